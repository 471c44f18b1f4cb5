/*
 * fuzz_http_head.c - libFuzzer target for the edge's check of a request
 * head (edge/edge_head.c), which reads bytes straight from the network
 * before libmicrohttpd does: any bytes must be judged (0, 400, 413, 431,
 * 501 or 505 with a code and a message), never read past the
 * buffer, crash or hang. Also fi_text_clean, which makes a client's
 * bytes quoted in an error valid UTF-8: its output must be, and as long.
 *
 *   fuzz_http_head -max_total_time=10
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "edge_impl.h"
#include "fi_audit.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char code[40] = "", msg[256] = "";
    int st = edge_front_check_head((const char *)data, size, 1 << 20, code, sizeof code, msg,
                                   sizeof msg);
    if (st != 0 && st != 400 && st != 413 && st != 431 && st != 501 && st != 505) abort();
    if (st && (!code[0] || !msg[0])) abort();
    if (strlen(msg) >= sizeof msg || strlen(code) >= sizeof code) abort();
    char *t = malloc(size + 1);
    if (!t) return 0;
    memcpy(t, data, size);
    t[size] = 0;
    size_t n = strlen(t);
    fi_text_clean(t);
    if (strlen(t) != n) abort();
    for (size_t i = 0; i < n;) { /* every sequence well formed */
        unsigned char c = (unsigned char)t[i];
        size_t k = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (!k || i + k > n || c == 0xC0 || c == 0xC1 || c > 0xF4) abort();
        for (size_t j = 1; j < k; j++)
            if (((unsigned char)t[i + j] & 0xC0) != 0x80) abort();
        i += k;
    }
    free(t);
    return 0;
}
