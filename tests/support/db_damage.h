/*
 * db_damage.h - damage an SQLite file the way a failing disk or a stray
 * write does: one b-tree page in the middle of the file overwritten with
 * garbage, the header and page 1 left intact, so that opening the file
 * still works and only a check of its pages (or a read that happens to
 * reach that page) finds it. And an audit log big enough to damage.
 */
#ifndef FI_TEST_DB_DAMAGE_H
#define FI_TEST_DB_DAMAGE_H

#include <stddef.h>

/* Overwrites the first b-tree page at or after the middle of the closed
 * database at path (page size from the header: offset 16, big-endian) with
 * garbage. Returns its page number (1-based, > 1), or -1 with a message in
 * why when the file cannot serve: unreadable, fewer than 8 pages, free
 * pages (a freed page may look like a b-tree page and is never read), a
 * write-ahead log with frames (they would hide the damage), no b-tree
 * page in the second half. */
int fi_test_db_damage(const char *path, char *why, size_t cap);

/* Adds n records to the audit log at path (created when absent) through
 * the log's own ingest, 100 to a transaction (appends wait for the disk
 * one by one): 2000 make about 150 pages. 0, or -1 with a message. */
int fi_test_audit_fill(const char *path, int n, char *err, size_t cap);

#endif
