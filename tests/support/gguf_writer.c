/*
 * gguf_writer.c - builds GGUF files in memory for tests (see gguf_writer.h).
 *
 * The kvs are serialised as they are added into one growing byte buffer;
 * tensors are kept as records (name, shape, type, owned data) and laid out
 * only when the file is serialised, so that the alignment may be set at any
 * time. Also here: fp16/bf16 conversion, reference quantisers for the block
 * formats the reader accepts, and the tiny Llama model builder.
 */
#include "gguf_writer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FI_GW_MAX_RAW_DIMS 8 /* ne values stored for a raw tensor info */

/* A growing byte buffer. */
typedef struct s_bytes {
    uint8_t *p; /* owned */
    size_t n;   /* bytes used */
    size_t cap; /* bytes allocated */
} s_bytes;

typedef struct s_tensor {
    uint8_t *name;                    /* owned, name_len bytes */
    uint64_t name_len;                /* bytes */
    uint32_t n_dims;                  /* as written (raw: anything) */
    uint64_t ne[FI_GW_MAX_RAW_DIMS];  /* as written; min(n_dims, 8) of them */
    uint32_t type;                    /* type id as written */
    int raw;                          /* 1: offset as given, no data */
    uint64_t offset;                  /* relative to the data section */
    uint8_t *data;                    /* owned, n_bytes (NULL for raw) */
    size_t n_bytes;                   /* data size */
    size_t info_at;                   /* file offset of the info, last serialise */
} s_tensor;

struct fi_gw {
    uint32_t version;      /* header version */
    uint32_t alignment;    /* data section alignment */
    uint64_t n_kv;         /* kvs added */
    s_bytes kv;            /* serialised kvs */
    size_t *kv_off;        /* start of kv i within kv.p; kv_off_cap entries */
    size_t kv_off_cap;     /* allocated entries */
    s_tensor *t;           /* tensors; t_cap allocated */
    size_t n_t;            /* tensors added */
    size_t t_cap;          /* allocated */
    uint64_t over_tensors; /* header tensor count override, UINT64_MAX: none */
    uint64_t over_kv;      /* header kv count override, UINT64_MAX: none */
    size_t tail;           /* zero bytes after the data */
    size_t align_at;       /* value of our general.alignment kv in kv.p; 0: none */
    int serialised;        /* 1 after a successful serialise */
    int failed;            /* sticky error */
};

/* --- byte buffers ------------------------------------------------------ */

static int s_reserve(s_bytes *b, size_t more)
{
    if (more > SIZE_MAX - b->n)
        return -1;
    if (b->n + more <= b->cap)
        return 0;
    size_t nc = b->cap ? b->cap : 256;
    while (nc < b->n + more)
        nc *= 2;
    uint8_t *p = realloc(b->p, nc);
    if (!p)
        return -1;
    b->p = p;
    b->cap = nc;
    return 0;
}

static int s_put(s_bytes *b, const void *p, size_t n)
{
    if (s_reserve(b, n) < 0)
        return -1;
    if (n)
        memcpy(b->p + b->n, p, n);
    b->n += n;
    return 0;
}

static int s_put32(s_bytes *b, uint32_t v)
{
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    return s_put(b, x, 4);
}

static int s_put64(s_bytes *b, uint64_t v)
{
    return s_put32(b, (uint32_t)v) || s_put32(b, (uint32_t)(v >> 32)) ? -1 : 0;
}

static int s_putstr(s_bytes *b, const void *s, uint64_t len)
{
    return s_put64(b, len) || s_put(b, s, (size_t)len) ? -1 : 0;
}

/* --- writer ------------------------------------------------------------ */

fi_gw *fi_gw_new(void)
{
    fi_gw *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->version = 3;
    w->alignment = 32;
    w->over_tensors = UINT64_MAX;
    w->over_kv = UINT64_MAX;
    return w;
}

void fi_gw_destroy(fi_gw **wp)
{
    if (!wp || !*wp)
        return;
    fi_gw *w = *wp;
    for (size_t i = 0; i < w->n_t; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->t);
    free(w->kv.p);
    free(w->kv_off);
    free(w);
    *wp = NULL;
}

int fi_gw_failed(const fi_gw *w)
{
    return !w || w->failed;
}

static int s_fail(fi_gw *w)
{
    if (w)
        w->failed = 1;
    return -1;
}

/* Starts a kv: records its offset, writes key and type. */
static int s_kv_begin(fi_gw *w, const char *key, uint64_t key_len, uint32_t type)
{
    if (!w || w->failed || (!key && key_len))
        return s_fail(w);
    if (w->n_kv == w->kv_off_cap) {
        size_t nc = w->kv_off_cap ? w->kv_off_cap * 2 : 32;
        size_t *p = realloc(w->kv_off, nc * sizeof *p);
        if (!p)
            return s_fail(w);
        w->kv_off = p;
        w->kv_off_cap = nc;
    }
    w->kv_off[w->n_kv] = w->kv.n;
    if (s_putstr(&w->kv, key, key_len) < 0 || s_put32(&w->kv, type) < 0)
        return s_fail(w);
    w->n_kv++;
    w->serialised = 0;
    return 0;
}

static int s_kv_scalar(fi_gw *w, const char *key, fi_gguf_type t, const void *v, size_t n)
{
    if (!key || s_kv_begin(w, key, strlen(key), t) < 0)
        return s_fail(w);
    return s_put(&w->kv, v, n) < 0 ? s_fail(w) : 0;
}

int fi_gw_add_u8(fi_gw *w, const char *key, uint8_t v) { return s_kv_scalar(w, key, FI_GGUF_UINT8, &v, 1); }
int fi_gw_add_i8(fi_gw *w, const char *key, int8_t v) { return s_kv_scalar(w, key, FI_GGUF_INT8, &v, 1); }
int fi_gw_add_u16(fi_gw *w, const char *key, uint16_t v) { return s_kv_scalar(w, key, FI_GGUF_UINT16, &v, 2); }
int fi_gw_add_i16(fi_gw *w, const char *key, int16_t v) { return s_kv_scalar(w, key, FI_GGUF_INT16, &v, 2); }
int fi_gw_add_u32(fi_gw *w, const char *key, uint32_t v) { return s_kv_scalar(w, key, FI_GGUF_UINT32, &v, 4); }
int fi_gw_add_i32(fi_gw *w, const char *key, int32_t v) { return s_kv_scalar(w, key, FI_GGUF_INT32, &v, 4); }
int fi_gw_add_f32(fi_gw *w, const char *key, float v) { return s_kv_scalar(w, key, FI_GGUF_FLOAT32, &v, 4); }
int fi_gw_add_u64(fi_gw *w, const char *key, uint64_t v) { return s_kv_scalar(w, key, FI_GGUF_UINT64, &v, 8); }
int fi_gw_add_i64(fi_gw *w, const char *key, int64_t v) { return s_kv_scalar(w, key, FI_GGUF_INT64, &v, 8); }
int fi_gw_add_f64(fi_gw *w, const char *key, double v) { return s_kv_scalar(w, key, FI_GGUF_FLOAT64, &v, 8); }

int fi_gw_add_bool(fi_gw *w, const char *key, int v)
{
    uint8_t b = v ? 1 : 0;
    return s_kv_scalar(w, key, FI_GGUF_BOOL, &b, 1);
}

int fi_gw_add_strn(fi_gw *w, const char *key, const char *s, uint64_t len)
{
    if (!key || (!s && len) || s_kv_begin(w, key, strlen(key), FI_GGUF_STRING) < 0)
        return s_fail(w);
    return s_putstr(&w->kv, s, len) < 0 ? s_fail(w) : 0;
}

int fi_gw_add_str(fi_gw *w, const char *key, const char *s)
{
    return s ? fi_gw_add_strn(w, key, s, strlen(s)) : s_fail(w);
}

static size_t s_scalar_size(fi_gguf_type t)
{
    switch (t) {
    case FI_GGUF_UINT8: case FI_GGUF_INT8: case FI_GGUF_BOOL: return 1;
    case FI_GGUF_UINT16: case FI_GGUF_INT16: return 2;
    case FI_GGUF_UINT32: case FI_GGUF_INT32: case FI_GGUF_FLOAT32: return 4;
    case FI_GGUF_UINT64: case FI_GGUF_INT64: case FI_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

int fi_gw_add_array(fi_gw *w, const char *key, fi_gguf_type elem, const void *data, uint64_t n)
{
    size_t esz = s_scalar_size(elem);
    if (!key || !esz || (!data && n) || n > SIZE_MAX / esz)
        return s_fail(w);
    if (s_kv_begin(w, key, strlen(key), FI_GGUF_ARRAY) < 0 || s_put32(&w->kv, elem) < 0 ||
        s_put64(&w->kv, n) < 0 || s_put(&w->kv, data, (size_t)n * esz) < 0)
        return s_fail(w);
    return 0;
}

int fi_gw_add_str_array(fi_gw *w, const char *key, const char *const *strs, uint64_t n)
{
    if (!key || (!strs && n))
        return s_fail(w);
    if (s_kv_begin(w, key, strlen(key), FI_GGUF_ARRAY) < 0 ||
        s_put32(&w->kv, FI_GGUF_STRING) < 0 || s_put64(&w->kv, n) < 0)
        return s_fail(w);
    for (uint64_t i = 0; i < n; i++)
        if (!strs[i] || s_putstr(&w->kv, strs[i], strlen(strs[i])) < 0)
            return s_fail(w);
    return 0;
}

int fi_gw_add_raw(fi_gw *w, const char *key, uint64_t key_len, uint32_t type, const void *value,
                  size_t len)
{
    if ((!value && len) || s_kv_begin(w, key, key_len, type) < 0)
        return s_fail(w);
    return s_put(&w->kv, value, len) < 0 ? s_fail(w) : 0;
}

int fi_gw_set_alignment(fi_gw *w, uint32_t a)
{
    if (!w || a == 0 || (a & (a - 1)))
        return s_fail(w);
    w->alignment = a;
    if (w->align_at) { /* set before: change the value, do not add a second kv */
        memcpy(w->kv.p + w->align_at, &a, 4);
        return 0;
    }
    if (fi_gw_add_u32(w, "general.alignment", a) < 0)
        return -1;
    w->align_at = w->kv.n - 4;
    return 0;
}

void fi_gw_set_version(fi_gw *w, uint32_t version)
{
    if (w)
        w->version = version;
}

void fi_gw_override_counts(fi_gw *w, uint64_t n_tensors, uint64_t n_kv)
{
    if (w) {
        w->over_tensors = n_tensors;
        w->over_kv = n_kv;
    }
}

void fi_gw_set_tail(fi_gw *w, size_t n)
{
    if (w)
        w->tail = n;
}

/* --- tensors ------------------------------------------------------------ */

static int s_block(fi_dtype t, int *elems, size_t *bytes)
{
    switch (t) {
    case FI_DTYPE_F32: *elems = 1; *bytes = 4; return 0;
    case FI_DTYPE_F16: case FI_DTYPE_BF16: *elems = 1; *bytes = 2; return 0;
    case FI_DTYPE_Q4_0: *elems = 32; *bytes = 18; return 0;
    case FI_DTYPE_Q4_1: *elems = 32; *bytes = 20; return 0;
    case FI_DTYPE_Q8_0: *elems = 32; *bytes = 34; return 0;
    default: return -1;
    }
}

size_t fi_gw_row_bytes(fi_dtype t, int64_t n)
{
    int be;
    size_t bb;
    if (n < 0 || s_block(t, &be, &bb) < 0 || n % be)
        return 0;
    return (size_t)(n / be) * bb;
}

static s_tensor *s_tensor_new(fi_gw *w, const char *name, uint64_t name_len)
{
    if (!w || w->failed || (!name && name_len))
        return NULL;
    if (w->n_t == w->t_cap) {
        size_t nc = w->t_cap ? w->t_cap * 2 : 16;
        s_tensor *p = realloc(w->t, nc * sizeof *p);
        if (!p)
            return NULL;
        w->t = p;
        w->t_cap = nc;
    }
    s_tensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    t->name = malloc(name_len ? name_len : 1);
    if (!t->name)
        return NULL;
    if (name_len)
        memcpy(t->name, name, name_len);
    t->name_len = name_len;
    w->n_t++;
    w->serialised = 0;
    return t;
}

/* Checks a shape; returns the data size or 0 when invalid. */
static size_t s_shape_bytes(fi_dtype type, int n_dims, const int64_t *ne)
{
    if (n_dims < 1 || n_dims > FI_GGUF_MAX_DIMS || !ne)
        return 0;
    size_t rows = 1, rb = fi_gw_row_bytes(type, ne[0]);
    if (!rb)
        return 0;
    for (int d = 1; d < n_dims; d++) {
        if (ne[d] < 1 || (uint64_t)ne[d] > SIZE_MAX / rows)
            return 0;
        rows *= (size_t)ne[d];
    }
    return rows > SIZE_MAX / rb ? 0 : rows * rb;
}

int fi_gw_add_tensor(fi_gw *w, const char *name, fi_dtype type, int n_dims, const int64_t *ne,
                     const void *data)
{
    size_t bytes = s_shape_bytes(type, n_dims, ne);
    if (!name || !bytes)
        return s_fail(w);
    s_tensor *t = s_tensor_new(w, name, strlen(name));
    if (!t)
        return s_fail(w);
    t->n_dims = (uint32_t)n_dims;
    for (int d = 0; d < n_dims; d++)
        t->ne[d] = (uint64_t)ne[d];
    t->type = type;
    t->n_bytes = bytes;
    t->data = data ? malloc(bytes) : calloc(1, bytes);
    if (!t->data)
        return s_fail(w);
    if (data)
        memcpy(t->data, data, bytes);
    return 0;
}

int fi_gw_add_tensor_f32(fi_gw *w, const char *name, fi_dtype type, int n_dims, const int64_t *ne,
                         const float *values)
{
    size_t bytes = s_shape_bytes(type, n_dims, ne);
    if (!bytes || !values)
        return s_fail(w);
    uint8_t *buf = malloc(bytes);
    if (!buf)
        return s_fail(w);
    size_t rb = fi_gw_row_bytes(type, ne[0]), rows = bytes / rb;
    for (size_t r = 0; r < rows; r++)
        (void)fi_gw_quantize(type, values + r * (size_t)ne[0], buf + r * rb, ne[0]);
    int rc = fi_gw_add_tensor(w, name, type, n_dims, ne, buf);
    free(buf);
    return rc;
}

int fi_gw_add_tensor_raw(fi_gw *w, const char *name, uint64_t name_len, uint32_t n_dims,
                         const uint64_t *ne, uint32_t type, uint64_t offset)
{
    uint32_t nd = n_dims < FI_GW_MAX_RAW_DIMS ? n_dims : FI_GW_MAX_RAW_DIMS;
    if (nd && !ne)
        return s_fail(w);
    s_tensor *t = s_tensor_new(w, name, name_len);
    if (!t)
        return s_fail(w);
    t->raw = 1;
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < nd; d++)
        t->ne[d] = ne[d];
    t->type = type;
    t->offset = offset;
    return 0;
}

/* --- output ------------------------------------------------------------- */

static size_t s_align(size_t x, size_t a)
{
    return (x + a - 1) / a * a;
}

uint8_t *fi_gw_serialize(fi_gw *w, size_t *len, fi_gw_layout *layout)
{
    if (!w || w->failed || !len)
        return NULL;
    s_bytes b = {0};
    size_t data_size = 0;
    /* Lay out the data: each real tensor at the next aligned offset. */
    for (size_t i = 0; i < w->n_t; i++) {
        s_tensor *t = &w->t[i];
        if (t->raw)
            continue;
        data_size = s_align(data_size, w->alignment);
        t->offset = data_size;
        data_size += t->n_bytes;
    }
    fi_gw_layout lay = {.kv_start = 24};
    int bad = s_put(&b, "GGUF", 4) || s_put32(&b, w->version) ||
              s_put64(&b, w->over_tensors != UINT64_MAX ? w->over_tensors : w->n_t) ||
              s_put64(&b, w->over_kv != UINT64_MAX ? w->over_kv : w->n_kv) ||
              s_put(&b, w->kv.p, w->kv.n);
    lay.tensor_start = b.n;
    for (size_t i = 0; i < w->n_t && !bad; i++) {
        s_tensor *t = &w->t[i];
        uint32_t nd = t->n_dims < FI_GW_MAX_RAW_DIMS ? t->n_dims : FI_GW_MAX_RAW_DIMS;
        t->info_at = b.n;
        bad = s_putstr(&b, t->name, t->name_len) || s_put32(&b, t->n_dims);
        for (uint32_t d = 0; d < nd && !bad; d++)
            bad = s_put64(&b, t->ne[d]);
        bad = bad || s_put32(&b, t->type) || s_put64(&b, t->offset);
    }
    lay.infos_end = b.n;
    lay.data_start = s_align(b.n, w->alignment);
    if (!bad && s_reserve(&b, lay.data_start - b.n + data_size + w->tail) == 0) {
        memset(b.p + b.n, 0, lay.data_start - b.n + data_size + w->tail);
        for (size_t i = 0; i < w->n_t; i++)
            if (!w->t[i].raw)
                memcpy(b.p + lay.data_start + w->t[i].offset, w->t[i].data, w->t[i].n_bytes);
        b.n = lay.data_start + data_size + w->tail;
    } else {
        bad = 1;
    }
    if (bad) {
        free(b.p);
        w->failed = 1;
        return NULL;
    }
    lay.size = b.n;
    if (layout)
        *layout = lay;
    *len = b.n;
    w->serialised = 1;
    return b.p ? b.p : malloc(1);
}

size_t fi_gw_kv_offset(const fi_gw *w, size_t i)
{
    if (!w || !w->serialised || i >= w->n_kv)
        return (size_t)-1;
    return 24 + w->kv_off[i];
}

size_t fi_gw_tensor_offset(const fi_gw *w, size_t i)
{
    if (!w || !w->serialised || i >= w->n_t)
        return (size_t)-1;
    return w->t[i].info_at;
}

int fi_gw_write_file(fi_gw *w, const char *path)
{
    size_t len;
    uint8_t *buf = fi_gw_serialize(w, &len, NULL);
    if (!buf || !path) {
        free(buf);
        return -1;
    }
    FILE *f = fopen(path, "wb");
    int rc = -1;
    if (f) {
        rc = fwrite(buf, 1, len, f) == len ? 0 : -1;
        if (fclose(f) != 0)
            rc = -1;
    }
    free(buf);
    return rc;
}

/* --- numbers ------------------------------------------------------------- */

uint16_t fi_gw_fp32_to_fp16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t exp = (x >> 23) & 0xff, mant = x & 0x7fffff;
    if (exp == 0xff) /* inf, nan (kept quiet) */
        return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 0x1f)
        return (uint16_t)(sign | 0x7c00);
    if (e <= 0) { /* subnormal half, or zero */
        if (e < -10)
            return sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - e), half = 1u << (shift - 1);
        uint32_t rem = mant & ((1u << shift) - 1), m = mant >> shift;
        if (rem > half || (rem == half && (m & 1)))
            m++;
        return (uint16_t)(sign | m);
    }
    uint32_t h = (uint32_t)sign | (uint32_t)e << 10 | mant >> 13, rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
        h++; /* a carry into the exponent is right, up to inf */
    return (uint16_t)h;
}

float fi_gw_fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, x;
    float f;
    if (exp == 0) {
        f = (float)mant * (1.0f / 16777216.0f); /* mant * 2^-24, exact */
        return sign ? -f : f;
    }
    if (exp == 0x1f)
        x = sign | 0x7f800000 | mant << 13;
    else
        x = sign | (exp + 127 - 15) << 23 | mant << 13;
    memcpy(&f, &x, 4);
    return f;
}

uint16_t fi_gw_fp32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000)
        return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

float fi_gw_bf16_to_fp32(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static void s_le16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static uint16_t s_rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

/* Q8_0 block: fp16 d, then 32 int8 q; x = q * d. */
static void s_q8_0(const float *x, uint8_t *blk)
{
    float amax = 0.0f;
    for (int j = 0; j < 32; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    s_le16(blk, fi_gw_fp32_to_fp16(d));
    for (int j = 0; j < 32; j++)
        blk[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* Q4_0 block: fp16 d, then 16 bytes: element j in the low nibble of byte j,
 * element j+16 in its high nibble; x = (q - 8) * d. */
static void s_q4_0(const float *x, uint8_t *blk)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    s_le16(blk, fi_gw_fp32_to_fp16(d));
    for (int j = 0; j < 16; j++) {
        int q0 = (int)(x[j] * id + 8.5f), q1 = (int)(x[j + 16] * id + 8.5f);
        q0 = q0 < 0 ? 0 : q0 > 15 ? 15 : q0;
        q1 = q1 < 0 ? 0 : q1 > 15 ? 15 : q1;
        blk[2 + j] = (uint8_t)(q0 | q1 << 4);
    }
}

/* Q4_1 block: fp16 d, fp16 m, then 16 bytes packed as Q4_0; x = q * d + m. */
static void s_q4_1(const float *x, uint8_t *blk)
{
    float mn = x[0], mx = x[0];
    for (int j = 1; j < 32; j++) {
        mn = fminf(mn, x[j]);
        mx = fmaxf(mx, x[j]);
    }
    float d = (mx - mn) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    s_le16(blk, fi_gw_fp32_to_fp16(d));
    s_le16(blk + 2, fi_gw_fp32_to_fp16(mn));
    for (int j = 0; j < 16; j++) {
        int q0 = (int)((x[j] - mn) * id + 0.5f), q1 = (int)((x[j + 16] - mn) * id + 0.5f);
        q0 = q0 < 0 ? 0 : q0 > 15 ? 15 : q0;
        q1 = q1 < 0 ? 0 : q1 > 15 ? 15 : q1;
        blk[4 + j] = (uint8_t)(q0 | q1 << 4);
    }
}

int fi_gw_quantize(fi_dtype t, const float *src, void *dst, int64_t n)
{
    uint8_t *o = dst;
    if (!fi_gw_row_bytes(t, n) && n != 0)
        return -1;
    switch (t) {
    case FI_DTYPE_F32: memcpy(dst, src, (size_t)n * 4); return 0;
    case FI_DTYPE_F16:
        for (int64_t i = 0; i < n; i++)
            s_le16(o + 2 * i, fi_gw_fp32_to_fp16(src[i]));
        return 0;
    case FI_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            s_le16(o + 2 * i, fi_gw_fp32_to_bf16(src[i]));
        return 0;
    case FI_DTYPE_Q8_0:
        for (int64_t b = 0; b < n / 32; b++)
            s_q8_0(src + 32 * b, o + 34 * b);
        return 0;
    case FI_DTYPE_Q4_0:
        for (int64_t b = 0; b < n / 32; b++)
            s_q4_0(src + 32 * b, o + 18 * b);
        return 0;
    case FI_DTYPE_Q4_1:
        for (int64_t b = 0; b < n / 32; b++)
            s_q4_1(src + 32 * b, o + 20 * b);
        return 0;
    }
    return -1;
}

int fi_gw_dequantize(fi_dtype t, const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    if (!fi_gw_row_bytes(t, n) && n != 0)
        return -1;
    switch (t) {
    case FI_DTYPE_F32: memcpy(dst, src, (size_t)n * 4); return 0;
    case FI_DTYPE_F16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = fi_gw_fp16_to_fp32(s_rd16(p + 2 * i));
        return 0;
    case FI_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = fi_gw_bf16_to_fp32(s_rd16(p + 2 * i));
        return 0;
    case FI_DTYPE_Q8_0:
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = p + 34 * b;
            float d = fi_gw_fp16_to_fp32(s_rd16(blk));
            for (int j = 0; j < 32; j++)
                dst[32 * b + j] = (float)(int8_t)blk[2 + j] * d;
        }
        return 0;
    case FI_DTYPE_Q4_0:
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = p + 18 * b;
            float d = fi_gw_fp16_to_fp32(s_rd16(blk));
            for (int j = 0; j < 16; j++) {
                dst[32 * b + j] = (float)((blk[2 + j] & 0x0f) - 8) * d;
                dst[32 * b + j + 16] = (float)((blk[2 + j] >> 4) - 8) * d;
            }
        }
        return 0;
    case FI_DTYPE_Q4_1:
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = p + 20 * b;
            float d = fi_gw_fp16_to_fp32(s_rd16(blk)), m = fi_gw_fp16_to_fp32(s_rd16(blk + 2));
            for (int j = 0; j < 16; j++) {
                dst[32 * b + j] = (float)(blk[4 + j] & 0x0f) * d + m;
                dst[32 * b + j + 16] = (float)(blk[4 + j] >> 4) * d + m;
            }
        }
        return 0;
    }
    return -1;
}

/* --- the tiny Llama model ------------------------------------------------ */

/* GPT-2's printable bytes stand for themselves; the others (controls,
 * space, DEL, the Latin-1 gap and soft hyphen) map to code points 256+k in
 * byte order. */
int fi_gw_byte_symbol(uint8_t b, char out[3])
{
    unsigned cp;
    if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae)) {
        cp = b;
    } else {
        unsigned k = 0;
        for (unsigned c = 0; c < b; c++)
            if (!((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || c >= 0xae))
                k++;
        cp = 256 + k;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xc0 | cp >> 6);
    out[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

/* Merges, in rank order: left and right symbols, as in tokenizer.ggml.merges
 * ("Ġ" is the space byte). Each merged token gets the next id. */
static const char *const s_merges[FI_GW_N_MERGES][2] = {
    {"Ġ", "t"},   {"Ġ", "a"},  {"i", "n"},    {"h", "e"},   {"r", "e"},  {"o", "n"},
    {"Ġt", "he"}, {"e", "r"},  {"Ġ", "s"},    {"l", "l"},   {"H", "e"},  {"He", "ll"},
    {"Hell", "o"}, {"Ġ", "w"}, {"o", "r"},    {"Ġw", "or"}, {"l", "d"},  {"Ġwor", "ld"},
};

static const char s_chat_template[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" FI_GW_TINY_SYSTEM "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

void fi_gw_llama_defaults(fi_gw_llama_opts *o)
{
    memset(o, 0, sizeof *o);
    o->n_layers = 2;
    o->dim = 64;
    o->n_heads = 4;
    o->n_kv_heads = 2;
    o->ffn_dim = 128;
    o->n_vocab = FI_GW_TINY_MIN_VOCAB;
    o->ctx = 256;
    o->wtype = FI_DTYPE_Q8_0;
    o->embd_type = FI_DTYPE_Q8_0;
    o->tied = 1;
    o->rope_theta = 10000.0f;
    o->norm_eps = 1e-5f;
    o->seed = 42;
}

static uint64_t s_splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float s_uniform(uint64_t *s)
{
    return (float)(s_splitmix(s) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/* Adds a 1-D (cols) or 2-D (cols x rows) tensor of random values. Norms
 * (rows == 0) are F32 values near 1; matrices are scaled by 1/sqrt(cols). */
static int s_rand_tensor(fi_gw *w, uint64_t *rng, const char *name, fi_dtype t, int64_t cols,
                         int64_t rows)
{
    int64_t n = cols * (rows ? rows : 1);
    float *v = malloc((size_t)n * sizeof *v);
    if (!v)
        return s_fail(w);
    float scale = rows ? 1.0f / sqrtf((float)cols) : 0.1f;
    for (int64_t i = 0; i < n; i++)
        v[i] = (rows ? 0.0f : 1.0f) + scale * s_uniform(rng);
    int64_t ne[2] = {cols, rows};
    int rc = fi_gw_add_tensor_f32(w, name, rows ? t : FI_DTYPE_F32, rows ? 2 : 1, ne, v);
    free(v);
    return rc;
}

static int s_ftype(fi_dtype t)
{
    switch (t) {
    case FI_DTYPE_F32: return 0;
    case FI_DTYPE_F16: return 1;
    case FI_DTYPE_Q4_0: return 2;
    case FI_DTYPE_Q4_1: return 3;
    case FI_DTYPE_Q8_0: return 7;
    case FI_DTYPE_BF16: return 32;
    }
    return 0;
}

static int s_add_vocab(fi_gw *w, int n_vocab)
{
    char **tok = calloc((size_t)n_vocab, sizeof *tok);
    int32_t *type = calloc((size_t)n_vocab, sizeof *type);
    const char *merges[FI_GW_N_MERGES];
    char mbuf[FI_GW_N_MERGES][32];
    int rc = -1, i;
    if (!tok || !type)
        goto done;
    tok[0] = strdup("<|endoftext|>");
    tok[1] = strdup("<|im_start|>");
    tok[2] = strdup("<|im_end|>");
    type[0] = type[1] = type[2] = 3; /* control */
    for (i = 0; i < 256; i++) {
        char s[3];
        int n = fi_gw_byte_symbol((uint8_t)i, s);
        tok[FI_GW_TOK_BYTE0 + i] = strndup(s, (size_t)n);
        type[FI_GW_TOK_BYTE0 + i] = 1; /* normal */
    }
    for (i = 0; i < FI_GW_N_MERGES; i++) {
        snprintf(mbuf[i], sizeof mbuf[i], "%s %s", s_merges[i][0], s_merges[i][1]);
        merges[i] = mbuf[i];
        size_t a = strlen(s_merges[i][0]), b = strlen(s_merges[i][1]);
        char *m = malloc(a + b + 1);
        if (m) {
            memcpy(m, s_merges[i][0], a);
            memcpy(m + a, s_merges[i][1], b + 1);
        }
        tok[FI_GW_TOK_FIRST_MERGE + i] = m;
        type[FI_GW_TOK_FIRST_MERGE + i] = 1;
    }
    for (i = FI_GW_TINY_MIN_VOCAB; i < n_vocab; i++) {
        char s[32];
        snprintf(s, sizeof s, "<|reserved_%d|>", i - FI_GW_TINY_MIN_VOCAB);
        tok[i] = strdup(s);
        type[i] = 3;
    }
    for (i = 0; i < n_vocab; i++)
        if (!tok[i])
            goto done;
    fi_gw_add_str(w, "tokenizer.ggml.model", "gpt2");
    fi_gw_add_str(w, "tokenizer.ggml.pre", "smollm");
    fi_gw_add_str_array(w, "tokenizer.ggml.tokens", (const char *const *)tok, (uint64_t)n_vocab);
    fi_gw_add_array(w, "tokenizer.ggml.token_type", FI_GGUF_INT32, type, (uint64_t)n_vocab);
    fi_gw_add_str_array(w, "tokenizer.ggml.merges", merges, FI_GW_N_MERGES);
    fi_gw_add_u32(w, "tokenizer.ggml.bos_token_id", FI_GW_TOK_IM_START);
    fi_gw_add_u32(w, "tokenizer.ggml.eos_token_id", FI_GW_TOK_IM_END);
    fi_gw_add_u32(w, "tokenizer.ggml.unknown_token_id", FI_GW_TOK_ENDOFTEXT);
    fi_gw_add_u32(w, "tokenizer.ggml.padding_token_id", FI_GW_TOK_IM_END);
    fi_gw_add_str(w, "tokenizer.chat_template", s_chat_template);
    rc = fi_gw_failed(w) ? -1 : 0;
done:
    if (tok)
        for (i = 0; i < n_vocab; i++)
            free(tok[i]);
    free(tok);
    free(type);
    return rc < 0 ? s_fail(w) : 0;
}

static int s_opts_ok(const fi_gw_llama_opts *o)
{
    if (!o || o->n_layers < 1 || o->dim < 1 || o->n_heads < 1 || o->n_kv_heads < 1 ||
        o->ffn_dim < 1 || o->ctx < 1 || o->n_layers > 1000 || o->n_vocab > (1 << 24))
        return 0;
    if (o->dim % o->n_heads || o->n_heads % o->n_kv_heads)
        return 0;
    int kv_dim = o->dim / o->n_heads * o->n_kv_heads;
    /* Every matrix's ne[0] (dim, or ffn for ffn_down) must hold whole blocks. */
    return fi_gw_row_bytes(o->wtype, o->dim) && fi_gw_row_bytes(o->wtype, o->ffn_dim) &&
           fi_gw_row_bytes(o->embd_type, o->dim) && kv_dim > 0;
}

fi_gw *fi_gw_tiny_llama(const fi_gw_llama_opts *o)
{
    if (!s_opts_ok(o))
        return NULL;
    int n_vocab = o->n_vocab > FI_GW_TINY_MIN_VOCAB ? o->n_vocab : FI_GW_TINY_MIN_VOCAB;
    int head_dim = o->dim / o->n_heads, kv_dim = head_dim * o->n_kv_heads;
    uint64_t rng = o->seed;
    fi_gw *w = fi_gw_new();
    if (!w)
        return NULL;
    fi_gw_add_str(w, "general.architecture", "llama");
    fi_gw_add_str(w, "general.type", "model");
    fi_gw_add_str(w, "general.name", "fedinfer tiny llama");
    fi_gw_add_u32(w, "llama.block_count", (uint32_t)o->n_layers);
    fi_gw_add_u32(w, "llama.context_length", (uint32_t)o->ctx);
    fi_gw_add_u32(w, "llama.embedding_length", (uint32_t)o->dim);
    fi_gw_add_u32(w, "llama.feed_forward_length", (uint32_t)o->ffn_dim);
    fi_gw_add_u32(w, "llama.attention.head_count", (uint32_t)o->n_heads);
    fi_gw_add_u32(w, "llama.attention.head_count_kv", (uint32_t)o->n_kv_heads);
    fi_gw_add_f32(w, "llama.rope.freq_base", o->rope_theta);
    fi_gw_add_f32(w, "llama.attention.layer_norm_rms_epsilon", o->norm_eps);
    fi_gw_add_u32(w, "general.file_type", (uint32_t)s_ftype(o->wtype));
    fi_gw_add_u32(w, "llama.vocab_size", (uint32_t)n_vocab);
    fi_gw_add_u32(w, "llama.rope.dimension_count", (uint32_t)head_dim);
    fi_gw_add_bool(w, "tokenizer.ggml.add_space_prefix", 0);
    fi_gw_add_bool(w, "tokenizer.ggml.add_bos_token", 0);
    if (s_add_vocab(w, n_vocab) < 0)
        goto fail;
    fi_gw_add_u32(w, "general.quantization_version", 2);

    s_rand_tensor(w, &rng, "token_embd.weight", o->embd_type, o->dim, n_vocab);
    for (int l = 0; l < o->n_layers; l++) {
        static const struct {
            const char *name; /* blk.N.<name> */
            int cols, rows;   /* 0 dim, 1 kv_dim, 2 ffn; rows -1: a norm */
        } layer[] = {
            {"attn_norm.weight", 0, -1}, {"attn_q.weight", 0, 0},      {"attn_k.weight", 0, 1},
            {"attn_v.weight", 0, 1},     {"attn_output.weight", 0, 0}, {"ffn_norm.weight", 0, -1},
            {"ffn_gate.weight", 0, 2},   {"ffn_up.weight", 0, 2},      {"ffn_down.weight", 2, 0},
        };
        const int64_t size[3] = {o->dim, kv_dim, o->ffn_dim};
        for (size_t k = 0; k < sizeof layer / sizeof layer[0]; k++) {
            char name[64];
            snprintf(name, sizeof name, "blk.%d.%s", l, layer[k].name);
            s_rand_tensor(w, &rng, name, o->wtype, size[layer[k].cols],
                          layer[k].rows < 0 ? 0 : size[layer[k].rows]);
        }
    }
    s_rand_tensor(w, &rng, "output_norm.weight", FI_DTYPE_F32, o->dim, 0);
    if (!o->tied)
        s_rand_tensor(w, &rng, "output.weight", o->embd_type, o->dim, n_vocab);
    if (fi_gw_failed(w))
        goto fail;
    return w;
fail:
    fi_gw_destroy(&w);
    return NULL;
}

int fi_gw_tiny_llama_file(const fi_gw_llama_opts *o, const char *path)
{
    fi_gw *w = fi_gw_tiny_llama(o);
    int rc = w ? fi_gw_write_file(w, path) : -1;
    fi_gw_destroy(&w);
    return rc;
}
