/*
 * gguf.c - GGUF v2/v3 reader over mmap (see fi_gguf.h for the contract).
 *
 * The whole header is parsed and checked at open, in one pass over the
 * bytes, by a cursor (s_rd) that refuses to move past the end of the file.
 * Every count, length and size read from the file is bounded by the bytes
 * that remain before it is used, and every sum or product is computed with
 * overflow checks, so that a hostile file can neither make us read out of
 * bounds nor make us allocate much more than its own size. Tables grow as
 * entries are actually parsed, never from a count the file claims.
 *
 * Errors: one message, "<file>: <where>: <what> (at byte offset N = 0xN)",
 * where <where> names the kv or tensor by index and name.
 *
 * Lookups: keys and tensor names are indexed in two open-addressing hash
 * tables built once at open (which is also how duplicates are found).
 */
#include "fi_gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#define FI_GGUF_DEFAULT_ALIGNMENT 32u
#define FI_GGUF_MAX_KEY_LEN 65535u /* the specification's limit on keys */
#define FI_GGUF_MAX_NEST 8         /* deeper arrays of arrays are refused */
/* Smallest possible encodings, used to refuse counts that cannot fit:
 * kv = key length (8) + 1 key byte + value type (4) + 1-byte value;
 * tensor info = name length (8) + 1 name byte + n_dims (4) + ne (8) +
 * type (4) + offset (8). */
#define FI_GGUF_MIN_KV_BYTES 14u
#define FI_GGUF_MIN_TENSOR_BYTES 33u
#define FI_GGUF_FMT_ELEMS 3 /* array elements shown by fi_gguf_kv_format */

struct fi_gguf {
    const uint8_t *base;     /* the file's bytes (our mapping or the caller's buffer) */
    size_t size;             /* bytes in the file */
    int mapped;              /* 1 when base is our mmap (unmapped at close) */
    int fd;                  /* the mapped file, kept open to ask its size now; -1: none */
    uint32_t version;        /* 2 or 3 */
    uint32_t alignment;      /* general.alignment, or 32 */
    uint64_t data_offset;    /* start of the data section, from the file's start */
    int64_t n_kv;            /* entries parsed into kv */
    int64_t kv_cap;          /* allocated entries of kv */
    fi_gguf_kv *kv;          /* owned; kv[i].strs owned too */
    int64_t n_tensors;       /* entries parsed into tensors */
    int64_t tensor_cap;      /* allocated entries of tensors */
    fi_gguf_tensor *tensors; /* owned */
    int64_t *kv_index;       /* hash slots: kv index + 1, 0 = empty; kv_slots entries */
    uint64_t kv_slots;       /* power of two */
    int64_t *tensor_index;   /* hash slots: tensor index + 1, 0 = empty */
    uint64_t tensor_slots;   /* power of two */
    uint64_t hash_seed;      /* random per open: a file cannot choose colliding names */
};

/* --- element types --------------------------------------------------- */

/* ggml type ids this reader accepts, with their block shapes. Kept here
 * rather than taken from fi_kernels so that the reader stands alone. */
typedef struct s_dtype_info {
    uint32_t id;          /* ggml type id */
    const char *name;     /* as ggml names it */
    uint32_t block_elems; /* elements per block */
    uint32_t block_bytes; /* bytes per block */
} s_dtype_info;

static const s_dtype_info s_dtypes[] = {
    {FI_DTYPE_F32, "f32", 1, 4},    {FI_DTYPE_F16, "f16", 1, 2},
    {FI_DTYPE_Q4_0, "q4_0", 32, 18}, {FI_DTYPE_Q4_1, "q4_1", 32, 20},
    {FI_DTYPE_Q8_0, "q8_0", 32, 34}, {FI_DTYPE_BF16, "bf16", 1, 2},
};

/* Names of the ggml types we do not support, so that the message for a
 * k-quant or an i-quant says which one it is. Index = type id. */
static const char *const s_ggml_names[] = {
    "f32",  "f16",  "q4_0", "q4_1", "q4_2 (removed)", "q4_3 (removed)", "q5_0", "q5_1",
    "q8_0", "q8_1", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "q8_K",
    "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq4_nl", "iq3_s", "iq2_s", "iq4_xs",
    "i8",   "i16",  "i32",  "i64",  "f64",  "iq1_m", "bf16",
};

static const s_dtype_info *s_dtype(uint32_t id)
{
    for (size_t i = 0; i < sizeof s_dtypes / sizeof s_dtypes[0]; i++)
        if (s_dtypes[i].id == id)
            return &s_dtypes[i];
    return NULL;
}

/* --- metadata types --------------------------------------------------- */

static const char *const s_type_names[] = {
    "uint8", "int8",  "uint16", "int16", "uint32", "int32",  "float32",
    "bool",  "string", "array", "uint64", "int64", "float64",
};

const char *fi_gguf_type_name(fi_gguf_type t)
{
    if ((unsigned)t < sizeof s_type_names / sizeof s_type_names[0])
        return s_type_names[t];
    return "unknown";
}

/* Bytes of a scalar of type t; 0 for string, array and unknown types. */
static uint64_t s_scalar_size(uint32_t t)
{
    switch (t) {
    case FI_GGUF_UINT8: case FI_GGUF_INT8: case FI_GGUF_BOOL: return 1;
    case FI_GGUF_UINT16: case FI_GGUF_INT16: return 2;
    case FI_GGUF_UINT32: case FI_GGUF_INT32: case FI_GGUF_FLOAT32: return 4;
    case FI_GGUF_UINT64: case FI_GGUF_INT64: case FI_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static int s_type_known(uint32_t t)
{
    return t <= FI_GGUF_FLOAT64;
}

/* --- little-endian loads (the mapping is not aligned for us) ----------- */

static uint32_t s_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t s_le64(const uint8_t *p)
{
    return (uint64_t)s_le32(p) | (uint64_t)s_le32(p + 4) << 32;
}

/* --- the cursor and its error messages -------------------------------- */

typedef struct s_rd {
    const uint8_t *base; /* file bytes */
    uint64_t size;       /* file size */
    uint64_t pos;        /* next byte to read; always <= size */
    const char *name;    /* file name for messages */
    char *err;           /* caller's message buffer (may be NULL) */
    size_t errlen;       /* its capacity */
    char where[224];     /* "kv 3 'general.name'", "" for the header */
} s_rd;

/* Contract in fi_gguf.h. */
void fi_gguf_name_format(fi_str s, size_t max, char *buf, size_t cap)
{
    size_t n = 0;
    uint64_t i;
    if (!cap)
        return;
    for (i = 0; i < s.len && n + 4 < cap && i < max; i++) {
        unsigned char c = (unsigned char)s.ptr[i];
        buf[n++] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
    }
    if (i < s.len && n + 4 <= cap) {
        memcpy(buf + n, "...", 3);
        n += 3;
    }
    buf[n] = '\0';
}

/* Copies at most ~80 bytes of s into buf as printable text. */
static void s_printable(fi_str s, char *buf, size_t cap)
{
    fi_gguf_name_format(s, 80, buf, cap);
}

static void s_where(s_rd *r, const char *what, int64_t idx, const fi_str *name)
{
    if (name) {
        char nb[96];
        s_printable(*name, nb, sizeof nb);
        snprintf(r->where, sizeof r->where, "%s %" PRId64 " '%s'", what, idx, nb);
    } else if (idx >= 0) {
        snprintf(r->where, sizeof r->where, "%s %" PRId64, what, idx);
    } else {
        snprintf(r->where, sizeof r->where, "%s", what);
    }
}

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void s_fail(const s_rd *r, uint64_t off, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    if (!r->err || r->errlen == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int n = snprintf(r->err, r->errlen, "%s: %s%s%s (at byte offset %" PRIu64 " = 0x%" PRIx64 ")",
                     r->name, r->where, r->where[0] ? ": " : "", msg, off, off);
    (void)n;
}

static uint64_t s_left(const s_rd *r)
{
    return r->size - r->pos;
}

/* Fails unless n more bytes are available for `what`. */
static int s_need(s_rd *r, uint64_t n, const char *what)
{
    if (n > s_left(r)) {
        s_fail(r, r->pos,
               "truncated file: %s needs %" PRIu64 " bytes but only %" PRIu64
               " remain (file is %" PRIu64 " bytes)",
               what, n, s_left(r), r->size);
        return -1;
    }
    return 0;
}

static int s_u32(s_rd *r, uint32_t *v, const char *what)
{
    if (s_need(r, 4, what) < 0)
        return -1;
    *v = s_le32(r->base + r->pos);
    r->pos += 4;
    return 0;
}

static int s_u64(s_rd *r, uint64_t *v, const char *what)
{
    if (s_need(r, 8, what) < 0)
        return -1;
    *v = s_le64(r->base + r->pos);
    r->pos += 8;
    return 0;
}

/* A gguf string: u64 length then bytes. `what` names it in messages, with
 * " <idx> of the array" appended when idx is not UINT64_MAX. Messages are
 * only formatted on failure: this runs once per vocabulary entry. */
static int s_str(s_rd *r, fi_str *s, const char *what, uint64_t idx)
{
    uint64_t at = r->pos, len = 0;
    char name[96];
    if (s_left(r) < 8 || (len = s_le64(r->base + r->pos)) > s_left(r) - 8) {
        if (idx == UINT64_MAX)
            snprintf(name, sizeof name, "%s", what);
        else
            snprintf(name, sizeof name, "%s %" PRIu64 " of the array", what, idx);
        if (s_left(r) < 8) {
            char lw[128];
            snprintf(lw, sizeof lw, "length of %s", name);
            return s_need(r, 8, lw);
        }
        s_fail(r, at,
               "%s length %" PRIu64 " exceeds the %" PRIu64 " bytes left in the file (%" PRIu64
               " bytes)",
               name, len, s_left(r) - 8, r->size);
        return -1;
    }
    r->pos += 8;
    s->ptr = (const char *)r->base + r->pos;
    s->len = len;
    r->pos += len;
    return 0;
}

/* --- metadata values ----------------------------------------------------- */

/* Parses an array body (element type and count already read) of `count`
 * elements of type `et`. When strs is not NULL (top-level string arrays),
 * it receives the strings. Nested arrays recurse up to FI_GGUF_MAX_NEST. */
static int s_array_body(s_rd *r, uint32_t et, uint64_t count, fi_str *strs, int depth)
{
    uint64_t at = r->pos;
    uint64_t esz = s_scalar_size(et);
    if (esz) {
        if (count > s_left(r) / esz) {
            s_fail(r, at,
                   "array of %" PRIu64 " x %s exceeds the %" PRIu64
                   " bytes left in the file (%" PRIu64 " bytes)",
                   count, fi_gguf_type_name((fi_gguf_type)et), s_left(r), r->size);
            return -1;
        }
        if (et == FI_GGUF_BOOL) {
            for (uint64_t i = 0; i < count; i++) {
                uint8_t b = r->base[r->pos + i];
                if (b > 1) {
                    s_fail(r, r->pos + i, "bool array element %" PRIu64 " is %u, not 0 or 1", i,
                           b);
                    return -1;
                }
            }
        }
        r->pos += count * esz;
        return 0;
    }
    if (et == FI_GGUF_STRING) {
        if (count > s_left(r) / 8) {
            s_fail(r, at,
                   "array of %" PRIu64 " strings cannot fit in the %" PRIu64
                   " bytes left in the file (%" PRIu64 " bytes)",
                   count, s_left(r), r->size);
            return -1;
        }
        for (uint64_t i = 0; i < count; i++) {
            fi_str s;
            if (s_str(r, &s, "string", i) < 0)
                return -1;
            if (strs)
                strs[i] = s;
        }
        return 0;
    }
    /* et == ARRAY: each element is itself (type, count, body). */
    if (depth + 1 > FI_GGUF_MAX_NEST) {
        s_fail(r, at, "arrays nested more than %d deep", FI_GGUF_MAX_NEST);
        return -1;
    }
    if (count > s_left(r) / 12) {
        s_fail(r, at,
               "array of %" PRIu64 " arrays cannot fit in the %" PRIu64
               " bytes left in the file (%" PRIu64 " bytes)",
               count, s_left(r), r->size);
        return -1;
    }
    for (uint64_t i = 0; i < count; i++) {
        uint32_t t2;
        uint64_t n2, at2 = r->pos;
        if (s_u32(r, &t2, "nested array element type") < 0 ||
            s_u64(r, &n2, "nested array length") < 0)
            return -1;
        if (!s_type_known(t2)) {
            s_fail(r, at2, "nested array %" PRIu64 " has unknown element type %u", i, t2);
            return -1;
        }
        if (s_array_body(r, t2, n2, NULL, depth + 1) < 0)
            return -1;
    }
    return 0;
}

/* Parses the value of kv (its type already in kv->type). */
static int s_value(s_rd *r, fi_gguf_kv *kv)
{
    uint64_t at = r->pos;
    if (kv->type == FI_GGUF_STRING) {
        fi_str s;
        kv->data = r->base + r->pos; /* the gguf string: u64 length, bytes */
        return s_str(r, &s, "string value", UINT64_MAX);
    }
    if (kv->type != FI_GGUF_ARRAY) {
        uint64_t sz = s_scalar_size(kv->type);
        if (s_need(r, sz, fi_gguf_type_name(kv->type)) < 0)
            return -1;
        if (kv->type == FI_GGUF_BOOL && r->base[r->pos] > 1) {
            s_fail(r, at, "bool value is %u, not 0 or 1", r->base[r->pos]);
            return -1;
        }
        kv->data = r->base + r->pos;
        r->pos += sz;
        return 0;
    }
    uint32_t et;
    uint64_t n;
    if (s_u32(r, &et, "array element type") < 0)
        return -1;
    if (!s_type_known(et)) {
        s_fail(r, at, "array has unknown element type %u (known: 0..12)", et);
        return -1;
    }
    if (s_u64(r, &n, "array length") < 0)
        return -1;
    kv->arr_type = (fi_gguf_type)et;
    kv->arr_len = n;
    kv->data = r->base + r->pos;
    fi_str *strs = NULL;
    if (et == FI_GGUF_STRING) {
        if (n > s_left(r) / 8) {
            s_fail(r, r->pos,
                   "array of %" PRIu64 " strings cannot fit in the %" PRIu64
                   " bytes left in the file (%" PRIu64 " bytes)",
                   n, s_left(r), r->size);
            return -1;
        }
        strs = calloc(n ? n : 1, sizeof *strs);
        if (!strs) {
            s_fail(r, at, "out of memory for a table of %" PRIu64 " strings", n);
            return -1;
        }
        kv->strs = strs; /* owned by the handle from here on */
    }
    return s_array_body(r, et, n, strs, 0);
}

/* --- hash index ---------------------------------------------------------- */

/* FNV-1a from a seeded start, then mixed (murmur3's finaliser): the
 * index uses the low bits, which in plain FNV-1a depend only on the low
 * bits of every step, so a crafted file could make all its names collide
 * and every lookup scan them all. With a random seed per open and the
 * mix, it cannot choose collisions. */
static uint64_t s_hash(const fi_gguf *g, const char *p, uint64_t n)
{
    uint64_t h = 1469598103934665603ull ^ g->hash_seed;
    for (uint64_t i = 0; i < n; i++) {
        h ^= (unsigned char)p[i];
        h *= 1099511628211ull;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

/* A random seed for s_hash (getrandom; failing that, addresses and time). */
static uint64_t s_seed(const void *g)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, GRND_NONBLOCK) == (ssize_t)sizeof v)
        return v;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)(uintptr_t)g ^ ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec;
}

static int s_str_same(fi_str a, fi_str b)
{
    return a.len == b.len && (a.len == 0 || memcmp(a.ptr, b.ptr, a.len) == 0);
}

/* Builds a table of slots for n names (name_of(i)). Returns 0, or -1 on
 * allocation failure; *dup receives (i, first) of the first duplicate, or
 * -1. */
typedef fi_str (*s_name_fn)(const fi_gguf *g, int64_t i);

static fi_str s_kv_name(const fi_gguf *g, int64_t i)
{
    return g->kv[i].key;
}

static fi_str s_tensor_name(const fi_gguf *g, int64_t i)
{
    return g->tensors[i].name;
}

static int s_index_build(const fi_gguf *g, int64_t n, s_name_fn name_of, int64_t **slots_out,
                         uint64_t *nslots_out, int64_t *dup, int64_t *first)
{
    uint64_t cap = 8;
    while (cap < (uint64_t)n * 2)
        cap *= 2;
    int64_t *slots = calloc(cap, sizeof *slots);
    if (!slots)
        return -1;
    *slots_out = slots;
    *nslots_out = cap;
    *dup = -1;
    for (int64_t i = 0; i < n; i++) {
        fi_str s = name_of(g, i);
        uint64_t h = s_hash(g, s.ptr, s.len) & (cap - 1);
        while (slots[h]) {
            if (s_str_same(name_of(g, slots[h] - 1), s)) {
                *dup = i;
                *first = slots[h] - 1;
                return 0;
            }
            h = (h + 1) & (cap - 1);
        }
        slots[h] = i + 1;
    }
    return 0;
}

static int64_t s_index_find(const fi_gguf *g, const int64_t *slots, uint64_t cap,
                            s_name_fn name_of, const char *c)
{
    if (!slots || !c)
        return -1;
    size_t n = strlen(c);
    uint64_t h = s_hash(g, c, n) & (cap - 1);
    while (slots[h]) {
        if (fi_str_eq(name_of(g, slots[h] - 1), c))
            return slots[h] - 1;
        h = (h + 1) & (cap - 1);
    }
    return -1;
}

/* --- tables that grow as entries are parsed ---------------------------- */

static int s_grow(void **arr, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    int64_t nc = *cap ? *cap * 2 : 64;
    while (nc < need)
        nc *= 2;
    void *p = realloc(*arr, (size_t)nc * elem);
    if (!p)
        return -1;
    memset((char *)p + (size_t)*cap * elem, 0, (size_t)(nc - *cap) * elem);
    *arr = p;
    *cap = nc;
    return 0;
}

/* --- tensors ------------------------------------------------------------- */

static int s_mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a && b > UINT64_MAX / a)
        return -1;
    *out = a * b;
    return 0;
}

/* Parses tensor info i (data range checked later, once the data section's
 * start is known). */
static int s_tensor_info(s_rd *r, fi_gguf *g, int64_t i)
{
    fi_gguf_tensor *t = &g->tensors[i];
    uint64_t at = r->pos;
    s_where(r, "tensor", i, NULL);
    if (s_str(r, &t->name, "tensor name", UINT64_MAX) < 0)
        return -1;
    if (t->name.len == 0) {
        s_fail(r, at, "empty tensor name");
        return -1;
    }
    if (memchr(t->name.ptr, '\0', t->name.len)) {
        s_where(r, "tensor", i, &t->name);
        s_fail(r, at, "tensor name contains a NUL byte");
        return -1;
    }
    s_where(r, "tensor", i, &t->name);
    uint64_t dims_at = r->pos;
    if (s_u32(r, &t->n_dims, "n_dims") < 0)
        return -1;
    if (t->n_dims < 1 || t->n_dims > FI_GGUF_MAX_DIMS) {
        s_fail(r, dims_at, "n_dims = %u is outside 1..%d", t->n_dims, FI_GGUF_MAX_DIMS);
        return -1;
    }
    for (int d = 0; d < FI_GGUF_MAX_DIMS; d++)
        t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        uint64_t ne, ne_at = r->pos;
        char what[16];
        snprintf(what, sizeof what, "ne[%u]", d);
        if (s_u64(r, &ne, what) < 0)
            return -1;
        if (ne > (uint64_t)INT64_MAX) {
            s_fail(r, ne_at, "ne[%u] = %" PRId64 " is negative", d, (int64_t)ne);
            return -1;
        }
        if (ne == 0) {
            s_fail(r, ne_at, "ne[%u] = 0: every dimension must be at least 1", d);
            return -1;
        }
        t->ne[d] = (int64_t)ne;
    }
    uint32_t type;
    uint64_t type_at = r->pos;
    if (s_u32(r, &type, "tensor type") < 0)
        return -1;
    const s_dtype_info *dt = s_dtype(type);
    if (!dt) {
        if (type < sizeof s_ggml_names / sizeof s_ggml_names[0])
            s_fail(r, type_at,
                   "tensor type %u (%s) is not supported (supported: f32, f16, bf16, q4_0, "
                   "q4_1, q8_0)",
                   type, s_ggml_names[type]);
        else
            s_fail(r, type_at, "unknown tensor type %u", type);
        return -1;
    }
    t->type = (fi_dtype)type;
    uint64_t off_at = r->pos;
    if (s_u64(r, &t->offset, "tensor data offset") < 0)
        return -1;

    /* Size: ne[0] whole blocks per row, rows = ne[1]*ne[2]*ne[3]. */
    if ((uint64_t)t->ne[0] % dt->block_elems) {
        s_fail(r, dims_at, "ne[0] = %" PRId64 " is not a multiple of the %s block size %u",
               t->ne[0], dt->name, dt->block_elems);
        return -1;
    }
    uint64_t elems = (uint64_t)t->ne[0], rows = 1, row_bytes;
    for (int d = 1; d < FI_GGUF_MAX_DIMS; d++) {
        if (s_mul_u64(rows, (uint64_t)t->ne[d], &rows) < 0 ||
            s_mul_u64(elems, (uint64_t)t->ne[d], &elems) < 0 || elems > (uint64_t)INT64_MAX) {
            s_fail(r, dims_at,
                   "element count %" PRId64 " x %" PRId64 " x %" PRId64 " x %" PRId64
                   " overflows int64",
                   t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
            return -1;
        }
    }
    if (s_mul_u64((uint64_t)t->ne[0] / dt->block_elems, dt->block_bytes, &row_bytes) < 0 ||
        s_mul_u64(row_bytes, rows, &t->n_bytes) < 0 || t->n_bytes > (uint64_t)INT64_MAX) {
        s_fail(r, dims_at,
               "data size of %" PRId64 " x %" PRId64 " x %" PRId64 " x %" PRId64
               " %s elements overflows",
               t->ne[0], t->ne[1], t->ne[2], t->ne[3], dt->name);
        return -1;
    }
    if (t->offset % g->alignment) {
        s_fail(r, off_at,
               "data offset %" PRIu64 " (0x%" PRIx64 ") is not a multiple of the alignment %u",
               t->offset, t->offset, g->alignment);
        return -1;
    }
    return 0;
}

/* File offset of tensor i's info (its name's length field). */
static uint64_t s_tensor_info_at(const fi_gguf *g, int64_t i)
{
    return (uint64_t)((const uint8_t *)g->tensors[i].name.ptr - g->base) - 8;
}

static uint64_t s_kv_at_offset(const fi_gguf *g, int64_t i)
{
    return (uint64_t)((const uint8_t *)g->kv[i].key.ptr - g->base) - 8;
}

/* A tensor's data offset with its index, for sorting by offset. */
typedef struct s_span {
    uint64_t offset; /* from the data section's start */
    int64_t idx;     /* tensor index */
} s_span;

static int s_cmp_span(const void *a, const void *b)
{
    const s_span *x = a, *y = b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* --- open ---------------------------------------------------------------- */

static int s_parse(fi_gguf *g, s_rd *r);

static fi_gguf *s_open(const uint8_t *base, size_t size, int mapped, const char *name, char *err,
                       size_t errlen)
{
    s_rd r = {.base = base, .size = size, .name = name ? name : "(memory)", .err = err,
              .errlen = errlen};
    if (err && errlen)
        err[0] = '\0';
    fi_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        if (mapped)
            munmap((void *)base, size);
        s_fail(&r, 0, "out of memory");
        return NULL;
    }
    g->base = base;
    g->size = size;
    g->mapped = mapped;
    g->fd = -1;
    g->hash_seed = s_seed(g);
    g->alignment = FI_GGUF_DEFAULT_ALIGNMENT;
    if (s_parse(g, &r) < 0) {
        fi_gguf_close(&g);
        return NULL;
    }
    return g;
}

static int s_parse_header(fi_gguf *g, s_rd *r, uint64_t *n_tensors, uint64_t *n_kv)
{
    s_where(r, "header", -1, NULL);
    if (s_need(r, 4, "magic") < 0)
        return -1;
    if (memcmp(r->base, "GGUF", 4) != 0) {
        char m[8];
        fi_str s = {(const char *)r->base, 4};
        s_printable(s, m, sizeof m);
        s_fail(r, 0, "bad magic '%s' (0x%08x): not a GGUF file (expected 'GGUF')", m,
               s_le32(r->base));
        return -1;
    }
    r->pos = 4;
    if (s_u32(r, &g->version, "version") < 0)
        return -1;
    if (g->version == 1) {
        s_fail(r, 4, "GGUF version 1 is not supported (this reader reads versions 2 and 3; "
                     "convert the file with a current llama.cpp)");
        return -1;
    }
    if (g->version != 2 && g->version != 3) {
        uint32_t sw = __builtin_bswap32(g->version);
        if (sw >= 1 && sw <= 3)
            s_fail(r, 4, "big-endian GGUF (version %u byte-swapped) is not supported", sw);
        else
            s_fail(r, 4, "unsupported GGUF version %u (this reader reads versions 2 and 3)",
                   g->version);
        return -1;
    }
    uint64_t tc_at = r->pos;
    if (s_u64(r, n_tensors, "tensor count") < 0)
        return -1;
    uint64_t kc_at = r->pos;
    if (s_u64(r, n_kv, "kv count") < 0)
        return -1;
    uint64_t left = s_left(r);
    if (*n_kv > left / FI_GGUF_MIN_KV_BYTES) {
        s_fail(r, kc_at,
               "kv count %" PRIu64 " cannot fit in the %" PRIu64
               " bytes left in the file (each kv takes at least %u bytes)",
               *n_kv, left, FI_GGUF_MIN_KV_BYTES);
        return -1;
    }
    if (*n_tensors > left / FI_GGUF_MIN_TENSOR_BYTES ||
        *n_kv * FI_GGUF_MIN_KV_BYTES + *n_tensors * FI_GGUF_MIN_TENSOR_BYTES > left) {
        s_fail(r, tc_at,
               "tensor count %" PRIu64 " (with %" PRIu64 " kvs) cannot fit in the %" PRIu64
               " bytes left in the file (each tensor info takes at least %u bytes)",
               *n_tensors, *n_kv, left, FI_GGUF_MIN_TENSOR_BYTES);
        return -1;
    }
    return 0;
}

static int s_parse_kvs(fi_gguf *g, s_rd *r, uint64_t n_kv)
{
    for (uint64_t i = 0; i < n_kv; i++) {
        if (s_grow((void **)&g->kv, &g->kv_cap, (int64_t)i + 1, sizeof *g->kv) < 0) {
            s_fail(r, r->pos, "out of memory");
            return -1;
        }
        fi_gguf_kv *kv = &g->kv[i];
        uint64_t at = r->pos;
        g->n_kv = (int64_t)i + 1;
        s_where(r, "kv", (int64_t)i, NULL);
        if (s_str(r, &kv->key, "key", UINT64_MAX) < 0)
            return -1;
        if (kv->key.len == 0) {
            s_fail(r, at, "empty key");
            return -1;
        }
        if (kv->key.len > FI_GGUF_MAX_KEY_LEN) {
            s_fail(r, at, "key length %" PRIu64 " exceeds %u", kv->key.len, FI_GGUF_MAX_KEY_LEN);
            return -1;
        }
        s_where(r, "kv", (int64_t)i, &kv->key);
        const char *nul = memchr(kv->key.ptr, '\0', kv->key.len);
        if (nul) {
            s_fail(r, at + 8 + (uint64_t)(nul - kv->key.ptr),
                   "key contains a NUL byte at position %td", nul - kv->key.ptr);
            return -1;
        }
        uint32_t type;
        uint64_t type_at = r->pos;
        if (s_u32(r, &type, "value type") < 0)
            return -1;
        if (!s_type_known(type)) {
            s_fail(r, type_at, "unknown value type %u (known: 0..12)", type);
            return -1;
        }
        kv->type = (fi_gguf_type)type;
        if (s_value(r, kv) < 0)
            return -1;
    }
    return 0;
}

static int s_check_alignment(fi_gguf *g, s_rd *r)
{
    int64_t i = s_index_find(g, g->kv_index, g->kv_slots, s_kv_name, "general.alignment");
    if (i < 0)
        return 0;
    const fi_gguf_kv *kv = &g->kv[i];
    s_where(r, "kv", i, &kv->key);
    uint64_t at = s_kv_at_offset(g, i);
    if (kv->type != FI_GGUF_UINT32) {
        s_fail(r, at, "general.alignment has type %s, expected uint32",
               fi_gguf_type_name(kv->type));
        return -1;
    }
    uint32_t a = s_le32(kv->data);
    if (a == 0 || (a & (a - 1)) != 0) {
        s_fail(r, at, "general.alignment = %u is not a nonzero power of two", a);
        return -1;
    }
    g->alignment = a;
    return 0;
}

static int s_check_data(fi_gguf *g, s_rd *r)
{
    /* Every tensor's data inside the file. */
    for (int64_t i = 0; i < g->n_tensors; i++) {
        fi_gguf_tensor *t = &g->tensors[i];
        uint64_t start, end;
        s_where(r, "tensor", i, &t->name);
        if (t->offset > UINT64_MAX - g->data_offset ||
            (start = g->data_offset + t->offset) > UINT64_MAX - t->n_bytes ||
            (end = start + t->n_bytes) > g->size) {
            uint64_t shown = t->offset <= UINT64_MAX - g->data_offset ? g->data_offset + t->offset
                                                                       : t->offset;
            s_fail(r, s_tensor_info_at(g, i),
                   "data [file offset 0x%" PRIx64 ", %" PRIu64
                   " bytes] extends past end of file (%" PRIu64 " bytes)",
                   shown, t->n_bytes, g->size);
            return -1;
        }
        t->data = g->base + start;
    }
    /* No two tensors share bytes. */
    if (g->n_tensors < 2)
        return 0;
    s_span *ord = malloc((size_t)g->n_tensors * sizeof *ord);
    if (!ord) {
        s_fail(r, 0, "out of memory");
        return -1;
    }
    for (int64_t i = 0; i < g->n_tensors; i++)
        ord[i] = (s_span){g->tensors[i].offset, i};
    qsort(ord, (size_t)g->n_tensors, sizeof *ord, s_cmp_span);
    int rc = 0;
    for (int64_t k = 1; k < g->n_tensors; k++) {
        const fi_gguf_tensor *a = &g->tensors[ord[k - 1].idx], *b = &g->tensors[ord[k].idx];
        if (a->offset + a->n_bytes > b->offset) {
            char an[96];
            s_printable(a->name, an, sizeof an);
            s_where(r, "tensor", ord[k].idx, &b->name);
            s_fail(r, s_tensor_info_at(g, ord[k].idx),
                   "data [offset 0x%" PRIx64 ", %" PRIu64 " bytes] overlaps tensor %" PRId64
                   " '%s' [offset 0x%" PRIx64 ", %" PRIu64 " bytes]",
                   b->offset, b->n_bytes, ord[k - 1].idx, an, a->offset, a->n_bytes);
            rc = -1;
            break;
        }
    }
    free(ord);
    return rc;
}

static int s_parse(fi_gguf *g, s_rd *r)
{
    uint64_t n_tensors, n_kv;
    int64_t dup, first;
    if (s_parse_header(g, r, &n_tensors, &n_kv) < 0 || s_parse_kvs(g, r, n_kv) < 0)
        return -1;
    if (s_index_build(g, g->n_kv, s_kv_name, &g->kv_index, &g->kv_slots, &dup, &first) < 0) {
        s_fail(r, r->pos, "out of memory");
        return -1;
    }
    if (dup >= 0) {
        s_where(r, "kv", dup, &g->kv[dup].key);
        s_fail(r, s_kv_at_offset(g, dup), "duplicate key (first defined at kv %" PRId64 ")",
               first);
        return -1;
    }
    if (s_check_alignment(g, r) < 0)
        return -1;
    for (uint64_t i = 0; i < n_tensors; i++) {
        if (s_grow((void **)&g->tensors, &g->tensor_cap, (int64_t)i + 1, sizeof *g->tensors) < 0) {
            s_fail(r, r->pos, "out of memory");
            return -1;
        }
        g->n_tensors = (int64_t)i + 1;
        if (s_tensor_info(r, g, (int64_t)i) < 0)
            return -1;
    }
    if (s_index_build(g, g->n_tensors, s_tensor_name, &g->tensor_index, &g->tensor_slots, &dup,
                      &first) < 0) {
        s_fail(r, r->pos, "out of memory");
        return -1;
    }
    if (dup >= 0) {
        s_where(r, "tensor", dup, &g->tensors[dup].name);
        s_fail(r, s_tensor_info_at(g, dup),
               "duplicate tensor name (first defined at tensor %" PRId64 ")", first);
        return -1;
    }
    /* The data section starts at the next multiple of the alignment. */
    uint64_t pad = (g->alignment - r->pos % g->alignment) % g->alignment;
    g->data_offset = r->pos + pad; /* pos <= size < 2^63: no overflow */
    return s_check_data(g, r);
}

fi_gguf *fi_gguf_open_memory(const void *buf, size_t len, const char *name, char *err,
                             size_t errlen)
{
    if (!buf && len) {
        s_rd r = {.name = name ? name : "(memory)", .err = err, .errlen = errlen};
        s_fail(&r, 0, "NULL buffer");
        return NULL;
    }
    return s_open(buf ? buf : "", len, 0, name, err, errlen);
}

fi_gguf *fi_gguf_open(const char *path, char *err, size_t errlen)
{
    s_rd r = {.name = path ? path : "(null)", .err = err, .errlen = errlen};
    struct stat st;
    if (err && errlen)
        err[0] = '\0';
    if (!path) {
        s_fail(&r, 0, "no path given");
        return NULL;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        s_fail(&r, 0, "cannot open: %s", strerror(errno));
        return NULL;
    }
    if (fstat(fd, &st) < 0) {
        s_fail(&r, 0, "cannot stat: %s", strerror(errno));
        close(fd);
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        s_fail(&r, 0, "not a regular file");
        close(fd);
        return NULL;
    }
    size_t size = (size_t)st.st_size;
    if (size == 0) {
        close(fd);
        return s_open((const uint8_t *)"", 0, 0, path, err, errlen);
    }
    void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    if (p == MAP_FAILED) {
        close(fd);
        s_fail(&r, 0, "cannot mmap %zu bytes: %s", size, strerror(e));
        return NULL;
    }
    fi_gguf *g = s_open(p, size, 1, path, err, errlen);
    if (g)
        g->fd = fd; /* fi_gguf_check_size asks it */
    else
        close(fd);
    return g;
}

int fi_gguf_check_size(const fi_gguf *g, const char *name, char *err, size_t errlen)
{
    struct stat st;
    if (!g->mapped || g->fd < 0)
        return 0;
    if (fstat(g->fd, &st) < 0) {
        snprintf(err, errlen, "%s: cannot stat the loaded file: %s", name, strerror(errno));
        return -1;
    }
    if ((uint64_t)st.st_size != (uint64_t)g->size) {
        snprintf(err, errlen, "%s: the loaded file changed size in place (%zu bytes at the load, %lld "
                 "now): it is not the model that was loaded", name, g->size, (long long)st.st_size);
        return -1;
    }
    return 0;
}

void fi_gguf_close(fi_gguf **gp)
{
    if (!gp || !*gp)
        return;
    fi_gguf *g = *gp;
    for (int64_t i = 0; i < g->n_kv; i++)
        free((void *)g->kv[i].strs);
    free(g->kv);
    free(g->tensors);
    free(g->kv_index);
    free(g->tensor_index);
    if (g->mapped)
        munmap((void *)g->base, g->size);
    if (g->fd >= 0)
        close(g->fd);
    free(g);
    *gp = NULL;
}

/* --- accessors ----------------------------------------------------------- */

uint32_t fi_gguf_version(const fi_gguf *g) { return g->version; }
void fi_gguf_sha256(const fi_gguf *g, char hex[65]) {
    uint8_t h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, g->base, g->size);
    sodium_bin2hex(hex, 65, h, sizeof h);
}

size_t fi_gguf_file_size(const fi_gguf *g) { return g->size; }
uint32_t fi_gguf_alignment(const fi_gguf *g) { return g->alignment; }
uint64_t fi_gguf_data_offset(const fi_gguf *g) { return g->data_offset; }
int64_t fi_gguf_n_kv(const fi_gguf *g) { return g->n_kv; }
int64_t fi_gguf_n_tensors(const fi_gguf *g) { return g->n_tensors; }

const fi_gguf_kv *fi_gguf_kv_at(const fi_gguf *g, int64_t i)
{
    return (i >= 0 && i < g->n_kv) ? &g->kv[i] : NULL;
}

const fi_gguf_kv *fi_gguf_find(const fi_gguf *g, const char *key)
{
    int64_t i = s_index_find(g, g->kv_index, g->kv_slots, s_kv_name, key);
    return i < 0 ? NULL : &g->kv[i];
}

const fi_gguf_tensor *fi_gguf_tensor_at(const fi_gguf *g, int64_t i)
{
    return (i >= 0 && i < g->n_tensors) ? &g->tensors[i] : NULL;
}

const fi_gguf_tensor *fi_gguf_find_tensor(const fi_gguf *g, const char *name)
{
    int64_t i = s_index_find(g, g->tensor_index, g->tensor_slots, s_tensor_name, name);
    return i < 0 ? NULL : &g->tensors[i];
}

int fi_str_eq(fi_str s, const char *c)
{
    if (!c)
        return 0;
    size_t n = strlen(c);
    return s.len == n && (n == 0 || memcmp(s.ptr, c, n) == 0);
}

int fi_gguf_kv_str(const fi_gguf_kv *kv, fi_str *out)
{
    if (!kv || kv->type != FI_GGUF_STRING)
        return -1;
    const uint8_t *p = kv->data;
    out->len = s_le64(p);
    out->ptr = (const char *)p + 8;
    return 0;
}

/* Reads an integer scalar at p of type t: *neg = 1 with *sv for negative
 * values, else *uv. -1 when t is not an integer type. */
static int s_int_at(const uint8_t *p, fi_gguf_type t, int *neg, int64_t *sv, uint64_t *uv)
{
    int64_t s;
    *neg = 0;
    switch (t) {
    case FI_GGUF_UINT8: *uv = p[0]; return 0;
    case FI_GGUF_UINT16: *uv = (uint64_t)p[0] | (uint64_t)p[1] << 8; return 0;
    case FI_GGUF_UINT32: *uv = s_le32(p); return 0;
    case FI_GGUF_UINT64: *uv = s_le64(p); return 0;
    case FI_GGUF_INT8: s = (int8_t)p[0]; break;
    case FI_GGUF_INT16: s = (int16_t)(uint16_t)((unsigned)p[0] | (unsigned)p[1] << 8); break;
    case FI_GGUF_INT32: s = (int32_t)s_le32(p); break;
    case FI_GGUF_INT64: s = (int64_t)s_le64(p); break;
    default: return -1;
    }
    if (s < 0) {
        *neg = 1;
        *sv = s;
    } else {
        *uv = (uint64_t)s;
    }
    return 0;
}

int fi_gguf_arr_i64(const fi_gguf_kv *kv, uint64_t i, int64_t *out)
{
    int neg;
    int64_t sv;
    uint64_t uv;
    if (!kv || kv->type != FI_GGUF_ARRAY || i >= kv->arr_len || !s_scalar_size(kv->arr_type))
        return -1;
    const uint8_t *p = (const uint8_t *)kv->data + i * s_scalar_size(kv->arr_type);
    if (s_int_at(p, kv->arr_type, &neg, &sv, &uv) < 0 || (!neg && uv > (uint64_t)INT64_MAX))
        return -1;
    *out = neg ? sv : (int64_t)uv;
    return 0;
}

int fi_gguf_get_u32(const fi_gguf *g, const char *key, uint32_t *out)
{
    const fi_gguf_kv *kv = fi_gguf_find(g, key);
    int neg;
    int64_t sv;
    uint64_t uv;
    if (!kv || s_int_at(kv->data, kv->type, &neg, &sv, &uv) < 0 || neg || uv > UINT32_MAX)
        return -1;
    *out = (uint32_t)uv;
    return 0;
}

int fi_gguf_get_i64(const fi_gguf *g, const char *key, int64_t *out)
{
    const fi_gguf_kv *kv = fi_gguf_find(g, key);
    int neg;
    int64_t sv;
    uint64_t uv;
    if (!kv || s_int_at(kv->data, kv->type, &neg, &sv, &uv) < 0)
        return -1;
    if (neg) {
        *out = sv;
        return 0;
    }
    if (uv > (uint64_t)INT64_MAX)
        return -1;
    *out = (int64_t)uv;
    return 0;
}

static float s_f32_at(const uint8_t *p)
{
    uint32_t u = s_le32(p);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static double s_f64_at(const uint8_t *p)
{
    uint64_t u = s_le64(p);
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

int fi_gguf_arr_f32(const fi_gguf_kv *kv, uint64_t i, float *out)
{
    if (!kv || kv->type != FI_GGUF_ARRAY || i >= kv->arr_len)
        return -1;
    const uint8_t *p = kv->data;
    if (kv->arr_type == FI_GGUF_FLOAT32)
        *out = s_f32_at(p + 4 * i);
    else if (kv->arr_type == FI_GGUF_FLOAT64)
        *out = (float)s_f64_at(p + 8 * i);
    else
        return -1;
    return 0;
}

int fi_gguf_get_f32(const fi_gguf *g, const char *key, float *out)
{
    const fi_gguf_kv *kv = fi_gguf_find(g, key);
    if (!kv)
        return -1;
    if (kv->type == FI_GGUF_FLOAT32) {
        *out = s_f32_at(kv->data);
        return 0;
    }
    if (kv->type == FI_GGUF_FLOAT64) {
        *out = (float)s_f64_at(kv->data);
        return 0;
    }
    return -1;
}

int fi_gguf_get_bool(const fi_gguf *g, const char *key, int *out)
{
    const fi_gguf_kv *kv = fi_gguf_find(g, key);
    if (!kv || kv->type != FI_GGUF_BOOL)
        return -1;
    *out = ((const uint8_t *)kv->data)[0] != 0;
    return 0;
}

int fi_gguf_get_str(const fi_gguf *g, const char *key, fi_str *out)
{
    return fi_gguf_kv_str(fi_gguf_find(g, key), out);
}

/* --- formatting ---------------------------------------------------------- */

typedef struct s_buf {
    char *p;    /* output */
    size_t cap; /* capacity, > 0 */
    size_t n;   /* bytes written, < cap */
} s_buf;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void s_put(s_buf *b, const char *fmt, ...)
{
    va_list ap;
    if (b->n + 1 >= b->cap)
        return;
    va_start(ap, fmt);
    int k = vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap);
    va_end(ap);
    if (k < 0)
        return;
    b->n += (size_t)k < b->cap - b->n ? (size_t)k : b->cap - b->n - 1;
}

/* Length of the valid UTF-8 sequence at p (n bytes available), or 0. */
static int s_utf8_len(const unsigned char *p, uint64_t n)
{
    int k;
    unsigned lo = 0x80, hi = 0xbf;
    if (p[0] < 0x80)
        return 1;
    if (p[0] >= 0xc2 && p[0] <= 0xdf)
        k = 2;
    else if (p[0] >= 0xe0 && p[0] <= 0xef)
        k = 3, lo = p[0] == 0xe0 ? 0xa0 : 0x80, hi = p[0] == 0xed ? 0x9f : 0xbf;
    else if (p[0] >= 0xf0 && p[0] <= 0xf4)
        k = 4, lo = p[0] == 0xf0 ? 0x90 : 0x80, hi = p[0] == 0xf4 ? 0x8f : 0xbf;
    else
        return 0;
    if ((uint64_t)k > n || p[1] < lo || p[1] > hi)
        return 0;
    for (int i = 2; i < k; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    return k;
}

/* A string, quoted, with controls, quotes and invalid UTF-8 escaped; at
 * most about 60 bytes of it. */
static void s_put_str(s_buf *b, const char *p, uint64_t len)
{
    const unsigned char *u = (const unsigned char *)p;
    uint64_t i = 0;
    s_put(b, "\"");
    while (i < len && i < 60) {
        unsigned char c = u[i];
        int k = s_utf8_len(u + i, len - i);
        if (c == '"' || c == '\\')
            s_put(b, "\\%c", c);
        else if (c == '\n')
            s_put(b, "\\n");
        else if (c == '\t')
            s_put(b, "\\t");
        else if (c < 0x20 || c == 0x7f || k == 0)
            s_put(b, "\\x%02x", c);
        else {
            s_put(b, "%.*s", k, p + i);
            i += (uint64_t)k;
            continue;
        }
        i++;
    }
    if (i < len)
        s_put(b, "\"...(%" PRIu64 " bytes)", len);
    else
        s_put(b, "\"");
}

static void s_put_scalar(s_buf *b, fi_gguf_type t, const uint8_t *p)
{
    int neg;
    int64_t sv;
    uint64_t uv;
    if (s_int_at(p, t, &neg, &sv, &uv) == 0) {
        if (neg)
            s_put(b, "%" PRId64, sv);
        else
            s_put(b, "%" PRIu64, uv);
    } else if (t == FI_GGUF_FLOAT32) {
        s_put(b, "%g", (double)s_f32_at(p));
    } else if (t == FI_GGUF_FLOAT64) {
        s_put(b, "%g", s_f64_at(p));
    } else if (t == FI_GGUF_BOOL) {
        s_put(b, "%s", p[0] ? "true" : "false");
    }
}

void fi_gguf_kv_format(const fi_gguf_kv *kv, char *buf, size_t cap)
{
    if (!buf || cap == 0)
        return;
    s_buf b = {buf, cap, 0};
    buf[0] = '\0';
    if (!kv)
        return;
    const uint8_t *p = kv->data;
    if (kv->type == FI_GGUF_STRING) {
        s_put_str(&b, (const char *)p + 8, s_le64(p));
    } else if (kv->type != FI_GGUF_ARRAY) {
        s_put_scalar(&b, kv->type, p);
    } else {
        s_put(&b, "[%" PRIu64 " x %s", kv->arr_len, fi_gguf_type_name(kv->arr_type));
        uint64_t esz = s_scalar_size(kv->arr_type);
        uint64_t shown = kv->arr_len < FI_GGUF_FMT_ELEMS ? kv->arr_len : FI_GGUF_FMT_ELEMS;
        if (kv->arr_type == FI_GGUF_ARRAY)
            shown = 0; /* nested arrays: raw only */
        for (uint64_t i = 0; i < shown; i++) {
            s_put(&b, i ? ", " : ": ");
            if (kv->arr_type == FI_GGUF_STRING && kv->strs)
                s_put_str(&b, kv->strs[i].ptr, kv->strs[i].len);
            else if (esz)
                s_put_scalar(&b, kv->arr_type, p + i * esz);
        }
        if (kv->arr_len > shown && shown)
            s_put(&b, ", ...");
        s_put(&b, "]");
    }
}
