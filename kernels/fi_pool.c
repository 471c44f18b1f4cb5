/*
 * fi_pool.c - persistent thread pool with low dispatch latency.
 *
 * Decode runs a few hundred small jobs per token, so a job must reach the
 * workers in well under a microsecond, and on a shared machine one
 * descheduled worker must not stall every job. Protocol:
 *
 *   - `slot` packs the job generation (high 32 bits) and the next unclaimed
 *     index (low 32 bits). The caller writes (fn, arg), zeroes `done` and
 *     publishes slot = (gen+1) << 32 | 1: index 0 is the caller's, which
 *     runs it at once. Every pool thread, the caller included once it is
 *     done with 0, claims the other indices with a compare-and-swap on
 *     slot and runs fn(arg, ith, nth) for each index it wins; so each ith
 *     in [0, nth) runs exactly once, normally ith 0 on the caller and one
 *     index per worker, but a worker that is asleep or preempted simply
 *     gets nothing and its share is done by whoever comes first. Kernels
 *     that split their work by ith (or claim chunks from a counter) are
 *     oblivious. Index 0 never moves to a worker (with two threads both
 *     indices stay where they are, call after call), so work split by ith
 *     tends to stay on the core whose caches hold its data.
 *   - A thread reads fn and arg only after winning an index of that
 *     generation, and the caller returns only when `done` reaches nth, so
 *     a late worker can never see a finished job's (stack) argument.
 *   - Workers spin on slot for FI_POOL_SPIN_NS after each job (yielding the
 *     core after FI_POOL_YIELD_NS) and then sleep on cv_work. A sleeper
 *     increments `sleepers` and re-reads slot under the mutex; the caller
 *     publishes slot and then reads `sleepers` (both sequentially
 *     consistent), so either the worker sees the new job or the caller
 *     sees the sleeper and broadcasts under the mutex. No wake-up is lost
 *     and no syscall is made while the workers still spin.
 *   - Completion mirrors it: the caller spins on `done`, then sleeps on
 *     cv_done with the same handshake (`caller_sleeping`).
 */
#include "fi_kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* How long a waiting thread spins before sleeping, in nanoseconds, and
 * after how long it starts yielding its core while it spins (so that a
 * pool with more threads than free cores still makes progress). */
#define FI_POOL_SPIN_NS 200000L
#define FI_POOL_YIELD_NS 20000L
#define S_LINE 64 /* cache line: keeps the caller's and workers' words apart */

typedef struct s_worker {
    struct fi_pool *pool;   /* owning pool */
    pthread_t thread;       /* its thread */
} s_worker;

struct fi_pool {
    /* written by the caller per job, read by whoever claims an index */
    _Alignas(S_LINE) _Atomic uint64_t slot;    /* gen << 32 | next index */
    fi_pool_fn fn;                              /* current job */
    void *arg;                                  /* its argument */
    /* written by each thread that finishes an index */
    _Alignas(S_LINE) atomic_uint done;          /* indices finished this job */
    /* rarely written */
    _Alignas(S_LINE) atomic_int sleepers;       /* workers inside the cv_work wait */
    atomic_int caller_sleeping;                 /* 1 while the caller waits on cv_done */
    atomic_int stop;                            /* 1: workers exit */
    int n;                                      /* pool threads, caller included */
    int started;                                /* worker threads created */
    s_worker *workers;                          /* n-1 of them */
    pthread_mutex_t mu;                         /* guards sleeping on either condvar */
    pthread_cond_t cv_work;                     /* a new job or stop */
    pthread_cond_t cv_done;                     /* done reached n */
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

static uint32_t s_gen(uint64_t slot) {
    return (uint32_t)(slot >> 32);
}

/* Claims and runs indices of the current job until none is left. Returns
 * the generation last seen in slot. */
static uint32_t s_work(fi_pool *p) {
    uint64_t s = atomic_load_explicit(&p->slot, memory_order_acquire);
    for (;;) {
        uint32_t ith = (uint32_t)s;
        if (ith >= (uint32_t)p->n)
            return s_gen(s);
        if (!atomic_compare_exchange_weak_explicit(&p->slot, &s, s + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* s reloaded: maybe another index, maybe a newer job */
        p->fn(p->arg, (int)ith, p->n);
        /* seq_cst, against the caller's caller_sleeping store + done load */
        unsigned d = atomic_fetch_add(&p->done, 1) + 1;
        if (d == (unsigned)p->n && atomic_load(&p->caller_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
        s = atomic_load_explicit(&p->slot, memory_order_acquire);
    }
}

static void *s_worker_main(void *argp) {
    s_worker *w = argp;
    fi_pool *p = w->pool;
    /* Workers start before any job can be posted (fi_pool_new returns
     * after creating them), so generation 0 never runs. */
    uint32_t seen = 0;
    for (;;) {
        s_spin sp = {0, 0};
        uint32_t g;
        while ((g = s_gen(atomic_load_explicit(&p->slot, memory_order_acquire))) == seen &&
               !atomic_load_explicit(&p->stop, memory_order_relaxed)) {
            if (s_spin_step(&sp))
                continue;
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((g = s_gen(atomic_load(&p->slot))) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv_work, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
            break;
        }
        if (atomic_load(&p->stop))
            break;
        seen = s_work(p);
    }
    return NULL;
}

fi_pool *fi_pool_new(int n_threads) {
    if (n_threads < 1)
        n_threads = 1;
    fi_pool *p = aligned_alloc(S_LINE, (sizeof *p + S_LINE - 1) / S_LINE * S_LINE);
    if (!p)
        return NULL;
    memset(p, 0, sizeof *p);
    p->n = n_threads;
    atomic_init(&p->slot, (uint64_t)n_threads); /* generation 0, nothing to claim */
    atomic_init(&p->done, 0);
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
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers)
            goto fail;
        for (int i = 0; i < n_threads - 1; i++) {
            p->workers[i].pool = p;
            if (pthread_create(&p->workers[i].thread, NULL, s_worker_main, &p->workers[i]) != 0)
                goto fail;
            p->started = i + 1;
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
    for (int i = 0; i < p->started; i++)
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

/* Each ith in [0, nth) runs exactly once, on whichever pool thread claims
 * it (see the top of the file); returns when all have finished. */
void fi_pool_run(fi_pool *p, fi_pool_fn fn, void *arg) {
    if (p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    /* No index of the previous job is still running: we waited for done. */
    uint32_t gen = s_gen(atomic_load_explicit(&p->slot, memory_order_relaxed)) + 1;
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store(&p->slot, (uint64_t)gen << 32 | 1u); /* seq_cst: publishes the above */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
    }
    fn(arg, 0, p->n);
    atomic_fetch_add(&p->done, 1); /* no signal: the caller is the one who waits */
    s_work(p);

    s_spin sp = {0, 0};
    while (atomic_load_explicit(&p->done, memory_order_acquire) != (unsigned)p->n) {
        if (!s_spin_step(&sp)) {
            pthread_mutex_lock(&p->mu);
            atomic_store(&p->caller_sleeping, 1);
            while (atomic_load(&p->done) != (unsigned)p->n)
                pthread_cond_wait(&p->cv_done, &p->mu);
            atomic_store(&p->caller_sleeping, 0);
            pthread_mutex_unlock(&p->mu);
            break;
        }
    }
}
