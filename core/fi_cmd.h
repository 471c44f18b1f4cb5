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

#ifdef __cplusplus
}
#endif
#endif /* FI_CMD_H */
