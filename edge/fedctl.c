/*
 * fedctl.c - main of `fedctl`, the central console: dispatches to the verb
 * named by the first argument. Each verb lives with the folder that owns
 * it (policy: policy, audit; fabric: status, enrol, revoke, ...) and answers
 * --help itself.
 */
#include <stdio.h>
#include <string.h>
#include "fi_policy_cmd.h"

#include "fi_fabric_cmd.h"

typedef struct verb {
    const char *name;                 /* first argument */
    int (*fn)(int argc, char **argv); /* runs it; returns the exit status */
    const char *summary;              /* one line for --help */
} verb;

/* Verbs are added here as their folders provide them. */
static const verb s_verbs[] = {
    {"policy", fi_ctl_policy, "author, test, explain, diff, sign and ship residency policies"},
    {"audit", fi_ctl_audit, "list and verify the coordinator's hash-chained decision audit log"},
    {"status", fi_ctl_status, "list sites, edges and clusters with their health"},
    {"enrol", fi_ctl_enrol, "create a one-time enrolment token"},
    {"join", fi_ctl_join, "enrol this configuration's key as an operator, with a token"},
    {"revoke", fi_ctl_revoke, "revoke a peer's key and cut it off"},
    {"token", fi_ctl_token, "add, list and revoke the application bearer tokens of edges"},
    {NULL, NULL, NULL},
};

static void s_usage(FILE *f) {
    fprintf(f, "usage: fedctl VERB [options]\n\nverbs:\n");
    for (size_t i = 0; s_verbs[i].name; i++)
        fprintf(f, "  %-10s %s\n", s_verbs[i].name, s_verbs[i].summary);
    fprintf(f, "\n`fedctl VERB --help` describes a verb's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        s_usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        s_usage(stdout);
        return 0;
    }
    for (size_t i = 0; s_verbs[i].name; i++)
        if (!strcmp(argv[1], s_verbs[i].name)) return s_verbs[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "fedctl: unknown verb '%s'\n", argv[1]);
    s_usage(stderr);
    return 2;
}
