/*
 * fi_kernels.h - compute backends for the fedinfer engine.
 *
 * The engine (core/) writes the forward pass once, against the table of
 * operations below; each backend fills the table. The CPU backend is the
 * reference and is always built; a CUDA backend fills the same table with
 * device memory (see kernels/cuda/ when FEDINFER_CUDA is on).
 *
 * Memory: every float pointer handed to an operation is backend memory
 * obtained from ops->alloc (host memory for the CPU backend, device memory
 * for CUDA). Weights are described by fi_weight; a backend may copy them to
 * its own memory in ops->weight_upload, otherwise it reads `data` in place
 * (the CPU backend reads the mmapped GGUF directly: no dequantising at load).
 *
 * Layout conventions (row-major, as in GGUF):
 *   weight W: `rows` rows of `cols` elements, each row row_bytes long;
 *             GGUF's ne[0] is cols, ne[1] is rows.
 *   activations x: n tokens, each `dim` floats contiguous: x[t*dim + i].
 */
#ifndef FI_KERNELS_H
#define FI_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define FI_MUST_CHECK __attribute__((warn_unused_result))
#else
#define FI_MUST_CHECK
#endif

/* Element types, numbered as GGUF (ggml_type) numbers them. */
typedef enum fi_dtype {
    FI_DTYPE_F32 = 0,
    FI_DTYPE_F16 = 1,
    FI_DTYPE_Q4_0 = 2,
    FI_DTYPE_Q4_1 = 3,
    FI_DTYPE_Q8_0 = 8,
    FI_DTYPE_BF16 = 30,
} fi_dtype;

/* 1 when `id` is a type the kernels can compute with, else 0. */
int fi_dtype_supported(uint32_t id);
/* Short name ("q4_1"), or "unknown" for an unsupported id. */
const char *fi_dtype_name(uint32_t id);
/* Elements per block (1 for float types, 32 for the quantised ones);
 * 0 for an unsupported id. */
int fi_dtype_block_elems(uint32_t id);
/* Bytes per block; 0 for an unsupported id. */
size_t fi_dtype_block_bytes(uint32_t id);
/* Bytes of one row of n elements, or 0 when n is not a multiple of the
 * block size or the type is unsupported. */
size_t fi_dtype_row_bytes(uint32_t id, int64_t n);

/* A weight matrix. `data` points to rows*row_bytes bytes the caller keeps
 * alive (usually the mmapped model file). `dev` belongs to the backend. */
typedef struct fi_weight {
    const void *data;   /* host bytes, rows * row_bytes */
    fi_dtype type;      /* element type of the rows */
    int rows;           /* output features */
    int cols;           /* input features (elements per row) */
    size_t row_bytes;   /* fi_dtype_row_bytes(type, cols) */
    void *dev;          /* backend copy, or NULL when read in place */
} fi_weight;

/* Which CPU code path to use. AUTO picks the best the processor supports at
 * run time; PORTABLE is plain C and gives the same results within
 * floating-point tolerance. */
typedef enum fi_simd {
    FI_SIMD_AUTO = 0,
    FI_SIMD_PORTABLE = 1,
    FI_SIMD_AVX2 = 2,
} fi_simd;

typedef struct fi_backend fi_backend;

/* Where each query token's keys and values are in a paged KV cache (see
 * ops->attention). seq and tables are backend memory. */
typedef struct fi_kv_map {
    const int32_t *seq;    /* n: the sequence (row of tables) of each token */
    const int32_t *tables; /* block ids, max_blocks per sequence */
    int max_blocks;        /* entries per sequence in tables */
    int block_size;        /* rows per block (> 0) */
} fi_kv_map;

/*
 * The operation table. All operations on one backend run in call order
 * (a backend may queue them; ops->sync waits for completion). Sizes are
 * trusted: the engine checks every shape against the model at load time.
 */
typedef struct fi_backend_ops {
    const char *name;                                   /* "cpu", "cuda" */
    void (*destroy)(void *ctx);

    /* Memory. alloc returns zeroed backend memory or NULL. */
    void *(*alloc)(void *ctx, size_t bytes);
    void (*free)(void *ctx, void *p);
    /* Copies between host and backend memory (and within the backend). */
    int (*to_backend)(void *ctx, void *dst, const void *host_src, size_t bytes);
    int (*to_host)(void *ctx, void *host_dst, const void *src, size_t bytes);
    int (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
    /* Optional (may be NULL): make w usable by this backend (sets w->dev). */
    int (*weight_upload)(void *ctx, fi_weight *w);
    void (*weight_release)(void *ctx, fi_weight *w);
    /* Wait for queued work; returns 0, or -1 with the backend's error. */
    int (*sync)(void *ctx);

    /* y[t][r] = sum_c W[r][c] * x[t][c]   for t < n, r < w->rows.
     * Quantised weights are read block by block; the backend may quantise
     * x (for example to 8 bits per 32-element block) to use integer dots. */
    void (*matmul)(void *ctx, float *y, const fi_weight *w, const float *x, int n);
    /* y[t][:] = row tok[t] of W, dequantised (embedding lookup). */
    void (*get_rows)(void *ctx, float *y, const fi_weight *w, const int32_t *tok, int n);
    /* y[t][i] = x[t][i] / sqrt(mean(x[t]^2) + eps) * g[i]; y may alias x. */
    void (*rmsnorm)(void *ctx, float *y, const float *x, const float *g, int n, int dim, float eps);
    /* Rotary embedding, in place, on n tokens of n_heads heads each
     * head_dim wide (rows of n_heads*head_dim floats). Pairs are adjacent
     * elements (2i, 2i+1), as GGUF llama stores Q and K; token t is at
     * position pos[t]; angle = pos * theta^(-2i/head_dim). */
    void (*rope)(void *ctx, float *x, int n, int n_heads, int head_dim, const int32_t *pos,
                 float theta);
    /* Causal grouped-query attention of n query tokens, which may belong
     * to different sequences, against a paged cache written by kv_store,
     * in the backend's cache-row format (FI_KV_ROW_F16: fp16, IEEE half
     * precision, as store_f16 writes them; the CPU backend also has
     * FI_KV_ROW_Q8, fi_cpu_backend_set_kv_bits).
     * q:   n rows of n_heads*head_dim.
     * k,v: the cache of one layer: rows of kv_dim = n_kv_heads*head_dim
     *      values (fi_backend_kv_row_bytes each), in blocks of
     *      map->block_size rows. Query token t belongs
     *      to sequence s = map->seq[t] and sees its positions 0..pos[t];
     *      position p of sequence s is row
     *        map->tables[s*map->max_blocks + p/block_size]*block_size
     *          + p%block_size.
     *      (A contiguous cache is the map with one sequence whose table is
     *      0, 1, 2, ...)
     * out: n rows of n_heads*head_dim. Query head h uses KV head
     *      h / (n_heads / n_kv_heads). Scale 1/sqrt(head_dim). */
    void (*attention)(void *ctx, float *out, const float *q, const void *k,
                      const void *v, int n, const int32_t *pos, const fi_kv_map *map,
                      int n_heads, int n_kv_heads, int head_dim);
    /* dst[i] = fp16(src[i]) for i < n, round to nearest even. */
    void (*store_f16)(void *ctx, uint16_t *dst, const float *src, size_t n);
    /* g[i] = silu(g[i]) * u[i] for i < n (SwiGLU). */
    void (*swiglu)(void *ctx, float *g, const float *u, size_t n);
    /* y[i] += x[i] for i < n (residual). */
    void (*add)(void *ctx, float *y, const float *x, size_t n);

    /* --- optional members: NULL where a backend has none (the CPU backend
     * has none). Callers test for NULL. New members go at the end. --- */
    /* The backend's first failure as text, with the runtime's own message
     * ("cuda: cublasLtMatmul (576x1x576): CUBLAS_STATUS_..."), or NULL when
     * nothing failed. Backends whose operations cannot fail leave it NULL. */
    const char *(*last_error)(void *ctx);
    /* *out = the index of the largest of x[0..n) (backend memory; the first
     * such index on ties), computed by the backend so that only one integer
     * comes back to the host (greedy decoding). Waits for queued work.
     * Returns 0, or -1 with the backend's error. */
    int (*argmax)(void *ctx, int32_t *out, const float *x, int n);
    /* Record the work of the calls that follow, up to graph_end, and run it
     * as one launch (a CUDA graph): for decode steps, whose hundreds of
     * small kernels would otherwise cost a launch each. In between, only
     * operations and to_backend (a few KiB in all: token ids, positions)
     * may be called; not to_host, sync, argmax, alloc, free or weight
     * calls. key names the shape of the work (the engine passes the
     * number of tokens of the step): the backend keeps one graph per key
     * and updates it in place for the next step of that key; upload is the
     * bytes the caller will pass to to_backend in between. graph_begin
     * returns 0, or -1 when the backend will not record now (graphs turned
     * off, profiling, a key out of its range, more upload than it stages,
     * or the first step of a key, which runs directly so that the buffers
     * that work needs exist before a capture, which may not allocate): the
     * caller then simply goes on without. After a 0 from graph_begin,
     * graph_end must follow, on error paths too; it launches the recorded
     * work and returns 0, or -1 with the backend's error. */
    int (*graph_begin)(void *ctx, int key, size_t upload);
    int (*graph_end)(void *ctx);

    /* --- required again (placed last to keep the table's order) --- */
    /* Writes n rows of `row` floats (heads of head_dim values) into a
     * paged cache in the backend's cache-row format: row t of src goes to
     * cache row slot[t] (slot: backend memory; rows are
     * fi_backend_kv_row_bytes apart). fp16 rows round to nearest even, as
     * store_f16. */
    void (*kv_store)(void *ctx, void *cache, const float *src, int n, const int32_t *slot,
                     int row, int head_dim);

    /* --- optional again (NULL: the caller does without) --- */
    /* Several products of one input, y[i] = W[i] x for i < count (1 to
     * FI_MATMUL_N_MAX), each the same bits as matmul(ctx, y[i], w[i], x,
     * n) would give; all w[i] have the same cols. Lets a backend prepare x
     * once (quantise it) and share one dispatch among all the rows: Q, K
     * and V, or the gate and up projections. */
    void (*matmul_n)(void *ctx, int count, float *const *y, const fi_weight *const *w,
                     const float *x, int n);
    /* 1 where backend memory is host memory (the CPU backend): operations
     * may then write straight into the caller's buffers, such as the
     * logits, instead of a copy through to_host. */
    int host_memory;
    /* Optional (NULL: matmul, then add): acc += W x, through y (n x
     * w->rows floats, left holding W x), the same bits as matmul(ctx, y, w,
     * x, n) then add(ctx, acc, y, n * w->rows); in one dispatch, each
     * thread adding the rows it just computed (the residual connections
     * after the attention output and the down projection). */
    void (*matmul_add)(void *ctx, float *acc, float *y, const fi_weight *w, const float *x, int n);
    /* Optional (NULL: matmul, then fi_argmax_f32 of each row): matmul, and
     * idx[t] = fi_argmax_f32(y + t * w->rows, w->rows) for t < n (idx:
     * host memory), found by the threads that make the rows while they are
     * in their caches (greedy decoding: no second pass over the logits). */
    void (*matmul_argmax)(void *ctx, float *y, int32_t *idx, const fi_weight *w, const float *x, int n);
    /* Optional (NULL: graph_begin): graph_begin with sig, sig_len bytes
     * (at most FI_GRAPH_SIG_MAX) that determine every argument of the calls
     * up to graph_end, apart from the bytes their to_backend calls pass:
     * two steps of one key with equal sig make the same calls, in the same
     * order, with the same pointers and sizes (the engine puts in its
     * buffers and the batch's shape). When the key's last recorded step had
     * an equal sig and nothing has moved since (the backend's own buffers;
     * and any alloc or free ends every recording, since a buffer can come
     * back where a freed one was), the backend relaunches that recording
     * instead of recording again: the
     * operations in between are then only checked against the recording
     * (a call that differs fails the backend, naming the call), and each
     * to_backend refreshes the bytes the recording copies. */
    int (*graph_begin_sig)(void *ctx, int key, size_t upload, const void *sig, size_t sig_len);

    /* Optional fused operations, for backends that pay per launch (GPUs).
     * Each gives the same bits as the calls it replaces, which the engine
     * makes instead where the member is NULL. */
    /* rmsnorm(ctx, xn, x, g, n, w[0]->cols, eps), then matmul_n(ctx, count,
     * y, w, xn, n). xn (n x cols, backend memory) may or may not be
     * written. */
    void (*norm_matmul_n)(void *ctx, int count, float *const *y, const fi_weight *const *w,
                          float *xn, const float *x, const float *g, float eps, int n);
    /* rmsnorm(ctx, xn, x, g, n, wg->cols, eps), matmul_n of {h, u} by {wg,
     * wu} on xn, then swiglu(ctx, h, u, n * wg->rows): the feed-forward
     * block's input. xn and u may or may not be written. */
    void (*norm_matmul_swiglu)(void *ctx, float *h, float *u, const fi_weight *wg,
                               const fi_weight *wu, float *xn, const float *x, const float *g,
                               float eps, int n);
    /* rope(ctx, q, n, n_heads, head_dim, pos, theta), rope(ctx, k, n,
     * n_kv_heads, ...), kv_store(ctx, kc, k, n, slot, n_kv_heads *
     * head_dim, head_dim), kv_store(ctx, vc, v, ...). */
    void (*rope_store)(void *ctx, float *q, float *k, const float *v, void *kc, void *vc,
                       int n, int n_heads, int n_kv_heads, int head_dim, const int32_t *pos,
                       float theta, const int32_t *slot);
} fi_backend_ops;

#define FI_GRAPH_SIG_MAX 256 /* most bytes of a graph_begin_sig signature */

#define FI_MATMUL_N_MAX 4 /* most products in one matmul_n call */

struct fi_backend {
    const fi_backend_ops *ops;
    void *ctx;
};

/* CPU backend with n_threads threads in a persistent pool (n_threads <= 0:
 * one per online core). Returns NULL with a message in err on failure.
 * Owned by the caller: release with fi_backend_destroy. */
fi_backend *fi_cpu_backend_new(int n_threads, fi_simd simd, char *err, size_t errlen);

/* Which SIMD path the CPU backend chose ("avx2", "portable"); NULL when b is
 * not a CPU backend. */
const char *fi_cpu_backend_simd(const fi_backend *b);
/* Precision of the activations in products with quantised weights. 16
 * (the default without an AMX tile unit): 16-bit quants with one scale
 * per token; logits within 0.08 of an exact computation on the default
 * model. 12 (the default where the AMX tile unit serves the products,
 * fi_cpu_backend_tiles): 16-bit quants with one scale per 32-element
 * block, within 2039 for Q4 weights, so that the tile unit needs one
 * product per block instead of two (batches of 16 tokens ~25% faster
 * there); logits within 0.18. 8: as llama.cpp does; logits move by up to
 * ~1.2 and greedy text can part from the exact one at near ties; with
 * AVX512-VNNI the products of several tokens take about 0.6 times as long
 * as at 12 bits (one vpdpbusd per four elements against one vpdpwssd per
 * two), one token's the same. Every precision is batch-invariant in every
 * flavour. 0, or -1 when bits is not 8, 12 or 16 or b is not a CPU
 * backend. */
FI_MUST_CHECK int fi_cpu_backend_set_act_bits(fi_backend *b, int bits);
int fi_cpu_backend_act_bits(const fi_backend *b);
/* 1 if b's products of batches go to the AMX tile unit (at 12 or 8 bits:
 * the processor has one, the OS grants it and the build has its kernels),
 * else 0. */
int fi_cpu_backend_tiles(const fi_backend *b);

/* Cache-row formats of the KV cache (ops->kv_store, ops->attention), for
 * a row of n_kv_heads heads of head_dim values:
 *   FI_KV_ROW_F16: the values as fp16, 2 * n_kv_heads * head_dim bytes;
 *   FI_KV_ROW_Q8:  each head's values as int8 q with one float scale s
 *                  per head (value = q * s, s = max |value| / 127, q
 *                  rounded to nearest even): the quants of every head
 *                  (n_kv_heads * head_dim bytes, then up to 3 bytes to a
 *                  multiple of 4), then the n_kv_heads scales: 0.53 times
 *                  the fp16 bytes for the default model (204 against 384). */
typedef enum fi_kv_row { FI_KV_ROW_F16 = 16, FI_KV_ROW_Q8 = 8 } fi_kv_row;
/* The CPU backend's KV cache precision: 16 (the default, FI_KV_ROW_F16)
 * or 8 (FI_KV_ROW_Q8: half the memory, so twice the tokens in a budget,
 * and attention that reads half the bytes; each cached value moves by at
 * most half a step, max |head| / 254). Set it before any KV cache is made:
 * caches made earlier keep the format they were made in, which this
 * backend then misreads. 0, or -1 when bits is not 8 or 16 or b is not a
 * CPU backend. */
FI_MUST_CHECK int fi_cpu_backend_set_kv_bits(fi_backend *b, int bits);
/* 16 or 8 for a CPU backend, else 16 (every other backend keeps fp16). */
int fi_backend_kv_bits(const fi_backend *b);
/* Bytes of one cache row of n_kv_heads heads of head_dim values in b's
 * format. */
size_t fi_backend_kv_row_bytes(const fi_backend *b, int n_kv_heads, int head_dim);
/* fi_backend_kv_row_bytes for a format. */
size_t fi_kv_row_bytes(fi_kv_row fmt, int n_kv_heads, int head_dim);
/* The backend in a few words, for logs, into buf (len bytes): "cpu
 * avx512vnni, 12-bit activations" for the CPU backend (", 8-bit KV
 * cache" added when it has one), else its name
 * ("cuda"). Returns buf. */
const char *fi_backend_describe(const fi_backend *b, char *buf, size_t len);
/* Threads in the CPU backend's pool; 0 when b is not a CPU backend. */
int fi_cpu_backend_threads(const fi_backend *b);

/* The CUDA backend on device `device`, loaded on demand from its module
 * (kernels/cuda/, libfi_cuda.so) so that CPU-only processes never map the
 * CUDA libraries. NULL with the reason in err: no CUDA in this build, no
 * driver, the module cannot be loaded, or CUDA's own message (no device).
 * fi_cuda_available() tells whether this build has the module at all. */
fi_backend *fi_cuda_backend_open(int device, char *err, size_t errlen);
int fi_cuda_available(void);

/* Frees the backend and sets *b to NULL; safe on NULL or *b == NULL. */
void fi_backend_destroy(fi_backend **b);

/* --- thread pool (used by the CPU backend; usable on its own) ---------- */
typedef struct fi_pool fi_pool;
typedef void (*fi_pool_fn)(void *arg, int ith, int nth);

/* A pool of n_threads workers (the caller's thread counts as worker 0).
 * Threads are created once and wait between jobs. NULL on failure. */
fi_pool *fi_pool_new(int n_threads);
void fi_pool_destroy(fi_pool **p);
int fi_pool_threads(const fi_pool *p);
/* Runs fn(arg, ith, nth) for every ith in [0, nth), each once, and returns
 * when all have finished: index 0 always on the caller, the others
 * normally one per worker (a late worker's index is run by whoever comes
 * first). Not reentrant: one job at a time per pool. */
void fi_pool_run(fi_pool *p, fi_pool_fn fn, void *arg);

/* --- reference helpers (portable C, used by tests and by other backends) */
/* Dequantises n elements (a multiple of the block size) of type t. */
void fi_dequantize_row(fi_dtype t, const void *src, float *dst, int64_t n);
/* The index of the largest of x[0..n): the first on ties (-0 equals 0),
 * NaNs never win, 0 when all are NaN. */
int32_t fi_argmax_f32(const float *x, int n);
/* fp16 / bf16 conversions. */
float fi_fp16_to_fp32(uint16_t h);
uint16_t fi_fp32_to_fp16(float f);
float fi_bf16_to_fp32(uint16_t h);
uint16_t fi_fp32_to_bf16(float f);

#ifdef __cplusplus
}
#endif
#endif /* FI_KERNELS_H */
