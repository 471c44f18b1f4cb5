/*
 * cmd_bench.c - `fedinfer bench`: prefill and decode speed, peak memory,
 * and the memory-bandwidth floor measured in the same process.
 *
 * Decode of a small model reads every weight once per token, so its speed
 * is bounded by how fast the machine can read those bytes. The probe reads
 * a buffer of exactly that size with the same number of threads, as fast
 * as the CPU allows (wide loads, no computation), and reports the floor:
 * bandwidth / bytes per token. A second probe on a buffer far larger than
 * the caches gives the DRAM floor. Decode is reported as a ratio to both.
 *
 * The probes run after the peak-RSS reading so that their buffers do not
 * count against the engine.
 */
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "fi_cmd.h"
#include "fi_model.h"

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int s_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double s_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, s_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* --- bench ------------------------------------------------------------- */

static void s_usage(FILE *f) {
    fprintf(f,
            "usage: fedinfer bench [options]\n"
            "\n"
            "Measures, on one model and in one process: prefill tokens/s for a prompt of\n"
            "--prompt-tokens tokens, decode tokens/s (greedy, batch 1), peak RSS after the\n"
            "context is filled to --ctx tokens, and the memory-bandwidth floor: the bytes of\n"
            "weights read per decoded token and the tokens/s a pure read of that many bytes\n"
            "allows, on a buffer of that size and on one larger than the caches.\n"
            "\n"
            "options:\n"
            "  -m, --model FILE         GGUF model (default: the set-up's model)\n"
            "  -t, --threads N          CPU threads (default: one per core)\n"
            "      --prompt-tokens N    prefill prompt length (default 256)\n"
            "      --gen-tokens N       tokens to decode per repetition (default 128)\n"
            "  -c, --ctx N              context to fill for the memory figure (default 2048)\n"
            "  -r, --reps N             repetitions; medians are reported (default 3)\n"
            "      --simd MODE          auto, portable or avx2 (default auto)\n"
            "      --device DEV         cpu, cuda or auto (default auto: CUDA when present)\n"
            "      --kv-bits N          the CPU's KV cache: 16 (fp16, default) or 8 (int8 with a\n"
            "                           scale per head: the peak RSS shows the smaller cache)\n"
            "      --serve              the serving benchmarks instead (see --serve --help)\n"
            "  -h, --help               this text\n");
}

static int s_arg_int(const char *opt, const char *s, long lo, long hi, long *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "fedinfer: %s expects an integer in [%ld, %ld], not '%s'\n", opt, lo, hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

int fi_cmd_bench(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--serve")) return fi_cmd_bench_serve(argc, argv);
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},        {"threads", required_argument, 0, 't'},
        {"prompt-tokens", required_argument, 0, 'P'}, {"gen-tokens", required_argument, 0, 'G'},
        {"ctx", required_argument, 0, 'c'},          {"reps", required_argument, 0, 'r'},
        {"simd", required_argument, 0, 'I'},         {"help", no_argument, 0, 'h'},
        {"device", required_argument, 0, 'D'},       {"kv-bits", required_argument, 0, 'K'},
        {0, 0, 0, 0}};
    const char *model = fi_default_model_path();
    long threads = 0, n_prompt = 256, n_gen = 128, n_ctx = 2048, reps = 3, kv_bits = 16;
    fi_simd simd = FI_SIMD_AUTO;
    fi_device device = FI_DEVICE_AUTO;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:t:c:r:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 't': if (s_arg_int("--threads", optarg, 1, 1024, &threads)) return 2; break;
        case 'P': if (s_arg_int("--prompt-tokens", optarg, 1, 1 << 20, &n_prompt)) return 2; break;
        case 'G': if (s_arg_int("--gen-tokens", optarg, 1, 1 << 20, &n_gen)) return 2; break;
        case 'c': if (s_arg_int("--ctx", optarg, 1, 1 << 24, &n_ctx)) return 2; break;
        case 'r': if (s_arg_int("--reps", optarg, 1, 1000, &reps)) return 2; break;
        case 'I': if (fi_parse_simd(optarg, &simd)) return 2; break;
        case 'D':
            if (fi_device_parse(optarg, &device)) {
                fprintf(stderr, "fedinfer: --device expects cpu, cuda or auto, not '%s'\n", optarg);
                return 2;
            }
            break;
        case 'K':
            if (s_arg_int("--kv-bits", optarg, 8, 16, &kv_bits)) return 2;
            if (kv_bits != 8 && kv_bits != 16) {
                fprintf(stderr, "fedinfer: --kv-bits expects 8 or 16, not '%s'\n", optarg);
                return 2;
            }
            break;
        case 'h': s_usage(stdout); return 0;
        default: s_usage(stderr); return 2;
        }
    }
    if (optind != argc) {
        s_usage(stderr);
        return 2;
    }
    char err[512];
    fi_model_opts mo = {.n_threads = (int)threads, .simd = simd, .device = device,
                        .kv_bits = (int)kv_bits};
    fi_model *m = fi_model_load(model, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "fedinfer: %s\n", err);
        return 1;
    }
    const fi_config *cfg = fi_model_config(m);
    if (n_ctx > cfg->ctx_train) n_ctx = cfg->ctx_train;
    if (n_prompt + n_gen > n_ctx) {
        fprintf(stderr, "fedinfer: --prompt-tokens %ld + --gen-tokens %ld exceed --ctx %ld\n",
                n_prompt, n_gen, n_ctx);
        fi_model_destroy(&m);
        return 2;
    }
    int status = 1;
    fi_session *s = NULL;
    fi_pool *pool = NULL;
    float *logits = malloc((size_t)cfg->n_vocab * sizeof(float));
    int32_t *toks = malloc((size_t)n_ctx * sizeof(int32_t));
    double *pre = calloc((size_t)reps, sizeof(double)), *dec = calloc((size_t)reps, sizeof(double));
    if (!logits || !toks || !pre || !dec) {
        fprintf(stderr, "fedinfer: out of memory\n");
        goto done;
    }
    /* A prompt of real text, repeated to length: tokens the model sees in
     * practice, not random ids. */
    const fi_tok *tok = fi_model_tok(m);
    const char *text =
        "Federated inference keeps regulated data where the law says it must stay, while "
        "still letting every site use a capable language model. Hospitals, banks and "
        "factories each run a local engine and send work elsewhere only when policy allows. ";
    int nt = fi_tok_encode(tok, text, strlen(text), 0, toks, (int)n_ctx);
    if (nt <= 0) {
        fprintf(stderr, "fedinfer: could not tokenize the benchmark text\n");
        goto done;
    }
    if (nt > n_ctx) nt = (int)n_ctx; /* a context shorter than the text: its start */
    for (long i = nt; i < n_ctx; i++) toks[i] = toks[i % nt];

    s = fi_session_new(m, (int)n_ctx, err, sizeof err);
    if (!s) {
        fprintf(stderr, "fedinfer: %s\n", err);
        goto done;
    }
    const fi_backend *be = fi_model_backend(m);
    int nth = fi_cpu_backend_threads(be);
    printf("model          %s\n", model);
    printf("config         %d layers, dim %d, ffn %d, heads %d/%d, vocab %d\n", cfg->n_layers,
           cfg->dim, cfg->ffn_dim, cfg->n_heads, cfg->n_kv_heads, cfg->n_vocab);
    if (fi_cpu_backend_simd(be))
        printf("backend        %s, %d threads, simd %s, %d-bit KV cache\n", be->ops->name, nth,
               fi_cpu_backend_simd(be), fi_backend_kv_bits(be));
    else
        printf("backend        %s\n", be->ops->name);

    /* warm-up: page in the weights, settle the clocks */
    fi_session_rewind(s, 0);
    if (fi_session_eval(s, toks, n_ctx < 16 ? (int)n_ctx : 16, logits, NULL, err, sizeof err) != 0) goto eval_fail;

    for (long r = 0; r < reps; r++) {
        fi_session_rewind(s, 0);
        double t0 = s_now();
        if (fi_session_eval(s, toks, (int)n_prompt, logits, NULL, err, sizeof err) != 0)
            goto eval_fail;
        double t1 = s_now();
        pre[r] = (double)n_prompt / (t1 - t0);
        int32_t id = fi_argmax(logits, cfg->n_vocab);
        double t2 = s_now();
        for (long g = 0; g < n_gen; g++) {
            if (fi_session_eval(s, &id, 1, logits, NULL, err, sizeof err) != 0) goto eval_fail;
            id = fi_argmax(logits, cfg->n_vocab);
        }
        dec[r] = (double)n_gen / (s_now() - t2);
    }
    double pre_med = s_median(pre, (int)reps), dec_med = s_median(dec, (int)reps);
    printf("prefill        %.1f tok/s  (%ld-token prompt, median of %ld; min %.1f max %.1f)\n",
           pre_med, n_prompt, reps, pre[0], pre[reps - 1]);
    printf("decode         %.1f tok/s  (%ld tokens after the prompt, median of %ld; min %.1f max %.1f)\n",
           dec_med, n_gen, reps, dec[0], dec[reps - 1]);

    /* fill the context, then read the peak RSS */
    fi_session_rewind(s, 0);
    double tf = s_now();
    if (fi_session_eval(s, toks, (int)n_ctx, logits, NULL, err, sizeof err) != 0) goto eval_fail;
    tf = s_now() - tf;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double rss_mib = (double)ru.ru_maxrss / 1024.0;
    double file_mib = (double)fi_gguf_file_size(fi_model_gguf(m)) / (1 << 20);
    printf("long prefill   %.1f tok/s  (context filled to %ld tokens)\n", (double)n_ctx / tf, n_ctx);
    printf("peak RSS       %.1f MiB = model file %.1f MiB + %.1f MiB  (context %ld)\n", rss_mib,
           file_mib, rss_mib - file_mib, n_ctx);
    /* the same decode with 8-bit activations, for the trade-off; after the
     * peak RSS, as its kernels read the weights from the file's mapping
     * (the 16-bit ones may use the backend's packed copy) */
    fi_backend *beb = fi_model_backend(m);
    double dec8 = 0;
    const int bits0 = fi_cpu_backend_act_bits(beb);
    if (fi_cpu_backend_set_act_bits(beb, 8) == 0) {
        double *d8 = calloc((size_t)reps, sizeof(double));
        if (!d8) goto done;
        for (long r = 0; r < reps; r++) {
            fi_session_rewind(s, 0);
            if (fi_session_eval(s, toks, (int)n_prompt, logits, NULL, err, sizeof err) != 0) {
                free(d8);
                goto eval_fail;
            }
            int32_t id = fi_argmax(logits, cfg->n_vocab);
            double t2 = s_now();
            for (long g = 0; g < n_gen; g++) {
                if (fi_session_eval(s, &id, 1, logits, NULL, err, sizeof err) != 0) {
                    free(d8);
                    goto eval_fail;
                }
                id = fi_argmax(logits, cfg->n_vocab);
            }
            d8[r] = (double)n_gen / (s_now() - t2);
        }
        dec8 = s_median(d8, (int)reps);
        free(d8);
        if (fi_cpu_backend_set_act_bits(beb, bits0) != 0) goto done;
    }
    if (dec8 > 0)
        printf("decode 8-bit   %.1f tok/s  (the decode above with 8-bit activations: %.2fx; less "
               "exact)\n", dec8, dec8 / dec_med);
    fi_session_destroy(&s);

    if (!fi_cpu_backend_simd(be)) { /* the floor below is a CPU measurement */
        printf("bandwidth      (CPU only; kernels/cuda/gpu-check.sh measures the GPU)\n");
        status = 0;
        goto done;
    }
    /* bandwidth floor, same thread count */
    uint64_t wbytes = fi_model_weight_bytes_per_token(m);
    pool = fi_pool_new(nth);
    if (!pool) {
        fprintf(stderr, "fedinfer: could not start the probe's threads\n");
        goto done;
    }
    double bw_w = fi_bench_read_bandwidth(pool, (size_t)wbytes, 20);
    double bw_d = fi_bench_read_bandwidth(pool, (size_t)1 << 30, 5);
    double floor_w = bw_w / (double)wbytes, floor_d = bw_d / (double)wbytes;
    printf("weights/token  %.1f MiB read per decoded token\n", (double)wbytes / (1 << 20));
    printf("bandwidth      %.1f GB/s reading a %.0f MiB buffer (the weights' size) -> floor %.1f tok/s\n",
           bw_w / 1e9, (double)wbytes / (1 << 20), floor_w);
    printf("               %.1f GB/s reading a 1024 MiB buffer (beyond the caches)  -> floor %.1f tok/s\n",
           bw_d / 1e9, floor_d);
    printf("decode/floor   %.2f of the weights-size floor, %.2f of the DRAM floor\n",
           dec_med / floor_w, dec_med / floor_d);
    status = 0;
    goto done;
eval_fail:
    fprintf(stderr, "fedinfer: %s\n", err);
done:
    fi_pool_destroy(&pool);
    fi_session_destroy(&s);
    fi_model_destroy(&m);
    free(logits);
    free(toks);
    free(pre);
    free(dec);
    return status;
}
