/*
 * fi_coord_route.c - the coordinator's scoring of permitted workers. See
 * fi_coord_route.h.
 */
#include "fi_coord_route.h"

#include "fi_sched.h"

double fi_route_load(const fi_route_cand *c) {
    uint64_t busy = (uint64_t)c->running + c->queued; /* reported counts: no wrap */
    if (busy < c->in_flight) busy = c->in_flight;
    return c->capacity ? (double)busy / (double)c->capacity : 1e9;
}

int fi_route_pick(const fi_route_cand *c, int n, const uint64_t *h, int nh, int *hit) {
    int best = -1, best_hit = 0;
    for (int i = 0; i < n; i++) {
        int k = c[i].filter && nh > 0 ? fi_prefix_filter_match(c[i].filter, c[i].filter_len, h, nh)
                                      : 0;
        if (k < 0) k = 0;
        int better = best < 0;
        if (!better && k != best_hit) better = k > best_hit;
        else if (!better && c[i].affinity != c[best].affinity) better = c[i].affinity;
        else if (!better) {
            double li = fi_route_load(&c[i]), lb = fi_route_load(&c[best]);
            if (li != lb) better = li < lb;
            else better = c[i].pref > c[best].pref;
        }
        if (better) {
            best = i;
            best_hit = k;
        }
    }
    if (hit) *hit = best < 0 ? 0 : best_hit;
    return best;
}
