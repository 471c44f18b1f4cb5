/*
 * fi_coord_policy.h - the coordinator's own check of the residency policy
 * for every routed request (fi_coord_opts.policy).
 *
 * The origin is the site of the edge's authenticated key (from the store),
 * never anything in the request's body; the target is the cluster of the
 * worker the coordinator picked (the worker's enrolled site name is the
 * cluster's name in the policy). The policy is the newest bundle in the
 * coordinator's store, verified against the trusted policy-signing key:
 * the public key file named by `policy_check_key` in coordinator.conf
 * (normally DB.policy.key.pub, the pair of the coordinator's own signing
 * key), or by the environment variable FEDINFER_COORD_POLICY_KEY, which
 * overrides the file's key. With a key, the check fails closed: no bundle,
 * a bad signature or an expired policy denies every routed request.
 * Without one the check is off and says so once in the log.
 */
#ifndef FI_COORD_POLICY_H
#define FI_COORD_POLICY_H

#include <stddef.h>

#include "fi_coord.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_COORD_POLICY_KEY_ENV "FEDINFER_COORD_POLICY_KEY"

/* Installs the cached check into o (o->policy, o->policy_user: a context
 * over o, which must stay valid as long as the check is used;
 * o->policy_free frees it) unless o->policy is already set or no key is
 * configured; the environment's key, when set, replaces
 * o->policy_check_key. */
void fi_coord_policy_attach(fi_coord_opts *o);

/* The check itself (fi_coord_policy_fn): user is the fi_coord_opts (its
 * db and policy_check_key). 1 to permit; 0 to deny with reason naming the
 * rule. v (may be NULL) gets the score, rules and policy digest. */
int fi_coord_policy_check(void *user, const Fi__InferRequest *req, const fi_peer_rec *origin,
                          const fi_peer_rec *target, fi_coord_verdict *v, char *reason,
                          size_t reasonlen);

/* Whether an operator's pushed bundle may be stored and shipped: signed
 * by the key in policy_check_key, valid now, its policy validating, and
 * newer than every version the store holds (both tables), with the
 * version it is sent under. Without a key configured the coordinator
 * checks nothing (it relays; every edge verifies) and this says yes.
 * 0, or -1 with err naming what is wrong. */
int fi_coord_policy_bundle_ok(const fi_coord_opts *o, uint64_t version, const void *bundle,
                              size_t len, char *err, size_t errlen);

/* The cached check the coordinator installs: same decisions as
 * fi_coord_policy_check, with the verified policy kept until the store has
 * a newer version, the key file changes or the bundle expires. user is a
 * context from fi_coord_policy_ctx_new(o) (o must outlive it), freed with
 * fi_coord_policy_ctx_free. */
typedef struct fi_coord_policy_ctx fi_coord_policy_ctx;
fi_coord_policy_ctx *fi_coord_policy_ctx_new(const fi_coord_opts *o);
void fi_coord_policy_ctx_free(void *ctx);
int fi_coord_policy_check_cached(void *user, const Fi__InferRequest *req,
                                 const fi_peer_rec *origin, const fi_peer_rec *target,
                                 fi_coord_verdict *v, char *reason, size_t reasonlen);

#ifdef __cplusplus
}
#endif
#endif /* FI_COORD_POLICY_H */
