"""RMS norm forward and backward: boo::rms_norm and boo::rms_norm_backward (see ops.py).

Kernels are written for a 2-D input [M, N] normalized over its last dim; `canonical`
reshapes any other call into that form. patterns.py puts these ops into Dynamo's graph in
place of torch.rms_norm calls and of the chains models write by hand (PATTERNS below).
M may be dynamic; N is a constant of the kernels.
"""

from __future__ import annotations

import functools
import operator

import torch

from .. import ops
from ..patterns import Pattern, Wild
from . import (
    ELEMENT_TYPES, Composite, common_decline, flat, random_tensor, register, register_pattern, rows_cols, same, size,
    symbolic_decline,
)
from .layer_norm import column_split

boo = torch.ops.boo
aten = torch.ops.aten


def _is_canonical(x, normalized_shape, weight) -> bool:
    return x.dim() == 2 and len(normalized_shape) == 1 and (weight is None or weight.dim() == 1)


def _decline(x, normalized_shape, weight, outs) -> str | None:
    if not _is_canonical(x, normalized_shape, weight):
        return "not in the kernel's [M, N] form"
    n = rows_cols(x, normalized_shape)[1]
    reason = symbolic_decline(N=n)
    if reason:
        return f"normalized size: {reason}"
    if size(n) == 0:
        return "empty normalized shape"
    return common_decline([x, weight], [o for o in outs if o is not None and size(o.numel()) != 0])


def _type(dtype) -> str | None:
    return None if dtype is None else ELEMENT_TYPES[dtype]


# -- rms_norm(x, normalized_shape, weight, eps, norm_dtype, out_dtype) -> (out, rstd) -------


def _forward_accepts(args, kwargs, outs):
    x, normalized_shape, weight, _eps, norm_dtype, _out_dtype = args
    if norm_dtype is not None and norm_dtype not in ELEMENT_TYPES:
        return f"norm_dtype {norm_dtype}"
    return _decline(x, normalized_shape, weight, outs)


def _forward_params(args, kwargs, outs):
    x, normalized_shape, weight, eps, norm_dtype, _out_dtype = args
    m, n = rows_cols(x, normalized_shape)
    return {"M": size(m), "N": size(n), "eps": float(eps), "dtype": ELEMENT_TYPES[x.dtype],
            "w_dtype": None if weight is None else ELEMENT_TYPES[weight.dtype],
            "norm_dtype": _type(norm_dtype), "out_dtype": ELEMENT_TYPES[outs[0].dtype]}


def _forward_canonical(x, normalized_shape, weight, eps, norm_dtype, out_dtype):
    if _is_canonical(x, normalized_shape, weight):
        return NotImplemented
    m, n = rows_cols(x, normalized_shape)
    out, rstd = boo.rms_norm.default(flat(x, [m, n]), [n], flat(weight, [n]), eps, norm_dtype, out_dtype)
    stat = [*x.shape[: x.dim() - len(normalized_shape)], *([1] * len(normalized_shape))]
    return flat(out, list(x.shape)), flat(rstd, stat)


def _sample_forward(shape, dtype, flags):
    n = shape[-1]
    return [random_tensor(shape, dtype, 2.0), [n], random_tensor([n], dtype, 1.0, 1.0), 1e-6, dtype, dtype], {}


register(Composite(
    op=boo.rms_norm.default,
    accepts=_forward_accepts,
    params=_forward_params,
    reference=ops.rms_norm_reference,
    tensor_args=(0, 2),
    flags=1,
    sample=_sample_forward,
    canonical=_forward_canonical,
))


# -- rms_norm_backward(grad, x, rstd, normalized_shape, weight, norm_dtype) -> (dx, dweight) --


def _backward_accepts(args, kwargs, outs):
    grad, x, rstd, normalized_shape, weight, norm_dtype = args
    if norm_dtype is not None and norm_dtype not in ELEMENT_TYPES:
        return f"norm_dtype {norm_dtype}"
    if rstd.dtype != torch.float32:
        return f"rstd in {rstd.dtype}"
    return _decline(x, normalized_shape, weight, [grad, *outs])


def _backward_params(args, kwargs, outs):
    grad, x, rstd, normalized_shape, weight, norm_dtype = args
    m, n = rows_cols(x, normalized_shape)
    return {"M": size(m), "N": size(n), "dtype": ELEMENT_TYPES[x.dtype], "g_dtype": ELEMENT_TYPES[grad.dtype],
            "w_dtype": None if weight is None else ELEMENT_TYPES[weight.dtype],
            "norm_dtype": _type(norm_dtype), "blocks": column_split(size(m))}


def _backward_canonical(grad, x, rstd, normalized_shape, weight, norm_dtype):
    if _is_canonical(x, normalized_shape, weight):
        return NotImplemented
    m, n = rows_cols(x, normalized_shape)
    dx, dw = boo.rms_norm_backward.default(
        flat(grad, [m, n]), flat(x, [m, n]), flat(rstd, [m, 1]), [n], flat(weight, [n]), norm_dtype
    )
    return flat(dx, list(x.shape)), (dw if weight is None else flat(dw, list(weight.shape)))


def _sample_backward(shape, dtype, flags):
    x, normalized, w, eps, norm_dtype, out_dtype = _sample_forward(shape, dtype, 1)[0]
    _, rstd = ops.rms_norm_reference(x, normalized, w, eps, norm_dtype, out_dtype)
    return [random_tensor(shape, dtype), x, rstd, normalized, w, norm_dtype], {}


register(Composite(
    op=boo.rms_norm_backward.default,
    accepts=_backward_accepts,
    params=_backward_params,
    reference=ops.rms_norm_backward_reference,
    tensor_args=(0, 1, 2, 4),
    flags=6,
    sample=_sample_backward,
    canonical=_backward_canonical,
))


# -- patterns: torch.rms_norm, and the chains Hugging Face models write by hand --------------


def _replacement(graph, x, weight, values, eps, norm_dtype, out_dtype):
    xv, wv = values["inputs"][0], (values["inputs"][1] if weight is not None else None)
    for t in (xv, wv):
        if t is not None and t.dtype not in ELEMENT_TYPES:
            return f"dtype {t.dtype}"
    if norm_dtype is not None and norm_dtype not in ELEMENT_TYPES:
        return f"rounded to {norm_dtype}"
    if xv.dim() == 0:
        return "0-d input"
    n = size(xv.shape[-1])
    if n is None:
        return "symbolic row size (the kernels need it static)"
    if wv is not None and not same(wv.shape, [n]):
        return f"weight of shape {list(wv.shape)} for rows of {n}"
    if values["result"].dtype != out_dtype:
        return f"the chain's result is {values['result'].dtype}, the op's would be {out_dtype}"
    call = graph.call_function(boo.rms_norm.default, (x, [n], weight, float(eps), norm_dtype, out_dtype))
    return graph.call_function(operator.getitem, (call, 0))


def _promoted(*dtypes):
    return functools.reduce(torch.promote_types, dtypes)


def _torch_rms_norm(weighted):
    def search(x, w=None):
        return torch.rms_norm(x, [Wild("n", int)], w if weighted else None, Wild("eps"))

    def replace(graph, inputs, captures, values):
        x, w = inputs[0], (inputs[1] if weighted else None)
        xv = values["inputs"][0]
        if weighted and values["inputs"][1].dtype != xv.dtype:
            return "weight and input dtypes differ (eager takes another path)"
        if not same(captures["n"], xv.shape[-1]):
            return "normalized shape"
        eps = torch.finfo(torch.float32).eps if captures["eps"] is None else captures["eps"]
        return _replacement(graph, x, w, values, eps, None, xv.dtype)

    if not weighted:
        return lambda x: search(x), replace
    return search, replace


def _mul(a, b, swap):
    return b * a if swap else a * b


def _llama(swap_rsqrt, swap_weight):
    """LlamaRMSNorm (and Qwen2, Mistral, ...): normalize in f32, round to the input's dtype,
    then multiply by the weight."""
    def search(x, w):
        h = x.to(torch.float32)
        h = _mul(h, torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + Wild("eps")), swap_rsqrt)
        return _mul(w, h.to(Wild("norm_dtype")), swap_weight)

    def replace(graph, inputs, captures, values):
        norm_dtype = captures["norm_dtype"]
        if not isinstance(norm_dtype, torch.dtype):
            return "cast to a non-dtype"
        out = _promoted(values["inputs"][1].dtype, norm_dtype)
        return _replacement(graph, inputs[0], inputs[1], values, captures["eps"], norm_dtype, out)

    return search, replace


def _t5(swap_rsqrt, swap_weight, cast):
    """T5LayerNorm: the mean of squares in f32, x times rsqrt (promoted to f32), rounded to
    the weight's dtype when that is half precision, times the weight."""
    def search(x, w):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = _mul(x, torch.rsqrt(variance + Wild("eps")), swap_rsqrt)
        if cast:
            h = h.to(Wild("norm_dtype"))
        return _mul(w, h, swap_weight)

    def replace(graph, inputs, captures, values):
        xv, wv = values["inputs"]
        norm_dtype = captures.get("norm_dtype")
        if cast and not isinstance(norm_dtype, torch.dtype):
            return "cast to a non-dtype"
        normalized = _promoted(xv.dtype, torch.float32) if not cast else norm_dtype
        return _replacement(graph, inputs[0], inputs[1], values, captures["eps"],
                            norm_dtype if cast else None, _promoted(wv.dtype, normalized))

    return search, replace


_NAMES = ("rms_norm", "rms_norm_backward")
for _weighted in (True, False):
    register_pattern(Pattern("torch.rms_norm", _NAMES, *_torch_rms_norm(_weighted)))
for _a in (False, True):
    for _b in (False, True):
        register_pattern(Pattern("llama_rms_norm", _NAMES, *_llama(_a, _b)))
        for _cast in (True, False):
            register_pattern(Pattern("t5_layer_norm", _NAMES, *_t5(_a, _b, _cast)))
