/*
 * fi_edge.h - the edge agent: what a site runs. Applications on the site
 * send it OpenAI-style inference requests over HTTP; it answers them with
 * the local engine or, where the residency policy permits and it is the
 * better place, over the fabric on a core cluster.
 *
 *   fedinfer edge --config edge.conf
 *
 * Ownership: fi_edge_new returns an agent the caller destroys with
 * fi_edge_destroy; the configuration is copied.
 */
#ifndef FI_EDGE_H
#define FI_EDGE_H

#include <stdatomic.h>
#include <stddef.h>

#include "fi_conf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The configuration file's contents (fi_conf format: key = value). */
typedef struct fi_edge_conf {
    char site[FI_CONF_STR_MAX];            /* this site's name in the policy (required) */
    char listen[FI_CONF_STR_MAX];          /* address to bind, default 127.0.0.1 */
    int port;                              /* HTTP port (0: any free port) */
    char model[FI_CONF_STR_MAX];           /* local GGUF model ("" : none, route only) */
    char model_sha256[FI_CONF_STR_MAX];    /* its expected SHA-256 ("": not checked) */
    char model_name[FI_CONF_STR_MAX];      /* name requests use for it */
    int threads;                           /* engine threads (0: one per core) */
    int act_bits;                          /* CPU activation precision: 16, 12 or 8,
                                              0 the backend's default
                                              (fi_cpu_backend_set_act_bits) */
    int kv_bits;                           /* CPU KV cache precision: 16 or 8
                                              (fi_cpu_backend_set_kv_bits) */
    int n_ctx;                             /* context per local session, tokens */
    int concurrency;                       /* local sessions that advance together */
    int queue;                             /* requests waiting beyond concurrency */
    int max_body;                          /* bytes of a request body */
    int max_tokens;                        /* cap on a request's max_tokens */
    int default_max_tokens;                /* when a request gives none (0: min(256, max_tokens)) */
    int request_timeout_s;                 /* whole request, seconds */
    int conn_limit;                        /* HTTP connections at once */
    int per_ip_limit;                      /* HTTP connections per client address */
    int conn_timeout_s;                    /* idle HTTP connection, seconds */
    int conn_memory;                       /* bytes of buffer per HTTP connection */
    int shutdown_grace_s;                  /* SIGTERM: time to finish in-flight work */
    char db[FI_CONF_STR_MAX];              /* SQLite: audit log and tokens */
    char policy_dir[FI_CONF_STR_MAX];      /* held signed bundle (fi_bundle_install) */
    char policy_key[FI_CONF_STR_MAX];      /* trusted policy-signing public key file */
    int auth;                              /* 1: bearer tokens required */
    char coordinator[FI_CONF_STR_MAX];     /* fabric endpoint ("" : offline only) */
    char coordinator_key[FI_CONF_STR_MAX]; /* coordinator's public key file */
    char secret_key[FI_CONF_STR_MAX];      /* this edge's CURVE secret key (0600) */
    char enrol_endpoint[FI_CONF_STR_MAX];  /* for --enrol */
    char region[FI_CONF_STR_MAX];          /* for --enrol */
    char clusters[FI_CONF_STR_MAX];        /* comma-separated; "" : every cluster of the policy */
    int heartbeat_ms;                      /* fabric heartbeat; match the coordinator's */
} fi_edge_conf;

/* Defaults for every optional key. */
void fi_edge_conf_default(fi_edge_conf *c);
/* The file's keys. */
extern const fi_conf_key fi_edge_conf_keys[];
/* Loads path over defaults and checks the combination. 0, or -1 with
 * "FILE:LINE: ..." (or "FILE: key: ...") in err. */
int fi_edge_conf_load(const char *path, fi_edge_conf *c, char *err, size_t errlen);

typedef struct fi_edge fi_edge;

/* Loads the model, the policy and the audit log, starts the executors and
 * the HTTP server. NULL with a message on failure. */
fi_edge *fi_edge_new(const fi_edge_conf *c, char *err, size_t errlen);
/* The HTTP port actually bound. */
int fi_edge_port(const fi_edge *e);
/* Re-reads what can change without a restart: the policy bundle on disk
 * and the limits of the configuration file at path. */
void fi_edge_reload(fi_edge *e, const char *path);
/* Stops accepting, lets in-flight requests finish within the configured
 * grace, cancels the rest, and frees everything; safe on NULL. */
void fi_edge_destroy(fi_edge **e);

/* `fedinfer edge`. */
int fi_cmd_edge(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif /* FI_EDGE_H */
