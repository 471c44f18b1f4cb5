/*
 * fi_coord_policy.c - the coordinator's re-check of the residency policy
 * (contract in fi_coord_policy.h).
 *
 * fi_coord_policy_check is stateless: each check reads the newest bundle
 * from the store, verifies it and parses its policy (about 0.3 ms for a
 * small policy, on the coordinator's only thread, once per candidate
 * cluster of every routed request). The coordinator uses the cached check
 * (fi_coord_policy_check_cached): it keeps the verified, parsed policy and
 * reloads it when the store holds a newer version in either table, the
 * key file changes, the bundle's validity ends, or no valid policy was
 * found last time; so it enforces exactly what the stateless check would.
 */
#include <sqlite3.h>
#include <stdio.h>
#include <sys/stat.h>
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
            fi_coord_log("%s overrides policy_check_key %s", FI_COORD_POLICY_KEY_ENV, o->policy_check_key);
        snprintf(o->policy_check_key, sizeof o->policy_check_key, "%s", env);
    }
    if (!o->policy_check_key[0]) {
        fi_coord_log("no policy_check_key (nor %s): routed requests are not re-checked against the "
                     "residency policy", FI_COORD_POLICY_KEY_ENV);
        return;
    }
    fi_coord_policy_ctx *x = fi_coord_policy_ctx_new(o);
    if (!x) {
        /* Out of memory: the stateless check, slower but as strict. */
        o->policy = fi_coord_policy_check;
        o->policy_user = o;
    } else {
        o->policy = fi_coord_policy_check_cached;
        o->policy_user = x;
        o->policy_free = fi_coord_policy_ctx_free;
    }
    fi_coord_log("routed requests are checked against the newest policy bundle signed by %s (fail "
                 "closed)", o->policy_check_key);
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

/* The newest valid policy: pol (NULL when none, why says why), its
 * bundle version and the end of the bundle's validity. */
typedef struct s_loaded {
    fi_policy *pol;          /* owned */
    uint64_t version;
    int64_t not_after;       /* Unix seconds */
    char why[160];           /* when pol is NULL */
} s_loaded;

static void s_load(const char *db, const char *keyfile, int64_t now, s_loaded *L) {
    uint8_t trusted[1][FI_BUNDLE_PK_BYTES];
    char err[256] = "";
    fi_bundle_info info;
    size_t len = 0;
    char *b = NULL;
    memset(L, 0, sizeof *L);
    if (!keyfile || fi_bundle_pub_load(keyfile, trusted[0], err, sizeof err) != 0) {
        snprintf(L->why, sizeof L->why, "the policy-signing key cannot be read");
    } else if (!(b = s_newest_bundle(db, &len))) {
        snprintf(L->why, sizeof L->why, "no policy bundle in the store");
    } else {
        fi_bundle_status st = fi_bundle_verify(b, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])trusted,
                                               1, 0, now, &info);
        if (st != FI_BUNDLE_OK) {
            snprintf(L->why, sizeof L->why, "%s", fi_bundle_status_str(st));
        } else if (!(L->pol = fi_policy_parse(info.content, info.content_len, NULL))) {
            snprintf(L->why, sizeof L->why, "the newest bundle's policy does not validate");
        } else {
            L->version = info.version;
            L->not_after = info.not_after;
        }
    }
    free(b);
}

int fi_coord_policy_bundle_ok(const fi_coord_opts *o, uint64_t version, const void *bundle,
                              size_t len, char *err, size_t errlen) {
    uint8_t trusted[1][FI_BUNDLE_PK_BYTES];
    char e[256] = "";
    if (!o->policy_check_key[0]) return 0; /* nothing to check with: relayed, edges verify */
    if (fi_bundle_pub_load(o->policy_check_key, trusted[0], e, sizeof e) != 0) {
        snprintf(err, errlen, "the policy-signing key cannot be read: %s", e);
        return -1;
    }
    /* the newest version held, in either table */
    uint64_t held_version = 0;
    sqlite3 *h = NULL;
    static const char *const q[2] = {"SELECT MAX(version) FROM bundles",
                                     "SELECT MAX(version) FROM policy_versions"};
    int read = sqlite3_open_v2(o->db, &h, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK;
    if (read) sqlite3_busy_timeout(h, 2000);
    for (int t = 0; read && t < 2; t++) {
        sqlite3_stmt *stq = NULL;
        int rc = sqlite3_prepare_v2(h, q[t], -1, &stq, NULL);
        if (rc != SQLITE_OK) {
            /* policy_versions exists once a policy was applied here */
            read = t == 1 && strstr(sqlite3_errmsg(h), "no such table") != NULL;
        } else if ((rc = sqlite3_step(stq)) == SQLITE_ROW) {
            if (sqlite3_column_int64(stq, 0) > (int64_t)held_version)
                held_version = (uint64_t)sqlite3_column_int64(stq, 0);
        } else {
            read = 0;
        }
        sqlite3_finalize(stq);
    }
    if (!read) {
        /* unknown what is held: "newer" cannot be checked, so no */
        snprintf(err, errlen, "pushed bundle refused: the store's versions cannot be read (%s)",
                 h ? sqlite3_errmsg(h) : "cannot open");
        sqlite3_close(h);
        return -1;
    }
    sqlite3_close(h);
    fi_bundle_info info;
    fi_bundle_status st = fi_bundle_verify(bundle, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])trusted,
                                           1, held_version, (int64_t)time(NULL), &info);
    if (st != FI_BUNDLE_OK) {
        snprintf(err, errlen, "pushed bundle refused: %s (the store holds version %llu)",
                 fi_bundle_status_str(st), (unsigned long long)held_version);
        return -1;
    }
    if (info.version != version) {
        snprintf(err, errlen, "pushed bundle refused: sent as version %llu, signed as %llu",
                 (unsigned long long)version, (unsigned long long)info.version);
        return -1;
    }
    fi_policy *pol = fi_policy_parse(info.content, info.content_len, NULL);
    if (!pol) {
        snprintf(err, errlen, "pushed bundle refused: its policy does not validate");
        return -1;
    }
    fi_policy_destroy(&pol);
    return 0;
}

/* Decides req for target with L (fail closed when L has no policy). */
static int s_decide(const s_loaded *L, int64_t now, const Fi__InferRequest *req,
                    const fi_peer_rec *origin, const fi_peer_rec *target, fi_coord_verdict *out,
                    char *reason, size_t reasonlen) {
    const fi_policy *pol = L->pol;
    const char *why = pol ? NULL : L->why;
    const char *labels[64];
    size_t n_labels = req->n_labels < 64 ? req->n_labels : 64;
    for (size_t i = 0; i < n_labels; i++) labels[i] = req->labels[i];
    fi_request rq = {0};
    rq.request_id = req->request_id;
    rq.origin_site = origin->site; /* from the edge's key, never the body */
    rq.model = req->model;
    rq.labels = labels;
    rq.n_labels = n_labels;
    /* as the edge decided: its tenant, application and prompt size, as it
     * says them, like the labels (a rule on them holds here too) */
    rq.tenant = req->tenant && req->tenant[0] ? req->tenant : NULL;
    rq.application = req->application && req->application[0] ? req->application : NULL;
    rq.latency_ms = -1;
    rq.prompt_tokens = req->prompt_tokens ? (int64_t)req->prompt_tokens : -1;
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
        const char *zone = pol ? fi_policy_jurisdiction(pol, origin->site) : NULL;
        snprintf(out->zone, sizeof out->zone, "%.63s", zone ? zone : "");
    }
    if (!v.permitted) {
        char ex[256];
        fi_verdict_explain(pol, &v, target->site, ex, sizeof ex);
        if (why)
            snprintf(reason, reasonlen, "no valid policy at the coordinator (%s): %s", why, ex);
        else
            snprintf(reason, reasonlen, "policy version %llu, origin %s: %s",
                     (unsigned long long)L->version, origin->site, ex);
    }
    return v.permitted ? 1 : 0;
}

int fi_coord_policy_check(void *user, const Fi__InferRequest *req, const fi_peer_rec *origin,
                          const fi_peer_rec *target, fi_coord_verdict *out, char *reason,
                          size_t reasonlen) {
    const fi_coord_opts *o = user;
    int64_t now = (int64_t)time(NULL);
    s_loaded L;
    s_load(o->db, o->policy_check_key[0] ? o->policy_check_key : NULL, now, &L);
    int ok = s_decide(&L, now, req, origin, target, out, reason, reasonlen);
    fi_policy_destroy(&L.pol);
    return ok;
}

/* --- the cached check ---------------------------------------------------- */

struct fi_coord_policy_ctx {
    const fi_coord_opts *o;  /* db and key (borrowed) */
    sqlite3 *db;             /* read-only connection, kept */
    s_loaded cur;            /* the policy in force */
    int have;                /* cur was loaded */
    int64_t seen[2];         /* s_versions when loaded */
    struct stat key;         /* the key file when loaded */
};

/* What changes when a bundle is added to either table (-1: none or no
 * table): the newest row of bundles (a bundle of an existing version may
 * be stored again), the newest version of policy_versions. */
static void s_versions(sqlite3 *db, int64_t v[2]) {
    static const char *const q[2] = {"SELECT MAX(id) FROM bundles",
                                     "SELECT MAX(version) FROM policy_versions"};
    for (int t = 0; t < 2; t++) {
        sqlite3_stmt *st = NULL;
        v[t] = -1;
        if (db && sqlite3_prepare_v2(db, q[t], -1, &st, NULL) == SQLITE_OK &&
            sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL)
            v[t] = sqlite3_column_int64(st, 0);
        sqlite3_finalize(st);
    }
}

fi_coord_policy_ctx *fi_coord_policy_ctx_new(const fi_coord_opts *o) {
    fi_coord_policy_ctx *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->o = o;
    if (sqlite3_open_v2(o->db, &x->db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK ||
        sqlite3_busy_timeout(x->db, 2000) != SQLITE_OK) {
        sqlite3_close(x->db); /* checks then open the file each time */
        x->db = NULL;
    }
    return x;
}

void fi_coord_policy_ctx_free(void *p) {
    fi_coord_policy_ctx *x = p;
    if (!x) return;
    fi_policy_destroy(&x->cur.pol);
    sqlite3_close(x->db);
    free(x);
}

int fi_coord_policy_check_cached(void *user, const Fi__InferRequest *req,
                                 const fi_peer_rec *origin, const fi_peer_rec *target,
                                 fi_coord_verdict *out, char *reason, size_t reasonlen) {
    fi_coord_policy_ctx *x = user;
    int64_t now = (int64_t)time(NULL);
    int64_t v[2];
    struct stat ks;
    memset(&ks, 0, sizeof ks);
    s_versions(x->db, v);
    int key_ok = stat(x->o->policy_check_key, &ks) == 0;
    int same = x->have && x->db && x->cur.pol && key_ok && v[0] == x->seen[0] &&
               v[1] == x->seen[1] && ks.st_ino == x->key.st_ino && ks.st_size == x->key.st_size &&
               ks.st_mtime == x->key.st_mtime && now < x->cur.not_after;
    if (!same) {
        /* A new bundle, another key, expiry, or no valid policy yet: load
         * and verify again (the stateless path). */
        fi_policy_destroy(&x->cur.pol);
        s_load(x->o->db, x->o->policy_check_key, now, &x->cur);
        x->have = 1;
        x->seen[0] = v[0];
        x->seen[1] = v[1];
        x->key = ks;
    }
    return s_decide(&x->cur, now, req, origin, target, out, reason, reasonlen);
}
