"""Model coverage and speed: how much of each model's training step boo puts in IREE, what it
compiles, and how its step time compares with eager and inductor, side by side in one run.

    python bench/models.py [--models gpt2,bert | --model mypkg.mymod:make] [--steps 20] [--runs 3]
                           [--warmup 20] [--backends eager,inductor,boo] [--out bench/models]

For every model, over the forward and backward graphs of one training step (model.train(),
loss from the output, loss.backward()), it reports: graphs and ops; the share of ops that run
in IREE; the composites used, by name (read from the `graph.txt` that boo's `dump_dir` writes);
ops left to eager islands, by op, and graphs that fell back whole (recovered); cold and warm
compile seconds; and each backend's step time with its speed-up over eager. boo runs with
strict off (BOO_STRICT=0), so a model that falls back is still measured, and the fallbacks
are reported.

Step times: every backend of a model takes its first step (the compile) and --warmup more
(boo times a small region against Dynamo's graph in eager over its first 16 or so steps and
keeps the faster, boo_backend/regions.py; boo_graphs_in_eager counts the graphs whose region
ended in eager),
then --runs runs of --steps rounds are timed, each round one step of every backend in
rotating order, so the machine's noise falls on all of them alike. min: the fastest step;
median: the median of the runs' medians (the CSV also has each run's median and their
spread); speed-up: the median over runs of eager's run median / the backend's.

  cold s  boo's first training step minus eager's, with a fresh, empty cache directory (after
          boo_backend.reset() and torch._dynamo.reset()). One-time imports (Dynamo, IREE,
          torch-mlir) are paid before the first model by a tiny throwaway compile.
  warm s  the same in a NEW process given the cold run's cache directory: boo's import plus
          its first step, minus eager's first step in that process (what a user would see).

Models: the names of boo_backend.zoo.MODELS (default: all of them), or your own factory as
`--model module:function` (`module` importable from the current directory or sys.path). The
function takes no arguments and returns (model, inputs):
  - inputs a dict: the step calls model(**inputs), like the zoo (whose batches hold labels);
  - inputs a tuple or list: the step calls model(*inputs).
The loss is output.sum() if the output is a tensor, otherwise output.loss.

The CSV also has each backend's first-step seconds (inductor's uses inductor's own caches,
so it is not a cold figure), the losses, and the fwd/bwd graph split.

Writes OUT.csv (one row per model, with where it ran: CPU model, cores, threads, torch, IREE
and torch-mlir versions, also printed as the table's header) and OUT.png (step ms per backend,
% ops in IREE, cold/warm compile seconds against the 30 s / 2 s targets; needs matplotlib,
the `bench` extra). Progress goes to stderr, the aligned table to stdout.
Uses only boo's public API.
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

# name: (torch.compile backend, its options); None runs the model eagerly. A "boo" backend
# also gets strict off and the model's cache and dump directories.
BACKENDS: dict[str, tuple[str | None, dict]] = {
    "eager": (None, {}),
    "inductor": ("inductor", {}),
    "boo": ("boo", {}),
    # Not run by default: every part in IREE, however it measures against ATen (runtime.ATEN).
    "boo-iree-parts": ("boo", {"cpu_driver": "iree"}),
}
DEFAULT_BACKENDS = ("eager", "inductor", "boo")
COLD_TARGET_S, WARM_TARGET_S = 30.0, 2.0
_COMPOSITE_LINE = re.compile(r"^#\s+\S+: (\S+) v\d+ ")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load(spec: str):
    """(model, inputs) from a zoo name or `module:function`."""
    if ":" in spec:
        module, function = spec.split(":", 1)
        sys.path.insert(0, os.getcwd())
        return getattr(importlib.import_module(module), function)()
    from boo_backend.zoo import MODELS

    return MODELS[spec]()


def build(spec: str, backend: str, cache_dir=None, dump_dir=None):
    """A function running one training step (forward, loss, backward) and returning the loss."""
    model, inputs = load(spec)
    model.train()
    compiler, options = BACKENDS[backend]
    if compiler is None:
        run = model
    elif compiler == "boo":
        options = dict(options, strict=False)
        if cache_dir:
            options["cache_dir"] = str(cache_dir)
        if dump_dir:
            options["dump_dir"] = str(dump_dir)
        run = torch.compile(model, backend="boo", options=options)
    else:
        run = torch.compile(model, backend=compiler, options=dict(options) or None)
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        out = run(**inputs) if isinstance(inputs, dict) else run(*inputs)
        loss = out.sum() if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        return loss.detach()

    return step


def first_step(step) -> tuple[float, float]:
    start = time.perf_counter()
    loss = step()
    return time.perf_counter() - start, loss.item()


def warm_probe(spec: str, cache_dir: str) -> dict:
    """Child process: eager's first step, then boo's with the cache the parent filled. boo's
    import (Dynamo, IREE, torch-mlir) counts too: an eager-only process would not pay it."""
    start = time.perf_counter()
    import boo_backend  # noqa: F401  (what torch.compile's entry point loads)

    import_s = time.perf_counter() - start
    eager_s, _ = first_step(build(spec, "eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        boo_s, _ = first_step(build(spec, "boo", cache_dir))
    return {"import_s": import_s, "eager_first_s": eager_s, "boo_first_s": boo_s,
            "iree_compiles": boo_backend.stats().get("iree_compiles", 0)}


def run_probe(spec: str, cache_dir: Path) -> dict:
    env = dict(os.environ, BOO_STRICT="0", BOO_CACHE_DIR=str(cache_dir))
    env.pop("BOO_DUMP_DIR", None)  # a dump bypasses the warm path
    cmd = [sys.executable, os.path.abspath(__file__), "--warm-probe", spec, "--cache-dir", str(cache_dir)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"warm probe failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def composites_by_name(dump_dir: Path) -> collections.Counter:
    names: collections.Counter = collections.Counter()
    for graph_txt in sorted(dump_dir.glob("*/graph.txt")):
        for line in graph_txt.read_text().split("# composites:", 1)[-1].splitlines():
            if m := _COMPOSITE_LINE.match(line):
                names[m.group(1)] += 1
    return names


def boo_coverage(row: dict, placements, dump_dir: Path, caught) -> None:
    import boo_backend

    ops = sum(p.ops for p in placements)
    islands: collections.Counter = collections.Counter()
    for p in placements:
        islands.update(p.island_ops)
    names = composites_by_name(dump_dir)
    row.update(
        fwd_graphs=sum(p.kind == "forward" for p in placements),
        bwd_graphs=sum(p.kind == "backward" for p in placements),
        graphs=len(placements), ops=ops,
        pct_iree=round(100 * sum(p.iree for p in placements) / ops, 1) if ops else 0.0,
        decomposed=sum(p.decomposed for p in placements),
        composites=sum(p.composites for p in placements),
        composites_by_name=" ".join(f"{n}:{c}" for n, c in sorted(names.items())),
        island_ops=sum(p.island for p in placements),
        island_ops_by_name=" ".join(f"{n}(in {c} graphs)" for n, c in sorted(islands.items())),
        recovered=" ".join(p.name for p in placements if p.recovered),
        fallback_warnings=len({str(w.message) for w in caught
                               if issubclass(w.category, boo_backend.BooFallbackWarning)}),
    )


def _fallbacks(caught) -> set[str]:
    import boo_backend

    return {str(w.message) for w in caught if issubclass(w.category, boo_backend.BooFallbackWarning)}


def measure(spec: str, backends: list[str], steps: int, runs: int, warmup: int) -> dict:
    """One row: every backend's first step (boo's with coverage), then `warmup` steps of
    each, then the timed interleaved runs, then boo's warm probe in a new process."""
    import boo_backend
    from boo_backend.benchmarking import interleaved, summarize

    row: dict = {"model": spec}
    torch._dynamo.reset()  # once per model: the backends' compiled models live side by side
    boo_backend.reset()
    eager_first = None
    steps_by_backend = {}
    with tempfile.TemporaryDirectory(prefix="boo-models-") as tmp:
        cache, dump = Path(tmp, "cache"), Path(tmp, "dump")
        for backend in backends:
            log(f"{spec}: {backend}: first step")
            try:
                if backend != "boo":
                    own_cache = Path(tmp, f"cache-{backend}") if BACKENDS[backend][0] == "boo" else None
                    step = build(spec, backend, own_cache)
                    row[f"{backend}_first_s"], row[f"{backend}_loss"] = first_step(step)
                    eager_first = row[f"{backend}_first_s"] if backend == "eager" else eager_first
                else:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        step = build(spec, "boo", cache, dump)
                        row["boo_first_s"], row["boo_loss"] = first_step(step)
                        boo_placed = boo_backend.placements()
                        boo_coverage(row, boo_placed, dump, caught)
                        row["iree_compiles"] = boo_backend.stats().get("iree_compiles", 0)
                    for msg in sorted(_fallbacks(caught)):
                        log(f"{spec}: fallback: {msg}")
                    if eager_first is not None:
                        row["cold_s"] = row["boo_first_s"] - eager_first
                steps_by_backend[backend] = step
            except Exception as e:  # report the backend and go on with the others
                _error(row, spec, backend, e)
        for backend, step in list(steps_by_backend.items()):
            try:
                for _ in range(warmup):
                    step()
            except Exception as e:
                _error(row, spec, backend, e)
                del steps_by_backend[backend]
        if steps_by_backend:
            log(f"{spec}: {runs} runs x {steps} interleaved steps of {', '.join(steps_by_backend)}")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    times = interleaved(steps_by_backend, steps, runs)
                for msg in sorted(_fallbacks(caught)):
                    log(f"{spec}: fallback while timing: {msg}")
                for backend in steps_by_backend:
                    st = summarize(times[backend], times.get("eager"))
                    row[f"{backend}_min_ms"], row[f"{backend}_median_ms"] = st["min_ms"], st["median_ms"]
                    row[f"{backend}_run_medians_ms"] = st["run_medians_ms"]
                    row[f"{backend}_run_spread_pct"] = st["run_spread_pct"]
                    if backend != "eager" and "speedup_vs_eager" in st:
                        row[f"{backend}_speedup"] = st["speedup_vs_eager"]
                        row[f"{backend}_speedup_runs"] = st["speedup_runs"]
            except Exception as e:
                _error(row, spec, "timing", e)
        if "boo" in steps_by_backend:  # regions that ran as Dynamo's graph by the end (regions.py)
            row["boo_graphs_in_eager"] = sum(bool(p.in_eager) for p in boo_placed)
        if "boo" in steps_by_backend:
            try:
                log(f"{spec}: boo warm probe (new process)")
                probe = run_probe(spec, cache)
                row["warm_import_s"] = probe["import_s"]
                row["warm_s"] = probe["import_s"] + probe["boo_first_s"] - probe["eager_first_s"]
                row["warm_iree_compiles"] = probe["iree_compiles"]
            except Exception as e:
                _error(row, spec, "boo_warm_probe", e)
    spreads = [row[f"{b}_run_spread_pct"] for b in backends if f"{b}_run_spread_pct" in row]
    if spreads:
        row["max_run_spread_pct"] = max(spreads)
    if "boo_loss" in row and "eager_loss" in row:
        row["boo_loss_diff"] = abs(row["boo_loss"] - row["eager_loss"])
    return row


def _error(row: dict, spec: str, what: str, e: Exception) -> None:
    text = str(e).strip().splitlines()
    row[f"{what}_error"] = f"{type(e).__name__}: {text[0] if text else ''}"[:300]
    log(f"{spec}: {what} failed: {row[f'{what}_error']}")


COLUMNS = [  # (CSV key, table heading, format)
    ("model", "model", "{}"), ("graphs", "graphs", "{}"), ("ops", "ops", "{}"),
    ("pct_iree", "% IREE", "{:.1f}"), ("decomposed", "decomp", "{}"), ("composites_by_name", "composites", "{}"),
    ("island_ops", "islands", "{}"), ("cold_s", "cold s", "{:.1f}"), ("warm_s", "warm s", "{:.2f}"),
    ("eager_min_ms", "eager min", "{:.2f}"), ("eager_median_ms", "eager ms", "{:.2f}"),
    ("inductor_min_ms", "inductor min", "{:.2f}"), ("inductor_median_ms", "inductor ms", "{:.2f}"),
    ("boo_min_ms", "boo min", "{:.2f}"), ("boo_median_ms", "boo ms", "{:.2f}"),
    ("max_run_spread_pct", "spread %", "{:.0f}"),
    ("inductor_speedup", "inductor x", "{:.2f}"), ("boo_speedup", "boo x", "{:.2f}"),
    ("boo_graphs_in_eager", "boo in eager", "{}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if key == "composites_by_name" and value is not None:
        value = value.replace("native_layer_norm", "ln").replace("_backward", "_bwd") or "-"
    if value is None or value == "":
        return "err" if any(k.endswith("_error") for k in row) and key != "model" else "-"
    return fmt.format(value)


def table(rows: list[dict]) -> str:
    cells = [[h for _, h, _ in COLUMNS]] + [[_cell(r, k, f) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(cl, widths)))
             for cl in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def chart(rows: list[dict], backends: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [r["model"] for r in rows]
    panels = [  # (y label, [(legend, key)], log scale, target lines)
        ("training step, median ms", [(b, f"{b}_median_ms") for b in backends], True, []),
        ("% of ops in IREE (boo)", [("boo", "pct_iree")], False, []),
        ("boo first step minus eager's, s", [("cold", "cold_s"), ("warm (new process)", "warm_s")],
         False, [COLD_TARGET_S, WARM_TARGET_S]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (label, series, log_scale, targets) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, (name, key) in enumerate(series):
            ax.bar([k + i * width for k in range(len(models))], [r.get(key) or 0 for r in rows], width, label=name)
        for y in targets:
            ax.axhline(y, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xticks([k + width * (len(series) - 1) / 2 for k in range(len(models))], models,
                      rotation=45, ha="right")
        ax.set_ylabel(label)
        ax.set_yscale("log" if log_scale else "linear")
        if len(series) > 1:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", help="comma list of zoo names (default: all of boo_backend.zoo.MODELS)")
    p.add_argument("--model", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="your own factory returning (model, kwargs dict | args tuple); repeatable")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help="comma list of " + ",".join(BACKENDS))
    p.add_argument("--steps", type=int, default=20, help="timed interleaved rounds per run")
    p.add_argument("--runs", type=int, default=3, help="runs of --steps rounds (median of the run medians)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps of each backend after its first")
    p.add_argument("--out", default="bench/models", help="writes OUT.csv and OUT.png")
    p.add_argument("--warm-probe", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ["BOO_STRICT"] = "0"
    if args.warm_probe:
        print(json.dumps(warm_probe(args.warm_probe, args.cache_dir)))
        return 0
    if args.steps < 1 or args.runs < 1 or args.warmup < 0:
        p.error("--steps and --runs must be at least 1, --warmup at least 0")
    from boo_backend.benchmarking import host_info, host_line, timing_line
    from boo_backend.zoo import MODELS

    specs = (args.models.split(",") if args.models else [] if args.model else list(MODELS)) + args.model
    unknown = [s for s in specs if ":" not in s and s not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; zoo: {', '.join(MODELS)}; or use MODULE:FUNCTION")
    backends = ["eager"] + [b for b in args.backends.split(",") if b != "eager"]
    if unknown := set(backends) - set(BACKENDS):
        p.error(f"unknown backend(s) {sorted(unknown)}; use {','.join(BACKENDS)}")
    host = host_info()
    if "boo" in backends:  # pay one-time imports (Dynamo, IREE, torch-mlir) before any model
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = torch.ones(4, requires_grad=True)
            torch.compile(lambda t: (t * 2).sum(), backend="boo", options={"cache_dir": tmp})(x).backward()
    log(f"{host_line(host)}; models: {', '.join(specs)}")
    rows = []
    for spec in specs:
        start = time.perf_counter()
        rows.append(measure(spec, backends, args.steps, args.runs, args.warmup) | host)
        log(f"{spec}: done in {time.perf_counter() - start:.0f} s")

    date = datetime.date.today().isoformat()
    print(f"{host_line(host)}; {date}")
    print(timing_line(f"{args.runs} runs x {args.steps} steps after {args.warmup} warm-up steps")
          + "; spread %: the largest of the backends'")
    print(table(rows))
    for r in rows:
        notes = [f"{k}: {r[k]}" for k in ("composites_by_name", "island_ops_by_name", "recovered")
                 if r.get(k)] + [f"{k}: {v}" for k, v in r.items() if k.endswith("_error")]
        if r.get("warm_iree_compiles"):  # boo's code changed, or its cache key is unstable
            notes.append(f"warm process recompiled {r['warm_iree_compiles']} modules (cache miss)")
        if notes:
            print(f"{r['model']}: " + "; ".join(notes))
    slow = [f"{r['model']} (cold {r['cold_s']:.1f} s)" for r in rows if r.get("cold_s", 0) > COLD_TARGET_S]
    slow += [f"{r['model']} (warm {r['warm_s']:.2f} s)" for r in rows if r.get("warm_s", 0) > WARM_TARGET_S]
    print(f"over the {COLD_TARGET_S:.0f} s cold / {WARM_TARGET_S:.0f} s warm targets: {', '.join(slow) or 'none'}")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows([{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows])
    try:
        chart(rows, backends, args.out + ".png", f"boo model zoo, training step: {host['cpu']}, {date}")
    except ImportError:
        print("note: matplotlib is not installed (pip install -e '.[bench]'); wrote the CSV, no PNG",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
