/*
 * policy_check.c - validation and compilation of a parsed policy, and the
 * policy object's life cycle and accessors.
 *
 * Validation resolves every name (entities, labels, attributes), checks
 * types and ids, and reports errors with their position and a hint; the
 * analysis of what rules can match is in policy_flows.c. Compilation then
 * splits each rule's condition into its top-level conjuncts, sorted by what
 * they depend on (nothing or the request only, the target only, both), and
 * evaluates the target-only ones for every target once, into bit masks over
 * rules (see fi_policy_decide in policy_eval.c).
 */
#include <errno.h>
#include <stdarg.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#include "policy_impl.h"

#define MAX_POLICY_BYTES (16u << 20) /* refuse larger source files */

const char *p_kind_name(uint8_t ek) {
    static const char *n[] = {"jurisdiction", "region", "site", "cluster"};
    return ek < 4 ? n[ek] : "entity";
}

static const char *const s_req_attr[RA_COUNT] = {
    "tenant", "application", "model", "labels", "origin.site", "origin.region",
    "origin.jurisdiction", "latency_ms", "prompt_tokens"};
static const uint8_t s_req_type[RA_COUNT] = {VT_STR, VT_STR, VT_STR, VT_SET, VT_LOC,
                                             VT_LOC, VT_LOC, VT_NUM, VT_NUM};
static const char *const s_tgt_attr[TA_USER] = {"kind", "name", "site", "region", "jurisdiction"};

const char *p_attr_name(const fi_policy *pol, uint8_t scope, uint32_t attr) {
    if (scope == SC_REQ) return attr < RA_COUNT ? s_req_attr[attr] : "?";
    if (attr < TA_USER) return s_tgt_attr[attr];
    return attr - TA_USER < pol->n_attrs ? p_str(pol, pol->attrs[attr - TA_USER].name) : "?";
}

static const char *s_type_name(uint8_t t) {
    static const char *n[] = {"nothing", "a boolean", "a number", "a string", "a set", "an entity name", "error"};
    return t <= VT_ERR ? n[t] : "?";
}

/* Edit distance, for "did you mean" hints; capped inputs. */
static size_t s_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return 99;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++) row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t prev = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t cur = row[j];
            size_t best = prev + (a[i - 1] != b[j - 1]);
            if (row[j] + 1 < best) best = row[j] + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            prev = cur;
        }
    }
    return row[lb];
}

/* Builds a hint: "did you mean X?" when a candidate is close, else a list
 * headed by `intro`. cands are n strings. */
static void s_suggest(char *hint, size_t cap, const char *word, const char *const *cands, size_t n,
                      const char *intro) {
    size_t best = 99, bi = 0;
    for (size_t i = 0; i < n; i++) {
        size_t dd = s_distance(word, cands[i]);
        if (dd < best) {
            best = dd;
            bi = i;
        }
    }
    if (n && best <= 2 && best < strlen(word)) {
        snprintf(hint, cap, "did you mean \"%s\"?", cands[bi]);
        return;
    }
    size_t k = (size_t)snprintf(hint, cap, "%s", intro);
    for (size_t i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(hint + k, cap - k, "%s%s", i ? ", " : "", cands[i]);
    if (!n && k < cap) snprintf(hint + k, cap - k, "(none)");
}

typedef struct checker {
    fi_policy *pol;
    fi_diags *d;
    int errors;
} checker;

static void s_err(checker *ck, unsigned line, unsigned col, const char *hint, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void s_err(checker *ck, unsigned line, unsigned col, const char *hint, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p_diag(ck->d, FI_DIAG_ERROR, line, col, hint, "%s", msg);
    ck->errors++;
}

/* ---------------------------------------------------------------- topology */

static int32_t s_entity_by_sym(const fi_policy *pol, uint32_t sym, uint32_t before) {
    for (uint32_t i = 0; i < before; i++)
        if (pol->ents[i].name == sym) return (int32_t)i;
    return -1;
}

static void s_entity_names(const fi_policy *pol, int kind_mask, const char **out, size_t *n) {
    *n = 0;
    for (uint32_t i = 0; i < pol->n_ents && *n < 48; i++)
        if (kind_mask & (1 << pol->ents[i].kind)) out[(*n)++] = p_str(pol, pol->ents[i].name);
}

static void s_topology(checker *ck) {
    fi_policy *pol = ck->pol;
    for (uint32_t i = 0; i < pol->n_ents; i++) {
        p_entity *e = &pol->ents[i];
        unsigned pline = (unsigned)e->region, pcol = (unsigned)e->jur; /* stashed by the parser */
        e->region = e->jur = -1;
        int32_t dup = s_entity_by_sym(pol, e->name, i);
        if (dup >= 0) {
            char hint[160], kn[16];
            snprintf(kn, sizeof kn, "%s", p_kind_name(pol->ents[dup].kind));
            snprintf(hint, sizeof hint,
                     "jurisdictions, regions, sites and clusters share one namespace; first "
                     "declared at %u:%u", pol->ents[dup].line, pol->ents[dup].col);
            s_err(ck, e->line, e->col, hint, "duplicate id \"%s\": already declared as a %s%s",
                  p_str(pol, e->name), kn, "");
        }
        if (e->parent >= 0) {
            uint32_t psym = (uint32_t)e->parent;
            int32_t p = s_entity_by_sym(pol, psym, i);
            uint8_t want = e->kind == EK_SITE || e->kind == EK_CLUSTER ? EK_REGION : EK_JUR;
            if (p < 0) {
                int32_t later = s_entity_by_sym(pol, psym, pol->n_ents);
                char hint[400];
                if (later >= 0) {
                    snprintf(hint, sizeof hint, "declare \"%s\" (line %u) before the entities inside it",
                             p_str(pol, psym), pol->ents[later].line);
                } else {
                    const char *names[48];
                    size_t n;
                    s_entity_names(pol, 1 << want, names, &n);
                    char intro[64];
                    snprintf(intro, sizeof intro, "declared %ss: ", p_kind_name(want));
                    s_suggest(hint, sizeof hint, p_str(pol, psym), names, n, intro);
                }
                if (later >= 0)
                    s_err(ck, pline, pcol, hint, "\"%s\" is used before it is declared", p_str(pol, psym));
                else
                    s_err(ck, pline, pcol, hint, "unknown entity \"%s\": no %s of that name is declared",
                          p_str(pol, psym), p_kind_name(want));
                e->parent = -1;
            } else if (pol->ents[p].kind != want) {
                char hint[200];
                snprintf(hint, sizeof hint, "a %s is inside a %s; \"%s\" is a %s",
                         p_kind_name(e->kind), p_kind_name(want), p_str(pol, psym),
                         p_kind_name(pol->ents[p].kind));
                s_err(ck, pline, pcol, hint, "a %s cannot be in \"%s\"%s", p_kind_name(e->kind),
                      p_str(pol, psym), "");
                e->parent = -1;
            } else {
                e->parent = p;
            }
        }
        if (e->kind == EK_JUR) {
            e->jur = (int32_t)i;
        } else if (e->kind == EK_REGION) {
            e->region = (int32_t)i;
            e->jur = e->parent;
        } else {
            e->region = e->parent;
            e->jur = e->parent >= 0 ? pol->ents[e->parent].jur : -1;
        }
    }
    for (uint32_t i = 0; i < pol->n_ents; i++)
        if (pol->ents[i].kind == EK_SITE || pol->ents[i].kind == EK_CLUSTER) pol->n_targets++;
    if (pol->n_targets > FI_POLICY_MAX_TARGETS) {
        p_diag(ck->d, FI_DIAG_ERROR, 0, 0, "split the fleet into several policies",
               "too many targets: %u (at most %d)", pol->n_targets, FI_POLICY_MAX_TARGETS);
        ck->errors++;
    }
}

/* -------------------------------------------------------------- attributes */

static int s_attributes(checker *ck) {
    fi_policy *pol = ck->pol;
    /* By symbol: the attribute definition (index in pol->attrs) and the
     * last assignment seen (an entity's assignments are consecutive), so
     * that the checks are linear in the number of assignments. */
    uint32_t ns = pol->n_syms ? pol->n_syms : 1;
    uint32_t *attr_of = malloc(ns * sizeof *attr_of), *last_as = malloc(ns * sizeof *last_as);
    if (!attr_of || !last_as) {
        free(attr_of);
        free(last_as);
        return -1;
    }
    for (uint32_t i = 0; i < ns; i++) attr_of[i] = last_as[i] = UINT32_MAX;
    bool too_many = false;
    for (uint32_t k = 0; k < pol->n_assigns; k++) {
        p_assign *as = &pol->assigns[k];
        p_entity *e = &pol->ents[as->ent];
        const char *an = p_str(pol, as->name);
        bool builtin = false;
        for (int i = 0; i < TA_USER; i++) builtin |= !strcmp(an, s_tgt_attr[i]);
        if (builtin) {
            s_err(ck, as->line, as->col,
                  "kind, name, site, region and jurisdiction come from the topology; rename the attribute",
                  "attribute \"%s\" is built in and cannot be set%s%s", an, "", "");
            continue;
        }
        if (e->kind != EK_SITE && e->kind != EK_CLUSTER) {
            s_err(ck, as->line, as->col, "only sites and clusters are targets, so only they carry attributes",
                  "attribute \"%s\" on %s \"%s\"", an, p_kind_name(e->kind), p_str(pol, e->name));
            continue;
        }
        uint32_t j = last_as[as->name];
        if (j != UINT32_MAX && pol->assigns[j].ent == as->ent) {
            char hint[80];
            snprintf(hint, sizeof hint, "first set at %u:%u", pol->assigns[j].line, pol->assigns[j].col);
            s_err(ck, as->line, as->col, hint, "duplicate attribute \"%s\" on \"%s\"%s", an,
                  p_str(pol, e->name), "");
        } else {
            last_as[as->name] = k;
        }
        uint32_t a = attr_of[as->name];
        if (a == UINT32_MAX) {
            if (pol->n_attrs == FI_POLICY_MAX_ATTRS) {
                if (!too_many)
                    s_err(ck, as->line, as->col, "use fewer attribute names (a set attribute holds many values)",
                          "too many attribute names: \"%s\" is one more than the %d allowed%s", an,
                          FI_POLICY_MAX_ATTRS, "");
                too_many = true;
                continue;
            }
            if (pol->n_attrs == pol->cap_attrs) {
                uint32_t cap = pol->cap_attrs ? pol->cap_attrs * 2 : 8;
                p_attrdef *n = realloc(pol->attrs, cap * sizeof *n);
                if (!n) {
                    free(attr_of);
                    free(last_as);
                    return -1;
                }
                pol->attrs = n;
                pol->cap_attrs = cap;
            }
            a = attr_of[as->name] = pol->n_attrs++;
            pol->attrs[a].name = as->name;
            pol->attrs[a].type = as->val.type;
            pol->attrs[a].line = as->line;
            pol->attrs[a].col = as->col;
        } else if (pol->attrs[a].type != as->val.type) {
            char hint[160];
            snprintf(hint, sizeof hint, "it was first given %s at %u:%u; an attribute has one type on every target",
                     s_type_name(pol->attrs[a].type), pol->attrs[a].line, pol->attrs[a].col);
            s_err(ck, as->line, as->col, hint, "type mismatch: attribute \"%s\" is %s here%s", an,
                  s_type_name(as->val.type), "");
        }
    }
    free(last_as);
    /* targets and the value table */
    pol->targets = calloc(pol->n_targets ? pol->n_targets : 1, sizeof *pol->targets);
    pol->sites = calloc(pol->n_targets ? pol->n_targets : 1, sizeof *pol->sites);
    pol->tvals = calloc((size_t)(pol->n_targets ? pol->n_targets : 1) * (pol->n_attrs ? pol->n_attrs : 1),
                        sizeof *pol->tvals);
    if (!pol->targets || !pol->sites || !pol->tvals) {
        free(attr_of);
        return -1;
    }
    uint32_t t = 0;
    for (uint32_t i = 0; i < pol->n_ents; i++) {
        p_entity *e = &pol->ents[i];
        if (e->kind != EK_SITE && e->kind != EK_CLUSTER) continue;
        e->target = (int32_t)t;
        pol->targets[t++] = i;
        if (e->kind == EK_SITE) pol->sites[pol->n_sites++] = i;
    }
    for (uint32_t k = 0; k < pol->n_assigns; k++) {
        p_assign *as = &pol->assigns[k];
        p_entity *e = &pol->ents[as->ent];
        if (e->target < 0) continue;
        uint32_t a = attr_of[as->name];
        if (a != UINT32_MAX && pol->attrs[a].type == as->val.type)
            pol->tvals[(size_t)e->target * pol->n_attrs + a] = as->val;
    }
    free(attr_of);
    return 0;
}

/* ------------------------------------------------------------------- types */

static bool s_is_label_attr(const p_node *n) {
    return n->op == OP_ATTR && n->scope == SC_REQ && n->attr == RA_LABELS;
}

/* Checks that string literal(s) of node `lit` are declared labels. */
static void s_check_label_lits(checker *ck, const p_node *lit) {
    fi_policy *pol = ck->pol;
    const char *names[FI_POLICY_MAX_LABELS];
    for (uint32_t i = 0; i < pol->n_labels; i++) names[i] = p_str(pol, pol->labels[i]);
    uint32_t n = lit->op == OP_SET ? lit->lit.n : lit->op == OP_STR ? 1 : 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t sym = lit->op == OP_SET ? pol->pool[lit->lit.off + i] : lit->lit.sym;
        bool ok = false;
        for (uint32_t j = 0; j < pol->n_labels; j++) ok |= pol->labels[j] == sym;
        if (!ok) {
            char hint[300];
            s_suggest(hint, sizeof hint, p_str(pol, sym), names, pol->n_labels, "declared labels: ");
            s_err(ck, lit->line, lit->col, hint, "unknown label \"%s\"%s%s", p_str(pol, sym), "", "");
        }
    }
}

/* The entity kinds (bit mask of 1 << EK_*) an entity-valued attribute may
 * hold; 0 for a node that is not one. */
static int s_loc_kinds(const p_node *n) {
    if (n->op == OP_TARGET) return (1 << EK_SITE) | (1 << EK_CLUSTER);
    if (n->op != OP_ATTR) return 0;
    if (n->scope == SC_REQ) {
        if (n->attr == RA_ORIGIN_SITE) return 1 << EK_SITE;
        if (n->attr == RA_ORIGIN_REGION) return 1 << EK_REGION;
        if (n->attr == RA_ORIGIN_JUR) return 1 << EK_JUR;
        return 0;
    }
    if (n->attr == TA_NAME) return (1 << EK_SITE) | (1 << EK_CLUSTER);
    if (n->attr == TA_SITE) return 1 << EK_SITE;
    if (n->attr == TA_REGION) return 1 << EK_REGION;
    if (n->attr == TA_JUR) return 1 << EK_JUR;
    return 0;
}

/* A string literal used as an entity: must name one of the given kinds;
 * turns the literal into VT_LOC. */
static void s_check_entity_lit(checker *ck, p_node *lit, int kinds) {
    fi_policy *pol = ck->pol;
    int32_t e = s_entity_by_sym(pol, lit->lit.sym, pol->n_ents);
    if (e >= 0 && (kinds & (1 << pol->ents[e].kind))) {
        lit->type = VT_LOC;
        return;
    }
    const char *names[48];
    size_t n;
    s_entity_names(pol, kinds, names, &n);
    char hint[400], what[64] = "";
    int k = 0;
    for (int i = 0; i < 4; i++)
        if (kinds & (1 << i))
            k += snprintf(what + k, sizeof what - (size_t)k, "%s%s", k ? " or " : "", p_kind_name((uint8_t)i));
    if (e >= 0) {
        snprintf(hint, sizeof hint, "\"%s\" is a %s here, not a %s", p_str(pol, lit->lit.sym),
                 p_kind_name(pol->ents[e].kind), what);
    } else {
        char intro[80];
        snprintf(intro, sizeof intro, "known: ");
        s_suggest(hint, sizeof hint, p_str(pol, lit->lit.sym), names, n, intro);
    }
    s_err(ck, lit->line, lit->col, hint, "unknown entity \"%s\": expected a %s%s", p_str(pol, lit->lit.sym),
          what, "");
}

static void s_resolve_attr(checker *ck, p_node *n, bool for_has) {
    fi_policy *pol = ck->pol;
    if (n->attr == SYM_NONE) { /* bare request outside has */
        s_err(ck, n->line, n->col, "write request.ATTRIBUTE, e.g. request.labels",
              "`request` alone is not a value%s%s%s", "", "", "");
        n->type = VT_ERR;
        return;
    }
    const char *a = p_str(pol, n->attr);
    char full[160];
    if (n->path2 != SYM_NONE) snprintf(full, sizeof full, "%s.%s", a, p_str(pol, n->path2));
    else snprintf(full, sizeof full, "%s", a);
    if (n->scope == SC_REQ) {
        for (uint32_t i = 0; i < RA_COUNT; i++)
            if (!strcmp(full, s_req_attr[i])) {
                n->attr = i;
                n->type = for_has ? VT_BOOL : s_req_type[i];
                n->dep = DEP_REQ;
                return;
            }
        char hint[300];
        s_suggest(hint, sizeof hint, full, (const char *const *)s_req_attr, RA_COUNT,
                  "request attributes: ");
        s_err(ck, n->line, n->col, hint, "unknown attribute request.%s%s%s", full,
              !strcmp(full, "origin") ? " (origin is not a value)" : "", "");
        n->type = VT_ERR;
        return;
    }
    if (n->path2 == SYM_NONE) {
        for (uint32_t i = 0; i < TA_USER; i++)
            if (!strcmp(a, s_tgt_attr[i])) {
                n->attr = i;
                n->type = for_has ? VT_BOOL : i == TA_KIND ? VT_STR : VT_LOC;
                n->dep = DEP_TGT;
                return;
            }
        for (uint32_t i = 0; i < pol->n_attrs; i++)
            if (!strcmp(a, p_str(pol, pol->attrs[i].name))) {
                n->attr = TA_USER + i;
                n->type = for_has ? VT_BOOL : pol->attrs[i].type;
                n->dep = DEP_TGT;
                return;
            }
    }
    const char *names[64];
    size_t k = 0;
    for (uint32_t i = 0; i < TA_USER; i++) names[k++] = s_tgt_attr[i];
    for (uint32_t i = 0; i < pol->n_attrs && k < 64; i++) names[k++] = p_str(pol, pol->attrs[i].name);
    char hint[400];
    s_suggest(hint, sizeof hint, full, names, k, "no site or cluster declares it; target attributes: ");
    s_err(ck, n->line, n->col, hint, "unknown attribute target.%s%s%s", full, "", "");
    n->type = VT_ERR;
}

/* Whether a node of this op is a value (literal, attribute, `target`)
 * rather than a condition: only values are compared with == and !=, and
 * only conditions stand where true or false is wanted. */
static bool s_is_value(uint8_t op) {
    return op == OP_TRUE || op == OP_FALSE || op == OP_NUM || op == OP_STR || op == OP_SET ||
           op == OP_ATTR || op == OP_TARGET;
}

static uint8_t s_type(checker *ck, uint32_t ni);

static const char *s_op_text(uint8_t op) {
    static const char *t[] = {"true", "false", "number", "string", "set", "attribute", "target", "not",
                              "and", "or", "==", "!=", "<", "<=", ">", ">=", "in", "within", "has"};
    return op <= OP_HAS ? t[op] : "?";
}

/* Warns when node n (==, != or in) compares a place exactly with the
 * entity sym while other jurisdictions are nested inside it: `within` is
 * probably meant. left is what the hint puts before `within`. */
static void s_warn_exact(checker *ck, const p_node *n, uint32_t sym, const char *left) {
    const fi_policy *pol = ck->pol;
    int32_t e = s_entity_by_sym(pol, sym, pol->n_ents);
    bool has_child = false;
    for (uint32_t i = 0; e >= 0 && i < pol->n_ents; i++)
        has_child |= pol->ents[i].parent == e && pol->ents[i].kind == EK_JUR;
    if (!has_child) return;
    char hint[200];
    snprintf(hint, sizeof hint, "write `%s within \"%s\"` to include what is nested inside it", left, p_str(pol, sym));
    p_diag(ck->d, FI_DIAG_WARNING, n->line, n->col, hint,
           "`%s` compares exactly: it is false for jurisdictions nested inside \"%s\"", s_op_text(n->op),
           p_str(pol, sym));
}

static void s_mismatch(checker *ck, const p_node *n, const char *hint, uint8_t ta, uint8_t tb) {
    char msg[200];
    snprintf(msg, sizeof msg, "type mismatch: `%s` cannot compare %s with %s", s_op_text(n->op),
             s_type_name(ta), s_type_name(tb));
    s_err(ck, n->line, n->col, hint, "%s%s%s", msg, "", "");
}

/* Types node ni and its operands; sets type and dep; reports errors.
 * Returns the type (VT_ERR after an error, which silences follow-ups). */
static uint8_t s_type(checker *ck, uint32_t ni) {
    fi_policy *pol = ck->pol;
    p_node *n = &pol->nodes[ni];
    switch (n->op) {
    case OP_TRUE:
    case OP_FALSE: return n->type = VT_BOOL;
    case OP_NUM: return n->type = VT_NUM;
    case OP_STR: return n->type = VT_STR;
    case OP_SET: return n->type = VT_SET;
    case OP_TARGET: n->dep = DEP_TGT; return n->type = VT_LOC;
    case OP_ATTR: s_resolve_attr(ck, n, false); return n->type;
    case OP_HAS: s_resolve_attr(ck, n, true); return n->type;
    default: break;
    }
    uint8_t ta = s_type(ck, n->a);
    uint8_t tb = n->b != NODE_NONE ? s_type(ck, n->b) : VT_BOOL;
    n = &pol->nodes[ni];
    p_node *A = &pol->nodes[n->a];
    p_node *B = n->b != NODE_NONE ? &pol->nodes[n->b] : NULL;
    n->dep = A->dep | (B ? B->dep : 0);
    if (ta == VT_ERR || tb == VT_ERR) return n->type = VT_ERR;
    switch (n->op) {
    case OP_NOT:
    case OP_AND:
    case OP_OR: {
        const p_node *bad = ta != VT_BOOL ? A : tb != VT_BOOL ? B : NULL;
        if (!bad && (A->op == OP_ATTR || (B && B->op == OP_ATTR))) {
            const p_node *at = A->op == OP_ATTR ? A : B;
            s_err(ck, at->line, at->col, "compare it, e.g. target.secure == true",
                  "a true/false attribute is a value, not a condition%s%s%s", "", "", "");
            return n->type = VT_ERR;
        }
        if (bad) {
            char msg[160];
            snprintf(msg, sizeof msg, "type mismatch: the operand of `%s` must be a condition, found %s",
                     s_op_text(n->op), s_type_name(bad->type));
            s_err(ck, bad->line, bad->col, "compare the value, e.g. target.gpu == \"h200\"", "%s%s%s", msg, "", "");
            return n->type = VT_ERR;
        }
        return n->type = VT_BOOL;
    }
    case OP_EQ:
    case OP_NE: {
        if (!s_is_value(A->op) || !s_is_value(B->op)) {
            const p_node *c = !s_is_value(A->op) ? A : B;
            s_err(ck, c->line, c->col, "use the condition itself, or `not` it",
                  "`%s` compares values, not conditions%s%s", s_op_text(n->op), "", "");
            return n->type = VT_ERR;
        }
        bool sa = ta == VT_STR || ta == VT_LOC, sb = tb == VT_STR || tb == VT_LOC;
        if (!(ta == tb || (sa && sb))) {
            s_mismatch(ck, n, "both sides of == and != have the same type", ta, tb);
            return n->type = VT_ERR;
        }
        if (A->op == OP_ATTR && A->scope == SC_TGT && A->attr == TA_KIND && B->op == OP_STR) {
            const char *v = p_str(pol, B->lit.sym);
            if (strcmp(v, "site") && strcmp(v, "cluster"))
                s_err(ck, B->line, B->col, "target.kind is \"site\" or \"cluster\"",
                      "unknown target kind \"%s\"%s%s", v, "", "");
        }
        if (B->op == OP_ATTR && B->scope == SC_TGT && B->attr == TA_KIND && A->op == OP_STR) {
            const char *v = p_str(pol, A->lit.sym);
            if (strcmp(v, "site") && strcmp(v, "cluster"))
                s_err(ck, A->line, A->col, "target.kind is \"site\" or \"cluster\"",
                      "unknown target kind \"%s\"%s%s", v, "", "");
        }
        int ka = s_loc_kinds(A), kb = s_loc_kinds(B);
        if (ka && B->op == OP_STR) s_check_entity_lit(ck, B, ka);
        if (kb && A->op == OP_STR) s_check_entity_lit(ck, A, kb);
        if (s_is_label_attr(A) && B->op == OP_SET) s_check_label_lits(ck, B);
        if (s_is_label_attr(B) && A->op == OP_SET) s_check_label_lits(ck, A);
        /* Exact comparison with a jurisdiction or region that holds others. */
        const p_node *lit = (ka && B->op == OP_STR) ? B : (kb && A->op == OP_STR) ? A : NULL;
        if (lit && lit->type == VT_LOC) s_warn_exact(ck, n, lit->lit.sym, A == lit ? "..." : "target");
        return n->type = VT_BOOL;
    }
    case OP_LT:
    case OP_GT:
    case OP_LE:
    case OP_GE:
        if (ta == VT_NUM && tb == VT_NUM) return n->type = VT_BOOL;
        if ((n->op == OP_LE || n->op == OP_GE) && ta == VT_SET && tb == VT_SET) {
            if (s_is_label_attr(A)) s_check_label_lits(ck, B);
            if (s_is_label_attr(B)) s_check_label_lits(ck, A);
            return n->type = VT_BOOL;
        }
        s_mismatch(ck, n,
                   n->op == OP_LE || n->op == OP_GE ? "<= and >= compare numbers, or sets (subset, superset)"
                                                    : "< and > compare numbers",
                   ta, tb);
        return n->type = VT_ERR;
    case OP_IN:
        if (tb != VT_SET) {
            s_mismatch(ck, n, "`x in S` needs a set on the right, e.g. \"phi\" in request.labels", ta, tb);
            return n->type = VT_ERR;
        }
        if (ta == VT_SET) {
            s_err(ck, n->line, n->col, "for a set on the left, test the subset with <=: request.labels <= [\"public\"]",
                  "type mismatch: `in` tests one element, found a set on the left%s%s%s", "", "", "");
            return n->type = VT_ERR;
        }
        if (ta != VT_STR && ta != VT_LOC) {
            s_mismatch(ck, n, "sets hold strings", ta, tb);
            return n->type = VT_ERR;
        }
        if (s_is_label_attr(B) && A->op == OP_STR) s_check_label_lits(ck, A);
        if (s_loc_kinds(A) && B->op == OP_SET) {
            /* target.region in ["a", "b"]: every element must be an entity */
            for (uint32_t i = 0; i < B->lit.n; i++) {
                p_node tmp = *B;
                tmp.op = OP_STR;
                tmp.lit.type = VT_STR;
                tmp.lit.sym = pol->pool[B->lit.off + i];
                s_check_entity_lit(ck, &tmp, s_loc_kinds(A));
                /* each element is compared exactly, as with == */
                if (tmp.type == VT_LOC)
                    s_warn_exact(ck, n, tmp.lit.sym, A->scope == SC_TGT ? "target" : "request.origin.site");
            }
        }
        return n->type = VT_BOOL;
    case OP_WITHIN: {
        if (ta != VT_LOC || !(tb == VT_LOC || tb == VT_STR)) {
            s_mismatch(ck, n, "`within` relates places: target within \"EU\", request.origin.site within \"DE\"",
                       ta, tb);
            return n->type = VT_ERR;
        }
        if (B->op == OP_STR) s_check_entity_lit(ck, B, 0xf);
        return n->type = VT_BOOL;
    }
    default: return n->type = VT_ERR;
    }
}

/* ----------------------------------------------------------------- compile */

static int s_conjuncts(fi_policy *pol, uint32_t ni, uint32_t *out, uint32_t *n, uint32_t cap) {
    const p_node *x = &pol->nodes[ni];
    if (x->op == OP_AND) {
        if (s_conjuncts(pol, x->a, out, n, cap)) return -1;
        return s_conjuncts(pol, x->b, out, n, cap);
    }
    if (*n == cap) return -1;
    out[(*n)++] = ni;
    return 0;
}

/* Structural hash and equality of condition trees, for sharing the
 * results of equal conjuncts between rules. */
static uint64_t s_shash(const fi_policy *pol, uint32_t ni) {
    const p_node *n = &pol->nodes[ni];
    uint64_t h = 1469598103934665603ull;
#define MIX(x) (h = (h ^ (uint64_t)(x)) * 1099511628211ull)
    MIX(n->op);
    MIX(n->scope);
    MIX(n->attr);
    MIX(n->lit.num);
    MIX(n->lit.sym);
    for (uint32_t i = 0; n->op == OP_SET && i < n->lit.n; i++) MIX(pol->pool[n->lit.off + i]);
    if (n->a != NODE_NONE) MIX(s_shash(pol, n->a));
    if (n->b != NODE_NONE) MIX(s_shash(pol, n->b));
#undef MIX
    return h;
}

static bool s_seq(const fi_policy *pol, uint32_t x, uint32_t y) {
    const p_node *a = &pol->nodes[x], *b = &pol->nodes[y];
    if (a->op != b->op || a->scope != b->scope || a->attr != b->attr || a->lit.num != b->lit.num ||
        a->lit.sym != b->lit.sym || a->lit.n != b->lit.n || (a->a == NODE_NONE) != (b->a == NODE_NONE) ||
        (a->b == NODE_NONE) != (b->b == NODE_NONE))
        return false;
    if (a->op == OP_SET && a->lit.n && memcmp(pol->pool + a->lit.off, pol->pool + b->lit.off, a->lit.n * sizeof(uint32_t)))
        return false;
    return (a->a == NODE_NONE || s_seq(pol, a->a, b->a)) && (a->b == NODE_NONE || s_seq(pol, a->b, b->b));
}

/* Gives every request-only and mixed conjunct a slot shared with the
 * structurally equal ones of its class. */
static int s_slots(fi_policy *pol) {
    pol->conj_slot = malloc((pol->n_conj ? pol->n_conj : 1) * sizeof *pol->conj_slot);
    uint32_t cap = 1;
    while (cap < 2 * pol->n_conj + 2) cap *= 2;
    uint32_t *tab = malloc(cap * sizeof *tab); /* conjunct index + 1 of each slot's first holder */
    uint64_t *hs = malloc((pol->n_conj ? pol->n_conj : 1) * sizeof *hs);
    if (!pol->conj_slot || !tab || !hs) {
        free(tab);
        free(hs);
        return -1;
    }
    for (int cls = 0; cls < 2; cls++) {
        memset(tab, 0, cap * sizeof *tab);
        uint32_t *count = cls == 0 ? &pol->n_rq_slots : &pol->n_mx_slots;
        for (uint32_t r = 0; r < pol->n_rules; r++) {
            const p_rule *ru = &pol->rules[r];
            uint32_t first = ru->conj + (cls == 0 ? 0 : ru->n_rq + ru->n_tg);
            uint32_t n = cls == 0 ? ru->n_rq : ru->n_mx;
            for (uint32_t k = first; k < first + n; k++) {
                uint32_t node = pol->conj[k];
                uint64_t h = hs[k] = s_shash(pol, node);
                uint32_t i = (uint32_t)h & (cap - 1);
                pol->conj_slot[k] = SLOT_NONE;
                while (tab[i]) {
                    uint32_t other = tab[i] - 1;
                    if (hs[other] == h && s_seq(pol, pol->conj[other], node)) {
                        pol->conj_slot[k] = pol->conj_slot[other];
                        break;
                    }
                    i = (i + 1) & (cap - 1);
                }
                if (!tab[i]) {
                    tab[i] = k + 1;
                    pol->conj_slot[k] = *count < SLOT_CAP ? (*count)++ : SLOT_NONE;
                }
            }
        }
    }
    for (uint32_t r = 0; r < pol->n_rules; r++) { /* target-only conjuncts are not cached */
        const p_rule *ru = &pol->rules[r];
        for (uint32_t k = ru->conj + ru->n_rq; k < ru->conj + ru->n_rq + ru->n_tg; k++) pol->conj_slot[k] = SLOT_NONE;
    }
    free(tab);
    free(hs);
    return 0;
}

static int s_compile(fi_policy *pol) {
    /* Every conjunct is a distinct node, so n_nodes bounds their number. */
    pol->conj = calloc(pol->n_nodes ? pol->n_nodes : 1, sizeof *pol->conj);
    if (!pol->conj) return -1;
    uint32_t *tmp = calloc(pol->n_nodes ? pol->n_nodes : 1, sizeof *tmp);
    if (!tmp) return -1;
    for (uint32_t r = 0; r < pol->n_rules; r++) {
        p_rule *ru = &pol->rules[r];
        uint32_t n = 0;
        if (ru->cond != NODE_NONE && s_conjuncts(pol, ru->cond, tmp, &n, pol->n_nodes)) {
            free(tmp);
            return -1;
        }
        ru->conj = pol->n_conj;
        for (int pass = 0; pass < 3; pass++)
            for (uint32_t i = 0; i < n; i++) {
                uint8_t dep = pol->nodes[tmp[i]].dep;
                int cls = dep == DEP_TGT ? 1 : dep == (DEP_REQ | DEP_TGT) ? 2 : 0;
                if (cls != pass) continue;
                pol->conj[pol->n_conj++] = tmp[i];
                if (pass == 0) ru->n_rq++;
                else if (pass == 1) ru->n_tg++;
                else ru->n_mx++;
            }
    }
    free(tmp);
    if (s_slots(pol)) return -1;
    uint32_t w = pol->words = (pol->n_rules + 63) / 64;
    size_t nw = w ? w : 1;
    pol->m_forbid = calloc(nw, 8);
    pol->m_permit = calloc(nw, 8);
    pol->m_prefer = calloc(nw, 8);
    pol->m_mixed = calloc(nw, 8);
    pol->m_all = calloc(nw, 8);
    pol->tg_t = calloc(nw * (pol->n_targets ? pol->n_targets : 1), 8);
    pol->tg_f = calloc(nw * (pol->n_targets ? pol->n_targets : 1), 8);
    if (!pol->m_forbid || !pol->m_permit || !pol->m_prefer || !pol->m_mixed || !pol->m_all || !pol->tg_t ||
        !pol->tg_f)
        return -1;
    for (uint32_t r = 0; r < pol->n_rules; r++) {
        const p_rule *ru = &pol->rules[r];
        uint64_t bit = 1ull << (r & 63);
        uint32_t wi = r >> 6;
        pol->m_all[wi] |= bit;
        if (ru->effect == FI_FORBID) pol->m_forbid[wi] |= bit;
        else if (ru->effect == FI_PERMIT) pol->m_permit[wi] |= bit;
        else pol->m_prefer[wi] |= bit;
        if (ru->n_mx) pol->m_mixed[wi] |= bit;
        for (uint32_t t = 0; t < pol->n_targets; t++) {
            p_ctx c = {pol, NULL, t, NULL, 0};
            uint8_t acc = B_T;
            for (uint32_t i = 0; i < ru->n_tg; i++) {
                uint8_t v = p_eval(&c, pol->conj[ru->conj + ru->n_rq + i]);
                if (v == B_F) acc = B_F;
                else if (v == B_E && acc == B_T) acc = B_E;
            }
            if (acc == B_T) pol->tg_t[(size_t)t * w + wi] |= bit;
            if (acc == B_F) pol->tg_f[(size_t)t * w + wi] |= bit;
        }
    }
    return 0;
}

/* --------------------------------------------------------------- the whole */

int p_check_and_compile(fi_policy *pol, fi_diags *d) {
    checker ck = {pol, d, 0};
    pol->sym_kind[0] = p_intern(pol, "site", 4);
    pol->sym_kind[1] = p_intern(pol, "cluster", 7);
    if (pol->sym_kind[0] == SYM_NONE || pol->sym_kind[1] == SYM_NONE) goto oom;
    s_topology(&ck);
    if (s_attributes(&ck)) goto oom;
    pol->sym_ent = malloc((pol->n_syms ? pol->n_syms : 1) * sizeof *pol->sym_ent);
    pol->sym_label = malloc((pol->n_syms ? pol->n_syms : 1) * sizeof *pol->sym_label);
    if (!pol->sym_ent || !pol->sym_label) goto oom;
    for (uint32_t s = 0; s < pol->n_syms; s++) pol->sym_ent[s] = pol->sym_label[s] = -1;
    for (uint32_t i = 0; i < pol->n_ents; i++)
        if (pol->sym_ent[pol->ents[i].name] < 0) pol->sym_ent[pol->ents[i].name] = (int32_t)i;
    for (uint32_t i = 0; i < pol->n_labels; i++) pol->sym_label[pol->labels[i]] = (int32_t)i;
    if (pol->default_label != SYM_NONE && pol->sym_label[pol->default_label] < 0) {
        const char *names[FI_POLICY_MAX_LABELS];
        for (uint32_t i = 0; i < pol->n_labels; i++) names[i] = p_str(pol, pol->labels[i]);
        char hint[300];
        s_suggest(hint, sizeof hint, p_str(pol, pol->default_label), names, pol->n_labels,
                  "declare it with `labels`; declared labels: ");
        s_err(&ck, pol->default_line, pol->default_col, hint, "unknown label \"%s\" in default_label%s%s",
              p_str(pol, pol->default_label), "", "");
    }
    if (pol->n_labels && pol->default_label == SYM_NONE)
        p_diag(d, FI_DIAG_WARNING, pol->labels_line, pol->labels_col,
               "add `default_label \"...\";` naming the label of unlabeled requests (the most restrictive one "
               "is the safe choice)",
               "the policy declares labels but no default_label: every request without labels is denied "
               "(bad request)");
    if (pol->n_rules > FI_POLICY_MAX_RULES) {
        p_diag(d, FI_DIAG_ERROR, 0, 0, "split the policy", "too many rules: %u (at most %d)", pol->n_rules,
               FI_POLICY_MAX_RULES);
        ck.errors++;
    }
    /* the first rule with each id, by symbol: linear */
    uint32_t *first_rule = malloc((pol->n_syms ? pol->n_syms : 1) * sizeof *first_rule);
    if (!first_rule) goto oom;
    for (uint32_t s = 0; s < pol->n_syms; s++) first_rule[s] = UINT32_MAX;
    for (uint32_t r = 0; r < pol->n_rules; r++) {
        p_rule *ru = &pol->rules[r];
        uint32_t q = first_rule[ru->id];
        if (q == UINT32_MAX) {
            first_rule[ru->id] = r;
        } else {
            char hint[120];
            snprintf(hint, sizeof hint, "rule ids are unique; the first is at %u:%u", pol->rules[q].line,
                     pol->rules[q].col);
            s_err(&ck, ru->line, ru->col, hint, "duplicate rule id \"%s\"%s%s", p_str(pol, ru->id), "", "");
        }
    }
    free(first_rule);
    for (uint32_t r = 0; r < pol->n_rules; r++) {
        p_rule *ru = &pol->rules[r];
        if (ru->cond == NODE_NONE) continue;
        uint8_t t = s_type(&ck, ru->cond);
        if (t == VT_BOOL && pol->nodes[ru->cond].op == OP_ATTR) {
            const p_node *c = &pol->nodes[ru->cond];
            s_err(&ck, c->line, c->col, "compare it, e.g. target.secure == true",
                  "a true/false attribute is a value, not a condition%s%s%s", "", "", "");
            continue;
        }
        if (t != VT_BOOL && t != VT_ERR) {
            const p_node *c = &pol->nodes[ru->cond];
            char msg[160];
            snprintf(msg, sizeof msg, "type mismatch: a condition must be true or false, found %s", s_type_name(t));
            s_err(&ck, c->line, c->col, "compare the value, e.g. target.gpu == \"h200\"", "%s%s%s", msg, "", "");
        }
    }
    if (ck.errors) return -1;
    if (s_compile(pol)) goto oom;
    return 0;
oom:
    p_diag(d, FI_DIAG_ERROR, 0, 0, NULL, "out of memory while checking the policy");
    return -1;
}

fi_policy *fi_policy_parse(const char *text, size_t len, fi_diags *diags) {
    if (len > MAX_POLICY_BYTES) {
        p_diag(diags, FI_DIAG_ERROR, 0, 0, "split the policy", "policy too large: %zu bytes (at most %u)", len,
               MAX_POLICY_BYTES);
        return NULL;
    }
    fi_policy *pol = p_policy_new();
    if (!pol) {
        p_diag(diags, FI_DIAG_ERROR, 0, 0, NULL, "out of memory");
        return NULL;
    }
    crypto_hash_sha256(pol->digest, (const unsigned char *)text, len);
    size_t before = fi_diags_errors(diags);
    if (p_parse(pol, text, len, diags) || p_check_and_compile(pol, diags) || fi_diags_errors(diags) > before) {
        fi_policy_destroy(&pol);
        return NULL;
    }
    p_analyse(pol, diags);
    return pol;
}

fi_policy *fi_policy_load(const char *path, fi_diags *diags) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        p_diag(diags, FI_DIAG_ERROR, 0, 0, NULL, "cannot open policy file %s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            cap = cap ? cap * 2 : 65536;
            if (cap > MAX_POLICY_BYTES + 1) cap = MAX_POLICY_BYTES + 1;
            if (len == cap) break;
            char *n = realloc(buf, cap);
            if (!n) {
                free(buf);
                fclose(f);
                p_diag(diags, FI_DIAG_ERROR, 0, 0, NULL, "out of memory reading %s", path);
                return NULL;
            }
            buf = n;
        }
        size_t k = fread(buf + len, 1, cap - len, f);
        len += k;
        if (k == 0) break;
    }
    int rerr = ferror(f);
    fclose(f);
    if (rerr) {
        free(buf);
        p_diag(diags, FI_DIAG_ERROR, 0, 0, NULL, "cannot read policy file %s", path);
        return NULL;
    }
    fi_policy *pol = fi_policy_parse(buf ? buf : "", len, diags);
    free(buf);
    return pol;
}

void fi_policy_destroy(fi_policy **self_p) {
    if (!self_p || !*self_p) return;
    fi_policy *p = *self_p;
    free(p->strs);
    free(p->sym_off);
    free(p->hash);
    free(p->sym_ent);
    free(p->sym_label);
    free(p->ents);
    free(p->targets);
    free(p->sites);
    free(p->attrs);
    free(p->tvals);
    free(p->assigns);
    free(p->pool);
    free(p->nodes);
    free(p->rules);
    free(p->conj);
    free(p->conj_slot);
    free(p->m_forbid);
    free(p->m_permit);
    free(p->m_prefer);
    free(p->m_mixed);
    free(p->m_all);
    free(p->tg_t);
    free(p->tg_f);
    free(p);
    *self_p = NULL;
}

/* ---------------------------------------------------------------- accessors */

const uint8_t *fi_policy_digest(const fi_policy *self) { return self->digest; }

void fi_policy_digest_hex(const fi_policy *self, char hex[65]) {
    sodium_bin2hex(hex, 65, self->digest, sizeof self->digest);
}

int64_t fi_policy_expires(const fi_policy *self) { return self->expires; }

void fi_policy_expire_by(fi_policy *self, int64_t at) {
    if (self && at > 0 && (self->expires == 0 || at < self->expires)) self->expires = at;
}

bool fi_policy_current(const fi_policy *self, int64_t now) {
    return self && (self->expires == 0 || now < self->expires);
}

size_t fi_policy_target_count(const fi_policy *self) { return self->n_targets; }

const char *fi_policy_target_name(const fi_policy *self, size_t i) {
    return i < self->n_targets ? p_str(self, self->ents[self->targets[i]].name) : NULL;
}

fi_target_kind fi_policy_target_kind(const fi_policy *self, size_t i) {
    return i < self->n_targets && self->ents[self->targets[i]].kind == EK_CLUSTER ? FI_TARGET_CLUSTER
                                                                                  : FI_TARGET_SITE;
}

int fi_policy_target_find(const fi_policy *self, const char *name) {
    uint32_t s = p_lookup(self, name);
    if (s >= self->n_syms) return -1;
    int32_t e = self->sym_ent[s];
    return e >= 0 ? self->ents[e].target : -1;
}

size_t fi_policy_site_count(const fi_policy *self) { return self->n_sites; }

const char *fi_policy_site_name(const fi_policy *self, size_t i) {
    return i < self->n_sites ? p_str(self, self->ents[self->sites[i]].name) : NULL;
}

const char *fi_policy_jurisdiction(const fi_policy *self, const char *name) {
    uint32_t s = name ? p_lookup(self, name) : SYM_UNKNOWN;
    if (s >= self->n_syms) return NULL;
    int32_t e = self->sym_ent[s];
    if (e < 0 || self->ents[e].jur < 0) return NULL;
    return p_str(self, self->ents[self->ents[e].jur].name);
}

size_t fi_policy_label_count(const fi_policy *self) { return self->n_labels; }

const char *fi_policy_label_name(const fi_policy *self, size_t i) {
    return i < self->n_labels ? p_str(self, self->labels[i]) : NULL;
}

int fi_policy_label_find(const fi_policy *self, const char *name) {
    uint32_t s = p_lookup(self, name);
    return s < self->n_syms ? self->sym_label[s] : -1;
}

const char *fi_policy_default_label(const fi_policy *self) {
    return self->default_label == SYM_NONE ? NULL : p_str(self, self->default_label);
}

size_t fi_policy_rule_count(const fi_policy *self) { return self->n_rules; }

const char *fi_policy_rule_id(const fi_policy *self, size_t i) {
    return i < self->n_rules ? p_str(self, self->rules[i].id) : NULL;
}

fi_effect fi_policy_rule_effect(const fi_policy *self, size_t i) {
    return i < self->n_rules ? (fi_effect)self->rules[i].effect : FI_FORBID;
}
