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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
