/*
 * sched.c - continuous batching over a paged KV cache with prefix reuse.
 * See fi_sched.h for the behaviour; this file's parts, in order:
 *
 *   blocks     the pool's blocks: reference counts, a free stack, the LRU
 *              list of cached blocks nobody uses (evicted head first), and
 *              the prefix table (open addressing on the chain hash).
 *   sequences  a request: its tokens (prompt, then what it generated), its
 *              block table, how many tokens have their KV computed, its
 *              sampler and text stream.
 *   step       admit, make room, build one batch, run it, sample, retire.
 *
 * A chain hash is BLAKE2b-128 over the previous block's hash and the
 * block's tokens; the first block's "previous hash" is the salt,
 * BLAKE2b-128(tenant, zone). A cached block also keeps its tokens and its
 * parent block's hash, and a lookup compares both, so only the same tokens
 * after the same prefix under the same salt ever match.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sodium.h>

#include "fi_sched.h"
#include "fi_textstream.h"
#include "gen_impl.h"

#define S_HASH 16 /* bytes of a chain hash */

enum { S_QUEUED, S_RUNNING };

typedef struct s_block {
    int ref;                       /* sequences holding it */
    int cached;                    /* in the prefix table */
    int lru_prev, lru_next;        /* in the LRU list (ref 0 and cached) */
    uint8_t hash[S_HASH];          /* chain hash (cached) */
    uint8_t parent[S_HASH];        /* the previous block's chain hash */
    int32_t toks[FI_KV_BLOCK];     /* its tokens (cached) */
} s_block;

typedef struct s_seq {
    int64_t id;
    int state;
    uint64_t order;          /* admission order: the youngest is preempted */
    int32_t *toks;           /* prompt, then generated tokens */
    int n_toks, cap;
    int n_prompt;            /* of the original request */
    int n_done;              /* tokens whose KV is in the cache */
    int32_t *table;          /* block ids, max_blocks */
    int n_blocks;            /* blocks held */
    int n_hashed;            /* leading blocks whose chain hash is known */
    uint8_t salt[S_HASH];
    uint8_t chain[S_HASH];   /* hash of block n_hashed-1 (salt when 0) */
    int cancel;
    /* generation */
    int max_tokens, n_generated;
    int greedy;
    fi_sampler *smp;
    fi_textstream *ts;
    fi_text_fn on_text;
    fi_done_fn on_done;
    void *user;
    double t_admit, t_first;
    int prompt_seen;         /* prefix-hit and prompt counters taken */
    int decoding;            /* its next token to compute is a newly sampled one (a
                                decode token); 0 for the prompt and for a recompute */
    struct s_seq *next;      /* queue or running list */
} s_seq;

struct fi_sched {
    fi_model *m;
    int closing;             /* fi_sched_destroy has begun: no submissions */
    fi_kvpool *kv;
    fi_sched_opts o;
    int n_ctx, max_blocks, n_vocab;
    /* blocks */
    s_block *blk;
    int n_blk;
    int32_t *free_stack;
    int n_free;
    int lru_head, lru_tail, n_lru;
    int32_t *table;          /* prefix table: block ids, -1 empty (linear probing) */
    size_t table_cap;        /* a power of two */
    int table_used;          /* slots not empty */
    int n_cached;
    /* sequences */
    s_seq *queue;            /* waiting, in order (preempted ones first) */
    s_seq *running;          /* in admission order */
    int n_running, n_queued;
    int64_t next_id;
    uint64_t next_order;
    /* one step's batch, host */
    int32_t *b_tok, *b_pos, *b_seq, *b_rows, *b_tables;
    int32_t *b_argmax;       /* each logit row's argmax (fi_batch.argmax), or -1 */
    s_seq **b_seqs;          /* sequences in the batch */
    int *b_count;            /* tokens each contributes */
    float *logits;           /* max_seqs rows */
    fi_sched_stats st;
};

static void s_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* --- hashes ----------------------------------------------------------- */

static void s_salt(const char *tenant, const char *zone, uint8_t out[S_HASH]) {
    crypto_generichash_state st;
    static const char tag[] = "fedinfer prefix v1";
    const char *t = tenant ? tenant : "", *z = zone ? zone : "";
    crypto_generichash_init(&st, NULL, 0, S_HASH);
    crypto_generichash_update(&st, (const unsigned char *)tag, sizeof tag);
    /* lengths first: ("ab", "c") and ("a", "bc") differ */
    uint64_t lens[2] = {strlen(t), strlen(z)};
    crypto_generichash_update(&st, (const unsigned char *)lens, sizeof lens);
    crypto_generichash_update(&st, (const unsigned char *)t, lens[0]);
    crypto_generichash_update(&st, (const unsigned char *)z, lens[1]);
    crypto_generichash_final(&st, out, S_HASH);
}

static void s_chain(const uint8_t prev[S_HASH], const int32_t *toks, uint8_t out[S_HASH]) {
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, S_HASH);
    crypto_generichash_update(&st, prev, S_HASH);
    crypto_generichash_update(&st, (const unsigned char *)toks, FI_KV_BLOCK * sizeof(int32_t));
    crypto_generichash_final(&st, out, S_HASH);
}

static uint64_t s_h64(const uint8_t h[S_HASH]) {
    uint64_t v;
    memcpy(&v, h, sizeof v);
    return v;
}

int fi_prefix_hashes(const char *tenant, const char *zone, const int32_t *toks, int n,
                     uint64_t *out, int max) {
    uint8_t h[S_HASH];
    if (sodium_init() < 0) return 0;
    s_salt(tenant, zone, h);
    int k = 0;
    for (; k < max && (k + 1) * FI_KV_BLOCK <= n; k++) {
        s_chain(h, toks + (size_t)k * FI_KV_BLOCK, h);
        out[k] = s_h64(h);
    }
    return k;
}

static int s_filter_size_ok(size_t nbytes) {
    return nbytes >= FI_PREFIX_FILTER_MIN && nbytes <= FI_PREFIX_FILTER_MAX &&
           (nbytes & (nbytes - 1)) == 0;
}

size_t fi_prefix_filter_bytes(int blocks) {
    uint64_t bits = (uint64_t)(blocks > 0 ? blocks : 0) * FI_PREFIX_FILTER_BITS_PER_BLOCK;
    size_t n = FI_PREFIX_FILTER_MIN;
    while (n < FI_PREFIX_FILTER_MAX && (uint64_t)n * 8 < bits) n *= 2;
    return n;
}

/* Probe i of hash h in a filter of nb bits (a power of two): double
 * hashing over h's two halves, (h + i * h2) mod nb with h2 the high half
 * (odd, so that the probes differ). A chain hash is uniform, so the
 * halves are independent. h2 must not come from h's low bits (it was
 * h * constant): every probe was then a function of h mod nb, and the
 * filter answered as one probe does: a hash it does not hold matched
 * with probability about n/nb for n hashes added (10% of them at 10 bits
 * a hash), not about fill^3 (under 2%). */
static uint64_t s_probe(uint64_t h, int i, uint64_t nb) {
    uint64_t h2 = (h >> 32) | 1;
    return (h + (uint64_t)i * h2) & (nb - 1);
}

void fi_prefix_filter_add(uint8_t *bits, size_t nbytes, uint64_t h) {
    if (!s_filter_size_ok(nbytes)) return;
    for (int i = 0; i < FI_PREFIX_FILTER_PROBES; i++) {
        uint64_t b = s_probe(h, i, (uint64_t)nbytes * 8);
        bits[b >> 3] |= (uint8_t)(1u << (b & 7));
    }
}

int fi_prefix_filter_has(const uint8_t *bits, size_t nbytes, uint64_t h) {
    if (!s_filter_size_ok(nbytes)) return 0;
    for (int i = 0; i < FI_PREFIX_FILTER_PROBES; i++) {
        uint64_t b = s_probe(h, i, (uint64_t)nbytes * 8);
        if (!(bits[b >> 3] & (1u << (b & 7)))) return 0;
    }
    return 1;
}

int fi_prefix_filter_match(const uint8_t *bits, size_t nbytes, const uint64_t *h, int n) {
    if (!s_filter_size_ok(nbytes)) return 0;
    int k = 0;
    while (k < n && fi_prefix_filter_has(bits, nbytes, h[k])) k++;
    return k;
}

int fi_sched_prefix_filter(const fi_sched *s, uint8_t *bits, size_t nbytes) {
    if (!s_filter_size_ok(nbytes)) return -1;
    memset(bits, 0, nbytes);
    for (int i = 0; i < s->n_blk; i++)
        if (s->blk[i].cached) fi_prefix_filter_add(bits, nbytes, s_h64(s->blk[i].hash));
    return 0;
}

/* --- blocks ----------------------------------------------------------- */

static void s_lru_unlink(fi_sched *s, int b) {
    s_block *k = &s->blk[b];
    if (k->lru_prev >= 0) s->blk[k->lru_prev].lru_next = k->lru_next;
    else s->lru_head = k->lru_next;
    if (k->lru_next >= 0) s->blk[k->lru_next].lru_prev = k->lru_prev;
    else s->lru_tail = k->lru_prev;
    k->lru_prev = k->lru_next = -1;
    s->n_lru--;
}

static void s_lru_push(fi_sched *s, int b) {
    s_block *k = &s->blk[b];
    k->lru_prev = s->lru_tail;
    k->lru_next = -1;
    if (s->lru_tail >= 0) s->blk[s->lru_tail].lru_next = b;
    else s->lru_head = b;
    s->lru_tail = b;
    s->n_lru++;
}

static size_t s_slot0(const fi_sched *s, const uint8_t h[S_HASH]) {
    return (size_t)s_h64(h) & (s->table_cap - 1);
}

/* The cached block with this hash, parent and tokens, or -1. */
static int s_lookup(const fi_sched *s, const uint8_t h[S_HASH], const uint8_t parent[S_HASH],
                    const int32_t *toks) {
    for (size_t i = s_slot0(s, h), n = 0; n < s->table_cap; i = (i + 1) & (s->table_cap - 1), n++) {
        int32_t b = s->table[i];
        if (b == -1) return -1;
        const s_block *k = &s->blk[b];
        if (!memcmp(k->hash, h, S_HASH) && !memcmp(k->parent, parent, S_HASH) &&
            !memcmp(k->toks, toks, sizeof k->toks))
            return b;
    }
    return -1;
}

/* Deletion shifts the later entries of the probe run back into the hole
 * (no "deleted" marks: with them every slot ends up marked after enough
 * churn, and each lookup that misses, the common case, then probes the
 * whole table). An entry at j may move to the hole at i only if its home
 * slot is not in (i, j]. */
static void s_table_remove(fi_sched *s, int b) {
    const size_t mask = s->table_cap - 1;
    size_t i = s_slot0(s, s->blk[b].hash);
    while (s->table[i] != b) {
        if (s->table[i] == -1) return;
        i = (i + 1) & mask;
    }
    for (size_t j = i;;) {
        j = (j + 1) & mask;
        if (s->table[j] == -1) break;
        size_t home = s_slot0(s, s->blk[s->table[j]].hash);
        if (((j - home) & mask) >= ((j - i) & mask)) {
            s->table[i] = s->table[j];
            i = j;
        }
    }
    s->table[i] = -1;
    s->table_used--;
}

static void s_table_insert(fi_sched *s, int b) {
    size_t i = s_slot0(s, s->blk[b].hash);
    while (s->table[i] != -1) i = (i + 1) & (s->table_cap - 1);
    s->table[i] = b;
    s->table_used++;
}

/* Blocks an allocation can get: free ones and cached ones nobody uses. */
static int s_available(const fi_sched *s) { return s->n_free + s->n_lru; }

/* A block for new data (ref 1), or -1 when the pool is exhausted. */
static int s_alloc_block(fi_sched *s) {
    int b;
    if (s->n_free > 0) {
        b = s->free_stack[--s->n_free];
    } else if (s->lru_head >= 0) {
        b = s->lru_head; /* least recently used cached block */
        s_lru_unlink(s, b);
        s_table_remove(s, b);
        s->blk[b].cached = 0;
        s->n_cached--;
        s->st.evictions++;
    } else {
        return -1;
    }
    s->blk[b].ref = 1;
    return b;
}

static void s_release_block(fi_sched *s, int b) {
    s_block *k = &s->blk[b];
    if (--k->ref > 0) return;
    if (k->cached) s_lru_push(s, b);
    else s->free_stack[s->n_free++] = b;
}

/* Takes a cached block for a new holder. */
static void s_take_block(fi_sched *s, int b) {
    if (s->blk[b].ref++ == 0) s_lru_unlink(s, b);
}

/* --- sequences -------------------------------------------------------- */

static void s_seq_free(s_seq *q) {
    if (!q) return;
    fi_sampler_destroy(&q->smp);
    fi_textstream_destroy(&q->ts);
    free(q->toks);
    free(q->table);
    free(q);
}

static void s_seq_release_blocks(fi_sched *s, s_seq *q) {
    /* last block first: a chain's later blocks reach the LRU's head, and are
     * evicted, before its first, without which none of them is found */
    for (int i = q->n_blocks - 1; i >= 0; i--) s_release_block(s, q->table[i]);
    q->n_blocks = 0;
    q->n_done = 0;
    q->decoding = 0; /* what it had is computed again, as prompt */
    q->n_hashed = 0;
    memcpy(q->chain, q->salt, S_HASH);
}

/* Registers the sequence's newly completed full blocks in the prefix
 * table (when the cache is on). */
static void s_seq_register(fi_sched *s, s_seq *q) {
    while ((q->n_hashed + 1) * FI_KV_BLOCK <= q->n_done) {
        int b = q->table[q->n_hashed];
        uint8_t h[S_HASH];
        const int32_t *toks = q->toks + (size_t)q->n_hashed * FI_KV_BLOCK;
        s_chain(q->chain, toks, h);
        s_block *k = &s->blk[b];
        if (!s->o.no_prefix_cache && !k->cached && s_lookup(s, h, q->chain, toks) < 0) {
            memcpy(k->hash, h, S_HASH);
            memcpy(k->parent, q->chain, S_HASH);
            memcpy(k->toks, toks, sizeof k->toks);
            k->cached = 1;
            s->n_cached++;
            s_table_insert(s, b);
        }
        memcpy(q->chain, h, S_HASH);
        q->n_hashed++;
    }
}

/* Finishes a sequence: unlinks nothing (the caller did), releases its
 * blocks, calls on_done, frees it. */
static void s_seq_finish(fi_sched *s, s_seq *q, fi_stop_reason why, const char *error) {
    fi_gen_result r = {0};
    if (!error && why != FI_STOP_CANCEL && fi_gen_emit(q->ts, q->on_text, q->user, 1))
        why = FI_STOP_CANCEL;
    r.n_prompt = q->n_prompt;
    r.n_generated = q->n_generated;
    r.stop = why;
    double now = s_now();
    if (q->t_admit > 0) r.prefill_s = (q->t_first > 0 ? q->t_first : now) - q->t_admit;
    if (q->t_first > 0) r.decode_s = now - q->t_first;
    s_seq_release_blocks(s, q);
    s->st.completed++;
    if (q->on_done) q->on_done(q->user, &r, error);
    s_seq_free(q);
}

/* --- creation --------------------------------------------------------- */

fi_sched *fi_sched_new(fi_model *m, const fi_sched_opts *o, char *err, size_t errlen) {
    if (sodium_init() < 0) {
        s_err(err, errlen, "libsodium could not initialise");
        return NULL;
    }
    const fi_config *c = fi_model_config(m);
    fi_sched *s = calloc(1, sizeof *s);
    if (!s) {
        s_err(err, errlen, "out of memory");
        return NULL;
    }
    s->m = m;
    if (o) s->o = *o;
    if (s->o.max_seqs <= 0) s->o.max_seqs = 64;
    if (s->o.step_tokens <= 0) s->o.step_tokens = 256;
    if (s->o.step_tokens < s->o.max_seqs) s->o.step_tokens = s->o.max_seqs;
    if (s->o.kv_bytes == 0) s->o.kv_bytes = (size_t)256 << 20;
    s->n_ctx = s->o.n_ctx > 0 ? s->o.n_ctx : (c->ctx_train < 8192 ? c->ctx_train : 8192);
    if (s->n_ctx > c->ctx_train) {
        s_err(err, errlen, "context of %d tokens exceeds the model's trained context of %d",
              s->n_ctx, c->ctx_train);
        fi_sched_destroy(&s);
        return NULL;
    }
    s->max_blocks = (s->n_ctx + FI_KV_BLOCK - 1) / FI_KV_BLOCK;
    s->n_vocab = c->n_vocab;
    size_t per = fi_kv_block_bytes(m);
    size_t want = s->o.kv_bytes / (per ? per : 1);
    size_t most = (size_t)s->max_blocks * (size_t)s->o.max_seqs;
    if (want > most) want = most;
    if (want > (1u << 24)) want = 1u << 24;
    if (want < 1) {
        s_err(err, errlen, "KV budget of %zu bytes is less than one block of %zu bytes",
              s->o.kv_bytes, per);
        fi_sched_destroy(&s);
        return NULL;
    }
    s->n_blk = (int)want;
    char why[256];
    s->kv = fi_kvpool_new(m, s->n_blk, s->o.step_tokens, s->o.max_seqs, why, sizeof why);
    if (!s->kv) {
        s_err(err, errlen, "scheduler: %s", why);
        fi_sched_destroy(&s);
        return NULL;
    }
    s->table_cap = 64;
    while (s->table_cap < (size_t)s->n_blk * 2) s->table_cap <<= 1;
    int S = s->o.step_tokens, N = s->o.max_seqs;
    s->blk = calloc((size_t)s->n_blk, sizeof *s->blk);
    s->free_stack = malloc((size_t)s->n_blk * sizeof *s->free_stack);
    s->table = malloc(s->table_cap * sizeof *s->table);
    s->b_tok = malloc((size_t)S * sizeof(int32_t));
    s->b_pos = malloc((size_t)S * sizeof(int32_t));
    s->b_seq = malloc((size_t)S * sizeof(int32_t));
    s->b_rows = malloc((size_t)N * sizeof(int32_t));
    s->b_argmax = malloc((size_t)N * sizeof(int32_t));
    s->b_tables = malloc((size_t)N * (size_t)s->max_blocks * sizeof(int32_t));
    s->b_seqs = malloc((size_t)N * sizeof *s->b_seqs);
    s->b_count = malloc((size_t)N * sizeof *s->b_count);
    s->logits = malloc((size_t)N * (size_t)s->n_vocab * sizeof(float));
    if (!s->blk || !s->free_stack || !s->table || !s->b_tok || !s->b_pos || !s->b_seq ||
        !s->b_rows || !s->b_argmax || !s->b_tables || !s->b_seqs || !s->b_count || !s->logits) {
        s_err(err, errlen, "out of memory for the scheduler");
        fi_sched_destroy(&s);
        return NULL;
    }
    for (size_t i = 0; i < s->table_cap; i++) s->table[i] = -1;
    for (int i = 0; i < s->n_blk; i++) {
        s->blk[i].lru_prev = s->blk[i].lru_next = -1;
        s->free_stack[i] = s->n_blk - 1 - i; /* block 0 first */
    }
    s->n_free = s->n_blk;
    s->lru_head = s->lru_tail = -1;
    s->next_id = 1;
    return s;
}

/* Ends every request with error. The lists are taken off the scheduler
 * first: a request that an on_done submits (a client's retry) waits for
 * the next step instead of being failed by this pass's error, or looping. */
static void s_fail_all(fi_sched *s, const char *error) {
    s_seq *l[2] = {s->running, s->queue};
    s->running = s->queue = NULL;
    s->n_running = s->n_queued = 0;
    for (int i = 0; i < 2; i++)
        while (l[i]) {
            s_seq *q = l[i];
            l[i] = q->next;
            s_seq_finish(s, q, FI_STOP_CANCEL, error);
        }
}

void fi_sched_destroy(fi_sched **sp) {
    if (!sp || !*sp) return;
    fi_sched *s = *sp;
    s->closing = 1;
    s_fail_all(s, "the scheduler is shutting down");
    fi_kvpool_destroy(&s->kv);
    free(s->blk);
    free(s->free_stack);
    free(s->table);
    free(s->b_tok);
    free(s->b_pos);
    free(s->b_seq);
    free(s->b_rows);
    free(s->b_argmax);
    free(s->b_tables);
    free(s->b_seqs);
    free(s->b_count);
    free(s->logits);
    free(s);
    *sp = NULL;
}

fi_model *fi_sched_model(const fi_sched *s) { return s->m; }
fi_kvpool *fi_sched_kvpool(fi_sched *s) { return s->kv; }
int fi_sched_pending(const fi_sched *s) { return s->n_running + s->n_queued; }

void fi_sched_forget_cache(fi_sched *s) {
    for (int b = 0; b < s->n_blk; b++) {
        s_block *k = &s->blk[b];
        if (!k->cached) continue;
        s_table_remove(s, b);
        k->cached = 0;
        s->n_cached--;
        if (k->ref == 0) {
            s_lru_unlink(s, b);
            s->free_stack[s->n_free++] = b;
        }
    }
}

void fi_sched_get_stats(const fi_sched *s, fi_sched_stats *st) {
    *st = s->st;
    st->running = s->n_running;
    st->queued = s->n_queued;
    st->blocks_total = s->n_blk;
    st->blocks_free = s_available(s);
    st->blocks_cached = s->n_cached;
    st->prefix_slots = (int)s->table_cap;
    st->prefix_slots_used = s->table_used;
}

/* --- submission ------------------------------------------------------- */

int64_t fi_sched_submit(fi_sched *s, const fi_sched_req *r, char *err, size_t errlen) {
    const fi_gen_opts *g = &r->gen;
    if (s->closing) {
        s_err(err, errlen, "the scheduler is shutting down");
        return -1;
    }
    if (!r->prompt || r->n_prompt <= 0) {
        s_err(err, errlen, "empty prompt");
        return -1;
    }
    if (g->max_tokens < 0) {
        s_err(err, errlen, "max_tokens must be >= 0, not %d", g->max_tokens);
        return -1;
    }
    for (int i = 0; i < r->n_prompt; i++) {
        if (r->prompt[i] < 0 || r->prompt[i] >= s->n_vocab) {
            s_err(err, errlen, "token %d at index %d is outside the vocabulary of %d",
                  r->prompt[i], i, s->n_vocab);
            return -1;
        }
    }
    if (r->n_prompt > s->n_ctx) {
        s_err(err, errlen, "prompt of %d tokens does not fit the context of %d", r->n_prompt,
              s->n_ctx);
        return -1;
    }
    /* Whatever it generates must fit the pool with nobody else there:
     * then preemption can always make room for it. */
    long need = (long)r->n_prompt + g->max_tokens;
    if (need > s->n_ctx) need = s->n_ctx;
    long room = (long)s->n_blk * FI_KV_BLOCK;
    if (need > room) {
        s_err(err, errlen,
              "prompt of %d tokens plus max_tokens %d needs %ld KV positions; the pool holds %ld",
              r->n_prompt, g->max_tokens, need, room);
        return -1;
    }
    s_seq *q = calloc(1, sizeof *q);
    if (!q) goto oom;
    q->cap = (int)(need + 1);
    q->toks = malloc((size_t)q->cap * sizeof *q->toks);
    q->table = malloc((size_t)s->max_blocks * sizeof *q->table);
    q->smp = fi_sampler_new(&g->sampling, s->n_vocab);
    if (q->smp) fi_sampler_prompt_len(q->smp, r->n_prompt);
    q->ts = fi_textstream_new(g->stop, g->n_stop);
    if (!q->toks || !q->table || !q->smp || !q->ts) goto oom;
    memcpy(q->toks, r->prompt, (size_t)r->n_prompt * sizeof *q->toks);
    q->n_toks = q->n_prompt = r->n_prompt;
    q->max_tokens = g->max_tokens;
    q->greedy = fi_gen_is_greedy(&g->sampling);
    q->on_text = g->on_text;
    q->on_done = r->on_done;
    q->user = g->user;
    s_salt(r->tenant, r->zone, q->salt);
    memcpy(q->chain, q->salt, S_HASH);
    q->id = s->next_id++;
    q->state = S_QUEUED;
    s_seq **pp = &s->queue; /* to the end of the queue */
    while (*pp) pp = &(*pp)->next;
    *pp = q;
    s->n_queued++;
    return q->id;
oom:
    s_seq_free(q);
    s_err(err, errlen, "out of memory");
    return -1;
}

int fi_sched_cancel(fi_sched *s, int64_t id) {
    for (s_seq *q = s->running; q; q = q->next)
        if (q->id == id) return q->cancel = 1, 0;
    for (s_seq *q = s->queue; q; q = q->next)
        if (q->id == id) return q->cancel = 1, 0;
    return -1;
}

/* --- one step --------------------------------------------------------- */

/* Takes the longest cached prefix of q's tokens (leaving at least one
 * token to compute, whose logits the sequence needs). */
static int s_match_prefix(fi_sched *s, s_seq *q) {
    if (s->o.no_prefix_cache) return 0;
    int full = (q->n_toks - 1) / FI_KV_BLOCK, k = 0;
    uint8_t h[S_HASH], prev[S_HASH];
    memcpy(prev, q->salt, S_HASH);
    for (; k < full; k++) {
        const int32_t *toks = q->toks + (size_t)k * FI_KV_BLOCK;
        s_chain(prev, toks, h);
        int b = s_lookup(s, h, prev, toks);
        if (b < 0) break;
        s_take_block(s, b);
        q->table[k] = b;
        memcpy(prev, h, S_HASH);
    }
    q->n_blocks = q->n_hashed = k;
    q->n_done = k * FI_KV_BLOCK;
    memcpy(q->chain, prev, S_HASH);
    return k;
}

/* Blocks the sequence's first `upto` tokens need. */
static int s_blocks_for(int upto) { return (upto + FI_KV_BLOCK - 1) / FI_KV_BLOCK; }

/* Tries to admit the queue's head: its cached prefix plus blocks for all
 * its tokens. 1 admitted, 0 not now. */
static int s_admit_one(fi_sched *s) {
    s_seq *q = s->queue;
    if (!q || s->n_running >= s->o.max_seqs) return 0;
    int hit = s_match_prefix(s, q);
    int need = s_blocks_for(q->n_toks) - q->n_blocks;
    /* keep what the running sequences need for their next tokens */
    int reserve = 0;
    for (s_seq *r = s->running; r; r = r->next)
        reserve += s_blocks_for(r->n_toks + 1) - r->n_blocks;
    if (need + reserve > s_available(s)) {
        s_seq_release_blocks(s, q); /* gives the matched blocks back */
        return 0;
    }
    for (int i = 0; i < need; i++) q->table[q->n_blocks++] = s_alloc_block(s);
    if (!q->prompt_seen) {
        q->prompt_seen = 1;
        s->st.prompt_tokens += (uint64_t)q->n_prompt;
        int reused = hit * FI_KV_BLOCK;
        s->st.prefix_hit_tokens += (uint64_t)(reused < q->n_prompt ? reused : q->n_prompt);
        q->t_admit = s_now();
    }
    s->queue = q->next;
    s->n_queued--;
    q->next = NULL;
    q->state = S_RUNNING;
    q->order = s->next_order++;
    s_seq **pp = &s->running;
    while (*pp) pp = &(*pp)->next;
    *pp = q;
    s->n_running++;
    return 1;
}

/* Puts the youngest running sequence back at the head of the queue,
 * releasing its blocks (it will be recomputed). */
static s_seq *s_preempt_youngest(fi_sched *s) {
    s_seq **pp = &s->running, **young = NULL;
    for (; *pp; pp = &(*pp)->next)
        if (!young || (*pp)->order > (*young)->order) young = pp;
    if (!young) return NULL;
    s_seq *q = *young;
    *young = q->next;
    s->n_running--;
    s_seq_release_blocks(s, q);
    q->state = S_QUEUED;
    q->next = s->queue;
    s->queue = q;
    s->n_queued++;
    s->st.preemptions++;
    return q;
}

/* Makes sure every running sequence has a block for its next token,
 * preempting the youngest while the pool is short. */
static void s_make_room(fi_sched *s) {
    for (;;) {
        s_seq *short_of = NULL;
        for (s_seq *q = s->running; q; q = q->next)
            if (s_blocks_for(q->n_toks) > q->n_blocks) {
                if (s_available(s) > 0) q->table[q->n_blocks++] = s_alloc_block(s);
                else {
                    short_of = q;
                    break;
                }
            }
        if (!short_of) return;
        s_preempt_youngest(s); /* maybe short_of itself: it waits then */
    }
}

/* Retires a running sequence (unlinks it first). */
static void s_retire(fi_sched *s, s_seq *q, fi_stop_reason why, const char *error) {
    for (s_seq **pp = &s->running; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            s->n_running--;
            break;
        }
    s_seq_finish(s, q, why, error);
}

/* After its logits: the next token of q. 1 when q goes on, 0 when it was
 * retired, -1 on failure (q retired with the error). */
static int s_after_logits(fi_sched *s, s_seq *q, float *logits, int32_t argmax) {
    const fi_tok *tok = fi_model_tok(s->m);
    if (q->t_first == 0) q->t_first = s_now();
    if (q->n_generated >= q->max_tokens) {
        s_retire(s, q, FI_STOP_LENGTH, NULL);
        return 0;
    }
    int32_t id;
    if (q->greedy) {
        /* the forward pass's argmax of the row, where it gave one */
        id = argmax >= 0 ? argmax : fi_argmax(logits, s->n_vocab);
    } else {
        id = fi_sampler_sample(q->smp, logits, q->toks, q->n_toks);
    }
    q->n_generated++;
    if (fi_tok_is_eog(tok, id)) {
        s_retire(s, q, FI_STOP_EOG, NULL);
        return 0;
    }
    char err[160];
    int hit = fi_gen_push_token(tok, q->ts, id, err, sizeof err);
    if (hit < 0) {
        s_retire(s, q, FI_STOP_CANCEL, err);
        return -1;
    }
    if (hit) {
        s_retire(s, q, FI_STOP_STRING, NULL);
        return 0;
    }
    if (fi_gen_emit(q->ts, q->on_text, q->user, 0)) {
        s_retire(s, q, FI_STOP_CANCEL, NULL);
        return 0;
    }
    if (q->n_generated >= q->max_tokens) {
        s_retire(s, q, FI_STOP_LENGTH, NULL);
        return 0;
    }
    if (q->n_toks >= s->n_ctx || q->n_toks >= q->cap) {
        s_retire(s, q, FI_STOP_CONTEXT, NULL);
        return 0;
    }
    q->toks[q->n_toks++] = id; /* computed at the next step */
    q->decoding = 1;
    return 1;
}

int fi_sched_step(fi_sched *s, char *err, size_t errlen) {
    /* cancellations */
    for (s_seq *q = s->running, *nx; q; q = nx) {
        nx = q->next;
        if (q->cancel) s_retire(s, q, FI_STOP_CANCEL, NULL);
    }
    for (s_seq **pp = &s->queue; *pp;) {
        s_seq *q = *pp;
        if (!q->cancel) {
            pp = &q->next;
            continue;
        }
        *pp = q->next;
        s->n_queued--;
        s_seq_finish(s, q, FI_STOP_CANCEL, NULL);
    }
    while (s_admit_one(s)) {
    }
    s_make_room(s);
    if (!s->running) return fi_sched_pending(s);

    /* the batch: one token per decoding sequence, then prompt chunks */
    int n = 0, ns = 0, n_out = 0, budget = s->o.step_tokens;
    for (int pass = 0; pass < 2; pass++) {
        for (s_seq *q = s->running; q && budget > 0; q = q->next) {
            int pending = q->n_toks - q->n_done;
            int decoding = pending == 1;
            if (pending <= 0 || decoding != (pass == 0)) continue;
            int take = pending < budget ? pending : budget;
            for (int i = 0; i < take; i++) {
                s->b_tok[n + i] = q->toks[q->n_done + i];
                s->b_pos[n + i] = q->n_done + i;
                s->b_seq[n + i] = ns;
            }
            memcpy(s->b_tables + (size_t)ns * s->max_blocks, q->table,
                   (size_t)q->n_blocks * sizeof(int32_t));
            n += take;
            budget -= take;
            if (take == pending) s->b_rows[n_out++] = n - 1;
            s->b_seqs[ns] = q;
            s->b_count[ns++] = take;
            /* a prompt's (or recompute's) one last token is prefill too */
            if (decoding && q->decoding) s->st.decode_tokens++;
            else s->st.prefill_tokens += (uint64_t)take;
        }
    }
    /* rows must ascend: they do, tokens were appended in order */
    for (int i = 0; i < n_out; i++)
        s->b_argmax[i] = -1; /* a pass that gives none leaves them */
    fi_batch b = {.n = n, .tok = s->b_tok, .pos = s->b_pos, .seq = s->b_seq, .n_seqs = ns,
                  .tables = s->b_tables, .max_blocks = s->max_blocks, .out_rows = s->b_rows,
                  .n_out = n_out, .argmax = s->b_argmax};
    if (err && errlen) err[0] = 0; /* a hook that fails without a word says nothing stale */
    int rc = s->o.forward
                 ? s->o.forward(s->o.forward_user, s->m, s->kv, &b, s->logits, err, errlen)
                 : fi_model_forward(s->m, s->kv, &b, NULL, NULL, s->logits, err, errlen);
    if (rc != 0) {
        char why[256];
        snprintf(why, sizeof why, "%s", err && *err ? err : "the forward pass failed");
        s_fail_all(s, why);
        return -1;
    }
    s->st.steps++;
    int row = 0;
    for (int i = 0; i < ns; i++) {
        s_seq *q = s->b_seqs[i];
        q->n_done += s->b_count[i];
        s_seq_register(s, q);
        if (q->n_done == q->n_toks) {
            (void)s_after_logits(s, q, s->logits + (size_t)row * s->n_vocab, s->b_argmax[row]);
            row++;
        }
    }
    return fi_sched_pending(s);
}
