/*
 * gen_capture.c - see gen_capture.h.
 */
#include "gen_capture.h"

#include <stdio.h>
#include <string.h>

int fi_capture_text(void *user, const char *t, size_t n) {
    fi_capture *c = user;
    if (c->len + n < sizeof c->text) {
        memcpy(c->text + c->len, t, n);
        c->len += n;
        c->text[c->len] = 0;
    }
    c->calls++;
    return c->cancel_after && c->calls >= c->cancel_after;
}

void fi_capture_done(void *user, const fi_gen_result *r, const char *error) {
    fi_capture *c = user;
    c->done++;
    c->n_generated = r->n_generated;
    c->n_prompt = r->n_prompt;
    c->stop = r->stop;
    if (error) snprintf(c->error, sizeof c->error, "%s", error);
}

fi_gen_opts fi_capture_greedy(int max_tokens, fi_capture *c) {
    fi_gen_opts g = {0};
    g.max_tokens = max_tokens;
    g.sampling = fi_sampler_defaults();
    g.sampling.temperature = 0.0f;
    g.on_text = fi_capture_text;
    g.user = c;
    return g;
}
