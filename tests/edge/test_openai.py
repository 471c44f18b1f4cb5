"""The official openai client (PyPI) and plain curl against a running edge:
chat and completions, streamed and not, stop strings, a denied request
raising the SDK's error, bearer tokens, and a clean stop on SIGTERM."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import unittest

import openai
from openai import OpenAI

sys.path.insert(0, os.path.dirname(__file__))
from edgeproc import Edge  # noqa: E402

MODEL = os.environ.get("FEDINFER_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
M = "smollm2-135m"


class OpenAIClient(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.edge = Edge(MODEL)
        cls.c = OpenAI(base_url=cls.edge.url + "/v1", api_key="unused", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        code, took = cls.edge.stop()
        cls.edge.cleanup()
        assert code == 0, f"edge exited {code}"

    def test_chat(self):
        r = self.c.chat.completions.with_raw_response.create(
            model=M, temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        self.assertEqual(r.headers["x-fedinfer-target"], "berlin-clinic")
        self.assertEqual(r.headers["x-fedinfer-policy"], "1")
        cc = r.parse()
        self.assertIn("Paris", cc.choices[0].message.content)
        self.assertEqual(cc.usage.total_tokens, cc.usage.prompt_tokens + cc.usage.completion_tokens)
        self.assertIn(cc.choices[0].finish_reason, ("stop", "length"))

    def test_chat_stream(self):
        whole = self.c.chat.completions.create(
            model=M, temperature=0, max_tokens=10, seed=1,
            messages=[{"role": "user", "content": "Name three colours."}]).choices[0].message.content
        parts, finish = [], None
        for ch in self.c.chat.completions.create(
                model=M, temperature=0, max_tokens=10, seed=1, stream=True,
                messages=[{"role": "user", "content": "Name three colours."}]):
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        self.assertGreater(len(parts), 1)
        self.assertEqual("".join(parts), whole)
        self.assertIn(finish, ("stop", "length"))
        # usage when asked for: a last chunk of its own, as the SDK expects
        chunks = list(self.c.chat.completions.create(
            model=M, temperature=0, max_tokens=10, seed=1, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Name three colours."}]))
        self.assertEqual(chunks[-1].choices, [])
        self.assertGreater(chunks[-1].usage.completion_tokens, 0)
        self.assertTrue(all(ch.usage is None for ch in chunks[:-1]))

    def test_unsupported_parameters(self):
        msgs = [{"role": "user", "content": "hi"}]
        for kw in ({"response_format": {"type": "json_object"}},
                   {"logprobs": True, "top_logprobs": 2},
                   {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}):
            with self.assertRaises(openai.BadRequestError) as cm:
                self.c.chat.completions.create(model=M, max_tokens=4, messages=msgs, **kw)
            self.assertEqual(cm.exception.code, "unsupported_parameter")
            self.assertIn(next(iter(kw)), str(cm.exception))

    def test_completions(self):
        r = self.c.completions.create(model=M, prompt="1, 2, 3, 4,", temperature=0, max_tokens=8)
        self.assertIn("5", r.choices[0].text)
        self.assertGreater(r.usage.completion_tokens, 0)
        text = "".join(ch.choices[0].text for ch in self.c.completions.create(
            model=M, prompt="1, 2, 3, 4,", temperature=0, max_tokens=8, stream=True))
        self.assertEqual(text, r.choices[0].text)

    def test_penalties_and_logit_bias(self):
        base = self.c.completions.create(model=M, prompt="1, 2, 3,", max_tokens=8, temperature=0)
        pen = self.c.completions.create(model=M, prompt="1, 2, 3,", max_tokens=8, temperature=0,
                                        frequency_penalty=2.0, presence_penalty=2.0)
        self.assertNotEqual(pen.choices[0].text, base.choices[0].text)
        # a +100 bias decides the (greedy) token, whatever else is banned
        def one(bias):
            return self.c.completions.create(model=M, prompt="1, 2, 3,", max_tokens=1,
                                             temperature=0, logit_bias=bias).choices[0].text
        banned = {str(t): -100 for t in range(0, 299)}
        self.assertEqual(one({**banned, "300": 100}), one({"300": 100}))
        self.assertNotEqual(one({"300": 100}), one({"301": 100}))
        with self.assertRaises(openai.BadRequestError) as cm:
            self.c.completions.create(model=M, prompt="x", max_tokens=1, logit_bias={"99999": 1})
        self.assertIn("logit_bias", str(cm.exception))

    def test_empty_prompt(self):
        # as OpenAI: the text starts after the beginning (or end) of text
        r = self.c.completions.create(model=M, prompt="", max_tokens=4, temperature=0)
        self.assertEqual(r.usage.prompt_tokens, 1)
        self.assertGreaterEqual(r.usage.completion_tokens, 1)

    def test_stop_strings(self):
        r = self.c.completions.create(model=M, prompt="1, 2, 3, 4,", temperature=0,
                                      max_tokens=16, stop=["7"])
        self.assertNotIn("7", r.choices[0].text)
        self.assertIn("6", r.choices[0].text)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        text = "".join(ch.choices[0].text for ch in self.c.completions.create(
            model=M, prompt="1, 2, 3, 4,", temperature=0, max_tokens=16, stop=["7", "zz"],
            stream=True))
        self.assertEqual(text, r.choices[0].text)

    def test_denied(self):
        with self.assertRaises(openai.PermissionDeniedError) as cm:
            self.c.chat.completions.create(
                model=M, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Data-Class": "secret"})
        self.assertEqual(cm.exception.status_code, 403)
        self.assertIn("secret nowhere", str(cm.exception))
        with self.assertRaises(openai.PermissionDeniedError):
            self.c.completions.create(model=M, prompt="x", max_tokens=4,
                                      extra_body={"data_class": ["phi", "secret"]})

    def test_bad_requests(self):
        with self.assertRaises(openai.NotFoundError):
            self.c.chat.completions.create(model="no-such-model", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
        with self.assertRaises(openai.BadRequestError) as cm:
            self.c.chat.completions.create(model=M, max_tokens=100000,
                                           messages=[{"role": "user", "content": "hi"}])
        self.assertIn("max_tokens", str(cm.exception))
        with self.assertRaises(openai.BadRequestError):
            self.c.chat.completions.create(model=M, max_tokens=4, n=2,
                                           messages=[{"role": "user", "content": "hi"}])
        with self.assertRaises(openai.BadRequestError):
            self.c.chat.completions.create(model=M, max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}],
                                           extra_headers={"X-Data-Class": "no-such-label"})

    def test_models(self):
        self.assertEqual([m.id for m in self.c.models.list()], [M])
        self.assertEqual(self.c.models.retrieve(M).id, M)
        with self.assertRaises(openai.NotFoundError):
            self.c.models.retrieve("no-such-model")

    def test_curl(self):
        out = subprocess.run(
            ["curl", "-sS", "-N", self.edge.url + "/v1/chat/completions",
             "-H", "Content-Type: application/json", "-H", "X-Data-Class: phi",
             "-d", json.dumps({"model": M, "max_tokens": 6, "stream": True,
                               "messages": [{"role": "user", "content": "hi"}]})],
            check=True, capture_output=True, text=True).stdout
        self.assertTrue(out.startswith("data: {"))
        self.assertTrue(out.endswith("data: [DONE]\n\n"))
        out = subprocess.run(
            ["curl", "-sS", "-w", "%{http_code}", self.edge.url + "/v1/chat/completions",
             "-d", "{not json"], capture_output=True, text=True).stdout
        self.assertTrue(out.endswith("400"))
        self.assertEqual(json.loads(out[:-3])["error"]["code"], "invalid_json")


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Floods(unittest.TestCase):
    """Slow clients and floods of connections are bounded by the HTTP
    server's connection, per-address, timeout and memory limits: the agent
    keeps serving and its memory stays flat."""

    def test_flood_and_slow_clients(self):
        import socket
        e = Edge(MODEL, extra="conn_limit = 64\nper_ip_limit = 48\nconn_timeout_s = 2\n"
                              "max_body = 65536\n")
        try:
            c = OpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0)
            c.completions.create(model=M, prompt="a", max_tokens=2)  # warm
            before = rss_kb(e.proc.pid)
            rounds = []
            for _round in range(4):
                socks = []
                for i in range(300):  # far over the limits: most are refused at once
                    try:
                        s = socket.create_connection(("127.0.0.1", e.port), timeout=2)
                        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Length: 60000\r\n\r\n{\"model\":")
                        socks.append(s)
                    except OSError:
                        pass
                # An endless chunked body is cut off.
                s = socket.create_connection(("127.0.0.1", e.port), timeout=5)
                try:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n")
                    chunk = b"4000\r\n" + b"a" * 0x4000 + b"\r\n"
                    for _ in range(200):
                        s.sendall(chunk)
                    self.fail("an endless body was accepted")
                except OSError:
                    pass
                finally:
                    s.close()
                time.sleep(2.5)  # the slow ones time out
                for s in socks:
                    s.close()
                rounds.append(rss_kb(e.proc.pid))
            time.sleep(0.5)
            r = c.completions.create(model=M, prompt="a", max_tokens=2)
            self.assertTrue(r.choices)
            after = rss_kb(e.proc.pid)
            # The floods do not grow memory (a model request afterwards
            # allocates its session as usual).
            print("rss kB before, per round, after a request:", before, rounds, after,
                  file=sys.stderr)
            self.assertLess(rounds[0] - before, 16 * 1024, (before, rounds, after))
            self.assertLess(rounds[-1] - rounds[0], 2 * 1024, (before, rounds, after))
        finally:
            e.cleanup()


class Lifecycle(unittest.TestCase):
    def test_stop_answers_every_request(self):
        # SIGTERM with no grace: every request cut off is answered (503, or
        # an error at the end of a stream already begun, or 429 when it
        # did not fit), never a connection closed with nothing sent (the
        # daemon was stopped before the handlers had sent their 503).
        e = Edge(MODEL, grace=0)
        try:
            got, lock = [], threading.Lock()

            def client(i):
                body = json.dumps({"model": M, "max_tokens": 64, "temperature": 1.0, "seed": i,
                                   "stream": i % 2 == 1,
                                   "messages": [{"role": "user", "content": "Tell a long story."}]})
                req = (f"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: {len(body)}\r\n"
                       f"\r\n{body}").encode()
                s = socket.create_connection(("127.0.0.1", e.port), timeout=30)
                s.sendall(req)
                data = b""
                while True:
                    d = s.recv(65536)
                    if not d:
                        break
                    data += d
                s.close()
                with lock:
                    got.append(data.split(b" ", 2)[1] if data.startswith(b"HTTP/") else b"nothing")
            ts = [threading.Thread(target=client, args=(i,)) for i in range(14)]
            for t in ts:
                t.start()
            time.sleep(1.0)
            code, _ = e.stop()
            for t in ts:
                t.join(30)
            self.assertEqual(code, 0)
            self.assertEqual(len(got), 14)
            self.assertNotIn(b"nothing", got, got)
            self.assertTrue(set(got) <= {b"200", b"503", b"429"}, got)
        finally:
            e.cleanup()

    def test_bearer_tokens_and_sigterm(self):
        e = Edge(MODEL, auth=True)
        try:
            tok = e.token("oncology", "triage-bot")
            self.assertTrue(tok.startswith("fie_"))
            with self.assertRaises(openai.AuthenticationError):
                OpenAI(base_url=e.url + "/v1", api_key="wrong-token", max_retries=0) \
                    .chat.completions.create(model=M, max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])
            good = OpenAI(base_url=e.url + "/v1", api_key=tok, max_retries=0)
            r = good.chat.completions.create(model=M, max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])
            self.assertTrue(r.choices[0].message.content is not None)
            # The model list answers token holders only, as OpenAI's.
            with self.assertRaises(openai.AuthenticationError):
                OpenAI(base_url=e.url + "/v1", api_key="wrong-token", max_retries=0).models.list()
            self.assertEqual([m.id for m in good.models.list().data], [M])
            # Optional whitespace around the header's value is not the token.
            out = subprocess.run(
                ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", e.url + "/v1/models",
                 "-H", f"Authorization: Bearer   {tok}\t "],
                check=True, capture_output=True, text=True).stdout
            self.assertEqual(out, "200")
            # The tenant and application are in the audit log.
            rows = subprocess.run(["sqlite3", f"{e.dir}/edge.db",
                                   "SELECT tenant, application FROM audit ORDER BY seq DESC LIMIT 1"],
                                  capture_output=True, text=True).stdout.strip()
            self.assertEqual(rows, "oncology|triage-bot")
            # SIGHUP reloads; the agent keeps serving.
            e.proc.send_signal(1)
            time.sleep(0.3)
            r = good.completions.create(model=M, prompt="a", max_tokens=2)
            # SIGTERM while a long request streams: it stops within the grace.
            got = []

            def long_request():
                try:
                    for ch in good.completions.create(model=M, prompt="Once upon a time",
                                                      max_tokens=64, stream=True):
                        got.append(ch)
                except Exception as ex:  # the stream is cut at the grace's end
                    got.append(ex)
            t = threading.Thread(target=long_request)
            t.start()
            time.sleep(0.5)
            code, took = e.stop()
            t.join(10)
            self.assertEqual(code, 0)
            self.assertLess(took, 8)
            self.assertIn("stopped", e.logs())
        finally:
            e.cleanup()


if __name__ == "__main__":
    unittest.main(verbosity=2)
