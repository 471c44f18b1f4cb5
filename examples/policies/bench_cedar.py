#!/usr/bin/env python3
"""bench_cedar.py - the policy engine against Cedar (cedarpy) on equivalent policies.

Runs `fedctl policy bench` and then Cedar on the same generated policies of
1, 10 and 100 rules over the same 10 targets, checks that both permit the
same targets and choose the same one, and prints both with their ratio.

The generator mirrors fi_policy_bench_text() in policy/policy_bench.c. Rule i
has shape i % 5; in Cedar:
  0 permit  route  when resource.models.contains(context.model) && resource.cost < 1 + i % 10
  1 forbid  route  when context.labels.contains("l<i%8>") && resource.region != context.origin_region
  2 permit  route  when ["l<i%8>", "l<(i+1)%8>"].containsAll(context.labels) && resource in Jurisdiction::"J<i%3>"
  3 forbid  route  when context.labels.contains("l<i%8>") && !resource.certifications.contains("cert<i%4>")
  4 permit  prefer when resource.tier == i % 3      (@score annotation; Cedar has no soft rules, so a
                                                    prefer rule is a permit of a second action and the
                                                    score is summed from the determining policies)
Nesting (`target within "J0"`) is Cedar's entity hierarchy (`resource in Jurisdiction::"J0"`).
One decision = one request against 10 targets: one is_authorized_batch call with 10 "route"
requests, plus 10 "prefer" requests when the policy has prefer rules. Policies and entities are
parsed once (PolicySet, Entities handles), so the timing is evaluation plus the binding's
per-call overhead (request dicts in, results out), as a Python caller of Cedar pays it.

usage: python3 examples/policies/bench_cedar.py [--fedctl build/fedctl] [--iterations N]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

try:
    import cedarpy
except ImportError:
    sys.exit("bench_cedar.py: cedarpy is not installed (pip install cedarpy)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
ALL_CERTS = ["cert0", "cert1", "cert2", "cert3"]
ALL_MODELS = ["m0", "m1", "m2"]


def targets():
    """(name, region, tier, cost, certifications, models) of the 10 targets, in policy order."""
    out = [("s0", "r0", 0, 9, ALL_CERTS, ALL_MODELS), ("s1", "r2", 1, 9, ALL_CERTS, ALL_MODELS)]
    for c in range(8):
        out.append((f"c{c}", f"r{c % 4}", c % 3, (c * 7) % 10, [f"cert{c % 4}", f"cert{(c + 1) % 4}"],
                    [f"m{c % 3}", f"m{(c + 1) % 3}"]))
    return out


def entities():
    ents = []
    def ent(typ, eid, attrs=None, parents=()):
        ents.append({"uid": {"type": typ, "id": eid}, "attrs": attrs or {},
                     "parents": [{"type": t, "id": i} for t, i in parents]})
    ent("Jurisdiction", "U")
    ent("Jurisdiction", "J0", parents=[("Jurisdiction", "U")])
    ent("Jurisdiction", "J1", parents=[("Jurisdiction", "U")])
    ent("Jurisdiction", "J2")
    for r, j in (("r0", "J0"), ("r1", "J0"), ("r2", "J1"), ("r3", "J2")):
        ent("Region", r, parents=[("Jurisdiction", j)])
    for name, region, tier, cost, certs, models in targets():
        ent("Target", name, {"kind": "site" if name.startswith("s") else "cluster", "region": region,
                             "tier": tier, "cost": cost, "certifications": certs, "models": models},
            parents=[("Region", region)])
    ent("Site", "s0")
    return ents


def policies(n):
    """Cedar text of the n-rule policy, and the score of each policy id (policy0, policy1, ...)."""
    text, scores = [], {}
    for i in range(n):
        k = i % 5
        if k == 0:
            p = (f'permit(principal, action == Action::"route", resource) when {{ '
                 f'resource.models.contains(context.model) && resource.cost < {1 + i % 10} }};')
        elif k == 1:
            p = (f'forbid(principal, action == Action::"route", resource) when {{ '
                 f'context.labels.contains("l{i % 8}") && resource.region != context.origin_region }};')
        elif k == 2:
            p = (f'permit(principal, action == Action::"route", resource) when {{ '
                 f'["l{i % 8}", "l{(i + 1) % 8}"].containsAll(context.labels) && '
                 f'resource in Jurisdiction::"J{i % 3}" }};')
        elif k == 3:
            p = (f'forbid(principal, action == Action::"route", resource) when {{ '
                 f'context.labels.contains("l{i % 8}") && !resource.certifications.contains("cert{i % 4}") }};')
        else:
            p = (f'permit(principal, action == Action::"prefer", resource) when {{ '
                 f'resource.tier == {i % 3} }};')
            scores[f"policy{i}"] = 1 + i % 7
        text.append(p)
    return "\n".join(text), scores


def cedar_decide(ps, ents, has_prefer):
    ctx = {"labels": ["l1"], "model": "m1", "origin_region": "r0"}
    reqs = [{"principal": 'Site::"s0"', "action": 'Action::"route"', "resource": f'Target::"{t[0]}"', "context": ctx}
            for t in targets()]
    if has_prefer:
        reqs += [{"principal": 'Site::"s0"', "action": 'Action::"prefer"', "resource": f'Target::"{t[0]}"',
                  "context": ctx} for t in targets()]
    return cedarpy.is_authorized_batch(reqs, ps, ents)


def cedar_outcome(results, scores):
    """permitted target names and the chosen one (highest score, first on ties)."""
    names = [t[0] for t in targets()]
    permitted = [names[i] for i in range(10) if results[i].allowed]
    best, best_score = None, None
    for i in range(10):
        if not results[i].allowed:
            continue
        s = 0
        if len(results) > 10 and results[10 + i].allowed:
            s = sum(scores.get(pid, 0) for pid in results[10 + i].diagnostics.reasons)
        if best is None or s > best_score:
            best, best_score = names[i], s
    return permitted, best


def bench_cedar(n, iters):
    text, scores = policies(n)
    ps = cedarpy.PolicySet.from_str(text)
    ents = cedarpy.Entities.from_json_str(json.dumps(entities()))
    has_prefer = bool(scores)
    res = cedar_decide(ps, ents, has_prefer)
    for r in res:
        if r.diagnostics.errors:
            sys.exit(f"bench_cedar.py: Cedar reported errors for {n} rules: {r.diagnostics.errors}")
    permitted, chosen = cedar_outcome(res, scores)
    for _ in range(max(100, iters // 10)):
        cedar_decide(ps, ents, has_prefer)
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        cedar_decide(ps, ents, has_prefer)
    total = time.perf_counter_ns() - t0
    lat = []
    for _ in range(iters):
        a = time.perf_counter_ns()
        cedar_decide(ps, ents, has_prefer)
        lat.append(time.perf_counter_ns() - a)
    lat.sort()
    return {"dps": iters * 1e9 / total, "p50": lat[len(lat) // 2] / 1000, "p99": lat[int(len(lat) * 0.99)] / 1000,
            "permitted": permitted, "chosen": chosen}


def bench_ours(fedctl, iters):
    out = subprocess.run([fedctl, "policy", "bench", os.path.join(HERE, "eu-hospital.policy"),
                          "--iterations", str(iters)], check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        m = re.match(r"generated-(\d+)\s+\d+\s+\d+\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+) permitted, chosen (\S+)", line)
        if m:
            rows[int(m.group(1))] = {"dps": float(m.group(2)), "p50": float(m.group(3)), "p99": float(m.group(4)),
                                     "npermitted": int(m.group(5)), "chosen": m.group(6)}
    return out, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fedctl", default=os.environ.get("FEDCTL", os.path.join(ROOT, "build", "fedctl")))
    ap.add_argument("--iterations", type=int, default=200000, help="fedctl iterations per row")
    ap.add_argument("--cedar-iterations", type=int, default=5000, help="Cedar iterations per row")
    a = ap.parse_args()
    raw, ours = bench_ours(a.fedctl, a.iterations)
    print(raw)
    try:
        from importlib.metadata import version
        cv = version("cedarpy")
    except Exception:  # the version is only printed
        cv = "?"
    print(f"cedarpy {cv}, Python {sys.version.split()[0]}, "
          f"{a.cedar_iterations} decisions per row (one decision: 10 targets)")
    print(f"{'rules':>5} {'ours dec/s':>12} {'cedar dec/s':>12} {'ours p50 us':>12} {'cedar p50 us':>13} "
          f"{'ours p99 us':>12} {'cedar p99 us':>13} {'p50 ratio':>10}  same decision")
    ok = True
    for n in (1, 10, 100):
        c = bench_cedar(n, a.cedar_iterations)
        o = ours.get(n)
        if not o:
            sys.exit(f"bench_cedar.py: no generated-{n} row in the fedctl output")
        same = len(c["permitted"]) == o["npermitted"] and (c["chosen"] or "none") == o["chosen"]
        ok &= same
        print(f"{n:>5} {o['dps']:>12.0f} {c['dps']:>12.0f} {o['p50']:>12.3f} {c['p50']:>13.3f} "
              f"{o['p99']:>12.3f} {c['p99']:>13.3f} {c['p50'] / o['p50']:>9.0f}x  "
              f"{'yes' if same else 'NO'} ({len(c['permitted'])} permitted, chosen {c['chosen'] or 'none'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
