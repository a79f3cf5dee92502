"""One IREE part of a graph: a lowered graph with its compiled module, mapping the graph's
inputs to IREE's arguments and IREE's results back to the graph's outputs, in eager's layout.

Imports checks, lower, runtime, memory and partition (for the ATen kernels' ops) from boo_backend.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from . import memory, symbolic
from .checks import raise_if_failed
from .lower import Lowered, arguments, output_texts
from .partition import ATEN_MEASURED
from .runtime import IreeFunction


log = logging.getLogger("boo_backend")

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
    out = memory.copy_into(torch.empty_strided(kept, stride, dtype=r.dtype, device=r.device), compact)
    return out if kept == list(shape) else out.as_strided(shape, stride)


def _view(base: torch.Tensor, plan, sizes: dict) -> torch.Tensor:
    """An output that is a view of `base` (an input: lower._view_of_input; another output:
    lower._views_of_outputs), as eager gives it."""
    _, shape, stride, offset, *dtype = plan
    if dtype and dtype[0] is not None:
        base = base.view(dtype[0])
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
        self._texts = output_texts(lowered.outputs) + [v for k, v in lowered.inputs if k == "size"] + [
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
        # Outputs that view another output (lower._views_of_outputs), made after the others.
        self._aliases = [(i, v) for i, (k, v) in enumerate(lowered.outputs) if k == "alias"]

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

    def forward(self, *args, donated: frozenset[int] = frozenset()):
        """`donated`: positions in IREE's arguments (`lowered.inputs`) of tensors that are
        dead after this call (see Donating)."""
        low = self.lowered
        results: list = []
        restride, sizes = self._concrete(args) if self._sizes else ((), {})
        if self.function is not None:
            inputs = self._inputs_for(args) if self._consts_moved else low.inputs
            tensors = arguments(inputs, args, sizes)
            results = self.function(tensors, len(low.result_layouts), donated)
            if low.checks:
                raise_if_failed(results[len(results) - len(low.checks):], low.checks, self.function.graph)
            for j, dtype in self.retype:
                results[j] = results[j].view(dtype)
            for j, shape, stride in (*self.restride, *restride):
                results[j] = _restrided(results[j], shape, stride)
        outs = [
            args[v] if k == "arg" else results[v] if k == "result" else sizes[v] if k == "size"
            else _view(args[v[0]], v, sizes) if k == "view" else results[v[0]].permute(v[1]) if k == "permuted" else v
            for k, v in low.outputs
        ]
        for i, v in self._aliases:
            outs[i] = _view(outs[v[0]], v, sizes)
        return tuple(outs) if low.tuple_output else outs[0]


class Donating(torch.nn.Module):
    """One call site of an IreePart (parts are shared between repeated blocks) whose
    arguments at positions `donated` (of IREE's arguments) are dead after the call and fresh: an ATen matmul's
    result that nothing else reads. A module that writes into an argument (index_put,
    scatter: `Lowered.writes`) then gets such a tensor as it is, not a copy. An embedding's
    backward with tied weights scatters into the projection's gradient, 154 MB for GPT-2."""

    def __init__(self, part: IreePart, donated: frozenset[int]):
        super().__init__()
        self.part = part
        self.donated = donated

    def forward(self, *args):
        return self.part(*args, donated=self.donated)


def _returned(sub: fx.GraphModule, index):
    """The node that `sub` returns at `index` (None: its only result), or None."""
    out = next(n for n in sub.graph.nodes if n.op == "output")
    returned = out.args[0]
    if isinstance(returned, (tuple, list)):
        if not isinstance(index, int) or index >= len(returned):
            return None
        returned = returned[index]
    elif index is not None:
        return None
    if not (isinstance(returned, fx.Node) and list(returned.users) == [out]):
        return None  # also read inside `sub`, or returned twice: it may alias another result
    return returned


def _owned(outer: fx.GraphModule, node, hops: int = 8) -> bool:
    """Whether the tensor of `node` (an argument in the outer graph) is fresh memory that
    nothing else reads: a result an ATen kernel made (a matmul's), or a view of one, with
    every step read only by the next."""
    if hops == 0 or not isinstance(node, fx.Node) or len(node.users) != 1:
        return False
    index = None
    if node.op == "call_function" and node.target is operator.getitem:
        node, index = node.args
    if not (isinstance(node, fx.Node) and node.op == "call_module"):
        return False
    sub = getattr(outer, node.target)
    if isinstance(sub, Donating):
        sub = sub.part
    if isinstance(sub, IreePart):  # an IREE part may hand on a view of its input i
        outputs = sub.lowered.outputs
        kind, plan = outputs[0 if index is None else index] if (index or 0) < len(outputs) else (None, None)
        if kind != "view":
            return False
        source = plan[0]
        if sum(k in ("view", "arg") and (v[0] if k == "view" else v) == source for k, v in outputs) != 1:
            return False
        return node.args.count(node.args[source]) == 1 and _owned(outer, node.args[source], hops - 1)
    if not isinstance(sub, fx.GraphModule):
        return False
    returned = _returned(sub, index)
    if returned is None or returned.op != "call_function":
        return False
    kernel = returned.args[0] if returned.target is operator.getitem else returned
    if isinstance(kernel, fx.Node) and kernel.op == "call_function" and kernel.target in ATEN_MEASURED:
        return True
    base = returned.args[0] if getattr(returned.target, "is_view", False) else None
    if not (isinstance(base, fx.Node) and base.op == "placeholder" and list(base.users) == [returned]):
        return False
    position = [n for n in sub.graph.nodes if n.op == "placeholder"].index(base)
    source = node.args[position] if position < len(node.args) else None
    return node.args.count(source) == 1 and _owned(outer, source, hops - 1)


def donate(outer):
    """`outer` (a graph cut into parts, or one IreePart) with each call of an IreePart that
    writes into an argument (Lowered.writes) and gets, there, a fresh ATen result read by
    nothing else, made a Donating call site: no copy of that argument per call."""
    if not isinstance(outer, fx.GraphModule):
        return outer
    for node in outer.graph.nodes:
        part = getattr(outer, node.target, None) if node.op == "call_module" else None
        if not isinstance(part, IreePart) or part.function is None or not part.lowered.writes:
            continue
        low = part.lowered
        # An argument the part also returns (as itself or a view) must keep its old values.
        returned = {v[0] if k == "view" else v for k, v in low.outputs if k in ("view", "arg")}
        donated = frozenset(
            j for j in low.writes
            if low.inputs[j][0] == "arg" and (v := low.inputs[j][1]) not in returned and v < len(node.args)
            and node.args.count(node.args[v]) == 1 and _owned(outer, node.args[v])
        )
        if donated:
            log.debug("boo: %s writes into fresh ATen results %s; passed without a copy", part.function.graph, sorted(donated))
            setattr(outer, node.target, Donating(part, donated))
    return outer
