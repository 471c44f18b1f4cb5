/*
 * fi_coord_tokens.c - edges' application tokens at the coordinator. See
 * fi_coord_tokens.h.
 */
#include "fi_coord_tokens.h"

#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_db.h"

#define S_MAX_LIST 2048 /* tokens in one list reply, at most (the newest; it must fit
                           FI_WIRE_MAX_MSG: about 330 bytes a token at most) */
#define S_SYNC_PAGE 1024 /* tokens in one AppTokenSync; a site's whole set goes in pages */

struct fi_apptok {
    sqlite3 *db; /* the coordinator's database, our own connection */
};

fi_apptok *fi_apptok_open(const char *db, char *err, size_t errlen) {
    fi_apptok *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    int rc = sqlite3_open(db, &t->db);
    if (rc == SQLITE_OK) rc = sqlite3_busy_timeout(t->db, 5000);
    if (rc == SQLITE_OK) {
        if (fi_db_check(t->db, db, err, errlen) != 0) goto fail; /* damaged, or locked: err says */
        rc = sqlite3_exec(t->db,
                          "CREATE TABLE IF NOT EXISTS app_tokens(hash TEXT PRIMARY KEY, site TEXT NOT NULL,"
                          " tenant TEXT NOT NULL, application TEXT NOT NULL, created INTEGER NOT NULL,"
                          " revoked INTEGER NOT NULL DEFAULT 0, author TEXT NOT NULL);",
                          NULL, NULL, NULL);
    }
    if (rc != SQLITE_OK) {
        const char *why = t->db ? sqlite3_errmsg(t->db) : "cannot open";
        if (!fi_db_damaged(rc, db, why, err, errlen)) snprintf(err, errlen, "%s: app_tokens: %s", db, why);
        goto fail;
    }
    return t;
fail:
    fi_apptok_destroy(&t);
    return NULL;
}

void fi_apptok_busy_timeout(fi_apptok *t, int ms) { sqlite3_busy_timeout(t->db, ms); }

void fi_apptok_destroy(fi_apptok **tp) {
    fi_apptok *t = *tp;
    if (!t) return;
    *tp = NULL;
    sqlite3_close(t->db);
    free(t);
}

static int s_name_ok(const char *s) {
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > 63) return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == '-'))
            return 0;
    }
    return 1;
}

static int s_hash_ok(const char *s) {
    if (!s || strlen(s) != 64) return 0;
    for (int i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
    return 1;
}

/* Rows of one query as AppToken messages (strings owned by the result). */
typedef struct s_rows {
    Fi__AppToken *tok;
    Fi__AppToken **ptr;
    char (*str)[5][80];
    size_t n;
} s_rows;

/* Rows matching where (with ?1 = arg), ordered by creation (newest first
 * with newest), limit of them from offset on. */
static int s_query_page(fi_apptok *t, const char *where, const char *arg, int newest, int limit,
                        long long offset, s_rows *r) {
    char sql[320];
    snprintf(sql, sizeof sql,
             "SELECT hash, site, tenant, application, created, revoked, author FROM app_tokens%s "
             "ORDER BY created %s, hash %s LIMIT %d OFFSET %lld",
             where, newest ? "DESC" : "", newest ? "DESC" : "", limit, offset);
    sqlite3_stmt *st = NULL;
    memset(r, 0, sizeof *r);
    if (sqlite3_prepare_v2(t->db, sql, -1, &st, NULL) != SQLITE_OK) return -1;
    if (arg) sqlite3_bind_text(st, 1, arg, -1, SQLITE_TRANSIENT);
    size_t cap = 0;
    int rc = 0;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (r->n == cap) {
            cap = cap ? 2 * cap : 16;
            Fi__AppToken *a = realloc(r->tok, cap * sizeof *a);
            if (a) r->tok = a;
            char(*s)[5][80] = realloc(r->str, cap * sizeof *s);
            if (s) r->str = s;
            if (!a || !s) break;
        }
        Fi__AppToken *a = &r->tok[r->n];
        fi__app_token__init(a);
        for (int k = 0; k < 4; k++)
            snprintf(r->str[r->n][k], 80, "%s", (const char *)sqlite3_column_text(st, k));
        snprintf(r->str[r->n][4], 80, "%s", (const char *)sqlite3_column_text(st, 6));
        a->created = sqlite3_column_int64(st, 4);
        a->revoked = sqlite3_column_int64(st, 5);
        r->n++;
    }
    sqlite3_finalize(st);
    r->ptr = calloc(r->n + 1, sizeof *r->ptr);
    if (!r->ptr) return -1;
    for (size_t i = 0; i < r->n; i++) {
        Fi__AppToken *a = &r->tok[i];
        a->hash = r->str[i][0];
        a->site = r->str[i][1];
        a->tenant = r->str[i][2];
        a->application = r->str[i][3];
        a->author = r->str[i][4];
        r->ptr[i] = a;
    }
    return rc == SQLITE_DONE ? 0 : -1;
}

static int s_query(fi_apptok *t, const char *where, const char *arg, s_rows *r) {
    return s_query_page(t, where, arg, 1, S_MAX_LIST, 0, r);
}

static void s_rows_free(s_rows *r) {
    free(r->tok);
    free(r->ptr);
    free(r->str);
}

static uint8_t *s_sync(const s_rows *r, size_t *len) {
    Fi__AppTokenSync sy = FI__APP_TOKEN_SYNC__INIT;
    sy.n_tokens = r->n;
    sy.tokens = r->ptr;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_APP_TOKEN_SYNC;
    m.app_token_sync = &sy;
    return fi_wire_encode(&m, len);
}

uint8_t *fi_apptok_sync_site(fi_apptok *t, const char *site, long long *offset, size_t *len) {
    s_rows r;
    uint8_t *out = NULL;
    if (s_query_page(t, " WHERE site=?1", site, 0, S_SYNC_PAGE, *offset, &r) == 0 && r.n) {
        out = s_sync(&r, len);
        *offset += (long long)r.n;
    }
    s_rows_free(&r);
    return out;
}

uint8_t *fi_apptok_handle(fi_apptok *t, const char *author, const Fi__AppTokenRequest *rq,
                          const fi_apptok_fleet *fleet, size_t *len) {
    const char *op = rq->op ? rq->op : "";
    char msg[256] = "";
    Fi__ErrorCode code = FI__ERROR_CODE__ERR_BAD_REQUEST;
    s_rows r;
    memset(&r, 0, sizeof r);
    if (!strcmp(op, "add")) {
        if (!s_name_ok(rq->site) || !s_name_ok(rq->tenant) || !s_name_ok(rq->application)) {
            snprintf(msg, sizeof msg, "token add needs a site, a tenant and an application "
                                      "(names of 1 to 63 characters of [A-Za-z0-9._-])");
        } else if (!s_hash_ok(rq->hash)) {
            snprintf(msg, sizeof msg, "token add needs the token's SHA-256 as 64 lower-case hex "
                                      "characters (fedctl computes it; the token never travels)");
        } else if (!fleet->site_has_edge(fleet->user, rq->site)) {
            code = FI__ERROR_CODE__ERR_NOT_FOUND;
            snprintf(msg, sizeof msg, "no edge is enrolled for site '%s'", rq->site);
        } else {
            sqlite3_stmt *st = NULL;
            int rc = sqlite3_prepare_v2(t->db,
                                        "INSERT INTO app_tokens(hash, site, tenant, application, "
                                        "created, author) VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
                                        -1, &st, NULL);
            if (rc == SQLITE_OK) {
                sqlite3_bind_text(st, 1, rq->hash, -1, SQLITE_STATIC);
                sqlite3_bind_text(st, 2, rq->site, -1, SQLITE_STATIC);
                sqlite3_bind_text(st, 3, rq->tenant, -1, SQLITE_STATIC);
                sqlite3_bind_text(st, 4, rq->application, -1, SQLITE_STATIC);
                sqlite3_bind_int64(st, 5, (int64_t)time(NULL));
                sqlite3_bind_text(st, 6, author, -1, SQLITE_STATIC);
                rc = sqlite3_step(st);
            }
            sqlite3_finalize(st);
            if (rc == SQLITE_CONSTRAINT) {
                snprintf(msg, sizeof msg, "a token with that hash exists already");
            } else if (rc != SQLITE_DONE) {
                code = FI__ERROR_CODE__ERR_INTERNAL;
                snprintf(msg, sizeof msg, "app_tokens: %s", sqlite3_errmsg(t->db));
            } else if (s_query(t, " WHERE hash=?1", rq->hash, &r) != 0) {
                code = FI__ERROR_CODE__ERR_INTERNAL;
                snprintf(msg, sizeof msg, "app_tokens: cannot read back");
            }
        }
    } else if (!strcmp(op, "revoke")) {
        if (!s_hash_ok(rq->hash)) {
            snprintf(msg, sizeof msg, "token revoke needs the token's SHA-256 (64 hex characters)");
        } else {
            sqlite3_stmt *st = NULL;
            int rc = sqlite3_prepare_v2(t->db,
                                        "UPDATE app_tokens SET revoked=?2 WHERE hash=?1 AND revoked=0",
                                        -1, &st, NULL);
            if (rc == SQLITE_OK) {
                sqlite3_bind_text(st, 1, rq->hash, -1, SQLITE_STATIC);
                sqlite3_bind_int64(st, 2, (int64_t)time(NULL));
                rc = sqlite3_step(st);
            }
            sqlite3_finalize(st);
            if (rc != SQLITE_DONE) {
                code = FI__ERROR_CODE__ERR_INTERNAL;
                snprintf(msg, sizeof msg, "app_tokens: %s", sqlite3_errmsg(t->db));
            } else if (sqlite3_changes(t->db) != 1) {
                code = FI__ERROR_CODE__ERR_NOT_FOUND;
                snprintf(msg, sizeof msg, "no active token has that hash");
            } else if (s_query(t, " WHERE hash=?1", rq->hash, &r) != 0) {
                code = FI__ERROR_CODE__ERR_INTERNAL;
                snprintf(msg, sizeof msg, "app_tokens: cannot read back");
            }
        }
    } else if (!strcmp(op, "list")) {
        int site = rq->site && rq->site[0];
        if (site && !s_name_ok(rq->site)) snprintf(msg, sizeof msg, "bad site name");
        else if (s_query(t, site ? " WHERE site=?1" : "", site ? rq->site : NULL, &r) != 0) {
            code = FI__ERROR_CODE__ERR_INTERNAL;
            snprintf(msg, sizeof msg, "app_tokens: cannot list");
        }
    } else {
        snprintf(msg, sizeof msg, "token op '%.32s' is not add, revoke or list", op);
    }
    uint8_t *out;
    if (msg[0]) {
        out = fi_wire_error("", code, msg, len);
    } else {
        Fi__AppTokenReply rep = FI__APP_TOKEN_REPLY__INIT;
        if (strcmp(op, "list") && r.n == 1) {
            size_t sl = 0;
            uint8_t *sync = s_sync(&r, &sl);
            if (sync) rep.pushed = (uint32_t)fleet->push(fleet->user, r.tok[0].site, sync, sl);
            free(sync);
        }
        rep.n_tokens = r.n;
        rep.tokens = r.ptr;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_APP_TOKEN_REPLY;
        m.app_token_reply = &rep;
        out = fi_wire_encode(&m, len);
    }
    s_rows_free(&r);
    return out;
}
