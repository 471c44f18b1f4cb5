/*
 * edge_prompt.c - a request's prompt as the local model's tokens: what the
 * edge counts for the policy and its limits, runs locally, and hashes for
 * the clusters' prefix caches. A cluster worker tokenises a routed request
 * the same way (fabric/fi_shard_engine.c, fi_shard_prompt_tokens), so that
 * the hashes the edge sends name the blocks the worker caches (tested in
 * tests/test_fabric_engine.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edge_impl.h"

int32_t *edge_prompt_tokens(const fi_tok *tok, const fi_chat_msg *msgs, int n_msgs,
                            const char *prompt, size_t max_len, int *n, char *err,
                            size_t errlen) {
    if (msgs) {
        /* a chat: the template's markers as special tokens, the messages as
         * plain text, so that no message can open or close a turn */
        char terr[256];
        int32_t *ids = fi_tok_chat_ids(tok, msgs, n_msgs, 1, n, terr, sizeof terr);
        if (!ids) snprintf(err, errlen, "cannot render the prompt: %s", terr);
        return ids;
    }
    /* raw text, without special tokens, after BOS when the model wants one */
    const char *text = prompt ? prompt : "";
    size_t len = strlen(text);
    if (len > max_len) len = max_len;
    int bos = fi_tok_add_bos(tok) && fi_tok_bos(tok) >= 0;
    int need = fi_tok_encode(tok, text, len, 0, NULL, 0);
    int32_t *ids = need >= 0 ? malloc(((size_t)need + 2) * sizeof *ids) : NULL;
    if (!ids || fi_tok_encode(tok, text, len, 0, ids + bos, need) != need) {
        free(ids);
        snprintf(err, errlen, "cannot tokenise the prompt");
        return NULL;
    }
    if (bos) ids[0] = fi_tok_bos(tok);
    *n = need + bos;
    return ids;
}
