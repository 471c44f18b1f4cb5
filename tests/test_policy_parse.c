/*
 * test_policy_parse.c - the parser: valid syntax in all its forms, and the
 * corpus of malformed policies in tests/policy/bad/, each of which must be
 * refused with the messages its "# expect: " lines name (file:line:col,
 * what was expected, a hint).
 */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "fi_cases.h"
#include "fi_policy.h"

static fi_policy *s_parse(const char *text, fi_diags *d) { return fi_policy_parse(text, strlen(text), d); }

static void test_empty_and_comments(void **state) {
    (void)state;
    fi_policy *p = s_parse("", NULL);
    assert_non_null(p);
    assert_int_equal(fi_policy_rule_count(p), 0);
    fi_policy_destroy(&p);
    p = s_parse("# a comment\n// another\n   \n\t# last", NULL);
    assert_non_null(p);
    fi_policy_destroy(&p);
    /* empty sets before any other set */
    p = s_parse("jurisdiction J; region r in J; site s in r; cluster c in r { e = []; }\n"
                "permit \"x\" when target.e <= [] and [] <= target.e and target.e == [];\n", NULL);
    assert_non_null(p);
    const char *none[1] = {NULL};
    fi_request r = {"t", NULL, NULL, "s", NULL, none, 0, -1, -1};
    fi_verdict v[2];
    assert_int_equal(fi_policy_decide(p, &r, NULL, 2, v), 0);
    assert_false(v[0].permitted); /* the site has no e: error, not permitted */
    assert_true(v[1].permitted);
    fi_policy_destroy(&p);
}

static void test_full_syntax(void **state) {
    (void)state;
    const char *text =
        "labels public, internal, \"export-controlled\", pii;  # names or strings\n"
        "default_label \"internal\";\n"
        "expires \"2031-02-03T04:05:06Z\";\n"
        "jurisdiction EU;\n"
        "jurisdiction DE in EU { };\n"
        "region \"eu central\" in DE;\n"
        "site berlin-clinic in \"eu central\" { tier = \"clinic\"; beds = 900; open = true; }\n"
        "cluster fra_gpu-1 in \"eu central\" {\n"
        "    certifications = [\"iso27001\", \"c5\", \"iso27001\"];\n" /* duplicates collapse */
        "    cost = -3; gpu = \"h\\\"200\\\\\"; empty = [];\n"
        "}\n"
        "permit \"always\";\n"
        "forbid \"f\" when not (target has gpu) or target.gpu != \"x\" and (true or false);\n"
        "prefer \"p\" score -5 when target.cost <= -3 and request.labels >= [];\n"
        "permit \"q\" when target.open == true and \"c5\" in target.certifications and target within \"EU\";\n"
        "permit \"r\" when request has tenant and request.tenant == \"t\" and request.origin.jurisdiction within \"EU\";\n";
    fi_diags *d = fi_diags_new();
    fi_policy *p = s_parse(text, d);
    if (!p) fi_diags_print(d, "full", stderr);
    assert_non_null(p);
    assert_int_equal(fi_diags_errors(d), 0);
    assert_int_equal(fi_policy_label_count(p), 4);
    assert_string_equal(fi_policy_label_name(p, 2), "export-controlled");
    assert_int_equal(fi_policy_target_count(p), 2);
    assert_true(fi_policy_target_find(p, "fra_gpu-1") >= 0);
    assert_int_equal(fi_policy_rule_count(p), 5);
    assert_true(fi_policy_expires(p) > 0);
    fi_policy_destroy(&p);
    fi_diags_destroy(&d);
}

static void test_many_errors_reported(void **state) {
    (void)state;
    const char *text = "permit \"a\" when ;\n"
                       "permit \"b\" when true;\n"
                       "forbid when false;\n"
                       "jurisdiction;\n"
                       "permit \"c\" when true\n";
    fi_diags *d = fi_diags_new();
    assert_null(s_parse(text, d));
    assert_true(fi_diags_errors(d) >= 4);
    /* in file order, each with a position and a hint */
    unsigned last = 0;
    for (size_t i = 0; i < fi_diags_count(d); i++) {
        const fi_diag *x = fi_diags_get(d, i);
        assert_true(x->line >= last);
        assert_true(x->line > 0 && x->col > 0);
        assert_true(x->hint[0] != 0);
        last = x->line;
    }
    fi_diags_destroy(&d);
}

static void test_depth_limit(void **state) {
    (void)state;
    char text[2000] = "permit \"deep\" when ";
    for (int i = 0; i < 100; i++) strcat(text, "(");
    strcat(text, "true");
    for (int i = 0; i < 100; i++) strcat(text, ")");
    strcat(text, ";");
    fi_diags *d = fi_diags_new();
    assert_null(s_parse(text, d));
    char buf[700];
    fi_diag_format(fi_diags_get(d, 0), "deep.policy", buf, sizeof buf);
    assert_non_null(strstr(buf, "deep.policy:1:"));
    assert_non_null(strstr(buf, "nested deeper than 64 levels"));
    fi_diags_destroy(&d);
    /* long and-chains are bounded too */
    size_t cap = 64 + 3000 * 9;
    char *chain = malloc(cap);
    assert_non_null(chain);
    strcpy(chain, "permit \"long\" when true");
    for (int i = 0; i < 3000; i++) strcat(chain, " and true");
    strcat(chain, ";");
    d = fi_diags_new();
    assert_null(s_parse(chain, d));
    assert_non_null(strstr(fi_diags_get(d, 0)->msg, "condition too long"));
    fi_diags_destroy(&d);
    free(chain);
    char nots[1000] = "permit \"n\" when ";
    for (int i = 0; i < 80; i++) strcat(nots, "not ");
    strcat(nots, "true;");
    d = fi_diags_new();
    assert_null(s_parse(nots, d));
    fi_diags_destroy(&d);
}

static void test_missing_file(void **state) {
    (void)state;
    fi_diags *d = fi_diags_new();
    assert_null(fi_policy_load("/nonexistent/dir/p.policy", d));
    char buf[700];
    fi_diag_format(fi_diags_get(d, 0), "p.policy", buf, sizeof buf);
    assert_non_null(strstr(buf, "cannot open policy file /nonexistent/dir/p.policy"));
    fi_diags_destroy(&d);
}

static char *s_slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *buf = calloc(1, 65536);
    assert_non_null(buf);
    size_t n = fread(buf, 1, 65535, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

static int s_name_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Every file in tests/policy/bad is refused with the expected messages. */
static void test_bad_corpus(void **state) {
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/policy/bad", FI_TEST_DIR);
    DIR *dh = opendir(dir);
    assert_non_null(dh);
    char *names[256];
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(dh)) && n < 256)
        if (strstr(e->d_name, ".policy")) names[n++] = strdup(e->d_name);
    closedir(dh);
    qsort(names, n, sizeof *names, s_name_cmp);
    assert_true(n >= 20);
    for (size_t i = 0; i < n; i++) {
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        char *text = s_slurp(path);
        fi_diags *d = fi_diags_new();
        fi_policy *p = fi_policy_parse(text, strlen(text), d);
        if (p) fail_msg("%s: accepted, but it is malformed", names[i]);
        /* the whole report, as fedctl policy check prints it */
        char report[8192] = "";
        for (size_t k = 0; k < fi_diags_count(d); k++) {
            char line[700];
            fi_diag_format(fi_diags_get(d, k), names[i], line, sizeof line);
            strncat(report, line, sizeof report - strlen(report) - 2);
            strcat(report, "\n");
        }
        const fi_diag *first = fi_diags_get(d, 0);
        assert_non_null(first);
        if (!first->line || !first->col) fail_msg("%s: first error has no position:\n%s", names[i], report);
        size_t expects = 0;
        for (char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
            if (strncmp(line, "# expect: ", 10)) continue;
            char want[512];
            size_t len = strcspn(line + 10, "\n");
            snprintf(want, sizeof want, "%.*s", (int)len, line + 10);
            expects++;
            if (!strstr(report, want)) fail_msg("%s: expected the message\n  %s\ngot:\n%s", names[i], want, report);
        }
        if (!expects) fail_msg("%s: no # expect: line", names[i]);
        fi_diags_destroy(&d);
        free(text);
        free(names[i]);
    }
}

/* The example policies parse without errors or warnings. */
static void test_examples_clean(void **state) {
    (void)state;
    const char *files[] = {"eu-hospital.policy", "us-bank.policy", "sovereign.policy"};
    for (size_t i = 0; i < 3; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/../examples/policies/%s", FI_TEST_DIR, files[i]);
        fi_diags *d = fi_diags_new();
        fi_policy *p = fi_policy_load(path, d);
        if (!p || fi_diags_count(d)) fi_diags_print(d, path, stderr);
        assert_non_null(p);
        assert_int_equal(fi_diags_count(d), 0);
        fi_policy_destroy(&p);
        fi_diags_destroy(&d);
    }
}

static void test_cases_syntax(void **state) {
    (void)state;
    const char *good = "case \"x\" { origin = \"s\"; labels = [\"a\", \"b\"]; latency_ms = 5; prompt_tokens = 7;\n"
                       "  targets = [\"t\"]; expect permitted = []; expect chosen = none;\n"
                       "  expect denied \"t\" by default; expect denied \"t\" by \"r\"; expect score \"t\" = -3; }\n";
    fi_diags *d = fi_diags_new();
    fi_cases *cs = fi_cases_parse(good, strlen(good), d);
    assert_non_null(cs);
    assert_int_equal(fi_cases_count(cs), 1);
    assert_int_equal(fi_cases_request(cs, 0)->n_labels, 2);
    assert_true(fi_cases_request(cs, 0)->latency_ms == 5);
    fi_cases_destroy(&cs);
    const char *bad[] = {"case \"x\" { origin = 3; }", "case \"x\" { nope = \"a\"; }",
                         "case \"x\" { labels = [\"a\"; }", "case x { }", "case \"x\" { expect maybe = []; }",
                         "case \"x\" { labels = [\"a\"]; }",
                         "case \"x\" { origin = \"s\"; labels = [\"a\",]; }"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fi_diags *e = fi_diags_new();
        assert_null(fi_cases_parse(bad[i], strlen(bad[i]), e));
        const fi_diag *x = fi_diags_get(e, 0);
        assert_non_null(x);
        assert_true(x->line > 0);
        fi_diags_destroy(&e);
    }
    /* a permitted (or targets) list is a set: an element given twice is
     * refused (before: ["berlin", "berlin"] passed where berlin and sf were
     * permitted, as the counts matched; found by a review) */
    const char *dups[] = {"case \"x\" { origin = \"s\";\n  expect permitted = [\"berlin\", \"berlin\"]; }",
                          "case \"x\" { origin = \"s\";\n  targets = [\"a\", \"berlin\", \"berlin\"]; }"};
    const char *dup_msgs[] = {"c:2:33: error: \"berlin\" is given twice in the expect permitted list",
                              "c:2:29: error: \"berlin\" is given twice in the targets list"};
    for (size_t i = 0; i < 2; i++) {
        fi_diags *e = fi_diags_new();
        assert_null(fi_cases_parse(dups[i], strlen(dups[i]), e));
        char line[400] = "";
        if (fi_diags_count(e)) fi_diag_format(fi_diags_get(e, 0), "c", line, sizeof line);
        if (!strstr(line, dup_msgs[i])) fail_msg("expected %s, got %s", dup_msgs[i], line);
        fi_diags_destroy(&e);
    }
    fi_diags_destroy(&d);
    char err[300];
    char *argv[] = {"origin=s", "labels=a,b", "model=m", "latency_ms=9"};
    cs = fi_cases_from_args(4, argv, err, sizeof err);
    assert_non_null(cs);
    assert_int_equal(fi_cases_request(cs, 0)->n_labels, 2);
    fi_cases_destroy(&cs);
    char *bad_argv[] = {"labels=a"};
    assert_null(fi_cases_from_args(1, bad_argv, err, sizeof err));
    assert_non_null(strstr(err, "origin"));
}

/* expires takes exactly "YYYY-MM-DDTHH:MM:SSZ" with digits where the
 * format has them and a time that exists; the error names the string's
 * line:col (before: sscanf's %2d took "-1", "+1" and " 5", so
 * "2030-01-01T05:-1:00Z" was 04:59; found by a review). */
static void test_expires_strict(void **state) {
    (void)state;
    const char *bad[] = {"2030-01-01T05:-1:00Z", "2030-01-01T05:00:-1Z", "2030-+1-01T00:00:00Z",
                         "2030-01-01T 5:00:00Z", "2030-01-01T23:59:60Z", "2030-02-29T00:00:00Z",
                         "2030-01-01T24:00:00Z", "2030-13-01T00:00:00Z", "2030-00-10T00:00:00Z",
                         "1969-12-31T23:59:59Z", "2030-01-01t00:00:00Z", "2030-01-01T00:00:00z",
                         "+030-01-01T00:00:00Z", "2030-01-00T00:00:00Z"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char src[200], want[120], line[600] = "";
        snprintf(src, sizeof src, "# the time\n  expires \"%s\";\n", bad[i]);
        snprintf(want, sizeof want, "t:2:11: error: malformed time \"%s\"", bad[i]);
        fi_diags *d = fi_diags_new();
        fi_policy *p = fi_policy_parse(src, strlen(src), d);
        if (fi_diags_count(d)) fi_diag_format(fi_diags_get(d, 0), "t", line, sizeof line);
        if (p || !strstr(line, want)) fail_msg("expires \"%s\": expected %s, got %s", bad[i], want, line);
        fi_diags_destroy(&d);
    }
    /* the epoch itself was taken as "no expiry" (0 inside), so a policy
     * long expired never expired (found by a review) */
    {
        const char *src = "expires \"1970-01-01T00:00:00Z\";\n";
        char line[600] = "";
        fi_diags *d = fi_diags_new();
        fi_policy *p = fi_policy_parse(src, strlen(src), d);
        if (fi_diags_count(d)) fi_diag_format(fi_diags_get(d, 0), "t", line, sizeof line);
        if (p || !strstr(line, "t:1:9: error: expiry at the Unix epoch"))
            fail_msg("expires at the epoch: got %s", line);
        fi_diags_destroy(&d);
    }
    const char *good[] = {"2030-01-01T05:00:00Z", "2028-02-29T23:59:59Z", "1970-01-01T00:00:01Z"};
    const int64_t when[] = {1893474000, 1835481599, 1};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        char src[200];
        snprintf(src, sizeof src, "expires \"%s\";\n", good[i]);
        fi_diags *d = fi_diags_new();
        fi_policy *p = fi_policy_parse(src, strlen(src), d);
        if (!p) fi_diags_print(d, "t", stderr);
        assert_non_null(p);
        assert_true(fi_policy_expires(p) == when[i]);
        fi_policy_destroy(&p);
        fi_diags_destroy(&d);
    }
}

/* Loads path and expects NULL with an error containing want. */
static void s_expect_load_error(const char *path, const char *want) {
    fi_diags *e = fi_diags_new();
    fi_cases *cs = fi_cases_load(path, e);
    char line[600] = "";
    if (fi_diags_count(e)) fi_diag_format(fi_diags_get(e, 0), NULL, line, sizeof line);
    if (cs || !strstr(line, want)) fail_msg("loading %s: expected an error containing \"%s\", got %s", path, want, line);
    fi_diags_destroy(&e);
}

/* A cases file that cannot be read (a directory), one over the 8 MiB limit
 * or one without cases is an error (before: "0 cases" and exit status 0
 * for the first and last, the second silently cut at 8 MiB; found by a
 * review). */
static void test_cases_load_errors(void **state) {
    (void)state;
    char dir[64] = "/tmp/fi_cases_test_XXXXXX", path[128];
    assert_non_null(mkdtemp(dir));
    s_expect_load_error(dir, "cannot read cases file");
    snprintf(path, sizeof path, "%s/empty.cases", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("# nothing here\n", f);
    assert_int_equal(fclose(f), 0);
    s_expect_load_error(path, "holds no cases");
    /* a valid case, then comments past 8 MiB */
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("case \"x\" { origin = \"s\"; }\n", f);
    for (int i = 0; i < 8 * 1024; i++) {
        char line[1024];
        memset(line, ' ', sizeof line);
        line[0] = '#';
        line[sizeof line - 1] = '\n';
        assert_int_equal(fwrite(line, 1, sizeof line, f), sizeof line);
    }
    assert_int_equal(fclose(f), 0);
    s_expect_load_error(path, "is larger than the limit of 8 MiB");
    /* under the limit it loads */
    assert_int_equal(truncate(path, 1 << 20), 0);
    fi_diags *e = fi_diags_new();
    fi_cases *cs = fi_cases_load(path, e);
    assert_non_null(cs);
    assert_int_equal(fi_cases_count(cs), 1);
    fi_cases_destroy(&cs);
    fi_diags_destroy(&e);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_empty_and_comments), cmocka_unit_test(test_full_syntax),
        cmocka_unit_test(test_many_errors_reported), cmocka_unit_test(test_depth_limit),
        cmocka_unit_test(test_missing_file), cmocka_unit_test(test_bad_corpus),
        cmocka_unit_test(test_examples_clean), cmocka_unit_test(test_cases_syntax),
        cmocka_unit_test(test_cases_load_errors), cmocka_unit_test(test_expires_strict),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
