/*
 * test_fabric_procs.c - the fabric across processes: the coordinator
 * killed with SIGKILL and restarted (peers come back by themselves, no
 * state is lost), and a worker killed with SIGKILL mid-stream (its request
 * ends with an error, never a hang).
 *
 * The coordinator and workers run as fi_fabric_peer processes (the same
 * command code as `fedinfer coordinator`); the edge is this process.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "net_ports.h"

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <fcntl.h>

#include "db_damage.h"
#include "fabric/harness.h"
#include "fi_audit.h"
#include "fi_bundle.h"
#include "fi_sched.h"

extern char **environ;

typedef struct procs {
    harness h;          /* directory, keys, database path */
    int port;           /* fabric port (enrolment on port + 1) */
    pid_t coord;        /* coordinator process, 0 when none */
    pid_t worker;       /* worker process, 0 when none */
    pid_t worker2;      /* a second one (two replicas), 0 when none */
    fi_keypair wk;      /* the worker's key */
} procs;

static int s_write(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

static pid_t s_spawn(const char *log, char *const argv[]) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    pid_t pid = 0;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    return rc ? -1 : pid;
}

static pid_t s_start_coord(procs *p) {
    char conf[300], log[300];
    snprintf(conf, sizeof conf, "%s/coord.conf", p->h.dir);
    snprintf(log, sizeof log, "%s/coord.log", p->h.dir);
    char *argv[] = {(char *)FI_FABRIC_PEER, (char *)"coordinator", (char *)"--config", conf, NULL};
    return s_spawn(log, argv);
}

static pid_t s_start_worker(procs *p) {
    char conf[300], log[300];
    snprintf(conf, sizeof conf, "%s/worker.conf", p->h.dir);
    snprintf(log, sizeof log, "%s/worker.log", p->h.dir);
    char *argv[] = {(char *)FI_FABRIC_PEER, (char *)"worker", (char *)"--config", conf, NULL};
    return s_spawn(log, argv);
}

/* A worker process of site `name` serving the replica backend (answers its
 * name, reports a prefix filter of what it served). */
static pid_t s_start_replica(procs *p, const char *name, const fi_keypair *kp) {
    char conf[300], log[300], sec[320], pubf[320], cpub[320], text[1024], err[256];
    snprintf(sec, sizeof sec, "%s/%s.key", p->h.dir, name);
    snprintf(pubf, sizeof pubf, "%s/%s.pub", p->h.dir, name);
    snprintf(cpub, sizeof cpub, "%s/coord.pub", p->h.dir);
    if (fi_keys_save(kp, sec, pubf, 0, err, sizeof err)) return -1;
    snprintf(text, sizeof text,
             "coordinator = %s\ncoordinator_key = %s\nsecret_key = %s\nmodel = none\n"
             "model_name = smol\nheartbeat_ms = %d\nliveness = %d\ncapacity = 4\n",
             p->h.ep, cpub, sec, H_HB_MS, H_LIVENESS);
    snprintf(conf, sizeof conf, "%s/%s.conf", p->h.dir, name);
    snprintf(log, sizeof log, "%s/%s.log", p->h.dir, name);
    if (s_write(conf, text)) return -1;
    char *argv[] = {(char *)FI_FABRIC_PEER, (char *)"worker", (char *)"--config", conf,
                    (char *)"--replica", (char *)name, NULL};
    return s_spawn(log, argv);
}

static void s_kill(pid_t *pid) {
    if (*pid <= 0) return;
    kill(*pid, SIGKILL);
    waitpid(*pid, NULL, 0);
    *pid = 0;
}

static int setup(void **state) {
    procs *p = calloc(1, sizeof *p);
    if (!p || h_init(&p->h)) return -1;
    char path[300], err[256], text[2048];
    snprintf(path, sizeof path, "%s/coord", p->h.dir);
    char sec[320], pub[320];
    snprintf(sec, sizeof sec, "%s.key", path);
    snprintf(pub, sizeof pub, "%s.pub", path);
    if (fi_keys_save(&p->h.coord, sec, pub, 0, err, sizeof err)) return -1;
    if (fi_keys_generate(&p->wk) ||
        h_enrol_direct(&p->h, &p->wk, FI__ROLE__ROLE_CLUSTER, "core1", "eu-west"))
        return -1;
    char wsec[320], wpub[320];
    snprintf(wsec, sizeof wsec, "%s/worker.key", p->h.dir);
    snprintf(wpub, sizeof wpub, "%s/worker.pub", p->h.dir);
    if (fi_keys_save(&p->wk, wsec, wpub, 0, err, sizeof err)) return -1;
    p->port = fi_test_free_ports(2); /* fabric and enrolment, below the ephemeral range */
    if (p->port <= 0) return -1;
    snprintf(p->h.ep, sizeof p->h.ep, "tcp://127.0.0.1:%d", p->port);
    snprintf(p->h.enrol_ep, sizeof p->h.enrol_ep, "tcp://127.0.0.1:%d", p->port + 1);
    snprintf(text, sizeof text,
             "db = %s\nsecret_key = %s\nbind = %s\nenrol_bind = %s\nheartbeat_ms = %d\n"
             "liveness = %d\nhandshake_ms = 2000\n",
             p->h.db, sec, p->h.ep, p->h.enrol_ep, H_HB_MS, H_LIVENESS);
    snprintf(path, sizeof path, "%s/coord.conf", p->h.dir);
    if (s_write(path, text)) return -1;
    snprintf(text, sizeof text,
             "coordinator = %s\ncoordinator_key = %s\nsecret_key = %s\nmodel = none\n"
             "model_name = smol\nheartbeat_ms = %d\nliveness = %d\ncapacity = 4\n",
             p->h.ep, pub, wsec, H_HB_MS, H_LIVENESS);
    snprintf(path, sizeof path, "%s/worker.conf", p->h.dir);
    if (s_write(path, text)) return -1;
    *state = p;
    return 0;
}

static int teardown(void **state) {
    procs *p = *state;
    s_kill(&p->worker);
    s_kill(&p->worker2); /* also when a test failed half-way */
    s_kill(&p->coord);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "cat '%s/coord.log' >&2; echo '--- worker.log' >&2; cat '%s/worker.log' >&2", p->h.dir, p->h.dir);
    if (system(cmd)) { /* log only */
    }
    h_stop(&p->h);
    free(p);
    return 0;
}

/* Retries an inference until it completes (or ms pass); returns the time
 * it took in ms, or -1. */
static long s_until_served(fi_client *edge, const char *tag, int ms) {
    uint64_t t0 = fi_wire_now_ms();
    for (int i = 0; fi_wire_now_ms() - t0 < (uint64_t)ms; i++) {
        char id[64];
        snprintf(id, sizeof id, "%s-%d", tag, i);
        h_text t;
        fi_client_result res;
        Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
        rq.request_id = id;
        rq.model = (char *)"smol";
        rq.prompt = (char *)"ping";
        char err[256] = "";
        memset(&t, 0, sizeof t);
        memset(&res, 0, sizeof res);
        if (fi_client_infer(edge, &rq, h_on_text, &t, 1000, &res, err, sizeof err) == 0 &&
            res.error == FI__ERROR_CODE__ERR_UNSPECIFIED && !strcmp(t.buf, "echo: ping"))
            return (long)(fi_wire_now_ms() - t0);
        if (getenv("FI_TEST_DEBUG")) fprintf(stderr, "%s attempt %d at %llu: %s / %s\n", tag, i, (unsigned long long)(fi_wire_now_ms() - t0), err, res.message);
        fi_msg *m = NULL;
        if (fi_client_recv(edge, 50, &m, err, sizeof err) < 0) return -1;
        fi_wire_free(&m);
    }
    return -1;
}

typedef struct s_killer {
    procs *p;   /* whose coordinator */
    int killed; /* 1 once killed */
} s_killer;

/* Kills the coordinator with SIGKILL on the first streamed text. */
static int s_kill_coord_on_text(void *user, const char *text, size_t len) {
    s_killer *k = user;
    (void)text;
    (void)len;
    if (!k->killed) {
        s_kill(&k->p->coord);
        k->killed = 1;
    }
    return 0;
}

static int64_t s_count(procs *p, const char *table) {
    char err[256];
    fi_store *st = fi_store_open(p->h.db, err, sizeof err);
    int64_t n = st ? fi_store_count(st, table) : -1;
    fi_store_destroy(&st);
    return n;
}

/* Enrols an edge, starts the coordinator and a worker, and returns the
 * edge's client once a request has gone through. */
static fi_client *s_start_fleet(procs *p) {
    char err[256];
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(&p->h, &ek, FI__ROLE__ROLE_EDGE, "clinic-7", "eu-west"), 0);
    assert_true((p->coord = s_start_coord(p)) > 0);
    assert_true((p->worker = s_start_worker(p)) > 0);
    fi_client_opts eo;
    h_client_opts(&p->h, &eo, &ek, FI__ROLE__ROLE_EDGE);
    fi_client *edge = fi_client_new(&eo, err, sizeof err);
    assert_non_null(edge);
    assert_true(s_until_served(edge, "warm", 5000) >= 0);
    return edge;
}

static void test_coordinator_kill9_restart(void **state) {
    procs *p = *state;
    char err[256];
    fi_client *edge = s_start_fleet(p);

    /* State written through the fabric before the crash. */
    fi_client *op = h_client(&p->h, &p->h.op, FI__ROLE__ROLE_OPERATOR);
    assert_non_null(op);
    Fi__TokenRequest tr = FI__TOKEN_REQUEST__INIT;
    tr.role = FI__ROLE__ROLE_EDGE;
    tr.site = (char *)"clinic-9";
    tr.region = (char *)"eu-west";
    tr.ttl_s = 600;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_TOKEN_REQUEST;
    m.token_request = &tr;
    fi_msg *r = NULL;
    assert_int_equal(fi_client_call(op, &m, FI__ENVELOPE__BODY_TOKEN_REPLY, 3000, &r, err, sizeof err), 1);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_TOKEN_REPLY);
    char token[64];
    snprintf(token, sizeof token, "%s", r->token_reply->token);
    fi_wire_free(&r);
    Fi__AuditUpload au = FI__AUDIT_UPLOAD__INIT;
    au.batch_id = (char *)"batch-1";
    au.first_seq = 1;
    au.count = 1;
    char *batch = h_audit_batch("clinic-7", 1, 1, "", NULL);
    assert_non_null(batch);
    au.batch.data = (uint8_t *)batch;
    au.batch.len = strlen(batch);
    m.body_case = FI__ENVELOPE__BODY_AUDIT_UPLOAD;
    m.audit_upload = &au;
    assert_int_equal(fi_client_call(edge, &m, FI__ENVELOPE__BODY_ACK, 3000, &r, err, sizeof err), 1);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ACK);
    fi_wire_free(&r);
    free(batch);
    fi_client_destroy(&op);
    /* The acks came after the commits: all of it is on disk now. */
    int64_t peers = s_count(p, "peers"), tokens = s_count(p, "tokens"),
            audit = s_count(p, "audit"), sites = s_count(p, "sites");
    assert_int_equal(peers, 3);
    assert_int_equal(tokens, 1);
    assert_int_equal(audit, 1);

    /* Killed while a request is streaming: the edge's call ends with an
     * error (the connection was lost), not a hang. */
    char prompt[401];
    memset(prompt, 'y', 400);
    prompt[400] = 0;
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)"in-flight";
    rq.model = (char *)"smol";
    rq.prompt = prompt;
    s_killer k = {p, 0};
    fi_client_result res;
    uint64_t t_call = fi_wire_now_ms();
    assert_int_equal(fi_client_infer(edge, &rq, s_kill_coord_on_text, &k, 10000, &res, err,
                                     sizeof err), -1);
    assert_true(k.killed);
    assert_non_null(strstr(err, "lost"));
    assert_true(fi_wire_now_ms() - t_call < 3000);
    h_sleep_ms(200);
    uint64_t t_restart = fi_wire_now_ms();
    assert_true((p->coord = s_start_coord(p)) > 0);
    /* Edge and worker reconnect by themselves (back-off 50..400 ms). */
    long back = s_until_served(edge, "after", 5000);
    assert_true(back >= 0);
    long total = (long)(fi_wire_now_ms() - t_restart);
    print_message("coordinator restarted: edge -> worker round trip back after %ld ms "
                  "(heartbeat %d ms)\n", total, H_HB_MS);
    assert_true(total < 3000);

    /* Nothing lost. */
    assert_int_equal(s_count(p, "peers"), peers);
    assert_int_equal(s_count(p, "tokens"), tokens);
    assert_int_equal(s_count(p, "audit"), audit);
    assert_int_equal(s_count(p, "sites"), sites);
    /* The token made before the crash still enrols, once. */
    fi_keypair nk;
    assert_int_equal(fi_keys_generate(&nk), 0);
    fi_client_opts no;
    h_client_opts(&p->h, &no, &nk, FI__ROLE__ROLE_EDGE);
    char fpr[FI_KEYS_FPR_LEN];
    assert_int_equal(fi_client_enrol(&no, p->h.enrol_ep, token, FI__ROLE__ROLE_EDGE, "clinic-9",
                                     "eu-west", 3000, fpr, err, sizeof err), 0);
    assert_int_equal(s_count(p, "peers"), peers + 1);
    fi_client_destroy(&edge);
}

/* A coordinator whose database has a damaged page in the middle refuses
 * to start: it exits with status 1 at once (no crash, no hang), and its
 * message names the file and says it is damaged (before, it started and
 * failed the requests that reached the page). */
static void test_coordinator_refuses_damaged_db(void **state) {
    procs *p = *state;
    char err[512], blob[1000], id[32];
    fi_store *st = fi_store_open(p->h.db, err, sizeof err);
    if (!st) fail_msg("%s", err);
    memset(blob, 'b', sizeof blob);
    for (int i = 0; i < 150; i++) {
        snprintf(id, sizeof id, "batch-%d", i);
        assert_int_equal(fi_store_audit_put(st, "edge-fpr", id, (uint64_t)i * 10 + 1, 10, blob, sizeof blob), 0);
    }
    fi_store_destroy(&st);
    int page = fi_test_db_damage(p->h.db, err, sizeof err);
    if (page < 0) fail_msg("%s", err);
    assert_true((p->coord = s_start_coord(p)) > 0);
    int status = 0;
    pid_t done = 0;
    for (int i = 0; i < 200 && (done = waitpid(p->coord, &status, WNOHANG)) == 0; i++) h_sleep_ms(50);
    if (done != p->coord) fail_msg("the coordinator still runs 10 s after start on a damaged database");
    p->coord = 0;
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 1);
    char log[300], text[2048] = "";
    snprintf(log, sizeof log, "%s/coord.log", p->h.dir);
    FILE *f = fopen(log, "r");
    assert_non_null(f);
    text[fread(text, 1, sizeof text - 1, f)] = 0;
    fclose(f);
    printf("damaged page %d; coordinator: %s", page, text);
    assert_non_null(strstr(text, p->h.db));
    assert_non_null(strstr(text, "database is damaged"));
}

static void test_worker_kill9_fails_requests(void **state) {
    procs *p = *state;
    char err[256];
    fi_client *edge = s_start_fleet(p);
    /* A long echo: 50 ms per 4 bytes. */
    char prompt[401];
    memset(prompt, 'x', 400);
    prompt[400] = 0;
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)"long";
    rq.model = (char *)"smol";
    rq.prompt = prompt;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_INFER;
    m.infer = &rq;
    assert_int_equal(fi_client_send(edge, &m), 0);
    int chunks = 0, code = 0;
    uint64_t t_kill = 0, t0 = fi_wire_now_ms();
    while (!code && fi_wire_now_ms() - t0 < 5000) {
        fi_msg *r = NULL;
        if (fi_client_recv(edge, 50, &r, err, sizeof err) != 1) continue;
        if (r->body_case == FI__ENVELOPE__BODY_CHUNK && ++chunks == 3) {
            s_kill(&p->worker); /* mid-stream, without a word */
            t_kill = fi_wire_now_ms();
        }
        if (r->body_case == FI__ENVELOPE__BODY_ERROR) {
            assert_string_equal(r->error->request_id, "long");
            code = r->error->code;
        }
        assert_int_not_equal(r->body_case, FI__ENVELOPE__BODY_FINAL);
        fi_wire_free(&r);
    }
    assert_true(t_kill > 0);
    assert_int_equal(code, FI__ERROR_CODE__ERR_PEER_DEAD);
    long took = (long)(fi_wire_now_ms() - t_kill);
    print_message("worker killed: error reached the edge after %ld ms (dead after %d ms)\n", took,
                  H_HB_MS * H_LIVENESS);
    assert_true(took < 2000);
    /* Out of routing until it comes back. */
    h_text t;
    fi_client_result res;
    assert_int_equal(h_infer(edge, "none", "smol", "x", &t, &res), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_NO_WORKER);
    assert_true((p->worker = s_start_worker(p)) > 0);
    assert_true(s_until_served(edge, "back", 5000) >= 0);
    fi_client_destroy(&edge);
}

/* A worker that stops answering (SIGSTOP: its TCP connection stays up but
 * nothing comes from it, as with a half-open link) is dropped by the
 * coordinator within a few heartbeats; resumed, it comes back. */
/* The processes' state and logs, to stderr, when a test is about to fail. */
static void s_dump_logs(procs *p) {
    int st = 0;
    pid_t w = waitpid(p->worker, &st, WNOHANG);
    if (w == p->worker)
        fprintf(stderr, "--- worker %d exited: %s %d\n", (int)w,
                WIFEXITED(st) ? "status" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    else
        fprintf(stderr, "--- worker %d still running\n", (int)p->worker);
    fflush(stderr);
    static const char *const names[] = {"coord.log", "worker.log"};
    for (int i = 0; i < 2; i++) {
        char path[320], line[512];
        snprintf(path, sizeof path, "%s/%s", p->h.dir, names[i]);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        fprintf(stderr, "--- %s\n", names[i]);
        while (fgets(line, sizeof line, f)) fputs(line, stderr);
        fclose(f);
        fflush(stderr);
    }
}

static void test_worker_stalled_then_back(void **state) {
    procs *p = *state;
    char err[256];
    fi_client *edge = s_start_fleet(p);
    kill(p->worker, SIGSTOP);
    /* Keep the edge alive while the coordinator notices. */
    for (int i = 0; i < 2 * H_LIVENESS; i++) { /* two liveness periods */
        fi_msg *m = NULL;
        (void)fi_client_recv(edge, H_HB_MS, &m, err, sizeof err);
        fi_wire_free(&m);
    }
    h_text t;
    fi_client_result res;
    assert_int_equal(h_infer(edge, "stalled", "smol", "x", &t, &res), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_NO_WORKER);
    kill(p->worker, SIGCONT);
    long back = s_until_served(edge, "resumed", 15000);
    print_message("stalled worker: out of routing, back %ld ms after SIGCONT\n", back);
    if (back < 0) s_dump_logs(p);
    assert_true(back >= 0);
    fi_client_destroy(&edge);
}

static const char *s_route_policy =
    "labels public, secret, pinned;\ndefault_label \"public\";\n"
    "jurisdiction EU;\nregion eu-a in EU;\nregion eu-b in EU;\n"
    "site clinic in eu-a;\ncluster core1 in eu-a;\ncluster core2 in eu-b;\n"
    "permit \"anything\";\n"
    "forbid \"secret stays out of eu-a clusters\" when \"secret\" in request.labels and "
    "target within \"eu-a\" and target.kind == \"cluster\";\n"
    "forbid \"pinned stays out of eu-b\" when \"pinned\" in request.labels and "
    "target within \"eu-b\";\n";

/* One request with the prompt's prefix hashes (its bytes as tokens);
 * returns 1 or 2 for the replica that answered, 0 for an error reply. */
static int s_route_ask(fi_client *edge, const char *id, const char *prompt, const char *label) {
    int32_t toks[1024];
    int n = 0;
    for (; prompt[n] && n < 1024; n++) toks[n] = (uint8_t)prompt[n];
    /* salted as the edge salts: the tenant qualified with its site */
    char salt[FI_WIRE_CACHE_TENANT_MAX];
    assert_int_equal(fi_wire_cache_tenant("clinic", "t", salt), 0);
    uint64_t h[64];
    int nh = fi_prefix_hashes(salt, "EU", toks, n, h, 64);
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)id;
    rq.model = (char *)"smol";
    rq.prompt = (char *)prompt;
    rq.tenant = (char *)"t";
    rq.zone = (char *)"EU";
    rq.prefix_hashes = h;
    rq.n_prefix_hashes = (size_t)nh;
    char *labels[1] = {(char *)label};
    rq.labels = labels;
    rq.n_labels = label ? 1 : 0;
    h_text t;
    memset(&t, 0, sizeof t);
    fi_client_result res;
    char err[256];
    assert_int_equal(fi_client_infer(edge, &rq, h_on_text, &t, 5000, &res, err, sizeof err), 0);
    if (res.error) return 0;
    return !strcmp(t.buf, "core1") ? 1 : !strcmp(t.buf, "core2") ? 2 : -1;
}

typedef struct s_route_scan {
    int secret_permits;      /* the coordinator's own permits of secret requests */
    int secret_to_core1;     /* of those, to core1 */
    int pub_to_core1;        /* unlabelled requests it sent to core1 */
} s_route_scan;

static int s_route_row(const fi_audit_record *r, void *arg) {
    s_route_scan *sc = arg;
    if (!strstr(r->rules, "worker ") || strcmp(r->decision, "permit")) return 0;
    if (!strcmp(r->labels, "secret")) {
        sc->secret_permits++;
        sc->secret_to_core1 += !strcmp(r->target, "core1");
    } else if (!strcmp(r->labels, "")) {
        sc->pub_to_core1 += !strcmp(r->target, "core1");
    }
    return 0;
}

/* Two replica worker processes, a coordinator process re-checking a signed
 * policy (policy_check_key in its configuration): requests sharing a prefix
 * go to the replica holding it; with that replica forbidden, never there,
 * by the answers and by the coordinator's own audit log. */
static void test_prefix_routing_two_replicas(void **state) {
    procs *p = *state;
    char err[256], path[400], text[2048];
    /* The policy, signed, in the coordinator's store; its key in the conf. */
    uint8_t pk[32], sk[64];
    assert_int_equal(fi_bundle_keygen(pk, sk), 0);
    snprintf(path, sizeof path, "%s/sign.key", p->h.dir);
    assert_int_equal(fi_bundle_key_save(path, sk, err, sizeof err), 0);
    char *b;
    size_t bl;
    int64_t now = (int64_t)time(NULL);
    assert_int_equal(fi_bundle_sign(sk, 1, now - 60, now + 3600, s_route_policy,
                                    strlen(s_route_policy), &b, &bl), 0);
    fi_store *st = fi_store_open(p->h.db, err, sizeof err);
    assert_non_null(st);
    assert_int_equal(fi_store_bundle_put(st, 1, b, bl, "op"), 0);
    fi_store_destroy(&st);
    free(b);
    snprintf(text, sizeof text,
             "db = %s\nsecret_key = %s/coord.key\nbind = %s\nenrol_bind = %s\nheartbeat_ms = %d\n"
             "liveness = %d\nhandshake_ms = 2000\npolicy_check_key = %s/sign.key.pub\n",
             p->h.db, p->h.dir, p->h.ep, p->h.enrol_ep, H_HB_MS, H_LIVENESS, p->h.dir);
    snprintf(path, sizeof path, "%s/coord.conf", p->h.dir);
    assert_int_equal(s_write(path, text), 0);
    /* Two replicas, clusters core1 and core2; an edge at clinic. */
    fi_keypair k1, k2, ek;
    assert_int_equal(fi_keys_generate(&k1) || fi_keys_generate(&k2) || fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(&p->h, &k1, FI__ROLE__ROLE_CLUSTER, "core1", "eu-a"), 0);
    assert_int_equal(h_enrol_direct(&p->h, &k2, FI__ROLE__ROLE_CLUSTER, "core2", "eu-b"), 0);
    assert_int_equal(h_enrol_direct(&p->h, &ek, FI__ROLE__ROLE_EDGE, "clinic", "eu-a"), 0);
    assert_true((p->coord = s_start_coord(p)) > 0);
    assert_true((p->worker = s_start_replica(p, "core1", &k1)) > 0);
    assert_true((p->worker2 = s_start_replica(p, "core2", &k2)) > 0);
    fi_client_opts eo;
    h_client_opts(&p->h, &eo, &ek, FI__ROLE__ROLE_EDGE);
    fi_client *edge = fi_client_new(&eo, err, sizeof err);
    assert_non_null(edge);
    assert_int_equal(fi_client_wait_ready(edge, 5000, err, sizeof err), 0);
    char prompt[600];
    memset(prompt, 'q', 512);
    prompt[512] = 0;
    /* Both replicas up: a request pinned to core1 (the policy keeps it out
     * of core2) makes core1 the holder of the prefix. */
    int r = 0;
    for (int i = 0; i < 100 && r != 1; i++) {
        char id[16];
        snprintf(id, sizeof id, "warm-%d", i);
        r = s_route_ask(edge, id, prompt, "pinned");
        if (r != 1) h_sleep_ms(50);
    }
    assert_int_equal(r, 1);
    int other = 0; /* core2 must be routable too before the comparison means anything */
    for (int i = 0; i < 100 && other != 2; i++) {
        char id[16];
        snprintf(id, sizeof id, "up2-%d", i);
        other = s_route_ask(edge, id, "core2 only, please", "secret");
        if (other != 2) h_sleep_ms(50);
    }
    assert_int_equal(other, 2);
    for (int i = 0; i < 4; i++) { /* the filters travel with heartbeats */
        fi_msg *m = NULL;
        (void)fi_client_recv(edge, H_HB_MS, &m, err, sizeof err);
        fi_wire_free(&m);
    }
    /* Unlabelled: the holder gets them (the cache). */
    for (int i = 0; i < 4; i++) {
        char id[16];
        snprintf(id, sizeof id, "pub-%d", i);
        assert_int_equal(s_route_ask(edge, id, prompt, NULL), 1);
    }
    /* Secret: core1 is forbidden: never there, whatever the cache says. */
    for (int i = 0; i < 6; i++) {
        char id[16];
        snprintf(id, sizeof id, "sec-%d", i);
        assert_int_equal(s_route_ask(edge, id, prompt, "secret"), 2);
    }
    fi_client_destroy(&edge);
    /* The coordinator's own audit log says the same (written by its writer
     * thread within moments). */
    char audit[400];
    snprintf(audit, sizeof audit, "%s.audit", p->h.db);
    s_route_scan sc = {0, 0, 0};
    for (int i = 0; i < 50 && sc.secret_permits < 7; i++) {
        h_sleep_ms(50);
        fi_audit *a = fi_audit_open(audit, err, sizeof err);
        assert_non_null(a);
        memset(&sc, 0, sizeof sc);
        assert_int_equal(fi_audit_query(a, NULL, s_route_row, &sc, err, sizeof err), 0);
        fi_audit_destroy(&a);
    }
    assert_int_equal(sc.secret_permits, 7); /* up2's and the six */
    assert_int_equal(sc.secret_to_core1, 0);
    assert_int_equal(sc.pub_to_core1, 4);
    s_kill(&p->worker2);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_coordinator_kill9_restart, setup, teardown),
        cmocka_unit_test_setup_teardown(test_worker_kill9_fails_requests, setup, teardown),
        cmocka_unit_test_setup_teardown(test_coordinator_refuses_damaged_db, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_routing_two_replicas, setup, teardown),
        /* Once failed about one run in three: the worker's client closed
         * its monitor's reader before the socket, and libzmq's I/O thread
         * blocked for good on the socket's last event
         * (fi_sock_close_monitored). */
        cmocka_unit_test_setup_teardown(test_worker_stalled_then_back, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
