/*
 * fi_audit.h - the decision audit log: SQLite, append-only, hash-chained.
 *
 * Every decision is one record: request id, time, tenant, application,
 * origin, labels, model, latency objective, prompt size, the decision, the
 * chosen target, the deciding rule ids and the digest of the policy that
 * decided. Record n stores hash_n = SHA-256(hash_{n-1} || encoding of
 * record n), with hash_0 = 32 zero bytes and the encoding of each field as
 * a 4-byte little-endian length and its bytes, numbers in decimal.
 *
 * Triggers refuse UPDATE and DELETE. Someone who bypasses them (editing the
 * file) is caught by fi_audit_verify: an edited record no longer hashes to
 * its stored hash, a removed one leaves a gap in the sequence numbers and a
 * broken link, reordered records break the links. Cutting records off the
 * end leaves a shorter valid chain: compare the head hash and count that
 * verify reports with a copy kept elsewhere (the coordinator keeps the
 * edges' heads when they upload).
 */
#ifndef FI_AUDIT_H
#define FI_AUDIT_H

#include "fi_policy.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_audit fi_audit;

/* One record. Strings are borrowed on append, and owned by the log for the
 * duration of a query callback. Absent strings are "" (never NULL on read). */
typedef struct fi_audit_record {
    int64_t seq;               /* 1, 2, ...: set by append */
    int64_t time;              /* Unix milliseconds */
    const char *request_id;
    const char *tenant;
    const char *application;
    const char *origin;        /* origin site */
    const char *labels;        /* comma-separated */
    const char *model;
    int64_t latency_ms;        /* -1: absent */
    int64_t prompt_tokens;     /* -1: absent */
    const char *decision;      /* "permit", "deny" or "fallback" */
    const char *target;        /* chosen target; "" when denied everywhere */
    const char *rules;         /* deciding rule ids, comma-separated */
    const char *policy_digest; /* hex SHA-256 of the deciding policy; "" for fallback */
    char hash[65];             /* this record's chain hash, hex (set by append, read back) */
} fi_audit_record;

/* Opens (creating if needed) the log at path. NULL with a message in err. */
fi_audit *fi_audit_open(const char *path, char *err, size_t cap) FI_WUR;
void fi_audit_destroy(fi_audit **self_p);

/* Appends rec, chaining it to the last record, in one transaction. Sets
 * rec->seq and rec->hash. 0 or -1 (message in err). */
int fi_audit_append(fi_audit *self, fi_audit_record *rec, char *err, size_t cap) FI_WUR;

/* Appends the record of a decision made by fi_policy_decide (pol) or by
 * fi_policy_fallback (pol NULL; names then gives the targets' names):
 * decision "permit" with the best target and its permit and prefer rules,
 * or "deny" with the forbid rules that decided (or "default deny"). */
int fi_audit_log_decision(fi_audit *self, const fi_policy *pol, const fi_request *req, const fi_verdict *v,
                          size_t n, const char *const *names, int64_t time_ms, char *err, size_t cap) FI_WUR;

/* Filters for fi_audit_query; zero / NULL fields do not filter. */
typedef struct fi_audit_filter {
    int64_t since_ms;          /* time >= since_ms */
    int64_t until_ms;          /* time < until_ms (0: no bound) */
    const char *origin;
    const char *label;         /* record carries this label */
    const char *target;
    const char *decision;
    const char *request_id;
    const char *rule;          /* record names this rule id */
    size_t limit;              /* at most this many, the newest (0: all) */
} fi_audit_filter;

/* Calls fn for each matching record in sequence order; stops when fn
 * returns nonzero. 0 or -1. */
int fi_audit_query(fi_audit *self, const fi_audit_filter *f, int (*fn)(const fi_audit_record *r, void *arg),
                   void *arg, char *err, size_t cap) FI_WUR;

typedef struct fi_audit_check {
    int64_t records;  /* records read */
    int64_t bad_seq;  /* first record found wrong (0: none) */
    char head[65];    /* hash of the last record ("" when empty) */
    char what[256];   /* what is wrong, when broken */
} fi_audit_check;

/* Walks the whole chain. Returns 0 when intact, 1 when broken (out->what
 * says where and how: removed, edited or reordered), -1 on a database error. */
int fi_audit_verify(fi_audit *self, fi_audit_check *out, char *err, size_t cap) FI_WUR;

#ifdef __cplusplus
}
#endif
#endif /* FI_AUDIT_H */
