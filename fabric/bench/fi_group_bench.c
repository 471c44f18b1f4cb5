/*
 * fi_group_bench.c - a model sharded over a group of ranks on loopback:
 * time to first token, decode tokens/s, bytes sent between ranks per
 * token and time per token spent communicating, for TP=1, TP=2, PP=2 with
 * its stages in turn and with micro-batches (and TP=3, TP=2xPP=2 with
 * -a), then a projection for a model 50 times larger
 * from the measured link latency and bandwidth.
 *
 *   fi_group_bench [-m MODEL] [-t THREADS_PER_RANK] [-n DECODE_STEPS]
 *                  [-p PROMPT_TOKENS] [-b BATCH] [-a]
 *
 * Every rank is a thread with its own ZeroMQ context, its own CURVE links
 * (real TCP on 127.0.0.1) and only its own slice of the weights, as the
 * processes of `fedinfer shard` would be; the leader drives the passes
 * through fi_group_forward exactly as its scheduler does.
 *
 * What is measured, per layout:
 *   TTFT       one prompt of P tokens, prefill pass to logits (ms)
 *   decode     B sequences decoding together, N passes: B*N / time (tok/s);
 *              also with batch 1
 *   bytes/tok  bytes every rank sent to the others during decode, per
 *              generated token (headers included)
 *   comm/tok   the leader's time in sends and TP sums (waiting for the
 *              slowest TP rank included) per generated token; for PP also
 *              the time waiting for the other stage (its compute included)
 */
#include <arpa/inet.h>
#include <getopt.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fi_group.h"
#include "fi_group_coll.h"
#include "fi_group_net.h"
#include "fi_wire.h"

#define S_MAX_BATCH 64

typedef struct s_opts {
    const char *model;
    int threads, steps, prompt, batch, all;
    int micro; /* the micro-batched PP=2 layout's micro_batch; -1: the default */
} s_opts;

typedef struct s_rank {
    fi_group_conf conf;
    int rank;
    const s_opts *o;
    fi_keypair kp;
    const fi_group_model *mi;
    const uint8_t *digest;
    fi_group *g;
    fi_model *m;
    atomic_int stop;
    int rc;
    char err[512];
    pthread_t th;
} s_rank;

/* The first of n consecutive loopback ports free now (below the ephemeral
 * range), or -1: group files name every rank's endpoint before any binds. */
static int s_free_ports(int n) {
    unsigned seed = (unsigned)getpid() ^ (unsigned)time(NULL);
    for (int attempt = 0; attempt < 200; attempt++) {
        int base = 20000 + (int)(rand_r(&seed) % 12000u), fds[8], k = 0, ok = 1;
        for (; ok && k < n && k < 8; k++) {
            struct sockaddr_in a;
            memset(&a, 0, sizeof a);
            a.sin_family = AF_INET;
            a.sin_port = htons((uint16_t)(base + k));
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            fds[k] = socket(AF_INET, SOCK_STREAM, 0);
            ok = fds[k] >= 0 && bind(fds[k], (struct sockaddr *)&a, sizeof a) == 0;
        }
        for (int i = 0; i < k; i++)
            if (fds[i] >= 0) close(fds[i]);
        if (ok) return base;
    }
    return -1;
}

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int s_open(s_rank *r) {
    if (!(r->g = fi_group_new(&r->conf, r->rank, &r->kp, r->mi, r->digest, r->err,
                              sizeof r->err)))
        return -1;
    fi_model_opts mo = {.n_threads = r->o->threads, .simd = FI_SIMD_AUTO,
                        .device = FI_DEVICE_CPU, .plan = fi_group_plan(r->g)};
    if (!(r->m = fi_model_load(r->o->model, &mo, r->err, sizeof r->err))) return -1;
    return fi_group_attach(r->g, r->m, r->err, sizeof r->err);
}

static void *s_follow(void *arg) {
    s_rank *r = arg;
    r->rc = s_open(r);
    if (!r->rc) r->rc = fi_group_follow(r->g, &r->stop, r->err, sizeof r->err);
    if (r->rc) fprintf(stderr, "rank %d: %s\n", r->rank, r->err);
    return NULL;
}

/* Figures of one layout. */
typedef struct s_fig {
    char name[32];
    int world, tp, pp;
    double ttft_ms;
    double tps1, tpsb;        /* decode tok/s, batch 1 and batch B */
    double bytes_tok;         /* all ranks, decode at batch B, per token */
    double comm_ms_tok;       /* leader, decode at batch 1, per token */
    double wait_ms_tok;       /* leader, waits for other stages, batch 1, per token */
    double ar_small_ms;       /* one TP sum at decode, batch 1 (dim floats) */
    double ar_big_ms;         /* one TP sum during the prefill (P*dim floats) */
    double compute_ms_tok;    /* leader computing, batch 1, per token */
    double pre_comm_ms, pre_comp_ms; /* leader's prefill: communicating, computing */
} s_fig;

/* Prefill one P-token prompt in each of n sequences (one pass), then
 * `steps` decode passes of one token per sequence. Returns the seconds of
 * the decode; *ttft the prefill's; at_decode (unless NULL) the leader's
 * counters between the two. */
static int s_drive(fi_group *g, fi_model *m, fi_kvpool *kv, const fi_group_model *mi, int n,
                   int P, int steps, double *ttft, double *decode, fi_group_stats *at_decode) {
    const int mb = (P + steps + FI_KV_BLOCK) / FI_KV_BLOCK + 1;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(n * P)), *pos = malloc(sizeof(int32_t) * (size_t)(n * P));
    int32_t *seq = malloc(sizeof(int32_t) * (size_t)(n * P)), *tables = malloc(sizeof(int32_t) * (size_t)(n * mb));
    int32_t rows[S_MAX_BATCH], next[S_MAX_BATCH];
    float *logits = malloc(sizeof(float) * (size_t)n * (size_t)mi->n_vocab);
    char err[512];
    int rc = -1;
    for (int i = 0; i < n; i++)
        for (int b = 0; b < mb; b++) tables[i * mb + b] = i * mb + b;
    int k = 0;
    for (int i = 0; i < n; i++) {
        for (int t = 0; t < P; t++, k++) {
            tok[k] = 1 + (int32_t)((unsigned)(i * 7919 + t * 104729) % (unsigned)(mi->n_vocab - 1));
            pos[k] = t;
            seq[k] = i;
        }
        rows[i] = k - 1;
    }
    fi_batch b = {.n = n * P, .tok = tok, .pos = pos, .seq = seq, .n_seqs = n, .tables = tables,
                  .max_blocks = mb, .out_rows = rows, .n_out = n};
    double t0 = s_now();
    if (fi_group_forward(g, m, kv, &b, logits, err, sizeof err)) goto fail;
    *ttft = s_now() - t0;
    for (int i = 0; i < n; i++) next[i] = fi_argmax(logits + (size_t)i * mi->n_vocab, mi->n_vocab);
    if (at_decode) fi_group_get_stats(g, at_decode);
    t0 = s_now();
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < n; i++) {
            tok[i] = next[i];
            pos[i] = P + s;
            seq[i] = i;
            rows[i] = i;
        }
        fi_batch d = {.n = n, .tok = tok, .pos = pos, .seq = seq, .n_seqs = n, .tables = tables,
                      .max_blocks = mb, .out_rows = rows, .n_out = n};
        if (fi_group_forward(g, m, kv, &d, logits, err, sizeof err)) goto fail;
        for (int i = 0; i < n; i++)
            next[i] = fi_argmax(logits + (size_t)i * mi->n_vocab, mi->n_vocab);
    }
    *decode = s_now() - t0;
    rc = 0;
fail:
    if (rc) fprintf(stderr, "fi_group_bench: %s\n", err);
    free(tok);
    free(pos);
    free(seq);
    free(tables);
    free(logits);
    return rc;
}

static int s_layout(const s_opts *o0, const char *dir, int port, int world, int tp, int tmul,
                    int micro, const fi_group_model *mi, const uint8_t *digest, s_fig *fig) {
    s_opts o1 = *o0, *o = &o1;
    o1.threads *= tmul;
    char path[256], err[512];
    snprintf(path, sizeof path, "%s/group-%d-%d.conf", dir, world, tp);
    FILE *fp = fopen(path, "w");
    if (!fp) return -1;
    fprintf(fp, "group = bench\nworld = %d\ntp = %d\n", world, tp);
    if (micro >= 0) fprintf(fp, "micro_batch = %d\n", micro);
    for (int r = 0; r < world; r++)
        fprintf(fp, "endpoint.%d = tcp://127.0.0.1:%d\nkey.%d = r%d.pub\n", r, port + r, r, r);
    fclose(fp);
    s_rank ranks[FI_GROUP_MAX_RANKS];
    memset(ranks, 0, sizeof ranks);
    int rc = -1, started = 0;
    for (int r = 0; r < world; r++) {
        char sec[300];
        ranks[r].rank = r;
        ranks[r].o = o;
        ranks[r].mi = mi;
        ranks[r].digest = digest;
        snprintf(sec, sizeof sec, "%s/r%d.key", dir, r);
        if (fi_group_conf_load(path, &ranks[r].conf, err, sizeof err) ||
            fi_keys_load_secret(sec, &ranks[r].kp, err, sizeof err)) {
            fprintf(stderr, "fi_group_bench: %s\n", err);
            goto done;
        }
    }
    for (int r = 1; r < world; r++, started++)
        if (pthread_create(&ranks[r].th, NULL, s_follow, &ranks[r])) goto done;
    s_rank *L = &ranks[0];
    if (s_open(L)) {
        fprintf(stderr, "fi_group_bench: leader: %s\n", L->err);
        goto done;
    }
    fig->world = world;
    fig->tp = tp;
    fig->pp = world / tp;
    if (fig->pp == 1 && tmul > 1) snprintf(fig->name, sizeof fig->name, "TP=%d,t*%d", tp, tmul);
    else if (fig->pp == 1) snprintf(fig->name, sizeof fig->name, "TP=%d", tp);
    else if (tp == 1 && micro >= 0)
        snprintf(fig->name, sizeof fig->name, "PP=%d,mb=%d", fig->pp, micro);
    else if (tp == 1) snprintf(fig->name, sizeof fig->name, "PP=%d", fig->pp);
    else snprintf(fig->name, sizeof fig->name, "TP=%dxPP=%d", tp, fig->pp);
    const int B = o->batch;
    const int mb = (o->prompt + o->steps + FI_KV_BLOCK) / FI_KV_BLOCK + 1;
    fi_kvpool *kv = fi_kvpool_new(L->m, B * mb, B * o->prompt, B, err, sizeof err);
    if (!kv) {
        fprintf(stderr, "fi_group_bench: %s\n", err);
        goto done;
    }
    fi_group_set_pool(L->g, B * mb, B * o->prompt, B);
    double until = s_now() + 60;
    int avail = 0;
    while (!avail && s_now() < until) avail = fi_group_lead_poll(L->g, 20, err, sizeof err) == 1;
    if (!avail) {
        fprintf(stderr, "fi_group_bench: %s never formed: %s\n", fig->name, fi_group_status(L->g));
        fi_kvpool_destroy(&kv);
        goto done;
    }
    /* Batch 1: TTFT, decode speed, communication per token. */
    fi_group_stats a, b1, m1, c1;
    double ttft, dec;
    fi_group_get_stats(L->g, &a);
    if (s_drive(L->g, L->m, kv, mi, 1, o->prompt, 0, &ttft, &dec, NULL)) goto pool;
    fi_group_get_stats(L->g, &b1);
    fig->ttft_ms = ttft * 1e3;
    fig->pre_comm_ms = (b1.comm_s - a.comm_s) * 1e3;
    fig->pre_comp_ms = (b1.compute_s - a.compute_s) * 1e3;
    if (b1.allreduces > a.allreduces)
        fig->ar_big_ms = (b1.comm_s - a.comm_s) * 1e3 / (double)(b1.allreduces - a.allreduces);
    if (s_drive(L->g, L->m, kv, mi, 1, o->prompt, o->steps, &ttft, &dec, &m1)) goto pool;
    fi_group_get_stats(L->g, &c1);
    /* The decode part of that run, from the counters read between its
     * prefill and its decode (not by subtracting another run's prefill,
     * whose time differs from this one's on a busy machine) */
    double comm = c1.comm_s - m1.comm_s;
    double wait = c1.wait_s - m1.wait_s;
    double comp = c1.compute_s - m1.compute_s;
    uint64_t ars = c1.allreduces - m1.allreduces;
    fig->tps1 = o->steps / dec;
    fig->comm_ms_tok = comm * 1e3 / o->steps;
    fig->wait_ms_tok = wait * 1e3 / o->steps;
    fig->compute_ms_tok = comp * 1e3 / o->steps;
    if (ars) fig->ar_small_ms = comm * 1e3 / (double)ars;
    /* Batch B: decode speed and bytes per token (every rank's; the
     * followers' counters are read between passes, when they are idle). */
    uint64_t before = 0, after = 0;
    fi_group_stats s;
    for (int r = 0; r < world; r++) {
        if (!ranks[r].g) goto pool;
        fi_group_get_stats(ranks[r].g, &s);
        before += s.bytes_sent;
    }
    double ttftb;
    if (s_drive(L->g, L->m, kv, mi, B, o->prompt, 0, &ttftb, &dec, NULL)) goto pool;
    uint64_t mid = 0;
    for (int r = 0; r < world; r++) {
        fi_group_get_stats(ranks[r].g, &s);
        mid += s.bytes_sent;
    }
    if (s_drive(L->g, L->m, kv, mi, B, o->prompt, o->steps, &ttftb, &dec, NULL)) goto pool;
    for (int r = 0; r < world; r++) {
        fi_group_get_stats(ranks[r].g, &s);
        after += s.bytes_sent;
    }
    fig->tpsb = (double)B * o->steps / dec;
    fig->bytes_tok = (double)((after - mid) - (mid - before)) / ((double)B * o->steps);
    rc = 0;
pool:
    fi_kvpool_destroy(&kv);
done:
    for (int r = 1; r <= started; r++) atomic_store(&ranks[r].stop, 1);
    for (int r = 1; r <= started; r++) pthread_join(ranks[r].th, NULL);
    for (int r = 0; r < world; r++) {
        fi_group_destroy(&ranks[r].g);
        fi_model_destroy(&ranks[r].m);
        fi_keys_wipe(&ranks[r].kp);
    }
    return rc;
}

/* --- the link alone: TP sums between two ranks with no model ----------- */

typedef struct s_probe {
    fi_gnet *n;
    size_t len;       /* floats per sum */
    int reps;
    double secs;      /* wall time of the reps */
    int rc;
} s_probe;

static void *s_probe_main(void *arg) {
    s_probe *p = arg;
    float *x = calloc(p->len, sizeof *x), *acc = calloc(p->len, sizeof *acc);
    char err[256];
    p->rc = x && acc ? 0 : -1;
    double t0 = s_now();
    for (int i = 0; i < p->reps && !p->rc; i++)
        p->rc = fi_gcoll_allreduce(p->n, 0, 2, 1, (uint32_t)i, x, p->len, acc,
                                   fi_wire_now_ms() + 60000, err, sizeof err);
    p->secs = s_now() - t0;
    if (p->rc) fprintf(stderr, "fi_group_bench: probe: %s\n", err);
    free(x);
    free(acc);
    return NULL;
}

/* Seconds per TP sum of len floats between two ranks (one thread each,
 * CURVE over loopback, nothing else running). -1 on failure. */
static double s_probe_sum(const char *dir, int port, size_t len, int reps) {
    char path[256], err[512], sec[300];
    snprintf(path, sizeof path, "%s/probe.conf", dir);
    FILE *fp = fopen(path, "w");
    if (!fp) return -1;
    fprintf(fp, "group = probe\nworld = 2\nendpoint.0 = tcp://127.0.0.1:%d\nkey.0 = r0.pub\n"
                "endpoint.1 = tcp://127.0.0.1:%d\nkey.1 = r1.pub\n",
            port, port + 1);
    fclose(fp);
    fi_group_conf c;
    s_probe p[2];
    memset(p, 0, sizeof p);
    double res = -1;
    if (fi_group_conf_load(path, &c, err, sizeof err)) goto done;
    for (int r = 0; r < 2; r++) {
        fi_keypair kp;
        snprintf(sec, sizeof sec, "%s/r%d.key", dir, r);
        if (fi_keys_load_secret(sec, &kp, err, sizeof err)) goto done;
        p[r].n = fi_gnet_new(&c, r, &kp, err, sizeof err);
        fi_keys_wipe(&kp);
        if (!p[r].n) goto done;
        p[r].len = len;
        p[r].reps = reps;
    }
    for (int i = 0; i < 500 && !(fi_gnet_up(p[0].n, 1) && fi_gnet_up(p[1].n, 0)); i++) {
        (void)fi_gnet_pump(p[0].n, 5, err, sizeof err);
        (void)fi_gnet_pump(p[1].n, 5, err, sizeof err);
    }
    pthread_t th[2];
    for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, s_probe_main, &p[r]);
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    if (!p[0].rc && !p[1].rc) res = p[0].secs / reps;
done:
    if (res < 0 && err[0]) fprintf(stderr, "fi_group_bench: probe: %s\n", err);
    for (int r = 0; r < 2; r++) fi_gnet_destroy(&p[r].n);
    return res;
}

static void s_usage(FILE *f) {
    fprintf(f, "usage: fi_group_bench [-m MODEL] [-t THREADS_PER_RANK] [-n DECODE_STEPS]\n"
               "                      [-p PROMPT_TOKENS] [-b BATCH] [-u MICRO_BATCH] [-a]\n\n"
               "The model sharded over ranks (threads with their own CURVE links on loopback):\n"
               "TTFT, decode tok/s, bytes between ranks per token, communication time per\n"
               "token, for TP=1, TP=2, PP=2 (stages in turn, then micro-batched; -a: also TP=3\n"
               "and TP=2xPP=2), and a projection for a model 50x larger. -u: the micro-batched\n"
               "PP=2 layout's micro_batch (default: the group file's default, 4 with zmq).\n"
               "Defaults: -t 1 -n 32 -p 128 -b 4, the default model.\n");
}

int main(int argc, char **argv) {
    s_opts o = {getenv("FEDINFER_MODEL") ? getenv("FEDINFER_MODEL") : FI_DEFAULT_MODEL, 1, 32,
                128, 4, 0, -1};
    static const struct option lo[] = {{"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "m:t:n:p:b:u:ah", lo, NULL)) != -1) {
        switch (ch) {
        case 'm': o.model = optarg; break;
        case 't': o.threads = atoi(optarg); break;
        case 'n': o.steps = atoi(optarg); break;
        case 'p': o.prompt = atoi(optarg); break;
        case 'b': o.batch = atoi(optarg); break;
        case 'u': {
            char *e = NULL;
            long v = strtol(optarg, &e, 10);
            o.micro = e != optarg && !*e && v >= 0 && v <= 1 << 16 ? (int)v : -2; /* -2: refused below */
            break;
        }
        case 'a': o.all = 1; break;
        case 'h': s_usage(stdout); return 0;
        default: s_usage(stderr); return 2;
        }
    }
    if (o.threads < 1 || o.steps < 1 || o.prompt < 1 || o.batch < 1 || o.batch > S_MAX_BATCH ||
        o.micro < -1 || optind != argc) {
        s_usage(stderr);
        return 2;
    }
    char err[512], dir[64];
    fi_group_model mi;
    uint8_t digest[FI_GROUP_DIGEST_BYTES];
    if (fi_group_model_read(o.model, &mi, err, sizeof err) ||
        fi_group_model_digest(o.model, digest, err, sizeof err)) {
        fprintf(stderr, "fi_group_bench: %s\n", err);
        return 1;
    }
    snprintf(dir, sizeof dir, "/tmp/fi_group_bench_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    for (int r = 0; r < 4; r++) {
        fi_keypair kp;
        char sec[128], pub[128];
        snprintf(sec, sizeof sec, "%s/r%d.key", dir, r);
        snprintf(pub, sizeof pub, "%s/r%d.pub", dir, r);
        if (fi_keys_generate(&kp) || fi_keys_save(&kp, sec, pub, 0, err, sizeof err)) {
            fprintf(stderr, "fi_group_bench: %s\n", err);
            return 1;
        }
        fi_keys_wipe(&kp);
    }
    /* TP=1 twice: with the threads of one rank, and with as many as TP=2
     * uses in all (the fair comparison on one machine). PP=2 twice: with
     * its stages in turn (micro_batch = 0), and with the group file's
     * default micro-batches (fi_group_micro_split). micro -1: the default. */
    struct { int world, tp, tmul, micro; } layouts[] = {{1, 1, 1, -1}, {1, 1, 2, -1}, {2, 2, 1, -1},
                                                        {2, 1, 1, 0},  {2, 1, 1, -1}, {3, 3, 1, -1},
                                                        {4, 2, 1, -1}};
    layouts[4].micro = o.micro;
    int n_layouts = o.all ? 7 : 5;
    s_fig figs[7];
    memset(figs, 0, sizeof figs);
    int port = 0;
    printf("model %s: %d layers, dim %d, %d heads / %d KV heads, ffn %d, vocab %d\n", o.model,
           mi.n_layers, mi.dim, mi.n_heads, mi.n_kv_heads, mi.ffn_dim, mi.n_vocab);
    printf("%d thread(s) per rank, prompt %d tokens, %d decode steps, batch %d; %ld CPU(s)\n\n",
           o.threads, o.prompt, o.steps, o.batch, sysconf(_SC_NPROCESSORS_ONLN));
    printf("%-10s %5s %9s %10s %10s %11s %11s %11s %11s\n", "layout", "ranks", "TTFT ms",
           "tok/s b=1", "tok/s b=B", "bytes/tok", "comm ms/tok", "wait ms/tok", "comp ms/tok");
    int ok = 0;
    for (int i = 0; i < n_layouts; i++) {
        if ((port = s_free_ports(layouts[i].world)) < 0 ||
            s_layout(&o, dir, port, layouts[i].world, layouts[i].tp, layouts[i].tmul,
                     layouts[i].micro, &mi, digest, &figs[i])) {
            fprintf(stderr, "fi_group_bench: layout world %d tp %d failed\n", layouts[i].world,
                    layouts[i].tp);
            continue;
        }
        ok++;
        s_fig *f = &figs[i];
        printf("%-10s %5d %9.1f %10.2f %10.2f %11.0f %11.3f %11.3f %11.3f\n", f->name, f->world,
               f->ttft_ms, f->tps1, f->tpsb, f->bytes_tok, f->comm_ms_tok, f->wait_ms_tok,
               f->compute_ms_tok);
        fflush(stdout);
    }
    /* The link alone, then the projection: a model 50x larger (about
     * 6.8B parameters), shaped like Llama-2-7B (32 layers, dim 4096, vocab
     * 32000). Decode is bound by reading the weights, so compute per token
     * scales with their size; each rank is assumed to have its own cores
     * and memory bandwidth (one machine per rank, or one GPU per rank). */
    const s_fig *t1 = &figs[0], *t2 = &figs[2];
    double lat = s_probe_sum(dir, s_free_ports(2), (size_t)mi.dim, 2000);
    double big = s_probe_sum(dir, s_free_ports(2), (size_t)1 << 18, 40); /* 1 MiB */
    if (lat > 0 && big > lat && t1->tps1 > 0) {
        const double L2 = 32, D2 = 4096, V2 = 32000, scale = 50;
        double bw = (double)((1 << 18) - mi.dim) * 4 / (big - lat); /* bytes/s one way */
        double lat_ms = lat * 1e3;
        double comp1 = 1e3 / t1->tps1 * scale; /* ms per token, whole model, one rank */
        double sum_ms = lat_ms + D2 * 4 / bw * 1e3;
        double tp2_comm = 2 * L2 * sum_ms;
        double pp2_comm = 2 * lat_ms + (D2 * 4 + V2 * 4) / bw * 1e3;
        printf("\nlink alone (two ranks, CURVE over loopback): %.1f us per TP sum of %d floats; "
               "%.0f MB/s for sums of 1 MiB\n",
               lat * 1e6, mi.dim, bw / 1e6);
        printf("measured in the passes above: TP=2 spent %.3f ms per token in sums (%d per "
               "token), i.e. %.1f us per sum with the ranks' skew\n",
               t2->comm_ms_tok, 2 * mi.n_layers, t2->comm_ms_tok * 1e3 / (2 * mi.n_layers));
        printf("projection for a 50x model (~6.8B, 32 layers, dim 4096), decode at batch 1, one "
               "rank per machine:\n");
        printf("  TP=1: %.0f ms/token computing (%.2f tok/s; measured TP=1 x 50)\n", comp1,
               1e3 / comp1);
        printf("  TP=2: %.0f ms computing + %.1f ms in 64 sums of 16 KB per token = %.2f tok/s "
               "(communication %.1f%% of a token)\n",
               comp1 / 2, tp2_comm, 1e3 / (comp1 / 2 + tp2_comm),
               100 * tp2_comm / (comp1 / 2 + tp2_comm));
        printf("  PP=2: %.0f ms computing (stages in turn) + %.1f ms moving 16 KB of activations "
               "and 125 KB of logits = %.2f tok/s at batch 1 (pipelining needs several batches "
               "in flight)\n",
               comp1, pp2_comm, 1e3 / (comp1 + pp2_comm));
        printf("  bytes per token between ranks: TP=2 %.0f KB, PP=2 %.0f KB\n",
               2 * 2 * L2 * D2 * 4 / 1024, (D2 * 4 + V2 * 4) / 1024);
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "fi_group_bench: could not remove %s\n", dir);
    return ok == n_layouts ? 0 : 1;
}
