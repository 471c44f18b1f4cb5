/*
 * edge_http.c - the OpenAI-compatible HTTP API of the edge agent.
 *
 *   POST /v1/chat/completions, POST /v1/completions (stream false or true)
 *   GET /v1/models, GET /healthz, GET /metrics
 *
 * libmicrohttpd runs one thread per connection (bounded by the connection
 * limit), so a handler may wait for its job without holding anyone else
 * up. Bodies are read by hand with a size limit (no post processor: see
 * FIELD-NOTES on CVE-2023-27371); JSON is parsed by jansson after a depth
 * check of our own. Every error is an OpenAI-shaped JSON body:
 *   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sodium.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "edge_impl.h"
#include "fi_audit.h"
#include "fi_sched.h"
#include "fi_wire.h"

#define EDGE_MAX_DEPTH 32       /* JSON nesting we accept */
#define EDGE_MAX_MESSAGES 256   /* chat messages per request */
#define EDGE_MAX_PARTS 64       /* text parts of one message's content */

/* Per-connection state (MHD's con_cls). */
typedef struct s_conn {
    char *body;          /* request body so far */
    size_t len, cap;     /* bytes, allocated */
    int too_big;         /* the body passed max_body: answer 413 */
    size_t discarded;    /* bytes of an oversized body thrown away */
    int started;         /* the first call (headers only) is over */
} s_conn;

/* A parsed inference request. */
typedef struct s_req {
    int chat;                          /* /v1/chat/completions */
    int stream;                        /* SSE */
    int usage_chunk;                   /* stream_options.include_usage */
    int max_tokens_given;              /* max_tokens (or max_completion_tokens) was sent */
    const char *max_tokens_key;        /* which of the two, as the client named it */
    const char *model;                 /* borrowed from the JSON */
    int max_tokens;
    fi_sampler_params sp;
    const char *stop[EDGE_MAX_STOP];
    int n_stop;
    const char *user;
    const char *labels[EDGE_MAX_LABELS];
    int n_labels;
    char labels_buf[EDGE_MAX_LABELS][64];
    fi_chat_msg msgs[EDGE_MAX_MESSAGES];
    int n_msgs;
    char *joined[EDGE_MAX_MESSAGES];   /* owned: a content of several text parts, joined */
    const char *prompt;                /* completions */
} s_req;

static void s_req_free(s_req *r) {
    if (!r) return;
    for (int i = 0; i < EDGE_MAX_MESSAGES; i++) free(r->joined[i]);
    free(r);
}

/* ------------------------------------------------------------ responses */

static enum MHD_Result s_send(struct MHD_Connection *c, int status, const char *ctype, char *body,
                              const char *const *hdrs) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    /* One request per connection: the listener checks every request's
     * head (Content-Length) before libmicrohttpd reads it, and it sees only
     * a connection's first request (edge_front.c). */
    MHD_add_response_header(r, "Connection", "close");
    for (int i = 0; hdrs && hdrs[i]; i += 2) MHD_add_response_header(r, hdrs[i], hdrs[i + 1]);
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result s_json(struct MHD_Connection *c, int status, json_t *j,
                              const char *const *hdrs) {
    char *body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!body) /* out of memory: still an answer, not a dropped connection */
        body = strdup("{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"code\":\"internal_error\"}}");
    if (!body) return MHD_NO;
    return s_send(c, status, "application/json", body, hdrs);
}

static const char *s_err_type(int status) {
    switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "invalid_request_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

static json_t *s_err_obj(int status, const char *code, const char *param, const char *msg) {
    return json_pack("{s:{s:s,s:s,s:s?,s:s}}", "error", "message", msg, "type", s_err_type(status),
                     "param", param, "code", code);
}

static void s_count_status(fi_edge *e, int status) {
    if (status == 403) atomic_fetch_add(&e->m.denied, 1);
    else if (status == 429) atomic_fetch_add(&e->m.busy, 1);
    else if (status == 503) atomic_fetch_add(&e->m.unavailable, 1);
    else if (status >= 500) atomic_fetch_add(&e->m.failed, 1);
    else if (status >= 400) atomic_fetch_add(&e->m.rejected, 1);
}

static enum MHD_Result s_error(fi_edge *e, struct MHD_Connection *c, int status, const char *code,
                               const char *param, const char *const *hdrs, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));

static enum MHD_Result s_error(fi_edge *e, struct MHD_Connection *c, int status, const char *code,
                               const char *param, const char *const *hdrs, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fi_text_clean(msg); /* it may quote the client's bytes, or be cut inside a character */
    if (e) s_count_status(e, status);
    return s_json(c, status, s_err_obj(status, code, param, msg), hdrs);
}

/* Whether the client has closed its end of the connection (a client that
 * only shuts down its sending side reads the same; HTTP clients do not). */
static int s_peer_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci || ci->connect_fd < 0) return 0;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* ------------------------------------------------------------- parsing */

/* Nesting depth of a JSON text, strings skipped; stops counting past max. */
static int s_depth_ok(const char *s, size_t n, int max) {
    int d = 0, in_str = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (in_str) {
            if (ch == '\\') i++;
            else if (ch == '"') in_str = 0;
        } else if (ch == '"') in_str = 1;
        else if (ch == '[' || ch == '{') {
            if (++d > max) return 0;
        } else if (ch == ']' || ch == '}') d--;
    }
    return 1;
}

static int s_label_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 63) return 0;
    for (size_t i = 0; i < n; i++)
        if (!(islower((unsigned char)s[i]) || isdigit((unsigned char)s[i]) || s[i] == '-' ||
              s[i] == '_'))
            return 0;
    return 1;
}

/* Adds the comma-separated labels of s (trimmed, lower case). 0, or -1
 * with a message. */
static int s_add_labels(s_req *r, const char *s, char *msg, size_t mlen) {
    const char *p = s;
    while (*p) {
        while (*p == ' ' || *p == '\t') p++;
        const char *q = p;
        while (*q && *q != ',') q++;
        const char *end = q;
        while (end > p && (end[-1] == ' ' || end[-1] == '\t')) end--;
        size_t n = (size_t)(end - p);
        if (n) {
            if (r->n_labels >= EDGE_MAX_LABELS || n >= 64) {
                snprintf(msg, mlen, "at most %d labels of at most 63 characters", EDGE_MAX_LABELS);
                return -1;
            }
            char *dst = r->labels_buf[r->n_labels];
            for (size_t i = 0; i < n; i++) dst[i] = (char)tolower((unsigned char)p[i]);
            dst[n] = 0;
            if (!s_label_ok(dst)) {
                snprintf(msg, mlen, "label '%.63s' is not a name of [a-z0-9_-]", dst);
                return -1;
            }
            int dup = 0;
            for (int i = 0; i < r->n_labels; i++) dup |= !strcmp(r->labels[i], dst);
            if (!dup) r->labels[r->n_labels++] = dst;
        } else if (*q == ',' || q == s) {
            snprintf(msg, mlen, "empty label in '%.100s'", s);
            return -1;
        }
        p = *q ? q + 1 : q;
    }
    /* "a," ends in an empty label too */
    const char *t = s + strlen(s);
    while (t > s && (t[-1] == ' ' || t[-1] == '\t')) t--;
    if (t > s && t[-1] == ',') {
        snprintf(msg, mlen, "empty label in '%.100s'", s);
        return -1;
    }
    return 0;
}

/* X-Data-Class headers, each added to r's labels (s_add_labels); bad: 1
 * with msg set at the first one refused. */
typedef struct s_xdc {
    s_req *r;
    char *msg;
    size_t mlen;
    int bad;
} s_xdc;

static enum MHD_Result s_xdc_each(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    s_xdc *x = cls;
    (void)kind;
    if (!key || strcasecmp(key, "X-Data-Class")) return MHD_YES;
    if (s_add_labels(x->r, value ? value : "", x->msg, x->mlen) == 0) return MHD_YES;
    x->bad = 1;
    return MHD_NO;
}

/* The first request field, other than those s_parse reads, whose value
 * would change the answer in a way this agent does not implement (tools,
 * structured output, log probabilities, echo, ...),
 * or NULL. Their default values are accepted, as clients often send them;
 * fields that do not change the answer (store, metadata, service_tier,
 * parallel_tool_calls, ...) are ignored. */
static const char *s_unsupported(json_t *root, int chat) {
    json_t *v;
#define SET(name) ((v = json_object_get(root, name)) != NULL && !json_is_null(v))
    if (SET("response_format")) {
        json_t *t = json_object_get(v, "type");
        if (!json_is_object(v) || !json_is_string(t) || strcmp(json_string_value(t), "text"))
            return "response_format";
    }
    if (SET("tools") && !(json_is_array(v) && json_array_size(v) == 0)) return "tools";
    if (SET("functions") && !(json_is_array(v) && json_array_size(v) == 0)) return "functions";
    if (SET("tool_choice") && !(json_is_string(v) && (!strcmp(json_string_value(v), "none") ||
                                                      !strcmp(json_string_value(v), "auto"))))
        return "tool_choice";
    if (SET("function_call") && !(json_is_string(v) && (!strcmp(json_string_value(v), "none") ||
                                                        !strcmp(json_string_value(v), "auto"))))
        return "function_call";
    /* chat: a boolean; completions: how many alternatives to return with
     * each token's own log probability (0 still returns that) */
    if (SET("logprobs") && !json_is_false(v)) return "logprobs";
    if (SET("top_logprobs") && !(json_is_integer(v) && json_integer_value(v) == 0)) return "top_logprobs";
    if (SET("modalities") && !(json_is_array(v) && json_array_size(v) == 1 &&
                               json_is_string(json_array_get(v, 0)) &&
                               !strcmp(json_string_value(json_array_get(v, 0)), "text")))
        return "modalities";
    if (SET("audio")) return "audio";
    if (SET("prediction")) return "prediction";
    if (!chat) {
        if (SET("echo") && !json_is_false(v)) return "echo";
        if (SET("suffix") && !(json_is_string(v) && json_string_length(v) == 0)) return "suffix";
        if (SET("best_of") && !(json_is_integer(v) && json_integer_value(v) == 1)) return "best_of";
    }
#undef SET
    return NULL;
}

/* Fills r from the JSON object. Returns 0, or an HTTP status with code,
 * param and message. */
static int s_parse(fi_edge *e, json_t *root, s_req *r, const char **code, const char **param,
                   char *msg, size_t mlen) {
    const edge_limits lim = edge_limits_now(e); /* this request's */
    *code = "invalid_value";
    *param = NULL;
    if (!json_is_object(root)) {
        *code = "invalid_json";
        snprintf(msg, mlen, "the body must be a JSON object");
        return 400;
    }
    json_t *v;
#define BAD(p, ...)                                                                               \
    do {                                                                                          \
        *param = p;                                                                               \
        snprintf(msg, mlen, __VA_ARGS__);                                                         \
        return 400;                                                                               \
    } while (0)
    v = json_object_get(root, "model");
    if (!json_is_string(v) || !json_string_length(v) || json_string_length(v) > 63)
        BAD("model", "'model' must be a string of 1 to 63 characters");
    r->model = json_string_value(v);
    v = json_object_get(root, "stream");
    if (v && !json_is_null(v) && !json_is_boolean(v)) BAD("stream", "'stream' must be a boolean");
    r->stream = json_is_true(v);
    v = json_object_get(root, "stream_options");
    if (v && !json_is_null(v)) {
        json_t *u = json_object_get(v, "include_usage");
        if (!json_is_object(v) || (u && !json_is_null(u) && !json_is_boolean(u)))
            BAD("stream_options", "'stream_options' must be an object with a boolean 'include_usage'");
        if (!r->stream) BAD("stream_options", "'stream_options' is only allowed with 'stream': true");
        r->usage_chunk = json_is_true(u);
    }
    r->max_tokens = lim.default_max_tokens;
    const char *mt = "max_completion_tokens";
    v = json_object_get(root, mt);
    if (!v || json_is_null(v)) v = json_object_get(root, mt = "max_tokens");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v)) BAD(mt, "'%s' must be an integer", mt);
        json_int_t n = json_integer_value(v);
        if (n < 1 || n > lim.max_tokens)
            BAD(mt, "'%s' must be between 1 and %d on this agent", mt, lim.max_tokens);
        r->max_tokens = (int)n;
        r->max_tokens_given = 1;
        r->max_tokens_key = mt;
    }
    r->sp = fi_sampler_defaults();
    r->sp.temperature = 1.0f; /* OpenAI's default */
    r->sp.top_k = 0;
    r->sp.top_p = 1.0f;
    r->sp.min_p = 0.0f;
    v = json_object_get(root, "temperature");
    if (v && !json_is_null(v)) {
        if (!json_is_number(v)) BAD("temperature", "'temperature' must be a number");
        double t = json_number_value(v);
        if (!(t >= 0 && t <= 2)) BAD("temperature", "'temperature' must be between 0 and 2");
        r->sp.temperature = (float)t;
    }
    v = json_object_get(root, "top_p");
    if (v && !json_is_null(v)) {
        if (!json_is_number(v)) BAD("top_p", "'top_p' must be a number");
        double t = json_number_value(v);
        if (!(t >= 0 && t <= 1)) BAD("top_p", "'top_p' must be between 0 and 1");
        r->sp.top_p = (float)t;
        if (r->sp.top_p == 0.0f) r->sp.temperature = 0.0f; /* only the likeliest token: greedy */
    }
    /* OpenAI's penalties and logit_bias (core/sampler.c) */
    static const char *const pens[2] = {"presence_penalty", "frequency_penalty"};
    for (int k = 0; k < 2; k++) {
        v = json_object_get(root, pens[k]);
        if (!v || json_is_null(v)) continue;
        double t = json_is_number(v) ? json_number_value(v) : 99;
        if (!(t >= -2 && t <= 2)) BAD(pens[k], "'%s' must be a number between -2 and 2", pens[k]);
        if (k) r->sp.frequency_penalty = (float)t;
        else r->sp.presence_penalty = (float)t;
    }
    v = json_object_get(root, "logit_bias");
    if (v && !json_is_null(v)) {
        if (!json_is_object(v) || json_object_size(v) > FI_SAMPLER_MAX_BIAS)
            BAD("logit_bias", "'logit_bias' must be an object of at most %d token ids and biases",
                FI_SAMPLER_MAX_BIAS);
        /* the local model's vocabulary, when it is the one asked for (a
         * cluster's worker checks against its own) */
        long vocab = e->model && !strcmp(r->model, e->conf.model_name) ? fi_tok_n_vocab(fi_model_tok(e->model))
                                                                         : (long)INT32_MAX;
        const char *key;
        json_t *b;
        json_object_foreach(v, key, b) {
            /* canonical decimal only: "01" beside "1" would bias one
             * token twice, past the range */
            char *end;
            long id = key[0] >= '0' && key[0] <= '9' && (key[0] != '0' || !key[1]) ? strtol(key, &end, 10) : -1;
            if (id < 0 || *end || id >= vocab || strlen(key) > 10)
                BAD("logit_bias", "logit_bias: '%.20s' is not a token id of this model (0..%ld)", key, vocab - 1);
            double t = json_is_number(b) ? json_number_value(b) : 999;
            if (!(t >= -100 && t <= 100))
                BAD("logit_bias", "logit_bias: the bias of token %ld must be a number between -100 and 100", id);
            r->sp.bias[r->sp.n_bias++] = (fi_logit_bias){(int32_t)id, (float)t};
        }
    }
    v = json_object_get(root, "seed");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v)) BAD("seed", "'seed' must be an integer");
        r->sp.seed = (uint64_t)json_integer_value(v);
    } else {
        r->sp.seed = (uint64_t)atomic_fetch_add(&e->next_id, 1) * 0x9E3779B97F4A7C15ull ^
                     (uint64_t)time(NULL);
    }
    v = json_object_get(root, "n");
    if (v && !json_is_null(v) && (!json_is_integer(v) || json_integer_value(v) != 1))
        BAD("n", "only 'n' = 1 is supported");
    /* parameters that would change the answer and that this agent does
     * not implement: refused by name, never silently ignored */
    {
        const char *u = s_unsupported(root, r->chat);
        if (u) {
            *code = "unsupported_parameter";
            BAD(u, "'%s' is not supported by this agent (only its default value is accepted)", u);
        }
    }
    v = json_object_get(root, "stop");
    if (v && !json_is_null(v)) {
        if (json_is_string(v)) {
            r->stop[r->n_stop++] = json_string_value(v);
        } else if (json_is_array(v) && json_array_size(v) <= EDGE_MAX_STOP) {
            for (size_t i = 0; i < json_array_size(v); i++) {
                json_t *s = json_array_get(v, i);
                if (!json_is_string(s)) BAD("stop", "'stop' must be a string or strings");
                r->stop[r->n_stop++] = json_string_value(s);
            }
        } else {
            BAD("stop", "'stop' must be a string or an array of at most %d strings", EDGE_MAX_STOP);
        }
        for (int i = 0; i < r->n_stop; i++)
            if (strlen(r->stop[i]) > 256) BAD("stop", "a stop string is longer than 256 bytes");
    }
    v = json_object_get(root, "user");
    if (v && !json_is_null(v)) {
        if (!json_is_string(v)) BAD("user", "'user' must be a string");
        r->user = json_string_value(v);
    }
    v = json_object_get(root, "data_class");
    if (v && !json_is_null(v)) {
        if (json_is_string(v)) {
            if (s_add_labels(r, json_string_value(v), msg, mlen)) {
                *param = "data_class";
                *code = "bad_label";
                return 400;
            }
        } else if (json_is_array(v)) {
            for (size_t i = 0; i < json_array_size(v); i++) {
                json_t *s = json_array_get(v, i);
                if (!json_is_string(s) || strchr(json_string_value(s), ','))
                    BAD("data_class", "'data_class' must be a string or an array of labels");
                if (s_add_labels(r, json_string_value(s), msg, mlen)) {
                    *param = "data_class";
                    *code = "bad_label";
                    return 400;
                }
            }
        } else {
            BAD("data_class", "'data_class' must be a string or an array of labels");
        }
    }
    if (r->chat) {
        v = json_object_get(root, "messages");
        if (!json_is_array(v) || !json_array_size(v) || json_array_size(v) > EDGE_MAX_MESSAGES)
            BAD("messages", "'messages' must be an array of 1 to %d messages", EDGE_MAX_MESSAGES);
        for (size_t i = 0; i < json_array_size(v); i++) {
            json_t *m = json_array_get(v, i);
            json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
            if (!json_is_object(m) || !json_is_string(role))
                BAD("messages", "messages[%zu] must be an object with a string 'role'", i);
            const char *rs = json_string_value(role);
            if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") &&
                strcmp(rs, "developer"))
                BAD("messages", "messages[%zu].role '%.32s' is not one of system, developer, user or assistant%s",
                    i, rs, !strcmp(rs, "tool") || !strcmp(rs, "function") ? " (tool calls are not supported)" : "");
            /* a history replayed from an answer carries "tool_calls": null
             * (or []): no calls, served; real ones are not */
            json_t *tc = json_object_get(m, "tool_calls"), *fc = json_object_get(m, "function_call");
            if ((tc && !json_is_null(tc) && !(json_is_array(tc) && json_array_size(tc) == 0)) ||
                (fc && !json_is_null(fc))) {
                *code = "unsupported_parameter";
                BAD("messages", "messages[%zu] carries tool calls, which this agent does not support", i);
            }
            const char *text = NULL;
            if (!strcmp(rs, "assistant") && (!content || json_is_null(content))) {
                text = ""; /* an assistant turn may come without content */
            } else if (json_is_string(content)) {
                text = json_string_value(content);
                if (strlen(text) != json_string_length(content))
                    BAD("messages", "messages[%zu].content holds a NUL character", i);
            } else if (json_is_array(content) && json_array_size(content) >= 1 &&
                       json_array_size(content) <= EDGE_MAX_PARTS) {
                /* text parts, as the OpenAI API sends them, joined by newlines */
                size_t np = json_array_size(content), total = 0;
                for (size_t k = 0; k < np; k++) {
                    json_t *part = json_array_get(content, k);
                    json_t *type = json_object_get(part, "type"), *t = json_object_get(part, "text");
                    if (!json_is_object(part) || !json_is_string(type))
                        BAD("messages", "messages[%zu].content[%zu] must be an object with a string 'type'", i, k);
                    if (strcmp(json_string_value(type), "text") || !json_is_string(t))
                        BAD("messages", "messages[%zu].content[%zu]: only text parts ({\"type\": \"text\", \"text\": ...}) are served, not '%.32s'",
                            i, k, json_string_value(type));
                    if (strlen(json_string_value(t)) != json_string_length(t))
                        BAD("messages", "messages[%zu].content[%zu].text holds a NUL character", i, k);
                    total += json_string_length(t) + 1;
                }
                if (np == 1) {
                    text = json_string_value(json_object_get(json_array_get(content, 0), "text"));
                } else {
                    char *j = malloc(total);
                    if (!j) {
                        *code = "internal_error";
                        snprintf(msg, mlen, "out of memory");
                        return 500;
                    }
                    size_t at = 0;
                    for (size_t k = 0; k < np; k++) {
                        json_t *t = json_object_get(json_array_get(content, k), "text");
                        if (k) j[at++] = '\n';
                        memcpy(j + at, json_string_value(t), json_string_length(t));
                        at += json_string_length(t);
                    }
                    j[at] = 0;
                    r->joined[r->n_msgs] = j;
                    text = j;
                }
            } else {
                BAD("messages", "messages[%zu].content must be a string or an array of 1 to %d text parts", i,
                    EDGE_MAX_PARTS);
            }
            r->msgs[r->n_msgs].role = !strcmp(rs, "developer") ? "system" : rs;
            r->msgs[r->n_msgs].content = text;
            r->n_msgs++;
        }
    } else {
        v = json_object_get(root, "prompt");
        if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
            v = json_array_get(v, 0);
        if (json_is_array(v) && json_array_size(v) > 0) {
            /* valid in OpenAI's API, not served here: said so by name */
            *code = "unsupported_parameter";
            BAD("prompt", "'prompt' as %s is not supported by this agent (a string, or an array of one "
                "string, is)", json_array_size(v) > 1 && json_is_string(json_array_get(v, 0))
                                   ? "an array of several prompts" : "an array of token ids");
        }
        if (!json_is_string(v)) BAD("prompt", "'prompt' must be a string");
        if (strlen(json_string_value(v)) != json_string_length(v))
            BAD("prompt", "'prompt' holds a NUL character");
        r->prompt = json_string_value(v);
    }
#undef BAD
    return 0;
}

/* ------------------------------------------------------------ streaming */

/* What a streamed response's reader owns. */
typedef struct s_stream {
    fi_edge *e;          /* the agent */
    edge_job *job;       /* one reference */
    int chat;            /* chunk shape */
    long created;        /* Unix seconds */
    size_t sent;         /* bytes of job->out already sent */
    int phase;           /* 0: role chunk due, 1: content, 2: [DONE] due, 3: over */
    char *pend;          /* formatted bytes not yet handed to MHD */
    size_t pend_len, pend_off;
    int routed;          /* counts for metrics */
    int usage_chunk;     /* stream_options.include_usage: usage in a chunk of its own */
} s_stream;

/* One server-sent event: the chunk with text (or none), finish (NULL
 * until the end), or, with usage, the usage chunk that OpenAI sends last
 * when asked (stream_options.include_usage: no choices, the counts; the
 * other chunks then carry "usage": null). */
static char *s_chunk(const s_stream *st, const char *text, size_t len, const char *finish,
                     int usage) {
    json_t *choice;
    if (st->chat) {
        json_t *delta = json_object();
        if (st->phase == 0) json_object_set_new(delta, "role", json_string("assistant"));
        if (text) json_object_set_new(delta, "content", json_stringn(text, len));
        choice = json_pack("{s:i,s:o,s:o}", "index", 0, "delta", delta, "finish_reason",
                           finish ? json_string(finish) : json_null());
    } else {
        choice = json_pack("{s:i,s:s%,s:n,s:o}", "index", 0, "text", text ? text : "",
                           text ? len : 0, "logprobs", "finish_reason",
                           finish ? json_string(finish) : json_null());
    }
    if (usage) {
        json_decref(choice);
        choice = NULL;
    }
    json_t *o = json_pack("{s:s,s:s,s:i,s:s,s:o}", "id", st->job->id, "object",
                          st->chat ? "chat.completion.chunk" : "text_completion", "created",
                          (json_int_t)st->created, "model", st->job->model, "choices",
                          choice ? json_pack("[o]", choice) : json_array());
    if (o && usage) {
        int p = st->job->n_prompt_tokens, g = st->job->n_completion_tokens;
        json_object_set_new(o, "usage", json_pack("{s:i,s:i,s:i}", "prompt_tokens", p,
                                                  "completion_tokens", g, "total_tokens", p + g));
    } else if (o && st->usage_chunk) {
        json_object_set_new(o, "usage", json_null());
    }
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return NULL;
    size_t n = strlen(s);
    char *out = malloc(n + 9);
    if (out) snprintf(out, n + 9, "data: %s\n\n", s);
    free(s);
    return out;
}

static void s_observe_ttft(fi_edge *e, const edge_job *j) {
    if (j->t_first <= 0) return;
    double t = j->t_first - j->t_submit;
    static const double le[8] = {0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10};
    for (int i = 0; i < 8; i++)
        if (t <= le[i]) atomic_fetch_add(&e->m.ttft_bucket[i], 1);
    atomic_fetch_add(&e->m.ttft_count, 1);
    atomic_fetch_add(&e->m.ttft_sum_us, (long)(t * 1e6));
}

static ssize_t s_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    s_stream *st = cls;
    edge_job *j = st->job;
    (void)pos;
    for (;;) {
        if (st->pend_off < st->pend_len) {
            size_t n = st->pend_len - st->pend_off;
            if (n > max) n = max;
            memcpy(buf, st->pend + st->pend_off, n);
            st->pend_off += n;
            return (ssize_t)n;
        }
        free(st->pend);
        st->pend = NULL;
        st->pend_len = st->pend_off = 0;
        if (st->phase == 3) return MHD_CONTENT_READER_END_OF_STREAM;
        if (st->phase == 2) {
            st->pend = strdup("data: [DONE]\n\n");
            if (!st->pend) return MHD_CONTENT_READER_END_WITH_ERROR;
            st->pend_len = strlen(st->pend);
            st->phase = 3;
            continue;
        }
        /* Wait for new text or the end. */
        pthread_mutex_lock(&j->mu);
        while (!j->done && j->out_len == st->sent) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&j->cv, &j->mu, &ts);
            if (edge_now() - j->t_submit > j->timeout_s + 5) break; /* executor lost it */
        }
        size_t n = j->out_len - st->sent;
        char *text = n ? malloc(n) : NULL;
        if (text) memcpy(text, j->out + st->sent, n);
        st->sent += n;
        int done = j->done, status = j->http_status;
        char finish[16], errmsg[256], code[40];
        snprintf(finish, sizeof finish, "%s", j->finish);
        snprintf(errmsg, sizeof errmsg, "%s", j->err);
        snprintf(code, sizeof code, "%s", j->err_code);
        pthread_mutex_unlock(&j->mu);
        if (n && !text) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (text) {
            st->pend = s_chunk(st, text, n, NULL, 0);
            free(text);
            st->phase = 1;
        } else if (done && status) {
            json_t *o = s_err_obj(status, code, NULL, errmsg);
            char *s = json_dumps(o, JSON_COMPACT);
            json_decref(o);
            size_t sl = s ? strlen(s) : 0;
            st->pend = s ? malloc(sl + 9) : NULL;
            if (st->pend) snprintf(st->pend, sl + 9, "data: %s\n\n", s);
            free(s);
            s_count_status(st->e, status);
            st->phase = 2;
        } else if (done) {
            st->pend = s_chunk(st, NULL, 0, finish, 0);
            if (st->pend && st->usage_chunk) {
                char *u = s_chunk(st, NULL, 0, NULL, 1);
                char *both = u ? malloc(strlen(st->pend) + strlen(u) + 1) : NULL;
                if (both) {
                    strcpy(both, st->pend);
                    strcat(both, u);
                }
                free(u);
                free(st->pend);
                st->pend = both;
            }
            atomic_fetch_add(st->routed ? &st->e->m.ok_routed : &st->e->m.ok_local, 1);
            atomic_fetch_add(&st->e->m.tokens, j->n_completion_tokens);
            s_observe_ttft(st->e, j);
            st->phase = 2;
        } else if (edge_now() - j->t_submit > j->timeout_s + 5) {
            atomic_store(&j->cancel, 1);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        } else {
            continue;
        }
        if (!st->pend) return MHD_CONTENT_READER_END_WITH_ERROR;
        st->pend_len = strlen(st->pend);
    }
}

/* A client left: its job's work stops, and the executor's thread is woken
 * to stop it now (the fabric's sends the cluster a Cancel; it looked only
 * every 200 ms). */
static void s_cancel(fi_edge *e, edge_job *j, int routed) {
    atomic_store(&j->cancel, 1);
    edge_exec *ex = routed ? &e->remote : &e->local;
    if (ex->ctx && ex->kick) ex->kick(ex->ctx);
}

static void s_stream_free(void *cls) {
    s_stream *st = cls;
    /* The connection is gone or the answer complete: a client that left
     * cancels its work (locally, or at the cluster through the fabric). */
    pthread_mutex_lock(&st->job->mu);
    int done = st->job->done;
    pthread_mutex_unlock(&st->job->mu);
    if (!done) atomic_fetch_add(&st->e->m.cancelled, 1);
    s_cancel(st->e, st->job, st->routed);
    free(st->pend);
    edge_job_unref(&st->job);
    free(st);
}

/* --------------------------------------------------------------- routes */

/* GET /v1/models (name NULL), or GET /v1/models/<name>: the model served
 * here ("created": when the agent started). */
static enum MHD_Result s_models(fi_edge *e, struct MHD_Connection *c, const char *name) {
    json_t *m = e->model ? json_pack("{s:s,s:s,s:I,s:s}", "id", e->conf.model_name, "object", "model",
                                     "created", (json_int_t)e->started, "owned_by", e->conf.site)
                         : NULL;
    if (name) {
        if (m && !strcmp(name, e->conf.model_name)) return s_json(c, 200, m, NULL);
        json_decref(m);
        return s_error(e, c, 404, "model_not_found", "model", NULL, "model '%.100s' is not served here", name);
    }
    json_t *data = json_array();
    if (m) json_array_append_new(data, m);
    return s_json(c, 200, json_pack("{s:s,s:o}", "object", "list", "data", data), NULL);
}

static enum MHD_Result s_metrics(fi_edge *e, struct MHD_Connection *c) {
    char *b = malloc(8192);
    if (!b) return MHD_NO;
    size_t k = 0, cap = 8192;
#define P(...) k += (size_t)snprintf(b + k, k < cap ? cap - k : 0, __VA_ARGS__)
    P("# HELP fedinfer_edge_requests_total Inference requests received.\n"
      "# TYPE fedinfer_edge_requests_total counter\n"
      "fedinfer_edge_requests_total %ld\n",
      atomic_load(&e->m.requests));
    P("# HELP fedinfer_edge_responses_total Inference requests by outcome.\n"
      "# TYPE fedinfer_edge_responses_total counter\n");
    P("fedinfer_edge_responses_total{outcome=\"local\"} %ld\n", atomic_load(&e->m.ok_local));
    P("fedinfer_edge_responses_total{outcome=\"routed\"} %ld\n", atomic_load(&e->m.ok_routed));
    P("fedinfer_edge_responses_total{outcome=\"denied\"} %ld\n", atomic_load(&e->m.denied));
    P("fedinfer_edge_responses_total{outcome=\"rejected\"} %ld\n", atomic_load(&e->m.rejected));
    P("fedinfer_edge_responses_total{outcome=\"busy\"} %ld\n", atomic_load(&e->m.busy));
    P("fedinfer_edge_responses_total{outcome=\"unavailable\"} %ld\n",
      atomic_load(&e->m.unavailable));
    P("fedinfer_edge_responses_total{outcome=\"failed\"} %ld\n", atomic_load(&e->m.failed));
    P("fedinfer_edge_responses_total{outcome=\"cancelled\"} %ld\n", atomic_load(&e->m.cancelled));
    P("# HELP fedinfer_edge_completion_tokens_total Tokens generated for clients.\n"
      "# TYPE fedinfer_edge_completion_tokens_total counter\n"
      "fedinfer_edge_completion_tokens_total %ld\n",
      atomic_load(&e->m.tokens));
    P("# HELP fedinfer_edge_local_queue_depth Local requests waiting or running.\n"
      "# TYPE fedinfer_edge_local_queue_depth gauge\n"
      "fedinfer_edge_local_queue_depth %d\n",
      e->local.ctx ? e->local.depth(e->local.ctx) : 0);
    if (e->local.ctx && e->local.stats) {
        fi_sched_stats st;
        e->local.stats(e->local.ctx, &st);
        P("# HELP fedinfer_engine_kv_blocks KV-cache blocks of the local engine, by state.\n"
          "# TYPE fedinfer_engine_kv_blocks gauge\n"
          "fedinfer_engine_kv_blocks{state=\"total\"} %d\n"
          "fedinfer_engine_kv_blocks{state=\"free\"} %d\n"
          "fedinfer_engine_kv_blocks{state=\"cached\"} %d\n",
          st.blocks_total, st.blocks_free, st.blocks_cached);
        P("# HELP fedinfer_engine_prompt_tokens_total Prompt tokens admitted by the local engine.\n"
          "# TYPE fedinfer_engine_prompt_tokens_total counter\n"
          "fedinfer_engine_prompt_tokens_total %llu\n"
          "# HELP fedinfer_engine_prefix_hit_tokens_total Prompt tokens taken from the prefix cache.\n"
          "# TYPE fedinfer_engine_prefix_hit_tokens_total counter\n"
          "fedinfer_engine_prefix_hit_tokens_total %llu\n",
          (unsigned long long)st.prompt_tokens, (unsigned long long)st.prefix_hit_tokens);
        P("# HELP fedinfer_engine_steps_total Forward passes of the local engine.\n"
          "# TYPE fedinfer_engine_steps_total counter\n"
          "fedinfer_engine_steps_total %llu\n"
          "# HELP fedinfer_engine_decode_tokens_total Tokens decoded (one per sequence per step).\n"
          "# TYPE fedinfer_engine_decode_tokens_total counter\n"
          "fedinfer_engine_decode_tokens_total %llu\n"
          "# HELP fedinfer_engine_preemptions_total Sequences preempted for KV memory.\n"
          "# TYPE fedinfer_engine_preemptions_total counter\n"
          "fedinfer_engine_preemptions_total %llu\n",
          (unsigned long long)st.steps, (unsigned long long)st.decode_tokens,
          (unsigned long long)st.preemptions);
    }
    {
        int failing = 0;
        uint64_t af = edge_policy_audit_failures(e->policy, &failing);
        P("# HELP fedinfer_edge_audit_failures_total Decisions that could not be recorded (each "
          "answered 503).\n"
          "# TYPE fedinfer_edge_audit_failures_total counter\n"
          "fedinfer_edge_audit_failures_total %llu\n"
          "# HELP fedinfer_edge_audit_up 1 while the last decision was recorded.\n"
          "# TYPE fedinfer_edge_audit_up gauge\n"
          "fedinfer_edge_audit_up %d\n",
          (unsigned long long)af, !failing);
    }
    if (e->local.ctx && e->local.engine) {
        long resets = 0;
        int up = e->local.engine(e->local.ctx, &resets, NULL, 0);
        P("# HELP fedinfer_edge_local_engine_up Whether the local engine runs (not while its "
          "failed backend is not yet replaced).\n"
          "# TYPE fedinfer_edge_local_engine_up gauge\n"
          "fedinfer_edge_local_engine_up %d\n"
          "# HELP fedinfer_edge_local_engine_resets_total Backends replaced after a failure.\n"
          "# TYPE fedinfer_edge_local_engine_resets_total counter\n"
          "fedinfer_edge_local_engine_resets_total %ld\n",
          up, resets);
    }
    P("# HELP fedinfer_edge_coordinator_up 1 when the coordinator is connected.\n"
      "# TYPE fedinfer_edge_coordinator_up gauge\n"
      "fedinfer_edge_coordinator_up %d\n",
      e->remote_online ? atomic_load(e->remote_online) : 0);
    P("# HELP fedinfer_edge_ttft_seconds Time to first token.\n"
      "# TYPE fedinfer_edge_ttft_seconds histogram\n");
    static const char *le[8] = {"0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "10"};
    for (int i = 0; i < 8; i++)
        P("fedinfer_edge_ttft_seconds_bucket{le=\"%s\"} %ld\n", le[i],
          atomic_load(&e->m.ttft_bucket[i]));
    long cnt = atomic_load(&e->m.ttft_count);
    P("fedinfer_edge_ttft_seconds_bucket{le=\"+Inf\"} %ld\n", cnt);
    P("fedinfer_edge_ttft_seconds_sum %.6f\n", atomic_load(&e->m.ttft_sum_us) / 1e6);
    P("fedinfer_edge_ttft_seconds_count %ld\n", cnt);
#undef P
    return s_send(c, 200, "text/plain; version=0.0.4", b, NULL);
}

/* The router: among the permitted targets, the best by policy score, with
 * the local engine only when it serves the model and is up (not down after
 * a backend failure), a cluster
 * only while the coordinator is connected and, when the coordinator
 * reports the clusters' load, only when it has a live worker for the
 * model. A full target (local slots, or the cluster's capacity by its
 * reported load) loses 1000; ties go to the site, then to the less loaded
 * cluster. Returns the index in d, or -1 with *why_unavail set when
 * something was permitted but not reachable. */
static int s_route(fi_edge *e, const edge_decision *d, const char *model, int *unavail,
                   char *why, size_t wlen) {
    int best = -1;
    double best_score = 0;
    int local_ok = e->model && !strcmp(model, e->conf.model_name);
    int online = e->remote_online && atomic_load(e->remote_online);
    *unavail = 0;
    why[0] = 0;
    for (int i = 0; i < d->n; i++) {
        if (!d->t[i].permitted) continue;
        double score = (double)d->t[i].score;
        if (i == 0) {
            if (!local_ok) {
                *unavail = 1;
                snprintf(why, wlen, "model '%s' is not served on this site", model);
                continue;
            }
            char down[640] = "";
            if (e->local.engine && !e->local.engine(e->local.ctx, NULL, down, sizeof down)) {
                *unavail = 1;
                snprintf(why, wlen, "the local engine is down: %s",
                         down[0] ? down : "its backend is being replaced");
                continue;
            }
            int depth = e->local.depth(e->local.ctx);
            if (depth >= e->conf.concurrency) score -= 1000; /* busy: prefer a cluster */
            score += 1; /* ties: stay on site */
        } else if (!online) {
            *unavail = 1;
            snprintf(why + strlen(why), wlen - strlen(why), "%scluster %s is permitted but the coordinator is unreachable",
                     why[0] ? "; " : "", d->t[i].name);
            continue;
        } else {
            edge_cluster_load cl;
            int known = edge_remote_cluster_load(e, d->t[i].name, model, &cl);
            if (known == 0 || (known == 1 && cl.workers == 0)) {
                *unavail = 1;
                snprintf(why + strlen(why), wlen - strlen(why),
                         "%scluster %s is permitted but no live worker there serves '%s'",
                         why[0] ? "; " : "", d->t[i].name, model);
                continue;
            }
            if (known == 1 && cl.capacity > 0) {
                if (cl.busy >= cl.capacity) score -= 1000; /* full: prefer the site */
                score -= 0.5 * (double)cl.busy / cl.capacity; /* ties: the less loaded */
            }
        }
        if (best < 0 || score > best_score) {
            best = i;
            best_score = score;
        }
    }
    return best;
}

/* Fills what a routed request carries: the chat's messages (the worker
 * renders them with its model's template) or the raw prompt, the sampling
 * and stop strings, the user for conversation affinity, and the prefix
 * hashes of the prompt when this edge's model is the one asked for (same
 * tokenizer as the workers serving it), salted with the tenant (qualified
 * with the site) and the residency zone. 0, or -1 when out of memory. */
static int s_routed(fi_edge *e, edge_job *job, const s_req *r, int chat, const char *tenant,
                    const char *app, const int32_t *ids, int n_ids) {
    edge_routed *w = calloc(1, sizeof *w);
    if (!w) return -1;
    job->routed = w;
    job->text = strdup(chat ? "" : r->prompt);
    if (!job->text) return -1;
    w->raw = !chat;
    if (chat) {
        w->roles = calloc((size_t)r->n_msgs, sizeof *w->roles);
        w->contents = calloc((size_t)r->n_msgs, sizeof *w->contents);
        if (!w->roles || !w->contents) return -1;
        for (int i = 0; i < r->n_msgs; i++, w->n_msgs++) {
            w->roles[i] = strdup(r->msgs[i].role);
            w->contents[i] = strdup(r->msgs[i].content);
            if (!w->roles[i] || !w->contents[i]) {
                w->n_msgs++;
                return -1;
            }
        }
    }
    for (int i = 0; i < r->n_stop; i++, w->n_stop++)
        if (!(w->stop[i] = strdup(r->stop[i]))) return -1;
    snprintf(w->user, sizeof w->user, "%s", r->user ? r->user : "");
    snprintf(w->tenant, sizeof w->tenant, "%s", tenant ? tenant : "");
    snprintf(w->application, sizeof w->application, "%s", app ? app : "");
    w->prompt_tokens = n_ids;
    snprintf(w->zone, sizeof w->zone, "%s", job->zone);
    /* the blocks a worker could reuse: all but the last prompt token's
     * (fi_prefix_hashes) */
    if (ids && n_ids > FI_KV_BLOCK && !strcmp(r->model, e->conf.model_name)) {
        int full = (n_ids - 1) / FI_KV_BLOCK;
        int max = full < EDGE_MAX_HASHES ? full : EDGE_MAX_HASHES;
        /* salted as the coordinator has the worker salt: the tenant
         * qualified with this site */
        char salt[FI_WIRE_CACHE_TENANT_MAX];
        if (fi_wire_cache_tenant(e->conf.site, w->tenant, salt) == 0) {
            if (!(w->hashes = malloc((size_t)max * sizeof *w->hashes))) return -1;
            w->n_hashes = fi_prefix_hashes(salt, w->zone, ids, n_ids - 1, w->hashes, max);
        }
    }
    return 0;
}

/* Authentication (with auth = 1): the request's bearer token, whose
 * tenant and application go to tenant and app. 1 when it may go on; 0
 * when a 401 was queued (*rc is its result). */
static int s_authenticated(fi_edge *e, struct MHD_Connection *c, char tenant[64], char app[64],
                           enum MHD_Result *rc) {
    if (!e->tokens) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    static const char *const hdr[] = {"WWW-Authenticate", "Bearer", NULL};
    if (!h || strncasecmp(h, "Bearer ", 7)) {
        *rc = s_error(e, c, 401, "missing_api_key", NULL, hdr,
                      "an Authorization: Bearer token is required");
        return 0;
    }
    /* the token, without the optional whitespace around a header value */
    char tok[260];
    const char *t = h + 7;
    while (*t == ' ' || *t == '\t') t++;
    size_t tl = strlen(t);
    while (tl && (t[tl - 1] == ' ' || t[tl - 1] == '\t')) tl--;
    if (tl >= sizeof tok) tl = sizeof tok - 1; /* too long for any token: refused below */
    memcpy(tok, t, tl);
    tok[tl] = 0;
    int ok = edge_auth_check(e->tokens, tok, tenant, 64, app, 64);
    sodium_memzero(tok, sizeof tok);
    if (!ok) {
        *rc = s_error(e, c, 401, "invalid_api_key", NULL, hdr, "the bearer token is not valid");
        return 0;
    }
    return 1;
}

static enum MHD_Result s_infer(fi_edge *e, struct MHD_Connection *c, s_conn *cn, int chat) {
    const edge_limits lim = edge_limits_now(e); /* this request's */
    atomic_fetch_add(&e->m.requests, 1);
    if (atomic_load(&e->stopping))
        return s_error(e, c, 503, "shutting_down", NULL, NULL, "the agent is stopping");
    /* Authentication: a tenant and application come from the token. */
    char tenant[64] = "", app[64] = "";
    enum MHD_Result arc;
    if (!s_authenticated(e, c, tenant, app, &arc)) return arc;
    if (cn->too_big)
        return s_error(e, c, 413, "body_too_large", NULL, NULL, "the body exceeds %d bytes",
                       lim.max_body);
    if (!cn->len) return s_error(e, c, 400, "invalid_json", NULL, NULL, "the body is empty");
    if (!s_depth_ok(cn->body, cn->len, EDGE_MAX_DEPTH))
        return s_error(e, c, 400, "invalid_json", NULL, NULL, "JSON nested deeper than %d levels",
                       EDGE_MAX_DEPTH);
    json_error_t jerr;
    json_t *root = json_loadb(cn->body, cn->len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return s_error(e, c, 400, "invalid_json", NULL, NULL, "malformed JSON at line %d column %d: %s",
                       jerr.line, jerr.column, jerr.text);
    enum MHD_Result rc;
    edge_job *job = NULL;
    s_req *r = calloc(1, sizeof *r);
    edge_decision *d = calloc(1, sizeof *d);
    char msg[512];
    if (!r || !d) {
        rc = s_error(e, c, 500, "internal_error", NULL, NULL, "out of memory");
        goto done;
    }
    r->chat = chat;
    const char *code, *param;
    int st = s_parse(e, root, r, &code, &param, msg, sizeof msg);
    if (st) {
        rc = s_error(e, c, st, code, param, NULL, "%s", msg);
        goto done;
    }
    /* every X-Data-Class header: repeated, they are one list (a proxy's
     * label beside the application's must not be lost) */
    s_xdc x = {.r = r, .msg = msg, .mlen = sizeof msg};
    MHD_get_connection_values(c, MHD_HEADER_KIND, s_xdc_each, &x);
    if (x.bad) {
        rc = s_error(e, c, 400, "bad_label", "X-Data-Class", NULL, "%s", msg);
        goto done;
    }
    int local_model = e->model && !strcmp(r->model, e->conf.model_name);
    if (!local_model && !e->remote.ctx) {
        rc = s_error(e, c, 404, "model_not_found", "model", NULL,
                     "model '%s' is not served here (this agent serves '%s')", r->model,
                     e->model ? e->conf.model_name : "no model");
        goto done;
    }
    /* The prompt: rendered and counted with the local tokenizer when there
     * is one (its count is what the policy and the limits see). */
    int32_t *ids = NULL;
    int n_ids = -1;
    if (e->model) {
        char terr[256];
        ids = edge_prompt_tokens(fi_model_tok(e->model), chat ? r->msgs : NULL, r->n_msgs,
                                 r->prompt, (size_t)lim.max_body * 2, &n_ids, terr,
                                 sizeof terr);
        if (!ids) {
            rc = s_error(e, c, 500, "internal_error", NULL, NULL, "%s", terr);
            goto done;
        }
        if (n_ids == 0 && !chat) {
            /* an empty prompt, as OpenAI takes it: the text begins after
             * the model's beginning (or end) of text */
            int32_t b = fi_tok_bos(fi_model_tok(e->model));
            ids[0] = b >= 0 ? b : fi_tok_eos(fi_model_tok(e->model));
            n_ids = ids[0] >= 0;
        }
        if (n_ids == 0) {
            free(ids);
            rc = s_error(e, c, 400, "invalid_value", chat ? "messages" : "prompt", NULL,
                         "the prompt is empty");
            goto done;
        }
        /* a limit the client did not set: as much as the context leaves
         * (this agent's context: for its own model only; a cluster's
         * model has the cluster's) */
        if (local_model && !r->max_tokens_given && n_ids + r->max_tokens > e->conf.n_ctx &&
            n_ids < e->conf.n_ctx)
            r->max_tokens = e->conf.n_ctx - n_ids;
        if (local_model && n_ids + r->max_tokens > e->conf.n_ctx) {
            free(ids);
            if (r->max_tokens_given)
                rc = s_error(e, c, 400, "context_length_exceeded", chat ? "messages" : "prompt", NULL,
                             "the prompt has %d tokens; with %s %d it exceeds the context of "
                             "%d tokens",
                             n_ids, r->max_tokens_key, r->max_tokens, e->conf.n_ctx);
            else
                rc = s_error(e, c, 400, "context_length_exceeded", chat ? "messages" : "prompt", NULL,
                             "the prompt has %d tokens, which leaves no room for a completion in the "
                             "context of %d tokens",
                             n_ids, e->conf.n_ctx);
            goto done;
        }
    }
    /* Policy: the permitted targets, then the router's choice. */
    char id[EDGE_ID_LEN];
    snprintf(id, sizeof id, "%s-%.16s-%s%ld", chat ? "chatcmpl" : "cmpl", e->conf.site, e->id_salt,
             atomic_fetch_add(&e->next_id, 1));
    if (edge_policy_decide(e->policy, tenant, app, r->model, r->labels, r->n_labels, n_ids, d) != 0) {
        free(ids);
        rc = s_error(e, c, 500, "internal_error", NULL, NULL, "out of memory for the policy's targets");
        goto done;
    }
    const char *const hdr_pol[] = {"X-Fedinfer-Policy", d->version, "X-Request-Id", id, NULL};
    /* Every decision is recorded before it is answered; one that cannot be
     * is answered 503 instead (nothing is served without its record). */
    char aerr[512];
#define S_AUDIT(decision, target, rules)                                                          \
    do {                                                                                          \
        if (edge_policy_audit(e->policy, id, tenant, app, r->model, d, decision, target, rules,   \
                              n_ids, aerr, sizeof aerr) != 0) {                                   \
            free(ids);                                                                            \
            rc = s_error(e, c, 503, "audit_unavailable", NULL, hdr_pol,                           \
                         "the decision (%s) could not be recorded, so the request is not served: " \
                         "%s",                                                                    \
                         decision, aerr);                                                         \
            goto done;                                                                            \
        }                                                                                         \
    } while (0)
    if (d->bad_labels) {
        S_AUDIT("deny", "", "bad request");
        free(ids);
        rc = s_error(e, c, 400, "bad_label", "X-Data-Class", hdr_pol,
                     "the request's labels are refused by the policy (version %s): %s", d->version,
                     d->t[0].why);
        goto done;
    }
    int unavail = 0;
    char why[512];
    int t = s_route(e, d, r->model, &unavail, why, sizeof why);
    if (t < 0) {
        int any = 0;
        for (int i = 0; i < d->n; i++) any |= d->t[i].permitted;
        if (any) {
            S_AUDIT("unavailable", "", "");
            free(ids);
            char where[256] = "", denied[300] = "";
            for (int i = 0; i < d->n; i++) {
                if (d->t[i].permitted)
                    snprintf(where + strlen(where), sizeof where - strlen(where), "%s%s",
                             where[0] ? ", " : "", d->t[i].name);
                else if (!denied[0])
                    snprintf(denied, sizeof denied, "; elsewhere %.280s", d->t[i].why);
            }
            rc = s_error(e, c, 503, "target_unavailable", NULL, hdr_pol,
                         "policy %s permits this request (labels %.100s) only at %.200s, where it "
                         "cannot run now: %.300s%s",
                         d->version, d->labels, where, why, denied);
            goto done;
        }
        /* Denied everywhere: name the rule that denied on site first. */
        char rules[512] = "";
        for (int i = 0; i < d->n; i++)
            if (d->t[i].rules[0] && !strstr(rules, d->t[i].rules))
                snprintf(rules + strlen(rules), sizeof rules - strlen(rules), "%s%s",
                         rules[0] ? "," : "", d->t[i].rules);
        S_AUDIT(d->fallback ? "fallback" : "deny", "", rules);
        free(ids);
        json_t *o = s_err_obj(403, "policy_denied", NULL, "");
        snprintf(msg, sizeof msg, "denied by policy %.40s (labels %.180s): %.250s", d->version, d->labels,
                 d->t[0].why);
        json_t *eo = json_object_get(o, "error");
        json_object_set_new(eo, "message", json_string(msg));
        json_object_set_new(eo, "rule", json_string(d->t[0].rules[0] ? d->t[0].rules : rules));
        json_object_set_new(eo, "policy_version", json_string(d->version));
        s_count_status(e, 403);
        rc = s_json(c, 403, o, hdr_pol);
        goto done;
    }
    S_AUDIT(d->fallback ? "fallback" : "permit", d->t[t].name, d->t[t].rules);
#undef S_AUDIT
    /* The job. */
    job = edge_job_new(id, r->model, r->stop, r->n_stop);
    if (!job) {
        free(ids);
        rc = s_error(e, c, 500, "internal_error", NULL, NULL, "out of memory");
        goto done;
    }
    job->prompt = ids;
    job->n_prompt = n_ids;
    job->stream = r->stream;
    job->sp = r->sp;
    job->max_tokens = r->max_tokens;
    job->timeout_s = lim.request_timeout_s;
    /* prefix-cache salt: tenants never share cached state */
    snprintf(job->tenant, sizeof job->tenant, "%s", tenant);
    snprintf(job->zone, sizeof job->zone, "%s", d->zone);
    for (int i = 0; i < d->n_eff_labels; i++) job->labels[job->n_labels++] = strdup(d->eff_labels[i]);
    job->labels_defaulted = d->labels_defaulted;
    snprintf(job->target, sizeof job->target, "%s", d->t[t].name);
    if (t > 0 && s_routed(e, job, r, chat, tenant, app, ids, n_ids) != 0) {
        rc = s_error(e, c, 500, "internal_error", NULL, NULL, "out of memory");
        goto done;
    }
    edge_exec *ex = t == 0 ? &e->local : &e->remote;
    int sub = ex->submit(ex->ctx, job);
    if (sub == -2) {
        /* it went down between the routing and now */
        char down[640] = "";
        if (ex->engine) (void)ex->engine(ex->ctx, NULL, down, sizeof down);
        const char *const hdr[] = {"Retry-After", "5", "X-Fedinfer-Policy", d->version,
                                   "X-Fedinfer-Target", d->t[t].name, NULL};
        rc = s_error(e, c, 503, "local_engine_down", NULL, hdr,
                     "the local engine is down: %s",
                     down[0] ? down : "its backend is being replaced");
        goto done;
    }
    if (sub != 0) {
        if (atomic_load(&e->stopping)) {
            /* stopping began while this request was being decided */
            rc = s_error(e, c, 503, "shutting_down", NULL, NULL, "the agent is stopping");
            goto done;
        }
        const char *const hdr[] = {"Retry-After", "1", "X-Fedinfer-Policy", d->version,
                                   "X-Fedinfer-Target", d->t[t].name, NULL};
        rc = s_error(e, c, 429, "rate_limit_exceeded", NULL, hdr,
                     "%s queue is full (%d requests at once); retry later",
                     t == 0 ? "the local" : "the fabric", ex->depth(ex->ctx));
        goto done;
    }
    /* Wait for the first text (or the end), so that an early failure gets
     * its own status rather than a stream that ends in an error. */
    pthread_mutex_lock(&job->mu);
    int gone = 0;
    while (!job->done && (!r->stream || job->out_len == 0)) {
        /* a tenth of a second: the client's leaving is seen soon */
        struct timespec ts = edge_deadline_ms(100);
        pthread_cond_timedwait(&job->cv, &job->mu, &ts);
        if (edge_now() - job->t_submit > job->timeout_s + 5) break;
        if (!job->done && s_peer_gone(c)) {
            gone = 1;
            break;
        }
    }
    int done = job->done;
    pthread_mutex_unlock(&job->mu);
    if (gone) {
        /* the client left before its answer: its work stops, its slot frees */
        s_cancel(e, job, t > 0);
        atomic_fetch_add(&e->m.cancelled, 1);
        rc = MHD_NO;
        goto done;
    }
    const char *const hdrs[] = {"X-Fedinfer-Target", d->t[t].name, "X-Fedinfer-Policy", d->version,
                                "X-Request-Id", id, "X-Fedinfer-Rules", d->t[t].rules,
                                "X-Fedinfer-Labels", d->labels, "X-Fedinfer-Zone", d->zone, NULL};
    if (!done && !r->stream) {
        atomic_store(&job->cancel, 1);
        rc = s_error(e, c, 504, "timeout", NULL, hdrs, "the request ran past its time limit");
        goto done;
    }
    if (done && job->http_status) {
        rc = s_error(e, c, job->http_status, job->err_code, NULL, hdrs, "%s", job->err);
        goto done;
    }
    long created = (long)time(NULL);
    if (r->stream) {
        s_stream *sst = calloc(1, sizeof *sst);
        if (!sst) {
            rc = MHD_NO;
            goto done;
        }
        sst->e = e;
        sst->job = job;
        job = NULL;
        sst->chat = chat;
        sst->created = created;
        sst->routed = t > 0;
        sst->usage_chunk = r->usage_chunk;
        struct MHD_Response *resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, s_reader, sst, s_stream_free);
        if (!resp) {
            s_stream_free(sst);
            rc = MHD_NO;
            goto done;
        }
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        MHD_add_response_header(resp, "Connection", "close"); /* see s_send */
        for (int i = 0; hdrs[i]; i += 2) MHD_add_response_header(resp, hdrs[i], hdrs[i + 1]);
        rc = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        goto done;
    }
    /* Not streamed: the whole answer. */
    int p = job->n_prompt_tokens, g = job->n_completion_tokens;
    json_t *choice =
        chat ? json_pack("{s:i,s:{s:s,s:s%},s:s}", "index", 0, "message", "role", "assistant",
                         "content", job->out, job->out_len, "finish_reason", job->finish)
             : json_pack("{s:i,s:s%,s:n,s:s}", "index", 0, "text", job->out, job->out_len,
                         "logprobs", "finish_reason", job->finish);
    json_t *o = json_pack("{s:s,s:s,s:i,s:s,s:[o],s:{s:i,s:i,s:i}}", "id", id, "object",
                          chat ? "chat.completion" : "text_completion", "created",
                          (json_int_t)created, "model", r->model, "choices", choice, "usage",
                          "prompt_tokens", p, "completion_tokens", g, "total_tokens", p + g);
    if (!o) {
        rc = s_error(e, c, 500, "internal_error", NULL, NULL, "cannot format the answer");
        goto done;
    }
    atomic_fetch_add(t > 0 ? &e->m.ok_routed : &e->m.ok_local, 1);
    atomic_fetch_add(&e->m.tokens, g);
    s_observe_ttft(e, job);
    rc = s_json(c, 200, o, hdrs);
done:
    if (job) edge_job_unref(&job);
    s_req_free(r);
    if (d) edge_decision_clear(d);
    free(d);
    json_decref(root);
    return rc;
}

static enum MHD_Result s_handler(void *cls, struct MHD_Connection *c, const char *url,
                                 const char *method, const char *version, const char *upload,
                                 size_t *upload_size, void **con_cls) {
    fi_edge *e = cls;
    (void)version;
    s_conn *cn = *con_cls;
    int post = !strcmp(method, "POST");
    const edge_limits lim = edge_limits_now(e);
    if (!cn) {
        cn = calloc(1, sizeof *cn);
        if (!cn) return MHD_NO;
        *con_cls = cn;
        atomic_fetch_add(&e->requests_open, 1); /* until s_completed */
        if (post) {
            /* Refuse a declared size over the limit before reading it. */
            const char *cl =
                MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
            if (cl) {
                char *end;
                unsigned long long n = strtoull(cl, &end, 10);
                if (n > (unsigned long long)lim.max_body)
                    return s_error(e, c, 413, "body_too_large", NULL, NULL,
                                   "the body of %s bytes exceeds %d bytes", cl, lim.max_body);
            }
        }
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (cn->too_big) {
            /* Discarding an oversized body: answered at its end, but a body
             * that goes on past four times the limit is cut off. */
            cn->discarded += n;
            return cn->discarded > 4 * (size_t)lim.max_body ? MHD_NO : MHD_YES;
        }
        if (cn->len + n > (size_t)lim.max_body) {
            cn->too_big = 1;
            cn->discarded = cn->len + n;
            free(cn->body);
            cn->body = NULL;
            cn->len = cn->cap = 0;
            return MHD_YES;
        }
        if (cn->len + n > cn->cap) {
            size_t cap = cn->cap ? cn->cap : 4096;
            while (cap < cn->len + n) cap *= 2;
            char *b = realloc(cn->body, cap);
            if (!b) return MHD_NO;
            cn->body = b;
            cn->cap = cap;
        }
        memcpy(cn->body + cn->len, upload, n);
        cn->len += n;
        return MHD_YES;
    }
    if (cn->too_big)
        return s_error(e, c, 413, "body_too_large", NULL, NULL, "the body exceeds %d bytes",
                       lim.max_body);
    if (post && !strcmp(url, "/v1/chat/completions")) return s_infer(e, c, cn, 1);
    if (post && !strcmp(url, "/v1/completions")) return s_infer(e, c, cn, 0);
    int get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (get && (!strcmp(url, "/v1/models") || (!strncmp(url, "/v1/models/", 11) && url[11]))) {
        /* the API's own endpoints answer token holders only (the probes,
         * /metrics and /healthz, stay open) */
        char tenant[64], app[64];
        enum MHD_Result arc;
        if (!s_authenticated(e, c, tenant, app, &arc)) return arc;
        return s_models(e, c, url[10] == '/' ? url + 11 : NULL);
    }
    if (get && !strcmp(url, "/metrics")) return s_metrics(e, c);
    if (get && !strcmp(url, "/healthz")) {
        /* degraded while decisions cannot be recorded (each request then
         * gets a 503), until an append succeeds again */
        int failing = 0;
        (void)edge_policy_audit_failures(e->policy, &failing);
        const int stopping = atomic_load(&e->stopping);
        /* and while the local engine's backend failed and is not replaced:
         * 503 then only when nothing else can serve (no coordinator), since
         * requests a cluster may take are still routed */
        char why[640] = "";
        int engine_up = !e->local.ctx || !e->local.engine ||
                        e->local.engine(e->local.ctx, NULL, why, sizeof why);
        int online = e->remote_online && atomic_load(e->remote_online);
        int bad = failing || !engine_up;
        json_t *o = json_pack("{s:s,s:s,s:b,s:b,s:b,s:b}", "status",
                              stopping ? "stopping" : bad ? "degraded" : "ok", "site",
                              e->conf.site, "local_model", e->model != NULL, "coordinator",
                              online, "audit_log", !failing, "local_engine", engine_up);
        if (o && !engine_up) json_object_set_new(o, "local_engine_error", json_string(why));
        return s_json(c, stopping || failing || (!engine_up && !online) ? 503 : 200, o, NULL);
    }
    int post_only = !strcmp(url, "/v1/chat/completions") || !strcmp(url, "/v1/completions");
    int known = post_only || !strcmp(url, "/v1/models") || (!strncmp(url, "/v1/models/", 11) && url[11]) ||
                !strcmp(url, "/metrics") || !strcmp(url, "/healthz");
    if (known) {
        static const char *const allow_post[] = {"Allow", "POST", NULL};
        static const char *const allow_get[] = {"Allow", "GET, HEAD", NULL};
        const char *const *allow = post_only ? allow_post : allow_get;
        return s_error(NULL, c, 405, "method_not_allowed", NULL, allow, "%s is not allowed on %s",
                       method, url);
    }
    return s_error(NULL, c, 404, "not_found", NULL, NULL, "no such endpoint: %s %s", method, url);
}

static void s_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                        enum MHD_RequestTerminationCode toe) {
    fi_edge *e = cls;
    (void)c, (void)toe;
    s_conn *cn = *con_cls;
    if (!cn) return;
    atomic_fetch_sub(&e->requests_open, 1);
    free(cn->body);
    free(cn);
    *con_cls = NULL;
}

static void s_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n') line[--n] = 0;
    fprintf(stderr, "edge: http: %s\n", line);
}

int edge_http_start(fi_edge *e, char *err, size_t errlen) {
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)e->conf.port);
    if (inet_pton(AF_INET, e->conf.listen, &sa.sin_addr) != 1) {
        snprintf(err, errlen, "listen: '%s' is not an IPv4 address", e->conf.listen);
        return -1;
    }
    /* Our own listener accepts and hands connections over (edge_front.c). */
    e->httpd = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG |
            MHD_USE_POLL | MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC,
        0, NULL, NULL, s_handler, e, MHD_OPTION_EXTERNAL_LOGGER, s_mhd_log, e,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)e->conf.conn_limit,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)e->conf.per_ip_limit,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)e->conf.conn_timeout_s,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)e->conf.conn_memory,
        MHD_OPTION_NOTIFY_COMPLETED, s_completed, e, MHD_OPTION_END);
    if (!e->httpd) {
        snprintf(err, errlen, "cannot start the HTTP server");
        return -1;
    }
    if (!(e->front = edge_front_start(e, &sa, &e->port, err, errlen))) {
        MHD_stop_daemon(e->httpd);
        e->httpd = NULL;
        return -1;
    }
    return 0;
}

void edge_http_stop(fi_edge *e) {
    edge_front_stop(&e->front);
    if (!e->httpd) return;
    /* The drains just ended every job (503 for those cut off): let their
     * handlers send those answers before the connections go, for up to a
     * second (stopping the daemon at once closed some with nothing sent). */
    for (int i = 0; i < 100 && atomic_load(&e->requests_open) > 0; i++) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    MHD_stop_daemon(e->httpd);
    e->httpd = NULL;
}
