/*
 * harness_edge.h - an edge agent on the test harness's coordinator
 * (tests/fabric/harness.h): its key enrolled, the coordinator's public key
 * and a signed policy bundle on disk, a config written and loaded, the
 * agent started in this process. For the tests that link the edge
 * (test_edge_fabric.c, test_edge_route.c).
 */
#ifndef FI_TEST_FABRIC_HARNESS_EDGE_H
#define FI_TEST_FABRIC_HARNESS_EDGE_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>

#include "harness.h"
#include "fi_bundle.h"
#include "fi_edge.h"

/* An HTTP answer: status, head, body (truncated to the buffers). */
typedef struct resp {
    int status;
    char head[2048];
    char body[8192];
} resp;

/* Sends raw bytes (a request head and body; split: in two sends 50 ms
 * apart at that offset, 0: at once) and reads the answer. */
H_FN int http_raw_split(int port, const char *req, size_t split, resp *r) {
    memset(r, 0, sizeof *r);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) return -1;
    size_t n = strlen(req), a = split && split < n ? split : n;
    if (send(fd, req, a, 0) != (ssize_t)a) return -1;
    if (a < n) {
        h_sleep_ms(50);
        if (send(fd, req + a, n - a, 0) != (ssize_t)(n - a)) return -1;
    }
    char buf[16384];
    size_t len = 0;
    for (;;) {
        ssize_t k = recv(fd, buf + len, sizeof buf - len - 1, 0);
        if (k <= 0) break;
        len += (size_t)k;
    }
    close(fd);
    buf[len] = 0;
    char *sep = strstr(buf, "\r\n\r\n");
    if (!sep) return -1;
    snprintf(r->head, sizeof r->head, "%.*s", (int)(sep - buf), buf);
    snprintf(r->body, sizeof r->body, "%s", sep + 4);
    sscanf(buf, "HTTP/1.%*d %d", &r->status);
    return 0;
}

/* POSTs body to /v1/completions on loopback (hdr: extra header lines,
 * each ending in CRLF, or NULL) and reads the whole answer. 0, or -1. */
H_FN int http_post(int port, const char *hdr, const char *body, resp *r) {
    char req[4096];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.0\r\nContent-Length: %zu\r\n%s\r\n%s",
                     strlen(body), hdr ? hdr : "", body);
    if (n < 0 || (size_t)n >= sizeof req) return -1;
    return http_raw_split(port, req, 0, r);
}

/* Enrols a fresh edge key as site/region, saves it and the coordinator's
 * key under h->dir, and installs `policy` signed as version 1 with a new
 * signing key (public key in pk, secret in sk, and h->dir/sign.key{,.pub}).
 * Then writes h->dir/edge.conf: the fabric and policy keys, followed by
 * `extra` (more "key = value" lines), and starts the agent. Fails the test
 * on any error. */
H_FN fi_edge *h_edge_start(harness *h, const char *site, const char *region, const char *policy,
                           uint8_t pk[32], uint8_t sk[64], const char *extra) {
    char err[768], path[512], ekey[400], epub[400], ckey[400], cpub[400];
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, site, region), 0);
    snprintf(ekey, sizeof ekey, "%s/edge.key", h->dir);
    snprintf(epub, sizeof epub, "%s/edge.pub", h->dir);
    snprintf(ckey, sizeof ckey, "%s/coord.key", h->dir);
    snprintf(cpub, sizeof cpub, "%s/coord.pub", h->dir);
    assert_int_equal(fi_keys_save(&ek, ekey, epub, 1, err, sizeof err), 0);
    assert_int_equal(fi_keys_save(&h->coord, ckey, cpub, 1, err, sizeof err), 0);
    assert_int_equal(fi_bundle_keygen(pk, sk), 0);
    snprintf(path, sizeof path, "%s/sign.key", h->dir);
    assert_int_equal(fi_bundle_key_save(path, sk, err, sizeof err), 0);
    snprintf(path, sizeof path, "%s/policy", h->dir);
    mkdir(path, 0700);
    char *b;
    size_t bl;
    int64_t now = (int64_t)time(NULL);
    assert_int_equal(fi_bundle_sign(sk, 1, now - 60, now + 3600, policy, strlen(policy), &b, &bl), 0);
    assert_int_equal(fi_bundle_install(path, b, bl, (const uint8_t(*)[32])pk, 1, now, err, sizeof err),
                     FI_BUNDLE_OK);
    free(b);
    char conf[400];
    snprintf(conf, sizeof conf, "%s/edge.conf", h->dir);
    FILE *fc = fopen(conf, "w");
    assert_non_null(fc);
    fprintf(fc,
            "site = %s\nport = 0\ndb = %s/edge.db\npolicy_dir = %s/policy\n"
            "policy_key = %s/sign.key.pub\ncoordinator = %s\ncoordinator_key = %s\n"
            "secret_key = %s\nshutdown_grace_s = 1\nheartbeat_ms = %d\n%s",
            site, h->dir, h->dir, h->dir, h->ep, cpub, ekey, h->edge_hb_ms ? h->edge_hb_ms : H_HB_MS,
            extra ? extra : "");
    fclose(fc);
    fi_edge_conf c;
    fi_edge_conf_default(&c);
    if (fi_edge_conf_load(conf, &c, err, sizeof err) != 0) fail_msg("%s", err);
    fi_edge *e = fi_edge_new(&c, err, sizeof err);
    if (!e) fail_msg("%s", err);
    return e;
}

#endif /* FI_TEST_FABRIC_HARNESS_EDGE_H */
