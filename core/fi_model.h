/*
 * fi_model.h - the engine: a Llama-architecture model from a GGUF file,
 * sessions (one sequence each, with its KV cache), sampling, and a
 * generation loop that streams text.
 *
 * Ownership: fi_model_load returns a model the caller destroys with
 * fi_model_destroy after every session made from it is destroyed. A
 * session is used by one thread at a time; several sessions of one model
 * may run in turn on the same backend.
 */
#ifndef FI_MODEL_H
#define FI_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "fi_gguf.h"
#include "fi_kernels.h"
#include "fi_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Hyper-parameters read from the GGUF metadata. */
typedef struct fi_config {
    int n_layers;       /* llama.block_count */
    int dim;            /* llama.embedding_length */
    int ffn_dim;        /* llama.feed_forward_length */
    int n_heads;        /* llama.attention.head_count */
    int n_kv_heads;     /* llama.attention.head_count_kv */
    int head_dim;       /* dim / n_heads */
    int n_vocab;        /* rows of token_embd */
    int ctx_train;      /* llama.context_length */
    float rope_theta;   /* llama.rope.freq_base */
    float norm_eps;     /* llama.attention.layer_norm_rms_epsilon */
    int tied_output;    /* 1 when output.weight is absent (uses token_embd) */
} fi_config;

typedef struct fi_model fi_model;

/* Where the model runs. */
typedef enum fi_device {
    FI_DEVICE_CPU = 0,   /* the CPU backend (the default of zeroed options) */
    FI_DEVICE_CUDA = 1,  /* CUDA device opts->gpu; loading fails when there is none */
    FI_DEVICE_AUTO = 2,  /* that CUDA device when present and the model loads
                            there (fits in its memory), else the CPU */
} fi_device;

/* The part of the model one rank of a shard group holds (tensor and
 * pipeline parallelism). A zeroed plan, or a NULL opts->plan, is the whole
 * model. Loading with a plan copies only the plan's slices of the weights
 * into the process (the file's mapping is then released), so a rank's
 * memory holds its share, not the whole model. */
typedef struct fi_shard_plan {
    int layer_begin, layer_end; /* layers [begin, end); end 0: to the last */
    int kv_head_begin;          /* first KV head of this rank; its query heads */
    int kv_head_count;          /*   come with it; 0: every head */
    int ffn_begin;              /* rows of ffn_gate/ffn_up (= columns of */
    int ffn_count;              /*   ffn_down) of this rank; 0: all */
    int no_embed;               /* 1: no token embedding (not the first stage) */
    int no_output;              /* 1: no output norm/matrix (not the last stage) */
} fi_shard_plan;

/* Checks a plan against a model's configuration: ranges inside the model,
 * the FFN slice on the quantisation block size of ffn_down's type, ...
 * 0, or -1 with the reason in err. (fi_model_load checks it too.) */
FI_MUST_CHECK int fi_shard_plan_check(const fi_shard_plan *p, const fi_config *c,
                                      int ffn_down_block, char *err, size_t errlen);

/* Called by the forward pass where tensor parallelism needs a sum over the
 * ranks of a stage: after the attention output projection and after the
 * FFN down projection of every layer. x holds n floats (backend memory)
 * that must be replaced by their sum over the ranks. 0, or -1 to abort the
 * pass (the forward pass then fails with the hook's message in err). */
typedef int (*fi_allreduce_fn)(void *user, float *x, size_t n, char *err, size_t errlen);

typedef struct fi_model_opts {
    int n_threads;   /* CPU threads; <= 0: one per core */
    fi_simd simd;    /* CPU code path */
    int act_bits;    /* activation precision of quantised products on the
                        CPU (fi_cpu_backend_set_act_bits): 16, 12 or 8
                        (least exact; batches faster with AVX512-VNNI);
                        0: the backend's default (12 where an AMX tile
                        unit serves the products, else 16); the CUDA
                        backend always uses fp16 */
    int kv_bits;     /* KV cache precision on the CPU
                        (fi_cpu_backend_set_kv_bits): 16 (0 means this
                        default, fp16) or 8 (int8 with a scale per head: half
                        the memory, attention reads half the bytes); the
                        CUDA backend keeps fp16: FI_DEVICE_CUDA refuses 8,
                        and FI_DEVICE_AUTO takes the CPU for it */
    fi_device device; /* backend; FI_DEVICE_CPU when zeroed */
    const fi_shard_plan *plan; /* NULL: the whole model */
    int gpu;         /* CUDA device index (ranks sharing a machine) */
    const char *sha256; /* the file's expected SHA-256 (64 hex digits, either
                           case), as a deployment pins it (model_sha256);
                           NULL or "": not checked */
} fi_model_opts;

/* Parses "cpu", "cuda" or "auto"; 0, or -1 for anything else. */
FI_MUST_CHECK int fi_device_parse(const char *s, fi_device *out);

/* Loads a model: opens the GGUF, checks its SHA-256 against opts->sha256
 * when given, checks every tensor's presence, type and
 * shape against the configuration, builds the tokenizer and a backend
 * (opts->device; a NULL opts means the CPU). NULL with a message in err on
 * any failure; with FI_DEVICE_CUDA and no usable device the message is
 * "no CUDA device: <CUDA's message>". */
fi_model *fi_model_load(const char *path, const fi_model_opts *opts, char *err, size_t errlen);
void fi_model_destroy(fi_model **m);

const fi_config *fi_model_config(const fi_model *m);
const fi_tok *fi_model_tok(const fi_model *m);
const fi_gguf *fi_model_gguf(const fi_model *m);
fi_backend *fi_model_backend(const fi_model *m);
/* 1 when m's backend has failed for good (a GPU's failures are sticky:
 * every later pass would fail too), with the backend's message in why;
 * 0 when it works. Waits for queued work. */
int fi_model_backend_failed(fi_model *m, char *why, size_t whylen);
/* Replaces m's backend with a new one made with the options m was loaded
 * with (FI_DEVICE_AUTO may land on the CPU this time) and binds every
 * weight to it again, from the file: what a server does after its GPU
 * failed, without a restart. Every KV pool and session of m must be
 * destroyed first (-1 otherwise). 0, or -1 with a message: when no new
 * backend could be made the old one stays; when the weights could not all
 * be bound, passes are refused until a reset succeeds. */
FI_MUST_CHECK int fi_model_reset_backend(fi_model *m, char *err, size_t errlen);
/* Bytes of weights one decode step reads (every matrix once, plus one
 * embedding row). */
uint64_t fi_model_weight_bytes_per_token(const fi_model *m);
/* Multiply-adds of one token's matrix products (the layers' seven
 * matrices and the logits matrix, rows x columns each) whose weights are
 * of type `type` (an fi_dtype), or of every type when type < 0. */
uint64_t fi_model_macs_per_token(const fi_model *m, int type);
/* The plan the model was loaded with (the whole model when none). */
const fi_shard_plan *fi_model_plan(const fi_model *m);
/* Installs the tensor-parallel sum (NULL: none, a single rank). */
void fi_model_set_allreduce(fi_model *m, fi_allreduce_fn fn, void *user);

/* --- paged KV cache and batched forward passes ------------------------- */

#define FI_KV_BLOCK 16 /* positions per KV-cache block */

/* A pool of KV-cache blocks (every layer of the model's plan, keys and
 * values, fp16), plus the work buffers of forward passes over up to
 * max_tokens tokens of which up to max_out want logits. */
typedef struct fi_kvpool fi_kvpool;

/* Bytes one block takes (all layers of the plan, K and V). */
size_t fi_kv_block_bytes(const fi_model *m);
fi_kvpool *fi_kvpool_new(fi_model *m, int n_blocks, int max_tokens, int max_out, char *err,
                         size_t errlen);
void fi_kvpool_destroy(fi_kvpool **p);
int fi_kvpool_blocks(const fi_kvpool *p);
int fi_kvpool_max_tokens(const fi_kvpool *p);
int fi_kvpool_max_out(const fi_kvpool *p);

/* One forward pass: n tokens of one or more sequences. tok, pos, seq and
 * out_rows are host arrays; tables holds max_blocks block ids for each of
 * n_seqs sequences (entries past a sequence's length are ignored). Token t
 * is written to the cache at its position pos[t] in sequence seq[t]; the
 * blocks covering it must be in the sequence's table. */
typedef struct fi_batch {
    int n;                 /* tokens, 1..fi_kvpool_max_tokens */
    const int32_t *tok;    /* token ids (ignored by a stage without embedding) */
    const int32_t *pos;    /* positions */
    const int32_t *seq;    /* sequence index of each token, < n_seqs */
    int n_seqs;
    const int32_t *tables; /* n_seqs * max_blocks block ids */
    int max_blocks;
    const int32_t *out_rows; /* tokens whose logits are wanted, ascending */
    int n_out;             /* 0..fi_kvpool_max_out */
    int32_t *argmax;       /* NULL, or n_out entries (host): where the backend finds
                              each logit row's argmax (fi_argmax) as it makes the rows,
                              the pass writes them there; else it leaves them as they are */
} fi_batch;

/* The checks fi_model_forward makes of a batch whatever the model's plan:
 * 1..max_tokens tokens, at most max_out wanted rows, token ids (when tok
 * is given) inside the vocabulary, sequences, positions inside their
 * tables, table blocks inside the pool, wanted rows ascending and < n. A
 * caller that runs a batch in pieces checks the whole first. 0, or -1
 * with a message naming the first fault. */
FI_MUST_CHECK int fi_batch_check(const fi_model *m, const fi_kvpool *kv, const fi_batch *b,
                                 char *err, size_t errlen);

/* Runs the batch through the model's plan: from the token embeddings (or,
 * for a stage without embedding, from x_in: n rows of dim floats, host),
 * through its layers, to logits (n_out rows of n_vocab floats, host) when
 * the plan has the output, else to x_out (n rows of dim floats, host).
 * Every check (token ids, positions inside the tables, block ids inside
 * the pool) is made before any work. 0, or -1 with a message in err. */
FI_MUST_CHECK int fi_model_forward(fi_model *m, fi_kvpool *kv, const fi_batch *b,
                                   const float *x_in, float *x_out, float *logits, char *err,
                                   size_t errlen);

/* --- sessions ---------------------------------------------------------- */
typedef struct fi_session fi_session;

/* A session with room for n_ctx positions (<= the model's trained context;
 * n_ctx <= 0 means min(ctx_train, 4096)). */
fi_session *fi_session_new(fi_model *m, int n_ctx, char *err, size_t errlen);
void fi_session_destroy(fi_session **s);
fi_model *fi_session_model(const fi_session *s);
int fi_session_n_ctx(const fi_session *s);
int fi_session_pos(const fi_session *s); /* tokens already in the cache */
/* Forget the cache from position pos on (0: start over). */
void fi_session_rewind(fi_session *s, int pos);

/* Runs n tokens through the model at the session's current position and
 * appends them to the cache. When logits is not NULL it receives the
 * logits of the last token (n_vocab floats); all_logits (may be NULL)
 * receives n * n_vocab floats, one row per token. Returns 0, or -1 with a
 * message in err when the context would overflow (nothing is changed). */
FI_MUST_CHECK int fi_session_eval(fi_session *s, const int32_t *toks, int n, float *logits,
                                  float *all_logits, char *err, size_t errlen);

/* fi_session_eval for greedy decoding: *next receives the index of the
 * largest logit of the last token (the first on ties). On a backend with
 * ops->argmax only that integer comes back to the host, not the logits. */
FI_MUST_CHECK int fi_session_eval_greedy(fi_session *s, const int32_t *toks, int n,
                                         int32_t *next, char *err, size_t errlen);

/* --- sampling ---------------------------------------------------------- */
#define FI_SAMPLER_MAX_BIAS 300 /* logit_bias entries, as OpenAI's limit */

/* One entry of OpenAI's logit_bias: added to the token's logit. */
typedef struct fi_logit_bias {
    int32_t id;
    float bias;           /* -100..100; -100 bans the token in practice */
} fi_logit_bias;

typedef struct fi_sampler_params {
    float temperature;    /* <= 0: greedy */
    int top_k;            /* <= 0: off */
    float top_p;          /* >= 1: off */
    float min_p;          /* <= 0: off */
    float repeat_penalty; /* 1: off */
    int repeat_last_n;    /* how many recent tokens the penalty looks at */
    uint64_t seed;        /* RNG seed (the RNG lives in the sampler) */
    /* OpenAI's penalties, over the generated tokens only
     * (fi_sampler_prompt_len): a token's logit loses presence_penalty
     * once it was generated, and frequency_penalty per time; 0: off */
    float presence_penalty;
    float frequency_penalty;
    int n_bias;           /* logit_bias entries (ids outside the vocabulary are ignored) */
    fi_logit_bias bias[FI_SAMPLER_MAX_BIAS];
} fi_sampler_params;

/* Defaults: temperature 0.7, top_k 40, top_p 0.95, min_p 0.05,
 * repeat_penalty 1.0 (off), repeat_last_n 64, seed 0, no OpenAI
 * penalties, no logit_bias. */
fi_sampler_params fi_sampler_defaults(void);

typedef struct fi_sampler fi_sampler;
fi_sampler *fi_sampler_new(const fi_sampler_params *p, int n_vocab);
void fi_sampler_destroy(fi_sampler **s);
/* The first n tokens of every history passed to fi_sampler_sample are the
 * prompt: the presence and frequency penalties count only what follows
 * (0, the default: the whole history). */
void fi_sampler_prompt_len(fi_sampler *s, int n);
/* Greedy choice: the first index of the largest of x[0..n) (NaNs never
 * win; 0 when all are NaN). */
int32_t fi_argmax(const float *x, int n);
/* Picks a token from logits (modified in place). history: the tokens so far
 * (for the repetition penalty), may be NULL when n_history is 0. */
int32_t fi_sampler_sample(fi_sampler *s, float *logits, const int32_t *history, int n_history);

/* --- generation -------------------------------------------------------- */
typedef enum fi_stop_reason {
    FI_STOP_EOG = 0,     /* the model ended its turn */
    FI_STOP_LENGTH = 1,  /* max_tokens reached */
    FI_STOP_STRING = 2,  /* a stop string appeared */
    FI_STOP_CANCEL = 3,  /* the callback asked to stop */
    FI_STOP_CONTEXT = 4, /* the context is full */
} fi_stop_reason;

const char *fi_stop_reason_name(fi_stop_reason r);

/* Called with each piece of text as it becomes final (never in the middle
 * of a UTF-8 character, never text that might still turn into a stop
 * string). Return nonzero to cancel. */
typedef int (*fi_text_fn)(void *user, const char *text, size_t len);

typedef struct fi_gen_opts {
    int max_tokens;              /* tokens to generate at most */
    fi_sampler_params sampling;
    const char *const *stop;     /* stop strings, may be NULL */
    int n_stop;
    fi_text_fn on_text;          /* may be NULL */
    void *user;
} fi_gen_opts;

typedef struct fi_gen_result {
    int n_prompt;                /* prompt tokens evaluated */
    int n_generated;             /* tokens sampled */
    fi_stop_reason stop;
    double prefill_s;            /* seconds spent on the prompt */
    double decode_s;             /* seconds spent generating */
} fi_gen_result;

/* Generates after the given prompt tokens (appended to the session's
 * cache; the generated tokens are too, except the last one sampled). Returns 0, or -1 with a message in err: a prompt longer than the
 * context is refused before any work ("prompt of N tokens does not fit the
 * context of M"). */
FI_MUST_CHECK int fi_generate(fi_session *s, const int32_t *prompt, int n_prompt,
                              const fi_gen_opts *o, fi_gen_result *res, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FI_MODEL_H */
