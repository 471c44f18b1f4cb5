/*
 * test_textstream.c - the text released during generation: whole UTF-8
 * characters only, stop strings held back and cut, flush at the end.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fi_textstream.h"

/* Pushes pieces one by one, collecting what is released; returns the
 * collected text (static buffer) and whether a stop matched. */
static const char *s_feed(const char *const *stop, int n_stop, const char *const *pieces, int n,
                          int *stopped) {
    static char out[1024];
    size_t o = 0, len;
    fi_textstream *ts = fi_textstream_new(stop, n_stop);
    assert_non_null(ts);
    *stopped = 0;
    for (int i = 0; i < n && !*stopped; i++) {
        int r = fi_textstream_push(ts, pieces[i], strlen(pieces[i]));
        assert_true(r >= 0);
        *stopped = r;
        const char *p = fi_textstream_take(ts, 0, &len);
        memcpy(out + o, p, len);
        o += len;
    }
    const char *p = fi_textstream_take(ts, 1, &len);
    memcpy(out + o, p, len);
    o += len;
    out[o] = 0;
    fi_textstream_destroy(&ts);
    assert_null(ts);
    return out;
}

static void test_plain(void **state) {
    (void)state;
    const char *pieces[] = {"Hello", ",", " world"};
    int stopped;
    assert_string_equal(s_feed(NULL, 0, pieces, 3, &stopped), "Hello, world");
    assert_int_equal(stopped, 0);
}

static void test_stop_across_pieces(void **state) {
    (void)state;
    const char *stop[] = {"END"};
    const char *pieces[] = {"abc E", "N", "D more"};
    int stopped;
    assert_string_equal(s_feed(stop, 1, pieces, 3, &stopped), "abc ");
    assert_int_equal(stopped, 1);
}

static void test_false_start_released(void **state) {
    (void)state;
    /* "EN" looked like the start of "END" but was not: it must come out */
    const char *stop[] = {"END"};
    const char *pieces[] = {"x E", "N", "X y"};
    int stopped;
    assert_string_equal(s_feed(stop, 1, pieces, 3, &stopped), "x ENX y");
    assert_int_equal(stopped, 0);
}

static void test_earliest_of_several_stops(void **state) {
    (void)state;
    const char *stop[] = {"world", "lo, w"};
    const char *pieces[] = {"Hello, world"};
    int stopped;
    assert_string_equal(s_feed(stop, 2, pieces, 1, &stopped), "Hel");
    assert_int_equal(stopped, 1);
}

static void test_utf8_held_until_complete(void **state) {
    (void)state;
    fi_textstream *ts = fi_textstream_new(NULL, 0);
    size_t len;
    /* "é" is C3 A9, "日" is E6 97 A5: pushed byte by byte */
    assert_int_equal(fi_textstream_push(ts, "a\xC3", 2), 0);
    const char *p = fi_textstream_take(ts, 0, &len);
    assert_int_equal(len, 1);
    assert_memory_equal(p, "a", 1);
    assert_int_equal(fi_textstream_push(ts, "\xA9\xE6\x97", 3), 0);
    p = fi_textstream_take(ts, 0, &len);
    assert_int_equal(len, 2);
    assert_memory_equal(p, "\xC3\xA9", 2);
    assert_int_equal(fi_textstream_push(ts, "\xA5", 1), 0);
    p = fi_textstream_take(ts, 0, &len);
    assert_int_equal(len, 3);
    assert_memory_equal(p, "\xE6\x97\xA5", 3);
    /* a sequence cut short is not held forever: flush releases U+FFFD */
    assert_int_equal(fi_textstream_push(ts, "\xF0", 1), 0);
    fi_textstream_take(ts, 0, &len);
    assert_int_equal(len, 0);
    p = fi_textstream_take(ts, 1, &len);
    assert_int_equal(len, 3);
    assert_memory_equal(p, "\xEF\xBF\xBD", 3);
    fi_textstream_destroy(&ts);
}

/* Malformed bytes never reach the caller (clients put the text in JSON):
 * each becomes U+FFFD; well-formed sequences around them are kept. */
static void test_utf8_malformed_replaced(void **state) {
    (void)state;
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"a\x80" "b", "a\xEF\xBF\xBD" "b"},                     /* lone continuation */
        {"\xC0\xAFx", "\xEF\xBF\xBD\xEF\xBF\xBDx"},             /* overlong */
        {"\xED\xA0\x80!", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD!"}, /* a surrogate */
        {"\xF4\x90\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* > U+10FFFF */
        {"\xC3\xA9\xC3(", "\xC3\xA9\xEF\xBF\xBD("},             /* cut by ASCII */
        {"\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"},                /* a valid emoji */
        /* one U+FFFD per maximal subpart (as Python's "replace" decoder):
         * a sequence cut short by the end is one, not one per byte */
        {"a\xE2\x82", "a\xEF\xBF\xBD"},
        {"\xF0\x9F\x98", "\xEF\xBF\xBD"},
        {"\xF0\x9F(", "\xEF\xBF\xBD("},
        {"\xE0\x80x", "\xEF\xBF\xBD\xEF\xBF\xBDx"},            /* E0 needs A0..BF next */
        {"\xF5\x80", "\xEF\xBF\xBD\xEF\xBF\xBD"},              /* F5 begins nothing */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fi_textstream *ts = fi_textstream_new(NULL, 0);
        assert_int_equal(fi_textstream_push(ts, cases[i].in, strlen(cases[i].in)), 0);
        char got[64];
        size_t n = 0, len;
        const char *p = fi_textstream_take(ts, 0, &len);
        memcpy(got, p, len);
        n = len;
        p = fi_textstream_take(ts, 1, &len);
        memcpy(got + n, p, len);
        n += len;
        if (n != strlen(cases[i].out) || memcmp(got, cases[i].out, n))
            fail_msg("case %zu: %zu bytes out, want %zu", i, n, strlen(cases[i].out));
        fi_textstream_destroy(&ts);
    }
}

/* A byte that begins no sequence (F5..FF) is not held back waiting for
 * the rest of one: it is released (as U+FFFD) with the text at once. */
static void test_invalid_lead_not_held(void **state) {
    (void)state;
    fi_textstream *ts = fi_textstream_new(NULL, 0);
    size_t len;
    assert_int_equal(fi_textstream_push(ts, "ok\xF8", 3), 0);
    const char *p = fi_textstream_take(ts, 0, &len);
    assert_int_equal(len, 5);
    assert_memory_equal(p, "ok\xEF\xBF\xBD", 5);
    fi_textstream_destroy(&ts);
}

/* A stop string begun in the text and ended in a control token's piece
 * (which is not text) stops there; its first part is not released. */
static void test_stop_ends_in_control_piece(void **state) {
    (void)state;
    const char *stop[] = {"\n<|im_start|>"};
    fi_textstream *ts = fi_textstream_new(stop, 1);
    size_t len;
    assert_int_equal(fi_textstream_push(ts, "Done.\n", 6), 0);
    const char *p = fi_textstream_take(ts, 0, &len);
    assert_int_equal(len, 5); /* "\n" may begin the stop: held */
    assert_memory_equal(p, "Done.", 5);
    assert_int_equal(fi_textstream_mark(ts, "<|im_start|>", 12), 1);
    p = fi_textstream_take(ts, 1, &len);
    assert_int_equal(len, 0); /* the "\n" was the stop's */
    fi_textstream_destroy(&ts);
    /* a piece that only ends something else does not stop */
    ts = fi_textstream_new(stop, 1);
    assert_int_equal(fi_textstream_push(ts, "Done.", 5), 0);
    assert_int_equal(fi_textstream_mark(ts, "<|im_start|>", 12), 0);
    p = fi_textstream_take(ts, 1, &len);
    assert_int_equal(len, 5);
    fi_textstream_destroy(&ts);
}

static void test_stop_at_start_and_empty_stops(void **state) {
    (void)state;
    const char *stop[] = {"", "<|"};
    const char *pieces[] = {"<|im_end|>"};
    int stopped;
    assert_string_equal(s_feed(stop, 2, pieces, 1, &stopped), "");
    assert_int_equal(stopped, 1);
}

static void test_long_stream(void **state) {
    (void)state;
    /* many pieces: the buffer compacts and the output is exact */
    const char *stop[] = {"STOP"};
    fi_textstream *ts = fi_textstream_new(stop, 1);
    size_t total = 0, len;
    for (int i = 0; i < 10000; i++) {
        assert_int_equal(fi_textstream_push(ts, "abcdefgh", 8), 0);
        fi_textstream_take(ts, 0, &len);
        total += len;
    }
    assert_int_equal(fi_textstream_push(ts, "xxSTOPyy", 8), 1);
    fi_textstream_take(ts, 1, &len);
    total += len;
    assert_int_equal(total, 80000 + 2);
    fi_textstream_destroy(&ts);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain),
        cmocka_unit_test(test_stop_across_pieces),
        cmocka_unit_test(test_false_start_released),
        cmocka_unit_test(test_earliest_of_several_stops),
        cmocka_unit_test(test_utf8_held_until_complete),
        cmocka_unit_test(test_utf8_malformed_replaced),
        cmocka_unit_test(test_invalid_lead_not_held),
        cmocka_unit_test(test_stop_ends_in_control_piece),
        cmocka_unit_test(test_stop_at_start_and_empty_stops),
        cmocka_unit_test(test_long_stream),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
