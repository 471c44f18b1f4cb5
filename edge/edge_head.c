/*
 * edge_head.c - the check of a request head (its request line, header
 * lines, Content-Length and Transfer-Encoding),
 * made by the HTTP listener (edge_front.c) before libmicrohttpd reads the
 * request. On its own (no I/O, no state) so that it can be fuzzed
 * (tests/edge/fuzz_http_head.c).
 */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "edge_impl.h"

static int s_fail(char *code, size_t clen, char *msg, size_t mlen, int status, const char *c,
                  const char *fmt, const char *a, int alen) {
    snprintf(code, clen, "%s", c);
    snprintf(msg, mlen, fmt, alen, a);
    return status;
}

/* Contract in edge_impl.h. */
int edge_front_check_head(const char *h, size_t n, long max_body, char *code, size_t clen, char *msg,
                          size_t mlen) {
    const char *end = h + n, *line = memchr(h, '\n', n);
    char first[32] = "";
    int have = 0, chunked = 0;
    /* bytes a head never holds: control characters other than tab and the
     * line ends (libmicrohttpd waits out its timeout on a NUL) */
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)h[i];
        if ((ch < 0x20 && ch != '\t' && ch != '\r' && ch != '\n') || ch == 0x7f) {
            snprintf(code, clen, "invalid_request");
            snprintf(msg, mlen, "the request head holds the control byte 0x%02x at offset %zu", ch, i);
            return 400;
        }
    }
    /* empty lines before the request line are ignored (RFC 9112 2.2) */
    while (n && (*h == '\r' || *h == '\n')) {
        h++;
        n--;
    }
    line = memchr(h, '\n', n);
    /* the request line: METHOD SP TARGET SP HTTP/1.x (a later minor
     * version is served as 1.1, RFC 9110 2.5) */
    {
        size_t ll = line ? (size_t)(line - h) : n;
        if (ll && h[ll - 1] == '\r') ll--;
        const char *sp = ll ? memchr(h, ' ', ll) : NULL;
        const char *sp2 = NULL;
        for (const char *q = h + ll; sp && q > sp + 1; q--)
            if (q[-1] == ' ') {
                sp2 = q - 1;
                break;
            }
        if (!sp || !sp2 || sp2 == sp)
            return s_fail(code, clen, msg, mlen, 400, "invalid_request",
                          "the request line '%.*s' is not METHOD TARGET VERSION", h, (int)(ll > 64 ? 64 : ll));
        const char *v = sp2 + 1;
        size_t vl = (size_t)(h + ll - v);
        if (vl != 8 || memcmp(v, "HTTP/1.", 7) || v[7] < '0' || v[7] > '9')
            return s_fail(code, clen, msg, mlen, 505, "http_version_not_supported",
                          "the version '%.*s' is not served here (HTTP/1.x is)", v, (int)(vl > 32 ? 32 : vl));
    }
    int lines = 0;
    while (line && line + 1 < end) {
        const char *s = line + 1;
        const char *e = memchr(s, '\n', (size_t)(end - s));
        if (!e) e = end;
        line = e < end ? e : NULL;
        size_t len = (size_t)(e - s);
        if (len && s[len - 1] == '\r') len--;
        if (len == 0) break; /* the blank line ends the head */
        if (++lines > EDGE_HEAD_MAX_LINES) {
            snprintf(code, clen, "request_header_too_large");
            snprintf(msg, mlen, "the request head has more than %d header lines", EDGE_HEAD_MAX_LINES);
            return 431;
        }
        if (*s == ' ' || *s == '\t')
            return s_fail(code, clen, msg, mlen, 400, "invalid_request",
                          "the header line '%.*s' continues the one before (obsolete line folding)", s,
                          (int)(len > 64 ? 64 : len));
        const char *colon = memchr(s, ':', len);
        if (!colon || colon == s)
            return s_fail(code, clen, msg, mlen, 400, "invalid_request",
                          "the header line '%.*s' has no name and colon", s, (int)(len > 64 ? 64 : len));
        if (colon[-1] == ' ' || colon[-1] == '\t') /* RFC 9112 5.1 */
            return s_fail(code, clen, msg, mlen, 400, "invalid_request",
                          "the header name in '%.*s' ends in whitespace before its colon", s,
                          (int)(len > 64 ? 64 : len));
        const char *v = colon + 1, *ve = s + len;
        while (v < ve && (*v == ' ' || *v == '\t')) v++;
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
        size_t vl = (size_t)(ve - v);
        if ((size_t)(colon - s) == 17 && !strncasecmp(s, "transfer-encoding", 17)) {
            if (vl == 0) {
                snprintf(code, clen, "invalid_request");
                snprintf(msg, mlen, "the Transfer-Encoding header is empty");
                return 400;
            }
            if (vl != 7 || strncasecmp(v, "chunked", 7))
                return s_fail(code, clen, msg, mlen, 501, "unsupported_transfer_encoding",
                              "the Transfer-Encoding '%.*s' is not served here (only chunked is)", v,
                              (int)(vl > 64 ? 64 : vl));
            chunked = 1;
            continue;
        }
        if ((size_t)(colon - s) != 14 || strncasecmp(s, "content-length", 14)) continue;
        int digits = vl > 0;
        for (size_t i = 0; i < vl; i++) digits &= v[i] >= '0' && v[i] <= '9';
        if (!digits) {
            snprintf(code, clen, "invalid_content_length");
            snprintf(msg, mlen, "the Content-Length header '%.*s' is not a number of bytes",
                     (int)(vl > 64 ? 64 : vl), v);
            return 400;
        }
        while (vl > 1 && *v == '0') v++, vl--;
        /* 2^64 - 1 has 20 digits: anything longer, or larger, does not fit. */
        if (vl > 20 || (vl == 20 && memcmp(v, "18446744073709551615", 20) > 0)) {
            snprintf(code, clen, "body_too_large");
            snprintf(msg, mlen, "the declared Content-Length of %.*s%s bytes is too large (this "
                     "agent takes bodies of at most %ld bytes)", (int)(vl > 40 ? 40 : vl), v,
                     vl > 40 ? "..." : "", max_body);
            return 413;
        }
        char val[32];
        snprintf(val, sizeof val, "%.*s", (int)vl, v);
        if (have && strcmp(val, first)) {
            snprintf(code, clen, "invalid_content_length");
            snprintf(msg, mlen, "the request has two Content-Length headers that differ (%s, %s)",
                     first, val);
            return 400;
        }
        have = 1;
        snprintf(first, sizeof first, "%s", val);
    }
    if (have && chunked) {
        snprintf(code, clen, "invalid_content_length");
        snprintf(msg, mlen, "the request has both Content-Length and Transfer-Encoding: chunked");
        return 400;
    }
    return 0;
}
