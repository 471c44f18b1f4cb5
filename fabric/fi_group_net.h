/*
 * fi_group_net.h - the links between the ranks of a shard group: a full
 * mesh of CURVE-encrypted ZeroMQ connections, authenticated by the ranks'
 * keys, with link liveness from ZMTP heartbeats.
 *
 * Every rank binds one ROUTER (a CURVE server; its ZAP handler, run by a
 * small actor thread, accepts only the keys of the group file and names
 * each connection after its rank) and connects one DEALER to every other
 * rank. A message goes out on the DEALER to its destination and comes in
 * on the destination's ROUTER, where the sender is read from the
 * connection's ZAP User-Id, never from the message. A link is "up" from
 * the DEALER's completed handshake to its disconnection: a killed rank's
 * links drop at once (TCP closes), a frozen rank's after the heartbeat
 * timeout (ZMTP PINGs go unanswered), whatever the application threads
 * are doing meanwhile (libzmq's I/O thread answers them).
 *
 * Messages are two frames: a fixed 24-byte header (magic, kind, pass,
 * op) and a payload whose meaning belongs to the kind (fi_group.c).
 * No schema-less decoding: every field is checked by its reader.
 *
 * Sends never block: DEALERs use ZMQ_IMMEDIATE, so a message for a rank
 * whose link is down fails at once instead of waiting in a queue for a
 * later incarnation of that rank.
 *
 * A fi_gnet is used by one thread (the rank's serving thread).
 */
#ifndef FI_GROUP_NET_H
#define FI_GROUP_NET_H

#include <stddef.h>
#include <stdint.h>

#include "fi_group_conf.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_GNET_MAX_MSG (256 << 20) /* bytes of one payload */
#define FI_GNET_ZAP_DOMAIN "fedinfer.group"

typedef struct fi_gnet fi_gnet;

/* One received message. */
typedef struct fi_gmsg {
    int from;             /* sender's rank (from its authenticated key) */
    uint8_t kind;         /* message kind (fi_group.c's FI_G_*) */
    uint64_t pass;        /* forward pass it belongs to (0: none) */
    uint32_t op;          /* index inside the pass */
    const void *data;     /* payload (owned by the message) */
    size_t len;           /* payload bytes */
    struct fi_gmsg *next; /* inbox chaining */
    void *zmsg;           /* the payload frame (zmq_msg_t), private */
} fi_gmsg;

void fi_gmsg_free(fi_gmsg **m);

/* Binds rank's endpoint and connects to every other rank. kp is rank's
 * key pair (copied, wiped on destroy). NULL with a message (the endpoint
 * cannot be bound, kp is not the key the group file lists for rank). */
fi_gnet *fi_gnet_new(const fi_group_conf *g, int rank, const fi_keypair *kp, char *err,
                     size_t errlen);
void fi_gnet_destroy(fi_gnet **n);

int fi_gnet_rank(const fi_gnet *n);
int fi_gnet_world(const fi_gnet *n);
/* 1 when the link to rank r is up (r == own rank: always 1). */
int fi_gnet_up(const fi_gnet *n, int r);
/* How many times the link to r has come up: a change means r may be a new
 * process (restarted) and must join again. */
unsigned fi_gnet_link_serial(const fi_gnet *n, int r);
/* The lowest rank whose link is down, or -1 when all are up. */
int fi_gnet_first_down(const fi_gnet *n);

/* Starts watching for lost links (at the start of a pass): a link that
 * goes down and comes back up between two pumps still counts as lost,
 * since messages of the pass may have gone with it. */
void fi_gnet_mark(fi_gnet *n);
/* The first rank whose link went down since fi_gnet_mark, or -1. */
int fi_gnet_lost_since_mark(const fi_gnet *n);

/* The first waiting message from `from` of `kind`, left in place; NULL
 * when none. */
const fi_gmsg *fi_gnet_peek(const fi_gnet *n, int from, uint8_t kind);

/* Sends one message to rank `to` (two frames: header, payload). 0, or -1
 * with a message when the link is down or the rank's queue is full. */
FI_WIRE_MUST_CHECK int fi_gnet_send(fi_gnet *n, int to, uint8_t kind, uint64_t pass,
                                    uint32_t op, const void *data, size_t len, char *err,
                                    size_t errlen);

/* Takes the first waiting message from rank `from` (-1: anyone) of kind
 * `kind` (0: any) for pass `pass` (UINT64_MAX: any), without waiting.
 * Messages are kept in arrival order per sender. NULL when none. */
fi_gmsg *fi_gnet_take(fi_gnet *n, int from, uint8_t kind, uint64_t pass);

/* Waits up to timeout_ms for the network (incoming messages go to the
 * inbox; link events update the link states). Returns 1 when something
 * happened (a message arrived or a link changed), 0 on timeout, -1 on a
 * socket error (with a message). timeout_ms 0 only drains. */
int fi_gnet_pump(fi_gnet *n, int timeout_ms, char *err, size_t errlen);

/* Drops every waiting message of a pass lower than `pass` (messages with
 * pass 0 are kept): what remains of aborted passes. */
void fi_gnet_drop_before(fi_gnet *n, uint64_t pass);

/* What this rank takes at all: keep(user, from, kind, pass) is asked for
 * every arriving message, and one it answers 0 for is dropped at once
 * (counted, and logged at most once a second per sender), so a rank that
 * sends what nobody waits for cannot fill the inbox. Besides, at most
 * 1024 messages and 2 x FI_GNET_MAX_MSG bytes wait from one sender; more
 * are dropped the same way, and the other senders are still heard.
 * NULL: every message is kept (within those bounds). */
void fi_gnet_set_filter(fi_gnet *n, int (*keep)(void *user, int from, uint8_t kind, uint64_t pass),
                        void *user);
/* Messages dropped so far from rank `from` (refused or over the bounds). */
uint64_t fi_gnet_dropped(const fi_gnet *n, int from);

/* Work that must go on while a rank waits inside a pass (the leader's
 * heartbeats to the coordinator): fn(user) is called by fi_gnet_idle at
 * most every FI_GNET_IDLE_MS. NULL: none. */
#define FI_GNET_IDLE_MS 50
void fi_gnet_set_idle(fi_gnet *n, void (*fn)(void *user), void *user);
/* Calls the idle work when it is due (fi_gcoll_wait calls this). */
void fi_gnet_idle(fi_gnet *n);

/* Traffic counters since creation: bytes and messages sent (headers
 * included). */
void fi_gnet_counters(const fi_gnet *n, uint64_t *bytes_sent, uint64_t *msgs_sent);

#ifdef __cplusplus
}
#endif
#endif /* FI_GROUP_NET_H */
