"""boo's own FX-level rewrites. A leaf: imports nothing from boo_backend.

- AOT: entries that replace core ATen's in the table given to AOTAutograd.
- FALLBACK: decompositions for ops that torch-mlir cannot lower and whose torch._decomp entry
  is missing or leads back to such ops. Used at fallback step 3, before torch._decomp.
- PRE_LOWERING: rewrites applied to every graph to steer around IREE codegen bugs; each one
  returns NotImplemented for the calls it leaves alone.
"""

from __future__ import annotations

import math
import threading

import torch

aten = torch.ops.aten


def _squeeze_dims(x, dims):
    dims = {d % max(x.dim(), 1) for d in dims}
    return aten.reshape.default(x, [s for i, s in enumerate(x.shape) if i not in dims or s != 1])


def _flash_attention_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal,
                                  *, attn_mask=None, scale=None):
    """Attention backward from the saved log-sum-exp: recompute the probabilities, then
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K * scale, dK = dS^T Q * scale."""
    if dropout_p != 0.0 or k.shape[1] != q.shape[1]:
        return NotImplemented  # dropout masks and grouped heads are not reproduced here
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    f32 = torch.float32
    qf, kf, vf, dof, of = (t.to(f32) for t in (q, k, v, grad_out, out))
    scores = _masked_scores(qf, kf, scale, is_causal, attn_mask)
    probs = torch.exp(scores - logsumexp.to(f32).unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-2, -1), dof)
    dprobs = torch.matmul(dof, vf.transpose(-2, -1))
    delta = (dof * of).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, kf)
    dk = torch.matmul(dscores.transpose(-2, -1), qf)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash_attention_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Attention forward that also returns the log-sum-exp its backward needs (torch._decomp's
    entry returns the probabilities in that place, which only inference can use)."""
    if dropout_p != 0.0 or k.shape[1] != q.shape[1]:
        return NotImplemented
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    f32 = torch.float32
    scores = _masked_scores(q.to(f32), k.to(f32), scale, is_causal, attn_mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(f32))
    return out.to(q.dtype), lse


def _masked_scores(qf, kf, scale, is_causal, attn_mask):
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if is_causal:
        lq, lk = qf.shape[-2], kf.shape[-2]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=qf.device).tril(diagonal=lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(scores.dtype))
    return scores


# core ATen's entry for CPU flash attention saves the probabilities where its backward
# expects the log-sum-exp, so training through it fails; this one saves the log-sum-exp.
AOT = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_cpu,
}

FALLBACK = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_cpu,
    aten.squeeze.dims: _squeeze_dims,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_attention_cpu_backward,
}


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
        rows = aten.reshape.default(x, [-1, x.shape[-1]])
        out = op(op(rows, [1], dtype=dtype), [0])
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


_NESTED = threading.local()


def _negative(t):
    """t < 0, counting -0.0 (whose reciprocal is -inf)."""
    return aten.logical_or.default(
        aten.lt.Scalar(t, 0), aten.logical_and.default(aten.eq.Scalar(t, 0), aten.lt.Scalar(aten.reciprocal.default(t), 0))
    )


def _atan2(y, x):
    """atan2 from its y >= 0 half: IREE 3.13's f32 approximation gets signs wrong (atan2(-1,
    -inf) gives +pi) and returns NaN for atan2(±0, ±0) and atan2(±inf, ±inf)."""
    if getattr(_NESTED, "atan2", False):
        return NotImplemented
    dtype = torch.result_type(y, x)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    if dtype == torch.float64:  # computed exactly (by an island: IREE's CPU target has no f64 atan2)
        return NotImplemented
    y, x = y.to(dtype), x.to(dtype)
    _NESTED.atan2 = True
    try:
        r = aten.atan2.default(aten.abs.default(y), x)
    finally:
        _NESTED.atan2 = False
    x_neg = _negative(x)
    zero = aten.logical_and.default(aten.eq.Scalar(y, 0), aten.eq.Scalar(x, 0))
    both_inf = aten.logical_and.default(aten.isinf.default(y), aten.isinf.default(x))
    pi = math.pi
    special = aten.where.self(zero, aten.mul.Tensor(x_neg, pi), aten.add.Tensor(aten.mul.Tensor(x_neg, pi / 2), pi / 4))
    r = aten.where.self(aten.logical_or.default(zero, both_inf), special.to(dtype), r)
    r = aten.where.self(_negative(y), aten.neg.default(r), r)
    nan = aten.logical_or.default(aten.isnan.default(y), aten.isnan.default(x))
    return aten.where.self(nan, aten.add.Tensor(y, x), r)


_HALF = (torch.float16, torch.bfloat16)


def _accumulate_in_f32(op, has_dtype: bool = True):
    """`op` (a reduction or scan) on f16/bf16 computed in f32 and rounded once at the end, as
    eager does on the CPU; in the input's type, a long sum loses its low bits or overflows."""

    def rewrite(x, *args, **kwargs):
        if x.dtype not in _HALF or kwargs.get("dtype") is not None:
            return NotImplemented
        if has_dtype:
            out = op(x, *args, **{**kwargs, "dtype": torch.float32})
        else:
            out = op(aten._to_copy.default(x, dtype=torch.float32), *args, **kwargs)
        return aten._to_copy.default(out, dtype=x.dtype)

    return rewrite


def _floor_divide(a, b, *, rounding_mode=None):
    """Integer floor division from truncating division, which IREE computes exactly;
    torch-mlir's floor lowering goes through f64 and is wrong beyond 2^53. A zero divisor
    (an error in eager) gives 0 instead of a hardware trap."""
    if rounding_mode != "floor" or torch.result_type(a, b).is_floating_point or torch.result_type(a, b) == torch.bool:
        return NotImplemented
    dtype = torch.result_type(a, b)
    b = b if isinstance(b, torch.Tensor) else torch.scalar_tensor(b, dtype=dtype, device=a.device)
    a, b = a.to(dtype), b.to(dtype)
    safe = aten.where.self(aten.eq.Scalar(b, 0), aten.ones_like.default(b), b)
    q = aten.div.Tensor_mode(a, safe, rounding_mode="trunc")
    r = aten.sub.Tensor(a, aten.mul.Tensor(q, safe))
    fix = aten.logical_and.default(aten.ne.Scalar(r, 0), aten.ne.Tensor(aten.lt.Scalar(r, 0), aten.lt.Scalar(safe, 0)))
    return aten.sub.Tensor(q, fix.to(dtype))


def _int_fmod(a, b):
    """Integer fmod (the remainder of truncating division), which torch-mlir cannot lower."""
    dtype = torch.result_type(a, b)
    if dtype.is_floating_point or dtype == torch.bool:
        return NotImplemented
    b = b if isinstance(b, torch.Tensor) else torch.scalar_tensor(b, dtype=dtype, device=a.device)
    a, b = a.to(dtype), b.to(dtype)
    safe = aten.where.self(aten.eq.Scalar(b, 0), aten.ones_like.default(b), b)
    return aten.sub.Tensor(a, aten.mul.Tensor(aten.div.Tensor_mode(a, safe, rounding_mode="trunc"), safe))


def _first_of(*rewrites):
    def rewrite(*args, **kwargs):
        for r in rewrites:
            out = r(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return NotImplemented

    return rewrite


def _is_half(x, *args, **kwargs) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _HALF and kwargs.get("dtype") is None


def _is_full(x, dims=None, *args, **kwargs) -> bool:
    return is_full_reduction(x, dims) or _is_half(x, **kwargs)


def _is_0d(x, *args, **kwargs) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _is_int(a, b, **kwargs) -> bool:
    dtype = torch.result_type(a, b)
    return not dtype.is_floating_point and dtype != torch.bool


def _is_int_floor(a, b, *, rounding_mode=None) -> bool:
    return rounding_mode == "floor" and _is_int(a, b)


# op: (when a call needs the rewrite, the rewrite). Each rewrite also returns NotImplemented
# for calls it leaves alone, because make_fx applies the whole table once any call needs it.
_REWRITES = {
    aten.atan2.default: (lambda *a, **k: True, _atan2),
    aten.div.Tensor_mode: (_is_int_floor, _floor_divide),
    aten.div.Scalar_mode: (_is_int_floor, _floor_divide),
    aten.fmod.Tensor: (_is_int, _int_fmod),
    aten.fmod.Scalar: (_is_int, _int_fmod),
    aten.sum.dim_IntList: (_is_full, _first_of(
        _accumulate_in_f32(aten.sum.dim_IntList), _two_stage_reduction(aten.sum.dim_IntList))),
    aten.sum.default: (_is_full, _first_of(
        _accumulate_in_f32(aten.sum.default), _two_stage_reduction(aten.sum.dim_IntList))),
    aten.mean.dim: (_is_full, _first_of(
        _accumulate_in_f32(aten.mean.dim), _two_stage_reduction(aten.mean.dim))),
    aten.mean.default: (_is_full, _first_of(
        _accumulate_in_f32(aten.mean.default), _two_stage_reduction(aten.mean.dim))),
    aten.linalg_vector_norm.default: (_is_half, _accumulate_in_f32(aten.linalg_vector_norm.default)),
    aten.prod.default: (_is_half, _accumulate_in_f32(aten.prod.default)),
    aten.prod.dim_int: (_is_half, _accumulate_in_f32(aten.prod.dim_int)),
    aten.cumsum.default: (_is_half, _accumulate_in_f32(aten.cumsum.default)),
    aten.var.correction: (_is_half, _accumulate_in_f32(aten.var.correction, has_dtype=False)),
    aten._softmax.default: (_is_0d, _over_a_vector(aten._softmax.default, 1)),
    aten._log_softmax.default: (_is_0d, _over_a_vector(aten._log_softmax.default, 1)),
    aten._softmax_backward_data.default: (_is_0d, _over_a_vector(aten._softmax_backward_data.default, 2)),
    aten._log_softmax_backward_data.default: (_is_0d, _over_a_vector(aten._log_softmax_backward_data.default, 2)),
}
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
