/*
 * gen_capture.h - what one generation produced, captured through the
 * engine's callbacks (on_text, on_done), for tests of fi_generate and the
 * scheduler.
 */
#ifndef FI_GEN_CAPTURE_H
#define FI_GEN_CAPTURE_H

#include <stddef.h>

#include "fi_model.h"

typedef struct fi_capture {
    char text[8192];      /* text so far, NUL-terminated */
    size_t len;
    int done;             /* on_done calls */
    int n_generated, n_prompt;
    fi_stop_reason stop;
    char error[256];      /* on_done's error, or empty */
    int cancel_after;     /* on_text cancels after this many calls (0: never) */
    int calls;            /* on_text calls */
} fi_capture;

/* fi_text_fn: appends the text (user: fi_capture). */
int fi_capture_text(void *user, const char *t, size_t n);
/* fi_done_fn of fi_sched.h: records the result (user: fi_capture). */
void fi_capture_done(void *user, const fi_gen_result *r, const char *error);
/* Greedy generation options writing into c. */
fi_gen_opts fi_capture_greedy(int max_tokens, fi_capture *c);

#endif /* FI_GEN_CAPTURE_H */
