/*
 * fuzz_http_head.c - libFuzzer target for the edge's check of a request
 * head's Content-Length headers (edge/edge_head.c), which reads bytes
 * straight from the network before libmicrohttpd does: any bytes must be
 * judged (0, 400 or 413 with a code and a message), never read past the
 * buffer, crash or hang.
 *
 *   fuzz_http_head -max_total_time=10
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "edge_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char code[40] = "", msg[256] = "";
    int st = edge_front_check_head((const char *)data, size, 1 << 20, code, sizeof code, msg,
                                   sizeof msg);
    if (st != 0 && st != 400 && st != 413) abort();
    if (st && (!code[0] || !msg[0])) abort();
    if (strlen(msg) >= sizeof msg || strlen(code) >= sizeof code) abort();
    return 0;
}
