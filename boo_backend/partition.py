"""Decide where each node of a graph runs, and reshape the graph to match.

Imports embed (for op names) and decompositions; nothing from compile or runtime.

Fallback order for a node that the composites did not take:
  1. torch-mlir's own lowering (inside IREE's torch input pipeline);
  2. a torch._decomp decomposition applied at FX level, then step 1 again;
  3. an eager PyTorch island between IREE parts.
Which nodes need 2 or 3 is learned from the compiler itself (see graph.py); this module
applies a `Plan` once it is known.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

from .decompositions import FALLBACK, PRE_LOWERING, needs_pre_lowering
from .embed import mlir_op_name


@dataclasses.dataclass
class Plan:
    """torch-mlir op names that go down fallback steps 2 and 3."""

    decompose: set[str] = dataclasses.field(default_factory=set)
    island: set[str] = dataclasses.field(default_factory=set)

    def to_json(self) -> dict:
        return {"decompose": sorted(self.decompose), "island": sorted(self.island)}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        return cls(set(data["decompose"]), set(data["island"]))


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The ATen op calls of a graph (getitem and other Python glue left out)."""
    return [
        n for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    ]


def is_symbolic(gm: fx.GraphModule) -> bool:
    """True when an input has symbolic sizes (Dynamo's dynamic shapes)."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return True
        if isinstance(val, torch.Tensor) and any(
            isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())
        ):
            return True
    return False


def retrace(gm: fx.GraphModule, args: list, decompositions: dict | None = None) -> fx.GraphModule:
    """Trace `gm` again on fake copies of concrete `args`: sizes become constants, every node
    gets fresh metadata, and ops in `decompositions` are replaced by their decompositions."""
    traced = make_fx(
        gm,
        decomposition_table=decompositions or {},
        tracing_mode="fake",
        _allow_non_fake_inputs=True,
    )(*args)
    return traced


def _values(node: fx.Node) -> tuple:
    args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    if len(args) < 2 and "dim" in node.kwargs:
        args.append(node.kwargs["dim"])
    return tuple(args)


def op_for_name(name: str):
    """The OpOverload torch-mlir calls `name` (torch.aten.sum.dim_IntList), or None."""
    parts = name.split(".")
    if len(parts) not in (3, 4) or parts[0] != "torch":
        return None
    packet = getattr(getattr(torch.ops, parts[1], None), parts[2], None)
    return getattr(packet, parts[3] if len(parts) == 4 else "default", None)


def decomposition_table(names: set[str]) -> tuple[dict, set[str]]:
    """Decompositions for the ops named in `names` (boo's own first, then torch._decomp);
    also the names that have none."""
    table: dict = {}
    missing: set[str] = set()
    for name in sorted(names):
        op = op_for_name(name)
        found = {}
        if op is not None:
            found = {op: FALLBACK[op]} if op in FALLBACK else get_decompositions([op])
        if found:
            table.update(found)
        else:
            missing.add(name)
    return table, missing


def preparation_table(gm: fx.GraphModule, decompositions: dict, canonical: dict) -> dict:
    """Everything one retrace applies: the pre-lowering rewrites where a node needs one, the
    composites' canonical forms, and the plan's decompositions (which win). make_fx applies
    the table to the ops that decompositions emit too, so one trace is enough."""
    table = dict(canonical)
    if any(needs_pre_lowering(n.target, _values(n)) for n in compute_nodes(gm)):
        table.update(PRE_LOWERING)
    table.update(decompositions)
    return table


# Ops left to ATen by choice under BOO_ATEN_MATMUL=1, the way Inductor calls extern kernels.
ATEN_MATMUL = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
})


def node_places(gm: fx.GraphModule, plan: Plan, extern: frozenset = frozenset()) -> dict[fx.Node, str]:
    """'iree', 'eager' (an island) or 'aten' (an extern kernel by choice) for each call node;
    getitem follows the node it reads."""
    places: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0] in places:
            places[node] = places[node.args[0]]
        elif mlir_op_name(node.target) in plan.island:
            places[node] = "eager"
        else:
            places[node] = "aten" if node.target in extern else "iree"
    return places


def split_islands(gm: fx.GraphModule, places: dict[fx.Node, str]) -> tuple[fx.GraphModule, dict[str, str]]:
    """Cut `gm` into consecutive runs of same-place nodes. Returns the outer graph, whose
    submodules `submod_N` are the runs, and each submodule's place."""
    index: dict[fx.Node, int] = {}
    part, previous = -1, None
    for node in gm.graph.nodes:
        if node not in places:
            continue
        if node.target is operator.getitem and node.args[0] in index:
            index[node] = index[node.args[0]]
            continue
        if places[node] != previous:
            part, previous = part + 1, places[node]
        index[node] = part
    place_of_part = {f"submod_{index[n]}": places[n] for n in index}
    outer = split_module(gm, None, lambda n: index[n], keep_original_order=True)
    return outer, place_of_part
