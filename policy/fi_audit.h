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
 * Provenance. A record taken from another log (fi_audit_ingest: an edge's
 * upload at the coordinator, or the coordinator's own routing records,
 * source "coordinator:router") also carries its source (the uploader's key
 * fingerprint), its sequence number and chain hash in the source's own log
 * (source_seq, source_hash) and when this log took it (received, Unix ms;
 * its time is the source's clock). Such a record, and only such a record
 * (source not ""), has these four fields appended to its encoding, in the
 * same form (source, source_seq, source_hash, received), after
 * policy_digest. A record without a source (an edge's own decision, every
 * record of a log written before provenance existed) is encoded exactly as
 * before, so those logs and every source's own hashes verify unchanged.
 * The source_hash of a record is what the source computed:
 * fi_audit_chain_hash of the record with its provenance cleared, linked to
 * the source's previous record.
 *
 * Triggers refuse UPDATE and DELETE. Someone who bypasses them (editing the
 * file) is caught by fi_audit_verify: an edited record no longer hashes to
 * its stored hash, a removed one leaves a gap in the sequence numbers and a
 * broken link, reordered records break the links; stripping or editing a
 * record's provenance breaks its hash too. Verify also follows each
 * source's own chain through the log (consecutive source_seq, each
 * source_hash the source's chain hash of the record) and checks the head
 * held per source (audit_sources) against the source's last record, so
 * records cut from the end of one source's run while other records follow
 * them, or an edited head, are reported. Cutting records off the end of
 * the whole log, together with a matching edit of audit_sources, leaves a
 * shorter valid log: compare the head hash and count that verify reports
 * with a checkpoint kept elsewhere (fi_audit_point).
 *
 * A log made before provenance existed gets the four columns when
 * fi_audit_open opens it (its records keep "" / 0), and the heads it held
 * then are copied to audit_sources_legacy: each source's run goes on from
 * there. fi_audit_open_readonly reads such a log unchanged (the columns
 * read as "" / 0).
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
    /* Provenance (see the top): "" / 0 for the log's own records; set by
     * fi_audit_ingest, never taken from the records it is given. */
    const char *source;        /* the log it came from (uploader's key fingerprint) */
    int64_t source_seq;        /* its sequence number in that log */
    char source_hash[65];      /* its chain hash in that log, hex */
    int64_t received;          /* when this log took it, Unix milliseconds */
} fi_audit_record;

/* Makes s valid UTF-8 in place: every byte that does not belong to a
 * well-formed sequence (bytes a client or a file supplied, a text cut
 * inside a character) becomes '?'. Every text field of an appended record
 * goes through it (records travel as JSON); the edge cleans the text of its
 * JSON errors with it too. */
void fi_text_clean(char *s);

/* Opens (creating if needed) the log at path. NULL with a message in err;
 * a damaged file among the refusals (fi_db_check: the whole file is
 * checked first). */
fi_audit *fi_audit_open(const char *path, char *err, size_t cap) FI_WUR;
/* Opens the existing log at path for reading only (verify, query): never
 * creates or changes the file. A missing file, one without an audit
 * table, or a damaged one (fi_db_check) is refused naming it. Appends on
 * it fail. NULL with a message. */
fi_audit *fi_audit_open_readonly(const char *path, char *err, size_t cap) FI_WUR;
void fi_audit_destroy(fi_audit **self_p);
/* Makes a query or verify that another thread runs on self stop soon
 * (it fails with SQLite's "interrupted"); for a shutdown that must not
 * wait for a verify of a large log. Safe from any thread. */
void fi_audit_interrupt(fi_audit *self);
/* How long a write waits for another connection's lock before it fails
 * (5000 ms from fi_audit_open); for a writer that retries on its own. */
void fi_audit_busy_timeout(fi_audit *self, int ms);
/* Who may continue whose log (fi_audit_ingest): may_adopt(user, old
 * source, uploader's origin) returns 1 when an uploader of that origin may
 * take the old source over (the coordinator: the old source is a revoked
 * key of an edge of the same site). Without it, nothing is taken over. */
void fi_audit_set_adopt_check(fi_audit *self,
                              int (*may_adopt)(void *user, const char *old_source, const char *origin),
                              void *user);

/* Appends rec, chaining it to the last record, in one transaction. Sets
 * rec->seq and rec->hash. 0 or -1 (message in err). */
int fi_audit_append(fi_audit *self, fi_audit_record *rec, char *err, size_t cap) FI_WUR;

/* Appends the record of a decision made by fi_policy_decide (pol, names
 * NULL: v[].target is the policy's target index), by fi_policy_decide_names
 * (pol and the same names: v[].target indexes names) or by
 * fi_policy_fallback (pol NULL; names gives the targets' names):
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
    int64_t after_seq;         /* seq > after_seq (paging; 0: from the start) */
} fi_audit_filter;

/* Calls fn for each matching record in sequence order; stops when fn
 * returns nonzero. 0 or -1. */
int fi_audit_query(fi_audit *self, const fi_audit_filter *f, int (*fn)(const fi_audit_record *r, void *arg),
                   void *arg, char *err, size_t cap) FI_WUR;

/* Copies records from another hash-chained log (an edge's upload) into
 * this one. source names that log (the uploader's key fingerprint); this
 * log keeps, per source, the sequence number and hash of the last record
 * taken (the source's head), in the same transaction as the records.
 *
 * recs are the source's records in its own numbering (seq, hash as the
 * source computed them), consecutive. The batch is refused, with nothing
 * taken, when: the records are not consecutive; a record does not hash to
 * its hash under the chain rule of this file (each linked to the one
 * before; the first to the held head when it follows it, to genesis when
 * it is record 1); the records leave a gap after the held head; a record
 * the log already holds comes with a different hash than the held head
 * (the source's log was rewritten); or, when origin is given, a record's
 * origin is another site. Records up to the held head are skipped, so a
 * batch sent twice is taken once. Taken records are appended with this
 * log's own seq and hash, and with their provenance: source, their seq and
 * hash in the source's log, and the time now as received. The records'
 * own provenance fields are ignored (cleared before their hashes are
 * checked). *taken gets how many were new.
 * A source with nothing held whose batch does not start at record 1 may go
 * on from another source's log (an edge whose key was replaced keeps its
 * local log): when origin is given and exactly one held source that the
 * adopt check (fi_audit_set_adopt_check) allows ends at the record before
 * the batch, with the batch's first record chained to its head, or at a
 * record of the batch with the same hash (the old key's last batch was
 * taken but its acknowledgement lost, and it comes again), source takes
 * that head over (and err, on success, names the source it continues;
 * else err is "").
 * 0, 1 refused (err says why), -1 database error. */
int fi_audit_ingest(fi_audit *self, const char *source, const char *origin, const fi_audit_record *recs, size_t n,
                    size_t *taken, char *err, size_t cap) FI_WUR;

/* The head held for a source: *seq 0 and head "" when none. 0 or -1. */
int fi_audit_source_head(fi_audit *self, const char *source, int64_t *seq, char head[65], char *err,
                         size_t cap) FI_WUR;

/* The chain hash of rec linked to prev_hex ("" for the first record),
 * hex into out[65]; for a source that builds its batch itself. */
void fi_audit_chain_hash(const char *prev_hex, const fi_audit_record *rec, char out[65]);

typedef struct fi_audit_check {
    int64_t records;   /* records read */
    int64_t bad_seq;   /* first record found wrong (0: none) */
    char head[65];     /* hash of the last record ("" when empty) */
    char what[256];    /* what is wrong, when broken */
    int64_t witnesses; /* witnesses checked (fi_audit_witness_put) */
} fi_audit_check;

/* Walks the whole chain, in one read transaction: the log's own chain,
 * then each source's run (consecutive source_seq from 1, or from the
 * record after another source's last one, a replaced key's log taken
 * over; each source_hash the source's chain hash), then each head in
 * audit_sources against its source's last record, then each witness
 * (audit_witnesses) against the record it was told. Returns 0 when intact,
 * 1 when broken (out->what says where and how: removed, edited or
 * reordered, naming the record and source; out->bad_seq is the record, or
 * for a head that does not match, the source's last record in this log,
 * or the log's last when it has none; for a witness, the record it was
 * told), -1 on a database error. */
int fi_audit_verify(fi_audit *self, fi_audit_check *out, char *err, size_t cap) FI_WUR;

/* A checkpoint of a log: record seq and its chain hash, noted by an
 * operator as "SEQ:HASH" from `fedctl audit verify` and checked later, when
 * the log may have grown: the record must still be there with that hash,
 * else records were cut off the end (or the log rewritten). */
typedef struct fi_audit_point {
    int64_t seq;
    char want[65];  /* the hash noted */
    int found;      /* the record seq was met (fi_audit_point_row) */
    char got[65];   /* its hash now */
} fi_audit_point;
/* Parses "SEQ:HASH" (SEQ >= 1, HASH 64 hex digits) into p. 0, or -1. */
int fi_audit_point_parse(const char *spec, fi_audit_point *p);
/* A fi_audit_query callback (arg: the point), for records after
 * point->seq - 1: takes the record seq and stops. */
int fi_audit_point_row(const fi_audit_record *r, void *arg);
/* After the query: 0 when the record is there with the hash noted; else 1
 * with a message in err naming what changed. */
int fi_audit_point_check(const fi_audit_point *p, int64_t records, char *err, size_t cap);

/* The log's last record: *seq (0 when the log is empty) and its chain
 * hash into head ("" when empty). 0 or -1 (message in err). */
int fi_audit_head(fi_audit *self, int64_t *seq, char head[65], char *err, size_t cap) FI_WUR;

/* Witnesses: the cut the checks above cannot see. Parties outside this
 * host (the coordinator's edges) are told the log's head (fi_audit_head)
 * from time to time; each keeps the newest it was told and reports it
 * back. A reported head is a checkpoint the log must hold for ever:
 * record seq, with that hash. The log keeps, per witness, the newest
 * reported (table audit_witnesses, outside the chain: rows are replaced),
 * and fi_audit_verify checks each. So records cut off the end, with
 * audit_sources edited to match, are caught once any witness was told a
 * record past the cut; a witness that reports again (an edge after the
 * coordinator restarts) brings its checkpoint back even when the cut also
 * removed its row. What no witness was told yet (the last heartbeat
 * interval) stays open to the cut. */
typedef struct fi_audit_witness {
    const char *who;   /* the witness (an edge's key fingerprint), 1..FI_AUDIT_WITNESS_MAX bytes */
    const char *site;  /* where it is, for messages ("" unknown) */
    int64_t seq;       /* the record it was told, >= 1 */
    char hash[65];     /* that record's chain hash, 64 lower-case hex */
    int64_t reported;  /* when it reported it, Unix ms */
} fi_audit_witness;
#define FI_AUDIT_WITNESS_MAX 128

/* 1 when seq and hash could name a record of a log (seq >= 1, hash 64
 * lower-case hex digits): what a witness report must be. */
int fi_audit_head_valid(int64_t seq, const char *hash);
/* Checks one witness against the log as it is now. 0 when the log holds
 * record w->seq with w->hash; 1 when not, with a message in err naming
 * the witness and what changed (cut off the end, or rewritten); -1 on a
 * database error. */
int fi_audit_witness_check(fi_audit *self, const fi_audit_witness *w, char *err, size_t cap) FI_WUR;
/* Keeps n witness reports, in one transaction: per witness the report of
 * the highest seq (a lower one, from a witness that lost its record, does
 * not replace it), except that a kept report the log no longer holds is
 * never replaced: it is the evidence, until someone removes the row. A
 * report that is not valid (who, fi_audit_head_valid) refuses the call: 1
 * with err, nothing kept. 0, 1 or -1. */
int fi_audit_witness_put(fi_audit *self, const fi_audit_witness *w, size_t n, char *err, size_t cap) FI_WUR;
/* Calls fn for each witness kept (by name), with holds 1 when the log
 * holds its record now, else 0 and why; stops when fn returns nonzero.
 * 0 or -1. */
int fi_audit_witness_each(fi_audit *self, int (*fn)(const fi_audit_witness *w, int holds, const char *why, void *arg),
                          void *arg, char *err, size_t cap) FI_WUR;
/* Removes the witness kept for who (NULL: all of them), after the log was
 * replaced on purpose; *removed gets how many. 0 or -1. */
int fi_audit_witness_forget(fi_audit *self, const char *who, int64_t *removed, char *err, size_t cap) FI_WUR;

#ifdef __cplusplus
}
#endif
#endif /* FI_AUDIT_H */
