/*
 * fi_coord_ship.h - the coordinator's side of policy shipping and auditing
 * (issue 4): the policy store (policy/fi_pstore.h, in the coordinator's
 * database), the policy-signing key, and the coordinator's audit log
 * (policy/fi_audit.h, in a file of its own).
 *
 * The coordinator's loop (fi_coord.c) hands every PolicyApply,
 * PolicyRollback, PolicyHistoryRequest, PolicyGet, AuditQuery and
 * AuditVerifyRequest of an operator, and every AuditUpload of an edge or
 * cluster, to fi_ship_handle, after checking the sender's role from its
 * authenticated key. Apply and rollback sign a bundle and hand it back to
 * the loop to push to every connected edge; an edge that says Hello is
 * sent the active bundle (fi_ship_active_bundle).
 *
 * Audit uploads: AuditUpload.batch is a JSON array of the source's records
 * in its own numbering (see fi_ship_audit_batch). The chain is verified and
 * the records are copied into the coordinator's log with fi_audit_ingest:
 * a batch sent twice is taken once, a gap or an edited record refuses the
 * batch (Error bad_request), and an edge's records must carry its own site
 * as origin.
 */
#ifndef FI_COORD_SHIP_H
#define FI_COORD_SHIP_H

#include <stddef.h>
#include <stdint.h>

#include "fi_audit.h"
#include "fi_bundle.h"
#include "fi_store.h"
#include "fi_wire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Default validity of a signed bundle when neither the request nor the
 * policy's `expires` bounds it sooner: 30 days. */
#define FI_SHIP_DEFAULT_VALID_S (30 * 86400)
/* How long the coordinator's event loop waits for a database lock held by
 * another process before the request fails with SQLite's reason. */
#define FI_SHIP_BUSY_MS 250
/* Records in one uploaded audit batch, at most. */
#define FI_SHIP_MAX_BATCH 5000

typedef struct fi_ship fi_ship;

/* Where the policy-signing key and the audit log live when the
 * configuration does not say: DB.policy.key and DB.audit, next to the
 * coordinator's database. key and audit may be NULL. */
void fi_ship_paths(const char *db, const char *policy_key, const char *audit_db, char *key, size_t keycap,
                   char *audit, size_t auditcap);

/* Makes the policy-signing key at key_path (secret, mode 0600, and
 * key_path.pub) unless it exists; either way writes its public key as 64
 * hex characters into pub_hex and sets *created. 0, or -1 with a message. */
int fi_ship_keygen(const char *key_path, char pub_hex[65], int *created, char *err, size_t errlen);

/* Opens the policy store (in db, the coordinator's database), the audit
 * log (audit_db) and reads the signing key (key_path; when it is absent,
 * apply and rollback are refused with a message naming --init). valid_s:
 * default bundle validity (0: FI_SHIP_DEFAULT_VALID_S). fleet (borrowed,
 * may be NULL) also keeps each uploaded batch that brought new records as
 * it came (fi_store_audit_put), as evidence of what the source sent. NULL
 * with a message on failure. */
fi_ship *fi_ship_open(fi_store *fleet, const char *db, const char *audit_db, const char *key_path, int64_t valid_s, char *err,
                      size_t errlen);
/* Closes both databases and wipes the secret key; safe on NULL. */
void fi_ship_destroy(fi_ship **s);

/* Reserves version v in the policy store (fi_pstore_reserve): a signed
 * bundle an operator pushed holds it, so later applies number above it. 0,
 * or -1 with a message. */
int fi_ship_reserve(fi_ship *s, uint64_t v, char *err, size_t errlen);

/* Sends an encoded PolicyBundle message to every connected edge; returns
 * how many it was sent to. */
typedef int (*fi_ship_push_fn)(void *user, const uint8_t *buf, size_t len);

/* Handles one message of a type listed above from the authenticated peer
 * `from`. Returns the encoded reply (malloc'd, length in *len; an Error
 * when refused) or NULL when out of memory. push is called with the new
 * bundle after an apply or rollback, before the reply is built. */
uint8_t *fi_ship_handle(fi_ship *s, const fi_peer_rec *from, const fi_msg *m, fi_ship_push_fn push, void *push_user,
                        size_t *len);

/* 1 when m's type is one fi_ship_handle serves. */
int fi_ship_serves(fi_msg_type t);

/* The encoded PolicyBundle message of the active version, or NULL when
 * there is none, when its version is not above held (what the edge said
 * it holds in Hello), or on error. */
uint8_t *fi_ship_active_bundle(fi_ship *s, uint64_t held, size_t *len);

/* The encoded reply to AuditVerifyRequest for fi_audit_verify's result
 * (rc, ck; err when rc < 0): AuditVerifyReply, or Error internal. NULL
 * when out of memory. */
uint8_t *fi_ship_verify_reply(int rc, const fi_audit_check *ck, const char *err, size_t *len);

/* The audit log (owned by s), for tests. */
fi_audit *fi_ship_audit(fi_ship *s);

/* Encodes n records (with their seq and hash) as an AuditUpload batch:
 * a JSON array of objects with the keys seq, time, request_id, tenant,
 * application, origin, labels, model, latency_ms, prompt_tokens,
 * decision, target, rules, policy_digest, hash (latency_ms is optional on
 * input, -1 when absent). malloc'd string, or NULL. */
char *fi_ship_audit_batch(const fi_audit_record *recs, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* FI_COORD_SHIP_H */
