/*
 * fi_ctl_policy.c - `fedctl policy apply | history | rollback | diff |
 * bundle` and `fedctl audit [verify]` against the coordinator.
 *
 * These verbs change or read the fleet's policy and audit log, which the
 * coordinator holds: fedctl sends operator requests over the fabric
 * (CURVE, the operator's key, --config as for `fedctl status`) and never
 * opens the coordinator's databases. The policy-signing key stays at the
 * coordinator.
 *
 * The same verbs with --store FILE (policy) or --db FILE (audit), and
 * `diff --active FILE`, are policy/'s offline tools working on a local
 * SQLite file (policy/policy_cmd.c); so are the verbs that need no fleet
 * state (check, test, explain, flows, bench, install, keygen).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_audit.h"
#include "fi_fabric_cmd.h"
#include "fi_policy.h"
#include "fi_policy_cmd.h"

#define S_CONF_HELP                                                                        \
    "  --config FILE   fedctl configuration (default $FEDCTL_CONFIG), as for fedctl status:\n" \
    "                  coordinator, coordinator_key, secret_key [, timeout_ms]\n"

/* --- arguments -------------------------------------------------------------- */

typedef struct s_args {
    const char *pos[4];   /* positional arguments */
    int n_pos;
    const char *val[16];  /* values of the options named in names, by index */
    bool flag[16];        /* flags given */
} s_args;

/* Parses argv[1..]: names lists "--opt=" (takes a value) or "--flag"
 * (none), with optional one-letter aliases after a '|' ("-m|--message=").
 * Returns 0, or 2 on an unknown option, a missing value or too many
 * positionals (message printed). */
static int s_parse(const char *verb, int argc, char **argv, const char *const *names, s_args *a) {
    memset(a, 0, sizeof *a);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (arg[0] != '-' || !arg[1]) {
            if (a->n_pos == 4) {
                fprintf(stderr, "fedctl %s: too many arguments (see --help)\n", verb);
                return 2;
            }
            a->pos[a->n_pos++] = arg;
            continue;
        }
        int found = -1, takes = 0;
        for (int k = 0; names[k] && found < 0; k++) {
            char buf[64];
            snprintf(buf, sizeof buf, "%s", names[k]);
            size_t n = strlen(buf);
            takes = n && buf[n - 1] == '=';
            if (takes) buf[n - 1] = 0;
            for (char *save = NULL, *t = strtok_r(buf, "|", &save); t; t = strtok_r(NULL, "|", &save))
                if (!strcmp(t, arg)) found = k;
        }
        if (found < 0) {
            fprintf(stderr, "fedctl %s: unknown option %s (see --help)\n", verb, arg);
            return 2;
        }
        if (takes) {
            if (i + 1 >= argc) {
                fprintf(stderr, "fedctl %s: option %s needs a value\n", verb, arg);
                return 2;
            }
            a->val[found] = argv[++i];
        } else {
            a->flag[found] = true;
        }
    }
    return 0;
}

static bool s_has(int argc, char **argv, const char *opt) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], opt)) return true;
    return false;
}

static bool s_help(int argc, char **argv) { return s_has(argc, argv, "--help") || s_has(argc, argv, "-h"); }


static char *s_slurp(const char *verb, const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fedctl %s: cannot open %s: %s\n", verb, path, strerror(errno));
        return NULL;
    }
    size_t cap = FI_WIRE_MAX_POLICY + 2;
    char *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        fprintf(stderr, "fedctl %s: out of memory\n", verb);
        return NULL;
    }
    *len = fread(buf, 1, cap - 1, f);
    int bad = ferror(f);
    fclose(f);
    if (bad || *len > FI_WIRE_MAX_POLICY) {
        fprintf(stderr, "fedctl %s: %s: %s\n", verb, path,
                bad ? "read error" : "larger than the 458752 bytes a policy may have");
        free(buf);
        return NULL;
    }
    buf[*len] = 0;
    if (strlen(buf) != *len) {
        fprintf(stderr, "fedctl %s: %s holds a NUL byte: not a policy\n", verb, path);
        free(buf);
        return NULL;
    }
    return buf;
}

/* Connects, sends m, waits for want, disconnects. NULL when refused
 * (printed). */
static fi_msg *s_ask(const char *verb, const char *config, const fi_msg *m, fi_msg_type want) {
    fi_client *c = fi_ctl_connect(verb, config);
    if (!c) return NULL;
    fi_msg *r = fi_ctl_call(verb, c, m, (int)want, NULL);
    fi_client_destroy(&c);
    return r;
}

static void s_print_shipped(const char *what, const Fi__PolicyReply *r) {
    for (size_t i = 0; i < r->n_warnings; i++) fprintf(stderr, "%s\n", r->warnings[i]);
    char na[32];
    fi_fmt_utc(r->not_after, na, sizeof na);
    printf("%s as version %llu (digest %.16s), bundle valid until %s, pushed to %u edge(s)\n", what,
           (unsigned long long)r->version, r->digest, na, r->pushed);
}

/* --- policy verbs ----------------------------------------------------------- */

static int s_apply(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy apply FILE -m WHY [--not-after T] [--config FILE]\n\n"
               "Sends FILE to the coordinator, which validates it (refused with the checker's\n"
               "messages when it has errors; warnings are printed), stores it as the next\n"
               "version with your key's fingerprint as author, the time, its digest and WHY,\n"
               "signs its bundle with the coordinator's policy-signing key and pushes it to\n"
               "every connected edge. The bundle is valid from now until T (YYYY-MM-DD,\n"
               "YYYY-MM-DDTHH:MM:SSZ or Unix seconds), the policy's `expires` or the\n"
               "coordinator's default (30 days), whichever is first.\n" S_CONF_HELP
               "\nOffline (a local store file, not the fleet's):\n"
               "  fedctl policy apply FILE -m WHY --store DB --key KEYFILE  (see policy/README.md)\n");
        return 0;
    }
    static const char *const names[] = {"-m|--message=", "--not-after=", "--config=", NULL};
    s_args a;
    if (s_parse("policy apply", argc, argv, names, &a)) return 2;
    if (a.n_pos != 1 || !a.val[0]) {
        fprintf(stderr, "usage: fedctl policy apply FILE -m WHY [--not-after T] [--config FILE]\n");
        return 2;
    }
    if (strlen(a.val[0]) > FI_WIRE_MAX_COMMENT) {
        fprintf(stderr, "fedctl policy apply: the comment is longer than %d bytes\n", FI_WIRE_MAX_COMMENT);
        return 2;
    }
    int64_t na = a.val[1] ? fi_policy_cmd_time(a.val[1]) : 0;
    if (na < 0) {
        fprintf(stderr, "fedctl policy apply: bad time '%s' (YYYY-MM-DD, YYYY-MM-DDTHH:MM:SSZ or Unix seconds)\n",
                a.val[1]);
        return 2;
    }
    if (a.val[1] && na <= (int64_t)time(NULL)) {
        /* 0 on the wire means "the default validity": a past time must not become it */
        fprintf(stderr, "fedctl policy apply: --not-after '%s' is not in the future\n", a.val[1]);
        return 2;
    }
    size_t len;
    char *text = s_slurp("policy apply", a.pos[0], &len);
    if (!text) return 1;
    Fi__PolicyApply pa = FI__POLICY_APPLY__INIT;
    pa.content = text;
    pa.comment = (char *)a.val[0];
    pa.not_after_s = (uint64_t)na;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_POLICY_APPLY;
    m.policy_apply = &pa;
    fi_msg *r = s_ask("policy apply", a.val[2], &m, FI__ENVELOPE__BODY_POLICY_REPLY);
    free(text);
    if (!r) return 1;
    char what[1200];
    snprintf(what, sizeof what, "applied %s", a.pos[0]);
    s_print_shipped(what, r->policy_reply);
    fi_wire_free(&r);
    return 0;
}

static int s_history(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy history [--config FILE]\n\n"
               "Lists the policy versions the coordinator holds, oldest first: version, time,\n"
               "author (the applying operator's key fingerprint), content digest, comment.\n" S_CONF_HELP
               "\nOffline: fedctl policy history --store DB\n");
        return 0;
    }
    static const char *const names[] = {"--config=", NULL};
    s_args a;
    if (s_parse("policy history", argc, argv, names, &a)) return 2;
    if (a.n_pos) {
        fprintf(stderr, "usage: fedctl policy history [--config FILE]\n");
        return 2;
    }
    Fi__PolicyHistoryRequest hq = FI__POLICY_HISTORY_REQUEST__INIT;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_POLICY_HISTORY_REQUEST;
    m.policy_history_request = &hq;
    fi_msg *r = s_ask("policy history", a.val[0], &m, FI__ENVELOPE__BODY_POLICY_HISTORY_REPLY);
    if (!r) return 1;
    const Fi__PolicyHistoryReply *h = r->policy_history_reply;
    if (h->truncated) printf("(older versions not shown)\n");
    printf("%-7s %-20s %-32s %-16s  %s\n", "version", "time", "author", "digest", "comment");
    for (size_t i = 0; i < h->n_versions; i++) {
        const Fi__PolicyVersion *v = h->versions[i];
        char t[32];
        fi_fmt_utc(v->created, t, sizeof t);
        printf("%-7llu %-20s %-32s %.16s  %s\n", (unsigned long long)v->version, t, v->author, v->digest,
               v->comment);
    }
    fi_wire_free(&r);
    return 0;
}

static int s_rollback(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy rollback VERSION [-m WHY] [--config FILE]\n\n"
               "Asks the coordinator for a new version carrying the content of VERSION, signed\n"
               "anew and pushed to every connected edge (edges accept it: its version number\n"
               "is higher than any they hold).\n" S_CONF_HELP
               "\nOffline: fedctl policy rollback VERSION --store DB --key KEYFILE [-m WHY]\n");
        return 0;
    }
    static const char *const names[] = {"-m|--message=", "--config=", NULL};
    s_args a;
    if (s_parse("policy rollback", argc, argv, names, &a)) return 2;
    char *e = NULL;
    unsigned long long old = a.n_pos == 1 ? strtoull(a.pos[0], &e, 10) : 0;
    if (a.n_pos != 1 || *e || !old || (a.val[0] && strlen(a.val[0]) > FI_WIRE_MAX_COMMENT)) {
        fprintf(stderr, "usage: fedctl policy rollback VERSION [-m WHY] [--config FILE]\n");
        return 2;
    }
    Fi__PolicyRollback rb = FI__POLICY_ROLLBACK__INIT;
    rb.version = old;
    rb.comment = (char *)(a.val[0] ? a.val[0] : "");
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_POLICY_ROLLBACK;
    m.policy_rollback = &rb;
    fi_msg *r = s_ask("policy rollback", a.val[1], &m, FI__ENVELOPE__BODY_POLICY_REPLY);
    if (!r) return 1;
    char what[64];
    snprintf(what, sizeof what, "restored the content of version %llu", old);
    s_print_shipped(what, r->policy_reply);
    fi_wire_free(&r);
    return 0;
}

/* Fetches a version (0: active). NULL when refused (printed). */
static fi_msg *s_get(const char *verb, fi_client *c, uint64_t version, bool with_bundle) {
    Fi__PolicyGet g = FI__POLICY_GET__INIT;
    g.version = version;
    g.with_bundle = with_bundle;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_POLICY_GET;
    m.policy_get = &g;
    fi_msg *r = fi_ctl_call(verb, c, &m, FI__ENVELOPE__BODY_POLICY_CONTENT, NULL);
    if (r && !r->policy_content->info) {
        fprintf(stderr, "fedctl %s: the coordinator's answer lacks the version's details\n", verb);
        fi_wire_free(&r);
    }
    return r;
}

static int s_bundle(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy bundle [--version N] --out FILE [--content] [--config FILE]\n\n"
               "Fetches version N (default: the active one) from the coordinator and writes its\n"
               "signed bundle to FILE; with --content, the policy text instead.\n" S_CONF_HELP
               "\nOffline: fedctl policy bundle --store DB [--version N] --out FILE [--content]\n");
        return 0;
    }
    static const char *const names[] = {"--version=", "--out=", "--content", "--config=", NULL};
    s_args a;
    if (s_parse("policy bundle", argc, argv, names, &a)) return 2;
    uint64_t v = 0; /* 0: the active version */
    if (a.val[0] && fi_policy_cmd_version(a.val[0], &v) != 0) {
        fprintf(stderr, "fedctl policy bundle: --version wants a whole number >= 1, not '%s'\n", a.val[0]);
        return 2;
    }
    if (a.n_pos || !a.val[1]) {
        fprintf(stderr, "usage: fedctl policy bundle [--version N] --out FILE [--content] [--config FILE]\n");
        return 2;
    }
    fi_client *c = fi_ctl_connect("policy bundle", a.val[3]);
    if (!c) return 1;
    fi_msg *r = s_get("policy bundle", c, v, !a.flag[2]);
    fi_client_destroy(&c);
    if (!r) return 1;
    const Fi__PolicyContent *pc = r->policy_content;
    const void *data = a.flag[2] ? (const void *)pc->content : (const void *)pc->bundle.data;
    size_t n = a.flag[2] ? strlen(pc->content) : pc->bundle.len;
    FILE *f = fopen(a.val[1], "wb");
    int rc = 0;
    if (!f || fwrite(data, 1, n, f) != n || fclose(f)) {
        fprintf(stderr, "fedctl policy bundle: cannot write %s: %s\n", a.val[1], strerror(errno));
        rc = 1;
    } else {
        printf("version %llu %s written to %s\n", (unsigned long long)pc->info->version,
               a.flag[2] ? "content" : "bundle", a.val[1]);
    }
    fi_wire_free(&r);
    return rc;
}

/* The coordinator's audit records matching q, page by page: fn is called
 * for each. 0, or 1 when refused (printed). */
static int s_audit_pages(const char *verb, fi_client *c, Fi__AuditQuery *q, int (*fn)(const fi_audit_record *, void *),
                         void *arg) {
    for (;;) {
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_AUDIT_QUERY;
        m.audit_query = q;
        fi_msg *r = fi_ctl_call(verb, c, &m, FI__ENVELOPE__BODY_AUDIT_RECORDS, NULL);
        if (!r) return 1;
        const Fi__AuditRecords *ar = r->audit_records;
        for (size_t i = 0; i < ar->n_records; i++) {
            const Fi__AuditRecord *x = ar->records[i];
            fi_audit_record rec;
            memset(&rec, 0, sizeof rec);
            rec.seq = (int64_t)x->seq;
            rec.time = x->time_ms;
            rec.request_id = x->request_id;
            rec.tenant = x->tenant;
            rec.application = x->application;
            rec.origin = x->origin;
            rec.labels = x->labels;
            rec.model = x->model;
            rec.latency_ms = x->latency_ms;
            rec.prompt_tokens = x->prompt_tokens;
            rec.decision = x->decision;
            rec.target = x->target;
            rec.rules = x->rules;
            rec.policy_digest = x->policy_digest;
            snprintf(rec.hash, sizeof rec.hash, "%s", x->hash);
            rec.source = x->source;
            rec.source_seq = (int64_t)x->source_seq;
            snprintf(rec.source_hash, sizeof rec.source_hash, "%s", x->source_hash ? x->source_hash : "");
            rec.received = x->received_ms;
            if (fn(&rec, arg)) {
                fi_wire_free(&r);
                return 0;
            }
        }
        int more = ar->more && ar->n_records;
        if (more) q->after_seq = ar->records[ar->n_records - 1]->seq;
        fi_wire_free(&r);
        if (!more) return 0;
    }
}

static int s_diff(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy diff FILE [--since T] [--until T] [--config FILE]\n\n"
               "Before applying FILE: fetches the active policy from the coordinator and lists\n"
               "the flows FILE opens or closes (every label set, origin site and target of\n"
               "both), then replays the coordinator's audited requests of the period\n"
               "[--since, --until) (default: the last 24 hours) under FILE and lists the\n"
               "decisions that would change. Times: YYYY-MM-DD, YYYY-MM-DDTHH:MM:SSZ or Unix\n"
               "seconds.\n" S_CONF_HELP
               "\nOffline: fedctl policy diff FILE (--active ACTIVE | --store DB) [--audit DB ...]\n");
        return 0;
    }
    static const char *const names[] = {"--since=", "--until=", "--config=", NULL};
    s_args a;
    if (s_parse("policy diff", argc, argv, names, &a)) return 2;
    if (a.n_pos != 1) {
        fprintf(stderr, "usage: fedctl policy diff FILE [--since T] [--until T] [--config FILE]\n");
        return 2;
    }
    int64_t t0 = (int64_t)time(NULL) - 86400, t1 = 0;
    if (fi_policy_cmd_time_opt("policy diff", "--since", a.val[0], &t0) ||
        fi_policy_cmd_time_opt("policy diff", "--until", a.val[1], &t1))
        return 2;
    const char *file = a.pos[0];
    fi_diags *d = fi_diags_new();
    fi_policy *np = d ? fi_policy_load(file, d) : NULL, *op = NULL;
    if (d && !np) {
        fi_diags_print(d, file, stderr);
        fprintf(stderr, "%s: %zu error(s); the policy cannot be used\n", file, fi_diags_errors(d));
    }
    fi_diags_destroy(&d);
    if (!np) return 1;
    int rc = 1;
    fi_client *c = fi_ctl_connect("policy diff", a.val[2]);
    fi_msg *r = c ? s_get("policy diff", c, 0, false) : NULL;
    char active[128];
    if (r) {
        snprintf(active, sizeof active, "version %llu at the coordinator",
                 (unsigned long long)r->policy_content->info->version);
        d = fi_diags_new();
        const char *text = r->policy_content->content;
        op = d ? fi_policy_parse(text, strlen(text), d) : NULL;
        if (d && !op) fi_diags_print(d, active, stderr);
        fi_diags_destroy(&d);
        if (!op) fprintf(stderr, "fedctl policy diff: the active policy does not validate here\n");
    }
    fi_wire_free(&r);
    if (!op || fi_policy_diff_flows(op, active, np, file) != 0) goto done;
    char since[32], until[32] = "now";
    fi_fmt_utc(t0, since, sizeof since);
    if (t1) fi_fmt_utc(t1, until, sizeof until);
    printf("\nreplay of the coordinator's audited requests from %s until %s under %s:\n", since, until, file);
    fi_policy_replay rp = {np, 0, 0};
    Fi__AuditQuery q = FI__AUDIT_QUERY__INIT;
    q.since_ms = t0 * 1000;
    q.until_ms = t1 * 1000;
    if (s_audit_pages("policy diff", c, &q, fi_policy_replay_record, &rp) != 0) goto done;
    printf("%zu audited request(s) replayed, %zu decision(s) would change\n", rp.seen, rp.changed);
    rc = 0;
done:
    fi_client_destroy(&c);
    fi_policy_destroy(&np);
    fi_policy_destroy(&op);
    return rc;
}

/* Verbs that go to the coordinator unless given one of the offline
 * options. */
typedef struct s_remote {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *offline[3]; /* options that select policy/'s offline mode */
} s_remote;

static const s_remote s_policy_verbs[] = {
    {"apply", s_apply, {"--store", "--key", NULL}},
    {"history", s_history, {"--store", NULL, NULL}},
    {"rollback", s_rollback, {"--store", "--key", NULL}},
    {"diff", s_diff, {"--store", "--active", "--audit"}},
    {"bundle", s_bundle, {"--store", NULL, NULL}},
};

int fi_ctl_policy(int argc, char **argv) {
    if (argc >= 2) {
        for (size_t i = 0; i < sizeof s_policy_verbs / sizeof s_policy_verbs[0]; i++) {
            const s_remote *v = &s_policy_verbs[i];
            if (strcmp(argv[1], v->name)) continue;
            bool offline = false;
            for (int k = 0; k < 3 && v->offline[k]; k++) offline = offline || s_has(argc - 1, argv + 1, v->offline[k]);
            if (!offline) return v->fn(argc - 1, argv + 1);
        }
    }
    return fi_cmd_policy(argc, argv);
}

/* --- audit ----------------------------------------------------------------- */


static int s_audit_verify(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl audit verify [--head HASH | --head SEQ:HASH] [--config FILE]\n\n"
               "Asks the coordinator to walk the hash chain of its audit log; exit status 1\n"
               "when a record was removed, edited or reordered, or when a record an edge was\n"
               "told as the log's head (its witness) is gone or changed: records cut off the\n"
               "end. Prints the record count, the head hash, the number of edge witnesses and\n"
               "a checkpoint SEQ:HASH to keep elsewhere; with --head HASH, also fails when the\n"
               "head differs from HASH (records cut off the end); with --head SEQ:HASH, when\n"
               "record SEQ is gone or no longer has HASH (a log that has grown since passes).\n"
               S_CONF_HELP
               "\nOffline: fedctl audit verify --db DB [--head HASH | --head SEQ:HASH]\n");
        return 0;
    }
    static const char *const names[] = {"--head=", "--config=", NULL};
    s_args a;
    if (s_parse("audit verify", argc, argv, names, &a)) return 2;
    if (a.n_pos) {
        fprintf(stderr, "usage: fedctl audit verify [--head HASH | --head SEQ:HASH] [--config FILE]\n");
        return 2;
    }
    fi_client *c = fi_ctl_connect("audit verify", a.val[1]);
    if (!c) return 1;
    Fi__AuditVerifyRequest vq = FI__AUDIT_VERIFY_REQUEST__INIT;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST;
    m.audit_verify_request = &vq;
    fi_msg *r = fi_ctl_call_wait("audit verify", c, &m, FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY, NULL,
                                 FI_CTL_VERIFY_WAIT_MS);
    if (!r) {
        fi_client_destroy(&c);
        return 1;
    }
    const Fi__AuditVerifyReply *v = r->audit_verify_reply;
    fi_audit_point pt;
    int at = a.val[0] && fi_audit_point_parse(a.val[0], &pt) == 0;
    int rc = 0;
    char why[300];
    if (v->intact && at) { /* record SEQ, as the coordinator holds it now */
        Fi__AuditQuery q = FI__AUDIT_QUERY__INIT;
        q.after_seq = (uint64_t)pt.seq - 1;
        if (s_audit_pages("audit verify", c, &q, fi_audit_point_row, &pt) != 0) {
            fi_wire_free(&r);
            fi_client_destroy(&c);
            return 1;
        }
    }
    fi_client_destroy(&c);
    if (!v->intact) {
        printf("coordinator audit log: BROKEN: %s\n", v->what);
        rc = 1;
    } else if (at && fi_audit_point_check(&pt, (int64_t)v->records, why, sizeof why)) {
        printf("coordinator audit log: chain intact over %llu records but %s\n", (unsigned long long)v->records, why);
        rc = 1;
    } else if (a.val[0] && !at && strcmp(a.val[0], v->head)) {
        printf("coordinator audit log: chain intact over %llu records but its head %s differs from the expected %s "
               "(records cut off?)\n",
               (unsigned long long)v->records, v->head, a.val[0]);
        rc = 1;
    } else {
        printf("coordinator audit log: intact: %llu records, head %s; witnessed by %llu edge(s), every one "
               "holds\n",
               (unsigned long long)v->records, v->head[0] ? v->head : "(empty)", (unsigned long long)v->witnesses);
        if (v->records) printf("checkpoint %llu:%s\n", (unsigned long long)v->records, v->head);
    }
    fi_wire_free(&r);
    return rc;
}

int fi_ctl_audit(int argc, char **argv) {
    if (s_has(argc, argv, "--db")) return fi_cmd_audit(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "witnesses")) {
        if (s_help(argc - 1, argv + 1)) return fi_cmd_audit(argc, argv);
        fprintf(stderr, "fedctl audit witnesses: works on the coordinator's audit file: --db DB (on its host)\n");
        return 2;
    }
    if (argc >= 2 && !strcmp(argv[1], "verify")) return s_audit_verify(argc - 1, argv + 1);
    if (s_help(argc, argv)) {
        printf("usage: fedctl audit [--since T] [--until T] [--site SITE] [--label L] [--target T]\n"
               "                    [--decision permit|deny|fallback] [--request ID] [--rule ID]\n"
               "                    [--limit N] [--config FILE]\n"
               "       fedctl audit verify [--head HASH | --head SEQ:HASH] [--config FILE]\n\n"
               "Lists the decisions recorded in the coordinator's audit log (the records the\n"
               "edges uploaded), oldest first; with --limit, the newest N. --origin is --site.\n"
               "Times: YYYY-MM-DD, YYYY-MM-DDTHH:MM:SSZ or Unix seconds.\n" S_CONF_HELP
               "\nOffline (an edge's or a copied log file): fedctl audit --db DB [filters],\n"
               "fedctl audit verify --db DB [--head HASH]; on the coordinator's host, its\n"
               "log's witnesses: fedctl audit witnesses --db DB [--forget WHO | --forget-all]\n");
        return 0;
    }
    static const char *const names[] = {"--since=",   "--until=",   "--site|--origin=", "--label=", "--target=",
                                        "--decision=", "--request=", "--rule=",           "--limit=", "--config=",
                                        NULL};
    s_args a;
    if (s_parse("audit", argc, argv, names, &a)) return 2;
    if (a.n_pos) {
        fprintf(stderr, "fedctl audit: unexpected argument '%.64s' (filters are options: see --help)\n",
                a.pos[0]);
        return 2;
    }
    int64_t t0 = 0, t1 = 0;
    uint64_t lim = 0;
    if (fi_policy_cmd_time_opt("audit", "--since", a.val[0], &t0) ||
        fi_policy_cmd_time_opt("audit", "--until", a.val[1], &t1) ||
        fi_policy_cmd_limit("audit", a.val[8], FI_POLICY_CMD_LIMIT_MAX, &lim))
        return 2;
    for (int i = 2; i <= 7; i++)
        if (a.val[i] && strlen(a.val[i]) > FI_WIRE_MAX_FILTER) {
            fprintf(stderr, "fedctl audit: a filter is longer than %d bytes\n", FI_WIRE_MAX_FILTER);
            return 2;
        }
    Fi__AuditQuery q = FI__AUDIT_QUERY__INIT;
    q.since_ms = t0 * 1000;
    q.until_ms = t1 * 1000;
    q.site = (char *)(a.val[2] ? a.val[2] : "");
    q.label = (char *)(a.val[3] ? a.val[3] : "");
    q.target = (char *)(a.val[4] ? a.val[4] : "");
    q.decision = (char *)(a.val[5] ? a.val[5] : "");
    q.request_id = (char *)(a.val[6] ? a.val[6] : "");
    q.rule = (char *)(a.val[7] ? a.val[7] : "");
    q.limit = (uint32_t)lim;
    fi_client *c = fi_ctl_connect("audit", a.val[9]);
    if (!c) return 1;
    printf("%-6s %-24s %-14s %-16s %-20s %-8s %-16s %s\n", "seq", "time", "request", "origin", "labels", "decision",
           "target", "rules");
    int rc = s_audit_pages("audit", c, &q, fi_audit_print_row, NULL);
    fi_client_destroy(&c);
    return rc;
}
