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
    int chat = msgs != NULL;
    char terr[256];
    char *text = chat ? fi_tok_chat(tok, msgs, n_msgs, 1, terr, sizeof terr)
                      : strdup(prompt ? prompt : "");
    if (!text) {
        snprintf(err, errlen, "cannot render the prompt: %s", chat ? terr : "out of memory");
        return NULL;
    }
    /* A chat is encoded with its special tokens; raw text without, after
     * BOS when the model wants one. */
    size_t len = strlen(text);
    if (len > max_len) len = max_len;
    int bos = !chat && fi_tok_add_bos(tok) && fi_tok_bos(tok) >= 0;
    int need = fi_tok_encode(tok, text, len, chat, NULL, 0);
    int32_t *ids = need >= 0 ? malloc(((size_t)need + 2) * sizeof *ids) : NULL;
    if (!ids || fi_tok_encode(tok, text, len, chat, ids + bos, need) != need) {
        free(ids);
        free(text);
        snprintf(err, errlen, "cannot tokenise the prompt");
        return NULL;
    }
    if (bos) ids[0] = fi_tok_bos(tok);
    free(text);
    *n = need + bos;
    return ids;
}
