/*
 * policy_audit.c - the hash-chained, append-only decision log (contract and
 * chain definition in fi_audit.h).
 */
#include <errno.h>
#include <sodium.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "fi_audit.h"
#include "fi_db.h"

struct fi_audit {
    sqlite3 *db; /* the open database */
    /* fi_audit_set_adopt_check: whether a source may be taken over by an
     * uploader of origin (NULL: never) */
    int (*may_adopt)(void *user, const char *old_source, const char *origin);
    void *adopt_user;
    int prov;    /* the audit table has the provenance columns (not: a log made before them, read-only) */
    int sources; /* the file has audit_sources (the held heads) */
    int legacy;  /* it has audit_sources_legacy (the heads held when the columns were added) */
    int witnessed; /* it has audit_witnesses (a log made before them, read-only, has not) */
};

static const char *s_schema =
    "PRAGMA journal_mode=WAL;"
    "PRAGMA synchronous=FULL;"
    "CREATE TABLE IF NOT EXISTS audit("
    " seq INTEGER PRIMARY KEY,"
    " time INTEGER NOT NULL,"
    " request_id TEXT NOT NULL, tenant TEXT NOT NULL, application TEXT NOT NULL,"
    " origin TEXT NOT NULL, labels TEXT NOT NULL, model TEXT NOT NULL,"
    " latency_ms INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,"
    " decision TEXT NOT NULL, target TEXT NOT NULL, rules TEXT NOT NULL, policy_digest TEXT NOT NULL,"
    " prev_hash TEXT NOT NULL, hash TEXT NOT NULL,"
    " source TEXT NOT NULL DEFAULT '', source_seq INTEGER NOT NULL DEFAULT 0,"
    " source_hash TEXT NOT NULL DEFAULT '', received INTEGER NOT NULL DEFAULT 0);"
    "CREATE INDEX IF NOT EXISTS audit_time ON audit(time);"
    "CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit"
    " BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;"
    "CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit"
    " BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;"
    "CREATE TABLE IF NOT EXISTS audit_sources("
    " source TEXT PRIMARY KEY, seq INTEGER NOT NULL, hash TEXT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS audit_witnesses("
    " who TEXT PRIMARY KEY, site TEXT NOT NULL, seq INTEGER NOT NULL, hash TEXT NOT NULL,"
    " reported INTEGER NOT NULL);";

/* A log made before provenance existed (fi_audit_open adds the columns;
 * a read-only handle reads them as absent). Its heads of that time are
 * kept, so that each source's run goes on from them in verify. */
static const char *s_migrate_sql =
    "ALTER TABLE audit ADD COLUMN source TEXT NOT NULL DEFAULT '';"
    "ALTER TABLE audit ADD COLUMN source_seq INTEGER NOT NULL DEFAULT 0;"
    "ALTER TABLE audit ADD COLUMN source_hash TEXT NOT NULL DEFAULT '';"
    "ALTER TABLE audit ADD COLUMN received INTEGER NOT NULL DEFAULT 0;"
    "CREATE TABLE audit_sources_legacy(source TEXT PRIMARY KEY, seq INTEGER NOT NULL, hash TEXT NOT NULL);"
    "INSERT INTO audit_sources_legacy(source, seq, hash) SELECT source, seq, hash FROM audit_sources;"
    "CREATE TRIGGER audit_legacy_no_update BEFORE UPDATE ON audit_sources_legacy"
    " BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;"
    "CREATE TRIGGER audit_legacy_no_delete BEFORE DELETE ON audit_sources_legacy"
    " BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;";

#define COLS_BASE                                                                                                \
    "seq, time, request_id, tenant, application, origin, labels, model, latency_ms, prompt_tokens, decision, " \
    "target, rules, policy_digest, prev_hash, hash"
#define COLS COLS_BASE ", source, source_seq, source_hash, received"
/* the same columns from a log without provenance */
#define COLS_OLD COLS_BASE ", '', 0, '', 0"
#define N_COLS 20

/* 1 when table exists, 0 when not, -1 on an error. */
static int s_has_table(sqlite3 *db, const char *table) {
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(db, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?", -1, &st,
                           NULL) != SQLITE_OK)
        return -1;
    sqlite3_bind_text(st, 1, table, -1, SQLITE_STATIC);
    int r = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int(st, 0) > 0 : -1;
    sqlite3_finalize(st);
    return r;
}

/* 1 when the audit table has the provenance columns, 0 when not, -1. */
static int s_has_prov(sqlite3 *db) {
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(db, "SELECT count(*) FROM pragma_table_info('audit') WHERE name = 'source'", -1, &st,
                           NULL) != SQLITE_OK)
        return -1;
    int r = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int(st, 0) > 0 : -1;
    sqlite3_finalize(st);
    return r;
}

/* Notes which tables and columns the file has. 0 or -1 (SQLite error). */
static int s_probe(fi_audit *a) {
    if ((a->prov = s_has_prov(a->db)) < 0 || (a->sources = s_has_table(a->db, "audit_sources")) < 0 ||
        (a->legacy = s_has_table(a->db, "audit_sources_legacy")) < 0 ||
        (a->witnessed = s_has_table(a->db, "audit_witnesses")) < 0)
        return -1;
    return 0;
}

/* Adds the provenance columns to a log made before them, in one
 * transaction (another writer may have done it meanwhile). SQLite code. */
static int s_migrate(fi_audit *a, char **msg) {
    int rc = s_has_prov(a->db);
    if (rc != 0) return rc == 1 ? SQLITE_OK : sqlite3_errcode(a->db);
    if ((rc = sqlite3_exec(a->db, "BEGIN IMMEDIATE", NULL, NULL, msg)) != SQLITE_OK) return rc;
    int has = s_has_prov(a->db);
    rc = has < 0 ? sqlite3_errcode(a->db) : has ? SQLITE_OK : sqlite3_exec(a->db, s_migrate_sql, NULL, NULL, msg);
    if (rc == SQLITE_OK) rc = sqlite3_exec(a->db, "COMMIT", NULL, NULL, msg);
    if (rc != SQLITE_OK) sqlite3_exec(a->db, "ROLLBACK", NULL, NULL, NULL);
    return rc;
}

/* A handle without a database yet; NULL (said) when out of memory or
 * libsodium cannot start. */
static fi_audit *s_new(char *err, size_t cap) {
    fi_audit *a = calloc(1, sizeof *a);
    if (!a || sodium_init() < 0) {
        free(a);
        snprintf(err, cap, "out of memory");
        return NULL;
    }
    return a;
}

fi_audit *fi_audit_open(const char *path, char *err, size_t cap) {
    fi_audit *a = s_new(err, cap);
    if (!a) return NULL;
    char *msg = NULL;
    int rc = sqlite3_open_v2(path, &a->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL);
    if (rc == SQLITE_OK) rc = sqlite3_busy_timeout(a->db, 5000);
    if (rc == SQLITE_OK) {
        if (fi_db_check(a->db, path, err, cap) != 0) goto fail; /* damaged, or locked: err says */
        rc = sqlite3_exec(a->db, s_schema, NULL, NULL, &msg);
        if (rc == SQLITE_OK) rc = s_migrate(a, &msg);
        if (rc == SQLITE_OK && s_probe(a) != 0) rc = sqlite3_errcode(a->db);
    }
    if (rc != SQLITE_OK) {
        const char *why = msg ? msg : a->db ? sqlite3_errmsg(a->db) : "out of memory";
        if (!fi_db_damaged(rc, path, why, err, cap)) snprintf(err, cap, "cannot open audit log %s: %s", path, why);
        sqlite3_free(msg);
        goto fail;
    }
    return a;
fail:
    fi_audit_destroy(&a);
    return NULL;
}

/* Opens path read-only as a URI with the given parameters (path's %, ?
 * and # escaped) and checks that it holds an audit log and is not damaged
 * (fi_db_check). 0, 1 when it could not be read at all (SQLITE_CANTOPEN:
 * worth another mode), -1. */
static int s_open_ro(fi_audit *a, const char *path, const char *params, char *err, size_t cap) {
    char uri[4200];
    /* an empty authority before an absolute path ("//x" would be a host);
     * "./" before a relative one (":memory:" would be no file) */
    size_t k = (size_t)snprintf(uri, sizeof uri, "%s", path[0] == '/' ? "file://" : "file:./");
    for (const char *p = path; *p && k + 4 < sizeof uri; p++) {
        if (*p == '%' || *p == '?' || *p == '#')
            k += (size_t)snprintf(uri + k, sizeof uri - k, "%%%02X", (unsigned char)*p);
        else
            uri[k++] = *p;
    }
    snprintf(uri + k, sizeof uri - k, "?%s", params);
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_open_v2(uri, &a->db, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, NULL);
    if (rc == SQLITE_OK) rc = sqlite3_busy_timeout(a->db, 5000);
    if (rc == SQLITE_OK)
        rc = sqlite3_prepare_v2(a->db, "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'audit'",
                                -1, &st, NULL);
    if (rc == SQLITE_OK) rc = sqlite3_step(st);
    int tables = rc == SQLITE_ROW ? sqlite3_column_int(st, 0) : 0;
    const int code = a->db ? sqlite3_extended_errcode(a->db) & 0xff : rc;
    if (rc != SQLITE_ROW) {
        const char *why = a->db ? sqlite3_errmsg(a->db) : "out of memory";
        if (!fi_db_damaged(code, path, why, err, cap)) snprintf(err, cap, "cannot read audit log %s: %s", path, why);
    } else if (tables != 1) {
        snprintf(err, cap, "%s is not an audit log (it has no audit table)", path);
    }
    sqlite3_finalize(st);
    if (rc == SQLITE_ROW && tables == 1 && s_probe(a) != 0) {
        snprintf(err, cap, "cannot read audit log %s: %s", path, sqlite3_errmsg(a->db));
        tables = -1;
    }
    /* a damaged page anywhere is said now, not halfway through a listing */
    if (rc == SQLITE_ROW && tables == 1 && fi_db_check(a->db, path, err, cap) == 0) return 0;
    sqlite3_close(a->db);
    a->db = NULL;
    return rc != SQLITE_ROW && code == SQLITE_CANTOPEN ? 1 : -1;
}

fi_audit *fi_audit_open_readonly(const char *path, char *err, size_t cap) {
    fi_audit *a = s_new(err, cap);
    if (!a) return NULL;
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(err, cap, "cannot read audit log %s: %s", path, strerror(errno));
        free(a);
        return NULL;
    }
    /* mode=ro reads a live log (another process may write it, through the
     * WAL); a copy on read-only media, whose WAL index cannot be made, is
     * read as immutable, but only without a write-ahead log, whose
     * records that reading would miss */
    int rc = s_open_ro(a, path, "mode=ro", err, cap);
    if (rc == 1) {
        char wal[4200];
        snprintf(wal, sizeof wal, "%s-wal", path);
        if (stat(wal, &st) == 0 && st.st_size > 0) {
            snprintf(err, cap,
                     "cannot read audit log %s: its write-ahead log %s holds records that only a reader "
                     "able to create %s-shm can see (run with write access to the folder, or copy the "
                     "three files where it has)",
                     path, wal, path);
            rc = -1;
        } else {
            rc = s_open_ro(a, path, "immutable=1", err, cap);
        }
    }
    if (rc != 0) {
        free(a);
        return NULL;
    }
    return a;
}

void fi_audit_busy_timeout(fi_audit *self, int ms) { sqlite3_busy_timeout(self->db, ms); }

/* The log's file, for messages. */
static const char *s_path(const fi_audit *self) {
    const char *f = sqlite3_db_filename(self->db, "main");
    return f && f[0] ? f : "(in memory)";
}

void fi_audit_set_adopt_check(fi_audit *self,
                              int (*may_adopt)(void *user, const char *old_source, const char *origin),
                              void *user) {
    self->may_adopt = may_adopt;
    self->adopt_user = user;
}

void fi_audit_interrupt(fi_audit *self) { sqlite3_interrupt(self->db); }

void fi_audit_destroy(fi_audit **self_p) {
    if (!self_p || !*self_p) return;
    sqlite3_close((*self_p)->db);
    free(*self_p);
    *self_p = NULL;
}

/* Length of the well-formed UTF-8 sequence at s (1..4), or 0. */
static int s_utf8_len(const unsigned char *s) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    int n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!n) return 0;
    /* the second byte's narrower ranges: no overlong forms, no surrogates,
     * nothing past U+10FFFF */
    unsigned lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
    unsigned hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
    if (s[1] < lo || s[1] > hi) return 0;
    for (int i = 2; i < n; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return n;
}

/* Contract in fi_audit.h. */
void fi_text_clean(char *s) {
    unsigned char *p = (unsigned char *)s;
    while (*p) {
        int n = s_utf8_len(p);
        if (n) {
            p += n;
        } else {
            *p++ = '?';
        }
    }
}

/* The encoding of a record on its way into SHA-256, gathered in a buffer
 * so that the hash is fed in a few large pieces rather than two small
 * ones per field (verify hashes every record, some twice). */
typedef struct s_enc {
    crypto_hash_sha256_state h; /* the hash being computed */
    size_t k;                   /* bytes waiting in b */
    uint8_t b[1024];            /* encoding not yet hashed */
} s_enc;

static void s_enc_bytes(s_enc *e, const void *p, size_t n) {
    if (e->k + n > sizeof e->b) {
        crypto_hash_sha256_update(&e->h, e->b, e->k);
        e->k = 0;
        if (n > sizeof e->b) {
            crypto_hash_sha256_update(&e->h, p, n);
            return;
        }
    }
    memcpy(e->b + e->k, p, n);
    e->k += n;
}

/* A field: 4-byte little-endian length, then its bytes. */
static void s_put_n(s_enc *e, const char *s, size_t n) {
    uint32_t n32 = (uint32_t)n;
    uint8_t le[4] = {(uint8_t)n32, (uint8_t)(n32 >> 8), (uint8_t)(n32 >> 16), (uint8_t)(n32 >> 24)};
    s_enc_bytes(e, le, 4);
    s_enc_bytes(e, s, n);
}

static void s_put(s_enc *e, const char *s) {
    if (!s) s = "";
    s_put_n(e, s, strlen(s));
}

/* A number, in decimal (as "%lld" writes it). */
static void s_put_i(s_enc *e, int64_t x) {
    char b[24], *p = b + sizeof b;
    uint64_t u = x < 0 ? 0 - (uint64_t)x : (uint64_t)x;
    do {
        *--p = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (x < 0) *--p = '-';
    s_put_n(e, p, (size_t)(b + sizeof b - p));
}

static int s_hex_val(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                                                                       : -1;
}

/* 64 hex digits, and nothing else, into out[32]. 0 or -1. */
static int s_hex32(const char *hex, uint8_t out[32]) {
    for (int i = 0; i < 32; i++) {
        int hi = s_hex_val(hex[2 * i]), lo = hi < 0 ? -1 : s_hex_val(hex[2 * i + 1]);
        if (lo < 0) return -1;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return hex[64] ? -1 : 0;
}

/* hash = SHA-256(prev || fields), hex into out[65]. prev_hex "" = genesis. */
static void s_chain(const char *prev_hex, const fi_audit_record *r, char out[65]) {
    uint8_t prev[32] = {0}, d[32];
    if (prev_hex[0] && s_hex32(prev_hex, prev) != 0)
        memset(prev, 0xff, 32); /* a malformed link never matches a real hash */
    s_enc e;
    crypto_hash_sha256_init(&e.h);
    e.k = 0;
    s_enc_bytes(&e, prev, 32);
    s_put_i(&e, r->seq);
    s_put_i(&e, r->time);
    s_put(&e, r->request_id);
    s_put(&e, r->tenant);
    s_put(&e, r->application);
    s_put(&e, r->origin);
    s_put(&e, r->labels);
    s_put(&e, r->model);
    s_put_i(&e, r->latency_ms);
    s_put_i(&e, r->prompt_tokens);
    s_put(&e, r->decision);
    s_put(&e, r->target);
    s_put(&e, r->rules);
    s_put(&e, r->policy_digest);
    if (r->source && r->source[0]) { /* provenance: only a record taken from another log has it */
        s_put(&e, r->source);
        s_put_i(&e, r->source_seq);
        s_put(&e, r->source_hash);
        s_put_i(&e, r->received);
    }
    crypto_hash_sha256_update(&e.h, e.b, e.k);
    crypto_hash_sha256_final(&e.h, d);
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        out[2 * i] = digits[d[i] >> 4];
        out[2 * i + 1] = digits[d[i] & 15];
    }
    out[64] = '\0';
}

static const char *s_nz(const char *s) { return s ? s : ""; }

void fi_audit_chain_hash(const char *prev_hex, const fi_audit_record *rec, char out[65]) {
    fi_audit_record c = *rec;
    c.request_id = s_nz(c.request_id);
    c.tenant = s_nz(c.tenant);
    c.application = s_nz(c.application);
    c.origin = s_nz(c.origin);
    c.labels = s_nz(c.labels);
    c.model = s_nz(c.model);
    c.decision = s_nz(c.decision);
    c.target = s_nz(c.target);
    c.rules = s_nz(c.rules);
    c.policy_digest = s_nz(c.policy_digest);
    c.source = s_nz(c.source);
    c.source_hash[sizeof c.source_hash - 1] = '\0';
    s_chain(prev_hex ? prev_hex : "", &c, out);
}

/* rec as its source encoded it: without the provenance this log adds
 * (read back from this log, its seq is still this log's: the caller puts
 * the source's back). */
static fi_audit_record s_as_sent(const fi_audit_record *rec) {
    fi_audit_record c = *rec;
    c.source = "";
    c.source_seq = 0;
    c.source_hash[0] = '\0';
    c.received = 0;
    return c;
}

/* Appends rec inside the caller's transaction. 0 or -1 (SQLite error). */
static int s_append_tx(fi_audit *self, fi_audit_record *rec) {
    sqlite3_stmt *st = NULL;
    char prev[65] = "";
    char *own[11] = {0}; /* the record's texts, cleaned (below) */
    if (sqlite3_prepare_v2(self->db, "SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1", -1, &st, NULL) !=
        SQLITE_OK)
        goto dberr_tx;
    int r = sqlite3_step(st);
    rec->seq = 1;
    if (r == SQLITE_ROW) {
        rec->seq = sqlite3_column_int64(st, 0) + 1;
        snprintf(prev, sizeof prev, "%s", (const char *)sqlite3_column_text(st, 1));
    } else if (r != SQLITE_DONE) {
        goto dberr_tx;
    }
    sqlite3_finalize(st);
    st = NULL;
    fi_audit_record c = *rec;
    c.source_hash[sizeof c.source_hash - 1] = '\0';
    if (!c.source || !c.source[0]) c = s_as_sent(&c); /* the log's own: no provenance */
    /* every text as valid UTF-8 (fi_text_clean), chained and stored so:
     * a record that JSON cannot carry would stall its source's uploads */
    const char **f[] = {&c.request_id, &c.tenant, &c.application, &c.origin, &c.labels,
                        &c.model, &c.decision, &c.target, &c.rules, &c.policy_digest, &c.source};
    _Static_assert(sizeof f / sizeof f[0] == sizeof own / sizeof own[0], "one copy per text");
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        *f[i] = s_nz(*f[i]);
        if (!(own[i] = strdup(*f[i]))) {
            for (size_t k = 0; k < i; k++) free(own[k]);
            return -1;
        }
        fi_text_clean(own[i]);
        *f[i] = own[i];
    }
    s_chain(prev, &c, rec->hash);
    if (sqlite3_prepare_v2(self->db, "INSERT INTO audit(" COLS ") VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                           -1, &st, NULL) != SQLITE_OK)
        goto dberr_tx;
    sqlite3_bind_int64(st, 1, c.seq);
    sqlite3_bind_int64(st, 2, c.time);
    const char *s[] = {c.request_id, c.tenant, c.application, c.origin, c.labels, c.model};
    for (int i = 0; i < 6; i++) sqlite3_bind_text(st, 3 + i, s[i], -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(st, 9, c.latency_ms);
    sqlite3_bind_int64(st, 10, c.prompt_tokens);
    const char *t[] = {c.decision, c.target, c.rules, c.policy_digest, prev, rec->hash};
    for (int i = 0; i < 6; i++) sqlite3_bind_text(st, 11 + i, t[i], -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(st, 17, c.source, -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(st, 18, c.source_seq);
    sqlite3_bind_text(st, 19, c.source_hash, -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(st, 20, c.received);
    if (sqlite3_step(st) != SQLITE_DONE) goto dberr_tx;
    sqlite3_finalize(st);
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) free(own[i]);
    return 0;
dberr_tx:
    sqlite3_finalize(st);
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) free(own[i]);
    return -1;
}

int fi_audit_append(fi_audit *self, fi_audit_record *rec, char *err, size_t cap) {
    if (sqlite3_exec(self->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) goto dberr;
    if (s_append_tx(self, rec) != 0 || sqlite3_exec(self->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        snprintf(err, cap, "audit log %s: %s", s_path(self), sqlite3_errmsg(self->db));
        sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    return 0;
dberr:
    snprintf(err, cap, "audit log %s: %s", s_path(self), sqlite3_errmsg(self->db));
    return -1;
}

/* The held head of source inside a transaction. 0 or -1. */
static int s_source_head(fi_audit *self, const char *source, int64_t *seq, char head[65]) {
    sqlite3_stmt *st = NULL;
    *seq = 0;
    head[0] = 0;
    if (sqlite3_prepare_v2(self->db, "SELECT seq, hash FROM audit_sources WHERE source = ?", -1, &st, NULL) !=
        SQLITE_OK)
        return -1;
    sqlite3_bind_text(st, 1, source, -1, SQLITE_TRANSIENT);
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) {
        *seq = sqlite3_column_int64(st, 0);
        const char *h = (const char *)sqlite3_column_text(st, 1);
        snprintf(head, 65, "%s", h ? h : "");
    }
    sqlite3_finalize(st);
    return r == SQLITE_ROW || r == SQLITE_DONE ? 0 : -1;
}

/* A source without a head whose batch continues another source's log (a
 * key replaced: the same edge, the same local log, a new key): the one
 * held source whose head is either the record before the batch, with the
 * batch's first record chained to it, or a record of the batch itself
 * (the old key's last batch was taken but its acknowledgement lost, so the
 * edge sends it again under the new key). Its row is taken over by source
 * (inside the caller's transaction); its name goes to from, its head to
 * held and head. 1 taken over, 0 none (or more than one: ambiguous), -1
 * database error. */
static int s_adopt_source(fi_audit *self, const char *source, const char *origin,
                          const fi_audit_record *recs, size_t n, int64_t *held, char head[65], char *from,
                          size_t from_cap) {
    sqlite3_stmt *st = NULL;
    const fi_audit_record *first = &recs[0];
    if (first->seq < 2 || !origin || !self->may_adopt) return 0;
    if (sqlite3_prepare_v2(self->db, "SELECT source, seq, hash FROM audit_sources WHERE seq BETWEEN ? AND ?", -1,
                           &st, NULL) != SQLITE_OK)
        return -1;
    sqlite3_bind_int64(st, 1, first->seq - 1);
    sqlite3_bind_int64(st, 2, recs[n - 1].seq);
    int found = 0, r;
    int64_t at = 0;
    char name[256] = "", hash[65] = "";
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        const char *s = (const char *)sqlite3_column_text(st, 0), *h = (const char *)sqlite3_column_text(st, 2);
        int64_t seq = sqlite3_column_int64(st, 1);
        if (!s || !h || strcmp(s, source) == 0) continue;
        if (seq == first->seq - 1) {
            char want[65];
            fi_audit_record sent = s_as_sent(first);
            fi_audit_chain_hash(h, &sent, want);
            if (strcmp(want, first->hash)) continue;
        } else if (strcmp(recs[seq - first->seq].hash, h)) {
            continue; /* the batch holds that record, but not the one held */
        }
        /* only a source the owner says this uploader may continue (the
         * coordinator: a replaced key of an edge of the same site) */
        if (!self->may_adopt(self->adopt_user, s, origin)) continue;
        if (found++) break; /* two logs end where this one goes on: take neither */
        snprintf(name, sizeof name, "%s", s);
        snprintf(hash, sizeof hash, "%s", h);
        at = seq;
    }
    sqlite3_finalize(st);
    if (r != SQLITE_ROW && r != SQLITE_DONE) return -1;
    if (found != 1) return 0;
    if (sqlite3_prepare_v2(self->db, "DELETE FROM audit_sources WHERE source = ?", -1, &st, NULL) != SQLITE_OK)
        return -1;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_TRANSIENT);
    r = sqlite3_step(st);
    sqlite3_finalize(st);
    if (r != SQLITE_DONE) return -1;
    *held = at;
    snprintf(head, 65, "%s", hash);
    snprintf(from, from_cap, "%s", name);
    return 1;
}

int fi_audit_source_head(fi_audit *self, const char *source, int64_t *seq, char head[65], char *err, size_t cap) {
    if (s_source_head(self, source, seq, head) != 0) {
        snprintf(err, cap, "audit log: %s", sqlite3_errmsg(self->db));
        return -1;
    }
    return 0;
}

int fi_audit_ingest(fi_audit *self, const char *source, const char *origin, const fi_audit_record *recs, size_t n,
                    size_t *taken, char *err, size_t cap) {
    *taken = 0;
    if (cap) err[0] = '\0';
    if (!source || !source[0]) {
        snprintf(err, cap, "audit batch without a source");
        return 1;
    }
    /* Checks that need nothing from the database first. */
    for (size_t i = 0; i < n; i++) {
        const fi_audit_record *r = &recs[i];
        if (r->seq < 1 || (i && r->seq != recs[i - 1].seq + 1)) {
            snprintf(err, cap, "audit batch: record %zu has sequence number %lld, expected %lld", i,
                     (long long)r->seq, (long long)(i ? recs[i - 1].seq + 1 : 1));
            return 1;
        }
        if (origin && strcmp(s_nz(r->origin), origin)) {
            snprintf(err, cap, "audit batch: record %lld has origin '%.64s', not the uploader's site '%.64s'",
                     (long long)r->seq, s_nz(r->origin), origin);
            return 1;
        }
        if (i) {
            char h[65];
            fi_audit_record sent = s_as_sent(r);
            fi_audit_chain_hash(recs[i - 1].hash, &sent, h);
            if (strcmp(h, r->hash)) {
                snprintf(err, cap, "audit batch: record %lld does not hash to its chain hash (edited, or not linked "
                         "to record %lld)", (long long)r->seq, (long long)r->seq - 1);
                return 1;
            }
        }
    }
    if (sqlite3_exec(self->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) goto dberr;
    int64_t held;
    char head[65];
    if (s_source_head(self, source, &held, head) != 0) goto dberr_tx;
    char adopted[256] = "";
    if (held == 0 && n && recs[0].seq > 1 &&
        s_adopt_source(self, source, origin, recs, n, &held, head, adopted, sizeof adopted) < 0)
        goto dberr_tx;
    int refused = 0;
    if (n && recs[0].seq > held + 1) {
        snprintf(err, cap, "audit batch starts at record %lld but records %lld..%lld were never received",
                 (long long)recs[0].seq, (long long)held + 1, (long long)recs[0].seq - 1);
        refused = 1;
    }
    /* The link between what is held and what is new: the first record
     * after the held head must chain from it (genesis for record 1). */
    for (size_t i = 0; !refused && i < n; i++) {
        const fi_audit_record *r = &recs[i];
        if (r->seq == held && strcmp(r->hash, head)) {
            snprintf(err, cap, "audit batch: record %lld differs from the one already received (the source's log "
                     "was rewritten)", (long long)r->seq);
            refused = 1;
        } else if (r->seq == held + 1 && i == 0) {
            char h[65];
            fi_audit_record sent = s_as_sent(r);
            fi_audit_chain_hash(held ? head : "", &sent, h);
            if (strcmp(h, r->hash)) {
                snprintf(err, cap, "audit batch: record %lld does not link to the last record received (%lld) or "
                         "was edited", (long long)r->seq, (long long)held);
                refused = 1;
            }
        }
    }
    if (refused) {
        sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
        return 1;
    }
    size_t k = 0;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (size_t i = 0; i < n; i++) {
        if (recs[i].seq <= held) continue;
        /* provenance from what this log knows, never from the records */
        fi_audit_record c = s_as_sent(&recs[i]);
        c.source = source;
        c.source_seq = recs[i].seq;
        snprintf(c.source_hash, sizeof c.source_hash, "%s", recs[i].hash);
        c.received = (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
        if (s_append_tx(self, &c) != 0) goto dberr_tx;
        k++;
    }
    if (k || adopted[0]) { /* the new head; or, adopted with nothing new, the head taken over */
        sqlite3_stmt *st = NULL;
        if (sqlite3_prepare_v2(self->db, "INSERT OR REPLACE INTO audit_sources(source, seq, hash) VALUES(?,?,?)", -1,
                               &st, NULL) != SQLITE_OK)
            goto dberr_tx;
        sqlite3_bind_text(st, 1, source, -1, SQLITE_TRANSIENT);
        sqlite3_bind_int64(st, 2, k ? recs[n - 1].seq : held);
        sqlite3_bind_text(st, 3, k ? recs[n - 1].hash : head, -1, SQLITE_TRANSIENT);
        int r = sqlite3_step(st);
        sqlite3_finalize(st);
        if (r != SQLITE_DONE) goto dberr_tx;
    }
    if (sqlite3_exec(self->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) goto dberr_tx;
    *taken = k;
    if (adopted[0]) snprintf(err, cap, "continues the log of source %.200s", adopted);
    return 0;
dberr_tx:
    snprintf(err, cap, "audit log: %s", sqlite3_errmsg(self->db));
    sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
    return -1;
dberr:
    snprintf(err, cap, "audit log: %s", sqlite3_errmsg(self->db));
    return -1;
}

/* Appends ", id" to a list buffer. */
static void s_list_add(char *buf, size_t cap, const char *id) {
    size_t k = strlen(buf);
    if (k + strlen(id) + 2 < cap) snprintf(buf + k, cap - k, "%s%s", k ? "," : "", id);
}

int fi_audit_log_decision(fi_audit *self, const fi_policy *pol, const fi_request *req, const fi_verdict *v, size_t n,
                          const char *const *names, int64_t time_ms, char *err, size_t cap) {
    char labels[1024] = "", rules[1024] = "", digest[65] = "";
    for (size_t i = 0; i < req->n_labels; i++) s_list_add(labels, sizeof labels, req->labels[i] ? req->labels[i] : "");
    int b = fi_verdict_best(v, n);
    const char *target = "";
    const char *decision = "deny";
    if (pol) fi_policy_digest_hex(pol, digest);
    if (b >= 0) {
        /* names, when given, are what v[].target indexes (fi_policy_fallback,
         * fi_policy_decide_names); otherwise v[].target is pol's index */
        target = names ? names[v[b].target] : fi_policy_target_name(pol, v[b].target);
        decision = v[b].cause == FI_CAUSE_FALLBACK ? "fallback" : "permit";
        unsigned k = v[b].n_rules < FI_VERDICT_MAX_RULES ? v[b].n_rules : FI_VERDICT_MAX_RULES;
        for (unsigned i = 0; pol && i < k; i++) s_list_add(rules, sizeof rules, fi_policy_rule_id(pol, v[b].rules[i]));
        k = v[b].n_prefer < FI_VERDICT_MAX_RULES ? v[b].n_prefer : FI_VERDICT_MAX_RULES;
        for (unsigned i = 0; pol && i < k; i++) s_list_add(rules, sizeof rules, fi_policy_rule_id(pol, v[b].prefer[i]));
    } else {
        for (size_t t = 0; t < n; t++) {
            if (v[t].cause == FI_CAUSE_FALLBACK) decision = "fallback";
            unsigned k = v[t].n_rules < FI_VERDICT_MAX_RULES ? v[t].n_rules : FI_VERDICT_MAX_RULES;
            for (unsigned i = 0; pol && v[t].cause == FI_CAUSE_FORBID && i < k; i++) {
                const char *id = fi_policy_rule_id(pol, v[t].rules[i]);
                char pad[300];
                snprintf(pad, sizeof pad, ",%s,", id);
                char hay[1100];
                snprintf(hay, sizeof hay, ",%s,", rules);
                if (!strstr(hay, pad)) s_list_add(rules, sizeof rules, id);
            }
        }
        if (!rules[0] && pol) snprintf(rules, sizeof rules, "default deny");
    }
    fi_audit_record r;
    memset(&r, 0, sizeof r);
    r.time = time_ms;
    r.request_id = req->request_id;
    r.tenant = req->tenant;
    r.application = req->application;
    r.origin = req->origin_site;
    r.labels = labels;
    r.model = req->model;
    r.latency_ms = req->latency_ms < 0 ? -1 : req->latency_ms;
    r.prompt_tokens = req->prompt_tokens < 0 ? -1 : req->prompt_tokens;
    r.decision = decision;
    r.target = target;
    r.rules = rules;
    r.policy_digest = digest;
    return fi_audit_append(self, &r, err, cap);
}

/* The column of the row at st that is not stored as the log writes it
 * (INTEGER, or TEXT without a NUL byte), or NULL: the chain hashes the
 * values as read back, so an edit that changes only a column's type, or
 * hides bytes behind a NUL, would otherwise keep the hash. Call before
 * any other column accessor (they convert). */
static int s_integer_col(int i) { return i == 0 || i == 1 || i == 8 || i == 9 || i == 17 || i == 19; }

static const char *s_stored_as_written(sqlite3_stmt *st) {
    static const char *const names[N_COLS] = {"seq", "time", "request_id", "tenant", "application", "origin",
                                              "labels", "model", "latency_ms", "prompt_tokens", "decision",
                                              "target", "rules", "policy_digest", "prev_hash", "hash",
                                              "source", "source_seq", "source_hash", "received"};
    for (int i = 0; i < N_COLS; i++) {
        if (sqlite3_column_type(st, i) != (s_integer_col(i) ? SQLITE_INTEGER : SQLITE_TEXT)) return names[i];
    }
    for (int i = 0; i < N_COLS; i++) {
        if (s_integer_col(i)) continue;
        const char *t = (const char *)sqlite3_column_text(st, i);
        if (!t || (size_t)sqlite3_column_bytes(st, i) != strlen(t)) return names[i];
    }
    return NULL;
}

static void s_read(sqlite3_stmt *st, fi_audit_record *r, const char **prev) {
    memset(r, 0, sizeof *r);
    r->seq = sqlite3_column_int64(st, 0);
    r->time = sqlite3_column_int64(st, 1);
    const char **s[] = {&r->request_id, &r->tenant, &r->application, &r->origin, &r->labels, &r->model};
    for (int i = 0; i < 6; i++) *s[i] = (const char *)sqlite3_column_text(st, 2 + i);
    r->latency_ms = sqlite3_column_int64(st, 8);
    r->prompt_tokens = sqlite3_column_int64(st, 9);
    const char **t[] = {&r->decision, &r->target, &r->rules, &r->policy_digest};
    for (int i = 0; i < 4; i++) *t[i] = (const char *)sqlite3_column_text(st, 10 + i);
    *prev = (const char *)sqlite3_column_text(st, 14);
    snprintf(r->hash, sizeof r->hash, "%s", s_nz((const char *)sqlite3_column_text(st, 15)));
    r->source = (const char *)sqlite3_column_text(st, 16);
    r->source_seq = sqlite3_column_int64(st, 17);
    snprintf(r->source_hash, sizeof r->source_hash, "%s", s_nz((const char *)sqlite3_column_text(st, 18)));
    r->received = sqlite3_column_int64(st, 19);
    const char **all[] = {&r->request_id, &r->tenant, &r->application, &r->origin, &r->labels, &r->model,
                          &r->decision, &r->target, &r->rules, &r->policy_digest, prev, &r->source};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (!*all[i]) *all[i] = "";
}

int fi_audit_query(fi_audit *self, const fi_audit_filter *f, int (*fn)(const fi_audit_record *r, void *arg), void *arg,
                   char *err, size_t cap) {
    static const fi_audit_filter none;
    if (!f) f = &none;
#define S_QUERY(cols)                                                                                           \
    "SELECT * FROM (SELECT " cols " FROM audit WHERE time >= ?1 AND (?2 = 0 OR time < ?2)"                      \
    " AND (?3 IS NULL OR origin = ?3) AND (?4 IS NULL OR instr(',' || labels || ',', ',' || ?4 || ',') > 0)"  \
    " AND (?5 IS NULL OR target = ?5) AND (?6 IS NULL OR decision = ?6) AND (?7 IS NULL OR request_id = ?7)"  \
    " AND (?8 IS NULL OR instr(',' || rules || ',', ',' || ?8 || ',') > 0) AND seq > ?10"                     \
    " ORDER BY seq DESC LIMIT ?9) ORDER BY seq"
    const char *sql = self->prov ? S_QUERY(COLS) : S_QUERY(COLS_OLD);
#undef S_QUERY
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(self->db, sql, -1, &st, NULL) != SQLITE_OK) {
        snprintf(err, cap, "audit log: %s", sqlite3_errmsg(self->db));
        return -1;
    }
    sqlite3_bind_int64(st, 1, f->since_ms);
    sqlite3_bind_int64(st, 2, f->until_ms);
    const char *b[] = {f->origin, f->label, f->target, f->decision, f->request_id, f->rule};
    for (int i = 0; i < 6; i++)
        if (b[i]) sqlite3_bind_text(st, 3 + i, b[i], -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(st, 9, f->limit ? (sqlite3_int64)f->limit : -1);
    sqlite3_bind_int64(st, 10, f->after_seq);
    int r;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        fi_audit_record rec;
        const char *prev;
        s_read(st, &rec, &prev);
        if (fn(&rec, arg)) {
            r = SQLITE_DONE;
            break;
        }
    }
    if (r != SQLITE_DONE) snprintf(err, cap, "audit log: %s", sqlite3_errmsg(self->db));
    sqlite3_finalize(st);
    return r == SQLITE_DONE ? 0 : -1;
}

/* --- verify: each source's run ------------------------------------------- */

/* What verify knows of one source's run through the log. */
typedef struct s_src {
    char *name;    /* the source, owned; NULL: an empty slot */
    int64_t last;  /* its last record's source_seq */
    char hash[65]; /* that record's source_hash */
    int64_t at;    /* that record's seq here (0: a head from audit_sources_legacy) */
    int live;      /* its run may go on (0: another source took it over) */
    int headed;    /* an audit_sources row is its head */
} s_src;

/* Sources by name: open addressing, at most half full. */
typedef struct s_srcs {
    s_src *v;   /* slots */
    size_t cap; /* slots, a power of two (0: none yet) */
    size_t n;   /* used */
} s_srcs;

static size_t s_name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (size_t)h;
}

static s_src *s_src_find(const s_srcs *m, const char *name) {
    if (!m->cap) return NULL;
    for (size_t i = s_name_hash(name) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (!m->v[i].name) return NULL;
        if (!strcmp(m->v[i].name, name)) return &m->v[i];
    }
}

/* Adds name (not there yet), zeroed. NULL when out of memory. */
static s_src *s_src_add(s_srcs *m, const char *name) {
    if ((m->n + 1) * 2 > m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 16;
        s_src *v = calloc(cap, sizeof *v);
        if (!v) return NULL;
        for (size_t k = 0; k < m->cap; k++) {
            if (!m->v[k].name) continue;
            size_t i = s_name_hash(m->v[k].name) & (cap - 1);
            while (v[i].name) i = (i + 1) & (cap - 1);
            v[i] = m->v[k];
        }
        free(m->v);
        m->v = v;
        m->cap = cap;
    }
    size_t i = s_name_hash(name) & (m->cap - 1);
    while (m->v[i].name) i = (i + 1) & (m->cap - 1);
    if (!(m->v[i].name = strdup(name))) return NULL;
    m->n++;
    return &m->v[i];
}

static void s_srcs_free(s_srcs *m) {
    for (size_t i = 0; i < m->cap; i++) free(m->v[i].name);
    free(m->v);
    memset(m, 0, sizeof *m);
}

/* Seeds m with the heads of sql's rows (source, seq, hash): the runs of a
 * log made before provenance go on from the heads it held then. 0 or -1
 * (an SQLite error, or out of memory: *oom). */
static int s_seed(fi_audit *self, const char *sql, s_srcs *m, int *oom) {
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(self->db, sql, -1, &st, NULL) != SQLITE_OK) return -1;
    int r;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        const char *name = (const char *)sqlite3_column_text(st, 0), *h = (const char *)sqlite3_column_text(st, 2);
        if (!name || s_src_find(m, name)) continue;
        s_src *e = s_src_add(m, name);
        if (!e) {
            *oom = 1;
            break;
        }
        e->last = sqlite3_column_int64(st, 1);
        snprintf(e->hash, sizeof e->hash, "%s", s_nz(h));
        e->live = 1;
    }
    sqlite3_finalize(st);
    return *oom || (r != SQLITE_ROW && r != SQLITE_DONE) ? -1 : 0;
}

/* Checks rec (a record of source rec->source, the log's own chain already
 * checked) against its source's run in m and takes it into the run. 0, 1
 * broken (out says why), -1 out of memory. */
static int s_check_source(s_srcs *m, const fi_audit_record *rec, fi_audit_check *out) {
    fi_audit_record sent = s_as_sent(rec); /* as the source hashed it: its number, no provenance */
    sent.seq = rec->source_seq;
    char h[65];
    s_src *e = s_src_find(m, rec->source), *from = NULL;
    if (e && e->live) {
        if (rec->source_seq != e->last + 1) {
            snprintf(out->what, sizeof out->what,
                     "record %lld (source %.64s, its record %lld) does not follow the source's record %lld: the "
                     "source's records are missing, repeated or reordered, or the provenance edited",
                     (long long)rec->seq, rec->source, (long long)rec->source_seq, (long long)e->last);
            out->bad_seq = rec->seq;
            return 1;
        }
        fi_audit_chain_hash(e->hash, &sent, h);
    } else if (rec->source_seq == 1) {
        fi_audit_chain_hash("", &sent, h);
    } else {
        /* a replaced key's log taken over (fi_audit_ingest's adoption):
         * another source's run ends at the record before, linked to it */
        for (size_t i = 0; i < m->cap && !from; i++) {
            s_src *t = &m->v[i];
            if (!t->name || !t->live || t == e || t->last != rec->source_seq - 1) continue;
            fi_audit_chain_hash(t->hash, &sent, h);
            if (!strcmp(h, rec->source_hash)) from = t;
        }
        if (!from) {
            snprintf(out->what, sizeof out->what,
                     "record %lld (source %.64s) starts the source's run at its record %lld, which is neither "
                     "record 1 nor linked to another source's last record (records removed, or the provenance "
                     "edited)",
                     (long long)rec->seq, rec->source, (long long)rec->source_seq);
            out->bad_seq = rec->seq;
            return 1;
        }
        from->live = 0;
    }
    if (strcmp(h, rec->source_hash)) {
        snprintf(out->what, sizeof out->what,
                 "record %lld (source %.64s, its record %lld) does not match its source hash: edited, or not "
                 "linked to the source's record %lld",
                 (long long)rec->seq, rec->source, (long long)rec->source_seq, (long long)rec->source_seq - 1);
        out->bad_seq = rec->seq;
        return 1;
    }
    if (!e && !(e = s_src_add(m, rec->source))) return -1;
    e->last = rec->source_seq;
    memcpy(e->hash, rec->source_hash, sizeof e->hash);
    e->at = rec->seq;
    e->live = 1;
    return 0;
}

/* One held head that names no live run (its source's log was taken over
 * by that source with nothing new yet, or the table was edited). */
typedef struct s_orphan {
    char name[256];
    int64_t seq;
    char hash[65];
} s_orphan;

/* Checks every head in audit_sources against the last record of its
 * source's run. 0, 1 broken (out says why), -1 (SQLite error, or out of
 * memory: *oom). */
static int s_check_heads(fi_audit *self, s_srcs *m, fi_audit_check *out, int *oom) {
    sqlite3_stmt *st = NULL;
    s_orphan *orph = NULL;
    size_t n_orph = 0, cap_orph = 0;
    int broken = 0, r;
    if (sqlite3_prepare_v2(self->db, "SELECT source, seq, hash FROM audit_sources ORDER BY source", -1, &st, NULL) !=
        SQLITE_OK)
        return -1;
    while (!broken && (r = sqlite3_step(st)) == SQLITE_ROW) {
        const char *name = s_nz((const char *)sqlite3_column_text(st, 0));
        const char *h = s_nz((const char *)sqlite3_column_text(st, 2));
        int64_t seq = sqlite3_column_int64(st, 1);
        s_src *e = s_src_find(m, name);
        if (e && e->live) {
            e->headed = 1;
            if (seq == e->last && !strcmp(h, e->hash)) continue;
            snprintf(out->what, sizeof out->what,
                     seq > e->last ? "source %.64s's head is its record %lld, but its last record here is its "
                                     "record %lld: records cut from the end of its run, or audit_sources edited"
                                   : "source %.64s's head (its record %lld) does not match its last record here "
                                     "(its record %lld): records cut from the end of its run, or audit_sources "
                                     "edited",
                     name, (long long)seq, (long long)e->last);
            out->bad_seq = e->at ? e->at : out->records;
            broken = 1;
            break;
        }
        if (n_orph == cap_orph) {
            size_t c = cap_orph ? cap_orph * 2 : 8;
            s_orphan *v = realloc(orph, c * sizeof *v);
            if (!v) {
                *oom = 1;
                break;
            }
            orph = v;
            cap_orph = c;
        }
        snprintf(orph[n_orph].name, sizeof orph[n_orph].name, "%s", name);
        orph[n_orph].seq = seq;
        snprintf(orph[n_orph].hash, sizeof orph[n_orph].hash, "%s", h);
        n_orph++;
    }
    int dberr = !broken && !*oom && r != SQLITE_DONE;
    sqlite3_finalize(st);
    if (dberr || *oom) {
        free(orph);
        return -1;
    }
    /* a head that took over another source's run with nothing new yet:
     * that run, headless, ends at it */
    for (size_t k = 0; !broken && k < n_orph; k++) {
        s_src *t = NULL;
        for (size_t i = 0; i < m->cap && !t; i++) {
            s_src *c = &m->v[i];
            if (c->name && c->live && !c->headed && c->last == orph[k].seq && !strcmp(c->hash, orph[k].hash)) t = c;
        }
        if (t) {
            t->headed = 1;
            continue;
        }
        snprintf(out->what, sizeof out->what,
                 "source %.64s's head (its record %lld) matches no record of it here: records cut from the end of "
                 "its run, or audit_sources edited",
                 orph[k].name, (long long)orph[k].seq);
        out->bad_seq = out->records;
        broken = 1;
    }
    free(orph);
    for (size_t i = 0; !broken && i < m->cap; i++) {
        s_src *e = &m->v[i];
        if (!e->name || !e->live || e->headed) continue;
        snprintf(out->what, sizeof out->what,
                 "source %.64s has records here (the last its record %lld) but no head in audit_sources: the table "
                 "was edited",
                 e->name, (long long)e->last);
        out->bad_seq = e->at ? e->at : out->records;
        broken = 1;
    }
    return broken;
}

/* --- witnesses ------------------------------------------------------------ */

int fi_audit_head_valid(int64_t seq, const char *hash) {
    if (seq < 1 || !hash || strlen(hash) != 64) return 0;
    for (const char *c = hash; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f'))) return 0;
    return 1;
}

int fi_audit_head(fi_audit *self, int64_t *seq, char head[65], char *err, size_t cap) {
    sqlite3_stmt *st = NULL;
    *seq = 0;
    head[0] = 0;
    int r = sqlite3_prepare_v2(self->db, "SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1", -1, &st, NULL);
    if (r == SQLITE_OK && (r = sqlite3_step(st)) == SQLITE_ROW) {
        *seq = sqlite3_column_int64(st, 0);
        snprintf(head, 65, "%s", s_nz((const char *)sqlite3_column_text(st, 1)));
    }
    sqlite3_finalize(st);
    if (r == SQLITE_ROW || r == SQLITE_DONE) return 0;
    snprintf(err, cap, "audit log: %s", sqlite3_errmsg(self->db));
    return -1;
}

/* w against the log, as one read (inside the caller's transaction, if
 * any): 0 holds, 1 not (err says so), -1. */
static int s_witness_check(fi_audit *self, const fi_audit_witness *w, char *err, size_t cap) {
    sqlite3_stmt *st = NULL;
    char got[65] = "";
    int found = 0;
    int64_t last = 0;
    int r = sqlite3_prepare_v2(self->db,
                               "SELECT (SELECT hash FROM audit WHERE seq = ?1), (SELECT max(seq) FROM audit)", -1,
                               &st, NULL);
    if (r == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, w->seq);
        if ((r = sqlite3_step(st)) == SQLITE_ROW) {
            found = sqlite3_column_type(st, 0) != SQLITE_NULL;
            snprintf(got, sizeof got, "%s", s_nz((const char *)sqlite3_column_text(st, 0)));
            last = sqlite3_column_int64(st, 1);
        }
    }
    sqlite3_finalize(st);
    if (r != SQLITE_ROW) {
        snprintf(err, cap, "audit log: %s", sqlite3_errmsg(self->db));
        return -1;
    }
    if (found && !strcmp(got, w->hash)) return 0;
    char when[32] = "?";
    time_t t = (time_t)(w->reported / 1000);
    struct tm tm;
    if (w->reported > 0 && gmtime_r(&t, &tm)) strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    const char *site = w->site && w->site[0] ? w->site : "";
    if (!found)
        snprintf(err, cap,
                 "witness %.64s%s%.63s%s was told record %lld (hash %.16s...), reported %s, but the log ends at "
                 "record %lld: records were cut off the end",
                 w->who, site[0] ? " (site " : "", site, site[0] ? ")" : "", (long long)w->seq, w->hash, when,
                 (long long)last);
    else
        snprintf(err, cap,
                 "witness %.64s%s%.63s%s was told record %lld with hash %.16s..., reported %s, but it now has "
                 "hash %.16s...: the log was rewritten from there on",
                 w->who, site[0] ? " (site " : "", site, site[0] ? ")" : "", (long long)w->seq, w->hash, when, got);
    return 1;
}

int fi_audit_witness_check(fi_audit *self, const fi_audit_witness *w, char *err, size_t cap) {
    if (!w->who || !w->who[0] || !fi_audit_head_valid(w->seq, w->hash)) {
        snprintf(err, cap, "a witness needs a name, a record number >= 1 and a 64-hex-digit hash");
        return 1;
    }
    return s_witness_check(self, w, err, cap);
}

/* 1 when the row kept for w->who is another report than w and the log
 * no longer holds it: the evidence stays (fi_audit_witness_put); 0, or -1
 * on a database error. */
static int s_witness_failing(fi_audit *self, const fi_audit_witness *w) {
    sqlite3_stmt *st = NULL;
    fi_audit_witness old = {.who = w->who};
    int r = sqlite3_prepare_v2(self->db, "SELECT seq, hash FROM audit_witnesses WHERE who = ?", -1, &st, NULL);
    if (r == SQLITE_OK) {
        sqlite3_bind_text(st, 1, w->who, -1, SQLITE_TRANSIENT);
        if ((r = sqlite3_step(st)) == SQLITE_ROW) {
            old.seq = sqlite3_column_int64(st, 0);
            snprintf(old.hash, sizeof old.hash, "%s", s_nz((const char *)sqlite3_column_text(st, 1)));
        }
    }
    sqlite3_finalize(st);
    if (r != SQLITE_ROW && r != SQLITE_DONE) return -1;
    if (r == SQLITE_DONE || (old.seq == w->seq && !strcmp(old.hash, w->hash))) return 0;
    char why[8];
    return s_witness_check(self, &old, why, sizeof why);
}

int fi_audit_witness_put(fi_audit *self, const fi_audit_witness *w, size_t n, char *err, size_t cap) {
    for (size_t i = 0; i < n; i++) {
        size_t wl = w[i].who ? strlen(w[i].who) : 0;
        if (wl == 0 || wl > FI_AUDIT_WITNESS_MAX || !fi_audit_head_valid(w[i].seq, w[i].hash) ||
            (w[i].site && strlen(w[i].site) > FI_AUDIT_WITNESS_MAX)) {
            snprintf(err, cap, "witness report %zu: needs a name of 1..%d bytes, a record number >= 1 and a "
                     "64-hex-digit hash", i, FI_AUDIT_WITNESS_MAX);
            return 1;
        }
    }
    if (!self->witnessed) {
        snprintf(err, cap, "audit log %s was opened read-only: it keeps no witnesses", s_path(self));
        return -1;
    }
    sqlite3_stmt *st = NULL;
    int r = sqlite3_exec(self->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (r == SQLITE_OK)
        r = sqlite3_prepare_v2(self->db,
                               "INSERT INTO audit_witnesses(who, site, seq, hash, reported) VALUES(?1, ?2, ?3, ?4, ?5)"
                               " ON CONFLICT(who) DO UPDATE SET site = excluded.site, seq = excluded.seq,"
                               " hash = excluded.hash, reported = excluded.reported WHERE excluded.seq >= seq",
                               -1, &st, NULL);
    for (size_t i = 0; r == SQLITE_OK && i < n; i++) {
        int keep = s_witness_failing(self, &w[i]);
        if (keep < 0) {
            r = sqlite3_errcode(self->db);
            break;
        }
        if (keep) continue;
        sqlite3_reset(st);
        sqlite3_bind_text(st, 1, w[i].who, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(st, 2, w[i].site ? w[i].site : "", -1, SQLITE_TRANSIENT);
        sqlite3_bind_int64(st, 3, w[i].seq);
        sqlite3_bind_text(st, 4, w[i].hash, -1, SQLITE_TRANSIENT);
        sqlite3_bind_int64(st, 5, w[i].reported);
        r = sqlite3_step(st) == SQLITE_DONE ? SQLITE_OK : sqlite3_errcode(self->db);
    }
    sqlite3_finalize(st);
    if (r == SQLITE_OK) r = sqlite3_exec(self->db, "COMMIT", NULL, NULL, NULL);
    if (r == SQLITE_OK) return 0;
    snprintf(err, cap, "audit log: witnesses: %s", sqlite3_errmsg(self->db));
    sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
    return -1;
}

int fi_audit_witness_each(fi_audit *self, int (*fn)(const fi_audit_witness *w, int holds, const char *why, void *arg),
                          void *arg, char *err, size_t cap) {
    if (!self->witnessed) return 0; /* a log made before witnesses, read as it is */
    sqlite3_stmt *st = NULL;
    int r = sqlite3_exec(self->db, "BEGIN", NULL, NULL, NULL);
    if (r == SQLITE_OK)
        r = sqlite3_prepare_v2(self->db, "SELECT who, site, seq, hash, reported FROM audit_witnesses ORDER BY who",
                               -1, &st, NULL);
    int c = 0;
    while (r == SQLITE_OK && (r = sqlite3_step(st)) == SQLITE_ROW) {
        fi_audit_witness w = {.who = s_nz((const char *)sqlite3_column_text(st, 0)),
                              .site = s_nz((const char *)sqlite3_column_text(st, 1)),
                              .seq = sqlite3_column_int64(st, 2),
                              .reported = sqlite3_column_int64(st, 4)};
        snprintf(w.hash, sizeof w.hash, "%s", s_nz((const char *)sqlite3_column_text(st, 3)));
        char why[300] = "";
        if ((c = s_witness_check(self, &w, why, sizeof why)) < 0) break;
        if (fn(&w, c == 0, why, arg)) {
            r = SQLITE_DONE;
            break;
        }
        r = SQLITE_OK;
    }
    if (c >= 0 && r == SQLITE_DONE) {
        sqlite3_finalize(st);
        sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
        return 0;
    }
    snprintf(err, cap, "audit log: witnesses: %s", sqlite3_errmsg(self->db));
    sqlite3_finalize(st);
    sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
    return -1;
}

int fi_audit_witness_forget(fi_audit *self, const char *who, int64_t *removed, char *err, size_t cap) {
    *removed = 0;
    if (!self->witnessed) return 0;
    sqlite3_stmt *st = NULL;
    int r = sqlite3_prepare_v2(self->db, who ? "DELETE FROM audit_witnesses WHERE who = ?" : "DELETE FROM audit_witnesses",
                               -1, &st, NULL);
    if (r == SQLITE_OK) {
        if (who) sqlite3_bind_text(st, 1, who, -1, SQLITE_TRANSIENT);
        r = sqlite3_step(st);
    }
    sqlite3_finalize(st);
    if (r == SQLITE_DONE) {
        *removed = sqlite3_changes(self->db);
        return 0;
    }
    snprintf(err, cap, "audit log: witnesses: %s", sqlite3_errmsg(self->db));
    return -1;
}

/* Every witness kept, inside verify's snapshot: 0, 1 broken (out says
 * which), -1. */
static int s_check_witnesses(fi_audit *self, fi_audit_check *out) {
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(self->db, "SELECT who, site, seq, hash, reported FROM audit_witnesses ORDER BY who", -1,
                           &st, NULL) != SQLITE_OK)
        return -1;
    int broken = 0, r;
    while (!broken && (r = sqlite3_step(st)) == SQLITE_ROW) {
        fi_audit_witness w = {.who = s_nz((const char *)sqlite3_column_text(st, 0)),
                              .site = s_nz((const char *)sqlite3_column_text(st, 1)),
                              .seq = sqlite3_column_int64(st, 2),
                              .reported = sqlite3_column_int64(st, 4)};
        snprintf(w.hash, sizeof w.hash, "%s", s_nz((const char *)sqlite3_column_text(st, 3)));
        out->witnesses++;
        char why[sizeof out->what];
        int c = s_witness_check(self, &w, why, sizeof why);
        if (c < 0) {
            sqlite3_finalize(st);
            return -1;
        }
        if (c) {
            snprintf(out->what, sizeof out->what, "%s", why);
            out->bad_seq = w.seq;
            broken = 1;
        }
    }
    int dberr = !broken && r != SQLITE_DONE;
    sqlite3_finalize(st);
    return dberr ? -1 : broken;
}

int fi_audit_verify(fi_audit *self, fi_audit_check *out, char *err, size_t cap) {
    memset(out, 0, sizeof *out);
    sqlite3_stmt *st = NULL;
    s_srcs m = {0};
    int oom = 0;
    /* one snapshot: the heads read at the end belong to the records read */
    if (sqlite3_exec(self->db, "BEGIN", NULL, NULL, NULL) != SQLITE_OK) goto dberr;
    if (self->legacy && s_seed(self, "SELECT source, seq, hash FROM audit_sources_legacy", &m, &oom) != 0)
        goto dberr;
    /* a log made before provenance, read as it is: its heads are its runs' */
    if (!self->prov && !self->legacy && self->sources &&
        s_seed(self, "SELECT source, seq, hash FROM audit_sources", &m, &oom) != 0)
        goto dberr;
    if (sqlite3_prepare_v2(self->db, self->prov ? "SELECT " COLS " FROM audit ORDER BY seq"
                                                : "SELECT " COLS_OLD " FROM audit ORDER BY seq",
                           -1, &st, NULL) != SQLITE_OK)
        goto dberr;
    char expect_prev[65] = "";
    int64_t expect_seq = 1;
    int r, broken = 0;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        fi_audit_record rec;
        const char *prev;
        const char *odd = s_stored_as_written(st);
        s_read(st, &rec, &prev);
        out->records++;
        if (odd) {
            snprintf(out->what, sizeof out->what,
                     "record %lld was edited: its %s is not stored as the log writes it (type or NUL byte)",
                     (long long)rec.seq, odd);
            out->bad_seq = rec.seq;
            broken = 1;
            break;
        }
        char h[65];
        if (rec.seq != expect_seq) {
            snprintf(out->what, sizeof out->what,
                     rec.seq > expect_seq ? "record %lld is missing (removed): the next one is %lld"
                                          : "record %lld is out of order: found %lld",
                     (long long)expect_seq, (long long)rec.seq);
            out->bad_seq = expect_seq;
            broken = 1;
            break;
        }
        if (strcmp(prev, expect_prev)) {
            snprintf(out->what, sizeof out->what,
                     "record %lld does not link to record %lld (records removed, replaced or reordered)",
                     (long long)rec.seq, (long long)rec.seq - 1);
            out->bad_seq = rec.seq;
            broken = 1;
            break;
        }
        s_chain(prev, &rec, h);
        if (strcmp(h, rec.hash)) {
            snprintf(out->what, sizeof out->what, "record %lld was edited: its content does not match its hash",
                     (long long)rec.seq);
            out->bad_seq = rec.seq;
            broken = 1;
            break;
        }
        if (!rec.source[0] && (rec.source_seq || rec.source_hash[0] || rec.received)) {
            /* the hash covers provenance only with a source */
            snprintf(out->what, sizeof out->what,
                     "record %lld was edited: it has provenance (source_seq, source_hash or received) but no source",
                     (long long)rec.seq);
            out->bad_seq = rec.seq;
            broken = 1;
            break;
        }
        if (rec.source[0] && (broken = s_check_source(&m, &rec, out)) != 0) {
            if (broken < 0) oom = 1;
            break;
        }
        snprintf(expect_prev, sizeof expect_prev, "%s", rec.hash);
        expect_seq++;
    }
    if (oom || (!broken && r != SQLITE_DONE)) goto dberr;
    sqlite3_finalize(st);
    st = NULL;
    if (!broken && self->sources && (broken = s_check_heads(self, &m, out, &oom)) < 0) goto dberr;
    if (!broken && self->witnessed && (broken = s_check_witnesses(self, out)) < 0) goto dberr;
    s_srcs_free(&m);
    sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL); /* read only: ends the snapshot */
    snprintf(out->head, sizeof out->head, "%s", expect_prev);
    return broken;
dberr:
    snprintf(err, cap, "audit log: %s", oom ? "out of memory" : sqlite3_errmsg(self->db));
    sqlite3_finalize(st);
    s_srcs_free(&m);
    sqlite3_exec(self->db, "ROLLBACK", NULL, NULL, NULL);
    return -1;
}

int fi_audit_point_parse(const char *spec, fi_audit_point *p) {
    memset(p, 0, sizeof *p);
    const char *colon = spec ? strchr(spec, ':') : NULL;
    if (!colon || colon == spec || strlen(colon + 1) != 64) return -1;
    int64_t seq = 0;
    for (const char *c = spec; c < colon; c++) {
        if (*c < '0' || *c > '9' || seq > (INT64_MAX - 9) / 10) return -1;
        seq = seq * 10 + (*c - '0');
    }
    for (const char *c = colon + 1; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f'))) return -1;
    if (seq < 1) return -1;
    p->seq = seq;
    memcpy(p->want, colon + 1, 65);
    return 0;
}

int fi_audit_point_row(const fi_audit_record *r, void *arg) {
    fi_audit_point *p = arg;
    if (r->seq < p->seq) return 0;
    if (r->seq == p->seq) {
        p->found = 1;
        snprintf(p->got, sizeof p->got, "%s", r->hash);
    }
    return 1;
}

int fi_audit_point_check(const fi_audit_point *p, int64_t records, char *err, size_t cap) {
    if (!p->found) {
        snprintf(err, cap, "record %lld of the checkpoint is gone: the log holds %lld records (records cut off the end)",
                 (long long)p->seq, (long long)records);
        return 1;
    }
    if (strcmp(p->got, p->want)) {
        snprintf(err, cap, "record %lld now has the chain hash %s, not the %s of the checkpoint (the log was rewritten "
                 "from there on)", (long long)p->seq, p->got, p->want);
        return 1;
    }
    return 0;
}
