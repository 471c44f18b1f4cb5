/*
 * policy_parse.c - lexer and recursive-descent parser of the policy
 * language (grammar: policy/README.md), the symbol table and the
 * diagnostics list.
 *
 * The parser only builds the representation; names, types and attributes
 * are resolved by policy_check.c. On a syntax error the parser records a
 * diagnostic (file position, what was expected, what was found, a hint),
 * skips to the end of the statement and goes on, so that one run reports
 * every independent mistake.
 */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "policy_impl.h"

#define MAX_DIAGS 100     /* stop reporting after this many */
#define MAX_STR 1024      /* longest string literal or name */
#define MAX_COND_NODES 2048 /* terms of one rule's condition */

/* ------------------------------------------------------------ diagnostics */

fi_diags *fi_diags_new(void) { return calloc(1, sizeof(fi_diags)); }

void fi_diags_destroy(fi_diags **self_p) {
    if (!self_p || !*self_p) return;
    free((*self_p)->v);
    free(*self_p);
    *self_p = NULL;
}

size_t fi_diags_count(const fi_diags *self) { return self ? self->n : 0; }

static size_t s_count_level(const fi_diags *self, fi_diag_level lv) {
    size_t k = 0;
    for (size_t i = 0; self && i < self->n; i++) k += self->v[i].level == lv;
    return k;
}

size_t fi_diags_errors(const fi_diags *self) { return s_count_level(self, FI_DIAG_ERROR); }
size_t fi_diags_warnings(const fi_diags *self) { return s_count_level(self, FI_DIAG_WARNING); }

const fi_diag *fi_diags_get(const fi_diags *self, size_t i) {
    return self && i < self->n ? &self->v[i] : NULL;
}

void fi_diag_format(const fi_diag *d, const char *file, char *buf, size_t cap) {
    const char *lv = d->level == FI_DIAG_ERROR ? "error" : "warning";
    if (!file) file = "<policy>";
    int k;
    if (d->line)
        k = snprintf(buf, cap, "%s:%u:%u: %s: %s", file, d->line, d->col, lv, d->msg);
    else
        k = snprintf(buf, cap, "%s: %s: %s", file, lv, d->msg);
    if (d->hint[0] && k >= 0 && (size_t)k < cap)
        snprintf(buf + k, cap - (size_t)k, "\n    hint: %s", d->hint);
}

void fi_diags_print(const fi_diags *self, const char *file, FILE *out) {
    char buf[700];
    for (size_t i = 0; self && i < self->n; i++) {
        fi_diag_format(&self->v[i], file, buf, sizeof buf);
        fprintf(out, "%s\n", buf);
    }
}

/* Records a diagnostic in file order; silently drops it past MAX_DIAGS or
 * when out of memory (the caller's error count still reflects the first). */
void p_diag(fi_diags *d, fi_diag_level lv, unsigned line, unsigned col, const char *hint,
            const char *fmt, ...) {
    if (!d || d->n >= MAX_DIAGS) return;
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 16;
        fi_diag *v = realloc(d->v, cap * sizeof *v);
        if (!v) return;
        d->v = v;
        d->cap = cap;
    }
    size_t at = d->n;
    while (at > 0 && (d->v[at - 1].line > line ||
                      (d->v[at - 1].line == line && d->v[at - 1].col > col)))
        at--;
    memmove(&d->v[at + 1], &d->v[at], (d->n - at) * sizeof *d->v);
    fi_diag *x = &d->v[at];
    memset(x, 0, sizeof *x);
    x->level = lv;
    x->line = line;
    x->col = col;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->msg, sizeof x->msg, fmt, ap);
    va_end(ap);
    if (hint) snprintf(x->hint, sizeof x->hint, "%s", hint);
    d->n++;
}

/* ---------------------------------------------------------------- symbols */

static uint32_t s_hash(const char *s, size_t len) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h;
}

const char *p_str(const fi_policy *pol, uint32_t sym) {
    if (sym >= pol->n_syms) return sym == SYM_NONE ? "(none)" : "(unknown)";
    return pol->strs + pol->sym_off[sym];
}

static int s_rehash(fi_policy *pol, uint32_t cap) {
    uint32_t *h = calloc(cap, sizeof *h);
    if (!h) return -1;
    for (uint32_t s = 0; s < pol->n_syms; s++) {
        const char *t = p_str(pol, s);
        uint32_t i = s_hash(t, strlen(t)) & (cap - 1);
        while (h[i]) i = (i + 1) & (cap - 1);
        h[i] = s + 1;
    }
    free(pol->hash);
    pol->hash = h;
    pol->hash_cap = cap;
    return 0;
}

static uint32_t s_find(const fi_policy *pol, const char *s, size_t len) {
    if (!pol->hash_cap) return SYM_UNKNOWN;
    uint32_t i = s_hash(s, len) & (pol->hash_cap - 1);
    while (pol->hash[i]) {
        uint32_t sym = pol->hash[i] - 1;
        const char *t = p_str(pol, sym);
        if (strlen(t) == len && !memcmp(t, s, len)) return sym;
        i = (i + 1) & (pol->hash_cap - 1);
    }
    return SYM_UNKNOWN;
}

/* Never allocates: usable on the evaluation path. */
uint32_t p_lookup(const fi_policy *pol, const char *s) { return s_find(pol, s, strlen(s)); }

uint32_t p_intern(fi_policy *pol, const char *s, size_t len) {
    uint32_t f = s_find(pol, s, len);
    if (f != SYM_UNKNOWN) return f;
    if (memchr(s, 0, len)) return SYM_NONE;
    if (pol->strs_len + len + 1 > pol->strs_cap) {
        size_t cap = pol->strs_cap ? pol->strs_cap * 2 : 1024;
        while (cap < pol->strs_len + len + 1) cap *= 2;
        char *n = realloc(pol->strs, cap);
        if (!n) return SYM_NONE;
        pol->strs = n;
        pol->strs_cap = cap;
    }
    if (pol->n_syms == pol->cap_syms) {
        uint32_t cap = pol->cap_syms ? pol->cap_syms * 2 : 64;
        uint32_t *n = realloc(pol->sym_off, cap * sizeof *n);
        if (!n) return SYM_NONE;
        pol->sym_off = n;
        pol->cap_syms = cap;
    }
    pol->sym_off[pol->n_syms] = (uint32_t)pol->strs_len;
    memcpy(pol->strs + pol->strs_len, s, len);
    pol->strs[pol->strs_len + len] = 0;
    pol->strs_len += len + 1;
    pol->n_syms++;
    if ((pol->n_syms + 1) * 2 > pol->hash_cap) {
        if (s_rehash(pol, pol->hash_cap ? pol->hash_cap * 2 : 128)) {
            pol->n_syms--;
            return SYM_NONE;
        }
    } else {
        uint32_t i = s_hash(s, len) & (pol->hash_cap - 1);
        while (pol->hash[i]) i = (i + 1) & (pol->hash_cap - 1);
        pol->hash[i] = pol->n_syms;
    }
    return pol->n_syms - 1;
}

fi_policy *p_policy_new(void) {
    fi_policy *pol = calloc(1, sizeof *pol);
    if (pol) pol->default_label = SYM_NONE;
    return pol;
}

/* Grows an array of element size sz to hold one more; 0 or -1. */
static int s_grow(void **v, uint32_t *cap, uint32_t n, size_t sz) {
    if (n < *cap) return 0;
    uint32_t c = *cap ? *cap * 2 : 16;
    void *x = realloc(*v, (size_t)c * sz);
    if (!x) return -1;
    *v = x;
    *cap = c;
    return 0;
}

/* ------------------------------------------------------------------ lexer */

typedef enum {
    T_EOF = 0, T_IDENT, T_STRING, T_NUMBER, T_SEMI, T_COMMA, T_DOT, T_LBRACE, T_RBRACE,
    T_LBRACK, T_RBRACK, T_LPAREN, T_RPAREN, T_ASSIGN, T_EQ, T_NE, T_LT, T_LE, T_GT, T_GE,
    T_BAD
} tok_kind;

typedef struct tok {
    tok_kind k;
    const char *s;   /* start in the text */
    size_t len;      /* bytes in the text */
    unsigned line;
    unsigned col;
    int64_t num;     /* T_NUMBER */
    char str[MAX_STR]; /* T_STRING: unescaped; T_IDENT: copy */
    size_t slen;
} tok;

typedef struct parser {
    fi_policy *pol;
    fi_diags *d;
    const char *p;    /* next byte */
    const char *end;
    unsigned line;
    unsigned col;
    tok t;            /* current token */
    int errors;       /* syntax errors so far */
    int depth;        /* nesting of conditions */
    bool oom;
    bool halt;        /* a limit was passed: parse no further */
} parser;

static const char *s_tok_name(tok_kind k) {
    static const char *n[] = {"end of file", "a name", "a string", "a number", "';'", "','",
                              "'.'", "'{'", "'}'", "'['", "']'", "'('", "')'", "'='", "'=='",
                              "'!='", "'<'", "'<='", "'>'", "'>='", "an invalid character"};
    return n[k];
}

/* Describes the current token for "found ..." in messages. */
static void s_found(const parser *ps, char *buf, size_t cap) {
    const tok *t = &ps->t;
    if (t->k == T_EOF) snprintf(buf, cap, "end of file");
    else if (t->k == T_STRING) snprintf(buf, cap, "string \"%.40s\"", t->str);
    else if (t->k == T_BAD && t->len == 1 && !isprint((unsigned char)t->s[0]))
        snprintf(buf, cap, "byte 0x%02x", (unsigned char)t->s[0]);
    else snprintf(buf, cap, "'%.*s'", (int)(t->len > 40 ? 40 : t->len), t->s);
}

static void s_adv(parser *ps, size_t n) {
    for (size_t i = 0; i < n && ps->p < ps->end; i++, ps->p++) {
        if (*ps->p == '\n') {
            ps->line++;
            ps->col = 1;
        } else {
            ps->col++;
        }
    }
}

static void s_lex_error(parser *ps, unsigned line, unsigned col, const char *hint, const char *msg) {
    p_diag(ps->d, FI_DIAG_ERROR, line, col, hint, "%s", msg);
    ps->errors++;
}

static bool s_ident_start(int c) { return isalpha(c) || c == '_'; }
static bool s_ident_char(int c) { return isalnum(c) || c == '_' || c == '-'; }

/* Reads the next token into ps->t. Lexical errors are reported here and
 * produce T_BAD, which no grammar rule accepts. */
static void s_next(parser *ps) {
    tok *t = &ps->t;
    for (;;) {
        while (ps->p < ps->end && isspace((unsigned char)*ps->p)) s_adv(ps, 1);
        if (ps->p < ps->end && (*ps->p == '#' || (*ps->p == '/' && ps->p + 1 < ps->end && ps->p[1] == '/'))) {
            while (ps->p < ps->end && *ps->p != '\n') s_adv(ps, 1);
            continue;
        }
        break;
    }
    t->s = ps->p;
    t->line = ps->line;
    t->col = ps->col;
    t->len = 0;
    t->slen = 0;
    t->str[0] = 0;
    if (ps->p >= ps->end) {
        t->k = T_EOF;
        return;
    }
    int c = (unsigned char)*ps->p;
    const char *p = ps->p;
    if (s_ident_start(c)) {
        size_t n = 1;
        while (p + n < ps->end && s_ident_char((unsigned char)p[n])) n++;
        t->k = T_IDENT;
        t->len = n;
        if (n >= MAX_STR) {
            s_lex_error(ps, t->line, t->col, "names are at most 1023 characters", "name too long");
            t->k = T_BAD;
        } else {
            memcpy(t->str, p, n);
            t->str[n] = 0;
            t->slen = n;
        }
        s_adv(ps, n);
        return;
    }
    if (isdigit(c) || (c == '-' && p + 1 < ps->end && isdigit((unsigned char)p[1]))) {
        size_t n = 1;
        while (p + n < ps->end && isdigit((unsigned char)p[n])) n++;
        t->k = T_NUMBER;
        t->len = n;
        if (p + n < ps->end && (s_ident_char((unsigned char)p[n]) || p[n] == '.')) {
            while (p + n < ps->end && (s_ident_char((unsigned char)p[n]) || p[n] == '.')) n++;
            t->len = n;
            s_lex_error(ps, t->line, t->col,
                        "numbers are whole decimal numbers such as 42 or -7; names start with a letter",
                        "malformed number");
            t->k = T_BAD;
            s_adv(ps, n);
            return;
        }
        char buf[32];
        if (n >= sizeof buf) {
            s_lex_error(ps, t->line, t->col, "numbers must fit in a signed 64-bit integer",
                        "number out of range");
            t->k = T_BAD;
            s_adv(ps, n);
            return;
        }
        memcpy(buf, p, n);
        buf[n] = 0;
        errno = 0;
        long long v = strtoll(buf, NULL, 10);
        if (errno == ERANGE) {
            s_lex_error(ps, t->line, t->col, "numbers must fit in a signed 64-bit integer",
                        "number out of range");
            t->k = T_BAD;
        }
        t->num = v;
        s_adv(ps, n);
        return;
    }
    if (c == '"') {
        size_t n = 1, o = 0;
        for (;;) {
            if (p + n >= ps->end || p[n] == '\n') {
                t->len = n;
                s_lex_error(ps, t->line, t->col, "close the string with '\"' on the same line",
                            "unterminated string");
                t->k = T_BAD;
                s_adv(ps, n);
                return;
            }
            char ch = p[n];
            if (ch == '"') break;
            if (ch == '\\') {
                char e = p + n + 1 < ps->end ? p[n + 1] : 0;
                if (e == '"' || e == '\\') ch = e;
                else if (e == 'n') ch = '\n';
                else if (e == 't') ch = '\t';
                else {
                    unsigned col = t->col + (unsigned)n;
                    t->len = n + 2;
                    s_lex_error(ps, t->line, col, "the escapes are \\\" \\\\ \\n and \\t",
                                "unknown escape in string");
                    t->k = T_BAD;
                    s_adv(ps, n + 1);
                    /* skip the rest of the string */
                    while (ps->p < ps->end && *ps->p != '"' && *ps->p != '\n') s_adv(ps, 1);
                    if (ps->p < ps->end && *ps->p == '"') s_adv(ps, 1);
                    return;
                }
                n++;
            } else if ((unsigned char)ch < 0x20) {
                t->len = n;
                s_lex_error(ps, t->line, t->col + (unsigned)n, "write control characters as \\n or \\t",
                            "control character in string");
                t->k = T_BAD;
                s_adv(ps, n + 1);
                return;
            }
            if (o + 1 >= MAX_STR) {
                t->len = n;
                s_lex_error(ps, t->line, t->col, "strings are at most 1023 bytes", "string too long");
                t->k = T_BAD;
                while (ps->p < ps->end && *ps->p != '\n') s_adv(ps, 1);
                return;
            }
            t->str[o++] = ch;
            n++;
        }
        t->str[o] = 0;
        t->slen = o;
        t->len = n + 1;
        t->k = T_STRING;
        s_adv(ps, n + 1);
        return;
    }
    char c2 = p + 1 < ps->end ? p[1] : 0;
    tok_kind k = T_BAD;
    size_t n = 1;
    switch (c) {
    case ';': k = T_SEMI; break;
    case ',': k = T_COMMA; break;
    case '.': k = T_DOT; break;
    case '{': k = T_LBRACE; break;
    case '}': k = T_RBRACE; break;
    case '[': k = T_LBRACK; break;
    case ']': k = T_RBRACK; break;
    case '(': k = T_LPAREN; break;
    case ')': k = T_RPAREN; break;
    case '=': if (c2 == '=') { k = T_EQ; n = 2; } else k = T_ASSIGN; break;
    case '!': if (c2 == '=') { k = T_NE; n = 2; } break;
    case '<': if (c2 == '=') { k = T_LE; n = 2; } else k = T_LT; break;
    case '>': if (c2 == '=') { k = T_GE; n = 2; } else k = T_GT; break;
    default: break;
    }
    if (k == T_BAD && (c == '&' || c == '|') && c2 == c) n = 2; /* report && and || once */
    t->k = k;
    t->len = n;
    if (k == T_BAD) {
        char msg[80];
        if (n == 2)
            snprintf(msg, sizeof msg, "unexpected '%c%c'", c, c);
        else if (c == '!')
            snprintf(msg, sizeof msg, "unexpected '!'");
        else if (isprint(c))
            snprintf(msg, sizeof msg, "unexpected character '%c'", c);
        else
            snprintf(msg, sizeof msg, "unexpected byte 0x%02x", (unsigned)c);
        s_lex_error(ps, t->line, t->col,
                    c == '!' ? "negation is written `not`; inequality is `!=`"
                    : c == '&' || c == '|' ? "conditions combine with the words `and` and `or`"
                    : c == '\'' ? "strings are written in double quotes"
                                : "see policy/README.md for the tokens of the language",
                    msg);
    }
    s_adv(ps, n);
}

static bool s_is_kw(const parser *ps, const char *kw) {
    return ps->t.k == T_IDENT && !strcmp(ps->t.str, kw);
}

static const char *const s_keywords[] = {
    "labels", "default_label", "expires", "jurisdiction", "region", "site", "cluster", "permit",
    "forbid", "prefer", "when", "score", "and", "or", "not", "in", "within", "has", "true",
    "false", "request", "target", NULL};

static bool s_is_keyword(const char *s) {
    for (size_t i = 0; s_keywords[i]; i++)
        if (!strcmp(s, s_keywords[i])) return true;
    return false;
}

/* Reports "expected X, found Y" at the current token. Returns -1. */
static int s_expected(parser *ps, const char *what, const char *hint) {
    if (ps->t.k == T_BAD) return -1; /* already reported by the lexer */
    char f[80];
    s_found(ps, f, sizeof f);
    p_diag(ps->d, FI_DIAG_ERROR, ps->t.line, ps->t.col, hint, "expected %s, found %s", what, f);
    ps->errors++;
    return -1;
}

static int s_expect(parser *ps, tok_kind k, const char *context, const char *hint) {
    if (ps->t.k == k) {
        s_next(ps);
        return 0;
    }
    char what[160];
    snprintf(what, sizeof what, "%s %s", s_tok_name(k), context);
    return s_expected(ps, what, hint);
}

/* Skips to just after the next ';' at nesting depth 0, or to a statement
 * keyword at the start of a line, so that parsing can resume. */
static void s_recover(parser *ps) {
    int depth = 0; /* braces opened since the error */
    while (ps->t.k != T_EOF) {
        if (ps->t.k == T_LBRACE) {
            depth++;
        } else if (ps->t.k == T_RBRACE) {
            s_next(ps);
            if (depth-- <= 1) return; /* the block that held the error, or one opened since */
            continue;
        } else if (ps->t.k == T_SEMI && depth == 0) {
            s_next(ps);
            return;
        } else if (depth == 0 && ps->t.col == 1 && ps->t.k == T_IDENT &&
                   (s_is_kw(ps, "permit") || s_is_kw(ps, "forbid") || s_is_kw(ps, "prefer") || s_is_kw(ps, "site") ||
                    s_is_kw(ps, "cluster") || s_is_kw(ps, "region") || s_is_kw(ps, "jurisdiction") ||
                    s_is_kw(ps, "labels") || s_is_kw(ps, "default_label") || s_is_kw(ps, "expires"))) {
            return;
        }
        s_next(ps);
    }
}

/* ------------------------------------------------------------ nodes, sets */

static uint32_t s_node(parser *ps, uint8_t op, unsigned line, unsigned col) {
    fi_policy *pol = ps->pol;
    if (s_grow((void **)&pol->nodes, &pol->cap_nodes, pol->n_nodes, sizeof(p_node))) {
        ps->oom = true;
        return NODE_NONE;
    }
    p_node *n = &pol->nodes[pol->n_nodes];
    memset(n, 0, sizeof *n);
    n->op = op;
    n->a = n->b = NODE_NONE;
    n->attr = n->path2 = SYM_NONE;
    n->line = line;
    n->col = col;
    return pol->n_nodes++;
}

static int s_cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Parses a literal: STRING | NUMBER | true | false | "[" [STRING {"," STRING}] "]". */
static int s_literal(parser *ps, p_value *v, const char *context) {
    fi_policy *pol = ps->pol;
    memset(v, 0, sizeof *v);
    if (ps->t.k == T_STRING) {
        v->type = VT_STR;
        v->sym = p_intern(pol, ps->t.str, ps->t.slen);
        if (v->sym == SYM_NONE) {
            if (memchr(ps->t.str, 0, ps->t.slen)) goto nul;
            ps->oom = true;
            return -1;
        }
        s_next(ps);
        return 0;
    }
    if (ps->t.k == T_NUMBER) {
        v->type = VT_NUM;
        v->num = ps->t.num;
        s_next(ps);
        return 0;
    }
    if (s_is_kw(ps, "true") || s_is_kw(ps, "false")) {
        v->type = VT_BOOL;
        v->num = s_is_kw(ps, "true");
        s_next(ps);
        return 0;
    }
    if (ps->t.k == T_LBRACK) {
        s_next(ps);
        uint32_t start = pol->n_pool;
        while (ps->t.k != T_RBRACK) {
            if (ps->t.k != T_STRING)
                return s_expected(ps, "a string in the set",
                                  "sets hold strings only, e.g. [\"pii\", \"phi\"]");
            uint32_t sym = p_intern(pol, ps->t.str, ps->t.slen);
            if (sym == SYM_NONE) {
                if (memchr(ps->t.str, 0, ps->t.slen)) goto nul;
                ps->oom = true;
                return -1;
            }
            if (s_grow((void **)&pol->pool, &pol->cap_pool, pol->n_pool, sizeof(uint32_t))) {
                ps->oom = true;
                return -1;
            }
            pol->pool[pol->n_pool++] = sym;
            s_next(ps);
            if (ps->t.k == T_COMMA) {
                s_next(ps);
                if (ps->t.k == T_RBRACK) /* the grammar has no trailing ',' */
                    return s_expected(ps, "a string after ',' in the set", "drop the ',' before ']'");
                continue;
            }
            if (ps->t.k != T_RBRACK)
                return s_expected(ps, "',' or ']' in the set", "separate the elements with ','");
        }
        s_next(ps);
        /* sort and drop duplicates */
        uint32_t n = pol->n_pool - start;
        if (n) qsort(pol->pool + start, n, sizeof(uint32_t), s_cmp_u32);
        uint32_t w = 0;
        for (uint32_t i = 0; i < n; i++)
            if (!w || pol->pool[start + w - 1] != pol->pool[start + i]) pol->pool[start + w++] = pol->pool[start + i];
        pol->n_pool = start + w;
        v->type = VT_SET;
        v->off = start;
        v->n = w;
        return 0;
    }
    char what[120];
    snprintf(what, sizeof what, "a value %s", context);
    return s_expected(ps, what, "a value is a string \"x\", a number, true, false or a set [\"a\", \"b\"]");
nul:
    s_lex_error(ps, ps->t.line, ps->t.col, "strings may not contain NUL bytes", "NUL byte in string");
    return -1;
}

/* ------------------------------------------------------------- conditions */

static uint32_t s_cond(parser *ps);

/* path = "request" "." IDENT ["." IDENT] | "target" ["." IDENT] */
static uint32_t s_path(parser *ps) {
    unsigned line = ps->t.line, col = ps->t.col;
    bool req = s_is_kw(ps, "request");
    s_next(ps);
    if (ps->t.k != T_DOT) {
        if (req && s_is_kw(ps, "has")) {
            uint32_t n = s_node(ps, OP_ATTR, line, col); /* bare request, only before has */
            if (n != NODE_NONE) ps->pol->nodes[n].scope = SC_REQ;
            return n;
        }
        if (req) {
            s_expected(ps, "'.' and an attribute after 'request'",
                       "request attributes: tenant, application, model, labels, origin.site, "
                       "origin.region, origin.jurisdiction, latency_ms, prompt_tokens");
            return NODE_NONE;
        }
        uint32_t n = s_node(ps, OP_TARGET, line, col);
        return n;
    }
    s_next(ps);
    if (ps->t.k != T_IDENT) {
        s_expected(ps, "an attribute name after '.'", "attribute names are written without quotes");
        return NODE_NONE;
    }
    uint32_t n = s_node(ps, OP_ATTR, line, col);
    if (n == NODE_NONE) return n;
    p_node *x = &ps->pol->nodes[n];
    x->scope = req ? SC_REQ : SC_TGT;
    x->attr = p_intern(ps->pol, ps->t.str, ps->t.slen);
    s_next(ps);
    if (ps->t.k == T_DOT) {
        s_next(ps);
        if (ps->t.k != T_IDENT) {
            s_expected(ps, "an attribute name after '.'", "e.g. request.origin.site");
            return NODE_NONE;
        }
        ps->pol->nodes[n].path2 = p_intern(ps->pol, ps->t.str, ps->t.slen);
        s_next(ps);
        if (ps->t.k == T_DOT) {
            s_expected(ps, "an operator after the attribute",
                       "paths have at most three parts, as in request.origin.site");
            return NODE_NONE;
        }
    }
    return n;
}

/* value = literal | path | "(" cond ")" */
static uint32_t s_value(parser *ps) {
    unsigned line = ps->t.line, col = ps->t.col;
    if (s_is_kw(ps, "request") || s_is_kw(ps, "target")) return s_path(ps);
    if (ps->t.k == T_LPAREN) {
        if (++ps->depth > FI_POLICY_MAX_DEPTH) {
            p_diag(ps->d, FI_DIAG_ERROR, line, col, "split the condition into several rules",
                   "conditions nested deeper than %d levels", FI_POLICY_MAX_DEPTH);
            ps->errors++;
            return NODE_NONE;
        }
        s_next(ps);
        uint32_t n = s_cond(ps);
        ps->depth--;
        if (n == NODE_NONE) return n;
        if (s_expect(ps, T_RPAREN, "to close the '('", "every '(' needs its ')'")) return NODE_NONE;
        return n;
    }
    if (ps->t.k == T_STRING || ps->t.k == T_NUMBER || ps->t.k == T_LBRACK || s_is_kw(ps, "true") ||
        s_is_kw(ps, "false")) {
        p_value v;
        if (s_literal(ps, &v, "")) return NODE_NONE;
        uint8_t op = v.type == VT_STR ? OP_STR : v.type == VT_NUM ? OP_NUM : v.type == VT_SET ? OP_SET
                     : v.num ? OP_TRUE : OP_FALSE;
        uint32_t n = s_node(ps, op, line, col);
        if (n != NODE_NONE) ps->pol->nodes[n].lit = v;
        return n;
    }
    if (ps->t.k == T_IDENT && !s_is_keyword(ps->t.str)) {
        char hint[200];
        snprintf(hint, sizeof hint,
                 "write names of entities and labels as strings (\"%.60s\"), attributes as "
                 "request.x or target.x", ps->t.str);
        s_expected(ps, "a value (a string, number, set, request.x or target.x)", hint);
        return NODE_NONE;
    }
    s_expected(ps, "a condition (a comparison such as target.cost < 5, \"phi\" in request.labels)",
               "see policy/README.md for the operators");
    return NODE_NONE;
}

/* test = value [relop value] | path "has" IDENT */
static uint32_t s_test(parser *ps) {
    uint32_t a = s_value(ps);
    if (a == NODE_NONE) return a;
    unsigned line = ps->t.line, col = ps->t.col;
    uint8_t op = 0xff;
    switch (ps->t.k) {
    case T_EQ: op = OP_EQ; break;
    case T_NE: op = OP_NE; break;
    case T_LT: op = OP_LT; break;
    case T_LE: op = OP_LE; break;
    case T_GT: op = OP_GT; break;
    case T_GE: op = OP_GE; break;
    case T_ASSIGN:
        s_expected(ps, "a comparison operator", "equality is written '=='");
        return NODE_NONE;
    case T_IDENT:
        if (s_is_kw(ps, "in")) op = OP_IN;
        else if (s_is_kw(ps, "within")) op = OP_WITHIN;
        else if (s_is_kw(ps, "has")) op = OP_HAS;
        break;
    default: break;
    }
    if (op == 0xff) return a;
    s_next(ps);
    if (op == OP_HAS) {
        p_node *pa = &ps->pol->nodes[a];
        bool bare = (pa->op == OP_TARGET) || (pa->op == OP_ATTR && pa->attr == SYM_NONE);
        if (!bare) {
            p_diag(ps->d, FI_DIAG_ERROR, line, col, "write `target has cost` or `request has model`",
                   "'has' applies to `target` or `request`, not to an attribute");
            ps->errors++;
            return NODE_NONE;
        }
        if (ps->t.k != T_IDENT) {
            s_expected(ps, "an attribute name after 'has'", "e.g. target has cost");
            return NODE_NONE;
        }
        uint8_t scope = pa->op == OP_TARGET ? SC_TGT : SC_REQ;
        uint32_t n = s_node(ps, OP_HAS, line, col);
        if (n == NODE_NONE) return n;
        p_node *x = &ps->pol->nodes[n];
        x->scope = scope;
        x->attr = p_intern(ps->pol, ps->t.str, ps->t.slen);
        x->line = ps->pol->nodes[a].line;
        x->col = ps->pol->nodes[a].col;
        s_next(ps);
        return n;
    }
    uint32_t b = s_value(ps);
    if (b == NODE_NONE) return b;
    if (ps->t.k == T_EQ || ps->t.k == T_NE || ps->t.k == T_LT || ps->t.k == T_LE || ps->t.k == T_GT ||
        ps->t.k == T_GE || s_is_kw(ps, "in") || s_is_kw(ps, "within")) {
        p_diag(ps->d, FI_DIAG_ERROR, ps->t.line, ps->t.col,
               "combine comparisons with `and`, e.g. a < b and b < c",
               "comparisons do not chain: expected `and`, `or`, ')' or ';', found '%.*s'",
               (int)ps->t.len, ps->t.s);
        ps->errors++;
        return NODE_NONE;
    }
    uint32_t n = s_node(ps, op, ps->pol->nodes[a].line, ps->pol->nodes[a].col);
    if (n == NODE_NONE) return n;
    ps->pol->nodes[n].a = a;
    ps->pol->nodes[n].b = b;
    (void)line;
    (void)col;
    return n;
}

static uint32_t s_unary(parser *ps) {
    if (s_is_kw(ps, "not")) {
        unsigned line = ps->t.line, col = ps->t.col;
        if (++ps->depth > FI_POLICY_MAX_DEPTH) {
            p_diag(ps->d, FI_DIAG_ERROR, line, col, "split the condition into several rules",
                   "conditions nested deeper than %d levels", FI_POLICY_MAX_DEPTH);
            ps->errors++;
            return NODE_NONE;
        }
        s_next(ps);
        uint32_t a = s_unary(ps);
        ps->depth--;
        if (a == NODE_NONE) return a;
        uint32_t n = s_node(ps, OP_NOT, line, col);
        if (n != NODE_NONE) ps->pol->nodes[n].a = a;
        return n;
    }
    return s_test(ps);
}

static uint32_t s_conj(parser *ps) {
    uint32_t a = s_unary(ps);
    while (a != NODE_NONE && s_is_kw(ps, "and")) {
        unsigned line = ps->t.line, col = ps->t.col;
        s_next(ps);
        uint32_t b = s_unary(ps);
        if (b == NODE_NONE) return b;
        uint32_t n = s_node(ps, OP_AND, line, col);
        if (n == NODE_NONE) return n;
        ps->pol->nodes[n].a = a;
        ps->pol->nodes[n].b = b;
        ps->pol->nodes[n].line = ps->pol->nodes[a].line;
        ps->pol->nodes[n].col = ps->pol->nodes[a].col;
        a = n;
    }
    return a;
}

/* cond = conj {"or" conj} */
static uint32_t s_cond(parser *ps) {
    uint32_t a = s_conj(ps);
    while (a != NODE_NONE && s_is_kw(ps, "or")) {
        s_next(ps);
        uint32_t b = s_conj(ps);
        if (b == NODE_NONE) return b;
        uint32_t n = s_node(ps, OP_OR, ps->pol->nodes[a].line, ps->pol->nodes[a].col);
        if (n == NODE_NONE) return n;
        ps->pol->nodes[n].a = a;
        ps->pol->nodes[n].b = b;
        a = n;
    }
    return a;
}

/* ------------------------------------------------------------- statements */

/* name = IDENT | STRING; returns the symbol or SYM_NONE after reporting. */
static uint32_t s_name(parser *ps, const char *what, const char *hint) {
    if ((ps->t.k == T_IDENT && !s_is_keyword(ps->t.str)) || (ps->t.k == T_STRING && ps->t.slen)) {
        uint32_t sym = p_intern(ps->pol, ps->t.str, ps->t.slen);
        if (sym == SYM_NONE) {
            ps->oom = true;
            return SYM_NONE;
        }
        s_next(ps);
        return sym;
    }
    if (ps->t.k == T_IDENT) {
        p_diag(ps->d, FI_DIAG_ERROR, ps->t.line, ps->t.col,
               "keywords cannot be names; quote the name (\"in\") or choose another",
               "expected %s, found the keyword '%.20s'", what, ps->t.str);
        ps->errors++;
        return SYM_NONE;
    }
    s_expected(ps, what, hint);
    return SYM_NONE;
}

static int s_rule(parser *ps) {
    fi_policy *pol = ps->pol;
    unsigned line = ps->t.line, col = ps->t.col;
    /* Refused here, before the rest is read: the checks of a rule set of
     * any size need not be bounded then. */
    if (pol->n_rules == FI_POLICY_MAX_RULES) {
        p_diag(ps->d, FI_DIAG_ERROR, line, col, "split the policy",
               "too many rules: this is rule %d, at most %d are allowed", FI_POLICY_MAX_RULES + 1,
               FI_POLICY_MAX_RULES);
        ps->errors++;
        ps->halt = true;
        return -1;
    }
    uint8_t effect = s_is_kw(ps, "permit") ? FI_PERMIT : s_is_kw(ps, "forbid") ? FI_FORBID : FI_PREFER;
    s_next(ps);
    if (ps->t.k != T_STRING || !ps->t.slen)
        return s_expected(ps, "the rule's id as a non-empty string",
                          "every rule has an id, e.g. forbid \"phi stays on site\" when ...;");
    uint32_t id = p_intern(pol, ps->t.str, ps->t.slen);
    if (id == SYM_NONE) {
        ps->oom = true;
        return -1;
    }
    unsigned id_line = ps->t.line, id_col = ps->t.col;
    s_next(ps);
    int64_t score = 0;
    if (effect == FI_PREFER) {
        if (!s_is_kw(ps, "score"))
            return s_expected(ps, "'score' after the id of a prefer rule",
                              "prefer \"cheap\" score 10 when target.cost < 5;");
        s_next(ps);
        if (ps->t.k != T_NUMBER)
            return s_expected(ps, "a whole number after 'score'", "e.g. score 10 or score -5");
        score = ps->t.num;
        if (score > 1000000000LL || score < -1000000000LL) {
            p_diag(ps->d, FI_DIAG_ERROR, ps->t.line, ps->t.col, "keep scores within +-1000000000",
                   "score %lld out of range", (long long)score);
            ps->errors++;
            return -1;
        }
        s_next(ps);
    } else if (s_is_kw(ps, "score")) {
        p_diag(ps->d, FI_DIAG_ERROR, ps->t.line, ps->t.col,
               "scores belong to prefer rules; permit and forbid only decide",
               "expected 'when' or ';' after the rule id, found 'score'");
        ps->errors++;
        return -1;
    }
    uint32_t cond = NODE_NONE;
    if (s_is_kw(ps, "when")) {
        unsigned cline = ps->t.line, ccol = ps->t.col;
        uint32_t first = pol->n_nodes;
        s_next(ps);
        ps->depth = 0;
        cond = s_cond(ps);
        if (cond == NODE_NONE) return -1;
        /* The evaluators recurse along and/or chains: bound their length. */
        if (pol->n_nodes - first > MAX_COND_NODES) {
            p_diag(ps->d, FI_DIAG_ERROR, cline, ccol, "split the condition into several rules",
                   "condition too long: %u terms (at most %d)", pol->n_nodes - first, MAX_COND_NODES);
            ps->errors++;
            return -1;
        }
    } else if (ps->t.k != T_SEMI) {
        return s_expected(ps, "'when' or ';' after the rule id",
                          "permit \"id\" when CONDITION;  or, unconditionally, permit \"id\";");
    }
    if (ps->t.k != T_SEMI)
        return s_expected(ps, "';' at the end of the rule",
                          ps->t.k == T_IDENT ? "conditions combine with `and` / `or`; every rule ends with ';'"
                                             : "every rule ends with ';'");
    s_next(ps);
    if (s_grow((void **)&pol->rules, &pol->cap_rules, pol->n_rules, sizeof(p_rule))) {
        ps->oom = true;
        return -1;
    }
    p_rule *r = &pol->rules[pol->n_rules++];
    memset(r, 0, sizeof *r);
    r->id = id;
    r->effect = effect;
    r->score = score;
    r->cond = cond;
    r->line = id_line;
    r->col = id_col;
    (void)line;
    (void)col;
    return 0;
}

/* IDENT "=" literal ";" inside an entity's braces. Keywords are accepted
 * as names here so that the checker can say why a name is not allowed. */
static int s_attr_assign(parser *ps, uint32_t ei) {
    fi_policy *pol = ps->pol;
    if (ps->t.k != T_IDENT)
        return s_expected(ps, "an attribute name or '}'", "attributes are written name = value;");
    uint32_t an = p_intern(pol, ps->t.str, ps->t.slen);
    if (an == SYM_NONE) {
        ps->oom = true;
        return -1;
    }
    unsigned aline = ps->t.line, acol = ps->t.col;
    s_next(ps);
    if (s_expect(ps, T_ASSIGN, "after the attribute name", "attributes are written name = value;")) return -1;
    p_value v;
    if (s_literal(ps, &v, "for the attribute")) return -1;
    if (s_expect(ps, T_SEMI, "after the attribute's value", "each attribute ends with ';'")) return -1;
    if (s_grow((void **)&pol->assigns, &pol->cap_assigns, pol->n_assigns, sizeof(p_assign))) {
        ps->oom = true;
        return -1;
    }
    p_assign *as = &pol->assigns[pol->n_assigns++];
    as->ent = ei;
    as->name = an;
    as->val = v;
    as->line = aline;
    as->col = acol;
    return 0;
}

static int s_entity(parser *ps) {
    fi_policy *pol = ps->pol;
    uint8_t kind = s_is_kw(ps, "jurisdiction") ? EK_JUR : s_is_kw(ps, "region") ? EK_REGION
                   : s_is_kw(ps, "site") ? EK_SITE : EK_CLUSTER;
    const char *kn = p_kind_name(kind);
    s_next(ps);
    unsigned line = ps->t.line, col = ps->t.col;
    char what[80];
    snprintf(what, sizeof what, "the %s's name", kn);
    uint32_t name = s_name(ps, what, "names are identifiers such as fra-gpu-1 or quoted strings");
    if (name == SYM_NONE) return -1;
    uint32_t parent = SYM_NONE;
    unsigned pline = 0, pcol = 0;
    if (s_is_kw(ps, "in")) {
        s_next(ps);
        pline = ps->t.line;
        pcol = ps->t.col;
        parent = s_name(ps, "the name of the enclosing entity after 'in'",
                        kind == EK_REGION ? "a region is in a jurisdiction: region eu-central in DE;"
                                          : "e.g. site berlin-clinic in eu-central;");
        if (parent == SYM_NONE) return -1;
    } else if (kind != EK_JUR) {
        char hint[120];
        snprintf(hint, sizeof hint, "every %s is in a %s: %s %s in NAME;", kn,
                 kind == EK_REGION ? "jurisdiction" : "region", kn, p_str(pol, name));
        return s_expected(ps, "'in' after the name", hint);
    }
    if (s_grow((void **)&pol->ents, &pol->cap_ents, pol->n_ents, sizeof(p_entity))) {
        ps->oom = true;
        return -1;
    }
    uint32_t ei = pol->n_ents++;
    p_entity *e = &pol->ents[ei];
    memset(e, 0, sizeof *e);
    e->name = name;
    e->kind = kind;
    e->parent = parent == SYM_NONE ? -1 : (int32_t)parent; /* a symbol until checked */
    e->target = e->region = e->jur = -1;
    e->line = line;
    e->col = col;
    /* Keep the parent's position for messages in the region/jur fields. */
    e->region = (int32_t)pline;
    e->jur = (int32_t)pcol;
    if (ps->t.k == T_SEMI) {
        s_next(ps);
        return 0;
    }
    if (ps->t.k != T_LBRACE)
        return s_expected(ps, "';' or '{' after the declaration",
                          "attributes go in braces: cluster x in r { cost = 3; }");
    s_next(ps);
    while (ps->t.k != T_RBRACE) {
        if (s_attr_assign(ps, ei)) {
            /* skip the rest of the block so that parsing resumes after it */
            while (ps->t.k != T_RBRACE && ps->t.k != T_EOF) s_next(ps);
            if (ps->t.k == T_RBRACE) s_next(ps);
            return -1;
        }
    }
    s_next(ps);
    if (ps->t.k == T_SEMI) s_next(ps);
    return 0;
}

/* The number written in the n digits at s; -1 unless they are all digits. */
static int s_digits(const char *s, int n) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v;
}

/* Parses "YYYY-MM-DDTHH:MM:SSZ" into Unix seconds; -1 when malformed:
 * exactly these characters, digits where the format has them, and a time
 * that exists (every field survives timegm unchanged: no 02-31, 24:00 or
 * leap second), from 1970 on. */
static int64_t s_parse_time(const char *s) {
    static const char shape[] = "dddd-dd-ddTdd:dd:ddZ";
    if (strlen(s) != sizeof shape - 1) return -1;
    for (size_t i = 0; i < sizeof shape - 1; i++)
        if (shape[i] == 'd' ? s[i] < '0' || s[i] > '9' : s[i] != shape[i]) return -1;
    int Y = s_digits(s, 4), M = s_digits(s + 5, 2), D = s_digits(s + 8, 2);
    int h = s_digits(s + 11, 2), m = s_digits(s + 14, 2), sec = s_digits(s + 17, 2);
    if (Y < 1970) return -1;
    struct tm tm = {0};
    tm.tm_year = Y - 1900;
    tm.tm_mon = M - 1;
    tm.tm_mday = D;
    tm.tm_hour = h;
    tm.tm_min = m;
    tm.tm_sec = sec;
    time_t t = timegm(&tm);
    if (t == (time_t)-1) return -1;
    struct tm back;
    if (!gmtime_r(&t, &back)) return -1;
    if (back.tm_year != Y - 1900 || back.tm_mon != M - 1 || back.tm_mday != D || back.tm_hour != h ||
        back.tm_min != m || back.tm_sec != sec)
        return -1;
    return (int64_t)t;
}

static int s_statement(parser *ps) {
    fi_policy *pol = ps->pol;
    if (s_is_kw(ps, "permit") || s_is_kw(ps, "forbid") || s_is_kw(ps, "prefer")) return s_rule(ps);
    if (s_is_kw(ps, "jurisdiction") || s_is_kw(ps, "region") || s_is_kw(ps, "site") ||
        s_is_kw(ps, "cluster"))
        return s_entity(ps);
    if (s_is_kw(ps, "labels")) {
        if (!pol->labels_line) {
            pol->labels_line = ps->t.line;
            pol->labels_col = ps->t.col;
        }
        s_next(ps);
        for (;;) {
            unsigned line = ps->t.line, col = ps->t.col;
            uint32_t l = s_name(ps, "a label name", "labels public, internal, pii, phi;");
            if (l == SYM_NONE) return -1;
            bool dup = false;
            for (uint32_t i = 0; i < pol->n_labels; i++) dup |= pol->labels[i] == l;
            if (dup) {
                p_diag(ps->d, FI_DIAG_ERROR, line, col, "declare each label once",
                       "duplicate label \"%s\"", p_str(pol, l));
                ps->errors++;
            } else if (pol->n_labels == FI_POLICY_MAX_LABELS) {
                p_diag(ps->d, FI_DIAG_ERROR, line, col,
                       "the flow analysis enumerates every label set; merge labels",
                       "too many labels: at most %d", FI_POLICY_MAX_LABELS);
                ps->errors++;
            } else {
                pol->label_line[pol->n_labels] = line;
                pol->labels[pol->n_labels++] = l;
            }
            if (ps->t.k == T_COMMA) {
                s_next(ps);
                continue;
            }
            break;
        }
        return s_expect(ps, T_SEMI, "after the labels", "labels a, b, c;");
    }
    if (s_is_kw(ps, "default_label")) {
        unsigned line = ps->t.line, col = ps->t.col;
        s_next(ps);
        if (pol->default_label != SYM_NONE) {
            p_diag(ps->d, FI_DIAG_ERROR, line, col, "keep one default_label statement",
                   "default_label given twice");
            ps->errors++;
        }
        /* where the name is, wherever it is written */
        pol->default_line = ps->t.line;
        pol->default_col = ps->t.col;
        pol->default_label = s_name(ps, "a label name after default_label", "default_label \"internal\";");
        if (pol->default_label == SYM_NONE) return -1;
        return s_expect(ps, T_SEMI, "after the default label", "default_label \"internal\";");
    }
    if (s_is_kw(ps, "expires")) {
        unsigned line = ps->t.line, col = ps->t.col;
        s_next(ps);
        if (ps->t.k != T_STRING)
            return s_expected(ps, "a UTC time string after 'expires'", "expires \"2027-12-31T23:59:59Z\";");
        int64_t t = s_parse_time(ps->t.str);
        if (t < 0) {
            p_diag(ps->d, FI_DIAG_ERROR, ps->t.line, ps->t.col,
                   "write the time as \"YYYY-MM-DDTHH:MM:SSZ\" (UTC), e.g. \"2027-12-31T23:59:59Z\"",
                   "malformed time \"%.40s\"", ps->t.str);
            ps->errors++;
            return -1;
        }
        if (t == 0) { /* 0 is "no expiry" inside: refused, not taken as never expiring */
            p_diag(ps->d, FI_DIAG_ERROR, ps->t.line, ps->t.col,
                   "give a time after 1970-01-01T00:00:00Z, or no expires statement for a "
                   "policy without expiry",
                   "expiry at the Unix epoch \"%.40s\"", ps->t.str);
            ps->errors++;
            return -1;
        }
        if (pol->expires_line) {
            p_diag(ps->d, FI_DIAG_ERROR, line, col, "keep one expires statement", "expires given twice");
            ps->errors++;
        }
        pol->expires = t;
        pol->expires_line = line;
        s_next(ps);
        return s_expect(ps, T_SEMI, "after the expiry time", "expires \"2027-12-31T23:59:59Z\";");
    }
    if (ps->t.k == T_IDENT) {
        const char *hint = "statements: labels, default_label, expires, jurisdiction, region, site, "
                           "cluster, permit, forbid, prefer";
        if (!strcmp(ps->t.str, "allow") || !strcmp(ps->t.str, "deny"))
            hint = "rules are written permit \"id\" ... or forbid \"id\" ...";
        p_diag(ps->d, FI_DIAG_ERROR, ps->t.line, ps->t.col, hint,
               "expected a statement, found unknown word '%.60s'", ps->t.str);
        ps->errors++;
        return -1;
    }
    return s_expected(ps, "a statement (a declaration or a rule)",
                      "statements: labels, default_label, expires, jurisdiction, region, site, "
                      "cluster, permit, forbid, prefer");
}

int p_parse(fi_policy *pol, const char *text, size_t len, fi_diags *d) {
    parser ps;
    memset(&ps, 0, sizeof ps);
    ps.pol = pol;
    ps.d = d;
    ps.p = text;
    ps.end = text + len;
    ps.line = 1;
    ps.col = 1;
    s_next(&ps);
    while (ps.t.k != T_EOF && !ps.oom) {
        if (s_statement(&ps)) {
            if (ps.oom || ps.halt || ps.errors >= MAX_DIAGS) break;
            s_recover(&ps);
        }
    }
    if (ps.oom) {
        p_diag(d, FI_DIAG_ERROR, ps.t.line, ps.t.col, NULL, "out of memory while parsing");
        return -1;
    }
    return ps.errors ? -1 : 0;
}
