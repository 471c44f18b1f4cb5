/*
 * fi_group_coll.c - waits, sums and failure notices of a shard group's
 * passes. See fi_group_coll.h.
 */
#include "fi_group_coll.h"

#include <stdio.h>
#include <string.h>

#include "fi_wire.h"

static const char *s_kind_name(uint8_t k) {
    switch (k) {
    case FI_G_JOIN: return "join";
    case FI_G_JOIN_REPLY: return "join reply";
    case FI_G_BATCH: return "batch";
    case FI_G_PART: return "partial sum";
    case FI_G_ACT: return "activations";
    case FI_G_LOGITS: return "logits";
    case FI_G_FAIL: return "failure";
    case FI_G_NCCL: return "NCCL set-up";
    default: return "unknown";
    }
}

int fi_gcoll_wait(fi_gnet *n, int from, uint8_t kind, uint64_t pass, uint32_t op,
                  uint64_t deadline_ms, fi_gmsg **out, char *err, size_t errlen) {
    *out = NULL;
    for (;;) {
        fi_gmsg *f = fi_gnet_take(n, -1, FI_G_FAIL, pass);
        if (f) {
            int len = f->len > 400 ? 400 : (int)f->len;
            snprintf(err, errlen, "rank %d failed: %.*s", f->from, len, (const char *)f->data);
            fi_gmsg_free(&f);
            return -1;
        }
        fi_gmsg *m = fi_gnet_take(n, from, kind, pass);
        if (m) {
            if (op != UINT32_MAX && m->op != op) {
                snprintf(err, errlen,
                         "rank %d sent %s number %u of pass %llu where number %u was due "
                         "(the ranks disagree on the model's steps)",
                         from, s_kind_name(kind), m->op, (unsigned long long)pass, op);
                fi_gmsg_free(&m);
                return -1;
            }
            *out = m;
            return 0;
        }
        int down = fi_gnet_first_down(n);
        if (down < 0) down = fi_gnet_lost_since_mark(n); /* down and back: the pass is lost */
        if (down >= 0) {
            snprintf(err, errlen, "rank %d is down (link lost) while rank %d waited for %s from "
                                  "rank %d",
                     down, fi_gnet_rank(n), s_kind_name(kind), from);
            return -1;
        }
        /* The leader moved on (a newer pass, or a join after a failure):
         * this pass will never complete. */
        const fi_gmsg *lm = fi_gnet_peek(n, 0, FI_G_BATCH);
        if (fi_gnet_rank(n) != 0 && (fi_gnet_peek(n, 0, FI_G_JOIN) || (lm && lm->pass > pass))) {
            snprintf(err, errlen, "the leader abandoned pass %llu (it %s)",
                     (unsigned long long)pass, lm && lm->pass > pass ? "started a newer pass"
                                                                     : "asks this rank to join again");
            return -1;
        }
        uint64_t now = fi_wire_now_ms();
        if (now >= deadline_ms) {
            snprintf(err, errlen, "rank %d: no %s from rank %d within the pass time limit",
                     fi_gnet_rank(n), s_kind_name(kind), from);
            return -1;
        }
        fi_gnet_idle(n);
        uint64_t left = deadline_ms - now;
        if (fi_gnet_pump(n, left > 50 ? 50 : (int)left, err, errlen) < 0) return -1;
    }
}

int fi_gcoll_allreduce(fi_gnet *n, int first, int count, uint64_t pass, uint32_t op, float *x,
                       size_t len, float *acc, uint64_t deadline_ms, char *err, size_t errlen) {
    const int me = fi_gnet_rank(n);
    if (count <= 1) return 0;
    for (int r = first; r < first + count; r++) {
        if (r == me) continue;
        char e[256];
        if (fi_gnet_send(n, r, FI_G_PART, pass, op, x, len * sizeof(float), e, sizeof e) != 0) {
            snprintf(err, errlen, "rank %d: sum %u of pass %llu: %s", me, op,
                     (unsigned long long)pass, e);
            return -1;
        }
    }
    /* acc = x_first + x_first+1 + ... in this order on every rank. */
    for (int r = first; r < first + count; r++) {
        const float *v = x;
        fi_gmsg *m = NULL;
        if (r != me) {
            if (fi_gcoll_wait(n, r, FI_G_PART, pass, op, deadline_ms, &m, err, errlen) != 0)
                return -1;
            if (m->len != len * sizeof(float)) {
                snprintf(err, errlen, "rank %d sent %zu bytes for sum %u; %zu were due", r, m->len,
                         op, len * sizeof(float));
                fi_gmsg_free(&m);
                return -1;
            }
            v = m->data;
        }
        if (r == first) {
            memcpy(acc, v, len * sizeof(float));
        } else if ((uintptr_t)v % sizeof(float) == 0) {
            for (size_t i = 0; i < len; i++) acc[i] += v[i];
        } else { /* a short frame may sit unaligned inside its zmq_msg_t */
            for (size_t i = 0; i < len; i++) {
                float f;
                memcpy(&f, (const char *)v + i * sizeof f, sizeof f);
                acc[i] += f;
            }
        }
        fi_gmsg_free(&m);
    }
    memcpy(x, acc, len * sizeof(float));
    return 0;
}

void fi_gcoll_fail(fi_gnet *n, uint64_t pass, const char *why) {
    char e[128];
    for (int r = 0; r < fi_gnet_world(n); r++)
        if (r != fi_gnet_rank(n) && fi_gnet_up(n, r))
            (void)!fi_gnet_send(n, r, FI_G_FAIL, pass, 0, why, strlen(why), e, sizeof e);
}
