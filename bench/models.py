"""Model coverage and speed: how much of each model's training step boo puts in IREE, what it
compiles, and how its step time compares with eager and inductor, side by side in one run.

    python bench/models.py [--models gpt2,bert | --model mypkg.mymod:make] [--steps 10]
                           [--warmup 3] [--backends eager,inductor,boo] [--out bench/models]

For every model, over the forward and backward graphs of one training step (model.train(),
loss from the output, loss.backward()), it reports: graphs and ops; the share of ops that run
in IREE; the composites used, by name (read from the `graph.txt` that boo's `dump_dir` writes);
ops left to eager islands, by op, and graphs that fell back whole (recovered); cold and warm
compile seconds; and the median step time of each backend with its speed-up over eager
(eager_ms / backend_ms). boo runs with strict off (BOO_STRICT=0), so a model that falls back
is still measured, and the fallbacks are reported.

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

Writes OUT.csv (one row per model, with the CPU model) and OUT.png (step ms per backend,
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
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

BACKENDS = ["eager", "inductor", "boo"]
COLD_TARGET_S, WARM_TARGET_S = 30.0, 2.0
_COMPOSITE_LINE = re.compile(r"^#\s+\S+: (\S+) v\d+ ")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    """lscpu's "Model name", else /proc/cpuinfo's "model name"."""
    for cmd, key in ((["lscpu"], "Model name"), (["cat", "/proc/cpuinfo"], "model name")):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return "unknown"


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
    if backend == "eager":
        run = model
    elif backend == "inductor":
        run = torch.compile(model, backend="inductor")
    else:
        options = {"strict": False, "cache_dir": str(cache_dir)}
        if dump_dir:
            options["dump_dir"] = str(dump_dir)
        run = torch.compile(model, backend="boo", options=options)
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


def median_ms(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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


def measure(spec: str, backends: list[str], steps: int, warmup: int) -> dict:
    import boo_backend

    row: dict = {"model": spec}
    eager_first = None
    for backend in backends:
        log(f"{spec}: {backend}")
        torch._dynamo.reset()
        boo_backend.reset()
        try:
            if backend != "boo":
                step = build(spec, backend)
                row[f"{backend}_first_s"], row[f"{backend}_loss"] = first_step(step)
                eager_first = row[f"{backend}_first_s"] if backend == "eager" else eager_first
                row[f"{backend}_ms"] = median_ms(step, warmup, steps)
                continue
            with tempfile.TemporaryDirectory(prefix="boo-models-") as tmp:
                cache, dump = Path(tmp, "cache"), Path(tmp, "dump")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    step = build(spec, "boo", cache, dump)
                    row["boo_first_s"], row["boo_loss"] = first_step(step)
                    boo_coverage(row, boo_backend.placements(), dump, caught)
                    row["iree_compiles"] = boo_backend.stats().get("iree_compiles", 0)
                    row["boo_ms"] = median_ms(step, warmup, steps)
                for msg in sorted({str(w.message) for w in caught
                                   if issubclass(w.category, boo_backend.BooFallbackWarning)}):
                    log(f"{spec}: fallback: {msg}")
                if eager_first is not None:
                    row["cold_s"] = row["boo_first_s"] - eager_first
                log(f"{spec}: boo warm probe (new process)")
                probe = run_probe(spec, cache)
                row["warm_import_s"] = probe["import_s"]
                row["warm_s"] = probe["import_s"] + probe["boo_first_s"] - probe["eager_first_s"]
                row["warm_iree_compiles"] = probe["iree_compiles"]
        except Exception as e:  # report the model and go on to the next
            text = str(e).strip().splitlines()
            row[f"{backend}_error"] = f"{type(e).__name__}: {text[0] if text else ''}"[:300]
            log(f"{spec}: {backend} failed: {row[f'{backend}_error']}")
    for backend in backends[1:]:
        if row.get("eager_ms") and row.get(f"{backend}_ms"):
            row[f"{backend}_speedup"] = row["eager_ms"] / row[f"{backend}_ms"]
    if "boo_loss" in row and "eager_loss" in row:
        row["boo_loss_diff"] = abs(row["boo_loss"] - row["eager_loss"])
    return row


COLUMNS = [  # (CSV key, table heading, format)
    ("model", "model", "{}"), ("graphs", "graphs", "{}"), ("ops", "ops", "{}"),
    ("pct_iree", "% IREE", "{:.1f}"), ("decomposed", "decomp", "{}"), ("composites_by_name", "composites", "{}"),
    ("island_ops", "islands", "{}"), ("cold_s", "cold s", "{:.1f}"), ("warm_s", "warm s", "{:.2f}"),
    ("eager_ms", "eager ms", "{:.2f}"), ("inductor_ms", "inductor ms", "{:.2f}"),
    ("boo_ms", "boo ms", "{:.2f}"), ("inductor_speedup", "inductor x", "{:.2f}"),
    ("boo_speedup", "boo x", "{:.2f}"),
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
        ("training step, median ms", [(b, f"{b}_ms") for b in backends], True, []),
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
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list of eager,inductor,boo")
    p.add_argument("--steps", type=int, default=10, help="timed steps per backend (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    p.add_argument("--out", default="bench/models", help="writes OUT.csv and OUT.png")
    p.add_argument("--warm-probe", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ["BOO_STRICT"] = "0"
    if args.warm_probe:
        print(json.dumps(warm_probe(args.warm_probe, args.cache_dir)))
        return 0

    from boo_backend.zoo import MODELS

    specs = (args.models.split(",") if args.models else [] if args.model else list(MODELS)) + args.model
    unknown = [s for s in specs if ":" not in s and s not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; zoo: {', '.join(MODELS)}; or use MODULE:FUNCTION")
    backends = ["eager"] + [b for b in args.backends.split(",") if b != "eager"]
    if unknown := set(backends) - set(BACKENDS):
        p.error(f"unknown backend(s) {sorted(unknown)}; use {','.join(BACKENDS)}")
    cpu = cpu_model()
    if "boo" in backends:  # pay one-time imports (Dynamo, IREE, torch-mlir) before any model
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = torch.ones(4, requires_grad=True)
            torch.compile(lambda t: (t * 2).sum(), backend="boo", options={"cache_dir": tmp})(x).backward()
    log(f"CPU: {cpu}; {torch.get_num_threads()} threads; models: {', '.join(specs)}")
    rows = []
    for spec in specs:
        start = time.perf_counter()
        rows.append(measure(spec, backends, args.steps, args.warmup) | {"cpu": cpu})
        log(f"{spec}: done in {time.perf_counter() - start:.0f} s")

    date = datetime.date.today().isoformat()
    print(f"CPU: {cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}; {date}; "
          f"median of {args.steps} steps after {args.warmup} warm-up steps")
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
        chart(rows, backends, args.out + ".png", f"boo model zoo, training step: {cpu}, {date}")
    except ImportError:
        print("note: matplotlib is not installed (pip install -e '.[bench]'); wrote the CSV, no PNG",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
