"""f16 and bf16 computed as eager computes them on the CPU: in f32, rounded once at the end.

Reductions and scans accumulate in f32 (in the half type, a long sum loses its low bits or
overflows), and layer norm of a half input with f32 weight or bias (what CPU autocast hands
`nn.LayerNorm`) computes in f32 (torch-mlir's lowering computed its statistics in the input's
type: NaN for an f16 input of 8000, an error of 5.8 for a bf16 row offset by 1000).
HALF_REWRITES is merged into rewrites.PRE_LOWERING. A leaf: imports arith (the half types).
"""

from __future__ import annotations

import torch

from .arith import _HALF

aten = torch.ops.aten
_F32 = torch.float32


def _half_result(x, *args, dtype=None, **kwargs):
    """The f16/bf16 type of a reduction's or scan's result (its `dtype=`, else its input's), or None."""
    if not isinstance(x, torch.Tensor):
        return None
    dtype = dtype if dtype is not None else x.dtype
    return dtype if dtype in _HALF else None


def _is_half(x, *args, **kwargs) -> bool:
    return _half_result(x, **kwargs) is not None


def _accumulate_in_f32(op, has_dtype: bool = True):
    """`op` (a reduction or scan) with an f16/bf16 result computed in f32 and rounded once at
    the end, as eager does on the CPU; in the half type, a long sum loses its low bits or
    overflows. A `dtype=` names the result's type: eager first rounds the input into it."""

    def rewrite(x, *args, **kwargs):
        half = _half_result(x, **kwargs)
        if half is None:
            return NotImplemented
        if x.dtype != half:
            x = aten._to_copy.default(x, dtype=half)
        if has_dtype:
            out = op(x, *args, **{**kwargs, "dtype": torch.float32})
        else:
            out = op(aten._to_copy.default(x, dtype=torch.float32), *args, **kwargs)
        return aten._to_copy.default(out, dtype=half)

    return rewrite


def _f32(t):
    return None if t is None else aten._to_copy.default(t, dtype=_F32)


def _to(t, like):
    return None if t is None or like is None else aten._to_copy.default(t, dtype=like.dtype)


def _mixed(x, weight, bias) -> bool:
    return (isinstance(x, torch.Tensor) and x.dtype in _HALF
            and any(t is not None and t.dtype != x.dtype for t in (weight, bias)))


def _is_mixed_layer_norm(x, normalized_shape, weight, bias, *args, **kwargs) -> bool:
    return _mixed(x, weight, bias)


def _is_mixed_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, *args, **kwargs) -> bool:
    return _mixed(x, weight, bias)


def _layer_norm_in_f32(x, normalized_shape, weight, bias, eps):
    """native_layer_norm of a half input with f32 weight or bias, as f32 throughout (the
    layer-norm composite takes that form). Its statistics come back in the input's type on
    the CPU, as the graph's own values say (torch._refs.native_layer_norm)."""
    if not _mixed(x, weight, bias):
        return NotImplemented
    out, mean, rstd = aten.native_layer_norm.default(_f32(x), normalized_shape, _f32(weight), _f32(bias), eps)
    stats = x.dtype if x.device.type == "cpu" else _F32
    return (aten._to_copy.default(out, dtype=x.dtype), aten._to_copy.default(mean, dtype=stats),
            aten._to_copy.default(rstd, dtype=stats))


def _layer_norm_backward_in_f32(grad, x, normalized_shape, mean, rstd, weight, bias, mask):
    """native_layer_norm_backward of the same, in f32; each gradient in its input's type. The
    mean is taken again from the input: the forward's came back rounded to the input's type
    (bf16 rounds a mean of 1000 to a multiple of 8, which would move every normalized value
    by up to 4 standard deviations), where eager's kernel keeps it in f32."""
    if not _mixed(x, weight, bias):
        return NotImplemented
    x32 = _f32(x)
    mean = aten.mean.dim(x32, list(range(x.dim() - len(normalized_shape), x.dim())), True)
    dx, dw, db = aten.native_layer_norm_backward.default(
        _f32(grad), x32, normalized_shape, mean, _f32(rstd), _f32(weight), _f32(bias), mask)
    return _to(dx, x), _to(dw, weight), _to(db, bias)


# op: (when a call needs the rewrite, the rewrite); see rewrites._REWRITES. sum, mean, var
# and avg_pool2d accumulate in f32 there, combined with their other rewrites. Adaptive average
# pooling's lowering summed bf16 windows in bf16 (an error of 0.0068 at 130 x 67 into 7 x 5,
# where eager's is 0.0006).
HALF_REWRITES = {
    aten.linalg_vector_norm.default: (_is_half, _accumulate_in_f32(aten.linalg_vector_norm.default)),
    aten.prod.default: (_is_half, _accumulate_in_f32(aten.prod.default)),
    aten.prod.dim_int: (_is_half, _accumulate_in_f32(aten.prod.dim_int)),
    aten.cumsum.default: (_is_half, _accumulate_in_f32(aten.cumsum.default)),
    aten.cumprod.default: (_is_half, _accumulate_in_f32(aten.cumprod.default)),
    **{op: (_is_half, _accumulate_in_f32(op, has_dtype=False))
       for op in (aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)},
    aten.native_layer_norm.default: (_is_mixed_layer_norm, _layer_norm_in_f32),
    aten.native_layer_norm_backward.default: (_is_mixed_layer_norm_backward, _layer_norm_backward_in_f32),
}
