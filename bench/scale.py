"""Training steps at the sizes people train: Hugging Face GPT-2 small and a Llama of similar
size, for eager, Inductor and boo, each compiled cold and again warm in fresh processes.

One step is a forward with `labels`, `loss.backward()` and AdamW (lr 1e-4) outside the
compiled model; batch 4 x 128 tokens, dropout 0, random weights (no downloads). For every
model and backend (a fresh compile cache each):

1. a cold process: eager's first step, then the compiled model's first step (the compile),
   then --steps steps of each, alternating, from the same weights; the compiled model's loss
   is compared with eager's at every step;
2. a warm process on the same cache: the compiled model's first step and --steps more, with
   nothing else in the process, so its peak resident memory is the backend's own (eager's
   own process gives eager's).

Reported: cold and warm seconds over eager's first step, step times and their ratio to
eager (the median of per-step ratios in the cold process), peak resident memory, and, for
boo, its compile time by stage: Dynamo and AOTAutograd (what is left of the first step),
boo's planning (retraces, matching, placement measurements, cutting into blocks), the
torch-mlir import, iree-compile, loading and the driver choice. Writes a CSV and (with
matplotlib: pip install -e '.[bench]') a PNG.

    python bench/scale.py [--models gpt2,llama] [--backends eager,inductor,boo] [--steps 4]
                          [--layers N] [--out bench/scale]

A backend named with `+precompile` (`boo+precompile`, `inductor+precompile`) runs with torch's
caching precompile (`TORCH_CACHING_PRECOMPILE=1`): the cold process saves what Dynamo traced
(`torch.compiler.save_cache_artifacts()`, after its timed steps), and the warm process loads it
instead of tracing.

Run it on a quiet machine: a second process on one of two cores stalls eager's OpenMP
regions and flatters every compiled backend.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

PRECOMPILE = "+precompile"
BACKENDS = {"eager": (None, {}), "inductor": ("inductor", {}), "boo": ("boo", {}),
            "boo-no-blocks": ("boo", {"blocks": False})}


def build(name: str, layers: int | None):
    """The model and one batch (4 x 128 tokens), seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":
        config = GPT2Config(n_layer=layers or 12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
    elif name == "llama":
        config = LlamaConfig(num_hidden_layers=layers or 8, hidden_size=512, intermediate_size=1408,
                             num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                             max_position_embeddings=512)
        model = LlamaForCausalLM(config)
    else:
        raise SystemExit(f"unknown model {name!r}; use gpt2 or llama")
    tokens = torch.randint(0, config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(1))
    return model, tokens


class Trainer:
    def __init__(self, model, backend: str):
        self.model = model
        compiler, options = BACKENDS[backend.removesuffix(PRECOMPILE)]
        self.run = model if compiler is None else torch.compile(model, backend=compiler, options=options or None)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self, tokens) -> tuple[float, float]:
        start = time.perf_counter()
        loss = self.run(tokens, labels=tokens).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start, loss.item()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args) -> dict:
    model, tokens = build(args.model, args.layers)
    out: dict = {}
    if args.phase == "cold" and args.backend != "eager":
        eager = Trainer(copy.deepcopy(model), "eager")
        out["eager_first_s"], eager_loss = eager.step(tokens)
    if args.backend.startswith("boo"):
        import boo_backend
        boo_backend.reset()
    trainer = Trainer(model, args.backend)
    out["first_s"], loss = trainer.step(tokens)
    if args.backend.startswith("boo"):
        out["stages"] = {k: v for k, v in boo_backend.stats().items() if k.endswith("_s")}
        out["iree_compiles"] = boo_backend.stats().get("iree_compiles", 0)
    steps, ratios, diffs = [], [], []
    if args.phase == "cold" and args.backend != "eager":
        diffs.append(abs(loss - eager_loss))
        eager_steps = []
        for i in range(args.steps):
            pair = [("eager", eager), ("backend", trainer)]
            times = {}
            for which, t in (pair if i % 2 == 0 else pair[::-1]):
                times[which], value = t.step(tokens)
                if which == "eager":
                    eager_loss = value
                else:
                    loss = value
            diffs.append(abs(loss - eager_loss))
            steps.append(times["backend"])
            eager_steps.append(times["eager"])
            ratios.append(times["eager"] / times["backend"])
        out["eager_step_s"] = statistics.median(eager_steps)
        out["ratio"] = statistics.median(ratios)
        out["loss_diff"] = max(diffs)
    else:
        for _ in range(args.steps):
            steps.append(trainer.step(tokens)[0])
    out["step_s"] = statistics.median(steps)
    out["peak_rss_mb"] = _peak_rss_mb()
    if args.phase == "cold" and args.backend.endswith(PRECOMPILE):
        torch.compiler.save_cache_artifacts()
    return out


def _spawn(model, backend, phase, cache, steps, layers) -> dict:
    env = dict(os.environ, BOO_CACHE_DIR=os.path.join(cache, "boo"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    if backend.endswith(PRECOMPILE):
        env["TORCH_CACHING_PRECOMPILE"] = "1"
    cmd = [sys.executable, __file__, "--child", "--model", model, "--backend", backend, "--phase", phase,
           "--steps", str(steps)] + (["--layers", str(layers)] if layers else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Failed(f"{model} {backend} {phase} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Failed(Exception):
    """A child process that failed: reported, and the other backends still run."""


def _stages(cold: dict) -> dict:
    """boo's cold compile by stage, in seconds."""
    st = cold.get("stages", {})
    compile_s = cold["first_s"] - cold["step_s"]
    build = st.get("build_s", 0.0)
    iree = st.get("iree_compile_s", 0.0)
    imp = st.get("import_s", 0.0)
    load = st.get("load_s", 0.0)
    boo_calls = st.get("driver_choice_s", 0.0) + st.get("dynamic_check_s", 0.0)
    return {"dynamo_aot_s": compile_s - build - boo_calls, "planning_s": build - iree - imp - load,
            "import_s": imp, "iree_compile_s": iree, "load_s": load, "driver_choice_s": boo_calls}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--backends", default="eager,inductor,boo")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--out", default="bench/scale")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--phase", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from boo_backend.benchmarking import host_info, host_line

    host = host_info()
    print(host_line(host), flush=True)
    rows = []
    for model in args.models.split(","):
        eager = None
        for backend in args.backends.split(","):
            with tempfile.TemporaryDirectory(prefix="boo-scale-") as cache:
                if backend == "eager":
                    eager = _spawn(model, backend, "warm", cache, args.steps, args.layers)
                    row = {"cold_s": 0.0, "warm_s": 0.0, "step_ms": eager["step_s"] * 1e3,
                           "ratio": 1.0, "peak_rss_mb": eager["peak_rss_mb"], "first_s": eager["first_s"]}
                else:
                    try:
                        cold = _spawn(model, backend, "cold", cache, args.steps, args.layers)
                        warm = _spawn(model, backend, "warm", cache, args.steps, args.layers)
                    except Failed as e:
                        print(e, flush=True)
                        rows.append({"model": model, "layers": args.layers or "", "backend": backend,
                                     "error": str(e).strip().splitlines()[-1][:200]})
                        continue
                    base = eager["first_s"] if eager else cold["eager_first_s"]
                    row = {"cold_s": cold["first_s"] - cold["eager_first_s"], "warm_s": warm["first_s"] - base,
                           "step_ms": cold["step_s"] * 1e3, "eager_step_ms": cold["eager_step_s"] * 1e3,
                           "ratio": cold["ratio"], "loss_diff": cold["loss_diff"],
                           "peak_rss_mb": warm["peak_rss_mb"], "warm_step_ms": warm["step_s"] * 1e3,
                           "iree_compiles": cold.get("iree_compiles", ""),
                           "warm_iree_compiles": warm.get("iree_compiles", "")}
                    if backend.startswith("boo"):
                        row |= {k: round(v, 2) for k, v in _stages(cold).items()}
                        row |= {f"warm_{k}": round(v, 2) for k, v in _stages(warm).items()}
            row = {"model": model, "layers": args.layers or "", "backend": backend, **row}
            rows.append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    columns = list(dict.fromkeys(k for r in rows for k in r)) + list(host)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow(r | host)
    _plot(rows, args.out + ".png")


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: pip install -e '.[bench]' for the PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = [f"{r['model']}\n{r['backend']}" for r in rows]
    for ax, key, title in zip(axes, ("cold_s", "warm_s", "ratio"),
                              ("cold compile (s over eager's first step)", "warm start (s)", "step speed vs eager")):
        ax.bar(range(len(rows)), [r.get(key, 0) for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
