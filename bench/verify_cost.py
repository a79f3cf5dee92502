"""What the checks of dynamic modules cost (BOO_VERIFY): a training loop over changing sizes.

The zoo's GPT-2 trains for --steps steps with dynamic=True (SGD), at batch sizes and sequence
lengths drawn from a fixed seeded sequence (batch 2-6, lengths 8-160: a loader padding each
batch to its longest sequence). For each policy (off, auto, all) a fresh process compiles the
model (into a cache warmed by a first, untimed process), runs the loop, and reports the loop's
seconds (compiles included, none happening on a warm cache), the number of checks and the
seconds they took (boo_backend.stats()), and the checks' share of the loop.

    python bench/verify_cost.py [--steps 60] [--out bench/verify_cost]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

POLICIES = ["off", "auto", "all"]


def sizes(steps: int) -> list[tuple[int, int]]:
    rng = random.Random(0)
    return [(rng.randint(2, 6), rng.randint(8, 160)) for _ in range(steps)]


def child(steps: int) -> None:
    import torch

    import boo_backend
    from boo_backend.zoo import MODELS

    model, _ = MODELS["gpt2"]()
    run = torch.compile(model, backend="boo", dynamic=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    for b, s in sizes(steps):
        _, batch = MODELS["gpt2"](batch=b, seq=s)
        opt.zero_grad()
        run(**batch).loss.backward()
        opt.step()
    loop = time.perf_counter() - start
    stats = boo_backend.stats()
    print(json.dumps({"loop_s": loop, "checks": stats.get("dynamic_checks", 0),
                      "check_s": stats.get("dynamic_check_s", 0.0),
                      "compiles": stats.get("iree_compiles", 0)}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="bench/verify_cost", help="writes OUT.csv")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.steps)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from boo_backend.benchmarking import host_info, host_line

    host = host_info()
    print(host_line(host))
    distinct = len(set(sizes(args.steps)))
    print(f"GPT-2 (zoo), dynamic=True, {args.steps} steps over {distinct} distinct (batch, length)")
    cache = tempfile.mkdtemp(prefix="boo-verify-cost-")
    rows = []

    def once(policy):
        env = dict(os.environ, BOO_VERIFY=policy, BOO_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--steps", str(args.steps)],
                             env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    once("auto")  # fills the cache: the timed processes compile nothing
    print(f"{'policy':<6} {'loop s':>8} {'checks':>7} {'check s':>8} {'share':>7}")
    for policy in POLICIES:
        r = once(policy)
        r["share_pct"] = 100 * r["check_s"] / r["loop_s"]
        print(f"{policy:<6} {r['loop_s']:>8.2f} {r['checks']:>7} {r['check_s']:>8.2f} {r['share_pct']:>6.1f}%")
        rows.append({"policy": policy, "steps": args.steps, "distinct_sizes": distinct, **r, **host})
    import csv

    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
