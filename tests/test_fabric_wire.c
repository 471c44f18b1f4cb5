/*
 * test_fabric_wire.c - the wire codec: every message type round-trips;
 * malformed, oversized, unknown-type and wrong-version input is refused
 * with the right error code.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "fi_wire.h"

static fi_msg *s_roundtrip(fi_msg *m) {
    size_t len = 0;
    uint8_t *buf = fi_wire_encode(m, &len);
    assert_non_null(buf);
    Fi__ErrorCode code = FI__ERROR_CODE__ERR_UNSPECIFIED;
    char err[256];
    fi_msg *out = fi_wire_decode(buf, len, 0, &code, err, sizeof err);
    free(buf);
    assert_non_null(out);
    assert_int_equal(out->version, FI_WIRE_VERSION);
    assert_int_equal(out->body_case, m->body_case);
    return out;
}

static void test_every_type_roundtrips(void **state) {
    (void)state;
    fi_msg m = FI__ENVELOPE__INIT, *r;
    char *labels[2] = {(char *)"phi", (char *)"pii"};
    Fi__Origin o = FI__ORIGIN__INIT;
    o.site = (char *)"s";
    o.region = (char *)"r";
    Fi__InferRequest ir = FI__INFER_REQUEST__INIT;
    ir.request_id = (char *)"r1";
    ir.model = (char *)"smol";
    ir.prompt = (char *)"hi";
    ir.n_labels = 2;
    ir.labels = labels;
    ir.origin = &o;
    ir.max_tokens = 9;
    m.body_case = FI__ENVELOPE__BODY_INFER, m.infer = &ir;
    r = s_roundtrip(&m);
    assert_string_equal(r->infer->prompt, "hi");
    assert_int_equal(r->infer->n_labels, 2);
    assert_string_equal(r->infer->labels[1], "pii");
    assert_string_equal(r->infer->origin->region, "r");
    assert_int_equal(r->infer->max_tokens, 9);
    fi_wire_free(&r);
    assert_null(r);

    Fi__Hello h = FI__HELLO__INIT;
    h.role = FI__ROLE__ROLE_CLUSTER;
    m.body_case = FI__ENVELOPE__BODY_HELLO, m.hello = &h;
    r = s_roundtrip(&m);
    assert_int_equal(r->hello->role, FI__ROLE__ROLE_CLUSTER);
    fi_wire_free(&r);
    Fi__Heartbeat hb = FI__HEARTBEAT__INIT;
    m.body_case = FI__ENVELOPE__BODY_HEARTBEAT, m.heartbeat = &hb;
    fi_wire_free((r = s_roundtrip(&m), &r));
    Fi__TokenChunk ch = FI__TOKEN_CHUNK__INIT;
    ch.request_id = (char *)"r1", ch.text = (char *)"tok", ch.index = 4;
    m.body_case = FI__ENVELOPE__BODY_CHUNK, m.chunk = &ch;
    r = s_roundtrip(&m);
    assert_string_equal(r->chunk->text, "tok");
    assert_int_equal(r->chunk->index, 4);
    fi_wire_free(&r);
    Fi__FinalResult fr = FI__FINAL_RESULT__INIT;
    fr.request_id = (char *)"r1", fr.stop_reason = (char *)"eog", fr.n_generated = 3;
    m.body_case = FI__ENVELOPE__BODY_FINAL, m.final = &fr;
    fi_wire_free((r = s_roundtrip(&m), &r));
    size_t len = 0;
    uint8_t *eb = fi_wire_error("r9", FI__ERROR_CODE__ERR_BUSY, "full", &len);
    Fi__ErrorCode code;
    char err[128];
    r = fi_wire_decode(eb, len, 0, &code, err, sizeof err);
    free(eb);
    assert_non_null(r);
    assert_int_equal(r->error->code, FI__ERROR_CODE__ERR_BUSY);
    assert_string_equal(r->error->message, "full");
    fi_wire_free(&r);
    Fi__PolicyBundle pb = FI__POLICY_BUNDLE__INIT;
    uint8_t blob[3] = {0, 1, 2};
    pb.version = 3, pb.bundle.data = blob, pb.bundle.len = 3;
    m.body_case = FI__ENVELOPE__BODY_POLICY_BUNDLE, m.policy_bundle = &pb;
    r = s_roundtrip(&m);
    assert_int_equal(r->policy_bundle->bundle.len, 3);
    assert_memory_equal(r->policy_bundle->bundle.data, blob, 3);
    fi_wire_free(&r);
    Fi__AuditUpload au = FI__AUDIT_UPLOAD__INIT;
    au.batch_id = (char *)"b", au.batch.data = blob, au.batch.len = 3;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_UPLOAD, m.audit_upload = &au;
    fi_wire_free((r = s_roundtrip(&m), &r));
    Fi__Enrol en = FI__ENROL__INIT;
    en.token = (char *)"t";
    m.body_case = FI__ENVELOPE__BODY_ENROL, m.enrol = &en;
    fi_wire_free((r = s_roundtrip(&m), &r));
    Fi__Cancel cn = FI__CANCEL__INIT;
    cn.request_id = (char *)"r1";
    m.body_case = FI__ENVELOPE__BODY_CANCEL, m.cancel = &cn;
    fi_wire_free((r = s_roundtrip(&m), &r));
    Fi__StatusRequest sq = FI__STATUS_REQUEST__INIT;
    m.body_case = FI__ENVELOPE__BODY_STATUS_REQUEST, m.status_request = &sq;
    fi_wire_free((r = s_roundtrip(&m), &r));
    fi_wire_free(&r); /* twice is safe */
}

static void test_refusals(void **state) {
    (void)state;
    Fi__ErrorCode code;
    char err[256];
    /* garbage: a length that runs past the end */
    const uint8_t garbage[] = {0x5a, 0x7f, 0x01};
    assert_null(fi_wire_decode(garbage, sizeof garbage, 0, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_MALFORMED);
    /* version 2 */
    const uint8_t v2[] = {0x08, 0x02, 0x5a, 0x00};
    assert_null(fi_wire_decode(v2, sizeof v2, 0, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_BAD_VERSION);
    assert_non_null(strstr(err, "version 2"));
    /* version 0 (absent) is refused too */
    const uint8_t v0[] = {0x5a, 0x00};
    assert_null(fi_wire_decode(v0, sizeof v0, 0, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_BAD_VERSION);
    /* a body field this build does not know (99): an unknown type, told
     * apart from other unknown fields */
    const uint8_t unknown[] = {0x08, 0x01, 0x9a, 0x06, 0x00};
    assert_null(fi_wire_decode(unknown, sizeof unknown, 0, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_UNKNOWN_TYPE);
    /* field number 0 inside a body (found by the fuzzer: protobuf-c keeps
     * it and would re-send it) */
    const uint8_t field0[] = {0x08, 0x01, 0x82, 0x01, 0x02, 0x08, 0x01, 0x82, 0x00, 0x00, 0x10, 0x00};
    assert_null(fi_wire_decode(field0, sizeof field0, 0, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_MALFORMED);
    /* an unknown field inside a known body */
    const uint8_t extra[] = {0x08, 0x01, 0x5a, 0x03, 0xf8, 0x01, 0x01};
    assert_null(fi_wire_decode(extra, sizeof extra, 0, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_MALFORMED);
    /* no body at all */
    const uint8_t none[] = {0x08, 0x01};
    assert_null(fi_wire_decode(none, sizeof none, 0, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_UNKNOWN_TYPE);
    /* empty */
    assert_null(fi_wire_decode("", 0, 0, &code, err, sizeof err));
    /* too large for the given limit, and for the hard limit */
    size_t len = 0;
    uint8_t *hb = fi_wire_heartbeat(1, &len);
    assert_null(fi_wire_decode(hb, len, len - 1, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_TOO_LARGE);
    free(hb);
    uint8_t *big = calloc(1, FI_WIRE_MAX_MSG + 1);
    assert_null(fi_wire_decode(big, FI_WIRE_MAX_MSG + 1, 0, &code, err, sizeof err));
    assert_int_equal(code, FI__ERROR_CODE__ERR_TOO_LARGE);
    free(big);
    /* encoding refuses to build an oversized message */
    char *huge = malloc(FI_WIRE_MAX_MSG + 16);
    memset(huge, 'a', FI_WIRE_MAX_MSG + 15);
    huge[FI_WIRE_MAX_MSG + 15] = 0;
    Fi__TokenChunk ch = FI__TOKEN_CHUNK__INIT;
    ch.text = huge;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_CHUNK, m.chunk = &ch;
    assert_null(fi_wire_encode(&m, &len));
    free(huge);
    /* truncations of a valid message never crash */
    Fi__InferRequest ir = FI__INFER_REQUEST__INIT;
    ir.request_id = (char *)"r1", ir.model = (char *)"m", ir.prompt = (char *)"hello there";
    m.body_case = FI__ENVELOPE__BODY_INFER, m.infer = &ir;
    uint8_t *ok = fi_wire_encode(&m, &len);
    for (size_t n = 0; n < len; n++) {
        fi_msg *r = fi_wire_decode(ok, n, 0, &code, err, sizeof err);
        fi_wire_free(&r);
    }
    free(ok);
}

/* fi_wire_chunk: the text is taken by length (not NUL-terminated), and
 * comes back whole with its request and index. */
static void test_chunk(void **state) {
    (void)state;
    const char text[] = "hello, world";
    size_t len = 0;
    uint8_t *buf = fi_wire_chunk("req-7", 42, text, 5, &len);
    assert_non_null(buf);
    Fi__ErrorCode code;
    char err[128];
    fi_msg *m = fi_wire_decode(buf, len, 0, &code, err, sizeof err);
    free(buf);
    assert_non_null(m);
    assert_int_equal(m->body_case, FI__ENVELOPE__BODY_CHUNK);
    assert_string_equal(m->chunk->request_id, "req-7");
    assert_int_equal(m->chunk->index, 42);
    assert_string_equal(m->chunk->text, "hello");
    fi_wire_free(&m);
}

static void test_names(void **state) {
    (void)state;
    assert_string_equal(fi_wire_type_name(FI__ENVELOPE__BODY_INFER), "infer");
    assert_string_equal(fi_wire_error_name(FI__ERROR_CODE__ERR_PEER_DEAD), "peer_dead");
    assert_int_equal(fi_wire_role_parse("cluster"), FI__ROLE__ROLE_CLUSTER);
    assert_int_equal(fi_wire_role_parse("root"), FI__ROLE__ROLE_UNSPECIFIED);
    assert_string_equal(fi_wire_role_name(FI__ROLE__ROLE_OPERATOR), "operator");
}

/* The routed prefix-cache tenant: unambiguous, and refused when a name
 * is too long rather than cut (two long names would then meet). */
static void test_cache_tenant(void **state) {
    (void)state;
    char a[FI_WIRE_CACHE_TENANT_MAX], b[FI_WIRE_CACHE_TENANT_MAX];
    assert_int_equal(fi_wire_cache_tenant("ab", "c/d", a), 0);
    assert_string_equal(a, "2:ab/c/d");
    assert_int_equal(fi_wire_cache_tenant("ab/c", "d", b), 0);
    assert_string_equal(b, "4:ab/c/d");
    assert_int_equal(fi_wire_cache_tenant("site", NULL, a), 0);
    assert_string_equal(a, "4:site/");
    char n63[64], n64[65];
    memset(n63, 'x', 63), n63[63] = '\0';
    memset(n64, 'x', 64), n64[64] = '\0';
    assert_int_equal(fi_wire_cache_tenant(n63, n63, a), 0);
    assert_int_equal(strlen(a), 3 + 63 + 1 + 63);
    assert_int_equal(fi_wire_cache_tenant(n64, "t", a), -1);
    assert_string_equal(a, "");
    assert_int_equal(fi_wire_cache_tenant("s", n64, a), -1);
}

/* The enrolment token an Enrol or a TokenReply carries is a secret: the
 * codec says so (the receiver wipes the frame too) and wipes it before
 * the message's memory is freed; other messages carry none. */
static void test_secrets_wiped(void **state) {
    (void)state;
    Fi__Enrol en = FI__ENROL__INIT;
    en.token = "fit_0123456789abcdef0123456789abcdef01234567";
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_ENROL;
    m.enrol = &en;
    fi_msg *d = s_roundtrip(&m);
    assert_true(fi_wire_has_secret(d));
    size_t n = strlen(d->enrol->token);
    assert_int_equal(n, strlen(en.token));
    fi_wire_wipe_secret(d);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(d->enrol->token[i], 0);
    fi_wire_free(&d);

    Fi__TokenReply tr = FI__TOKEN_REPLY__INIT;
    tr.token = "fit_secret";
    m.body_case = FI__ENVELOPE__BODY_TOKEN_REPLY;
    m.token_reply = &tr;
    d = s_roundtrip(&m);
    assert_true(fi_wire_has_secret(d));
    fi_wire_wipe_secret(d);
    assert_int_equal(d->token_reply->token[0], 0);
    assert_false(fi_wire_has_secret(d)); /* nothing left to wipe */
    fi_wire_free(&d);

    Fi__Enrol none = FI__ENROL__INIT; /* no token: protobuf-c's shared "" */
    m.body_case = FI__ENVELOPE__BODY_ENROL;
    m.enrol = &none;
    d = s_roundtrip(&m);
    assert_false(fi_wire_has_secret(d));
    fi_wire_free(&d);
    Fi__StatusRequest sr = FI__STATUS_REQUEST__INIT;
    m.body_case = FI__ENVELOPE__BODY_STATUS_REQUEST;
    m.status_request = &sr;
    d = s_roundtrip(&m);
    assert_false(fi_wire_has_secret(d));
    fi_wire_free(&d);
}

/* A message that decodes into far more than its size (400,000 empty
 * repeated sub-messages: two bytes each on the wire, a struct each
 * decoded, some 60 MB from 800 KB) is refused as malformed, within its
 * decoding budget, instead of taking the memory and the time (a tenth of
 * a second each, on a coordinator's only thread). A real message of the
 * same size still decodes. */
static void test_expansion_refused(void **state) {
    (void)state;
    enum { N = 400000 };
    Fi__AuditRecord empty = FI__AUDIT_RECORD__INIT;
    Fi__AuditRecord **recs = malloc(N * sizeof *recs);
    assert_non_null(recs);
    for (int i = 0; i < N; i++) recs[i] = &empty;
    Fi__AuditRecords ar = FI__AUDIT_RECORDS__INIT;
    ar.records = recs;
    ar.n_records = N;
    fi_msg m = FI__ENVELOPE__INIT;
    m.body_case = FI__ENVELOPE__BODY_AUDIT_RECORDS;
    m.audit_records = &ar;
    size_t len = 0;
    uint8_t *buf = fi_wire_encode(&m, &len);
    assert_non_null(buf);
    assert_true(len < FI_WIRE_MAX_MSG);
    Fi__ErrorCode code = FI__ERROR_CODE__ERR_UNSPECIFIED;
    char err[256];
    fi_msg *out = fi_wire_decode(buf, len, 0, &code, err, sizeof err);
    if (out) fail_msg("a message of %zu bytes that expands about a hundredfold was decoded", len);
    assert_int_equal(code, FI__ERROR_CODE__ERR_MALFORMED);
    print_message("%s\n", err);
    assert_non_null(strstr(err, "decoded"));
    free(buf);
    /* 1,000 records with their strings (about 900 KB): decoded */
    Fi__AuditRecord full = FI__AUDIT_RECORD__INIT;
    char text[300];
    memset(text, 'x', sizeof text - 1);
    text[sizeof text - 1] = 0;
    full.request_id = full.rules = full.labels = text;
    ar.n_records = 1000;
    for (int i = 0; i < 1000; i++) recs[i] = &full;
    buf = fi_wire_encode(&m, &len);
    assert_non_null(buf);
    out = fi_wire_decode(buf, len, 0, &code, err, sizeof err);
    if (!out) fail_msg("a real message of %zu bytes: %s", len, err);
    assert_int_equal(out->audit_records->n_records, 1000);
    fi_wire_free(&out);
    free(buf);
    free(recs);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_type_roundtrips),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_chunk),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_cache_tenant),
        cmocka_unit_test(test_expansion_refused),
        cmocka_unit_test(test_secrets_wiped),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
