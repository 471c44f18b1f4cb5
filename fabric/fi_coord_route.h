/*
 * fi_coord_route.h - the coordinator's choice among the workers a routed
 * request may go to (issue 6).
 *
 * The caller passes only candidates the residency policy permits (the
 * coordinator's own re-check runs first, fi_coord.c): nothing here can
 * widen the set, it only orders it. Among them, in this order:
 *   1. the expected prefix-cache hit: how many leading blocks of the
 *      request's prompt (its fi_prefix_hashes) the worker's reported
 *      Bloom filter holds (fi_prefix_filter_match), less the run that a
 *      filter this full shows for a prompt it does not hold, more is
 *      better. A filter with a fraction `fill` of its bits set answers a
 *      hash it does not hold with probability fp = fill^3 (its 3 probes),
 *      so a cold prompt matches k leading blocks with probability fp^k;
 *      the runs it reaches with odds above 1 in FI_ROUTE_FALSE_RUN_ODDS
 *      (r blocks: fp^r > 1/odds) are not counted, and a match of k counts
 *      as k - r. A sized filter (fi_prefix_filter_bytes) stays under 2%
 *      false and loses nothing; a saturated one (a small filter over a
 *      large pool: every cold prompt "hit", and since the hit outranks
 *      load, a busy worker took cold traffic from idle ones) counts only
 *      a run longer than chance explains, and a full one nothing;
 *   2. conversation affinity: the worker that served this user last;
 *   3. load: open requests and reported queue over capacity, lower is
 *      better;
 *   4. the policy's preference score, higher is better;
 *   5. on a full tie, rendezvous hashing of the request's key with each
 *      candidate's id: the key is the prefix hash of the request's first
 *      FI_ROUTE_KEY_BLOCKS blocks (fewer if it has fewer), so requests
 *      that share that much go to the same worker while the filters (sent
 *      with heartbeats) do not show it yet, and others spread over the
 *      workers (the first candidate took every tie: all cold traffic of
 *      an idle fleet went to one worker). The first block alone would not
 *      do: a chat template's header fills it, the same for every chat.
 */
#ifndef FI_COORD_ROUTE_H
#define FI_COORD_ROUTE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A filter's chance runs are not counted when a cold prompt reaches them
 * with odds above 1 in this (fi_route_pick). */
#define FI_ROUTE_FALSE_RUN_ODDS 32

typedef struct fi_route_cand {
    uint32_t in_flight;       /* requests open on it (the coordinator's count) */
    uint32_t capacity;        /* announced for the model, > 0 */
    uint32_t running, queued; /* reported with its heartbeats */
    const uint8_t *filter;    /* its prefix filter, NULL: none */
    size_t filter_len;        /* bytes (a power of two, 64..65536) */
    uint32_t filter_ones;     /* bits set in filter (fi_route_filter_ones); 0: counted when needed */
    int64_t pref;             /* the policy's prefer score */
    int affinity;             /* 1: served this request's user last */
    uint64_t id;              /* stable and distinct per worker (from its key): full ties */
} fi_route_cand;

/* Load of a candidate: max(open, reported running + queued) / capacity. */
double fi_route_load(const fi_route_cand *c);

/* Bits set in a filter of len bytes (its fill, for fi_route_pick). */
uint32_t fi_route_filter_ones(const uint8_t *filter, size_t len);

/* The leading blocks of a prompt that a filter of len bytes with ones
 * bits set matches by chance with odds above 1 in
 * FI_ROUTE_FALSE_RUN_ODDS, at most nh: what fi_route_pick takes off its
 * match (0 for a filter under 31% full; nh for a full one). */
int fi_route_false_run(uint32_t ones, size_t len, int nh);

/* The index in c[0..n) to route to (n >= 1; every candidate permitted),
 * with the expected hit in blocks (the match less its chance run) in
 * *hit (may be NULL). h: the request's
 * prefix hashes (nh may be 0). key: what breaks a full tie (fi_route_key).
 * The order is total and does not depend on the candidates' positions.
 * -1 when n is 0. */
int fi_route_pick(const fi_route_cand *c, int n, const uint64_t *h, int nh, uint64_t key, int *hit);

/* Leading blocks (of FI_KV_BLOCK tokens) that a full tie's key covers:
 * 64 tokens, past a chat template's header and into the first message or
 * document. */
#define FI_ROUTE_KEY_BLOCKS 4

/* A request's tie key: the hash of its first FI_ROUTE_KEY_BLOCKS prefix
 * blocks (each hash chains the ones before), or (none) fallback, which the
 * caller varies per request (a counter: ties then spread at random). */
uint64_t fi_route_key(const uint64_t *h, int nh, uint64_t fallback);

#ifdef __cplusplus
}
#endif
#endif /* FI_COORD_ROUTE_H */
