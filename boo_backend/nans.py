"""NaN and sign bits where eager PyTorch gives them, for the ops whose torch-mlir lowerings
lose them. A leaf: imports nothing from boo_backend.

torch-mlir 20261001 lowers `maximum` and `minimum` to a compare and a select (`a > b ? a : b`),
so a NaN on the left gives the right operand; `clamp`, `clamp_min`, `clamp_max` and `hardtanh`
compare with `ult`/`ugt`, so a NaN input becomes the bound; `argmax`, `argmin` and the indices
of `max.dim` and `min.dim` pass over NaN, where eager picks the first NaN. Eager propagates
NaN through all of them, and a training step whose numbers went NaN must show it rather than
carry on with the bounds. `isfinite` is True for NaN, and so is `x == x` (which is what
`isfinite` of bfloat16 decomposes to), folded to True. NAN_REWRITES (merged into
rewrites.PRE_LOWERING) puts the NaN back: an isnan and a select, which IREE fuses into the
op's own loop. `sort` and `topk` put NaN among the numbers; with static sizes they order by a
key that puts it above +inf, as eager does (_sort, _topk).

`prims.signbit` (what `signbit` and `copysign` decompose to) says it returns floats but
returns bools, so as an island it handed the next part a tensor of the wrong type; it is read
here from the bits, as eager does (a NaN's sign too). PRIMS (merged into
decompositions.FALLBACK) gives it and the other prims that `copysign`'s decomposition brings
in their ATen forms, which torch-mlir lowers, where they would be islands.
"""

from __future__ import annotations

import threading

import torch

aten = torch.ops.aten
_NESTED = threading.local()


def _inner(op, *args, **kwargs):
    """`op` called from its own rewrite: make_fx applies the table to it again otherwise."""
    busy = getattr(_NESTED, "ops", None)
    if busy is None:
        busy = _NESTED.ops = set()
    busy.add(op)
    try:
        return op(*args, **kwargs)
    finally:
        busy.discard(op)


def _nested(op) -> bool:
    return op in getattr(_NESTED, "ops", ())


def _floats(*values) -> bool:
    """Whether any tensor among `values` is of a floating dtype: NaN can only come from one."""
    return any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in values)


def _any_nan(tensors):
    nan = None
    for t in tensors:
        one = aten.isnan.default(t)
        nan = one if nan is None else aten.logical_or.default(nan, one)
    return nan


def _propagating(op):
    """`op` whose result is NaN where any of its tensor arguments is (broadcast), as eager's:
    maximum, minimum and the clamps with tensor bounds. The sum of the arguments is NaN there
    and has the result's dtype and shape."""

    def rewrite(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if _nested(op) or not _floats(*tensors):
            return NotImplemented
        r = _inner(op, *args, **kwargs)
        total = tensors[0]
        for t in tensors[1:]:
            total = aten.add.Tensor(total, t)
        return aten.where.self(_any_nan(tensors), total.to(r.dtype), r)

    return rewrite


def _keeping_nan(op):
    """`op` of one tensor and scalar bounds (clamp, hardtanh) with NaN inputs left NaN."""

    def rewrite(x, *args, **kwargs):
        if _nested(op) or not _floats(x):
            return NotImplemented
        r = _inner(op, x, *args, **kwargs)
        return aten.where.self(aten.isnan.default(x), x.to(r.dtype), r)

    return rewrite


def _first_nan_wins(indices, x, dim, keepdim):
    """`indices` of an arg-reduction of `x` over `dim` (None: all of it), with the index of
    the first NaN wherever the reduced slice holds one, as eager's argmax and argmin."""
    if dim is None:
        x, dim = aten.reshape.default(x, [-1]), 0
    nan = aten.isnan.default(x)
    first = _inner(aten.argmax.default, aten._to_copy.default(nan, dtype=torch.float32), dim, keepdim)
    has = aten.any.dim(nan, dim, keepdim)
    return aten.where.self(aten.reshape.default(has, list(indices.shape)),
                           aten.reshape.default(first, list(indices.shape)), indices)


def _arg(op):
    def rewrite(x, dim=None, keepdim=False):
        if _nested(op) or not _floats(x):
            return NotImplemented
        return _first_nan_wins(_inner(op, x, dim, keepdim), x, dim, keepdim)

    return rewrite


def _with_indices(op):
    """max.dim / min.dim: the values are NaN already; the indices are the first NaN's."""

    def rewrite(x, dim, keepdim=False):
        if _nested(op) or not _floats(x):
            return NotImplemented
        values, indices = _inner(op, x, dim, keepdim)
        return values, _first_nan_wins(indices, x, dim, keepdim)

    return rewrite


def _isfinite(x):
    return aten.logical_not.default(aten.logical_or.default(aten.isnan.default(x), aten.isinf.default(x)))


def _self_equal(a, b):
    if a is not b or not _floats(a):
        return NotImplemented
    return aten.logical_not.default(aten.isnan.default(a))


_SAME_WIDTH = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
               torch.bfloat16: torch.int16}


def _signbit(x):
    if x.dtype not in _SAME_WIDTH:
        return NotImplemented
    if x.dim() == 0:  # IREE 3.13 crashes on a bitcast of a 0-d tensor
        return aten.squeeze.dim(_signbit(aten.unsqueeze.default(x, 0)), 0)
    return aten.lt.Scalar(aten.view.dtype(x, _SAME_WIDTH[x.dtype]), 0)


def _ordered_key(x):
    """An integer per element of `x` (a float) that orders as eager's sort orders it: NaN above
    +inf, -0.0 equal to 0.0. A float's bits read as a signed integer order the non-negative
    ones; a negative one's bits b (the smallest integer plus its magnitude) become
    smallest - b - 1, which orders the negative ones below them, larger magnitudes lower."""
    x = aten.where.self(aten.isnan.default(x), aten.abs.default(x), x)  # NaN with its sign cleared
    bits = aten.view.dtype(x, _SAME_WIDTH[x.dtype])
    smallest = torch.iinfo(bits.dtype).min
    flipped = aten.add.Scalar(aten.add.Scalar(aten.neg.default(bits), smallest), -1)
    # -0.0 (the bits `smallest`) sorts with 0.0; read from the bits, as IREE's CPU code
    # compares subnormals as zeros.
    flipped = aten.where.self(aten.eq.Scalar(bits, smallest), aten.mul.Scalar(bits, 0), flipped)
    return aten.where.self(aten.lt.Scalar(bits, 0), flipped, bits)


def _symbolic(x) -> bool:
    return any(isinstance(d, torch.SymInt) for d in x.shape)


def _sort(x, dim=-1, descending=False):
    """sort with NaN where eager puts it (the largest: last when ascending): the order comes
    from _ordered_key, the values from `x` at that order. Not where sizes are symbolic:
    IREE 3.13 does not compile a sort whose keys another op computes when sizes are dynamic
    ('memref.alloca' op stack allocation size overflows 64 bits)."""
    if x.dtype not in _SAME_WIDTH or _symbolic(x):
        return NotImplemented
    _, indices = aten.sort.default(_ordered_key(x), dim, descending)
    return aten.gather.default(x, dim, indices), indices


def _topk(x, k, dim=-1, largest=True, sorted=True):
    """topk with NaN as eager's largest: of a float key, NaN made +inf and +inf the largest
    finite value (IREE's topk takes no integers, and a sort of all of a vocabulary to keep
    k would cost far more); the values from `x` at its order. Exact but for ties of the
    largest finite value with an infinity, and for subnormals, which IREE compares as zeros."""
    if x.dtype not in _SAME_WIDTH or _symbolic(x) or _nested(aten.topk.default):
        return NotImplemented
    key = aten.where.self(aten.isnan.default(x), aten.full_like.default(x, float("inf")),
                          _inner(aten.clamp_max.default, x, torch.finfo(x.dtype).max))
    _, indices = _inner(aten.topk.default, key, k, dim, largest, sorted)
    return aten.gather.default(x, dim, indices), indices


def _floating(*args, **kwargs) -> bool:
    return _floats(*args, *kwargs.values())


_BY_KIND = (
    (_propagating, (aten.maximum.default, aten.minimum.default, aten.clamp_min.Tensor, aten.clamp_max.Tensor,
                    aten.clamp.Tensor)),
    (_keeping_nan, (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default)),
    (_arg, (aten.argmax.default, aten.argmin.default)),
    (_with_indices, (aten.max.dim, aten.min.dim)),
)
NAN_REWRITES = {
    **{op: (_floating, kind(op)) for kind, ops in _BY_KIND for op in ops},
    aten.isfinite.default: (_floating, _isfinite),
    aten.eq.Tensor: (lambda a, b: a is b and _floats(a), _self_equal),
    aten.signbit.default: (lambda x: x.dtype in _SAME_WIDTH, _signbit),
    torch.ops.prims.signbit.default: (lambda x: x.dtype in _SAME_WIDTH, _signbit),
    aten.sort.default: (lambda x, *a, **k: x.dtype in _SAME_WIDTH and not _symbolic(x), _sort),
    aten.topk.default: (lambda x, *a, **k: x.dtype in _SAME_WIDTH and not _symbolic(x), _topk),
}

prims = torch.ops.prims
PRIMS = {
    prims.signbit.default: _signbit,
    prims.abs.default: aten.abs.default,
    prims.neg.default: aten.neg.default,
    prims.where.default: aten.where.self,
}
