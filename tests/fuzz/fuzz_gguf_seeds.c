/*
 * fuzz_gguf_seeds.c - writes the seed corpus for fuzz_gguf into a folder:
 * a few small valid GGUF files covering every metadata type, nested
 * arrays, every tensor type, a non-default alignment and a tiny Llama
 * model. Usage: fuzz_gguf_seeds DIR (DIR is created if missing).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf_writer.h"

static int s_write(fi_gw *w, const char *dir, const char *name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int rc = fi_gw_write_file(w, path);
    if (rc < 0)
        fprintf(stderr, "fuzz_gguf_seeds: cannot write %s\n", path);
    fi_gw_destroy(&w);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_gguf_seeds DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    if (mkdir(dir, 0777) < 0 && errno != EEXIST) {
        fprintf(stderr, "fuzz_gguf_seeds: mkdir %s: %s\n", dir, strerror(errno));
        return 1;
    }
    int rc = 0;

    /* Every metadata type, nested arrays. */
    fi_gw *w = fi_gw_new();
    fi_gw_add_u8(w, "a.u8", 1);
    fi_gw_add_i8(w, "a.i8", -1);
    fi_gw_add_u16(w, "a.u16", 2);
    fi_gw_add_i16(w, "a.i16", -2);
    fi_gw_add_u32(w, "a.u32", 3);
    fi_gw_add_i32(w, "a.i32", -3);
    fi_gw_add_f32(w, "a.f32", 0.5f);
    fi_gw_add_bool(w, "a.bool", 1);
    fi_gw_add_str(w, "a.str", "text");
    fi_gw_add_u64(w, "a.u64", 4);
    fi_gw_add_i64(w, "a.i64", -4);
    fi_gw_add_f64(w, "a.f64", 0.25);
    const char *strs[] = {"x", "yy", ""};
    fi_gw_add_str_array(w, "a.strs", strs, 3);
    int32_t ints[3] = {1, -2, 3};
    fi_gw_add_array(w, "a.ints", FI_GGUF_INT32, ints, 3);
    static const unsigned char nest[] = {9, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0,
                                         0, 0, 0, 0, 0, 0, 7, 8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0,
                                         0, 1, 0, 0, 0, 0, 0, 0, 0, 'z'};
    fi_gw_add_raw(w, "a.nested", 8, FI_GGUF_ARRAY, nest, sizeof nest);
    rc |= s_write(w, dir, "types.gguf");

    /* One tensor of every type, alignment 64. */
    w = fi_gw_new();
    fi_gw_set_alignment(w, 64);
    static const fi_dtype types[] = {FI_DTYPE_F32,  FI_DTYPE_F16,  FI_DTYPE_BF16,
                                     FI_DTYPE_Q4_0, FI_DTYPE_Q4_1, FI_DTYPE_Q8_0};
    float v[64];
    for (int i = 0; i < 64; i++)
        v[i] = (float)(i - 32) / 16.0f;
    for (int k = 0; k < 6; k++) {
        char name[16];
        int64_t ne[2] = {32, 2};
        snprintf(name, sizeof name, "t%d", k);
        fi_gw_add_tensor_f32(w, name, types[k], 2, ne, v);
    }
    rc |= s_write(w, dir, "tensors.gguf");

    /* A tiny Llama (one layer, small dims). */
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    o.n_layers = 1;
    o.dim = 32;
    o.n_heads = 2;
    o.n_kv_heads = 1;
    o.ffn_dim = 32;
    o.wtype = FI_DTYPE_Q4_1;
    w = fi_gw_tiny_llama(&o);
    rc |= w ? s_write(w, dir, "tiny_llama.gguf") : -1;

    /* The smallest valid file: header only. */
    w = fi_gw_new();
    rc |= s_write(w, dir, "empty.gguf");
    return rc ? 1 : 0;
}
