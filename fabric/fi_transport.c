/*
 * fi_transport.c - socket set-up and the ZAP handler. See fi_transport.h.
 */
#include "fi_transport.h"
#include "fi_wire.h"

#include <stdio.h>
#include <string.h>
#include <zmq.h>

void fi_sockopts_default(fi_sockopts *o) {
    memset(o, 0, sizeof *o);
    o->heartbeat_ms = 1000;
    o->heartbeat_timeout_ms = 3000;
    o->handshake_ms = 2000;
    o->max_msg = (int)FI_WIRE_MAX_MSG;
    o->hwm = 1000;
    o->reconnect_ms = 100;
    o->reconnect_max_ms = 5000;
}

#define S_SET(opt, val)                                                                      \
    do {                                                                                     \
        if (zmq_setsockopt(s, opt, &(val), sizeof(val)) != 0) {                              \
            snprintf(err, errlen, "zmq_setsockopt(%s): %s", #opt, zmq_strerror(zmq_errno())); \
            return -1;                                                                       \
        }                                                                                    \
    } while (0)

/* The limits every fabric socket carries, whatever its side. */
static int s_limits(void *s, const fi_sockopts *o, char *err, size_t errlen) {
    int64_t maxmsg = (int64_t)o->max_msg + FI_WIRE_CURVE_SLACK; /* the codec checks max_msg itself */
    int linger = 0, keepalive = 1, idle = 30, intvl = 10, cnt = 3;
    int ttl = o->heartbeat_timeout_ms;
    S_SET(ZMQ_MAXMSGSIZE, maxmsg);
    S_SET(ZMQ_HANDSHAKE_IVL, o->handshake_ms);
    S_SET(ZMQ_HEARTBEAT_IVL, o->heartbeat_ms);
    S_SET(ZMQ_HEARTBEAT_TIMEOUT, o->heartbeat_timeout_ms);
    S_SET(ZMQ_HEARTBEAT_TTL, ttl);
    S_SET(ZMQ_SNDHWM, o->hwm);
    S_SET(ZMQ_RCVHWM, o->hwm);
    S_SET(ZMQ_LINGER, linger);
    S_SET(ZMQ_TCP_KEEPALIVE, keepalive);
    S_SET(ZMQ_TCP_KEEPALIVE_IDLE, idle);
    S_SET(ZMQ_TCP_KEEPALIVE_INTVL, intvl);
    S_SET(ZMQ_TCP_KEEPALIVE_CNT, cnt);
    S_SET(ZMQ_RECONNECT_IVL, o->reconnect_ms);
    S_SET(ZMQ_RECONNECT_IVL_MAX, o->reconnect_max_ms);
    return 0;
}

int fi_sock_server(void *s, const fi_keypair *kp, const char *domain, const fi_sockopts *o,
                   char *err, size_t errlen) {
    int one = 1;
    if (s_limits(s, o, err, errlen) != 0) return -1;
    if (o->plaintext) {
#ifdef FI_FABRIC_PLAINTEXT_BENCH
        S_SET(ZMQ_PLAIN_SERVER, one);
#else
        snprintf(err, errlen, "plaintext sockets exist only in the benchmark build");
        return -1;
#endif
    } else {
        S_SET(ZMQ_CURVE_SERVER, one);
        if (zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, kp->sec, FI_KEYS_BYTES) != 0) {
            snprintf(err, errlen, "zmq_setsockopt(ZMQ_CURVE_SECRETKEY): %s",
                     zmq_strerror(zmq_errno()));
            return -1;
        }
    }
    if (zmq_setsockopt(s, ZMQ_ZAP_DOMAIN, domain, strlen(domain)) != 0) {
        snprintf(err, errlen, "zmq_setsockopt(ZMQ_ZAP_DOMAIN): %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    S_SET(ZMQ_ZAP_ENFORCE_DOMAIN, one);
    return 0;
}

int fi_sock_client(void *s, const fi_keypair *kp, const uint8_t server_pub[FI_KEYS_BYTES],
                   const fi_sockopts *o, char *err, size_t errlen) {
    if (s_limits(s, o, err, errlen) != 0) return -1;
    if (o->plaintext) {
#ifdef FI_FABRIC_PLAINTEXT_BENCH
        /* The benchmark's stand-in for a key: the Z85 public key as user
         * name, so that ZAP still knows which peer this is. */
        char z[FI_KEYS_Z85_LEN];
        fi_keys_to_z85(kp->pub, z);
        if (zmq_setsockopt(s, ZMQ_PLAIN_USERNAME, z, strlen(z)) != 0 ||
            zmq_setsockopt(s, ZMQ_PLAIN_PASSWORD, "bench", 5) != 0) {
            snprintf(err, errlen, "zmq_setsockopt(ZMQ_PLAIN_*): %s", zmq_strerror(zmq_errno()));
            return -1;
        }
        return 0;
#else
        snprintf(err, errlen, "plaintext sockets exist only in the benchmark build");
        return -1;
#endif
    }
    if (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, server_pub, FI_KEYS_BYTES) != 0 ||
        zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, kp->pub, FI_KEYS_BYTES) != 0 ||
        zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, kp->sec, FI_KEYS_BYTES) != 0) {
        snprintf(err, errlen, "zmq_setsockopt(ZMQ_CURVE_*): %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    return 0;
}

void *fi_zap_bind(void *ctx, char *err, size_t errlen) {
    void *zap = zmq_socket(ctx, ZMQ_REP);
    int linger = 0;
    if (!zap || zmq_setsockopt(zap, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_bind(zap, "inproc://zeromq.zap.01") != 0) {
        snprintf(err, errlen, "ZAP handler: cannot bind inproc://zeromq.zap.01: %s",
                 zmq_strerror(zmq_errno()));
        if (zap) zmq_close(zap);
        return NULL;
    }
    return zap;
}

/* Receives the frames of one ZAP request into fr (up to 8, each up to
 * 255 bytes, NUL-terminated). Returns the frame count, 0 when nothing is
 * pending, -1 on error. */
#define S_ZAP_FRAMES 8
static int s_zap_recv(void *zap, char fr[S_ZAP_FRAMES][256], size_t len[S_ZAP_FRAMES]) {
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, zap, n == 0 ? ZMQ_DONTWAIT : 0) < 0) {
            zmq_msg_close(&m);
            return n == 0 && zmq_errno() == EAGAIN ? 0 : -1;
        }
        more = zmq_msg_more(&m);
        if (n < S_ZAP_FRAMES) {
            size_t sz = zmq_msg_size(&m);
            if (sz > 255) sz = 255;
            memcpy(fr[n], zmq_msg_data(&m), sz);
            fr[n][sz] = 0;
            len[n] = sz;
        }
        n++;
        zmq_msg_close(&m);
    }
    return n;
}

int fi_zap_handle(void *zap, fi_zap_fn fn, void *user) {
    int answered = 0;
    for (;;) {
        char fr[S_ZAP_FRAMES][256];
        size_t len[S_ZAP_FRAMES] = {0};
        int n = s_zap_recv(zap, fr, len);
        if (n == 0) return answered;
        if (n < 0) return -1;
        /* version, request id, domain, address, routing id, mechanism,
         * credentials... (RFC 27/ZAP) */
        char uid[128] = "", reason[256] = "refused";
        int ok = 0;
        if (n < 6 || strcmp(fr[0], "1.0")) {
            snprintf(reason, sizeof reason, "malformed ZAP request");
        } else if (!strcmp(fr[5], "CURVE") && n == 7 && len[6] == FI_KEYS_BYTES) {
            ok = fn(user, fr[2], (const uint8_t *)fr[6], fr[3], uid, sizeof uid, reason,
                    sizeof reason);
#ifdef FI_FABRIC_PLAINTEXT_BENCH
        } else if (!strcmp(fr[5], "PLAIN") && n == 8) {
            uint8_t pub[FI_KEYS_BYTES];
            if (fi_keys_from_z85(fr[6], pub) == 0)
                ok = fn(user, fr[2], pub, fr[3], uid, sizeof uid, reason, sizeof reason);
#endif
        } else {
            snprintf(reason, sizeof reason, "mechanism %.32s is not accepted", fr[5]);
            fprintf(stderr, "fabric: refused a %s handshake from %s: only CURVE is accepted\n",
                    fr[5], fr[3]);
        }
        const char *code = ok ? "200" : "400";
        const char *text = ok ? "OK" : reason;
        if (zmq_send(zap, "1.0", 3, ZMQ_SNDMORE) < 0 ||
            zmq_send(zap, fr[1], len[1], ZMQ_SNDMORE) < 0 ||
            zmq_send(zap, code, 3, ZMQ_SNDMORE) < 0 ||
            zmq_send(zap, text, strlen(text), ZMQ_SNDMORE) < 0 ||
            zmq_send(zap, uid, ok ? strlen(uid) : 0, ZMQ_SNDMORE) < 0 ||
            zmq_send(zap, "", 0, 0) < 0)
            return -1;
        answered++;
    }
}

void fi_sock_close_monitored(void *s) {
    if (!s) return;
    (void)zmq_socket_monitor(s, NULL, 0);
    zmq_close(s);
}
