/*
 * test_fabric_store.c - keys and their files, strict configuration files,
 * and the SQLite fleet store (peers, one-time tokens, revocation,
 * persistence across reopening).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "db_damage.h"
#include "fi_conf.h"
#include "fi_coord_audit.h"
#include "fi_coord_tokens.h"
#include "fi_wire.h"
#include "fi_keys.h"
#include "fi_store.h"

typedef struct s_dir {
    char path[64]; /* temporary directory */
} s_dir;

static int setup(void **state) {
    s_dir *d = calloc(1, sizeof *d);
    snprintf(d->path, sizeof d->path, "/tmp/fi_store_test_XXXXXX");
    if (!mkdtemp(d->path)) return -1;
    *state = d;
    return 0;
}

static int teardown(void **state) {
    s_dir *d = *state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", d->path);
    if (system(cmd)) return -1;
    free(d);
    return 0;
}

static void test_keys(void **state) {
    s_dir *d = *state;
    char sec[128], pub[128], err[512];
    snprintf(sec, sizeof sec, "%s/k.key", d->path);
    snprintf(pub, sizeof pub, "%s/k.pub", d->path);
    fi_keypair kp, back;
    assert_int_equal(fi_keys_generate(&kp), 0);
    assert_int_equal(fi_keys_save(&kp, sec, pub, 0, err, sizeof err), 0);
    struct stat st;
    assert_int_equal(stat(sec, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    /* no silent overwrite */
    assert_int_equal(fi_keys_save(&kp, sec, pub, 0, err, sizeof err), -1);
    assert_int_equal(fi_keys_load_secret(sec, &back, err, sizeof err), 0);
    assert_memory_equal(back.pub, kp.pub, FI_KEYS_BYTES);
    assert_memory_equal(back.sec, kp.sec, FI_KEYS_BYTES);
    uint8_t p2[FI_KEYS_BYTES];
    assert_int_equal(fi_keys_load_public(pub, p2, err, sizeof err), 0);
    assert_memory_equal(p2, kp.pub, FI_KEYS_BYTES);
    /* a secret key readable by others is refused */
    assert_int_equal(chmod(sec, 0644), 0);
    assert_int_equal(fi_keys_load_secret(sec, &back, err, sizeof err), -1);
    assert_non_null(strstr(err, "accessible by others"));
    assert_int_equal(chmod(sec, 0640), 0);
    assert_int_equal(fi_keys_load_secret(sec, &back, err, sizeof err), -1);
    /* a public file has no secret */
    assert_int_equal(fi_keys_load_secret(pub, &back, err, sizeof err), -1);
    /* a mismatched pair is refused */
    FILE *f = fopen(sec, "w");
    char z1[FI_KEYS_Z85_LEN], z2[FI_KEYS_Z85_LEN];
    fi_keypair other;
    assert_int_equal(fi_keys_generate(&other), 0);
    fi_keys_to_z85(other.pub, z1);
    fi_keys_to_z85(kp.sec, z2);
    fprintf(f, "public = %s\nsecret = %s\n", z1, z2);
    fclose(f);
    assert_int_equal(chmod(sec, 0600), 0);
    assert_int_equal(fi_keys_load_secret(sec, &back, err, sizeof err), -1);
    assert_non_null(strstr(err, "does not match"));
    /* z85, fingerprint, tokens */
    uint8_t k3[FI_KEYS_BYTES];
    assert_int_equal(fi_keys_from_z85(z1, k3), 0);
    assert_memory_equal(k3, other.pub, FI_KEYS_BYTES);
    assert_int_equal(fi_keys_from_z85("short", k3), -1);
    char f1[FI_KEYS_FPR_LEN], f2[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(kp.pub, f1);
    fi_keys_fingerprint(kp.pub, f2);
    assert_string_equal(f1, f2);
    assert_int_equal(strlen(f1), 32);
    char t1[FI_KEYS_TOKEN_LEN], t2[FI_KEYS_TOKEN_LEN], h1[65];
    assert_int_equal(fi_keys_token(t1), 0);
    assert_int_equal(fi_keys_token(t2), 0);
    assert_string_not_equal(t1, t2);
    assert_int_equal(strncmp(t1, "fit_", 4), 0);
    fi_keys_token_hash(t1, h1);
    assert_null(strstr(h1, t1 + 4));
    /* --force writes a new file and renames it over the old one: a link
     * there keeps pointing at what it pointed at, and never gets the secret */
    char target[160], lnk[160], lpub[160];
    snprintf(target, sizeof target, "%s/target", d->path);
    snprintf(lnk, sizeof lnk, "%s/l.key", d->path);
    snprintf(lpub, sizeof lpub, "%s/l.pub", d->path);
    f = fopen(target, "w");
    fputs("old\n", f);
    fclose(f);
    assert_int_equal(symlink(target, lnk), 0);
    assert_int_equal(fi_keys_save(&kp, lnk, lpub, 1, err, sizeof err), 0);
    char line[16] = "";
    f = fopen(target, "r");
    assert_non_null(fgets(line, sizeof line, f));
    fclose(f);
    assert_string_equal(line, "old\n");
    assert_int_equal(lstat(lnk, &st), 0);
    assert_true(S_ISREG(st.st_mode) && (st.st_mode & 0777) == 0600);
    /* the same path twice, a FIFO (refused, not waited on), a second key line */
    assert_int_equal(fi_keys_save(&kp, sec, sec, 1, err, sizeof err), -1);
    char fifo[160];
    snprintf(fifo, sizeof fifo, "%s/fifo.key", d->path);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(fi_keys_load_secret(fifo, &back, err, sizeof err), -1);
    assert_non_null(strstr(err, "not a regular file"));
    f = fopen(sec, "w");
    fprintf(f, "secret = %s\nsecret = %s\n", z2, z2);
    fclose(f);
    assert_int_equal(chmod(sec, 0600), 0);
    assert_int_equal(fi_keys_load_secret(sec, &back, err, sizeof err), -1);
    assert_non_null(strstr(err, "second key line"));
    fi_keys_wipe(&kp);
    uint8_t zero[sizeof kp] = {0};
    assert_memory_equal(&kp, zero, sizeof kp);
}

typedef struct s_cfg {
    char name[FI_CONF_STR_MAX]; /* required string */
    int n;                      /* optional int in [1, 10] */
    int even;                   /* optional even int in [0, 8] */
} s_cfg;

static const fi_conf_key s_keys[] = {
    {"name", FI_CONF_STR, offsetof(s_cfg, name), 1, 0, 0, 0},
    {"n", FI_CONF_INT, offsetof(s_cfg, n), 0, 1, 10, 0},
    {"even", FI_CONF_INT, offsetof(s_cfg, even), 0, 0, 8, 2},
    {NULL, FI_CONF_STR, 0, 0, 0, 0, 0},
};

static int s_conf(const char *dir, const char *text, s_cfg *c, char *err, size_t errlen) {
    char path[128];
    snprintf(path, sizeof path, "%s/c.conf", dir);
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
    memset(c, 0, sizeof *c);
    c->n = 5;
    return fi_conf_load(path, s_keys, c, err, errlen);
}

/* A secret key file owned by another user is refused: its owner could
 * swap the key. Only root can give a file away, so elsewhere this skips. */
static void test_key_owner(void **state) {
    s_dir *d = *state;
    if (geteuid() != 0) skip();
    char sec[128], pub[128], err[512];
    snprintf(sec, sizeof sec, "%s/o.key", d->path);
    snprintf(pub, sizeof pub, "%s/o.pub", d->path);
    fi_keypair kp, back;
    assert_int_equal(fi_keys_generate(&kp), 0);
    assert_int_equal(fi_keys_save(&kp, sec, pub, 0, err, sizeof err), 0);
    assert_int_equal(chown(sec, 12345, (gid_t)-1), 0);
    assert_int_equal(fi_keys_load_secret(sec, &back, err, sizeof err), -1);
    assert_non_null(strstr(err, "belongs to uid 12345"));
    assert_int_equal(chown(sec, 0, (gid_t)-1), 0);
    assert_int_equal(fi_keys_load_secret(sec, &back, err, sizeof err), 0);
    /* a public key may belong to anyone */
    assert_int_equal(chown(pub, 12345, (gid_t)-1), 0);
    uint8_t p2[FI_KEYS_BYTES];
    assert_int_equal(fi_keys_load_public(pub, p2, err, sizeof err), 0);
}

/* A routing-record writer on log d/name (path gets its path), with the log
 * locked by another connection (*other) by the statement begin. */
static fi_coord_audit *s_writer_locked(const s_dir *d, const char *name, const char *begin,
                                       char *path, size_t plen, sqlite3 **other) {
    char err[256];
    snprintf(path, plen, "%s/%s", d->path, name);
    fi_coord_audit *a = fi_coord_audit_new(path, err, sizeof err);
    assert_non_null(a);
    assert_int_equal(sqlite3_open(path, other), SQLITE_OK);
    assert_int_equal(sqlite3_exec(*other, begin, NULL, NULL, NULL), SQLITE_OK);
    return a;
}

/* Queues n routing records. */
static void s_put_records(fi_coord_audit *a, int n) {
    for (int i = 0; i < n; i++) {
        fi_audit_record r;
        memset(&r, 0, sizeof r);
        char id[16];
        snprintf(id, sizeof id, "req-%d", i);
        r.request_id = id;
        r.origin = "clinic";
        r.decision = "permit";
        r.target = "core1";
        r.time = 1000 + i;
        assert_int_equal(fi_coord_audit_put(a, &r), 0);
    }
}

/* The coordinator's routing records survive a log locked by another
 * process for a while (a `sqlite3` shell, a backup): the writer tries
 * again until it can write, and nothing accepted is lost. */
static void test_routing_records_wait_for_a_lock(void **state) {
    char path[160], err[256];
    sqlite3 *other;
    fi_coord_audit *a = s_writer_locked(*state, "coord.db.audit", "BEGIN IMMEDIATE", path,
                                        sizeof path, &other);
    s_put_records(a, 3);
    /* longer than SQLite's own wait of 5 s: several of the writer's tries fail */
    struct timespec ts = {5, 300 * 1000000L};
    nanosleep(&ts, NULL);
    assert_int_equal(sqlite3_exec(other, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(other);
    fi_coord_audit_flush(a);
    fi_coord_audit_destroy(&a);
    fi_audit *log = fi_audit_open(path, err, sizeof err);
    assert_non_null(log);
    fi_audit_check chk;
    assert_int_equal(fi_audit_verify(log, &chk, err, sizeof err), 0);
    assert_int_equal(chk.records, 3);
    fi_audit_destroy(&log);
}

/* Stopping the writer while the log stays locked gives up after 10 s for
 * all that is queued together (each batch of 1024 had 10 s of its own: a
 * full queue held a stop for minutes). */
static void test_routing_writer_stops_in_time(void **state) {
    char path[160];
    sqlite3 *other;
    fi_coord_audit *a = s_writer_locked(*state, "stop.db.audit", "BEGIN EXCLUSIVE", path,
                                        sizeof path, &other);
    s_put_records(a, 3000);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fi_coord_audit_destroy(&a);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("stop with 3000 records waiting on a locked log: %.1f s\n", took);
    assert_true(took < 14.0);
    sqlite3_exec(other, "ROLLBACK", NULL, NULL, NULL);
    sqlite3_close(other);
}

/* A site's application tokens reach a reconnecting edge all of them, in
 * pages that fit a message, revocations of the newest included (a sync
 * capped at the 4096 oldest left later revocations out: a revoked token
 * kept working at an edge that was offline). */
static void test_token_sync_pages(void **state) {
    s_dir *d = *state;
    char path[160], err[256];
    snprintf(path, sizeof path, "%s/coord.db", d->path);
    fi_apptok *t = fi_apptok_open(path, err, sizeof err);
    assert_non_null(t);
    sqlite3 *db;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "BEGIN", NULL, NULL, NULL), SQLITE_OK);
    enum { N = 4500 };
    for (int i = 0; i < N; i++) {
        char sql[400];
        snprintf(sql, sizeof sql,
                 "INSERT INTO app_tokens(hash, site, tenant, application, created, revoked, author) "
                 "VALUES('%064d', 'clinic', 'a-tenant-name-of-some-length-for-the-size-check-xx', "
                 "'an-application-name-of-some-length-as-well-xxxxxxxxxx', %d, %d, 'op')",
                 i, 1000 + i, i == N - 1 ? 9999 : 0);
        assert_int_equal(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    }
    assert_int_equal(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    long long at = 0;
    size_t len = 0, total = 0;
    int pages = 0, newest_revoked = 0;
    uint8_t *buf;
    while ((buf = fi_apptok_sync_site(t, "clinic", &at, &len))) {
        assert_true(len <= FI_WIRE_MAX_MSG);
        Fi__ErrorCode code;
        fi_msg *m = fi_wire_decode(buf, len, 0, &code, err, sizeof err);
        assert_non_null(m);
        assert_int_equal(m->body_case, FI__ENVELOPE__BODY_APP_TOKEN_SYNC);
        for (size_t i = 0; i < m->app_token_sync->n_tokens; i++) {
            const Fi__AppToken *k = m->app_token_sync->tokens[i];
            if (k->created == 1000 + N - 1) newest_revoked = k->revoked == 9999;
        }
        total += m->app_token_sync->n_tokens;
        pages++;
        fi_wire_free(&m);
        free(buf);
    }
    assert_int_equal(total, N);
    assert_true(pages >= 3);
    assert_true(newest_revoked);
    assert_null(fi_apptok_sync_site(t, "elsewhere", &(long long){0}, &len));
    fi_apptok_destroy(&t);
}

static void test_conf(void **state) {
    s_dir *d = *state;
    s_cfg c;
    char err[512];
    assert_int_equal(s_conf(d->path, "# comment\n\nname = a b  \n", &c, err, sizeof err), 0);
    assert_string_equal(c.name, "a b");
    assert_int_equal(c.n, 5);
    assert_int_equal(s_conf(d->path, "name = x\nn=7\n", &c, err, sizeof err), 0);
    assert_int_equal(c.n, 7);
    assert_int_equal(s_conf(d->path, "name = x\nnmae = 3\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "c.conf:2: unknown key 'nmae' (did you mean 'name'?)"));
    /* a near miss names the key meant; a name far from every key, or too
     * short to tell, does not */
    assert_int_equal(s_conf(d->path, "name = x\nevn = 2\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "unknown key 'evn' (did you mean 'even'?)"));
    assert_int_equal(s_conf(d->path, "name = x\nbatch = 2\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "c.conf:2: unknown key 'batch'"));
    assert_null(strstr(err, "did you mean"));
    assert_int_equal(s_conf(d->path, "name = x\nq = 2\n", &c, err, sizeof err), -1);
    assert_null(strstr(err, "did you mean"));
    assert_int_equal(s_conf(d->path, "name = x\nn = 11\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, ":2:"));
    assert_int_equal(s_conf(d->path, "name = x\nn = 3x\n", &c, err, sizeof err), -1);
    assert_int_equal(s_conf(d->path, "name = x\neven = 6\n", &c, err, sizeof err), 0);
    assert_int_equal(c.even, 6);
    assert_int_equal(s_conf(d->path, "name = x\n\neven = 5\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "c.conf:3: value of 'even' must be a multiple of 2 in [0, 8]"));
    assert_int_equal(s_conf(d->path, "name = x\neven = 10\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "c.conf:2: value of 'even' must be a multiple of 2 in [0, 8]"));
    assert_int_equal(s_conf(d->path, "name = x\nname = y\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "twice"));
    assert_int_equal(s_conf(d->path, "n = 3\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "required key 'name'"));
    assert_int_equal(s_conf(d->path, "name\n", &c, err, sizeof err), -1);
    assert_non_null(strstr(err, ":1: expected"));
    /* a NUL byte is named (what follows it would be dropped unseen), and a
     * long comment is no long line */
    {
        char path[128];
        snprintf(path, sizeof path, "%s/c.conf", d->path);
        FILE *f = fopen(path, "w");
        fwrite("name = x\nn = 3\0garbage\n", 1, 23, f);
        fclose(f);
        assert_int_equal(fi_conf_load(path, s_keys, &c, err, sizeof err), -1);
        assert_non_null(strstr(err, "c.conf:2: NUL byte"));
        char big[3000] = "# ";
        memset(big + 2, 'x', 2000);
        strcpy(big + 2002, "\nname = y\n");
        assert_int_equal(s_conf(d->path, big, &c, err, sizeof err), 0);
        assert_string_equal(c.name, "y");
    }
    assert_int_equal(s_conf(d->path, "name =\n", &c, err, sizeof err), -1);
}

static void test_store(void **state) {
    s_dir *d = *state;
    char db[128], err[512];
    snprintf(db, sizeof db, "%s/state.db", d->path);
    fi_store *st = fi_store_open(db, err, sizeof err);
    assert_non_null(st);
    fi_keypair a, b, c;
    assert_int_equal(fi_keys_generate(&a) | fi_keys_generate(&b) | fi_keys_generate(&c), 0);
    assert_int_equal(fi_store_peer_add(st, a.pub, FI__ROLE__ROLE_OPERATOR, "", "", err, sizeof err), 0);
    assert_int_equal(fi_store_peer_add(st, a.pub, FI__ROLE__ROLE_EDGE, "s", "r", err, sizeof err), -1);
    assert_non_null(strstr(err, "already enrolled"));
    fi_peer_rec rec;
    assert_int_equal(fi_store_peer_get(st, a.pub, &rec), 1);
    assert_int_equal(rec.role, FI__ROLE__ROLE_OPERATOR);
    assert_int_equal(fi_store_peer_get(st, b.pub, &rec), 0);

    /* tokens: right role/site/region, once, before expiry */
    char tok[FI_KEYS_TOKEN_LEN], h[65];
    assert_int_equal(fi_keys_token(tok), 0);
    fi_keys_token_hash(tok, h);
    int64_t now = (int64_t)time(NULL);
    assert_int_equal(fi_store_token_add(st, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", now + 60, err,
                                        sizeof err), 0);
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_CLUSTER, "clinic", "eu", b.pub, now, err,
                                    sizeof err), -1);
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_EDGE, "clinic", "us", b.pub, now, err,
                                    sizeof err), -1);
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", b.pub, now + 61,
                                    err, sizeof err), -1);
    assert_non_null(strstr(err, "expired"));
    assert_int_equal(fi_store_peer_get(st, b.pub, &rec), 0); /* nothing half-done */
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", b.pub, now, err,
                                    sizeof err), 0);
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", c.pub, now, err,
                                    sizeof err), -1);
    assert_non_null(strstr(err, "already used"));
    /* the same key asking again (its answer was lost) is enrolled, as it
     * asked; not for another site */
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", b.pub, now, err,
                                    sizeof err), 0);
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_EDGE, "clinic2", "eu", b.pub, now, err,
                                    sizeof err), -1);
    /* ... but only the key that spent it: c, enrolled with a token of its
     * own for the same site, is refused b's */
    char h2[65];
    fi_keys_token_hash("fit_second-token", h2);
    assert_int_equal(fi_store_token_add(st, h2, FI__ROLE__ROLE_EDGE, "clinic", "eu", now + 60, err,
                                        sizeof err), 0);
    assert_int_equal(fi_store_enrol(st, h2, FI__ROLE__ROLE_EDGE, "clinic", "eu", c.pub, now, err,
                                    sizeof err), 0);
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", c.pub, now, err,
                                    sizeof err), -1);
    assert_non_null(strstr(err, "already used"));
    fi_keys_token_hash("fit_nope", h);
    assert_int_equal(fi_store_enrol(st, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", c.pub, now, err,
                                    sizeof err), -1);
    assert_non_null(strstr(err, "unknown"));
    assert_int_equal(fi_store_peer_get(st, b.pub, &rec), 1);
    assert_string_equal(rec.site, "clinic");
    assert_false(rec.revoked);

    /* revoke */
    char fpr[FI_KEYS_FPR_LEN];
    fi_keys_fingerprint(b.pub, fpr);
    assert_int_equal(fi_store_peer_revoke(st, fpr, &rec), 1);
    assert_true(rec.revoked);
    assert_int_equal(fi_store_peer_revoke(st, "00000000000000000000000000000000", &rec), 0);
    /* opaque carriage for policy/ */
    assert_int_equal(fi_store_bundle_put(st, 1, "b", 1, fpr), 0);
    assert_int_equal(fi_store_audit_put(st, fpr, "x", 1, 1, "a", 1), 0);
    assert_int_equal(fi_store_audit_put(st, fpr, "x", 1, 1, "a", 1), 0); /* resent: kept once */
    assert_int_equal(fi_store_count(st, "audit"), 1);
    assert_int_equal(fi_store_count(st, "sites"), 1);
    assert_int_equal(fi_store_count(st, "nope"), -1);
    fi_store_destroy(&st);
    assert_null(st);
    fi_store_destroy(&st);

    /* everything survives a reopen */
    st = fi_store_open(db, err, sizeof err);
    assert_non_null(st);
    assert_int_equal(fi_store_peer_get(st, b.pub, &rec), 1);
    assert_true(rec.revoked);
    assert_int_equal(fi_store_count(st, "peers"), 3);
    assert_int_equal(fi_store_count(st, "tokens"), 2);
    assert_int_equal(fi_store_count(st, "bundles"), 1);
    fi_store_destroy(&st);
    assert_null(fi_store_open("/nonexistent/dir/x.db", err, sizeof err));
    /* a store made before tokens recorded who spent them gains the column */
    {
        char old[200];
        snprintf(old, sizeof old, "%s/old.db", d->path);
        sqlite3 *o;
        assert_int_equal(sqlite3_open(old, &o), SQLITE_OK);
        assert_int_equal(sqlite3_exec(o, "CREATE TABLE tokens(hash TEXT PRIMARY KEY, role INTEGER "
                                         "NOT NULL, site TEXT NOT NULL, region TEXT NOT NULL, "
                                         "created INTEGER NOT NULL, expires INTEGER NOT NULL, "
                                         "used INTEGER)", NULL, NULL, NULL),
                         SQLITE_OK);
        sqlite3_close(o);
        fi_store *os = fi_store_open(old, err, sizeof err);
        if (!os) fail_msg("%s", err);
        fi_keys_token_hash("fit_old-store", h);
        assert_int_equal(fi_store_token_add(os, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", now + 60,
                                            err, sizeof err), 0);
        assert_int_equal(fi_store_enrol(os, h, FI__ROLE__ROLE_EDGE, "clinic", "eu", b.pub, now,
                                        err, sizeof err), 0);
        fi_store_destroy(&os);
        assert_non_null(os = fi_store_open(old, err, sizeof err)); /* and opens again */
        fi_store_destroy(&os);
    }
    assert_true(fi_store_name_ok("clinic-7.eu_1"));
    assert_false(fi_store_name_ok("a b"));
    assert_false(fi_store_name_ok(""));
}

/* Audit batches of about 1 KB: n of them span n / 3 pages and more. */
static void s_fill_store(const char *db, int n) {
    char err[512], blob[1000], id[32];
    fi_store *st = fi_store_open(db, err, sizeof err);
    if (!st) fail_msg("%s", err);
    memset(blob, 'a', sizeof blob);
    for (int i = 0; i < n; i++) {
        snprintf(id, sizeof id, "batch-%d", i);
        assert_int_equal(fi_store_audit_put(st, "edge-fpr", id, (uint64_t)i * 10 + 1, 10, blob, sizeof blob), 0);
    }
    fi_store_destroy(&st);
}

/* A page damaged in the middle of the coordinator's database (a failing
 * disk, a stray write) is found when it is opened, by the fleet store and
 * by the application tokens (the coordinator's start; the policy store on
 * the same file is test_policy_bundle's), and the refusal names the file
 * and says it is damaged: before, both opened and the damage surfaced
 * when a request reached that page. A new path is still created, an
 * intact file still opens. */
static void test_store_damaged(void **state) {
    s_dir *d = *state;
    char db[128], err[1024];
    struct stat sb;
    snprintf(db, sizeof db, "%s/state.db", d->path);
    assert_int_equal(stat(db, &sb), -1);
    fi_apptok *t = fi_apptok_open(db, err, sizeof err);
    if (!t) fail_msg("new file: %s", err);
    fi_apptok_destroy(&t);
    assert_int_equal(stat(db, &sb), 0);
    s_fill_store(db, 150);
    fi_store *st = fi_store_open(db, err, sizeof err);
    if (!st) fail_msg("intact store: %s", err);
    fi_store_destroy(&st);
    if (!(t = fi_apptok_open(db, err, sizeof err))) fail_msg("intact store, tokens: %s", err);
    fi_apptok_destroy(&t);

    int page = fi_test_db_damage(db, err, sizeof err);
    if (page < 0) fail_msg("%s", err);
    printf("damaged page %d\n", page);
    assert_null(fi_store_open(db, err, sizeof err));
    printf("store: %s\n", err);
    assert_non_null(strstr(err, db));
    assert_non_null(strstr(err, "database is damaged"));
    assert_null(fi_apptok_open(db, err, sizeof err));
    printf("tokens: %s\n", err);
    assert_non_null(strstr(err, db));
    assert_non_null(strstr(err, "database is damaged"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_keys, setup, teardown),
        cmocka_unit_test_setup_teardown(test_key_owner, setup, teardown),
        cmocka_unit_test_setup_teardown(test_routing_records_wait_for_a_lock, setup, teardown),
        cmocka_unit_test_setup_teardown(test_token_sync_pages, setup, teardown),
        cmocka_unit_test_setup_teardown(test_routing_writer_stops_in_time, setup, teardown),
        cmocka_unit_test_setup_teardown(test_conf, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store, setup, teardown),
        cmocka_unit_test_setup_teardown(test_store_damaged, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
