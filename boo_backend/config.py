"""Settings for one compile, read from the environment and from torch.compile(options=...).

This module is a leaf: it imports nothing else from boo_backend.

Every control has one environment variable and one options key of the same meaning:

| env                  | options key         | meaning                                              |
|----------------------|---------------------|------------------------------------------------------|
| BOO_STRICT           | strict              | islands and recoveries raise instead of warning      |
| BOO_FORCE_DECOMPOSE  | force_decompose     | "1"/"all" or a comma list of composites to turn off  |
| BOO_DUMP_DIR         | dump_dir            | write per-graph artifacts into this directory        |
| BOO_CACHE            | cache               | "0" turns the compile cache off                      |
| BOO_CACHE_DIR        | cache_dir           | where the on-disk compile cache lives                |
| BOO_TARGET           | target              | IREE target: llvm-cpu, cuda:sm_80, rocm:gfx942, ...  |
| BOO_ATEN_MATMUL      | aten_matmul         | auto (measured), 1 (ATen) or 0 (IREE) for matmuls    |
| BOO_CPU_DRIVER       | cpu_driver          | auto (measured, ATen too), iree, local-task/-sync    |
| BOO_PARTITIONER      | partitioner         | AOTAutograd's split: "mincut" (default) or "default" |
| BOO_COMPILE_TIMEOUT  | compile_timeout     | seconds one iree-compile may take (0: no limit)      |
| BOO_DYNAMIC          | dynamic             | "0": compile symbolic graphs per concrete shape      |
| BOO_VERIFY           | verify              | dynamic modules checked vs eager: auto, all or off   |
| BOO_SYNC             | sync                | wait for the device after every IREE call (debug)    |
| BOO_COMPILE_ONLY     | compile_only        | compile for `target` into the cache, run in eager    |
| BOO_MODE             | mode                | torch.compile's mode=: default, reduce-overhead, ... |
| BOO_BLOCKS           | blocks              | "0": no per-layer modules for repeated blocks        |

torch.compile(model, backend="boo", mode=...) passes its mode here (as the options key "mode");
MODES says what each one means for boo. A setting given explicitly beats the mode's default.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class BooError(RuntimeError):
    """An error boo raises on purpose: strict mode, bad settings, or a failed compile."""


class BooStrictError(BooError):
    """Strict mode (BOO_STRICT=1) refused an eager island or a silent recovery."""


class BooFallbackWarning(UserWarning):
    """A part of a graph runs in eager PyTorch instead of IREE."""


# torch.compile's modes, as boo reads them. Each maps to the defaults it changes; settings given
# explicitly (environment or options) win over them.
MODES = {
    # The measured choices, as measured by default.
    "default": {},
    # The cheapest path per call: one IREE call per graph (no matmul handed to ATen between
    # parts) on the driver with no worker wake-up (local-sync: one core, no thread hand-off).
    "reduce-overhead": {"aten_matmul": "never", "cpu_driver": "local-sync"},
    # Measure every placement choice more broadly: each timing runs AUTOTUNE_SCALE times longer,
    # every matmul and convolution is timed (not only the large ones), and every CPU module
    # picks its driver by measurement, however long its first call took.
    "max-autotune": {"autotune": True},
    # Inductor's name for max-autotune without CUDA graphs: boo uses no CUDA graphs.
    "max-autotune-no-cudagraphs": {"autotune": True},
}
AUTOTUNE_SCALE = 5


def _parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise BooError(f"{name}={value!r} is not a boolean; use 1 or 0")


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "boo"


@dataclasses.dataclass(frozen=True)
class Options:
    """The resolved settings. Build one with `Options.resolve(options)`."""

    strict: bool = False
    # Raw text of the force-decompose control; the composite registry interprets it.
    force_decompose: str = ""
    dump_dir: Path | None = None
    cache: bool = True
    cache_dir: Path = dataclasses.field(default_factory=_default_cache_dir)
    # None: pick from the inputs' device.
    target: str | None = None
    # Where mm/addmm/bmm/convolution run: "auto" (the faster of ATen's kernel and IREE's
    # code, measured per shape on this host), "always" (ATen between IREE parts) or "never".
    aten_matmul: str = "auto"
    # The IREE runtime driver for CPU modules: "auto" (per graph, the faster on its first
    # calls), "local-task" or "local-sync".
    cpu_driver: str = "auto"
    # How AOTAutograd splits forward from backward: "mincut" recomputes cheap ops in the
    # backward instead of saving them (measured faster on the LayerNorm+GELU and MLP steps,
    # slower on the transformer layer); "default" saves what the forward computed.
    partitioner: str = "mincut"
    # Seconds one iree-compile call may run before it is killed and the graph runs in eager
    # PyTorch; 0 means no limit. Real graphs compile in seconds; a compiler loop never ends.
    compile_timeout: float = 180.0
    # A graph Dynamo traced with symbolic sizes compiles once, with dynamic dimensions (True),
    # or once per concrete shape (False).
    dynamic: bool = True
    # Which calls of a dynamic module are checked against the graph run in eager PyTorch:
    # "auto" (the first call of each size class, a bounded number), "all" (every new shape)
    # or "off"; see boo_backend.verify.
    verify: str = "auto"
    # Wait for the device after every IREE call, so that a failing graph raises at its own
    # call rather than as a later call's "semaphore was aborted" (GPU calls can return
    # before their work is done; CPU calls always finish first).
    sync: bool = False
    # Compile every graph for `target` (a GPU one, say, on a machine without it) into the
    # compile cache and dump_dir, and run the graphs in eager PyTorch.
    compile_only: bool = False
    # torch.compile's mode (see MODES); `autotune` is max-autotune's broader measuring.
    mode: str = "default"
    autotune: bool = False
    # A graph of repeated blocks (a model's layers) is cut at the blocks, and each distinct
    # block is lowered and compiled once (boo_backend.blocks); False: one module per graph.
    blocks: bool = True

    @property
    def measure_scale(self) -> int:
        """How many times longer than by default each measurement of a placement runs."""
        return AUTOTUNE_SCALE if self.autotune else 1

    _ENV = {
        "strict": "BOO_STRICT",
        "force_decompose": "BOO_FORCE_DECOMPOSE",
        "dump_dir": "BOO_DUMP_DIR",
        "cache": "BOO_CACHE",
        "cache_dir": "BOO_CACHE_DIR",
        "target": "BOO_TARGET",
        "aten_matmul": "BOO_ATEN_MATMUL",
        "cpu_driver": "BOO_CPU_DRIVER",
        "partitioner": "BOO_PARTITIONER",
        "compile_timeout": "BOO_COMPILE_TIMEOUT",
        "dynamic": "BOO_DYNAMIC",
        "verify": "BOO_VERIFY",
        "sync": "BOO_SYNC",
        "compile_only": "BOO_COMPILE_ONLY",
        "mode": "BOO_MODE",
        "blocks": "BOO_BLOCKS",
    }

    @classmethod
    def resolve(cls, options: dict | None = None) -> "Options":
        """Environment first, then `options` (torch.compile's options dict) on top."""
        raw: dict = {}
        for key, env in cls._ENV.items():
            if env in os.environ:
                raw[key] = os.environ[env]
        for key, value in (options or {}).items():
            if key not in cls._ENV:
                valid = ", ".join(sorted(cls._ENV))
                raise BooError(f"unknown boo option {key!r}; valid options are: {valid}")
            raw[key] = value
        mode = str(raw.pop("mode", None) or "default").strip().lower()
        if mode not in MODES:
            raise BooError(f"mode={mode!r} is not a torch.compile mode boo knows; use one of: {', '.join(MODES)}")
        for key, value in MODES[mode].items():
            if key != "autotune" and raw.get(key) in (None, ""):
                raw[key] = value
        kwargs: dict = {"mode": mode, "autotune": MODES[mode].get("autotune", False)}
        if "strict" in raw:
            kwargs["strict"] = _parse_bool("strict", raw["strict"])
        if "cache" in raw:
            kwargs["cache"] = _parse_bool("cache", raw["cache"])
        for key in ("dynamic", "sync", "compile_only", "blocks"):
            if key in raw:
                kwargs[key] = _parse_bool(key, raw[key])
        if raw.get("aten_matmul", "") != "":
            value = raw["aten_matmul"]
            text = str(value).strip().lower()
            if text in ("auto", "always", "never"):
                kwargs["aten_matmul"] = text
            else:
                try:
                    kwargs["aten_matmul"] = "always" if _parse_bool("aten_matmul", value) else "never"
                except BooError:
                    raise BooError(f"aten_matmul={value!r}; use auto, 1/always (ATen) or 0/never (IREE)") from None
        if raw.get("cpu_driver"):
            value = str(raw["cpu_driver"]).strip().lower()
            if value not in ("auto", "iree", "local-task", "local-sync"):
                raise BooError(f"cpu_driver={value!r}; use auto, iree (measured, never ATen), local-task or local-sync")
            kwargs["cpu_driver"] = value
        if "force_decompose" in raw:
            value = raw["force_decompose"]
            if isinstance(value, (list, tuple, set)):
                value = ",".join(value)
            elif isinstance(value, bool):
                value = "all" if value else ""
            kwargs["force_decompose"] = str(value).strip()
        if raw.get("dump_dir"):
            kwargs["dump_dir"] = Path(raw["dump_dir"])
        if raw.get("cache_dir"):
            kwargs["cache_dir"] = Path(raw["cache_dir"])
        if raw.get("verify") not in (None, ""):
            value = str(raw["verify"]).strip().lower()
            value = {"1": "auto", "true": "auto", "on": "auto", "0": "off", "false": "off"}.get(value, value)
            if value not in ("auto", "all", "off"):
                raise BooError(f"verify={raw['verify']!r}; use auto (default), all (every new shape) or off")
            kwargs["verify"] = value
        if raw.get("partitioner"):
            value = str(raw["partitioner"]).strip().lower()
            if value not in ("mincut", "default"):
                raise BooError(f"partitioner={value!r}; use mincut or default")
            kwargs["partitioner"] = value
        if raw.get("compile_timeout") not in (None, ""):
            try:
                kwargs["compile_timeout"] = float(raw["compile_timeout"])
            except (TypeError, ValueError):
                kwargs["compile_timeout"] = -1.0
            if not kwargs["compile_timeout"] >= 0:
                raise BooError(
                    f"compile_timeout={raw['compile_timeout']!r}; use a number of seconds (0: no limit)"
                )
        if raw.get("target"):
            kwargs["target"] = str(raw["target"]).strip()
        if kwargs.get("compile_only") and not kwargs.get("target"):
            raise BooError("compile_only (BOO_COMPILE_ONLY) needs a target to compile for: set BOO_TARGET "
                           "(options key target), e.g. cuda:sm_80 or rocm:gfx942")
        return cls(**kwargs)
