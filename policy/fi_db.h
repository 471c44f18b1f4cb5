/*
 * fi_db.h - the start-up check of an SQLite database that a process is
 * about to rely on: damage anywhere in the file is found when it is
 * opened, and said plainly, instead of when a later read or write happens
 * to meet the damaged page (for an edge: every request answered 503
 * audit_unavailable from then on).
 *
 * Every module that opens a database of its own at the start of a process
 * or a command (the coordinator's state, its audit log, the policy store,
 * the edge's database, fedctl's --store and --db files) runs fi_db_check
 * right after opening it. It lives in policy/ because policy/ stands alone
 * and fabric/ and edge/ both use it.
 *
 * Cost: PRAGMA quick_check reads every page of the file once (it leaves
 * out integrity_check's comparison of each index with its table). On an
 * audit log of 200,000 records (78 MB, 4 KB pages) it took 0.09-0.13 s
 * with the file in the page cache, and 0.12-0.19 s with the file dropped
 * from the cache first, thanks to one sequential read of the file before
 * the check (without it: 1.5 s, about 2 s per 100 MB, on this machine's
 * virtual disk). Each module that opens the file pays it: the
 * coordinator's database is checked three times at start (the fleet
 * store, the policy store, the application tokens) and its audit log
 * twice, the second time from the page cache; an edge checks its database
 * once. Nothing is checked while serving.
 */
#ifndef FI_DB_H
#define FI_DB_H

#include <sqlite3.h>
#include <stddef.h>

#include "fi_policy.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_DB_PROBLEMS 5 /* problems PRAGMA quick_check is asked to list, at most */

/* Runs PRAGMA quick_check(FI_DB_PROBLEMS) on db, just opened on path (a
 * busy timeout already set: the check waits for another process's write
 * lock like any read). Returns 0 when SQLite answers "ok" (a new, empty
 * file does). Otherwise returns the SQLite result code that failed it
 * (SQLITE_CORRUPT when the check listed problems) with a message in err:
 *
 *   PATH: database is damaged: Page 7: btreeInitPage() returns error code
 *   11 (restore it from a backup)
 *
 * for damage or a file that is not a database (SQLITE_CORRUPT,
 * SQLITE_NOTADB), "PATH: cannot check the database: ..." for anything else
 * (a lock held past the timeout, an I/O error). err always names path and
 * ends with the advice, however much of SQLite's list had to be cut. */
int fi_db_check(sqlite3 *db, const char *path, char *err, size_t cap) FI_WUR;

/* For the failure paths of the open and of the statements that follow it
 * (the schema, the pragmas): when rc, a primary or extended SQLite result
 * code, is SQLITE_CORRUPT or SQLITE_NOTADB, writes fi_db_check's damaged
 * message with detail (SQLite's message; NULL: none) as the problem and
 * returns 1. Returns 0 otherwise, err untouched, for the caller's own
 * message. */
int fi_db_damaged(int rc, const char *path, const char *detail, char *err, size_t cap);

#ifdef __cplusplus
}
#endif

#endif
