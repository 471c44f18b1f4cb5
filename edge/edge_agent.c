/*
 * edge_agent.c - the edge agent's life: load the model, the policy and the
 * audit log, start the executors and the HTTP server; reload on request;
 * stop within a bound.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sodium.h>
#include <string.h>
#include <time.h>

#include "edge_impl.h"

fi_edge *fi_edge_new(const fi_edge_conf *c, char *err, size_t errlen) {
    fi_edge *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    e->conf = *c;
    e->file = *c;
    e->lim = (edge_limits){c->max_tokens, c->default_max_tokens, c->max_body, c->request_timeout_s};
    pthread_rwlock_init(&e->lim_lk, NULL);
    atomic_init(&e->next_id, 1);
    /* ids unique across restarts too: clients keep them as keys */
    if (sodium_init() < 0) {
        snprintf(err, errlen, "libsodium cannot initialise");
        goto fail;
    }
    snprintf(e->id_salt, sizeof e->id_salt, "%08x", (unsigned)randombytes_random());
    e->started = (long)time(NULL);
    if (c->model[0]) {
        fi_model_opts mo = {.n_threads = c->threads, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_AUTO,
                            .act_bits = c->act_bits, .kv_bits = c->kv_bits,
                            .sha256 = c->model_sha256};
        if (!(e->model = fi_model_load(c->model, &mo, err, errlen))) goto fail;
        int ctx_train = fi_model_config(e->model)->ctx_train;
        if (e->conf.n_ctx > ctx_train) e->conf.n_ctx = ctx_train;
        if (edge_local_new(e->model, c->concurrency, c->queue, e->conf.n_ctx, &e->local, err,
                           errlen) != 0)
            goto fail;
    }
    if (!(e->policy = edge_policy_new(c->policy_dir, c->policy_key, c->db, c->site, c->clusters, err,
                                     errlen)))
        goto fail;
    /* c->db: edge_policy_new has just checked the file */
    if (c->auth && !(e->tokens = edge_auth_open(c->db, 0, err, errlen))) goto fail;
    if (c->coordinator[0] && edge_remote_new(e, &e->remote, err, errlen) != 0) goto fail;
    if (edge_http_start(e, err, errlen) != 0) goto fail;
    /* the backend the load landed on: a GPU when one is visible (a
     * sandbox that hides /dev/nvidia* gives the CPU) */
    char dev[96];
    fi_backend_describe(e->model ? fi_model_backend(e->model) : NULL, dev, sizeof dev);
    fprintf(stderr, "edge: site %s serving on http://%s:%d (model %s on %s, concurrency %d, "
                    "queue %d%s%s)\n",
            c->site, c->listen, e->port, e->model ? c->model_name : "none", dev, c->concurrency,
            c->queue, c->coordinator[0] ? ", coordinator " : ", offline only",
            c->coordinator[0] ? c->coordinator : "");
    return e;
fail:
    fi_edge_destroy(&e);
    return NULL;
}

int fi_edge_port(const fi_edge *e) { return e->port; }

edge_limits edge_limits_now(fi_edge *e) {
    pthread_rwlock_rdlock(&e->lim_lk);
    edge_limits l = e->lim;
    pthread_rwlock_unlock(&e->lim_lk);
    return l;
}

int edge_conf_restart_keys(const fi_edge_conf *run, const fi_edge_conf *nc, char *out, size_t cap) {
    static const char *const live[] = {"max_tokens", "default_max_tokens", "max_body",
                                       "request_timeout_s", NULL};
    int n = 0;
    size_t at = 0;
    if (cap) out[0] = '\0';
    for (const fi_conf_key *k = fi_edge_conf_keys; k->name; k++) {
        int reloads = 0;
        for (int i = 0; live[i]; i++) reloads |= !strcmp(k->name, live[i]);
        if (reloads) continue;
        const char *a = (const char *)run + k->offset, *b = (const char *)nc + k->offset;
        int same = k->type == FI_CONF_STR ? !strcmp(a, b) : *(const int *)a == *(const int *)b;
        if (same) continue;
        int w = snprintf(out + at, cap > at ? cap - at : 0, "%s%s", n ? ", " : "", k->name);
        if (w > 0 && at + (size_t)w < cap) at += (size_t)w;
        n++;
    }
    return n;
}

void fi_edge_reload(fi_edge *e, const char *path) {
    fi_edge_conf nc;
    char err[768];
    fi_edge_conf_default(&nc);
    if (path && fi_edge_conf_load(path, &nc, err, sizeof err) != 0) {
        fprintf(stderr, "edge: reload: %s; keeping the running configuration\n", err);
    } else if (path) {
        /* Limits take effect for new requests; what is bound to sockets,
         * threads and files needs a restart. */
        pthread_rwlock_wrlock(&e->lim_lk);
        e->lim = (edge_limits){nc.max_tokens, nc.default_max_tokens, nc.max_body, nc.request_timeout_s};
        pthread_rwlock_unlock(&e->lim_lk);
        char keys[1024];
        if (edge_conf_restart_keys(&e->file, &nc, keys, sizeof keys) > 0)
            fprintf(stderr, "edge: reload: %s changed in %s; they take effect only on restart "
                            "(the running values stay)\n",
                    keys, path);
        fprintf(stderr, "edge: reload: limits applied (max_tokens %d, max_body %d, timeout %d s)\n",
                nc.max_tokens, nc.max_body, nc.request_timeout_s);
    }
    edge_policy_reload(e->policy);
}

void fi_edge_destroy(fi_edge **ep) {
    fi_edge *e = *ep;
    if (!e) return;
    *ep = NULL;
    atomic_store(&e->stopping, 1);
    /* One grace for both executors: the routed work runs on meanwhile, and
     * gets what is left of it after the local drain (each had a grace of
     * its own, so a stop took up to twice shutdown_grace_s) */
    int grace = e->conf.shutdown_grace_s * 1000;
    double t0 = edge_now();
    if (e->local.ctx) e->local.drain(e->local.ctx, grace);
    int left = grace - (int)((edge_now() - t0) * 1000);
    if (e->remote.ctx) e->remote.drain(e->remote.ctx, left > 0 ? left : 0);
    edge_http_stop(e);
    if (e->local.ctx) e->local.destroy(e->local.ctx);
    if (e->remote.ctx) e->remote.destroy(e->remote.ctx);
    edge_auth_close(&e->tokens);
    edge_policy_destroy(&e->policy);
    fi_model_destroy(&e->model);
    pthread_rwlock_destroy(&e->lim_lk);
    free(e);
}
