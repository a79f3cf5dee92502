"""The runtime's GPU side: one IREE HAL device per torch device (and, on ROCm, per stream),
IREE's work ordered against torch's, and tensors in and out through DLPack.

Imports only config from boo_backend; runtime.py calls it for every module that is not a
CPU one.

Ordering. A GPU module is called through its `main$async` (IREE's "coarse-fences" ABI): each
call takes a wait fence and a signal fence, and may return before its work is done.
- HIP: the HAL device dispatches on torch's own current stream (`hip_external_stream`), so
  IREE's work follows the work torch queued before the call, and torch's later work follows
  IREE's; IREE's HIP driver has queued its work by the time the call returns. No host wait.
  A raw stream pointer crosses between torch and IREE, so IREE must load the same
  libamdhip64 that torch loaded (`--hip_dylib_path`).
- CUDA: IREE's CUDA driver takes no external stream and cannot import or export timepoints.
  So torch's device is synchronized before the call (the work it queued may write the
  inputs), and the signal fence is waited on after it (the outputs are not ready, and the
  inputs are still read, until then).
- `sync` (BOO_SYNC=1) waits for the signal fence and for the whole device after every call,
  so that a failure raises at the call that caused it.

Result buffers. IREE's CUDA driver cannot export a buffer from its stream-ordered pool, so
it is created with `--cuda_async_allocations=false`: every result is a plain allocation
torch can take over. HIP exports pool buffers.

Importing. Arguments arrive dense, row-major, 64-byte aligned and at offset 0, none sharing
memory with another (runtime._importable and runtime.IreeFunction see to that: IREE's GPU
kernels take each argument as `align 16` and `noalias`). A tensor on another device (a CPU
scalar among CUDA tensors) is copied to the module's device first. `to_dlpack` is used, not
`Tensor.__dlpack__`, which synchronizes the default stream (~25 us a tensor), and
`_cuda_getCurrentRawStream`, not `torch.cuda.current_stream()` (15-50 us).
"""

from __future__ import annotations

import functools
import logging
import threading

import iree.runtime as rt
import torch
from torch.utils.dlpack import to_dlpack

from .config import BooError

log = logging.getLogger("boo_backend")

DLPACK_CPU, DLPACK_CUDA, DLPACK_ROCM = 1, 2, 10

# torch's float8 dtypes as IREE's element types. IREE's DLPack import and export know no
# float8 ("dlpack unsupported buffer view element type"), so these cross as uint8 views of
# the same bytes and get their type back on the other side.
FLOAT8 = {getattr(torch, name): getattr(rt.HalElementType, element) for name, element in (
    ("float8_e4m3fn", "FLOAT_8_E4M3_FN"), ("float8_e4m3fnuz", "FLOAT_8_E4M3_FNUZ"),
    ("float8_e5m2", "FLOAT_8_E5M2"), ("float8_e5m2fnuz", "FLOAT_8_E5M2_FNUZ"),
    ("float8_e8m0fnu", "FLOAT_8_E8M0_FNU")) if hasattr(torch, name)}
_FLOAT8_DTYPE = {int(element): dtype for dtype, element in FLOAT8.items()}


def import_tensor(hal: rt.HalDevice, t: torch.Tensor) -> rt.HalBufferView:
    """`t` as a buffer view of `hal`, zero-copy through DLPack (to_dlpack: see above)."""
    if t.dtype not in FLOAT8:
        return hal.from_dlpack_capsule(to_dlpack(t))
    raw = hal.from_dlpack_capsule(to_dlpack(t.view(torch.uint8)))
    return rt.HalBufferView(raw.get_buffer(), list(t.shape), FLOAT8[t.dtype])


def export_tensor(hal: rt.HalDevice, view: rt.HalBufferView, dl_device: int, index: int) -> torch.Tensor:
    """A result buffer view as a torch tensor on DLPack device (`dl_device`, `index`), zero-copy."""
    dtype = _FLOAT8_DTYPE.get(int(view.element_type))
    if dtype is None:
        return torch.from_dlpack(hal.create_dlpack_capsule(view, dl_device, index))
    raw = rt.HalBufferView(view.get_buffer(), list(view.shape), rt.HalElementType.UINT_8)
    return torch.from_dlpack(hal.create_dlpack_capsule(raw, dl_device, index)).view(dtype)


class BooDeviceError(BooError):
    """No IREE device matches the torch device, or the IREE driver cannot start."""


class Queue:
    """One HAL device and a timeline semaphore: the fences for calls of fenced modules.

    `host_wait`: wait for each call's signal fence before returning (CUDA; and every target
    when `sync`). `before`/`after`: torch-side ordering around the call, if any."""

    def __init__(self, hal: rt.HalDevice, dl_device: int, index: int, host_wait: bool,
                 before=None, after=None):
        self.hal = hal
        self.dl_device = dl_device
        self.index = index
        self.host_wait = host_wait
        self._before, self._after = before, after
        self._semaphore = hal.create_semaphore(0)
        self._timepoint = 0
        self._no_wait = rt.HalFence(0)
        self._lock = threading.Lock()

    def invoke(self, context: rt.VmContext, function: rt.VmFunction, args: rt.VmVariantList,
               num_results: int, sync: bool) -> rt.VmVariantList:
        """Call `function` with `args` (tensors already imported), appending the fences."""
        results = rt.VmVariantList(num_results)
        with self._lock:
            self._timepoint += 1
            signal = rt.HalFence.create_at(self._semaphore, self._timepoint)
        args.push_ref(self._no_wait.ref)  # nothing to wait for: the ordering is done here
        args.push_ref(signal.ref)
        if self._before is not None:
            self._before()
        context.invoke(function, args, results)
        if self.host_wait or sync:
            signal.wait()  # raises the device's error, if the work failed
        if sync and self._after is not None:
            self._after()
        return results

    def export(self, results: rt.VmVariantList) -> list[torch.Tensor]:
        return [export_tensor(self.hal, results.get_as_object(i, rt.HalBufferView), self.dl_device, self.index)
                for i in range(len(results))]


def _uuid(text) -> str:
    """A device UUID as bare lowercase hex: torch prints it with dashes, IREE as GPU-..."""
    return "".join(c for c in str(text).lower().removeprefix("gpu-") if c in "0123456789abcdef")


@functools.cache
def _torch_hip_library() -> str | None:
    """The libamdhip64 this process loaded (torch's), from /proc/self/maps."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libamdhip64.so" in path:
                    return path
    except OSError:
        pass
    return None


_DRIVER_FLAGS_SET: set[str] = set()


def _driver(name: str) -> rt.HalDriver:
    """IREE's driver, with the flags it must be created with (see the module docstring)."""
    if name not in _DRIVER_FLAGS_SET:
        _DRIVER_FLAGS_SET.add(name)
        if name == "cuda":
            rt.flags.parse_flags("--cuda_async_allocations=false")
        elif name == "hip":
            path = _torch_hip_library()
            if path:
                # A bare path names a directory to search; "file:" names the library itself.
                rt.flags.parse_flags(f"--hip_dylib_path=file:{path}")
            else:
                log.warning("boo: cannot find the libamdhip64 torch loaded; IREE loads its own, "
                            "and torch's stream may not be valid in it")
    try:
        return rt.get_driver(name)
    except Exception as e:
        raise BooDeviceError(f"boo: IREE's {name} driver cannot start: {str(e).splitlines()[0]}") from e


@functools.cache
def _device_infos(driver: str) -> dict[str, dict]:
    return {_uuid(info["path"]): info for info in _driver(driver).query_available_devices()}


def _device_info(driver: str, index: int) -> dict:
    """IREE's description of torch's device `index`, matched by UUID: the two may number
    devices differently (CUDA_DEVICE_ORDER, several GPUs)."""
    uuid = _uuid(torch.cuda.get_device_properties(index).uuid)
    infos = _device_infos(driver)
    if uuid not in infos and len(infos) == 1 == torch.cuda.device_count():
        log.warning("boo: IREE's %s device %s does not carry the UUID torch reports for cuda:%d (%s); "
                    "it is the only GPU either sees, so boo uses it", driver, next(iter(infos)), index, uuid)
        return next(iter(infos.values()))
    if uuid not in infos:
        raise BooDeviceError(
            f"boo: IREE's {driver} driver has no device with the UUID of torch's cuda:{index} ({uuid}); "
            f"it sees {sorted(infos) or 'none'}"
        )
    return infos[uuid]


_QUEUES: dict[tuple[str, int, int], Queue] = {}
_QUEUES_LOCK = threading.Lock()


def queue_for(driver: str, index: int) -> Queue:
    """The Queue for torch device `index`: one per device on CUDA, one per device and stream
    on HIP (each HAL device dispatches on the stream it was created with)."""
    stream = torch._C._cuda_getCurrentRawStream(index) if driver == "hip" else 0
    key = (driver, index, stream)
    queue = _QUEUES.get(key)
    if queue is not None:
        return queue
    with _QUEUES_LOCK:
        if key not in _QUEUES:
            _QUEUES[key] = _make_queue(driver, index, stream)
        return _QUEUES[key]


def _make_queue(driver: str, index: int, stream: int) -> Queue:
    info = _device_info(driver, index)
    sync_device = functools.partial(torch.cuda.synchronize, index)
    if driver == "hip":
        hal = _driver(driver).create_device(info, params={"hip_external_stream": str(stream)})
        log.debug("boo: IREE hip device for cuda:%d on torch's stream %#x", index, stream)
        return Queue(hal, DLPACK_ROCM, index, host_wait=False, after=sync_device)
    hal = _driver(driver).create_device(info)
    log.debug("boo: IREE cuda device for cuda:%d", index)
    # synchronize() waits for every stream of the device: more than the current stream, but
    # one call without building a Stream object.
    return Queue(hal, DLPACK_CUDA, index, host_wait=True, before=sync_device, after=sync_device)


def torch_device_index(tensors) -> int:
    """The CUDA device the call's tensors are on (torch's current one if none is)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device.index
    return torch.cuda.current_device()
