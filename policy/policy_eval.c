/*
 * policy_eval.c - evaluation of a compiled policy: binding a request to the
 * policy's symbols, the three-valued condition evaluator, the decision over
 * all candidate targets, explanations, and the fail-closed fallback.
 *
 * Nothing in this file allocates. fi_policy_decide keeps its scratch (bit
 * masks over at most FI_POLICY_MAX_RULES rules, result caches) on the
 * stack, about 5 KiB.
 *
 * Values of conditions are sets of {true, false, error} as bit masks: a
 * decision always yields exactly one; the flow analysis (policy_flows.c)
 * binds "wild" requests whose optional attributes may be anything, and then
 * gets every outcome that is possible.
 */
#include <stdlib.h>
#include <string.h>

#include "policy_impl.h"

#define MAXW (FI_POLICY_MAX_RULES / 64)

/* A run-time value. */
typedef struct rv {
    uint8_t type;          /* VT_* */
    int64_t num;           /* VT_NUM, VT_BOOL */
    uint32_t sym;          /* VT_STR, VT_LOC: symbol or SYM_UNKNOWN */
    const char *s;         /* VT_STR with SYM_UNKNOWN: the text */
    const uint32_t *set;   /* VT_SET: sorted symbols */
    uint32_t n;            /* VT_SET: count */
} rv;

enum { V_OK = 0, V_ERR = 1, V_ANY = 2 };

static void s_seterr(const p_ctx *c, const char *what, const char *where) {
    if (c->err && !c->err[0]) snprintf(c->err, c->err_cap, "%s%s", what, where ? where : "");
}

static uint8_t s_req_str(const p_ctx *c, uint32_t sym, const char *s, const char *name, rv *v) {
    if (c->req->wild) return V_ANY;
    if (sym == SYM_NONE) {
        if (c->err && !c->err[0]) snprintf(c->err, c->err_cap, "request.%s is absent", name);
        return V_ERR;
    }
    v->type = VT_STR;
    v->sym = sym;
    v->s = s;
    return V_OK;
}

/* Fetches the value of a value node. */
static uint8_t s_val(const p_ctx *c, uint32_t ni, rv *v) {
    const fi_policy *pol = c->pol;
    const p_node *n = &pol->nodes[ni];
    memset(v, 0, sizeof *v);
    switch (n->op) {
    case OP_NUM: v->type = VT_NUM; v->num = n->lit.num; return V_OK;
    case OP_TRUE: v->type = VT_BOOL; v->num = 1; return V_OK;
    case OP_FALSE: v->type = VT_BOOL; return V_OK;
    case OP_STR: v->type = VT_STR; v->sym = n->lit.sym; return V_OK;
    case OP_SET: v->type = VT_SET; v->set = n->lit.n ? pol->pool + n->lit.off : NULL; v->n = n->lit.n; return V_OK;
    case OP_TARGET:
        v->type = VT_LOC;
        v->sym = pol->ents[pol->targets[c->target]].name;
        return V_OK;
    case OP_ATTR: break;
    default: return V_ERR; /* conditions are not values; the checker rules this out */
    }
    if (n->scope == SC_REQ) {
        const p_req *r = c->req;
        switch (n->attr) {
        case RA_TENANT: return s_req_str(c, r->tenant, r->tenant_s, "tenant", v);
        case RA_APPLICATION: return s_req_str(c, r->application, r->application_s, "application", v);
        case RA_MODEL: return s_req_str(c, r->model, r->model_s, "model", v);
        case RA_LABELS: v->type = VT_SET; v->set = r->labels; v->n = r->n_labels; return V_OK;
        case RA_ORIGIN_SITE:
        case RA_ORIGIN_REGION:
        case RA_ORIGIN_JUR: {
            const p_entity *e = &pol->ents[r->origin];
            int32_t x = n->attr == RA_ORIGIN_SITE ? r->origin : n->attr == RA_ORIGIN_REGION ? e->region : e->jur;
            if (x < 0) return V_ERR;
            v->type = VT_LOC;
            v->sym = pol->ents[x].name;
            return V_OK;
        }
        case RA_LATENCY:
        case RA_PROMPT: {
            if (r->wild) return V_ANY;
            int64_t x = n->attr == RA_LATENCY ? r->latency : r->prompt;
            if (x < 0) {
                s_seterr(c, "request.", n->attr == RA_LATENCY ? "latency_ms is absent" : "prompt_tokens is absent");
                return V_ERR;
            }
            v->type = VT_NUM;
            v->num = x;
            return V_OK;
        }
        default: return V_ERR;
        }
    }
    const p_entity *e = &pol->ents[pol->targets[c->target]];
    switch (n->attr) {
    case TA_KIND: v->type = VT_STR; v->sym = pol->sym_kind[e->kind == EK_CLUSTER]; return V_OK;
    case TA_NAME: v->type = VT_LOC; v->sym = e->name; return V_OK;
    case TA_SITE:
        if (e->kind != EK_SITE) {
            if (c->err && !c->err[0])
                snprintf(c->err, c->err_cap, "target.site is absent on cluster %s", p_str(pol, e->name));
            return V_ERR;
        }
        v->type = VT_LOC;
        v->sym = e->name;
        return V_OK;
    case TA_REGION:
    case TA_JUR: {
        int32_t x = n->attr == TA_REGION ? e->region : e->jur;
        if (x < 0) return V_ERR;
        v->type = VT_LOC;
        v->sym = pol->ents[x].name;
        return V_OK;
    }
    default: {
        const p_value *tv = &pol->tvals[(size_t)c->target * pol->n_attrs + (n->attr - TA_USER)];
        if (tv->type == VT_NONE) {
            if (c->err && !c->err[0])
                snprintf(c->err, c->err_cap, "target.%s is absent on %s %s", p_attr_name(pol, SC_TGT, n->attr),
                         p_kind_name(e->kind), p_str(pol, e->name));
            return V_ERR;
        }
        v->type = tv->type == VT_STR ? VT_STR : tv->type;
        v->num = tv->num;
        v->sym = tv->sym;
        if (tv->type == VT_SET && tv->n) {
            v->set = pol->pool + tv->off;
            v->n = tv->n;
        }
        return V_OK;
    }
    }
}

static const char *s_text(const fi_policy *pol, const rv *v) {
    return v->sym < pol->n_syms ? p_str(pol, v->sym) : v->s ? v->s : "";
}

static bool s_str_eq(const fi_policy *pol, const rv *a, const rv *b) {
    if (a->sym < pol->n_syms && b->sym < pol->n_syms) return a->sym == b->sym;
    if (a->sym < pol->n_syms || b->sym < pol->n_syms) return false; /* known vs unknown */
    return !strcmp(s_text(pol, a), s_text(pol, b));
}

static bool s_member(const uint32_t *set, uint32_t n, uint32_t sym) {
    for (uint32_t i = 0; i < n; i++)
        if (set[i] == sym) return true;
    return false;
}

static bool s_subset(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb) {
    uint32_t j = 0;
    for (uint32_t i = 0; i < na; i++) {
        while (j < nb && b[j] < a[i]) j++;
        if (j == nb || b[j] != a[i]) return false;
    }
    return true;
}

/* a within b: b is a or one of its ancestors in the topology. */
static bool s_within(const fi_policy *pol, uint32_t a, uint32_t b) {
    if (a >= pol->n_syms || b >= pol->n_syms) return false;
    int32_t x = pol->sym_ent[a], y = pol->sym_ent[b];
    if (x < 0 || y < 0) return false;
    for (int guard = 0; x >= 0 && guard < 256; guard++) {
        if (x == y) return true;
        x = pol->ents[x].parent;
    }
    return false;
}

static uint8_t s_not(uint8_t m) {
    return (uint8_t)(((m & B_T) ? B_F : 0) | ((m & B_F) ? B_T : 0) | (m & B_E));
}

static uint8_t s_and1(uint8_t x, uint8_t y) {
    if (x == B_F || y == B_F) return B_F;
    if (x == B_E || y == B_E) return B_E;
    return B_T;
}

static uint8_t s_or1(uint8_t x, uint8_t y) {
    if (x == B_T || y == B_T) return B_T;
    if (x == B_E || y == B_E) return B_E;
    return B_F;
}

/* Lifts a Kleene operator to sets of outcomes. */
static uint8_t s_lift(uint8_t a, uint8_t b, uint8_t (*op)(uint8_t, uint8_t)) {
    uint8_t out = 0;
    for (uint8_t x = 1; x <= 4; x <<= 1)
        for (uint8_t y = 1; y <= 4; y <<= 1)
            if ((a & x) && (b & y)) out |= op(x, y);
    return out;
}

static uint8_t s_cmp(const p_ctx *c, const p_node *n) {
    const fi_policy *pol = c->pol;
    rv a, b;
    uint8_t ra = s_val(c, n->a, &a);
    uint8_t rb = s_val(c, n->b, &b);
    if (ra == V_ERR || rb == V_ERR) return B_E;
    if (ra == V_ANY || rb == V_ANY) return B_T | B_F | B_E;
    bool r = false;
    switch (n->op) {
    case OP_EQ:
    case OP_NE:
        if (a.type == VT_SET && b.type == VT_SET)
            r = a.n == b.n && s_subset(a.set, a.n, b.set, b.n);
        else if ((a.type == VT_STR || a.type == VT_LOC) && (b.type == VT_STR || b.type == VT_LOC))
            r = s_str_eq(pol, &a, &b);
        else
            r = a.num == b.num;
        if (n->op == OP_NE) r = !r;
        break;
    case OP_LT: r = a.num < b.num; break;
    case OP_GT: r = a.num > b.num; break;
    case OP_LE:
        r = a.type == VT_SET ? s_subset(a.set, a.n, b.set, b.n) : a.num <= b.num;
        break;
    case OP_GE:
        r = a.type == VT_SET ? s_subset(b.set, b.n, a.set, a.n) : a.num >= b.num;
        break;
    case OP_IN: r = a.sym < pol->n_syms && s_member(b.set, b.n, a.sym); break;
    case OP_WITHIN: r = s_within(pol, a.sym, b.sym); break;
    default: return B_E;
    }
    return r ? B_T : B_F;
}

static uint8_t s_has(const p_ctx *c, const p_node *n) {
    const fi_policy *pol = c->pol;
    if (n->scope == SC_REQ) {
        const p_req *r = c->req;
        switch (n->attr) {
        case RA_TENANT: return r->wild ? B_T | B_F : r->tenant != SYM_NONE ? B_T : B_F;
        case RA_APPLICATION: return r->wild ? B_T | B_F : r->application != SYM_NONE ? B_T : B_F;
        case RA_MODEL: return r->wild ? B_T | B_F : r->model != SYM_NONE ? B_T : B_F;
        case RA_LATENCY: return r->wild ? B_T | B_F : r->latency >= 0 ? B_T : B_F;
        case RA_PROMPT: return r->wild ? B_T | B_F : r->prompt >= 0 ? B_T : B_F;
        default: return B_T;
        }
    }
    const p_entity *e = &pol->ents[pol->targets[c->target]];
    if (n->attr == TA_SITE) return e->kind == EK_SITE ? B_T : B_F;
    if (n->attr < TA_USER) return B_T;
    return pol->tvals[(size_t)c->target * pol->n_attrs + (n->attr - TA_USER)].type != VT_NONE ? B_T : B_F;
}

/* Evaluates a condition node: a set of outcomes (exactly one unless the
 * request is wild). Recursion depth is bounded by FI_POLICY_MAX_DEPTH and
 * the length of and/or chains, which the parser builds left-deep. */
uint8_t p_eval(const p_ctx *c, uint32_t ni) {
    const p_node *n = &c->pol->nodes[ni];
    switch (n->op) {
    case OP_TRUE: return B_T;
    case OP_FALSE: return B_F;
    case OP_NOT: return s_not(p_eval(c, n->a));
    case OP_AND: {
        uint8_t a = p_eval(c, n->a);
        if (a == B_F) return B_F;
        return s_lift(a, p_eval(c, n->b), s_and1);
    }
    case OP_OR: {
        uint8_t a = p_eval(c, n->a);
        if (a == B_T) return B_T;
        return s_lift(a, p_eval(c, n->b), s_or1);
    }
    case OP_HAS: return s_has(c, n);
    case OP_ATTR:
    case OP_NUM:
    case OP_STR:
    case OP_SET:
    case OP_TARGET: return B_E; /* a value where a condition belongs; the checker rules this out */
    default: return s_cmp(c, n);
    }
}

uint8_t p_eval_rule(const p_ctx *c, const p_rule *r) {
    return r->cond == NODE_NONE ? B_T : p_eval(c, r->cond);
}

/* ------------------------------------------------------------------ binding */

static uint32_t s_bind_str(const fi_policy *pol, const char *s) {
    return s ? p_lookup(pol, s) : SYM_NONE;
}

/* Binds r to out. 0, or -1 with *bad (fi_bad) saying what is wrong. A
 * request without labels carries the default label; with none named, it
 * carries no label only when the policy declares none (fail closed: an
 * empty set would pass every `request.labels <= [...]`). */
int p_bind(const fi_policy *pol, const fi_request *r, p_req *out, uint8_t *bad) {
    memset(out, 0, sizeof *out);
    *bad = FI_BAD_NONE;
    uint32_t o = r->origin_site ? p_lookup(pol, r->origin_site) : SYM_UNKNOWN;
    int32_t e = o < pol->n_syms ? pol->sym_ent[o] : -1;
    if (e < 0 || pol->ents[e].kind != EK_SITE) {
        *bad = FI_BAD_ORIGIN;
        return -1;
    }
    out->origin = e;
    out->tenant = s_bind_str(pol, r->tenant);
    out->application = s_bind_str(pol, r->application);
    out->model = s_bind_str(pol, r->model);
    out->tenant_s = r->tenant;
    out->application_s = r->application;
    out->model_s = r->model;
    out->latency = r->latency_ms;
    out->prompt = r->prompt_tokens;
    if (r->n_labels > FI_POLICY_MAX_REQ_LABELS) {
        *bad = FI_BAD_TOO_MANY_LABELS;
        return -1;
    }
    for (size_t i = 0; i < r->n_labels; i++) {
        uint32_t s = r->labels[i] ? p_lookup(pol, r->labels[i]) : SYM_UNKNOWN;
        if (s >= pol->n_syms || pol->sym_label[s] < 0) {
            *bad = FI_BAD_LABEL;
            return -1;
        }
        uint32_t j = out->n_labels;
        while (j > 0 && out->labels[j - 1] > s) {
            out->labels[j] = out->labels[j - 1];
            j--;
        }
        if (j > 0 && out->labels[j - 1] == s) { /* duplicate: undo the shift */
            memmove(&out->labels[j], &out->labels[j + 1], (out->n_labels - j) * sizeof(uint32_t));
            continue;
        }
        out->labels[j] = s;
        out->n_labels++;
    }
    if (!out->n_labels && pol->default_label != SYM_NONE) {
        out->labels[0] = pol->default_label;
        out->n_labels = 1;
    } else if (!out->n_labels && pol->n_labels) {
        *bad = FI_BAD_NO_LABELS;
        return -1;
    }
    return 0;
}

/* --------------------------------------------------------------- decisions */

static void s_deny_all(const uint32_t *targets, size_t n, fi_verdict *out, uint8_t cause, uint8_t bad) {
    for (size_t i = 0; i < n; i++) {
        memset(&out[i], 0, sizeof out[i]);
        out[i].target = targets ? targets[i] : (uint32_t)i;
        out[i].cause = cause;
        out[i].bad = bad;
    }
}

static int s_check_targets(const fi_policy *pol, const uint32_t *targets, size_t n, fi_verdict *out) {
    if (n > FI_POLICY_MAX_TARGETS || (!targets && n != pol->n_targets)) {
        s_deny_all(NULL, n > FI_POLICY_MAX_TARGETS ? 0 : n, out, FI_CAUSE_BAD_REQUEST, FI_BAD_NONE);
        return -1;
    }
    for (size_t i = 0; targets && i < n; i++)
        if (targets[i] >= pol->n_targets) {
            s_deny_all(NULL, n, out, FI_CAUSE_BAD_REQUEST, FI_BAD_NONE);
            return -1;
        }
    return 0;
}

/* Fills a verdict from the hit masks of one target. */
static void s_verdict(const fi_policy *pol, const uint64_t *fh, const uint64_t *fe, const uint64_t *ph,
                      const uint64_t *pr, fi_verdict *v) {
    uint32_t w = pol->words;
    uint64_t anyf = 0, anyp = 0;
    for (uint32_t i = 0; i < w; i++) {
        anyf |= fh[i];
        anyp |= ph[i];
    }
    const uint64_t *m = anyf ? fh : anyp ? ph : NULL;
    v->cause = anyf ? FI_CAUSE_FORBID : anyp ? FI_CAUSE_PERMIT : FI_CAUSE_DEFAULT_DENY;
    v->permitted = !anyf && anyp;
    if (!m) return;
    unsigned k = 0;
    for (uint32_t i = 0; i < w; i++) {
        uint64_t x = m[i];
        k += (unsigned)__builtin_popcountll(x);
        while (x && v->n_rules < FI_VERDICT_MAX_RULES) {
            unsigned b = (unsigned)__builtin_ctzll(x);
            x &= x - 1;
            if (anyf && (fe[i] >> b & 1)) v->rule_errored |= (uint8_t)(1u << v->n_rules);
            v->rules[v->n_rules++] = (uint16_t)(i * 64 + b);
        }
    }
    v->n_rules = (uint16_t)k;
    if (!v->permitted) return;
    unsigned np = 0;
    for (uint32_t i = 0; i < w; i++) {
        uint64_t x = pr[i];
        while (x) {
            unsigned b = (unsigned)__builtin_ctzll(x);
            x &= x - 1;
            if (np < FI_VERDICT_MAX_RULES) v->prefer[np] = (uint16_t)(i * 64 + b);
            np++;
            v->score += pol->rules[i * 64 + b].score;
        }
    }
    v->n_prefer = (uint16_t)np;
}

int fi_policy_decide(const fi_policy *pol, const fi_request *req, const uint32_t *targets, size_t n,
                     fi_verdict *out) {
    if (s_check_targets(pol, targets, n, out)) return -1;
    p_req rq;
    uint8_t bad;
    if (p_bind(pol, req, &rq, &bad)) {
        s_deny_all(targets, n, out, FI_CAUSE_BAD_REQUEST, bad);
        return 0;
    }
    const uint32_t w = pol->words;
    uint64_t rq_t[MAXW], rq_f[MAXW];
    uint8_t rq_cache[SLOT_CAP], mx_cache[SLOT_CAP]; /* 0: not yet evaluated */
    p_ctx c = {pol, &rq, 0, NULL, 0};
    /* Request-only conjuncts: once per request, and once per distinct one. */
    for (uint32_t i = 0; i < w; i++) rq_t[i] = rq_f[i] = 0;
    memset(rq_cache, 0, pol->n_rq_slots);
    for (uint32_t r = 0; r < pol->n_rules; r++) {
        const p_rule *ru = &pol->rules[r];
        uint8_t acc = B_T;
        for (uint32_t k = ru->conj; k < ru->conj + ru->n_rq && acc != B_F; k++) {
            uint32_t sl = pol->conj_slot[k];
            uint8_t v = sl == SLOT_NONE ? p_eval(&c, pol->conj[k])
                                        : rq_cache[sl] ? rq_cache[sl] : (rq_cache[sl] = p_eval(&c, pol->conj[k]));
            acc = s_and1(acc, v);
        }
        if (acc == B_T) rq_t[r >> 6] |= 1ull << (r & 63);
        else if (acc == B_F) rq_f[r >> 6] |= 1ull << (r & 63);
    }
    uint64_t fh[MAXW], fe[MAXW], ph[MAXW], pr[MAXW];
    for (size_t i = 0; i < n; i++) {
        uint32_t t = targets ? targets[i] : (uint32_t)i;
        const uint64_t *tt = pol->tg_t + (size_t)t * w, *tf = pol->tg_f + (size_t)t * w;
        c.target = t;
        memset(mx_cache, 0, pol->n_mx_slots);
        for (uint32_t k = 0; k < w; k++) {
            uint64_t T = rq_t[k] & tt[k];
            uint64_t F = rq_f[k] | tf[k];
            uint64_t mx = pol->m_mixed[k] & ~F;
            while (mx) {
                unsigned b = (unsigned)__builtin_ctzll(mx);
                uint64_t bit = 1ull << b;
                mx &= mx - 1;
                const p_rule *ru = &pol->rules[k * 64 + b];
                uint8_t acc = (T & bit) ? B_T : B_E;
                uint32_t first = ru->conj + ru->n_rq + ru->n_tg;
                for (uint32_t j = first; j < first + ru->n_mx && acc != B_F; j++) {
                    uint32_t sl = pol->conj_slot[j];
                    uint8_t v = sl == SLOT_NONE ? p_eval(&c, pol->conj[j])
                                                : mx_cache[sl] ? mx_cache[sl] : (mx_cache[sl] = p_eval(&c, pol->conj[j]));
                    acc = s_and1(acc, v);
                }
                T &= ~bit;
                if (acc == B_T) T |= bit;
                else if (acc == B_F) F |= bit;
            }
            uint64_t E = pol->m_all[k] & ~T & ~F;
            fh[k] = (T | E) & pol->m_forbid[k];
            fe[k] = E & pol->m_forbid[k];
            ph[k] = T & pol->m_permit[k];
            pr[k] = T & pol->m_prefer[k];
        }
        fi_verdict *v = &out[i];
        memset(v, 0, sizeof *v);
        v->target = t;
        s_verdict(pol, fh, fe, ph, pr, v);
    }
    return 0;
}

int fi_policy_decide_slow(const fi_policy *pol, const fi_request *req, const uint32_t *targets, size_t n,
                          fi_verdict *out) {
    if (s_check_targets(pol, targets, n, out)) return -1;
    p_req rq;
    uint8_t bad;
    if (p_bind(pol, req, &rq, &bad)) {
        s_deny_all(targets, n, out, FI_CAUSE_BAD_REQUEST, bad);
        return 0;
    }
    uint64_t fh[MAXW], fe[MAXW], ph[MAXW], pr[MAXW];
    for (size_t i = 0; i < n; i++) {
        uint32_t t = targets ? targets[i] : (uint32_t)i;
        p_ctx c = {pol, &rq, t, NULL, 0};
        memset(fh, 0, sizeof fh);
        memset(fe, 0, sizeof fe);
        memset(ph, 0, sizeof ph);
        memset(pr, 0, sizeof pr);
        for (uint32_t r = 0; r < pol->n_rules; r++) {
            const p_rule *ru = &pol->rules[r];
            uint8_t m = p_eval_rule(&c, ru);
            uint64_t bit = 1ull << (r & 63);
            if (ru->effect == FI_FORBID && m != B_F) {
                fh[r >> 6] |= bit;
                if (m == B_E) fe[r >> 6] |= bit;
            } else if (ru->effect == FI_PERMIT && m == B_T) {
                ph[r >> 6] |= bit;
            } else if (ru->effect == FI_PREFER && m == B_T) {
                pr[r >> 6] |= bit;
            }
        }
        memset(&out[i], 0, sizeof out[i]);
        out[i].target = t;
        s_verdict(pol, fh, fe, ph, pr, &out[i]);
    }
    return 0;
}

int fi_verdict_best(const fi_verdict *out, size_t n) {
    int best = -1;
    for (size_t i = 0; i < n; i++)
        if (out[i].permitted && (best < 0 || out[i].score > out[best].score)) best = (int)i;
    return best;
}

/* Appends to buf at *k, never past cap. */
static void s_cat(char *buf, size_t cap, size_t *k, const char *fmt, const char *a, const char *b) {
    if (*k >= cap) return;
    int x = snprintf(buf + *k, cap - *k, fmt, a, b);
    if (x > 0) *k += (size_t)x;
    if (*k >= cap) *k = cap - 1;
}

/* Why a request is bad, for a fi_bad. */
static const char *s_bad_text(uint8_t bad) {
    switch (bad) {
    case FI_BAD_ORIGIN: return "the request's origin site is not a site of the policy";
    case FI_BAD_LABEL: return "the request names a label the policy does not declare";
    case FI_BAD_TOO_MANY_LABELS: return "the request has too many labels";
    case FI_BAD_NO_LABELS: return "the request has no labels and the policy names no default_label";
    default: return "the request names an origin site or label the policy does not know";
    }
}

void fi_verdict_explain(const fi_policy *pol, const fi_verdict *v, const char *name, char *buf, size_t cap) {
    if (!cap) return;
    buf[0] = 0;
    size_t k = 0;
    if (!name) name = pol ? fi_policy_target_name(pol, v->target) : "?";
    if (!name) name = "?";
    s_cat(buf, cap, &k, "%s %s: ", v->permitted ? "permitted" : "denied", name);
    switch (v->cause) {
    case FI_CAUSE_DEFAULT_DENY: s_cat(buf, cap, &k, "%sno permit matched (default deny)", "", ""); return;
    case FI_CAUSE_BAD_REQUEST: s_cat(buf, cap, &k, "%s (fail closed)", s_bad_text(v->bad), ""); return;
    case FI_CAUSE_UNKNOWN_TARGET:
        s_cat(buf, cap, &k, "%sthe target is not in the policy (fail closed)", "", "");
        return;
    case FI_CAUSE_FALLBACK:
        s_cat(buf, cap, &k, "%s",
              v->permitted ? "no valid policy: the origin site only (fail closed)"
                           : "no valid policy: only the origin site may process (fail closed)", "");
        return;
    default: break;
    }
    unsigned shown = v->n_rules < FI_VERDICT_MAX_RULES ? v->n_rules : FI_VERDICT_MAX_RULES;
    for (unsigned i = 0; i < shown; i++) {
        s_cat(buf, cap, &k, i ? ", %s \"%s\"" : "%s \"%s\"", v->cause == FI_CAUSE_FORBID ? "forbid" : "permit",
              fi_policy_rule_id(pol, v->rules[i]));
        if (v->rule_errored >> i & 1) s_cat(buf, cap, &k, "%s%s", " (condition could not be evaluated)", "");
    }
    if (v->n_rules > shown) {
        char more[32];
        snprintf(more, sizeof more, " and %u more", v->n_rules - shown);
        s_cat(buf, cap, &k, "%s%s", more, "");
    }
    if (v->permitted && v->n_prefer) {
        char sc[48];
        snprintf(sc, sizeof sc, "; score %lld (", (long long)v->score);
        s_cat(buf, cap, &k, "%s%s", sc, "");
        unsigned sp = v->n_prefer < FI_VERDICT_MAX_RULES ? v->n_prefer : FI_VERDICT_MAX_RULES;
        for (unsigned i = 0; i < sp; i++)
            s_cat(buf, cap, &k, i ? ", prefer \"%s\"%s" : "prefer \"%s\"%s", fi_policy_rule_id(pol, v->prefer[i]), "");
        s_cat(buf, cap, &k, "%s)", v->n_prefer > sp ? ", ..." : "", "");
    }
}

void fi_policy_rule_trace(const fi_policy *pol, const fi_request *req, uint32_t target, size_t rule, char *buf,
                          size_t cap) {
    if (!cap) return;
    buf[0] = 0;
    p_req rq;
    uint8_t bad;
    if (rule >= pol->n_rules || target >= pol->n_targets) {
        snprintf(buf, cap, "error: no such rule or target");
        return;
    }
    if (p_bind(pol, req, &rq, &bad)) {
        snprintf(buf, cap, "error: %s", s_bad_text(bad));
        return;
    }
    char err[200] = "";
    p_ctx c = {pol, &rq, target, err, sizeof err};
    uint8_t m = p_eval_rule(&c, &pol->rules[rule]);
    if (m == B_T) snprintf(buf, cap, "true");
    else if (m == B_F) snprintf(buf, cap, "false");
    else snprintf(buf, cap, "error: %s", err[0] ? err : "the condition could not be evaluated");
}

void fi_policy_fallback(const char *origin_site, const char *const *names, const fi_target_kind *kinds, size_t n,
                        fi_verdict *out) {
    for (size_t i = 0; i < n; i++) {
        memset(&out[i], 0, sizeof out[i]);
        out[i].target = (uint32_t)i;
        out[i].cause = FI_CAUSE_FALLBACK;
        out[i].permitted = origin_site && names[i] && kinds[i] == FI_TARGET_SITE && !strcmp(origin_site, names[i]);
    }
}

#define NAMES_CHUNK 128 /* candidates decided per call of fi_policy_decide */

void fi_policy_decide_names(const fi_policy *pol, int64_t now, const fi_request *req, const char *const *names,
                            const fi_target_kind *kinds, size_t n, fi_verdict *out) {
    if (!pol || !fi_policy_current(pol, now)) {
        fi_policy_fallback(req ? req->origin_site : NULL, names, kinds, n, out);
        return;
    }
    for (size_t base = 0; base < n; base += NAMES_CHUNK) {
        size_t m = n - base < NAMES_CHUNK ? n - base : NAMES_CHUNK;
        uint32_t idx[NAMES_CHUNK];
        size_t pos[NAMES_CHUNK], k = 0;
        fi_verdict tmp[NAMES_CHUNK];
        for (size_t i = 0; i < m; i++) {
            fi_verdict *v = &out[base + i];
            memset(v, 0, sizeof *v);
            v->target = (uint32_t)(base + i);
            v->cause = FI_CAUSE_UNKNOWN_TARGET;
            int t = names[base + i] ? fi_policy_target_find(pol, names[base + i]) : -1;
            if (t < 0 || fi_policy_target_kind(pol, (size_t)t) != kinds[base + i]) continue;
            idx[k] = (uint32_t)t;
            pos[k++] = base + i;
        }
        if (!k || fi_policy_decide(pol, req, idx, k, tmp)) continue;
        for (size_t j = 0; j < k; j++) {
            out[pos[j]] = tmp[j];
            out[pos[j]].target = (uint32_t)pos[j];
        }
    }
}
