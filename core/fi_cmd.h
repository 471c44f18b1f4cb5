/*
 * fi_cmd.h - the engine's commands of the `fedinfer` binary.
 *
 * Each takes the arguments after the command name (argv[0] is the command
 * name) and returns the process exit status: 0 success, 1 failure, 2 bad
 * usage. Each answers --help.
 */
#ifndef FI_CMD_H
#define FI_CMD_H

#ifdef __cplusplus
extern "C" {
#endif

int fi_cmd_run(int argc, char **argv);     /* fedinfer run     */
int fi_cmd_bench(int argc, char **argv);   /* fedinfer bench   */
int fi_cmd_bench_serve(int argc, char **argv); /* fedinfer bench --serve */
int fi_cmd_inspect(int argc, char **argv); /* fedinfer inspect */

#include <stddef.h>
#include <stdint.h>
/* What the routing figures of `bench --serve` give the coordinator's router
 * about each replica (fabric/fi_coord_route.h's candidate, as the
 * coordinator fills it from heartbeats). */
typedef struct fi_bench_replica {
    const uint8_t *filter;  /* its prefix filter as last reported */
    size_t filter_len;
    uint32_t running, queued, capacity;
    uint64_t id;            /* stable and distinct */
} fi_bench_replica;
/* The router's choice among n replicas for a request with prefix hashes
 * h[0..nh): an index. */
typedef int (*fi_bench_route_fn)(const fi_bench_replica *r, int n, const uint64_t *h, int nh);
/* Sets the router `bench --serve` measures (the fedinfer binary gives the
 * coordinator's, fabric's fi_route_pick: core does not link fabric).
 * Without one the routing figures are left out, saying so. */
void fi_bench_serve_set_router(fi_bench_route_fn fn);

/* The model path used when -m is not given: $FEDINFER_MODEL, else the
 * set-up script's download. */
const char *fi_default_model_path(void);

#include "fi_kernels.h"
/* Parses "auto", "portable" or "avx2"; prints an error and returns -1 for
 * anything else. */
int fi_parse_simd(const char *s, fi_simd *out);

/* The best read bandwidth, in bytes/s, of the pool's threads over `reps`
 * passes of a buffer of `bytes` (each thread its share, wide loads); 0
 * when the buffer cannot be had. The bench commands' floor: a decode that
 * reads every weight once a token runs at most this over the weights'
 * bytes. */
double fi_bench_read_bandwidth(fi_pool *pool, size_t bytes, int reps);

/* The integer instruction sequences of the CPU kernels' quantised products
 * (bench_probes.c): per sequence, 16 to 64 multiply-adds. */
typedef enum fi_peak_mix {
    FI_PEAK_MADDWD,    /* vpmaddwd + vpaddd, 16: 12- and 16-bit activations */
    FI_PEAK_MADDUBSW,  /* vpmaddubsw + vpaddw, 32: 8-bit, Q4 weights */
    FI_PEAK_Q8_SIGNED, /* vpsignb + vpmaddubsw + vpmaddwd + vpaddd, 32: 8-bit, Q8_0 */
    FI_PEAK_DPWSSD512, /* AVX512-VNNI vpdpwssd on 512 bits, 32: 12- and 16-bit */
    FI_PEAK_DPBUSD512, /* AVX512-VNNI vpdpbusd on 512 bits, 64: 8-bit, every type */
    FI_PEAK_N
} fi_peak_mix;
const char *fi_peak_mix_name(fi_peak_mix mix);
/* The best rate, in multiply-adds/s, at which the pool's threads run the
 * mix with every operand in registers, over `reps` timed passes (about
 * 0.1 s each); 0 where the processor lacks the mix's instructions. */
double fi_bench_product_peak(fi_pool *pool, fi_peak_mix mix, int reps);
struct fi_model;
/* The tokens/s that the products of a batch of tokens of model m can reach
 * at most on the CPU backend of SIMD flavour `simd` at act_bits-bit
 * activations: each weight type's multiply-adds a token
 * (fi_model_macs_per_token) at the peak rate of its kernels' mix, probed
 * now by the pool's threads; `what` says how. 0 where no probe fits the
 * flavour (portable, AVX-VNNI at 8 bits, AVX512 where the AMX tile
 * unit takes the 12- and 16-bit batches) or the weights (float),
 * `what` saying why. */
double fi_bench_product_ceiling(fi_pool *pool, const struct fi_model *m, const char *simd, int act_bits,
                                char *what, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* FI_CMD_H */
