"""IREE compilation: target flags, the compiler call, and its errors.

Imports only config, cache and placing from boo_backend.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import re
import shlex
import signal
import subprocess
import time

from . import placing
from .cache import CompileCache, timed
from .config import BooError

log = logging.getLogger("boo_backend")

# The CUDA architectures IREE 3.13 compiles for: sm_60 to sm_89, and the consumer Blackwells
# sm_120/sm_121, whose PTX must be at least the version named here (measured: sm_121 with
# +ptx87 fails in LLVM). Hopper (sm_90) and datacenter Blackwell (sm_100/103/110) are
# rejected as "missing GPU target": they get sm_89 code instead, whose PTX their drivers
# compile for them when the module loads. That choice is logged once per architecture.
_CUDA_NEWEST = 89
_CUDA_NEWER = {120: "+ptx87", 121: "+ptx88"}


@dataclasses.dataclass(frozen=True)
class Target:
    """An IREE target: how to compile for it and which runtime driver runs it."""

    name: str  # canonical spelling, e.g. "llvm-cpu", "cuda:sm_80", "rocm:gfx942"
    flags: tuple[str, ...]
    driver: str  # iree.runtime driver name, the default one
    # Flags that make faster code but that the compiler sometimes fails with; a module that
    # fails with them is compiled again without them.
    optional_flags: tuple[str, ...] = ()
    # What replaces the embedded-linker flag for a module that computes in float64: IREE's
    # CPU runtime has no float64 math functions (tanh, sin, atan2, ...) to link into its
    # portable embedded library, so such a module links as a system shared library whose
    # undefined libm symbols bind, when the runtime dlopens it, to the libm that Python
    # itself links. The linker is the wheel's own lld (`-z now`: a missing symbol fails at
    # load, not at a call). None: no such flags (GPU targets, whose math is their own).
    f64_flags: tuple[str, ...] | None = None
    # Call the module's `main$async`, which takes a wait and a signal fence and may return
    # before the device is done (every torch-input module has one), instead of `main`,
    # which waits. GPU modules do; see boo_backend.gpu.
    fenced: bool = False

    @property
    def kind(self) -> str:
        """llvm-cpu, cuda or rocm."""
        return self.name.split(":")[0]

    @property
    def is_cpu(self) -> bool:
        return self.driver.startswith("local")

    @property
    def host_specific(self) -> bool:
        """Whether a module depends on the host compiling it (llvm-cpu's `host` CPU does);
        GPU modules do not, so cache keys leave the host out for them."""
        return self.is_cpu

    @property
    def drivers(self) -> tuple[str, ...]:
        """The runtime drivers that can run this target's modules. The CPU has two: local-task
        (a worker pool: parallel, but each call wakes the workers, 20-150 us) and local-sync
        (the calling thread: one core, a few us per call); runtime.IreeFunction picks one."""
        return ("local-task", "local-sync") if self.is_cpu else (self.driver,)


@functools.cache
def find_tool(name: str) -> str:
    """The path of one of IREE's compiler tools (iree-compile, iree-lld): IREE_TOOL_PATH's
    directories first, as IREE's own lookup does, then the one the iree-base-compiler wheel
    ships. Found without importing iree.compiler, which loads the whole compiler library
    into the process (55 MB resident): boo runs the compiler as a separate process."""
    import importlib.util

    for directory in os.environ.get("IREE_TOOL_PATH", "").split(os.pathsep):
        if directory and os.access(os.path.join(directory, name), os.X_OK):
            return os.path.join(directory, name)
    spec = importlib.util.find_spec("iree.compiler")
    for package in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(package, "_mlir_libs", name)
        if os.access(path, os.X_OK):
            return path
    from iree.compiler.tools.binaries import find_tool as iree_find_tool

    return iree_find_tool(name)


_EMBEDDED_LINKER = f"--iree-llvmcpu-embedded-linker-path={find_tool('iree-lld')}"


def parse_target(spec: str) -> Target:
    """Turn `llvm-cpu`, `cuda:sm_80` or `rocm:gfx942` (also `hip:`) into a Target."""
    kind, _, arch = spec.strip().partition(":")
    kind = kind.lower()
    if kind in ("llvm-cpu", "cpu"):
        cpu = arch or "host"
        return Target(
            f"llvm-cpu:{cpu}" if arch else "llvm-cpu",
            (
                "--iree-hal-target-device=local",
                "--iree-hal-local-target-device-backends=llvm-cpu",
                f"--iree-llvmcpu-target-cpu={cpu}",
                # Without it, float reductions keep strict order: scalar code and a long
                # rounding chain. Eager PyTorch reassociates too.
                "--iree-llvmcpu-reassociate-fp-reductions",
                "--iree-input-demote-f64-to-f32=false",
                _EMBEDDED_LINKER,
            ),
            "local-task",
            f64_flags=(
                "--iree-llvmcpu-link-embedded=false",
                f"--iree-llvmcpu-system-linker-path={shlex.quote(find_tool('iree-lld'))} -flavor gnu -z now",
                # The compiler's own evaluation of constant subgraphs links its code into the
                # embedded library, where libm's sin is an undefined symbol: the whole module
                # failed for sin of an arange in float64 (a positional table). Such values are
                # computed when the module runs instead, as eager computes them.
                "--iree-opt-const-eval=false",
            ),
            # Packed (data-tiled) matmuls: measured 2x faster on the MLP backward here, but
            # IREE 3.13 fails on some ("operations with large vector sizes"); see compile_mlir.
            # They are packed on the path from global optimization: IREE 3.13's default path
            # (from dispatch creation) computes some matmuls wrongly, without an error
            # (tests/test_iree_workarounds.py): where two of its dims are the same dynamic
            # size (attention's scores @ values, [s0, s1, s1] @ [s0, s1, s2]) and one passes
            # 64, and, with static sizes, a batched matmul beside a sum of its left operand
            # over the contracted dim (torch.cdist's backward: gradients off by 10). The
            # global path was as fast on an MLP step and a batched matmul here.
            optional_flags=("--iree-global-opt-data-tiling",),
        )
    if kind == "cuda":
        arch = arch or "sm_80"
        m = re.fullmatch(r"sm_(\d+)", arch)
        if not m:
            raise BooError(f"BOO_TARGET={spec!r}: a CUDA target looks like cuda:sm_80")
        sm = int(m.group(1))
        features = ()
        if sm in _CUDA_NEWER:
            features = (f"--iree-cuda-target-features={_CUDA_NEWER[sm]}",)
        elif sm > _CUDA_NEWEST:
            _log_newer_cuda(arch)
            arch = f"sm_{_CUDA_NEWEST}"
        return Target(
            f"cuda:{arch}",
            ("--iree-hal-target-device=cuda", f"--iree-cuda-target={arch}", *features),
            "cuda",
            fenced=True,
        )
    if kind in ("rocm", "hip"):
        arch = arch or "gfx942"
        return Target(
            f"rocm:{arch}",
            ("--iree-hal-target-device=hip", f"--iree-rocm-target={arch}"),
            "hip",
            fenced=True,
        )
    raise BooError(
        f"unknown IREE target {spec!r}; use llvm-cpu, cuda:sm_XX or rocm:gfxXXXX"
    )


@functools.cache
def _log_newer_cuda(arch: str) -> None:
    log.info("boo: IREE 3.13 has no %s target; compiling sm_%d code, which the CUDA driver "
             "compiles for %s when the module loads (BOO_TARGET=cuda:sm_XX picks another)",
             arch, _CUDA_NEWEST, arch)


def target_for(spec: str | None, tensors) -> Target:
    """`spec` (BOO_TARGET) when given, else the target for the tensors' device: a GPU's when
    any tensor is on one (a CPU scalar may come first), else the CPU's."""
    if spec:
        return parse_target(spec)
    import torch

    found = [t.device for t in tensors if isinstance(t, torch.Tensor)]
    return target_for_device(next((d for d in found if d.type != "cpu"), torch.device("cpu")))


def target_for_device(device) -> Target:
    """The default target for tensors on `device` (a torch.device)."""
    if device.type == "cpu":
        return parse_target("llvm-cpu")
    if device.type == "cuda":
        import torch

        if torch.version.hip:
            arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
            return parse_target(f"rocm:{arch}")
        major, minor = torch.cuda.get_device_capability(device)
        return parse_target(f"cuda:sm_{major}{minor}")
    raise BooError(f"boo has no IREE target for device {device}; set BOO_TARGET")


class BooCompileError(BooError):
    """iree-compile failed. Carries the MLIR, the flags and the compiler's diagnostics."""

    def __init__(self, mlir: str, flags: list[str], diagnostics: str):
        self.mlir = mlir
        self.flags = flags
        self.diagnostics = diagnostics
        numbered = "\n".join(f"{i + 1:5d} {line}" for i, line in enumerate(mlir.splitlines()[:200]))
        super().__init__(
            "iree-compile failed\n"
            f"flags: {' '.join(flags)}\n"
            f"diagnostics:\n{diagnostics.strip()}\n"
            f"module (first 200 lines):\n{numbered}"
        )

    def failing_lines(self) -> list[int]:
        """1-based lines of the input module that the diagnostics point at."""
        return sorted({int(n) for n in re.findall(r"<stdin>:(\d+):\d+: error", self.diagnostics)})


_DYNAMIC_DIM = re.compile(r"vtensor<\[[^\]]*\?|tensor<(?:\d+x)*\?")


def has_dynamic_dims(mlir: str) -> bool:
    """Whether a module's text has a tensor type with a dynamic (`?`) dim."""
    return _DYNAMIC_DIM.search(mlir) is not None


_F64 = re.compile(r"[\[<,x]f64>")


def computes_in_f64(mlir: str) -> bool:
    """Whether a module's text has a float64 tensor type."""
    return _F64.search(mlir) is not None


def compile_flags(target: Target, optional: bool = True, dynamic: bool = False, f64: bool = False) -> list[str]:
    """iree-compile's flags for `target`; `f64` for a module that computes in float64 (see
    Target.f64_flags). `dynamic` (a module with dynamic dims) takes the same flags."""
    extra = target.optional_flags if optional else ()
    flags = target.flags
    if f64 and target.f64_flags is not None:
        flags = (*(f for f in flags if f != _EMBEDDED_LINKER), *target.f64_flags)
    return ["--iree-input-type=torch", *flags, *extra]


class BooCompileTimeout(BooError):
    """iree-compile did not finish within the time limit (BOO_COMPILE_TIMEOUT)."""

    def __init__(self, limit: float, remembered: bool = False):
        self.limit = limit
        when = "an earlier run found that " if remembered else ""
        super().__init__(
            f"{when}iree-compile did not finish within {limit:g} s; raise BOO_COMPILE_TIMEOUT "
            "(options key compile_timeout; 0 means no limit) to wait longer, or file the module "
            "that BOO_DUMP_DIR writes"
        )


def _run_compiler(mlir: str, flags: list[str], cache: CompileCache, timeout: float) -> bytes:
    """iree-compile on `mlir`. Past `timeout` seconds (0: no limit) its whole process group
    is killed, so a compiler that loops never hangs the caller. A module that reads a result
    it places (placing.READS_PLACED) compiles in two runs, with placing.alias_early between
    them; the limit applies to each."""
    cache.stats["iree_compiles"] += 1
    with timed("iree_compile"):
        if placing.READS_PLACED not in mlir:
            return _run_process(mlir, flags, timeout)
        text = _run_process(mlir, [*flags, "--compile-to=input"], timeout).decode()
        try:
            text, moved = placing.alias_early(text)
        except Exception as e:  # noqa: BLE001 - IR the rewrite cannot read: IREE's own order
            log.debug("boo: placed results left where IREE's import puts them (%s)", e)
            return _run_process(mlir, flags, timeout)
        log.debug("boo: %d placed result(s) aliased where they are made", moved)
        return _run_process(text, [*flags, "--compile-from=input"], timeout, source=mlir)


def _run_process(mlir: str, flags: list[str], timeout: float, source: str | None = None) -> bytes:
    """One iree-compile process; `source` is the torch module to report when it fails (by
    default `mlir`)."""
    cmd = [find_tool("iree-compile"), "-", *flags, "--mlir-print-op-on-diagnostic=false", "-o", "-"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(mlir.encode(), timeout=timeout or None)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise BooCompileTimeout(timeout) from None
    except BaseException:  # KeyboardInterrupt included: never leave a compiler behind
        _kill_group(proc)
        raise
    if proc.returncode != 0 or not out:
        raise BooCompileError(source or mlir, flags, err.decode(errors="replace"))
    return out


# IREE's CPU codegen refuses a dispatch whose stack buffers pass 32 KiB. Some fused row
# reductions need more: bf16 logits cast to float32 and fed to log-softmax (a causal LM's
# loss in bf16 training) took 89 KiB at 140 rows of 1000 classes, 157 KiB with symbolic
# rows, and the whole graph ran in eager. Such a module is compiled again with this much
# allowed; local-task's workers get stacks that hold it (runtime._WORKER_STACK), and
# local-sync runs on the caller's thread (8 MiB on Linux).
_STACK_REFUSED = "exceeded stack allocation limit"
_STACK_ROOM = "--iree-llvmcpu-stack-allocation-limit=524288"


def _run_with_stack_room(mlir: str, flags: list[str], cache: CompileCache, timeout: float) -> bytes:
    """_run_compiler, run again with _STACK_ROOM when the CPU codegen refused a dispatch for
    the stack it needs."""
    try:
        return _run_compiler(mlir, flags, cache, timeout)
    except BooCompileError as e:
        if _STACK_REFUSED not in e.diagnostics or not any(f.startswith("--iree-llvmcpu") for f in flags):
            raise
        log.debug("boo: iree-compile refused a dispatch's stack use; retrying with %s:\n%s",
                  _STACK_ROOM, e.diagnostics[:2000])
        return _run_compiler(mlir, [*flags, _STACK_ROOM], cache, timeout)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.communicate()


def compile_mlir(mlir: str, target: Target, cache: CompileCache, timeout: float = 0) -> bytes:
    """Compile `mlir` (torch dialect text) to a vmfb, through the cache. The key names the
    full flag set even when the module needed the conservative one, so a warm cache never
    retries the failing compile. A compile that ran out of time is remembered with its limit,
    so later processes with the same or a shorter limit fail at once."""
    dynamic, f64 = has_dynamic_dims(mlir), computes_in_f64(mlir)
    flags = compile_flags(target, dynamic=dynamic, f64=f64)
    key = cache.key("vmfb", mlir, *flags, target.name, host=target.host_specific)
    blob = cache.get(key)
    if blob is not None:
        return blob
    timed_out = cache.key("timeout", key, host=target.host_specific)
    earlier = cache.get_json(timed_out)
    if earlier is not None and timeout and timeout <= earlier["limit"]:
        raise BooCompileTimeout(timeout, remembered=True)
    try:
        try:
            blob = _run_with_stack_room(mlir, flags, cache, timeout)
        except BooCompileError as e:
            optional = set(flags) - set(compile_flags(target, optional=False, f64=f64))
            if not optional:
                raise
            log.debug("boo: iree-compile failed with %s; retrying without them:\n%s",
                      " ".join(sorted(optional)), e.diagnostics[:2000])
            blob = _run_with_stack_room(mlir, compile_flags(target, optional=False, f64=f64), cache, timeout)
    except BooCompileTimeout:
        cache.put_json(timed_out, {"limit": timeout})
        raise
    cache.put(key, blob)
    return blob


def precompile(mlirs: list[str], target: Target, cache: CompileCache, timeout: float = 0) -> None:
    """Compile these modules into the cache side by side, one iree-compile per core, so that
    the compile_mlir calls that follow hit the cache (a graph's distinct blocks, the one-op
    modules extern.py times). A module that fails is left out: its own compile_mlir call
    compiles it again and reports the error. STATS counts the wall time, not the sum."""
    todo = list(dict.fromkeys(mlirs))
    workers = min(len(todo), os.cpu_count() or 1)
    if workers < 2:
        return

    def one(mlir: str) -> None:
        try:
            compile_mlir(mlir, target, cache, timeout)
        except Exception:  # noqa: BLE001 - reported by the caller's own compile
            pass

    before, start = cache.stats["iree_compile_s"], time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, todo))
    cache.stats["iree_compile_s"] = before + time.perf_counter() - start


_ALIAS = re.compile(r"^(#[\w$.-]+)\s*=", re.M)


def combine(mlirs: list[str]) -> str | None:
    """One module holding the functions of all of `mlirs` (torch-mlir's printed modules):
    the i-th one's symbols (`@main`, its composite kernels) and attribute aliases (`#map`)
    are prefixed with `m{i}_`, so its entry point is `m{i}_main`. One iree-compile of the
    whole took 3.1 s for GPT-2 small's 11 one-op backward modules, against 5.4 s for one
    compile each, two side by side on two cores. None when a module is not laid out as
    expected (something after its closing brace, such as resource blobs, or an `@` in a
    string)."""
    prelude, bodies = [], []
    for i, mlir in enumerate(mlirs):
        head, found, body = mlir.partition("module {\n")
        body = body.rstrip()
        if (not found or not body.endswith("\n}") or "{-#" in body or re.search(r'"[^"\n]*@', mlir)
                or any(line and not line.startswith("#") for line in head.splitlines())):
            return None
        body = body[:-1]
        for alias in _ALIAS.findall(head):
            pattern = re.compile(re.escape(alias) + r"(?![\w$.-])")
            head = pattern.sub(f"#m{i}_{alias[1:]}", head)
            body = pattern.sub(f"#m{i}_{alias[1:]}", body)
        prelude.append(head)
        bodies.append(re.sub(r"@([\w$.-]+)", rf"@m{i}_\1", body))
    return "".join(prelude) + "module {\n" + "".join(bodies) + "}\n"


_LEFT_OVER = re.compile(r"^\s*(?:%[\w:#, %]+=\s*)?(torch\.(?:aten|prims)\.[\w.]+)", re.M)


def unconverted_ops(mlir: str, target: Target) -> set[str]:
    """ATen op names that IREE's torch input conversion leaves unconverted in `mlir`.

    When an op has no lowering, the conversion fails on its operands instead: constants
    that lost their location when they were hoisted and uniqued ("<unknown>:0: error:
    failed to legalize operation 'torch.constant.int'"), so no line names the op. This runs
    the input phase alone (well under a second) and reads the IR it prints on failure:
    every ATen op still in it is one the conversion could not lower."""
    cmd = [find_tool("iree-compile"), "-", *compile_flags(target, optional=False), "--compile-to=input",
           "--mlir-print-ir-after-failure", "--mlir-print-op-on-diagnostic=false", "-o", os.devnull]
    try:
        proc = subprocess.run(cmd, input=mlir.encode(), capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return set()
    err = proc.stderr.decode(errors="replace")
    if proc.returncode == 0 or "failed to legalize operation 'torch." not in err:
        return set()
    dump = err.split("IR Dump After", 1)[-1] if "IR Dump After" in err else ""
    return set(_LEFT_OVER.findall(dump))
