/*
 * fault_backend.c - see fault_backend.h.
 */
#include "fault_backend.h"

#include <stdatomic.h>
#include <stdlib.h>

struct fi_fault_backend {
    const fi_backend_ops *in; /* the wrapped table */
    void *ictx;               /* and its context */
    fi_backend_ops ops;       /* ours */
    atomic_int fail;
    atomic_int after;         /* > 0: syncs to pass before failing (fi_fault_after) */
};

#define F(ctx) ((fi_fault_backend *)(ctx))
#define FAILED(ctx) atomic_load(&F(ctx)->fail)

static void f_destroy(void *ctx) {
    fi_fault_backend *f = F(ctx);
    f->in->destroy(f->ictx);
    free(f);
}
static void *f_alloc(void *ctx, size_t n) {
    return FAILED(ctx) ? NULL : F(ctx)->in->alloc(F(ctx)->ictx, n);
}
static void f_free(void *ctx, void *p) {
    F(ctx)->in->free(F(ctx)->ictx, p); /* giving back still works */
}
static int f_to_backend(void *ctx, void *d, const void *s, size_t n) {
    return FAILED(ctx) ? -1 : F(ctx)->in->to_backend(F(ctx)->ictx, d, s, n);
}
static int f_to_host(void *ctx, void *d, const void *s, size_t n) {
    return FAILED(ctx) ? -1 : F(ctx)->in->to_host(F(ctx)->ictx, d, s, n);
}
static int f_copy(void *ctx, void *d, const void *s, size_t n) {
    return FAILED(ctx) ? -1 : F(ctx)->in->copy(F(ctx)->ictx, d, s, n);
}
static int f_weight_upload(void *ctx, fi_weight *w) {
    return FAILED(ctx) ? -1 : F(ctx)->in->weight_upload(F(ctx)->ictx, w);
}
static void f_weight_release(void *ctx, fi_weight *w) {
    F(ctx)->in->weight_release(F(ctx)->ictx, w);
}
static int f_sync(void *ctx) {
    if (atomic_load(&F(ctx)->after) > 0 && atomic_fetch_sub(&F(ctx)->after, 1) == 1)
        atomic_store(&F(ctx)->fail, 1); /* this pass is the one that fails */
    return FAILED(ctx) ? -1 : F(ctx)->in->sync(F(ctx)->ictx);
}
static void f_matmul(void *ctx, float *y, const fi_weight *w, const float *x, int n) {
    if (!FAILED(ctx)) F(ctx)->in->matmul(F(ctx)->ictx, y, w, x, n);
}
static void f_get_rows(void *ctx, float *y, const fi_weight *w, const int32_t *tok, int n) {
    if (!FAILED(ctx)) F(ctx)->in->get_rows(F(ctx)->ictx, y, w, tok, n);
}
static void f_rmsnorm(void *ctx, float *y, const float *x, const float *g, int n, int dim,
                      float eps) {
    if (!FAILED(ctx)) F(ctx)->in->rmsnorm(F(ctx)->ictx, y, x, g, n, dim, eps);
}
static void f_rope(void *ctx, float *x, int n, int nh, int hd, const int32_t *pos, float theta) {
    if (!FAILED(ctx)) F(ctx)->in->rope(F(ctx)->ictx, x, n, nh, hd, pos, theta);
}
static void f_attention(void *ctx, float *out, const float *q, const void *k,
                        const void *v, int n, const int32_t *pos, const fi_kv_map *map,
                        int nh, int nkv, int hd) {
    if (!FAILED(ctx)) F(ctx)->in->attention(F(ctx)->ictx, out, q, k, v, n, pos, map, nh, nkv, hd);
}
static void f_store_f16(void *ctx, uint16_t *d, const float *s, size_t n) {
    if (!FAILED(ctx)) F(ctx)->in->store_f16(F(ctx)->ictx, d, s, n);
}
static void f_swiglu(void *ctx, float *g, const float *u, size_t n) {
    if (!FAILED(ctx)) F(ctx)->in->swiglu(F(ctx)->ictx, g, u, n);
}
static void f_add(void *ctx, float *y, const float *x, size_t n) {
    if (!FAILED(ctx)) F(ctx)->in->add(F(ctx)->ictx, y, x, n);
}
static const char *f_last_error(void *ctx) {
    if (FAILED(ctx)) return "injected failure: the device is lost";
    return F(ctx)->in->last_error ? F(ctx)->in->last_error(F(ctx)->ictx) : NULL;
}
static int f_argmax(void *ctx, int32_t *out, const float *x, int n) {
    return FAILED(ctx) ? -1 : F(ctx)->in->argmax(F(ctx)->ictx, out, x, n);
}
static void f_kv_store(void *ctx, void *c, const float *s, int n, const int32_t *slot,
                       int row, int hd) {
    if (!FAILED(ctx)) F(ctx)->in->kv_store(F(ctx)->ictx, c, s, n, slot, row, hd);
}
static void f_matmul_n(void *ctx, int count, float *const *y, const fi_weight *const *w,
                       const float *x, int n) {
    if (!FAILED(ctx)) F(ctx)->in->matmul_n(F(ctx)->ictx, count, y, w, x, n);
}
static void f_matmul_add(void *ctx, float *acc, float *y, const fi_weight *w, const float *x,
                         int n) {
    if (!FAILED(ctx)) F(ctx)->in->matmul_add(F(ctx)->ictx, acc, y, w, x, n);
}
static void f_matmul_argmax(void *ctx, float *y, int32_t *idx, const fi_weight *w,
                            const float *x, int n) {
    if (!FAILED(ctx)) F(ctx)->in->matmul_argmax(F(ctx)->ictx, y, idx, w, x, n);
}

fi_fault_backend *fi_fault_wrap(fi_backend *be) {
    fi_fault_backend *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    const fi_backend_ops *in = be->ops;
    f->in = in;
    f->ictx = be->ctx;
    fi_backend_ops o = {0};
    o.name = in->name;
    o.destroy = f_destroy;
    o.alloc = f_alloc;
    o.free = f_free;
    o.to_backend = f_to_backend;
    o.to_host = f_to_host;
    o.copy = f_copy;
    o.weight_upload = in->weight_upload ? f_weight_upload : NULL;
    o.weight_release = in->weight_release ? f_weight_release : NULL;
    o.sync = f_sync;
    o.matmul = f_matmul;
    o.get_rows = f_get_rows;
    o.rmsnorm = f_rmsnorm;
    o.rope = f_rope;
    o.attention = f_attention;
    o.store_f16 = f_store_f16;
    o.swiglu = f_swiglu;
    o.add = f_add;
    o.last_error = f_last_error;
    o.argmax = in->argmax ? f_argmax : NULL;
    o.graph_begin = NULL; /* no graphs: every call passes through */
    o.graph_end = NULL;
    o.kv_store = f_kv_store;
    o.matmul_n = in->matmul_n ? f_matmul_n : NULL;
    o.host_memory = in->host_memory;
    o.matmul_add = in->matmul_add ? f_matmul_add : NULL;
    o.matmul_argmax = in->matmul_argmax ? f_matmul_argmax : NULL;
    f->ops = o;
    be->ops = &f->ops;
    be->ctx = f;
    return f;
}

void fi_fault_set(fi_fault_backend *f, int fail) {
    atomic_store(&f->fail, fail);
}

void fi_fault_after(fi_fault_backend *f, int passes) {
    atomic_store(&f->after, passes);
}
