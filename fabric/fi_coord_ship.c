/*
 * fi_coord_ship.c - policy shipping and the audit log at the coordinator.
 * See fi_coord_ship.h.
 */
#include "fi_coord_ship.h"
#include "fi_coord.h"

#include <errno.h>
#include <jansson.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "fi_conf.h"
#include "fi_pstore.h"

#define S_MAX_HISTORY 1000       /* versions in one history reply */
#define S_MAX_RECORDS 2000       /* audit records in one reply */
#define S_REPLY_BUDGET (768u << 10) /* bytes of records in one reply */
#define S_MAX_FIELD 4096         /* bytes of one string of an uploaded record */
#define S_MAX_DIAG_TEXT 16384    /* bytes of the checker's messages in a refusal */

struct fi_ship {
    fi_pstore *ps;                   /* policy versions (in the coordinator's database) */
    fi_audit *au;                    /* the coordinator's audit log */
    fi_store *fleet;                 /* borrowed: raw copies of uploaded batches */
    uint8_t sk[FI_BUNDLE_SK_BYTES];  /* policy-signing key (wiped on destroy) */
    int have_key;                    /* 0: apply and rollback are refused */
    char key_path[FI_CONF_STR_MAX];  /* for the message when it is missing */
    int64_t valid_s;                 /* default bundle validity */
};

void fi_ship_paths(const char *db, const char *policy_key, const char *audit_db, char *key, size_t keycap,
                   char *audit, size_t auditcap) {
    if (key) {
        if (policy_key && policy_key[0]) snprintf(key, keycap, "%s", policy_key);
        else snprintf(key, keycap, "%s.policy.key", db);
    }
    if (audit) {
        if (audit_db && audit_db[0]) snprintf(audit, auditcap, "%s", audit_db);
        else snprintf(audit, auditcap, "%s.audit", db);
    }
}

int fi_ship_keygen(const char *key_path, char pub_hex[65], int *created, char *err, size_t errlen) {
    uint8_t pk[FI_BUNDLE_PK_BYTES], sk[FI_BUNDLE_SK_BYTES];
    struct stat sb;
    *created = 0;
    if (sodium_init() < 0) {
        snprintf(err, errlen, "libsodium failed to initialise");
        return -1;
    }
    int rc = -1;
    if (stat(key_path, &sb) == 0) {
        if (fi_bundle_key_load(key_path, sk, err, errlen) != 0) goto done;
    } else if (errno != ENOENT) {
        snprintf(err, errlen, "%s: %s", key_path, strerror(errno));
        goto done;
    } else {
        if (fi_bundle_keygen(pk, sk) != 0) {
            snprintf(err, errlen, "cannot make a policy-signing key");
            goto done;
        }
        if (fi_bundle_key_save(key_path, sk, err, errlen) != 0) goto done;
        *created = 1;
    }
    crypto_sign_ed25519_sk_to_pk(pk, sk);
    sodium_bin2hex(pub_hex, 65, pk, sizeof pk);
    rc = 0;
done:
    sodium_memzero(sk, sizeof sk);
    return rc;
}

/* fi_audit_set_adopt_check for uploads: an edge's new key may continue
 * the log of a key of an edge of the same site that was revoked (replaced);
 * never another site's, a live key's, or the router's own. */
typedef struct s_adopt_scan {
    const char *fpr, *site;
    int ok;
} s_adopt_scan;

static int s_adopt_row(void *user, const fi_peer_rec *p) {
    s_adopt_scan *a = user;
    if (strcmp(p->fpr, a->fpr)) return 0;
    a->ok = p->role == FI__ROLE__ROLE_EDGE && p->revoked && !strcmp(p->site, a->site);
    return 1;
}

static int s_may_adopt(void *user, const char *old_source, const char *origin) {
    fi_ship *s = user;
    s_adopt_scan a = {old_source, origin, 0};
    if (!s->fleet || fi_store_peer_each(s->fleet, s_adopt_row, &a) < 0) return 0;
    return a.ok;
}

fi_ship *fi_ship_open(fi_store *fleet, const char *db, const char *audit_db, const char *key_path, int64_t valid_s, char *err,
                      size_t errlen) {
    fi_ship *s = calloc(1, sizeof *s);
    if (!s || sodium_init() < 0) {
        free(s);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->valid_s = valid_s > 0 ? valid_s : FI_SHIP_DEFAULT_VALID_S;
    s->fleet = fleet;
    snprintf(s->key_path, sizeof s->key_path, "%s", key_path ? key_path : "");
    if (!(s->ps = fi_pstore_open(db, err, errlen)) || !(s->au = fi_audit_open(audit_db, err, errlen))) {
        fi_ship_destroy(&s);
        return NULL;
    }
    /* used on the coordinator's event loop: a lock held elsewhere fails a
     * request soon, with its reason (an upload is sent again later) */
    fi_pstore_busy_timeout(s->ps, FI_SHIP_BUSY_MS);
    fi_audit_busy_timeout(s->au, FI_SHIP_BUSY_MS);
    fi_audit_set_adopt_check(s->au, s_may_adopt, s);
    struct stat sb;
    if (key_path && key_path[0] && stat(key_path, &sb) == 0) {
        if (fi_bundle_key_load(key_path, s->sk, err, errlen) != 0) {
            fi_ship_destroy(&s);
            return NULL;
        }
        s->have_key = 1;
    } else {
        fi_coord_log("no policy-signing key at %s: policy apply and rollback are refused until "
              "`fedinfer coordinator --init` makes one",
              key_path ? key_path : "(none)");
    }
    return s;
}

void fi_ship_destroy(fi_ship **sp) {
    if (!sp || !*sp) return;
    fi_ship *s = *sp;
    fi_pstore_destroy(&s->ps);
    fi_audit_destroy(&s->au);
    sodium_memzero(s->sk, sizeof s->sk);
    free(s);
    *sp = NULL;
}

fi_audit *fi_ship_audit(fi_ship *s) { return s->au; }

int fi_ship_serves(fi_msg_type t) {
    switch (t) {
    case FI__ENVELOPE__BODY_POLICY_APPLY:
    case FI__ENVELOPE__BODY_POLICY_ROLLBACK:
    case FI__ENVELOPE__BODY_POLICY_HISTORY_REQUEST:
    case FI__ENVELOPE__BODY_POLICY_GET:
    case FI__ENVELOPE__BODY_AUDIT_QUERY:
    case FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST:
    case FI__ENVELOPE__BODY_AUDIT_UPLOAD: return 1;
    default: return 0;
    }
}

/* --- replies -------------------------------------------------------------- */

static uint8_t *s_error(Fi__ErrorCode code, const char *msg, size_t *len) {
    return fi_wire_error("", code, msg, len);
}

/* strlen bounded: 1 when s is non-NULL and at most max bytes. */
static int s_len_ok(const char *s, size_t max) { return s && strnlen(s, max + 1) <= max; }

/* The checker's messages for content: *errors and the formatted lines
 * (errors first) into text; warnings into a malloc'd array of strings. */
typedef struct s_diag {
    size_t errors;       /* error count */
    char *text;          /* the errors, one per line (malloc'd) */
    char **warnings;     /* each warning, formatted (malloc'd) */
    size_t n_warnings;   /* entries */
    char digest[65];     /* of the content, when it validates */
} s_diag;

static void s_diag_free(s_diag *d) {
    free(d->text);
    for (size_t i = 0; i < d->n_warnings; i++) free(d->warnings[i]);
    free(d->warnings);
    memset(d, 0, sizeof *d);
}

/* 0, or -1 when out of memory. */
static int s_diagnose(const char *content, size_t len, s_diag *out) {
    memset(out, 0, sizeof *out);
    fi_diags *d = fi_diags_new();
    if (!d) return -1;
    fi_policy *pol = fi_policy_parse(content, len, d);
    size_t n = fi_diags_count(d);
    out->errors = fi_diags_errors(d);
    out->text = calloc(1, S_MAX_DIAG_TEXT);
    out->warnings = calloc(n ? n : 1, sizeof *out->warnings);
    if (!out->text || !out->warnings) goto oom;
    size_t used = 0;
    for (size_t i = 0; i < n; i++) {
        const fi_diag *g = fi_diags_get(d, i);
        char line[1024];
        fi_diag_format(g, "policy", line, sizeof line);
        if (g->level == FI_DIAG_ERROR) {
            if (used + strlen(line) + 2 < S_MAX_DIAG_TEXT)
                used += (size_t)snprintf(out->text + used, S_MAX_DIAG_TEXT - used, "%s%s", used ? "\n" : "", line);
        } else if (!(out->warnings[out->n_warnings++] = strdup(line))) {
            goto oom;
        }
    }
    if (pol) fi_policy_digest_hex(pol, out->digest);
    if (!pol && !out->errors) { /* no policy and no error: out of memory */
        fi_diags_destroy(&d);
        s_diag_free(out);
        return -1;
    }
    fi_policy_destroy(&pol);
    fi_diags_destroy(&d);
    return 0;
oom:
    fi_policy_destroy(&pol);
    fi_diags_destroy(&d);
    s_diag_free(out);
    return -1;
}

/* Encodes the PolicyBundle message of version v; NULL when none. */
static uint8_t *s_bundle_msg(fi_ship *s, uint64_t v, size_t *len, fi_pstore_version *info) {
    char *bundle = NULL, err[256];
    size_t blen = 0;
    fi_pstore_version sv;
    if (fi_pstore_get(s->ps, v, &sv, NULL, NULL, &bundle, &blen, err, sizeof err) != 0) return NULL;
    Fi__PolicyBundle pb = FI__POLICY_BUNDLE__INIT;
    pb.version = sv.version;
    pb.bundle.data = (uint8_t *)bundle;
    pb.bundle.len = blen;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_POLICY_BUNDLE;
    m.policy_bundle = &pb;
    uint8_t *out = fi_wire_encode(&m, len);
    free(bundle);
    if (info) *info = sv;
    return out;
}

uint8_t *fi_ship_active_bundle(fi_ship *s, uint64_t held, size_t *len) {
    fi_pstore_version v;
    char err[256];
    if (fi_pstore_get(s->ps, 0, &v, NULL, NULL, NULL, NULL, err, sizeof err) != 0 || v.version <= held) return NULL;
    return s_bundle_msg(s, v.version, len, NULL);
}

/* After a new version v: push its bundle, answer with PolicyReply. */
static uint8_t *s_shipped(fi_ship *s, uint64_t v, const s_diag *dg, fi_ship_push_fn push, void *push_user,
                          const fi_peer_rec *from, size_t *len) {
    fi_pstore_version sv;
    size_t blen = 0;
    uint8_t *bmsg = s_bundle_msg(s, v, &blen, &sv);
    if (!bmsg) return s_error(FI__ERROR_CODE__ERR_INTERNAL, "the new version cannot be read back", len);
    int pushed = push ? push(push_user, bmsg, blen) : 0;
    free(bmsg);
    fi_coord_log("operator %s stored policy version %llu (digest %.16s%s), pushed to %d edge(s)", from->fpr,
          (unsigned long long)v, sv.digest, sv.rollback_of ? ", a rollback" : "", pushed);
    Fi__PolicyReply r = FI__POLICY_REPLY__INIT;
    r.version = v;
    r.digest = sv.digest;
    r.n_warnings = dg->n_warnings;
    r.warnings = dg->warnings;
    r.not_before = sv.not_before;
    r.not_after = sv.not_after;
    r.pushed = (uint32_t)(pushed > 0 ? pushed : 0);
    r.rollback_of = sv.rollback_of;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_POLICY_REPLY;
    m.policy_reply = &r;
    return fi_wire_encode(&m, len);
}

static uint8_t *s_no_key(fi_ship *s, size_t *len) {
    char msg[FI_CONF_STR_MAX + 160];
    snprintf(msg, sizeof msg,
             "the coordinator has no policy-signing key (%s); run `fedinfer coordinator --init` to make one",
             s->key_path);
    return s_error(FI__ERROR_CODE__ERR_INTERNAL, msg, len);
}

/* valid_for from a requested not-after (0: the default). -1 if in the past. */
static int64_t s_valid_for(fi_ship *s, uint64_t not_after_s, int64_t now) {
    if (!not_after_s) return s->valid_s;
    if (not_after_s > (uint64_t)INT64_MAX / 2 || (int64_t)not_after_s <= now) return -1;
    return (int64_t)not_after_s - now;
}

int fi_ship_reserve(fi_ship *s, uint64_t v, char *err, size_t errlen) {
    return fi_pstore_reserve(s->ps, v, err, errlen);
}

static uint8_t *s_apply(fi_ship *s, const fi_peer_rec *from, const Fi__PolicyApply *a, fi_ship_push_fn push,
                        void *push_user, size_t *len) {
    if (!a->content || !a->content[0] || !s_len_ok(a->content, FI_WIRE_MAX_POLICY) ||
        !s_len_ok(a->comment ? a->comment : "", FI_WIRE_MAX_COMMENT))
        return s_error(FI__ERROR_CODE__ERR_BAD_REQUEST,
                       "policy apply needs a policy of 1..458752 bytes and a comment of at most 500 bytes", len);
    if (!s->have_key) return s_no_key(s, len);
    int64_t now = (int64_t)time(NULL), valid_for = s_valid_for(s, a->not_after_s, now);
    if (valid_for <= 0) return s_error(FI__ERROR_CODE__ERR_BAD_REQUEST, "the requested not-after is in the past", len);
    size_t clen = strlen(a->content);
    s_diag dg;
    if (s_diagnose(a->content, clen, &dg) != 0) return s_error(FI__ERROR_CODE__ERR_INTERNAL, "out of memory", len);
    uint8_t *out;
    if (dg.errors) {
        char *msg = malloc(S_MAX_DIAG_TEXT + 128);
        if (msg) snprintf(msg, S_MAX_DIAG_TEXT + 128, "policy refused: %zu error(s):\n%s", dg.errors, dg.text);
        fi_coord_log("operator %s: policy refused, %zu error(s)", from->fpr, dg.errors);
        out = s_error(FI__ERROR_CODE__ERR_BAD_REQUEST, msg ? msg : "policy refused", len);
        free(msg);
        s_diag_free(&dg);
        return out;
    }
    uint64_t v = 0;
    char err[800];
    int prc = fi_pstore_apply(s->ps, a->content, clen, from->fpr, a->comment ? a->comment : "", s->sk, now,
                              valid_for, &v, err, sizeof err);
    if (prc != 0) {
        fi_coord_log("operator %s: policy apply failed: %s", from->fpr, err);
        out = s_error(prc == FI_PSTORE_FAILED ? FI__ERROR_CODE__ERR_INTERNAL : FI__ERROR_CODE__ERR_BAD_REQUEST, err,
                      len);
    } else {
        out = s_shipped(s, v, &dg, push, push_user, from, len);
    }
    s_diag_free(&dg);
    return out;
}

static uint8_t *s_rollback(fi_ship *s, const fi_peer_rec *from, const Fi__PolicyRollback *rb, fi_ship_push_fn push,
                           void *push_user, size_t *len) {
    if (!rb->version || !s_len_ok(rb->comment ? rb->comment : "", FI_WIRE_MAX_COMMENT))
        return s_error(FI__ERROR_CODE__ERR_BAD_REQUEST,
                       "policy rollback needs a version >= 1 and a comment of at most 500 bytes", len);
    if (!s->have_key) return s_no_key(s, len);
    char err[800], *content = NULL;
    size_t clen = 0;
    fi_pstore_version old;
    int r = fi_pstore_get(s->ps, rb->version, &old, &content, &clen, NULL, NULL, err, sizeof err);
    if (r) {
        if (r > 0) snprintf(err, sizeof err, "no policy version %llu", (unsigned long long)rb->version);
        return s_error(r > 0 ? FI__ERROR_CODE__ERR_NOT_FOUND : FI__ERROR_CODE__ERR_INTERNAL, err, len);
    }
    s_diag dg;
    int drc = s_diagnose(content, clen, &dg);
    free(content);
    if (drc != 0) return s_error(FI__ERROR_CODE__ERR_INTERNAL, "out of memory", len);
    uint64_t v = 0;
    uint8_t *out;
    int64_t now = (int64_t)time(NULL);
    int prc = fi_pstore_rollback(s->ps, rb->version, from->fpr, rb->comment ? rb->comment : "", s->sk, now,
                                 s->valid_s, &v, err, sizeof err);
    if (prc != 0) {
        fi_coord_log("operator %s: rollback to %llu failed: %s", from->fpr, (unsigned long long)rb->version, err);
        out = s_error(prc == FI_PSTORE_FAILED ? FI__ERROR_CODE__ERR_INTERNAL : FI__ERROR_CODE__ERR_BAD_REQUEST, err,
                      len);
    } else {
        out = s_shipped(s, v, &dg, push, push_user, from, len);
    }
    s_diag_free(&dg);
    return out;
}

/* --- history and get ------------------------------------------------------- */

typedef struct s_hist {
    Fi__PolicyVersion *rows;  /* ring of the newest S_MAX_HISTORY */
    char (*strs)[3][512];     /* author, digest, comment per row */
    size_t n;                 /* versions seen */
} s_hist;

static void s_version_fill(Fi__PolicyVersion *pv, const fi_pstore_version *v, char *author, char *digest,
                           char *comment) {
    fi__policy_version__init(pv);
    pv->version = v->version;
    pv->created = v->created;
    snprintf(author, 512, "%s", v->author);
    snprintf(digest, 512, "%s", v->digest);
    snprintf(comment, 512, "%s", v->comment);
    pv->author = author;
    pv->digest = digest;
    pv->comment = comment;
    pv->not_before = v->not_before;
    pv->not_after = v->not_after;
    pv->rollback_of = v->rollback_of;
}

static int s_hist_row(const fi_pstore_version *v, void *arg) {
    s_hist *h = arg;
    size_t i = h->n++ % S_MAX_HISTORY;
    s_version_fill(&h->rows[i], v, h->strs[i][0], h->strs[i][1], h->strs[i][2]);
    return 0;
}

static uint8_t *s_history(fi_ship *s, size_t *len) {
    s_hist h = {calloc(S_MAX_HISTORY, sizeof(Fi__PolicyVersion)), calloc(S_MAX_HISTORY, sizeof *h.strs), 0};
    Fi__PolicyVersion **ptrs = calloc(S_MAX_HISTORY, sizeof *ptrs);
    char err[400];
    uint8_t *out;
    if (!h.rows || !h.strs || !ptrs) {
        out = s_error(FI__ERROR_CODE__ERR_INTERNAL, "out of memory", len);
    } else if (fi_pstore_history(s->ps, s_hist_row, &h, err, sizeof err) != 0) {
        out = s_error(FI__ERROR_CODE__ERR_INTERNAL, err, len);
    } else {
        size_t k = h.n < S_MAX_HISTORY ? h.n : S_MAX_HISTORY;
        for (size_t i = 0; i < k; i++) ptrs[i] = &h.rows[(h.n - k + i) % S_MAX_HISTORY];
        Fi__PolicyHistoryReply r = FI__POLICY_HISTORY_REPLY__INIT;
        r.n_versions = k;
        r.versions = ptrs;
        r.truncated = h.n > k;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_POLICY_HISTORY_REPLY;
        m.policy_history_reply = &r;
        out = fi_wire_encode(&m, len);
    }
    free(h.rows);
    free(h.strs);
    free(ptrs);
    return out;
}

static uint8_t *s_get(fi_ship *s, const Fi__PolicyGet *g, size_t *len) {
    char err[400], *content = NULL, *bundle = NULL;
    size_t clen = 0, blen = 0;
    fi_pstore_version v;
    int r = fi_pstore_get(s->ps, g->version, &v, &content, &clen, g->with_bundle ? &bundle : NULL,
                          g->with_bundle ? &blen : NULL, err, sizeof err);
    if (r) {
        if (r > 0)
            snprintf(err, sizeof err, g->version ? "no policy version %llu" : "no policy has been applied yet",
                     (unsigned long long)g->version);
        return s_error(r > 0 ? FI__ERROR_CODE__ERR_NOT_FOUND : FI__ERROR_CODE__ERR_INTERNAL, err, len);
    }
    char *text = malloc(clen + 1);
    uint8_t *out;
    if (!text) {
        out = s_error(FI__ERROR_CODE__ERR_INTERNAL, "out of memory", len);
    } else {
        memcpy(text, content, clen);
        text[clen] = 0;
        char a[512], d[512], c[512];
        Fi__PolicyVersion pv;
        s_version_fill(&pv, &v, a, d, c);
        Fi__PolicyContent pc = FI__POLICY_CONTENT__INIT;
        pc.info = &pv;
        pc.content = text;
        pc.bundle.data = (uint8_t *)bundle;
        pc.bundle.len = blen;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_POLICY_CONTENT;
        m.policy_content = &pc;
        out = fi_wire_encode(&m, len);
        if (!out) out = s_error(FI__ERROR_CODE__ERR_TOO_LARGE, "the policy does not fit one message", len);
    }
    free(text);
    free(content);
    free(bundle);
    return out;
}

/* --- audit ----------------------------------------------------------------- */

static const char *s_nz_str(const char *s) { return s ? s : ""; }

/* One record copied out of a query callback: the struct and its strings
 * in one allocation. */
static Fi__AuditRecord *s_rec_copy(const fi_audit_record *r, size_t *bytes) {
    const char *src[14] = {r->request_id, r->tenant,        r->application, r->origin, r->labels,
                           r->model,      r->decision,      r->target,      r->rules,  r->policy_digest,
                           r->hash,       s_nz_str(r->source), r->source_hash, NULL};
    size_t need = sizeof(Fi__AuditRecord);
    for (int i = 0; src[i]; i++) need += strlen(src[i]) + 1;
    Fi__AuditRecord *a = malloc(need);
    if (!a) return NULL;
    fi__audit_record__init(a);
    char *p = (char *)(a + 1);
    char **dst[13] = {&a->request_id, &a->tenant, &a->application,   &a->origin, &a->labels,
                      &a->model,      &a->decision, &a->target,      &a->rules,  &a->policy_digest,
                      &a->hash,       &a->source, &a->source_hash};
    for (int i = 0; src[i]; i++) {
        size_t n = strlen(src[i]) + 1;
        memcpy(p, src[i], n);
        *dst[i] = p;
        p += n;
    }
    a->seq = (uint64_t)r->seq;
    a->time_ms = r->time;
    a->latency_ms = r->latency_ms;
    a->prompt_tokens = r->prompt_tokens;
    a->source_seq = r->source_seq > 0 ? (uint64_t)r->source_seq : 0;
    a->received_ms = r->received;
    *bytes = need + 96;
    return a;
}

typedef struct s_rows {
    Fi__AuditRecord **recs;  /* collected */
    size_t n;                /* entries */
    size_t bytes;            /* about what they take on the wire */
    int more;                /* stopped on the budget */
    int oom;                 /* out of memory */
} s_rows;

static int s_row(const fi_audit_record *r, void *arg) {
    s_rows *rs = arg;
    if (rs->n >= S_MAX_RECORDS || rs->bytes >= S_REPLY_BUDGET) {
        rs->more = 1;
        return 1;
    }
    size_t b = 0;
    Fi__AuditRecord *a = s_rec_copy(r, &b);
    if (!a) {
        rs->oom = 1;
        return 1;
    }
    rs->recs[rs->n++] = a;
    rs->bytes += b;
    return 0;
}

static const char *s_filter_str(const char *s) { return s && s[0] ? s : NULL; }

static uint8_t *s_audit_query(fi_ship *s, const Fi__AuditQuery *q, size_t *len) {
    const char *strs[] = {q->site, q->label, q->target, q->rule, q->request_id, q->decision};
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++)
        if (!s_len_ok(strs[i] ? strs[i] : "", FI_WIRE_MAX_FILTER))
            return s_error(FI__ERROR_CODE__ERR_BAD_REQUEST, "an audit filter is longer than 256 bytes", len);
    if (q->since_ms < 0 || q->until_ms < 0 || q->after_seq > (uint64_t)INT64_MAX)
        return s_error(FI__ERROR_CODE__ERR_BAD_REQUEST, "audit times and sequence numbers are not negative", len);
    fi_audit_filter f;
    memset(&f, 0, sizeof f);
    f.since_ms = q->since_ms;
    f.until_ms = q->until_ms;
    f.origin = s_filter_str(q->site);
    f.label = s_filter_str(q->label);
    f.target = s_filter_str(q->target);
    f.rule = s_filter_str(q->rule);
    f.request_id = s_filter_str(q->request_id);
    f.decision = s_filter_str(q->decision);
    f.limit = q->limit;
    f.after_seq = (int64_t)q->after_seq;
    s_rows rs = {calloc(S_MAX_RECORDS, sizeof(Fi__AuditRecord *)), 0, 0, 0, 0};
    char err[400];
    uint8_t *out;
    if (!rs.recs) {
        out = s_error(FI__ERROR_CODE__ERR_INTERNAL, "out of memory", len);
    } else if (fi_audit_query(s->au, &f, s_row, &rs, err, sizeof err) != 0 || rs.oom) {
        out = s_error(FI__ERROR_CODE__ERR_INTERNAL, rs.oom ? "out of memory" : err, len);
    } else {
        Fi__AuditRecords ar = FI__AUDIT_RECORDS__INIT;
        ar.n_records = rs.n;
        ar.records = rs.recs;
        ar.more = rs.more;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_AUDIT_RECORDS;
        m.audit_records = &ar;
        out = fi_wire_encode(&m, len);
    }
    for (size_t i = 0; i < rs.n; i++) free(rs.recs[i]);
    free(rs.recs);
    return out;
}

uint8_t *fi_ship_verify_reply(int rc, const fi_audit_check *ck, const char *err, size_t *len) {
    if (rc < 0) return s_error(FI__ERROR_CODE__ERR_INTERNAL, err, len);
    Fi__AuditVerifyReply v = FI__AUDIT_VERIFY_REPLY__INIT;
    v.intact = rc == 0;
    v.records = (uint64_t)ck->records;
    v.bad_seq = (uint64_t)ck->bad_seq;
    v.head = (char *)ck->head;
    v.what = (char *)ck->what;
    v.witnesses = (uint64_t)ck->witnesses;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY;
    m.audit_verify_reply = &v;
    return fi_wire_encode(&m, len);
}

static uint8_t *s_audit_verify(fi_ship *s, size_t *len) {
    fi_audit_check ck;
    char err[400];
    int r = fi_audit_verify(s->au, &ck, err, sizeof err);
    return fi_ship_verify_reply(r, &ck, err, len);
}

/* The string member key of o, "" when absent; -1 when present and not a
 * string or too long. */
static int s_jstr(json_t *o, const char *key, const char **out) {
    json_t *v = json_object_get(o, key);
    *out = "";
    if (!v) return 0;
    if (!json_is_string(v) || json_string_length(v) > S_MAX_FIELD || strlen(json_string_value(v)) !=
                                                                         json_string_length(v))
        return -1;
    *out = json_string_value(v);
    return 0;
}

static int s_jint(json_t *o, const char *key, int required, int64_t dflt, int64_t *out) {
    json_t *v = json_object_get(o, key);
    *out = dflt;
    if (!v) return required ? -1 : 0;
    if (!json_is_integer(v)) return -1;
    *out = (int64_t)json_integer_value(v);
    return 0;
}

static uint8_t *s_audit_upload(fi_ship *s, const fi_peer_rec *from, const Fi__AuditUpload *u, size_t *len) {
    const char *bid = u->batch_id ? u->batch_id : "";
    if (!bid[0] || strlen(bid) > FI_WIRE_MAX_ID)
        return s_error(FI__ERROR_CODE__ERR_BAD_REQUEST, "audit upload needs a batch_id of 1..64 bytes", len);
    json_error_t je;
    json_t *arr = json_loadb((const char *)u->batch.data, u->batch.len, JSON_REJECT_DUPLICATES, &je);
    char msg[512];
    uint8_t *out = NULL;
    fi_audit_record *recs = NULL;
    size_t n = arr && json_is_array(arr) ? json_array_size(arr) : 0;
    if (!arr || !json_is_array(arr) || n > FI_SHIP_MAX_BATCH) {
        snprintf(msg, sizeof msg, "audit batch %.64s: %s", bid,
                 !arr ? "not JSON" : !json_is_array(arr) ? "not a JSON array of records" : "too many records");
        goto refuse;
    }
    recs = calloc(n ? n : 1, sizeof *recs);
    if (!recs) {
        json_decref(arr);
        return s_error(FI__ERROR_CODE__ERR_INTERNAL, "out of memory", len);
    }
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(arr, i);
        fi_audit_record *r = &recs[i];
        const char *hash = "";
        if (!json_is_object(o) || s_jint(o, "seq", 1, 0, &r->seq) || s_jint(o, "time", 1, 0, &r->time) ||
            s_jint(o, "latency_ms", 0, -1, &r->latency_ms) || s_jint(o, "prompt_tokens", 0, -1, &r->prompt_tokens) ||
            s_jstr(o, "request_id", &r->request_id) || s_jstr(o, "tenant", &r->tenant) ||
            s_jstr(o, "application", &r->application) || s_jstr(o, "origin", &r->origin) ||
            s_jstr(o, "labels", &r->labels) || s_jstr(o, "model", &r->model) ||
            s_jstr(o, "decision", &r->decision) || s_jstr(o, "target", &r->target) ||
            s_jstr(o, "rules", &r->rules) || s_jstr(o, "policy_digest", &r->policy_digest) ||
            s_jstr(o, "hash", &hash) || strlen(hash) != 64) {
            snprintf(msg, sizeof msg, "audit batch %.64s: record %zu is malformed (needs integers seq and time, "
                     "strings of at most %d bytes, a 64-hex hash)", bid, i, S_MAX_FIELD);
            goto refuse;
        }
        snprintf(r->hash, sizeof r->hash, "%s", hash);
    }
    if ((n && (u->first_seq != (uint64_t)recs[0].seq)) || u->count != n) {
        snprintf(msg, sizeof msg, "audit batch %.64s: first_seq %llu and count %llu do not match its %zu record(s)",
                 bid, (unsigned long long)u->first_seq, (unsigned long long)u->count, n);
        goto refuse;
    }
    size_t taken = 0;
    char err[512];
    int r = fi_audit_ingest(s->au, from->fpr, from->site, recs, n, &taken, err, sizeof err);
    if (r < 0) {
        fi_coord_log("audit batch %s from %s: %s", bid, from->fpr, err);
        out = s_error(FI__ERROR_CODE__ERR_INTERNAL, "cannot store the audit batch", len);
    } else if (r > 0) {
        snprintf(msg, sizeof msg, "%s", err);
        goto refuse;
    } else {
        if (taken && s->fleet &&
            fi_store_audit_put(s->fleet, from->fpr, bid, u->first_seq, u->count, u->batch.data, u->batch.len) != 0)
            fi_coord_log("audit batch %s from %s: its records are in the audit log; the raw copy could not be kept", bid,
                  from->fpr);
        if (err[0]) fi_coord_log("audit batch %s from %s: %s (a replaced key of the same log)", bid, from->fpr, err);
        if (taken != n)
            fi_coord_log("audit batch %s from %s: %zu record(s), %zu new (the rest were received before)", bid, from->fpr, n,
                  taken);
        out = fi_wire_ack(bid, len);
    }
    free(recs);
    json_decref(arr);
    return out;
refuse:
    fi_coord_log("refused audit batch from %s: %s", from->fpr, msg);
    free(recs);
    json_decref(arr);
    return s_error(FI__ERROR_CODE__ERR_BAD_REQUEST, msg, len);
}

char *fi_ship_audit_batch(const fi_audit_record *recs, size_t n) {
    json_t *arr = json_array();
    if (!arr) return NULL;
    for (size_t i = 0; i < n; i++) {
        const fi_audit_record *r = &recs[i];
#define S_NZ(x) ((x) ? (x) : "")
        json_t *o = json_pack("{s:I,s:I,s:s,s:s,s:s,s:s,s:s,s:s,s:I,s:I,s:s,s:s,s:s,s:s,s:s}", "seq",
                              (json_int_t)r->seq, "time", (json_int_t)r->time, "request_id", S_NZ(r->request_id),
                              "tenant", S_NZ(r->tenant), "application", S_NZ(r->application), "origin",
                              S_NZ(r->origin), "labels", S_NZ(r->labels), "model", S_NZ(r->model), "latency_ms",
                              (json_int_t)r->latency_ms, "prompt_tokens", (json_int_t)r->prompt_tokens, "decision",
                              S_NZ(r->decision), "target", S_NZ(r->target), "rules", S_NZ(r->rules),
                              "policy_digest", S_NZ(r->policy_digest), "hash", r->hash);
#undef S_NZ
        if (!o || json_array_append_new(arr, o) != 0) {
            json_decref(arr);
            return NULL;
        }
    }
    char *out = json_dumps(arr, JSON_COMPACT);
    json_decref(arr);
    return out;
}

static uint8_t *s_handle(fi_ship *s, const fi_peer_rec *from, const fi_msg *m, fi_ship_push_fn push, void *push_user,
                         size_t *len) {
    int op = from->role == FI__ROLE__ROLE_OPERATOR;
    if (m->body_case == FI__ENVELOPE__BODY_AUDIT_UPLOAD) {
        if (from->role != FI__ROLE__ROLE_EDGE)
            return s_error(FI__ERROR_CODE__ERR_UNAUTHORISED, "only edges upload audit batches (of their own site)", len);
        return s_audit_upload(s, from, m->audit_upload, len);
    }
    /* The role is the one enrolled with the sender's key (fi_coord checks
     * it too); nothing in the message can claim it. */
    if (!op) return s_error(FI__ERROR_CODE__ERR_UNAUTHORISED, "only operators may do this", len);
    switch (m->body_case) {
    case FI__ENVELOPE__BODY_POLICY_APPLY: return s_apply(s, from, m->policy_apply, push, push_user, len);
    case FI__ENVELOPE__BODY_POLICY_ROLLBACK: return s_rollback(s, from, m->policy_rollback, push, push_user, len);
    case FI__ENVELOPE__BODY_POLICY_HISTORY_REQUEST: return s_history(s, len);
    case FI__ENVELOPE__BODY_POLICY_GET: return s_get(s, m->policy_get, len);
    case FI__ENVELOPE__BODY_AUDIT_QUERY: return s_audit_query(s, m->audit_query, len);
    case FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST: return s_audit_verify(s, len);
    default: return s_error(FI__ERROR_CODE__ERR_UNKNOWN_TYPE, "not a policy or audit request", len);
    }
}

uint8_t *fi_ship_handle(fi_ship *s, const fi_peer_rec *from, const fi_msg *m, fi_ship_push_fn push, void *push_user,
                        size_t *len) {
    uint8_t *out = s_handle(s, from, m, push, push_user, len);
    /* A reply that cannot be encoded (out of memory, over the size limit)
     * still gets an answer. */
    return out ? out : s_error(FI__ERROR_CODE__ERR_INTERNAL, "the reply could not be encoded", len);
}
