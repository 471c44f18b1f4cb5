/*
 * fi_ctl_tokens.c - `fedctl token`: the application bearer tokens of an
 * edge (issue 5), managed centrally.
 *
 *   fedctl token add --site S --tenant T --app A   prints a new token, once
 *   fedctl token list [--site S]
 *   fedctl token revoke TOKEN|SHA256
 *
 * The token is made here and only its SHA-256 leaves this process: the
 * coordinator records the hash with its metadata and sends it to the
 * site's edges, which store the hash. The secret is printed once and
 * wiped; it is on no wire and in no database.
 */
#include <getopt.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_client.h"
#include "fi_fabric_cmd.h"

#define S_USAGE                                                                                   \
    "usage: fedctl token add --site SITE --tenant NAME --app NAME [--config FILE]\n"              \
    "       fedctl token list [--site SITE] [--config FILE]\n"                                    \
    "       fedctl token revoke TOKEN|SHA256 [--config FILE]\n\n"                                 \
    "Application bearer tokens of an edge. add prints a new token once (only its\n"             \
    "SHA-256 is sent and stored; the coordinator forwards it to the site's edges,\n"            \
    "now or when they next connect); list shows hashes with tenant, application\n"              \
    "and state, the newest 2048 first; revoke takes the token or its SHA-256. Tokens made on the edge\n" \
    "itself (fedinfer edge token) are not listed here.\n"                                       \
    "  --config FILE   fedctl configuration (default $FEDCTL_CONFIG)\n"

/* SHA-256 of the token as the edge computes it (edge_token_hash). */
static void s_hash(const char *token, char out[65]) {
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (const unsigned char *)token, strlen(token));
    sodium_bin2hex(out, 65, h, sizeof h);
}

static void s_time(int64_t t, char *buf, size_t cap) {
    if (!t) {
        snprintf(buf, cap, "-");
        return;
    }
    time_t tt = (time_t)t;
    struct tm tm;
    gmtime_r(&tt, &tm);
    strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

int fi_ctl_token(int argc, char **argv) {
    static const struct option opts[] = {{"config", required_argument, NULL, 'C'},
                                         {"site", required_argument, NULL, 's'},
                                         {"tenant", required_argument, NULL, 't'},
                                         {"app", required_argument, NULL, 'a'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *config = NULL, *site = "", *tenant = "", *app = "";
    int ch;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "C:s:t:a:h", opts, NULL)) != -1) {
        switch (ch) {
        case 'C': config = optarg; break;
        case 's': site = optarg; break;
        case 't': tenant = optarg; break;
        case 'a': app = optarg; break;
        default: fprintf(ch == 'h' ? stdout : stderr, "%s", S_USAGE); return ch == 'h' ? 0 : 2;
        }
    }
    const char *op = optind < argc ? argv[optind] : "";
    Fi__AppTokenRequest rq = FI__APP_TOKEN_REQUEST__INIT;
    char token[64] = "", hash[65] = "";
    if (!strcmp(op, "add") && optind + 1 == argc) {
        if (!site[0] || !tenant[0] || !app[0]) {
            fprintf(stderr, "fedctl token add: --site, --tenant and --app are required\n");
            return 2;
        }
        unsigned char rnd[20];
        if (sodium_init() < 0) {
            fprintf(stderr, "fedctl token add: libsodium cannot initialise\n");
            return 1;
        }
        randombytes_buf(rnd, sizeof rnd);
        char hex[41];
        sodium_bin2hex(hex, sizeof hex, rnd, sizeof rnd);
        snprintf(token, sizeof token, "fie_%s", hex);
        sodium_memzero(rnd, sizeof rnd);
        sodium_memzero(hex, sizeof hex);
        s_hash(token, hash);
    } else if (!strcmp(op, "revoke") && optind + 2 == argc) {
        const char *t = argv[optind + 1];
        int hex = strlen(t) == 64;
        for (int i = 0; hex && i < 64; i++)
            hex = (t[i] >= '0' && t[i] <= '9') || (t[i] >= 'a' && t[i] <= 'f');
        if (hex) snprintf(hash, sizeof hash, "%s", t);
        else s_hash(t, hash);
    } else if (!(!strcmp(op, "list") && optind + 1 == argc)) {
        fprintf(stderr, "%s", S_USAGE);
        return 2;
    }
    rq.op = (char *)op;
    rq.site = (char *)site;
    rq.tenant = (char *)tenant;
    rq.application = (char *)app;
    rq.hash = hash;
    int rc = 1;
    fi_client *c = fi_ctl_connect("token", config);
    if (c) {
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_APP_TOKEN_REQUEST;
        m.app_token_request = &rq;
        fi_msg *r = fi_ctl_call("token", c, &m, FI__ENVELOPE__BODY_APP_TOKEN_REPLY, NULL);
        fi_client_destroy(&c);
        if (r) {
            const Fi__AppTokenReply *rep = r->app_token_reply;
            if (!strcmp(op, "add")) {
                printf("%s\n", token);
                fprintf(stderr, "token for tenant %s, application %s at site %s (sha256 %s); sent "
                        "to %u connected edge(s), the others get it when they connect. It is "
                        "shown only now.\n", tenant, app, site, hash, rep->pushed);
            } else if (!strcmp(op, "revoke")) {
                printf("revoked %s (sent to %u connected edge(s))\n", hash, rep->pushed);
            } else {
                printf("%-64s %-16s %-16s %-16s %-20s %s\n", "SHA256", "SITE", "TENANT",
                       "APPLICATION", "CREATED", "REVOKED");
                for (size_t i = 0; i < rep->n_tokens; i++) {
                    const Fi__AppToken *t = rep->tokens[i];
                    char cr[32], rv[32];
                    s_time(t->created, cr, sizeof cr);
                    s_time(t->revoked, rv, sizeof rv);
                    printf("%-64s %-16s %-16s %-16s %-20s %s\n", t->hash, t->site, t->tenant,
                           t->application, cr, rv);
                }
            }
            fi_wire_free(&r);
            rc = 0;
        }
    }
    sodium_memzero(token, sizeof token);
    return rc;
}
