"""boo's own operators (torch.library custom ops), for chains that models write by hand and
that ATen has no op for which autograd keeps whole.

A leaf: imports nothing from boo_backend. patterns.py rewrites a hand-written chain in
Dynamo's graph into a call of one of these before AOTAutograd, so that the forward and the
backward graphs each hold one op that a composite computes. Each op has an eager
implementation (the reference, also used where no composite takes the node), a fake one,
and an autograd formula that calls its backward op.
"""

from __future__ import annotations

import torch

# -- boo::rms_norm ---------------------------------------------------------------------------
#
# out = (x * rstd) [rounded to norm_dtype] [* weight], rounded once to out_dtype, where
# rstd = rsqrt(mean(x^2 over the trailing normalized dims) + eps), all in f32. The optional
# rounding before the weight is the one hand-written chains make (Llama's
# `weight * hidden.to(input_dtype)`); torch.rms_norm makes none.


def _dims(x: torch.Tensor, normalized_shape) -> list[int]:
    return list(range(x.dim() - len(normalized_shape), x.dim()))


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """f32 for every dtype but float64 (the float64 references of the tests stay float64)."""
    return t if t.dtype == torch.float64 else t.float()


def _normalized(x, rstd, norm_dtype):
    y = _opmath(x) * rstd
    return y if norm_dtype is None else y.to(norm_dtype).float()


def rms_norm_reference(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float,
             norm_dtype: torch.dtype | None, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    xf = _opmath(x)
    rstd = torch.rsqrt(xf.pow(2).mean(_dims(x, normalized_shape), keepdim=True) + eps)
    y = _normalized(x, rstd, norm_dtype)
    if weight is not None:
        y = y * _opmath(weight)
    return y.to(out_dtype), rstd


rms_norm = torch.library.custom_op("boo::rms_norm", rms_norm_reference, mutates_args=())


@rms_norm.register_fake
def _(x, normalized_shape, weight, eps, norm_dtype, out_dtype):
    stat = [*x.shape[: x.dim() - len(normalized_shape)], *([1] * len(normalized_shape))]
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(stat, dtype=_opmath(x).dtype)


def rms_norm_backward_reference(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, normalized_shape: list[int],
                      weight: torch.Tensor | None, norm_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight); dweight is empty when there is no weight.
    dx = rstd * (gy - y * mean(gy * y)), gy = grad * weight, y = x * rstd."""
    dims = _dims(x, normalized_shape)
    gf = _opmath(grad)
    y = _opmath(x) * rstd
    if weight is None:
        dw = x.new_empty([0])
        gy = gf
    else:
        lead = list(range(x.dim() - len(normalized_shape)))
        yn = _normalized(x, rstd, norm_dtype)
        dw = (gf * yn).sum(lead).to(weight.dtype) if lead else (gf * yn).to(weight.dtype)
        gy = gf * _opmath(weight)
    dx = rstd * (gy - y * (gy * y).mean(dims, keepdim=True))
    return dx.to(x.dtype), dw


rms_norm_backward = torch.library.custom_op("boo::rms_norm_backward", rms_norm_backward_reference, mutates_args=())


@rms_norm_backward.register_fake
def _(grad, x, rstd, normalized_shape, weight, norm_dtype):
    dw = x.new_empty([0]) if weight is None else weight.new_empty(weight.shape)
    return x.new_empty(x.shape), dw


def _rms_norm_setup(ctx, inputs, output):
    x, normalized_shape, weight, _eps, norm_dtype, _out_dtype = inputs
    ctx.save_for_backward(x, output[1], weight)
    ctx.normalized_shape, ctx.norm_dtype = normalized_shape, norm_dtype


def _rms_norm_grad(ctx, grad_out, _grad_rstd):
    x, rstd, weight = ctx.saved_tensors
    dx, dw = torch.ops.boo.rms_norm_backward(grad_out, x, rstd, ctx.normalized_shape, weight, ctx.norm_dtype)
    return dx, None, (dw if weight is not None else None), None, None, None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)
