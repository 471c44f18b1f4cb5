/*
 * fi_store.h - the coordinator's fleet state in SQLite: sites, regions,
 * enrolled peers (edges, clusters, operators) with their keys, enrolment
 * tokens, and the opaque policy bundles and audit batches the fabric
 * carries for policy/.
 *
 * The database runs in WAL mode with synchronous=FULL: a call that returned
 * 0 is on disk, and a coordinator killed with SIGKILL finds it on restart.
 * One fi_store per process, used from one thread.
 */
#ifndef FI_STORE_H
#define FI_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "fi_keys.h"
#include "fi_wire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_STORE_NAME_MAX 64 /* bytes of a site or region name, NUL included */

typedef struct fi_store fi_store;

typedef struct fi_peer_rec {
    uint8_t pub[FI_KEYS_BYTES];       /* the enrolled CURVE public key */
    char fpr[FI_KEYS_FPR_LEN];        /* its fingerprint */
    Fi__Role role;                    /* edge, cluster or operator */
    char site[FI_STORE_NAME_MAX];     /* site name ("" for operators) */
    char region[FI_STORE_NAME_MAX];   /* region name ("" for operators) */
    int64_t enrolled_unix;            /* when it was enrolled, seconds */
    int revoked;                      /* 1 once revoked; never undone */
} fi_peer_rec;

/* Opens (creating when absent) the database at path. NULL with a message
 * in err on failure; a damaged file among the refusals (fi_db_check: the
 * whole file is checked first). */
fi_store *fi_store_open(const char *path, char *err, size_t errlen);
void fi_store_destroy(fi_store **st);
/* How long a write waits for another process's lock before it fails
 * (5000 ms from open); the coordinator's event loop uses a short one, so
 * that a lock held elsewhere fails a request with its reason instead of
 * stalling every peer. */
void fi_store_busy_timeout(fi_store *st, int ms);

/* A name is 1..63 bytes of [A-Za-z0-9._-]. */
int fi_store_name_ok(const char *s);

/* Adds a peer (and its site and region). Returns 0, or -1 with a message
 * (the key is already enrolled, or a database error). */
FI_WIRE_MUST_CHECK int fi_store_peer_add(fi_store *st, const uint8_t pub[FI_KEYS_BYTES],
                                         Fi__Role role, const char *site, const char *region,
                                         char *err, size_t errlen);
/* Looks a key up. Returns 1 found (out filled), 0 not enrolled, -1 error. */
int fi_store_peer_get(fi_store *st, const uint8_t pub[FI_KEYS_BYTES], fi_peer_rec *out);
/* Revokes the peer with fingerprint fpr. Returns 1 revoked (out filled),
 * 0 no such peer, -1 error. */
int fi_store_peer_revoke(fi_store *st, const char *fpr, fi_peer_rec *out);
/* SQLite's message for the last failed call on st ("database is locked"). */
const char *fi_store_last_error(fi_store *st);
/* Calls fn for each peer, ordered by role, site, fingerprint. Stops and
 * returns fn's value when nonzero; -1 on a database error. */
int fi_store_peer_each(fi_store *st, int (*fn)(void *user, const fi_peer_rec *p), void *user);

/* Stores a token's hash with what it may enrol and when it expires. */
FI_WIRE_MUST_CHECK int fi_store_token_add(fi_store *st, const char *token_hash, Fi__Role role,
                                          const char *site, const char *region,
                                          int64_t expires_unix, char *err, size_t errlen);
/* Redeems a token and enrols pub in one transaction: the token must be
 * unused, unexpired at now_unix, and for the given role, site and region.
 * Returns 0, or -1 with a message (nothing changed). */
FI_WIRE_MUST_CHECK int fi_store_enrol(fi_store *st, const char *token_hash, Fi__Role role,
                                      const char *site, const char *region,
                                      const uint8_t pub[FI_KEYS_BYTES], int64_t now_unix,
                                      char *err, size_t errlen);

/* Keeps an opaque signed policy bundle / an audit batch. */
FI_WIRE_MUST_CHECK int fi_store_bundle_put(fi_store *st, uint64_t version, const void *blob,
                                           size_t len, const char *from_fpr);
/* The newest bundle kept by fi_store_bundle_put (the highest version, the
 * last received on a tie): 1 with *version and a malloc'd copy in *blob
 * (*len bytes), 0 when there is none, -1 on a database error. */
FI_WIRE_MUST_CHECK int fi_store_bundle_newest(fi_store *st, uint64_t *version, void **blob, size_t *len);
FI_WIRE_MUST_CHECK int fi_store_audit_put(fi_store *st, const char *from_fpr, const char *batch_id,
                                          uint64_t first_seq, uint64_t count, const void *blob,
                                          size_t len);
/* Counts rows of a table ("peers", "tokens", "bundles", "audit", "sites");
 * -1 on error. For tests and status. */
int64_t fi_store_count(fi_store *st, const char *table);

#ifdef __cplusplus
}
#endif
#endif /* FI_STORE_H */
