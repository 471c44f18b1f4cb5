/*
 * tokenizer_impl.h - the fi_tok structure, shared by tokenizer.c (vocabulary,
 * merges, encoding) and tokenizer_chat.c (chat template). Private to core/.
 */
#ifndef FI_TOKENIZER_IMPL_H
#define FI_TOKENIZER_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "fi_tokenizer.h"

/* Code points the byte-level alphabet uses: 0..323. */
#define FI_TOK_CP_MAX 324

/* Pre-tokenizers (tokenizer.ggml.pre). */
enum {
    FI_TOK_PRE_GPT2 = 0,   /* "gpt2": the GPT-2 pattern */
    FI_TOK_PRE_SMOLLM = 1, /* "smollm": each \p{N} alone, then the GPT-2 pattern */
};

/* Character classes of the pre-tokenizer. */
enum {
    FI_TOK_C_SPACE = 0,  /* Unicode White_Space (\s) */
    FI_TOK_C_LETTER = 1, /* \p{L} */
    FI_TOK_C_NUMBER = 2, /* \p{N} */
    FI_TOK_C_OTHER = 3,  /* anything else, and bytes that are not UTF-8 */
};

/* Per-token flags. */
enum {
    FI_TOK_F_EOG = 1, /* ends a generation */
};

/* Chat template families. */
enum {
    FI_TOK_CHAT_NONE = 0,   /* no template in the file */
    FI_TOK_CHAT_OTHER = 1,  /* a template we cannot render */
    FI_TOK_CHAT_CHATML = 2, /* <|im_start|>role\ncontent<|im_end|>\n */
};

/* One merge rule in the open-addressing table keyed by (a, b). */
typedef struct fi_tok_merge {
    int32_t a;      /* left token */
    int32_t b;      /* right token */
    int32_t rank;   /* index in tokenizer.ggml.merges; -1 marks an empty slot */
    int32_t result; /* token of a's text followed by b's */
} fi_tok_merge;

/* A node of the trie of special texts (fi_tok.special): the text bytes on
 * the path from the root spell a prefix of some special token's text. A
 * node's children are a run of nodes sorted by byte, so a scan of the text
 * steps down one byte at a time and finds the longest special that
 * starts at a position in at most that special's length of steps, however
 * many specials the vocabulary declares. */
typedef struct fi_tok_trie {
    int32_t child;    /* first child, or 0 (the root is nobody's child) */
    int16_t n_child;  /* children, 0..256 */
    uint8_t byte;     /* the byte that leads here from the parent */
    int32_t any;      /* lowest id of a special whose text ends here; -1 */
    int32_t user;     /* the same among user-defined ones (matched always); -1 */
} fi_tok_trie;

struct fi_tok {
    int32_t n_vocab;          /* tokens */
    char *text;               /* every token's text, each NUL-terminated */
    size_t *text_off;         /* (n_vocab + 1) offsets into text */
    char *piece;              /* every token's raw bytes, back to back */
    size_t *piece_off;        /* (n_vocab + 1) offsets into piece */
    uint8_t *type;            /* (n_vocab) token type, 0..6 as in GGUF */
    uint8_t *flags;           /* (n_vocab) FI_TOK_F_* */
    int32_t *vocab_slot;      /* (vocab_cap) text -> id table; -1: empty */
    size_t vocab_cap;         /* slots, a power of two */
    fi_tok_merge *merge_slot; /* (merge_cap) (a, b) -> merge table */
    size_t merge_cap;         /* slots, a power of two */
    int32_t n_merges;         /* entries in tokenizer.ggml.merges */
    int32_t byte_tok[256];    /* token of each byte's byte-level symbol; -1: none */
    int n_missing_bytes;      /* bytes without a token (dropped when encoding) */
    int16_t cp_byte[FI_TOK_CP_MAX]; /* byte of a byte-level code point; -1: none */
    uint8_t ascii_class[128];       /* FI_TOK_C_* of each ASCII character */
    fi_tok_trie *special;     /* (n_trie) trie of the special texts; node 0 the root */
    int32_t n_trie;           /* its nodes */
    int32_t n_special;        /* control and user-defined tokens with text */
    int has_user_defined;     /* 1: some special is matched even without parse_special */
    int pre;                  /* FI_TOK_PRE_* */
    int32_t bos, eos, unk, pad; /* ids, -1 when absent */
    int add_bos;              /* tokenizer.ggml.add_bos_token */
    int chat_kind;            /* FI_TOK_CHAT_* */
    char *chat_system;        /* ChatML default system message, or NULL */
    char chat_head[48];       /* start of the template, for error messages */
};

/* Id of the token whose text is the n bytes at s, or -1. */
int32_t fi_tok_find_n(const fi_tok *t, const char *s, size_t n);

/* Reads tokenizer.chat_template (optional) into t. 0, or -1 with a message
 * on a template that cannot be read (not a string). */
int fi_tok_chat_load(fi_tok *t, const fi_gguf *g, char *err, size_t errlen);

#endif /* FI_TOKENIZER_IMPL_H */
