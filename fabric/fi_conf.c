/*
 * fi_conf.c - strict key = value configuration files. See fi_conf.h.
 */
#include "fi_conf.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S_MAX_KEYS 64

static char *s_trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1])) s[--n] = 0;
    return s;
}

/* Edit distance (insertions, deletions, substitutions) between a and b;
 * 99 for names over 63 bytes: only for suggesting a key. */
static int s_distance(const char *a, const char *b) {
    size_t n = strlen(a), m = strlen(b);
    if (n > 63 || m > 63) return 99;
    int row[64];
    for (size_t j = 0; j <= m; j++) row[j] = (int)j;
    for (size_t i = 1; i <= n; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= m; j++) {
            int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[m];
}

/* The known key closest to name, within two edits and fewer than name's
 * length (so that short noise suggests nothing), or NULL. */
static const char *s_suggest(const fi_conf_key *keys, const char *name) {
    const char *best = NULL;
    int bd = 3;
    for (int k = 0; keys[k].name; k++) {
        int d = s_distance(name, keys[k].name);
        if (d < bd && d < (int)strlen(name)) {
            bd = d;
            best = keys[k].name;
        }
    }
    return best;
}

int fi_conf_load(const char *path, const fi_conf_key *keys, void *dst, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    int seen[S_MAX_KEYS] = {0};
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    int lineno = 0, rc = -1;
    while ((got = getline(&line, &cap, f)) != -1) {
        lineno++;
        if ((size_t)got != strlen(line)) { /* the rest of the line would be dropped unseen */
            snprintf(err, errlen, "%s:%d: NUL byte", path, lineno);
            goto done;
        }
        char *s = s_trim(line);
        if (!*s || *s == '#') continue;
        if ((size_t)got > FI_CONF_STR_MAX + 128) {
            snprintf(err, errlen, "%s:%d: line too long", path, lineno);
            goto done;
        }
        char *eq = strchr(s, '=');
        if (!eq) {
            snprintf(err, errlen, "%s:%d: expected 'key = value'", path, lineno);
            goto done;
        }
        *eq = 0;
        char *name = s_trim(s), *val = s_trim(eq + 1);
        int k = 0;
        while (keys[k].name && strcmp(keys[k].name, name)) k++;
        if (!keys[k].name) {
            const char *near = s_suggest(keys, name);
            if (near)
                snprintf(err, errlen, "%s:%d: unknown key '%s' (did you mean '%s'?)", path, lineno, name,
                         near);
            else
                snprintf(err, errlen, "%s:%d: unknown key '%s'", path, lineno, name);
            goto done;
        }
        if (k < S_MAX_KEYS && seen[k]) {
            snprintf(err, errlen, "%s:%d: key '%s' given twice", path, lineno, name);
            goto done;
        }
        if (k < S_MAX_KEYS) seen[k] = 1;
        char *at = (char *)dst + keys[k].offset;
        if (keys[k].type == FI_CONF_STR) {
            if (strlen(val) >= FI_CONF_STR_MAX || !*val) {
                snprintf(err, errlen, "%s:%d: value of '%s' is %s", path, lineno, name,
                         *val ? "too long" : "empty");
                goto done;
            }
            strcpy(at, val);
        } else {
            char *end;
            errno = 0;
            long v = strtol(val, &end, 10);
            int bad = errno || end == val || *end || v < keys[k].min || v > keys[k].max;
            if (bad && !keys[k].step) {
                snprintf(err, errlen, "%s:%d: value of '%s' must be an integer in [%ld, %ld]",
                         path, lineno, name, keys[k].min, keys[k].max);
                goto done;
            }
            if (bad || (keys[k].step && v % keys[k].step)) {
                snprintf(err, errlen, "%s:%d: value of '%s' must be a multiple of %ld in [%ld, %ld]",
                         path, lineno, name, keys[k].step, keys[k].min, keys[k].max);
                goto done;
            }
            int iv = (int)v;
            memcpy(at, &iv, sizeof iv);
        }
    }
    for (int k = 0; keys[k].name && k < S_MAX_KEYS; k++)
        if (keys[k].required && !seen[k]) {
            snprintf(err, errlen, "%s: required key '%s' is missing", path, keys[k].name);
            goto done;
        }
    rc = 0;
done:
    free(line);
    fclose(f);
    return rc;
}
