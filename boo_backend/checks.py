"""Checks that eager makes on the host and IREE cannot: an index out of range, an integer
division by zero. Each becomes one more result of the module, a 0-d bool, and the part
raises as eager would when it comes back true (`raise_if_failed`).

Imports nothing else from boo_backend.

Indices. `x[i]`, `index_select`, `gather`, `embedding`, `scatter` and their kin check every
index in eager (IndexError or RuntimeError); IREE's gather and scatter kernels take the
index as it is, so a token id past the vocabulary read another tensor's memory, or zeros,
and `x.index_select(0, ids)` with one id too large summed to 13951 where every value was
below 4. `checked` flags an index out of range from each index tensor's min and max (two
small reductions) and clamps each index into range, so that the op itself stays inside its
tensors (a scatter past the end aborted the process).

Asserts. A rewrite that must refuse what eager refuses (arith.py: an integer divided by
zero, which gave the dividend) calls `aten._assert_async.msg(ok, kind)`, `kind` a key of
RAISES; `checked` turns each into a flag of `not ok`.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten

# Ops that take one index tensor: the position of the indexed tensor, of the index, and of
# the dim (None: dim 0), and whether an index may count from the end ([-n, n); else [0, n)).
ONE_INDEX = {
    aten.index_select.default: (0, 2, 1, False),
    aten.gather.default: (0, 2, 1, False),
    aten.embedding.default: (0, 1, None, False),
    aten.scatter.src: (0, 2, 1, False),
    aten.scatter.value: (0, 2, 1, False),
    aten.scatter.reduce: (0, 2, 1, False),
    aten.scatter.value_reduce: (0, 2, 1, False),
    aten.scatter_add.default: (0, 2, 1, False),
    aten.scatter_reduce.two: (0, 2, 1, False),
    aten.index_add.default: (0, 2, 1, False),
    aten.index_copy.default: (0, 2, 1, False),
    aten.index_fill.int_Scalar: (0, 2, 1, True),
    aten.index_fill.int_Tensor: (0, 2, 1, True),
}
# Ops that take a list of index tensors (None for a dim taken whole), one per dim from dim 0,
# a bool mask taking as many dims as it has; whether an index may count from the end. An
# index_put's indices have been wrapped by then (rewrites._index_put_wrapped: i + n where
# i < 0), so they must lie in [0, n); index_add, index_copy and index_fill come here as
# index_put too.
INDEX_LISTS = {aten.index.Tensor: True, aten.index_put.default: False}


def _value(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _indices(node: fx.Node):
    """(indexed tensor node, dim, where the index is, negatives allowed) for each index of
    `node`; where: (argument position, position in its list or None)."""
    target = node.target
    if target in INDEX_LISTS:
        dim = 0
        for k, index in enumerate(node.args[1]):
            val = _value(index)
            if val is None:
                dim += 1
            elif val.dtype in (torch.bool, torch.uint8):
                dim += val.dim()
            else:
                yield node.args[0], dim, (1, k), INDEX_LISTS[target]
                dim += 1
        return
    spec = ONE_INDEX.get(target)
    if spec is not None and len(node.args) > spec[1]:
        source, index, dim, negatives = spec
        yield node.args[source], node.args[dim] if dim is not None else 0, (index, None), negatives


def _add(graph: fx.Graph, op, *args, **kwargs) -> fx.Node:
    """A node of `op` on `args`, with its value computed on theirs (fake tensors: no data)."""
    node = graph.call_function(op, args, kwargs)
    vals = [_value(a) for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = op(*vals, **kwargs)
    return node


def _guarded(graph: fx.Graph, source: fx.Node, dim: int, index: fx.Node, negatives: bool):
    """(flag, index clamped into range), nodes added before the op that takes `index`; None
    for an index that needs no check."""
    val, indexed = _value(index), _value(source)
    if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype == torch.bool:
        return None
    if isinstance(val.numel(), int) and val.numel() == 0:
        return None  # nothing to check; and ATen's min and max refuse an empty tensor
    dim = dim % max(indexed.dim(), 1)
    n = indexed.shape[dim] if indexed.dim() else 1
    if isinstance(n, int) and n == 0:
        return None
    if not isinstance(n, int):
        n = _add(graph, aten.sym_size.int, source, dim)
    too_high = _add(graph, aten.ge.Scalar, _add(graph, aten.max.default, index), n)
    low = _add(graph, aten.min.default, index)
    # ~i == -1 - i, so ~i >= n is i < -n: an index from the end that is out of range.
    too_low = (_add(graph, aten.ge.Scalar, _add(graph, aten.bitwise_not.default, low), n) if negatives
               else _add(graph, aten.lt.Scalar, low, 0))
    flag = _add(graph, aten.logical_or.default, too_high, too_low)
    # The op then reads and writes inside the tensor whatever the index holds: the call
    # raises anyway when the flag is set, and must not crash or corrupt memory first.
    lowest = (-n if isinstance(n, int) else _add(graph, operator.neg, n)) if negatives else 0
    highest = n - 1 if isinstance(n, int) else _add(graph, operator.sub, n, 1)
    clamped = _add(graph, aten.clamp.default, index, lowest, highest)
    if negatives:  # and counted from the start: torch-mlir's scatter takes -1 as an offset
        clamped = _add(graph, aten.where.self, _add(graph, aten.lt.Scalar, clamped, 0),
                       _add(graph, aten.add.Scalar, clamped, n), clamped)
    if val.dtype != torch.int64:  # torch-mlir lowers index.Tensor with int64 indices only
        clamped = _add(graph, aten._to_copy.default, clamped, dtype=torch.int64)
    return flag, clamped


# What a failed check raises, as eager does: the exception and what it says.
RAISES = {
    "index": (IndexError, "index out of range (an index tensor holds a value past the size of the dim it indexes)"),
    "ZeroDivisionError": (RuntimeError, "ZeroDivisionError: an integer divided by zero"),
}


def checked(graph: fx.Graph) -> list[tuple[fx.Node, str]]:
    """Guards every index that `graph` takes and turns its asserts into flags (before its
    output node is made): (0-d bool node, true where the check failed; its key in RAISES),
    one per kind of check the graph makes."""
    flags: dict[str, list[fx.Node]] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_async.msg:
            with graph.inserting_before(node):
                flags.setdefault(node.args[1], []).append(_add(graph, aten.logical_not.default, node.args[0]))
            graph.erase_node(node)
            continue
        for source, dim, (position, k), negatives in list(_indices(node)):
            index = node.args[position] if k is None else node.args[position][k]
            with graph.inserting_before(node):
                guarded = _guarded(graph, source, dim, index, negatives)
            if guarded is None:
                continue
            flags.setdefault("index", []).append(guarded[0])
            if k is None:
                node.update_arg(position, guarded[1])
            else:
                node.update_arg(position, [guarded[1] if j == k else i for j, i in enumerate(node.args[position])])
    out = []
    for kind, nodes in flags.items():
        failed = nodes[0]
        for flag in nodes[1:]:
            failed = _add(graph, aten.logical_or.default, failed, flag)
        out.append((failed, kind))
    return out


def raise_if_failed(flags: list[torch.Tensor], kinds: tuple[str, ...], graph: str) -> None:
    """Raise as eager would where a check's flag (a 0-d bool result) is true."""
    for flag, kind in zip(flags, kinds):
        if flag.item():
            error, what = RAISES.get(kind, (RuntimeError, kind))
            raise error(f"boo: graph {graph}: {what}, as eager PyTorch reports")
