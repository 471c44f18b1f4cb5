/*
 * policy_impl.h - the policy's private representation, shared by the
 * parser (policy_parse.c), the validator and compiler (policy_check.c), the
 * evaluator (policy_eval.c) and the flow analysis (policy_flows.c).
 *
 * Every string of a policy (names, attribute values, literals, rule ids) is
 * interned once as a symbol, a dense uint32 index; comparisons at run time
 * are integer comparisons. Sets are sorted runs of symbols in one pool.
 */
#ifndef FI_POLICY_IMPL_H
#define FI_POLICY_IMPL_H

#include "fi_policy.h"

#define SYM_NONE 0xFFFFFFFFu    /* absent value */
#define SYM_UNKNOWN 0xFFFFFFFEu /* a request string the policy does not know */
#define NODE_NONE 0xFFFFFFFFu
#define SLOT_NONE 0xFFFFFFFFu
#define SLOT_CAP 1024 /* cached distinct conjuncts per class; more are evaluated uncached */

/* Entity kinds of the topology. */
enum { EK_JUR = 0, EK_REGION = 1, EK_SITE = 2, EK_CLUSTER = 3 };

/* Value types of the language. VT_LOC is a string that names an entity. */
enum { VT_NONE = 0, VT_BOOL, VT_NUM, VT_STR, VT_SET, VT_LOC, VT_ERR };

/* Operators of condition nodes. */
enum {
    OP_TRUE = 0, OP_FALSE, OP_NUM, OP_STR, OP_SET, /* literals */
    OP_ATTR,                                         /* request.x / target.x */
    OP_TARGET,                                       /* bare `target` (for within) */
    OP_NOT, OP_AND, OP_OR,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE,
    OP_IN, OP_WITHIN, OP_HAS
};

/* Attribute scopes and built-in attributes. */
enum { SC_REQ = 1, SC_TGT = 2 };
enum {
    RA_TENANT = 0, RA_APPLICATION, RA_MODEL, RA_LABELS, RA_ORIGIN_SITE, RA_ORIGIN_REGION,
    RA_ORIGIN_JUR, RA_LATENCY, RA_PROMPT, RA_COUNT
};
enum { TA_KIND = 0, TA_NAME, TA_SITE, TA_REGION, TA_JUR, TA_USER /* + user attribute index */ };

/* Dependence of a node on the request and on the target (bit mask). */
enum { DEP_REQ = 1, DEP_TGT = 2 };

/* Three-valued results as bit masks; the flow analysis uses sets of them. */
enum { B_T = 1, B_F = 2, B_E = 4 };

typedef struct p_value {
    uint8_t type;   /* VT_* ; VT_NONE = absent */
    int64_t num;    /* VT_NUM, VT_BOOL (0/1) */
    uint32_t sym;   /* VT_STR, VT_LOC */
    uint32_t off;   /* VT_SET: first element in pool */
    uint32_t n;     /* VT_SET: elements */
} p_value;

typedef struct p_entity {
    uint32_t name;   /* symbol */
    uint8_t kind;    /* EK_* */
    int32_t parent;  /* entity index; -1 for a top-level jurisdiction */
    int32_t target;  /* target index for sites and clusters, else -1 */
    int32_t region;  /* enclosing region (sites, clusters; self for regions), else -1 */
    int32_t jur;     /* innermost jurisdiction (self for jurisdictions) */
    unsigned line;   /* where declared */
    unsigned col;
} p_entity;

typedef struct p_attrdef {
    uint32_t name;  /* symbol */
    uint8_t type;   /* VT_* of every value */
    unsigned line;  /* first declaration */
    unsigned col;
} p_attrdef;

/* An attribute assignment in an entity block, kept until compile. */
typedef struct p_assign {
    uint32_t ent;   /* entity index */
    uint32_t name;  /* attribute symbol */
    p_value val;    /* the literal */
    unsigned line;
    unsigned col;
} p_assign;

typedef struct p_node {
    uint8_t op;      /* OP_* */
    uint8_t type;    /* VT_* after checking */
    uint8_t dep;     /* DEP_* after checking */
    uint8_t scope;   /* OP_ATTR/OP_HAS: SC_REQ or SC_TGT */
    uint32_t attr;   /* OP_ATTR/OP_HAS: RA_* or TA_*; before checking, the path symbols */
    uint32_t path2;  /* before checking: second path symbol (request.origin.X) or SYM_NONE */
    uint32_t a;      /* first operand (node index) */
    uint32_t b;      /* second operand */
    p_value lit;     /* literals */
    unsigned line;
    unsigned col;
} p_node;

typedef struct p_rule {
    uint32_t id;       /* symbol of the rule id */
    uint8_t effect;    /* fi_effect */
    int64_t score;     /* prefer only */
    uint32_t cond;     /* root node, NODE_NONE = always */
    uint32_t conj;     /* first conjunct in fi_policy.conj */
    uint16_t n_rq;     /* conjuncts depending on the request only (or nothing) */
    uint16_t n_tg;     /* then on the target only */
    uint16_t n_mx;     /* then on both */
    unsigned line;
    unsigned col;
} p_rule;

struct fi_diags {
    fi_diag *v;  /* sorted by line, col */
    size_t n;    /* used */
    size_t cap;  /* allocated */
};

struct fi_policy {
    uint8_t digest[FI_POLICY_DIGEST_BYTES]; /* SHA-256 of the source */
    int64_t expires;                         /* Unix seconds; 0 = never */
    unsigned expires_line;                   /* where `expires` was (0: absent) */

    char *strs;          /* symbol text, NUL-separated */
    size_t strs_len;     /* used bytes */
    size_t strs_cap;     /* allocated */
    uint32_t *sym_off;   /* symbol -> offset in strs */
    uint32_t n_syms;
    uint32_t cap_syms;
    uint32_t *hash;      /* open addressing: symbol + 1, 0 = empty */
    uint32_t hash_cap;   /* power of two */
    int32_t *sym_ent;    /* symbol -> entity index or -1 (after build) */
    int32_t *sym_label;  /* symbol -> label index or -1 (after build) */
    uint32_t sym_kind[2]; /* symbols "site" and "cluster" (target.kind values) */

    uint32_t labels[FI_POLICY_MAX_LABELS]; /* label symbols in declaration order */
    unsigned label_line[FI_POLICY_MAX_LABELS];
    uint32_t n_labels;
    unsigned labels_line;                  /* the first labels statement; 0: none */
    unsigned labels_col;
    uint32_t default_label;                /* symbol or SYM_NONE */
    unsigned default_line;
    unsigned default_col;

    p_entity *ents;
    uint32_t n_ents;
    uint32_t cap_ents;
    uint32_t *targets;   /* target index -> entity index */
    uint32_t n_targets;
    uint32_t *sites;     /* site number -> entity index */
    uint32_t n_sites;

    p_attrdef *attrs;    /* user target attributes */
    uint32_t n_attrs;
    uint32_t cap_attrs;
    p_value *tvals;      /* [n_targets][n_attrs]; VT_NONE = absent */
    p_assign *assigns;   /* parse-time assignments */
    uint32_t n_assigns;
    uint32_t cap_assigns;

    uint32_t *pool;      /* set elements (symbols), sorted per set */
    uint32_t n_pool;
    uint32_t cap_pool;

    p_node *nodes;
    uint32_t n_nodes;
    uint32_t cap_nodes;
    p_rule *rules;
    uint32_t n_rules;
    uint32_t cap_rules;
    uint32_t *conj;      /* conjunct node indices, per rule: rq, tg, mx */
    uint32_t *conj_slot; /* per conjunct: cache slot shared by structurally equal
                            conjuncts (request-only and mixed ones), or SLOT_NONE */
    uint32_t n_conj;
    uint32_t n_rq_slots; /* distinct request-only conjuncts (<= SLOT_CAP) */
    uint32_t n_mx_slots; /* distinct mixed conjuncts (<= SLOT_CAP) */

    /* Compiled masks over rules (words = ceil(n_rules / 64)). */
    uint32_t words;
    uint64_t *m_forbid;  /* [words] forbid rules */
    uint64_t *m_permit;  /* [words] permit rules */
    uint64_t *m_prefer;  /* [words] prefer rules */
    uint64_t *m_mixed;   /* [words] rules with conjuncts on request and target */
    uint64_t *m_all;     /* [words] every rule */
    uint64_t *tg_t;      /* [n_targets][words] target-only conjuncts all true */
    uint64_t *tg_f;      /* [n_targets][words] some target-only conjunct false */
};

/* The request bound to the policy's symbols; lives on the caller's stack. */
typedef struct p_req {
    int32_t origin;                             /* entity index of the site */
    uint32_t tenant;                            /* symbol, SYM_NONE or SYM_UNKNOWN */
    uint32_t application;
    uint32_t model;
    const char *tenant_s;                       /* the caller's strings */
    const char *application_s;
    const char *model_s;
    int64_t latency;                            /* < 0: absent */
    int64_t prompt;                             /* < 0: absent */
    uint32_t labels[FI_POLICY_MAX_REQ_LABELS];  /* sorted label symbols */
    uint32_t n_labels;
    bool wild;                                  /* flows: optional attributes are unknown */
} p_req;

/* Evaluation context. */
typedef struct p_ctx {
    const fi_policy *pol;
    const p_req *req;
    uint32_t target;       /* target index */
    char *err;             /* when not NULL: the first error's description */
    size_t err_cap;
} p_ctx;

/* policy_parse.c */
uint32_t p_intern(fi_policy *pol, const char *s, size_t len); /* SYM_NONE on OOM */
uint32_t p_lookup(const fi_policy *pol, const char *s);        /* SYM_UNKNOWN if absent */
const char *p_str(const fi_policy *pol, uint32_t sym);
void p_diag(fi_diags *d, fi_diag_level lv, unsigned line, unsigned col, const char *hint,
            const char *fmt, ...) __attribute__((format(printf, 6, 7)));
int p_parse(fi_policy *pol, const char *text, size_t len, fi_diags *d);
fi_policy *p_policy_new(void);

/* policy_check.c */
int p_check_and_compile(fi_policy *pol, fi_diags *d);
const char *p_attr_name(const fi_policy *pol, uint8_t scope, uint32_t attr);
const char *p_kind_name(uint8_t ek);

/* policy_eval.c */
int p_bind(const fi_policy *pol, const fi_request *r, p_req *out, uint8_t *bad);
uint8_t p_eval(const p_ctx *c, uint32_t node);
uint8_t p_eval_rule(const p_ctx *c, const p_rule *r);

/* policy_flows.c */
void p_analyse(const fi_policy *pol, fi_diags *d);

#endif /* FI_POLICY_IMPL_H */
