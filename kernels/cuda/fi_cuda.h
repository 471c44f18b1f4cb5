/*
 * fi_cuda.h - the CUDA backend: fills fi_backend_ops (fi_kernels.h) with
 * device memory, hand-written kernels and cuBLASLt matrix products.
 *
 * Built only when CMake found nvcc (FEDINFER_HAVE_CUDA), as a shared module
 * (libfi_cuda.so) that the engine opens on demand through
 * fi_cuda_backend_open (kernels/fi_cuda_loader.c); tests link it directly. Everything a forward pass touches stays on the
 * device: weights are uploaded once (fi_weight.dev), activations and the
 * fp16 KV cache are device memory from ops->alloc, and only what the
 * caller asks for with ops->to_host (logits) or ops->argmax (one token id)
 * comes back.
 *
 * Errors: the operations of the table return nothing, so the backend keeps
 * the first CUDA or cuBLASLt failure (with the library's message) and from
 * then on skips further work; ops->to_host, ops->sync and ops->argmax return
 * -1, and ops->last_error gives the message. A failed backend stays failed:
 * destroy it.
 *
 * Threads: a backend may be used from any thread, one thread at a time; each
 * entry point makes the backend's device current for the calling thread.
 */
#ifndef FI_CUDA_H
#define FI_CUDA_H

#include <stddef.h>

#include "fi_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How weights live on the device. */
typedef enum fi_cuda_weights {
    /* Dequantised to fp16 at upload; every product goes through cuBLASLt
     * (fp16 inputs, fp32 accumulation and output). The default. */
    FI_CUDA_WEIGHTS_F16 = 0,
    /* Quantised types (Q4_0, Q4_1, Q8_0) kept as GGUF blocks: products of
     * up to FI_CUDA_QUANT_MAX_N tokens read the blocks directly (less memory
     * traffic per decoded token); larger ones dequantise the matrix into a
     * scratch buffer and use cuBLASLt. Float types are stored as fp16. */
    FI_CUDA_WEIGHTS_QUANT = 1,
} fi_cuda_weights;

/* Largest token count the quantised-read kernel takes (see above). */
#define FI_CUDA_QUANT_MAX_N 8

/* Number of CUDA devices, or -1 with CUDA's message in err when there is no
 * usable device (no driver, driver too old, no device: "CUDA driver version
 * is insufficient for CUDA runtime version", "no CUDA-capable device is
 * detected"). Never returns 0: no device is an error with a message. */
int fi_cuda_device_count(char *err, size_t errlen);

/* A backend on CUDA device `device` (0-based). The weight mode comes from
 * the environment variable FEDINFER_CUDA_WEIGHTS ("f16" or "quant"; unset:
 * f16) and can be changed with fi_cuda_backend_set_weights before any
 * weight is uploaded. Returns NULL with a message in err when the device is
 * absent or cannot be set up (the message carries CUDA's or cuBLASLt's).
 * Owned by the caller: release with fi_backend_destroy. */
fi_backend *fi_cuda_backend_new(int device, char *err, size_t errlen);

/* 1 when b is a CUDA backend. */
int fi_cuda_backend_is(const fi_backend *b);
/* The device's name ("NVIDIA H200"); NULL when b is not a CUDA backend. */
const char *fi_cuda_backend_device_name(const fi_backend *b);
/* Sets the weight mode; only before the first weight_upload. 0, or -1 when
 * b is not a CUDA backend, weights are already uploaded or mode is unknown. */
FI_MUST_CHECK int fi_cuda_backend_set_weights(fi_backend *b, fi_cuda_weights mode);
fi_cuda_weights fi_cuda_backend_weights(const fi_backend *b);

/* Decode steps as CUDA graphs (ops->graph_begin / graph_end), one per
 * batch size from 1 to 64, the first step of each size run directly: on
 * unless the environment variable FEDINFER_CUDA_GRAPHS is "0" at creation.
 * 0, or -1 when b is not a CUDA backend. */
FI_MUST_CHECK int fi_cuda_backend_set_graphs(fi_backend *b, int on);
/* Graphs launched since creation, and how many of them had to be
 * instantiated (the others updated the previous one of their key in
 * place). */
void fi_cuda_backend_graph_stats(const fi_backend *b, long *launched, long *instantiated);
/* Of the graphs launched, how many were relaunched without recording
 * (graph_begin_sig with the signature of the key's last recording). */
long fi_cuda_backend_graph_replays(const fi_backend *b);

/* Kernel timing with CUDA events, for the benchmark: while on, every
 * operation is bracketed by two events, and fi_cuda_backend_kernel_ms
 * returns the summed elapsed times of all operations since it was last
 * called (it synchronises). Costs a little time per operation, and no
 * graphs are recorded while it is on; off by default. -1 when b is not a
 * CUDA backend or on a CUDA error. */
FI_MUST_CHECK int fi_cuda_backend_set_profile(fi_backend *b, int on);
double fi_cuda_backend_kernel_ms(fi_backend *b);
/* The profiled time split by kind of operation ("matmul (cuBLASLt)",
 * "attention", ...) since the last call: up to cap kinds, each with its
 * name (static), milliseconds and number of operations; returns how many
 * kinds were filled (those with no operation are left out), or -1 (not a
 * CUDA backend, CUDA error). Synchronises, and starts the split again. */
int fi_cuda_backend_profile_ops(fi_backend *b, const char **name, double *ms, long *calls, int cap);

#ifdef __cplusplus
}
#endif
#endif /* FI_CUDA_H */
