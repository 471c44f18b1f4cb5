/*
 * fi_shard.c - the cluster worker's loop and the echo backend. See
 * fi_shard.h.
 */
#include "fi_shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <zmq.h>

#define S_OFF(f) offsetof(fi_shard_conf, f)
const fi_conf_key fi_shard_conf_keys[] = {
    {"coordinator", FI_CONF_STR, S_OFF(coordinator), 1, 0, 0, 0},
    {"enrol_endpoint", FI_CONF_STR, S_OFF(enrol_endpoint), 0, 0, 0, 0},
    {"coordinator_key", FI_CONF_STR, S_OFF(coordinator_key), 1, 0, 0, 0},
    {"secret_key", FI_CONF_STR, S_OFF(secret_key), 1, 0, 0, 0},
    {"model", FI_CONF_STR, S_OFF(model), 1, 0, 0, 0},
    {"model_name", FI_CONF_STR, S_OFF(model_name), 1, 0, 0, 0},
    {"model_sha256", FI_CONF_STR, S_OFF(model_sha256), 0, 0, 0, 0},
    {"site", FI_CONF_STR, S_OFF(site), 0, 0, 0, 0},
    {"region", FI_CONF_STR, S_OFF(region), 0, 0, 0, 0},
    {"capacity", FI_CONF_INT, S_OFF(capacity), 0, 1, 1024, 0},
    {"heartbeat_ms", FI_CONF_INT, S_OFF(heartbeat_ms), 0, 10, 600000, 0},
    {"liveness", FI_CONF_INT, S_OFF(liveness), 0, 2, 100, 0},
    {"n_ctx", FI_CONF_INT, S_OFF(n_ctx), 0, 0, 1 << 20, 0},
    {"threads", FI_CONF_INT, S_OFF(threads), 0, 0, 1024, 0},
    FI_CONF_PRECISION_KEYS(S_OFF),
    {"max_tokens", FI_CONF_INT, S_OFF(max_tokens), 0, 1, 1 << 20, 0},
    {"kv_mb", FI_CONF_INT, S_OFF(kv_mb), 0, 0, 1 << 20, 0},
    {"batch", FI_CONF_INT, S_OFF(batch), 0, 0, 4096, 0},
    {"prefix_cache", FI_CONF_INT, S_OFF(prefix_cache), 0, 0, 1, 0},
    {NULL, FI_CONF_STR, 0, 0, 0, 0, 0},
};

void fi_shard_conf_default(fi_shard_conf *c) {
    memset(c, 0, sizeof *c);
    c->capacity = 4;
    c->heartbeat_ms = 1000;
    c->liveness = 3;
    c->max_tokens = 512;
    c->prefix_cache = 1;
    c->act_bits = 0; /* the backend's default (fi_cpu_backend_set_act_bits) */
    c->kv_bits = 16;
}

/* --- echo backend ------------------------------------------------------ */

typedef struct s_echo {
    int piece_len; /* bytes per chunk */
    int delay_ms;  /* before each chunk */
} s_echo;

static int s_echo_generate(void *ctx, const Fi__InferRequest *rq, fi_shard_emit_fn emit,
                           void *emit_user, fi_shard_gen *out, char *err, size_t errlen) {
    const s_echo *e = ctx;
    /* A chat echoes its last message. */
    const char *p = rq->n_messages && rq->messages[rq->n_messages - 1]->content
                        ? rq->messages[rq->n_messages - 1]->content
                    : rq->prompt ? rq->prompt : "";
    size_t n = strlen(p), piece = (size_t)e->piece_len;
    memset(out, 0, sizeof *out);
    snprintf(out->stop, sizeof out->stop, "eog");
    if (emit(emit_user, "echo: ", 6)) {
        snprintf(out->stop, sizeof out->stop, "cancel");
        return 0;
    }
    for (size_t i = 0; i < n; i += piece) {
        if (e->delay_ms > 0) {
            struct timespec ts = {e->delay_ms / 1000, (long)(e->delay_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
        out->n_generated++;
        if (rq->max_tokens && out->n_generated > rq->max_tokens) {
            out->n_generated--;
            snprintf(out->stop, sizeof out->stop, "length");
            break;
        }
        if (emit(emit_user, p + i, n - i < piece ? n - i : piece)) {
            snprintf(out->stop, sizeof out->stop, "cancel");
            break;
        }
    }
    out->n_prompt = (uint32_t)n;
    (void)err;
    (void)errlen;
    return 0;
}

fi_shard_backend fi_shard_echo_backend(int piece_len, int delay_ms) {
    fi_shard_backend be = {.name = "echo", .generate = s_echo_generate, .destroy = free};
    s_echo *e = malloc(sizeof *e);
    if (!e) return be;
    e->piece_len = piece_len > 0 ? piece_len : 4;
    e->delay_ms = delay_ms;
    be.ctx = e;
    return be;
}

/* --- the serving loop ----------------------------------------------------
 *
 * Two threads. The loop owns the connection: it answers heartbeats, takes
 * requests and cancellations, and forwards what the generator produces.
 * The generator (an actor) owns the backend and runs one request at a
 * time, so that a long prefill never silences the heartbeats. They talk
 * over an inproc PAIR pipe: the loop sends a request (a pointer to a
 * decoded message, whose ownership passes with it) or a NULL pointer to
 * quit; the generator sends frames of one kind byte and a payload:
 *   'm' + encoded envelope   forward this to the coordinator
 *   'd'                      the request is done
 * Cancellation is an atomic flag the generator's emitter reads between
 * pieces of text.
 */

#define S_PIPE "inproc://fi-shard-generator"

typedef struct s_gen {
    const fi_shard_backend *be; /* the backend, used by the generator thread only */
    void *pipe;                 /* generator's end of the pipe */
    atomic_int cancel;          /* set by the loop: stop the current request */
    const char *id;             /* current request id (generator's copy of the pointer) */
    uint32_t index;             /* next chunk's index */
} s_gen;

/* Passes an encoded message (buf, freed here; NULL: out of memory) to the loop. */
static void s_gen_send(s_gen *g, uint8_t *buf, size_t len) {
    if (!buf) return;
    zmq_send(g->pipe, "m", 1, ZMQ_SNDMORE);
    zmq_send(g->pipe, buf, len, 0);
    free(buf);
}

static void s_gen_forward(s_gen *g, const fi_msg *m) {
    size_t len = 0;
    uint8_t *buf = fi_wire_encode(m, &len);
    s_gen_send(g, buf, len);
}

static int s_gen_emit(void *user, const char *text, size_t len) {
    s_gen *g = user;
    if (atomic_load(&g->cancel)) return 1;
    size_t n = 0;
    uint8_t *buf = fi_wire_chunk(g->id, g->index++, text, len, &n);
    if (!buf) return 1;
    s_gen_send(g, buf, n);
    return 0;
}

static void s_gen_one(s_gen *g, const Fi__InferRequest *rq) {
    g->id = rq->request_id;
    g->index = 0;
    fi_shard_gen out;
    char err[256] = "";
    int rc = g->be->generate(g->be->ctx, rq, s_gen_emit, g, &out, err, sizeof err);
    if (atomic_load(&g->cancel)) return; /* the coordinator forgot it already */
    fi_msg m = FI__ENVELOPE__INIT;
    Fi__FinalResult fr = FI__FINAL_RESULT__INIT;
    Fi__Error e = FI__ERROR__INIT;
    if (rc != 0) {
        e.request_id = rq->request_id;
        e.code = FI__ERROR_CODE__ERR_ENGINE;
        e.message = err;
        m.body_case = FI__ENVELOPE__BODY_ERROR;
        m.error = &e;
    } else {
        fr.request_id = rq->request_id;
        fr.n_prompt = out.n_prompt;
        fr.n_generated = out.n_generated;
        fr.stop_reason = out.stop;
        fr.prefill_ms = out.prefill_ms;
        fr.decode_ms = out.decode_ms;
        m.body_case = FI__ENVELOPE__BODY_FINAL;
        m.final = &fr;
    }
    s_gen_forward(g, &m);
}

static void *s_gen_main(void *arg) {
    s_gen *g = arg;
    for (;;) {
        fi_msg *m = NULL;
        if (zmq_recv(g->pipe, &m, sizeof m, 0) != (int)sizeof m || !m) break;
        s_gen_one(g, m->infer);
        fi_wire_free(&m);
        uint8_t bits[FI_SHARD_FILTER_BYTES];
        if (g->be->prefix_filter && g->be->prefix_filter(g->be->ctx, bits, sizeof bits) == 0) {
            zmq_send(g->pipe, "f", 1, ZMQ_SNDMORE);
            zmq_send(g->pipe, bits, sizeof bits, 0);
        }
        zmq_send(g->pipe, "d", 1, 0);
    }
    return NULL;
}

typedef struct s_serve {
    fi_client *c;            /* connection to the coordinator */
    fi_msg **queue;          /* waiting requests (owned) */
    int n_queue, max_queue;  /* used / bound */
    char current[FI_WIRE_MAX_ID + 1]; /* id of the request the generator runs, "" when idle */
    int busy;                /* the generator has a request */
    int fatal;               /* refused or revoked */
    unsigned gen;            /* fi_client_reconnects when the queue was last valid */
    s_gen *g;                /* the generator (for its cancel flag) */
    uint8_t filter[FI_SHARD_FILTER_BYTES]; /* the backend's last prefix filter */
    int have_filter;         /* filter is set */
    void *pipe;              /* loop's end of the pipe */
    char err[256];           /* why fatal */
} s_serve;

static void s_send_error(s_serve *s, const char *id, Fi__ErrorCode code, const char *msg) {
    size_t len = 0;
    if (fi_client_send_encoded(s->c, fi_wire_error(id, code, msg, &len), &len) != 0)
        fprintf(stderr, "shard: could not send an error for %s (queue full)\n", id);
}

/* Handles one incoming message: queues requests, applies cancellations. */
static void s_take(s_serve *s, fi_msg *m) {
    if (m->body_case == FI__ENVELOPE__BODY_INFER) {
        const char *id = m->infer->request_id ? m->infer->request_id : "";
        if (!id[0] || strlen(id) > FI_WIRE_MAX_ID) {
            s_send_error(s, id, FI__ERROR_CODE__ERR_BAD_REQUEST, "bad request id");
            fi_wire_free(&m);
            return;
        }
        if (s->n_queue >= s->max_queue) {
            s_send_error(s, id, FI__ERROR_CODE__ERR_BUSY, "the worker's queue is full");
            fi_wire_free(&m);
            return;
        }
        s->queue[s->n_queue++] = m;
        return;
    }
    if (m->body_case == FI__ENVELOPE__BODY_CANCEL && m->cancel->request_id) {
        const char *id = m->cancel->request_id;
        if (s->busy && !strcmp(s->current, id)) atomic_store(&s->g->cancel, 1);
        for (int i = 0; i < s->n_queue; i++)
            if (!strcmp(s->queue[i]->infer->request_id, id)) {
                fi_wire_free(&s->queue[i]);
                memmove(&s->queue[i], &s->queue[i + 1],
                        (size_t)(s->n_queue - i - 1) * sizeof *s->queue);
                s->n_queue--;
                break;
            }
    } else if (m->body_case == FI__ENVELOPE__BODY_ERROR) {
        fprintf(stderr, "shard: coordinator error: %s (%s)\n", m->error->message,
                fi_wire_error_name(m->error->code));
    }
    fi_wire_free(&m);
}

/* After a lost connection the coordinator that routed our requests may be
 * gone with its bookkeeping: drop them rather than make new requests wait
 * behind work nobody will receive. */
static void s_check_link(s_serve *s) {
    if (fi_client_reconnects(s->c) == s->gen) return;
    s->gen = fi_client_reconnects(s->c);
    if (s->busy) atomic_store(&s->g->cancel, 1);
    for (int i = 0; i < s->n_queue; i++) fi_wire_free(&s->queue[i]);
    s->n_queue = 0;
}

/* Forwards what the generator sent. */
static void s_from_generator(s_serve *s) {
    for (;;) {
        char kind = 0;
        if (zmq_recv(s->pipe, &kind, 1, ZMQ_DONTWAIT) < 0) return;
        if (kind == 'd') {
            s->busy = 0;
            s->current[0] = 0;
            continue;
        }
        if (kind == 'f') {
            s->have_filter = zmq_recv(s->pipe, s->filter, sizeof s->filter, 0) == (int)sizeof s->filter;
            continue;
        }
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->pipe, 0) >= 0 && !atomic_load(&s->g->cancel)) {
            size_t len = zmq_msg_size(&m);
            uint8_t *buf = malloc(len ? len : 1);
            if (buf) memcpy(buf, zmq_msg_data(&m), len);
            if (fi_client_send_encoded(s->c, buf, &len) != 0) {
                /* Our queue to the coordinator is full: stop the work. */
                atomic_store(&s->g->cancel, 1);
            }
        }
        zmq_msg_close(&m);
    }
}

int fi_shard_serve(fi_client *c, const fi_shard_backend *be, int max_queue, atomic_int *stop,
                   char *err, size_t errlen) {
    if (be->submit) return fi_shard_serve_batched(c, be, max_queue, stop, err, errlen);
    int rc = -1;
    s_gen g;
    memset(&g, 0, sizeof g);
    g.be = be;
    s_serve s;
    memset(&s, 0, sizeof s);
    s.c = c;
    s.max_queue = max_queue > 0 ? max_queue : 1;
    s.gen = fi_client_reconnects(c);
    s.g = &g;
    s.queue = calloc((size_t)s.max_queue, sizeof(fi_msg *));
    void *ctx = zmq_ctx_new();
    pthread_t th;
    int started = 0;
    if (!s.queue || !ctx || !(s.pipe = zmq_socket(ctx, ZMQ_PAIR)) ||
        !(g.pipe = zmq_socket(ctx, ZMQ_PAIR)) || zmq_bind(s.pipe, S_PIPE) != 0 ||
        zmq_connect(g.pipe, S_PIPE) != 0) {
        snprintf(err, errlen, "shard: cannot set up the generator's pipe");
        goto done;
    }
    if (pthread_create(&th, NULL, s_gen_main, &g) != 0) {
        snprintf(err, errlen, "shard: cannot start the generator thread");
        goto done;
    }
    started = 1;
    while (!atomic_load(stop) && !s.fatal) {
        if (!s.busy && s.n_queue > 0) {
            fi_msg *m = s.queue[0];
            memmove(&s.queue[0], &s.queue[1], (size_t)(s.n_queue - 1) * sizeof *s.queue);
            s.n_queue--;
            snprintf(s.current, sizeof s.current, "%s", m->infer->request_id);
            atomic_store(&g.cancel, 0);
            s.busy = 1;
            zmq_send(s.pipe, &m, sizeof m, 0); /* ownership passes to the generator */
        }
        fi_msg *m = NULL;
        int r = fi_client_recv_or(c, 100, s.pipe, &m, s.err, sizeof s.err);
        if (r < 0) s.fatal = 1;
        if (r == 1) s_take(&s, m);
        s_check_link(&s);
        s_from_generator(&s);
        /* The load the router sees, with every heartbeat. */
        fi_client_set_load(c, (uint32_t)s.busy, (uint32_t)s.n_queue, 0, 0,
                           s.have_filter ? s.filter : NULL, sizeof s.filter);
    }
    rc = s.fatal ? -1 : 0;
    if (s.fatal) snprintf(err, errlen, "%s", s.err);
done:
    if (started) {
        fi_msg *quit = NULL;
        atomic_store(&g.cancel, 1);
        zmq_send(s.pipe, &quit, sizeof quit, 0);
        pthread_join(th, NULL);
    }
    if (s.pipe) zmq_close(s.pipe);
    if (g.pipe) zmq_close(g.pipe);
    if (ctx) zmq_ctx_term(ctx);
    for (int i = 0; i < s.n_queue; i++) fi_wire_free(&s.queue[i]);
    free(s.queue);
    return rc;
}
