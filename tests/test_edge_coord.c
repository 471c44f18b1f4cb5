/*
 * test_edge_coord.c - the coordinator's policy re-check
 * (fabric/fi_coord_policy.c) on its own: the newest signed bundle in the
 * store decides with the origin of the edge's key; no bundle, a tampered
 * one, an untrusted signer or an expired policy deny (fail closed); the
 * denial names the rule; without the key configured the check is not
 * installed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "fi_bundle.h"
#include "fi_coord_policy.h"
#include "fi_store.h"

typedef struct fx {
    char dir[64], db[128], pub[128];
    uint8_t pk[32], sk[64];
    fi_store *st;
    fi_coord_opts co;          /* db and key, for the cached check */
    fi_coord_policy_ctx *ctx;  /* the cached check, kept across calls */
} fx;

static const char *s_policy_fmt =
    "labels public, internal, phi;\n"
    "default_label \"internal\";\n"
    "expires \"%s\";\n"
    "jurisdiction EU;\njurisdiction US;\n"
    "region eu-central in EU;\nregion us-east in US;\n"
    "site berlin-clinic in eu-central;\n"
    "cluster fra-gpu-1 in eu-central { models = [\"smollm2-135m\"]; }\n"
    "cluster virginia-gpu in us-east { models = [\"smollm2-135m\"]; }\n"
    "permit \"public anywhere\" when request.labels <= [\"public\"];\n"
    "permit \"internal in the EU\" when request.labels <= [\"public\", \"internal\"] and target "
    "within \"EU\";\n"
    "forbid \"phi stays on site\" when \"phi\" in request.labels and target.site != "
    "request.origin.site;\n"
    "forbid \"oncology stays on site\" when request has tenant and request.tenant == \"oncology\" "
    "and target.kind == \"cluster\";\n"
    "forbid \"trading stays on site\" when request has application and request.application == "
    "\"trading\" and target.kind == \"cluster\";\n"
    "forbid \"long prompts stay on site\" when request has prompt_tokens and "
    "request.prompt_tokens > 1000 and target.kind == \"cluster\";\n";

/* What the edge says besides the labels (check() sends them). */
static const char *s_tenant = "", *s_app = "";
static uint32_t s_prompt;

static int setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "/tmp/test_edge_coord.XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    snprintf(f->db, sizeof f->db, "%s/coordinator.db", f->dir);
    char err[256], key[128];
    assert_int_equal(fi_bundle_keygen(f->pk, f->sk), 0);
    snprintf(key, sizeof key, "%s/sign.key", f->dir);
    assert_int_equal(fi_bundle_key_save(key, f->sk, err, sizeof err), 0);
    snprintf(f->pub, sizeof f->pub, "%s/sign.key.pub", f->dir);
    f->st = fi_store_open(f->db, err, sizeof err);
    assert_non_null(f->st);
    unsetenv(FI_COORD_POLICY_KEY_ENV); /* the key comes from the configuration */
    fi_coord_opts_default(&f->co);
    snprintf(f->co.db, sizeof f->co.db, "%s", f->db);
    snprintf(f->co.policy_check_key, sizeof f->co.policy_check_key, "%s", f->pub);
    f->ctx = fi_coord_policy_ctx_new(&f->co);
    assert_non_null(f->ctx);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fx *f = *state;
    fi_coord_policy_ctx_free(f->ctx);
    fi_store_destroy(&f->st);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
    assert_int_equal(system(cmd), 0);
    unsetenv(FI_COORD_POLICY_KEY_ENV);
    free(f);
    return 0;
}

static void put(fx *f, uint64_t version, const char *expires, const uint8_t *sk, int tamper) {
    char text[2048];
    snprintf(text, sizeof text, s_policy_fmt, expires);
    char *b;
    size_t bl;
    int64_t now = (int64_t)time(NULL);
    assert_int_equal(fi_bundle_sign(sk, version, now - 60, now + 3600, text, strlen(text), &b, &bl), 0);
    if (tamper) strstr(b, "phi stays")[0] = 'P';
    assert_int_equal(fi_store_bundle_put(f->st, version, b, bl, "op"), 0);
    free(b);
}

static int check(const char *origin, const char *target, const char *label, char *reason,
                 size_t cap, void *db) {
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    char *labels[1] = {(char *)label};
    rq.request_id = "r1";
    rq.model = "smollm2-135m";
    rq.labels = label ? labels : NULL;
    rq.n_labels = label ? 1 : 0;
    rq.tenant = (char *)s_tenant;
    rq.application = (char *)s_app;
    rq.prompt_tokens = s_prompt;
    fi_peer_rec o = {0}, t = {0};
    snprintf(o.site, sizeof o.site, "%s", origin);
    snprintf(t.site, sizeof t.site, "%s", target);
    o.role = FI__ROLE__ROLE_EDGE;
    t.role = FI__ROLE__ROLE_CLUSTER;
    reason[0] = 0;
    const fx *f = db;
    fi_coord_opts co;
    fi_coord_opts_default(&co);
    snprintf(co.db, sizeof co.db, "%s", f->db);
    snprintf(co.policy_check_key, sizeof co.policy_check_key, "%s", f->pub);
    fi_coord_verdict v, vc;
    int ok = fi_coord_policy_check(&co, &rq, &o, &t, &v, reason, cap);
    /* The verdict names the deciding rules and the policy when there is one. */
    if (ok) assert_true(v.rules[0] && strlen(v.digest) == 64);
    /* The cached check (what the coordinator runs), kept across every call
     * of the test while bundles come and go, decides the same. */
    char rc2[256] = "";
    int okc = fi_coord_policy_check_cached(f->ctx, &rq, &o, &t, &vc, rc2, sizeof rc2);
    assert_int_equal(okc, ok);
    assert_string_equal(vc.rules, v.rules);
    assert_string_equal(vc.digest, v.digest);
    /* the origin's residency zone, which the worker salts its cache with:
     * berlin-clinic (the only origin ever permitted here) is in EU */
    assert_string_equal(vc.zone, v.zone);
    if (ok) assert_string_equal(v.zone, "EU");
    assert_string_equal(rc2, reason);
    return ok;
}

static void test_attach(void **state) {
    fx *f = *state;
    fi_coord_opts o;
    /* From coordinator.conf's policy_check_key. */
    fi_coord_opts_default(&o);
    snprintf(o.db, sizeof o.db, "%s", f->db);
    snprintf(o.policy_check_key, sizeof o.policy_check_key, "%s", f->pub);
    fi_coord_policy_attach(&o);
    assert_ptr_equal(o.policy, fi_coord_policy_check_cached);
    assert_non_null(o.policy_user);
    assert_non_null(o.policy_free);
    o.policy_free(o.policy_user);
    /* Neither the key nor the variable: off. */
    fi_coord_opts_default(&o);
    fi_coord_policy_attach(&o);
    assert_null(o.policy);
    /* The variable overrides the file's key. */
    setenv(FI_COORD_POLICY_KEY_ENV, f->pub, 1);
    fi_coord_opts_default(&o);
    snprintf(o.policy_check_key, sizeof o.policy_check_key, "/nonexistent.pub");
    fi_coord_policy_attach(&o);
    assert_ptr_equal(o.policy, fi_coord_policy_check_cached);
    assert_string_equal(o.policy_check_key, f->pub);
    o.policy_free(o.policy_user);
    unsetenv(FI_COORD_POLICY_KEY_ENV);
    /* A configured key that cannot be read fails closed. */
    fi_coord_opts_default(&o);
    snprintf(o.db, sizeof o.db, "%s", f->db);
    snprintf(o.policy_check_key, sizeof o.policy_check_key, "%s/missing.pub", f->dir);
    fi_coord_policy_attach(&o);
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = "r0";
    rq.model = "m";
    fi_peer_rec org = {0}, tgt = {0};
    snprintf(org.site, sizeof org.site, "berlin-clinic");
    snprintf(tgt.site, sizeof tgt.site, "fra-gpu-1");
    char reason[256] = "";
    assert_int_equal(o.policy(o.policy_user, &rq, &org, &tgt, NULL, reason, sizeof reason), 0);
    assert_non_null(strstr(reason, "key cannot be read"));
    o.policy_free(o.policy_user);
}

static void test_fail_closed_and_decisions(void **state) {
    fx *f = *state;
    char r[256];
    /* No bundle: every routed request is denied. */
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 0);
    assert_non_null(strstr(r, "no policy bundle"));
    /* A valid bundle decides, with the origin given (from the key). */
    put(f, 1, "2099-01-01T00:00:00Z", f->sk, 0);
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 1);
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", NULL, r, sizeof r, f), 1);
    assert_int_equal(check("berlin-clinic", "virginia-gpu", "internal", r, sizeof r, f), 0);
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "phi", r, sizeof r, f), 0);
    assert_non_null(strstr(r, "phi stays on site"));
    assert_non_null(strstr(r, "berlin-clinic"));
    /* An unknown origin or cluster is denied. */
    assert_int_equal(check("atlantis", "fra-gpu-1", "public", r, sizeof r, f), 0);
    assert_int_equal(check("berlin-clinic", "moon-gpu", "public", r, sizeof r, f), 0);
    /* A newer bundle signed by someone else is not used: fail closed. */
    uint8_t pk2[32], sk2[64];
    assert_int_equal(fi_bundle_keygen(pk2, sk2), 0);
    put(f, 2, "2099-01-01T00:00:00Z", sk2, 0);
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 0);
    assert_non_null(strstr(r, "no valid policy"));
    /* A tampered one neither. */
    put(f, 3, "2099-01-01T00:00:00Z", f->sk, 1);
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 0);
    /* An expired policy neither. */
    put(f, 4, "2001-01-01T00:00:00Z", f->sk, 0);
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 0);
    /* A good newer one restores service. */
    put(f, 5, "2099-01-01T00:00:00Z", f->sk, 0);
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 1);
    /* Rules on the tenant, the application and the prompt's size hold at
     * the coordinator too (an edge with an older bundle, or one that lies
     * about its own decision, is checked against them). */
    s_tenant = "oncology";
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 0);
    assert_non_null(strstr(r, "oncology stays on site"));
    s_tenant = "radiology";
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 1);
    s_app = "trading";
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 0);
    assert_non_null(strstr(r, "trading stays on site"));
    s_app = "notes";
    s_prompt = 1001;
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 0);
    assert_non_null(strstr(r, "long prompts stay on site"));
    s_prompt = 1000;
    assert_int_equal(check("berlin-clinic", "fra-gpu-1", "public", r, sizeof r, f), 1);
    s_tenant = s_app = "";
    s_prompt = 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_attach, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fail_closed_and_decisions, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
