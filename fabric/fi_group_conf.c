/*
 * fi_group_conf.c - group and rank files, the shard plan and its digest.
 * See fi_group_conf.h.
 *
 * The plan is computed, not configured rank by rank: every rank derives
 * every rank's plan from the same group file and the same model header,
 * so a rank whose file or model differs ends up with another digest and
 * is refused at join instead of computing garbage.
 */
#include "fi_group_conf.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sodium.h>

#include "fi_gguf.h"

/* --- group file ---------------------------------------------------------- */

#define S_NAMES16(p)                                                                          \
    p "0", p "1", p "2", p "3", p "4", p "5", p "6", p "7", p "8", p "9", p "10", p "11",     \
        p "12", p "13", p "14", p "15"

static const char *const s_ep_names[FI_GROUP_MAX_RANKS] = {S_NAMES16("endpoint.")};
static const char *const s_key_names[FI_GROUP_MAX_RANKS] = {S_NAMES16("key.")};

/* What fi_conf_load fills; turned into fi_group_conf after checks. */
typedef struct s_raw {
    char name[FI_CONF_STR_MAX];        /* group */
    int world;                         /* world */
    int tp;                            /* tp (0: world) */
    char tp_weights[FI_CONF_STR_MAX];  /* lists, "" when absent */
    char pp_weights[FI_CONF_STR_MAX];
    char kv_split[FI_CONF_STR_MAX];
    char ffn_split[FI_CONF_STR_MAX];
    char layer_split[FI_CONF_STR_MAX];
    int heartbeat_ms;
    int timeout_ms;
    char coll[FI_CONF_STR_MAX];        /* collective */
    int micro_batch;
    char ep[FI_GROUP_MAX_RANKS][FI_CONF_STR_MAX];
    char key[FI_GROUP_MAX_RANKS][FI_CONF_STR_MAX];
} s_raw;

/* Resolves a path relative to the folder of `base` (a file path) into out.
 * Absolute paths are kept. 0, or -1 when the result does not fit. */
static int s_resolve(const char *base, const char *p, char *out, size_t cap) {
    if (p[0] == '/' || !strchr(base, '/')) {
        int w = snprintf(out, cap, "%s", p);
        return w >= 0 && (size_t)w < cap ? 0 : -1;
    }
    int dirlen = (int)(strrchr(base, '/') - base);
    int w = snprintf(out, cap, "%.*s/%s", dirlen, base, p);
    return w >= 0 && (size_t)w < cap ? 0 : -1;
}

/* Parses "a,b,c" into exactly n positive integers. 0, or -1 with a
 * message naming the key. An empty string leaves out untouched. */
static int s_list(const char *path, const char *key, const char *s, int n, int *out,
                  char *err, size_t errlen) {
    if (!s[0]) return 0;
    int got = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 1 || v > 1 << 24) {
            snprintf(err, errlen, "%s: %s: '%s' is not a list of positive integers", path, key, s);
            return -1;
        }
        if (got < n) out[got] = (int)v;
        got++;
        while (*end == ' ') end++;
        if (*end == ',') end++;
        else if (*end) {
            snprintf(err, errlen, "%s: %s: '%s' is not a list of positive integers", path, key, s);
            return -1;
        }
        while (*end == ' ') end++;
        p = end;
    }
    if (got != n) {
        snprintf(err, errlen, "%s: %s has %d entries; it needs %d (one per %s)", path, key, got,
                 n, !strcmp(key, "tp_weights") || !strcmp(key, "kv_split") ||
                            !strcmp(key, "ffn_split")
                        ? "TP rank of a stage"
                        : "stage");
        return -1;
    }
    return 0;
}

int fi_group_conf_load(const char *path, fi_group_conf *g, char *err, size_t errlen) {
#define S_OFF(f) offsetof(s_raw, f)
    fi_conf_key keys[16 + 2 * FI_GROUP_MAX_RANKS];
    int k = 0;
    keys[k++] = (fi_conf_key){"group", FI_CONF_STR, S_OFF(name), 1, 0, 0, 0};
    keys[k++] = (fi_conf_key){"world", FI_CONF_INT, S_OFF(world), 1, 1, FI_GROUP_MAX_RANKS, 0};
    keys[k++] = (fi_conf_key){"tp", FI_CONF_INT, S_OFF(tp), 0, 1, FI_GROUP_MAX_RANKS, 0};
    keys[k++] = (fi_conf_key){"tp_weights", FI_CONF_STR, S_OFF(tp_weights), 0, 0, 0, 0};
    keys[k++] = (fi_conf_key){"pp_weights", FI_CONF_STR, S_OFF(pp_weights), 0, 0, 0, 0};
    keys[k++] = (fi_conf_key){"kv_split", FI_CONF_STR, S_OFF(kv_split), 0, 0, 0, 0};
    keys[k++] = (fi_conf_key){"ffn_split", FI_CONF_STR, S_OFF(ffn_split), 0, 0, 0, 0};
    keys[k++] = (fi_conf_key){"layer_split", FI_CONF_STR, S_OFF(layer_split), 0, 0, 0, 0};
    keys[k++] = (fi_conf_key){"heartbeat_ms", FI_CONF_INT, S_OFF(heartbeat_ms), 0, 10, 60000, 0};
    keys[k++] = (fi_conf_key){"timeout_ms", FI_CONF_INT, S_OFF(timeout_ms), 0, 30, 600000, 0};
    keys[k++] = (fi_conf_key){"collective", FI_CONF_STR, S_OFF(coll), 0, 0, 0, 0};
    keys[k++] = (fi_conf_key){"micro_batch", FI_CONF_INT, S_OFF(micro_batch), 0, 0, 1 << 16, 0};
    for (int r = 0; r < FI_GROUP_MAX_RANKS; r++) {
        keys[k++] = (fi_conf_key){s_ep_names[r], FI_CONF_STR, S_OFF(ep[r]), 0, 0, 0, 0};
        keys[k++] = (fi_conf_key){s_key_names[r], FI_CONF_STR, S_OFF(key[r]), 0, 0, 0, 0};
    }
    keys[k] = (fi_conf_key){NULL, FI_CONF_STR, 0, 0, 0, 0, 0};
#undef S_OFF
    s_raw *raw = calloc(1, sizeof *raw);
    if (!raw) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int rc = -1;
    raw->heartbeat_ms = 250;
    raw->timeout_ms = 1500;
    raw->micro_batch = -1; /* unset: by the collective, below */
    if (fi_conf_load(path, keys, raw, err, errlen) != 0) goto done;
    memset(g, 0, sizeof *g);
    snprintf(g->path, sizeof g->path, "%s", path);
    snprintf(g->name, sizeof g->name, "%s", raw->name);
    g->world = raw->world;
    g->tp = raw->tp ? raw->tp : raw->world;
    if (g->world % g->tp) {
        snprintf(err, errlen, "%s: tp = %d does not divide world = %d (every stage has tp ranks)",
                 path, g->tp, g->world);
        goto done;
    }
    g->pp = g->world / g->tp;
    g->heartbeat_ms = raw->heartbeat_ms;
    g->timeout_ms = raw->timeout_ms;
    if (g->timeout_ms < 2 * g->heartbeat_ms) {
        snprintf(err, errlen, "%s: timeout_ms = %d must be at least twice heartbeat_ms = %d", path,
                 g->timeout_ms, g->heartbeat_ms);
        goto done;
    }
    if (!raw->coll[0] || !strcmp(raw->coll, "zmq")) {
        g->coll = FI_GROUP_COLL_ZMQ;
    } else if (!strcmp(raw->coll, "nccl")) {
        g->coll = FI_GROUP_COLL_NCCL;
    } else {
        snprintf(err, errlen, "%s: collective = %s: expected zmq or nccl", path, raw->coll);
        goto done;
    }
    g->micro_batch_set = raw->micro_batch >= 0;
    if (g->micro_batch_set)
        g->micro_batch = raw->micro_batch;
    else
        g->micro_batch = g->coll == FI_GROUP_COLL_NCCL ? FI_GROUP_MICRO_BATCH_GPU : FI_GROUP_MICRO_BATCH_CPU;
    for (int r = 0; r < FI_GROUP_MAX_RANKS; r++) {
        if (r >= g->world) {
            if (raw->ep[r][0] || raw->key[r][0]) {
                snprintf(err, errlen, "%s: %s is set but world = %d (ranks 0..%d)", path,
                         raw->ep[r][0] ? s_ep_names[r] : s_key_names[r], g->world, g->world - 1);
                goto done;
            }
            continue;
        }
        if (!raw->ep[r][0] || !raw->key[r][0]) {
            snprintf(err, errlen, "%s: rank %d needs %s and %s", path, r, s_ep_names[r],
                     s_key_names[r]);
            goto done;
        }
        snprintf(g->endpoint[r], sizeof g->endpoint[r], "%s", raw->ep[r]);
        for (int q = 0; q < r; q++)
            if (!strcmp(g->endpoint[q], g->endpoint[r])) {
                /* else the second rank's bind fails, naming no file */
                snprintf(err, errlen, "%s: ranks %d and %d have the same endpoint (%s): each rank needs its own",
                         path, q, r, g->endpoint[r]);
                goto done;
            }
        char kp[FI_CONF_STR_MAX], kerr[256];
        if (s_resolve(path, raw->key[r], kp, sizeof kp) != 0) {
            snprintf(err, errlen, "%s: %s: path too long", path, s_key_names[r]);
            goto done;
        }
        if (fi_keys_load_public(kp, g->pub[r], kerr, sizeof kerr) != 0) {
            snprintf(err, errlen, "%s: %s: %s", path, s_key_names[r], kerr);
            goto done;
        }
        for (int q = 0; q < r; q++)
            if (!memcmp(g->pub[q], g->pub[r], FI_KEYS_BYTES)) {
                snprintf(err, errlen, "%s: ranks %d and %d have the same key: each rank needs its own",
                         path, q, r);
                goto done;
            }
    }
    for (int i = 0; i < FI_GROUP_MAX_RANKS; i++) g->tp_weight[i] = g->pp_weight[i] = 1;
    if (s_list(path, "tp_weights", raw->tp_weights, g->tp, g->tp_weight, err, errlen) ||
        s_list(path, "pp_weights", raw->pp_weights, g->pp, g->pp_weight, err, errlen) ||
        s_list(path, "kv_split", raw->kv_split, g->tp, g->kv_split, err, errlen) ||
        s_list(path, "ffn_split", raw->ffn_split, g->tp, g->ffn_split, err, errlen) ||
        s_list(path, "layer_split", raw->layer_split, g->pp, g->layer_split, err, errlen))
        goto done;
    rc = 0;
done:
    free(raw);
    return rc;
}

/* --- rank file ----------------------------------------------------------- */

int fi_group_conf_is_rank_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[FI_CONF_STR_MAX + 128];
    int yes = 0;
    while (!yes && fgets(line, sizeof line, f)) {
        const char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        if (!strncmp(s, "group_file", 10)) {
            s += 10;
            while (*s == ' ' || *s == '\t') s++;
            yes = *s == '=';
        }
    }
    fclose(f);
    return yes;
}

int fi_group_rank_conf_load(const char *path, fi_group_rank_conf *r, char *err, size_t errlen) {
#define S_OFF(f) offsetof(fi_group_rank_conf, f)
    static const fi_conf_key keys[] = {
        {"group_file", FI_CONF_STR, S_OFF(group_file), 1, 0, 0, 0},
        {"rank", FI_CONF_INT, S_OFF(rank), 1, 0, FI_GROUP_MAX_RANKS - 1, 0},
        {"secret_key", FI_CONF_STR, S_OFF(secret_key), 1, 0, 0, 0},
        {"model", FI_CONF_STR, S_OFF(model), 1, 0, 0, 0},
        {"model_sha256", FI_CONF_STR, S_OFF(model_sha256), 0, 0, 0, 0},
        {"threads", FI_CONF_INT, S_OFF(threads), 0, 0, 1024, 0},
        FI_CONF_PRECISION_KEYS(S_OFF),
        {"coordinator", FI_CONF_STR, S_OFF(coordinator), 0, 0, 0, 0},
        {"coordinator_key", FI_CONF_STR, S_OFF(coordinator_key), 0, 0, 0, 0},
        {"enrol_endpoint", FI_CONF_STR, S_OFF(enrol_endpoint), 0, 0, 0, 0},
        {"site", FI_CONF_STR, S_OFF(site), 0, 0, 0, 0},
        {"region", FI_CONF_STR, S_OFF(region), 0, 0, 0, 0},
        {"model_name", FI_CONF_STR, S_OFF(model_name), 0, 0, 0, 0},
        {"capacity", FI_CONF_INT, S_OFF(capacity), 0, 1, 1024, 0},
        {"heartbeat_ms", FI_CONF_INT, S_OFF(heartbeat_ms), 0, 10, 600000, 0},
        {"liveness", FI_CONF_INT, S_OFF(liveness), 0, 2, 100, 0},
        {"max_tokens", FI_CONF_INT, S_OFF(max_tokens), 0, 1, 1 << 20, 0},
        {"n_ctx", FI_CONF_INT, S_OFF(n_ctx), 0, 0, 1 << 20, 0},
        {"kv_mib", FI_CONF_INT, S_OFF(kv_mib), 0, 1, 1 << 20, 0},
        {"max_seqs", FI_CONF_INT, S_OFF(max_seqs), 0, 1, 1024, 0},
        {"step_tokens", FI_CONF_INT, S_OFF(step_tokens), 0, 1, 65536, 0},
        {"device", FI_CONF_STR, S_OFF(device), 0, 0, 0, 0},
        {"gpu", FI_CONF_INT, S_OFF(gpu), 0, 0, 1023, 0},
        {NULL, FI_CONF_STR, 0, 0, 0, 0, 0},
    };
#undef S_OFF
    fi_group_rank_conf *raw = calloc(1, sizeof *raw);
    if (!raw) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int rc = -1;
    raw->capacity = 8;
    raw->act_bits = 0; /* the backend's default (fi_cpu_backend_set_act_bits) */
    raw->kv_bits = 16;
    raw->heartbeat_ms = 1000;
    raw->liveness = 3;
    raw->max_tokens = 512;
    raw->kv_mib = 64;
    raw->max_seqs = 16;
    raw->step_tokens = 256;
    if (fi_conf_load(path, keys, raw, err, errlen) != 0) goto done;
    *r = *raw;
    if (!r->device[0]) snprintf(r->device, sizeof r->device, "cpu");
    if (strcmp(r->device, "cpu") && strcmp(r->device, "cuda") && strcmp(r->device, "auto")) {
        snprintf(err, errlen, "%s: device = %s: expected cpu, cuda or auto", path, r->device);
        goto done;
    }
    char tmp[FI_CONF_STR_MAX];
    char *paths[] = {r->group_file, r->secret_key, r->model, r->coordinator_key};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        if (!paths[i][0]) continue;
        if (s_resolve(path, paths[i], tmp, sizeof tmp) != 0) {
            snprintf(err, errlen, "%s: path too long: %s", path, paths[i]);
            goto done;
        }
        memcpy(paths[i], tmp, sizeof tmp);
    }
    if (r->rank == 0 && (!r->coordinator[0] || !r->coordinator_key[0] || !r->model_name[0])) {
        snprintf(err, errlen,
                 "%s: rank 0 leads the group and needs coordinator, coordinator_key and "
                 "model_name",
                 path);
        goto done;
    }
    rc = 0;
done:
    free(raw);
    return rc;
}

/* --- the model's shape --------------------------------------------------- */

static int s_u32(const fi_gguf *gg, const char *key, int *out, const char *path, char *err,
                 size_t errlen) {
    uint32_t v = 0;
    if (fi_gguf_get_u32(gg, key, &v) != 0 || v == 0 || v > INT_MAX) {
        snprintf(err, errlen, "%s: metadata %s is missing or not a positive integer", path, key);
        return -1;
    }
    *out = (int)v;
    return 0;
}

int fi_group_model_read(const char *path, fi_group_model *out, char *err, size_t errlen) {
    fi_gguf *gg = fi_gguf_open(path, err, errlen);
    if (!gg) return -1;
    int rc = -1;
    memset(out, 0, sizeof *out);
    if (s_u32(gg, "llama.block_count", &out->n_layers, path, err, errlen) ||
        s_u32(gg, "llama.embedding_length", &out->dim, path, err, errlen) ||
        s_u32(gg, "llama.feed_forward_length", &out->ffn_dim, path, err, errlen) ||
        s_u32(gg, "llama.attention.head_count", &out->n_heads, path, err, errlen))
        goto done;
    if (s_u32(gg, "llama.attention.head_count_kv", &out->n_kv_heads, path, err, errlen))
        out->n_kv_heads = out->n_heads; /* absent: no grouping */
    const fi_gguf_tensor *emb = fi_gguf_find_tensor(gg, "token_embd.weight");
    if (!emb || emb->n_dims != 2) {
        snprintf(err, errlen, "%s: tensor token_embd.weight is missing", path);
        goto done;
    }
    out->n_vocab = (int)emb->ne[1];
    out->ffn_block = 1;
    for (int l = 0; l < out->n_layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.ffn_down.weight", l);
        const fi_gguf_tensor *t = fi_gguf_find_tensor(gg, name);
        if (!t) {
            snprintf(err, errlen, "%s: tensor %s is missing", path, name);
            goto done;
        }
        int b = fi_dtype_block_elems(t->type);
        if (b > out->ffn_block) out->ffn_block = b;
    }
    out->file_bytes = fi_gguf_file_size(gg);
    rc = 0;
done:
    fi_gguf_close(&gg);
    return rc;
}

/* --- the plan ------------------------------------------------------------ */

/* Splits `total` units among n parts in proportion to w (largest
 * remainder; ties to the higher index when ties_high, else the lower),
 * each part at least one unit. Requires 1 <= n <= total. */
static void s_split(int total, int n, const int *w, int *out, int ties_high) {
    long wsum = 0;
    for (int i = 0; i < n; i++) wsum += w[i];
    double q[FI_GROUP_MAX_RANKS];
    int sum = 0;
    for (int i = 0; i < n; i++) {
        q[i] = (double)total * w[i] / (double)wsum;
        out[i] = (int)q[i];
        if (out[i] < 1) out[i] = 1;
        sum += out[i];
    }
    while (sum < total) {
        int best = ties_high ? n - 1 : 0;
        for (int i = 0; i < n; i++) {
            double d = q[i] - out[i], b = q[best] - out[best];
            if (d > b || (d == b && (ties_high ? i > best : i < best))) best = i;
        }
        out[best]++;
        sum++;
    }
    while (sum > total) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (out[i] > 1 && (best < 0 || q[i] - out[i] < q[best] - out[best])) best = i;
        out[best]--;
        sum--;
    }
}

int fi_group_plan_make(const fi_group_conf *g, const fi_group_model *m,
                       fi_shard_plan plans[FI_GROUP_MAX_RANKS], char *err, size_t errlen) {
    int kv[FI_GROUP_MAX_RANKS], ffn[FI_GROUP_MAX_RANKS], layers[FI_GROUP_MAX_RANKS];
    const int tp = g->tp, pp = g->pp;
    memset(plans, 0, sizeof(fi_shard_plan) * FI_GROUP_MAX_RANKS);
    if (m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads) {
        snprintf(err, errlen, "model: %d query heads are not a multiple of %d KV heads",
                 m->n_heads, m->n_kv_heads);
        return -1;
    }
    /* Tensor parallelism: KV-head groups (a KV head and its query heads). */
    if (tp > m->n_kv_heads) {
        snprintf(err, errlen,
                 "%s: tp = %d ranks per stage, but the model has only %d KV heads: attention is "
                 "split by KV head, so a stage can have at most %d TP ranks",
                 g->path, tp, m->n_kv_heads, m->n_kv_heads);
        return -1;
    }
    if (g->kv_split[0]) {
        int sum = 0;
        for (int t = 0; t < tp; t++) sum += kv[t] = g->kv_split[t];
        if (sum != m->n_kv_heads) {
            snprintf(err, errlen, "%s: kv_split adds up to %d KV heads; the model has %d", g->path,
                     sum, m->n_kv_heads);
            return -1;
        }
    } else {
        /* An odd head goes to the last TP ranks: TP rank 0 of the last
         * stage also computes the output matrix (the largest one). */
        s_split(m->n_kv_heads, tp, g->tp_weight, kv, 1);
    }
    /* FFN: gate/up by output rows, down by input columns, so every share
     * must hold whole quantisation blocks of ffn_down's rows (a model file
     * always does: its rows are whole blocks; checked whatever tp is, as
     * a plan's FFN share is counted in blocks below). */
    const int blk = m->ffn_block > 0 ? m->ffn_block : 1;
    if (m->ffn_dim % blk) {
        snprintf(err, errlen, "model: ffn length %d is not a multiple of ffn_down's block of %d",
                 m->ffn_dim, blk);
        return -1;
    }
    const int n_blocks = m->ffn_dim / blk;
    if (tp > n_blocks) {
        snprintf(err, errlen,
                 "%s: tp = %d ranks per stage, but the FFN has only %d blocks of %d columns",
                 g->path, tp, n_blocks, blk);
        return -1;
    }
    if (g->ffn_split[0]) {
        int sum = 0;
        for (int t = 0; t < tp; t++) {
            ffn[t] = g->ffn_split[t];
            sum += ffn[t];
            if (ffn[t] % blk) {
                int lo = ffn[t] / blk * blk;
                snprintf(err, errlen,
                         "%s: ffn_split gives TP rank %d %d FFN rows, not a multiple of %d: "
                         "ffn_down is split by input columns, which must fall on its "
                         "quantisation blocks of %d (use %d or %d)",
                         g->path, t, ffn[t], blk, blk, lo, lo + blk);
                return -1;
            }
        }
        if (sum != m->ffn_dim) {
            snprintf(err, errlen, "%s: ffn_split adds up to %d rows; the model's FFN has %d",
                     g->path, sum, m->ffn_dim);
            return -1;
        }
    } else {
        s_split(n_blocks, tp, g->tp_weight, ffn, 1);
        for (int t = 0; t < tp; t++) ffn[t] *= blk;
    }
    /* Pipeline: contiguous layer ranges. */
    if (pp > m->n_layers) {
        snprintf(err, errlen, "%s: %d stages, but the model has only %d layers", g->path, pp,
                 m->n_layers);
        return -1;
    }
    if (g->layer_split[0]) {
        int sum = 0;
        for (int s = 0; s < pp; s++) sum += layers[s] = g->layer_split[s];
        if (sum != m->n_layers) {
            snprintf(err, errlen, "%s: layer_split adds up to %d layers; the model has %d",
                     g->path, sum, m->n_layers);
            return -1;
        }
    } else {
        /* An odd layer goes to the first stages: the last one has the output. */
        s_split(m->n_layers, pp, g->pp_weight, layers, 0);
    }
    int lb = 0;
    for (int s = 0; s < pp; s++) {
        int kb = 0, fb = 0;
        for (int t = 0; t < tp; t++) {
            fi_shard_plan *p = &plans[s * tp + t];
            p->layer_begin = lb;
            p->layer_end = lb + layers[s];
            /* Explicit even when whole (tp = 1): the plan the model reports
             * after loading is the same, field for field. */
            p->kv_head_begin = kb;
            p->kv_head_count = kv[t];
            p->ffn_begin = fb;
            p->ffn_count = ffn[t];
            kb += kv[t];
            fb += ffn[t];
            p->no_embed = s > 0;
            p->no_output = !(s == pp - 1 && t == 0);
        }
        lb += layers[s];
    }
    return 0;
}

void fi_group_plan_text(const fi_group_conf *g, const fi_shard_plan *plans, char *buf,
                        size_t cap) {
    size_t at = 0;
    /* the collective too: ranks summing over different ones would wait for
     * each other's sums until the pass time limit */
    int w = snprintf(buf, cap, "group=%s world=%d tp=%d pp=%d coll=%s", g->name, g->world, g->tp,
                     g->pp, g->coll == FI_GROUP_COLL_NCCL ? "nccl" : "zmq");
    if (w < 0 || (size_t)w >= cap) return;
    at = (size_t)w;
    /* and, with stages, how a pass is cut: ranks cutting it differently
     * would wait for activations that never come */
    if (g->pp > 1) {
        w = snprintf(buf + at, cap - at, " mb=%d", g->micro_batch);
        if (w < 0 || (size_t)w >= cap - at) return;
        at += (size_t)w;
    }
    for (int r = 0; r < g->world; r++) {
        const fi_shard_plan *p = &plans[r];
        w = snprintf(buf + at, cap - at, "; r%d L%d-%d kv%d+%d ffn%d+%d%s%s", r, p->layer_begin,
                     p->layer_end, p->kv_head_begin, p->kv_head_count, p->ffn_begin, p->ffn_count,
                     p->no_embed ? "" : " E", p->no_output ? "" : " O");
        if (w < 0 || (size_t)w >= cap - at) return;
        at += (size_t)w;
    }
}

int fi_group_micro_split(const fi_group_conf *g, int n, int *at) {
    const int mb = g->micro_batch;
    int m = 1;
    if (g->pp > 1 && mb > 0 && n / mb >= 2) {
        m = n / mb;
        if (m > 2 * g->pp) m = 2 * g->pp;
        if (m > FI_GROUP_MICRO_MAX) m = FI_GROUP_MICRO_MAX;
    }
    /* k n / m down to a multiple of mb: n / m >= mb, so each step is at
     * least mb */
    at[0] = 0;
    for (int k = 1; k < m; k++) at[k] = (int)((long)k * n / m / mb * mb);
    at[m] = n;
    return m;
}

void fi_group_plan_digest(const fi_group_conf *g, const fi_shard_plan *plans,
                          uint8_t out[FI_GROUP_DIGEST_BYTES]) {
    char text[4096];
    fi_group_plan_text(g, plans, text, sizeof text);
    crypto_generichash(out, FI_GROUP_DIGEST_BYTES, (const unsigned char *)text, strlen(text),
                       NULL, 0);
}

int fi_group_model_digest(const char *path, uint8_t out[FI_GROUP_DIGEST_BYTES], char *err,
                          size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    enum { S_CHUNK = 1 << 20 };
    unsigned char *buf = malloc(S_CHUNK);
    crypto_generichash_state st;
    int rc = -1;
    if (!buf || sodium_init() < 0 ||
        crypto_generichash_init(&st, NULL, 0, FI_GROUP_DIGEST_BYTES) != 0) {
        snprintf(err, errlen, "%s: cannot start the digest (out of memory or libsodium)", path);
        goto done;
    }
    size_t n;
    while ((n = fread(buf, 1, S_CHUNK, f)) > 0) crypto_generichash_update(&st, buf, n);
    if (ferror(f)) {
        snprintf(err, errlen, "%s: read error while computing its digest", path);
        goto done;
    }
    crypto_generichash_final(&st, out, FI_GROUP_DIGEST_BYTES);
    rc = 0;
done:
    free(buf);
    fclose(f);
    return rc;
}

void fi_group_digest_hex(const uint8_t d[FI_GROUP_DIGEST_BYTES], char out[FI_GROUP_DIGEST_HEX]) {
    sodium_bin2hex(out, FI_GROUP_DIGEST_HEX, d, FI_GROUP_DIGEST_BYTES);
}
