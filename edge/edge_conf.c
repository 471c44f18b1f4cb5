/*
 * edge_conf.c - the edge agent's configuration file (fi_conf format: strict
 * `key = value`, unknown and repeated keys are errors naming file and line).
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "fi_edge.h"

#define S(k, req) {#k, FI_CONF_STR, offsetof(fi_edge_conf, k), req, 0, 0, 0}
#define I(k, lo, hi) {#k, FI_CONF_INT, offsetof(fi_edge_conf, k), 0, lo, hi, 0}
#define E_OFF(f) offsetof(fi_edge_conf, f)

const fi_conf_key fi_edge_conf_keys[] = {
    S(site, 1),
    S(listen, 0),
    I(port, 0, 65535),
    S(model, 0),
    S(model_name, 0),
    S(model_sha256, 0),
    I(threads, 0, 256),
    FI_CONF_PRECISION_KEYS(E_OFF),
    I(n_ctx, 64, 32768),
    I(concurrency, 1, 64),
    I(queue, 0, 4096),
    I(max_body, 1024, 64 << 20),
    I(max_tokens, 1, 32768),
    I(default_max_tokens, 0, 32768),
    I(request_timeout_s, 1, 86400),
    I(conn_limit, 1, 65536),
    I(per_ip_limit, 0, 65536),
    I(conn_timeout_s, 1, 3600),
    I(conn_memory, 4096, 16 << 20),
    I(shutdown_grace_s, 0, 3600),
    S(db, 0),
    S(policy_dir, 0),
    S(policy_key, 0),
    I(auth, 0, 1),
    S(coordinator, 0),
    S(coordinator_key, 0),
    S(secret_key, 0),
    S(enrol_endpoint, 0),
    S(region, 0),
    S(clusters, 0),
    I(heartbeat_ms, 50, 60000),
    {NULL, FI_CONF_STR, 0, 0, 0, 0, 0},
};

void fi_edge_conf_default(fi_edge_conf *c) {
    memset(c, 0, sizeof *c);
    snprintf(c->listen, sizeof c->listen, "127.0.0.1");
    c->port = 8080;
    c->n_ctx = 2048;
    c->act_bits = 0; /* the backend's default (fi_cpu_backend_set_act_bits) */
    c->kv_bits = 16;
    c->concurrency = 4;
    c->queue = 16;
    c->max_body = 1 << 20;
    c->max_tokens = 1024;
    c->default_max_tokens = 0; /* min(256, max_tokens) */
    c->request_timeout_s = 300;
    c->conn_limit = 256;
    c->per_ip_limit = 64;
    c->conn_timeout_s = 30;
    c->conn_memory = 64 * 1024;
    c->shutdown_grace_s = 10;
    snprintf(c->db, sizeof c->db, "edge.db");
    c->heartbeat_ms = 1000;
}

/* The line that sets key in path (0 when none): combination errors name
 * it too. */
static int s_line_of(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[FI_CONF_STR_MAX + 128];
    int n = 0, found = 0;
    size_t kl = strlen(key);
    while (!found && fgets(line, sizeof line, f)) {
        n++;
        const char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (!strncmp(p, key, kl) && (p[kl] == ' ' || p[kl] == '\t' || p[kl] == '=')) found = n;
    }
    fclose(f);
    return found;
}

int fi_edge_conf_load(const char *path, fi_edge_conf *c, char *err, size_t errlen) {
    if (fi_conf_load(path, fi_edge_conf_keys, c, err, errlen) != 0) return -1;
    if (c->default_max_tokens == 0) c->default_max_tokens = c->max_tokens < 256 ? c->max_tokens : 256;
    const char *bad = NULL, *why = NULL;
    if (c->model[0] && !c->model_name[0])
        bad = "model_name", why = "is required with model";
    else if (c->coordinator[0] && (!c->coordinator_key[0] || !c->secret_key[0]))
        bad = "coordinator", why = "needs coordinator_key and secret_key";
    else if (!c->model[0] && !c->coordinator[0])
        bad = "model", why = "neither a local model nor a coordinator: nothing could serve";
    else if (c->policy_dir[0] && !c->policy_key[0])
        bad = "policy_dir", why = "needs policy_key (the trusted signer's public key)";
    else if (c->default_max_tokens > c->max_tokens)
        bad = "default_max_tokens", why = "exceeds max_tokens";
    if (bad) {
        int line = s_line_of(path, bad);
        if (line)
            snprintf(err, errlen, "%s:%d: %s %s", path, line, bad, why);
        else
            snprintf(err, errlen, "%s: %s %s", path, bad, why);
        return -1;
    }
    return 0;
}
