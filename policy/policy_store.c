/*
 * policy_store.c - the operator-side policy store (contract in fi_pstore.h).
 */
#include <sodium.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>

#include "fi_db.h"
#include "fi_pstore.h"

struct fi_pstore {
    sqlite3 *db; /* the open database */
};

static const char *s_schema =
    "PRAGMA journal_mode=WAL;"
    "PRAGMA synchronous=FULL;"
    "CREATE TABLE IF NOT EXISTS policy_versions("
    " version INTEGER PRIMARY KEY,"
    " created INTEGER NOT NULL,"
    " author TEXT NOT NULL,"
    " digest TEXT NOT NULL,"
    " comment TEXT NOT NULL,"
    " content BLOB NOT NULL,"
    " bundle BLOB NOT NULL,"
    " not_before INTEGER NOT NULL,"
    " not_after INTEGER NOT NULL,"
    " rollback_of INTEGER NOT NULL DEFAULT 0);"
    "CREATE TRIGGER IF NOT EXISTS policy_versions_no_update BEFORE UPDATE ON policy_versions"
    " BEGIN SELECT RAISE(ABORT, 'policy versions are immutable'); END;"
    "CREATE TRIGGER IF NOT EXISTS policy_versions_no_delete BEFORE DELETE ON policy_versions"
    " BEGIN SELECT RAISE(ABORT, 'policy versions are immutable'); END;"
    /* the highest version signed elsewhere (fi_pstore_reserve): one row */
    "CREATE TABLE IF NOT EXISTS policy_version_floor("
    " id INTEGER PRIMARY KEY CHECK(id = 1),"
    " version INTEGER NOT NULL);";

fi_pstore *fi_pstore_open(const char *path, char *err, size_t cap) {
    fi_pstore *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, cap, "out of memory");
        return NULL;
    }
    char *msg = NULL;
    int rc = sqlite3_open_v2(path, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL);
    if (rc == SQLITE_OK) rc = sqlite3_busy_timeout(s->db, 5000);
    if (rc == SQLITE_OK) {
        if (fi_db_check(s->db, path, err, cap) != 0) goto fail; /* damaged, or locked: err says */
        rc = sqlite3_exec(s->db, s_schema, NULL, NULL, &msg);
    }
    if (rc != SQLITE_OK) {
        const char *why = msg ? msg : s->db ? sqlite3_errmsg(s->db) : "out of memory";
        if (!fi_db_damaged(rc, path, why, err, cap)) snprintf(err, cap, "cannot open policy store %s: %s", path, why);
        sqlite3_free(msg);
        goto fail;
    }
    return s;
fail:
    fi_pstore_destroy(&s);
    return NULL;
}

void fi_pstore_busy_timeout(fi_pstore *self, int ms) { sqlite3_busy_timeout(self->db, ms); }

void fi_pstore_destroy(fi_pstore **self_p) {
    if (!self_p || !*self_p) return;
    sqlite3_close((*self_p)->db);
    free(*self_p);
    *self_p = NULL;
}

/* A database failure, naming the file. */
static void s_dberr(sqlite3 *db, char *err, size_t cap) {
    const char *f = sqlite3_db_filename(db, "main");
    snprintf(err, cap, "policy store %s: %s", f && f[0] ? f : "(in memory)", sqlite3_errmsg(db));
}

static int s_insert(fi_pstore *s, const char *content, size_t len, const char *author, const char *comment,
                    const uint8_t sk[FI_BUNDLE_SK_BYTES], int64_t now, int64_t valid_for, uint64_t rollback_of,
                    uint64_t *version, char *err, size_t cap) {
    fi_diags *d = fi_diags_new();
    fi_policy *pol = fi_policy_parse(content, len, d);
    if (!pol) {
        char first[600] = "out of memory";
        for (size_t i = 0; i < fi_diags_count(d); i++)
            if (fi_diags_get(d, i)->level == FI_DIAG_ERROR) {
                fi_diag_format(fi_diags_get(d, i), "policy", first, sizeof first);
                break;
            }
        snprintf(err, cap, "policy refused, it has %zu error(s); first: %s", fi_diags_errors(d), first);
        fi_diags_destroy(&d);
        return -1;
    }
    fi_diags_destroy(&d);
    int64_t not_after = now + valid_for;
    if (fi_policy_expires(pol) && fi_policy_expires(pol) < not_after) not_after = fi_policy_expires(pol);
    char digest[65];
    fi_policy_digest_hex(pol, digest);
    fi_policy_destroy(&pol);
    if (not_after <= now) {
        snprintf(err, cap, "policy refused: it has already expired");
        return -1;
    }
    sqlite3_stmt *st = NULL;
    char *bundle = NULL;
    size_t blen = 0;
    int rc = -1;
    if (sqlite3_exec(s->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) goto dberr;
    uint64_t v = 1;
    /* above every stored version and every one signed elsewhere */
    if (sqlite3_prepare_v2(s->db,
                           "SELECT MAX((SELECT COALESCE(MAX(version), 0) FROM policy_versions),"
                           " (SELECT COALESCE(MAX(version), 0) FROM policy_version_floor))",
                           -1, &st, NULL) != SQLITE_OK ||
        sqlite3_step(st) != SQLITE_ROW)
        goto dberr_tx;
    if (sqlite3_column_int64(st, 0) >= INT64_MAX) {
        snprintf(err, cap, "policy store: the version numbering is exhausted");
        goto fail_tx;
    }
    v = (uint64_t)sqlite3_column_int64(st, 0) + 1;
    sqlite3_finalize(st);
    st = NULL;
    if (fi_bundle_sign(sk, v, now, not_after, content, len, &bundle, &blen)) {
        snprintf(err, cap, "cannot sign the bundle (out of memory)");
        rc = FI_PSTORE_FAILED;
        goto fail_tx;
    }
    if (sqlite3_prepare_v2(s->db,
                           "INSERT INTO policy_versions(version, created, author, digest, comment, content, bundle,"
                           " not_before, not_after, rollback_of) VALUES(?,?,?,?,?,?,?,?,?,?)",
                           -1, &st, NULL) != SQLITE_OK)
        goto dberr_tx;
    sqlite3_bind_int64(st, 1, (sqlite3_int64)v);
    sqlite3_bind_int64(st, 2, now);
    sqlite3_bind_text(st, 3, author ? author : "", -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(st, 4, digest, -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(st, 5, comment ? comment : "", -1, SQLITE_TRANSIENT);
    sqlite3_bind_blob(st, 6, content, (int)len, SQLITE_TRANSIENT);
    sqlite3_bind_blob(st, 7, bundle, (int)blen, SQLITE_TRANSIENT);
    sqlite3_bind_int64(st, 8, now);
    sqlite3_bind_int64(st, 9, not_after);
    sqlite3_bind_int64(st, 10, (sqlite3_int64)rollback_of);
    if (sqlite3_step(st) != SQLITE_DONE) goto dberr_tx;
    sqlite3_finalize(st);
    st = NULL;
    if (sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) goto dberr_tx;
    *version = v;
    rc = 0;
    goto done;
dberr_tx:
    s_dberr(s->db, err, cap);
    rc = FI_PSTORE_FAILED;
fail_tx:
    sqlite3_finalize(st);
    st = NULL;
    sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    goto done;
dberr:
    s_dberr(s->db, err, cap);
    rc = FI_PSTORE_FAILED;
done:
    sqlite3_finalize(st);
    free(bundle);
    return rc;
}

int fi_pstore_reserve(fi_pstore *self, uint64_t version, char *err, size_t cap) {
    /* the store numbers in SQLite's signed 64 bits, and a version must
     * leave room for the next */
    if (version >= (uint64_t)INT64_MAX) {
        snprintf(err, cap, "policy store: version %llu is beyond the store's numbering (at most %lld)",
                 (unsigned long long)version, (long long)INT64_MAX - 1);
        return -1;
    }
    sqlite3_stmt *st = NULL;
    int ok = sqlite3_prepare_v2(self->db,
                                "INSERT INTO policy_version_floor(id, version) VALUES(1, ?1)"
                                " ON CONFLICT(id) DO UPDATE SET version = MAX(version, excluded.version)",
                                -1, &st, NULL) == SQLITE_OK &&
             sqlite3_bind_int64(st, 1, (sqlite3_int64)version) == SQLITE_OK && sqlite3_step(st) == SQLITE_DONE;
    if (!ok) s_dberr(self->db, err, cap);
    sqlite3_finalize(st);
    return ok ? 0 : -1;
}

int fi_pstore_apply(fi_pstore *self, const char *content, size_t len, const char *author, const char *comment,
                   const uint8_t sk[FI_BUNDLE_SK_BYTES], int64_t now, int64_t valid_for, uint64_t *version,
                   char *err, size_t cap) {
    return s_insert(self, content, len, author, comment, sk, now, valid_for, 0, version, err, cap);
}

int fi_pstore_rollback(fi_pstore *self, uint64_t old, const char *author, const char *comment,
                      const uint8_t sk[FI_BUNDLE_SK_BYTES], int64_t now, int64_t valid_for, uint64_t *version,
                      char *err, size_t cap) {
    fi_pstore_version v;
    char *content = NULL;
    size_t len = 0;
    if (!old) {
        snprintf(err, cap, "no version 0: versions start at 1");
        return -1;
    }
    int r = fi_pstore_get(self, old, &v, &content, &len, NULL, NULL, err, cap);
    if (r > 0) snprintf(err, cap, "no version %llu in the store", (unsigned long long)old);
    if (r) return r > 0 ? -1 : FI_PSTORE_FAILED;
    char why[700];
    snprintf(why, sizeof why, "rollback to version %llu%s%s", (unsigned long long)old, comment && *comment ? ": " : "",
             comment ? comment : "");
    int rc = s_insert(self, content, len, author, why, sk, now, valid_for, old, version, err, cap);
    free(content);
    return rc;
}

static void s_row(sqlite3_stmt *st, fi_pstore_version *v) {
    memset(v, 0, sizeof *v);
    v->version = (uint64_t)sqlite3_column_int64(st, 0);
    v->created = sqlite3_column_int64(st, 1);
    snprintf(v->author, sizeof v->author, "%s", (const char *)sqlite3_column_text(st, 2));
    snprintf(v->digest, sizeof v->digest, "%s", (const char *)sqlite3_column_text(st, 3));
    snprintf(v->comment, sizeof v->comment, "%s", (const char *)sqlite3_column_text(st, 4));
    v->not_before = sqlite3_column_int64(st, 5);
    v->not_after = sqlite3_column_int64(st, 6);
    v->rollback_of = (uint64_t)sqlite3_column_int64(st, 7);
}

#define COLS "version, created, author, digest, comment, not_before, not_after, rollback_of"

int fi_pstore_history(fi_pstore *self, int (*fn)(const fi_pstore_version *v, void *arg), void *arg, char *err,
                     size_t cap) {
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(self->db, "SELECT " COLS " FROM policy_versions ORDER BY version", -1, &st, NULL) !=
        SQLITE_OK) {
        s_dberr(self->db, err, cap);
        return -1;
    }
    int r;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        fi_pstore_version v;
        s_row(st, &v);
        if (fn(&v, arg)) {
            r = SQLITE_DONE;
            break;
        }
    }
    if (r != SQLITE_DONE) s_dberr(self->db, err, cap);
    sqlite3_finalize(st);
    return r == SQLITE_DONE ? 0 : -1;
}

static int s_blob(sqlite3_stmt *st, int col, char **out, size_t *len) {
    if (!out) return 0;
    const void *b = sqlite3_column_blob(st, col);
    size_t n = (size_t)sqlite3_column_bytes(st, col);
    *out = malloc(n + 1);
    if (!*out) return -1;
    if (n) memcpy(*out, b, n);
    (*out)[n] = 0;
    *len = n;
    return 0;
}

int fi_pstore_get(fi_pstore *self, uint64_t version, fi_pstore_version *v, char **content, size_t *content_len,
                 char **bundle, size_t *bundle_len, char *err, size_t cap) {
    if (content) *content = NULL;
    if (bundle) *bundle = NULL;
    sqlite3_stmt *st = NULL;
    const char *sql = version ? "SELECT " COLS ", content, bundle FROM policy_versions WHERE version = ?"
                              : "SELECT " COLS ", content, bundle FROM policy_versions ORDER BY version DESC LIMIT 1";
    if (sqlite3_prepare_v2(self->db, sql, -1, &st, NULL) != SQLITE_OK) {
        s_dberr(self->db, err, cap);
        return -1;
    }
    if (version) sqlite3_bind_int64(st, 1, (sqlite3_int64)version);
    int r = sqlite3_step(st), rc;
    if (r == SQLITE_ROW) {
        if (v) s_row(st, v);
        rc = s_blob(st, 8, content, content_len) || s_blob(st, 9, bundle, bundle_len) ? -1 : 0;
        if (rc) {
            snprintf(err, cap, "out of memory");
            if (content) {
                free(*content);
                *content = NULL;
            }
        }
    } else if (r == SQLITE_DONE) {
        rc = 1;
    } else {
        s_dberr(self->db, err, cap);
        rc = -1;
    }
    sqlite3_finalize(st);
    return rc;
}
