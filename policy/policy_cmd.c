/*
 * policy_cmd.c - `fedctl policy ...` and `fedctl audit ...` (see
 * fi_policy_cmd.h). The benchmark is in policy_bench.c.
 */
#include <errno.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fi_audit.h"
#include "fi_bundle.h"
#include "fi_cases.h"
#include "fi_policy_cmd.h"
#include "fi_pstore.h"

#define DEFAULT_VALID_DAYS 30

/* ------------------------------------------------------------------ helpers */

static bool s_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return true;
    return false;
}

/* Finds "--name VALUE" (or "-n VALUE") in argv; NULL when absent. *bad is
 * set when the option is present without a value. */
static const char *s_opt(int argc, char **argv, const char *name, const char *alias, bool *bad) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], name) || (alias && !strcmp(argv[i], alias))) {
            if (i + 1 >= argc) {
                fprintf(stderr, "fedctl: option %s needs a value\n", name);
                *bad = true;
                return NULL;
            }
            return argv[i + 1];
        }
    return NULL;
}

/* The first argument that looks like an option and is none of the
 * command's (with_value: options that take a value, whose value is then
 * skipped; flags: options without one); NULL when all are known. A
 * mistyped or unsupported option must not be ignored: a filter that is
 * silently dropped widens what a command does. */
static const char *s_stray(int argc, char **argv, const char *const *with_value,
                           const char *const *flags) {
    for (int i = 1; i < argc; i++) {
        if (argv[i][0] != '-' || !argv[i][1]) continue;
        bool known = false;
        for (size_t j = 0; with_value && with_value[j] && !known; j++)
            if (!strcmp(argv[i], with_value[j])) {
                known = true;
                i++;
            }
        for (size_t j = 0; flags && flags[j] && !known; j++) known = !strcmp(argv[i], flags[j]);
        if (!known) return argv[i];
    }
    return NULL;
}

/* s_stray's verdict, told: 0, or 2 (the usage exit status) after naming
 * the unknown option. */
static int s_options_ok(int argc, char **argv, const char *cmd, const char *const *with_value,
                        const char *const *flags) {
    const char *x = s_stray(argc, argv, with_value, flags);
    if (!x) return 0;
    fprintf(stderr, "fedctl %s: unknown option '%s' (fedctl %s --help lists them)\n", cmd, x, cmd);
    return 2;
}

static bool s_flag(int argc, char **argv, const char *name) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], name)) return true;
    return false;
}

/* The i-th positional argument (not an option or an option's value).
 * Options that take a value are listed in with_value. */
static const char *s_pos(int argc, char **argv, int want, const char *const *with_value) {
    int k = 0;
    for (int i = 1; i < argc; i++) {
        if (argv[i][0] == '-' && argv[i][1]) {
            for (size_t j = 0; with_value[j]; j++)
                if (!strcmp(argv[i], with_value[j])) {
                    i++;
                    break;
                }
            continue;
        }
        if (k++ == want) return argv[i];
    }
    return NULL;
}

/* Parses "YYYY-MM-DDTHH:MM:SSZ", "YYYY-MM-DD" or Unix seconds; -1 if bad.
 * Seconds above INT64_MAX / 1000 are bad: callers take milliseconds. */
int fi_policy_cmd_version(const char *s, uint64_t *v) {
    /* a whole number >= 1, all of it: "x" or "2x" is not the latest */
    char *e = NULL;
    errno = 0;
    unsigned long long n = s[0] >= '0' && s[0] <= '9' ? strtoull(s, &e, 10) : 0;
    if (!n || *e || errno) return -1;
    *v = (uint64_t)n;
    return 0;
}

int64_t fi_policy_cmd_time(const char *s) {
    int Y, M, D, h = 0, m = 0, sec = 0;
    char *e;
    errno = 0;
    long long x = strtoll(s, &e, 10);
    if (*s >= '0' && *s <= '9' && !*e && !errno) /* Unix seconds: digits only (no " 5", "+5") */
        return x <= FI_POLICY_CMD_TIME_MAX ? x : -1;
    size_t n = strlen(s);
    if (!((n == 20 && sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2dZ", &Y, &M, &D, &h, &m, &sec) == 6) ||
          (n == 10 && sscanf(s, "%4d-%2d-%2d", &Y, &M, &D) == 3)))
        return -1;
    struct tm tm = {0};
    tm.tm_year = Y - 1900;
    tm.tm_mon = M - 1;
    tm.tm_mday = D;
    tm.tm_hour = h;
    tm.tm_min = m;
    tm.tm_sec = sec;
    time_t t = timegm(&tm);
    /* a date that does not exist (2030-02-31, 25:00) is refused, not
     * carried into the next month or day */
    struct tm back;
    if (t == (time_t)-1 || !gmtime_r(&t, &back) || back.tm_year != Y - 1900 || back.tm_mon != M - 1 ||
        back.tm_mday != D || back.tm_hour != h || back.tm_min != m || back.tm_sec != sec)
        return -1;
    return (int64_t)t;
}

int fi_policy_cmd_time_opt(const char *cmd, const char *opt, const char *v, int64_t *t) {
    if (!v) return 0;
    int64_t x = fi_policy_cmd_time(v);
    if (x >= 0) {
        *t = x;
        return 0;
    }
    fprintf(stderr,
            "fedctl %s: %s '%.64s' is not a time: YYYY-MM-DD, YYYY-MM-DDTHH:MM:SSZ (a date that "
            "exists) or Unix seconds from 0 to %lld\n",
            cmd, opt, v, (long long)FI_POLICY_CMD_TIME_MAX);
    return -1;
}

int fi_policy_cmd_limit(const char *cmd, const char *v, uint64_t max, uint64_t *n) {
    if (!v) return 0;
    char *e = NULL;
    errno = 0;
    unsigned long long x = strtoull(v, &e, 10);
    if (*v >= '0' && *v <= '9' && !*e && !errno && x <= max) {
        *n = x;
        return 0;
    }
    fprintf(stderr, "fedctl %s: --limit '%.64s' is not a number of records from 0 (no limit) to %llu\n",
            cmd, v, (unsigned long long)max);
    return -1;
}

void fi_fmt_utc(int64_t t, char *buf, size_t cap) {
    time_t tt = (time_t)t;
    struct tm tm;
    gmtime_r(&tt, &tm);
    strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static fi_policy *s_load(const char *path, bool print_warnings) {
    fi_diags *d = fi_diags_new();
    fi_policy *pol = fi_policy_load(path, d);
    if (!pol || print_warnings) fi_diags_print(d, path, stderr);
    if (!pol) fprintf(stderr, "%s: %zu error(s); the policy cannot be used\n", path, fi_diags_errors(d));
    fi_diags_destroy(&d);
    return pol;
}

static fi_policy *s_load_text(const char *text, size_t len, const char *name) {
    fi_diags *d = fi_diags_new();
    fi_policy *pol = fi_policy_parse(text, len, d);
    if (!pol) {
        fi_diags_print(d, name, stderr);
        fprintf(stderr, "%s: %zu error(s); the policy cannot be used\n", name, fi_diags_errors(d));
    }
    fi_diags_destroy(&d);
    return pol;
}

static char *s_slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fedctl: cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    size_t cap = 0;
    *len = 0;
    for (;;) {
        if (*len == cap) {
            cap = cap ? cap * 2 : 65536;
            char *n = realloc(buf, cap);
            if (!n) {
                free(buf);
                fclose(f);
                fprintf(stderr, "fedctl: out of memory reading %s\n", path);
                return NULL;
            }
            buf = n;
        }
        size_t k = fread(buf + *len, 1, cap - *len, f);
        *len += k;
        if (!k || *len > (64u << 20)) break;
    }
    fclose(f);
    return buf;
}

/* -------------------------------------------------------------------- check */

static int s_check(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy check FILE\n\n"
               "Parses and validates FILE; prints every error and warning as file:line:col.\n"
               "Exit status 0 when it has no errors (warnings allowed), 1 otherwise.\n");
        return 0;
    }
    const char *nv[] = {NULL};
    if (s_options_ok(argc, argv, "policy check", nv, NULL)) return 2;
    const char *file = s_pos(argc, argv, 0, nv);
    if (!file) {
        fprintf(stderr, "usage: fedctl policy check FILE\n");
        return 2;
    }
    fi_diags *d = fi_diags_new();
    fi_policy *pol = fi_policy_load(file, d);
    fi_diags_print(d, file, stdout);
    if (pol) {
        char hex[65];
        fi_policy_digest_hex(pol, hex);
        printf("%s: ok: %zu sites, %zu targets, %zu labels, %zu rules, %zu warning(s); digest %.16s\n", file,
               fi_policy_site_count(pol), fi_policy_target_count(pol), fi_policy_label_count(pol),
               fi_policy_rule_count(pol), fi_diags_warnings(d), hex);
        if (fi_policy_expires(pol)) {
            char t[32];
            fi_fmt_utc(fi_policy_expires(pol), t, sizeof t);
            printf("%s: expires %s%s\n", file, t, fi_policy_current(pol, time(NULL)) ? "" : " (ALREADY EXPIRED)");
        }
    } else {
        printf("%s: %zu error(s), %zu warning(s); a policy with errors is never applied\n", file, fi_diags_errors(d),
               fi_diags_warnings(d));
    }
    fi_diags_destroy(&d);
    int rc = pol ? 0 : 1;
    fi_policy_destroy(&pol);
    return rc;
}

/* --------------------------------------------------------------------- test */

static int s_test(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy test FILE CASES\n\n"
               "Runs every case of CASES against the policy FILE and prints a report.\n"
               "Exit status 1 when a case fails. Cases format: policy/README.md.\n");
        return 0;
    }
    const char *nv[] = {NULL};
    if (s_options_ok(argc, argv, "policy test", nv, NULL)) return 2;
    const char *file = s_pos(argc, argv, 0, nv), *cases = s_pos(argc, argv, 1, nv);
    if (!file || !cases) {
        fprintf(stderr, "usage: fedctl policy test FILE CASES\n");
        return 2;
    }
    fi_policy *pol = s_load(file, false);
    if (!pol) return 1;
    fi_diags *d = fi_diags_new();
    fi_cases *cs = fi_cases_load(cases, d);
    if (!cs) {
        fi_diags_print(d, cases, stderr);
        fi_diags_destroy(&d);
        fi_policy_destroy(&pol);
        return 1;
    }
    fi_diags_destroy(&d);
    printf("policy %s, cases %s\n", file, cases);
    size_t failed = fi_cases_run(cs, pol, stdout);
    fi_cases_destroy(&cs);
    fi_policy_destroy(&pol);
    return failed ? 1 : 0;
}

/* ------------------------------------------------------------------ explain */

static void s_explain_one(const fi_policy *pol, const fi_cases *cs, size_t ci, bool verbose) {
    const fi_request *req = fi_cases_request(cs, ci);
    size_t nt;
    const char *const *names = fi_cases_targets(cs, ci, &nt);
    size_t n = names ? nt : fi_policy_target_count(pol);
    uint32_t *idx = calloc(n ? n : 1, sizeof *idx);
    fi_verdict *v = calloc(n ? n : 1, sizeof *v);
    if (!idx || !v) goto done;
    for (size_t i = 0; i < n; i++) {
        int t = names ? fi_policy_target_find(pol, names[i]) : (int)i;
        if (t < 0) {
            printf("unknown target \"%s\" (not in the policy)\n", names[i]);
            goto done;
        }
        idx[i] = (uint32_t)t;
    }
    if (fi_policy_decide(pol, req, idx, n, v)) {
        printf("the policy refused the candidate targets\n");
        goto done;
    }
    int best = fi_verdict_best(v, n);
    printf("request %s: origin %s, labels [", fi_cases_name(cs, ci), req->origin_site);
    for (size_t i = 0; i < req->n_labels; i++) printf("%s%s", i ? ", " : "", req->labels[i]);
    if (!req->n_labels && fi_policy_default_label(pol)) printf("(default) %s", fi_policy_default_label(pol));
    printf("]%s%s\n", req->model ? ", model " : "", req->model ? req->model : "");
    char line[700];
    for (size_t i = 0; i < n; i++) {
        fi_verdict_explain(pol, &v[i], NULL, line, sizeof line);
        printf("  %s %s\n", (int)i == best ? "->" : "  ", line);
        if (!verbose) continue;
        for (size_t r = 0; r < fi_policy_rule_count(pol); r++) {
            char tr[300];
            fi_policy_rule_trace(pol, req, idx[i], r, tr, sizeof tr);
            const char *kw = fi_policy_rule_effect(pol, r) == FI_FORBID ? "forbid"
                             : fi_policy_rule_effect(pol, r) == FI_PERMIT ? "permit" : "prefer";
            printf("         %s \"%s\": %s\n", kw, fi_policy_rule_id(pol, r), tr);
        }
    }
    printf("  chosen: %s\n", best >= 0 ? fi_policy_target_name(pol, idx[best]) : "none (denied everywhere)");
done:
    free(idx);
    free(v);
}

static int s_explain(int argc, char **argv) {
    if (s_help(argc, argv) || argc < 3) {
        printf("usage: fedctl policy explain FILE REQUEST... [-v]\n\n"
               "REQUEST is either key=value words:\n"
               "  origin=SITE labels=a,b model=M tenant=T application=A latency_ms=N\n"
               "  prompt_tokens=N targets=t1,t2 (default: every target)\n"
               "or a cases file, whose every case is explained.\n"
               "Prints one line per target: permitted or denied, and the rules that decided;\n"
               "-v adds each rule's result (true, false, or the error that blocked it).\n");
        return argc < 3 && !s_help(argc, argv) ? 2 : 0;
    }
    const char *const explain_flags[] = {"-v", NULL};
    if (s_options_ok(argc, argv, "policy explain", NULL, explain_flags)) return 2;
    bool verbose = s_flag(argc, argv, "-v");
    fi_policy *pol = s_load(argv[1], false);
    if (!pol) return 1;
    int rest = 0;
    char **words = calloc((size_t)argc, sizeof *words);
    if (!words) {
        fi_policy_destroy(&pol);
        return 1;
    }
    for (int i = 2; i < argc; i++)
        if (strcmp(argv[i], "-v")) words[rest++] = argv[i];
    fi_cases *cs = NULL;
    if (rest == 1 && !strchr(words[0], '=')) {
        fi_diags *d = fi_diags_new();
        cs = fi_cases_load(words[0], d);
        if (!cs) fi_diags_print(d, words[0], stderr);
        fi_diags_destroy(&d);
    } else {
        char err[300];
        cs = fi_cases_from_args(rest, words, err, sizeof err);
        if (!cs) fprintf(stderr, "fedctl policy explain: %s\n", err);
    }
    free(words);
    if (!cs) {
        fi_policy_destroy(&pol);
        return 2;
    }
    for (size_t i = 0; i < fi_cases_count(cs); i++) s_explain_one(pol, cs, i, verbose);
    if (!fi_policy_current(pol, time(NULL))) printf("note: this policy has expired; an edge would fail closed (origin site only)\n");
    fi_cases_destroy(&cs);
    fi_policy_destroy(&pol);
    return 0;
}

/* -------------------------------------------------------------------- flows */

static int s_flows(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy flows FILE [--all]\n\n"
               "Enumerates every (label set, origin site, target): all subsets of the declared\n"
               "labels, every site as origin, every site and cluster as target. Prints which\n"
               "single labels may flow from which site to which target, then every label set\n"
               "whose outcome is not what its single labels give. --all also prints every\n"
               "combination as tab-separated rows.\n");
        return 0;
    }
    const char *nv[] = {NULL}, *const flows_flags[] = {"--all", NULL};
    if (s_options_ok(argc, argv, "policy flows", nv, flows_flags)) return 2;
    const char *file = s_pos(argc, argv, 0, nv);
    if (!file) {
        fprintf(stderr, "usage: fedctl policy flows FILE [--all]\n");
        return 2;
    }
    fi_policy *pol = s_load(file, false);
    if (!pol) return 1;
    fi_policy_flows_print(pol, s_flag(argc, argv, "--all"), stdout);
    fi_policy_destroy(&pol);
    return 0;
}

/* --------------------------------------------------------------------- diff */

#define MAXU 64 /* names in the union of two policies' labels */

/* The flow in pol for a label set given by names, origin and target by
 * name; DENY when pol does not know one of them (it would fail closed). */
static fi_flow s_flow_by_name(const fi_policy *pol, const char *const *labels, uint32_t umask, size_t nl,
                              const char *origin, const char *target, char *why, size_t cap) {
    why[0] = 0;
    uint32_t mask = 0;
    for (size_t l = 0; l < nl; l++) {
        if (!(umask >> l & 1)) continue;
        int k = fi_policy_label_find(pol, labels[l]);
        if (k < 0) {
            snprintf(why, cap, "label %s unknown", labels[l]);
            return FI_FLOW_DENY;
        }
        mask |= 1u << k;
    }
    int o = -1;
    for (size_t i = 0; i < fi_policy_site_count(pol); i++)
        if (!strcmp(fi_policy_site_name(pol, i), origin)) o = (int)i;
    int t = fi_policy_target_find(pol, target);
    if (o < 0 || t < 0) {
        snprintf(why, cap, "%s unknown", o < 0 ? "origin" : "target");
        return FI_FLOW_DENY;
    }
    return fi_policy_flow(pol, mask, (size_t)o, (size_t)t, why, cap);
}

static void s_union_add(const char **v, size_t *n, const char *s) {
    for (size_t i = 0; i < *n; i++)
        if (!strcmp(v[i], s)) return;
    if (*n < 4096) v[(*n)++] = s;
}

int fi_policy_replay_record(const fi_audit_record *r, void *arg) {
    fi_policy_replay *rp = arg;
    rp->seen++;
    const char *labels[FI_POLICY_MAX_REQ_LABELS];
    char lb[1024];
    snprintf(lb, sizeof lb, "%s", r->labels);
    size_t nl = 0;
    for (char *save = NULL, *tok = strtok_r(lb, ",", &save); tok && nl < FI_POLICY_MAX_REQ_LABELS;
         tok = strtok_r(NULL, ",", &save))
        labels[nl++] = tok;
    fi_request req = {r->request_id, r->tenant[0] ? r->tenant : NULL, r->application[0] ? r->application : NULL,
                      r->origin, r->model[0] ? r->model : NULL, labels, nl, r->latency_ms, r->prompt_tokens};
    size_t n = fi_policy_target_count(rp->pol);
    fi_verdict *v = calloc(n ? n : 1, sizeof *v);
    if (!v) return 1;
    if (fi_policy_decide(rp->pol, &req, NULL, n, v)) {
        free(v);
        return 1;
    }
    int best = fi_verdict_best(v, n);
    const char *now = best >= 0 ? fi_policy_target_name(rp->pol, v[best].target) : "";
    bool was_permit = !strcmp(r->decision, "permit") || !strcmp(r->decision, "fallback");
    const char *was = was_permit ? r->target : "";
    if (strcmp(was, now)) {
        rp->changed++;
        char t[32], line[700] = "";
        fi_fmt_utc(r->time / 1000, t, sizeof t);
        int old_t = was[0] ? fi_policy_target_find(rp->pol, was) : -1;
        if (old_t >= 0) fi_verdict_explain(rp->pol, &v[old_t], NULL, line, sizeof line);
        else if (best >= 0) fi_verdict_explain(rp->pol, &v[best], NULL, line, sizeof line);
        printf("  %s request %s (origin %s, labels [%s]%s%s): %s -> %s%s%s\n", t, r->request_id, r->origin, r->labels,
               r->model[0] ? ", model " : "", r->model, was[0] ? was : "denied", now[0] ? now : "denied",
               line[0] ? "; " : "", line);
    }
    free(v);
    return 0;
}

/* Writes the labels of mask (joined by ",", "(no labels)" for none) into
 * buf. Labels may be 1023 bytes long, so the text may not fit: it is then
 * cut and ends with "...". cap is at least 4. */
static void s_label_set_text(const char *const *labels, size_t nl, uint32_t mask, char *buf, size_t cap) {
    size_t k = 0;
    buf[0] = 0;
    if (!mask) {
        snprintf(buf, cap, "(no labels)");
        return;
    }
    for (size_t l = 0; l < nl && k < cap; l++)
        if (mask >> l & 1) k += (size_t)snprintf(buf + k, cap - k, "%s%s", k ? "," : "", labels[l]);
    if (k >= cap) memcpy(buf + cap - 4, "...", 4);
}

int fi_policy_diff_flows(const fi_policy *op, const char *active_name, const fi_policy *np, const char *new_name) {
    const char *labels[MAXU], *sites[4096], *targets[4096];
    size_t nl = 0, ns = 0, nt = 0;
    const fi_policy *both[2] = {op, np};
    for (int p = 0; p < 2; p++) {
        for (size_t i = 0; i < fi_policy_label_count(both[p]); i++) {
            size_t before = nl;
            if (nl < MAXU) s_union_add(labels, &nl, fi_policy_label_name(both[p], i));
            (void)before;
        }
        for (size_t i = 0; i < fi_policy_site_count(both[p]); i++) s_union_add(sites, &ns, fi_policy_site_name(both[p], i));
        for (size_t i = 0; i < fi_policy_target_count(both[p]); i++)
            s_union_add(targets, &nt, fi_policy_target_name(both[p], i));
    }
    int rc = 0;
    const char *active = active_name, *file = new_name;
    if (nl > FI_POLICY_MAX_LABELS) {
        fprintf(stderr, "fedctl policy diff: the two policies declare %zu labels together; at most %d can be enumerated\n",
                nl, FI_POLICY_MAX_LABELS);
        return 1;
    }
    printf("flows of %s compared with the active %s (%u label sets x %zu origins x %zu targets):\n", file, active,
           1u << nl, ns, nt);
    size_t opened = 0, closed = 0, other = 0;
    static const char *w[] = {"no", "yes", "maybe"};
    for (uint32_t m = 0; m < (1u << nl); m++)
        for (size_t o = 0; o < ns; o++)
            for (size_t t = 0; t < nt; t++) {
                char wo[128], wn[128];
                fi_flow a = s_flow_by_name(op, labels, m, nl, sites[o], targets[t], wo, sizeof wo);
                fi_flow b = s_flow_by_name(np, labels, m, nl, sites[o], targets[t], wn, sizeof wn);
                if (a == b) continue;
                char ms[512];
                s_label_set_text(labels, nl, m, ms, sizeof ms);
                const char *kind = b == FI_FLOW_ALLOW || (b == FI_FLOW_MAYBE && a == FI_FLOW_DENY) ? "opens "
                                   : b == FI_FLOW_DENY || (b == FI_FLOW_MAYBE && a == FI_FLOW_ALLOW) ? "closes"
                                                                                                   : "changes";
                if (kind[0] == 'o') opened++;
                else if (kind[0] == 'c' && kind[1] == 'l') closed++;
                else other++;
                printf("  %c %s %s from %s to %s: %s -> %s%s%s%s\n", kind[0] == 'o' ? '+' : '-', kind, ms, sites[o],
                       targets[t], w[a], w[b], wn[0] ? " (" : "", wn, wn[0] ? ")" : "");
            }
    printf("%zu flow(s) opened, %zu closed, %zu otherwise changed\n", opened, closed, other);
    return rc;
}

static int s_diff(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy diff FILE (--active ACTIVE | --store DB) [--audit DB [--since T] [--until T]]\n\n"
               "Before applying FILE: the flows it opens or closes compared with the active\n"
               "policy (every label set, origin site and target of both), and, with --audit, a\n"
               "replay of the audited requests of the period [--since, --until) under FILE\n"
               "listing the decisions that would change. The active policy is the file ACTIVE,\n"
               "or the latest version in the operator-side store DB. Times: YYYY-MM-DD,\n"
               "YYYY-MM-DDTHH:MM:SSZ or Unix seconds.\n");
        return 0;
    }
    const char *with[] = {"--active", "--store", "--audit", "--since", "--until", NULL};
    if (s_options_ok(argc, argv, "policy diff", with, NULL)) return 2;
    bool bad = false;
    const char *file = s_pos(argc, argv, 0, with);
    const char *active = s_opt(argc, argv, "--active", NULL, &bad);
    const char *store = s_opt(argc, argv, "--store", NULL, &bad);
    const char *audit = s_opt(argc, argv, "--audit", NULL, &bad);
    const char *since = s_opt(argc, argv, "--since", NULL, &bad);
    const char *until = s_opt(argc, argv, "--until", NULL, &bad);
    if (bad || !file || !active == !store) {
        fprintf(stderr, "usage: fedctl policy diff FILE (--active ACTIVE | --store DB) [--audit DB [--since T] [--until T]]\n");
        return 2;
    }
    int64_t t0 = 0, t1 = 0;
    if (fi_policy_cmd_time_opt("policy diff", "--since", since, &t0) ||
        fi_policy_cmd_time_opt("policy diff", "--until", until, &t1))
        return 2;
    fi_policy *np = s_load(file, false), *op = NULL;
    char active_name[600];
    if (active) {
        op = s_load(active, false);
        snprintf(active_name, sizeof active_name, "%s", active);
    } else {
        char err[400], *content = NULL;
        size_t clen = 0;
        fi_pstore_version sv;
        fi_pstore *st = fi_pstore_open(store, err, sizeof err);
        int r = st ? fi_pstore_get(st, 0, &sv, &content, &clen, NULL, NULL, err, sizeof err) : -1;
        fi_pstore_destroy(&st);
        if (r) {
            fprintf(stderr, "fedctl policy diff: %s\n", r > 0 ? "the store holds no version yet" : err);
        } else {
            snprintf(active_name, sizeof active_name, "version %llu of %s", (unsigned long long)sv.version, store);
            op = s_load_text(content, clen, active_name);
        }
        free(content);
    }
    active = active_name;
    if (!np || !op) {
        fi_policy_destroy(&np);
        fi_policy_destroy(&op);
        return 1;
    }
    int rc = fi_policy_diff_flows(op, active, np, file);
    if (rc) goto done;
    if (audit) {
        char err[400];
        fi_audit *a = fi_audit_open_readonly(audit, err, sizeof err);
        if (!a) {
            fprintf(stderr, "fedctl policy diff: %s\n", err);
            rc = 1;
            goto done;
        }
        fi_audit_filter f = {0};
        f.since_ms = t0 * 1000;
        f.until_ms = t1 * 1000;
        fi_policy_replay rp = {np, 0, 0};
        printf("\nreplay of the audited requests%s%s%s%s under %s:\n", since ? " since " : "", since ? since : "",
               until ? " until " : "", until ? until : "", file);
        if (fi_audit_query(a, &f, fi_policy_replay_record, &rp, err, sizeof err)) {
            fprintf(stderr, "fedctl policy diff: %s\n", err);
            rc = 1;
        }
        printf("%zu audited request(s) replayed, %zu decision(s) would change\n", rp.seen, rp.changed);
        fi_audit_destroy(&a);
    }
done:
    fi_policy_destroy(&np);
    fi_policy_destroy(&op);
    return rc;
}

/* ------------------------------------------------------- store: apply etc. */

static const char *s_author(const char *given) {
    if (given) return given;
    const char *u = getenv("USER");
    return u && *u ? u : "unknown";
}

static int s_apply(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy apply FILE -m WHY --store DB --key KEYFILE [--author NAME]\n"
               "                          [--valid-days N] [--bundle-out FILE]\n\n"
               "Validates FILE (refused when it has errors), stores it as the next version in the\n"
               "operator-side store DB (the coordinator's SQLite store; created if absent) with\n"
               "author, time, content digest and the comment WHY, and signs its bundle with the\n"
               "policy-signing key KEYFILE (fedctl policy keygen). The bundle is valid from now\n"
               "for N days (default %d) or until the policy's `expires`, whichever is first;\n"
               "--bundle-out also writes it to FILE for shipping to edges.\n",
               DEFAULT_VALID_DAYS);
        return 0;
    }
    const char *with[] = {"-m",           "--message",    "--store",      "--key",
                          "--author",     "--valid-days", "--bundle-out", NULL};
    if (s_options_ok(argc, argv, "policy apply", with, NULL)) return 2;
    bool bad = false;
    const char *file = s_pos(argc, argv, 0, with);
    const char *why = s_opt(argc, argv, "-m", "--message", &bad);
    const char *store = s_opt(argc, argv, "--store", NULL, &bad);
    const char *key = s_opt(argc, argv, "--key", NULL, &bad);
    const char *author = s_opt(argc, argv, "--author", NULL, &bad);
    const char *days = s_opt(argc, argv, "--valid-days", NULL, &bad);
    const char *out = s_opt(argc, argv, "--bundle-out", NULL, &bad);
    if (bad || !file || !why || !store || !key) {
        fprintf(stderr, "usage: fedctl policy apply FILE -m WHY --store DB --key KEYFILE (see --help)\n");
        return 2;
    }
    long nd = days ? strtol(days, NULL, 10) : DEFAULT_VALID_DAYS;
    if (nd <= 0 || nd > 3650) {
        fprintf(stderr, "fedctl policy apply: --valid-days wants 1..3650\n");
        return 2;
    }
    size_t len;
    char *text = s_slurp(file, &len);
    if (!text) return 1;
    char err[800];
    uint8_t sk[FI_BUNDLE_SK_BYTES];
    int rc = 1;
    fi_pstore *s = NULL;
    if (fi_bundle_key_load(key, sk, err, sizeof err)) {
        fprintf(stderr, "fedctl policy apply: %s\n", err);
        goto done;
    }
    if (!(s = fi_pstore_open(store, err, sizeof err))) {
        fprintf(stderr, "fedctl policy apply: %s\n", err);
        goto done;
    }
    /* Show warnings, as check would. */
    fi_policy *pol = s_load(file, true);
    fi_policy_destroy(&pol);
    uint64_t v;
    if (fi_pstore_apply(s, text, len, s_author(author), why, sk, time(NULL), nd * 86400, &v, err, sizeof err)) {
        fprintf(stderr, "fedctl policy apply: %s\n", err);
        goto done;
    }
    fi_pstore_version sv;
    char *bundle = NULL;
    size_t blen = 0;
    if (fi_pstore_get(s, v, &sv, NULL, NULL, &bundle, &blen, err, sizeof err)) {
        fprintf(stderr, "fedctl policy apply: %s\n", err);
        goto done;
    }
    char na[32];
    fi_fmt_utc(sv.not_after, na, sizeof na);
    printf("applied %s as version %llu (digest %.16s), bundle valid until %s\n", file, (unsigned long long)v, sv.digest, na);
    if (out) {
        FILE *f = fopen(out, "wb");
        if (!f || fwrite(bundle, 1, blen, f) != blen || fclose(f)) {
            fprintf(stderr, "fedctl policy apply: cannot write %s: %s\n", out, strerror(errno));
            free(bundle);
            goto done;
        }
        printf("bundle written to %s\n", out);
    }
    free(bundle);
    rc = 0;
done:
    sodium_memzero(sk, sizeof sk);
    fi_pstore_destroy(&s);
    free(text);
    return rc;
}

static int s_history_row(const fi_pstore_version *v, void *arg) {
    (void)arg;
    char t[32];
    fi_fmt_utc(v->created, t, sizeof t);
    printf("%-7llu %-20s %-16s %.16s  %s\n", (unsigned long long)v->version, t, v->author, v->digest, v->comment);
    return 0;
}

static int s_history(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy history --store DB\n\n"
               "Lists every stored policy version of the operator-side store DB: version,\n"
               "time, author, content digest and comment.\n");
        return 0;
    }
    const char *const history_with[] = {"--store", NULL};
    if (s_options_ok(argc, argv, "policy history", history_with, NULL)) return 2;
    bool bad = false;
    const char *store = s_opt(argc, argv, "--store", NULL, &bad);
    if (bad || !store) {
        fprintf(stderr, "usage: fedctl policy history --store DB\n");
        return 2;
    }
    char err[400];
    fi_pstore *s = fi_pstore_open(store, err, sizeof err);
    if (!s) {
        fprintf(stderr, "fedctl policy history: %s\n", err);
        return 1;
    }
    printf("%-7s %-20s %-16s %-16s  %s\n", "version", "time", "author", "digest", "comment");
    int rc = fi_pstore_history(s, s_history_row, NULL, err, sizeof err);
    if (rc) fprintf(stderr, "fedctl policy history: %s\n", err);
    fi_pstore_destroy(&s);
    return rc ? 1 : 0;
}

static int s_rollback(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy rollback VERSION --store DB --key KEYFILE [-m WHY] [--author NAME]\n"
               "                             [--valid-days N]\n\n"
               "Stores a new version carrying the content of VERSION, signed anew: edges accept\n"
               "it because its version number is higher than any they hold.\n");
        return 0;
    }
    const char *with[] = {"-m", "--message", "--store", "--key", "--author", "--valid-days", NULL};
    if (s_options_ok(argc, argv, "policy rollback", with, NULL)) return 2;
    bool bad = false;
    const char *ver = s_pos(argc, argv, 0, with);
    const char *store = s_opt(argc, argv, "--store", NULL, &bad);
    const char *key = s_opt(argc, argv, "--key", NULL, &bad);
    const char *why = s_opt(argc, argv, "-m", "--message", &bad);
    const char *author = s_opt(argc, argv, "--author", NULL, &bad);
    const char *days = s_opt(argc, argv, "--valid-days", NULL, &bad);
    char *e = NULL;
    unsigned long long old = ver ? strtoull(ver, &e, 10) : 0;
    if (bad || !ver || *e || !old || !store || !key) {
        fprintf(stderr, "usage: fedctl policy rollback VERSION --store DB --key KEYFILE [-m WHY]\n");
        return 2;
    }
    long nd = days ? strtol(days, NULL, 10) : DEFAULT_VALID_DAYS;
    if (nd <= 0 || nd > 3650) {
        fprintf(stderr, "fedctl policy rollback: --valid-days wants 1..3650\n");
        return 2;
    }
    char err[800];
    uint8_t sk[FI_BUNDLE_SK_BYTES];
    if (fi_bundle_key_load(key, sk, err, sizeof err)) {
        fprintf(stderr, "fedctl policy rollback: %s\n", err);
        return 1;
    }
    fi_pstore *s = fi_pstore_open(store, err, sizeof err);
    if (!s) {
        sodium_memzero(sk, sizeof sk);
        fprintf(stderr, "fedctl policy rollback: %s\n", err);
        return 1;
    }
    uint64_t v;
    int rc = fi_pstore_rollback(s, old, s_author(author), why ? why : "", sk, time(NULL), nd * 86400, &v, err, sizeof err);
    sodium_memzero(sk, sizeof sk);
    if (rc) fprintf(stderr, "fedctl policy rollback: %s\n", err);
    else printf("version %llu restores the content of version %llu\n", (unsigned long long)v, old);
    fi_pstore_destroy(&s);
    return rc ? 1 : 0;
}

static int s_bundle(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy bundle --store DB [--version N] --out FILE [--content]\n\n"
               "Writes the signed bundle of version N (default: the latest) from the store DB to\n"
               "FILE; with --content, the policy text instead (for diff --active).\n");
        return 0;
    }
    const char *const bundle_with[] = {"--store", "--version", "--out", NULL},
                      *const bundle_flags[] = {"--content", NULL};
    if (s_options_ok(argc, argv, "policy bundle", bundle_with, bundle_flags)) return 2;
    bool bad = false;
    const char *store = s_opt(argc, argv, "--store", NULL, &bad);
    const char *ver = s_opt(argc, argv, "--version", NULL, &bad);
    const char *out = s_opt(argc, argv, "--out", NULL, &bad);
    if (bad || !store || !out) {
        fprintf(stderr, "usage: fedctl policy bundle --store DB [--version N] --out FILE [--content]\n");
        return 2;
    }
    uint64_t vn = 0;
    if (ver && fi_policy_cmd_version(ver, &vn) != 0) {
        fprintf(stderr, "fedctl policy bundle: --version wants a whole number >= 1, not '%s'\n", ver);
        return 2;
    }
    char err[400];
    fi_pstore *s = fi_pstore_open(store, err, sizeof err);
    if (!s) {
        fprintf(stderr, "fedctl policy bundle: %s\n", err);
        return 1;
    }
    char *content = NULL, *bundle = NULL;
    size_t clen = 0, blen = 0;
    fi_pstore_version sv;
    int r = fi_pstore_get(s, vn, &sv, &content, &clen, &bundle, &blen, err, sizeof err);
    fi_pstore_destroy(&s);
    if (r) {
        fprintf(stderr, "fedctl policy bundle: %s\n", r > 0 ? "no such version in the store" : err);
        return 1;
    }
    bool text = s_flag(argc, argv, "--content");
    FILE *f = fopen(out, "wb");
    size_t n = text ? clen : blen;
    int rc = 0;
    if (!f || fwrite(text ? content : bundle, 1, n, f) != n || fclose(f)) {
        fprintf(stderr, "fedctl policy bundle: cannot write %s: %s\n", out, strerror(errno));
        rc = 1;
    } else {
        printf("version %llu %s written to %s\n", (unsigned long long)sv.version, text ? "content" : "bundle", out);
    }
    free(content);
    free(bundle);
    return rc;
}

static int s_install(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy install BUNDLE --dir DIR --trust PUBKEY...\n\n"
               "Edge side: verifies BUNDLE (signature by a trusted key, digest, version newer than\n"
               "the one held in DIR, validity window, policy validates) and keeps it in DIR as the\n"
               "bundle to enforce. A refused bundle leaves the held one in place; exit status 1.\n");
        return 0;
    }
    const char *with[] = {"--dir", "--trust", NULL};
    if (s_options_ok(argc, argv, "policy install", with, NULL)) return 2;
    bool bad = false;
    const char *file = s_pos(argc, argv, 0, with);
    const char *dir = s_opt(argc, argv, "--dir", NULL, &bad);
    if (bad || !file || !dir) {
        fprintf(stderr, "usage: fedctl policy install BUNDLE --dir DIR --trust PUBKEY...\n");
        return 2;
    }
    uint8_t keys[16][FI_BUNDLE_PK_BYTES];
    size_t nk = 0;
    char err[600];
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--trust") && nk < 16) {
            if (fi_bundle_pub_load(argv[i + 1], keys[nk], err, sizeof err)) {
                fprintf(stderr, "fedctl policy install: %s\n", err);
                return 1;
            }
            nk++;
        }
    if (!nk) {
        fprintf(stderr, "fedctl policy install: give at least one --trust PUBKEY\n");
        return 2;
    }
    size_t len;
    char *buf = s_slurp(file, &len);
    if (!buf) return 1;
    err[0] = 0;
    fi_bundle_status st = fi_bundle_install(dir, buf, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])keys, nk, time(NULL),
                                            err, sizeof err);
    free(buf);
    if (st != FI_BUNDLE_OK) {
        fprintf(stderr, "fedctl policy install: %s: %s\n", file, err);
        return 1;
    }
    printf("installed %s into %s\n", file, dir);
    return 0;
}

static int s_keygen(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl policy keygen --out KEYFILE\n\n"
               "Makes a policy-signing key: KEYFILE (secret, mode 0600, never overwritten) and\n"
               "KEYFILE.pub (to install on edges as a trusted signer).\n");
        return 0;
    }
    const char *const keygen_with[] = {"--out", NULL};
    if (s_options_ok(argc, argv, "policy keygen", keygen_with, NULL)) return 2;
    bool bad = false;
    const char *out = s_opt(argc, argv, "--out", NULL, &bad);
    if (bad || !out) {
        fprintf(stderr, "usage: fedctl policy keygen --out KEYFILE\n");
        return 2;
    }
    uint8_t pk[FI_BUNDLE_PK_BYTES], sk[FI_BUNDLE_SK_BYTES];
    char err[400];
    if (fi_bundle_keygen(pk, sk) || fi_bundle_key_save(out, sk, err, sizeof err)) {
        sodium_memzero(sk, sizeof sk);
        fprintf(stderr, "fedctl policy keygen: %s\n", err);
        return 1;
    }
    sodium_memzero(sk, sizeof sk);
    printf("wrote %s and %s.pub\n", out, out);
    return 0;
}

/* ------------------------------------------------------------------ verbs */

typedef struct sub {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *summary;
} sub;

static const sub s_subs[] = {
    {"check", s_check, "validate a policy file; print errors and warnings"},
    {"test", s_test, "run a cases file against a policy; nonzero exit on a failing case"},
    {"explain", s_explain, "decide one request for every target and say why"},
    {"flows", s_flows, "the matrix of which labels may flow from which site to which target"},
    {"diff", s_diff, "flows opened/closed vs the active policy; replay of audited requests"},
    {"bench", fi_policy_bench_cmd, "decisions per second and latency for 1, 10 and 100 rules"},
    {"apply", s_apply, "store, sign and ship a new version (coordinator; offline: --store)"},
    {"history", s_history, "list the stored versions (coordinator; offline: --store)"},
    {"rollback", s_rollback, "a new version with an old version's content (coordinator; --store)"},
    {"bundle", s_bundle, "export a version's signed bundle or content (coordinator; --store)"},
    {"install", s_install, "edge side: verify a bundle and keep it as the one to enforce"},
    {"keygen", s_keygen, "make a policy-signing key pair"},
};

int fi_cmd_policy(int argc, char **argv) {
    size_t n = sizeof s_subs / sizeof s_subs[0];
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        FILE *f = argc < 2 ? stderr : stdout;
        fprintf(f, "usage: fedctl policy VERB [options]\n\nverbs:\n");
        for (size_t i = 0; i < n; i++) fprintf(f, "  %-9s %s\n", s_subs[i].name, s_subs[i].summary);
        fprintf(f, "\n`fedctl policy VERB --help` describes a verb. The language: policy/README.md.\n");
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < n; i++)
        if (!strcmp(argv[1], s_subs[i].name)) return s_subs[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "fedctl policy: unknown verb '%s' (fedctl policy --help lists them)\n", argv[1]);
    return 2;
}

/* -------------------------------------------------------------------- audit */

/* A Unix time in ms as "YYYY-MM-DDTHH:MM:SS.mmmZ" in buf. */
static void s_fmt_utc_ms(int64_t ms, char *buf, size_t cap) {
    char t[32];
    fi_fmt_utc(ms / 1000, t, sizeof t);
    size_t tl = strlen(t);
    if (tl && t[tl - 1] == 'Z') t[tl - 1] = '\0'; /* the fraction goes before the Z */
    snprintf(buf, cap, "%s.%03lldZ", t, (long long)(ms % 1000));
}

int fi_audit_print_row(const fi_audit_record *r, void *arg) {
    (void)arg;
    char t[48];
    s_fmt_utc_ms(r->time, t, sizeof t);
    printf("%-6lld %s %-14s %-16s %-20s %-8s %-16s %s\n", (long long)r->seq, t, r->request_id, r->origin, r->labels,
           r->decision, r->target[0] ? r->target : "-", r->rules);
    if (r->source && r->source[0]) { /* taken from another log: which, where in it, and when */
        s_fmt_utc_ms(r->received, t, sizeof t);
        printf("       from %s #%lld %s received %s\n", r->source, (long long)r->source_seq, r->source_hash, t);
    }
    return 0;
}

static int s_audit_verify(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl audit verify --db DB [--head HASH | --head SEQ:HASH]\n\n"
               "Walks the hash chain of the audit log DB; exit status 1 when a record was removed,\n"
               "edited or reordered. Prints the record count, the head hash and a checkpoint\n"
               "SEQ:HASH to keep elsewhere; with --head HASH, also fails when the head differs\n"
               "from HASH (records cut off the end); with --head SEQ:HASH, when record SEQ is gone\n"
               "or no longer has HASH (a log that has grown since passes).\n");
        return 0;
    }
    const char *const verify_with[] = {"--db", "--head", NULL};
    if (s_options_ok(argc, argv, "audit verify", verify_with, NULL)) return 2;
    bool bad = false;
    const char *db = s_opt(argc, argv, "--db", NULL, &bad);
    const char *head = s_opt(argc, argv, "--head", NULL, &bad);
    if (bad || !db) {
        fprintf(stderr, "usage: fedctl audit verify --db DB [--head HASH | --head SEQ:HASH]\n");
        return 2;
    }
    char err[400];
    fi_audit *a = fi_audit_open_readonly(db, err, sizeof err);
    if (!a) {
        fprintf(stderr, "fedctl audit verify: %s\n", err);
        return 1;
    }
    fi_audit_check ck;
    fi_audit_point pt;
    int at = head && fi_audit_point_parse(head, &pt) == 0;
    int r = fi_audit_verify(a, &ck, err, sizeof err);
    if (r == 0 && at) {
        fi_audit_filter f = {.after_seq = pt.seq - 1};
        if (fi_audit_query(a, &f, fi_audit_point_row, &pt, err, sizeof err) != 0) r = -1;
    }
    fi_audit_destroy(&a);
    if (r < 0) {
        fprintf(stderr, "fedctl audit verify: %s\n", err);
        return 1;
    }
    if (r > 0) {
        printf("%s: BROKEN: %s\n", db, ck.what);
        return 1;
    }
    if (at && fi_audit_point_check(&pt, ck.records, err, sizeof err)) {
        printf("%s: chain intact over %lld records but %s\n", db, (long long)ck.records, err);
        return 1;
    }
    if (head && !at && strcmp(head, ck.head)) {
        printf("%s: chain intact over %lld records but its head %s differs from the expected %s (records cut off?)\n",
               db, (long long)ck.records, ck.head, head);
        return 1;
    }
    printf("%s: intact: %lld records, head %s; %lld witness(es) hold\n", db, (long long)ck.records,
           ck.head[0] ? ck.head : "(empty)", (long long)ck.witnesses);
    if (ck.records) printf("checkpoint %lld:%s\n", (long long)ck.records, ck.head);
    return 0;
}

/* One line per witness (fedctl audit witnesses); counts the failing. */
static int s_witness_row(const fi_audit_witness *w, int holds, const char *why, void *arg) {
    int *failing = arg;
    char when[32] = "?";
    if (w->reported > 0) fi_fmt_utc(w->reported / 1000, when, sizeof when);
    printf("%-34s %-16s %-8lld %.16s... %-20s %s%s\n", w->who, w->site[0] ? w->site : "-", (long long)w->seq, w->hash,
           when, holds ? "holds" : "FAILS: ", holds ? "" : why);
    if (!holds) (*failing)++;
    return 0;
}

static int s_audit_witnesses(int argc, char **argv) {
    if (s_help(argc, argv)) {
        printf("usage: fedctl audit witnesses --db DB [--forget WHO | --forget-all]\n\n"
               "Lists the witnesses of the audit log DB (the coordinator's): per edge, the\n"
               "newest head of the log it said it was told, and whether the log still holds\n"
               "that record with that hash; exit status 1 when one does not (records cut off\n"
               "the end, or the log rewritten). A witness the log does not hold stays until it\n"
               "is forgotten: after the log was replaced on purpose, reset the edges first\n"
               "(fedinfer edge witness --reset, agents stopped: a running edge says its\n"
               "witness again), then --forget WHO (a key fingerprint) or --forget-all.\n");
        return 0;
    }
    const char *const with[] = {"--db", "--forget", NULL};
    const char *const flags[] = {"--forget-all", NULL};
    if (s_options_ok(argc, argv, "audit witnesses", with, flags)) return 2;
    bool bad = false;
    const char *db = s_opt(argc, argv, "--db", NULL, &bad);
    const char *who = s_opt(argc, argv, "--forget", NULL, &bad);
    bool all = s_flag(argc, argv, "--forget-all");
    if (bad || !db || (who && all) || s_pos(argc, argv, 0, with)) {
        fprintf(stderr, "usage: fedctl audit witnesses --db DB [--forget WHO | --forget-all]\n");
        return 2;
    }
    char err[400];
    fi_audit *a = who || all ? fi_audit_open(db, err, sizeof err) : fi_audit_open_readonly(db, err, sizeof err);
    if (!a) {
        fprintf(stderr, "fedctl audit witnesses: %s\n", err);
        return 1;
    }
    int rc = 0;
    if (who || all) {
        int64_t n = 0;
        if (fi_audit_witness_forget(a, all ? NULL : who, &n, err, sizeof err) != 0) {
            fprintf(stderr, "fedctl audit witnesses: %s\n", err);
            rc = 1;
        } else if (who && n == 0) {
            fprintf(stderr, "fedctl audit witnesses: %s keeps no witness %s\n", db, who);
            rc = 1;
        } else {
            printf("%s: forgot %lld witness(es)\n", db, (long long)n);
        }
    } else {
        int failing = 0;
        printf("%-34s %-16s %-8s %-19s %-20s %s\n", "witness", "site", "record", "hash", "reported", "state");
        if (fi_audit_witness_each(a, s_witness_row, &failing, err, sizeof err) != 0) {
            fprintf(stderr, "fedctl audit witnesses: %s\n", err);
            rc = 1;
        } else if (failing) {
            rc = 1;
        }
    }
    fi_audit_destroy(&a);
    return rc;
}

int fi_cmd_audit(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "verify")) return s_audit_verify(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "witnesses")) return s_audit_witnesses(argc - 1, argv + 1);
    if (s_help(argc, argv)) {
        printf("usage: fedctl audit --db DB [--since T] [--until T] [--origin|--site SITE] [--label L]\n"
               "                    [--target T] [--decision permit|deny|fallback] [--request ID]\n"
               "                    [--rule ID] [--limit N]\n"
               "       fedctl audit verify --db DB [--head HASH | --head SEQ:HASH]\n"
               "       fedctl audit witnesses --db DB [--forget WHO | --forget-all]\n\n"
               "Lists the decisions recorded in the audit log DB (an edge's or the coordinator's),\n"
               "oldest first (with --limit, the newest N). Times: YYYY-MM-DD,\n"
               "YYYY-MM-DDTHH:MM:SSZ or Unix seconds.\n");
        return 0;
    }
    const char *const audit_with[] = {"--db",       "--since",   "--until",   "--limit",
                                      "--origin",   "--site",    "--label",   "--target",
                                      "--decision", "--request", "--rule",    NULL};
    if (s_options_ok(argc, argv, "audit", audit_with, NULL)) return 2;
    bool bad = false;
    const char *db = s_opt(argc, argv, "--db", NULL, &bad);
    const char *since = s_opt(argc, argv, "--since", NULL, &bad);
    const char *until = s_opt(argc, argv, "--until", NULL, &bad);
    const char *limit = s_opt(argc, argv, "--limit", NULL, &bad);
    fi_audit_filter f = {0};
    f.origin = s_opt(argc, argv, "--origin", "--site", &bad); /* --site: as online */
    f.label = s_opt(argc, argv, "--label", NULL, &bad);
    f.target = s_opt(argc, argv, "--target", NULL, &bad);
    f.decision = s_opt(argc, argv, "--decision", NULL, &bad);
    f.request_id = s_opt(argc, argv, "--request", NULL, &bad);
    f.rule = s_opt(argc, argv, "--rule", NULL, &bad);
    if (bad || !db) {
        fprintf(stderr, "usage: fedctl audit --db DB [filters] (see --help)\n");
        return 2;
    }
    int64_t t0 = 0, t1 = 0;
    uint64_t lim = 0;
    if (fi_policy_cmd_time_opt("audit", "--since", since, &t0) ||
        fi_policy_cmd_time_opt("audit", "--until", until, &t1) ||
        fi_policy_cmd_limit("audit", limit, FI_POLICY_CMD_LIMIT_MAX, &lim))
        return 2;
    f.since_ms = t0 * 1000;
    f.until_ms = t1 * 1000;
    f.limit = (size_t)lim;
    char err[400];
    fi_audit *a = fi_audit_open_readonly(db, err, sizeof err);
    if (!a) {
        fprintf(stderr, "fedctl audit: %s\n", err);
        return 1;
    }
    printf("%-6s %-24s %-14s %-16s %-20s %-8s %-16s %s\n", "seq", "time", "request", "origin", "labels", "decision",
           "target", "rules");
    int rc = fi_audit_query(a, &f, fi_audit_print_row, NULL, err, sizeof err);
    if (rc) fprintf(stderr, "fedctl audit: %s\n", err);
    fi_audit_destroy(&a);
    return rc ? 1 : 0;
}
