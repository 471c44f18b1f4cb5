/*
 * test_gguf.c - the GGUF reader: the real model's known facts, a synthetic
 * round trip of every metadata type, the test writer and quantisers, the
 * tiny Llama builder, a corpus of malformed files (each must fail with a
 * message that says what and where), and a bounded mutation loop.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

#include <cmocka.h>

#include "fi_gguf.h"
#include "gguf_writer.h"

#define ERRLEN 512

/* --- helpers ----------------------------------------------------------- */

static fi_gguf *s_open_buf(const uint8_t *buf, size_t len, char *err)
{
    return fi_gguf_open_memory(buf, len, "test.gguf", err, ERRLEN);
}

/* Serialises w, which must then open cleanly. Caller frees *buf. */
static fi_gguf *s_open_writer(fi_gw *w, uint8_t **buf, size_t *len)
{
    char err[ERRLEN];
    *buf = fi_gw_serialize(w, len, NULL);
    assert_non_null(*buf);
    fi_gguf *g = s_open_buf(*buf, *len, err);
    if (!g)
        fail_msg("unexpected open failure: %s", err);
    return g;
}

/* Asserts the open of buf fails and that the message holds every one of
 * the NULL-terminated words. */
static void s_expect_fail(const uint8_t *buf, size_t len, ...)
{
    char err[ERRLEN];
    va_list ap;
    fi_gguf *g = s_open_buf(buf, len, err);
    if (g) {
        fi_gguf_close(&g);
        fail_msg("open succeeded on a malformed file");
    }
    if (strncmp(err, "test.gguf: ", 11) != 0 || !strstr(err, " (at byte offset "))
        fail_msg("message lacks the file or the offset: %s", err);
    va_start(ap, len);
    for (const char *w = va_arg(ap, const char *); w; w = va_arg(ap, const char *))
        if (!strstr(err, w)) {
            va_end(ap);
            fail_msg("message lacks '%s': %s", w, err);
        }
    va_end(ap);
}

/* Serialises w and expects failure with the given words. Frees w. */
#define EXPECT_FAIL_W(w, ...)                                                                   \
    do {                                                                                        \
        size_t len_;                                                                            \
        uint8_t *buf_ = fi_gw_serialize((w), &len_, NULL);                                      \
        assert_non_null(buf_);                                                                  \
        s_expect_fail(buf_, len_, __VA_ARGS__, NULL);                                           \
        free(buf_);                                                                             \
        fi_gw_destroy(&(w));                                                                    \
    } while (0)

static void s_put32(uint8_t *p, uint32_t v)
{
    memcpy(p, &v, 4);
}

static void s_put64(uint8_t *p, uint64_t v)
{
    memcpy(p, &v, 8);
}

/* A small valid file: two kvs, two tensors. */
static fi_gw *s_small(void)
{
    fi_gw *w = fi_gw_new();
    assert_non_null(w);
    fi_gw_add_str(w, "general.architecture", "llama");
    fi_gw_add_u32(w, "llama.block_count", 2);
    const char *toks[] = {"a", "b", "c"};
    fi_gw_add_str_array(w, "tokenizer.ggml.tokens", toks, 3);
    int64_t ne1[1] = {8}, ne2[2] = {32, 2};
    float v[64];
    for (int i = 0; i < 64; i++)
        v[i] = (float)i / 8.0f - 4.0f;
    fi_gw_add_tensor_f32(w, "a.weight", FI_DTYPE_F32, 1, ne1, v);
    fi_gw_add_tensor_f32(w, "b.weight", FI_DTYPE_Q8_0, 2, ne2, v);
    return w;
}

/* --- the real model ------------------------------------------------------ */

static fi_gguf *s_model;

static int s_model_setup(void **state)
{
    char err[ERRLEN];
    s_model = NULL;
    if (access(FI_TEST_MODEL, R_OK) != 0)
        return 0;
    s_model = fi_gguf_open(FI_TEST_MODEL, err, sizeof err);
    if (!s_model) {
        print_error("%s\n", err);
        return -1;
    }
    *state = s_model;
    return 0;
}

static int s_model_teardown(void **state)
{
    fi_gguf_close(&s_model);
    return 0;
}

static void test_model_facts(void **state)
{
    fi_gguf *g = s_model;
    if (!g)
        skip();
    assert_int_equal(fi_gguf_version(g), 3);
    assert_int_equal(fi_gguf_n_tensors(g), 272);
    assert_int_equal(fi_gguf_n_kv(g), 33);
    assert_int_equal(fi_gguf_alignment(g), 32);
    assert_int_equal(fi_gguf_data_offset(g) % 32, 0);

    fi_str s;
    assert_int_equal(fi_gguf_get_str(g, "general.architecture", &s), 0);
    assert_true(fi_str_eq(s, "llama"));
    uint32_t u;
    assert_int_equal(fi_gguf_get_u32(g, "llama.block_count", &u), 0);
    assert_int_equal(u, 30);
    assert_int_equal(fi_gguf_get_u32(g, "llama.embedding_length", &u), 0);
    assert_int_equal(u, 576);
    assert_int_equal(fi_gguf_get_u32(g, "llama.attention.head_count_kv", &u), 0);
    assert_int_equal(u, 3);
    int64_t i64;
    assert_int_equal(fi_gguf_get_i64(g, "llama.feed_forward_length", &i64), 0);
    assert_int_equal(i64, 1536);
    float f;
    assert_int_equal(fi_gguf_get_f32(g, "llama.rope.freq_base", &f), 0);
    assert_true(f == 100000.0f);
    int b;
    assert_int_equal(fi_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b), 0);
    assert_int_equal(b, 0);
    /* Wrong-type requests fail. */
    assert_int_equal(fi_gguf_get_u32(g, "general.architecture", &u), -1);
    assert_int_equal(fi_gguf_get_str(g, "llama.block_count", &s), -1);
    assert_int_equal(fi_gguf_get_f32(g, "llama.block_count", &f), -1);
    assert_int_equal(fi_gguf_get_bool(g, "llama.block_count", &b), -1);
    assert_int_equal(fi_gguf_get_u32(g, "no.such.key", &u), -1);
    assert_null(fi_gguf_find(g, "no.such.key"));

    const fi_gguf_kv *kv = fi_gguf_find(g, "tokenizer.ggml.tokens");
    assert_non_null(kv);
    assert_int_equal(kv->type, FI_GGUF_ARRAY);
    assert_int_equal(kv->arr_type, FI_GGUF_STRING);
    assert_int_equal(kv->arr_len, 49152);
    assert_non_null(kv->strs);
    assert_true(fi_str_eq(kv->strs[0], "<|endoftext|>"));
    assert_true(fi_str_eq(kv->strs[1], "<|im_start|>"));
    assert_true(fi_str_eq(kv->strs[2], "<|im_end|>"));
    char buf[256];
    fi_gguf_kv_format(kv, buf, sizeof buf);
    assert_string_equal(buf,
                        "[49152 x string: \"<|endoftext|>\", \"<|im_start|>\", \"<|im_end|>\", ...]");
    fi_gguf_kv_format(fi_gguf_find(g, "llama.block_count"), buf, sizeof buf);
    assert_string_equal(buf, "30");
    kv = fi_gguf_find(g, "tokenizer.ggml.token_type");
    assert_non_null(kv);
    assert_int_equal(kv->arr_type, FI_GGUF_INT32);
    assert_null(kv->strs);

    const fi_gguf_tensor *t = fi_gguf_find_tensor(g, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, FI_DTYPE_Q8_0);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 576);
    assert_int_equal(t->ne[1], 49152);
    assert_int_equal(t->n_bytes, (uint64_t)576 / 32 * 34 * 49152);
    t = fi_gguf_find_tensor(g, "blk.0.attn_q.weight");
    assert_non_null(t);
    assert_int_equal(t->type, FI_DTYPE_Q4_1);
    assert_int_equal(t->n_bytes, 207360);
    t = fi_gguf_find_tensor(g, "output_norm.weight");
    assert_non_null(t);
    assert_int_equal(t->type, FI_DTYPE_F32);
    assert_null(fi_gguf_find_tensor(g, "output.weight")); /* tied embeddings */
    assert_null(fi_gguf_find_tensor(g, "blk.30.attn_q.weight"));

    /* Every tensor lies inside the file, found by its own name. */
    const uint8_t *lo = fi_gguf_tensor_at(g, 0)->data - fi_gguf_tensor_at(g, 0)->offset;
    for (int64_t i = 0; i < fi_gguf_n_tensors(g); i++) {
        t = fi_gguf_tensor_at(g, i);
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        assert_ptr_equal(fi_gguf_find_tensor(g, name), t);
        assert_ptr_equal((const uint8_t *)t->data, lo + t->offset);
        assert_true(fi_gguf_data_offset(g) + t->offset + t->n_bytes <= fi_gguf_file_size(g));
    }
    assert_null(fi_gguf_tensor_at(g, 272));
    assert_null(fi_gguf_tensor_at(g, -1));
    assert_null(fi_gguf_kv_at(g, 33));
}

static void test_open_missing(void **state)
{
    char err[ERRLEN];
    assert_null(fi_gguf_open("/nonexistent/x.gguf", err, sizeof err));
    assert_non_null(strstr(err, "/nonexistent/x.gguf"));
    assert_non_null(strstr(err, "cannot open"));
    assert_null(fi_gguf_open("/", err, sizeof err));
    assert_non_null(strstr(err, "not a regular file"));
    fi_gguf_close(NULL);
    fi_gguf *g = NULL;
    fi_gguf_close(&g);
}

/* Names from a file printed for people: no control bytes get through (a
 * crafted key could otherwise retitle or clear the terminal of `inspect`). */
static void test_name_format(void **state)
{
    (void)state;
    const char raw[] = "general.\x1b]0;pwned\a\x1b[2J";
    fi_str s = {raw, sizeof raw - 1};
    char out[64];
    fi_gguf_name_format(s, 200, out, sizeof out);
    for (const char *p = out; *p; p++)
        assert_true((unsigned char)*p >= 0x20 && *p != 0x7f);
    assert_string_equal(out, "general.?]0;pwned??[2J");
    fi_gguf_name_format(s, 4, out, sizeof out);
    assert_string_equal(out, "gene...");
}

/* --- synthetic round trip -------------------------------------------------- */

static void test_roundtrip_types(void **state)
{
    fi_gw *w = fi_gw_new();
    fi_gw_add_u8(w, "t.u8", 250);
    fi_gw_add_i8(w, "t.i8", -7);
    fi_gw_add_u16(w, "t.u16", 65000);
    fi_gw_add_i16(w, "t.i16", -30000);
    fi_gw_add_u32(w, "t.u32", 4000000000u);
    fi_gw_add_i32(w, "t.i32", -2000000000);
    fi_gw_add_f32(w, "t.f32", 1.5f);
    fi_gw_add_bool(w, "t.bool", 1);
    fi_gw_add_str(w, "t.str", "hello");
    fi_gw_add_u64(w, "t.u64", UINT64_MAX);
    fi_gw_add_i64(w, "t.i64", INT64_MIN);
    fi_gw_add_f64(w, "t.f64", 0.25);
    fi_gw_add_strn(w, "t.bin", "a\0\xff\xfe", 4); /* NUL and bad UTF-8 are fine in values */
    fi_gw_add_str(w, "t.empty", "");
    int16_t a16[3] = {-1, 2, -3};
    fi_gw_add_array(w, "t.arr_i16", FI_GGUF_INT16, a16, 3);
    float af[2] = {0.5f, -2.0f};
    fi_gw_add_array(w, "t.arr_f32", FI_GGUF_FLOAT32, af, 2);
    uint8_t ab[4] = {1, 0, 1, 1};
    fi_gw_add_array(w, "t.arr_bool", FI_GGUF_BOOL, ab, 4);
    double ad[1] = {3.0};
    fi_gw_add_array(w, "t.arr_f64", FI_GGUF_FLOAT64, ad, 1);
    fi_gw_add_array(w, "t.arr_empty", FI_GGUF_UINT64, NULL, 0);
    const char *strs[] = {"x", "", "zz\"q"};
    fi_gw_add_str_array(w, "t.arr_str", strs, 3);
    /* [[1, 2], []] as an array of uint8 arrays; and [["s"]] nested strings. */
    uint8_t nest[] = {9, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, /* ARRAY of 2 */
                      0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 2, /* uint8 x2 */
                      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};      /* uint8 x0 */
    fi_gw_add_raw(w, "t.nested", 8, FI_GGUF_ARRAY, nest, sizeof nest);
    uint8_t nest2[] = {9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                       1, 0, 0, 0, 0, 0, 0, 0, 's'};
    fi_gw_add_raw(w, "t.nested_str", 12, FI_GGUF_ARRAY, nest2, sizeof nest2);
    fi_gw_add_raw(w, "k\xff", 2, FI_GGUF_UINT8, nest2, 1);

    uint8_t *buf;
    size_t len;
    fi_gguf *g = s_open_writer(w, &buf, &len);
    assert_int_equal(fi_gguf_n_kv(g), 23);
    assert_int_equal(fi_gguf_n_tensors(g), 0);
    uint32_t u;
    int64_t i;
    float f;
    int b;
    fi_str s;
    assert_int_equal(fi_gguf_get_u32(g, "t.u8", &u), 0);
    assert_int_equal(u, 250);
    assert_int_equal(fi_gguf_get_i64(g, "t.i8", &i), 0);
    assert_int_equal(i, -7);
    assert_int_equal(fi_gguf_get_u32(g, "t.i8", &u), -1); /* negative */
    assert_int_equal(fi_gguf_get_u32(g, "t.u16", &u), 0);
    assert_int_equal(u, 65000);
    assert_int_equal(fi_gguf_get_i64(g, "t.i16", &i), 0);
    assert_int_equal(i, -30000);
    assert_int_equal(fi_gguf_get_u32(g, "t.u32", &u), 0);
    assert_int_equal(u, 4000000000u);
    assert_int_equal(fi_gguf_get_i64(g, "t.i32", &i), 0);
    assert_int_equal(i, -2000000000);
    assert_int_equal(fi_gguf_get_f32(g, "t.f32", &f), 0);
    assert_true(f == 1.5f);
    assert_int_equal(fi_gguf_get_bool(g, "t.bool", &b), 0);
    assert_int_equal(b, 1);
    assert_int_equal(fi_gguf_get_str(g, "t.str", &s), 0);
    assert_true(fi_str_eq(s, "hello"));
    assert_int_equal(fi_gguf_get_u32(g, "t.u64", &u), -1); /* does not fit */
    assert_int_equal(fi_gguf_get_i64(g, "t.u64", &i), -1);
    assert_int_equal(fi_gguf_get_i64(g, "t.i64", &i), 0);
    assert_true(i == INT64_MIN);
    assert_int_equal(fi_gguf_get_f32(g, "t.f64", &f), 0);
    assert_true(f == 0.25f);
    assert_int_equal(fi_gguf_get_str(g, "t.bin", &s), 0);
    assert_int_equal(s.len, 4);
    assert_memory_equal(s.ptr, "a\0\xff\xfe", 4);
    assert_int_equal(fi_gguf_get_str(g, "t.empty", &s), 0);
    assert_int_equal(s.len, 0);
    assert_int_equal(fi_gguf_get_i64(g, "t.arr_i16", &i), -1); /* arrays are not scalars */

    char out[256];
    static const struct {
        const char *key, *text;
    } fmt[] = {
        {"t.u8", "250"},
        {"t.i8", "-7"},
        {"t.u64", "18446744073709551615"},
        {"t.i64", "-9223372036854775808"},
        {"t.f32", "1.5"},
        {"t.bool", "true"},
        {"t.str", "\"hello\""},
        {"t.bin", "\"a\\x00\\xff\\xfe\""},
        {"t.arr_i16", "[3 x int16: -1, 2, -3]"},
        {"t.arr_f32", "[2 x float32: 0.5, -2]"},
        {"t.arr_bool", "[4 x bool: true, false, true, ...]"},
        {"t.arr_f64", "[1 x float64: 3]"},
        {"t.arr_empty", "[0 x uint64]"},
        {"t.arr_str", "[3 x string: \"x\", \"\", \"zz\\\"q\"]"},
        {"t.nested", "[2 x array]"},
    };
    for (size_t k = 0; k < sizeof fmt / sizeof fmt[0]; k++) {
        fi_gguf_kv_format(fi_gguf_find(g, fmt[k].key), out, sizeof out);
        assert_string_equal(out, fmt[k].text);
    }
    /* Truncating output never overruns. */
    fi_gguf_kv_format(fi_gguf_find(g, "t.arr_str"), out, 5);
    assert_string_equal(out, "[3 x");
    fi_gguf_kv_format(fi_gguf_find(g, "t.arr_str"), out, 1);
    assert_string_equal(out, "");

    /* Array elements, read through the unaligned-safe accessors. */
    assert_int_equal(fi_gguf_arr_i64(fi_gguf_find(g, "t.arr_i16"), 2, &i), 0);
    assert_int_equal(i, -3);
    assert_int_equal(fi_gguf_arr_i64(fi_gguf_find(g, "t.arr_i16"), 3, &i), -1);
    assert_int_equal(fi_gguf_arr_i64(fi_gguf_find(g, "t.arr_bool"), 0, &i), -1);
    assert_int_equal(fi_gguf_arr_i64(fi_gguf_find(g, "t.arr_str"), 0, &i), -1);
    assert_int_equal(fi_gguf_arr_i64(fi_gguf_find(g, "t.u8"), 0, &i), -1);
    assert_int_equal(fi_gguf_arr_f32(fi_gguf_find(g, "t.arr_f32"), 1, &f), 0);
    assert_true(f == -2.0f);
    assert_int_equal(fi_gguf_arr_f32(fi_gguf_find(g, "t.arr_f64"), 0, &f), 0);
    assert_true(f == 3.0f);
    assert_int_equal(fi_gguf_arr_f32(fi_gguf_find(g, "t.arr_f64"), 1, &f), -1);
    assert_int_equal(fi_gguf_arr_f32(fi_gguf_find(g, "t.arr_i16"), 0, &f), -1);
    assert_int_equal(fi_gguf_arr_i64(NULL, 0, &i), -1);
    /* Keys may be any bytes but NUL. */
    assert_non_null(fi_gguf_find(g, "k\xff"));

    const fi_gguf_kv *kv = fi_gguf_find(g, "t.arr_str");
    assert_int_equal(kv->arr_len, 3);
    assert_true(fi_str_eq(kv->strs[2], "zz\"q"));
    kv = fi_gguf_find(g, "t.nested");
    assert_int_equal(kv->arr_type, FI_GGUF_ARRAY);
    assert_int_equal(kv->arr_len, 2);
    assert_null(kv->strs);
    kv = fi_gguf_find(g, "t.arr_f32");
    float got[2];
    memcpy(got, kv->data, sizeof got);
    assert_true(got[0] == 0.5f && got[1] == -2.0f);
    kv = fi_gguf_kv_at(g, 0);
    assert_true(fi_str_eq(kv->key, "t.u8"));
    assert_string_equal(fi_gguf_type_name(FI_GGUF_ARRAY), "array");
    assert_string_equal(fi_gguf_type_name((fi_gguf_type)13), "unknown");

    fi_gguf_close(&g);
    assert_null(g);
    free(buf);
    fi_gw_destroy(&w);
    assert_null(w);
}

static void test_roundtrip_tensors(void **state)
{
    static const fi_dtype types[] = {FI_DTYPE_F32,  FI_DTYPE_F16,  FI_DTYPE_BF16,
                                     FI_DTYPE_Q4_0, FI_DTYPE_Q4_1, FI_DTYPE_Q8_0};
    fi_gw *w = fi_gw_new();
    assert_int_equal(fi_gw_set_alignment(w, 64), 0);
    float v[64 * 3];
    for (int i = 0; i < 64 * 3; i++)
        v[i] = (float)((i * 37) % 101) / 25.0f - 2.0f;
    for (size_t k = 0; k < 6; k++) {
        char name[32];
        int64_t ne[3] = {64, 3, 1};
        snprintf(name, sizeof name, "t%zu", k);
        fi_gw_add_tensor_f32(w, name, types[k], 3, ne, v);
    }
    uint8_t *buf;
    size_t len;
    fi_gw_layout lay;
    buf = fi_gw_serialize(w, &len, &lay);
    assert_non_null(buf);
    assert_int_equal(lay.data_start % 64, 0);
    char err[ERRLEN];
    fi_gguf *g = s_open_buf(buf, len, err);
    assert_non_null(g);
    assert_int_equal(fi_gguf_alignment(g), 64);
    assert_int_equal(fi_gguf_data_offset(g), lay.data_start);
    for (size_t k = 0; k < 6; k++) {
        const fi_gguf_tensor *t = fi_gguf_tensor_at(g, (int64_t)k);
        assert_int_equal(t->type, types[k]);
        assert_int_equal(t->n_dims, 3);
        assert_int_equal(t->ne[0], 64);
        assert_int_equal(t->ne[1], 3);
        assert_int_equal(t->ne[2], 1);
        assert_int_equal(t->ne[3], 1);
        assert_int_equal(t->offset % 64, 0);
        assert_int_equal(t->n_bytes, fi_gw_row_bytes(types[k], 64) * 3);
        float back[64 * 3];
        assert_int_equal(fi_gw_dequantize(types[k], t->data, back, 64 * 3), 0);
        /* Error bounds per format: exact, half, bf16, 4-bit, 4-bit, 8-bit. */
        static const float tol[] = {0.0f, 1e-3f, 1.6e-2f, 0.29f, 0.15f, 0.02f};
        for (int i = 0; i < 64 * 3; i++)
            if (!(back[i] - v[i] <= tol[k] && v[i] - back[i] <= tol[k]))
                fail_msg("type %d elem %d: %g vs %g", types[k], i, back[i], v[i]);
    }
    fi_gguf_close(&g);
    free(buf);
    fi_gw_destroy(&w);
}

static void test_file_roundtrip(void **state)
{
    char path[] = "/tmp/fi_gguf_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    fi_gw *w = s_small();
    assert_int_equal(fi_gw_write_file(w, path), 0);
    char err[ERRLEN];
    fi_gguf *g = fi_gguf_open(path, err, sizeof err);
    if (!g)
        fail_msg("%s", err);
    assert_int_equal(fi_gguf_n_tensors(g), 2);
    assert_non_null(fi_gguf_find_tensor(g, "b.weight"));
    fi_gguf_close(&g);
    /* An empty file: truncated at the magic. */
    fd = open(path, O_WRONLY | O_TRUNC);
    assert_true(fd >= 0);
    close(fd);
    assert_null(fi_gguf_open(path, err, sizeof err));
    assert_non_null(strstr(err, "truncated"));
    assert_non_null(strstr(err, "magic"));
    unlink(path);
    fi_gw_destroy(&w);
}

/* --- numbers ----------------------------------------------------------------- */

static void test_fp16(void **state)
{
    static const struct {
        float f;
        uint16_t h;
    } k[] = {
        {0.0f, 0x0000},         {-0.0f, 0x8000},     {1.0f, 0x3c00},    {-2.0f, 0xc000},
        {65504.0f, 0x7bff},     {65520.0f, 0x7c00},  {1e9f, 0x7c00},    {5.9604645e-8f, 0x0001},
        {6.1035156e-5f, 0x0400}, {1e-9f, 0x0000},     {0.33325195f, 0x3555},
        {1.0009765625f, 0x3c01}, {1.00048828125f, 0x3c00}, /* tie: to even */
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        assert_int_equal(fi_gw_fp32_to_fp16(k[i].f), k[i].h);
        if (k[i].h != 0x7c00 && k[i].f != 1e-9f && k[i].f != 1.00048828125f)
            assert_true(fi_gw_fp16_to_fp32(k[i].h) == k[i].f);
    }
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff))
            continue; /* nan */
        assert_int_equal(fi_gw_fp32_to_fp16(fi_gw_fp16_to_fp32((uint16_t)h)), h);
    }
    assert_int_equal(fi_gw_fp32_to_bf16(1.0f), 0x3f80);
    assert_true(fi_gw_bf16_to_fp32(0xc040) == -3.0f);
}

static void test_quant_layout(void **state)
{
    /* Q8_0 of 0..31: d = 31/127, q[j] = round(j * 127 / 31). */
    float x[32], y[32];
    uint8_t blk[34];
    for (int j = 0; j < 32; j++)
        x[j] = (float)j;
    assert_int_equal(fi_gw_quantize(FI_DTYPE_Q8_0, x, blk, 32), 0);
    assert_int_equal(blk[2 + 31], 127);
    assert_int_equal(blk[2 + 0], 0);
    /* Q4_1: min 0, d = 31/15: element j in the low nibble of byte j. */
    uint8_t b41[20];
    assert_int_equal(fi_gw_quantize(FI_DTYPE_Q4_1, x, b41, 32), 0);
    assert_int_equal(b41[4] & 0x0f, 0);
    assert_int_equal(b41[4] >> 4, 8); /* element 16: 16 / (31/15) = 7.74 -> 8 */
    assert_int_equal(b41[4 + 15] >> 4, 15);
    assert_int_equal(fi_gw_dequantize(FI_DTYPE_Q4_1, b41, y, 32), 0);
    assert_true(y[31] > 30.9f && y[31] < 31.1f);
    /* Q4_0: the signed max maps to -8. */
    uint8_t b40[18];
    x[5] = -40.0f;
    assert_int_equal(fi_gw_quantize(FI_DTYPE_Q4_0, x, b40, 32), 0);
    assert_int_equal(b40[2 + 5] & 0x0f, 0);
    assert_int_equal(fi_gw_dequantize(FI_DTYPE_Q4_0, b40, y, 32), 0);
    assert_true(y[5] == -40.0f);
    /* Partial blocks and unknown types are refused. */
    assert_int_equal(fi_gw_quantize(FI_DTYPE_Q8_0, x, blk, 31), -1);
    assert_int_equal(fi_gw_quantize((fi_dtype)12, x, blk, 32), -1);
    assert_int_equal(fi_gw_row_bytes(FI_DTYPE_Q4_1, 576), 360);
    assert_int_equal(fi_gw_row_bytes(FI_DTYPE_Q4_1, 577), 0);
    /* All-zero blocks stay zero. */
    memset(x, 0, sizeof x);
    assert_int_equal(fi_gw_quantize(FI_DTYPE_Q4_1, x, b41, 32), 0);
    assert_int_equal(fi_gw_dequantize(FI_DTYPE_Q4_1, b41, y, 32), 0);
    assert_true(y[0] == 0.0f && y[31] == 0.0f);
}

/* --- the tiny Llama ------------------------------------------------------------ */

static void test_tiny_llama(void **state)
{
    static const fi_dtype types[] = {FI_DTYPE_F32, FI_DTYPE_F16, FI_DTYPE_Q8_0, FI_DTYPE_Q4_1,
                                     FI_DTYPE_Q4_0};
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        fi_gw_llama_opts o;
        fi_gw_llama_defaults(&o);
        o.wtype = types[k];
        o.n_layers = 3;
        o.tied = (int)(k % 2);
        o.n_vocab = 300;
        fi_gw *w = fi_gw_tiny_llama(&o);
        assert_non_null(w);
        uint8_t *buf;
        size_t len;
        fi_gguf *g = s_open_writer(w, &buf, &len);
        uint32_t u;
        assert_int_equal(fi_gguf_get_u32(g, "llama.block_count", &u), 0);
        assert_int_equal(u, 3);
        assert_int_equal(fi_gguf_get_u32(g, "llama.vocab_size", &u), 0);
        assert_int_equal(u, 300);
        assert_int_equal(fi_gguf_n_tensors(g), 2 + 9 * 3 + (o.tied ? 0 : 1));
        const fi_gguf_tensor *t = fi_gguf_find_tensor(g, "blk.2.ffn_down.weight");
        assert_non_null(t);
        assert_int_equal(t->type, types[k]);
        assert_int_equal(t->ne[0], 128);
        assert_int_equal(t->ne[1], 64);
        t = fi_gguf_find_tensor(g, "blk.1.attn_k.weight");
        assert_non_null(t);
        assert_int_equal(t->ne[1], 32);
        t = fi_gguf_find_tensor(g, "token_embd.weight");
        assert_int_equal(t->ne[1], 300);
        assert_int_equal(t->type, FI_DTYPE_Q8_0);
        assert_int_equal(fi_gguf_find_tensor(g, "output.weight") == NULL, o.tied);
        const fi_gguf_kv *kv = fi_gguf_find(g, "tokenizer.ggml.tokens");
        assert_int_equal(kv->arr_len, 300);
        assert_true(fi_str_eq(kv->strs[FI_GW_TOK_IM_START], "<|im_start|>"));
        assert_true(fi_str_eq(kv->strs[FI_GW_TOK_BYTE0 + ' '], "Ġ"));
        assert_true(fi_str_eq(kv->strs[FI_GW_TOK_BYTE0 + 'A'], "A"));
        assert_true(fi_str_eq(kv->strs[FI_GW_TOK_BYTE0 + '\n'], "Ċ"));
        assert_true(fi_str_eq(kv->strs[FI_GW_TOK_BYTE0 + 0xad], "Ń"));
        assert_true(fi_str_eq(kv->strs[FI_GW_TOK_FIRST_MERGE + 12], "Hello"));
        assert_true(fi_str_eq(kv->strs[FI_GW_TINY_MIN_VOCAB - 1], "Ġworld"));
        assert_true(fi_str_eq(kv->strs[299], "<|reserved_22|>"));
        kv = fi_gguf_find(g, "tokenizer.ggml.merges");
        assert_int_equal(kv->arr_len, FI_GW_N_MERGES);
        assert_true(fi_str_eq(kv->strs[12], "Hell o"));
        fi_str s;
        assert_int_equal(fi_gguf_get_str(g, "tokenizer.ggml.pre", &s), 0);
        assert_true(fi_str_eq(s, "smollm"));
        assert_int_equal(fi_gguf_get_str(g, "tokenizer.chat_template", &s), 0);
        assert_non_null(memmem(s.ptr, s.len, FI_GW_TINY_SYSTEM, strlen(FI_GW_TINY_SYSTEM)));
        fi_gguf_close(&g);
        free(buf);
        fi_gw_destroy(&w);
    }
    /* Same seed, same bytes; another seed, other weights. */
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    fi_gw *a = fi_gw_tiny_llama(&o), *b = fi_gw_tiny_llama(&o);
    o.seed = 7;
    fi_gw *c = fi_gw_tiny_llama(&o);
    size_t la, lb, lc;
    uint8_t *ba = fi_gw_serialize(a, &la, NULL), *bb = fi_gw_serialize(b, &lb, NULL),
            *bc = fi_gw_serialize(c, &lc, NULL);
    assert_int_equal(la, lb);
    assert_memory_equal(ba, bb, la);
    assert_int_equal(la, lc);
    assert_memory_not_equal(ba, bc, la);
    free(ba);
    free(bb);
    free(bc);
    fi_gw_destroy(&a);
    fi_gw_destroy(&b);
    fi_gw_destroy(&c);
    /* Bad options. */
    fi_gw_llama_defaults(&o);
    o.dim = 48; /* not a multiple of 32 for Q8_0 */
    assert_null(fi_gw_tiny_llama(&o));
    fi_gw_llama_defaults(&o);
    o.n_kv_heads = 3;
    assert_null(fi_gw_tiny_llama(&o));
}

/* --- malformed files: truncation ------------------------------------------- */

/* 1 when err says the file ends too early. */
static int s_says_short(const char *err)
{
    return strstr(err, "truncated") || strstr(err, "cannot fit") || strstr(err, "exceeds") ||
           strstr(err, "extends past end of file");
}

static void test_truncate_small(void **state)
{
    fi_gw *w = s_small();
    fi_gw_layout lay;
    size_t len;
    uint8_t *buf = fi_gw_serialize(w, &len, &lay);
    assert_non_null(buf);
    char err[ERRLEN];
    fi_gguf *g = s_open_buf(buf, len, err);
    assert_non_null(g);
    fi_gguf_close(&g);
    /* Every prefix, byte by byte: a copy of exactly cut bytes so that ASan
     * sees any read past the end. */
    for (size_t cut = 0; cut < len; cut++) {
        uint8_t *c = malloc(cut ? cut : 1);
        memcpy(c, buf, cut);
        g = s_open_buf(c, cut, err);
        if (g)
            fail_msg("open succeeded on %zu of %zu bytes", cut, len);
        if (!s_says_short(err) || !strstr(err, "byte offset") || strncmp(err, "test.gguf: ", 11))
            fail_msg("cut %zu: unclear message: %s", cut, err);
        if (cut < 4)
            assert_non_null(strstr(err, "magic"));
        else if (cut < 8)
            assert_non_null(strstr(err, "version"));
        else if (cut < 16)
            assert_non_null(strstr(err, "tensor count"));
        else if (cut < 24)
            assert_non_null(strstr(err, "kv count"));
        else if (cut < lay.tensor_start && !strstr(err, "cannot fit"))
            assert_non_null(strstr(err, ": kv "));
        else if (cut >= lay.tensor_start && cut < lay.infos_end && !strstr(err, "cannot fit"))
            assert_non_null(strstr(err, ": tensor "));
        else if (cut >= lay.infos_end)
            assert_non_null(strstr(err, "extends past end of file"));
        free(c);
    }
    free(buf);
    fi_gw_destroy(&w);
}

static uint64_t s_rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void test_truncate_model(void **state)
{
    if (access(FI_TEST_MODEL, R_OK) != 0)
        skip();
    char err[ERRLEN];
    fi_gguf *g = fi_gguf_open(FI_TEST_MODEL, err, sizeof err);
    assert_non_null(g);
    size_t size = fi_gguf_file_size(g);
    /* The mapping's start, found from the first kv's key. */
    const uint8_t *base = (const uint8_t *)fi_gguf_kv_at(g, 0)->key.ptr - 32;
    size_t *cuts = malloc(4096 * sizeof *cuts), n = 0;
    for (size_t c = 0; c < 64; c++)
        cuts[n++] = c;
    for (int64_t i = 0; i < fi_gguf_n_kv(g); i++) { /* kv boundaries and just after */
        size_t at = (size_t)((const uint8_t *)fi_gguf_kv_at(g, i)->key.ptr - base) - 8;
        for (size_t d = 0; d < 14; d++)
            cuts[n++] = at + d;
    }
    for (int64_t i = 0; i < fi_gguf_n_tensors(g); i += 7) { /* tensor infos */
        size_t at = (size_t)((const uint8_t *)fi_gguf_tensor_at(g, i)->name.ptr - base) - 8;
        cuts[n++] = at;
        cuts[n++] = at + 9;
        cuts[n++] = at + 8 + fi_gguf_tensor_at(g, i)->name.len + 4;
    }
    cuts[n++] = fi_gguf_data_offset(g) - 1;
    cuts[n++] = fi_gguf_data_offset(g);
    for (int64_t i = 0; i < fi_gguf_n_tensors(g); i += 5) { /* ends of tensor data */
        const fi_gguf_tensor *t = fi_gguf_tensor_at(g, i);
        cuts[n++] = fi_gguf_data_offset(g) + t->offset + t->n_bytes - 1;
    }
    cuts[n++] = size - 1;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 100; i++)
        cuts[n++] = (size_t)(s_rng_next(&rng) % size);
    for (int i = 0; i < 100; i++) /* inside the metadata and tensor infos */
        cuts[n++] = (size_t)(s_rng_next(&rng) % fi_gguf_data_offset(g));
    for (size_t k = 0; k < n; k++) {
        fi_gguf *h = fi_gguf_open_memory(base, cuts[k], "model.gguf", err, sizeof err);
        if (h)
            fail_msg("open succeeded on %zu of %zu bytes", cuts[k], size);
        if (!s_says_short(err) || !strstr(err, "byte offset") || strncmp(err, "model.gguf: ", 12))
            fail_msg("cut %zu: unclear message: %s", cuts[k], err);
    }
    /* Example from the contract: a cut inside the last tensor. */
    fi_gguf *h = fi_gguf_open_memory(base, size - 1, "model.gguf", err, sizeof err);
    assert_null(h);
    assert_non_null(strstr(err, "model.gguf: tensor 271 'output_norm.weight': data [file offset"));
    assert_non_null(strstr(err, "extends past end of file (98362431 bytes)"));
    free(cuts);
    fi_gguf_close(&g);
}

/* --- malformed files: one defect each --------------------------------------- */

static void test_bad_header(void **state)
{
    fi_gw *w = s_small();
    size_t len;
    uint8_t *buf = fi_gw_serialize(w, &len, NULL);
    char err[ERRLEN];

    memcpy(buf, "GGUX", 4);
    s_expect_fail(buf, len, "header: bad magic 'GGUX'", "not a GGUF file", "byte offset 0 ", NULL);
    memcpy(buf, "\0\0\0\0", 4);
    s_expect_fail(buf, len, "bad magic '?\?\?\?'", NULL);
    memcpy(buf, "GGUF", 4);
    s_put32(buf + 4, 1);
    s_expect_fail(buf, len, "header: GGUF version 1 is not supported", "byte offset 4 ", NULL);
    s_put32(buf + 4, 4);
    s_expect_fail(buf, len, "header: unsupported GGUF version 4", NULL);
    s_put32(buf + 4, 0x03000000);
    s_expect_fail(buf, len, "header: big-endian", "version 3 byte-swapped", NULL);
    s_put32(buf + 4, 2); /* v2 has the same layout: accepted */
    fi_gguf *g = s_open_buf(buf, len, err);
    assert_non_null(g);
    assert_int_equal(fi_gguf_version(g), 2);
    fi_gguf_close(&g);
    s_put32(buf + 4, 3);

    static const uint64_t huge[] = {UINT64_MAX, (uint64_t)1 << 63, (uint64_t)1 << 40, 1000000};
    for (size_t i = 0; i < 4; i++) {
        s_put64(buf + 8, huge[i]);
        s_expect_fail(buf, len, "header: tensor count", "cannot fit", "byte offset 8 ", NULL);
        s_put64(buf + 8, 2);
        s_put64(buf + 16, huge[i]);
        s_expect_fail(buf, len, "header: kv count", "cannot fit", "byte offset 16 ", NULL);
        s_put64(buf + 16, 3);
    }
    /* Counts that fit the file but claim more than it holds. */
    s_put64(buf + 16, 4);
    s_expect_fail(buf, len, NULL);
    s_put64(buf + 16, 3);
    s_put64(buf + 8, 3);
    s_expect_fail(buf, len, "tensor 2", NULL);
    free(buf);
    fi_gw_destroy(&w);
}

static void test_bad_kv(void **state)
{
    fi_gw *w;
    uint8_t v[64];

    /* A string whose length runs past the end. */
    w = s_small();
    s_put64(v, (uint64_t)1 << 62);
    fi_gw_add_raw(w, "x.s", 3, FI_GGUF_STRING, v, 8);
    EXPECT_FAIL_W(w, "kv 3 'x.s'", "string value length 4611686018427387904", "exceeds", NULL);

    /* A key whose length runs past the end (patched in place). */
    w = s_small();
    {
        size_t len;
        uint8_t *buf = fi_gw_serialize(w, &len, NULL);
        size_t at = fi_gw_kv_offset(w, 1);
        s_put64(buf + at, UINT64_MAX);
        char want[64];
        snprintf(want, sizeof want, "byte offset %zu ", at);
        s_expect_fail(buf, len, "kv 1: key length 18446744073709551615 exceeds", want, NULL);
        s_put64(buf + at, 70000);
        s_expect_fail(buf, len, "kv 1: key length 70000 exceeds", NULL);
        free(buf);
        fi_gw_destroy(&w);
    }
    /* Arrays too long for the file, of every kind of element. */
    static const struct {
        uint32_t et;
        const char *words;
    } arr[] = {
        {FI_GGUF_UINT32, "array of 4611686018427387904 x uint32"},
        {FI_GGUF_FLOAT64, "array of 4611686018427387904 x float64"},
        {FI_GGUF_UINT8, "array of 4611686018427387904 x uint8"},
        {FI_GGUF_STRING, "array of 4611686018427387904 strings cannot fit"},
        {FI_GGUF_ARRAY, "array of 4611686018427387904 arrays cannot fit"},
    };
    for (size_t i = 0; i < sizeof arr / sizeof arr[0]; i++) {
        w = s_small();
        s_put32(v, arr[i].et);
        s_put64(v + 4, (uint64_t)1 << 62);
        fi_gw_add_raw(w, "x.arr", 5, FI_GGUF_ARRAY, v, 12);
        EXPECT_FAIL_W(w, "kv 3 'x.arr'", arr[i].words, NULL);
    }
    /* count * 8 overflows 64 bits */
    w = s_small();
    s_put32(v, FI_GGUF_UINT64);
    s_put64(v + 4, ((uint64_t)1 << 61) + 1);
    fi_gw_add_raw(w, "x.arr", 5, FI_GGUF_ARRAY, v, 12);
    EXPECT_FAIL_W(w, "x uint64", "bytes left", NULL);
    /* A string in a string array that runs past the end. */
    w = fi_gw_new();
    s_put32(v, FI_GGUF_STRING);
    s_put64(v + 4, 2);
    s_put64(v + 12, 1);
    v[20] = 'a';
    s_put64(v + 21, 1000);
    fi_gw_add_raw(w, "tok", 3, FI_GGUF_ARRAY, v, 29);
    EXPECT_FAIL_W(w, "kv 0 'tok'", "string 1 of the array length 1000 exceeds", NULL);

    /* Unknown value type, unknown array element type. */
    w = s_small();
    fi_gw_add_raw(w, "x.t", 3, 13, v, 4);
    EXPECT_FAIL_W(w, "kv 3 'x.t'", "unknown value type 13", NULL);
    w = s_small();
    s_put32(v, 0xffffffffu);
    s_put64(v + 4, 1);
    fi_gw_add_raw(w, "x.t", 3, FI_GGUF_ARRAY, v, 12);
    EXPECT_FAIL_W(w, "kv 3 'x.t'", "unknown element type 4294967295", NULL);
    /* Nested: an inner array of unknown type; too deep. */
    w = s_small();
    uint8_t nest[] = {9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    fi_gw_add_raw(w, "x.n", 3, FI_GGUF_ARRAY, nest, sizeof nest);
    EXPECT_FAIL_W(w, "kv 3 'x.n'", "nested array 0 has unknown element type 77", NULL);
    {
        uint8_t deep[12 * 10];
        for (int d = 0; d < 10; d++) {
            s_put32(deep + 12 * d, d < 9 ? FI_GGUF_ARRAY : FI_GGUF_UINT8);
            s_put64(deep + 12 * d + 4, d < 9 ? 1 : 0);
        }
        w = s_small();
        fi_gw_add_raw(w, "x.d", 3, FI_GGUF_ARRAY, deep, sizeof deep);
        EXPECT_FAIL_W(w, "kv 3 'x.d'", "nested more than 8 deep", NULL);
        /* 8 levels are fine. */
        s_put32(deep + 12 * 8, FI_GGUF_UINT8);
        s_put64(deep + 12 * 8 + 4, 0);
        w = s_small();
        fi_gw_add_raw(w, "x.d", 3, FI_GGUF_ARRAY, deep, 12 * 9);
        uint8_t *buf;
        size_t len;
        fi_gguf *g = s_open_writer(w, &buf, &len);
        fi_gguf_close(&g);
        free(buf);
        fi_gw_destroy(&w);
    }
    /* bool must be 0 or 1. */
    w = s_small();
    v[0] = 2;
    fi_gw_add_raw(w, "x.b", 3, FI_GGUF_BOOL, v, 1);
    EXPECT_FAIL_W(w, "kv 3 'x.b'", "bool value is 2", NULL);
    w = s_small();
    s_put32(v, FI_GGUF_BOOL);
    s_put64(v + 4, 3);
    v[12] = 0;
    v[13] = 1;
    v[14] = 9;
    fi_gw_add_raw(w, "x.b", 3, FI_GGUF_ARRAY, v, 15);
    EXPECT_FAIL_W(w, "bool array element 2 is 9", NULL);

    /* Keys: duplicate, NUL inside, empty. */
    w = s_small();
    fi_gw_add_str(w, "general.architecture", "gpt2");
    EXPECT_FAIL_W(w, "kv 3 'general.architecture'", "duplicate key", "first defined at kv 0", NULL);
    w = s_small();
    fi_gw_add_raw(w, "bad\0key", 7, FI_GGUF_UINT8, v, 1);
    EXPECT_FAIL_W(w, "kv 3 'bad?key'", "NUL byte at position 3", NULL);
    w = s_small();
    fi_gw_add_raw(w, "", 0, FI_GGUF_UINT8, v, 1);
    EXPECT_FAIL_W(w, "kv 3", "empty key", NULL);
}

static void test_bad_alignment(void **state)
{
    static const uint32_t bad[] = {0, 3, 48, 0x80000001u};
    for (size_t i = 0; i < 4; i++) {
        fi_gw *w = s_small();
        fi_gw_add_u32(w, "general.alignment", bad[i]);
        char want[64];
        snprintf(want, sizeof want, "general.alignment = %u is not a nonzero power of two", bad[i]);
        EXPECT_FAIL_W(w, "kv 3 'general.alignment'", want, NULL);
    }
    fi_gw *w = s_small();
    fi_gw_add_u64(w, "general.alignment", 32);
    EXPECT_FAIL_W(w, "general.alignment has type uint64, expected uint32", NULL);
    /* A large power of two is fine when the file honours it. */
    w = fi_gw_new();
    fi_gw_set_alignment(w, 4096);
    int64_t ne[1] = {4};
    fi_gw_add_tensor(w, "a", FI_DTYPE_F32, 1, ne, NULL);
    fi_gw_add_tensor(w, "b", FI_DTYPE_F32, 1, ne, NULL);
    uint8_t *buf;
    size_t len;
    fi_gguf *g = s_open_writer(w, &buf, &len);
    assert_int_equal(fi_gguf_data_offset(g), 4096);
    assert_int_equal(fi_gguf_find_tensor(g, "b")->offset, 4096);
    fi_gguf_close(&g);
    free(buf);
    fi_gw_destroy(&w);
}

static void test_bad_tensor(void **state)
{
    fi_gw *w;
    uint64_t ne[8] = {32, 2, 1, 1, 1, 1, 1, 1};

    /* n_dims 0 and 5; the byte offset is that of the n_dims field. */
    for (uint32_t nd = 0; nd <= 5; nd += 5) {
        w = s_small();
        fi_gw_add_tensor_raw(w, "c.weight", 8, nd, ne, FI_DTYPE_F32, 0);
        fi_gw_set_tail(w, 4096);
        size_t len;
        uint8_t *buf = fi_gw_serialize(w, &len, NULL);
        char want[96];
        snprintf(want, sizeof want, "n_dims = %u is outside 1..4 (at byte offset %zu ", nd,
                 fi_gw_tensor_offset(w, 2) + 16);
        s_expect_fail(buf, len, "test.gguf: tensor 2 'c.weight': ", want, NULL);
        free(buf);
        fi_gw_destroy(&w);
    }
    /* ne 0, negative, overflowing products, partial blocks. */
    static const struct {
        uint32_t nd, type;
        uint64_t ne[4];
        const char *words;
    } shapes[] = {
        {2, FI_DTYPE_F32, {32, 0}, "ne[1] = 0: every dimension must be at least 1"},
        {1, FI_DTYPE_F32, {0}, "ne[0] = 0"},
        {2, FI_DTYPE_F32, {UINT64_MAX, 1}, "ne[0] = -1 is negative"},
        {3, FI_DTYPE_F32, {1, 1, (uint64_t)1 << 63}, "ne[2] = -9223372036854775808 is negative"},
        {3, FI_DTYPE_F32, {(uint64_t)1 << 32, (uint64_t)1 << 32, (uint64_t)1 << 32},
         "overflows int64"},
        {4, FI_DTYPE_F32, {(uint64_t)1 << 62, 1, 1, 2}, "overflows int64"},
        {4, FI_DTYPE_F32, {1, (uint64_t)1 << 21, (uint64_t)1 << 21, (uint64_t)1 << 21},
         "overflows int64"},
        {2, FI_DTYPE_F32, {(uint64_t)1 << 62, 1}, "data size of"}, /* 2^64 bytes */
        {2, FI_DTYPE_F16, {(uint64_t)1 << 61, 2}, "data size of"},
        {2, FI_DTYPE_Q8_0, {(uint64_t)INT64_MAX - 31, 1}, "9223372036854775776 x 1 x 1 x 1 q8_0"},
        {2, FI_DTYPE_Q8_0, {33, 1}, "ne[0] = 33 is not a multiple of the q8_0 block size 32"},
        {1, FI_DTYPE_Q4_1, {16}, "not a multiple of the q4_1 block size 32"},
        {2, FI_DTYPE_F32, {1 << 20, 1 << 20}, "extends past end of file"},
        {2, 99, {32, 1}, "unknown tensor type 99"},
        {2, 12, {256, 1}, "tensor type 12 (q4_K) is not supported"},
        {2, 4, {32, 1}, "tensor type 4 (q4_2 (removed)) is not supported"},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        w = s_small();
        fi_gw_add_tensor_raw(w, "c.weight", 8, shapes[i].nd, shapes[i].ne, shapes[i].type, 1024);
        fi_gw_set_tail(w, 2048);
        EXPECT_FAIL_W(w, "tensor 2 'c.weight'", shapes[i].words, NULL);
    }
    /* Offsets: past the end, overflowing, misaligned, overlapping. */
    static const struct {
        uint64_t offset;
        const char *words;
    } offs[] = {
        {1u << 20, "data [file offset"},
        {UINT64_MAX - 31, "extends past end of file"},
        {(uint64_t)1 << 63, "extends past end of file"},
        {8, "data offset 8 (0x8) is not a multiple of the alignment 32"},
        {33, "not a multiple of the alignment 32"},
        {0, "overlaps tensor 0 'a.weight'"}, /* a.weight sits at 0 */
        {64, "overlaps tensor 1 'b.weight'"}, /* b.weight sits at 32..100 */
    };
    for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++) {
        w = s_small();
        fi_gw_add_tensor_raw(w, "c.weight", 8, 2, ne, FI_DTYPE_F32, offs[i].offset);
        fi_gw_set_tail(w, 2048);
        EXPECT_FAIL_W(w, "tensor 2 'c.weight'", offs[i].words, NULL);
    }
    /* Adjacent is fine: c right after b (b ends at 32 + 68 = 100, so 128). */
    w = s_small();
    fi_gw_add_tensor_raw(w, "c.weight", 8, 2, ne, FI_DTYPE_F32, 128);
    fi_gw_set_tail(w, 28 + 256); /* data: 100 bytes of a and b, pad to 128, c */
    {
        uint8_t *buf;
        size_t len;
        fi_gguf *g = s_open_writer(w, &buf, &len);
        assert_int_equal(fi_gguf_find_tensor(g, "c.weight")->n_bytes, 256);
        fi_gguf_close(&g);
        free(buf);
        fi_gw_destroy(&w);
    }
    /* Names: duplicate, NUL inside, empty, too long for the file. */
    w = s_small();
    fi_gw_add_tensor_raw(w, "a.weight", 8, 1, ne, FI_DTYPE_F32, 1024);
    fi_gw_set_tail(w, 2048);
    EXPECT_FAIL_W(w, "tensor 2 'a.weight'", "duplicate tensor name", "first defined at tensor 0",
                  NULL);
    w = s_small();
    fi_gw_add_tensor_raw(w, "c\0d", 3, 1, ne, FI_DTYPE_F32, 1024);
    fi_gw_set_tail(w, 2048);
    EXPECT_FAIL_W(w, "tensor 2 'c?d'", "NUL byte", NULL);
    w = s_small();
    fi_gw_add_tensor_raw(w, "", 0, 1, ne, FI_DTYPE_F32, 1024);
    fi_gw_set_tail(w, 2048);
    EXPECT_FAIL_W(w, "tensor 2", "empty tensor name", NULL);
    w = s_small();
    {
        size_t len;
        uint8_t *buf = fi_gw_serialize(w, &len, NULL);
        s_put64(buf + fi_gw_tensor_offset(w, 1), 1u << 30);
        s_expect_fail(buf, len, "tensor 1: tensor name length 1073741824 exceeds", NULL);
        free(buf);
        fi_gw_destroy(&w);
    }
}

/* --- random mutations ------------------------------------------------------- */

/* Touches every byte a successful open hands out, so that ASan sees it. */
static unsigned s_walk(const fi_gguf *g)
{
    unsigned sum = 0;
    char buf[160];
    for (int64_t i = 0; i < fi_gguf_n_kv(g); i++) {
        const fi_gguf_kv *kv = fi_gguf_kv_at(g, i);
        fi_gguf_kv_format(kv, buf, sizeof buf);
        sum += (unsigned)strlen(buf);
        if (kv->key.len)
            sum += (unsigned char)kv->key.ptr[kv->key.len - 1];
        for (uint64_t k = 0; kv->strs && k < kv->arr_len; k++)
            if (kv->strs[k].len)
                sum += (unsigned char)kv->strs[k].ptr[kv->strs[k].len - 1];
        char key[80];
        snprintf(key, sizeof key, "%.*s", (int)(kv->key.len < 79 ? kv->key.len : 79), kv->key.ptr);
        (void)fi_gguf_find(g, key);
    }
    for (int64_t i = 0; i < fi_gguf_n_tensors(g); i++) {
        const fi_gguf_tensor *t = fi_gguf_tensor_at(g, i);
        const uint8_t *d = t->data;
        sum += d[0] + d[t->n_bytes - 1];
    }
    return sum;
}

static void test_mutations(void **state)
{
    fi_gw *w = s_small();
    fi_gw_add_i64(w, "x.i64", -5);
    uint8_t nest[] = {9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                      1, 0, 0, 0, 0, 0, 0, 0, 's'};
    fi_gw_add_raw(w, "x.nested", 8, FI_GGUF_ARRAY, nest, sizeof nest);
    size_t len;
    uint8_t *orig = fi_gw_serialize(w, &len, NULL);
    assert_non_null(orig);
    static const uint64_t interesting[] = {0, 1, 2, 4, 5, 8, 9, 12, 13, 31, 32, 33, 0x7f, 0xff,
                                           0xffff, 0x7fffffff, 0xffffffffu, (uint64_t)1 << 32,
                                           INT64_MAX, (uint64_t)INT64_MAX + 1, UINT64_MAX};
    uint64_t rng = 12345;
    unsigned opened = 0, sum = 0;
    char err[ERRLEN];
    for (int it = 0; it < 30000; it++) {
        size_t n = len;
        uint8_t *m = malloc(len);
        memcpy(m, orig, len);
        int edits = 1 + (int)(s_rng_next(&rng) % 4);
        for (int e = 0; e < edits; e++) {
            size_t at = (size_t)(s_rng_next(&rng) % len);
            switch (s_rng_next(&rng) % 5) {
            case 0: m[at] ^= (uint8_t)(1u << (s_rng_next(&rng) % 8)); break;
            case 1: m[at] = (uint8_t)s_rng_next(&rng); break;
            case 2:
                if (at + 8 <= len)
                    s_put64(m + at, interesting[s_rng_next(&rng) % 21]);
                break;
            case 3:
                if (at + 4 <= len)
                    s_put32(m + at, (uint32_t)interesting[s_rng_next(&rng) % 21]);
                break;
            case 4: n = at; break; /* truncate */
            }
        }
        fi_gguf *g = s_open_buf(m, n, err);
        if (g) {
            opened++;
            sum += s_walk(g);
            fi_gguf_close(&g);
        } else {
            assert_true(strncmp(err, "test.gguf: ", 11) == 0 && strstr(err, "byte offset"));
        }
        free(m);
    }
    print_message("mutations: %u of 30000 still opened (checksum %u)\n", opened, sum);
    free(orig);
    fi_gw_destroy(&w);
}

/* --- allocation failures ------------------------------------------------------
 * Where the linker supports it (tests/gguf.cmake), test_gguf is linked with
 * --wrap for malloc, calloc, realloc and free: while counting is on, the
 * wrappers count live blocks and fail the nth allocation, so that every
 * allocation in fi_gguf_open is made to fail in turn and every error path
 * is checked for a clear message and for leaks (also without ASan). */
#ifdef FI_TEST_WRAP_ALLOC
void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void __real_free(void *p);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);
void __wrap_free(void *p);

static int s_alloc_on;       /* 1: count and inject */
static long s_alloc_n;       /* allocations since counting began */
static long s_alloc_fail_at; /* the allocation that fails (1-based); 0: none */
static long s_alloc_live;    /* blocks allocated minus blocks freed while counting */

static int s_alloc_fails(void)
{
    return s_alloc_on && ++s_alloc_n == s_alloc_fail_at;
}

void *__wrap_malloc(size_t n)
{
    if (s_alloc_fails())
        return NULL;
    void *p = __real_malloc(n);
    s_alloc_live += p && s_alloc_on;
    return p;
}

void *__wrap_calloc(size_t k, size_t n)
{
    if (s_alloc_fails())
        return NULL;
    void *p = __real_calloc(k, n);
    s_alloc_live += p && s_alloc_on;
    return p;
}

void *__wrap_realloc(void *p, size_t n)
{
    if (s_alloc_fails())
        return NULL;
    void *q = __real_realloc(p, n);
    s_alloc_live += q && !p && s_alloc_on;
    return q;
}

void __wrap_free(void *p)
{
    s_alloc_live -= p && s_alloc_on;
    __real_free(p);
}

/* Opens buf with allocation 1, 2, ... failing until an open succeeds;
 * returns the number of allocations a successful open makes. */
static long s_oom_loop(const uint8_t *buf, size_t len, const char *path)
{
    char err[ERRLEN];
    for (long n = 1;; n++) {
        s_alloc_on = 1;
        s_alloc_n = 0;
        s_alloc_fail_at = n;
        s_alloc_live = 0;
        fi_gguf *g = path ? fi_gguf_open(path, err, sizeof err)
                          : fi_gguf_open_memory(buf, len, "test.gguf", err, sizeof err);
        long made = s_alloc_n, live = s_alloc_live;
        fi_gguf_close(&g);
        long after_close = s_alloc_live;
        s_alloc_on = 0;
        if (made < n) { /* nothing failed: the open must have worked */
            assert_int_equal(live > 0, 1);
            assert_int_equal(after_close, 0);
            return made;
        }
        assert_int_equal(live, 0); /* a failed open frees everything */
        if (!strstr(err, "out of memory"))
            fail_msg("allocation %ld failed, message: %s", n, err);
    }
}

static void test_alloc_failures(void **state)
{
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    fi_gw *w = fi_gw_tiny_llama(&o);
    size_t len;
    uint8_t *buf = fi_gw_serialize(w, &len, NULL);
    assert_non_null(buf);
    long n = s_oom_loop(buf, len, NULL);
    print_message("tiny llama: %ld allocations per open, each failed in turn\n", n);
    assert_true(n >= 5);
    free(buf);
    fi_gw_destroy(&w);
    if (access(FI_TEST_MODEL, R_OK) == 0) {
        n = s_oom_loop(NULL, 0, FI_TEST_MODEL);
        print_message("model: %ld allocations per open, each failed in turn\n", n);
    }
}
#else
static void test_alloc_failures(void **state)
{
    skip(); /* the linker cannot wrap malloc here */
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_model_facts, s_model_setup, s_model_teardown),
        cmocka_unit_test(test_open_missing),
        cmocka_unit_test(test_name_format),
        cmocka_unit_test(test_roundtrip_types),
        cmocka_unit_test(test_roundtrip_tensors),
        cmocka_unit_test(test_file_roundtrip),
        cmocka_unit_test(test_fp16),
        cmocka_unit_test(test_quant_layout),
        cmocka_unit_test(test_tiny_llama),
        cmocka_unit_test(test_truncate_small),
        cmocka_unit_test(test_truncate_model),
        cmocka_unit_test(test_bad_header),
        cmocka_unit_test(test_bad_kv),
        cmocka_unit_test(test_bad_alignment),
        cmocka_unit_test(test_bad_tensor),
        cmocka_unit_test(test_mutations),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
