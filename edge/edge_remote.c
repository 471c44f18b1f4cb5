/*
 * edge_remote.c - the routed executor: the edge's fabric client, on a
 * thread of its own (a fi_client is used by one thread). HTTP threads hand
 * it jobs through a locked list and wake it through an inproc ZeroMQ pair;
 * it sends each as an InferRequest, streams the chunks that come back into
 * the job (stop strings are applied there, and end the work at the worker
 * with a Cancel), and ends the job on the final result or an error.
 *
 * The same thread keeps the link's state (online or not, for the router),
 * installs the policy bundles the coordinator pushes, and uploads the
 * audit log in batches: a batch is marked uploaded only when the
 * coordinator acknowledges it, and the mark lives in the edge's SQLite,
 * so nothing is lost across restarts of either side (a batch may arrive
 * twice; its records carry their sequence numbers and chain hashes).
 *
 * A client that disconnects sets its job's cancel flag and wakes this
 * thread, which sends Cancel: the cluster stops generating.
 */
#include <stdio.h>
#include <stdlib.h>
#include <limits.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "edge_impl.h"
#include "fi_client.h"

#define EDGE_AUDIT_BATCH 200     /* records per upload */
#define EDGE_AUDIT_RETRY_MS 5000 /* resend an unacknowledged batch after */

typedef struct s_open {
    edge_job *job;          /* one reference */
    char rid[EDGE_ID_LEN];  /* our request id on the fabric */
    unsigned gen;           /* the client's reconnect count when sent */
    int cancel_sent;        /* Cancel already sent */
    int chunks;             /* chunks received (a worker sends one per piece of text) */
} s_open;

typedef struct s_remote {
    fi_edge *e;                 /* the agent (conf, policy) */
    fi_client *client;          /* owned by the thread once started */
    pthread_t thread;
    void *zctx;                 /* our own context for the wake-up pair */
    void *wake_tx, *wake_rx;    /* PUSH (under mu) -> PULL (thread) */
    pthread_mutex_t mu;         /* guards inbox, n_inbox, stopping, wake_tx */
    edge_job **inbox;           /* submitted, not yet sent */
    int n_inbox, cap_inbox;
    int stopping;               /* 1: refuse; 2: cancel everything and leave */
    double deadline;            /* drain: cancel what runs after this */
    atomic_int online;          /* 1 while the coordinator has answered Hello */
    atomic_int n_open;          /* open requests, for depth */
    int max_open;               /* queue bound */
    /* thread-only state */
    s_open *open;
    int n_open_t, cap_open;
    char upload_id[FI_WIRE_MAX_ID + 1]; /* batch awaiting its Ack ("" : none) */
    int64_t upload_last;        /* its last seq */
    uint64_t upload_at;         /* when it was sent */
    uint64_t said_version;      /* policy version the client says in Hello */
    unsigned wit_gen;           /* fi_client_audit_witness's count when last kept */
    uint64_t wit_kept_ms;       /* when it was last kept */
    char coord_fpr[FI_KEYS_FPR_LEN]; /* the coordinator's key fingerprint (whose log we witness) */
    /* clusters' load from the coordinator's heartbeats, under mu (the
     * thread alone writes them) */
    fi_cluster_load *loads;     /* owned */
    int n_loads;
    int loads_truncated;        /* the heartbeat left rows out: a missing one is unknown */
    uint64_t loads_ms;          /* when the heartbeat that carried them came (0: none) */
} s_remote;

static void s_wake(s_remote *r) {
    /* caller holds mu */
    (void)zmq_send(r->wake_tx, "", 0, ZMQ_DONTWAIT);
}

static int s_submit(void *ctx, edge_job *j) {
    s_remote *r = ctx;
    pthread_mutex_lock(&r->mu);
    if (r->stopping || r->n_inbox + atomic_load(&r->n_open) >= r->max_open) {
        pthread_mutex_unlock(&r->mu);
        return -1;
    }
    if (r->n_inbox == r->cap_inbox) {
        int cap = r->cap_inbox ? 2 * r->cap_inbox : 16;
        edge_job **n = realloc(r->inbox, (size_t)cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&r->mu);
            return -1;
        }
        r->inbox = n;
        r->cap_inbox = cap;
    }
    edge_job_ref(j);
    r->inbox[r->n_inbox++] = j;
    s_wake(r);
    pthread_mutex_unlock(&r->mu);
    return 0;
}

static void s_kick(void *ctx) {
    s_remote *r = ctx;
    pthread_mutex_lock(&r->mu);
    s_wake(r);
    pthread_mutex_unlock(&r->mu);
}

static int s_depth(void *ctx) {
    s_remote *r = ctx;
    pthread_mutex_lock(&r->mu);
    int d = r->n_inbox + atomic_load(&r->n_open);
    pthread_mutex_unlock(&r->mu);
    return d;
}

static void s_send_cancel(s_remote *r, s_open *o) {
    if (o->cancel_sent) return;
    o->cancel_sent = 1;
    Fi__Cancel cn = FI__CANCEL__INIT;
    cn.request_id = o->rid;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_CANCEL;
    m.cancel = &cn;
    if (fi_client_send(r->client, &m) != 0)
        fprintf(stderr, "edge: fabric: cannot send Cancel for %s\n", o->rid);
}

static void s_close_open(s_remote *r, int i) {
    edge_job_unref(&r->open[i].job);
    r->open[i] = r->open[r->n_open_t - 1];
    r->n_open_t--;
    atomic_store(&r->n_open, r->n_open_t);
}

/* Sends the inbox's jobs. */
static void s_send_new(s_remote *r) {
    pthread_mutex_lock(&r->mu);
    edge_job **jobs = r->inbox;
    int n = r->n_inbox;
    r->inbox = NULL;
    r->n_inbox = r->cap_inbox = 0;
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < n; i++) {
        edge_job *j = jobs[i];
        if (!atomic_load(&r->online)) {
            edge_job_fail(j, 503, "coordinator_unreachable",
                          "the coordinator is unreachable; the request may not be served here");
            edge_job_unref(&j);
            continue;
        }
        if (r->n_open_t == r->cap_open) {
            int cap = r->cap_open ? 2 * r->cap_open : 16;
            s_open *no = realloc(r->open, (size_t)cap * sizeof *no);
            if (!no) {
                edge_job_fail(j, 500, "internal_error", "out of memory");
                edge_job_unref(&j);
                continue;
            }
            r->open = no;
            r->cap_open = cap;
        }
        Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
        rq.request_id = j->id;
        rq.model = j->model;
        rq.prompt = j->text ? j->text : (char *)"";
        /* the client's labels only: where it gave none, the coordinator's
         * newest policy applies its own default_label (or refuses), not
         * this edge's possibly older one */
        rq.labels = j->labels;
        rq.n_labels = j->labels_defaulted ? 0 : (size_t)j->n_labels;
        rq.max_tokens = (uint32_t)j->max_tokens;
        rq.temperature = j->sp.temperature;
        rq.seed = j->sp.seed;
        rq.top_p = j->sp.top_p;
        rq.top_k = j->sp.top_k;
        rq.min_p = j->sp.min_p;
        rq.repeat_penalty = j->sp.repeat_penalty;
        rq.presence_penalty = j->sp.presence_penalty;
        rq.frequency_penalty = j->sp.frequency_penalty;
        Fi__LogitBias lb[FI_SAMPLER_MAX_BIAS], *lbp[FI_SAMPLER_MAX_BIAS];
        for (int k = 0; k < j->sp.n_bias && k < FI_SAMPLER_MAX_BIAS; k++) {
            fi__logit_bias__init(&lb[k]);
            lb[k].token = j->sp.bias[k].id;
            lb[k].bias = j->sp.bias[k].bias;
            lbp[k] = &lb[k];
        }
        rq.logit_bias = lbp;
        rq.n_logit_bias = (size_t)(j->sp.n_bias < FI_SAMPLER_MAX_BIAS ? j->sp.n_bias : FI_SAMPLER_MAX_BIAS);
        const edge_routed *w = j->routed;
        Fi__ChatMessage *cm = NULL, **cmp = NULL;
        if (w) {
            rq.raw = w->raw;
            rq.stop = (char **)w->stop;
            rq.n_stop = (size_t)w->n_stop;
            rq.user = (char *)w->user;
            rq.tenant = (char *)w->tenant;
            rq.application = (char *)w->application;
            /* the size the edge's policy decided with (the job keeps the
             * prompt's tokens only when it runs locally) */
            rq.prompt_tokens = (uint32_t)(w->prompt_tokens > 0 ? w->prompt_tokens : 0);
            rq.zone = (char *)w->zone;
            rq.cluster = j->target; /* what our policy decided and our audit log says */
            rq.prefix_hashes = w->hashes;
            rq.n_prefix_hashes = (size_t)w->n_hashes;
            cm = calloc((size_t)w->n_msgs + 1, sizeof *cm);
            cmp = calloc((size_t)w->n_msgs + 1, sizeof *cmp);
            for (int k = 0; cm && cmp && k < w->n_msgs; k++) {
                fi__chat_message__init(&cm[k]);
                cm[k].role = w->roles[k];
                cm[k].content = w->contents[k];
                cmp[k] = &cm[k];
            }
            rq.messages = cmp;
            rq.n_messages = cm && cmp ? (size_t)w->n_msgs : 0;
        }
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_INFER;
        m.infer = &rq;
        int sent = (!w || (cm && cmp)) && fi_client_send(r->client, &m) == 0;
        free(cm);
        free(cmp);
        if (!sent) {
            edge_job_fail(j, 503, "coordinator_unreachable",
                          "cannot send the request to the coordinator");
            edge_job_unref(&j);
            continue;
        }
        s_open *o = &r->open[r->n_open_t++];
        memset(o, 0, sizeof *o);
        o->job = j;
        snprintf(o->rid, sizeof o->rid, "%s", j->id);
        o->gen = fi_client_reconnects(r->client);
        atomic_store(&r->n_open, r->n_open_t);
    }
    free(jobs);
}

static int s_find(s_remote *r, const char *rid) {
    for (int i = 0; rid && i < r->n_open_t; i++)
        if (!strcmp(r->open[i].rid, rid)) return i;
    return -1;
}

/* The coordinator's refusal of a request the edge recorded as permitted
 * there: a second record of the request says what became of it ("deny":
 * its policy check; "unavailable": no room or no worker), so the log does
 * not show a permit for a request that was not served. */
static void s_audit_note(s_remote *r, const edge_job *j, const char *decision, const char *msg) {
    char labels[256] = "";
    for (int k = 0; k < j->n_labels; k++)
        snprintf(labels + strlen(labels), sizeof labels - strlen(labels), "%s%s", k ? "," : "",
                 j->labels[k]);
    char rules[300];
    snprintf(rules, sizeof rules, "coordinator: %.280s", msg);
    edge_policy_audit_note(r->e->policy, j->id, j->model, labels, decision, j->target, rules);
}

static void s_on_error(s_remote *r, const Fi__Error *er) {
    int i = s_find(r, er->request_id);
    const char *msg = er->message ? er->message : "";
    if (i < 0) {
        if (r->upload_id[0] && (!er->request_id || !er->request_id[0]))
            r->upload_at = fi_wire_now_ms(); /* our upload was refused: the same batch again after
                                                EDGE_AUDIT_RETRY_MS, not at once */
        fprintf(stderr, "edge: fabric: coordinator error (%s): %s\n",
                fi_wire_error_name(er->code), msg);
        return;
    }
    int status = 502;
    const char *code = "upstream_error";
    char text[400];
    switch (er->code) {
    case FI__ERROR_CODE__ERR_UNAUTHORISED:
        status = 403;
        code = "policy_denied";
        snprintf(text, sizeof text, "denied by the coordinator's policy check: %s", msg);
        s_audit_note(r, r->open[i].job, "deny", msg);
        break;
    case FI__ERROR_CODE__ERR_BUSY:
        status = 429;
        code = "rate_limit_exceeded";
        snprintf(text, sizeof text, "the cluster is busy: %s", msg);
        s_audit_note(r, r->open[i].job, "unavailable", msg);
        break;
    case FI__ERROR_CODE__ERR_NO_WORKER:
        status = 503;
        code = "target_unavailable";
        snprintf(text, sizeof text, "no cluster serves the model now: %s", msg);
        s_audit_note(r, r->open[i].job, "unavailable", msg);
        break;
    default:
        snprintf(text, sizeof text, "the cluster failed the request (%s): %s",
                 fi_wire_error_name(er->code), msg);
    }
    edge_job_fail(r->open[i].job, status, code, text);
    s_close_open(r, i);
}

static void s_dispatch(s_remote *r, fi_msg *m) {
    switch (m->body_case) {
    case FI__ENVELOPE__BODY_CHUNK: {
        int i = s_find(r, m->chunk->request_id);
        if (i < 0) return;
        const char *t = m->chunk->text ? m->chunk->text : "";
        r->open[i].chunks++;
        int hit = edge_job_emit(r->open[i].job, t, strlen(t));
        if (hit) {
            /* A stop string the worker did not apply (or the job already
             * ended): stop the worker. The coordinator forgets a request
             * once cancelled, so no final result comes: the request ends
             * here, with the usage known here (the prompt as this edge
             * tokenised it, when it holds the model; a token a chunk). */
            edge_job *j = r->open[i].job;
            s_send_cancel(r, &r->open[i]);
            edge_job_finish(j, "stop", j->n_prompt > 0 ? j->n_prompt : 0, r->open[i].chunks);
            s_close_open(r, i);
        }
        return;
    }
    case FI__ENVELOPE__BODY_FINAL: {
        int i = s_find(r, m->final->request_id);
        if (i < 0) return;
        const char *sr = m->final->stop_reason ? m->final->stop_reason : "";
        edge_job *j = r->open[i].job;
        /* (a job the client left is done already: finish leaves it as it
         * is, since its answer may be on its way). OpenAI's reasons: the
         * context filling up is "length", as on the local engine; work the
         * cluster stopped on its own (out of memory, its scheduler
         * stopping: the edge's own cancels never come back) is no answer,
         * and a gateway's failure the client may retry. */
        if (!strcmp(sr, "cancelled"))
            edge_job_fail(j, 502, "cluster_cancelled", "the cluster stopped the request before it finished");
        else
            edge_job_finish(j, !strcmp(sr, "length") || !strcmp(sr, "context_full") ? "length" : "stop",
                            (int)m->final->n_prompt, (int)m->final->n_generated);
        s_close_open(r, i);
        return;
    }
    case FI__ENVELOPE__BODY_ERROR: s_on_error(r, m->error); return;
    case FI__ENVELOPE__BODY_POLICY_BUNDLE: {
        char err[512];
        const Fi__PolicyBundle *b = m->policy_bundle;
        if (edge_policy_install(r->e->policy, (const char *)b->bundle.data, b->bundle.len, err,
                                sizeof err) == 0)
            fprintf(stderr, "edge: installed policy bundle version %llu from the coordinator\n",
                    (unsigned long long)b->version);
        else
            fprintf(stderr, "edge: refused policy bundle version %llu from the coordinator: %s\n",
                    (unsigned long long)b->version, err);
        return;
    }
    case FI__ENVELOPE__BODY_APP_TOKEN_SYNC: {
        char err[512];
        int added = 0, revoked = 0;
        if (edge_token_sync(r->e->conf.db, m->app_token_sync, &added, &revoked, err,
                            sizeof err) != 0)
            fprintf(stderr, "edge: refused the coordinator's application tokens: %s\n", err);
        else if (added || revoked)
            fprintf(stderr, "edge: application tokens from the coordinator: %d added, %d revoked\n",
                    added, revoked);
        return;
    }
    case FI__ENVELOPE__BODY_ACK:
        if (r->upload_id[0] && m->ack->ref && !strcmp(m->ack->ref, r->upload_id)) {
            edge_policy_set_uploaded(r->e->policy, r->upload_last);
            r->upload_id[0] = 0;
        }
        return;
    default: return;
    }
}

/* Uploads the next batch of audit records when none is awaiting its Ack. */
static void s_upload(s_remote *r) {
    uint64_t now = fi_wire_now_ms();
    if (r->upload_id[0] && now - r->upload_at < EDGE_AUDIT_RETRY_MS) return;
    int64_t after = edge_policy_uploaded(r->e->policy);
    if (edge_policy_audit_head(r->e->policy) <= after) return;
    int64_t last = 0, count = 0;
    char *batch = edge_policy_audit_batch(r->e->policy, after, EDGE_AUDIT_BATCH, &last, &count);
    if (!batch) return;
    snprintf(r->upload_id, sizeof r->upload_id, "a%lld-%lld-%llu", (long long)after + 1,
             (long long)last, (unsigned long long)now);
    Fi__AuditUpload au = FI__AUDIT_UPLOAD__INIT;
    au.batch_id = r->upload_id;
    au.first_seq = (uint64_t)after + 1;
    au.count = (uint64_t)count;
    au.batch.data = (uint8_t *)batch;
    au.batch.len = strlen(batch);
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_UPLOAD;
    m.audit_upload = &au;
    if (fi_client_send(r->client, &m) != 0) r->upload_id[0] = 0;
    r->upload_last = last;
    r->upload_at = now;
    free(batch);
}

/* Copies the clusters' load of the coordinator's last heartbeat, when a
 * new one came, for the HTTP threads' router. Out of memory, it keeps no
 * rows and marks them truncated: every cluster reads as unknown. */
static void s_take_loads(s_remote *r) {
    uint64_t heard = 0;
    int trunc = 0;
    int n = fi_client_cluster_loads(r->client, NULL, 0, &heard, &trunc);
    if (heard == r->loads_ms) return; /* read by this thread alone without mu: it writes it */
    fi_cluster_load *l = n > 0 ? malloc((size_t)n * sizeof *l) : NULL;
    if (n > 0 && !l) {
        n = 0;
        trunc = 1;
    }
    if (n > 0) n = fi_client_cluster_loads(r->client, l, n, &heard, &trunc);
    pthread_mutex_lock(&r->mu);
    fi_cluster_load *old = r->loads;
    r->loads = l;
    r->n_loads = n;
    r->loads_truncated = trunc;
    r->loads_ms = heard;
    pthread_mutex_unlock(&r->mu);
    free(old);
}

/* Keeps the coordinator's audit head when the witness moved up: at most
 * every EDGE_WITNESS_KEEP_MS (each is a synced write; the coordinator
 * sends a head every heartbeat while its log grows), and at the end
 * (now). */
#define EDGE_WITNESS_KEEP_MS 5000
static void s_keep_witness(s_remote *r, int now) {
    int64_t seq;
    char hash[65];
    unsigned gen = fi_client_audit_witness(r->client, &seq, hash);
    uint64_t t = fi_wire_now_ms();
    if (gen == r->wit_gen || (!now && t - r->wit_kept_ms < EDGE_WITNESS_KEEP_MS)) return;
    r->wit_gen = gen;
    r->wit_kept_ms = t;
    edge_policy_set_witness(r->e->policy, r->coord_fpr, seq, hash);
}

static void *s_run(void *arg) {
    s_remote *r = arg;
    char err[512];
    unsigned gen = fi_client_reconnects(r->client);
    int was_online = 0;
    for (;;) {
        fi_msg *m = NULL;
        int rc = fi_client_recv_or(r->client, 200, r->wake_rx, &m, err, sizeof err);
        if (rc < 0) {
            fprintf(stderr, "edge: fabric: %s\n", err);
            usleep(200 * 1000);
        }
        if (rc == 2) {
            char b[8];
            while (zmq_recv(r->wake_rx, b, sizeof b, ZMQ_DONTWAIT) >= 0) {
            }
        }
        if (rc == 1) {
            s_dispatch(r, m);
            fi_wire_free(&m);
        }
        uint64_t held = edge_policy_version(r->e->policy); /* pushed, or reloaded on SIGHUP */
        if (held != r->said_version) {
            fi_client_set_policy_version(r->client, held);
            r->said_version = held;
        }
        s_take_loads(r);
        s_keep_witness(r, 0);
        int online = fi_client_ready(r->client);
        atomic_store(&r->online, online);
        if (online != was_online)
            fprintf(stderr, "edge: coordinator %s\n", online ? "connected" : "unreachable");
        was_online = online;
        /* Requests open across a reconnection are lost. */
        unsigned g = fi_client_reconnects(r->client);
        if (g != gen) {
            gen = g;
            for (int i = r->n_open_t - 1; i >= 0; i--) {
                edge_job_fail(r->open[i].job, 503, "coordinator_unreachable",
                              "the connection to the coordinator was lost");
                s_close_open(r, i);
            }
            r->upload_id[0] = 0;
        }
        s_send_new(r);
        /* Cancellations (clients gone, timeouts, shutdown). */
        double now = edge_now();
        pthread_mutex_lock(&r->mu);
        int stopping = r->stopping;
        double deadline = r->deadline;
        pthread_mutex_unlock(&r->mu);
        for (int i = r->n_open_t - 1; i >= 0; i--) {
            edge_job *j = r->open[i].job;
            int late = j->timeout_s > 0 && now - j->t_submit > j->timeout_s;
            int cut = stopping && (stopping == 2 || now > deadline);
            if (atomic_load(&j->cancel) || late || cut) {
                s_send_cancel(r, &r->open[i]);
                edge_job_fail(j, cut ? 503 : late ? 504 : 499,
                              cut ? "shutting_down" : late ? "timeout" : "cancelled",
                              cut ? "the agent is stopping"
                              : late ? "the request ran past its time limit"
                                     : "the request was cancelled");
                s_close_open(r, i);
            }
        }
        if (online && !stopping) s_upload(r);
        if (stopping && r->n_open_t == 0) break;
    }
    if (atomic_load(&r->online) && r->upload_id[0] == 0) s_upload(r); /* last records, best effort */
    s_keep_witness(r, 1);
    return NULL;
}

static void s_drain(void *ctx, int grace_ms) {
    s_remote *r = ctx;
    pthread_mutex_lock(&r->mu);
    if (r->stopping) {
        pthread_mutex_unlock(&r->mu);
        return;
    }
    r->stopping = 1;
    r->deadline = edge_now() + grace_ms / 1000.0;
    s_wake(r);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);
    /* Anything submitted after the thread left. */
    for (int i = 0; i < r->n_inbox; i++) {
        edge_job_fail(r->inbox[i], 503, "shutting_down", "the agent is stopping");
        edge_job_unref(&r->inbox[i]);
    }
    r->n_inbox = 0;
}

static void s_destroy(void *ctx) {
    s_remote *r = ctx;
    if (!r) return;
    s_drain(r, 0);
    fi_client_destroy(&r->client);
    free(r->open);
    free(r->inbox);
    free(r->loads);
    zmq_close(r->wake_tx);
    zmq_close(r->wake_rx);
    zmq_ctx_term(r->zctx);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* A reported count as an int (the coordinator's sums saturate at
 * UINT32_MAX, which must read as huge, not negative). */
static int s_clamp_int(uint32_t v) {
    return v > (uint32_t)INT_MAX ? INT_MAX : (int)v;
}

int edge_remote_cluster_load(fi_edge *e, const char *cluster, const char *model,
                             edge_cluster_load *out) {
    s_remote *r = e->remote.ctx;
    if (!r) return -1;
    memset(out, 0, sizeof *out);
    int rc = -1;
    uint64_t now = fi_wire_now_ms(), fresh = 5u * (uint64_t)e->conf.heartbeat_ms;
    pthread_mutex_lock(&r->mu);
    /* a recent heartbeat lists every cluster with a live worker: one it
     * leaves out has none, unless it said it left some out; an old one (or
     * none) says nothing */
    if (r->loads_ms && now - r->loads_ms <= fresh) {
        rc = r->loads_truncated ? -1 : 0;
        for (int i = 0; i < r->n_loads; i++) {
            const fi_cluster_load *l = &r->loads[i];
            if (strcmp(l->cluster, cluster) || strcmp(l->model, model)) continue;
            out->workers = s_clamp_int(l->workers);
            out->capacity = s_clamp_int(l->capacity);
            out->busy = s_clamp_int(l->queued > l->in_flight ? l->queued : l->in_flight);
            rc = 1;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int edge_remote_client_opts(const fi_edge_conf *c, fi_client_opts *o, char *err, size_t errlen) {
    fi_client_opts_default(o);
    o->role = FI__ROLE__ROLE_EDGE;
    o->heartbeat_ms = c->heartbeat_ms;
    snprintf(o->endpoint, sizeof o->endpoint, "%s", c->coordinator);
    if (fi_keys_load_public(c->coordinator_key, o->server_pub, err, errlen) != 0) return -1;
    if (fi_keys_load_secret(c->secret_key, &o->kp, err, errlen) != 0) return -1;
    return 0;
}

int edge_remote_new(fi_edge *e, edge_exec *out, char *err, size_t errlen) {
    s_remote *r = calloc(1, sizeof *r);
    if (!r) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    r->e = e;
    r->max_open = e->conf.concurrency * 4 + e->conf.queue;
    if (r->max_open > 60) r->max_open = 60; /* the coordinator takes 64 per edge by default */
    pthread_mutex_init(&r->mu, NULL);
    fi_client_opts o;
    if (edge_remote_client_opts(&e->conf, &o, err, errlen) != 0) goto fail;
    /* Say which bundle we hold, so that the coordinator does not push the
     * same one again after each Hello. */
    o.policy_version = r->said_version = edge_policy_version(e->policy);
    /* and which head of its audit log we witnessed, kept from before */
    fi_keys_fingerprint(o.server_pub, r->coord_fpr);
    edge_policy_witness(e->policy, r->coord_fpr, &o.audit_seq, o.audit_hash);
    r->client = fi_client_new(&o, err, errlen);
    fi_keys_wipe(&o.kp);
    if (!r->client) goto fail;
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://edge-wake-%p", (void *)r);
    r->zctx = zmq_ctx_new();
    r->wake_rx = r->zctx ? zmq_socket(r->zctx, ZMQ_PULL) : NULL;
    r->wake_tx = r->zctx ? zmq_socket(r->zctx, ZMQ_PUSH) : NULL;
    int hwm = 1, linger = 0;
    if (!r->wake_rx || !r->wake_tx || zmq_bind(r->wake_rx, ep) != 0 ||
        zmq_setsockopt(r->wake_tx, ZMQ_SNDHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(r->wake_tx, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_setsockopt(r->wake_rx, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(r->wake_tx, ep) != 0) {
        snprintf(err, errlen, "cannot make the wake-up pipe: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    /* Give the link a moment, so that the first requests can be routed. */
    (void)fi_client_wait_ready(r->client, 1500, err, errlen);
    atomic_store(&r->online, fi_client_ready(r->client));
    fprintf(stderr, "edge: coordinator %s %s\n", e->conf.coordinator,
            atomic_load(&r->online) ? "connected" : "unreachable for now (serving on site)");
    if (pthread_create(&r->thread, NULL, s_run, r) != 0) {
        snprintf(err, errlen, "cannot start the fabric thread");
        goto fail;
    }
    e->remote_online = &r->online;
    out->name = "fabric";
    out->submit = s_submit;
    out->depth = s_depth;
    out->kick = s_kick;
    out->drain = s_drain;
    out->destroy = s_destroy;
    out->ctx = r;
    return 0;
fail:
    fi_client_destroy(&r->client);
    if (r->wake_tx) zmq_close(r->wake_tx);
    if (r->wake_rx) zmq_close(r->wake_rx);
    if (r->zctx) zmq_ctx_term(r->zctx);
    pthread_mutex_destroy(&r->mu);
    free(r);
    return -1;
}
