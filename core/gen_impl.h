/*
 * gen_impl.h - pieces of the generation loop shared by fi_generate
 * (generate.c) and the scheduler (sched.c). Private to core/.
 */
#ifndef FI_GEN_IMPL_H
#define FI_GEN_IMPL_H

#include "fi_model.h"
#include "fi_textstream.h"

/* Appends the text of token id to ts (nothing for a control token, whose
 * text still completes a stop string in it: fi_textstream_mark).
 * Returns 1 when a stop string is now
 * complete, 0 otherwise, -1 with a message in err (a token without text,
 * out of memory). */
int fi_gen_push_token(const fi_tok *tok, fi_textstream *ts, int32_t id, char *err,
                      size_t errlen);

/* Hands the text ts has released to on_text; returns nonzero when the
 * callback cancels. flush: the end of generation. */
int fi_gen_emit(fi_textstream *ts, fi_text_fn on_text, void *user, int flush);

/* Greedy decoding without a penalty or logit_bias: only the argmax is needed. */
int fi_gen_is_greedy(const fi_sampler_params *p);

#endif /* FI_GEN_IMPL_H */
