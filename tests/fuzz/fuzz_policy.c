/*
 * fuzz_policy.c - libFuzzer target for the policy parser, validator,
 * compiler and evaluator, and the cases parser: any input must be either
 * refused with diagnostics or built into a policy that decides, explains
 * and analyses without crashing, and the compiled evaluator must agree with
 * the reference one. Built with clang only (tests/policy.cmake).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fi_cases.h"
#include "fi_policy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fi_diags *d = fi_diags_new();
    fi_policy *p = fi_policy_parse((const char *)data, size, d);
    char line[800];
    for (size_t i = 0; i < fi_diags_count(d); i++) fi_diag_format(fi_diags_get(d, i), "fuzz", line, sizeof line);
    if (p) {
        size_t n = fi_policy_target_count(p);
        if (n <= 256 && fi_policy_site_count(p)) {
            fi_verdict *a = calloc(n + 1, sizeof *a), *b = calloc(n + 1, sizeof *b);
            const char *labels[2] = {fi_policy_label_count(p) ? fi_policy_label_name(p, 0) : "x", "y"};
            fi_request r = {"f", "t", "a", fi_policy_site_name(p, 0), "m", labels, fi_policy_label_count(p) ? 1 : 0, 5, 6};
            if (a && b && !fi_policy_decide(p, &r, NULL, n, a) && !fi_policy_decide_slow(p, &r, NULL, n, b)) {
                for (size_t i = 0; i < n; i++) {
                    if (a[i].permitted != b[i].permitted || a[i].score != b[i].score || a[i].n_rules != b[i].n_rules)
                        abort();
                    fi_verdict_explain(p, &a[i], NULL, line, sizeof line);
                    if (i < 4 && fi_policy_rule_count(p))
                        fi_policy_rule_trace(p, &r, (uint32_t)i, 0, line, sizeof line);
                    (void)fi_policy_flow(p, 1, 0, i, line, sizeof line);
                }
            }
            free(a);
            free(b);
        }
        fi_policy_destroy(&p);
    }
    fi_diags_destroy(&d);
    d = fi_diags_new();
    fi_cases *cs = fi_cases_parse((const char *)data, size, d);
    fi_cases_destroy(&cs);
    fi_diags_destroy(&d);
    return 0;
}
