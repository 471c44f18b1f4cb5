/*
 * edge_local.c - the local executor: one thread that owns the engine's
 * continuous-batching scheduler (core/fi_sched.h). Every step is one
 * forward pass over all running requests (one token each, plus chunks of
 * newcomers' prompts), so concurrent requests share the weights' reads and
 * a long prompt does not hold back the others. Prompts that share a prefix
 * under the same tenant reuse its cached KV blocks.
 *
 * Admission: up to `concurrency` requests run in the batch, up to `queue`
 * more wait in arrival order; beyond that submit refuses (the HTTP layer
 * answers 429). Stop strings, UTF-8 boundaries and the output buffer are
 * the job's (edge_job_emit); the scheduler hands it text as it is made.
 *
 * A backend that fails for good (a GPU's failures are sticky) fails every
 * request the scheduler holds (those none of whose text can have reached
 * the client run once more on the new backend: s_settle), and the thread
 * then replaces it (fi_model_reset_backend) and makes a new scheduler,
 * without a restart of the agent; requests that come meanwhile wait in the
 * queue. While it cannot, the engine is down (s_engine: the router sends
 * requests elsewhere, submissions are refused) and it tries again after a
 * pause that grows to 30 s.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "edge_impl.h"
#include "fi_sched.h"

/* One job inside the scheduler. */
typedef struct s_run {
    edge_job *job;          /* owned reference */
    int64_t id;             /* the scheduler's id */
    int stop_hit;           /* a stop string ended it */
    int oom;                /* edge_job_emit ran out of memory */
    int why;                /* cancelled by us: 499, 503 or 504 (0: not) */
    char *deferred;         /* failed before any of its text could reach the
                               client: the error, until s_settle knows whether
                               the backend failed for good */
    struct s_local *l;
    struct s_run *next;
} s_run;

typedef struct s_local {
    fi_model *model;        /* borrowed */
    int n_ctx;              /* per request */
    int concurrency;        /* running requests at most */
    int queue_max;          /* waiting requests at most */
    fi_sched *sched;        /* used by the thread only */
    pthread_t thread;
    pthread_mutex_t mu;     /* guards waiting, n_waiting, n_active, stopping */
    pthread_cond_t cv;      /* a job arrived, or stop */
    edge_job **waiting;     /* FIFO ring of queue_max + concurrency */
    int head, n_waiting;
    int n_active;           /* jobs in the scheduler, for depth */
    int stopping;           /* 1: accept nothing more */
    double deadline;        /* drain: cancel what runs after this (0: none) */
    fi_sched_stats st;      /* the scheduler's counters after the last step,
                               plus base's */
    fi_sched_stats base;    /* the counters of schedulers replaced after a
                               backend failure (so the totals never go back) */
    fi_sched_opts so;       /* the scheduler's options, for a new one */
    int in_step;            /* the thread is inside fi_sched_step */
    int down;               /* 1 while the backend failed and is not yet replaced */
    char down_why[640];     /* why, while down */
    long resets;            /* backends replaced after a failure */
} s_local;

static int s_submit(void *ctx, edge_job *j) {
    s_local *l = ctx;
    pthread_mutex_lock(&l->mu);
    if (l->down && !l->stopping) {
        pthread_mutex_unlock(&l->mu);
        return -2;
    }
    if (l->stopping || l->n_waiting + l->n_active >= l->concurrency + l->queue_max) {
        pthread_mutex_unlock(&l->mu);
        return -1;
    }
    edge_job_ref(j);
    int cap = l->queue_max + l->concurrency;
    l->waiting[(l->head + l->n_waiting) % cap] = j;
    l->n_waiting++;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return 0;
}

/* A job's place among the concurrency + queue ends: released before its
 * end is announced, so that a client sending again at once finds it free
 * (it was released after the step, and such a client got 429). */
static void s_release_slot(s_local *l) {
    pthread_mutex_lock(&l->mu);
    l->n_active--;
    pthread_mutex_unlock(&l->mu);
}

static int s_depth(void *ctx) {
    s_local *l = ctx;
    pthread_mutex_lock(&l->mu);
    int d = l->n_waiting + l->n_active;
    pthread_mutex_unlock(&l->mu);
    return d;
}

static void s_stats(void *ctx, fi_sched_stats *st) {
    s_local *l = ctx;
    pthread_mutex_lock(&l->mu);
    *st = l->st;
    pthread_mutex_unlock(&l->mu);
}

static int s_engine(void *ctx, long *resets, char *why, size_t whylen) {
    s_local *l = ctx;
    pthread_mutex_lock(&l->mu);
    int up = !l->down;
    if (resets) *resets = l->resets;
    if (why && whylen) snprintf(why, whylen, "%s", up ? "" : l->down_why);
    pthread_mutex_unlock(&l->mu);
    return up;
}

/* a += b's counters (not its gauges). */
static void s_add_counters(fi_sched_stats *a, const fi_sched_stats *b) {
    a->steps += b->steps;
    a->prompt_tokens += b->prompt_tokens;
    a->prefix_hit_tokens += b->prefix_hit_tokens;
    a->prefill_tokens += b->prefill_tokens;
    a->decode_tokens += b->decode_tokens;
    a->preemptions += b->preemptions;
    a->evictions += b->evictions;
    a->completed += b->completed;
}

/* The runs whose request failed before any of its text could reach the
 * client (s_on_done kept them): when the backend failed for good, back to
 * the front of the line, in their order, their text so far dropped, to run
 * once more on the new backend; else failed as they would have been. */
static void s_settle(s_local *l, s_run *runs, int dead) {
    int cap = l->queue_max + l->concurrency;
    for (s_run *r = runs; r; r = r->next) { /* newest first: the oldest ends up first */
        if (!r->deferred) continue;
        edge_job *j = r->job;
        r->job = NULL;
        if (dead && edge_job_unseen(j, 1)) {
            j->engine_retries++;
            pthread_mutex_lock(&l->mu); /* its slot becomes a place in the line */
            l->n_active--;
            l->head = (l->head + cap - 1) % cap;
            l->waiting[l->head] = j; /* the run's reference goes with it */
            l->n_waiting++;
            pthread_mutex_unlock(&l->mu);
        } else {
            s_release_slot(l);
            edge_job_fail(j, 500, "engine_error", r->deferred);
            edge_job_unref(&j);
        }
        free(r->deferred);
        r->deferred = NULL;
    }
}

/* The backend failed for good (why): the failed step has ended every
 * request the scheduler held. Replaces the backend and the scheduler.
 * During the first try requests are still taken, and wait in the queue
 * (a replacement that works takes well under a second for the default
 * model; a big pinned model's file is hashed again first). Once a try has
 * failed the engine is down (submissions refused, what waits answered
 * 503) and it tries again with a growing pause. Returns with l->sched
 * NULL only when the agent stops meanwhile. */
static void s_recover(s_local *l, const char *why) {
    char err[512];
    int cap = l->queue_max + l->concurrency;
    fi_sched_stats old;
    fi_sched_get_stats(l->sched, &old);
    pthread_mutex_lock(&l->mu);
    s_add_counters(&l->base, &old);
    l->st = l->base; /* no blocks while down */
    pthread_mutex_unlock(&l->mu);
    fi_sched_destroy(&l->sched);
    for (int pause_ms = 250;; pause_ms = pause_ms < 15000 ? 2 * pause_ms : 30000) {
        double t0 = edge_now();
        if (fi_model_reset_backend(l->model, err, sizeof err) == 0 &&
            (l->sched = fi_sched_new(l->model, &l->so, err, sizeof err)) != NULL) {
            pthread_mutex_lock(&l->mu);
            l->down = 0;
            l->resets++;
            pthread_mutex_unlock(&l->mu);
            fprintf(stderr, "fedinfer edge: local engine: a new backend (%s) took the weights "
                            "in %.1f s after the old one failed (%s)\n",
                    fi_model_backend(l->model)->ops->name, edge_now() - t0, why);
            return;
        }
        fprintf(stderr, "fedinfer edge: local engine is down: %s (again in %d ms)\n", err,
                pause_ms);
        pthread_mutex_lock(&l->mu);
        l->down = 1;
        snprintf(l->down_why, sizeof l->down_why, "%.200s; replacing it failed: %.400s", why,
                 err);
        while (l->n_waiting > 0) { /* handed over before the engine went down */
            edge_job *j = l->waiting[l->head];
            l->head = (l->head + 1) % cap;
            l->n_waiting--;
            edge_job_fail(j, 503, "local_engine_down", l->down_why);
            edge_job_unref(&j);
        }
        if (!l->stopping) {
            struct timespec ts = edge_deadline_ms(pause_ms);
            (void)pthread_cond_timedwait(&l->cv, &l->mu, &ts);
        }
        int stop = l->stopping;
        pthread_mutex_unlock(&l->mu);
        if (stop) return;
    }
}

static int s_on_text(void *user, const char *text, size_t len) {
    s_run *r = user;
    int hit = edge_job_emit(r->job, text, len);
    if (hit < 0) r->oom = 1;
    else if (hit) r->stop_hit = 1;
    return hit != 0; /* nonzero ends the sequence */
}

/* The scheduler's end of a request: the job's end. */
static void s_on_done(void *user, const fi_gen_result *res, const char *error) {
    s_run *r = user;
    edge_job *j = r->job;
    if (error && r->l->in_step && !r->why && j->engine_retries == 0 && edge_job_unseen(j, 0) &&
        (r->deferred = strdup(error)) != NULL)
        return; /* nothing reached the client: it may run again on a new backend (s_settle) */
    s_release_slot(r->l); /* before the client can learn of the end */
    if (error) edge_job_fail(j, 500, "engine_error", error);
    else if (r->oom) edge_job_fail(j, 500, "internal_error", "out of memory");
    else if (r->stop_hit || res->stop == FI_STOP_EOG || res->stop == FI_STOP_STRING)
        edge_job_finish(j, "stop", res->n_prompt, res->n_generated);
    else if (res->stop == FI_STOP_LENGTH || res->stop == FI_STOP_CONTEXT)
        edge_job_finish(j, "length", res->n_prompt, res->n_generated);
    else if (r->why == 503) edge_job_fail(j, 503, "shutting_down", "the agent is stopping");
    else if (r->why == 504) edge_job_fail(j, 504, "timeout", "the request ran past its time limit");
    else edge_job_fail(j, 499, "cancelled", "the request was cancelled");
    r->job = NULL; /* the thread drops its reference when it unlinks r */
    edge_job_unref(&j);
}

/* Hands a job to the scheduler; on refusal the job fails at once. */
static s_run *s_start(s_local *l, edge_job *j) {
    char err[256];
    if (j->n_prompt <= 0 || j->n_prompt + j->max_tokens > l->n_ctx + 1) {
        snprintf(err, sizeof err, "prompt of %d tokens and max_tokens %d exceed the context of %d",
                 j->n_prompt, j->max_tokens, l->n_ctx);
        s_release_slot(l);
        edge_job_fail(j, 400, "context_length_exceeded", err);
        edge_job_unref(&j);
        return NULL;
    }
    s_run *r = calloc(1, sizeof *r);
    if (!r) {
        s_release_slot(l);
        edge_job_fail(j, 500, "internal_error", "out of memory");
        edge_job_unref(&j);
        return NULL;
    }
    r->job = j;
    r->l = l;
    fi_sched_req q = {.prompt = j->prompt, .n_prompt = j->n_prompt, .on_done = s_on_done,
                      .tenant = j->tenant, .zone = j->zone};
    q.gen.max_tokens = j->max_tokens;
    q.gen.sampling = j->sp;
    q.gen.on_text = s_on_text;
    q.gen.user = r;
    r->id = fi_sched_submit(l->sched, &q, err, sizeof err);
    if (r->id < 0) {
        s_release_slot(l);
        edge_job_fail(j, 400, "invalid_request_error", err);
        edge_job_unref(&j);
        free(r);
        return NULL;
    }
    return r;
}

static void *s_thread(void *arg) {
    s_local *l = arg;
    s_run *runs = NULL; /* jobs in the scheduler */
    int cap = l->queue_max + l->concurrency;
    char err[256];
    for (;;) {
        pthread_mutex_lock(&l->mu);
        while (!runs && l->n_waiting == 0 && !l->stopping) pthread_cond_wait(&l->cv, &l->mu);
        if (!runs && l->n_waiting == 0 && l->stopping) {
            pthread_mutex_unlock(&l->mu);
            break;
        }
        edge_job *admit[64];
        int n_admit = 0;
        while (l->n_waiting > 0 && n_admit < 64) {
            admit[n_admit++] = l->waiting[l->head];
            l->head = (l->head + 1) % cap;
            l->n_waiting--;
        }
        l->n_active += n_admit;
        double deadline = l->deadline;
        pthread_mutex_unlock(&l->mu);
        /* a job's slot is released when it ends (s_on_done), or by s_start
         * when it cannot start, before its client can learn of the end */
        for (int i = 0; i < n_admit; i++) {
            s_run *r = s_start(l, admit[i]);
            if (!r) continue;
            r->next = runs;
            runs = r;
        }
        /* cancellations: the client left, the drain's deadline, timeouts */
        double now = edge_now();
        for (s_run *r = runs; r; r = r->next) {
            if (!r->job || r->why) continue;
            edge_job *j = r->job;
            if (atomic_load(&j->cancel)) r->why = 499;
            else if (deadline > 0 && now > deadline) r->why = 503;
            else if (j->timeout_s > 0 && now - j->t_submit > j->timeout_s) r->why = 504;
            if (r->why) (void)fi_sched_cancel(l->sched, r->id);
        }
        l->in_step = 1;
        int failed = fi_sched_pending(l->sched) > 0 && fi_sched_step(l->sched, err, sizeof err) < 0;
        l->in_step = 0;
        if (failed) fprintf(stderr, "fedinfer edge: local engine: %s\n", err); /* its jobs failed */
        char why[256];
        int dead = failed && fi_model_backend_failed(l->model, why, sizeof why);
        s_settle(l, runs, dead);
        /* unlink what ended */
        for (s_run **pp = &runs; *pp;) {
            s_run *r = *pp;
            if (r->job) {
                pp = &r->next;
                continue;
            }
            *pp = r->next;
            free(r);
        }
        if (dead) {
            s_recover(l, why);
            if (!l->sched) break; /* stopping: s_drain answers what waits */
        }
        fi_sched_stats st;
        fi_sched_get_stats(l->sched, &st);
        pthread_mutex_lock(&l->mu);
        s_add_counters(&st, &l->base);
        l->st = st;
        pthread_mutex_unlock(&l->mu);
    }
    return NULL;
}

static void s_drain(void *ctx, int grace_ms) {
    s_local *l = ctx;
    pthread_mutex_lock(&l->mu);
    if (l->stopping) {
        pthread_mutex_unlock(&l->mu);
        return;
    }
    l->stopping = 1;
    l->deadline = edge_now() + grace_ms / 1000.0;
    /* Waiting jobs never started: end them now. */
    int cap = l->queue_max + l->concurrency;
    while (l->n_waiting > 0) {
        edge_job *j = l->waiting[l->head];
        l->head = (l->head + 1) % cap;
        l->n_waiting--;
        edge_job_fail(j, 503, "shutting_down", "the agent is stopping");
        edge_job_unref(&j);
    }
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->thread, NULL);
}

static void s_destroy(void *ctx) {
    s_local *l = ctx;
    if (!l) return;
    s_drain(l, 0);
    fi_sched_destroy(&l->sched);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    free(l->waiting);
    free(l);
}

int edge_local_new(fi_model *model, int concurrency, int queue, int n_ctx, edge_exec *out,
                   char *err, size_t errlen) {
    s_local *l = calloc(1, sizeof *l);
    if (!l) goto oom;
    l->model = model;
    l->n_ctx = n_ctx;
    l->concurrency = concurrency;
    l->queue_max = queue;
    l->waiting = calloc((size_t)(queue + concurrency), sizeof *l->waiting);
    if (!l->waiting) goto oom;
    /* KV pool: every running request can hold a whole context */
    fi_sched_opts so = {.max_seqs = concurrency, .n_ctx = n_ctx,
                        .kv_bytes = fi_kv_block_bytes(model) * (size_t)concurrency *
                                    (size_t)(n_ctx / FI_KV_BLOCK + 1)};
    l->so = so;
    l->sched = fi_sched_new(model, &so, err, errlen);
    if (!l->sched) {
        free(l->waiting);
        free(l);
        return -1;
    }
    fi_sched_get_stats(l->sched, &l->st);
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    if (pthread_create(&l->thread, NULL, s_thread, l) != 0) {
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->cv);
        fi_sched_destroy(&l->sched);
        snprintf(err, errlen, "cannot start the scheduler thread");
        free(l->waiting);
        free(l);
        return -1;
    }
    out->name = "local";
    out->submit = s_submit;
    out->depth = s_depth;
    out->drain = s_drain;
    out->destroy = s_destroy;
    out->stats = s_stats;
    out->engine = s_engine;
    out->ctx = l;
    return 0;
oom:
    if (l) free(l->waiting);
    free(l);
    snprintf(err, errlen, "out of memory");
    return -1;
}
