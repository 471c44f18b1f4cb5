/*
 * test_group_procs.c - a TP=2 shard group as real processes (`fedinfer
 * shard --config rankN.conf`, the default model) behind a coordinator, with
 * an edge sending requests over the fabric:
 *   - end to end: a request from an edge's fabric link is routed to the
 *     group's leader and its greedy text equals the single-process
 *     engine's; and through the real edge agent (HTTP API, signed policy):
 *     a completion routed to the group;
 *   - kill -9 of rank 1 while two requests are generating: both end with
 *     an error naming the lost rank within the group's timeout (plus
 *     S_MARGIN_MS for a loaded machine); the group withdraws its model (a
 *     new request is refused, nothing hangs); rank 1 restarted alone, the
 *     group serves again without restarting rank 0;
 *   - a frozen rank 1 (SIGSTOP): the same, found by the heartbeat timeout;
 *     after SIGCONT it rejoins by itself;
 *   - the leader killed mid-generation: the request ends (the coordinator
 *     finds its worker dead); a new leader forms the group again with the
 *     rank 1 that kept running;
 *   - a rank 1 started with another model file (one byte changed) is
 *     refused at join: it exits with status 1 naming both model digests.
 * Skipped when the model file is missing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "fabric/harness.h"
#include "fi_bundle.h"
#include "fi_edge.h"
#include "fi_model.h"
#include "net_ports.h"

#define S_TIMEOUT_MS 1000 /* the group's timeout_ms */
#define S_MARGIN_MS 2000  /* room for a loaded 2-core machine */
#define S_PROMPT "What is the capital of France?"

typedef struct fixture {
    harness h;
    fi_keypair rank[2];   /* ranks' keys; rank 0's is enrolled as a cluster */
    fi_keypair edge;      /* an enrolled edge */
    pid_t pid[2];         /* rank processes (0: not running) */
    char conf[2][600];    /* rank files */
    char log[2][600];     /* their stderr */
    int port;             /* rank 0's link port */
} fixture;

/* The KV cache precision of the ranks (kv_bits in their files) and of the
 * single-process engine they are compared with: 16, or 8 for setup_kv8. */
static int s_kv_bits = 16;

static int setup(void **state) {
    if (access(FI_TEST_MODEL, R_OK) != 0) {
        printf("SKIPPED: the model %s is absent\n", FI_TEST_MODEL);
        return -1;
    }
    fixture *f = calloc(1, sizeof *f);
    char err[256], p[300], q[300];
    if (h_init(&f->h) || h_start(&f->h)) return -1;
    snprintf(p, sizeof p, "%s/coord.key", f->h.dir);
    snprintf(q, sizeof q, "%s/coord.pub", f->h.dir);
    if (fi_keys_save(&f->h.coord, p, q, 0, err, sizeof err)) return -1;
    for (int r = 0; r < 2; r++) {
        snprintf(p, sizeof p, "%s/rank%d.key", f->h.dir, r);
        snprintf(q, sizeof q, "%s/rank%d.pub", f->h.dir, r);
        if (fi_keys_generate(&f->rank[r]) || fi_keys_save(&f->rank[r], p, q, 0, err, sizeof err))
            return -1;
    }
    if (h_enrol_direct(&f->h, &f->rank[0], FI__ROLE__ROLE_CLUSTER, "core1", "eu-central") ||
        fi_keys_generate(&f->edge) ||
        h_enrol_direct(&f->h, &f->edge, FI__ROLE__ROLE_EDGE, "berlin-clinic", "eu-central"))
        return -1;
    if ((f->port = fi_test_free_ports(2)) < 0) return -1;
    snprintf(p, sizeof p, "%s/group.conf", f->h.dir);
    FILE *fp = fopen(p, "w");
    if (!fp) return -1;
    fprintf(fp, "group = procs\nworld = 2\ntp = 2\nheartbeat_ms = 100\ntimeout_ms = %d\n"
                "endpoint.0 = tcp://127.0.0.1:%d\nkey.0 = rank0.pub\n"
                "endpoint.1 = tcp://127.0.0.1:%d\nkey.1 = rank1.pub\n",
            S_TIMEOUT_MS, f->port, f->port + 1);
    fclose(fp);
    char dir[256];
    memcpy(dir, f->h.dir, sizeof dir);
    for (int r = 0; r < 2; r++) {
        snprintf(f->conf[r], sizeof f->conf[r], "%s/rank%d.conf", dir, r);
        snprintf(f->log[r], sizeof f->log[r], "%s/rank%d.log", dir, r);
        fp = fopen(f->conf[r], "w");
        if (!fp) return -1;
        fprintf(fp, "group_file = group.conf\nrank = %d\nsecret_key = rank%d.key\nmodel = %s\n"
                    "threads = 1\nkv_bits = %d\n",
                r, r, FI_TEST_MODEL, s_kv_bits);
        if (r == 0)
            fprintf(fp, "coordinator = %s\ncoordinator_key = coord.pub\nmodel_name = smollm2\n"
                        "capacity = 4\nheartbeat_ms = %d\nliveness = %d\nmax_tokens = 400\n"
                        "n_ctx = 1024\nkv_mib = 32\n",
                    f->h.ep, H_HB_MS, H_LIVENESS);
        fclose(fp);
    }
    *state = f;
    return 0;
}

static void s_kill(fixture *f, int r, int sig) {
    if (!f->pid[r]) return;
    kill(f->pid[r], sig);
    if (sig == SIGKILL || sig == SIGTERM) {
        waitpid(f->pid[r], NULL, 0);
        f->pid[r] = 0;
    }
}

static int teardown(void **state) {
    fixture *f = *state;
    if (!f) return 0;
    for (int r = 0; r < 2; r++) {
        if (f->pid[r]) kill(f->pid[r], SIGCONT);
        s_kill(f, r, SIGKILL);
    }
    h_stop(&f->h);
    free(f);
    return 0;
}

/* Starts rank r as a process: fedinfer shard --config conf (stderr to
 * its log, appended). */
static void s_spawn(fixture *f, int r, const char *conf) {
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(f->log[r], O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 2);
            dup2(fd, 1);
        }
        execl(FI_BUILD_DIR "/fedinfer", "fedinfer", "shard", "--config", conf, (char *)NULL);
        _exit(127);
    }
    f->pid[r] = pid;
}

/* 1 when the log of rank r holds s. */
static int s_log_has(fixture *f, int r, const char *s) {
    FILE *fp = fopen(f->log[r], "r");
    if (!fp) return 0;
    char line[2048];
    int yes = 0;
    while (!yes && fgets(line, sizeof line, fp)) yes = strstr(line, s) != NULL;
    fclose(fp);
    return yes;
}

/* Prints both ranks' logs (when a test is about to fail). */
static void s_dump_logs(fixture *f) {
    for (int r = 0; r < 2; r++) {
        char cmd[700];
        printf("--- rank %d log:\n", r);
        fflush(stdout);
        snprintf(cmd, sizeof cmd, "tail -n 40 '%s'", f->log[r]);
        if (system(cmd) != 0) printf("(no log)\n");
    }
}

/* --- requests from the edge ----------------------------------------------- */

typedef struct s_req {
    char id[32];
    int done, chunks;
    Fi__ErrorCode code;   /* ERR_UNSPECIFIED: finished */
    char msg[512];
    char text[4096];
    size_t len;
    uint64_t end_ms;
} s_req;

static void s_send(fi_client *c, s_req *q, const char *id, const char *prompt, int max_tokens) {
    memset(q, 0, sizeof *q);
    snprintf(q->id, sizeof q->id, "%s", id);
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = q->id;
    rq.model = (char *)"smollm2";
    rq.prompt = (char *)prompt;
    rq.max_tokens = (uint32_t)max_tokens;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_INFER;
    m.infer = &rq;
    assert_int_equal(fi_client_send(c, &m), 0);
}

/* As the edge sends a chat: the conversation in messages, no prompt; one
 * stop string (NULL: none). */
static void s_send_chat(fi_client *c, s_req *q, const char *id, const char *user, int max_tokens,
                        const char *stop) {
    memset(q, 0, sizeof *q);
    snprintf(q->id, sizeof q->id, "%s", id);
    Fi__ChatMessage msg = FI__CHAT_MESSAGE__INIT, *msgs[1] = {&msg};
    msg.role = (char *)"user";
    msg.content = (char *)user;
    char *stops[1] = {(char *)stop};
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = q->id;
    rq.model = (char *)"smollm2";
    rq.prompt = (char *)"";
    rq.messages = msgs;
    rq.n_messages = 1;
    rq.stop = stop ? stops : NULL;
    rq.n_stop = stop ? 1 : 0;
    rq.max_tokens = (uint32_t)max_tokens;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_INFER;
    m.infer = &rq;
    assert_int_equal(fi_client_send(c, &m), 0);
}

/* Takes the edge's messages for up to ms into qs. */
static void s_pump(fi_client *c, s_req *qs, int n, int ms) {
    char err[256];
    fi_msg *m = NULL;
    uint64_t until = fi_wire_now_ms() + (uint64_t)ms;
    while (fi_wire_now_ms() < until) {
        int r = fi_client_recv(c, 20, &m, err, sizeof err);
        assert_true(r >= 0);
        if (r != 1) continue;
        const char *id = m->body_case == FI__ENVELOPE__BODY_CHUNK   ? m->chunk->request_id
                         : m->body_case == FI__ENVELOPE__BODY_FINAL ? m->final->request_id
                         : m->body_case == FI__ENVELOPE__BODY_ERROR ? m->error->request_id
                                                                    : NULL;
        for (int i = 0; id && i < n; i++) {
            s_req *q = &qs[i];
            if (strcmp(q->id, id) || q->done) continue;
            if (m->body_case == FI__ENVELOPE__BODY_CHUNK) {
                size_t l = strlen(m->chunk->text);
                if (q->len + l < sizeof q->text) {
                    memcpy(q->text + q->len, m->chunk->text, l);
                    q->len += l;
                }
                q->chunks++;
            } else {
                q->done = 1;
                q->end_ms = fi_wire_now_ms();
                if (m->body_case == FI__ENVELOPE__BODY_ERROR) {
                    q->code = m->error->code;
                    snprintf(q->msg, sizeof q->msg, "%s", m->error->message);
                }
            }
        }
        fi_wire_free(&m);
        int all = 1;
        for (int i = 0; i < n; i++) all &= qs[i].done;
        if (all) return;
    }
}

/* Sends small requests until one succeeds (the group formed and was
 * announced) or ms pass. 1 on success. */
static int s_wait_serving(fi_client *c, int ms) {
    uint64_t until = fi_wire_now_ms() + (uint64_t)ms;
    int k = 0;
    while (fi_wire_now_ms() < until) {
        s_req q;
        char id[32];
        snprintf(id, sizeof id, "probe-%d", k++);
        s_send(c, &q, id, "Hi", 2);
        s_pump(c, &q, 1, 5000);
        if (q.done && q.code == FI__ERROR_CODE__ERR_UNSPECIFIED) return 1;
        h_sleep_ms(200);
    }
    return 0;
}

/* The single-process engine's greedy text for S_PROMPT (chat), n tokens. */
static void s_engine_text(char *out, size_t cap, int n) {
    char err[512];
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU,
                        .kv_bits = s_kv_bits};
    fi_model *m = fi_model_load(FI_TEST_MODEL, &mo, err, sizeof err);
    assert_non_null(m);
    const fi_tok *tok = fi_model_tok(m);
    fi_chat_msg msg = {"user", S_PROMPT};
    char *text = fi_tok_chat(tok, &msg, 1, 1, err, sizeof err);
    int32_t ids[256];
    int k = fi_tok_encode(tok, text, strlen(text), 1, ids, 256);
    fi_session *s = fi_session_new(m, 512, err, sizeof err);
    h_text t;
    memset(&t, 0, sizeof t);
    fi_gen_opts o;
    memset(&o, 0, sizeof o);
    o.max_tokens = n;
    o.sampling = fi_sampler_defaults();
    o.sampling.temperature = 0;
    o.on_text = h_on_text;
    o.user = &t;
    fi_gen_result res;
    assert_int_equal(fi_generate(s, ids, k, &o, &res, err, sizeof err), 0);
    snprintf(out, cap, "%s", t.buf);
    fi_session_destroy(&s);
    free(text);
    fi_model_destroy(&m);
}

/* Starts both ranks and an edge; waits until the group serves. */
static fi_client *s_group_up(fixture *f) {
    s_spawn(f, 0, f->conf[0]);
    s_spawn(f, 1, f->conf[1]);
    fi_client *c = h_client(&f->h, &f->edge, FI__ROLE__ROLE_EDGE);
    assert_non_null(c);
    if (!s_wait_serving(c, 60000)) fail_msg("the group never served (see %s)", f->log[0]);
    return c;
}

/* Two long requests; once both stream, rank 1 gets sig. Both must end with
 * an error naming rank 1 within the bound; a new request must be refused. */
static void s_fault(fixture *f, fi_client *c, int sig, const char *what) {
    s_req q[2];
    s_send(c, &q[0], "long-a", "Write a long story about a dragon and a knight.", 400);
    s_send(c, &q[1], "long-b", "Describe the history of Rome in detail.", 400);
    uint64_t until = fi_wire_now_ms() + 30000;
    while ((q[0].chunks < 2 || q[1].chunks < 2) && fi_wire_now_ms() < until) s_pump(c, q, 2, 50);
    assert_true(q[0].chunks >= 2 && q[1].chunks >= 2); /* both in flight, batched */
    assert_false(q[0].done || q[1].done);
    uint64_t t0 = fi_wire_now_ms();
    kill(f->pid[1], sig);
    s_pump(c, q, 2, S_TIMEOUT_MS + S_MARGIN_MS + 2000);
    for (int i = 0; i < 2; i++) {
        assert_true(q[i].done);
        uint64_t took = q[i].end_ms - t0;
        printf("%s: request %s ended %llu ms after the signal (%d chunks): %s (%s)\n", what,
               q[i].id, (unsigned long long)took, q[i].chunks, q[i].msg,
               fi_wire_error_name(q[i].code));
        assert_int_equal(q[i].code, FI__ERROR_CODE__ERR_ENGINE);
        assert_non_null(strstr(q[i].msg, "rank 1"));
        assert_true(took <= S_TIMEOUT_MS + S_MARGIN_MS);
    }
    /* The group has withdrawn its model: the coordinator routes nothing
     * there (a request racing the withdrawal is refused by the leader with
     * ERR_BUSY and the group's status). */
    s_req n;
    uint64_t w0 = fi_wire_now_ms();
    for (int k = 0; k < 50; k++) {
        char id[32];
        snprintf(id, sizeof id, "while-down-%d", k);
        s_send(c, &n, id, "Hi", 4);
        s_pump(c, &n, 1, 5000);
        assert_true(n.done);
        assert_true(n.code == FI__ERROR_CODE__ERR_NO_WORKER || n.code == FI__ERROR_CODE__ERR_BUSY);
        if (n.code == FI__ERROR_CODE__ERR_NO_WORKER) break;
        h_sleep_ms(50);
    }
    printf("%s: a request while rank 1 is gone (%llu ms after the failure): %s (%s)\n", what,
           (unsigned long long)(fi_wire_now_ms() - w0), n.msg, fi_wire_error_name(n.code));
    assert_int_equal(n.code, FI__ERROR_CODE__ERR_NO_WORKER);
}

/* Request id (S_PROMPT, 8 tokens) through c to the group: it must be
 * served with want, the single-process engine's text. */
static void s_ask_as_engine(fi_client *c, s_req *q, const char *id, const char *want) {
    s_send(c, q, id, S_PROMPT, 8);
    s_pump(c, q, 1, 30000);
    assert_true(q->done);
    if (q->code) fail_msg("%s: %s", id, q->msg);
    printf("%s: edge -> coordinator -> TP=2 group: \"%.*s\"\nsingle-process engine: \"%s\"\n", id,
           (int)q->len, q->text, want);
    assert_int_equal(q->len, strlen(want));
    assert_memory_equal(q->text, want, q->len);
}

static void test_end_to_end_and_kill(void **state) {
    fixture *f = *state;
    char want[4096];
    s_engine_text(want, sizeof want, 8);
    fi_client *c = s_group_up(f);
    s_req q;
    s_ask_as_engine(c, &q, "e2e", want);
    /* The conversation as the edge sends a chat (messages, no prompt), and
     * a stop string: the group takes them as a single worker does. */
    s_send_chat(c, &q, "chat", S_PROMPT, 8, NULL);
    s_pump(c, &q, 1, 30000);
    assert_true(q.done);
    if (q.code) fail_msg("chat: %s", q.msg);
    if (q.len != strlen(want) || memcmp(q.text, want, q.len))
        fail_msg("chat through messages: \"%.*s\", the engine: \"%s\"", (int)q.len, q.text, want);
    const char *sp = strchr(want + 1, ' ');
    assert_non_null(sp);
    s_send_chat(c, &q, "stop", S_PROMPT, 8, " ");
    s_pump(c, &q, 1, 30000);
    assert_true(q.done);
    if (q.len != (size_t)(sp - want) || memcmp(q.text, want, q.len))
        fail_msg("stop \" \": \"%.*s\", wanted \"%.*s\"", (int)q.len, q.text, (int)(sp - want), want);
    pid_t leader = f->pid[0];
    s_fault(f, c, SIGKILL, "kill -9");
    waitpid(f->pid[1], NULL, 0);
    f->pid[1] = 0;
    /* Rank 1 alone comes back; the leader was never restarted. */
    uint64_t t0 = fi_wire_now_ms();
    s_spawn(f, 1, f->conf[1]);
    assert_true(s_wait_serving(c, 60000));
    printf("serving again %llu ms after rank 1 was restarted\n",
           (unsigned long long)(fi_wire_now_ms() - t0));
    assert_int_equal(f->pid[0], leader);
    assert_int_equal(kill(leader, 0), 0);
    s_send(c, &q, "after", S_PROMPT, 8);
    s_pump(c, &q, 1, 30000);
    assert_true(q.done);
    assert_int_equal(q.code, FI__ERROR_CODE__ERR_UNSPECIFIED);
    assert_memory_equal(q.text, want, q.len);
    assert_true(s_log_has(f, 0, "rank 1 joined"));
    fi_client_destroy(&c);
}

/* One POST to the edge agent's HTTP API on 127.0.0.1:port; the status,
 * and head + body in out. */
static int s_http_post(int port, const char *path, const char *body, char *out, size_t cap) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) return -1;
    char req[2048];
    int n = snprintf(req, sizeof req, "POST %s HTTP/1.0\r\nContent-Length: %zu\r\n\r\n%s", path,
                     strlen(body), body);
    if (send(fd, req, (size_t)n, 0) != n) return -1;
    size_t len = 0;
    for (;;) {
        ssize_t k = recv(fd, out + len, cap - len - 1, 0);
        if (k <= 0) break;
        len += (size_t)k;
    }
    close(fd);
    out[len] = 0;
    int status = 0;
    return sscanf(out, "HTTP/1.%*d %d", &status) == 1 ? status : -1;
}

/* The real edge agent (HTTP API, signed policy, its own fabric link)
 * routes a chat completion to the TP=2 group: 200, processed at the cluster,
 * the engine's text. */
static void test_edge_agent_to_group(void **state) {
    fixture *f = *state;
    char want[4096], err[768], path[700], conf[700], ekey[700], epub[700], cpub[700];
    s_engine_text(want, sizeof want, 8);
    fi_client *c = s_group_up(f); /* also proves the group serves */
    fi_client_destroy(&c);
    /* The edge's files: its key (enrolled in setup), the coordinator's
     * public key, a signed policy that permits routing to cluster core1. */
    const char *dir = f->h.dir;
    snprintf(ekey, sizeof ekey, "%s/edge.key", dir);
    snprintf(epub, sizeof epub, "%s/edge.pub", dir);
    snprintf(cpub, sizeof cpub, "%s/coord.pub", dir);
    assert_int_equal(fi_keys_save(&f->edge, ekey, epub, 1, err, sizeof err), 0);
    uint8_t pk[FI_BUNDLE_PK_BYTES], sk[FI_BUNDLE_SK_BYTES];
    assert_int_equal(fi_bundle_keygen(pk, sk), 0);
    snprintf(path, sizeof path, "%s/sign.key", dir);
    assert_int_equal(fi_bundle_key_save(path, sk, err, sizeof err), 0);
    snprintf(path, sizeof path, "%s/policy", dir);
    mkdir(path, 0700);
    static const char *pol = "labels public, internal;\ndefault_label \"internal\";\n"
                             "jurisdiction EU;\nregion eu-central in EU;\n"
                             "site berlin-clinic in eu-central;\ncluster core1 in eu-central;\n"
                             "permit \"anything in the EU\";\n";
    char *b = NULL;
    size_t bl = 0;
    int64_t now = (int64_t)time(NULL);
    assert_int_equal(fi_bundle_sign(sk, 1, now - 60, now + 3600, pol, strlen(pol), &b, &bl), 0);
    assert_int_equal(fi_bundle_install(path, b, bl, (const uint8_t(*)[32])pk, 1, time(NULL), err,
                                       sizeof err),
                     FI_BUNDLE_OK);
    free(b);
    snprintf(conf, sizeof conf, "%s/edge.conf", dir);
    FILE *fc = fopen(conf, "w");
    assert_non_null(fc);
    fprintf(fc,
            "site = berlin-clinic\nport = 0\ndb = %s/edge.db\npolicy_dir = %s/policy\n"
            "policy_key = %s/sign.key.pub\ncoordinator = %s\ncoordinator_key = %s\n"
            "secret_key = %s\nshutdown_grace_s = 1\nheartbeat_ms = %d\n",
            dir, dir, dir, f->h.ep, cpub, ekey, H_HB_MS);
    fclose(fc);
    fi_edge_conf ec;
    fi_edge_conf_default(&ec);
    if (fi_edge_conf_load(conf, &ec, err, sizeof err) != 0) fail_msg("%s", err);
    fi_edge *e = fi_edge_new(&ec, err, sizeof err);
    if (!e) fail_msg("%s", err);
    char out[16384];
    int status = 0;
    /* a chat, as OpenAI clients send one: the group renders it as the
     * single-process engine does */
    const char *body = "{\"model\":\"smollm2\",\"messages\":[{\"role\":\"user\",\"content\":\"" S_PROMPT
                       "\"}],\"max_tokens\":8,\"temperature\":0}";
    for (int k = 0; k < 100; k++) { /* until the edge's own link is up */
        status = s_http_post(fi_edge_port(e), "/v1/chat/completions", body, out, sizeof out);
        if (status == 200) break;
        h_sleep_ms(100);
    }
    printf("edge agent -> coordinator -> TP=2 group: HTTP %d\n%s\n", status,
           strstr(out, "\r\n\r\n") ? strstr(out, "\r\n\r\n") + 4 : out);
    assert_int_equal(status, 200);
    assert_non_null(strstr(out, "X-Fedinfer-Target: core1"));
    if (!strpbrk(want, "\"\\\n")) /* the text as JSON writes it, unescaped */
        assert_non_null(strstr(out, want));
    fi_edge_destroy(&e);
}

static void test_frozen_rank(void **state) {
    fixture *f = *state;
    fi_client *c = s_group_up(f);
    s_fault(f, c, SIGSTOP, "SIGSTOP");
    kill(f->pid[1], SIGCONT); /* it wakes up, finds its links gone, rejoins */
    if (!s_wait_serving(c, 20000)) {
        s_dump_logs(f);
        if (getenv("FI_GROUP_TEST_PAUSE")) { /* debugging: leave the ranks to look at */
            printf("ranks: %d %d\n", (int)f->pid[0], (int)f->pid[1]);
            fflush(stdout);
            h_sleep_ms(120000);
        }
        fail_msg("the group did not serve again after SIGCONT");
    }
    fi_client_destroy(&c);
}

/* The leader dies mid-generation: the edge's request ends (the
 * coordinator reports the worker dead); a new leader forms the group again
 * with the rank that kept running. */
static void test_leader_restart(void **state) {
    fixture *f = *state;
    fi_client *c = s_group_up(f);
    pid_t follower = f->pid[1];
    s_req q;
    s_send(c, &q, "long", "Write a long story about a dragon and a knight.", 400);
    uint64_t until = fi_wire_now_ms() + 30000;
    while (q.chunks < 2 && fi_wire_now_ms() < until) s_pump(c, &q, 1, 50);
    assert_true(q.chunks >= 2);
    uint64_t t0 = fi_wire_now_ms();
    s_kill(f, 0, SIGKILL);
    s_pump(c, &q, 1, 10000);
    assert_true(q.done);
    printf("leader killed: request ended %llu ms later: %s (%s)\n",
           (unsigned long long)(q.end_ms - t0), q.msg, fi_wire_error_name(q.code));
    assert_int_equal(q.code, FI__ERROR_CODE__ERR_PEER_DEAD);
    s_spawn(f, 0, f->conf[0]);
    assert_true(s_wait_serving(c, 60000));
    assert_int_equal(f->pid[1], follower); /* rank 1 was not restarted */
    assert_int_equal(kill(follower, 0), 0);
    fi_client_destroy(&c);
}

/* A leader whose rank never comes up says so, naming the rank and its
 * endpoint, instead of waiting silently. */
static void test_leader_alone_says_why(void **state) {
    fixture *f = *state;
    s_spawn(f, 0, f->conf[0]);
    const char *want = "waiting: rank 1: link down";
    for (int i = 0; i < 200 && !s_log_has(f, 0, want); i++) h_sleep_ms(100);
    if (!s_log_has(f, 0, want)) {
        s_dump_logs(f);
        fail_msg("the leader's log never said \"%s\"", want);
    }
}

static void test_wrong_model_refused(void **state) {
    fixture *f = *state;
    /* A copy of the model with its last byte changed: it loads, but it is
     * another file. */
    char copy[300], conf[300], cmd[1024];
    snprintf(copy, sizeof copy, "%s/other.gguf", f->h.dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", FI_TEST_MODEL, copy);
    assert_int_equal(system(cmd), 0);
    FILE *fp = fopen(copy, "r+b");
    assert_non_null(fp);
    fseek(fp, -1, SEEK_END);
    int b = fgetc(fp);
    fseek(fp, -1, SEEK_END);
    fputc(b ^ 1, fp);
    fclose(fp);
    snprintf(conf, sizeof conf, "%s/rank1-other.conf", f->h.dir);
    fp = fopen(conf, "w");
    fprintf(fp, "group_file = group.conf\nrank = 1\nsecret_key = rank1.key\nmodel = other.gguf\n"
                "threads = 1\n");
    fclose(fp);
    s_spawn(f, 0, f->conf[0]);
    s_spawn(f, 1, conf);
    int status = 0;
    pid_t got = 0;
    for (int i = 0; i < 600 && got == 0; i++) {
        got = waitpid(f->pid[1], &status, WNOHANG);
        if (!got) h_sleep_ms(100);
    }
    assert_int_equal(got, f->pid[1]);
    f->pid[1] = 0;
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 1);
    assert_true(s_log_has(f, 1, "refused at join: model digest"));
    assert_true(s_log_has(f, 1, "every rank must load the same model file"));
    for (int i = 0; i < 50 && !s_log_has(f, 0, "rank 1 refused at join"); i++) h_sleep_ms(100);
    assert_true(s_log_has(f, 0, "rank 1 refused at join: model digest"));
    /* The right file joins and the group serves. */
    fi_client *c = h_client(&f->h, &f->edge, FI__ROLE__ROLE_EDGE);
    s_spawn(f, 1, f->conf[1]);
    assert_true(s_wait_serving(c, 60000));
    fi_client_destroy(&c);
}

/* The ranks with the 8-bit KV cache (kv_bits = 8): each keeps its own KV
 * heads as int8 rows with a scale per head, as the whole model would, so
 * the group's greedy text is the single-process engine's with that cache;
 * the ranks' start-up lines say so. */
static int setup_kv8(void **state) {
    s_kv_bits = 8;
    return setup(state);
}

static int teardown_kv8(void **state) {
    s_kv_bits = 16;
    return teardown(state);
}

static void test_kv8_end_to_end(void **state) {
    fixture *f = *state;
    char want[4096];
    s_engine_text(want, sizeof want, 8);
    fi_client *c = s_group_up(f);
    s_req q;
    s_ask_as_engine(c, &q, "kv8", want);
    assert_true(s_log_has(f, 0, "8-bit KV cache") && s_log_has(f, 1, "8-bit KV cache"));
    fi_client_destroy(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_end_to_end_and_kill, setup, teardown),
        cmocka_unit_test_setup_teardown(test_edge_agent_to_group, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frozen_rank, setup, teardown),
        cmocka_unit_test_setup_teardown(test_leader_restart, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_model_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_leader_alone_says_why, setup, teardown),
        cmocka_unit_test_setup_teardown(test_kv8_end_to_end, setup_kv8, teardown_kv8),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
