/*
 * test_fabric_net.c - the fabric on loopback: a coordinator, an operator,
 * an edge and an echo worker exchange every message type; enrolment with
 * one-time tokens; unknown and revoked keys. (A worker killed mid-stream:
 * test_fabric_procs.c.)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <sqlite3.h>

#include "db_damage.h"
#include "fabric/harness.h"
#include "fi_audit.h"

static int setup(void **state) {
    harness *h = calloc(1, sizeof *h);
    if (!h || h_init(h) || h_start(h)) return -1;
    *state = h;
    return 0;
}

static int teardown(void **state) {
    harness *h = *state;
    h_stop(h);
    free(h);
    return 0;
}

/* Asks the coordinator for an enrolment token. */
static int s_token(fi_client *op, Fi__Role role, const char *site, const char *region,
                   char *tok, size_t toklen) {
    Fi__TokenRequest tr = FI__TOKEN_REQUEST__INIT;
    tr.role = role;
    tr.site = (char *)site;
    tr.region = (char *)region;
    tr.ttl_s = 60;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_TOKEN_REQUEST;
    m.token_request = &tr;
    fi_msg *r = NULL;
    char err[256];
    if (fi_client_call(op, &m, FI__ENVELOPE__BODY_TOKEN_REPLY, 3000, &r, err, sizeof err) != 1)
        return -1;
    int rc = r->body_case == FI__ENVELOPE__BODY_TOKEN_REPLY ? 0 : -1;
    if (!rc) snprintf(tok, toklen, "%s", r->token_reply->token);
    fi_wire_free(&r);
    return rc;
}

static void test_every_message_type(void **state) {
    harness *h = *state;
    char err[256], tok[64], fpr[FI_KEYS_FPR_LEN];
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR); /* hello, heartbeat */
    assert_non_null(op);

    /* Enrolment: token -> enrol (with the key of the new edge). */
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(s_token(op, FI__ROLE__ROLE_EDGE, "clinic-7", "eu-west", tok, sizeof tok), 0);
    fi_client_opts eo;
    h_client_opts(h, &eo, &ek, FI__ROLE__ROLE_EDGE);
    /* Before enrolment the key is refused on the fabric endpoint. */
    fi_client *early = fi_client_new(&eo, err, sizeof err);
    assert_non_null(early);
    assert_int_equal(fi_client_wait_ready(early, 1500, err, sizeof err), -1);
    fi_client_destroy(&early);
    /* A token for another site does not enrol. */
    assert_int_equal(fi_client_enrol(&eo, h->enrol_ep, tok, FI__ROLE__ROLE_EDGE, "clinic-8",
                                     "eu-west", 3000, fpr, err, sizeof err), -1);
    assert_non_null(strstr(err, "clinic-7"));
    assert_int_equal(fi_client_enrol(&eo, h->enrol_ep, tok, FI__ROLE__ROLE_EDGE, "clinic-7",
                                     "eu-west", 3000, fpr, err, sizeof err), 0);
    char want[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(ek.pub, want);
    assert_string_equal(fpr, want);
    /* One time only: a second key cannot use it. */
    fi_keypair other;
    assert_int_equal(fi_keys_generate(&other), 0);
    fi_client_opts oo = eo;
    oo.kp = other;
    assert_int_equal(fi_client_enrol(&oo, h->enrol_ep, tok, FI__ROLE__ROLE_EDGE, "clinic-7",
                                     "eu-west", 3000, fpr, err, sizeof err), -1);
    assert_non_null(strstr(err, "already used"));

    fi_client *edge = h_client(h, &ek, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    h_worker w;
    assert_int_equal(h_worker_start(h, &w, "smol", 0), 0);

    /* Inference request -> token-stream chunks -> final result. */
    h_text t;
    fi_client_result res;
    assert_int_equal(h_infer(edge, "r1", "smol", "hello fabric", &t, &res), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_UNSPECIFIED);
    assert_string_equal(t.buf, "echo: hello fabric");
    assert_string_equal(res.stop_reason, "eog");
    /* Error: no worker serves that model. */
    assert_int_equal(h_infer(edge, "r2", "nope", "x", &t, &res), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_NO_WORKER);

    /* Audit upload -> ack. */
    Fi__AuditUpload au = FI__AUDIT_UPLOAD__INIT;
    au.batch_id = (char *)"b1";
    au.first_seq = 1;
    au.count = 2;
    char *batch = h_audit_batch("clinic-7", 1, 2, "", NULL);
    assert_non_null(batch);
    au.batch.data = (uint8_t *)batch;
    au.batch.len = strlen(batch);
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_UPLOAD;
    m.audit_upload = &au;
    fi_msg *r = NULL;
    assert_int_equal(fi_client_call(edge, &m, FI__ENVELOPE__BODY_ACK, 3000, &r, err, sizeof err), 1);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ACK);
    assert_string_equal(r->ack->ref, "b1");
    fi_wire_free(&r);
    free(batch);

    /* Policy bundle push: stored and forwarded to the edge. */
    Fi__PolicyBundle pb = FI__POLICY_BUNDLE__INIT;
    pb.version = 7;
    pb.bundle.data = (uint8_t *)"signed-bundle";
    pb.bundle.len = 13;
    m.body_case = FI__ENVELOPE__BODY_POLICY_BUNDLE;
    m.policy_bundle = &pb;
    assert_int_equal(fi_client_call(op, &m, FI__ENVELOPE__BODY_ACK, 3000, &r, err, sizeof err), 1);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ACK);
    fi_wire_free(&r);
    int got = 0;
    for (int i = 0; i < 20 && !got; i++) {
        if (fi_client_recv(edge, 100, &r, err, sizeof err) == 1) {
            got = r->body_case == FI__ENVELOPE__BODY_POLICY_BUNDLE && r->policy_bundle->version == 7;
            fi_wire_free(&r);
        }
    }
    assert_true(got);
    /* An edge may not push a bundle. */
    assert_int_equal(fi_client_call(edge, &m, FI__ENVELOPE__BODY_ACK, 3000, &r, err, sizeof err), 1);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, FI__ERROR_CODE__ERR_UNAUTHORISED);
    fi_wire_free(&r);

    /* Status: every enrolled peer, with its health. */
    Fi__StatusRequest sq = FI__STATUS_REQUEST__INIT;
    m.body_case = FI__ENVELOPE__BODY_STATUS_REQUEST;
    m.status_request = &sq;
    assert_int_equal(
        fi_client_call(op, &m, FI__ENVELOPE__BODY_STATUS_REPLY, 3000, &r, err, sizeof err), 1);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_STATUS_REPLY);
    assert_int_equal(r->status_reply->n_peers, 3);
    int edges = 0, clusters = 0;
    for (size_t i = 0; i < r->status_reply->n_peers; i++) {
        Fi__PeerStatus *ps = r->status_reply->peers[i];
        assert_true(ps->connected);
        if (ps->role == FI__ROLE__ROLE_EDGE) {
            edges++;
            assert_string_equal(ps->site, "clinic-7");
        }
        if (ps->role == FI__ROLE__ROLE_CLUSTER) {
            clusters++;
            assert_int_equal(ps->n_models, 1);
            assert_string_equal(ps->models[0]->name, "smol");
        }
    }
    assert_int_equal(edges, 1);
    assert_int_equal(clusters, 1);
    fi_wire_free(&r);
    /* An edge may not ask for status or tokens. */
    assert_int_equal(
        fi_client_call(edge, &m, FI__ENVELOPE__BODY_STATUS_REPLY, 3000, &r, err, sizeof err), 1);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    fi_wire_free(&r);

    h_worker_stop(&w);
    fi_client_destroy(&edge);
    fi_client_destroy(&op);
}

static void test_unknown_key_refused(void **state) {
    harness *h = *state;
    fi_keypair k;
    char err[256];
    assert_int_equal(fi_keys_generate(&k), 0);
    fi_client_opts o;
    h_client_opts(h, &o, &k, FI__ROLE__ROLE_EDGE);
    fi_client *c = fi_client_new(&o, err, sizeof err);
    assert_non_null(c);
    assert_int_equal(fi_client_wait_ready(c, 2000, err, sizeof err), -1);
    assert_non_null(strstr(err, "refused"));
    fi_client_destroy(&c);
    /* A client that trusts another server key never completes either. */
    fi_keypair fake;
    assert_int_equal(fi_keys_generate(&fake), 0);
    h_client_opts(h, &o, &h->op, FI__ROLE__ROLE_OPERATOR);
    memcpy(o.server_pub, fake.pub, FI_KEYS_BYTES);
    c = fi_client_new(&o, err, sizeof err);
    assert_non_null(c);
    assert_int_equal(fi_client_wait_ready(c, 1000, err, sizeof err), -1);
    fi_client_destroy(&c);
}

/* A raw CURVE DEALER with a monitor, to watch the connection itself. */
typedef struct s_raw {
    void *ctx, *sock, *mon;
} s_raw;

static int s_raw_open(s_raw *r, const harness *h, const fi_keypair *kp) {
    fi_sockopts so;
    char err[256];
    fi_sockopts_default(&so);
    so.reconnect_ms = 50;
    r->ctx = zmq_ctx_new();
    r->sock = zmq_socket(r->ctx, ZMQ_DEALER);
    if (fi_sock_client(r->sock, kp, h->coord.pub, &so, err, sizeof err)) return -1;
    if (zmq_socket_monitor(r->sock, "inproc://raw-mon", ZMQ_EVENT_DISCONNECTED)) return -1;
    r->mon = zmq_socket(r->ctx, ZMQ_PAIR);
    zmq_connect(r->mon, "inproc://raw-mon");
    return zmq_connect(r->sock, h->ep);
}

static void s_raw_close(s_raw *r) {
    zmq_close(r->mon);
    zmq_close(r->sock);
    zmq_ctx_term(r->ctx);
}

/* Sends bytes and returns the decoded answer (NULL when none in ms). */
static fi_msg *s_raw_ask(s_raw *r, const void *buf, size_t len, int ms) {
    zmq_send(r->sock, buf, len, 0);
    uint64_t end = fi_wire_now_ms() + (uint64_t)ms;
    while (fi_wire_now_ms() < end) {
        zmq_pollitem_t it = {r->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 50) <= 0) continue;
        char rbuf[4096];
        int n = zmq_recv(r->sock, rbuf, sizeof rbuf, 0);
        if (n < 0) continue;
        Fi__ErrorCode code;
        char err[128];
        fi_msg *m = fi_wire_decode(rbuf, (size_t)n, 0, &code, err, sizeof err);
        if (m && m->body_case == FI__ENVELOPE__BODY_HEARTBEAT) {
            fi_wire_free(&m);
            continue;
        }
        return m;
    }
    return NULL;
}

/* Asks the coordinator, as op, to revoke fpr: 0 Ack, else the error code
 * with its message in why. */
static int s_revoke(fi_client *op, const char *fpr, char *why, size_t wlen) {
    Fi__RevokeRequest rr = FI__REVOKE_REQUEST__INIT;
    rr.fingerprint = (char *)fpr;
    fi_msg req = FI__ENVELOPE__INIT;
    req.body_case = FI__ENVELOPE__BODY_REVOKE_REQUEST;
    req.revoke_request = &rr;
    fi_msg *r = NULL;
    char err[256];
    if (fi_client_call(op, &req, FI__ENVELOPE__BODY_ACK, 3000, &r, err, sizeof err) != 1) return -1;
    int code = r->body_case == FI__ENVELOPE__BODY_ACK ? 0 : (int)r->error->code;
    if (code) snprintf(why, wlen, "%s", r->error->message);
    fi_wire_free(&r);
    return code;
}

static void test_revoked_key_cut_off(void **state) {
    harness *h = *state;
    char err[256];
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "s1", "r1"), 0);
    /* The edge's connection, watched at the socket level. */
    s_raw raw = {NULL, NULL, NULL};
    assert_int_equal(s_raw_open(&raw, h, &ek), 0);
    size_t len;
    uint8_t *hb = fi_wire_heartbeat(1, &len);
    fi_msg *m = s_raw_ask(&raw, hb, len, 300); /* registers it */
    fi_wire_free(&m);
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    assert_non_null(op);
    char fpr[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(ek.pub, fpr);
    zmq_send(raw.sock, hb, len, 0); /* alive and registered right now */
    h_sleep_ms(20);
    assert_int_equal(s_revoke(op, fpr, err, sizeof err), 0);
    /* The open connection is closed by the coordinator, well before the
     * raw socket's own heartbeat timeout (3 s) could have closed it. */
    zmq_pollitem_t it = {raw.mon, 0, ZMQ_POLLIN, 0};
    assert_int_equal(zmq_poll(&it, 1, 1000), 1);
    /* ... and nothing it sends is answered any more (reconnects fail);
     * at most the error sent just before the cut arrives. */
    m = s_raw_ask(&raw, hb, len, 500);
    if (m) {
        assert_int_equal(m->body_case, FI__ENVELOPE__BODY_ERROR);
        assert_int_equal(m->error->code, FI__ERROR_CODE__ERR_REVOKED);
        fi_wire_free(&m);
        m = s_raw_ask(&raw, hb, len, 500);
    }
    assert_null(m);
    free(hb);
    s_raw_close(&raw);
    /* A fresh client with the key is refused at the handshake. */
    fi_client_opts o;
    h_client_opts(h, &o, &ek, FI__ROLE__ROLE_EDGE);
    fi_client *c = fi_client_new(&o, err, sizeof err);
    assert_int_equal(fi_client_wait_ready(c, 2000, err, sizeof err), -1);
    assert_non_null(strstr(err, "refused"));
    fi_client_destroy(&c);
    fi_client_destroy(&op);
}

/* Revoking a peer whose connection already closed (the coordinator not
 * knowing yet) never cuts the connection that now has its socket number,
 * even from the same host: here the operator's own, opened right after
 * (the revoke was applied, but the operator saw no reply). */
static void test_revoke_spares_a_reused_socket(void **state) {
    harness *h = *state;
    char err[256];
    for (int round = 0; round < 3; round++) {
        fi_keypair ek;
        assert_int_equal(fi_keys_generate(&ek), 0);
        char site[16];
        snprintf(site, sizeof site, "s9%d", round);
        assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, site, "r1"), 0);
        s_raw raw = {NULL, NULL, NULL};
        assert_int_equal(s_raw_open(&raw, h, &ek), 0);
        size_t len;
        uint8_t *hb = fi_wire_heartbeat(1, &len);
        fi_msg *m = s_raw_ask(&raw, hb, len, 300); /* registers it, with its socket */
        fi_wire_free(&m);
        free(hb);
        s_raw_close(&raw); /* gone; its socket number is free again */
        fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
        assert_non_null(op);
        char fpr[FI_KEYS_FPR_LEN];
        fi_keys_fingerprint(ek.pub, fpr);
        assert_int_equal(s_revoke(op, fpr, err, sizeof err), 0);
        fi_client_destroy(&op);
        fi_keys_wipe(&ek);
    }
}

/* The last operator cannot revoke itself (nobody would be left to manage
 * the fleet); a key revoked already says so. */
static void test_last_operator_kept(void **state) {
    harness *h = *state;
    char why[256] = "", fpr[FI_KEYS_FPR_LEN];
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    assert_non_null(op);
    fi_keys_fingerprint(h->op.pub, fpr);
    assert_int_equal(s_revoke(op, fpr, why, sizeof why), FI__ERROR_CODE__ERR_BAD_REQUEST);
    assert_non_null(strstr(why, "last operator"));
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "s11", "r1"), 0);
    fi_keys_fingerprint(ek.pub, fpr);
    assert_int_equal(s_revoke(op, fpr, why, sizeof why), 0);
    assert_int_equal(s_revoke(op, fpr, why, sizeof why), FI__ERROR_CODE__ERR_BAD_REQUEST);
    assert_non_null(strstr(why, "revoked already"));
    fi_client_destroy(&op);
}

/* Sends, without waiting for the answer, an inference request (id, model,
 * prompt) from the edge client c. */
static void s_send_infer(fi_client *c, const char *id, const char *model, const char *prompt) {
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)id;
    rq.model = (char *)model;
    rq.prompt = (char *)prompt;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_INFER;
    m.infer = &rq;
    assert_int_equal(fi_client_send(c, &m), 0);
}

/* Another process holding the fleet database's write lock (a sqlite3
 * shell, a backup) fails an operator's request soon, saying why; the
 * coordinator does not stall its loop (SQLite's 5 s wait there stopped
 * every peer's traffic, and fedctl saw no reply at all). */
static void test_locked_store_answers(void **state) {
    harness *h = *state;
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    assert_non_null(op);
    sqlite3 *other;
    assert_int_equal(sqlite3_open(h->db, &other), SQLITE_OK);
    assert_int_equal(sqlite3_exec(other, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
    Fi__TokenRequest tr = FI__TOKEN_REQUEST__INIT;
    tr.role = FI__ROLE__ROLE_EDGE;
    tr.site = (char *)"s12";
    tr.region = (char *)"r1";
    tr.ttl_s = 60;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_TOKEN_REQUEST;
    m.token_request = &tr;
    fi_msg *r = NULL;
    char err[256];
    uint64_t t0 = fi_wire_now_ms();
    assert_int_equal(fi_client_call(op, &m, FI__ENVELOPE__BODY_TOKEN_REPLY, 3000, &r, err, sizeof err), 1);
    assert_true(fi_wire_now_ms() - t0 < 2000);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_ERROR);
    assert_non_null(strstr(r->error->message, "locked"));
    fi_wire_free(&r);
    assert_int_equal(sqlite3_exec(other, "ROLLBACK", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(other);
    char tok[128];
    assert_int_equal(s_token(op, FI__ROLE__ROLE_EDGE, "s12", "r1", tok, sizeof tok), 0);
    fi_client_destroy(&op);
}

static void test_revoked_client_told(void **state) {
    harness *h = *state;
    char err[256];
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "s2", "r1"), 0);
    fi_client *edge = h_client(h, &ek, FI__ROLE__ROLE_EDGE);
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    assert_non_null(edge);
    assert_non_null(op);
    Fi__RevokeRequest rr = FI__REVOKE_REQUEST__INIT;
    char fpr[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(ek.pub, fpr);
    rr.fingerprint = fpr;
    fi_msg req = FI__ENVELOPE__INIT;
    req.body_case = FI__ENVELOPE__BODY_REVOKE_REQUEST;
    req.revoke_request = &rr;
    fi_msg *r = NULL;
    assert_int_equal(fi_client_call(op, &req, FI__ENVELOPE__BODY_ACK, 3000, &r, err, sizeof err), 1);
    fi_wire_free(&r);
    int rc = 0;
    for (int i = 0; i < 40 && rc >= 0; i++) {
        rc = fi_client_recv(edge, 100, &r, err, sizeof err);
        fi_wire_free(&r);
    }
    assert_int_equal(rc, -1);
    fi_client_destroy(&edge);
    fi_client_destroy(&op);
}

static void test_bad_messages_answered(void **state) {
    harness *h = *state;
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "s4", "r1"), 0);
    s_raw raw = {NULL, NULL, NULL};
    assert_int_equal(s_raw_open(&raw, h, &ek), 0);
    struct {
        const uint8_t *b;
        size_t n;
        Fi__ErrorCode want;
    } cases[] = {
        {(const uint8_t *)"\x5a\x7f\x01", 3, FI__ERROR_CODE__ERR_MALFORMED},
        {(const uint8_t *)"\x08\x02\x5a\x00", 4, FI__ERROR_CODE__ERR_BAD_VERSION},
        {(const uint8_t *)"\x08\x01\x9a\x06\x00", 5, FI__ERROR_CODE__ERR_UNKNOWN_TYPE},
        {(const uint8_t *)"\x08\x01", 2, FI__ERROR_CODE__ERR_UNKNOWN_TYPE},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fi_msg *m = s_raw_ask(&raw, cases[i].b, cases[i].n, 1000);
        assert_non_null(m);
        assert_int_equal(m->body_case, FI__ENVELOPE__BODY_ERROR);
        assert_int_equal(m->error->code, cases[i].want);
        fi_wire_free(&m);
    }
    /* Two frames: one message is one frame. */
    size_t len;
    uint8_t *hb = fi_wire_heartbeat(1, &len);
    zmq_send(raw.sock, hb, len, ZMQ_SNDMORE);
    fi_msg *m = s_raw_ask(&raw, hb, len, 1000);
    assert_non_null(m);
    assert_int_equal(m->error->code, FI__ERROR_CODE__ERR_MALFORMED);
    fi_wire_free(&m);
    /* A message type an edge may not send here (enrol belongs to the
     * enrolment endpoint). */
    Fi__Enrol en = FI__ENROL__INIT;
    en.token = (char *)"x";
    fi_msg e = FI__ENVELOPE__INIT;
    e.body_case = FI__ENVELOPE__BODY_ENROL;
    e.enrol = &en;
    size_t elen;
    uint8_t *eb = fi_wire_encode(&e, &elen);
    m = s_raw_ask(&raw, eb, elen, 1000);
    free(eb);
    assert_non_null(m);
    assert_int_equal(m->error->code, FI__ERROR_CODE__ERR_UNKNOWN_TYPE);
    fi_wire_free(&m);
    /* Over ZMQ_MAXMSGSIZE: no reply is possible, libzmq drops the
     * connection; the coordinator carries on. */
    size_t big = 2 * FI_WIRE_MAX_MSG;
    uint8_t *huge = calloc(1, big);
    zmq_send(raw.sock, huge, big, 0);
    free(huge);
    zmq_pollitem_t it = {raw.mon, 0, ZMQ_POLLIN, 0};
    assert_int_equal(zmq_poll(&it, 1, 2000), 1); /* disconnected */
    free(hb);
    s_raw_close(&raw);
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    assert_non_null(op);
    fi_client_destroy(&op);
}

static void test_capacity_and_cancel(void **state) {
    harness *h = *state;
    char err[256];
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "s5", "r1"), 0);
    fi_client *edge = h_client(h, &ek, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    h_worker w;
    assert_int_equal(h_worker_start_cap(h, &w, "one", 50, 1), 0);
    s_send_infer(edge, "first", "one", "a fairly long prompt to keep the only slot busy for a while");
    /* The second finds the worker at capacity: busy, not "no worker". */
    h_text t;
    fi_client_result res;
    assert_int_equal(h_infer(edge, "second", "one", "x", &t, &res), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_BUSY);
    /* Cancel the first: the slot frees, and no more of its stream comes. */
    Fi__Cancel cn = FI__CANCEL__INIT;
    cn.request_id = (char *)"first";
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_CANCEL;
    m.cancel = &cn;
    assert_int_equal(fi_client_send(edge, &m), 0);
    h_sleep_ms(150);
    fi_msg *r = NULL;
    while (fi_client_recv(edge, 100, &r, err, sizeof err) == 1) fi_wire_free(&r);
    assert_int_equal(h_infer(edge, "third", "one", "ok", &t, &res), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_UNSPECIFIED);
    assert_string_equal(t.buf, "echo: ok");
    h_worker_stop(&w);
    fi_client_destroy(&edge);
}

static int setup_in_flight(void **state) {
    harness *h = calloc(1, sizeof *h);
    if (!h || h_init(h)) return -1;
    h->max_in_flight = 2;
    if (h_start(h)) return -1;
    *state = h;
    return 0;
}

/* max_in_flight bounds a key's open requests over all its connections: a
 * second connection of the same key that never says Hello (so it does
 * not replace the first) gets no budget of its own. */
static void test_in_flight_per_key(void **state) {
    harness *h = *state;
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "s5", "r1"), 0);
    h_worker w;
    assert_int_equal(h_worker_start_cap(h, &w, "one", 300, 10), 0);
    s_raw a, b;
    assert_int_equal(s_raw_open(&a, h, &ek), 0);
    assert_int_equal(s_raw_open(&b, h, &ek), 0);
    const char *ids[] = {"a1", "a2", "b1"};
    uint8_t *enc[3];
    size_t len[3];
    for (int i = 0; i < 3; i++) {
        Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
        rq.request_id = (char *)ids[i];
        rq.model = (char *)"one";
        rq.prompt = (char *)"a slow answer";
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_INFER;
        m.infer = &rq;
        enc[i] = fi_wire_encode(&m, &len[i]);
        assert_non_null(enc[i]);
    }
    zmq_send(a.sock, enc[0], len[0], 0);
    zmq_send(a.sock, enc[1], len[1], 0);
    h_sleep_ms(200); /* both admitted, and slow (300 ms a token) */
    fi_msg *m = s_raw_ask(&b, enc[2], len[2], 2000);
    assert_non_null(m);
    if (m->body_case != FI__ENVELOPE__BODY_ERROR)
        fail_msg("the other connection's request was admitted (answer %d)", (int)m->body_case);
    printf("  %s: %s\n", fi_wire_error_name(m->error->code), m->error->message);
    assert_int_equal(m->error->code, FI__ERROR_CODE__ERR_BUSY);
    assert_non_null(strstr(m->error->message, "from this key (max_in_flight 2"));
    fi_wire_free(&m);
    for (int i = 0; i < 3; i++)
        free(enc[i]);
    s_raw_close(&a);
    s_raw_close(&b);
    h_worker_stop(&w);
    fi_keys_wipe(&ek);
}

/* A new edge key of site, enrolled and connected. */
static fi_client *s_new_edge(harness *h, const char *site) {
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, site, "r1"), 0);
    fi_client *edge = h_client(h, &ek, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    fi_keys_wipe(&ek);
    return edge;
}

/* Receives on the edge for ms (heartbeats carry the clusters' load). */
static void s_listen(fi_client *edge, int ms) {
    uint64_t end = fi_wire_now_ms() + (uint64_t)ms;
    while (fi_wire_now_ms() < end) {
        fi_msg *m = NULL;
        char err[128];
        (void)fi_client_recv(edge, 10, &m, err, sizeof err);
        fi_wire_free(&m);
    }
}

/* The edge's view of the clusters follows the workers: a model's row
 * comes with its worker and goes with it, also when it was the last
 * worker (a heartbeat without rows says none is live, and the edge must
 * not keep routing to a cluster with nobody there). */
static void test_edge_view_follows_workers(void **state) {
    harness *h = *state;
    fi_client *edge = s_new_edge(h, "s6");
    fi_cluster_load L[4];
    int trunc = -1;
    uint64_t heard = 0;
    h_worker w;
    assert_int_equal(h_worker_start_cap(h, &w, "solo", 0, 2), 0);
    s_listen(edge, 3 * H_HB_MS);
    assert_int_equal(fi_client_cluster_loads(edge, L, 4, &heard, &trunc), 1);
    assert_int_equal(trunc, 0);
    assert_string_equal(L[0].model, "solo");
    assert_int_equal(L[0].workers, 1);
    assert_int_equal(L[0].capacity, 2);
    h_worker_stop(&w);
    /* the coordinator notices within its liveness, then tells the edges */
    s_listen(edge, (H_LIVENESS + 3) * H_HB_MS);
    assert_int_equal(fi_client_cluster_loads(edge, L, 4, &heard, &trunc), 0);
    assert_int_equal(trunc, 0);
    assert_true(heard > 0 && fi_wire_now_ms() - heard <= 3 * H_HB_MS);
    fi_client_destroy(&edge);
}

/* Witnesses on the wire: an edge hears the head of the coordinator's
 * audit log in its heartbeats and keeps it; witnesses it says that are
 * malformed (record 0, a hash that is not 64 lower-case hex digits) are
 * ignored, the coordinator serves on, and verify counts the edge's valid
 * one. */
static void test_audit_witness_wire(void **state) {
    harness *h = *state;
    char audit[400], err[300];
    snprintf(audit, sizeof audit, "%s.audit", h->db);
    assert_int_equal(fi_test_audit_fill(audit, 5, err, sizeof err), 0);
    fi_audit *a = fi_audit_open_readonly(audit, err, sizeof err);
    assert_non_null(a);
    int64_t head_seq;
    char head[65];
    assert_int_equal(fi_audit_head(a, &head_seq, head, err, sizeof err), 0);
    fi_audit_destroy(&a);
    assert_true(head_seq == 5);
    fi_client *edge = s_new_edge(h, "s7");
    int64_t seq = 0;
    char hash[65];
    unsigned gen0 = fi_client_audit_witness(edge, &seq, hash);
    assert_true(seq == 0); /* none before a heartbeat */
    s_listen(edge, 4 * H_HB_MS);
    assert_true(fi_client_audit_witness(edge, &seq, hash) != gen0);
    assert_true(seq == 5);
    assert_string_equal(hash, head);
    const char *bad_hash[] = {head, "ABC", NULL};
    const uint64_t bad_seq[] = {0, 5, 5};
    char upper[65];
    snprintf(upper, sizeof upper, "%s", head);
    upper[0] = upper[0] >= 'a' ? 'A' : '?';
    bad_hash[2] = upper;
    for (int i = 0; i < 3; i++) {
        Fi__AuditHead ah = FI__AUDIT_HEAD__INIT;
        ah.seq = bad_seq[i];
        ah.hash = (char *)bad_hash[i];
        Fi__Heartbeat hb = FI__HEARTBEAT__INIT;
        hb.audit_head = &ah;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_HEARTBEAT;
        m.heartbeat = &hb;
        assert_int_equal(fi_client_send(edge, &m), 0);
    }
    s_listen(edge, 2 * H_HB_MS);
    fi_msg *r = h_audit_verify(h);
    assert_non_null(r);
    if (!r->audit_verify_reply->intact) fail_msg("verify: %s", r->audit_verify_reply->what);
    assert_true(r->audit_verify_reply->records == 5 && r->audit_verify_reply->witnesses == 1);
    fi_wire_free(&r);
    fi_client_destroy(&edge);
}

/* fedctl audit verify runs off the coordinator's loop: on a log of
 * 20,000 records, a status request sent after it is answered first, and
 * a second verify while the first runs is refused busy; the verify's
 * own answer comes last. (On the loop, the walk held every other
 * message back: seconds on a large log, long enough for edges to call
 * the coordinator dead.) */
static void test_audit_verify_off_loop(void **state) {
    harness *h = *state;
    char audit[400], err[300];
    snprintf(audit, sizeof audit, "%s.audit", h->db);
    assert_int_equal(fi_test_audit_fill(audit, 20000, err, sizeof err), 0);
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    assert_non_null(op);
    Fi__AuditVerifyRequest vq = FI__AUDIT_VERIFY_REQUEST__INIT;
    fi_msg v = FI__ENVELOPE__INIT;
    v.body_case = FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST;
    v.audit_verify_request = &vq;
    Fi__StatusRequest sq = FI__STATUS_REQUEST__INIT;
    fi_msg st = FI__ENVELOPE__INIT;
    st.body_case = FI__ENVELOPE__BODY_STATUS_REQUEST;
    st.status_request = &sq;
    assert_int_equal(fi_client_send(op, &v), 0);
    assert_int_equal(fi_client_send(op, &v), 0);
    assert_int_equal(fi_client_send(op, &st), 0);
    fi_msg_type got[3];
    int n = 0;
    uint64_t end = fi_wire_now_ms() + 30000;
    while (n < 3 && fi_wire_now_ms() < end) {
        fi_msg *m = NULL;
        if (fi_client_recv(op, 100, &m, err, sizeof err) != 1) continue;
        got[n] = m->body_case;
        if (m->body_case == FI__ENVELOPE__BODY_ERROR)
            assert_int_equal(m->error->code, FI__ERROR_CODE__ERR_BUSY);
        if (m->body_case == FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY) {
            assert_true(m->audit_verify_reply->intact);
            assert_true(m->audit_verify_reply->records == 20000);
        }
        print_message("reply %d: %s\n", n, fi_wire_type_name(m->body_case));
        n++;
        fi_wire_free(&m);
    }
    assert_int_equal(n, 3);
    assert_int_equal(got[0], FI__ENVELOPE__BODY_ERROR);
    assert_int_equal(got[1], FI__ENVELOPE__BODY_STATUS_REPLY);
    assert_int_equal(got[2], FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY);
    /* and the next one runs */
    fi_msg *r = NULL;
    assert_int_equal(fi_client_call(op, &v, FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY, 30000, &r, err, sizeof err), 1);
    assert_int_equal(r->body_case, FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY);
    fi_wire_free(&r);
    fi_client_destroy(&op);
}

/* n clusters c00, c01, ... each with one echo worker of model, in h. */
static h_worker *s_clusters(harness *h, int n, const char *model) {
    h_worker *w = calloc((size_t)n, sizeof *w);
    assert_non_null(w);
    for (int i = 0; i < n; i++) {
        char site[16];
        snprintf(site, sizeof site, "c%02d", i);
        fi_shard_backend be = fi_shard_echo_backend(4, 0);
        assert_int_equal(h_worker_start_be(h, &w[i], model, site, &be, 4), 0);
        w[i].owns_be = 1;
    }
    return w;
}

static void s_clusters_stop(h_worker **w, int n) {
    for (int i = 0; i < n; i++) h_worker_stop(&(*w)[i]);
    free(*w);
    *w = NULL;
}

/* The edge's rows now: malloc'd, *n of them, truncated or not. */
static fi_cluster_load *s_rows(fi_client *edge, int *n, int *trunc) {
    uint64_t heard = 0;
    *n = fi_client_cluster_loads(edge, NULL, 0, &heard, trunc);
    fi_cluster_load *L = calloc((size_t)*n + 1, sizeof *L);
    assert_non_null(L);
    assert_int_equal(fi_client_cluster_loads(edge, L, *n, &heard, trunc), *n);
    assert_true(heard > 0);
    return L;
}

/* Edges hear of every (cluster, model) with a live worker, however many:
 * 66 clusters, 66 rows (the coordinator sent the first 64, and the edge
 * read the 65th and 66th as clusters without a live worker). */
static void test_edge_view_many_clusters(void **state) {
    harness *h = *state;
    enum { NC = 66 };
    h_worker *w = s_clusters(h, NC, "mX");
    fi_client *edge = s_new_edge(h, "s15");
    s_listen(edge, 4 * H_HB_MS);
    int n = 0, trunc = -1;
    fi_cluster_load *L = s_rows(edge, &n, &trunc);
    assert_int_equal(trunc, 0);
    assert_int_equal(n, NC);
    for (int i = 0; i < NC; i++) { /* in order of cluster names */
        char site[16];
        snprintf(site, sizeof site, "c%02d", i);
        assert_string_equal(L[i].cluster, site);
        assert_string_equal(L[i].model, "mX");
        assert_int_equal(L[i].workers, 1);
        assert_int_equal(L[i].capacity, 4);
    }
    free(L);
    fi_client_destroy(&edge);
    s_clusters_stop(&w, NC);
}

static int setup_small_msg(void **state) {
    harness *h = calloc(1, sizeof *h);
    if (!h || h_init(h)) return -1;
    h->max_msg = 4096;
    if (h_start(h)) return -1;
    *state = h;
    return 0;
}

/* A heartbeat keeps within the coordinator's message limit (max_msg,
 * here 4 KiB; FI_WIRE_MAX_LOAD_ROWS rows at most anyway): the rows that
 * do not fit are left out, and the heartbeat says so, so that an edge
 * reads the clusters it is not told about as unknown rather than as
 * clusters without a live worker. */
static void test_edge_view_truncated(void **state) {
    harness *h = *state;
    enum { NC = 66 };
    char model[61];
    memset(model, 'm', 60);
    model[60] = 0;
    h_worker *w = s_clusters(h, NC, model); /* rows of about 80 bytes: some 50 fit */
    fi_client *edge = s_new_edge(h, "s16");
    s_listen(edge, 4 * H_HB_MS);
    int n = 0, trunc = -1;
    fi_cluster_load *L = s_rows(edge, &n, &trunc);
    print_message("max_msg 4096: %d of %d rows sent, truncated %d\n", n, NC, trunc);
    assert_int_equal(trunc, 1);
    assert_true(n > 10 && n < NC);
    for (int i = 0; i < n; i++) { /* the first ones in name order */
        char site[16];
        snprintf(site, sizeof site, "c%02d", i);
        assert_string_equal(L[i].cluster, site);
    }
    free(L);
    /* once the others are gone, the one left fits: the rows are whole
     * again */
    for (int i = 0; i < NC - 1; i++) h_worker_stop(&w[i]);
    s_listen(edge, (H_LIVENESS + 3) * H_HB_MS);
    L = s_rows(edge, &n, &trunc);
    assert_int_equal(trunc, 0); /* one row fits */
    assert_int_equal(n, 1);
    assert_string_equal(L[0].cluster, "c65");
    free(L);
    fi_client_destroy(&edge);
    h_worker_stop(&w[NC - 1]);
    free(w);
}

/* A raw worker of site (a fi_client that answers nothing): models[i]
 * with capacity caps[i]. */
static fi_client *s_raw_worker(harness *h, const char *site, int n, const char *const *models,
                               const uint32_t *caps) {
    fi_keypair kp;
    char err[256];
    assert_int_equal(fi_keys_generate(&kp), 0);
    assert_int_equal(h_enrol_direct(h, &kp, FI__ROLE__ROLE_CLUSTER, site, "r1"), 0);
    fi_client_opts o;
    h_client_opts(h, &o, &kp, FI__ROLE__ROLE_CLUSTER);
    o.n_models = n;
    for (int i = 0; i < n; i++) {
        snprintf(o.models[i], sizeof o.models[i], "%s", models[i]);
        o.capacity[i] = caps[i];
    }
    fi_client *c = fi_client_new(&o, err, sizeof err);
    assert_non_null(c);
    assert_int_equal(fi_client_wait_ready(c, 5000, err, sizeof err), 0);
    return c;
}

/* Keeps the edge and the raw workers talking for ms; counts the Infers
 * each worker got in got[]. */
static void s_pump(fi_client *edge, fi_client **w, int nw, int *got, int ms) {
    uint64_t end = fi_wire_now_ms() + (uint64_t)ms;
    while (fi_wire_now_ms() < end) {
        char err[128];
        for (int i = 0; i < nw; i++) {
            fi_msg *m = NULL;
            if (fi_client_recv(w[i], 0, &m, err, sizeof err) == 1 &&
                m->body_case == FI__ENVELOPE__BODY_INFER)
                got[i]++;
            fi_wire_free(&m);
        }
        fi_msg *m = NULL;
        (void)fi_client_recv(edge, 5, &m, err, sizeof err);
        fi_wire_free(&m);
    }
}

/* The row of (cluster, model) the edge holds now; fails when none. */
static fi_cluster_load s_row(fi_client *edge, const char *cluster, const char *model) {
    fi_cluster_load L[8];
    uint64_t heard = 0;
    int n = fi_client_cluster_loads(edge, L, 8, &heard, NULL);
    for (int i = 0; i < n && i < 8; i++)
        if (!strcmp(L[i].cluster, cluster) && !strcmp(L[i].model, model)) return L[i];
    fail_msg("no row for %s/%s", cluster, model);
    return L[0];
}

/* A worker serving two models counts in the row of each with its open
 * requests of both (they share its slots: the coordinator admits a
 * request for m1 while its open requests are under its m1 capacity), but
 * at most its capacity for the row's model: here A (m1: 2, m2: 8) has 6
 * m2 requests open and B (m1: 2) none, and the m1 row says 2 of 4 busy,
 * which is the room the coordinator admits into. It said 6 of 4: full,
 * and an edge kept m1 requests away from B's free slots. */
static void test_edge_view_multi_model_worker(void **state) {
    harness *h = *state;
    const char *ab[2] = {"m1", "m2"};
    uint32_t cap_a[2] = {2, 8}, cap_b[1] = {2};
    fi_client *w[2] = {s_raw_worker(h, "cm", 2, ab, cap_a), s_raw_worker(h, "cm", 1, ab, cap_b)};
    fi_client *edge = s_new_edge(h, "s17");
    int got[2] = {0, 0};
    for (int i = 0; i < 6; i++) {
        char id[16];
        snprintf(id, sizeof id, "mm-%d", i);
        s_send_infer(edge, id, "m2", "x");
    }
    s_pump(edge, w, 2, got, 4 * H_HB_MS);
    assert_int_equal(got[0], 6);
    fi_cluster_load r1 = s_row(edge, "cm", "m1"), r2 = s_row(edge, "cm", "m2");
    print_message("m1 row: %u of %u busy, %u workers; m2 row: %u of %u\n", r1.in_flight,
                  r1.capacity, r1.workers, r2.in_flight, r2.capacity);
    assert_int_equal(r1.workers, 2);
    assert_int_equal(r1.capacity, 4);
    assert_int_equal(r1.in_flight, 2);
    assert_int_equal(r2.capacity, 8);
    assert_int_equal(r2.in_flight, 6);
    /* and the room is real: an m1 request goes to B */
    s_send_infer(edge, "mm-m1", "m1", "x");
    s_pump(edge, w, 2, got, 3 * H_HB_MS);
    assert_int_equal(got[1], 1);
    fi_client_destroy(&edge);
    for (int i = 0; i < 2; i++) fi_client_destroy(&w[i]);
}

/* A worker answers a request with a code about the edge's connection
 * (revoked): it is the request's error only, as an engine error, and the
 * edge stays connected and served. */
static fi_keypair s_rogue_key;
static atomic_int s_rogue_stop;
static harness *s_rogue_h;

static void *s_rogue(void *arg) {
    (void)arg;
    fi_client_opts o;
    char err[256];
    h_client_opts(s_rogue_h, &o, &s_rogue_key, FI__ROLE__ROLE_CLUSTER);
    o.n_models = 1;
    snprintf(o.models[0], sizeof o.models[0], "rogue");
    o.capacity[0] = 4;
    fi_client *c = fi_client_new(&o, err, sizeof err);
    if (!c || fi_client_wait_ready(c, 3000, err, sizeof err) != 0) return NULL;
    while (!atomic_load(&s_rogue_stop)) {
        fi_msg *m = NULL;
        if (fi_client_recv(c, 50, &m, err, sizeof err) == 1 && m->body_case == FI__ENVELOPE__BODY_INFER) {
            size_t len = 0;
            uint8_t *buf = fi_wire_error(m->infer->request_id, FI__ERROR_CODE__ERR_REVOKED, "this key was revoked", &len);
            if (fi_client_send_encoded(c, buf, &len) != 0) fprintf(stderr, "rogue: cannot answer\n");
        }
        fi_wire_free(&m);
    }
    fi_client_destroy(&c);
    return NULL;
}

static void test_worker_cannot_disconnect_edge(void **state) {
    harness *h = *state;
    assert_int_equal(fi_keys_generate(&s_rogue_key), 0);
    assert_int_equal(h_enrol_direct(h, &s_rogue_key, FI__ROLE__ROLE_CLUSTER, "core-r", "r1"), 0);
    s_rogue_h = h;
    atomic_store(&s_rogue_stop, 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, s_rogue, NULL), 0);
    h_sleep_ms(300);
    fi_client *edge = s_new_edge(h, "s7");
    h_text t;
    fi_client_result res;
    assert_int_equal(h_infer(edge, "r1", "rogue", "hello", &t, &res), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_ENGINE);
    atomic_store(&s_rogue_stop, 1);
    pthread_join(th, NULL);
    h_worker w;
    assert_int_equal(h_worker_start(h, &w, "honest", 0), 0);
    assert_int_equal(h_infer(edge, "r2", "honest", "ok", &t, &res), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_UNSPECIFIED);
    assert_string_equal(t.buf, "echo: ok");
    h_worker_stop(&w);
    fi_client_destroy(&edge);
}

/* Uploads a batch of two records of origin "s8" from c; the reply's type. */
/* Uploads records first..first+n-1 of origin site, the first chained to
 * prev ("" for record 1), from c; the reply's type; last gets the head. */
static int s_upload_from(fi_client *c, const char *bid, const char *site, int first, int n,
                         const char *prev, char last[65], char *why, size_t wlen) {
    char *batch = h_audit_batch(site, first, n, prev, last);
    Fi__AuditUpload au = FI__AUDIT_UPLOAD__INIT;
    au.batch_id = (char *)bid;
    au.first_seq = (uint64_t)first;
    au.count = (uint64_t)n;
    au.batch.data = (uint8_t *)batch;
    au.batch.len = strlen(batch);
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_UPLOAD;
    m.audit_upload = &au;
    fi_msg *r = NULL;
    char err[256];
    int got = fi_client_call(c, &m, FI__ENVELOPE__BODY_ACK, 3000, &r, err, sizeof err) == 1 ? (int)r->body_case : -1;
    snprintf(why, wlen, "%s", got == FI__ENVELOPE__BODY_ERROR ? r->error->message : got < 0 ? err : "");
    fi_wire_free(&r);
    free(batch);
    return got;
}

static int s_upload(fi_client *c, const char *bid, char *why, size_t wlen) {
    char last[65];
    return s_upload_from(c, bid, "s8", 1, 2, "", last, why, wlen);
}

/* An edge whose key is replaced keeps its local log: the new key goes on
 * from the old key's head, once that key is revoked; while it is live,
 * nobody takes its log over. */
static void test_replaced_key_continues_log(void **state) {
    harness *h = *state;
    fi_keypair ka, kb;
    char why[256], head[65], head2[65], fpr[FI_KEYS_FPR_LEN];
    assert_int_equal(fi_keys_generate(&ka), 0);
    assert_int_equal(fi_keys_generate(&kb), 0);
    assert_int_equal(h_enrol_direct(h, &ka, FI__ROLE__ROLE_EDGE, "s13", "r1"), 0);
    assert_int_equal(h_enrol_direct(h, &kb, FI__ROLE__ROLE_EDGE, "s13", "r1"), 0);
    fi_client *a = h_client(h, &ka, FI__ROLE__ROLE_EDGE), *b = h_client(h, &kb, FI__ROLE__ROLE_EDGE);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(s_upload_from(a, "a1", "s13", 1, 2, "", head, why, sizeof why),
                     FI__ENVELOPE__BODY_ACK);
    /* a is live: b cannot go on from its head */
    assert_int_equal(s_upload_from(b, "b1", "s13", 3, 1, head, head2, why, sizeof why),
                     FI__ENVELOPE__BODY_ERROR);
    assert_non_null(strstr(why, "never received"));
    fi_client_destroy(&a);
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    fi_keys_fingerprint(ka.pub, fpr);
    assert_int_equal(s_revoke(op, fpr, why, sizeof why), 0);
    fi_client_destroy(&op);
    assert_int_equal(s_upload_from(b, "b2", "s13", 3, 1, head, head2, why, sizeof why),
                     FI__ENVELOPE__BODY_ACK);
    fi_client_destroy(&b);
}

/* Audit records come from the edges of their own site only: a cluster
 * worker cannot plant records under an edge's site. */
static void test_only_edges_upload_their_site(void **state) {
    harness *h = *state;
    fi_keypair wk, ek;
    char why[256];
    assert_int_equal(fi_keys_generate(&wk), 0);
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &wk, FI__ROLE__ROLE_CLUSTER, "core-a", "r1"), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "s8", "r1"), 0);
    fi_client *w = h_client(h, &wk, FI__ROLE__ROLE_CLUSTER);
    fi_client *e = h_client(h, &ek, FI__ROLE__ROLE_EDGE);
    assert_non_null(w);
    assert_non_null(e);
    assert_int_not_equal(s_upload(w, "b1", why, sizeof why), FI__ENVELOPE__BODY_ACK);
    assert_int_equal(s_upload(e, "b1", why, sizeof why), FI__ENVELOPE__BODY_ACK);
    fi_client_destroy(&w);
    fi_client_destroy(&e);
}

/* A bundle an operator pushed reaches an edge that says Hello later too. */
static void test_pushed_bundle_reaches_late_edge(void **state) {
    harness *h = *state;
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "s9", "r1"), 0);
    char err[256];
    assert_int_equal(h_push_bundle(h, 7, "signed-bundle-bytes", 19), 0);
    fi_client *e = h_client(h, &ek, FI__ROLE__ROLE_EDGE); /* Hello after the push */
    assert_non_null(e);
    int got = 0;
    for (int i = 0; i < 20 && !got; i++) {
        fi_msg *x = NULL;
        if (fi_client_recv(e, 50, &x, err, sizeof err) == 1 && x->body_case == FI__ENVELOPE__BODY_POLICY_BUNDLE)
            got = x->policy_bundle->version == 7 && x->policy_bundle->bundle.len == 19;
        fi_wire_free(&x);
    }
    assert_true(got);
    fi_client_destroy(&e);
}

/* A backend that answers with the prefix-cache tenant it was given. */
static int s_tenant_gen(void *ctx, const Fi__InferRequest *rq, fi_shard_emit_fn emit, void *eu,
                        fi_shard_gen *out, char *err, size_t errlen) {
    (void)ctx, (void)err, (void)errlen;
    memset(out, 0, sizeof *out);
    snprintf(out->stop, sizeof out->stop, "eog");
    const char *t = rq->tenant ? rq->tenant : "";
    return emit(eu, t, strlen(t)) ? 0 : 0;
}

/* Asks c for model "salt" with tenant; the reply's text into t. */
static void s_ask_tenant(fi_client *c, const char *id, const char *tenant, h_text *t,
                         fi_client_result *res) {
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)id;
    rq.model = (char *)"salt";
    rq.prompt = (char *)"the same prompt";
    rq.tenant = (char *)tenant;
    memset(t, 0, sizeof *t);
    char err[256];
    assert_int_equal(fi_client_infer(c, &rq, h_on_text, t, 5000, res, err, sizeof err), 0);
}

/* Two sites that name the same tenant never share a worker's cached
 * prefixes: the coordinator qualifies the tenant with the site of the
 * edge's key, whatever the edge wrote; a tenant name it cannot carry is
 * refused, not cut. */
static void test_sites_never_share_cache_salt(void **state) {
    harness *h = *state;
    fi_shard_backend be = {.name = "salt", .generate = s_tenant_gen};
    h_worker w;
    assert_int_equal(h_worker_start_be(h, &w, "salt", NULL, &be, 4), 0);
    fi_client *a = s_new_edge(h, "s10a"), *b = s_new_edge(h, "s10b");
    h_text ta, tb;
    fi_client_result res;
    s_ask_tenant(a, "a1", "acme", &ta, &res);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_UNSPECIFIED);
    s_ask_tenant(b, "b1", "acme", &tb, &res);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_UNSPECIFIED);
    assert_string_equal(ta.buf, "4:s10a/acme");
    assert_string_equal(tb.buf, "4:s10b/acme");
    /* an edge cannot pass for another site by writing its qualified name */
    s_ask_tenant(b, "b2", "4:s10a/acme", &tb, &res);
    assert_string_not_equal(tb.buf, "4:s10a/acme");
    char salt[FI_WIRE_CACHE_TENANT_MAX];
    assert_int_equal(fi_wire_cache_tenant("s10a", "acme", salt), 0);
    assert_string_equal(salt, ta.buf);
    char big[65];
    memset(big, 't', 64);
    big[64] = '\0';
    s_ask_tenant(a, "a2", big, &ta, &res);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_BAD_REQUEST);
    h_worker_stop(&w);
    fi_client_destroy(&a);
    fi_client_destroy(&b);
}

/* Waits up to ms for an Infer at worker w: its coordinator id in id. */
static int s_wait_infer(fi_client *w, int ms, char *id, size_t idlen) {
    uint64_t end = fi_wire_now_ms() + (uint64_t)ms;
    while (fi_wire_now_ms() < end) {
        fi_msg *m = NULL;
        char err[128];
        int got = fi_client_recv(w, 20, &m, err, sizeof err) == 1 && m->body_case == FI__ENVELOPE__BODY_INFER;
        if (got) snprintf(id, idlen, "%s", m->infer->request_id);
        fi_wire_free(&m);
        if (got) return 0;
    }
    return -1;
}

/* A worker's late reply to a request of the coordinator's last run, sent
 * after it reconnects to the restarted coordinator, reaches no edge. The
 * ids the workers saw were counted from 1 in each run, so the reply to
 * site A's "c1" went to site B, whose request was "c1" again (found by a
 * review). */
static void test_restart_ids_never_reused(void **state) {
    harness *h = *state;
    static const char *const models[] = {"m"};
    static const uint32_t caps[] = {4};
    fi_client *w = s_raw_worker(h, "core1", 1, models, caps);
    fi_client *a = s_new_edge(h, "site-a");
    s_send_infer(a, "a-1", "m", "site A's private prompt");
    char id1[64], id2[64], err[256];
    assert_int_equal(s_wait_infer(w, 3000, id1, sizeof id1), 0);
    /* the coordinator restarts on the same endpoint and database */
    char ep[sizeof h->ep];
    snprintf(ep, sizeof ep, "%s", h->ep);
    unsigned r0 = fi_client_reconnects(w);
    h_halt(h);
    fi_coord_opts o;
    h_opts(h, &o, ep, "tcp://127.0.0.1:*");
    h->c = fi_coord_new(&o, &h->coord, err, sizeof err);
    assert_non_null(h->c);
    atomic_store(&h->stop, 0);
    assert_int_equal(pthread_create(&h->th, NULL, h_coord_main, h), 0);
    for (int i = 0; i < 300 && !(fi_client_reconnects(w) != r0 && fi_client_ready(w)); i++) {
        fi_msg *m = NULL;
        (void)fi_client_recv(w, 20, &m, err, sizeof err);
        fi_wire_free(&m);
    }
    assert_true(fi_client_ready(w));
    fi_client *b = s_new_edge(h, "site-b");
    s_send_infer(b, "b-1", "m", "site B's prompt");
    assert_int_equal(s_wait_infer(w, 3000, id2, sizeof id2), 0);
    print_message("the worker's ids: %s (first run), %s (after the restart)\n", id1, id2);
    assert_string_not_equal(id1, id2);
    /* the late answer to the first run's request */
    size_t len = 0;
    assert_int_equal(fi_client_send_encoded(w, fi_wire_chunk(id1, 0, "site A's answer", 15, &len), &len), 0);
    uint64_t end = fi_wire_now_ms() + 1000;
    while (fi_wire_now_ms() < end) {
        fi_msg *m = NULL;
        if (fi_client_recv(b, 20, &m, err, sizeof err) == 1 && m->body_case == FI__ENVELOPE__BODY_CHUNK)
            fail_msg("site B got a chunk for '%s': '%s'", m->chunk->request_id, m->chunk->text);
        fi_wire_free(&m);
    }
    fi_client_destroy(&a);
    fi_client_destroy(&b);
    fi_client_destroy(&w);
}

/* A worker whose connection is gone (its process died; the heartbeats
 * have not yet said so) is not routed to: the request goes to the other
 * permitted worker, and the gone one is removed at once. Requests failed
 * with "the worker's queue is full" until liveness ran out, though the
 * other worker was idle (found by a review). */
static void test_gone_worker_skipped(void **state) {
    harness *h = *state;
    static const char *const models[] = {"m"};
    static const uint32_t caps[] = {4};
    fi_client *w[2];
    for (int i = 0; i < 2; i++) w[i] = s_raw_worker(h, "core1", 1, models, caps);
    fi_client *e = s_new_edge(h, "site-a");
    fi_client_destroy(&w[0]); /* its TCP connection closes now */
    h_sleep_ms(100);
    int failed = 0, served = 0;
    char err[256];
    for (int i = 0; i < 20; i++) {
        char id[16];
        snprintf(id, sizeof id, "r%d", i);
        s_send_infer(e, id, "m", "hello");
        uint64_t end = fi_wire_now_ms() + 300;
        int done = 0;
        while (fi_wire_now_ms() < end && !done) {
            fi_msg *m = NULL;
            if (fi_client_recv(e, 5, &m, err, sizeof err) == 1) {
                if (m->body_case == FI__ENVELOPE__BODY_ERROR && !strcmp(m->error->request_id, id)) {
                    print_message("%s: %s\n", id, m->error->message);
                    failed++, done = 1;
                } else if (m->body_case == FI__ENVELOPE__BODY_FINAL && !strcmp(m->final->request_id, id)) {
                    done = 1;
                }
            }
            fi_wire_free(&m);
            if (fi_client_recv(w[1], 0, &m, err, sizeof err) == 1 && m->body_case == FI__ENVELOPE__BODY_INFER) {
                served++;
                Fi__FinalResult fr = FI__FINAL_RESULT__INIT;
                fr.request_id = m->infer->request_id;
                fi_msg fm = FI__ENVELOPE__INIT;
                fm.body_case = FI__ENVELOPE__BODY_FINAL;
                fm.final = &fr;
                assert_int_equal(fi_client_send(w[1], &fm), 0);
            }
            fi_wire_free(&m);
        }
    }
    print_message("20 requests, one of two workers gone: %d failed, %d served\n", failed, served);
    assert_int_equal(failed, 0);
    assert_int_equal(served, 20);
    fi_client_destroy(&e);
    fi_client_destroy(&w[1]);
}

/* A worker's reply that fits the size limit under the coordinator's id
 * but not under the edge's (ids of up to 64 bytes against ~20) is not
 * relayed: the edge is told, instead of waiting for ever (the request was
 * ended in silence; found by a review). */
static void test_reply_too_large_answered(void **state) {
    harness *h = *state;
    static const char *const models[] = {"m"};
    static const uint32_t caps[] = {4};
    fi_client *w = s_raw_worker(h, "core1", 1, models, caps);
    fi_client *e = s_new_edge(h, "site-a");
    char rid[65], cid[64], err[256];
    memset(rid, 'r', 64), rid[64] = '\0';
    s_send_infer(e, rid, "m", "hello");
    assert_int_equal(s_wait_infer(w, 3000, cid, sizeof cid), 0);
    size_t n = FI_WIRE_MAX_MSG - 60;
    char *big = malloc(n + 1);
    assert_non_null(big);
    memset(big, 'x', n), big[n] = '\0';
    size_t len = 0;
    uint8_t *buf = fi_wire_error(cid, FI__ERROR_CODE__ERR_ENGINE, big, &len);
    assert_non_null(buf);
    assert_true(len <= FI_WIRE_MAX_MSG);
    assert_int_equal(fi_client_send_encoded(w, buf, &len), 0);
    free(big);
    int told = 0;
    uint64_t end = fi_wire_now_ms() + 3000;
    while (fi_wire_now_ms() < end && !told) {
        fi_msg *m = NULL;
        if (fi_client_recv(e, 20, &m, err, sizeof err) == 1 && m->body_case == FI__ENVELOPE__BODY_ERROR &&
            !strcmp(m->error->request_id, rid)) {
            print_message("the edge is told: %s\n", m->error->message);
            assert_non_null(strstr(m->error->message, "size limit"));
            told = 1;
        }
        fi_wire_free(&m);
    }
    assert_true(told);
    fi_client_destroy(&e);
    fi_client_destroy(&w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_every_message_type, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_key_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_revoked_key_cut_off, setup, teardown),
        cmocka_unit_test_setup_teardown(test_revoked_client_told, setup, teardown),
        cmocka_unit_test_setup_teardown(test_revoke_spares_a_reused_socket, setup, teardown),
        cmocka_unit_test_setup_teardown(test_last_operator_kept, setup, teardown),
        cmocka_unit_test_setup_teardown(test_locked_store_answers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_messages_answered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_capacity_and_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_in_flight_per_key, setup_in_flight, teardown),
        cmocka_unit_test_setup_teardown(test_edge_view_follows_workers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_audit_witness_wire, setup, teardown),
        cmocka_unit_test_setup_teardown(test_audit_verify_off_loop, setup, teardown),
        cmocka_unit_test_setup_teardown(test_edge_view_many_clusters, setup, teardown),
        cmocka_unit_test_setup_teardown(test_edge_view_truncated, setup_small_msg, teardown),
        cmocka_unit_test_setup_teardown(test_edge_view_multi_model_worker, setup, teardown),
        cmocka_unit_test_setup_teardown(test_worker_cannot_disconnect_edge, setup, teardown),
        cmocka_unit_test_setup_teardown(test_only_edges_upload_their_site, setup, teardown),
        cmocka_unit_test_setup_teardown(test_replaced_key_continues_log, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pushed_bundle_reaches_late_edge, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sites_never_share_cache_salt, setup, teardown),
        cmocka_unit_test_setup_teardown(test_restart_ids_never_reused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gone_worker_skipped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reply_too_large_answered, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
