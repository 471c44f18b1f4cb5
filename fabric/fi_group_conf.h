/*
 * fi_group_conf.h - a shard group's layout: who the ranks are, where they
 * listen, which keys they hold, and which part of the model each computes
 * (tensor parallelism inside a pipeline stage, pipeline stages over
 * contiguous layer ranges).
 *
 * Two files. The group file is the same on every rank (its plan digest is
 * compared at join, so a rank with another layout is refused):
 *
 *   group = smollm-tp2            # name, part of the plan digest
 *   world = 2                     # ranks
 *   tp = 2                        # ranks per stage (pp = world / tp)
 *   endpoint.0 = tcp://10.0.0.1:7810   # where rank 0 binds and others connect
 *   key.0 = rank0.pub             # rank 0's public key file
 *   endpoint.1 = tcp://10.0.0.2:7810
 *   key.1 = rank1.pub
 *   # optional:
 *   tp_weights = 2,1              # share of KV heads and FFN rows per TP rank
 *   pp_weights = 1,1              # share of layers per stage
 *   kv_split = 2,1                # KV heads per TP rank (overrides tp_weights)
 *   ffn_split = 768,768           # FFN rows per TP rank (multiples of the block)
 *   layer_split = 15,15           # layers per stage (overrides pp_weights)
 *   heartbeat_ms = 250            # link heartbeats between ranks
 *   timeout_ms = 1500             # silence after which a rank is dead
 *   collective = zmq              # zmq (CPU, any machine) or nccl (GPUs, one machine)
 *   micro_batch = 4               # pipeline: tokens per micro-batch at least (0: off;
 *                                 # default 4 with zmq, 16 with nccl)
 *
 * The rank file is each process's own (fedinfer shard --config FILE):
 *
 *   group_file = group.conf       # relative paths: to this file's folder
 *   rank = 1
 *   secret_key = rank1.key        # 0600
 *   model = SmolLM2-135M-Instruct.Q4_1.gguf
 *   threads = 2
 *   # rank 0 only: coordinator, coordinator_key, model_name, capacity,
 *   # heartbeat_ms, liveness, max_tokens, n_ctx, kv_mib, max_seqs,
 *   # step_tokens, enrol_endpoint, site, region (see fedinfer shard --help)
 *
 * Rank r is TP rank r % tp of stage r / tp; rank 0 leads the group.
 */
#ifndef FI_GROUP_CONF_H
#define FI_GROUP_CONF_H

#include <stddef.h>
#include <stdint.h>

#include "fi_conf.h"
#include "fi_keys.h"
#include "fi_model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_GROUP_MAX_RANKS 16   /* ranks in one group */
#define FI_GROUP_DIGEST_BYTES 32 /* BLAKE2b-256 */
#define FI_GROUP_DIGEST_HEX 65   /* 64 hex characters and a NUL */
/* micro_batch by default. With collective = zmq (CPU ranks) 4: on the
 * 2-core machine decode of 8 or 16 sequences went through PP=2 1.1-1.4x
 * faster cut in micro-batches of 4 (fi_group_bench -b 8 / -b 16, see
 * examples/cluster/README.md), and at 2 tokens a micro-batch the cuts
 * cost more than the overlap gave.
 * With nccl (GPUs) 16: a GPU pass of few tokens costs about what one of
 * many does, so only larger passes gain by being cut. */
#define FI_GROUP_MICRO_BATCH_CPU 4
#define FI_GROUP_MICRO_BATCH_GPU 16
#define FI_GROUP_MICRO_MAX (2 * FI_GROUP_MAX_RANKS) /* micro-batches per pass, at most */

typedef enum fi_group_coll {
    FI_GROUP_COLL_ZMQ = 0,  /* CURVE ZeroMQ between processes (CPU memory) */
    FI_GROUP_COLL_NCCL = 1, /* NCCL among the GPUs of one machine */
} fi_group_coll;

/* The group file, parsed and checked. */
typedef struct fi_group_conf {
    char path[FI_CONF_STR_MAX];   /* the file it came from */
    char name[FI_CONF_STR_MAX];   /* group */
    int world;                    /* ranks, 1..FI_GROUP_MAX_RANKS */
    int tp;                       /* ranks per stage */
    int pp;                       /* stages (world / tp) */
    char endpoint[FI_GROUP_MAX_RANKS][FI_CONF_STR_MAX]; /* rank r binds here */
    uint8_t pub[FI_GROUP_MAX_RANKS][FI_KEYS_BYTES];     /* rank r's public key */
    int tp_weight[FI_GROUP_MAX_RANKS]; /* per TP rank, >= 1 (default 1) */
    int pp_weight[FI_GROUP_MAX_RANKS]; /* per stage, >= 1 (default 1) */
    int kv_split[FI_GROUP_MAX_RANKS];  /* explicit KV heads per TP rank, or all 0 */
    int ffn_split[FI_GROUP_MAX_RANKS]; /* explicit FFN rows per TP rank, or all 0 */
    int layer_split[FI_GROUP_MAX_RANKS]; /* explicit layers per stage, or all 0 */
    int heartbeat_ms;             /* link heartbeat interval */
    int timeout_ms;               /* a rank silent this long is dead */
    fi_group_coll coll;           /* how TP sums are made */
    int micro_batch;              /* pp > 1: a pass of at least 2 x this many tokens
                                     goes through the stages in micro-batches of at
                                     least this many (fi_group_micro_split); 0: whole */
    int micro_batch_set;          /* 1: given in the file; 0: the collective's default */
} fi_group_conf;

/* Parses and checks a group file (strict: unknown or repeated keys,
 * missing endpoints or keys, tp not dividing world, a list with the wrong
 * number of entries are errors naming the file, line and key). Public key
 * paths are relative to the file's folder. 0, or -1 with a message. */
FI_WIRE_MUST_CHECK int fi_group_conf_load(const char *path, fi_group_conf *g, char *err,
                                          size_t errlen);

/* The rank file. */
typedef struct fi_group_rank_conf {
    char group_file[FI_CONF_STR_MAX]; /* the group file (resolved path) */
    int rank;                         /* this process's rank */
    char secret_key[FI_CONF_STR_MAX]; /* this rank's secret key file */
    char model[FI_CONF_STR_MAX];      /* GGUF path */
    char model_sha256[FI_CONF_STR_MAX]; /* its expected SHA-256 ("": not checked) */
    int threads;                      /* CPU threads, 0: all */
    int act_bits;                     /* CPU activation precision: 16, 12 or 8; 0 the backend's default */
    int kv_bits;                      /* CPU KV cache precision: 16 or 8 */
    char device[FI_CONF_STR_MAX];     /* cpu, cuda, auto (default cpu) */
    int gpu;                          /* CUDA device index (default 0): ranks
                                         sharing a machine each take their own */
    /* rank 0 only */
    char coordinator[FI_CONF_STR_MAX];     /* fabric endpoint */
    char coordinator_key[FI_CONF_STR_MAX]; /* its public key file */
    char enrol_endpoint[FI_CONF_STR_MAX];  /* for --enrol */
    char site[FI_CONF_STR_MAX];            /* for --enrol */
    char region[FI_CONF_STR_MAX];          /* for --enrol */
    char model_name[FI_CONF_STR_MAX];      /* name requests use */
    int capacity;                          /* requests announced at once */
    int heartbeat_ms;                      /* to the coordinator */
    int liveness;                          /* coordinator heartbeats missed before reconnecting */
    int max_tokens;                        /* cap on a request's max_tokens */
    int n_ctx;                             /* positions per sequence, 0: model's */
    int kv_mib;                            /* KV pool budget (leader's plan), MiB */
    int max_seqs;                          /* sequences in a batch */
    int step_tokens;                       /* tokens per forward pass */
} fi_group_rank_conf;

/* Parses a rank file and resolves its relative paths against the file's
 * folder. A rank 0 file must name the coordinator, its key and the model
 * name. 0, or -1 with a message. */
FI_WIRE_MUST_CHECK int fi_group_rank_conf_load(const char *path, fi_group_rank_conf *r,
                                               char *err, size_t errlen);

/* 1 when the configuration file at path is a rank file (has a
 * `group_file` key): `fedinfer shard` then runs a group rank. */
int fi_group_conf_is_rank_file(const char *path);

/* --- the plan ------------------------------------------------------------ */

/* What the plan needs to know of the model (read from the GGUF header). */
typedef struct fi_group_model {
    int n_layers;       /* llama.block_count */
    int n_heads;        /* query heads */
    int n_kv_heads;     /* KV heads */
    int dim;            /* embedding length */
    int ffn_dim;        /* feed-forward length */
    int n_vocab;        /* rows of token_embd */
    int ffn_block;      /* elements per quantisation block of ffn_down's rows */
    uint64_t file_bytes; /* size of the file */
} fi_group_model;

/* Reads the model's shape from a GGUF file (no weights are read).
 * 0, or -1 with a message naming the file and what is missing. */
FI_WIRE_MUST_CHECK int fi_group_model_read(const char *path, fi_group_model *out, char *err,
                                           size_t errlen);

/* Fills plans[0..g->world) with each rank's part of the model: the KV
 * heads and FFN rows of a stage split among its TP ranks (by kv_split /
 * ffn_split when given, else in proportion to tp_weight, as evenly as the
 * model allows: every FFN share a multiple of ffn_block), the layers
 * split into contiguous stages (layer_split, or pp_weight), the token
 * embedding in every rank of the first stage, the output in TP rank 0 of
 * the last stage. Refuses, with a message saying why and what would work,
 * a plan that cannot be computed: more TP ranks than KV heads or than FFN
 * blocks, an explicit split that does not add up, an FFN share off the
 * block size, more stages than layers. 0, or -1. */
FI_WIRE_MUST_CHECK int fi_group_plan_make(const fi_group_conf *g, const fi_group_model *m,
                                          fi_shard_plan plans[FI_GROUP_MAX_RANKS], char *err,
                                          size_t errlen);

/* The plan digest: BLAKE2b-256 of a canonical text of the group's name,
 * world, tp, pp and every rank's plan (fi_group_plan_text). Two ranks
 * agree on the layout exactly when their digests are equal. */
void fi_group_plan_digest(const fi_group_conf *g, const fi_shard_plan *plans,
                          uint8_t out[FI_GROUP_DIGEST_BYTES]);
/* The canonical text (also what logs show): "group=NAME world=2 tp=2 pp=1
 * coll=zmq; r0 L0-30 kv0+2 ffn0+768 E O; r1 ...", with " mb=4" after
 * the collective when there are stages. Truncated to cap. */
void fi_group_plan_text(const fi_group_conf *g, const fi_shard_plan *plans, char *buf,
                        size_t cap);

/* The model digest: BLAKE2b-256 of the whole file (read once, ~1 GB/s).
 * 0, or -1 with a message. */
FI_WIRE_MUST_CHECK int fi_group_model_digest(const char *path, uint8_t out[FI_GROUP_DIGEST_BYTES],
                                             char *err, size_t errlen);
/* Hex of a digest (out: FI_GROUP_DIGEST_HEX bytes). */
void fi_group_digest_hex(const uint8_t d[FI_GROUP_DIGEST_BYTES], char out[FI_GROUP_DIGEST_HEX]);

/* How a pass of n tokens goes through the stages: in m micro-batches,
 * tokens [at[k], at[k+1]) in micro-batch k (at[0] = 0, at[m] = n). With
 * one stage, or micro_batch 0, or fewer than 2 x micro_batch tokens, m is
 * 1; else m = min(n / micro_batch, 2 pp), and every micro-batch but the
 * last holds a multiple of micro_batch tokens, the last at least
 * micro_batch. Stage s runs micro-batch k while stage s + 1 runs k - 1:
 * with equal stages, each taking time T on the whole batch, a pass takes
 * about (m + pp - 1) T / m instead of pp T. at: FI_GROUP_MICRO_MAX + 1
 * entries. Returns m. */
int fi_group_micro_split(const fi_group_conf *g, int n, int *at);

/* Stage and TP rank of a rank. */
static inline int fi_group_stage(const fi_group_conf *g, int rank) { return rank / g->tp; }
static inline int fi_group_tp_rank(const fi_group_conf *g, int rank) { return rank % g->tp; }

#ifdef __cplusplus
}
#endif
#endif /* FI_GROUP_CONF_H */
