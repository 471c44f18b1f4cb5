/*
 * fi_shard_batch.c - the cluster worker's loop for a batched backend (the
 * engine over one continuous-batching scheduler). See fi_shard.h.
 *
 * Two threads, as for one-at-a-time backends. The calling thread owns the
 * connection: heartbeats (with the load), requests, cancellations, and
 * forwarding what the serving thread produces. The serving thread owns
 * the backend (a scheduler is single-threaded): it submits requests as
 * they come, cancels, and steps while anything is pending, so requests
 * that arrive together share forward passes. They talk over an inproc
 * PAIR pipe, one frame of a kind byte and a payload each way:
 *
 *   loop -> serving  'r' + fi_msg *   a request (ownership passes)
 *                    'c' + id         cancel the request (the client left)
 *                    'q'              stop: cancel everything and return
 *   serving -> loop  'm' + envelope   forward to the coordinator
 *                    'd' + id         the request has ended
 *                    'l' + 5 x u32    running, queued, KV free, KV total, up
 *                    'f' + filter     the backend's prefix filter, sized from
 *                                     the KV total (fi_prefix_filter_bytes)
 *
 * A cancelled request forwards nothing more (the coordinator has
 * forgotten it); its end still comes back as 'd', so the loop's count of
 * open requests stays right.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <zmq.h>

#include "fi_shard.h"

#define S_PIPE "inproc://fi-shard-batch"
#define S_REPORT_MS 100 /* load and filter to the loop at most this often */

typedef struct s_bgen s_bgen;

/* One request at the backend. */
typedef struct s_slot {
    char id[FI_WIRE_MAX_ID + 1]; /* the coordinator's request id */
    int64_t handle;              /* the backend's id */
    uint32_t index;              /* next chunk's index */
    int cancelled;               /* forward nothing more */
    s_bgen *g;                   /* the serving thread's state */
} s_slot;

struct s_bgen {
    const fi_shard_backend *be;  /* used by the serving thread only */
    void *pipe;                  /* serving thread's end */
    s_slot **slots;              /* open requests */
    int n_slots, cap_slots;
    uint64_t report_ms;          /* when load was last sent */
    uint8_t *bits;               /* the filter's buffer, FI_PREFIX_FILTER_MAX bytes */
};

/* Passes an encoded message (buf, freed here; NULL: out of memory) to the loop. */
static void s_send(s_bgen *g, uint8_t *buf, size_t len) {
    if (!buf) return;
    zmq_send(g->pipe, "m", 1, ZMQ_SNDMORE);
    zmq_send(g->pipe, buf, len, 0);
    free(buf);
}

static void s_forward(s_bgen *g, const fi_msg *m) {
    size_t len = 0;
    uint8_t *buf = fi_wire_encode(m, &len);
    s_send(g, buf, len);
}

static void s_error(s_bgen *g, const char *id, Fi__ErrorCode code, const char *msg) {
    size_t len = 0;
    uint8_t *buf = fi_wire_error(id, code, msg, &len);
    s_send(g, buf, len);
}

static void s_ended(s_bgen *g, const char *id) {
    zmq_send(g->pipe, "d", 1, ZMQ_SNDMORE);
    zmq_send(g->pipe, id, strlen(id), 0);
}

static int s_emit(void *user, const char *text, size_t len) {
    s_slot *sl = user;
    if (sl->cancelled) return 1;
    size_t n = 0;
    uint8_t *buf = fi_wire_chunk(sl->id, sl->index++, text, len, &n);
    if (!buf) return 1;
    s_send(sl->g, buf, n);
    return 0;
}

static void s_done(void *user, const fi_gen_result *res, const char *error) {
    s_slot *sl = user;
    s_bgen *g = sl->g;
    if (!sl->cancelled) {
        if (error) {
            s_error(g, sl->id, FI__ERROR_CODE__ERR_ENGINE, error);
        } else {
            Fi__FinalResult fr = FI__FINAL_RESULT__INIT;
            fr.request_id = sl->id;
            fr.n_prompt = (uint32_t)res->n_prompt;
            fr.n_generated = (uint32_t)res->n_generated;
            fr.stop_reason = (char *)fi_stop_reason_name(res->stop);
            fr.prefill_ms = (uint32_t)(res->prefill_s * 1000.0);
            fr.decode_ms = (uint32_t)(res->decode_s * 1000.0);
            fi_msg m = FI__ENVELOPE__INIT;
            m.body_case = FI__ENVELOPE__BODY_FINAL;
            m.final = &fr;
            s_forward(g, &m);
        }
    }
    s_ended(g, sl->id);
    for (int i = 0; i < g->n_slots; i++)
        if (g->slots[i] == sl) {
            g->slots[i] = g->slots[--g->n_slots];
            break;
        }
    free(sl);
}

static void s_submit(s_bgen *g, fi_msg *m) {
    const Fi__InferRequest *rq = m->infer;
    char err[256] = "";
    s_slot *sl = calloc(1, sizeof *sl);
    if (sl && g->n_slots == g->cap_slots) {
        int cap = g->cap_slots ? 2 * g->cap_slots : 16;
        s_slot **n = realloc(g->slots, (size_t)cap * sizeof *n);
        if (n) {
            g->slots = n;
            g->cap_slots = cap;
        }
    }
    if (!sl || g->n_slots == g->cap_slots) {
        s_error(g, rq->request_id, FI__ERROR_CODE__ERR_INTERNAL, "out of memory");
        s_ended(g, rq->request_id);
        free(sl);
        return;
    }
    snprintf(sl->id, sizeof sl->id, "%s", rq->request_id);
    sl->g = g;
    fi_shard_sink sink = {s_emit, s_done, sl};
    g->slots[g->n_slots++] = sl; /* before submit: done may not come, but it is findable */
    sl->handle = g->be->submit(g->be->ctx, rq, &sink, err, sizeof err);
    if (sl->handle < 0) {
        g->n_slots--;
        /* -2: the engine is down, not the request at fault */
        s_error(g, sl->id,
                sl->handle == -2 ? FI__ERROR_CODE__ERR_ENGINE : FI__ERROR_CODE__ERR_BAD_REQUEST,
                err);
        s_ended(g, sl->id);
        free(sl);
    }
}

static void s_cancel(s_bgen *g, const char *id) {
    for (int i = 0; i < g->n_slots; i++) {
        s_slot *sl = g->slots[i];
        if (strcmp(sl->id, id) || sl->cancelled) continue;
        sl->cancelled = 1;
        (void)g->be->cancel(g->be->ctx, sl->handle);
        return;
    }
}

static void s_report(s_bgen *g, int force) {
    uint64_t now = fi_wire_now_ms();
    if (!force && now - g->report_ms < S_REPORT_MS) return;
    g->report_ms = now;
    uint32_t l[5] = {0, 0, 0, 0, 1}; /* running, queued, KV free, KV total, up */
    if (g->be->load) g->be->load(g->be->ctx, &l[0], &l[1], &l[2], &l[3]);
    if (g->be->up) l[4] = (uint32_t)(g->be->up(g->be->ctx) != 0);
    zmq_send(g->pipe, "l", 1, ZMQ_SNDMORE);
    zmq_send(g->pipe, l, sizeof l, 0);
    /* about 10 bits per block of the pool (a backend that reports no
     * load: the one-at-a-time size) */
    size_t nb = g->be->load ? fi_prefix_filter_bytes(l[3] > INT32_MAX ? INT32_MAX : (int)l[3])
                            : FI_SHARD_FILTER_BYTES;
    if (!l[4]) { /* down: no prefix is here any more */
        memset(g->bits, 0, nb);
        zmq_send(g->pipe, "f", 1, ZMQ_SNDMORE);
        zmq_send(g->pipe, g->bits, nb, 0);
    } else if (g->be->prefix_filter && g->be->prefix_filter(g->be->ctx, g->bits, nb) == 0) {
        zmq_send(g->pipe, "f", 1, ZMQ_SNDMORE);
        zmq_send(g->pipe, g->bits, nb, 0);
    }
}

/* Takes one frame from the loop; 1 to quit. */
static int s_take(s_bgen *g, int flags) {
    zmq_msg_t k, p;
    zmq_msg_init(&k);
    if (zmq_msg_recv(&k, g->pipe, flags) < 0) {
        zmq_msg_close(&k);
        return zmq_errno() == EAGAIN ? -1 : 1;
    }
    char kind = zmq_msg_size(&k) ? *(const char *)zmq_msg_data(&k) : 'q';
    int more = zmq_msg_more(&k);
    zmq_msg_close(&k);
    zmq_msg_init(&p);
    if (more && zmq_msg_recv(&p, g->pipe, 0) < 0) kind = 'q';
    int quit = 0;
    if (kind == 'r' && zmq_msg_size(&p) == sizeof(fi_msg *)) {
        fi_msg *m;
        memcpy(&m, zmq_msg_data(&p), sizeof m);
        s_submit(g, m);
        fi_wire_free(&m);
    } else if (kind == 'c') {
        char id[FI_WIRE_MAX_ID + 1];
        size_t n = zmq_msg_size(&p) < FI_WIRE_MAX_ID ? zmq_msg_size(&p) : FI_WIRE_MAX_ID;
        memcpy(id, zmq_msg_data(&p), n);
        id[n] = 0;
        s_cancel(g, id);
    } else {
        quit = 1;
    }
    zmq_msg_close(&p);
    return quit;
}

static void *s_serving_main(void *arg) {
    s_bgen *g = arg;
    char err[256];
    int quit = 0;
    s_report(g, 1); /* the pool's size from the start */
    while (!quit) {
        if (g->n_slots == 0) {
            /* Idle: wait for work, reporting the load now and then. */
            zmq_pollitem_t it = {g->pipe, 0, ZMQ_POLLIN, 0};
            if (zmq_poll(&it, 1, S_REPORT_MS) < 0 && zmq_errno() != EINTR) break;
            s_report(g, 0);
            if (!(it.revents & ZMQ_POLLIN)) continue;
        }
        int r;
        while ((r = s_take(g, ZMQ_DONTWAIT)) == 0) {
        }
        if (r == 1) quit = 1;
        if (g->n_slots > 0 && g->be->step(g->be->ctx, err, sizeof err) < 0)
            fprintf(stderr, "shard: a batch failed: %s\n", err); /* its requests ended with it */
        s_report(g, 0);
    }
    /* Stopping: cancel what is open and let the cancellations happen. */
    for (int i = 0; i < g->n_slots; i++) {
        g->slots[i]->cancelled = 1;
        (void)g->be->cancel(g->be->ctx, g->slots[i]->handle);
    }
    for (int i = 0; i < 64 && g->n_slots > 0; i++)
        if (g->be->step(g->be->ctx, err, sizeof err) <= 0) break;
    for (int i = 0; i < g->n_slots; i++) free(g->slots[i]);
    free(g->slots);
    g->slots = NULL;
    g->n_slots = 0;
    return NULL;
}

/* --- the connection's side ------------------------------------------- */

typedef struct s_open {
    char id[FI_WIRE_MAX_ID + 1]; /* open at the serving thread */
} s_open;

typedef struct s_loop {
    fi_client *c;                /* connection */
    void *pipe;                  /* loop's end */
    s_open *open;                /* requests handed over and not ended */
    int n_open, max_open;
    unsigned gen;                /* reconnect count the open requests belong to */
    uint32_t load[5];            /* running, queued, KV free, KV total, up */
    uint32_t withdrawn;          /* down: the capacity to announce again (0: up) */
    uint8_t *filter;             /* the backend's last prefix filter, FI_PREFIX_FILTER_MAX bytes */
    size_t filter_len;           /* its size (0: none yet) */
} s_loop;

static void s_tell(s_loop *s, char kind, const void *payload, size_t len) {
    zmq_send(s->pipe, &kind, 1, ZMQ_SNDMORE);
    zmq_send(s->pipe, payload, len, 0);
}

static void s_loop_error(s_loop *s, const char *id, Fi__ErrorCode code, const char *msg) {
    size_t len = 0;
    if (fi_client_send_encoded(s->c, fi_wire_error(id, code, msg, &len), &len) != 0)
        fprintf(stderr, "shard: could not send an error for %s (queue full)\n", id);
}

static void s_loop_take(s_loop *s, fi_msg *m) {
    if (m->body_case == FI__ENVELOPE__BODY_INFER) {
        const char *id = m->infer->request_id ? m->infer->request_id : "";
        if (!id[0] || strlen(id) > FI_WIRE_MAX_ID) {
            s_loop_error(s, id, FI__ERROR_CODE__ERR_BAD_REQUEST, "bad request id");
        } else if (s->n_open >= s->max_open) {
            s_loop_error(s, id, FI__ERROR_CODE__ERR_BUSY, "the worker's queue is full");
        } else {
            snprintf(s->open[s->n_open++].id, sizeof s->open[0].id, "%s", id);
            s_tell(s, 'r', &m, sizeof m); /* ownership passes */
            return;
        }
    } else if (m->body_case == FI__ENVELOPE__BODY_CANCEL && m->cancel->request_id) {
        for (int i = 0; i < s->n_open; i++)
            if (!strcmp(s->open[i].id, m->cancel->request_id)) {
                s_tell(s, 'c', s->open[i].id, strlen(s->open[i].id));
                break;
            }
    } else if (m->body_case == FI__ENVELOPE__BODY_ERROR) {
        fprintf(stderr, "shard: coordinator error: %s (%s)\n", m->error->message,
                fi_wire_error_name(m->error->code));
    }
    fi_wire_free(&m);
}

/* What the serving thread sent. */
static void s_loop_from_serving(s_loop *s) {
    for (;;) {
        zmq_msg_t k, p;
        zmq_msg_init(&k);
        if (zmq_msg_recv(&k, s->pipe, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&k);
            return;
        }
        char kind = zmq_msg_size(&k) ? *(const char *)zmq_msg_data(&k) : 0;
        zmq_msg_close(&k);
        zmq_msg_init(&p);
        if (zmq_msg_recv(&p, s->pipe, 0) < 0) {
            zmq_msg_close(&p);
            return;
        }
        size_t n = zmq_msg_size(&p);
        if (kind == 'm') {
            uint8_t *buf = malloc(n ? n : 1);
            if (buf) memcpy(buf, zmq_msg_data(&p), n);
            if (fi_client_send_encoded(s->c, buf, &n) != 0)
                fprintf(stderr, "shard: a reply was dropped (the queue to the coordinator is full)\n");
        } else if (kind == 'd') {
            char id[FI_WIRE_MAX_ID + 1];
            size_t k2 = n < FI_WIRE_MAX_ID ? n : FI_WIRE_MAX_ID;
            memcpy(id, zmq_msg_data(&p), k2);
            id[k2] = 0;
            for (int i = 0; i < s->n_open; i++)
                if (!strcmp(s->open[i].id, id)) {
                    s->open[i] = s->open[--s->n_open];
                    break;
                }
        } else if (kind == 'l' && n == sizeof s->load) {
            memcpy(s->load, zmq_msg_data(&p), n);
        } else if (kind == 'f' && n >= FI_PREFIX_FILTER_MIN && n <= FI_PREFIX_FILTER_MAX) {
            memcpy(s->filter, zmq_msg_data(&p), n);
            s->filter_len = n;
        }
        zmq_msg_close(&p);
    }
}

int fi_shard_serve_batched(fi_client *c, const fi_shard_backend *be, int max_open,
                           atomic_int *stop, char *err, size_t errlen) {
    int rc = -1, started = 0, fatal = 0;
    char why[256] = "";
    s_bgen g;
    memset(&g, 0, sizeof g);
    g.be = be;
    s_loop s;
    memset(&s, 0, sizeof s);
    s.c = c;
    s.max_open = max_open > 0 ? max_open : 1;
    s.gen = fi_client_reconnects(c);
    s.load[4] = 1; /* up until the serving thread says otherwise */
    s.open = calloc((size_t)s.max_open, sizeof *s.open);
    s.filter = malloc(FI_PREFIX_FILTER_MAX);
    g.bits = malloc(FI_PREFIX_FILTER_MAX);
    void *ctx = zmq_ctx_new();
    pthread_t th;
    if (!s.open || !s.filter || !g.bits || !ctx || !(s.pipe = zmq_socket(ctx, ZMQ_PAIR)) ||
        !(g.pipe = zmq_socket(ctx, ZMQ_PAIR)) || zmq_bind(s.pipe, S_PIPE) != 0 ||
        zmq_connect(g.pipe, S_PIPE) != 0) {
        snprintf(err, errlen, "shard: cannot set up the serving thread's pipe");
        goto done;
    }
    if (!be->submit || !be->cancel || !be->step) {
        snprintf(err, errlen, "shard: backend %s is not batched (submit, cancel, step)", be->name);
        goto done;
    }
    if (pthread_create(&th, NULL, s_serving_main, &g) != 0) {
        snprintf(err, errlen, "shard: cannot start the serving thread");
        goto done;
    }
    started = 1;
    while (!atomic_load(stop) && !fatal) {
        fi_msg *m = NULL;
        int r = fi_client_recv_or(c, 100, s.pipe, &m, why, sizeof why);
        if (r < 0) fatal = 1;
        if (r == 1) s_loop_take(&s, m);
        if (fi_client_reconnects(c) != s.gen) {
            /* The coordinator that routed them may be gone with its
             * bookkeeping: stop the work nobody will receive. */
            s.gen = fi_client_reconnects(c);
            for (int i = 0; i < s.n_open; i++) s_tell(&s, 'c', s.open[i].id, strlen(s.open[i].id));
        }
        s_loop_from_serving(&s);
        if (s.load[4] == 0 && !s.withdrawn && fi_client_capacity(c, 0) > 0) {
            /* the engine is down: nothing more is routed here until it is up */
            s.withdrawn = fi_client_capacity(c, 0);
            (void)fi_client_set_capacity(c, 0, 0);
            fprintf(stderr, "shard: the engine is down: model withdrawn\n");
        } else if (s.load[4] && s.withdrawn) {
            (void)fi_client_set_capacity(c, 0, s.withdrawn);
            s.withdrawn = 0;
            fprintf(stderr, "shard: the engine is up again: model announced\n");
        }
        fi_client_set_load(c, s.load[0], s.load[1], s.load[2], s.load[3],
                           s.filter_len ? s.filter : NULL, s.filter_len);
    }
    rc = fatal ? -1 : 0;
    if (fatal) snprintf(err, errlen, "%s", why);
done:
    if (started) {
        s_tell(&s, 'q', "", 0);
        pthread_join(th, NULL);
        s_loop_from_serving(&s);
    }
    if (s.pipe) zmq_close(s.pipe);
    if (g.pipe) zmq_close(g.pipe);
    if (ctx) zmq_ctx_term(ctx);
    free(s.open);
    free(s.filter);
    free(g.bits);
    return rc;
}
