/*
 * model.c - a Llama-architecture model from a GGUF file, and sessions that
 * run it.
 *
 * The shape follows llama2.c: fi_config holds the hyper-parameters, the
 * weights are views into the mmapped file (described by fi_weight so that a
 * backend may upload them), a session holds the activations and the KV
 * cache, and one forward function runs every layer. All arithmetic goes
 * through the backend's operation table (kernels/fi_kernels.h), so the
 * same forward pass runs on the CPU and, later, on a GPU.
 *
 * The KV cache is stored in fp16 (half the memory of fp32; a 2048-token
 * context of the default model takes 45 MiB instead of 90).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fi_model.h"

/* Most tokens a forward pass takes at once; longer prompts go in chunks. */
#define FI_MAX_BATCH 256
/* Most rows of logits computed at once (a row is n_vocab floats: 192 KiB
 * for the default model, so a whole batch of them would cost 48 MiB). */
#define FI_LOGIT_ROWS 16

typedef struct layer {
    float *attn_norm;       /* (dim) backend memory */
    float *ffn_norm;        /* (dim) backend memory */
    fi_weight wq;           /* (dim, dim): rows = n_heads*head_dim */
    fi_weight wk;           /* (kv_dim, dim) */
    fi_weight wv;           /* (kv_dim, dim) */
    fi_weight wo;           /* (dim, dim) */
    fi_weight w_gate;       /* (ffn_dim, dim) */
    fi_weight w_up;         /* (ffn_dim, dim) */
    fi_weight w_down;       /* (dim, ffn_dim) */
} layer;

struct fi_model {
    char *path;             /* the file, for messages */
    fi_gguf *gguf;          /* owns the mapping the weights point into */
    fi_tok *tok;            /* tokenizer */
    fi_backend *be;         /* compute backend */
    fi_config cfg;
    fi_weight tok_embd;     /* (n_vocab, dim) */
    fi_weight output;       /* (n_vocab, dim); a copy of tok_embd when tied */
    float *output_norm;     /* (dim) backend memory */
    layer *layers;          /* n_layers */
};

struct fi_session {
    fi_model *m;
    int n_ctx;              /* positions the cache holds */
    int pos;                /* positions filled */
    uint16_t *kcache;       /* (n_layers, n_ctx, kv_dim) fp16, backend memory */
    uint16_t *vcache;       /* (n_layers, n_ctx, kv_dim) fp16 */
    /* Activations for up to FI_MAX_BATCH tokens, backend memory. */
    float *x;               /* (batch, dim) residual stream */
    float *xb;              /* (batch, dim) normed input / attention output */
    float *q;               /* (batch, dim) */
    float *k;               /* (batch, kv_dim) */
    float *v;               /* (batch, kv_dim) */
    float *hb;              /* (batch, ffn_dim) gate, then swiglu */
    float *hb2;             /* (batch, ffn_dim) up */
    float *logits;          /* (FI_LOGIT_ROWS, n_vocab) */
    int32_t *toks;          /* (batch) backend memory */
    int32_t *pos_buf;       /* (batch) backend memory */
    int32_t *pos_host;      /* (batch) host copy */
};

static void s_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Reads an integer hyper-parameter "<arch>.<name>" that must be in [lo, hi]. */
static int s_get_int(const fi_model *m, const char *name, int lo, int hi, int *out, char *err,
                     size_t errlen) {
    char key[128];
    snprintf(key, sizeof key, "llama.%s", name);
    int64_t v;
    if (fi_gguf_get_i64(m->gguf, key, &v) != 0) {
        s_err(err, errlen, "%s: metadata '%s' is missing or not an integer", m->path, key);
        return -1;
    }
    if (v < lo || v > hi) {
        s_err(err, errlen, "%s: metadata '%s' = %lld is out of range [%d, %d]", m->path, key,
              (long long)v, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int s_read_config(fi_model *m, char *err, size_t errlen) {
    fi_config *c = &m->cfg;
    fi_str arch;
    if (fi_gguf_get_str(m->gguf, "general.architecture", &arch) != 0) {
        s_err(err, errlen, "%s: metadata 'general.architecture' is missing", m->path);
        return -1;
    }
    if (!fi_str_eq(arch, "llama")) {
        s_err(err, errlen, "%s: architecture '%.*s' is not supported (only 'llama')", m->path,
              (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
        return -1;
    }
    if (s_get_int(m, "block_count", 1, 4096, &c->n_layers, err, errlen) ||
        s_get_int(m, "embedding_length", 1, 1 << 16, &c->dim, err, errlen) ||
        s_get_int(m, "feed_forward_length", 1, 1 << 18, &c->ffn_dim, err, errlen) ||
        s_get_int(m, "attention.head_count", 1, 1024, &c->n_heads, err, errlen))
        return -1;
    if (fi_gguf_find(m->gguf, "llama.attention.head_count_kv")) {
        if (s_get_int(m, "attention.head_count_kv", 1, c->n_heads, &c->n_kv_heads, err, errlen))
            return -1;
    } else {
        c->n_kv_heads = c->n_heads;
    }
    c->ctx_train = 2048;
    if (fi_gguf_find(m->gguf, "llama.context_length") &&
        s_get_int(m, "context_length", 1, 1 << 24, &c->ctx_train, err, errlen))
        return -1;
    if (c->dim % c->n_heads) {
        s_err(err, errlen, "%s: embedding_length %d is not a multiple of head_count %d", m->path,
              c->dim, c->n_heads);
        return -1;
    }
    if (c->n_heads % c->n_kv_heads) {
        s_err(err, errlen, "%s: head_count %d is not a multiple of head_count_kv %d", m->path,
              c->n_heads, c->n_kv_heads);
        return -1;
    }
    c->head_dim = c->dim / c->n_heads;
    if (c->head_dim % 2) {
        s_err(err, errlen, "%s: head size %d is odd; rotary embedding needs pairs", m->path,
              c->head_dim);
        return -1;
    }
    int rope_dims = c->head_dim;
    if (fi_gguf_find(m->gguf, "llama.rope.dimension_count") &&
        s_get_int(m, "rope.dimension_count", 1, 1 << 16, &rope_dims, err, errlen))
        return -1;
    if (rope_dims != c->head_dim) {
        s_err(err, errlen, "%s: partial rotary embedding (%d of %d dims) is not supported",
              m->path, rope_dims, c->head_dim);
        return -1;
    }
    c->rope_theta = 10000.0f;
    if (fi_gguf_find(m->gguf, "llama.rope.freq_base") &&
        fi_gguf_get_f32(m->gguf, "llama.rope.freq_base", &c->rope_theta) != 0) {
        s_err(err, errlen, "%s: metadata 'llama.rope.freq_base' is not a float", m->path);
        return -1;
    }
    if (fi_gguf_find(m->gguf, "llama.rope.scaling.type")) {
        fi_str st;
        if (fi_gguf_get_str(m->gguf, "llama.rope.scaling.type", &st) != 0 ||
            !(fi_str_eq(st, "none"))) {
            s_err(err, errlen, "%s: rope scaling is not supported", m->path);
            return -1;
        }
    }
    if (fi_gguf_get_f32(m->gguf, "llama.attention.layer_norm_rms_epsilon", &c->norm_eps) != 0) {
        s_err(err, errlen,
              "%s: metadata 'llama.attention.layer_norm_rms_epsilon' is missing or not a float",
              m->path);
        return -1;
    }
    if (!(c->rope_theta > 0.0f) || !isfinite(c->rope_theta) || !(c->norm_eps > 0.0f) ||
        !isfinite(c->norm_eps)) {
        s_err(err, errlen, "%s: rope.freq_base %g or rms epsilon %g is not a positive number",
              m->path, (double)c->rope_theta, (double)c->norm_eps);
        return -1;
    }
    return 0;
}

/* Binds a weight matrix: the tensor must exist, be 2-D (rows, cols) of a
 * type the kernels support. */
static int s_bind_weight(fi_model *m, fi_weight *w, const char *name, int rows, int cols,
                         char *err, size_t errlen) {
    const fi_gguf_tensor *t = fi_gguf_find_tensor(m->gguf, name);
    if (!t) {
        s_err(err, errlen, "%s: tensor '%s' is missing", m->path, name);
        return -1;
    }
    if (!fi_dtype_supported(t->type)) {
        s_err(err, errlen, "%s: tensor '%s' has type %u, which the kernels cannot compute with",
              m->path, name, (unsigned)t->type);
        return -1;
    }
    int64_t n1 = t->n_dims >= 2 ? t->ne[1] : 1;
    int higher = t->n_dims > 2 && (t->ne[2] != 1 || t->ne[3] != 1);
    if (t->ne[0] != cols || n1 != rows || higher) {
        s_err(err, errlen, "%s: tensor '%s' has shape [%lld, %lld], expected [%d, %d]", m->path,
              name, (long long)t->ne[0], (long long)n1, cols, rows);
        return -1;
    }
    w->data = t->data;
    w->type = t->type;
    w->rows = rows;
    w->cols = cols;
    w->row_bytes = fi_dtype_row_bytes(t->type, cols);
    w->dev = NULL;
    if (w->row_bytes == 0 || (uint64_t)w->row_bytes * (uint64_t)rows != t->n_bytes) {
        s_err(err, errlen, "%s: tensor '%s' holds %llu bytes, expected %llu for %d x %d %s",
              m->path, name, (unsigned long long)t->n_bytes,
              (unsigned long long)w->row_bytes * (unsigned long long)rows, rows, cols,
              fi_dtype_name(t->type));
        return -1;
    }
    fi_backend *be = m->be;
    if (be->ops->weight_upload && be->ops->weight_upload(be->ctx, w) != 0) {
        s_err(err, errlen, "%s: backend '%s' could not take tensor '%s'", m->path, be->ops->name,
              name);
        return -1;
    }
    return 0;
}

/* Copies a 1-D norm vector of n elements into backend memory as fp32. */
static float *s_bind_vector(fi_model *m, const char *name, int n, char *err, size_t errlen) {
    const fi_gguf_tensor *t = fi_gguf_find_tensor(m->gguf, name);
    if (!t) {
        s_err(err, errlen, "%s: tensor '%s' is missing", m->path, name);
        return NULL;
    }
    if (t->ne[0] != n || t->ne[1] != 1 || t->ne[2] != 1 || t->ne[3] != 1) {
        s_err(err, errlen, "%s: tensor '%s' has %lld elements in dimension 0, expected a vector of %d",
              m->path, name, (long long)t->ne[0], n);
        return NULL;
    }
    if (t->type != FI_DTYPE_F32 && t->type != FI_DTYPE_F16 && t->type != FI_DTYPE_BF16) {
        s_err(err, errlen, "%s: tensor '%s' has type %s; norm weights must be f32, f16 or bf16",
              m->path, name, fi_dtype_name(t->type));
        return NULL;
    }
    float *host = malloc((size_t)n * sizeof(float));
    float *dev = m->be->ops->alloc(m->be->ctx, (size_t)n * sizeof(float));
    if (!host || !dev) {
        free(host);
        if (dev) m->be->ops->free(m->be->ctx, dev);
        s_err(err, errlen, "out of memory loading '%s'", name);
        return NULL;
    }
    fi_dequantize_row(t->type, t->data, host, n);
    int rc = m->be->ops->to_backend(m->be->ctx, dev, host, (size_t)n * sizeof(float));
    free(host);
    if (rc != 0) {
        m->be->ops->free(m->be->ctx, dev);
        s_err(err, errlen, "backend could not take tensor '%s'", name);
        return NULL;
    }
    return dev;
}

fi_model *fi_model_load(const char *path, const fi_model_opts *opts, char *err, size_t errlen) {
    fi_model_opts defaults = {0, FI_SIMD_AUTO, 0};
    if (!opts) opts = &defaults;
    fi_model *m = calloc(1, sizeof *m);
    if (!m) {
        s_err(err, errlen, "out of memory");
        return NULL;
    }
    m->path = strdup(path);
    if (!m->path) {
        s_err(err, errlen, "out of memory");
        goto fail;
    }
    m->gguf = fi_gguf_open(path, err, errlen);
    if (!m->gguf) goto fail;
    if (s_read_config(m, err, errlen) != 0) goto fail;
    m->tok = fi_tok_new(m->gguf, err, errlen);
    if (!m->tok) goto fail;
    m->be = fi_cpu_backend_new(opts->n_threads, opts->simd, err, errlen);
    if (!m->be) goto fail;
    if (opts->act_bits && fi_cpu_backend_set_act_bits(m->be, opts->act_bits) != 0) {
        s_err(err, errlen, "activation precision must be 8 or 16 bits, not %d", opts->act_bits);
        goto fail;
    }

    fi_config *c = &m->cfg;
    const fi_gguf_tensor *emb = fi_gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!emb) {
        s_err(err, errlen, "%s: tensor 'token_embd.weight' is missing", m->path);
        goto fail;
    }
    if (emb->ne[1] < 1 || emb->ne[1] > (1 << 22)) {
        s_err(err, errlen, "%s: tensor 'token_embd.weight' has %lld rows; expected a vocabulary",
              m->path, (long long)emb->ne[1]);
        goto fail;
    }
    c->n_vocab = (int)emb->ne[1];
    if (c->n_vocab != fi_tok_n_vocab(m->tok)) {
        s_err(err, errlen, "%s: token_embd has %d rows but the tokenizer has %d tokens", m->path,
              c->n_vocab, fi_tok_n_vocab(m->tok));
        goto fail;
    }
    if (s_bind_weight(m, &m->tok_embd, "token_embd.weight", c->n_vocab, c->dim, err, errlen))
        goto fail;
    if (fi_gguf_find_tensor(m->gguf, "output.weight")) {
        c->tied_output = 0;
        if (s_bind_weight(m, &m->output, "output.weight", c->n_vocab, c->dim, err, errlen))
            goto fail;
    } else {
        c->tied_output = 1;
        m->output = m->tok_embd;
    }
    m->output_norm = s_bind_vector(m, "output_norm.weight", c->dim, err, errlen);
    if (!m->output_norm) goto fail;

    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) {
        s_err(err, errlen, "out of memory");
        goto fail;
    }
    int kv_dim = c->n_kv_heads * c->head_dim;
    for (int l = 0; l < c->n_layers; l++) {
        layer *L = &m->layers[l];
        char name[96];
#define BIND_W(field, suffix, rows, cols)                                                  \
    do {                                                                                   \
        snprintf(name, sizeof name, "blk.%d." suffix ".weight", l);                        \
        if (s_bind_weight(m, &L->field, name, rows, cols, err, errlen)) goto fail;          \
    } while (0)
        BIND_W(wq, "attn_q", c->dim, c->dim);
        BIND_W(wk, "attn_k", kv_dim, c->dim);
        BIND_W(wv, "attn_v", kv_dim, c->dim);
        BIND_W(wo, "attn_output", c->dim, c->dim);
        BIND_W(w_gate, "ffn_gate", c->ffn_dim, c->dim);
        BIND_W(w_up, "ffn_up", c->ffn_dim, c->dim);
        BIND_W(w_down, "ffn_down", c->dim, c->ffn_dim);
#undef BIND_W
        snprintf(name, sizeof name, "blk.%d.attn_norm.weight", l);
        if (!(L->attn_norm = s_bind_vector(m, name, c->dim, err, errlen))) goto fail;
        snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", l);
        if (!(L->ffn_norm = s_bind_vector(m, name, c->dim, err, errlen))) goto fail;
    }
    return m;
fail:
    fi_model_destroy(&m);
    return NULL;
}

static void s_release(fi_model *m, fi_weight *w) {
    if (w->dev && m->be->ops->weight_release) m->be->ops->weight_release(m->be->ctx, w);
    w->dev = NULL;
}

void fi_model_destroy(fi_model **mp) {
    if (!mp || !*mp) return;
    fi_model *m = *mp;
    if (m->be) {
        const fi_backend_ops *ops = m->be->ops;
        if (m->layers) {
            for (int l = 0; l < m->cfg.n_layers; l++) {
                layer *L = &m->layers[l];
                s_release(m, &L->wq);
                s_release(m, &L->wk);
                s_release(m, &L->wv);
                s_release(m, &L->wo);
                s_release(m, &L->w_gate);
                s_release(m, &L->w_up);
                s_release(m, &L->w_down);
                if (L->attn_norm) ops->free(m->be->ctx, L->attn_norm);
                if (L->ffn_norm) ops->free(m->be->ctx, L->ffn_norm);
            }
        }
        if (!m->cfg.tied_output) s_release(m, &m->output);
        s_release(m, &m->tok_embd);
        if (m->output_norm) ops->free(m->be->ctx, m->output_norm);
    }
    free(m->layers);
    fi_backend_destroy(&m->be);
    fi_tok_destroy(&m->tok);
    fi_gguf_close(&m->gguf);
    free(m->path);
    free(m);
    *mp = NULL;
}

const fi_config *fi_model_config(const fi_model *m) { return &m->cfg; }
const fi_tok *fi_model_tok(const fi_model *m) { return m->tok; }
const fi_gguf *fi_model_gguf(const fi_model *m) { return m->gguf; }
fi_backend *fi_model_backend(const fi_model *m) { return m->be; }

uint64_t fi_model_weight_bytes_per_token(const fi_model *m) {
    uint64_t total = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const layer *L = &m->layers[l];
        const fi_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            total += (uint64_t)ws[i]->rows * ws[i]->row_bytes;
    }
    total += (uint64_t)m->output.rows * m->output.row_bytes; /* the logits matrix */
    total += m->tok_embd.row_bytes;                          /* one embedding row */
    total += (uint64_t)(2 * m->cfg.n_layers + 1) * m->cfg.dim * sizeof(float); /* norms */
    return total;
}

/* --- sessions ---------------------------------------------------------- */

fi_session *fi_session_new(fi_model *m, int n_ctx, char *err, size_t errlen) {
    const fi_config *c = &m->cfg;
    if (n_ctx <= 0) n_ctx = c->ctx_train < 4096 ? c->ctx_train : 4096;
    if (n_ctx > c->ctx_train) {
        s_err(err, errlen, "context of %d tokens exceeds the model's trained context of %d",
              n_ctx, c->ctx_train);
        return NULL;
    }
    fi_session *s = calloc(1, sizeof *s);
    if (!s) {
        s_err(err, errlen, "out of memory");
        return NULL;
    }
    s->m = m;
    s->n_ctx = n_ctx;
    const fi_backend_ops *ops = m->be->ops;
    void *bc = m->be->ctx;
    size_t kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    size_t cache = (size_t)c->n_layers * (size_t)n_ctx * kv_dim * sizeof(uint16_t);
    size_t B = FI_MAX_BATCH;
    s->kcache = ops->alloc(bc, cache);
    s->vcache = ops->alloc(bc, cache);
    s->x = ops->alloc(bc, B * c->dim * sizeof(float));
    s->xb = ops->alloc(bc, B * c->dim * sizeof(float));
    s->q = ops->alloc(bc, B * c->dim * sizeof(float));
    s->k = ops->alloc(bc, B * kv_dim * sizeof(float));
    s->v = ops->alloc(bc, B * kv_dim * sizeof(float));
    s->hb = ops->alloc(bc, B * c->ffn_dim * sizeof(float));
    s->hb2 = ops->alloc(bc, B * c->ffn_dim * sizeof(float));
    s->logits = ops->alloc(bc, (size_t)FI_LOGIT_ROWS * (size_t)c->n_vocab * sizeof(float));
    s->toks = ops->alloc(bc, B * sizeof(int32_t));
    s->pos_buf = ops->alloc(bc, B * sizeof(int32_t));
    s->pos_host = malloc(B * sizeof(int32_t));
    if (!s->kcache || !s->vcache || !s->x || !s->xb || !s->q || !s->k || !s->v || !s->hb ||
        !s->hb2 || !s->logits || !s->toks || !s->pos_buf || !s->pos_host) {
        s_err(err, errlen, "out of memory for a session of %d tokens (%zu MiB of KV cache)",
              n_ctx, 2 * cache >> 20);
        fi_session_destroy(&s);
        return NULL;
    }
    return s;
}

void fi_session_destroy(fi_session **sp) {
    if (!sp || !*sp) return;
    fi_session *s = *sp;
    const fi_backend_ops *ops = s->m->be->ops;
    void *bc = s->m->be->ctx;
    void *bufs[] = {s->kcache, s->vcache, s->x,      s->xb,   s->q,    s->k,
                    s->v,      s->hb,     s->hb2,    s->logits, s->toks, s->pos_buf};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ops->free(bc, bufs[i]);
    free(s->pos_host);
    free(s);
    *sp = NULL;
}

fi_model *fi_session_model(const fi_session *s) { return s->m; }
int fi_session_n_ctx(const fi_session *s) { return s->n_ctx; }
int fi_session_pos(const fi_session *s) { return s->pos; }

void fi_session_rewind(fi_session *s, int pos) {
    if (pos < 0) pos = 0;
    if (pos < s->pos) s->pos = pos;
}

/* One forward pass over n <= FI_MAX_BATCH tokens at positions s->pos ..
 * s->pos+n-1. Leaves the final hidden states (before the output norm) in
 * s->x. */
static int s_forward(fi_session *s, const int32_t *toks, int n) {
    fi_model *m = s->m;
    const fi_config *c = &m->cfg;
    const fi_backend_ops *ops = m->be->ops;
    void *bc = m->be->ctx;
    int dim = c->dim, kv_dim = c->n_kv_heads * c->head_dim;

    for (int t = 0; t < n; t++) s->pos_host[t] = s->pos + t;
    if (ops->to_backend(bc, s->toks, toks, (size_t)n * sizeof(int32_t)) ||
        ops->to_backend(bc, s->pos_buf, s->pos_host, (size_t)n * sizeof(int32_t)))
        return -1;
    ops->get_rows(bc, s->x, &m->tok_embd, s->toks, n);

    for (int l = 0; l < c->n_layers; l++) {
        const layer *L = &m->layers[l];
        /* attention */
        ops->rmsnorm(bc, s->xb, s->x, L->attn_norm, n, dim, c->norm_eps);
        ops->matmul(bc, s->q, &L->wq, s->xb, n);
        ops->matmul(bc, s->k, &L->wk, s->xb, n);
        ops->matmul(bc, s->v, &L->wv, s->xb, n);
        ops->rope(bc, s->q, n, c->n_heads, c->head_dim, s->pos_buf, c->rope_theta);
        ops->rope(bc, s->k, n, c->n_kv_heads, c->head_dim, s->pos_buf, c->rope_theta);
        size_t layer_off = (size_t)l * s->n_ctx * kv_dim + (size_t)s->pos * kv_dim;
        ops->store_f16(bc, s->kcache + layer_off, s->k, (size_t)n * kv_dim);
        ops->store_f16(bc, s->vcache + layer_off, s->v, (size_t)n * kv_dim);
        const uint16_t *kc = s->kcache + (size_t)l * s->n_ctx * kv_dim;
        const uint16_t *vc = s->vcache + (size_t)l * s->n_ctx * kv_dim;
        ops->attention(bc, s->xb, s->q, kc, vc, n, s->pos_buf, c->n_heads, c->n_kv_heads,
                       c->head_dim);
        ops->matmul(bc, s->q, &L->wo, s->xb, n); /* q is free again: reuse it */
        ops->add(bc, s->x, s->q, (size_t)n * dim);
        /* feed-forward (SwiGLU) */
        ops->rmsnorm(bc, s->xb, s->x, L->ffn_norm, n, dim, c->norm_eps);
        ops->matmul(bc, s->hb, &L->w_gate, s->xb, n);
        ops->matmul(bc, s->hb2, &L->w_up, s->xb, n);
        ops->swiglu(bc, s->hb, s->hb2, (size_t)n * c->ffn_dim);
        ops->matmul(bc, s->xb, &L->w_down, s->hb, n);
        ops->add(bc, s->x, s->xb, (size_t)n * dim);
    }
    return 0;
}

int fi_session_eval(fi_session *s, const int32_t *toks, int n, float *logits, float *all_logits,
                    char *err, size_t errlen) {
    fi_model *m = s->m;
    const fi_config *c = &m->cfg;
    const fi_backend_ops *ops = m->be->ops;
    void *bc = m->be->ctx;
    if (n <= 0) {
        s_err(err, errlen, "nothing to evaluate (0 tokens)");
        return -1;
    }
    if (n > s->n_ctx - s->pos) {
        s_err(err, errlen,
              "context full: %d tokens do not fit after position %d in a context of %d", n,
              s->pos, s->n_ctx);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (toks[i] < 0 || toks[i] >= c->n_vocab) {
            s_err(err, errlen, "token %d at index %d is outside the vocabulary of %d", toks[i], i,
                  c->n_vocab);
            return -1;
        }
    }
    size_t V = (size_t)c->n_vocab;
    for (int done = 0; done < n;) {
        int b = n - done < FI_MAX_BATCH ? n - done : FI_MAX_BATCH;
        if (s_forward(s, toks + done, b) != 0) {
            s_err(err, errlen, "backend '%s' failed during the forward pass", ops->name);
            return -1;
        }
        s->pos += b;
        int last_chunk = done + b == n;
        if (all_logits) {
            ops->rmsnorm(bc, s->xb, s->x, m->output_norm, b, c->dim, c->norm_eps);
            for (int r = 0; r < b; r += FI_LOGIT_ROWS) {
                int nr = b - r < FI_LOGIT_ROWS ? b - r : FI_LOGIT_ROWS;
                ops->matmul(bc, s->logits, &m->output, s->xb + (size_t)r * c->dim, nr);
                if (ops->to_host(bc, all_logits + (size_t)(done + r) * V, s->logits,
                                 (size_t)nr * V * sizeof(float)))
                    goto backend_fail;
            }
            if (last_chunk && logits)
                memcpy(logits, all_logits + (size_t)(n - 1) * V, V * sizeof(float));
        } else if (last_chunk && logits) {
            const float *xl = s->x + (size_t)(b - 1) * c->dim;
            ops->rmsnorm(bc, s->xb, xl, m->output_norm, 1, c->dim, c->norm_eps);
            ops->matmul(bc, s->logits, &m->output, s->xb, 1);
            if (ops->to_host(bc, logits, s->logits, V * sizeof(float))) goto backend_fail;
        }
        done += b;
    }
    if (ops->sync(bc) != 0) goto backend_fail;
    return 0;
backend_fail:
    s_err(err, errlen, "backend '%s' failed reading back logits", ops->name);
    return -1;
}
