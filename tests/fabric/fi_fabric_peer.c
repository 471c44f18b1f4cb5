/*
 * fi_fabric_peer.c - test-only program: the fabric's commands without the
 * engine, so that tests can run a coordinator or a worker as a separate
 * process (and kill it with SIGKILL).
 *
 *   fi_fabric_peer coordinator ARGS...   same as `fedinfer coordinator`
 *   fi_fabric_peer keygen ARGS...        same as `fedinfer keygen`
 *   fi_fabric_peer worker --config FILE [--enrol TOKEN] [--replica NAME]
 *                                        a cluster worker with the echo
 *                                        backend (shard configuration;
 *                                        `model` is not read); --replica:
 *                                        answers NAME and reports a prefix
 *                                        filter of the prompts it served
 *                                        (their bytes hashed as tokens)
 *   fi_fabric_peer status|enrol|revoke ARGS...  the fedctl verbs
 */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include <pthread.h>
#include <stdlib.h>

#include "fi_fabric_cmd.h"
#include "fi_sched.h"
#include "fi_shard.h"

static atomic_int s_stop;

static void s_on_signal(int sig) {
    (void)sig;
    atomic_store(&s_stop, 1);
}

/* The --replica backend: test-only, a stand-in for the engine's scheduler
 * whose prefix filter the router matches; the prompt's bytes are its
 * "tokens", hashed as fi_prefix_hashes does with the request's salt. */
typedef struct s_replica {
    const char *name;                    /* what it answers */
    pthread_mutex_t mu;
    uint8_t bits[FI_SHARD_FILTER_BYTES]; /* prompts served */
} s_replica;

static int s_replica_gen(void *ctx, const Fi__InferRequest *rq, fi_shard_emit_fn emit, void *eu,
                         fi_shard_gen *out, char *err, size_t errlen) {
    s_replica *r = ctx;
    (void)err, (void)errlen;
    memset(out, 0, sizeof *out);
    snprintf(out->stop, sizeof out->stop, "eog");
    int32_t toks[2048];
    int n = 0;
    for (const char *p = rq->prompt; p && *p && n < 2048; p++) toks[n++] = (uint8_t)*p;
    uint64_t h[128];
    int k = fi_prefix_hashes(rq->tenant, rq->zone, toks, n, h, 128);
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < k; i++) fi_prefix_filter_add(r->bits, sizeof r->bits, h[i]);
    pthread_mutex_unlock(&r->mu);
    (void)emit(eu, r->name, strlen(r->name));
    return 0;
}

static int s_replica_filter(void *ctx, uint8_t *bits, size_t nbytes) {
    s_replica *r = ctx;
    if (nbytes != sizeof r->bits) return -1;
    pthread_mutex_lock(&r->mu);
    memcpy(bits, r->bits, nbytes);
    pthread_mutex_unlock(&r->mu);
    return 0;
}

static int s_worker(int argc, char **argv) {
    const char *config = NULL, *token = NULL, *replica = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--config")) config = argv[i + 1];
        else if (!strcmp(argv[i], "--enrol")) token = argv[i + 1];
        else if (!strcmp(argv[i], "--replica")) replica = argv[i + 1];
        else config = NULL, i = argc;
    }
    if (!config || argc % 2 != 1) {
        fprintf(stderr, "usage: fi_fabric_peer worker --config FILE [--enrol TOKEN] [--replica NAME]\n");
        return 2;
    }
    char err[1024];
    fi_shard_conf conf;
    fi_shard_conf_default(&conf);
    if (fi_conf_load(config, fi_shard_conf_keys, &conf, err, sizeof err) != 0) {
        fprintf(stderr, "worker: %s\n", err);
        return 1;
    }
    fi_client_opts o;
    fi_client_opts_default(&o);
    snprintf(o.endpoint, sizeof o.endpoint, "%s", conf.coordinator);
    o.role = FI__ROLE__ROLE_CLUSTER;
    o.heartbeat_ms = conf.heartbeat_ms;
    o.liveness = conf.liveness;
    o.reconnect_ms = 50;
    o.reconnect_max_ms = 400;
    o.n_models = 1;
    snprintf(o.models[0], sizeof o.models[0], "%.63s", conf.model_name);
    o.capacity[0] = (uint32_t)conf.capacity;
    if (fi_keys_load_public(conf.coordinator_key, o.server_pub, err, sizeof err) != 0 ||
        fi_keys_load_secret(conf.secret_key, &o.kp, err, sizeof err) != 0) {
        fprintf(stderr, "worker: %s\n", err);
        return 1;
    }
    if (token) {
        char fpr[FI_KEYS_FPR_LEN];
        if (fi_client_enrol(&o, conf.enrol_endpoint, token, FI__ROLE__ROLE_CLUSTER, conf.site,
                            conf.region, 5000, fpr, err, sizeof err) != 0) {
            fprintf(stderr, "worker: %s\n", err);
            fi_keys_wipe(&o.kp);
            return 1;
        }
        printf("%s\n", fpr);
        fflush(stdout);
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = s_on_signal;
    sigaction(SIGTERM, &sa, NULL);
    fi_client *c = fi_client_new(&o, err, sizeof err);
    fi_keys_wipe(&o.kp);
    if (!c) {
        fprintf(stderr, "worker: %s\n", err);
        return 1;
    }
    static s_replica rep = {NULL, PTHREAD_MUTEX_INITIALIZER, {0}};
    rep.name = replica;
    fi_shard_backend be = replica ? (fi_shard_backend){.name = "replica", .generate = s_replica_gen,
                                                       .ctx = &rep, .prefix_filter = s_replica_filter}
                                  : fi_shard_echo_backend(4, 50);
    int rc = be.ctx ? fi_shard_serve(c, &be, 16, &s_stop, err, sizeof err) : -1;
    if (rc) fprintf(stderr, "worker: %s\n", err);
    if (be.destroy) be.destroy(be.ctx);
    fi_client_destroy(&c);
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: fi_fabric_peer coordinator|keygen|worker|status|enrol|revoke|token ...\n");
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        printf("usage: fi_fabric_peer coordinator|keygen|worker|status|enrol|revoke|token ...\n\n"
               "Test-only: runs the coordinator, an echo cluster worker or the fedctl verbs as\n"
               "separate processes for the fabric's process tests. Each command answers --help.\n");
        return 0;
    }
    if (!strcmp(cmd, "coordinator")) return fi_cmd_coordinator(argc - 1, argv + 1);
    if (!strcmp(cmd, "keygen")) return fi_cmd_keygen(argc - 1, argv + 1);
    if (!strcmp(cmd, "worker")) return s_worker(argc - 1, argv + 1);
    if (!strcmp(cmd, "status")) return fi_ctl_status(argc - 1, argv + 1);
    if (!strcmp(cmd, "enrol")) return fi_ctl_enrol(argc - 1, argv + 1);
    if (!strcmp(cmd, "revoke")) return fi_ctl_revoke(argc - 1, argv + 1);
    if (!strcmp(cmd, "join")) return fi_ctl_join(argc - 1, argv + 1);
    if (!strcmp(cmd, "token")) return fi_ctl_token(argc - 1, argv + 1);
    fprintf(stderr, "fi_fabric_peer: unknown command '%s'\n", cmd);
    return 2;
}
