/*
 * textstream.c - see fi_textstream.h.
 *
 * The buffer holds text not yet released. After each push we look for a
 * complete stop string; if none, we hold back the longest suffix that is a
 * prefix of some stop string and any incomplete UTF-8 sequence at the end.
 * A stop string therefore always starts inside the buffer.
 *
 * What is released is valid UTF-8 (clients put it in JSON): a byte that
 * does not begin a well-formed sequence (RFC 3629: no overlong forms, no
 * surrogates, nothing above U+10FFFF), or a sequence cut short at the end
 * of generation, is released as U+FFFD, as a decoder with "replace" does:
 * one for each maximal subpart of an ill-formed sequence (a lead byte and
 * the continuation bytes that fit it so far), as Unicode recommends and
 * Python's and browsers' decoders do.
 */
#include <stdlib.h>
#include <string.h>

#include "fi_textstream.h"

struct fi_textstream {
    char **stop;      /* stop strings */
    size_t *stop_len; /* their lengths */
    int n_stop;
    char *buf;        /* held text */
    size_t len;       /* bytes in buf */
    size_t cap;       /* allocated */
    size_t out;       /* bytes at the front already taken */
    size_t stop_at;   /* offset of a matched stop, or SIZE_MAX */
    char *rel;        /* released text, made valid UTF-8 */
    size_t rel_cap;
};

fi_textstream *fi_textstream_new(const char *const *stop, int n_stop) {
    fi_textstream *ts = calloc(1, sizeof *ts);
    if (!ts) return NULL;
    ts->stop_at = (size_t)-1;
    if (n_stop > 0) {
        ts->stop = calloc((size_t)n_stop, sizeof *ts->stop);
        ts->stop_len = calloc((size_t)n_stop, sizeof *ts->stop_len);
        if (!ts->stop || !ts->stop_len) goto fail;
        for (int i = 0; i < n_stop; i++) {
            if (!stop[i] || !stop[i][0]) continue;
            ts->stop[ts->n_stop] = strdup(stop[i]);
            if (!ts->stop[ts->n_stop]) goto fail;
            ts->stop_len[ts->n_stop++] = strlen(stop[i]);
        }
    }
    return ts;
fail:
    fi_textstream_destroy(&ts);
    return NULL;
}

void fi_textstream_reset(fi_textstream *ts) {
    ts->len = 0;
    ts->out = 0;
    ts->stop_at = (size_t)-1;
}

void fi_textstream_destroy(fi_textstream **tsp) {
    if (!tsp || !*tsp) return;
    fi_textstream *ts = *tsp;
    for (int i = 0; i < ts->n_stop; i++) free(ts->stop[i]);
    free(ts->stop);
    free(ts->stop_len);
    free(ts->buf);
    free(ts->rel);
    free(ts);
    *tsp = NULL;
}

/* Earliest complete stop string at or after `from`; SIZE_MAX if none. */
static size_t s_find_stop(const fi_textstream *ts, size_t from) {
    size_t best = (size_t)-1;
    for (int i = 0; i < ts->n_stop; i++) {
        size_t L = ts->stop_len[i];
        if (ts->len - from < L) continue;
        for (size_t p = from; p + L <= ts->len && p < best; p++)
            if (!memcmp(ts->buf + p, ts->stop[i], L)) {
                best = p;
                break;
            }
    }
    return best;
}

int fi_textstream_push(fi_textstream *ts, const char *bytes, size_t len) {
    if (ts->stop_at != (size_t)-1) return 1;
    if (ts->out > 0) { /* drop what was taken, so the buffer stays small */
        memmove(ts->buf, ts->buf + ts->out, ts->len - ts->out);
        ts->len -= ts->out;
        ts->out = 0;
    }
    if (ts->len + len + 1 > ts->cap) {
        size_t cap = ts->cap ? ts->cap : 256;
        while (cap < ts->len + len + 1) cap *= 2;
        char *nb = realloc(ts->buf, cap);
        if (!nb) return -1;
        ts->buf = nb;
        ts->cap = cap;
    }
    memcpy(ts->buf + ts->len, bytes, len);
    ts->len += len;
    ts->stop_at = s_find_stop(ts, ts->out);
    return ts->stop_at != (size_t)-1;
}

int fi_textstream_mark(fi_textstream *ts, const char *piece, size_t len) {
    if (ts->stop_at != (size_t)-1) return 1;
    size_t held = ts->len - ts->out;
    const char *tail = ts->buf ? ts->buf + ts->out : "";
    for (int i = 0; i < ts->n_stop; i++) {
        size_t L = ts->stop_len[i];
        /* begun in the held text (k of its bytes there), ended in piece:
         * the k bytes are the stop's, not the answer's */
        for (size_t k = L - 1; k >= 1; k--)
            if (k <= held && L - k <= len && !memcmp(tail + held - k, ts->stop[i], k) &&
                !memcmp(piece, ts->stop[i] + k, L - k)) {
                ts->stop_at = ts->len - k;
                return 1;
            }
        for (size_t p = 0; p + L <= len; p++)
            if (!memcmp(piece + p, ts->stop[i], L)) {
                ts->stop_at = ts->len; /* everything before is final */
                return 1;
            }
    }
    return 0;
}

/* Bytes at the end that must wait: an incomplete UTF-8 sequence, or a
 * suffix that could grow into a stop string. */
static size_t s_holdback(const fi_textstream *ts) {
    size_t avail = ts->len - ts->out, hold = 0;
    const unsigned char *b = (const unsigned char *)ts->buf + ts->out;
    /* incomplete UTF-8: look back at most 3 bytes for a lead byte */
    for (size_t i = 1; i <= 3 && i <= avail; i++) {
        unsigned char c = b[avail - i];
        if ((c & 0xC0) == 0x80) continue;           /* continuation byte */
        size_t need = c >= 0xF0 && c <= 0xF4   ? 4
                      : c >= 0xE0 && c <= 0xEF ? 3
                      : c >= 0xC2 && c <= 0xDF ? 2
                                               : 1; /* ASCII, or never a lead: not held */
        if (need > i) hold = i;                     /* sequence not finished */
        break;
    }
    for (int s = 0; s < ts->n_stop; s++) {
        size_t L = ts->stop_len[s];
        for (size_t k = L - 1; k > hold && k >= 1; k--) {
            if (k > avail) continue;
            if (!memcmp(b + avail - k, ts->stop[s], k)) {
                hold = k;
                break;
            }
        }
    }
    return hold;
}

/* The UTF-8 sequence at p (n bytes available): the bytes that fit a
 * well-formed sequence from p[0] on (at least 1: a byte that begins none
 * is a subpart of its own), and in *whole whether they are all of it. */
static size_t s_utf8_part(const unsigned char *p, size_t n, int *whole) {
    unsigned char c = p[0];
    *whole = 1;
    if (c < 0x80) return 1;
    size_t need = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    *whole = 0;
    if (!need) return 1;
    unsigned char lo = 0x80, hi = 0xBF; /* the second byte's range */
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED) hi = 0x9F;      /* no surrogates */
    else if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;      /* nothing above U+10FFFF */
    if (n < 2 || p[1] < lo || p[1] > hi) return 1;
    size_t i = 2;
    while (i < need && i < n && (p[i] & 0xC0) == 0x80) i++;
    *whole = i == need;
    return i;
}

const char *fi_textstream_take(fi_textstream *ts, int flush, size_t *len) {
    size_t end;
    if (ts->stop_at != (size_t)-1) end = ts->stop_at;
    else if (flush) end = ts->len;
    else end = ts->len - s_holdback(ts);
    *len = 0;
    if (!ts->buf || end <= ts->out) return "";
    size_t n = end - ts->out;
    if (3 * n > ts->rel_cap) { /* each byte becomes at most 3 (U+FFFD) */
        char *r = realloc(ts->rel, 3 * n);
        if (!r) return ""; /* nothing released now; the bytes wait */
        ts->rel = r;
        ts->rel_cap = 3 * n;
    }
    const unsigned char *b = (const unsigned char *)ts->buf + ts->out;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        int whole;
        size_t k = s_utf8_part(b + i, n - i, &whole);
        if (whole) {
            memcpy(ts->rel + o, b + i, k);
            o += k;
        } else { /* one U+FFFD for the maximal subpart */
            memcpy(ts->rel + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
        i += k;
    }
    ts->out = end;
    *len = o;
    return ts->rel;
}
