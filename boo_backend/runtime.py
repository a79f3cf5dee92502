"""Run compiled IREE modules on torch tensors, passing buffers both ways through DLPack.

Imports cores (the CPU's cores, shared with torch's threads and the thread that waits), gpu
(devices, fences and ordering for GPU modules), memory (which tensors share memory, and which
results leave IREE's pool), pool (storage for results), compile (for Target) and config from
boo_backend.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time

import iree.runtime as rt
import torch

from . import cores, gpu, memory, pool
from .cache import timed
from .compile import Target
from .config import BooError

log = logging.getLogger("boo_backend")

# Modules live in graphs that Dynamo keeps until the interpreter exits; nanobind's exit-time
# report of those live objects is noise, not a leak.
rt._binding.disable_leak_checker()

_ALIGN = 64  # IREE's heap buffers must start on a 64-byte boundary.
# The first call snapshots the arguments it passes zero-copy, up to this many bytes in all.
_SNAPSHOT_LIMIT = 256 << 20


@functools.cache
def _instance() -> rt.VmInstance:
    return rt.VmInstance()


# The stack of each local-task worker thread. IREE's default is smaller than what a module
# compiled with compile._STACK_ROOM may use in one dispatch (up to 512 KiB): bf16 logits fed
# to log-softmax at 256 rows crashed a worker. Set before the first local-task device.
_WORKER_STACK = 2 << 20


@functools.cache
def _cpu_device(driver: str) -> rt.HalDevice:
    if driver == "local-task":
        rt.flags.parse_flags(f"--task_worker_stack_size={_WORKER_STACK}")
    return rt.get_device(driver)


class BooRuntimeError(BooError):
    """IREE failed while running a compiled graph."""


def _importable(t: torch.Tensor | int, copy: bool = False, device: torch.device | None = None) -> torch.Tensor | int:
    """`t` itself when IREE can import its memory, else a dense, aligned copy (always a copy
    when `copy`: the module writes into that argument) on the module's device: `device`
    for a GPU module, the CPU when None. An empty tensor is always made afresh: torch calls
    one with any strides contiguous, which IREE's import rejects. A size (an int: a graph
    with dynamic shapes takes some) passes as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    moved = t.device != device if device is not None else t.is_cuda
    if not (copy or moved) and t.numel() and t.is_contiguous() and t.data_ptr() % _ALIGN == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=device or (t.device if not moved else "cpu"))
    return memory.copy_into(out, t)


def _elsewhere(tensors: list, on_gpu: bool) -> torch.device | None:
    """Where the results go when no tensor of the call is on the module's side (a CPU
    module called with CUDA tensors, or the reverse): the first tensor's device."""
    first = None
    for t in tensors:
        if isinstance(t, torch.Tensor):
            if t.is_cuda == on_gpu:
                return None
            first = first or t.device
    return first


class _Loaded:
    """The module loaded on one HAL device: its context and `main`, and for a module that
    takes fences (every GPU module), the gpu.Queue that supplies them. `pooled`: the device
    hands out results from a pool that must get them back soon (see memory.POOLED).
    `placed`: (result index, shape, dtype) of each result the module writes into storage
    passed after its arguments (storage.with_storage)."""

    def __init__(self, module: rt.VmModule, device: rt.HalDevice, name: str, graph: str,
                 queue: "gpu.Queue | None" = None, pooled: bool = False, placed=(), workers: bool = False):
        inst = _instance()
        self.device = device
        self.pooled = pooled
        self.workers = workers  # local-task: IREE's worker threads run the call (see boo_backend.cores)
        # What each call needs to pass a placed result's storage, worked out once.
        self._storage = [(tuple(shape), dtype, math.prod(shape) * dtype.itemsize,
                          memory.SAME_SIZE_INT[dtype.itemsize], rt.Shape(list(shape)))
                         for _, shape, dtype in placed]
        self._placed_at = frozenset(j for j, _, _ in placed)
        self.context = rt.VmContext(inst, [rt.create_hal_module(inst, device), module])
        if queue is not None:
            name += "$async"
        self.function = module.lookup_function(name)
        if self.function is None:
            raise BooRuntimeError(f"boo: compiled module of graph {graph} has no function {name!r}")
        self.queue = queue

    def run(self, passed: list, num_results: int, sync: bool, spans=None,
            whole=frozenset()) -> list[torch.Tensor]:
        """`spans`: memory.spans(passed), where the caller has it already. `whole`: positions
        of arguments (copies) IREE may overwrite in full (see IreeFunction._overwritten)."""
        if self.queue is not None and self.queue.dl_device != gpu.DLPACK_CPU:
            whole = ()
        args = _arguments(self.device, passed, whole)
        if self.queue is not None:
            return self._kept(self.queue.export(self.queue.invoke(self.context, self.function, args, num_results, sync)),
                              passed, whole)
        storage = self._placed_storage(args) if self._storage else ()
        results = rt.VmVariantList(num_results - len(storage))
        if self.workers:
            cores.release_torch_threads()
            cores.wait_aside(self.context.invoke, self.function, args, results)
        else:
            self.context.invoke(self.function, args, results)
        out = [gpu.export_tensor(self.device, results.get_as_object(i, rt.HalBufferView), gpu.DLPACK_CPU, 0)
               for i in range(len(results))]
        if self.pooled and out:
            out = memory.out_of_pool(out, memory.spans(passed) if spans is None else spans)
        out = self._kept(out, passed, whole)
        if not storage:
            return out
        if not out:
            return storage
        made, placed = iter(out), iter(storage)
        return [next(placed) if j in self._placed_at else next(made) for j in range(num_results)]

    @staticmethod
    def _kept(out: list[torch.Tensor], passed: list, whole) -> list[torch.Tensor]:
        """A result IREE wrote into an argument imported as host memory (`whole`) does not keep
        that memory alive once exported: such a result is remade on the argument's storage
        (a copy made for this call), which does."""
        if not whole or not out:
            return out
        held = [(t.untyped_storage(), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                for i, t in enumerate(passed) if i in whole and isinstance(t, torch.Tensor) and t.numel()]
        for j, r in enumerate(out):
            p = r.data_ptr()
            for storage, start, size in held:
                if r.numel() and start <= p < start + size:
                    kept = torch.empty(0, dtype=r.dtype)
                    if (p - start) % r.element_size():
                        out[j] = memory.dense_copy(r)
                    else:
                        out[j] = kept.set_(storage, (p - start) // r.element_size(), r.shape, r.stride())
                    break
        return out

    def _placed_storage(self, args: rt.VmVariantList) -> list[torch.Tensor]:
        """Fresh storage for each placed result (from pool.RESULTS), pushed onto `args` as a
        buffer view IREE writes the result into, zero-copy."""
        storage = []
        allocator = self.device.allocator
        for shape, dtype, nbytes, bits, view_shape in self._storage:
            t = pool.RESULTS.tensor(shape, dtype, nbytes)
            storage.append(t)
            buffer = allocator.import_host_allocation(t.view(bits).numpy(), _STORAGE_MEMORY, _STORAGE_USAGE)
            args.push_ref(buffer.create_view(view_shape, dtype.itemsize).ref)
        return storage


# Storage for placed results is imported as host memory IREE may write in full: a DLPack
# import allows READ|WRITE only, and local-sync's writes of a whole buffer ask for DISCARD_WRITE.
_STORAGE_MEMORY = int(rt.MemoryType.DEVICE_LOCAL) | int(rt.MemoryType.HOST_VISIBLE)
_STORAGE_USAGE = int(rt.BufferUsage.DEFAULT) | int(rt.BufferUsage.MAPPING)


# How a CPU module picks its driver when BOO_CPU_DRIVER=auto: after its first call, it is
# called _ROUNDS more times on each driver, alternating, and keeps the one with the lower
# minimum, local-task's weighted by _IN_USE: back-to-back calls find its workers awake, a
# training step does not (its workers sleep between calls and share the cores with torch's
# threads). Measured on the main job's graphs: 92 against 90 us and 107 against 108 us back
# to back, yet the step took 0.57-0.67 ms on local-sync against 0.64-0.81 ms on local-task.
# Each timed call follows a torch parallel region (cores.after_torch_work), as a part between
# ATen's kernels does in the step: with OMP_WAIT_POLICY unset, torch's worker then spins for
# about 7 ms on one of the cores local-task's workers want (memory._PARALLEL_COPY).
# A winner other than the target's default driver must win again over as many more rounds
# (one stalled sample must not send a large graph to a single core). A first call slower
# than _MEASURE_LIMIT seconds skips all this and keeps local-task: such a graph does enough
# work to gain from two cores, and measuring would cost seconds.
#
# A static CPU part may also offer ATen as a driver (ATEN, `aten` in IreeFunction): its own
# graph, op by op, on torch's threads. It is timed like the others and wins only the same way.
# At small sizes on 2 cores, a part on one IREE core lost to ATen's two threads: layer norm
# and GELU on 256x1024 took 0.29 ms in IREE against ATen's 0.16 ms. Run in ATen, the MLP step of
# bench/steps.py went from 0.84x eager to 0.89x (bench/RESULTS.md, sixteenth session). At the
# Llama's size IREE's parts took 71 ms a step, where ATen would take 220 ms.
_ROUNDS = 3
_IN_USE = {"local-task": 1.25}
_MEASURE_LIMIT = 0.1
ATEN = "aten"


class IreeFunction:
    """One loaded module's `main`, called with and returning torch tensors.

    IREE's kernels treat their arguments as distinct, read-only memory (GPU kernels mark them
    `noalias`). Two guarantees follow: arguments that share memory are passed as separate
    copies, and an argument the module writes into is passed as a copy. The second set is
    `writes` (known from the graph: in-place kernels such as sort and scatter), plus whatever
    the first call finds changed: that call keeps a snapshot of the arguments it passes
    zero-copy, restores any that IREE wrote, and runs again with copies.

    `placed`: (result index, shape, dtype) of the results written into storage that each
    call allocates (storage.with_storage; CPU modules without fences only).
    `driver` names the runtime driver; None lets the function choose among the target's
    drivers by timing its first calls (see _ROUNDS), and tells `remember` what it chose.
    `checked`: what an earlier process's first-call check found this module writes into (the
    check is then skipped: it clones every argument passed zero-copy, a second or more of a
    large model's warm start); else the check runs and tells `remember_writes` what it found.
    A GPU module is loaded once per gpu.Queue (a torch device, and on ROCm a stream) it is
    called on. `sync`: wait for the device after every call (BOO_SYNC).
    """

    def __init__(self, vmfb: bytes, target: Target, name: str = "main", graph: str = "?",
                 writes: frozenset[int] = frozenset(), driver: str | None = None,
                 remember=None, sync: bool = False, measure_scale: int = 1,
                 checked: frozenset[int] | None = None, remember_writes=None, placed=(), aten=None):
        self.target = target
        self.placed = tuple(placed)
        self.measure_scale = measure_scale
        self.graph = graph
        self.sync = sync
        self._name = name
        self._module = rt.VmModule.copy_buffer(_instance(), vmfb)
        self._loaded: dict = {ATEN: aten} if aten is not None else {}
        self.writes = set(writes) | (checked or set())
        self._checked = checked is not None
        self._remember_writes = remember_writes
        # IREE contexts are not re-entrant; serialize calls from several threads.
        self._lock = threading.Lock()
        self._remember = remember
        self._gpu = not target.is_cpu
        choices = self.drivers = (*target.drivers, *([ATEN] if aten is not None else []))
        if driver is not None and driver not in choices:
            raise BooRuntimeError(f"boo: driver {driver!r} cannot run {target.name} modules; use one of {choices}")
        self.driver = driver if driver is not None or len(choices) > 1 else choices[0]
        if not self._gpu:  # a GPU module is loaded on its first call's device (_on_gpu)
            self._use(self.driver or target.driver)

    def _load(self, driver: str) -> "_Loaded | OnAten":
        if driver not in self._loaded:
            device = _cpu_device(driver)
            # A fenced CPU target (tests) runs the GPU calling convention on the CPU.
            queue = gpu.Queue(device, gpu.DLPACK_CPU, 0, host_wait=True) if self.target.fenced else None
            self._loaded[driver] = _Loaded(self._module, device, self._name, self.graph, queue,
                                           pooled=driver in memory.POOLED, placed=self.placed,
                                           workers=driver == "local-task")
        return self._loaded[driver]

    def _use(self, driver: str) -> None:
        if driver == "local-task" and self.driver == driver:
            cores.hint_wait_policy()
        self._current = self._load(driver)

    def _on_gpu(self, passed: list) -> _Loaded:
        """The module loaded on the Queue of this call's device (and ROCm stream)."""
        queue = gpu.queue_for(self.driver, gpu.torch_device_index(passed))  # every tensor is there now
        loaded = self._loaded.get(queue)
        if loaded is None:
            loaded = self._loaded[queue] = _Loaded(self._module, queue.hal, self._name, self.graph, queue)
        return loaded

    def __call__(self, tensors: list[torch.Tensor], num_results: int,
                 donated: frozenset[int] = frozenset()) -> list[torch.Tensor]:
        """`donated`: positions of tensors the caller will not read again and that no other
        tensor shares; IREE may write into them, so they are passed as they are, and results
        in their memory are kept. Not on the first call, which checks what IREE writes."""
        device = torch.device("cuda", gpu.torch_device_index(tensors)) if self._gpu else None
        if not self._checked:
            donated = frozenset()
        passed = [_importable(t, i in self.writes and i not in donated, device) for i, t in enumerate(tensors)]
        spans = memory.spans(passed)
        if len(spans) > 1:
            shared = memory.overlapping(spans)
            if shared:
                for i in shared:
                    passed[i] = _importable(passed[i], True, device)
                spans = memory.spans(passed)
        try:
            if not self._checked or self.driver is None:  # the first call checks and chooses
                return self._first_call(tensors, passed, spans, num_results)
            return self._invoke(tensors, passed, spans, num_results, donated)
        except BooRuntimeError as e:
            if self._gpu or "DISCARD_WRITE" not in str(e.__cause__):
                raise
            return self._overwritten(tensors, num_results, e)

    def _overwritten(self, tensors, num_results, error):
        """IREE overwrites some argument in full (with dynamic shapes, `x[1:].fill_(7)` fills
        x's own buffer), which a DLPack import does not allow. Run once more on copies of the
        arguments not yet passed as copies, imported so that IREE may overwrite them; those
        it changed (or all of them, where it changed none: a fill may leave the same bits)
        are passed so from now on, and the call is made again."""
        fresh = {i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.numel()} - self.writes
        if not fresh:
            raise error
        passed = [_importable(t, i in fresh) for i, t in enumerate(tensors)]
        self._current.run(passed, num_results, self.sync, whole=self.writes | fresh)
        changed = {i for i in fresh if not memory.same_bits(passed[i], tensors[i])}
        log.debug("boo: IREE overwrites arguments %s of graph %s; passing copies from now on",
                  sorted(changed or fresh), self.graph)
        self.writes |= changed or fresh
        return self(tensors, num_results)

    def _first_call(self, tensors, passed, spans, num_results):
        start = time.perf_counter()
        if self._checked:
            results = self._invoke(tensors, passed, spans, num_results)
        else:
            results = self._checked_call(tensors, passed, spans, num_results)
        if self.driver is None:
            with timed("driver_choice"), pool.RESULTS.transient():
                self._choose(time.perf_counter() - start, passed, num_results)
        return results

    def _checked_call(self, tensors, passed, spans, num_results):
        if isinstance(self._current, OnAten):  # a warm start on ATen: IREE does not run here
            results = self._invoke(tensors, passed, spans, num_results)
            self._checked = True
            return results
        zero_copy = [i for i, (t, p) in enumerate(zip(tensors, passed)) if t is p and isinstance(t, torch.Tensor)]
        size = sum(tensors[i].numel() * tensors[i].element_size() for i in zero_copy)
        if size > _SNAPSHOT_LIMIT:  # a large model's weights: rely on `writes` alone
            log.debug("boo: %s passes %d MB zero-copy; skipping the first-call write check",
                      self.graph, size >> 20)
            zero_copy = []
        before = {i: tensors[i].clone() for i in zero_copy}
        results = self._invoke(tensors, passed, spans, num_results)
        written = {i for i in zero_copy if not memory.same_bits(before[i], tensors[i])}
        self._checked = True
        if self._remember_writes is not None and len(zero_copy) == sum(isinstance(t, torch.Tensor) for t in tensors):
            self._remember_writes(frozenset(self.writes | written))
        if not written:
            return results
        log.debug("boo: IREE wrote into arguments %s of graph %s; passing copies from now on",
                  sorted(written), self.graph)
        for i in written:
            tensors[i].copy_(before[i])
        self.writes |= written
        return self(tensors, num_results)

    def _choose(self, first: float, passed: list[torch.Tensor], num_results: int) -> None:
        """Pick the driver (see _ROUNDS). The extra calls run on copies of the arguments, so
        they change nothing the caller sees."""
        default = self.target.driver
        if first > _MEASURE_LIMIT and self.measure_scale == 1:  # max-autotune measures them all
            self._decide(default, f"its first call took {first * 1e3:.0f} ms")
            return
        passed = [_importable(t, copy=True) for t in passed]
        copies = frozenset(range(len(passed)))  # IREE may overwrite any of them
        times: dict[str, float] = {}
        with self._lock:
            if ATEN in self.drivers and not self._aten_agrees(passed, num_results, copies):
                self.drivers = tuple(d for d in self.drivers if d != ATEN)
            for driver in self.drivers:
                loaded = self._load(driver)
                self._timed_invoke(loaded, passed, num_results, copies)  # warm-up
            for _ in range(2):
                for _ in range(_ROUNDS * self.measure_scale):
                    for driver in self.drivers:
                        t = self._timed_invoke(self._loaded[driver], passed, num_results, copies)
                        times[driver] = min(times.get(driver, t), t)
                best = min(times, key=lambda d: times[d] * _IN_USE.get(d, 1.0))
                if best == default:
                    break
        self._decide(best, ", ".join(f"{d} {t * 1e6:.0f} us" for d, t in times.items()))

    def _aten_agrees(self, passed: list, num_results: int, copies: frozenset[int]) -> bool:
        """Whether the part's graph in ATen gives what IREE gives on these arguments (see
        OnAten.disagreement). Else, or if ATen fails, it is not offered."""
        # IREE writes into its `writes` arguments: those get copies, so ATen reads the originals.
        ours = self._load(self.target.driver).run(
            [_importable(t, copy=True) if i in self.writes else t for i, t in enumerate(passed)], num_results, self.sync,
            whole=copies)
        try:
            wrong = self._loaded[ATEN].disagreement(passed, ours)
        except Exception as e:
            wrong = f"it fails there ({e})"
        if wrong:
            log.debug("boo %s: its graph in ATen does not give IREE's results (%s); it stays in IREE", self.graph, wrong)
        return not wrong

    def _timed_invoke(self, loaded: _Loaded, passed, num_results, copies) -> float:
        cores.after_torch_work()
        start = time.perf_counter()
        loaded.run(passed, num_results, self.sync, whole=copies)
        return time.perf_counter() - start

    def _decide(self, driver: str, why: str) -> None:
        self.driver = driver
        self._use(driver)
        log.log(logging.INFO if self._remember else logging.DEBUG, "boo %s: runs on %s (%s)", self.graph, driver, why)
        if self._remember is not None:
            self._remember(driver)

    def _invoke(self, tensors, passed, spans, num_results, donated: frozenset[int] = frozenset()):
        try:
            with self._lock, _labelled(self.graph):
                loaded = self._on_gpu(passed) if self._gpu else self._current
                # Only this call's own copies may be overwritten in full: a donated tensor keeps
                # its DLPack import, so that results written there stay where they are.
                copies = () if self._gpu else {i for i in self.writes if passed[i] is not tensors[i]}
                out = loaded.run(passed, num_results, self.sync, spans, copies)
        except gpu.BooDeviceError:
            raise
        except Exception as e:  # IREE reports its runtime errors as IndexError/RuntimeError
            shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                               for t in tensors)
            where = "ATen (the part's own graph, measured faster)" if isinstance(self._current, OnAten) else "IREE"
            raise BooRuntimeError(
                f"boo: {where} failed while running graph {self.graph} on ({shapes}): "
                f"{str(e).strip().splitlines()[0]}. Unset BOO_STRICT and set BOO_CACHE=0 to retry, "
                "or file the module that BOO_DUMP_DIR writes"
                + ("" if self.sync or not self._gpu else "; BOO_SYNC=1 makes each graph's error show at its own call")
            ) from e
        home = _elsewhere(tensors, self._gpu)
        if home is not None:
            out = [r.to(home) for r in out]
        elif len(self.placed) == num_results and not isinstance(loaded, OnAten):
            return out  # each result lies in storage this call took: fresh, and apart
        # Only memory the caller still reads matters: a copy made for this call (an argument
        # IREE writes into) and a donated tensor are no one else's, so a result there is fresh.
        return memory.unalias(out, [s for s in spans if passed[s[2]] is tensors[s[2]] and s[2] not in donated])


class OnAten:
    """The "aten" driver: the part's own graph (`run`: the IREE arguments to its results), op
    by op in ATen. Its results are made dense, as IREE's are; IreeFunction._invoke then copies
    any that alias an argument or each other. `disagreement(passed, ours)`: how IREE's results
    `ours` on `passed` differ from the graph's, or None (assemble builds it on verify.py's)."""

    def __init__(self, run, disagreement):
        self._run = run
        self.disagreement = disagreement

    def run(self, passed: list, num_results: int, sync: bool, spans=None, whole=()) -> list[torch.Tensor]:
        out = self._run(passed)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        storages: set[int] = set()
        for i, r in enumerate(out):
            if not r.is_contiguous():
                r = r.contiguous()
            # A view of a larger tensor (one piece of a split) would keep all of it alive; two
            # views of one tensor would share memory. IREE hands back a buffer per result.
            if r.numel() and (r.untyped_storage().nbytes() > r.numel() * r.element_size()
                              or r.untyped_storage().data_ptr() in storages):
                r = r.clone()
            storages.add(r.untyped_storage().data_ptr())
            out[i] = r
        return out


def _labelled(graph: str):
    """Under torch.profiler, a range named after the graph, so a trace shows what each IREE
    call ran; otherwise nothing (a range costs microseconds a call)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"boo: {graph}")
    return contextlib.nullcontext()


def _arguments(device: rt.HalDevice, passed: list[torch.Tensor], whole=()) -> rt.VmVariantList:
    """The call's argument list: each tensor imported zero-copy through DLPack, each size as
    an i64 (a float of sizes as an f64), and room for the two fences of a fenced module.
    A host tensor at a position in `whole` is imported as memory IREE may overwrite in full
    (a DLPack import allows READ|WRITE only; see _STORAGE_USAGE).
    (IREE 3.13's VmVariantList cannot be cleared, so one is built per call.)"""
    args = rt.VmVariantList(len(passed) + 2)
    for i, t in enumerate(passed):
        if isinstance(t, torch.Tensor):
            view = gpu.import_tensor(device, t)
            if whole and i in whole and t.numel() and not t.is_cuda and (
                    bits := memory.SAME_SIZE_INT.get(t.element_size())) is not None:
                buffer = device.allocator.import_host_allocation(t.view(bits).numpy(), _STORAGE_MEMORY, _STORAGE_USAGE)
                view = rt.HalBufferView(buffer, list(t.shape), view.element_type)
            args.push_ref(view.ref)
        elif isinstance(t, float):
            args.push_float(t)
        else:
            args.push_int(int(t))
    return args
