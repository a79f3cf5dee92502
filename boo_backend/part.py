"""One IREE part of a graph: a lowered graph with its compiled module, mapping the graph's
inputs to IREE's arguments and IREE's results back to the graph's outputs, in eager's layout.

Imports lower and runtime from boo_backend.
"""

from __future__ import annotations

import torch

from . import symbolic
from .lower import Lowered, output_texts
from .runtime import IreeFunction


# Distinct sets of sizes whose evaluated layouts a dynamic part keeps.
_SIZES_KEPT = 1024


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _is_row_major(shape, stride) -> bool:
    """Whether a tensor of this layout reads like IREE's dense result (size-1 dims' strides
    and empty tensors do not matter)."""
    if 0 in shape:
        return True
    return all(n == 1 or a == b for n, a, b in zip(shape, stride, _contiguous_stride(shape)))


def _restrided(r: torch.Tensor, shape, stride) -> torch.Tensor:
    """IREE's dense result `r` in the layout eager gives it. Stride-0 dims (an `expand`ed
    result) keep one copy of the data and are expanded as a view, as in eager."""
    kept = [n if st or n == 1 else 1 for n, st in zip(shape, stride)]
    compact = r[tuple(slice(0, k) for k in kept)]
    out = torch.empty_strided(kept, stride, dtype=r.dtype, device=r.device).copy_(compact)
    return out if kept == list(shape) else out.as_strided(shape, stride)


def _view(args, plan, sizes: dict) -> torch.Tensor:
    """An output that is a view of input i, as eager gives it (lower._view_of_input)."""
    i, shape, stride, offset = plan
    base = args[i]
    value = sizes.get  # symbolic sizes evaluated for this call; ints stand for themselves
    return base.as_strided([value(x, x) for x in shape], [value(x, x) for x in stride],
                           base.storage_offset() + value(offset, offset))


class IreePart(torch.nn.Module):
    """A lowered graph with its compiled module: maps graph inputs to IREE and back.
    A Module, so that it can stand in for a submodule of a graph split around islands."""

    def __init__(self, lowered: Lowered, function: IreeFunction | None):
        super().__init__()
        self.lowered = lowered
        self.function = function
        # Results whose eager strides are not the dense row-major ones IREE produces; with
        # dynamic shapes, the layouts that depend on the call's sizes, evaluated (with the
        # sizes the graph returns: `_texts`) once per distinct set of sizes.
        self.restride, self._symbolic_layouts = [], []
        for j, (shape, stride) in enumerate(lowered.result_layouts):
            if stride is None:
                continue
            if any(isinstance(x, str) for x in (*shape, *stride)):
                self._symbolic_layouts.append((j, shape, stride))
            elif not _is_row_major(shape, stride):
                self.restride.append((j, shape, stride))
        self._texts = output_texts(lowered.outputs) + [
            x for _, shape, stride in self._symbolic_layouts for x in (*shape, *stride) if isinstance(x, str)
        ]
        self._sizes = symbolic.Sizes(lowered.symbols) if lowered.symbols else None
        self._per_sizes: dict[tuple, tuple[list, dict]] = {}
        self.retype = [
            (j, getattr(torch, name)) for j, name in enumerate(lowered.result_dtypes)
            if name.startswith("uint")
        ]
        # A GPU module's constants (tensors the graph holds, on the CPU) are copied to the
        # call's device once, not at every call.
        target = getattr(function, "target", None)
        self._consts_moved = target is not None and not target.is_cpu and any(k == "const" for k, _ in lowered.inputs)
        self._inputs_on: dict[torch.device, list] = {}

    def _concrete(self, args) -> tuple[list, dict]:
        """For this call's sizes: the results to restride, and the values of returned sizes."""
        key = self._sizes.key(args)
        found = self._per_sizes.get(key)
        if found is None:
            values = dict(zip(self._texts, self._sizes.evaluate(self._texts, key)))
            layouts = [(j, [values.get(x, x) for x in shape], [values.get(x, x) for x in stride])
                       for j, shape, stride in self._symbolic_layouts]
            restride = [(j, shape, stride) for j, shape, stride in layouts if not _is_row_major(shape, stride)]
            if len(self._per_sizes) >= _SIZES_KEPT:  # generation: a new length every step
                self._per_sizes.clear()
            found = self._per_sizes[key] = (restride, values)
        return found

    def _inputs_for(self, args) -> list:
        """`lowered.inputs` with the constants on the device of the call's GPU tensors."""
        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        if device is None:
            return self.lowered.inputs
        found = self._inputs_on.get(device)
        if found is None:
            found = self._inputs_on[device] = [
                (k, v.to(device) if k == "const" and isinstance(v, torch.Tensor) else v) for k, v in self.lowered.inputs
            ]
        return found

    def forward(self, *args):
        low = self.lowered
        results: list = []
        restride, sizes = self._concrete(args) if self._sizes else ((), {})
        if self.function is not None:
            inputs = self._inputs_for(args) if self._consts_moved else low.inputs
            tensors = [args[v] if k == "arg" else v for k, v in inputs]
            results = self.function(tensors, len(low.result_layouts))
            for j, dtype in self.retype:
                results[j] = results[j].view(dtype)
            for j, shape, stride in (*self.restride, *restride):
                results[j] = _restrided(results[j], shape, stride)
        outs = [
            args[v] if k == "arg" else results[v] if k == "result" else sizes[v] if k == "size"
            else _view(args, v, sizes) if k == "view" else v
            for k, v in low.outputs
        ]
        return tuple(outs) if low.tuple_output else outs[0]
