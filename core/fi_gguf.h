/*
 * fi_gguf.h - GGUF v3 model files, read over mmap.
 *
 * fi_gguf_open parses and checks the whole header before returning: every
 * count, length, size and offset is checked against the file (and against
 * overflow) so that a truncated, corrupt or hostile file gives an error that
 * names what is wrong and where (byte offset, key or tensor), never a crash,
 * a hang or a read out of bounds. After a successful open every pointer the
 * accessors return lies inside the mapping and stays valid until
 * fi_gguf_close.
 *
 * Strings in GGUF are not NUL-terminated: they are returned as fi_str
 * (pointer + length into the mapping).
 */
#ifndef FI_GGUF_H
#define FI_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "fi_kernels.h" /* FI_MUST_CHECK, fi_dtype */

#ifdef __cplusplus
extern "C" {
#endif

/* Metadata value types, numbered as in the GGUF specification. */
typedef enum fi_gguf_type {
    FI_GGUF_UINT8 = 0,
    FI_GGUF_INT8 = 1,
    FI_GGUF_UINT16 = 2,
    FI_GGUF_INT16 = 3,
    FI_GGUF_UINT32 = 4,
    FI_GGUF_INT32 = 5,
    FI_GGUF_FLOAT32 = 6,
    FI_GGUF_BOOL = 7,
    FI_GGUF_STRING = 8,
    FI_GGUF_ARRAY = 9,
    FI_GGUF_UINT64 = 10,
    FI_GGUF_INT64 = 11,
    FI_GGUF_FLOAT64 = 12,
} fi_gguf_type;

typedef struct fi_str {
    const char *ptr; /* not NUL-terminated; inside the mapping */
    uint64_t len;    /* bytes */
} fi_str;

/* One metadata key/value. */
typedef struct fi_gguf_kv {
    fi_str key;
    fi_gguf_type type;     /* value type */
    fi_gguf_type arr_type; /* element type when type == FI_GGUF_ARRAY */
    uint64_t arr_len;      /* elements when type == FI_GGUF_ARRAY */
    const void *data;      /* the value's bytes in the file (for arrays: the
                              first element, after type and count; for a
                              string: its u64 length, then the bytes - use
                              fi_gguf_kv_str). Not aligned: read with memcpy */
    const fi_str *strs;    /* string arrays only: arr_len entries; else NULL */
} fi_gguf_kv;

#define FI_GGUF_MAX_DIMS 4

/* One tensor. */
typedef struct fi_gguf_tensor {
    fi_str name;
    uint32_t n_dims;                  /* 1..FI_GGUF_MAX_DIMS */
    int64_t ne[FI_GGUF_MAX_DIMS];     /* elements per dimension; unused = 1 */
    fi_dtype type;                    /* a type fi_dtype_supported() knows */
    uint64_t offset;                  /* from the start of the data section */
    uint64_t n_bytes;                 /* size of the data */
    const void *data;                 /* inside the mapping */
} fi_gguf_tensor;

typedef struct fi_gguf fi_gguf;

/* Opens and checks a GGUF file. Returns an owned handle, or NULL with a
 * message in err (always NUL-terminated when errlen > 0). */
fi_gguf *fi_gguf_open(const char *path, char *err, size_t errlen);
/* Same, over a caller's buffer that must outlive the handle (tests, fuzz).
 * `name` is used in error messages. */
fi_gguf *fi_gguf_open_memory(const void *buf, size_t len, const char *name, char *err,
                             size_t errlen);
/* Unmaps and frees; sets *g to NULL. Safe on NULL. */
void fi_gguf_close(fi_gguf **g);

/* Whether the file a handle maps still has the size it had at open (the
 * handle keeps it open: a file replaced by rename is still the one
 * mapped). 0 when it has, or the handle reads memory; -1 with a message
 * naming `name` when it changed in place: reading the mapping past a
 * shrunk file's end would kill the process (SIGBUS), so the model must
 * not read its weights from it again. */
int fi_gguf_check_size(const fi_gguf *g, const char *name, char *err, size_t errlen);

/* The SHA-256 of the whole file, as read through the handle, in 64
 * lower-case hex digits: what a deployment pins (model_sha256). */
void fi_gguf_sha256(const fi_gguf *g, char hex[65]);

uint32_t fi_gguf_version(const fi_gguf *g);
size_t fi_gguf_file_size(const fi_gguf *g);
uint32_t fi_gguf_alignment(const fi_gguf *g);
uint64_t fi_gguf_data_offset(const fi_gguf *g); /* start of the data section */

int64_t fi_gguf_n_kv(const fi_gguf *g);
const fi_gguf_kv *fi_gguf_kv_at(const fi_gguf *g, int64_t i);
/* The kv with this key, or NULL. */
const fi_gguf_kv *fi_gguf_find(const fi_gguf *g, const char *key);

/* Typed getters: 0 on success, -1 when the key is missing or its value does
 * not fit the requested type (any integer type that fits is accepted for
 * the integer getters; FLOAT32 or FLOAT64 for get_f32). */
FI_MUST_CHECK int fi_gguf_get_u32(const fi_gguf *g, const char *key, uint32_t *out);
FI_MUST_CHECK int fi_gguf_get_i64(const fi_gguf *g, const char *key, int64_t *out);
FI_MUST_CHECK int fi_gguf_get_f32(const fi_gguf *g, const char *key, float *out);
FI_MUST_CHECK int fi_gguf_get_bool(const fi_gguf *g, const char *key, int *out);
FI_MUST_CHECK int fi_gguf_get_str(const fi_gguf *g, const char *key, fi_str *out);

/* The value of a STRING kv: 0, or -1 when kv is NULL or not a string. */
FI_MUST_CHECK int fi_gguf_kv_str(const fi_gguf_kv *kv, fi_str *out);

/* Element i of an array kv of any integer type, as int64 (a uint64 above
 * INT64_MAX fails); for FLOAT32 or FLOAT64 arrays, fi_gguf_arr_f32. 0, or
 * -1 when kv is NULL, not an array of such elements, or i >= arr_len.
 * (Array data in the mapping is not aligned: use these, or memcpy.) */
FI_MUST_CHECK int fi_gguf_arr_i64(const fi_gguf_kv *kv, uint64_t i, int64_t *out);
FI_MUST_CHECK int fi_gguf_arr_f32(const fi_gguf_kv *kv, uint64_t i, float *out);

/* Human-readable name of a metadata type ("uint32", "array"). */
const char *fi_gguf_type_name(fi_gguf_type t);
/* Writes a short rendering of a value (arrays abbreviated) into buf. */
void fi_gguf_kv_format(const fi_gguf_kv *kv, char *buf, size_t cap);
/* A name from the file (a key, a tensor's name) as printable text: control
 * bytes (a crafted file's terminal escapes) become '?', at most max bytes
 * of it, then "...". */
void fi_gguf_name_format(fi_str s, size_t max, char *buf, size_t cap);

int64_t fi_gguf_n_tensors(const fi_gguf *g);
const fi_gguf_tensor *fi_gguf_tensor_at(const fi_gguf *g, int64_t i);
/* The tensor with this name, or NULL. */
const fi_gguf_tensor *fi_gguf_find_tensor(const fi_gguf *g, const char *name);

/* 1 when s equals the NUL-terminated c string. */
int fi_str_eq(fi_str s, const char *c);

#ifdef __cplusplus
}
#endif
#endif /* FI_GGUF_H */
