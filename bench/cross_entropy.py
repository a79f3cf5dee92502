"""A language model's loss alone: F.cross_entropy over [rows, classes] float32 logits, forward
and backward timed apart, side by side in one run: eager, Inductor, boo and boo with every
composite forced off. boo's forward saves a row statistic, not the log-probabilities
(boo_backend/joint.py).

    python bench/cross_entropy.py [--rows 512] [--classes 32000] [--calls 15] [--warmup 30]

Each backend is warmed up first (boo times its graphs against Dynamo's in eager over its
first calls), then the backends take turns, one forward and backward each per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from boo_backend.benchmarking import host_line  # noqa: E402

BACKENDS = {"eager": (None, {}), "inductor": ("inductor", {}), "boo": ("boo", {}),
            "boo-decomposed": ("boo", {"force_decompose": "all"})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--classes", type=int, default=32000)
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--backends", default=",".join(BACKENDS))
    args = p.parse_args()
    torch.manual_seed(0)
    x = (torch.randn(args.rows, args.classes) * 3).requires_grad_()
    y = torch.randint(0, args.classes, (args.rows,))

    def loss(x, y):
        return F.cross_entropy(x, y)

    fns = {}
    for name in args.backends.split(","):
        compiler, options = BACKENDS[name]
        fns[name] = loss if compiler is None else torch.compile(loss, backend=compiler, options=options or None)
    times = {name: ([], []) for name in fns}
    grads = {}
    for name, fn in fns.items():
        for _ in range(args.warmup):
            x.grad = None
            fn(x, y).backward()
        grads[name] = x.grad
    for _ in range(args.calls):
        for name, fn in fns.items():
            x.grad = None
            start = time.perf_counter()
            out = fn(x, y)
            middle = time.perf_counter()
            out.backward()
            times[name][0].append(middle - start)
            times[name][1].append(time.perf_counter() - middle)
    print(host_line())
    print(f"F.cross_entropy on [{args.rows}, {args.classes}] float32, median of {args.calls} calls:")
    base = [statistics.median(t) for t in times.get("eager", next(iter(times.values())))]
    for name, (fwd, bwd) in times.items():
        f, b = statistics.median(fwd) * 1e3, statistics.median(bwd) * 1e3
        diff = (grads[name] - grads[next(iter(grads))]).abs().max().item()
        print(f"  {name:15s} forward {f:7.2f} ms ({base[0] * 1e3 / f:5.2f}x eager)  "
              f"backward {b:7.2f} ms ({base[1] * 1e3 / b:5.2f}x eager)  gradient diff {diff:.1e}")


if __name__ == "__main__":
    main()
