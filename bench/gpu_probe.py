"""What scripts/gpu_check.sh asks of Python outside pytest and boo-driver:

    python bench/gpu_probe.py deps [--with-torch]   # boo's pinned dependencies and test extra, one a line
    python bench/gpu_probe.py env OUT.json          # torch, CUDA/ROCm, the device, boo's IREE target
    python bench/gpu_probe.py zoo OUT.json [--model gpt2] [--device cuda] [--steps 20] [--runs 3]

`deps` reads pyproject.toml (standard library only), leaving torch out unless asked, so that
pip never replaces the machine's own torch. `env` picks the target through
boo_backend.compile.target_for_device, the logic boo itself uses. `zoo` times one training
step of a boo_backend.zoo model (forward, loss, backward), eager against boo, interleaved as
boo-driver times ops, and records the largest gradient difference from eager.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def deps(with_torch: bool) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip carries the same parser
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    return [d for d in wanted if with_torch or re.split(r"[\s=<>!~;\[]", d, maxsplit=1)[0].lower() != "torch"]


def env() -> dict:
    import torch

    from boo_backend.benchmarking import host_info
    from boo_backend.compile import parse_target, target_for_device

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "gpu": torch.cuda.is_available()} | {k: v for k, v in host_info().items() if "version" in k}
    if not info["gpu"]:
        hopper = parse_target("cuda:sm_90").name
        return info | {"device": "none", "target": "no GPU",
                       "note": f"no GPU: torch.cuda.is_available() is False (a Hopper would get {hopper})"}
    props = torch.cuda.get_device_properties(0)
    arch = props.gcnArchName if info["hip"] else "sm_%d%d" % torch.cuda.get_device_capability(0)
    target = target_for_device(torch.device("cuda", 0))
    info |= {"device": props.name, "arch": arch, "memory_gib": round(props.total_memory / 2**30, 1),
             "target": target.name}
    if not info["hip"] and target.name != f"cuda:{arch}":
        info["note"] = (f"IREE 3.13 has no {arch} target (none past sm_89, so no sm_90/sm_100): "
                        f"boo compiles {target.name} code, which the {arch} driver runs")
    return info


def _train_step(model, run, batch):
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        loss = run(**batch).loss
        loss.backward()
        return loss.detach()

    return step


def _rel_err(ours, ref) -> float:
    scale = ref.abs().max().item()
    return (ours.double() - ref.double()).abs().max().item() / max(scale, 1e-30)


def zoo(name: str, device: str, steps: int, runs: int, warmup: int) -> dict:
    import torch

    import boo_backend
    from boo_backend.benchmarking import interleaved, summarize
    from boo_backend.zoo import MODELS

    dev = torch.device(device)
    model, batch = MODELS[name]()
    model = model.to(dev).train()
    batch = {k: v.to(dev) for k, v in batch.items()}
    ref = copy.deepcopy(model)
    boo_backend.reset()
    fns = {"eager": _train_step(ref, ref, batch), "boo": _train_step(model, torch.compile(model, backend="boo"), batch)}
    losses = {n: fn() for n, fn in fns.items()}  # boo compiles here; one step's gradients each
    grads = dict(ref.named_parameters())
    err = max([_rel_err(losses["boo"], losses["eager"])] +
              [_rel_err(p.grad, grads[n].grad) for n, p in model.named_parameters() if p.grad is not None])
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    times = interleaved(fns, steps, runs, sync)
    eager, boo = summarize(times["eager"]), summarize(times["boo"], times["eager"])
    placed = boo_backend.placements()
    return {"model": name, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "eager_ms": eager["median_ms"], "boo_ms": boo["median_ms"], "speedup_vs_eager": boo["speedup_vs_eager"],
            "max_rel_err": err, "loss_eager": losses["eager"].item(), "loss_boo": losses["boo"].item(),
            "islands": sum(p.island for p in placed) + sum(p.recovered for p in placed),
            "placements": [p.line() for p in placed]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("deps")
    d.add_argument("--with-torch", action="store_true")
    e = sub.add_parser("env")
    e.add_argument("out", type=Path)
    z = sub.add_parser("zoo")
    z.add_argument("out", type=Path)
    z.add_argument("--model", default="gpt2")
    z.add_argument("--device", default="cuda")
    z.add_argument("--steps", type=int, default=20)
    z.add_argument("--runs", type=int, default=3)
    z.add_argument("--warmup", type=int, default=3)
    ns = p.parse_args(argv)
    if ns.what == "deps":
        print("\n".join(deps(ns.with_torch)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # boo's target and placement lines
    result = env() if ns.what == "env" else zoo(ns.model, ns.device, ns.steps, ns.runs, ns.warmup)
    ns.out.write_text(json.dumps(result, indent=1) + "\n")
    for key, value in result.items():
        if key != "placements":
            print(f"{key}: {value}")
    for line in result.get("placements", []):
        print(f"placement: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
