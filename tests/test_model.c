/*
 * test_model.c - the engine on tiny synthetic Llama models that the test
 * writes itself (tests/support/gguf_writer.h): batching and chunking give
 * the same logits as one token at a time, the KV cache rewinds, the context
 * limit is enforced with a clear error, generation stops as asked, the
 * portable and SIMD paths agree, and malformed models are refused with a
 * message that names the problem.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>

#include <cmocka.h>

#include "fi_model.h"
#include "fault_backend.h"
#include "gguf_writer.h"

static char s_path[256];

/* Writes the tiny model with options o to a temp file; returns its path. */
static const char *s_write(const fi_gw_llama_opts *o) {
    snprintf(s_path, sizeof s_path, "/tmp/fi_test_model_%d.gguf", (int)getpid());
    assert_int_equal(fi_gw_tiny_llama_file(o, s_path), 0);
    return s_path;
}

static fi_model *s_load(const fi_gw_llama_opts *o, fi_simd simd, int threads) {
    char err[512];
    fi_model_opts mo = {.n_threads = threads, .simd = simd, .device = FI_DEVICE_CPU};
    fi_model *m = fi_model_load(s_write(o), &mo, err, sizeof err);
    if (!m) fail_msg("load failed: %s", err);
    unlink(s_path);
    return m;
}

static double s_max_abs_diff(const float *a, const float *b, size_t n) {
    double d = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]);
        if (!(e <= d)) d = e; /* NaN propagates as a failure */
    }
    return d;
}

static double s_max_abs(const float *a, size_t n) {
    double d = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs(a[i]) > d) d = fabs(a[i]);
    return d;
}

static void s_tokens(int32_t *t, int n, int vocab, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        t[i] = 3 + (int32_t)((seed >> 8) % (uint32_t)(vocab - 3));
    }
}

static void test_config_and_shapes(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    fi_model *m = s_load(&o, FI_SIMD_AUTO, 1);
    const fi_config *c = fi_model_config(m);
    assert_int_equal(c->n_layers, o.n_layers);
    assert_int_equal(c->dim, o.dim);
    assert_int_equal(c->n_heads, o.n_heads);
    assert_int_equal(c->n_kv_heads, o.n_kv_heads);
    assert_int_equal(c->head_dim, o.dim / o.n_heads);
    assert_int_equal(c->ffn_dim, o.ffn_dim);
    assert_int_equal(c->ctx_train, o.ctx);
    assert_int_equal(c->tied_output, 1);
    assert_true(fi_model_weight_bytes_per_token(m) > 0);
    /* multiply-adds a token: each layer's q, k, v, o, gate, up and down,
     * and the logits matrix (the tied embeddings); all of them, and by
     * type, Q8_0 here */
    const uint64_t kv = (uint64_t)c->n_kv_heads * (uint64_t)c->head_dim, d = (uint64_t)c->dim;
    const uint64_t want = (uint64_t)c->n_layers * (2 * d * d + 2 * kv * d + 3 * (uint64_t)c->ffn_dim * d) +
                          (uint64_t)c->n_vocab * d;
    assert_int_equal(fi_model_macs_per_token(m, -1), want);
    assert_int_equal(fi_model_macs_per_token(m, FI_DTYPE_Q8_0), want);
    assert_int_equal(fi_model_macs_per_token(m, FI_DTYPE_Q4_1), 0);
    fi_model_destroy(&m);
    assert_null(m);
    /* Q4_1 layers beside Q8_0 embeddings: the split follows the types */
    o.wtype = FI_DTYPE_Q4_1;
    m = s_load(&o, FI_SIMD_AUTO, 1);
    c = fi_model_config(m);
    assert_int_equal(fi_model_macs_per_token(m, FI_DTYPE_Q8_0), (uint64_t)c->n_vocab * d);
    assert_int_equal(fi_model_macs_per_token(m, FI_DTYPE_Q4_1), want - (uint64_t)c->n_vocab * d);
    assert_int_equal(fi_model_macs_per_token(m, -1), want);
    fi_model_destroy(&m);
    fi_model_destroy(&m); /* safe twice */
}

/* Evaluating n tokens at once, or one at a time, or in odd chunks, gives
 * the same logits for every position. */
static void s_check_batching(fi_dtype wtype, int n) {
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    o.wtype = wtype;
    o.ctx = 512;
    fi_model *m = s_load(&o, FI_SIMD_AUTO, 2);
    const fi_config *c = fi_model_config(m);
    size_t V = (size_t)c->n_vocab;
    char err[256];
    int32_t *toks = malloc((size_t)n * sizeof *toks);
    float *all = malloc((size_t)n * V * sizeof(float));
    float *one = malloc(V * sizeof(float));
    float *last = malloc(V * sizeof(float));
    s_tokens(toks, n, c->n_vocab, 7);

    fi_session *s = fi_session_new(m, 512, err, sizeof err);
    assert_non_null(s);
    assert_int_equal(fi_session_eval(s, toks, n, last, all, err, sizeof err), 0);
    assert_int_equal(fi_session_pos(s), n);
    assert_true(s_max_abs_diff(last, all + (size_t)(n - 1) * V, V) == 0.0);
    double scale = s_max_abs(all, (size_t)n * V);
    assert_true(scale > 0.0);

    fi_session_rewind(s, 0);
    assert_int_equal(fi_session_pos(s), 0);
    double worst = 0;
    for (int i = 0; i < n; i++) {
        assert_int_equal(fi_session_eval(s, toks + i, 1, one, NULL, err, sizeof err), 0);
        double d = s_max_abs_diff(one, all + (size_t)i * V, V);
        if (d > worst) worst = d;
    }
    /* the same arithmetic, only grouped differently */
    if (!(worst <= 1e-3 * scale)) fail_msg("batched vs single differ by %g (scale %g)", worst, scale);

    /* odd chunks */
    fi_session_rewind(s, 0);
    for (int i = 0; i < n; i += 7) {
        int b = n - i < 7 ? n - i : 7;
        assert_int_equal(fi_session_eval(s, toks + i, b, one, NULL, err, sizeof err), 0);
    }
    worst = s_max_abs_diff(one, all + (size_t)(n - 1) * V, V);
    if (!(worst <= 1e-3 * scale)) fail_msg("chunked vs batched differ by %g", worst);

    fi_session_destroy(&s);
    free(toks);
    free(all);
    free(one);
    free(last);
    fi_model_destroy(&m);
}

static void test_batching_q8_0(void **state) {
    (void)state;
    s_check_batching(FI_DTYPE_Q8_0, 40);
}
static void test_batching_q4_1(void **state) {
    (void)state;
    s_check_batching(FI_DTYPE_Q4_1, 40);
}
static void test_batching_f32(void **state) {
    (void)state;
    s_check_batching(FI_DTYPE_F32, 21);
}
static void test_batching_f16_long(void **state) {
    (void)state;
    /* longer than one forward chunk (256 tokens) */
    s_check_batching(FI_DTYPE_F16, 300);
}

static void test_rewind_reuses_prefix(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    fi_model *m = s_load(&o, FI_SIMD_AUTO, 1);
    size_t V = (size_t)fi_model_config(m)->n_vocab;
    char err[256];
    float *a = malloc(V * sizeof(float)), *b = malloc(V * sizeof(float));
    int32_t t1[] = {10, 20, 30, 40, 50}, t2[] = {10, 20, 99, 98, 97};
    fi_session *s = fi_session_new(m, 64, err, sizeof err);
    assert_int_equal(fi_session_eval(s, t1, 5, a, NULL, err, sizeof err), 0);
    fi_session_rewind(s, 2);
    assert_int_equal(fi_session_pos(s), 2);
    assert_int_equal(fi_session_eval(s, t2 + 2, 3, a, NULL, err, sizeof err), 0);
    fi_session_rewind(s, 0);
    assert_int_equal(fi_session_eval(s, t2, 5, b, NULL, err, sizeof err), 0);
    assert_true(s_max_abs_diff(a, b, V) <= 1e-3 * s_max_abs(b, V));
    /* rewinding forward does nothing */
    fi_session_rewind(s, 100);
    assert_int_equal(fi_session_pos(s), 5);
    fi_session_destroy(&s);
    free(a);
    free(b);
    fi_model_destroy(&m);
}

static void test_context_limit(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    fi_model *m = s_load(&o, FI_SIMD_AUTO, 1);
    size_t V = (size_t)fi_model_config(m)->n_vocab;
    char err[256] = "";
    float *l = malloc(V * sizeof(float));
    int32_t t[16];
    s_tokens(t, 16, (int)V, 3);
    /* a session larger than the trained context is refused */
    assert_null(fi_session_new(m, o.ctx + 1, err, sizeof err));
    assert_non_null(strstr(err, "exceeds the model's trained context"));
    fi_session *s = fi_session_new(m, 16, err, sizeof err);
    assert_int_equal(fi_session_eval(s, t, 10, l, NULL, err, sizeof err), 0);
    assert_int_not_equal(fi_session_eval(s, t, 7, l, NULL, err, sizeof err), 0);
    assert_non_null(strstr(err, "context full"));
    assert_int_equal(fi_session_pos(s), 10); /* nothing changed */
    assert_int_equal(fi_session_eval(s, t, 6, l, NULL, err, sizeof err), 0);
    assert_int_equal(fi_session_pos(s), 16);
    /* bad ids and empty input */
    fi_session_rewind(s, 0);
    int32_t bad[] = {5, (int32_t)V};
    assert_int_not_equal(fi_session_eval(s, bad, 2, l, NULL, err, sizeof err), 0);
    assert_non_null(strstr(err, "outside the vocabulary"));
    assert_int_not_equal(fi_session_eval(s, bad, 0, l, NULL, err, sizeof err), 0);
    fi_session_destroy(&s);
    free(l);
    fi_model_destroy(&m);
}

typedef struct collect {
    char text[4096];
    size_t len;
    int cancel_after; /* cancel at this callback (0: never) */
    int calls;
} collect;

static int s_collect(void *user, const char *t, size_t n) {
    collect *c = user;
    if (c->len + n < sizeof c->text) {
        memcpy(c->text + c->len, t, n);
        c->len += n;
        c->text[c->len] = 0;
    }
    c->calls++;
    return c->cancel_after && c->calls >= c->cancel_after;
}

static void test_generate(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    fi_model *m = s_load(&o, FI_SIMD_AUTO, 1);
    char err[256];
    fi_session *s = fi_session_new(m, 64, err, sizeof err);
    int32_t prompt[] = {FI_GW_TOK_IM_START, 10, 11, 12};
    fi_gen_opts go = {0};
    go.max_tokens = 8;
    go.sampling = fi_sampler_defaults();
    go.sampling.temperature = 0.0f;
    collect c1 = {0}, c2 = {0};
    go.on_text = s_collect;
    go.user = &c1;
    fi_gen_result r;
    assert_int_equal(fi_generate(s, prompt, 4, &go, &r, err, sizeof err), 0);
    assert_int_equal(r.n_prompt, 4);
    assert_true(r.n_generated >= 1 && r.n_generated <= 8);
    if (r.stop == FI_STOP_LENGTH) assert_int_equal(r.n_generated, 8);
    /* greedy is deterministic */
    fi_session_rewind(s, 0);
    go.user = &c2;
    fi_gen_result r2;
    assert_int_equal(fi_generate(s, prompt, 4, &go, &r2, err, sizeof err), 0);
    assert_int_equal(r2.n_generated, r.n_generated);
    assert_int_equal(c1.len, c2.len);
    assert_memory_equal(c1.text, c2.text, c1.len);

    /* the context ends generation with its own reason */
    fi_session_rewind(s, 0);
    go.max_tokens = 1000;
    go.user = &c2;
    int32_t longp[60];
    s_tokens(longp, 60, fi_model_config(m)->n_vocab, 9);
    assert_int_equal(fi_generate(s, longp, 60, &go, &r2, err, sizeof err), 0);
    assert_true(r2.stop == FI_STOP_CONTEXT || r2.stop == FI_STOP_EOG || r2.stop == FI_STOP_STRING);
    assert_true(fi_session_pos(s) <= 64);

    /* a prompt longer than the context is refused before any work */
    fi_session_rewind(s, 0);
    int32_t huge[65] = {0};
    assert_int_not_equal(fi_generate(s, huge, 65, &go, &r2, err, sizeof err), 0);
    assert_non_null(strstr(err, "does not fit the context"));
    assert_int_equal(fi_session_pos(s), 0);

    /* the callback cancels */
    fi_session_rewind(s, 0);
    collect c3 = {0};
    c3.cancel_after = 1;
    go.user = &c3;
    go.max_tokens = 30;
    go.sampling.temperature = 1.0f;
    go.sampling.top_k = 0;
    go.sampling.top_p = 1.0f;
    go.sampling.min_p = 0.0f;
    /* sample from a flat-ish distribution: special tokens (which end the
     * turn) are 3 of hundreds, so text appears quickly */
    assert_int_equal(fi_generate(s, prompt, 4, &go, &r2, err, sizeof err), 0);
    if (c3.calls > 0) assert_int_equal(r2.stop, FI_STOP_CANCEL);
    fi_session_destroy(&s);
    fi_model_destroy(&m);
}

static void test_portable_matches_simd(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    o.wtype = FI_DTYPE_Q4_1;
    fi_model *a = s_load(&o, FI_SIMD_AUTO, 2), *b = s_load(&o, FI_SIMD_PORTABLE, 1);
    size_t V = (size_t)fi_model_config(a)->n_vocab;
    char err[256];
    float *la = malloc(V * sizeof(float)), *lb = malloc(V * sizeof(float));
    int32_t t[12];
    s_tokens(t, 12, (int)V, 5);
    fi_session *sa = fi_session_new(a, 32, err, sizeof err), *sb = fi_session_new(b, 32, err, sizeof err);
    assert_int_equal(fi_session_eval(sa, t, 12, la, NULL, err, sizeof err), 0);
    assert_int_equal(fi_session_eval(sb, t, 12, lb, NULL, err, sizeof err), 0);
    assert_true(s_max_abs_diff(la, lb, V) <= 1e-3 * s_max_abs(lb, V));
    fi_session_destroy(&sa);
    fi_session_destroy(&sb);
    fi_model_destroy(&a);
    fi_model_destroy(&b);
    free(la);
    free(lb);
}

/* Serialises the default tiny model, lets `patch` change bytes, and
 * expects the load to fail with `want` in the message. */
static void s_expect_load_error(void (*patch)(fi_gw *, uint8_t *, size_t), const char *want) {
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    fi_gw *w = fi_gw_tiny_llama(&o);
    assert_non_null(w);
    size_t len;
    uint8_t *buf = fi_gw_serialize(w, &len, NULL);
    assert_non_null(buf);
    patch(w, buf, len);
    char path[256], err[512] = "";
    snprintf(path, sizeof path, "/tmp/fi_test_bad_%d.gguf", (int)getpid());
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    fclose(f);
    fi_model *m = fi_model_load(path, NULL, err, sizeof err);
    unlink(path);
    if (m) fail_msg("a bad model loaded (expected \"%s\")", want);
    if (!strstr(err, want)) fail_msg("error \"%s\" does not say \"%s\"", err, want);
    free(buf);
    fi_gw_destroy(&w);
}

static void s_replace(uint8_t *buf, size_t len, const char *from, const char *to) {
    size_t n = strlen(from);
    assert_int_equal(n, strlen(to));
    for (size_t i = 0; i + n <= len; i++)
        if (!memcmp(buf + i, from, n)) {
            memcpy(buf + i, to, n);
            return;
        }
    fail_msg("'%s' not found in the model bytes", from);
}

static void s_patch_arch(fi_gw *w, uint8_t *b, size_t n) {
    (void)w;
    /* key, uint32 type, uint64 length, then the value "llama" */
    const char *key = "general.architecture";
    size_t kl = strlen(key);
    for (size_t i = 0; i + kl + 17 <= n; i++)
        if (!memcmp(b + i, key, kl)) {
            assert_memory_equal(b + i + kl + 12, "llama", 5);
            memcpy(b + i + kl + 12, "mamba", 5);
            return;
        }
    fail_msg("key not found");
}
static void s_patch_missing(fi_gw *w, uint8_t *b, size_t n) {
    (void)w;
    s_replace(b, n, "blk.1.ffn_up.weight", "blk.1.ffn_uX.weight");
}
static void s_patch_shape(fi_gw *w, uint8_t *b, size_t n) {
    (void)n;
    /* tensor info of blk.0.attn_k: swap ne[0] and ne[1] (same byte size) */
    for (size_t i = 0;; i++) {
        size_t off = fi_gw_tensor_offset(w, i);
        assert_true(off != (size_t)-1);
        uint64_t nl;
        memcpy(&nl, b + off, 8);
        if (nl == strlen("blk.0.attn_k.weight") && !memcmp(b + off + 8, "blk.0.attn_k.weight", nl)) {
            uint8_t *ne = b + off + 8 + nl + 4;
            uint8_t t[8];
            memcpy(t, ne, 8);
            memcpy(ne, ne + 8, 8);
            memcpy(ne + 8, t, 8);
            return;
        }
    }
}
static void s_patch_heads(fi_gw *w, uint8_t *b, size_t n) {
    (void)w;
    /* head_count_kv = 3 does not divide head_count = 4 */
    const char *key = "llama.attention.head_count_kv";
    size_t kl = strlen(key);
    for (size_t i = 0; i + kl + 8 <= n; i++)
        if (!memcmp(b + i, key, kl)) {
            uint32_t three = 3;
            memcpy(b + i + kl + 4, &three, 4); /* after the uint32 type id */
            return;
        }
    fail_msg("key not found");
}

static void test_load_errors(void **state) {
    (void)state;
    s_expect_load_error(s_patch_arch, "architecture 'mamba' is not supported");
    s_expect_load_error(s_patch_missing, "tensor 'blk.1.ffn_up.weight' is missing");
    s_expect_load_error(s_patch_shape, "'blk.0.attn_k.weight' has shape");
    s_expect_load_error(s_patch_heads, "not a multiple of head_count_kv");
    char err[256] = "";
    assert_null(fi_model_load("/nonexistent/model.gguf", NULL, err, sizeof err));
    assert_non_null(strstr(err, "/nonexistent/model.gguf"));
}

/* A pinned SHA-256 (model_sha256): the file's own, in either case, loads;
 * another digest, or one that is not 64 hex digits, is refused with both
 * digests named. The file's digest is taken by sha256sum, apart from the
 * engine. */
static void test_pinned_sha256(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    const char *path = s_write(&o);
    char cmd[600], sum[80] = "", err[512] = "";
    snprintf(cmd, sizeof cmd, "sha256sum '%s'", path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    assert_non_null(fgets(sum, sizeof sum, p));
    pclose(p);
    sum[64] = '\0';
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .sha256 = sum};
    fi_model *m = fi_model_load(path, &mo, err, sizeof err);
    assert_non_null(m);
    fi_model_destroy(&m);
    char upper[65];
    for (int i = 0; i < 65; i++) upper[i] = (char)toupper((unsigned char)sum[i]);
    mo.sha256 = upper;
    assert_non_null(m = fi_model_load(path, &mo, err, sizeof err));
    fi_model_destroy(&m);
    char other[65];
    memcpy(other, sum, sizeof other);
    other[10] = other[10] == '0' ? '1' : '0';
    mo.sha256 = other;
    assert_null(fi_model_load(path, &mo, err, sizeof err));
    assert_non_null(strstr(err, sum));
    assert_non_null(strstr(err, other));
    mo.sha256 = "abc";
    assert_null(fi_model_load(path, &mo, err, sizeof err));
    assert_non_null(strstr(err, "64 hexadecimal digits"));
    other[3] = 'g';
    mo.sha256 = other;
    assert_null(fi_model_load(path, &mo, err, sizeof err));
    assert_non_null(strstr(err, "not all hexadecimal"));
    mo.sha256 = ""; /* not pinned */
    assert_non_null(m = fi_model_load(path, &mo, err, sizeof err));
    fi_model_destroy(&m);
    unlink(path);
}

/* --device: cuda either loads on a device or fails with "no CUDA device: "
 * and CUDA's reason (always so in a build without CUDA); auto always loads;
 * an unknown value is refused; the device strings parse. */
static void test_device_choice(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    const char *path = s_write(&o);
    char err[512] = "";
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CUDA};
    fi_model *m = fi_model_load(path, &mo, err, sizeof err);
    if (m) {
        assert_string_equal(fi_model_backend(m)->ops->name, "cuda");
        fi_model_destroy(&m);
    } else {
        printf("  --device cuda: %s\n", err);
        assert_ptr_equal(strstr(err, "no CUDA device: "), err);
        assert_true(strlen(err) > strlen("no CUDA device: "));
    }
    mo.device = FI_DEVICE_AUTO;
    m = fi_model_load(path, &mo, err, sizeof err);
    assert_non_null(m);
    fi_model_destroy(&m);
    mo.device = (fi_device)7;
    assert_null(fi_model_load(path, &mo, err, sizeof err));
    unlink(path);
    fi_device d;
    assert_int_equal(fi_device_parse("cpu", &d), 0);
    assert_int_equal(d, FI_DEVICE_CPU);
    assert_int_equal(fi_device_parse("cuda", &d), 0);
    assert_int_equal(d, FI_DEVICE_CUDA);
    assert_int_equal(fi_device_parse("auto", &d), 0);
    assert_int_equal(d, FI_DEVICE_AUTO);
    assert_int_equal(fi_device_parse("gpu", &d), -1);
}

/* fi_session_eval_greedy picks the argmax of fi_session_eval's logits. */
static void test_eval_greedy(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    fi_model *m = s_load(&o, FI_SIMD_AUTO, 1);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    fi_session *a = fi_session_new(m, 64, err, sizeof err), *b = fi_session_new(m, 64, err, sizeof err);
    assert_non_null(a);
    assert_non_null(b);
    float *logits = malloc((size_t)V * sizeof *logits);
    assert_non_null(logits);
    int32_t toks[5];
    s_tokens(toks, 5, V, 7);
    int32_t ta = toks[4], tb = toks[4];
    assert_int_equal(fi_session_eval(a, toks, 4, logits, NULL, err, sizeof err), 0);
    assert_int_equal(fi_session_eval_greedy(b, toks, 4, &tb, err, sizeof err), 0);
    for (int step = 0; step < 6; step++) {
        ta = 0;
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[ta]) ta = i;
        assert_int_equal(ta, tb);
        assert_int_equal(fi_session_eval(a, &ta, 1, logits, NULL, err, sizeof err), 0);
        assert_int_equal(fi_session_eval_greedy(b, &tb, 1, &tb, err, sizeof err), 0);
    }
    free(logits);
    fi_session_destroy(&a);
    fi_session_destroy(&b);
    fi_model_destroy(&m);
}

/* --- shard plans ------------------------------------------------------- */

static fi_model *s_load_plan(const fi_gw_llama_opts *o, const fi_shard_plan *p, char *err,
                             size_t errlen) {
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU, .plan = p};
    fi_model *m = fi_model_load(s_write(o), &mo, err, errlen);
    unlink(s_path);
    return m;
}

/* n tokens of one sequence at positions 0.., logits of the last. */
static fi_batch s_batch(const int32_t *toks, int n, int32_t *pos, int32_t *seq, int32_t *tbl,
                        int32_t *row, int out) {
    for (int t = 0; t < n; t++) {
        pos[t] = t;
        seq[t] = 0;
    }
    for (int i = 0; i < 8; i++) tbl[i] = 7 - i; /* blocks in any order */
    *row = n - 1;
    fi_batch b = {.n = n, .tok = toks, .pos = pos, .seq = seq, .n_seqs = 1, .tables = tbl,
                  .max_blocks = 8, .out_rows = row, .n_out = out};
    return b;
}

/* Two pipeline stages (layer 0 | layer 1): stage 0's activations fed to
 * stage 1 give the whole model's logits. */
static void test_plan_pipeline(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    char err[256];
    fi_shard_plan p0 = {.layer_begin = 0, .layer_end = 1, .no_output = 1};
    fi_shard_plan p1 = {.layer_begin = 1, .layer_end = 2, .no_embed = 1};
    fi_model *whole = s_load_plan(&o, NULL, err, sizeof err);
    fi_model *m0 = s_load_plan(&o, &p0, err, sizeof err);
    fi_model *m1 = s_load_plan(&o, &p1, err, sizeof err);
    assert_non_null(whole);
    assert_non_null(m0);
    assert_non_null(m1);
    assert_true(fi_model_weight_bytes_per_token(m0) < fi_model_weight_bytes_per_token(whole));
    const fi_config *c = fi_model_config(whole);
    size_t V = (size_t)c->n_vocab;
    fi_kvpool *k = fi_kvpool_new(whole, 8, 64, 1, err, sizeof err);
    fi_kvpool *k0 = fi_kvpool_new(m0, 8, 64, 0, err, sizeof err);
    fi_kvpool *k1 = fi_kvpool_new(m1, 8, 64, 1, err, sizeof err);
    assert_true(k && k0 && k1);
    int32_t toks[40], pos[40], seq[40], tbl[8], row;
    s_tokens(toks, 40, c->n_vocab, 3);
    float *ref = malloc(V * sizeof *ref), *got = malloc(V * sizeof *got);
    float *x = malloc(40 * (size_t)c->dim * sizeof *x);
    fi_batch b = s_batch(toks, 40, pos, seq, tbl, &row, 1);
    assert_int_equal(fi_model_forward(whole, k, &b, NULL, NULL, ref, err, sizeof err), 0);
    fi_batch b0 = b;
    b0.n_out = 0;
    assert_int_equal(fi_model_forward(m0, k0, &b0, NULL, x, NULL, err, sizeof err), 0);
    assert_int_equal(fi_model_forward(m1, k1, &b, x, NULL, got, err, sizeof err), 0);
    double d = s_max_abs_diff(got, ref, V);
    if (!(d == 0.0)) fail_msg("pipeline logits differ by %g", d);
    /* a stage without the output layer refuses to make logits */
    assert_int_equal(fi_model_forward(m0, k0, &b, NULL, x, got, err, sizeof err), -1);
    assert_non_null(strstr(err, "no output layer"));
    /* a stage without embedding needs its input */
    assert_int_equal(fi_model_forward(m1, k1, &b, NULL, NULL, got, err, sizeof err), -1);
    assert_non_null(strstr(err, "input activations"));
    fi_kvpool_destroy(&k);
    fi_kvpool_destroy(&k0);
    fi_kvpool_destroy(&k1);
    fi_model_destroy(&whole);
    fi_model_destroy(&m0);
    fi_model_destroy(&m1);
    free(ref);
    free(got);
    free(x);
}

/* Tensor parallelism in one process: two ranks in two threads, each with
 * one KV head (and its query heads) and half the FFN; the all-reduce sums
 * through a shared buffer between two barriers. */
typedef struct tp_shared {
    pthread_barrier_t bar;
    float *part[2];
    size_t n;
    const fi_gw_llama_opts *o;
    const int32_t *toks;
    int n_toks;
    float *logits;    /* rank 0's */
    int rc[2];
    char err[2][256];
} tp_shared;

typedef struct tp_rank {
    tp_shared *sh;
    int rank;
    fi_model *m;
} tp_rank;

static int s_tp_allreduce(void *user, float *x, size_t n, char *err, size_t errlen) {
    (void)err;
    (void)errlen;
    tp_rank *r = user;
    tp_shared *sh = r->sh;
    memcpy(sh->part[r->rank], x, n * sizeof *x);
    pthread_barrier_wait(&sh->bar);
    for (size_t i = 0; i < n; i++) x[i] = sh->part[0][i] + sh->part[1][i];
    pthread_barrier_wait(&sh->bar);
    return 0;
}

static void *s_tp_thread(void *arg) {
    tp_rank *r = arg;
    tp_shared *sh = r->sh;
    fi_kvpool *kv = fi_kvpool_new(r->m, 8, 64, r->rank == 0, sh->err[r->rank], 256);
    if (!kv) {
        sh->rc[r->rank] = -1;
        return NULL;
    }
    fi_model_set_allreduce(r->m, s_tp_allreduce, r);
    int32_t pos[64], seq[64], tbl[8], row;
    fi_batch b = s_batch(sh->toks, sh->n_toks, pos, seq, tbl, &row, r->rank == 0);
    sh->rc[r->rank] = fi_model_forward(r->m, kv, &b, NULL, NULL, r->rank == 0 ? sh->logits : NULL,
                                       sh->err[r->rank], 256);
    fi_kvpool_destroy(&kv);
    return NULL;
}

static void test_plan_tensor_parallel(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    char err[256];
    fi_model *whole = s_load_plan(&o, NULL, err, sizeof err);
    assert_non_null(whole);
    const fi_config *c = fi_model_config(whole);
    size_t V = (size_t)c->n_vocab;
    int32_t toks[30], pos[64], seq[64], tbl[8], row;
    s_tokens(toks, 30, c->n_vocab, 11);
    float *ref = malloc(V * sizeof *ref);
    fi_kvpool *k = fi_kvpool_new(whole, 8, 64, 1, err, sizeof err);
    fi_batch b = s_batch(toks, 30, pos, seq, tbl, &row, 1);
    assert_int_equal(fi_model_forward(whole, k, &b, NULL, NULL, ref, err, sizeof err), 0);

    tp_shared sh = {.o = &o, .toks = toks, .n_toks = 30, .n = 30 * (size_t)c->dim};
    sh.logits = malloc(V * sizeof(float));
    sh.part[0] = malloc(sh.n * sizeof(float));
    sh.part[1] = malloc(sh.n * sizeof(float));
    pthread_barrier_init(&sh.bar, NULL, 2);
    tp_rank r[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        fi_shard_plan p = {.kv_head_begin = i, .kv_head_count = 1, .ffn_begin = i * 64,
                           .ffn_count = 64, .no_output = i != 0};
        r[i] = (tp_rank){.sh = &sh, .rank = i, .m = s_load_plan(&o, &p, err, sizeof err)};
        if (!r[i].m) fail_msg("rank %d: %s", i, err);
    }
    for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, s_tp_thread, &r[i]), 0);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++)
        if (sh.rc[i]) fail_msg("rank %d: %s", i, sh.err[i]);
    double d = s_max_abs_diff(sh.logits, ref, V), scale = s_max_abs(ref, V);
    /* the same products, summed in another order */
    if (!(d <= 1e-4 * scale)) fail_msg("TP=2 logits differ by %g (scale %g)", d, scale);
    pthread_barrier_destroy(&sh.bar);
    for (int i = 0; i < 2; i++) fi_model_destroy(&r[i].m);
    free(sh.part[0]);
    free(sh.part[1]);
    free(sh.logits);
    free(ref);
    fi_kvpool_destroy(&k);
    fi_model_destroy(&whole);
}

/* Plans that cannot work are refused with the reason. */
static void test_plan_errors(void **state) {
    (void)state;
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o); /* 2 layers, 2 KV heads, ffn 128, Q8_0 (32-wide blocks) */
    char err[256];
    struct {
        fi_shard_plan p;
        const char *want;
    } bad[] = {
        {{.kv_head_begin = 2, .kv_head_count = 1}, "KV heads 2+1 are not inside the model's 2"},
        {{.ffn_begin = 16, .ffn_count = 32}, "off the weights' quantisation block of 32"},
        {{.ffn_begin = 0, .ffn_count = 48}, "off the weights' quantisation block"},
        {{.layer_begin = 1, .layer_end = 3}, "layers [1, 3) are not a range inside"},
        {{.layer_begin = 2, .layer_end = 2}, "not a range"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fi_model *m = s_load_plan(&o, &bad[i].p, err, sizeof err);
        assert_null(m);
        if (!strstr(err, bad[i].want)) fail_msg("plan %zu: '%s' lacks '%s'", i, err, bad[i].want);
    }
    /* one stage cannot hold a session (it is not the whole pipeline) */
    fi_shard_plan stage = {.layer_end = 1, .no_output = 1};
    fi_model *m = s_load_plan(&o, &stage, err, sizeof err);
    assert_non_null(m);
    assert_null(fi_session_new(m, 64, err, sizeof err));
    assert_non_null(strstr(err, "one stage"));
    fi_model_destroy(&m);
}

/* The tiny model of the backend tests: Q4_1 weights, an output matrix of
 * its own. */
static fi_gw_llama_opts s_q4_untied(void) {
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    o.tied = 0;
    o.wtype = FI_DTYPE_Q4_1;
    return o;
}

/* Resets m's backend (no session alive), then evaluates toks[0..n) in a
 * new session into got: the logits must be want's, bit for bit. */
static void s_reset_and_eval(fi_model *m, const int32_t *toks, int n, const float *want, float *got) {
    char err[512];
    if (fi_model_reset_backend(m, err, sizeof err) != 0) fail_msg("reset: %s", err);
    fi_session *s = fi_session_new(m, 64, err, sizeof err);
    assert_non_null(s);
    assert_int_equal(fi_session_eval(s, toks, n, got, NULL, err, sizeof err), 0);
    assert_memory_equal(got, want, (size_t)fi_model_config(m)->n_vocab * sizeof *got);
    fi_session_destroy(&s);
}

/* A backend that fails for good (as a GPU's does) is replaced without a
 * restart: passes fail with its message, fi_model_backend_failed says so,
 * the reset waits for the model's sessions to go, and the new backend
 * gives the same logits as before the failure. */
static void test_backend_reset(void **state) {
    (void)state;
    char err[512], why[256];
    fi_gw_llama_opts o = s_q4_untied();
    fi_model *m = s_load(&o, FI_SIMD_AUTO, 1);
    const fi_config *c = fi_model_config(m);
    size_t V = (size_t)c->n_vocab;
    int32_t toks[12];
    s_tokens(toks, 12, c->n_vocab, 5);
    float *ref = malloc(V * sizeof *ref), *got = malloc(V * sizeof *got);
    fi_session *s = fi_session_new(m, 64, err, sizeof err);
    assert_non_null(s);
    assert_int_equal(fi_session_eval(s, toks, 12, ref, NULL, err, sizeof err), 0);
    assert_int_equal(fi_model_backend_failed(m, why, sizeof why), 0);

    fi_fault_backend *f = fi_fault_wrap(fi_model_backend(m));
    assert_non_null(f);
    fi_fault_set(f, 1);
    assert_int_equal(fi_session_eval(s, toks, 1, got, NULL, err, sizeof err), -1);
    printf("  pass: %s\n", err);
    assert_non_null(strstr(err, "injected failure"));
    assert_int_equal(fi_model_backend_failed(m, why, sizeof why), 1);
    printf("  failed: %s\n", why);
    assert_non_null(strstr(why, "injected failure"));
    /* not while a session holds memory on the failed backend */
    assert_int_equal(fi_model_reset_backend(m, err, sizeof err), -1);
    printf("  reset refused: %s\n", err);
    assert_non_null(strstr(err, "1 KV pool or session"));
    fi_session_destroy(&s);
    s_reset_and_eval(m, toks, 12, ref, got);
    /* f went with the old backend */
    assert_int_equal(fi_model_backend_failed(m, why, sizeof why), 0);
    free(ref);
    free(got);
    fi_model_destroy(&m);
}

/* The 8-bit KV cache (fi_model_opts.kv_bits): half the bytes per block
 * (a little more: a scale per head), logits close to the fp16 cache's, a
 * backend reset keeps the format, and a pool made in one format is
 * refused, by name, once the backend's has changed; a precision other
 * than 8 or 16 fails the load. */
static void test_kv_bits(void **state) {
    (void)state;
    char err[512];
    fi_gw_llama_opts o = s_q4_untied();
    const char *path = s_write(&o);
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU, .kv_bits = 12};
    assert_null(fi_model_load(path, &mo, err, sizeof err));
    assert_non_null(strstr(err, "KV cache precision must be 8 or 16 bits, not 12"));
    mo.kv_bits = 8; /* only the CPU has it: CUDA refuses, AUTO takes the CPU */
    mo.device = FI_DEVICE_CUDA;
    assert_null(fi_model_load(path, &mo, err, sizeof err));
    assert_non_null(strstr(err, "8-bit KV cache is for the CPU backend only"));
    mo.device = FI_DEVICE_AUTO;
    fi_model *m8 = fi_model_load(path, &mo, err, sizeof err);
    if (!m8) fail_msg("load: %s", err);
    assert_non_null(fi_cpu_backend_simd(fi_model_backend(m8)));
    mo.kv_bits = 0; /* the default, fp16 */
    mo.device = FI_DEVICE_CPU;
    fi_model *m16 = fi_model_load(path, &mo, err, sizeof err);
    unlink(path);
    assert_true(m16 && m8);
    assert_int_equal(fi_backend_kv_bits(fi_model_backend(m16)), 16);
    assert_int_equal(fi_backend_kv_bits(fi_model_backend(m8)), 8);
    const fi_config *c = fi_model_config(m8);
    size_t b16 = fi_kv_block_bytes(m16), b8 = fi_kv_block_bytes(m8);
    printf("  block bytes: %zu fp16, %zu 8-bit\n", b16, b8);
    assert_int_equal(b16, (size_t)c->n_layers * 2 * FI_KV_BLOCK * 2 * c->n_kv_heads * c->head_dim);
    assert_int_equal(b8, (size_t)c->n_layers * 2 * FI_KV_BLOCK *
                             (((size_t)c->n_kv_heads * c->head_dim + 3) / 4 * 4 + 4 * (size_t)c->n_kv_heads));
    size_t V = (size_t)c->n_vocab;
    int32_t toks[40];
    s_tokens(toks, 40, c->n_vocab, 9);
    float *l16 = malloc(V * sizeof *l16), *l8 = malloc(V * sizeof *l8), *again = malloc(V * sizeof *again);
    assert_true(l16 && l8 && again);
    fi_session *s16 = fi_session_new(m16, 64, err, sizeof err), *s8 = fi_session_new(m8, 64, err, sizeof err);
    assert_true(s16 && s8);
    assert_int_equal(fi_session_eval(s16, toks, 40, l16, NULL, err, sizeof err), 0);
    assert_int_equal(fi_session_eval(s8, toks, 40, l8, NULL, err, sizeof err), 0);
    double d = s_max_abs_diff(l8, l16, V), mx = 0;
    for (size_t i = 0; i < V; i++)
        mx = fmax(mx, fabs(l16[i]));
    printf("  logits after 40 tokens: max |8-bit - fp16| %.4f (largest |logit| %.2f)\n", d, mx);
    assert_true(d > 0.0 && d < 0.05 * mx); /* the cache is really int8, and close */
    /* a pool of the fp16 format on a backend switched to 8 bits: refused */
    assert_int_equal(fi_cpu_backend_set_kv_bits(fi_model_backend(m16), 8), 0);
    assert_int_equal(fi_session_eval(s16, toks, 1, l16, NULL, err, sizeof err), -1);
    printf("  stale pool: %s\n", err);
    assert_non_null(strstr(err, "not in the backend's cache format"));
    fi_session_destroy(&s16);
    /* the same where the two formats' rows have the same size (head_dim 4:
     * 8 bytes of fp16, or 4 quants and a scale): the format is compared */
    fi_gw_llama_opts o4 = s_q4_untied();
    o4.n_heads = 16; /* dim 64: head_dim 4 */
    o4.wtype = o4.embd_type = FI_DTYPE_F32;
    const char *p4 = s_write(&o4);
    mo.kv_bits = 16;
    fi_model *m4 = fi_model_load(p4, &mo, err, sizeof err);
    unlink(p4);
    if (!m4) fail_msg("load: %s", err);
    assert_int_equal(fi_model_config(m4)->head_dim, 4);
    assert_int_equal(fi_kv_row_bytes(FI_KV_ROW_Q8, 2, 4), fi_kv_row_bytes(FI_KV_ROW_F16, 2, 4));
    fi_session *s4 = fi_session_new(m4, 64, err, sizeof err);
    assert_non_null(s4);
    assert_int_equal(fi_session_eval(s4, toks, 8, NULL, NULL, err, sizeof err), 0);
    assert_int_equal(fi_cpu_backend_set_kv_bits(fi_model_backend(m4), 8), 0);
    assert_int_equal(fi_session_eval(s4, toks, 1, NULL, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "not in the backend's cache format"));
    fi_session_destroy(&s4);
    fi_model_destroy(&m4);
    /* a reset (a backend that failed for good) makes an 8-bit backend again */
    fi_session_destroy(&s8);
    s_reset_and_eval(m8, toks, 40, l8, again);
    assert_int_equal(fi_backend_kv_bits(fi_model_backend(m8)), 8);
    free(l16);
    free(l8);
    free(again);
    fi_model_destroy(&m16);
    fi_model_destroy(&m8);
}

/* The model file shrunk in place after the load (a copy of another file
 * over it): a reset, which binds the weights from the file's mapping
 * again, refuses naming the change instead of reading past the file's new
 * end (SIGBUS killed the process); the model stays failed, not gone. */
static void test_backend_reset_file_shrunk(void **state) {
    (void)state;
    char err[512], why[256];
    fi_gw_llama_opts o = s_q4_untied();
    const char *path = s_write(&o);
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU};
    fi_model *m = fi_model_load(path, &mo, err, sizeof err);
    if (!m) fail_msg("load failed: %s", err);
    fi_fault_backend *f = fi_fault_wrap(fi_model_backend(m));
    assert_non_null(f);
    fi_fault_set(f, 1);
    assert_int_equal(fi_model_backend_failed(m, why, sizeof why), 1);
    assert_int_equal(truncate(path, 4096), 0);
    assert_int_equal(fi_model_reset_backend(m, err, sizeof err), -1);
    printf("  reset refused: %s\n", err);
    assert_non_null(strstr(err, "changed size in place"));
    assert_non_null(strstr(err, path));
    assert_int_equal(fi_model_backend_failed(m, why, sizeof why), 1);
    unlink(path);
    fi_model_destroy(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eval_greedy),
        cmocka_unit_test(test_device_choice),
        cmocka_unit_test(test_pinned_sha256),
        cmocka_unit_test(test_config_and_shapes),
        cmocka_unit_test(test_batching_q8_0),
        cmocka_unit_test(test_batching_q4_1),
        cmocka_unit_test(test_batching_f32),
        cmocka_unit_test(test_batching_f16_long),
        cmocka_unit_test(test_rewind_reuses_prefix),
        cmocka_unit_test(test_context_limit),
        cmocka_unit_test(test_generate),
        cmocka_unit_test(test_portable_matches_simd),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_plan_pipeline),
        cmocka_unit_test(test_plan_tensor_parallel),
        cmocka_unit_test(test_plan_errors),
        cmocka_unit_test(test_backend_reset),
        cmocka_unit_test(test_kv_bits),
        cmocka_unit_test(test_backend_reset_file_shrunk),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
