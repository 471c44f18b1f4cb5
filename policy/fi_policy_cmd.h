/*
 * fi_policy_cmd.h - the console verbs of the policy folder, for `fedctl`:
 *   fedctl policy check | test | explain | flows | diff | bench | apply |
 *                 history | rollback | bundle | install | keygen ...
 *   fedctl audit [filters] | audit verify
 *
 * Each takes the arguments from its verb on (argv[0] is "policy" or
 * "audit") and returns the exit status: 0 success, 1 failure (a failing
 * check or case, a refused bundle, a broken audit chain), 2 bad usage.
 * Each answers --help, as does every sub-verb.
 *
 * Here, apply, history, rollback and bundle work on a local store named
 * with --store FILE and audit on a log named with --db FILE: the offline
 * tools. fedctl sends these verbs to the coordinator instead when those
 * options are absent (fabric/fi_ctl_policy.c: fi_ctl_policy, fi_ctl_audit).
 */
#ifndef FI_POLICY_CMD_H
#define FI_POLICY_CMD_H

#include <stddef.h>
#include <stdint.h>

#include "fi_audit.h"

#ifdef __cplusplus
extern "C" {
#endif

int fi_cmd_policy(int argc, char **argv); /* fedctl policy ... */
int fi_cmd_audit(int argc, char **argv);  /* fedctl audit ...  */

/* `fedctl policy bench` (policy_bench.c). */
int fi_policy_bench_cmd(int argc, char **argv);
/* Writes the benchmark's generated policy of nrules rules (shapes in
 * policy_bench.c) into buf; returns its length, or -1 when cap is short. */
int fi_policy_bench_text(unsigned nrules, char *buf, size_t cap);

/* Pieces of `fedctl policy diff`, shared with the fabric's console verbs
 * (fabric/fi_ctl_policy.c), which fetch the active policy and the audited
 * requests from the coordinator. */

/* Prints the flows new_pol opens or closes compared with active (every
 * label set, origin site and target of both). 0, or 1 when the two
 * declare too many labels together to enumerate. */
int fi_policy_diff_flows(const fi_policy *active, const char *active_name, const fi_policy *new_pol,
                         const char *new_name);

/* Replays audited requests under pol; each decision that would change is
 * printed. Use fi_policy_replay_record as an fi_audit_query callback or
 * call it per record. */
typedef struct fi_policy_replay {
    const fi_policy *pol; /* the new policy */
    size_t seen;          /* records replayed */
    size_t changed;       /* decisions that would change */
} fi_policy_replay;
int fi_policy_replay_record(const fi_audit_record *r, void *arg);

/* The largest time fi_policy_cmd_time takes, in Unix seconds: its value
 * in milliseconds still fits in an int64_t. */
#define FI_POLICY_CMD_TIME_MAX (INT64_MAX / 1000)

/* Parses "YYYY-MM-DDTHH:MM:SSZ", "YYYY-MM-DD" or Unix seconds; -1 if bad,
 * including seconds above FI_POLICY_CMD_TIME_MAX (whose milliseconds, as
 * the audit filters use them, would overflow). */
int64_t fi_policy_cmd_time(const char *s);
/* The value v of option opt ("--since") of fedctl's command cmd ("audit")
 * into *t by fi_policy_cmd_time: 0 (and *t untouched when v is NULL), or
 * -1 after a message on stderr naming the option, the value and the forms
 * and range taken. */
int fi_policy_cmd_time_opt(const char *cmd, const char *opt, const char *v, int64_t *t);

/* The most records a --limit asks for (the online audit's bound too). */
#define FI_POLICY_CMD_LIMIT_MAX 1000000
/* --limit's value v into *n (0..max; 0: no limit): 0 (and *n untouched
 * when v is NULL), or -1 after a message naming the value and the range. */
int fi_policy_cmd_limit(const char *cmd, const char *v, uint64_t max, uint64_t *n);

/* Parses a policy version given on the command line: a whole number >= 1,
 * all of it ("x", "2x", "-1", "" and "0" are refused, never taken as "the
 * latest"). 0, or -1 if bad. */
int fi_policy_cmd_version(const char *s, uint64_t *v);

/* Shared with the fabric's console verbs: a Unix time as
 * "YYYY-MM-DDTHH:MM:SSZ" (UTC) in buf, and one audit record printed as a
 * row of `fedctl audit` (an fi_audit_query callback; arg unused); a record
 * taken from another log gets a second, indented line with its provenance
 * ("from SOURCE #SEQ HASH received TIME"). */
void fi_fmt_utc(int64_t t, char *buf, size_t cap);
int fi_audit_print_row(const fi_audit_record *r, void *arg);

#ifdef __cplusplus
}
#endif
#endif /* FI_POLICY_CMD_H */
