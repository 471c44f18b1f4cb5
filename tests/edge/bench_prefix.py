"""Time to first token of routed chats whose long system prompt the
cluster worker has cached (prefix hit) against ones it has not (miss), on
one berlin-clinic edge of the EU hospital example on loopback (not a test;
run by hand):

  .venv/bin/python tests/edge/bench_prefix.py [N]

Each round sends a chat with a fresh system prompt (a miss: the whole
prompt is prefilled) and then the same system prompt with another
question (a hit: the worker's scheduler takes the cached blocks, and the
coordinator routes it to the worker that holds them).
"""
import json
import os
import random
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from fleet import Fleet  # noqa: E402

MODEL = os.environ.get("FEDINFER_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
WORDS = ("patient ward nurse report triage dose allergy history imaging consent "
         "discharge referral clinic schedule protocol lab result vital chart").split()


def ttft(url, system, question):
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"model": "smollm2-135m", "max_tokens": 1, "temperature": 0,
                       "stream": True, "user": "bench",
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": question}]})
    req = (f"POST /v1/chat/completions HTTP/1.0\r\nX-Data-Class: internal\r\n"
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
    assert "x-fedinfer-target: fra-gpu-1" in head.lower(), head
    return t


def pct(v, p):
    v = sorted(v)
    return v[int(p * (len(v) - 1) + 0.5)]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rnd = random.Random(7)
    f = Fleet(MODEL)
    try:
        url = f.add_edge("berlin-clinic", "eu-central", extra="clusters = fra-gpu-1\n")
        f.wait_ready()
        ttft(url, "warm up", "hello")
        miss, hit = [], []
        for i in range(n):
            system = f"Round {i}. " + " ".join(rnd.choice(WORDS) for _ in range(400))
            miss.append(ttft(url, system, "Summarise the notes."))
            hit.append(ttft(url, system, "List the doses."))
        print(f"routed chat, system prompt of ~{len(system.split())} words, {n} rounds")
        for k, v in (("miss (prefill)", miss), ("hit (cached prefix)", hit)):
            print(f"{k:22s} TTFT p50 {1000 * pct(v, 0.5):7.1f} ms  p90 {1000 * pct(v, 0.9):7.1f} ms")
    finally:
        f.close()


if __name__ == "__main__":
    main()
