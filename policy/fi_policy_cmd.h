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
 * apply, history, rollback and bundle work on the operator-side store
 * named with --store FILE (the coordinator's SQLite store, opened directly
 * until the fabric carries these verbs to the coordinator); audit reads the
 * log named with --db FILE.
 */
#ifndef FI_POLICY_CMD_H
#define FI_POLICY_CMD_H

#include <stddef.h>

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

#ifdef __cplusplus
}
#endif
#endif /* FI_POLICY_CMD_H */
