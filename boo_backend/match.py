"""Step 1 of a graph's journey: mark ATen nodes that a composite kernel will compute.

Imports the composite registry (a leaf), decompositions and embed (for the meta key).

A matched node stays an ATen node in the FX graph, carrying `node.meta["boo_composite"]`;
lower.py swaps it for a call to the rendered kernel after torch-mlir imports the graph.
Nodes that a composite declines keep going down torch-mlir's path; the reason is logged at
debug level.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator

import torch.fx as fx

from . import composites
from .config import Options
from .decompositions import AOT, fma_decomposition, foreach_decompositions, keep_dtypes
from .embed import META_KEY, schema_args

log = logging.getLogger("boo_backend")



@dataclasses.dataclass(frozen=True)
class CompositeCall:
    """A matched node: which composite computes it, with which template parameters."""

    entry: composites.Composite
    params: dict
    # Positions of the op's arguments that the kernel takes, in order (absent ones dropped).
    arg_positions: tuple[int, ...]
    # Indices of the op's results the kernel returns, in order.
    results: tuple[int, ...]


def _value(a):
    """An argument as the composite sees it: a node's value, in lists too (a symbolic
    normalized_shape holds SymInt nodes)."""
    if isinstance(a, (list, tuple)):
        return type(a)(_value(x) for x in a)
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _outs(node: fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _used_results(node: fx.Node, outs: list) -> set[int]:
    if len(outs) == 1:
        return {0}
    used = set()
    for user in node.users:
        if user.target is operator.getitem:
            if outs[user.args[1]] is not None:  # a getitem of an absent gradient is None
                used.add(user.args[1])
        else:
            used.update(range(len(outs)))
    return used


def _match_node(node: fx.Node, entry: composites.Composite, target: str) -> CompositeCall | str:
    args = [_value(a) for a in schema_args(node)]  # keyword-only ones too, in schema order
    kwargs = {k: _value(v) for k, v in node.kwargs.items()}
    outs = _outs(node)
    reason = entry.accepts(args, kwargs, outs)
    if reason:
        return reason
    produced = tuple(i for i, o in enumerate(outs) if o is not None)
    if not _used_results(node, outs) <= set(produced):
        return "a result the kernel does not produce is used"
    positions = tuple(i for i in entry.tensor_args if i < len(args) and args[i] is not None)
    params = {**entry.params(args, kwargs, outs), "target": target}
    return CompositeCall(entry, params, positions, produced)


def canonical_table(opts: Options) -> dict:
    """The rewrites that put calls of enabled composites into their kernels' shapes."""
    return {op: e.canonical for op, e in composites.enabled(opts.force_decompose).items() if e.canonical}


def apply(gm: fx.GraphModule, opts: Options, target: str) -> list[str]:
    """Mark the nodes of `gm` that enabled composites accept (in canonical form already: see
    canonical_table); returns the composite names of the marked nodes, in graph order. `target` (llvm-cpu, cuda, rocm) reaches
    the templates, which may tune their layout to it."""
    enabled = composites.enabled(opts.force_decompose)
    matched = []
    for node in gm.graph.nodes:
        entry = enabled.get(node.target) if node.op == "call_function" else None
        if entry is None:
            continue
        result = _match_node(node, entry, target)
        if isinstance(result, str):
            log.debug("boo: composite %s declines %s: %s", entry.name, node.name, result)
            continue
        node.meta[META_KEY] = result
        matched.append(entry.name)
    return matched


def decompositions(opts: Options) -> dict:
    """The decomposition table for AOTAutograd: core ATen minus the enabled composites. Built
    once per set of enabled composites (0.04-0.1 s each time, once per graph Dynamo hands
    over); each call gets its own copy."""
    return dict(_decompositions(frozenset(composites.enabled(opts.force_decompose))))


@functools.lru_cache(maxsize=8)
def _decompositions(kept: frozenset) -> dict:
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    table.update(foreach_decompositions())
    table.update(fma_decomposition())
    table.update(AOT)
    for op in kept:
        table.pop(op, None)
    return {op: keep_dtypes(op, fn) for op, fn in table.items()}
