/*
 * fi_fabric_cmd.h - the fabric's commands of `fedinfer` and verbs of
 * `fedctl`. Each takes the arguments after the command name (argv[0] is
 * the name) and returns the exit status: 0 success, 1 failure, 2 bad
 * usage. Each answers --help.
 */
#ifndef FI_FABRIC_CMD_H
#define FI_FABRIC_CMD_H

#ifdef __cplusplus
extern "C" {
#endif

int fi_cmd_keygen(int argc, char **argv);      /* fedinfer keygen      */
int fi_cmd_coordinator(int argc, char **argv); /* fedinfer coordinator */
int fi_cmd_shard(int argc, char **argv);       /* fedinfer shard       */

int fi_ctl_status(int argc, char **argv); /* fedctl status */
int fi_ctl_enrol(int argc, char **argv);  /* fedctl enrol  */
int fi_ctl_revoke(int argc, char **argv); /* fedctl revoke */

#ifdef __cplusplus
}
#endif
#endif /* FI_FABRIC_CMD_H */
