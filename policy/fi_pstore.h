/*
 * fi_pstore.h - the operator-side policy store: every policy version in
 * SQLite with its author, time, content hash and comment, signed into a
 * bundle by the policy-signing key.
 *
 * This store is what the coordinator keeps (fabric/fi_coord_ship.c, in
 * its database); `fedctl policy apply | history | rollback` reach it over
 * the fabric. With --store FILE they open a local store directly (an
 * offline tool).
 *
 * Versions are never edited or deleted (triggers refuse it); a roll-back is
 * a new version that carries an old version's content. Version numbers
 * increase by one per apply, so every bundle's version is greater than any
 * earlier bundle's, which is what edges need to refuse replays; a version
 * signed elsewhere and shipped to the edges (an operator's pushed bundle)
 * is reserved here (fi_pstore_reserve), and later versions number above it.
 */
#ifndef FI_PSTORE_H
#define FI_PSTORE_H

#include "fi_bundle.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_pstore fi_pstore;

/* One stored version (strings NUL-terminated, truncated if longer). */
typedef struct fi_pstore_version {
    uint64_t version;      /* 1, 2, ... */
    int64_t created;       /* Unix seconds */
    char author[128];      /* who applied it */
    char digest[65];       /* SHA-256 of the content, hex */
    char comment[512];     /* the operator's reason */
    int64_t not_before;    /* bundle validity, Unix seconds */
    int64_t not_after;
    uint64_t rollback_of;  /* version whose content this restores; 0: none */
} fi_pstore_version;

/* Opens (creating if needed) the store at path. Owned result, or NULL with
 * a message in err; a damaged file among the refusals (fi_db_check: the
 * whole file is checked first). */
fi_pstore *fi_pstore_open(const char *path, char *err, size_t cap) FI_WUR;
void fi_pstore_destroy(fi_pstore **self_p);
/* How long a write waits for another process's lock before it fails
 * (5000 ms from open); the coordinator's event loop uses a short one, so
 * that a lock held elsewhere fails a request with its reason instead of
 * stalling every peer. */
void fi_pstore_busy_timeout(fi_pstore *self, int ms);

/* What apply and rollback return when the store itself failed (a full
 * disk, a broken file: err names the file), as against -1, the request
 * refused (a policy with errors, an expired one, no such version). */
#define FI_PSTORE_FAILED (-2)

/* Validates the policy text (refused if it has any error: the first error
 * goes to err), signs a bundle valid from now to min(now + valid_for,
 * the policy's `expires`) with sk, and stores it as the next version.
 * *version gets its number. 0, -1 or FI_PSTORE_FAILED. */
int fi_pstore_apply(fi_pstore *self, const char *content, size_t len, const char *author, const char *comment,
                   const uint8_t sk[FI_BUNDLE_SK_BYTES], int64_t now, int64_t valid_for, uint64_t *version,
                   char *err, size_t cap) FI_WUR;

/* Records that versions up to `version` were taken by a bundle signed
 * elsewhere (the coordinator calls it for a signed bundle an operator
 * pushed): later applies and rollbacks are numbered above it, so edges
 * that hold it never refuse them as older. A lower version than one
 * reserved before changes nothing. 0 or -1. */
int fi_pstore_reserve(fi_pstore *self, uint64_t version, char *err, size_t cap) FI_WUR;

/* A new version with the content of version `old`. 0, -1 or
 * FI_PSTORE_FAILED. */
int fi_pstore_rollback(fi_pstore *self, uint64_t old, const char *author, const char *comment,
                      const uint8_t sk[FI_BUNDLE_SK_BYTES], int64_t now, int64_t valid_for, uint64_t *version,
                      char *err, size_t cap) FI_WUR;

/* Calls fn for every version, oldest first; stops when fn returns nonzero.
 * 0, or -1 on a database error. */
int fi_pstore_history(fi_pstore *self, int (*fn)(const fi_pstore_version *v, void *arg), void *arg, char *err,
                     size_t cap) FI_WUR;

/* Fetches a version (0: the latest). content and bundle (either may be
 * NULL) are owned by the caller. 0, 1 when there is no such version, -1 on
 * a database error. */
int fi_pstore_get(fi_pstore *self, uint64_t version, fi_pstore_version *v, char **content, size_t *content_len,
                 char **bundle, size_t *bundle_len, char *err, size_t cap) FI_WUR;

#ifdef __cplusplus
}
#endif
#endif /* FI_PSTORE_H */
