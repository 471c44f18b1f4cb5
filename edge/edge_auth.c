/*
 * edge_auth.c - bearer tokens of the site's applications. A token is
 * stored only as its SHA-256 (the database never holds a usable token),
 * with the tenant and application it stands for:
 *
 *   fedinfer edge token add --config edge.conf --tenant T --app A   (prints it once)
 *   fedinfer edge token list | revoke ...
 *
 * Checked on every request under a mutex (one SQLite connection).
 */
#include <pthread.h>
#include <sodium.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edge_impl.h"
#include "fi_db.h"
#include "fi_wire.h"

typedef struct s_auth {
    sqlite3 *db;            /* the edge's SQLite */
    pthread_mutex_t mu;     /* one user of db at a time */
} s_auth;

static const char *s_schema =
    "CREATE TABLE IF NOT EXISTS edge_tokens(hash TEXT PRIMARY KEY, tenant TEXT NOT NULL,"
    " application TEXT NOT NULL, created INTEGER NOT NULL, revoked INTEGER);";

void edge_token_hash(const char *token, char out[65]) {
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (const unsigned char *)token, strlen(token));
    sodium_bin2hex(out, 65, h, sizeof h);
}

void *edge_auth_open(const char *db, int check, char *err, size_t errlen) {
    s_auth *a = calloc(1, sizeof *a);
    if (!a) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    int rc = sqlite3_open(db, &a->db);
    if (rc == SQLITE_OK) rc = sqlite3_busy_timeout(a->db, 5000);
    if (rc == SQLITE_OK) {
        if (check && fi_db_check(a->db, db, err, errlen) != 0) goto fail; /* damaged, or locked: err says */
        rc = sqlite3_exec(a->db, s_schema, NULL, NULL, NULL);
    }
    if (rc != SQLITE_OK) {
        const char *why = a->db ? sqlite3_errmsg(a->db) : "cannot open";
        if (!fi_db_damaged(rc, db, why, err, errlen)) snprintf(err, errlen, "%s: %s", db, why);
        goto fail;
    }
    pthread_mutex_init(&a->mu, NULL);
    return a;
fail:
    sqlite3_close(a->db);
    free(a);
    return NULL;
}

void edge_auth_close(void **ap) {
    s_auth *a = *ap;
    if (!a) return;
    *ap = NULL;
    sqlite3_close(a->db);
    pthread_mutex_destroy(&a->mu);
    free(a);
}

int edge_auth_check(void *ap, const char *token, char *tenant, size_t tlen, char *app,
                    size_t alen) {
    s_auth *a = ap;
    if (!token || strlen(token) < 8 || strlen(token) > 256) return 0;
    char hash[65];
    edge_token_hash(token, hash);
    int ok = 0;
    sqlite3_stmt *st = NULL;
    pthread_mutex_lock(&a->mu);
    if (sqlite3_prepare_v2(a->db,
                           "SELECT tenant, application FROM edge_tokens WHERE hash=?1 AND "
                           "revoked IS NULL",
                           -1, &st, NULL) == SQLITE_OK) {
        sqlite3_bind_text(st, 1, hash, -1, SQLITE_STATIC);
        if (sqlite3_step(st) == SQLITE_ROW) {
            snprintf(tenant, tlen, "%s", (const char *)sqlite3_column_text(st, 0));
            snprintf(app, alen, "%s", (const char *)sqlite3_column_text(st, 1));
            ok = 1;
        }
    }
    sqlite3_finalize(st);
    pthread_mutex_unlock(&a->mu);
    return ok;
}

int edge_token_add(const char *db, const char *tenant, const char *app, char *token, size_t toklen,
                   char *err, size_t errlen) {
    void *ap = edge_auth_open(db, 1, err, errlen);
    if (!ap) return -1;
    s_auth *a = ap;
    unsigned char rnd[20];
    if (sodium_init() < 0) {
        snprintf(err, errlen, "libsodium cannot initialise");
        edge_auth_close(&ap);
        return -1;
    }
    randombytes_buf(rnd, sizeof rnd);
    char hex[41];
    sodium_bin2hex(hex, sizeof hex, rnd, sizeof rnd);
    snprintf(token, toklen, "fie_%s", hex);
    char hash[65];
    edge_token_hash(token, hash);
    sqlite3_stmt *st = NULL;
    int rc = -1;
    if (sqlite3_prepare_v2(a->db,
                           "INSERT INTO edge_tokens(hash, tenant, application, created) "
                           "VALUES(?1, ?2, ?3, strftime('%s','now'))",
                           -1, &st, NULL) == SQLITE_OK) {
        sqlite3_bind_text(st, 1, hash, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 2, tenant, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 3, app, -1, SQLITE_STATIC);
        rc = sqlite3_step(st) == SQLITE_DONE ? 0 : -1;
    }
    if (rc) snprintf(err, errlen, "%s: %s", db, sqlite3_errmsg(a->db));
    sqlite3_finalize(st);
    sodium_memzero(rnd, sizeof rnd);
    sodium_memzero(hex, sizeof hex);
    edge_auth_close(&ap);
    return rc;
}

int edge_token_revoke(const char *db, const char *token_or_hash, char *err, size_t errlen) {
    void *ap = edge_auth_open(db, 1, err, errlen);
    if (!ap) return -1;
    s_auth *a = ap;
    char hash[65];
    if (strlen(token_or_hash) == 64) snprintf(hash, sizeof hash, "%s", token_or_hash);
    else edge_token_hash(token_or_hash, hash);
    sqlite3_stmt *st = NULL;
    int rc = -1;
    if (sqlite3_prepare_v2(a->db,
                           "UPDATE edge_tokens SET revoked=strftime('%s','now') WHERE hash=?1 "
                           "AND revoked IS NULL",
                           -1, &st, NULL) == SQLITE_OK) {
        sqlite3_bind_text(st, 1, hash, -1, SQLITE_STATIC);
        rc = sqlite3_step(st) == SQLITE_DONE && sqlite3_changes(a->db) == 1 ? 0 : -1;
    }
    if (rc) snprintf(err, errlen, "no such active token");
    sqlite3_finalize(st);
    edge_auth_close(&ap);
    return rc;
}

int edge_token_sync(const char *db, const Fi__AppTokenSync *sy, int *added, int *revoked,
                    char *err, size_t errlen) {
    *added = *revoked = 0;
    void *ap = edge_auth_open(db, 0, err, errlen); /* while serving: checked at start */
    if (!ap) return -1;
    s_auth *a = ap;
    int rc = sqlite3_exec(a->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK ? 0 : -1;
    for (size_t i = 0; rc == 0 && i < sy->n_tokens; i++) {
        const Fi__AppToken *t = sy->tokens[i];
        const char *h = t->hash ? t->hash : "";
        int hex = strlen(h) == 64;
        for (int k = 0; hex && k < 64; k++)
            hex = (h[k] >= '0' && h[k] <= '9') || (h[k] >= 'a' && h[k] <= 'f');
        if (!hex || !t->tenant || !t->application || !t->tenant[0] || !t->application[0] ||
            strlen(t->tenant) > 63 || strlen(t->application) > 63) {
            snprintf(err, errlen, "token %zu of the sync is malformed (hash, tenant, application)", i);
            rc = -1;
            break;
        }
        sqlite3_stmt *st = NULL;
        /* Never brings a revoked token back; a revocation of a token this
         * edge never saw is kept too, so that a late add cannot revive it. */
        const char *sql = t->revoked
                              ? "INSERT INTO edge_tokens(hash, tenant, application, created, revoked) "
                                "VALUES(?1, ?2, ?3, ?4, ?5) ON CONFLICT(hash) DO UPDATE SET "
                                "revoked=excluded.revoked WHERE revoked IS NULL"
                              : "INSERT OR IGNORE INTO edge_tokens(hash, tenant, application, "
                                "created) VALUES(?1, ?2, ?3, ?4)";
        if (sqlite3_prepare_v2(a->db, sql, -1, &st, NULL) != SQLITE_OK) {
            rc = -1;
        } else {
            sqlite3_bind_text(st, 1, h, -1, SQLITE_STATIC);
            sqlite3_bind_text(st, 2, t->tenant, -1, SQLITE_STATIC);
            sqlite3_bind_text(st, 3, t->application, -1, SQLITE_STATIC);
            sqlite3_bind_int64(st, 4, t->created);
            if (t->revoked) sqlite3_bind_int64(st, 5, t->revoked);
            if (sqlite3_step(st) != SQLITE_DONE) rc = -1;
            else if (sqlite3_changes(a->db)) (*(t->revoked ? revoked : added))++;
        }
        sqlite3_finalize(st);
        if (rc) snprintf(err, errlen, "%s: %s", db, sqlite3_errmsg(a->db));
    }
    sqlite3_exec(a->db, rc == 0 ? "COMMIT" : "ROLLBACK", NULL, NULL, NULL);
    edge_auth_close(&ap);
    return rc;
}
