/*
 * edge_head.c - the check of a request head's Content-Length headers,
 * made by the HTTP listener (edge_front.c) before libmicrohttpd reads the
 * request. On its own (no I/O, no state) so that it can be fuzzed
 * (tests/edge/fuzz_http_head.c).
 */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "edge_impl.h"

/* Contract in edge_impl.h. */
int edge_front_check_head(const char *h, size_t n, long max_body, char *code, size_t clen, char *msg,
                          size_t mlen) {
    const char *end = h + n, *line = memchr(h, '\n', n);
    char first[32] = "";
    int have = 0;
    while (line && line + 1 < end) {
        const char *s = line + 1;
        const char *e = memchr(s, '\n', (size_t)(end - s));
        if (!e) e = end;
        line = e < end ? e : NULL;
        size_t len = (size_t)(e - s);
        if (len && s[len - 1] == '\r') len--;
        if (len == 0) break; /* the blank line ends the head */
        const char *colon = memchr(s, ':', len);
        if (!colon || (size_t)(colon - s) != 14 || strncasecmp(s, "content-length", 14)) continue;
        const char *v = colon + 1, *ve = s + len;
        while (v < ve && (*v == ' ' || *v == '\t')) v++;
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
        size_t vl = (size_t)(ve - v);
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
    return 0;
}


