/*
 * cmd_run.c - `fedinfer run` and `fedinfer inspect`.
 *
 * run streams a reply to stdout as it is generated; diagnostics and
 * statistics go to stderr so that stdout holds only the model's text.
 */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fi_cmd.h"
#include "fi_model.h"
#include "fi_sched.h"

const char *fi_default_model_path(void) {
    const char *env = getenv("FEDINFER_MODEL");
    return env && *env ? env : FI_DEFAULT_MODEL;
}

/* Parses a whole decimal integer in [lo, hi]; 0 on success. */
static int s_parse_int(const char *opt, const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "fedinfer: %s expects an integer in [%ld, %ld], not '%s'\n", opt, lo, hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

static int s_parse_float(const char *opt, const char *s, double lo, double hi, float *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "fedinfer: %s expects a number in [%g, %g], not '%s'\n", opt, lo, hi, s);
        return -1;
    }
    *out = (float)v;
    return 0;
}

int fi_parse_simd(const char *s, fi_simd *out) {
    if (!strcmp(s, "auto")) *out = FI_SIMD_AUTO;
    else if (!strcmp(s, "portable")) *out = FI_SIMD_PORTABLE;
    else if (!strcmp(s, "avx2")) *out = FI_SIMD_AVX2;
    else {
        fprintf(stderr, "fedinfer: --simd expects auto, portable or avx2, not '%s'\n", s);
        return -1;
    }
    return 0;
}

static void s_run_usage(FILE *f) {
    fprintf(f,
            "usage: fedinfer run [options] [PROMPT...]\n"
            "\n"
            "Generates a reply to PROMPT (or to standard input when PROMPT is absent or '-')\n"
            "and streams it to standard output. By default the prompt is a user message\n"
            "wrapped in the model's chat template.\n"
            "\n"
            "options:\n"
            "  -m, --model FILE        GGUF model (default: $FEDINFER_MODEL or\n"
            "                          %s)\n"
            "      --model-sha256 HEX  refuse a model file whose SHA-256 is not HEX\n"
            "      --raw               plain completion: no chat template\n"
            "      --system TEXT       system message (chat mode)\n"
            "  -n, --max-tokens N      tokens to generate at most (default 256)\n"
            "      --temp T            temperature; 0 is greedy (default 0.7)\n"
            "      --top-k K           keep the K most likely tokens; 0 is off (default 40)\n"
            "      --top-p P           nucleus sampling; 1 is off, 0 greedy (default 0.95)\n"
            "      --min-p P           drop tokens below P x the best; 0 is off (default 0.05)\n"
            "      --repeat-penalty R  penalise recent tokens; 1 is off (default 1.0)\n"
            "      --presence-penalty P, --frequency-penalty F\n"
            "                          OpenAI's: subtract P once, F per time, from each\n"
            "                          token generated so far; -2..2, 0 is off (default)\n"
            "      --seed N            RNG seed (default: from the clock, printed with --stats)\n"
            "      --stop TEXT         stop before TEXT (repeatable)\n"
            "  -t, --threads N         CPU threads (default: one per core)\n"
            "  -c, --ctx N             context size in tokens (default 4096)\n"
            "      --simd MODE         auto, portable or avx2 (default auto)\n"
            "      --device DEV        cpu, cuda or auto: CUDA device 0 when present, else\n"
            "                          the CPU (default auto)\n"
            "      --act-bits N        activation precision in quantised products: 16\n"
            "                          (one scale per token; logits within ~0.08 of an\n"
            "                          exact computation), 12 (a scale per 32 values,\n"
            "                          within ~0.2; batches faster on AMX) or 8 (as\n"
            "                          llama.cpp; up to ~1.2; batches of tokens faster\n"
            "                          with AVX512-VNNI); default 12 where an AMX tile\n"
            "                          unit serves the products, else 16\n"
            "      --kv-bits N         KV cache precision on the CPU: 16 (fp16, default)\n"
            "                          or 8 (int8 with a scale per head: half the memory\n"
            "                          and half the bytes attention reads)\n"
            "      --stats             print timings and token counts to stderr\n"
            "  -h, --help              this text\n",
            FI_DEFAULT_MODEL);
}

typedef struct run_out {
    int any;            /* wrote something */
    fi_gen_result res;  /* how it ended */
    char error[512];    /* why it failed, or empty */
} run_out;

static void s_done(void *user, const fi_gen_result *res, const char *error) {
    run_out *o = user;
    o->res = *res;
    if (error) snprintf(o->error, sizeof o->error, "%s", error);
}

static int s_print(void *user, const char *text, size_t len) {
    run_out *o = user;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    o->any = 1;
    return 0;
}

/* The most of a prompt read from stdin: far past any model's context. */
#define S_STDIN_MAX ((size_t)64 << 20)

/* Reads all of stdin into a malloc'd string. NULL with the reason in err
 * and the exit status in *status: 1, out of memory; 2, a read error, more
 * than S_STDIN_MAX bytes, or a NUL byte (the prompt would end there
 * without a word; the same text on the command line cannot hold one). */
static char *s_read_stdin(int *status, char *err, size_t cap) {
    *status = 2;
    size_t bcap = 4096, len = 0;
    char *buf = malloc(bcap);
    if (!buf) goto oom;
    size_t n;
    while ((n = fread(buf + len, 1, bcap - len - 1, stdin)) > 0) {
        len += n;
        if (len > S_STDIN_MAX) {
            snprintf(err, cap, "the prompt on stdin is longer than %zu MiB", S_STDIN_MAX >> 20);
            goto fail;
        }
        if (bcap - len < 2) {
            char *nb = realloc(buf, bcap * 2);
            if (!nb) goto oom;
            buf = nb;
            bcap *= 2;
        }
    }
    if (ferror(stdin)) {
        snprintf(err, cap, "cannot read the prompt from stdin: %s", strerror(errno));
        goto fail;
    }
    const char *z = memchr(buf, 0, len);
    if (z) {
        snprintf(err, cap, "the prompt on stdin has a NUL byte at offset %zu", (size_t)(z - buf));
        goto fail;
    }
    buf[len] = 0;
    return buf;
oom:
    snprintf(err, cap, "out of memory reading the prompt");
    *status = 1;
fail:
    free(buf);
    return NULL;
}

int fi_cmd_run(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"raw", no_argument, 0, 'r'},
        {"system", required_argument, 0, 'S'},  {"max-tokens", required_argument, 0, 'n'},
        {"temp", required_argument, 0, 'T'},    {"top-k", required_argument, 0, 'k'},
        {"top-p", required_argument, 0, 'p'},   {"min-p", required_argument, 0, 'M'},
        {"repeat-penalty", required_argument, 0, 'R'}, {"seed", required_argument, 0, 's'},
        {"stop", required_argument, 0, 'x'},    {"threads", required_argument, 0, 't'},
        {"ctx", required_argument, 0, 'c'},     {"simd", required_argument, 0, 'I'},
        {"stats", no_argument, 0, 'z'},         {"help", no_argument, 0, 'h'},
        {"act-bits", required_argument, 0, 'B'}, {"device", required_argument, 0, 'D'},
        {"kv-bits", required_argument, 0, 'K'},
        {"model-sha256", required_argument, 0, 'H'},
        {"presence-penalty", required_argument, 0, 'P'}, {"frequency-penalty", required_argument, 0, 'F'},
        {0, 0, 0, 0}};
    const char *model = fi_default_model_path(), *system = NULL, *sha256 = NULL;
    int raw = 0, stats = 0, seed_given = 0;
    long max_tokens = 256, threads = 0, n_ctx = 4096, act_bits = 0, kv_bits = 16, v;
    fi_simd simd = FI_SIMD_AUTO;
    fi_device device = FI_DEVICE_AUTO;
    fi_sampler_params sp = fi_sampler_defaults();
    const char *stops[16];
    int n_stop = 0;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "m:n:t:c:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'H': sha256 = optarg; break;
        case 'r': raw = 1; break;
        case 'S': system = optarg; break;
        case 'n': if (s_parse_int("--max-tokens", optarg, 0, 1 << 20, &max_tokens)) return 2; break;
        case 'T': if (s_parse_float("--temp", optarg, 0, 100, &sp.temperature)) return 2; break;
        case 'k': if (s_parse_int("--top-k", optarg, 0, INT_MAX, &v)) return 2; sp.top_k = (int)v; break;
        case 'p':
            if (s_parse_float("--top-p", optarg, 0, 1, &sp.top_p)) return 2;
            break;
        case 'M': if (s_parse_float("--min-p", optarg, 0, 1, &sp.min_p)) return 2; break;
        case 'R': if (s_parse_float("--repeat-penalty", optarg, 0.01, 100, &sp.repeat_penalty)) return 2; break;
        case 'P': if (s_parse_float("--presence-penalty", optarg, -2, 2, &sp.presence_penalty)) return 2; break;
        case 'F': if (s_parse_float("--frequency-penalty", optarg, -2, 2, &sp.frequency_penalty)) return 2; break;
        case 's': {
            char *end;
            errno = 0;
            unsigned long long u = strtoull(optarg, &end, 10);
            if (errno || end == optarg || *end || !isdigit((unsigned char)optarg[0])) {
                fprintf(stderr, "fedinfer: --seed expects an unsigned integer, not '%s'\n", optarg);
                return 2;
            }
            sp.seed = u;
            seed_given = 1;
            break;
        }
        case 'x':
            if (n_stop == (int)(sizeof stops / sizeof stops[0])) {
                fprintf(stderr, "fedinfer: at most %d --stop strings\n", n_stop);
                return 2;
            }
            stops[n_stop++] = optarg;
            break;
        case 't': if (s_parse_int("--threads", optarg, 1, 1024, &threads)) return 2; break;
        case 'c': if (s_parse_int("--ctx", optarg, 1, 1 << 24, &n_ctx)) return 2; break;
        case 'I': if (fi_parse_simd(optarg, &simd)) return 2; break;
        case 'D':
            if (fi_device_parse(optarg, &device)) {
                fprintf(stderr, "fedinfer: --device expects cpu, cuda or auto, not '%s'\n", optarg);
                return 2;
            }
            break;
        case 'z': stats = 1; break;
        case 'B': if (s_parse_int("--act-bits", optarg, 8, 16, &act_bits) || act_bits % 4 != 0) {
                      fprintf(stderr, "fedinfer: --act-bits must be 8, 12 or 16\n");
                      return 2;
                  }
                  break;
        case 'K': if (s_parse_int("--kv-bits", optarg, 8, 16, &kv_bits) || (kv_bits != 8 && kv_bits != 16)) {
                      fprintf(stderr, "fedinfer: --kv-bits must be 8 or 16\n");
                      return 2;
                  }
                  break;
        case 'h': s_run_usage(stdout); return 0;
        default: s_run_usage(stderr); return 2;
        }
    }
    if (sp.top_p <= 0) /* only the likeliest token, as the API takes 0 (the sampler reads 0 as off) */
        sp.temperature = 0.0f;
    if (!seed_given) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        sp.seed = (uint64_t)ts.tv_sec * 1000000007ULL ^ (uint64_t)ts.tv_nsec;
    }

    /* the prompt: arguments joined by spaces, or stdin */
    char *prompt = NULL;
    char perr[128] = "out of memory reading the prompt";
    int pstatus = 1;
    if (optind >= argc || (optind == argc - 1 && !strcmp(argv[optind], "-"))) {
        prompt = s_read_stdin(&pstatus, perr, sizeof perr);
    } else {
        size_t len = 1;
        for (int i = optind; i < argc; i++) len += strlen(argv[i]) + 1;
        prompt = malloc(len);
        if (prompt) {
            prompt[0] = 0;
            for (int i = optind; i < argc; i++) {
                if (i > optind) strcat(prompt, " ");
                strcat(prompt, argv[i]);
            }
        }
    }
    if (!prompt) {
        fprintf(stderr, "fedinfer: %s\n", perr);
        return pstatus;
    }

    int status = 1;
    char err[512];
    int32_t *ids = NULL;
    fi_sched *s = NULL;
    fi_model_opts mo = {.n_threads = (int)threads, .simd = simd, .act_bits = (int)act_bits,
                        .kv_bits = (int)kv_bits, .device = device, .sha256 = sha256};
    fi_model *m = fi_model_load(model, &mo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "fedinfer: %s\n", err);
        if (!strcmp(model, FI_DEFAULT_MODEL) && access(model, F_OK) != 0)
            fprintf(stderr, "fedinfer: (run examples/setup.sh to fetch the default model)\n");
        goto done;
    }
    const fi_tok *tok = fi_model_tok(m);
    int n_ids = 0;
    if (raw) {
        /* plain text (special tokens' text included), after BOS when the
         * model wants one, as the edge and the workers encode it */
        if (!fi_tok_can_encode(tok, prompt, strlen(prompt))) {
            fprintf(stderr, "fedinfer: the prompt has bytes this model's vocabulary cannot encode\n");
            status = 2;
            goto done;
        }
        int bos = fi_tok_add_bos(tok) && fi_tok_bos(tok) >= 0;
        size_t tlen = strlen(prompt);
        int need = fi_tok_encode(tok, prompt, tlen, 0, NULL, 0);
        if (need < 0) goto oom;
        ids = malloc(((size_t)need + 1) * sizeof *ids);
        if (!ids) goto oom;
        if (fi_tok_encode(tok, prompt, tlen, 0, ids + bos, need) != need) goto oom;
        if (bos) ids[0] = fi_tok_bos(tok);
        n_ids = need + bos;
    } else {
        /* the chat template's markers as special tokens, the messages as
         * plain text (fi_tok_chat_ids) */
        const char *bad = !fi_tok_can_encode(tok, prompt, strlen(prompt)) ? "prompt"
                          : system && !fi_tok_can_encode(tok, system, strlen(system)) ? "--system text"
                          : NULL;
        if (bad) {
            /* refused as --raw refuses it, rather than answered without
             * the bytes the vocabulary has no token for */
            fprintf(stderr, "fedinfer: the %s has bytes this model's vocabulary cannot encode\n", bad);
            status = 2;
            goto done;
        }
        fi_chat_msg msgs[2];
        int n = 0;
        if (system) msgs[n++] = (fi_chat_msg){"system", system};
        msgs[n++] = (fi_chat_msg){"user", prompt};
        ids = fi_tok_chat_ids(tok, msgs, n, 1, &n_ids, err, sizeof err);
        if (!ids) {
            fprintf(stderr, "fedinfer: %s (use --raw for plain completion)\n", err);
            goto done;
        }
    }
    if (n_ids <= 0) {
        fprintf(stderr, "fedinfer: the prompt is empty\n");
        status = 2;
        goto done;
    }
    if (n_ctx > fi_model_config(m)->ctx_train) n_ctx = fi_model_config(m)->ctx_train;
    if (n_ids > n_ctx) {
        fprintf(stderr,
                "fedinfer: the prompt is %d tokens, more than the context of %ld tokens "
                "(raise --ctx, at most %d for this model, or shorten the prompt)\n",
                n_ids, n_ctx, fi_model_config(m)->ctx_train);
        goto done;
    }
    /* the same scheduler that serves many requests, with one */
    fi_sched_opts so = {.max_seqs = 1, .n_ctx = (int)n_ctx,
                        .kv_bytes = fi_kv_block_bytes(m) * (size_t)(n_ctx / FI_KV_BLOCK + 1)};
    s = fi_sched_new(m, &so, err, sizeof err);
    if (!s) {
        fprintf(stderr, "fedinfer: %s\n", err);
        goto done;
    }
    run_out out = {0};
    fi_sched_req rq = {.prompt = ids, .n_prompt = n_ids, .on_done = s_done,
                       .gen = {(int)max_tokens, sp, stops, n_stop, s_print, &out}};
    if (fi_sched_submit(s, &rq, err, sizeof err) < 0) {
        fprintf(stderr, "fedinfer: %s\n", err);
        goto done;
    }
    while (fi_sched_pending(s) > 0)
        if (fi_sched_step(s, err, sizeof err) < 0) break;
    if (out.error[0]) {
        fprintf(stderr, "\nfedinfer: %s\n", out.error);
        goto done;
    }
    const fi_gen_result res = out.res;
    if (out.any) fputc('\n', stdout);
    fflush(stdout);
    if (res.stop == FI_STOP_CONTEXT)
        fprintf(stderr, "fedinfer: stopped: the context of %ld tokens is full\n", n_ctx);
    if (stats) {
        const fi_backend *be = fi_model_backend(m);
        fprintf(stderr,
                "[prompt %d tokens in %.3f s (%.1f tok/s); generated %d tokens in %.3f s "
                "(%.1f tok/s); stop: %s; threads %d, simd %s, seed %" PRIu64 "]\n",
                res.n_prompt, res.prefill_s, res.n_prompt / (res.prefill_s > 0 ? res.prefill_s : 1e-9),
                res.n_generated, res.decode_s,
                res.n_generated / (res.decode_s > 0 ? res.decode_s : 1e-9), fi_stop_reason_name(res.stop),
                fi_cpu_backend_threads(be),
                fi_cpu_backend_simd(be) ? fi_cpu_backend_simd(be) : be->ops->name, sp.seed);
    }
    status = 0;
    goto done;
oom:
    fprintf(stderr, "fedinfer: out of memory\n");
done:
    fi_sched_destroy(&s);
    fi_model_destroy(&m);
    free(ids);
    free(prompt);
    return status;
}

/* --- inspect ----------------------------------------------------------- */

static void s_inspect_usage(FILE *f) {
    fprintf(f,
            "usage: fedinfer inspect [options] [MODEL]\n"
            "\n"
            "Prints a GGUF file's header, metadata and tensor table (MODEL defaults to the\n"
            "set-up's model). The file is checked completely first; a damaged file is\n"
            "reported with what is wrong and where.\n"
            "\n"
            "options:\n"
            "      --no-tensors   metadata only\n"
            "  -h, --help         this text\n");
}

int fi_cmd_inspect(int argc, char **argv) {
    static const struct option opts[] = {{"no-tensors", no_argument, 0, 'N'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int tensors = 1, c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'N': tensors = 0; break;
        case 'h': s_inspect_usage(stdout); return 0;
        default: s_inspect_usage(stderr); return 2;
        }
    }
    if (argc - optind > 1) {
        s_inspect_usage(stderr);
        return 2;
    }
    const char *path = optind < argc ? argv[optind] : fi_default_model_path();
    char err[512];
    fi_gguf *g = fi_gguf_open(path, err, sizeof err);
    if (!g) {
        fprintf(stderr, "fedinfer: %s\n", err);
        return 1;
    }
    printf("file        %s\n", path);
    printf("size        %zu bytes\n", fi_gguf_file_size(g));
    char sha[65];
    fi_gguf_sha256(g, sha);
    printf("sha256      %s\n", sha);
    printf("version     %u\n", fi_gguf_version(g));
    printf("alignment   %u\n", fi_gguf_alignment(g));
    printf("data at     %" PRIu64 "\n", fi_gguf_data_offset(g));
    printf("\nmetadata (%" PRId64 " keys)\n", fi_gguf_n_kv(g));
    char val[512];
    for (int64_t i = 0; i < fi_gguf_n_kv(g); i++) {
        const fi_gguf_kv *kv = fi_gguf_kv_at(g, i);
        fi_gguf_kv_format(kv, val, sizeof val);
        char key[256];
        fi_gguf_name_format(kv->key, 200, key, sizeof key); /* no raw escapes from the file */
        printf("  %-42s %-8s %s\n", key, fi_gguf_type_name(kv->type), val);
    }
    uint64_t total = 0, elems = 0;
    int64_t counts[64] = {0};
    for (int64_t i = 0; i < fi_gguf_n_tensors(g); i++) {
        const fi_gguf_tensor *t = fi_gguf_tensor_at(g, i);
        total += t->n_bytes;
        elems += (uint64_t)(t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]);
        if ((unsigned)t->type < 64) counts[t->type]++;
    }
    printf("\ntensors (%" PRId64 ", %" PRIu64 " elements, %.1f MiB)\n", fi_gguf_n_tensors(g), elems,
           (double)total / (1 << 20));
    for (int i = 0; i < 64; i++)
        if (counts[i]) printf("  %-6s %" PRId64 "\n", fi_dtype_name((uint32_t)i), counts[i]);
    if (tensors) {
        printf("\n  %-32s %-6s %-24s %12s %12s\n", "name", "type", "shape", "offset", "bytes");
        for (int64_t i = 0; i < fi_gguf_n_tensors(g); i++) {
            const fi_gguf_tensor *t = fi_gguf_tensor_at(g, i);
            char shape[64];
            int o = snprintf(shape, sizeof shape, "[%" PRId64, t->ne[0]);
            for (uint32_t d = 1; d < t->n_dims && o < (int)sizeof shape; d++)
                o += snprintf(shape + o, sizeof shape - (size_t)o, ", %" PRId64, t->ne[d]);
            if (o < (int)sizeof shape) snprintf(shape + o, sizeof shape - (size_t)o, "]");
            char name[96];
            fi_gguf_name_format(t->name, 64, name, sizeof name);
            printf("  %-32s %-6s %-24s %12" PRIu64 " %12" PRIu64 "\n", name, fi_dtype_name(t->type),
                   shape, t->offset, t->n_bytes);
        }
    }
    fi_gguf_close(&g);
    return 0;
}
