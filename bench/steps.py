"""Whole training steps (forward + loss + backward), side by side in one run:
eager, inductor, boo, and boo with every composite forced off.

For each workload and backend it reports the median step time and its ratio to eager, the
first call's time in a fresh process with a cold cache and again with a warm one, and the
largest gradient difference from eager. Writes a CSV and a PNG bar chart.

    python bench/steps.py [--steps 20] [--workloads ln_gelu,mlp,transformer]
                          [--backends eager,inductor,boo,boo-decomposed] [--out bench/steps]

Uses only boo's public API (the "boo" backend name and its options).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

BACKENDS = ["eager", "inductor", "boo", "boo-decomposed"]


def _ln_gelu():
    return nn.Sequential(nn.LayerNorm(1024), nn.GELU()), (4096, 1024), (4096, 1024)


def _mlp():
    model = nn.Sequential(nn.Linear(512, 1024), nn.LayerNorm(1024), nn.GELU(), nn.Linear(1024, 512))
    return model, (256, 512), (256, 512)


def _transformer():
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=0.0,
                                       activation="gelu", batch_first=True)
    return layer, (8, 128, 256), (8, 128, 256)


WORKLOADS = {"ln_gelu": _ln_gelu, "mlp": _mlp, "transformer": _transformer}


class WithLoss(nn.Module):
    """The model and its loss, compiled together: the loss is part of the step."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.mse_loss(self.model(x), y)


def build(workload: str):
    torch.manual_seed(0)
    model, in_shape, out_shape = WORKLOADS[workload]()
    g = torch.Generator().manual_seed(1)
    return WithLoss(model), torch.randn(in_shape, generator=g), torch.randn(out_shape, generator=g)


def compiled(model, backend: str):
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model, backend="inductor")
    options = {"force_decompose": "all"} if backend == "boo-decomposed" else {}
    return torch.compile(model, backend="boo", options=options)


def step(run, model, x, y):
    for p in model.parameters():
        p.grad = None
    loss = run(x, y)
    loss.backward()
    return loss


def first_call(workload: str, backend: str) -> float:
    """Child process: seconds for the first step, compile included."""
    model, x, y = build(workload)
    run = compiled(model, backend)
    start = time.perf_counter()
    step(run, model, x, y)
    return time.perf_counter() - start


def _child(workload, backend, cache_dir) -> float:
    env = dict(os.environ, BOO_CACHE_DIR=cache_dir, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"))
    cmd = [sys.executable, __file__, "--child", workload, backend]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{workload}/{backend} child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["first_call_s"]


def measure(workload: str, backend: str, steps: int, ref_grads) -> dict:
    torch._dynamo.reset()  # each run compiles afresh; Dynamo's recompile limit would mix runs
    model, x, y = build(workload)
    run = compiled(model, backend)
    step(run, model, x, y)  # compile
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for _ in range(3):
        step(run, model, x, y)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(run, model, x, y)
        times.append((time.perf_counter() - start) * 1e3)
    diff = rel = 0.0
    if ref_grads is not None:
        for name, ref in ref_grads.items():
            d = (grads[name] - ref).abs().max().item()
            diff = max(diff, d)
            rel = max(rel, d / max(ref.abs().max().item(), 1e-30))
    q = statistics.quantiles(times, n=4)
    return {"median_ms": statistics.median(times), "iqr_pct": 100 * (q[2] - q[0]) / statistics.median(times),
            "grads": grads, "max_grad_diff": diff, "max_grad_rel_diff": rel}


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        vals = [next((r["speedup_vs_eager"] for r in rows if r["workload"] == w and r["backend"] == b), 0)
                for w in workloads]
        ax.bar([k + i * width for k in range(len(workloads))], vals, width, label=b)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([k + width * (len(backends) - 1) / 2 for k in range(len(workloads))], workloads)
    ax.set_ylabel("speed-up over eager (step time)")
    ax.set_title(f"training step, {torch.get_num_threads()} CPU threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--out", default="bench/steps", help="writes OUT.csv and OUT.png")
    p.add_argument("--no-compile-times", action="store_true", help="skip the cold/warm first-call runs")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps({"first_call_s": first_call(*args.child)}))
        return 0

    backends = args.backends.split(",")
    rows = []
    for workload in args.workloads.split(","):
        ref = measure(workload, "eager", args.steps, None)
        eager_first = None
        for backend in backends:
            print(f"{workload} / {backend} ...", file=sys.stderr, flush=True)
            r = ref if backend == "eager" else measure(workload, backend, args.steps, ref["grads"])
            cold = warm = float("nan")
            if not args.no_compile_times:
                with tempfile.TemporaryDirectory() as cache:
                    cold = _child(workload, backend, cache)
                    warm = _child(workload, backend, cache)
                eager_first = cold if backend == "eager" else eager_first
            rows.append({
                "workload": workload, "backend": backend,
                "step_ms": round(r["median_ms"], 3), "iqr_pct": round(r["iqr_pct"], 1),
                "speedup_vs_eager": round(ref["median_ms"] / r["median_ms"], 3),
                "first_call_cold_s": round(cold, 3), "first_call_warm_s": round(warm, 3),
                "warm_minus_eager_first_s": "" if eager_first is None else round(warm - eager_first, 3),
                "max_grad_diff": f"{r['max_grad_diff']:.2e}", "max_grad_rel_diff": f"{r['max_grad_rel_diff']:.2e}",
            })
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).rjust(widths[c]) for c in cols))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    try:
        chart(rows, args.out + ".png")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); no PNG written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
