/*
 * test_policy_audit.c - the hash-chained audit log: appends chain, the
 * triggers refuse edits, and verify detects every edited, removed or
 * reordered record made by someone who bypasses the triggers; queries
 * filter; decisions are logged with their rules and the policy digest.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "db_damage.h"
#include "fi_audit.h"

typedef struct fx {
    char path[256]; /* the log's file */
} fx;

static int s_setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    if (!f) return -1;
    snprintf(f->path, sizeof f->path, "/tmp/fi_audit_test_%d_XXXXXX", (int)getpid());
    int fd = mkstemp(f->path);
    if (fd < 0) return -1;
    close(fd);
    unlink(f->path);
    *state = f;
    return 0;
}

static void s_teardown_files(const fx *f) {
    char p[300];
    unlink(f->path);
    snprintf(p, sizeof p, "%s-wal", f->path);
    unlink(p);
    snprintf(p, sizeof p, "%s-shm", f->path);
    unlink(p);
}

static int s_teardown(void **state) {
    fx *f = *state;
    s_teardown_files(f);
    free(f);
    return 0;
}

static void s_fill(const fx *f, int n) {
    char err[300];
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    for (int i = 0; i < n; i++) {
        char id[32];
        snprintf(id, sizeof id, "req-%d", i + 1);
        fi_audit_record r = {0};
        r.time = 1800000000000LL + i * 1000;
        r.request_id = id;
        r.origin = i % 2 ? "berlin-clinic" : "paris-clinic";
        r.labels = i % 3 ? "pii" : "phi,public";
        r.model = "smollm2-135m";
        r.latency_ms = -1;
        r.prompt_tokens = 100 + i;
        r.decision = i % 3 ? "permit" : "deny";
        r.target = i % 3 ? "fra-gpu-1" : "";
        r.rules = i % 3 ? "internal and pii within the EU" : "phi stays on site";
        r.policy_digest = "ab12";
        assert_int_equal(fi_audit_append(a, &r, err, sizeof err), 0);
        assert_true(r.seq == i + 1);
        assert_int_equal(strlen(r.hash), 64);
    }
    fi_audit_destroy(&a);
}

/* Runs SQL on the file directly, as someone who edits it would. */
static int s_sql(const fx *f, const char *sql) {
    sqlite3 *db;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    int rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
    if (rc != SQLITE_OK) fprintf(stderr, "s_sql: %s\n", sqlite3_errmsg(db));
    sqlite3_close(db);
    return rc;
}

static int s_verify(const fx *f, fi_audit_check *ck) {
    char err[300];
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    int r = fi_audit_verify(a, ck, err, sizeof err);
    fi_audit_destroy(&a);
    return r;
}

/* The first record's column col, as stored (malloc'd). */
static int s_first_field(const fx *f, const char *col, char **out) {
    sqlite3 *db;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    char sql[128];
    snprintf(sql, sizeof sql, "SELECT %s FROM audit WHERE seq = 1", col);
    sqlite3_stmt *st = NULL;
    int rc = -1;
    *out = NULL;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW) {
        *out = strdup((const char *)sqlite3_column_text(st, 0));
        rc = 0;
    }
    sqlite3_finalize(st);
    sqlite3_close(db);
    return rc;
}

static const char *UNGUARD = "DROP TRIGGER audit_no_update; DROP TRIGGER audit_no_delete;";

static void test_intact(void **state) {
    fx *f = *state;
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 0); /* empty is intact */
    assert_true(ck.records == 0);
    s_fill(f, 10);
    assert_int_equal(s_verify(f, &ck), 0);
    assert_true(ck.records == 10);
    assert_int_equal(strlen(ck.head), 64);
}

/* Reading a log (fedctl audit verify / query) never creates or changes a
 * file: a missing or mistyped path is refused, as is a database that is
 * not an audit log; a real one verifies and refuses appends. */
static void test_open_readonly(void **state) {
    fx *f = *state;
    char err[600];
    struct stat st;
    assert_null(fi_audit_open_readonly(f->path, err, sizeof err));
    printf("missing: %s\n", err);
    assert_non_null(strstr(err, f->path));
    assert_int_equal(stat(f->path, &st), -1); /* not created */
    assert_int_equal(s_sql(f, "CREATE TABLE other(x);"), SQLITE_OK);
    assert_null(fi_audit_open_readonly(f->path, err, sizeof err));
    printf("other: %s\n", err);
    assert_non_null(strstr(err, "is not an audit log"));
    unlink(f->path);
    s_fill(f, 5);
    assert_int_equal(stat(f->path, &st), 0);
    const time_t mtime = st.st_mtime;
    const off_t size = st.st_size;
    fi_audit *a = fi_audit_open_readonly(f->path, err, sizeof err);
    if (!a) fail_msg("%s", err);
    fi_audit_check ck;
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 0);
    assert_true(ck.records == 5);
    fi_audit_record r = {0};
    r.request_id = "x";
    r.origin = r.labels = r.model = r.decision = r.target = r.rules = r.policy_digest = "";
    assert_int_equal(fi_audit_append(a, &r, err, sizeof err), -1);
    fi_audit_destroy(&a);
    assert_int_equal(stat(f->path, &st), 0);
    assert_true(st.st_mtime == mtime && st.st_size == size);
    /* paths a URI would read otherwise: characters it reserves, a leading
     * "//" (an authority), a relative ":memory:" (no file) */
    fx odd;
    snprintf(odd.path, sizeof odd.path, "%.200s a%%41?b#c:memory:", f->path);
    s_fill(&odd, 2);
    char alt[300];
    snprintf(alt, sizeof alt, "/%.250s", odd.path);
    const char *names[] = {odd.path, alt};
    for (int i = 0; i < 2; i++) {
        a = fi_audit_open_readonly(names[i], err, sizeof err);
        if (!a) fail_msg("%s: %s", names[i], err);
        assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 0);
        assert_true(ck.records == 2);
        fi_audit_destroy(&a);
    }
    char cwd[512];
    assert_non_null(getcwd(cwd, sizeof cwd));
    assert_int_equal(chdir("/tmp"), 0);
    unlink(":memory:");
    snprintf(odd.path, sizeof odd.path, "./:memory:"); /* a file, for the writer too */
    s_fill(&odd, 3);
    a = fi_audit_open_readonly(":memory:", err, sizeof err);
    if (!a) fail_msg("relative :memory:: %s", err);
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 0);
    assert_true(ck.records == 3);
    fi_audit_destroy(&a);
    s_teardown_files(&odd);
    snprintf(odd.path, sizeof odd.path, "%.200s a%%41?b#c:memory:", f->path);
    s_teardown_files(&odd);
    assert_int_equal(chdir(cwd), 0);
}

/* A page damaged in the middle of the file (a failing disk, a stray
 * write) is found when the log is opened, by the writer (an edge, the
 * coordinator) and by the readers (fedctl audit, audit verify), and the
 * refusal names the file and says it is damaged: before, the open
 * succeeded and the damage surfaced only when an append or a query
 * reached that page. */
static void test_damaged_page_refused(void **state) {
    fx *f = *state;
    char err[600];
    struct stat st;
    /* a fresh path is still created, and an intact log still opens */
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    if (!a) fail_msg("new log: %s", err);
    fi_audit_destroy(&a);
    assert_int_equal(stat(f->path, &st), 0);
    if (fi_test_audit_fill(f->path, 2000, err, sizeof err) != 0) fail_msg("%s", err);
    a = fi_audit_open(f->path, err, sizeof err);
    if (!a) fail_msg("intact log: %s", err);
    fi_audit_destroy(&a);
    a = fi_audit_open_readonly(f->path, err, sizeof err);
    if (!a) fail_msg("intact log, read-only: %s", err);
    fi_audit_destroy(&a);

    int page = fi_test_db_damage(f->path, err, sizeof err);
    if (page < 0) fail_msg("%s", err);
    printf("damaged page %d\n", page);
    assert_null(fi_audit_open(f->path, err, sizeof err));
    printf("writer: %s\n", err);
    assert_non_null(strstr(err, f->path));
    assert_non_null(strstr(err, "database is damaged"));
    assert_non_null(strstr(err, "restore it from a backup"));
    assert_null(fi_audit_open_readonly(f->path, err, sizeof err));
    printf("reader: %s\n", err);
    assert_non_null(strstr(err, f->path));
    assert_non_null(strstr(err, "database is damaged"));
}

/* A file that is no database at all (a mistyped path to a text file, a
 * file cut or overwritten from its start) is refused the same way. */
static void test_not_a_database_refused(void **state) {
    fx *f = *state;
    char err[600];
    FILE *out = fopen(f->path, "w");
    assert_non_null(out);
    for (int i = 0; i < 200; i++) fprintf(out, "not an SQLite file, line %d\n", i);
    fclose(out);
    assert_null(fi_audit_open(f->path, err, sizeof err));
    printf("writer: %s\n", err);
    assert_non_null(strstr(err, f->path));
    assert_non_null(strstr(err, "database is damaged"));
    assert_null(fi_audit_open_readonly(f->path, err, sizeof err));
    printf("reader: %s\n", err);
    assert_non_null(strstr(err, f->path));
    assert_non_null(strstr(err, "database is damaged"));
}

static void test_triggers_refuse(void **state) {
    fx *f = *state;
    s_fill(f, 3);
    assert_int_not_equal(s_sql(f, "UPDATE audit SET target='virginia-gpu' WHERE seq=2"), SQLITE_OK);
    assert_int_not_equal(s_sql(f, "DELETE FROM audit WHERE seq=2"), SQLITE_OK);
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 0);
}

static void test_edit_detected(void **state) {
    fx *f = *state;
    s_fill(f, 6);
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(s_sql(f, "UPDATE audit SET target='virginia-gpu' WHERE seq=4"), SQLITE_OK);
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 1);
    assert_true(ck.bad_seq == 4);
    assert_string_equal(ck.what, "record 4 was edited: its content does not match its hash");
}

/* Edits that leave the values the chain hashes as they were read back: a
 * NUL byte hiding the rest of a text (the record no longer matches its
 * request id), a number stored as text or as a real. */
static void test_type_and_nul_edits_detected(void **state) {
    static const struct {
        const char *sql, *what;
    } e[] = {
        {"UPDATE audit SET request_id = request_id || char(0) || 'hidden' WHERE seq=2",
         "record 2 was edited: its request_id is not stored as the log writes it (type or NUL byte)"},
        {"UPDATE audit SET time = CAST(time AS TEXT) || ' tampered' WHERE seq=2",
         "record 2 was edited: its time is not stored as the log writes it (type or NUL byte)"},
        {"UPDATE audit SET prompt_tokens = -1.75 WHERE seq=3",
         "record 3 was edited: its prompt_tokens is not stored as the log writes it (type or NUL byte)"},
    };
    fx *f = *state;
    for (size_t i = 0; i < sizeof e / sizeof e[0]; i++) {
        unlink(f->path);
        s_fill(f, 4);
        assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
        assert_int_equal(s_sql(f, e[i].sql), SQLITE_OK);
        fi_audit_check ck;
        assert_int_equal(s_verify(f, &ck), 1);
        assert_string_equal(ck.what, e[i].what);
    }
}

/* A record's texts are stored as valid UTF-8 (a rule name cut inside a
 * character, a client's bytes): they travel as JSON to the coordinator,
 * and one that could not would stall every upload after it. */
static void test_texts_valid_utf8(void **state) {
    fx *f = *state;
    char err[300];
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    fi_audit_record r = {0};
    r.time = 1800000000000LL;
    r.request_id = "req-\xff";
    r.tenant = "onkologie-\xe4";
    r.rules = "a,b,c\xc3"; /* cut inside "\xc3\xa9" */
    r.decision = "permit";
    r.target = "caf\xc3\xa9";
    assert_int_equal(fi_audit_append(a, &r, err, sizeof err), 0);
    fi_audit_destroy(&a);
    char *got = NULL;
    assert_int_equal(s_first_field(f, "rules", &got), 0);
    assert_string_equal(got, "a,b,c?");
    free(got);
    assert_int_equal(s_first_field(f, "tenant", &got), 0);
    assert_string_equal(got, "onkologie-?");
    free(got);
    assert_int_equal(s_first_field(f, "target", &got), 0);
    assert_string_equal(got, "caf\xc3\xa9"); /* valid text is kept */
    free(got);
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 0);
}

static void test_edit_with_rehash_detected(void **state) {
    fx *f = *state;
    s_fill(f, 6);
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    /* the editor also replaces the hash with another record's: the next link breaks */
    assert_int_equal(s_sql(f, "UPDATE audit SET hash=(SELECT hash FROM audit WHERE seq=1) WHERE seq=3"), SQLITE_OK);
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 1);
    assert_true(ck.bad_seq == 3);
}

static void test_remove_detected(void **state) {
    fx *f = *state;
    s_fill(f, 6);
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(s_sql(f, "DELETE FROM audit WHERE seq=3"), SQLITE_OK);
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 1);
    assert_true(ck.bad_seq == 3);
    assert_string_equal(ck.what, "record 3 is missing (removed): the next one is 4");
}

static void test_remove_and_renumber_detected(void **state) {
    fx *f = *state;
    s_fill(f, 6);
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(s_sql(f, "DELETE FROM audit WHERE seq=3; UPDATE audit SET seq=seq-1 WHERE seq>3"), SQLITE_OK);
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 1);
    assert_true(ck.bad_seq == 3);
    assert_non_null(strstr(ck.what, "does not link"));
}

static void test_reorder_detected(void **state) {
    fx *f = *state;
    s_fill(f, 6);
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(
        s_sql(f, "UPDATE audit SET seq=-2 WHERE seq=2; UPDATE audit SET seq=2 WHERE seq=5; UPDATE audit SET seq=5 WHERE seq=-2"),
        SQLITE_OK);
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 1);
    assert_true(ck.bad_seq == 2);
}

static void test_truncation_changes_head(void **state) {
    fx *f = *state;
    s_fill(f, 5);
    fi_audit_check before, after;
    assert_int_equal(s_verify(f, &before), 0);
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(s_sql(f, "DELETE FROM audit WHERE seq=5"), SQLITE_OK);
    /* a shorter chain is still a chain; its head differs from the one kept elsewhere */
    assert_int_equal(s_verify(f, &after), 0);
    assert_true(after.records == 4);
    assert_string_not_equal(before.head, after.head);
}

typedef struct collect {
    int n;
    char ids[32][32];
} collect;

static int s_collect(const fi_audit_record *r, void *arg) {
    collect *c = arg;
    if (c->n < 32) snprintf(c->ids[c->n++], 32, "%s", r->request_id);
    return 0;
}

static void test_query(void **state) {
    fx *f = *state;
    s_fill(f, 9);
    char err[300];
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    fi_audit_filter flt = {0};
    collect c = {0};
    flt.label = "phi";
    assert_int_equal(fi_audit_query(a, &flt, s_collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 3); /* 1, 4, 7 */
    assert_string_equal(c.ids[0], "req-1");
    assert_string_equal(c.ids[2], "req-7");
    memset(&c, 0, sizeof c);
    memset(&flt, 0, sizeof flt);
    flt.origin = "berlin-clinic";
    flt.decision = "permit";
    assert_int_equal(fi_audit_query(a, &flt, s_collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 3); /* 2, 6, 8 */
    memset(&c, 0, sizeof c);
    memset(&flt, 0, sizeof flt);
    flt.since_ms = 1800000000000LL + 2000;
    flt.until_ms = 1800000000000LL + 5000;
    assert_int_equal(fi_audit_query(a, &flt, s_collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 3); /* 3, 4, 5 */
    memset(&c, 0, sizeof c);
    memset(&flt, 0, sizeof flt);
    flt.limit = 2;
    assert_int_equal(fi_audit_query(a, &flt, s_collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 2);
    assert_string_equal(c.ids[0], "req-8");
    assert_string_equal(c.ids[1], "req-9");
    memset(&c, 0, sizeof c);
    memset(&flt, 0, sizeof flt);
    flt.rule = "phi stays on site";
    flt.label = "p_i"; /* whole labels only, no LIKE wildcards */
    assert_int_equal(fi_audit_query(a, &flt, s_collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 0);
    flt.label = "ph";
    assert_int_equal(fi_audit_query(a, &flt, s_collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 0);
    flt.label = "phi";
    assert_int_equal(fi_audit_query(a, &flt, s_collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 3);
    fi_audit_destroy(&a);
}

static void test_log_decision(void **state) {
    fx *f = *state;
    const char *text = "labels public, phi;\njurisdiction EU;\nregion r in EU;\nsite s1 in r;\nsite s2 in r;\n"
                       "cluster c in r { cost = 1; }\n"
                       "permit \"all\";\nforbid \"phi on site\" when \"phi\" in request.labels and target.site != request.origin.site;\n"
                       "prefer \"cheap\" score 3 when target has cost and target.cost < 2;\n";
    fi_policy *p = fi_policy_parse(text, strlen(text), NULL);
    assert_non_null(p);
    char err[300];
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    const char *pub[] = {"public"}, *phi[] = {"phi"};
    fi_request r1 = {"r1", NULL, NULL, "s1", "m", pub, 1, -1, 7};
    fi_request r2 = {"r2", NULL, NULL, "s1", NULL, phi, 1, -1, -1};
    fi_verdict v[3];
    assert_int_equal(fi_policy_decide(p, &r1, NULL, 3, v), 0);
    assert_int_equal(fi_audit_log_decision(a, p, &r1, v, 3, NULL, 1000, err, sizeof err), 0);
    uint32_t only_remote[2] = {(uint32_t)fi_policy_target_find(p, "s2"), (uint32_t)fi_policy_target_find(p, "c")};
    assert_int_equal(fi_policy_decide(p, &r2, only_remote, 2, v), 0);
    assert_int_equal(fi_audit_log_decision(a, p, &r2, v, 2, NULL, 2000, err, sizeof err), 0);
    const char *names[] = {"c", "s1"};
    fi_target_kind kinds[] = {FI_TARGET_CLUSTER, FI_TARGET_SITE};
    fi_policy_fallback("s1", names, kinds, 2, v);
    assert_int_equal(fi_audit_log_decision(a, NULL, &r2, v, 2, names, 3000, err, sizeof err), 0);
    /* fi_policy_decide_names: v[].target indexes the caller's names, which
     * are in another order than the policy's targets */
    const char *names2[] = {"s2", "s1"};
    fi_target_kind kinds2[] = {FI_TARGET_SITE, FI_TARGET_SITE};
    fi_policy_decide_names(p, 0, &r2, names2, kinds2, 2, v);
    assert_int_equal(fi_audit_log_decision(a, p, &r2, v, 2, names2, 4000, err, sizeof err), 0);
    fi_audit_destroy(&a);
    sqlite3 *db;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    sqlite3_stmt *st;
    assert_int_equal(sqlite3_prepare_v2(db, "SELECT decision, target, rules, labels, prompt_tokens, policy_digest FROM audit ORDER BY seq",
                                        -1, &st, NULL),
                     SQLITE_OK);
    char digest[65];
    fi_policy_digest_hex(p, digest);
    const char *want[4][6] = {{"permit", "c", "all,cheap", "public", "7", digest},
                              {"deny", "", "phi on site", "phi", "-1", digest},
                              {"fallback", "s1", "", "phi", "-1", ""},
                              {"permit", "s1", "all", "phi", "-1", digest}};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(sqlite3_step(st), SQLITE_ROW);
        for (int k = 0; k < 6; k++) assert_string_equal((const char *)sqlite3_column_text(st, k), want[i][k]);
    }
    sqlite3_finalize(st);
    sqlite3_close(db);
    fi_audit_check ck;
    assert_int_equal(s_verify(f, &ck), 0);
    assert_true(ck.records == 4);
    fi_policy_destroy(&p);
}


/* --- provenance ----------------------------------------------------------- */

/* n records of a source's own log from seq first on, chained to prev ("":
 * genesis), as the source computes them. */
static void s_src_records(fi_audit_record *r, int64_t first, size_t n, const char *prev, const char *site) {
    for (size_t i = 0; i < n; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].seq = first + (int64_t)i;
        r[i].time = 1800000000000LL + r[i].seq;
        r[i].request_id = "q";
        r[i].origin = site;
        r[i].labels = "public";
        r[i].latency_ms = -1;
        r[i].prompt_tokens = -1;
        r[i].decision = "permit";
        r[i].target = site;
        fi_audit_chain_hash(i ? r[i - 1].hash : prev, &r[i], r[i].hash);
    }
}

/* A record as read back, its strings copied. */
typedef struct s_got {
    int64_t seq, source_seq, received;
    char source[64], source_hash[65], hash[65];
} s_got;

typedef struct s_gots {
    int n;
    s_got v[16];
} s_gots;

static int s_get(const fi_audit_record *r, void *arg) {
    s_gots *g = arg;
    if (g->n < 16) {
        s_got *x = &g->v[g->n++];
        x->seq = r->seq;
        x->source_seq = r->source_seq;
        x->received = r->received;
        snprintf(x->source, sizeof x->source, "%s", r->source);
        snprintf(x->source_hash, sizeof x->source_hash, "%s", r->source_hash);
        snprintf(x->hash, sizeof x->hash, "%s", r->hash);
    }
    return 0;
}

static void s_ingest(fi_audit *a, const char *source, const fi_audit_record *r, size_t n, size_t want_taken) {
    char err[300];
    size_t taken = 99;
    if (fi_audit_ingest(a, source, "s1", r, n, &taken, err, sizeof err) != 0) fail_msg("ingest %s: %s", source, err);
    assert_int_equal(taken, want_taken);
}

static int64_t s_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* (a) An ingested record keeps where it came from: the source, its number
 * and hash in the source's log, and when it was taken; provenance the
 * records themselves carry is not believed. The log's own records have
 * none. */
static void test_ingest_keeps_provenance(void **state) {
    fx *f = *state;
    char err[300];
    s_fill(f, 1); /* one record of the log's own */
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    fi_audit_record r[3];
    s_src_records(r, 1, 3, "", "s1");
    for (int i = 0; i < 3; i++) { /* what an uploader might claim */
        r[i].source = "someone-else";
        r[i].source_seq = 42;
        snprintf(r[i].source_hash, sizeof r[i].source_hash, "%064d", 7);
        r[i].received = 5;
    }
    int64_t t0 = s_now_ms();
    s_ingest(a, "edge-a", r, 3, 3);
    int64_t t1 = s_now_ms();
    s_gots g = {0};
    assert_int_equal(fi_audit_query(a, NULL, s_get, &g, err, sizeof err), 0);
    assert_int_equal(g.n, 4);
    assert_string_equal(g.v[0].source, "");
    assert_true(g.v[0].source_seq == 0 && g.v[0].received == 0 && g.v[0].source_hash[0] == 0);
    for (int i = 0; i < 3; i++) {
        const s_got *x = &g.v[i + 1];
        assert_true(x->seq == i + 2);
        assert_string_equal(x->source, "edge-a");
        assert_true(x->source_seq == i + 1);
        assert_string_equal(x->source_hash, r[i].hash);
        assert_string_not_equal(x->hash, r[i].hash); /* the log's own chain */
        assert_true(x->received >= t0 && x->received <= t1);
    }
    fi_audit_check ck;
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 0);
    assert_true(ck.records == 4);
    fi_audit_destroy(&a);
}

/* (b) Provenance edited in the file, or stripped, breaks the record's
 * hash; verify names the record. */
static void test_provenance_edit_detected(void **state) {
    static const struct {
        const char *sql;
        int64_t bad;
    } e[] = {
        {"UPDATE audit SET source_hash = (SELECT source_hash FROM audit WHERE seq = 2) WHERE seq = 3", 3},
        {"UPDATE audit SET source = 'edge-b' WHERE seq = 2", 2},
        {"UPDATE audit SET source_seq = 7 WHERE seq = 4", 4},
        {"UPDATE audit SET received = received + 1 WHERE seq = 2", 2},
        {"UPDATE audit SET source = '', source_seq = 0, source_hash = '', received = 0 WHERE seq = 3", 3},
        {"UPDATE audit SET source = '' WHERE seq = 3", 3},
    };
    fx *f = *state;
    char err[300];
    fi_audit_record r[4];
    s_src_records(r, 1, 4, "", "s1");
    for (size_t i = 0; i < sizeof e / sizeof e[0]; i++) {
        s_teardown_files(f);
        fi_audit *a = fi_audit_open(f->path, err, sizeof err);
        assert_non_null(a);
        s_ingest(a, "edge-a", r, 4, 4);
        fi_audit_destroy(&a);
        assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
        assert_int_equal(s_sql(f, e[i].sql), SQLITE_OK);
        fi_audit_check ck;
        assert_int_equal(s_verify(f, &ck), 1);
        printf("%s\n  -> %s\n", e[i].sql, ck.what);
        assert_true(ck.bad_seq == e[i].bad);
        char want[32];
        snprintf(want, sizeof want, "record %lld ", (long long)e[i].bad);
        assert_non_null(strstr(ck.what, want));
    }
}

/* A record whose log hash was written over a wrong source chain (the log's
 * own chain intact: fi_audit_append takes provenance as given) is caught
 * by the per-source check: a source hash that is not the source's, a run
 * that skips a record, one that starts in the middle. */
static void test_source_run_checked(void **state) {
    fx *f = *state;
    char err[300];
    fi_audit_record r[4];
    s_src_records(r, 1, 4, "", "s1");
    for (int variant = 0; variant < 3; variant++) {
        s_teardown_files(f);
        fi_audit *a = fi_audit_open(f->path, err, sizeof err);
        assert_non_null(a);
        for (int i = 0; i < 4; i++) {
            if (variant == 1 && i == 2) continue; /* its record 3 left out */
            if (variant == 2 && i == 0) continue; /* its record 1 left out */
            fi_audit_record c = r[i];
            c.source = "edge-a";
            c.source_seq = r[i].seq;
            memcpy(c.source_hash, r[i].hash, sizeof c.source_hash);
            if (variant == 0 && i == 2) memcpy(c.source_hash, r[1].hash, sizeof c.source_hash);
            c.received = 1;
            assert_int_equal(fi_audit_append(a, &c, err, sizeof err), 0);
        }
        fi_audit_check ck;
        assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 1);
        printf("variant %d: %s\n", variant, ck.what);
        assert_non_null(strstr(ck.what, "source edge-a"));
        static const char *const want[] = {"record 3 (source edge-a, its record 3) does not match its source hash",
                                           "record 3 (source edge-a, its record 4) does not follow the source's record 2",
                                           "record 1 (source edge-a) starts the source's run at its record 2"};
        assert_non_null(strstr(ck.what, want[variant]));
        fi_audit_destroy(&a);
    }
}

/* (c) The head held per source must be its last record here: records cut
 * off the end of the log leave their source's head pointing past its run;
 * an edited or removed head is found too. Cutting the end together with
 * the heads is still not found without a checkpoint kept elsewhere. */
static void test_heads_checked(void **state) {
    static const struct {
        const char *sql, *what;
    } e[] = {
        {"DELETE FROM audit WHERE seq = 7",
         "source edge-b's head is its record 2, but its last record here is its record 1: records cut from the end "
         "of its run"},
        {"DELETE FROM audit WHERE seq >= 6",
         "source edge-b's head (its record 2) matches no record of it here: records cut from the end of its run"},
        {"UPDATE audit_sources SET seq = 6 WHERE source = 'edge-a'",
         "source edge-a's head is its record 6, but its last record here is its record 5"},
        {"UPDATE audit_sources SET hash = (SELECT source_hash FROM audit WHERE seq = 4) WHERE source = 'edge-a'",
         "source edge-a's head (its record 5) does not match its last record here (its record 5)"},
        {"DELETE FROM audit_sources WHERE source = 'edge-a'",
         "source edge-a has records here (the last its record 5) but no head in audit_sources"},
    };
    fx *f = *state;
    char err[300];
    fi_audit_record ra[5], rb[2];
    s_src_records(ra, 1, 5, "", "s1");
    s_src_records(rb, 1, 2, "", "s1");
    for (size_t i = 0; i <= sizeof e / sizeof e[0]; i++) {
        s_teardown_files(f);
        fi_audit *a = fi_audit_open(f->path, err, sizeof err);
        assert_non_null(a);
        s_ingest(a, "edge-a", ra, 5, 5); /* log records 1..5 */
        s_ingest(a, "edge-b", rb, 2, 2); /* 6..7 */
        fi_audit_destroy(&a);
        fi_audit_check ck;
        assert_int_equal(s_verify(f, &ck), 0);
        assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
        if (i == sizeof e / sizeof e[0]) {
            /* the end cut and its source's head moved back with it: a
             * shorter, consistent log (a checkpoint kept elsewhere finds it) */
            assert_int_equal(s_sql(f, "DELETE FROM audit WHERE seq = 7;"
                                      "UPDATE audit_sources SET seq = 1, hash = (SELECT source_hash FROM audit"
                                      " WHERE seq = 6) WHERE source = 'edge-b'"),
                             SQLITE_OK);
            assert_int_equal(s_verify(f, &ck), 0);
            assert_true(ck.records == 6);
            break;
        }
        assert_int_equal(s_sql(f, e[i].sql), SQLITE_OK);
        assert_int_equal(s_verify(f, &ck), 1);
        printf("%s\n  -> %s\n", e[i].sql, ck.what);
        if (!strstr(ck.what, e[i].what)) fail_msg("got: %s\nwant: %s", ck.what, e[i].what);
    }
}

/* (d) Witnesses close the hole test_heads_checked leaves: an edge told
 * the head (fi_audit_head) reports it back, the log keeps it, and verify
 * then finds the end cut with its heads, and a rewritten tail; a log that
 * only grew since passes. A lower report does not replace a higher one;
 * malformed reports are refused whole. */
static void test_witnesses(void **state) {
    fx *f = *state;
    char err[300];
    fi_audit_record ra[5], rb[2];
    s_src_records(ra, 1, 5, "", "s1");
    s_src_records(rb, 1, 2, "", "s1");
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    int64_t seq = -1;
    char head[65] = "x";
    assert_int_equal(fi_audit_head(a, &seq, head, err, sizeof err), 0);
    assert_true(seq == 0 && head[0] == 0); /* empty */
    s_ingest(a, "edge-a", ra, 5, 5);        /* log records 1..5 */
    s_ingest(a, "edge-b", rb, 2, 2);        /* 6..7 */
    assert_int_equal(fi_audit_head(a, &seq, head, err, sizeof err), 0);
    assert_true(seq == 7);
    fi_audit_check ck;
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 0);
    assert_string_equal(ck.head, head);
    assert_true(ck.witnesses == 0);

    /* the edge was told record 7; a second edge record 6, then a lower
     * report of its own (it lost its state) that must not replace it */
    fi_audit_witness w[3] = {{.who = "fpr-edge-1", .site = "berlin", .seq = 7, .reported = 1764567000000},
                             {.who = "fpr-edge-2", .site = "", .seq = 6, .reported = 1764567000000},
                             {.who = "fpr-edge-2", .site = "", .seq = 2, .reported = 1764567001000}};
    memcpy(w[0].hash, head, 65);
    int64_t s6;
    char h6[65];
    {
        sqlite3 *db;
        sqlite3_stmt *st;
        assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
        assert_int_equal(sqlite3_prepare_v2(db, "SELECT seq, hash FROM audit WHERE seq IN (2, 6) ORDER BY seq", -1,
                                            &st, NULL),
                         SQLITE_OK);
        assert_int_equal(sqlite3_step(st), SQLITE_ROW);
        snprintf(w[2].hash, 65, "%s", (const char *)sqlite3_column_text(st, 1));
        assert_int_equal(sqlite3_step(st), SQLITE_ROW);
        s6 = sqlite3_column_int64(st, 0);
        snprintf(h6, sizeof h6, "%s", (const char *)sqlite3_column_text(st, 1));
        sqlite3_finalize(st);
        sqlite3_close(db);
    }
    assert_true(s6 == 6);
    memcpy(w[1].hash, h6, 65);
    for (int i = 0; i < 3; i++) assert_int_equal(fi_audit_witness_check(a, &w[i], err, sizeof err), 0);
    assert_int_equal(fi_audit_witness_put(a, w, 3, err, sizeof err), 0);
    {
        sqlite3 *db;
        sqlite3_stmt *st;
        assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
        assert_int_equal(sqlite3_prepare_v2(db, "SELECT seq, reported FROM audit_witnesses WHERE who = 'fpr-edge-2'",
                                            -1, &st, NULL),
                         SQLITE_OK);
        assert_int_equal(sqlite3_step(st), SQLITE_ROW);
        assert_true(sqlite3_column_int64(st, 0) == 6); /* the lower report did not replace it */
        assert_true(sqlite3_column_int64(st, 1) == 1764567000000);
        sqlite3_finalize(st);
        sqlite3_close(db);
    }

    /* refused whole: no name, record 0, a short or upper-case hash */
    fi_audit_witness bad = w[0];
    bad.who = "";
    assert_int_equal(fi_audit_witness_put(a, &bad, 1, err, sizeof err), 1);
    assert_non_null(strstr(err, "witness report 0"));
    bad = w[0];
    bad.seq = 0;
    assert_int_equal(fi_audit_witness_check(a, &bad, err, sizeof err), 1);
    bad = w[0];
    bad.hash[63] = 0;
    assert_false(fi_audit_head_valid(bad.seq, bad.hash));
    bad = w[0];
    bad.hash[0] = 'A';
    fi_audit_witness two[2] = {w[0], bad};
    two[0].seq = 1; /* would lower edge-1's, were the call taken */
    assert_int_equal(fi_audit_witness_put(a, two, 2, err, sizeof err), 1);
    assert_non_null(strstr(err, "witness report 1"));
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 0);
    assert_true(ck.witnesses == 2);
    fi_audit_destroy(&a);

    /* the log grows: every witness still holds */
    fi_audit_record rc[1];
    s_src_records(rc, 1, 1, "", "s1");
    a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    s_ingest(a, "edge-c", rc, 1, 1); /* 8 */
    fi_audit_destroy(&a);
    assert_int_equal(s_verify(f, &ck), 0);
    assert_true(ck.records == 8 && ck.witnesses == 2);

    /* the cut test_heads_checked cannot see: records 7 and 8 gone with
     * their sources' heads moved back (and edge-c's removed) */
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(s_sql(f, "DELETE FROM audit WHERE seq >= 7; DELETE FROM audit_sources WHERE source = 'edge-c';"
                              "UPDATE audit_sources SET seq = 1, hash = (SELECT source_hash FROM audit"
                              " WHERE seq = 6) WHERE source = 'edge-b'"),
                     SQLITE_OK);
    assert_int_equal(s_verify(f, &ck), 1);
    printf("%s\n", ck.what);
    assert_true(ck.bad_seq == 7);
    assert_non_null(strstr(ck.what, "witness fpr-edge-1 (site berlin) was told record 7"));
    assert_non_null(strstr(ck.what, "the log ends at record 6: records were cut off the end"));
    assert_non_null(strstr(ck.what, "reported 2025-12-01T05:30:00Z"));
    /* the log grows past the cut again (other records 7 and 8) and the
     * witness reports record 8, which holds: its failing report stays */
    fi_audit_record rd[2];
    s_src_records(rd, 1, 2, "", "s1");
    a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    s_ingest(a, "edge-d", rd, 2, 2); /* 7, 8 */
    fi_audit_witness w8 = w[0];
    assert_int_equal(fi_audit_head(a, &w8.seq, w8.hash, err, sizeof err), 0);
    assert_true(w8.seq == 8);
    assert_int_equal(fi_audit_witness_check(a, &w8, err, sizeof err), 0);
    assert_int_equal(fi_audit_witness_put(a, &w8, 1, err, sizeof err), 0);
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 1);
    printf("%s\n", ck.what);
    assert_non_null(strstr(ck.what, "witness fpr-edge-1 (site berlin) was told record 7 with hash"));
    assert_non_null(strstr(ck.what, "the log was rewritten from there on"));
    fi_audit_destroy(&a);
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(s_sql(f, "DELETE FROM audit WHERE seq >= 7; DELETE FROM audit_sources WHERE source = 'edge-d'"),
                     SQLITE_OK);
    /* ... and without that witness's row, the other one still holds and
     * the cut goes unseen, as before: it is the edge's report that counts */
    assert_int_equal(s_sql(f, "DELETE FROM audit_witnesses WHERE who = 'fpr-edge-1'"), SQLITE_OK);
    assert_int_equal(s_verify(f, &ck), 0);
    assert_true(ck.witnesses == 1);
    a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    assert_int_equal(fi_audit_witness_check(a, &w[0], err, sizeof err), 1);
    assert_non_null(strstr(err, "records were cut off the end"));
    assert_int_equal(fi_audit_witness_put(a, w, 1, err, sizeof err), 0); /* it reports again */
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 1);

    /* rewritten from record 6 on: same length, another hash (the
     * triggers are back: fi_audit_open makes them) */
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(s_sql(f, "DELETE FROM audit_witnesses WHERE who = 'fpr-edge-1';"
                              "UPDATE audit SET hash = (CASE WHEN substr(hash, 1, 1) = '0' THEN '1' ELSE '0' END) ||"
                              " substr(hash, 2) WHERE seq = 6"),
                     SQLITE_OK);
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 1); /* the chain itself finds this one */
    assert_int_equal(fi_audit_witness_check(a, &w[1], err, sizeof err), 1);
    printf("%s\n", err);
    assert_non_null(strstr(err, "witness fpr-edge-2 was told record 6 with hash"));
    assert_non_null(strstr(err, "the log was rewritten from there on"));
    fi_audit_destroy(&a);

    /* a read-only handle checks witnesses but keeps none */
    a = fi_audit_open_readonly(f->path, err, sizeof err);
    assert_non_null(a);
    assert_int_equal(fi_audit_witness_put(a, w, 1, err, sizeof err), -1);
    fi_audit_destroy(&a);
}

/* The schema of a log made before provenance, as policy_audit.c wrote it. */
static const char *OLD_SCHEMA =
    "PRAGMA journal_mode=WAL;"
    "CREATE TABLE audit(seq INTEGER PRIMARY KEY, time INTEGER NOT NULL,"
    " request_id TEXT NOT NULL, tenant TEXT NOT NULL, application TEXT NOT NULL,"
    " origin TEXT NOT NULL, labels TEXT NOT NULL, model TEXT NOT NULL,"
    " latency_ms INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,"
    " decision TEXT NOT NULL, target TEXT NOT NULL, rules TEXT NOT NULL, policy_digest TEXT NOT NULL,"
    " prev_hash TEXT NOT NULL, hash TEXT NOT NULL);"
    "CREATE INDEX audit_time ON audit(time);"
    "CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit"
    " BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;"
    "CREATE TRIGGER audit_no_delete BEFORE DELETE ON audit"
    " BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;"
    "CREATE TABLE audit_sources(source TEXT PRIMARY KEY, seq INTEGER NOT NULL, hash TEXT NOT NULL);";

/* An old coordinator's log, written with raw SQL and the old chain rule:
 * one record of its own, then edge-a's records 1..3 (without provenance)
 * and edge-a's head 3. */
static void s_old_log(const fx *f, const fi_audit_record *ra) {
    sqlite3 *db;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, OLD_SCHEMA, NULL, NULL, NULL), SQLITE_OK);
    sqlite3_stmt *st;
    assert_int_equal(sqlite3_prepare_v2(db, "INSERT INTO audit VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", -1, &st,
                                        NULL),
                     SQLITE_OK);
    char prev[65] = "";
    for (int i = 0; i < 4; i++) {
        fi_audit_record c;
        if (i == 0) {
            memset(&c, 0, sizeof c);
            c.time = 1700000000000LL;
            c.request_id = "own";
            c.origin = c.labels = c.model = c.tenant = c.application = "";
            c.decision = "deny";
            c.target = c.rules = c.policy_digest = "";
            c.latency_ms = c.prompt_tokens = -1;
        } else {
            c = ra[i - 1];
            c.tenant = c.application = c.model = c.rules = c.policy_digest = "";
        }
        c.seq = i + 1;
        fi_audit_chain_hash(prev, &c, c.hash);
        sqlite3_bind_int64(st, 1, c.seq);
        sqlite3_bind_int64(st, 2, c.time);
        const char *t[] = {c.request_id, c.tenant, c.application, c.origin, c.labels, c.model};
        for (int k = 0; k < 6; k++) sqlite3_bind_text(st, 3 + k, t[k], -1, SQLITE_TRANSIENT);
        sqlite3_bind_int64(st, 9, c.latency_ms);
        sqlite3_bind_int64(st, 10, c.prompt_tokens);
        const char *u[] = {c.decision, c.target, c.rules, c.policy_digest, prev, c.hash};
        for (int k = 0; k < 6; k++) sqlite3_bind_text(st, 11 + k, u[k], -1, SQLITE_TRANSIENT);
        assert_int_equal(sqlite3_step(st), SQLITE_DONE);
        sqlite3_reset(st);
        memcpy(prev, c.hash, sizeof prev);
    }
    sqlite3_finalize(st);
    char sql[300];
    snprintf(sql, sizeof sql, "INSERT INTO audit_sources VALUES('edge-a', 3, '%s')", ra[2].hash);
    assert_int_equal(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
}

/* (d) A log made before provenance verifies read-only without a change to
 * the file; fi_audit_open adds the columns; it verifies, edge-a goes on
 * from the head held before (with provenance now), a new source starts,
 * and it verifies again, also read-only. */
static void test_old_log_upgraded(void **state) {
    fx *f = *state;
    char err[300];
    fi_audit_record ra[5], rb[2];
    s_src_records(ra, 1, 5, "", "s1");
    for (int i = 0; i < 5; i++) ra[i].tenant = ra[i].application = ra[i].model = ra[i].rules = ra[i].policy_digest = "";
    s_src_records(rb, 1, 2, "", "s1");
    s_old_log(f, ra);
    struct stat st0, st1;
    assert_int_equal(stat(f->path, &st0), 0);
    fi_audit *a = fi_audit_open_readonly(f->path, err, sizeof err);
    if (!a) fail_msg("old log, read-only: %s", err);
    fi_audit_check ck;
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) fail_msg("old log, read-only: %s %s", err, ck.what);
    assert_true(ck.records == 4);
    s_gots g = {0};
    assert_int_equal(fi_audit_query(a, NULL, s_get, &g, err, sizeof err), 0);
    assert_int_equal(g.n, 4);
    assert_string_equal(g.v[3].source, "");
    fi_audit_destroy(&a);
    assert_int_equal(stat(f->path, &st1), 0);
    assert_true(st0.st_size == st1.st_size && st0.st_mtime == st1.st_mtime);
    char *got = NULL;
    assert_int_not_equal(s_first_field(f, "source", &got), 0); /* no column added */
    free(got);

    a = fi_audit_open(f->path, err, sizeof err);
    if (!a) fail_msg("old log: %s", err);
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) fail_msg("upgraded: %s %s", err, ck.what);
    assert_true(ck.records == 4);
    s_ingest(a, "edge-a", ra + 2, 3, 2); /* 3 again, 4 and 5 new */
    s_ingest(a, "edge-b", rb, 2, 2);
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) fail_msg("upgraded, ingested: %s", ck.what);
    assert_true(ck.records == 8);
    memset(&g, 0, sizeof g);
    assert_int_equal(fi_audit_query(a, NULL, s_get, &g, err, sizeof err), 0);
    assert_string_equal(g.v[3].source, "");
    assert_string_equal(g.v[4].source, "edge-a");
    assert_true(g.v[4].source_seq == 4);
    assert_string_equal(g.v[4].source_hash, ra[3].hash);
    assert_string_equal(g.v[7].source, "edge-b");
    fi_audit_destroy(&a);
    a = fi_audit_open(f->path, err, sizeof err); /* opened again: nothing to add */
    assert_non_null(a);
    fi_audit_destroy(&a);
    a = fi_audit_open_readonly(f->path, err, sizeof err);
    assert_non_null(a);
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) fail_msg("upgraded, read-only: %s", ck.what);
    assert_true(ck.records == 8);
    fi_audit_destroy(&a);
    /* the first record with provenance must still follow the old head */
    assert_int_equal(s_sql(f, "DROP TRIGGER audit_legacy_no_update;"
                              "UPDATE audit_sources_legacy SET seq = 2 WHERE source = 'edge-a'"),
                     SQLITE_OK);
    assert_int_equal(s_verify(f, &ck), 1);
    printf("legacy head edited: %s\n", ck.what);
    assert_true(ck.bad_seq == 5);
}

static int s_may_adopt(void *user, const char *old_source, const char *origin) {
    (void)user;
    return !strcmp(old_source, "edge-a") && !strcmp(origin, "s1");
}

/* (e) A replaced key goes on with the old key's log: verify follows the
 * run across the two sources, also when the new key took the head over
 * with nothing new; a run that claims to go on from a record it is not
 * linked to is found. */
static void test_adoption_verified(void **state) {
    fx *f = *state;
    char err[300];
    fi_audit_record r[8];
    s_src_records(r, 1, 8, "", "s1");
    fi_audit *a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    fi_audit_set_adopt_check(a, s_may_adopt, NULL);
    s_ingest(a, "edge-a", r, 3, 3);
    s_ingest(a, "edge-a2", r + 3, 2, 2); /* takes edge-a's log over at 4 */
    fi_audit_check ck;
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) fail_msg("adopted: %s", ck.what);
    fi_audit_destroy(&a);

    /* taken over with nothing new (the old key's last batch sent again),
     * then going on */
    s_teardown_files(f);
    a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    fi_audit_set_adopt_check(a, s_may_adopt, NULL);
    s_ingest(a, "edge-a", r, 5, 5);
    s_ingest(a, "edge-a2", r + 3, 2, 0);
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) fail_msg("adopted, nothing new: %s", ck.what);
    s_ingest(a, "edge-a2", r + 5, 3, 3);
    if (fi_audit_verify(a, &ck, err, sizeof err) != 0) fail_msg("adopted, then new: %s", ck.what);
    assert_true(ck.records == 8);
    fi_audit_destroy(&a);
    /* the adopting run's link edited in the file */
    assert_int_equal(s_sql(f, UNGUARD), SQLITE_OK);
    assert_int_equal(s_sql(f, "UPDATE audit SET source_hash = (SELECT source_hash FROM audit WHERE seq = 5)"
                              " WHERE seq = 6"),
                     SQLITE_OK);
    assert_int_equal(s_verify(f, &ck), 1);
    assert_true(ck.bad_seq == 6);

    /* a new key whose first record is not linked to the old key's last
     * (the log's own chain intact: written with fi_audit_append) */
    s_teardown_files(f);
    a = fi_audit_open(f->path, err, sizeof err);
    assert_non_null(a);
    for (int i = 0; i < 5; i++) {
        fi_audit_record c = r[i];
        c.source = i < 3 ? "edge-a" : "edge-a2";
        c.source_seq = r[i].seq;
        memcpy(c.source_hash, r[i].hash, sizeof c.source_hash);
        c.received = 1;
        if (i == 3) fi_audit_chain_hash(r[1].hash, &r[i], c.source_hash); /* linked to 2, not 3 */
        assert_int_equal(fi_audit_append(a, &c, err, sizeof err), 0);
    }
    assert_int_equal(fi_audit_verify(a, &ck, err, sizeof err), 1);
    printf("broken adoption: %s\n", ck.what);
    assert_true(ck.bad_seq == 4);
    assert_non_null(strstr(ck.what, "record 4 (source edge-a2) starts the source's run at its record 4"));
    fi_audit_destroy(&a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_intact, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_open_readonly, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_damaged_page_refused, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_not_a_database_refused, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_triggers_refuse, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_edit_detected, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_type_and_nul_edits_detected, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_texts_valid_utf8, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_edit_with_rehash_detected, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_remove_detected, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_remove_and_renumber_detected, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_reorder_detected, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_truncation_changes_head, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_query, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_log_decision, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_ingest_keeps_provenance, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_provenance_edit_detected, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_source_run_checked, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_heads_checked, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_witnesses, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_old_log_upgraded, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_adoption_verified, s_setup, s_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
