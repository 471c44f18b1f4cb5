/*
 * fi_store.c - fleet state in SQLite. See fi_store.h.
 */
#include "fi_store.h"

#include <sqlite3.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_db.h"

struct fi_store {
    sqlite3 *db; /* the open database */
};

static const char *s_schema =
    "CREATE TABLE IF NOT EXISTS regions(name TEXT PRIMARY KEY);"
    "CREATE TABLE IF NOT EXISTS sites(name TEXT PRIMARY KEY, region TEXT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS peers("
    "  pubkey BLOB PRIMARY KEY, fpr TEXT NOT NULL UNIQUE, role INTEGER NOT NULL,"
    "  site TEXT NOT NULL, region TEXT NOT NULL, enrolled INTEGER NOT NULL,"
    "  revoked INTEGER);"
    "CREATE TABLE IF NOT EXISTS tokens("
    "  hash TEXT PRIMARY KEY, role INTEGER NOT NULL, site TEXT NOT NULL,"
    "  region TEXT NOT NULL, created INTEGER NOT NULL, expires INTEGER NOT NULL,"
    "  used INTEGER, used_by TEXT);"
    "CREATE TABLE IF NOT EXISTS bundles(id INTEGER PRIMARY KEY, version INTEGER NOT NULL,"
    "  blob BLOB NOT NULL, from_fpr TEXT NOT NULL, received INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS audit(id INTEGER PRIMARY KEY, from_fpr TEXT NOT NULL,"
    "  batch_id TEXT NOT NULL, first_seq INTEGER NOT NULL, count INTEGER NOT NULL,"
    "  blob BLOB NOT NULL, received INTEGER NOT NULL, UNIQUE(from_fpr, batch_id));";

fi_store *fi_store_open(const char *path, char *err, size_t errlen) {
    fi_store *st = calloc(1, sizeof *st);
    if (!st) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    int rc = sqlite3_open_v2(path, &st->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL);
    if (rc != SQLITE_OK) {
        const char *why = st->db ? sqlite3_errmsg(st->db) : "cannot open";
        if (!fi_db_damaged(rc, path, why, err, errlen)) snprintf(err, errlen, "%s: %s", path, why);
        goto fail;
    }
    sqlite3_busy_timeout(st->db, 5000);
    /* damage anywhere in the file: refused now, not when a request meets it */
    if (fi_db_check(st->db, path, err, errlen) != 0) goto fail;
    char *msg = NULL;
    if ((rc = sqlite3_exec(st->db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"
                                   "PRAGMA foreign_keys=ON;", NULL, NULL, &msg)) != SQLITE_OK ||
        (rc = sqlite3_exec(st->db, s_schema, NULL, NULL, &msg)) != SQLITE_OK) {
        const char *why = msg ? msg : "schema failed";
        if (!fi_db_damaged(rc, path, why, err, errlen)) snprintf(err, errlen, "%s: %s", path, why);
        sqlite3_free(msg);
        goto fail;
    }
    /* a store made before tokens recorded who spent them */
    sqlite3_stmt *q = NULL;
    int has_used_by = 0;
    if (sqlite3_prepare_v2(st->db, "SELECT 1 FROM pragma_table_info('tokens') WHERE name='used_by'",
                           -1, &q, NULL) == SQLITE_OK)
        has_used_by = sqlite3_step(q) == SQLITE_ROW;
    sqlite3_finalize(q);
    if (!has_used_by &&
        sqlite3_exec(st->db, "ALTER TABLE tokens ADD COLUMN used_by TEXT", NULL, NULL, &msg) != SQLITE_OK) {
        snprintf(err, errlen, "%s: tokens: %s", path, msg ? msg : "cannot add used_by");
        sqlite3_free(msg);
        goto fail;
    }
    return st;
fail:
    fi_store_destroy(&st);
    return NULL;
}

void fi_store_busy_timeout(fi_store *st, int ms) { sqlite3_busy_timeout(st->db, ms); }

void fi_store_destroy(fi_store **st) {
    if (!st || !*st) return;
    sqlite3_close((*st)->db);
    free(*st);
    *st = NULL;
}

int fi_store_name_ok(const char *s) {
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n >= FI_STORE_NAME_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

/* Prepares sql and binds the arguments described by fmt: 'b' key blob
 * (32 bytes), 's' text, 'i' int64, 'B' blob + size_t length. NULL on a
 * database error. */
static sqlite3_stmt *s_prep(fi_store *st, const char *sql, const char *fmt, ...) {
    sqlite3_stmt *q = NULL;
    if (sqlite3_prepare_v2(st->db, sql, -1, &q, NULL) != SQLITE_OK) return NULL;
    va_list ap;
    va_start(ap, fmt);
    for (int i = 0; fmt[i]; i++) {
        int rc = SQLITE_OK;
        switch (fmt[i]) {
        case 'b': rc = sqlite3_bind_blob(q, i + 1, va_arg(ap, const void *), FI_KEYS_BYTES,
                                         SQLITE_TRANSIENT); break;
        case 's': rc = sqlite3_bind_text(q, i + 1, va_arg(ap, const char *), -1,
                                         SQLITE_TRANSIENT); break;
        case 'i': rc = sqlite3_bind_int64(q, i + 1, va_arg(ap, int64_t)); break;
        case 'B': {
            const void *p = va_arg(ap, const void *);
            size_t n = va_arg(ap, size_t);
            rc = sqlite3_bind_blob64(q, i + 1, p ? p : "", n, SQLITE_TRANSIENT);
            break;
        }
        }
        if (rc != SQLITE_OK) {
            sqlite3_finalize(q);
            q = NULL;
            break;
        }
    }
    va_end(ap);
    return q;
}

/* Runs a prepared statement that returns no rows; 0 or -1. */
static int s_run(fi_store *st, sqlite3_stmt *q, char *err, size_t errlen) {
    if (!q) {
        if (err) snprintf(err, errlen, "database: %s", sqlite3_errmsg(st->db));
        return -1;
    }
    int rc = sqlite3_step(q);
    sqlite3_finalize(q);
    if (rc != SQLITE_DONE) {
        if (err) snprintf(err, errlen, "database: %s", sqlite3_errmsg(st->db));
        return -1;
    }
    return 0;
}

static int s_exec(fi_store *st, const char *sql) {
    return sqlite3_exec(st->db, sql, NULL, NULL, NULL) == SQLITE_OK ? 0 : -1;
}

static int s_peer_insert(fi_store *st, const uint8_t pub[FI_KEYS_BYTES], Fi__Role role,
                         const char *site, const char *region, char *err, size_t errlen) {
    char fpr[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(pub, fpr);
    fi_peer_rec old;
    int have = fi_store_peer_get(st, pub, &old);
    if (have != 0) {
        snprintf(err, errlen, have > 0 ? "key %s is already enrolled" : "database: lookup failed",
                 fpr);
        return -1;
    }
    if (site[0] && (s_run(st, s_prep(st, "INSERT OR IGNORE INTO regions(name) VALUES(?)", "s",
                                     region), err, errlen) ||
                    s_run(st, s_prep(st, "INSERT OR IGNORE INTO sites(name, region) VALUES(?,?)",
                                     "ss", site, region), err, errlen)))
        return -1;
    return s_run(st, s_prep(st, "INSERT INTO peers(pubkey, fpr, role, site, region, enrolled) "
                                "VALUES(?,?,?,?,?,?)", "bsissi", pub, fpr, (int64_t)role, site,
                            region, (int64_t)time(NULL)), err, errlen);
}

int fi_store_peer_add(fi_store *st, const uint8_t pub[FI_KEYS_BYTES], Fi__Role role,
                      const char *site, const char *region, char *err, size_t errlen) {
    if (s_exec(st, "BEGIN IMMEDIATE") != 0) {
        snprintf(err, errlen, "database: %s", sqlite3_errmsg(st->db));
        return -1;
    }
    if (s_peer_insert(st, pub, role, site, region, err, errlen) != 0) {
        s_exec(st, "ROLLBACK");
        return -1;
    }
    if (s_exec(st, "COMMIT") != 0) {
        snprintf(err, errlen, "database: commit: %s", sqlite3_errmsg(st->db));
        s_exec(st, "ROLLBACK");
        return -1;
    }
    return 0;
}

static void s_row_to_peer(sqlite3_stmt *q, fi_peer_rec *p) {
    memset(p, 0, sizeof *p);
    if (sqlite3_column_bytes(q, 0) == FI_KEYS_BYTES)
        memcpy(p->pub, sqlite3_column_blob(q, 0), FI_KEYS_BYTES);
    snprintf(p->fpr, sizeof p->fpr, "%s", (const char *)sqlite3_column_text(q, 1));
    p->role = (Fi__Role)sqlite3_column_int(q, 2);
    snprintf(p->site, sizeof p->site, "%s", (const char *)sqlite3_column_text(q, 3));
    snprintf(p->region, sizeof p->region, "%s", (const char *)sqlite3_column_text(q, 4));
    p->enrolled_unix = sqlite3_column_int64(q, 5);
    p->revoked = sqlite3_column_type(q, 6) != SQLITE_NULL;
}

#define S_PEER_COLS "pubkey, fpr, role, site, region, enrolled, revoked"

int fi_store_peer_get(fi_store *st, const uint8_t pub[FI_KEYS_BYTES], fi_peer_rec *out) {
    sqlite3_stmt *q = s_prep(st, "SELECT " S_PEER_COLS " FROM peers WHERE pubkey = ?", "b", pub);
    if (!q) return -1;
    int rc = sqlite3_step(q);
    int res = rc == SQLITE_ROW ? 1 : rc == SQLITE_DONE ? 0 : -1;
    if (res == 1) s_row_to_peer(q, out);
    sqlite3_finalize(q);
    return res;
}

const char *fi_store_last_error(fi_store *st) { return sqlite3_errmsg(st->db); }

int fi_store_peer_revoke(fi_store *st, const char *fpr, fi_peer_rec *out) {
    if (s_run(st, s_prep(st, "UPDATE peers SET revoked = ? WHERE fpr = ? AND revoked IS NULL",
                         "is", (int64_t)time(NULL), fpr), NULL, 0) != 0)
        return -1;
    sqlite3_stmt *q = s_prep(st, "SELECT " S_PEER_COLS " FROM peers WHERE fpr = ?", "s", fpr);
    if (!q) return -1;
    int rc = sqlite3_step(q);
    int res = rc == SQLITE_ROW ? 1 : rc == SQLITE_DONE ? 0 : -1;
    if (res == 1) s_row_to_peer(q, out);
    sqlite3_finalize(q);
    return res;
}

int fi_store_peer_each(fi_store *st, int (*fn)(void *user, const fi_peer_rec *p), void *user) {
    sqlite3_stmt *q = s_prep(st, "SELECT " S_PEER_COLS " FROM peers ORDER BY role, site, fpr", "");
    if (!q) return -1;
    int rc, res = 0;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        fi_peer_rec p;
        s_row_to_peer(q, &p);
        if ((res = fn(user, &p)) != 0) break;
    }
    if (res == 0 && rc != SQLITE_DONE) res = -1;
    sqlite3_finalize(q);
    return res;
}

int fi_store_token_add(fi_store *st, const char *token_hash, Fi__Role role, const char *site,
                       const char *region, int64_t expires_unix, char *err, size_t errlen) {
    return s_run(st, s_prep(st, "INSERT INTO tokens(hash, role, site, region, created, expires) "
                                "VALUES(?,?,?,?,?,?)", "sissii", token_hash, (int64_t)role,
                            site, region, (int64_t)time(NULL), expires_unix), err, errlen);
}

int fi_store_enrol(fi_store *st, const char *token_hash, Fi__Role role, const char *site,
                   const char *region, const uint8_t pub[FI_KEYS_BYTES], int64_t now_unix,
                   char *err, size_t errlen) {
    if (s_exec(st, "BEGIN IMMEDIATE") != 0) {
        snprintf(err, errlen, "database: %s", sqlite3_errmsg(st->db));
        return -1;
    }
    sqlite3_stmt *q = s_prep(st, "SELECT role, site, region, expires, used, used_by FROM tokens "
                                 "WHERE hash = ?", "s", token_hash);
    char fpr[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(pub, fpr);
    int ok = 0, again = 0;
    fi_peer_rec had;
    if (!q) {
        snprintf(err, errlen, "database: %s", sqlite3_errmsg(st->db));
    } else if (sqlite3_step(q) != SQLITE_ROW) {
        snprintf(err, errlen, "unknown enrolment token");
    } else if (sqlite3_column_type(q, 4) != SQLITE_NULL) {
        /* The key that spent the token asking again (its first answer
         * was lost): it is enrolled, as it asked. */
        const char *by = (const char *)sqlite3_column_text(q, 5);
        again = by && !strcmp(by, fpr) && fi_store_peer_get(st, pub, &had) == 1 &&
                !had.revoked && had.role == role &&
                sqlite3_column_int(q, 0) == (int)role && !strcmp(had.site, site) &&
                !strcmp(had.region, region) &&
                !strcmp((const char *)sqlite3_column_text(q, 1), site) &&
                !strcmp((const char *)sqlite3_column_text(q, 2), region);
        if (!again) snprintf(err, errlen, "enrolment token already used");
    } else if (sqlite3_column_int64(q, 3) <= now_unix) {
        snprintf(err, errlen, "enrolment token expired");
    } else if (sqlite3_column_int(q, 0) != (int)role ||
               strcmp((const char *)sqlite3_column_text(q, 1), site) ||
               strcmp((const char *)sqlite3_column_text(q, 2), region)) {
        snprintf(err, errlen, "enrolment token is for %s at site '%s' region '%s'",
                 fi_wire_role_name((Fi__Role)sqlite3_column_int(q, 0)),
                 (const char *)sqlite3_column_text(q, 1), (const char *)sqlite3_column_text(q, 2));
    } else {
        ok = 1;
    }
    sqlite3_finalize(q);
    if (again) {
        s_exec(st, "ROLLBACK"); /* nothing to change */
        return 0;
    }
    if (ok && s_run(st, s_prep(st, "UPDATE tokens SET used = ?, used_by = ? WHERE hash = ?", "iss",
                               now_unix, fpr, token_hash), err, errlen) != 0)
        ok = 0;
    if (ok && s_peer_insert(st, pub, role, site, region, err, errlen) != 0) ok = 0;
    if (ok && s_exec(st, "COMMIT") != 0) {
        snprintf(err, errlen, "database: commit: %s", sqlite3_errmsg(st->db));
        ok = 0;
    }
    if (!ok) s_exec(st, "ROLLBACK");
    return ok ? 0 : -1;
}

int fi_store_bundle_put(fi_store *st, uint64_t version, const void *blob, size_t len,
                        const char *from_fpr) {
    return s_run(st, s_prep(st, "INSERT INTO bundles(version, blob, from_fpr, received) "
                                "VALUES(?,?,?,?)", "iBsi", (int64_t)version, blob, len, from_fpr,
                            (int64_t)time(NULL)), NULL, 0);
}

int fi_store_bundle_newest(fi_store *st, uint64_t *version, void **blob, size_t *len) {
    *blob = NULL;
    *len = 0;
    sqlite3_stmt *q = s_prep(st, "SELECT version, blob FROM bundles ORDER BY version DESC, id DESC LIMIT 1", "");
    if (!q) return -1;
    int rc = sqlite3_step(q), res = rc == SQLITE_ROW ? 1 : rc == SQLITE_DONE ? 0 : -1;
    if (res == 1) {
        int n = sqlite3_column_bytes(q, 1);
        const void *p = sqlite3_column_blob(q, 1);
        *version = (uint64_t)sqlite3_column_int64(q, 0);
        if (n <= 0 || !p || !(*blob = malloc((size_t)n))) {
            res = -1;
        } else {
            memcpy(*blob, p, (size_t)n);
            *len = (size_t)n;
        }
    }
    sqlite3_finalize(q);
    return res;
}

int fi_store_audit_put(fi_store *st, const char *from_fpr, const char *batch_id,
                       uint64_t first_seq, uint64_t count, const void *blob, size_t len) {
    /* A batch sent again after a lost ack is kept once. */
    return s_run(st, s_prep(st, "INSERT OR IGNORE INTO audit(from_fpr, batch_id, first_seq, "
                                "count, blob, received) VALUES(?,?,?,?,?,?)", "ssiiBi", from_fpr,
                            batch_id, (int64_t)first_seq, (int64_t)count, blob, len,
                            (int64_t)time(NULL)), NULL, 0);
}

int64_t fi_store_count(fi_store *st, const char *table) {
    static const char *const ok[] = {"peers", "tokens", "bundles", "audit", "sites", "regions"};
    int known = 0;
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) known |= !strcmp(ok[i], table);
    if (!known) return -1;
    char sql[64];
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s", table);
    sqlite3_stmt *q = s_prep(st, sql, "");
    if (!q) return -1;
    int64_t n = sqlite3_step(q) == SQLITE_ROW ? sqlite3_column_int64(q, 0) : -1;
    sqlite3_finalize(q);
    return n;
}
