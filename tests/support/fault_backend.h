/*
 * fault_backend.h - a backend that fails the way a GPU does, for tests.
 *
 * fi_fault_wrap wraps an existing backend in place (be->ops and be->ctx
 * are replaced; destroying be destroys both). It passes every call through
 * until fi_fault_set(f, 1); from then on, as after a lost device or a
 * kernel fault, operations do nothing and sync, to_host, to_backend, copy
 * and argmax return -1, alloc returns NULL, and last_error says "injected
 * failure: the device is lost". The failure is sticky, as CUDA's are:
 * nothing but a new backend (fi_model_reset_backend) ends it.
 */
#ifndef FAULT_BACKEND_H
#define FAULT_BACKEND_H

#include "fi_kernels.h"

typedef struct fi_fault_backend fi_fault_backend;

fi_fault_backend *fi_fault_wrap(fi_backend *be);
/* From any thread. */
void fi_fault_set(fi_fault_backend *f, int fail);
/* The backend fails in the passes-th forward pass from now (each pass
 * ends with one sync, which then reports the failure), as a device lost
 * in the middle of a request. */
void fi_fault_after(fi_fault_backend *f, int passes);

#endif /* FAULT_BACKEND_H */
