/*
 * fi_fabric_bench.c - round trips through the coordinator: an edge sends
 * an inference request, the coordinator routes it to an echo worker, the
 * worker streams it back (one chunk and a final result), the coordinator
 * forwards both to the edge. All three in one process, over loopback TCP,
 * each with its own ZeroMQ context.
 *
 * Reports latency (p50, p99 of sequential round trips) and throughput
 * (round trips and fabric messages per second with a window of requests
 * in flight), with CURVE, and, when built with the benchmark-only CMake
 * option FEDINFER_FABRIC_BENCH_PLAINTEXT=ON, the same without encryption
 * (ZMQ PLAIN: same ZAP path, no crypto) and the ratio.
 *
 *   fi_fabric_bench [-n ROUNDTRIPS] [-w WINDOW] [-s PROMPT_BYTES] [-r ROUNDS]
 *
 * With -r, the modes alternate ROUNDS times (CURVE, plaintext, CURVE, ...)
 * and the medians are reported, which keeps a busy machine's drift out of
 * the ratio.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fi_client.h"
#include "fi_coord.h"
#include "fi_shard.h"

typedef struct bench {
    char dir[64];            /* temporary directory */
    char db[128];            /* coordinator database */
    fi_keypair coord, edge, worker; /* keys */
    fi_coord *c;             /* coordinator */
    pthread_t coord_th, worker_th; /* their threads */
    atomic_int stop_coord, stop_worker; /* stop flags */
    atomic_int worker_ready; /* worker's Hello answered */
    int plaintext;           /* PLAIN instead of CURVE */
    char ep[256];            /* coordinator endpoint */
} bench;

typedef struct result {
    double p50_us, p99_us;   /* sequential round-trip latency */
    double rt_per_s;         /* round trips per second, windowed */
    double msg_per_s;        /* fabric messages per second through the coordinator */
} result;

static void *s_coord_main(void *arg) {
    bench *b = arg;
    (void)fi_coord_run(b->c, &b->stop_coord);
    return NULL;
}

static void s_client_opts(const bench *b, fi_client_opts *o, const fi_keypair *kp, Fi__Role r) {
    fi_client_opts_default(o);
    snprintf(o->endpoint, sizeof o->endpoint, "%s", b->ep);
    memcpy(o->server_pub, b->coord.pub, FI_KEYS_BYTES);
    o->kp = *kp;
    o->role = r;
    o->plaintext = b->plaintext;
    o->hwm = 100000;
}

static void *s_worker_main(void *arg) {
    bench *b = arg;
    fi_client_opts o;
    char err[256];
    s_client_opts(b, &o, &b->worker, FI__ROLE__ROLE_CLUSTER);
    o.n_models = 1;
    snprintf(o.models[0], sizeof o.models[0], "echo");
    o.capacity[0] = 1024;
    fi_client *c = fi_client_new(&o, err, sizeof err);
    if (!c || fi_client_wait_ready(c, 5000, err, sizeof err) != 0) {
        fprintf(stderr, "bench: worker: %s\n", err);
        fi_client_destroy(&c);
        return NULL;
    }
    atomic_store(&b->worker_ready, 1);
    fi_shard_backend be = fi_shard_echo_backend(1 << 16, 0); /* one chunk per request */
    if (fi_shard_serve(c, &be, 4096, &b->stop_worker, err, sizeof err) != 0)
        fprintf(stderr, "bench: worker: %s\n", err);
    if (be.destroy) be.destroy(be.ctx);
    fi_client_destroy(&c);
    return NULL;
}

static int s_start(bench *b, int plaintext) {
    char err[256];
    memset(b, 0, sizeof *b);
    b->plaintext = plaintext;
    snprintf(b->dir, sizeof b->dir, "/tmp/fi_bench_XXXXXX");
    if (!mkdtemp(b->dir)) return -1;
    snprintf(b->db, sizeof b->db, "%s/c.db", b->dir);
    if (fi_keys_generate(&b->coord) || fi_keys_generate(&b->edge) ||
        fi_keys_generate(&b->worker))
        return -1;
    fi_store *st = fi_store_open(b->db, err, sizeof err);
    if (!st || fi_store_peer_add(st, b->edge.pub, FI__ROLE__ROLE_EDGE, "site", "region", err,
                                 sizeof err) ||
        fi_store_peer_add(st, b->worker.pub, FI__ROLE__ROLE_CLUSTER, "core", "region", err,
                          sizeof err)) {
        fprintf(stderr, "bench: %s\n", err);
        fi_store_destroy(&st);
        return -1;
    }
    fi_store_destroy(&st);
    fi_coord_opts o;
    fi_coord_opts_default(&o);
    snprintf(o.bind, sizeof o.bind, "tcp://127.0.0.1:*");
    snprintf(o.enrol_bind, sizeof o.enrol_bind, "tcp://127.0.0.1:*");
    snprintf(o.db, sizeof o.db, "%s", b->db);
    o.hwm = 100000;
    o.max_in_flight = 4096;
    o.plaintext = plaintext;
    b->c = fi_coord_new(&o, &b->coord, err, sizeof err);
    if (!b->c) {
        fprintf(stderr, "bench: %s\n", err);
        return -1;
    }
    snprintf(b->ep, sizeof b->ep, "%s", fi_coord_endpoint(b->c, 0));
    if (pthread_create(&b->coord_th, NULL, s_coord_main, b) ||
        pthread_create(&b->worker_th, NULL, s_worker_main, b))
        return -1;
    for (int i = 0; i < 500 && !atomic_load(&b->worker_ready); i++) usleep(10000);
    return atomic_load(&b->worker_ready) ? 0 : -1;
}

static void s_stop(bench *b) {
    atomic_store(&b->stop_worker, 1);
    pthread_join(b->worker_th, NULL);
    atomic_store(&b->stop_coord, 1);
    pthread_join(b->coord_th, NULL);
    fi_coord_destroy(&b->c);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", b->dir);
    if (system(cmd)) fprintf(stderr, "bench: could not remove %s\n", b->dir);
}

static int s_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double s_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Sends request i; 0 or -1. */
static int s_send(fi_client *c, int i, const char *prompt) {
    char id[32];
    snprintf(id, sizeof id, "b%d", i);
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = id;
    rq.model = (char *)"echo";
    rq.prompt = (char *)prompt;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_INFER;
    m.infer = &rq;
    return fi_client_send(c, &m);
}

/* Waits for the next final result or error; 1 final, 0 error, -1 none.
 * Adds the messages received to *msgs when not NULL. */
static int s_wait_final(fi_client *c, long *msgs) {
    char err[256];
    for (;;) {
        fi_msg *m = NULL;
        int rc = fi_client_recv(c, 5000, &m, err, sizeof err);
        if (rc < 0) return -1;
        if (rc == 0) {
            if (!fi_client_ready(c)) continue;
            return -1;
        }
        int t = m->body_case;
        fi_wire_free(&m);
        if (msgs) ++*msgs;
        if (t == FI__ENVELOPE__BODY_FINAL) return 1;
        if (t == FI__ENVELOPE__BODY_ERROR) return 0;
    }
}

static int s_run(int plaintext, int n, int window, int size, result *res) {
    bench b;
    if (s_start(&b, plaintext) != 0) {
        fprintf(stderr, "bench: set-up failed\n");
        return -1;
    }
    char err[256];
    fi_client_opts o;
    s_client_opts(&b, &o, &b.edge, FI__ROLE__ROLE_EDGE);
    fi_client *c = fi_client_new(&o, err, sizeof err);
    int rc = -1;
    double *lat = calloc((size_t)n, sizeof *lat);
    char *prompt = malloc((size_t)size + 1);
    if (!c || !lat || !prompt || fi_client_wait_ready(c, 5000, err, sizeof err) != 0) goto done;
    memset(prompt, 'p', (size_t)size);
    prompt[size] = 0;
    for (int i = 0; i < 200; i++) /* warm-up */
        if (s_send(c, i, prompt) || s_wait_final(c, NULL) != 1) goto done;
    for (int i = 0; i < n; i++) {
        double t0 = s_now_us();
        if (s_send(c, i, prompt) || s_wait_final(c, NULL) != 1) goto done;
        lat[i] = s_now_us() - t0;
    }
    qsort(lat, (size_t)n, sizeof *lat, s_cmp);
    res->p50_us = lat[n / 2];
    res->p99_us = lat[(size_t)((double)n * 0.99)];
    /* Throughput: keep `window` requests in flight. */
    double t0 = s_now_us();
    int sent = 0, done_n = 0;
    while (sent < window && sent < n) {
        if (s_send(c, sent, prompt)) goto done;
        sent++;
    }
    long back = 0; /* chunks and finals received */
    while (done_n < n) {
        if (s_wait_final(c, &back) != 1) goto done;
        done_n++;
        if (sent < n) {
            if (s_send(c, sent, prompt)) goto done;
            sent++;
        }
    }
    double secs = (s_now_us() - t0) / 1e6;
    res->rt_per_s = n / secs;
    /* every message crosses the coordinator: in and out, requests and
     * what came back (the echo worker sends two chunks and a final) */
    res->msg_per_s = 2.0 * (double)(n + back) / secs;
    rc = 0;
done:
    if (rc) fprintf(stderr, "bench: run failed (%s)\n", err);
    fi_client_destroy(&c);
    free(lat);
    free(prompt);
    s_stop(&b);
    return rc;
}

static double s_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, s_cmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void s_print(const char *name, const result *r) {
    printf("%-10s p50 %8.1f us  p99 %8.1f us  %9.0f round trips/s  %9.0f msgs/s\n", name,
           r->p50_us, r->p99_us, r->rt_per_s, r->msg_per_s);
}

/* Medians of each metric over n results. */
static result s_medians(const result *rs, int n) {
    double a[4][64];
    for (int i = 0; i < n; i++) {
        a[0][i] = rs[i].p50_us;
        a[1][i] = rs[i].p99_us;
        a[2][i] = rs[i].rt_per_s;
        a[3][i] = rs[i].msg_per_s;
    }
    result m = {s_median(a[0], n), s_median(a[1], n), s_median(a[2], n), s_median(a[3], n)};
    return m;
}

int main(int argc, char **argv) {
    int n = 5000, window = 32, size = 64, rounds = 1, ch;
    if (argc > 1 && !strcmp(argv[1], "--help")) argv[1] = (char *)"-h";
    while ((ch = getopt(argc, argv, "n:w:s:r:h")) != -1) {
        switch (ch) {
        case 'n': n = atoi(optarg); break;
        case 'w': window = atoi(optarg); break;
        case 's': size = atoi(optarg); break;
        case 'r': rounds = atoi(optarg); break;
        default:
            fprintf(ch == 'h' ? stdout : stderr,
                    "usage: fi_fabric_bench [-n ROUNDTRIPS] [-w WINDOW] [-s PROMPT_BYTES] "
                    "[-r ROUNDS]\n");
            return ch == 'h' ? 0 : 2;
        }
    }
    if (n < 100 || window < 1 || size < 1 || size > 65536 || rounds < 1 || rounds > 64) {
        fprintf(stderr, "fi_fabric_bench: -n >= 100, -w >= 1, -s in 1..65536, -r in 1..64\n");
        return 2;
    }
    printf("fabric round trip edge -> coordinator -> echo worker -> edge, loopback TCP, "
           "%d round trips, window %d, prompt %d bytes, %d round(s)\n", n, window, size, rounds);
    result curve[64], plain[64];
    for (int r = 0; r < rounds; r++) {
        if (s_run(0, n, window, size, &curve[r]) != 0) return 1;
        if (rounds > 1) s_print("CURVE", &curve[r]);
#ifdef FI_FABRIC_PLAINTEXT_BENCH
        if (s_run(1, n, window, size, &plain[r]) != 0) return 1;
        if (rounds > 1) s_print("plaintext", &plain[r]);
#endif
    }
    result c = s_medians(curve, rounds);
    if (rounds > 1) printf("medians:\n");
    s_print("CURVE", &c);
#ifdef FI_FABRIC_PLAINTEXT_BENCH
    result p = s_medians(plain, rounds);
    s_print("plaintext", &p);
    printf("CURVE/plaintext: p50 x%.2f  p99 x%.2f  throughput x%.2f\n", c.p50_us / p.p50_us,
           c.p99_us / p.p99_us, c.rt_per_s / p.rt_per_s);
#else
    (void)plain;
    printf("(plaintext comparison: configure with -DFEDINFER_FABRIC_BENCH_PLAINTEXT=ON)\n");
#endif
    return 0;
}
