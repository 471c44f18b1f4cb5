/*
 * fi_cmd_fabric.c - `fedinfer keygen` and `fedinfer coordinator`.
 *
 * Bootstrap: the first operator key cannot be enrolled over the fabric
 * (nobody could create its token), so it is written into the database
 * directly, by whoever runs the coordinator:
 *
 *   fedinfer keygen coord              # coord.key (0600), coord.pub
 *   fedinfer keygen op                 # on the operator's machine
 *   fedinfer coordinator --config coordinator.conf --init --operator-key op.pub
 *   fedinfer coordinator --config coordinator.conf
 *
 * Every other peer, operators included, is enrolled with a one-time token
 * from `fedctl enrol`.
 */
#include <getopt.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "fi_coord.h"
#include "fi_coord_ship.h"
#include "fi_fabric_cmd.h"

int fi_cmd_keygen(int argc, char **argv) {
    static const struct option opts[] = {
        {"force", no_argument, NULL, 'f'}, {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    int force = 0, ch;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "fh", opts, NULL)) != -1) {
        if (ch == 'f') force = 1;
        else {
            FILE *f = ch == 'h' ? stdout : stderr;
            fprintf(f, "usage: fedinfer keygen [--force] NAME\n\n"
                       "Writes a Curve25519 key pair: NAME.key (secret, mode 0600) and NAME.pub.\n"
                       "  --force   overwrite existing files\n");
            return ch == 'h' ? 0 : 2;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "fedinfer keygen: expected one NAME (see --help)\n");
        return 2;
    }
    char sec[1024], pub[1024], err[512], fpr[FI_KEYS_FPR_LEN];
    const char *name = argv[optind];
    size_t base = strlen(name);
    if (!base || name[base - 1] == '/' || snprintf(sec, sizeof sec, "%s.key", name) >= (int)sizeof sec ||
        snprintf(pub, sizeof pub, "%s.pub", name) >= (int)sizeof pub) {
        fprintf(stderr, "fedinfer keygen: NAME must be a file name of at most %zu bytes, not '%.64s%s'\n",
                sizeof sec - 5, name, base > 64 ? "..." : "");
        return 2;
    }
    fi_keypair kp;
    if (fi_keys_generate(&kp) != 0) {
        fprintf(stderr, "fedinfer keygen: libsodium failed to initialise\n");
        return 1;
    }
    int rc = fi_keys_save(&kp, sec, pub, force, err, sizeof err);
    fi_keys_fingerprint(kp.pub, fpr);
    fi_keys_wipe(&kp);
    if (rc != 0) {
        fprintf(stderr, "fedinfer keygen: %s\n", err);
        return 1;
    }
    printf("wrote %s (secret, 0600) and %s, fingerprint %s\n", sec, pub, fpr);
    return 0;
}

/* The one piece of process state a signal handler needs. */
static atomic_int s_stop;

static void s_on_signal(int sig) {
    (void)sig;
    atomic_store(&s_stop, 1);
}

int fi_cmd_coordinator(int argc, char **argv) {
    static const struct option opts[] = {{"config", required_argument, NULL, 'c'},
                                         {"init", no_argument, NULL, 'i'},
                                         {"operator-key", required_argument, NULL, 'o'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *config = NULL, *op_key = NULL;
    int init = 0, ch;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "c:io:h", opts, NULL)) != -1) {
        switch (ch) {
        case 'c': config = optarg; break;
        case 'i': init = 1; break;
        case 'o': op_key = optarg; break;
        default: {
            FILE *f = ch == 'h' ? stdout : stderr;
            fprintf(f,
                    "usage: fedinfer coordinator --config FILE\n"
                    "       fedinfer coordinator --config FILE --init --operator-key OP.pub\n\n"
                    "Runs the coordinator. --init records the first operator's public key in\n"
                    "the database, makes the policy-signing key (unless it exists; its public\n"
                    "key, KEY.pub, is what edges trust as the signer of policy bundles) and\n"
                    "exits (bootstrap; later peers enrol with tokens).\n\n"
                    "Configuration (key = value lines; unknown keys are errors):\n"
                    "  db = FILE            SQLite state (required)\n"
                    "  secret_key = FILE    the coordinator's secret key (required, mode 0600)\n"
                    "  bind = ENDPOINT      fabric endpoint (tcp://0.0.0.0:7700)\n"
                    "  enrol_bind = ENDPOINT  enrolment endpoint (tcp://0.0.0.0:7701)\n"
                    "  policy_key = FILE    policy-signing key (DB.policy.key)\n"
                    "  audit_db = FILE      the coordinator's audit log (DB.audit)\n"
                    "  policy_valid_s = N   default validity of a signed bundle (2592000)\n"
                    "  policy_check_key = FILE  trusted policy-signing public key: re-check every\n"
                    "                       routed request (normally DB.policy.key.pub; the\n"
                    "                       environment's FEDINFER_COORD_POLICY_KEY overrides it;\n"
                    "                       neither: no re-check)\n"
                    "  heartbeat_ms, liveness, handshake_ms, max_msg, hwm, max_in_flight\n");
            return ch == 'h' ? 0 : 2;
        }
        }
    }
    if (!config || optind != argc || (init && !op_key) || (!init && op_key)) {
        fprintf(stderr, "fedinfer coordinator: --config is required; --init goes with "
                        "--operator-key (see --help)\n");
        return 2;
    }
    char err[1024];
    fi_coord_opts o;
    fi_coord_opts_default(&o);
    if (fi_conf_load(config, fi_coord_conf_keys, &o, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer coordinator: %s\n", err);
        return 1;
    }
    if (init) {
        uint8_t pub[FI_KEYS_BYTES];
        char fpr[FI_KEYS_FPR_LEN];
        if (fi_keys_load_public(op_key, pub, err, sizeof err) != 0) {
            fprintf(stderr, "fedinfer coordinator: %s\n", err);
            return 1;
        }
        fi_store *st = fi_store_open(o.db, err, sizeof err);
        /* An operator recorded by an earlier --init that stopped before
         * making the policy-signing key: this run goes on from there. */
        fi_peer_rec had;
        int known = st ? fi_store_peer_get(st, pub, &had) : -1;
        int again = known == 1 && had.role == FI__ROLE__ROLE_OPERATOR && !had.revoked;
        int rc = !st ? -1
                 : again ? 0
                         : fi_store_peer_add(st, pub, FI__ROLE__ROLE_OPERATOR, "", "", err, sizeof err);
        fi_store_destroy(&st);
        if (rc != 0) {
            fprintf(stderr, "fedinfer coordinator: --init: %s\n", err);
            return 1;
        }
        fi_keys_fingerprint(pub, fpr);
        printf("operator %s %s in %s\n", fpr, again ? "already recorded" : "recorded", o.db);
        /* The policy-signing key: bundles are signed with it at the
         * coordinator; edges pin its public key as the one known signer. */
        char key[FI_CONF_STR_MAX + 16], hex[65];
        int created = 0;
        fi_ship_paths(o.db, o.policy_key, o.audit_db, key, sizeof key, NULL, 0);
        if (fi_ship_keygen(key, hex, &created, err, sizeof err) != 0) {
            fprintf(stderr, "fedinfer coordinator: --init: policy-signing key: %s\n", err);
            return 1;
        }
        printf("policy-signing key %s %s (0600); public key %s.pub: %s\n", key,
               created ? "written" : "kept", key, hex);
        return 0;
    }
    fi_keypair kp;
    if (fi_keys_load_secret(o.secret_key, &kp, err, sizeof err) != 0) {
        fprintf(stderr, "fedinfer coordinator: %s\n", err);
        return 1;
    }
    fi_coord *c = fi_coord_new(&o, &kp, err, sizeof err);
    fi_keys_wipe(&kp);
    if (!c) {
        fprintf(stderr, "fedinfer coordinator: %s\n", err);
        return 1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = s_on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    int rc = fi_coord_run(c, &s_stop);
    fi_coord_destroy(&c);
    return rc == 0 ? 0 : 1;
}
