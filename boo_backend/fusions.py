"""Rewrites across ops: chains that AOTAutograd's decompositions leave in a form that costs
whole passes over large tensors, each replaced by fewer ops that compute the same values.
Imports only composites (for `same`, a leaf) from boo_backend.

Every rewrite is an algebraic identity, checked on the nodes' ops, dtypes and shapes, never
on a model. At the sizes people train, the tensors these chains touch are the largest of the
step (a vocabulary of 50257 by a width of 768 is 154 MB in float32), and fresh memory is
dear: a new tensor of that size costs 55 ms of page faults on the AVX2 machines here, against
10 ms for one pass over memory already mapped.

- **Scatter into zeros, then add** (`accumulate_into`): `add(X, index_put(zeros, indices,
  values, accumulate=True))` is `index_put(X, indices, values, True)`. An embedding's
  backward scatters its rows into zeros. With tied weights (GPT-2's lm_head), AOTAutograd
  then adds the projection's gradient. The rewrite drops a zeroed tensor and a pass. Only
  for float32 and float64: in half precision the sum would be rounded in a different order.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.fx as fx

from .composites import same

aten = torch.ops.aten
log = logging.getLogger("boo_backend")

_EXACT = (torch.float32, torch.float64)


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _only_user(node, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and list(node.users) == [user]


def _is_zeros(node) -> bool:
    """A node that makes a tensor of zeros (full, full_like, zeros, zeros_like)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.zeros.default, aten.zeros_like.default):
        return True
    if node.target in (aten.full.default, aten.full_like.default):
        fill = _arg(node, 1, "fill_value")
        return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0
    return False


def _insert(graph: fx.Graph, anchor: fx.Node, target, args: tuple, value) -> fx.Node:
    """A call of `target` before `anchor`, with `anchor`'s metadata (source location, module
    stack) and `value` as its result's value. The value is given, not computed: on symbolic
    sizes, computing it could add guards to the shape environment."""
    with graph.inserting_before(anchor):
        node = graph.call_function(target, args)
    node.meta = {**anchor.meta, "val": value}
    node.meta.pop("tensor_meta", None)
    return node


def _accumulate_into(graph: fx.Graph, add: fx.Node) -> bool:
    if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return False
    out = _val(add)
    if not isinstance(out, torch.Tensor) or out.dtype not in _EXACT:
        return False
    for put, other in (add.args, reversed(add.args)):
        if not (isinstance(put, fx.Node) and put.target is aten.index_put.default and _only_user(put, add)):
            continue
        base = put.args[0]
        if not (_arg(put, 3, "accumulate", False) and _is_zeros(base) and _only_user(base, put)):
            continue
        x = _val(other)
        if not (isinstance(x, torch.Tensor) and x.dtype == out.dtype == _val(put).dtype and same(x.shape, out.shape)):
            continue
        # The add's value: the layout the graph's users were traced with.
        node = _insert(graph, add, aten.index_put.default, (other, put.args[1], put.args[2], True), out)
        add.replace_all_uses_with(node)
        return True
    return False


_REWRITES = (_accumulate_into,)


def apply(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or a rewritten copy of it where a chain above is found."""
    nodes = gm.graph.nodes
    if not any(n.op == "call_function" and n.target is aten.index_put.default for n in nodes):
        return gm  # (copying a large graph to find nothing would cost more than the search)
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = copied.graph
    changed = [node.name for node in list(graph.nodes)
               if node.op == "call_function" and any(rewrite(graph, node) for rewrite in _REWRITES)]
    if not changed:
        return gm
    log.debug("boo: fused the chains ending in %s", ", ".join(changed))
    graph.eliminate_dead_code()
    graph.lint()
    copied.recompile()
    return copied
