/*
 * fi_keys.c - key pairs, key files, fingerprints and tokens. See fi_keys.h.
 */
#include "fi_keys.h"

#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

int fi_keys_generate(fi_keypair *kp) {
    if (sodium_init() < 0) return -1;
    crypto_box_keypair(kp->pub, kp->sec);
    return 0;
}

void fi_keys_wipe(fi_keypair *kp) {
    if (kp) sodium_memzero(kp, sizeof *kp);
}

void fi_keys_to_z85(const uint8_t key[FI_KEYS_BYTES], char out[FI_KEYS_Z85_LEN]) {
    zmq_z85_encode(out, key, FI_KEYS_BYTES);
}

int fi_keys_from_z85(const char *s, uint8_t key[FI_KEYS_BYTES]) {
    if (!s || strlen(s) != FI_KEYS_Z85_LEN - 1) return -1;
    return zmq_z85_decode(key, s) ? 0 : -1;
}

void fi_keys_fingerprint(const uint8_t pub[FI_KEYS_BYTES], char out[FI_KEYS_FPR_LEN]) {
    uint8_t h[16];
    crypto_generichash(h, sizeof h, pub, FI_KEYS_BYTES, NULL, 0);
    sodium_bin2hex(out, FI_KEYS_FPR_LEN, h, sizeof h);
}

int fi_keys_token(char out[FI_KEYS_TOKEN_LEN]) {
    if (sodium_init() < 0) return -1;
    uint8_t r[20];
    randombytes_buf(r, sizeof r);
    memcpy(out, "fit_", 4);
    sodium_bin2hex(out + 4, FI_KEYS_TOKEN_LEN - 4, r, sizeof r);
    sodium_memzero(r, sizeof r);
    return 0;
}

void fi_keys_token_hash(const char *token, char out[65]) {
    uint8_t h[32];
    crypto_generichash(h, sizeof h, (const uint8_t *)token, strlen(token), NULL, 0);
    sodium_bin2hex(out, 65, h, sizeof h);
}

/* Writes text to path with the given mode: exclusive, or (force) into a
 * new file beside it that is then renamed over it. An existing file is
 * never opened for writing: a link there (symbolic or hard), or a reader
 * that opened the old file, never gets the new secret. */
static int s_write_file(const char *path, const char *text, mode_t mode, int force, char *err,
                        size_t errlen) {
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp-XXXXXX", path) >= (int)sizeof tmp) {
        snprintf(err, errlen, "%s: path too long", path);
        return -1;
    }
    int fd = -1;
    if (force) {
        fd = mkstemp(tmp); /* O_EXCL, 0600 */
    } else {
        fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    }
    const char *where = force ? tmp : path;
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s%s", where, strerror(errno),
                 errno == EEXIST ? " (use --force to overwrite)" : "");
        return -1;
    }
    size_t n = strlen(text);
    int rc = 0;
    if (fchmod(fd, mode) != 0 || write(fd, text, n) != (ssize_t)n || fsync(fd) != 0) {
        snprintf(err, errlen, "%s: write failed: %s", where, strerror(errno));
        rc = -1;
    }
    close(fd);
    if (force && rc == 0 && rename(tmp, path) != 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        rc = -1;
    }
    if (force && rc != 0) unlink(tmp);
    return rc;
}

int fi_keys_save(const fi_keypair *kp, const char *sec_path, const char *pub_path, int force,
                 char *err, size_t errlen) {
    char pz[FI_KEYS_Z85_LEN], sz[FI_KEYS_Z85_LEN], fpr[FI_KEYS_FPR_LEN];
    char text[256];
    fi_keys_to_z85(kp->pub, pz);
    fi_keys_to_z85(kp->sec, sz);
    fi_keys_fingerprint(kp->pub, fpr);
    snprintf(text, sizeof text,
             "# fedinfer CURVE secret key (keep private), fingerprint %s\n"
             "public = %s\nsecret = %s\n", fpr, pz, sz);
    if (!strcmp(sec_path, pub_path)) {
        snprintf(err, errlen, "%s: the secret and public key files must differ", sec_path);
        sodium_memzero(text, sizeof text);
        sodium_memzero(sz, sizeof sz);
        return -1;
    }
    int rc = s_write_file(sec_path, text, 0600, force, err, errlen);
    sodium_memzero(text, sizeof text);
    sodium_memzero(sz, sizeof sz);
    if (rc != 0) return -1;
    snprintf(text, sizeof text, "# fedinfer CURVE public key, fingerprint %s\npublic = %s\n", fpr,
             pz);
    if (s_write_file(pub_path, text, 0644, force, err, errlen) != 0) {
        if (!force) unlink(sec_path); /* no secret without its public half (a forced pair keeps the new secret) */
        return -1;
    }
    return 0;
}

/* Reads `public = ` and `secret = ` lines; the other may be absent. */
static int s_read_keys(const char *path, char *pub_z, char *sec_z, char *err, size_t errlen,
                       int want_private) {
    /* non-blocking: a FIFO at the path is refused below, not waited on */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", path);
        close(fd);
        return -1;
    }
    if (want_private && (st.st_mode & 077)) {
        snprintf(err, errlen,
                 "%s: secret key file is accessible by others (mode %04o); "
                 "refusing it (chmod 600 %s)", path, (unsigned)(st.st_mode & 07777), path);
        close(fd);
        return -1;
    }
    /* another user who owns it could swap the key under us */
    if (want_private && st.st_uid != geteuid() && st.st_uid != 0) {
        snprintf(err, errlen,
                 "%s: secret key file belongs to uid %u, not to this user (uid %u); "
                 "refusing it (chown it to the user that runs fedinfer)",
                 path, (unsigned)st.st_uid, (unsigned)geteuid());
        close(fd);
        return -1;
    }
    char buf[1024];
    if (st.st_size >= (off_t)sizeof buf) {
        snprintf(err, errlen, "%s: %lld bytes; a key file is under %zu", path, (long long)st.st_size,
                 sizeof buf);
        close(fd);
        return -1;
    }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    buf[n] = 0;
    if ((size_t)n != strlen(buf)) {
        snprintf(err, errlen, "%s: holds a NUL byte", path);
        sodium_memzero(buf, sizeof buf);
        return -1;
    }
    pub_z[0] = sec_z[0] = 0;
    int lineno = 0;
    for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
        lineno++;
        if (line[0] == '#' || line[0] == 0) continue;
        char *dst = NULL;
        if (!strncmp(line, "public = ", 9)) dst = pub_z;
        else if (!strncmp(line, "secret = ", 9)) dst = sec_z;
        if (!dst || strlen(line + 9) != FI_KEYS_Z85_LEN - 1 || dst[0]) {
            snprintf(err, errlen, "%s: line %d is %s", path, lineno,
                     dst && dst[0] ? "a second key line of its kind" : "not a key line");
            sodium_memzero(buf, sizeof buf);
            sodium_memzero(sec_z, FI_KEYS_Z85_LEN);
            return -1;
        }
        memcpy(dst, line + 9, FI_KEYS_Z85_LEN);
    }
    sodium_memzero(buf, sizeof buf);
    return 0;
}

int fi_keys_load_secret(const char *path, fi_keypair *kp, char *err, size_t errlen) {
    char pz[FI_KEYS_Z85_LEN], sz[FI_KEYS_Z85_LEN];
    uint8_t derived[FI_KEYS_BYTES];
    int rc = -1;
    if (sodium_init() < 0) {
        snprintf(err, errlen, "libsodium failed to initialise");
        return -1;
    }
    if (s_read_keys(path, pz, sz, err, errlen, 1) != 0) goto done;
    if (!sz[0] || fi_keys_from_z85(sz, kp->sec) != 0) {
        snprintf(err, errlen, "%s: no valid secret key", path);
        goto done;
    }
    crypto_scalarmult_base(derived, kp->sec);
    if (pz[0] && (fi_keys_from_z85(pz, kp->pub) != 0 || memcmp(derived, kp->pub, FI_KEYS_BYTES))) {
        snprintf(err, errlen, "%s: public key does not match the secret key", path);
        goto done;
    }
    memcpy(kp->pub, derived, FI_KEYS_BYTES);
    rc = 0;
done:
    sodium_memzero(sz, sizeof sz);
    if (rc != 0) fi_keys_wipe(kp);
    return rc;
}

int fi_keys_load_public(const char *path, uint8_t pub[FI_KEYS_BYTES], char *err, size_t errlen) {
    char pz[FI_KEYS_Z85_LEN], sz[FI_KEYS_Z85_LEN];
    if (s_read_keys(path, pz, sz, err, errlen, 0) != 0) return -1;
    sodium_memzero(sz, sizeof sz);
    if (!pz[0] || fi_keys_from_z85(pz, pub) != 0) {
        snprintf(err, errlen, "%s: no valid public key", path);
        return -1;
    }
    return 0;
}
