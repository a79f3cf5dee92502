"""Before AOTAutograd: rewrite the chains models write by hand into ops composites compute.

Imports config; the composite registry (where each pattern is declared, next to its
composite) is read at call time.

A hand-written RMS norm (`x.to(float32).pow(2).mean(-1, keepdim=True)`, `rsqrt`, `*`, ...)
decomposes to a dozen ATen ops in AOTAutograd's forward graph and more in its backward, so
matching it after AOTAutograd could never reach a backward composite. Here, in Dynamo's
graph, where autograd still sees the chain, it becomes one call of an op with its own
autograd formula (boo::rms_norm, aten.gelu, F.scaled_dot_product_attention); AOTAutograd
then puts that op in the forward graph and its backward op in the backward graph.

Dynamo's graph says one thing many ways: `x.pow(2)` and `torch.pow(x, 2)`, `a * b` and
`torch.mul(a, b)`, arguments by position or by name. Both the graph and each pattern are
first put in one form: Tensor methods and operators become torch functions, `0.5 * x`
becomes `x * 0.5`, and every call's arguments are bound to its signature, defaults filled
in (torch.fx's normalize_function). The patterns are matched with torch.fx's SubgraphMatcher.

A pattern's literals must equal the graph's (within 1e-6 for floats), except those written
as `Wild("name")`, which match any value and are handed to the pattern's `replace`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import operator
import warnings
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from .config import BooFallbackWarning

log = logging.getLogger("boo_backend")


class _WildFloat(float):
    name: str


class _WildInt(int):
    name: str


def Wild(name: str, kind: type = float):  # noqa: N802  (reads as a literal in patterns)
    """A literal in a pattern that matches any value; `replace` gets it as captures[name].
    `kind` int makes one that torch accepts where it wants an int (a list of sizes)."""
    wild = (_WildInt if kind is int else _WildFloat)(0)
    wild.name = name
    return wild


def _is_wild(v) -> bool:
    return isinstance(v, (_WildFloat, _WildInt))


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A chain to find (`search`, a function of the chain's tensor inputs) and what to put in
    its place: `replace(graph, inputs, captures, values)` inserts nodes computing the chain's
    result and returns the last one, or returns the reason it leaves this match alone.
    `inputs` are the graph nodes bound to `search`'s parameters, `captures` the Wild
    literals, `values` the example values (FakeTensors) of inputs and result."""

    name: str
    composites: tuple[str, ...]  # BOO_FORCE_DECOMPOSE naming any of these turns it off
    search: Callable
    replace: Callable


# Tensor methods and operators that become torch functions in the normal form.
_METHODS = {"pow", "mean", "rsqrt", "tanh", "mul", "add", "sub", "div", "matmul", "softmax",
            "transpose", "sqrt", "exp", "sum"}
_OPERATORS = {operator.mul: torch.mul, operator.add: torch.add, operator.sub: torch.sub,
              operator.truediv: torch.div, operator.matmul: torch.matmul}
_COMMUTATIVE = {torch.mul, torch.add}


def _example(node) -> object:
    if not isinstance(node, fx.Node):
        return node
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if val is not None else node.meta.get("_pattern_value")


def _tensor_result(node: fx.Node) -> bool:
    return isinstance(_example(node), torch.Tensor)


def _kind(a) -> type:
    """The type normalize_function resolves overloads by."""
    value = _example(a)
    return torch.Tensor if isinstance(value, torch.Tensor) else type(value)


def normalize(graph: fx.Graph) -> None:
    """Put `graph` in the normal form (in place). Nodes whose result is not a tensor (SymInt
    arithmetic) and calls whose arguments cannot be named are left as they are."""
    for node in list(graph.nodes):
        target = node.target
        if node.op == "call_method" and target == "float" and len(node.args) == 1:
            node.target, node.args = "to", (node.args[0], torch.float32)
            continue
        if node.op == "call_method" and target == "to" and "dtype" in node.kwargs and len(node.args) == 1:
            node.args, node.kwargs = (node.args[0], node.kwargs["dtype"]), {}
            continue
        if node.op == "call_method" and target in _METHODS:
            fn = getattr(torch, target)
        elif node.op == "call_function" and target in _OPERATORS:
            fn = _OPERATORS[target]
        elif node.op == "call_function" and target is torch.nn.functional.softmax:
            if node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None) is None:
                continue  # F.softmax's implicit dim has no torch.softmax twin
            fn = torch.softmax
        elif node.op == "call_function" and callable(target) and any(
            getattr(ns, getattr(target, "__name__", ""), None) is target for ns in (torch, torch.nn.functional)
        ):
            fn = target
        else:
            continue
        if not _tensor_result(node):
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        kwargs.pop("_stacklevel", None)
        if fn in _COMMUTATIVE and len(args) == 2 and not isinstance(args[0], fx.Node) and isinstance(args[1], fx.Node):
            args.reverse()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Does not support nested parametric types"
                pair = normalize_function(fn, tuple(args), kwargs, arg_types=tuple(map(_kind, args)),
                                          kwarg_types={k: _kind(v) for k, v in kwargs.items()},
                                          normalize_to_only_use_kwargs=False)
        except Exception:  # noqa: BLE001  (an overload it cannot resolve: the arguments as given)
            pair = None
        if pair is not None:
            args, kwargs = list(pair.args), dict(pair.kwargs)
        node.op, node.target, node.args, node.kwargs = "call_function", fn, tuple(args), kwargs


@functools.cache
def _pattern_graph(pattern: Pattern) -> fx.Graph:
    """The pattern's search function traced and put in the normal form, with example
    tensors standing in for its inputs (normalize_function needs their types)."""
    gm = fx.symbolic_trace(pattern.search)
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["_pattern_value"] = torch.empty(0)
    normalize(gm.graph)
    return gm.graph


def _same(p, g) -> bool:
    if isinstance(p, float) and isinstance(g, (int, float)) and not isinstance(g, bool):
        return math.isclose(p, g, rel_tol=1e-6, abs_tol=1e-12)
    return type(p) is type(g) and p == g


def _literals(match: InternalMatch) -> dict | None:
    """The Wild captures of `match`, or None when a literal of the pattern differs."""
    captures: dict = {}

    def compare(p, g) -> bool:
        if isinstance(p, fx.Node):
            return True  # the matcher checked the structure
        if _is_wild(p):
            if p.name in captures and captures[p.name] != g:
                return False
            captures[p.name] = g
            return True
        if isinstance(p, (list, tuple)) and isinstance(g, (list, tuple)):
            return len(p) == len(g) and all(compare(a, b) for a, b in zip(p, g))
        return _same(p, g)

    for pn, gn in match.nodes_map.items():
        if pn.op in ("placeholder", "output"):
            continue
        if not all(compare(a, b) for a, b in zip(pn.args, gn.args)):
            return None
        if not all(compare(pn.kwargs[k], gn.kwargs[k]) for k in pn.kwargs):
            return None
    return captures


class _Matcher(SubgraphMatcher):
    """SubgraphMatcher whose literals always match here, to be compared by _literals with
    Wild and float tolerance (its own ignore_literals also lets a pattern's op node match a
    literal, then fails on the placeholders it never reached)."""

    def _match_literals(self, pn, gn, match) -> bool:
        if isinstance(pn, fx.Node) or isinstance(gn, fx.Node):
            return super()._match_literals(pn, gn, match)
        return True


def active(force_decompose: str) -> list[Pattern]:
    from . import composites

    off = composites.disabled(force_decompose)
    return [p for p in composites.PATTERNS if not any(composites.by_name(n).op in off for n in p.composites)]


def apply(gm: fx.GraphModule, force_decompose: str, strict: bool = False) -> fx.GraphModule:
    """`gm`, or a rewritten copy of it where enabled patterns matched. A pattern that fails
    leaves the graph as Dynamo gave it (with a warning; strict mode raises)."""
    patterns = active(force_decompose)
    if not patterns:
        return gm
    try:
        graph = copy.deepcopy(gm.graph)
        normalize(graph)
        replaced = 0
        for pattern in patterns:
            matcher = _Matcher(_pattern_graph(pattern), match_output=False, match_placeholder=False,
                               remove_overlapping_matches=True)
            for match in matcher.match(graph):
                replaced += _replace(graph, pattern, match)
        if not replaced:
            return gm
        graph.lint()
        return fx.GraphModule(gm, graph)
    except Exception as e:  # a bug in a pattern must not cost the user the model
        if strict:
            raise
        warnings.warn(f"boo: matching hand-written chains failed ({type(e).__name__}: {e}); "
                      "compiling the graph without patterns", BooFallbackWarning, stacklevel=2)
        return gm


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _replace(graph: fx.Graph, pattern: Pattern, match: InternalMatch) -> int:
    matched = list(match.nodes_map.values())
    if len(match.returning_nodes) != 1 or not all(isinstance(n, fx.Node) for n in matched):
        return 0  # an input matched a literal (a weight of None for a weighted pattern)
    if any(n.graph is not graph or n._erased for n in matched):
        return 0  # an earlier replacement took part of it
    captures = _literals(match)
    if captures is None:
        return 0
    result = match.returning_nodes[0]
    inputs = list(match.placeholder_nodes)
    values = {"inputs": [_example(n) for n in inputs], "result": _example(result)}
    with graph.inserting_before(result.next):
        new = pattern.replace(graph, inputs, captures, values)
    if isinstance(new, str):
        log.debug("boo: pattern %s leaves %s alone: %s", pattern.name, result.name, new)
        return 0
    new.meta.update({k: v for k, v in result.meta.items() if k in ("example_value", "stack_trace", "nn_module_stack")})
    result.replace_all_uses_with(new)
    chain = [gn for pn, gn in match.nodes_map.items() if pn.op not in ("placeholder", "output")]
    for node in sorted(chain, key=_position(graph), reverse=True):
        if not node.users:
            graph.erase_node(node)
    log.debug("boo: pattern %s replaced the chain ending in %s", pattern.name, result.name)
    return 1
