/*
 * tokenizer_chat.c - renders chat messages with the model's chat template.
 *
 * We do not run Jinja. The template text is only inspected to tell its
 * family; ChatML ("<|im_start|>role\ncontent<|im_end|>\n") is the one we
 * render, which is what SmolLM2, Qwen2 and many fine-tunes carry. A ChatML
 * template may hold a default system message as a string literal
 * ('<|im_start|>system\nYou are ...<|im_end|>\n'), which it emits when the
 * first message is not a system message; we extract that literal at load
 * and do the same. Any other family is refused with an error rather than
 * rendered wrongly.
 */
#include "tokenizer_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char s_im_start[] = "<|im_start|>";
static const char s_im_end[] = "<|im_end|>";

/* Writes the first bytes of the template, escaped, for error messages. */
static void s_head(char *o, size_t cap, const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n && k + 3 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') {
            o[k++] = '\\';
            o[k++] = 'n';
        } else {
            o[k++] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
        }
    }
    if (k + 3 < cap || n == 0) {
        o[k] = 0;
    } else {
        memcpy(o + (k < cap - 4 ? k : cap - 4), "...", 4);
    }
}

/* Finds the default system message: a string literal in the template that
 * reads <|im_start|>system, a newline (real or escaped), then text without
 * the literal's quote or Jinja markup, then <|im_end|>. Sets *out to a
 * malloc'd, unescaped copy, or NULL when there is none. -1 on allocation
 * failure. */
static int s_default_system(const char *s, size_t n, char **out) {
    *out = NULL;
    static const char needle[] = "<|im_start|>system";
    size_t nl = sizeof needle - 1;
    for (size_t i = 1; i + nl <= n; i++) {
        if (memcmp(s + i, needle, nl) != 0)
            continue;
        char quote = s[i - 1];
        if (quote != '\'' && quote != '"')
            continue;
        size_t j = i + nl;
        if (j < n && s[j] == '\n')
            j++;
        else if (j + 1 < n && s[j] == '\\' && s[j + 1] == 'n')
            j += 2;
        else
            continue;
        size_t end = j;
        int ok = 0;
        while (end < n) {
            if (n - end >= sizeof s_im_end - 1 && memcmp(s + end, s_im_end, sizeof s_im_end - 1) == 0) {
                ok = 1;
                break;
            }
            if (s[end] == quote || (s[end] == '{' && end + 1 < n && (s[end + 1] == '{' || s[end + 1] == '%')))
                break;
            end += (s[end] == '\\' && end + 1 < n) ? 2 : 1;
        }
        if (!ok)
            continue;
        char *msg = malloc(end - j + 1);
        if (!msg)
            return -1;
        size_t k = 0;
        for (size_t p = j; p < end; p++) {
            if (s[p] == '\\' && p + 1 < end) {
                char c = s[++p];
                msg[k++] = c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c;
            } else {
                msg[k++] = s[p];
            }
        }
        msg[k] = 0;
        *out = msg;
        return 0;
    }
    return 0;
}

int fi_tok_chat_load(fi_tok *t, const fi_gguf *g, char *err, size_t errlen) {
    const char *key = "tokenizer.chat_template";
    const fi_gguf_kv *kv = fi_gguf_find(g, key);
    t->chat_kind = FI_TOK_CHAT_NONE;
    if (!kv)
        return 0;
    fi_str s;
    if (fi_gguf_get_str(g, key, &s) != 0) {
        if (err && errlen)
            snprintf(err, errlen, "%s: expected a string, found %s", key,
                     fi_gguf_type_name(kv->type));
        return -1;
    }
    size_t n = (size_t)s.len;
    s_head(t->chat_head, sizeof t->chat_head, s.ptr, n);
    t->chat_kind = FI_TOK_CHAT_OTHER;
    for (size_t i = 0; i + sizeof s_im_start - 1 <= n; i++) {
        if (memcmp(s.ptr + i, s_im_start, sizeof s_im_start - 1) == 0) {
            t->chat_kind = FI_TOK_CHAT_CHATML;
            break;
        }
    }
    if (t->chat_kind == FI_TOK_CHAT_CHATML && s_default_system(s.ptr, n, &t->chat_system) != 0) {
        if (err && errlen)
            snprintf(err, errlen, "%s: out of memory", key);
        return -1;
    }
    return 0;
}

/* A growing string. */
typedef struct s_buf {
    char *p;    /* malloc'd, NUL-terminated when ok */
    size_t n;   /* bytes used, without the NUL */
    size_t cap; /* bytes allocated */
    int oom;    /* 1 after an allocation failure */
} s_buf;

static void s_put(s_buf *b, const char *s) {
    size_t k = strlen(s);
    if (b->oom)
        return;
    if (b->n + k + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + k + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, k + 1);
    b->n += k;
}

static void s_turn(s_buf *b, const char *role, const char *content) {
    s_put(b, s_im_start);
    s_put(b, role);
    s_put(b, "\n");
    s_put(b, content);
    s_put(b, s_im_end);
    s_put(b, "\n");
}

/* Whether the model's template and the messages can be rendered; 0, or
 * -1 with a message in err. */
static int s_chat_ok(const fi_tok *t, const fi_chat_msg *msgs, int n, char *err, size_t errlen) {
    if (t->chat_kind == FI_TOK_CHAT_NONE) {
        if (err && errlen)
            snprintf(err, errlen, "chat template not supported: the model has no "
                                  "tokenizer.chat_template");
        return -1;
    }
    if (t->chat_kind != FI_TOK_CHAT_CHATML) {
        if (err && errlen)
            snprintf(err, errlen, "chat template not supported: not ChatML (no <|im_start|>): \"%s\"",
                     t->chat_head);
        return -1;
    }
    if (n < 0 || (n > 0 && !msgs)) {
        if (err && errlen)
            snprintf(err, errlen, "chat: %d messages", n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (!msgs[i].role || !msgs[i].content) {
            if (err && errlen)
                snprintf(err, errlen, "chat: message %d has no %s", i,
                         msgs[i].role ? "content" : "role");
            return -1;
        }
    }
    return 0;
}

char *fi_tok_chat(const fi_tok *t, const fi_chat_msg *msgs, int n, int add_assistant, char *err,
                  size_t errlen) {
    if (s_chat_ok(t, msgs, n, err, errlen) != 0)
        return NULL;
    s_buf b = {0};
    s_put(&b, "");
    if (n > 0 && strcmp(msgs[0].role, "system") != 0 && t->chat_system)
        s_turn(&b, "system", t->chat_system);
    for (int i = 0; i < n; i++)
        s_turn(&b, msgs[i].role, msgs[i].content);
    if (add_assistant) {
        s_put(&b, s_im_start);
        s_put(&b, "assistant\n");
    }
    if (b.oom) {
        free(b.p);
        if (err && errlen)
            snprintf(err, errlen, "chat: out of memory");
        return NULL;
    }
    return b.p;
}

/* A growing array of ids. */
typedef struct s_ids {
    int32_t *p;
    int n, cap;
    int bad; /* allocation or encoding failure */
} s_ids;

/* Appends the encoding of text, its special tokens' text as those tokens
 * only with special. */
static void s_add(const fi_tok *t, s_ids *b, const char *text, int special) {
    size_t len = strlen(text);
    if (b->bad || !len) return;
    int k = fi_tok_encode(t, text, len, special, NULL, 0);
    if (k < 0 || k > INT32_MAX / 2 - b->n) {
        b->bad = 1;
        return;
    }
    if (b->n + k > b->cap) {
        int cap = b->cap ? b->cap : 256;
        while (cap < b->n + k) cap *= 2;
        int32_t *p = realloc(b->p, (size_t)cap * sizeof *p);
        if (!p) {
            b->bad = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    if (fi_tok_encode(t, text, len, special, b->p + b->n, k) != k) {
        b->bad = 1;
        return;
    }
    b->n += k;
}

/* A turn: its markers as special tokens, and between them "role\ncontent"
 * as one piece of plain text (the piece the whole string's encoding sees
 * between the two markers, so the ids are the same). */
static void s_turn_ids(const fi_tok *t, s_ids *b, const char *role, const char *content) {
    s_add(t, b, s_im_start, 1);
    s_buf mid = {0};
    s_put(&mid, role);
    s_put(&mid, "\n");
    s_put(&mid, content);
    if (mid.oom) b->bad = 1;
    else s_add(t, b, mid.p, 0);
    free(mid.p);
    s_add(t, b, s_im_end, 1);
    s_add(t, b, "\n", 0);
}

int32_t *fi_tok_chat_ids(const fi_tok *t, const fi_chat_msg *msgs, int n, int add_assistant, int *n_ids,
                         char *err, size_t errlen) {
    *n_ids = 0;
    /* the same checks and turns as fi_tok_chat */
    if (s_chat_ok(t, msgs, n, err, errlen) != 0)
        return NULL;
    s_ids b = {0};
    if (n > 0 && strcmp(msgs[0].role, "system") != 0 && t->chat_system)
        s_turn_ids(t, &b, "system", t->chat_system);
    for (int i = 0; i < n; i++) s_turn_ids(t, &b, msgs[i].role, msgs[i].content);
    if (add_assistant) {
        s_add(t, &b, s_im_start, 1);
        s_add(t, &b, "assistant\n", 0);
    }
    if (b.bad || b.n == 0) {
        free(b.p);
        if (err && errlen) snprintf(err, errlen, "chat: %s", b.bad ? "cannot tokenise the conversation" : "no tokens");
        return NULL;
    }
    *n_ids = b.n;
    return b.p;
}
