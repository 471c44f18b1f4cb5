/*
 * fi_cmd.h - the engine's commands of the `fedinfer` binary.
 *
 * Each takes the arguments after the command name (argv[0] is the command
 * name) and returns the process exit status: 0 success, 1 failure, 2 bad
 * usage. Each answers --help.
 */
#ifndef FI_CMD_H
#define FI_CMD_H

#ifdef __cplusplus
extern "C" {
#endif

int fi_cmd_run(int argc, char **argv);     /* fedinfer run     */
int fi_cmd_bench(int argc, char **argv);   /* fedinfer bench   */
int fi_cmd_bench_serve(int argc, char **argv); /* fedinfer bench --serve */
int fi_cmd_inspect(int argc, char **argv); /* fedinfer inspect */

/* The model path used when -m is not given: $FEDINFER_MODEL, else the
 * set-up script's download. */
const char *fi_default_model_path(void);

#include "fi_kernels.h"
/* Parses "auto", "portable" or "avx2"; prints an error and returns -1 for
 * anything else. */
int fi_parse_simd(const char *s, fi_simd *out);

#ifdef __cplusplus
}
#endif
#endif /* FI_CMD_H */
