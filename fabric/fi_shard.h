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

#ifdef __cplusplus
extern "C" {
#endif

/* Called by a backend with each piece of text; returns nonzero when the
 * request must stop (cancelled, the link was lost, or the worker is
 * stopping). Backends run on the generator thread. */
typedef int (*fi_shard_emit_fn)(void *emit_user, const char *text, size_t len);

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
     * (sent to the requester as ERR_ENGINE). */
    int (*generate)(void *ctx, const Fi__InferRequest *rq, fi_shard_emit_fn emit,
                    void *emit_user, fi_shard_gen *out, char *err, size_t errlen);
    void (*destroy)(void *ctx); /* optional */
    void *ctx;                  /* the backend's state */
    /* Optional: the backend's prefix-cache summary for the router, into
     * bits (nbytes, a power of two): fi_sched_prefix_filter for a backend
     * with a prefix cache. 0, or -1 when it has none now. Called on the
     * generator thread between requests. */
    int (*prefix_filter)(void *ctx, uint8_t *bits, size_t nbytes);
} fi_shard_backend;

/* Bytes of the prefix filter a worker reports (fi_fabric.proto WorkerLoad). */
#define FI_SHARD_FILTER_BYTES 1024

/* The echo backend: streams "echo: " and the prompt back in pieces of
 * piece_len bytes, waiting delay_ms before each (0: none). Its ctx is NULL
 * when out of memory. */
fi_shard_backend fi_shard_echo_backend(int piece_len, int delay_ms);

/* Serves requests from c with be until *stop is nonzero or the
 * coordinator refuses or revokes the key. Returns 0 on stop, -1 with a
 * message on refusal. max_queue bounds the waiting requests. */
int fi_shard_serve(fi_client *c, const fi_shard_backend *be, int max_queue, atomic_int *stop,
                   char *err, size_t errlen);

/* --- the `fedinfer shard` configuration ------------------------------ */
typedef struct fi_shard_conf {
    char coordinator[FI_CONF_STR_MAX];     /* fabric endpoint, tcp://host:7700 */
    char enrol_endpoint[FI_CONF_STR_MAX];  /* enrolment endpoint (for --enrol) */
    char coordinator_key[FI_CONF_STR_MAX]; /* the coordinator's public key file */
    char secret_key[FI_CONF_STR_MAX];      /* our secret key file */
    char model[FI_CONF_STR_MAX];           /* GGUF path */
    char model_name[FI_CONF_STR_MAX];      /* name requests ask for */
    char site[FI_CONF_STR_MAX];            /* for --enrol */
    char region[FI_CONF_STR_MAX];          /* for --enrol */
    int capacity;                          /* requests announced at once */
    int heartbeat_ms;                      /* heartbeat interval */
    int liveness;                          /* silent intervals before reconnecting */
    int n_ctx;                             /* context per session, tokens */
    int threads;                           /* CPU threads, 0: all */
    int max_tokens;                        /* cap on a request's max_tokens */
} fi_shard_conf;

void fi_shard_conf_default(fi_shard_conf *c);
extern const fi_conf_key fi_shard_conf_keys[];

/* The engine backend (fi_shard_engine.c): loads the model of conf.
 * 0, or -1 with a message. */
int fi_shard_engine_backend(const fi_shard_conf *conf, fi_shard_backend *out, char *err,
                            size_t errlen);

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

#ifdef __cplusplus
}
#endif
#endif /* FI_SHARD_H */
