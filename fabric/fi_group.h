/*
 * fi_group.h - one rank of a shard group: a model split across processes
 * by tensor parallelism (inside a pipeline stage) and pipeline
 * parallelism (stages over contiguous layers), over the CURVE mesh of
 * fi_group_net.
 *
 * Rank 0 leads. It holds the scheduler (fi_sched) and installs
 * fi_group_forward as the scheduler's forward hook: every forward pass is
 * sent to the other ranks as a batch (tokens, positions, sequences, KV
 * block tables, wanted rows), every rank runs its slice, and the logits
 * come back to the leader, which samples. The other ranks run
 * fi_group_follow: they hold their slice and compute on command.
 *
 * In a pass:
 *   - every TP rank of a stage sums its partial outputs with the others
 *     of its stage twice per layer (after the attention output projection
 *     and after ffn_down; fi_model_set_allreduce): each sends its vector to
 *     the others and adds them all in rank order, so every rank of the
 *     stage holds bit-identical activations;
 *   - TP rank t of stage s sends its stage's output rows to TP rank t of
 *     stage s + 1;
 *   - TP rank 0 of the last stage sends the logits to the leader;
 *   - with several stages, a pass of enough tokens is cut into
 *     micro-batches (fi_group_micro_split, the group file's micro_batch)
 *     that follow each other through the stages, so that stage s works on
 *     one while stage s + 1 works on the one before.
 *
 * Joining. The leader sends Join to every rank whose link comes up (a new
 * process, or the same one back): the world size, the rank it expects,
 * the model digest, the plan digest and the KV pool's geometry. The rank
 * compares them with its own and answers; a mismatch is refused on both
 * sides with both digests in the message (the rank's fi_group_follow
 * returns -1, so that its process exits with the reason). The group is
 * available when every rank has joined on its current link.
 *
 * Faults. A rank whose links drop (killed: at once; frozen: after the
 * heartbeat timeout) makes the group unavailable; a pass in progress
 * fails on every rank with a message naming the rank, so every request
 * in flight ends with that error (the scheduler ends them all when its
 * forward call fails) and nothing waits for a rank that will not answer.
 * When the rank comes back it joins again and the group is available
 * again; the others keep running. A pass that takes longer than
 * FI_GROUP_PASS_TIMEOUT_MS also fails.
 *
 * A fi_group is used by one thread.
 */
#ifndef FI_GROUP_H
#define FI_GROUP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fi_client.h"
#include "fi_group_conf.h"
#include "fi_model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_GROUP_PASS_TIMEOUT_MS 120000 /* a pass that runs longer fails */

typedef struct fi_group fi_group;

/* A rank: links to the others (fi_gnet_new), the plan of every rank
 * (fi_group_plan_make with model) and the digests. kp is this rank's key
 * pair (copied). The model is attached later (fi_group_attach). NULL with
 * a message. */
fi_group *fi_group_new(const fi_group_conf *conf, int rank, const fi_keypair *kp,
                       const fi_group_model *model, const uint8_t model_digest[FI_GROUP_DIGEST_BYTES],
                       char *err, size_t errlen);
void fi_group_destroy(fi_group **g);

/* This rank's plan (to load the model with). */
const fi_shard_plan *fi_group_plan(const fi_group *g);
/* The plan digest, and the canonical text of the whole plan. */
const uint8_t *fi_group_plan_digest_bytes(const fi_group *g);
const char *fi_group_plan_str(const fi_group *g);
int fi_group_rank(const fi_group *g);

/* Attaches the model this rank loaded with fi_group_plan(g) (not owned;
 * it must outlive the group or be detached with NULL) and installs the
 * stage's sum (fi_model_set_allreduce) when the stage has several TP
 * ranks. 0, or -1 when the model's plan is not this rank's. */
FI_WIRE_MUST_CHECK int fi_group_attach(fi_group *g, fi_model *m, char *err, size_t errlen);

/* --- the leader ------------------------------------------------------- */

/* The CUDA device this rank's model is on (fi_model_opts.gpu), which its
 * NCCL communicator must use too (default 0). */
void fi_group_set_gpu(fi_group *g, int gpu);

/* The KV pool the leader's scheduler uses: every rank makes a pool of the
 * same number of blocks and work-buffer sizes (sent in Join). Ranks that
 * joined with other values join again. */
void fi_group_set_pool(fi_group *g, int n_blocks, int max_tokens, int max_out);

/* Serves the links for up to timeout_ms: link changes, Join and its
 * answers. Returns 1 when the group is available, 0 when not (see
 * fi_group_status), -1 on a socket error. */
int fi_group_lead_poll(fi_group *g, int timeout_ms, char *err, size_t errlen);
int fi_group_available(const fi_group *g);
/* Why the group is not available ("rank 1: link down", "rank 2 refused:
 * model digest ab12... differs from the leader's cd34..."), or "available". */
const char *fi_group_status(const fi_group *g);

/* Work to keep going while a pass waits for other ranks (at most every
 * 50 ms): the leader's link to the coordinator. NULL: none. */
void fi_group_set_idle(fi_group *g, void (*fn)(void *user), void *user);

/* The scheduler's forward hook (fi_sched_opts.forward, user = the group):
 * one pass over every rank. 0, or -1 with the reason in err ("shard group
 * unavailable: ...", "rank 2 failed: ...", "rank 1 is down (link lost)
 * during pass ..."). */
int fi_group_forward(void *user, fi_model *m, fi_kvpool *kv, const fi_batch *b, float *logits,
                     char *err, size_t errlen);

/* The leader's serving loop (fi_group_serve.c): attaches m (loaded with
 * fi_group_plan(g)), makes a scheduler whose forward hook is
 * fi_group_forward (KV budget, batch and context limits from rc), and
 * serves c's requests until *stop, announcing the model to the
 * coordinator with rc->capacity while the group is available and with
 * capacity 0 (withdrawn) while not. c should be made with capacity 0 so
 * that nothing is routed before the group has formed. Returns 0 on stop,
 * -1 with a message when the coordinator refused or revoked the key, the
 * scheduler cannot be made, or the leader's own backend failed for good
 * (as fi_group_follow). */
int fi_group_serve(fi_group *g, fi_model *m, fi_client *c, const fi_group_rank_conf *rc,
                   atomic_int *stop, char *err, size_t errlen);

/* --- the other ranks ----------------------------------------------------- */

/* Serves the leader's commands until *stop: Join (answered), batches (run
 * on this rank's slice with the pool made at Join). Returns 0 on stop, or
 * -1 with the reason when this rank was refused at join (its model, world
 * size or layout is not the leader's), a socket failed, or its backend
 * failed for good (a GPU's failures are sticky: the process should end so
 * that its supervisor starts it with a new device context; the group
 * re-forms when it is back). */
int fi_group_follow(fi_group *g, atomic_int *stop, char *err, size_t errlen);

/* --- the command -------------------------------------------------------- */

/* `fedinfer shard --config RANKFILE [--enrol TOKEN]` for a rank file
 * (fi_group_conf_is_rank_file): runs this rank until SIGINT/SIGTERM.
 * Returns the exit status (0, or 1 with the reason on stderr). */
int fi_group_cmd(const char *config, const char *token);
/* The rank file's part of `fedinfer shard --help`. */
void fi_group_cmd_help(FILE *f);

/* --- figures ------------------------------------------------------------- */
typedef struct fi_group_stats {
    uint64_t passes;        /* forward passes this rank took part in */
    uint64_t failed;        /* of which failed */
    uint64_t micro;         /* micro-batches this rank ran (a pass cut in m by
                               fi_group_micro_split counts m) */
    uint64_t bytes_sent;    /* to the other ranks, headers included */
    uint64_t msgs_sent;
    uint64_t allreduces;    /* TP sums made */
    double comm_s;          /* time in sends and TP sums (waits for the other TP
                               ranks of the stage included) */
    double wait_s;          /* time waiting for another stage's activations or
                               logits (their computing included: the pipeline's
                               bubble) */
    double compute_s;       /* time in this rank's fi_model_forward, sums excluded */
} fi_group_stats;
void fi_group_get_stats(const fi_group *g, fi_group_stats *st);

#ifdef __cplusplus
}
#endif
#endif /* FI_GROUP_H */
