/*
 * fi_wire.h - the fabric's wire protocol: one protobuf-c Envelope
 * (fi_fabric.proto) per ZeroMQ frame, with a protocol version in each.
 *
 * Decoding is the one place where bytes from the network become structs:
 * it checks the size limit, the schema, the version and that the body is a
 * type this build knows, in that order, and on failure gives the error
 * code to answer with. It never aborts on any input (fuzzed:
 * tests/fuzz/fuzz_wire.c).
 */
#ifndef FI_WIRE_H
#define FI_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "fi_fabric.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define FI_WIRE_MUST_CHECK __attribute__((warn_unused_result))
#else
#define FI_WIRE_MUST_CHECK
#endif

/* The protocol version this build speaks (Envelope.version). */
#define FI_WIRE_VERSION 1u
/* Default and hard upper bound of one message, bytes. Sockets are given
 * the same bound as ZMQ_MAXMSGSIZE, so larger frames never reach us. */
#define FI_WIRE_MAX_MSG (1u << 20)
/* What decoding a message may allocate, at most: FI_WIRE_EXPAND times its
 * size plus FI_WIRE_EXPAND_SLACK. Real messages take a few times their
 * size; a message of empty repeated sub-messages (two bytes each on the
 * wire, a struct of a hundred and more decoded) would take a hundred
 * times, and seconds of a coordinator's only thread. */
#define FI_WIRE_EXPAND 16u
#define FI_WIRE_EXPAND_SLACK (64u * 1024u)
/* The size limit of the coordinator's enrolment endpoint, which anyone
 * with a key may reach: an Enrol message is a few hundred bytes. */
#define FI_WIRE_MAX_ENROL (16u * 1024u)
/* What CURVE adds to a message on the socket (its frame's box and
 * nonce): the sockets' own size limit is the message limit plus this, so
 * that every message the codec accepts also passes the socket. */
#define FI_WIRE_CURVE_SLACK 256u
/* Longest request id we take, bytes. */
#define FI_WIRE_MAX_ID 64
#define FI_WIRE_MAX_BIAS 300 /* logit_bias entries of an InferRequest (FI_SAMPLER_MAX_BIAS) */
/* Policy shipping: longest policy text in PolicyApply (so that a
 * PolicyContent with the text and its signed bundle fits one message),
 * comment, and filter string of an AuditQuery, bytes. */
#define FI_WIRE_MAX_POLICY (448u * 1024u)
#define FI_WIRE_MAX_COMMENT 500
#define FI_WIRE_MAX_FILTER 256
/* ClusterLoad rows of one Heartbeat at most: the coordinator sends no
 * more (and sets clusters_truncated when there are), a client keeps no
 * more. 4096 rows of the longest names (63 bytes) encode in under 700
 * KiB, within FI_WIRE_MAX_MSG (checked in fi_coord.c). */
#define FI_WIRE_MAX_LOAD_ROWS 4096

typedef Fi__Envelope fi_msg;
typedef Fi__Envelope__BodyCase fi_msg_type;

/* Decodes one message of len bytes. Returns the message, owned by the
 * caller (fi_wire_free), or NULL with *code set to the error to answer
 * with (FI__ERROR_CODE__ERR_MALFORMED, _TOO_LARGE, _BAD_VERSION,
 * _UNKNOWN_TYPE) and a message in err naming what is wrong. max: the size
 * limit, 0 for FI_WIRE_MAX_MSG. A message that would allocate more than
 * FI_WIRE_EXPAND times its size decoded is refused as malformed, before
 * it has. */
fi_msg *fi_wire_decode(const void *buf, size_t len, size_t max, Fi__ErrorCode *code, char *err,
                       size_t errlen);
/* Frees a decoded message and sets *m to NULL; safe on NULL. The secret a
 * message can carry (an enrolment token: Enrol, TokenReply) is wiped
 * first (sodium_memzero). */
void fi_wire_free(fi_msg **m);
/* Whether m carries a secret (see fi_wire_free): the frame it was decoded
 * from is to be wiped too. */
int fi_wire_has_secret(const fi_msg *m);
/* Wipes the secret m carries, if any (what fi_wire_free does first). */
void fi_wire_wipe_secret(fi_msg *m);

/* Encodes m (version is forced to FI_WIRE_VERSION). Returns a malloc'd
 * buffer the caller frees and its size in *len, or NULL when out of memory
 * or when the result would exceed FI_WIRE_MAX_MSG. */
FI_WIRE_MUST_CHECK uint8_t *fi_wire_encode(const fi_msg *m, size_t *len);

/* Short name of a body type ("infer", "chunk", ...), "none" for NOT_SET,
 * "unknown" otherwise. */
const char *fi_wire_type_name(fi_msg_type t);
/* Short name of an error code ("malformed", ...). */
const char *fi_wire_error_name(Fi__ErrorCode c);
/* "edge", "cluster", "operator", "coordinator" or "unspecified". */
const char *fi_wire_role_name(Fi__Role r);
/* The role named s, or FI__ROLE__ROLE_UNSPECIFIED. */
Fi__Role fi_wire_role_parse(const char *s);

/* Encoders for the small messages every module answers with. Each returns
 * a malloc'd buffer and its size, or NULL when out of memory. */
uint8_t *fi_wire_error(const char *request_id, Fi__ErrorCode code, const char *message, size_t *len);
uint8_t *fi_wire_heartbeat(uint64_t sent_ms, size_t *len);
uint8_t *fi_wire_ack(const char *ref, size_t *len);
/* A TokenChunk of request_id: piece `index` of the reply, text[0..n) (not
 * NUL-terminated; copied). */
uint8_t *fi_wire_chunk(const char *request_id, uint32_t index, const char *text, size_t n,
                       size_t *len);

/* The tenant a worker salts its prefix cache with for a routed request
 * (fi_sched_req.tenant): the origin site, from the edge's key, and the
 * tenant the edge named, as "<bytes of site>:<site>/<tenant>". The
 * coordinator forwards this instead of the edge's tenant, so that two
 * sites never share cached state, even under one tenant name; the edge
 * hashes its prompts (fi_prefix_hashes) with the same. 0, or -1 when a
 * name is longer than FI_WIRE_MAX_NAME bytes (out is then ""). */
#define FI_WIRE_MAX_NAME 63
#define FI_WIRE_CACHE_TENANT_MAX (2 * FI_WIRE_MAX_NAME + 8)
int fi_wire_cache_tenant(const char *site, const char *tenant, char out[FI_WIRE_CACHE_TENANT_MAX]);

/* Monotonic clock, milliseconds. */
uint64_t fi_wire_now_ms(void);

#ifdef __cplusplus
}
#endif
#endif /* FI_WIRE_H */
