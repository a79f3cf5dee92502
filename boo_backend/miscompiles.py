"""What IREE 3.13 (through torch-mlir) computes wrongly, and where boo runs it instead:
ops wrong for some dtypes (eager islands: wrong_in_iree), ops wrong with symbolic sizes (the
graph compiles per shape: wrong_when_dynamic), sorts that must not share a module (ATen
kernels: sorts_apart), and cats whose pieces come out of order (reordered: pieces_in_order).
tests/test_iree_workarounds.py holds the repros.

A leaf: imports nothing from boo_backend.
"""

from __future__ import annotations

import heapq

import torch
import torch.fx as fx

aten = torch.ops.aten

_UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)
# Ops whose lowering is right for unsigned integers too. IREE's integers are signless, and
# torch-mlir lowers division, remainder, reductions and widening casts of unsigned values
# as if they were signed (200 // 3 on uint8 gives 0), so any other op on them stays in eager.
_UNSIGNED_SAFE = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor,
    aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar, aten.bitwise_not.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.maximum.default, aten.minimum.default, aten.where.self, aten.clone.default,
    aten.cat.default, aten.copy.default, aten.alias.default, aten.lift_fresh_copy.default,
    aten.bitwise_right_shift.Tensor, aten.bitwise_left_shift.Tensor,
    aten.__rshift__.Scalar, aten.__lshift__.Scalar, aten.logical_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default,
    aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.constant_pad_nd.default,
})


# Ops whose lowering treats bool (i1) as a signed integer, True as -1: sort puts True first,
# clamp and scatter_add/amax with bools give False.
_BOOL_WRONG = frozenset({
    aten.sort.default, aten.sort.stable, aten.topk.default, aten.kthvalue.default,
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_min.Tensor,
    aten.clamp_max.default, aten.clamp_max.Tensor, aten.scatter_add.default,
    aten.scatter_reduce.two, aten.index_add.default,
})
# Ops whose lowering is wrong for every dtype: logcumsumexp adds exp(x) without taking out the
# running maximum, so it overflows to inf where eager does not.
_ALWAYS_WRONG = frozenset({aten.logcumsumexp.default})


# torch-mlir's embedding_bag in "sum" mode (mode 0) drops per_sample_weights and
# padding_idx: it gave the unweighted sum, padding rows included (with symbolic sizes; with
# static ones the compiler refuses it).
_EMBEDDING_BAGS = frozenset({aten._embedding_bag.default, aten._embedding_bag_forward_only.default})


def _weighted_sum(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1) -> bool:
    return mode == 0 and (per_sample_weights is not None or padding_idx not in (None, -1))


# Ops that torch-mlir lowers to an in-place sort of the values and of an iota of indices.
_SORTS = frozenset({aten.sort.default, aten.sort.stable, aten.topk.default})


def sorts_apart(gm: fx.GraphModule) -> set[fx.Node]:
    """The sorts of a graph to run as ATen kernels: all but the first. IREE 3.13 makes one
    iota of indices for two sorts of the same shape and sorts it in place twice, so the
    indices of both came out permuted by the other's order (the experts that a
    mixture-of-experts model's second layer chose, say). One per module is right
    (tests/test_iree_workarounds.py)."""
    sorts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SORTS]
    return set(sorts[1:])


# Pooling whose output size rounds up (ceil_mode): torch-mlir's lowering with symbolic sizes
# read past the input (avg_pool2d of 2x37x64 was 1.6x off, of 3x101x64 by 1e34: Funnel's
# pooling; max_pool2d gave inf). Such a graph compiles per shape, which lowers it right.
# Average pooling rarely gets here: rewrites.PRE_LOWERING takes its ceil_mode out.
_CEIL_POOLS = frozenset({
    aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
    aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
    aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default,
})


def wrong_when_dynamic(node: fx.Node) -> bool:
    """Whether IREE would compute `node` wrongly when its sizes are symbolic (_CEIL_POOLS)."""
    if node.op != "call_function" or node.target not in _CEIL_POOLS:
        return False
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    if "ceil_mode" not in names:
        return False
    i = names.index("ceil_mode")
    ceil = node.args[i] if len(node.args) > i else node.kwargs.get("ceil_mode", schema.arguments[i].default_value)
    return bool(ceil)


def _unsigned_alone(args, kwargs, out, unsigned: set) -> bool:
    """Whether an _UNSIGNED_SAFE op meets no Python number and gives its unsigned dtype (or
    bool): torch-mlir turns a scalar into the tensor's signless type and promotes to float
    as if it were signed, so `img * 0.5` gave -28 for 200 and `img < 200` was False there."""
    if any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args[1:]):
        return False
    if any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in kwargs.values()):
        return False
    outs = out if isinstance(out, (tuple, list)) else [out]
    return all(not isinstance(o, torch.Tensor) or o.dtype in unsigned or o.dtype == torch.bool for o in outs)


def wrong_in_iree(node: fx.Node) -> bool:
    """Whether IREE would compute `node` wrongly for its dtypes, so that it must run in eager:
    unsigned integers outside _UNSIGNED_SAFE, bools in _BOOL_WRONG, ops in _ALWAYS_WRONG,
    weighted or padded embedding_bag sums, and boolean-mask index_put that
    rewrites.PRE_LOWERING could not rewrite."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    op = node.target
    if op in _ALWAYS_WRONG or (op in _EMBEDDING_BAGS and _weighted_sum(*node.args, **node.kwargs)):
        return True
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    dtypes = {v.dtype for v in vals if isinstance(v, torch.Tensor)}
    if op in (aten.index_put.default, aten._index_put_impl_.default) and any(
        isinstance(i, fx.Node) and getattr(i.meta.get("val"), "dtype", None) == torch.bool for i in node.args[1]
    ):
        return True
    if torch.bool in dtypes and op in _BOOL_WRONG:
        return True
    accumulate = len(node.args) > 3 and node.args[3]
    if op in (aten.index_put.default, aten._index_put_impl_.default) and accumulate and torch.bool in dtypes:
        return True  # True + True overflows i1 to False; eager's bool sum is a logical or
    return _unsigned_wrong(op, dtypes, node.args, node.kwargs, node.meta.get("val"))


def _unsigned_wrong(op, dtypes: set, args, kwargs, out) -> bool:
    """Whether a call of `op` on tensors of `dtypes` giving `out` meets an unsigned integer
    where IREE computes it as a signed one."""
    unsigned = dtypes & set(_UNSIGNED)
    if not unsigned or op.is_view:
        return False
    if op in _UNSIGNED_SAFE:
        return not _unsigned_alone(args, kwargs, out, unsigned)
    if op is aten._to_copy.default:  # unsigned to float or bool is right; to int is not
        return not (isinstance(out, torch.Tensor) and (out.dtype.is_floating_point or out.dtype in {torch.bool, *unsigned}))
    return True


# An unsigned integer computed in a signed type that holds all its values, where IREE would
# compute it wrongly (_unsigned_wrong): read through a float, which the unsigned-to-float cast
# (right in IREE) holds exactly, and cast back to the unsigned type where eager's result has
# it (wrapping as eager wraps). uint8 only: eager implements few ops for the wider unsigned
# types (`a + 3` on uint32 raises), and an island raises as eager does.
_WIDER = {torch.uint8: (torch.float32, torch.int32)}


def widens(node: fx.Node) -> bool:
    """Whether `node` would be an island for its unsigned integers alone, and widened()
    computes it in IREE."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or not wrong_in_iree(node):
        return False
    dtypes = {v.dtype for a in node.all_input_nodes if isinstance(v := a.meta.get("val"), torch.Tensor)}
    unsigned = dtypes & set(_UNSIGNED)
    return bool(unsigned) and unsigned <= _WIDER.keys() and _unsigned_wrong(
        node.target, dtypes, node.args, node.kwargs, node.meta.get("val"))


def _tensors(values) -> list:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += _tensors(v)
    return found


def _wide(v):
    if isinstance(v, torch.Tensor) and v.dtype in _WIDER:
        through, wide = _WIDER[v.dtype]
        return aten._to_copy.default(aten._to_copy.default(v, dtype=through), dtype=wide)
    if isinstance(v, (list, tuple)):
        return type(v)(_wide(x) for x in v)
    return v


def widened(op):
    """A PRE_LOWERING-style rewrite of `op` for the calls _unsigned_wrong names: the unsigned
    tensors widened (_WIDER), `op` on them, and each result cast to eager's dtype for it
    (found without tracing), so `img + 3` wraps at 256 and `img.max()` stays uint8."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    def rewrite(*args, **kwargs):
        tensors = _tensors([*args, *kwargs.values()])
        dtypes = {t.dtype for t in tensors}
        if not (dtypes & set(_UNSIGNED)) or not (dtypes & set(_UNSIGNED)) <= _WIDER.keys():
            return NotImplemented
        with disable_proxy_modes_tracing():
            expected = op(*args, **kwargs)
        if not _unsigned_wrong(op, dtypes, args, kwargs, expected):
            return NotImplemented
        out = op(*_wide(args), **{k: _wide(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return out if out.dtype == expected.dtype else aten._to_copy.default(out, dtype=expected.dtype)
        return type(out)(o if not isinstance(o, torch.Tensor) or o.dtype == e.dtype
                         else aten._to_copy.default(o, dtype=e.dtype) for o, e in zip(out, expected))

    return rewrite


# Ops whose result IREE assembles in one buffer from their tensor arguments, each written
# in place into what the ones before it wrote: a cat's pieces, a scatter's base then source.
_ASSEMBLED = frozenset({
    torch.ops.aten.cat.default, torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
    torch.ops.aten.diagonal_scatter.default, torch.ops.aten.as_strided_scatter.default,
})


def _closure(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it depends on."""
    seen, todo = {node}, [node]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return seen


def pieces_in_order(graph: fx.Graph) -> None:
    """Reorder `graph` so that what each piece of a cat (or a scatter's source) needs beyond
    the pieces before it is computed after them; the rest keeps its order.

    IREE 3.13 miscompiles such a graph in the other order. To write a piece's dispatch in
    place into the cat's buffer, its stream pass EmplaceAllocations moves the earlier pieces'
    producers up, above that dispatch, and does not check what it moves past: it moved a
    slice_scatter that updates a tensor in place above a matmul that still had to read that
    tensor (ormqr's backward, whose cat takes its pieces in the reverse of the order it
    computes them: gradients up to 100x off; the FX graph in eager and every intermediate,
    returned, were right). In this order nothing needs to move."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    after: dict[fx.Node, set[fx.Node]] = {}  # node -> nodes that must come after it
    moves = False
    for node in nodes:
        if node.op != "call_function" or node.target not in _ASSEMBLED:
            continue
        flat = node.args[0] if node.target is torch.ops.aten.cat.default else node.args[:2]
        pieces = [p for p in flat if isinstance(p, fx.Node)]
        earlier: set[fx.Node] = set()
        for prev, piece in zip(pieces, pieces[1:]):
            earlier |= _closure(prev)
            later = {n for n in _closure(piece) - earlier if n.op != "placeholder"}
            if later:
                after.setdefault(prev, set()).update(later)
                moves = moves or any(index[n] < index[prev] for n in later)
    if not moves:  # the graph's own order already has every piece's work after the one before
        return
    # Kahn's algorithm, the ready node first in the graph's order; a cycle among the added
    # constraints (two cats asking for opposite orders) drops them for the node it stalls on.
    waits = {n: set(n.all_input_nodes) for n in nodes}
    for first, later in after.items():
        for n in later:
            waits[n].add(first)
    users = {n: set() for n in nodes}
    for n, deps in waits.items():
        for d in deps:
            users[d].add(n)
    ready = [(index[n], n) for n in nodes if not waits[n]]  # indexes are unique: nodes never compared
    heapq.heapify(ready)
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()
    while len(order) < len(nodes):
        if not ready:  # stalled: the first node whose data is all there goes next
            n = min((n for n in nodes if n not in placed and set(n.all_input_nodes) <= placed), key=index.get)
            waits[n] = set()
            heapq.heappush(ready, (index[n], n))
        _, n = heapq.heappop(ready)
        if n in placed:
            continue
        placed.add(n)
        order.append(n)
        for u in users[n]:
            waits[u].discard(n)
            if not waits[u] and u not in placed:
                heapq.heappush(ready, (index[u], u))
    out = next(n for n in nodes if n.op == "output")
    for n in order:
        if n is not out:
            out.prepend(n)
