/*
 * fuzz_wire.c - libFuzzer target for the fabric's wire decoder
 * (fi_wire_decode): any bytes must decode or be refused with an error
 * code, never crash, leak or hang; what decodes must encode again and
 * decode to the same bytes.
 *
 *   fuzz_wire_seeds CORPUS && fuzz_wire -max_total_time=20 CORPUS
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fi_wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    Fi__ErrorCode code = FI__ERROR_CODE__ERR_UNSPECIFIED;
    char err[256];
    fi_msg *m = fi_wire_decode(data, size, 0, &code, err, sizeof err);
    if (!m) {
        if (code == FI__ERROR_CODE__ERR_UNSPECIFIED || !err[0]) abort();
        return 0;
    }
    (void)fi_wire_type_name(m->body_case);
    size_t len1 = 0, len2 = 0;
    uint8_t *b1 = fi_wire_encode(m, &len1);
    fi_wire_free(&m);
    if (!b1) return 0; /* larger than the limit after re-encoding: refused, fine */
    m = fi_wire_decode(b1, len1, 0, &code, err, sizeof err);
    if (!m) abort(); /* what we encode we must decode */
    uint8_t *b2 = fi_wire_encode(m, &len2);
    if (!b2 || len1 != len2 || memcmp(b1, b2, len1)) abort();
    free(b1);
    free(b2);
    fi_wire_free(&m);
    return 0;
}
