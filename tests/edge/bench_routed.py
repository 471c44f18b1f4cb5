"""Time to first token, p50/p99, for routed requests (edge -> coordinator ->
cluster worker -> back) against local ones, on one berlin-clinic edge of the
EU hospital example on loopback (not a test; run by hand):

  .venv/bin/python tests/edge/bench_routed.py [N]
"""
import socket
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from fleet import Fleet  # noqa: E402

MODEL = os.environ.get("FEDINFER_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")


def ttft(url, labels):
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"model": "smollm2-135m", "max_tokens": 1, "temperature": 0,
                       "stream": True,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    req = (f"POST /v1/chat/completions HTTP/1.0\r\nX-Data-Class: {labels}\r\n"
           f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    t0 = time.perf_counter()
    s = socket.create_connection((host, int(port)))
    s.sendall(req)
    buf, t = b"", None
    while True:
        d = s.recv(65536)
        if not d:
            break
        buf += d
        if t is None and b"data: {" in buf:
            t = time.perf_counter() - t0
    s.close()
    head = buf.split(b"\r\n\r\n")[0].decode()
    target = [l.split(":", 1)[1].strip() for l in head.split("\r\n")
              if l.lower().startswith("x-fedinfer-target:")]
    return t, target[0] if target else head.split("\r\n")[0]


def pct(v, p):
    v = sorted(v)
    return v[int(p * (len(v) - 1) + 0.5)]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    f = Fleet(MODEL)
    try:
        url = f.add_edge("berlin-clinic", "eu-central", extra="clusters = fra-gpu-1\n")
        f.wait_ready()
        kinds = (("local", "phi", "berlin-clinic"), ("routed", "internal", "fra-gpu-1"))
        ts = {k[0]: [] for k in kinds}
        for kind, labels, want in kinds:
            ttft(url, labels)  # warm-up
        for _ in range(n):  # alternate, so that both see the same load
            for kind, labels, want in kinds:
                t, target = ttft(url, labels)
                assert target == want, (target, want)
                ts[kind].append(t)
        for kind, labels, want in kinds:
            v = ts[kind]
            print(f"{kind:7s} ({want}): TTFT p50 {pct(v, .5) * 1e3:7.2f} ms  "
                  f"p99 {pct(v, .99) * 1e3:7.2f} ms  ({n} requests)")
    finally:
        f.close()


if __name__ == "__main__":
    main()
