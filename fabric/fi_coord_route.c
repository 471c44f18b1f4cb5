/*
 * fi_coord_route.c - the coordinator's scoring of permitted workers. See
 * fi_coord_route.h.
 */
#include "fi_coord_route.h"

#include <string.h>

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

uint32_t fi_route_filter_ones(const uint8_t *filter, size_t len) {
    uint32_t ones = 0;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, filter + i, sizeof w);
        ones += (uint32_t)__builtin_popcountll(w);
    }
    for (; i < len; i++) ones += (uint32_t)__builtin_popcount(filter[i]);
    return ones;
}

int fi_route_false_run(uint32_t ones, size_t len, int nh) {
    if (!len || nh <= 0) return 0;
    double fill = (double)ones / ((double)len * 8.0), fp = 1.0;
    for (int i = 0; i < FI_PREFIX_FILTER_PROBES; i++) fp *= fill;
    /* r = how many k >= 1 have fp^k > 1/odds (bounded by nh: a full
     * filter, fp = 1, matches every prompt to its end) */
    int r = 0;
    for (double q = fp; r < nh && q * FI_ROUTE_FALSE_RUN_ODDS > 1.0; q *= fp) r++;
    return r;
}

/* The credible hit of candidate c for h: its filter's match less the run
 * its fill explains by chance (fi_coord_route.h, 1). */
static int s_hit(const fi_route_cand *c, const uint64_t *h, int nh) {
    if (!c->filter || nh <= 0) return 0;
    int k = fi_prefix_filter_match(c->filter, c->filter_len, h, nh);
    if (k <= 0) return 0;
    uint32_t ones = c->filter_ones ? c->filter_ones : fi_route_filter_ones(c->filter, c->filter_len);
    int r = fi_route_false_run(ones, c->filter_len, nh);
    return k > r ? k - r : 0;
}

int fi_route_pick(const fi_route_cand *c, int n, const uint64_t *h, int nh, uint64_t key, int *hit) {
    int best = -1, best_hit = 0;
    for (int i = 0; i < n; i++) {
        int k = s_hit(&c[i], h, nh);
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
