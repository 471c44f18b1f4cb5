/*
 * fi_cuda.cu - the CUDA backend (see fi_cuda.h): device memory, the kernels
 * of the forward pass, cuBLASLt products, and the fi_backend_ops table.
 *
 * Everything runs on one non-blocking stream per backend, so operations run
 * in call order and the host only waits in to_host, argmax and sync.
 *
 * Products of up to 8 tokens: k_matvec, a warp per output row reading
 * fp16 (or GGUF block) rows against fp32 x; it also serves matmul_n,
 * matmul_add and the fused norm_matmul_n and norm_matmul_swiglu (see the
 * kernel). Larger products: y (n x rows, row-major) = x (n x cols) . W^T.
 * Row-major W is column-major W^T with leading dimension cols, so cuBLASLt
 * computes, in column-major terms, D (rows x n) = op_T(A: cols x rows) .
 * B (cols x n): m = rows, n = tokens, k = cols. A and B are fp16 (x is
 * converted on the device into a scratch buffer first), D is fp32,
 * accumulation is fp32. The algorithm for each (m, n, k, alignment of D)
 * is chosen once by cublasLtMatmulAlgoGetHeuristic and kept in a small
 * cache.
 *
 * Attention: k_attention_g (head_dim 32/64/128, up to 8 query heads per KV
 * head: one block per token and KV head, see the kernel), else
 * k_attention: one block of S_ATT_WARPS warps per (token, head, split), a
 * warp scoring one cached position at a time with an online softmax, the
 * splits merged by k_attention_merge. Each query's length (pos[t] + 1) is
 * read on the device, so the host never needs the positions.
 *
 * Graphs: between graph_begin and graph_end the stream is captured
 * (cudaStreamBeginCapture) instead of run; graph_end turns the capture into
 * a graph and launches it. The engine does this for every decode step,
 * keyed by its batch size; a step's graph differs from the last one of its
 * key only in kernel parameters, so each key's executable graph is updated
 * in place (cudaGraphExecUpdate) rather than instantiated again. With
 * graph_begin_sig, a step whose signature equals that of the key's last
 * recording (and nothing of the backend's own moved since: c->gen) is not
 * captured at all: its calls are hashed and checked against the
 * recording's at graph_end, and the recording is relaunched. The first
 * step of a key runs directly instead, which grows the scratch buffers
 * that batch size needs (a capture may not allocate), and cuBLASLt's
 * choices for its shapes are then cached. While capturing, to_backend
 * copies the host bytes into a pinned staging buffer at once and captures
 * a copy from there (a copy from pageable memory cannot be captured); a
 * relaunch writes the same offsets; the next capture or relaunch waits for
 * the previous launch before it reuses the buffer. Nothing may allocate
 * during a capture, so the scratch buffers a one-token step needs are
 * allocated at creation.
 *
 * Errors: see fi_cuda.h. s_ok / s_lt_ok record the first failure; every
 * operation starts with s_enter, which skips the work once failed.
 */
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fi_cuda.h"

#define S_WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLASLt workspace */
#define S_PLANS 128                          /* cached GEMM plans */
#define S_THREADS 256                        /* element-wise block size */
#define S_ATT_WARPS 4                        /* warps per attention block */
#define S_ATT_CHUNK 64                       /* positions per split chunk */
#define S_ATT_MAX_SPLIT 32                   /* most splits of one query */
#define S_ATT_MAX_HD 256                     /* largest head_dim supported */
#define S_PROF_PAIRS 4096                    /* event pairs kept before a flush */
#define S_QK 32                              /* elements per quantised block */
#define S_STAGE_BYTES ((size_t)64 << 10)     /* pinned staging while capturing */
#define S_GRAPH_KEYS 64                      /* graphs kept: keys (batch sizes) 1..64 */
#define S_STAGE_SLACK (16 * 16)              /* alignment of up to 16 staged copies */
#define S_XH_MIN ((size_t)1 << 18)           /* fp16 activations made at start */
#define S_MV_MAX_N 8 /* most tokens of a k_matvec product (32 was measured: 2.4x slower than cuBLASLt at 32) */
#define S_MV_THREADS 256                     /* k_matvec block: 8 rows */
#define S_AG_THREADS 128                     /* k_attention_g block */
#define S_AG_TILE 128                        /* positions per k_attention_g tile */
#define S_AG_MAX_G 8                         /* most query heads per KV head */
#define S_ROPE_POS 8192                      /* positions in the RoPE angle table */

/* Operations as the profile splits them (fi_cuda_backend_profile_ops). */
enum {
    S_OP_GEMM,      /* matmul through cuBLASLt (with the fp16 conversion) */
    S_OP_MATVEC,    /* matmul through the small-n kernels */
    S_OP_GET_ROWS,
    S_OP_RMSNORM,
    S_OP_ROPE,
    S_OP_ATTENTION, /* with the merge of its splits */
    S_OP_KV_STORE,  /* kv_store and store_f16 */
    S_OP_SWIGLU,
    S_OP_ADD,
    S_OP_ARGMAX,
    S_N_OPS,
    /* below: only as names of calls in a graph's record, never timed */
    S_REC_TO_BACKEND = S_N_OPS,
    S_REC_MATMUL_N,
    S_REC_MATMUL_ADD,
    S_REC_STORE_F16,
    S_REC_NORM_MATMUL_N,
    S_REC_NORM_MATMUL_SWIGLU,
    S_REC_ROPE_STORE,
    S_REC_COPY
};
static const char *const s_op_names[S_N_OPS] = {
    "matmul (cuBLASLt)", "matmul (small n)", "get_rows", "rmsnorm", "rope",
    "attention", "kv_store", "swiglu", "add", "argmax"};

/* One cached cuBLASLt plan. */
typedef struct s_plan {
    int m, n, k;                    /* shape: rows, tokens, cols */
    int align;                      /* alignment of D in bytes (<= 256) */
    cublasLtMatmulDesc_t op;        /* fp32 compute, A transposed */
    cublasLtMatrixLayout_t a, b, d; /* fp16 A and B, fp32 D */
    cublasLtMatmulAlgo_t algo;      /* the heuristic's first choice */
} s_plan;

/* A weight as the device holds it (fi_weight.dev). */
typedef struct s_cweight {
    __half *h;      /* rows * cols fp16, or NULL when kept quantised */
    uint8_t *q;     /* rows * row_bytes GGUF blocks, or NULL */
} s_cweight;

typedef struct s_cuda {
    int device;                  /* CUDA ordinal */
    char name[256];              /* device name */
    int n_sm;                    /* streaming multiprocessors */
    cudaStream_t stream;         /* every operation runs here */
    cublasLtHandle_t lt;         /* cuBLASLt */
    void *workspace;             /* S_WORKSPACE_BYTES for cuBLASLt */
    s_plan plans[S_PLANS];       /* GEMM plan cache */
    int n_plans;                 /* plans in use */
    int next_evict;              /* round-robin victim when full */
    __half *xh;                  /* fp16 copy of a product's activations */
    size_t xh_elems;             /* its capacity */
    __half *wscratch;            /* a dequantised weight (quantised mode) */
    size_t wscratch_elems;       /* its capacity */
    float *att_part;             /* attention partials: (m, l, o[hd]) each */
    size_t att_part_floats;      /* its capacity */
    int32_t *arg_dev;            /* argmax result on the device */
    int32_t *arg_host;           /* and in pinned host memory */
    fi_cuda_weights mode;        /* weight storage */
    int uploaded;                /* weights uploaded so far */
    int failed;                  /* 1 after the first failure */
    char err[512];               /* first failure (or last allocation failure) */
    int profile;                 /* bracket operations with events */
    cudaEvent_t *ev;             /* 2 * S_PROF_PAIRS events when profiling */
    uint8_t *ev_op;              /* S_OP_* of each pair */
    int n_pairs;                 /* pairs recorded since the last flush */
    double kernel_ms;            /* summed event time since last read */
    double op_ms[S_N_OPS];       /* the same, split by operation */
    long op_calls[S_N_OPS];      /* operations timed, by kind */
    int graphs;                  /* graph_begin may capture */
    int capturing;               /* between graph_begin and graph_end */
    cudaGraphExec_t exec[S_GRAPH_KEYS + 1]; /* by key: the last step's executable graph */
    uint8_t key_seen[S_GRAPH_KEYS + 1]; /* a step of this key has run directly */
    int key;                     /* the key being captured */
    cudaEvent_t graph_done;      /* recorded after each graph launch */
    int graph_launched;          /* graph_done has been recorded */
    uint8_t *stage;              /* S_STAGE_BYTES pinned, for to_backend */
    size_t stage_used;           /* bytes of it used by this capture */
    long n_graphs;               /* graphs launched */
    long n_instantiated;         /* of which instantiated (not updated) */
    long n_replays;              /* of which relaunched without recording */
    /* graph_begin_sig: each key's recording, and the calls of this one */
    struct {
        uint8_t sig[FI_GRAPH_SIG_MAX];
        size_t sig_len;           /* 0: no signature (plain graph_begin) */
        uint64_t gen;             /* c->gen at recording */
        uint64_t hash;            /* of the recorded calls and arguments */
        long calls;               /* calls recorded */
    } rec[S_GRAPH_KEYS + 1];
    uint8_t pending_sig[FI_GRAPH_SIG_MAX]; /* the capture's signature */
    size_t pending_sig_len;
    int replaying;               /* between graph_begin_sig and graph_end, relaunching */
    uint64_t hash;               /* running hash of this capture's or replay's calls */
    long calls;                  /* and their number */
    uint64_t gen;                /* bumped when anything a recording points into moves */
    int matvec;                  /* products of up to 8 tokens by k_matvec (else cuBLASLt) */
    int att_g;                   /* k_attention_g where it applies (else k_attention) */
    int replay;                  /* graph_begin_sig may relaunch (else it records) */
    int fused;                   /* the fused operations in one launch (else in several) */
    int mv_pre;                  /* k_matvec: early row loads, and its one-token instance */
    unsigned *att_count;         /* per (token, KV head): k_attention_g blocks done */
    size_t att_count_elems;      /* its capacity */
    float2 *rope_tab;            /* (cos, sin) of position p, pair i at p * half + i */
    size_t rope_elems;           /* its capacity */
    int rope_hd;                 /* head_dim of the table (0: none) */
    float rope_theta;            /* its theta */
} s_cuda;

/* --- errors ------------------------------------------------------------ */

static void s_set_err(s_cuda *c, const char *fmt, const char *a, const char *b) {
    if (c->failed)
        return;
    c->failed = 1;
    snprintf(c->err, sizeof c->err, fmt, a, b);
}

/* 1 when e is success; otherwise records "cuda: what: message" and 0. */
static int s_ok(s_cuda *c, cudaError_t e, const char *what) {
    if (e == cudaSuccess)
        return 1;
    s_set_err(c, "cuda: %s: %s", what, cudaGetErrorString(e));
    return 0;
}

static int s_lt_ok(s_cuda *c, cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS)
        return 1;
    char msg[160];
    snprintf(msg, sizeof msg, "%s (%s)", cublasLtGetStatusString(st), cublasLtGetStatusName(st));
    s_set_err(c, "cublasLt: %s: %s", what, msg);
    return 0;
}

/* Checks that a kernel launch was accepted. */
static void s_launched(s_cuda *c, const char *kernel) {
    s_ok(c, cudaGetLastError(), kernel);
}

/* Makes the device current; 0 when the backend has failed (skip the work). */
static int s_enter(s_cuda *c) {
    if (c->failed)
        return 0;
    return s_ok(c, cudaSetDevice(c->device), "cudaSetDevice");
}

/* --- graph records ----------------------------------------------------- */

/* FNV-1a, one 64-bit word at a time. */
static uint64_t s_mix(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        h ^= (v >> (8 * i)) & 0xffu;
        h *= 1099511628211ull;
    }
    return h;
}

static uint64_t s_fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

#define S_P(p) ((uint64_t)(uintptr_t)(p))

/* While a graph is recorded or relaunched, adds a call (its kind and every
 * argument) to the running hash that graph_end compares with the key's
 * recording. Returns 1 when relaunching: the call is then only checked,
 * not issued, since the recorded graph already holds it. */
static int s_note(s_cuda *c, int op, const uint64_t *v, int nv) {
    if (!c->capturing)
        return 0;
    uint64_t h = s_mix(c->hash, (uint64_t)op);
    for (int i = 0; i < nv; i++)
        h = s_mix(h, v[i]);
    c->hash = h;
    c->calls++;
    return c->replaying;
}

/* In an operation returning void: notes the call and returns when it is
 * only checked. */
#define S_NOTE(c, op, ...)                                                   \
    do {                                                                     \
        const uint64_t v_[] = {__VA_ARGS__};                                 \
        if (s_note((c), (op), v_, (int)(sizeof v_ / sizeof v_[0])))          \
            return;                                                          \
    } while (0)

/* --- profiling --------------------------------------------------------- */

static void s_prof_flush(s_cuda *c) {
    if (!c->n_pairs)
        return;
    if (!s_ok(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize (profile)"))
        return;
    for (int i = 0; i < c->n_pairs; i++) {
        float ms = 0;
        if (!s_ok(c, cudaEventElapsedTime(&ms, c->ev[2 * i], c->ev[2 * i + 1]), "cudaEventElapsedTime"))
            return;
        c->kernel_ms += ms;
        c->op_ms[c->ev_op[i]] += ms;
        c->op_calls[c->ev_op[i]]++;
    }
    c->n_pairs = 0;
}

static void s_prof_begin(s_cuda *c) {
    if (!c->profile)
        return;
    if (c->n_pairs == S_PROF_PAIRS)
        s_prof_flush(c);
    if (c->n_pairs == S_PROF_PAIRS)
        return; /* the flush failed (and failed the backend): no free pair */
    s_ok(c, cudaEventRecord(c->ev[2 * c->n_pairs], c->stream), "cudaEventRecord");
}

static void s_prof_end(s_cuda *c, int op) {
    if (!c->profile || c->n_pairs == S_PROF_PAIRS)
        return;
    if (s_ok(c, cudaEventRecord(c->ev[2 * c->n_pairs + 1], c->stream), "cudaEventRecord"))
        c->ev_op[c->n_pairs++] = (uint8_t)op;
}

/* --- device helpers ---------------------------------------------------- */

static unsigned s_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 65535u * 32u ? 65535u * 32u : b); /* kernels stride beyond */
}

__device__ static inline float s_h2f(uint16_t h) {
    return __half2float(__ushort_as_half(h));
}

__device__ static inline uint16_t s_ld16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}

/* Element j (< 32) of one GGUF block of type t, as fi_dequantize_row
 * computes it (same operations, so the same fp32 value). */
__device__ static inline float s_block_elem(int t, const uint8_t *blk, int j) {
    switch (t) {
    case FI_DTYPE_Q8_0:
        return (float)(int8_t)blk[2 + j] * s_h2f(s_ld16(blk));
    case FI_DTYPE_Q4_0: {
        uint8_t b = blk[2 + (j & 15)];
        int q = j < 16 ? (b & 0x0f) : (b >> 4);
        return (float)(q - 8) * s_h2f(s_ld16(blk));
    }
    case FI_DTYPE_Q4_1: {
        uint8_t b = blk[4 + (j & 15)];
        int q = j < 16 ? (b & 0x0f) : (b >> 4);
        /* no fused multiply-add: the CPU rounds the product first */
        return __fadd_rn(__fmul_rn((float)q, s_h2f(s_ld16(blk))), s_h2f(s_ld16(blk + 2)));
    }
    }
    return __int_as_float(0x7fc00000); /* NaN: an unsupported type shows */
}

/* Element i of a row of `cols` elements of type t at `row`. */
__device__ static inline float s_row_elem(int t, const uint8_t *row, int i) {
    switch (t) {
    case FI_DTYPE_F32: return ((const float *)row)[i];
    case FI_DTYPE_F16: return s_h2f(((const uint16_t *)row)[i]);
    case FI_DTYPE_BF16: return __uint_as_float((uint32_t)((const uint16_t *)row)[i] << 16);
    case FI_DTYPE_Q8_0: return s_block_elem(t, row + (size_t)(i / S_QK) * 34, i % S_QK);
    case FI_DTYPE_Q4_0: return s_block_elem(t, row + (size_t)(i / S_QK) * 18, i % S_QK);
    case FI_DTYPE_Q4_1: return s_block_elem(t, row + (size_t)(i / S_QK) * 20, i % S_QK);
    }
    return __int_as_float(0x7fc00000);
}

__device__ static inline float s_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* --- kernels ----------------------------------------------------------- */

/* out[r*cols + i] = fp16(element i of row r), for a whole matrix. */
__global__ static void k_dequant_f16(__half *out, const uint8_t *w, int t, int rows, int cols,
                                     size_t row_bytes) {
    size_t total = (size_t)rows * cols;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t r = e / cols;
        int i = (int)(e % cols);
        out[e] = __float2half_rn(s_row_elem(t, w + r * row_bytes, i));
    }
}

/* y[t][i] = row tok[t] of a weight: fp16 table when h, else raw rows q. */
__global__ static void k_get_rows(float *y, const __half *h, const uint8_t *q, int t, int cols,
                                  size_t row_bytes, const int32_t *tok, int n) {
    size_t total = (size_t)n * cols;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t tt = e / cols;
        int i = (int)(e % cols);
        size_t r = (size_t)tok[tt];
        y[e] = h ? __half2float(h[r * cols + i]) : s_row_elem(t, q + r * row_bytes, i);
    }
}

__global__ static void k_to_half(__half *y, const float *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2half_rn(x[i]);
}

/* The weights of one k_matvec launch: up to FI_MATMUL_N_MAX matrices with
 * the same cols sharing one x; the launch's rows are those of w[0], then
 * w[1], ... (end[i]: rows of w[0..i]). */
typedef struct s_mv_args {
    const __half *h[FI_MATMUL_N_MAX];  /* fp16 rows, or NULL: */
    const uint8_t *q[FI_MATMUL_N_MAX]; /* GGUF blocks of type type[i] */
    float *y[FI_MATMUL_N_MAX];         /* n x rows of w[i] */
    int end[FI_MATMUL_N_MAX];
    int type[FI_MATMUL_N_MAX];
    int row_bytes[FI_MATMUL_N_MAX];
    int blk_bytes[FI_MATMUL_N_MAX];
    int count;
    float *acc;     /* matmul_add (count 1): acc += y, element by element */
    const float *g; /* rmsnorm weights: x is normalised on the fly */
    float eps;
    int swiglu;     /* count 2, equal rows: y[0] = silu(W0 x) * (W1 x), y[1] = W1 x */
    int prefetch;   /* issue the rows' first loads before the rmsnorm scales */
} s_mv_args;

/* k_rmsnorm's scale for a row whose squares sum to ss. */
__device__ static inline float s_norm_scale(float ss, int dim, float eps) {
    return (float)(1.0 / sqrt((double)ss / dim + (double)eps));
}

__host__ __device__ static inline int s_norm_threads_dev(int dim) {
    return dim >= 1024 ? 1024 : 256; /* k_rmsnorm's block size */
}

/* Lane-partial dot products of row r of weight i with n tokens of x
 * (normalised as x * scale[k] * g when a.g) into acc[0..n). fp16 rows:
 * lane l takes 8-element chunks l, l+32, ..., four chunks' loads issued
 * before their use (cols % 8 == 0, x 16-byte aligned: the host checks).
 * Quantised rows: lane l takes blocks l, l+32, ... A row's result
 * depends only on its weight row, x and g, so matmul, matmul_n,
 * matmul_add and the fused forms give the same bits. pre (when use_pre):
 * the fp16 row's first four chunks of this lane, loaded already
 * (s_mv_pre). */
template <int NT>
__device__ static inline void s_mv_dot(const s_mv_args &a, int i, int r, const float *x, int cols,
                                       int n, const float *scale, float *acc,
                                       const uint4 (&pre)[4], int use_pre) {
    int lane = threadIdx.x & 31;
    if (a.h[i]) {
        const __half *row = a.h[i] + (size_t)r * cols;
        int nch = cols / 8;
        for (int c = lane; c < nch; c += 4 * 32) {
            uint4 u[4];
            float4 xl[4], xh[4]; /* one token: its x loads go out with u's */
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if (c + 32 * j < nch) {
                    int c0 = (c + 32 * j) * 8;
                    u[j] = use_pre && c == lane ? pre[j] : __ldg((const uint4 *)(row + c0));
                    if (NT == 1) {
                        xl[j] = *(const float4 *)(x + c0);
                        xh[j] = *(const float4 *)(x + c0 + 4);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if (c + 32 * j >= nch)
                    break;
                int c0 = (c + 32 * j) * 8;
                const __half2 *h2 = (const __half2 *)&u[j];
                float wf[8];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __half22float2(h2[e]);
                    wf[2 * e] = f.x;
                    wf[2 * e + 1] = f.y;
                }
                float gf[8];
                if (a.g) {
                    float4 g0 = *(const float4 *)(a.g + c0), g1 = *(const float4 *)(a.g + c0 + 4);
                    gf[0] = g0.x, gf[1] = g0.y, gf[2] = g0.z, gf[3] = g0.w;
                    gf[4] = g1.x, gf[5] = g1.y, gf[6] = g1.z, gf[7] = g1.w;
                }
#pragma unroll
                for (int k = 0; k < NT; k++) {
                    if (NT == 1 || k < n) {
                        float4 x0, x1;
                        if (NT == 1) {
                            x0 = xl[j];
                            x1 = xh[j];
                        } else {
                            const float4 *xp = (const float4 *)(x + (size_t)k * cols + c0);
                            x0 = xp[0];
                            x1 = xp[1];
                        }
                        float xf[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                        if (a.g) {
#pragma unroll
                            for (int e = 0; e < 8; e++)
                                xf[e] = xf[e] * scale[k] * gf[e];
                        }
                        float s = acc[k];
#pragma unroll
                        for (int e = 0; e < 8; e++)
                            s = fmaf(wf[e], xf[e], s);
                        acc[k] = s;
                    }
                }
            }
        }
        return;
    }
    const uint8_t *row = a.q[i] + (size_t)r * a.row_bytes[i];
    int t = a.type[i], nb = cols / S_QK;
    for (int b = lane; b < nb; b += 32) {
        const uint8_t *blk = row + (size_t)b * a.blk_bytes[i];
        float v[S_QK];
#pragma unroll
        for (int j = 0; j < S_QK; j++)
            v[j] = s_block_elem(t, blk, j);
#pragma unroll
        for (int k = 0; k < NT; k++) {
            if (NT == 1 || k < n) {
                const float *xk = x + (size_t)k * cols + (size_t)b * S_QK;
                const float *gk = a.g ? a.g + (size_t)b * S_QK : NULL;
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < S_QK; j++)
                    s = fmaf(v[j], gk ? xk[j] * scale[k] * gk[j] : xk[j], s);
                acc[k] += s;
            }
        }
    }
}

/* Loads the first four chunks of this lane of fp16 row r of weight i, as
 * s_mv_dot would (nothing for quantised rows). */
__device__ static inline void s_mv_pre(const s_mv_args &a, int i, int r, int cols, uint4 *u) {
    if (!a.h[i])
        return;
    const __half *row = a.h[i] + (size_t)r * cols;
    int lane = threadIdx.x & 31, nch = cols / 8;
#pragma unroll
    for (int j = 0; j < 4; j++)
        if (lane + 32 * j < nch)
            u[j] = __ldg((const uint4 *)(row + (size_t)(lane + 32 * j) * 8));
}

/* Matrix-vector products of n <= S_MV_MAX_N tokens: one warp per output
 * row (per row pair with a.swiglu), x read as fp32 (no conversion); see
 * s_mv_dot. With a.g, x is normalised on the fly: each block first finds
 * the n tokens' scales exactly as k_rmsnorm does with its block of 256
 * threads (cols < 1024: the host checks), thread v summing the squares of
 * elements v, v + 256, ..., each warp's sums by s_warp_sum, then warp 0
 * those of the 8 warps, so that the products see the bits rmsnorm would
 * have written. The weight rows' first loads are issued before that, so
 * that they are under way while the scales are found. */
template <int NT>
__global__ static void __launch_bounds__(S_MV_THREADS, 2)
k_matvec(s_mv_args a, const float *x, int cols, int n) {
    __shared__ float sscale[NT], part[NT][S_MV_THREADS / 32];
    int gw = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    int valid = gw < a.end[a.count - 1];
    int i = 0;
    if (!a.swiglu)
        for (int j = 0; j + 1 < a.count; j++)
            i += gw >= a.end[j];
    int first = i ? a.end[i - 1] : 0, rows = a.end[i] - first, r = gw - first;
    uint4 pre[4], pre2[4];
    if (valid && a.prefetch) {
        s_mv_pre(a, i, r, cols, pre);
        if (a.swiglu)
            s_mv_pre(a, 1, r, cols, pre2);
    }
    if (a.g) {
        float ss[NT];
#pragma unroll
        for (int k = 0; k < NT; k++) {
            ss[k] = 0.0f;
            if (NT == 1 || k < n)
                for (int i = threadIdx.x; i < cols; i += S_MV_THREADS)
                    ss[k] = fmaf(x[(size_t)k * cols + i], x[(size_t)k * cols + i], ss[k]);
        }
#pragma unroll
        for (int k = 0; k < NT; k++) {
            if (NT == 1 || k < n) {
                float v = s_warp_sum(ss[k]);
                if (lane == 0)
                    part[k][warp] = v;
            }
        }
        __syncthreads();
        if (warp == 0) {
            for (int k = 0; k < n; k++) {
                float v = s_warp_sum(lane < S_MV_THREADS / 32 ? part[k][lane] : 0.0f);
                if (lane == 0)
                    sscale[k] = s_norm_scale(v, cols, a.eps);
            }
        }
        __syncthreads();
    }
    if (!valid)
        return;
    float scale[NT];
#pragma unroll
    for (int k = 0; k < NT; k++)
        scale[k] = a.g && (NT == 1 || k < n) ? sscale[k] : 1.0f;
    float acc[NT], acc2[NT];
#pragma unroll
    for (int k = 0; k < NT; k++)
        acc[k] = acc2[k] = 0.0f;
    s_mv_dot<NT>(a, i, r, x, cols, n, scale, acc, pre, a.prefetch);
    if (a.swiglu)
        s_mv_dot<NT>(a, 1, r, x, cols, n, scale, acc2, pre2, a.prefetch);
#pragma unroll
    for (int k = 0; k < NT; k++) {
        if (NT == 1 || k < n) {
            float s = s_warp_sum(acc[k]);
            size_t at = (size_t)k * rows + r;
            if (a.swiglu) {
                float u = s_warp_sum(acc2[k]);
                if (lane == 0) {
                    a.y[0][at] = s / (1.0f + expf(-s)) * u; /* as k_swiglu */
                    a.y[1][at] = u;
                }
            } else if (lane == 0) {
                a.y[i][at] = s;
                if (a.acc)
                    a.acc[at] += s;
            }
        }
    }
}

/* One block per row: y = x / sqrt(mean(x^2) + eps) * g; y may alias x. */
__global__ static void k_rmsnorm(float *y, const float *x, const float *g, int dim, float eps) {
    __shared__ float part[32];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        ss = fmaf(xr[i], xr[i], ss);
    ss = s_warp_sum(ss);
    int w = threadIdx.x / 32, lane = threadIdx.x & 31, nw = (blockDim.x + 31) / 32;
    if (lane == 0)
        part[w] = ss;
    __syncthreads();
    if (w == 0) {
        float v = lane < nw ? part[lane] : 0.0f;
        v = s_warp_sum(v);
        if (lane == 0)
            part[0] = v;
    }
    __syncthreads();
    float scale = (float)(1.0 / sqrt((double)part[0] / dim + (double)eps));
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = xr[i] * scale * g[i];
}

/* The rotation of pair i at position p, in double as the CPU reference
 * computes it, rounded to float. */
__device__ static inline float2 s_rope_cs(int p, int i, int head_dim, float theta) {
    double ang = (double)p * pow((double)theta, -2.0 * i / head_dim);
    return make_float2((float)cos(ang), (float)sin(ang));
}

/* Rotates the pair at p by r = (cos, sin), each product rounded alone (no
 * fused multiply-add), so that every kernel rotating it gets its bits. */
__device__ static inline void s_rotate(float *p, float2 r) {
    float a = p[0], b = p[1];
    p[0] = __fsub_rn(__fmul_rn(a, r.x), __fmul_rn(b, r.y));
    p[1] = __fadd_rn(__fmul_rn(a, r.y), __fmul_rn(b, r.x));
}

/* The rotation of pair i of position p: from tab where it holds it (the
 * same values), else computed. */
__device__ static inline float2 s_rope_at(const float2 *tab, int p, int i, int head_dim,
                                         float theta) {
    return tab && p >= 0 && p < S_ROPE_POS ? tab[(size_t)p * (head_dim / 2) + i]
                                           : s_rope_cs(p, i, head_dim, theta);
}

/* tab[p * half + i] = s_rope_cs(p, i) for p < S_ROPE_POS. */
__global__ static void k_rope_table(float2 *tab, int head_dim, float theta) {
    int half = head_dim / 2;
    size_t total = (size_t)S_ROPE_POS * half;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x)
        tab[e] = s_rope_cs((int)(e / half), (int)(e % half), head_dim, theta);
}

/* One thread per (token, pair index i): the rotation from tab (when given
 * and the position is in it: the same values) or computed, then every
 * head. */
__global__ static void k_rope(float *x, int n, int n_heads, int head_dim, const int32_t *pos,
                              float theta, const float2 *tab) {
    int half = head_dim / 2;
    size_t total = (size_t)n * half;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(e / half), i = (int)(e % half);
        float2 r = s_rope_at(tab, pos[t], i, head_dim, theta);
        float *row = x + (size_t)t * n_heads * head_dim;
        for (int h = 0; h < n_heads; h++)
            s_rotate(row + (size_t)h * head_dim + 2 * i, r);
    }
}

/* rope_store: thread e < n * half rotates pair i of token t in every
 * query and KV head (as k_rope) and stores the KV heads' pairs in the
 * cache row slot[t]; thread e < n * kv_dim / 2 also stores a pair of v. */
__global__ static void k_rope_store(float *q, float *k, const float *v, uint16_t *kc,
                                    uint16_t *vc, int n, int n_heads, int n_kv_heads,
                                    int head_dim, const int32_t *pos, float theta,
                                    const float2 *tab, const int32_t *slot) {
    int half = head_dim / 2, kv_dim = n_kv_heads * head_dim;
    size_t n_rot = (size_t)n * half, n_v = (size_t)n * (kv_dim / 2);
    size_t total = n_rot > n_v ? n_rot : n_v;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        if (e < n_rot) {
            int t = (int)(e / half), i = (int)(e % half);
            float2 r = s_rope_at(tab, pos[t], i, head_dim, theta);
            float *qr = q + (size_t)t * n_heads * head_dim + 2 * i;
            for (int h = 0; h < n_heads; h++)
                s_rotate(qr + (size_t)h * head_dim, r);
            float *kr = k + (size_t)t * kv_dim + 2 * i;
            uint16_t *cr = kc + (size_t)slot[t] * kv_dim + 2 * i;
            for (int h = 0; h < n_kv_heads; h++) {
                float *p = kr + (size_t)h * head_dim;
                s_rotate(p, r);
                cr[(size_t)h * head_dim] = __half_as_ushort(__float2half_rn(p[0]));
                cr[(size_t)h * head_dim + 1] = __half_as_ushort(__float2half_rn(p[1]));
            }
        }
        if (e < n_v) {
            size_t t = e / (kv_dim / 2), j = 2 * (e % (kv_dim / 2));
            const float *vr = v + t * kv_dim + j;
            uint16_t *cr = vc + (size_t)slot[t] * kv_dim + j;
            cr[0] = __half_as_ushort(__float2half_rn(vr[0]));
            cr[1] = __half_as_ushort(__float2half_rn(vr[1]));
        }
    }
}

__global__ static void k_store_f16(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __half_as_ushort(__float2half_rn(src[i]));
}

__global__ static void k_swiglu(float *g, const float *u, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

__global__ static void k_add(float *y, const float *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

/* Attention, first pass. grid.x = n * n_heads (token t, head h), grid.y =
 * splits. Split s takes chunks s, s+S, s+2S, ... of S_ATT_CHUNK positions
 * of 0..pos[t]. With one split the result goes straight to out; otherwise
 * (max, sum, o[head_dim]) goes to part[((t*H + h)*S + s) * (hd + 2)]. */
__global__ static void __launch_bounds__(S_ATT_WARPS * 32)
k_attention(float *out, float *part, const float *q, const uint16_t *kc, const uint16_t *vc,
            const int32_t *pos, const int32_t *seq, const int32_t *tables, int max_blocks, int bs,
            int n_heads, int n_kv_heads, int hd) {
    __shared__ float sq[S_ATT_MAX_HD];
    __shared__ float wm[S_ATT_WARPS], wl[S_ATT_WARPS];
    __shared__ float wo[S_ATT_WARPS][S_ATT_MAX_HD];
    int th = blockIdx.x, t = th / n_heads, h = th % n_heads;
    int split = blockIdx.y, n_split = gridDim.y;
    int kh = h / (n_heads / n_kv_heads);
    int kv_dim = n_kv_heads * hd;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const float *qr = q + (size_t)t * n_heads * hd + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        sq[d] = qr[d];
    __syncthreads();
    float scale = 1.0f / sqrtf((float)hd); /* as the CPU computes it */
    int np = pos[t] + 1;
    const int32_t *tbl = tables + (size_t)seq[t] * max_blocks;
    float m = -INFINITY, l = 0.0f;
    /* lane holds dims lane, lane+32, ...; fixed trip counts keep acc in
     * registers */
    float acc[S_ATT_MAX_HD / 32];
#pragma unroll
    for (int j = 0; j < S_ATT_MAX_HD / 32; j++)
        acc[j] = 0.0f;
    for (int c0 = split * S_ATT_CHUNK; c0 < np; c0 += n_split * S_ATT_CHUNK) {
        int c1 = c0 + S_ATT_CHUNK < np ? c0 + S_ATT_CHUNK : np;
        for (int p = c0 + warp; p < c1; p += S_ATT_WARPS) {
            size_t row = (size_t)tbl[p / bs] * bs + (size_t)(p % bs);
            const uint16_t *kr = kc + row * kv_dim + (size_t)kh * hd;
            const uint16_t *vr = vc + row * kv_dim + (size_t)kh * hd;
            float s = 0.0f;
            for (int d = lane; d < hd; d += 32)
                s = fmaf(sq[d], s_h2f(kr[d]), s);
            s = s_warp_sum(s) * scale;
            float r, e;
            if (s > m) {
                r = expf(m - s); /* 0 on the first position */
                e = 1.0f;
                m = s;
            } else {
                r = 1.0f;
                e = expf(s - m);
            }
            l = l * r + e;
#pragma unroll
            for (int j = 0; j < S_ATT_MAX_HD / 32; j++)
                if (lane + 32 * j < hd)
                    acc[j] = acc[j] * r + e * s_h2f(vr[lane + 32 * j]);
        }
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < S_ATT_MAX_HD / 32; j++)
        if (lane + 32 * j < hd)
            wo[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < S_ATT_WARPS; w++)
        M = fmaxf(M, wm[w]);
    float L = 0.0f;
    float f[S_ATT_WARPS];
    for (int w = 0; w < S_ATT_WARPS; w++) {
        f[w] = wm[w] == -INFINITY ? 0.0f : expf(wm[w] - M);
        L += wl[w] * f[w];
    }
    if (n_split == 1) {
        float *o = out + (size_t)t * n_heads * hd + (size_t)h * hd;
        float il = 1.0f / L;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float v = 0.0f;
            for (int w = 0; w < S_ATT_WARPS; w++)
                v += wo[w][d] * f[w];
            o[d] = v * il;
        }
    } else {
        float *pp = part + ((size_t)th * n_split + split) * (size_t)(hd + 2);
        if (threadIdx.x == 0) {
            pp[0] = M;
            pp[1] = L;
        }
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float v = 0.0f;
            for (int w = 0; w < S_ATT_WARPS; w++)
                v += wo[w][d] * f[w];
            pp[2 + d] = v;
        }
    }
}

__device__ static inline float s_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Attention for head_dim HD (32, 64 or 128) and up to S_AG_MAX_G query
 * heads per KV head: one block per (token t, KV head kh, split), taking the
 * G query heads of kh together so that each K and V row is read once for
 * all of them. The split takes tiles s, s+S, s+2S, ... of S_AG_TILE
 * positions of 0..pos[t]. Per tile:
 *   1. thread i loads the K and V rows of position i of the tile together
 *      (16-byte loads, all in flight at once), puts the V row in shared
 *      memory and scores the position for the G heads (q from shared
 *      memory);
 *   2. the block's max and sum of exp per head update an online softmax;
 *   3. thread (sub, d2) adds p * V to dims 2*d2, 2*d2+1 for the tile's
 *      positions sub, sub + nsub, ..., reading V from shared memory.
 * Only the first `active` splits have positions (those starting below
 * pos[t] + 1); the others return at once. With one active split the result
 * goes to out; otherwise each active block writes (max, sum, o[hd]) per
 * head as k_attention does, and the last of them to finish (counted in
 * count[t * n_kv_heads + kh], reset by that block) merges them in split
 * order, so no second launch is needed. GM: the most heads per group
 * the instance handles (4 or 8: fewer registers for the common groups). */
template <int HD, int GM>
__global__ static void __launch_bounds__(S_AG_THREADS)
k_attention_g(float *out, float *part, unsigned *count, const float *q, const uint16_t *kc,
              const uint16_t *vc, const int32_t *pos, const int32_t *seq, const int32_t *tables,
              int max_blocks, int bs, int n_heads, int n_kv_heads) {
    constexpr int V4 = HD / 8;     /* 16-byte pieces of a row */
    constexpr int VS = V4 + 1;     /* a staged V row's stride: one piece of padding (banks) */
    constexpr int H2 = HD / 2;     /* half2 columns */
    constexpr int NSUB = S_AG_THREADS / H2;
    constexpr int SV = S_AG_TILE * VS; /* staged V, uint4s */
    constexpr int SO = 2 * S_AG_THREADS * GM / 4; /* the end's sums, as uint4s */
    __shared__ __align__(16) uint4 sv[SV > SO ? SV : SO]; /* V tile; at the end, the subsets' sums */
    __shared__ float sq[GM * HD];
    __shared__ float sp[GM][S_AG_TILE];
    __shared__ float smax[S_AG_THREADS / 32][GM], ssum[S_AG_THREADS / 32][GM];
    __shared__ float sm[GM], sl[GM];
    __shared__ float mf[GM][S_ATT_MAX_SPLIT]; /* merge: each split's factor */
    __shared__ float mL[GM];
    __shared__ int last;
    const int G = n_heads / n_kv_heads; /* <= GM */
    const int tk = blockIdx.x, t = tk / n_kv_heads, kh = tk % n_kv_heads;
    const int split = blockIdx.y;
    const int np = pos[t] + 1;
    const int tiles = (np + S_AG_TILE - 1) / S_AG_TILE;
    const int S = (int)gridDim.y; /* splits of the launch: the partials' stride */
    const int n_split = tiles < S ? tiles : S; /* active */
    if (split >= n_split)
        return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
    const int kv_dim = n_kv_heads * HD;
    const int d2 = tid % H2, sub = tid / H2;
    const float *qr = q + (size_t)t * n_heads * HD + (size_t)kh * G * HD;
    for (int i = tid; i < G * HD; i += S_AG_THREADS)
        sq[i] = qr[i];
    const float scale = 1.0f / sqrtf((float)HD); /* as the CPU computes it */
    const int32_t *tbl = tables + (size_t)seq[t] * max_blocks;
    float m[GM], l[GM], a0[GM], a1[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        m[g] = -INFINITY;
        l[g] = a0[g] = a1[g] = 0.0f;
    }
    __syncthreads();
    for (int c0 = split * S_AG_TILE; c0 < np; c0 += n_split * S_AG_TILE) {
        const int cn = np - c0 < S_AG_TILE ? np - c0 : S_AG_TILE;
        float sc[GM];
#pragma unroll
        for (int g = 0; g < GM; g++)
            sc[g] = -INFINITY;
        if (tid < cn) {
            int p = c0 + tid;
            size_t row = (size_t)tbl[p / bs] * bs + (size_t)(p % bs);
            const uint4 *kr = (const uint4 *)(kc + row * kv_dim + (size_t)kh * HD);
            const uint4 *vr = (const uint4 *)(vc + row * kv_dim + (size_t)kh * HD);
            /* V straight to shared memory (cp.async: no registers held),
             * waited for below, while K is scored */
#pragma unroll
            for (int j = 0; j < V4; j++)
                __pipeline_memcpy_async(&sv[tid * VS + j], vr + j, sizeof(uint4));
            __pipeline_commit();
            uint4 ku[V4];
#pragma unroll
            for (int j = 0; j < V4; j++)
                ku[j] = __ldg(kr + j);
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (g < G)
                    sc[g] = 0.0f;
#pragma unroll
            for (int j = 0; j < V4; j++) {
                const __half2 *k2 = (const __half2 *)&ku[j];
                float kf[8];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __half22float2(k2[e]);
                    kf[2 * e] = f.x;
                    kf[2 * e + 1] = f.y;
                }
#pragma unroll
                for (int g = 0; g < GM; g++) {
                    if (g < G) {
                        const float *qg = sq + g * HD + 8 * j;
                        float sg = sc[g];
#pragma unroll
                        for (int e = 0; e < 8; e++)
                            sg = fmaf(qg[e], kf[e], sg);
                        sc[g] = sg;
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (g < G)
                    sc[g] *= scale;
        }
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g < G) {
                float v = s_warp_max(sc[g]);
                if (lane == 0)
                    smax[warp][g] = v;
            }
        }
        __pipeline_wait_prior(0); /* this thread's V row; the barrier shows it to all */
        __syncthreads();
        float r[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) {
            r[g] = 1.0f;
            if (g < G) {
                float tm = smax[0][g];
#pragma unroll
                for (int w = 1; w < S_AG_THREADS / 32; w++)
                    tm = fmaxf(tm, smax[w][g]);
                float mn = fmaxf(m[g], tm); /* finite: the tile has a position */
                r[g] = expf(m[g] - mn);     /* 0 on the first tile */
                m[g] = mn;
                float e = tid < cn ? expf(sc[g] - mn) : 0.0f;
                sp[g][tid] = e;
                e = s_warp_sum(e);
                if (lane == 0)
                    ssum[warp][g] = e;
            }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g < G) {
                float ts = 0.0f;
#pragma unroll
                for (int w = 0; w < S_AG_THREADS / 32; w++)
                    ts += ssum[w][g];
                l[g] = l[g] * r[g] + ts;
                a0[g] *= r[g];
                a1[g] *= r[g];
            }
        }
        const __half2 *sv2 = (const __half2 *)sv;
#pragma unroll 4
        for (int i = sub; i < cn; i += NSUB) {
            float2 vf = __half22float2(sv2[i * (VS * 4) + d2]);
#pragma unroll
            for (int g = 0; g < GM; g++) {
                if (g < G) {
                    float pg = sp[g][i];
                    a0[g] = fmaf(pg, vf.x, a0[g]);
                    a1[g] = fmaf(pg, vf.y, a1[g]);
                }
            }
        }
        __syncthreads(); /* sv, sp and the sums are refilled next */
    }
    float *so = (float *)sv;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g < G) {
            so[(sub * G + g) * HD + 2 * d2] = a0[g];
            so[(sub * G + g) * HD + 2 * d2 + 1] = a1[g];
        }
    }
    if (tid == 0) {
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g < G) {
                sm[g] = m[g];
                sl[g] = l[g];
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < G * HD; i += S_AG_THREADS) {
        int g = i / HD, d = i % HD, h = kh * G + g;
        float v = 0.0f;
#pragma unroll
        for (int sb = 0; sb < NSUB; sb++)
            v += so[(sb * G + g) * HD + d];
        if (n_split == 1) {
            out[(size_t)t * n_heads * HD + (size_t)h * HD + d] = v / sl[g];
        } else {
            float *pp = part + ((size_t)(t * n_heads + h) * S + split) * (size_t)(HD + 2);
            if (d == 0) {
                pp[0] = sm[g];
                pp[1] = sl[g];
            }
            pp[2 + d] = v;
        }
    }
    if (n_split == 1)
        return;
    /* the last block of (t, kh) merges: see the header */
    __threadfence();
    __syncthreads();
    if (tid == 0)
        last = atomicAdd(&count[tk], 1u) == (unsigned)n_split - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    /* each split's factor exp(m_s - M) and the sum L, per head */
    for (int i = tid; i < G * n_split; i += S_AG_THREADS) {
        int g = i / n_split, sp_ = i % n_split;
        mf[g][sp_] = __ldcg(part + ((size_t)(t * n_heads + kh * G + g) * S + sp_) * (size_t)(HD + 2));
    }
    __syncthreads();
    if (tid < G) {
        float M = -INFINITY;
        for (int sp_ = 0; sp_ < n_split; sp_++)
            M = fmaxf(M, mf[tid][sp_]);
        const float *pp = part + (size_t)(t * n_heads + kh * G + tid) * S * (size_t)(HD + 2);
        float L = 0.0f;
        for (int sp_ = 0; sp_ < n_split; sp_++) {
            float f = expf(mf[tid][sp_] - M); /* every active split has positions */
            L += __ldcg(pp + (size_t)sp_ * (HD + 2) + 1) * f;
            mf[tid][sp_] = f;
        }
        mL[tid] = L;
    }
    __syncthreads();
    for (int i = tid; i < G * HD; i += S_AG_THREADS) {
        int g = i / HD, d = i % HD, h = kh * G + g;
        const float *pp = part + (size_t)(t * n_heads + h) * S * (size_t)(HD + 2) + 2 + d;
        float v = 0.0f;
#pragma unroll 8
        for (int sp_ = 0; sp_ < n_split; sp_++)
            v += __ldcg(pp + (size_t)sp_ * (HD + 2)) * mf[g][sp_];
        out[(size_t)t * n_heads * HD + (size_t)h * HD + d] = v / mL[g];
    }
    if (tid == 0)
        count[tk] = 0; /* ready for the next launch */
}

/* Attention, second pass (only with splits): one block per (token, head). */
__global__ static void k_attention_merge(float *out, const float *part, int n_heads, int hd,
                                         int n_split) {
    int th = blockIdx.x;
    const float *pp = part + (size_t)th * n_split * (hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_split; s++)
        M = fmaxf(M, pp[(size_t)s * (hd + 2)]);
    float L = 0.0f;
    for (int s = 0; s < n_split; s++) {
        float ms = pp[(size_t)s * (hd + 2)];
        if (ms != -INFINITY)
            L += pp[(size_t)s * (hd + 2) + 1] * expf(ms - M);
    }
    float il = 1.0f / L;
    float *o = out + (size_t)th * hd; /* rows of n_heads*hd: (t, h) is th*hd */
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
        for (int s = 0; s < n_split; s++) {
            float ms = pp[(size_t)s * (hd + 2)];
            if (ms != -INFINITY)
                v += pp[(size_t)s * (hd + 2) + 2 + d] * expf(ms - M);
        }
        o[d] = v * il;
    }
}

/* Index of the largest of x[0..n), the first on ties; NaN never wins. One
 * block of 1024 threads. */
__global__ static void __launch_bounds__(1024) k_argmax(int32_t *out, const float *x, int n) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    float best = -INFINITY;
    int idx = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[i];
        if (!isnan(v) && (idx < 0 || v > best)) {
            best = v;
            idx = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (oi >= 0 && (idx < 0 || ov > best || (ov == best && oi < idx))) {
            best = ov;
            idx = oi;
        }
    }
    int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    if (lane == 0) {
        bv[w] = best;
        bi[w] = idx;
    }
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x / 32;
        best = lane < nw ? bv[lane] : -INFINITY;
        idx = lane < nw ? bi[lane] : -1;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (oi >= 0 && (idx < 0 || ov > best || (ov == best && oi < idx))) {
                best = ov;
                idx = oi;
            }
        }
        if (lane == 0)
            *out = idx < 0 ? 0 : idx;
    }
}

/* --- scratch ----------------------------------------------------------- */

/* Makes *buf hold at least `need` elements of `elem` bytes; 0 or -1. */
static int s_grow(s_cuda *c, void **buf, size_t *cap, size_t need, size_t elem, const char *what) {
    if (need <= *cap)
        return 0;
    if (c->capturing) {
        s_set_err(c, "cuda: %s: %s", what, "would allocate during a graph capture");
        return -1;
    }
    size_t n = need + need / 4;
    c->gen++; /* recorded graphs point into the old buffer */
    if (*buf && !s_ok(c, cudaFree(*buf), "cudaFree (scratch)"))
        return -1;
    *buf = NULL;
    *cap = 0;
    if (!s_ok(c, cudaMalloc(buf, n * elem), what))
        return -1;
    *cap = n;
    return 0;
}

/* --- memory ------------------------------------------------------------ */

/* Refuses a call that cannot be part of a graph capture. */
static int s_not_capturing(s_cuda *c, const char *what) {
    if (!c->capturing)
        return 1;
    s_set_err(c, "cuda: %s: %s", what, "not allowed between graph_begin and graph_end");
    return 0;
}

static void *s_alloc(void *ctx, size_t bytes) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || !s_not_capturing(c, "alloc"))
        return NULL;
    void *p = NULL;
    c->gen++; /* the caller's buffers may now sit where freed ones were */
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        /* not sticky: the caller sees NULL and may go on */
        snprintf(c->err, sizeof c->err, "cuda: cudaMalloc of %zu bytes: %s", bytes,
                 cudaGetErrorString(e));
        (void)cudaGetLastError();
        return NULL;
    }
    if (!s_ok(c, cudaMemsetAsync(p, 0, bytes ? bytes : 1, c->stream), "cudaMemsetAsync")) {
        (void)cudaFree(p);
        return NULL;
    }
    return p;
}

static void s_free(void *ctx, void *p) {
    s_cuda *c = (s_cuda *)ctx;
    if (!p || !s_not_capturing(c, "free"))
        return;
    (void)cudaSetDevice(c->device);
    c->gen++;
    /* a failure here is reported by the next operation that checks */
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess && !c->failed)
        s_ok(c, e, "cudaFree");
}

static int s_to_backend(void *ctx, void *dst, const void *src, size_t bytes) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c))
        return -1;
    const uint64_t v[] = {S_P(dst), (uint64_t)bytes};
    int check_only = s_note(c, S_REC_TO_BACKEND, v, 2);
    if (c->capturing && bytes) {
        size_t at = (c->stage_used + 15) / 16 * 16;
        if (at + bytes > S_STAGE_BYTES) {
            s_set_err(c, "cuda: %s: %s", "to_backend during a graph capture",
                      "more than the 64 KiB staging buffer");
            return -1;
        }
        memcpy(c->stage + at, src, bytes);
        c->stage_used = at + bytes;
        src = c->stage + at;
        if (check_only) /* the recording copies from there */
            return 0;
    }
    /* From pageable memory this returns once src has been staged, so the
     * caller may reuse src at once. */
    if (bytes && !s_ok(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream),
                       "cudaMemcpyAsync (to device)"))
        return -1;
    return 0;
}

static int s_to_host(void *ctx, void *dst, const void *src, size_t bytes) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || !s_not_capturing(c, "to_host"))
        return -1;
    if (bytes && !s_ok(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream),
                       "cudaMemcpyAsync (to host)"))
        return -1;
    if (!s_ok(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize (to host)"))
        return -1;
    return 0;
}

static int s_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c))
        return -1;
    const uint64_t v[] = {S_P(dst), S_P(src), (uint64_t)bytes};
    if (s_note(c, S_REC_COPY, v, 3)) /* a relaunch runs the recorded copy */
        return 0;
    if (bytes && !s_ok(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream),
                       "cudaMemcpyAsync (device to device)"))
        return -1;
    return 0;
}

static int s_sync(void *ctx) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || !s_not_capturing(c, "sync"))
        return -1;
    if (!s_ok(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize"))
        return -1;
    return 0;
}

static const char *s_last_error(void *ctx) {
    s_cuda *c = (s_cuda *)ctx;
    return c->err[0] ? c->err : NULL;
}

/* --- weights ----------------------------------------------------------- */

static int s_is_quant(fi_dtype t) {
    return t == FI_DTYPE_Q4_0 || t == FI_DTYPE_Q4_1 || t == FI_DTYPE_Q8_0;
}

static size_t s_blk_bytes(fi_dtype t) {
    switch (t) {
    case FI_DTYPE_Q4_0: return 18;
    case FI_DTYPE_Q4_1: return 20;
    case FI_DTYPE_Q8_0: return 34;
    default: return 0;
    }
}

static void s_weight_free(s_cweight *cw) {
    if (!cw)
        return;
    if (cw->h)
        (void)cudaFree(cw->h);
    if (cw->q)
        (void)cudaFree(cw->q);
    free(cw);
}

/* Copies the rows to the device and, unless they stay quantised,
 * dequantises them to fp16 there (the raw copy is then freed). */
static int s_weight_upload(void *ctx, fi_weight *w) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || !s_not_capturing(c, "weight_upload"))
        return -1;
    s_cweight *cw = (s_cweight *)calloc(1, sizeof *cw);
    uint8_t *raw = NULL;
    size_t raw_bytes = (size_t)w->rows * w->row_bytes;
    size_t elems = (size_t)w->rows * w->cols;
    if (!cw) {
        snprintf(c->err, sizeof c->err, "cuda: out of host memory for a weight");
        return -1;
    }
    char what[96];
    snprintf(what, sizeof what, "cudaMalloc of a %dx%d weight", w->rows, w->cols);
    if (!s_ok(c, cudaMalloc((void **)&raw, raw_bytes), what))
        goto fail;
    if (!s_ok(c, cudaMemcpyAsync(raw, w->data, raw_bytes, cudaMemcpyHostToDevice, c->stream),
              "cudaMemcpyAsync (weight)"))
        goto fail;
    if (c->mode == FI_CUDA_WEIGHTS_QUANT && s_is_quant(w->type)) {
        cw->q = raw;
        raw = NULL;
    } else {
        if (!s_ok(c, cudaMalloc((void **)&cw->h, elems * sizeof(__half)), what))
            goto fail;
        k_dequant_f16<<<s_blocks(elems, S_THREADS), S_THREADS, 0, c->stream>>>(
            cw->h, raw, (int)w->type, w->rows, w->cols, w->row_bytes);
        s_launched(c, "k_dequant_f16");
        if (!s_ok(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize (weight)"))
            goto fail;
        (void)cudaFree(raw);
        raw = NULL;
    }
    if (c->failed)
        goto fail;
    w->dev = cw;
    c->uploaded++;
    c->gen++;
    return 0;
fail:
    if (raw)
        (void)cudaFree(raw);
    s_weight_free(cw);
    return -1;
}

static void s_weight_release(void *ctx, fi_weight *w) {
    s_cuda *c = (s_cuda *)ctx;
    /* cudaFree would invalidate the capture (and fail): refuse, as s_free does */
    if (!s_not_capturing(c, "weight_release"))
        return;
    (void)cudaSetDevice(c->device);
    c->gen++;
    s_weight_free((s_cweight *)w->dev);
    w->dev = NULL;
}

/* --- products ---------------------------------------------------------- */

static void s_plan_free(s_plan *p) {
    if (p->op)
        cublasLtMatmulDescDestroy(p->op);
    if (p->a)
        cublasLtMatrixLayoutDestroy(p->a);
    if (p->b)
        cublasLtMatrixLayoutDestroy(p->b);
    if (p->d)
        cublasLtMatrixLayoutDestroy(p->d);
    memset(p, 0, sizeof *p);
}

static int s_align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 1 && a % (uintptr_t)al)
        al /= 2;
    return al;
}

/* The cached plan for (m, n, k) writing to D at alignment `align`, made
 * (descriptors, layouts, heuristic) on first use. NULL on failure. */
static s_plan *s_get_plan(s_cuda *c, int m, int n, int k, int align) {
    for (int i = 0; i < c->n_plans; i++) {
        s_plan *p = &c->plans[i];
        if (p->m == m && p->n == n && p->k == k && p->align == align)
            return p;
    }
    s_plan *p;
    if (c->n_plans < S_PLANS) {
        p = &c->plans[c->n_plans++];
    } else {
        p = &c->plans[c->next_evict];
        c->next_evict = (c->next_evict + 1) % S_PLANS;
        s_plan_free(p);
    }
    char what[128];
    snprintf(what, sizeof what, "plan for %dx%d . %dx%d", m, k, k, n);
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int nres = 0;
    uint64_t ws = S_WORKSPACE_BYTES;
    uint32_t al = (uint32_t)align;
    if (!s_lt_ok(c, cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), what) ||
        !s_lt_ok(c, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), what) ||
        !s_lt_ok(c, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), what) ||
        !s_lt_ok(c, cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16F, (uint64_t)k, (uint64_t)m, (int64_t)k), what) ||
        !s_lt_ok(c, cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16F, (uint64_t)k, (uint64_t)n, (int64_t)k), what) ||
        !s_lt_ok(c, cublasLtMatrixLayoutCreate(&p->d, CUDA_R_32F, (uint64_t)m, (uint64_t)n, (int64_t)m), what) ||
        !s_lt_ok(c, cublasLtMatmulPreferenceCreate(&pref), what) ||
        !s_lt_ok(c, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), what) ||
        !s_lt_ok(c, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof al), what) ||
        !s_lt_ok(c, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof al), what) ||
        !s_lt_ok(c, cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->d, p->d, pref, 1, &res, &nres), what))
        goto fail;
    if (nres < 1) {
        s_lt_ok(c, CUBLAS_STATUS_NOT_SUPPORTED, what);
        goto fail;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    p->m = m;
    p->n = n;
    p->k = k;
    p->align = align;
    p->algo = res.algo;
    return p;
fail:
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    s_plan_free(p);
    /* a freed slot in the middle has m == 0 and never matches a lookup */
    return NULL;
}

/* y (n x m, row-major fp32) = x (n x k, fp16) . W^T, W m x k fp16. */
static void s_gemm(s_cuda *c, float *y, const __half *w, const __half *xh, int m, int n, int k) {
    s_plan *p = s_get_plan(c, m, n, k, s_align_of(y));
    if (!p)
        return;
    float alpha = 1.0f, beta = 0.0f;
    char what[96];
    snprintf(what, sizeof what, "cublasLtMatmul (%dx%d . %dx%d)", m, k, k, n);
    s_lt_ok(c, cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, xh, p->b, &beta, y, p->d, y, p->d,
                              &p->algo, c->workspace, S_WORKSPACE_BYTES, c->stream),
            what);
}

/* y[i] += x[i], after s_enter and the call's note. */
static void s_add_do(s_cuda *c, float *y, const float *x, size_t n) {
    s_prof_begin(c);
    k_add<<<s_blocks(n, S_THREADS), S_THREADS, 0, c->stream>>>(y, x, n);
    s_launched(c, "k_add");
    s_prof_end(c, S_OP_ADD);
}

/* Whether k_matvec takes the product of w with n tokens of x. */
static int s_mv_takes(const s_cuda *c, const fi_weight *w, const float *x, int n) {
    const s_cweight *cw = (const s_cweight *)w->dev;
    if (!cw || n > S_MV_MAX_N)
        return 0;
    if (cw->q) /* blocks: always (a GEMM would dequantise the whole matrix first) */
        return 1;
    return c->matvec && w->cols % 8 == 0 && (uintptr_t)x % 16 == 0;
}

/* Adds w as weight i of a k_matvec launch (rows after those already in). */
static void s_mv_add(s_mv_args *a, int i, const fi_weight *w, float *y) {
    const s_cweight *cw = (const s_cweight *)w->dev;
    a->h[i] = cw->h;
    a->q[i] = cw->h ? NULL : cw->q;
    a->y[i] = y;
    a->end[i] = (i ? a->end[i - 1] : 0) + w->rows;
    a->type[i] = (int)w->type;
    a->row_bytes[i] = (int)w->row_bytes;
    a->blk_bytes[i] = (int)s_blk_bytes(w->type);
    a->count = i + 1;
}

static void s_mv_launch(s_cuda *c, const s_mv_args *a, const float *x, int cols, int n) {
    size_t threads = (size_t)a->end[a->count - 1] * 32;
    s_prof_begin(c);
    unsigned blocks = (unsigned)((threads + S_MV_THREADS - 1) / S_MV_THREADS);
    /* one token (batch-1 decode): an instance whose x loads go out with the
     * weights' and that holds one accumulator; the same arithmetic */
    s_mv_args args = *a;
    args.prefetch = c->mv_pre;
    if (n == 1 && c->mv_pre)
        k_matvec<1><<<blocks, S_MV_THREADS, 0, c->stream>>>(args, x, cols, n);
    else
        k_matvec<S_MV_MAX_N><<<blocks, S_MV_THREADS, 0, c->stream>>>(args, x, cols, n);
    s_launched(c, "k_matvec");
    s_prof_end(c, S_OP_MATVEC);
}

/* matmul, after s_enter and the call's note. */
static void s_matmul_do(s_cuda *c, float *y, const fi_weight *w, const float *x, int n) {
    const s_cweight *cw = (const s_cweight *)w->dev;
    if (!cw) {
        s_set_err(c, "cuda: %s%s", "matmul on a weight that was not uploaded", "");
        return;
    }
    if (s_mv_takes(c, w, x, n)) {
        s_mv_args a;
        memset(&a, 0, sizeof a);
        s_mv_add(&a, 0, w, y);
        s_mv_launch(c, &a, x, w->cols, n);
        return;
    }
    s_prof_begin(c);
    const __half *wh = cw->h;
    if (!wh) {
        /* quantised mode, many tokens: dequantise into the scratch */
        size_t elems = (size_t)w->rows * w->cols;
        if (s_grow(c, (void **)&c->wscratch, &c->wscratch_elems, elems, sizeof(__half),
                   "cudaMalloc (weight scratch)"))
            return;
        k_dequant_f16<<<s_blocks(elems, S_THREADS), S_THREADS, 0, c->stream>>>(
            c->wscratch, cw->q, (int)w->type, w->rows, w->cols, w->row_bytes);
        s_launched(c, "k_dequant_f16");
        wh = c->wscratch;
    }
    size_t xe = (size_t)n * w->cols;
    if (s_grow(c, (void **)&c->xh, &c->xh_elems, xe, sizeof(__half), "cudaMalloc (fp16 activations)"))
        return;
    k_to_half<<<s_blocks(xe, S_THREADS), S_THREADS, 0, c->stream>>>(c->xh, x, xe);
    s_launched(c, "k_to_half");
    s_gemm(c, y, wh, c->xh, w->rows, n, w->cols);
    s_prof_end(c, S_OP_GEMM);
}

static void s_matmul(void *ctx, float *y, const fi_weight *w, const float *x, int n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || n <= 0)
        return;
    S_NOTE(c, S_OP_GEMM, S_P(y), S_P(w->dev), (uint64_t)w->rows, (uint64_t)w->cols, S_P(x),
           (uint64_t)n);
    s_matmul_do(c, y, w, x, n);
}

static void s_matmul_n_do(s_cuda *c, int count, float *const *y, const fi_weight *const *w,
                          const float *x, int n, int all);

/* y[i] = W[i] x: one k_matvec launch when it takes every product, else
 * each as matmul does it (so the same bits either way). */
static void s_matmul_n(void *ctx, int count, float *const *y, const fi_weight *const *w,
                       const float *x, int n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || n <= 0 || count <= 0)
        return;
    if (count > FI_MATMUL_N_MAX) {
        s_set_err(c, "cuda: matmul_n: %s%s", "more products than FI_MATMUL_N_MAX", "");
        return;
    }
    uint64_t v[2 + 3 * FI_MATMUL_N_MAX + 2];
    int nv = 0, all = 1;
    v[nv++] = (uint64_t)count;
    for (int i = 0; i < count; i++) {
        v[nv++] = S_P(y[i]);
        v[nv++] = S_P(w[i]->dev);
        v[nv++] = (uint64_t)w[i]->rows << 32 | (uint32_t)w[i]->cols;
        all = all && w[i]->cols == w[0]->cols && s_mv_takes(c, w[i], x, n);
    }
    v[nv++] = S_P(x);
    v[nv++] = (uint64_t)n;
    if (s_note(c, S_REC_MATMUL_N, v, nv))
        return;
    s_matmul_n_do(c, count, y, w, x, n, all);
}

/* matmul_n after the note; all: k_matvec takes every product. */
static void s_matmul_n_do(s_cuda *c, int count, float *const *y, const fi_weight *const *w,
                          const float *x, int n, int all) {
    if (!all) {
        for (int i = 0; i < count; i++)
            s_matmul_do(c, y[i], w[i], x, n);
        return;
    }
    s_mv_args a;
    memset(&a, 0, sizeof a);
    for (int i = 0; i < count; i++)
        s_mv_add(&a, i, w[i], y[i]);
    s_mv_launch(c, &a, x, w[0]->cols, n);
}

/* acc += W x through y, in the product's launch where k_matvec takes it. */
static void s_matmul_add(void *ctx, float *acc, float *y, const fi_weight *w, const float *x,
                         int n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || n <= 0)
        return;
    S_NOTE(c, S_REC_MATMUL_ADD, S_P(acc), S_P(y), S_P(w->dev), (uint64_t)w->rows,
           (uint64_t)w->cols, S_P(x), (uint64_t)n);
    if (!s_mv_takes(c, w, x, n)) {
        s_matmul_do(c, y, w, x, n);
        s_add_do(c, acc, y, (size_t)n * w->rows);
        return;
    }
    s_mv_args a;
    memset(&a, 0, sizeof a);
    s_mv_add(&a, 0, w, y);
    a.acc = acc;
    s_mv_launch(c, &a, x, w->cols, n);
}

/* --- small ops --------------------------------------------------------- */

static void s_get_rows(void *ctx, float *y, const fi_weight *w, const int32_t *tok, int n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || n <= 0)
        return;
    const s_cweight *cw = (const s_cweight *)w->dev;
    if (!cw) {
        s_set_err(c, "cuda: %s%s", "get_rows on a weight that was not uploaded", "");
        return;
    }
    S_NOTE(c, S_OP_GET_ROWS, S_P(y), S_P(cw), S_P(tok), (uint64_t)n);
    size_t total = (size_t)n * w->cols;
    s_prof_begin(c);
    k_get_rows<<<s_blocks(total, S_THREADS), S_THREADS, 0, c->stream>>>(
        y, cw->h, cw->q, (int)w->type, w->cols, w->row_bytes, tok, n);
    s_launched(c, "k_get_rows");
    s_prof_end(c, S_OP_GET_ROWS);
}

static void s_rmsnorm_do(s_cuda *c, float *y, const float *x, const float *g, int n, int dim,
                         float eps);

static void s_rmsnorm(void *ctx, float *y, const float *x, const float *g, int n, int dim,
                      float eps) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || n <= 0)
        return;
    S_NOTE(c, S_OP_RMSNORM, S_P(y), S_P(x), S_P(g), (uint64_t)n, (uint64_t)dim, s_fbits(eps));
    s_rmsnorm_do(c, y, x, g, n, dim, eps);
}

static void s_rmsnorm_do(s_cuda *c, float *y, const float *x, const float *g, int n, int dim,
                         float eps) {
    s_prof_begin(c);
    k_rmsnorm<<<(unsigned)n, s_norm_threads_dev(dim), 0, c->stream>>>(y, x, g, dim, eps);
    s_launched(c, "k_rmsnorm");
    s_prof_end(c, S_OP_RMSNORM);
}

/* The angles' table for (head_dim, theta), (re)made outside a graph;
 * NULL when there is none for this pair (inside a graph, or on a failure):
 * the kernels then compute their own, the same values. */
static const float2 *s_rope_table(s_cuda *c, int head_dim, float theta) {
    if (!c->capturing && head_dim >= 2 && (c->rope_hd != head_dim || c->rope_theta != theta)) {
        size_t elems = (size_t)S_ROPE_POS * (head_dim / 2);
        c->rope_hd = 0;
        if (s_grow(c, (void **)&c->rope_tab, &c->rope_elems, elems, sizeof(float2),
                   "cudaMalloc (rope table)"))
            return NULL;
        c->gen++; /* recorded graphs read the old contents */
        k_rope_table<<<s_blocks(elems, S_THREADS), S_THREADS, 0, c->stream>>>(c->rope_tab, head_dim, theta);
        s_launched(c, "k_rope_table");
        c->rope_hd = head_dim;
        c->rope_theta = theta;
    }
    return c->rope_hd == head_dim && c->rope_theta == theta ? c->rope_tab : NULL;
}

static void s_rope(void *ctx, float *x, int n, int n_heads, int head_dim, const int32_t *pos,
                   float theta) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || n <= 0)
        return;
    const float2 *tab = s_rope_table(c, head_dim, theta);
    if (c->failed)
        return;
    S_NOTE(c, S_OP_ROPE, S_P(x), (uint64_t)n, (uint64_t)n_heads, (uint64_t)head_dim, S_P(pos),
           s_fbits(theta), S_P(tab));
    size_t total = (size_t)n * (head_dim / 2);
    s_prof_begin(c);
    k_rope<<<s_blocks(total, 128), 128, 0, c->stream>>>(x, n, n_heads, head_dim, pos, theta, tab);
    s_launched(c, "k_rope");
    s_prof_end(c, S_OP_ROPE);
}

/* Attention through k_attention_g (see the kernel), after the checks. */
static void s_attention_g(s_cuda *c, float *out, const float *q, const uint16_t *k,
                          const uint16_t *v, int n, const int32_t *pos, const fi_kv_map *map,
                          int n_heads, int n_kv_heads, int head_dim) {
    long items = (long)n * n_kv_heads;
    int split = 1;
    if (items < 2L * c->n_sm) {
        split = (int)((2L * c->n_sm + items - 1) / items);
        if (split > S_ATT_MAX_SPLIT)
            split = S_ATT_MAX_SPLIT;
    }
    if (split > 1) {
        size_t had = c->att_count_elems;
        if (s_grow(c, (void **)&c->att_part, &c->att_part_floats,
                   (size_t)n * n_heads * split * (size_t)(head_dim + 2), sizeof(float),
                   "cudaMalloc (attention partials)") ||
            s_grow(c, (void **)&c->att_count, &c->att_count_elems, (size_t)items,
                   sizeof(unsigned), "cudaMalloc (attention counters)"))
            return;
        /* counters start at 0; each launch's merging blocks leave them so */
        if (c->att_count_elems != had &&
            !s_ok(c, cudaMemsetAsync(c->att_count, 0, c->att_count_elems * sizeof(unsigned), c->stream),
                  "cudaMemsetAsync (attention counters)"))
            return;
    }
    s_prof_begin(c);
    dim3 grid((unsigned)items, (unsigned)split);
#define S_AG_LAUNCH(hd, gm)                                                                \
    k_attention_g<hd, gm><<<grid, S_AG_THREADS, 0, c->stream>>>(                          \
        out, c->att_part, c->att_count, q, k, v, pos, map->seq, map->tables, map->max_blocks, \
        map->block_size, n_heads, n_kv_heads)
    int g4 = n_heads / n_kv_heads <= 4;
    if (head_dim == 32)
        g4 ? S_AG_LAUNCH(32, 4) : S_AG_LAUNCH(32, 8);
    else if (head_dim == 64)
        g4 ? S_AG_LAUNCH(64, 4) : S_AG_LAUNCH(64, 8);
    else
        g4 ? S_AG_LAUNCH(128, 4) : S_AG_LAUNCH(128, 8);
#undef S_AG_LAUNCH
    s_launched(c, "k_attention_g");
    s_prof_end(c, S_OP_ATTENTION);
}

static void s_attention(void *ctx, float *out, const float *q, const void *kp, const void *vp,
                        int n, const int32_t *pos, const fi_kv_map *map, int n_heads,
                        int n_kv_heads, int head_dim) {
    s_cuda *c = (s_cuda *)ctx;
    const uint16_t *k = (const uint16_t *)kp, *v = (const uint16_t *)vp; /* FI_KV_ROW_F16 */
    if (!s_enter(c) || n <= 0)
        return;
    if (head_dim > S_ATT_MAX_HD) {
        char hd[32];
        snprintf(hd, sizeof hd, "%d", head_dim);
        s_set_err(c, "cuda: attention: head_dim %s is larger than the kernel's %s", hd, "256");
        return;
    }
    S_NOTE(c, S_OP_ATTENTION, S_P(out), S_P(q), S_P(k), S_P(v), (uint64_t)n, S_P(pos),
           S_P(map->seq), S_P(map->tables), (uint64_t)map->max_blocks,
           (uint64_t)map->block_size, (uint64_t)n_heads << 32 | (uint32_t)n_kv_heads,
           (uint64_t)head_dim);
    int G = n_kv_heads > 0 ? n_heads / n_kv_heads : 0;
    if (c->att_g && (head_dim == 32 || head_dim == 64 || head_dim == 128) && G >= 1 &&
        G <= S_AG_MAX_G && G * n_kv_heads == n_heads && (uintptr_t)k % 16 == 0 &&
        (uintptr_t)v % 16 == 0) {
        s_attention_g(c, out, q, k, v, n, pos, map, n_heads, n_kv_heads, head_dim);
        return;
    }
    long items = (long)n * n_heads;
    int split = 1;
    if (items < 2L * c->n_sm) {
        split = (int)((2L * c->n_sm + items - 1) / items);
        if (split > S_ATT_MAX_SPLIT)
            split = S_ATT_MAX_SPLIT;
    }
    if (split > 1 &&
        s_grow(c, (void **)&c->att_part, &c->att_part_floats,
               (size_t)items * split * (size_t)(head_dim + 2), sizeof(float),
               "cudaMalloc (attention partials)"))
        return;
    s_prof_begin(c);
    dim3 grid((unsigned)items, (unsigned)split);
    k_attention<<<grid, S_ATT_WARPS * 32, 0, c->stream>>>(
        out, c->att_part, q, k, v, pos, map->seq, map->tables, map->max_blocks, map->block_size,
        n_heads, n_kv_heads, head_dim);
    s_launched(c, "k_attention");
    if (split > 1) {
        k_attention_merge<<<(unsigned)items, head_dim >= 128 ? 128 : 64, 0, c->stream>>>(
            out, c->att_part, n_heads, head_dim, split);
        s_launched(c, "k_attention_merge");
    }
    s_prof_end(c, S_OP_ATTENTION);
}

static void s_store_f16(void *ctx, uint16_t *dst, const float *src, size_t n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || !n)
        return;
    S_NOTE(c, S_REC_STORE_F16, S_P(dst), S_P(src), (uint64_t)n);
    s_prof_begin(c);
    k_store_f16<<<s_blocks(n, S_THREADS), S_THREADS, 0, c->stream>>>(dst, src, n);
    s_launched(c, "k_store_f16");
    s_prof_end(c, S_OP_KV_STORE);
}

/* One thread per element; row t of src goes to cache row slot[t]. */
__global__ static void k_kv_store(uint16_t *cache, const float *src, int n, const int32_t *slot,
                                  int row) {
    size_t total = (size_t)n * row;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / row, e = i % row;
        cache[(size_t)slot[t] * row + e] = __half_as_ushort(__float2half_rn(src[i]));
    }
}

static void s_kv_store(void *ctx, void *cp, const float *src, int n, const int32_t *slot, int row,
                       int head_dim) {
    s_cuda *c = (s_cuda *)ctx;
    uint16_t *cache = (uint16_t *)cp; /* FI_KV_ROW_F16: whole rows, head_dim not needed */
    (void)head_dim;
    if (!s_enter(c) || n <= 0 || row <= 0)
        return;
    S_NOTE(c, S_OP_KV_STORE, S_P(cache), S_P(src), (uint64_t)n, S_P(slot), (uint64_t)row);
    size_t total = (size_t)n * row;
    s_prof_begin(c);
    k_kv_store<<<s_blocks(total, S_THREADS), S_THREADS, 0, c->stream>>>(cache, src, n, slot, row);
    s_launched(c, "k_kv_store");
    s_prof_end(c, S_OP_KV_STORE);
}

static void s_swiglu_do(s_cuda *c, float *g, const float *u, size_t n);

static void s_swiglu(void *ctx, float *g, const float *u, size_t n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || !n)
        return;
    S_NOTE(c, S_OP_SWIGLU, S_P(g), S_P(u), (uint64_t)n);
    s_swiglu_do(c, g, u, n);
}

static void s_swiglu_do(s_cuda *c, float *g, const float *u, size_t n) {
    s_prof_begin(c);
    k_swiglu<<<s_blocks(n, S_THREADS), S_THREADS, 0, c->stream>>>(g, u, n);
    s_launched(c, "k_swiglu");
    s_prof_end(c, S_OP_SWIGLU);
}

static void s_add(void *ctx, float *y, const float *x, size_t n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || !n)
        return;
    S_NOTE(c, S_OP_ADD, S_P(y), S_P(x), (uint64_t)n);
    s_add_do(c, y, x, n);
}

static int s_argmax(void *ctx, int32_t *out, const float *x, int n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || !s_not_capturing(c, "argmax"))
        return -1;
    s_prof_begin(c);
    k_argmax<<<1, 1024, 0, c->stream>>>(c->arg_dev, x, n);
    s_launched(c, "k_argmax");
    s_prof_end(c, S_OP_ARGMAX);
    if (!s_ok(c, cudaMemcpyAsync(c->arg_host, c->arg_dev, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                 c->stream),
              "cudaMemcpyAsync (argmax)") ||
        !s_ok(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize (argmax)"))
        return -1;
    *out = *c->arg_host;
    return 0;
}

/* --- fused operations (fi_kernels.h: the same bits as the calls they
 * replace) --------------------------------------------------------------- */

/* Whether k_matvec can normalise x on the fly for these products. */
static int s_mv_norm_takes(const s_cuda *c, int count, const fi_weight *const *w, const float *x,
                           const float *g, int n) {
    if (!c->fused)
        return 0;
    for (int i = 0; i < count; i++)
        if (w[i]->cols != w[0]->cols || !s_mv_takes(c, w[i], x, n))
            return 0;
    /* k_rmsnorm's block is k_matvec's (256 threads) below 1024 columns */
    return (uintptr_t)g % 16 == 0 && (uintptr_t)x % 16 == 0 && w[0]->cols % 8 == 0 &&
           w[0]->cols < 1024 && s_norm_threads_dev(w[0]->cols) == S_MV_THREADS;
}

static void s_norm_matmul_n(void *ctx, int count, float *const *y, const fi_weight *const *w,
                            float *xn, const float *x, const float *g, float eps, int n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || n <= 0 || count <= 0)
        return;
    if (count > FI_MATMUL_N_MAX) {
        s_set_err(c, "cuda: norm_matmul_n: %s%s", "more products than FI_MATMUL_N_MAX", "");
        return;
    }
    for (int i = 0; i < count; i++)
        if (!w[i]->dev) {
            s_set_err(c, "cuda: %s%s", "norm_matmul_n on a weight that was not uploaded", "");
            return;
        }
    uint64_t v[1 + 3 * FI_MATMUL_N_MAX + 5];
    int nv = 0;
    v[nv++] = (uint64_t)count;
    for (int i = 0; i < count; i++) {
        v[nv++] = S_P(y[i]);
        v[nv++] = S_P(w[i]->dev);
        v[nv++] = (uint64_t)w[i]->rows << 32 | (uint32_t)w[i]->cols;
    }
    v[nv++] = S_P(xn);
    v[nv++] = S_P(x);
    v[nv++] = S_P(g);
    v[nv++] = s_fbits(eps);
    v[nv++] = (uint64_t)n;
    if (s_note(c, S_REC_NORM_MATMUL_N, v, nv))
        return;
    int cols = w[0]->cols;
    if (!s_mv_norm_takes(c, count, w, x, g, n)) {
        s_rmsnorm_do(c, xn, x, g, n, cols, eps);
        int all = 1;
        for (int i = 0; i < count; i++)
            all = all && w[i]->cols == cols && s_mv_takes(c, w[i], xn, n);
        s_matmul_n_do(c, count, y, w, xn, n, all);
        return;
    }
    s_mv_args a;
    memset(&a, 0, sizeof a);
    for (int i = 0; i < count; i++)
        s_mv_add(&a, i, w[i], y[i]);
    a.g = g;
    a.eps = eps;
    s_mv_launch(c, &a, x, cols, n);
}

static void s_norm_matmul_swiglu(void *ctx, float *h, float *u, const fi_weight *wg,
                                 const fi_weight *wu, float *xn, const float *x, const float *g,
                                 float eps, int n) {
    s_cuda *c = (s_cuda *)ctx;
    if (!s_enter(c) || n <= 0)
        return;
    if (!wg->dev || !wu->dev) {
        s_set_err(c, "cuda: %s%s", "norm_matmul_swiglu on a weight that was not uploaded", "");
        return;
    }
    S_NOTE(c, S_REC_NORM_MATMUL_SWIGLU, S_P(h), S_P(u), S_P(wg->dev), S_P(wu->dev),
           (uint64_t)wg->rows << 32 | (uint32_t)wg->cols,
           (uint64_t)wu->rows << 32 | (uint32_t)wu->cols, S_P(xn), S_P(x), S_P(g), s_fbits(eps),
           (uint64_t)n);
    const fi_weight *w[2] = {wg, wu};
    float *y[2] = {h, u};
    if (wg->rows != wu->rows || !s_mv_norm_takes(c, 2, w, x, g, n)) {
        s_rmsnorm_do(c, xn, x, g, n, wg->cols, eps);
        int all = wg->cols == wu->cols && s_mv_takes(c, wg, xn, n) && s_mv_takes(c, wu, xn, n);
        s_matmul_n_do(c, 2, y, w, xn, n, all);
        s_swiglu_do(c, h, u, (size_t)n * wg->rows);
        return;
    }
    s_mv_args a;
    memset(&a, 0, sizeof a);
    s_mv_add(&a, 0, wg, h);
    s_mv_add(&a, 1, wu, u);
    a.end[0] = a.end[1] = wg->rows; /* one warp per row pair */
    a.count = 2;
    a.swiglu = 1;
    a.g = g;
    a.eps = eps;
    s_mv_launch(c, &a, x, wg->cols, n);
}

static void s_rope_store(void *ctx, float *q, float *k, const float *v, void *kcp, void *vcp,
                         int n, int n_heads, int n_kv_heads, int head_dim, const int32_t *pos,
                         float theta, const int32_t *slot) {
    s_cuda *c = (s_cuda *)ctx;
    uint16_t *kc = (uint16_t *)kcp, *vc = (uint16_t *)vcp; /* FI_KV_ROW_F16 */
    if (!s_enter(c) || n <= 0 || head_dim < 2)
        return;
    const float2 *tab = s_rope_table(c, head_dim, theta);
    if (c->failed)
        return;
    S_NOTE(c, S_REC_ROPE_STORE, S_P(q), S_P(k), S_P(v), S_P(kc), S_P(vc), (uint64_t)n,
           (uint64_t)n_heads << 32 | (uint32_t)n_kv_heads, (uint64_t)head_dim, S_P(pos),
           s_fbits(theta), S_P(tab), S_P(slot));
    size_t n_rot = (size_t)n * (head_dim / 2), n_v = (size_t)n * (n_kv_heads * head_dim / 2);
    size_t total = n_rot > n_v ? n_rot : n_v;
    if (!c->fused) { /* the four launches it replaces */
        int kv_dim = n_kv_heads * head_dim;
        s_prof_begin(c);
        k_rope<<<s_blocks(n_rot, 128), 128, 0, c->stream>>>(q, n, n_heads, head_dim, pos, theta, tab);
        s_launched(c, "k_rope");
        k_rope<<<s_blocks(n_rot, 128), 128, 0, c->stream>>>(k, n, n_kv_heads, head_dim, pos, theta, tab);
        s_launched(c, "k_rope");
        s_prof_end(c, S_OP_ROPE);
        s_prof_begin(c);
        k_kv_store<<<s_blocks((size_t)n * kv_dim, S_THREADS), S_THREADS, 0, c->stream>>>(kc, k, n, slot, kv_dim);
        s_launched(c, "k_kv_store");
        k_kv_store<<<s_blocks((size_t)n * kv_dim, S_THREADS), S_THREADS, 0, c->stream>>>(vc, v, n, slot, kv_dim);
        s_launched(c, "k_kv_store");
        s_prof_end(c, S_OP_KV_STORE);
        return;
    }
    s_prof_begin(c);
    k_rope_store<<<s_blocks(total, 128), 128, 0, c->stream>>>(
        q, k, v, kc, vc, n, n_heads, n_kv_heads, head_dim, pos, theta, tab, slot);
    s_launched(c, "k_rope_store");
    s_prof_end(c, S_OP_ROPE);
}

/* --- graphs ------------------------------------------------------------ */

/* graph_begin, and graph_begin_sig with a signature (sig_len > 0): a
 * relaunch when it equals that of the key's recording and c->gen has not
 * moved since. */
static int s_graph_start(s_cuda *c, int key, size_t upload, const void *sig, size_t sig_len) {
    if (!c->graphs || c->profile || c->capturing || key < 1 || key > S_GRAPH_KEYS ||
        upload > S_STAGE_BYTES - S_STAGE_SLACK || sig_len > FI_GRAPH_SIG_MAX || !s_enter(c))
        return -1;
    if (!c->key_seen[key]) {
        c->key_seen[key] = 1; /* this step directly: see the header */
        return -1;
    }
    /* the previous graph may still read the staging buffer */
    if (c->graph_launched &&
        !s_ok(c, cudaEventSynchronize(c->graph_done), "cudaEventSynchronize (graph)"))
        return -1;
    c->stage_used = 0;
    c->hash = 14695981039346656037ull;
    c->calls = 0;
    c->key = key;
    if (sig_len && c->replay && c->exec[key] && c->rec[key].sig_len == sig_len && c->rec[key].gen == c->gen &&
        !memcmp(c->rec[key].sig, sig, sig_len)) {
        c->replaying = 1;
        c->capturing = 1; /* the same rules as a recording */
        return 0;
    }
    c->rec[key].sig_len = 0; /* the key's graph is about to change */
    if (!s_ok(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal),
              "cudaStreamBeginCapture"))
        return -1;
    if (sig_len)
        memcpy(c->pending_sig, sig, sig_len);
    c->pending_sig_len = sig_len;
    c->capturing = 1;
    return 0;
}

static int s_graph_begin(void *ctx, int key, size_t upload) {
    return s_graph_start((s_cuda *)ctx, key, upload, NULL, 0);
}

static int s_graph_begin_sig(void *ctx, int key, size_t upload, const void *sig, size_t sig_len) {
    return s_graph_start((s_cuda *)ctx, key, upload, sig, sig_len);
}

/* Keeps the signature, calls and hash of the key's new recording. */
static void s_cuda_rec_keep(s_cuda *c) {
    int k = c->key;
    c->rec[k].sig_len = c->pending_sig_len;
    if (c->pending_sig_len)
        memcpy(c->rec[k].sig, c->pending_sig, c->pending_sig_len);
    c->rec[k].gen = c->gen;
    c->rec[k].hash = c->hash;
    c->rec[k].calls = c->calls;
}

/* Launches the key's executable graph after a recording or a relaunch. */
static int s_graph_launch(s_cuda *c) {
    if (!s_ok(c, cudaGraphLaunch(c->exec[c->key], c->stream), "cudaGraphLaunch") ||
        !s_ok(c, cudaEventRecord(c->graph_done, c->stream), "cudaEventRecord (graph)"))
        return -1;
    c->graph_launched = 1;
    c->n_graphs++;
    return 0;
}

static int s_graph_end(void *ctx) {
    s_cuda *c = (s_cuda *)ctx;
    if (!c->capturing)
        return -1;
    c->capturing = 0;
    (void)cudaSetDevice(c->device);
    if (c->replaying) {
        c->replaying = 0;
        if (c->failed)
            return -1;
        if (c->hash != c->rec[c->key].hash || c->calls != c->rec[c->key].calls) {
            char key[32];
            snprintf(key, sizeof key, "%d", c->key);
            c->rec[c->key].sig_len = 0;
            s_set_err(c, "cuda: graph replay of key %s: %s", key,
                      "the calls differ from the recording with the same signature (nothing ran)");
            return -1;
        }
        if (s_graph_launch(c))
            return -1;
        c->n_replays++;
        return 0;
    }
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (!s_ok(c, e, "cudaStreamEndCapture") || c->failed) {
        /* what was recorded never ran: the pass is lost, and says so */
        s_set_err(c, "cuda: %s%s", "a failure during graph capture", "");
        if (g)
            (void)cudaGraphDestroy(g);
        return -1;
    }
    cudaGraphExec_t *ex = &c->exec[c->key];
    if (*ex) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(*ex, g, &info) != cudaSuccess) {
            (void)cudaGetLastError(); /* not an error: the shape changed */
            (void)cudaGraphExecDestroy(*ex);
            *ex = NULL;
        }
    }
    if (!*ex) {
        if (!s_ok(c, cudaGraphInstantiate(ex, g, 0), "cudaGraphInstantiate")) {
            *ex = NULL;
            (void)cudaGraphDestroy(g);
            return -1;
        }
        c->n_instantiated++;
    }
    (void)cudaGraphDestroy(g);
    if (s_graph_launch(c))
        return -1;
    s_cuda_rec_keep(c);
    return 0;
}

/* --- backend ----------------------------------------------------------- */

static void s_destroy(void *ctx) {
    s_cuda *c = (s_cuda *)ctx;
    if (!c)
        return;
    (void)cudaSetDevice(c->device);
    if (c->capturing && !c->replaying) {
        cudaGraph_t g = NULL;
        if (cudaStreamEndCapture(c->stream, &g) == cudaSuccess && g)
            (void)cudaGraphDestroy(g);
        c->capturing = 0;
    }
    if (c->stream)
        (void)cudaStreamSynchronize(c->stream);
    for (int k = 0; k <= S_GRAPH_KEYS; k++)
        if (c->exec[k])
            (void)cudaGraphExecDestroy(c->exec[k]);
    if (c->graph_done)
        (void)cudaEventDestroy(c->graph_done);
    if (c->stage)
        (void)cudaFreeHost(c->stage);
    for (int i = 0; i < c->n_plans; i++)
        s_plan_free(&c->plans[i]);
    if (c->lt)
        cublasLtDestroy(c->lt);
    void *bufs[] = {c->workspace, c->xh, c->wscratch, c->att_part, c->arg_dev, c->att_count,
                    c->rope_tab};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            (void)cudaFree(bufs[i]);
    if (c->arg_host)
        (void)cudaFreeHost(c->arg_host);
    if (c->ev) {
        for (int i = 0; i < 2 * S_PROF_PAIRS; i++)
            if (c->ev[i])
                (void)cudaEventDestroy(c->ev[i]);
        free(c->ev);
    }
    free(c->ev_op);
    if (c->stream)
        (void)cudaStreamDestroy(c->stream);
    free(c);
}

static const fi_backend_ops s_cuda_ops = {
    /* .name = */ "cuda",
    /* .destroy = */ s_destroy,
    /* .alloc = */ s_alloc,
    /* .free = */ s_free,
    /* .to_backend = */ s_to_backend,
    /* .to_host = */ s_to_host,
    /* .copy = */ s_copy,
    /* .weight_upload = */ s_weight_upload,
    /* .weight_release = */ s_weight_release,
    /* .sync = */ s_sync,
    /* .matmul = */ s_matmul,
    /* .get_rows = */ s_get_rows,
    /* .rmsnorm = */ s_rmsnorm,
    /* .rope = */ s_rope,
    /* .attention = */ s_attention,
    /* .store_f16 = */ s_store_f16,
    /* .swiglu = */ s_swiglu,
    /* .add = */ s_add,
    /* .last_error = */ s_last_error,
    /* .argmax = */ s_argmax,
    /* .graph_begin = */ s_graph_begin,
    /* .graph_end = */ s_graph_end,
    /* .kv_store = */ s_kv_store,
    /* .matmul_n = */ s_matmul_n,
    /* .host_memory = */ 0,
    /* .matmul_add = */ s_matmul_add,
    /* .matmul_argmax = */ NULL, /* matmul, then the engine's argmax of the host logits */
    /* .graph_begin_sig = */ s_graph_begin_sig,
    /* .norm_matmul_n = */ s_norm_matmul_n,
    /* .norm_matmul_swiglu = */ s_norm_matmul_swiglu,
    /* .rope_store = */ s_rope_store,
};

extern "C" int fi_cuda_device_count(char *err, size_t errlen) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (err && errlen)
            snprintf(err, errlen, "%s", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return -1;
    }
    if (n < 1) {
        if (err && errlen)
            snprintf(err, errlen, "no CUDA-capable device is detected");
        return -1;
    }
    return n;
}

extern "C" fi_backend *fi_cuda_backend_new(int device, char *err, size_t errlen) {
    char msg[256];
    int n = fi_cuda_device_count(msg, sizeof msg);
    if (n < 0) {
        snprintf(err, errlen, "%s", msg);
        return NULL;
    }
    if (device < 0 || device >= n) {
        snprintf(err, errlen, "CUDA device %d does not exist (%d device%s)", device, n,
                 n == 1 ? "" : "s");
        return NULL;
    }
    s_cuda *c = (s_cuda *)calloc(1, sizeof *c);
    fi_backend *b = (fi_backend *)calloc(1, sizeof *b);
    cudaDeviceProp prop;
    const char *env = getenv("FEDINFER_CUDA_WEIGHTS"), *genv = NULL;
    if (!c || !b) {
        snprintf(err, errlen, "cuda backend: out of host memory");
        goto fail;
    }
    c->device = device;
    if (env && *env && strcmp(env, "f16") && strcmp(env, "quant")) {
        snprintf(err, errlen, "FEDINFER_CUDA_WEIGHTS must be 'f16' or 'quant', not '%.32s'", env);
        goto fail;
    }
    c->mode = env && !strcmp(env, "quant") ? FI_CUDA_WEIGHTS_QUANT : FI_CUDA_WEIGHTS_F16;
    genv = getenv("FEDINFER_CUDA_GRAPHS");
    if (genv && *genv && strcmp(genv, "0") && strcmp(genv, "1")) {
        snprintf(err, errlen, "FEDINFER_CUDA_GRAPHS must be '0' or '1', not '%.32s'", genv);
        goto fail;
    }
    c->graphs = !(genv && !strcmp(genv, "0"));
    /* the newer kernels, each with a switch back for comparisons */
    {
        const char *names[] = {"FEDINFER_CUDA_MATVEC", "FEDINFER_CUDA_ATTN_G", "FEDINFER_CUDA_REPLAY",
                               "FEDINFER_CUDA_FUSED", "FEDINFER_CUDA_MV_PRE"};
        int *flags[] = {&c->matvec, &c->att_g, &c->replay, &c->fused, &c->mv_pre};
        for (int i = 0; i < 5; i++) {
            const char *e = getenv(names[i]);
            if (e && *e && strcmp(e, "0") && strcmp(e, "1")) {
                snprintf(err, errlen, "%s must be '0' or '1', not '%.32s'", names[i], e);
                goto fail;
            }
            *flags[i] = !(e && !strcmp(e, "0"));
        }
    }
    if (!s_ok(c, cudaSetDevice(device), "cudaSetDevice") ||
        !s_ok(c, cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties") ||
        !s_ok(c, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "cudaStreamCreate") ||
        !s_ok(c, cudaMalloc(&c->workspace, S_WORKSPACE_BYTES), "cudaMalloc (cuBLASLt workspace)") ||
        !s_ok(c, cudaMalloc((void **)&c->arg_dev, sizeof(int32_t)), "cudaMalloc (argmax)") ||
        !s_ok(c, cudaMallocHost((void **)&c->arg_host, sizeof(int32_t)), "cudaMallocHost (argmax)") ||
        !s_ok(c, cudaMallocHost((void **)&c->stage, S_STAGE_BYTES), "cudaMallocHost (staging)") ||
        !s_ok(c, cudaEventCreateWithFlags(&c->graph_done, cudaEventDisableTiming), "cudaEventCreate") ||
        !s_lt_ok(c, cublasLtCreate(&c->lt), "cublasLtCreate")) {
        snprintf(err, errlen, "%s", c->err);
        goto fail;
    }
    snprintf(c->name, sizeof c->name, "%s", prop.name);
    c->n_sm = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
    /* what a one-token step needs, so that a graph capture never allocates:
     * fp16 activations for a row of up to S_XH_MIN elements, and attention
     * partials (fewer than 4 * n_sm (token, head, split) blocks) */
    if (s_grow(c, (void **)&c->xh, &c->xh_elems, S_XH_MIN, sizeof(__half), "cudaMalloc (fp16 activations)") ||
        s_grow(c, (void **)&c->att_part, &c->att_part_floats, (size_t)4 * c->n_sm * (S_ATT_MAX_HD + 2),
               sizeof(float), "cudaMalloc (attention partials)") ||
        s_grow(c, (void **)&c->att_count, &c->att_count_elems, (size_t)4 * c->n_sm, sizeof(unsigned),
               "cudaMalloc (attention counters)") ||
        !s_ok(c, cudaMemsetAsync(c->att_count, 0, c->att_count_elems * sizeof(unsigned), c->stream),
              "cudaMemsetAsync (attention counters)")) {
        snprintf(err, errlen, "%s", c->err);
        goto fail;
    }
    b->ops = &s_cuda_ops;
    b->ctx = c;
    return b;
fail:
    s_destroy(c);
    free(b);
    return NULL;
}

extern "C" int fi_cuda_backend_is(const fi_backend *b) {
    return b && b->ops == &s_cuda_ops;
}

extern "C" const char *fi_cuda_backend_device_name(const fi_backend *b) {
    return fi_cuda_backend_is(b) ? ((const s_cuda *)b->ctx)->name : NULL;
}

extern "C" int fi_cuda_backend_set_weights(fi_backend *b, fi_cuda_weights mode) {
    if (!fi_cuda_backend_is(b) || (mode != FI_CUDA_WEIGHTS_F16 && mode != FI_CUDA_WEIGHTS_QUANT))
        return -1;
    s_cuda *c = (s_cuda *)b->ctx;
    if (c->uploaded)
        return -1;
    c->mode = mode;
    return 0;
}

extern "C" fi_cuda_weights fi_cuda_backend_weights(const fi_backend *b) {
    return fi_cuda_backend_is(b) ? ((const s_cuda *)b->ctx)->mode : FI_CUDA_WEIGHTS_F16;
}

extern "C" int fi_cuda_backend_set_profile(fi_backend *b, int on) {
    if (!fi_cuda_backend_is(b))
        return -1;
    s_cuda *c = (s_cuda *)b->ctx;
    if (!s_enter(c))
        return -1;
    if (on && !c->ev) {
        c->ev = (cudaEvent_t *)calloc(2 * S_PROF_PAIRS, sizeof *c->ev);
        c->ev_op = (uint8_t *)calloc(S_PROF_PAIRS, 1);
        if (!c->ev || !c->ev_op) { /* both or neither: s_prof_end writes ev_op */
            free(c->ev);
            free(c->ev_op);
            c->ev = NULL;
            c->ev_op = NULL;
            return -1;
        }
        for (int i = 0; i < 2 * S_PROF_PAIRS; i++)
            if (!s_ok(c, cudaEventCreate(&c->ev[i]), "cudaEventCreate"))
                return -1;
    }
    if (!on)
        s_prof_flush(c);
    c->profile = on != 0;
    return c->failed ? -1 : 0;
}

/* b's state with every recorded event pair counted in; NULL when b is
 * not a CUDA backend or has failed. */
static s_cuda *s_prof_read(fi_backend *b) {
    if (!fi_cuda_backend_is(b))
        return NULL;
    s_cuda *c = (s_cuda *)b->ctx;
    if (!s_enter(c))
        return NULL;
    s_prof_flush(c);
    return c->failed ? NULL : c;
}

extern "C" double fi_cuda_backend_kernel_ms(fi_backend *b) {
    s_cuda *c = s_prof_read(b);
    if (!c)
        return -1;
    double ms = c->kernel_ms;
    c->kernel_ms = 0;
    return ms;
}

extern "C" int fi_cuda_backend_profile_ops(fi_backend *b, const char **name, double *ms,
                                           long *calls, int cap) {
    s_cuda *c = s_prof_read(b);
    if (!c)
        return -1;
    int n = 0;
    for (int i = 0; i < S_N_OPS && n < cap; i++) {
        if (!c->op_calls[i])
            continue;
        name[n] = s_op_names[i];
        ms[n] = c->op_ms[i];
        calls[n] = c->op_calls[i];
        n++;
    }
    memset(c->op_ms, 0, sizeof c->op_ms);
    memset(c->op_calls, 0, sizeof c->op_calls);
    return n;
}

extern "C" int fi_cuda_backend_set_graphs(fi_backend *b, int on) {
    if (!fi_cuda_backend_is(b))
        return -1;
    ((s_cuda *)b->ctx)->graphs = on != 0;
    return 0;
}

extern "C" long fi_cuda_backend_graph_replays(const fi_backend *b) {
    return fi_cuda_backend_is(b) ? ((const s_cuda *)b->ctx)->n_replays : 0;
}

extern "C" void fi_cuda_backend_graph_stats(const fi_backend *b, long *launched,
                                            long *instantiated) {
    const s_cuda *c = fi_cuda_backend_is(b) ? (const s_cuda *)b->ctx : NULL;
    if (launched)
        *launched = c ? c->n_graphs : 0;
    if (instantiated)
        *instantiated = c ? c->n_instantiated : 0;
}
