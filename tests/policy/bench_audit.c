/*
 * bench_audit.c - what witnessing the audit log costs (policy/fi_audit.h):
 * the head the coordinator reads for every heartbeat to its edges, the
 * check of one edge's witness, keeping a batch of witnesses (one synced
 * transaction, at most every 5 s on the coordinator's loop), and verify
 * with and without witnesses, on a log of RECORDS records.
 *
 *   build/tests/bench_audit [RECORDS [WITNESSES [KEEP]]]     (200000 and 100)
 *
 * KEEP: a path where the log is left (a coordinator's audit_db, to time
 * its answers while it verifies).
 *
 * Prints figures, checks nothing: the tests are test_policy_audit.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "db_damage.h"
#include "fi_audit.h"

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int s_die(const char *what, const char *err) {
    fprintf(stderr, "bench_audit: %s: %s\n", what, err);
    return 1;
}

/* The chain hash of record seq, read back (witnesses report real ones). */
static int s_hash_of(const fi_audit_record *r, void *arg) {
    memcpy(arg, r->hash, 65);
    return 1;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? strtol(argv[1], NULL, 10) : 200000;
    long nw = argc > 2 ? strtol(argv[2], NULL, 10) : 100;
    const char *keep = argc > 3 ? argv[3] : NULL;
    if (argc > 4 || n < 10 || n > 10000000 || nw < 1 || nw > 10000) {
        fprintf(stderr, "usage: bench_audit [RECORDS (10..10000000) [WITNESSES (1..10000) [KEEP]]]\n");
        return 2;
    }
    char dir[] = "/tmp/fi_bench_audit_XXXXXX", path[64], err[400];
    if (!mkdtemp(dir)) return s_die("mkdtemp", "failed");
    snprintf(path, sizeof path, "%s/audit.db", dir);
    double t0 = s_now();
    if (fi_test_audit_fill(path, (int)n, err, sizeof err) != 0) return s_die("fill", err);
    double fill = s_now() - t0;
    fi_audit *a = fi_audit_open(path, err, sizeof err);
    if (!a) return s_die("open", err);
    printf("log: %ld records, written in %.2f s (%.0f records/s, 100 to a transaction)\n", n, fill, n / fill);

    enum { HEADS = 20000, CHECKS = 20000, PUTS = 20 };
    int64_t seq = 0;
    char head[65];
    t0 = s_now();
    for (int i = 0; i < HEADS; i++)
        if (fi_audit_head(a, &seq, head, err, sizeof err) != 0) return s_die("head", err);
    printf("fi_audit_head (every heartbeat to the edges): %.2f us\n", (s_now() - t0) / HEADS * 1e6);

    /* witnesses of records spread over the log, with their real hashes */
    fi_audit_witness *w = calloc((size_t)nw, sizeof *w);
    char (*names)[32] = calloc((size_t)nw, sizeof *names);
    if (!w || !names) return s_die("memory", "out of memory");
    for (long i = 0; i < nw; i++) {
        snprintf(names[i], sizeof names[i], "edge-%05ld", i);
        w[i].who = names[i];
        w[i].site = "bench-site";
        w[i].seq = n - (n / nw) * i;
        w[i].reported = 1800000000000LL;
        fi_audit_filter f = {.after_seq = w[i].seq - 1};
        if (fi_audit_query(a, &f, s_hash_of, w[i].hash, err, sizeof err) != 0) return s_die("query", err);
    }
    t0 = s_now();
    for (int i = 0; i < CHECKS; i++)
        if (fi_audit_witness_check(a, &w[i % nw], err, sizeof err) != 0) return s_die("check", err);
    printf("fi_audit_witness_check (an edge's witness changed): %.2f us\n", (s_now() - t0) / CHECKS * 1e6);

    fi_audit_check ck;
    t0 = s_now();
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) return s_die("verify", err[0] ? err : ck.what);
    double v0 = s_now() - t0;
    t0 = s_now();
    for (int i = 0; i < PUTS; i++)
        if (fi_audit_witness_put(a, w, (size_t)nw, err, sizeof err) != 0) return s_die("put", err);
    printf("fi_audit_witness_put of %ld witnesses (one synced transaction): %.2f ms\n", nw,
           (s_now() - t0) / PUTS * 1e3);
    t0 = s_now();
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) return s_die("verify", err[0] ? err : ck.what);
    double v1 = s_now() - t0;
    printf("fi_audit_verify: %.1f ms without witnesses, %.1f ms with %lld (%.3fx)\n", v0 * 1e3, v1 * 1e3,
           (long long)ck.witnesses, v1 / v0);
    fi_audit_destroy(&a);
    free(w);
    free(names);
    if (keep && rename(path, keep) != 0) {
        fprintf(stderr, "bench_audit: cannot move the log to %s\n", keep);
        return 1;
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "bench_audit: could not remove %s\n", dir);
    return 0;
}
