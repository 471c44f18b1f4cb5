/*
 * test_pshipping.c - policy shipping and auditing through the coordinator
 * (issue 4 over the fabric of issue 3), on loopback with a real
 * coordinator process (fi_fabric_peer coordinator, so that it can be
 * killed with SIGKILL):
 *
 *   operator applies a policy -> history shows it with the operator's key
 *   fingerprint and comment -> a connected edge receives the pushed bundle
 *   and fi_bundle verification accepts it -> a second apply is version 2
 *   -> rollback 1 makes version 3 with version 1's content -> an edge key
 *   sending PolicyApply is refused -> an invalid policy is refused with the
 *   checker's message -> audit uploads (re-sent, with a gap, tampered) ->
 *   `fedctl audit` and `fedctl audit verify` -> `fedctl policy diff`
 *   against the active policy and the audited requests -> a new edge gets
 *   the active bundle on Hello -> kill -9 and restart keep versions and
 *   audit -> a row edited in the coordinator's audit database is found by
 *   `fedctl audit verify`.
 *
 * fedctl is found through $FEDCTL; the coordinator through FI_FABRIC_PEER
 * (tests/pshipping.cmake).
 */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <sodium.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <cmocka.h>

#include "fabric/harness.h"
#include "fi_bundle.h"
#include "net_ports.h"

extern char **environ;

static const char *P1 =
    "labels public, phi;\n"
    "jurisdiction EU;\n"
    "region eu-central in EU;\n"
    "site berlin-clinic in eu-central;\n"
    "cluster fra-gpu-1 in eu-central { cost = 3; }\n"
    "permit \"public anywhere\" when request.labels <= [\"public\"];\n"
    "permit \"phi on site\" when \"phi\" in request.labels and target == request.origin.site;\n";

static const char *P2 =
    "labels public, phi;\n"
    "jurisdiction EU;\n"
    "region eu-central in EU;\n"
    "site berlin-clinic in eu-central;\n"
    "cluster fra-gpu-1 in eu-central { cost = 3; }\n"
    "permit \"public anywhere\" when request.labels <= [\"public\"];\n"
    "permit \"phi in the EU\" when target within \"EU\";\n"
    "prefer \"cheap\" score 5 when target.cost < 5;\n"; /* a warning: cost is absent on sites */

typedef struct fx {
    harness h;                          /* directory, keys, database path */
    pid_t coord;                        /* coordinator process */
    fi_keypair edge;                    /* an edge at berlin-clinic (uploads, refusals) */
    fi_keypair listener;                /* another edge there, receiving pushed bundles */
    uint8_t trusted[1][FI_BUNDLE_PK_BYTES]; /* the policy-signing public key */
    char conf[320];                     /* coordinator configuration */
    char ctl[320];                      /* fedctl configuration */
    char audit_db[320];                 /* the coordinator's audit log */
    char out[65536];                    /* last fedctl output */
} fx;

static int s_write(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

static pid_t s_start_coord(fx *f) {
    char log[320];
    snprintf(log, sizeof log, "%s/coord.log", f->h.dir);
    char *argv[] = {(char *)FI_FABRIC_PEER, (char *)"coordinator", (char *)"--config", f->conf, NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    pid_t pid = 0;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    return rc ? -1 : pid;
}

static void s_kill(pid_t *pid) {
    if (*pid <= 0) return;
    kill(*pid, SIGKILL);
    waitpid(*pid, NULL, 0);
    *pid = 0;
}

/* Runs "fedctl ARGS --config CTL"; output (stdout and stderr) in f->out. */
static int s_fedctl(fx *f, const char *fmt, ...) {
    const char *bin = getenv("FEDCTL");
    if (!bin || access(bin, X_OK)) fail_msg("FEDCTL is not set to the fedctl binary");
    char args[2048], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s --config '%s' 2>&1", f->h.dir, bin, args, f->ctl);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(f->out, 1, sizeof f->out - 1, p);
    f->out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void s_has(const fx *f, const char *needle) {
    if (!strstr(f->out, needle)) fail_msg("expected \"%s\" in:\n%s", needle, f->out);
}

static size_t s_count(const char *hay, const char *needle) {
    size_t n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

static int setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    if (!f || h_init(&f->h)) return -1;
    char sec[320], pub[320], osec[320], opub[320], key[340], err[256], text[2048], hex[65];
    snprintf(sec, sizeof sec, "%s/coord.key", f->h.dir);
    snprintf(pub, sizeof pub, "%s/coord.pub", f->h.dir);
    snprintf(osec, sizeof osec, "%s/op.key", f->h.dir);
    snprintf(opub, sizeof opub, "%s/op.pub", f->h.dir);
    if (fi_keys_save(&f->h.coord, sec, pub, 0, err, sizeof err) ||
        fi_keys_save(&f->h.op, osec, opub, 0, err, sizeof err))
        return -1;
    if (fi_keys_generate(&f->edge) || fi_keys_generate(&f->listener) ||
        h_enrol_direct(&f->h, &f->edge, FI__ROLE__ROLE_EDGE, "berlin-clinic", "eu-central") ||
        h_enrol_direct(&f->h, &f->listener, FI__ROLE__ROLE_EDGE, "berlin-clinic", "eu-central"))
        return -1;
    /* What --init does: the policy-signing key next to the database. */
    int created = 0;
    fi_ship_paths(f->h.db, NULL, NULL, key, sizeof key, f->audit_db, sizeof f->audit_db);
    if (fi_ship_keygen(key, hex, &created, err, sizeof err) || !created) return -1;
    size_t got = 0;
    if (sodium_hex2bin(f->trusted[0], FI_BUNDLE_PK_BYTES, hex, 64, NULL, &got, NULL) || got != 32) return -1;
    int port = fi_test_free_ports(2); /* below the ephemeral range: no TCP self-connect */
    if (port <= 0) return -1;
    snprintf(f->h.ep, sizeof f->h.ep, "tcp://127.0.0.1:%d", port);
    snprintf(f->h.enrol_ep, sizeof f->h.enrol_ep, "tcp://127.0.0.1:%d", port + 1);
    snprintf(text, sizeof text,
             "db = %s\nsecret_key = %s\nbind = %s\nenrol_bind = %s\nheartbeat_ms = %d\nliveness = %d\n"
             "handshake_ms = 500\n",
             f->h.db, sec, f->h.ep, f->h.enrol_ep, H_HB_MS, H_LIVENESS);
    snprintf(f->conf, sizeof f->conf, "%s/coord.conf", f->h.dir);
    if (s_write(f->conf, text)) return -1;
    snprintf(text, sizeof text, "coordinator = %s\ncoordinator_key = %s\nsecret_key = %s\n", f->h.ep, pub, osec);
    snprintf(f->ctl, sizeof f->ctl, "%s/ctl.conf", f->h.dir);
    if (s_write(f->ctl, text)) return -1;
    snprintf(text, sizeof text, "%s/p1.policy", f->h.dir);
    if (s_write(text, P1)) return -1;
    snprintf(text, sizeof text, "%s/p2.policy", f->h.dir);
    if (s_write(text, P2)) return -1;
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fx *f = *state;
    s_kill(&f->coord);
    if (getenv("FI_TEST_DEBUG")) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "cat '%s/coord.log' >&2", f->h.dir);
        if (system(cmd)) { /* log only */
        }
    }
    h_stop(&f->h);
    free(f);
    return 0;
}

/* The operator's connection to the coordinator just started (it may take
 * a few tries while the process binds). */
static fi_client *s_operator(fx *f) {
    fi_client *op = NULL;
    for (int i = 0; i < 50 && !op; i++) {
        op = h_client(&f->h, &f->h.op, FI__ROLE__ROLE_OPERATOR);
        if (!op) h_sleep_ms(100);
    }
    assert_non_null(op);
    return op;
}

/* Sends m from c and waits for want (or an Error); the reply. */
static fi_msg *s_call(fi_client *c, fi_msg_type body, void *msg, fi_msg_type want) {
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = body;
    /* Every body is a pointer in the same union. */
    m.hello = msg;
    fi_msg *r = NULL;
    char err[256];
    int rc = fi_client_call(c, &m, want, 5000, &r, err, sizeof err);
    if (rc != 1) fail_msg("no reply to %s: %s", fi_wire_type_name(body), err);
    return r;
}

static fi_msg *s_apply(fi_client *op, const char *content, const char *comment) {
    Fi__PolicyApply pa = FI__POLICY_APPLY__INIT;
    pa.content = (char *)content;
    pa.comment = (char *)comment;
    return s_call(op, FI__ENVELOPE__BODY_POLICY_APPLY, &pa, FI__ENVELOPE__BODY_POLICY_REPLY);
}

/* An edge on a thread of its own, so that its heartbeats go on while the
 * test waits for fedctl processes: verifies and installs every pushed
 * bundle as an edge does, and counts them. */
typedef struct s_listener {
    fx *f;                     /* the fixture */
    uint64_t held;             /* said in Hello */
    pthread_t th;
    atomic_int stop;           /* ends the thread */
    atomic_int ready;          /* connected */
    atomic_uint_fast64_t last; /* version of the last bundle installed */
    atomic_int bundles;        /* bundles received */
    atomic_int refused;        /* bundles that did not verify or install */
} s_listener;

static void *s_listener_main(void *arg) {
    s_listener *l = arg;
    fx *f = l->f;
    fi_client_opts o;
    char err[512], dir[320];
    static atomic_int n_dirs;
    snprintf(dir, sizeof dir, "%s/edge-%d", f->h.dir, atomic_fetch_add(&n_dirs, 1)); /* its own kept bundle */
    mkdir(dir, 0700);
    h_client_opts(&f->h, &o, &f->listener, FI__ROLE__ROLE_EDGE);
    o.policy_version = l->held;
    fi_client *c = fi_client_new(&o, err, sizeof err);
    if (!c) return NULL;
    if (fi_client_wait_ready(c, 3000, err, sizeof err) == 0) atomic_store(&l->ready, 1);
    while (!atomic_load(&l->stop)) {
        fi_msg *m = NULL;
        if (fi_client_recv(c, 50, &m, err, sizeof err) == 1 && m->body_case == FI__ENVELOPE__BODY_POLICY_BUNDLE) {
            const Fi__PolicyBundle *pb = m->policy_bundle;
            fi_bundle_info info;
            atomic_fetch_add(&l->bundles, 1);
            if (fi_bundle_verify((const char *)pb->bundle.data, pb->bundle.len,
                                 (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->trusted, 1, 0, time(NULL),
                                 &info) != FI_BUNDLE_OK ||
                info.version != pb->version ||
                fi_bundle_install(dir, (const char *)pb->bundle.data, pb->bundle.len,
                                  (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->trusted, 1, time(NULL), err,
                                  sizeof err) != FI_BUNDLE_OK) {
                fprintf(stderr, "listener: bundle %llu refused: %s\n", (unsigned long long)pb->version, err);
                atomic_fetch_add(&l->refused, 1);
            } else {
                atomic_store(&l->last, pb->version);
            }
        }
        fi_wire_free(&m);
    }
    fi_client_destroy(&c);
    return NULL;
}

static void s_listener_start(fx *f, s_listener *l, uint64_t held) {
    memset(l, 0, sizeof *l);
    l->f = f;
    l->held = held;
    assert_int_equal(pthread_create(&l->th, NULL, s_listener_main, l), 0);
    for (int i = 0; i < 300 && !atomic_load(&l->ready); i++) h_sleep_ms(10);
    assert_true(atomic_load(&l->ready));
}

static void s_listener_stop(s_listener *l) {
    atomic_store(&l->stop, 1);
    pthread_join(l->th, NULL);
}

/* Waits until the listener has installed version want (or ms pass). */
static uint64_t s_bundle_at_edge(s_listener *l, uint64_t want, int ms) {
    uint64_t t0 = fi_wire_now_ms();
    while (atomic_load(&l->last) != want && fi_wire_now_ms() - t0 < (uint64_t)ms) h_sleep_ms(10);
    assert_int_equal(atomic_load(&l->refused), 0);
    return atomic_load(&l->last);
}

static fi_msg *s_upload(fi_client *edge, const char *id, int64_t first, uint64_t count, const char *batch) {
    Fi__AuditUpload au = FI__AUDIT_UPLOAD__INIT;
    au.batch_id = (char *)id;
    au.first_seq = (uint64_t)first;
    au.count = count;
    au.batch.data = (uint8_t *)batch;
    au.batch.len = strlen(batch);
    return s_call(edge, FI__ENVELOPE__BODY_AUDIT_UPLOAD, &au, FI__ENVELOPE__BODY_ACK);
}

/* batch with provenance members put into each record, as an uploader
 * might claim them (malloc'd): the coordinator must not believe them. */
static char *s_forge_provenance(const char *batch) {
    static const char add[] = "\"source\":\"forged-src\",\"source_seq\":77,\"received\":5,\"source_hash\":"
                              "\"0000000000000000000000000000000000000000000000000000000000000000\",";
    size_t n = strlen(batch), k = 0;
    char *out = malloc(n * 4 + 1);
    assert_non_null(out);
    for (const char *p = batch; *p; p++) {
        out[k++] = *p;
        if (*p == '{') {
            memcpy(out + k, add, sizeof add - 1);
            k += sizeof add - 1;
        }
    }
    out[k] = '\0';
    return out;
}

static void test_ship_and_audit(void **state) {
    fx *f = *state;
    char opfpr[FI_KEYS_FPR_LEN], d1[65];
    fi_keys_fingerprint(f->h.op.pub, opfpr);
    assert_true((f->coord = s_start_coord(f)) > 0);
    fi_client *op = s_operator(f), *edge = NULL;
    edge = h_client(&f->h, &f->edge, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    s_listener lis;
    s_listener_start(f, &lis, 0);

    /* Version 1: stored, signed, pushed to the connected edges. */
    fi_msg *r = s_apply(op, P1, "first policy");
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->policy_reply->version, 1);
    assert_true(r->policy_reply->pushed >= 1);
    assert_int_equal(strlen(r->policy_reply->digest), 64);
    snprintf(d1, sizeof d1, "%s", r->policy_reply->digest);
    assert_true(r->policy_reply->not_after > r->policy_reply->not_before);
    fi_wire_free(&r);
    assert_int_equal(s_bundle_at_edge(&lis, 1, 3000), 1);

    /* History: author is the operator's key fingerprint, with the comment. */
    Fi__PolicyHistoryRequest hq = FI__POLICY_HISTORY_REQUEST__INIT;
    r = s_call(op, FI__ENVELOPE__BODY_POLICY_HISTORY_REQUEST, &hq, FI__ENVELOPE__BODY_POLICY_HISTORY_REPLY);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_HISTORY_REPLY);
    assert_int_equal(r->policy_history_reply->n_versions, 1);
    assert_string_equal(r->policy_history_reply->versions[0]->author, opfpr);
    assert_string_equal(r->policy_history_reply->versions[0]->comment, "first policy");
    assert_string_equal(r->policy_history_reply->versions[0]->digest, d1);
    fi_wire_free(&r);

    /* Version 2, with the checker's warning returned. */
    r = s_apply(op, P2, "open phi to the EU");
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->policy_reply->version, 2);
    assert_true(r->policy_reply->n_warnings >= 1);
    fi_wire_free(&r);
    assert_int_equal(s_bundle_at_edge(&lis, 2, 3000), 2);

    /* Rollback to 1: version 3 with version 1's content. */
    Fi__PolicyRollback rb = FI__POLICY_ROLLBACK__INIT;
    rb.version = 1;
    rb.comment = (char *)"too wide";
    r = s_call(op, FI__ENVELOPE__BODY_POLICY_ROLLBACK, &rb, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->policy_reply->version, 3);
    assert_int_equal(r->policy_reply->rollback_of, 1);
    assert_string_equal(r->policy_reply->digest, d1);
    fi_wire_free(&r);
    assert_int_equal(s_bundle_at_edge(&lis, 3, 3000), 3);
    Fi__PolicyGet pg = FI__POLICY_GET__INIT;
    r = s_call(op, FI__ENVELOPE__BODY_POLICY_GET, &pg, FI__ENVELOPE__BODY_POLICY_CONTENT);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_CONTENT);
    assert_int_equal(r->policy_content->info->version, 3);
    assert_string_equal(r->policy_content->content, P1);
    fi_wire_free(&r);
    rb.version = 99;
    r = s_call(op, FI__ENVELOPE__BODY_POLICY_ROLLBACK, &rb, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, FI__ERROR_CODE__ERR_NOT_FOUND);
    fi_wire_free(&r);

    /* An edge's key may not apply, read or roll back policy. */
    r = s_apply(edge, P2, "edge says so");
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, FI__ERROR_CODE__ERR_UNAUTHORISED);
    fi_wire_free(&r);
    Fi__AuditVerifyRequest avq = FI__AUDIT_VERIFY_REQUEST__INIT;
    r = s_call(edge, FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST, &avq, FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, FI__ERROR_CODE__ERR_UNAUTHORISED);
    fi_wire_free(&r);

    /* An invalid policy is refused with the checker's message; nothing stored. */
    r = s_apply(op, "labels public;\npermit \"x\" when \"secret\" in request.labels;\n", "bad");
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, FI__ERROR_CODE__ERR_BAD_REQUEST);
    if (!strstr(r->error->message, "policy refused") || !strstr(r->error->message, "policy:2:") ||
        !strstr(r->error->message, "secret"))
        fail_msg("refusal without the checker's message: %s", r->error->message);
    fi_wire_free(&r);

    /* Audit uploads: 1..3, the same again (taken once), 4..5 chained on. */
    char h3[65], h5[65];
    char *b13 = h_audit_batch("berlin-clinic", 1, 3, "", h3);
    char *b45 = h_audit_batch("berlin-clinic", 4, 2, h3, h5);
    assert_non_null(b13);
    assert_non_null(b45);
    /* the first upload claims provenance of its own: taken, and ignored */
    char *forged = s_forge_provenance(b13);
    r = s_upload(edge, "a1-3", 1, 3, forged);
    free(forged);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ACK);
    assert_string_equal(r->ack->ref, "a1-3");
    fi_wire_free(&r);
    r = s_upload(edge, "a1-3-again", 1, 3, b13);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ACK);
    fi_wire_free(&r);
    r = s_upload(edge, "a4-5", 4, 2, b45);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ACK);
    fi_wire_free(&r);
    /* A gap (7..8 after 5), a record edited in transit, another site's
     * records, and junk are refused. */
    char *b78 = h_audit_batch("berlin-clinic", 7, 2, h5, NULL);
    r = s_upload(edge, "a7-8", 7, 2, b78);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_non_null(strstr(r->error->message, "never received"));
    fi_wire_free(&r);
    free(b78);
    char *b6 = h_audit_batch("berlin-clinic", 6, 1, h5, NULL);
    char *t = strstr(b6, "\"permit\"");
    assert_non_null(t);
    memcpy(t, "\"denyit\"", 8);
    r = s_upload(edge, "a6", 6, 1, b6);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, FI__ERROR_CODE__ERR_BAD_REQUEST);
    fi_wire_free(&r);
    free(b6);
    char *other = h_audit_batch("paris-clinic", 6, 1, h5, NULL);
    r = s_upload(edge, "a6b", 6, 1, other);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_non_null(strstr(r->error->message, "origin"));
    fi_wire_free(&r);
    free(other);
    r = s_upload(edge, "junk", 1, 1, "{not json");
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    fi_wire_free(&r);
    /* An operator may not upload audit records. */
    r = s_upload(op, "op", 1, 3, b13);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, FI__ERROR_CODE__ERR_UNAUTHORISED);
    fi_wire_free(&r);
    free(b13);

    /* The console, over the fabric. */
    assert_int_equal(s_fedctl(f, "audit"), 0);
    for (int i = 1; i <= 5; i++) {
        char id[32];
        snprintf(id, sizeof id, "req-%d ", i);
        if (s_count(f->out, id) != 1) fail_msg("%s not exactly once in:\n%s", id, f->out);
    }
    {
        /* each record's provenance: the edge's key, its number there, its
         * hash there (h5 for its record 5), from the authenticated
         * connection, never from the batch */
        char edgefpr[FI_KEYS_FPR_LEN], want[200];
        fi_keys_fingerprint(f->edge.pub, edgefpr);
        assert_int_equal(s_count(f->out, edgefpr), 5);
        snprintf(want, sizeof want, "from %s #5 %s received ", edgefpr, h5);
        s_has(f, want);
        snprintf(want, sizeof want, "from %s #1 ", edgefpr);
        s_has(f, want);
        if (strstr(f->out, "forged-src") || strstr(f->out, "#77")) fail_msg("uploaded provenance shown:\n%s", f->out);
    }
    assert_int_equal(s_fedctl(f, "audit --request req-4"), 0);
    s_has(f, "req-4");
    if (strstr(f->out, "req-3")) fail_msg("--request let req-3 through:\n%s", f->out);
    assert_int_equal(s_fedctl(f, "audit --limit 2"), 0);
    if (strstr(f->out, "req-3 ") || !strstr(f->out, "req-5")) fail_msg("--limit 2:\n%s", f->out);
    assert_int_equal(s_fedctl(f, "audit --site paris-clinic"), 0);
    if (strstr(f->out, "req-")) fail_msg("--site filter:\n%s", f->out);
    assert_int_equal(s_fedctl(f, "audit verify"), 0);
    s_has(f, "intact: 5 records");
    {
        /* the checkpoint it prints holds; another hash at 5, or a record
         * the log does not hold, does not */
        char point[100], head5[70];
        const char *cp = strstr(f->out, "checkpoint ");
        assert_non_null(cp);
        assert_int_equal(sscanf(cp, "checkpoint %99s", point), 1);
        assert_int_equal(sscanf(point, "5:%69s", head5), 1);
        assert_int_equal(s_fedctl(f, "audit verify --head %s", point), 0);
        assert_int_equal(s_fedctl(f, "audit verify --head 6:%s", head5), 1);
        s_has(f, "record 6 of the checkpoint is gone");
        assert_int_equal(s_fedctl(f, "audit verify --head 5:%064d", 0), 1);
        s_has(f, "not the 0000");
    }
    assert_int_equal(s_fedctl(f, "policy history"), 0);
    s_has(f, opfpr);
    s_has(f, "rollback to version 1: too wide");
    assert_int_equal(s_fedctl(f, "policy diff p2.policy --since 2000-01-01"), 0);
    s_has(f, "compared with the active version 3 at the coordinator");
    s_has(f, "5 audited request(s) replayed");
    assert_int_equal(s_fedctl(f, "policy apply p2.policy -m 'from the console'"), 0);
    s_has(f, "as version 4");
    s_has(f, "pushed to ");
    assert_int_equal(s_bundle_at_edge(&lis, 4, 3000), 4);
    assert_int_equal(s_fedctl(f, "policy rollback 3 -m back"), 0);
    s_has(f, "as version 5");
    assert_int_equal(s_bundle_at_edge(&lis, 5, 3000), 5);

    /* A new connection (Hello) of an edge that holds nothing gets the
     * active bundle; one that says it holds version 5 is not sent it again. */
    s_listener_stop(&lis);
    s_listener_start(f, &lis, 0);
    assert_int_equal(s_bundle_at_edge(&lis, 5, 3000), 5);
    s_listener_stop(&lis);
    s_listener_start(f, &lis, 5);
    h_sleep_ms(500);
    assert_int_equal(atomic_load(&lis.bundles), 0);
    s_listener_stop(&lis);

    /* kill -9 and restart: versions and audit are kept. */
    fi_client_destroy(&op);
    fi_client_destroy(&edge);
    s_kill(&f->coord);
    assert_true((f->coord = s_start_coord(f)) > 0);
    int rc = 1;
    for (int i = 0; i < 50 && rc; i++) {
        rc = s_fedctl(f, "policy history");
        if (rc) h_sleep_ms(100);
    }
    assert_int_equal(rc, 0);
    s_has(f, "from the console");
    assert_int_equal(s_count(f->out, opfpr), 5);
    assert_int_equal(s_fedctl(f, "audit verify"), 0);
    s_has(f, "intact: 5 records");
    /* Re-uploading after the restart still takes nothing twice; a batch
     * whose records differ from those received is refused. */
    edge = h_client(&f->h, &f->edge, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    r = s_upload(edge, "a4-5-resent", 4, 2, b45);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ACK);
    fi_wire_free(&r);
    free(b45);
    char *rewritten = h_audit_batch("berlin-clinic", 4, 2, "", NULL);
    r = s_upload(edge, "a4-5-other", 4, 2, rewritten);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_non_null(strstr(r->error->message, "rewritten"));
    fi_wire_free(&r);
    free(rewritten);
    fi_client_destroy(&edge);
    assert_int_equal(s_fedctl(f, "audit verify"), 0);
    s_has(f, "intact: 5 records");

    /* Tampering with the coordinator's database (the test may; fedctl
     * never opens it) is found by fedctl audit verify. */
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(f->audit_db, &db), SQLITE_OK);
    sqlite3_busy_timeout(db, 5000);
    assert_int_equal(sqlite3_exec(db,
                                  "DROP TRIGGER audit_no_update;"
                                  "UPDATE audit SET target = 'fra-gpu-1' WHERE seq = 2;",
                                  NULL, NULL, NULL),
                     SQLITE_OK);
    sqlite3_close(db);
    assert_int_equal(s_fedctl(f, "audit verify"), 1);
    s_has(f, "BROKEN");
    s_has(f, "record 2 was edited");
}

/* A signed bundle an operator pushed with a version above the store's
 * numbering takes that version: later applies are numbered above it, so
 * the edges that hold it take them (they refuse older versions). */
static void test_pushed_version_taken(void **state) {
    fx *f = *state;
    assert_true((f->coord = s_start_coord(f)) > 0);
    fi_client *op = s_operator(f);
    s_listener lis;
    s_listener_start(f, &lis, 0);
    fi_msg *r = s_apply(op, P1, "first");
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->policy_reply->version, 1);
    fi_wire_free(&r);
    assert_int_equal(s_bundle_at_edge(&lis, 1, 3000), 1);
    /* version 10, signed with the policy-signing key and pushed */
    char key[340], audit[340], err[256];
    uint8_t sk[FI_BUNDLE_SK_BYTES];
    fi_ship_paths(f->h.db, NULL, NULL, key, sizeof key, audit, sizeof audit);
    assert_int_equal(fi_bundle_key_load(key, sk, err, sizeof err), 0);
    char *b = NULL;
    size_t bl = 0;
    int64_t now = (int64_t)time(NULL);
    assert_int_equal(fi_bundle_sign(sk, 10, now - 60, now + 3600, P2, strlen(P2), &b, &bl), 0);
    sodium_memzero(sk, sizeof sk);
    assert_int_equal(h_push_bundle(&f->h, 10, b, bl), 0);
    free(b);
    assert_int_equal(s_bundle_at_edge(&lis, 10, 3000), 10);
    /* the next apply and rollback come after it */
    r = s_apply(op, P1, "after the push");
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->policy_reply->version, 11);
    fi_wire_free(&r);
    assert_int_equal(s_bundle_at_edge(&lis, 11, 3000), 11);
    Fi__PolicyRollback rb = FI__POLICY_ROLLBACK__INIT;
    rb.version = 1;
    r = s_call(op, FI__ENVELOPE__BODY_POLICY_ROLLBACK, &rb, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->policy_reply->version, 12);
    fi_wire_free(&r);
    assert_int_equal(s_bundle_at_edge(&lis, 12, 3000), 12);
    /* a version outside the numbering is refused */
    b = NULL;
    assert_int_equal(fi_bundle_key_load(key, sk, err, sizeof err), 0);
    assert_int_equal(fi_bundle_sign(sk, 20, now - 60, now + 3600, P2, strlen(P2), &b, &bl), 0);
    assert_int_equal(h_push_bundle(&f->h, (uint64_t)INT64_MAX, b, bl), FI__ERROR_CODE__ERR_BAD_REQUEST);
    /* a pushed version stays taken across a restart */
    assert_int_equal(h_push_bundle(&f->h, 20, b, bl), 0);
    sodium_memzero(sk, sizeof sk);
    free(b);
    assert_int_equal(s_bundle_at_edge(&lis, 20, 3000), 20);
    s_kill(&f->coord);
    fi_client_destroy(&op);
    assert_true((f->coord = s_start_coord(f)) > 0);
    op = s_operator(f);
    r = s_apply(op, P2, "after a restart");
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_POLICY_REPLY);
    assert_int_equal(r->policy_reply->version, 21);
    fi_wire_free(&r);
    s_listener_stop(&lis);
    fi_client_destroy(&op);
}

static void test_help(void **state) {
    fx *f = *state;
    const char *verbs[] = {"policy apply", "policy history", "policy rollback", "policy diff", "policy bundle",
                           "audit", "audit verify"};
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++) {
        assert_int_equal(s_fedctl(f, "%s --help", verbs[i]), 0);
        s_has(f, "usage: fedctl");
        s_has(f, "--config FILE");
    }
    /* Usage errors are 2, before any connection. */
    assert_int_equal(s_fedctl(f, "policy apply p1.policy"), 2);
    assert_int_equal(s_fedctl(f, "policy rollback x"), 2);
    assert_int_equal(s_fedctl(f, "audit --bogus 1"), 2);
}

/* fi_audit_ingest on its own: overlap, re-send, gap, rewrite, origin. */
static int s_count_rec(const fi_audit_record *r, void *arg) {
    (void)r;
    (*(int *)arg)++;
    return 0;
}

static void s_records(fi_audit_record *r, int64_t first, size_t n, const char *site, const char *prev,
                      const char *decision) {
    for (size_t i = 0; i < n; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].seq = first + (int64_t)i;
        r[i].time = 1800000000000 + r[i].seq;
        r[i].request_id = "q";
        r[i].origin = site;
        r[i].labels = "public";
        r[i].latency_ms = -1;
        r[i].prompt_tokens = -1;
        r[i].decision = decision;
        r[i].target = site;
        fi_audit_chain_hash(i ? r[i - 1].hash : prev, &r[i], r[i].hash);
    }
}

/* The owner's adopt check, as the coordinator's: here edge-a's key was
 * replaced, and it was of site s1. */
static int s_may_adopt(void *user, const char *old_source, const char *origin) {
    (void)user;
    return !strcmp(old_source, "edge-a") && !strcmp(origin, "s1");
}

static void test_ingest(void **state) {
    fx *f = *state;
    char path[400], err[512];
    snprintf(path, sizeof path, "%s/ingest.db", f->h.dir);
    fi_audit *a = fi_audit_open(path, err, sizeof err);
    assert_non_null(a);
    fi_audit_record r[8], o[8];
    size_t taken = 0;
    s_records(r, 1, 6, "s1", "", "permit");
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", r, 3, &taken, err, sizeof err), 0);
    assert_int_equal(taken, 3);
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", r, 3, &taken, err, sizeof err), 0);
    assert_int_equal(taken, 0);
    /* overlapping 2..5: 4 and 5 are new */
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", r + 1, 4, &taken, err, sizeof err), 0);
    assert_int_equal(taken, 2);
    /* another source starts its own numbering at 1 */
    s_records(o, 1, 2, "s2", "", "deny");
    assert_int_equal(fi_audit_ingest(a, "edge-b", "s2", o, 2, &taken, err, sizeof err), 0);
    assert_int_equal(taken, 2);
    /* edge-a's record 6 held back; 7.. would be a gap */
    fi_audit_record g[2];
    s_records(g, 7, 2, "s1", r[5].hash, "permit");
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", g, 2, &taken, err, sizeof err), 1);
    assert_non_null(strstr(err, "never received"));
    /* a rewritten record 5 (same number, other content) */
    fi_audit_record w[2];
    s_records(w, 4, 2, "s1", r[2].hash, "deny");
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", w, 2, &taken, err, sizeof err), 1);
    /* a record of another site, and one not linked to the held head */
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s9", r + 5, 1, &taken, err, sizeof err), 1);
    fi_audit_record x[1];
    s_records(x, 6, 1, "s1", "", "permit");
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", x, 1, &taken, err, sizeof err), 1);
    /* not consecutive */
    fi_audit_record nc[2] = {r[0], r[2]};
    assert_int_equal(fi_audit_ingest(a, "edge-c", NULL, nc, 2, &taken, err, sizeof err), 1);
    /* the right record 6 */
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", r + 5, 1, &taken, err, sizeof err), 0);
    assert_int_equal(taken, 1);
    int64_t seq = 0;
    char head[65];
    assert_int_equal(fi_audit_source_head(a, "edge-a", &seq, head, err, sizeof err), 0);
    assert_int_equal(seq, 6);
    assert_string_equal(head, r[5].hash);
    /* edge-a's key is replaced: the new key (edge-a2) goes on with the
     * same local log from record 7, chained to the held head 6, once the
     * owner allows it; a log that goes on from nowhere is still a gap, and
     * another site's uploader cannot take edge-a's log over even with the
     * right chain (its records would need origin s1: refused either way) */
    assert_int_equal(fi_audit_ingest(a, "edge-a2", "s1", g, 2, &taken, err, sizeof err), 1);
    assert_non_null(strstr(err, "never received")); /* no adopt check: nothing taken over */
    fi_audit_set_adopt_check(a, s_may_adopt, NULL);
    fi_audit_record stray[1];
    s_records(stray, 7, 1, "s1", "", "permit");
    assert_int_equal(fi_audit_ingest(a, "edge-x", "s1", stray, 1, &taken, err, sizeof err), 1);
    assert_non_null(strstr(err, "never received"));
    fi_audit_record other[1];
    s_records(other, 7, 1, "s2", r[5].hash, "permit");
    assert_int_equal(fi_audit_ingest(a, "edge-b2", "s2", other, 1, &taken, err, sizeof err), 1);
    assert_int_equal(fi_audit_ingest(a, "edge-a2", "s1", g, 2, &taken, err, sizeof err), 0);
    assert_int_equal(taken, 2);
    assert_string_equal(err, "continues the log of source edge-a");
    assert_int_equal(fi_audit_source_head(a, "edge-a2", &seq, head, err, sizeof err), 0);
    assert_int_equal(seq, 8);
    assert_int_equal(fi_audit_source_head(a, "edge-a", &seq, head, err, sizeof err), 0);
    assert_int_equal(seq, 0); /* taken over */
    int n = 0;
    assert_int_equal(fi_audit_query(a, NULL, s_count_rec, &n, err, sizeof err), 0);
    assert_int_equal(n, 10);
    fi_audit_filter fl;
    memset(&fl, 0, sizeof fl);
    fl.after_seq = 6;
    n = 0;
    assert_int_equal(fi_audit_query(a, &fl, s_count_rec, &n, err, sizeof err), 0);
    assert_int_equal(n, 4);
    fi_audit_check ck;
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 0);
    assert_int_equal(ck.records, 10);
    fi_audit_destroy(&a);
}

/* A key replaced while its last batch's acknowledgement was lost: the
 * edge sends that batch again, under the new key, from its old mark. The
 * new key goes on from the record the old one's head is in the batch
 * (it was refused forever: "records 1..3 were never received"); a batch
 * whose record at that head differs is still refused. */
static void test_ingest_adopt_after_lost_ack(void **state) {
    fx *f = *state;
    char path[400], err[512];
    snprintf(path, sizeof path, "%s/ingest-ack.db", f->h.dir);
    fi_audit *a = fi_audit_open(path, err, sizeof err);
    assert_non_null(a);
    fi_audit_set_adopt_check(a, s_may_adopt, NULL);
    fi_audit_record r[8], w[5];
    size_t taken = 0;
    s_records(r, 1, 8, "s1", "", "permit");
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", r, 5, &taken, err, sizeof err), 0);
    assert_int_equal(taken, 5); /* its ack lost: the edge's mark stays at 3 */
    s_records(w, 4, 5, "s1", r[2].hash, "deny"); /* 4..8 rewritten */
    assert_int_equal(fi_audit_ingest(a, "edge-a2", "s1", w, 5, &taken, err, sizeof err), 1);
    assert_non_null(strstr(err, "never received"));
    if (fi_audit_ingest(a, "edge-a2", "s1", r + 3, 5, &taken, err, sizeof err) != 0)
        fail_msg("the new key's resent batch 4..8: %s", err);
    assert_int_equal(taken, 3);
    assert_string_equal(err, "continues the log of source edge-a");
    int64_t seq = 0;
    char head[65];
    assert_int_equal(fi_audit_source_head(a, "edge-a2", &seq, head, err, sizeof err), 0);
    assert_int_equal(seq, 8);
    assert_string_equal(head, r[7].hash);
    fi_audit_check ck;
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 0);
    assert_int_equal(ck.records, 8);
    fi_audit_destroy(&a);

    /* the batch sent again holds nothing new (no decision between the lost
     * acknowledgement and the new key): the new key still takes the head
     * over, and its next batch goes on from there (it lost both heads and
     * was refused for good) */
    snprintf(path, sizeof path, "%s/ingest-ack2.db", f->h.dir);
    a = fi_audit_open(path, err, sizeof err);
    assert_non_null(a);
    fi_audit_set_adopt_check(a, s_may_adopt, NULL);
    assert_int_equal(fi_audit_ingest(a, "edge-a", "s1", r, 5, &taken, err, sizeof err), 0);
    assert_int_equal(fi_audit_ingest(a, "edge-a2", "s1", r + 3, 2, &taken, err, sizeof err), 0);
    assert_int_equal(taken, 0);
    assert_string_equal(err, "continues the log of source edge-a");
    assert_int_equal(fi_audit_source_head(a, "edge-a2", &seq, head, err, sizeof err), 0);
    assert_int_equal(seq, 5);
    if (fi_audit_ingest(a, "edge-a2", "s1", r + 5, 3, &taken, err, sizeof err) != 0)
        fail_msg("the new key's next batch 6..8: %s", err);
    assert_int_equal(taken, 3);
    fi_audit_destroy(&a);
}

/* The new message types have names and pass the decoder; an unknown
 * field inside one is malformed. */
static void test_wire_types(void **state) {
    (void)state;
    static const struct {
        fi_msg_type t;
        const char *name;
    } types[] = {
        {FI__ENVELOPE__BODY_POLICY_APPLY, "policy_apply"},
        {FI__ENVELOPE__BODY_POLICY_REPLY, "policy_reply"},
        {FI__ENVELOPE__BODY_POLICY_HISTORY_REQUEST, "policy_history_request"},
        {FI__ENVELOPE__BODY_POLICY_HISTORY_REPLY, "policy_history_reply"},
        {FI__ENVELOPE__BODY_POLICY_ROLLBACK, "policy_rollback"},
        {FI__ENVELOPE__BODY_POLICY_GET, "policy_get"},
        {FI__ENVELOPE__BODY_POLICY_CONTENT, "policy_content"},
        {FI__ENVELOPE__BODY_AUDIT_QUERY, "audit_query"},
        {FI__ENVELOPE__BODY_AUDIT_RECORDS, "audit_records"},
        {FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST, "audit_verify_request"},
        {FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY, "audit_verify_reply"},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        assert_string_equal(fi_wire_type_name(types[i].t), types[i].name);
        /* An empty body of that type: the field number and a zero length. */
        uint8_t buf[8] = {0x08, 0x01, (uint8_t)((unsigned)types[i].t << 3 | 2) | 0x80,
                          (uint8_t)((unsigned)types[i].t >> 4), 0x00};
        Fi__ErrorCode code;
        char err[160];
        fi_msg *m = fi_wire_decode(buf, 5, 0, &code, err, sizeof err);
        if (!m) fail_msg("%s refused: %s", types[i].name, err);
        assert_int_equal(m->body_case, types[i].t);
        fi_wire_free(&m);
        /* The same with an undefined field (99, varint 1) inside. */
        uint8_t bad[10] = {0x08, 0x01, buf[2], buf[3], 0x03, 0x98, 0x06, 0x01};
        m = fi_wire_decode(bad, 8, 0, &code, err, sizeof err);
        assert_null(m);
        assert_int_equal(code, FI__ERROR_CODE__ERR_MALFORMED);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_types),
        cmocka_unit_test_setup_teardown(test_help, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ingest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ingest_adopt_after_lost_ack, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ship_and_audit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pushed_version_taken, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
