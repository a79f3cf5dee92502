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
- **A slice written into a constant** (`_pad_instead_of_scatter`): `slice_scatter(full(c),
  src, dim, start, end)` with step 1 is `constant_pad_nd(src, ..., c)`: a slice's backward
  (a rotary embedding's halves, a split's pieces). With a step (x[..., 1::2]: an interleaved
  rotary embedding), `src` is first spread out by a where on a new dim of `step`. One pass
  instead of a fill and a copy, and a workaround: with dynamic sizes IREE 3.13 got GPT-J's
  backward (strided and whole-dim slice_scatters into zeros, 26 of them) wrong even with
  each fill its own splat (torch_import._fills_as_splats); the cause in IREE is not isolated.
  Any dtype, static or symbolic sizes.
"""

from __future__ import annotations

import copy
import logging
import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

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


# Ops that make a tensor of one value: (index of the value among the args, or None for 0;
# where the sizes come from: "sizes" (a list argument, args[0] or args[1] for new_*) or
# "like" (the shape of args[0])).
_FILLS = {
    aten.full.default: (1, "sizes"),
    aten.zeros.default: (None, "sizes"),
    aten.full_like.default: (1, "like"),
    aten.zeros_like.default: (None, "like"),
    aten.new_zeros.default: (None, "new"),
    aten.new_full.default: (2, "new"),
}


def _fill(node):
    """(value, sizes) of a node that makes a tensor of one number: sizes a list of ints or
    SymInt nodes, or None for a *_like node (its input's shape); None if `node` is no such node."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _FILLS:
        return None
    index, sizes = _FILLS[node.target]
    value = 0 if index is None else _arg(node, index, "fill_value")
    if not isinstance(value, (int, float)):  # bool is an int: a mask of one value
        return None
    listed = node.args[0] if sizes == "sizes" else node.args[1] if sizes == "new" else None
    return value, listed


def _is_zeros(node) -> bool:
    """A node that makes a tensor of zeros (_FILLS with the value 0)."""
    fill = _fill(node)
    return fill is not None and not isinstance(fill[0], bool) and fill[0] == 0


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


def _arith(graph: fx.Graph, anchor: fx.Node, op, a, b):
    """op(a, b) (operator.sub or mul) for ints or SymInt nodes: an int where both are (or the
    SymInt is a constant), else a node whose value is the SymInt. Arithmetic adds no guard."""
    if isinstance(b, int) and b == (0 if op is operator.sub else 1):
        return a
    value = op(_val(a), _val(b))
    if isinstance(value, torch.SymInt) and value.node.maybe_as_int() is not None:
        value = value.node.maybe_as_int()
    if isinstance(value, int):
        return value
    return _insert(graph, anchor, op, (a, b), value)


def _dim_size(graph: fx.Graph, anchor: fx.Node, tensor: fx.Node, dim: int):
    value = _val(tensor).shape[dim]
    return value if isinstance(value, int) else _insert(graph, anchor, aten.sym_size.int, (tensor, dim), value)


def _spread(graph: fx.Graph, node: fx.Node, src: fx.Node, dim: int, step: int, length, value):
    """`src` with step - 1 fills after each of its slices along `dim` but the last, and that
    length ((length - 1) * step + 1): `src` given a dim of `step` after `dim` (its slice, then
    fills: a `where` on a column mask), seen as one dim, less the fills after the last slice.
    (A pad of a new dim of 1 would be shorter; torch-mlir's lowering rejects it.)"""
    piece = _val(src)
    mode = detect_fake_mode([piece])
    if mode is None:
        return None
    sizes = [_dim_size(graph, node, src, i) for i in range(piece.dim())]
    wide = sizes[:dim + 1] + [step] + sizes[dim + 1:]
    sizes[dim] = _arith(graph, node, operator.mul, length, step)
    end = _arith(graph, node, operator.sub, sizes[dim], step - 1)
    trailing = [1] * (piece.dim() - 1 - dim)
    with mode:  # the values: shapes only, made without a guard
        column = aten.unsqueeze.default(piece, dim + 1)
        iota = aten.arange.default(step, device=piece.device)
        first = aten.eq.Scalar(iota, 0)
        mask = aten.view.default(first, [step, *trailing])
        spread = piece.new_empty([_val(n) for n in wide])
        flat = piece.new_empty([_val(n) for n in sizes])
        cut = flat.new_empty_strided([_val(n) if i != dim else _val(end) for i, n in enumerate(sizes)], flat.stride())
    column_node = _insert(graph, node, aten.unsqueeze.default, (src, dim + 1), column)
    iota_node = _insert(graph, node, aten.arange.default, (step,), iota, {"device": piece.device})
    mask_node = _insert(graph, node, aten.view.default,
                        (_insert(graph, node, aten.eq.Scalar, (iota_node, 0), first), [step, *trailing]), mask)
    spread_node = _insert(graph, node, aten.where.ScalarOther, (mask_node, column_node, value), spread)
    flat_node = _insert(graph, node, aten.view.default, (spread_node, sizes), flat)
    return _insert(graph, node, aten.slice.Tensor, (flat_node, dim, 0, end), cut), end


def _pad_instead_of_scatter(graph: fx.Graph, node: fx.Node) -> bool:
    if node.target is not aten.slice_scatter.default or len(node.args) < 2:
        return False
    base, src = node.args[0], node.args[1]
    dim, start, step = _arg(node, 2, "dim", 0), _arg(node, 3, "start", None), _arg(node, 5, "step", 1)
    fill, out, piece = _fill(base), _val(node), _val(src)
    if fill is None or not isinstance(dim, int) or not (isinstance(start, int) or start is None):
        return False
    if not (isinstance(out, torch.Tensor) and isinstance(piece, torch.Tensor) and out.dim() >= 1
            and out.dtype == piece.dtype and piece.dim() == out.dim() and isinstance(step, int) and step >= 1):
        return False
    dim %= out.dim()
    size, length = out.shape[dim], piece.shape[dim]
    if step > 1 and not statically_known_true(length >= 1):
        return False  # spread below needs a slice to end on
    start = start or 0
    if isinstance(size, int):
        start = min(max(start + size if start < 0 else start, 0), size)
    elif start < 0 and not isinstance(length, int):
        return False  # from a symbolic end, of a symbolic length: the bounds may clamp
    value, listed = fill
    if out.dtype == torch.bool:  # the value as the result's kind of number: a where would promote
        value = bool(value)
    elif not out.is_floating_point():
        if value != int(value):
            return False
        value = int(value)
    size_at = listed[dim] if listed is not None else _dim_size(graph, node, base.args[0], dim)
    if start < 0:  # from the end of a symbolic size, of a fixed length
        start = _arith(graph, node, operator.sub, size_at, -start)
    length = _dim_size(graph, node, src, dim)
    if step > 1:
        spread = _spread(graph, node, src, dim, step, length, value)
        if spread is None:
            return False
        src, length = spread
    right = _arith(graph, node, operator.sub, _arith(graph, node, operator.sub, size_at, start), length)
    if isinstance(right, int) and right < 0:
        return False
    pad = [0, 0] * (out.dim() - 1 - dim) + [start, right]
    result = _insert(graph, node, aten.constant_pad_nd.default, (src, pad, value), out)
    node.replace_all_uses_with(result)
    return True


_REWRITES = (_accumulate_into, _cross_entropy_backward, _pad_instead_of_scatter)


_ANCHORS = (aten.index_put.default, aten._log_softmax_backward_data.default, aten.slice_scatter.default)


def apply(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or a rewritten copy of it where a chain above is found."""
    nodes = gm.graph.nodes
    if not any(n.op == "call_function" and n.target in _ANCHORS for n in nodes):
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
