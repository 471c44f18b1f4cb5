/*
 * fi_client.h - a peer of the coordinator: an edge agent, a cluster worker
 * or the console. Connects outward (the site needs no inbound port) over
 * CURVE with its own key, says Hello, keeps heartbeats going both ways and
 * comes back by itself, with back-off, when the coordinator goes away.
 *
 * Also the one-shot enrolment: present a token with a fresh key on the
 * coordinator's enrolment endpoint.
 *
 * A client is used by one thread; it owns its ZeroMQ context.
 */
#ifndef FI_CLIENT_H
#define FI_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "fi_conf.h"
#include "fi_keys.h"
#include "fi_wire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_CLIENT_MAX_MODELS 8

typedef struct fi_client_opts {
    char endpoint[FI_CONF_STR_MAX];     /* coordinator's fabric endpoint */
    uint8_t server_pub[FI_KEYS_BYTES];  /* coordinator's public key */
    fi_keypair kp;                      /* our key pair (copied, wiped on destroy) */
    Fi__Role role;                      /* what Hello announces (the coordinator uses the key's) */
    int heartbeat_ms;                   /* our heartbeat interval */
    int liveness;                       /* silent intervals before we reconnect */
    int handshake_ms;                   /* CURVE handshake limit */
    int reconnect_ms;                   /* first back-off delay */
    int reconnect_max_ms;               /* back-off ceiling */
    int hwm;                            /* queue bound, messages */
    int n_models;                       /* workers: models served */
    char models[FI_CLIENT_MAX_MODELS][64]; /* their names */
    uint32_t capacity[FI_CLIENT_MAX_MODELS]; /* requests at once, per model */
    int plaintext;                      /* benchmark builds only */
    uint64_t policy_version;            /* edges: policy bundle version held (see below) */
    int64_t audit_seq;                  /* edges: the coordinator's audit head witnessed so far */
    char audit_hash[65];                /* (0 / "": none), see fi_client_audit_witness */
} fi_client_opts;

/* Defaults: heartbeat 1000 ms, liveness 3, handshake 2000 ms, reconnect
 * 100..5000 ms, hwm 1000, role edge. endpoint, server_pub and kp must be
 * filled in. */
void fi_client_opts_default(fi_client_opts *o);

typedef struct fi_client fi_client;

/* Connects and sends Hello (the connection completes in the background).
 * NULL with a message on failure. */
fi_client *fi_client_new(const fi_client_opts *o, char *err, size_t errlen);
void fi_client_destroy(fi_client **c);

/* Sends one message (never blocks: -1 when the queue is full). */
FI_WIRE_MUST_CHECK int fi_client_send(fi_client *c, const fi_msg *m);
/* Sends an encoded message (fi_wire_encode), taking ownership of buf
 * (NULL is a failure). len is read after buf is evaluated, so that
 * fi_client_send_encoded(c, fi_wire_ack(ref, &len), &len) is correct. */
FI_WIRE_MUST_CHECK int fi_client_send_encoded(fi_client *c, uint8_t *buf, const size_t *len);
/* Waits up to timeout_ms for the next message that is not a heartbeat or
 * the coordinator's Hello, while keeping heartbeats and reconnection
 * going. Returns 1 with *out (free with fi_wire_free), 0 on timeout (or
 * early: just after the coordinator's Hello arrived, or when the
 * connection was lost, see fi_client_reconnects), or -1
 * with a message when the coordinator refused our key (unknown or
 * revoked) or revoked us. */
int fi_client_recv(fi_client *c, int timeout_ms, fi_msg **out, char *err, size_t errlen);
/* fi_client_recv that also returns 2 as soon as the ZeroMQ socket other
 * (of any context) has input: for a loop that serves the fabric and a
 * pipe to a background thread at once. */
int fi_client_recv_or(fi_client *c, int timeout_ms, void *other, fi_msg **out, char *err,
                      size_t errlen);
/* Waits until the coordinator has answered our Hello; 0, or -1 on timeout
 * or refusal. */
int fi_client_wait_ready(fi_client *c, int timeout_ms, char *err, size_t errlen);
/* 1 when the coordinator has answered Hello on the current connection. */
int fi_client_ready(const fi_client *c);
/* Edges: the version of the policy bundle held (initially
 * o.policy_version), said in every Hello from now on; the coordinator
 * pushes its active bundle after Hello only when it is newer (0, the
 * default: whatever is active). */
void fi_client_set_policy_version(fi_client *c, uint64_t version);
/* Edges: the newest head of the coordinator's audit log (record seq and
 * chain hash) that its heartbeats have told, starting from
 * o.audit_seq / o.audit_hash: *seq 0 and hash "" when none. Every Hello
 * and heartbeat says it back (the coordinator checks its log against it:
 * a witness, policy/fi_audit.h). A head lower than it, or the same record
 * with another hash, is never taken: the client warns on stderr, once
 * per such head. Returns a count that changes whenever the witness
 * advances, for the caller to keep it (the edge stores it in its
 * database, and starts from it). */
unsigned fi_client_audit_witness(const fi_client *c, int64_t *seq, char hash[65]);
/* Clusters: the load sent with every heartbeat from now on (at least once
 * per heartbeat interval, even while streaming): sequences running and
 * queued, KV-cache blocks, and the prefix filter (fi_sched_prefix_filter;
 * NULL: none; copied, at most 65536 bytes). */
void fi_client_set_load(fi_client *c, uint32_t running, uint32_t queued, uint32_t kv_free,
                        uint32_t kv_total, const uint8_t *filter, size_t filter_len);

/* (cluster, model) rows kept from a heartbeat at most: the coordinator's
 * bound (a heartbeat with more is kept as truncated). */
#define FI_CLIENT_MAX_LOADS FI_WIRE_MAX_LOAD_ROWS
/* One cluster's load for one model, as the coordinator last said. */
typedef struct fi_cluster_load {
    char cluster[64];       /* the policy's cluster (the workers' site) */
    char model[64];
    uint32_t workers;       /* live workers serving the model */
    uint32_t capacity;      /* their capacity, summed */
    uint32_t in_flight;     /* requests open on them */
    uint32_t queued;        /* waiting at the workers, reported */
} fi_cluster_load;
/* Edges: the clusters' load from the coordinator's last heartbeat. Copies
 * its first max rows to out (out may be NULL when max is 0) and returns
 * how many rows it had, which may be more than max (call again with room
 * for them); when that heartbeat was heard goes to *heard_ms
 * (fi_wire_now_ms; 0: none yet), and to *truncated (may be NULL) whether
 * its rows stop short of every live (cluster, model): 0, they list every
 * one with a live worker (none listed: none live); 1, the coordinator left
 * some out (FI_WIRE_MAX_LOAD_ROWS, its message limit, out of memory) or
 * we could not keep them all, and a pair not listed says nothing. */
int fi_client_cluster_loads(const fi_client *c, fi_cluster_load *out, int max, uint64_t *heard_ms,
                            int *truncated);

/* Workers: changes the capacity announced for model i (0 withdraws it:
 * the coordinator routes no new request there, as for a worker that is
 * not serving it) and says Hello again on the current connection; later
 * Hellos (after a reconnection) carry it too. A shard group uses it to
 * report itself unavailable while a rank is missing. 0, or -1 when i is
 * not a model of the options or the Hello cannot be queued now (it is
 * then said at the next reconnection). */
int fi_client_set_capacity(fi_client *c, int i, uint32_t capacity);
/* The capacity announced now for model i (0 when i is not a model). */
uint32_t fi_client_capacity(const fi_client *c, int i);
/* How many times the client has reconnected (a request open across a
 * reconnect is lost: the coordinator that had it may be gone). */
unsigned fi_client_reconnects(const fi_client *c);

/* Sends req and waits for a reply of type want (or an Error). Messages of
 * other types that arrive meanwhile are dropped. Returns 1 with *reply, 0
 * on timeout, -1 on refusal. */
int fi_client_call(fi_client *c, const fi_msg *req, fi_msg_type want, int timeout_ms,
                   fi_msg **reply, char *err, size_t errlen);

/* Called with each streamed piece of text; return nonzero to cancel. */
typedef int (*fi_client_text_fn)(void *user, const char *text, size_t len);

typedef struct fi_client_result {
    uint32_t n_prompt;      /* prompt tokens */
    uint32_t n_generated;   /* generated tokens */
    char stop_reason[32];   /* the worker's stop reason */
    Fi__ErrorCode error;    /* ERR_UNSPECIFIED on success */
    char message[256];      /* the error's message */
} fi_client_result;

/* Sends an inference request and streams its text to on_text until the
 * final result or an error. Returns 0 with res filled (res->error tells
 * an error reply apart), or -1 with a message on timeout, refusal or a
 * lost connection. */
int fi_client_infer(fi_client *c, const Fi__InferRequest *rq, fi_client_text_fn on_text,
                    void *user, int timeout_ms, fi_client_result *res, char *err, size_t errlen);

/* Enrols o->kp: connects to the enrolment endpoint, presents token with
 * role, site and region, and waits for the answer. Returns 0 with the
 * fingerprint recorded in fpr, or -1 with a message. A token of "-" is
 * read from the first line of standard input (so that it never appears in
 * the process list, where every local user can read a command line). */
int fi_client_enrol(const fi_client_opts *o, const char *enrol_endpoint, const char *token,
                    Fi__Role role, const char *site, const char *region, int timeout_ms,
                    char fpr[FI_KEYS_FPR_LEN], char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FI_CLIENT_H */
