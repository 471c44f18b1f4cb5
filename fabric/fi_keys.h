/*
 * fi_keys.h - the fabric's one crypto module: Curve25519 key pairs for
 * ZeroMQ CURVE, their files, fingerprints, random tokens and wiping.
 *
 * Key files are text. A secret key file holds both halves and must not be
 * readable by group or others (mode 0600 or stricter); loading refuses it
 * otherwise. A public key file holds the public half only:
 *
 *   # fedinfer CURVE secret key (keep private)
 *   public = <40 Z85 characters>
 *   secret = <40 Z85 characters>
 */
#ifndef FI_KEYS_H
#define FI_KEYS_H

#include <stddef.h>
#include <stdint.h>

#include "fi_wire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_KEYS_BYTES 32        /* Curve25519 key, either half */
#define FI_KEYS_Z85_LEN 41      /* 40 Z85 characters and a NUL */
#define FI_KEYS_FPR_LEN 33      /* 32 hex characters and a NUL */
#define FI_KEYS_TOKEN_LEN 45    /* enrolment token: "fit_" + 40 hex, NUL */

typedef struct fi_keypair {
    uint8_t pub[FI_KEYS_BYTES]; /* public half */
    uint8_t sec[FI_KEYS_BYTES]; /* secret half: wipe with fi_keys_wipe */
} fi_keypair;

/* Fills kp with a fresh key pair. Returns 0, or -1 when libsodium cannot
 * initialise. */
FI_WIRE_MUST_CHECK int fi_keys_generate(fi_keypair *kp);
/* Writes the secret file (mode 0600, created exclusively unless force) and
 * the public file (0644). Returns 0, or -1 with a message in err. */
FI_WIRE_MUST_CHECK int fi_keys_save(const fi_keypair *kp, const char *sec_path,
                                    const char *pub_path, int force, char *err, size_t errlen);
/* Loads a secret key file; refuses a file readable or writable by group or
 * others, and one whose public half does not match its secret. Returns 0,
 * or -1 with a message in err (kp is wiped). */
FI_WIRE_MUST_CHECK int fi_keys_load_secret(const char *path, fi_keypair *kp, char *err,
                                           size_t errlen);
/* Loads the public key from a public or a secret key file. */
FI_WIRE_MUST_CHECK int fi_keys_load_public(const char *path, uint8_t pub[FI_KEYS_BYTES],
                                           char *err, size_t errlen);
void fi_keys_wipe(fi_keypair *kp);

/* Z85 text of a key (out: FI_KEYS_Z85_LEN bytes). */
void fi_keys_to_z85(const uint8_t key[FI_KEYS_BYTES], char out[FI_KEYS_Z85_LEN]);
/* Parses 40 Z85 characters; 0, or -1 when s is not a key. */
FI_WIRE_MUST_CHECK int fi_keys_from_z85(const char *s, uint8_t key[FI_KEYS_BYTES]);
/* Fingerprint of a public key: the first 16 bytes of its BLAKE2b hash in
 * hex. What logs and fedctl show instead of the key. */
void fi_keys_fingerprint(const uint8_t pub[FI_KEYS_BYTES], char out[FI_KEYS_FPR_LEN]);
/* A fresh one-time enrolment token ("fit_" and 40 hex characters). */
FI_WIRE_MUST_CHECK int fi_keys_token(char out[FI_KEYS_TOKEN_LEN]);
/* The hash under which a token is stored (hex, 64 characters + NUL): the
 * database never holds a usable token. */
void fi_keys_token_hash(const char *token, char out[65]);

#ifdef __cplusplus
}
#endif
#endif /* FI_KEYS_H */
