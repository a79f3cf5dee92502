"""Group norm forward and the combined backward (dx, dweight, dbias in one kernel).

Kernels are written for a 3-D input [N, C, HxW]; `canonical` reshapes any other rank
([N, C], [N, C, H, W], ...) into that form. Inside, the kernels view it as [N, G, C/G, HxW].
Statistics (mean, rstd) are [N, G] in the input's dtype, as eager gives them. N and HxW may
be dynamic; C and the group count are constants of the kernels (the groups' layout).
"""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from . import ELEMENT_TYPES, Composite, common_decline, flat, random_tensor, register, same, size, symbolic_decline

aten = torch.ops.aten


def _decline(x, n, c, hxw, group, tensors, outs) -> str | None:
    reason = symbolic_decline(C=c, group=group)
    if reason:
        return reason
    c, group = size(c), size(group)
    if group <= 0 or c % group:
        return f"group={group} does not divide C={c}"
    if c == 0 or size(hxw) == 0:
        return "empty groups"
    if not same(x.shape[:2], [n, c]) or not same(x.numel(), n * c * hxw):
        return f"input {list(x.shape)} is not [N={n}, C={c}, HxW={hxw}]"
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(map(str, dtypes))}"
    return common_decline(list(tensors), [o for o in outs if o is not None])


# -- native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd) ------


def _forward_accepts(args, kwargs, outs):
    x, weight, bias, n, c, hxw, group, _eps = args
    return _decline(x, n, c, hxw, group, (x, weight, bias), outs)


def _forward_params(args, kwargs, outs):
    x, weight, bias, n, c, hxw, group, eps = args
    return {
        "N": size(n), "C": size(c), "HW": size(hxw), "G": size(group), "eps": float(eps),
        "dtype": ELEMENT_TYPES[x.dtype], "stat_dtype": ELEMENT_TYPES[outs[1].dtype],
        "has_weight": weight is not None, "has_bias": bias is not None,
    }


def _forward_canonical(x, weight, bias, n, c, hxw, group, eps):
    if x.dim() == 3:
        return NotImplemented
    out, mean, rstd = aten.native_group_norm.default(
        flat(x, [n, c, hxw]), weight, bias, n, c, hxw, group, eps
    )
    return flat(out, list(x.shape)), mean, rstd


def _groups(c: int) -> int:
    """The driver's group count: 32 (as in most models) where it divides C."""
    for g in (32, 16, 8, 4, 2):
        if c % g == 0:
            return g
    return 1


def _sample_forward(shape, dtype, flags):
    n, c = shape[0], shape[1]
    hxw = 1
    for s in shape[2:]:
        hxw *= s
    return [random_tensor(shape, dtype, 3.0, 0.5), random_tensor([c], dtype, 1.0, 1.0),
            random_tensor([c], dtype), n, c, hxw, _groups(c), 1e-5], {}


register(Composite(
    op=aten.native_group_norm.default,
    accepts=_forward_accepts,
    params=_forward_params,
    reference=decomposition_table[aten.native_group_norm.default],
    tensor_args=(0, 1, 2),
    flags=1,
    sample=_sample_forward,
    canonical=_forward_canonical,
    family_name="group_norm",
))


# -- native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group,
#                               output_mask) -> (dx, dweight, dbias) ---------------------------


def _backward_accepts(args, kwargs, outs):
    grad, x, mean, rstd, weight, n, c, hxw, group, mask = args
    if mask[1] and weight is None:
        return "dweight asked for an absent weight"
    if not any(mask):
        return "no output asked for"
    if grad.dtype != x.dtype or mean.dtype != rstd.dtype:
        return "mixed dtypes"
    if not same(grad.shape, x.shape):
        return "grad_out and input shapes differ"
    if not same(mean.shape, [n, group]) or not same(rstd.shape, [n, group]):
        return f"mean/rstd {list(mean.shape)} are not [N, group]"
    return _decline(x, n, c, hxw, group, (grad, x, weight), outs)


def _backward_params(args, kwargs, outs):
    grad, x, mean, rstd, weight, n, c, hxw, group, mask = args
    return {
        "N": size(n), "C": size(c), "HW": size(hxw), "G": size(group),
        "dtype": ELEMENT_TYPES[x.dtype], "stat_dtype": ELEMENT_TYPES[mean.dtype],
        "has_weight": weight is not None,
        "output_mask": [bool(b) for b in mask],
    }


def _backward_canonical(grad, x, mean, rstd, weight, n, c, hxw, group, mask):
    if x.dim() == 3:
        return NotImplemented
    dx, dw, db = aten.native_group_norm_backward.default(
        flat(grad, [n, c, hxw]), flat(x, [n, c, hxw]), mean, rstd, weight, n, c, hxw, group, mask
    )
    return flat(dx, list(x.shape)), dw, db


def _sample_backward(shape, dtype, flags):
    x, w, b, n, c, hxw, group, eps = _sample_forward(shape, dtype, 1)[0]
    _, mean, rstd = aten.native_group_norm.default(x, w, b, n, c, hxw, group, eps)
    mask = [bool(flags & 2), bool(flags & 4), bool(flags & 8)]
    return [random_tensor(shape, dtype), x, mean, rstd, w, n, c, hxw, group, mask], {}


register(Composite(
    op=aten.native_group_norm_backward.default,
    accepts=_backward_accepts,
    params=_backward_params,
    reference=decomposition_table[aten.native_group_norm_backward.default],
    tensor_args=(0, 1, 2, 3, 4),
    flags=14,
    sample=_sample_backward,
    canonical=_backward_canonical,
    family_name="group_norm",
))
