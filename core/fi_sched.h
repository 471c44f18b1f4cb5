/*
 * fi_sched.h - continuous batching over a paged KV cache with prefix reuse.
 *
 * A scheduler owns one pool of KV-cache blocks (fi_kvpool) sized by a
 * memory budget and runs many sequences of one model together: every call
 * of fi_sched_step is one forward pass holding one token of every decoding
 * sequence plus chunks of the prompts of newcomers (chunked prefill, so
 * running sequences keep producing tokens while a long prompt is read).
 * The weights are read once per step, whatever the number of sequences.
 *
 * Blocks: a sequence holds a table of blocks of FI_KV_BLOCK positions.
 * A full block is registered in the prefix cache under the hash of its
 * tokens chained to the hash of the block before it; the chain starts from
 * a salt made of the tenant and the residency zone, so two tenants or two
 * zones never share cached state even with identical prompts. A new
 * sequence whose leading blocks are in the cache takes them (reference
 * counted) and skips their prefill; unused cached blocks are evicted least
 * recently used first.
 *
 * When the pool is full: newcomers wait in the queue; a running sequence
 * that needs a block and finds none preempts the youngest running sequence
 * (its blocks are released and it is queued again, to be recomputed from
 * its prompt and the tokens it had produced). A request that cannot fit
 * the pool even alone is refused at submission. Nothing fails for memory
 * once the scheduler exists.
 *
 * Threads: a scheduler is used by one thread at a time (the serving loop
 * of its owner). Callbacks run on that thread, inside fi_sched_step.
 */
#ifndef FI_SCHED_H
#define FI_SCHED_H

#include <stddef.h>
#include <stdint.h>

#include "fi_model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_sched_opts {
    size_t kv_bytes;     /* KV pool budget; 0: 256 MiB (capped by n_ctx * max_seqs) */
    int max_seqs;        /* sequences in the running batch; 0: 64 */
    int step_tokens;     /* tokens per forward pass (decode + prefill); 0: 256 */
    int n_ctx;           /* positions per sequence at most; 0: the model's (<= 8192) */
    int no_prefix_cache; /* 1: never reuse blocks across sequences */
    /* Runs each step's batch instead of fi_model_forward(m, kv, b, NULL,
     * NULL, logits, ...): a shard group's leader sends the batch to the
     * other ranks and runs its own slice. NULL: fi_model_forward. */
    int (*forward)(void *user, fi_model *m, fi_kvpool *kv, const fi_batch *b, float *logits,
                   char *err, size_t errlen);
    void *forward_user;
} fi_sched_opts;

typedef struct fi_sched fi_sched;

fi_sched *fi_sched_new(fi_model *m, const fi_sched_opts *o, char *err, size_t errlen);
void fi_sched_destroy(fi_sched **s);
fi_model *fi_sched_model(const fi_sched *s);
/* The pool the scheduler owns (shard groups pass its block tables on). */
fi_kvpool *fi_sched_kvpool(fi_sched *s);

/* Called once per request when it ends (after its last on_text): res is
 * always filled; error is NULL, or why it failed (then res->stop is
 * meaningless). */
typedef void (*fi_done_fn)(void *user, const fi_gen_result *res, const char *error);

typedef struct fi_sched_req {
    const int32_t *prompt; /* copied at submission */
    int n_prompt;
    fi_gen_opts gen;       /* max_tokens, sampling, stop strings (copied), on_text */
    fi_done_fn on_done;    /* may be NULL; gets gen.user */
    const char *tenant;    /* prefix-cache salt: tenant (NULL = "") */
    const char *zone;      /* prefix-cache salt: residency zone (NULL = "") */
} fi_sched_req;

/* Queues a request; returns its id (> 0), or -1 with a message in err
 * (empty prompt, a token outside the vocabulary, a prompt or prompt +
 * max_tokens that cannot fit n_ctx or the whole pool). Nothing runs until
 * fi_sched_step. */
int64_t fi_sched_submit(fi_sched *s, const fi_sched_req *r, char *err, size_t errlen);
/* Ends a request at the next step with FI_STOP_CANCEL (its on_done is
 * called then). 0, or -1 when no such request is pending. */
int fi_sched_cancel(fi_sched *s, int64_t id);

/* One iteration: admits queued requests while blocks and batch room last,
 * runs one forward pass, samples, streams text, retires finished
 * sequences. Returns the number of requests still pending (0: idle), or -1
 * with a message in err when the backend failed (every pending request is
 * then ended with that error through on_done). */
int fi_sched_step(fi_sched *s, char *err, size_t errlen);
int fi_sched_pending(const fi_sched *s);
/* Drops every cached block nobody holds (their contents are no longer to
 * be trusted: a shard group lost a rank's KV state, say). Running
 * sequences keep theirs. */
void fi_sched_forget_cache(fi_sched *s);

typedef struct fi_sched_stats {
    int running;              /* sequences in the batch */
    int queued;               /* waiting for admission (incl. preempted) */
    int blocks_total;
    int blocks_free;          /* unused, including evictable cached ones */
    int blocks_cached;        /* registered in the prefix cache */
    int prefix_slots;         /* the prefix table's slots (at least 2 x blocks_total) */
    int prefix_slots_used;    /* of those, not empty (= blocks_cached): a lookup that
                                 misses probes a run of these */
    uint64_t steps;           /* forward passes */
    uint64_t prompt_tokens;   /* prompt tokens of admitted sequences */
    uint64_t prefix_hit_tokens; /* of those, taken from the prefix cache */
    uint64_t prefill_tokens;  /* tokens computed as prompt (incl. recompute) */
    uint64_t decode_tokens;   /* tokens computed while decoding */
    uint64_t preemptions;
    uint64_t evictions;       /* cached blocks reused for other data */
    uint64_t completed;
} fi_sched_stats;
void fi_sched_get_stats(const fi_sched *s, fi_sched_stats *st);

/* --- prefix hashes, shared with routers ---------------------------------
 * fi_prefix_hashes computes the chain hashes of the first full blocks of a
 * token sequence, exactly as the scheduler keys its cache: out[i] covers
 * blocks 0..i. Returns how many were written (<= max). A router holding the
 * model's tokenizer hashes a request's prompt and asks which replica holds
 * the longest chain; it hashes all but the prompt's last token, as the
 * scheduler always computes that one (it needs its logits) and so never
 * takes a block that holds it from the cache. */
int fi_prefix_hashes(const char *tenant, const char *zone, const int32_t *toks, int n,
                     uint64_t *out, int max);

/* A compact summary of the cached chains: a Bloom filter
 * (FI_PREFIX_FILTER_PROBES probes) of the hashes of every cached block,
 * nbytes long (a power of two, FI_PREFIX_FILTER_MIN..MAX). Returns 0, or
 * -1 for a bad size. With a bad size, fi_prefix_filter_add does nothing
 * and fi_prefix_filter_has and _match find nothing. A filter whose bits
 * are a fraction `fill` set answers a hash it does not hold with
 * probability about fill^FI_PREFIX_FILTER_PROBES. */
#define FI_PREFIX_FILTER_PROBES 3
#define FI_PREFIX_FILTER_MIN 64
#define FI_PREFIX_FILTER_MAX 65536
int fi_sched_prefix_filter(const fi_sched *s, uint8_t *bits, size_t nbytes);
/* The size of the prefix filter of a pool of `blocks` KV blocks (its
 * blocks_total; fewer than 0 count as 0): FI_PREFIX_FILTER_BITS_PER_BLOCK
 * bits per block, rounded up to a power of two and clamped to
 * FI_PREFIX_FILTER_MIN..MAX bytes. With every block cached, such a filter
 * is at most 26% full and answers a hash it does not hold with
 * probability at most about (1 - e^(-3/10))^3, 1.7%; a fixed size instead
 * fills up on a large pool until it claims every prompt. Past 52428
 * blocks it is 64 KiB, with fewer bits per block. */
#define FI_PREFIX_FILTER_BITS_PER_BLOCK 10
size_t fi_prefix_filter_bytes(int blocks);
void fi_prefix_filter_add(uint8_t *bits, size_t nbytes, uint64_t h);
int fi_prefix_filter_has(const uint8_t *bits, size_t nbytes, uint64_t h);
/* How many leading hashes of h[0..n) the filter holds (stops at the first
 * miss): the expected prefix hit in blocks. */
int fi_prefix_filter_match(const uint8_t *bits, size_t nbytes, const uint64_t *h, int n);

#ifdef __cplusplus
}
#endif
#endif /* FI_SCHED_H */
