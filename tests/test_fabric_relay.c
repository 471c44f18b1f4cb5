/*
 * test_fabric_relay.c - what an observer of the wire sees, and what the
 * coordinator does with connections that are not peers.
 *
 *  - A relay between an edge and the coordinator records every byte in
 *    both directions; a prompt with a recognisable string crosses it (and
 *    is echoed back by the worker), and the string never appears in the
 *    recording.
 *  - Idle, garbage and stalled-handshake TCP connections are dropped,
 *    while a legitimate edge keeps its round-trip time.
 *  - A plaintext (NULL mechanism) client gets nothing through; a CURVE
 *    server socket without a ZAP handler refuses clients (fails closed).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include "fabric/harness.h"

#define S_CANARY "CANARY-zebra-4471-patient-record"

/* --- the recording relay ------------------------------------------------ */
#define S_MAX_PAIRS 8
typedef struct s_relay {
    int listen_fd;                 /* where the edge connects */
    int port;                      /* its port */
    int target_port;               /* the coordinator's port */
    int fds[S_MAX_PAIRS][2];       /* [client, upstream] per connection */
    int n_pairs;                   /* connections relayed */
    uint8_t *rec;                  /* every byte seen, both directions */
    size_t rec_len, rec_cap;       /* used / allocated */
    atomic_int stop;               /* stops the thread */
    pthread_t th;                  /* relay thread */
} s_relay;

static void s_record(s_relay *r, const uint8_t *b, size_t n) {
    if (r->rec_len + n > r->rec_cap) {
        size_t cap = (r->rec_cap + n) * 2;
        uint8_t *nb = realloc(r->rec, cap);
        if (!nb) return;
        r->rec = nb;
        r->rec_cap = cap;
    }
    memcpy(r->rec + r->rec_len, b, n);
    r->rec_len += n;
}

static int s_connect_port(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void *s_relay_main(void *arg) {
    s_relay *r = arg;
    while (!atomic_load(&r->stop)) {
        struct pollfd pf[1 + 2 * S_MAX_PAIRS];
        int n = 0;
        pf[n++] = (struct pollfd){r->listen_fd, POLLIN, 0};
        for (int i = 0; i < r->n_pairs; i++)
            for (int k = 0; k < 2; k++) pf[n++] = (struct pollfd){r->fds[i][k], POLLIN, 0};
        if (poll(pf, (nfds_t)n, 50) <= 0) continue;
        if ((pf[0].revents & POLLIN) && r->n_pairs < S_MAX_PAIRS) {
            int c = accept(r->listen_fd, NULL, NULL);
            int u = c >= 0 ? s_connect_port(r->target_port) : -1;
            if (c >= 0 && u >= 0) {
                r->fds[r->n_pairs][0] = c;
                r->fds[r->n_pairs][1] = u;
                r->n_pairs++;
            } else if (c >= 0) {
                close(c);
            }
        }
        for (int i = 1; i < n; i++) {
            if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR)) || pf[i].fd < 0) continue;
            int pair = (i - 1) / 2, side = (i - 1) % 2;
            uint8_t buf[65536];
            ssize_t got = read(pf[i].fd, buf, sizeof buf);
            if (got <= 0) {
                /* one side closed: close both (the peer reconnects) */
                if (r->fds[pair][0] >= 0) close(r->fds[pair][0]);
                if (r->fds[pair][1] >= 0) close(r->fds[pair][1]);
                r->fds[pair][0] = r->fds[pair][1] = -1;
                continue;
            }
            s_record(r, buf, (size_t)got);
            int to = r->fds[pair][1 - side];
            for (ssize_t off = 0; to >= 0 && off < got;) {
                ssize_t w = write(to, buf + off, (size_t)(got - off));
                if (w <= 0) break;
                off += w;
            }
        }
    }
    for (int i = 0; i < r->n_pairs; i++)
        for (int k = 0; k < 2; k++)
            if (r->fds[i][k] >= 0) close(r->fds[i][k]);
    return NULL;
}

static int s_relay_start(s_relay *r, int target_port) {
    memset(r, 0, sizeof *r);
    r->target_port = target_port;
    r->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof a;
    if (bind(r->listen_fd, (struct sockaddr *)&a, sizeof a) || listen(r->listen_fd, 8) ||
        getsockname(r->listen_fd, (struct sockaddr *)&a, &sl))
        return -1;
    r->port = ntohs(a.sin_port);
    return pthread_create(&r->th, NULL, s_relay_main, r) ? -1 : 0;
}

static int s_port_of(const char *ep) {
    const char *colon = strrchr(ep, ':');
    return colon ? atoi(colon + 1) : -1;
}

static int s_contains(const uint8_t *hay, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(hay + i, needle, k)) return 1;
    return 0;
}

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

static void test_relay_sees_no_plaintext(void **state) {
    harness *h = *state;
    s_relay r;
    assert_int_equal(s_relay_start(&r, s_port_of(h->ep)), 0);
    h_worker w;
    assert_int_equal(h_worker_start(h, &w, "smol", 0), 0);
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "clinic-7", "eu-west"), 0);
    harness via = *h;
    snprintf(via.ep, sizeof via.ep, "tcp://127.0.0.1:%d", r.port);
    fi_client *edge = h_client(&via, &ek, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    for (int i = 0; i < 3; i++) {
        char id[16];
        snprintf(id, sizeof id, "c%d", i);
        h_text t;
        fi_client_result res;
        assert_int_equal(h_infer(edge, id, "smol", S_CANARY, &t, &res), 0);
        assert_string_equal(t.buf, "echo: " S_CANARY);
    }
    fi_client_destroy(&edge);
    h_worker_stop(&w);
    atomic_store(&r.stop, 1);
    pthread_join(r.th, NULL);
    print_message("relay recorded %zu bytes\n", r.rec_len);
    assert_true(r.rec_len > 1000);
    assert_true(s_contains(r.rec, r.rec_len, "CURVE")); /* we did record the session */
    assert_false(s_contains(r.rec, r.rec_len, S_CANARY));
    assert_false(s_contains(r.rec, r.rec_len, "zebra-4471"));
    assert_false(s_contains(r.rec, r.rec_len, "clinic-7"));
    assert_false(s_contains(r.rec, r.rec_len, "smol"));
    close(r.listen_fd);
    free(r.rec);
}

/* Reads until EOF/error; returns ms until the peer closed, or -1 if it
 * stayed open for limit_ms. */
static long s_closed_within(int fd, int limit_ms) {
    uint64_t t0 = fi_wire_now_ms();
    while (fi_wire_now_ms() - t0 < (uint64_t)limit_ms) {
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, 20) <= 0) continue;
        uint8_t buf[512];
        ssize_t n = read(fd, buf, sizeof buf);
        if (n <= 0) return (long)(fi_wire_now_ms() - t0);
    }
    return -1;
}

static void test_junk_connections_dropped(void **state) {
    harness *h = *state;
    int port = s_port_of(h->ep);
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "clinic-7", "eu-west"), 0);
    h_worker w;
    assert_int_equal(h_worker_start(h, &w, "smol", 0), 0);
    fi_client *edge = h_client(h, &ek, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    h_text t;
    fi_client_result res;
    /* Baseline round trip. */
    uint64_t t0 = fi_wire_now_ms();
    assert_int_equal(h_infer(edge, "base", "smol", "hello", &t, &res), 0);
    long base = (long)(fi_wire_now_ms() - t0);

    enum { N = 24 };
    int fds[N];
    /* A third idle, a third garbage, a third a valid ZMTP greeting that
     * never finishes the CURVE handshake. */
    static const uint8_t greeting[64] = {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0, 'C', 'U',
                                         'R', 'V', 'E'};
    for (int i = 0; i < N; i++) {
        fds[i] = s_connect_port(port);
        assert_true(fds[i] >= 0);
        if (i % 3 == 1) {
            uint8_t junk[4096];
            for (size_t k = 0; k < sizeof junk; k++) junk[k] = (uint8_t)(k * 131 + (size_t)i);
            assert_true(write(fds[i], junk, sizeof junk) > 0);
        } else if (i % 3 == 2) {
            assert_int_equal(write(fds[i], greeting, sizeof greeting), (ssize_t)sizeof greeting);
        }
    }
    /* Legitimate traffic is not slowed meanwhile. */
    long worst = 0;
    for (int i = 0; i < 10; i++) {
        char id[16];
        snprintf(id, sizeof id, "j%d", i);
        t0 = fi_wire_now_ms();
        assert_int_equal(h_infer(edge, id, "smol", "hello", &t, &res), 0);
        assert_int_equal(res.error, FI__ERROR_CODE__ERR_UNSPECIFIED);
        long dt = (long)(fi_wire_now_ms() - t0);
        if (dt > worst) worst = dt;
    }
    print_message("round trip: %ld ms alone, at worst %ld ms beside %d junk connections\n", base,
                  worst, N);
    assert_true(worst < 400);
    /* Every junk connection is closed by the coordinator: the handshake
     * limit is 500 ms. */
    for (int i = 0; i < N; i++) {
        long closed = s_closed_within(fds[i], 3000);
        assert_true(closed >= 0);
        close(fds[i]);
    }
    fi_client_destroy(&edge);
    h_worker_stop(&w);
}

static void test_plaintext_refused(void **state) {
    harness *h = *state;
    /* A client with no security (NULL mechanism) never gets a message
     * through: the mechanisms do not match and the handshake fails. */
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    assert_int_equal(zmq_connect(d, h->ep), 0);
    size_t len;
    uint8_t *hb = fi_wire_heartbeat(1, &len);
    zmq_send(d, hb, len, ZMQ_DONTWAIT);
    free(hb);
    zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
    assert_int_equal(zmq_poll(&it, 1, 800), 0);
    zmq_close(d);

    /* Fail closed: a CURVE server socket with ZMQ_ZAP_ENFORCE_DOMAIN and no
     * ZAP handler in its context delivers nothing from any client. */
    void *ctx2 = zmq_ctx_new(), *srv = zmq_socket(ctx2, ZMQ_ROUTER);
    fi_keypair sk, ck;
    assert_int_equal(fi_keys_generate(&sk), 0);
    assert_int_equal(fi_keys_generate(&ck), 0);
    fi_sockopts so;
    char err[256];
    fi_sockopts_default(&so);
    so.handshake_ms = 300;
    assert_int_equal(fi_sock_server(srv, &sk, FI_ZAP_DOMAIN_FABRIC, &so, err, sizeof err), 0);
    assert_int_equal(zmq_bind(srv, "tcp://127.0.0.1:*"), 0);
    char ep[128];
    size_t epl = sizeof ep;
    zmq_getsockopt(srv, ZMQ_LAST_ENDPOINT, ep, &epl);
    void *cli = zmq_socket(ctx2, ZMQ_DEALER);
    assert_int_equal(fi_sock_client(cli, &ck, sk.pub, &so, err, sizeof err), 0);
    assert_int_equal(zmq_connect(cli, ep), 0);
    zmq_send(cli, "x", 1, ZMQ_DONTWAIT);
    zmq_pollitem_t it2 = {srv, 0, ZMQ_POLLIN, 0};
    assert_int_equal(zmq_poll(&it2, 1, 800), 0);
    zmq_close(cli);
    zmq_close(srv);
    zmq_ctx_term(ctx2);
    zmq_ctx_term(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_relay_sees_no_plaintext, setup, teardown),
        cmocka_unit_test_setup_teardown(test_junk_connections_dropped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plaintext_refused, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
