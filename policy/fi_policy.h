/*
 * fi_policy.h - the residency policy engine: parse, validate, compile and
 * evaluate a policy file; explain a decision; build the fail-closed
 * fallback decision.
 *
 * A policy file holds the topology (jurisdictions, regions, sites, clusters
 * and their attributes) and the rules (permit, forbid, prefer). The language
 * is described, with its EBNF, in policy/README.md.
 *
 * Lifetimes: fi_policy_parse()/fi_policy_load() return an owned, immutable
 * policy or NULL; fi_policy_destroy() frees it. A policy is never modified
 * after it is built, so one policy may be shared by any number of threads
 * that evaluate it at the same time.
 *
 * Semantics (the contract the fabric relies on):
 *   - default deny: a target is permitted only if some permit matches;
 *   - a matching forbid always wins over any permit;
 *   - prefer rules add their score to permitted targets (never permit);
 *   - errors block: a condition that cannot be evaluated (missing attribute)
 *     counts as matched for a forbid and as not matched for permit/prefer.
 *     and/or/not follow Kleene's three-valued logic with "error" as the
 *     unknown value: a condition is true (or false) only when it would be
 *     true (or false) whatever the unknown value is;
 *   - fi_policy_decide() allocates nothing and evaluates every candidate
 *     target in one call.
 */
#ifndef FI_POLICY_H
#define FI_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define FI_WUR __attribute__((warn_unused_result))
#else
#define FI_WUR
#endif

/* Limits of the language. Policies beyond them are refused with an error. */
#define FI_POLICY_MAX_LABELS 16     /* declared data labels (flows are 2^labels) */
#define FI_POLICY_MAX_RULES 4096    /* permit + forbid + prefer rules */
#define FI_POLICY_MAX_TARGETS 4096  /* sites + clusters */
#define FI_POLICY_MAX_ATTRS 256     /* distinct attribute names over all targets */
#define FI_POLICY_MAX_DEPTH 64      /* nesting of parentheses and `not` */
#define FI_POLICY_MAX_REQ_LABELS 64 /* labels carried by one request */
#define FI_VERDICT_MAX_RULES 4      /* rule ids kept per verdict (count is exact) */
#define FI_POLICY_DIGEST_BYTES 32   /* SHA-256 of the source text */

/* ---------------------------------------------------------------- diags */

typedef enum fi_diag_level { FI_DIAG_ERROR = 0, FI_DIAG_WARNING = 1 } fi_diag_level;

/* One diagnostic: where (1-based line and column; 0 when not tied to a
 * place), what, and an optional hint. */
typedef struct fi_diag {
    fi_diag_level level; /* error blocks use; warning does not */
    unsigned line;       /* 1-based; 0 = whole file */
    unsigned col;        /* 1-based; 0 = whole line */
    char msg[256];       /* what is wrong, and what was expected */
    char hint[256];      /* how to fix it; "" when none */
} fi_diag;

typedef struct fi_diags fi_diags;

/* Returns an owned, empty list, or NULL when out of memory. */
fi_diags *fi_diags_new(void);
void fi_diags_destroy(fi_diags **self_p);
size_t fi_diags_count(const fi_diags *self);
size_t fi_diags_errors(const fi_diags *self);
size_t fi_diags_warnings(const fi_diags *self);
/* The i-th diagnostic in file order (i < count); owned by the list. */
const fi_diag *fi_diags_get(const fi_diags *self, size_t i);
/* Writes every diagnostic as "file:line:col: error: msg" plus an indented
 * "hint: ..." line, in file order. */
void fi_diags_print(const fi_diags *self, const char *file, FILE *out);
/* The same text for diagnostic i, into buf (always NUL-terminated). */
void fi_diag_format(const fi_diag *d, const char *file, char *buf, size_t cap);

/* --------------------------------------------------------------- policy */

typedef struct fi_policy fi_policy;

typedef enum fi_target_kind { FI_TARGET_SITE = 0, FI_TARGET_CLUSTER = 1 } fi_target_kind;
typedef enum fi_effect { FI_PERMIT = 0, FI_FORBID = 1, FI_PREFER = 2 } fi_effect;

/* Parses, validates and compiles the policy text (len bytes, need not be
 * NUL-terminated). Diagnostics go to diags (may be NULL). Returns an owned
 * policy, or NULL when there is any error (a policy with errors is never
 * built, hence never applied). Warnings do not prevent building. */
fi_policy *fi_policy_parse(const char *text, size_t len, fi_diags *diags) FI_WUR;

/* Reads path and calls fi_policy_parse(). A file that cannot be read gives
 * one error diagnostic naming the path and the system's reason. */
fi_policy *fi_policy_load(const char *path, fi_diags *diags) FI_WUR;

/* Frees the policy and sets *self_p to NULL; safe on NULL. */
void fi_policy_destroy(fi_policy **self_p);

/* SHA-256 of the source text the policy was built from. */
const uint8_t *fi_policy_digest(const fi_policy *self);
/* The digest as 64 lowercase hex characters plus NUL into hex[65]. */
void fi_policy_digest_hex(const fi_policy *self, char hex[65]);

/* Expiry: Unix seconds, or 0 when none. From the `expires` statement,
 * or earlier where fi_policy_expire_by set it. */
int64_t fi_policy_expires(const fi_policy *self);
/* Makes the policy expire at `at` (Unix seconds, > 0) if it would not
 * expire sooner: a policy from a signed bundle stops at the bundle's
 * not-after (fi_bundle_load), so a holder that keeps it past then falls
 * back (fail closed) instead of enforcing it for good. */
void fi_policy_expire_by(fi_policy *self, int64_t at);
/* True when the policy may be enforced at time now (Unix seconds): it has
 * no expiry or now is before it. An edge whose policy is not current uses
 * fi_policy_fallback(). */
bool fi_policy_current(const fi_policy *self, int64_t now);

/* Topology and rules, for listing. Indices are dense and stable for the
 * lifetime of the policy; names are owned by the policy. */
size_t fi_policy_target_count(const fi_policy *self);
const char *fi_policy_target_name(const fi_policy *self, size_t i);
fi_target_kind fi_policy_target_kind(const fi_policy *self, size_t i);
/* Target index by name, or -1. */
int fi_policy_target_find(const fi_policy *self, const char *name);
size_t fi_policy_site_count(const fi_policy *self);
/* The i-th declared site (also a target; see fi_policy_target_find). */
const char *fi_policy_site_name(const fi_policy *self, size_t i);
/* The innermost jurisdiction that holds the site, cluster, region or
 * jurisdiction `name` (a jurisdiction holds itself): the residency zone
 * that salts cached state. NULL when the policy declares no such name. */
const char *fi_policy_jurisdiction(const fi_policy *self, const char *name);
size_t fi_policy_label_count(const fi_policy *self);
const char *fi_policy_label_name(const fi_policy *self, size_t i);
/* Label index by name, or -1. */
int fi_policy_label_find(const fi_policy *self, const char *name);
/* The default label applied to a request without labels; NULL when none. */
const char *fi_policy_default_label(const fi_policy *self);
size_t fi_policy_rule_count(const fi_policy *self);
const char *fi_policy_rule_id(const fi_policy *self, size_t i);
fi_effect fi_policy_rule_effect(const fi_policy *self, size_t i);

/* ------------------------------------------------------------- requests */

/* A request as the fabric sees it. Strings are borrowed for the call.
 * origin_site is set by the fabric from the authenticated peer, never from
 * the client; its region and jurisdiction are taken from the policy's
 * topology. NULL strings and negative numbers mean "absent". */
typedef struct fi_request {
    const char *request_id;    /* for the audit log; not seen by rules */
    const char *tenant;        /* request.tenant */
    const char *application;   /* request.application */
    const char *origin_site;   /* request.origin.site (required) */
    const char *model;         /* request.model */
    const char *const *labels; /* request.labels; none: the default label */
    size_t n_labels;           /* entries in labels */
    int64_t latency_ms;        /* request.latency_ms; < 0: absent */
    int64_t prompt_tokens;     /* request.prompt_tokens; < 0: absent */
} fi_request;

/* Why a target was decided as it was. */
typedef enum fi_cause {
    FI_CAUSE_PERMIT = 0,       /* permitted: rules[] are the matching permits */
    FI_CAUSE_FORBID = 1,       /* denied: rules[] are the matching forbids */
    FI_CAUSE_DEFAULT_DENY = 2, /* denied: no permit matched */
    FI_CAUSE_BAD_REQUEST = 3,  /* denied: origin or a label unknown to the policy, or no labels
                                  where the policy declares labels but no default_label (fi_bad) */
    FI_CAUSE_FALLBACK = 4,     /* no usable policy: only the origin site */
    FI_CAUSE_UNKNOWN_TARGET = 5 /* fi_policy_decide_names: target not in the policy */
} fi_cause;

/* What made a request bad (FI_CAUSE_BAD_REQUEST). */
typedef enum fi_bad {
    FI_BAD_NONE = 0,            /* not a bad request (or bad target indices) */
    FI_BAD_ORIGIN = 1,          /* the origin site is not a site of the policy */
    FI_BAD_LABEL = 2,           /* a label the policy does not declare */
    FI_BAD_TOO_MANY_LABELS = 3, /* more than FI_POLICY_MAX_REQ_LABELS labels */
    FI_BAD_NO_LABELS = 4        /* no labels, and the policy declares labels but no default_label */
} fi_bad;

/* The decision for one candidate target. */
typedef struct fi_verdict {
    uint32_t target;                      /* target index (fallback: index in the caller's list) */
    bool permitted;                       /* may process the request */
    uint8_t cause;                        /* fi_cause */
    uint8_t bad;                          /* fi_bad: what was wrong when cause is FI_CAUSE_BAD_REQUEST */
    uint16_t n_rules;                     /* matching rules of the deciding kind (exact) */
    uint16_t rules[FI_VERDICT_MAX_RULES]; /* the first of them, in file order */
    uint8_t rule_errored;                 /* bit i: rules[i] matched because it could not be evaluated */
    uint16_t n_prefer;                    /* prefer rules that added to score (exact) */
    uint16_t prefer[FI_VERDICT_MAX_RULES]; /* the first of them, in file order */
    int64_t score;                        /* sum of matching prefer scores (permitted only) */
} fi_verdict;

/* Decides the request for n candidate targets (indices from
 * fi_policy_target_find; targets == NULL means every target, and then n
 * must be fi_policy_target_count()). Writes out[0..n). Never allocates and
 * never fails for bad request data: an unknown origin site or label, or a
 * request without labels when the policy declares labels but names no
 * default_label, denies every target with FI_CAUSE_BAD_REQUEST (and says
 * which in the verdicts' bad). Returns 0, or -1 when a target
 * index is out of range, targets is NULL and n is not the target count
 * (out[0..n) are then all denied), or n exceeds FI_POLICY_MAX_TARGETS (out
 * is not written). Does not look at expiry; see fi_policy_current(). */
int fi_policy_decide(const fi_policy *self, const fi_request *req, const uint32_t *targets, size_t n,
                     fi_verdict *out) FI_WUR;

/* The reference evaluator: same contract and results as fi_policy_decide,
 * evaluating each rule's whole condition for each target (no compiled
 * masks). Slower; used by tests as an oracle and by `explain`. */
int fi_policy_decide_slow(const fi_policy *self, const fi_request *req, const uint32_t *targets,
                          size_t n, fi_verdict *out) FI_WUR;

/* Index in out[0..n) of the target the router should take: the permitted
 * one with the highest score, the first on ties; -1 when none is. */
int fi_verdict_best(const fi_verdict *out, size_t n);

/* One line into buf, e.g. `denied fra-gpu-1: forbid "phi stays on site"`,
 * `permitted fra-gpu-1: permit "public anywhere"; score 10 (prefer "cheap")`,
 * `denied x: no permit matched (default deny)`. name is the target's name
 * (NULL: taken from the policy). Always NUL-terminates. */
void fi_verdict_explain(const fi_policy *self, const fi_verdict *v, const char *name, char *buf,
                        size_t cap);

/* For `explain`: why rule `rule` gave its result for (req, target): writes
 * "true", "false" or "error: <what could not be evaluated>" into buf. */
void fi_policy_rule_trace(const fi_policy *self, const fi_request *req, uint32_t target,
                          size_t rule, char *buf, size_t cap);

/* Fail closed: the decision when there is no valid policy (none, bad
 * signature, expired). Only a target of kind site whose name equals
 * origin_site is permitted; out[i].target = i. */
void fi_policy_fallback(const char *origin_site, const char *const *names,
                        const fi_target_kind *kinds, size_t n, fi_verdict *out);

/* The edge's and coordinator's one entry point, which always fails closed:
 * candidates given by name and kind; pol may be NULL (no valid policy).
 * When pol is NULL or not current at now, this is fi_policy_fallback().
 * Otherwise it is fi_policy_decide() over the named targets; a name the
 * policy does not know, or whose kind differs from the policy's, is denied
 * (FI_CAUSE_UNKNOWN_TARGET). out[i].target is always i (the caller's index),
 * so pass names[i] to fi_verdict_explain. Allocates nothing. */
void fi_policy_decide_names(const fi_policy *pol, int64_t now, const fi_request *req, const char *const *names,
                            const fi_target_kind *kinds, size_t n, fi_verdict *out);

/* ---------------------------------------------------------------- flows */

typedef enum fi_flow { FI_FLOW_DENY = 0, FI_FLOW_ALLOW = 1, FI_FLOW_MAYBE = 2 } fi_flow;

/* Exhaustive flow analysis of one (label set, origin site, target): the
 * label set is a bit mask over the declared labels (0 = the default label).
 * ALLOW and DENY hold for every value of the other request attributes
 * (tenant, application, model, latency, prompt size, including absent);
 * MAYBE means the outcome depends on them. When why is not NULL it gets
 * the id of a deciding rule or "" (why_cap bytes). */
fi_flow fi_policy_flow(const fi_policy *self, uint32_t label_mask, size_t origin_site,
                       size_t target, char *why, size_t why_cap);

/* Prints the flow matrix (see policy/README.md, "Flows"); all = also every
 * (label set, origin, target) row as tab-separated values. */
void fi_policy_flows_print(const fi_policy *self, bool all, FILE *out);

#ifdef __cplusplus
}
#endif
#endif /* FI_POLICY_H */
