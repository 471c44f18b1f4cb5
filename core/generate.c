/*
 * generate.c - the generation loop: prompt, then sample/eval until an
 * end-of-generation token, a stop string, max_tokens, the end of the
 * context, or the caller cancels. Text reaches the caller through a
 * fi_textstream, so it never splits a UTF-8 character or shows the start of
 * a stop string.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_model.h"
#include "fi_textstream.h"
#include "gen_impl.h"

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void s_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

const char *fi_stop_reason_name(fi_stop_reason r) {
    switch (r) {
    case FI_STOP_EOG: return "stop";
    case FI_STOP_LENGTH: return "length";
    case FI_STOP_STRING: return "stop_string";
    case FI_STOP_CANCEL: return "cancelled";
    case FI_STOP_CONTEXT: return "context_full";
    }
    return "unknown";
}

int fi_gen_emit(fi_textstream *ts, fi_text_fn on_text, void *user, int flush) {
    size_t n;
    const char *p = fi_textstream_take(ts, flush, &n);
    if (n && on_text) return on_text(user, p, n);
    return 0;
}

int fi_gen_is_greedy(const fi_sampler_params *p) {
    return !(p->temperature > 0.0f) && (p->repeat_penalty == 1.0f || p->repeat_penalty <= 0.0f) &&
           p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f && p->n_bias <= 0;
}

int fi_gen_push_token(const fi_tok *tok, fi_textstream *ts, int32_t id, char *err,
                      size_t errlen) {
    char piece[256];
    int len = fi_tok_piece(tok, id, piece, sizeof piece);
    if (len < 0) {
        s_err(err, errlen, "sampled token %d has no text", id);
        return -1;
    }
    char *big = NULL;
    const char *pp = piece;
    if ((size_t)len > sizeof piece) { /* rare: a very long token */
        big = malloc((size_t)len);
        if (!big || fi_tok_piece(tok, id, big, (size_t)len) != len) {
            free(big);
            s_err(err, errlen, "out of memory");
            return -1;
        }
        pp = big;
    }
    /* A control token the model samples mid-answer ("<jupyter_start>", a
     * stray "<|im_start|>") is markup, not text: it counts as generated
     * but adds nothing to the answer, as in OpenAI's and llama.cpp's
     * servers; a stop string in it, or begun in the text before it and
     * ended in it, still stops. */
    int hit = fi_tok_is_special(tok, id) ? fi_textstream_mark(ts, pp, (size_t)len)
                                         : fi_textstream_push(ts, pp, (size_t)len);
    free(big);
    if (hit < 0) s_err(err, errlen, "out of memory");
    return hit;
}

int fi_generate(fi_session *s, const int32_t *prompt, int n_prompt, const fi_gen_opts *o,
                fi_gen_result *res, char *err, size_t errlen) {
    fi_gen_result r = {0};
    const fi_tok *tok = NULL;
    int n_vocab = 0, rc = -1;
    fi_sampler *smp = NULL;
    fi_textstream *ts = NULL;
    float *logits = NULL;
    int32_t *hist = NULL;

    if (n_prompt <= 0) {
        s_err(err, errlen, "empty prompt");
        return -1;
    }
    int room = fi_session_n_ctx(s) - fi_session_pos(s);
    if (n_prompt > room) {
        s_err(err, errlen, "prompt of %d tokens does not fit the context of %d (%d in use)",
              n_prompt, fi_session_n_ctx(s), fi_session_pos(s));
        return -1;
    }
    if (o->max_tokens < 0) {
        s_err(err, errlen, "max_tokens must be >= 0, not %d", o->max_tokens);
        return -1;
    }
    fi_model *m = fi_session_model(s);
    tok = fi_model_tok(m);
    n_vocab = fi_model_config(m)->n_vocab;

    smp = fi_sampler_new(&o->sampling, n_vocab);
    if (smp) fi_sampler_prompt_len(smp, n_prompt);
    ts = fi_textstream_new(o->stop, o->n_stop);
    logits = malloc((size_t)n_vocab * sizeof(float));
    hist = malloc(((size_t)n_prompt + (size_t)o->max_tokens + 1) * sizeof(int32_t));
    if (!smp || !ts || !logits || !hist) {
        s_err(err, errlen, "out of memory");
        goto done;
    }
    memcpy(hist, prompt, (size_t)n_prompt * sizeof(int32_t));
    int n_hist = n_prompt;

    /* Greedy without a repetition penalty needs only the argmax: on a
     * backend that computes it, the logits never leave the device. */
    int greedy = fi_gen_is_greedy(&o->sampling);
    int32_t next = 0;
    double t0 = s_now();
    if (greedy ? fi_session_eval_greedy(s, prompt, n_prompt, &next, err, errlen)
               : fi_session_eval(s, prompt, n_prompt, logits, NULL, err, errlen))
        goto done;
    double t1 = s_now();
    r.n_prompt = n_prompt;
    r.prefill_s = t1 - t0;
    r.stop = FI_STOP_LENGTH;

    for (;;) {
        if (r.n_generated >= o->max_tokens) {
            r.stop = FI_STOP_LENGTH;
            break;
        }
        int32_t id = greedy ? next : fi_sampler_sample(smp, logits, hist, n_hist);
        r.n_generated++;
        hist[n_hist++] = id;
        if (fi_tok_is_eog(tok, id)) {
            r.stop = FI_STOP_EOG;
            break;
        }
        int hit = fi_gen_push_token(tok, ts, id, err, errlen);
        if (hit < 0) goto done;
        if (hit) {
            r.stop = FI_STOP_STRING;
            break;
        }
        if (fi_gen_emit(ts, o->on_text, o->user, 0)) {
            r.stop = FI_STOP_CANCEL;
            break;
        }
        if (r.n_generated >= o->max_tokens) {
            r.stop = FI_STOP_LENGTH;
            break;
        }
        if (fi_session_pos(s) >= fi_session_n_ctx(s)) {
            r.stop = FI_STOP_CONTEXT;
            break;
        }
        if (greedy ? fi_session_eval_greedy(s, &id, 1, &next, err, errlen)
                   : fi_session_eval(s, &id, 1, logits, NULL, err, errlen))
            goto done;
    }
    if (r.stop != FI_STOP_CANCEL && fi_gen_emit(ts, o->on_text, o->user, 1))
        r.stop = FI_STOP_CANCEL;
    r.decode_s = s_now() - t1;
    rc = 0;
done:
    if (res) *res = r;
    fi_sampler_destroy(&smp);
    fi_textstream_destroy(&ts);
    free(logits);
    free(hist);
    return rc;
}
