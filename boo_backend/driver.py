"""`boo-driver`: benchmark single composite ops with MIOpen-style command lines.

    boo-driver layer_norm -X 8192x1024 -t bf16 -F 14 --backend eager,inductor,boo,boo-decomposed
    boo-driver --commands-file cmds.txt --csv results.csv

Op names are the composite families of the registry (`layer_norm`, `gelu`). -F is a bit set:
1 forward, 2 input gradient, 4 weight gradient, 8 bias gradient (14: the combined backward).
Every backend is compiled and warmed up first; then --runs runs of --iter rounds, each round
one call of every backend (and of a plain copy) in rotating order, so the machine's noise
falls on all of them alike. Each backend's min and median (of the runs' medians) are compared
with eager's (the median of the per-run ratios), with the bytes the op must move, with the
plain copy of as many bytes, and with a float64 reference. The output and every CSV row say
where it ran (CPU model, cores, threads, torch, IREE and torch-mlir versions).
A CLI: the library never imports it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import shlex
import statistics
import sys
import time

import torch

from . import composites
from .benchmarking import HOST_COLUMNS, host_info, host_line, interleaved, summarize, timing_line
from .config import BooError
from .timing import sync

# name: (torch.compile backend, its options); None runs the op eagerly.
BACKENDS: dict[str, tuple[str | None, dict]] = {
    "eager": (None, {}),
    "inductor": ("inductor", {}),
    "boo": ("boo", {}),
    "boo-decomposed": ("boo", {"force_decompose": "all"}),
}
DTYPES = {"f32": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16,
          "f16": torch.float16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
CSV_COLUMNS = ["op", "shape", "dtype", "flags", "backend", "min_ms", "median_ms", "run_medians_ms",
               "run_spread_pct", "spread_pct", "gb_per_s", "copy_pct", "speedup_vs_eager", "speedup_runs",
               "max_rel_err", "numerics"] + HOST_COLUMNS
_COPY = " copy"  # the plain copy's key among the timed functions (no backend has a space)


@dataclasses.dataclass
class Command:
    text: str
    family: str
    shape: tuple[int, ...]
    dtype: str
    flags: int
    backends: list[str]
    iters: int
    warmup: int
    runs: int = 3


def _parser(exit_on_error: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boo-driver", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                exit_on_error=exit_on_error)
    p.add_argument("op", nargs="?", help="op family: " + ", ".join(sorted({e.family for e in composites.REGISTRY.values()})))
    p.add_argument("-X", "--shape", default="8192x1024", help="input shape, e.g. 8192x1024")
    p.add_argument("-t", "--dtype", default="f32", help="f32, bf16 or f16")
    p.add_argument("-F", "--flags", type=int, default=1, help="1 fwd, 2 dx, 4 dweight, 8 dbias")
    p.add_argument("--backend", default="eager,boo,boo-decomposed", help="comma list of " + ", ".join(BACKENDS))
    p.add_argument("--iter", type=int, default=20, dest="iters", help="timed rounds per run")
    p.add_argument("--runs", type=int, default=3, help="runs of --iter rounds (median of the run medians)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each backend before")
    return p


def parse_command(text: str, defaults: argparse.Namespace | None = None) -> Command:
    """One command line (without `boo-driver`); raises BooError saying what is wrong."""
    try:
        ns, extra = _parser(exit_on_error=False).parse_known_args(shlex.split(text), namespace=defaults)
    except (argparse.ArgumentError, ValueError) as e:
        raise BooError(f"bad command {text!r}: {e}") from None
    if extra:
        raise BooError(f"bad command {text!r}: unrecognized arguments: {' '.join(extra)}")
    if not ns.op:
        raise BooError(f"bad command {text!r}: no op given")
    try:
        shape = tuple(int(s) for s in ns.shape.lower().split("x"))
    except ValueError:
        raise BooError(f"bad command {text!r}: -X {ns.shape!r} is not like 8192x1024") from None
    if ns.dtype not in DTYPES:
        raise BooError(f"bad command {text!r}: -t {ns.dtype!r}; use one of {', '.join(DTYPES)}")
    backends = [b.strip() for b in ns.backend.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise BooError(f"bad command {text!r}: unknown backend {unknown}; use {', '.join(BACKENDS)}")
    if ns.iters < 1 or ns.runs < 1 or ns.warmup < 0:
        raise BooError(f"bad command {text!r}: --iter and --runs must be at least 1, --warmup at least 0")
    composites.for_flags(ns.op, ns.flags)  # raises on an unknown op or flag set
    return Command(text, ns.op, shape, ns.dtype, ns.flags, backends, ns.iters, ns.warmup, ns.runs)


def time_ms(fn, warmup: int, iters: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _rel_error(ours, ref) -> float:
    worst = 0.0
    for a, b in zip(_tensors(ours), _tensors(ref)):
        if b.numel():
            worst = max(worst, (a.double().cpu() - b).abs().max().item() / max(b.abs().max().item(), 1e-30))
    return worst


def _callable(backend: str, op, args, kwargs):
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def fn(*tensors):
        full = list(args)
        for i, t in zip(positions, tensors):
            full[i] = t
        return op(*full, **kwargs)

    compiler, options = BACKENDS[backend]
    if compiler is None:
        return fn
    return torch.compile(fn, backend=compiler, dynamic=False, options=dict(options) or None)


def copy_gbps(nbytes: int, device: torch.device, warmup: int, iters: int) -> float:
    """Bandwidth of a plain copy moving `nbytes` (half read, half written), timed alone."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = statistics.median(time_ms(lambda: dst.copy_(src), warmup, iters, device))
    return 2 * src.numel() / ms / 1e6


def measure(cmd: Command, device: torch.device, progress=None) -> list[dict]:
    """One row per op of the command's family and backend. The backends (and a plain copy of
    the bytes the op moves) are compiled and warmed up, then timed interleaved."""
    rows = []
    host = host_info()
    torch.manual_seed(0)
    for entry in composites.for_flags(cmd.family, cmd.flags):
        args, kwargs = entry.sample(cmd.shape, DTYPES[cmd.dtype], cmd.flags)
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # On the CPU: some composite ops have no kernel on a GPU (the CPU flash attention).
        reference = entry.op(*[a.double().cpu() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        outputs = entry.op(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        moved = sum(t.numel() * t.element_size() for t in tensors + _tensors(outputs))
        src = torch.empty(max(moved // 2, 1), dtype=torch.uint8, device=device).random_()
        dst = torch.empty_like(src)
        torch._dynamo.reset()  # once per op: the backends' compiled functions live side by side
        fns, errors, failed = {}, {}, {}
        for backend in cmd.backends:
            fn = _callable(backend, entry.op, args, kwargs)
            try:
                errors[backend] = _rel_error(fn(*tensors), reference)  # compiles
            except Exception as e:  # e.g. eager on a GPU, for an op with a CPU kernel only
                failed[backend] = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
                continue
            fns[backend] = functools.partial(fn, *tensors)
        fns[_COPY] = functools.partial(dst.copy_, src)
        for fn in fns.values():
            for _ in range(cmd.warmup):
                fn()
        sync(device)
        times = interleaved(fns, cmd.iters, cmd.runs, sync=(lambda: sync(device)) if device.type != "cpu" else None)
        copy = 2 * src.numel() / summarize(times[_COPY])["median_ms"] / 1e6
        for backend in cmd.backends:
            if backend in failed:
                row = {c: "" for c in CSV_COLUMNS} | {
                    "op": entry.name, "shape": "x".join(map(str, cmd.shape)), "dtype": cmd.dtype,
                    "flags": cmd.flags, "backend": backend, "numerics": f"ERROR: {failed[backend]}"} | host
                rows.append(row)
                if progress:
                    progress(row)
                continue
            st = summarize(times[backend], times.get("eager"))
            gbps = moved / st["median_ms"] / 1e6
            row = {
                "op": entry.name, "shape": "x".join(map(str, cmd.shape)), "dtype": cmd.dtype,
                "flags": cmd.flags, "backend": backend, "min_ms": round(st["min_ms"], 4),
                "median_ms": round(st["median_ms"], 4), "run_medians_ms": st["run_medians_ms"],
                "run_spread_pct": round(st["run_spread_pct"], 1), "spread_pct": round(st["iqr_pct"], 1),
                "gb_per_s": round(gbps, 2), "copy_pct": round(100 * gbps / copy, 1),
                "speedup_vs_eager": round(st["speedup_vs_eager"], 3) if "speedup_vs_eager" in st else "",
                "speedup_runs": st.get("speedup_runs", ""),
                "max_rel_err": f"{errors[backend]:.1e}",
                "numerics": "ok" if errors[backend] < TOLERANCE[DTYPES[cmd.dtype]] else "FAIL",
            } | host
            rows.append(row)
            if progress:
                progress(row)
    return rows


def format_table(rows: list[dict]) -> str:
    cols = ["op", "shape", "dtype", "flags", "backend", "min_ms", "median_ms", "run_spread_pct", "spread_pct",
            "gb_per_s", "copy_pct", "speedup_vs_eager", "max_rel_err", "numerics"]
    heads = ["op", "shape", "dtype", "-F", "backend", "min ms", "median ms", "spread %", "IQR %", "GB/s",
             "% copy", "vs eager", "rel err", "check"]
    cells = [heads] + [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = _parser(exit_on_error=True)
    parser.add_argument("--commands-file", help="one command per line (# comments allowed)")
    parser.add_argument("--csv", help="write every measured row to this CSV file")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (ROCm too)")
    ns = parser.parse_args(argv)
    texts = []
    if ns.op:
        texts.append(shlex.join(argv if argv is not None else sys.argv[1:]))
    if ns.commands_file:
        with open(ns.commands_file) as f:
            texts += [line.split("#", 1)[0].strip() for line in f]
        texts = [t for t in texts if t]
    if not texts:
        parser.error("give an op or --commands-file")
    device = torch.device(ns.device)
    writer, out = None, None
    if ns.csv:
        out = open(ns.csv, "w", newline="")
        writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS)
        writer.writeheader()
    rows, failures, timings = [], [], set()
    print(host_line(), file=sys.stderr, flush=True)
    for i, text in enumerate(texts, 1):
        try:
            cmd = parse_command(_strip_driver_options(text))
        except BooError as e:
            failures.append(str(e))
            print(f"[{i}/{len(texts)}] error: {e}", file=sys.stderr, flush=True)
            continue
        timings.add((cmd.runs, cmd.iters, cmd.warmup))

        def progress(row, i=i):
            print(f"[{i}/{len(texts)}] {row['op']} {row['shape']} {row['dtype']} -F {row['flags']} "
                  f"{row['backend']}: min {row['min_ms']} ms, median {row['median_ms']} ms "
                  f"(runs {row['run_medians_ms']})", file=sys.stderr, flush=True)
            if writer:
                writer.writerow(row)
                out.flush()

        rows += measure(cmd, device, progress)
    if out:
        out.close()
    if rows:
        print(host_line())
        print(timing_line(", ".join(f"{r} runs x {n} steps after {w} warm-up calls" for r, n, w in sorted(timings))))
        print(format_table(rows))
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 2 if failures else 0


def _strip_driver_options(text: str) -> str:
    """Drop the whole-run options (--csv, --commands-file, --device) from one command."""
    words, keep, skip = shlex.split(text), [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("--csv", "--commands-file", "--device"):
            skip = True
        elif not w.startswith(("--csv=", "--commands-file=", "--device=")):
            keep.append(w)
    return shlex.join(keep)


if __name__ == "__main__":
    sys.exit(main())

