/*
 * graph_backend.h - CUDA's graph contract on the CPU backend, for tests.
 *
 * fi_graph_wrap wraps a backend in place (be->ops and be->ctx are
 * replaced; destroying be destroys both) and gives it graph_begin,
 * graph_begin_sig and graph_end with the CUDA backend's rules, so that the
 * engine's side of them runs in CI, where there is no GPU:
 *   - the first step of each key runs directly (graph_begin returns -1);
 *   - a recording runs nothing until graph_end: the calls are kept, each
 *     with its arguments (pointers, sizes) as they were, and to_backend
 *     copies the host bytes into a staging buffer at once;
 *   - graph_end runs the kept calls, reading the staged bytes;
 *   - alloc and free are refused in between, and end every recording
 *     when made outside (a buffer may come back where a freed one was);
 *   - graph_begin_sig with the signature of the key's last recording
 *     relaunches it: the calls in between are only hashed and checked
 *     against the recording, to_backend writes the same staging offsets,
 *     and graph_end runs the recorded calls again. A difference fails the
 *     step (graph_end -1, last_error says "graph replay").
 * So a signature that leaves out something the calls depend on makes a
 * relaunch run stale arguments, and the outputs differ from a plain
 * backend's, or the check fails.
 *
 * It also gives the backend the fused operations (norm_matmul_n,
 * norm_matmul_swiglu, rope_store) as the calls they replace, so that the
 * engine's path through them runs too.
 */
#ifndef GRAPH_BACKEND_H
#define GRAPH_BACKEND_H

#include "fi_kernels.h"

typedef struct fi_graph_backend fi_graph_backend;

fi_graph_backend *fi_graph_wrap(fi_backend *be);
/* Steps recorded, relaunched, and run directly (first of their key). */
void fi_graph_stats(const fi_graph_backend *g, long *recorded, long *relaunched, long *direct);

#endif /* GRAPH_BACKEND_H */
