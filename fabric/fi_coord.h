/*
 * fi_coord.h - the coordinator: a ROUTER socket brokering between edge
 * agents (clients) and cluster workers in the Majordomo style, plus the
 * enrolment endpoint and the operator console's requests.
 *
 * Everything crosses CURVE. Every connection is authenticated by the ZAP
 * handler against the keys enrolled in the store; a peer's role, site and
 * region come only from its key (ZAP User-Id), never from what it writes.
 *
 * Heartbeats go both ways every heartbeat_ms; a peer silent for liveness
 * intervals is dead: its requests end with ERR_PEER_DEAD to their senders
 * and it leaves routing until it says Hello again.
 *
 * One event loop (zmq_poll) on one thread; no locks.
 */
#ifndef FI_COORD_H
#define FI_COORD_H

#include <stdatomic.h>
#include <stddef.h>

#include "fi_conf.h"
#include "fi_keys.h"
#include "fi_store.h"
#include "fi_transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the policy said about one target, for routing and the audit log. */
typedef struct fi_coord_verdict {
    int64_t score;          /* sum of the matching prefer rules (permitted only) */
    char rules[256];        /* deciding rule ids, comma-separated */
    char digest[65];        /* SHA-256 of the deciding policy, hex; "" when none */
    char zone[64];          /* the origin's residency zone: its innermost jurisdiction in
                               that policy ("" when none: the origin site stands for it) */
} fi_coord_verdict;

/* The seam for policy/: called for every routed inference request with the
 * origin (from the edge's key) and each candidate worker's enrolled
 * identity (its site is the policy's cluster), before any routing score
 * is looked at: only the targets it permits are ever scored. Returns 1 to
 * permit, 0 to deny with a reason; fills v (may be NULL). NULL: requests
 * are routed on model and load alone. */
typedef int (*fi_coord_policy_fn)(void *user, const Fi__InferRequest *req,
                                  const fi_peer_rec *origin, const fi_peer_rec *target,
                                  fi_coord_verdict *v, char *reason, size_t reasonlen);

typedef struct fi_coord_opts {
    char bind[FI_CONF_STR_MAX];       /* fabric endpoint, e.g. tcp://0.0.0.0:7700 */
    char enrol_bind[FI_CONF_STR_MAX]; /* enrolment endpoint, e.g. tcp://0.0.0.0:7701 */
    char db[FI_CONF_STR_MAX];         /* SQLite file */
    char secret_key[FI_CONF_STR_MAX]; /* the coordinator's secret key file */
    int heartbeat_ms;                 /* application heartbeat interval */
    int liveness;                     /* intervals of silence before a peer is dead */
    int handshake_ms;                 /* CURVE handshake limit */
    int max_msg;                      /* bytes of one message at most */
    int hwm;                          /* queue bound per peer, messages */
    int max_in_flight;                /* open requests per edge key at most (all its connections) */
    int plaintext;                    /* benchmark builds only */
    fi_coord_policy_fn policy;        /* may be NULL, see above */
    void *policy_user;                /* passed to policy */
    void (*policy_free)(void *user);  /* frees policy_user with the coordinator; may be NULL */
    /* Policy shipping and auditing (fi_coord_ship.h). Empty paths: next to
     * db, as DB.policy.key and DB.audit. */
    char policy_key[FI_CONF_STR_MAX]; /* policy-signing key (made by --init) */
    char audit_db[FI_CONF_STR_MAX];   /* the coordinator's audit log (SQLite) */
    int policy_valid_s;               /* default bundle validity, seconds (30 days) */
    /* The re-check of routed requests (fi_coord_policy.h): the trusted
     * policy-signing public key; "" : off (unless the environment variable
     * FEDINFER_COORD_POLICY_KEY names one, which overrides this). */
    char policy_check_key[FI_CONF_STR_MAX];
} fi_coord_opts;

/* Defaults: tcp://0.0.0.0:7700 and :7701, coordinator.db, heartbeat
 * 1000 ms, liveness 3, handshake 2000 ms, FI_WIRE_MAX_MSG, hwm 1000,
 * 64 requests per edge. */
void fi_coord_opts_default(fi_coord_opts *o);
/* The configuration file's keys (fi_conf), for fi_coord_opts. */
extern const fi_conf_key fi_coord_conf_keys[];

/* One line of the coordinator's log on stderr: a UTC timestamp, then
 * "coordinator: " and the message (no newline needed). Every part of the
 * coordinator (its loop, policy shipping, the audit writer thread, the
 * policy check) logs through it, so its lines read alike. */
void fi_coord_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

typedef struct fi_coord fi_coord;

/* Opens the store, starts the ZAP handler, then binds both endpoints.
 * kp is copied. NULL with a message on failure. */
fi_coord *fi_coord_new(const fi_coord_opts *o, const fi_keypair *kp, char *err, size_t errlen);
/* Closes the sockets and the store; safe on NULL and twice. */
void fi_coord_destroy(fi_coord **c);
/* Runs the loop until *stop becomes nonzero. Returns 0, or -1 on a fatal
 * socket error. */
int fi_coord_run(fi_coord *c, atomic_int *stop);
/* The endpoint actually bound (resolves port 0 / "*"): enrol 0 for the
 * fabric, 1 for enrolment. */
const char *fi_coord_endpoint(const fi_coord *c, int enrol);
/* The store, for bootstrap and tests (owned by c). */
fi_store *fi_coord_store(fi_coord *c);
/* The policy store and audit log (fi_coord_ship.h), for tests (owned by c). */
struct fi_ship *fi_coord_ship(fi_coord *c);
/* Waits until the routing decisions made so far are in the audit log
 * (they are written by a thread of their own, fi_coord_audit.h); for
 * tests. Safe from another thread. */
void fi_coord_audit_wait(fi_coord *c);

#ifdef __cplusplus
}
#endif
#endif /* FI_COORD_H */
