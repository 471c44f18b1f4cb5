/*
 * test_group_net.c - the CURVE mesh between a shard group's ranks and its
 * collectives, with real sockets on loopback (each rank has its own
 * ZeroMQ context, as separate processes would):
 *   - the mesh comes up; the TP sum over 3 ranks is exact and bit-identical
 *     on every rank; messages out of order and of other passes are kept
 *     apart; stale passes are dropped;
 *   - a key that is not in the group file gets no link, either way;
 *   - a rank that goes away is seen down at once and a wait in a pass
 *     fails naming it; it comes back with a new link serial;
 *   - a failure notice ends the other ranks' waits in that pass.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fi_group_coll.h"
#include "fi_group_net.h"
#include "fi_wire.h"
#include "net_ports.h"

#define N 3

typedef struct fixture {
    char dir[64];              /* temporary folder: keys, group file */
    fi_keypair kp[N + 1];      /* ranks' keys, and an intruder's */
    fi_group_conf g;           /* a world of N, tp N */
    fi_gnet *net[N];           /* the ranks */
} fixture;

static void s_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "/tmp/fi_group_net_XXXXXX");
    if (!mkdtemp(f->dir)) return -1;
    char path[128], err[256];
    snprintf(path, sizeof path, "%s/group.conf", f->dir);
    FILE *fp = fopen(path, "w");
    if (!fp) return -1;
    int base = fi_test_free_ports(N);
    if (base < 0) return -1;
    fprintf(fp, "group = nettest\nworld = %d\nheartbeat_ms = 50\ntimeout_ms = 400\n", N);
    for (int r = 0; r <= N; r++) {
        char sec[128], pub[128];
        snprintf(sec, sizeof sec, "%s/r%d.key", f->dir, r);
        snprintf(pub, sizeof pub, "%s/r%d.pub", f->dir, r);
        if (fi_keys_generate(&f->kp[r]) || fi_keys_save(&f->kp[r], sec, pub, 0, err, sizeof err))
            return -1;
        if (r < N) fprintf(fp, "endpoint.%d = tcp://127.0.0.1:%d\nkey.%d = r%d.pub\n", r, base + r, r, r);
    }
    fclose(fp);
    if (fi_group_conf_load(path, &f->g, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    for (int r = 0; r < N; r++) fi_gnet_destroy(&f->net[r]);
    for (int r = 0; r <= N; r++) fi_keys_wipe(&f->kp[r]);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", f->dir);
    if (system(cmd) != 0) return -1;
    free(f);
    return 0;
}

/* Pumps every rank until all links are up or ms pass. 1 when all up. */
static int s_wait_mesh(fixture *f, int ms) {
    char err[256];
    for (int waited = 0; waited < ms; waited += 10) {
        int all = 1;
        for (int r = 0; r < N; r++) {
            if (!f->net[r]) continue;
            assert_true(fi_gnet_pump(f->net[r], 0, err, sizeof err) >= 0);
            for (int q = 0; q < N; q++)
                if (f->net[q] && !fi_gnet_up(f->net[r], q)) all = 0;
        }
        if (all) return 1;
        s_sleep_ms(10);
    }
    return 0;
}

static void s_start_all(fixture *f) {
    char err[256];
    for (int r = 0; r < N; r++) {
        f->net[r] = fi_gnet_new(&f->g, r, &f->kp[r], err, sizeof err);
        if (!f->net[r]) fprintf(stderr, "rank %d: %s\n", r, err);
        assert_non_null(f->net[r]);
    }
    assert_true(s_wait_mesh(f, 5000));
}

typedef struct s_job {
    fi_gnet *net;     /* the rank */
    float *x;         /* its vector, summed in place */
    size_t len;
    int rc;
    char err[256];
} s_job;

static void *s_allreduce_main(void *arg) {
    s_job *j = arg;
    float *acc = malloc(j->len * sizeof *acc);
    j->rc = 0;
    /* Two sums in a row in the same pass (op 0 and 1), as a layer makes. */
    for (uint32_t op = 0; op < 2 && j->rc == 0; op++)
        j->rc = fi_gcoll_allreduce(j->net, 0, N, 42, op, j->x, j->len, acc,
                                   fi_wire_now_ms() + 10000, j->err, sizeof j->err);
    free(acc);
    return NULL;
}

static void test_mesh_and_sum(void **state) {
    fixture *f = *state;
    s_start_all(f);
    /* A 100000-float vector (400 KB, like a prefill's activations). */
    const size_t len = 100000;
    s_job jobs[N];
    pthread_t th[N];
    for (int r = 0; r < N; r++) {
        jobs[r] = (s_job){f->net[r], malloc(len * sizeof(float)), len, 0, ""};
        for (size_t i = 0; i < len; i++) jobs[r].x[i] = (float)(r + 1) * 0.1f + (float)i * 1e-3f;
    }
    for (int r = 0; r < N; r++) pthread_create(&th[r], NULL, s_allreduce_main, &jobs[r]);
    for (int r = 0; r < N; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < N; r++) {
        if (jobs[r].rc) fprintf(stderr, "rank %d: %s\n", r, jobs[r].err);
        assert_int_equal(jobs[r].rc, 0);
    }
    /* Twice summed over 3 ranks: 3 * (3 * mean) ... computed the same way. */
    for (size_t i = 0; i < len; i += 997) {
        float once = 0, v[N];
        for (int r = 0; r < N; r++) v[r] = (float)(r + 1) * 0.1f + (float)i * 1e-3f;
        once = v[0] + v[1];
        once = once + v[2];
        float twice = once + once;
        twice = twice + once;
        assert_true(jobs[0].x[i] == twice);
    }
    for (int r = 1; r < N; r++) assert_memory_equal(jobs[0].x, jobs[r].x, len * sizeof(float));
    for (int r = 0; r < N; r++) free(jobs[r].x);
    uint64_t bytes = 0, msgs = 0;
    fi_gnet_counters(f->net[0], &bytes, &msgs);
    printf("rank 0 sent %llu bytes in %llu messages for 2 sums of %zu floats\n",
           (unsigned long long)bytes, (unsigned long long)msgs, len);
    assert_int_equal(msgs, 2 * (N - 1));
    assert_true(bytes >= 2 * (N - 1) * len * sizeof(float));

    /* Pass and kind keep messages apart; older passes are dropped. */
    char err[256];
    assert_int_equal(fi_gnet_send(f->net[1], 0, FI_G_ACT, 7, 0, "old", 3, err, sizeof err), 0);
    assert_int_equal(fi_gnet_send(f->net[1], 0, FI_G_ACT, 8, 0, "new", 3, err, sizeof err), 0);
    assert_int_equal(fi_gnet_send(f->net[2], 0, FI_G_LOGITS, 8, 0, "lg", 2, err, sizeof err), 0);
    fi_gmsg *m = NULL;
    assert_int_equal(fi_gcoll_wait(f->net[0], 2, FI_G_LOGITS, 8, UINT32_MAX,
                                   fi_wire_now_ms() + 3000, &m, err, sizeof err),
                     0);
    assert_int_equal(m->from, 2);
    assert_int_equal(m->len, 2);
    fi_gmsg_free(&m);
    /* rank 1's two messages come on their own link, in order: once "new"
     * is here, "old" is too (waiting for rank 2's says nothing of them) */
    for (int i = 0; i < 300 && !(m = fi_gnet_take(f->net[0], 1, FI_G_ACT, 8)); i++)
        assert_true(fi_gnet_pump(f->net[0], 10, err, sizeof err) >= 0);
    assert_non_null(m);
    assert_memory_equal(m->data, "new", 3);
    fi_gmsg_free(&m);
    assert_non_null(fi_gnet_peek(f->net[0], 1, FI_G_ACT)); /* "old", still waiting */
    fi_gnet_drop_before(f->net[0], 8);
    assert_null(fi_gnet_take(f->net[0], 1, FI_G_ACT, 7));
    /* An op out of order is an error, not a silent mix-up. */
    assert_int_equal(fi_gnet_send(f->net[1], 0, FI_G_PART, 9, 5, "x", 1, err, sizeof err), 0);
    assert_int_equal(fi_gcoll_wait(f->net[0], 1, FI_G_PART, 9, 4, fi_wire_now_ms() + 3000, &m,
                                   err, sizeof err),
                     -1);
    assert_non_null(strstr(err, "number 5 of pass 9 where number 4 was due"));
    /* Sending to oneself or past the world is refused. */
    assert_int_equal(fi_gnet_send(f->net[1], 1, FI_G_ACT, 1, 0, "x", 1, err, sizeof err), -1);
    assert_int_equal(fi_gnet_send(f->net[1], N, FI_G_ACT, 1, 0, "x", 1, err, sizeof err), -1);
}

static void test_foreign_key_refused(void **state) {
    fixture *f = *state;
    char err[256];
    /* Rank 0 runs; an intruder with its own key claims rank 1 (a group
     * file naming its key for rank 1). Neither side gets a link. */
    f->net[0] = fi_gnet_new(&f->g, 0, &f->kp[0], err, sizeof err);
    assert_non_null(f->net[0]);
    fi_group_conf evil = f->g;
    memcpy(evil.pub[1], f->kp[N].pub, FI_KEYS_BYTES);
    /* Its own key must match its group file's: */
    assert_null(fi_gnet_new(&f->g, 1, &f->kp[N], err, sizeof err));
    assert_non_null(strstr(err, "key.1 is not the public half"));
    fi_gnet *intruder = fi_gnet_new(&evil, 1, &f->kp[N], err, sizeof err);
    assert_non_null(intruder);
    for (int i = 0; i < 100; i++) {
        assert_true(fi_gnet_pump(f->net[0], 5, err, sizeof err) >= 0);
        assert_true(fi_gnet_pump(intruder, 5, err, sizeof err) >= 0);
    }
    assert_int_equal(fi_gnet_up(f->net[0], 1), 0);
    assert_int_equal(fi_gnet_up(intruder, 0), 0);
    assert_int_equal(fi_gnet_send(intruder, 0, FI_G_BATCH, 1, 0, "x", 1, err, sizeof err), -1);
    assert_non_null(strstr(err, "rank 0 is not connected"));
    fi_gnet_destroy(&intruder);
    /* The real rank 1 gets in. */
    f->net[1] = fi_gnet_new(&f->g, 1, &f->kp[1], err, sizeof err);
    assert_non_null(f->net[1]);
    int up = 0;
    for (int i = 0; i < 400 && !up; i++) {
        assert_true(fi_gnet_pump(f->net[0], 5, err, sizeof err) >= 0);
        assert_true(fi_gnet_pump(f->net[1], 5, err, sizeof err) >= 0);
        up = fi_gnet_up(f->net[0], 1) && fi_gnet_up(f->net[1], 0);
    }
    assert_true(up);
}

static void test_rank_death_and_return(void **state) {
    fixture *f = *state;
    char err[256];
    s_start_all(f);
    unsigned serial = fi_gnet_link_serial(f->net[0], 2);
    assert_true(serial >= 1);
    /* Rank 2 goes away (its sockets close, as when the process dies). */
    uint64_t t0 = fi_wire_now_ms();
    fi_gnet_destroy(&f->net[2]);
    fi_gmsg *m = NULL;
    /* Rank 0 waits for rank 1's part: it fails because rank 2 is down. */
    int rc = fi_gcoll_wait(f->net[0], 1, FI_G_PART, 5, 0, fi_wire_now_ms() + 5000, &m, err,
                           sizeof err);
    uint64_t took = fi_wire_now_ms() - t0;
    printf("wait failed after %llu ms: %s\n", (unsigned long long)took, err);
    assert_int_equal(rc, -1);
    assert_non_null(strstr(err, "rank 2 is down"));
    assert_true(took < 400 + 300); /* within the timeout, with room for a loaded machine */
    assert_int_equal(fi_gnet_first_down(f->net[0]), 2);
    /* It comes back: a new link, a new serial. */
    f->net[2] = fi_gnet_new(&f->g, 2, &f->kp[2], err, sizeof err);
    assert_non_null(f->net[2]);
    assert_true(s_wait_mesh(f, 5000));
    assert_true(fi_gnet_link_serial(f->net[0], 2) > serial);
}

static void test_failure_notice(void **state) {
    fixture *f = *state;
    char err[256];
    s_start_all(f);
    fi_gcoll_fail(f->net[1], 77, "out of blocks on rank 1");
    fi_gmsg *m = NULL;
    assert_int_equal(fi_gcoll_wait(f->net[0], 2, FI_G_PART, 77, 0, fi_wire_now_ms() + 5000, &m,
                                   err, sizeof err),
                     -1);
    assert_string_equal(err, "rank 1 failed: out of blocks on rank 1");
    /* A notice for another pass does not end this one: it times out. */
    fi_gcoll_fail(f->net[1], 78, "other");
    uint64_t t0 = fi_wire_now_ms();
    assert_int_equal(fi_gcoll_wait(f->net[2], 0, FI_G_PART, 79, 0, fi_wire_now_ms() + 300, &m,
                                   err, sizeof err),
                     -1);
    assert_true(fi_wire_now_ms() - t0 >= 290);
    assert_non_null(strstr(err, "within the pass time limit"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_mesh_and_sum, setup, teardown),
        cmocka_unit_test_setup_teardown(test_foreign_key_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rank_death_and_return, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failure_notice, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
