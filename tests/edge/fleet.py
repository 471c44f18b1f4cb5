"""A whole fleet on loopback for the end-to-end tests: a coordinator, one
cluster worker (fra-gpu-1 of the EU hospital example) and edge agents,
each enrolled with its own key through one-time tokens."""
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request

from edgeproc import FEDCTL, FEDINFER, die_with_parent, free_port

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
EU_HOSPITAL = os.path.join(ROOT, "examples/policies/eu-hospital.policy")


class Fleet:
    def __init__(self, model, policy=EU_HOSPITAL):
        self.model = os.path.abspath(model)  # the processes run in a scratch folder
        self.dir = tempfile.mkdtemp(prefix="edge-fleet.")
        self.procs = {}
        d = self.dir
        self.fabric = free_port()
        self.enrol = free_port()
        for k in ("coord", "op", "shard1"):
            self.run(FEDINFER, "keygen", k)
        self.write("coordinator.conf", f"db = {d}/coordinator.db\nsecret_key = {d}/coord.key\n"
                   f"bind = tcp://127.0.0.1:{self.fabric}\nenrol_bind = tcp://127.0.0.1:{self.enrol}\n"
                   f"policy_check_key = {d}/sign.key.pub\n")
        self.run(FEDINFER, "coordinator", "--config", f"{d}/coordinator.conf", "--init",
                 "--operator-key", f"{d}/op.pub")
        # The policy: signed, stored where the coordinator enforces it.
        self.run(FEDCTL, "policy", "keygen", "--out", f"{d}/sign.key")
        self.run(FEDCTL, "policy", "apply", policy, "-m", "e2e", "--store", f"{d}/coordinator.db",
                 "--key", f"{d}/sign.key", "--bundle-out", f"{d}/v1.bundle")
        self.start("coordinator", [FEDINFER, "coordinator", "--config", f"{d}/coordinator.conf"])
        self.write("fedctl.conf", f"coordinator = tcp://127.0.0.1:{self.fabric}\n"
                   f"coordinator_key = {d}/coord.pub\nsecret_key = {d}/op.key\n")
        tok = self.ctl("enrol", "--role", "cluster", "--site", "fra-gpu-1", "--region",
                       "eu-central", "--ttl", "300")
        self.write("shard.conf", f"coordinator = tcp://127.0.0.1:{self.fabric}\n"
                   f"enrol_endpoint = tcp://127.0.0.1:{self.enrol}\ncoordinator_key = {d}/coord.pub\n"
                   f"secret_key = {d}/shard1.key\nmodel = {self.model}\nmodel_name = smollm2-135m\n"
                   f"site = fra-gpu-1\nregion = eu-central\ncapacity = 4\nthreads = 1\nn_ctx = 1024\n"
                   f"max_tokens = 800\n")
        self.start("shard", [FEDINFER, "shard", "--config", f"{d}/shard.conf", "--enrol", tok])
        self.edges = {}

    def run(self, *a, env=None):
        e = dict(os.environ, **(env or {}))
        r = subprocess.run(a, cwd=self.dir, capture_output=True, text=True, env=e)
        if r.returncode != 0:
            raise RuntimeError(f"{a}: {r.returncode}: {r.stderr}")
        return r.stdout.strip()

    def ctl(self, *a):
        return self.run(FEDCTL, *a, env={"FEDCTL_CONFIG": f"{self.dir}/fedctl.conf"})

    def write(self, name, text):
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(text)

    def start(self, name, argv, env=None, stdin_text=None):
        log = open(os.path.join(self.dir, name + ".log"), "w")
        p = subprocess.Popen(argv, cwd=self.dir, stdout=log, stderr=log,
                             stdin=subprocess.PIPE if stdin_text is not None else None,
                             env=dict(os.environ, **(env or {})), preexec_fn=die_with_parent)
        if stdin_text is not None:
            p.stdin.write(stdin_text.encode())
            p.stdin.close()
        self.procs[name] = (p, log)

    def log(self, name):
        with open(os.path.join(self.dir, name + ".log")) as f:
            return f.read()

    def add_edge(self, site, region, bundle=None, extra=""):
        """Enrols and starts an edge for site; bundle: the signed policy it holds."""
        d = self.dir
        self.run(FEDINFER, "keygen", site)
        os.makedirs(f"{d}/{site}-policy", exist_ok=True)
        self.run(FEDCTL, "policy", "install", bundle or f"{d}/v1.bundle", "--dir",
                 f"{d}/{site}-policy", "--trust", f"{d}/sign.key.pub")
        tok = self.ctl("enrol", "--role", "edge", "--site", site, "--region", region, "--ttl", "300")
        port = free_port()
        self.write(f"{site}.conf",
                   f"site = {site}\nregion = {region}\nport = {port}\nmodel = {self.model}\n"
                   f"model_name = smollm2-135m\nthreads = 1\nn_ctx = 1024\nconcurrency = 2\n"
                   f"max_tokens = 800\ndefault_max_tokens = 8\ndb = {d}/{site}.db\n"
                   f"policy_dir = {d}/{site}-policy\npolicy_key = {d}/sign.key.pub\n"
                   f"coordinator = tcp://127.0.0.1:{self.fabric}\ncoordinator_key = {d}/coord.pub\n"
                   f"secret_key = {d}/{site}.key\nenrol_endpoint = tcp://127.0.0.1:{self.enrol}\n"
                   f"shutdown_grace_s = 3\n{extra}")
        # the one-time token on standard input, not on the command line
        self.start(site, [FEDINFER, "edge", "--config", f"{d}/{site}.conf", "--enrol", "-"],
                   stdin_text=tok + "\n")
        self.edges[site] = f"http://127.0.0.1:{port}"
        return self.edges[site]

    def wait_ready(self, timeout=60):
        """Until every edge says the coordinator is up and the worker serves."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for name, (p, _) in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode}: {self.log(name)}")
            try:
                st = self.ctl("status")
                ok = any(l.startswith("cluster") and " up " in l for l in st.splitlines())
                for url in self.edges.values():
                    with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
                        ok = ok and json.load(r)["coordinator"]
                if ok:
                    return
            except (OSError, RuntimeError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError("fleet not ready: " + "".join(self.log(n) for n in self.procs))

    def stop(self, name, sig=signal.SIGTERM):
        p, log = self.procs.pop(name)
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
        return p.returncode

    def close(self):
        for name in list(self.procs)[::-1]:
            self.stop(name)
        subprocess.run(["rm", "-rf", self.dir])
