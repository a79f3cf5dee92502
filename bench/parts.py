"""Each IREE part of a training step against ATen running the same ops on the same inputs.

A part is one IREE module of boo's graph (a run of ops between ATen's matmuls and
attention, or the whole graph). For each part, this script keeps the inputs of its call in
the third step, then times, alone: the part as boo calls it (argument import, the call on
the driver boo chose, results; "aten" when the part itself runs in ATen, runtime.ATEN), and
the part's own graph run op by op by ATen on torch's threads. Each call follows a torch
parallel region, as in the step (see cores.after_torch_work). The totals weigh each part
by its calls per step (the layers of a model share their parts).

    python bench/parts.py [--model mlp|transformer|ln_gelu|gpt2|llama] [--layers N] [--calls 9] [--out F.csv]

The small models are bench/steps.py's workloads, the large ones bench/scale.py's. boo's
compile cache is off for the run; a part that torch's own caches serve from an earlier run
unpickles its graph from boo's cache entry (Lowered.graph).

How to read it:
- The ATen side runs the part's graph as boo built it (after its decompositions and
  rewrites), so it is not eager's time for the same work: a fused cross-entropy backward is
  several ATen ops where eager has one kernel, and a part's copies are free in IREE and
  are passes in ATen.
- Times taken alone are lower bounds. In the step, an IREE call right after a matmul finds
  torch's OpenMP thread spinning on the other core and takes longer (bench/RESULTS.md,
  sixteenth session).
- Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402  (bench/ is not a package)
import steps  # noqa: E402
from boo_backend import part  # noqa: E402
from boo_backend.benchmarking import host_line  # noqa: E402
from boo_backend.lower import arguments  # noqa: E402
from boo_backend.cores import after_torch_work  # noqa: E402

# Ops that move no data (views, getitem), left out of a part's op list.
_QUIET = ("view", "getitem", "permute", "unsqueeze", "squeeze", "expand", "_unsafe_view", "alias", "t")


def _step_fn(name: str, layers: int | None):
    """One training step of boo's compiled model, cache off."""
    options = {"cache": False}
    if name in steps.WORKLOADS:
        model, x, y = steps.build(name)
        run = torch.compile(model, backend="boo", options=options)
        return lambda: steps.step(run, model, x, y)
    model, tokens = scale.build(name, layers)
    scale.BACKENDS["boo-parts"] = ("boo", options)
    trainer = scale.Trainer(model, "boo-parts")
    return lambda: trainer.step(tokens)


def _median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        after_torch_work()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _ops(core) -> str:
    names = collections.Counter(
        str(n.target).split(".")[-2] if "." in str(n.target) else str(n.target)
        for n in core.graph.nodes if n.op == "call_function")
    shown = [(k, v) for k, v in names.most_common() if k.split(" ")[-1].strip(">") not in _QUIET]
    return " ".join(k if v == 1 else f"{k} x{v}" for k, v in shown[:6])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--calls", type=int, default=9, help="timed calls per side and part (median)")
    parser.add_argument("--out", default=None, help="CSV of the table")
    args = parser.parse_args()

    first: dict[str, tuple] = {}
    per_step: collections.Counter = collections.Counter()
    forward = part.IreePart.forward

    on = []  # recording, during the third step only

    def recording(self, *a, **k):
        if on and self.function is not None and self.lowered.graph() is not None:
            name = self.function.graph
            per_step[name] += 1
            if name not in first:
                first[name] = (self, [x.clone() if isinstance(x, torch.Tensor) else x for x in a], k)
        return forward(self, *a, **k)

    part.IreePart.forward = recording  # before the compile: a graph may keep its part's bound forward
    step = _step_fn(args.model, args.layers)
    step()  # compile
    step()
    on.append(True)
    step()
    part.IreePart.forward = forward

    print(host_line())
    print(f"{args.model}: {len(first)} IREE parts, {sum(per_step.values())} IREE calls a step")
    rows, total = [], collections.Counter()
    for name in sorted(first):
        p, inputs, kwargs = first[name]
        tensors = arguments(p.lowered.inputs, inputs)
        core = p.lowered.graph()
        for _ in range(2):  # warm both sides
            p(*inputs, **kwargs)
            core(*tensors)
        iree_ms = _median_ms(lambda: p(*inputs, **kwargs), args.calls)
        aten_ms = _median_ms(lambda: core(*tensors), args.calls)
        calls = per_step[name]
        total["iree"] += iree_ms * calls
        total["aten"] += aten_ms * calls
        row = {"part": name, "calls_per_step": calls, "driver": p.function.driver, "boo_ms": round(iree_ms, 3),
               "aten_ms": round(aten_ms, 3), "aten_over_boo": round(aten_ms / iree_ms, 2), "ops": _ops(core)}
        rows.append(row)
        print(f"{name:30} x{calls:<3} {row['driver'] or '?':10} boo {iree_ms:9.3f} ms  ATen {aten_ms:9.3f} ms  "
              f"ATen/boo {row['aten_over_boo']:5.2f}  {row['ops']}")
    print(f"per step, weighed by calls: boo {total['iree']:.1f} ms, ATen {total['aten']:.1f} ms "
          f"(ATen/boo {total['aten'] / max(total['iree'], 1e-9):.2f})")
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["part"])
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
