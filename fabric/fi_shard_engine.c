/*
 * fi_shard_engine.c - the shard worker's engine backend: a whole model in
 * one process (core/fi_model.h). Sharded groups (TP/PP ranks) come with
 * their own issue and will provide the same fi_shard_backend table.
 *
 * A request's prompt is one user message: it is rendered with the model's
 * chat template, and the assistant's turn is generated. Each request gets
 * a fresh session (no prefix cache yet).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fi_model.h"
#include "fi_shard.h"

typedef struct s_engine {
    fi_model *model;   /* loaded once */
    int n_ctx;         /* context per request */
    int max_tokens;    /* cap on a request's max_tokens */
} s_engine;

typedef struct s_emit_ctx {
    fi_shard_emit_fn emit; /* the worker's emitter */
    void *user;            /* its state */
} s_emit_ctx;

static int s_on_text(void *user, const char *text, size_t len) {
    s_emit_ctx *e = user;
    return e->emit(e->user, text, len);
}

static int s_generate(void *ctx, const Fi__InferRequest *rq, fi_shard_emit_fn emit,
                      void *emit_user, fi_shard_gen *out, char *err, size_t errlen) {
    s_engine *en = ctx;
    const fi_tok *tok = fi_model_tok(en->model);
    memset(out, 0, sizeof *out);
    fi_chat_msg msg = {"user", rq->prompt ? rq->prompt : ""};
    char *text = fi_tok_chat(tok, &msg, 1, 1, err, errlen);
    if (!text) return -1;
    int rc = -1;
    int32_t *ids = NULL;
    fi_session *s = NULL;
    int n = fi_tok_encode(tok, text, strlen(text), 1, NULL, 0);
    if (n < 0 || !(ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids)) ||
        fi_tok_encode(tok, text, strlen(text), 1, ids, n) != n) {
        snprintf(err, errlen, "cannot tokenise the prompt");
        goto done;
    }
    if (!(s = fi_session_new(en->model, en->n_ctx, err, errlen))) goto done;
    fi_gen_opts o;
    memset(&o, 0, sizeof o);
    o.max_tokens = rq->max_tokens && (int)rq->max_tokens < en->max_tokens ? (int)rq->max_tokens
                                                                          : en->max_tokens;
    o.sampling = fi_sampler_defaults();
    o.sampling.temperature = rq->temperature; /* 0 (the wire default): greedy */
    o.sampling.seed = rq->seed;
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
    free(text);
    return rc;
}

static void s_destroy(void *ctx) {
    s_engine *en = ctx;
    if (!en) return;
    fi_model_destroy(&en->model);
    free(en);
}

int fi_shard_engine_backend(const fi_shard_conf *conf, fi_shard_backend *out, char *err,
                            size_t errlen) {
    s_engine *en = calloc(1, sizeof *en);
    if (!en) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    fi_model_opts mo = {.n_threads = conf->threads, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_AUTO}; /* a GPU when present */
    en->model = fi_model_load(conf->model, &mo, err, errlen);
    if (!en->model) {
        free(en);
        return -1;
    }
    en->n_ctx = conf->n_ctx;
    en->max_tokens = conf->max_tokens;
    out->name = "engine";
    out->generate = s_generate;
    out->destroy = s_destroy;
    out->ctx = en;
    return 0;
}
