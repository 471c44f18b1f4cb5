/*
 * policy_flows.c - exhaustive flow analysis, and the validator's analysis
 * of what each rule can match (never-matching rules, permits shadowed by
 * forbids, rules that cannot be evaluated for some targets).
 *
 * Sites, clusters and labels are finite, so every (label set, origin site,
 * target) can be enumerated: label sets are all 2^L subsets of the L
 * declared labels (L <= FI_POLICY_MAX_LABELS), where the empty set stands
 * for a request without labels, which carries the default label. The other
 * request attributes (tenant, application, model, latency, prompt size)
 * are unbounded; the analysis evaluates each rule with them "wild", every
 * value or absent at once (see p_req.wild), and keeps the set of possible
 * outcomes. The verdict of a combination is then:
 *   deny  - some forbid matches whatever those attributes are, or no
 *           permit can match;
 *   allow - some permit matches and no forbid can, whatever they are;
 *   maybe - it depends on them.
 * The analysis is sound: allow and deny are certain. It may say maybe where
 * a closer look would decide, because it treats two mentions of the same
 * attribute as independent.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "policy_impl.h"

/* Work the validator may spend on its analysis, in condition terms
 * evaluated: label sets x origins x targets x (terms of every condition,
 * elements of set literals included, + one per rule). At about 150 million
 * terms a second, the budget is a third of a second at worst. */
#define ANALYSIS_BUDGET 50000000ull

/* Binds a wild request for a label mask and an origin site number. */
static void s_wild(const fi_policy *pol, uint32_t mask, size_t origin_site, p_req *rq) {
    memset(rq, 0, sizeof *rq);
    rq->wild = true;
    rq->origin = (int32_t)pol->sites[origin_site];
    rq->tenant = rq->application = rq->model = SYM_NONE;
    rq->latency = rq->prompt = -1;
    for (uint32_t l = 0; l < pol->n_labels; l++)
        if (mask >> l & 1) rq->labels[rq->n_labels++] = pol->labels[l];
    if (!rq->n_labels && pol->default_label != SYM_NONE) rq->labels[rq->n_labels++] = pol->default_label;
    /* sort (at most 16) */
    for (uint32_t i = 1; i < rq->n_labels; i++)
        for (uint32_t j = i; j > 0 && rq->labels[j - 1] > rq->labels[j]; j--) {
            uint32_t x = rq->labels[j];
            rq->labels[j] = rq->labels[j - 1];
            rq->labels[j - 1] = x;
        }
}

/* A request without labels under a policy that declares labels but names
 * no default_label is refused (p_bind), whatever the rules say. */
static bool s_unlabeled_refused(const fi_policy *pol, uint32_t mask) {
    return !mask && pol->n_labels && pol->default_label == SYM_NONE;
}

fi_flow fi_policy_flow(const fi_policy *pol, uint32_t label_mask, size_t origin_site, size_t target, char *why,
                       size_t why_cap) {
    if (why && why_cap) why[0] = 0;
    if (origin_site >= pol->n_sites || target >= pol->n_targets) return FI_FLOW_DENY;
    if (s_unlabeled_refused(pol, label_mask)) {
        if (why && why_cap) snprintf(why, why_cap, "no labels and no default_label");
        return FI_FLOW_DENY;
    }
    p_req rq;
    s_wild(pol, label_mask, origin_site, &rq);
    p_ctx c = {pol, &rq, (uint32_t)target, NULL, 0};
    int def_forbid = -1, pos_forbid = -1, def_permit = -1, pos_permit = -1;
    for (uint32_t r = 0; r < pol->n_rules; r++) {
        const p_rule *ru = &pol->rules[r];
        if (ru->effect == FI_PREFER) continue;
        uint8_t m = p_eval_rule(&c, ru);
        if (ru->effect == FI_FORBID) {
            if (!(m & B_F) && def_forbid < 0) def_forbid = (int)r;
            if ((m & (B_T | B_E)) && pos_forbid < 0) pos_forbid = (int)r;
        } else {
            if (m == B_T && def_permit < 0) def_permit = (int)r;
            if ((m & B_T) && pos_permit < 0) pos_permit = (int)r;
        }
        if (def_forbid >= 0) break;
    }
    fi_flow f;
    int why_rule;
    if (def_forbid >= 0) {
        f = FI_FLOW_DENY;
        why_rule = def_forbid;
    } else if (pos_permit < 0) {
        f = FI_FLOW_DENY;
        why_rule = -1;
    } else if (pos_forbid < 0 && def_permit >= 0) {
        f = FI_FLOW_ALLOW;
        why_rule = def_permit;
    } else {
        f = FI_FLOW_MAYBE;
        why_rule = pos_forbid >= 0 ? pos_forbid : pos_permit;
    }
    if (why && why_cap && why_rule >= 0) snprintf(why, why_cap, "%s", p_str(pol, pol->rules[why_rule].id));
    return f;
}

static const char *s_flow_word(fi_flow f) { return f == FI_FLOW_ALLOW ? "yes" : f == FI_FLOW_DENY ? "no" : "maybe"; }

/* The outcome one would expect of a label set from its single labels;
 * single[l] is the flow of label l alone for this origin and target. */
static fi_flow s_combine(const fi_policy *pol, uint32_t mask, const uint8_t *single) {
    bool all_allow = true;
    for (uint32_t l = 0; l < pol->n_labels; l++) {
        if (!(mask >> l & 1)) continue;
        fi_flow f = (fi_flow)single[l];
        if (f == FI_FLOW_DENY) return FI_FLOW_DENY;
        if (f != FI_FLOW_ALLOW) all_allow = false;
    }
    return all_allow ? FI_FLOW_ALLOW : FI_FLOW_MAYBE;
}

static void s_mask_text(const fi_policy *pol, uint32_t mask, char *buf, size_t cap) {
    size_t k = 0;
    buf[0] = 0;
    if (!mask) {
        snprintf(buf, cap, "(no labels)");
        return;
    }
    for (uint32_t l = 0; l < pol->n_labels && k < cap; l++)
        if (mask >> l & 1) k += (size_t)snprintf(buf + k, cap - k, "%s%s", k ? "," : "", p_str(pol, pol->labels[l]));
}

void fi_policy_flows_print(const fi_policy *pol, bool all, FILE *out) {
    uint32_t nsets = 1u << pol->n_labels;
    fprintf(out, "flows: %u origin sites x %u targets x %u label sets (every subset of %u declared labels",
            pol->n_sites, pol->n_targets, nsets, pol->n_labels);
    if (pol->default_label != SYM_NONE)
        fprintf(out, "; no labels means the default label \"%s\"", p_str(pol, pol->default_label));
    else if (s_unlabeled_refused(pol, 0))
        fprintf(out, "; no labels is refused: there is no default_label");
    fprintf(out, ")\n");
    fprintf(out, "yes: always permitted; no: never; maybe: depends on tenant, application, model, latency or prompt size\n\n");
    size_t wo = 6, wt = 6;
    for (uint32_t i = 0; i < pol->n_sites; i++) {
        size_t l = strlen(p_str(pol, pol->ents[pol->sites[i]].name));
        if (l > wo) wo = l;
    }
    for (uint32_t i = 0; i < pol->n_targets; i++) {
        size_t l = strlen(p_str(pol, pol->ents[pol->targets[i]].name));
        if (l > wt) wt = l;
    }
    fprintf(out, "%-*s  %-*s", (int)wo, "origin", (int)wt, "target");
    for (uint32_t l = 0; l < pol->n_labels; l++) fprintf(out, "  %-5s", p_str(pol, pol->labels[l]));
    fprintf(out, "\n");
    for (uint32_t o = 0; o < pol->n_sites; o++)
        for (uint32_t t = 0; t < pol->n_targets; t++) {
            fprintf(out, "%-*s  %-*s", (int)wo, p_str(pol, pol->ents[pol->sites[o]].name), (int)wt,
                    p_str(pol, pol->ents[pol->targets[t]].name));
            for (uint32_t l = 0; l < pol->n_labels; l++) {
                int w = (int)strlen(p_str(pol, pol->labels[l]));
                fprintf(out, "  %-*s", w < 5 ? 5 : w, s_flow_word(fi_policy_flow(pol, 1u << l, o, t, NULL, 0)));
            }
            fprintf(out, "\n");
        }
    /* Every other label set, checked; listed when it differs from what its
     * single labels suggest (all denied if one is, else all permitted). */
    unsigned exceptions = 0;
    size_t cells = (size_t)pol->n_sites * pol->n_targets;
    uint8_t *single = malloc(cells * FI_POLICY_MAX_LABELS + 1);
    if (!single) {
        fprintf(out, "\nout of memory: multi-label sets not checked\n");
        return;
    }
    for (uint32_t o = 0; o < pol->n_sites; o++)
        for (uint32_t t = 0; t < pol->n_targets; t++)
            for (uint32_t l = 0; l < pol->n_labels; l++)
                single[((size_t)o * pol->n_targets + t) * FI_POLICY_MAX_LABELS + l] =
                    (uint8_t)fi_policy_flow(pol, 1u << l, o, t, NULL, 0);
    for (uint32_t mask = 0; mask < nsets; mask++) {
        if (mask && !(mask & (mask - 1))) continue; /* single labels are in the table */
        for (uint32_t o = 0; o < pol->n_sites; o++)
            for (uint32_t t = 0; t < pol->n_targets; t++) {
                char why[128];
                const uint8_t *sg = single + ((size_t)o * pol->n_targets + t) * FI_POLICY_MAX_LABELS;
                fi_flow f = fi_policy_flow(pol, mask, o, t, why, sizeof why);
                fi_flow expect = mask ? s_combine(pol, mask, sg)
                                      : (pol->default_label != SYM_NONE
                                             ? (fi_flow)sg[pol->sym_label[pol->default_label]]
                                             : f);
                if (f == expect) continue;
                if (!exceptions++)
                    fprintf(out, "\nlabel sets whose outcome differs from their single labels' (all of them):\n");
                char ms[400];
                s_mask_text(pol, mask, ms, sizeof ms);
                fprintf(out, "  %s from %s to %s: %s%s%s%s\n", ms, p_str(pol, pol->ents[pol->sites[o]].name),
                        p_str(pol, pol->ents[pol->targets[t]].name), s_flow_word(f), why[0] ? " (" : "", why,
                        why[0] ? ")" : "");
            }
    }
    free(single);
    if (!exceptions)
        fprintf(out, "\nall %u label sets checked: each combination is permitted exactly where all of its labels are\n",
                nsets);
    if (all) {
        fprintf(out, "\nlabels\torigin\ttarget\tflow\trule\n");
        for (uint32_t mask = 0; mask < nsets; mask++)
            for (uint32_t o = 0; o < pol->n_sites; o++)
                for (uint32_t t = 0; t < pol->n_targets; t++) {
                    char why[128], ms[400];
                    fi_flow f = fi_policy_flow(pol, mask, o, t, why, sizeof why);
                    s_mask_text(pol, mask, ms, sizeof ms);
                    fprintf(out, "%s\t%s\t%s\t%s\t%s\n", ms, p_str(pol, pol->ents[pol->sites[o]].name),
                            p_str(pol, pol->ents[pol->targets[t]].name), s_flow_word(f), why);
                }
    }
}

/* ------------------------------------------------------------- validation */

/* The analysis's cost in condition terms evaluated (see ANALYSIS_BUDGET),
 * saturating at ULLONG_MAX: a rule's evaluation walks its condition, so a
 * few rules of thousands of terms cost as much as thousands of rules. */
static unsigned long long s_analysis_cost(const fi_policy *pol) {
    unsigned long long terms = pol->n_rules, cost = 1ull << pol->n_labels;
    for (uint32_t i = 0; i < pol->n_nodes; i++)
        terms += 1ull + (pol->nodes[i].op == OP_SET ? pol->nodes[i].lit.n : 0);
    if (__builtin_mul_overflow(cost, (unsigned long long)pol->n_sites, &cost) ||
        __builtin_mul_overflow(cost, (unsigned long long)pol->n_targets, &cost) ||
        __builtin_mul_overflow(cost, terms, &cost))
        return ULLONG_MAX;
    return cost;
}

void p_analyse(const fi_policy *pol, fi_diags *d) {
    uint32_t nsets = 1u << pol->n_labels;
    unsigned long long cost = s_analysis_cost(pol);
    if (!pol->n_rules) return;
    if (!pol->n_sites || !pol->n_targets) {
        p_diag(d, FI_DIAG_WARNING, 0, 0, "declare at least one site and one target",
               "the policy has no %s, so every request is denied", !pol->n_sites ? "sites" : "targets");
        return;
    }
    if (cost > ANALYSIS_BUDGET) {
        p_diag(d, FI_DIAG_WARNING, 0, 0, "use fewer labels or sites to get the full analysis",
               "rule analysis skipped: %llu condition terms to evaluate exceed the budget of %llu", cost,
               ANALYSIS_BUDGET);
        return;
    }
    uint32_t R = pol->n_rules, T = pol->n_targets;
    uint8_t *u = calloc(R, 1);            /* union of outcomes per rule */
    uint8_t *ut = calloc((size_t)R * T, 1); /* union per rule and target */
    uint8_t *maybe_shadow = malloc(R);    /* permit: every possible match is definitely forbidden */
    int *shadower = malloc(R * sizeof(int));
    uint8_t *m = malloc(R);
    if (!u || !ut || !maybe_shadow || !shadower || !m) {
        p_diag(d, FI_DIAG_WARNING, 0, 0, NULL, "rule analysis skipped: out of memory");
        goto done;
    }
    memset(maybe_shadow, 1, R);
    for (uint32_t r = 0; r < R; r++) shadower[r] = -1;
    for (uint32_t mask = s_unlabeled_refused(pol, 0) ? 1 : 0; mask < nsets; mask++)
        for (uint32_t o = 0; o < pol->n_sites; o++) {
            p_req rq;
            s_wild(pol, mask, o, &rq);
            for (uint32_t t = 0; t < T; t++) {
                p_ctx c = {pol, &rq, t, NULL, 0};
                int def_forbid = -1;
                for (uint32_t r = 0; r < R; r++) {
                    m[r] = p_eval_rule(&c, &pol->rules[r]);
                    u[r] |= m[r];
                    ut[(size_t)r * T + t] |= m[r];
                    if (pol->rules[r].effect == FI_FORBID && !(m[r] & B_F) && def_forbid < 0) def_forbid = (int)r;
                }
                for (uint32_t r = 0; r < R; r++) {
                    if (pol->rules[r].effect != FI_PERMIT || !(m[r] & B_T)) continue;
                    if (def_forbid < 0) maybe_shadow[r] = 0;
                    else if (shadower[r] < 0) shadower[r] = def_forbid;
                }
            }
        }
    for (uint32_t r = 0; r < R; r++) {
        const p_rule *ru = &pol->rules[r];
        const char *id = p_str(pol, ru->id);
        const char *kw = ru->effect == FI_FORBID ? "forbid" : ru->effect == FI_PERMIT ? "permit" : "prefer";
        bool can = ru->effect == FI_FORBID ? (u[r] & (B_T | B_E)) != 0 : (u[r] & B_T) != 0;
        if (!can) {
            p_diag(d, FI_DIAG_WARNING, ru->line, ru->col,
                   "check the names and values in the condition against the topology and labels",
                   "%s \"%s\" can never match: its condition is false for every label set, origin and target", kw, id);
            continue;
        }
        if (ru->effect == FI_PERMIT && maybe_shadow[r] && shadower[r] >= 0) {
            char hint[200];
            snprintf(hint, sizeof hint, "a matching forbid always wins; narrow forbid \"%s\" or remove this permit",
                     p_str(pol, pol->rules[shadower[r]].id));
            p_diag(d, FI_DIAG_WARNING, ru->line, ru->col, hint,
                   "permit \"%s\" is entirely shadowed: wherever it matches, a forbid matches too", id);
            continue;
        }
        /* Targets for which the condition is an error whatever the request. */
        char names[200] = "";
        size_t k = 0;
        unsigned cnt = 0;
        for (uint32_t t = 0; t < T; t++)
            if (ut[(size_t)r * T + t] == B_E) {
                if (cnt++ < 4 && k < sizeof names)
                    k += (size_t)snprintf(names + k, sizeof names - k, "%s%s", k ? ", " : "",
                                          p_str(pol, pol->ents[pol->targets[t]].name));
            }
        if (cnt) {
            char hint[300];
            snprintf(hint, sizeof hint,
                     "a condition that cannot be evaluated (missing attribute) makes a forbid match and a "
                     "permit or prefer not; guard it with `target has ATTRIBUTE` if that is not meant");
            p_diag(d, FI_DIAG_WARNING, ru->line, ru->col, hint,
                   "%s \"%s\" cannot be evaluated for %s%s, so it %s there", kw, id, names, cnt > 4 ? " and others" : "",
                   ru->effect == FI_FORBID ? "always matches" : "never matches");
        }
    }
done:
    free(u);
    free(ut);
    free(maybe_shadow);
    free(shadower);
    free(m);
}
