/*
 * policy_cases.c - cases files: parsing, and running them against a policy
 * (see fi_cases.h for the format).
 */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "fi_cases.h"
#include "policy_impl.h"

#define MAX_LIST 256 /* labels or target names in one case */
#define MAX_CASES_BYTES ((size_t)8 << 20) /* a cases file; a larger one is refused */

typedef struct s_expect_denied {
    char *target;   /* target name */
    char *rule;     /* forbid rule id; NULL = by default deny */
    unsigned line;
} s_expect_denied;

typedef struct s_expect_score {
    char *target;
    int64_t score;
    unsigned line;
} s_expect_score;

typedef struct s_case {
    char *name;
    unsigned line;
    fi_request req;           /* strings point into the fields below */
    char *origin, *tenant, *application, *model;
    char **labels;            /* n in req.n_labels */
    char **targets;           /* candidate names; NULL = every target */
    size_t n_targets;
    bool has_permitted;       /* expect permitted = [...] */
    char **permitted;
    size_t n_permitted;
    bool has_chosen;          /* expect chosen = ... */
    char *chosen;             /* NULL = none */
    s_expect_denied *denied;
    size_t n_denied;
    s_expect_score *scores;
    size_t n_scores;
} s_case;

struct fi_cases {
    s_case *v;
    size_t n;
    size_t cap;
};

/* ---------------------------------------------------------------- tokens */

typedef struct lx {
    const char *p, *end;
    unsigned line, col;
    /* current token */
    int k;            /* 's' string, 'i' ident, 'n' number, 'e' end, else the char */
    char s[512];
    int64_t num;
    unsigned tl, tc;
    fi_diags *d;
    int errors;
} lx;

static void s_adv(lx *l) {
    if (*l->p == '\n') {
        l->line++;
        l->col = 1;
    } else {
        l->col++;
    }
    l->p++;
}

static void s_err(lx *l, const char *hint, const char *what) {
    char found[64];
    if (l->k == 'e') snprintf(found, sizeof found, "end of file");
    else if (l->k == 's') snprintf(found, sizeof found, "string \"%.30s\"", l->s);
    else if (l->k == 'i' || l->k == 'n') snprintf(found, sizeof found, "'%.30s'", l->s);
    else snprintf(found, sizeof found, "'%c'", l->k);
    p_diag(l->d, FI_DIAG_ERROR, l->tl, l->tc, hint, "expected %s, found %s", what, found);
    l->errors++;
}

static void s_next(lx *l) {
    for (;;) {
        while (l->p < l->end && isspace((unsigned char)*l->p)) s_adv(l);
        if (l->p < l->end && *l->p == '#') {
            while (l->p < l->end && *l->p != '\n') s_adv(l);
            continue;
        }
        break;
    }
    l->tl = l->line;
    l->tc = l->col;
    l->s[0] = 0;
    if (l->p >= l->end) {
        l->k = 'e';
        return;
    }
    char c = *l->p;
    if (c == '"') {
        size_t o = 0;
        s_adv(l);
        while (l->p < l->end && *l->p != '"' && *l->p != '\n') {
            char ch = *l->p;
            if (ch == '\\' && l->p + 1 < l->end) {
                s_adv(l);
                ch = *l->p == 'n' ? '\n' : *l->p;
            }
            if (o + 1 < sizeof l->s) l->s[o++] = ch;
            s_adv(l);
        }
        l->s[o] = 0;
        if (l->p >= l->end || *l->p != '"') {
            l->k = '?';
            p_diag(l->d, FI_DIAG_ERROR, l->tl, l->tc, "close the string on the same line", "unterminated string");
            l->errors++;
            return;
        }
        s_adv(l);
        l->k = 's';
        return;
    }
    if (isalnum((unsigned char)c) || c == '_' || c == '-') {
        size_t o = 0;
        while (l->p < l->end && (isalnum((unsigned char)*l->p) || *l->p == '_' || *l->p == '-')) {
            if (o + 1 < sizeof l->s) l->s[o++] = *l->p;
            s_adv(l);
        }
        l->s[o] = 0;
        char *e;
        errno = 0;
        long long v = strtoll(l->s, &e, 10);
        l->k = (*e == 0 && errno == 0) ? 'n' : 'i';
        l->num = v;
        return;
    }
    l->k = c;
    s_adv(l);
}

static bool s_accept(lx *l, int k) {
    if (l->k != k) return false;
    s_next(l);
    return true;
}

static int s_expect(lx *l, int k, const char *what, const char *hint) {
    if (s_accept(l, k)) return 0;
    s_err(l, hint, what);
    return -1;
}

static char *s_dup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* [ "a", "b" ] into a new array; -1 on error. With unique (what the list
 * is, for the message), an element given twice is an error: such a list
 * is compared as a set. */
static int s_list(lx *l, char ***out, size_t *n, const char *unique) {
    *out = NULL;
    *n = 0;
    if (s_expect(l, '[', "'[' to start a list", "lists are written [\"a\", \"b\"]")) return -1;
    char **v = calloc(MAX_LIST, sizeof *v);
    if (!v) return -1;
    *out = v;
    while (l->k != ']') {
        if (l->k != 's') {
            s_err(l, "lists hold strings in double quotes", "a string in the list");
            return -1;
        }
        if (*n == MAX_LIST) {
            s_err(l, "at most 256 elements", "']'");
            return -1;
        }
        for (size_t i = 0; unique && i < *n; i++)
            if (!strcmp(v[i], l->s)) {
                p_diag(l->d, FI_DIAG_ERROR, l->tl, l->tc, "name each target once",
                       "\"%s\" is given twice in the %s list", l->s, unique);
                l->errors++;
                return -1;
            }
        if (!(v[(*n)++] = s_dup(l->s))) return -1;
        s_next(l);
        if (s_accept(l, ',')) {
            if (l->k == ']') { /* no trailing ',' */
                s_err(l, "drop the ',' before ']'", "a string after ','");
                return -1;
            }
        } else if (l->k != ']') {
            s_err(l, "separate elements with ','", "',' or ']'");
            return -1;
        }
    }
    s_next(l);
    return 0;
}

static void s_free_list(char **v, size_t n) {
    for (size_t i = 0; v && i < n; i++) free(v[i]);
    free(v);
}

static void s_case_free(s_case *c) {
    free(c->name);
    free(c->origin);
    free(c->tenant);
    free(c->application);
    free(c->model);
    s_free_list(c->labels, c->req.n_labels);
    s_free_list(c->targets, c->n_targets);
    s_free_list(c->permitted, c->n_permitted);
    free(c->chosen);
    for (size_t i = 0; i < c->n_denied; i++) {
        free(c->denied[i].target);
        free(c->denied[i].rule);
    }
    free(c->denied);
    for (size_t i = 0; i < c->n_scores; i++) free(c->scores[i].target);
    free(c->scores);
}

static void s_case_link(s_case *c) {
    c->req.origin_site = c->origin;
    c->req.tenant = c->tenant;
    c->req.application = c->application;
    c->req.model = c->model;
    c->req.labels = (const char *const *)c->labels;
}

static int s_set_str(lx *l, char **dst) {
    if (l->k != 's') {
        s_err(l, "values are strings in double quotes", "a string");
        return -1;
    }
    free(*dst);
    *dst = s_dup(l->s);
    s_next(l);
    return *dst ? 0 : -1;
}

static int s_field(lx *l, s_case *c) {
    char key[64];
    snprintf(key, sizeof key, "%.63s", l->s); /* longer names match no field */
    unsigned kl = l->tl, kc = l->tc;
    if (l->k != 'i') {
        s_err(l, "fields: origin, labels, model, tenant, application, latency_ms, prompt_tokens, targets, expect",
              "a field name or '}'");
        return -1;
    }
    s_next(l);
    if (!strcmp(key, "expect")) {
        char what[32];
        snprintf(what, sizeof what, "%.31s", l->s);
        if (l->k != 'i') {
            s_err(l, "expect permitted = [...]; expect chosen = \"t\"; expect denied \"t\" by \"rule\"; expect score \"t\" = N;",
                  "permitted, chosen, denied or score after expect");
            return -1;
        }
        s_next(l);
        if (!strcmp(what, "permitted")) {
            if (s_expect(l, '=', "'='", "expect permitted = [\"a\"];")) return -1;
            s_free_list(c->permitted, c->n_permitted);
            c->has_permitted = true;
            if (s_list(l, &c->permitted, &c->n_permitted, "expect permitted")) return -1;
        } else if (!strcmp(what, "chosen")) {
            if (s_expect(l, '=', "'='", "expect chosen = \"t\";")) return -1;
            c->has_chosen = true;
            if (l->k == 'i' && !strcmp(l->s, "none")) {
                s_next(l);
            } else if (s_set_str(l, &c->chosen)) {
                return -1;
            }
        } else if (!strcmp(what, "denied")) {
            if (l->k != 's') {
                s_err(l, "expect denied \"target\" by \"rule id\"; or by default;", "a target name");
                return -1;
            }
            s_expect_denied *nd = realloc(c->denied, (c->n_denied + 1) * sizeof *nd);
            if (!nd) return -1;
            c->denied = nd;
            s_expect_denied *e = &c->denied[c->n_denied++];
            memset(e, 0, sizeof *e);
            e->line = kl;
            if (!(e->target = s_dup(l->s))) return -1;
            s_next(l);
            if (l->k != 'i' || strcmp(l->s, "by")) {
                s_err(l, "expect denied \"target\" by \"rule id\"; or by default;", "'by'");
                return -1;
            }
            s_next(l);
            if (l->k == 'i' && !strcmp(l->s, "default")) {
                s_next(l);
            } else if (s_set_str(l, &e->rule)) {
                return -1;
            }
        } else if (!strcmp(what, "score")) {
            if (l->k != 's') {
                s_err(l, "expect score \"target\" = N;", "a target name");
                return -1;
            }
            s_expect_score *ns = realloc(c->scores, (c->n_scores + 1) * sizeof *ns);
            if (!ns) return -1;
            c->scores = ns;
            s_expect_score *e = &c->scores[c->n_scores++];
            e->line = kl;
            if (!(e->target = s_dup(l->s))) return -1;
            s_next(l);
            if (s_expect(l, '=', "'='", "expect score \"t\" = 10;")) return -1;
            if (l->k != 'n') {
                s_err(l, "scores are whole numbers", "a number");
                return -1;
            }
            e->score = l->num;
            s_next(l);
        } else {
            p_diag(l->d, FI_DIAG_ERROR, kl, kc, "expect permitted, chosen, denied or score",
                   "unknown expectation '%s'", what);
            l->errors++;
            return -1;
        }
        return s_expect(l, ';', "';' after the expectation", "each line ends with ';'");
    }
    if (s_expect(l, '=', "'=' after the field name", "fields are written name = value;")) return -1;
    int rc = 0;
    if (!strcmp(key, "origin")) rc = s_set_str(l, &c->origin);
    else if (!strcmp(key, "tenant")) rc = s_set_str(l, &c->tenant);
    else if (!strcmp(key, "application")) rc = s_set_str(l, &c->application);
    else if (!strcmp(key, "model")) rc = s_set_str(l, &c->model);
    else if (!strcmp(key, "labels")) {
        s_free_list(c->labels, c->req.n_labels);
        rc = s_list(l, &c->labels, &c->req.n_labels, NULL);
    } else if (!strcmp(key, "targets")) {
        s_free_list(c->targets, c->n_targets);
        rc = s_list(l, &c->targets, &c->n_targets, "targets");
    } else if (!strcmp(key, "latency_ms") || !strcmp(key, "prompt_tokens")) {
        if (l->k != 'n' || l->num < 0) {
            s_err(l, "a whole number >= 0", "a number");
            return -1;
        }
        if (key[0] == 'l') c->req.latency_ms = l->num;
        else c->req.prompt_tokens = l->num;
        s_next(l);
    } else {
        p_diag(l->d, FI_DIAG_ERROR, kl, kc,
               "fields: origin, labels, model, tenant, application, latency_ms, prompt_tokens, targets, expect",
               "unknown field '%s'", key);
        l->errors++;
        return -1;
    }
    if (rc) return -1;
    return s_expect(l, ';', "';' after the value", "each line ends with ';'");
}

fi_cases *fi_cases_parse(const char *text, size_t len, fi_diags *d) {
    fi_cases *cs = calloc(1, sizeof *cs);
    if (!cs) return NULL;
    lx l = {text, text + len, 1, 1, 0, {0}, 0, 0, 0, d, 0};
    s_next(&l);
    while (l.k != 'e') {
        if (l.k != 'i' || strcmp(l.s, "case")) {
            s_err(&l, "a cases file is a sequence of case \"name\" { ... } blocks", "'case'");
            goto fail;
        }
        unsigned line = l.tl;
        s_next(&l);
        if (l.k != 's') {
            s_err(&l, "case \"name\" { ... }", "the case's name as a string");
            goto fail;
        }
        if (cs->n == cs->cap) {
            size_t cap = cs->cap ? cs->cap * 2 : 16;
            s_case *v = realloc(cs->v, cap * sizeof *v);
            if (!v) goto fail;
            cs->v = v;
            cs->cap = cap;
        }
        s_case *c = &cs->v[cs->n++];
        memset(c, 0, sizeof *c);
        c->req.latency_ms = c->req.prompt_tokens = -1;
        c->line = line;
        if (!(c->name = s_dup(l.s))) goto fail;
        s_next(&l);
        if (s_expect(&l, '{', "'{' after the case name", "case \"name\" { ... }")) goto fail;
        while (l.k != '}' && l.k != 'e')
            if (s_field(&l, c)) goto fail;
        if (s_expect(&l, '}', "'}' to close the case", "every case ends with '}'")) goto fail;
        if (!c->origin) {
            p_diag(d, FI_DIAG_ERROR, line, 1, "origin = \"site\"; is required", "case \"%s\" has no origin", c->name);
            goto fail;
        }
        s_case_link(c);
    }
    return cs;
fail:
    if (!l.errors && !fi_diags_errors(d)) p_diag(d, FI_DIAG_ERROR, l.tl, l.tc, NULL, "out of memory");
    fi_cases_destroy(&cs);
    return NULL;
}

fi_cases *fi_cases_load(const char *path, fi_diags *d) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        p_diag(d, FI_DIAG_ERROR, 0, 0, NULL, "cannot open cases file %s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    bool nomem = false;
    /* one byte past the limit tells a file over it from one at it */
    while (len <= MAX_CASES_BYTES) {
        if (len == cap) {
            cap = cap ? cap * 2 : 65536;
            if (cap > MAX_CASES_BYTES + 1) cap = MAX_CASES_BYTES + 1;
            char *n = realloc(buf, cap);
            if (!n) {
                nomem = true;
                break;
            }
            buf = n;
        }
        size_t k = fread(buf + len, 1, cap - len, f);
        len += k;
        if (!k) break;
    }
    int rerr = ferror(f) ? errno : 0;
    bool failed = ferror(f) != 0;
    fclose(f);
    fi_cases *cs = NULL;
    if (failed)
        p_diag(d, FI_DIAG_ERROR, 0, 0, NULL, "cannot read cases file %s: %s", path,
               rerr ? strerror(rerr) : "read error");
    else if (nomem)
        p_diag(d, FI_DIAG_ERROR, 0, 0, NULL, "cannot read cases file %s: out of memory", path);
    else if (len > MAX_CASES_BYTES)
        p_diag(d, FI_DIAG_ERROR, 0, 0, "split the cases into several files",
               "cases file %s is larger than the limit of %zu MiB", path, MAX_CASES_BYTES >> 20);
    else if ((cs = fi_cases_parse(buf ? buf : "", len, d)) && !cs->n) {
        p_diag(d, FI_DIAG_ERROR, 0, 0, "a cases file holds case \"name\" { ... } blocks",
               "cases file %s holds no cases", path);
        fi_cases_destroy(&cs);
    }
    free(buf);
    return cs;
}

void fi_cases_destroy(fi_cases **self_p) {
    if (!self_p || !*self_p) return;
    for (size_t i = 0; i < (*self_p)->n; i++) s_case_free(&(*self_p)->v[i]);
    free((*self_p)->v);
    free(*self_p);
    *self_p = NULL;
}

size_t fi_cases_count(const fi_cases *self) { return self->n; }
const char *fi_cases_name(const fi_cases *self, size_t i) { return i < self->n ? self->v[i].name : NULL; }
const fi_request *fi_cases_request(const fi_cases *self, size_t i) { return i < self->n ? &self->v[i].req : NULL; }

const char *const *fi_cases_targets(const fi_cases *self, size_t i, size_t *n) {
    *n = i < self->n ? self->v[i].n_targets : 0;
    return i < self->n ? (const char *const *)self->v[i].targets : NULL;
}

/* ------------------------------------------------------------------ running */

static int s_find_in(const fi_policy *pol, const uint32_t *idx, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(fi_policy_target_name(pol, idx[i]), name)) return (int)i;
    return -1;
}

static bool s_run_one(const s_case *c, const fi_policy *pol, FILE *out) {
    size_t n = c->targets ? c->n_targets : fi_policy_target_count(pol);
    uint32_t *idx = calloc(n ? n : 1, sizeof *idx);
    fi_verdict *v = calloc(n ? n : 1, sizeof *v);
    bool ok = idx && v;
    char line[600];
    if (!ok) {
        if (out) fprintf(out, "FAIL  %s: out of memory\n", c->name);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        if (!c->targets) {
            idx[i] = (uint32_t)i;
            continue;
        }
        int t = fi_policy_target_find(pol, c->targets[i]);
        if (t < 0) {
            if (out) fprintf(out, "FAIL  %s (line %u): target \"%s\" is not in the policy\n", c->name, c->line, c->targets[i]);
            ok = false;
            goto done;
        }
        idx[i] = (uint32_t)t;
    }
    if (fi_policy_decide(pol, &c->req, idx, n, v)) {
        if (out) fprintf(out, "FAIL  %s: the policy refused the candidate targets\n", c->name);
        ok = false;
        goto done;
    }
    char why[2048];
    size_t wk = 0;
    why[0] = 0;
#define WHY(...) do { if (wk < sizeof why) wk += (size_t)snprintf(why + wk, sizeof why - wk, __VA_ARGS__); } while (0)
    if (c->has_permitted) {
        bool same = true;
        for (size_t i = 0; i < c->n_permitted; i++) {
            int k = s_find_in(pol, idx, n, c->permitted[i]);
            if (k < 0 || !v[k].permitted) same = false;
        }
        size_t np = 0;
        for (size_t i = 0; i < n; i++) np += v[i].permitted;
        if (np != c->n_permitted) same = false;
        if (!same) {
            WHY("    expected permitted = [");
            for (size_t i = 0; i < c->n_permitted; i++) WHY("%s\"%s\"", i ? ", " : "", c->permitted[i]);
            WHY("], got [");
            size_t k = 0;
            for (size_t i = 0; i < n; i++)
                if (v[i].permitted) WHY("%s\"%s\"", k++ ? ", " : "", fi_policy_target_name(pol, idx[i]));
            WHY("]\n");
            ok = false;
        }
    }
    if (c->has_chosen) {
        int b = fi_verdict_best(v, n);
        const char *got = b < 0 ? NULL : fi_policy_target_name(pol, idx[b]);
        if ((got == NULL) != (c->chosen == NULL) || (got && strcmp(got, c->chosen))) {
            WHY("    expected chosen = %s%s%s, got %s%s%s\n", c->chosen ? "\"" : "", c->chosen ? c->chosen : "none",
                c->chosen ? "\"" : "", got ? "\"" : "", got ? got : "none", got ? "\"" : "");
            ok = false;
        }
    }
    for (size_t i = 0; i < c->n_denied; i++) {
        const s_expect_denied *e = &c->denied[i];
        int k = s_find_in(pol, idx, n, e->target);
        bool good = k >= 0 && !v[k].permitted;
        if (good && e->rule) {
            bool found = false;
            unsigned shown = v[k].n_rules < FI_VERDICT_MAX_RULES ? v[k].n_rules : FI_VERDICT_MAX_RULES;
            for (unsigned j = 0; j < shown; j++)
                found |= v[k].cause == FI_CAUSE_FORBID && !strcmp(fi_policy_rule_id(pol, v[k].rules[j]), e->rule);
            good = found;
        } else if (good) {
            good = v[k].cause == FI_CAUSE_DEFAULT_DENY;
        }
        if (!good) {
            if (k < 0) {
                WHY("    expected denied \"%s\": not a candidate target\n", e->target);
            } else {
                fi_verdict_explain(pol, &v[k], NULL, line, sizeof line);
                WHY("    expected denied \"%s\" by %s%s%s, got: %s\n", e->target, e->rule ? "\"" : "",
                    e->rule ? e->rule : "default", e->rule ? "\"" : "", line);
            }
            ok = false;
        }
    }
    for (size_t i = 0; i < c->n_scores; i++) {
        const s_expect_score *e = &c->scores[i];
        int k = s_find_in(pol, idx, n, e->target);
        if (k < 0 || !v[k].permitted || v[k].score != e->score) {
            WHY("    expected score \"%s\" = %lld, got %s%lld\n", e->target, (long long)e->score,
                k < 0 ? "no such candidate " : !v[k].permitted ? "denied, " : "", k < 0 ? 0LL : (long long)v[k].score);
            ok = false;
        }
    }
#undef WHY
    if (out) {
        fprintf(out, "%s  %s\n", ok ? "ok  " : "FAIL", c->name);
        if (!ok) {
            fprintf(out, "%s", why);
            for (size_t i = 0; i < n; i++) {
                fi_verdict_explain(pol, &v[i], NULL, line, sizeof line);
                fprintf(out, "      %s\n", line);
            }
        }
    }
done:
    free(idx);
    free(v);
    return ok;
}

size_t fi_cases_run(const fi_cases *self, const fi_policy *pol, FILE *out) {
    size_t failed = 0;
    for (size_t i = 0; i < self->n; i++) failed += !s_run_one(&self->v[i], pol, out);
    if (out) fprintf(out, "%zu cases, %zu passed, %zu failed\n", self->n, self->n - failed, failed);
    return failed;
}

/* ------------------------------------------------------------ command line */

static int s_split(const char *csv, char ***out, size_t *n) {
    *n = 0;
    *out = calloc(MAX_LIST, sizeof **out);
    if (!*out) return -1;
    const char *p = csv;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len) {
            if (*n == MAX_LIST) return -1;
            char *s = malloc(len + 1);
            if (!s) return -1;
            memcpy(s, p, len);
            s[len] = 0;
            (*out)[(*n)++] = s;
        }
        p += len;
        if (*p == ',') p++;
    }
    return 0;
}

fi_cases *fi_cases_from_args(int argc, char **argv, char *err, size_t err_cap) {
    fi_cases *cs = calloc(1, sizeof *cs);
    if (!cs || !(cs->v = calloc(1, sizeof *cs->v))) {
        free(cs);
        snprintf(err, err_cap, "out of memory");
        return NULL;
    }
    cs->n = cs->cap = 1;
    s_case *c = &cs->v[0];
    c->req.latency_ms = c->req.prompt_tokens = -1;
    c->name = s_dup("from the command line");
    for (int i = 0; i < argc; i++) {
        const char *eq = strchr(argv[i], '=');
        if (!eq) {
            snprintf(err, err_cap, "expected key=value, found '%s' (keys: origin, labels, model, tenant, application, "
                     "latency_ms, prompt_tokens, targets)", argv[i]);
            goto fail;
        }
        size_t kl = (size_t)(eq - argv[i]);
        const char *val = eq + 1;
#define KEY(s) (kl == strlen(s) && !strncmp(argv[i], s, kl))
        char **dst = KEY("origin") ? &c->origin : KEY("tenant") ? &c->tenant : KEY("application") ? &c->application
                     : KEY("model") ? &c->model : NULL;
        if (dst) {
            free(*dst);
            if (!(*dst = s_dup(val))) goto oom;
        } else if (KEY("labels")) {
            s_free_list(c->labels, c->req.n_labels);
            if (s_split(val, &c->labels, &c->req.n_labels)) goto oom;
        } else if (KEY("targets")) {
            s_free_list(c->targets, c->n_targets);
            if (s_split(val, &c->targets, &c->n_targets)) goto oom;
        } else if (KEY("latency_ms") || KEY("prompt_tokens")) {
            char *e;
            errno = 0;
            long long x = strtoll(val, &e, 10);
            if (*e || errno || x < 0) {
                snprintf(err, err_cap, "%.*s wants a whole number >= 0, found '%s'", (int)kl, argv[i], val);
                goto fail;
            }
            if (argv[i][0] == 'l') c->req.latency_ms = x;
            else c->req.prompt_tokens = x;
        } else {
            snprintf(err, err_cap, "unknown key '%.*s' (keys: origin, labels, model, tenant, application, latency_ms, "
                     "prompt_tokens, targets)", (int)kl, argv[i]);
            goto fail;
        }
#undef KEY
    }
    if (!c->origin) {
        snprintf(err, err_cap, "the request needs origin=SITE");
        goto fail;
    }
    s_case_link(c);
    return cs;
oom:
    snprintf(err, err_cap, "out of memory");
fail:
    fi_cases_destroy(&cs);
    return NULL;
}
