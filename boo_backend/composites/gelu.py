"""GELU forward and backward, approximate="none" and "tanh"."""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from . import ELEMENT_TYPES, Composite, common_decline, random_tensor, register

aten = torch.ops.aten


def _approximate(kwargs) -> str:
    return kwargs.get("approximate", "none")


def _accepts(args, kwargs, outs):
    if _approximate(kwargs) not in ("none", "tanh"):
        return f"approximate={_approximate(kwargs)!r}"
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len({t.dtype for t in tensors}) != 1:
        return "mixed dtypes"
    return common_decline(tensors, list(outs))


def _params(args, kwargs, outs):
    out = outs[0]
    return {
        "approximate": _approximate(kwargs),
        "shape": list(out.shape),
        "dtype": ELEMENT_TYPES[out.dtype],
    }


def _sample_forward(shape, dtype, flags):
    return [random_tensor(shape, dtype, 2.0)], {"approximate": "none"}


def _sample_backward(shape, dtype, flags):
    return [random_tensor(shape, dtype), random_tensor(shape, dtype, 2.0)], {"approximate": "none"}


register(Composite(
    op=aten.gelu.default,
    accepts=_accepts,
    params=_params,
    reference=decomposition_table[aten.gelu.default],
    tensor_args=(0,),
    flags=1,
    sample=_sample_forward,
))

register(Composite(
    op=aten.gelu_backward.default,
    accepts=_accepts,
    params=_params,
    reference=decomposition_table[aten.gelu_backward.default],
    tensor_args=(0, 1),
    flags=2,
    sample=_sample_backward,
))
