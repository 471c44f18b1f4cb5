/*
 * test_policy_noalloc.c - proves that a decision allocates nothing: this
 * program is linked with -Wl,--wrap=malloc,calloc,realloc (tests/policy.cmake),
 * so every allocation made by the policy library goes through the counters
 * below. Parsing allocates (the control that shows the counters work);
 * fi_policy_decide, fi_policy_decide_slow, fi_verdict_explain, the flow
 * analysis of one combination and the fallback must not.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fi_cases.h"
#include "fi_policy.h"
#include "fi_policy_cmd.h"

/* The wrappers need state that outlives any call: the only globals here. */
static size_t g_allocs;  /* allocations seen while counting */
static int g_counting;   /* count only between s_start and s_stop */
static size_t g_fail_at; /* while counting, fail the allocation with this number (0: none) */

void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);

void *__wrap_malloc(size_t n) {
    g_allocs += g_counting;
    if (g_counting && g_fail_at && g_allocs == g_fail_at) return NULL;
    return __real_malloc(n);
}
void *__wrap_calloc(size_t k, size_t n) {
    g_allocs += g_counting;
    if (g_counting && g_fail_at && g_allocs == g_fail_at) return NULL;
    return __real_calloc(k, n);
}
void *__wrap_realloc(void *p, size_t n) {
    g_allocs += g_counting;
    if (g_counting && g_fail_at && g_allocs == g_fail_at) return NULL;
    return __real_realloc(p, n);
}

static void s_start(void) {
    g_allocs = 0;
    g_fail_at = 0;
    g_counting = 1;
}
static size_t s_stop(void) {
    g_counting = 0;
    return g_allocs;
}

static fi_policy *s_load_example(const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/../examples/policies/%s", FI_TEST_DIR, name);
    s_start();
    fi_policy *p = fi_policy_load(path, NULL);
    assert_true(s_stop() > 0); /* control: the counters see the library's allocations */
    assert_non_null(p);
    return p;
}

static void s_no_alloc_decisions(const fi_policy *p) {
    size_t n = fi_policy_target_count(p), nl = fi_policy_label_count(p);
    fi_verdict v[64];
    assert_true(n <= 64);
    const char *models[] = {NULL, "m1", "smollm2-135m", "not-known"};
    char line[512];
    s_start();
    for (uint32_t mask = 0; mask < (1u << nl); mask++)
        for (size_t o = 0; o < fi_policy_site_count(p); o++)
            for (int m = 0; m < 4; m++) {
                const char *labels[16];
                size_t k = 0;
                for (size_t l = 0; l < nl; l++)
                    if (mask >> l & 1) labels[k++] = fi_policy_label_name(p, l);
                fi_request r = {"id", m ? "tenant" : NULL, "app", fi_policy_site_name(p, o), models[m], labels, k,
                                m ? 100 : -1, m ? 1000 : -1};
                assert_int_equal(fi_policy_decide(p, &r, NULL, n, v), 0);
                for (size_t i = 0; i < n; i++) fi_verdict_explain(p, &v[i], NULL, line, sizeof line);
                assert_int_equal(fi_policy_decide_slow(p, &r, NULL, n, v), 0);
                (void)fi_verdict_best(v, n);
                for (size_t t = 0; t < n && mask < 4; t++) (void)fi_policy_flow(p, mask, o, t, line, sizeof line);
            }
    const char *bad[] = {"no-such-label"};
    fi_request r = {"id", NULL, NULL, "no-such-site", NULL, bad, 1, -1, -1};
    assert_int_equal(fi_policy_decide(p, &r, NULL, n, v), 0);
    size_t allocs = s_stop();
    assert_int_equal(allocs, 0);
}

static void test_examples(void **state) {
    (void)state;
    const char *files[] = {"eu-hospital.policy", "us-bank.policy", "sovereign.policy"};
    for (size_t i = 0; i < 3; i++) {
        fi_policy *p = s_load_example(files[i]);
        s_no_alloc_decisions(p);
        fi_policy_destroy(&p);
    }
}

static void test_generated_100(void **state) {
    (void)state;
    char *buf = malloc(100000);
    assert_non_null(buf);
    int len = fi_policy_bench_text(100, buf, 100000);
    assert_true(len > 0);
    fi_policy *p = fi_policy_parse(buf, (size_t)len, NULL);
    free(buf);
    assert_non_null(p);
    s_no_alloc_decisions(p);
    fi_policy_destroy(&p);
}

static void test_fallback(void **state) {
    (void)state;
    const char *names[] = {"a", "b"};
    fi_target_kind kinds[] = {FI_TARGET_SITE, FI_TARGET_CLUSTER};
    fi_verdict v[2];
    char line[256];
    s_start();
    fi_policy_fallback("a", names, kinds, 2, v);
    fi_verdict_explain(NULL, &v[0], names[0], line, sizeof line);
    assert_int_equal(s_stop(), 0);
}

/* Out of memory at every allocation of parsing, checking, compiling and
 * analysing a policy, of loading a cases file, and of decisions after it:
 * each either fails cleanly (NULL, an "out of memory" diagnostic) or
 * succeeds; nothing crashes and nothing leaks (LeakSanitizer in the
 * sanitizer build). */
static void test_out_of_memory(void **state) {
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/../examples/policies/eu-hospital.policy", FI_TEST_DIR);
    s_start();
    fi_policy *p = fi_policy_load(path, NULL);
    size_t total = s_stop();
    assert_non_null(p);
    fi_policy_destroy(&p);
    size_t failed = 0;
    for (size_t n = 1; n <= total + 1; n++) {
        fi_diags *d = fi_diags_new();
        s_start();
        g_fail_at = n;
        p = fi_policy_load(path, d);
        s_stop();
        if (!p) {
            failed++;
            /* a refused load says why, unless the diagnostics themselves had no memory */
            bool oom = false;
            for (size_t i = 0; i < fi_diags_count(d); i++) oom |= strstr(fi_diags_get(d, i)->msg, "out of memory") != NULL;
            assert_true(oom || fi_diags_count(d) == 0);
        } else {
            const char *labels[] = {"phi"};
            fi_request r = {"t", NULL, NULL, "berlin-clinic", NULL, labels, 1, -1, -1};
            fi_verdict v[16];
            assert_int_equal(fi_policy_decide(p, &r, NULL, fi_policy_target_count(p), v), 0);
        }
        fi_policy_destroy(&p);
        fi_diags_destroy(&d);
    }
    assert_true(failed > 0);
    snprintf(path, sizeof path, "%s/../examples/policies/eu-hospital.cases", FI_TEST_DIR);
    for (size_t n = 1; n <= 200; n++) {
        fi_diags *d = fi_diags_new();
        s_start();
        g_fail_at = n;
        fi_cases *cs = fi_cases_load(path, d);
        s_stop();
        fi_cases_destroy(&cs);
        fi_diags_destroy(&d);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_examples),
        cmocka_unit_test(test_generated_100),
        cmocka_unit_test(test_fallback),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
