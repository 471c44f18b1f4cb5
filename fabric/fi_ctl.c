/*
 * fi_ctl.c - the fabric's verbs of `fedctl`, the operator's console:
 * status, enrol (one-time tokens), join (a new operator's key, with an
 * operator token), revoke.
 *
 * fedctl talks to the coordinator over the fabric, as an operator peer
 * authenticated by its key; it never opens the coordinator's database.
 * Its configuration (--config FILE, or $FEDCTL_CONFIG):
 *
 *   coordinator = tcp://coordinator:7700
 *   coordinator_key = /etc/fedinfer/coord.pub
 *   secret_key = /home/op/.fedinfer/op.key
 */
#include <getopt.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_client.h"
#include "fi_fabric_cmd.h"

typedef struct s_ctl_conf {
    char coordinator[FI_CONF_STR_MAX];     /* fabric endpoint */
    char coordinator_key[FI_CONF_STR_MAX]; /* its public key file */
    char secret_key[FI_CONF_STR_MAX];      /* the operator's secret key file */
    char enrol_endpoint[FI_CONF_STR_MAX];  /* the coordinator's enrolment endpoint (join) */
    int timeout_ms;                        /* how long to wait for answers */
} s_ctl_conf;

static const fi_conf_key s_ctl_keys[] = {
    {"coordinator", FI_CONF_STR, offsetof(s_ctl_conf, coordinator), 1, 0, 0, 0},
    {"coordinator_key", FI_CONF_STR, offsetof(s_ctl_conf, coordinator_key), 1, 0, 0, 0},
    {"secret_key", FI_CONF_STR, offsetof(s_ctl_conf, secret_key), 1, 0, 0, 0},
    {"enrol_endpoint", FI_CONF_STR, offsetof(s_ctl_conf, enrol_endpoint), 0, 0, 0, 0},
    {"timeout_ms", FI_CONF_INT, offsetof(s_ctl_conf, timeout_ms), 0, 100, 600000, 0},
    {NULL, FI_CONF_STR, 0, 0, 0, 0, 0},
};

#define S_CONF_HELP                                                                  \
    "  --config FILE   fedctl configuration (default $FEDCTL_CONFIG): coordinator,\n" \
    "                  coordinator_key, secret_key [, enrol_endpoint, timeout_ms]\n"

/* Reads the configuration (config, else $FEDCTL_CONFIG) into cc and the
 * operator's client options into o (its keys loaded: wipe o->kp). 0, or
 * -1 with the message printed. */
static int s_load_conf(const char *verb, const char **config, s_ctl_conf *cc, fi_client_opts *o) {
    if (!*config) *config = getenv("FEDCTL_CONFIG");
    if (!*config) {
        fprintf(stderr, "fedctl %s: no --config and no $FEDCTL_CONFIG\n", verb);
        return -1;
    }
    memset(cc, 0, sizeof *cc);
    cc->timeout_ms = 5000;
    char err[1024];
    fi_client_opts_default(o);
    o->role = FI__ROLE__ROLE_OPERATOR;
    if (fi_conf_load(*config, s_ctl_keys, cc, err, sizeof err) != 0 ||
        fi_keys_load_public(cc->coordinator_key, o->server_pub, err, sizeof err) != 0 ||
        fi_keys_load_secret(cc->secret_key, &o->kp, err, sizeof err) != 0) {
        fprintf(stderr, "fedctl %s: %s\n", verb, err);
        return -1;
    }
    snprintf(o->endpoint, sizeof o->endpoint, "%s", cc->coordinator);
    return 0;
}

/* Connects as an operator. NULL (message printed) on failure. */
fi_client *fi_ctl_connect(const char *verb, const char *config) {
    s_ctl_conf cc;
    fi_client_opts o;
    char err[1024];
    if (s_load_conf(verb, &config, &cc, &o) != 0) return NULL;
    fi_client *c = fi_client_new(&o, err, sizeof err);
    fi_keys_wipe(&o.kp);
    if (c && fi_client_wait_ready(c, cc.timeout_ms, err, sizeof err) != 0) fi_client_destroy(&c);
    if (!c) fprintf(stderr, "fedctl %s: %s\n", verb, err);
    return c;
}

fi_msg *fi_ctl_call(const char *verb, fi_client *c, const fi_msg *m, int want, int *code) {
    return fi_ctl_call_wait(verb, c, m, want, code, FI_CTL_WAIT_MS);
}

fi_msg *fi_ctl_call_wait(const char *verb, fi_client *c, const fi_msg *m, int want, int *code, int wait_ms) {
    fi_msg *r = NULL;
    char err[512];
    if (code) *code = FI__ERROR_CODE__ERR_UNSPECIFIED;
    int rc = fi_client_call(c, m, (fi_msg_type)want, wait_ms, &r, err, sizeof err);
    if (rc != 1) {
        fprintf(stderr, "fedctl %s: %s\n", verb, err);
        return NULL;
    }
    if (r->body_case == FI__ENVELOPE__BODY_ERROR) {
        if (code) *code = r->error->code;
        fprintf(stderr, "fedctl %s: %s (%s)\n", verb, r->error->message,
                fi_wire_error_name(r->error->code));
        fi_wire_free(&r);
    }
    return r;
}

static fi_client *s_connect(const char *verb, const char *config) {
    return fi_ctl_connect(verb, config);
}

static fi_msg *s_call(const char *verb, fi_client *c, const fi_msg *m, fi_msg_type want) {
    return fi_ctl_call(verb, c, m, want, NULL);
}

/* Parses --config/--help only; returns -1 to exit with *rc. */
static int s_simple_opts(int argc, char **argv, const char *usage, const char **config, int *rc) {
    static const struct option opts[] = {{"config", required_argument, NULL, 'C'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int ch;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "C:h", opts, NULL)) != -1) {
        if (ch == 'C') {
            *config = optarg;
            continue;
        }
        fprintf(ch == 'h' ? stdout : stderr, "%s", usage);
        *rc = ch == 'h' ? 0 : 2;
        return -1;
    }
    return 0;
}

int fi_ctl_status(int argc, char **argv) {
    const char *config = NULL;
    int rc = 0;
    if (s_simple_opts(argc, argv,
                      "usage: fedctl status [--config FILE]\n\n"
                      "Lists enrolled sites, edges, clusters and operators with their health.\n" S_CONF_HELP,
                      &config, &rc) != 0)
        return rc;
    if (optind != argc) {
        fprintf(stderr, "fedctl status: no arguments expected\n");
        return 2;
    }
    fi_client *c = s_connect("status", config);
    if (!c) return 1;
    Fi__StatusRequest sq = FI__STATUS_REQUEST__INIT;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_STATUS_REQUEST;
    m.status_request = &sq;
    fi_msg *r = s_call("status", c, &m, FI__ENVELOPE__BODY_STATUS_REPLY);
    fi_client_destroy(&c);
    if (!r) return 1;
    printf("%-9s %-16s %-12s %-32s %-10s %-9s %s\n", "ROLE", "SITE", "REGION", "FINGERPRINT",
           "HEALTH", "IN-FLIGHT", "MODELS/POLICY");
    for (size_t i = 0; i < r->status_reply->n_peers; i++) {
        const Fi__PeerStatus *p = r->status_reply->peers[i];
        char health[32], models[256] = "";
        if (p->revoked) snprintf(health, sizeof health, "revoked");
        else if (p->connected) snprintf(health, sizeof health, "up");
        else snprintf(health, sizeof health, "down");
        for (size_t k = 0; k < p->n_models; k++) {
            size_t used = strlen(models);
            snprintf(models + used, sizeof models - used, "%s%s(x%u)", k ? "," : "",
                     p->models[k]->name, p->models[k]->capacity);
        }
        if (p->load && p->connected) {
            size_t used = strlen(models);
            snprintf(models + used, sizeof models - used, " running=%u queued=%u kv=%u/%u",
                     p->load->running, p->load->queued, p->load->kv_blocks_free,
                     p->load->kv_blocks_total);
        }
        if (p->role == FI__ROLE__ROLE_EDGE && p->connected)
            snprintf(models, sizeof models, "policy=%llu audit-witness=%llu%s", (unsigned long long)p->policy_version,
                     (unsigned long long)p->audit_witness, p->audit_witness_fails ? " FAILS" : "");
        printf("%-9s %-16s %-12s %-32s %-10s %-9u %s\n", fi_wire_role_name(p->role),
               p->site[0] ? p->site : "-", p->region[0] ? p->region : "-", p->fingerprint, health,
               p->in_flight, models[0] ? models : "-");
    }
    fi_wire_free(&r);
    return 0;
}

int fi_ctl_enrol(int argc, char **argv) {
    static const struct option opts[] = {{"config", required_argument, NULL, 'C'},
                                         {"role", required_argument, NULL, 'r'},
                                         {"site", required_argument, NULL, 's'},
                                         {"region", required_argument, NULL, 'g'},
                                         {"ttl", required_argument, NULL, 't'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *config = NULL, *role = NULL, *site = "", *region = "";
    long ttl = 3600;
    int ch;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "C:r:s:g:t:h", opts, NULL)) != -1) {
        switch (ch) {
        case 'C': config = optarg; break;
        case 'r': role = optarg; break;
        case 's': site = optarg; break;
        case 'g': region = optarg; break;
        case 't': {
            char *end;
            errno = 0;
            ttl = strtol(optarg, &end, 10);
            if (errno || end == optarg || *end) {
                fprintf(stderr, "fedctl enrol: --ttl expects seconds, not '%s'\n", optarg);
                return 2;
            }
            break;
        }
        default:
            fprintf(ch == 'h' ? stdout : stderr,
                    "usage: fedctl enrol --role edge|cluster|operator [--site S --region R]\n"
                    "                    [--ttl SECONDS] [--config FILE]\n\n"
                    "Creates a one-time enrolment token (default ttl 3600 s). The peer presents\n"
                    "it once with its key, site and region; edges and clusters need --site and\n"
                    "--region, which the token pins. An operator token is presented with\n"
                    "`fedctl join`.\n" S_CONF_HELP);
            return ch == 'h' ? 0 : 2;
        }
    }
    Fi__Role r = fi_wire_role_parse(role);
    if (optind != argc || r == FI__ROLE__ROLE_UNSPECIFIED || ttl < 1 || ttl > 7 * 86400) {
        fprintf(stderr, "fedctl enrol: --role edge|cluster|operator is required; --ttl is "
                        "1..604800 s (see --help)\n");
        return 2;
    }
    fi_client *c = s_connect("enrol", config);
    if (!c) return 1;
    Fi__TokenRequest tr = FI__TOKEN_REQUEST__INIT;
    tr.role = r;
    tr.site = (char *)site;
    tr.region = (char *)region;
    tr.ttl_s = (uint32_t)ttl;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_TOKEN_REQUEST;
    m.token_request = &tr;
    fi_msg *rep = s_call("enrol", c, &m, FI__ENVELOPE__BODY_TOKEN_REPLY);
    fi_client_destroy(&c);
    if (!rep) return 1;
    time_t exp = (time_t)rep->token_reply->expires_unix;
    struct tm tm;
    char when[32];
    gmtime_r(&exp, &tm);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    printf("%s\n", rep->token_reply->token);
    fprintf(stderr, "one-time token for %s %s/%s, expires %s\n", role, site[0] ? site : "-",
            region[0] ? region : "-", when);
    fi_wire_free(&rep);
    return 0;
}

int fi_ctl_join(int argc, char **argv) {
    const char *config = NULL;
    int rc = 0;
    if (s_simple_opts(argc, argv,
                      "usage: fedctl join [--config FILE] TOKEN|-\n\n"
                      "Enrols this configuration's key (secret_key) as an operator, with a\n"
                      "one-time token another operator made (fedctl enrol --role operator);\n"
                      "- reads the token from standard input (a command line is visible to\n"
                      "every local user). Needs enrol_endpoint in the configuration.\n" S_CONF_HELP,
                      &config, &rc) != 0)
        return rc;
    if (optind != argc - 1) {
        fprintf(stderr, "fedctl join: expected one TOKEN (or - for standard input)\n");
        return 2;
    }
    s_ctl_conf cc;
    fi_client_opts o;
    char err[1024], fpr[FI_KEYS_FPR_LEN];
    if (s_load_conf("join", &config, &cc, &o) != 0) return 1;
    if (!cc.enrol_endpoint[0]) {
        fi_keys_wipe(&o.kp);
        fprintf(stderr, "fedctl join: %s has no enrol_endpoint (the coordinator's enrol_bind)\n",
                config);
        return 2;
    }
    rc = fi_client_enrol(&o, cc.enrol_endpoint, argv[optind], FI__ROLE__ROLE_OPERATOR, "", "",
                         cc.timeout_ms, fpr, err, sizeof err);
    fi_keys_wipe(&o.kp);
    if (rc != 0) {
        fprintf(stderr, "fedctl join: %s\n", err);
        return 1;
    }
    printf("enrolled as operator, fingerprint %s\n", fpr);
    return 0;
}

int fi_ctl_revoke(int argc, char **argv) {
    const char *config = NULL;
    int rc = 0;
    if (s_simple_opts(argc, argv,
                      "usage: fedctl revoke [--config FILE] FINGERPRINT\n\n"
                      "Revokes an enrolled key: its open connection is closed at once and it\n"
                      "cannot connect again. Not undoable (enrol a new key).\n" S_CONF_HELP,
                      &config, &rc) != 0)
        return rc;
    if (optind != argc - 1) {
        fprintf(stderr, "fedctl revoke: expected one FINGERPRINT (see `fedctl status`)\n");
        return 2;
    }
    fi_client *c = s_connect("revoke", config);
    if (!c) return 1;
    Fi__RevokeRequest rr = FI__REVOKE_REQUEST__INIT;
    rr.fingerprint = argv[optind];
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_REVOKE_REQUEST;
    m.revoke_request = &rr;
    fi_msg *r = s_call("revoke", c, &m, FI__ENVELOPE__BODY_ACK);
    fi_client_destroy(&c);
    if (!r) return 1;
    printf("revoked %s\n", argv[optind]);
    fi_wire_free(&r);
    return 0;
}
