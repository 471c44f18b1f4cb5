/*
 * test_policy_cli.c - the console verbs end to end: `fedctl policy ...` and
 * `fedctl audit ...` run as processes, with their output and exit status
 * checked. fedctl is found through the FEDCTL environment variable (set by
 * tests/policy.cmake); without it the tests are skipped.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "db_damage.h"
#include "fi_audit.h"

typedef struct fx {
    const char *fedctl; /* path of the binary */
    char dir[256];      /* scratch directory */
    char ex[1024];      /* examples/policies */
    char out[65536];    /* output of the last command */
} fx;

static int s_setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    if (!f) return -1;
    f->fedctl = getenv("FEDCTL");
    snprintf(f->dir, sizeof f->dir, "/tmp/fi_cli_test_XXXXXX");
    if (!mkdtemp(f->dir)) return -1;
    snprintf(f->ex, sizeof f->ex, "%s/../examples/policies", FI_TEST_DIR);
    *state = f;
    return 0;
}

static int s_teardown(void **state) {
    fx *f = *state;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", f->dir);
    int rc = system(cmd);
    free(f);
    return rc ? -1 : 0;
}

/* Runs "fedctl ARGS" (a shell fragment), capturing stdout and stderr. */
static int s_run(fx *f, const char *fmt, ...) {
    if (!f->fedctl || access(f->fedctl, X_OK)) skip();
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s 2>&1", f->dir, f->fedctl, args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(f->out, 1, sizeof f->out - 1, p);
    f->out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void s_has(const fx *f, const char *want) {
    if (!strstr(f->out, want)) fail_msg("expected in the output:\n  %s\ngot:\n%s", want, f->out);
}

static void test_help(void **state) {
    fx *f = *state;
    assert_int_equal(s_run(f, "--help"), 0);
    s_has(f, "policy");
    s_has(f, "audit");
    const char *verbs[] = {"check", "test", "explain", "flows", "diff", "bench", "apply",
                           "history", "rollback", "bundle", "install", "keygen"};
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++) {
        assert_int_equal(s_run(f, "policy %s --help", verbs[i]), 0);
        s_has(f, "usage: fedctl policy");
    }
    assert_int_equal(s_run(f, "policy --help"), 0);
    assert_int_equal(s_run(f, "audit --help"), 0);
    s_has(f, "usage: fedctl audit");
    assert_int_equal(s_run(f, "audit verify --help"), 0);
    assert_int_equal(s_run(f, "audit witnesses --help"), 0);
    s_has(f, "usage: fedctl audit witnesses");
    assert_int_equal(s_run(f, "policy nope"), 2);
    assert_int_equal(s_run(f, "policy check"), 2);
}

static void test_check_test_explain_flows(void **state) {
    fx *f = *state;
    assert_int_equal(s_run(f, "policy check '%s/eu-hospital.policy'", f->ex), 0);
    s_has(f, "ok: 3 sites, 6 targets, 4 labels, 9 rules, 0 warning(s)");
    assert_int_equal(s_run(f, "policy check '%s/policy/bad/14-unknown-label.policy'", FI_TEST_DIR), 1);
    s_has(f, "14-unknown-label.policy:4:17: error: unknown label \"phy\"");
    s_has(f, "a policy with errors is never applied");
    assert_int_equal(s_run(f, "policy test '%s/sovereign.policy' '%s/sovereign.cases'", f->ex, f->ex), 0);
    s_has(f, "4 cases, 4 passed, 0 failed");
    /* a failing case: readable report and exit status 1 */
    char path[512];
    snprintf(path, sizeof path, "%s/bad.cases", f->dir);
    FILE *c = fopen(path, "w");
    assert_non_null(c);
    fputs("case \"phi to the cloud\" { origin = \"berlin-clinic\"; labels = [\"phi\"];\n"
          "  expect chosen = \"fra-gpu-1\"; }\n",
          c);
    fclose(c);
    assert_int_equal(s_run(f, "policy test '%s/eu-hospital.policy' bad.cases", f->ex), 1);
    s_has(f, "FAIL  phi to the cloud");
    s_has(f, "expected chosen = \"fra-gpu-1\", got \"berlin-clinic\"");
    s_has(f, "denied fra-gpu-1: forbid \"phi stays on site\" (condition could not be evaluated)");
    assert_int_equal(s_run(f, "policy explain '%s/eu-hospital.policy' origin=berlin-clinic labels=phi", f->ex), 0);
    s_has(f, "denied munich-clinic: forbid \"phi stays on site\"");
    s_has(f, "chosen: berlin-clinic");
    assert_int_equal(s_run(f, "policy explain '%s/eu-hospital.policy' origin=berlin-clinic bogus", f->ex), 2);
    assert_int_equal(s_run(f, "policy explain '%s/eu-hospital.policy' origin=berlin-clinic -V", f->ex), 2);
    assert_int_equal(s_run(f, "policy flows '%s/us-bank.policy' --al", f->ex), 2);
    assert_int_equal(s_run(f, "policy check --strict '%s/eu-hospital.policy'", f->ex), 2);
    assert_int_equal(s_run(f, "policy flows '%s/us-bank.policy'", f->ex), 0);
    s_has(f, "nyc-branch  montreal-dr  no      no        no     no");
    assert_int_equal(s_run(f, "policy flows '%s/us-bank.policy' --all", f->ex), 0);
    s_has(f, "pci\tnyc-branch\tnyc-gpu\tyes\tinside the US");
}

static void s_seed_audit(fx *f, const char *db) {
    char err[300], path[1200];
    snprintf(path, sizeof path, "%s/eu-hospital.policy", f->ex);
    fi_policy *p = fi_policy_load(path, NULL);
    assert_non_null(p);
    snprintf(path, sizeof path, "%s/%s", f->dir, db);
    fi_audit *a = fi_audit_open(path, err, sizeof err);
    assert_non_null(a);
    const char *phi[] = {"phi"}, *pii[] = {"pii"};
    fi_request reqs[2] = {{"req-phi", NULL, NULL, "berlin-clinic", "smollm2-135m", phi, 1, -1, -1},
                          {"req-pii", NULL, NULL, "berlin-clinic", "smollm2-135m", pii, 1, -1, -1}};
    fi_verdict v[8];
    for (int i = 0; i < 2; i++) {
        assert_int_equal(fi_policy_decide(p, &reqs[i], NULL, fi_policy_target_count(p), v), 0);
        assert_int_equal(fi_audit_log_decision(a, p, &reqs[i], v, fi_policy_target_count(p), NULL,
                                               1800000000000LL + i * 1000, err, sizeof err), 0);
    }
    fi_audit_destroy(&a);
    fi_policy_destroy(&p);
}

static void test_store_bundle_diff_audit(void **state) {
    fx *f = *state;
    assert_int_equal(s_run(f, "policy keygen --out signing.key"), 0);
    assert_int_equal(s_run(f, "policy keygen --out signing.key"), 1); /* never overwrites */
    assert_int_equal(s_run(f, "policy apply '%s/eu-hospital.policy' -m 'first' --store store.db --key signing.key --author alice",
                           f->ex), 0);
    s_has(f, "as version 1");
    /* a modified policy: without the own-site permit */
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "grep -v 'permit \"own site\"' '%s/eu-hospital.policy' > '%s/new.policy'", f->ex, f->dir);
    assert_int_equal(system(cmd), 0);
    /* --message before FILE: its value is not taken for the file */
    assert_int_equal(s_run(f, "policy apply --message 'drop own site' new.policy --store store.db --key signing.key --author bob"), 0);
    s_has(f, "as version 2");
    assert_int_equal(s_run(f, "policy apply new.policy -m x --store store.db --key signing.key --valid-day 3"), 2);
    assert_int_equal(s_run(f, "policy apply '%s/policy/bad/12-unknown-attribute.policy' -m x --store store.db --key signing.key",
                           FI_TEST_DIR), 1);
    s_has(f, "policy refused");
    assert_int_equal(s_run(f, "policy history --store store.db"), 0);
    s_has(f, "alice");
    s_has(f, "drop own site");
    assert_int_equal(s_run(f, "policy rollback 1 --store store.db --key signing.key -m 'bad idea'"), 0);
    s_has(f, "version 3 restores the content of version 1");
    assert_int_equal(s_run(f, "policy history --store store.db"), 0);
    s_has(f, "rollback to version 1: bad idea");
    /* ship: the edge installs 2 then 3, and refuses 1 and 3 again */
    assert_int_equal(s_run(f, "policy bundle --store store.db --version 2 --out v2.bundle"), 0);
    assert_int_equal(s_run(f, "policy bundle --store store.db --out v3.bundle"), 0);
    assert_int_equal(s_run(f, "policy bundle --store store.db --version 1 --out v1.bundle"), 0);
    /* a --version that is not a whole number >= 1 is refused, never taken
     * for the latest (before: "x" exported version 3 with exit status 0;
     * found by a review) */
    const char *bad_versions[] = {"x", "2x", "0", "-1", "", " 2", "99999999999999999999999"};
    for (size_t i = 0; i < sizeof bad_versions / sizeof bad_versions[0]; i++) {
        assert_int_equal(s_run(f, "policy bundle --store store.db --version '%s' --out bad.bundle", bad_versions[i]), 2);
        s_has(f, "--version wants a whole number >= 1");
        char bpath[400];
        snprintf(bpath, sizeof bpath, "%s/bad.bundle", f->dir);
        if (!access(bpath, F_OK)) fail_msg("--version '%s' wrote a bundle", bad_versions[i]);
        /* the online verb refuses it too, before it connects (it took
         * "-1" as 2^64 - 1 and "0" or "" as the active version) */
        assert_int_equal(s_run(f, "policy bundle --version '%s' --out bad.bundle", bad_versions[i]), 2);
        s_has(f, "--version wants a whole number >= 1");
    }
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/edge'", f->dir);
    assert_int_equal(system(cmd), 0);
    assert_int_equal(s_run(f, "policy install v2.bundle --dir edge --trust signing.key.pub"), 0);
    assert_int_equal(s_run(f, "policy install v3.bundle --dir edge --trust signing.key.pub"), 0);
    assert_int_equal(s_run(f, "policy install v1.bundle --dir edge --trust signing.key.pub"), 1);
    s_has(f, "replay or roll-back");
    assert_int_equal(s_run(f, "policy install v3.bundle --dir edge --trust signing.key.pub"), 1);
    assert_int_equal(s_run(f, "policy keygen --out other.key"), 0);
    assert_int_equal(s_run(f, "policy install v3.bundle --dir edge2 --trust other.key.pub"), 1);
    s_has(f, "signed by an unknown key");
    /* diff before applying: flows and a replay of the audited requests */
    assert_int_equal(s_run(f, "policy bundle --store store.db --version 1 --out active.policy --content"), 0);
    s_seed_audit(f, "audit.db");
    assert_int_equal(s_run(f, "policy diff new.policy --active active.policy --audit audit.db --since 2027-01-15 --until 2027-01-16"),
                     0);
    s_has(f, "- closes phi from berlin-clinic to berlin-clinic: yes -> no");
    s_has(f, "request req-phi (origin berlin-clinic, labels [phi], model smollm2-135m): berlin-clinic -> denied");
    s_has(f, "2 audited request(s) replayed, 1 decision(s) would change");
    assert_int_equal(s_run(f, "policy diff new.policy --active active.policy --audit audit.db --since 2030-01-01"), 0);
    s_has(f, "0 audited request(s) replayed");
    assert_int_equal(s_run(f, "policy diff new.policy --active active.policy --audit audit.db --since 1800000000 --until 1800000001"), 0);
    s_has(f, "1 audited request(s) replayed, 1 decision(s) would change");
    assert_int_equal(s_run(f, "audit --db audit.db --since 2027-01-15T08:00:01Z"), 0);
    s_has(f, "req-pii");
    if (strstr(f->out, "req-phi")) fail_msg("--since let an earlier record through:\n%s", f->out);
    assert_int_equal(s_run(f, "audit --db audit.db --since yesterday"), 2);
    s_has(f, "fedctl audit: --since 'yesterday' is not a time");
    assert_int_equal(s_run(f, "audit --db audit.db --since 99999999999999999"), 2); /* ms would overflow */
    s_has(f, "Unix seconds from 0 to 9223372036854775");
    assert_int_equal(s_run(f, "audit --db audit.db --since +5"), 2); /* strtoll took it */
    s_has(f, "--since '+5' is not a time");
    assert_int_equal(s_run(f, "audit --db audit.db --since ' 5'"), 2);
    assert_int_equal(s_run(f, "audit --db audit.db --until 2027-02-30"), 2);
    s_has(f, "--until '2027-02-30' is not a time");
    assert_int_equal(s_run(f, "audit --db audit.db --limit 5x"), 2); /* was taken as 5 */
    s_has(f, "--limit '5x' is not a number of records from 0 (no limit) to 1000000");
    assert_int_equal(s_run(f, "audit --db audit.db --limit 1"), 0);
    /* online, refused before any connection is tried */
    assert_int_equal(s_run(f, "audit --limit 1000001"), 2);
    s_has(f, "--limit '1000001' is not a number of records");
    assert_int_equal(s_run(f, "audit --since 2027-13-01"), 2);
    s_has(f, "--since '2027-13-01' is not a time");
    assert_int_equal(s_run(f, "audit stray"), 2);
    s_has(f, "unexpected argument 'stray'");
    assert_int_equal(s_run(f, "policy diff new.policy --until never"), 2);
    s_has(f, "fedctl policy diff: --until 'never' is not a time");
    /* the active version taken from the store: version 3 has version 1's content */
    assert_int_equal(s_run(f, "policy diff new.policy --store store.db"), 0);
    s_has(f, "compared with the active version 3 of store.db");
    s_has(f, "- closes phi from berlin-clinic to berlin-clinic: yes -> no");
    /* without --active/--store the active policy is the coordinator's: no
     * operator configuration here */
    assert_int_equal(s_run(f, "policy diff new.policy"), 1);
    s_has(f, "no --config and no $FEDCTL_CONFIG");
    /* the audit log: listing with filters, verify, tamper */
    assert_int_equal(s_run(f, "audit --db audit.db --label phi"), 0);
    s_has(f, "req-phi");
    if (strstr(f->out, "req-pii")) fail_msg("filter by label let req-pii through:\n%s", f->out);
    assert_int_equal(s_run(f, "audit --db audit.db --decision permit --target fra-gpu-1"), 0);
    s_has(f, "req-pii");
    /* times read as ISO 8601: the fraction before the Z */
    s_has(f, ".000Z");
    /* --site is --origin, as online; an unknown option is refused, never
     * dropped (a dropped filter would list everything) */
    assert_int_equal(s_run(f, "audit --db audit.db --site nowhere"), 0);
    if (strstr(f->out, "req-")) fail_msg("--site did not filter:\n%s", f->out);
    assert_int_equal(s_run(f, "audit --db audit.db --sight nowhere"), 2);
    s_has(f, "unknown option '--sight'");
    assert_int_equal(s_run(f, "audit verify --db audit.db --hed 00"), 2);
    assert_int_equal(s_run(f, "policy history --store store.db --all"), 2);
    assert_int_equal(s_run(f, "policy bundle --store store.db --out x.bundle --contents"), 2);
    assert_int_equal(s_run(f, "audit verify --db audit.db"), 0);
    s_has(f, "intact: 2 records");
    /* a checkpoint noted now still holds once the log has grown; the
     * plain head does not, and neither does a checkpoint whose record is
     * cut off the end */
    char point[100], h2[70];
    const char *cp = strstr(f->out, "checkpoint ");
    assert_non_null(cp);
    assert_int_equal(sscanf(cp, "checkpoint %99s", point), 1);
    assert_int_equal(sscanf(point, "2:%69s", h2), 1);
    s_seed_audit(f, "audit.db");
    assert_int_equal(s_run(f, "audit verify --db audit.db --head %s", point), 0);
    s_has(f, "intact: 4 records");
    cp = strstr(f->out, "checkpoint ");
    char point4[100];
    assert_non_null(cp);
    assert_int_equal(sscanf(cp, "checkpoint %99s", point4), 1);
    assert_int_equal(s_run(f, "audit verify --db audit.db --head %s", h2), 1);
    assert_int_equal(s_run(f, "audit verify --db audit.db --head 2:%064d", 0), 1);
    s_has(f, "not the 0000");
    assert_int_equal(s_run(f, "audit verify --db audit.db --head 00"), 1);
    char path[600];
    snprintf(path, sizeof path, "%s/audit.db", f->dir);
    sqlite3 *db;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "DROP TRIGGER audit_no_delete; DELETE FROM audit WHERE seq=4", NULL, NULL, NULL),
                     SQLITE_OK);
    assert_int_equal(s_run(f, "audit verify --db audit.db"), 0); /* a cut end alone looks intact */
    assert_int_equal(s_run(f, "audit verify --db audit.db --head %s", point4), 1);
    s_has(f, "record 4 of the checkpoint is gone");
    assert_int_equal(s_run(f, "audit verify --db audit.db --head %s", point), 0);
    assert_int_equal(sqlite3_exec(db, "DROP TRIGGER audit_no_update; UPDATE audit SET target='virginia-gpu' WHERE seq=2",
                                  NULL, NULL, NULL),
                     SQLITE_OK);
    sqlite3_close(db);
    assert_int_equal(s_run(f, "audit verify --db audit.db"), 1);
    s_has(f, "BROKEN: record 2 was edited");
}

/* fedctl audit witnesses --db: each witness of the log and whether the log
 * still holds it; a cut makes it fail (exit 1) until forgotten. */
static void test_audit_witnesses(void **state) {
    fx *f = *state;
    s_seed_audit(f, "wit.db");
    s_seed_audit(f, "wit.db"); /* records 1..4 */
    char err[300], path[600];
    snprintf(path, sizeof path, "%s/wit.db", f->dir);
    fi_audit *a = fi_audit_open(path, err, sizeof err);
    assert_non_null(a);
    fi_audit_witness w = {.who = "edge-fpr-1", .site = "berlin-clinic", .reported = 1800000000000LL};
    assert_int_equal(fi_audit_head(a, &w.seq, w.hash, err, sizeof err), 0);
    assert_true(w.seq == 4);
    assert_int_equal(fi_audit_witness_put(a, &w, 1, err, sizeof err), 0);
    fi_audit_destroy(&a);
    assert_int_equal(s_run(f, "audit witnesses --db wit.db"), 0);
    s_has(f, "edge-fpr-1");
    s_has(f, "berlin-clinic");
    s_has(f, "2027-01-15T08:00:00Z holds");
    assert_int_equal(s_run(f, "audit verify --db wit.db"), 0);
    s_has(f, "1 witness(es) hold");
    sqlite3 *db;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "DROP TRIGGER audit_no_delete; DELETE FROM audit WHERE seq = 4", NULL, NULL, NULL),
                     SQLITE_OK);
    sqlite3_close(db);
    assert_int_equal(s_run(f, "audit witnesses --db wit.db"), 1);
    s_has(f, "FAILS: witness edge-fpr-1 (site berlin-clinic) was told record 4");
    assert_int_equal(s_run(f, "audit verify --db wit.db"), 1);
    s_has(f, "BROKEN: witness edge-fpr-1");
    /* usage errors, an unknown witness */
    assert_int_equal(s_run(f, "audit witnesses --db wit.db --forget a --forget-all"), 2);
    assert_int_equal(s_run(f, "audit witnesses --db wit.db extra"), 2);
    assert_int_equal(s_run(f, "audit witnesses --db wit.db --forgot a"), 2);
    assert_int_equal(s_run(f, "audit witnesses"), 2);
    s_has(f, "--db DB");
    assert_int_equal(s_run(f, "audit witnesses --db wit.db --forget nobody"), 1);
    s_has(f, "keeps no witness nobody");
    /* forgotten on purpose: the log verifies again */
    assert_int_equal(s_run(f, "audit witnesses --db wit.db --forget edge-fpr-1"), 0);
    s_has(f, "forgot 1 witness(es)");
    assert_int_equal(s_run(f, "audit witnesses --db wit.db"), 0);
    assert_int_equal(s_run(f, "audit verify --db wit.db"), 0);
    s_has(f, "0 witness(es) hold");
}

/* A damaged file given to fedctl (a log to list or verify, a store) is
 * refused at once, with exit status 1 and a message that names it and
 * says it is damaged (before: audit verify and the listing failed midway
 * with "database disk image is malformed", the store opened). */
static void test_damaged_files_refused(void **state) {
    fx *f = *state;
    char path[600], err[600];
    snprintf(path, sizeof path, "%s/damaged.db", f->dir);
    if (fi_test_audit_fill(path, 2000, err, sizeof err) != 0) fail_msg("%s", err);
    assert_int_equal(s_run(f, "audit verify --db damaged.db"), 0);
    s_has(f, "intact: 2000 records");
    int page = fi_test_db_damage(path, err, sizeof err);
    if (page < 0) fail_msg("%s", err);
    const char *cmds[] = {"audit verify --db damaged.db", "audit --db damaged.db --label phi",
                          "policy history --store damaged.db"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        assert_int_equal(s_run(f, "%s", cmds[i]), 1);
        printf("fedctl %s: %s", cmds[i], f->out);
        s_has(f, "damaged.db: database is damaged: ");
        if (strstr(f->out, "req-")) fail_msg("records listed from a damaged log:\n%s", f->out);
    }
}

/* Writes text to a file in the scratch directory. */
static void s_write(fx *f, const char *name, const char *text) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", f->dir, name);
    FILE *c = fopen(path, "w");
    assert_non_null(c);
    fputs(text, c);
    assert_int_equal(fclose(c), 0);
}

/* policy diff with three labels of 300 bytes: the label set of a changed
 * flow no longer fits the 512 bytes kept for it, and is cut with "..."
 * (before: the offset ran past the buffer and snprintf was given a wrapped
 * size, a stack overflow found by a review). */
static void test_diff_long_labels(void **state) {
    fx *f = *state;
    char a[301], b[301], c[301], head[1600];
    memset(a, 'a', 300);
    memset(b, 'b', 300);
    memset(c, 'c', 300);
    a[300] = b[300] = c[300] = 0;
    snprintf(head, sizeof head, "labels %s, %s, %s;\ndefault_label \"%s\";\njurisdiction J; region r in J; site s in r;\n",
             a, b, c, a);
    char text[2000];
    snprintf(text, sizeof text, "%spermit \"all\";\n", head);
    s_write(f, "long-old.policy", text);
    snprintf(text, sizeof text, "%sforbid \"none\";\npermit \"all\";\n", head);
    s_write(f, "long-new.policy", text);
    assert_int_equal(s_run(f, "policy diff long-new.policy --active long-old.policy"), 0);
    s_has(f, "- closes aaaa");
    s_has(f, "bbbb... from s to s: yes -> no");
    s_has(f, "0 flow(s) opened, 8 closed");
}

static void test_bench_runs(void **state) {
    fx *f = *state;
    assert_int_equal(s_run(f, "policy bench '%s/eu-hospital.policy' --iterations 2000", f->ex), 0);
    s_has(f, "generated-100");
    assert_int_equal(s_run(f, "policy bench x --print-rules 5"), 0);
    s_has(f, "prefer \"r4\" score 5 when target.tier == 1;");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_help),
        cmocka_unit_test(test_check_test_explain_flows),
        cmocka_unit_test(test_store_bundle_diff_audit),
        cmocka_unit_test(test_audit_witnesses),
        cmocka_unit_test(test_damaged_files_refused),
        cmocka_unit_test(test_diff_long_labels),
        cmocka_unit_test(test_bench_runs),
    };
    return cmocka_run_group_tests(tests, s_setup, s_teardown);
}
