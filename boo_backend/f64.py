"""float64 math that keeps float64's precision in IREE. Imports only nans (`_inner`, a leaf) from boo_backend.

IREE's CPU modules in float64 call libm for most math functions (compile.Target.f64_flags
links them), but IREE expands a few itself, in forms that lose most of float64's precision:
log1p as log(1 + x) (5e-7 relative near 0), expm1 as exp(x) - 1, sinh, asinh, acosh and
atanh likewise; it cannot compile erf at all, and pow is exp(y log x), NaN for every
negative base (in every float type: _pow_ieee serves them all). F64_REWRITES (merged into
rewrites.PRE_LOWERING) gives them forms that keep float64's precision (Kahan's for log1p
and expm1), built from ops IREE computes exactly. IN_F64 computes IREE's inaccurate float32
functions (sin, cos, sinh, ...) of f32, f16 and bf16 tensors in float64.
"""

from __future__ import annotations

import math

import torch

from .nans import _inner, _nested

aten = torch.ops.aten


def _negative(t):
    """t < 0, counting -0.0 (whose reciprocal is -inf)."""
    return aten.logical_or.default(
        aten.lt.Scalar(t, 0), aten.logical_and.default(aten.eq.Scalar(t, 0), aten.lt.Scalar(aten.reciprocal.default(t), 0))
    )


_F64 = torch.float64


def _is_f64(x, *args, **kwargs) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == _F64


def _log1p_f64(x):
    """log(u) * x / (u - 1) with u = 1 + x: exact to a few ulps, as x / (u - 1) corrects
    the rounding of 1 + x."""
    if not _is_f64(x):
        return NotImplemented
    u = aten.add.Scalar(x, 1.0)
    d = aten.sub.Scalar(u, 1.0)
    r = aten.mul.Tensor(aten.log.default(u), aten.div.Tensor(x, d))
    return aten.where.self(aten.logical_or.default(aten.eq.Scalar(d, 0), aten.eq.Scalar(x, math.inf)), x, r)


def _expm1_f64(x):
    """(u - 1) * x / log(u) with u = exp(x)."""
    if not _is_f64(x):
        return NotImplemented
    u = aten.exp.default(x)
    um1 = aten.sub.Scalar(u, 1.0)
    r = aten.div.Tensor(aten.mul.Tensor(um1, x), aten.log.default(u))
    r = aten.where.self(aten.isinf.default(u), u, r)
    r = aten.where.self(aten.eq.Scalar(um1, -1.0), um1, r)
    return aten.where.self(aten.eq.Scalar(u, 1.0), x, r)


def _sinh_f64(x):
    """(e + e / (e + 1)) / 2 with e = expm1(x) below |x| = 1; (exp(x) - exp(-x)) / 2 above."""
    if not _is_f64(x):
        return NotImplemented
    e = _expm1_f64(x)
    small = aten.mul.Scalar(aten.add.Tensor(e, aten.div.Tensor(e, aten.add.Scalar(e, 1.0))), 0.5)
    large = aten.mul.Scalar(aten.sub.Tensor(aten.exp.default(x), aten.exp.default(aten.neg.default(x))), 0.5)
    return aten.where.self(aten.lt.Scalar(aten.abs.default(x), 1.0), small, large)


def _odd(f, x):
    """An odd function from its values at |x| (the sign of -0.0 kept)."""
    r = f(aten.abs.default(x))
    return aten.where.self(_negative(x), aten.neg.default(r), r)


def _asinh_f64(x):
    """log1p(a + a^2 / (1 + sqrt(1 + a^2))) for a = |x|; log(a) + log(2) past 2^28."""
    if not _is_f64(x):
        return NotImplemented

    def at(a):
        a2 = aten.mul.Tensor(a, a)
        inner = aten.add.Tensor(a, aten.div.Tensor(a2, aten.add.Scalar(aten.sqrt.default(aten.add.Scalar(a2, 1.0)), 1.0)))
        far = aten.add.Scalar(aten.log.default(a), math.log(2.0))
        return aten.where.self(aten.gt.Scalar(a, 2.0 ** 28), far, _log1p_f64(inner))

    return _odd(at, x)


def _atanh_f64(x):
    """log1p(2a / (1 - a)) / 2 for a = |x|."""
    if not _is_f64(x):
        return NotImplemented
    return _odd(lambda a: aten.mul.Scalar(_log1p_f64(aten.div.Tensor(aten.mul.Scalar(a, 2.0), aten.rsub.Scalar(a, 1.0))), 0.5), x)


def _acosh_f64(x):
    """log1p(t + sqrt(2t + t^2)) for t = x - 1; log(x) + log(2) past 2^28; NaN below 1."""
    if not _is_f64(x):
        return NotImplemented
    t = aten.sub.Scalar(x, 1.0)
    near = _log1p_f64(aten.add.Tensor(t, aten.sqrt.default(aten.add.Tensor(aten.mul.Scalar(t, 2.0), aten.mul.Tensor(t, t)))))
    far = aten.add.Scalar(aten.log.default(x), math.log(2.0))
    # NaN below 1, as in eager (a large negative x gave -inf: t + sqrt(2t + t^2) cancels)
    return _where(aten.lt.Scalar(x, 1.0), math.nan, aten.where.self(aten.gt.Scalar(x, 2.0 ** 28), far, near))


_ERF_TERMS = 100


def _erf_f64(x):
    """2/sqrt(pi) exp(-x^2) sum_n 2^n x^(2n+1) / (1 3 5 ... (2n+1)): positive terms, no
    cancellation; 100 of them reach 2e-15 at |x| = 6, past which erf is +-1 in float64."""
    if not _is_f64(x):
        return NotImplemented
    xc = aten.clamp.default(x, -6.0, 6.0)
    twice_x2 = aten.mul.Scalar(aten.mul.Tensor(xc, xc), 2.0)
    term = total = xc
    for n in range(1, _ERF_TERMS + 1):
        term = aten.mul.Tensor(term, aten.div.Scalar(twice_x2, 2.0 * n + 1.0))
        total = aten.add.Tensor(total, term)
    r = aten.mul.Tensor(aten.exp.default(aten.mul.Scalar(twice_x2, -0.5)), aten.mul.Scalar(total, 2.0 / math.sqrt(math.pi)))
    r = aten.where.self(aten.ge.Scalar(aten.abs.default(x), 6.0), aten.sign.default(x), r)
    return aten.where.self(aten.isnan.default(x), x, r)  # the clamp drops NaN


def _and(a, b):
    """Logical and of masks that are bool tensors or Python bools (decided while tracing)."""
    if isinstance(a, bool) or isinstance(b, bool):
        known, other = (a, b) if isinstance(a, bool) else (b, a)
        return other if known else False
    return aten.logical_and.default(a, b)


def _or(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        known, other = (a, b) if isinstance(a, bool) else (b, a)
        return True if known else other
    return aten.logical_or.default(a, b)


def _not(a):
    return (not a) if isinstance(a, bool) else aten.logical_not.default(a)


def _where(mask, value: float, r):
    if isinstance(mask, bool):
        return aten.full_like.default(r, value) if mask else r
    return aten.where.self(mask, aten.full_like.default(r, value), r)


# The exponents eager's pow(tensor, number) computes without pow (its results differ from
# IEEE pow at -0.0 and -inf: (-0.0) ** 0.5 is sqrt(-0.0) = -0.0).
_EAGER_POWERS = {
    0.5: aten.sqrt.default,
    -0.5: aten.rsqrt.default,
    2: lambda x: aten.mul.Tensor(x, x),
    3: lambda x: aten.mul.Tensor(aten.mul.Tensor(x, x), x),
    -1: aten.reciprocal.default,
    -2: lambda x: aten.reciprocal.default(aten.mul.Tensor(x, x)),
}


_GELU_BETA, _GELU_KAPPA = math.sqrt(2.0 / math.pi), 0.044715


def _gelu_tanh_inner(x):
    cube = aten.mul.Tensor(aten.mul.Tensor(x, x), x)
    return aten.tanh.default(aten.mul.Scalar(aten.add.Tensor(x, aten.mul.Scalar(cube, _GELU_KAPPA)), _GELU_BETA))


def _gelu_f64(x, approximate="none"):
    """gelu in float64: x * Phi(x) with Phi from _erf_f64 (torch-mlir lowers it to erf, which
    IREE cannot compile in float64); the tanh form as eager writes it (torch-mlir's is 5e-5 off)."""
    if not _is_f64(x):
        return NotImplemented
    if approximate == "tanh":
        return aten.mul.Tensor(aten.mul.Scalar(x, 0.5), aten.add.Scalar(_gelu_tanh_inner(x), 1.0))
    return aten.mul.Tensor(x, _normal_cdf(x))


def _normal_cdf(x):
    return aten.mul.Scalar(aten.add.Scalar(_erf_f64(aten.mul.Scalar(x, math.sqrt(0.5))), 1.0), 0.5)


def _gelu_backward_f64(grad, x, approximate="none"):
    """grad * (Phi(x) + x * phi(x)); for the tanh form, its derivative as eager computes it."""
    if not _is_f64(x):
        return NotImplemented
    if approximate == "tanh":
        t = _gelu_tanh_inner(x)
        left = aten.mul.Scalar(aten.add.Scalar(t, 1.0), 0.5)
        slope = aten.mul.Scalar(aten.add.Scalar(aten.mul.Scalar(aten.mul.Tensor(x, x), 3.0 * _GELU_KAPPA), 1.0), _GELU_BETA)
        right = aten.mul.Tensor(aten.mul.Tensor(aten.mul.Scalar(x, 0.5), aten.rsub.Scalar(aten.mul.Tensor(t, t), 1.0)), slope)
        return aten.mul.Tensor(grad, aten.add.Tensor(left, right))
    pdf = aten.mul.Scalar(aten.exp.default(aten.mul.Scalar(aten.mul.Tensor(x, x), -0.5)), 1.0 / math.sqrt(2.0 * math.pi))
    return aten.mul.Tensor(grad, aten.add.Tensor(_normal_cdf(x), aten.mul.Tensor(x, pdf)))


def _pow_needs(x, y) -> bool:
    """Whether pow(x, y) takes _pow_ieee: every float64 call; in float32 and the half types,
    a tensor exponent, or a number exponent that is not finite or not a whole number (with
    a -inf base; 0.5 and -0.5 are sqrt and rsqrt). torch-mlir computes a whole number
    exponent as eager does (arith._pow_negative_integer mends x = 0)."""
    dtype = torch.result_type(x, y)
    if not dtype.is_floating_point:
        return False
    if dtype == _F64 or isinstance(y, torch.Tensor):
        return True
    y = float(y)
    return not math.isfinite(y) or (y != math.floor(y) and y not in (0.5, -0.5))


def _pow_ieee(op):
    """pow from pow(|x|, y), with the sign and the special cases IEEE and eager give: a
    negative base to an integer power, NaN to a fractional one, x^0 = 1^y = 1,
    (-1)^(+-inf) = 1. IREE's pow is exp(y log x) in every float type: NaN for every negative
    base (`torch.pow(x, e)` with x = -2 and e = 3 gave NaN, not -8) and for 0^0 and 1^inf.
    Half types are computed in f32 and rounded once, as eager does. A Python-number operand
    is decided while tracing, not compared as a constant tensor (torch-mlir folds
    comparisons of float64 constant tensors wrongly)."""

    def rewrite(x, y):
        if _nested(op) or not _pow_needs(x, y):
            return NotImplemented
        dtype = torch.result_type(x, y)
        work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        tx, ty = isinstance(x, torch.Tensor), isinstance(y, torch.Tensor)
        if tx and not ty and y in _EAGER_POWERS:  # eager's own kernels for these exponents
            return _EAGER_POWERS[y](x.to(_F64))
        x = x.to(dtype).to(work) if tx else float(x)
        y = y.to(dtype).to(work) if ty else float(y)
        # abs: IREE's pow of a positive base that overflows to an odd power gives -inf
        r = aten.abs.default(_inner(op, aten.abs.default(x) if tx else abs(x), y))
        if ty:
            half = aten.mul.Scalar(y, 0.5)
            whole = aten.eq.Tensor(aten.floor.default(y), y)
            odd = _and(whole, aten.ne.Tensor(aten.floor.default(half), half))
            zero, infinite = aten.eq.Scalar(y, 0), aten.isinf.default(y)
        else:
            whole = y == math.floor(y) if math.isfinite(y) else math.isinf(y)
            odd = whole and math.isfinite(y) and math.floor(y / 2) != y / 2
            zero, infinite = y == 0, math.isinf(y)
        if tx:
            negative = _negative(x)
            finite_negative = aten.logical_and.default(aten.lt.Scalar(x, 0), aten.isfinite.default(x))
            base_one, minus_one = aten.eq.Scalar(x, 1.0), aten.eq.Scalar(x, -1.0)
        else:
            negative = x < 0 or (x == 0 and math.copysign(1.0, x) < 0)
            finite_negative, base_one, minus_one = x < 0 and math.isfinite(x), x == 1.0, x == -1.0
        flip = _and(negative, odd)
        if isinstance(flip, bool):
            r = aten.neg.default(r) if flip else r
        else:
            r = aten.where.self(flip, aten.neg.default(r), r)
        r = _where(_and(finite_negative, _not(whole)), math.nan, r)
        r = _where(_or(_or(zero, base_one), _and(minus_one, infinite)), 1.0, r)
        return r if work == dtype else aten._to_copy.default(r, dtype=dtype)

    return rewrite


def _narrow(x, *args, **kwargs) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _in_f64(op):
    """`op` on an f32/f16/bf16 tensor computed in float64 and rounded once. IREE's own float32
    forms of these are far from eager's: sin(-1e-6) gave -9.0e-7, sin(1e4) -0.30535 (eager
    -0.30561: its argument reduction loses digits, so RoPE tables at long positions drift),
    sin(1e10) -6e21; sinh, asinh and atanh of 1e-10 gave 0; sinh and cosh overflowed at 89
    and asinh, acosh at 1e10 (through exp(x) and x * x); exp2 was 8 ulps off. In float64
    IREE calls libm for them, or F64_REWRITES gives them exact forms."""

    def rewrite(x):
        if not _narrow(x) or _nested(op):
            return NotImplemented
        return aten._to_copy.default(_inner(op, aten._to_copy.default(x, dtype=_F64)), dtype=x.dtype)

    return rewrite


# The float32 math that _in_f64 computes in float64 (tanh, exp, log, erf and the inverse
# trigonometric functions are within eager's rounding in float32).
IN_F64 = {op: (_narrow, _in_f64(op)) for op in (
    aten.sin.default, aten.cos.default, aten.tan.default, aten.sinh.default, aten.cosh.default,
    aten.asinh.default, aten.acosh.default, aten.atanh.default, aten.exp2.default)}


# op: (when a call needs the rewrite, the rewrite); see rewrites._REWRITES.
F64_REWRITES = {
    aten.log1p.default: (_is_f64, _log1p_f64),
    aten.expm1.default: (_is_f64, _expm1_f64),
    aten.sinh.default: (_is_f64, _sinh_f64),
    aten.asinh.default: (_is_f64, _asinh_f64),
    aten.atanh.default: (_is_f64, _atanh_f64),
    aten.acosh.default: (_is_f64, _acosh_f64),
    aten.erf.default: (_is_f64, _erf_f64),
    torch.ops.prims.erf.default: (_is_f64, _erf_f64),
    aten.gelu.default: (_is_f64, _gelu_f64),
    aten.gelu_backward.default: (lambda grad, x, *args, **kwargs: _is_f64(x), _gelu_backward_f64),
    **{op: (_pow_needs, _pow_ieee(op)) for op in (aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)},
}
