/*
 * fi_pool.c - persistent thread pool with low dispatch latency.
 *
 * Decode runs a few hundred small jobs per token, so a job must reach the
 * workers in well under a microsecond when they are busy-ish. Protocol:
 *
 *   - The caller publishes (fn, arg), sets `pending` to n-1 and bumps the
 *     generation counter `gen`. Workers spin on `gen` for a short while
 *     after each job (FI_POOL_SPIN_NS) and then sleep on `cv_work`.
 *   - A sleeping worker first increments `sleepers` and re-reads `gen`
 *     under the mutex; the caller bumps `gen` and then reads `sleepers`
 *     (both sequentially consistent), so either the worker sees the new
 *     generation or the caller sees the sleeper and broadcasts under the
 *     mutex. No wake-up can be lost, and no syscall is made while every
 *     worker is still spinning.
 *   - Completion is the mirror image: the caller runs its share as worker
 *     0, spins on `pending`, then sleeps on `cv_done` with the same
 *     sleeper handshake (`caller_sleeping`).
 */
#include "fi_kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

/* How long a waiting thread spins before sleeping, in nanoseconds, and
 * after how long it starts yielding its core while it spins (so that a
 * pool with more threads than free cores still makes progress). */
#define FI_POOL_SPIN_NS 200000L
#define FI_POOL_YIELD_NS 20000L

typedef struct s_worker {
    struct fi_pool *pool;   /* owning pool */
    int ith;                /* worker index, 1..n-1 */
    pthread_t thread;       /* its thread */
} s_worker;

struct fi_pool {
    int n;                          /* workers including the caller */
    s_worker *workers;              /* n-1 entries (index 1..n-1 used as ith) */
    int started;                    /* threads successfully created */
    pthread_mutex_t mu;             /* guards sleeping on either condvar */
    pthread_cond_t cv_work;         /* signalled when gen moves or stop */
    pthread_cond_t cv_done;         /* signalled when pending hits 0 */
    atomic_uint gen;                /* job generation, bumped per job */
    atomic_int pending;             /* workers still running this job */
    atomic_int sleepers;            /* workers inside the cv_work wait */
    atomic_int caller_sleeping;     /* 1 while the caller waits on cv_done */
    atomic_int stop;                /* 1: workers exit */
    fi_pool_fn fn;                  /* current job, valid while pending */
    void *arg;                      /* its argument */
};

static void s_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long s_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Spin state: call s_spin_step once per failed poll; it returns 0 when
 * the spin budget is spent and the caller should sleep. */
typedef struct s_spin {
    unsigned i;     /* polls so far */
    long start;     /* first clock reading, 0 before it */
} s_spin;

static int s_spin_step(s_spin *sp) {
    if ((++sp->i & 31u) == 0) {
        long now = s_now_ns();
        if (sp->start == 0)
            sp->start = now;
        else if (now - sp->start > FI_POOL_SPIN_NS)
            return 0;
        else if (now - sp->start > FI_POOL_YIELD_NS)
            sched_yield();
    }
    s_cpu_relax();
    return 1;
}

/* Spins until gen differs from seen or the spin budget runs out; returns
 * the last value read. */
static unsigned s_spin_gen(fi_pool *p, unsigned seen) {
    s_spin sp = {0, 0};
    for (;;) {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->stop, memory_order_relaxed))
            return g;
        if (!s_spin_step(&sp))
            return g;
    }
}

static void *s_worker_main(void *argp) {
    s_worker *w = argp;
    fi_pool *p = w->pool;
    /* Workers start before any job can be posted (fi_pool_new returns
     * after creating them), so generation 0 has never run. */
    unsigned seen = 0;
    for (;;) {
        unsigned g = s_spin_gen(p, seen);
        if (g == seen && !atomic_load(&p->stop)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv_work, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            break;
        seen = g;
        p->fn(p->arg, w->ith, p->n);
        if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

fi_pool *fi_pool_new(int n_threads) {
    if (n_threads < 1)
        n_threads = 1;
    fi_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->n = n_threads;
    atomic_init(&p->gen, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->caller_sleeping, 0);
    atomic_init(&p->stop, 0);
    if (pthread_mutex_init(&p->mu, NULL) != 0) {
        free(p);
        return NULL;
    }
    if (pthread_cond_init(&p->cv_work, NULL) != 0) {
        pthread_mutex_destroy(&p->mu);
        free(p);
        return NULL;
    }
    if (pthread_cond_init(&p->cv_done, NULL) != 0) {
        pthread_cond_destroy(&p->cv_work);
        pthread_mutex_destroy(&p->mu);
        free(p);
        return NULL;
    }
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads, sizeof *p->workers);
        if (!p->workers)
            goto fail;
        for (int i = 1; i < n_threads; i++) {
            p->workers[i].pool = p;
            p->workers[i].ith = i;
            if (pthread_create(&p->workers[i].thread, NULL, s_worker_main, &p->workers[i]) != 0)
                goto fail;
            p->started = i;
        }
    }
    return p;
fail:
    fi_pool_destroy(&p);
    return NULL;
}

void fi_pool_destroy(fi_pool **pp) {
    if (!pp || !*pp)
        return;
    fi_pool *p = *pp;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i <= p->started; i++)
        pthread_join(p->workers[i].thread, NULL);
    pthread_cond_destroy(&p->cv_done);
    pthread_cond_destroy(&p->cv_work);
    pthread_mutex_destroy(&p->mu);
    free(p->workers);
    free(p);
    *pp = NULL;
}

int fi_pool_threads(const fi_pool *p) {
    return p ? p->n : 0;
}

void fi_pool_run(fi_pool *p, fi_pool_fn fn, void *arg) {
    if (p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store(&p->pending, p->n - 1);
    atomic_fetch_add(&p->gen, 1); /* seq_cst: publishes fn/arg/pending */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
    }
    fn(arg, 0, p->n);

    s_spin sp = {0, 0};
    while (atomic_load_explicit(&p->pending, memory_order_acquire) != 0) {
        if (!s_spin_step(&sp)) {
            pthread_mutex_lock(&p->mu);
            atomic_store(&p->caller_sleeping, 1);
            while (atomic_load(&p->pending) != 0)
                pthread_cond_wait(&p->cv_done, &p->mu);
            atomic_store(&p->caller_sleeping, 0);
            pthread_mutex_unlock(&p->mu);
            break;
        }
    }
}
