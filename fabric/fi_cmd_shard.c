/*
 * fi_cmd_shard.c - `fedinfer shard`: a cluster worker serving one model
 * (the whole model in this process) to the coordinator.
 *
 *   fedinfer shard --config shard.conf [--enrol TOKEN] [--echo]
 *
 * --enrol presents a one-time token (from `fedctl enrol --role cluster`)
 * with this worker's key before serving. --echo serves with the echo
 * backend instead of the model (tests, demos of the fabric alone).
 */
#include <getopt.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "fi_fabric_cmd.h"
#include "fi_group.h"
#include "fi_shard.h"

static atomic_int s_stop;

static void s_on_signal(int sig) {
    (void)sig;
    atomic_store(&s_stop, 1);
}

int fi_cmd_shard(int argc, char **argv) {
    static const struct option opts[] = {{"config", required_argument, NULL, 'c'},
                                         {"enrol", required_argument, NULL, 'e'},
                                         {"echo", no_argument, NULL, 'E'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *config = NULL, *token = NULL;
    int echo = 0, ch;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "c:e:Eh", opts, NULL)) != -1) {
        switch (ch) {
        case 'c': config = optarg; break;
        case 'e': token = optarg; break;
        case 'E': echo = 1; break;
        default: {
            FILE *f = ch == 'h' ? stdout : stderr;
            fprintf(f, "usage: fedinfer shard --config FILE [--enrol TOKEN] [--echo]\n\n"
                       "Serves a model to the coordinator as a cluster worker, through one\n"
                       "continuous-batching scheduler with a paged KV cache and prefix reuse.\n"
                       "--enrol - reads the one-time token from standard input (a command line\n"
                       "is visible to every local user).\n\n"
                       "Configuration (key = value lines; unknown keys are errors):\n"
                       "  coordinator = ENDPOINT       tcp://coordinator:7700 (required)\n"
                       "  coordinator_key = FILE       the coordinator's public key (required)\n"
                       "  secret_key = FILE            this worker's secret key (required, 0600)\n"
                       "  model = FILE                 GGUF model (required)\n"
                       "  model_name = NAME            name requests use (required)\n"
                       "  model_sha256 = HEX           the model file's SHA-256: another file is\n"
                       "                               refused at start\n"
                       "  enrol_endpoint, site, region  for --enrol\n"
                       "  capacity, heartbeat_ms, liveness, n_ctx, threads, max_tokens\n"
                       "  act_bits = 16|12|8           precision of the CPU's quantised products\n"
                       "                               (default 12 with an AMX tile unit, else\n"
                       "                               16): 8 is less exact, its batches faster\n"
                       "  kv_bits = 16|8               the CPU's KV cache: 8 keeps int8 with a\n"
                       "                               scale per head (half the memory; runs on\n"
                       "                               the CPU even where a GPU is present)\n"
                       "  kv_mb = N                    KV-cache pool in MiB (0: 256)\n"
                       "  batch = N                    sequences per forward pass (0: capacity)\n"
                       "  prefix_cache = 0|1           reuse cached prompt prefixes (1)\n\n");
            fi_group_cmd_help(f);
            return ch == 'h' ? 0 : 2;
        }
        }
    }
    if (!config || optind != argc) {
        fprintf(stderr, "fedinfer shard: --config is required (see --help)\n");
        return 2;
    }
    if (fi_group_conf_is_rank_file(config)) {
        if (echo) {
            fprintf(stderr, "fedinfer shard: --echo serves a whole model, not a group rank\n");
            return 2;
        }
        return fi_group_cmd(config, token); /* one rank of a shard group */
    }
    char err[1024];
    fi_shard_conf conf;
    fi_shard_conf_default(&conf);
    if (fi_conf_load(config, fi_shard_conf_keys, &conf, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        return 1;
    }
    if (strlen(conf.model_name) >= sizeof((fi_client_opts *)0)->models[0]) {
        fprintf(stderr, "fedinfer shard: %s: model_name is longer than 63 bytes\n", config);
        return 1;
    }
    fi_client_opts o;
    fi_client_opts_default(&o);
    snprintf(o.endpoint, sizeof o.endpoint, "%s", conf.coordinator);
    o.role = FI__ROLE__ROLE_CLUSTER;
    o.heartbeat_ms = conf.heartbeat_ms;
    o.liveness = conf.liveness;
    o.n_models = 1;
    /* checked to fit above; the precision says so to the compiler too */
    snprintf(o.models[0], sizeof o.models[0], "%.*s", (int)sizeof o.models[0] - 1, conf.model_name);
    o.capacity[0] = (uint32_t)conf.capacity;
    if (fi_keys_load_public(conf.coordinator_key, o.server_pub, err, sizeof err) != 0 ||
        fi_keys_load_secret(conf.secret_key, &o.kp, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        return 1;
    }
    int rc = 1;
    fi_client *c = NULL;
    fi_shard_backend be = {0};
    if (token) {
        char fpr[FI_KEYS_FPR_LEN];
        if (!conf.enrol_endpoint[0] || !conf.site[0] || !conf.region[0]) {
            fprintf(stderr, "fedinfer shard: --enrol needs enrol_endpoint, site and region in %s\n",
                    config);
            goto done;
        }
        if (fi_client_enrol(&o, conf.enrol_endpoint, token, FI__ROLE__ROLE_CLUSTER, conf.site,
                            conf.region, 10000, fpr, err, sizeof err) != 0) {
            fprintf(stderr, "fedinfer shard: %s\n", err);
            goto done;
        }
        printf("enrolled as cluster %s/%s, fingerprint %s\n", conf.site, conf.region, fpr);
        fflush(stdout); /* a service log shows it now, not at exit */
    }
    if (echo) {
        be = fi_shard_echo_backend(4, 0);
        if (!be.ctx) {
            fprintf(stderr, "fedinfer shard: out of memory\n");
            goto done;
        }
    } else if (fi_shard_engine_backend(&conf, &be, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s: %s\n", conf.model, err);
        goto done;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = s_on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (!(c = fi_client_new(&o, err, sizeof err))) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        goto done;
    }
    /* the engine's device: the CPU's kernels and precision, where it is the CPU */
    char dev[128] = "";
    const fi_model *em = echo ? NULL : fi_shard_engine_model(&be);
    if (em) {
        char d[96];
        snprintf(dev, sizeof dev, " on %s", fi_backend_describe(fi_model_backend(em), d, sizeof d));
    }
    fprintf(stderr, "shard: serving %s (%s backend%s, capacity %d) to %s\n", conf.model_name,
            be.name, dev, conf.capacity, conf.coordinator);
    if (fi_shard_serve(c, &be, 4 * conf.capacity, &s_stop, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        goto done;
    }
    rc = 0;
done:
    fi_client_destroy(&c);
    if (be.destroy) be.destroy(be.ctx);
    fi_keys_wipe(&o.kp);
    return rc;
}
