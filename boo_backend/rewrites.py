"""Pre-lowering rewrites: ATen calls that IREE 3.13 or torch-mlir get wrong, compile forever,
or crash on, rewritten into ATen calls they get right. Imports only arith (integer and
float division, remainders, shifts), convolutions (convolutions IREE fails to compile), f64 (float64 math), halves (f16/bf16 accumulated in
f32), nans (NaN that torch-mlir's lowerings drop), refusals (calls eager refuses), pooling
and symbolic, all leaves.

Each entry of PRE_LOWERING returns NotImplemented for the calls it leaves alone, because
make_fx applies the whole table once `needs_pre_lowering` says that some call needs it.
"""

from __future__ import annotations

import functools
import math

import sympy
import torch

from .arith import ARITH_REWRITES, INT8_REWRITES, _first_of
from .convolutions import CONV_REWRITES
from .halves import HALF_REWRITES, _accumulate_in_f32, _is_half
from .f64 import F64_REWRITES, IN_F64, _negative
from .nans import NAN_REWRITES, _inner, _nested
from .pooling import batched, ceil_mode_avg_pool, unbatched
from .refusals import REFUSAL_REWRITES
from .symbolic import expr, is_row_major, is_static

aten = torch.ops.aten


def _two_stage_reduction(op):
    """`op` over all dims of a rank>=2 tensor, as rows first, then the row results.

    IREE 3.13's CPU codegen fails ('vector.contract' op invalid accumulator/result vector
    shape) when a broadcasting elementwise op feeds a reduction to a 0-d result. Reducing the
    rows first also spreads the work over threads, where one 0-d reduction runs on one.
    Rows have equal length, so this holds for mean as well as for sum."""

    def rewrite(x, dims=None, keepdim=False, *, dtype=None):
        rank = x.dim()
        if rank < 2 or (dims and len({d % rank for d in dims}) != rank):
            return NotImplemented
        # The row count written out: with -1, rows of length 0 make the reshape ambiguous.
        rows = aten.reshape.default(x, [math.prod(x.shape[:-1]), x.shape[-1]])
        out = op(op(rows, [1], dtype=dtype), [0], dtype=dtype)
        return aten.reshape.default(out, [1] * rank) if keepdim else out

    return rewrite


def _over_a_vector(op, tensors: int):
    """`op` (softmax family: `tensors` tensor arguments, then dim) on 0-d tensors, computed on
    one-element vectors. IREE 3.13 never finishes compiling a softmax over a 0-d tensor."""

    def rewrite(*args):
        if args[0].dim() != 0:
            return NotImplemented
        vectors = [aten.reshape.default(t, [1]) for t in args[:tensors]]
        return aten.reshape.default(op(*vectors, 0, *args[tensors + 1:]), [])

    return rewrite


def _atan2(y, x):
    """atan2 from its y >= 0 half: IREE 3.13's f32 approximation gets signs wrong (atan2(-1,
    -inf) gives +pi) and returns NaN for atan2(±0, ±0) and atan2(±inf, ±inf)."""
    if _nested(aten.atan2.default):
        return NotImplemented
    dtype = torch.result_type(y, x)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    if dtype == torch.float64:  # libm's atan2 (see compile.Target.f64_flags) is right
        return NotImplemented
    y, x = y.to(dtype), x.to(dtype)
    r = _inner(aten.atan2.default, aten.abs.default(y), x)
    x_neg = _negative(x)
    zero = aten.logical_and.default(aten.eq.Scalar(y, 0), aten.eq.Scalar(x, 0))
    both_inf = aten.logical_and.default(aten.isinf.default(y), aten.isinf.default(x))
    pi = math.pi
    special = aten.where.self(zero, aten.mul.Tensor(x_neg, pi), aten.add.Tensor(aten.mul.Tensor(x_neg, pi / 2), pi / 4))
    r = aten.where.self(aten.logical_or.default(zero, both_inf), special.to(dtype), r)
    r = aten.where.self(_negative(y), aten.neg.default(r), r)
    nan = aten.logical_or.default(aten.isnan.default(y), aten.isnan.default(x))
    return aten.where.self(nan, aten.add.Tensor(y, x), r)


def _square_as_pow(a, b, *args, **kwargs):
    """`x * x` as `x ** 2`, the same value in every dtype (tests/test_iree_workarounds.py).
    A reduction fed by a value times itself ((x * x).sum(-1)) becomes, in IREE 3.13's CPU
    code, a vector contraction of one operand with itself, lowered to scalar code: 0.19 ms
    for 512 x 512 floats, where the power's lowering took 0.012 ms (bench/RESULTS.md,
    thirty-seventh session)."""
    if not _squares(a, b):
        return NotImplemented
    return aten.pow.Tensor_Scalar(a, 2)


def _not_f64(x, *args, **kwargs) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.dtype != torch.float64


def _squares(a, b=None, *args, **kwargs) -> bool:
    """A float tensor times itself (one value as both operands); not float64, whose powers
    f64._pow_ieee computes as products."""
    return a is b and _not_f64(a)


def _log10(x):
    """log10 as log(x) / log(10) in float32 (half types rounded once at the end): IREE's CPU
    target links no log10f, so every float32 log10 ran as an eager island. float64's is
    libm's (compile.Target.f64_flags)."""
    if not _not_f64(x):
        return NotImplemented
    r = aten.div.Scalar(aten.log.default(aten._to_copy.default(x, dtype=torch.float32)), math.log(10.0))
    return r if x.dtype == torch.float32 else aten._to_copy.default(r, dtype=x.dtype)


# float8 conversions. IREE 3.13's own are right but for two bands: a value just below the
# smallest normal float8 (0.0147 to float8_e4m3fn, whose smallest normal is 2^-6) becomes 0
# where it rounds up to that normal, float8_e4m3fn's negative NaN (0xFF) reads as -480, and
# a value past float8_e4m3fn's max becomes NaN where eager saturates it to +-448.
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                if hasattr(torch, n))


_MANTISSA_BITS = {d: 3 if "e4m3" in str(d) else 2 for d in _FLOAT8}


def _is_float8_cast(x, *args, dtype=None, **kwargs) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype != dtype and (dtype in _FLOAT8 or x.dtype in _FLOAT8)


def _float8_cast(x, *args, dtype=None, **kwargs):
    if _nested(aten._to_copy.default) or not _is_float8_cast(x, dtype=dtype):
        return NotImplemented
    if dtype in _FLOAT8 and x.dtype.is_floating_point:
        x = aten._to_copy.default(x, dtype=torch.float32)  # exact, or as eager rounds float64 (via float)
        info = torch.finfo(dtype)
        step = info.smallest_normal / 2 ** _MANTISSA_BITS[dtype]  # the subnormal step
        band = aten.logical_and.default(aten.ge.Scalar(aten.abs.default(x), info.smallest_normal - step / 2),
                                        aten.lt.Scalar(aten.abs.default(x), info.smallest_normal))
        x = aten.where.self(band, aten.mul.Scalar(aten.sign.default(x), info.smallest_normal), x)
        if dtype == getattr(torch, "float8_e4m3fn", None):  # eager saturates it, infinities too
            x = aten.where.self(aten.gt.Scalar(aten.abs.default(x), info.max),
                                aten.mul.Scalar(aten.sign.default(x), info.max), x)
    widen = x.dtype in _FLOAT8 and dtype is not None and dtype.is_floating_point
    finite_only = x.dtype != getattr(torch, "float8_e5m2", None)  # no infinities: past max is NaN
    # float8 to a float goes through float32 (exact), which IREE converts from every float8
    out = _inner(aten._to_copy.default, x, *args, dtype=torch.float32 if widen else dtype, **kwargs)
    if widen and finite_only:
        out = aten.where.self(aten.gt.Scalar(aten.abs.default(out), torch.finfo(x.dtype).max),
                              aten.full_like.default(out, math.nan), out)
    if widen and dtype != torch.float32:
        out = aten._to_copy.default(out, dtype=dtype)
    return out


def _index_put_mask(x, indices, values, accumulate=False):
    """`x[mask] = values` (or `+=`) with one boolean mask over x's leading dims, as a `where`:
    torch-mlir's lowering goes through nonzero(), whose size depends on the data, and IREE
    crashes on an all-False mask. Values that have a row per True element (a size known only
    at run time) are left alone."""
    if len(indices) != 1 or indices[0] is None or indices[0].dtype != torch.bool:
        return NotImplemented
    mask = indices[0]
    rest = x.dim() - mask.dim()
    if values.dim() > rest or tuple(mask.shape) != tuple(x.shape[: mask.dim()]):
        return NotImplemented
    mask = aten.reshape.default(mask, [*mask.shape] + [1] * rest)
    values = aten.expand.default(values.to(x.dtype), list(x.shape))
    if accumulate:
        return aten.add.Tensor(x, aten.where.self(mask, values, aten.zeros_like.default(values)))
    return aten.where.self(mask, values, x)


def _wrapped(i, size):
    """An integer index tensor made non-negative (i + size where i < 0), as eager reads it."""
    return aten.where.self(aten.lt.Scalar(i, 0), aten.add.Scalar(i, size), i)


def _index_put_wrapped(x, indices, values, accumulate=False):
    """index_put with its integer indices made non-negative (i + size where i < 0), as eager
    reads them: torch-mlir lowers index_put to a scatter that takes the indices as offsets,
    so a negative one (`x[:, [-1]] = v`, or the backward of `x[:, [-1]]`) writes out of
    bounds and the compiled module corrupts memory or crashes."""
    if _nested(aten.index_put.default) or any(i is not None and i.dtype == torch.bool for i in indices):
        return NotImplemented
    wrapped = [None if i is None else _wrapped(i, x.shape[d]) for d, i in enumerate(indices)]
    if len(wrapped) == 1 and wrapped[0].dim() > 1 and not all(isinstance(s, int) for s in wrapped[0].shape):
        # One index tensor of several symbolic dims (an embedding's backward with dynamic
        # shapes): torch-mlir's scatter lowering takes all but the first of its dims as 1, so
        # the module rejects every real size. One flat dim of indices lowers right.
        rest = list(x.shape[1:])
        count = math.prod(wrapped[0].shape)  # not -1: with an empty row, -1 is ambiguous
        values = aten.reshape.default(aten.expand.default(values, list(wrapped[0].shape) + rest), [count] + rest)
        wrapped = [aten.reshape.default(wrapped[0], [count])]
    return _inner(aten.index_put.default, x, wrapped, values, accumulate)


def _adjacent_indices(x, indices) -> tuple[int, int] | None:
    """(first dim, count) of index tensors that sit on adjacent dims of `x` (integer, two or
    more, none of them masks), or None."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    if len(dims) < 2 or dims != list(range(dims[0], dims[-1] + 1)) or any(
            indices[d].dtype == torch.bool for d in dims):
        return None
    return dims[0], len(dims)


def _several_symbolic_indices(x, indices, *args, **kwargs) -> bool:
    symbolic = not all(isinstance(n, int) for t in (x, *[i for i in indices if i is not None]) for n in t.shape)
    return symbolic and _adjacent_indices(x, indices) is not None


def _index_flattened(x, indices):
    """`x[i, j]` (index tensors on adjacent dims) as one index into those dims merged, each
    index wrapped where negative, as eager reads it: torch-mlir fails to lower several index
    tensors of symbolic sizes (CLIP's pooling, `h[arange(b), ids.argmax(-1)]`), and the graph
    compiled once per shape."""
    if not _several_symbolic_indices(x, indices):
        return NotImplemented
    first, count = _adjacent_indices(x, indices)
    sizes = list(x.shape[first:first + count])
    flat = inside = None
    for d, size in enumerate(sizes):
        i = _wrapped(indices[first + d], size)
        ok = aten.logical_and.default(aten.ge.Scalar(i, 0), aten.lt.Scalar(i, size))
        inside = ok if inside is None else aten.logical_and.default(inside, ok)
        flat = i if flat is None else aten.add.Tensor(aten.mul.Scalar(flat, size), i)
    # An index out of its own dim's range (j = 7 of 5 read the next row's element 2) makes
    # the flat one out of the merged dim's, where bounds.py sees it.
    total = math.prod(sizes)
    flat = aten.where.self(inside, flat, aten.add.Scalar(aten.mul.Scalar(flat, 0), total))
    merged = [*x.shape[:first], total, *x.shape[first + count:]]
    return aten.index.Tensor(aten.reshape.default(x, merged), [None] * first + [flat])


def _crop_negative_pads(x, pad, value=0.0):
    """constant_pad_nd with negative pads (crops) as a slice, then the non-negative pads:
    torch-mlir's lowering fills the whole result with the pad value."""
    if all(p >= 0 for p in pad):
        return NotImplemented
    for i in range(len(pad) // 2):
        dim, left, right = x.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        size = x.shape[dim]
        x = aten.slice.Tensor(x, dim, max(-left, 0), size - max(-right, 0))
    return aten.constant_pad_nd.default(x, [max(p, 0) for p in pad], value)


def _symbolic(x, *args, **kwargs) -> bool:
    return not all(isinstance(n, int) for n in x.shape)


def _resizes_a_symbolic_row(x, dtype) -> bool:
    return x.dim() > 0 and x.dtype.itemsize != dtype.itemsize and not is_static(x.shape[-1])


def _dtype_view_by_whole_elements(x, dtype):
    """A view as a dtype of another size of a tensor whose last dim is symbolic, made through
    a last dim of static size: each of x's elements split into whole elements of `dtype`
    (narrower), or runs of them joined into one (wider). torch-mlir's lowering of a symbolic
    last dim divides where it should multiply: int16 from float32 [3, 4] came out [3, 2],
    the first half of the result, without an error, and float32 from int16 4x too wide."""
    if not _resizes_a_symbolic_row(x, dtype):
        return NotImplemented
    lead, n = list(x.shape[:-1]), x.shape[-1]
    if dtype.itemsize < x.dtype.itemsize:
        return aten.view.dtype(x.unsqueeze(-1), dtype).reshape(lead + [n * (x.dtype.itemsize // dtype.itemsize)])
    ratio = dtype.itemsize // x.dtype.itemsize  # (a reshape to [n // ratio, ratio] sizes its last dim n // (n // ratio))
    return aten.view.dtype(x.unfold(-1, ratio, ratio), dtype).squeeze(-1)


def _split_as_slices(x, split_sizes, dim=0):
    """split_with_sizes (chunk, split) as one slice per piece: torch-mlir fails to lower it
    where any size of `x` is symbolic ('failed to legalize torch.constant.int'), and
    torch._decomp's entry goes through as_strided, which takes no symbolic size, so a graph
    that chunks a tensor (a fused gate and up projection, Mamba's x and z) compiled once per
    shape."""
    dim, start, pieces = dim % x.dim(), 0, []
    for size in split_sizes:
        pieces.append(aten.slice.Tensor(x, dim, start, start + size))
        start = start + size
    return pieces


def _only_reshapes(x, size, stride, storage_offset=None) -> bool:
    """An as_strided with symbolic sizes that reads all of a row-major x in order: as many
    elements, row-major strides (those of size-1 dims aside), from the start. AOTAutograd
    writes one to give an output eager's strides (global pooling of a channels_last input:
    [n, c, 1, 1] with strides [c, 1, c, c]) and in the backward of that view, and
    torch-mlir's importer takes as_strided only at static sizes, so such graphs compiled
    once per shape."""
    if all(isinstance(n, int) for n in (*size, *stride, *x.shape)):
        return False
    offset = x.storage_offset() if storage_offset is None else storage_offset
    return (expr(offset) == 0 and expr(x.storage_offset()) == 0
            and sympy.expand(expr(math.prod(size)) - expr(x.numel())) == 0
            and is_row_major(size, stride) and is_row_major(x.shape, x.stride()))


def _as_strided_as_view(x, size, stride, storage_offset=None):
    if not _only_reshapes(x, size, stride, storage_offset):
        return NotImplemented
    return aten.view.default(x, list(size))


def _var_of_nothing(op):
    """var/std over zero elements is NaN (0/0 in eager); IREE's lowering gives -0.0."""

    def rewrite(x, dim=None, *, correction=None, keepdim=False):
        dims = range(x.dim()) if dim is None or len(dim) == 0 else dim
        count = 1
        for d in dims:
            count *= x.shape[d]
        if count != 0:
            return NotImplemented
        return aten.mul.Tensor(aten.sum.dim_IntList(x, list(dims), keepdim), float("nan"))

    return rewrite


def _empty_contraction(op):
    """mm/bmm/addmm over a zero-length inner dim: zeros (plus beta * self for addmm).
    IREE 3.13's compiler fails on a contraction over nothing."""

    def rewrite(*args, beta=1, alpha=1):
        a, b = args[-2], args[-1]
        if a.shape[-1] != 0:
            return NotImplemented
        out = aten.full.default([*a.shape[:-1], b.shape[-1]], 0, dtype=a.dtype, device=a.device)
        if op is aten.addmm.default and beta != 0:
            out = aten.add.Tensor(out, aten.mul.Tensor(args[0], beta))
        return out

    return rewrite


def _contracts_nothing(*args, **kwargs) -> bool:
    return args[-1].dim() >= 2 and args[-2].shape[-1] == 0


def _is_one(n) -> bool:
    return is_static(n) and int(n) == 1


def _one_row_or_column(*args, **kwargs) -> bool:
    """Whether mm/addmm/bmm multiplies one row (a is 1 x K) or by one column (b is K x 1),
    that size being known (the others may be symbolic)."""
    a, b = args[-2], args[-1]
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        return False
    return _is_one(a.shape[-2]) or _is_one(b.shape[-1])


def _vector_product(op):
    """mm/addmm/bmm of one row by a matrix (or of a matrix by one column) computed with a
    second row (column) of zeros, dropped after.

    On its data-tiling path IREE 3.13 packs a 1 x K operand as a plain reshape of where it
    came from and reads it as if dense: the transpose of a column slice (w[:, j:j+1].t() @ m,
    w[:, j] @ m, linear of such a row, einsum) read K elements from the slice's start instead
    of one per row of w, a wrong answer without an error; with symbolic sizes the result came
    back padded to 16 columns. A 2 x K operand is packed for real. (A product and a sum over
    K was also right, but 2.1x slower than this for a 1 x 768 row by GPT-2's 768 x 50257
    output projection.)"""

    def rewrite(*args, beta=1, alpha=1):
        if not _one_row_or_column(*args):
            return NotImplemented
        a, b = args[-2], args[-1]
        mm = aten.bmm.default if a.dim() == 3 else aten.mm.default
        if _is_one(a.shape[-2]):  # [.., 1, K] @ [.., K, N]: a second row of zeros, dropped after
            two = aten.cat.default([a, aten.zeros_like.default(a)], -2)
            out = aten.slice.Tensor(mm(two, b), -2, 0, 1)
        else:  # [.., M, K] @ [.., K, 1]: a second column of zeros, dropped after
            two = aten.cat.default([b, aten.zeros_like.default(b)], -1)
            out = aten.slice.Tensor(mm(a, two), -1, 0, 1)
        if op is aten.addmm.default:
            if alpha != 1:
                out = aten.mul.Tensor(out, alpha)
            if beta != 0:  # beta 0 ignores self, NaNs and all, as eager does
                out = aten.add.Tensor(out, args[0] if beta == 1 else aten.mul.Tensor(args[0], beta))
        return out

    return rewrite


def _positive_dim(op):
    """`op` (x, dim, ...) with dim counted from the front: torch-mlir's scatter lowering
    crashes iree-compile on a negative dim."""

    def rewrite(x, dim, *args, **kwargs):
        if dim >= 0:
            return NotImplemented
        return op(x, dim % max(x.dim(), 1), *args, **kwargs)

    return rewrite


def _slice_bounds(size: int, start, end) -> tuple[int, int]:
    """A slice's start and end as Python slicing reads them, counted from the front in [0, size]."""
    start = 0 if start is None else start + size if start < 0 else start
    end = size if end is None else end + size if end < 0 else end
    return min(max(start, 0), size), min(max(end, start, 0), size)


def _contiguous_slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """slice_scatter of a contiguous block (step 1, every dim before `dim` of size 1) as the
    concatenation of the pieces before, `src`, and after. IREE 3.13 turns the direct form
    into a copy into the input's buffer, which the runtime refuses at the call
    (PERMISSION_DENIED: the buffer does not allow DISCARD_WRITE)."""
    if not _block_scatter(x, src, dim, start, end, step):
        return NotImplemented
    dim = dim % x.dim()
    start, end = _slice_bounds(x.shape[dim], start, end)
    pieces = [aten.slice.Tensor(x, dim, 0, start), src, aten.slice.Tensor(x, dim, end, x.shape[dim])]
    return aten.cat.default([p for p in pieces if p.shape[dim] != 0], dim)


def _is_full(x, dims=None, *args, **kwargs) -> bool:
    return is_full_reduction(x, dims) or _is_half(x, **kwargs)


def _is_0d(x, *args, **kwargs) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _has_index(x, indices, *args, **kwargs) -> bool:
    return any(i is not None for i in indices)


def _negative_pad(x, pad, *args, **kwargs) -> bool:
    return any(p < 0 for p in pad)


def _reduces_nothing(x, dim=None, *args, **kwargs) -> bool:
    dims = range(x.dim()) if dim is None or len(dim) == 0 else dim
    return any(x.shape[d] == 0 for d in dims)


def _block_scatter(x, src, dim=0, start=None, end=None, step=1) -> bool:
    """Whether slice_scatter writes one contiguous block, with sizes and bounds all known."""
    if step != 1 or x.dim() == 0 or src.numel() == 0:
        return False
    known = all(isinstance(v, int) for v in (dim, start, end, *x.shape) if v is not None)
    return known and math.prod(x.shape[:dim % x.dim()]) == 1


def _ceil_mode(x, kernel_size, stride=(), padding=0, ceil_mode=False, *args, **kwargs) -> bool:
    return bool(ceil_mode)


def _negative_dim(x, dim, *args, **kwargs) -> bool:
    return dim < 0


def _either(first, second):
    return lambda *args, **kwargs: first(*args, **kwargs) or second(*args, **kwargs)


def _merged(*tables: dict) -> dict:
    """One table from several; an op in more than one gets each of its rewrites, tried in
    order (a later table's entry no longer replaces an earlier one's)."""
    out = {}
    for table in tables:
        for op, (needs, rewrite) in table.items():
            if op in out:
                needs, rewrite = _either(out[op][0], needs), _first_of(out[op][1], rewrite)
            out[op] = (needs, rewrite)
    return out


# op: (when a call needs the rewrite, the rewrite). Each rewrite also returns NotImplemented
# for calls it leaves alone, because make_fx applies the whole table once any call needs it.
_REWRITES = _merged(REFUSAL_REWRITES, INT8_REWRITES, F64_REWRITES, IN_F64, NAN_REWRITES, ARITH_REWRITES,
                    HALF_REWRITES, *CONV_REWRITES, {
    aten.atan2.default: (lambda *a, **k: True, _atan2),
    aten.mul.Tensor: (_squares, _square_as_pow),
    aten.log10.default: (_not_f64, _log10),
    aten.sum.dim_IntList: (_is_full, _first_of(
        _accumulate_in_f32(aten.sum.dim_IntList), _two_stage_reduction(aten.sum.dim_IntList))),
    aten.sum.default: (_is_full, _first_of(
        _accumulate_in_f32(aten.sum.default), _two_stage_reduction(aten.sum.dim_IntList))),
    aten.mean.dim: (_is_full, _first_of(
        _accumulate_in_f32(aten.mean.dim), _two_stage_reduction(aten.mean.dim))),
    aten.mean.default: (_is_full, _first_of(
        _accumulate_in_f32(aten.mean.default), _two_stage_reduction(aten.mean.dim))),
    aten.var.correction: (lambda *a, **k: _is_half(*a, **k) or _reduces_nothing(*a, **k), _first_of(
        _var_of_nothing(aten.var.correction), _accumulate_in_f32(aten.var.correction, has_dtype=False))),
    aten.std.correction: (_reduces_nothing, _var_of_nothing(aten.std.correction)),
    aten.avg_pool2d.default: (lambda *a, **k: _is_half(*a, **k) or _ceil_mode(*a, **k) or unbatched(*a), _first_of(
        functools.partial(ceil_mode_avg_pool, 2), batched(aten.avg_pool2d.default),
        _accumulate_in_f32(aten.avg_pool2d.default, has_dtype=False))),
    aten.avg_pool3d.default: (_ceil_mode, functools.partial(ceil_mode_avg_pool, 3)),
    aten.index_put.default: (_has_index, _first_of(_index_put_mask, _index_put_wrapped)),
    aten.index.Tensor: (_several_symbolic_indices, _index_flattened),
    aten.split_with_sizes.default: (_symbolic, _split_as_slices),
    aten.view.dtype: (_resizes_a_symbolic_row, _dtype_view_by_whole_elements),
    aten.as_strided.default: (_only_reshapes, _as_strided_as_view),

    aten.mm.default: (_contracts_nothing, _empty_contraction(aten.mm.default)),
    aten.bmm.default: (_contracts_nothing, _empty_contraction(aten.bmm.default)),
    aten.addmm.default: (_contracts_nothing, _empty_contraction(aten.addmm.default)),
    aten.constant_pad_nd.default: (_negative_pad, _crop_negative_pads),
    aten.slice_scatter.default: (_block_scatter, _contiguous_slice_scatter),
    aten._to_copy.default: (_is_float8_cast, _float8_cast),
    aten._softmax.default: (_is_0d, _over_a_vector(aten._softmax.default, 1)),
    aten._log_softmax.default: (_is_0d, _over_a_vector(aten._log_softmax.default, 1)),
    aten._softmax_backward_data.default: (_is_0d, _over_a_vector(aten._softmax_backward_data.default, 2)),
    aten._log_softmax_backward_data.default: (_is_0d, _over_a_vector(aten._log_softmax_backward_data.default, 2)),
}, {
    aten.mm.default: (_one_row_or_column, _vector_product(aten.mm.default)),
    aten.addmm.default: (_one_row_or_column, _vector_product(aten.addmm.default)),
    aten.bmm.default: (_one_row_or_column, _vector_product(aten.bmm.default)),
}, {op: (_negative_dim, _positive_dim(op)) for op in (
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_add.default,
    aten.scatter_reduce.two, aten.index_add.default, aten.index_copy.default, aten.gather.default)})
PRE_LOWERING = {op: rewrite for op, (_, rewrite) in _REWRITES.items()}


def needs_pre_lowering(op, args: tuple, kwargs: dict) -> bool:
    """Whether the PRE_LOWERING entry of `op` rewrites a call with these arguments (tensor
    values); make_fx only applies the table when some node needs it."""
    entry = _REWRITES.get(op)
    return entry is not None and bool(args) and entry[0](*args, **kwargs)


def is_full_reduction(x, dims) -> bool:
    """Whether a PRE_LOWERING reduction of `x` (a tensor value) over `dims` would be rewritten."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return False
    return not dims or len({d % x.dim() for d in dims}) == x.dim()
