/*
 * fi_shard_engine.c - the shard worker's engine backend: a whole model in
 * one process (core/fi_model.h). Sharded groups (TP/PP ranks) come with
 * their own issue and will provide the same fi_shard_backend table.
 *
 * A request is a chat (its messages, rendered with the model's chat
 * template; the assistant's turn is generated), raw text to continue, or
 * one user message; sampling and stop strings come with it.
 *
 * Served through one scheduler (core/fi_sched.h): the worker's serving
 * thread submits requests as they arrive and steps the batch, so
 * concurrent requests share each forward pass, and prompts reuse the KV
 * blocks of earlier prompts with the same prefix, tenant and zone. The
 * one-at-a-time `generate` (a fresh session per request) stays as the
 * reference the tests compare with.
 *
 * A backend that fails for good (a GPU's failures are sticky) fails every
 * request the scheduler holds; the engine then replaces it
 * (fi_model_reset_backend) and makes a new scheduler. While it cannot, the
 * engine is down: up says so (the serving loop withdraws the model),
 * submit refuses with -2 and the reason (the requester gets ERR_ENGINE),
 * the load has no KV blocks, and it tries again, when asked, at most every
 * 1-30 s.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_model.h"
#include "fi_sched.h"
#include "fi_shard.h"

typedef struct s_engine {
    fi_model *model;   /* loaded once */
    fi_sched *sched;   /* the continuous-batching scheduler (serving thread only);
                          NULL while the engine is down */
    fi_sched_opts so;  /* its options, for a new one */
    int n_ctx;         /* context per request */
    int max_tokens;    /* cap on a request's max_tokens */
    char down[700];    /* why the engine is down ("" when up) */
    double retry_at;   /* down: the earliest next try (monotonic seconds) */
    double pause;      /* down: the pause before the try after that */
} s_engine;

static double s_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A new backend and scheduler after the old backend failed for good (why);
 * the failed step has ended every request the scheduler held. 0, or -1
 * with the engine down (en->down says why). */
static int s_revive(s_engine *en, const char *why) {
    char err[512];
    fi_sched_destroy(&en->sched);
    if (fi_model_reset_backend(en->model, err, sizeof err) == 0 &&
        (en->sched = fi_sched_new(en->model, &en->so, err, sizeof err)) != NULL) {
        fprintf(stderr, "shard: a new backend took the weights after the old one failed (%s)\n",
                why);
        en->down[0] = 0;
        en->pause = 0;
        return 0;
    }
    snprintf(en->down, sizeof en->down, "the engine's backend failed (%.200s) and could not be "
             "replaced yet: %.400s", why, err);
    fprintf(stderr, "shard: %s\n", en->down);
    en->pause = en->pause ? (en->pause < 15 ? 2 * en->pause : 30) : 1;
    en->retry_at = s_mono() + en->pause;
    return -1;
}

typedef struct s_emit_ctx {
    fi_shard_emit_fn emit; /* the worker's emitter */
    void *user;            /* its state */
} s_emit_ctx;

static int s_on_text(void *user, const char *text, size_t len) {
    s_emit_ctx *e = user;
    return e->emit(e->user, text, len);
}

/* The request's sampling, from the wire: fields left at 0 are off (or
 * greedy, for temperature). */
fi_sampler_params fi_shard_sampling(const Fi__InferRequest *rq) {
    fi_sampler_params sp = fi_sampler_defaults();
    sp.temperature = rq->temperature; /* 0 (the wire default): greedy */
    sp.top_p = rq->top_p > 0 && rq->top_p <= 1 ? rq->top_p : 1.0f;
    sp.top_k = rq->top_k > 0 ? rq->top_k : 0;
    sp.min_p = rq->min_p > 0 && rq->min_p < 1 ? rq->min_p : 0.0f;
    sp.repeat_penalty = rq->repeat_penalty > 0 ? rq->repeat_penalty : 1.0f;
    sp.seed = rq->seed;
    /* OpenAI's, within their ranges (the edge refused others) */
    sp.presence_penalty = rq->presence_penalty >= -2 && rq->presence_penalty <= 2 ? rq->presence_penalty : 0.0f;
    sp.frequency_penalty = rq->frequency_penalty >= -2 && rq->frequency_penalty <= 2 ? rq->frequency_penalty : 0.0f;
    for (size_t i = 0; i < rq->n_logit_bias && sp.n_bias < FI_SAMPLER_MAX_BIAS; i++) {
        const Fi__LogitBias *b = rq->logit_bias[i];
        if (b && b->bias >= -100 && b->bias <= 100)
            sp.bias[sp.n_bias++] = (fi_logit_bias){b->token, b->bias};
    }
    return sp;
}

int32_t *fi_shard_prompt_tokens(const fi_tok *tok, const Fi__InferRequest *rq, int *n, char *err,
                                size_t errlen) {
    int32_t *ids = NULL;
    *n = 0;
    /* OpenAI's penalties within -2..2, logit_bias entries naming tokens of
     * this model's vocabulary with biases within -100..100 (the edge
     * checks as much; another sender is refused, not quietly changed) */
    if (!(rq->presence_penalty >= -2 && rq->presence_penalty <= 2) ||
        !(rq->frequency_penalty >= -2 && rq->frequency_penalty <= 2)) {
        snprintf(err, errlen, "presence_penalty and frequency_penalty must be within -2..2");
        return NULL;
    }
    for (size_t i = 0; i < rq->n_logit_bias; i++) {
        const Fi__LogitBias *b = rq->logit_bias[i];
        if (!b || b->token < 0 || b->token >= fi_tok_n_vocab(tok) || !(b->bias >= -100 && b->bias <= 100)) {
            snprintf(err, errlen, "logit_bias entry %zu (token %d, bias %g) is outside the vocabulary of %d tokens "
                     "or the range -100..100", i, b ? (int)b->token : -1, b ? (double)b->bias : 0.0,
                     fi_tok_n_vocab(tok));
            return NULL;
        }
    }
    if (rq->n_messages > 0 || !rq->raw) {
        /* As the edge counts and hashes it (edge_prompt.c): through the
         * chat template, its markers as special tokens and the messages as
         * plain text (fi_tok_chat_ids). */
        if (rq->n_messages > 256) {
            snprintf(err, errlen, "at most 256 messages, not %zu", rq->n_messages);
            return NULL;
        }
        fi_chat_msg msgs[256];
        int nm = 0;
        if (rq->n_messages > 0) {
            for (size_t i = 0; i < rq->n_messages; i++) {
                const Fi__ChatMessage *m = rq->messages[i];
                const char *role = m->role ? m->role : "";
                if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant")) {
                    snprintf(err, errlen, "messages[%zu]: role '%.32s' is not system, user or assistant",
                             i, role);
                    return NULL;
                }
                msgs[nm++] = (fi_chat_msg){role, m->content ? m->content : ""};
            }
        } else {
            msgs[nm++] = (fi_chat_msg){"user", rq->prompt ? rq->prompt : ""};
        }
        ids = fi_tok_chat_ids(tok, msgs, nm, 1, n, err, errlen);
        if (!ids) return NULL;
    } else {
        /* raw text as plain text, after BOS when the model wants one */
        const char *text = rq->prompt ? rq->prompt : "";
        int bos = fi_tok_add_bos(tok) && fi_tok_bos(tok) >= 0;
        int k = fi_tok_encode(tok, text, strlen(text), 0, NULL, 0);
        if (k < 0 || !(ids = malloc((size_t)(k + bos + 1) * sizeof *ids)) ||
            fi_tok_encode(tok, text, strlen(text), 0, ids + bos, k) != k) {
            snprintf(err, errlen, "cannot tokenise the prompt");
            free(ids);
            return NULL;
        }
        if (bos) ids[0] = fi_tok_bos(tok);
        *n = k + bos;
    }
    if (*n == 0) {
        snprintf(err, errlen, "the prompt is empty");
        free(ids);
        return NULL;
    }
    return ids;
}

static int s_generate(void *ctx, const Fi__InferRequest *rq, fi_shard_emit_fn emit,
                      void *emit_user, fi_shard_gen *out, char *err, size_t errlen) {
    s_engine *en = ctx;
    const fi_tok *tok = fi_model_tok(en->model);
    memset(out, 0, sizeof *out);
    int rc = -1, n = 0;
    fi_session *s = NULL;
    int32_t *ids = fi_shard_prompt_tokens(tok, rq, &n, err, errlen);
    if (!ids) return -1;
    if (!(s = fi_session_new(en->model, en->n_ctx, err, errlen))) goto done;
    fi_gen_opts o;
    memset(&o, 0, sizeof o);
    o.max_tokens = fi_shard_max_tokens(rq->max_tokens, en->max_tokens);
    o.sampling = fi_shard_sampling(rq);
    o.stop = (const char *const *)rq->stop;
    o.n_stop = rq->n_stop < 4 ? (int)rq->n_stop : 4;
    s_emit_ctx ec = {emit, emit_user};
    o.on_text = s_on_text;
    o.user = &ec;
    fi_gen_result res;
    if (fi_generate(s, ids, n, &o, &res, err, errlen) != 0) goto done;
    out->n_prompt = (uint32_t)res.n_prompt;
    out->n_generated = (uint32_t)res.n_generated;
    snprintf(out->stop, sizeof out->stop, "%s", fi_stop_reason_name(res.stop));
    out->prefill_ms = (uint32_t)(res.prefill_s * 1000.0);
    out->decode_ms = (uint32_t)(res.decode_s * 1000.0);
    rc = 0;
done:
    fi_session_destroy(&s);
    free(ids);
    return rc;
}

static int64_t s_submit(void *ctx, const Fi__InferRequest *rq, const fi_shard_sink *sink,
                        char *err, size_t errlen) {
    s_engine *en = ctx;
    if (!en->sched) {
        char why[700];
        snprintf(why, sizeof why, "%s", en->down);
        if (s_mono() < en->retry_at || s_revive(en, why) != 0) {
            snprintf(err, errlen, "%s", en->down);
            return -2;
        }
    }
    int n = 0;
    int32_t *ids = fi_shard_prompt_tokens(fi_model_tok(en->model), rq, &n, err, errlen);
    if (!ids) return -1;
    fi_sched_req r;
    memset(&r, 0, sizeof r);
    r.prompt = ids;
    r.n_prompt = n;
    r.gen.max_tokens = fi_shard_max_tokens(rq->max_tokens, en->max_tokens);
    r.gen.sampling = fi_shard_sampling(rq);
    r.gen.stop = (const char *const *)rq->stop;
    r.gen.n_stop = rq->n_stop < 4 ? (int)rq->n_stop : 4;
    r.gen.on_text = sink->emit;
    r.gen.user = sink->user;
    r.on_done = sink->done;
    r.tenant = rq->tenant;
    r.zone = rq->zone;
    int64_t id = fi_sched_submit(en->sched, &r, err, errlen); /* copies the prompt */
    free(ids);
    return id;
}

static int s_cancel(void *ctx, int64_t id) {
    s_engine *en = ctx;
    return en->sched ? fi_sched_cancel(en->sched, id) : -1;
}

static int s_step(void *ctx, char *err, size_t errlen) {
    s_engine *en = ctx;
    if (!en->sched) return 0; /* down: nothing is pending */
    int rc = fi_sched_step(en->sched, err, errlen);
    char why[256];
    if (rc < 0 && fi_model_backend_failed(en->model, why, sizeof why)) (void)s_revive(en, why);
    return rc;
}

static void s_load(void *ctx, uint32_t *running, uint32_t *queued, uint32_t *kv_free,
                   uint32_t *kv_total) {
    s_engine *en = ctx;
    fi_sched_stats st;
    memset(&st, 0, sizeof st); /* down: no room at all */
    if (en->sched) fi_sched_get_stats(en->sched, &st);
    *running = (uint32_t)st.running;
    *queued = (uint32_t)st.queued;
    *kv_free = (uint32_t)st.blocks_free;
    *kv_total = (uint32_t)st.blocks_total;
}

static int s_up(void *ctx) {
    s_engine *en = ctx;
    if (!en->sched && s_mono() >= en->retry_at) {
        char why[700];
        snprintf(why, sizeof why, "%s", en->down);
        (void)s_revive(en, why); /* the loop asks between steps: try again */
    }
    return en->sched != NULL;
}

static int s_filter(void *ctx, uint8_t *bits, size_t nbytes) {
    s_engine *en = ctx;
    if (!en->sched) return -1;
    return fi_sched_prefix_filter(en->sched, bits, nbytes);
}

static void s_destroy(void *ctx) {
    s_engine *en = ctx;
    if (!en) return;
    fi_sched_destroy(&en->sched);
    fi_model_destroy(&en->model);
    free(en);
}

int fi_shard_engine_backend_hooks(const fi_shard_conf *conf, const fi_shard_engine_hooks *hooks,
                                  fi_shard_backend *out, char *err, size_t errlen) {
    s_engine *en = calloc(1, sizeof *en);
    if (!en) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    fi_model_opts mo = {.n_threads = conf->threads, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_AUTO,
                        .plan = hooks ? hooks->plan : NULL, /* a GPU when present */
                        .act_bits = conf->act_bits, .kv_bits = conf->kv_bits,
                        .sha256 = conf->model_sha256};
    en->model = fi_model_load(conf->model, &mo, err, errlen);
    if (!en->model) {
        free(en);
        return -1;
    }
    en->n_ctx = conf->n_ctx;
    en->max_tokens = conf->max_tokens;
    fi_sched_opts so;
    memset(&so, 0, sizeof so);
    so.kv_bytes = (size_t)conf->kv_mb << 20;
    so.max_seqs = conf->batch > 0 ? conf->batch : conf->capacity;
    so.n_ctx = conf->n_ctx;
    so.no_prefix_cache = !conf->prefix_cache;
    if (hooks) {
        so.forward = hooks->forward;
        so.forward_user = hooks->forward_user;
    }
    en->so = so;
    if (!(en->sched = fi_sched_new(en->model, &so, err, errlen))) {
        s_destroy(en);
        return -1;
    }
    memset(out, 0, sizeof *out);
    out->name = "engine";
    out->generate = s_generate;
    out->destroy = s_destroy;
    out->ctx = en;
    out->prefix_filter = s_filter;
    out->submit = s_submit;
    out->cancel = s_cancel;
    out->step = s_step;
    out->load = s_load;
    out->up = s_up;
    return 0;
}

int fi_shard_engine_stats(const fi_shard_backend *be, fi_sched_stats *st) {
    if (!be || be->destroy != s_destroy || !be->ctx) return -1;
    const s_engine *en = be->ctx;
    if (!en->sched) {
        memset(st, 0, sizeof *st);
        return 0;
    }
    fi_sched_get_stats(en->sched, st);
    return 0;
}

fi_model *fi_shard_engine_model(const fi_shard_backend *be) {
    if (!be || be->destroy != s_destroy || !be->ctx) return NULL;
    return ((const s_engine *)be->ctx)->model;
}

int fi_shard_engine_backend(const fi_shard_conf *conf, fi_shard_backend *out, char *err,
                            size_t errlen) {
    return fi_shard_engine_backend_hooks(conf, NULL, out, err, errlen);
}
