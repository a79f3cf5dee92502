"""Arithmetic as eager computes it, where torch-mlir's lowering or fold differs: integer
division without the traps, float division and remainders from an exact fmod, integer
negation and shifts, `x ** -n` at zero, and integer scatter means. ARITH_REWRITES is merged
into rewrites.PRE_LOWERING.

Imports only nans (the recursion guard), a leaf.
"""

from __future__ import annotations

import math

import torch

from .nans import _inner, _nested

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)


def _has_tensor(a, b) -> bool:
    """Whether a binary op's call has a tensor operand: a call on sizes alone (SymInts, as
    `torch.div(x.shape[1], 4, rounding_mode="trunc")` traces) is left to torch-mlir."""
    return isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)


def _nonzero(b, given, zero=None):
    """The divisor `b` with 1 where it is 0 (or where `zero`, a mask that includes b == 0),
    so that no division traps; and the call raises as eager does (RuntimeError:
    ZeroDivisionError) where one was 0 (checks.py turns the assert into a flag the part
    reads), unless the divisor `given` is a number other than 0 or such a divisor already
    (floor division divides by one through truncating division)."""
    is_zero = aten.eq.Scalar(b, 0)
    if not (type(given) is int and given != 0 or getattr(given, "_boo_nonzero", False)):
        aten._assert_async.msg(aten.logical_not.default(aten.any.default(is_zero)), "ZeroDivisionError")
    safe = aten.where.self(is_zero if zero is None else zero, aten.ones_like.default(b), b)
    safe._boo_nonzero = True
    return safe


def _floor_divide(a, b, *, rounding_mode=None):
    """Integer floor division from truncating division, which IREE computes exactly;
    torch-mlir's floor lowering goes through f64 and is wrong beyond 2^53. A zero divisor
    raises, as in eager (it gave 0)."""
    if rounding_mode != "floor" or not _is_int(a, b):
        return NotImplemented
    given = b
    a, b, dtype = _as_tensors(a, b)
    safe = _nonzero(b, given)
    q = aten.div.Tensor_mode(a, safe, rounding_mode="trunc")
    r = aten.sub.Tensor(a, aten.mul.Tensor(q, safe))
    fix = aten.logical_and.default(aten.ne.Scalar(r, 0), aten.ne.Tensor(aten.lt.Scalar(r, 0), aten.lt.Scalar(safe, 0)))
    return aten.sub.Tensor(q, fix.to(dtype))


def _is_signed_int(dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool and dtype.is_signed


def _int_trunc_divide(a, b, *, rounding_mode=None):
    """Integer truncating division without the divisors a CPU's division traps on: INT_MIN
    divided by -1 (eager wraps it to INT_MIN) killed the process with SIGFPE. A zero divisor
    raises, as in eager (it gave the dividend)."""
    if not _is_int_trunc(a, b, rounding_mode=rounding_mode) or _nested(aten.div.Tensor_mode):
        return NotImplemented
    given = b
    a, b, _ = _as_tensors(a, b)
    minus_one = aten.eq.Scalar(b, -1)
    safe = _nonzero(b, given, aten.logical_or.default(aten.eq.Scalar(b, 0), minus_one))
    q = _inner(aten.div.Tensor_mode, a, safe, rounding_mode="trunc")
    return aten.where.self(minus_one, aten.neg.default(a), q)


def _int_negate(x):
    """-x of an integer tensor as x * -1: torch-mlir's neg went through f32, so values past
    2^24 came back rounded (-463277013 as -463277024), written into the caller's tensor by neg_."""
    if not _is_signed_int(x.dtype):
        return NotImplemented
    return aten.mul.Scalar(x, -1)


def _shift_by_number(op, right: bool):
    """An integer shifted by a Python number outside [0, bits), as eager gives it: 0 to the
    left, the sign's fill to the right (x >> (bits - 1)). IREE shifted by the amount modulo
    the width (or, with dynamic sizes, returned other elements)."""

    def rewrite(x, n):
        if not _shift_out_of_range(x, n):
            return NotImplemented
        if right:
            return op(x, x.element_size() * 8 - 1)
        return aten.mul.Scalar(x, 0)

    return rewrite


def _shift_out_of_range(x, n) -> bool:
    return (isinstance(x, torch.Tensor) and _is_signed_int(x.dtype) and isinstance(n, int)
            and not isinstance(n, bool) and not 0 <= n < x.element_size() * 8)


def _as_tensors(a, b, *, wide: bool = False):
    """a and b (one may be a Python number) as tensors of their result type, and that type;
    with `wide`, f16/bf16 become f32, and a number is made f32 directly (as eager reads it)."""
    dtype = torch.result_type(a, b)
    work = torch.float32 if wide and dtype in _HALF else dtype
    b = b.to(dtype).to(work) if isinstance(b, torch.Tensor) else torch.scalar_tensor(b, dtype=work, device=a.device)
    a = a.to(dtype).to(work) if isinstance(a, torch.Tensor) else torch.scalar_tensor(a, dtype=work, device=b.device)
    return a, b, dtype


def _float_fmod(a, b):
    """Float fmod from the remainder of the magnitudes (an exact remf), with a's sign:
    torch-mlir lowers fmod as a - trunc(a / b) * b, which rounds the quotient first
    (fmod(1.5, 0.3) gave -6e-8 where eager gives 0.3; 1555826.4 mod 0.0008 was off by 0.04)."""
    if not _has_tensor(a, b):
        return NotImplemented
    a, b, dtype = _as_tensors(a, b)
    if not dtype.is_floating_point or dtype in _HALF:
        return NotImplemented
    r = _inner(aten.remainder.Tensor, aten.abs.default(a), aten.abs.default(b))
    return aten.where.self(aten.signbit.default(a), aten.neg.default(r), r)


def _float_remainder(a, b):
    """Float remainder as eager computes it, fmod moved to b's sign: torch-mlir's fold of a
    remainder of constants left out that move (remainder(full(-2.5), 1) gave -0.5, not 0.5)."""
    if _nested(aten.remainder.Tensor) or not _has_tensor(a, b):
        return NotImplemented
    a, b, dtype = _as_tensors(a, b)
    if not dtype.is_floating_point or dtype in _HALF:
        return NotImplemented
    r = _float_fmod(a, b)
    moves = aten.logical_and.default(aten.ne.Scalar(r, 0.0), aten.ne.Tensor(aten.signbit.default(r), aten.signbit.default(b)))
    return aten.where.self(moves, aten.add.Tensor(r, b), r)


def _negative_whole_exponent(x, n) -> bool:
    return (isinstance(x, torch.Tensor) and x.dtype.is_floating_point and isinstance(n, (int, float))
            and not isinstance(n, bool) and n < 0 and math.isfinite(n) and n == int(n))


def _pow_negative_integer(x, n):
    """x ** n for a negative whole n, with eager's infinity at x = 0 (+inf, or -inf for -0.0
    and odd n): IREE's expansion gave -inf for every zero."""
    if not _negative_whole_exponent(x, n) or _nested(aten.pow.Tensor_Scalar):
        return NotImplemented
    at_zero = aten.reciprocal.default(aten.pow.Tensor_Scalar(x, -n))
    return aten.where.self(aten.eq.Scalar(x, 0.0), at_zero, _inner(aten.pow.Tensor_Scalar, x, n))


def _float_floor_divide(a, b, *, rounding_mode=None):
    """Float floor division as eager computes it, from fmod: torch-mlir's floor(a / b) rounds
    the quotient first, so 1.5 // 0.3 gave 5 where eager (and Python) give 4. Half types are
    computed in f32 and rounded once, a Python number taken in f32, as eager does."""
    if rounding_mode != "floor" or not _has_tensor(a, b):
        return NotImplemented
    a, b, dtype = _as_tensors(a, b, wide=True)
    if not dtype.is_floating_point:
        return NotImplemented
    mod = aten.fmod.Tensor(a, b)
    div = aten.div.Tensor(aten.sub.Tensor(a, mod), b)
    below = aten.logical_and.default(aten.ne.Scalar(mod, 0.0), aten.ne.Tensor(aten.signbit.default(b), aten.signbit.default(mod)))
    div = aten.where.self(below, aten.sub.Scalar(div, 1.0), div)
    floor = aten.floor.default(div)
    floor = aten.where.self(aten.gt.Scalar(aten.sub.Tensor(div, floor), 0.5), aten.add.Scalar(floor, 1.0), floor)
    quotient = aten.div.Tensor(a, b)
    zero = aten.where.self(aten.signbit.default(quotient), aten.full_like.default(floor, -0.0), aten.zeros_like.default(floor))
    out = aten.where.self(aten.eq.Scalar(div, 0.0), zero, floor)
    out = aten.where.self(aten.eq.Scalar(b, 0.0), quotient, out)
    return out.to(dtype)


def _int_scatter_mean(x, dim, index, src, reduce, *, include_self=True):
    """Integer scatter_reduce "mean" as eager computes it: the sum, floor-divided by the count
    (torch-mlir's lowering truncates, so -7 and 2 gave -1 where eager gives -2)."""
    if not _is_int_mean(x, dim, index, src, reduce):
        return NotImplemented
    total = aten.scatter_reduce.two(x, dim, index, src, "sum", include_self=include_self)
    start = aten.ones_like.default(x) if include_self else aten.zeros_like.default(x)
    count = aten.scatter_add.default(start, dim, index, aten.ones_like.default(src))
    count = aten.where.self(aten.eq.Scalar(count, 0), aten.ones_like.default(count), count)
    return _floor_divide(total, count, rounding_mode="floor")


def _int_fmod(a, b):
    """Integer fmod (the remainder of truncating division), which torch-mlir cannot lower.
    A zero divisor raises, as in eager."""
    if not _is_int(a, b):
        return NotImplemented
    given = b
    a, b, _ = _as_tensors(a, b)
    safe = _nonzero(b, given)
    return aten.sub.Tensor(a, aten.mul.Tensor(aten.div.Tensor_mode(a, safe, rounding_mode="trunc"), safe))


def _int_remainder(a, b):
    """Integer remainder (Python's: the divisor's sign) from fmod, so that a zero divisor
    raises as in eager (torch-mlir's remainder gave the dividend, or 0)."""
    if not _is_int(a, b):
        return NotImplemented
    a, b, _ = _as_tensors(a, b)
    r = _int_fmod(a, b)
    moves = aten.logical_and.default(aten.ne.Scalar(r, 0), aten.ne.Tensor(aten.lt.Scalar(r, 0), aten.lt.Scalar(b, 0)))
    return aten.where.self(moves, aten.add.Tensor(r, b), r)


def _binary_in_f32(op):
    """Binary `op` on f16/bf16 computed in f32 and rounded once: torch-mlir expands fmod and
    remainder into several half-precision steps (a - trunc(a / b) * b), each one rounding."""

    def rewrite(a, b):
        dtype = torch.result_type(a, b)
        if dtype not in _HALF or not _has_tensor(a, b):
            return NotImplemented
        # eager rounds a Python number to the tensor's type for these two ops (not for div)
        wide = [aten._to_copy.default(t if isinstance(t, torch.Tensor) else torch.scalar_tensor(t, dtype=dtype),
                                      dtype=torch.float32) for t in (a, b)]
        return aten._to_copy.default(op(*wide), dtype=dtype)

    return rewrite


def _is_int(a, b, **kwargs) -> bool:
    dtype = torch.result_type(a, b)
    return _has_tensor(a, b) and not dtype.is_floating_point and dtype != torch.bool


def _is_floor(a, b, *, rounding_mode=None) -> bool:
    return rounding_mode == "floor" and _has_tensor(a, b) and torch.result_type(a, b) != torch.bool


def _is_int_trunc(a, b, *, rounding_mode=None) -> bool:
    return rounding_mode == "trunc" and _has_tensor(a, b) and _is_signed_int(torch.result_type(a, b))


def _is_int_mean(x, dim, index, src, reduce, **kwargs) -> bool:
    return reduce == "mean" and not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool


def _first_of(*rewrites):
    def rewrite(*args, **kwargs):
        for r in rewrites:
            out = r(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return NotImplemented

    return rewrite


def _floor_or_int_trunc(a, b, *, rounding_mode=None) -> bool:
    return _is_floor(a, b, rounding_mode=rounding_mode) or _is_int_trunc(a, b, rounding_mode=rounding_mode)


def _int8_with_number(a, b, *args, **kwargs) -> bool:
    """An int8 result from an int8 tensor and a number: a Python int or a 0-d tensor of
    another integer type (`x * torch.tensor(3)`), either side."""
    return (_has_tensor(a, b) and torch.result_type(a, b) == torch.int8
            and any(type(v) is int or isinstance(v, torch.Tensor) and v.dtype != torch.int8 for v in (a, b)))


def _wrapped_to_int8(n: int) -> int:
    """`n` as eager reads it beside an int8 tensor: cast to int8 (300 is 44)."""
    return (n + 128) % 256 - 128


def _int8_as_int32(t):
    """An int8 operand (a 0-d tensor of another type cast to int8 first, as eager casts it)
    widened to int32."""
    return aten._to_copy.default(t if t.dtype == torch.int8 else aten._to_copy.default(t, dtype=torch.int8),
                                 dtype=torch.int32)


def _int8_in_int32(op):
    """`op` on an int8 tensor and a number, computed in int32 and cast back to int8.
    torch-mlir cannot make an int8 constant from a number ("dstOriginalDtype has to be
    passed"), so `x * 3`, `x - 3`, `x // 3` and `x % 7` sent their whole graph to eager.
    The number is first cast to int8 as eager casts it; the int32 result then wraps to the
    same int8 value as eager's (sums, differences and products modulo 2^8; quotients and
    remainders of numbers already in int8's range)."""

    def rewrite(a, b, *args, **kwargs):
        if not _int8_with_number(a, b):
            return NotImplemented
        a, b = (_int8_as_int32(v) if isinstance(v, torch.Tensor) else _wrapped_to_int8(v) for v in (a, b))
        return aten._to_copy.default(op(a, b, *args, **kwargs), dtype=torch.int8)

    return rewrite


def _compares_ints_as_floats(a, b) -> bool:
    """A comparison whose common dtype is a float one, with an integer or bool tensor in it."""
    return (_has_tensor(a, b) and torch.result_type(a, b).is_floating_point
            and any(isinstance(v, torch.Tensor) and not v.dtype.is_floating_point for v in (a, b)))


def _compared_in(op):
    """Comparison `op` with its integer tensors cast to the common float dtype first, as
    eager's kernels compare: `i == 16777216.0` of an int64 16777217 is True in eager (both
    are that float32), where torch-mlir compared exactly."""

    def rewrite(a, b):
        if not _compares_ints_as_floats(a, b):
            return NotImplemented
        dtype = torch.result_type(a, b)
        a, b = (aten._to_copy.default(v, dtype=dtype) if isinstance(v, torch.Tensor) and v.dtype != dtype else v
                for v in (a, b))
        return op(a, b)

    return rewrite


# op: (when a call needs the rewrite, the rewrite), tried before ARITH_REWRITES' own.
INT8_REWRITES = {op: (_int8_with_number, _int8_in_int32(op)) for op in (
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar,
    aten.rsub.Scalar, aten.floor_divide.default, aten.div.Tensor_mode, aten.div.Scalar_mode,
    aten.remainder.Scalar, aten.remainder.Tensor, aten.fmod.Scalar, aten.fmod.Tensor)}

# op: (when a call needs the rewrite, the rewrite); see rewrites._REWRITES.
ARITH_REWRITES = {
    aten.scatter_reduce.two: (_is_int_mean, _int_scatter_mean),
    aten.neg.default: (lambda x: _is_signed_int(x.dtype), _int_negate),
    **{op: (_floor_or_int_trunc, _first_of(_floor_divide, _float_floor_divide, _int_trunc_divide))
       for op in (aten.div.Tensor_mode, aten.div.Scalar_mode)},
    **{op: (_has_tensor, _first_of(_int_fmod, _binary_in_f32(aten.fmod.Tensor), _float_fmod))
       for op in (aten.fmod.Tensor, aten.fmod.Scalar)},
    **{op: (_has_tensor, _first_of(_int_remainder, _binary_in_f32(aten.remainder.Tensor), _float_remainder))
       for op in (aten.remainder.Tensor, aten.remainder.Scalar)},
    aten.pow.Tensor_Scalar: (_negative_whole_exponent, _pow_negative_integer),
    **{op: (_compares_ints_as_floats, _compared_in(op)) for op in (
        aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar,
        aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor)},
    **{op: (_shift_out_of_range, _shift_by_number(op, right)) for op, right in (
        (aten.__rshift__.Scalar, True), (aten.bitwise_right_shift.Tensor_Scalar, True),
        (aten.bitwise_right_shift.Tensor, True), (aten.__lshift__.Scalar, False),
        (aten.bitwise_left_shift.Tensor_Scalar, False), (aten.bitwise_left_shift.Tensor, False))},
}
