/*
 * fi_shard.h - a cluster worker: connects to the coordinator as a
 * cluster, announces the models it serves and their capacity, serves the
 * inference requests routed to it and streams tokens back.
 *
 * What generates text is a backend (a table of functions and a context,
 * like the compute backends): the engine (fi_shard_engine.c, a whole model
 * in one process) or, for tests and the benchmark, an echo backend that
 * needs no model. Requests are served one at a time in arrival order by
 * a generator thread; those that arrive meanwhile wait in a bounded queue.
 * The connection (heartbeats, cancellations) is served by the calling
 * thread all along, so a long prefill never looks like a dead worker.
 */
#ifndef FI_SHARD_H
#define FI_SHARD_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "fi_client.h"
#include "fi_conf.h"
#include "fi_model.h"
#include "fi_sched.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Called by a backend with each piece of text; returns nonzero when the
 * request must stop (cancelled, the link was lost, or the worker is
 * stopping). Backends run on the generator thread. */
typedef int (*fi_shard_emit_fn)(void *emit_user, const char *text, size_t len);

/* Where a batched backend sends one request's output: emit (text) and,
 * once, done (the end: error NULL, or why it failed), both with user and
 * both on the serving thread. Shaped as fi_sched's callbacks. */
typedef struct fi_shard_sink {
    fi_shard_emit_fn emit;
    void (*done)(void *user, const fi_gen_result *res, const char *error);
    void *user;
} fi_shard_sink;

typedef struct fi_shard_gen {
    uint32_t n_prompt;     /* prompt tokens */
    uint32_t n_generated;  /* generated tokens */
    char stop[32];         /* stop reason ("eog", "length", "cancel", ...) */
    uint32_t prefill_ms;   /* time on the prompt */
    uint32_t decode_ms;    /* time generating */
} fi_shard_gen;

typedef struct fi_shard_backend {
    const char *name; /* "engine", "echo" */
    /* Generates for rq, emitting text as it goes. 0, or -1 with a message
     * (sent to the requester as ERR_ENGINE). One request at a time; the
     * serving loop uses it when the backend is not batched (submit NULL). */
    int (*generate)(void *ctx, const Fi__InferRequest *rq, fi_shard_emit_fn emit,
                    void *emit_user, fi_shard_gen *out, char *err, size_t errlen);
    void (*destroy)(void *ctx); /* optional */
    void *ctx;                  /* the backend's state */
    /* Optional: the backend's prefix-cache summary for the router, into
     * bits (nbytes, a power of two of 64..65536: FI_SHARD_FILTER_BYTES
     * for a one-at-a-time backend, fi_prefix_filter_bytes of its pool for
     * a batched one): fi_sched_prefix_filter for a backend with a prefix
     * cache. 0, or -1 when it has none now. Called on the generator (or
     * serving) thread between requests (or steps). */
    int (*prefix_filter)(void *ctx, uint8_t *bits, size_t nbytes);
    /* Optional, a batched backend (the engine over fi_sched): every call on
     * one serving thread. submit queues rq (copied) and returns its id
     * (> 0), or -1 with a message (sink is not called then); cancel ends it
     * at the next step (its done still comes); step runs one batch and
     * returns how many requests are pending, or -1 with a message (every
     * pending request has then ended through done); load reports the
     * counters of fi_sched_stats. */
    int64_t (*submit)(void *ctx, const Fi__InferRequest *rq, const fi_shard_sink *sink,
                      char *err, size_t errlen);
    int (*cancel)(void *ctx, int64_t id);
    int (*step)(void *ctx, char *err, size_t errlen);
    void (*load)(void *ctx, uint32_t *running, uint32_t *queued, uint32_t *kv_free,
                 uint32_t *kv_total);
    /* Optional (NULL: always up): 0 while the engine is down (its backend
     * failed and is not yet replaced). The batched loop then withdraws the
     * model (capacity 0) so that the coordinator routes elsewhere, and
     * announces it again once up; submit refuses with -2 meanwhile (the
     * requester gets ERR_ENGINE). */
    int (*up)(void *ctx);
} fi_shard_backend;

/* Bytes of the prefix filter a one-at-a-time backend (fi_shard_serve's
 * generate; it reports no KV pool) is asked for. A batched backend's is
 * sized from the KV pool its load reports (fi_prefix_filter_bytes of the
 * blocks in all), and so is a shard group leader's: a fixed size fills up
 * on a large pool until the filter claims every prompt. */
#define FI_SHARD_FILTER_BYTES 1024

/* The echo backend: streams "echo: " and the prompt back in pieces of
 * piece_len bytes, waiting delay_ms before each (0: none). Its ctx is NULL
 * when out of memory. */
fi_shard_backend fi_shard_echo_backend(int piece_len, int delay_ms);

/* Serves requests from c with be until *stop is nonzero or the
 * coordinator refuses or revokes the key. Returns 0 on stop, -1 with a
 * message on refusal. max_queue bounds the waiting requests (batched: the
 * requests open at the backend). A batched backend (be->submit) is served
 * by fi_shard_serve_batched. */
int fi_shard_serve(fi_client *c, const fi_shard_backend *be, int max_queue, atomic_int *stop,
                   char *err, size_t errlen);
/* The serving loop of a batched backend (fi_shard_batch.c): the calling
 * thread owns the connection; one serving thread owns the backend and
 * calls submit, cancel and step; requests and cancellations reach it
 * through a pipe, so a client's disconnect (Cancel from the coordinator)
 * reaches the backend's cancel. */
int fi_shard_serve_batched(fi_client *c, const fi_shard_backend *be, int max_open,
                           atomic_int *stop, char *err, size_t errlen);

/* --- the `fedinfer shard` configuration ------------------------------ */
typedef struct fi_shard_conf {
    char coordinator[FI_CONF_STR_MAX];     /* fabric endpoint, tcp://host:7700 */
    char enrol_endpoint[FI_CONF_STR_MAX];  /* enrolment endpoint (for --enrol) */
    char coordinator_key[FI_CONF_STR_MAX]; /* the coordinator's public key file */
    char secret_key[FI_CONF_STR_MAX];      /* our secret key file */
    char model[FI_CONF_STR_MAX];           /* GGUF path */
    char model_sha256[FI_CONF_STR_MAX];    /* its expected SHA-256 ("": not checked) */
    char model_name[FI_CONF_STR_MAX];      /* name requests ask for */
    char site[FI_CONF_STR_MAX];            /* for --enrol */
    char region[FI_CONF_STR_MAX];          /* for --enrol */
    int capacity;                          /* requests announced at once */
    int heartbeat_ms;                      /* heartbeat interval */
    int liveness;                          /* silent intervals before reconnecting */
    int n_ctx;                             /* context per session, tokens */
    int threads;                           /* CPU threads, 0: all */
    int act_bits;                          /* CPU activation precision: 16, 12 or 8; 0 the backend's default */
    int kv_bits;                           /* CPU KV cache precision: 16 or 8 */
    int max_tokens;                        /* cap on a request's max_tokens */
    int kv_mb;                             /* KV-cache pool, MiB (0: the scheduler's 256) */
    int batch;                             /* sequences in one forward pass (0: capacity) */
    int prefix_cache;                      /* 1: reuse cached prompt prefixes (default) */
} fi_shard_conf;

void fi_shard_conf_default(fi_shard_conf *c);
extern const fi_conf_key fi_shard_conf_keys[];

/* The engine backend (fi_shard_engine.c): loads the model of conf and
 * serves through one continuous-batching scheduler (fi_sched): requests
 * that arrive together share forward passes, and prompts share cached
 * prefixes (salted with the request's tenant and zone). 0, or -1 with a
 * message. */
int fi_shard_engine_backend(const fi_shard_conf *conf, fi_shard_backend *out, char *err,
                            size_t errlen);

/* The seam for shard groups (issue 7): a group's leader loads its part of
 * the model (plan) and runs each step's batch through its own forward
 * function (fi_sched_opts.forward), which drives the other ranks. NULL
 * members: the whole model in this process. */
typedef struct fi_shard_engine_hooks {
    const fi_shard_plan *plan;   /* this rank's part of the model; NULL: all */
    int (*forward)(void *user, fi_model *m, fi_kvpool *kv, const fi_batch *b, float *logits,
                   char *err, size_t errlen);
    void *forward_user;
} fi_shard_engine_hooks;
/* The engine backend's scheduler counters (fi_sched_get_stats); call it
 * only while no serving loop uses the backend. -1 when be is not the
 * engine. */
int fi_shard_engine_stats(const fi_shard_backend *be, fi_sched_stats *st);
/* The engine's model (NULL when be is not the engine), for tests and
 * tools; the engine keeps owning it. */
fi_model *fi_shard_engine_model(const fi_shard_backend *be);
int fi_shard_engine_backend_hooks(const fi_shard_conf *conf, const fi_shard_engine_hooks *hooks,
                                  fi_shard_backend *out, char *err, size_t errlen);

/* A routed request's sampling parameters (fields 0 on the wire: off,
 * temperature 0: greedy). */
fi_sampler_params fi_shard_sampling(const Fi__InferRequest *rq);
/* A routed request's prompt as tokens: its messages rendered with the
 * model's chat template, or its raw prompt (after BOS when the model wants
 * one), or its prompt as one user message; exactly as the edge tokenises
 * it for prefix hashes. malloc'd, *n tokens; NULL with a message on a bad
 * role, an empty prompt or when out of memory. */
int32_t *fi_shard_prompt_tokens(const fi_tok *tok, const Fi__InferRequest *rq, int *n, char *err,
                                size_t errlen);

/* The tokens a request may generate: the max_tokens it asked for on the
 * wire (0: not given), at most cap. Compared unsigned: a value of 2^31 or
 * more is capped like any other too large, not cast to a negative int. */
static inline int fi_shard_max_tokens(uint32_t asked, int cap) {
    return asked && asked < (uint32_t)cap ? (int)asked : cap;
}

#ifdef __cplusplus
}
#endif
#endif /* FI_SHARD_H */
