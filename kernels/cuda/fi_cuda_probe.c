/*
 * fi_cuda_probe.c - GPU timings for kernels/cuda/gpu-check.sh.
 *
 *   fi_cuda_probe MODEL | --synthetic
 *   fi_cuda_probe --write-synthetic PATH   (writes the model below; no GPU needed)
 *
 * --synthetic writes a random-weight model of the default model's shape
 * (SmolLM2-135M: 30 layers, dim 576, 9/3 heads, ffn 1536, vocab 49152,
 * Q4_1 matrices, tied Q8_0 embeddings) to a temporary file and times that:
 * the same shapes and bytes, for machines the real file cannot reach.
 *
 * Prints a table (one "name | value | note" row per line):
 *   - cuBLASLt throughput (TFLOP/s) through the backend's matmul for the
 *     model's shapes at 1, 32, 256 and 2048 tokens, against the same path on
 *     an 8192^3 product (the card's measured fp16 peak here);
 *   - prefill tokens/s for a 2048-token prompt;
 *   - decode tokens/s at batch 1 in both weight modes (fp16, quantised
 *     read), wall time per token with and without CUDA graphs against the
 *     sum of kernel times from CUDA events (the launch-overhead gap);
 *   - a 32-token step as the proxy for batch-32 decode (bench --serve
 *     measures real batched decode);
 *   in four configurations: fp16 weights, quantised weights, fp16 with the
 *   first version's path (every FEDINFER_CUDA_* kernel switch off), and
 *   fp16 without k_matvec's early loads (FEDINFER_CUDA_MV_PRE=0).
 * Without a device prints "SKIPPED: no CUDA device (...)" and exits 77.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <unistd.h>

#include "fi_cuda.h"
#include "fi_model.h"
#include "gguf_writer.h"

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void s_row(const char *name, const char *value, const char *note) {
    printf("| %-34s | %-22s | %s\n", name, value, note);
}

/* TFLOP/s of y = x . W^T for a rows x cols fp16 weight and n tokens;
 * -1 on error (printed). */
static double s_gemm_tflops(fi_backend *b, int rows, int cols, int n) {
    const fi_backend_ops *o = b->ops;
    size_t we = (size_t)rows * cols;
    uint16_t *wh = malloc(we * sizeof *wh);
    float *xh = malloc((size_t)n * cols * sizeof *xh);
    double tf = -1;
    float *x = NULL, *y = NULL;
    fi_weight w = {0};
    if (!wh || !xh)
        goto done;
    uint32_t s = 12345;
    for (size_t i = 0; i < we; i++) {
        s = s * 1664525u + 1013904223u;
        wh[i] = fi_fp32_to_fp16(((float)(s >> 8) / 16777216.0f - 0.5f) * 0.1f);
    }
    for (size_t i = 0; i < (size_t)n * cols; i++)
        xh[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    w.data = wh;
    w.type = FI_DTYPE_F16;
    w.rows = rows;
    w.cols = cols;
    w.row_bytes = (size_t)cols * 2;
    if (o->weight_upload(b->ctx, &w) != 0)
        goto done;
    x = o->alloc(b->ctx, (size_t)n * cols * sizeof(float));
    y = o->alloc(b->ctx, (size_t)n * rows * sizeof(float));
    if (!x || !y || o->to_backend(b->ctx, x, xh, (size_t)n * cols * sizeof(float)))
        goto done;
    double flops = 2.0 * rows * cols * n;
    int reps = (int)ceil(4e10 / flops);
    reps = reps < 3 ? 3 : reps > 500 ? 500 : reps;
    o->matmul(b->ctx, y, &w, x, n); /* plan + warm-up */
    if (o->sync(b->ctx))
        goto done;
    double t0 = s_now();
    for (int r = 0; r < reps; r++)
        o->matmul(b->ctx, y, &w, x, n);
    if (o->sync(b->ctx))
        goto done;
    tf = flops * reps / (s_now() - t0) / 1e12;
done:
    if (tf < 0)
        fprintf(stderr, "gemm %dx%d n=%d: %s\n", rows, cols, n,
                o->last_error(b->ctx) ? o->last_error(b->ctx) : "out of memory");
    if (w.dev)
        o->weight_release(b->ctx, &w);
    if (x)
        o->free(b->ctx, x);
    if (y)
        o->free(b->ctx, y);
    free(wh);
    free(xh);
    return tf;
}

static int32_t s_argmax(const float *x, int n) {
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

typedef struct model_times {
    double prefill_tps;     /* 2048-token prompt */
    double decode_tps;      /* batch 1, 128 tokens */
    double ms_per_token;    /* wall time per decoded token */
    double kernel_ms;       /* summed event time per decoded token */
    double nograph_ms;      /* wall time per decoded token without graphs */
    double greedy_ms;       /* the same with the argmax on the device */
    double step32_tps;      /* tokens/s of 32-token steps */
    long graphs, replays;   /* graphs launched in the timed decode, relaunched of them */
    int n_ops;              /* kinds of operation in the split below */
    const char *op_name[16];
    double op_ms[16];       /* per decoded token, profiled */
    double op_calls[16];    /* operations per decoded token */
} model_times;

/* The model in weight mode `mode`, with the newer kernels and graph
 * relaunches on (1) or off (0, as before them: cuBLASLt for every product,
 * the warp-per-position attention, a recording every step). */
static int s_model(const char *path, const char *mode, int newer, int mv_pre, model_times *mt) {
    char err[512];
    const char *on = newer ? "1" : "0";
    if (setenv("FEDINFER_CUDA_WEIGHTS", mode, 1) || setenv("FEDINFER_CUDA_MATVEC", on, 1) ||
        setenv("FEDINFER_CUDA_ATTN_G", on, 1) || setenv("FEDINFER_CUDA_REPLAY", on, 1) ||
        setenv("FEDINFER_CUDA_FUSED", on, 1) || setenv("FEDINFER_CUDA_MV_PRE", mv_pre ? "1" : "0", 1))
        return -1;
    fi_model_opts mo = {.simd = FI_SIMD_AUTO, .device = FI_DEVICE_CUDA};
    fi_model *m = fi_model_load(path, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "fi_cuda_probe: %s\n", err);
        return -1;
    }
    const fi_config *c = fi_model_config(m);
    int n_ctx = 2048 + 256 < c->ctx_train ? 2048 + 256 : c->ctx_train;
    int n_prompt = n_ctx - 256;
    fi_session *s = fi_session_new(m, n_ctx, err, sizeof err);
    float *logits = malloc((size_t)c->n_vocab * sizeof *logits);
    int32_t *toks = malloc((size_t)n_ctx * sizeof *toks);
    int rc = -1;
    if (!s || !logits || !toks)
        goto done;
    for (int i = 0; i < n_ctx; i++)
        toks[i] = (int32_t)((i * 7919 + 13) % c->n_vocab);
    if (fi_session_eval(s, toks, 16, logits, NULL, err, sizeof err)) /* warm-up */
        goto fail;
    fi_session_rewind(s, 0);
    double t0 = s_now();
    if (fi_session_eval(s, toks, n_prompt, logits, NULL, err, sizeof err))
        goto fail;
    mt->prefill_tps = n_prompt / (s_now() - t0);
    /* decode at batch 1 after a 64-token prompt */
    fi_session_rewind(s, 64);
    int32_t id = s_argmax(logits, c->n_vocab);
    const int n_gen = 128;
    t0 = s_now();
    for (int g = 0; g < n_gen; g++) {
        if (fi_session_eval(s, &id, 1, logits, NULL, err, sizeof err))
            goto fail;
        id = s_argmax(logits, c->n_vocab);
    }
    double dt = s_now() - t0;
    mt->decode_tps = n_gen / dt;
    mt->ms_per_token = dt * 1e3 / n_gen;
    /* greedy with the argmax on the device: one integer comes back */
    fi_backend *be = fi_model_backend(m);
    long g0, r0 = fi_cuda_backend_graph_replays(be), g1;
    fi_cuda_backend_graph_stats(be, &g0, NULL);
    fi_session_rewind(s, 64);
    t0 = s_now();
    for (int g = 0; g < n_gen; g++)
        if (fi_session_eval_greedy(s, &id, 1, &id, err, sizeof err))
            goto fail;
    mt->greedy_ms = (s_now() - t0) * 1e3 / n_gen;
    fi_cuda_backend_graph_stats(be, &g1, NULL);
    mt->graphs = g1 - g0;
    mt->replays = fi_cuda_backend_graph_replays(be) - r0;
    /* the same without graphs, then with kernel timing (also no graphs) */
    if (fi_cuda_backend_set_graphs(be, 0))
        goto done;
    fi_session_rewind(s, 64);
    t0 = s_now();
    for (int g = 0; g < n_gen; g++) {
        if (fi_session_eval(s, &id, 1, logits, NULL, err, sizeof err))
            goto fail;
        id = s_argmax(logits, c->n_vocab);
    }
    mt->nograph_ms = (s_now() - t0) * 1e3 / n_gen;
    if (fi_cuda_backend_set_graphs(be, 1))
        goto done;
    fi_session_rewind(s, 64);
    if (fi_cuda_backend_set_profile(be, 1) || fi_cuda_backend_kernel_ms(be) < 0)
        goto done;
    for (int g = 0; g < n_gen; g++) {
        if (fi_session_eval(s, &id, 1, logits, NULL, err, sizeof err))
            goto fail;
        id = s_argmax(logits, c->n_vocab);
    }
    mt->kernel_ms = fi_cuda_backend_kernel_ms(be) / n_gen;
    long calls[16];
    mt->n_ops = fi_cuda_backend_profile_ops(be, mt->op_name, mt->op_ms, calls, 16);
    if (mt->n_ops < 0)
        goto done;
    for (int i = 0; i < mt->n_ops; i++) {
        mt->op_ms[i] /= n_gen;
        mt->op_calls[i] = (double)calls[i] / n_gen;
    }
    if (fi_cuda_backend_set_profile(be, 0))
        goto done;
    /* 32-token steps */
    fi_session_rewind(s, 64);
    const int steps = 16;
    t0 = s_now();
    for (int g = 0; g < steps; g++)
        if (fi_session_eval(s, toks + 64 + 32 * g, 32, logits, NULL, err, sizeof err))
            goto fail;
    mt->step32_tps = 32.0 * steps / (s_now() - t0);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "fi_cuda_probe: %s\n", err);
done:
    free(logits);
    free(toks);
    fi_session_destroy(&s);
    fi_model_destroy(&m);
    return rc;
}

static int s_run(const char *path);

/* A random-weight model of the default model's shapes at path; 0 or -1. */
static int s_write_synthetic(const char *path) {
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    o.n_layers = 30;
    o.dim = 576;
    o.n_heads = 9;
    o.n_kv_heads = 3;
    o.ffn_dim = 1536;
    o.n_vocab = 49152;
    o.ctx = 8192;
    o.wtype = FI_DTYPE_Q4_1;
    o.embd_type = FI_DTYPE_Q8_0;
    o.tied = 1;
    o.rope_theta = 100000.0f;
    if (fi_gw_tiny_llama_file(&o, path) != 0) {
        fprintf(stderr, "fi_cuda_probe: could not write %s\n", path);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    char err[512];
    if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        printf("usage: fi_cuda_probe MODEL | --synthetic\n"
               "       fi_cuda_probe --write-synthetic FILE\n\n"
               "GPU throughput probe for kernels/cuda/gpu-check.sh: cuBLASLt GEMMs at the model's\n"
               "shapes against a large square GEMM, prefill and decode timings with CUDA-event\n"
               "kernel sums. Exits 77 where no CUDA device is present.\n");
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "--write-synthetic"))
        return s_write_synthetic(argv[2]) ? 1 : 0;
    if (fi_cuda_device_count(err, sizeof err) < 0) {
        printf("SKIPPED: no CUDA device (%s)\n", err);
        return 77;
    }
    const char *path = argc > 1 ? argv[1] : getenv("FEDINFER_MODEL");
    char tmp[128] = "";
    if (!path) {
        fprintf(stderr, "usage: fi_cuda_probe MODEL | --synthetic\n");
        return 2;
    }
    if (!strcmp(path, "--synthetic")) {
        snprintf(tmp, sizeof tmp, "/tmp/fi_cuda_probe_%d.gguf", (int)getpid());
        if (s_write_synthetic(tmp) != 0)
            return 1;
        path = tmp;
        s_row("model", "synthetic", "random weights, the default model's shapes and types");
    }

    int rc = s_run(path);
    if (tmp[0])
        unlink(tmp);
    return rc;
}

/* Everything after the model is chosen; 0, or 1 on a failure (printed). */
static int s_run(const char *path) {
    char err[512], v[64], note[128];
    fi_backend *b = fi_cuda_backend_new(0, err, sizeof err);
    if (!b) {
        fprintf(stderr, "fi_cuda_probe: %s\n", err);
        return 1;
    }
    /* the model's shapes, from a CPU load (no GPU memory used) */
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU};
    fi_model *m = fi_model_load(path, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "fi_cuda_probe: %s\n", err);
        fi_backend_destroy(&b);
        return 1;
    }
    fi_config c = *fi_model_config(m);
    fi_model_destroy(&m);
    int kv = c.n_kv_heads * c.head_dim;
    s_row("device", fi_cuda_backend_device_name(b), "");
    double peak = s_gemm_tflops(b, 8192, 8192, 8192);
    snprintf(v, sizeof v, "%.1f TFLOP/s", peak);
    s_row("GEMM 8192^3 fp16 (measured peak)", v, "same path as the model: fp32 x -> fp16, cuBLASLt");
    struct {
        const char *name;
        int rows, cols;
    } shapes[] = {{"q/o", c.dim, c.dim},      {"k/v", kv, c.dim},   {"gate/up", c.ffn_dim, c.dim},
                  {"down", c.dim, c.ffn_dim}, {"logits", c.n_vocab, c.dim}};
    const int ns[] = {1, 32, 256, 2048};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            double tf = s_gemm_tflops(b, shapes[i].rows, shapes[i].cols, ns[k]);
            char name[64];
            snprintf(name, sizeof name, "GEMM %s %dx%d n=%d", shapes[i].name, shapes[i].rows,
                     shapes[i].cols, ns[k]);
            snprintf(v, sizeof v, "%.2f TFLOP/s", tf);
            snprintf(note, sizeof note, "%.1f%% of the measured peak", peak > 0 ? 100 * tf / peak : 0);
            s_row(name, v, note);
        }
    }
    fi_backend_destroy(&b);

    /* the third: fp16 weights with the kernels of before (see s_model);
     * the fourth: without k_matvec's early loads (FEDINFER_CUDA_MV_PRE) */
    const char *modes[] = {"f16", "quant", "f16 old", "f16 no-pre"},
               *wmode[] = {"f16", "quant", "f16", "f16"};
    for (int i = 0; i < 4; i++) {
        model_times mt = {0};
        if (s_model(path, wmode[i], i != 2, i != 3, &mt) != 0)
            return 1;
        char name[64];
        snprintf(name, sizeof name, "prefill 2048 [%s]", modes[i]);
        snprintf(v, sizeof v, "%.0f tok/s", mt.prefill_tps);
        s_row(name, v, "one fi_session_eval, chunks of 256");
        snprintf(name, sizeof name, "decode batch 1 [%s]", modes[i]);
        snprintf(v, sizeof v, "%.1f tok/s", mt.decode_tps);
        snprintf(note, sizeof note,
                 "%.3f ms/token wall with graphs, %.3f without; %.3f in kernels (gap %.3f ms)",
                 mt.ms_per_token, mt.nograph_ms, mt.kernel_ms, mt.ms_per_token - mt.kernel_ms);
        s_row(name, v, note);
        for (int k = 0; k < mt.n_ops; k++) {
            snprintf(name, sizeof name, "  %s [%s]", mt.op_name[k], modes[i]);
            snprintf(v, sizeof v, "%.3f ms/token", mt.op_ms[k]);
            snprintf(note, sizeof note, "%.0f operations per token, %.2f us each (profiled)",
                     mt.op_calls[k], 1e3 * mt.op_ms[k] / mt.op_calls[k]);
            s_row(name, v, note);
        }
        snprintf(name, sizeof name, "decode b1 device argmax [%s]", modes[i]);
        snprintf(v, sizeof v, "%.1f tok/s", 1e3 / mt.greedy_ms);
        snprintf(note, sizeof note,
                 "fi_session_eval_greedy: no logits to the host; %ld graphs, %ld relaunched",
                 mt.graphs, mt.replays);
        s_row(name, v, note);
        snprintf(name, sizeof name, "32-token steps [%s]", modes[i]);
        snprintf(v, sizeof v, "%.0f tok/s", mt.step32_tps);
        s_row(name, v, "proxy for batch-32 decode (no cross-session batching yet)");
    }
    return 0;
}
