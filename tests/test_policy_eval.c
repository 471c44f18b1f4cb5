/*
 * test_policy_eval.c - the evaluator: every operator, precedence, Kleene
 * error semantics (errors block), forbid over permit, default deny,
 * preference scores, nesting, bad requests, explanations, the fail-closed
 * fallback, expiry, and the compiled decision against the reference
 * evaluator on many requests.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fi_policy.h"
#include "fi_policy_cmd.h"

static const char *TOPO =
    "labels public, internal, pii, phi;\n"
    "default_label \"internal\";\n"
    "jurisdiction EU;\n"
    "jurisdiction DE in EU;\n"
    "jurisdiction BY in DE;\n"
    "jurisdiction FR in EU;\n"
    "jurisdiction US;\n"
    "region de-r in BY;\n"
    "region fr-r in FR;\n"
    "region us-r in US;\n"
    "site s-de in de-r { tier = \"clinic\"; }\n"
    "site s-fr in fr-r;\n"
    "site s-us in us-r;\n"
    "cluster c-de in de-r { cost = 3; gpu = \"h200\"; certifications = [\"iso\"]; models = [\"m1\"]; }\n"
    "cluster c-us in us-r { cost = 1; gpu = \"a100\"; certifications = [\"soc2\", \"pci-dss\"]; models = [\"m1\", \"m2\"]; }\n"
    "cluster c-bare in fr-r;\n";

static fi_policy *s_build(const char *rules) {
    size_t n = strlen(TOPO) + strlen(rules) + 1;
    char *text = malloc(n);
    assert_non_null(text);
    snprintf(text, n, "%s%s", TOPO, rules);
    fi_diags *d = fi_diags_new();
    fi_policy *pol = fi_policy_parse(text, strlen(text), d);
    if (!pol || fi_diags_errors(d)) {
        fprintf(stderr, "policy:\n%s\n", rules);
        fi_diags_print(d, "test", stderr);
    }
    fi_diags_destroy(&d);
    free(text);
    assert_non_null(pol);
    return pol;
}

typedef struct req_spec {
    const char *origin;
    const char *labels; /* comma-separated; "" none */
    const char *model;
    int64_t latency;
    int64_t prompt;
    const char *tenant;
} req_spec;

/* Decides for one target by name, with both evaluators; checks they agree. */
static fi_verdict s_decide(const fi_policy *pol, const req_spec *rs, const char *target) {
    char buf[256];
    const char *labels[16];
    size_t nl = 0;
    snprintf(buf, sizeof buf, "%s", rs->labels ? rs->labels : "");
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) labels[nl++] = t;
    fi_request r = {"t", rs->tenant, NULL, rs->origin, rs->model, labels, nl, rs->latency, rs->prompt};
    int t = fi_policy_target_find(pol, target);
    assert_true(t >= 0);
    uint32_t idx = (uint32_t)t;
    fi_verdict a, b;
    assert_int_equal(fi_policy_decide(pol, &r, &idx, 1, &a), 0);
    assert_int_equal(fi_policy_decide_slow(pol, &r, &idx, 1, &b), 0);
    assert_int_equal(a.permitted, b.permitted);
    assert_int_equal(a.cause, b.cause);
    assert_int_equal(a.n_rules, b.n_rules);
    assert_int_equal(a.rule_errored, b.rule_errored);
    assert_true(a.score == b.score);
    return a;
}

/* The outcome of COND for (request, target): 'T', 'F' or 'E', observed
 * through a permit (permitted only when true) and a forbid (denies when
 * true or error). */
static char s_outcome(const char *cond, const req_spec *rs, const char *target) {
    char rules[1024];
    snprintf(rules, sizeof rules, "permit \"p\" when %s;\n", cond);
    fi_policy *p = s_build(rules);
    fi_verdict vp = s_decide(p, rs, target);
    fi_policy_destroy(&p);
    snprintf(rules, sizeof rules, "permit \"all\";\nforbid \"f\" when %s;\n", cond);
    fi_policy *f = s_build(rules);
    fi_verdict vf = s_decide(f, rs, target);
    fi_policy_destroy(&f);
    if (vp.permitted) {
        assert_false(vf.permitted);
        assert_int_equal(vf.rule_errored, 0);
        return 'T';
    }
    if (vf.permitted) return 'F';
    assert_int_equal(vf.cause, FI_CAUSE_FORBID);
    assert_int_equal(vf.rule_errored & 1, 1); /* denied because it could not be evaluated */
    return 'E';
}

typedef struct row {
    const char *cond;
    req_spec rq;
    const char *target;
    char want;
} row;

#define R(o, l, m, lat, pr) {o, l, m, lat, pr, NULL}

static const row ROWS[] = {
    /* == and != on strings, absent attributes are errors */
    {"target.gpu == \"h200\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.gpu == \"h200\"", R("s-de", "", NULL, -1, -1), "c-us", 'F'},
    {"target.gpu == \"h200\"", R("s-de", "", NULL, -1, -1), "c-bare", 'E'},
    {"target.gpu == \"h200\"", R("s-de", "", NULL, -1, -1), "s-de", 'E'},
    {"target.gpu != \"h200\"", R("s-de", "", NULL, -1, -1), "c-us", 'T'},
    {"target.gpu != \"h200\"", R("s-de", "", NULL, -1, -1), "c-bare", 'E'},
    {"target.kind == \"cluster\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.kind == \"site\"", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"target.name == \"c-us\"", R("s-de", "", NULL, -1, -1), "c-us", 'T'},
    {"target.site == request.origin.site", R("s-de", "", NULL, -1, -1), "s-de", 'T'},
    {"target.site == request.origin.site", R("s-fr", "", NULL, -1, -1), "s-de", 'F'},
    {"target.site == request.origin.site", R("s-de", "", NULL, -1, -1), "c-de", 'E'},
    {"target.region == request.origin.region", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.jurisdiction == \"BY\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.jurisdiction == \"DE\"", R("s-de", "", NULL, -1, -1), "c-de", 'F'}, /* exact; within nests */
    {"request.model == \"m1\"", R("s-de", "", "m1", -1, -1), "c-de", 'T'},
    {"request.model == \"m1\"", R("s-de", "", "unknown-model", -1, -1), "c-de", 'F'},
    {"request.model == \"m1\"", R("s-de", "", NULL, -1, -1), "c-de", 'E'},
    {"request.labels == [\"pii\", \"public\"]", R("s-de", "public,pii", NULL, -1, -1), "c-de", 'T'},
    {"request.labels == [\"pii\"]", R("s-de", "public,pii", NULL, -1, -1), "c-de", 'F'},
    /* numbers */
    {"target.cost < 2", R("s-de", "", NULL, -1, -1), "c-us", 'T'},
    {"target.cost < 2", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"target.cost <= 3", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.cost > 2", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.cost >= 4", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"request.prompt_tokens > 100", R("s-de", "", NULL, -1, 500), "c-de", 'T'},
    {"request.prompt_tokens > 100", R("s-de", "", NULL, -1, 50), "c-de", 'F'},
    {"request.prompt_tokens > 100", R("s-de", "", NULL, -1, -1), "c-de", 'E'},
    {"request.latency_ms >= 100", R("s-de", "", NULL, 100, -1), "c-de", 'T'},
    {"request.latency_ms < -5", R("s-de", "", NULL, 0, -1), "c-de", 'F'},
    /* sets: subset, superset, membership */
    {"request.labels <= [\"public\", \"pii\"]", R("s-de", "pii", NULL, -1, -1), "c-de", 'T'},
    {"request.labels <= [\"public\", \"pii\"]", R("s-de", "pii,phi", NULL, -1, -1), "c-de", 'F'},
    {"request.labels <= [\"public\"]", R("s-de", "", NULL, -1, -1), "c-de", 'F'}, /* default label internal */
    {"target.certifications >= [\"soc2\", \"pci-dss\"]", R("s-de", "", NULL, -1, -1), "c-us", 'T'},
    {"target.certifications >= [\"soc2\", \"pci-dss\"]", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"\"pii\" in request.labels", R("s-de", "public,pii", NULL, -1, -1), "c-de", 'T'},
    {"\"phi\" in request.labels", R("s-de", "public,pii", NULL, -1, -1), "c-de", 'F'},
    {"\"internal\" in request.labels", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.gpu in [\"h200\", \"h100\"]", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.gpu in [\"h200\", \"h100\"]", R("s-de", "", NULL, -1, -1), "c-us", 'F'},
    {"request.model in target.models", R("s-de", "", "m2", -1, -1), "c-us", 'T'},
    {"request.model in target.models", R("s-de", "", "m2", -1, -1), "c-de", 'F'},
    {"request.model in target.models", R("s-de", "", NULL, -1, -1), "c-de", 'E'},
    {"request.model in target.models", R("s-de", "", "m1", -1, -1), "c-bare", 'E'},
    {"target.region in [\"de-r\", \"fr-r\"]", R("s-de", "", NULL, -1, -1), "c-bare", 'T'},
    /* within: nesting */
    {"target within \"EU\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'}, /* de-r in BY in DE in EU */
    {"target within \"DE\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target within \"BY\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target within \"de-r\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target within \"c-de\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target within \"EU\"", R("s-de", "", NULL, -1, -1), "c-us", 'F'},
    {"target within \"DE\"", R("s-de", "", NULL, -1, -1), "s-fr", 'F'},
    {"target.jurisdiction within \"EU\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target.region within \"FR\"", R("s-de", "", NULL, -1, -1), "c-bare", 'T'},
    {"request.origin.site within \"EU\"", R("s-de", "", NULL, -1, -1), "c-us", 'T'},
    {"request.origin.region within \"US\"", R("s-de", "", NULL, -1, -1), "c-us", 'F'},
    {"target within request.origin.jurisdiction", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target within request.origin.jurisdiction", R("s-fr", "", NULL, -1, -1), "c-de", 'F'},
    {"target.site within \"EU\"", R("s-de", "", NULL, -1, -1), "c-de", 'E'},
    /* has */
    {"target has gpu", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"target has gpu", R("s-de", "", NULL, -1, -1), "c-bare", 'F'},
    {"target has site", R("s-de", "", NULL, -1, -1), "s-fr", 'T'},
    {"target has site", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"request has model", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"request has latency_ms", R("s-de", "", NULL, 3, -1), "c-de", 'T'},
    {"target has gpu and target.gpu == \"x\"", R("s-de", "", NULL, -1, -1), "c-bare", 'F'},
    {"not (target has tier) or target.tier == \"clinic\"", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    /* and, or, not with errors: Kleene, error = unknown */
    {"true and false", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"true and true", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"false or true", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"false or false", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"not true", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"not false", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"true or target.gpu == \"x\"", R("s-de", "", NULL, -1, -1), "c-bare", 'T'},
    {"target.gpu == \"x\" or true", R("s-de", "", NULL, -1, -1), "c-bare", 'T'},
    {"false and target.gpu == \"x\"", R("s-de", "", NULL, -1, -1), "c-bare", 'F'},
    {"target.gpu == \"x\" and false", R("s-de", "", NULL, -1, -1), "c-bare", 'F'},
    {"true and target.gpu == \"x\"", R("s-de", "", NULL, -1, -1), "c-bare", 'E'},
    {"false or target.gpu == \"x\"", R("s-de", "", NULL, -1, -1), "c-bare", 'E'},
    {"not (target.gpu == \"x\")", R("s-de", "", NULL, -1, -1), "c-bare", 'E'},
    {"not not (target.gpu == \"x\")", R("s-de", "", NULL, -1, -1), "c-bare", 'E'},
    /* precedence: not > and > or; parentheses */
    {"true or true and false", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"(true or true) and false", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"not false and false", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    {"not (false and false)", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"not true or true", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"false and true or true", R("s-de", "", NULL, -1, -1), "c-de", 'T'},
    {"false and (true or true)", R("s-de", "", NULL, -1, -1), "c-de", 'F'},
    /* strings the policy does not know, compared with each other */
    {"request.tenant == request.model", {"s-de", "", "q", -1, -1, "q"}, "c-de", 'T'},
    {"request.tenant == request.model", {"s-de", "", "q", -1, -1, "r"}, "c-de", 'F'},
};

static void test_operators(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof ROWS / sizeof ROWS[0]; i++) {
        char got = s_outcome(ROWS[i].cond, &ROWS[i].rq, ROWS[i].target);
        if (got != ROWS[i].want)
            fail_msg("`%s` for %s from %s: expected %c, got %c", ROWS[i].cond, ROWS[i].target, ROWS[i].rq.origin,
                     ROWS[i].want, got);
    }
}

static void test_default_deny(void **state) {
    (void)state;
    fi_policy *p = s_build("prefer \"p\" score 5 when true;\nforbid \"f\" when false;\n");
    req_spec rs = R("s-de", "public", NULL, -1, -1);
    const char *names[] = {"s-de", "c-de", "c-us"};
    for (size_t i = 0; i < 3; i++) {
        fi_verdict v = s_decide(p, &rs, names[i]);
        assert_false(v.permitted);
        assert_int_equal(v.cause, FI_CAUSE_DEFAULT_DENY);
        assert_true(v.score == 0);
        char line[256], want[128];
        fi_verdict_explain(p, &v, NULL, line, sizeof line);
        snprintf(want, sizeof want, "denied %s: no permit matched (default deny)", names[i]);
        assert_string_equal(line, want);
    }
    fi_policy_destroy(&p);
}

static void test_forbid_wins(void **state) {
    (void)state;
    fi_policy *p = s_build("permit \"everything\";\n"
                           "permit \"eu\" when target within \"EU\";\n"
                           "forbid \"no de\" when target within \"DE\";\n"
                           "forbid \"no bavaria\" when target within \"BY\";\n"
                           "permit \"after\" when true;\n");
    req_spec rs = R("s-de", "phi", NULL, -1, -1);
    fi_verdict v = s_decide(p, &rs, "c-de");
    assert_false(v.permitted);
    assert_int_equal(v.cause, FI_CAUSE_FORBID);
    assert_int_equal(v.n_rules, 2);
    char line[256];
    fi_verdict_explain(p, &v, NULL, line, sizeof line);
    assert_string_equal(line, "denied c-de: forbid \"no de\", forbid \"no bavaria\"");
    v = s_decide(p, &rs, "s-fr");
    assert_true(v.permitted);
    assert_int_equal(v.n_rules, 3);
    fi_verdict_explain(p, &v, NULL, line, sizeof line);
    assert_string_equal(line, "permitted s-fr: permit \"everything\", permit \"eu\", permit \"after\"");
    fi_policy_destroy(&p);
}

static void test_errors_block_explained(void **state) {
    (void)state;
    fi_policy *p = s_build("permit \"all\";\n"
                           "forbid \"phi stays on site\" when \"phi\" in request.labels and target.site != request.origin.site;\n"
                           "permit \"cheap\" when target.cost < 2;\n");
    req_spec phi = R("s-de", "phi", NULL, -1, -1);
    fi_verdict v = s_decide(p, &phi, "c-de");
    char line[256];
    fi_verdict_explain(p, &v, NULL, line, sizeof line);
    assert_string_equal(line, "denied c-de: forbid \"phi stays on site\" (condition could not be evaluated)");
    v = s_decide(p, &phi, "s-fr");
    fi_verdict_explain(p, &v, NULL, line, sizeof line);
    assert_string_equal(line, "denied s-fr: forbid \"phi stays on site\"");
    v = s_decide(p, &phi, "s-de");
    assert_true(v.permitted);
    /* Without phi the forbid is false whatever target.site is: the cluster is fine. */
    req_spec pub = R("s-de", "public", NULL, -1, -1);
    v = s_decide(p, &pub, "c-de");
    assert_true(v.permitted);
    /* A permit that cannot be evaluated does not permit. */
    fi_policy *q = s_build("permit \"cheap\" when target.cost < 2;\n");
    v = s_decide(q, &pub, "s-de");
    assert_false(v.permitted);
    assert_int_equal(v.cause, FI_CAUSE_DEFAULT_DENY);
    char tr[256];
    const char *labels[] = {"public"};
    fi_request r = {"t", NULL, NULL, "s-de", NULL, labels, 1, -1, -1};
    fi_policy_rule_trace(q, &r, (uint32_t)fi_policy_target_find(q, "s-de"), 0, tr, sizeof tr);
    assert_string_equal(tr, "error: target.cost is absent on site s-de");
    fi_policy_destroy(&q);
    fi_policy_destroy(&p);
}

static void test_scores(void **state) {
    (void)state;
    fi_policy *p = s_build("permit \"all\";\n"
                           "forbid \"not us sites\" when target.name == \"s-us\";\n"
                           "prefer \"cheap\" score 10 when target.cost < 2;\n"
                           "prefer \"eu\" score 5 when target within \"EU\";\n"
                           "prefer \"penalty\" score -7 when target.kind == \"site\";\n"
                           "prefer \"broken\" score 1000 when target.gpu == \"a100\";\n");
    const char *labels[] = {"public"};
    fi_request r = {"t", NULL, NULL, "s-de", NULL, labels, 1, -1, -1};
    size_t n = fi_policy_target_count(p);
    fi_verdict v[16];
    assert_int_equal(fi_policy_decide(p, &r, NULL, n, v), 0);
    int64_t want[16];
    for (size_t i = 0; i < n; i++) {
        const char *name = fi_policy_target_name(p, i);
        want[i] = !strcmp(name, "s-de") || !strcmp(name, "s-fr") ? -2 : !strcmp(name, "c-de") || !strcmp(name, "c-bare") ? 5
                  : !strcmp(name, "c-us") ? 1010 : 0;
        if (!strcmp(name, "s-us")) {
            assert_false(v[i].permitted);
            assert_true(v[i].score == 0); /* no score for a denied target */
        } else {
            assert_true(v[i].permitted);
            assert_true(v[i].score == want[i]);
        }
    }
    int best = fi_verdict_best(v, n);
    assert_string_equal(fi_policy_target_name(p, v[best].target), "c-us");
    char line[256];
    fi_verdict_explain(p, &v[best], NULL, line, sizeof line);
    assert_string_equal(line, "permitted c-us: permit \"all\"; score 1010 (prefer \"cheap\", prefer \"broken\")");
    fi_policy_destroy(&p);
}

static void test_bad_requests(void **state) {
    (void)state;
    fi_policy *p = s_build("permit \"all\";\n");
    size_t n = fi_policy_target_count(p);
    fi_verdict v[16];
    const char *bad_label[] = {"public", "secret"};
    fi_request r = {"t", NULL, NULL, "s-de", NULL, bad_label, 2, -1, -1};
    assert_int_equal(fi_policy_decide(p, &r, NULL, n, v), 0);
    for (size_t i = 0; i < n; i++) {
        assert_false(v[i].permitted);
        assert_int_equal(v[i].cause, FI_CAUSE_BAD_REQUEST);
    }
    char line[256];
    fi_verdict_explain(p, &v[0], NULL, line, sizeof line);
    assert_non_null(strstr(line, "fail closed"));
    r.n_labels = 1;
    r.origin_site = "c-de"; /* a cluster is not an origin */
    assert_int_equal(fi_policy_decide(p, &r, NULL, n, v), 0);
    assert_int_equal(v[0].cause, FI_CAUSE_BAD_REQUEST);
    r.origin_site = NULL;
    assert_int_equal(fi_policy_decide(p, &r, NULL, n, v), 0);
    assert_false(v[0].permitted);
    r.origin_site = "s-de";
    uint32_t bad_idx = 99;
    assert_int_equal(fi_policy_decide(p, &r, &bad_idx, 1, v), -1);
    assert_false(v[0].permitted);
    assert_int_equal(fi_policy_decide(p, &r, NULL, n + 1, v), -1);
    /* duplicate labels are one label */
    const char *dup[] = {"pii", "pii", "pii"};
    fi_policy *q = s_build("permit \"only pii\" when request.labels == [\"pii\"];\n");
    fi_request r2 = {"t", NULL, NULL, "s-de", NULL, dup, 3, -1, -1};
    assert_int_equal(fi_policy_decide(q, &r2, NULL, n, v), 0);
    assert_true(v[0].permitted);
    fi_policy_destroy(&q);
    fi_policy_destroy(&p);
}

/* A policy that declares labels but names no default_label: a request
 * without labels is denied as a bad request, and the validator warns
 * (before: it carried the empty set, so `request.labels <= ["public"]`
 * held and it was permitted everywhere; found by a review). A policy
 * without labels still takes requests without labels. */
static void test_no_default_label_fails_closed(void **state) {
    (void)state;
    const char *text = "labels public, internal, pii, phi;\n"
                       "jurisdiction EU;\njurisdiction DE in EU;\nregion eu-central in DE;\n"
                       "site berlin in eu-central;\ncluster fra in eu-central { cost = 3; }\n"
                       "permit \"public anywhere\" when request.labels <= [\"public\"];\n";
    fi_diags *d = fi_diags_new();
    fi_policy *p = fi_policy_parse(text, strlen(text), d);
    assert_non_null(p);
    assert_int_equal(fi_diags_warnings(d), 1);
    char line[512];
    fi_diag_format(fi_diags_get(d, 0), "t", line, sizeof line);
    if (!strstr(line, "t:1:1: warning: the policy declares labels but no default_label"))
        fail_msg("expected the warning, got %s", line);
    fi_diags_destroy(&d);
    size_t n = fi_policy_target_count(p);
    fi_verdict v[4];
    fi_request r = {"t", NULL, NULL, "berlin", NULL, NULL, 0, -1, -1};
    assert_int_equal(fi_policy_decide(p, &r, NULL, n, v), 0);
    for (size_t i = 0; i < n; i++) {
        assert_false(v[i].permitted);
        assert_int_equal(v[i].cause, FI_CAUSE_BAD_REQUEST);
        assert_int_equal(v[i].bad, FI_BAD_NO_LABELS);
    }
    fi_verdict_explain(p, &v[0], NULL, line, sizeof line);
    assert_string_equal(line, "denied berlin: the request has no labels and the policy names no default_label "
                              "(fail closed)");
    assert_int_equal(fi_policy_decide_slow(p, &r, NULL, n, v), 0);
    assert_false(v[0].permitted);
    assert_int_equal(v[0].cause, FI_CAUSE_BAD_REQUEST);
    /* the flows say so too */
    char why[128];
    assert_int_equal(fi_policy_flow(p, 0, 0, 0, why, sizeof why), FI_FLOW_DENY);
    assert_string_equal(why, "no labels and no default_label");
    /* labelled requests are decided as before */
    const char *pub[] = {"public"};
    r.labels = pub;
    r.n_labels = 1;
    assert_int_equal(fi_policy_decide(p, &r, NULL, n, v), 0);
    assert_true(v[0].permitted && v[1].permitted);
    fi_policy_destroy(&p);
    /* no labels declared: nothing to default to, nothing refused */
    const char *bare = "jurisdiction EU;\nregion r in EU;\nsite s in r;\npermit \"all\";\n";
    d = fi_diags_new();
    p = fi_policy_parse(bare, strlen(bare), d);
    assert_non_null(p);
    assert_int_equal(fi_diags_warnings(d), 0);
    fi_diags_destroy(&d);
    r.origin_site = "s";
    r.labels = NULL;
    r.n_labels = 0;
    assert_int_equal(fi_policy_decide(p, &r, NULL, 1, v), 0);
    assert_true(v[0].permitted);
    fi_policy_destroy(&p);
}

/* Console times: Unix seconds are taken only while their milliseconds
 * fit in an int64_t (before: `fedctl audit --since 99999999999999999`
 * overflowed t0 * 1000, undefined behaviour; found by a review). */
static void test_cmd_time_range(void **state) {
    (void)state;
    char s[40];
    snprintf(s, sizeof s, "%lld", (long long)FI_POLICY_CMD_TIME_MAX);
    assert_true(fi_policy_cmd_time(s) == INT64_MAX / 1000);
    snprintf(s, sizeof s, "%lld", (long long)FI_POLICY_CMD_TIME_MAX + 1);
    assert_true(fi_policy_cmd_time(s) == -1);
    assert_true(fi_policy_cmd_time("99999999999999999") == -1);
    assert_true(fi_policy_cmd_time("+5") == -1); /* digits only, as the forms it names */
    assert_true(fi_policy_cmd_time(" 5") == -1);
    assert_true(fi_policy_cmd_time("5") == 5);
    assert_true(fi_policy_cmd_time("9223372036854775807") == -1);
    assert_true(fi_policy_cmd_time("1800000000") == 1800000000);
    assert_true(fi_policy_cmd_time("2027-01-15") == 1799971200);
    assert_true(fi_policy_cmd_time("-5") == -1);
}

static void test_candidates_subset(void **state) {
    (void)state;
    fi_policy *p = s_build("permit \"eu\" when target within \"EU\";\nprefer \"c\" score 3 when target.kind == \"cluster\";\n");
    uint32_t idx[3] = {(uint32_t)fi_policy_target_find(p, "c-us"), (uint32_t)fi_policy_target_find(p, "c-de"),
                       (uint32_t)fi_policy_target_find(p, "s-fr")};
    fi_verdict v[3];
    const char *labels[] = {"pii"};
    fi_request r = {"t", NULL, NULL, "s-fr", NULL, labels, 1, -1, -1};
    assert_int_equal(fi_policy_decide(p, &r, idx, 3, v), 0);
    for (int i = 0; i < 3; i++) assert_int_equal(v[i].target, idx[i]);
    assert_false(v[0].permitted);
    assert_true(v[1].permitted);
    assert_true(v[2].permitted);
    assert_int_equal(fi_verdict_best(v, 3), 1);
    assert_int_equal(fi_policy_target_find(p, "nope"), -1);
    fi_policy_destroy(&p);
}

static void test_fallback(void **state) {
    (void)state;
    const char *names[] = {"fra-gpu-1", "berlin-clinic", "munich-clinic", "berlin-clinic"};
    fi_target_kind kinds[] = {FI_TARGET_CLUSTER, FI_TARGET_SITE, FI_TARGET_SITE, FI_TARGET_CLUSTER};
    fi_verdict v[4];
    fi_policy_fallback("berlin-clinic", names, kinds, 4, v);
    assert_false(v[0].permitted);
    assert_true(v[1].permitted);
    assert_false(v[2].permitted);
    assert_false(v[3].permitted); /* a cluster named like the site is still not the site */
    char line[256];
    fi_verdict_explain(NULL, &v[1], names[1], line, sizeof line);
    assert_string_equal(line, "permitted berlin-clinic: no valid policy: the origin site only (fail closed)");
    fi_verdict_explain(NULL, &v[0], names[0], line, sizeof line);
    assert_string_equal(line, "denied fra-gpu-1: no valid policy: only the origin site may process (fail closed)");
    fi_policy_fallback(NULL, names, kinds, 4, v);
    for (int i = 0; i < 4; i++) assert_false(v[i].permitted);
}

static void test_decide_names(void **state) {
    (void)state;
    fi_policy *p = s_build("expires \"2027-01-01T00:00:00Z\";\npermit \"eu\" when target within \"EU\";\n");
    const char *names[] = {"c-us", "c-de", "nowhere", "s-de", "s-fr", "s-de"};
    fi_target_kind kinds[] = {FI_TARGET_CLUSTER, FI_TARGET_CLUSTER, FI_TARGET_CLUSTER, FI_TARGET_SITE,
                              FI_TARGET_SITE, FI_TARGET_CLUSTER};
    const char *labels[] = {"pii"};
    fi_request r = {"t", NULL, NULL, "s-de", NULL, labels, 1, -1, -1};
    fi_verdict v[6];
    int64_t before = 1798761600 - 1, after = 1798761600;
    fi_policy_decide_names(p, before, &r, names, kinds, 6, v);
    bool want[] = {false, true, false, true, true, false};
    for (int i = 0; i < 6; i++) {
        assert_int_equal(v[i].target, i);
        assert_int_equal(v[i].permitted, want[i]);
    }
    assert_int_equal(v[2].cause, FI_CAUSE_UNKNOWN_TARGET);
    assert_int_equal(v[5].cause, FI_CAUSE_UNKNOWN_TARGET); /* s-de is a site, not a cluster */
    char line[256];
    fi_verdict_explain(p, &v[2], names[2], line, sizeof line);
    assert_string_equal(line, "denied nowhere: the target is not in the policy (fail closed)");
    /* expired: fail closed, the origin site only */
    fi_policy_decide_names(p, after, &r, names, kinds, 6, v);
    for (int i = 0; i < 6; i++) {
        assert_int_equal(v[i].cause, FI_CAUSE_FALLBACK);
        assert_int_equal(v[i].permitted, i == 3);
    }
    /* no policy at all */
    fi_policy_decide_names(NULL, before, &r, names, kinds, 6, v);
    for (int i = 0; i < 6; i++) assert_int_equal(v[i].permitted, i == 3);
    fi_policy_destroy(&p);
}

static void test_expiry(void **state) {
    (void)state;
    const char *text = "expires \"2027-01-01T00:00:00Z\";\njurisdiction X;\n";
    fi_policy *p = fi_policy_parse(text, strlen(text), NULL);
    assert_non_null(p);
    assert_true(fi_policy_expires(p) == 1798761600);
    assert_true(fi_policy_current(p, 1798761599));
    assert_false(fi_policy_current(p, 1798761600));
    fi_policy_destroy(&p);
    fi_policy *q = fi_policy_parse("", 0, NULL);
    assert_non_null(q);
    assert_true(fi_policy_current(q, INT64_MAX));
    fi_policy_destroy(&q);
    assert_false(fi_policy_current(NULL, 0));
}

/* The compiled evaluator agrees with the reference one on many requests. */
static void s_compare_all(const fi_policy *p, unsigned seed) {
    const char *models[] = {NULL, "m0", "m1", "m2", "smollm2-135m", "llama-3-8b", "nope"};
    size_t n = fi_policy_target_count(p), nl = fi_policy_label_count(p), ns = fi_policy_site_count(p);
    fi_verdict a[64], b[64];
    assert_true(n <= 64);
    for (unsigned it = 0; it < 3000; it++) {
        seed = seed * 1103515245u + 12345u;
        const char *labels[16];
        size_t k = 0;
        for (size_t l = 0; l < nl; l++)
            if ((seed >> (l + 3)) & 1) labels[k++] = fi_policy_label_name(p, l);
        fi_request r = {"t", (seed & 64) ? "acme" : NULL, NULL, fi_policy_site_name(p, (seed >> 8) % ns),
                        models[(seed >> 12) % 7], labels, k, (seed & 128) ? (int64_t)(seed >> 20) % 500 : -1,
                        (seed & 256) ? (int64_t)(seed >> 16) % 5000 : -1};
        assert_int_equal(fi_policy_decide(p, &r, NULL, n, a), 0);
        assert_int_equal(fi_policy_decide_slow(p, &r, NULL, n, b), 0);
        for (size_t i = 0; i < n; i++) {
            assert_int_equal(a[i].permitted, b[i].permitted);
            assert_int_equal(a[i].cause, b[i].cause);
            assert_int_equal(a[i].n_rules, b[i].n_rules);
            assert_memory_equal(a[i].rules, b[i].rules, sizeof a[i].rules);
            assert_int_equal(a[i].rule_errored, b[i].rule_errored);
            assert_int_equal(a[i].n_prefer, b[i].n_prefer);
            assert_true(a[i].score == b[i].score);
        }
    }
}

static void test_compiled_matches_reference(void **state) {
    (void)state;
    const char *files[] = {"eu-hospital.policy", "us-bank.policy", "sovereign.policy"};
    for (size_t f = 0; f < 3; f++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/../examples/policies/%s", FI_TEST_DIR, files[f]);
        fi_policy *p = fi_policy_load(path, NULL);
        assert_non_null(p);
        s_compare_all(p, (unsigned)f + 1);
        fi_policy_destroy(&p);
    }
    static const unsigned sizes[] = {1, 10, 100, 300};
    for (size_t s = 0; s < 4; s++) {
        char *buf = malloc(200000);
        assert_non_null(buf);
        int len = fi_policy_bench_text(sizes[s], buf, 200000);
        assert_true(len > 0);
        fi_policy *p = fi_policy_parse(buf, (size_t)len, NULL);
        free(buf);
        assert_non_null(p);
        s_compare_all(p, 77 + (unsigned)s);
        fi_policy_destroy(&p);
    }
}

/* Flows are sound: allow and deny hold for concrete requests. */
static void test_flows_sound(void **state) {
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/../examples/policies/eu-hospital.policy", FI_TEST_DIR);
    fi_policy *p = fi_policy_load(path, NULL);
    assert_non_null(p);
    const char *models[] = {NULL, "smollm2-135m", "llama-3-8b", "other"};
    size_t nl = fi_policy_label_count(p);
    for (uint32_t mask = 0; mask < (1u << nl); mask++)
        for (size_t o = 0; o < fi_policy_site_count(p); o++)
            for (size_t t = 0; t < fi_policy_target_count(p); t++) {
                fi_flow f = fi_policy_flow(p, mask, o, t, NULL, 0);
                const char *labels[16];
                size_t k = 0;
                for (size_t l = 0; l < nl; l++)
                    if (mask >> l & 1) labels[k++] = fi_policy_label_name(p, l);
                bool any = false, all = true;
                for (int m = 0; m < 4; m++) {
                    fi_request r = {"t", NULL, NULL, fi_policy_site_name(p, o), models[m], labels, k, -1, -1};
                    uint32_t idx = (uint32_t)t;
                    fi_verdict v;
                    assert_int_equal(fi_policy_decide(p, &r, &idx, 1, &v), 0);
                    any |= v.permitted;
                    all &= v.permitted;
                }
                if (f == FI_FLOW_ALLOW) assert_true(all);
                if (f == FI_FLOW_DENY) assert_false(any);
            }
    int phi = fi_policy_label_find(p, "phi"), pub = fi_policy_label_find(p, "public");
    int fra = fi_policy_target_find(p, "fra-gpu-1"), us = fi_policy_target_find(p, "virginia-gpu");
    int berlin = fi_policy_target_find(p, "berlin-clinic");
    char why[128];
    assert_int_equal(fi_policy_flow(p, 1u << phi, 0, (size_t)fra, why, sizeof why), FI_FLOW_DENY);
    assert_string_equal(why, "phi stays on site");
    assert_int_equal(fi_policy_flow(p, 1u << phi, 0, (size_t)berlin, why, sizeof why), FI_FLOW_ALLOW);
    assert_int_equal(fi_policy_flow(p, 1u << pub, 0, (size_t)us, why, sizeof why), FI_FLOW_MAYBE);
    assert_string_equal(why, "model must be served");
    fi_policy_destroy(&p);
}

static void test_accessors(void **state) {
    (void)state;
    fi_policy *p = s_build("permit \"a\";\nforbid \"b\" when false;\nprefer \"c\" score 1 when true;\n");
    assert_int_equal(fi_policy_rule_count(p), 3);
    assert_string_equal(fi_policy_rule_id(p, 1), "b");
    assert_int_equal(fi_policy_rule_effect(p, 2), FI_PREFER);
    assert_int_equal(fi_policy_site_count(p), 3);
    assert_int_equal(fi_policy_target_count(p), 6);
    assert_int_equal(fi_policy_target_kind(p, (size_t)fi_policy_target_find(p, "c-de")), FI_TARGET_CLUSTER);
    assert_string_equal(fi_policy_default_label(p), "internal");
    assert_int_equal(fi_policy_label_find(p, "phi"), 3);
    assert_int_equal(fi_policy_label_find(p, "s-de"), -1);
    /* the innermost jurisdiction: the residency zone of cached state */
    assert_string_equal(fi_policy_jurisdiction(p, "s-de"), "BY");
    assert_string_equal(fi_policy_jurisdiction(p, "c-de"), "BY");
    assert_string_equal(fi_policy_jurisdiction(p, "s-fr"), "FR");
    assert_string_equal(fi_policy_jurisdiction(p, "us-r"), "US");
    assert_string_equal(fi_policy_jurisdiction(p, "DE"), "DE");
    assert_null(fi_policy_jurisdiction(p, "nowhere"));
    assert_null(fi_policy_jurisdiction(p, "phi")); /* a label, not a place */
    assert_null(fi_policy_jurisdiction(p, NULL));
    char hex[65];
    fi_policy_digest_hex(p, hex);
    assert_int_equal(strlen(hex), 64);
    fi_policy_destroy(&p);
    fi_policy_destroy(&p); /* safe twice */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_operators),
        cmocka_unit_test(test_default_deny),
        cmocka_unit_test(test_forbid_wins),
        cmocka_unit_test(test_errors_block_explained),
        cmocka_unit_test(test_scores),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_no_default_label_fails_closed),
        cmocka_unit_test(test_cmd_time_range),
        cmocka_unit_test(test_candidates_subset),
        cmocka_unit_test(test_fallback),
        cmocka_unit_test(test_expiry),
        cmocka_unit_test(test_decide_names),
        cmocka_unit_test(test_compiled_matches_reference),
        cmocka_unit_test(test_flows_sound),
        cmocka_unit_test(test_accessors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
