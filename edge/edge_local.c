/*
 * edge_local.c - the local executor: one scheduler thread that owns every
 * local session and interleaves them token by token (round robin, one
 * fi_session_eval per active session per turn), so that a long generation
 * does not hold back a short one. The CPU backend runs one forward pass at a
 * time, over its own thread pool, so this is the whole of the concurrency
 * the engine allows; a batched scheduler (one forward pass over several
 * sequences) can replace this file behind the same edge_exec table.
 *
 * Prompts are evaluated in chunks of EDGE_PREFILL_CHUNK tokens per turn, so
 * a long prompt also takes its turns with the others.
 *
 * Admission: up to `concurrency` jobs are active, up to `queue` more wait in
 * arrival order; beyond that submit refuses (the HTTP layer answers 429).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edge_impl.h"

#define EDGE_PREFILL_CHUNK 64

typedef struct s_slot {
    edge_job *job;          /* owned reference */
    fi_session *sess;       /* its KV cache */
    fi_sampler *smp;        /* its sampler (RNG state) */
    float *logits;          /* n_vocab */
    int32_t *hist;          /* prompt + generated, for the repetition penalty */
    int n_hist;             /* entries of hist */
    int prefilled;          /* prompt tokens evaluated */
    int n_gen;              /* tokens sampled */
} s_slot;

typedef struct s_local {
    fi_model *model;        /* borrowed */
    int n_ctx;              /* per session */
    int concurrency;        /* active slots at most */
    int queue_max;          /* waiting jobs at most */
    pthread_t thread;       /* the scheduler */
    pthread_mutex_t mu;     /* guards waiting, n_waiting, n_active, stopping */
    pthread_cond_t cv;      /* a job arrived, or stop */
    edge_job **waiting;     /* FIFO ring of queue_max */
    int head, n_waiting;
    int n_active;           /* mirror of the thread's count, for depth */
    int stopping;           /* 1: accept nothing more */
    double deadline;        /* drain: cancel what runs after this (0: none) */
} s_local;

static int s_submit(void *ctx, edge_job *j) {
    s_local *l = ctx;
    pthread_mutex_lock(&l->mu);
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

static int s_depth(void *ctx) {
    s_local *l = ctx;
    pthread_mutex_lock(&l->mu);
    int d = l->n_waiting + l->n_active;
    pthread_mutex_unlock(&l->mu);
    return d;
}

static void s_slot_end(s_slot *s) {
    fi_session_destroy(&s->sess);
    fi_sampler_destroy(&s->smp);
    free(s->logits);
    free(s->hist);
    edge_job_unref(&s->job);
    memset(s, 0, sizeof *s);
}

/* Prepares a slot for j; on failure the job is failed and 0 returned. */
static int s_slot_start(s_local *l, s_slot *s, edge_job *j) {
    char err[256];
    memset(s, 0, sizeof *s);
    s->job = j;
    int n_vocab = fi_model_config(l->model)->n_vocab;
    if (j->n_prompt <= 0 || j->n_prompt + j->max_tokens > l->n_ctx + 1) {
        snprintf(err, sizeof err, "prompt of %d tokens and max_tokens %d exceed the context of %d",
                 j->n_prompt, j->max_tokens, l->n_ctx);
        edge_job_fail(j, 400, "context_length_exceeded", err);
        s_slot_end(s);
        return 0;
    }
    s->sess = fi_session_new(l->model, l->n_ctx, err, sizeof err);
    s->smp = fi_sampler_new(&j->sp, n_vocab);
    s->logits = malloc((size_t)n_vocab * sizeof(float));
    s->hist = malloc(((size_t)j->n_prompt + (size_t)j->max_tokens + 1) * sizeof(int32_t));
    if (!s->sess || !s->smp || !s->logits || !s->hist) {
        edge_job_fail(j, 500, "internal_error", s->sess ? "out of memory" : err);
        s_slot_end(s);
        return 0;
    }
    memcpy(s->hist, j->prompt, (size_t)j->n_prompt * sizeof(int32_t));
    s->n_hist = j->n_prompt;
    return 1;
}

/* One turn of a slot: a prompt chunk, or one token. Returns 1 while the
 * slot goes on, 0 when its job ended. */
static int s_step(s_local *l, s_slot *s) {
    edge_job *j = s->job;
    char err[256];
    if (atomic_load(&j->cancel)) {
        edge_job_fail(j, 499, "cancelled", "the request was cancelled");
        return 0;
    }
    if (l->deadline > 0 && edge_now() > l->deadline) {
        edge_job_fail(j, 503, "shutting_down", "the agent is stopping");
        return 0;
    }
    if (j->timeout_s > 0 && edge_now() - j->t_submit > j->timeout_s) {
        edge_job_fail(j, 504, "timeout", "the request ran past its time limit");
        return 0;
    }
    if (s->prefilled < j->n_prompt) {
        int n = j->n_prompt - s->prefilled;
        if (n > EDGE_PREFILL_CHUNK) n = EDGE_PREFILL_CHUNK;
        if (fi_session_eval(s->sess, j->prompt + s->prefilled, n, s->logits, NULL, err,
                            sizeof err) != 0) {
            edge_job_fail(j, 500, "engine_error", err);
            return 0;
        }
        s->prefilled += n;
        if (s->prefilled < j->n_prompt) return 1;
    }
    if (s->n_gen >= j->max_tokens) {
        edge_job_finish(j, "length", j->n_prompt, s->n_gen);
        return 0;
    }
    const fi_tok *tok = fi_model_tok(l->model);
    int32_t id = fi_sampler_sample(s->smp, s->logits, s->hist, s->n_hist);
    s->hist[s->n_hist++] = id;
    s->n_gen++;
    if (fi_tok_is_eog(tok, id)) {
        edge_job_finish(j, "stop", j->n_prompt, s->n_gen);
        return 0;
    }
    char piece[256];
    int len = fi_tok_piece(tok, id, piece, sizeof piece);
    if (len < 0 || (size_t)len > sizeof piece) len = 0; /* no text, or a giant token: skip */
    int hit = edge_job_emit(j, piece, (size_t)len);
    if (hit < 0) {
        edge_job_fail(j, 500, "internal_error", "out of memory");
        return 0;
    }
    if (hit) {
        edge_job_finish(j, "stop", j->n_prompt, s->n_gen);
        return 0;
    }
    if (s->n_gen >= j->max_tokens || fi_session_pos(s->sess) >= fi_session_n_ctx(s->sess)) {
        edge_job_finish(j, "length", j->n_prompt, s->n_gen);
        return 0;
    }
    if (fi_session_eval(s->sess, &id, 1, s->logits, NULL, err, sizeof err) != 0) {
        edge_job_fail(j, 500, "engine_error", err);
        return 0;
    }
    return 1;
}

static void *s_run(void *arg) {
    s_local *l = arg;
    s_slot *slots = calloc((size_t)l->concurrency, sizeof *slots);
    int n_active = 0;
    int cap = l->queue_max + l->concurrency;
    for (;;) {
        pthread_mutex_lock(&l->mu);
        while (n_active == 0 && l->n_waiting == 0 && !l->stopping)
            pthread_cond_wait(&l->cv, &l->mu);
        if (n_active == 0 && l->n_waiting == 0 && l->stopping) {
            pthread_mutex_unlock(&l->mu);
            break;
        }
        edge_job *admit[64];
        int n_admit = 0;
        while (l->n_waiting > 0 && n_active + n_admit < l->concurrency && n_admit < 64) {
            admit[n_admit++] = l->waiting[l->head];
            l->head = (l->head + 1) % cap;
            l->n_waiting--;
        }
        l->n_active = n_active + n_admit;
        pthread_mutex_unlock(&l->mu);
        for (int i = 0; i < n_admit; i++) {
            if (!slots) {
                edge_job_fail(admit[i], 500, "internal_error", "out of memory");
                edge_job_unref(&admit[i]);
                continue;
            }
            if (s_slot_start(l, &slots[n_active], admit[i])) n_active++;
        }
        for (int i = 0; i < n_active;) {
            if (s_step(l, &slots[i])) {
                i++;
                continue;
            }
            s_slot_end(&slots[i]);
            slots[i] = slots[n_active - 1];
            memset(&slots[n_active - 1], 0, sizeof *slots);
            n_active--;
        }
        pthread_mutex_lock(&l->mu);
        l->n_active = n_active;
        pthread_mutex_unlock(&l->mu);
    }
    free(slots);
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
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    if (pthread_create(&l->thread, NULL, s_run, l) != 0) {
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->cv);
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
    out->ctx = l;
    return 0;
oom:
    if (l) free(l->waiting);
    free(l);
    snprintf(err, errlen, "out of memory");
    return -1;
}
