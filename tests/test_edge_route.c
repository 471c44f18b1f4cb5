/*
 * test_edge_route.c - the edge's local-versus-cluster choice sees the
 * clusters' load the coordinator reports with its heartbeats (issue 5/6):
 * an edge whose policy prefers the cluster sends a request to its own
 * engine while the cluster is full, and to the cluster again once it has
 * room. A real coordinator (thread), a slow echo worker of capacity 1 and
 * the default model on the edge.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <cmocka.h>

#include "fabric/harness_edge.h"
#include "fi_audit.h"
#include "fi_bundle.h"
#include "fi_edge.h"

static const char *s_policy =
    "labels public;\ndefault_label \"public\";\n"
    "jurisdiction EU;\nregion eu-a in EU;\n"
    "site clinic in eu-a;\ncluster core1 in eu-a;\n"
    "permit \"anything\";\n"
    "prefer \"the cluster\" score 10 when target.kind == \"cluster\";\n";

typedef struct fx {
    harness h;
    h_worker w;
    fi_edge *e;
    int port;
} fx;

static int setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    assert_int_equal(h_init(&f->h), 0);
    assert_int_equal(h_start(&f->h), 0);
    /* One slot, 50 ms per 4 bytes: a 400-byte prompt holds it for 5 s. */
    assert_int_equal(h_worker_start_cap(&f->h, &f->w, "smol", 50, 1), 0);
    uint8_t pk[32], sk[64];
    char extra[600];
    snprintf(extra, sizeof extra,
             "model = %s\nmodel_name = smol\nthreads = 1\nn_ctx = 1024\nconcurrency = 1\n",
             FI_TEST_MODEL);
    f->e = h_edge_start(&f->h, "clinic", "eu-a", s_policy, pk, sk, extra);
    f->port = fi_edge_port(f->e);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fx *f = *state;
    fi_edge_destroy(&f->e);
    h_worker_stop(&f->w);
    h_stop(&f->h);
    free(f);
    return 0;
}

typedef struct s_bg {
    int port;     /* the edge */
    resp r;       /* its answer */
} s_bg;

static void *s_long(void *arg) {
    s_bg *bg = arg;
    char body[700];
    char prompt[401];
    memset(prompt, 'x', 400);
    prompt[400] = 0;
    snprintf(body, sizeof body, "{\"model\":\"smol\",\"prompt\":\"%s\",\"max_tokens\":200}", prompt);
    if (http_post(bg->port, NULL, body, &bg->r) != 0) bg->r.status = -1;
    return NULL;
}

/* Whether the coordinator of h comes to see one request open at the
 * cluster worker within 2 s. */
static int s_cluster_holds_one(harness *h) {
    int open = 0;
    for (int i = 0; i < 100 && !open; i++) {
        h_sleep_ms(20);
        fi_client *op = h_client(h, &h->op, FI__ROLE__ROLE_OPERATOR);
        assert_non_null(op);
        Fi__StatusRequest sq = FI__STATUS_REQUEST__INIT;
        fi_msg m = FI__ENVELOPE__INIT;
        m.body_case = FI__ENVELOPE__BODY_STATUS_REQUEST;
        m.status_request = &sq;
        fi_msg *rep = NULL;
        char err[256];
        if (fi_client_call(op, &m, FI__ENVELOPE__BODY_STATUS_REPLY, 3000, &rep, err, sizeof err) == 1 &&
            rep->body_case == FI__ENVELOPE__BODY_STATUS_REPLY)
            for (size_t k = 0; k < rep->status_reply->n_peers; k++)
                open |= rep->status_reply->peers[k]->role == FI__ROLE__ROLE_CLUSTER &&
                        rep->status_reply->peers[k]->in_flight == 1;
        fi_wire_free(&rep);
        fi_client_destroy(&op);
    }
    return open;
}

static void test_full_cluster_keeps_it_local(void **state) {
    fx *f = *state;
    resp r;
    const char *b = "{\"model\":\"smol\",\"prompt\":\"Hi\",\"max_tokens\":2,\"temperature\":0}";
    /* The policy prefers the cluster. */
    assert_int_equal(http_post(f->port, NULL, b, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.head, "X-Fedinfer-Target: core1"));
    /* A long request fills the cluster's only slot (once the edge has
     * heard that the first one ended: the load it sees lags by up to a
     * heartbeat)... */
    h_sleep_ms(4 * H_HB_MS);
    s_bg bg = {f->port, {0, "", ""}};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, s_long, &bg), 0);
    /* ...(the coordinator has it open)... */
    if (!s_cluster_holds_one(&f->h)) {
        pthread_join(th, NULL);
        fail_msg("the long request did not reach the cluster: %d %s", bg.r.status, bg.r.head);
    }
    h_sleep_ms(4 * H_HB_MS); /* ...and its heartbeats have told the edge */
    assert_int_equal(http_post(f->port, NULL, b, &r), 0);
    assert_int_equal(r.status, 200);
    if (!strstr(r.head, "X-Fedinfer-Target: clinic")) fail_msg("while full: %s", r.head);
    pthread_join(th, NULL);
    assert_int_equal(bg.r.status, 200);
    assert_non_null(strstr(bg.r.head, "X-Fedinfer-Target: core1"));
    /* Room again: back to the cluster. */
    h_sleep_ms(8 * H_HB_MS);
    assert_int_equal(http_post(f->port, NULL, b, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.head, "X-Fedinfer-Target: core1"));
}

/* A policy of many clusters: the edge weighs every one. It used to take
 * the site and the first 15 clusters only, so a request that only the
 * 41st may serve was answered 403 "default deny" (and audited as a
 * denial) though the policy permits it and its worker is live. */
static void test_every_declared_cluster_is_weighed(void **state) {
    (void)state;
    harness h;
    h_worker w;
    assert_int_equal(h_init(&h), 0);
    assert_int_equal(h_start(&h), 0);
    assert_int_equal(h_worker_start_cap(&h, &w, "smol", 1, 4), 0); /* cluster core1 */
    char pol[4096];
    int k = snprintf(pol, sizeof pol,
                     "labels public;\ndefault_label \"public\";\n"
                     "jurisdiction EU;\nregion eu-a in EU;\nsite clinic in eu-a;\n");
    for (int i = 0; i < 40; i++)
        k += snprintf(pol + k, sizeof pol - (size_t)k, "cluster c%02d in eu-a;\n", i);
    snprintf(pol + k, sizeof pol - (size_t)k,
             "cluster core1 in eu-a;\npermit \"only core1\" when target within \"core1\";\n");
    uint8_t pk[32], sk[64];
    fi_edge *e = h_edge_start(&h, "clinic", "eu-a", pol, pk, sk, "");
    assert_non_null(e);
    h_sleep_ms(4 * H_HB_MS); /* the clusters' load reaches the edge */
    resp r;
    assert_int_equal(http_post(fi_edge_port(e), NULL, "{\"model\":\"smol\",\"prompt\":\"Hi\",\"max_tokens\":2}",
                               &r), 0);
    if (r.status != 200 || !strstr(r.head, "X-Fedinfer-Target: core1"))
        fail_msg("status %d: %s%s", r.status, r.head, r.body);
    assert_non_null(strstr(r.head, "X-Fedinfer-Rules: only core1"));
    fi_edge_destroy(&e);
    h_worker_stop(&w);
    h_stop(&h);
}

/* The edge records a routed request as permitted at the cluster before it
 * sends it; when the coordinator then refuses it (the only permitted
 * cluster is full: 429), a second record of the request says so
 * ("unavailable", with the coordinator's reason), so the edge's log does
 * not show a permit for a request that was not served; the coordinator
 * records its refusal in its own log. */
static int s_find_rec(const fi_audit_record *r, void *arg) {
    fi_audit_record *want = arg;
    if (!strcmp(r->request_id, want->request_id) && !strcmp(r->decision, "unavailable")) {
        snprintf((char *)want->rules, 300, "%s", r->rules);
        return 1;
    }
    return 0;
}

/* The coordinator's own record of the refusal of request id (its log also
 * holds the edge's uploaded records, whose rules start "coordinator: "). */
typedef struct s_own {
    const char *id;
    int found;
} s_own;

static int s_find_own(const fi_audit_record *r, void *arg) {
    s_own *o = arg;
    o->found |= !strcmp(r->request_id, o->id) && !strcmp(r->decision, "unavailable") &&
                !strncmp(r->rules, "every permitted worker", 22);
    return 0;
}

static void test_refused_by_coordinator_is_recorded(void **state) {
    (void)state;
    harness h;
    h_worker w;
    assert_int_equal(h_init(&h), 0);
    assert_int_equal(h_start(&h), 0);
    assert_int_equal(h_worker_start_cap(&h, &w, "smol", 50, 1), 0); /* one slot, slow */
    const char *pol = "labels public;\ndefault_label \"public\";\n"
                      "jurisdiction EU;\nregion eu-a in EU;\nsite clinic in eu-a;\ncluster core1 in eu-a;\n"
                      "permit \"on the cluster\" when target within \"core1\";\n";
    uint8_t pk[32], sk[64];
    fi_edge *e = h_edge_start(&h, "clinic", "eu-a", pol, pk, sk, "");
    int port = fi_edge_port(e);
    h_sleep_ms(4 * H_HB_MS);
    s_bg bg = {port, {0, "", ""}};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, s_long, &bg), 0);
    if (!s_cluster_holds_one(&h)) fail_msg("the long request did not reach the cluster");
    resp r;
    assert_int_equal(http_post(port, NULL, "{\"model\":\"smol\",\"prompt\":\"Hi\",\"max_tokens\":2}", &r), 0);
    printf("  with the cluster full: %d %.200s\n", r.status, r.body);
    assert_int_equal(r.status, 429);
    const char *p = strstr(r.head, "X-Request-Id: ");
    assert_non_null(p);
    char id[128];
    assert_int_equal(sscanf(p + 14, "%127[^\r\n]", id), 1);
    pthread_join(th, NULL);
    fi_edge_destroy(&e); /* the log is complete */
    char path[512], err[512], rules[300] = "";
    snprintf(path, sizeof path, "%s/edge.db", h.dir);
    fi_audit *a = fi_audit_open_readonly(path, err, sizeof err);
    if (!a) fail_msg("%s", err);
    fi_audit_record want = {.request_id = id, .rules = rules};
    assert_int_equal(fi_audit_query(a, NULL, s_find_rec, &want, err, sizeof err), 0);
    fi_audit_destroy(&a);
    printf("  recorded: unavailable, %s\n", rules);
    if (!strstr(rules, "coordinator: ")) fail_msg("no 'unavailable' record of %s", id);
    /* and the coordinator's own log records its refusal too */
    fi_coord_audit_wait(h.c);
    s_own own = {id, 0};
    assert_int_equal(fi_audit_query(fi_ship_audit(fi_coord_ship(h.c)), NULL, s_find_own, &own, err, sizeof err), 0);
    if (!own.found) fail_msg("the coordinator has no record of its own of refusing %s", id);
    h_worker_stop(&w);
    h_stop(&h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_full_cluster_keeps_it_local, setup, teardown),
        cmocka_unit_test(test_every_declared_cluster_is_weighed),
        cmocka_unit_test(test_refused_by_coordinator_is_recorded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
