/*
 * policy_bundle.c - signed policy bundles (format and contract in
 * fi_bundle.h): keys, signing, verification, and the edge's on-disk copy.
 *
 * Uses libsodium directly (crypto_sign_detached, crypto_hash_sha256); when
 * the fabric's crypto module lands, the key-file helpers belong there.
 */
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fi_bundle.h"

#define MAGIC "fedinfer-policy-bundle 1\n"

const char *fi_bundle_status_str(fi_bundle_status st) {
    switch (st) {
    case FI_BUNDLE_OK: return "ok";
    case FI_BUNDLE_MALFORMED: return "malformed bundle";
    case FI_BUNDLE_UNSIGNED: return "unsigned bundle";
    case FI_BUNDLE_UNKNOWN_SIGNER: return "signed by an unknown key";
    case FI_BUNDLE_BAD_SIGNATURE: return "bad signature (tampered or corrupt)";
    case FI_BUNDLE_BAD_DIGEST: return "content does not match its digest";
    case FI_BUNDLE_REPLAY: return "version not newer than the one held (replay or roll-back)";
    case FI_BUNDLE_NOT_YET_VALID: return "not yet valid";
    case FI_BUNDLE_EXPIRED: return "expired";
    case FI_BUNDLE_BAD_POLICY: return "policy does not validate";
    case FI_BUNDLE_NONE: return "no bundle held";
    case FI_BUNDLE_IO: return "I/O error";
    }
    return "unknown status";
}

int fi_bundle_keygen(uint8_t pk[FI_BUNDLE_PK_BYTES], uint8_t sk[FI_BUNDLE_SK_BYTES]) {
    if (sodium_init() < 0) return -1;
    return crypto_sign_keypair(pk, sk) ? -1 : 0;
}

static int s_write_file(const char *path, const char *data, size_t len, mode_t mode, bool excl, char *err,
                        size_t cap) {
    int fd = open(path, O_WRONLY | O_CREAT | (excl ? O_EXCL : O_TRUNC), mode);
    if (fd < 0) {
        snprintf(err, cap, "cannot create %s: %s", path, strerror(errno));
        return -1;
    }
    size_t off = 0;
    while (off < len) {
        ssize_t k = write(fd, data + off, len - off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            snprintf(err, cap, "cannot write %s: %s", path, strerror(errno));
            close(fd);
            return -1;
        }
        off += (size_t)k;
    }
    if (fsync(fd) || close(fd)) {
        snprintf(err, cap, "cannot sync %s: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

int fi_bundle_key_save(const char *path, const uint8_t sk[FI_BUNDLE_SK_BYTES], char *err, size_t cap) {
    char hex[2 * FI_BUNDLE_SK_BYTES + 2];
    sodium_bin2hex(hex, sizeof hex - 1, sk, FI_BUNDLE_SK_BYTES);
    strcat(hex, "\n");
    int rc = s_write_file(path, hex, strlen(hex), 0600, true, err, cap);
    sodium_memzero(hex, sizeof hex);
    if (rc) return -1;
    uint8_t pk[FI_BUNDLE_PK_BYTES];
    crypto_sign_ed25519_sk_to_pk(pk, sk);
    char phex[2 * FI_BUNDLE_PK_BYTES + 2], pub[4096];
    sodium_bin2hex(phex, sizeof phex - 1, pk, sizeof pk);
    strcat(phex, "\n");
    snprintf(pub, sizeof pub, "%s.pub", path);
    return s_write_file(pub, phex, strlen(phex), 0644, false, err, cap);
}

/* Reads at most cap-1 bytes of a small file into buf, NUL-terminated. */
static int s_read_small(const char *path, char *buf, size_t cap, struct stat *st, char *err, size_t ecap) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC); /* a FIFO is refused, not waited on */
    if (fd < 0) {
        snprintf(err, ecap, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    if (fstat(fd, st)) {
        snprintf(err, ecap, "cannot stat %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st->st_mode)) {
        snprintf(err, ecap, "%s is not a regular file", path);
        close(fd);
        return -1;
    }
    ssize_t k = read(fd, buf, cap - 1);
    close(fd);
    if (k < 0) {
        snprintf(err, ecap, "cannot read %s: %s", path, strerror(errno));
        return -1;
    }
    buf[k] = 0;
    while (k > 0 && (buf[k - 1] == '\n' || buf[k - 1] == '\r' || buf[k - 1] == ' ')) buf[--k] = 0;
    return 0;
}

int fi_bundle_key_load(const char *path, uint8_t sk[FI_BUNDLE_SK_BYTES], char *err, size_t cap) {
    char buf[256];
    struct stat st;
    if (s_read_small(path, buf, sizeof buf, &st, err, cap)) return -1;
    int rc = -1;
    size_t n = 0;
    if (st.st_mode & 077) {
        snprintf(err, cap, "secret key %s is readable by others (mode %03o); chmod 600 it", path,
                 (unsigned)(st.st_mode & 0777));
    } else if (st.st_uid != geteuid() && st.st_uid != 0) {
        /* another user who owns it could swap the key under us */
        snprintf(err, cap, "secret key %s belongs to uid %u, not to this user (uid %u); chown it",
                 path, (unsigned)st.st_uid, (unsigned)geteuid());
    } else if (sodium_hex2bin(sk, FI_BUNDLE_SK_BYTES, buf, strlen(buf), NULL, &n, NULL) || n != FI_BUNDLE_SK_BYTES) {
        snprintf(err, cap, "%s is not a secret key file: expected %d hex characters", path, 2 * FI_BUNDLE_SK_BYTES);
    } else {
        rc = 0;
    }
    sodium_memzero(buf, sizeof buf);
    return rc;
}

int fi_bundle_pub_load(const char *path, uint8_t pk[FI_BUNDLE_PK_BYTES], char *err, size_t cap) {
    char buf[256];
    struct stat st;
    size_t n = 0;
    if (s_read_small(path, buf, sizeof buf, &st, err, cap)) return -1;
    if (sodium_hex2bin(pk, FI_BUNDLE_PK_BYTES, buf, strlen(buf), NULL, &n, NULL) || n != FI_BUNDLE_PK_BYTES) {
        snprintf(err, cap, "%s is not a public key file: expected %d hex characters", path, 2 * FI_BUNDLE_PK_BYTES);
        return -1;
    }
    return 0;
}

int fi_bundle_sign(const uint8_t sk[FI_BUNDLE_SK_BYTES], uint64_t version, int64_t not_before, int64_t not_after,
                   const char *content, size_t len, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    if (!version || not_after <= not_before || len > FI_BUNDLE_MAX_BYTES || sodium_init() < 0) return -1;
    uint8_t digest[32], pk[FI_BUNDLE_PK_BYTES], sig[FI_BUNDLE_SIG_BYTES];
    char dhex[65], phex[65], shex[129], head[512];
    crypto_hash_sha256(digest, (const unsigned char *)content, len);
    crypto_sign_ed25519_sk_to_pk(pk, sk);
    sodium_bin2hex(dhex, sizeof dhex, digest, sizeof digest);
    sodium_bin2hex(phex, sizeof phex, pk, sizeof pk);
    int h = snprintf(head, sizeof head, MAGIC "version %llu\nnot-before %lld\nnot-after %lld\ndigest %s\nsigner %s\nsize %zu\n\n",
                     (unsigned long long)version, (long long)not_before, (long long)not_after, dhex, phex, len);
    size_t body = (size_t)h + len;
    size_t total = body + strlen("signature ") + 128 + 1;
    char *b = malloc(total + 1);
    if (!b) return -1;
    memcpy(b, head, (size_t)h);
    memcpy(b + h, content, len);
    crypto_sign_detached(sig, NULL, (const unsigned char *)b, body, sk);
    sodium_bin2hex(shex, sizeof shex, sig, sizeof sig);
    snprintf(b + body, total + 1 - body, "signature %s\n", shex);
    *out = b;
    *out_len = total;
    return 0;
}

/* Reads "key value\n" at *p; value into val (NUL-terminated). */
static int s_field(const char **p, const char *end, const char *key, char *val, size_t cap) {
    size_t kl = strlen(key);
    if ((size_t)(end - *p) < kl + 2 || memcmp(*p, key, kl) || (*p)[kl] != ' ') return -1;
    const char *v = *p + kl + 1;
    const char *nl = memchr(v, '\n', (size_t)(end - v));
    if (!nl || (size_t)(nl - v) >= cap || nl == v) return -1;
    memcpy(val, v, (size_t)(nl - v));
    val[nl - v] = 0;
    *p = nl + 1;
    return 0;
}

static int s_u64(const char *s, uint64_t *out) {
    uint64_t x = 0;
    if (!*s || (s[0] == '0' && s[1])) return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || x > (UINT64_MAX - 9) / 10) return -1;
        x = x * 10 + (uint64_t)(*s - '0');
    }
    *out = x;
    return 0;
}

static int s_i64(const char *s, int64_t *out) {
    bool neg = *s == '-';
    uint64_t x;
    if (s_u64(s + neg, &x) || x > (uint64_t)INT64_MAX) return -1;
    *out = neg ? -(int64_t)x : (int64_t)x;
    return 0;
}

static int s_hex(const char *s, uint8_t *out, size_t n) {
    size_t got = 0;
    if (strlen(s) != 2 * n) return -1;
    for (size_t i = 0; i < 2 * n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return -1;
    return sodium_hex2bin(out, n, s, 2 * n, NULL, &got, NULL) || got != n ? -1 : 0;
}

fi_bundle_status fi_bundle_verify(const char *buf, size_t len, const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES],
                                  size_t n_trusted, uint64_t held_version, int64_t now, fi_bundle_info *info) {
    if (sodium_init() < 0) return FI_BUNDLE_IO;
    fi_bundle_info bi;
    memset(&bi, 0, sizeof bi);
    const char *p = buf, *end = buf + len;
    char v[160];
    uint64_t size;
    if (len > FI_BUNDLE_MAX_BYTES || len < strlen(MAGIC) || memcmp(buf, MAGIC, strlen(MAGIC))) return FI_BUNDLE_MALFORMED;
    p += strlen(MAGIC);
    if (s_field(&p, end, "version", v, sizeof v) || s_u64(v, &bi.version) || !bi.version) return FI_BUNDLE_MALFORMED;
    if (s_field(&p, end, "not-before", v, sizeof v) || s_i64(v, &bi.not_before)) return FI_BUNDLE_MALFORMED;
    if (s_field(&p, end, "not-after", v, sizeof v) || s_i64(v, &bi.not_after)) return FI_BUNDLE_MALFORMED;
    if (s_field(&p, end, "digest", v, sizeof v) || s_hex(v, bi.digest, 32)) return FI_BUNDLE_MALFORMED;
    if (s_field(&p, end, "signer", v, sizeof v) || s_hex(v, bi.signer, FI_BUNDLE_PK_BYTES)) return FI_BUNDLE_MALFORMED;
    if (s_field(&p, end, "size", v, sizeof v) || s_u64(v, &size)) return FI_BUNDLE_MALFORMED;
    if (p >= end || *p != '\n') return FI_BUNDLE_MALFORMED;
    p++;
    if (size > (uint64_t)(end - p)) return FI_BUNDLE_MALFORMED;
    bi.content = p;
    bi.content_len = (size_t)size;
    const char *sigp = p + size;
    size_t body = (size_t)(sigp - buf);
    if (sigp == end) return FI_BUNDLE_UNSIGNED;
    uint8_t sig[FI_BUNDLE_SIG_BYTES];
    const char *q = sigp;
    if (s_field(&q, end, "signature", v, sizeof v)) {
        return (size_t)(end - sigp) >= 9 && !memcmp(sigp, "signature", 9) ? FI_BUNDLE_MALFORMED : FI_BUNDLE_UNSIGNED;
    }
    if (q != end || s_hex(v, sig, sizeof sig)) return FI_BUNDLE_MALFORMED;
    bool known = false;
    for (size_t i = 0; i < n_trusted; i++) known |= !sodium_memcmp(trusted[i], bi.signer, FI_BUNDLE_PK_BYTES);
    if (!known) return FI_BUNDLE_UNKNOWN_SIGNER;
    if (crypto_sign_verify_detached(sig, (const unsigned char *)buf, body, bi.signer)) return FI_BUNDLE_BAD_SIGNATURE;
    uint8_t d[32];
    crypto_hash_sha256(d, (const unsigned char *)bi.content, bi.content_len);
    if (sodium_memcmp(d, bi.digest, 32)) return FI_BUNDLE_BAD_DIGEST;
    if (bi.version <= held_version) return FI_BUNDLE_REPLAY;
    if (now < bi.not_before) return FI_BUNDLE_NOT_YET_VALID;
    if (now >= bi.not_after) return FI_BUNDLE_EXPIRED;
    if (info) *info = bi;
    return FI_BUNDLE_OK;
}

/* ---------------------------------------------------------------- the edge */

static int s_read_all(const char *path, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return errno == ENOENT ? 1 : -1;
    size_t cap = 0;
    for (;;) {
        if (*len == cap) {
            if (cap >= FI_BUNDLE_MAX_BYTES + 1) break;
            cap = cap ? cap * 2 : 65536;
            char *n = realloc(*out, cap);
            if (!n) {
                fclose(f);
                free(*out);
                *out = NULL;
                return -1;
            }
            *out = n;
        }
        size_t k = fread(*out + *len, 1, cap - *len, f);
        *len += k;
        if (!k) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(*out);
        *out = NULL;
        return -1;
    }
    return 0;
}

/* The high-water mark: the highest version ever installed in dir (0: none). */
static uint64_t s_highwater(const char *dir) {
    char path[4096], buf[64], err[16];
    struct stat st;
    uint64_t v = 0;
    snprintf(path, sizeof path, "%s/version", dir);
    if (s_read_small(path, buf, sizeof buf, &st, err, sizeof err) || s_u64(buf, &v)) return 0;
    return v;
}

/* dir's install lock (dir/.lock, flock): an install holds it throughout,
 * so that no other install, and no load finishing one cut short, moves
 * files under it (another process, such as fedctl policy install, or
 * another thread of the edge). The descriptor, or -1: busy (nonblock) or
 * not to be had (a read-only folder). */
static int s_lock(const char *dir, int nonblock) {
    char path[4096];
    snprintf(path, sizeof path, "%s/.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    while (flock(fd, LOCK_EX | (nonblock ? LOCK_NB : 0)) != 0) {
        if (errno == EINTR) continue;
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static void s_unlock(int fd) {
    if (fd < 0) return;
    (void)flock(fd, LOCK_UN);
    close(fd);
}

/* fi_bundle_install raises the mark, writes current.bundle.tmp, then
 * renames it into place. Cut short between the two (a crash, a kill), the
 * held bundle is below the mark and the edge fails closed. A complete
 * current.bundle.tmp that verifies and carries the mark's version is the
 * bundle that install was putting in place: finish its job, unless an
 * install holds the lock now (then it is not cut short; it is running). */
static void s_finish_install(const char *dir, const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES], size_t n_trusted,
                             int64_t now) {
    char tmp[4096], cur[4096], *buf = NULL;
    size_t len = 0;
    snprintf(tmp, sizeof tmp, "%s/current.bundle.tmp", dir);
    snprintf(cur, sizeof cur, "%s/current.bundle", dir);
    if (access(tmp, F_OK) != 0) return;
    int lk = s_lock(dir, 1);
    if (lk < 0) return;
    if (s_read_all(tmp, &buf, &len) != 0) {
        s_unlock(lk);
        return;
    }
    fi_bundle_info bi;
    uint64_t mark = s_highwater(dir);
    if (mark && fi_bundle_verify(buf, len, trusted, n_trusted, 0, now, &bi) == FI_BUNDLE_OK && bi.version == mark &&
        rename(tmp, cur) == 0) {
        int dfd = open(dir, O_RDONLY);
        if (dfd >= 0) {
            (void)fsync(dfd);
            close(dfd);
        }
    }
    free(buf);
    s_unlock(lk);
}

/* Verifies the held bundle (finishing an install cut short first): like
 * fi_bundle_verify with the version check replaced by "not below the
 * high-water mark". */
static fi_bundle_status s_held(const char *dir, const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES], size_t n_trusted,
                               int64_t now, char **buf, size_t *len, fi_bundle_info *info) {
    char path[4096];
    s_finish_install(dir, trusted, n_trusted, now);
    snprintf(path, sizeof path, "%s/current.bundle", dir);
    int rc = s_read_all(path, buf, len);
    if (rc > 0) return FI_BUNDLE_NONE;
    if (rc < 0) return FI_BUNDLE_IO;
    /* Verify without the replay check first, then compare versions. */
    fi_bundle_status st = fi_bundle_verify(*buf, *len, trusted, n_trusted, 0, now, info);
    if (st != FI_BUNDLE_OK && st != FI_BUNDLE_EXPIRED && st != FI_BUNDLE_NOT_YET_VALID) return st;
    if (st == FI_BUNDLE_OK && info->version < s_highwater(dir)) return FI_BUNDLE_REPLAY;
    return st;
}

static fi_bundle_status s_install(const char *dir, const char *buf, size_t len,
                                  const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES], size_t n_trusted, int64_t now,
                                  char *err, size_t cap) {
    char *held = NULL;
    size_t hlen = 0;
    fi_bundle_info hi, ni;
    memset(&hi, 0, sizeof hi);
    const uint64_t mark = s_highwater(dir);
    fi_bundle_status hs = s_held(dir, trusted, n_trusted, now, &held, &hlen, &hi);
    /* Newer than the bundle held (which is at the mark or above). Without
     * one in place (none, or one below the mark: an install cut short
     * before its bundle was written whole), the mark's own version may be
     * installed again; anything older is a roll-back. */
    uint64_t held_version = hs == FI_BUNDLE_OK ? hi.version : mark ? mark - 1 : 0;
    free(held);
    fi_bundle_status st = fi_bundle_verify(buf, len, trusted, n_trusted, held_version, now, &ni);
    if (st != FI_BUNDLE_OK) {
        if (st == FI_BUNDLE_REPLAY) {
            fi_bundle_info x;
            memset(&x, 0, sizeof x);
            if (fi_bundle_verify(buf, len, trusted, n_trusted, 0, now, &x) != FI_BUNDLE_OK) x.version = 0;
            if (hs == FI_BUNDLE_OK)
                snprintf(err, cap, "bundle refused: %s (offered version %llu, holding %llu)",
                         fi_bundle_status_str(st), (unsigned long long)x.version, (unsigned long long)held_version);
            else
                snprintf(err, cap, "bundle refused: %s (offered version %llu; version %llu was installed here)",
                         fi_bundle_status_str(st), (unsigned long long)x.version, (unsigned long long)mark);
        } else {
            snprintf(err, cap, "bundle refused: %s", fi_bundle_status_str(st));
        }
        return st;
    }
    fi_diags *d = fi_diags_new();
    fi_policy *pol = fi_policy_parse(ni.content, ni.content_len, d);
    if (!pol) {
        char first[512] = "";
        if (fi_diags_count(d)) fi_diag_format(fi_diags_get(d, 0), "bundle", first, sizeof first);
        snprintf(err, cap, "bundle refused: its policy does not validate: %s", first);
        fi_diags_destroy(&d);
        return FI_BUNDLE_BAD_POLICY;
    }
    fi_policy_destroy(&pol);
    fi_diags_destroy(&d);
    char tmp[4096], cur[4096], ver[4096], vtext[32];
    snprintf(tmp, sizeof tmp, "%s/current.bundle.tmp", dir);
    snprintf(cur, sizeof cur, "%s/current.bundle", dir);
    snprintf(ver, sizeof ver, "%s/version", dir);
    /* Raise the high-water mark first: a crash between the two leaves the
     * old bundle below the mark, which then fails closed, never open. */
    snprintf(vtext, sizeof vtext, "%llu\n", (unsigned long long)ni.version);
    char vtmp[4096];
    snprintf(vtmp, sizeof vtmp, "%s/version.tmp", dir);
    if (s_write_file(vtmp, vtext, strlen(vtext), 0644, false, err, cap) || rename(vtmp, ver) ||
        s_write_file(tmp, buf, len, 0644, false, err, cap) || rename(tmp, cur)) {
        if (!err[0]) snprintf(err, cap, "cannot install bundle in %s: %s", dir, strerror(errno));
        return FI_BUNDLE_IO;
    }
    int dfd = open(dir, O_RDONLY);
    if (dfd >= 0) {
        (void)fsync(dfd);
        close(dfd);
    }
    return FI_BUNDLE_OK;
}

fi_bundle_status fi_bundle_install(const char *dir, const char *buf, size_t len,
                                   const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES], size_t n_trusted, int64_t now,
                                   char *err, size_t cap) {
    err[0] = 0;
    /* The folder is made by the first install (an edge's policy_dir, which
     * nothing else creates: every pushed bundle was refused, and the edge
     * stayed fail-closed), mode 0700; its parent must exist. */
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        snprintf(err, cap, "cannot create the policy folder %s: %s", dir, strerror(errno));
        return FI_BUNDLE_IO;
    }
    /* Without the lock (a folder we may not write) the install cannot
     * write either: it fails with its own reason, the bundle's or the
     * folder's. */
    int lk = s_lock(dir, 0);
    fi_bundle_status st = s_install(dir, buf, len, trusted, n_trusted, now, err, cap);
    s_unlock(lk);
    return st;
}

fi_bundle_status fi_bundle_load(const char *dir, const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES], size_t n_trusted,
                                int64_t now, fi_policy **pol, uint64_t *version, char *err, size_t cap) {
    *pol = NULL;
    *version = 0;
    char *buf = NULL;
    size_t len = 0;
    fi_bundle_info bi;
    memset(&bi, 0, sizeof bi);
    fi_bundle_status st = s_held(dir, trusted, n_trusted, now, &buf, &len, &bi);
    if (st == FI_BUNDLE_REPLAY) {
        snprintf(err, cap, "held bundle in %s is version %llu, below version %llu, the highest installed there "
                           "(an install was cut short, or the file was put back); enforcing the origin site only "
                           "(fail closed) until version %llu or newer is installed", dir,
                 (unsigned long long)bi.version, (unsigned long long)s_highwater(dir),
                 (unsigned long long)s_highwater(dir));
        free(buf);
        return st;
    }
    if (st != FI_BUNDLE_OK) {
        snprintf(err, cap, "held bundle in %s unusable: %s; enforcing the origin site only (fail closed)", dir,
                 fi_bundle_status_str(st));
        free(buf);
        return st;
    }
    *pol = fi_policy_parse(bi.content, bi.content_len, NULL);
    free(buf);
    if (!*pol) {
        snprintf(err, cap, "held bundle in %s: policy does not validate; fail closed", dir);
        return FI_BUNDLE_BAD_POLICY;
    }
    /* enforced no later than the bundle's not-after, however long it is held */
    fi_policy_expire_by(*pol, bi.not_after);
    if (!fi_policy_current(*pol, now)) {
        fi_policy_destroy(pol);
        snprintf(err, cap, "held bundle in %s: its policy has expired; fail closed", dir);
        return FI_BUNDLE_EXPIRED;
    }
    *version = bi.version;
    return FI_BUNDLE_OK;
}
