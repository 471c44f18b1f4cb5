/*
 * fi_coord_audit.c - the coordinator's routing records, written by a
 * thread of their own. See fi_coord_audit.h.
 */
#include "fi_coord_audit.h"
#include "fi_coord.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define S_MAX_QUEUE 65536 /* records waiting, at most */
#define S_MAX_BATCH 1024  /* records in one transaction, at most */
#define S_SOURCE "coordinator:router"
#define S_BUSY_MS 250        /* the writer's wait for a lock, per try */
#define S_RETRY_MIN_MS 100   /* first wait after a failed write, doubling */
#define S_RETRY_MAX_MS 5000  /* ... up to this */
#define S_STOP_TRY_MS 10000  /* when stopping, how long a failing write is retried */

/* A record's strings, owned. */
typedef struct s_rec {
    fi_audit_record r;   /* strings point into s */
    char *s;             /* all of them, NUL-separated */
} s_rec;

struct fi_coord_audit {
    fi_audit *log;             /* the writer's connection */
    pthread_t th;
    pthread_mutex_t mu;        /* guards the queue and the counters */
    pthread_cond_t cv;         /* work for the writer, or room for the loop */
    pthread_cond_t stop_cv;    /* a stop: wakes a writer pausing between tries */
    uint64_t stop_at;          /* once stopping: when failing writes are given up (0: not yet) */
    s_rec *q;                  /* ring of S_MAX_QUEUE */
    size_t head, n;            /* first queued, how many */
    unsigned long long put, written; /* records queued / written so far */
    int stop;                  /* the writer ends once the queue is empty */
};

static char *s_dup(const fi_audit_record *r, fi_audit_record *out) {
    const char *f[10] = {r->request_id, r->tenant, r->application, r->origin, r->labels,
                         r->model, r->decision, r->target, r->rules, r->policy_digest};
    size_t len = 0;
    for (int i = 0; i < 10; i++) len += strlen(f[i] ? f[i] : "") + 1;
    char *s = malloc(len), *p = s;
    if (!s) return NULL;
    const char **dst[10] = {&out->request_id, &out->tenant, &out->application, &out->origin,
                            &out->labels, &out->model, &out->decision, &out->target,
                            &out->rules, &out->policy_digest};
    *out = *r;
    for (int i = 0; i < 10; i++) {
        size_t n = strlen(f[i] ? f[i] : "") + 1;
        memcpy(p, f[i] ? f[i] : "", n);
        /* as the log will store them: the chain hashed here (the source
         * hash of the records) must be the one verify recomputes */
        fi_text_clean(p);
        *dst[i] = p;
        p += n;
    }
    out->source = NULL; /* the log's ingest sets provenance */
    return s;
}

/* Writes batch[0..n) as the next records of our source's chain: 0, or -1
 * with err when it could not be written now (a lock held elsewhere, a
 * full disk, out of memory): the caller tries again. */
static int s_write(fi_coord_audit *a, s_rec *batch, size_t n, char *err, size_t errlen) {
    char head[65];
    int64_t seq = 0;
    fi_audit_record *recs = calloc(n, sizeof *recs);
    if (!recs) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (fi_audit_source_head(a->log, S_SOURCE, &seq, head, err, errlen) != 0) {
        free(recs);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        recs[i] = batch[i].r;
        recs[i].seq = seq + 1 + (int64_t)i;
        fi_audit_chain_hash(i ? recs[i - 1].hash : head, &recs[i], recs[i].hash);
    }
    size_t taken = 0;
    /* the chain is ours, computed just now from the held head: a refusal
     * (1) cannot come from the records, only from the log moving under
     * us, so it is tried again like a database error */
    int rc = fi_audit_ingest(a->log, S_SOURCE, NULL, recs, n, &taken, err, errlen);
    free(recs);
    return rc == 0 ? 0 : -1;
}

static uint64_t s_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Writes the batch, trying again with a growing pause while it fails, so
 * that a record accepted is not lost to a passing lock or a full disk
 * (the queue meanwhile fills, and when it is full the loop waits). Once
 * stopping, a failing write is tried for S_STOP_TRY_MS, then the batch is
 * reported lost. */
static void s_write_retrying(fi_coord_audit *a, s_rec *batch, size_t n) {
    char err[256];
    unsigned pause = S_RETRY_MIN_MS, tries = 0;
    while (s_write(a, batch, n, err, sizeof err) != 0) {
        if (!tries++)
            fi_coord_log("audit: %s: %zu routing record(s) wait; trying again", err, n);
        pthread_mutex_lock(&a->mu);
        /* one deadline for everything still queued when the stop came */
        if (a->stop && !a->stop_at) a->stop_at = s_ms() + S_STOP_TRY_MS;
        if (a->stop_at && s_ms() >= a->stop_at) {
            pthread_mutex_unlock(&a->mu);
            fi_coord_log("audit: %s: %zu routing record(s) NOT WRITTEN (stopping after %u tries)", err,
                         n, tries);
            return;
        }
        unsigned wait = a->stop && pause > S_RETRY_MIN_MS ? S_RETRY_MIN_MS : pause;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += wait / 1000;
        ts.tv_nsec += (long)(wait % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        /* not a->cv: every put signals that, and the pause would not grow */
        (void)pthread_cond_timedwait(&a->stop_cv, &a->mu, &ts);
        pthread_mutex_unlock(&a->mu);
        pause = pause * 2 > S_RETRY_MAX_MS ? S_RETRY_MAX_MS : pause * 2;
    }
    if (tries)
        fi_coord_log("audit: %zu routing record(s) written after %u tries", n, tries + 1);
}

static void *s_main(void *arg) {
    fi_coord_audit *a = arg;
    s_rec *batch = calloc(S_MAX_BATCH, sizeof *batch);
    for (;;) {
        pthread_mutex_lock(&a->mu);
        while (!a->n && !a->stop) pthread_cond_wait(&a->cv, &a->mu);
        if (!a->n && a->stop) {
            pthread_mutex_unlock(&a->mu);
            break;
        }
        size_t n = 0;
        while (a->n && n < S_MAX_BATCH && batch) {
            batch[n++] = a->q[a->head];
            a->head = (a->head + 1) % S_MAX_QUEUE;
            a->n--;
        }
        pthread_cond_broadcast(&a->cv); /* room */
        pthread_mutex_unlock(&a->mu);
        if (!batch) break;
        s_write_retrying(a, batch, n);
        for (size_t i = 0; i < n; i++) free(batch[i].s);
        pthread_mutex_lock(&a->mu);
        a->written += n;
        pthread_cond_broadcast(&a->cv);
        pthread_mutex_unlock(&a->mu);
    }
    free(batch);
    return NULL;
}

fi_coord_audit *fi_coord_audit_new(const char *path, char *err, size_t errlen) {
    fi_coord_audit *a = calloc(1, sizeof *a);
    if (!a || !(a->q = calloc(S_MAX_QUEUE, sizeof *a->q))) {
        snprintf(err, errlen, "out of memory");
        if (a) free(a);
        return NULL;
    }
    if (!(a->log = fi_audit_open(path, err, errlen))) {
        free(a->q);
        free(a);
        return NULL;
    }
    fi_audit_busy_timeout(a->log, S_BUSY_MS); /* the writer retries by itself */
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    pthread_cond_init(&a->stop_cv, NULL);
    if (pthread_create(&a->th, NULL, s_main, a) != 0) {
        snprintf(err, errlen, "cannot start the audit writer");
        fi_audit_destroy(&a->log);
        pthread_mutex_destroy(&a->mu);
        pthread_cond_destroy(&a->cv);
        pthread_cond_destroy(&a->stop_cv);
        free(a->q);
        free(a);
        return NULL;
    }
    return a;
}

void fi_coord_audit_destroy(fi_coord_audit **ap) {
    fi_coord_audit *a = *ap;
    if (!a) return;
    *ap = NULL;
    pthread_mutex_lock(&a->mu);
    a->stop = 1;
    pthread_cond_broadcast(&a->cv);
    pthread_cond_broadcast(&a->stop_cv);
    pthread_mutex_unlock(&a->mu);
    pthread_join(a->th, NULL);
    for (size_t i = 0; i < a->n; i++) free(a->q[(a->head + i) % S_MAX_QUEUE].s);
    fi_audit_destroy(&a->log);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    pthread_cond_destroy(&a->stop_cv);
    free(a->q);
    free(a);
}

int fi_coord_audit_put(fi_coord_audit *a, const fi_audit_record *rec) {
    s_rec r;
    memset(&r, 0, sizeof r);
    if (!(r.s = s_dup(rec, &r.r))) return -1;
    pthread_mutex_lock(&a->mu);
    while (a->n == S_MAX_QUEUE) pthread_cond_wait(&a->cv, &a->mu); /* never drop one */
    a->q[(a->head + a->n) % S_MAX_QUEUE] = r;
    a->n++;
    a->put++;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    return 0;
}

void fi_coord_audit_flush(fi_coord_audit *a) {
    pthread_mutex_lock(&a->mu);
    unsigned long long want = a->put;
    while (a->written < want) pthread_cond_wait(&a->cv, &a->mu);
    pthread_mutex_unlock(&a->mu);
}
