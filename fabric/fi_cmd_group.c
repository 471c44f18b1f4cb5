/*
 * fi_cmd_group.c - `fedinfer shard --config RANKFILE`: one rank of a shard
 * group (a rank file has a group_file key; fi_cmd_shard.c hands it here).
 *
 * Reads the rank file and the group file, computes the plan, the model's
 * digest and this rank's slice, loads only that slice, binds its link
 * endpoint and then either leads (rank 0: the coordinator's requests, the
 * scheduler, the passes) or follows (computes on command). A rank refused
 * at join exits with status 1 and the reason.
 */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "fi_group.h"

static atomic_int s_stop;

static void s_on_signal(int sig) {
    (void)sig;
    atomic_store(&s_stop, 1);
}

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void fi_group_cmd_help(FILE *f) {
    fprintf(f,
            "A rank of a shard group (when the configuration has group_file):\n"
            "  group_file = FILE            the group: ranks, endpoints, keys, tp, splits (required)\n"
            "  rank = N                     this process's rank; 0 leads (required)\n"
            "  secret_key = FILE            this rank's secret key, key.N's pair (required, 0600)\n"
            "  model = FILE                 GGUF model, the same file on every rank (required)\n"
            "  model_sha256 = HEX           its SHA-256: another file is refused at start\n"
            "  threads = N, device = cpu|cuda|auto, gpu = N (CUDA device, default 0;\n"
            "          ranks sharing a machine each take their own)\n"
            "  act_bits = 16|12|8           the CPU's activation precision (give every rank the same;\n"
            "                               default 12 with an AMX tile unit, else 16)\n"
            "  kv_bits = 16|8               the CPU's KV cache precision (the same on every rank)\n"
            "  rank 0: coordinator, coordinator_key, model_name (required); capacity,\n"
            "          heartbeat_ms, liveness, max_tokens, n_ctx, kv_mib, max_seqs,\n"
            "          step_tokens; enrol_endpoint, site, region for --enrol\n"
            "Group file: group, world, tp, endpoint.N, key.N; tp_weights, pp_weights,\n"
            "  kv_split, ffn_split, layer_split, heartbeat_ms, timeout_ms, collective,\n"
            "  micro_batch (see examples/cluster/README.md).\n");
}

int fi_group_cmd(const char *config, const char *token) {
    char err[1024];
    fi_group_rank_conf rc;
    fi_group_conf gc;
    fi_keypair kp;
    memset(&kp, 0, sizeof kp);
    if (fi_group_rank_conf_load(config, &rc, err, sizeof err) != 0 ||
        fi_group_conf_load(rc.group_file, &gc, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        return 1;
    }
    if (rc.rank >= gc.world) {
        fprintf(stderr, "fedinfer shard: %s: rank %d, but %s has world = %d\n", config, rc.rank,
                rc.group_file, gc.world);
        return 1;
    }
    if (token && rc.rank != 0) {
        /* only the leader talks to the coordinator: a token given here
         * would be spent by nobody */
        fprintf(stderr, "fedinfer shard: %s: rank %d does not connect to the coordinator (rank 0 "
                        "does); --enrol goes with rank 0's configuration\n",
                config, rc.rank);
        return 2;
    }
    if (fi_keys_load_secret(rc.secret_key, &kp, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        return 1;
    }
    int rc_ = 1;
    fi_group *g = NULL;
    fi_model *m = NULL;
    fi_client *c = NULL;
    fi_group_model mi;
    uint8_t md[FI_GROUP_DIGEST_BYTES];
    char hex[FI_GROUP_DIGEST_HEX];
    fi_device dev = FI_DEVICE_CPU;
    double t0 = s_now();
    if (fi_device_parse(rc.device, &dev) != 0) {
        fprintf(stderr, "fedinfer shard: %s: device = %s\n", config, rc.device);
        goto done;
    }
    if (fi_group_model_read(rc.model, &mi, err, sizeof err) != 0 ||
        fi_group_model_digest(rc.model, md, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        goto done;
    }
    fi_group_digest_hex(md, hex);
    if (!(g = fi_group_new(&gc, rc.rank, &kp, &mi, md, err, sizeof err))) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        goto done;
    }
    fprintf(stderr, "group %s: rank %d of %d (stage %d, TP rank %d), model %s digest %.16s..., "
                    "plan %s\n",
            gc.name, rc.rank, gc.world, fi_group_stage(&gc, rc.rank),
            fi_group_tp_rank(&gc, rc.rank), rc.model, hex, fi_group_plan_str(g));
    fi_model_opts mo;
    memset(&mo, 0, sizeof mo);
    mo.n_threads = rc.threads;
    mo.act_bits = rc.act_bits;
    mo.kv_bits = rc.kv_bits;
    mo.simd = FI_SIMD_AUTO;
    mo.device = dev;
    mo.gpu = rc.gpu;
    fi_group_set_gpu(g, rc.gpu);
    mo.plan = fi_group_plan(g);
    mo.sha256 = rc.model_sha256;
    if (!(m = fi_model_load(rc.model, &mo, err, sizeof err))) {
        fprintf(stderr, "fedinfer shard: %s: %s\n", rc.model, err);
        goto done;
    }
    if (fi_group_attach(g, m, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        goto done;
    }
    if (gc.pp > 1 && !gc.micro_batch_set && gc.coll == FI_GROUP_COLL_ZMQ &&
        !fi_model_backend(m)->ops->host_memory)
        fprintf(stderr, "group %s: rank %d: micro_batch is %d, the default for CPU ranks; with "
                        "GPUs a pass of few tokens costs about what one of many does, so set "
                        "micro_batch = %d (or more) in %s on every rank\n",
                gc.name, rc.rank, gc.micro_batch, FI_GROUP_MICRO_BATCH_GPU, rc.group_file);
    char d[96];
    fprintf(stderr, "group %s: rank %d ready in %.1f s (digest and slice) on %s, listening on %s\n",
            gc.name, rc.rank, s_now() - t0, fi_backend_describe(fi_model_backend(m), d, sizeof d),
            gc.endpoint[rc.rank]);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = s_on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (rc.rank != 0) {
        if (fi_group_follow(g, &s_stop, err, sizeof err) != 0) {
            fprintf(stderr, "fedinfer shard: rank %d: %s\n", rc.rank, err);
            goto done;
        }
        rc_ = 0;
        goto done;
    }
    fi_client_opts o;
    fi_client_opts_default(&o);
    if (strlen(rc.model_name) >= sizeof o.models[0]) {
        fprintf(stderr, "fedinfer shard: %s: model_name is longer than 63 bytes\n", config);
        goto done;
    }
    snprintf(o.endpoint, sizeof o.endpoint, "%s", rc.coordinator);
    o.role = FI__ROLE__ROLE_CLUSTER;
    o.heartbeat_ms = rc.heartbeat_ms;
    o.liveness = rc.liveness;
    o.n_models = 1;
    /* checked to fit above; the precision says so to the compiler too */
    snprintf(o.models[0], sizeof o.models[0], "%.*s", (int)sizeof o.models[0] - 1, rc.model_name);
    o.capacity[0] = 0; /* announced when every rank has joined */
    o.kp = kp;
    if (fi_keys_load_public(rc.coordinator_key, o.server_pub, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        goto done;
    }
    if (token) {
        char fpr[FI_KEYS_FPR_LEN];
        if (!rc.enrol_endpoint[0] || !rc.site[0] || !rc.region[0]) {
            fprintf(stderr, "fedinfer shard: --enrol needs enrol_endpoint, site and region in %s\n",
                    config);
            goto done;
        }
        if (fi_client_enrol(&o, rc.enrol_endpoint, token, FI__ROLE__ROLE_CLUSTER, rc.site,
                            rc.region, 10000, fpr, err, sizeof err) != 0) {
            fprintf(stderr, "fedinfer shard: %s\n", err);
            goto done;
        }
        printf("enrolled as cluster %s/%s, fingerprint %s\n", rc.site, rc.region, fpr);
        fflush(stdout); /* a service log shows it now, not at exit */
    }
    if (!(c = fi_client_new(&o, err, sizeof err))) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        goto done;
    }
    fi_keys_wipe(&o.kp);
    fprintf(stderr, "group %s: leading %d rank(s) for %s (capacity %d) to %s\n", gc.name,
            gc.world, rc.model_name, rc.capacity, rc.coordinator);
    if (fi_group_serve(g, m, c, &rc, &s_stop, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer shard: %s\n", err);
        goto done;
    }
    rc_ = 0;
done:
    fi_client_destroy(&c);
    fi_group_destroy(&g);
    fi_model_destroy(&m);
    fi_keys_wipe(&o.kp); /* the copy, where an error came before fi_client_new took it */
    fi_keys_wipe(&kp);
    return rc_;
}
