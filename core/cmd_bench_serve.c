/*
 * cmd_bench_serve.c - `fedinfer bench --serve`: the scheduler under load.
 *
 * Three measurements, each in this one process on the same model:
 *
 *   concurrency  closed loop: C requests in flight (each finished one is
 *                replaced at once) until 2*C (at least 4) have completed;
 *                aggregate generated tokens/s (three ways: s_concurrency),
 *                time to first token (from submission, queueing included)
 *                and time per output token, p50 and p99, for each C of
 *                --concurrency; with --reps, each ratio to the first
 *                concurrency is taken within one repetition (odd ones run
 *                the list backwards) and the median printed.
 *   prefix       requests sharing a --shared-prefix-token document, each
 *                with its own question, one after the other and then 4 at
 *                a time, prefix cache on and off: time to first token.
 *   routing      two replicas (two schedulers with small KV pools), a
 *                stream of requests over 6 documents, one at a time, then
 *                4 at a time behind a shared system prompt; the
 *                coordinator's router (the replica whose prefix filter
 *                holds the longest chain of the request's block hashes,
 *                then the lighter load, then its rendezvous tie-break)
 *                with filters and without, against round-robin: prefix
 *                hit rate.
 *
 * Prompts are real text, not random ids, so that the model's outputs (and
 * where they stop) are what they would be in practice.
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_cmd.h"
#include "fi_sched.h"

#define S_MAX_CONC 16 /* concurrencies in one --concurrency list */
#define S_MAX_REPS 15 /* --reps */

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int s_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The q-quantile (0..1) of v[0..n), nearest rank; sorts v. */
static double s_pct(double *v, int n, double q) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, s_cmp);
    int i = (int)ceil(q * n) - 1;
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* One request's timings. */
/* The median of v[0..n) (the mean of the middle two for even n); sorts v. */
static double s_median(double *v, int n) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, s_cmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

typedef struct req {
    double t_submit, t_first, t_done;
    int n_gen, done;
    char error[160];
} req;

static int s_on_text(void *user, const char *t, size_t n) {
    (void)t;
    (void)n;
    req *r = user;
    if (r->t_first == 0) r->t_first = s_now();
    return 0;
}

static void s_on_done(void *user, const fi_gen_result *res, const char *error) {
    req *r = user;
    r->t_done = s_now();
    if (r->t_first == 0) r->t_first = r->t_done;
    r->n_gen = res->n_generated;
    r->done = 1;
    if (error) snprintf(r->error, sizeof r->error, "%s", error);
}

/* Each of the n requests' time to first token into ttft[i], and the time
 * per token after the first of those that made more than one into tpot;
 * the tokens generated into *gen. How many tpot, or -1 (said) when a
 * request failed. */
static int s_latencies(const req *rs, int n, double *ttft, double *tpot, long *gen) {
    int nt = 0;
    for (int i = 0; i < n; i++) {
        if (rs[i].error[0]) {
            fprintf(stderr, "fedinfer: request %d failed: %s\n", i, rs[i].error);
            return -1;
        }
        *gen += rs[i].n_gen;
        ttft[i] = rs[i].t_first - rs[i].t_submit;
        if (rs[i].n_gen > 1) tpot[nt++] = (rs[i].t_done - rs[i].t_first) / (rs[i].n_gen - 1);
    }
    return nt;
}

typedef struct bench {
    fi_model *m;
    const fi_tok *tok;
    int32_t *text;        /* a long run of text tokens */
    int n_text;
} bench;

/* Tokens for request i: a window of the text starting at a place of its
 * own (so prompts differ), n long. */
static void s_prompt(const bench *b, int i, int32_t *out, int n) {
    int start = (i * 37) % (b->n_text - n);
    memcpy(out, b->text + start, (size_t)n * sizeof *out);
}

static int64_t s_submit(fi_sched *s, const int32_t *p, int n, int max_tokens, req *r,
                        const char *tenant) {
    char err[256];
    fi_sched_req q = {.prompt = p, .n_prompt = n, .on_done = s_on_done, .tenant = tenant,
                      .zone = "bench"};
    q.gen.max_tokens = max_tokens;
    q.gen.sampling = fi_sampler_defaults();
    q.gen.sampling.temperature = 0; /* greedy: the same work every run */
    q.gen.on_text = s_on_text;
    q.gen.user = r;
    memset(r, 0, sizeof *r);
    r->t_submit = s_now();
    int64_t id = fi_sched_submit(s, &q, err, sizeof err);
    if (id < 0) fprintf(stderr, "fedinfer: submit: %s\n", err);
    return id;
}

static int s_step_all(fi_sched *s) {
    char err[256];
    if (fi_sched_step(s, err, sizeof err) < 0) {
        fprintf(stderr, "fedinfer: %s\n", err);
        return -1;
    }
    return 0;
}

/* Closed loop at concurrency c. Prints one row. Three throughputs, all
 * measured: agg (generated tokens over the wall time), dec (decode tokens
 * over the time of every step that decoded: only the steps that did
 * nothing but prefill are left out; those that also carried newcomers'
 * prompt chunks count, with their time), and step (decode tokens over the
 * time of the steps that carried only decode tokens: the engine's decode
 * rate at the batch it runs, an engine figure: at 16 it leaves out the
 * slow mixed steps that one stream never has). */
static int s_concurrency(bench *b, int c, int n_prompt, int n_gen, int max_seqs,
                         double *tput_out, double *dec_out, double *step_out) {
    char err[256];
    fi_sched_opts so = {.max_seqs = max_seqs, .n_ctx = n_prompt + n_gen + 16,
                        .no_prefix_cache = 1};
    fi_sched *s = fi_sched_new(b->m, &so, err, sizeof err);
    if (!s) {
        fprintf(stderr, "fedinfer: %s\n", err);
        return -1;
    }
    int total = 2 * c < 4 ? 4 : 2 * c, submitted = 0, rc = -1;
    req *rs = calloc((size_t)total, sizeof *rs);
    int32_t *p = malloc((size_t)n_prompt * sizeof *p);
    double *ttft = calloc((size_t)total, sizeof *ttft), *tpot = calloc((size_t)total, sizeof *tpot);
    if (!rs || !p || !ttft || !tpot) goto done;
    double t0 = s_now();
    while (submitted < c && submitted < total) {
        s_prompt(b, submitted, p, n_prompt);
        if (s_submit(s, p, n_prompt, n_gen, &rs[submitted], NULL) < 0) goto done;
        submitted++;
    }
    double dec_s = 0, any_s = 0;
    uint64_t dec_tok = 0, any_tok = 0;
    while (fi_sched_pending(s) > 0) {
        fi_sched_stats a, z;
        fi_sched_get_stats(s, &a);
        double ts = s_now();
        if (s_step_all(s)) goto done;
        fi_sched_get_stats(s, &z);
        double te = s_now();
        if (z.decode_tokens > a.decode_tokens) {
            any_s += te - ts;
            any_tok += z.decode_tokens - a.decode_tokens;
            if (z.prefill_tokens == a.prefill_tokens) {
                dec_s += te - ts;
                dec_tok += z.decode_tokens - a.decode_tokens;
            }
        }
        /* replace each finished request at once */
        int in_flight = fi_sched_pending(s);
        while (in_flight < c && submitted < total) {
            s_prompt(b, submitted, p, n_prompt);
            if (s_submit(s, p, n_prompt, n_gen, &rs[submitted], NULL) < 0) goto done;
            submitted++;
            in_flight++;
        }
    }
    double wall = s_now() - t0;
    long gen = 0;
    int nt = s_latencies(rs, total, ttft, tpot, &gen);
    if (nt < 0) goto done;
    *tput_out = (double)gen / wall;
    *dec_out = any_s > 0 ? (double)any_tok / any_s : 0;
    *step_out = dec_s > 0 ? (double)dec_tok / dec_s : 0;
    double t50 = s_pct(ttft, total, 0.5), t99 = s_pct(ttft, total, 0.99);
    double p50 = s_pct(tpot, nt, 0.5), p99 = s_pct(tpot, nt, 0.99);
    printf("  %4d  %8d  %10.1f  %10.1f  %11.1f  %8.0f  %8.0f  %8.1f  %8.1f\n", c, total, *tput_out,
           *dec_out, *step_out, t50 * 1e3, t99 * 1e3, p50 * 1e3, p99 * 1e3);
    fflush(stdout);
    rc = 0;
done:
    fi_sched_destroy(&s);
    free(rs);
    free(p);
    free(ttft);
    free(tpot);
    return rc;
}

/* What a shared-prefix run measured. */
typedef struct s_pfx {
    double ttft50, ttft99, tpot50, tpot99; /* seconds */
    double tput;                           /* generated tokens over the wall time */
    double hit_rate;                       /* prompt tokens taken from the cache */
} s_pfx;

/* Requests sharing a document prefix, c at a time (closed loop), with the
 * cache on or off. */
static int s_prefix(bench *b, int n_prefix, int n_suffix, int n_gen, int n_req, int c,
                    int cache_on, s_pfx *out) {
    char err[256];
    fi_sched_opts so = {.n_ctx = n_prefix + n_suffix + n_gen + 16, .max_seqs = c < 64 ? 64 : c,
                        .no_prefix_cache = !cache_on};
    fi_sched *s = fi_sched_new(b->m, &so, err, sizeof err);
    if (!s) {
        fprintf(stderr, "fedinfer: %s\n", err);
        return -1;
    }
    int rc = -1, n = n_prefix + n_suffix, submitted = 0;
    req *rs = calloc((size_t)n_req, sizeof *rs);
    double *ttft = calloc((size_t)n_req, sizeof *ttft), *tpot = calloc((size_t)n_req, sizeof *tpot);
    int32_t *p = malloc((size_t)n * sizeof *p);
    if (!rs || !ttft || !tpot || !p) goto done;
    memcpy(p, b->text, (size_t)n_prefix * sizeof *p); /* the shared document */
    /* the first request warms the cache and is not counted */
    req warm;
    s_prompt(b, 1000, p + n_prefix, n_suffix);
    if (s_submit(s, p, n, n_gen, &warm, "acme") < 0) goto done;
    while (fi_sched_pending(s) > 0)
        if (s_step_all(s)) goto done;
    fi_sched_stats st0, st1;
    fi_sched_get_stats(s, &st0);
    double t0 = s_now();
    while (submitted < n_req || fi_sched_pending(s) > 0) {
        while (submitted < n_req && fi_sched_pending(s) < c) {
            s_prompt(b, 2000 + 7 * submitted, p + n_prefix, n_suffix); /* its own question */
            if (s_submit(s, p, n, n_gen, &rs[submitted], "acme") < 0) goto done;
            submitted++;
        }
        if (s_step_all(s)) goto done;
    }
    double wall = s_now() - t0;
    fi_sched_get_stats(s, &st1);
    long gen = 0;
    int nt = s_latencies(rs, n_req, ttft, tpot, &gen);
    if (nt < 0) goto done;
    out->ttft50 = s_pct(ttft, n_req, 0.5);
    out->ttft99 = s_pct(ttft, n_req, 0.99);
    out->tpot50 = s_pct(tpot, nt, 0.5);
    out->tpot99 = s_pct(tpot, nt, 0.99);
    out->tput = (double)gen / wall;
    out->hit_rate = (double)(st1.prefix_hit_tokens - st0.prefix_hit_tokens) /
                    (double)(st1.prompt_tokens - st0.prompt_tokens);
    rc = 0;
done:
    fi_sched_destroy(&s);
    free(rs);
    free(ttft);
    free(tpot);
    free(p);
    return rc;
}

static fi_bench_route_fn s_router; /* fi_bench_serve_set_router */

void fi_bench_serve_set_router(fi_bench_route_fn fn) { s_router = fn; }

/* A routing workload: n_req requests over n_docs documents of doc_tokens
 * (each after sys_tokens of a system prompt shared by all, 0: none), each
 * with its own 16-token question and 1 generated token; at most inflight
 * of them at a time over two replicas whose KV pools hold about pool_docs
 * documents each. */
typedef struct s_route_load {
    int n_docs, doc_tokens, sys_tokens, n_req, inflight, pool_docs;
} s_route_load;

/* Hit rate of the coordinator's router with each replica's filter as it
 * is at each request (mode 1), as heartbeats would bring it, a snapshot
 * taken every refresh_n requests (mode 2), or with no filter at all (mode
 * 3: load, then its tie-break alone); or of round-robin (mode 0). The
 * replicas step in turn; deterministic. */
static int s_routing(bench *b, int mode, int refresh_n, const s_route_load *w, double *hit_rate,
                     double *seconds) {
    char err[256];
    const int sys_blocks = (w->sys_tokens + FI_KV_BLOCK - 1) / FI_KV_BLOCK;
    size_t per_doc = (size_t)(w->doc_tokens / FI_KV_BLOCK + 2) * fi_kv_block_bytes(b->m);
    fi_sched_opts so = {.n_ctx = w->sys_tokens + w->doc_tokens + 64,
                        .kv_bytes = per_doc * (size_t)w->pool_docs +
                                    (size_t)sys_blocks * fi_kv_block_bytes(b->m)};
    fi_sched *rep[2] = {fi_sched_new(b->m, &so, err, sizeof err),
                        fi_sched_new(b->m, &so, err, sizeof err)};
    int rc = -1, n = w->sys_tokens + w->doc_tokens + 16;
    int32_t *p = malloc((size_t)n * sizeof *p);
    /* each replica's filter as the router sees it, sized as a worker sizes
     * its own from its pool (fi_prefix_filter_bytes) */
    fi_sched_stats st0 = {0};
    if (rep[0]) fi_sched_get_stats(rep[0], &st0);
    size_t fb = fi_prefix_filter_bytes(st0.blocks_total);
    uint8_t *bits = calloc(2, fb);
    req *rs = calloc((size_t)w->n_req, sizeof *rs);
    uint64_t h[64];
    if (!rep[0] || !rep[1] || !p || !bits || !rs) {
        fprintf(stderr, "fedinfer: %s\n", rep[0] && rep[1] ? "out of memory" : err);
        goto done;
    }
    if (w->sys_tokens) s_prompt(b, 7, p, w->sys_tokens);
    uint32_t seed = 12345;
    double t0 = s_now();
    int i = 0;
    while (i < w->n_req || fi_sched_pending(rep[0]) + fi_sched_pending(rep[1]) > 0) {
        while (i < w->n_req && fi_sched_pending(rep[0]) + fi_sched_pending(rep[1]) < w->inflight) {
            seed = seed * 1664525u + 1013904223u;
            int doc = (int)((seed >> 8) % (uint32_t)w->n_docs);
            memcpy(p + w->sys_tokens, b->text + doc * 97 % (b->n_text - w->doc_tokens),
                   (size_t)w->doc_tokens * 4);
            s_prompt(b, 3000 + i, p + w->sys_tokens + w->doc_tokens, 16);
            int pick = i % 2;
            if (mode) {
                /* as the edge hashes (reusable blocks) and the coordinator
                 * ranks, with the filters its heartbeats brought */
                int nh = fi_prefix_hashes("acme", "bench", p, n - 1, h, 64);
                if (mode == 1 || (mode == 2 && i % refresh_n == 0))
                    for (int r = 0; r < 2; r++)
                        if (fi_sched_prefix_filter(rep[r], bits + r * fb, fb)) goto done;
                fi_bench_replica rr[2];
                for (int r = 0; r < 2; r++) {
                    fi_sched_stats st;
                    fi_sched_get_stats(rep[r], &st);
                    rr[r] = (fi_bench_replica){mode == 3 ? NULL : bits + r * fb, fb,
                                               (uint32_t)st.running, (uint32_t)st.queued, 8,
                                               0x5eed0000u + (uint64_t)r};
                }
                pick = s_router(rr, 2, h, nh);
            }
            if (s_submit(rep[pick], p, n, 1, &rs[i], "acme") < 0) goto done;
            i++;
        }
        for (int r = 0; r < 2; r++)
            if (fi_sched_pending(rep[r]) > 0 && s_step_all(rep[r])) goto done;
    }
    *seconds = s_now() - t0;
    for (int k = 0; k < w->n_req; k++)
        if (rs[k].error[0]) {
            fprintf(stderr, "fedinfer: routing request %d: %s\n", k, rs[k].error);
            goto done;
        }
    uint64_t hit = 0, all = 0;
    for (int r = 0; r < 2; r++) {
        fi_sched_stats st;
        fi_sched_get_stats(rep[r], &st);
        hit += st.prefix_hit_tokens;
        all += st.prompt_tokens;
    }
    *hit_rate = (double)hit / (double)all;
    rc = 0;
done:
    fi_sched_destroy(&rep[0]);
    fi_sched_destroy(&rep[1]);
    free(p);
    free(bits);
    free(rs);
    return rc;
}

/* The four routers on workload w, one row each. */
static int s_routing_rows(bench *b, const s_route_load *w) {
    double ca, st, nf, rr, tca, tst, tnf, trr;
    if (s_routing(b, 1, 0, w, &ca, &tca) || s_routing(b, 2, 40, w, &st, &tst) ||
        s_routing(b, 3, 0, w, &nf, &tnf) || s_routing(b, 0, 0, w, &rr, &trr))
        return -1;
    printf("  router, filters current   hit rate %.2f  (%.1f s)\n", ca, tca);
    printf("  router, filters every 40  hit rate %.2f  (%.1f s)\n", st, tst);
    printf("  router, no filters        hit rate %.2f  (%.1f s)\n", nf, tnf);
    printf("  round-robin               hit rate %.2f  (%.1f s)\n", rr, trr);
    printf("        -> filters current: %.2fx the hit rate of round-robin, %.2fx that of the router "
           "without filters; %.2fx round-robin's time\n",
           rr > 0 ? ca / rr : 0, nf > 0 ? ca / nf : 0, tca / trr);
    fflush(stdout);
    return 0;
}

static void s_usage(FILE *f) {
    fprintf(f,
            "usage: fedinfer bench --serve [options]\n"
            "\n"
            "Serving benchmarks of the continuous-batching scheduler: throughput and\n"
            "latency at several concurrencies, time to first token with a shared prefix\n"
            "(prefix cache on and off), and the prefix hit rate of cache-aware routing\n"
            "against round-robin over two replicas. Throughput three ways, all measured:\n"
            "tok/s(agg), the tokens generated over the wall time (prefills included);\n"
            "tok/s(dec), the decode tokens over the time of the steps that decoded\n"
            "(those that only prefilled left out; those that also carried newcomers'\n"
            "prompt chunks counted); tok/s(step), the decode tokens over the time of\n"
            "the steps that carried nothing else (an engine figure: at high concurrency\n"
            "it leaves out the slow mixed steps one stream never has). Percentiles are\n"
            "nearest-rank over the requests of a row: a p99 of fewer than 100 requests\n"
            "is their maximum (the first wave's, which all arrive at once). With 1 first\n"
            "in the list, on the CPU, one stream's decode is also given against the DRAM\n"
            "floor (the read bandwidth of a 1 GiB buffer over the bytes of weights a\n"
            "token reads), probed right after each repetition's one-stream run: the\n"
            "median fraction, and their range.\n"
            "\n"
            "options:\n"
            "  -m, --model FILE         GGUF model (default: the set-up's model)\n"
            "  -t, --threads N          CPU threads (default: one per core)\n"
            "      --concurrency LIST   comma-separated (default 1,4,16,64)\n"
            "      --prompt-tokens N    prompt length of the concurrency runs (default 64)\n"
            "      --gen-tokens N       tokens generated per request (default 64)\n"
            "      --shared-prefix N    shared document length (default 512)\n"
            "      --only WHAT          concurrency, prefix or routing (default: all three)\n"
            "  -r, --reps N             repeat the concurrency runs N times (1..15, default 1),\n"
            "                           every other time in reverse order; each ratio to the\n"
            "                           first concurrency is taken within one repetition, and\n"
            "                           its median and range are printed\n"
            "      --device DEV         cpu, cuda or auto (default auto)\n"
            "      --act-bits N         activation precision of the CPU's quantised products:\n"
            "                           16, 12 or 8 (default and meaning: fedinfer run --help)\n"
            "      --kv-bits N          the CPU's KV cache: 16 (fp16, default) or 8 (int8 with\n"
            "                           a scale per head: half the bytes)\n"
            "  -h, --help               this text\n");
}

int fi_cmd_bench_serve(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},         {"threads", required_argument, 0, 't'},
        {"concurrency", required_argument, 0, 'C'},   {"prompt-tokens", required_argument, 0, 'P'},
        {"gen-tokens", required_argument, 0, 'G'},    {"shared-prefix", required_argument, 0, 'S'},
        {"only", required_argument, 0, 'O'},          {"device", required_argument, 0, 'D'},
        {"serve", no_argument, 0, 'V'},               {"help", no_argument, 0, 'h'},
        {"reps", required_argument, 0, 'r'},          {"act-bits", required_argument, 0, 'B'},
        {"kv-bits", required_argument, 0, 'K'},       {0, 0, 0, 0}};
    const char *model = fi_default_model_path(), *only = NULL;
    char conc[128] = "1,4,16,64";
    long threads = 0, n_prompt = 64, n_gen = 64, n_prefix = 512, reps = 1, act_bits = 0, kv_bits = 16;
    fi_device device = FI_DEVICE_AUTO;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:t:r:h", opts, NULL)) != -1) {
        char *end;
        switch (c) {
        case 'm': model = optarg; break;
        case 't': threads = strtol(optarg, &end, 10); if (*end || threads < 1 || threads > 1024) goto bad; break;
        case 'P': n_prompt = strtol(optarg, &end, 10); if (*end || n_prompt < 1 || n_prompt > 4096) goto bad; break;
        case 'G': n_gen = strtol(optarg, &end, 10); if (*end || n_gen < 1 || n_gen > 4096) goto bad; break;
        case 'r': reps = strtol(optarg, &end, 10); if (*end || reps < 1 || reps > S_MAX_REPS) goto bad; break;
        case 'S': n_prefix = strtol(optarg, &end, 10); if (*end || n_prefix < 16 || n_prefix > 4096) goto bad; break;
        case 'C':
            if (strlen(optarg) >= sizeof conc || strspn(optarg, "0123456789,") != strlen(optarg)) goto bad;
            snprintf(conc, sizeof conc, "%s", optarg);
            break;
        case 'O':
            if (strcmp(optarg, "concurrency") && strcmp(optarg, "prefix") && strcmp(optarg, "routing")) goto bad;
            only = optarg;
            break;
        case 'D': if (fi_device_parse(optarg, &device)) goto bad; break;
        case 'B':
            act_bits = strtol(optarg, &end, 10);
            if (*end || (act_bits != 8 && act_bits != 12 && act_bits != 16)) {
                fprintf(stderr, "fedinfer: bench --serve: --act-bits must be 8, 12 or 16, not '%s'\n", optarg);
                return 2;
            }
            break;
        case 'K':
            kv_bits = strtol(optarg, &end, 10);
            if (*end || (kv_bits != 8 && kv_bits != 16)) {
                fprintf(stderr, "fedinfer: bench --serve: --kv-bits must be 8 or 16, not '%s'\n", optarg);
                return 2;
            }
            break;
        case 'V': break;
        case 'h': s_usage(stdout); return 0;
        default: s_usage(stderr); return 2;
        }
        continue;
    bad:
        fprintf(stderr, "fedinfer: bench --serve: bad value '%s' for an option (see --help)\n", optarg);
        return 2;
    }
    int cl[S_MAX_CONC], ncl = 0;
    for (char *save = NULL, *tokp = strtok_r(conc, ",", &save); tokp; tokp = strtok_r(NULL, ",", &save)) {
        int cc = atoi(tokp);
        if (cc < 1 || cc > 256 || ncl == S_MAX_CONC) {
            fprintf(stderr, "fedinfer: bench --serve: concurrency %s: each must be in 1..256, at most %d of them\n",
                    tokp, S_MAX_CONC);
            return 2;
        }
        cl[ncl++] = cc;
    }
    if (ncl == 0) {
        fprintf(stderr, "fedinfer: bench --serve: --concurrency lists no concurrency\n");
        return 2;
    }
    char err[512];
    fi_model_opts mo = {.n_threads = (int)threads, .simd = FI_SIMD_AUTO, .device = device,
                        .act_bits = (int)act_bits, .kv_bits = (int)kv_bits};
    bench b = {0};
    b.m = fi_model_load(model, &mo, err, sizeof err);
    if (!b.m) {
        fprintf(stderr, "fedinfer: %s\n", err);
        return 1;
    }
    b.tok = fi_model_tok(b.m);
    int status = 1;
    const char *para[] = {
        "Federated inference keeps regulated data where the law says it must stay, while still "
        "letting every site use a capable language model. ",
        "Hospitals, banks and factories each run a local engine and send work elsewhere only "
        "when policy allows. ",
        "A clinic in Lyon may summarise a discharge letter on its own server at night, and a "
        "branch office in Porto may draft a reply to a customer in the morning. ",
        "The coordinator keeps the list of sites and clusters, signs each policy version, and "
        "records every decision in a log that cannot be rewritten without notice. ",
        "When the network to the core is down, the edge goes on answering what it may answer "
        "alone, and refuses at once what must be processed elsewhere. "};
    size_t cap = 1 << 16;
    b.text = malloc(cap * sizeof *b.text);
    char *buf = malloc(1 << 16);
    if (!b.text || !buf) goto done;
    for (int i = 0; i < 200 && b.n_text < 8192; i++) { /* varied text: paragraphs in turn */
        const char *t = para[(i * 3 + i / 5) % 5];
        int k = fi_tok_encode(b.tok, t, strlen(t), 0, b.text + b.n_text, (int)(cap - (size_t)b.n_text));
        if (k <= 0) break;
        b.n_text += k;
    }
    free(buf);
    if (b.n_text < 4096) {
        fprintf(stderr, "fedinfer: could not tokenize the benchmark text\n");
        goto done;
    }
    const fi_backend *be = fi_model_backend(b.m);
    printf("model          %s\n", model);
    if (fi_cpu_backend_simd(be))
        printf("backend        %s, %d threads, simd %s, %d-bit activations, %d-bit KV cache\n",
               be->ops->name, fi_cpu_backend_threads(be), fi_cpu_backend_simd(be),
               fi_cpu_backend_act_bits(be), fi_backend_kv_bits(be));
    else
        printf("backend        %s\n", be->ops->name);

    if (!only || !strcmp(only, "concurrency")) {
        printf("\nconcurrency: prompts of %ld tokens, %ld generated each (greedy), closed loop\n",
               n_prompt, n_gen);
        /* [rep][i][agg, dec, step] */
        double (*v)[S_MAX_CONC][3] = calloc((size_t)reps, sizeof *v);
        if (!v) goto done;
        /* one stream against what memory allows: with 1 first in the
         * list, on the CPU, the read bandwidth is probed right after each
         * repetition's one-stream run (the floor moves with the machine's
         * other load, so each run is set against its own window) */
        const uint64_t wbytes = fi_model_weight_bytes_per_token(b.m);
        const int want_bw = cl[0] == 1 && fi_cpu_backend_simd(be) && wbytes;
        double bw[S_MAX_REPS] = {0};
        /* many streams against what compute allows: the products'
         * ceiling for the backend's kernels, probed right after each
         * repetition's run of the largest concurrency (the same window) */
        int top = 0;
        for (int i = 1; i < ncl; i++)
            top = cl[i] > cl[top] ? i : top;
        const int want_ceil = ncl > 1 && fi_cpu_backend_simd(be);
        /* both probes run on one pool of the backend's thread count */
        fi_pool *probe = want_bw || want_ceil ? fi_pool_new(fi_cpu_backend_threads(be)) : NULL;
        double ceil_tps[S_MAX_REPS] = {0};
        char ceil_what[256] = "";
        for (int r = 0; r < reps; r++) {
            if (reps > 1)
                printf("rep %d of %ld (%s order)\n", r + 1, reps, r % 2 ? "reverse" : "list");
            printf("  conc  requests  tok/s(agg)  tok/s(dec)  tok/s(step)  ttft p50  ttft p99  tpot p50  "
                   "tpot p99   (ms)\n");
            for (int k = 0; k < ncl; k++) {
                /* odd repetitions in reverse order: a machine that drifts
                 * faster or slower favours neither end of the list */
                int i = r % 2 ? ncl - 1 - k : k;
                if (s_concurrency(&b, cl[i], (int)n_prompt, (int)n_gen, cl[i] < 64 ? 64 : cl[i],
                                  &v[r][i][0], &v[r][i][1], &v[r][i][2])) {
                    free(v);
                    fi_pool_destroy(&probe);
                    goto done;
                }
                if (probe && want_bw && i == 0)
                    bw[r] = fi_bench_read_bandwidth(probe, (size_t)1 << 30, 5);
                if (probe && want_ceil && i == top)
                    ceil_tps[r] = fi_bench_product_ceiling(probe, b.m, fi_cpu_backend_simd(be),
                                                           fi_cpu_backend_act_bits(be), ceil_what,
                                                           sizeof ceil_what);
            }
        }
        fi_pool_destroy(&probe);
        /* each throughput against the first concurrency's in the same
         * repetition; medians over the repetitions */
        for (int i = 1; i < ncl; i++) {
            double q[3][S_MAX_REPS], med[3], lo[3], hi[3];
            for (int m = 0; m < 3; m++) {
                for (int r = 0; r < reps; r++)
                    q[m][r] = v[r][0][m] > 0 ? v[r][i][m] / v[r][0][m] : 0;
                lo[m] = hi[m] = q[m][0];
                for (int r = 1; r < reps; r++) {
                    lo[m] = q[m][r] < lo[m] ? q[m][r] : lo[m];
                    hi[m] = q[m][r] > hi[m] ? q[m][r] : hi[m];
                }
                med[m] = s_median(q[m], (int)reps);
            }
            if (reps == 1)
                printf("        -> concurrency %d: %.2fx the aggregate throughput of concurrency %d "
                       "(decoding steps: %.2fx; decode-only steps: %.2fx)\n",
                       cl[i], med[0], cl[0], med[1], med[2]);
            else
                printf("        -> concurrency %d against %d, median of %ld [range]: aggregate "
                       "%.2fx [%.2f-%.2f], decoding steps %.2fx [%.2f-%.2f], decode-only steps "
                       "%.2fx [%.2f-%.2f]\n",
                       cl[i], cl[0], reps, med[0], lo[0], hi[0], med[1], lo[1], hi[1], med[2], lo[2],
                       hi[2]);
        }
        /* each repetition's one stream against the floor probed right
         * after it: its decode reads every weight once a token, so the
         * fraction says how much of a many-against-one ratio is the
         * machine's */
        double fr[S_MAX_REPS], one[S_MAX_REPS], gbs[S_MAX_REPS];
        int np = 0;
        for (int r = 0; r < reps; r++)
            if (bw[r] > 0 && v[r][0][1] > 0) {
                one[np] = v[r][0][1];
                gbs[np] = bw[r] / 1e9;
                fr[np++] = v[r][0][1] / (bw[r] / (double)wbytes);
            }
        if (np > 0) {
            double flo = fr[0], fhi = fr[0], blo = gbs[0], bhi = gbs[0];
            for (int k = 1; k < np; k++) {
                flo = fr[k] < flo ? fr[k] : flo;
                fhi = fr[k] > fhi ? fr[k] : fhi;
                blo = gbs[k] < blo ? gbs[k] : blo;
                bhi = gbs[k] > bhi ? gbs[k] : bhi;
            }
            const double gmed = s_median(gbs, np);
            printf("        -> one stream's decoding steps, %.1f tok/s: %.2f of the DRAM floor (%.1f tok/s: "
                   "%.1f GB/s read by %d threads over %.1f MiB of weights a token",
                   s_median(one, np), s_median(fr, np), gmed * 1e9 / (double)wbytes, gmed,
                   fi_cpu_backend_threads(be), (double)wbytes / (1 << 20));
            if (np > 1)
                printf("; medians of %d repetitions, each against a probe right after its one-stream "
                       "run: fractions %.2f-%.2f, %.1f-%.1f GB/s", np, flo, fhi, blo, bhi);
            printf(")\n");
        }
        /* the largest concurrency's decode-only steps against the
         * products' ceiling, and that ceiling against one stream: how
         * much of a many-against-one ratio this machine's arithmetic
         * allows at all */
        if (ncl > 1 && fi_cpu_backend_simd(be)) {
            double fc[S_MAX_REPS], cc[S_MAX_REPS], kc[S_MAX_REPS], st[S_MAX_REPS];
            int nc = 0;
            double probed = 0; /* the first ceiling probed */
            for (int r = 0; r < reps; r++) {
                if (probed == 0) probed = ceil_tps[r];
                if (ceil_tps[r] > 0 && v[r][top][2] > 0 && v[r][0][1] > 0) {
                    st[nc] = v[r][top][2];
                    cc[nc] = ceil_tps[r];
                    fc[nc] = v[r][top][2] / ceil_tps[r];
                    kc[nc++] = ceil_tps[r] / v[r][0][1];
                }
            }
            if (nc > 0)
                printf("        -> concurrency %d's decode-only steps, %.1f tok/s: %.2f of the products' ceiling "
                       "(%.1f tok/s: %s; probed right after its run%s); that ceiling is %.2fx concurrency "
                       "%d's decoding steps\n",
                       cl[top], s_median(st, nc), s_median(fc, nc), s_median(cc, nc), ceil_what,
                       nc > 1 ? ", medians over the repetitions" : "", s_median(kc, nc), cl[0]);
            else if (probed > 0)
                printf("        -> the products' ceiling: %.1f tok/s (%s); no decode-only steps at "
                       "concurrency %d to set against it\n", probed, ceil_what, cl[top]);
            else
                printf("        -> the products' ceiling: not probed (%s)\n", ceil_what);
        }
        free(v);
    }
    if (!only || !strcmp(only, "prefix")) {
        /* at each concurrency of the list, 2c requests (at least 8) after
         * one that warms the cache, each with its own question */
        printf("\nshared prefix: a %ld-token document + a 16-token question, 8 generated; at each\n"
               "concurrency 2c requests (at least 8), the cache warmed by one before\n",
               n_prefix);
        printf("  conc  cache  tok/s(agg)  ttft p50  ttft p99  tpot p50  tpot p99   (ms)  hit rate\n");
        for (int i = 0; i < ncl; i++) {
            int cc = cl[i], nr = 2 * cc < 8 ? 8 : 2 * cc;
            s_pfx on, off;
            if (s_prefix(&b, (int)n_prefix, 16, 8, nr, cc, 1, &on) ||
                s_prefix(&b, (int)n_prefix, 16, 8, nr, cc, 0, &off))
                goto done;
            const s_pfx *row[2] = {&on, &off};
            for (int k = 0; k < 2; k++)
                printf("  %4d  %-5s  %10.1f  %8.1f  %8.1f  %8.1f  %8.1f         %8.2f\n", cc, k ? "off" : "on",
                       row[k]->tput, row[k]->ttft50 * 1e3, row[k]->ttft99 * 1e3, row[k]->tpot50 * 1e3,
                       row[k]->tpot99 * 1e3, row[k]->hit_rate);
            printf("        -> the prefix cache cuts time to first token %.1fx (p50), %.2fx the throughput\n",
                   off.ttft50 / on.ttft50, off.tput > 0 ? on.tput / off.tput : 0);
            fflush(stdout);
        }
    }
    if ((!only || !strcmp(only, "routing")) && !s_router) {
        printf("\nrouting: left out (no router: this build of bench --serve has no fabric)\n");
    } else if (!only || !strcmp(only, "routing")) {
        printf("\nrouting: 2 replicas, each KV pool holding ~3 documents; 48 requests over 6\n"
               "documents of 128 tokens (+16-token question, 1 generated); the coordinator's\n"
               "router (fi_route_pick) with each replica's prefix filter as it is at each\n"
               "request, as heartbeats would bring it (every 40 requests, about a second at\n"
               "this pace), and with none (load, then its tie-break alone)\n");
        const s_route_load serial = {6, 128, 0, 48, 1, 3};
        const s_route_load shared = {6, 128, 96, 48, 4, 3};
        printf("one request at a time:\n");
        if (s_routing_rows(&b, &serial)) goto done;
        printf("a 96-token system prompt shared by all before each document (so the first\n"
               "blocks, the tie-break's key, are the same for every request), 4 in flight:\n");
        if (s_routing_rows(&b, &shared)) goto done;
    }
    status = 0;
done:
    free(b.text);
    fi_model_destroy(&b.m);
    return status;
}
