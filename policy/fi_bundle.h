/*
 * fi_bundle.h - signed policy bundles: what the coordinator ships and what
 * an edge accepts, keeps on disk and enforces while offline.
 *
 * A bundle is a policy's source text with a header, signed with Ed25519
 * (libsodium crypto_sign_detached) by the coordinator's policy-signing key:
 *
 *   fedinfer-policy-bundle 1\n
 *   version 7\n                 monotonically increasing, >= 1
 *   not-before 1764000000\n     Unix seconds
 *   not-after 1766592000\n      Unix seconds
 *   digest <64 hex>\n           SHA-256 of the content
 *   signer <64 hex>\n           the Ed25519 public key that signed
 *   size 1234\n                 bytes of content
 *   \n
 *   <content>
 *   signature <128 hex>\n       over every byte before "signature"
 *
 * An edge refuses a bundle that is malformed, unsigned, signed by a key it
 * does not trust, whose signature or digest does not verify, whose version
 * is not greater than the one it holds (replay, roll-back), that is not yet
 * valid or has expired, or whose policy does not validate.
 *
 * Key files hold lowercase hex: the secret key file (mode 0600) the 64-byte
 * libsodium Ed25519 secret key, the public key file (KEYFILE.pub) the 32-byte
 * public key.
 */
#ifndef FI_BUNDLE_H
#define FI_BUNDLE_H

#include "fi_policy.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_BUNDLE_PK_BYTES 32  /* Ed25519 public key */
#define FI_BUNDLE_SK_BYTES 64  /* Ed25519 secret key (libsodium layout) */
#define FI_BUNDLE_SIG_BYTES 64 /* Ed25519 signature */
#define FI_BUNDLE_MAX_BYTES (16u << 20)

typedef enum fi_bundle_status {
    FI_BUNDLE_OK = 0,
    FI_BUNDLE_MALFORMED,      /* not a bundle, or a header field is wrong */
    FI_BUNDLE_UNSIGNED,       /* no signature line */
    FI_BUNDLE_UNKNOWN_SIGNER, /* signer is not a trusted key */
    FI_BUNDLE_BAD_SIGNATURE,  /* signature does not verify (tampered) */
    FI_BUNDLE_BAD_DIGEST,     /* content does not match its digest */
    FI_BUNDLE_REPLAY,         /* version not above the one held */
    FI_BUNDLE_NOT_YET_VALID,  /* now < not-before */
    FI_BUNDLE_EXPIRED,        /* now >= not-after */
    FI_BUNDLE_BAD_POLICY,     /* content is not a valid policy */
    FI_BUNDLE_NONE,           /* no bundle held */
    FI_BUNDLE_IO              /* reading or writing failed */
} fi_bundle_status;

/* A short English phrase for the status ("bad signature"). */
const char *fi_bundle_status_str(fi_bundle_status st);

/* A verified bundle's header; content points into the caller's buffer. */
typedef struct fi_bundle_info {
    uint64_t version;                 /* >= 1 */
    int64_t not_before;               /* Unix seconds */
    int64_t not_after;                /* Unix seconds */
    uint8_t digest[32];               /* SHA-256 of content */
    uint8_t signer[FI_BUNDLE_PK_BYTES]; /* who signed */
    const char *content;              /* the policy text, in the bundle buffer */
    size_t content_len;               /* bytes */
} fi_bundle_info;

/* Makes a new signing key pair. 0 or -1. */
int fi_bundle_keygen(uint8_t pk[FI_BUNDLE_PK_BYTES], uint8_t sk[FI_BUNDLE_SK_BYTES]) FI_WUR;
/* Writes sk to path (mode 0600, refuses to overwrite) and its public key to
 * path.pub. 0, or -1 with a message in err. */
int fi_bundle_key_save(const char *path, const uint8_t sk[FI_BUNDLE_SK_BYTES], char *err, size_t cap) FI_WUR;
/* Reads a secret key file; refuses one readable by group or others. */
int fi_bundle_key_load(const char *path, uint8_t sk[FI_BUNDLE_SK_BYTES], char *err, size_t cap) FI_WUR;
/* Reads a public key file (64 hex characters). */
int fi_bundle_pub_load(const char *path, uint8_t pk[FI_BUNDLE_PK_BYTES], char *err, size_t cap) FI_WUR;

/* Builds and signs a bundle. *out is owned by the caller (free()). 0 or -1
 * (bad arguments: version 0, not_after <= not_before; or out of memory). */
int fi_bundle_sign(const uint8_t sk[FI_BUNDLE_SK_BYTES], uint64_t version, int64_t not_before, int64_t not_after,
                   const char *content, size_t len, char **out, size_t *out_len) FI_WUR;

/* Verifies a bundle against the trusted keys, the version held (0: none)
 * and the time now. Checks, in order: format, signature present, signer
 * trusted, signature, digest, version > held_version, not-before, not-after.
 * On FI_BUNDLE_OK, info (may be NULL) describes it. Never allocates. */
fi_bundle_status fi_bundle_verify(const char *buf, size_t len, const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES],
                                  size_t n_trusted, uint64_t held_version, int64_t now, fi_bundle_info *info) FI_WUR;

/* ----------------------------------------------------------- edge side */

/* Installs a bundle into the edge's directory dir (created, mode 0700,
 * when missing; its parent must exist): verifies it (against the
 * version currently held there), checks that its policy validates, then
 * replaces dir/current.bundle atomically (write, fsync, rename) and raises
 * the high-water mark dir/version. On refusal the held bundle stays. err
 * gets a sentence naming what was refused and why. */
fi_bundle_status fi_bundle_install(const char *dir, const char *buf, size_t len,
                                   const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES], size_t n_trusted, int64_t now,
                                   char *err, size_t cap) FI_WUR;

/* Loads the bundle held in dir and its policy, for enforcement. Verifies
 * the signature and digest again, that its version is not below the
 * high-water mark (a file put back from an older bundle is a replay), and
 * the time. On FI_BUNDLE_OK *pol is an owned policy and *version its
 * version. On any other status *pol is NULL and the caller must use
 * fi_policy_fallback() (fail closed). */
fi_bundle_status fi_bundle_load(const char *dir, const uint8_t (*trusted)[FI_BUNDLE_PK_BYTES], size_t n_trusted,
                                int64_t now, fi_policy **pol, uint64_t *version, char *err, size_t cap) FI_WUR;

#ifdef __cplusplus
}
#endif
#endif /* FI_BUNDLE_H */
