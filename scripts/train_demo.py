"""The main job: train a GPT-2-style language model for a few steps with eager PyTorch,
Inductor and boo, side by side, from the same weights on the same batches.

Hugging Face GPT-2 with random weights (no download): --layers blocks of width --width,
a --vocab-token vocabulary, batches of --batch x --seq tokens, AdamW outside the compiled
model, dropout 0. Each backend's first step includes its compile; the later steps run in
rounds, one step of every backend per round in rotating order, so the machine's noise falls
on all of them alike. Prints each step's losses and times, each backend's compile seconds
(its first step over eager's) and median step against eager's, boo's compile time by stage,
and where boo placed every graph's ops. Exits non-zero if boo's losses differ from eager's.
Boo and Inductor compile into empty caches of this run's own (--caches fresh), so the
compile seconds are cold compiles every time; --caches shared uses their usual caches, where
a second run starts warm. Uses only boo_backend's public API.
"""

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time

import torch

import boo_backend


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=args.vocab,
                        n_positions=max(args.seq, 128), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class Trainer:
    def __init__(self, model, backend: str | None, options: dict | None = None):
        self.model = model
        self.run = model if backend is None else torch.compile(model, backend=backend, options=options)
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        self.losses, self.times = [], []

    def step(self, tokens) -> None:
        start = time.perf_counter()
        loss = self.run(tokens, labels=tokens).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backends", default="eager,inductor,boo")
    parser.add_argument("--caches", choices=("fresh", "shared"), default="fresh",
                        help="fresh: empty compile caches for this run (cold compiles); shared: boo's and "
                             "Inductor's usual caches (a second run starts warm)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        options = {"boo": {}}
        if args.caches == "fresh":
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="boo-main-job-", ignore_cleanup_errors=True))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
            options["boo"]["cache_dir"] = os.path.join(root, "boo")
        return _run(args, options)


def _run(args, options: dict) -> int:
    names = args.backends.split(",")
    if "eager" not in names:
        names.insert(0, "eager")

    from boo_backend.benchmarking import host_line

    print(host_line(), flush=True)
    print(f"model: GPT-2, {args.layers} layers of width {args.width}, vocabulary {args.vocab}; "
          f"batches of {args.batch} x {args.seq} tokens; AdamW", flush=True)
    print("compile caches: " + ("empty, this run's own (cold compiles)" if args.caches == "fresh"
                                else "boo's and Inductor's usual ones (warm if an earlier run filled them)"), flush=True)
    model = build(args)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps)]
    trainers = {n: Trainer(copy.deepcopy(model), None if n == "eager" else n, options.get(n)) for n in names}
    for name, t in trainers.items():  # first steps: the compiles
        t.step(batches[0])
        print(f"{name}: first step {t.times[0]:.1f} s", flush=True)
    stages = {k: v for k, v in boo_backend.stats().items() if k.endswith("_s")}
    for i, tokens in enumerate(batches[1:], 1):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            trainers[name].step(tokens)

    print(f"\n{'step':>4}  " + "  ".join(f"{n + ' loss':>14}  {n + ' ms':>12}" for n in names))
    for i in range(args.steps):
        cells = "  ".join(f"{trainers[n].losses[i]:>14.6f}  {trainers[n].times[i] * 1e3:>12.1f}" for n in names)
        print(f"{i:>4}  {cells}{'  (first step: includes the compile)' if i == 0 else ''}")
    eager = trainers["eager"]
    print("\nbackend   compile s (first step over eager's)   median step ms   step speed vs eager")
    for n in names:
        t = trainers[n]
        ratio = statistics.median(e / s for e, s in zip(eager.times[1:], t.times[1:])) if args.steps > 1 else float("nan")
        med = statistics.median(t.times[1:]) * 1e3 if args.steps > 1 else float("nan")
        print(f"{n:<9} {t.times[0] - eager.times[0]:>37.1f}   {med:>14.1f}   {ratio:>18.2f}x")
    if "boo" in trainers:
        dynamo_aot = trainers["boo"].times[0] - statistics.median(trainers["boo"].times[1:] or [0]) \
            - stages.get("build_s", 0) - stages.get("driver_choice_s", 0)
        planning = stages.get("build_s", 0) - stages.get("import_s", 0) - stages.get("iree_compile_s", 0) \
            - stages.get("load_s", 0)
        print(f"\nboo's compile by stage: Dynamo and AOTAutograd {dynamo_aot:.1f} s, planning {planning:.1f} s, "
              f"torch-mlir import {stages.get('import_s', 0):.1f} s, iree-compile "
              f"{stages.get('iree_compile_s', 0):.1f} s ({boo_backend.stats().get('iree_compiles', 0)} runs), "
              f"loading {stages.get('load_s', 0):.1f} s, driver choice {stages.get('driver_choice_s', 0):.1f} s")
        print("\nplacement summary:")
        for placement in boo_backend.placements():
            print("  " + placement.line())
        worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager.losses, trainers["boo"].losses))
        ok = worst <= 1e-4
        print(f"\nlargest relative loss difference, boo against eager: {worst:.2e} -> "
              f"{'losses match' if ok else 'LOSSES DIFFER'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
