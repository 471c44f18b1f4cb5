/*
 * edge_front.c - the HTTP listener in front of libmicrohttpd.
 *
 * Why it exists: libmicrohttpd 0.9.75 answers a Content-Length it cannot
 * parse (not a number, or over 2^64) itself, with an HTML page, before any
 * of our code sees the request. Clients of an OpenAI-style API expect a
 * JSON error. So this thread owns the listening socket: it accepts each
 * connection, peeks (MSG_PEEK, nothing consumed) at the head of its first
 * request, answers a malformed or absurd Content-Length itself with an
 * OpenAI-shaped JSON error (400 or 413), and hands every other connection
 * untouched to libmicrohttpd (MHD_add_connection), which then reads the
 * same bytes as if it had accepted it.
 *
 * A head longer than half of conn_memory (at most 64 KiB) is refused
 * here with a JSON 431. Not seen here: a body's chunked encoding, which
 * libmicrohttpd checks (a malformed one gets its HTML 400).
 *
 * Limits: connections waiting here are bounded by conn_limit, and by
 * per_ip_limit for each client address, and wait at most conn_timeout_s
 * for their head (then libmicrohttpd gets them and applies its own
 * timeout and per_ip_limit). Only the first request of a connection is
 * seen here; every response closes its connection (edge_http.c, s_send),
 * so there is no later one.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "edge_impl.h"
#include "fi_audit.h"

#define S_PEEK_MIN 8192 /* bytes of a request head we look at, at least (conn_memory / 2) */
#define S_RECHECK_MS 10 /* a head that arrives in pieces is looked at again after */
#define S_RCVBUF (128 * 1024) /* kernel receive buffer per connection, bytes */

typedef struct s_pend {
    int fd;                    /* accepted, not yet handed over */
    struct sockaddr_storage sa; /* its peer */
    socklen_t sl;
    double deadline;           /* hand it over after this (monotonic seconds) */
    size_t seen;               /* bytes peeked last time */
    int stalled;               /* head incomplete and nothing new: poll by timer */
} s_pend;

struct edge_front {
    fi_edge *e;          /* the agent (limits, metrics) */
    int lfd;             /* listening socket */
    int wake[2];         /* pipe: a byte stops the thread */
    pthread_t th;
    s_pend *p;           /* waiting connections */
    int n, cap;
    char *peek;          /* the head being looked at: a request head may be this long */
    size_t peek_len;
};

static void s_drop(edge_front *f, int i) {
    f->p[i] = f->p[--f->n];
}

/* Answers a refused head with a JSON error and closes the connection. */
static void s_refuse(edge_front *f, int fd, size_t head_len, int status, const char *code,
                     const char *msg_in) {
    char *body = NULL, msg[512];
    snprintf(msg, sizeof msg, "%s", msg_in);
    fi_text_clean(msg); /* it may quote the client's bytes */
    json_t *o = json_pack("{s:{s:s,s:s,s:n,s:s}}", "error", "message", msg, "type",
                          "invalid_request_error", "param", "code", code);
    if (o) body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    /* Take what the client has sent, so that closing does not reset the
     * connection before it reads the answer. */
    char junk[4096];
    size_t left = head_len;
    while (left) {
        ssize_t k = recv(fd, junk, left < sizeof junk ? left : sizeof junk, MSG_DONTWAIT);
        if (k <= 0) break;
        left -= (size_t)k;
    }
    while (recv(fd, junk, sizeof junk, MSG_DONTWAIT) > 0) {
    }
    char head[256];
    int hl = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                      "Connection: close\r\n\r\n",
                      status,
                      status == 413   ? "Content Too Large"
                      : status == 431 ? "Request Header Fields Too Large"
                      : status == 501 ? "Not Implemented"
                      : status == 505 ? "HTTP Version Not Supported"
                                      : "Bad Request",
                      body ? strlen(body) : 0);
    if (send(fd, head, (size_t)hl, MSG_NOSIGNAL) == hl && body)
        (void)send(fd, body, strlen(body), MSG_NOSIGNAL);
    shutdown(fd, SHUT_WR);
    close(fd);
    free(body);
    atomic_fetch_add(&f->e->m.rejected, 1);
}

/* Whether two peers are the same client address (ports aside). */
static int s_same_host(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return 0;
    if (a->ss_family == AF_INET)
        return !memcmp(&((const struct sockaddr_in *)a)->sin_addr, &((const struct sockaddr_in *)b)->sin_addr,
                       sizeof(struct in_addr));
    if (a->ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                       &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr));
    return 0;
}

/* Connections from sa's address waiting here (libmicrohttpd applies
 * per_ip_limit only to those it holds). */
static int s_waiting_from(const edge_front *f, const struct sockaddr_storage *sa) {
    int k = 0;
    for (int i = 0; i < f->n; i++) k += s_same_host(&f->p[i].sa, sa);
    return k;
}

/* Looks at a waiting connection: 1 when it left the waiting set. */
static int s_look(edge_front *f, int i, double now) {
    s_pend *p = &f->p[i];
    char *buf = f->peek;
    ssize_t k = recv(p->fd, buf, f->peek_len, MSG_PEEK | MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        close(p->fd); /* gone before saying anything */
        s_drop(f, i);
        return 1;
    }
    size_t n = k > 0 ? (size_t)k : 0;
    const char *eoh = NULL;
    size_t j0 = 0; /* empty lines before the request line are not its end */
    while (j0 < n && (buf[j0] == '\r' || buf[j0] == '\n')) j0++;
    for (size_t j = j0; j + 3 < n && !eoh; j++)
        if (!memcmp(buf + j, "\r\n\r\n", 4)) eoh = buf + j + 4;
    for (size_t j = j0; j + 1 < n && !eoh; j++)
        if (!memcmp(buf + j, "\n\n", 2)) eoh = buf + j + 2;
    if (eoh) {
        char code[40], msg[256];
        int st = edge_front_check_head(buf, (size_t)(eoh - buf), edge_limits_now(f->e).max_body, code,
                                       sizeof code, msg, sizeof msg);
        if (st) {
            s_refuse(f, p->fd, (size_t)(eoh - buf), st, code, msg);
            s_drop(f, i);
            return 1;
        }
    }
    if (!eoh && n == f->peek_len) {
        /* longer than a head may be: answered here, as JSON */
        char msg[128];
        snprintf(msg, sizeof msg, "the request head exceeds %zu bytes", f->peek_len);
        s_refuse(f, p->fd, n, 431, "request_header_too_large", msg);
        s_drop(f, i);
        return 1;
    }
    if (eoh || now >= p->deadline) {
        /* A good head, or a slow client: libmicrohttpd's (it closes the
         * socket itself on failure). */
        (void)MHD_add_connection(f->e->httpd, p->fd, (const struct sockaddr *)&p->sa, p->sl);
        s_drop(f, i);
        return 1;
    }
    /* Part of a head and nothing new since the last look: its socket stays
     * readable, so it is looked at again after S_RECHECK_MS rather than
     * polled (which would return at once, again and again). A connection
     * with nothing yet is polled: its first bytes wake us at once (it was
     * left for S_RECHECK_MS, 10 ms on a request whose bytes came just
     * after its connection). */
    p->stalled = n > 0 && n == p->seen;
    p->seen = n;
    return 0;
}

static void *s_main(void *arg) {
    edge_front *f = arg;
    struct pollfd *pf = NULL;
    int *idx = NULL;
    for (;;) {
        int limit = f->e->conf.conn_limit > 0 ? f->e->conf.conn_limit : 1;
        struct pollfd *npf = realloc(pf, (size_t)(f->n + 2) * sizeof *pf);
        int *nidx = realloc(idx, (size_t)(f->n + 2) * sizeof *idx);
        if (npf) pf = npf;
        if (nidx) idx = nidx;
        if (!npf || !nidx) break;
        int np = 0, timeout = 1000;
        pf[np++] = (struct pollfd){f->wake[0], POLLIN, 0};
        pf[np++] = (struct pollfd){f->lfd, POLLIN, 0};
        double now = edge_now();
        for (int i = 0; i < f->n; i++) {
            int ms = (int)((f->p[i].deadline - now) * 1000) + 1;
            if (f->p[i].stalled && ms > S_RECHECK_MS) ms = S_RECHECK_MS;
            if (ms < timeout) timeout = ms < 0 ? 0 : ms;
            if (f->p[i].stalled) continue;
            idx[np] = i;
            pf[np++] = (struct pollfd){f->p[i].fd, POLLIN, 0};
        }
        if (poll(pf, (nfds_t)np, timeout) < 0 && errno != EINTR) break;
        if (pf[0].revents) break;
        now = edge_now();
        /* Newest first, so that indices of the poll set stay valid while
         * entries are removed (removal moves the last entry). */
        for (int i = f->n - 1; i >= 0; i--) {
            int ready = f->p[i].stalled || now >= f->p[i].deadline;
            for (int q = 2; q < np && !ready; q++) ready = idx[q] == i && pf[q].revents;
            if (ready) (void)s_look(f, i, now);
        }
        /* Take every connection waiting; over the limit, one is closed at
         * once (as libmicrohttpd does), so that its client learns it now. */
        while (pf[1].revents & POLLIN) {
            struct sockaddr_storage sa;
            socklen_t sl = sizeof sa;
            int fd = accept4(f->lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC);
            if (fd < 0) break;
            const union MHD_DaemonInfo *di =
                MHD_get_daemon_info(f->e->httpd, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
            if (f->n + (di ? (int)di->num_connections : 0) >= limit ||
                (f->e->conf.per_ip_limit > 0 && s_waiting_from(f, &sa) >= f->e->conf.per_ip_limit)) {
                /* full, or this address holds its share of the waiting
                 * places (one client must not crowd the others out) */
                close(fd);
                continue;
            }
            if (f->n == f->cap) {
                int cap = f->cap ? 2 * f->cap : 16;
                s_pend *p = realloc(f->p, (size_t)cap * sizeof *p);
                if (!p) {
                    close(fd);
                    continue;
                }
                f->p = p;
                f->cap = cap;
            }
            s_pend *p = &f->p[f->n++];
            memset(p, 0, sizeof *p);
            p->fd = fd;
            p->sa = sa;
            p->sl = sl;
            p->deadline = now + (f->e->conf.conn_timeout_s > 0 ? f->e->conf.conn_timeout_s : 10);
            /* Most clients send their head with the connection: look now. */
            (void)s_look(f, f->n - 1, now);
        }
    }
    free(pf);
    free(idx);
    return NULL;
}

edge_front *edge_front_start(fi_edge *e, const struct sockaddr_in *sa, int *port, char *err,
                             size_t errlen) {
    edge_front *f = calloc(1, sizeof *f);
    if (!f) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    f->e = e;
    f->peek_len = (size_t)e->conf.conn_memory / 2 > S_PEEK_MIN ? (size_t)e->conf.conn_memory / 2 : S_PEEK_MIN;
    if (f->peek_len > S_RCVBUF / 2) f->peek_len = S_RCVBUF / 2; /* what the kernel holds for us to see */
    if (!(f->peek = malloc(f->peek_len))) {
        free(f);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    f->wake[0] = f->wake[1] = -1;
    /* A bounded receive buffer (inherited by accepted sockets; set before
     * listen so that the window is negotiated with it): a client cannot
     * park megabytes in the kernel for us, and one that streams a body we
     * refuse learns it after S_RCVBUF bytes, not after the kernel's
     * autotuned tens of MiB. */
    int one = 1, rcvbuf = S_RCVBUF;
    f->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_in bound;
    socklen_t bl = sizeof bound;
    if (f->lfd < 0 || setsockopt(f->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        setsockopt(f->lfd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf) != 0 ||
        bind(f->lfd, (const struct sockaddr *)sa, sizeof *sa) != 0 || listen(f->lfd, 128) != 0 ||
        getsockname(f->lfd, (struct sockaddr *)&bound, &bl) != 0) {
        char a[INET_ADDRSTRLEN] = "?";
        inet_ntop(AF_INET, &sa->sin_addr, a, sizeof a);
        snprintf(err, errlen, "cannot listen on %s:%d: %s", a, ntohs(sa->sin_port), strerror(errno));
        goto fail;
    }
    if (pipe2(f->wake, O_CLOEXEC) != 0 || pthread_create(&f->th, NULL, s_main, f) != 0) {
        snprintf(err, errlen, "cannot start the HTTP listener thread");
        goto fail;
    }
    *port = ntohs(bound.sin_port);
    return f;
fail:
    if (f->lfd >= 0) close(f->lfd);
    if (f->wake[0] >= 0) close(f->wake[0]);
    if (f->wake[1] >= 0) close(f->wake[1]);
    free(f->peek);
    free(f);
    return NULL;
}

void edge_front_stop(edge_front **fp) {
    edge_front *f = *fp;
    if (!f) return;
    *fp = NULL;
    if (write(f->wake[1], "x", 1) != 1) fprintf(stderr, "edge: http: cannot wake the listener\n");
    pthread_join(f->th, NULL);
    for (int i = 0; i < f->n; i++) close(f->p[i].fd);
    close(f->lfd);
    close(f->wake[0]);
    close(f->wake[1]);
    free(f->p);
    free(f->peek);
    free(f);
}
