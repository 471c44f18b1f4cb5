/*
 * fi_cases.h - test cases for a policy: requests with their expected
 * decisions, read from a cases file and run against a policy
 * (`fedctl policy test FILE CASES`).
 *
 * A cases file holds blocks like this one (the format is in
 * policy/README.md, "Cases files"):
 *
 *   case "phi stays at berlin" {
 *       origin = "berlin-clinic";
 *       labels = ["phi"];
 *       model = "smollm2-135m";           # also tenant, application,
 *       latency_ms = 200;                  # prompt_tokens
 *       targets = ["berlin-clinic", "fra-gpu-1"];  # default: every target
 *       expect permitted = ["berlin-clinic"];
 *       expect chosen = "berlin-clinic";   # or: expect chosen = none;
 *       expect denied "fra-gpu-1" by "phi stays on site";
 *       expect denied "x" by default;      # no permit matched
 *       expect score "berlin-clinic" = 20;
 *   }
 */
#ifndef FI_CASES_H
#define FI_CASES_H

#include "fi_policy.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_cases fi_cases;

/* Parses a cases file. Returns an owned list, or NULL with diagnostics
 * (file positions, what was expected, a hint) in diags. */
fi_cases *fi_cases_load(const char *path, fi_diags *diags) FI_WUR;
fi_cases *fi_cases_parse(const char *text, size_t len, fi_diags *diags) FI_WUR;
void fi_cases_destroy(fi_cases **self_p);

size_t fi_cases_count(const fi_cases *self);
/* Name and request of case i; owned by the list. */
const char *fi_cases_name(const fi_cases *self, size_t i);
const fi_request *fi_cases_request(const fi_cases *self, size_t i);
/* Candidate target names of case i (*n of them), or NULL for "every
 * target"; owned by the list. */
const char *const *fi_cases_targets(const fi_cases *self, size_t i, size_t *n);

/* Runs every case against the policy, writing a readable report to out
 * (NULL: none): one line per case, and for a failing case each expectation
 * that failed with the decision's explanation. Returns the number of
 * failing cases (0 when all pass). */
size_t fi_cases_run(const fi_cases *self, const fi_policy *pol, FILE *out);

/* Parses a request from "key=value" words (origin=, labels=a,b, model=,
 * tenant=, application=, latency_ms=, prompt_tokens=) into an owned
 * one-case list. Returns NULL and writes a message to err on bad input. */
fi_cases *fi_cases_from_args(int argc, char **argv, char *err, size_t err_cap) FI_WUR;

#ifdef __cplusplus
}
#endif
#endif /* FI_CASES_H */
