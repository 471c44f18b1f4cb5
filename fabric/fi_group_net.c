/*
 * fi_group_net.c - the mesh of CURVE links between a group's ranks. See
 * fi_group_net.h.
 */
#include "fi_group_net.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "fi_transport.h"
#include "fi_wire.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the group wire format (headers, int32 and float arrays) is little-endian"
#endif

#define S_MAGIC 0x31474946u /* "FIG1" */
#define S_HDR 24             /* magic u32, kind u8, 3 zero bytes, pass u64, op u32, 0 u32 */
#define S_INBOX_MAX 65536    /* messages waiting, all senders together */
/* Messages and bytes waiting from one sender: a rank has a few messages
 * of a pass in flight at most, so one that floods is cut off without
 * shutting the others out. */
#define S_FROM_MAX_MSGS 1024
#define S_FROM_MAX_BYTES ((size_t)2 * FI_GNET_MAX_MSG)
#define S_DROP_LOG_MS 1000   /* at most one "dropped" line per sender this often */

struct fi_gnet {
    int rank, world;                        /* who we are, how many */
    fi_keypair kp;                          /* our keys (wiped on destroy) */
    uint8_t pub[FI_GROUP_MAX_RANKS][FI_KEYS_BYTES]; /* every rank's public key (ZAP) */
    void *ctx;                              /* own ZeroMQ context */
    void *router;                           /* where messages arrive */
    void *dealer[FI_GROUP_MAX_RANKS];       /* to each other rank */
    void *mon[FI_GROUP_MAX_RANKS];          /* monitor events of each dealer */
    int up[FI_GROUP_MAX_RANKS];             /* link state (dealer handshake done) */
    unsigned serial[FI_GROUP_MAX_RANKS];    /* times each link came up */
    int lost;                               /* first rank down since fi_gnet_mark, or -1 */
    fi_gmsg *head[FI_GROUP_MAX_RANKS];      /* inbox per sender, arrival order */
    fi_gmsg *tail[FI_GROUP_MAX_RANKS];
    int n_inbox;                            /* messages in all inboxes */
    int n_from[FI_GROUP_MAX_RANKS];         /* messages waiting from each sender */
    size_t bytes_from[FI_GROUP_MAX_RANKS];  /* their payload bytes */
    uint64_t dropped[FI_GROUP_MAX_RANKS];   /* messages refused from each sender */
    uint64_t drop_log_ms[FI_GROUP_MAX_RANKS]; /* when that was last logged */
    int (*keep)(void *user, int from, uint8_t kind, uint64_t pass); /* fi_gnet_set_filter */
    void *keep_user;
    void *zap;                              /* ZAP handler socket (actor's) */
    void *zap_pipe[2];                      /* [0] ours, [1] the actor's: stop signal */
    pthread_t zap_th;                       /* the ZAP actor */
    int zap_started;                        /* joined on destroy */
    uint64_t bytes_sent, msgs_sent;         /* traffic counters */
    void (*idle_fn)(void *);                /* fi_gnet_set_idle */
    void *idle_user;
    uint64_t idle_at_ms;                    /* when it last ran */
};

/* Unlinks the waiting message m (after prev, NULL: first) from r's inbox. */
static void s_unlink(fi_gnet *n, int r, fi_gmsg *prev, fi_gmsg *m) {
    if (prev) prev->next = m->next;
    else n->head[r] = m->next;
    if (n->tail[r] == m) n->tail[r] = prev;
    m->next = NULL;
    n->n_inbox--;
    n->n_from[r]--;
    n->bytes_from[r] -= m->len;
}

/* Counts a message refused from rank `from`, logged at most every
 * S_DROP_LOG_MS per sender (a flood must not flood the log too). */
static void s_dropped(fi_gnet *n, int from, const char *why, uint8_t kind, uint64_t pass) {
    n->dropped[from]++;
    uint64_t now = fi_wire_now_ms();
    if (n->drop_log_ms[from] && now - n->drop_log_ms[from] < S_DROP_LOG_MS) return;
    n->drop_log_ms[from] = now;
    fprintf(stderr, "group rank %d: dropped a message from rank %d (kind %u, pass %llu): %s "
                    "(%llu dropped from it so far)\n",
            n->rank, from, kind, (unsigned long long)pass, why,
            (unsigned long long)n->dropped[from]);
}

void fi_gmsg_free(fi_gmsg **mp) {
    if (!mp || !*mp) return;
    fi_gmsg *m = *mp;
    if (m->zmsg) {
        zmq_msg_close(m->zmsg);
        free(m->zmsg);
    }
    free(m);
    *mp = NULL;
}

/* --- ZAP actor: accepts the group's keys only ----------------------------- */

static int s_zap_fn(void *user, const char *domain, const uint8_t pub[FI_KEYS_BYTES],
                    const char *address, char *user_id, size_t uidlen, char *reason,
                    size_t reasonlen) {
    const fi_gnet *n = user;
    if (strcmp(domain, FI_GNET_ZAP_DOMAIN)) {
        snprintf(reason, reasonlen, "wrong ZAP domain");
        return 0;
    }
    for (int r = 0; r < n->world; r++)
        if (r != n->rank && !memcmp(pub, n->pub[r], FI_KEYS_BYTES)) {
            snprintf(user_id, uidlen, "rank:%d", r);
            return 1;
        }
    char fpr[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(pub, fpr);
    fprintf(stderr, "group rank %d: refused a connection from %s: key %s is not a rank of the "
                    "group file\n",
            n->rank, address, fpr);
    snprintf(reason, reasonlen, "not a rank of this group");
    return 0;
}

static void *s_zap_main(void *arg) {
    fi_gnet *n = arg;
    for (;;) {
        zmq_pollitem_t it[2] = {{n->zap, 0, ZMQ_POLLIN, 0}, {n->zap_pipe[1], 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(it, 2, -1) < 0) {
            if (zmq_errno() == EINTR) continue;
            break;
        }
        if (it[1].revents & ZMQ_POLLIN) break;
        if ((it[0].revents & ZMQ_POLLIN) && fi_zap_handle(n->zap, s_zap_fn, n) < 0) break;
    }
    return NULL;
}

/* --- set-up ---------------------------------------------------------------- */

fi_gnet *fi_gnet_new(const fi_group_conf *g, int rank, const fi_keypair *kp, char *err,
                     size_t errlen) {
    if (rank < 0 || rank >= g->world) {
        snprintf(err, errlen, "rank %d is not in the group (world %d)", rank, g->world);
        return NULL;
    }
    if (memcmp(kp->pub, g->pub[rank], FI_KEYS_BYTES)) {
        snprintf(err, errlen, "%s: key.%d is not the public half of this rank's secret key",
                 g->path, rank);
        return NULL;
    }
    fi_gnet *n = calloc(1, sizeof *n);
    if (!n) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    n->rank = rank;
    n->world = g->world;
    n->kp = *kp;
    memcpy(n->pub, g->pub, sizeof n->pub);
    n->up[rank] = 1;
    n->lost = -1;
    fi_sockopts so;
    fi_sockopts_default(&so);
    so.heartbeat_ms = g->heartbeat_ms;
    so.heartbeat_timeout_ms = g->timeout_ms;
    so.handshake_ms = g->timeout_ms > 2000 ? g->timeout_ms : 2000;
    so.max_msg = FI_GNET_MAX_MSG + 4096;
    so.reconnect_ms = 100;
    so.reconnect_max_ms = g->heartbeat_ms > 100 ? g->heartbeat_ms : 100;
    int one = 1;
    char ep[64];
    if (!(n->ctx = zmq_ctx_new())) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (!(n->zap = fi_zap_bind(n->ctx, err, errlen))) goto fail;
    if (!(n->zap_pipe[0] = zmq_socket(n->ctx, ZMQ_PAIR)) ||
        !(n->zap_pipe[1] = zmq_socket(n->ctx, ZMQ_PAIR)) ||
        zmq_bind(n->zap_pipe[0], "inproc://fi-gnet-zap-pipe") != 0 ||
        zmq_connect(n->zap_pipe[1], "inproc://fi-gnet-zap-pipe") != 0) {
        snprintf(err, errlen, "group: ZAP pipe: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (pthread_create(&n->zap_th, NULL, s_zap_main, n) != 0) {
        snprintf(err, errlen, "group: cannot start the ZAP thread");
        goto fail;
    }
    n->zap_started = 1;
    if (!(n->router = zmq_socket(n->ctx, ZMQ_ROUTER))) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (fi_sock_server(n->router, kp, FI_GNET_ZAP_DOMAIN, &so, err, errlen) != 0) goto fail;
    if (zmq_bind(n->router, g->endpoint[rank]) != 0) {
        snprintf(err, errlen, "group rank %d: cannot bind %s: %s", rank, g->endpoint[rank],
                 zmq_strerror(zmq_errno()));
        goto fail;
    }
    for (int r = 0; r < n->world; r++) {
        if (r == rank) continue;
        snprintf(ep, sizeof ep, "inproc://fi-gnet-mon-%d", r);
        if (!(n->dealer[r] = zmq_socket(n->ctx, ZMQ_DEALER))) {
            snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(zmq_errno()));
            goto fail;
        }
        if (fi_sock_client(n->dealer[r], kp, g->pub[r], &so, err, errlen) != 0) goto fail;
        if (zmq_setsockopt(n->dealer[r], ZMQ_IMMEDIATE, &one, sizeof one) != 0 ||
            zmq_socket_monitor(n->dealer[r], ep,
                               ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED) != 0 ||
            !(n->mon[r] = zmq_socket(n->ctx, ZMQ_PAIR)) || zmq_connect(n->mon[r], ep) != 0 ||
            zmq_connect(n->dealer[r], g->endpoint[r]) != 0) {
            snprintf(err, errlen, "group rank %d: link to rank %d (%s): %s", rank, r,
                     g->endpoint[r], zmq_strerror(zmq_errno()));
            goto fail;
        }
    }
    return n;
fail:
    fi_gnet_destroy(&n);
    return NULL;
}

void fi_gnet_destroy(fi_gnet **np) {
    if (!np || !*np) return;
    fi_gnet *n = *np;
    if (n->zap_started) {
        zmq_send(n->zap_pipe[0], "", 0, 0);
        pthread_join(n->zap_th, NULL);
    }
    for (int r = 0; r < FI_GROUP_MAX_RANKS; r++) {
        while (n->head[r]) {
            fi_gmsg *m = n->head[r];
            n->head[r] = m->next;
            fi_gmsg_free(&m);
        }
        fi_sock_close_monitored(n->dealer[r]);
        if (n->mon[r]) zmq_close(n->mon[r]);
    }
    if (n->router) zmq_close(n->router);
    if (n->zap) zmq_close(n->zap);
    for (int i = 0; i < 2; i++)
        if (n->zap_pipe[i]) zmq_close(n->zap_pipe[i]);
    if (n->ctx) zmq_ctx_term(n->ctx);
    fi_keys_wipe(&n->kp);
    free(n);
    *np = NULL;
}

int fi_gnet_rank(const fi_gnet *n) { return n->rank; }
int fi_gnet_world(const fi_gnet *n) { return n->world; }
int fi_gnet_up(const fi_gnet *n, int r) { return r >= 0 && r < n->world && n->up[r]; }
unsigned fi_gnet_link_serial(const fi_gnet *n, int r) {
    return r >= 0 && r < n->world ? n->serial[r] : 0;
}
int fi_gnet_first_down(const fi_gnet *n) {
    for (int r = 0; r < n->world; r++)
        if (!n->up[r]) return r;
    return -1;
}

void fi_gnet_set_idle(fi_gnet *n, void (*fn)(void *user), void *user) {
    n->idle_fn = fn;
    n->idle_user = user;
}

void fi_gnet_idle(fi_gnet *n) {
    if (!n->idle_fn) return;
    uint64_t now = fi_wire_now_ms();
    if (now - n->idle_at_ms < FI_GNET_IDLE_MS) return;
    n->idle_at_ms = now;
    n->idle_fn(n->idle_user);
}

void fi_gnet_counters(const fi_gnet *n, uint64_t *bytes_sent, uint64_t *msgs_sent) {
    if (bytes_sent) *bytes_sent = n->bytes_sent;
    if (msgs_sent) *msgs_sent = n->msgs_sent;
}

/* --- sending ---------------------------------------------------------------- */

int fi_gnet_send(fi_gnet *n, int to, uint8_t kind, uint64_t pass, uint32_t op, const void *data,
                 size_t len, char *err, size_t errlen) {
    if (to < 0 || to >= n->world || to == n->rank) {
        snprintf(err, errlen, "group rank %d: no rank %d to send to", n->rank, to);
        return -1;
    }
    if (len > FI_GNET_MAX_MSG) {
        snprintf(err, errlen, "group rank %d: a message of %zu bytes to rank %d is over the "
                              "limit of %d",
                 n->rank, len, to, FI_GNET_MAX_MSG);
        return -1;
    }
    if (!n->up[to]) {
        snprintf(err, errlen, "rank %d is not connected (its link is down)", to);
        return -1;
    }
    uint8_t h[S_HDR] = {0};
    uint32_t magic = S_MAGIC;
    memcpy(h, &magic, 4);
    h[4] = kind;
    memcpy(h + 8, &pass, 8);
    memcpy(h + 16, &op, 4);
    if (zmq_send(n->dealer[to], h, S_HDR, ZMQ_SNDMORE | ZMQ_DONTWAIT) != S_HDR ||
        zmq_send(n->dealer[to], data, len, ZMQ_DONTWAIT) < 0) {
        snprintf(err, errlen, "rank %d cannot be sent to: %s", to,
                 zmq_errno() == EAGAIN ? "its link is down or its queue is full"
                                       : zmq_strerror(zmq_errno()));
        return -1;
    }
    n->bytes_sent += S_HDR + len;
    n->msgs_sent++;
    return 0;
}

/* --- receiving -------------------------------------------------------------- */

/* Reads one message from the router (non-blocking). 1: read (queued or
 * dropped with a log line), 0: nothing waiting, -1: socket error. */
static int s_recv_one(fi_gnet *n, char *err, size_t errlen) {
    zmq_msg_t id, hdr, *body = malloc(sizeof *body);
    if (!body) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    zmq_msg_init(&id);
    zmq_msg_init(&hdr);
    zmq_msg_init(body);
    int rc = 1, frames = 0, more = 0;
    if (zmq_msg_recv(&id, n->router, ZMQ_DONTWAIT) < 0) {
        rc = zmq_errno() == EAGAIN ? 0 : -1;
        if (rc < 0) snprintf(err, errlen, "group: receive: %s", zmq_strerror(zmq_errno()));
        goto done;
    }
    frames = 1;
    more = zmq_msg_more(&id);
    if (more && zmq_msg_recv(&hdr, n->router, 0) >= 0) {
        frames++;
        more = zmq_msg_more(&hdr);
        if (more && zmq_msg_recv(body, n->router, 0) >= 0) {
            frames++;
            more = zmq_msg_more(body);
        }
    }
    while (more) { /* surplus frames: read and drop the whole message */
        zmq_msg_t x;
        zmq_msg_init(&x);
        if (zmq_msg_recv(&x, n->router, 0) < 0) more = 0;
        else more = zmq_msg_more(&x);
        zmq_msg_close(&x);
        frames++;
    }
    /* The ZAP User-Id rides on the frames the peer sent (not on the
     * routing id the ROUTER adds). */
    const char *uid = frames >= 2 ? zmq_msg_gets(&hdr, "User-Id") : NULL;
    int from = -1;
    if (uid && !strncmp(uid, "rank:", 5)) from = atoi(uid + 5);
    uint32_t magic = 0;
    if (frames == 3 && zmq_msg_size(&hdr) == S_HDR) memcpy(&magic, zmq_msg_data(&hdr), 4);
    if (from < 0 || from >= n->world || from == n->rank || frames != 3 || magic != S_MAGIC) {
        fprintf(stderr, "group rank %d: dropped a malformed message (%d frames) from %s\n",
                n->rank, frames, uid ? uid : "an unknown peer");
        goto done;
    }
    const uint8_t *h = zmq_msg_data(&hdr);
    const uint8_t kind = h[4];
    uint64_t pass;
    memcpy(&pass, h + 8, 8);
    const size_t len = zmq_msg_size(body);
    if (n->keep && !n->keep(n->keep_user, from, kind, pass)) {
        s_dropped(n, from, "not a message this rank takes from it", kind, pass);
        goto done;
    }
    if (n->n_inbox >= S_INBOX_MAX || n->n_from[from] >= S_FROM_MAX_MSGS ||
        n->bytes_from[from] + len > S_FROM_MAX_BYTES) {
        s_dropped(n, from, "too many of its messages are waiting", kind, pass);
        goto done;
    }
    fi_gmsg *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "out of memory");
        rc = -1;
        goto done;
    }
    m->from = from;
    m->kind = kind;
    m->pass = pass;
    memcpy(&m->op, h + 16, 4);
    m->zmsg = body;
    m->data = zmq_msg_data(body);
    m->len = len;
    body = NULL; /* owned by m */
    if (n->tail[from]) n->tail[from]->next = m;
    else n->head[from] = m;
    n->tail[from] = m;
    n->n_inbox++;
    n->n_from[from]++;
    n->bytes_from[from] += len;
done:
    zmq_msg_close(&id);
    zmq_msg_close(&hdr);
    if (body) {
        zmq_msg_close(body);
        free(body);
    }
    return rc;
}

/* Reads the monitor events of the link to r. 1 when the state changed. */
static int s_events(fi_gnet *n, int r) {
    int changed = 0;
    for (;;) {
        zmq_msg_t a, b;
        zmq_msg_init(&a);
        if (zmq_msg_recv(&a, n->mon[r], ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&a);
            return changed;
        }
        uint16_t ev = 0;
        if (zmq_msg_size(&a) >= 2) memcpy(&ev, zmq_msg_data(&a), 2);
        if (zmq_msg_more(&a)) {
            zmq_msg_init(&b);
            zmq_msg_recv(&b, n->mon[r], 0);
            zmq_msg_close(&b);
        }
        zmq_msg_close(&a);
        if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED && !n->up[r]) {
            n->up[r] = 1;
            n->serial[r]++;
            changed = 1;
        } else if (ev == ZMQ_EVENT_DISCONNECTED && n->up[r]) {
            n->up[r] = 0;
            if (n->lost < 0) n->lost = r;
            changed = 1;
        }
    }
}

int fi_gnet_pump(fi_gnet *n, int timeout_ms, char *err, size_t errlen) {
    zmq_pollitem_t it[FI_GROUP_MAX_RANKS + 1];
    int map[FI_GROUP_MAX_RANKS + 1], k = 0;
    it[k] = (zmq_pollitem_t){n->router, 0, ZMQ_POLLIN, 0};
    map[k++] = -1;
    for (int r = 0; r < n->world; r++)
        if (n->mon[r]) {
            it[k] = (zmq_pollitem_t){n->mon[r], 0, ZMQ_POLLIN, 0};
            map[k++] = r;
        }
    int pr = zmq_poll(it, k, timeout_ms);
    if (pr < 0) {
        if (zmq_errno() == EINTR) return 0;
        snprintf(err, errlen, "group: poll: %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    int happened = 0;
    for (int i = 0; i < k; i++) {
        if (!(it[i].revents & ZMQ_POLLIN)) continue;
        if (map[i] < 0) {
            int rc;
            while ((rc = s_recv_one(n, err, errlen)) == 1) happened = 1;
            if (rc < 0) return -1;
        } else if (s_events(n, map[i])) {
            happened = 1;
        }
    }
    return happened;
}

void fi_gnet_mark(fi_gnet *n) { n->lost = -1; }
int fi_gnet_lost_since_mark(const fi_gnet *n) { return n->lost; }

const fi_gmsg *fi_gnet_peek(const fi_gnet *n, int from, uint8_t kind) {
    if (from < 0 || from >= n->world) return NULL;
    for (const fi_gmsg *m = n->head[from]; m; m = m->next)
        if (m->kind == kind) return m;
    return NULL;
}

fi_gmsg *fi_gnet_take(fi_gnet *n, int from, uint8_t kind, uint64_t pass) {
    for (int r = 0; r < n->world; r++) {
        if (from >= 0 && r != from) continue;
        fi_gmsg *prev = NULL;
        for (fi_gmsg *m = n->head[r]; m; prev = m, m = m->next) {
            if ((kind && m->kind != kind) || (pass != UINT64_MAX && m->pass != pass)) continue;
            s_unlink(n, r, prev, m);
            return m;
        }
    }
    return NULL;
}

void fi_gnet_drop_before(fi_gnet *n, uint64_t pass) {
    for (int r = 0; r < n->world; r++) {
        fi_gmsg *prev = NULL, *m = n->head[r];
        while (m) {
            fi_gmsg *next = m->next;
            if (m->pass && m->pass < pass) {
                s_unlink(n, r, prev, m);
                fi_gmsg_free(&m);
            } else {
                prev = m;
            }
            m = next;
        }
    }
}

void fi_gnet_set_filter(fi_gnet *n, int (*keep)(void *user, int from, uint8_t kind, uint64_t pass),
                        void *user) {
    n->keep = keep;
    n->keep_user = user;
}

uint64_t fi_gnet_dropped(const fi_gnet *n, int from) {
    return from >= 0 && from < n->world ? n->dropped[from] : 0;
}
