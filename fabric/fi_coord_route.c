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

uint64_t fi_route_key(const uint64_t *h, int nh, uint64_t fallback) {
    if (!h || nh <= 0) return fallback;
    return h[(nh < FI_ROUTE_KEY_BLOCKS ? nh : FI_ROUTE_KEY_BLOCKS) - 1];
}

/* Rendezvous weight of candidate id for key (splitmix64's finaliser). */
static uint64_t s_weight(uint64_t key, uint64_t id) {
    uint64_t z = key ^ (id * 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

int fi_route_pick(const fi_route_cand *c, int n, const uint64_t *h, int nh, uint64_t key, int *hit) {
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
            else if (c[i].pref != c[best].pref) better = c[i].pref > c[best].pref;
            else better = s_weight(key, c[i].id) > s_weight(key, c[best].id);
        }
        if (better) {
            best = i;
            best_hit = k;
        }
    }
    if (hit) *hit = best < 0 ? 0 : best_hit;
    return best;
}
