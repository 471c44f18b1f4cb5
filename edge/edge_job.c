/*
 * edge_job.c - a request in flight: the channel between an executor, which
 * produces text token by token, and the HTTP connection, which waits for
 * it. Stop strings are applied here, on the text itself, so local and
 * routed answers stop the same way.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "edge_impl.h"

double edge_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct timespec edge_deadline_ms(long ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

edge_job *edge_job_new(const char *id, const char *model, const char *const *stop, int n_stop) {
    edge_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    snprintf(j->id, sizeof j->id, "%s", id);
    snprintf(j->model, sizeof j->model, "%s", model);
    j->ts = fi_textstream_new(stop, n_stop);
    j->out_cap = 256;
    j->out = malloc(j->out_cap);
    if (!j->ts || !j->out) {
        fi_textstream_destroy(&j->ts);
        free(j->out);
        free(j);
        return NULL;
    }
    j->out[0] = 0;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    atomic_init(&j->refs, 1);
    atomic_init(&j->cancel, 0);
    j->t_submit = edge_now();
    return j;
}

void edge_routed_free(edge_routed **rp) {
    edge_routed *r = *rp;
    if (!r) return;
    *rp = NULL;
    for (int i = 0; i < r->n_msgs; i++) {
        free(r->roles[i]);
        free(r->contents[i]);
    }
    free(r->roles);
    free(r->contents);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->hashes);
    free(r);
}

void edge_job_ref(edge_job *j) { atomic_fetch_add(&j->refs, 1); }

void edge_job_unref(edge_job **jp) {
    edge_job *j = *jp;
    *jp = NULL;
    if (!j || atomic_fetch_sub(&j->refs, 1) != 1) return;
    fi_textstream_destroy(&j->ts);
    free(j->out);
    free(j->text);
    free(j->prompt);
    for (int i = 0; i < j->n_labels; i++) free(j->labels[i]);
    edge_routed_free(&j->routed);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

/* Appends released text; caller holds mu. -1 when out of memory. */
static int s_take(edge_job *j, int flush) {
    size_t n;
    const char *p = fi_textstream_take(j->ts, flush, &n);
    if (!n) return 0;
    if (j->out_len + n + 1 > j->out_cap) {
        size_t cap = j->out_cap;
        while (j->out_len + n + 1 > cap) cap *= 2;
        char *o = realloc(j->out, cap);
        if (!o) return -1;
        j->out = o;
        j->out_cap = cap;
    }
    memcpy(j->out + j->out_len, p, n);
    j->out_len += n;
    j->out[j->out_len] = 0;
    if (j->t_first == 0) j->t_first = edge_now();
    pthread_cond_broadcast(&j->cv);
    return 0;
}

int edge_job_emit(edge_job *j, const char *bytes, size_t len) {
    pthread_mutex_lock(&j->mu);
    int rc = -1;
    if (j->done) {
        rc = 1;
        goto out;
    }
    int hit = fi_textstream_push(j->ts, bytes, len);
    if (hit < 0 || s_take(j, 0) != 0) goto out;
    rc = hit;
out:
    pthread_mutex_unlock(&j->mu);
    return rc;
}

void edge_job_finish(edge_job *j, const char *finish, int n_prompt, int n_gen) {
    pthread_mutex_lock(&j->mu);
    if (!j->done) {
        (void)s_take(j, 1);
        snprintf(j->finish, sizeof j->finish, "%s", finish);
        j->n_prompt_tokens = n_prompt;
        j->n_completion_tokens = n_gen;
        j->done = 1;
        pthread_cond_broadcast(&j->cv);
    }
    pthread_mutex_unlock(&j->mu);
}

int edge_job_unseen(edge_job *j, int reset) {
    pthread_mutex_lock(&j->mu);
    int unseen = !j->done && (!j->stream || j->out_len == 0);
    if (unseen && reset) {
        fi_textstream_reset(j->ts);
        j->out_len = 0;
        j->out[0] = 0;
        j->t_first = 0;
    }
    pthread_mutex_unlock(&j->mu);
    return unseen;
}

void edge_job_fail(edge_job *j, int http_status, const char *code, const char *msg) {
    pthread_mutex_lock(&j->mu);
    if (!j->done) {
        j->http_status = http_status;
        snprintf(j->err_code, sizeof j->err_code, "%s", code);
        snprintf(j->err, sizeof j->err, "%s", msg);
        j->done = 1;
        pthread_cond_broadcast(&j->cv);
    }
    pthread_mutex_unlock(&j->mu);
}
