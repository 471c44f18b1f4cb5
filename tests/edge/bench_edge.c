/*
 * bench_edge.c - the edge agent's own overhead (not a test; run by hand):
 *
 *   1. time to first token of the engine alone (fi_generate, first text
 *      callback) against the same prompt through the HTTP API, streamed,
 *      on one in-process agent: p50 and p99 of each, and the difference.
 *      Every round's prompt starts with its own system message, so the
 *      agent's prefix cache finds nothing: both sides prefill it all;
 *   2. requests/s of the denial path (policy says no: no model work),
 *      with several client threads, one connection per request.
 *
 *   build/tests/bench_edge [-n REQUESTS] [-t SECONDS] [-c CLIENTS]
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fi_bundle.h"
#include "fi_edge.h"
#include "fi_model.h"

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int s_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double s_pct(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, s_cmp);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

typedef struct first {
    double t0, t1; /* start, first text */
} first;

static int s_on_text(void *user, const char *t, size_t n) {
    first *f = user;
    (void)t;
    if (n && f->t1 == 0) f->t1 = s_now();
    return 0;
}

static int s_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Sends body to path; returns seconds to the first byte of the first
 * data chunk (stream) or to the end (else); *status gets the HTTP status. */
static double s_request(int port, const char *path, const char *hdr, const char *body, int *status) {
    char req[2048];
    int n = snprintf(req, sizeof req, "POST %s HTTP/1.0\r\nContent-Length: %zu\r\n%s\r\n%s", path,
                     strlen(body), hdr ? hdr : "", body);
    double t0 = s_now(), tf = 0;
    int fd = s_connect(port);
    if (fd < 0) return -1;
    if (send(fd, req, (size_t)n, 0) != n) {
        close(fd);
        return -1;
    }
    char buf[8192];
    size_t len = 0;
    *status = 0;
    for (;;) {
        ssize_t k = recv(fd, buf + len, sizeof buf - len - 1, 0);
        if (k <= 0) break;
        len += (size_t)k;
        buf[len] = 0;
        if (!*status) sscanf(buf, "HTTP/1.%*d %d", status);
        if (!tf && strstr(buf, "data: {")) tf = s_now();
        if (len > sizeof buf / 2) { /* keep the tail only */
            memmove(buf, buf + len - 16, 16);
            len = 16;
        }
    }
    close(fd);
    return (tf ? tf : s_now()) - t0;
}

typedef struct deny_ctx {
    int port;
    double until;
    atomic_long done, bad;
} deny_ctx;

static void *s_denier(void *arg) {
    deny_ctx *d = arg;
    const char *b = "{\"model\":\"smollm2-135m\",\"max_tokens\":4,"
                    "\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}]}";
    while (s_now() < d->until) {
        int st = 0;
        s_request(d->port, "/v1/chat/completions", "X-Data-Class: secret\r\n", b, &st);
        atomic_fetch_add(st == 403 ? &d->done : &d->bad, 1);
    }
    return NULL;
}

/* Time to first text of one generation by the engine alone, of the chat
 * (system sys, user q); keep: a session to rewind and reuse, or NULL for a
 * new session. */
static double s_engine_once(fi_model *m, fi_session *keep, const char *sys, const char *q) {
    char err[256];
    first f = {0};
    f.t0 = s_now();
    fi_chat_msg msg[2] = {{"system", sys}, {"user", q}};
    char *text = fi_tok_chat(fi_model_tok(m), msg, 2, 1, err, sizeof err);
    int32_t ids[256];
    int k = fi_tok_encode(fi_model_tok(m), text, strlen(text), 1, ids, 256);
    free(text);
    fi_session *s = keep ? keep : fi_session_new(m, 512, err, sizeof err);
    if (keep) fi_session_rewind(s, 0);
    fi_gen_opts o;
    memset(&o, 0, sizeof o);
    o.max_tokens = 1;
    o.sampling = fi_sampler_defaults();
    o.sampling.temperature = 0;
    o.on_text = s_on_text;
    o.user = &f;
    fi_gen_result res;
    if (fi_generate(s, ids, k, &o, &res, err, sizeof err) != 0) return -1;
    if (!keep) fi_session_destroy(&s);
    return (f.t1 ? f.t1 : s_now()) - f.t0;
}

int main(int argc, char **argv) {
    int n = 20, clients = 4, threads = 2;
    double secs = 3;
    const char *model = FI_TEST_MODEL;
    if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        printf("usage: bench_edge [-n REQUESTS] [-t SECONDS] [-c CLIENTS] [-m MODEL] [--threads N]\n\n"
               "Time to first token of the engine alone against the same prompt through the\n"
               "edge's HTTP API (p50, p99, difference), then requests/s of the denial path\n"
               "with CLIENTS threads for SECONDS. Not a test: run by hand.\n");
        return 0;
    }
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-n")) n = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-t")) secs = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "-c")) clients = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-m")) model = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
    }
    char err[768];
    const char *q = "What is the capital of France?";

    /* 1a. The engine alone: render, encode, generate until the first text. */
    fi_model_opts mo = {.n_threads = threads, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_AUTO};
    fi_model *m = fi_model_load(model, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }

    /* 1b. The same through the HTTP API of an in-process agent. */
    char dir[] = "/tmp/bench_edge.XXXXXX";
    if (!mkdtemp(dir)) return 1;
    uint8_t pk[32], sk[64];
    char path[256], conf[256];
    if (fi_bundle_keygen(pk, sk) != 0) return 1;
    snprintf(path, sizeof path, "%s/sign.key", dir);
    if (fi_bundle_key_save(path, sk, err, sizeof err) != 0) return 1;
    snprintf(path, sizeof path, "%s/policy", dir);
    mkdir(path, 0700);
    const char *pol = "labels internal, secret;\ndefault_label \"internal\";\n"
                      "jurisdiction EU;\nregion r in EU;\nsite s in r;\n"
                      "permit \"own site\" when target.name == request.origin.site;\n"
                      "forbid \"secret nowhere\" when \"secret\" in request.labels;\n";
    char *b;
    size_t bl;
    int64_t now = (int64_t)time(NULL);
    if (fi_bundle_sign(sk, 1, now - 60, now + 3600, pol, strlen(pol), &b, &bl) != 0 ||
        fi_bundle_install(path, b, bl, (const uint8_t(*)[32])pk, 1, now, err, sizeof err) !=
            FI_BUNDLE_OK) {
        fprintf(stderr, "bundle: %s\n", err);
        return 1;
    }
    free(b);
    snprintf(conf, sizeof conf, "%s/edge.conf", dir);
    FILE *fc = fopen(conf, "w");
    fprintf(fc,
            "site = s\nport = 0\nmodel = %s\nmodel_name = smollm2-135m\nthreads = %d\n"
            "n_ctx = 512\nconcurrency = 4\nqueue = 64\nconn_limit = 512\nper_ip_limit = 0\n"
            "db = %s/edge.db\npolicy_dir = %s/policy\npolicy_key = %s/sign.key.pub\n",
            model, threads, dir, dir, dir);
    fclose(fc);
    fi_edge_conf c;
    fi_edge_conf_default(&c);
    if (fi_edge_conf_load(conf, &c, err, sizeof err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    fi_edge *e = fi_edge_new(&c, err, sizeof err);
    if (!e) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int port = fi_edge_port(e);
    char body[512], sys[64];
    /* Alternate the three, so that they see the same load. */
    double *eng = calloc((size_t)n, sizeof *eng), *web = calloc((size_t)n, sizeof *web);
    double *reuse = calloc((size_t)n, sizeof *reuse);
    fi_session *keep = fi_session_new(m, 512, err, sizeof err);
    for (int i = 0; i < n + 1; i++) {
        int st = 0;
        snprintf(sys, sizeof sys, "Round %d of the benchmark.", i);
        snprintf(body, sizeof body,
                 "{\"model\":\"smollm2-135m\",\"max_tokens\":1,\"temperature\":0,\"stream\":true,"
                 "\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},"
                 "{\"role\":\"user\",\"content\":\"%s\"}]}",
                 sys, q);
        double te = s_engine_once(m, NULL, sys, q);
        double tr = s_engine_once(m, keep, sys, q);
        double t = s_request(port, "/v1/chat/completions", NULL, body, &st);
        if (st != 200 || te < 0 || tr < 0) {
            fprintf(stderr, "HTTP %d\n", st);
            return 1;
        }
        if (i) { /* the first round warms up */
            web[i - 1] = t;
            eng[i - 1] = te;
            reuse[i - 1] = tr;
        }
    }
    fi_session_destroy(&keep);
    double e50 = s_pct(eng, n, 0.5), e99 = s_pct(eng, n, 0.99);
    double w50 = s_pct(web, n, 0.5), w99 = s_pct(web, n, 0.99);
    printf("time to first token, local, %d requests (%d engine threads):\n", n, threads);
    printf("  engine alone   p50 %7.2f ms  p99 %7.2f ms  (new session per request)\n",
           e50 * 1e3, e99 * 1e3);
    double r50 = s_pct(reuse, n, 0.5);
    printf("  engine alone   p50 %7.2f ms  p99 %7.2f ms  (one session, rewound)\n", r50 * 1e3,
           s_pct(reuse, n, 0.99) * 1e3);
    printf("  HTTP (stream)  p50 %7.2f ms  p99 %7.2f ms\n", w50 * 1e3, w99 * 1e3);
    /* the agent's KV pool is made once, as a rewound session's cache: the
     * second difference is the HTTP path's own cost */
    printf("  overhead       p50 %7.2f ms against a new session, %.2f ms against a rewound one\n",
           (w50 - e50) * 1e3, (w50 - r50) * 1e3);

    /* 2. The denial path. */
    deny_ctx d = {port, s_now() + secs, 0, 0};
    pthread_t *t = calloc((size_t)clients, sizeof *t);
    double t0 = s_now();
    for (int i = 0; i < clients; i++) pthread_create(&t[i], NULL, s_denier, &d);
    for (int i = 0; i < clients; i++) pthread_join(t[i], NULL);
    double el = s_now() - t0;
    printf("denial path (403, policy evaluated and audited, no model work), %d clients, "
           "one connection per request:\n  %.0f requests/s (%ld denied, %ld other)\n",
           clients, (double)atomic_load(&d.done) / el, atomic_load(&d.done), atomic_load(&d.bad));
    fi_edge_destroy(&e);
    fi_model_destroy(&m);
    snprintf(path, sizeof path, "rm -rf %s", dir);
    if (system(path) != 0) return 1;
    free(eng);
    free(reuse);
    free(web);
    free(t);
    return 0;
}
