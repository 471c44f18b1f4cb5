/*
 * fi_tokenizer.h - byte-level BPE tokenizer built from GGUF metadata.
 *
 * Supports tokenizer.ggml.model = "gpt2" (byte-level BPE with merges), the
 * pre-tokenizer split named by tokenizer.ggml.pre (SmolLM2's "smollm": each
 * digit alone, then the GPT-2 pattern), special (control) tokens, and the
 * chat template the model carries (ChatML family).
 *
 * Encoding then decoding gives back the input bytes exactly, invalid UTF-8
 * included, when every byte has a token of its own. Not every vocabulary
 * has all 256: SmolLM2's lacks 21 bytes (0x04 0x06 0x13 0x14 0x16 0x1d
 * 0xc0 0xc1 0xf1 0xf2 0xf5..0xff), and encoding drops those bytes as
 * Hugging Face tokenizers does; fi_tok_can_encode tells whether a text is
 * affected.
 */
#ifndef FI_TOKENIZER_H
#define FI_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "fi_gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_tok fi_tok;

/* Builds the tokenizer from an open GGUF. The result does not refer to g
 * after return (it copies what it needs). NULL with a message in err when
 * the metadata is missing, inconsistent or of an unsupported kind. */
fi_tok *fi_tok_new(const fi_gguf *g, char *err, size_t errlen);
void fi_tok_destroy(fi_tok **t);

int fi_tok_n_vocab(const fi_tok *t);
int32_t fi_tok_bos(const fi_tok *t);  /* -1 when the model has none */
int32_t fi_tok_eos(const fi_tok *t);
/* 1 when the model asks for bos before a prompt (tokenizer.ggml.add_bos_token);
 * fi_tok_encode never adds it itself. */
int fi_tok_add_bos(const fi_tok *t);
/* 1 when id ends a generation (eos, <|im_end|>, <|endoftext|>, ...). */
int fi_tok_is_eog(const fi_tok *t, int32_t id);
/* 1 when id is a special (control) token. */
int fi_tok_is_special(const fi_tok *t, int32_t id);
/* Id of the token whose text is exactly s, or -1. */
int32_t fi_tok_find(const fi_tok *t, const char *s);

/* 1 when every byte of text has a token, so that decoding the encoding
 * gives text back exactly; 0 when some byte would be dropped. */
int fi_tok_can_encode(const fi_tok *t, const char *text, size_t len);

/* Encodes len bytes of text. With parse_special, the text of a special
 * token ("<|im_start|>") becomes that token; without, it is plain text.
 * Writes at most max_out ids and returns the number of ids the text needs
 * (call again with a larger buffer when it exceeds max_out), or -1 on an
 * allocation failure. */
int fi_tok_encode(const fi_tok *t, const char *text, size_t len, int parse_special, int32_t *out,
                  int max_out);

/* The bytes of one token (byte-level symbols mapped back to raw bytes).
 * Writes up to cap bytes and returns the full length, or -1 for an id out
 * of range. Special tokens render as their text. No NUL is written. */
int fi_tok_piece(const fi_tok *t, int32_t id, char *buf, size_t cap);

/* Decodes n ids into a malloc'd NUL-terminated string (raw bytes, which
 * may be invalid UTF-8 if the ids are). NULL on bad id or allocation
 * failure. Caller frees. */
char *fi_tok_decode(const fi_tok *t, const int32_t *ids, int n, size_t *len_out);

/* One chat message. */
typedef struct fi_chat_msg {
    const char *role;    /* "system", "user", "assistant" */
    const char *content;
} fi_chat_msg;

/* Renders messages with the model's chat template (ChatML family: the
 * template's default system message is added when the first message is
 * not a system message, as the template does) and, with add_assistant,
 * opens the assistant's turn. Returns a malloc'd string or NULL with a
 * message in err when the template is of an unsupported kind. */
char *fi_tok_chat(const fi_tok *t, const fi_chat_msg *msgs, int n, int add_assistant, char *err,
                  size_t errlen);
/* The same conversation as token ids, the way to feed a model: the
 * template's markers become their special tokens, while roles and contents
 * are encoded as plain text, so a message that contains "<|im_end|>" or
 * "<|im_start|>system" cannot open or close a turn (encoding fi_tok_chat's
 * string with parse_special would let it). The ids equal that encoding for
 * any conversation without such text. Returns a malloc'd array of *n_ids
 * ids, or NULL with a message in err (also when there are no ids). */
int32_t *fi_tok_chat_ids(const fi_tok *t, const fi_chat_msg *msgs, int n, int add_assistant, int *n_ids,
                         char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FI_TOKENIZER_H */
