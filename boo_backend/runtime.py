"""Run compiled IREE modules on torch tensors, passing buffers both ways through DLPack.

Imports only compile (for Target) from boo_backend.
"""

from __future__ import annotations

import bisect
import functools
import threading

import iree.runtime as rt
import torch
from torch.utils.dlpack import to_dlpack

from .compile import Target

# Modules live in graphs that Dynamo keeps until the interpreter exits; nanobind's exit-time
# report of those live objects is noise, not a leak.
rt._binding.disable_leak_checker()

_ALIGN = 64  # IREE's heap buffers must start on a 64-byte boundary.
_DLPACK_DEVICE = {"cpu": 1, "cuda": 2, "hip": 10}


@functools.cache
def _instance() -> rt.VmInstance:
    return rt.VmInstance()


@functools.cache
def _device(driver: str) -> rt.HalDevice:
    return rt.get_device(driver)


def _importable(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when IREE can import its memory, else a dense, aligned copy."""
    if t.is_contiguous() and (t.numel() == 0 or t.data_ptr() % _ALIGN == 0):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


class IreeFunction:
    """One loaded module's `main`, called with and returning torch tensors."""

    def __init__(self, vmfb: bytes, target: Target, name: str = "main"):
        self.target = target
        self.device = _device(target.driver)
        inst = _instance()
        self._module = rt.VmModule.copy_buffer(inst, vmfb)
        self._context = rt.VmContext(inst, [rt.create_hal_module(inst, self.device), self._module])
        self._function = self._module.lookup_function(name)
        if self._function is None:
            raise RuntimeError(f"compiled module has no function {name!r}")
        kind = "cpu" if target.is_cpu else target.driver
        self._dl_device = _DLPACK_DEVICE[kind]
        # IREE contexts are not re-entrant; serialize calls from several threads.
        self._lock = threading.Lock()

    def __call__(self, tensors: list[torch.Tensor], num_results: int) -> list[torch.Tensor]:
        args = rt.VmVariantList(len(tensors))
        from_dlpack = self.device.from_dlpack_capsule
        for t in tensors:
            args.push_ref(from_dlpack(to_dlpack(_importable(t))).ref)
        results = rt.VmVariantList(num_results)
        with self._lock:
            self._context.invoke(self._function, args, results)
        device_id = 0
        if tensors and tensors[0].device.index is not None:
            device_id = tensors[0].device.index
        export = self.device.create_dlpack_capsule
        out = [
            torch.from_dlpack(export(results.get_as_object(i, rt.HalBufferView), self._dl_device, device_id))
            for i in range(len(results))
        ]
        return _unalias(out, tensors)


def _unalias(results: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """IREE may hand back an input's buffer (or one buffer twice) for a result that is a copy
    in the graph, e.g. `x.clone()`. The graph promised a fresh tensor, so copy those."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in inputs if t.numel())
    starts = [s for s, _ in spans]
    reach, ends = 0, []
    for _, end in spans:
        reach = max(reach, end)
        ends.append(reach)
    seen: set[int] = set()
    for i, r in enumerate(results):
        if not r.numel():
            continue
        p = r.data_ptr()
        k = bisect.bisect_right(starts, p)
        if p in seen or (k and ends[k - 1] > p):
            results[i] = r.clone()
        seen.add(results[i].data_ptr())
    return results
