/*
 * test_sched.c - the continuous-batching scheduler on tiny synthetic models
 * (tests/support/gguf_writer.h), fast enough for the sanitizer build:
 * batched generation equals one-at-a-time generation, prefix reuse skips
 * prefill and changes nothing, tenants and zones never share blocks, a
 * pool too small for the load still completes everything (preemption),
 * cancellation, bad submissions, the prefix filter, the forward hook, a
 * retry submitted from on_done, the prefill and decode counters, a pool of
 * one block, and the blocks a router expects against those reused.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "fi_sched.h"
#include "gen_capture.h"
#include "gguf_writer.h"

static fi_model *s_model(int ctx) {
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    o.ctx = ctx;
    char path[128], err[512];
    snprintf(path, sizeof path, "/tmp/fi_test_sched_%d.gguf", (int)getpid());
    assert_int_equal(fi_gw_tiny_llama_file(&o, path), 0);
    fi_model_opts mo = {.n_threads = 2, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU};
    fi_model *m = fi_model_load(path, &mo, err, sizeof err);
    unlink(path);
    if (!m) fail_msg("load: %s", err);
    return m;
}

static void s_tokens(int32_t *t, int n, int vocab, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        t[i] = 3 + (int32_t)((seed >> 8) % (uint32_t)(vocab - 3));
    }
}


/* The reference: one request alone in a session, through fi_generate. */
static void s_solo(fi_model *m, const int32_t *p, int n, int max_tokens, fi_capture *o) {
    char err[256];
    memset(o, 0, sizeof *o);
    fi_session *s = fi_session_new(m, 0, err, sizeof err);
    assert_non_null(s);
    fi_gen_opts g = fi_capture_greedy(max_tokens, o);
    fi_gen_result r;
    assert_int_equal(fi_generate(s, p, n, &g, &r, err, sizeof err), 0);
    o->n_generated = r.n_generated;
    o->stop = r.stop;
    o->done = 1;
    fi_session_destroy(&s);
}

static int64_t s_submit(fi_sched *s, const int32_t *p, int n, int max_tokens, fi_capture *o,
                        const char *tenant, const char *zone) {
    char err[256];
    fi_sched_req r = {.prompt = p, .n_prompt = n, .gen = fi_capture_greedy(max_tokens, o),
                      .on_done = fi_capture_done, .tenant = tenant, .zone = zone};
    int64_t id = fi_sched_submit(s, &r, err, sizeof err);
    if (id <= 0) fail_msg("submit: %s", err);
    return id;
}

static void s_run(fi_sched *s) {
    char err[256];
    for (int i = 0; i < 100000 && fi_sched_pending(s) > 0; i++)
        if (fi_sched_step(s, err, sizeof err) < 0) fail_msg("step: %s", err);
    assert_int_equal(fi_sched_pending(s), 0);
}

static void s_same(const fi_capture *a, const fi_capture *b, const char *what, int i) {
    if (a->n_generated != b->n_generated || a->stop != b->stop || a->len != b->len ||
        memcmp(a->text, b->text, a->len))
        fail_msg("%s: request %d differs: %d tokens (%s) vs %d (%s) of reference", what, i,
                 a->n_generated, fi_stop_reason_name(a->stop), b->n_generated,
                 fi_stop_reason_name(b->stop));
}

#define NP 6
static const int s_lens[NP] = {5, 90, 17, 33, 1, 64};

/* Prompts of different lengths entering at different steps, prefill in
 * chunks, equal the same requests run one at a time. */
static void test_batched_equals_single(void **state) {
    (void)state;
    fi_model *m = s_model(512);
    int V = fi_model_config(m)->n_vocab;
    int32_t p[NP][128];
    fi_capture solo[NP], got[NP];
    for (int i = 0; i < NP; i++) {
        s_tokens(p[i], s_lens[i], V, 100 + (uint32_t)i);
        s_solo(m, p[i], s_lens[i], 24, &solo[i]);
        memset(&got[i], 0, sizeof got[i]);
    }
    char err[256];
    fi_sched_opts so = {.max_seqs = 4, .step_tokens = 24, .n_ctx = 512};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    int next = 0;
    for (int step = 0; next < NP || fi_sched_pending(s); step++) {
        if (next < NP && step % 3 == 0) {
            s_submit(s, p[next], s_lens[next], 24, &got[next], "t", "eu");
            next++;
        }
        assert_true(fi_sched_step(s, err, sizeof err) >= 0);
        assert_true(step < 10000);
    }
    int total = 0;
    size_t text = 0;
    for (int i = 0; i < NP; i++) {
        total += solo[i].n_generated;
        text += solo[i].len;
    }
    assert_true(total > 2 * NP && text > 0); /* the comparison is about something */
    for (int i = 0; i < NP; i++) {
        assert_int_equal(got[i].done, 1);
        assert_int_equal(got[i].n_prompt, s_lens[i]);
        s_same(&got[i], &solo[i], "batched", i);
    }
    fi_sched_stats st;
    fi_sched_get_stats(s, &st);
    assert_int_equal(st.completed, NP);
    assert_int_equal(st.running + st.queued, 0);
    /* fewer forward passes than tokens: sequences shared steps */
    assert_true(st.steps < st.decode_tokens);
    assert_int_equal(st.blocks_free, st.blocks_total);
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

/* A shared prefix of 6 full blocks: the second request takes them from
 * the cache, computes only its own suffix, and answers as a cold run. */
static void test_prefix_reuse(void **state) {
    (void)state;
    fi_model *m = s_model(512);
    int V = fi_model_config(m)->n_vocab;
    int32_t a[110], b[110];
    s_tokens(a, 110, V, 7);
    memcpy(b, a, 96 * sizeof *b);
    s_tokens(b + 96, 14, V, 8);
    char err[256];
    fi_sched_opts so = {.n_ctx = 512};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    fi_capture oa = {0}, ob = {0}, cold;
    s_submit(s, a, 110, 12, &oa, "tenant-a", "eu");
    s_run(s);
    fi_sched_stats st0, st1;
    fi_sched_get_stats(s, &st0);
    assert_int_equal(st0.prefix_hit_tokens, 0);
    assert_true(st0.blocks_cached >= 6);
    s_submit(s, b, 110, 12, &ob, "tenant-a", "eu");
    s_run(s);
    fi_sched_get_stats(s, &st1);
    assert_int_equal(st1.prefix_hit_tokens - st0.prefix_hit_tokens, 96);
    assert_int_equal(st1.prefill_tokens - st0.prefill_tokens, 110 - 96);
    s_solo(m, b, 110, 12, &cold);
    s_same(&ob, &cold, "after prefix reuse", 1);

    /* the same prompt again from another tenant, or another zone: no hit */
    const char *who[][2] = {{"tenant-b", "eu"}, {"tenant-a", "us"}, {"tenant-a", "eu"}};
    for (int i = 0; i < 3; i++) {
        fi_sched_stats before, after;
        fi_sched_get_stats(s, &before);
        fi_capture o = {0};
        s_submit(s, a, 110, 12, &o, who[i][0], who[i][1]);
        s_run(s);
        fi_sched_get_stats(s, &after);
        uint64_t hit = after.prefix_hit_tokens - before.prefix_hit_tokens;
        if (i < 2 && hit != 0)
            fail_msg("%s/%s reused %llu cached tokens of another salt", who[i][0], who[i][1],
                     (unsigned long long)hit);
        if (i == 2) assert_int_equal(hit, 96 + 0); /* 110 tokens: 6 full blocks */
        s_same(&o, &oa, "same prompt", i);
    }
    /* forgetting the cache: the same prompt computes everything again */
    fi_sched_stats f0, f1;
    fi_sched_forget_cache(s);
    fi_sched_get_stats(s, &f0);
    assert_int_equal(f0.blocks_cached, 0);
    assert_int_equal(f0.blocks_free, f0.blocks_total);
    fi_capture of = {0};
    s_submit(s, a, 110, 12, &of, "tenant-a", "eu");
    s_run(s);
    fi_sched_get_stats(s, &f1);
    assert_int_equal(f1.prefix_hit_tokens, f0.prefix_hit_tokens);
    s_same(&of, &oa, "after forgetting", 0);
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

/* A pool of 20 blocks (320 positions) and 8 requests that need 80
 * positions each: all complete, equal to their solo runs, some
 * preempted; none fails. */
static void test_pool_exhaustion(void **state) {
    (void)state;
    fi_model *m = s_model(512);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    fi_sched_opts so = {.kv_bytes = 20 * fi_kv_block_bytes(m), .max_seqs = 8, .n_ctx = 512,
                        .step_tokens = 64};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    fi_sched_stats st;
    fi_sched_get_stats(s, &st);
    assert_int_equal(st.blocks_total, 20);
    int32_t p[8][40];
    fi_capture got[8], solo[8];
    for (int i = 0; i < 8; i++) {
        s_tokens(p[i], 40, V, 300 + (uint32_t)i);
        memset(&got[i], 0, sizeof got[i]);
        s_submit(s, p[i], 40, 40, &got[i], "t", "z");
    }
    s_run(s);
    for (int i = 0; i < 8; i++) {
        assert_int_equal(got[i].done, 1);
        assert_string_equal(got[i].error, "");
        s_solo(m, p[i], 40, 40, &solo[i]);
        s_same(&got[i], &solo[i], "under memory pressure", i);
    }
    fi_sched_get_stats(s, &st);
    assert_true(st.preemptions > 0); /* deterministic: one thread, no clocks */
    printf("  pool of 20 blocks, 8 x 80 positions: %llu preemptions, %llu steps\n",
           (unsigned long long)st.preemptions, (unsigned long long)st.steps);

    /* a request that cannot fit the pool even alone is refused up front */
    fi_capture big = {0};
    int32_t longp[300];
    s_tokens(longp, 300, V, 5);
    fi_sched_req r = {.prompt = longp, .n_prompt = 300, .gen = fi_capture_greedy(100, &big),
                      .on_done = fi_capture_done};
    assert_int_equal(fi_sched_submit(s, &r, err, sizeof err), -1);
    assert_non_null(strstr(err, "the pool holds 320"));
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

static void test_cancel_and_errors(void **state) {
    (void)state;
    fi_model *m = s_model(256);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    fi_sched_opts so = {.max_seqs = 1, .n_ctx = 256};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    int32_t p[20];
    s_tokens(p, 20, V, 1);
    fi_capture a = {0}, b = {0}, c = {0};
    int64_t ia = s_submit(s, p, 20, 50, &a, NULL, NULL);
    int64_t ib = s_submit(s, p, 20, 50, &b, NULL, NULL); /* queued: max_seqs 1 */
    c.cancel_after = 1;                                  /* cancels from its callback */
    s_submit(s, p, 20, 50, &c, NULL, NULL);
    assert_true(ia > 0 && ib > ia);
    assert_true(fi_sched_step(s, err, sizeof err) > 0);
    assert_int_equal(fi_sched_cancel(s, ia), 0);
    assert_int_equal(fi_sched_cancel(s, ib), 0);
    assert_int_equal(fi_sched_cancel(s, 9999), -1);
    s_run(s);
    assert_int_equal(a.done, 1);
    assert_int_equal(a.stop, FI_STOP_CANCEL);
    assert_int_equal(b.done, 1);
    assert_int_equal(b.stop, FI_STOP_CANCEL);
    assert_int_equal(b.n_generated, 0);
    assert_int_equal(c.done, 1);
    if (c.calls > 0) assert_int_equal(c.stop, FI_STOP_CANCEL);

    /* bad submissions name what is wrong */
    fi_capture x = {0};
    fi_sched_req r = {.prompt = p, .n_prompt = 0, .gen = fi_capture_greedy(4, &x)};
    assert_int_equal(fi_sched_submit(s, &r, err, sizeof err), -1);
    assert_non_null(strstr(err, "empty prompt"));
    int32_t bad[3] = {5, V, 6};
    r.prompt = bad;
    r.n_prompt = 3;
    assert_int_equal(fi_sched_submit(s, &r, err, sizeof err), -1);
    assert_non_null(strstr(err, "index 1 is outside the vocabulary"));
    r.prompt = p;
    r.n_prompt = 20;
    r.gen.max_tokens = -1;
    assert_int_equal(fi_sched_submit(s, &r, err, sizeof err), -1);
    assert_non_null(strstr(err, "max_tokens"));
    int32_t huge[300] = {0};
    r.prompt = huge;
    r.n_prompt = 300;
    r.gen.max_tokens = 1;
    assert_int_equal(fi_sched_submit(s, &r, err, sizeof err), -1);
    assert_non_null(strstr(err, "does not fit the context of 256"));
    assert_int_equal(x.done, 0); /* refused requests never call back */

    /* destroying with work pending ends it with an error */
    fi_capture d = {0};
    s_submit(s, p, 20, 50, &d, NULL, NULL);
    fi_sched_destroy(&s);
    assert_int_equal(d.done, 1);
    assert_non_null(strstr(d.error, "shutting down"));
    fi_model_destroy(&m);
}

/* The filter holds the chain hashes routers compute for a served prompt,
 * and not those of another tenant. */
static void test_prefix_filter(void **state) {
    (void)state;
    fi_model *m = s_model(512);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    fi_sched *s = fi_sched_new(m, NULL, err, sizeof err);
    assert_non_null(s);
    int32_t p[70];
    s_tokens(p, 70, V, 77);
    fi_capture o = {0};
    s_submit(s, p, 70, 4, &o, "acme", "de");
    s_run(s);
    uint64_t h[8], other[8];
    assert_int_equal(fi_prefix_hashes("acme", "de", p, 70, h, 8), 4);
    assert_int_equal(fi_prefix_hashes("acme", "fr", p, 70, other, 8), 4);
    for (int i = 0; i < 4; i++) assert_true(h[i] != other[i]);
    uint8_t bits[1024];
    assert_int_equal(fi_sched_prefix_filter(s, bits, 100), -1); /* not a power of two */
    assert_int_equal(fi_sched_prefix_filter(s, bits, sizeof bits), 0);
    assert_int_equal(fi_prefix_filter_match(bits, sizeof bits, h, 4), 4);
    assert_int_equal(fi_prefix_filter_match(bits, sizeof bits, other, 4), 0);
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

/* splitmix64: the next of a sequence of well-mixed 64-bit values. */
static uint64_t s_mix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A filter answers a hash it does not hold about as often as its fill
 * says (fill^FI_PREFIX_FILTER_PROBES), which the coordinator's router
 * counts on to tell a likely false hit. Its probes came from the hash's
 * low bits alone, and it answered about n/bits of them whatever the
 * fill: 12.4% where fill^3 is 3.0% (1000 hashes in 1 KiB), 4.5% where it
 * is 0.2% (3000 in 8 KiB). */
static void test_prefix_filter_false_rate(void **state) {
    (void)state;
    static const struct { size_t nbytes; int n; } cases[] = {{1024, 300}, {1024, 1000},
                                                             {8192, 3000}, {512, 1000}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        uint8_t *f = calloc(cases[k].nbytes, 1);
        assert_non_null(f);
        uint64_t x = 99; /* uniform values, as BLAKE2b chain hashes are */
        for (int b = 0; b < cases[k].n; b++) fi_prefix_filter_add(f, cases[k].nbytes, s_mix(&x));
        int ones = 0;
        for (size_t i = 0; i < cases[k].nbytes; i++) ones += __builtin_popcount(f[i]);
        double fill = (double)ones / (double)(cases[k].nbytes * 8);
        double expect = fill * fill * fill;
        int fp = 0;
        const int Q = 100000;
        for (int q = 0; q < Q; q++) fp += fi_prefix_filter_has(f, cases[k].nbytes, s_mix(&x));
        double got = (double)fp / Q;
        print_message("%5d hashes in %5zu bytes: fill %.3f, fill^3 %.4f, false %.4f\n", cases[k].n,
                      cases[k].nbytes, fill, expect, got);
        assert_true(got < 1.3 * expect + 0.001);
        free(f);
    }
}

/* A filter sized for a pool (fi_prefix_filter_bytes: 10 bits a block, a
 * power of two of 64..65536 bytes) holding every block of the pool
 * answers about 1-2% of hashes it does not hold; the fixed 1 KiB filter
 * every worker reported answered most of them once the pool held
 * thousands of blocks (measured here too). */
static void test_prefix_filter_size(void **state) {
    (void)state;
    assert_int_equal(fi_prefix_filter_bytes(-5), 64);
    assert_int_equal(fi_prefix_filter_bytes(0), 64);
    assert_int_equal(fi_prefix_filter_bytes(51), 64);   /* 510 bits */
    assert_int_equal(fi_prefix_filter_bytes(52), 128);  /* 520 bits */
    assert_int_equal(fi_prefix_filter_bytes(347), 512); /* SmolLM2-135M, 256 MiB */
    assert_int_equal(fi_prefix_filter_bytes(5000), 8192);
    assert_int_equal(fi_prefix_filter_bytes(52428), 65536);
    assert_int_equal(fi_prefix_filter_bytes(1 << 30), 65536);
    static const int pools[] = {300, 3000, 12000, 40000};
    for (size_t k = 0; k < sizeof pools / sizeof *pools; k++) {
        size_t nb = fi_prefix_filter_bytes(pools[k]);
        uint8_t *sized = calloc(nb, 1), fixed[1024] = {0};
        assert_non_null(sized);
        uint64_t x = 99; /* uniform 64-bit values, as BLAKE2b chain hashes are */
        for (int b = 0; b < pools[k]; b++) {
            uint64_t v = s_mix(&x);
            fi_prefix_filter_add(sized, nb, v);
            fi_prefix_filter_add(fixed, sizeof fixed, v);
        }
        int fp_sized = 0, fp_fixed = 0;
        for (int q = 0; q < 10000; q++) {
            uint64_t v = s_mix(&x);
            fp_sized += fi_prefix_filter_has(sized, nb, v);
            fp_fixed += fi_prefix_filter_has(fixed, sizeof fixed, v);
        }
        print_message("%5d blocks: %5zu-byte filter %.2f%% false, 1 KiB filter %.2f%%\n", pools[k], nb,
                      fp_sized / 100.0, fp_fixed / 100.0);
        assert_true(fp_sized < 250); /* 2.5% */
        free(sized);
    }
}

typedef struct hook {
    int calls;
    int fail_at;
} hook;

static int s_forward(void *user, fi_model *m, fi_kvpool *kv, const fi_batch *b, float *logits,
                     char *err, size_t errlen) {
    hook *h = user;
    if (++h->calls == h->fail_at) {
        snprintf(err, errlen, "rank 1 is gone");
        return -1;
    }
    return fi_model_forward(m, kv, b, NULL, NULL, logits, err, errlen);
}

/* The forward hook runs every step; a failing hook ends every request with
 * its message, and the scheduler serves again afterwards. */
static void test_forward_hook(void **state) {
    (void)state;
    fi_model *m = s_model(256);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    hook h = {0};
    fi_sched_opts so = {.forward = s_forward, .forward_user = &h, .n_ctx = 256};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    int32_t p[30];
    s_tokens(p, 30, V, 3);
    fi_capture a = {0}, ref;
    s_submit(s, p, 30, 10, &a, NULL, NULL);
    s_run(s);
    s_solo(m, p, 30, 10, &ref);
    s_same(&a, &ref, "through the hook", 0);
    assert_true(h.calls >= a.n_generated);

    fi_capture b = {0}, c = {0};
    h.fail_at = h.calls + 3;
    s_submit(s, p, 30, 10, &b, NULL, NULL);
    s_submit(s, p, 20, 10, &c, NULL, NULL);
    int rc = 0;
    for (int i = 0; i < 100 && fi_sched_pending(s); i++)
        if ((rc = fi_sched_step(s, err, sizeof err)) < 0) break;
    assert_int_equal(rc, -1);
    assert_non_null(strstr(err, "rank 1 is gone"));
    assert_int_equal(fi_sched_pending(s), 0);
    assert_int_equal(b.done + c.done, 2);
    assert_non_null(strstr(b.error, "rank 1 is gone"));
    fi_capture d = {0};
    s_submit(s, p, 30, 10, &d, NULL, NULL);
    s_run(s);
    s_same(&d, &ref, "after a failed step", 0);
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

/* A client's retry: on_done resubmits a request that failed. */
typedef struct retry {
    fi_sched *s;
    const int32_t *p;
    int n, dones, resubmitted, refused;
    char refusal[160];
} retry;

static void s_retry_done(void *user, const fi_gen_result *r, const char *error) {
    retry *t = user;
    (void)r;
    t->dones++;
    if (!error || t->dones > 100) return;
    char err[160];
    fi_sched_req q = {.prompt = t->p, .n_prompt = t->n, .on_done = s_retry_done};
    q.gen.user = t;
    q.gen.max_tokens = 4;
    q.gen.sampling = fi_sampler_defaults();
    q.gen.sampling.temperature = 0;
    if (fi_sched_submit(t->s, &q, err, sizeof err) > 0) {
        t->resubmitted++;
    } else {
        t->refused++;
        snprintf(t->refusal, sizeof t->refusal, "%s", err);
    }
}

/* A request that on_done submits while a failed pass ends everything
 * waits for the next step (it took no part in the failed pass); one
 * submitted while the scheduler is destroyed is refused, not lost. */
static void test_resubmit_from_on_done(void **state) {
    (void)state;
    fi_model *m = s_model(128);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    hook h = {.fail_at = 1};
    fi_sched_opts so = {.forward = s_forward, .forward_user = &h, .n_ctx = 128};
    int32_t p[20];
    s_tokens(p, 20, V, 11);
    retry t = {.p = p, .n = 20};
    t.s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(t.s);
    fi_sched_req q = {.prompt = p, .n_prompt = 20, .on_done = s_retry_done};
    q.gen.user = &t;
    q.gen.max_tokens = 4;
    q.gen.sampling = fi_sampler_defaults();
    q.gen.sampling.temperature = 0;
    assert_true(fi_sched_submit(t.s, &q, err, sizeof err) > 0);
    assert_int_equal(fi_sched_step(t.s, err, sizeof err), -1); /* the hook fails the first pass */
    assert_int_equal(t.dones, 1);
    assert_int_equal(t.resubmitted, 1);
    assert_int_equal(fi_sched_pending(t.s), 1); /* the retry, not yet run */
    s_run(t.s);                                  /* and it completes */
    assert_int_equal(t.dones, 2);
    assert_int_equal(t.resubmitted, 1);
    /* during destroy: the pending request ends with an error, its retry is refused */
    h.fail_at = -1;
    assert_true(fi_sched_submit(t.s, &q, err, sizeof err) > 0);
    fi_sched_destroy(&t.s);
    assert_int_equal(t.dones, 3);
    assert_int_equal(t.refused, 1);
    assert_non_null(strstr(t.refusal, "shutting down"));
    fi_model_destroy(&m);
}

/* The counters: a prompt's tokens are prefill however they are chunked
 * (also a last chunk of one token, a one-token prompt, or the one token a
 * prefix hit leaves); only newly sampled tokens count as decode. And a
 * pool of a single block is a valid configuration. */
static void test_counters_and_small_pool(void **state) {
    (void)state;
    fi_model *m = s_model(128);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    fi_sched_opts so = {.n_ctx = 128, .step_tokens = 16, .max_seqs = 4};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    int32_t p[64];
    s_tokens(p, 64, V, 5);
    static const struct {
        int off, n, max_tokens;
        uint64_t prefill, decode, hit;
    } c[] = {
        {0, 1, 0, 1, 0, 0},    /* a one-token prompt */
        {1, 33, 0, 33, 0, 0},  /* chunks of 16, 16 and 1 */
        {1, 17, 0, 1, 0, 16},  /* 16 of 17 from the cache */
        {40, 20, 3, 20, 2, 0}, /* 3 generated: the last is never computed */
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        fi_sched_stats a, z;
        fi_capture o = {0};
        fi_sched_get_stats(s, &a);
        s_submit(s, p + c[i].off, c[i].n, c[i].max_tokens, &o, NULL, NULL);
        s_run(s);
        fi_sched_get_stats(s, &z);
        assert_int_equal(o.n_generated, c[i].max_tokens);
        assert_int_equal(z.prefix_hit_tokens - a.prefix_hit_tokens, c[i].hit);
        assert_int_equal(z.prefill_tokens - a.prefill_tokens, c[i].prefill);
        assert_int_equal(z.decode_tokens - a.decode_tokens, c[i].decode);
    }
    fi_sched_destroy(&s);
    /* n_ctx 16 with one sequence: one block, enough */
    fi_sched_opts one = {.n_ctx = 16, .max_seqs = 1};
    s = fi_sched_new(m, &one, err, sizeof err);
    if (!s) fail_msg("one block: %s", err);
    fi_capture o = {0}, ref;
    s_submit(s, p, 10, 6, &o, NULL, NULL);
    s_run(s);
    s_solo(m, p, 10, 6, &ref);
    s_same(&o, &ref, "a one-block pool", 0);
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

/* A router that hashes all but a prompt's last token (fi_prefix_hashes)
 * expects exactly the blocks the scheduler then takes from its cache, for
 * prompts of a whole number of blocks too (the last token is always
 * computed, so its block is not taken). */
static void test_router_expects_what_is_reused(void **state) {
    (void)state;
    fi_model *m = s_model(256);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    fi_sched_opts so = {.n_ctx = 256};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    int32_t p[64];
    s_tokens(p, 64, V, 21);
    static uint8_t bits[1024];
    for (int n = 16; n <= 64; n += 8) {
        fi_capture a = {0}, b = {0};
        fi_sched_forget_cache(s);
        s_submit(s, p, n, 1, &a, "t", "z");
        s_run(s);
        uint64_t h[8];
        int nh = fi_prefix_hashes("t", "z", p, n - 1, h, 8);
        assert_int_equal(fi_sched_prefix_filter(s, bits, sizeof bits), 0);
        int expect = fi_prefix_filter_match(bits, sizeof bits, h, nh);
        fi_sched_stats st0, st1;
        fi_sched_get_stats(s, &st0);
        s_submit(s, p, n, 1, &b, "t", "z");
        s_run(s);
        fi_sched_get_stats(s, &st1);
        if ((int)(st1.prefix_hit_tokens - st0.prefix_hit_tokens) != expect * FI_KV_BLOCK)
            fail_msg("prompt of %d: the router expects %d blocks, the scheduler reused %d tokens", n,
                     expect, (int)(st1.prefix_hit_tokens - st0.prefix_hit_tokens));
        assert_int_equal(expect, (n - 1) / FI_KV_BLOCK);
    }
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

/* Eviction under memory pressure takes a cached chain's last blocks first:
 * its first block is what every lookup starts from, so evicting it (as
 * when blocks were released first to last) loses the whole chain though
 * most of it is still cached. A pool of 8 blocks: a 97-token prompt caches
 * 6, an unrelated 33-token one needs 3 (one eviction), and the first
 * prompt again still finds its first 5 blocks. */
static void test_eviction_keeps_chains(void **state) {
    (void)state;
    fi_model *m = s_model(128);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    fi_sched_opts so = {.kv_bytes = 8 * fi_kv_block_bytes(m), .max_seqs = 1, .n_ctx = 128};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    int32_t a[97], x[33];
    s_tokens(a, 97, V, 41);
    s_tokens(x, 33, V, 42);
    fi_capture o1 = {0}, o2 = {0}, o3 = {0};
    fi_sched_stats st0, st1, st2;
    s_submit(s, a, 97, 1, &o1, "t", "z");
    s_run(s);
    fi_sched_get_stats(s, &st0);
    assert_int_equal(st0.blocks_cached, 6);
    s_submit(s, x, 33, 1, &o2, "t", "z");
    s_run(s);
    fi_sched_get_stats(s, &st1);
    assert_int_equal(st1.evictions - st0.evictions, 1);
    s_submit(s, a, 97, 1, &o3, "t", "z");
    s_run(s);
    fi_sched_get_stats(s, &st2);
    if (st2.prefix_hit_tokens - st1.prefix_hit_tokens != 5 * FI_KV_BLOCK)
        fail_msg("after one eviction the prompt found %llu cached tokens, not the %d of its 5 blocks left",
                 (unsigned long long)(st2.prefix_hit_tokens - st1.prefix_hit_tokens), 5 * FI_KV_BLOCK);
    s_same(&o3, &o1, "after an eviction", 0);
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

/* The prefix table after churn: 300 distinct prompts through a pool of 8
 * blocks (every one evicting others) leave no slot taken but by a cached
 * block. With "deleted" marks every slot ended up marked, and each lookup
 * that missed then probed the whole table. */
static void test_prefix_table_churn(void **state) {
    (void)state;
    fi_model *m = s_model(64);
    int V = fi_model_config(m)->n_vocab;
    char err[256];
    fi_sched_opts so = {.kv_bytes = 8 * fi_kv_block_bytes(m), .max_seqs = 2, .n_ctx = 64};
    fi_sched *s = fi_sched_new(m, &so, err, sizeof err);
    assert_non_null(s);
    fi_sched_stats st;
    for (int i = 0; i < 300; i++) {
        int32_t p[40];
        s_tokens(p, 40, V, 1000 + (uint32_t)i);
        fi_capture o = {0};
        s_submit(s, p, 40, 1, &o, "t", "z");
        s_run(s);
        fi_sched_get_stats(s, &st);
        if (st.prefix_slots_used != st.blocks_cached)
            fail_msg("after prompt %d: %d of the %d slots taken for %d cached blocks", i,
                     st.prefix_slots_used, st.prefix_slots, st.blocks_cached);
    }
    assert_true(st.evictions > 200);
    assert_true(st.prefix_slots >= 2 * st.blocks_total);
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batched_equals_single),
        cmocka_unit_test(test_prefix_reuse),
        cmocka_unit_test(test_pool_exhaustion),
        cmocka_unit_test(test_cancel_and_errors),
        cmocka_unit_test(test_prefix_filter),
        cmocka_unit_test(test_prefix_filter_false_rate),
        cmocka_unit_test(test_prefix_filter_size),
        cmocka_unit_test(test_forward_hook),
        cmocka_unit_test(test_resubmit_from_on_done),
        cmocka_unit_test(test_counters_and_small_pool),
        cmocka_unit_test(test_router_expects_what_is_reused),
        cmocka_unit_test(test_eviction_keeps_chains),
        cmocka_unit_test(test_prefix_table_churn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
