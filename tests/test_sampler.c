/*
 * test_sampler.c - greedy, top-k, top-p, min-p, temperature, repetition
 * penalty and seeding, on small hand-made distributions.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fi_model.h"

#define V 1000

static void s_logits(float *l, uint32_t seed) {
    for (int i = 0; i < V; i++) {
        seed = seed * 1664525u + 1013904223u;
        l[i] = (float)(seed >> 8) / (float)(1u << 24) * 4.0f - 2.0f;
    }
}

static fi_sampler_params s_off(void) {
    fi_sampler_params p = fi_sampler_defaults();
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.repeat_penalty = 1.0f;
    p.temperature = 1.0f;
    return p;
}

static void test_greedy_is_argmax(void **state) {
    (void)state;
    float l[V];
    s_logits(l, 1);
    l[123] = 10.0f;
    fi_sampler_params p = s_off();
    p.temperature = 0.0f;
    fi_sampler *s = fi_sampler_new(&p, V);
    assert_int_equal(fi_sampler_sample(s, l, NULL, 0), 123);
    fi_sampler_destroy(&s);
    assert_null(s);
}

/* fi_argmax: the first index of the maximum at every place, with ties,
 * lengths that are not a multiple of its eight lanes, infinities and NaNs. */
static void test_argmax(void **state) {
    (void)state;
    float x[37];
    for (int n = 1; n <= 37; n++)
        for (int at = 0; at < n; at++) {
            for (int i = 0; i < n; i++)
                x[i] = (float)((i * 7) % 5) - 3.0f;
            x[at] = 5.0f;
            assert_int_equal(fi_argmax(x, n), at);
            if (at + 3 < n) {
                x[at + 3] = 5.0f; /* a tie: the first wins */
                assert_int_equal(fi_argmax(x, n), at);
            }
        }
    for (int i = 0; i < 37; i++)
        x[i] = NAN;
    assert_int_equal(fi_argmax(x, 37), 0);
    x[20] = -INFINITY;
    assert_int_equal(fi_argmax(x, 37), 20);
    x[30] = 1.0f;
    x[0] = INFINITY;
    assert_int_equal(fi_argmax(x, 37), 0);
}

static void test_top_k_one_is_greedy(void **state) {
    (void)state;
    fi_sampler_params p = s_off();
    p.top_k = 1;
    fi_sampler *s = fi_sampler_new(&p, V);
    for (uint32_t seed = 0; seed < 50; seed++) {
        float l[V], c[V];
        s_logits(l, seed);
        memcpy(c, l, sizeof l);
        int best = 0;
        for (int i = 1; i < V; i++)
            if (l[i] > l[best]) best = i;
        assert_int_equal(fi_sampler_sample(s, c, NULL, 0), best);
    }
    fi_sampler_destroy(&s);
}

static void test_seed_determinism(void **state) {
    (void)state;
    fi_sampler_params p = fi_sampler_defaults();
    p.seed = 42;
    fi_sampler *a = fi_sampler_new(&p, V), *b = fi_sampler_new(&p, V);
    p.seed = 43;
    fi_sampler *c = fi_sampler_new(&p, V);
    int differ = 0;
    for (uint32_t i = 0; i < 200; i++) {
        float l1[V], l2[V], l3[V];
        s_logits(l1, i);
        memcpy(l2, l1, sizeof l1);
        memcpy(l3, l1, sizeof l1);
        int x = fi_sampler_sample(a, l1, NULL, 0), y = fi_sampler_sample(b, l2, NULL, 0);
        assert_int_equal(x, y);
        differ += fi_sampler_sample(c, l3, NULL, 0) != x;
    }
    assert_true(differ > 0); /* another seed gives another sequence */
    fi_sampler_destroy(&a);
    fi_sampler_destroy(&b);
    fi_sampler_destroy(&c);
}

/* Draw many times from a 4-way distribution and compare frequencies. */
static void s_frequencies(fi_sampler_params p, const float *base, int n_draws, double *freq) {
    fi_sampler *s = fi_sampler_new(&p, V);
    int count[V] = {0};
    for (int i = 0; i < n_draws; i++) {
        float l[V];
        memcpy(l, base, sizeof l);
        int id = fi_sampler_sample(s, l, NULL, 0);
        assert_true(id >= 0 && id < V);
        count[id]++;
    }
    for (int i = 0; i < V; i++) freq[i] = (double)count[i] / n_draws;
    fi_sampler_destroy(&s);
}

static void s_four_way(float *l) {
    /* probabilities 0.5, 0.25, 0.15, 0.10 over ids 7, 8, 9, 10; rest -inf */
    for (int i = 0; i < V; i++) l[i] = -INFINITY;
    l[7] = logf(0.5f);
    l[8] = logf(0.25f);
    l[9] = logf(0.15f);
    l[10] = logf(0.10f);
}

static void test_temperature_one_matches_softmax(void **state) {
    (void)state;
    float l[V];
    double f[V];
    s_four_way(l);
    s_frequencies(s_off(), l, 20000, f);
    assert_true(fabs(f[7] - 0.50) < 0.02);
    assert_true(fabs(f[8] - 0.25) < 0.02);
    assert_true(fabs(f[9] - 0.15) < 0.02);
    assert_true(fabs(f[10] - 0.10) < 0.02);
}

static void test_top_p_keeps_the_nucleus(void **state) {
    (void)state;
    float l[V];
    double f[V];
    s_four_way(l);
    fi_sampler_params p = s_off();
    p.top_p = 0.7f; /* 0.5 + 0.25 reaches 0.7: ids 7 and 8 only */
    s_frequencies(p, l, 20000, f);
    assert_true(f[9] == 0.0 && f[10] == 0.0);
    assert_true(fabs(f[7] - 2.0 / 3.0) < 0.02);
}

static void test_top_p_over_full_vocab(void **state) {
    (void)state;
    /* no top-k: the nucleus is found among all V tokens */
    float l[V];
    double f[V];
    for (int i = 0; i < V; i++) l[i] = 0.0f;
    l[500] = 10.0f; /* p ~ 0.957 */
    fi_sampler_params p = s_off();
    p.top_p = 0.9f;
    s_frequencies(p, l, 2000, f);
    assert_true(f[500] == 1.0);
}

static void test_min_p(void **state) {
    (void)state;
    float l[V];
    double f[V];
    s_four_way(l);
    fi_sampler_params p = s_off();
    p.min_p = 0.4f; /* keep p >= 0.2: ids 7 and 8 */
    s_frequencies(p, l, 20000, f);
    assert_true(f[9] == 0.0 && f[10] == 0.0 && f[7] > 0.6);
}

static void test_low_temperature_sharpens(void **state) {
    (void)state;
    float l[V];
    double f[V];
    s_four_way(l);
    fi_sampler_params p = s_off();
    p.temperature = 0.1f;
    s_frequencies(p, l, 5000, f);
    assert_true(f[7] > 0.99);
}

static void test_repeat_penalty(void **state) {
    (void)state;
    float l[V];
    for (int i = 0; i < V; i++) l[i] = -5.0f;
    l[1] = 2.0f;
    l[2] = 1.5f;
    int32_t hist[] = {1, 1, 1};
    fi_sampler_params p = s_off();
    p.temperature = 0.0f;
    p.repeat_penalty = 2.0f; /* 2.0 -> 1.0 < 1.5: token 2 wins */
    fi_sampler *s = fi_sampler_new(&p, V);
    assert_int_equal(fi_sampler_sample(s, l, hist, 3), 2);
    assert_true(l[1] == 1.0f); /* penalised once, not three times */
    /* a negative logit is multiplied */
    for (int i = 0; i < V; i++) l[i] = -1.0f;
    l[5] = -0.4f;
    l[6] = -0.5f;
    int32_t h2[] = {5};
    assert_int_equal(fi_sampler_sample(s, l, h2, 1), 6);
    /* repeat_last_n bounds the window */
    fi_sampler_destroy(&s);
    p.repeat_last_n = 1;
    s = fi_sampler_new(&p, V);
    for (int i = 0; i < V; i++) l[i] = -5.0f;
    l[1] = 2.0f;
    l[2] = 1.5f;
    int32_t h3[] = {1, 9};
    assert_int_equal(fi_sampler_sample(s, l, h3, 2), 1);
    fi_sampler_destroy(&s);
}

/* OpenAI's penalties count only the generated tokens (after the prompt):
 * presence once per token, frequency per occurrence; logit_bias adds. */
static void test_openai_penalties_and_bias(void **state) {
    (void)state;
    float l[V];
    fi_sampler_params p = s_off();
    p.temperature = 0.0f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    fi_sampler *s = fi_sampler_new(&p, V);
    assert_non_null(s);
    fi_sampler_prompt_len(s, 2);
    /* prompt 7, 7; generated 3, 3, 3, 4 */
    int32_t hist[] = {7, 7, 3, 3, 3, 4};
    for (int i = 0; i < V; i++) l[i] = 0.0f;
    l[3] = 3.0f;
    l[4] = 2.0f;
    l[7] = 1.0f;
    (void)fi_sampler_sample(s, l, hist, 6);
    assert_true(l[3] == 3.0f - 0.5f - 3 * 0.25f); /* 1.75 */
    assert_true(l[4] == 2.0f - 0.5f - 0.25f);     /* 1.25 */
    assert_true(l[7] == 1.0f);                    /* in the prompt only: untouched */
    assert_true(l[5] == 0.0f);
    /* the presence marks are cleared between calls: 3, marked above, is
     * penalised once again (stale marks would leave it at -0.25) */
    for (int i = 0; i < V; i++) l[i] = 0.0f;
    int32_t h2[] = {7, 7, 3};
    (void)fi_sampler_sample(s, l, h2, 3);
    assert_true(l[3] == -0.75f && l[5] == 0.0f);
    fi_sampler_destroy(&s);
    /* logit_bias: -100 bans the argmax, +100 crowns another; ids outside
     * the vocabulary are ignored */
    p = s_off();
    p.temperature = 0.0f;
    p.n_bias = 3;
    p.bias[0] = (fi_logit_bias){1, -100.0f};
    p.bias[1] = (fi_logit_bias){9, 5.0f};
    p.bias[2] = (fi_logit_bias){V + 5, 100.0f};
    s = fi_sampler_new(&p, V);
    for (int i = 0; i < V; i++) l[i] = 0.0f;
    l[1] = 10.0f;
    l[2] = 4.0f;
    assert_int_equal(fi_sampler_sample(s, l, NULL, 0), 9);
    fi_sampler_destroy(&s);
}

static void test_bad_input(void **state) {
    (void)state;
    assert_null(fi_sampler_new(NULL, 0));
    fi_sampler_destroy(NULL);
    /* NaN logits are never chosen */
    float l[V];
    for (int i = 0; i < V; i++) l[i] = NAN;
    l[3] = 0.0f;
    fi_sampler_params p = s_off();
    fi_sampler *s = fi_sampler_new(&p, V);
    assert_int_equal(fi_sampler_sample(s, l, NULL, 0), 3);
    fi_sampler_destroy(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_is_argmax),
        cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_top_k_one_is_greedy),
        cmocka_unit_test(test_seed_determinism),
        cmocka_unit_test(test_temperature_one_matches_softmax),
        cmocka_unit_test(test_top_p_keeps_the_nucleus),
        cmocka_unit_test(test_top_p_over_full_vocab),
        cmocka_unit_test(test_min_p),
        cmocka_unit_test(test_low_temperature_sharpens),
        cmocka_unit_test(test_repeat_penalty),
        cmocka_unit_test(test_openai_penalties_and_bias),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
