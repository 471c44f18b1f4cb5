/*
 * test_policy_bundle.c - signed bundles, the edge's on-disk copy and the
 * operator-side store: a good bundle is accepted; tampered, unsigned,
 * wrongly signed, replayed, rolled-back, expired and not-yet-valid ones are
 * refused; the edge keeps the last valid bundle and fails closed without
 * one; the store versions, refuses invalid policies and rolls back.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "db_damage.h"
#include "fi_bundle.h"
#include "fi_pstore.h"

static const char *POLICY = "labels public;\njurisdiction EU;\nregion r in EU;\nsite s in r;\npermit \"all\";\n";
static const char *POLICY2 = "labels public;\njurisdiction EU;\nregion r in EU;\nsite s in r;\npermit \"all\";\n"
                             "prefer \"p\" score 1 when true;\n";
#define NOW 1800000000LL

typedef struct fx {
    uint8_t pk[FI_BUNDLE_PK_BYTES];
    uint8_t sk[FI_BUNDLE_SK_BYTES];
    uint8_t pk2[FI_BUNDLE_PK_BYTES]; /* another, untrusted key */
    uint8_t sk2[FI_BUNDLE_SK_BYTES];
    char dir[256];                   /* scratch directory */
} fx;

static int s_setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    if (!f || fi_bundle_keygen(f->pk, f->sk) || fi_bundle_keygen(f->pk2, f->sk2)) return -1;
    snprintf(f->dir, sizeof f->dir, "/tmp/fi_bundle_test_XXXXXX");
    if (!mkdtemp(f->dir)) return -1;
    *state = f;
    return 0;
}

static int s_teardown(void **state) {
    fx *f = *state;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", f->dir);
    if (system(cmd)) return -1;
    free(f);
    return 0;
}

static char *s_sign(const fx *f, const uint8_t *sk, uint64_t v, int64_t nb, int64_t na, const char *text, size_t *len) {
    char *b = NULL;
    assert_int_equal(fi_bundle_sign(sk ? sk : f->sk, v, nb, na, text, strlen(text), &b, len), 0);
    return b;
}

static fi_bundle_status s_verify(const fx *f, const char *b, size_t len, uint64_t held, int64_t now) {
    fi_bundle_info info;
    return fi_bundle_verify(b, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk, 1, held, now, &info);
}

static void test_good_bundle(void **state) {
    fx *f = *state;
    size_t len;
    char *b = s_sign(f, NULL, 3, NOW - 10, NOW + 100, POLICY, &len);
    fi_bundle_info info;
    assert_int_equal(fi_bundle_verify(b, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk, 1, 2, NOW, &info), FI_BUNDLE_OK);
    assert_true(info.version == 3);
    assert_int_equal(info.content_len, strlen(POLICY));
    assert_memory_equal(info.content, POLICY, info.content_len);
    assert_memory_equal(info.signer, f->pk, FI_BUNDLE_PK_BYTES);
    /* a second trusted key does not hurt */
    uint8_t keys[2][FI_BUNDLE_PK_BYTES];
    memcpy(keys[0], f->pk2, FI_BUNDLE_PK_BYTES);
    memcpy(keys[1], f->pk, FI_BUNDLE_PK_BYTES);
    assert_int_equal(fi_bundle_verify(b, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])keys, 2, 0, NOW, NULL), FI_BUNDLE_OK);
    free(b);
    /* bad arguments to sign */
    char *x = NULL;
    size_t xl;
    assert_int_equal(fi_bundle_sign(f->sk, 0, 0, 10, "a", 1, &x, &xl), -1);
    assert_int_equal(fi_bundle_sign(f->sk, 1, 10, 10, "a", 1, &x, &xl), -1);
    assert_null(x);
}

static void test_refusals(void **state) {
    fx *f = *state;
    size_t len;
    char *b = s_sign(f, NULL, 5, NOW - 10, NOW + 100, POLICY, &len);
    /* tampered content: the signature no longer verifies */
    char *t = malloc(len);
    memcpy(t, b, len);
    char *at = strstr(t, "permit \"all\"");
    assert_non_null(at);
    at[0] = 'f'; /* permit -> fermit */
    assert_int_equal(s_verify(f, t, len, 0, NOW), FI_BUNDLE_BAD_SIGNATURE);
    /* tampered header (version raised) */
    memcpy(t, b, len);
    char *v = strstr(t, "version 5");
    v[8] = '9';
    assert_int_equal(s_verify(f, t, len, 0, NOW), FI_BUNDLE_BAD_SIGNATURE);
    /* tampered signature */
    memcpy(t, b, len);
    char *sg = strstr(t, "signature ");
    sg[10] = sg[10] == 'a' ? 'b' : 'a';
    assert_int_equal(s_verify(f, t, len, 0, NOW), FI_BUNDLE_BAD_SIGNATURE);
    /* unsigned: the signature line cut off */
    size_t body = (size_t)((const char *)memmem(b, len, "signature ", 10) - b);
    assert_int_equal(s_verify(f, b, body, 0, NOW), FI_BUNDLE_UNSIGNED);
    /* malformed */
    assert_int_equal(s_verify(f, "hello", 5, 0, NOW), FI_BUNDLE_MALFORMED);
    assert_int_equal(s_verify(f, b, 40, 0, NOW), FI_BUNDLE_MALFORMED);
    memcpy(t, b, len);
    strstr(t, "size ")[5] = 'x';
    assert_int_equal(s_verify(f, t, len, 0, NOW), FI_BUNDLE_MALFORMED);
    free(t);
    /* replay and roll-back: equal or lower version than held */
    assert_int_equal(s_verify(f, b, len, 5, NOW), FI_BUNDLE_REPLAY);
    assert_int_equal(s_verify(f, b, len, 9, NOW), FI_BUNDLE_REPLAY);
    assert_int_equal(s_verify(f, b, len, 4, NOW), FI_BUNDLE_OK);
    /* time window */
    assert_int_equal(s_verify(f, b, len, 0, NOW - 11), FI_BUNDLE_NOT_YET_VALID);
    assert_int_equal(s_verify(f, b, len, 0, NOW + 100), FI_BUNDLE_EXPIRED);
    free(b);
    /* signed by a key the edge does not trust */
    b = s_sign(f, f->sk2, 6, NOW - 10, NOW + 100, POLICY, &len);
    assert_int_equal(s_verify(f, b, len, 0, NOW), FI_BUNDLE_UNKNOWN_SIGNER);
    /* an untrusted key that names the trusted one as signer: bad signature */
    char *forged = malloc(len + 1);
    memcpy(forged, b, len);
    char hex[65];
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", f->pk[i]);
    memcpy(strstr(forged, "signer ") + 7, hex, 64);
    assert_int_equal(s_verify(f, forged, len, 0, NOW), FI_BUNDLE_BAD_SIGNATURE);
    free(forged);
    free(b);
    assert_string_equal(fi_bundle_status_str(FI_BUNDLE_REPLAY), "version not newer than the one held (replay or roll-back)");
}

static fi_bundle_status s_install(const fx *f, const char *b, size_t len, int64_t now, char *err, size_t cap) {
    err[0] = 0;
    return fi_bundle_install(f->dir, b, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk, 1, now, err, cap);
}

static void test_edge_keeps_last_valid(void **state) {
    fx *f = *state;
    char err[600];
    fi_policy *pol = NULL;
    uint64_t ver = 0;
    const uint8_t(*trusted)[FI_BUNDLE_PK_BYTES] = (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk;
    /* nothing held yet: fail closed */
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW, &pol, &ver, err, sizeof err), FI_BUNDLE_NONE);
    assert_null(pol);
    assert_non_null(strstr(err, "fail closed"));
    size_t l1, l2, l3, l4;
    char *b1 = s_sign(f, NULL, 1, NOW - 10, NOW + 1000, POLICY, &l1);
    char *b2 = s_sign(f, NULL, 2, NOW - 10, NOW + 1000, POLICY2, &l2);
    char *bad = s_sign(f, NULL, 3, NOW - 10, NOW + 1000, "permit \"x\" when target.nope;", &l3);
    char *b4 = s_sign(f, NULL, 4, NOW - 10, NOW + 10, POLICY, &l4);
    assert_int_equal(s_install(f, b1, l1, NOW, err, sizeof err), FI_BUNDLE_OK);
    assert_int_equal(s_install(f, b2, l2, NOW, err, sizeof err), FI_BUNDLE_OK);
    /* roll-back to version 1 refused, version 2 kept */
    assert_int_equal(s_install(f, b1, l1, NOW, err, sizeof err), FI_BUNDLE_REPLAY);
    assert_non_null(strstr(err, "offered version 1, holding 2"));
    /* replay of the held version refused */
    assert_int_equal(s_install(f, b2, l2, NOW, err, sizeof err), FI_BUNDLE_REPLAY);
    /* a validly signed bundle whose policy does not validate is refused */
    assert_int_equal(s_install(f, bad, l3, NOW, err, sizeof err), FI_BUNDLE_BAD_POLICY);
    assert_non_null(strstr(err, "does not validate"));
    /* tampered refused */
    char *t = malloc(l2);
    memcpy(t, b2, l2);
    strstr(t, "score 1")[6] = '9';
    assert_int_equal(s_install(f, t, l2, NOW, err, sizeof err), FI_BUNDLE_BAD_SIGNATURE);
    free(t);
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW, &pol, &ver, err, sizeof err), FI_BUNDLE_OK);
    assert_non_null(pol);
    assert_true(ver == 2);
    assert_int_equal(fi_policy_rule_count(pol), 2); /* POLICY2 */
    fi_policy_destroy(&pol);
    /* someone puts the older bundle file back: below the high-water mark */
    char path[512];
    snprintf(path, sizeof path, "%s/current.bundle", f->dir);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(b1, 1, l1, fp), l1);
    fclose(fp);
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW, &pol, &ver, err, sizeof err), FI_BUNDLE_REPLAY);
    assert_null(pol);
    /* a newer valid bundle repairs it; when it expires the edge fails closed */
    assert_int_equal(s_install(f, b4, l4, NOW, err, sizeof err), FI_BUNDLE_OK);
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW + 5, &pol, &ver, err, sizeof err), FI_BUNDLE_OK);
    /* the policy held from it stops at the bundle's not-after too, however
     * long the edge keeps it without reloading (offline): then only the
     * origin site is permitted */
    assert_true(fi_policy_current(pol, NOW + 5));
    assert_int_equal(fi_policy_expires(pol), NOW + 10);
    assert_false(fi_policy_current(pol, NOW + 10));
    {
        const char *names[] = {"s", "elsewhere"};
        fi_target_kind kinds[] = {FI_TARGET_SITE, FI_TARGET_CLUSTER};
        const char *labels[] = {"public"};
        fi_request rq = {0};
        rq.origin_site = "s";
        rq.labels = labels;
        rq.n_labels = 1;
        rq.latency_ms = rq.prompt_tokens = -1;
        fi_verdict v[2];
        fi_policy_decide_names(pol, NOW + 5, &rq, names, kinds, 2, v);
        assert_true(v[0].permitted);
        fi_policy_decide_names(pol, NOW + 365 * 86400, &rq, names, kinds, 2, v);
        assert_true(v[0].permitted);  /* the origin site */
        assert_false(v[1].permitted); /* nothing else */
    }
    fi_policy_destroy(&pol);
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW + 10, &pol, &ver, err, sizeof err), FI_BUNDLE_EXPIRED);
    assert_null(pol);
    /* an untrusted signer cannot install */
    size_t l5;
    char *b5 = s_sign(f, f->sk2, 50, NOW - 10, NOW + 1000, POLICY, &l5);
    assert_int_equal(s_install(f, b5, l5, NOW, err, sizeof err), FI_BUNDLE_UNKNOWN_SIGNER);
    free(b1);
    free(b2);
    free(bad);
    free(b4);
    free(b5);
}

/* Writes len bytes of b to dir/name. */
static void s_put(const fx *f, const char *name, const char *b, size_t len) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", f->dir, name);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(b, 1, len, fp), len);
    fclose(fp);
}

/* An install cut short (kill -9) after it raised the high-water mark: the
 * edge must not stay fail-closed until a newer version comes. */
static void test_install_cut_short(void **state) {
    fx *f = *state;
    char err[600], path[512];
    fi_policy *pol = NULL;
    uint64_t ver = 0;
    const uint8_t(*trusted)[FI_BUNDLE_PK_BYTES] = (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk;
    size_t l1, l2;
    char *b1 = s_sign(f, NULL, 11, NOW - 10, NOW + 1000, POLICY, &l1);
    char *b2 = s_sign(f, NULL, 12, NOW - 10, NOW + 1000, POLICY2, &l2);
    assert_int_equal(s_install(f, b1, l1, NOW, err, sizeof err), FI_BUNDLE_OK);
    /* cut after the mark and the whole temporary file, before the rename:
     * the next load finishes the install */
    s_put(f, "version", "12\n", 3);
    s_put(f, "current.bundle.tmp", b2, l2);
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW, &pol, &ver, err, sizeof err), FI_BUNDLE_OK);
    assert_true(ver == 12);
    assert_int_equal(fi_policy_rule_count(pol), 2); /* POLICY2 */
    fi_policy_destroy(&pol);
    snprintf(path, sizeof path, "%s/current.bundle.tmp", f->dir);
    assert_int_equal(access(path, F_OK), -1);
    /* cut while the temporary file was written (half of it): fail closed,
     * saying why, until the same version comes again, which is taken */
    size_t l3;
    char *b3 = s_sign(f, NULL, 13, NOW - 10, NOW + 1000, POLICY, &l3);
    s_put(f, "version", "13\n", 3);
    s_put(f, "current.bundle.tmp", b3, l3 / 2);
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW, &pol, &ver, err, sizeof err), FI_BUNDLE_REPLAY);
    assert_null(pol);
    printf("load: %s\n", err);
    assert_non_null(strstr(err, "version 12, below version 13"));
    assert_non_null(strstr(err, "cut short"));
    /* an older one is still a roll-back */
    assert_int_equal(s_install(f, b2, l2, NOW, err, sizeof err), FI_BUNDLE_REPLAY);
    printf("install: %s\n", err);
    assert_non_null(strstr(err, "offered version 12; version 13 was installed here"));
    assert_int_equal(s_install(f, b3, l3, NOW, err, sizeof err), FI_BUNDLE_OK);
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW, &pol, &ver, err, sizeof err), FI_BUNDLE_OK);
    assert_true(ver == 13);
    fi_policy_destroy(&pol);
    /* once in place, the same version again is a replay */
    assert_int_equal(s_install(f, b3, l3, NOW, err, sizeof err), FI_BUNDLE_REPLAY);
    assert_non_null(strstr(err, "offered version 13, holding 13"));
    /* a temporary file of another version than the mark is not taken */
    s_put(f, "current.bundle.tmp", b2, l2);
    assert_int_equal(fi_bundle_load(f->dir, trusted, 1, NOW, &pol, &ver, err, sizeof err), FI_BUNDLE_OK);
    assert_true(ver == 13);
    fi_policy_destroy(&pol);
    free(b1);
    free(b2);
    free(b3);
}

/* Loads in a loop, as an edge's reload (SIGHUP) while a bundle is pushed. */
typedef struct s_loader {
    const fx *f;
    atomic_int stop;
    int loads;
} s_loader;

static void *s_load_loop(void *arg) {
    s_loader *l = arg;
    char err[600];
    while (!atomic_load(&l->stop)) {
        fi_policy *pol = NULL;
        uint64_t ver = 0;
        if (fi_bundle_load(l->f->dir, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])l->f->pk, 1, NOW, &pol, &ver, err,
                           sizeof err) == FI_BUNDLE_OK)
            fi_policy_destroy(&pol);
        l->loads++;
    }
    return NULL;
}

/* Installs while another thread loads: the load never moves the files of
 * an install that is running (it only finishes one cut short), so every
 * install succeeds, and the last is what is held. */
static void test_install_races_load(void **state) {
    fx *f = *state;
    char err[600];
    s_loader l = {.f = f};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, s_load_loop, &l), 0);
    int failed = 0;
    for (uint64_t v = 100; v < 160; v++) {
        size_t len;
        char *b = s_sign(f, NULL, v, NOW - 10, NOW + 1000, v % 2 ? POLICY : POLICY2, &len);
        if (s_install(f, b, len, NOW, err, sizeof err) != FI_BUNDLE_OK) {
            printf("install %llu: %s\n", (unsigned long long)v, err);
            failed++;
        }
        free(b);
    }
    atomic_store(&l.stop, 1);
    pthread_join(th, NULL);
    printf("60 installs against %d loads: %d failed\n", l.loads, failed);
    assert_int_equal(failed, 0);
    fi_policy *pol = NULL;
    uint64_t ver = 0;
    assert_int_equal(fi_bundle_load(f->dir, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk, 1, NOW, &pol, &ver, err,
                                    sizeof err),
                     FI_BUNDLE_OK);
    assert_true(ver == 159);
    fi_policy_destroy(&pol);
}

static void test_policy_expiry_fails_closed(void **state) {
    fx *f = *state;
    char err[600];
    size_t len;
    const char *text = "expires \"2027-01-01T00:00:00Z\";\njurisdiction X;\n";
    int64_t exp = 1798761600;
    char sub[300];
    /* the folder is not there yet: the first install makes it, 0700 (an
     * edge's policy_dir that nothing had made refused every bundle) */
    snprintf(sub, sizeof sub, "%s/exp", f->dir);
    char *b = s_sign(f, NULL, 1, exp - 100, exp + 1000, text, &len);
    char nested[320];
    snprintf(nested, sizeof nested, "%s/no-parent/exp", f->dir);
    assert_int_equal(fi_bundle_install(nested, b, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk, 1, exp - 50, err,
                                       sizeof err),
                     FI_BUNDLE_IO);
    assert_non_null(strstr(err, "cannot create the policy folder"));
    err[0] = 0;
    assert_int_equal(fi_bundle_install(sub, b, len, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk, 1, exp - 50, err, sizeof err),
                     FI_BUNDLE_OK);
    struct stat sb;
    assert_int_equal(stat(sub, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0700);
    fi_policy *pol;
    uint64_t ver;
    /* the bundle is still valid but its policy has expired */
    assert_int_equal(fi_bundle_load(sub, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk, 1, exp, &pol, &ver, err, sizeof err),
                     FI_BUNDLE_EXPIRED);
    assert_null(pol);
    free(b);
}

static void test_keys(void **state) {
    fx *f = *state;
    char path[512], err[400];
    snprintf(path, sizeof path, "%s/signing.key", f->dir);
    assert_int_equal(fi_bundle_key_save(path, f->sk, err, sizeof err), 0);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(fi_bundle_key_save(path, f->sk, err, sizeof err), -1); /* never overwrites */
    uint8_t sk[FI_BUNDLE_SK_BYTES], pk[FI_BUNDLE_PK_BYTES];
    assert_int_equal(fi_bundle_key_load(path, sk, err, sizeof err), 0);
    assert_memory_equal(sk, f->sk, sizeof sk);
    char pub[520];
    snprintf(pub, sizeof pub, "%s.pub", path);
    assert_int_equal(fi_bundle_pub_load(pub, pk, err, sizeof err), 0);
    assert_memory_equal(pk, f->pk, sizeof pk);
    assert_int_equal(chmod(path, 0644), 0);
    assert_int_equal(fi_bundle_key_load(path, sk, err, sizeof err), -1);
    assert_non_null(strstr(err, "readable by others"));
    assert_int_equal(fi_bundle_pub_load(path, pk, err, sizeof err), -1); /* a secret key is not a public key */
}

/* A signing key owned by another user is refused (only root can give a
 * file away, so elsewhere this skips). */
static void test_key_owner(void **state) {
    fx *f = *state;
    if (geteuid() != 0) skip();
    char path[512], err[400];
    snprintf(path, sizeof path, "%s/owned.key", f->dir);
    assert_int_equal(fi_bundle_key_save(path, f->sk, err, sizeof err), 0);
    assert_int_equal(chown(path, 12345, (gid_t)-1), 0);
    uint8_t sk[FI_BUNDLE_SK_BYTES];
    assert_int_equal(fi_bundle_key_load(path, sk, err, sizeof err), -1);
    assert_non_null(strstr(err, "belongs to uid 12345"));
    assert_int_equal(chown(path, 0, (gid_t)-1), 0);
    assert_int_equal(fi_bundle_key_load(path, sk, err, sizeof err), 0);
}

static int s_count(const fi_pstore_version *v, void *arg) {
    fi_pstore_version *last = arg;
    *last = *v;
    return 0;
}

static void test_store(void **state) {
    fx *f = *state;
    char path[512], err[800];
    snprintf(path, sizeof path, "%s/store.db", f->dir);
    fi_pstore *s = fi_pstore_open(path, err, sizeof err);
    assert_non_null(s);
    uint64_t v1, v2, v3;
    assert_int_equal(fi_pstore_apply(s, POLICY, strlen(POLICY), "alice", "first", f->sk, NOW, 3600, &v1, err, sizeof err), 0);
    assert_int_equal(fi_pstore_apply(s, POLICY2, strlen(POLICY2), "bob", "second", f->sk, NOW + 1, 3600, &v2, err, sizeof err), 0);
    assert_true(v1 == 1 && v2 == 2);
    /* a policy with errors is never stored */
    const char *broken = "permit \"x\" when target.nope == 1;";
    uint64_t vx;
    assert_int_equal(fi_pstore_apply(s, broken, strlen(broken), "eve", "bad", f->sk, NOW, 3600, &vx, err, sizeof err), -1);
    assert_non_null(strstr(err, "unknown attribute target.nope"));
    /* roll back: a new version with old content */
    assert_int_equal(fi_pstore_rollback(s, 1, "carol", "revert", f->sk, NOW + 2, 3600, &v3, err, sizeof err), 0);
    assert_true(v3 == 3);
    assert_int_equal(fi_pstore_rollback(s, 42, "carol", "", f->sk, NOW + 2, 3600, &vx, err, sizeof err), -1);
    fi_pstore_version last;
    assert_int_equal(fi_pstore_history(s, s_count, &last, err, sizeof err), 0);
    assert_true(last.version == 3);
    assert_true(last.rollback_of == 1);
    assert_string_equal(last.author, "carol");
    assert_string_equal(last.comment, "rollback to version 1: revert");
    char *content, *bundle;
    size_t cl, bl;
    fi_pstore_version sv;
    assert_int_equal(fi_pstore_get(s, 0, &sv, &content, &cl, &bundle, &bl, err, sizeof err), 0);
    assert_string_equal(content, POLICY);
    fi_bundle_info info;
    /* the rollback's bundle is accepted by an edge holding version 2 */
    assert_int_equal(fi_bundle_verify(bundle, bl, (const uint8_t(*)[FI_BUNDLE_PK_BYTES])f->pk, 1, 2, NOW + 3, &info),
                     FI_BUNDLE_OK);
    assert_true(info.version == 3);
    assert_true(info.not_after == NOW + 2 + 3600);
    free(content);
    free(bundle);
    assert_int_equal(fi_pstore_get(s, 99, &sv, NULL, NULL, NULL, NULL, err, sizeof err), 1);
    fi_pstore_destroy(&s);
    /* versions are immutable, even through SQL */
    char cmd[700];
    snprintf(cmd, sizeof cmd, "sqlite3 '%s' \"UPDATE policy_versions SET comment='x' WHERE version=1\" 2>/dev/null", path);
    int rc = system(cmd);
    if (rc != -1 && WEXITSTATUS(rc) != 127) assert_true(rc != 0); /* refused by the trigger (skipped without sqlite3) */
    /* the policy's own expiry bounds the bundle */
    s = fi_pstore_open(path, err, sizeof err);
    const char *exp = "expires \"2027-01-01T00:00:00Z\";\njurisdiction X;\n";
    assert_int_equal(fi_pstore_apply(s, exp, strlen(exp), "a", "b", f->sk, 1798761600 - 100, 86400, &vx, err, sizeof err), 0);
    assert_int_equal(fi_pstore_get(s, vx, &sv, NULL, NULL, NULL, NULL, err, sizeof err), 0);
    assert_true(sv.not_after == 1798761600);
    assert_int_equal(fi_pstore_apply(s, exp, strlen(exp), "a", "b", f->sk, 1798761600, 86400, &vx, err, sizeof err), -1);
    assert_non_null(strstr(err, "expired"));
    fi_pstore_destroy(&s);
    fi_pstore_destroy(&s);
}

/* A version reserved for a bundle signed elsewhere is skipped by later
 * applies and rollbacks; a lower reservation changes nothing. */
static void test_store_reserve(void **state) {
    fx *f = *state;
    char path[512], err[800];
    snprintf(path, sizeof path, "%s/reserve.db", f->dir);
    fi_pstore *s = fi_pstore_open(path, err, sizeof err);
    assert_non_null(s);
    uint64_t v;
    assert_int_equal(fi_pstore_apply(s, POLICY, strlen(POLICY), "a", "", f->sk, NOW, 3600, &v, err, sizeof err), 0);
    assert_true(v == 1);
    assert_int_equal(fi_pstore_reserve(s, 7, err, sizeof err), 0);
    assert_int_equal(fi_pstore_reserve(s, 3, err, sizeof err), 0); /* lower: no change */
    assert_int_equal(fi_pstore_apply(s, POLICY2, strlen(POLICY2), "a", "", f->sk, NOW, 3600, &v, err, sizeof err), 0);
    assert_true(v == 8);
    assert_int_equal(fi_pstore_reserve(s, 8, err, sizeof err), 0); /* not above: no change */
    assert_int_equal(fi_pstore_rollback(s, 1, "a", "", f->sk, NOW, 3600, &v, err, sizeof err), 0);
    assert_true(v == 9);
    assert_int_equal(fi_pstore_reserve(s, (uint64_t)INT64_MAX + 1, err, sizeof err), -1);
    assert_non_null(strstr(err, "beyond"));
    assert_int_equal(fi_pstore_reserve(s, (uint64_t)INT64_MAX, err, sizeof err), -1);
    /* the last number there is, then a clear refusal (not a wrapped one) */
    assert_int_equal(fi_pstore_reserve(s, (uint64_t)INT64_MAX - 1, err, sizeof err), 0);
    assert_int_equal(fi_pstore_apply(s, POLICY, strlen(POLICY), "a", "", f->sk, NOW, 3600, &v, err, sizeof err), 0);
    assert_true(v == (uint64_t)INT64_MAX);
    assert_int_equal(fi_pstore_apply(s, POLICY, strlen(POLICY), "a", "", f->sk, NOW, 3600, &v, err, sizeof err), -1);
    assert_non_null(strstr(err, "exhausted"));
    fi_pstore_destroy(&s);
    /* kept in the database */
    snprintf(path, sizeof path, "%s/reserve2.db", f->dir);
    s = fi_pstore_open(path, err, sizeof err);
    assert_non_null(s);
    assert_int_equal(fi_pstore_reserve(s, 20, err, sizeof err), 0);
    fi_pstore_destroy(&s);
    s = fi_pstore_open(path, err, sizeof err);
    assert_int_equal(fi_pstore_apply(s, POLICY, strlen(POLICY), "a", "", f->sk, NOW, 3600, &v, err, sizeof err), 0);
    assert_true(v == 21);
    fi_pstore_destroy(&s);
}

/* A store that cannot write (here a trigger refuses, as a full disk
 * would) says so, naming its file, with FI_PSTORE_FAILED: not the -1 of a
 * refused policy, so the coordinator answers ERR_INTERNAL, not
 * bad_request. Nothing is numbered meanwhile. */
static void test_store_failure(void **state) {
    fx *f = *state;
    char path[512], err[800];
    snprintf(path, sizeof path, "%s/failing.db", f->dir);
    fi_pstore *s = fi_pstore_open(path, err, sizeof err);
    assert_non_null(s);
    uint64_t v = 0;
    assert_int_equal(fi_pstore_apply(s, POLICY, strlen(POLICY), "a", "", f->sk, NOW, 3600, &v, err, sizeof err), 0);
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "CREATE TRIGGER full BEFORE INSERT ON policy_versions BEGIN "
                                      "SELECT RAISE(ABORT, 'database or disk is full'); END;",
                                  NULL, NULL, NULL),
                     SQLITE_OK);
    assert_int_equal(fi_pstore_apply(s, POLICY2, strlen(POLICY2), "a", "", f->sk, NOW, 3600, &v, err, sizeof err),
                     FI_PSTORE_FAILED);
    printf("apply: %s\n", err);
    assert_non_null(strstr(err, "failing.db"));
    assert_non_null(strstr(err, "disk is full"));
    assert_int_equal(fi_pstore_rollback(s, 1, "a", "", f->sk, NOW, 3600, &v, err, sizeof err), FI_PSTORE_FAILED);
    /* a refusal is still a refusal */
    assert_int_equal(fi_pstore_rollback(s, 9, "a", "", f->sk, NOW, 3600, &v, err, sizeof err), -1);
    assert_int_equal(sqlite3_exec(db, "DROP TRIGGER full;", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    assert_int_equal(fi_pstore_apply(s, POLICY2, strlen(POLICY2), "a", "", f->sk, NOW, 3600, &v, err, sizeof err), 0);
    assert_true(v == 2);
    fi_pstore_destroy(&s);
}

/* A page damaged in the middle of the store (a failing disk, a stray
 * write) is found when the store is opened (the coordinator's start,
 * fedctl policy --store), and the refusal names the file and says it is
 * damaged; before, the open succeeded and the damage surfaced when a
 * read or an apply reached that page. A new path is still created, an
 * intact store still opens. */
static void test_store_damaged(void **state) {
    fx *f = *state;
    char path[512], err[800], comment[400];
    snprintf(path, sizeof path, "%s/damaged.db", f->dir);
    fi_pstore *s = fi_pstore_open(path, err, sizeof err);
    if (!s) fail_msg("new store: %s", err);
    memset(comment, 'c', sizeof comment - 1);
    comment[sizeof comment - 1] = 0;
    uint64_t v = 0;
    for (int i = 0; i < 60; i++)
        assert_int_equal(fi_pstore_apply(s, i % 2 ? POLICY : POLICY2, strlen(i % 2 ? POLICY : POLICY2), "a",
                                         comment, f->sk, NOW, 3600, &v, err, sizeof err),
                         0);
    fi_pstore_destroy(&s);
    s = fi_pstore_open(path, err, sizeof err);
    if (!s) fail_msg("intact store: %s", err);
    fi_pstore_destroy(&s);
    int page = fi_test_db_damage(path, err, sizeof err);
    if (page < 0) fail_msg("%s", err);
    printf("damaged page %d\n", page);
    assert_null(fi_pstore_open(path, err, sizeof err));
    printf("open: %s\n", err);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, "database is damaged"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_good_bundle),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_edge_keeps_last_valid),
        cmocka_unit_test(test_install_cut_short),
        cmocka_unit_test(test_install_races_load),
        cmocka_unit_test(test_policy_expiry_fails_closed),
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_key_owner),
        cmocka_unit_test(test_store),
        cmocka_unit_test(test_store_reserve),
        cmocka_unit_test(test_store_failure),
        cmocka_unit_test(test_store_damaged),
    };
    return cmocka_run_group_tests(tests, s_setup, s_teardown);
}
