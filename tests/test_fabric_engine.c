/*
 * test_fabric_engine.c - a request through the fabric served by the real
 * engine: edge -> coordinator -> shard worker (engine backend, the default
 * model) -> tokens streamed back. Skipped when the model file is missing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "fabric/harness.h"

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
    o.capacity[0] = 2;
    fi_client *c = fi_client_new(&o, err, sizeof err);
    if (c && fi_shard_serve(c, &w->be, 4, &w->stop, err, sizeof err) != 0)
        fprintf(stderr, "engine worker: %s\n", err);
    fi_client_destroy(&c);
    return NULL;
}

static void test_engine_through_fabric(void **state) {
    (void)state;
    if (access(FI_TEST_MODEL, R_OK) != 0) {
        print_message("skipped: model %s not found\n", FI_TEST_MODEL);
        skip();
    }
    harness h;
    assert_int_equal(h_init(&h), 0);
    assert_int_equal(h_start(&h), 0);
    s_engine_worker w;
    memset(&w, 0, sizeof w);
    w.h = &h;
    fi_shard_conf conf;
    fi_shard_conf_default(&conf);
    snprintf(conf.model, sizeof conf.model, "%s", FI_TEST_MODEL);
    conf.n_ctx = 512;
    conf.max_tokens = 64;
    char err[512];
    assert_int_equal(fi_shard_engine_backend(&conf, &w.be, err, sizeof err), 0);
    assert_int_equal(fi_keys_generate(&w.kp), 0);
    assert_int_equal(h_enrol_direct(&h, &w.kp, FI__ROLE__ROLE_CLUSTER, "core1", "eu-west"), 0);
    assert_int_equal(pthread_create(&w.th, NULL, s_serve, &w), 0);

    fi_keypair ek;
    assert_int_equal(fi_keys_generate(&ek), 0);
    assert_int_equal(h_enrol_direct(&h, &ek, FI__ROLE__ROLE_EDGE, "clinic-7", "eu-west"), 0);
    fi_client *edge = h_client(&h, &ek, FI__ROLE__ROLE_EDGE);
    assert_non_null(edge);
    h_text t;
    fi_client_result res;
    Fi__InferRequest rq = FI__INFER_REQUEST__INIT;
    rq.request_id = (char *)"e1";
    rq.model = (char *)"smollm2";
    rq.prompt = (char *)"What is the capital of France? Answer in one word.";
    rq.max_tokens = 16;
    rq.temperature = 0; /* greedy */
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
    /* Greedy: exactly what the engine gives in-process, streamed intact. */
    h_text direct;
    memset(&direct, 0, sizeof direct);
    fi_shard_gen g;
    assert_int_equal(w.be.generate(w.be.ctx, &rq, h_on_text, &direct, &g, err, sizeof err), 0);
    assert_string_equal(t.buf, direct.buf);
    assert_int_equal(g.n_generated, res.n_generated);
    fi_client_destroy(&edge);
    atomic_store(&w.stop, 1);
    pthread_join(w.th, NULL);
    w.be.destroy(w.be.ctx);
    h_stop(&h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_engine_through_fabric),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
