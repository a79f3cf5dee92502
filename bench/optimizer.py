"""AdamW's step on a model of about 10M parameters, side by side in one run: eager's foreach
and fused implementations, eager's for-loop, Inductor and boo compiling `opt.step`, and boo
with every composite forced off.

The step is memory-bound: it reads parameters, gradients and both moments and writes three
of them back, so one fused pass over that memory is the limit. Each backend gets its own
copy of the model, the same gradients and fresh state, is warmed up, then all are timed
interleaved (boo_backend.benchmarking). After the timing the parameters of every backend
are compared with eager foreach's (same gradients, same number of steps).

    python bench/optimizer.py [--steps 20] [--runs 3] [--warmup 3] [--width 1024 --layers 9]
                              [--backends eager-foreach,eager-fused,...] [--out bench/optimizer]
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from boo_backend.benchmarking import host_info, host_line, interleaved, summarize, timing_line  # noqa: E402

# name: (AdamW keyword arguments, torch.compile backend or None, its options)
BACKENDS = {
    "eager-foreach": ({"foreach": True}, None, {}),
    "eager-fused": ({"fused": True}, None, {}),
    "eager-for-loop": ({"foreach": False}, None, {}),
    "inductor": ({"foreach": True}, "inductor", {}),
    "boo": ({"foreach": True}, "boo", {}),
    "boo-decomposed": ({"foreach": True}, "boo", {"force_decompose": "all"}),
}


def model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--out", default="bench/optimizer")
    args = ap.parse_args(argv)
    names = args.backends.split(",")
    base = model(args.width, args.layers)
    count = sum(p.numel() for p in base.parameters())
    grads = [torch.randn_like(p) * 1e-2 for p in base.parameters()]
    info = host_info()
    print(host_line(info))
    print(f"AdamW(lr=1e-3, weight_decay=0.01) step over {count / 1e6:.1f}M float32 parameters "
          f"({args.layers} x Linear({args.width}, {args.width}))")
    steps, models = {}, {}
    for name in names:
        kwargs, backend, options = BACKENDS[name]
        m = copy.deepcopy(base)
        for p, g in zip(m.parameters(), grads):
            p.grad = g.clone()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, **kwargs)
        step = opt.step if backend is None else torch.compile(opt.step, backend=backend, options=options or None)
        for _ in range(args.warmup):
            step()
        steps[name], models[name] = step, m
    times = interleaved(steps, args.steps, args.runs)
    reference = models.get("eager-foreach")
    rows = []
    print(timing_line(f"{args.runs} runs of {args.steps} steps after {args.warmup} warm-up steps"))
    print(f"{'backend':16s} {'min ms':>8s} {'median ms':>10s} {'runs':>22s} {'vs eager-foreach':>17s} {'max |diff|':>11s}")
    for name in names:
        s = summarize(times[name], times.get("eager-foreach"))
        diff = max((p - q).abs().max().item() for p, q in zip(models[name].parameters(), reference.parameters())) \
            if reference is not None else float("nan")
        # every backend ran warmup + runs * steps steps on the same gradients
        rows.append({"backend": name, "params_m": round(count / 1e6, 2), **s, "max_abs_diff": diff, **info})
        print(f"{name:16s} {s['min_ms']:8.2f} {s['median_ms']:10.2f} {s['run_medians_ms']:>22s} "
              f"{s.get('speedup_vs_eager', float('nan')):16.2f}x {diff:11.2e}")
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
