/*
 * logit_rank.c - see logit_rank.h.
 */
#include "logit_rank.h"

int logit_argmax_gap(const float *x, int n, float *gap) {
    int best = 0, second = -1;
    for (int i = 1; i < n; i++) {
        if (x[i] > x[best]) {
            second = best;
            best = i;
        } else if (second < 0 || x[i] > x[second]) {
            second = i;
        }
    }
    if (gap)
        *gap = second < 0 ? 0.0f : x[best] - x[second];
    return best;
}
