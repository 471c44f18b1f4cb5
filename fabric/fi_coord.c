/*
 * fi_coord.c - the coordinator's broker loop. See fi_coord.h.
 *
 * Peers are kept in a small array searched linearly: a coordinator serves
 * tens to hundreds of peers, and a scan of that is cheaper than the CURVE
 * work on each message. Requests likewise.
 */
#include "fi_coord.h"
#include "fi_coord_audit.h"
#include "fi_coord_policy.h"
#include "fi_coord_route.h"
#include "fi_coord_ship.h"
#include "fi_coord_tokens.h"
#include "fi_coord_verify.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include <sodium.h>
#include <zmq.h>

#define S_MAX_MODELS 8
#define S_MODEL_NAME 64
#define S_MAX_STATUS 4096
#define S_ADDR_LEN 64
#define S_MAX_CANDS 64     /* workers considered for one request */
#define S_AFFINITY 1024    /* remembered conversations (direct-mapped) */
#define S_MAX_HASHES 512   /* prefix hashes of a request taken */
#define S_DRAIN_MS 20      /* one socket's turn at the loop, at most */
#define S_ENROL_HWM 64     /* enrolment messages that may wait per connection */
#define S_WITNESS_KEEP_MS 5000 /* the edges' audit witnesses are written at most this often */

typedef struct s_model {
    char name[S_MODEL_NAME]; /* model a worker serves */
    uint32_t capacity;       /* requests at once */
} s_model;

typedef struct s_peer {
    uint64_t serial;               /* never reused; requests refer to peers by it */
    uint8_t rid[256];              /* ROUTER routing id */
    size_t rid_len;                /* bytes of rid */
    fi_peer_rec rec;               /* enrolled identity, from the key */
    uint64_t last_ms;              /* when the last message arrived */
    int hello;                     /* 1 once it said Hello */
    int n_models;                  /* entries of models */
    s_model models[S_MAX_MODELS];  /* what a worker serves */
    uint32_t in_flight;            /* requests open on (worker) or from (edge) it */
    int fd;                        /* TCP socket it last spoke on, -1 unknown */
    char addr[S_ADDR_LEN];         /* that socket's peer address (logs) */
    struct sockaddr_storage sa;    /* ... and its whole peer endpoint, address and port, */
    socklen_t sa_len;              /* for the cut-off check (0: unknown) */
    uint64_t policy_version;       /* edges: the bundle version said in Hello or since */
    uint32_t running, queued;      /* clusters: reported load (heartbeats) */
    uint32_t kv_free, kv_total;    /* clusters: reported KV-cache blocks */
    uint8_t *filter;               /* clusters: reported prefix filter (owned), NULL: none */
    size_t filter_len;             /* its bytes */
    uint32_t filter_ones;          /* its bits set (its fill, for the router) */
    int64_t wit_seq;               /* edges: the audit head they say they were told (0: none) */
    char wit_hash[65];             /* ... its hash */
    int64_t wit_ms;                /* when they first said it (Unix ms) */
    int wit_dirty;                 /* not yet kept in the audit log's witnesses */
    int wit_malformed;             /* it sent a malformed one (logged once) */
    int wit_failed;                /* its witness is not in our log as it was told: it is
                                      told no newer head, so it keeps saying that one */
} s_peer;

/* The worker that served a conversation (a user of an edge) last. */
typedef struct s_affinity {
    uint64_t key;                  /* hash of edge serial, tenant and user; 0: empty */
    uint64_t worker;               /* serial of the worker */
} s_affinity;

typedef struct s_req {
    uint64_t id;                       /* coordinator's id ("c<id>" on the worker side) */
    char edge_rid[FI_WIRE_MAX_ID + 1]; /* the edge's own request id */
    uint64_t edge;                     /* serial of the sending peer */
    uint64_t worker;                   /* serial of the serving worker */
    uint64_t started_ms;               /* when it was routed */
} s_req;

struct fi_coord {
    fi_coord_opts o;               /* options, copied */
    fi_keypair kp;                 /* coordinator's key pair (wiped on destroy) */
    fi_store *st;                  /* fleet state */
    fi_ship *ship;                 /* policy store, signing key, audit log */
    fi_apptok *apptok;             /* edges' application tokens (hashes) */
    fi_coord_audit *raudit;        /* writer of our routing decisions to the audit log */
    fi_coord_verify *verify;       /* fedctl audit verify, on its own thread */
    void *ctx;                     /* ZeroMQ context */
    void *zap;                     /* ZAP handler (REP, inproc) */
    void *router;                  /* fabric endpoint */
    void *enrol;                   /* enrolment endpoint */
    void *mon[2];                  /* PAIRs receiving each endpoint's failed handshakes */
    uint64_t failed_handshakes;    /* since the last log line */
    uint64_t failed_total;         /* since start */
    char ep[2][FI_CONF_STR_MAX];   /* bound endpoints */
    s_peer *peers;                 /* connected peers */
    size_t n_peers, cap_peers;     /* used / allocated */
    s_req *reqs;                   /* open requests */
    size_t n_reqs, cap_reqs;       /* used / allocated */
    uint64_t next_serial;          /* for peers */
    uint64_t next_req;             /* for requests (ids start at random: fi_coord_new) */
    uint64_t n_routed;             /* routing choices made: the tie key of hash-less requests */
    uint64_t next_beat_ms;         /* when heartbeats go out next */
    int loads_truncated;           /* the last heartbeat to edges left rows out (logged once) */
    int head_failing;              /* the audit head could not be read (logged once) */
    uint64_t wit_kept_ms;          /* when the edges' witnesses were last kept (s_tick) */
    s_affinity affinity[S_AFFINITY]; /* conversations and their last worker */
};

#define S_OFF(f) offsetof(fi_coord_opts, f)
const fi_conf_key fi_coord_conf_keys[] = {
    {"bind", FI_CONF_STR, S_OFF(bind), 0, 0, 0, 0},
    {"enrol_bind", FI_CONF_STR, S_OFF(enrol_bind), 0, 0, 0, 0},
    {"db", FI_CONF_STR, S_OFF(db), 1, 0, 0, 0},
    {"secret_key", FI_CONF_STR, S_OFF(secret_key), 1, 0, 0, 0},
    {"heartbeat_ms", FI_CONF_INT, S_OFF(heartbeat_ms), 0, 10, 600000, 0},
    {"liveness", FI_CONF_INT, S_OFF(liveness), 0, 2, 100, 0},
    {"handshake_ms", FI_CONF_INT, S_OFF(handshake_ms), 0, 100, 60000, 0},
    {"max_msg", FI_CONF_INT, S_OFF(max_msg), 0, 1024, (long)FI_WIRE_MAX_MSG, 0},
    {"hwm", FI_CONF_INT, S_OFF(hwm), 0, 10, 1000000, 0},
    {"max_in_flight", FI_CONF_INT, S_OFF(max_in_flight), 0, 1, 100000, 0},
    {"policy_key", FI_CONF_STR, S_OFF(policy_key), 0, 0, 0, 0},
    {"audit_db", FI_CONF_STR, S_OFF(audit_db), 0, 0, 0, 0},
    {"policy_valid_s", FI_CONF_INT, S_OFF(policy_valid_s), 0, 60, 10 * 366 * 86400, 0},
    {"policy_check_key", FI_CONF_STR, S_OFF(policy_check_key), 0, 0, 0, 0},
    {NULL, FI_CONF_STR, 0, 0, 0, 0, 0},
};

void fi_coord_opts_default(fi_coord_opts *o) {
    memset(o, 0, sizeof *o);
    snprintf(o->bind, sizeof o->bind, "tcp://0.0.0.0:7700");
    snprintf(o->enrol_bind, sizeof o->enrol_bind, "tcp://0.0.0.0:7701");
    snprintf(o->db, sizeof o->db, "coordinator.db");
    o->heartbeat_ms = 1000;
    o->liveness = 3;
    o->handshake_ms = 2000;
    o->max_msg = (int)FI_WIRE_MAX_MSG;
    o->hwm = 1000;
    o->max_in_flight = 64;
    o->policy_valid_s = FI_SHIP_DEFAULT_VALID_S;
}

void fi_coord_log(const char *fmt, ...) {
    char ts[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s coordinator: ", ts);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* --- ZAP --------------------------------------------------------------- */

static int s_zap_check(void *user, const char *domain, const uint8_t pub[FI_KEYS_BYTES],
                       const char *address, char *uid, size_t uidlen, char *reason,
                       size_t reasonlen) {
    fi_coord *c = user;
    char fpr[FI_KEYS_FPR_LEN], z[FI_KEYS_Z85_LEN];
    fi_keys_fingerprint(pub, fpr);
    fi_peer_rec rec;
    int have = fi_store_peer_get(c->st, pub, &rec);
    int enrol = !strcmp(domain, FI_ZAP_DOMAIN_ENROL);
    if (!enrol && strcmp(domain, FI_ZAP_DOMAIN_FABRIC)) {
        snprintf(reason, reasonlen, "unknown domain");
    } else if (have < 0) {
        snprintf(reason, reasonlen, "store error");
    } else if (have == 1 && rec.revoked) {
        snprintf(reason, reasonlen, "revoked key");
    } else if (have == 0 && !enrol) {
        snprintf(reason, reasonlen, "unknown key");
    } else {
        fi_keys_to_z85(pub, z);
        snprintf(uid, uidlen, "%s", z);
        return 1;
    }
    fi_coord_log("refused %s %s from %s at the handshake (%s endpoint)", reason, fpr, address,
          enrol ? "enrolment" : "fabric");
    return 0;
}

/* --- peers and requests -------------------------------------------------- */

static s_peer *s_peer_by_rid(fi_coord *c, const void *rid, size_t len) {
    for (size_t i = 0; i < c->n_peers; i++)
        if (c->peers[i].rid_len == len && !memcmp(c->peers[i].rid, rid, len)) return &c->peers[i];
    return NULL;
}

static s_peer *s_peer_by_serial(fi_coord *c, uint64_t serial) {
    for (size_t i = 0; i < c->n_peers; i++)
        if (c->peers[i].serial == serial) return &c->peers[i];
    return NULL;
}

static s_req *s_req_by_id(fi_coord *c, uint64_t id) {
    for (size_t i = 0; i < c->n_reqs; i++)
        if (c->reqs[i].id == id) return &c->reqs[i];
    return NULL;
}

static void s_req_remove(fi_coord *c, s_req *r) {
    s_peer *w = s_peer_by_serial(c, r->worker), *e = s_peer_by_serial(c, r->edge);
    if (w && w->in_flight) w->in_flight--;
    if (e && e->in_flight) e->in_flight--;
    *r = c->reqs[--c->n_reqs];
}

/* Sends one encoded message to a peer without blocking; frees buf. 0, or
 * -1 (the message dropped) with errno: EMSGSIZE when buf is NULL (its
 * encoder failed: over FI_WIRE_MAX_MSG, or out of memory), EHOSTUNREACH
 * when the peer's connection is gone (ZMQ_ROUTER_MANDATORY), EAGAIN when
 * its queue is full. */
static int s_send(fi_coord *c, void *sock, const void *rid, size_t rid_len, uint8_t *buf,
                  const size_t *len) {
    int rc = -1, e = EMSGSIZE;
    /* len by pointer: read after buf's encoder has written it. */
    if (buf) {
        if (zmq_send(sock, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
            zmq_send(sock, buf, *len, ZMQ_DONTWAIT) >= 0)
            rc = 0;
        else
            e = zmq_errno();
    }
    free(buf);
    (void)c;
    if (rc) errno = e;
    return rc;
}

static int s_send_msg(fi_coord *c, void *sock, const void *rid, size_t rid_len, const fi_msg *m) {
    size_t len = 0;
    uint8_t *buf = fi_wire_encode(m, &len);
    return s_send(c, sock, rid, rid_len, buf, &len);
}

/* s_send_msg for a message that holds a secret (an enrolment token): the
 * encoded copy is wiped before it is freed. */
static int s_send_secret(fi_coord *c, void *sock, const void *rid, size_t rid_len, const fi_msg *m) {
    size_t len = 0;
    uint8_t *buf = fi_wire_encode(m, &len);
    if (!buf) return -1;
    int rc = zmq_send(sock, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
                     zmq_send(sock, buf, len, ZMQ_DONTWAIT) >= 0
                 ? 0
                 : -1;
    sodium_memzero(buf, len);
    free(buf);
    (void)c;
    return rc;
}

static void s_send_error(fi_coord *c, void *sock, const void *rid, size_t rid_len,
                         const char *req_id, Fi__ErrorCode code, const char *msg) {
    size_t len = 0;
    (void)s_send(c, sock, rid, rid_len, fi_wire_error(req_id, code, msg, &len), &len);
}

/* Ends every request that involves peer p: requests it served end with an
 * error to their senders, requests it sent are cancelled at the worker. */
static void s_fail_requests_of(fi_coord *c, const s_peer *p, const char *why) {
    for (size_t i = 0; i < c->n_reqs;) {
        s_req *r = &c->reqs[i];
        if (r->worker == p->serial) {
            s_peer *e = s_peer_by_serial(c, r->edge);
            if (e)
                s_send_error(c, c->router, e->rid, e->rid_len, r->edge_rid,
                             FI__ERROR_CODE__ERR_PEER_DEAD, why);
            s_req_remove(c, r);
        } else if (r->edge == p->serial) {
            s_peer *w = s_peer_by_serial(c, r->worker);
            if (w) {
                char id[32];
                snprintf(id, sizeof id, "c%llu", (unsigned long long)r->id);
                Fi__Cancel cn = FI__CANCEL__INIT;
                cn.request_id = id;
                fi_msg m = FI__ENVELOPE__INIT;
                m.body_case = FI__ENVELOPE__BODY_CANCEL;
                m.cancel = &cn;
                (void)s_send_msg(c, c->router, w->rid, w->rid_len, &m);
            }
            s_req_remove(c, r);
        } else {
            i++;
        }
    }
}

static void s_tell_edges(fi_coord *c);

/* --- witnesses of the audit log (policy/fi_audit.h) ------------------------- */

/* The witness of edge p as fi_audit takes it. */
static fi_audit_witness s_witness_of(const s_peer *p) {
    fi_audit_witness w = {.who = p->rec.fpr, .site = p->rec.site, .seq = p->wit_seq, .reported = p->wit_ms};
    memcpy(w.hash, p->wit_hash, sizeof w.hash);
    return w;
}

/* Keeps the witnesses not yet kept (only's, when only is not NULL) in the
 * audit log, in one transaction; a failure is logged and tried again at
 * the next tick. */
static void s_keep_witnesses(fi_coord *c, s_peer *only) {
    enum { batch = 64 };
    fi_audit_witness w[batch];
    size_t at[batch], i = 0;
    for (;;) {
        size_t n = 0;
        for (; i < c->n_peers && n < batch; i++) {
            s_peer *p = &c->peers[i];
            if (!p->wit_dirty || (only && p != only)) continue;
            at[n] = i;
            w[n++] = s_witness_of(p);
        }
        if (!n) return;
        char err[300];
        if (fi_audit_witness_put(fi_ship_audit(c->ship), w, n, err, sizeof err) != 0) {
            fi_coord_log("audit: cannot keep %zu witness report(s) now: %s", n, err);
            return;
        }
        for (size_t k = 0; k < n; k++) c->peers[at[k]].wit_dirty = 0;
    }
}

/* Edge p's witness against the log now: a failure is logged when it is
 * new, and the witness marked to be kept (its row may be gone with the
 * records). 0 holds, 1 fails, -1 the log could not be read (logged). */
static int s_check_witness(fi_coord *c, s_peer *p) {
    fi_audit_witness w = s_witness_of(p);
    char why[400];
    int r = fi_audit_witness_check(fi_ship_audit(c->ship), &w, why, sizeof why);
    if (r < 0) {
        fi_coord_log("audit: cannot check edge %s's witness: %s", p->rec.fpr, why);
        return -1;
    }
    if (r > 0 && !p->wit_failed) fi_coord_log("AUDIT LOG NOT AS WITNESSED: %s", why);
    if (r > 0) p->wit_dirty = 1;
    p->wit_failed = r > 0;
    return r;
}

/* An edge's Hello or heartbeat says which head of our audit log it was
 * told last: checked against the log at once when it changes (a cut or a
 * rewrite is logged loudly), kept at the next tick. An edge whose witness
 * the log does not hold is told no newer head (s_tell_edges): it goes on
 * saying the one it has, so that every verify finds it again (the audit
 * log keeps a failing witness, fi_audit_witness_put), after our restarts
 * too, until an operator resets it (fedinfer edge witness --reset). */
static void s_take_witness(fi_coord *c, s_peer *p, const Fi__AuditHead *ah) {
    if (!ah || p->rec.role != FI__ROLE__ROLE_EDGE) return;
    int64_t seq = ah->seq <= (uint64_t)INT64_MAX ? (int64_t)ah->seq : 0;
    if (!fi_audit_head_valid(seq, ah->hash)) {
        if (!p->wit_malformed)
            fi_coord_log("edge %s: its audit witness (record %llu) is malformed; ignored", p->rec.fpr,
                         (unsigned long long)ah->seq);
        p->wit_malformed = 1;
        return;
    }
    if (seq == p->wit_seq && !strcmp(ah->hash, p->wit_hash)) return;
    p->wit_seq = seq;
    memcpy(p->wit_hash, ah->hash, sizeof p->wit_hash);
    p->wit_ms = (int64_t)time(NULL) * 1000;
    p->wit_dirty = 1;
    p->wit_failed = 0; /* a new witness: its failure is news */
    (void)s_check_witness(c, p);
}

/* Every edge's witness against the log as it is now, before each tick's
 * heartbeats: a log cut or rewritten while we run is found within a
 * heartbeat, before the edges could be told a newer head (they are not,
 * once theirs fails), and a failing witness is kept again (its row may
 * have been removed with the records). */
static void s_recheck_witnesses(fi_coord *c) {
    for (size_t i = 0; i < c->n_peers; i++) {
        s_peer *p = &c->peers[i];
        if (p->rec.role != FI__ROLE__ROLE_EDGE || p->wit_seq <= 0) continue;
        if (s_check_witness(c, p) < 0) return; /* logged: the next tick tries again */
    }
}

/* Removes p from routing; its requests end (see s_fail_requests_of). Logs
 * why unless quiet. A cluster worker's going is told to the edges at once. */
static void s_peer_remove(fi_coord *c, s_peer *p, const char *why, int quiet) {
    if (!quiet)
        fi_coord_log("peer %s (%s %s) removed: %s", p->rec.fpr, fi_wire_role_name(p->rec.role),
              p->rec.site[0] ? p->rec.site : "-", why);
    s_fail_requests_of(c, p, why);
    if (p->wit_dirty) s_keep_witnesses(c, p);
    free(p->filter);
    int worker = p->rec.role == FI__ROLE__ROLE_CLUSTER && p->hello;
    *p = c->peers[--c->n_peers];
    if (worker) s_tell_edges(c);
}

/* The requests open from p's key over all its connections (one normally;
 * a connection that never says Hello does not replace the others), so
 * that max_in_flight bounds a key, not a connection. */
static uint64_t s_key_in_flight(const fi_coord *c, const s_peer *p) {
    uint64_t n = 0;
    for (size_t i = 0; i < c->n_peers; i++)
        if (!memcmp(c->peers[i].rec.pub, p->rec.pub, FI_KEYS_BYTES)) n += c->peers[i].in_flight;
    return n;
}

/* Finds or registers the peer behind a routing id; the identity is the
 * ZAP User-Id (the Z85 key) of the message. NULL when the message must be
 * dropped. */
static s_peer *s_peer_for(fi_coord *c, const void *rid, size_t rid_len, const char *uid, int fd,
                          const char *addr) {
    uint8_t pub[FI_KEYS_BYTES];
    if (!uid || fi_keys_from_z85(uid, pub) != 0) {
        fi_coord_log("dropped a message without an authenticated key (from %s)", addr);
        return NULL;
    }
    s_peer *p = s_peer_by_rid(c, rid, rid_len);
    if (p) {
        if (memcmp(p->rec.pub, pub, FI_KEYS_BYTES)) {
            fi_coord_log("dropped a message whose key does not match its connection (from %s)", addr);
            return NULL;
        }
    } else {
        if (rid_len > sizeof p->rid) return NULL;
        if (c->n_peers == c->cap_peers) {
            size_t cap = c->cap_peers ? 2 * c->cap_peers : 16;
            s_peer *np = realloc(c->peers, cap * sizeof *np);
            if (!np) return NULL;
            c->peers = np;
            c->cap_peers = cap;
        }
        p = &c->peers[c->n_peers];
        memset(p, 0, sizeof *p);
        int have = fi_store_peer_get(c->st, pub, &p->rec);
        if (have != 1) {
            fi_coord_log("dropped a message from a key not in the store (from %s)", addr);
            return NULL;
        }
        if (p->rec.revoked) return NULL; /* not registered again by a message sent before its cut */
        c->n_peers++;
        p->serial = ++c->next_serial;
        memcpy(p->rid, rid, rid_len);
        p->rid_len = rid_len;
    }
    if (p->rec.revoked) return NULL;
    p->fd = fd;
    snprintf(p->addr, sizeof p->addr, "%s", addr);
    p->sa_len = sizeof p->sa;
    if (fd < 0 || getpeername(fd, (struct sockaddr *)&p->sa, &p->sa_len) != 0) p->sa_len = 0;
    p->last_ms = fi_wire_now_ms();
    return p;
}

/* Cuts a connection off beneath libzmq: shutting the TCP socket down makes
 * libzmq see the end of the stream and drop the connection; the peer's
 * reconnect then fails at the ZAP handler. The fd is checked against the
 * peer endpoint (address and port) it was seen with, so a number reused by
 * another connection, even one from the same host, is never touched. */
static void s_cut_off(const s_peer *p) {
    if (p->fd < 0 || !p->sa_len) return;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getpeername(p->fd, (struct sockaddr *)&ss, &sl) != 0) return;
    if (sl != p->sa_len || ss.ss_family != p->sa.ss_family) return;
    int same = 0;
    if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *a = (const void *)&ss, *b = (const void *)&p->sa;
        same = a->sin_port == b->sin_port && a->sin_addr.s_addr == b->sin_addr.s_addr;
    } else if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const void *)&ss, *b = (const void *)&p->sa;
        same = a->sin6_port == b->sin6_port &&
               !memcmp(&a->sin6_addr, &b->sin6_addr, sizeof a->sin6_addr);
    }
    if (same) shutdown(p->fd, SHUT_RDWR);
}

/* --- handlers ------------------------------------------------------------ */

static void s_on_hello(fi_coord *c, s_peer *p, const Fi__Hello *h) {
    /* One live connection per key: an older one is a connection that died
     * without us noticing yet. */
    int replaced = 0;
    for (size_t i = 0; i < c->n_peers;) {
        s_peer *q = &c->peers[i];
        if (q != p && !memcmp(q->rec.pub, p->rec.pub, FI_KEYS_BYTES)) {
            uint64_t keep = p->serial;
            s_peer_remove(c, q, "replaced by a new connection of the same key", 1);
            replaced = 1;
            p = s_peer_by_serial(c, keep);
            if (!p) return;
        } else {
            i++;
        }
    }
    p->n_models = 0;
    p->policy_version = p->rec.role == FI__ROLE__ROLE_EDGE ? h->policy_version : 0;
    if (p->rec.role == FI__ROLE__ROLE_CLUSTER) {
        for (size_t i = 0; i < h->n_models && p->n_models < S_MAX_MODELS; i++) {
            const Fi__ModelOffer *mo = h->models[i];
            if (!mo || !mo->name || !mo->name[0] || strlen(mo->name) >= S_MODEL_NAME ||
                mo->capacity == 0 || mo->capacity > 1024)
                continue;
            snprintf(p->models[p->n_models].name, S_MODEL_NAME, "%s", mo->name);
            p->models[p->n_models].capacity = mo->capacity;
            p->n_models++;
        }
    }
    if (!p->hello)
        fi_coord_log("peer %s (%s %s/%s) %s from %s, %d model(s)", p->rec.fpr,
              fi_wire_role_name(p->rec.role), p->rec.site[0] ? p->rec.site : "-",
              p->rec.region[0] ? p->rec.region : "-", replaced ? "reconnected" : "connected",
              p->addr, p->n_models);
    p->hello = 1;
    if (p->rec.role == FI__ROLE__ROLE_CLUSTER) s_tell_edges(c); /* a worker came, or its models changed */
    Fi__Hello r = FI__HELLO__INIT;
    r.role = FI__ROLE__ROLE_COORDINATOR;
    r.software = (char *)"fedinfer " FI_VERSION;
    r.heartbeat_ms = (uint32_t)c->o.heartbeat_ms;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_HELLO;
    m.hello = &r;
    (void)s_send_msg(c, c->router, p->rid, p->rid_len, &m);
}

/* FNV-1a over a conversation's identity: the edge, the tenant, the user. */
static uint64_t s_conv_key(const s_peer *e, const Fi__InferRequest *rq) {
    if (!rq->user || !rq->user[0]) return 0;
    uint64_t h = 1469598103934665603ull;
    const char *parts[3] = {e->rec.fpr, rq->tenant ? rq->tenant : "", rq->user};
    for (int i = 0; i < 3; i++) {
        for (const char *p = parts[i]; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
        h = (h ^ 0xff) * 1099511628211ull;
    }
    return h ? h : 1;
}

/* Appends the coordinator's own routing decision to its audit log. */
static void s_audit_route(fi_coord *c, const s_peer *e, const Fi__InferRequest *rq,
                          const char *decision, const char *target, const char *rules,
                          const char *digest) {
    if (!c->raudit) return;
    char labels[512] = "";
    for (size_t i = 0; i < rq->n_labels && i < 32; i++)
        snprintf(labels + strlen(labels), sizeof labels - strlen(labels), "%s%s", i ? "," : "",
                 rq->labels[i] ? rq->labels[i] : "");
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    fi_audit_record r;
    memset(&r, 0, sizeof r);
    r.time = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    r.request_id = rq->request_id;
    r.tenant = rq->tenant ? rq->tenant : "";
    r.application = rq->application ? rq->application : "";
    r.origin = e->rec.site;
    r.labels = labels;
    r.model = rq->model;
    r.latency_ms = -1;
    r.prompt_tokens = rq->prompt_tokens ? (int64_t)rq->prompt_tokens : -1;
    r.decision = decision;
    r.target = target;
    r.rules = rules;
    r.policy_digest = digest ? digest : "";
    if (fi_coord_audit_put(c->raudit, &r) != 0)
        fi_coord_log("audit: cannot record the routing of %s: out of memory", rq->request_id);
}

/* A permitted live worker serving the request's model with room for it,
 * and what the router and the audit need to know about it. */
typedef struct s_cand {
    s_peer *w;                 /* the worker */
    fi_route_cand rc;          /* its routing inputs */
    fi_coord_verdict v;        /* the policy's verdict on its cluster */
} s_cand;

/* One request's policy verdicts, one per cluster (workers of a site share
 * it): the first S_MAX_SITES sites are remembered, later ones asked again. */
#define S_MAX_SITES 64
typedef struct s_verdicts {
    int n;
    const char *site[S_MAX_SITES];
    int ok[S_MAX_SITES];
    fi_coord_verdict v[S_MAX_SITES];
    char first_reason[256]; /* the first denial's reason */
} s_verdicts;

/* Whether the policy permits worker w for request rq from edge e; its
 * verdict in *v. */
static int s_permits(fi_coord *c, s_verdicts *vs, const Fi__InferRequest *rq, const s_peer *e,
                     const s_peer *w, fi_coord_verdict *v) {
    for (int i = 0; i < vs->n; i++)
        if (!strcmp(vs->site[i], w->rec.site)) {
            *v = vs->v[i];
            return vs->ok[i];
        }
    memset(v, 0, sizeof *v);
    int ok = 1;
    if (c->o.policy) {
        char reason[256] = "denied by policy";
        ok = c->o.policy(c->o.policy_user, rq, &e->rec, &w->rec, v, reason, sizeof reason);
        if (!ok && !vs->first_reason[0])
            snprintf(vs->first_reason, sizeof vs->first_reason, "%s", reason);
    }
    if (vs->n < S_MAX_SITES) {
        vs->site[vs->n] = w->rec.site;
        vs->ok[vs->n] = ok;
        vs->v[vs->n] = *v;
        vs->n++;
    }
    return ok;
}

/* The residency zone the worker is told for rq from edge e, verdict v:
 * the worker salts its prefix cache with it (and the tenant), and the
 * edge salted its prefix hashes with rq->zone.
 * - With a policy (policy_check_key): the origin's zone in the policy
 *   that permitted the request (v->zone), else the origin site; never the
 *   edge's word, since the zone is the policy's residency decision (an
 *   edge with another bundle, or none, must not choose it).
 * - Without one, the coordinator decides nothing from the zone, so the
 *   edge's own (1..FI_WIRE_MAX_NAME bytes; else the origin site): its
 *   hashes then match the worker's filter. Sending the origin site here
 *   made every edge's hashes miss (the edge salts with its policy's
 *   jurisdiction), and cache-aware routing was dead without a word. It is
 *   safe: the tenant the worker salts with is qualified with the origin
 *   site of the edge's key (fi_wire_cache_tenant), and the salt takes
 *   both with their lengths, so whatever zone an edge names, its requests
 *   can share cached blocks only with requests of its own site: an edge
 *   can split its own site's cache, never reach another site's. */
static const char *s_fwd_zone(const fi_coord *c, const s_peer *e, const Fi__InferRequest *rq,
                              const fi_coord_verdict *v) {
    if (c->o.policy) return v->zone[0] ? v->zone : e->rec.site;
    if (rq->zone && rq->zone[0] && strlen(rq->zone) <= FI_WIRE_MAX_NAME) return rq->zone;
    return e->rec.site;
}

/* 1 when the edge's prefix hashes can match the filter of a worker told
 * zone: they were salted with rq->zone. When the zones differ (the
 * coordinator's policy puts the origin in another zone than the edge's
 * does: an edge that has not installed the pushed bundle yet), a match
 * could only be a false positive of the filter. The coordinator does not
 * tell edges its zone (the Hello reply could, but the zone follows the
 * policy, which changes after Hello; the edge gets the pushed bundle and
 * then agrees). */
static int s_hashes_match_zone(const Fi__InferRequest *rq, const char *zone) {
    return !strcmp(rq->zone ? rq->zone : "", zone);
}

static void s_on_infer(fi_coord *c, s_peer *e, Fi__InferRequest *rq) {
    const char *rid = rq->request_id ? rq->request_id : "";
    if (!rid[0] || strlen(rid) > FI_WIRE_MAX_ID || !rq->model || !rq->model[0] ||
        rq->n_labels > 32) {
        s_send_error(c, c->router, e->rid, e->rid_len, rid, FI__ERROR_CODE__ERR_BAD_REQUEST,
                     "request_id (1..64 bytes), model and at most 32 labels are required");
        return;
    }
    if (rq->n_prefix_hashes > S_MAX_HASHES || rq->n_messages > 256 || rq->n_stop > 4 ||
        rq->n_logit_bias > FI_WIRE_MAX_BIAS) {
        s_send_error(c, c->router, e->rid, e->rid_len, rid, FI__ERROR_CODE__ERR_BAD_REQUEST,
                     "at most 512 prefix hashes, 256 messages, 4 stop strings and 300 logit_bias entries");
        return;
    }
    char tenant[FI_WIRE_CACHE_TENANT_MAX];
    if (fi_wire_cache_tenant(e->rec.site, rq->tenant, tenant) != 0 ||
        (rq->application && strlen(rq->application) > 63)) {
        s_send_error(c, c->router, e->rid, e->rid_len, rid, FI__ERROR_CODE__ERR_BAD_REQUEST,
                     "tenant and application: at most 63 bytes each");
        return;
    }
    if (s_key_in_flight(c, e) >= (uint64_t)c->o.max_in_flight) {
        char why[160];
        snprintf(why, sizeof why,
                 "too many requests in flight from this key (max_in_flight %d, over all its "
                 "connections)", c->o.max_in_flight);
        s_send_error(c, c->router, e->rid, e->rid_len, rid, FI__ERROR_CODE__ERR_BUSY, why);
        return;
    }
    /* The residency policy first: a worker is a candidate only once the
     * policy, asked with the origin of the edge's key, permits its
     * cluster; the router's scores never see the others. The permitted
     * ones with room are ranked S_MAX_CANDS at a time, each round's
     * winner kept first for the next (the order is total and does not
     * depend on the positions, so this is the pick over all of them). */
    s_verdicts vs;
    memset(&vs, 0, sizeof vs);
    s_cand cands[S_MAX_CANDS];
    fi_route_cand rcs[S_MAX_CANDS];
    int n = 0, permitted_full = 0, denied = 0;
    uint64_t conv = s_conv_key(e, rq);
    /* full ties: by the prefix (or, without one, in turns) */
    uint64_t key = fi_route_key(rq->prefix_hashes, (int)rq->n_prefix_hashes, c->n_routed++);
    s_affinity *aff = conv ? &c->affinity[conv % S_AFFINITY] : NULL;
    for (size_t i = 0; i < c->n_peers; i++) {
        s_peer *w = &c->peers[i];
        if (w->rec.role != FI__ROLE__ROLE_CLUSTER || !w->hello) continue;
        if (rq->cluster && rq->cluster[0] && strcmp(w->rec.site, rq->cluster)) continue;
        int k = 0;
        while (k < w->n_models && strcmp(w->models[k].name, rq->model)) k++;
        if (k == w->n_models) continue;
        fi_coord_verdict v;
        if (!s_permits(c, &vs, rq, e, w, &v)) {
            denied++;
            continue;
        }
        if (w->in_flight >= w->models[k].capacity) {
            permitted_full++;
            continue;
        }
        if (n == S_MAX_CANDS) {
            int best = fi_route_pick(rcs, n, rq->prefix_hashes, (int)rq->n_prefix_hashes, key, NULL);
            cands[0] = cands[best];
            rcs[0] = rcs[best];
            n = 1;
        }
        s_cand *cd = &cands[n];
        cd->w = w;
        cd->v = v;
        memset(&cd->rc, 0, sizeof cd->rc);
        cd->rc.in_flight = w->in_flight;
        cd->rc.capacity = w->models[k].capacity;
        cd->rc.running = w->running;
        cd->rc.queued = w->queued;
        /* the edge's hashes against its filter only when they were salted
         * with the zone it will be told (else they would only mislead) */
        int zone_ok = s_hashes_match_zone(rq, s_fwd_zone(c, e, rq, &v));
        cd->rc.filter = zone_ok ? w->filter : NULL;
        cd->rc.filter_len = zone_ok ? w->filter_len : 0;
        cd->rc.filter_ones = zone_ok ? w->filter_ones : 0;
        cd->rc.pref = v.score;
        cd->rc.affinity = aff && aff->key == conv && aff->worker == w->serial;
        memcpy(&cd->rc.id, w->rec.pub, sizeof cd->rc.id); /* its key: stable across reconnects */
        rcs[n++] = cd->rc;
    }
    if (n == 0) {
        /* every refusal is recorded, as what is served is */
        char msg[256], where[80] = "";
        const char *cluster = rq->cluster ? rq->cluster : "";
        fi_coord_verdict v0 = vs.n ? vs.v[0] : (fi_coord_verdict){0};
        if (cluster[0]) snprintf(where, sizeof where, " in cluster '%.64s'", cluster);
        if (permitted_full) {
            snprintf(msg, sizeof msg, "every permitted worker serving model '%.64s'%s is at capacity",
                     rq->model, where);
            s_audit_route(c, e, rq, "unavailable", cluster, msg, v0.digest);
            s_send_error(c, c->router, e->rid, e->rid_len, rid, FI__ERROR_CODE__ERR_BUSY, msg);
        } else if (denied) {
            s_audit_route(c, e, rq, "deny", "", vs.first_reason, v0.digest);
            s_send_error(c, c->router, e->rid, e->rid_len, rid, FI__ERROR_CODE__ERR_UNAUTHORISED,
                         vs.first_reason);
        } else {
            snprintf(msg, sizeof msg, "no live worker serves model '%.64s'%s", rq->model, where);
            s_audit_route(c, e, rq, "unavailable", cluster, msg, v0.digest);
            s_send_error(c, c->router, e->rid, e->rid_len, rid, FI__ERROR_CODE__ERR_NO_WORKER, msg);
        }
        return;
    }
    /* The best candidate gets it. One whose connection is gone (its
     * process died and the heartbeats have not yet said so: the socket
     * finds no such peer) is dropped, and removed after this request, and
     * the next best permitted one is tried. */
    uint64_t gone[S_MAX_CANDS];
    int n_gone = 0;
    for (;;) {
        int hit = 0;
        int pick = fi_route_pick(rcs, n, rq->prefix_hashes, (int)rq->n_prefix_hashes, key, &hit);
        s_peer *w = cands[pick].w;
        const char *zone = s_fwd_zone(c, e, rq, &cands[pick].v);
        char rules[512], zone_note[160] = "";
        if (rq->n_prefix_hashes && !s_hashes_match_zone(rq, zone))
            snprintf(zone_note, sizeof zone_note, " (hashes of zone '%.40s' ignored: the worker's is '%.40s')",
                     rq->zone ? rq->zone : "", zone);
        snprintf(rules, sizeof rules, "%s%sworker %s; prefix hit %d of %zu blocks%s; load %.2f%s",
                 c->o.policy ? cands[pick].v.rules : "no policy re-check",
                 "; ", w->rec.fpr, hit, rq->n_prefix_hashes, zone_note, fi_route_load(&rcs[pick]),
                 rcs[pick].affinity ? "; same conversation" : "");
        if (c->n_reqs == c->cap_reqs) {
            size_t cap = c->cap_reqs ? 2 * c->cap_reqs : 64;
            s_req *nr = realloc(c->reqs, cap * sizeof *nr);
            if (!nr) {
                s_audit_route(c, e, rq, "error", w->rec.site, "out of memory", cands[pick].v.digest);
                s_send_error(c, c->router, e->rid, e->rid_len, rid, FI__ERROR_CODE__ERR_INTERNAL,
                             "out of memory");
                return;
            }
            c->reqs = nr;
            c->cap_reqs = cap;
        }
        s_req *r = &c->reqs[c->n_reqs];
        r->id = ++c->next_req;
        snprintf(r->edge_rid, sizeof r->edge_rid, "%s", rid);
        r->edge = e->serial;
        r->worker = w->serial;
        r->started_ms = fi_wire_now_ms();
        /* The worker sees the coordinator's id, the origin known from the
         * edge's key, the residency zone (s_fwd_zone) and the tenant qualified
         * with the origin site (fi_wire_cache_tenant), whatever the edge wrote:
         * the worker salts its prefix cache with the last two, so no two sites
         * or zones share cached state. */
        char cid[32];
        snprintf(cid, sizeof cid, "c%llu", (unsigned long long)r->id);
        Fi__Origin origin = FI__ORIGIN__INIT;
        origin.site = e->rec.site;
        origin.region = e->rec.region;
        Fi__InferRequest fwd = *rq;
        fwd.request_id = cid;
        fwd.origin = &origin;
        fwd.zone = (char *)zone;
        fwd.tenant = tenant;
        /* What only the router and the policy need stays here: the end user's
         * id, the hashes, the application and the prompt's size. */
        fwd.user = (char *)"";
        fwd.application = (char *)"";
        fwd.prompt_tokens = 0;
        fwd.n_prefix_hashes = 0;
        fwd.prefix_hashes = NULL;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_INFER;
        m.infer = &fwd;
        if (s_send_msg(c, c->router, w->rid, w->rid_len, &m) != 0) {
            int why = errno;
            if (why == EHOSTUNREACH) {
                gone[n_gone++] = w->serial;
                if (n > 1) {
                    cands[pick] = cands[n - 1];
                    rcs[pick] = rcs[n - 1];
                    n--;
                    continue;
                }
            }
            const char *msg = why == EMSGSIZE      ? "the request is too large to forward"
                              : why == EHOSTUNREACH ? "the worker's connection is gone"
                                                    : "the worker's queue is full";
            s_audit_route(c, e, rq, "unavailable", w->rec.site, msg, cands[pick].v.digest);
            s_send_error(c, c->router, e->rid, e->rid_len, rid,
                         why == EMSGSIZE ? FI__ERROR_CODE__ERR_TOO_LARGE : FI__ERROR_CODE__ERR_BUSY, msg);
            break;
        }
        /* Recorded once it is on its way. */
        s_audit_route(c, e, rq, "permit", w->rec.site, rules, cands[pick].v.digest);
        if (aff) {
            aff->key = conv;
            aff->worker = w->serial;
        }
        c->n_reqs++;
        e->in_flight++;
        w->in_flight++;
        break;
    }
    for (int i = 0; i < n_gone; i++) {
        s_peer *p = s_peer_by_serial(c, gone[i]);
        if (p) s_peer_remove(c, p, "its connection is gone", 0);
    }
}

/* A chunk, final result or error from a worker: back to the request's
 * sender under the sender's own id. */
static void s_on_worker_reply(fi_coord *c, s_peer *w, fi_msg *m) {
    char **idp = m->body_case == FI__ENVELOPE__BODY_CHUNK   ? &m->chunk->request_id
                 : m->body_case == FI__ENVELOPE__BODY_FINAL ? &m->final->request_id
                                                            : &m->error->request_id;
    const char *id = *idp ? *idp : "";
    char *end = NULL;
    unsigned long long n = id[0] == 'c' ? strtoull(id + 1, &end, 10) : 0;
    s_req *r = n && end && !*end ? s_req_by_id(c, n) : NULL;
    if (!r || r->worker != w->serial) return; /* cancelled or ended: late replies are dropped */
    s_peer *e = s_peer_by_serial(c, r->edge);
    int last = m->body_case != FI__ENVELOPE__BODY_CHUNK;
    if (m->body_case == FI__ENVELOPE__BODY_ERROR) {
        /* A worker speaks for its request only: a code about the edge's
         * own connection or key (revoked, not registered, ...) from it
         * would make the edge act on its connection; it becomes an engine
         * error. */
        Fi__ErrorCode k = m->error->code;
        if (k != FI__ERROR_CODE__ERR_ENGINE && k != FI__ERROR_CODE__ERR_CANCELLED &&
            k != FI__ERROR_CODE__ERR_BUSY && k != FI__ERROR_CODE__ERR_BAD_REQUEST &&
            k != FI__ERROR_CODE__ERR_INTERNAL)
            m->error->code = FI__ERROR_CODE__ERR_ENGINE;
    }
    char *saved = *idp;
    *idp = r->edge_rid;
    int rc = e ? s_send_msg(c, c->router, e->rid, e->rid_len, m) : -1;
    int why = e ? errno : 0;
    *idp = saved;
    if (rc != 0) {
        /* The sender is gone or not reading, or the reply under the
         * sender's id (up to 64 bytes, longer than ours) is over the size
         * limit: stop the work, and tell the sender, which else would wait
         * for an answer that never comes. */
        if (!last) {
            Fi__Cancel cn = FI__CANCEL__INIT;
            cn.request_id = (char *)id;
            fi_msg cm = FI__ENVELOPE__INIT;
            cm.body_case = FI__ENVELOPE__BODY_CANCEL;
            cm.cancel = &cn;
            (void)s_send_msg(c, c->router, w->rid, w->rid_len, &cm);
        }
        if (e && why == EMSGSIZE)
            s_send_error(c, c->router, e->rid, e->rid_len, r->edge_rid, FI__ERROR_CODE__ERR_ENGINE,
                         "the worker's reply is over the message size limit");
        else if (e && !last)
            s_send_error(c, c->router, e->rid, e->rid_len, r->edge_rid, FI__ERROR_CODE__ERR_BUSY,
                         "stream dropped: the receiver's queue is full");
        last = 1;
    }
    if (last) s_req_remove(c, r);
}

static void s_on_cancel(fi_coord *c, s_peer *e, const Fi__Cancel *cn) {
    for (size_t i = 0; i < c->n_reqs; i++) {
        s_req *r = &c->reqs[i];
        if (r->edge != e->serial || !cn->request_id || strcmp(r->edge_rid, cn->request_id))
            continue;
        s_peer *w = s_peer_by_serial(c, r->worker);
        if (w) {
            char id[32];
            snprintf(id, sizeof id, "c%llu", (unsigned long long)r->id);
            Fi__Cancel fc = FI__CANCEL__INIT;
            fc.request_id = id;
            fi_msg m = FI__ENVELOPE__INIT;
            m.body_case = FI__ENVELOPE__BODY_CANCEL;
            m.cancel = &fc;
            (void)s_send_msg(c, c->router, w->rid, w->rid_len, &m);
        }
        s_req_remove(c, r);
        return;
    }
}

typedef struct s_status_ctx {
    fi_coord *c;              /* the coordinator */
    Fi__WorkerLoad *loads;    /* one per row */
    Fi__PeerStatus *rows;     /* one per enrolled peer */
    Fi__PeerStatus **ptrs;    /* pointers to rows, for the reply */
    Fi__ModelOffer *offers;   /* S_MAX_MODELS per row */
    Fi__ModelOffer **optrs;   /* pointers to offers */
    size_t n;                 /* rows filled */
    fi_peer_rec *recs;        /* copies the rows' strings point into */
    size_t cap;               /* rows allocated (peers enrolled since the count wait) */
} s_status_ctx;

static int s_status_row(void *user, const fi_peer_rec *rec) {
    s_status_ctx *s = user;
    if (s->n >= s->cap) return 1;
    size_t i = s->n++;
    s->recs[i] = *rec;
    Fi__PeerStatus *ps = &s->rows[i];
    fi__peer_status__init(ps);
    ps->fingerprint = s->recs[i].fpr;
    ps->role = rec->role;
    ps->site = s->recs[i].site;
    ps->region = s->recs[i].region;
    ps->revoked = rec->revoked;
    uint64_t now = fi_wire_now_ms();
    for (size_t k = 0; k < s->c->n_peers; k++) {
        s_peer *p = &s->c->peers[k];
        if (memcmp(p->rec.pub, rec->pub, FI_KEYS_BYTES)) continue;
        ps->connected = 1;
        ps->idle_ms = now - p->last_ms;
        ps->in_flight = p->in_flight;
        ps->policy_version = p->policy_version;
        ps->audit_witness = p->wit_seq > 0 ? (uint64_t)p->wit_seq : 0;
        ps->audit_witness_fails = p->wit_failed;
        if (p->rec.role == FI__ROLE__ROLE_CLUSTER) {
            Fi__WorkerLoad *wl = &s->loads[i];
            fi__worker_load__init(wl);
            wl->running = p->running;
            wl->queued = p->queued;
            wl->kv_blocks_free = p->kv_free;
            wl->kv_blocks_total = p->kv_total;
            ps->load = wl;
        }
        ps->n_models = (size_t)p->n_models;
        ps->models = &s->optrs[i * S_MAX_MODELS];
        for (int j = 0; j < p->n_models; j++) {
            Fi__ModelOffer *mo = &s->offers[i * S_MAX_MODELS + (size_t)j];
            fi__model_offer__init(mo);
            mo->name = p->models[j].name;
            mo->capacity = p->models[j].capacity;
            s->optrs[i * S_MAX_MODELS + (size_t)j] = mo;
        }
    }
    s->ptrs[i] = ps;
    return 0;
}

static void s_on_status(fi_coord *c, s_peer *op) {
    int64_t total = fi_store_count(c->st, "peers");
    size_t n = total < 0 ? 0 : total > S_MAX_STATUS ? S_MAX_STATUS : (size_t)total;
    s_status_ctx s = {c, calloc(n + 1, sizeof(Fi__WorkerLoad)), calloc(n + 1, sizeof(Fi__PeerStatus)),
                      calloc(n + 1, sizeof(Fi__PeerStatus *)),
                      calloc((n + 1) * S_MAX_MODELS, sizeof(Fi__ModelOffer)),
                      calloc((n + 1) * S_MAX_MODELS, sizeof(Fi__ModelOffer *)), 0,
                      calloc(n + 1, sizeof(fi_peer_rec)), n};
    if (total < 0 || !s.loads || !s.rows || !s.ptrs || !s.offers || !s.optrs || !s.recs) {
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_INTERNAL,
                     "cannot read the fleet");
    } else {
        s.n = 0;
        if (n) (void)fi_store_peer_each(c->st, s_status_row, &s);
        Fi__StatusReply sr = FI__STATUS_REPLY__INIT;
        sr.n_peers = s.n;
        sr.peers = s.ptrs;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_STATUS_REPLY;
        m.status_reply = &sr;
        (void)s_send_msg(c, c->router, op->rid, op->rid_len, &m);
    }
    free(s.loads);
    free(s.rows);
    free(s.ptrs);
    free(s.offers);
    free(s.optrs);
    free(s.recs);
}

static void s_on_token(fi_coord *c, s_peer *op, const Fi__TokenRequest *tr) {
    const char *site = tr->site ? tr->site : "", *region = tr->region ? tr->region : "";
    int need_site = tr->role == FI__ROLE__ROLE_EDGE || tr->role == FI__ROLE__ROLE_CLUSTER;
    if ((!need_site && tr->role != FI__ROLE__ROLE_OPERATOR) ||
        (need_site && (!fi_store_name_ok(site) || !fi_store_name_ok(region))) ||
        (!need_site && (site[0] || region[0])) || tr->ttl_s == 0 || tr->ttl_s > 7 * 86400) {
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_BAD_REQUEST,
                     "token request needs a role (edge, cluster, operator), a site and region "
                     "for edges and clusters (names of [A-Za-z0-9._-]), and a ttl of 1 s to 7 days");
        return;
    }
    char tok[FI_KEYS_TOKEN_LEN], hash[65], err[256];
    int64_t expires = (int64_t)time(NULL) + tr->ttl_s;
    if (fi_keys_token(tok) != 0) {
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_INTERNAL,
                     "no randomness");
        return;
    }
    fi_keys_token_hash(tok, hash);
    if (fi_store_token_add(c->st, hash, tr->role, site, region, expires, err, sizeof err) != 0) {
        sodium_memzero(tok, sizeof tok);
        fi_coord_log("token: %s", err);
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_INTERNAL, err);
        return;
    }
    fi_coord_log("operator %s created an enrolment token for %s %s/%s, expires in %u s", op->rec.fpr,
          fi_wire_role_name(tr->role), site[0] ? site : "-", region[0] ? region : "-", tr->ttl_s);
    Fi__TokenReply r = FI__TOKEN_REPLY__INIT;
    r.token = tok;
    r.expires_unix = (uint64_t)expires;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_TOKEN_REPLY;
    m.token_reply = &r;
    (void)s_send_secret(c, c->router, op->rid, op->rid_len, &m);
    sodium_memzero(tok, sizeof tok);
}

/* What a revoke would leave: whether fpr is enrolled (and revoked), and
 * how many operators not revoked there are besides it. */
typedef struct s_revoke_scan {
    const char *fpr;
    int found, revoked, is_operator, other_operators;
} s_revoke_scan;

static int s_revoke_row(void *user, const fi_peer_rec *rec) {
    s_revoke_scan *s = user;
    int me = !strcmp(rec->fpr, s->fpr);
    if (me) {
        s->found = 1;
        s->revoked = rec->revoked != 0;
        s->is_operator = rec->role == FI__ROLE__ROLE_OPERATOR;
    } else if (rec->role == FI__ROLE__ROLE_OPERATOR && !rec->revoked) {
        s->other_operators++;
    }
    return 0;
}

static void s_on_revoke(fi_coord *c, s_peer *op, const Fi__RevokeRequest *rr) {
    fi_peer_rec rec;
    const char *fpr = rr->fingerprint ? rr->fingerprint : "";
    s_revoke_scan sc = {fpr, 0, 0, 0, 0};
    if (strlen(fpr) == FI_KEYS_FPR_LEN - 1 && fi_store_peer_each(c->st, s_revoke_row, &sc) != 0) {
        /* without the scan the last-operator rule cannot be applied: no */
        char why[256];
        snprintf(why, sizeof why, "the fleet database: %s", fi_store_last_error(c->st));
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_INTERNAL, why);
        return;
    }
    if (strlen(fpr) == FI_KEYS_FPR_LEN - 1) {
        /* the last operator would leave nobody to manage the fleet (only
         * --init on the database's host could add one again) */
        const char *why = sc.revoked ? "that key is revoked already"
                          : sc.is_operator && !sc.other_operators
                              ? "that key is the last operator's; enrol another operator first"
                              : NULL;
        if (why) {
            s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_BAD_REQUEST,
                         why);
            return;
        }
    }
    int rc = strlen(fpr) == FI_KEYS_FPR_LEN - 1 ? fi_store_peer_revoke(c->st, fpr, &rec) : 0;
    if (rc <= 0) {
        char why[256];
        snprintf(why, sizeof why, "%s%s",
                 rc < 0 ? "the fleet database: " : "no enrolled peer has that fingerprint",
                 rc < 0 ? fi_store_last_error(c->st) : "");
        s_send_error(c, c->router, op->rid, op->rid_len, "",
                     rc < 0 ? FI__ERROR_CODE__ERR_INTERNAL : FI__ERROR_CODE__ERR_NOT_FOUND, why);
        return;
    }
    fi_coord_log("operator %s revoked %s (%s %s)", op->rec.fpr, rec.fpr, fi_wire_role_name(rec.role),
          rec.site[0] ? rec.site : "-");
    uint64_t op_serial = op->serial;
    for (size_t i = 0; i < c->n_peers;) {
        s_peer *p = &c->peers[i];
        if (memcmp(p->rec.pub, rec.pub, FI_KEYS_BYTES)) {
            i++;
            continue;
        }
        s_send_error(c, c->router, p->rid, p->rid_len, "", FI__ERROR_CODE__ERR_REVOKED,
                     "this key was revoked");
        s_cut_off(p);
        s_peer_remove(c, p, "revoked", 0);
    }
    op = s_peer_by_serial(c, op_serial);
    if (!op) return; /* the operator revoked itself */
    size_t len = 0;
    (void)s_send(c, c->router, op->rid, op->rid_len, fi_wire_ack(rec.fpr, &len), &len);
}

static void s_on_bundle(fi_coord *c, s_peer *op, const Fi__PolicyBundle *b) {
    /* Checked before it is kept: the coordinator's own re-check and every
     * late edge take the newest bundle of the store, so an unsigned or
     * stale one with a high version would deny every routed request and
     * hide later applies. */
    char why[512];
    if (!b->version || b->version >= (uint64_t)INT64_MAX) {
        snprintf(why, sizeof why, "pushed bundle refused: version %llu is outside 1..%lld",
                 (unsigned long long)b->version, (long long)INT64_MAX - 1);
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_BAD_REQUEST, why);
        return;
    }
    if (fi_coord_policy_bundle_ok(&c->o, b->version, b->bundle.data, b->bundle.len, why,
                                  sizeof why) != 0) {
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_BAD_REQUEST, why);
        return;
    }
    /* its version taken, so that later applies number above it (else
     * the edges that hold it would refuse them as older) */
    if (fi_ship_reserve(c->ship, b->version, why, sizeof why) != 0) {
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_INTERNAL, why);
        return;
    }
    if (fi_store_bundle_put(c->st, b->version, b->bundle.data, b->bundle.len, op->rec.fpr) != 0) {
        s_send_error(c, c->router, op->rid, op->rid_len, "", FI__ERROR_CODE__ERR_INTERNAL,
                     "cannot store the bundle");
        return;
    }
    /* Opaque to the fabric: policy/ signs it and every edge checks it. */
    Fi__PolicyBundle fwd = *b;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_POLICY_BUNDLE;
    m.policy_bundle = &fwd;
    int sent = 0;
    for (size_t i = 0; i < c->n_peers; i++)
        if (c->peers[i].rec.role == FI__ROLE__ROLE_EDGE)
            sent += s_send_msg(c, c->router, c->peers[i].rid, c->peers[i].rid_len, &m) == 0;
    fi_coord_log("policy bundle version %llu (%zu bytes) from %s stored, pushed to %d edge(s)",
          (unsigned long long)b->version, b->bundle.len, op->rec.fpr, sent);
    char ref[32];
    snprintf(ref, sizeof ref, "bundle %llu", (unsigned long long)b->version);
    size_t len = 0;
    (void)s_send(c, c->router, op->rid, op->rid_len, fi_wire_ack(ref, &len), &len);
}

/* Sends an encoded message to every connected edge (fi_ship_push_fn). */
static int s_push_edges(void *user, const uint8_t *buf, size_t len) {
    fi_coord *c = user;
    int sent = 0;
    for (size_t i = 0; i < c->n_peers; i++) {
        s_peer *p = &c->peers[i];
        if (p->rec.role != FI__ROLE__ROLE_EDGE || !p->hello) continue;
        if (zmq_send(c->router, p->rid, p->rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
            zmq_send(c->router, buf, len, ZMQ_DONTWAIT) >= 0)
            sent++;
    }
    return sent;
}

/* fedctl audit verify: on the verify thread (fi_coord_verify.h), answered
 * by s_verify_done; one at a time. */
static void s_on_verify(fi_coord *c, s_peer *p) {
    int r = fi_coord_verify_start(c->verify, p->serial);
    if (r == 0) return;
    s_send_error(c, c->router, p->rid, p->rid_len, "",
                 r > 0 ? FI__ERROR_CODE__ERR_BUSY : FI__ERROR_CODE__ERR_INTERNAL,
                 r > 0 ? "an audit verify is running: ask again when it is done"
                       : "cannot start the audit verify (no thread)");
}

/* The finished verify's answer to whoever asked, if still connected. */
static void s_verify_done(fi_coord *c) {
    uint64_t serial;
    uint8_t *buf;
    size_t len = 0;
    if (!fi_coord_verify_done(c->verify, &serial, &buf, &len)) return;
    s_peer *p = s_peer_by_serial(c, serial);
    if (p) (void)s_send(c, c->router, p->rid, p->rid_len, buf, &len);
    else free(buf);
}

/* Policy and audit requests, and audit uploads (fi_coord_ship.c). */
static void s_on_ship(fi_coord *c, s_peer *p, const fi_msg *m) {
    uint64_t serial = p->serial;
    fi_peer_rec from = p->rec;
    size_t len = 0;
    uint8_t *buf = fi_ship_handle(c->ship, &from, m, s_push_edges, c, &len);
    p = s_peer_by_serial(c, serial);
    if (p) (void)s_send(c, c->router, p->rid, p->rid_len, buf, &len);
    else free(buf);
}

/* An edge that says Hello gets the active policy bundle when it holds an
 * older one. */
/* Sends edge p the newest policy bundle above the version it holds: the
 * newest of the versions stored and signed here (fi_ship) and of the
 * bundles operators pushed signed (PolicyBundle), as the policy re-check
 * chooses; so an edge that was away when one was pushed gets it too. */
static void s_push_active(fi_coord *c, s_peer *p, uint64_t held) {
    uint64_t pv = 0;
    void *blob = NULL;
    size_t blen = 0, len = 0;
    int pushed = fi_store_bundle_newest(c->st, &pv, &blob, &blen) == 1 && pv > held;
    uint8_t *buf = fi_ship_active_bundle(c->ship, pushed ? pv : held, &len);
    if (buf) {
        (void)s_send(c, c->router, p->rid, p->rid_len, buf, &len);
    } else if (pushed) {
        Fi__PolicyBundle b = FI__POLICY_BUNDLE__INIT;
        b.version = pv;
        b.bundle.data = blob;
        b.bundle.len = blen;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_POLICY_BUNDLE;
        m.policy_bundle = &b;
        (void)s_send_msg(c, c->router, p->rid, p->rid_len, &m);
    }
    free(blob);
}

typedef struct s_site_scan {
    const char *site; /* wanted */
    int found;        /* an edge of it is enrolled */
} s_site_scan;

static int s_site_row(void *user, const fi_peer_rec *rec) {
    s_site_scan *sc = user;
    if (rec->role == FI__ROLE__ROLE_EDGE && !rec->revoked && !strcmp(rec->site, sc->site)) {
        sc->found = 1;
        return 1;
    }
    return 0;
}

static int s_site_has_edge(void *user, const char *site) {
    fi_coord *c = user;
    s_site_scan sc = {site, 0};
    (void)fi_store_peer_each(c->st, s_site_row, &sc);
    return sc.found;
}

static int s_push_site(void *user, const char *site, const uint8_t *buf, size_t len) {
    fi_coord *c = user;
    int sent = 0;
    for (size_t i = 0; i < c->n_peers; i++) {
        s_peer *p = &c->peers[i];
        if (p->rec.role != FI__ROLE__ROLE_EDGE || !p->hello || strcmp(p->rec.site, site)) continue;
        if (zmq_send(c->router, p->rid, p->rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
            zmq_send(c->router, buf, len, ZMQ_DONTWAIT) >= 0)
            sent++;
    }
    return sent;
}

static void s_on_apptok(fi_coord *c, s_peer *op, const Fi__AppTokenRequest *rq) {
    uint64_t serial = op->serial;
    char author[FI_KEYS_FPR_LEN];
    snprintf(author, sizeof author, "%s", op->rec.fpr);
    fi_apptok_fleet fl = {s_site_has_edge, s_push_site, c};
    size_t len = 0;
    uint8_t *buf = fi_apptok_handle(c->apptok, author, rq, &fl, &len);
    fi_coord_log("operator %s: application token %s%s%s", author, rq->op ? rq->op : "?",
          rq->site && rq->site[0] ? " for " : "", rq->site ? rq->site : "");
    op = s_peer_by_serial(c, serial);
    if (op) (void)s_send(c, c->router, op->rid, op->rid_len, buf, &len);
    else free(buf);
}

/* A worker's reported load and prefix filter. A report with a count
 * beyond S_MAX_REPORTED, more free KV blocks than blocks, or a filter
 * that is not a power of two of 64..65536 bytes is dropped with a log line
 * naming the field, and so is what the worker said before: it then claims
 * no cached prefix and reports no load (its old filter and counts go),
 * so a bad report never keeps an old cache score or an old load alive;
 * its load is what the coordinator counts itself (in_flight), as for a
 * worker that never reported, until a good report comes. */
#define S_MAX_REPORTED (1u << 30)
static void s_take_load(s_peer *w, const Fi__WorkerLoad *l) {
    size_t n = l->prefix_filter.len;
    const char *bad = l->running > S_MAX_REPORTED               ? "running"
                      : l->queued > S_MAX_REPORTED              ? "queued"
                      : l->kv_blocks_total > S_MAX_REPORTED     ? "kv_blocks_total"
                      : l->kv_blocks_free > l->kv_blocks_total  ? "kv_blocks_free (above kv_blocks_total)"
                      : n && (n < 64 || n > 65536 || (n & (n - 1))) ? "prefix_filter (not a power of two of 64..65536 bytes)"
                                                                : NULL;
    if (bad) {
        fi_coord_log("peer %s: load report dropped: bad %s", w->rec.fpr, bad);
        n = 0;
        w->running = w->queued = w->kv_free = w->kv_total = 0;
    } else {
        w->running = l->running;
        w->queued = l->queued;
        w->kv_free = l->kv_blocks_free;
        w->kv_total = l->kv_blocks_total;
    }
    if (n && n != w->filter_len) {
        uint8_t *f = realloc(w->filter, n);
        if (!f) {
            fi_coord_log("peer %s: prefix filter dropped: out of memory", w->rec.fpr);
            n = 0;
        } else {
            w->filter = f;
            w->filter_len = n;
        }
    }
    if (n == 0) {
        free(w->filter);
        w->filter = NULL;
        w->filter_len = 0;
        w->filter_ones = 0;
        return;
    }
    memcpy(w->filter, l->prefix_filter.data, n);
    w->filter_ones = fi_route_filter_ones(w->filter, n);
}

/* a + b, at most UINT32_MAX (the rows' sums of reported counts) */
static uint32_t s_sat_add(uint32_t a, uint32_t b) {
    return a > UINT32_MAX - b ? UINT32_MAX : a + b;
}

static uint32_t s_min_u32(uint32_t a, uint32_t b) { return a < b ? a : b; }

/* The most bytes one ClusterLoad row takes in a Heartbeat: two names of
 * at most 63 bytes (FI_STORE_NAME_MAX, S_MODEL_NAME; tag and length 1
 * byte each), six uint32 (tag 1, varint at most 5), and the row's own tag
 * and length (3). The rows the coordinator can send at most must fit the
 * wire's message limit with room for the rest of the Heartbeat. */
#define S_LOAD_ROW_MAX (2 * (2 + 63) + 6 * (1 + 5) + 3)
#define S_BEAT_SLACK 64 /* envelope, sent_ms, clusters_truncated */
_Static_assert((uint64_t)FI_WIRE_MAX_LOAD_ROWS * S_LOAD_ROW_MAX + S_BEAT_SLACK <= FI_WIRE_MAX_MSG,
               "FI_WIRE_MAX_LOAD_ROWS rows of the longest names must fit one message");

/* One (cluster, model) that a live worker serves, before merging. */
typedef struct s_pair {
    const char *cluster;     /* the worker's site */
    const s_model *model;    /* the model and the worker's capacity for it */
    const s_peer *w;         /* the worker */
} s_pair;

static int s_pair_cmp(const void *a, const void *b) {
    const s_pair *x = a, *y = b;
    int d = strcmp(x->cluster, y->cluster);
    return d ? d : strcmp(x->model->name, y->model->name);
}

/* The load of each (cluster, model) for the edges' routers, encoded as a
 * heartbeat (with no rows when no worker is live), in the order of
 * cluster then model names. At most FI_WIRE_MAX_LOAD_ROWS rows, and only
 * as many as keep the message within max_msg; the rest are left out and
 * the heartbeat says so (clusters_truncated), as it does when out of
 * memory: an edge then reads a pair it is not told about as unknown, not
 * as one without a live worker. NULL when out of memory even for that.
 *
 * A worker serving several models is counted in the row of each: its
 * models share its slots and its KV pool, and the coordinator admits a
 * request for model k to a worker while the worker's open requests, of
 * every model, are under its capacity for k (s_on_infer). So a row takes
 * each worker's open and queued requests, each at most the worker's
 * capacity for the row's model: the row's capacity minus its in_flight is
 * then the room the coordinator would admit into, and a worker busy with
 * another model does not hide the free slots of the others (unclamped,
 * its count could exceed its share of the row's capacity and make the
 * row look full). The KV blocks are the worker's pool, in each row alike. */
static uint8_t *s_cluster_loads(fi_coord *c, uint64_t now, int with_head, size_t *len) {
    size_t n_pairs = 0;
    for (size_t i = 0; i < c->n_peers; i++) {
        const s_peer *w = &c->peers[i];
        if (w->rec.role == FI__ROLE__ROLE_CLUSTER && w->hello) n_pairs += (size_t)w->n_models;
    }
    s_pair *pairs = n_pairs ? malloc(n_pairs * sizeof *pairs) : NULL;
    size_t rows_cap = n_pairs < FI_WIRE_MAX_LOAD_ROWS ? n_pairs : FI_WIRE_MAX_LOAD_ROWS;
    Fi__ClusterLoad *rows = rows_cap ? malloc(rows_cap * sizeof *rows) : NULL;
    Fi__ClusterLoad **ptrs = rows_cap ? malloc(rows_cap * sizeof *ptrs) : NULL;
    const char *why = n_pairs && (!pairs || !rows || !ptrs) ? "out of memory" : NULL;
    int truncated = why != NULL;
    size_t n = 0;
    if (!truncated && n_pairs) {
        size_t k = 0;
        for (size_t i = 0; i < c->n_peers; i++) {
            const s_peer *w = &c->peers[i];
            if (w->rec.role != FI__ROLE__ROLE_CLUSTER || !w->hello) continue;
            for (int m = 0; m < w->n_models; m++) pairs[k++] = (s_pair){w->rec.site, &w->models[m], w};
        }
        qsort(pairs, n_pairs, sizeof *pairs, s_pair_cmp);
        size_t max_msg = c->o.max_msg > 0 && (size_t)c->o.max_msg < FI_WIRE_MAX_MSG
                             ? (size_t)c->o.max_msg
                             : FI_WIRE_MAX_MSG;
        size_t bytes = S_BEAT_SLACK;
        for (size_t i = 0; i < n_pairs;) {
            size_t j = i; /* pairs[i..j) make one row */
            while (j < n_pairs && !s_pair_cmp(&pairs[i], &pairs[j])) j++;
            if (n == FI_WIRE_MAX_LOAD_ROWS) {
                why = "FI_WIRE_MAX_LOAD_ROWS";
                truncated = 1;
                break;
            }
            Fi__ClusterLoad *r = &rows[n];
            fi__cluster_load__init(r);
            r->cluster = (char *)pairs[i].cluster;
            r->model = (char *)pairs[i].model->name;
            for (; i < j; i++) {
                const s_peer *w = pairs[i].w;
                uint32_t cap = pairs[i].model->capacity;
                r->workers++;
                r->capacity = s_sat_add(r->capacity, cap);
                r->in_flight = s_sat_add(r->in_flight, s_min_u32(w->in_flight, cap));
                r->queued = s_sat_add(r->queued, s_min_u32(w->queued, cap));
                r->kv_blocks_free = s_sat_add(r->kv_blocks_free, w->kv_free);
                r->kv_blocks_total = s_sat_add(r->kv_blocks_total, w->kv_total);
            }
            size_t rl = fi__cluster_load__get_packed_size(r) + 4; /* and its tag and length */
            if (bytes + rl > max_msg) {
                why = "max_msg";
                truncated = 1;
                break;
            }
            bytes += rl;
            ptrs[n++] = r;
        }
    }
    Fi__Heartbeat h = FI__HEARTBEAT__INIT;
    h.sent_ms = now;
    /* our audit log's last record, for the edges to witness (not for
     * those whose witness our log no longer holds: with_head 0) */
    Fi__AuditHead ah = FI__AUDIT_HEAD__INIT;
    int64_t head_seq = 0;
    char head[65], herr[300];
    if (with_head) {
        int failing = fi_audit_head(fi_ship_audit(c->ship), &head_seq, head, herr, sizeof herr) != 0;
        if (failing && !c->head_failing) fi_coord_log("audit: heartbeats go without the log's head: %s", herr);
        c->head_failing = failing;
        if (!failing && head_seq > 0) {
            ah.seq = (uint64_t)head_seq;
            ah.hash = head;
            h.audit_head = &ah;
        }
    }
    h.n_clusters = n;
    h.clusters = ptrs;
    h.clusters_truncated = truncated;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_HEARTBEAT;
    m.heartbeat = &h;
    uint8_t *beat = fi_wire_encode(&m, len);
    if (!beat && n) { /* out of memory: a heartbeat that says nothing of the clusters */
        h.n_clusters = n = 0;
        h.clusters_truncated = truncated = 1;
        why = "out of memory";
        beat = fi_wire_encode(&m, len);
    }
    if (truncated && !c->loads_truncated)
        fi_coord_log("heartbeats to edges carry %zu (cluster, model) rows, not all (%s): edges read "
              "the others as unknown", n, why);
    else if (!truncated && c->loads_truncated)
        fi_coord_log("heartbeats to edges carry every (cluster, model) row again (%zu)", n);
    c->loads_truncated = truncated;
    free(pairs);
    free(rows);
    free(ptrs);
    return beat;
}

/* Which message types each role may send on the fabric endpoint. */
static int s_allowed(Fi__Role role, fi_msg_type t) {
    switch (t) {
    case FI__ENVELOPE__BODY_HELLO:
    case FI__ENVELOPE__BODY_HEARTBEAT: return 1;
    case FI__ENVELOPE__BODY_INFER:
    case FI__ENVELOPE__BODY_CANCEL: return role == FI__ROLE__ROLE_EDGE;
    case FI__ENVELOPE__BODY_CHUNK:
    case FI__ENVELOPE__BODY_FINAL:
    case FI__ENVELOPE__BODY_ERROR: return role == FI__ROLE__ROLE_CLUSTER;
    case FI__ENVELOPE__BODY_AUDIT_UPLOAD: return role == FI__ROLE__ROLE_EDGE; /* records of its own site */
    case FI__ENVELOPE__BODY_POLICY_APPLY:
    case FI__ENVELOPE__BODY_POLICY_ROLLBACK:
    case FI__ENVELOPE__BODY_POLICY_HISTORY_REQUEST:
    case FI__ENVELOPE__BODY_POLICY_GET:
    case FI__ENVELOPE__BODY_AUDIT_QUERY:
    case FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST:
    case FI__ENVELOPE__BODY_POLICY_BUNDLE:
    case FI__ENVELOPE__BODY_STATUS_REQUEST:
    case FI__ENVELOPE__BODY_TOKEN_REQUEST:
    case FI__ENVELOPE__BODY_REVOKE_REQUEST:
    case FI__ENVELOPE__BODY_APP_TOKEN_REQUEST: return role == FI__ROLE__ROLE_OPERATOR;
    default: return 0;
    }
}

static void s_dispatch(fi_coord *c, s_peer *p, fi_msg *m) {
    if (!s_allowed(p->rec.role, m->body_case)) {
        char msg[128];
        snprintf(msg, sizeof msg, "a %s may not send %s", fi_wire_role_name(p->rec.role),
                 fi_wire_type_name(m->body_case));
        fi_coord_log("peer %s: %s", p->rec.fpr, msg);
        s_send_error(c, c->router, p->rid, p->rid_len, "",
                     m->body_case == FI__ENVELOPE__BODY_ENROL ? FI__ERROR_CODE__ERR_UNKNOWN_TYPE
                                                              : FI__ERROR_CODE__ERR_UNAUTHORISED,
                     msg);
        return;
    }
    if (p->rec.role == FI__ROLE__ROLE_CLUSTER && !p->hello &&
        m->body_case != FI__ENVELOPE__BODY_HELLO) {
        /* A worker we do not know yet, typically after our restart. */
        s_send_error(c, c->router, p->rid, p->rid_len, "", FI__ERROR_CODE__ERR_NOT_REGISTERED,
                     "send hello first");
        return;
    }
    switch (m->body_case) {
    case FI__ENVELOPE__BODY_HELLO:
        if (p->rec.role == FI__ROLE__ROLE_EDGE) {
            uint64_t serial = p->serial;
            s_on_hello(c, p, m->hello);
            if ((p = s_peer_by_serial(c, serial))) s_take_witness(c, p, m->hello->audit_head);
            if ((p = s_peer_by_serial(c, serial))) s_push_active(c, p, m->hello->policy_version);
            if ((p = s_peer_by_serial(c, serial))) {
                /* The site's application tokens, all of them, in pages, so an
                 * edge that was offline catches up (revocations included). */
                long long at = 0, from = 0;
                size_t len = 0;
                uint8_t *buf;
                while ((buf = fi_apptok_sync_site(c->apptok, p->rec.site, &at, &len))) {
                    if (s_send(c, c->router, p->rid, p->rid_len, buf, &len) != 0) {
                        /* the rest at its next Hello (a reconnect) */
                        fi_coord_log("edge %s: application tokens from the %lld-th on not sent (its "
                              "queue is full)", p->rec.fpr, from + 1);
                        break;
                    }
                    from = at;
                }
            }
        } else {
            s_on_hello(c, p, m->hello);
        }
        break;
    case FI__ENVELOPE__BODY_HEARTBEAT:
        if (p->rec.role == FI__ROLE__ROLE_CLUSTER && m->heartbeat->load)
            s_take_load(p, m->heartbeat->load);
        /* the policy an edge holds now (fedctl status), after a push or reload */
        if (p->rec.role == FI__ROLE__ROLE_EDGE && m->heartbeat->policy_version)
            p->policy_version = m->heartbeat->policy_version;
        s_take_witness(c, p, m->heartbeat->audit_head);
        break;
    case FI__ENVELOPE__BODY_INFER: s_on_infer(c, p, m->infer); break;
    case FI__ENVELOPE__BODY_CANCEL: s_on_cancel(c, p, m->cancel); break;
    case FI__ENVELOPE__BODY_CHUNK:
    case FI__ENVELOPE__BODY_FINAL:
    case FI__ENVELOPE__BODY_ERROR: s_on_worker_reply(c, p, m); break;
    case FI__ENVELOPE__BODY_AUDIT_UPLOAD:
    case FI__ENVELOPE__BODY_POLICY_APPLY:
    case FI__ENVELOPE__BODY_POLICY_ROLLBACK:
    case FI__ENVELOPE__BODY_POLICY_HISTORY_REQUEST:
    case FI__ENVELOPE__BODY_POLICY_GET:
    case FI__ENVELOPE__BODY_AUDIT_QUERY: s_on_ship(c, p, m); break;
    case FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST:
        /* verify checks every witness the edges say now, also one whose
         * row was removed meanwhile */
        for (size_t i = 0; i < c->n_peers; i++)
            if (c->peers[i].rec.role == FI__ROLE__ROLE_EDGE && c->peers[i].wit_seq > 0) c->peers[i].wit_dirty = 1;
        s_keep_witnesses(c, NULL);
        s_on_verify(c, p);
        break;
    case FI__ENVELOPE__BODY_POLICY_BUNDLE: s_on_bundle(c, p, m->policy_bundle); break;
    case FI__ENVELOPE__BODY_STATUS_REQUEST: s_on_status(c, p); break;
    case FI__ENVELOPE__BODY_TOKEN_REQUEST: s_on_token(c, p, m->token_request); break;
    case FI__ENVELOPE__BODY_REVOKE_REQUEST: s_on_revoke(c, p, m->revoke_request); break;
    case FI__ENVELOPE__BODY_APP_TOKEN_REQUEST: s_on_apptok(c, p, m->app_token_request); break;
    default: break;
    }
}

static void s_on_enrol(fi_coord *c, const void *rid, size_t rid_len, const char *uid,
                       const char *addr, fi_msg *m) {
    uint8_t pub[FI_KEYS_BYTES];
    if (!uid || fi_keys_from_z85(uid, pub) != 0) return;
    char fpr[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(pub, fpr);
    if (m->body_case != FI__ENVELOPE__BODY_ENROL) {
        s_send_error(c, c->enrol, rid, rid_len, "", FI__ERROR_CODE__ERR_UNKNOWN_TYPE,
                     "only enrol is served on this endpoint");
        return;
    }
    const Fi__Enrol *en = m->enrol;
    const char *site = en->site ? en->site : "", *region = en->region ? en->region : "";
    char hash[65], err[256];
    fi_keys_token_hash(en->token ? en->token : "", hash);
    if (fi_store_enrol(c->st, hash, en->role, site, region, pub, (int64_t)time(NULL), err,
                       sizeof err) != 0) {
        fi_coord_log("enrolment of %s (%s %s/%s) from %s refused: %s", fpr, fi_wire_role_name(en->role),
              site, region, addr, err);
        s_send_error(c, c->enrol, rid, rid_len, "", FI__ERROR_CODE__ERR_BAD_TOKEN, err);
        return;
    }
    fi_coord_log("enrolled %s as %s %s/%s from %s", fpr, fi_wire_role_name(en->role), site, region, addr);
    Fi__EnrolReply r = FI__ENROL_REPLY__INIT;
    r.fingerprint = fpr;
    r.role = en->role;
    r.site = (char *)site;
    r.region = (char *)region;
    fi_msg out = FI__ENVELOPE__INIT;
    out.body_case = FI__ENVELOPE__BODY_ENROL_REPLY;
    out.enrol_reply = &r;
    (void)s_send_msg(c, c->enrol, rid, rid_len, &out);
}

/* Reads and handles up to a batch of messages from one ROUTER socket, for
 * at most S_DRAIN_MS (the loop then polls both sockets again, so that one
 * peer's flood cannot hold up the other socket's messages or the
 * heartbeats). Returns -1 on a fatal socket error. */
static int s_drain(fi_coord *c, void *sock) {
    uint64_t t0 = fi_wire_now_ms();
    size_t max = sock == c->enrol ? FI_WIRE_MAX_ENROL : (size_t)c->o.max_msg;
    for (int n = 0; n < 256 && fi_wire_now_ms() - t0 < S_DRAIN_MS; n++) {
        zmq_msg_t id, body;
        zmq_msg_init(&id);
        if (zmq_msg_recv(&id, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&id);
            return zmq_errno() == EAGAIN || zmq_errno() == EINTR ? 0 : -1;
        }
        zmq_msg_init(&body);
        int have_body = zmq_msg_more(&id) && zmq_msg_recv(&body, sock, 0) >= 0;
        int extra = 0;
        while (have_body && zmq_msg_more(&body)) { /* a peer that sends several frames */
            zmq_msg_t x;
            zmq_msg_init(&x);
            if (zmq_msg_recv(&x, sock, 0) < 0) {
                zmq_msg_close(&x);
                break;
            }
            extra = 1;
            int more = zmq_msg_more(&x);
            zmq_msg_close(&x);
            if (!more) break;
        }
        if (!have_body) {
            zmq_msg_close(&id);
            zmq_msg_close(&body);
            continue;
        }
        const char *uid = zmq_msg_gets(&body, "User-Id");
        const char *addr = zmq_msg_gets(&body, "Peer-Address");
        int fd = zmq_msg_get(&body, ZMQ_SRCFD);
        const void *rid = zmq_msg_data(&id);
        size_t rid_len = zmq_msg_size(&id);
        if (!addr) addr = "?";
        s_peer *p = NULL;
        if (sock == c->router) {
            p = s_peer_for(c, rid, rid_len, uid, fd, addr);
            if (!p) {
                zmq_msg_close(&id);
                zmq_msg_close(&body);
                continue;
            }
        }
        Fi__ErrorCode code = FI__ERROR_CODE__ERR_UNSPECIFIED;
        char err[160];
        fi_msg *m = extra ? NULL
                          : fi_wire_decode(zmq_msg_data(&body), zmq_msg_size(&body), max, &code, err,
                                           sizeof err);
        if (extra) {
            code = FI__ERROR_CODE__ERR_MALFORMED;
            snprintf(err, sizeof err, "a message is one frame; got several");
        }
        if (!m) {
            char fpr[FI_KEYS_FPR_LEN] = "?";
            uint8_t pub[FI_KEYS_BYTES];
            if (uid && fi_keys_from_z85(uid, pub) == 0) fi_keys_fingerprint(pub, fpr);
            fi_coord_log("bad message from %s (%s): %s", fpr, addr, err);
            s_send_error(c, sock, rid, rid_len, "", code, err);
        } else if (sock == c->router) {
            s_dispatch(c, p, m);
        } else {
            s_on_enrol(c, rid, rid_len, uid, addr, m);
        }
        /* an enrolment's frame holds its token, even one that did not decode */
        if (sock != c->router || fi_wire_has_secret(m)) sodium_memzero(zmq_msg_data(&body), zmq_msg_size(&body));
        fi_wire_free(&m);
        zmq_msg_close(&id);
        zmq_msg_close(&body);
    }
    return 0;
}

/* Counts handshakes that failed before ZAP (garbage, timeouts, another
 * mechanism); they are logged as one line per heartbeat interval, so that
 * a flood of junk connections cannot flood the log. */
static void s_monitor(fi_coord *c, void *mon) {
    for (;;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        int more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        while (more) {
            zmq_msg_init(&ev);
            more = zmq_msg_recv(&ev, mon, 0) >= 0 && zmq_msg_more(&ev);
            zmq_msg_close(&ev);
        }
        c->failed_handshakes++;
        c->failed_total++;
    }
}

/* Every edge's heartbeat: the load of each (cluster, model) with a live
 * worker (s_cluster_loads: all of them, none listed: none live, unless it
 * says it left some out), which the edges' routers go by. */
static void s_tell_edges(fi_coord *c) {
    uint64_t now = fi_wire_now_ms();
    size_t len = 0;
    uint8_t *beat = s_cluster_loads(c, now, 1, &len), *headless = NULL;
    size_t hlen = 0;
    if (!beat) return; /* out of memory: the edges' view goes stale, then unknown */
    for (size_t i = 0; i < c->n_peers; i++)
        if (c->peers[i].rec.role == FI__ROLE__ROLE_EDGE && c->peers[i].wit_failed && !headless)
            headless = s_cluster_loads(c, now, 0, &hlen);
    for (size_t i = 0; i < c->n_peers; i++) {
        const s_peer *p = &c->peers[i];
        if (p->rec.role != FI__ROLE__ROLE_EDGE) continue;
        const uint8_t *b = p->wit_failed ? headless : beat;
        size_t bl = p->wit_failed ? hlen : len;
        if (b && zmq_send(c->router, p->rid, p->rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0)
            (void)zmq_send(c->router, b, bl, ZMQ_DONTWAIT);
    }
    free(beat);
    free(headless);
}

static void s_tick(fi_coord *c) {
    uint64_t now = fi_wire_now_ms();
    if (c->failed_handshakes) {
        fi_coord_log("dropped %llu connection(s) that failed the handshake (not ZMTP, timed out or "
              "not CURVE); %llu since start",
              (unsigned long long)c->failed_handshakes, (unsigned long long)c->failed_total);
        c->failed_handshakes = 0;
    }
    uint64_t dead_after = (uint64_t)c->o.heartbeat_ms * (uint64_t)c->o.liveness;
    for (size_t i = 0; i < c->n_peers;) {
        s_peer *p = &c->peers[i];
        if (now - p->last_ms > dead_after) {
            char why[96];
            snprintf(why, sizeof why, "no message for %llu ms: peer is dead",
                     (unsigned long long)(now - p->last_ms));
            s_peer_remove(c, p, why, 0);
            continue;
        }
        size_t len = 0;
        if (p->rec.role != FI__ROLE__ROLE_EDGE)
            (void)s_send(c, c->router, p->rid, p->rid_len, fi_wire_heartbeat(now, &len), &len);
        i++;
    }
    s_recheck_witnesses(c);
    s_tell_edges(c);
    /* each keep is a synced write on the loop: every few seconds (a
     * failing witness is logged at once, and verify keeps them first) */
    if (now - c->wit_kept_ms >= S_WITNESS_KEEP_MS) {
        s_keep_witnesses(c, NULL);
        c->wit_kept_ms = now;
    }
    c->next_beat_ms = now + (uint64_t)c->o.heartbeat_ms;
}

fi_coord *fi_coord_new(const fi_coord_opts *o, const fi_keypair *kp, char *err, size_t errlen) {
    if (sodium_init() < 0) {
        snprintf(err, errlen, "libsodium cannot initialise");
        return NULL;
    }
    fi_coord *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->o = *o;
    fi_coord_policy_attach(&c->o); /* the residency re-check, fi_coord_policy.c */
    c->kp = *kp;
    /* The ids workers see start at a random point of 2^62, not at 1: a
     * worker may still hold a reply for a request of the coordinator's
     * last run and send it after reconnecting, and under an id counted
     * from 1 again it would reach the edge that now holds that id. */
    uint64_t r0;
    randombytes_buf(&r0, sizeof r0);
    c->next_req = r0 & ((UINT64_C(1) << 62) - 1);
    fi_sockopts so;
    fi_sockopts_default(&so);
    so.heartbeat_ms = o->heartbeat_ms;
    so.heartbeat_timeout_ms = o->heartbeat_ms * o->liveness;
    so.handshake_ms = o->handshake_ms;
    so.max_msg = o->max_msg;
    so.hwm = o->hwm;
    so.plaintext = o->plaintext;
    int one = 1;
    size_t n;
    if (!(c->st = fi_store_open(o->db, err, errlen))) goto fail;
    fi_store_busy_timeout(c->st, FI_SHIP_BUSY_MS); /* on the loop: fail soon, never stall */
    {
        char key[FI_CONF_STR_MAX + 16], audit[FI_CONF_STR_MAX + 16];
        fi_ship_paths(o->db, o->policy_key, o->audit_db, key, sizeof key, audit, sizeof audit);
        if (!(c->ship = fi_ship_open(c->st, o->db, audit, key, o->policy_valid_s, err, errlen))) goto fail;
        if (!(c->raudit = fi_coord_audit_new(audit, err, errlen))) goto fail;
        if (!(c->verify = fi_coord_verify_new(audit, err, errlen))) goto fail;
    }
    if (!(c->apptok = fi_apptok_open(o->db, err, errlen))) goto fail;
    fi_apptok_busy_timeout(c->apptok, FI_SHIP_BUSY_MS);
    if (!(c->ctx = zmq_ctx_new())) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    /* The ZAP handler first: with ZMQ_ZAP_ENFORCE_DOMAIN a server socket
     * without one refuses every client, so order matters for liveness, not
     * safety. */
    if (!(c->zap = fi_zap_bind(c->ctx, err, errlen))) goto fail;
    c->router = zmq_socket(c->ctx, ZMQ_ROUTER);
    c->enrol = zmq_socket(c->ctx, ZMQ_ROUTER);
    if (!c->router || !c->enrol) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    /* the enrolment endpoint admits any key: its messages are small, and
     * few may wait */
    fi_sockopts se = so;
    se.max_msg = (int)FI_WIRE_MAX_ENROL;
    se.hwm = S_ENROL_HWM;
    if (fi_sock_server(c->router, &c->kp, FI_ZAP_DOMAIN_FABRIC, &so, err, errlen) != 0 ||
        fi_sock_server(c->enrol, &c->kp, FI_ZAP_DOMAIN_ENROL, &se, err, errlen) != 0)
        goto fail;
    for (int i = 0; i < 2; i++) {
        const char *ep = i ? "inproc://fi-coord-monitor-enrol" : "inproc://fi-coord-monitor";
        if (zmq_socket_monitor(i ? c->enrol : c->router, ep,
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                   ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) != 0 ||
            !(c->mon[i] = zmq_socket(c->ctx, ZMQ_PAIR)) || zmq_connect(c->mon[i], ep) != 0) {
            snprintf(err, errlen, "socket monitor: %s", zmq_strerror(zmq_errno()));
            goto fail;
        }
    }
    zmq_setsockopt(c->router, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(c->enrol, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    if (zmq_bind(c->router, o->bind) != 0 || zmq_bind(c->enrol, o->enrol_bind) != 0) {
        snprintf(err, errlen, "cannot bind %s / %s: %s", o->bind, o->enrol_bind,
                 zmq_strerror(zmq_errno()));
        goto fail;
    }
    n = sizeof c->ep[0];
    zmq_getsockopt(c->router, ZMQ_LAST_ENDPOINT, c->ep[0], &n);
    n = sizeof c->ep[1];
    zmq_getsockopt(c->enrol, ZMQ_LAST_ENDPOINT, c->ep[1], &n);
    c->next_beat_ms = fi_wire_now_ms() + (uint64_t)o->heartbeat_ms;
    return c;
fail:
    fi_coord_destroy(&c);
    return NULL;
}

void fi_coord_destroy(fi_coord **cp) {
    if (!cp || !*cp) return;
    fi_coord *c = *cp;
    if (c->ship) s_keep_witnesses(c, NULL); /* what the edges said since the last tick */
    fi_sock_close_monitored(c->router);
    fi_sock_close_monitored(c->enrol);
    if (c->zap) zmq_close(c->zap);
    for (int i = 0; i < 2; i++)
        if (c->mon[i]) zmq_close(c->mon[i]);
    if (c->ctx) zmq_ctx_term(c->ctx);
    fi_store_destroy(&c->st);
    fi_coord_verify_destroy(&c->verify); /* a verify running stops */
    fi_coord_audit_destroy(&c->raudit); /* writes what is queued */
    if (c->o.policy_free) c->o.policy_free(c->o.policy_user);
    fi_ship_destroy(&c->ship);
    fi_apptok_destroy(&c->apptok);
    for (size_t i = 0; i < c->n_peers; i++) free(c->peers[i].filter);
    free(c->peers);
    free(c->reqs);
    fi_keys_wipe(&c->kp);
    free(c);
    *cp = NULL;
}

const char *fi_coord_endpoint(const fi_coord *c, int enrol) { return c->ep[enrol ? 1 : 0]; }

fi_store *fi_coord_store(fi_coord *c) { return c->st; }

fi_ship *fi_coord_ship(fi_coord *c) { return c->ship; }

void fi_coord_audit_wait(fi_coord *c) {
    if (c->raudit) fi_coord_audit_flush(c->raudit);
}

int fi_coord_run(fi_coord *c, atomic_int *stop) {
    fi_coord_log("serving on %s (enrolment on %s), heartbeat %d ms x %d", c->ep[0], c->ep[1],
          c->o.heartbeat_ms, c->o.liveness);
    while (!atomic_load(stop)) {
        zmq_pollitem_t items[5] = {{c->zap, 0, ZMQ_POLLIN, 0},
                                   {c->router, 0, ZMQ_POLLIN, 0},
                                   {c->enrol, 0, ZMQ_POLLIN, 0},
                                   {c->mon[0], 0, ZMQ_POLLIN, 0},
                                   {c->mon[1], 0, ZMQ_POLLIN, 0}};
        uint64_t now = fi_wire_now_ms();
        long timeout = c->next_beat_ms > now ? (long)(c->next_beat_ms - now) : 0;
        if (timeout > 100) timeout = 100; /* so that *stop is seen soon */
        if (zmq_poll(items, 5, timeout) < 0) {
            if (zmq_errno() == EINTR) continue;
            fi_coord_log("zmq_poll: %s", zmq_strerror(zmq_errno()));
            return -1;
        }
        if ((items[0].revents & ZMQ_POLLIN) && fi_zap_handle(c->zap, s_zap_check, c) < 0)
            fi_coord_log("ZAP handler: %s", zmq_strerror(zmq_errno()));
        if ((items[1].revents & ZMQ_POLLIN) && s_drain(c, c->router) < 0) return -1;
        if ((items[2].revents & ZMQ_POLLIN) && s_drain(c, c->enrol) < 0) return -1;
        if (items[3].revents & ZMQ_POLLIN) s_monitor(c, c->mon[0]);
        if (items[4].revents & ZMQ_POLLIN) s_monitor(c, c->mon[1]);
        if (fi_wire_now_ms() >= c->next_beat_ms) s_tick(c);
        s_verify_done(c);
    }
    return 0;
}
