/*
 * fi_wire.c - decoding and encoding of fabric messages. See fi_wire.h.
 *
 * protobuf-c's unpacker checks the structure (lengths, wire types, nested
 * sizes) and never reads past the buffer; what it leaves to us is the size
 * limit, fields the schema does not define, the version and the body
 * type.
 */
#include "fi_wire.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* 0 when m and every message inside it hold only fields the schema
 * defines. protobuf-c keeps unknown fields (even the invalid field number
 * 0) and would send them on; we speak one version of the schema exactly,
 * so anything else is malformed. depth bounds the walk. */
static int s_strict(const ProtobufCMessage *m, int depth) {
    if (!m) return 0;
    if (depth > 16 || m->n_unknown_fields) return -1;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    const char *base = (const char *)m;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE) continue;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            ProtobufCMessage *const *arr = *(ProtobufCMessage *const *const *)(base + f->offset);
            for (size_t k = 0; k < n; k++)
                if (s_strict(arr[k], depth + 1)) return -1;
            continue;
        }
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        if (s_strict(*(ProtobufCMessage *const *)(base + f->offset), depth + 1)) return -1;
    }
    return 0;
}

/* protobuf-c's allocator for one decode: malloc and free, as the default
 * one (fi_wire_free frees with it), within a budget. */
typedef struct s_budget {
    size_t left;  /* bytes that may still be allocated */
    int over;     /* an allocation was refused */
} s_budget;

static void *s_budget_alloc(void *data, size_t size) {
    s_budget *b = data;
    if (size > b->left) {
        b->over = 1;
        return NULL;
    }
    b->left -= size;
    return malloc(size);
}

static void s_budget_free(void *data, void *p) {
    (void)data;
    free(p);
}

fi_msg *fi_wire_decode(const void *buf, size_t len, size_t max, Fi__ErrorCode *code, char *err,
                       size_t errlen) {
    if (max == 0 || max > FI_WIRE_MAX_MSG) max = FI_WIRE_MAX_MSG;
    if (len > max) {
        *code = FI__ERROR_CODE__ERR_TOO_LARGE;
        snprintf(err, errlen, "message of %zu bytes is over the limit of %zu", len, max);
        return NULL;
    }
    s_budget b = {FI_WIRE_EXPAND * len + FI_WIRE_EXPAND_SLACK, 0};
    ProtobufCAllocator a = {s_budget_alloc, s_budget_free, &b};
    fi_msg *m = fi__envelope__unpack(&a, len, buf);
    if (!m) {
        *code = FI__ERROR_CODE__ERR_MALFORMED;
        if (b.over)
            snprintf(err, errlen, "message of %zu bytes would take more than %zu bytes decoded", len,
                     (size_t)(FI_WIRE_EXPAND * len + FI_WIRE_EXPAND_SLACK));
        else
            snprintf(err, errlen, "message of %zu bytes is not a valid envelope", len);
        return NULL;
    }
    if (m->version != FI_WIRE_VERSION) {
        *code = FI__ERROR_CODE__ERR_BAD_VERSION;
        snprintf(err, errlen, "protocol version %u is not supported (this build speaks %u)",
                 m->version, FI_WIRE_VERSION);
        fi__envelope__free_unpacked(m, NULL);
        return NULL;
    }
    if (!strcmp(fi_wire_type_name(m->body_case), "unknown") ||
        m->body_case == FI__ENVELOPE__BODY__NOT_SET) {
        *code = FI__ERROR_CODE__ERR_UNKNOWN_TYPE;
        snprintf(err, errlen, "message has %s body type",
                 m->body_case == FI__ENVELOPE__BODY__NOT_SET ? "no known" : "an unknown");
        fi__envelope__free_unpacked(m, NULL);
        return NULL;
    }
    if (s_strict(&m->base, 0) != 0) {
        *code = FI__ERROR_CODE__ERR_MALFORMED;
        snprintf(err, errlen, "message holds fields protocol version %u does not define",
                 FI_WIRE_VERSION);
        fi__envelope__free_unpacked(m, NULL);
        return NULL;
    }
    return m;
}

/* The token m carries, or NULL. An absent string is protobuf-c's shared
 * empty string: strlen 0, never written. */
static char *s_secret(const fi_msg *m) {
    if (m->body_case == FI__ENVELOPE__BODY_ENROL && m->enrol) return m->enrol->token;
    if (m->body_case == FI__ENVELOPE__BODY_TOKEN_REPLY && m->token_reply) return m->token_reply->token;
    return NULL;
}

int fi_wire_has_secret(const fi_msg *m) {
    const char *s = m ? s_secret(m) : NULL;
    return s && s[0];
}

void fi_wire_wipe_secret(fi_msg *m) {
    char *s = m ? s_secret(m) : NULL;
    if (s && s[0]) sodium_memzero(s, strlen(s));
}

void fi_wire_free(fi_msg **m) {
    if (!m || !*m) return;
    fi_wire_wipe_secret(*m);
    fi__envelope__free_unpacked(*m, NULL);
    *m = NULL;
}

uint8_t *fi_wire_encode(const fi_msg *m, size_t *len) {
    fi_msg copy = *m;
    copy.version = FI_WIRE_VERSION;
    size_t n = fi__envelope__get_packed_size(&copy);
    if (n > FI_WIRE_MAX_MSG) return NULL;
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return NULL;
    *len = fi__envelope__pack(&copy, buf);
    return buf;
}

const char *fi_wire_type_name(fi_msg_type t) {
    switch (t) {
    case FI__ENVELOPE__BODY__NOT_SET: return "none";
    case FI__ENVELOPE__BODY_HELLO: return "hello";
    case FI__ENVELOPE__BODY_HEARTBEAT: return "heartbeat";
    case FI__ENVELOPE__BODY_INFER: return "infer";
    case FI__ENVELOPE__BODY_CHUNK: return "chunk";
    case FI__ENVELOPE__BODY_FINAL: return "final";
    case FI__ENVELOPE__BODY_ERROR: return "error";
    case FI__ENVELOPE__BODY_POLICY_BUNDLE: return "policy_bundle";
    case FI__ENVELOPE__BODY_AUDIT_UPLOAD: return "audit_upload";
    case FI__ENVELOPE__BODY_ACK: return "ack";
    case FI__ENVELOPE__BODY_ENROL: return "enrol";
    case FI__ENVELOPE__BODY_ENROL_REPLY: return "enrol_reply";
    case FI__ENVELOPE__BODY_STATUS_REQUEST: return "status_request";
    case FI__ENVELOPE__BODY_STATUS_REPLY: return "status_reply";
    case FI__ENVELOPE__BODY_TOKEN_REQUEST: return "token_request";
    case FI__ENVELOPE__BODY_TOKEN_REPLY: return "token_reply";
    case FI__ENVELOPE__BODY_REVOKE_REQUEST: return "revoke_request";
    case FI__ENVELOPE__BODY_CANCEL: return "cancel";
    case FI__ENVELOPE__BODY_POLICY_APPLY: return "policy_apply";
    case FI__ENVELOPE__BODY_POLICY_REPLY: return "policy_reply";
    case FI__ENVELOPE__BODY_POLICY_HISTORY_REQUEST: return "policy_history_request";
    case FI__ENVELOPE__BODY_POLICY_HISTORY_REPLY: return "policy_history_reply";
    case FI__ENVELOPE__BODY_POLICY_ROLLBACK: return "policy_rollback";
    case FI__ENVELOPE__BODY_POLICY_GET: return "policy_get";
    case FI__ENVELOPE__BODY_POLICY_CONTENT: return "policy_content";
    case FI__ENVELOPE__BODY_AUDIT_QUERY: return "audit_query";
    case FI__ENVELOPE__BODY_AUDIT_RECORDS: return "audit_records";
    case FI__ENVELOPE__BODY_AUDIT_VERIFY_REQUEST: return "audit_verify_request";
    case FI__ENVELOPE__BODY_AUDIT_VERIFY_REPLY: return "audit_verify_reply";
    case FI__ENVELOPE__BODY_APP_TOKEN_REQUEST: return "app_token_request";
    case FI__ENVELOPE__BODY_APP_TOKEN_REPLY: return "app_token_reply";
    case FI__ENVELOPE__BODY_APP_TOKEN_SYNC: return "app_token_sync";
    default: return "unknown";
    }
}

const char *fi_wire_error_name(Fi__ErrorCode c) {
    switch (c) {
    case FI__ERROR_CODE__ERR_MALFORMED: return "malformed";
    case FI__ERROR_CODE__ERR_TOO_LARGE: return "too_large";
    case FI__ERROR_CODE__ERR_UNKNOWN_TYPE: return "unknown_type";
    case FI__ERROR_CODE__ERR_BAD_VERSION: return "bad_version";
    case FI__ERROR_CODE__ERR_UNAUTHORISED: return "unauthorised";
    case FI__ERROR_CODE__ERR_NO_WORKER: return "no_worker";
    case FI__ERROR_CODE__ERR_PEER_DEAD: return "peer_dead";
    case FI__ERROR_CODE__ERR_BUSY: return "busy";
    case FI__ERROR_CODE__ERR_BAD_TOKEN: return "bad_token";
    case FI__ERROR_CODE__ERR_INTERNAL: return "internal";
    case FI__ERROR_CODE__ERR_NOT_FOUND: return "not_found";
    case FI__ERROR_CODE__ERR_REVOKED: return "revoked";
    case FI__ERROR_CODE__ERR_BAD_REQUEST: return "bad_request";
    case FI__ERROR_CODE__ERR_NOT_REGISTERED: return "not_registered";
    case FI__ERROR_CODE__ERR_ENGINE: return "engine";
    case FI__ERROR_CODE__ERR_CANCELLED: return "cancelled";
    default: return "unspecified";
    }
}

const char *fi_wire_role_name(Fi__Role r) {
    switch (r) {
    case FI__ROLE__ROLE_EDGE: return "edge";
    case FI__ROLE__ROLE_CLUSTER: return "cluster";
    case FI__ROLE__ROLE_OPERATOR: return "operator";
    case FI__ROLE__ROLE_COORDINATOR: return "coordinator";
    default: return "unspecified";
    }
}

Fi__Role fi_wire_role_parse(const char *s) {
    if (!s) return FI__ROLE__ROLE_UNSPECIFIED;
    if (!strcmp(s, "edge")) return FI__ROLE__ROLE_EDGE;
    if (!strcmp(s, "cluster")) return FI__ROLE__ROLE_CLUSTER;
    if (!strcmp(s, "operator")) return FI__ROLE__ROLE_OPERATOR;
    return FI__ROLE__ROLE_UNSPECIFIED;
}

uint8_t *fi_wire_error(const char *request_id, Fi__ErrorCode code, const char *message, size_t *len) {
    Fi__Error e = FI__ERROR__INIT;
    e.request_id = (char *)(request_id ? request_id : "");
    e.code = code;
    e.message = (char *)(message ? message : "");
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_ERROR;
    m.error = &e;
    return fi_wire_encode(&m, len);
}

uint8_t *fi_wire_heartbeat(uint64_t sent_ms, size_t *len) {
    Fi__Heartbeat h = FI__HEARTBEAT__INIT;
    h.sent_ms = sent_ms;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_HEARTBEAT;
    m.heartbeat = &h;
    return fi_wire_encode(&m, len);
}

uint8_t *fi_wire_ack(const char *ref, size_t *len) {
    Fi__Ack a = FI__ACK__INIT;
    a.ref = (char *)(ref ? ref : "");
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_ACK;
    m.ack = &a;
    return fi_wire_encode(&m, len);
}

uint8_t *fi_wire_chunk(const char *request_id, uint32_t index, const char *text, size_t n,
                       size_t *len) {
    char *t = malloc(n + 1); /* protobuf-c strings end in NUL */
    if (!t) return NULL;
    memcpy(t, text, n);
    t[n] = 0;
    Fi__TokenChunk ch = FI__TOKEN_CHUNK__INIT;
    ch.request_id = (char *)(request_id ? request_id : "");
    ch.index = index;
    ch.text = t;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_CHUNK;
    m.chunk = &ch;
    uint8_t *buf = fi_wire_encode(&m, len);
    free(t);
    return buf;
}

int fi_wire_cache_tenant(const char *site, const char *tenant, char out[FI_WIRE_CACHE_TENANT_MAX]) {
    size_t ns = site ? strlen(site) : 0, nt = tenant ? strlen(tenant) : 0;
    out[0] = '\0';
    if (ns > FI_WIRE_MAX_NAME || nt > FI_WIRE_MAX_NAME) return -1;
    snprintf(out, FI_WIRE_CACHE_TENANT_MAX, "%zu:%s/%s", ns, ns ? site : "", nt ? tenant : "");
    return 0;
}

uint64_t fi_wire_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}
