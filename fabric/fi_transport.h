/*
 * fi_transport.h - how every fabric socket is set up: CURVE (server or
 * client side), the ZAP handler that authenticates clients, and the limits
 * every socket carries (message size, handshake time, heartbeats, queue
 * bounds, reconnect back-off).
 *
 * There is no plaintext mode. The only exception is a build of the
 * benchmark with FI_FABRIC_PLAINTEXT_BENCH defined (CMake option
 * FEDINFER_FABRIC_BENCH_PLAINTEXT, OFF by default), which lets
 * fi_fabric_bench use ZMQ PLAIN to measure what CURVE costs; the library
 * that fedinfer and fedctl link never contains that path.
 */
#ifndef FI_TRANSPORT_H
#define FI_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "fi_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

/* libzmq 4.3.4 accepts this option but declares it only in its draft API
 * (see FIELD-NOTES.md). With it, a server socket whose ZAP handler is
 * missing refuses every client instead of accepting them all. */
#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN 93
#endif

/* ZAP domains: the fabric proper (enrolled keys only) and the enrolment
 * endpoint (any key that is not revoked; only Enrol is served there). */
#define FI_ZAP_DOMAIN_FABRIC "fedinfer.fabric"
#define FI_ZAP_DOMAIN_ENROL "fedinfer.enrol"

typedef struct fi_sockopts {
    int heartbeat_ms;         /* ZMQ_HEARTBEAT_IVL: ZMTP ping interval */
    int heartbeat_timeout_ms; /* ZMQ_HEARTBEAT_TIMEOUT / _TTL: silence that drops the link */
    int handshake_ms;         /* ZMQ_HANDSHAKE_IVL: time to finish the CURVE handshake */
    int max_msg;              /* ZMQ_MAXMSGSIZE, bytes */
    int hwm;                  /* ZMQ_SNDHWM and ZMQ_RCVHWM, messages */
    int reconnect_ms;         /* ZMQ_RECONNECT_IVL: first reconnect delay */
    int reconnect_max_ms;     /* ZMQ_RECONNECT_IVL_MAX: back-off ceiling */
    int plaintext;            /* benchmark builds only: ZMQ PLAIN instead of CURVE */
} fi_sockopts;

/* Defaults: heartbeat 1000 ms, timeout 3000 ms, handshake 2000 ms,
 * FI_WIRE_MAX_MSG, hwm 1000, reconnect 100..5000 ms, CURVE. */
void fi_sockopts_default(fi_sockopts *o);

/* Makes s a CURVE server with key pair kp, authenticated through ZAP in
 * domain, with the limits of o. Call before zmq_bind, after
 * fi_zap_bind. Returns 0, or -1 with a message. */
FI_WIRE_MUST_CHECK int fi_sock_server(void *s, const fi_keypair *kp, const char *domain,
                                      const fi_sockopts *o, char *err, size_t errlen);
/* Makes s a CURVE client with key pair kp that only talks to a server
 * holding server_pub. Call before zmq_connect. */
FI_WIRE_MUST_CHECK int fi_sock_client(void *s, const fi_keypair *kp,
                                      const uint8_t server_pub[FI_KEYS_BYTES],
                                      const fi_sockopts *o, char *err, size_t errlen);

/* Closes a socket that has a monitor (zmq_socket_monitor), stopping the
 * monitor first. libzmq's I/O thread sends monitor events blocking: once
 * the reading PAIR is closed, the closing socket's last event (its
 * disconnection, emitted after zmq_close returns) blocks that thread for
 * good, and with it every socket of the context and zmq_ctx_term. NULL is
 * ignored. */
void fi_sock_close_monitored(void *s);

/* --- ZAP --------------------------------------------------------------- */

/* Decides on one handshake: domain, the client's key, its address.
 * Returns 1 to accept, with the User-Id every message of the connection
 * will carry written to user_id; 0 to refuse, with a reason. */
typedef int (*fi_zap_fn)(void *user, const char *domain, const uint8_t pub[FI_KEYS_BYTES],
                         const char *address, char *user_id, size_t uidlen, char *reason,
                         size_t reasonlen);

/* Binds the ZAP handler's socket in ctx at inproc://zeromq.zap.01. Must
 * come before any server socket binds. NULL with a message on failure. */
void *fi_zap_bind(void *ctx, char *err, size_t errlen);
/* Answers every pending ZAP request on zap (never blocks). A request that
 * is not CURVE (or PLAIN in benchmark builds) is refused. Returns the
 * number answered, or -1 on a socket error. */
int fi_zap_handle(void *zap, fi_zap_fn fn, void *user);

#ifdef __cplusplus
}
#endif
#endif /* FI_TRANSPORT_H */
