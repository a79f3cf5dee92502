"""Layer norm forward and the combined backward (dx, dweight, dbias in one kernel).

Kernels are written for a 2-D input [M, N] normalized over its last dim; `canonical`
reshapes any other call (several trailing normalized dims, extra batch dims) into that form.
M may be dynamic; N is a constant of the kernels (and picks the backward's layout).
"""

from __future__ import annotations


import torch
from torch._decomp import decomposition_table

from . import (
    ELEMENT_TYPES, Composite, common_decline, flat, random_tensor, register, rows_cols, size, symbolic_decline,
)

aten = torch.ops.aten


def _is_canonical(x, normalized_shape) -> bool:
    return x.dim() == 2 and len(normalized_shape) == 1


def _decline(x, normalized_shape, weight, bias, outs) -> str | None:
    n = rows_cols(x, normalized_shape)[1]
    reason = symbolic_decline(N=n)
    if reason:
        return f"normalized size: {reason}"
    if size(n) == 0:
        return "empty normalized shape"
    dtypes = {t.dtype for t in (x, weight, bias) if t is not None}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(map(str, dtypes))}"
    return common_decline([x, weight, bias], [o for o in outs if o is not None])


# -- native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd) --------


def _forward_accepts(args, kwargs, outs):
    x, normalized_shape, weight, bias, _eps = args
    return _decline(x, normalized_shape, weight, bias, outs)


def _forward_params(args, kwargs, outs):
    x, normalized_shape, weight, bias, eps = args
    m, n = rows_cols(x, normalized_shape)
    return {
        "M": size(m), "N": size(n), "eps": float(eps),
        "dtype": ELEMENT_TYPES[x.dtype], "stat_dtype": ELEMENT_TYPES[outs[1].dtype],
        "has_weight": weight is not None, "has_bias": bias is not None,
    }


def _forward_canonical(x, normalized_shape, weight, bias, eps):
    if _is_canonical(x, normalized_shape):
        return NotImplemented
    m, n = rows_cols(x, normalized_shape)
    out, mean, rstd = aten.native_layer_norm.default(
        flat(x, [m, n]), [n], flat(weight, [n]), flat(bias, [n]), eps
    )
    stat_shape = list(x.shape[: x.dim() - len(normalized_shape)]) + [1] * len(normalized_shape)
    return flat(out, list(x.shape)), flat(mean, stat_shape), flat(rstd, stat_shape)


def _sample_forward(shape, dtype, flags):
    n = shape[-1]
    return [random_tensor(shape, dtype, 3.0, 0.5), [n], random_tensor([n], dtype, 1.0, 1.0),
            random_tensor([n], dtype), 1e-5], {}


register(Composite(
    op=aten.native_layer_norm.default,
    accepts=_forward_accepts,
    params=_forward_params,
    reference=decomposition_table[aten.native_layer_norm.default],
    tensor_args=(0, 2, 3),
    flags=1,
    sample=_sample_forward,
    canonical=_forward_canonical,
))


# -- native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
#                               output_mask) -> (dx, dweight, dbias) --------------------------


def _backward_accepts(args, kwargs, outs):
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args
    if mask[1] and weight is None or mask[2] and bias is None:
        return "a gradient asked for an absent weight or bias"
    if not any(mask):
        return "no output asked for"
    if grad.dtype != x.dtype or mean.dtype != rstd.dtype:
        return "mixed dtypes"
    return _decline(x, normalized_shape, weight, bias, outs)


# The row blocks of the column sums for a dynamic M; the rows left over are summed apart.
DYNAMIC_BLOCKS = 64


def column_split(m: int | None) -> int:
    """How many row blocks the column sums (dweight, dbias) are split into: partial sums per
    block run in parallel, then one short reduction adds the blocks. A divisor of m, or for
    a dynamic m (None) DYNAMIC_BLOCKS, with the rest of the rows summed apart."""
    if m is None:
        return DYNAMIC_BLOCKS
    for blocks in (64, 32, 16, 8, 4, 2):
        if m % blocks == 0 and m // blocks >= 8:
            return blocks
    return 1


def _backward_params(args, kwargs, outs):
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args
    m, n = rows_cols(x, normalized_shape)
    return {
        "M": size(m), "N": size(n),
        "dtype": ELEMENT_TYPES[x.dtype], "stat_dtype": ELEMENT_TYPES[mean.dtype],
        "has_weight": weight is not None, "has_bias": bias is not None,
        "output_mask": [bool(b) for b in mask],
        "blocks": column_split(size(m)),
    }


def _backward_canonical(grad, x, normalized_shape, mean, rstd, weight, bias, mask):
    if _is_canonical(x, normalized_shape):
        return NotImplemented
    m, n = rows_cols(x, normalized_shape)
    dx, dw, db = aten.native_layer_norm_backward.default(
        flat(grad, [m, n]), flat(x, [m, n]), [n], flat(mean, [m, 1]), flat(rstd, [m, 1]),
        flat(weight, [n]), flat(bias, [n]), mask,
    )
    return (
        flat(dx, list(x.shape)),
        None if dw is None else flat(dw, list(weight.shape)),
        None if db is None else flat(db, list(bias.shape)),
    )


def _sample_backward(shape, dtype, flags):
    x, normalized, w, b, eps = _sample_forward(shape, dtype, 1)[0]
    _, mean, rstd = aten.native_layer_norm.default(x, normalized, w, b, eps)
    mask = [bool(flags & 2), bool(flags & 4), bool(flags & 8)]
    return [random_tensor(shape, dtype), x, normalized, mean, rstd, w, b, mask], {}


register(Composite(
    op=aten.native_layer_norm_backward.default,
    accepts=_backward_accepts,
    params=_backward_params,
    reference=decomposition_table[aten.native_layer_norm_backward.default],
    tensor_args=(0, 1, 3, 4, 5),
    flags=14,
    sample=_sample_backward,
    canonical=_backward_canonical,
))
