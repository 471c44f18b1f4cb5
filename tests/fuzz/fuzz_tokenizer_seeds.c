/*
 * fuzz_tokenizer_seeds.c - writes the seed corpus of fuzz_tokenizer into the
 * folder named by argv[1]: each prompt of tests/golden/tokens.txt as text
 * (first byte 0 or 1, as its special flag), and a small GGUF file holding
 * only tokenizer metadata (first byte 2). Returns 0, or 1 on an I/O error.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf_writer.h"

static int s_write(const char *dir, int i, const void *a, size_t na, const void *b, size_t nb) {
    char path[4096];
    snprintf(path, sizeof path, "%s/seed_%03d", dir, i);
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    int ok = fwrite(a, 1, na, f) == na && fwrite(b, 1, nb, f) == nb;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}

static int s_hex(int c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; }

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_tokenizer_seeds DIR\n");
        return 2;
    }
    mkdir(argv[1], 0777);
    int n = 0;
    FILE *f = fopen(FI_TEST_DIR "/golden/tokens.txt", "r");
    if (!f) {
        perror(FI_TEST_DIR "/golden/tokens.txt");
        return 1;
    }
    static char line[1 << 16], text[1 << 15];
    while (fgets(line, sizeof line, f)) {
        if (line[0] != '0' && line[0] != '1')
            continue;
        unsigned char mode = (unsigned char)(line[0] - '0');
        size_t k = 0;
        for (char *p = line + 2; s_hex(p[0]) >= 0 && s_hex(p[1]) >= 0 && k < sizeof text; p += 2)
            text[k++] = (char)(s_hex(p[0]) * 16 + s_hex(p[1]));
        if (s_write(argv[1], n++, &mode, 1, text, k) != 0)
            return 1;
    }
    fclose(f);

    /* tokenizer metadata only: 3 control tokens, 256 bytes, 2 merges */
    const char *toks[3 + 256 + 2];
    int32_t types[3 + 256 + 2];
    char syms[256][4];
    size_t nt = 0;
    const char *ctl[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    for (int i = 0; i < 3; i++) {
        types[nt] = 3;
        toks[nt++] = ctl[i];
    }
    for (int b = 0; b < 256; b++) {
        syms[b][fi_gw_byte_symbol((uint8_t)b, syms[b])] = 0;
        types[nt] = 1;
        toks[nt++] = syms[b];
    }
    types[nt] = 1;
    toks[nt++] = "Ġt";
    types[nt] = 1;
    toks[nt++] = "he";
    const char *merges[] = {"Ġ t", "h e"};
    fi_gw *w = fi_gw_new();
    fi_gw_add_str(w, "tokenizer.ggml.model", "gpt2");
    fi_gw_add_str(w, "tokenizer.ggml.pre", "smollm");
    fi_gw_add_str_array(w, "tokenizer.ggml.tokens", toks, nt);
    fi_gw_add_array(w, "tokenizer.ggml.token_type", FI_GGUF_INT32, types, nt);
    fi_gw_add_str_array(w, "tokenizer.ggml.merges", merges, 2);
    fi_gw_add_u32(w, "tokenizer.ggml.bos_token_id", 1);
    fi_gw_add_u32(w, "tokenizer.ggml.eos_token_id", 2);
    fi_gw_add_str(w, "tokenizer.chat_template",
                  "{{ '<|im_start|>system\\nDefault.<|im_end|>\\n' }}<|im_start|>");
    size_t len;
    uint8_t *buf = fi_gw_serialize(w, &len, NULL);
    fi_gw_destroy(&w);
    if (!buf)
        return 1;
    unsigned char mode = 2;
    int rc = s_write(argv[1], n++, &mode, 1, buf, len);
    free(buf);
    return rc ? 1 : 0;
}
