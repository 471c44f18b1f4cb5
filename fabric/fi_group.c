/*
 * fi_group.c - a shard group's rank: join, the leader's forward hook and
 * the other ranks' serving loop. See fi_group.h.
 */
#include "fi_group.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_group_coll.h"
#include "fi_group_nccl.h"
#include "fi_group_net.h"
#include "fi_wire.h"

#define S_JOIN_VERSION 1
#define S_JOIN_BYTES (4 * 8 + 2 * FI_GROUP_DIGEST_BYTES)
#define S_REPLY_MIN (4 * 4 + 2 * FI_GROUP_DIGEST_BYTES)
#define S_REPLY_OK 0
#define S_REPLY_REFUSED 1  /* layout or model differ: the rank gives up */
#define S_REPLY_NOT_READY 2 /* links to other ranks not up yet: ask again */

struct fi_group {
    fi_group_conf conf;                   /* the group file */
    int rank, stage, t;                   /* who we are */
    fi_gnet *net;                         /* links */
    fi_group_model mi;                    /* the model's shape */
    fi_shard_plan plans[FI_GROUP_MAX_RANKS]; /* every rank's part */
    uint8_t plan_digest[FI_GROUP_DIGEST_BYTES];
    uint8_t model_digest[FI_GROUP_DIGEST_BYTES];
    char plan_text[2048];                 /* canonical plan (logs) */
    fi_model *m;                          /* attached model (not owned) */
    int gpu;                              /* CUDA device of the NCCL communicator */
    char dead[512];                       /* the backend failed for good: why ("": no) */
    int host_mem;                         /* 1: the backend's memory is host memory */
    /* KV pool geometry (the leader's, sent in Join) */
    int n_blocks, max_tokens, max_out;
    unsigned geom_gen;                    /* bumped when the geometry changes */
    /* leader */
    uint64_t pass;                        /* last pass number given */
    unsigned joined_serial[FI_GROUP_MAX_RANKS]; /* link serial a rank joined on (0: none) */
    unsigned joined_geom[FI_GROUP_MAX_RANKS];   /* geometry it joined with */
    /* The mesh generation: bumped whenever a rank joins on a new link (a
     * restarted process, or a link that came back). Every other rank must
     * then join again, which makes it wait for its own link to the new
     * one: a rank's Join checks only its own links. */
    unsigned mesh_gen;
    unsigned joined_mesh[FI_GROUP_MAX_RANKS];   /* generation it joined in */
    /* The last Join sent to each rank: its number (the reply echoes it in
     * op) and what held when it was sent, so a reply counts only for the
     * link, geometry and generation it answered. */
    uint32_t join_seq;                    /* Joins sent so far, all ranks */
    uint32_t join_sent_seq[FI_GROUP_MAX_RANKS];
    unsigned join_sent_serial[FI_GROUP_MAX_RANKS];
    unsigned join_sent_geom[FI_GROUP_MAX_RANKS];
    unsigned join_sent_mesh[FI_GROUP_MAX_RANKS];
    unsigned refused_serial[FI_GROUP_MAX_RANKS];/* link serial it was refused on */
    char refused_why[FI_GROUP_MAX_RANKS][512];
    uint64_t join_sent_ms[FI_GROUP_MAX_RANKS];
    char status[640];                     /* fi_group_status */
    char logged[640];                     /* the status last logged while unavailable */
    uint64_t logged_ms;                   /* when (the leader's "still" lines) */
    uint64_t waiting_since_ms;            /* unavailable since (0: available) */
    /* the pass in progress */
    uint64_t cur_pass;
    uint32_t op;                          /* next sum's number */
    uint64_t deadline_ms;
    float *acc, *hostx;                   /* sum scratch, host copy of device vectors */
    size_t acc_cap, hostx_cap;            /* floats in each */
    float *xa, *xb;                       /* stage input / output rows */
    size_t xa_cap, xb_cap;                /* floats in each */
    float *logits;                        /* follower's logits (last stage, TP rank 0) */
    size_t logits_cap;
    int32_t *rows;                        /* a micro-batch's wanted rows */
    size_t rows_cap;
    /* NCCL (collective = nccl): one communicator over the ranks, formed
     * by the leader once every rank has joined, again after any rejoin */
    fi_gnccl *nccl;
    unsigned nccl_members[FI_GROUP_MAX_RANKS]; /* link serials it was formed with */
    /* follower */
    fi_kvpool *kv;                        /* made at Join */
    int kv_blocks, kv_tokens, kv_out;     /* its geometry */
    fi_group_stats st;                    /* figures */
    int has_idle;                         /* fi_group_set_idle gave work */
};

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void s_put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static uint32_t s_get32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Grows a float buffer to at least n floats. 0, or -1. */
static int s_grow(float **p, size_t *cap, size_t n) {
    if (*cap >= n) return 0;
    float *q = realloc(*p, n * sizeof **p);
    if (!q) return -1;
    *p = q;
    *cap = n;
    return 0;
}

static int s_grow_rows(fi_group *g, int n) {
    if (g->rows_cap >= (size_t)n && g->rows) return 0;
    int32_t *q = realloc(g->rows, (n > 0 ? (size_t)n : 1) * sizeof *q);
    if (!q) return -1;
    g->rows = q;
    g->rows_cap = n > 0 ? (size_t)n : 1;
    return 0;
}

/* What a rank takes at all (fi_gnet_set_filter), by kind, sender and
 * pass: set-up messages have pass 0 and go between the leader and the
 * others; a pass's messages have its number and go where the pass sends
 * them; the leader gave every pass number itself, so a newer one is not
 * real. The rest is dropped on arrival. */
static int s_keep(void *user, int from, uint8_t kind, uint64_t pass) {
    const fi_group *g = user;
    const int tp = g->conf.tp, leader = g->rank == 0;
    if (leader && pass > g->pass) return 0;
    switch (kind) {
    case FI_G_JOIN: return !leader && from == 0 && pass == 0;
    case FI_G_NCCL: return !leader && from == 0 && pass == 0 && g->conf.coll == FI_GROUP_COLL_NCCL;
    case FI_G_JOIN_REPLY: return leader && pass == 0;
    case FI_G_BATCH: return !leader && from == 0 && pass != 0;
    case FI_G_PART: return pass != 0 && tp > 1 && fi_group_stage(&g->conf, from) == g->stage;
    case FI_G_ACT: return pass != 0 && from == g->rank - tp;
    case FI_G_LOGITS: return leader && pass != 0 && from == (g->conf.pp - 1) * tp;
    case FI_G_FAIL: return pass != 0;
    default: return 0;
    }
}

fi_group *fi_group_new(const fi_group_conf *conf, int rank, const fi_keypair *kp,
                       const fi_group_model *model, const uint8_t model_digest[FI_GROUP_DIGEST_BYTES],
                       char *err, size_t errlen) {
    fi_group *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    g->conf = *conf;
    g->rank = rank;
    g->stage = fi_group_stage(conf, rank);
    g->t = fi_group_tp_rank(conf, rank);
    g->mi = *model;
    memcpy(g->model_digest, model_digest, FI_GROUP_DIGEST_BYTES);
    if (fi_group_plan_make(conf, model, g->plans, err, errlen) != 0) goto fail;
    if (conf->coll == FI_GROUP_COLL_NCCL) {
        if (conf->pp > 1) {
            snprintf(err, errlen, "%s: collective = nccl sums over the GPUs of one machine in one "
                                  "stage; with %d stages use collective = zmq",
                     conf->path, conf->pp);
            goto fail;
        }
        if (!fi_gnccl_built()) {
            snprintf(err, errlen, "%s: collective = nccl, but this build has no CUDA backend "
                                  "(configure with -DFEDINFER_CUDA=ON)",
                     conf->path);
            goto fail;
        }
    }
    fi_group_plan_digest(conf, g->plans, g->plan_digest);
    fi_group_plan_text(conf, g->plans, g->plan_text, sizeof g->plan_text);
    /* Passes are numbered from the clock (microseconds), so that the
     * passes of a restarted leader are newer than any leftover. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    g->pass = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
    if (!(g->net = fi_gnet_new(conf, rank, kp, err, errlen))) goto fail;
    fi_gnet_set_filter(g->net, s_keep, g);
    snprintf(g->status, sizeof g->status, "starting");
    return g;
fail:
    fi_group_destroy(&g);
    return NULL;
}

void fi_group_destroy(fi_group **gp) {
    if (!gp || !*gp) return;
    fi_group *g = *gp;
    if (g->m) fi_model_set_allreduce(g->m, NULL, NULL);
    fi_gnccl_destroy(&g->nccl);
    fi_kvpool_destroy(&g->kv);
    fi_gnet_destroy(&g->net);
    free(g->acc);
    free(g->hostx);
    free(g->xa);
    free(g->xb);
    free(g->logits);
    free(g->rows);
    free(g);
    *gp = NULL;
}

const fi_shard_plan *fi_group_plan(const fi_group *g) { return &g->plans[g->rank]; }
const uint8_t *fi_group_plan_digest_bytes(const fi_group *g) { return g->plan_digest; }
const char *fi_group_plan_str(const fi_group *g) { return g->plan_text; }
int fi_group_rank(const fi_group *g) { return g->rank; }
static void s_install_hooks(fi_group *g);

void fi_group_set_idle(fi_group *g, void (*fn)(void *user), void *user) {
    fi_gnet_set_idle(g->net, fn, user);
    g->has_idle = fn != NULL;
    if (g->m) s_install_hooks(g);
}

void fi_group_get_stats(const fi_group *g, fi_group_stats *st) {
    *st = g->st;
    fi_gnet_counters(g->net, &st->bytes_sent, &st->msgs_sent);
}

/* --- the stage's sum -------------------------------------------------- */

/* err = "rank R: WHAT: <the backend's error>". */
static void s_dev_err(const fi_group *g, const fi_backend *be, const char *what, char *err,
                      size_t errlen) {
    const char *why = be->ops->last_error ? be->ops->last_error(be->ctx) : NULL;
    snprintf(err, errlen, "rank %d: %s: %s", g->rank, what, why ? why : "backend error");
}

static int s_allreduce(void *user, float *x, size_t n, char *err, size_t errlen) {
    fi_group *g = user;
    double t0 = s_now();
    int rc = -1;
    if (s_grow(&g->acc, &g->acc_cap, n) != 0 ||
        (!g->host_mem && s_grow(&g->hostx, &g->hostx_cap, n) != 0)) {
        snprintf(err, errlen, "rank %d: out of memory for a sum of %zu floats", g->rank, n);
        goto done;
    }
    if (g->conf.coll == FI_GROUP_COLL_NCCL) {
        fi_backend *dev = fi_model_backend(g->m);
        if (!g->nccl) {
            snprintf(err, errlen, "rank %d: no NCCL communicator (the group is re-forming)",
                     g->rank);
            goto done;
        }
        if (dev->ops->sync(dev->ctx) != 0) {
            s_dev_err(g, dev, "the device failed before the sum", err, errlen);
            goto done;
        }
        if (fi_gnccl_sum(g->nccl, x, n, err, errlen) != 0) {
            /* an aborted communicator is no use again: the leader forms a
             * new one before the next pass (s_nccl_current) */
            fi_gnccl_destroy(&g->nccl);
            goto done;
        }
        g->st.allreduces++;
        rc = 0;
        goto done;
    }
    float *h = x;
    fi_backend *be = g->host_mem ? NULL : fi_model_backend(g->m);
    if (be) {
        h = g->hostx;
        if (be->ops->sync(be->ctx) != 0 ||
            be->ops->to_host(be->ctx, h, x, n * sizeof(float)) != 0) {
            s_dev_err(g, be, "cannot copy a partial sum to the host", err, errlen);
            goto done;
        }
    }
    if (fi_gcoll_allreduce(g->net, g->stage * g->conf.tp, g->conf.tp, g->cur_pass, g->op++, h, n,
                           g->acc, g->deadline_ms, err, errlen) != 0)
        goto done;
    if (be && be->ops->to_backend(be->ctx, x, h, n * sizeof(float)) != 0) {
        s_dev_err(g, be, "cannot copy a sum back to the device", err, errlen);
        goto done;
    }
    g->st.allreduces++;
    rc = 0;
done:
    g->st.comm_s += s_now() - t0;
    return rc;
}

/* Without TP sums, a stage's pass never waits on the links, so a leader
 * with a long pass (a big model's prefill) would not serve its idle work
 * (the coordinator's heartbeats) for the whole pass: the same hook, called
 * twice per layer, then only does that. (On the CPU only: a hook turns off
 * the CUDA backend's recorded decode graphs.) */
static int s_idle_only(void *user, float *x, size_t n, char *err, size_t errlen) {
    (void)x, (void)n, (void)err, (void)errlen;
    fi_gnet_idle(((fi_group *)user)->net);
    return 0;
}

static void s_install_hooks(fi_group *g) {
    if (g->conf.tp > 1) fi_model_set_allreduce(g->m, s_allreduce, g);
    else if (g->has_idle && g->host_mem) fi_model_set_allreduce(g->m, s_idle_only, g);
    else fi_model_set_allreduce(g->m, NULL, NULL);
}

int fi_group_attach(fi_group *g, fi_model *m, char *err, size_t errlen) {
    if (g->m) fi_model_set_allreduce(g->m, NULL, NULL);
    g->m = m;
    if (!m) return 0;
    const fi_shard_plan *p = fi_model_plan(m), *want = &g->plans[g->rank];
    if (p->layer_begin != want->layer_begin || p->layer_end != want->layer_end ||
        p->kv_head_begin != want->kv_head_begin || p->kv_head_count != want->kv_head_count ||
        p->ffn_begin != want->ffn_begin || p->ffn_count != want->ffn_count ||
        p->no_embed != want->no_embed || p->no_output != want->no_output) {
        snprintf(err, errlen, "rank %d: the model was loaded with another plan than the group's",
                 g->rank);
        g->m = NULL;
        return -1;
    }
    const char *name = fi_model_backend(m)->ops->name;
    g->host_mem = name && !strcmp(name, "cpu");
    if (g->conf.coll == FI_GROUP_COLL_NCCL && g->host_mem) {
        snprintf(err, errlen, "rank %d: collective = nccl needs the model on a GPU (device = cuda)",
                 g->rank);
        g->m = NULL;
        return -1;
    }
    s_install_hooks(g);
    return 0;
}

/* --- batches on the wire ----------------------------------------------
 * u32 n, n_seqs, max_blocks, n_out; i32 tok[n], pos[n], seq[n],
 * tables[n_seqs * max_blocks], out_rows[n_out]. */

static uint8_t *s_batch_encode(const fi_batch *b, size_t *len) {
    size_t nt = (size_t)b->n_seqs * (size_t)b->max_blocks;
    size_t words = 4 + 3 * (size_t)b->n + nt + (size_t)b->n_out;
    uint8_t *p = malloc(words * 4), *w = p;
    if (!p) return NULL;
    s_put32(w, (uint32_t)b->n);
    s_put32(w + 4, (uint32_t)b->n_seqs);
    s_put32(w + 8, (uint32_t)b->max_blocks);
    s_put32(w + 12, (uint32_t)b->n_out);
    w += 16;
    memcpy(w, b->tok, (size_t)b->n * 4);
    w += (size_t)b->n * 4;
    memcpy(w, b->pos, (size_t)b->n * 4);
    w += (size_t)b->n * 4;
    memcpy(w, b->seq, (size_t)b->n * 4);
    w += (size_t)b->n * 4;
    if (nt) memcpy(w, b->tables, nt * 4);
    w += nt * 4;
    if (b->n_out) memcpy(w, b->out_rows, (size_t)b->n_out * 4);
    *len = words * 4;
    return p;
}

/* Points b's arrays into a received payload (which must stay alive and be
 * 4-byte aligned; copied otherwise into *copy). 0, or -1 with a message. */
static int s_batch_decode(const fi_gmsg *m, fi_batch *b, void **copy, char *err, size_t errlen) {
    *copy = NULL;
    if (m->len < 16) goto bad;
    const uint8_t *p = m->data;
    uint32_t n = s_get32(p), ns = s_get32(p + 4), mb = s_get32(p + 8), no = s_get32(p + 12);
    if (n == 0 || n > (1u << 20) || ns == 0 || ns > (1u << 16) || mb > (1u << 20) || no > n)
        goto bad;
    uint64_t words = 4 + 3ull * n + (uint64_t)ns * mb + no;
    if (words * 4 != m->len) goto bad;
    if ((uintptr_t)p % 4) {
        if (!(*copy = malloc(m->len))) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        memcpy(*copy, p, m->len);
        p = *copy;
    }
    const int32_t *w = (const int32_t *)(p + 16);
    b->n = (int)n;
    b->tok = w;
    b->pos = w + n;
    b->seq = w + 2 * n;
    b->n_seqs = (int)ns;
    b->tables = w + 3 * n;
    b->max_blocks = (int)mb;
    b->out_rows = w + 3 * n + (size_t)ns * mb;
    b->n_out = (int)no;
    b->argmax = NULL;
    return 0;
bad:
    snprintf(err, errlen, "rank %d sent a malformed batch (%zu bytes)", m->from, m->len);
    return -1;
}

/* --- the leader: join ---------------------------------------------------- */

void fi_group_set_gpu(fi_group *g, int gpu) {
    g->gpu = gpu;
}

void fi_group_set_pool(fi_group *g, int n_blocks, int max_tokens, int max_out) {
    if (n_blocks == g->n_blocks && max_tokens == g->max_tokens && max_out == g->max_out) return;
    g->n_blocks = n_blocks;
    g->max_tokens = max_tokens;
    g->max_out = max_out;
    g->geom_gen++;
}

static int s_nccl_current(const fi_group *g);

static int s_joined(const fi_group *g, int r) {
    return r == g->rank || (fi_gnet_up(g->net, r) && g->joined_serial[r] &&
                            g->joined_serial[r] == fi_gnet_link_serial(g->net, r) &&
                            g->joined_geom[r] == g->geom_gen && g->joined_mesh[r] == g->mesh_gen);
}

/* 1 when the NCCL communicator was formed with the ranks as they are now
 * (always 1 with the ZeroMQ collective). */
static int s_nccl_current(const fi_group *g) {
    if (g->conf.coll != FI_GROUP_COLL_NCCL) return 1;
    if (!g->nccl) return 0;
    for (int r = 0; r < g->conf.world; r++)
        if (r != g->rank && g->nccl_members[r] != fi_gnet_link_serial(g->net, r)) return 0;
    return 1;
}

int fi_group_available(const fi_group *g) {
    for (int r = 0; r < g->conf.world; r++)
        if (!s_joined(g, r)) return 0;
    return g->geom_gen > 0 && s_nccl_current(g);
}

const char *fi_group_status(const fi_group *g) { return g->status; }

static void s_update_status(fi_group *g) {
    if (g->geom_gen == 0) {
        snprintf(g->status, sizeof g->status, "the leader has no KV pool yet");
        return;
    }
    for (int r = 0; r < g->conf.world; r++) {
        if (s_joined(g, r)) continue;
        unsigned ser = fi_gnet_link_serial(g->net, r);
        if (!fi_gnet_up(g->net, r))
            snprintf(g->status, sizeof g->status, "rank %d: link down (%s)", r,
                     g->conf.endpoint[r]);
        else if (g->refused_serial[r] == ser)
            snprintf(g->status, sizeof g->status, "rank %d refused: %s", r, g->refused_why[r]);
        else
            snprintf(g->status, sizeof g->status, "rank %d: joining", r);
        return;
    }
    if (!s_nccl_current(g)) {
        snprintf(g->status, sizeof g->status, "every rank joined; the NCCL communicator is not "
                                              "formed yet");
        return;
    }
    snprintf(g->status, sizeof g->status, "available");
}

/* While the group is unavailable, the leader says why when that changes
 * and again every S_WAIT_LOG_MS, so that ranks that never come up (a
 * wrong endpoint, a firewall, a rank not started) do not leave it
 * silent. */
#define S_WAIT_LOG_MS 30000
static void s_log_waiting(fi_group *g, int available, uint64_t now) {
    if (available) {
        g->waiting_since_ms = 0;
        g->logged[0] = 0;
        return;
    }
    if (!g->waiting_since_ms) g->waiting_since_ms = now;
    if (strcmp(g->logged, g->status) != 0 && now - g->logged_ms >= 1000) { /* flaps: 1 a second */
        fprintf(stderr, "group %s: waiting: %s\n", g->conf.name, g->status);
        snprintf(g->logged, sizeof g->logged, "%s", g->status);
        g->logged_ms = now;
    } else if (now - g->logged_ms >= S_WAIT_LOG_MS) {
        fprintf(stderr, "group %s: still unavailable after %llu s: %s\n", g->conf.name,
                (unsigned long long)((now - g->waiting_since_ms) / 1000), g->status);
        g->logged_ms = now;
    }
}

static void s_send_join(fi_group *g, int r) {
    uint8_t p[S_JOIN_BYTES];
    s_put32(p, S_JOIN_VERSION);
    s_put32(p + 4, (uint32_t)g->conf.world);
    s_put32(p + 8, (uint32_t)g->conf.tp);
    s_put32(p + 12, (uint32_t)g->conf.pp);
    s_put32(p + 16, (uint32_t)r);
    s_put32(p + 20, (uint32_t)g->n_blocks);
    s_put32(p + 24, (uint32_t)g->max_tokens);
    s_put32(p + 28, (uint32_t)g->max_out);
    memcpy(p + 32, g->model_digest, FI_GROUP_DIGEST_BYTES);
    memcpy(p + 32 + FI_GROUP_DIGEST_BYTES, g->plan_digest, FI_GROUP_DIGEST_BYTES);
    char e[256];
    /* The Join's number rides in op (the reply echoes it); what it was
     * sent for stays here. */
    uint32_t seq = ++g->join_seq;
    if (fi_gnet_send(g->net, r, FI_G_JOIN, 0, seq, p, sizeof p, e, sizeof e) == 0) {
        g->join_sent_ms[r] = fi_wire_now_ms();
        g->join_sent_seq[r] = seq;
        g->join_sent_serial[r] = fi_gnet_link_serial(g->net, r);
        g->join_sent_geom[r] = g->geom_gen;
        g->join_sent_mesh[r] = g->mesh_gen;
    }
}

static void s_take_reply(fi_group *g, fi_gmsg *m) {
    const int r = m->from;
    const unsigned ser = fi_gnet_link_serial(g->net, r);
    const uint8_t *p = m->data;
    char ours[FI_GROUP_DIGEST_HEX], theirs[FI_GROUP_DIGEST_HEX];
    if (m->len < S_REPLY_MIN || s_get32(p) != S_JOIN_VERSION) {
        g->refused_serial[r] = ser;
        snprintf(g->refused_why[r], sizeof g->refused_why[r],
                 "malformed join reply (%zu bytes; another fedinfer version?)", m->len);
        goto refused;
    }
    uint32_t status = s_get32(p + 4), rank = s_get32(p + 8), world = s_get32(p + 12);
    const uint8_t *md = p + 16, *pd = p + 16 + FI_GROUP_DIGEST_BYTES;
    int tl = (int)(m->len - S_REPLY_MIN);
    const char *text = (const char *)p + S_REPLY_MIN;
    if (status == S_REPLY_NOT_READY) return; /* asked again later */
    if (status != S_REPLY_OK) {
        g->refused_serial[r] = ser;
        snprintf(g->refused_why[r], sizeof g->refused_why[r], "%.*s", tl > 400 ? 400 : tl, text);
        goto refused;
    }
    if (rank != (uint32_t)r || world != (uint32_t)g->conf.world) {
        g->refused_serial[r] = ser;
        snprintf(g->refused_why[r], sizeof g->refused_why[r],
                 "it says it is rank %u of %u; the group file says rank %d of %d", rank, world, r,
                 g->conf.world);
        goto refused;
    }
    if (memcmp(md, g->model_digest, FI_GROUP_DIGEST_BYTES)) {
        fi_group_digest_hex(md, theirs);
        fi_group_digest_hex(g->model_digest, ours);
        g->refused_serial[r] = ser;
        snprintf(g->refused_why[r], sizeof g->refused_why[r],
                 "model digest %.16s... differs from the leader's %.16s... (another model file)",
                 theirs, ours);
        goto refused;
    }
    if (memcmp(pd, g->plan_digest, FI_GROUP_DIGEST_BYTES)) {
        fi_group_digest_hex(pd, theirs);
        fi_group_digest_hex(g->plan_digest, ours);
        g->refused_serial[r] = ser;
        snprintf(g->refused_why[r], sizeof g->refused_why[r],
                 "plan digest %.16s... differs from the leader's %.16s... (another group file: "
                 "world, tp, splits or weights)",
                 theirs, ours);
        goto refused;
    }
    /* An answer to an older Join, or to one sent on an earlier link of r
     * or for another geometry: r is asked again. */
    if (m->op != g->join_sent_seq[r] || g->join_sent_serial[r] != ser ||
        g->join_sent_geom[r] != g->geom_gen)
        return;
    if (g->joined_serial[r] != ser) {
        /* r is new on this link: the others must see it too (each checks
         * its own links to every rank when it answers a Join) */
        g->joined_mesh[r] = ++g->mesh_gen;
    } else {
        g->joined_mesh[r] = g->join_sent_mesh[r];
    }
    g->joined_serial[r] = ser;
    g->joined_geom[r] = g->geom_gen;
    if (g->joined_mesh[r] == g->mesh_gen)
        fprintf(stderr, "group %s: rank %d joined (%s)\n", g->conf.name, r, g->conf.endpoint[r]);
    return;
refused:
    fprintf(stderr, "group %s: rank %d refused at join: %s\n", g->conf.name, r,
            g->refused_why[r]);
}

/* The leader forms the NCCL communicator over every rank: a fresh id to
 * each, then its own rank 0, which returns once all have called in. The
 * old communicator is destroyed only after the id has gone out: the other
 * ranks destroy theirs when the id arrives, and recent NCCL may make the
 * destruction wait for every rank of the machine, which would never come
 * if the leader destroyed first. Known limit: a rank that dies before
 * calling in leaves the others blocked in NCCL's set-up (fi_nccl aborts a
 * stuck reduction, not a stuck set-up). */
static int s_nccl_form(fi_group *g, char *err, size_t errlen) {
    uint8_t id[FI_GNCCL_ID_BYTES];
    if (fi_gnccl_id_new(id, err, errlen) != 0) return -1;
    for (int r = 1; r < g->conf.world; r++)
        if (fi_gnet_send(g->net, r, FI_G_NCCL, 0, (uint32_t)g->conf.world, id, sizeof id, err,
                         errlen) != 0) {
            /* the ranks that got the id have dropped their communicator:
             * the old one is no longer the group's (s_nccl_current) */
            memset(g->nccl_members, 0, sizeof g->nccl_members);
            return -1;
        }
    fi_gnccl_destroy(&g->nccl);
    if (!(g->nccl = fi_gnccl_new(id, g->conf.world, 0, g->gpu, err, errlen))) return -1;
    for (int r = 0; r < g->conf.world; r++) g->nccl_members[r] = fi_gnet_link_serial(g->net, r);
    fprintf(stderr, "group %s: NCCL communicator formed over %d ranks\n", g->conf.name,
            g->conf.world);
    return 0;
}

int fi_group_lead_poll(fi_group *g, int timeout_ms, char *err, size_t errlen) {
    if (fi_gnet_pump(g->net, timeout_ms, err, errlen) < 0) return -1;
    fi_gmsg *m;
    while ((m = fi_gnet_take(g->net, -1, FI_G_JOIN_REPLY, UINT64_MAX))) {
        s_take_reply(g, m);
        fi_gmsg_free(&m);
    }
    /* Between passes nothing of a pass given so far is waited for: what
     * is left of failed passes goes (failure notices included). */
    fi_gnet_drop_before(g->net, g->pass + 1);
    uint64_t now = fi_wire_now_ms();
    uint64_t again = (uint64_t)(g->conf.heartbeat_ms * 2 > 300 ? g->conf.heartbeat_ms * 2 : 300);
    for (int r = 0; r < g->conf.world && g->geom_gen; r++) {
        if (s_joined(g, r) || !fi_gnet_up(g->net, r)) continue;
        if (g->refused_serial[r] == fi_gnet_link_serial(g->net, r)) continue;
        /* at once when a rank joined since r was last asked */
        if (now - g->join_sent_ms[r] >= again || g->join_sent_mesh[r] != g->mesh_gen)
            s_send_join(g, r);
    }
    if (g->conf.coll == FI_GROUP_COLL_NCCL && !s_nccl_current(g)) {
        int all = g->geom_gen > 0;
        for (int r = 0; r < g->conf.world; r++) all &= s_joined(g, r);
        if (all && s_nccl_form(g, err, errlen) != 0)
            fprintf(stderr, "group %s: NCCL: %s\n", g->conf.name, err);
    }
    int was = !strcmp(g->status, "available");
    s_update_status(g);
    int is = fi_group_available(g);
    if (was && !is) {
        fprintf(stderr, "group %s: unavailable: %s\n", g->conf.name, g->status);
        snprintf(g->logged, sizeof g->logged, "%s", g->status); /* said: s_log_waiting */
        g->logged_ms = g->waiting_since_ms = now;
    }
    if (!was && is) fprintf(stderr, "group %s: available (%s)\n", g->conf.name, g->plan_text);
    s_log_waiting(g, is, now);
    return is;
}

/* --- passes ----------------------------------------------------------- */

/* Micro-batch k of b: tokens [a, e), their wanted rows rebased into
 * rows (room for b->n_out), the first of them b's row *first. */
static void s_micro(const fi_batch *b, int a, int e, int32_t *rows, fi_batch *mb, int *first) {
    int i = 0, j;
    while (i < b->n_out && b->out_rows[i] < a) i++;
    for (j = i; j < b->n_out && b->out_rows[j] < e; j++) rows[j - i] = b->out_rows[j] - a;
    *mb = *b;
    mb->n = e - a;
    mb->tok = b->tok + a;
    mb->pos = b->pos + a;
    mb->seq = b->seq + a;
    mb->out_rows = rows;
    mb->n_out = j - i;
    mb->argmax = b->argmax ? b->argmax + i : NULL;
    *first = i;
}

/* Runs this rank's part of micro-batch k of the pass in progress: input
 * from the previous stage, its slice, output to the next stage or the
 * leader. logits: where the leader wants this micro-batch's rows (leader
 * only). Activations and logits carry k as their op, so a rank that cut
 * the pass otherwise is caught. */
static int s_run_micro(fi_group *g, fi_kvpool *kv, const fi_batch *b, uint32_t k, float *logits,
                       char *err, size_t errlen) {
    const int tp = g->conf.tp, pp = g->conf.pp, dim = g->mi.dim;
    const size_t rows = (size_t)b->n * (size_t)dim;
    const size_t nlog = (size_t)b->n_out * (size_t)g->mi.n_vocab;
    const int last = g->stage == pp - 1;
    double t0 = s_now();
    const float *x_in = NULL;
    if (g->stage > 0) {
        fi_gmsg *m = NULL;
        if (fi_gcoll_wait(g->net, g->rank - tp, FI_G_ACT, g->cur_pass, k, g->deadline_ms, &m, err,
                          errlen) != 0)
            goto comm_fail;
        if (m->len != rows * sizeof(float)) {
            snprintf(err, errlen, "rank %d sent %zu bytes of activations; %zu were due", m->from,
                     m->len, rows * sizeof(float));
            fi_gmsg_free(&m);
            goto comm_fail;
        }
        memcpy(g->xa, m->data, m->len);
        fi_gmsg_free(&m);
        x_in = g->xa;
    }
    g->st.wait_s += s_now() - t0;
    double c0 = s_now(), comm_before = g->st.comm_s;
    float *out_logits = NULL;
    if (last && g->t == 0) {
        if (g->rank == 0) {
            out_logits = logits;
        } else {
            if (s_grow(&g->logits, &g->logits_cap, nlog ? nlog : 1) != 0) {
                snprintf(err, errlen, "rank %d: out of memory for logits", g->rank);
                return -1;
            }
            out_logits = g->logits;
        }
    }
    /* Only the rank with the output makes logits; the others run the same
     * tokens without asking for rows. */
    fi_batch mine = *b;
    if (g->plans[g->rank].no_output) mine.n_out = 0;
    int rc = fi_model_forward(g->m, kv, &mine, x_in, last ? NULL : g->xb, out_logits, err, errlen);
    g->st.compute_s += (s_now() - c0) - (g->st.comm_s - comm_before);
    g->st.micro++;
    if (rc != 0) return -1;
    double t1 = s_now();
    if (!last) {
        if (fi_gnet_send(g->net, g->rank + tp, FI_G_ACT, g->cur_pass, k, g->xb,
                         rows * sizeof(float), err, errlen) != 0)
            goto comm_fail;
    } else if (g->t == 0 && g->rank != 0) {
        if (fi_gnet_send(g->net, 0, FI_G_LOGITS, g->cur_pass, k, g->logits, nlog * sizeof(float),
                         err, errlen) != 0)
            goto comm_fail;
    }
    g->st.comm_s += s_now() - t1;
    return 0;
comm_fail:
    g->st.wait_s += s_now() - t0;
    return -1;
}

/* Runs this rank's part of the pass in progress over batch b, micro-batch
 * by micro-batch (fi_group_micro_split): while this stage runs one, the
 * next stage runs the one before. Splitting changes no result on the CPU
 * backend: a token's computation does not depend on the other tokens of
 * its batch, and the tokens of a micro-batch find in the KV cache every
 * earlier one (this stage ran the micro-batches before it already). (The
 * CUDA backend's products and attention may choose their algorithm by
 * the batch's size.) logits: where the leader wants them (leader only; with
 * stages, it then collects them from the last stage). */
static int s_run_pass(fi_group *g, fi_kvpool *kv, const fi_batch *b, float *logits, char *err,
                      size_t errlen) {
    /* the whole batch first (the leader did before sending it): a piece
     * is checked only for itself, and a wanted row outside every piece
     * would be skipped */
    if (g->rank != 0 && fi_batch_check(g->m, kv, b, err, errlen) != 0) return -1;
    const size_t rows = (size_t)b->n * (size_t)g->mi.dim;
    if (s_grow(&g->xa, &g->xa_cap, rows) != 0 || s_grow(&g->xb, &g->xb_cap, rows) != 0 ||
        s_grow_rows(g, b->n_out) != 0) {
        snprintf(err, errlen, "rank %d: out of memory for %zu activations", g->rank, rows);
        return -1;
    }
    int at[FI_GROUP_MICRO_MAX + 1];
    const int m = fi_group_micro_split(&g->conf, b->n, at);
    for (int k = 0; k < m; k++) {
        fi_batch mb;
        int first;
        s_micro(b, at[k], at[k + 1], g->rows, &mb, &first);
        float *lg = logits ? logits + (size_t)first * (size_t)g->mi.n_vocab : NULL;
        if (s_run_micro(g, kv, &mb, (uint32_t)k, lg, err, errlen) != 0) return -1;
    }
    if (g->rank != 0 || g->conf.pp == 1) return 0;
    /* the leader, with stages: the last stage's logits, a message per
     * micro-batch */
    for (int k = 0; k < m; k++) {
        fi_batch mb;
        int first;
        s_micro(b, at[k], at[k + 1], g->rows, &mb, &first);
        const size_t nlog = (size_t)mb.n_out * (size_t)g->mi.n_vocab;
        double t1 = s_now();
        fi_gmsg *lm = NULL;
        int wr = fi_gcoll_wait(g->net, (g->conf.pp - 1) * g->conf.tp, FI_G_LOGITS, g->cur_pass,
                               (uint32_t)k, g->deadline_ms, &lm, err, errlen);
        g->st.wait_s += s_now() - t1;
        if (wr != 0) return -1;
        if (lm->len != nlog * sizeof(float)) {
            snprintf(err, errlen, "rank %d sent %zu bytes of logits; %zu were due", lm->from,
                     lm->len, nlog * sizeof(float));
            fi_gmsg_free(&lm);
            return -1;
        }
        if (nlog) memcpy(logits + (size_t)first * (size_t)g->mi.n_vocab, lm->data, lm->len);
        fi_gmsg_free(&lm);
    }
    return 0;
}

int fi_group_forward(void *user, fi_model *m, fi_kvpool *kv, const fi_batch *b, float *logits,
                     char *err, size_t errlen) {
    fi_group *g = user;
    const uint64_t pass = ++g->pass;
    char why[512] = "";
    int rc = -1;
    uint8_t *buf = NULL;
    if (m != g->m) {
        snprintf(err, errlen, "shard group: the scheduler's model is not the group's");
        return -1;
    }
    if (!fi_group_available(g)) {
        snprintf(err, errlen, "shard group %s unavailable: %s", g->conf.name, g->status);
        return -1;
    }
    if (fi_batch_check(m, kv, b, why, sizeof why) != 0) {
        snprintf(err, errlen, "shard group %s: %s", g->conf.name, why);
        return -1;
    }
    /* A pass's activations between two stages, and its logits, may wait
     * whole at a rank (the leader reads the logits once its own pieces
     * are done), and one sender may have 2 x FI_GNET_MAX_MSG waiting: one
     * pass's worth must fit in one message, cut or not. */
    const size_t act_bytes = (size_t)b->n * (size_t)g->mi.dim * sizeof(float);
    const size_t log_bytes = (size_t)b->n_out * (size_t)g->mi.n_vocab * sizeof(float);
    if (b->n > 0 && b->n_out >= 0 && g->conf.pp > 1 &&
        (act_bytes > FI_GNET_MAX_MSG || log_bytes > FI_GNET_MAX_MSG)) {
        snprintf(err, errlen, "shard group %s: a pass of %d tokens and %d rows of logits moves "
                              "%zu bytes of %s between ranks; the limit is %d",
                 g->conf.name, b->n, b->n_out, act_bytes > log_bytes ? act_bytes : log_bytes,
                 act_bytes > log_bytes ? "activations" : "logits", FI_GNET_MAX_MSG);
        return -1;
    }
    g->st.passes++;
    fi_gnet_drop_before(g->net, pass);
    fi_gnet_mark(g->net);
    g->cur_pass = pass;
    g->op = 0;
    g->deadline_ms = fi_wire_now_ms() + FI_GROUP_PASS_TIMEOUT_MS;
    double t0 = s_now();
    size_t len = 0;
    if (!(buf = s_batch_encode(b, &len))) {
        snprintf(why, sizeof why, "out of memory");
        goto done;
    }
    for (int r = 1; r < g->conf.world; r++)
        if (fi_gnet_send(g->net, r, FI_G_BATCH, pass, 0, buf, len, why, sizeof why) != 0)
            goto done;
    g->st.comm_s += s_now() - t0;
    if (s_run_pass(g, kv, b, logits, why, sizeof why) != 0) goto done;
    rc = 0;
done:
    free(buf);
    if (rc != 0) {
        g->st.failed++;
        fi_gcoll_fail(g->net, pass, why);
        snprintf(err, errlen, "shard group %s: pass failed: %s", g->conf.name, why);
        /* A rank found down is no longer joined: the group is unavailable
         * until it is back and has joined again. */
        s_update_status(g);
    }
    return rc;
}

/* --- the other ranks --------------------------------------------------- */

/* Answers a Join; 0 when sent, -1 (logged) when the leader's link is down. */
static int s_reply(fi_group *g, uint32_t status, uint32_t geom, const char *text) {
    size_t tl = text ? strlen(text) : 0;
    if (tl > 1000) tl = 1000;
    uint8_t p[S_REPLY_MIN + 1000];
    s_put32(p, S_JOIN_VERSION);
    s_put32(p + 4, status);
    s_put32(p + 8, (uint32_t)g->rank);
    s_put32(p + 12, (uint32_t)g->conf.world);
    memcpy(p + 16, g->model_digest, FI_GROUP_DIGEST_BYTES);
    memcpy(p + 16 + FI_GROUP_DIGEST_BYTES, g->plan_digest, FI_GROUP_DIGEST_BYTES);
    if (tl) memcpy(p + S_REPLY_MIN, text, tl);
    char e[256];
    /* The leader's link to us is up (it sent Join); ours to it may take a
     * moment longer after a restart. */
    uint64_t until = fi_wire_now_ms() + (uint64_t)g->conf.timeout_ms;
    while (!fi_gnet_up(g->net, 0) && fi_wire_now_ms() < until)
        if (fi_gnet_pump(g->net, 20, e, sizeof e) < 0) break;
    if (fi_gnet_send(g->net, 0, FI_G_JOIN_REPLY, 0, geom, p, S_REPLY_MIN + tl, e, sizeof e) != 0) {
        fprintf(stderr, "group rank %d: cannot answer the leader's join: %s\n", g->rank, e);
        return -1;
    }
    return 0;
}

/* Answers a Join. 0 when joined or asked again later, -1 when refused
 * (err says why). */
static int s_on_join(fi_group *g, const fi_gmsg *m, char *err, size_t errlen) {
    const uint8_t *p = m->data;
    char ours[FI_GROUP_DIGEST_HEX], theirs[FI_GROUP_DIGEST_HEX];
    if (m->len != S_JOIN_BYTES || s_get32(p) != S_JOIN_VERSION) {
        snprintf(err, errlen, "the leader's join message is malformed (%zu bytes; another "
                              "fedinfer version?)",
                 m->len);
        goto refuse;
    }
    uint32_t world = s_get32(p + 4), tp = s_get32(p + 8), pp = s_get32(p + 12),
             rank = s_get32(p + 16), nb = s_get32(p + 20), mt = s_get32(p + 24),
             mo = s_get32(p + 28);
    const uint8_t *md = p + 32, *pd = p + 32 + FI_GROUP_DIGEST_BYTES;
    if (world != (uint32_t)g->conf.world || rank != (uint32_t)g->rank) {
        snprintf(err, errlen,
                 "the leader expects rank %u of a world of %u (tp %u, pp %u); this process is "
                 "rank %d of %d (tp %d, pp %d) by %s",
                 rank, world, tp, pp, g->rank, g->conf.world, g->conf.tp, g->conf.pp,
                 g->conf.path);
        goto refuse;
    }
    if (memcmp(md, g->model_digest, FI_GROUP_DIGEST_BYTES)) {
        fi_group_digest_hex(md, theirs);
        fi_group_digest_hex(g->model_digest, ours);
        snprintf(err, errlen,
                 "model digest %s of this rank's file differs from the leader's %s: every rank "
                 "must load the same model file",
                 ours, theirs);
        goto refuse;
    }
    if (memcmp(pd, g->plan_digest, FI_GROUP_DIGEST_BYTES)) {
        fi_group_digest_hex(pd, theirs);
        fi_group_digest_hex(g->plan_digest, ours);
        snprintf(err, errlen,
                 "plan digest %s differs from the leader's %s: this rank's layout (%s) is not "
                 "the leader's; every rank needs the same group file",
                 ours, theirs, g->plan_text);
        goto refuse;
    }
    if (nb == 0 || mt == 0 || mo == 0 || nb > (1u << 24) || mt > (1u << 20) || mo > mt) {
        snprintf(err, errlen, "the leader's KV pool geometry is out of range (%u blocks, %u "
                              "tokens, %u outputs)",
                 nb, mt, mo);
        goto refuse;
    }
    /* The mesh must be whole before we say yes: a pass needs every link. */
    uint64_t until = fi_wire_now_ms() + (uint64_t)g->conf.timeout_ms;
    while (fi_gnet_first_down(g->net) >= 0 && fi_wire_now_ms() < until)
        if (fi_gnet_pump(g->net, 20, err, errlen) < 0) return -1;
    int down = fi_gnet_first_down(g->net);
    if (down >= 0) {
        char t[128];
        snprintf(t, sizeof t, "not ready: no link to rank %d yet", down);
        (void)s_reply(g, S_REPLY_NOT_READY, m->op, t);
        return 0;
    }
    if (!g->kv || g->kv_blocks != (int)nb || g->kv_tokens != (int)mt || g->kv_out != (int)mo) {
        fi_kvpool_destroy(&g->kv);
        char e[256];
        if (!(g->kv = fi_kvpool_new(g->m, (int)nb, (int)mt, (int)mo, e, sizeof e))) {
            snprintf(err, errlen, "cannot make the KV pool the leader asks for (%u blocks): %s",
                     nb, e);
            goto refuse;
        }
        g->kv_blocks = (int)nb;
        g->kv_tokens = (int)mt;
        g->kv_out = (int)mo;
    }
    if (s_reply(g, S_REPLY_OK, m->op, NULL) == 0) /* else the leader asks again */
        fprintf(stderr, "group %s: rank %d joined the leader (%s)\n", g->conf.name, g->rank,
                g->plan_text);
    return 0;
refuse:
    (void)s_reply(g, S_REPLY_REFUSED, m->op, err);
    return -1;
}

static void s_on_batch(fi_group *g, const fi_gmsg *m) {
    char why[512] = "";
    void *copy = NULL;
    fi_batch b;
    g->cur_pass = m->pass;
    g->op = 0;
    g->deadline_ms = fi_wire_now_ms() + FI_GROUP_PASS_TIMEOUT_MS;
    g->st.passes++;
    fi_gnet_mark(g->net);
    if (!g->kv) {
        snprintf(why, sizeof why, "rank %d has not joined (no KV pool)", g->rank);
    } else if (s_batch_decode(m, &b, &copy, why, sizeof why) != 0) {
        /* why says it */
    } else if (b.n > g->kv_tokens || b.n_out > g->kv_out) {
        /* checked before any buffer grows to the batch's size */
        snprintf(why, sizeof why, "a batch of %d tokens and %d outputs exceeds the KV pool the "
                                  "leader set (%d tokens, %d outputs)",
                 b.n, b.n_out, g->kv_tokens, g->kv_out);
    } else if (s_run_pass(g, g->kv, &b, NULL, why, sizeof why) == 0) {
        free(copy);
        return;
    }
    free(copy);
    g->st.failed++;
    fprintf(stderr, "group %s: rank %d: pass %llu failed: %s\n", g->conf.name, g->rank,
            (unsigned long long)m->pass, why);
    fi_gcoll_fail(g->net, m->pass, why);
    /* A backend that failed for good (a GPU's failures are sticky) would
     * fail every later pass: the rank stops (fi_group_follow), so that its
     * supervisor starts it again with a new device context; the group
     * re-forms with a fresh scheduler when it is back, as after any
     * restart (the rank's KV cache is gone with it). */
    char bwhy[384];
    if (g->m && fi_model_backend_failed(g->m, bwhy, sizeof bwhy))
        snprintf(g->dead, sizeof g->dead, "%s", bwhy);
}

int fi_group_follow(fi_group *g, atomic_int *stop, char *err, size_t errlen) {
    if (!g->m) {
        snprintf(err, errlen, "rank %d: no model attached", g->rank);
        return -1;
    }
    int was_up = fi_gnet_up(g->net, 0);
    while (!atomic_load(stop)) {
        if (fi_gnet_pump(g->net, 100, err, errlen) < 0) return -1;
        if (was_up != fi_gnet_up(g->net, 0)) {
            was_up = !was_up;
            fprintf(stderr, "group %s: rank %d: link to the leader %s\n", g->conf.name, g->rank,
                    was_up ? "up" : "down (waiting for it to come back)");
        }
        fi_gmsg *m;
        while ((m = fi_gnet_take(g->net, 0, FI_G_JOIN, UINT64_MAX))) {
            int rc = s_on_join(g, m, err, errlen);
            fi_gmsg_free(&m);
            if (rc != 0) {
                fprintf(stderr, "group %s: rank %d refused at join: %s\n", g->conf.name, g->rank,
                        err);
                return -1;
            }
        }
        while ((m = fi_gnet_take(g->net, 0, FI_G_NCCL, UINT64_MAX))) {
            char e[512];
            fi_gnccl_destroy(&g->nccl);
            if (m->len != FI_GNCCL_ID_BYTES ||
                !(g->nccl = fi_gnccl_new(m->data, g->conf.world, g->rank, g->gpu, e, sizeof e)))
                fprintf(stderr, "group %s: rank %d: NCCL: %s\n", g->conf.name, g->rank,
                        m->len != FI_GNCCL_ID_BYTES ? "malformed id" : e);
            fi_gmsg_free(&m);
        }
        while ((m = fi_gnet_take(g->net, 0, FI_G_BATCH, UINT64_MAX))) {
            fi_gnet_drop_before(g->net, m->pass);
            s_on_batch(g, m);
            fi_gmsg_free(&m);
            if (g->dead[0]) {
                snprintf(err, errlen, "rank %d: its backend failed for good (%s); stopping so "
                         "that it starts again with a new one", g->rank, g->dead);
                return -1;
            }
        }
    }
    return 0;
}
