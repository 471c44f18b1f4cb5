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
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <stdatomic.h>
#include <unistd.h>

#include "fi_model.h"

/* Most tokens a session's forward pass takes at once; longer prompts go
 * in chunks. */
#define FI_MAX_BATCH 256
/* Most rows of logits a session computes at once (a row is n_vocab floats:
 * 192 KiB for the default model, so a whole batch would cost 48 MiB). */
#define FI_LOGIT_ROWS 16

typedef struct layer {
    float *attn_norm;       /* (dim) backend memory */
    float *ffn_norm;        /* (dim) backend memory */
    fi_weight wq;           /* (q_dim, dim): this rank's query heads */
    fi_weight wk;           /* (kv_dim, dim): this rank's KV heads */
    fi_weight wv;           /* (kv_dim, dim) */
    fi_weight wo;           /* (dim, q_dim): the matching input columns */
    fi_weight w_gate;       /* (ffn, dim): this rank's rows */
    fi_weight w_up;         /* (ffn, dim) */
    fi_weight w_down;       /* (dim, ffn): the matching input columns */
} layer;

struct fi_model {
    char *path;             /* the file, for messages */
    fi_gguf *gguf;          /* owns the mapping the weights point into */
    fi_tok *tok;            /* tokenizer */
    fi_backend *be;         /* compute backend */
    fi_config cfg;
    fi_shard_plan plan;     /* normalised: every range filled in */
    int sliced;             /* the plan is not the whole model */
    /* This rank's sizes (the whole model's without a plan). */
    int n_local_layers, n_heads_l, n_kv_l, q_dim_l, kv_dim_l, ffn_l;
    fi_weight tok_embd;     /* (n_vocab, dim); absent (data NULL) per plan */
    fi_weight output;       /* (n_vocab, dim); a copy of tok_embd when tied */
    float *output_norm;     /* (dim) backend memory; NULL per plan */
    layer *layers;          /* n_local_layers: plan.layer_begin.. */
    void **owned;           /* slices copied out of the file (plans) */
    int n_owned;
    fi_allreduce_fn allreduce; /* tensor-parallel sum, or NULL */
    void *allreduce_user;
    fi_model_opts be_opts;  /* the backend's options, for fi_model_reset_backend */
    int be_auto;            /* the caller asked for FI_DEVICE_AUTO */
    int be_unbound;         /* a reset could not bind every weight: no pass runs */
    char pin[65];           /* the SHA-256 the load checked ("": none), checked again
                               by a reset, which reads the weights from the file again */
    atomic_int n_pools;     /* KV pools (and sessions) alive on the backend */
};

struct fi_kvpool {
    fi_model *m;
    int n_blocks, max_tokens, max_out;
    uint8_t *kcache;        /* (layers, n_blocks*FI_KV_BLOCK) rows of kv_row bytes in the
                               backend's format (fi_backend_kv_row_bytes), backend */
    uint8_t *vcache;
    size_t kv_row;          /* bytes per cache row */
    int kv_bits;            /* their format (fi_backend_kv_bits when made) */
    /* Activations for up to max_tokens tokens, backend memory. */
    float *x;               /* (n, dim) residual stream */
    float *xb;              /* (n, dim) normed input / attention output */
    float *q;               /* (n, max(q_dim, dim)) queries, then projections */
    float *k;               /* (n, kv_dim) */
    float *v;               /* (n, kv_dim) */
    float *hb;              /* (n, ffn) gate, then swiglu */
    float *hb2;             /* (n, ffn) up */
    float *logits;          /* (max_out, n_vocab) */
    int32_t *toks, *pos, *seq, *slot; /* (n) backend memory */
    int32_t *tables;        /* backend memory, tables_cap entries */
    size_t tables_cap;
    int32_t *slot_host;     /* (n) */
    uint64_t serial;        /* never reused: names the pool in graph signatures */
};

/* Pools made so far (fi_kvpool.serial). */
static _Atomic uint64_t s_pool_serial;

struct fi_session {
    fi_model *m;
    fi_kvpool *kv;          /* n_ctx / FI_KV_BLOCK blocks, in order */
    int n_ctx;              /* positions the cache holds */
    int pos;                /* positions filled */
    int32_t *table;         /* 0, 1, 2, ...: blocks of the session */
    int32_t *pos_host, *seq_host, *rows_host; /* (FI_MAX_BATCH) */
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

/* The backend's own message for its last failure, or a generic one. */
static const char *s_backend_error(const fi_backend *be) {
    const char *e = be->ops->last_error ? be->ops->last_error(be->ctx) : NULL;
    return e ? e : "no details";
}

int fi_device_parse(const char *s, fi_device *out) {
    if (!strcmp(s, "cpu")) *out = FI_DEVICE_CPU;
    else if (!strcmp(s, "cuda")) *out = FI_DEVICE_CUDA;
    else if (!strcmp(s, "auto")) *out = FI_DEVICE_AUTO;
    else return -1;
    return 0;
}

/* The backend opts asks for. NULL with a message: for CUDA without a
 * device, "no CUDA device: <why>". AUTO falls back to the CPU quietly, and
 * takes the CPU at once for an 8-bit KV cache, which only it has. */
static fi_backend *s_backend_new(const fi_model_opts *opts, char *err, size_t errlen) {
    const int kv8 = opts->kv_bits && opts->kv_bits != FI_KV_ROW_F16;
    if (opts->device == FI_DEVICE_CUDA && kv8) {
        s_err(err, errlen, "an %d-bit KV cache is for the CPU backend only: the CUDA backend "
              "keeps it in fp16 (leave kv_bits at 16, or run on the CPU)", opts->kv_bits);
        return NULL;
    }
    if (opts->device == FI_DEVICE_CUDA || (opts->device == FI_DEVICE_AUTO && !kv8)) {
        char why[384];
        fi_backend *be = fi_cuda_backend_open(opts->gpu, why, sizeof why);
        if (be) return be;
        if (opts->device == FI_DEVICE_CUDA) {
            s_err(err, errlen, "no CUDA device: %s", why);
            return NULL;
        }
    } else if (opts->device != FI_DEVICE_CPU && opts->device != FI_DEVICE_AUTO) {
        s_err(err, errlen, "unknown device %d", (int)opts->device);
        return NULL;
    }
    fi_backend *be = fi_cpu_backend_new(opts->n_threads, opts->simd, err, errlen);
    if (be && opts->act_bits && fi_cpu_backend_set_act_bits(be, opts->act_bits) != 0) {
        s_err(err, errlen, "activation precision must be 8, 12 or 16 bits, not %d", opts->act_bits);
        fi_backend_destroy(&be);
    }
    if (be && opts->kv_bits && fi_cpu_backend_set_kv_bits(be, opts->kv_bits) != 0) {
        s_err(err, errlen, "KV cache precision must be 8 or 16 bits, not %d", opts->kv_bits);
        fi_backend_destroy(&be);
    }
    return be;
}

/* Lets the kernel drop the whole pages of the mapping in [lo, hi): read
 * again, they come back from the file. */
static void s_drop_pages(uintptr_t lo, uintptr_t hi) {
    long pg = sysconf(_SC_PAGESIZE);
    if (pg <= 0 || hi <= lo) return;
    uintptr_t a = (lo + (uintptr_t)pg - 1) & ~((uintptr_t)pg - 1);
    uintptr_t e = hi & ~((uintptr_t)pg - 1);
    if (e > a) (void)madvise((void *)a, e - a, MADV_DONTNEED);
}

/* Binds rows [r0, r0+nr) and columns [c0, c0+nc) of a weight matrix (nr
 * or nc 0: all): the tensor must exist and be 2-D (rows, cols) of a type the
 * kernels support. The whole matrix is read in place from the mapping; a
 * slice (shard plans) is copied into memory the model owns, columns on
 * block boundaries (fi_shard_plan_check made sure). */
static int s_bind_slice(fi_model *m, fi_weight *w, const char *name, int rows, int cols, int r0,
                        int nr, int c0, int nc, char *err, size_t errlen) {
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
    size_t full_row = fi_dtype_row_bytes(t->type, cols);
    if (full_row == 0 || (uint64_t)full_row * (uint64_t)rows != t->n_bytes) {
        s_err(err, errlen, "%s: tensor '%s' holds %llu bytes, expected %llu for %d x %d %s",
              m->path, name, (unsigned long long)t->n_bytes,
              (unsigned long long)full_row * (unsigned long long)rows, rows, cols,
              fi_dtype_name(t->type));
        return -1;
    }
    if (nr <= 0) r0 = 0, nr = rows;
    if (nc <= 0) c0 = 0, nc = cols;
    w->type = t->type;
    w->rows = nr;
    w->cols = nc;
    w->row_bytes = fi_dtype_row_bytes(t->type, nc);
    w->dev = NULL;
    if (nr == rows && nc == cols) {
        w->data = t->data;
    } else {
        size_t skip = c0 ? fi_dtype_row_bytes(t->type, c0) : 0;
        if (w->row_bytes == 0 || (c0 && skip == 0) || r0 < 0 || r0 + nr > rows || c0 < 0 ||
            c0 + nc > cols) {
            s_err(err, errlen, "%s: tensor '%s': slice rows %d+%d, columns %d+%d does not fit "
                  "[%d, %d] %s blocks", m->path, name, r0, nr, c0, nc, cols, rows,
                  fi_dtype_name(t->type));
            return -1;
        }
        void **grown = realloc(m->owned, (size_t)(m->n_owned + 1) * sizeof *grown);
        uint8_t *copy = malloc((size_t)nr * w->row_bytes);
        if (grown) m->owned = grown;
        if (!grown || !copy) {
            free(copy);
            s_err(err, errlen, "out of memory for a slice of '%s'", name);
            return -1;
        }
        m->owned[m->n_owned++] = copy;
        const uint8_t *src = (const uint8_t *)t->data + (size_t)r0 * full_row + skip;
        for (int r = 0; r < nr; r++)
            memcpy(copy + (size_t)r * w->row_bytes, src + (size_t)r * full_row, w->row_bytes);
        w->data = copy;
    }
    fi_backend *be = m->be;
    if (be->ops->weight_upload && be->ops->weight_upload(be->ctx, w) != 0) {
        s_err(err, errlen, "%s: backend '%s' could not take tensor '%s': %s", m->path,
              be->ops->name, name, s_backend_error(be));
        return -1;
    }
    /* the backend has its own copy: the mapped pages need not stay (so the
     * load never holds the model twice) */
    if (w->dev && w->data == t->data)
        s_drop_pages((uintptr_t)t->data, (uintptr_t)t->data + (uintptr_t)t->n_bytes);
    return 0;
}

static int s_bind_weight(fi_model *m, fi_weight *w, const char *name, int rows, int cols,
                         char *err, size_t errlen) {
    return s_bind_slice(m, w, name, rows, cols, 0, 0, 0, 0, err, errlen);
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
        s_err(err, errlen, "backend could not take tensor '%s': %s", name,
              s_backend_error(m->be));
        m->be->ops->free(m->be->ctx, dev);
        return NULL;
    }
    return dev;
}

int fi_shard_plan_check(const fi_shard_plan *p, const fi_config *c, int blk, char *err,
                        size_t errlen) {
    int le = p->layer_end ? p->layer_end : c->n_layers;
    if (p->layer_begin < 0 || p->layer_begin >= le || le > c->n_layers) {
        s_err(err, errlen, "shard plan: layers [%d, %d) are not a range inside the model's %d",
              p->layer_begin, le, c->n_layers);
        return -1;
    }
    if (p->kv_head_count < 0 || p->kv_head_begin < 0 ||
        (p->kv_head_count && p->kv_head_begin + p->kv_head_count > c->n_kv_heads)) {
        s_err(err, errlen, "shard plan: KV heads %d+%d are not inside the model's %d",
              p->kv_head_begin, p->kv_head_count, c->n_kv_heads);
        return -1;
    }
    if (p->ffn_count < 0 || p->ffn_begin < 0 ||
        (p->ffn_count && p->ffn_begin + p->ffn_count > c->ffn_dim)) {
        s_err(err, errlen, "shard plan: FFN slice %d+%d is not inside the model's %d",
              p->ffn_begin, p->ffn_count, c->ffn_dim);
        return -1;
    }
    if (blk < 1) blk = 1;
    if (p->ffn_count && (p->ffn_begin % blk || p->ffn_count % blk)) {
        s_err(err, errlen,
              "shard plan: FFN slice %d+%d is off the weights' quantisation block of %d "
              "columns (ffn_down is split by columns)", p->ffn_begin, p->ffn_count, blk);
        return -1;
    }
    int qcols = c->n_heads / c->n_kv_heads * c->head_dim; /* attn_output columns per KV head */
    if (p->kv_head_count && (p->kv_head_begin * qcols) % blk) {
        s_err(err, errlen,
              "shard plan: KV head %d starts attn_output column %d, off the quantisation "
              "block of %d", p->kv_head_begin, p->kv_head_begin * qcols, blk);
        return -1;
    }
    return 0;
}

/* A sliced model has copied what it needs: give the mapped weight pages
 * back (the mapping stays, for the metadata). */
static void s_drop_mapped_weights(fi_model *m) {
    int64_t nt = fi_gguf_n_tensors(m->gguf);
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int64_t i = 0; i < nt; i++) {
        const fi_gguf_tensor *t = fi_gguf_tensor_at(m->gguf, i);
        uintptr_t a = (uintptr_t)t->data, e = a + (uintptr_t)t->n_bytes;
        lo = a < lo ? a : lo;
        hi = e > hi ? e : hi;
    }
    s_drop_pages(lo, hi);
}

static fi_model *s_load(const char *path, const fi_model_opts *opts, int *on_gpu, char *err,
                        size_t errlen);

fi_model *fi_model_load(const char *path, const fi_model_opts *opts, char *err, size_t errlen) {
    fi_model_opts defaults = {.simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU};
    if (!opts) opts = &defaults;
    int on_gpu = 0;
    fi_model_opts used = *opts;
    fi_model *m = s_load(path, opts, &on_gpu, err, errlen);
    if (!m && on_gpu && opts->device == FI_DEVICE_AUTO) {
        /* a device was there but could not take the model (memory, for
         * one): the CPU may still run it, and reports its own error if not */
        used.device = FI_DEVICE_CPU;
        m = s_load(path, &used, &on_gpu, err, errlen);
    }
    if (m) {
        /* what a reset makes its new backend with: the device the load
         * landed on (AUTO where that was a GPU); the plan was for the load */
        if (!strcmp(m->be->ops->name, "cpu")) used.device = FI_DEVICE_CPU;
        used.plan = NULL;
        used.sha256 = NULL;
        m->be_opts = used;
        m->be_auto = opts->device == FI_DEVICE_AUTO;
        if (opts->sha256) snprintf(m->pin, sizeof m->pin, "%s", opts->sha256);
    }
    return m;
}

/* 0 when the file's SHA-256 is want (64 hex digits, either case), else -1
 * with a message naming both. The bytes hashed are the ones mapped, so
 * the weights used are the weights checked. */
static int s_check_sha256(const fi_gguf *g, const char *path, const char *want, char *err,
                          size_t errlen) {
    size_t n = strlen(want);
    int hex = n == 64;
    for (size_t i = 0; hex && i < n; i++) hex = isxdigit((unsigned char)want[i]) != 0;
    if (!hex) {
        s_err(err, errlen, "the model's pinned SHA-256 (model_sha256) must be 64 hexadecimal "
              "digits; got %zu characters%s", n, n == 64 ? ", not all hexadecimal" : "");
        return -1;
    }
    char got[65];
    fi_gguf_sha256(g, got);
    if (strcasecmp(got, want) != 0) {
        s_err(err, errlen, "%s: SHA-256 is %s, but the deployment pins %s (model_sha256): "
              "not the model it names", path, got, want);
        return -1;
    }
    return 0;
}

/* fi_model_load on the backend opts names; *on_gpu is set when that
 * backend turned out not to be the CPU. */
static fi_model *s_load(const char *path, const fi_model_opts *opts, int *on_gpu, char *err,
                        size_t errlen) {
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
    if (opts->sha256 && opts->sha256[0] && s_check_sha256(m->gguf, path, opts->sha256, err, errlen))
        goto fail;
    if (s_read_config(m, err, errlen) != 0) goto fail;
    m->tok = fi_tok_new(m->gguf, err, errlen);
    if (!m->tok) goto fail;
    m->be = s_backend_new(opts, err, errlen);
    if (!m->be) goto fail;
    *on_gpu = strcmp(m->be->ops->name, "cpu") != 0;

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
    c->tied_output = fi_gguf_find_tensor(m->gguf, "output.weight") == NULL;

    /* the plan: checked against the model, then normalised */
    const fi_gguf_tensor *wo0 = fi_gguf_find_tensor(m->gguf, "blk.0.attn_output.weight");
    const fi_gguf_tensor *wd0 = fi_gguf_find_tensor(m->gguf, "blk.0.ffn_down.weight");
    int blk = 1;
    if (wo0 && fi_dtype_block_elems(wo0->type) > blk) blk = fi_dtype_block_elems(wo0->type);
    if (wd0 && fi_dtype_block_elems(wd0->type) > blk) blk = fi_dtype_block_elems(wd0->type);
    fi_shard_plan whole = {0};
    const fi_shard_plan *pl = opts->plan ? opts->plan : &whole;
    if (fi_shard_plan_check(pl, c, blk, err, errlen) != 0) goto fail;
    m->plan = *pl;
    fi_shard_plan *P = &m->plan;
    if (P->layer_end == 0) P->layer_end = c->n_layers;
    if (P->kv_head_count == 0) P->kv_head_begin = 0, P->kv_head_count = c->n_kv_heads;
    if (P->ffn_count == 0) P->ffn_begin = 0, P->ffn_count = c->ffn_dim;
    int group = c->n_heads / c->n_kv_heads;
    m->n_local_layers = P->layer_end - P->layer_begin;
    m->n_kv_l = P->kv_head_count;
    m->n_heads_l = P->kv_head_count * group;
    m->q_dim_l = m->n_heads_l * c->head_dim;
    m->kv_dim_l = m->n_kv_l * c->head_dim;
    m->ffn_l = P->ffn_count;
    m->sliced = m->n_local_layers != c->n_layers || m->n_kv_l != c->n_kv_heads ||
                m->ffn_l != c->ffn_dim || P->no_embed || P->no_output;

    int need_embd = !P->no_embed || (!P->no_output && c->tied_output);
    if (need_embd &&
        s_bind_weight(m, &m->tok_embd, "token_embd.weight", c->n_vocab, c->dim, err, errlen))
        goto fail;
    if (!P->no_output) {
        if (c->tied_output) {
            m->output = m->tok_embd;
        } else if (s_bind_weight(m, &m->output, "output.weight", c->n_vocab, c->dim, err,
                                 errlen)) {
            goto fail;
        }
        m->output_norm = s_bind_vector(m, "output_norm.weight", c->dim, err, errlen);
        if (!m->output_norm) goto fail;
    }

    m->layers = calloc((size_t)m->n_local_layers, sizeof *m->layers);
    if (!m->layers) {
        s_err(err, errlen, "out of memory");
        goto fail;
    }
    int kv_dim = c->n_kv_heads * c->head_dim, hd = c->head_dim;
    int q0 = P->kv_head_begin * group * hd, k0 = P->kv_head_begin * hd;
    for (int i = 0; i < m->n_local_layers; i++) {
        int l = P->layer_begin + i;
        layer *L = &m->layers[i];
        char name[96];
#define BIND_W(field, suffix, rows, cols, r0, nr, c0, nc)                                  \
    do {                                                                                   \
        snprintf(name, sizeof name, "blk.%d." suffix ".weight", l);                        \
        if (s_bind_slice(m, &L->field, name, rows, cols, r0, nr, c0, nc, err, errlen))      \
            goto fail;                                                                     \
    } while (0)
        BIND_W(wq, "attn_q", c->dim, c->dim, q0, m->q_dim_l, 0, 0);
        BIND_W(wk, "attn_k", kv_dim, c->dim, k0, m->kv_dim_l, 0, 0);
        BIND_W(wv, "attn_v", kv_dim, c->dim, k0, m->kv_dim_l, 0, 0);
        BIND_W(wo, "attn_output", c->dim, c->dim, 0, 0, q0, m->q_dim_l);
        BIND_W(w_gate, "ffn_gate", c->ffn_dim, c->dim, P->ffn_begin, m->ffn_l, 0, 0);
        BIND_W(w_up, "ffn_up", c->ffn_dim, c->dim, P->ffn_begin, m->ffn_l, 0, 0);
        BIND_W(w_down, "ffn_down", c->dim, c->ffn_dim, 0, 0, P->ffn_begin, m->ffn_l);
#undef BIND_W
        snprintf(name, sizeof name, "blk.%d.attn_norm.weight", l);
        if (!(L->attn_norm = s_bind_vector(m, name, c->dim, err, errlen))) goto fail;
        snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", l);
        if (!(L->ffn_norm = s_bind_vector(m, name, c->dim, err, errlen))) goto fail;
    }
    if (m->sliced) s_drop_mapped_weights(m);
    return m;
fail:
    fi_model_destroy(&m);
    return NULL;
}

static void s_release(fi_model *m, fi_weight *w) {
    if (w->dev && m->be->ops->weight_release) m->be->ops->weight_release(m->be->ctx, w);
    w->dev = NULL;
}

/* Everything m holds on its backend given back: the weights' device
 * copies and the norm vectors (the host side stays). */
static void s_unbind_all(fi_model *m) {
    if (!m->be) return;
    const fi_backend_ops *ops = m->be->ops;
    for (int l = 0; m->layers && l < m->n_local_layers; l++) {
        layer *L = &m->layers[l];
        fi_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) s_release(m, ws[i]);
        if (L->attn_norm) ops->free(m->be->ctx, L->attn_norm);
        if (L->ffn_norm) ops->free(m->be->ctx, L->ffn_norm);
        L->attn_norm = L->ffn_norm = NULL;
    }
    if (!m->cfg.tied_output) s_release(m, &m->output);
    s_release(m, &m->tok_embd);
    if (m->cfg.tied_output) m->output.dev = NULL;
    if (m->output_norm) ops->free(m->be->ctx, m->output_norm);
    m->output_norm = NULL;
}

/* One weight bound again to m->be (its host side as the load left it). */
static int s_rebind(fi_model *m, fi_weight *w, const char *what, char *err, size_t errlen) {
    fi_backend *be = m->be;
    if (!w->data || !be->ops->weight_upload) return 0;
    if (be->ops->weight_upload(be->ctx, w) != 0) {
        s_err(err, errlen, "%s: backend '%s' could not take %s again: %s", m->path, be->ops->name,
              what, s_backend_error(be));
        return -1;
    }
    if (w->dev && !m->sliced) /* mapped, as at load: the backend has its copy */
        s_drop_pages((uintptr_t)w->data, (uintptr_t)w->data + (uintptr_t)w->rows * w->row_bytes);
    return 0;
}

/* Every weight and vector of the plan bound to m->be, as the load did. */
static int s_rebind_all(fi_model *m, char *err, size_t errlen) {
    const fi_config *c = &m->cfg;
    char name[96];
    if (s_rebind(m, &m->tok_embd, "token_embd.weight", err, errlen)) return -1;
    if (!m->plan.no_output) {
        if (c->tied_output) m->output = m->tok_embd;
        else if (s_rebind(m, &m->output, "output.weight", err, errlen)) return -1;
        if (!(m->output_norm = s_bind_vector(m, "output_norm.weight", c->dim, err, errlen)))
            return -1;
    }
    for (int i = 0; i < m->n_local_layers; i++) {
        layer *L = &m->layers[i];
        int l = m->plan.layer_begin + i;
        fi_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t k = 0; k < sizeof ws / sizeof ws[0]; k++) {
            snprintf(name, sizeof name, "a weight of layer %d", l);
            if (s_rebind(m, ws[k], name, err, errlen)) return -1;
        }
        snprintf(name, sizeof name, "blk.%d.attn_norm.weight", l);
        if (!(L->attn_norm = s_bind_vector(m, name, c->dim, err, errlen))) return -1;
        snprintf(name, sizeof name, "blk.%d.ffn_norm.weight", l);
        if (!(L->ffn_norm = s_bind_vector(m, name, c->dim, err, errlen))) return -1;
    }
    return 0;
}

/* 1, with the reason in err, while a failed reset left m's weights off its
 * backend: no pool, session or pass until a reset succeeds. */
static int s_unbound(const fi_model *m, char *err, size_t errlen) {
    if (!m->be_unbound) return 0;
    s_err(err, errlen, "the model's weights are not on its backend (a reset failed): reset it "
          "again");
    return 1;
}

int fi_model_backend_failed(fi_model *m, char *why, size_t whylen) {
    if (m->be_unbound) {
        s_err(why, whylen, "the last reset could not bind the weights again");
        return 1;
    }
    if (m->be->ops->sync(m->be->ctx) == 0) return 0;
    s_err(why, whylen, "backend '%s': %s", m->be->ops->name, s_backend_error(m->be));
    return 1;
}

int fi_model_reset_backend(fi_model *m, char *err, size_t errlen) {
    int pools = atomic_load(&m->n_pools);
    if (pools) {
        s_err(err, errlen, "cannot reset the backend while %d KV pool%s or session%s of the model "
              "%s alive", pools, pools == 1 ? "" : "s", pools == 1 ? "" : "s",
              pools == 1 ? "is" : "are");
        return -1;
    }
    /* the weights come from the mapping again: a file shrunk in place
     * since the load would fault the process where the mapping passes its
     * end, and one changed in place would give others than the
     * deployment pinned */
    if (fi_gguf_check_size(m->gguf, m->path, err, errlen) != 0) return -1;
    if (m->pin[0] && s_check_sha256(m->gguf, m->path, m->pin, err, errlen) != 0) return -1;
    /* the load's options; asked for AUTO, the CPU after them, as
     * fi_model_load would have done (a device whose process context a
     * fault poisoned may still open, then fail to take the weights) */
    fi_model_opts tries[2] = {m->be_opts, m->be_opts};
    tries[1].device = FI_DEVICE_CPU;
    int n_tries = m->be_auto && m->be_opts.device != FI_DEVICE_CPU ? 2 : 1;
    for (int i = 0; i < n_tries; i++) {
        fi_backend *nb = s_backend_new(&tries[i], err, errlen);
        if (!nb) continue; /* the old backend stays, failed as it was */
        m->be_unbound = 1;
        s_unbind_all(m);
        fi_backend_destroy(&m->be);
        m->be = nb;
        if (s_rebind_all(m, err, errlen) == 0) {
            m->be_unbound = 0;
            return 0;
        }
    }
    return -1; /* unbound when a backend was made: reset again */
}

void fi_model_destroy(fi_model **mp) {
    if (!mp || !*mp) return;
    fi_model *m = *mp;
    s_unbind_all(m);
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
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
const fi_shard_plan *fi_model_plan(const fi_model *m) { return &m->plan; }

void fi_model_set_allreduce(fi_model *m, fi_allreduce_fn fn, void *user) {
    m->allreduce = fn;
    m->allreduce_user = user;
}

uint64_t fi_model_weight_bytes_per_token(const fi_model *m) {
    uint64_t total = 0;
    for (int l = 0; l < m->n_local_layers; l++) {
        const layer *L = &m->layers[l];
        const fi_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            total += (uint64_t)ws[i]->rows * ws[i]->row_bytes;
    }
    if (m->output_norm) /* the logits matrix */
        total += (uint64_t)m->output.rows * m->output.row_bytes + (uint64_t)m->cfg.dim * 4;
    if (!m->plan.no_embed) total += m->tok_embd.row_bytes; /* one embedding row */
    total += (uint64_t)(2 * m->n_local_layers) * m->cfg.dim * sizeof(float); /* norms */
    return total;
}

uint64_t fi_model_macs_per_token(const fi_model *m, int type) {
    uint64_t total = 0;
    for (int l = 0; l < m->n_local_layers; l++) {
        const layer *L = &m->layers[l];
        const fi_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            if (type < 0 || (int)ws[i]->type == type)
                total += (uint64_t)ws[i]->rows * (uint64_t)ws[i]->cols;
    }
    if (m->output_norm && (type < 0 || (int)m->output.type == type)) /* the logits matrix */
        total += (uint64_t)m->output.rows * (uint64_t)m->output.cols;
    return total;
}

/* --- the paged KV pool -------------------------------------------------- */

size_t fi_kv_block_bytes(const fi_model *m) {
    return (size_t)m->n_local_layers * 2 * FI_KV_BLOCK *
           fi_backend_kv_row_bytes(m->be, m->n_kv_l, m->cfg.head_dim);
}

fi_kvpool *fi_kvpool_new(fi_model *m, int n_blocks, int max_tokens, int max_out, char *err,
                         size_t errlen) {
    const fi_config *c = &m->cfg;
    if (n_blocks < 1 || max_tokens < 1 || max_tokens > (1 << 20) || max_out < 0 ||
        max_out > max_tokens || (size_t)n_blocks * FI_KV_BLOCK > (size_t)INT32_MAX) {
        s_err(err, errlen, "KV pool of %d blocks for %d tokens (%d with logits) is not possible",
              n_blocks, max_tokens, max_out);
        return NULL;
    }
    if (s_unbound(m, err, errlen)) return NULL;
    fi_kvpool *p = calloc(1, sizeof *p);
    if (!p) {
        s_err(err, errlen, "out of memory");
        return NULL;
    }
    p->m = m;
    p->serial = atomic_fetch_add(&s_pool_serial, 1) + 1;
    atomic_fetch_add(&m->n_pools, 1);
    p->n_blocks = n_blocks;
    p->kv_row = fi_backend_kv_row_bytes(m->be, m->n_kv_l, c->head_dim);
    p->kv_bits = fi_backend_kv_bits(m->be);
    p->max_tokens = max_tokens;
    p->max_out = max_out;
    const fi_backend_ops *ops = m->be->ops;
    void *bc = m->be->ctx;
    size_t cache = fi_kv_block_bytes(m) / 2 * (size_t)n_blocks;
    size_t B = (size_t)max_tokens, qw = (size_t)(m->q_dim_l > c->dim ? m->q_dim_l : c->dim);
    p->kcache = ops->alloc(bc, cache);
    p->vcache = ops->alloc(bc, cache);
    p->x = ops->alloc(bc, B * c->dim * sizeof(float));
    p->xb = ops->alloc(bc, B * qw * sizeof(float));
    p->q = ops->alloc(bc, B * qw * sizeof(float));
    p->k = ops->alloc(bc, B * m->kv_dim_l * sizeof(float));
    p->v = ops->alloc(bc, B * m->kv_dim_l * sizeof(float));
    p->hb = ops->alloc(bc, B * m->ffn_l * sizeof(float));
    p->hb2 = ops->alloc(bc, B * m->ffn_l * sizeof(float));
    p->logits = max_out ? ops->alloc(bc, (size_t)max_out * (size_t)c->n_vocab * sizeof(float))
                        : NULL;
    p->toks = ops->alloc(bc, B * sizeof(int32_t));
    p->pos = ops->alloc(bc, B * sizeof(int32_t));
    p->seq = ops->alloc(bc, B * sizeof(int32_t));
    p->slot = ops->alloc(bc, B * sizeof(int32_t));
    p->slot_host = malloc(B * sizeof(int32_t));
    if (!p->kcache || !p->vcache || !p->x || !p->xb || !p->q || !p->k || !p->v || !p->hb ||
        !p->hb2 || (max_out && !p->logits) || !p->toks || !p->pos || !p->seq || !p->slot ||
        !p->slot_host) {
        s_err(err, errlen, "out of memory for a KV pool of %d blocks (%zu MiB)", n_blocks,
              2 * cache >> 20);
        fi_kvpool_destroy(&p);
        return NULL;
    }
    return p;
}

void fi_kvpool_destroy(fi_kvpool **pp) {
    if (!pp || !*pp) return;
    fi_kvpool *p = *pp;
    const fi_backend_ops *ops = p->m->be->ops;
    void *bc = p->m->be->ctx;
    void *bufs[] = {p->kcache, p->vcache, p->x,    p->xb,  p->q,    p->k,      p->v,
                    p->hb,     p->hb2,    p->logits, p->toks, p->pos, p->seq, p->slot,
                    p->tables};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ops->free(bc, bufs[i]);
    free(p->slot_host);
    atomic_fetch_sub(&p->m->n_pools, 1);
    free(p);
    *pp = NULL;
}

int fi_kvpool_blocks(const fi_kvpool *p) { return p->n_blocks; }
int fi_kvpool_max_tokens(const fi_kvpool *p) { return p->max_tokens; }
int fi_kvpool_max_out(const fi_kvpool *p) { return p->max_out; }

int fi_batch_check(const fi_model *m, const fi_kvpool *kv, const fi_batch *b, char *err,
                   size_t errlen) {
    if (b->n < 1 || b->n > kv->max_tokens) {
        s_err(err, errlen, "batch of %d tokens; this pool takes 1..%d", b->n, kv->max_tokens);
        return -1;
    }
    if (b->n_out < 0 || b->n_out > kv->max_out) {
        s_err(err, errlen, "batch wants %d rows of logits; this pool takes at most %d", b->n_out,
              kv->max_out);
        return -1;
    }
    if (b->n_seqs < 1 || b->max_blocks < 1 || !b->tables || !b->pos || !b->seq ||
        (b->n_out && !b->out_rows)) {
        s_err(err, errlen, "batch without sequences or block tables");
        return -1;
    }
    for (int t = 0; t < b->n; t++) {
        if (b->tok && (b->tok[t] < 0 || b->tok[t] >= m->cfg.n_vocab)) {
            s_err(err, errlen, "token %d at index %d is outside the vocabulary of %d", b->tok[t],
                  t, m->cfg.n_vocab);
            return -1;
        }
        if (b->seq[t] < 0 || b->seq[t] >= b->n_seqs) {
            s_err(err, errlen, "token %d names sequence %d of %d", t, b->seq[t], b->n_seqs);
            return -1;
        }
        if (b->pos[t] < 0 || b->pos[t] / FI_KV_BLOCK >= b->max_blocks) {
            s_err(err, errlen, "token %d: position %d is outside its table of %d blocks", t,
                  b->pos[t], b->max_blocks);
            return -1;
        }
        /* every block the token's attention reads must be in the pool */
        const int32_t *tbl = b->tables + (size_t)b->seq[t] * b->max_blocks;
        for (int i = 0; i <= b->pos[t] / FI_KV_BLOCK; i++) {
            if (tbl[i] < 0 || tbl[i] >= kv->n_blocks) {
                s_err(err, errlen, "sequence %d: block %d of its table is %d; the pool has %d",
                      b->seq[t], i, tbl[i], kv->n_blocks);
                return -1;
            }
        }
    }
    for (int i = 0; i < b->n_out; i++) {
        if (b->out_rows[i] < 0 || b->out_rows[i] >= b->n ||
            (i && b->out_rows[i] <= b->out_rows[i - 1])) {
            s_err(err, errlen, "logit row %d (token %d) is not an ascending token index < %d", i,
                  b->out_rows[i], b->n);
            return -1;
        }
    }
    return 0;
}

/* Checks a batch against the model's plan and the pool before any work. */
static int s_check_batch(const fi_model *m, const fi_kvpool *kv, const fi_batch *b,
                         const float *x_in, char *err, size_t errlen) {
    if (b->n_out && !m->output_norm) {
        s_err(err, errlen, "this shard's plan has no output layer, yet logits were asked for");
        return -1;
    }
    if (m->plan.no_embed ? !x_in : !b->tok) {
        s_err(err, errlen, "batch lacks its %s", m->plan.no_embed ? "input activations" : "tokens");
        return -1;
    }
    return fi_batch_check(m, kv, b, err, errlen);
}

/* The layers of the plan over the batch already in kv->x (positions,
 * sequences, slots and tables on the backend). */
/* y[i] = W[i] x for i < count: in one call where the backend has matmul_n
 * (the input quantised once, one dispatch), else one matmul each. */
static void s_products(const fi_backend_ops *ops, void *bc, int count, float *const *y,
                       const fi_weight *const *w, const float *x, int n) {
    if (ops->matmul_n) {
        ops->matmul_n(bc, count, y, w, x, n);
        return;
    }
    for (int i = 0; i < count; i++)
        ops->matmul(bc, y[i], w[i], x, n);
}

/* A residual connection: x += W in, through y. The products summed over
 * the ranks of a tensor-parallel group first (allreduce), else in one call
 * where the backend has matmul_add. */
static int s_residual(fi_model *m, float *x, float *y, const fi_weight *w, const float *in, int n,
                      char *err, size_t errlen) {
    const fi_backend_ops *ops = m->be->ops;
    void *bc = m->be->ctx;
    if (!m->allreduce && ops->matmul_add) {
        ops->matmul_add(bc, x, y, w, in, n);
        return 0;
    }
    ops->matmul(bc, y, w, in, n);
    if (m->allreduce && m->allreduce(m->allreduce_user, y, (size_t)n * m->cfg.dim, err, errlen))
        return -1;
    ops->add(bc, x, y, (size_t)n * m->cfg.dim);
    return 0;
}

static int s_layers(fi_model *m, fi_kvpool *kv, const fi_kv_map *map, int n, char *err,
                    size_t errlen) {
    const fi_config *c = &m->cfg;
    const fi_backend_ops *ops = m->be->ops;
    void *bc = m->be->ctx;
    int dim = c->dim, kv_dim = m->kv_dim_l;
    size_t layer_bytes = (size_t)kv->n_blocks * FI_KV_BLOCK * kv->kv_row;
    for (int l = 0; l < m->n_local_layers; l++) {
        const layer *L = &m->layers[l];
        /* attention (the backend's fused forms where it has them) */
        float *const qkv[3] = {kv->q, kv->k, kv->v};
        const fi_weight *const wqkv[3] = {&L->wq, &L->wk, &L->wv};
        if (ops->norm_matmul_n) {
            ops->norm_matmul_n(bc, 3, qkv, wqkv, kv->xb, kv->x, L->attn_norm, c->norm_eps, n);
        } else {
            ops->rmsnorm(bc, kv->xb, kv->x, L->attn_norm, n, dim, c->norm_eps);
            s_products(ops, bc, 3, qkv, wqkv, kv->xb, n);
        }
        uint8_t *kc = kv->kcache + (size_t)l * layer_bytes;
        uint8_t *vc = kv->vcache + (size_t)l * layer_bytes;
        if (ops->rope_store) {
            ops->rope_store(bc, kv->q, kv->k, kv->v, kc, vc, n, m->n_heads_l, m->n_kv_l,
                            c->head_dim, kv->pos, c->rope_theta, kv->slot);
        } else {
            ops->rope(bc, kv->q, n, m->n_heads_l, c->head_dim, kv->pos, c->rope_theta);
            ops->rope(bc, kv->k, n, m->n_kv_l, c->head_dim, kv->pos, c->rope_theta);
            ops->kv_store(bc, kc, kv->k, n, kv->slot, kv_dim, c->head_dim);
            ops->kv_store(bc, vc, kv->v, n, kv->slot, kv_dim, c->head_dim);
        }
        ops->attention(bc, kv->xb, kv->q, kc, vc, n, kv->pos, map, m->n_heads_l, m->n_kv_l,
                       c->head_dim);
        /* q is free again: reuse it */
        if (s_residual(m, kv->x, kv->q, &L->wo, kv->xb, n, err, errlen) != 0) return -1;
        /* feed-forward (SwiGLU) */
        if (ops->norm_matmul_swiglu) {
            ops->norm_matmul_swiglu(bc, kv->hb, kv->hb2, &L->w_gate, &L->w_up, kv->xb, kv->x,
                                    L->ffn_norm, c->norm_eps, n);
        } else {
            ops->rmsnorm(bc, kv->xb, kv->x, L->ffn_norm, n, dim, c->norm_eps);
            float *const gu[2] = {kv->hb, kv->hb2};
            const fi_weight *const wgu[2] = {&L->w_gate, &L->w_up};
            s_products(ops, bc, 2, gu, wgu, kv->xb, n);
            ops->swiglu(bc, kv->hb, kv->hb2, (size_t)n * m->ffn_l);
        }
        if (s_residual(m, kv->x, kv->xb, &L->w_down, kv->hb, n, err, errlen) != 0) return -1;
    }
    return 0;
}

/* fi_model_forward; with `next` (n_out 1, logits NULL) the argmax of the
 * row computed by the backend instead of the logits. */
static int s_forward(fi_model *m, fi_kvpool *kv, const fi_batch *b, const float *x_in,
                     float *x_out, float *logits, int32_t *next, char *err, size_t errlen) {
    const fi_config *c = &m->cfg;
    const fi_backend_ops *ops = m->be->ops;
    void *bc = m->be->ctx;
    if (kv->m != m) {
        s_err(err, errlen, "KV pool belongs to another model");
        return -1;
    }
    if (kv->kv_bits != fi_backend_kv_bits(m->be)) {
        s_err(err, errlen, "KV pool's rows are %d-bit, not in the backend's cache format (%d-bit): "
              "made before the format changed", kv->kv_bits, fi_backend_kv_bits(m->be));
        return -1;
    }
    if (s_unbound(m, err, errlen)) return -1;
    if (s_check_batch(m, kv, b, x_in, err, errlen) != 0) return -1;
    int n = b->n;
    for (int t = 0; t < n; t++) {
        const int32_t *tbl = b->tables + (size_t)b->seq[t] * b->max_blocks;
        kv->slot_host[t] = tbl[b->pos[t] / FI_KV_BLOCK] * FI_KV_BLOCK + b->pos[t] % FI_KV_BLOCK;
    }
    size_t tables = (size_t)b->n_seqs * (size_t)b->max_blocks;
    if (tables > kv->tables_cap) { /* grows rarely; never inside a graph */
        if (kv->tables) ops->free(bc, kv->tables);
        size_t cap = tables < 1024 ? 1024 : tables * 2;
        kv->tables = ops->alloc(bc, cap * sizeof(int32_t));
        kv->tables_cap = kv->tables ? cap : 0;
        if (!kv->tables) {
            s_err(err, errlen, "out of memory for block tables of %d sequences", b->n_seqs);
            return -1;
        }
    }
    fi_kv_map map = {.seq = kv->seq, .tables = kv->tables, .max_blocks = b->max_blocks,
                     .block_size = FI_KV_BLOCK};
    /* A decode step (every token's logits wanted: one token of each of n
     * sequences) goes to the backend as one recorded graph, one per batch
     * size, where the backend can. */
    size_t ib = (size_t)n * sizeof(int32_t);
    /* output rows 0..n_out-1 in order (decode): one rmsnorm for them all,
     * and a step that a signature describes */
    int rows_in_order = 1;
    for (int i = 0; i < b->n_out && rows_in_order; i++)
        rows_in_order = b->out_rows[i] == i;
    float *lg = logits && ops->host_memory ? logits : kv->logits;
    int graph = 0;
    if (n == b->n_out && !m->allreduce && !m->plan.no_embed && ops->graph_begin) {
        size_t upload = 4 * ib + tables * sizeof(int32_t);
        if (ops->graph_begin_sig && rows_in_order) {
            /* every argument of the step's calls follows from these; see
             * graph_begin_sig in fi_kernels.h */
            struct {
                const void *m, *tables, *lg, *argmax;
                uint64_t pool; /* a pool made where a freed one was is another */
                int n, n_seqs, max_blocks;
            } sig;
            memset(&sig, 0, sizeof sig); /* no stray padding bytes */
            sig.m = m;
            sig.pool = kv->serial;
            sig.argmax = b->argmax;
            sig.tables = kv->tables;
            sig.lg = lg;
            sig.n = n;
            sig.n_seqs = b->n_seqs;
            sig.max_blocks = b->max_blocks;
            graph = ops->graph_begin_sig(bc, n, upload, &sig, sizeof sig) == 0;
        } else {
            graph = ops->graph_begin(bc, n, upload) == 0;
        }
    }
    if ((!m->plan.no_embed && ops->to_backend(bc, kv->toks, b->tok, ib)) ||
        ops->to_backend(bc, kv->pos, b->pos, ib) || ops->to_backend(bc, kv->seq, b->seq, ib) ||
        ops->to_backend(bc, kv->slot, kv->slot_host, ib) ||
        ops->to_backend(bc, kv->tables, b->tables, tables * sizeof(int32_t)) ||
        (m->plan.no_embed &&
         ops->to_backend(bc, kv->x, x_in, (size_t)n * c->dim * sizeof(float)))) {
        if (graph) (void)ops->graph_end(bc); /* a recording always ends */
        goto backend_fail;
    }
    if (!m->plan.no_embed) ops->get_rows(bc, kv->x, &m->tok_embd, kv->toks, n);
    if (s_layers(m, kv, &map, n, err, errlen) != 0) {
        if (graph) (void)ops->graph_end(bc);
        return -1;
    }
    /* lg: the logits straight into the caller's buffer where backend memory
     * is the host's (n_out x n_vocab floats: 3 MiB for 16 sequences); each
     * row's argmax found with the rows where the backend can (else
     * b->argmax is left as it is: the caller looks where it needs one) */
    if (b->n_out) {
        if (rows_in_order)
            ops->rmsnorm(bc, kv->xb, kv->x, m->output_norm, b->n_out, c->dim, c->norm_eps);
        else
            for (int i = 0; i < b->n_out; i++)
                ops->rmsnorm(bc, kv->xb + (size_t)i * c->dim,
                             kv->x + (size_t)b->out_rows[i] * c->dim, m->output_norm, 1, c->dim,
                             c->norm_eps);
        if (b->argmax && logits && ops->matmul_argmax && ops->host_memory)
            ops->matmul_argmax(bc, lg, b->argmax, &m->output, kv->xb, b->n_out);
        else
            ops->matmul(bc, lg, &m->output, kv->xb, b->n_out);
    }
    if (graph && ops->graph_end(bc)) goto backend_fail;
    size_t V = (size_t)c->n_vocab;
    if (b->n_out && logits && lg != logits &&
        ops->to_host(bc, logits, kv->logits, (size_t)b->n_out * V * sizeof(float)))
        goto backend_fail;
    if (next && ops->argmax(bc, next, kv->logits, (int)V)) goto backend_fail;
    if (x_out && ops->to_host(bc, x_out, kv->x, (size_t)n * c->dim * sizeof(float)))
        goto backend_fail;
    if (ops->sync(bc) != 0) goto backend_fail;
    return 0;
backend_fail:
    s_err(err, errlen, "backend '%s' failed during the forward pass: %s", ops->name,
          s_backend_error(m->be));
    return -1;
}

int fi_model_forward(fi_model *m, fi_kvpool *kv, const fi_batch *b, const float *x_in,
                     float *x_out, float *logits, char *err, size_t errlen) {
    return s_forward(m, kv, b, x_in, x_out, logits, NULL, err, errlen);
}

/* --- sessions: one sequence in a private pool --------------------------- */

fi_session *fi_session_new(fi_model *m, int n_ctx, char *err, size_t errlen) {
    const fi_config *c = &m->cfg;
    if (n_ctx <= 0) n_ctx = c->ctx_train < 4096 ? c->ctx_train : 4096;
    if (n_ctx > c->ctx_train) {
        s_err(err, errlen, "context of %d tokens exceeds the model's trained context of %d",
              n_ctx, c->ctx_train);
        return NULL;
    }
    if (s_unbound(m, err, errlen)) return NULL;
    if (m->plan.no_embed || m->plan.no_output) {
        s_err(err, errlen, "a session needs the whole pipeline; this shard's plan is one stage");
        return NULL;
    }
    fi_session *s = calloc(1, sizeof *s);
    if (!s) {
        s_err(err, errlen, "out of memory");
        return NULL;
    }
    s->m = m;
    s->n_ctx = n_ctx;
    int nb = (n_ctx + FI_KV_BLOCK - 1) / FI_KV_BLOCK;
    s->table = malloc((size_t)nb * sizeof *s->table);
    s->pos_host = malloc(FI_MAX_BATCH * sizeof(int32_t));
    s->seq_host = calloc(FI_MAX_BATCH, sizeof(int32_t));
    s->rows_host = malloc(FI_MAX_BATCH * sizeof(int32_t));
    if (!s->table || !s->pos_host || !s->seq_host || !s->rows_host) {
        s_err(err, errlen, "out of memory");
        fi_session_destroy(&s);
        return NULL;
    }
    for (int i = 0; i < nb; i++) s->table[i] = i;
    char why[256];
    s->kv = fi_kvpool_new(m, nb, FI_MAX_BATCH, FI_LOGIT_ROWS, why, sizeof why);
    if (!s->kv) {
        s_err(err, errlen, "session of %d tokens: %s", n_ctx, why);
        fi_session_destroy(&s);
        return NULL;
    }
    return s;
}

void fi_session_destroy(fi_session **sp) {
    if (!sp || !*sp) return;
    fi_session *s = *sp;
    fi_kvpool_destroy(&s->kv);
    free(s->table);
    free(s->pos_host);
    free(s->seq_host);
    free(s->rows_host);
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

/* fi_session_eval, and with `next` (then logits and all_logits are NULL)
 * the argmax of the last token's logits computed by the backend. */
static int s_eval(fi_session *s, const int32_t *toks, int n, float *logits, float *all_logits,
                  int32_t *next, char *err, size_t errlen) {
    fi_model *m = s->m;
    const fi_config *c = &m->cfg;
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
    /* all logits: chunks of FI_LOGIT_ROWS tokens, every row out */
    int chunk = all_logits ? FI_LOGIT_ROWS : FI_MAX_BATCH;
    for (int done = 0; done < n;) {
        int b = n - done < chunk ? n - done : chunk;
        int last = done + b == n;
        for (int t = 0; t < b; t++) {
            s->pos_host[t] = s->pos + t;
            s->rows_host[t] = t;
        }
        fi_batch bt = {.n = b, .tok = toks + done, .pos = s->pos_host, .seq = s->seq_host,
                       .n_seqs = 1, .tables = s->table,
                       .max_blocks = (s->n_ctx + FI_KV_BLOCK - 1) / FI_KV_BLOCK,
                       .out_rows = s->rows_host, .n_out = 0};
        float *dst = NULL;
        if (all_logits) {
            bt.n_out = b;
            dst = all_logits + (size_t)done * V;
        } else if (last && (logits || next)) {
            s->rows_host[0] = b - 1;
            bt.n_out = 1;
            dst = logits;
        }
        if (s_forward(m, s->kv, &bt, NULL, NULL, dst, last && !all_logits ? next : NULL, err,
                      errlen) != 0)
            return -1;
        s->pos += b;
        done += b;
    }
    if (all_logits && logits) memcpy(logits, all_logits + (size_t)(n - 1) * V, V * sizeof(float));
    return 0;
}

int fi_session_eval(fi_session *s, const int32_t *toks, int n, float *logits, float *all_logits,
                    char *err, size_t errlen) {
    return s_eval(s, toks, n, logits, all_logits, NULL, err, errlen);
}

int fi_session_eval_greedy(fi_session *s, const int32_t *toks, int n, int32_t *next, char *err,
                           size_t errlen) {
    const fi_backend_ops *ops = s->m->be->ops;
    if (ops->argmax) return s_eval(s, toks, n, NULL, NULL, next, err, errlen);
    int V = s->m->cfg.n_vocab;
    float *logits = malloc((size_t)V * sizeof *logits);
    if (!logits) {
        s_err(err, errlen, "out of memory for %d logits", V);
        return -1;
    }
    int rc = s_eval(s, toks, n, logits, NULL, NULL, err, errlen);
    if (rc == 0) *next = fi_argmax(logits, V);
    free(logits);
    return rc;
}
