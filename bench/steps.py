"""Whole training steps (forward + loss + backward), side by side in one run:
eager, inductor, boo, and boo with every composite forced off.

Every backend of a workload is built and compiled first (eager always, as the reference),
then warmed up, then timed in --runs runs of --steps rounds, each round one step of every
backend in rotating order, so the machine's noise falls on all of them alike. For each
workload and backend it reports the fastest step, the median step time (the median of the
runs' medians), each run's median and their spread, the ratio to eager (the median of the
per-run ratios), the first call's time in a fresh process with a cold cache and again with a
warm one, the largest gradient difference from eager, and for boo how many of its graphs had
their region run as Dynamo's graph in eager PyTorch by the end (measured faster there:
boo_backend/regions.py; its trial takes a small region's first 16 or so steps, hence 20 warm-up
steps). The output's header and every CSV row say where it ran (CPU model, cores, threads,
torch, IREE and torch-mlir versions).
Writes a CSV and a PNG bar chart.

    python bench/steps.py [--steps 20] [--runs 3] [--warmup 20] [--workloads ln_gelu,mlp,transformer]
                          [--backends eager,inductor,boo,boo-decomposed] [--out bench/steps]

Uses boo's public API (the "boo" backend name and its options) and its benchmarking helpers.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# name: (torch.compile backend, its options); None runs the model eagerly.
BACKENDS: dict[str, tuple[str | None, dict]] = {
    "eager": (None, {}),
    "inductor": ("inductor", {}),
    "boo": ("boo", {}),
    "boo-decomposed": ("boo", {"force_decompose": "all"}),
    # Not run by default: boo with every matmul in ATen, or every matmul in IREE (the
    # default, "boo", measures each shape and picks).
    "boo-aten-matmul": ("boo", {"aten_matmul": "always"}),
    "boo-iree-matmul": ("boo", {"aten_matmul": "never"}),
    # boo with every part in IREE: no part runs in ATen, however it measures (runtime.ATEN).
    "boo-iree-parts": ("boo", {"cpu_driver": "iree"}),
}
DEFAULT_BACKENDS = ["eager", "inductor", "boo", "boo-decomposed"]


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
    compiler, options = BACKENDS[backend]
    if compiler is None:
        return model
    return torch.compile(model, backend=compiler, options=dict(options) or None)


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


def measure(workload: str, backends: list[str], steps: int, runs: int, warmup: int) -> dict[str, dict]:
    """{backend: summary}: every backend compiled (its first step) and warmed up, then timed
    interleaved. backends[0] is eager, the reference for the gradients and the ratios."""
    from boo_backend.benchmarking import interleaved, summarize

    torch._dynamo.reset()  # once per workload: the backends' compiled models live side by side
    import boo_backend

    fns, grads, placed = {}, {}, {}
    for backend in backends:
        print(f"{workload} / {backend}: compile", file=sys.stderr, flush=True)
        model, x, y = build(workload)
        run = compiled(model, backend)
        before = len(boo_backend.placements())
        step(run, model, x, y)  # compile
        placed[backend] = boo_backend.placements()[before:]
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        fns[backend] = functools.partial(step, run, model, x, y)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    print(f"{workload}: {runs} runs x {steps} interleaved steps", file=sys.stderr, flush=True)
    times = interleaved(fns, steps, runs)
    ref = grads[backends[0]]
    out = {}
    for backend in backends:
        diff = rel = 0.0
        for name, r in ref.items():
            d = (grads[backend][name] - r).abs().max().item()
            diff = max(diff, d)
            rel = max(rel, d / max(r.abs().max().item(), 1e-30))
        # boo's graphs whose region ran as Dynamo's graph in eager by the end (regions.py).
        in_eager = sum(bool(p.in_eager) for p in placed[backend])
        out[backend] = summarize(times[backend], times[backends[0]]) | {
            "max_grad_diff": diff, "max_grad_rel_diff": rel,
            "graphs_in_eager": f"{in_eager}/{len(placed[backend])}" if placed[backend] else ""}
    return out


def chart(rows: list[dict], path: str, title: str) -> None:
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
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed interleaved rounds per run")
    p.add_argument("--runs", type=int, default=3, help="runs of --steps rounds")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps of each backend after its first")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help="comma list of " + ", ".join(BACKENDS))
    p.add_argument("--out", default="bench/steps", help="writes OUT.csv and OUT.png")
    p.add_argument("--no-compile-times", action="store_true", help="skip the cold/warm first-call runs")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps({"first_call_s": first_call(*args.child)}))
        return 0
    if args.steps < 1 or args.runs < 1 or args.warmup < 0:
        p.error("--steps and --runs must be at least 1, --warmup at least 0")
    backends = ["eager"] + [b for b in args.backends.split(",") if b and b != "eager"]
    if unknown := sorted(set(backends) - set(BACKENDS)):
        p.error(f"unknown backend(s) {unknown}; use {','.join(BACKENDS)}")
    if unknown := sorted(set(args.workloads.split(",")) - set(WORKLOADS)):
        p.error(f"unknown workload(s) {unknown}; use {','.join(WORKLOADS)}")

    from boo_backend.benchmarking import HOST_COLUMNS, host_info, host_line, timing_line

    host = host_info()
    print(host_line(host), file=sys.stderr, flush=True)
    rows = []
    for workload in args.workloads.split(","):
        results = measure(workload, backends, args.steps, args.runs, args.warmup)
        eager_first = None
        for backend in backends:
            r = results[backend]
            cold = warm = float("nan")
            if not args.no_compile_times:
                print(f"{workload} / {backend}: first calls in new processes", file=sys.stderr, flush=True)
                with tempfile.TemporaryDirectory() as cache:
                    cold = _child(workload, backend, cache)
                    warm = _child(workload, backend, cache)
                eager_first = cold if backend == "eager" else eager_first
            rows.append({
                "workload": workload, "backend": backend,
                "min_ms": round(r["min_ms"], 3), "median_ms": round(r["median_ms"], 3),
                "run_medians_ms": r["run_medians_ms"], "run_spread_pct": round(r["run_spread_pct"], 1),
                "iqr_pct": round(r["iqr_pct"], 1),
                "speedup_vs_eager": round(r["speedup_vs_eager"], 3), "speedup_runs": r["speedup_runs"],
                "first_call_cold_s": round(cold, 3), "first_call_warm_s": round(warm, 3),
                "warm_minus_eager_first_s": "" if eager_first is None else round(warm - eager_first, 3),
                "max_grad_diff": f"{r['max_grad_diff']:.2e}", "max_grad_rel_diff": f"{r['max_grad_rel_diff']:.2e}",
                "graphs_in_eager": r["graphs_in_eager"],
            } | host)
    cols = [c for c in rows[0] if c not in HOST_COLUMNS]  # the host is the header line
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print(host_line(host))
    print(timing_line(f"{args.runs} runs x {args.steps} steps after {args.warmup} warm-up steps"))
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).rjust(widths[c]) for c in cols))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        chart(rows, args.out + ".png", f"training step: {host['cpu']}, {host['torch_threads']} threads")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); no PNG written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
