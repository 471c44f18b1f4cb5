"""Starts and stops a `fedinfer edge` for the Python tests."""
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

BUILD = os.environ.get("FEDINFER_BUILD", os.path.join(os.path.dirname(__file__), "../../build"))
FEDINFER = os.path.join(BUILD, "fedinfer")
FEDCTL = os.path.join(BUILD, "fedctl")
HERE = os.path.dirname(os.path.abspath(__file__))


def die_with_parent():
    """preexec_fn: the child gets SIGTERM when the test process dies (even
    by SIGKILL, e.g. a ctest timeout), so no agent is left behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port():
    """A free port below the ephemeral range (32768-60999 on Linux): a
    client that connects to an ephemeral-range port before its server binds
    can connect to itself (TCP self-connect; ZeroMQ retries the connect
    from a new ephemeral port each time) and hold the port, so that the
    server's bind fails."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free port in 20000-31999")


class Edge:
    """An edge agent in a temporary directory, with a signed policy."""

    def __init__(self, model, policy=os.path.join(HERE, "site.policy"), extra="", auth=False,
                 grace=3):
        self.dir = tempfile.mkdtemp(prefix="edge-py.")
        d = self.dir
        self.port = free_port()
        run = lambda *a: subprocess.run(a, check=True, capture_output=True, text=True)
        run(FEDCTL, "policy", "keygen", "--out", f"{d}/sign.key")
        run(FEDCTL, "policy", "apply", policy, "-m", "test", "--store", f"{d}/ops.db",
            "--key", f"{d}/sign.key", "--bundle-out", f"{d}/v1.bundle")
        os.mkdir(f"{d}/policy")
        run(FEDCTL, "policy", "install", f"{d}/v1.bundle", "--dir", f"{d}/policy",
            "--trust", f"{d}/sign.key.pub")
        self.conf = f"{d}/edge.conf"
        with open(self.conf, "w") as f:
            f.write(f"site = berlin-clinic\nport = {self.port}\nmodel = {model}\n"
                    f"model_name = smollm2-135m\nthreads = 2\nn_ctx = 512\nconcurrency = 4\n"
                    f"queue = 8\nmax_tokens = 64\ndefault_max_tokens = 8\ndb = {d}/edge.db\n"
                    f"policy_dir = {d}/policy\npolicy_key = {d}/sign.key.pub\n"
                    f"shutdown_grace_s = {grace}\nauth = {1 if auth else 0}\n{extra}")
        self.log = open(f"{d}/edge.log", "w+")
        self.proc = subprocess.Popen([FEDINFER, "edge", "--config", self.conf],
                                     stderr=self.log, stdout=self.log,
                                     preexec_fn=die_with_parent)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(200):
            if self.proc.poll() is not None:
                raise RuntimeError("edge exited: " + self.logs())
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if json.load(r)["status"] == "ok":
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("edge did not come up: " + self.logs())

    def logs(self):
        self.log.flush()
        with open(f"{self.dir}/edge.log") as f:
            return f.read()

    def token(self, tenant, app):
        out = subprocess.run([FEDINFER, "edge", "token", "add", "--config", self.conf,
                              "--tenant", tenant, "--app", app],
                             check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def stop(self, sig=signal.SIGTERM, timeout=15):
        """Stops the agent; returns its exit status and how long it took."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9, time.monotonic() - t0
        return self.proc.returncode, time.monotonic() - t0

    def cleanup(self):
        self.stop()
        self.log.close()
        subprocess.run(["rm", "-rf", self.dir])
