/*
 * fi_coord_verify.h - `fedctl audit verify` off the coordinator's event
 * loop. Walking the chain of a large audit log takes seconds (about 0.9 s
 * for 200,000 records here, growing with the log), during which the loop
 * would neither route nor keep its heartbeats, and edges would take the
 * coordinator for dead. So one verify at a time runs on a thread of its
 * own, over a read-only connection to the log opened once; the loop asks
 * fi_coord_verify_done at each turn (at least every 100 ms) and answers
 * the operator then. A second request while one runs is refused busy.
 */
#ifndef FI_COORD_VERIFY_H
#define FI_COORD_VERIFY_H

#include <stddef.h>
#include <stdint.h>

#include "fi_audit.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_coord_verify fi_coord_verify;

/* Opens the log at path read-only (it must exist: the coordinator has
 * opened it for writing first). NULL with a message. */
fi_coord_verify *fi_coord_verify_new(const char *path, char *err, size_t errlen);
/* Stops a verify that runs (interrupted) and closes; safe on NULL. */
void fi_coord_verify_destroy(fi_coord_verify **v);
/* Starts a verify for the peer serial. 0; 1 when one runs already; -1
 * when no thread can be started. */
int fi_coord_verify_start(fi_coord_verify *v, uint64_t serial);
/* 1 when the verify started has finished: its asker in *serial and its
 * encoded reply (fi_ship_verify_reply; malloc'd, NULL when out of memory)
 * in *reply; a new one may start. 0 when none has finished. */
int fi_coord_verify_done(fi_coord_verify *v, uint64_t *serial, uint8_t **reply, size_t *len);

#ifdef __cplusplus
}
#endif
#endif /* FI_COORD_VERIFY_H */
