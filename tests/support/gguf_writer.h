/*
 * gguf_writer.h - builds GGUF files in memory, for tests only.
 *
 * A writer collects metadata and tensors, then serialises them to a
 * malloc'd buffer (fi_gw_serialize) or a file (fi_gw_write_file). Typical
 * use:
 *
 *     fi_gw *w = fi_gw_new();
 *     fi_gw_add_str(w, "general.architecture", "llama");
 *     fi_gw_add_u32(w, "llama.block_count", 2);
 *     int64_t ne[2] = {64, 10};                    // ne[0] = columns
 *     fi_gw_add_tensor_f32(w, "token_embd.weight", FI_DTYPE_Q8_0, 2, ne, values);
 *     size_t len;
 *     uint8_t *buf = fi_gw_serialize(w, &len, NULL);
 *     fi_gguf *g = fi_gguf_open_memory(buf, len, "test.gguf", err, sizeof err);
 *     ...
 *     fi_gguf_close(&g); free(buf); fi_gw_destroy(&w);
 *
 * For an engine test, fi_gw_tiny_llama() builds a complete Llama model
 * (hyper-parameters, random weights from a seed, a byte-level BPE
 * vocabulary with merges, special tokens and a ChatML template).
 *
 * Errors are sticky: an add function that fails (out of memory, bad
 * arguments) returns -1 and marks the writer failed; fi_gw_serialize then
 * returns NULL. Tests may therefore ignore the add functions' results and
 * check only the serialised buffer. Nothing here validates beyond what is
 * needed to write bytes: the writer can (and is meant to) produce malformed
 * files through the *_raw functions and the overrides.
 *
 * Byte order: little-endian, as GGUF; the host is assumed little-endian.
 */
#ifndef FI_GGUF_WRITER_H
#define FI_GGUF_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "fi_gguf.h"
#include "fi_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_gw fi_gw;

/* An empty writer (version 3, alignment 32). NULL on allocation failure.
 * Owned by the caller: release with fi_gw_destroy. */
fi_gw *fi_gw_new(void);
/* Frees the writer and sets *w to NULL; safe on NULL. */
void fi_gw_destroy(fi_gw **w);
/* 1 when an earlier call failed (serialising will fail). */
int fi_gw_failed(const fi_gw *w);

/* --- metadata ---------------------------------------------------------
 * Keys are NUL-terminated; kvs are written in the order they are added.
 * Nothing stops duplicates (the reader must refuse them). */
int fi_gw_add_u8(fi_gw *w, const char *key, uint8_t v);
int fi_gw_add_i8(fi_gw *w, const char *key, int8_t v);
int fi_gw_add_u16(fi_gw *w, const char *key, uint16_t v);
int fi_gw_add_i16(fi_gw *w, const char *key, int16_t v);
int fi_gw_add_u32(fi_gw *w, const char *key, uint32_t v);
int fi_gw_add_i32(fi_gw *w, const char *key, int32_t v);
int fi_gw_add_f32(fi_gw *w, const char *key, float v);
int fi_gw_add_bool(fi_gw *w, const char *key, int v);
int fi_gw_add_u64(fi_gw *w, const char *key, uint64_t v);
int fi_gw_add_i64(fi_gw *w, const char *key, int64_t v);
int fi_gw_add_f64(fi_gw *w, const char *key, double v);
/* A NUL-terminated string value. */
int fi_gw_add_str(fi_gw *w, const char *key, const char *s);
/* A string value of len bytes (may hold NULs or invalid UTF-8). */
int fi_gw_add_strn(fi_gw *w, const char *key, const char *s, uint64_t len);
/* An array of n scalars of type elem (not STRING or ARRAY) from data,
 * which holds n elements in their GGUF sizes (uint8_t, int16_t, float,
 * bool as one byte, ...). */
int fi_gw_add_array(fi_gw *w, const char *key, fi_gguf_type elem, const void *data, uint64_t n);
/* An array of n NUL-terminated strings. */
int fi_gw_add_str_array(fi_gw *w, const char *key, const char *const *strs, uint64_t n);
/* A kv written verbatim: key of key_len bytes (may hold NULs), the type id
 * `type` (need not be a known type), then len bytes of value exactly as
 * given. Use it for arrays of arrays (value = element type, count, and each
 * nested array's own type, count, elements) and for malformed values. */
int fi_gw_add_raw(fi_gw *w, const char *key, uint64_t key_len, uint32_t type, const void *value,
                  size_t len);

/* Sets the alignment of the data section and records it as a
 * "general.alignment" uint32 kv (added at the first call, in order; later
 * calls change its value). a must be a power of two; to write a bad
 * general.alignment use fi_gw_add_u32 directly. */
int fi_gw_set_alignment(fi_gw *w, uint32_t a);
/* Version number written to the header (default 3). */
void fi_gw_set_version(fi_gw *w, uint32_t version);
/* Counts written to the header instead of the real ones (for "count too
 * large" files); pass UINT64_MAX to keep the real count. */
void fi_gw_override_counts(fi_gw *w, uint64_t n_tensors, uint64_t n_kv);
/* Appends n zero bytes after the data section (room for raw tensors). */
void fi_gw_set_tail(fi_gw *w, size_t n);

/* --- tensors ----------------------------------------------------------
 * ne[0] is the number of columns (elements per row), as in GGUF; it must be
 * a multiple of the type's block size. Data is copied. Tensors are laid
 * out in the order added, each at the next multiple of the alignment. */

/* Bytes of n elements of type t (n a multiple of the block size), or 0 for
 * an unknown type or a partial block. */
size_t fi_gw_row_bytes(fi_dtype t, int64_t n);
/* A tensor from bytes already in type t's layout: rows * row_bytes bytes
 * (NULL data: zeros). */
int fi_gw_add_tensor(fi_gw *w, const char *name, fi_dtype t, int n_dims, const int64_t *ne,
                     const void *data);
/* A tensor from float values, converted (or quantised) to type t. values
 * holds ne[0]*ne[1]*ne[2]*ne[3] floats, row-major. */
int fi_gw_add_tensor_f32(fi_gw *w, const char *name, fi_dtype t, int n_dims, const int64_t *ne,
                         const float *values);
/* A tensor info written verbatim (name of name_len bytes, n_dims ne values
 * - n_dims may exceed 4, up to 8 are stored -, type id, offset relative to
 * the data section). No data is written for it: use fi_gw_set_tail or point
 * it at another tensor's bytes. For malformed files. */
int fi_gw_add_tensor_raw(fi_gw *w, const char *name, uint64_t name_len, uint32_t n_dims,
                         const uint64_t *ne, uint32_t type, uint64_t offset);

/* --- output ---------------------------------------------------------- */

/* Where the sections of the last serialised file start (byte offsets). */
typedef struct fi_gw_layout {
    size_t kv_start;     /* first kv (24: right after the header) */
    size_t tensor_start; /* first tensor info (= end of the kvs) */
    size_t infos_end;    /* end of the tensor infos (before padding) */
    size_t data_start;   /* data section (infos_end rounded up to the alignment) */
    size_t size;         /* whole file */
} fi_gw_layout;

/* The file as a malloc'd buffer of *len bytes (caller frees), with its
 * layout in *layout when not NULL. NULL when the writer failed. */
uint8_t *fi_gw_serialize(fi_gw *w, size_t *len, fi_gw_layout *layout);
/* Byte offset of kv i / tensor info i in the last serialised file, or
 * (size_t)-1 when out of range or nothing was serialised yet. */
size_t fi_gw_kv_offset(const fi_gw *w, size_t i);
size_t fi_gw_tensor_offset(const fi_gw *w, size_t i);
/* Serialises to a file. 0, or -1 (writer failed, or an I/O error). */
int fi_gw_write_file(fi_gw *w, const char *path);

/* --- numbers --------------------------------------------------------- */

uint16_t fi_gw_fp32_to_fp16(float f); /* round to nearest even */
float fi_gw_fp16_to_fp32(uint16_t h);
uint16_t fi_gw_fp32_to_bf16(float f); /* round to nearest even */
float fi_gw_bf16_to_fp32(uint16_t h);
/* Converts n floats (a multiple of the block size) to type t, writing
 * fi_gw_row_bytes(t, n) bytes to dst. F32, F16, BF16 and the reference
 * (ggml-compatible) Q4_0, Q4_1 and Q8_0 block formats. 0, or -1 for an
 * unknown type or a partial block. */
int fi_gw_quantize(fi_dtype t, const float *src, void *dst, int64_t n);
/* The inverse (reference dequantiser, for checking other code). */
int fi_gw_dequantize(fi_dtype t, const void *src, float *dst, int64_t n);

/* --- a complete tiny Llama model ---------------------------------------
 * Vocabulary (ids): 0 "<|endoftext|>", 1 "<|im_start|>", 2 "<|im_end|>"
 * (control tokens), then the 256 byte symbols in byte order (byte b is id
 * FI_GW_TOK_BYTE0 + b, spelled with GPT-2's byte-to-unicode mapping: ' ' is
 * "Ġ"), then the merged tokens of the FI_GW_N_MERGES merges (in merge
 * order: "Ġt", "Ġa", "in", "he", ..., "Hello", ..., "Ġworld"), then padding
 * control tokens "<|reserved_N|>" up to n_vocab. bos = 1, eos = 2,
 * unknown = 0, padding = 2; add_bos_token false; model "gpt2", pre
 * "smollm"; a ChatML chat_template with a default system message.
 * "Hello world" encodes to {Hello, Ġworld}. */
#define FI_GW_TOK_ENDOFTEXT 0
#define FI_GW_TOK_IM_START 1
#define FI_GW_TOK_IM_END 2
#define FI_GW_TOK_BYTE0 3
#define FI_GW_N_MERGES 18
#define FI_GW_TOK_FIRST_MERGE (FI_GW_TOK_BYTE0 + 256)
#define FI_GW_TINY_MIN_VOCAB (FI_GW_TOK_FIRST_MERGE + FI_GW_N_MERGES)
#define FI_GW_TINY_SYSTEM "You are a tiny test model."

typedef struct fi_gw_llama_opts {
    int n_layers;      /* llama.block_count */
    int dim;           /* embedding length; a multiple of n_heads, and of 32
                          for quantised types */
    int n_heads;       /* query heads */
    int n_kv_heads;    /* KV heads; divides n_heads */
    int ffn_dim;       /* feed-forward width; a multiple of 32 when quantised */
    int n_vocab;       /* <= FI_GW_TINY_MIN_VOCAB: the minimum; more pads */
    int ctx;           /* llama.context_length */
    fi_dtype wtype;    /* the layers' matrices: F32, F16, BF16, Q4_0, Q4_1, Q8_0 */
    fi_dtype embd_type; /* token_embd (and output) type */
    int tied;          /* 1: no output.weight (the engine reuses token_embd) */
    float rope_theta;  /* llama.rope.freq_base */
    float norm_eps;    /* llama.attention.layer_norm_rms_epsilon */
    uint64_t seed;     /* weights are a deterministic function of the seed */
} fi_gw_llama_opts;

/* Defaults: 2 layers, dim 64, 4 heads, 2 KV heads, ffn 128, minimum vocab,
 * ctx 256, Q8_0 matrices, Q8_0 embeddings, tied, theta 10000, eps 1e-5,
 * seed 42. */
void fi_gw_llama_defaults(fi_gw_llama_opts *o);
/* A writer holding the whole model (add more before serialising if you
 * like). Tensor names and shapes follow llama.cpp: token_embd.weight
 * [dim, n_vocab], output_norm.weight [dim], output.weight [dim, n_vocab]
 * unless tied, and per layer blk.N.{attn_norm [dim], attn_q [dim, dim],
 * attn_k [dim, kv_dim], attn_v [dim, kv_dim], attn_output [dim, dim],
 * ffn_norm [dim], ffn_gate [dim, ffn], ffn_up [dim, ffn], ffn_down
 * [ffn, dim]}.weight; norms are F32 near 1. NULL on bad options or
 * allocation failure. */
fi_gw *fi_gw_tiny_llama(const fi_gw_llama_opts *o);
/* Same, written to path. 0 or -1. */
int fi_gw_tiny_llama_file(const fi_gw_llama_opts *o, const char *path);
/* The byte-level symbol of byte b (GPT-2's bytes_to_unicode) as UTF-8 into
 * out (at least 3 bytes, not NUL-terminated); returns its length. */
int fi_gw_byte_symbol(uint8_t b, char out[3]);

#ifdef __cplusplus
}
#endif
#endif /* FI_GGUF_WRITER_H */
