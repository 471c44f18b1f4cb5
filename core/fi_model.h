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

typedef struct fi_model_opts {
    int n_threads;   /* CPU threads; <= 0: one per core */
    fi_simd simd;    /* CPU code path */
    int act_bits;    /* activation precision of quantised products: 16
                        (0 means this default) or 8 (faster, less exact) */
} fi_model_opts;

/* Loads a model: opens the GGUF, checks every tensor's presence, type and
 * shape against the configuration, builds the tokenizer and a backend.
 * NULL with a message in err on any failure. */
fi_model *fi_model_load(const char *path, const fi_model_opts *opts, char *err, size_t errlen);
void fi_model_destroy(fi_model **m);

const fi_config *fi_model_config(const fi_model *m);
const fi_tok *fi_model_tok(const fi_model *m);
const fi_gguf *fi_model_gguf(const fi_model *m);
fi_backend *fi_model_backend(const fi_model *m);
/* Bytes of weights one decode step reads (every matrix once, plus one
 * embedding row). */
uint64_t fi_model_weight_bytes_per_token(const fi_model *m);

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

/* --- sampling ---------------------------------------------------------- */
typedef struct fi_sampler_params {
    float temperature;    /* <= 0: greedy */
    int top_k;            /* <= 0: off */
    float top_p;          /* >= 1: off */
    float min_p;          /* <= 0: off */
    float repeat_penalty; /* 1: off */
    int repeat_last_n;    /* how many recent tokens the penalty looks at */
    uint64_t seed;        /* RNG seed (the RNG lives in the sampler) */
} fi_sampler_params;

/* Defaults: temperature 0.7, top_k 40, top_p 0.95, min_p 0.05,
 * repeat_penalty 1.0 (off), repeat_last_n 64, seed 0. */
fi_sampler_params fi_sampler_defaults(void);

typedef struct fi_sampler fi_sampler;
fi_sampler *fi_sampler_new(const fi_sampler_params *p, int n_vocab);
void fi_sampler_destroy(fi_sampler **s);
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
