"""GELU forward and backward, approximate="none" and "tanh". Elementwise: any dim may be
dynamic."""

from __future__ import annotations

import math

import torch
from torch._decomp import decomposition_table

from ..patterns import Pattern
from . import ELEMENT_TYPES, Composite, common_decline, random_tensor, register, register_pattern, sizes

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
        "shape": sizes(out.shape),
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


# -- pattern: the tanh formula written out (GPT-2's NewGELUActivation) ----------------------


def _new_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _to_gelu_tanh(graph, inputs, captures, values):
    (x,), (xv,) = inputs, values["inputs"]
    if xv.dtype not in ELEMENT_TYPES or values["result"].dtype != xv.dtype:
        return f"dtype {xv.dtype} -> {values['result'].dtype}"
    return graph.call_function(torch.nn.functional.gelu, (x,), {"approximate": "tanh"})


register_pattern(Pattern("gelu_tanh_written_out", ("gelu", "gelu_backward"), _new_gelu, _to_gelu_tanh))
