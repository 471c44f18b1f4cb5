/*
 * fi_shard.c - the cluster worker's loop and the echo backend. See
 * fi_shard.h.
 */
#include "fi_shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define S_OFF(f) offsetof(fi_shard_conf, f)
const fi_conf_key fi_shard_conf_keys[] = {
    {"coordinator", FI_CONF_STR, S_OFF(coordinator), 1, 0, 0},
    {"enrol_endpoint", FI_CONF_STR, S_OFF(enrol_endpoint), 0, 0, 0},
    {"coordinator_key", FI_CONF_STR, S_OFF(coordinator_key), 1, 0, 0},
    {"secret_key", FI_CONF_STR, S_OFF(secret_key), 1, 0, 0},
    {"model", FI_CONF_STR, S_OFF(model), 1, 0, 0},
    {"model_name", FI_CONF_STR, S_OFF(model_name), 1, 0, 0},
    {"site", FI_CONF_STR, S_OFF(site), 0, 0, 0},
    {"region", FI_CONF_STR, S_OFF(region), 0, 0, 0},
    {"capacity", FI_CONF_INT, S_OFF(capacity), 0, 1, 1024},
    {"heartbeat_ms", FI_CONF_INT, S_OFF(heartbeat_ms), 0, 10, 600000},
    {"liveness", FI_CONF_INT, S_OFF(liveness), 0, 2, 100},
    {"n_ctx", FI_CONF_INT, S_OFF(n_ctx), 0, 0, 1 << 20},
    {"threads", FI_CONF_INT, S_OFF(threads), 0, 0, 1024},
    {"max_tokens", FI_CONF_INT, S_OFF(max_tokens), 0, 1, 1 << 20},
    {NULL, FI_CONF_STR, 0, 0, 0, 0},
};

void fi_shard_conf_default(fi_shard_conf *c) {
    memset(c, 0, sizeof *c);
    c->capacity = 4;
    c->heartbeat_ms = 1000;
    c->liveness = 3;
    c->max_tokens = 512;
}

/* --- echo backend ------------------------------------------------------ */

typedef struct s_echo {
    int piece_len; /* bytes per chunk */
    int delay_ms;  /* before each chunk */
} s_echo;

static int s_echo_generate(void *ctx, const Fi__InferRequest *rq, fi_shard_emit_fn emit,
                           void *emit_user, fi_shard_gen *out, char *err, size_t errlen) {
    const s_echo *e = ctx;
    const char *p = rq->prompt ? rq->prompt : "";
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
    fi_shard_backend be = {"echo", s_echo_generate, free, NULL};
    s_echo *e = malloc(sizeof *e);
    if (!e) return be;
    e->piece_len = piece_len > 0 ? piece_len : 4;
    e->delay_ms = delay_ms;
    be.ctx = e;
    return be;
}

/* --- the serving loop ---------------------------------------------------- */

typedef struct s_serve {
    fi_client *c;            /* connection to the coordinator */
    fi_msg **queue;          /* waiting requests (owned) */
    int n_queue, max_queue;  /* used / bound */
    const char *current;     /* id of the request being generated */
    uint32_t index;          /* next chunk's index */
    int cancel;              /* the current request was cancelled */
    int fatal;               /* refused or revoked */
    atomic_int *stop;        /* set by the owner to stop */
    unsigned gen;            /* fi_client_reconnects when the queue was last valid */
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
        if (s->n_queue >= s->max_queue) {
            s_send_error(s, m->infer->request_id, FI__ERROR_CODE__ERR_BUSY,
                         "the worker's queue is full");
            fi_wire_free(&m);
            return;
        }
        s->queue[s->n_queue++] = m;
        return;
    }
    if (m->body_case == FI__ENVELOPE__BODY_CANCEL && m->cancel->request_id) {
        const char *id = m->cancel->request_id;
        if (s->current && !strcmp(s->current, id)) s->cancel = 1;
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
    if (s->current) s->cancel = 1;
    for (int i = 0; i < s->n_queue; i++) fi_wire_free(&s->queue[i]);
    s->n_queue = 0;
}

/* Reads what arrived, waiting at most timeout_ms. */
static void s_pump(s_serve *s, int timeout_ms) {
    for (;;) {
        s_check_link(s);
        fi_msg *m = NULL;
        int rc = fi_client_recv(s->c, timeout_ms, &m, s->err, sizeof s->err);
        if (rc < 0) {
            s->fatal = 1;
            return;
        }
        s_check_link(s);
        if (rc == 0) return;
        s_take(s, m);
        timeout_ms = 0;
    }
}

static int s_emit(void *user, const char *text, size_t len) {
    s_serve *s = user;
    s_pump(s, 0); /* heartbeats and cancellations between tokens */
    if (s->cancel || s->fatal || atomic_load(s->stop)) return 1;
    char *t = malloc(len + 1);
    if (!t) return 1;
    memcpy(t, text, len);
    t[len] = 0;
    Fi__TokenChunk ch = FI__TOKEN_CHUNK__INIT;
    ch.request_id = (char *)s->current;
    ch.index = s->index++;
    ch.text = t;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_CHUNK;
    m.chunk = &ch;
    int rc = fi_client_send(s->c, &m);
    free(t);
    return rc != 0; /* queue full: the coordinator is not draining us */
}

static void s_serve_one(s_serve *s, const fi_shard_backend *be, fi_msg *m) {
    const Fi__InferRequest *rq = m->infer;
    s->current = rq->request_id;
    s->index = 0;
    s->cancel = 0;
    fi_shard_gen g;
    char err[256] = "";
    int rc = be->generate(be->ctx, rq, s_emit, s, &g, err, sizeof err);
    if (s->cancel) {
        /* The coordinator forgot the request already; nothing to answer. */
    } else if (rc != 0) {
        s_send_error(s, rq->request_id, FI__ERROR_CODE__ERR_ENGINE, err);
    } else {
        Fi__FinalResult fr = FI__FINAL_RESULT__INIT;
        fr.request_id = rq->request_id;
        fr.n_prompt = g.n_prompt;
        fr.n_generated = g.n_generated;
        fr.stop_reason = g.stop;
        fr.prefill_ms = g.prefill_ms;
        fr.decode_ms = g.decode_ms;
        fi_msg out = FI__ENVELOPE__INIT;
        out.body_case = FI__ENVELOPE__BODY_FINAL;
        out.final = &fr;
        if (fi_client_send(s->c, &out) != 0)
            fprintf(stderr, "shard: could not send the result of %s\n", rq->request_id);
    }
    s->current = NULL;
}

int fi_shard_serve(fi_client *c, const fi_shard_backend *be, int max_queue, atomic_int *stop,
                   char *err, size_t errlen) {
    s_serve s = {c, calloc((size_t)(max_queue > 0 ? max_queue : 1), sizeof(fi_msg *)), 0,
                 max_queue > 0 ? max_queue : 1, NULL, 0, 0, 0, stop, fi_client_reconnects(c), ""};
    if (!s.queue) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    while (!atomic_load(stop) && !s.fatal) {
        if (s.n_queue == 0) {
            s_pump(&s, 100);
            continue;
        }
        fi_msg *m = s.queue[0];
        memmove(&s.queue[0], &s.queue[1], (size_t)(s.n_queue - 1) * sizeof *s.queue);
        s.n_queue--;
        s_serve_one(&s, be, m);
        fi_wire_free(&m);
    }
    for (int i = 0; i < s.n_queue; i++) fi_wire_free(&s.queue[i]);
    free(s.queue);
    if (s.fatal) {
        snprintf(err, errlen, "%s", s.err);
        return -1;
    }
    return 0;
}
