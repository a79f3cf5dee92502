"""Shared by `boo-driver` and the scripts under bench/: where a benchmark ran, and timing that
lets the machine's noise fall on every backend alike.

- `host_info()`: the CPU model, core and thread counts and the versions of torch, IREE and
  torch-mlir, as CSV columns (`HOST_COLUMNS`); `host_line()` says the same in one line.
- `interleaved(fns, steps, runs)`: runs of timed rounds, each round one call of every
  function in turn, the order rotating from round to round.
- `summarize(times, baseline)`: min, median of the runs' medians, the spread between runs and
  the median over runs of the per-run ratio to a baseline.

The library never imports this module. (Importing it imports the boo_backend package.)
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import statistics
import time
from typing import Callable

import torch

from .cache import cpu_model

HOST_COLUMNS = ["cpu", "cpu_kind", "cpu_count", "torch_threads", "torch_version", "iree_compiler_version",
                "iree_runtime_version", "torch_mlir_version",
                "omp_wait_policy"]
_DISTRIBUTIONS = {"iree_compiler_version": "iree-base-compiler", "iree_runtime_version": "iree-base-runtime",
                  "torch_mlir_version": "torch-mlir"}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def cpu_kind() -> str:
    """Family, model and vector extensions ("family 25 model 17, AVX2"): lscpu's model name
    is "AMD EPYC" for CPUs of different kinds, and the speed ratios differ between them."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        return "unknown"
    flags = set(fields.get("flags", "").split())
    vector = [name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags]
    return (f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, "
            f"{'+'.join(vector) or 'no AVX2'}")


@functools.cache
def _static_info() -> dict:
    info = {"cpu": cpu_model(), "cpu_kind": cpu_kind(), "cpu_count": os.cpu_count(), "torch_version": torch.__version__}
    return info | {key: _version(dist) for key, dist in _DISTRIBUTIONS.items()}


def host_info() -> dict:
    """The HOST_COLUMNS of this process (torch_threads as it is now)."""
    # OpenMP's wait policy changes how torch's idle threads share the cores with IREE's
    # workers (see README, "Known limits"); libgomp reads it once, at load.
    info = _static_info() | {"torch_threads": torch.get_num_threads(),
                             "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}
    return {key: info[key] for key in HOST_COLUMNS}


def host_line(info: dict | None = None) -> str:
    """`host: <cpu>; N CPUs, M torch threads; torch ...; iree-base-compiler ...; ...`"""
    i = info or host_info()
    return (f"host: {i['cpu']} ({i['cpu_kind']}); {i['cpu_count']} CPUs, {i['torch_threads']} torch threads; "
            f"torch {i['torch_version']}; iree-base-compiler {i['iree_compiler_version']}; "
            f"iree-base-runtime {i['iree_runtime_version']}; torch-mlir {i['torch_mlir_version']}; "
            f"OMP_WAIT_POLICY {i['omp_wait_policy']}")


def interleaved(fns: dict[str, Callable[[], object]], steps: int, runs: int,
                sync: Callable[[], None] | None = None) -> dict[str, list[list[float]]]:
    """Milliseconds per call: {name: [run][step]}. Each of the `runs` runs is `steps` rounds;
    a round calls every function once, starting one further along the list each round, so
    no function always follows the same one. `sync` (a device synchronization) runs after
    each call, inside its time. Compile and warm up the functions before."""
    names = list(fns)
    times: dict[str, list[list[float]]] = {n: [[] for _ in range(runs)] for n in names}
    for r in range(runs):
        for s in range(steps):
            k = (r * steps + s) % len(names)
            for name in names[k:] + names[:k]:
                fn = fns[name]
                start = time.perf_counter()
                fn()
                if sync:
                    sync()
                times[name][r].append((time.perf_counter() - start) * 1e3)
    return times


def _iqr_pct(times: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=4)
    return 100 * (q[2] - q[0]) / statistics.median(times)


def summarize(times: list[list[float]], baseline: list[list[float]] | None = None) -> dict:
    """One backend's [run][step] milliseconds as:
    min_ms          the fastest step of all runs;
    median_ms       the median of the runs' medians;
    run_medians_ms  each run's median, e.g. "7.41/7.58/9.02";
    run_spread_pct  (largest - smallest run median) / median_ms;
    iqr_pct         the median over runs of each run's interquartile range / its median;
    and, given the baseline's (eager's) times from the same runs:
    speedup_vs_eager  the median over runs of baseline run median / this run median;
    speedup_runs      each run's ratio."""
    medians = [statistics.median(run) for run in times]
    median = statistics.median(medians)
    out = {
        "min_ms": min(t for run in times for t in run), "median_ms": median,
        "run_medians_ms": "/".join(f"{m:.4g}" for m in medians),
        "run_spread_pct": 100 * (max(medians) - min(medians)) / median,
        "iqr_pct": statistics.median(_iqr_pct(run) for run in times),
    }
    if baseline is not None:
        ratios = [statistics.median(b) / m for b, m in zip(baseline, medians)]
        out["speedup_vs_eager"] = statistics.median(ratios)
        out["speedup_runs"] = "/".join(f"{x:.3g}" for x in ratios)
    return out


def timing_line(counts: str) -> str:
    """`timing: <counts>; ...` and what the summary columns mean."""
    return (f"timing: {counts}; backends interleaved in rotating order; min: fastest step; "
            f"median: of the run medians; spread: range of the run medians; "
            f"speed-up over eager: median of the per-run ratios")
