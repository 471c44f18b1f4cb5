/*
 * harness.h - shared by the fabric's tests: a coordinator on loopback in
 * a thread (or a child process), keys, enrolled peers, echo workers.
 *
 * Header-only (static functions) so that each test program stays one
 * file; included by tests/test_fabric_*.c.
 */
#ifndef FI_TEST_FABRIC_HARNESS_H
#define FI_TEST_FABRIC_HARNESS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "fi_client.h"
#include "fi_coord.h"
#include "fi_coord_ship.h"
#include "fi_keys.h"
#include "fi_shard.h"
#include "fi_store.h"

/* Short heartbeats keep the suite fast: a dead peer is found in 300 ms. */
/* Each test program uses a part of the harness. */
#define H_FN static __attribute__((unused))

#define H_HB_MS 100
#define H_LIVENESS 5 /* 500 ms: room for a loaded 2-core CI machine */

typedef struct harness {
    char dir[256];          /* temporary directory (removed by h_stop) */
    char db[300];           /* coordinator's database */
    fi_keypair coord;       /* coordinator's keys */
    fi_keypair op;          /* an operator, bootstrapped */
    fi_coord *c;            /* the coordinator (thread mode) */
    pthread_t th;           /* its thread */
    atomic_int stop;        /* stops it */
    char ep[256];           /* fabric endpoint */
    char enrol_ep[256];     /* enrolment endpoint */
    int handshake_ms;       /* coordinator's handshake limit */
    int max_msg;            /* coordinator's message limit */
    int liveness;           /* heartbeats of silence before a peer is dead (0: H_LIVENESS) */
    int max_in_flight;      /* coordinator's open requests per edge key (0: its default) */
    int edge_hb_ms;         /* h_edge_start's heartbeat_ms (0: H_HB_MS); an edge calls the
                               coordinator unreachable after 3 of them in silence */
    char policy_check_key[300]; /* coordinator's policy_check_key ("": no re-check) */
} harness;

H_FN void h_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

H_FN void *h_coord_main(void *arg) {
    harness *h = arg;
    if (fi_coord_run(h->c, &h->stop) != 0) fprintf(stderr, "harness: coordinator failed\n");
    return NULL;
}

/* Enrols kp directly in the database (a second connection; WAL lets the
 * coordinator's own stay open). */
H_FN int h_enrol_direct(harness *h, const fi_keypair *kp, Fi__Role role, const char *site,
                          const char *region) {
    char err[256];
    fi_store *st = fi_store_open(h->db, err, sizeof err);
    if (!st) return -1;
    int rc = fi_store_peer_add(st, kp->pub, role, site, region, err, sizeof err);
    if (rc) fprintf(stderr, "harness: %s\n", err);
    fi_store_destroy(&st);
    return rc;
}

H_FN void h_opts(harness *h, fi_coord_opts *o, const char *bind, const char *enrol_bind) {
    fi_coord_opts_default(o);
    snprintf(o->bind, sizeof o->bind, "%s", bind);
    snprintf(o->enrol_bind, sizeof o->enrol_bind, "%s", enrol_bind);
    snprintf(o->db, sizeof o->db, "%s", h->db);
    o->heartbeat_ms = H_HB_MS;
    o->liveness = h->liveness ? h->liveness : H_LIVENESS;
    o->handshake_ms = h->handshake_ms ? h->handshake_ms : 2000;
    if (h->max_msg) o->max_msg = h->max_msg;
    if (h->max_in_flight) o->max_in_flight = h->max_in_flight;
    if (h->policy_check_key[0])
        snprintf(o->policy_check_key, sizeof o->policy_check_key, "%s", h->policy_check_key);
}

/* Makes the directory, the keys and the bootstrapped operator. */
H_FN int h_init(harness *h) {
    memset(h, 0, sizeof *h);
    snprintf(h->dir, sizeof h->dir, "/tmp/fi_fabric_test_XXXXXX");
    if (!mkdtemp(h->dir)) return -1;
    snprintf(h->db, sizeof h->db, "%s/coord.db", h->dir);
    if (fi_keys_generate(&h->coord) || fi_keys_generate(&h->op)) return -1;
    return h_enrol_direct(h, &h->op, FI__ROLE__ROLE_OPERATOR, "", "");
}

/* Starts the coordinator thread on loopback ports chosen by the system. */
H_FN int h_start(harness *h) {
    fi_coord_opts o;
    char err[256];
    h_opts(h, &o, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*");
    h->c = fi_coord_new(&o, &h->coord, err, sizeof err);
    if (!h->c) {
        fprintf(stderr, "harness: %s\n", err);
        return -1;
    }
    snprintf(h->ep, sizeof h->ep, "%s", fi_coord_endpoint(h->c, 0));
    snprintf(h->enrol_ep, sizeof h->enrol_ep, "%s", fi_coord_endpoint(h->c, 1));
    atomic_store(&h->stop, 0);
    return pthread_create(&h->th, NULL, h_coord_main, h) ? -1 : 0;
}

/* Starts the coordinator again, after h_halt, on the endpoints it had, so
 * that its peers come back to it. */
H_FN int h_restart(harness *h) {
    fi_coord_opts o;
    char err[256], ep[256], enrol_ep[256];
    snprintf(ep, sizeof ep, "%s", h->ep);
    snprintf(enrol_ep, sizeof enrol_ep, "%s", h->enrol_ep);
    h_opts(h, &o, ep, enrol_ep);
    h->c = fi_coord_new(&o, &h->coord, err, sizeof err);
    if (!h->c) {
        fprintf(stderr, "harness: %s\n", err);
        return -1;
    }
    atomic_store(&h->stop, 0);
    return pthread_create(&h->th, NULL, h_coord_main, h) ? -1 : 0;
}

H_FN void h_halt(harness *h) {
    if (!h->c) return;
    atomic_store(&h->stop, 1);
    pthread_join(h->th, NULL);
    fi_coord_destroy(&h->c);
}

H_FN void h_stop(harness *h) {
    h_halt(h);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", h->dir);
    if (system(cmd) != 0) fprintf(stderr, "harness: could not remove %s\n", h->dir);
}

H_FN void h_client_opts(const harness *h, fi_client_opts *o, const fi_keypair *kp,
                          Fi__Role role) {
    fi_client_opts_default(o);
    snprintf(o->endpoint, sizeof o->endpoint, "%s", h->ep);
    memcpy(o->server_pub, h->coord.pub, FI_KEYS_BYTES);
    o->kp = *kp;
    o->role = role;
    o->heartbeat_ms = H_HB_MS;
    o->liveness = h->liveness ? h->liveness : H_LIVENESS;
    o->handshake_ms = 2000;
    o->reconnect_ms = 50;
    o->reconnect_max_ms = 400;
}

/* A connected client (waits for the coordinator's Hello); NULL on failure. */
H_FN fi_client *h_client(const harness *h, const fi_keypair *kp, Fi__Role role) {
    fi_client_opts o;
    char err[256];
    h_client_opts(h, &o, kp, role);
    fi_client *c = fi_client_new(&o, err, sizeof err);
    if (c && fi_client_wait_ready(c, 3000, err, sizeof err) != 0) {
        fprintf(stderr, "harness: %s\n", err);
        fi_client_destroy(&c);
    }
    return c;
}

/* An audit batch as an edge uploads it (fi_ship_audit_batch): n records
 * numbered first.. with origin site, chained from prev ("" for record 1);
 * the last record's hash goes to last (may be NULL). malloc'd JSON. */
/* One request of the harness's operator, on a connection of its own: the
 * reply of type want (free with fi_wire_free), or NULL, said on stderr,
 * on a timeout (5 s), an Error or a reply of another type. */
H_FN fi_msg *h_op_call(harness *h, const fi_msg *m, fi_msg_type want) {
    fi_client *c = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    if (!c) return NULL;
    fi_msg *rep = NULL;
    char err[256] = "";
    int rc = fi_client_call(c, m, want, 5000, &rep, err, sizeof err);
    fi_client_destroy(&c);
    if (rc == 1 && rep->body_case == want) return rep;
    fprintf(stderr, "harness: operator call: %s\n",
            rc != 1 ? err : rep->body_case == FI__ENVELOPE__BODY_ERROR ? rep->error->message : "another reply");
    fi_wire_free(&rep);
    return NULL;
}

/* fedctl audit verify's request: the coordinator's AuditVerifyReply. */
H_FN fi_msg *h_audit_verify(harness *h) {
    Fi__AuditVerifyRequest vq = FI__AUDIT_VERIFY_REQUEST__INIT;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST;
    m.audit_verify_request = &vq;
    return h_op_call(h, &m, FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY);
}

H_FN char *h_audit_batch(const char *site, int64_t first, size_t n, const char *prev, char last[65]) {
    fi_audit_record *r = calloc(n ? n : 1, sizeof *r);
    char ids[64][32];
    if (!r || n > 64) {
        free(r);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        snprintf(ids[i], sizeof ids[i], "req-%lld", (long long)first + (long long)i);
        r[i].seq = first + (int64_t)i;
        r[i].time = (int64_t)time(NULL) * 1000 + (int64_t)i;
        r[i].request_id = ids[i];
        r[i].origin = site;
        r[i].labels = "phi";
        r[i].model = "smol";
        r[i].latency_ms = -1;
        r[i].prompt_tokens = 12;
        r[i].decision = "permit";
        r[i].target = site;
        r[i].rules = "phi stays on site";
        r[i].policy_digest = "";
        fi_audit_chain_hash(i ? r[i - 1].hash : prev, &r[i], r[i].hash);
    }
    if (last && n) snprintf(last, 65, "%s", r[n - 1].hash);
    char *out = fi_ship_audit_batch(r, n);
    free(r);
    return out;
}

/* --- an echo worker in a thread -------------------------------------- */
typedef struct h_worker {
    const harness *h;       /* whose coordinator */
    fi_keypair kp;          /* the worker's key (enrolled as cluster) */
    char model[64];         /* model announced */
    int delay_ms;           /* echo delay per chunk */
    int capacity;           /* announced capacity */
    pthread_t th;           /* serving thread */
    atomic_int stop;        /* stops it */
    atomic_int ready;       /* 1 once Hello was answered */
    int rc;                 /* fi_shard_serve's result */
    fi_shard_backend be;    /* backend it serves with */
    int owns_be;            /* be is destroyed by h_worker_stop */
    char site[64];          /* enrolled site ("" : core1) */
} h_worker;

H_FN void *h_worker_main(void *arg) {
    h_worker *w = arg;
    fi_client_opts o;
    char err[256];
    h_client_opts(w->h, &o, &w->kp, FI__ROLE__ROLE_CLUSTER);
    o.n_models = 1;
    snprintf(o.models[0], sizeof o.models[0], "%s", w->model);
    o.capacity[0] = (uint32_t)(w->capacity ? w->capacity : 4);
    fi_client *c = fi_client_new(&o, err, sizeof err);
    if (!c) {
        w->rc = -1;
        return NULL;
    }
    if (fi_client_wait_ready(c, 3000, err, sizeof err) == 0) atomic_store(&w->ready, 1);
    w->rc = fi_shard_serve(c, &w->be, 16, &w->stop, err, sizeof err);
    fi_client_destroy(&c);
    return NULL;
}

/* Enrols a fresh key as a cluster and starts serving `model` with the
 * given capacity (0: 4). */
/* Enrols a fresh key as a cluster of site ("" : core1) and starts serving
 * `model` with backend be (NULL: echo) and the given capacity (0: 4). */
H_FN int h_worker_start_be(harness *h, h_worker *w, const char *model, const char *site,
                           const fi_shard_backend *be, int capacity) {
    memset(w, 0, sizeof *w);
    if (be) w->be = *be;
    snprintf(w->site, sizeof w->site, "%s", site && site[0] ? site : "core1");
    w->h = h;
    w->capacity = capacity;
    snprintf(w->model, sizeof w->model, "%s", model);
    if (fi_keys_generate(&w->kp) ||
        h_enrol_direct(h, &w->kp, FI__ROLE__ROLE_CLUSTER, w->site, "eu-west"))
        return -1;
    if (pthread_create(&w->th, NULL, h_worker_main, w)) return -1;
    for (int i = 0; i < 300 && !atomic_load(&w->ready); i++) h_sleep_ms(10);
    /* The coordinator routes to it once its Hello is processed, which the
     * answer proves. */
    return atomic_load(&w->ready) ? 0 : -1;
}

H_FN int h_worker_start_cap(harness *h, h_worker *w, const char *model, int delay_ms,
                            int capacity) {
    fi_shard_backend be = fi_shard_echo_backend(4, delay_ms);
    int rc = h_worker_start_be(h, w, model, NULL, &be, capacity);
    w->delay_ms = delay_ms;
    w->owns_be = 1;
    return rc;
}

H_FN int h_worker_start(harness *h, h_worker *w, const char *model, int delay_ms) {
    return h_worker_start_cap(h, w, model, delay_ms, 0);
}

H_FN void h_worker_stop(h_worker *w) {
    atomic_store(&w->stop, 1);
    pthread_join(w->th, NULL);
    if (w->owns_be && w->be.destroy) w->be.destroy(w->be.ctx);
}

/* Collects streamed text. */
typedef struct h_text {
    char buf[4096]; /* text so far */
    size_t len;     /* bytes in buf */
} h_text;

H_FN int h_on_text(void *user, const char *t, size_t n) {
    h_text *x = user;
    if (x->len + n < sizeof x->buf) {
        memcpy(x->buf + x->len, t, n);
        x->len += n;
        x->buf[x->len] = 0;
    }
    return 0;
}

/* Pushes bundle b (version v) to h's coordinator as its operator, on a
 * fresh connection (an idle one is dropped by the test coordinator's
 * 100 ms heartbeats): 0 Ack, -1 no answer, else the error's code. */
H_FN int h_push_bundle(harness *h, uint64_t v, const void *b, size_t bl) {
    fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
    if (!op) return -1;
    Fi__PolicyBundle pb = FI__POLICY_BUNDLE__INIT;
    pb.version = v;
    pb.bundle.data = (uint8_t *)b;
    pb.bundle.len = bl;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_POLICY_BUNDLE;
    m.policy_bundle = &pb;
    fi_msg *r = NULL;
    char err[256];
    int code = -1;
    if (fi_client_call(op, &m, FI__ENVELOPE__BODY_ACK, 3000, &r, err, sizeof err) == 1) {
        code = r->body_case == FI__ENVELOPE__BODY_ACK ? 0 : (int)r->error->code;
        if (code) fprintf(stderr, "harness: push v%llu: %s\n", (unsigned long long)v, r->error->message);
    } else {
        fprintf(stderr, "harness: push v%llu: %s\n", (unsigned long long)v, err);
    }
    fi_wire_free(&r);
    fi_client_destroy(&op);
    return code;
}

/* One inference through the fabric; 0 with the text in out. */
H_FN int h_infer(fi_client *c, const char *id, const char *model, const char *prompt,
                   h_text *out, fi_client_result *res) {
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)id;
    rq.model = (char *)model;
    rq.prompt = (char *)prompt;
    memset(out, 0, sizeof *out);
    char err[256];
    int rc = fi_client_infer(c, &rq, h_on_text, out, 5000, res, err, sizeof err);
    if (rc) fprintf(stderr, "harness: infer %s: %s\n", id, err);
    return rc;
}

#endif /* FI_TEST_FABRIC_HARNESS_H */
