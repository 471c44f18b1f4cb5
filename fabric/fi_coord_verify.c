/*
 * fi_coord_verify.c - verify of the coordinator's audit log on its own
 * thread. See fi_coord_verify.h.
 */
#include "fi_coord_verify.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "fi_coord_ship.h"

struct fi_coord_verify {
    fi_audit *au;          /* read-only connection, the thread's while it runs */
    pthread_t th;          /* the running verify */
    pthread_mutex_t mu;    /* guards the fields below */
    int running;           /* a thread was started and is not joined yet */
    int done;              /* ... and has finished: its result is below */
    uint64_t serial;       /* who asked */
    int rc;                /* fi_audit_verify's result */
    fi_audit_check ck;
    char err[400];
};

fi_coord_verify *fi_coord_verify_new(const char *path, char *err, size_t errlen) {
    fi_coord_verify *v = calloc(1, sizeof *v);
    if (!v) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (!(v->au = fi_audit_open_readonly(path, err, errlen))) {
        free(v);
        return NULL;
    }
    pthread_mutex_init(&v->mu, NULL);
    return v;
}

static void *s_run(void *arg) {
    fi_coord_verify *v = arg;
    fi_audit_check ck;
    char err[sizeof v->err] = "";
    int rc = fi_audit_verify(v->au, &ck, err, sizeof err);
    pthread_mutex_lock(&v->mu);
    v->rc = rc;
    v->ck = ck;
    snprintf(v->err, sizeof v->err, "%s", err);
    v->done = 1;
    pthread_mutex_unlock(&v->mu);
    return NULL;
}

int fi_coord_verify_start(fi_coord_verify *v, uint64_t serial) {
    pthread_mutex_lock(&v->mu);
    int busy = v->running;
    if (!busy) {
        v->running = 1;
        v->done = 0;
        v->serial = serial;
    }
    pthread_mutex_unlock(&v->mu);
    if (busy) return 1;
    if (pthread_create(&v->th, NULL, s_run, v) != 0) {
        pthread_mutex_lock(&v->mu);
        v->running = 0;
        pthread_mutex_unlock(&v->mu);
        return -1;
    }
    return 0;
}

int fi_coord_verify_done(fi_coord_verify *v, uint64_t *serial, uint8_t **reply, size_t *len) {
    pthread_mutex_lock(&v->mu);
    int done = v->running && v->done;
    pthread_mutex_unlock(&v->mu);
    if (!done) return 0;
    pthread_join(v->th, NULL); /* it has finished: no wait */
    *serial = v->serial;
    *reply = fi_ship_verify_reply(v->rc, &v->ck, v->err, len);
    pthread_mutex_lock(&v->mu);
    v->running = v->done = 0;
    pthread_mutex_unlock(&v->mu);
    return 1;
}

void fi_coord_verify_destroy(fi_coord_verify **vp) {
    fi_coord_verify *v = vp ? *vp : NULL;
    if (!v) return;
    *vp = NULL;
    pthread_mutex_lock(&v->mu);
    int running = v->running;
    pthread_mutex_unlock(&v->mu);
    if (running) {
        /* an interrupt before the walk's first statement is lost: again
         * until the thread has finished */
        for (;;) {
            pthread_mutex_lock(&v->mu);
            int done = v->done;
            pthread_mutex_unlock(&v->mu);
            if (done) break;
            fi_audit_interrupt(v->au);
            nanosleep(&(struct timespec){0, 5000000}, NULL);
        }
        pthread_join(v->th, NULL);
    }
    fi_audit_destroy(&v->au);
    pthread_mutex_destroy(&v->mu);
    free(v);
}
