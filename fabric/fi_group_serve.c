/*
 * fi_group_serve.c - the group leader's serving loop: requests from the
 * coordinator go into one scheduler (continuous batching: several
 * requests decode together, one pass over every rank per step), whose
 * forward passes run over the group (fi_group_forward). See fi_group.h.
 *
 * One thread does everything, in turn: the coordinator's link
 * (heartbeats, requests, cancellations), the group's links (joins, rank
 * failures) and one scheduler step. A step is one forward pass (at most
 * step_tokens tokens), short next to the coordinator's heartbeat
 * timeout, so nothing needs a second thread.
 *
 * Availability: the model is announced with its capacity only while every
 * rank has joined; otherwise with capacity 0 (withdrawn), so the
 * coordinator routes nothing here. A request that arrives meanwhile is
 * refused with the group's status. When a rank is lost, the pass in
 * progress fails and the scheduler ends every request it holds with that
 * message. When the group is whole again, the scheduler is made anew:
 * the restarted rank's KV cache is empty, so no cached prefix may be
 * reused.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_group.h"
#include "fi_sched.h"
#include "fi_shard.h"
#include "fi_wire.h"

typedef struct s_lead s_lead;

#define S_HELD 256 /* coordinator messages held while a pass runs */

/* One request in the scheduler. */
typedef struct s_req {
    char id[FI_WIRE_MAX_ID + 1]; /* the coordinator's request id */
    int64_t sid;                 /* the scheduler's id */
    uint32_t index;              /* next chunk's number */
    int lost;                    /* the coordinator forgot it: send nothing more */
    s_lead *L;                   /* back pointer */
    struct s_req *next;          /* list of open requests */
} s_req;

struct s_lead {
    fi_group *g;                 /* the group */
    fi_model *m;                 /* the leader's slice */
    fi_client *c;                /* the coordinator */
    const fi_group_rank_conf *rc; /* limits */
    fi_sched *s;                 /* the scheduler (made anew after a failure) */
    s_req *open;                 /* open requests */
    unsigned gen;                /* fi_client_reconnects when last checked */
    fi_msg *held[S_HELD];        /* messages that came during a pass (owned) */
    int n_held;
    int fatal;                   /* the coordinator refused or revoked us */
    char fatal_err[256];
};

static int s_on_text(void *user, const char *text, size_t len) {
    s_req *q = user;
    if (q->lost) return 1;
    size_t n = 0;
    uint8_t *buf = fi_wire_chunk(q->id, q->index++, text, len, &n);
    /* a full queue to the coordinator (or no memory) stops this one */
    return fi_client_send_encoded(q->L->c, buf, &n) != 0;
}

static void s_unlink(s_lead *L, s_req *q) {
    for (s_req **p = &L->open; *p; p = &(*p)->next)
        if (*p == q) {
            *p = q->next;
            return;
        }
}

static void s_on_done(void *user, const fi_gen_result *res, const char *error) {
    s_req *q = user;
    s_lead *L = q->L;
    if (!q->lost) {
        fi_msg m = FI__ENVELOPE__INIT;
        Fi__FinalResult fr = FI__FINAL_RESULT__INIT;
        Fi__Error e = FI__ERROR__INIT;
        if (error) {
            e.request_id = q->id;
            e.code = FI__ERROR_CODE__ERR_ENGINE;
            e.message = (char *)error;
            m.body_case = FI__ENVELOPE__BODY_ERROR;
            m.error = &e;
        } else {
            fr.request_id = q->id;
            fr.n_prompt = (uint32_t)res->n_prompt;
            fr.n_generated = (uint32_t)res->n_generated;
            fr.stop_reason = (char *)fi_stop_reason_name(res->stop);
            fr.prefill_ms = (uint32_t)(res->prefill_s * 1000.0);
            fr.decode_ms = (uint32_t)(res->decode_s * 1000.0);
            m.body_case = FI__ENVELOPE__BODY_FINAL;
            m.final = &fr;
        }
        if (fi_client_send(L->c, &m) != 0)
            fprintf(stderr, "group leader: could not send the end of %s (queue full)\n", q->id);
    }
    s_unlink(L, q);
    free(q);
}

static void s_send_error(s_lead *L, const char *id, Fi__ErrorCode code, const char *msg) {
    size_t len = 0;
    if (fi_client_send_encoded(L->c, fi_wire_error(id, code, msg, &len), &len) != 0)
        fprintf(stderr, "group leader: could not send an error for %s (queue full)\n", id);
}

static int s_make_sched(s_lead *L, char *err, size_t errlen) {
    fi_sched_destroy(&L->s);
    fi_sched_opts o;
    memset(&o, 0, sizeof o);
    o.kv_bytes = (size_t)L->rc->kv_mib << 20;
    o.max_seqs = L->rc->max_seqs;
    o.step_tokens = L->rc->step_tokens;
    o.n_ctx = L->rc->n_ctx;
    o.forward = fi_group_forward;
    o.forward_user = L->g;
    if (!(L->s = fi_sched_new(L->m, &o, err, errlen))) return -1;
    fi_kvpool *kv = fi_sched_kvpool(L->s);
    fi_group_set_pool(L->g, fi_kvpool_blocks(kv), fi_kvpool_max_tokens(kv), fi_kvpool_max_out(kv));
    return 0;
}

/* Takes one request from the coordinator into the scheduler. */
static void s_submit(s_lead *L, const Fi__InferRequest *rq) {
    const char *id = rq->request_id ? rq->request_id : "";
    char err[512];
    if (!id[0] || strlen(id) > FI_WIRE_MAX_ID) {
        s_send_error(L, id, FI__ERROR_CODE__ERR_BAD_REQUEST, "bad request id");
        return;
    }
    if (!fi_group_available(L->g)) {
        snprintf(err, sizeof err, "shard group unavailable: %s", fi_group_status(L->g));
        s_send_error(L, id, FI__ERROR_CODE__ERR_BUSY, err);
        return;
    }
    int n = 0;
    s_req *q = NULL;
    /* the request as a single worker takes it (fi_shard_engine.c): its
     * messages or prompt, raw or through the chat template, its sampling
     * and stop strings */
    int32_t *ids = fi_shard_prompt_tokens(fi_model_tok(L->m), rq, &n, err, sizeof err);
    if (!ids) goto bad;
    if (!(q = calloc(1, sizeof *q))) {
        snprintf(err, sizeof err, "out of memory");
        goto bad;
    }
    snprintf(q->id, sizeof q->id, "%s", id);
    q->L = L;
    fi_sched_req r;
    memset(&r, 0, sizeof r);
    r.prompt = ids;
    r.n_prompt = n;
    r.gen.max_tokens = fi_shard_max_tokens(rq->max_tokens, L->rc->max_tokens);
    r.gen.sampling = fi_shard_sampling(rq);
    r.gen.stop = (const char *const *)rq->stop;
    r.gen.n_stop = rq->n_stop < 4 ? (int)rq->n_stop : 4;
    r.gen.on_text = s_on_text;
    r.gen.user = q;
    r.on_done = s_on_done;
    /* the prefix-cache salt: the application's tenant (from the edge) and
     * the origin's residency zone (set by the coordinator) */
    r.tenant = rq->tenant;
    r.zone = rq->zone;
    q->sid = fi_sched_submit(L->s, &r, err, sizeof err);
    if (q->sid < 0) goto bad;
    q->next = L->open;
    L->open = q;
    free(ids);
    return;
bad:
    s_send_error(L, id, FI__ERROR_CODE__ERR_BAD_REQUEST, err);
    free(q);
    free(ids);
}

static void s_take(s_lead *L, fi_msg *m) {
    if (m->body_case == FI__ENVELOPE__BODY_INFER) {
        s_submit(L, m->infer);
    } else if (m->body_case == FI__ENVELOPE__BODY_CANCEL && m->cancel->request_id) {
        for (s_req *q = L->open; q; q = q->next)
            if (!strcmp(q->id, m->cancel->request_id)) {
                q->lost = 1; /* the coordinator forgot it */
                (void)fi_sched_cancel(L->s, q->sid);
            }
    } else if (m->body_case == FI__ENVELOPE__BODY_ERROR) {
        fprintf(stderr, "group leader: coordinator error: %s (%s)\n", m->error->message,
                fi_wire_error_name(m->error->code));
    }
}

/* Runs while a pass waits for other ranks: keeps the coordinator's link
 * alive (heartbeats both ways) and holds what arrives for after the step
 * (the scheduler is inside fi_sched_step and must not be re-entered). */
static void s_tick(void *user) {
    s_lead *L = user;
    fi_msg *m = NULL;
    for (int k = 0; k < 64 && !L->fatal; k++) {
        int r = fi_client_recv(L->c, 0, &m, L->fatal_err, sizeof L->fatal_err);
        if (r < 0) L->fatal = 1;
        if (r != 1) return;
        if (L->n_held < S_HELD) {
            L->held[L->n_held++] = m;
            continue;
        }
        if (m->body_case == FI__ENVELOPE__BODY_INFER && m->infer->request_id)
            s_send_error(L, m->infer->request_id, FI__ERROR_CODE__ERR_BUSY,
                         "the group leader's queue is full");
        fi_wire_free(&m);
    }
}

int fi_group_serve(fi_group *g, fi_model *m, fi_client *c, const fi_group_rank_conf *rc,
                   atomic_int *stop, char *err, size_t errlen) {
    s_lead L;
    memset(&L, 0, sizeof L);
    L.g = g;
    L.m = m;
    L.c = c;
    L.rc = rc;
    L.gen = fi_client_reconnects(c);
    int rc_ = -1, announced = 0, dirty = 0;
    double last_load = 0;
    if (fi_group_attach(g, m, err, errlen) != 0 || s_make_sched(&L, err, errlen) != 0) goto done;
    fi_group_set_idle(g, s_tick, &L);
    (void)fi_client_set_capacity(c, 0, 0); /* nothing until every rank has joined */
    while (!atomic_load(stop)) {
        int busy = fi_sched_pending(L.s) > 0;
        int avail = fi_group_lead_poll(g, busy ? 0 : 20, err, errlen);
        if (avail < 0) goto done;
        if (!avail && announced) {
            dirty = 1; /* a rank was lost: its KV cache is gone */
            (void)fi_client_set_capacity(c, 0, 0);
            announced = 0;
        }
        if (avail && dirty && !busy) {
            if (s_make_sched(&L, err, errlen) != 0) goto done;
            dirty = 0;
        }
        if (avail && !announced && !dirty) {
            (void)fi_client_set_capacity(c, 0, (uint32_t)rc->capacity);
            announced = 1;
        }
        for (int i = 0; i < L.n_held; i++) {
            s_take(&L, L.held[i]);
            fi_wire_free(&L.held[i]);
        }
        L.n_held = 0;
        fi_msg *msg = NULL;
        int r = fi_client_recv(c, 0, &msg, err, errlen);
        if (r < 0 || L.fatal) { /* refused or revoked */
            if (L.fatal) snprintf(err, errlen, "%s", L.fatal_err);
            goto done;
        }
        if (r == 1) {
            s_take(&L, msg);
            fi_wire_free(&msg);
        }
        if (fi_client_reconnects(c) != L.gen) {
            /* The coordinator that routed our requests may be gone. */
            L.gen = fi_client_reconnects(c);
            for (s_req *q = L.open; q; q = q->next) {
                q->lost = 1;
                (void)fi_sched_cancel(L.s, q->sid);
            }
            if (!avail) (void)fi_client_set_capacity(c, 0, 0);
        }
        if (fi_sched_pending(L.s) > 0) {
            char why[512], bwhy[384];
            if (fi_sched_step(L.s, why, sizeof why) < 0) {
                fprintf(stderr, "group leader: step failed, its requests ended: %s\n", why);
                if (fi_model_backend_failed(m, bwhy, sizeof bwhy)) {
                    /* for good (a GPU's failures are sticky): stop, so that
                     * the supervisor starts the leader again with a new
                     * device context (the ranks keep running; the group
                     * re-forms around it) */
                    snprintf(err, errlen, "the leader's backend failed for good (%s); stopping "
                             "so that it starts again with a new one", bwhy);
                    goto done;
                }
            }
        }
        /* The group's load and prefix filter ride on the heartbeats, as a
         * single worker's do (refreshed every 100 ms at most). */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
        if (now - last_load >= 0.1) {
            fi_sched_stats st;
            fi_sched_get_stats(L.s, &st);
            size_t nb = fi_prefix_filter_bytes(st.blocks_total); /* ~10 bits per block */
            uint8_t *filter = malloc(nb);
            int have = filter && fi_sched_prefix_filter(L.s, filter, nb) == 0;
            fi_client_set_load(c, (uint32_t)st.running, (uint32_t)st.queued,
                               (uint32_t)st.blocks_free, (uint32_t)st.blocks_total,
                               have ? filter : NULL, nb);
            free(filter);
            last_load = now;
        }
    }
    rc_ = 0;
done:
    fi_group_set_idle(g, NULL, NULL);
    for (int i = 0; i < L.n_held; i++) fi_wire_free(&L.held[i]);
    fi_sched_destroy(&L.s); /* ends the open requests ("shutting down") */
    while (L.open) {
        s_req *q = L.open;
        L.open = q->next;
        free(q);
    }
    (void)!fi_group_attach(g, NULL, err, errlen);
    return rc_;
}
