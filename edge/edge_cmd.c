/*
 * edge_cmd.c - `fedinfer edge`: the edge agent in the foreground, logging
 * to stderr (journald takes it as is).
 *
 *   fedinfer edge --config edge.conf             serve
 *   fedinfer edge token add --config F --tenant T --app A    prints a bearer token once
 *   fedinfer edge token revoke --config F TOKEN|HASH
 *   fedinfer edge witness --config F [--reset]
 *
 * SIGHUP reloads the configuration's limits and the policy bundle; SIGTERM
 * and SIGINT stop: new requests get 503, in-flight ones have
 * shutdown_grace_s to finish, then are cancelled.
 */
#include <getopt.h>
#include <sodium.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "edge_impl.h"
#include "fi_client.h"

static volatile sig_atomic_t s_stop, s_hup;

static void s_on_signal(int sig) {
    if (sig == SIGHUP) s_hup = 1;
    else s_stop = 1;
}

static void s_usage(FILE *f) {
    fprintf(f,
            "usage: fedinfer edge --config FILE [--enrol TOKEN]\n"
            "       fedinfer edge token add --config FILE --tenant NAME --app NAME\n"
            "       fedinfer edge token revoke --config FILE TOKEN|HASH\n"
            "       fedinfer edge witness --config FILE [--reset]\n\n"
            "Serves the OpenAI-compatible API of a site: local model, residency policy,\n"
            "routing to core clusters over the fabric. --enrol - reads the one-time token\n"
            "from standard input (a command line is visible to every local user).\n\n"
            "witness prints the newest head of the coordinator's audit log this site was\n"
            "told (record and hash, kept in db), which the coordinator's log must still hold\n"
            "(fedctl audit verify); --reset, with the agent stopped, forgets it after the\n"
            "coordinator's log was replaced on purpose.\n\n"
            "Configuration (key = value lines; unknown keys are errors):\n"
            "  site = NAME                 this site, as the policy names it (required)\n"
            "  listen, port                HTTP address (127.0.0.1:8080)\n"
            "  model, model_name           local GGUF model and the name requests use\n"
            "  model_sha256                the model file's SHA-256; another file is refused\n"
            "  threads, n_ctx              engine threads, context per session\n"
            "  act_bits = 16|12|8          precision of the CPU's quantised products (default\n"
            "                              12 with an AMX tile unit, else 16): 8 is less\n"
            "                              exact, its batches faster (README)\n"
            "  kv_bits = 16|8              the CPU's KV cache: 8 keeps int8 with a scale per\n"
            "                              head (half the memory; the model then runs on\n"
            "                              the CPU even where a GPU is present)\n"
            "  concurrency, queue          local sessions at once, and waiting beyond (429)\n"
            "  max_body, max_tokens, default_max_tokens, request_timeout_s\n"
            "  conn_limit, per_ip_limit, conn_timeout_s, conn_memory   HTTP bounds\n"
            "  shutdown_grace_s            SIGTERM: time for in-flight requests\n"
            "  db                          SQLite: audit log, tokens (edge.db)\n"
            "  policy_dir, policy_key      held signed bundle, trusted signer's public key\n"
            "  auth = 0|1                  require bearer tokens\n"
            "  coordinator, coordinator_key, secret_key, heartbeat_ms    the fabric\n"
            "  enrol_endpoint, region      for --enrol\n"
            "  clusters                    comma-separated clusters to consider (default all)\n");
}

/* A tenant or application name: 1..63 of [A-Za-z0-9._-], as the
 * coordinator takes them (fedctl token add); anything else would end up
 * in the audit log and the prefix-cache salt. */
static int s_name_ok(const char *s) {
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > 63) return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
              ch == '_' || ch == '-'))
            return 0;
    }
    return 1;
}


static int s_token(int argc, char **argv) {
    static const struct option opts[] = {{"config", required_argument, NULL, 'c'},
                                         {"tenant", required_argument, NULL, 't'},
                                         {"app", required_argument, NULL, 'a'},
                                         {NULL, 0, NULL, 0}};
    const char *config = NULL, *tenant = NULL, *app = NULL;
    int ch;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            s_usage(stdout);
            return 0;
        }
    if (argc < 2 || (strcmp(argv[1], "add") && strcmp(argv[1], "revoke"))) {
        fprintf(stderr, "fedinfer edge token: expected add or revoke (see --help)\n");
        return 2;
    }
    const char *verb = argv[1];
    optind = 0;
    while ((ch = getopt_long(argc - 1, argv + 1, "c:t:a:", opts, NULL)) != -1) {
        if (ch == 'c') config = optarg;
        else if (ch == 't') tenant = optarg;
        else if (ch == 'a') app = optarg;
        else {
            fprintf(stderr, "fedinfer edge token: see --help\n");
            return 2;
        }
    }
    fi_edge_conf c;
    char err[768];
    fi_edge_conf_default(&c);
    if (!config || fi_edge_conf_load(config, &c, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer edge token: %s\n", config ? err : "--config is required");
        return config ? 1 : 2;
    }
    if (!strcmp(verb, "add")) {
        if (optind != argc - 1) {
            fprintf(stderr, "fedinfer edge token add: unexpected argument '%s'\n", argv[optind + 1]);
            return 2;
        }
        if (!s_name_ok(tenant) || !s_name_ok(app)) {
            fprintf(stderr, "fedinfer edge token add: --tenant and --app (1..63 of [A-Za-z0-9._-], as "
                            "fedctl token add takes them) are required\n");
            return 2;
        }
        char tok[64];
        if (edge_token_add(c.db, tenant, app, tok, sizeof tok, err, sizeof err) != 0) {
            fprintf(stderr, "fedinfer edge token add: %s\n", err);
            return 1;
        }
        printf("%s\n", tok);
        sodium_memzero(tok, sizeof tok);
        return 0;
    }
    if (!strcmp(verb, "revoke") && optind + 1 == argc - 1) {
        if (edge_token_revoke(c.db, argv[optind + 1], err, sizeof err) != 0) {
            fprintf(stderr, "fedinfer edge token revoke: %s\n", err);
            return 1;
        }
        return 0;
    }
    s_usage(stderr);
    return 2;
}

static int s_witness(int argc, char **argv) {
    static const struct option opts[] = {{"config", required_argument, NULL, 'c'},
                                         {"reset", no_argument, NULL, 'r'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *config = NULL;
    int reset = 0, ch;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "c:rh", opts, NULL)) != -1) {
        if (ch == 'c') config = optarg;
        else if (ch == 'r') reset = 1;
        else {
            s_usage(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
    }
    if (!config || optind != argc) {
        fprintf(stderr, "fedinfer edge witness: %s (see --help)\n",
                !config ? "--config is required" : "unexpected argument");
        return 2;
    }
    fi_edge_conf c;
    char err[768], line[512];
    fi_edge_conf_default(&c);
    if (fi_edge_conf_load(config, &c, err, sizeof err) != 0 ||
        edge_witness_cmd(c.db, reset, line, sizeof line, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer edge witness: %s\n", err);
        return 1;
    }
    printf("%s\n", line);
    return 0;
}

int fi_cmd_edge(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "token")) return s_token(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "witness")) return s_witness(argc - 1, argv + 1);
    static const struct option opts[] = {{"config", required_argument, NULL, 'c'},
                                         {"enrol", required_argument, NULL, 'e'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *config = NULL, *token = NULL;
    int ch;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "c:e:h", opts, NULL)) != -1) {
        if (ch == 'c') {
            config = optarg;
        } else if (ch == 'e') {
            token = optarg;
        } else {
            s_usage(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
    }
    if (!config || optind != argc) {
        fprintf(stderr, "fedinfer edge: %s (see --help)\n",
                !config ? "--config is required" : "unexpected argument");
        return 2;
    }
    fi_edge_conf c;
    char err[768];
    fi_edge_conf_default(&c);
    if (fi_edge_conf_load(config, &c, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer edge: %s\n", err);
        return 1;
    }
    if (token) {
        /* Present the one-time token with this edge's key, once. */
        fi_client_opts o;
        char fpr[FI_KEYS_FPR_LEN];
        if (!c.coordinator[0] || !c.enrol_endpoint[0] || !c.region[0]) {
            fprintf(stderr, "fedinfer edge: --enrol needs coordinator, enrol_endpoint and region\n");
            return 1;
        }
        if (edge_remote_client_opts(&c, &o, err, sizeof err) != 0 ||
            fi_client_enrol(&o, c.enrol_endpoint, token, FI__ROLE__ROLE_EDGE, c.site, c.region,
                            10000, fpr, err, sizeof err) != 0) {
            fi_keys_wipe(&o.kp);
            fprintf(stderr, "fedinfer edge: enrolment failed: %s\n", err);
            return 1;
        }
        fi_keys_wipe(&o.kp);
        fprintf(stderr, "edge: enrolled as %s (site %s, region %s)\n", fpr, c.site, c.region);
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = s_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    fi_edge *e = fi_edge_new(&c, err, sizeof err);
    if (!e) {
        fprintf(stderr, "fedinfer edge: %s\n", err);
        return 1;
    }
    while (!s_stop) {
        usleep(100 * 1000);
        if (s_hup) {
            s_hup = 0;
            fprintf(stderr, "edge: SIGHUP: reloading %s\n", config);
            fi_edge_reload(e, config);
        }
    }
    fprintf(stderr, "edge: stopping (in-flight requests have %d s)\n", c.shutdown_grace_s);
    fi_edge_destroy(&e);
    fprintf(stderr, "edge: stopped\n");
    return 0;
}
