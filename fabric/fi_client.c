/*
 * fi_client.c - a coordinator's peer. See fi_client.h.
 *
 * The coordinator's silence for `liveness` heartbeats means the link is
 * gone (a dead coordinator, a half-open TCP connection): the socket is
 * closed and a new one opened after a back-off that doubles up to
 * reconnect_max_ms, and Hello is sent again. A socket monitor tells us
 * when the coordinator refused our key at the handshake.
 */
#include "fi_client.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sodium.h>
#include <string.h>
#include <zmq.h>

#include "fi_audit.h"
#include "fi_transport.h"

struct fi_client {
    fi_client_opts o;       /* options, copied */
    void *ctx;              /* own ZeroMQ context */
    void *sock;             /* DEALER to the coordinator, NULL while backing off */
    void *mon;              /* PAIR receiving the socket's monitor events */
    unsigned serial;        /* numbers monitor endpoints */
    int ready;              /* coordinator answered Hello on this connection */
    int refused;            /* the handshake was refused (key unknown or revoked) */
    int revoked;            /* the coordinator said we are revoked */
    unsigned reconnects;    /* reconnections so far */
    uint64_t last_recv_ms;  /* last message from the coordinator (or connect time) */
    uint64_t last_send_ms;  /* last message we sent */
    uint64_t retry_at_ms;   /* when to reconnect while sock is NULL */
    int backoff_ms;         /* next back-off delay */
    uint64_t hello_at_ms;   /* when Hello was last sent */
    uint64_t policy_version; /* edges: the policy bundle version held, for Hello */
    uint64_t version_said;   /* the one the last Hello or heartbeat carried */
    int have_load;          /* clusters: load set, sent with heartbeats */
    Fi__WorkerLoad load;    /* its counters (prefix_filter points into filter) */
    uint8_t *filter;        /* its prefix filter (owned) */
    uint64_t load_sent_ms;  /* when the load was last sent */
    fi_cluster_load *loads; /* edges: clusters' load, last heard (owned) */
    int n_loads, cap_loads; /* rows in loads / allocated */
    int loads_truncated;    /* those rows are not all the live ones */
    uint64_t loads_ms;      /* when the last heartbeat (and its loads) came */
    int64_t wit_seq;        /* edges: the coordinator's audit head witnessed (0: none) */
    char wit_hash[65];      /* ... its chain hash */
    unsigned wit_gen;       /* bumped when the witness advances */
    int64_t back_seq;       /* the last such head, warned of once */
    char back_hash[65];
    int head_malformed;     /* a malformed head came (warned once) */
};

void fi_client_set_load(fi_client *c, uint32_t running, uint32_t queued, uint32_t kv_free,
                        uint32_t kv_total, const uint8_t *filter, size_t filter_len) {
    fi__worker_load__init(&c->load);
    c->load.running = running;
    c->load.queued = queued;
    c->load.kv_blocks_free = kv_free;
    c->load.kv_blocks_total = kv_total;
    if (filter && filter_len && filter_len <= 65536) {
        uint8_t *f = realloc(c->filter, filter_len);
        if (f) {
            memcpy(f, filter, filter_len);
            c->filter = f;
            c->load.prefix_filter.data = f;
            c->load.prefix_filter.len = filter_len;
        }
    }
    c->have_load = 1;
}

int fi_client_cluster_loads(const fi_client *c, fi_cluster_load *out, int max, uint64_t *heard_ms,
                            int *truncated) {
    int n = c->n_loads < max ? c->n_loads : max;
    if (n > 0) memcpy(out, c->loads, (size_t)n * sizeof *out);
    *heard_ms = c->loads_ms;
    if (truncated) *truncated = c->loads_truncated;
    return c->n_loads;
}

/* Keeps what the coordinator's heartbeat says about the clusters: every
 * heartbeat carries all the live ones (or says it does not), so one
 * without rows means none is live (the old rows must not outlive their
 * workers). Rows beyond FI_CLIENT_MAX_LOADS, or that memory cannot hold,
 * are dropped and the whole marked truncated. */
static void s_take_loads(fi_client *c, const Fi__Heartbeat *h) {
    c->n_loads = 0;
    c->loads_ms = fi_wire_now_ms();
    c->loads_truncated = h->clusters_truncated;
    size_t want = h->n_clusters;
    if (want > FI_CLIENT_MAX_LOADS) {
        want = FI_CLIENT_MAX_LOADS;
        c->loads_truncated = 1;
    }
    if (want > (size_t)c->cap_loads) {
        fi_cluster_load *nl = realloc(c->loads, want * sizeof *nl);
        if (nl) {
            c->loads = nl;
            c->cap_loads = (int)want;
        } else {
            want = (size_t)c->cap_loads;
            c->loads_truncated = 1;
        }
    }
    for (size_t i = 0; i < h->n_clusters && c->n_loads < (int)want; i++) {
        const Fi__ClusterLoad *l = h->clusters[i];
        if (!l->cluster || !l->model) continue;
        fi_cluster_load *o = &c->loads[c->n_loads++];
        snprintf(o->cluster, sizeof o->cluster, "%s", l->cluster);
        snprintf(o->model, sizeof o->model, "%s", l->model);
        o->workers = l->workers;
        o->capacity = l->capacity;
        o->in_flight = l->in_flight;
        o->queued = l->queued;
    }
}

/* An audit head of the coordinator's heartbeat: the witness moves up to
 * it, never back. */
static void s_take_audit_head(fi_client *c, const Fi__AuditHead *ah) {
    if (!ah || c->o.role != FI__ROLE__ROLE_EDGE) return;
    int64_t seq = ah->seq <= (uint64_t)INT64_MAX ? (int64_t)ah->seq : 0;
    if (!fi_audit_head_valid(seq, ah->hash)) {
        if (!c->head_malformed)
            fprintf(stderr, "fabric client: the coordinator's heartbeat carries a malformed audit head (record "
                            "%llu); ignored\n", (unsigned long long)ah->seq);
        c->head_malformed = 1;
        return;
    }
    if (seq > c->wit_seq) {
        c->wit_seq = seq;
        memcpy(c->wit_hash, ah->hash, 65);
        c->wit_gen++;
        return;
    }
    if (seq == c->wit_seq && !strcmp(ah->hash, c->wit_hash)) return;
    if (seq == c->back_seq && !strcmp(ah->hash, c->back_hash)) return;
    c->back_seq = seq;
    memcpy(c->back_hash, ah->hash, 65);
    fprintf(stderr,
            "fabric client: the coordinator's audit log went back: its last record is now %lld (hash %.16s...), "
            "but it was told as %lld (hash %.16s...) before: records were cut off its end, or it is another "
            "log; %lld stays this site's witness\n",
            (long long)seq, ah->hash, (long long)c->wit_seq, c->wit_hash, (long long)c->wit_seq);
}

unsigned fi_client_audit_witness(const fi_client *c, int64_t *seq, char hash[65]) {
    *seq = c->wit_seq;
    memcpy(hash, c->wit_hash, 65);
    return c->wit_gen;
}

void fi_client_set_policy_version(fi_client *c, uint64_t version) { c->policy_version = version; }

/* The bundle version an edge holds: set, else the one it started with. */
static uint64_t s_version(const fi_client *c) {
    return c->policy_version ? c->policy_version : c->o.policy_version;
}

void fi_client_opts_default(fi_client_opts *o) {
    memset(o, 0, sizeof *o);
    o->role = FI__ROLE__ROLE_EDGE;
    o->heartbeat_ms = 1000;
    o->liveness = 3;
    o->handshake_ms = 2000;
    o->reconnect_ms = 100;
    o->reconnect_max_ms = 5000;
    o->hwm = 1000;
}

/* Takes len by pointer so that a call s_send_raw(c, encode(.., &len), &len)
 * reads it after the encoder wrote it (argument order is unspecified). */
static int s_send_raw(fi_client *c, uint8_t *buf, const size_t *len) {
    int rc = buf && c->sock && zmq_send(c->sock, buf, *len, ZMQ_DONTWAIT) >= 0 ? 0 : -1;
    free(buf);
    if (rc == 0) c->last_send_ms = fi_wire_now_ms();
    return rc;
}

int fi_client_send_encoded(fi_client *c, uint8_t *buf, const size_t *len) {
    return s_send_raw(c, buf, len);
}

int fi_client_send(fi_client *c, const fi_msg *m) {
    size_t len = 0;
    return s_send_raw(c, fi_wire_encode(m, &len), &len);
}

static int s_send_hello(fi_client *c) {
    Fi__Hello h = FI__HELLO__INIT;
    Fi__ModelOffer offers[FI_CLIENT_MAX_MODELS], *ptrs[FI_CLIENT_MAX_MODELS];
    size_t n = 0;
    for (int i = 0; i < c->o.n_models && i < FI_CLIENT_MAX_MODELS; i++) {
        if (c->o.capacity[i] == 0) continue; /* withdrawn (fi_client_set_capacity) */
        fi__model_offer__init(&offers[n]);
        offers[n].name = c->o.models[i];
        offers[n].capacity = c->o.capacity[i];
        ptrs[n] = &offers[n];
        n++;
    }
    h.role = c->o.role;
    h.software = (char *)"fedinfer " FI_VERSION;
    h.heartbeat_ms = (uint32_t)c->o.heartbeat_ms;
    h.policy_version = s_version(c);
    c->version_said = h.policy_version;
    Fi__AuditHead wit = FI__AUDIT_HEAD__INIT;
    if (c->o.role == FI__ROLE__ROLE_EDGE && c->wit_seq > 0) {
        wit.seq = (uint64_t)c->wit_seq;
        wit.hash = c->wit_hash;
        h.audit_head = &wit;
    }
    h.n_models = n;
    h.models = n ? ptrs : NULL;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_HELLO;
    m.hello = &h;
    c->hello_at_ms = fi_wire_now_ms();
    return fi_client_send(c, &m);
}

int fi_client_set_capacity(fi_client *c, int i, uint32_t capacity) {
    if (i < 0 || i >= c->o.n_models) return -1;
    c->o.capacity[i] = capacity;
    return c->sock ? s_send_hello(c) : -1;
}

uint32_t fi_client_capacity(const fi_client *c, int i) {
    return i < 0 || i >= c->o.n_models ? 0 : c->o.capacity[i];
}

static void s_close(fi_client *c) {
    fi_sock_close_monitored(c->sock);
    if (c->mon) zmq_close(c->mon);
    c->sock = c->mon = NULL;
    c->ready = 0;
}

static int s_open(fi_client *c, char *err, size_t errlen) {
    fi_sockopts so;
    fi_sockopts_default(&so);
    so.heartbeat_ms = c->o.heartbeat_ms;
    so.heartbeat_timeout_ms = c->o.heartbeat_ms * c->o.liveness;
    so.handshake_ms = c->o.handshake_ms;
    so.hwm = c->o.hwm;
    so.reconnect_ms = c->o.reconnect_ms;
    so.reconnect_max_ms = c->o.reconnect_max_ms;
    so.plaintext = c->o.plaintext;
    char mon_ep[64];
    snprintf(mon_ep, sizeof mon_ep, "inproc://fi-client-monitor-%u", ++c->serial);
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    if (!c->sock) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    if (fi_sock_client(c->sock, &c->o.kp, c->o.server_pub, &so, err, errlen) != 0) goto fail;
    if (zmq_socket_monitor(c->sock, mon_ep,
                           ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                               ZMQ_EVENT_DISCONNECTED) != 0 ||
        !(c->mon = zmq_socket(c->ctx, ZMQ_PAIR)) || zmq_connect(c->mon, mon_ep) != 0) {
        snprintf(err, errlen, "socket monitor: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_connect(c->sock, c->o.endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", c->o.endpoint,
                 zmq_strerror(zmq_errno()));
        goto fail;
    }
    c->last_recv_ms = fi_wire_now_ms();
    (void)s_send_hello(c);
    return 0;
fail:
    s_close(c);
    return -1;
}

fi_client *fi_client_new(const fi_client_opts *o, char *err, size_t errlen) {
    fi_client *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->o = *o;
    c->backoff_ms = o->reconnect_ms;
    if (o->role == FI__ROLE__ROLE_EDGE && fi_audit_head_valid(o->audit_seq, o->audit_hash)) {
        c->wit_seq = o->audit_seq;
        memcpy(c->wit_hash, o->audit_hash, 65);
    }
    if (!(c->ctx = zmq_ctx_new())) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
        fi_client_destroy(&c);
        return NULL;
    }
    if (s_open(c, err, errlen) != 0) fi_client_destroy(&c);
    return c;
}

void fi_client_destroy(fi_client **cp) {
    if (!cp || !*cp) return;
    fi_client *c = *cp;
    s_close(c);
    if (c->ctx) zmq_ctx_term(c->ctx);
    fi_keys_wipe(&c->o.kp);
    free(c->filter);
    free(c->loads);
    free(c);
    *cp = NULL;
}

int fi_client_ready(const fi_client *c) { return c->ready; }

unsigned fi_client_reconnects(const fi_client *c) { return c->reconnects; }

/* Reads pending monitor events; notes a refused handshake. */
static void s_monitor(fi_client *c) {
    for (;;) {
        zmq_msg_t ev, addr;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t event = 0;
        if (zmq_msg_size(&ev) >= 2) memcpy(&event, zmq_msg_data(&ev), 2);
        int more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        if (more) {
            zmq_msg_init(&addr);
            (void)zmq_msg_recv(&addr, c->mon, 0);
            zmq_msg_close(&addr);
        }
        if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) c->refused = 1;
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) c->refused = 0;
        if (event == ZMQ_EVENT_DISCONNECTED && c->ready) {
            /* libzmq reconnects by itself, but whatever the coordinator
             * held for us (open requests, our registration) may be gone:
             * count it as a reconnection and say Hello again. */
            c->ready = 0;
            c->reconnects++;
        }
    }
}

/* Heartbeats, liveness and reconnection; run on every wake-up. */
static void s_housekeeping(fi_client *c) {
    uint64_t now = fi_wire_now_ms();
    if (!c->sock) {
        if (now < c->retry_at_ms) return;
        char err[256];
        c->reconnects++;
        if (s_open(c, err, sizeof err) != 0) {
            fprintf(stderr, "fabric client: reconnect failed: %s\n", err);
            c->retry_at_ms = now + (uint64_t)c->backoff_ms;
        }
        return;
    }
    if (now - c->last_recv_ms > (uint64_t)c->o.heartbeat_ms * (uint64_t)c->o.liveness) {
        /* The coordinator is gone or the link is half-open. */
        s_close(c);
        c->retry_at_ms = now + (uint64_t)c->backoff_ms;
        c->backoff_ms = c->backoff_ms * 2 > c->o.reconnect_max_ms ? c->o.reconnect_max_ms
                                                                  : c->backoff_ms * 2;
        return;
    }
    if (!c->ready && now - c->hello_at_ms >= (uint64_t)c->o.heartbeat_ms)
        (void)s_send_hello(c);
    else if (now - c->last_send_ms >= (uint64_t)c->o.heartbeat_ms ||
             (c->have_load && now - c->load_sent_ms >= (uint64_t)c->o.heartbeat_ms) ||
             (c->ready && c->o.role == FI__ROLE__ROLE_EDGE && s_version(c) != c->version_said)) {
        /* A busy worker sends its load every interval, streaming or not;
         * an edge says at once which policy it holds when that changes. */
        Fi__Heartbeat h = FI__HEARTBEAT__INIT;
        h.sent_ms = now;
        Fi__AuditHead wit = FI__AUDIT_HEAD__INIT;
        if (c->o.role == FI__ROLE__ROLE_EDGE) {
            h.policy_version = s_version(c);
            c->version_said = h.policy_version;
            if (c->wit_seq > 0) {
                wit.seq = (uint64_t)c->wit_seq;
                wit.hash = c->wit_hash;
                h.audit_head = &wit;
            }
        }
        if (c->have_load) {
            h.load = &c->load;
            c->load_sent_ms = now;
        }
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_HEARTBEAT;
        m.heartbeat = &h;
        size_t len = 0;
        (void)s_send_raw(c, fi_wire_encode(&m, &len), &len);
    }
}

int fi_client_recv(fi_client *c, int timeout_ms, fi_msg **out, char *err, size_t errlen) {
    return fi_client_recv_or(c, timeout_ms, NULL, out, err, errlen);
}

int fi_client_recv_or(fi_client *c, int timeout_ms, void *other, fi_msg **out, char *err,
                      size_t errlen) {
    uint64_t deadline = fi_wire_now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    unsigned gen = c->reconnects;
    *out = NULL;
    for (;;) {
        if (c->mon) s_monitor(c);
        if (c->reconnects != gen) return 0; /* callers check for lost requests */
        if (c->refused || c->revoked) {
            snprintf(err, errlen, c->revoked ? "the coordinator revoked this key"
                                             : "the coordinator refused this key at the "
                                               "handshake (unknown or revoked)");
            return -1;
        }
        s_housekeeping(c);
        if (c->reconnects != gen) return 0;
        uint64_t now = fi_wire_now_ms();
        if (now >= deadline && timeout_ms >= 0 && now > deadline) return 0;
        long wait = (long)(deadline > now ? deadline - now : 0);
        long hb = c->o.heartbeat_ms / 2 > 0 ? c->o.heartbeat_ms / 2 : 1;
        if (wait > hb) wait = hb;
        if (!c->sock) {
            zmq_pollitem_t it = {other, 0, ZMQ_POLLIN, 0};
            if (zmq_poll(other ? &it : NULL, other ? 1 : 0, wait) > 0) return 2;
            if (fi_wire_now_ms() >= deadline) return 0;
            continue;
        }
        zmq_pollitem_t items[3] = {{c->sock, 0, ZMQ_POLLIN, 0},
                                   {c->mon, 0, ZMQ_POLLIN, 0},
                                   {other, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, other ? 3 : 2, wait) < 0 && zmq_errno() != EINTR) {
            snprintf(err, errlen, "zmq_poll: %s", zmq_strerror(zmq_errno()));
            return -1;
        }
        if (other && (items[2].revents & ZMQ_POLLIN) && !(items[0].revents & ZMQ_POLLIN))
            return 2;
        if (items[0].revents & ZMQ_POLLIN) {
            zmq_msg_t msg;
            zmq_msg_init(&msg);
            if (zmq_msg_recv(&msg, c->sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&msg);
                continue;
            }
            c->last_recv_ms = fi_wire_now_ms();
            c->backoff_ms = c->o.reconnect_ms;
            Fi__ErrorCode code;
            char derr[160];
            fi_msg *m = fi_wire_decode(zmq_msg_data(&msg), zmq_msg_size(&msg), 0, &code, derr,
                                       sizeof derr);
            int more = zmq_msg_more(&msg);
            if (fi_wire_has_secret(m)) sodium_memzero(zmq_msg_data(&msg), zmq_msg_size(&msg));
            zmq_msg_close(&msg);
            while (more) { /* the coordinator never sends several frames */
                zmq_msg_init(&msg);
                if (zmq_msg_recv(&msg, c->sock, 0) < 0) more = 0;
                else more = zmq_msg_more(&msg);
                zmq_msg_close(&msg);
                fi_wire_free(&m);
            }
            if (!m) {
                fprintf(stderr, "fabric client: bad message from the coordinator: %s\n", derr);
                continue;
            }
            switch (m->body_case) {
            case FI__ENVELOPE__BODY_HEARTBEAT:
                s_take_loads(c, m->heartbeat);
                s_take_audit_head(c, m->heartbeat->audit_head);
                fi_wire_free(&m);
                continue;
            case FI__ENVELOPE__BODY_HELLO:
                c->ready = 1;
                fi_wire_free(&m);
                return 0; /* lets fi_client_wait_ready see it at once */
            case FI__ENVELOPE__BODY_ERROR: {
                /* about the connection only when it names no request (as the
                 * coordinator sends them); one about a request is the
                 * request's */
                int conn = !m->error->request_id || !m->error->request_id[0];
                if (conn && m->error->code == FI__ERROR_CODE__ERR_NOT_REGISTERED) {
                    c->ready = 0;
                    (void)s_send_hello(c);
                    fi_wire_free(&m);
                    continue;
                }
                if (conn && m->error->code == FI__ERROR_CODE__ERR_REVOKED) c->revoked = 1;
                break;
            }
            default: break;
            }
            *out = m;
            return 1;
        }
        if (fi_wire_now_ms() >= deadline) return 0;
    }
}

int fi_client_wait_ready(fi_client *c, int timeout_ms, char *err, size_t errlen) {
    uint64_t deadline = fi_wire_now_ms() + (uint64_t)timeout_ms;
    while (!c->ready) {
        uint64_t now = fi_wire_now_ms();
        if (now >= deadline) {
            snprintf(err, errlen, "no answer from the coordinator at %s within %d ms",
                     c->o.endpoint, timeout_ms);
            return -1;
        }
        fi_msg *m = NULL;
        int rc = fi_client_recv(c, (int)(deadline - now), &m, err, errlen);
        if (rc < 0) return -1;
        fi_wire_free(&m);
    }
    return 0;
}

int fi_client_call(fi_client *c, const fi_msg *req, fi_msg_type want, int timeout_ms,
                   fi_msg **reply, char *err, size_t errlen) {
    *reply = NULL;
    if (fi_client_send(c, req) != 0) {
        snprintf(err, errlen, "cannot queue the request (not connected or queue full)");
        return -1;
    }
    uint64_t deadline = fi_wire_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        uint64_t now = fi_wire_now_ms();
        if (now >= deadline) {
            snprintf(err, errlen, "no reply from the coordinator within %d ms", timeout_ms);
            return 0;
        }
        fi_msg *m = NULL;
        int rc = fi_client_recv(c, (int)(deadline - now), &m, err, errlen);
        if (rc < 0) return -1;
        if (rc == 0) continue;
        if (m->body_case == want || m->body_case == FI__ENVELOPE__BODY_ERROR) {
            *reply = m;
            return 1;
        }
        fi_wire_free(&m);
    }
}

int fi_client_infer(fi_client *c, const Fi__InferRequest *rq, fi_client_text_fn on_text,
                    void *user, int timeout_ms, fi_client_result *res, char *err,
                    size_t errlen) {
    memset(res, 0, sizeof *res);
    unsigned gen = c->reconnects;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_INFER;
    m.infer = (Fi__InferRequest *)rq;
    if (fi_client_send(c, &m) != 0) {
        snprintf(err, errlen, "cannot queue the request (not connected or queue full)");
        return -1;
    }
    uint64_t deadline = fi_wire_now_ms() + (uint64_t)timeout_ms;
    int cancelled = 0;
    for (;;) {
        uint64_t now = fi_wire_now_ms();
        if (now >= deadline || c->reconnects != gen) {
            snprintf(err, errlen, c->reconnects != gen
                                      ? "the connection to the coordinator was lost"
                                      : "no result within %d ms", timeout_ms);
            return -1;
        }
        fi_msg *r = NULL;
        int rc = fi_client_recv(c, (int)(deadline - now), &r, err, errlen);
        if (rc < 0) return -1;
        if (rc == 0) continue;
        const char *id = r->body_case == FI__ENVELOPE__BODY_CHUNK   ? r->chunk->request_id
                         : r->body_case == FI__ENVELOPE__BODY_FINAL ? r->final->request_id
                         : r->body_case == FI__ENVELOPE__BODY_ERROR ? r->error->request_id
                                                                    : NULL;
        int ours = id && !strcmp(id, rq->request_id);
        /* An error about no request in particular (a refused message) ends
         * the call too. */
        if (r->body_case == FI__ENVELOPE__BODY_ERROR && id && !id[0]) ours = 1;
        if (!ours) {
            fi_wire_free(&r);
            continue;
        }
        if (r->body_case == FI__ENVELOPE__BODY_CHUNK) {
            if (!cancelled && on_text && on_text(user, r->chunk->text, strlen(r->chunk->text))) {
                Fi__Cancel cn = FI__CANCEL__INIT;
                cn.request_id = rq->request_id;
                fi_msg cm = FI__ENVELOPE__INIT;
                cm.body_case = FI__ENVELOPE__BODY_CANCEL;
                cm.cancel = &cn;
                if (fi_client_send(c, &cm) != 0) { /* best effort: the worker times out */
                }
                cancelled = 1;
                res->error = FI__ERROR_CODE__ERR_CANCELLED;
                snprintf(res->message, sizeof res->message, "cancelled by the caller");
                fi_wire_free(&r);
                return 0;
            }
            fi_wire_free(&r);
            continue;
        }
        if (r->body_case == FI__ENVELOPE__BODY_FINAL) {
            res->n_prompt = r->final->n_prompt;
            res->n_generated = r->final->n_generated;
            snprintf(res->stop_reason, sizeof res->stop_reason, "%s", r->final->stop_reason);
        } else {
            res->error = r->error->code;
            snprintf(res->message, sizeof res->message, "%s", r->error->message);
        }
        fi_wire_free(&r);
        return 0;
    }
}

static int s_enrol(const fi_client_opts *o, const char *enrol_endpoint, const char *token,
                                Fi__Role role, const char *site, const char *region, int timeout_ms,
                                char fpr[FI_KEYS_FPR_LEN], char *err, size_t errlen);

int fi_client_enrol(const fi_client_opts *o, const char *enrol_endpoint, const char *token,
                    Fi__Role role, const char *site, const char *region, int timeout_ms,
                    char fpr[FI_KEYS_FPR_LEN], char *err, size_t errlen) {
    char line[256];
    if (token && !strcmp(token, "-")) {
        if (!fgets(line, sizeof line, stdin)) {
            snprintf(err, errlen, "--enrol -: no token on standard input");
            return -1;
        }
        size_t n = strlen(line);
        while (n && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ')) line[--n] = 0;
        token = line;
    }
    int rc = s_enrol(o, enrol_endpoint, token, role, site, region, timeout_ms, fpr, err, errlen);
    sodium_memzero(line, sizeof line);
    return rc;
}

static int s_enrol(const fi_client_opts *o, const char *enrol_endpoint, const char *token,
                                Fi__Role role, const char *site, const char *region, int timeout_ms,
                                char fpr[FI_KEYS_FPR_LEN], char *err, size_t errlen) {
    int rc = -1;
    void *ctx = zmq_ctx_new(), *s = NULL, *mon = NULL;
    fi_sockopts so;
    fi_sockopts_default(&so);
    so.handshake_ms = o->handshake_ms;
    so.plaintext = o->plaintext;
    if (!ctx || !(s = zmq_socket(ctx, ZMQ_DEALER))) {
        snprintf(err, errlen, "zmq: %s", zmq_strerror(zmq_errno()));
        goto done;
    }
    if (fi_sock_client(s, &o->kp, o->server_pub, &so, err, errlen) != 0) goto done;
    if (zmq_socket_monitor(s, "inproc://fi-enrol-monitor", ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0 ||
        !(mon = zmq_socket(ctx, ZMQ_PAIR)) || zmq_connect(mon, "inproc://fi-enrol-monitor") != 0 ||
        zmq_connect(s, enrol_endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", enrol_endpoint,
                 zmq_strerror(zmq_errno()));
        goto done;
    }
    Fi__Enrol en = FI__ENROL__INIT;
    en.token = (char *)token;
    en.role = role;
    en.site = (char *)(site ? site : "");
    en.region = (char *)(region ? region : "");
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_ENROL;
    m.enrol = &en;
    size_t len = 0;
    uint8_t *buf = fi_wire_encode(&m, &len);
    int sent = buf && zmq_send(s, buf, len, ZMQ_DONTWAIT) >= 0;
    if (buf) sodium_memzero(buf, len); /* it holds the token */
    free(buf);
    if (!sent) {
        snprintf(err, errlen, "cannot send the enrolment");
        goto done;
    }
    zmq_pollitem_t items[2] = {{s, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
    uint64_t deadline = fi_wire_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        uint64_t now = fi_wire_now_ms();
        if (now >= deadline) {
            snprintf(err, errlen, "no answer from %s within %d ms", enrol_endpoint, timeout_ms);
            goto done;
        }
        if (zmq_poll(items, 2, (long)(deadline - now)) < 0) continue;
        if (items[1].revents & ZMQ_POLLIN) {
            snprintf(err, errlen, "the coordinator refused this key at the handshake (revoked?)");
            goto done;
        }
        if (!(items[0].revents & ZMQ_POLLIN)) continue;
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, s, 0) < 0) {
            zmq_msg_close(&msg);
            continue;
        }
        Fi__ErrorCode code;
        fi_msg *r = fi_wire_decode(zmq_msg_data(&msg), zmq_msg_size(&msg), 0, &code, err, errlen);
        zmq_msg_close(&msg);
        if (!r) goto done;
        if (r->body_case == FI__ENVELOPE__BODY_ENROL_REPLY) {
            snprintf(fpr, FI_KEYS_FPR_LEN, "%s", r->enrol_reply->fingerprint);
            rc = 0;
        } else if (r->body_case == FI__ENVELOPE__BODY_ERROR) {
            snprintf(err, errlen, "enrolment refused: %s (%s)", r->error->message,
                     fi_wire_error_name(r->error->code));
        } else {
            snprintf(err, errlen, "unexpected %s in answer to enrol",
                     fi_wire_type_name(r->body_case));
        }
        fi_wire_free(&r);
        goto done;
    }
done:
    fi_sock_close_monitored(s);
    if (mon) zmq_close(mon);
    if (ctx) zmq_ctx_term(ctx);
    return rc;
}
