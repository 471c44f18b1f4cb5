/*
 * test_sched_model.c - the continuous-batching scheduler on the default
 * model (SmolLM2-135M-Instruct): chat prompts of different lengths entering
 * at different steps answer exactly as each alone (also with 8-bit
 * activations); a request sharing a
 * 512-token prefix with an earlier one skips that prefill and answers as a
 * cold run, while another tenant or zone gets no hit; more long requests
 * than the KV pool holds all complete, unchanged.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fi_sched.h"
#include "gen_capture.h"

static fi_model *g_m;

/* Tokens generated a request. The sanitizer builds (tests/CMakeLists.txt
 * defines FI_SCHED_TEST_QUICK there: every memory access instrumented,
 * ThreadSanitizer's stage beside test_edge on 2 cores) make fewer, with
 * the same checks: the batches still mix prefill and decode, and the pool
 * still overflows (six requests of ~180 positions in 32 blocks of 16). */
#ifdef FI_SCHED_TEST_QUICK
#define GEN_BATCHED 16
#define GEN_PREFIX 8
#define GEN_PRESSURE 32
#else
#define GEN_BATCHED 32
#define GEN_PREFIX 16
#define GEN_PRESSURE 64
#endif

/* Chat-formatted prompt tokens of a user message. */
static int s_chat(const char *user, int32_t *ids, int cap) {
    char err[256];
    const fi_tok *tok = fi_model_tok(g_m);
    fi_chat_msg msg = {"user", user};
    char *text = fi_tok_chat(tok, &msg, 1, 1, err, sizeof err);
    assert_non_null(text);
    int n = fi_tok_encode(tok, text, strlen(text), 1, ids, cap);
    free(text);
    assert_true(n > 0 && n <= cap);
    return n;
}

static void s_solo(const int32_t *p, int n, int max_tokens, fi_capture *o) {
    char err[256];
    memset(o, 0, sizeof *o);
    fi_session *s = fi_session_new(g_m, 2048, err, sizeof err);
    assert_non_null(s);
    fi_gen_opts g = fi_capture_greedy(max_tokens, o);
    fi_gen_result r;
    if (fi_generate(s, p, n, &g, &r, err, sizeof err) != 0) fail_msg("generate: %s", err);
    o->n_generated = r.n_generated;
    o->stop = r.stop;
    o->done = 1;
    fi_session_destroy(&s);
}

static void s_submit(fi_sched *s, const int32_t *p, int n, int max_tokens, fi_capture *o,
                     const char *tenant, const char *zone) {
    char err[256];
    memset(o, 0, sizeof *o);
    fi_sched_req r = {.prompt = p, .n_prompt = n, .gen = fi_capture_greedy(max_tokens, o),
                      .on_done = fi_capture_done, .tenant = tenant, .zone = zone};
    if (fi_sched_submit(s, &r, err, sizeof err) <= 0) fail_msg("submit: %s", err);
}

static void s_run(fi_sched *s) {
    char err[256];
    while (fi_sched_pending(s) > 0)
        if (fi_sched_step(s, err, sizeof err) < 0) fail_msg("step: %s", err);
}

static void s_same(const fi_capture *a, const fi_capture *b, const char *what, int i) {
    if (a->n_generated != b->n_generated || a->stop != b->stop || a->len != b->len ||
        memcmp(a->text, b->text, a->len))
        fail_msg("%s: request %d differs:\n  got  %d tokens (%s): %s\n  want %d tokens (%s): %s",
                 what, i, a->n_generated, fi_stop_reason_name(a->stop), a->text, b->n_generated,
                 fi_stop_reason_name(b->stop), b->text);
}

static const char *s_questions[] = {
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in three sentences why hospitals keep patient records private, and who may read "
    "them, and what happens when a record must be sent to another country for a second "
    "opinion by a specialist.",
    "List five prime numbers.",
    "Translate 'good morning' into German, Spanish and Italian.",
    "hi",
};
#define NQ 6

static void s_batched_equals_alone(void) {
    int32_t p[NQ][256];
    int n[NQ];
    fi_capture solo[NQ], got[NQ];
    for (int i = 0; i < NQ; i++) {
        n[i] = s_chat(s_questions[i], p[i], 256);
        s_solo(p[i], n[i], GEN_BATCHED, &solo[i]);
    }
    char err[256];
    fi_sched_opts so = {.max_seqs = 8, .step_tokens = 32, .n_ctx = 2048};
    fi_sched *s = fi_sched_new(g_m, &so, err, sizeof err);
    assert_non_null(s);
    int next = 0;
    for (int step = 0; next < NQ || fi_sched_pending(s); step++) {
        if (next < NQ && step % 4 == 0) { /* newcomers join a running batch */
            s_submit(s, p[next], n[next], GEN_BATCHED, &got[next], "t", "eu");
            next++;
        }
        assert_true(fi_sched_step(s, err, sizeof err) >= 0);
    }
    for (int i = 0; i < NQ; i++) {
        assert_int_equal(got[i].done, 1);
        s_same(&got[i], &solo[i], "batched vs alone", i);
    }
    fi_sched_stats st;
    fi_sched_get_stats(s, &st);
    printf("  %d requests: %llu decode tokens in %llu steps (%.2f tokens per step)\n", NQ,
           (unsigned long long)st.decode_tokens, (unsigned long long)st.steps,
           (double)(st.decode_tokens + st.prefill_tokens) / (double)st.steps);
    assert_true(st.steps < st.decode_tokens + st.prefill_tokens);
    fi_sched_destroy(&s);
}

static void test_batched_equals_alone(void **state) {
    (void)state;
    s_batched_equals_alone();
}

/* The same with 8-bit activations (fi_cpu_backend_set_act_bits). */
static void test_batched_equals_alone_8bit(void **state) {
    (void)state;
    fi_backend *b = fi_model_backend(g_m);
    assert_non_null(fi_cpu_backend_simd(b)); /* s_setup made a CPU backend */
    assert_int_equal(fi_cpu_backend_set_act_bits(b, 8), 0);
    s_batched_equals_alone();
}

/* The same with the 8-bit KV cache (fi_cpu_backend_set_kv_bits; no pool
 * is alive between tests): every request's text must still be the one it
 * gets alone, with the same cache format. */
static void test_batched_equals_alone_kv8(void **state) {
    (void)state;
    fi_backend *b = fi_model_backend(g_m);
    assert_int_equal(fi_cpu_backend_set_kv_bits(b, 8), 0);
    s_batched_equals_alone();
}

/* Back to the default precisions for the tests that follow, even after a
 * failure. */
static int s_default_bits(void **state) {
    (void)state;
    fi_backend *b = fi_model_backend(g_m);
    return fi_cpu_backend_simd(b) &&
                   (fi_cpu_backend_set_act_bits(b, fi_cpu_backend_tiles(b) ? 12 : 16) != 0 ||
                    fi_cpu_backend_set_kv_bits(b, 16) != 0)
               ? -1
               : 0;
}

/* A 512-token document shared by two questions. */
static int s_doc_prompt(const char *question, int32_t *ids, int cap, int *n_prefix) {
    const fi_tok *tok = fi_model_tok(g_m);
    const char *para =
        "The regional health authority keeps discharge letters, laboratory results and "
        "imaging reports on servers inside the country. Clinicians may read the records of "
        "their own patients; researchers see only what an ethics board has approved. ";
    int n = 0;
    while (n < 512) {
        int k = fi_tok_encode(tok, para, strlen(para), 0, ids + n, cap - n);
        assert_true(k > 0);
        n += k;
    }
    n = 512; /* exactly 32 blocks */
    *n_prefix = n;
    int k = fi_tok_encode(tok, question, strlen(question), 0, ids + n, cap - n);
    assert_true(k > 0);
    return n + k;
}

static void test_prefix_512(void **state) {
    (void)state;
    int32_t a[1024], b[1024];
    int np;
    int na = s_doc_prompt(" Question: who may read the records?", a, 1024, &np);
    int nb = s_doc_prompt(" Question: where are the letters kept?", b, 1024, &np);
    char err[256];
    fi_sched_opts so = {.n_ctx = 2048};
    fi_sched *s = fi_sched_new(g_m, &so, err, sizeof err);
    assert_non_null(s);
    fi_capture oa, ob, cold;
    s_submit(s, a, na, GEN_PREFIX, &oa, "hospital-a", "fr");
    s_run(s);
    fi_sched_stats s0, s1;
    fi_sched_get_stats(s, &s0);
    s_submit(s, b, nb, GEN_PREFIX, &ob, "hospital-a", "fr");
    s_run(s);
    fi_sched_get_stats(s, &s1);
    unsigned long long hit = s1.prefix_hit_tokens - s0.prefix_hit_tokens;
    unsigned long long computed = s1.prefill_tokens - s0.prefill_tokens;
    printf("  second request: %d prompt tokens, %llu from the cache, %llu computed\n", nb, hit,
           computed);
    assert_int_equal(hit, 512);
    assert_int_equal(computed, (unsigned long long)(nb - 512));
    s_solo(b, nb, GEN_PREFIX, &cold);
    s_same(&ob, &cold, "after a 512-token prefix hit", 1);

    /* the same prompt from another tenant or another zone: nothing reused */
    const char *who[][2] = {{"hospital-b", "fr"}, {"hospital-a", "de"}};
    for (int i = 0; i < 2; i++) {
        fi_sched_stats x0, x1;
        fi_sched_get_stats(s, &x0);
        fi_capture o;
        s_submit(s, b, nb, GEN_PREFIX, &o, who[i][0], who[i][1]);
        s_run(s);
        fi_sched_get_stats(s, &x1);
        assert_int_equal(x1.prefix_hit_tokens - x0.prefix_hit_tokens, 0);
        assert_int_equal(x1.prefill_tokens - x0.prefill_tokens, (unsigned long long)nb);
        s_same(&o, &cold, "other salt", i);
    }
    fi_sched_destroy(&s);
}

/* Six requests of ~150 + GEN_PRESSURE tokens in a pool of 32 blocks (512
 * positions): they cannot all be resident; all complete, unchanged. */
static void test_pool_pressure(void **state) {
    (void)state;
    int32_t p[6][512 + 64];
    int n[6];
    fi_capture got[6], solo[6];
    for (int i = 0; i < 6; i++) {
        int np;
        n[i] = s_doc_prompt(s_questions[i], p[i], (int)(sizeof p[i] / sizeof p[i][0]), &np) - 512 + 150;
        memmove(p[i], p[i] + 512 - 150, (size_t)n[i] * sizeof(int32_t)); /* a 150-token tail */
        p[i][0] = (int32_t)(100 + i);                                   /* each its own */
    }
    char err[256];
    fi_sched_opts so = {.kv_bytes = 32 * fi_kv_block_bytes(g_m), .max_seqs = 6, .n_ctx = 2048};
    fi_sched *s = fi_sched_new(g_m, &so, err, sizeof err);
    assert_non_null(s);
    for (int i = 0; i < 6; i++) s_submit(s, p[i], n[i], GEN_PRESSURE, &got[i], "t", "z");
    s_run(s);
    fi_sched_stats st;
    fi_sched_get_stats(s, &st);
    printf("  6 requests in 32 blocks: %llu preemptions, %llu steps\n",
           (unsigned long long)st.preemptions, (unsigned long long)st.steps);
    assert_true(st.preemptions >= 1); /* the pool did overflow: recompute was exercised */
    for (int i = 0; i < 6; i++) {
        assert_int_equal(got[i].done, 1);
        assert_string_equal(got[i].error, "");
        s_solo(p[i], n[i], GEN_PRESSURE, &solo[i]);
        s_same(&got[i], &solo[i], "under KV pressure", i);
    }
    fi_sched_destroy(&s);
}

static int s_setup(void **state) {
    (void)state;
    char err[512];
    fi_model_opts o = {.n_threads = 2, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU};
    g_m = fi_model_load(FI_TEST_MODEL, &o, err, sizeof err);
    if (!g_m) {
        fprintf(stderr, "test_sched_model: %s\n", err);
        return -1;
    }
    return 0;
}

static int s_teardown(void **state) {
    (void)state;
    fi_model_destroy(&g_m);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batched_equals_alone),
        cmocka_unit_test_teardown(test_batched_equals_alone_8bit, s_default_bits),
        cmocka_unit_test_teardown(test_batched_equals_alone_kv8, s_default_bits),
        cmocka_unit_test(test_prefix_512),
        cmocka_unit_test(test_pool_pressure),
    };
    return cmocka_run_group_tests(tests, s_setup, s_teardown);
}
