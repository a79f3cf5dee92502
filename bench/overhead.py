"""boo's own cost per compiled-graph call: everything but the IREE invoke.

For a few small graphs, times in one process, interleaved:
  eager     the function in eager PyTorch;
  compiled  the torch.compile'd function (Dynamo's guards and AOTAutograd's wrapper included);
  graph     boo's CompiledGraph alone (what boo runs per call: argument import, invoke, export);
  invoke    the IREE invoke alone, on prebuilt argument lists;
and reports `graph - invoke` as boo's overhead, per runtime driver.

    python bench/overhead.py [--calls 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import iree.runtime as rt
import torch
from torch.utils.dlpack import to_dlpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from boo_backend.cache import cpu_model  # noqa: E402
from boo_backend.graph import CompiledGraph  # noqa: E402

CASES = {
    "gelu 8x8": (lambda x: torch.nn.functional.gelu(x), lambda: [torch.randn(8, 8)]),
    "layer_norm 256x1024": (
        lambda x, w, b: torch.nn.functional.layer_norm(x, (1024,), w, b),
        lambda: [torch.randn(256, 1024), torch.randn(1024), torch.randn(1024)],
    ),
    "3 inputs, 2 outputs 64x64": (
        lambda a, b, c: (a * b + c, (a - c).relu()),
        lambda: [torch.randn(64, 64) for _ in range(3)],
    ),
}


def _graphs() -> list[CompiledGraph]:
    found = []
    for obj in gc.get_objects():
        try:
            if type(obj) is CompiledGraph:
                found.append(obj)
        except ReferenceError:
            continue
    return found


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(name: str, driver: str, calls: int, runs: int) -> dict:
    torch._dynamo.reset()
    fn, make = CASES[name]
    args = make()
    known = set(map(id, _graphs()))
    compiled = torch.compile(fn, backend="boo", options={"cpu_driver": driver})
    compiled(*args)
    graph = next(g for g in _graphs() if id(g) not in known)
    runner = next(iter(graph._runners.values()))
    part = runner.part  # graph._boxed's call of one IreePart
    function = part.function
    tensors = [args[v] if k == "arg" else v for k, v in part.lowered.inputs]
    count = len(part.lowered.result_layouts)
    prebuilt = rt.VmVariantList(len(tensors))
    for t in tensors:
        prebuilt.push_ref(function._current.device.from_dlpack_capsule(to_dlpack(t)).ref)

    def invoke():
        function._current.context.invoke(function._current.function, prebuilt, rt.VmVariantList(count))

    timers = {
        "eager": lambda: fn(*args),
        "compiled": lambda: compiled(*args),
        "graph": lambda: graph(list(args)),
        "invoke": invoke,
    }
    for f in timers.values():
        _per_call_us(f, 50)
    samples = {k: [] for k in timers}
    for _ in range(runs):
        for k, f in timers.items():
            samples[k].append(_per_call_us(f, calls))
    row = {"case": name, "driver": function.driver}
    row.update({f"{k}_us": statistics.median(v) for k, v in samples.items()})
    row["boo_overhead_us"] = statistics.median(g - i for g, i in zip(samples["graph"], samples["invoke"]))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args(argv)
    print(f"# {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}; median of {a.runs} runs "
          f"of {a.calls} calls; microseconds per call")
    cols = ["case", "driver", "eager_us", "compiled_us", "graph_us", "invoke_us", "boo_overhead_us"]
    print("  ".join(f"{c:>26}" if i == 0 else f"{c:>15}" for i, c in enumerate(cols)))
    for name in CASES:
        for driver in ("local-sync", "local-task"):
            row = measure(name, driver, a.calls, a.runs)
            print("  ".join(f"{row[c]:>26}" if i == 0 else (f"{row[c]:>15.1f}" if isinstance(row[c], float) else f"{row[c]:>15}")
                            for i, c in enumerate(cols)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
