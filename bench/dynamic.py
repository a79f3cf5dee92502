"""Dynamic against static modules: one training step at the same shape, side by side in one run.

Backends: eager; boo and inductor compiled with dynamic=False (one module for this shape) and
with dynamic=True (one module for every size). Every backend is compiled and warmed up first,
then timed in --runs runs of --steps rounds in rotating order (boo_backend.benchmarking). For
each workload it reports the median step time, and each compiled backend's ratio to its
static twin (static median / dynamic median, the median of the per-run ratios: above 1.0 the
dynamic module is faster) and to eager. Writes a CSV whose rows say where it ran.

    python bench/dynamic.py [--steps 20] [--runs 3] [--workloads transformer,gpt2] [--out bench/dynamic]

Workloads: `transformer` is bench/steps.py's transformer layer (d_model 256, batch 8,
sequence 128); `gpt2` is the zoo's GPT-2 (boo_backend.zoo) at batch 4, sequence 64.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BACKENDS = {  # name: (torch.compile backend or None for eager, dynamic)
    "eager": (None, None),
    "boo-static": ("boo", False),
    "boo-dynamic": ("boo", True),
    "inductor-static": ("inductor", False),
    "inductor-dynamic": ("inductor", True),
}


def _transformer():
    from steps import build

    model, x, y = build("transformer")
    return model, (x, y), lambda run, args: run(*args)


def _gpt2():
    from boo_backend.zoo import MODELS

    model, _ = MODELS["gpt2"]()
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    return Loss(), (ids,), lambda run, args: run(*args)


WORKLOADS = {"transformer": _transformer, "gpt2": _gpt2}


def step(run, model, call, args):
    for p in model.parameters():
        p.grad = None
    loss = call(run, args)
    loss.backward()
    return loss


def measure(workload: str, steps: int, runs: int, warmup: int) -> dict[str, dict]:
    from boo_backend.benchmarking import interleaved, summarize

    torch._dynamo.reset()
    fns = {}
    for name, (backend, dynamic) in BACKENDS.items():
        print(f"{workload} / {name}: compile", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        model, args, call = WORKLOADS[workload]()
        run = model if backend is None else torch.compile(model, backend=backend, dynamic=dynamic)
        step(run, model, call, args)
        fns[name] = functools.partial(step, run, model, call, args)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = interleaved(fns, steps, runs)
    out = {}
    for name in BACKENDS:
        row = summarize(times[name], times["eager"])
        twin = name.replace("-dynamic", "-static")
        if name.endswith("-dynamic"):
            row["speedup_vs_static"] = summarize(times[name], times[twin])["speedup_vs_eager"]
        out[name] = row
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--out", default="bench/dynamic", help="writes OUT.csv")
    args = p.parse_args(argv)
    if unknown := sorted(set(args.workloads.split(",")) - set(WORKLOADS)):
        p.error(f"unknown workload(s) {unknown}; use {','.join(WORKLOADS)}")

    from boo_backend.benchmarking import HOST_COLUMNS, host_info, host_line, timing_line

    host = host_info()
    print(host_line(host))
    print(timing_line(f"{args.runs} runs x {args.steps} steps after {args.warmup} warm-up steps"))
    rows = []
    print(f"{'workload':<12} {'backend':<17} {'median ms':>10} {'min ms':>8} {'vs eager':>9} {'vs static':>10}")
    for workload in args.workloads.split(","):
        for name, r in measure(workload, args.steps, args.runs, args.warmup).items():
            vs_static = r.get("speedup_vs_static")
            print(f"{workload:<12} {name:<17} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} "
                  f"{r['speedup_vs_eager']:>8.2f}x {'' if vs_static is None else f'{vs_static:.2f}x':>10}")
            rows.append({"workload": workload, "backend": name, **r, **host})
    with open(args.out + ".csv", "w", newline="") as f:
        columns = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
