/*
 * edge_policy.c - the policy the edge enforces and the record it keeps.
 *
 * The policy is the signed bundle held in policy_dir (policy/fi_bundle.h):
 * verified against the trusted signer on every load, never used unsigned,
 * rolled back or expired. With none (or none valid) every decision is the
 * fail-closed fallback: the site itself only. Decisions go through
 * fi_policy_decide_names, which also falls back when the policy expires
 * while held.
 *
 * Every decision is appended to the hash-chained audit log (policy/
 * fi_audit.h) in the edge's SQLite file; a small table of our own there
 * remembers how far the coordinator has acknowledged the log, so an upload
 * resumes after a restart of either side, and another the newest head of
 * the coordinator's own log that it was told (this site's witness of that
 * log, fabric/fi_client.h).
 *
 * Threads: HTTP threads decide and audit at once; the policy pointer is
 * swapped under a read-write lock, the audit log is used under a mutex.
 */
#include <jansson.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "edge_impl.h"
#include "fi_audit.h"
#include "fi_bundle.h"
#include "fi_db.h"

struct edge_policy {
    char dir[FI_CONF_STR_MAX];       /* held bundle ("" : none configured) */
    char site[FI_CONF_STR_MAX];      /* origin of every request */
    char clusters[FI_CONF_STR_MAX];  /* ",a,b," clusters to consider ("" : all) */
    uint8_t trusted[1][FI_BUNDLE_PK_BYTES]; /* the signer we accept */
    int have_key;                    /* trusted is loaded */
    pthread_rwlock_t lk;             /* guards pol, version, status */
    pthread_mutex_t rmu;             /* one reload at a time (SIGHUP, a pushed bundle) */
    fi_policy *pol;                  /* enforced policy, NULL: fallback */
    uint64_t version;                /* its bundle version */
    char status[256];                /* why there is none, for logs and headers */
    pthread_mutex_t amu;             /* guards audit, db */
    fi_audit *audit;                 /* the decision log */
    sqlite3 *db;                     /* our own table (upload mark) */
    _Atomic uint64_t audit_failed;   /* appends that failed */
    _Atomic int64_t audit_failed_ms; /* when the last append failed (monotonic), 0: it did not */
};

static void s_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void s_log(const char *fmt, ...) {
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "edge: %s\n", line);
}

void edge_policy_reload(edge_policy *p) {
    fi_policy *pol = NULL;
    uint64_t version = 0;
    char err[256] = "", status[sizeof p->status];
    fi_bundle_status st = FI_BUNDLE_NONE;
    /* load and swap as one step: a SIGHUP reload that read the disk before
     * a pushed bundle was installed must not swap in after it */
    pthread_mutex_lock(&p->rmu);
    if (p->dir[0] && p->have_key)
        st = fi_bundle_load(p->dir, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])p->trusted, 1,
                            (int64_t)time(NULL), &pol, &version, err, sizeof err);
    pthread_rwlock_wrlock(&p->lk);
    fi_policy_destroy(&p->pol);
    p->pol = pol;
    p->version = version;
    if (st == FI_BUNDLE_OK)
        snprintf(p->status, sizeof p->status, "policy version %llu", (unsigned long long)version);
    else
        /* a status line: the loader's message cut to fit */
        snprintf(p->status, sizeof p->status, "no valid policy (%s%s%.150s): on-site processing only",
                 p->dir[0] ? fi_bundle_status_str(st) : "none configured", err[0] ? ": " : "", err);
    memcpy(status, p->status, sizeof status);
    pthread_rwlock_unlock(&p->lk);
    pthread_mutex_unlock(&p->rmu);
    s_log("%s", status);
}

edge_policy *edge_policy_new(const char *dir, const char *pubkey, const char *db, const char *site,
                             const char *clusters, char *err, size_t errlen) {
    edge_policy *p = calloc(1, sizeof *p);
    if (!p) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    pthread_rwlock_init(&p->lk, NULL);
    pthread_mutex_init(&p->rmu, NULL);
    pthread_mutex_init(&p->amu, NULL);
    snprintf(p->dir, sizeof p->dir, "%s", dir ? dir : "");
    snprintf(p->site, sizeof p->site, "%s", site);
    if (clusters && clusters[0]) {
        size_t k = 0;
        p->clusters[k++] = ',';
        for (const char *c = clusters; *c && k + 2 < sizeof p->clusters; c++)
            if (*c != ' ' && *c != '\t') p->clusters[k++] = *c;
        p->clusters[k++] = ',';
        p->clusters[k] = 0;
    }
    if (pubkey && pubkey[0]) {
        if (fi_bundle_pub_load(pubkey, p->trusted[0], err, errlen) != 0) goto fail;
        p->have_key = 1;
    }
    /* the audit log checks the whole file (fi_db_check): a damaged page
     * anywhere stops the edge here, not at the request whose record meets
     * it; the second connection to the same file needs no second check */
    if (!(p->audit = fi_audit_open(db, err, errlen))) goto fail;
    int rc = sqlite3_open(db, &p->db);
    if (rc == SQLITE_OK)
        rc = sqlite3_exec(p->db,
                          "PRAGMA busy_timeout=5000;"
                          "CREATE TABLE IF NOT EXISTS edge_upload(id INTEGER PRIMARY KEY CHECK(id=1),"
                          " seq INTEGER NOT NULL);"
                          "INSERT OR IGNORE INTO edge_upload(id, seq) VALUES(1, 0);"
                          "CREATE TABLE IF NOT EXISTS edge_witness(id INTEGER PRIMARY KEY CHECK(id=1),"
                          " coordinator TEXT NOT NULL, seq INTEGER NOT NULL, hash TEXT NOT NULL);"
                          "INSERT OR IGNORE INTO edge_witness(id, coordinator, seq, hash) VALUES(1, '', 0, '');",
                          NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        const char *why = p->db ? sqlite3_errmsg(p->db) : "cannot open";
        if (!fi_db_damaged(rc, db, why, err, errlen)) snprintf(err, errlen, "%s: %s", db, why);
        goto fail;
    }
    edge_policy_reload(p);
    return p;
fail:
    edge_policy_destroy(&p);
    return NULL;
}

void edge_policy_destroy(edge_policy **pp) {
    edge_policy *p = *pp;
    if (!p) return;
    *pp = NULL;
    fi_policy_destroy(&p->pol);
    fi_audit_destroy(&p->audit);
    if (p->db) sqlite3_close(p->db);
    pthread_rwlock_destroy(&p->lk);
    pthread_mutex_destroy(&p->rmu);
    pthread_mutex_destroy(&p->amu);
    free(p);
}

uint64_t edge_policy_version(edge_policy *p) {
    pthread_rwlock_rdlock(&p->lk);
    uint64_t v = p->pol ? p->version : 0;
    pthread_rwlock_unlock(&p->lk);
    return v;
}

int edge_policy_install(edge_policy *p, const char *buf, size_t len, char *err, size_t errlen) {
    if (!p->dir[0] || !p->have_key) {
        snprintf(err, errlen, "no policy_dir/policy_key configured: bundle ignored");
        return -1;
    }
    fi_bundle_status st = fi_bundle_install(p->dir, buf, len,
                                            (const uint8_t(*)[FI_BUNDLE_PK_BYTES])p->trusted, 1,
                                            (int64_t)time(NULL), err, errlen);
    if (st != FI_BUNDLE_OK) return -1;
    edge_policy_reload(p);
    return 0;
}

void edge_decision_clear(edge_decision *d) {
    free(d->t);
    d->t = NULL;
    d->n = 0;
}

int edge_policy_decide(edge_policy *p, const char *tenant, const char *app, const char *model,
                       const char *const *labels, int n_labels, int64_t prompt_tokens,
                       edge_decision *d) {
    memset(d, 0, sizeof *d);
    pthread_rwlock_rdlock(&p->lk);
    const fi_policy *pol = p->pol;
    int64_t now = (int64_t)time(NULL);
    int current = pol && fi_policy_current(pol, now);
    const char *zone = current ? fi_policy_jurisdiction(pol, p->site) : NULL;
    snprintf(d->zone, sizeof d->zone, "%.63s", zone ? zone : p->site);
    if (current) {
        snprintf(d->version, sizeof d->version, "%llu", (unsigned long long)p->version);
        fi_policy_digest_hex(pol, d->digest);
    } else {
        snprintf(d->version, sizeof d->version, "none");
        d->fallback = 1;
    }
    /* Candidates: the site, then every cluster of the policy (all of them:
     * one left out would be reported denied though nothing denied it). */
    size_t cap = 1 + (current ? fi_policy_target_count(pol) : 0);
    const char **names = calloc(cap, sizeof *names);
    fi_target_kind *kinds = calloc(cap, sizeof *kinds);
    fi_verdict *v = calloc(cap, sizeof *v);
    d->t = calloc(cap, sizeof *d->t);
    if (!names || !kinds || !v || !d->t) {
        pthread_rwlock_unlock(&p->lk);
        free(names);
        free(kinds);
        free(v);
        edge_decision_clear(d);
        return -1;
    }
    snprintf(d->t[0].name, sizeof d->t[0].name, "%.63s", p->site);
    names[0] = d->t[0].name;
    kinds[0] = FI_TARGET_SITE;
    d->n = 1;
    for (size_t i = 0; current && i < fi_policy_target_count(pol); i++) {
        if (fi_policy_target_kind(pol, i) != FI_TARGET_CLUSTER) continue;
        if (p->clusters[0]) {
            char pat[80];
            snprintf(pat, sizeof pat, ",%.64s,", fi_policy_target_name(pol, i));
            if (!strstr(p->clusters, pat)) continue;
        }
        snprintf(d->t[d->n].name, sizeof d->t[0].name, "%s", fi_policy_target_name(pol, i));
        names[d->n] = d->t[d->n].name;
        kinds[d->n] = FI_TARGET_CLUSTER;
        d->n++;
    }
    /* Labels: the request's, or the policy's default. */
    for (int i = 0; i < n_labels && i < EDGE_MAX_LABELS; i++)
        snprintf(d->labels_buf[d->n_eff_labels++], 64, "%s", labels[i]);
    if (!d->n_eff_labels && current && fi_policy_default_label(pol)) {
        snprintf(d->labels_buf[d->n_eff_labels++], 64, "%s", fi_policy_default_label(pol));
        d->labels_defaulted = 1;
    }
    size_t k = 0;
    for (int i = 0; i < d->n_eff_labels; i++) {
        d->eff_labels[i] = d->labels_buf[i];
        k += (size_t)snprintf(d->labels + k, k < sizeof d->labels ? sizeof d->labels - k : 0,
                              "%s%s", i ? "," : "", d->labels_buf[i]);
    }
    if (!d->labels[0]) snprintf(d->labels, sizeof d->labels, "(none)");
    fi_request rq = {0};
    rq.request_id = NULL;
    rq.tenant = tenant && tenant[0] ? tenant : NULL;
    rq.application = app && app[0] ? app : NULL;
    rq.origin_site = p->site;
    rq.model = model;
    rq.labels = d->eff_labels;
    rq.n_labels = (size_t)d->n_eff_labels;
    rq.latency_ms = -1;
    rq.prompt_tokens = prompt_tokens;
    fi_policy_decide_names(current ? pol : NULL, now, &rq, names, kinds, (size_t)d->n, v);
    for (int i = 0; i < d->n; i++) {
        edge_target *t = &d->t[i];
        t->permitted = v[i].permitted;
        t->score = v[i].score;
        if (v[i].cause == FI_CAUSE_BAD_REQUEST) d->bad_labels = 1;
        fi_verdict_explain(current ? pol : NULL, &v[i], names[i], t->why, sizeof t->why);
        size_t rk = 0;
        unsigned nr = v[i].n_rules < FI_VERDICT_MAX_RULES ? v[i].n_rules : FI_VERDICT_MAX_RULES;
        for (unsigned r = 0; current && r < nr; r++)
            rk += (size_t)snprintf(t->rules + rk, rk < sizeof t->rules ? sizeof t->rules - rk : 0,
                                   "%s%s", r ? "," : "", fi_policy_rule_id(pol, v[i].rules[r]));
        if (current && !v[i].permitted && !nr && v[i].cause == FI_CAUSE_DEFAULT_DENY)
            snprintf(t->rules, sizeof t->rules, "default deny");
        if (!current && !v[i].permitted)
            snprintf(t->rules, sizeof t->rules, "no valid policy: on-site only");
    }
    pthread_rwlock_unlock(&p->lk);
    free(names);
    free(kinds);
    free(v);
    return 0;
}

/* Appends r; counts and logs a failure (reason in err). */
static int64_t s_mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int s_append(edge_policy *p, fi_audit_record *r, char *err, size_t errlen) {
    pthread_mutex_lock(&p->amu);
    int rc = fi_audit_append(p->audit, r, err, errlen);
    /* under the lock: the state is the last append's */
    atomic_store(&p->audit_failed_ms, rc != 0 ? s_mono_ms() : 0);
    pthread_mutex_unlock(&p->amu);
    if (rc != 0) {
        atomic_fetch_add(&p->audit_failed, 1);
        s_log("audit: cannot append the record for %s (%s): %s", r->request_id, r->decision, err);
    }
    return rc;
}

uint64_t edge_policy_audit_failures(edge_policy *p, int *failing) {
    if (failing) {
        int64_t t = atomic_load(&p->audit_failed_ms);
        *failing = t != 0 && s_mono_ms() - t < EDGE_AUDIT_DEGRADED_MS;
    }
    return atomic_load(&p->audit_failed);
}

int edge_policy_audit(edge_policy *p, const char *request_id, const char *tenant, const char *app,
                      const char *model, const edge_decision *d, const char *decision,
                      const char *target, const char *rules, int64_t prompt_tokens, char *err,
                      size_t errlen) {
    fi_audit_record r;
    memset(&r, 0, sizeof r);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r.time = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    r.request_id = request_id;
    r.tenant = tenant ? tenant : "";
    r.application = app ? app : "";
    r.origin = p->site;
    r.labels = d->labels;
    r.model = model;
    r.latency_ms = -1;
    r.prompt_tokens = prompt_tokens;
    r.decision = decision;
    r.target = target;
    r.rules = rules;
    r.policy_digest = d->digest;
    return s_append(p, &r, err, errlen);
}

void edge_policy_audit_note(edge_policy *p, const char *request_id, const char *model,
                            const char *labels, const char *decision, const char *target,
                            const char *rules) {
    fi_audit_record r;
    memset(&r, 0, sizeof r);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r.time = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    r.request_id = request_id;
    r.tenant = "";
    r.application = "";
    r.origin = p->site;
    r.labels = labels;
    r.model = model;
    r.latency_ms = -1;
    r.prompt_tokens = -1;
    r.decision = decision;
    r.target = target;
    r.rules = rules;
    r.policy_digest = "";
    char err[512];
    (void)s_append(p, &r, err, sizeof err); /* the request is answered already */
}

typedef struct s_batch {
    int64_t after;   /* records with seq > after */
    int max;         /* at most */
    json_t *arr;     /* collected */
    int64_t last;    /* last seq taken */
    int stuck;       /* stopped at a record JSON cannot carry */
} s_batch;

static int s_collect(const fi_audit_record *r, void *arg) {
    s_batch *b = arg;
    if (r->seq <= b->after) return 0;
    json_t *o =
        json_pack("{s:I,s:I,s:s,s:s,s:s,s:s,s:s,s:s,s:I,s:s,s:s,s:s,s:s,s:s}", "seq",
                  (json_int_t)r->seq, "time", (json_int_t)r->time, "request_id", r->request_id,
                  "tenant", r->tenant, "application", r->application, "origin", r->origin,
                  "labels", r->labels, "model", r->model, "prompt_tokens",
                  (json_int_t)r->prompt_tokens, "decision", r->decision, "target", r->target,
                  "rules", r->rules, "policy_digest", r->policy_digest, "hash", r->hash);
    if (!o) {
        /* not JSON (a record written before texts were made valid UTF-8):
         * the batch ends before it, never with a gap */
        if (!b->stuck) fprintf(stderr, "edge: audit: record %lld cannot be sent as JSON\n", (long long)r->seq);
        b->stuck = 1;
        return 1;
    }
    json_array_append_new(b->arr, o);
    b->last = r->seq;
    return (int)json_array_size(b->arr) >= b->max;
}

char *edge_policy_audit_batch(edge_policy *p, int64_t after, int max, int64_t *last,
                              int64_t *count) {
    s_batch b = {after, max, json_array(), after, 0};
    char err[256];
    /* from the record after the mark on (the key's index): without the
     * filter SQLite sorted the whole log before the first row, under the
     * lock every decision's record waits for (2 s at a million records) */
    fi_audit_filter f = {.after_seq = after};
    pthread_mutex_lock(&p->amu);
    int rc = fi_audit_query(p->audit, &f, s_collect, &b, err, sizeof err);
    pthread_mutex_unlock(&p->amu);
    char *out = NULL;
    if (rc == 0 && json_array_size(b.arr)) {
        out = json_dumps(b.arr, JSON_COMPACT);
        *last = b.last;
        *count = (int64_t)json_array_size(b.arr);
    }
    json_decref(b.arr);
    return out;
}

/* The one integer that sql selects from the audit database, or 0 when it
 * selects nothing (or fails). */
static int64_t s_select_int64(edge_policy *p, const char *sql) {
    int64_t v = 0;
    sqlite3_stmt *st = NULL;
    pthread_mutex_lock(&p->amu);
    if (sqlite3_prepare_v2(p->db, sql, -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    pthread_mutex_unlock(&p->amu);
    return v;
}

int64_t edge_policy_uploaded(edge_policy *p) {
    return s_select_int64(p, "SELECT seq FROM edge_upload WHERE id=1");
}

void edge_policy_set_uploaded(edge_policy *p, int64_t seq) {
    sqlite3_stmt *st = NULL;
    pthread_mutex_lock(&p->amu);
    if (sqlite3_prepare_v2(p->db, "UPDATE edge_upload SET seq=?1 WHERE id=1 AND seq<?1", -1, &st,
                           NULL) == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, seq);
        if (sqlite3_step(st) != SQLITE_DONE) s_log("audit: cannot record the upload mark");
    }
    sqlite3_finalize(st);
    pthread_mutex_unlock(&p->amu);
}

/* The witness row of db: 1 with a valid one, 0 none, -1 (SQLite). */
static int s_witness_get(sqlite3 *db, char coord[128], int64_t *seq, char hash[65]) {
    sqlite3_stmt *st = NULL;
    *seq = 0;
    hash[0] = coord[0] = 0;
    int r = sqlite3_prepare_v2(db, "SELECT coordinator, seq, hash FROM edge_witness WHERE id=1", -1, &st, NULL);
    if (r == SQLITE_OK && (r = sqlite3_step(st)) == SQLITE_ROW) {
        const char *c = (const char *)sqlite3_column_text(st, 0), *h = (const char *)sqlite3_column_text(st, 2);
        if (c && h && fi_audit_head_valid(sqlite3_column_int64(st, 1), h)) {
            snprintf(coord, 128, "%s", c);
            *seq = sqlite3_column_int64(st, 1);
            snprintf(hash, 65, "%s", h);
        }
    }
    sqlite3_finalize(st);
    return r == SQLITE_ROW ? *seq > 0 : r == SQLITE_DONE ? 0 : -1;
}

static int s_witness_set(sqlite3 *db, const char *coord, int64_t seq, const char *hash) {
    sqlite3_stmt *st = NULL;
    int r = sqlite3_prepare_v2(db, "UPDATE edge_witness SET coordinator=?1, seq=?2, hash=?3 WHERE id=1", -1, &st,
                               NULL);
    if (r == SQLITE_OK) {
        sqlite3_bind_text(st, 1, coord, -1, SQLITE_TRANSIENT);
        sqlite3_bind_int64(st, 2, seq);
        sqlite3_bind_text(st, 3, hash, -1, SQLITE_TRANSIENT);
        r = sqlite3_step(st);
    }
    sqlite3_finalize(st);
    return r == SQLITE_DONE ? 0 : -1;
}

void edge_policy_witness(edge_policy *p, const char *coordinator, int64_t *seq, char hash[65]) {
    char coord[128];
    pthread_mutex_lock(&p->amu);
    int r = s_witness_get(p->db, coord, seq, hash);
    pthread_mutex_unlock(&p->amu);
    if (r > 0 && strcmp(coord, coordinator)) {
        s_log("audit: the coordinator's audit head kept here (record %lld) is of another coordinator (%.64s), not "
              "of %.64s: starting afresh",
              (long long)*seq, coord, coordinator);
        *seq = 0;
        hash[0] = 0;
    }
}

void edge_policy_set_witness(edge_policy *p, const char *coordinator, int64_t seq, const char *hash) {
    pthread_mutex_lock(&p->amu);
    if (s_witness_set(p->db, coordinator, seq, hash) != 0)
        s_log("audit: cannot keep the coordinator's audit head (witness of record %lld): %s", (long long)seq,
              sqlite3_errmsg(p->db));
    pthread_mutex_unlock(&p->amu);
}

int edge_witness_cmd(const char *db, int reset, char *out, size_t cap, char *err, size_t errlen) {
    sqlite3 *h = NULL;
    char coord[128], hash[65];
    int64_t seq;
    int rc = -1;
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "%s: %s", db, h ? sqlite3_errmsg(h) : "cannot open");
        goto done;
    }
    sqlite3_busy_timeout(h, 5000);
    int r = s_witness_get(h, coord, &seq, hash);
    if (r < 0) {
        snprintf(err, errlen, "%s: %s (has this agent ever run with a coordinator?)", db, sqlite3_errmsg(h));
        goto done;
    }
    if (!r) {
        snprintf(out, cap, "%s: no head of a coordinator's audit log witnessed", db);
    } else if (reset) {
        if (s_witness_set(h, "", 0, "") != 0) {
            snprintf(err, errlen, "%s: %s", db, sqlite3_errmsg(h));
            goto done;
        }
        snprintf(out, cap, "%s: witness of coordinator %s's audit log (record %lld, hash %s) reset", db, coord,
                 (long long)seq, hash);
    } else {
        snprintf(out, cap, "%s: witness of coordinator %s's audit log: record %lld, hash %s", db, coord,
                 (long long)seq, hash);
    }
    rc = 0;
done:
    sqlite3_close(h);
    return rc;
}

int64_t edge_policy_audit_head(edge_policy *p) {
    return s_select_int64(p, "SELECT COALESCE(MAX(seq),0) FROM audit");
}
