/*
 * fi_group_coll.h - the collectives of a shard group's forward pass over
 * the CURVE mesh (fi_group_net): a waited-for message that fails fast
 * when the pass is lost, the TP sum among the ranks of a stage, and the
 * failure notice.
 *
 * Every message of a pass carries the pass number; the leader numbers
 * passes from a clock-based start, so that a restarted leader's passes
 * are newer than anything left over from before. A rank that fails a pass
 * sends FI_G_FAIL with the reason to every rank it can reach; a rank
 * waiting in that pass stops at once with "rank R failed: reason".
 */
#ifndef FI_GROUP_COLL_H
#define FI_GROUP_COLL_H

#include <stddef.h>
#include <stdint.h>

#include "fi_group_net.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Message kinds. */
enum {
    FI_G_JOIN = 1,       /* leader -> rank: layout, digests, pool geometry */
    FI_G_JOIN_REPLY = 2, /* rank -> leader: accepted or refused, with its digests */
    FI_G_BATCH = 3,      /* leader -> every rank: one forward pass */
    FI_G_PART = 4,       /* TP rank -> the others of its stage: a partial sum */
    FI_G_ACT = 5,        /* stage s -> stage s+1 (same TP rank): output rows */
    FI_G_LOGITS = 6,     /* last stage's TP rank 0 -> leader: logits */
    FI_G_FAIL = 7,       /* any rank -> all: the pass failed (payload: reason) */
    FI_G_NCCL = 8,       /* leader -> every rank: form the NCCL communicator (id) */
};

/* Waits until deadline_ms (fi_wire_now_ms clock) for the message of
 * `kind` from `from` in `pass` and checks its op (UINT32_MAX: any).
 * Fails early, with a message naming the rank, on a FI_G_FAIL of the
 * pass from any rank, on any link of the group going down, or on a
 * message out of order. 0 with *out (free with fi_gmsg_free), or -1. */
FI_WIRE_MUST_CHECK int fi_gcoll_wait(fi_gnet *n, int from, uint8_t kind, uint64_t pass,
                                     uint32_t op, uint64_t deadline_ms, fi_gmsg **out, char *err,
                                     size_t errlen);

/* The sum of x (len floats, host memory) over ranks first..first+count-1
 * (this rank among them): each sends its x to the others, then every rank
 * adds the vectors in rank order into acc (len floats of scratch) and
 * copies the sum back into x, so all of them hold the same bits. 0, or -1
 * with a message. */
FI_WIRE_MUST_CHECK int fi_gcoll_allreduce(fi_gnet *n, int first, int count, uint64_t pass,
                                          uint32_t op, float *x, size_t len, float *acc,
                                          uint64_t deadline_ms, char *err, size_t errlen);

/* Tells every rank whose link is up that `pass` failed, and why. */
void fi_gcoll_fail(fi_gnet *n, uint64_t pass, const char *why);

#ifdef __cplusplus
}
#endif
#endif /* FI_GROUP_COLL_H */
