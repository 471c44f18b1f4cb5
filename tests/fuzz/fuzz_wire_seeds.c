/*
 * fuzz_wire_seeds.c - writes the fuzz corpus's seeds: one valid encoded
 * message of every type (and a few invalid ones) into the directory given.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fi_wire.h"

static int s_write(const char *dir, const char *name, const uint8_t *buf, size_t len) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t n = fwrite(buf, 1, len, f);
    return fclose(f) == 0 && n == len ? 0 : -1;
}

static int s_seed(const char *dir, const char *name, fi_msg *m) {
    size_t len = 0;
    uint8_t *buf = fi_wire_encode(m, &len);
    int rc = buf ? s_write(dir, name, buf, len) : -1;
    free(buf);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_wire_seeds DIR\n");
        return 2;
    }
    const char *d = argv[1];
    int rc = 0;
    fi_msg m = FI__ENVELOPE__INIT;
    Fi__ModelOffer mo = FI__MODEL_OFFER__INIT, *mos[1] = {&mo};
    mo.name = (char *)"smol";
    mo.capacity = 4;
    Fi__Hello h = FI__HELLO__INIT;
    h.role = FI__ROLE__ROLE_CLUSTER;
    h.software = (char *)"fedinfer 0.1.0";
    h.n_models = 1;
    h.models = mos;
    h.heartbeat_ms = 1000;
    m.body_case = FI__ENVELOPE__BODY_HELLO, m.hello = &h;
    rc |= s_seed(d, "hello", &m);
    Fi__Heartbeat hb = FI__HEARTBEAT__INIT;
    hb.sent_ms = 123456;
    m.body_case = FI__ENVELOPE__BODY_HEARTBEAT, m.heartbeat = &hb;
    rc |= s_seed(d, "heartbeat", &m);
    Fi__Origin o = FI__ORIGIN__INIT;
    o.site = (char *)"clinic-7";
    o.region = (char *)"eu-west";
    char *labels[2] = {(char *)"phi", (char *)"pii"};
    Fi__InferRequest ir = FI__INFER_REQUEST__INIT;
    ir.request_id = (char *)"r1";
    ir.model = (char *)"smol";
    ir.prompt = (char *)"What is the capital of France?";
    ir.n_labels = 2;
    ir.labels = labels;
    ir.origin = &o;
    ir.max_tokens = 64;
    ir.temperature = 0.7f;
    ir.seed = 42;
    m.body_case = FI__ENVELOPE__BODY_INFER, m.infer = &ir;
    rc |= s_seed(d, "infer", &m);
    Fi__TokenChunk ch = FI__TOKEN_CHUNK__INIT;
    ch.request_id = (char *)"r1";
    ch.index = 3;
    ch.text = (char *)"Paris";
    m.body_case = FI__ENVELOPE__BODY_CHUNK, m.chunk = &ch;
    rc |= s_seed(d, "chunk", &m);
    Fi__FinalResult fr = FI__FINAL_RESULT__INIT;
    fr.request_id = (char *)"r1";
    fr.n_prompt = 12;
    fr.n_generated = 5;
    fr.stop_reason = (char *)"eog";
    fr.prefill_ms = 10;
    fr.decode_ms = 40;
    m.body_case = FI__ENVELOPE__BODY_FINAL, m.final = &fr;
    rc |= s_seed(d, "final", &m);
    Fi__Error e = FI__ERROR__INIT;
    e.request_id = (char *)"r1";
    e.code = FI__ERROR_CODE__ERR_NO_WORKER;
    e.message = (char *)"no live worker";
    m.body_case = FI__ENVELOPE__BODY_ERROR, m.error = &e;
    rc |= s_seed(d, "error", &m);
    Fi__PolicyBundle pb = FI__POLICY_BUNDLE__INIT;
    pb.version = 7;
    pb.bundle.data = (uint8_t *)"signed";
    pb.bundle.len = 6;
    m.body_case = FI__ENVELOPE__BODY_POLICY_BUNDLE, m.policy_bundle = &pb;
    rc |= s_seed(d, "policy_bundle", &m);
    Fi__AuditUpload au = FI__AUDIT_UPLOAD__INIT;
    au.batch_id = (char *)"b1";
    au.first_seq = 1;
    au.count = 2;
    au.batch.data = (uint8_t *)"chain";
    au.batch.len = 5;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_UPLOAD, m.audit_upload = &au;
    rc |= s_seed(d, "audit_upload", &m);
    Fi__Ack ack = FI__ACK__INIT;
    ack.ref = (char *)"b1";
    m.body_case = FI__ENVELOPE__BODY_ACK, m.ack = &ack;
    rc |= s_seed(d, "ack", &m);
    Fi__Enrol en = FI__ENROL__INIT;
    en.token = (char *)"fit_0123456789abcdef0123456789abcdef01234567";
    en.role = FI__ROLE__ROLE_EDGE;
    en.site = (char *)"clinic-7";
    en.region = (char *)"eu-west";
    m.body_case = FI__ENVELOPE__BODY_ENROL, m.enrol = &en;
    rc |= s_seed(d, "enrol", &m);
    Fi__EnrolReply er = FI__ENROL_REPLY__INIT;
    er.fingerprint = (char *)"00112233445566778899aabbccddeeff";
    er.role = FI__ROLE__ROLE_EDGE;
    er.site = (char *)"clinic-7";
    er.region = (char *)"eu-west";
    m.body_case = FI__ENVELOPE__BODY_ENROL_REPLY, m.enrol_reply = &er;
    rc |= s_seed(d, "enrol_reply", &m);
    Fi__StatusRequest sq = FI__STATUS_REQUEST__INIT;
    m.body_case = FI__ENVELOPE__BODY_STATUS_REQUEST, m.status_request = &sq;
    rc |= s_seed(d, "status_request", &m);
    Fi__PeerStatus ps = FI__PEER_STATUS__INIT, *pss[1] = {&ps};
    ps.fingerprint = (char *)"00112233445566778899aabbccddeeff";
    ps.role = FI__ROLE__ROLE_CLUSTER;
    ps.site = (char *)"core1";
    ps.region = (char *)"eu-west";
    ps.connected = 1;
    ps.n_models = 1;
    ps.models = mos;
    Fi__StatusReply sr = FI__STATUS_REPLY__INIT;
    sr.n_peers = 1;
    sr.peers = pss;
    m.body_case = FI__ENVELOPE__BODY_STATUS_REPLY, m.status_reply = &sr;
    rc |= s_seed(d, "status_reply", &m);
    Fi__TokenRequest tq = FI__TOKEN_REQUEST__INIT;
    tq.role = FI__ROLE__ROLE_EDGE;
    tq.site = (char *)"clinic-7";
    tq.region = (char *)"eu-west";
    tq.ttl_s = 3600;
    m.body_case = FI__ENVELOPE__BODY_TOKEN_REQUEST, m.token_request = &tq;
    rc |= s_seed(d, "token_request", &m);
    Fi__TokenReply tr = FI__TOKEN_REPLY__INIT;
    tr.token = (char *)"fit_0123456789abcdef0123456789abcdef01234567";
    tr.expires_unix = 1800000000;
    m.body_case = FI__ENVELOPE__BODY_TOKEN_REPLY, m.token_reply = &tr;
    rc |= s_seed(d, "token_reply", &m);
    Fi__RevokeRequest rr = FI__REVOKE_REQUEST__INIT;
    rr.fingerprint = (char *)"00112233445566778899aabbccddeeff";
    m.body_case = FI__ENVELOPE__BODY_REVOKE_REQUEST, m.revoke_request = &rr;
    rc |= s_seed(d, "revoke_request", &m);
    Fi__Cancel cn = FI__CANCEL__INIT;
    cn.request_id = (char *)"r1";
    m.body_case = FI__ENVELOPE__BODY_CANCEL, m.cancel = &cn;
    rc |= s_seed(d, "cancel", &m);
    /* Invalid on purpose: version 2, an unknown body (field 99), garbage. */
    const uint8_t v2[] = {0x08, 0x02, 0x5a, 0x00};
    const uint8_t unknown[] = {0x08, 0x01, 0x9a, 0x06, 0x00};
    const uint8_t garbage[] = {0xff, 0xff, 0xff, 0xff, 0x0f};
    rc |= s_write(d, "bad_version", v2, sizeof v2);
    rc |= s_write(d, "unknown_type", unknown, sizeof unknown);
    rc |= s_write(d, "garbage", garbage, sizeof garbage);
    if (rc) fprintf(stderr, "fuzz_wire_seeds: could not write every seed to %s\n", d);
    return rc ? 1 : 0;
}
