"""Where a training step's time goes, by op, for several backends side by side in one process.

The model and step are bench/scale.py's (GPT-2 small or a Llama, 4 x 128 tokens, AdamW).
Each backend is compiled and warmed up, then the backends take turns for --runs profiled
steps (torch.profiler). boo names each IREE call after its graph and part ("boo:
backward_000/submod_9"), so a part's time shows next to ATen's kernels; BOO_DUMP_DIR
writes each part's graph and module under the same name.

    python bench/where.py [--model gpt2] [--layers N] [--backends eager,boo] [--runs 3] [--top 25]

Printed per backend: the step times, the self time by group (matmuls, attention, boo's
IREE calls, the rest) and the ops with the most self time, each a mean over the runs.
The profiler adds its own cost, so compare the groups, not these steps with scale.py's.
Run it on a quiet machine (see scale.py).
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402  (bench/ is not a package)

_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::convolution")


def _group(key: str) -> str:
    if key in _MATMULS:
        return "matmul (ATen)"
    if "attention" in key:
        return "attention (ATen)"
    if key.startswith("boo: "):
        return "boo's IREE calls"
    return "the rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--backends", default="eager,boo")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    model, tokens = scale.build(args.model, args.layers)
    backends = args.backends.split(",")
    trainers = {b: scale.Trainer(copy.deepcopy(model), b) for b in backends}
    for name, trainer in trainers.items():
        start = time.perf_counter()
        trainer.step(tokens)
        print(f"{name}: first step {time.perf_counter() - start:.1f} s", flush=True)
        trainer.step(tokens)
    spent = {b: collections.Counter() for b in backends}
    steps = {b: [] for b in backends}
    for _ in range(args.runs):
        for name, trainer in trainers.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                steps[name].append(trainer.step(tokens)[0] * 1e3)
            for event in prof.key_averages():
                spent[name][event.key] += event.self_cpu_time_total / 1e3 / args.runs
    for name in backends:
        groups = collections.Counter()
        for key, ms in spent[name].items():
            groups[_group(key)] += ms
        print(f"\n== {name}: steps (profiled) {', '.join(f'{s:.0f}' for s in steps[name])} ms")
        print("   by group: " + ", ".join(f"{g} {ms:.0f} ms" for g, ms in groups.most_common()))
        for key, ms in spent[name].most_common(args.top):
            print(f"   {ms:9.1f} ms  {key[:90]}")


if __name__ == "__main__":
    main()
