/*
 * fi_coord_tokens.h - the coordinator's record of edges' application
 * bearer tokens (issue 5), managed by operators with `fedctl token`.
 *
 * Only each token's SHA-256 is held (fedctl makes the secret, shows it
 * once and sends the hash), with the site, tenant, application, times
 * and the operator's fingerprint, in a table `app_tokens` of the
 * coordinator's database (its own connection). Changes are sent to the
 * site's connected edges as AppTokenSync; an edge that says Hello is sent
 * every token of its site, so one that was offline catches up.
 */
#ifndef FI_COORD_TOKENS_H
#define FI_COORD_TOKENS_H

#include <stddef.h>
#include <stdint.h>

#include "fi_store.h"
#include "fi_wire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_apptok fi_apptok;

/* Opens (creating the table) on the coordinator's database file. NULL with
 * a message; a damaged file among the refusals (fi_db_check). */
fi_apptok *fi_apptok_open(const char *db, char *err, size_t errlen);
void fi_apptok_destroy(fi_apptok **t);
/* How long a write waits for another process's lock before it fails
 * (5000 ms from open); the coordinator's event loop uses a short one, so
 * that a lock held elsewhere fails a request with its reason instead of
 * stalling every peer. */
void fi_apptok_busy_timeout(fi_apptok *t, int ms);

/* What the handler needs from the coordinator's loop. */
typedef struct fi_apptok_fleet {
    /* 1 when an edge is enrolled for site */
    int (*site_has_edge)(void *user, const char *site);
    /* sends an encoded message to the site's connected edges; how many */
    int (*push)(void *user, const char *site, const uint8_t *buf, size_t len);
    void *user;
} fi_apptok_fleet;

/* Handles an operator's AppTokenRequest (author: its key fingerprint). A
 * change is pushed to the site's edges (AppTokenSync) before the reply is
 * made. Returns the encoded reply (AppTokenReply, or Error naming what is
 * wrong; malloc'd) or NULL when out of memory. */
uint8_t *fi_apptok_handle(fi_apptok *t, const char *author, const Fi__AppTokenRequest *rq,
                          const fi_apptok_fleet *fleet, size_t *len);

/* A site's tokens, all of them, revoked ones included, as AppTokenSync
 * pages of at most 1024 (oldest first): the page from *offset on, which
 * moves *offset past it; NULL once there is no more (or on error). An
 * edge applies each page on its own (edge_token_sync). */
uint8_t *fi_apptok_sync_site(fi_apptok *t, const char *site, long long *offset, size_t *len);

#ifdef __cplusplus
}
#endif
#endif /* FI_COORD_TOKENS_H */
