"""End to end on loopback: a coordinator, one cluster worker (fra-gpu-1)
and two edge agents in two regions (berlin-clinic in eu-central,
paris-clinic in eu-west) of the EU hospital example. Labelled requests land
where the policy says and nowhere else, checked against both edges' audit
logs; the coordinator re-checks with the origin of the edge's key (paris
holds a permissive policy and is refused PHI routing); a client that leaves
cancels the work at the cluster; offline, the edge serves what it may on
site and answers 503 at once for the rest; the audit logs reach the
coordinator, also across its restart."""
import hashlib
import json
import os
import sqlite3
import sys
import time
import unittest

import openai
from openai import OpenAI

sys.path.insert(0, os.path.dirname(__file__))
from edgeproc import FEDCTL, FEDINFER  # noqa: E402
from fleet import Fleet  # noqa: E402

MODEL = os.environ.get("FEDINFER_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
M = "smollm2-135m"
HERE = os.path.dirname(os.path.abspath(__file__))


def audit(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT seq, request_id, labels, decision, target, rules FROM audit "
                         "ORDER BY seq").fetchall()


class EndToEnd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        f = cls.f = Fleet(MODEL)
        d = f.dir
        f.run(FEDCTL, "policy", "apply", os.path.join(HERE, "permissive.policy"), "-m", "paris test",
              "--store", f"{d}/paris-ops.db", "--key", f"{d}/sign.key",
              "--bundle-out", f"{d}/permissive.bundle")
        cls.berlin = f.add_edge("berlin-clinic", "eu-central", extra="clusters = fra-gpu-1\n")
        cls.paris = f.add_edge("paris-clinic", "eu-west", bundle=f"{d}/permissive.bundle",
                               extra="clusters = fra-gpu-1\n")
        f.wait_ready()
        cls.cb = OpenAI(base_url=cls.berlin + "/v1", api_key="x", max_retries=0)
        cls.cp = OpenAI(base_url=cls.paris + "/v1", api_key="x", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.f.close()

    def ask(self, client, labels, model=M, stream=False, max_tokens=6):
        h = {"X-Data-Class": labels} if labels else {}
        r = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=max_tokens, temperature=0, stream=stream,
            messages=[{"role": "user", "content": "Say hello."}], extra_headers=h)
        body = r.parse()
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in body if c.choices)
        else:
            text = body.choices[0].message.content
        return r.headers["x-fedinfer-target"], r.headers["x-fedinfer-policy"], \
            r.headers["x-request-id"], text

    def test_1_placement(self):
        want = {"phi": "berlin-clinic", "": "fra-gpu-1", "pii": "fra-gpu-1",
                "public": "fra-gpu-1", "internal,phi": "berlin-clinic"}
        ids = {}
        for labels, target in want.items():
            t, pol, rid, text = self.ask(self.cb, labels, stream=labels == "public")
            self.assertEqual(t, target, labels)
            self.assertEqual(pol, "1")
            self.assertTrue(text)
            ids[rid] = (labels, target)
        rows = {r[1]: r for r in audit(f"{self.f.dir}/berlin-clinic.db")}
        for rid, (labels, target) in ids.items():
            self.assertEqual(rows[rid][3], "permit")
            self.assertEqual(rows[rid][4], target)
        # PHI never left the site, by the audit log.
        for r in audit(f"{self.f.dir}/berlin-clinic.db"):
            if "phi" in r[2].split(","):
                self.assertEqual(r[4], "berlin-clinic", r)

    def test_1b_seeded_sampling_same_anywhere(self):
        # A sampled request with a seed gives the same text wherever the
        # policy sends it: on site (phi) and at the cluster (unlabelled),
        # as the seed and every sampling parameter travel with the request
        # and both engines compute the same logits.
        texts = {}
        for labels in ("phi", ""):
            h = {"X-Data-Class": labels} if labels else {}
            r = self.cb.completions.with_raw_response.create(
                model=M, max_tokens=24, temperature=1.0, seed=7, logit_bias={"2": -100},
                prompt="Write a very long story about a dragon.", extra_headers=h)
            texts[r.headers["x-fedinfer-target"]] = r.parse().choices[0].text
        self.assertEqual(set(texts), {"berlin-clinic", "fra-gpu-1"})
        self.assertTrue(texts["berlin-clinic"])
        self.assertEqual(texts["berlin-clinic"], texts["fra-gpu-1"])

    def test_2_coordinator_rechecks(self):
        # paris holds a permissive policy and routes PHI; the coordinator,
        # which knows the request comes from paris-clinic by its key,
        # applies the real policy and refuses, naming the rule.
        with self.assertRaises(openai.PermissionDeniedError) as cm:
            self.ask(self.cp, "phi")
        self.assertIn("phi stays on site", str(cm.exception))
        t, _, rid, _ = self.ask(self.cp, "internal")
        self.assertEqual(t, "fra-gpu-1")
        rows = audit(f"{self.f.dir}/paris-clinic.db")
        phi = [r for r in rows if "phi" in r[2].split(",")]
        self.assertTrue(any(r[3] == "deny" and "phi stays on site" in r[5] for r in phi), rows)
        self.assertIn(rid, [r[1] for r in rows])
        # The coordinator wrote its own decisions to its hash-chained log:
        # the worker it chose, and the denial with the rule.
        deadline = time.monotonic() + 5  # written by the coordinator's audit thread
        while True:
            own = audit(f"{self.f.dir}/coordinator.db.audit")
            mine = [r for r in own if r[1] == rid and "worker " in r[5]]
            if mine or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.assertTrue(mine and mine[0][3] == "permit" and mine[0][4] == "fra-gpu-1", own)
        self.assertTrue(any(r[3] == "deny" and "phi stays on site" in r[5] and "phi" in r[2]
                            for r in own), own)

    def cluster_running(self):
        for line in self.f.ctl("status").splitlines():
            if line.startswith("cluster") and " up " in line and "running=" in line:
                return int(line.split("running=")[1].split()[0])
        return -1

    def test_3_disconnect_cancels_at_cluster(self):
        # A long routed stream (800 tokens: many seconds of work for the
        # worker; the end-of-text token is barred, so that the model cannot
        # end it early, as a sampled story sometimes did after 20 tokens),
        # dropped after its first chunks: the worker's scheduler ends it
        # (its reported running count drops to 0 long before 800 tokens
        # could be made), and a short request right after is served at once.
        s = self.cb.completions.create(
            model=M, max_tokens=800, temperature=1.0, seed=7, stream=True, logit_bias={"2": -100},
            prompt="Write a very long story about a dragon, in many chapters.")
        it = iter(s)
        for _ in range(3):
            next(it)
        t_seen = time.monotonic()  # the load reported lags by up to a heartbeat (1 s)
        while self.cluster_running() != 1 and time.monotonic() - t_seen < 4:
            time.sleep(0.2)
        self.assertEqual(self.cluster_running(), 1)
        s.close()
        t_close = time.monotonic()
        while self.cluster_running() != 0 and time.monotonic() - t_close < 6:
            time.sleep(0.2)
        self.assertEqual(self.cluster_running(), 0)
        print(f"cancelled at the cluster: running=0 after {time.monotonic() - t_close:.1f} s",
              file=sys.stderr)
        t0 = time.monotonic()
        t, _, _, _ = self.ask(self.cb, "", max_tokens=2)
        took = time.monotonic() - t0
        self.assertEqual(t, "fra-gpu-1")
        self.assertLess(took, 3.0)

    def test_4_offline_and_upload(self):
        f = self.f
        self.assertEqual(f.stop("coordinator"), 0)
        time.sleep(4.5)  # the edges notice (liveness 3 x 1 s)
        t0 = time.monotonic()
        with self.assertRaises(openai.APIStatusError) as cm:
            self.ask(self.cb, "public", model="llama-3-8b")
        self.assertEqual(cm.exception.status_code, 503)
        self.assertLess(time.monotonic() - t0, 2)
        t, pol, _, _ = self.ask(self.cb, "")          # internal: on site while offline
        self.assertEqual((t, pol), ("berlin-clinic", "1"))
        t, _, _, _ = self.ask(self.cb, "phi")
        self.assertEqual(t, "berlin-clinic")
        # The coordinator comes back; every record of both edges reaches it.
        f.start("coordinator", [FEDINFER, "coordinator", "--config",
                                f"{f.dir}/coordinator.conf"])
        heads = {s: audit(f"{f.dir}/{s}.db")[-1][0] for s in ("berlin-clinic", "paris-clinic")}
        deadline = time.monotonic() + 30
        got = {}
        while time.monotonic() < deadline:
            with sqlite3.connect(f"{f.dir}/coordinator.db") as c:
                got = {}
                for blob, in c.execute("SELECT blob FROM audit"):
                    for rec in json.loads(blob):
                        got.setdefault(rec["origin"], set()).add(rec["seq"])
            if all(got.get(s, set()) >= set(range(1, h + 1)) for s, h in heads.items()):
                break
            time.sleep(0.5)
        for s, h in heads.items():
            self.assertTrue(got.get(s, set()) >= set(range(1, h + 1)), (s, h, got.get(s)))
        # the fleet whole again for the tests after: the edges see the
        # coordinator and the worker serves (test_6 once routed a request
        # before the worker was back: 503, no live worker)
        f.wait_ready()

    def test_5_app_tokens_with_fedctl(self):
        # fedctl makes the token; only its SHA-256 reaches the coordinator
        # and the edge; revoked the same way; the secret is in no database.
        f = self.f
        tok = f.ctl("token", "add", "--site", "berlin-clinic", "--tenant", "oncology",
                    "--app", "triage")
        self.assertTrue(tok.startswith("fie_"), tok)
        h = hashlib.sha256(tok.encode()).hexdigest()

        def edge_row():
            try:
                with sqlite3.connect(f"{f.dir}/berlin-clinic.db") as c:
                    return c.execute("SELECT tenant, application, revoked FROM edge_tokens "
                                     "WHERE hash=?", (h,)).fetchone()
            except sqlite3.OperationalError:  # no table until the first token arrives
                return None
        deadline = time.monotonic() + 15
        while edge_row() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertEqual(edge_row(), ("oncology", "triage", None))
        self.assertIn(h, f.ctl("token", "list", "--site", "berlin-clinic"))
        f.ctl("token", "revoke", tok)
        deadline = time.monotonic() + 15
        while edge_row()[2] is None and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertIsNotNone(edge_row()[2])
        for name in os.listdir(f.dir):
            if name.endswith((".db", ".db-wal", ".audit", ".audit-wal")):
                with open(os.path.join(f.dir, name), "rb") as fh:
                    self.assertNotIn(tok[4:].encode(), fh.read(), name)


    def test_6_audit_log_witnessed_by_the_edges(self):
        # The coordinator tells the edges the head of its audit log with its
        # heartbeats; each edge keeps the newest (fedinfer edge witness) and
        # says it back, and fedctl audit verify checks the log against both.
        f = self.f
        t, _, _, _ = self.ask(self.cb, "public")  # a routed request: a record there
        self.assertEqual(t, "fra-gpu-1")
        deadline = time.monotonic() + 20
        out = ""
        while time.monotonic() < deadline:
            out = f.ctl("audit", "verify")
            if "witnessed by 2 edge(s), every one holds" in out:
                break
            time.sleep(0.5)
        self.assertIn("witnessed by 2 edge(s), every one holds", out)
        st = f.ctl("status")
        self.assertRegex(st, r"(?m)berlin-clinic .* policy=1 audit-witness=[1-9][0-9]*$", st)
        self.assertNotIn("FAILS", st)
        w = f.run(FEDINFER, "edge", "witness", "--config", f"{f.dir}/berlin-clinic.conf")
        self.assertRegex(w, r"witness of coordinator [0-9a-f]+'s audit log: record [1-9][0-9]*, "
                            r"hash [0-9a-f]{64}$")


if __name__ == "__main__":
    unittest.main(verbosity=2)
