/*
 * fi_coord_policy.c - the coordinator's re-check of the residency policy
 * (contract in fi_coord_policy.h).
 *
 * Stateless on purpose: each check reads the newest bundle from the store,
 * verifies it and parses its policy. That costs about a millisecond on a
 * request that is about to run a model, and means the coordinator always
 * enforces exactly what is in its store, with nothing to free or keep in
 * step.
 */
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_bundle.h"
#include "fi_coord_policy.h"

void fi_coord_policy_attach(fi_coord_opts *o) {
    if (o->policy) return;
    const char *env = getenv(FI_COORD_POLICY_KEY_ENV);
    if (env && env[0]) {
        if (o->policy_check_key[0] && strcmp(o->policy_check_key, env))
            fprintf(stderr, "coordinator: %s overrides policy_check_key %s\n",
                    FI_COORD_POLICY_KEY_ENV, o->policy_check_key);
        snprintf(o->policy_check_key, sizeof o->policy_check_key, "%s", env);
    }
    if (!o->policy_check_key[0]) {
        fprintf(stderr, "coordinator: no policy_check_key (nor %s): routed requests are not "
                        "re-checked against the residency policy\n", FI_COORD_POLICY_KEY_ENV);
        return;
    }
    o->policy = fi_coord_policy_check;
    o->policy_user = o;
    fprintf(stderr, "coordinator: routed requests are checked against the newest policy bundle "
                    "signed by %s (fail closed)\n", o->policy_check_key);
}

/* The newest bundle in the store, malloc'd; NULL when none. Bundles
 * arrive two ways: pushed by an operator over the fabric (the fleet store's
 * `bundles`), or applied with `fedctl policy apply --store` on the same
 * file (policy/'s `policy_versions`). The higher version wins; either table
 * may be absent. */
static char *s_newest_bundle(const char *db, size_t *len) {
    static const char *const q[2] = {
        "SELECT version, blob FROM bundles ORDER BY version DESC, id DESC LIMIT 1",
        "SELECT version, bundle FROM policy_versions ORDER BY version DESC LIMIT 1"};
    sqlite3 *h = NULL;
    char *out = NULL;
    int64_t best = -1;
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
        sqlite3_busy_timeout(h, 2000) == SQLITE_OK) {
        for (int t = 0; t < 2; t++) {
            sqlite3_stmt *st = NULL;
            if (sqlite3_prepare_v2(h, q[t], -1, &st, NULL) == SQLITE_OK &&
                sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int64(st, 0) > best) {
                int n = sqlite3_column_bytes(st, 1);
                const void *p = sqlite3_column_blob(st, 1);
                char *b = p && n > 0 ? malloc((size_t)n + 1) : NULL;
                if (b) {
                    memcpy(b, p, (size_t)n);
                    b[n] = 0;
                    free(out);
                    out = b;
                    *len = (size_t)n;
                    best = sqlite3_column_int64(st, 0);
                }
            }
            sqlite3_finalize(st);
        }
    }
    sqlite3_close(h);
    return out;
}

int fi_coord_policy_check(void *user, const Fi__InferRequest *req, const fi_peer_rec *origin,
                          const fi_peer_rec *target, fi_coord_verdict *out, char *reason,
                          size_t reasonlen) {
    const fi_coord_opts *o = user;
    const char *db = o->db;
    const char *keyfile = o->policy_check_key[0] ? o->policy_check_key : NULL;
    uint8_t trusted[1][FI_BUNDLE_PK_BYTES];
    char err[256] = "";
    fi_policy *pol = NULL;
    fi_bundle_info info;
    int64_t now = (int64_t)time(NULL);
    size_t len = 0;
    char *b = NULL;
    const char *why = NULL;
    if (!keyfile || fi_bundle_pub_load(keyfile, trusted[0], err, sizeof err) != 0) {
        why = "the policy-signing key cannot be read";
    } else if (!(b = s_newest_bundle(db, &len))) {
        why = "no policy bundle in the store";
    } else {
        fi_bundle_status st = fi_bundle_verify(b, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])trusted,
                                               1, 0, now, &info);
        if (st != FI_BUNDLE_OK) {
            why = fi_bundle_status_str(st);
        } else if (!(pol = fi_policy_parse(info.content, info.content_len, NULL))) {
            why = "the newest bundle's policy does not validate";
        }
    }
    const char *labels[64];
    size_t n_labels = req->n_labels < 64 ? req->n_labels : 64;
    for (size_t i = 0; i < n_labels; i++) labels[i] = req->labels[i];
    fi_request rq = {0};
    rq.request_id = req->request_id;
    rq.origin_site = origin->site; /* from the edge's key, never the body */
    rq.model = req->model;
    rq.labels = labels;
    rq.n_labels = n_labels;
    rq.latency_ms = -1;
    rq.prompt_tokens = -1;
    const char *names[1] = {target->site};
    fi_target_kind kinds[1] = {FI_TARGET_CLUSTER};
    fi_verdict v;
    fi_policy_decide_names(pol, now, &rq, names, kinds, 1, &v);
    if (out) {
        memset(out, 0, sizeof *out);
        out->score = v.permitted ? v.score : 0;
        size_t k = 0;
        unsigned nr = v.n_rules < FI_VERDICT_MAX_RULES ? v.n_rules : FI_VERDICT_MAX_RULES;
        for (unsigned r = 0; pol && r < nr; r++)
            k += (size_t)snprintf(out->rules + k, k < sizeof out->rules ? sizeof out->rules - k : 0,
                                  "%s%s", r ? "," : "", fi_policy_rule_id(pol, v.rules[r]));
        if (!v.permitted && !out->rules[0])
            snprintf(out->rules, sizeof out->rules, "%s",
                     why ? "no valid policy at the coordinator" : "default deny");
        if (pol) fi_policy_digest_hex(pol, out->digest);
    }
    if (!v.permitted) {
        char ex[256];
        fi_verdict_explain(pol, &v, target->site, ex, sizeof ex);
        if (why)
            snprintf(reason, reasonlen, "no valid policy at the coordinator (%s): %s", why, ex);
        else
            snprintf(reason, reasonlen, "policy version %llu, origin %s: %s",
                     (unsigned long long)info.version, origin->site, ex);
    }
    fi_policy_destroy(&pol);
    free(b);
    return v.permitted ? 1 : 0;
}
