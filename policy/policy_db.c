/*
 * policy_db.c - the start-up check of an SQLite database (contract and
 * cost in fi_db.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fi_db.h"

/* what a damaged message ends with, whatever had to be cut before it */
/* Only a backup: a new, empty file in its place is no repair (an edge's
 * empty audit log restarts the chain the coordinator holds, which then
 * refuses its uploads as a rewritten history; an empty coordinator
 * database forgets every enrolled key). */
static const char s_advice[] = " (restore it from a backup)";
static const char s_damaged_head[] = ": database is damaged: ";

/* Writes "PATH: database is damaged: PROBLEMS (advice)", cutting problems
 * (with "...") rather than the advice when err is too small. */
static void s_damaged(const char *path, const char *problems, char *err, size_t cap) {
    if (!cap) return;
    size_t fixed = strlen(path) + sizeof s_damaged_head - 1 + sizeof s_advice - 1;
    size_t room = cap > fixed + 1 ? cap - fixed - 1 : 0; /* bytes of problems that fit */
    size_t len = strlen(problems);
    const char *cut = "";
    if (len > room) {
        len = room > 3 ? room - 3 : 0;
        cut = "...";
    }
    snprintf(err, cap, "%s%s%.*s%s%s", path, s_damaged_head, (int)len, problems, cut, s_advice);
}

int fi_db_damaged(int rc, const char *path, const char *detail, char *err, size_t cap) {
    int primary = rc & 0xff;
    if (primary != SQLITE_CORRUPT && primary != SQLITE_NOTADB) return 0;
    s_damaged(path, detail && detail[0] ? detail : sqlite3_errstr(rc), err, cap);
    return 1;
}

/* Appends one row of quick_check's answer to list (joined by "; "), on one
 * line and without the "*** in database main ***" that starts the first
 * (there is only the main database). */
static void s_add_problem(char *list, size_t cap, const char *row) {
    static const char in_main[] = "*** in database main ***";
    if (!strncmp(row, in_main, sizeof in_main - 1)) {
        row += sizeof in_main - 1;
        while (*row == '\n' || *row == ' ') row++;
    }
    size_t k = strlen(list);
    if (k && k + 2 < cap) {
        memcpy(list + k, "; ", 3);
        k += 2;
    }
    for (; *row && k + 1 < cap; row++) list[k++] = *row == '\n' ? ' ' : *row;
    list[k] = 0;
}

/* Reads the main database file of db once from start to end, so that the
 * check finds its pages in the page cache: quick_check walks each b-tree
 * in turn, and the pages of a table and of its index, grown together,
 * alternate in the file, so its 4 KB reads of a file not yet cached
 * defeat the kernel's read-ahead (an audit log of 78 MB not in the cache:
 * 1.5 s without this read, 0.12-0.19 s with it). The read goes through
 * SQLite's own file handle: opening and closing the file here would drop
 * every POSIX lock this process holds on it (the other connections' too),
 * and another process could then checkpoint and delete a write-ahead log
 * still in use. Failures are ignored: the check itself reports what
 * matters. */
static void s_warm(sqlite3 *db) {
    enum { S_CHUNK = 1 << 20 };
    sqlite3_file *f = NULL;
    sqlite3_int64 size = 0;
    if (sqlite3_file_control(db, "main", SQLITE_FCNTL_FILE_POINTER, &f) != SQLITE_OK || !f || !f->pMethods ||
        f->pMethods->xFileSize(f, &size) != SQLITE_OK)
        return;
    char *buf = malloc(S_CHUNK);
    for (sqlite3_int64 at = 0; buf && at < size; at += S_CHUNK)
        if (f->pMethods->xRead(f, buf, S_CHUNK, at) != SQLITE_OK) break; /* the end: a short read */
    free(buf);
}

int fi_db_check(sqlite3 *db, const char *path, char *err, size_t cap) {
    s_warm(db);
    char sql[40], problems[1024] = "";
    snprintf(sql, sizeof sql, "PRAGMA quick_check(%d)", FI_DB_PROBLEMS);
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db, sql, -1, &st, NULL);
    int rows = 0, ok = 0;
    while (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const char *row = (const char *)sqlite3_column_text(st, 0);
        if (!row) row = "";
        ok = rows++ == 0 && !strcmp(row, "ok");
        if (!ok) s_add_problem(problems, sizeof problems, row);
        rc = SQLITE_OK;
    }
    if (rc == SQLITE_DONE && ok) {
        rc = SQLITE_OK;
    } else if (rc == SQLITE_DONE) {
        rc = SQLITE_CORRUPT; /* the rows listed problems */
        s_damaged(path, problems[0] ? problems : "quick_check gave no answer", err, cap);
    } else {
        /* the check itself failed, or stopped after the rows it gave:
         * the file is no database, its schema is unreadable, or a lock or
         * I/O error stopped it (SQLite's message is read before finalize
         * resets it; the rows, when there are some, say more) */
        if (!problems[0]) s_add_problem(problems, sizeof problems, sqlite3_errmsg(db));
        if (!fi_db_damaged(rc, path, problems, err, cap))
            snprintf(err, cap, "%s: cannot check the database: %s", path, sqlite3_errmsg(db));
    }
    sqlite3_finalize(st);
    return rc & 0xff;
}
