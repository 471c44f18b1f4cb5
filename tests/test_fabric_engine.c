/*
 * test_fabric_engine.c - a request through the fabric served by the real
 * engine: edge -> coordinator -> shard worker (engine backend, the default
 * model, one continuous-batching scheduler) -> tokens streamed back; three
 * requests at once batched and each equal to its one-at-a-time answer; a
 * repeated prompt taken from the prefix cache; a client that leaves
 * cancels at the scheduler; a backend that fails for good replaced at
 * once. Skipped when the model file is missing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "fabric/harness.h"
#include "edge_impl.h"
#include "fault_backend.h"
#include "model_copy.h"

typedef struct s_engine_worker {
    const harness *h;     /* whose coordinator */
    fi_keypair kp;        /* enrolled as a cluster */
    fi_shard_backend be;  /* the engine */
    pthread_t th;         /* serving thread */
    atomic_int stop;      /* stops it */
} s_engine_worker;

static void *s_serve(void *arg) {
    s_engine_worker *w = arg;
    fi_client_opts o;
    char err[256];
    h_client_opts(w->h, &o, &w->kp, FI__ROLE__ROLE_CLUSTER);
    o.n_models = 1;
    snprintf(o.models[0], sizeof o.models[0], "smollm2");
    o.capacity[0] = 4;
    fi_client *c = fi_client_new(&o, err, sizeof err);
    if (c && fi_shard_serve(c, &w->be, 4, &w->stop, err, sizeof err) != 0)
        fprintf(stderr, "engine worker: %s\n", err);
    fi_client_destroy(&c);
    return NULL;
}

typedef struct s_stop_after {
    int calls; /* pieces seen */
} s_stop_after;

static int s_stop_after_3(void *user, const char *t, size_t n) {
    s_stop_after *sa = user;
    (void)t, (void)n;
    return ++sa->calls >= 3;
}

/* Starts w (the engine of conf, enrolled as cluster core1, serving in its
 * thread) on h's coordinator, and returns an enrolled edge's client. */
static fi_client *s_worker_and_edge(harness *h, const fi_shard_conf *conf, s_engine_worker *w) {
    char err[512];
    memset(w, 0, sizeof *w);
    w->h = h;
    assert_int_equal(fi_shard_engine_backend(conf, &w->be, err, sizeof err), 0);
    assert_int_equal(fi_keys_generate(&w->kp), 0);
    assert_int_equal(h_enrol_direct(h, &w->kp, FI__ROLE__ROLE_CLUSTER, "core1", "eu-west"), 0);
    assert_int_equal(pthread_create(&w->th, NULL, s_serve, w), 0);
    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(h, &ek, FI__ROLE__ROLE_EDGE, "clinic-7", "eu-west"), 0);
    fi_client *edge = h_client(h, &ek, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    return edge;
}

static void test_engine_through_fabric(void **state) {
    (void)state;
    if (access(FI_TEST_MODEL, R_OK) != 0) {
        print_message("skipped: model %s not found\n", FI_TEST_MODEL);
        skip();
    }
    harness h;
    assert_int_equal(h_init(&h), 0);
    /* Batches of the real model on 2 cores (20 times slower under the
     * sanitizers) can starve the test's threads for a while: liveness of
     * 5 s, not the harness's 0.5 s. */
    h.liveness = 50;
    assert_int_equal(h_start(&h), 0);
    fi_shard_conf conf;
    fi_shard_conf_default(&conf);
    snprintf(conf.model, sizeof conf.model, "%s", FI_TEST_MODEL);
    conf.n_ctx = 512;
    conf.max_tokens = 64;
    conf.threads = 1;
    char err[512];
    s_engine_worker w;
    fi_client *edge = s_worker_and_edge(&h, &conf, &w);
    h_text t;
    fi_client_result res;
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)"e1";
    rq.model = (char *)"smollm2";
    rq.prompt = (char *)"What is the capital of France? Answer in one word.";
    rq.max_tokens = 16;
    rq.temperature = 0; /* greedy */
    rq.tenant = (char *)"oncology"; /* the prefix cache's salt, with the zone: */
    rq.zone = (char *)"EU"; /* which the coordinator (no policy here) forwards */
    int rc = -1;
    for (int i = 0; i < 50 && rc != 0; i++) { /* until the worker has said Hello */
        memset(&t, 0, sizeof t);
        rc = fi_client_infer(edge, &rq, h_on_text, &t, 60000, &res, err, sizeof err);
        if (rc == 0 && res.error == FI__ERROR_CODE__ERR_NO_WORKER) {
            rc = -1;
            h_sleep_ms(100);
        }
    }
    assert_int_equal(rc, 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_UNSPECIFIED);
    print_message("engine via fabric: %u prompt tokens, %u generated (%s): \"%s\"\n", res.n_prompt,
                  res.n_generated, res.stop_reason, t.buf);
    assert_true(res.n_generated > 0);
    assert_true(t.len > 0);
    h_text first = t;
    uint32_t first_n = res.n_generated;

    /* Three requests at once share forward passes, and each is still
     * exactly its one-at-a-time greedy answer. */
    static const char *qs[3] = {"Name a colour.", "Name a fruit.", "Name a planet."};
    char ids[3][8];
    h_text tx[3];
    int done[3] = {0, 0, 0}, n_gen[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) {
        Fi__InferRequest q = FI__INFER_REQUEST__INIT;
        snprintf(ids[i], sizeof ids[i], "b%d", i);
        q.request_id = ids[i];
        q.model = (char *)"smollm2";
        q.prompt = (char *)qs[i];
        q.max_tokens = 12;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_INFER;
        m.infer = &q;
        assert_int_equal(fi_client_send(edge, &m), 0);
        memset(&tx[i], 0, sizeof tx[i]);
    }
    uint64_t t0 = fi_wire_now_ms();
    while ((done[0] + done[1] + done[2]) < 3 && fi_wire_now_ms() - t0 < 60000) {
        fi_msg *r = NULL;
        if (fi_client_recv(edge, 100, &r, err, sizeof err) != 1) continue;
        const char *id = r->body_case == FI__ENVELOPE__BODY_CHUNK   ? r->chunk->request_id
                         : r->body_case == FI__ENVELOPE__BODY_FINAL ? r->final->request_id
                         : r->body_case == FI__ENVELOPE__BODY_ERROR ? r->error->request_id
                                                                    : "";
        int k = id[0] == 'b' ? id[1] - '0' : -1;
        if (k >= 0 && k < 3) {
            if (r->body_case == FI__ENVELOPE__BODY_CHUNK)
                h_on_text(&tx[k], r->chunk->text, strlen(r->chunk->text));
            else if (r->body_case == FI__ENVELOPE__BODY_FINAL)
                done[k] = 1, n_gen[k] = (int)r->final->n_generated;
            else
                fail_msg("b%d: %s", k, r->error->message);
        }
        fi_wire_free(&r);
    }
    for (int i = 0; i < 3; i++) assert_true(done[i]);
    /* The same prompt again reuses its cached prefix. */
    memset(&t, 0, sizeof t);
    assert_int_equal(fi_client_infer(edge, &rq, h_on_text, &t, 60000, &res, err, sizeof err), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_UNSPECIFIED);
    assert_string_equal(t.buf, first.buf);
    /* A client that goes away cancels at the scheduler: a long answer
     * stops after a few pieces. */
    Fi__InferRequest lq = FI__INFER_REQUEST__INIT;
    lq.request_id = (char *)"long";
    lq.model = (char *)"smollm2";
    lq.prompt = (char *)"Count from 1 to 500, separated by commas.";
    lq.max_tokens = 400;
    s_stop_after sa = {0};
    memset(&t, 0, sizeof t);
    assert_int_equal(fi_client_infer(edge, &lq, s_stop_after_3, &sa, 60000, &res, err, sizeof err), 0);
    assert_int_equal(res.error, FI__ERROR_CODE__ERR_CANCELLED);
    h_sleep_ms(500); /* the Cancel reaches the worker; the next steps end it */

    fi_client_destroy(&edge);
    atomic_store(&w.stop, 1);
    pthread_join(w.th, NULL);
    fi_sched_stats st;
    assert_int_equal(fi_shard_engine_stats(&w.be, &st), 0);
    int sum = n_gen[0] + n_gen[1] + n_gen[2];
    print_message("scheduler: %llu steps, %llu decode tokens (3 concurrent: %d generated), "
                  "%llu of %llu prompt tokens from the prefix cache, %llu completed\n",
                  (unsigned long long)st.steps, (unsigned long long)st.decode_tokens, sum,
                  (unsigned long long)st.prefix_hit_tokens, (unsigned long long)st.prompt_tokens,
                  (unsigned long long)st.completed);
    assert_int_equal(st.completed, 6);
    assert_true(st.prefix_hit_tokens >= 32);
    /* Everything but the cancelled one: 8 + sum + 8 tokens; the cancelled
     * one stopped long before its 400. */
    assert_true(st.decode_tokens < (uint64_t)(2 * res.n_generated + sum + 100));
    assert_true(st.decode_tokens < 300);
    /* Batched: fewer forward passes than tokens decoded. */
    assert_true(st.steps < st.decode_tokens);
    /* Greedy: exactly what the engine gives one request at a time,
     * in-process, streamed intact (the worker is stopped: the backend is
     * ours now). */
    h_text direct;
    memset(&direct, 0, sizeof direct);
    fi_shard_gen g;
    assert_int_equal(w.be.generate(w.be.ctx, &rq, h_on_text, &direct, &g, err, sizeof err), 0);
    assert_string_equal(first.buf, direct.buf);
    assert_int_equal(g.n_generated, first_n);
    for (int i = 0; i < 3; i++) {
        Fi__InferRequest q = FI__INFER_REQUEST__INIT;
        q.request_id = ids[i];
        q.model = (char *)"smollm2";
        q.prompt = (char *)qs[i];
        q.max_tokens = 12;
        h_text one;
        memset(&one, 0, sizeof one);
        assert_int_equal(w.be.generate(w.be.ctx, &q, h_on_text, &one, &g, err, sizeof err), 0);
        assert_string_equal(tx[i].buf, one.buf);
    }
    /* The blocks the worker cached are found under the hashes an edge
     * computes for the same chat (edge_http.c: the chat template, encoded
     * with its special tokens, fi_prefix_hashes with the tenant qualified
     * with the site, fi_wire_cache_tenant, and the zone) with the zone the
     * coordinator sent (the edge's own, as it holds no policy), and not
     * under another tenant's, nor under the tenant alone, nor under the
     * origin site as the zone (what the coordinator sent before: the
     * edge's hashes then never matched). */
    uint8_t bits[FI_SHARD_FILTER_BYTES];
    assert_int_equal(w.be.prefix_filter(w.be.ctx, bits, sizeof bits), 0);
    int n_ids = 0;
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU};
    fi_model *edge_model = fi_model_load(FI_TEST_MODEL, &mo, err, sizeof err);
    assert_non_null(edge_model);
    fi_chat_msg one_user = {"user", rq.prompt}; /* a prompt without messages is one user message */
    int32_t *toks = edge_prompt_tokens(fi_model_tok(edge_model), &one_user, 1, NULL, 1 << 20,
                                       &n_ids, err, sizeof err);
    assert_non_null(toks);
    uint64_t hs[64];
    char onc[FI_WIRE_CACHE_TENANT_MAX], rad[FI_WIRE_CACHE_TENANT_MAX];
    assert_int_equal(fi_wire_cache_tenant("clinic-7", "oncology", onc), 0);
    assert_int_equal(fi_wire_cache_tenant("clinic-7", "radiology", rad), 0);
    int nh = fi_prefix_hashes(onc, "EU", toks, n_ids, hs, 64);
    assert_true(nh >= 2);
    assert_int_equal(fi_prefix_filter_match(bits, sizeof bits, hs, nh), nh);
    nh = fi_prefix_hashes(rad, "EU", toks, n_ids, hs, 64);
    assert_int_equal(fi_prefix_filter_match(bits, sizeof bits, hs, nh), 0);
    nh = fi_prefix_hashes("oncology", "EU", toks, n_ids, hs, 64);
    assert_int_equal(fi_prefix_filter_match(bits, sizeof bits, hs, nh), 0);
    nh = fi_prefix_hashes(onc, "clinic-7", toks, n_ids, hs, 64);
    assert_int_equal(fi_prefix_filter_match(bits, sizeof bits, hs, nh), 0);
    free(toks);
    fi_model_destroy(&edge_model);
    w.be.destroy(w.be.ctx);
    h_stop(&h);
}

/* A routed request's sampling as a worker reads it: OpenAI's penalties
 * and logit_bias within their ranges; a bias on a token outside the
 * model's vocabulary refuses the request, naming it. */
static void test_sampling_from_wire(void **state) {
    (void)state;
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    Fi__LogitBias b[3], *bp[3];
    for (int i = 0; i < 3; i++) {
        fi__logit_bias__init(&b[i]);
        bp[i] = &b[i];
    }
    b[0].token = 5, b[0].bias = -100;
    b[1].token = 6, b[1].bias = 300; /* out of range: dropped */
    b[2].token = 7, b[2].bias = 2.5f;
    rq.logit_bias = bp;
    rq.n_logit_bias = 3;
    rq.presence_penalty = 1.5f;
    rq.frequency_penalty = 7; /* out of range: off */
    fi_sampler_params sp = fi_shard_sampling(&rq);
    assert_true(sp.presence_penalty == 1.5f && sp.frequency_penalty == 0.0f);
    assert_int_equal(sp.n_bias, 2);
    assert_true(sp.bias[0].id == 5 && sp.bias[0].bias == -100.0f);
    assert_true(sp.bias[1].id == 7 && sp.bias[1].bias == 2.5f);
    if (access(FI_TEST_MODEL, R_OK) != 0) {
        print_message("skipped the vocabulary check: model %s not found\n", FI_TEST_MODEL);
        return;
    }
    char err[256];
    fi_model_opts mo = {.n_threads = 1, .simd = FI_SIMD_AUTO, .device = FI_DEVICE_CPU};
    fi_model *m = fi_model_load(FI_TEST_MODEL, &mo, err, sizeof err);
    assert_non_null(m);
    rq.prompt = (char *)"hello";
    int n = 0;
    int32_t *ids = NULL;
    /* the entry out of range is refused at the worker, not dropped */
    rq.frequency_penalty = 0;
    assert_null(fi_shard_prompt_tokens(fi_model_tok(m), &rq, &n, err, sizeof err));
    assert_non_null(strstr(err, "entry 1 (token 6, bias 300)"));
    b[1].bias = 1;
    ids = fi_shard_prompt_tokens(fi_model_tok(m), &rq, &n, err, sizeof err);
    assert_non_null(ids);
    free(ids);
    b[2].token = 49152;
    assert_null(fi_shard_prompt_tokens(fi_model_tok(m), &rq, &n, err, sizeof err));
    assert_non_null(strstr(err, "token 49152, bias 2.5) is outside the vocabulary of 49152"));
    b[2].token = 7;
    rq.presence_penalty = -3;
    assert_null(fi_shard_prompt_tokens(fi_model_tok(m), &rq, &n, err, sizeof err));
    assert_non_null(strstr(err, "within -2..2"));
    fi_model_destroy(&m);
}

/* --- a backend that fails for good ------------------------------------ */

typedef struct s_sinkbuf {
    char text[512];
    size_t len;
    int done;
    int n_generated;
    char error[512];
} s_sinkbuf;

static int s_sink_emit(void *user, const char *t, size_t n) {
    s_sinkbuf *b = user;
    if (b->len + n < sizeof b->text) {
        memcpy(b->text + b->len, t, n);
        b->len += n;
        b->text[b->len] = 0;
    }
    return 0;
}

static void s_sink_done(void *user, const fi_gen_result *res, const char *error) {
    s_sinkbuf *b = user;
    b->done = 1;
    b->n_generated = res ? res->n_generated : 0;
    snprintf(b->error, sizeof b->error, "%s", error ? error : "");
}

/* One greedy request through the engine's batched calls, as the serving
 * thread makes them, asking for max_tokens: 0 with its text, or -1 (err:
 * why it was refused or why its step failed). */
static int s_one_max(fi_shard_backend *be, uint32_t max_tokens, s_sinkbuf *b, char *err, size_t errlen) {
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)"f1";
    rq.model = (char *)"smollm2";
    rq.prompt = (char *)"Name a planet.";
    rq.max_tokens = max_tokens;
    memset(b, 0, sizeof *b);
    fi_shard_sink sink = {.emit = s_sink_emit, .done = s_sink_done, .user = b};
    if (be->submit(be->ctx, &rq, &sink, err, errlen) < 0) return -1;
    int pending = 1;
    while (pending > 0)
        if ((pending = be->step(be->ctx, err, errlen)) < 0) return -1;
    return b->done && !b->error[0] ? 0 : -1;
}

static int s_one(fi_shard_backend *be, s_sinkbuf *b, char *err, size_t errlen) {
    return s_one_max(be, 8, b, err, errlen);
}

/* The engine's configuration for the default model (one thread); the
 * test is skipped without the model. */
static void s_engine_conf(fi_shard_conf *conf, int n_ctx, int max_tokens) {
    if (access(FI_TEST_MODEL, R_OK) != 0) {
        print_message("skipped: model %s not found\n", FI_TEST_MODEL);
        skip();
    }
    fi_shard_conf_default(conf);
    snprintf(conf->model, sizeof conf->model, "%s", FI_TEST_MODEL);
    conf->n_ctx = n_ctx;
    conf->max_tokens = max_tokens;
    conf->threads = 1;
}

/* The worker's backend fails for good, as a GPU's can: the request in
 * that step ends with the backend's message, the engine takes a new
 * backend at once, and the next request gets the answer the first got. */
static void test_engine_backend_failure(void **state) {
    (void)state;
    fi_shard_conf conf;
    s_engine_conf(&conf, 256, 16);
    char err[512];
    fi_shard_backend be;
    assert_int_equal(fi_shard_engine_backend(&conf, &be, err, sizeof err), 0);
    s_sinkbuf a, b;
    if (s_one(&be, &a, err, sizeof err)) fail_msg("%s", err);
    fi_fault_backend *fb = fi_fault_wrap(fi_model_backend(fi_shard_engine_model(&be)));
    assert_non_null(fb);
    fi_fault_set(fb, 1);
    assert_int_equal(s_one(&be, &b, err, sizeof err), -1);
    print_message("failed step: %s; the request: %s\n", err, b.error);
    assert_non_null(strstr(err, "injected failure"));
    assert_true(b.done);
    assert_non_null(strstr(b.error, "injected failure"));
    /* fb went with the failed backend */
    uint32_t l[4];
    be.load(be.ctx, &l[0], &l[1], &l[2], &l[3]);
    assert_true(l[3] > 0); /* a new scheduler with its KV pool */
    assert_int_equal(be.up(be.ctx), 1);
    if (s_one(&be, &b, err, sizeof err)) fail_msg("after the reset: %s", err);
    print_message("before: \"%s\", after: \"%s\"\n", a.text, b.text);
    assert_string_equal(b.text, a.text);
    be.destroy(be.ctx);
}

/* A private copy of the default model in a new folder (dir, 64 bytes)
 * and the engine's configuration for it, pinned to its SHA-256; the test
 * is skipped without the model. */
static void s_pinned_conf(char *dir, char *model, size_t mlen, fi_shard_conf *conf) {
    char pin[65];
    s_engine_conf(conf, 256, 16);
    snprintf(dir, 64, "/tmp/test_fabric_engine.XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(model, mlen, "%s/model.gguf", dir);
    assert_int_equal(model_copy(FI_TEST_MODEL, model, pin), 0);
    snprintf(conf->model, sizeof conf->model, "%s", model);
    snprintf(conf->model_sha256, sizeof conf->model_sha256, "%s", pin);
}

/* A failure while the model file no longer matches the deployment's pin
 * (changed in place): the engine stays down (submit refuses with -2, which
 * the worker answers ERR_ENGINE; no KV blocks; up 0) until the file is as
 * pinned again, then comes back at a try and answers as before. */
static void test_engine_down(void **state) {
    (void)state;
    char dir[64], model[128], err[1024];
    fi_shard_conf conf;
    s_pinned_conf(dir, model, sizeof model, &conf);
    fi_shard_backend be;
    assert_int_equal(fi_shard_engine_backend(&conf, &be, err, sizeof err), 0);
    s_sinkbuf a, b;
    if (s_one(&be, &a, err, sizeof err)) fail_msg("%s", err);
    assert_int_equal(model_flip_last_byte(model), 0);
    fi_fault_set(fi_fault_wrap(fi_model_backend(fi_shard_engine_model(&be))), 1);
    assert_int_equal(s_one(&be, &b, err, sizeof err), -1);
    assert_int_equal(be.up(be.ctx), 0);
    uint32_t l[4];
    be.load(be.ctx, &l[0], &l[1], &l[2], &l[3]);
    assert_int_equal(l[3], 0);
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)"d1";
    rq.prompt = (char *)"Name a planet.";
    fi_shard_sink sink = {.emit = s_sink_emit, .done = s_sink_done, .user = &b};
    assert_int_equal(be.submit(be.ctx, &rq, &sink, err, sizeof err), -2);
    print_message("while down: %s\n", err);
    assert_non_null(strstr(err, "SHA-256"));
    assert_int_equal(model_flip_last_byte(model), 0);
    int up = 0;
    for (int i = 0; i < 100 && !up; i++) { /* the next try is at most 2 s away */
        up = be.up(be.ctx);
        if (!up) h_sleep_ms(50);
    }
    assert_true(up);
    if (s_one(&be, &b, err, sizeof err)) fail_msg("after coming back: %s", err);
    assert_string_equal(b.text, a.text);
    be.destroy(be.ctx);
    unlink(model);
    rmdir(dir);
}

/* One greedy request from the edge; its error code (ERR_UNSPECIFIED when
 * served), with the text in t. */
static int s_edge_once(fi_client *edge, const char *id, h_text *t) {
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)id;
    rq.model = (char *)"smollm2";
    rq.prompt = (char *)"Name a planet.";
    rq.max_tokens = 8;
    char err[512];
    fi_client_result res;
    memset(t, 0, sizeof *t);
    if (fi_client_infer(edge, &rq, h_on_text, t, 60000, &res, err, sizeof err) != 0)
        fail_msg("%s: %s", id, err);
    return (int)res.error;
}

/* Through the coordinator: a worker whose engine is down withdraws its
 * model (capacity 0), so requests are not routed to it (ERR_NO_WORKER
 * with no other worker) instead of failing there one after another, and
 * announces it again once the engine is back. */
static void test_engine_down_through_fabric(void **state) {
    (void)state;
    char dir[64], model[128];
    fi_shard_conf conf;
    s_pinned_conf(dir, model, sizeof model, &conf);
    harness h;
    assert_int_equal(h_init(&h), 0);
    h.liveness = 50;
    assert_int_equal(h_start(&h), 0);
    s_engine_worker w;
    fi_client *edge = s_worker_and_edge(&h, &conf, &w);
    h_text first, t;
    int code = FI__ERROR_CODE__ERR_NO_WORKER;
    for (int i = 0; i < 50 && code == FI__ERROR_CODE__ERR_NO_WORKER; i++) { /* its Hello */
        code = s_edge_once(edge, "x1", &first);
        if (code == FI__ERROR_CODE__ERR_NO_WORKER) h_sleep_ms(100);
    }
    assert_int_equal(code, FI__ERROR_CODE__ERR_UNSPECIFIED);
    /* the worker is idle between requests: the wrapper goes in */
    assert_int_equal(model_flip_last_byte(model), 0);
    fi_fault_set(fi_fault_wrap(fi_model_backend(fi_shard_engine_model(&w.be))), 1);
    assert_int_equal(s_edge_once(edge, "x2", &t), FI__ERROR_CODE__ERR_ENGINE);
    int withdrawn = 0;
    for (int i = 0; i < 100 && !withdrawn; i++) {
        code = s_edge_once(edge, "x3", &t);
        withdrawn = code == FI__ERROR_CODE__ERR_NO_WORKER;
        if (!withdrawn) {
            assert_int_equal(code, FI__ERROR_CODE__ERR_ENGINE); /* before the withdrawal lands */
            h_sleep_ms(50);
        }
    }
    assert_true(withdrawn);
    assert_int_equal(model_flip_last_byte(model), 0);
    code = FI__ERROR_CODE__ERR_NO_WORKER;
    for (int i = 0; i < 100 && code == FI__ERROR_CODE__ERR_NO_WORKER; i++) { /* back within ~2 s */
        code = s_edge_once(edge, "x4", &t);
        if (code == FI__ERROR_CODE__ERR_NO_WORKER) h_sleep_ms(100);
    }
    assert_int_equal(code, FI__ERROR_CODE__ERR_UNSPECIFIED);
    print_message("before: \"%s\", after coming back: \"%s\"\n", first.buf, t.buf);
    assert_string_equal(t.buf, first.buf);
    fi_client_destroy(&edge);
    atomic_store(&w.stop, 1);
    pthread_join(w.th, NULL);
    w.be.destroy(w.be.ctx);
    h_stop(&h);
    unlink(model);
    rmdir(dir);
}

/* A routed request's max_tokens is a uint32 on the wire: any value above
 * the worker's cap is capped, 2^31 and more too (they were cast to a
 * negative int, passed the cap and were refused "max_tokens must be >=
 * 0"). Through the engine backend itself, its cap 4. */
static void test_max_tokens_from_wire(void **state) {
    (void)state;
    fi_shard_conf conf;
    s_engine_conf(&conf, 64, 4);
    fi_shard_backend be;
    char err[512];
    if (fi_shard_engine_backend(&conf, &be, err, sizeof err) != 0) fail_msg("engine: %s", err);
    static const uint32_t asked[] = {2, 5, 2000000000u, 2147483648u, 4294967295u};
    static const int want[] = {2, 4, 4, 4, 4};
    for (int i = 0; i < 5; i++) {
        s_sinkbuf b;
        if (s_one_max(&be, asked[i], &b, err, sizeof err) != 0)
            fail_msg("max_tokens %u refused: %s%s", asked[i], err, b.error);
        if (b.n_generated != want[i])
            fail_msg("max_tokens %u: %d generated, not %d", asked[i], b.n_generated, want[i]);
    }
    be.destroy(be.ctx);
}

/* kv_bits = 8 in the worker's configuration: its model's backend keeps
 * 8-bit cache rows, the same kv_mb holds 1.9x the blocks (reported to the
 * coordinator with the load; 8 MiB stays under the pool's cap of what
 * its sessions can use), and a request is served. */
static void test_engine_kv_bits(void **state) {
    (void)state;
    uint32_t total[2];
    for (int i = 0; i < 2; i++) {
        fi_shard_conf conf;
        s_engine_conf(&conf, 256, 8);
        conf.kv_mb = 8;
        conf.kv_bits = i ? 8 : 16;
        fi_shard_backend be;
        char err[512];
        if (fi_shard_engine_backend(&conf, &be, err, sizeof err) != 0) fail_msg("engine: %s", err);
        assert_int_equal(fi_backend_kv_bits(fi_model_backend(fi_shard_engine_model(&be))), conf.kv_bits);
        s_sinkbuf b;
        if (s_one(&be, &b, err, sizeof err)) fail_msg("kv_bits %d: %s%s", conf.kv_bits, err, b.error);
        assert_true(b.n_generated > 0);
        uint32_t l[4];
        be.load(be.ctx, &l[0], &l[1], &l[2], &l[3]);
        total[i] = l[3];
        print_message("kv_bits %d: %u KV blocks in 8 MiB; \"%s\"\n", conf.kv_bits, l[3], b.text);
        assert_int_equal(l[3], ((size_t)8 << 20) / fi_kv_block_bytes(fi_shard_engine_model(&be)));
        be.destroy(be.ctx);
    }
    assert_true(total[1] * 100 >= total[0] * 185 && total[1] * 100 <= total[0] * 195);
}

/* A batched backend that serves nothing and reports a pool of 5000 KV
 * blocks; it keeps the size of the prefix filter it is asked for. */
static atomic_int s_filter_asked;
static int64_t s_pool_submit(void *ctx, const Fi__InferRequest *rq, const fi_shard_sink *sink,
                             char *err, size_t errlen) {
    (void)ctx, (void)rq, (void)sink;
    snprintf(err, errlen, "serves nothing");
    return -1;
}
static int s_pool_cancel(void *ctx, int64_t id) {
    (void)ctx, (void)id;
    return -1;
}
static int s_pool_step(void *ctx, char *err, size_t errlen) {
    (void)ctx, (void)err, (void)errlen;
    return 0;
}
static void s_pool_load(void *ctx, uint32_t *running, uint32_t *queued, uint32_t *kv_free,
                        uint32_t *kv_total) {
    (void)ctx;
    *running = *queued = 0;
    *kv_free = *kv_total = 5000;
}
static int s_pool_filter(void *ctx, uint8_t *bits, size_t nbytes) {
    (void)ctx;
    memset(bits, 0, nbytes);
    atomic_store(&s_filter_asked, (int)nbytes);
    return 0;
}

/* A batched worker's prefix filter is sized from its KV pool
 * (fi_prefix_filter_bytes: 5000 blocks, 8 KiB), not the fixed 1 KiB that
 * a pool of thousands of cached blocks fills until it claims every
 * prompt. */
static void test_filter_sized_from_pool(void **state) {
    (void)state;
    harness h;
    assert_int_equal(h_init(&h), 0);
    assert_int_equal(h_start(&h), 0);
    atomic_store(&s_filter_asked, 0);
    fi_shard_backend be = {.name = "pool", .submit = s_pool_submit, .cancel = s_pool_cancel,
                           .step = s_pool_step, .load = s_pool_load, .prefix_filter = s_pool_filter};
    h_worker w;
    assert_int_equal(h_worker_start_be(&h, &w, "pooled", "core1", &be, 4), 0);
    for (int i = 0; i < 200 && !atomic_load(&s_filter_asked); i++) h_sleep_ms(10);
    assert_int_equal(atomic_load(&s_filter_asked), 8192);
    h_worker_stop(&w);
    h_stop(&h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sampling_from_wire),
        cmocka_unit_test(test_engine_through_fabric),
        cmocka_unit_test(test_engine_backend_failure),
        cmocka_unit_test(test_engine_down),
        cmocka_unit_test(test_engine_down_through_fabric),
        cmocka_unit_test(test_max_tokens_from_wire),
        cmocka_unit_test(test_engine_kv_bits),
        cmocka_unit_test(test_filter_sized_from_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
