/*
 * fi_fabric_cmd.h - the fabric's commands of `fedinfer` and verbs of
 * `fedctl`. Each takes the arguments after the command name (argv[0] is
 * the name) and returns the exit status: 0 success, 1 failure, 2 bad
 * usage. Each answers --help.
 */
#ifndef FI_FABRIC_CMD_H
#define FI_FABRIC_CMD_H

#include "fi_client.h"

#ifdef __cplusplus
extern "C" {
#endif

int fi_cmd_keygen(int argc, char **argv);      /* fedinfer keygen      */
int fi_cmd_coordinator(int argc, char **argv); /* fedinfer coordinator */
int fi_cmd_shard(int argc, char **argv);       /* fedinfer shard       */

int fi_ctl_status(int argc, char **argv); /* fedctl status */
int fi_ctl_enrol(int argc, char **argv);  /* fedctl enrol  */
int fi_ctl_revoke(int argc, char **argv); /* fedctl revoke */
int fi_ctl_join(int argc, char **argv);   /* fedctl join   */
int fi_ctl_token(int argc, char **argv);  /* fedctl token: edges' application tokens */

/* fedctl policy / fedctl audit: the verbs that change or read the fleet's
 * policy and audit log go to the coordinator (fi_ctl_policy.c); the rest,
 * and the offline modes (--store FILE, --db FILE), are policy/'s
 * fi_cmd_policy / fi_cmd_audit. */
int fi_ctl_policy(int argc, char **argv); /* fedctl policy */
int fi_ctl_audit(int argc, char **argv);  /* fedctl audit  */

/* The console's connection to the coordinator, as an operator, from the
 * configuration file config (NULL: $FEDCTL_CONFIG): coordinator,
 * coordinator_key, secret_key [, timeout_ms]. Returns an opaque
 * fi_client (fi_client.h), or NULL with a message printed as
 * "fedctl VERB: ...". */
fi_client *fi_ctl_connect(const char *verb, const char *config);
/* Sends m and waits for a reply of type want; an Error reply is printed
 * and NULL returned (as on a timeout). *code (may be NULL) gets the
 * error's code, ERR_UNSPECIFIED otherwise. */
fi_msg *fi_ctl_call(const char *verb, fi_client *c, const fi_msg *m, int want, int *code);
/* fi_ctl_call waits FI_CTL_WAIT_MS; this one wait_ms (audit verify: the
 * coordinator walks the whole log on its verify thread, seconds for a
 * few million records). */
#define FI_CTL_WAIT_MS 10000
#define FI_CTL_VERIFY_WAIT_MS 300000
fi_msg *fi_ctl_call_wait(const char *verb, fi_client *c, const fi_msg *m, int want, int *code, int wait_ms);

#ifdef __cplusplus
}
#endif
#endif /* FI_FABRIC_CMD_H */
