/*
 * test_graph_replay.c - the engine's side of graph recording and
 * relaunching (graph_begin_sig), and of the fused operations, on the CPU.
 *
 * The model runs twice: on a plain CPU backend, and on one wrapped by
 * tests/support/graph_backend.c, which keeps CUDA's rules (recorded calls
 * run at graph_end, with the arguments they had; a step whose signature
 * equals its key's last recording is relaunched, its calls only checked
 * against the recording) and makes the fused operations the calls they
 * replace. Every logit must be the same bits on both: a signature that
 * left out something a step's calls depend on would relaunch stale
 * arguments, and the logits would differ (or the check would fail).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fi_kernels.h"
#include "fi_model.h"
#include "gguf_writer.h"
#include "graph_backend.h"

typedef struct pair {
    char path[64];
    fi_model *plain, *graph;
    fi_graph_backend *g;
    int V;
} pair;

static int setup(void **state) {
    pair *p = calloc(1, sizeof *p);
    assert_non_null(p);
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    o.n_layers = 3;
    o.dim = 128;
    o.n_heads = 4;
    o.n_kv_heads = 2;
    o.ffn_dim = 256;
    o.ctx = 512;
    snprintf(p->path, sizeof p->path, "/tmp/fi_test_graph_%d.gguf", (int)getpid());
    assert_int_equal(fi_gw_tiny_llama_file(&o, p->path), 0);
    char err[256];
    fi_model_opts mo = {.n_threads = 2, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU};
    p->plain = fi_model_load(p->path, &mo, err, sizeof err);
    p->graph = fi_model_load(p->path, &mo, err, sizeof err);
    assert_non_null(p->plain);
    assert_non_null(p->graph);
    p->g = fi_graph_wrap(fi_model_backend(p->graph));
    assert_non_null(p->g);
    p->V = fi_model_config(p->plain)->n_vocab;
    *state = p;
    return 0;
}

static int teardown(void **state) {
    pair *p = *state;
    fi_model_destroy(&p->plain);
    fi_model_destroy(&p->graph);
    unlink(p->path);
    free(p);
    return 0;
}

static void same_bits(const float *a, const float *b, size_t n, const char *what, int step) {
    if (memcmp(a, b, n * sizeof *a) != 0) {
        size_t i = 0;
        while (i < n && !memcmp(a + i, b + i, sizeof *a))
            i++;
        fail_msg("%s, step %d: logit %zu is %.9g, plain %.9g", what, step, i, (double)b[i],
                 (double)a[i]);
    }
}

/* One session decoding alone: after the first step of its key, every step
 * is relaunched. */
static void test_session_relaunches(void **state) {
    pair *p = *state;
    char err[256];
    fi_session *sa = fi_session_new(p->plain, 256, err, sizeof err);
    fi_session *sb = fi_session_new(p->graph, 256, err, sizeof err);
    assert_non_null(sa);
    assert_non_null(sb);
    float *la = calloc((size_t)p->V, sizeof *la), *lb = calloc((size_t)p->V, sizeof *lb);
    assert_non_null(la);
    assert_non_null(lb);
    int32_t prompt[12];
    for (int i = 0; i < 12; i++)
        prompt[i] = (int32_t)((i * 37 + 5) % p->V);
    assert_int_equal(fi_session_eval(sa, prompt, 12, la, NULL, err, sizeof err), 0);
    assert_int_equal(fi_session_eval(sb, prompt, 12, lb, NULL, err, sizeof err), 0);
    same_bits(la, lb, (size_t)p->V, "prompt", 0);
    long rec0, rel0;
    fi_graph_stats(p->g, &rec0, &rel0, NULL);
    const int steps = 40; /* crosses KV blocks of 16 positions twice */
    for (int s = 0; s < steps; s++) {
        int32_t t = fi_argmax_f32(la, p->V);
        assert_int_equal(fi_session_eval(sa, &t, 1, la, NULL, err, sizeof err), 0);
        if (fi_session_eval(sb, &t, 1, lb, NULL, err, sizeof err) != 0)
            fail_msg("step %d: %s", s, err);
        same_bits(la, lb, (size_t)p->V, "decode", s);
    }
    long rec, rel, direct;
    fi_graph_stats(p->g, &rec, &rel, &direct);
    printf("  %d steps: %ld recorded, %ld relaunched, %ld direct\n", steps, rec - rec0,
           rel - rel0, direct);
    assert_true(rel - rel0 >= steps - 2); /* the first step of the key, and one recording */
    free(la);
    free(lb);
    fi_session_destroy(&sa);
    fi_session_destroy(&sb);
}

/* Two sessions taking turns: their pools differ, so each step's signature
 * differs from its key's last recording, and each step records again. */
static void test_sessions_alternate(void **state) {
    pair *p = *state;
    char err[256];
    fi_session *s[4];
    for (int k = 0; k < 4; k++) {
        s[k] = fi_session_new(k < 2 ? p->plain : p->graph, 128, err, sizeof err);
        assert_non_null(s[k]);
    }
    float *l[4];
    for (int k = 0; k < 4; k++) {
        l[k] = calloc((size_t)p->V, sizeof *l[k]);
        assert_non_null(l[k]);
    }
    int32_t t[2] = {7, 11};
    long rel0;
    fi_graph_stats(p->g, NULL, &rel0, NULL);
    for (int step = 0; step < 30; step++) {
        for (int q = 0; q < 2; q++) { /* session q, then q's twin */
            assert_int_equal(fi_session_eval(s[q], &t[q], 1, l[q], NULL, err, sizeof err), 0);
            if (fi_session_eval(s[2 + q], &t[q], 1, l[2 + q], NULL, err, sizeof err) != 0)
                fail_msg("step %d: %s", step, err);
            same_bits(l[q], l[2 + q], (size_t)p->V, q ? "second session" : "first session", step);
            t[q] = fi_argmax_f32(l[q], p->V);
        }
    }
    long rel;
    fi_graph_stats(p->g, NULL, &rel, NULL);
    assert_int_equal(rel, rel0); /* never the same signature twice in a row */
    for (int k = 0; k < 4; k++) {
        free(l[k]);
        fi_session_destroy(&s[k]);
    }
}

/* Batched decode steps of 4 sequences through one pool, with block tables
 * that change between steps: relaunched steps upload new positions, slots
 * and tables. Then 3 of the sequences (another key), then 4 again, and
 * for a few steps tables of another width (another signature). */
static void test_batched_steps(void **state) {
    pair *p = *state;
    char err[256];
    enum { S = 4, MB = 8 };
    fi_kvpool *ka = fi_kvpool_new(p->plain, S * MB, 16, S, err, sizeof err);
    fi_kvpool *kb = fi_kvpool_new(p->graph, S * MB, 16, S, err, sizeof err);
    assert_non_null(ka);
    assert_non_null(kb);
    float *la = calloc((size_t)S * p->V, sizeof *la), *lb = calloc((size_t)S * p->V, sizeof *lb);
    assert_non_null(la);
    assert_non_null(lb);
    int32_t tables[S * MB], tok[S], pos[S] = {0, 5, 17, 30}, seq[S], rows[S];
    for (int s = 0; s < S; s++)
        for (int b = 0; b < MB; b++) /* interleaved, and each sequence's own */
            tables[s * MB + b] = b * S + (s + b) % S;
    long rel0;
    fi_graph_stats(p->g, NULL, &rel0, NULL);
    for (int step = 0; step < 48; step++) {
        int n = step >= 20 && step < 30 ? 3 : S; /* a smaller batch in between */
        for (int s = 0; s < n; s++) {
            tok[s] = (int32_t)((step * 13 + s * 7 + 1) % p->V);
            seq[s] = s;
            rows[s] = s;
        }
        /* steps 40-43: the same tables, 6 blocks wide (another signature) */
        int mb = step >= 40 && step < 44 ? 6 : MB;
        int32_t narrow[S * MB];
        for (int s = 0; s < S; s++)
            memcpy(narrow + s * mb, tables + s * MB, (size_t)mb * sizeof *narrow);
        fi_batch b = {.n = n, .tok = tok, .pos = pos, .seq = seq, .n_seqs = S,
                      .tables = mb == MB ? tables : narrow, .max_blocks = mb, .out_rows = rows,
                      .n_out = n};
        assert_int_equal(fi_model_forward(p->plain, ka, &b, NULL, NULL, la, err, sizeof err), 0);
        if (fi_model_forward(p->graph, kb, &b, NULL, NULL, lb, err, sizeof err) != 0)
            fail_msg("step %d: %s", step, err);
        same_bits(la, lb, (size_t)n * p->V, "batched", step);
        for (int s = 0; s < n; s++)
            pos[s]++;
        if (step == 35) /* the tables change: their bytes are uploaded, not recorded */
            for (int s = 0; s < S; s++)
                tables[s * MB + 7] = tables[s * MB + 6], tables[s * MB + 6] = 7 * S + s;
    }
    long rec, rel;
    fi_graph_stats(p->g, &rec, &rel, NULL);
    printf("  48 batched steps: %ld relaunched\n", rel - rel0);
    assert_true(rel - rel0 >= 36);
    free(la);
    free(lb);
    fi_kvpool_destroy(&ka);
    fi_kvpool_destroy(&kb);
}

/* Runs one step of b on both models' pools and compares the logits. */
static void s_step_both(pair *p, fi_kvpool *ka, fi_kvpool *kb, const fi_batch *b, float *la,
                        float *lb, const char *what, int step) {
    char err[256];
    assert_int_equal(fi_model_forward(p->plain, ka, b, NULL, NULL, la, err, sizeof err), 0);
    if (fi_model_forward(p->graph, kb, b, NULL, NULL, lb, err, sizeof err) != 0)
        fail_msg("%s, step %d: %s", what, step, err);
    same_bits(la, lb, (size_t)b->n_out * p->V, what, step);
}

/* Between two steps of key 1 with the same shape, a wide step of key 2
 * makes the engine's block-table buffer grow (freed and allocated again,
 * past 1024 entries), and a step of key 1 then has the sequences of
 * another n_seqs: each must record again, not relaunch old pointers or
 * sizes. (Found by a review: removing n_seqs from the signature passed the
 * tests above, and so did removing the tables' pointer before the wrapper
 * ended its recordings on alloc and free, as the CUDA backend does.) */
static void test_tables_grow_and_seqs_change(void **state) {
    pair *p = *state;
    char err[256];
    enum { NB = 64, WIDE = 600 };
    fi_kvpool *ka = fi_kvpool_new(p->plain, NB, 4, 2, err, sizeof err);
    fi_kvpool *kb = fi_kvpool_new(p->graph, NB, 4, 2, err, sizeof err);
    assert_non_null(ka);
    assert_non_null(kb);
    float *la = calloc((size_t)2 * p->V, sizeof *la), *lb = calloc((size_t)2 * p->V, sizeof *lb);
    assert_non_null(la);
    assert_non_null(lb);
    static int32_t tables[2 * WIDE];
    int32_t tok[2] = {3, 9}, pos[2] = {0, 0}, seq[2] = {0, 1}, rows[2] = {0, 1};
    for (int step = 0; step < 14; step++) {
        int wide = step == 4;        /* key 2: 2 x 600 table entries */
        int two_seqs = step >= 9;    /* key 1, the token in sequence 1 of 2 */
        int n = wide ? 2 : 1;
        for (int i = 0; i < 2 * WIDE; i++)
            tables[i] = (i * 5 + step) % NB;
        seq[0] = two_seqs ? 1 : 0;
        fi_batch b = {.n = n, .tok = tok, .pos = pos, .seq = seq,
                      .n_seqs = wide || two_seqs ? 2 : 1, .tables = tables,
                      .max_blocks = wide ? WIDE : 8, .out_rows = rows, .n_out = n};
        s_step_both(p, ka, kb, &b, la, lb, "tables and sequences", step);
        for (int k = 0; k < n; k++)
            pos[k]++;
        tok[0] = (tok[0] * 7 + 1) % p->V;
    }
    long rel;
    fi_graph_stats(p->g, NULL, &rel, NULL);
    printf("  14 steps: %ld relaunched\n", rel);
    assert_true(rel >= 6);
    free(la);
    free(lb);
    fi_kvpool_destroy(&ka);
    fi_kvpool_destroy(&kb);
}

/* Pools destroyed and made again (malloc may hand back the same
 * addresses): the steps on each new pool are the plain backend's. */
static void test_pools_made_again(void **state) {
    pair *p = *state;
    char err[256];
    float *la = calloc((size_t)p->V, sizeof *la), *lb = calloc((size_t)p->V, sizeof *lb);
    assert_non_null(la);
    assert_non_null(lb);
    int32_t table[4] = {0, 1, 2, 3}, tok = 5, pos = 0, seq = 0, row = 0;
    for (int round = 0; round < 4; round++) {
        fi_kvpool *ka = fi_kvpool_new(p->plain, 4, 4, 1, err, sizeof err);
        fi_kvpool *kb = fi_kvpool_new(p->graph, 4, 4, 1, err, sizeof err);
        assert_non_null(ka);
        assert_non_null(kb);
        for (int step = 0; step < 6; step++) {
            pos = step;
            tok = (tok * 11 + round + 1) % p->V;
            fi_batch b = {.n = 1, .tok = &tok, .pos = &pos, .seq = &seq, .n_seqs = 1,
                          .tables = table, .max_blocks = 4, .out_rows = &row, .n_out = 1};
            s_step_both(p, ka, kb, &b, la, lb, "pool made again", round * 10 + step);
        }
        fi_kvpool_destroy(&ka);
        fi_kvpool_destroy(&kb);
    }
    free(la);
    free(lb);
}

/* The wrapper itself: a relaunch whose calls differ from the recording
 * fails, naming it, instead of running stale work. */
static void test_differing_relaunch_fails(void **state) {
    pair *p = *state;
    fi_backend *be = fi_model_backend(p->graph);
    const fi_backend_ops *o = be->ops;
    float *a = o->alloc(be->ctx, 64 * sizeof(float)), *b = o->alloc(be->ctx, 64 * sizeof(float));
    assert_non_null(a);
    assert_non_null(b);
    const char sig[] = "sig";
    float h[64] = {0};
    assert_int_equal(o->graph_begin_sig(be->ctx, 9, 256, sig, sizeof sig), -1); /* direct */
    for (int step = 0; step < 3; step++) {
        assert_int_equal(o->graph_begin_sig(be->ctx, 9, 256, sig, sizeof sig), 0);
        assert_int_equal(o->to_backend(be->ctx, a, h, sizeof h), 0);
        o->add(be->ctx, step == 2 ? b : a, a, 64); /* the third differs */
        int rc = o->graph_end(be->ctx);
        if (step < 2) {
            assert_int_equal(rc, 0);
        } else {
            assert_int_equal(rc, -1);
            printf("  %s\n", o->last_error(be->ctx));
            assert_non_null(strstr(o->last_error(be->ctx), "graph replay"));
        }
    }
    o->free(be->ctx, a);
    o->free(be->ctx, b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_session_relaunches, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sessions_alternate, setup, teardown),
        cmocka_unit_test_setup_teardown(test_batched_steps, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tables_grow_and_seqs_change, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pools_made_again, setup, teardown),
        cmocka_unit_test_setup_teardown(test_differing_relaunch_fails, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
