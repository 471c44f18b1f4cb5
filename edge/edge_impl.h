/*
 * edge_impl.h - the edge agent's internals, shared by its modules:
 *
 *   edge_job.c     a request in flight: its inputs, and the channel its text
 *                  flows through from an executor to the HTTP connection
 *   edge_local.c   the local executor: one scheduler thread that interleaves
 *                  the active sessions token by token
 *   edge_remote.c  the routed executor: the fabric client, on its own thread
 *   edge_policy.c  the signed policy held on disk, decisions, the audit log
 *   edge_http.c    the OpenAI-compatible HTTP API (libmicrohttpd, jansson)
 *   edge_conf.c    the configuration file
 *   edge_cmd.c     `fedinfer edge`
 *
 * An executor is a table of functions (edge_exec) so that the local one can
 * be replaced by a batched scheduler without touching the HTTP layer: the
 * HTTP layer only builds jobs, submits them and reads their channel.
 */
#ifndef EDGE_IMPL_H
#define EDGE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "fi_edge.h"
#include "fi_model.h"
#include "fi_sched.h"
#include "fi_textstream.h"

struct MHD_Daemon;

#define EDGE_MAX_STOP 4    /* stop strings per request (OpenAI's limit) */
#define EDGE_MAX_LABELS 16 /* residency labels per request */
#define EDGE_ID_LEN 64     /* request id, NUL included (within the wire's FI_WIRE_MAX_ID) */
#define EDGE_AUDIT_DEGRADED_MS 2000 /* /healthz says degraded this long after an audit append failed */

/* --- jobs ------------------------------------------------------------- */

#define EDGE_MAX_HASHES 512 /* prefix hashes sent with a routed request */

/* What a routed request carries over the fabric besides the job's own
 * fields; owned by its job. */
typedef struct edge_routed {
    int raw;                       /* completions: prompt is text to continue */
    int n_msgs;                    /* chat: messages (roles and contents owned) */
    char **roles, **contents;
    char *stop[EDGE_MAX_STOP];     /* stop strings (the worker stops early too) */
    int n_stop;
    char user[128];                /* OpenAI's `user`: conversation affinity */
    char tenant[64];               /* prefix-cache salt: the token's tenant */
    char application[64];          /* the token's application (the coordinator's re-check) */
    char zone[64];                 /* prefix-cache salt: the residency zone */
    uint64_t *hashes;              /* fi_prefix_hashes of the prompt (NULL: none) */
    int n_hashes;
    int prompt_tokens;             /* the prompt's size the policy decided with */
} edge_routed;
void edge_routed_free(edge_routed **r);

/* One request in flight. Created by the HTTP layer, handed to one executor;
 * both hold a reference (edge_job_unref frees at zero). Inputs are fixed
 * before submission; outputs are guarded by mu and announced on cv. */
typedef struct edge_job {
    /* inputs (immutable once submitted) */
    char id[EDGE_ID_LEN];        /* "chatcmpl-..." / "cmpl-..." */
    char model[64];              /* model name the client asked for */
    char *text;                  /* rendered prompt (local) or user text (routed) */
    int32_t *prompt;             /* local: prompt tokens (n_prompt) */
    int n_prompt;                /* local: count of prompt */
    fi_sampler_params sp;        /* sampling */
    int max_tokens;              /* tokens to generate at most */
    char *labels[EDGE_MAX_LABELS]; /* effective residency labels (routed) */
    char target[64];             /* the cluster chosen (routed), for the audit */
    edge_routed *routed;         /* routed: what goes on the wire (owned) */
    int n_labels;                /* count of labels */
    int labels_defaulted;        /* they are the edge policy's default_label, not the
                                    client's: the coordinator is sent none, so that its
                                    own (newest) policy applies its default */
    double timeout_s;            /* whole request, from submission */
    char tenant[64];             /* from the bearer token ("" without one) */
    char zone[64];               /* residency zone of the cached state (edge_decision.zone) */
    int stream;                  /* the client reads the text as it comes (SSE) */

    /* the executor's own */
    int engine_retries;          /* local: times run again after its backend failed */

    /* cancellation: set by the HTTP side, or by the executor on a stop */
    atomic_int cancel;           /* nonzero: stop generating */
    atomic_int refs;             /* owners */

    /* outputs, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;           /* signalled on new text and at the end */
    fi_textstream *ts;           /* stop strings, UTF-8 boundaries */
    char *out;                   /* final text so far (out_len bytes, NUL-terminated) */
    size_t out_len, out_cap;
    int done;                    /* 1: no more text will come */
    int http_status;             /* 0: success; else the error's HTTP status */
    char err_code[40];           /* OpenAI error code when http_status != 0 */
    char err[256];               /* message when http_status != 0 */
    char finish[16];             /* "stop" or "length" (OpenAI finish_reason) */
    int n_prompt_tokens;         /* usage: prompt tokens */
    int n_completion_tokens;     /* usage: generated tokens */
    double t_submit;             /* monotonic seconds */
    double t_first;              /* first text, 0 until then */
} edge_job;

/* A new job with one reference; stop strings are copied. NULL when out of
 * memory. */
edge_job *edge_job_new(const char *id, const char *model, const char *const *stop, int n_stop);
void edge_job_ref(edge_job *j);
/* Drops a reference; frees at zero and sets *j to NULL. */
void edge_job_unref(edge_job **j);
/* Executor side: raw text of one token. Returns 1 when a stop string is
 * complete (the executor should end the job with edge_job_finish), 0
 * otherwise, -1 when out of memory. */
int edge_job_emit(edge_job *j, const char *bytes, size_t len);
/* Executor side: the end. Releases held text, records usage. Idempotent:
 * the first end (finish or fail) wins. */
void edge_job_finish(edge_job *j, const char *finish, int n_prompt, int n_gen);
/* Whether none of the job's text can have reached its client (it is not a
 * stream, or a stream with no text yet), so that it may run again from its
 * beginning; with reset, its text so far is then dropped. 1 or 0. */
int edge_job_unseen(edge_job *j, int reset);
void edge_job_fail(edge_job *j, int http_status, const char *code, const char *msg);
double edge_now(void);
/* The CLOCK_REALTIME time ms milliseconds from now, for pthread_cond_timedwait. */
struct timespec edge_deadline_ms(long ms);

/* A request's prompt as tokens of tok (edge_prompt.c): msgs through the
 * chat template (fi_tok_chat_ids: markers as special tokens, messages as
 * plain text), or (msgs NULL) the raw prompt as plain text after BOS when
 * the model wants one, at most max_len bytes of it. malloc'd, *n tokens
 * (may be 0); NULL with a message. */
int32_t *edge_prompt_tokens(const fi_tok *tok, const fi_chat_msg *msgs, int n_msgs,
                            const char *prompt, size_t max_len, int *n, char *err,
                            size_t errlen);

/* --- executors -------------------------------------------------------- */

typedef struct edge_exec {
    const char *name;           /* "local", "fabric" */
    /* Takes a reference to j when it accepts. 0, -1 when the queue is
     * full (the caller answers 429), or -2 when the engine is down (its
     * backend failed and could not be replaced yet: 503, see engine). */
    int (*submit)(void *ctx, edge_job *j);
    /* Requests waiting or running. */
    int (*depth)(void *ctx);
    /* Optional (NULL: none): wakes the executor's thread to look at its
     * jobs' cancel flags now (a client that left). */
    void (*kick)(void *ctx);
    /* Stops accepting; lets running jobs finish for up to grace_ms, then
     * cancels the rest and joins. */
    void (*drain)(void *ctx, int grace_ms);
    void (*destroy)(void *ctx);
    /* Optional (NULL: none): the engine scheduler's counters (local). */
    void (*stats)(void *ctx, fi_sched_stats *st);
    /* Optional (NULL: always up): 1 when the engine runs, 0 while it is
     * down, with why; *resets: backends replaced after a failure so far. */
    int (*engine)(void *ctx, long *resets, char *why, size_t whylen);
    void *ctx;
} edge_exec;

/* The local executor over model: concurrency sessions advance together,
 * queue more wait. n_ctx: context per session. */
int edge_local_new(fi_model *model, int concurrency, int queue, int n_ctx, edge_exec *out,
                   char *err, size_t errlen);

/* --- policy and audit --------------------------------------------------- */

typedef struct edge_policy edge_policy;

/* Loads the bundle held in dir (trusted signer key file pubkey), opens the
 * audit log at db. A missing or invalid bundle is not an error: the agent
 * then serves on site only (fail closed) and says so. NULL on I/O errors. */
edge_policy *edge_policy_new(const char *dir, const char *pubkey, const char *db, const char *site,
                             const char *clusters, char *err, size_t errlen);
/* A record that is not a policy decision of ours: the coordinator's
 * refusal of a routed request ("deny": its policy check; "unavailable":
 * no room or no live worker), with its reason as rules. */
void edge_policy_audit_note(edge_policy *p, const char *request_id, const char *model,
                            const char *labels, const char *decision, const char *target,
                            const char *rules);
void edge_policy_destroy(edge_policy **p);
/* The version of the bundle held and valid now (0: none), said in Hello
 * so that the coordinator pushes only a newer one. */
uint64_t edge_policy_version(edge_policy *p);
/* Reloads the bundle from disk (SIGHUP). */
void edge_policy_reload(edge_policy *p);
/* Verifies and installs a bundle received from the coordinator, then
 * enforces it. 0, or -1 with the reason in err. */
int edge_policy_install(edge_policy *p, const char *buf, size_t len, char *err, size_t errlen);

/* One candidate target of a decision and what the policy said of it. */
typedef struct edge_target {
    char name[64];
    int permitted;
    int64_t score;
    char why[256];                 /* explanation, one line */
    char rules[256];               /* deciding rule ids, comma-separated */
} edge_target;

/* A routing decision: the candidate targets and what the policy said. */
typedef struct edge_decision {
    char version[96];              /* "7" or "none" (X-Fedinfer-Policy) */
    char digest[65];               /* policy digest hex, "" for fallback */
    int n;                         /* candidates: the site ([0]), then every cluster of the
                                      policy that this edge may use, however many */
    edge_target *t;                /* n of them (edge_decision_clear frees) */
    char labels[256];              /* effective labels, comma-separated */
    const char *eff_labels[EDGE_MAX_LABELS]; /* into labels_buf */
    int n_eff_labels;
    int labels_defaulted;          /* eff_labels is the policy's default_label */
    char labels_buf[EDGE_MAX_LABELS][64];
    int bad_labels;                /* a label unknown to the policy */
    int fallback;                  /* no valid policy: site only */
    char zone[64];                 /* residency zone: the site's innermost jurisdiction in
                                      the policy (the site itself without one); salts the
                                      prefix cache, here and at the clusters */
} edge_decision;

/* Decides req (origin is forced to the site) for the site and every cluster
 * of the policy (without a valid policy only the site is permitted). 0, or
 * -1 when out of memory for the candidates (d then holds none). */
int edge_policy_decide(edge_policy *p, const char *tenant, const char *app, const char *model,
                        const char *const *labels, int n_labels, int64_t prompt_tokens,
                        edge_decision *d);
/* Frees what edge_policy_decide allocated in d. */
void edge_decision_clear(edge_decision *d);
/* Appends one audit record: decision "permit"/"deny"/"fallback"/"error",
 * the chosen target ("" when none), its rules. 0, or -1 (logged, counted,
 * the reason naming the log's file in err) when it could not be stored:
 * then the request gets no answer but a 503, since nothing is served
 * without its record. */
FI_MUST_CHECK int edge_policy_audit(edge_policy *p, const char *request_id, const char *tenant,
                                    const char *app, const char *model, const edge_decision *d,
                                    const char *decision, const char *target, const char *rules,
                                    int64_t prompt_tokens, char *err, size_t errlen);
/* Appends that failed since the start, and whether the last one failed
 * less than EDGE_AUDIT_DEGRADED_MS ago (/metrics, /healthz). Only requests
 * append, so /healthz does not stay degraded for good: after that time a
 * probe sees the agent ready, the next request tries the log again, and a
 * new failure makes it degraded again. */
uint64_t edge_policy_audit_failures(edge_policy *p, int *failing);
/* Records after seq (for upload), as a JSON array text (malloc'd) of at
 * most max records; *last gets the last seq included, *count the number.
 * NULL when none or on error. */
char *edge_policy_audit_batch(edge_policy *p, int64_t after, int max, int64_t *last,
                              int64_t *count);
/* The highest seq acknowledged by the coordinator (kept in the db). */
int64_t edge_policy_uploaded(edge_policy *p);
void edge_policy_set_uploaded(edge_policy *p, int64_t seq);
int64_t edge_policy_audit_head(edge_policy *p);
/* The head of the coordinator's audit log this edge witnessed
 * (fi_client_audit_witness), kept in the db across restarts with the
 * coordinator's key fingerprint: *seq 0 and hash "" when none, or when
 * the one kept is of another coordinator (said on stderr). */
void edge_policy_witness(edge_policy *p, const char *coordinator, int64_t *seq, char hash[65]);
/* Keeps the witness of coordinator (the client only ever moves it up). */
void edge_policy_set_witness(edge_policy *p, const char *coordinator, int64_t seq, const char *hash);
/* `fedinfer edge witness`: the witness kept in db, as a line into out
 * (reset: cleared first, for an operator who replaced the coordinator's
 * log on purpose; with the agent stopped). 0, or -1 with err. */
int edge_witness_cmd(const char *db, int reset, char *out, size_t cap, char *err, size_t errlen);

/* --- the agent ----------------------------------------------------------- */

/* Counters for /metrics; all atomic (HTTP threads update them). */
typedef struct edge_metrics {
    atomic_long requests;        /* inference requests received */
    atomic_long ok_local;        /* served on site */
    atomic_long ok_routed;       /* served by a cluster */
    atomic_long denied;          /* 403: policy */
    atomic_long rejected;        /* other 4xx */
    atomic_long busy;            /* 429 */
    atomic_long unavailable;     /* 503 */
    atomic_long failed;          /* 5xx other than 503 */
    atomic_long cancelled;       /* requests whose client left before the end */
    atomic_long tokens;          /* completion tokens */
    atomic_long ttft_bucket[8];  /* time to first token, cumulative le buckets */
    atomic_long ttft_count;
    atomic_long ttft_sum_us;
} edge_metrics;

/* The limits a reload (SIGHUP) may change, taken as one snapshot per
 * request (edge_limits_now): no request sees half of an old set. */
typedef struct edge_limits {
    int max_tokens, default_max_tokens, max_body, request_timeout_s;
} edge_limits;

struct fi_edge {
    fi_edge_conf conf;            /* as loaded (its limits: see lim) */
    fi_edge_conf file;            /* as the file gave it (conf may be adjusted: n_ctx) */
    pthread_rwlock_t lim_lk;      /* guards lim */
    edge_limits lim;              /* the limits in force */
    fi_model *model;              /* local model, NULL when none */
    edge_exec local;              /* local executor (ctx NULL when no model) */
    edge_exec remote;             /* fabric executor (ctx NULL when offline only) */
    atomic_int *remote_online;    /* owned by the remote executor; NULL when none */
    edge_policy *policy;          /* bundle, decisions, audit */
    void *tokens;                 /* bearer tokens (edge_auth), NULL when auth is off */
    struct MHD_Daemon *httpd;     /* the HTTP server */
    struct edge_front *front;     /* its listener (edge_front.c) */
    int port;                     /* bound port */
    atomic_int stopping;          /* 1: refuse new requests with 503 */
    atomic_int requests_open;     /* HTTP requests begun and not yet completed */
    atomic_long next_id;          /* request ids */
    char id_salt[9];              /* random per start, in every request id (8 hex) */
    long started;                 /* Unix seconds: the agent's start, "created" of its model */
    edge_metrics m;
};

/* The listener in front of libmicrohttpd (edge_front.c): accepts, answers
 * an unparsable or absurd Content-Length with a JSON error, hands the rest
 * to e->httpd. */
typedef struct edge_front edge_front;
struct sockaddr_in;
edge_front *edge_front_start(fi_edge *e, const struct sockaddr_in *sa, int *port, char *err,
                             size_t errlen);
void edge_front_stop(edge_front **f);
/* Header lines a request head may hold (Apache's LimitRequestFields):
 * libmicrohttpd spends its per-connection memory on each, and a head of a
 * thousand short lines, 12 KB, ran its 64 KiB out (its HTML 431). */
#define EDGE_HEAD_MAX_LINES 100
/* The check on a complete request head (h, n bytes up to its blank line),
 * for what libmicrohttpd would answer with an HTML page, or not at all:
 * 0 when it may go on; else 400 (a control byte, a header line without a
 * name and colon, folded or with whitespace before its colon, a
 * Content-Length that is not a number, two that differ, or one beside
 * Transfer-Encoding), 413 (a Content-Length over 2^64-1), 431 (more than
 * EDGE_HEAD_MAX_LINES header lines), 501 (a Transfer-Encoding other than
 * chunked) or 505 (a version other than HTTP/1.x), with an OpenAI error
 * code and a message. Empty lines before the request line are skipped. */
int edge_front_check_head(const char *h, size_t n, long max_body, char *code, size_t clen,
                          char *msg, size_t mlen);

/* The limits in force now (edge_agent.c). */
edge_limits edge_limits_now(fi_edge *e);

/* The keys whose value differs between the running file's configuration
 * and a re-read one, other than the limits a reload applies (max_tokens,
 * default_max_tokens, max_body, request_timeout_s): comma-separated into
 * out, "" when none. How many (edge_agent.c). */
int edge_conf_restart_keys(const fi_edge_conf *run, const fi_edge_conf *nc, char *out, size_t cap);

/* HTTP server (edge_http.c). */
int edge_http_start(fi_edge *e, char *err, size_t errlen);
void edge_http_stop(fi_edge *e);

/* A cluster's load for one model, as the coordinator last said
 * (edge_remote_cluster_load). */
typedef struct edge_cluster_load {
    int workers;     /* live workers serving the model */
    int capacity;    /* their capacity, summed */
    int busy;        /* requests open on them, or waiting there if more */
} edge_cluster_load;

/* The routed executor (edge_remote.c): a fabric client on its own thread. */
int edge_remote_new(fi_edge *e, edge_exec *out, char *err, size_t errlen);
/* What the coordinator's heartbeats last said about cluster's load for
 * model: 1 with *out filled; 0 when no live worker there serves the
 * model (a recent heartbeat left it out: it lists every cluster with a
 * live worker); -1 when nothing is known (no heartbeat for a few
 * periods, or none yet, or the last one left it out but said that it
 * left rows out: clusters_truncated). */
int edge_remote_cluster_load(fi_edge *e, const char *cluster, const char *model,
                             edge_cluster_load *out);
struct fi_client_opts;
/* Client options from the configuration (keys loaded; wipe o->kp). */
int edge_remote_client_opts(const fi_edge_conf *c, struct fi_client_opts *o, char *err,
                            size_t errlen);

/* Bearer tokens (edge_auth.c), stored hashed in the edge's SQLite. With
 * check, the whole file is checked first (fi_db_check: a damaged one is
 * refused, naming it): at the start of a command; not for a file the
 * process checked already (the edge's own, by edge_policy_new) or while
 * serving. NULL with a message. */
void *edge_auth_open(const char *db, int check, char *err, size_t errlen);
void edge_auth_close(void **a);
/* 1 with tenant and app filled when token is valid, else 0. */
int edge_auth_check(void *a, const char *token, char *tenant, size_t tlen, char *app, size_t alen);
void edge_token_hash(const char *token, char out[65]);
/* Makes a token for tenant/app, stores its hash, and writes it to token. */
int edge_token_add(const char *db, const char *tenant, const char *app, char *token, size_t toklen,
                   char *err, size_t errlen);
/* Applies the coordinator's AppTokenSync (tokens managed with `fedctl
 * token`): inserts the hashes it lacks, revokes the revoked ones, never
 * revives a revoked one, leaves local tokens alone. 0, or -1 with a
 * message (nothing applied). */
struct Fi__AppTokenSync;
int edge_token_sync(const char *db, const struct Fi__AppTokenSync *sy, int *added, int *revoked,
                    char *err, size_t errlen);
/* Revokes by token or by its hash. */
int edge_token_revoke(const char *db, const char *token_or_hash, char *err, size_t errlen);

#endif /* EDGE_IMPL_H */
