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
- **Cross-entropy's backward** (`_cross_entropy_backward`): nll_loss_backward decomposes to
  `G = scatter(zeros, d, target, c) * w`, one value per row (`w` broadcasts along `d`), and
  `_log_softmax_backward_data(G, out, d)` is `G - exp(out) * sum(G, d)`. The row sum is
  `c * w`, so the result is `c * w * (onehot(target) - exp(out))`: one elementwise pass
  that reads `out` and writes the gradient, where IREE wrote the zeros, the scatter and the
  product, then reduced them. GPT-2's [512, 50257] logits: 223 ms became 138 ms
  (iree-benchmark-module, AVX2). Static sizes, float32 and float64 only.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

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


def _insert(graph: fx.Graph, anchor: fx.Node, target, args: tuple, value, kwargs: dict | None = None) -> fx.Node:
    """A call of `target` before `anchor`, with `anchor`'s metadata (source location, module
    stack) and `value` as its result's value. The value is given, not computed: on symbolic
    sizes, computing it could add guards to the shape environment."""
    with graph.inserting_before(anchor):
        node = graph.call_function(target, args, kwargs or {})
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


def _one_value_per_row(grad, out: torch.Tensor, dim: int):
    """(index, c, w) when `grad` is `scatter(zeros, dim, index, c)` (one index per row),
    times `w` (None if absent) whose size along `dim` is 1, each read only by the next
    node; None otherwise. Then each row of `grad` holds one nonzero value, `c * w`."""
    scale = None
    if grad.target is aten.mul.Tensor and len(grad.args) == 2 and tuple(_val(grad).shape) == tuple(out.shape):
        for s, w in (grad.args, tuple(reversed(grad.args))):
            wv = _val(w)
            if (isinstance(s, fx.Node) and s.target is aten.scatter.value and _only_user(s, grad)
                    and isinstance(wv, torch.Tensor) and wv.dtype == out.dtype and wv.dim() == out.dim()
                    and wv.shape[dim] == 1):
                grad, scale = s, w
                break
        else:
            return None
    if grad.target is not aten.scatter.value or len(grad.args) != 4:
        return None
    zeros, d, index, c = grad.args
    iv = _val(index)
    rows = list(out.shape)
    rows[dim] = 1
    if not (_is_zeros(zeros) and _only_user(zeros, grad) and isinstance(c, (int, float)) and not isinstance(c, bool)
            and isinstance(d, int) and d % out.dim() == dim and isinstance(iv, torch.Tensor)
            and tuple(_val(zeros).shape) == tuple(out.shape) and list(iv.shape) == rows):
        return None
    return index, c, scale


def _cross_entropy_backward(graph: fx.Graph, node: fx.Node) -> bool:
    if node.target is not aten._log_softmax_backward_data.default or len(node.args) != 4:
        return False
    grad, out_node, dim, input_dtype = node.args
    out = _val(out_node)
    if not (isinstance(grad, fx.Node) and _only_user(grad, node) and isinstance(out, torch.Tensor)
            and out.dim() >= 1 and out.dtype in _EXACT and _val(grad).dtype == out.dtype == input_dtype
            and isinstance(dim, int) and all(isinstance(n, int) for n in out.shape)):
        return False  # symbolic sizes: the new nodes' values would be computed on them
    dim %= out.dim()
    found = _one_value_per_row(grad, out, dim)
    if found is None:
        return False
    index, c, scale = found
    mode = detect_fake_mode([out])
    if mode is None:
        return False

    def call(target, *args, **kwargs) -> fx.Node:
        values = fx.node.map_arg((args, kwargs), _val)
        with mode:
            value = target(*values[0], **values[1])
        return _insert(graph, node, target, args, value, kwargs)

    shape = [1] * out.dim()
    shape[dim] = out.shape[dim]
    iota = call(aten.view.default, call(aten.arange.default, out.shape[dim], dtype=_val(index).dtype,
                                        device=out.device), shape)
    minus = call(aten.neg.default, call(aten.exp.default, out_node))
    rows = call(aten.where.self, call(aten.eq.Tensor, iota, index), call(aten.add.Tensor, minus, 1), minus)
    per_row = c if scale is None else call(aten.mul.Tensor, scale, c)
    result = call(aten.mul.Tensor, rows, per_row)  # c * w * (onehot - exp(out))
    result.meta["val"] = _val(node)
    node.replace_all_uses_with(result)
    return True


_REWRITES = (_accumulate_into, _cross_entropy_backward)


def apply(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or a rewritten copy of it where a chain above is found."""
    nodes = gm.graph.nodes
    if not any(n.op == "call_function" and n.target in (aten.index_put.default, aten._log_softmax_backward_data.default)
               for n in nodes):
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
