/*
 * fuzz_gguf.c - libFuzzer target for the GGUF reader.
 *
 * Each input is opened with fi_gguf_open_memory. A refused input must come
 * with a message; an accepted one is walked completely (every kv rendered
 * and looked up, every string of every string array and the first and last
 * byte of every tensor read, every tensor looked up by name) so that the
 * sanitizers see any pointer the reader hands out that is not inside the
 * input. Built by tests/gguf.cmake with clang only.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "fi_gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile unsigned s_sink; /* keeps the reads below from being optimised out */

static void s_cstr(fi_str s, char *buf, size_t cap)
{
    size_t n = s.len < cap - 1 ? (size_t)s.len : cap - 1;
    memcpy(buf, s.ptr, n);
    buf[n] = '\0';
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512], buf[256];
    err[0] = '\0';
    fi_gguf *g = fi_gguf_open_memory(data, size, "fuzz.gguf", err, sizeof err);
    if (!g) {
        if (strncmp(err, "fuzz.gguf: ", 11) != 0 || !strstr(err, "byte offset"))
            __builtin_trap(); /* every refusal says what and where */
        return 0;
    }
    unsigned sum = 0;
    for (int64_t i = 0; i < fi_gguf_n_kv(g); i++) {
        const fi_gguf_kv *kv = fi_gguf_kv_at(g, i);
        fi_gguf_kv_format(kv, buf, sizeof buf);
        sum += (unsigned)strlen(buf);
        s_cstr(kv->key, buf, sizeof buf);
        if (kv->key.len < sizeof buf && fi_gguf_find(g, buf) != kv)
            __builtin_trap(); /* keys are unique and NUL-free */
        uint32_t u;
        int64_t v;
        float f;
        int b;
        fi_str s;
        sum += (unsigned)fi_gguf_get_u32(g, buf, &u) + (unsigned)fi_gguf_get_i64(g, buf, &v) +
               (unsigned)fi_gguf_get_f32(g, buf, &f) + (unsigned)fi_gguf_get_bool(g, buf, &b);
        if (fi_gguf_get_str(g, buf, &s) == 0 && s.len)
            sum += (unsigned char)s.ptr[s.len - 1];
        for (uint64_t k = 0; kv->strs && k < kv->arr_len; k++)
            if (kv->strs[k].len)
                sum += (unsigned char)kv->strs[k].ptr[0] + (unsigned char)kv->strs[k].ptr[kv->strs[k].len - 1];
    }
    for (int64_t i = 0; i < fi_gguf_n_tensors(g); i++) {
        const fi_gguf_tensor *t = fi_gguf_tensor_at(g, i);
        const uint8_t *d = t->data;
        if (t->n_bytes == 0 || d < data || d + t->n_bytes > data + size)
            __builtin_trap();
        sum += d[0] + d[t->n_bytes - 1];
        s_cstr(t->name, buf, sizeof buf);
        if (t->name.len < sizeof buf && fi_gguf_find_tensor(g, buf) != t)
            __builtin_trap();
    }
    s_sink = sum;
    fi_gguf_close(&g);
    return 0;
}
