/*
 * fi_coord_audit.h - the coordinator's own routing decisions into its
 * hash-chained audit log (policy/fi_audit.h), off the event loop.
 *
 * Appending one record is a SQLite transaction with a full sync (about
 * half a millisecond here): done on the loop for every routed request, it
 * cut the broker's throughput by ten. So the loop hands copies of the
 * records to a writer thread with its own connection to the log; the
 * writer appends whatever has gathered in one transaction (through
 * fi_audit_ingest, as the chain of the source "coordinator:router"), in
 * order. A write that fails (the log locked by another process, a full
 * disk) is tried again with a growing pause (0.1 s doubling to 5 s) until
 * it succeeds, and the records wait. The queue is bounded: when it is
 * full the loop waits for room, so a record is never dropped. Destroying
 * the writer writes what is queued first (writes still failing are tried
 * for 10 s more, all together, then what is left is reported lost). A crash loses at most the records of the last moments
 * (the edges keep and upload their own record of each decision).
 */
#ifndef FI_COORD_AUDIT_H
#define FI_COORD_AUDIT_H

#include <stddef.h>

#include "fi_audit.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fi_coord_audit fi_coord_audit;

/* Opens the log at path (another connection; WAL) and starts the writer.
 * NULL with a message. */
fi_coord_audit *fi_coord_audit_new(const char *path, char *err, size_t errlen);
/* Writes what is queued, stops the writer, closes; safe on NULL. */
void fi_coord_audit_destroy(fi_coord_audit **a);
/* Queues a copy of rec (seq and hash are ignored). Waits while the queue
 * is full. 0, or -1 when out of memory. */
int fi_coord_audit_put(fi_coord_audit *a, const fi_audit_record *rec);
/* Waits until everything queued so far is written (tests). */
void fi_coord_audit_flush(fi_coord_audit *a);

#ifdef __cplusplus
}
#endif
#endif /* FI_COORD_AUDIT_H */
