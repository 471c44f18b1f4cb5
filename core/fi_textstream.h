/*
 * fi_textstream.h - turns a stream of token pieces into text that is safe
 * to show: never half a UTF-8 character, never text that may still become
 * a stop string, and nothing from a stop string on.
 *
 * Used by the generation loop; public so that it can be tested alone.
 */
#ifndef FI_TEXTSTREAM_H
#define FI_TEXTSTREAM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_textstream fi_textstream;

/* stop: n_stop NUL-terminated strings (copied; empty ones are ignored).
 * NULL on allocation failure. */
fi_textstream *fi_textstream_new(const char *const *stop, int n_stop);
void fi_textstream_destroy(fi_textstream **ts);

/* Appends bytes. Returns 1 when a stop string is now complete (the text
 * before it is ready to be taken), 0 otherwise, -1 on allocation failure. */
int fi_textstream_push(fi_textstream *ts, const char *bytes, size_t len);

/* A piece that is not text (a control token's, shown as nothing): when a
 * stop string occurs in it, or begins in the text held back and ends in
 * it, the stream stops there, as at a stop string in the text, and 1 is
 * returned; else 0 and nothing changes. So a client's stop "<|im_start|>"
 * (or "\n<|im_start|>") still ends the answer where the model opens a
 * turn. */
int fi_textstream_mark(fi_textstream *ts, const char *piece, size_t len);

/* Text that is final: returns a pointer to *len bytes (valid until the next
 * call) and consumes them. With flush, everything held back is released
 * too (the end of generation), except what follows a matched stop. The
 * text is always valid UTF-8: a malformed byte, or a sequence cut short by
 * the flush, comes out as U+FFFD. */
const char *fi_textstream_take(fi_textstream *ts, int flush, size_t *len);

/* Forgets all text pushed and taken, as if new (the stop strings stay):
 * for a generation that starts again from its beginning. */
void fi_textstream_reset(fi_textstream *ts);

#ifdef __cplusplus
}
#endif
#endif /* FI_TEXTSTREAM_H */
