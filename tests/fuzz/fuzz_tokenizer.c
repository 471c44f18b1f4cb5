/*
 * fuzz_tokenizer.c - libFuzzer target for the tokenizer: text and metadata.
 *
 * The first byte of an input says what the rest is:
 *   0: text for SmolLM2's tokenizer (FI_TEST_MODEL), special tokens off;
 *   1: the same, special tokens on;
 *   2: a GGUF file: its tokenizer metadata is loaded, and when it loads the
 *      file's own bytes are encoded with it and a chat is rendered.
 * Checked: fi_tok_new refuses with a message; the count fi_tok_encode
 * returns does not depend on the buffer; ids are in range; decoding gives
 * the text back less the bytes that have no token (with special tokens
 * off: a parsed special token comes back whole). Built by
 * tests/tokenizer.cmake with clang only.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fi_gguf.h"
#include "fi_tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static fi_gguf *s_model; /* SmolLM2, opened once; NULL when absent */
static fi_tok *s_tok;    /* its tokenizer */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    char err[256];
    s_model = fi_gguf_open(FI_TEST_MODEL, err, sizeof err);
    if (s_model)
        s_tok = fi_tok_new(s_model, err, sizeof err);
    return 0;
}

/* Encodes, checks the properties above, and decodes. */
static void s_check(const fi_tok *t, const char *s, size_t n, int special) {
    int k = fi_tok_encode(t, s, n, special, NULL, 0);
    if (k < 0)
        __builtin_trap();
    int32_t *ids = malloc(((size_t)k + 1) * sizeof *ids);
    int32_t few[3];
    if (!ids || fi_tok_encode(t, s, n, special, ids, k) != k ||
        fi_tok_encode(t, s, n, special, few, 3) != k)
        __builtin_trap();
    for (int i = 0; i < k; i++)
        if (ids[i] < 0 || ids[i] >= fi_tok_n_vocab(t) || (i < 3 && few[i] != ids[i]))
            __builtin_trap();
    size_t dl;
    char *d = fi_tok_decode(t, ids, k, &dl);
    if (!d)
        __builtin_trap();
    /* Plain text (special tokens not parsed): what comes back is the input
     * with the bytes the vocabulary cannot encode left out, in order (a
     * subsequence), and exactly the input when fi_tok_can_encode says so.
     * (A user-defined token can carry a byte that has no token of its own,
     * so which bytes are dropped depends on their context.) With special
     * tokens parsed, a special token's text comes back whole even where its
     * bytes alone could not be encoded, so only the checks above apply. */
    if (!special) {
        size_t j = 0;
        for (size_t i = 0; i < n && j < dl; i++)
            if (d[j] == s[i])
                j++;
        if (j != dl)
            __builtin_trap();
        if (fi_tok_can_encode(t, s, n) && (dl != n || memcmp(d, s, n)))
            __builtin_trap();
    }
    free(d);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0)
        return 0;
    int mode = data[0] % 3;
    const char *s = (const char *)data + 1;
    size_t n = size - 1;
    if (mode < 2) {
        if (s_tok)
            s_check(s_tok, s, n, mode);
        return 0;
    }
    char err[256] = "";
    fi_gguf *g = fi_gguf_open_memory(s, n, "fuzz.gguf", err, sizeof err);
    if (!g)
        return 0;
    fi_tok *t = fi_tok_new(g, err, sizeof err);
    if (!t) {
        if (!err[0])
            __builtin_trap(); /* every refusal says why */
    } else {
        s_check(t, s, n, 0);
        s_check(t, s, n, 1);
        fi_chat_msg m[] = {{"user", "hi"}};
        free(fi_tok_chat(t, m, 1, 1, err, sizeof err));
        char p[8];
        for (int32_t id = 0; id < fi_tok_n_vocab(t) && id < 300; id++)
            if (fi_tok_piece(t, id, p, sizeof p) < 0)
                __builtin_trap();
    }
    fi_tok_destroy(&t);
    fi_gguf_close(&g);
    return 0;
}
