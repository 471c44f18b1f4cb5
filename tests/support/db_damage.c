/*
 * db_damage.c - one damaged page in the middle of an SQLite file. See
 * db_damage.h.
 */
#include "db_damage.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "fi_audit.h"

static uint32_t s_be(const uint8_t *p, int n) {
    uint32_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

int fi_test_db_damage(const char *path, char *why, size_t cap) {
    char wal[4200];
    struct stat st;
    snprintf(wal, sizeof wal, "%s-wal", path);
    if (stat(wal, &st) == 0 && st.st_size > 0) {
        snprintf(why, cap, "%s has %lld bytes of write-ahead log: close every connection first", path,
                 (long long)st.st_size);
        return -1;
    }
    FILE *f = fopen(path, "r+b");
    uint8_t head[100], page[65536];
    if (!f || fread(head, 1, sizeof head, f) != sizeof head || memcmp(head, "SQLite format 3", 16) ||
        fseek(f, 0, SEEK_END) != 0) {
        snprintf(why, cap, "%s: no SQLite file", path);
        if (f) fclose(f);
        return -1;
    }
    uint32_t size = s_be(head + 16, 2) == 1 ? 65536 : s_be(head + 16, 2);
    long pages = ftell(f) / (long)size;
    long freelist = (long)s_be(head + 36, 4);
    if (pages < 8 || freelist) {
        snprintf(why, cap, "%s: %ld pages, %ld of them free (8 and none needed)", path, pages, freelist);
        fclose(f);
        return -1;
    }
    for (long n = pages / 2 + 1; n <= pages; n++) {
        if (fseek(f, (n - 1) * (long)size, SEEK_SET) != 0 || fread(page, 1, size, f) != size) break;
        /* interior index, interior table, leaf index, leaf table */
        if (page[0] != 0x02 && page[0] != 0x05 && page[0] != 0x0a && page[0] != 0x0d) continue;
        for (uint32_t i = 0; i < size; i++) page[i] = (uint8_t)(0x5b + i * 131u); /* no page type */
        int ok = fseek(f, (n - 1) * (long)size, SEEK_SET) == 0 && fwrite(page, 1, size, f) == size;
        if (fclose(f) != 0 || !ok) {
            snprintf(why, cap, "%s: cannot write page %ld", path, n);
            return -1;
        }
        return (int)n;
    }
    fclose(f);
    snprintf(why, cap, "%s: no b-tree page among pages %ld..%ld", path, pages / 2 + 1, pages);
    return -1;
}

int fi_test_audit_fill(const char *path, int n, char *err, size_t cap) {
    enum { S_BATCH = 100 };
    char prev[65] = "", ids[S_BATCH][32];
    fi_audit_record r[S_BATCH];
    int64_t seq0 = 0;
    fi_audit *a = fi_audit_open(path, err, cap);
    if (!a || fi_audit_source_head(a, "test-source", &seq0, prev, err, cap) != 0) {
        fi_audit_destroy(&a);
        return -1;
    }
    for (int base = 0; base < n; base += S_BATCH) {
        int k = n - base < S_BATCH ? n - base : S_BATCH;
        for (int i = 0; i < k; i++) {
            int64_t seq = seq0 + base + i + 1;
            memset(&r[i], 0, sizeof r[i]);
            snprintf(ids[i], sizeof ids[i], "req-%lld", (long long)seq);
            r[i].seq = seq;
            r[i].time = 1800000000000LL + seq * 1000;
            r[i].request_id = ids[i];
            r[i].tenant = "radiology";
            r[i].application = "report-summariser";
            r[i].origin = "berlin-clinic";
            r[i].labels = "phi,eu-resident";
            r[i].model = "smollm2-135m";
            r[i].latency_ms = -1;
            r[i].prompt_tokens = 100 + i;
            r[i].decision = "permit";
            r[i].target = "fra-gpu-1";
            r[i].rules = "phi stays in the EU";
            r[i].policy_digest = "ab12";
            fi_audit_chain_hash(prev, &r[i], r[i].hash);
            memcpy(prev, r[i].hash, sizeof prev);
        }
        size_t taken = 0;
        if (fi_audit_ingest(a, "test-source", NULL, r, (size_t)k, &taken, err, cap) != 0) {
            fi_audit_destroy(&a);
            return -1;
        }
    }
    fi_audit_destroy(&a);
    return 0;
}
