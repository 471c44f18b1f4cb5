/*
 * tokenizer.c - byte-level BPE (tokenizer.ggml.model = "gpt2") built from
 * GGUF metadata: loading and checking the vocabulary, merges and special
 * tokens, encoding, pieces and decoding. The chat template lives in
 * tokenizer_chat.c.
 *
 * Encoding works in three stages, as Hugging Face tokenizers and llama.cpp
 * do for SmolLM2:
 *   1. special tokens: with parse_special the texts of control tokens
 *      (always those of user-defined ones) are cut out first (leftmost,
 *      longest match) and become their ids; a trie of their texts finds
 *      them in time independent of how many the vocabulary declares;
 *   2. pre-tokenizer: the rest is split into words by a hand-written state
 *      machine equal to "each \p{N} alone" (pre "smollm" only) followed by
 *      the GPT-2 pattern
 *        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *      run on each piece separately (so lookahead never crosses a digit);
 *   3. BPE: each word starts as one symbol per byte (the GPT-2
 *      bytes_to_unicode symbol of that byte) and adjacent pairs merge by
 *      rank, lowest rank first, leftmost first on ties.
 * Bytes that are not valid UTF-8 count as single "other" characters in
 * stage 2. When every byte has a token, any byte string encodes and
 * decodes back exactly; a byte without one is dropped (s_bpe).
 *
 * The tokenizer is immutable after fi_tok_new; encoding allocates its own
 * scratch, so one fi_tok may be used from several threads at once.
 */
#include "tokenizer_impl.h"

#include <assert.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

/* Token types as GGUF (llama.cpp) numbers them. */
enum {
    TT_UNDEFINED = 0,
    TT_NORMAL = 1,
    TT_UNKNOWN = 2,
    TT_CONTROL = 3,
    TT_USER_DEFINED = 4,
    TT_UNUSED = 5,
    TT_BYTE = 6,
};

/* Control-token texts that end a generation when the model has them. */
static const char *const s_eog_texts[] = {
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
};

/* ---------------------------------------------------------------------- */
/* Errors                                                                 */

static void s_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void s_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Writes at most max bytes of s into a quoted, escaped form for messages. */
static const char *s_quote(char *buf, size_t cap, const char *s, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\\')
            buf[o++] = (char)c;
        else
            o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", c);
    }
    if (o < cap)
        buf[o] = 0;
    else if (cap)
        buf[cap - 1] = 0;
    return buf;
}

/* ---------------------------------------------------------------------- */
/* Hash maps                                                              */

static uint64_t s_hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t s_hash_pair(int32_t a, int32_t b) {
    uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    k *= 0x9E3779B97F4A7C15ull;
    return k ^ (k >> 31);
}

/* Smallest power of two >= 2 * n (at least 16). */
static size_t s_table_size(size_t n) {
    size_t s = 16;
    while (s < 2 * n)
        s <<= 1;
    return s;
}

int32_t fi_tok_find_n(const fi_tok *t, const char *s, size_t n) {
    size_t mask = t->vocab_cap - 1;
    for (size_t i = s_hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = t->vocab_slot[i];
        if (id < 0)
            return -1;
        size_t len = t->text_off[id + 1] - t->text_off[id] - 1;
        if (len == n && memcmp(t->text + t->text_off[id], s, n) == 0)
            return id;
    }
}

/* Adds id under its text unless that text is already there (first wins). */
static void s_vocab_insert(fi_tok *t, int32_t id) {
    const char *s = t->text + t->text_off[id];
    size_t n = t->text_off[id + 1] - t->text_off[id] - 1;
    size_t mask = t->vocab_cap - 1;
    for (size_t i = s_hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t o = t->vocab_slot[i];
        if (o < 0) {
            t->vocab_slot[i] = id;
            return;
        }
        size_t len = t->text_off[o + 1] - t->text_off[o] - 1;
        if (len == n && memcmp(t->text + t->text_off[o], s, n) == 0)
            return;
    }
}

/* The merge of the pair (a, b): its rank, and the merged token in *out; or
 * -1 when the pair does not merge. */
static inline int32_t s_merge_find(const fi_tok *t, int32_t a, int32_t b, int32_t *out) {
    size_t mask = t->merge_cap - 1;
    for (size_t i = s_hash_pair(a, b) & mask;; i = (i + 1) & mask) {
        const fi_tok_merge *m = &t->merge_slot[i];
        if (m->rank < 0)
            return -1;
        if (m->a == a && m->b == b) {
            *out = m->result;
            return m->rank;
        }
    }
}

/* Adds a merge; a pair seen before keeps its first (lowest) rank. */
static void s_merge_insert(fi_tok *t, int32_t a, int32_t b, int32_t rank, int32_t result) {
    size_t mask = t->merge_cap - 1;
    for (size_t i = s_hash_pair(a, b) & mask;; i = (i + 1) & mask) {
        fi_tok_merge *m = &t->merge_slot[i];
        if (m->rank < 0) {
            *m = (fi_tok_merge){a, b, rank, result};
            return;
        }
        if (m->a == a && m->b == b)
            return;
    }
}

/* ---------------------------------------------------------------------- */
/* Byte-level symbols                                                     */

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves,
 * the other 68 bytes take code points 256, 257, ... in byte order. */
static void s_byte_map(uint32_t byte_cp[256]) {
    uint32_t next = 256;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        byte_cp[b] = printable ? (uint32_t)b : next++;
    }
}

/* Encodes cp (< 0x800 here) as UTF-8; returns the length. */
static size_t s_utf8_put(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

/* Writes the raw bytes a normal token stands for: each byte-level symbol
 * becomes its byte; a character that is no byte-level symbol (or a byte
 * that is not UTF-8) is copied unchanged. Returns the length (<= n). */
static size_t s_unmap_bytes(const fi_tok *t, const char *s, size_t n, char *o) {
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s + i,
                                              (utf8proc_ssize_t)(n - i), &cp);
        if (l < 1) {
            o[k++] = s[i++];
            continue;
        }
        if (cp < FI_TOK_CP_MAX && t->cp_byte[cp] >= 0)
            o[k++] = (char)t->cp_byte[cp];
        else {
            memcpy(o + k, s + i, (size_t)l);
            k += (size_t)l;
        }
        i += (size_t)l;
    }
    return k;
}

/* ---------------------------------------------------------------------- */
/* Loading                                                                */

/* Reads an optional token id key: *out = -1 when absent (or stored as -1),
 * else an id < n_vocab. -1 with a message on a bad value. */
static int s_get_id(const fi_gguf *g, const char *key, int32_t n_vocab, int32_t *out, char *err,
                    size_t errlen) {
    *out = -1;
    const fi_gguf_kv *kv = fi_gguf_find(g, key);
    if (!kv)
        return 0;
    int64_t v;
    if (fi_gguf_get_i64(g, key, &v) != 0) {
        s_err(err, errlen, "%s: expected an integer token id, found %s", key,
              fi_gguf_type_name(kv->type));
        return -1;
    }
    if (v == -1)
        return 0;
    if (v < 0 || v >= n_vocab) {
        s_err(err, errlen, "%s = %lld is out of range (%d tokens)", key, (long long)v,
              (int)n_vocab);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

/* A string-array key of the tokenizer, or NULL with a message. */
static const fi_gguf_kv *s_get_strs(const fi_gguf *g, const char *key, char *err,
                                    size_t errlen) {
    const fi_gguf_kv *kv = fi_gguf_find(g, key);
    if (!kv) {
        s_err(err, errlen, "%s: missing", key);
        return NULL;
    }
    if (kv->type != FI_GGUF_ARRAY || kv->arr_type != FI_GGUF_STRING || !kv->strs) {
        s_err(err, errlen, "%s: expected an array of strings, found %s of %s", key,
              fi_gguf_type_name(kv->type),
              kv->type == FI_GGUF_ARRAY ? fi_gguf_type_name(kv->arr_type) : "-");
        return NULL;
    }
    return kv;
}

/* Copies the token texts, types, and their raw-byte pieces. */
static int s_load_vocab(fi_tok *t, const fi_gguf *g, char *err, size_t errlen) {
    const char *key = "tokenizer.ggml.tokens";
    const fi_gguf_kv *tokens = s_get_strs(g, key, err, errlen);
    if (!tokens)
        return -1;
    if (tokens->arr_len == 0 || tokens->arr_len > (uint64_t)INT32_MAX / 2) {
        s_err(err, errlen, "%s: %llu tokens is not a usable vocabulary size", key,
              (unsigned long long)tokens->arr_len);
        return -1;
    }
    int32_t n = (int32_t)tokens->arr_len;
    t->n_vocab = n;

    const fi_gguf_kv *types = fi_gguf_find(g, "tokenizer.ggml.token_type");
    if (types) {
        if (types->type != FI_GGUF_ARRAY || types->arr_type != FI_GGUF_INT32) {
            s_err(err, errlen, "tokenizer.ggml.token_type: expected an array of int32, found %s",
                  fi_gguf_type_name(types->type == FI_GGUF_ARRAY ? types->arr_type
                                                                 : types->type));
            return -1;
        }
        if (types->arr_len != tokens->arr_len) {
            s_err(err, errlen,
                  "tokenizer.ggml.token_type: %llu entries but tokenizer.ggml.tokens has %d",
                  (unsigned long long)types->arr_len, (int)n);
            return -1;
        }
    }
    const fi_gguf_kv *scores = fi_gguf_find(g, "tokenizer.ggml.scores");
    if (scores && (scores->type != FI_GGUF_ARRAY || scores->arr_len != tokens->arr_len)) {
        s_err(err, errlen, "tokenizer.ggml.scores: %llu entries but tokenizer.ggml.tokens has %d",
              (unsigned long long)(scores->type == FI_GGUF_ARRAY ? scores->arr_len : 1), (int)n);
        return -1;
    }

    size_t total = 0;
    for (int32_t i = 0; i < n; i++)
        total += tokens->strs[i].len + 1;
    t->text = malloc(total);
    t->piece = malloc(total);
    t->text_off = malloc(((size_t)n + 1) * sizeof *t->text_off);
    t->piece_off = malloc(((size_t)n + 1) * sizeof *t->piece_off);
    t->type = malloc((size_t)n);
    t->flags = calloc((size_t)n, 1);
    t->vocab_cap = s_table_size((size_t)n);
    t->vocab_slot = malloc(t->vocab_cap * sizeof *t->vocab_slot);
    if (!t->text || !t->piece || !t->text_off || !t->piece_off || !t->type || !t->flags ||
        !t->vocab_slot) {
        s_err(err, errlen, "tokenizer: out of memory for %d tokens", (int)n);
        return -1;
    }
    memset(t->vocab_slot, 0xff, t->vocab_cap * sizeof *t->vocab_slot);

    size_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t ty = TT_NORMAL;
        if (types)
            memcpy(&ty, (const char *)types->data + 4 * (size_t)i, 4);
        if (ty < TT_UNDEFINED || ty > TT_BYTE) {
            s_err(err, errlen, "tokenizer.ggml.token_type[%d] = %d is not a token type (0..6)",
                  (int)i, (int)ty);
            return -1;
        }
        t->type[i] = (uint8_t)ty;
        t->text_off[i] = off;
        memcpy(t->text + off, tokens->strs[i].ptr, tokens->strs[i].len);
        off += tokens->strs[i].len;
        t->text[off++] = 0;
    }
    t->text_off[n] = off;
    for (int32_t i = 0; i < n; i++)
        s_vocab_insert(t, i);
    return 0;
}

/* Whether id is a byte-level symbol (decoded by mapping its characters
 * back to bytes); control, user-defined and unknown tokens are their text
 * as it is, so byte-level encoding never produces them: a vocabulary that
 * gave one of them a byte's symbol would otherwise decode that byte as the
 * symbol's UTF-8. */
static int s_byte_level(const fi_tok *t, int32_t id) {
    int ty = t->type[id];
    return ty != TT_CONTROL && ty != TT_USER_DEFINED && ty != TT_UNKNOWN;
}

/* Raw bytes of every token: control, user-defined and unknown tokens are
 * their text; the others are byte-level symbols mapped back to bytes. */
static void s_build_pieces(fi_tok *t) {
    size_t off = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        const char *s = t->text + t->text_off[i];
        size_t n = t->text_off[i + 1] - t->text_off[i] - 1;
        t->piece_off[i] = off;
        int ty = t->type[i];
        if (ty == TT_CONTROL || ty == TT_USER_DEFINED || ty == TT_UNKNOWN) {
            memcpy(t->piece + off, s, n);
            off += n;
        } else {
            off += s_unmap_bytes(t, s, n, t->piece + off);
        }
    }
    t->piece_off[t->n_vocab] = off;
}

static int s_load_merges(fi_tok *t, const fi_gguf *g, char *err, size_t errlen) {
    const char *key = "tokenizer.ggml.merges";
    const fi_gguf_kv *merges = s_get_strs(g, key, err, errlen);
    if (!merges)
        return -1;
    if (merges->arr_len > (uint64_t)INT32_MAX / 4) {
        s_err(err, errlen, "%s: %llu merges is too many", key,
              (unsigned long long)merges->arr_len);
        return -1;
    }
    int32_t n = (int32_t)merges->arr_len;
    t->n_merges = n;
    t->merge_cap = s_table_size((size_t)n);
    t->merge_slot = malloc(t->merge_cap * sizeof *t->merge_slot);
    size_t longest = 0;
    for (int32_t i = 0; i < n; i++)
        if (merges->strs[i].len > longest)
            longest = merges->strs[i].len;
    char *cat = malloc(longest + 1);
    if (!t->merge_slot || !cat) {
        free(cat);
        s_err(err, errlen, "tokenizer: out of memory for %d merges", (int)n);
        return -1;
    }
    for (size_t i = 0; i < t->merge_cap; i++)
        t->merge_slot[i].rank = -1;

    char q[96];
    for (int32_t i = 0; i < n; i++) {
        const char *s = merges->strs[i].ptr;
        size_t len = (size_t)merges->strs[i].len;
        const char *sp = memchr(s, ' ', len);
        if (!sp || sp == s || sp == s + len - 1 || memchr(sp + 1, ' ', len - (size_t)(sp - s) - 1)) {
            s_err(err, errlen, "%s[%d] = \"%s\": expected two symbols separated by one space", key,
                  (int)i, s_quote(q, sizeof q, s, len));
            free(cat);
            return -1;
        }
        size_t la = (size_t)(sp - s), lb = len - la - 1;
        int32_t a = fi_tok_find_n(t, s, la);
        int32_t b = fi_tok_find_n(t, sp + 1, lb);
        memcpy(cat, s, la);
        memcpy(cat + la, sp + 1, lb);
        int32_t ab = fi_tok_find_n(t, cat, la + lb);
        if (a < 0 || b < 0 || ab < 0) {
            const char *what = a < 0 ? s : b < 0 ? sp + 1 : cat;
            size_t wl = a < 0 ? la : b < 0 ? lb : la + lb;
            s_err(err, errlen, "%s[%d]: %s \"%s\" is not in tokenizer.ggml.tokens", key, (int)i,
                  a < 0 || b < 0 ? "symbol" : "merged token", s_quote(q, sizeof q, what, wl));
            free(cat);
            return -1;
        }
        /* only byte-level symbols merge (s_byte_level); a merge that
         * names another token is left out, not applied */
        if (s_byte_level(t, a) && s_byte_level(t, b) && s_byte_level(t, ab))
            s_merge_insert(t, a, b, i, ab);
    }
    free(cat);
    return 0;
}

/* Special tokens matched in the text before pre-tokenizing: control tokens
 * (only with parse_special) and user-defined ones (always); at a position
 * the longest match wins, and the lowest id among tokens of the same text.
 * Their texts go into a trie (fi_tok_trie), built breadth first from the
 * texts sorted bytewise, so that every node's children are one sorted run. */
/* A special token's text and id, for sorting. */
typedef struct s_text_id {
    const char *text;
    size_t len;
    int32_t id;
} s_text_id;

static int s_text_cmp(const void *a, const void *b) {
    const s_text_id *x = a, *y = b;
    int c = memcmp(x->text, y->text, x->len < y->len ? x->len : y->len);
    if (c)
        return c;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1; /* a prefix first */
    return (x->id > y->id) - (x->id < y->id);
}

/* A node waiting for its children: the run [lo, hi) of sorted ids whose
 * texts share the node's path of `depth` bytes. */
typedef struct s_trie_todo {
    int32_t node, lo, hi;
    size_t depth;
} s_trie_todo;

static int s_build_specials(fi_tok *t, char *err, size_t errlen) {
    int32_t n = 0;
    size_t bytes = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->type[i] == TT_CONTROL || t->type[i] == TT_USER_DEFINED) &&
            t->text_off[i + 1] - t->text_off[i] > 1) {
            n++;
            bytes += t->text_off[i + 1] - t->text_off[i] - 1;
        }
    if (bytes >= INT32_MAX) {
        s_err(err, errlen, "tokenizer: the special tokens' texts hold %zu bytes, too many", bytes);
        return -1;
    }
    s_text_id *ids = malloc(((size_t)n + 1) * sizeof *ids);
    s_trie_todo *todo = malloc((bytes + 1) * sizeof *todo);
    t->special = malloc((bytes + 1) * sizeof *t->special); /* at most one node per byte, + root */
    if (!ids || !todo || !t->special) {
        free(ids);
        free(todo);
        s_err(err, errlen, "tokenizer: out of memory");
        return -1;
    }
    t->n_special = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if ((t->type[i] != TT_CONTROL && t->type[i] != TT_USER_DEFINED) ||
            t->text_off[i + 1] - t->text_off[i] <= 1)
            continue;
        ids[t->n_special++] = (s_text_id){t->text + t->text_off[i], t->text_off[i + 1] - t->text_off[i] - 1, i};
        if (t->type[i] == TT_USER_DEFINED)
            t->has_user_defined = 1;
    }
    qsort(ids, (size_t)n, sizeof *ids, s_text_cmp);
    t->special[0] = (fi_tok_trie){.child = 0, .n_child = 0, .byte = 0, .any = -1, .user = -1};
    t->n_trie = 1;
    size_t head = 0, tail = 0;
    todo[tail++] = (s_trie_todo){0, 0, n, 0};
    while (head < tail) {
        s_trie_todo w = todo[head++];
        int32_t lo = w.lo;
        /* the texts that end at this node sort first: the lowest id wins */
        for (; lo < w.hi; lo++) {
            int32_t id = ids[lo].id;
            if (ids[lo].len != w.depth)
                break;
            if (t->special[w.node].any < 0)
                t->special[w.node].any = id;
            if (t->type[id] == TT_USER_DEFINED && t->special[w.node].user < 0)
                t->special[w.node].user = id;
        }
        /* the rest, in runs of the same next byte: one child each */
        t->special[w.node].child = t->n_trie;
        while (lo < w.hi) {
            unsigned char c = (unsigned char)ids[lo].text[w.depth];
            int32_t hi = lo + 1;
            while (hi < w.hi && (unsigned char)ids[hi].text[w.depth] == c)
                hi++;
            int32_t k = t->n_trie++;
            t->special[k] = (fi_tok_trie){.child = 0, .n_child = 0, .byte = c, .any = -1, .user = -1};
            t->special[w.node].n_child++;
            todo[tail++] = (s_trie_todo){k, lo, hi, w.depth + 1};
            lo = hi;
        }
    }
    free(todo);
    free(ids);
    return 0;
}

static int s_load_pre(fi_tok *t, const fi_gguf *g, char *err, size_t errlen) {
    fi_str s;
    if (fi_gguf_get_str(g, "tokenizer.ggml.model", &s) != 0) {
        s_err(err, errlen, "tokenizer.ggml.model: missing or not a string");
        return -1;
    }
    if (!fi_str_eq(s, "gpt2")) {
        char q[64];
        s_err(err, errlen,
              "tokenizer.ggml.model = \"%s\" is not supported (only \"gpt2\", byte-level BPE)",
              s_quote(q, sizeof q, s.ptr, (size_t)s.len));
        return -1;
    }
    if (fi_gguf_get_str(g, "tokenizer.ggml.pre", &s) != 0) {
        s_err(err, errlen, "tokenizer.ggml.pre: missing or not a string (the pre-tokenizer "
                           "cannot be chosen)");
        return -1;
    }
    if (fi_str_eq(s, "smollm"))
        t->pre = FI_TOK_PRE_SMOLLM;
    else if (fi_str_eq(s, "gpt2") || fi_str_eq(s, "gpt-2"))
        t->pre = FI_TOK_PRE_GPT2;
    else {
        char q[64];
        s_err(err, errlen,
              "tokenizer.ggml.pre = \"%s\" is not supported (supported: \"smollm\", \"gpt2\")",
              s_quote(q, sizeof q, s.ptr, (size_t)s.len));
        return -1;
    }
    return 0;
}

static int s_load_ids(fi_tok *t, const fi_gguf *g, char *err, size_t errlen) {
    int32_t eot, eom;
    if (s_get_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos, err, errlen) ||
        s_get_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos, err, errlen) ||
        s_get_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk, err, errlen) ||
        s_get_id(g, "tokenizer.ggml.padding_token_id", t->n_vocab, &t->pad, err, errlen) ||
        s_get_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab, &eot, err, errlen) ||
        s_get_id(g, "tokenizer.ggml.eom_token_id", t->n_vocab, &eom, err, errlen))
        return -1;
    const fi_gguf_kv *kv = fi_gguf_find(g, "tokenizer.ggml.add_bos_token");
    if (kv && fi_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos) != 0) {
        s_err(err, errlen, "tokenizer.ggml.add_bos_token: expected a bool, found %s",
              fi_gguf_type_name(kv->type));
        return -1;
    }
    if (t->eos >= 0)
        t->flags[t->eos] |= FI_TOK_F_EOG;
    if (eot >= 0)
        t->flags[eot] |= FI_TOK_F_EOG;
    if (eom >= 0)
        t->flags[eom] |= FI_TOK_F_EOG;
    for (size_t i = 0; i < sizeof s_eog_texts / sizeof s_eog_texts[0]; i++) {
        int32_t id = fi_tok_find(t, s_eog_texts[i]);
        if (id >= 0 && t->type[id] == TT_CONTROL)
            t->flags[id] |= FI_TOK_F_EOG;
    }
    return 0;
}

fi_tok *fi_tok_new(const fi_gguf *g, char *err, size_t errlen) {
    s_err(err, errlen, "%s", "");
    fi_tok *t = calloc(1, sizeof *t);
    if (!t) {
        s_err(err, errlen, "tokenizer: out of memory");
        return NULL;
    }
    t->bos = t->eos = t->unk = t->pad = -1;
    if (s_load_pre(t, g, err, errlen) || s_load_vocab(t, g, err, errlen))
        goto fail;

    uint32_t byte_cp[256];
    s_byte_map(byte_cp);
    for (int i = 0; i < FI_TOK_CP_MAX; i++)
        t->cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        char sym[4];
        size_t n = s_utf8_put(sym, byte_cp[b]);
        t->cp_byte[byte_cp[b]] = (int16_t)b;
        int32_t id = fi_tok_find_n(t, sym, n);
        t->byte_tok[b] = id >= 0 && s_byte_level(t, id) ? id : -1;
        if (t->byte_tok[b] < 0)
            t->n_missing_bytes++;
    }
    s_build_pieces(t);
    if (s_load_merges(t, g, err, errlen) || s_build_specials(t, err, errlen) ||
        s_load_ids(t, g, err, errlen) || fi_tok_chat_load(t, g, err, errlen))
        goto fail;

    for (int c = 0; c < 128; c++) {
        uint8_t k = FI_TOK_C_OTHER;
        if (c == ' ' || (c >= '\t' && c <= '\r'))
            k = FI_TOK_C_SPACE;
        else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
            k = FI_TOK_C_LETTER;
        else if (c >= '0' && c <= '9')
            k = FI_TOK_C_NUMBER;
        t->ascii_class[c] = k;
    }
    return t;
fail:
    fi_tok_destroy(&t);
    return NULL;
}

void fi_tok_destroy(fi_tok **tp) {
    if (!tp || !*tp)
        return;
    fi_tok *t = *tp;
    free(t->text);
    free(t->text_off);
    free(t->piece);
    free(t->piece_off);
    free(t->type);
    free(t->flags);
    free(t->vocab_slot);
    free(t->merge_slot);
    free(t->special);
    free(t->chat_system);
    free(t);
    *tp = NULL;
}

/* ---------------------------------------------------------------------- */
/* Accessors                                                              */

int fi_tok_n_vocab(const fi_tok *t) { return t->n_vocab; }
int32_t fi_tok_bos(const fi_tok *t) { return t->bos; }
int32_t fi_tok_eos(const fi_tok *t) { return t->eos; }
int fi_tok_add_bos(const fi_tok *t) { return t->add_bos; }

static size_t s_find_special(const fi_tok *t, const unsigned char *s, size_t from, size_t n,
                             int parse_special, int32_t *id);

/* As fi_tok_encode sees plain text: the user-defined tokens in it are
 * matched whole (even one whose text is a byte without a byte-level
 * token), every other byte needs its token. */
int fi_tok_can_encode(const fi_tok *t, const char *text, size_t len) {
    if (t->n_missing_bytes == 0)
        return 1;
    const unsigned char *s = (const unsigned char *)text;
    for (size_t p = 0; p < len;) {
        int32_t id = -1;
        size_t at = t->has_user_defined ? s_find_special(t, s, p, len, 0, &id) : len;
        for (size_t i = p; i < at; i++)
            if (t->byte_tok[s[i]] < 0)
                return 0;
        if (at >= len)
            break;
        p = at + (t->text_off[id + 1] - t->text_off[id] - 1);
    }
    return 1;
}

int fi_tok_is_eog(const fi_tok *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && (t->flags[id] & FI_TOK_F_EOG) != 0;
}

int fi_tok_is_special(const fi_tok *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && t->type[id] == TT_CONTROL;
}

int32_t fi_tok_find(const fi_tok *t, const char *s) { return fi_tok_find_n(t, s, strlen(s)); }

int fi_tok_piece(const fi_tok *t, int32_t id, char *buf, size_t cap) {
    if (id < 0 || id >= t->n_vocab)
        return -1;
    size_t n = t->piece_off[id + 1] - t->piece_off[id];
    if (cap > 0)
        memcpy(buf, t->piece + t->piece_off[id], n < cap ? n : cap);
    return (int)n;
}

char *fi_tok_decode(const fi_tok *t, const int32_t *ids, int n, size_t *len_out) {
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return NULL;
        total += t->piece_off[ids[i] + 1] - t->piece_off[ids[i]];
    }
    char *s = malloc(total + 1);
    if (!s)
        return NULL;
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        size_t k = t->piece_off[ids[i] + 1] - t->piece_off[ids[i]];
        memcpy(s + o, t->piece + t->piece_off[ids[i]], k);
        o += k;
    }
    s[o] = 0;
    if (len_out)
        *len_out = o;
    return s;
}

/* ---------------------------------------------------------------------- */
/* Encoding                                                               */

/* One candidate merge in a word: the pair (left, next[left]) as it was
 * when queued; stale when either symbol has changed since. */
typedef struct s_cand {
    int32_t rank; /* merge rank: lower merges first */
    int32_t left; /* index of the left symbol (its first byte in the word) */
    int32_t a;    /* left symbol's token when queued */
    int32_t b;    /* right symbol's token when queued */
    int32_t res;  /* token of the merged pair */
} s_cand;

/* Per-call scratch, grown to the longest word seen. */
typedef struct s_work {
    int32_t *sym;   /* (cap) token of the symbol starting at byte i; -1: none */
    int32_t *next;  /* (cap) index of the next symbol, or n */
    int32_t *prev;  /* (cap) index of the previous symbol, or -1 */
    s_cand *heap;   /* (3 * cap) candidate merges, a binary min-heap */
    size_t cap;     /* symbols the arrays hold */
    int32_t *out;   /* caller's ids */
    int max_out;    /* caller's capacity */
    size_t n_out;   /* ids produced so far (also past max_out) */
} s_work;

static inline void s_emit(s_work *w, int32_t id) {
    if (w->n_out < (size_t)w->max_out)
        w->out[w->n_out] = id;
    w->n_out++;
}

static inline int s_cand_less(const s_cand *x, const s_cand *y) {
    return x->rank < y->rank || (x->rank == y->rank && x->left < y->left);
}

static void s_heap_push(s_cand *h, size_t *n, s_cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!s_cand_less(&c, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static s_cand s_heap_pop(s_cand *h, size_t *n) {
    s_cand top = h[0], last = h[--*n];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m)
            break;
        if (c + 1 < m && s_cand_less(&h[c + 1], &h[c]))
            c++;
        if (!s_cand_less(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static int s_work_grow(s_work *w, size_t n) {
    if (n <= w->cap)
        return 0;
    if (n > (size_t)INT32_MAX / 4)
        return -1;
    size_t cap = w->cap ? w->cap : 64;
    while (cap < n)
        cap *= 2;
    int32_t *sym = realloc(w->sym, cap * sizeof *sym);
    if (sym)
        w->sym = sym;
    int32_t *next = realloc(w->next, cap * sizeof *next);
    if (next)
        w->next = next;
    int32_t *prev = realloc(w->prev, cap * sizeof *prev);
    if (prev)
        w->prev = prev;
    s_cand *heap = realloc(w->heap, 3 * cap * sizeof *heap);
    if (heap)
        w->heap = heap;
    if (!sym || !next || !prev || !heap)
        return -1;
    w->cap = cap;
    return 0;
}

static inline void s_queue(const fi_tok *t, s_work *w, size_t *nh, int32_t left, int32_t right) {
    int32_t res;
    int32_t a = w->sym[left], b = w->sym[right];
    int32_t rank = s_merge_find(t, a, b, &res);
    if (rank >= 0)
        s_heap_push(w->heap, nh, (s_cand){rank, left, a, b, res});
}

/* BPE on one word of n bytes: one symbol per byte, then merges by rank.
 * A byte whose symbol is not in the vocabulary (SmolLM2 lacks 21 of them)
 * is left out of the word, and its neighbours become adjacent, as Hugging
 * Face's BPE does when there is no unknown token. */
static int s_bpe(const fi_tok *t, s_work *w, const unsigned char *s, size_t n) {
    if (n == 1) {
        if (t->byte_tok[s[0]] >= 0)
            s_emit(w, t->byte_tok[s[0]]);
        return 0;
    }
    if (n == 2 && t->byte_tok[s[0]] >= 0 && t->byte_tok[s[1]] >= 0) {
        int32_t res;
        if (s_merge_find(t, t->byte_tok[s[0]], t->byte_tok[s[1]], &res) >= 0) {
            s_emit(w, res);
        } else {
            s_emit(w, t->byte_tok[s[0]]);
            s_emit(w, t->byte_tok[s[1]]);
        }
        return 0;
    }
    if (s_work_grow(w, n) != 0)
        return -1;
    int32_t m = (int32_t)n, first = m, last = -1;
    size_t nh = 0;
    for (int32_t i = 0; i < m; i++) {
        int32_t id = t->byte_tok[s[i]];
        if (id < 0)
            continue;
        w->sym[i] = id;
        w->prev[i] = last;
        if (last >= 0) {
            w->next[last] = i;
            s_queue(t, w, &nh, last, i);
        } else {
            first = i;
        }
        last = i;
    }
    if (last >= 0)
        w->next[last] = m;
    while (nh > 0) {
        s_cand c = s_heap_pop(w->heap, &nh);
        int32_t l = c.left;
        int32_t r = w->next[l];
        if (w->sym[l] != c.a || r >= m || w->sym[r] != c.b)
            continue; /* stale: a symbol of the pair merged since */
        w->sym[l] = c.res;
        w->sym[r] = -1;
        w->next[l] = w->next[r];
        if (w->next[r] < m)
            w->prev[w->next[r]] = l;
        if (w->prev[l] >= 0)
            s_queue(t, w, &nh, w->prev[l], l);
        if (w->next[l] < m)
            s_queue(t, w, &nh, l, w->next[l]);
        assert(nh <= 3 * w->cap);
    }
    for (int32_t i = first; i < m; i = w->next[i])
        s_emit(w, w->sym[i]);
    return 0;
}

/* Class of the character at s (n > 0 bytes left); its length in *len.
 * Bytes that do not start valid UTF-8 are one "other" character each. */
static inline int s_class(const fi_tok *t, const unsigned char *s, size_t n, size_t *len) {
    if (s[0] < 0x80) {
        *len = 1;
        return t->ascii_class[s[0]];
    }
    utf8proc_int32_t cp;
    utf8proc_ssize_t l = utf8proc_iterate(s, n > 4 ? 4 : (utf8proc_ssize_t)n, &cp);
    if (l < 1) {
        *len = 1;
        return FI_TOK_C_OTHER;
    }
    *len = (size_t)l;
    /* Unicode White_Space (what \s matches in Oniguruma and llama.cpp) */
    if (cp == 0x85 || cp == 0xa0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) ||
        cp == 0x2028 || cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000)
        return FI_TOK_C_SPACE;
    switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
        return FI_TOK_C_LETTER;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
        return FI_TOK_C_NUMBER;
    default:
        return FI_TOK_C_OTHER;
    }
}

/* End of the word that starts at p (p < e): one match of the pre-tokenizer.
 * With digit splitting, a number character is a word of its own and ends
 * the piece before it: lookahead treats it as the end of the text. */
static size_t s_word_end(const fi_tok *t, const unsigned char *s, size_t p, size_t e) {
    int split_digits = t->pre == FI_TOK_PRE_SMOLLM;
    size_t len0;
    int c0 = s_class(t, s + p, e - p, &len0);
    if (c0 == FI_TOK_C_NUMBER && split_digits)
        return p + len0;
    /* 's|'t|'re|'ve|'m|'ll|'d */
    if (s[p] == '\'' && p + 1 < e) {
        unsigned char a = s[p + 1];
        if (a == 's' || a == 't' || a == 'm' || a == 'd')
            return p + 2;
        if (p + 2 < e) {
            unsigned char b = s[p + 2];
            if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
                return p + 3;
        }
    }
    /* ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+' */
    size_t q = p;
    int c = c0;
    if (s[p] == ' ' && p + 1 < e) {
        size_t len1;
        int c1 = s_class(t, s + p + 1, e - p - 1, &len1);
        if (c1 == FI_TOK_C_LETTER || c1 == FI_TOK_C_OTHER ||
            (c1 == FI_TOK_C_NUMBER && !split_digits)) {
            c = c1;
            q = p + 1;
        }
    }
    if (c != FI_TOK_C_SPACE) {
        while (q < e) {
            size_t k;
            if (s_class(t, s + q, e - q, &k) != c)
                break;
            q += k;
        }
        return q;
    }
    /* '\s+(?!\S)|\s+': a run of spaces up to the end of the piece is one
     * word; before a non-space the run leaves its last space to the next
     * word, unless it is a single space */
    size_t last = p;
    int after = FI_TOK_C_SPACE;
    q = p;
    while (q < e) {
        size_t k;
        after = s_class(t, s + q, e - q, &k);
        if (after != FI_TOK_C_SPACE)
            break;
        last = q;
        q += k;
    }
    if (q == e || (split_digits && after == FI_TOK_C_NUMBER))
        return q;
    return last > p ? last : q;
}

/* Pre-tokenizes and encodes text that holds no special token. */
static int s_encode_plain(const fi_tok *t, s_work *w, const unsigned char *s, size_t n) {
    for (size_t p = 0; p < n;) {
        size_t q = s_word_end(t, s, p, n);
        assert(q > p && q <= n);
        if (s_bpe(t, w, s + p, q - p) != 0)
            return -1;
        p = q;
    }
    return 0;
}

/* The child of trie node k reached by byte c, or 0. */
static int32_t s_trie_step(const fi_tok_trie *tr, int32_t k, unsigned char c) {
    int32_t lo = tr[k].child, hi = lo + tr[k].n_child;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (tr[mid].byte < c)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < tr[k].child + tr[k].n_child && tr[lo].byte == c ? lo : 0;
}

/* The first special token in s[from, n) (leftmost, then longest): its
 * position, or n when there is none; its id in *id. */
static size_t s_find_special(const fi_tok *t, const unsigned char *s, size_t from, size_t n,
                             int parse_special, int32_t *id) {
    const fi_tok_trie *tr = t->special;
    for (size_t i = from; i < n; i++) {
        int32_t best = -1;
        for (size_t j = i, k = 0; j < n && (k = (size_t)s_trie_step(tr, (int32_t)k, s[j])) != 0; j++) {
            int32_t here = parse_special ? tr[k].any : tr[k].user;
            if (here >= 0)
                best = here;
        }
        if (best >= 0) {
            *id = best;
            return i;
        }
    }
    return n;
}

int fi_tok_encode(const fi_tok *t, const char *text, size_t len, int parse_special, int32_t *out,
                  int max_out) {
    assert(out || max_out <= 0);
    s_work w = {.out = out, .max_out = max_out > 0 ? max_out : 0};
    const unsigned char *s = (const unsigned char *)text;
    int rc = 0;
    if (parse_special || t->has_user_defined) {
        size_t p = 0;
        while (p < len && rc == 0) {
            int32_t id = -1;
            size_t at = s_find_special(t, s, p, len, parse_special, &id);
            rc = s_encode_plain(t, &w, s + p, at - p);
            if (at < len) {
                s_emit(&w, id);
                at += t->text_off[id + 1] - t->text_off[id] - 1;
            }
            p = at;
        }
    } else if (len > 0) {
        rc = s_encode_plain(t, &w, s, len);
    }
    free(w.sym);
    free(w.next);
    free(w.prev);
    free(w.heap);
    if (rc != 0 || w.n_out > INT_MAX)
        return -1;
    return (int)w.n_out;
}
