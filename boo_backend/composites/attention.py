"""Scaled dot-product attention as the CPU flash ops that SDPA reaches after AOTAutograd:
the forward (output and log-sum-exp) and the backward (dq, dk, dv in one kernel).

Inputs are [B, H, L, D] queries and [B, Hk, S, D] keys and values; Hk divides H (grouped-
query heads: query head h reads key head h // (H // Hk)). Masks are additive float masks of
q's dtype, 2-D [L, S] or 4-D broadcastable to [B, H, L, S] (SDPA turns boolean masks into
such a float mask before the op); `is_causal` aligns to the top left. No dropout.

B, L and S (batch and sequence lengths) may be dynamic, and with them the mask's dims along
them; H, Hk, D and Dv are constants of the kernels (their layout and contractions).
"""

from __future__ import annotations

import math

import torch

from ..decompositions import FALLBACK
from ..patterns import Pattern, Wild
from . import (
    ELEMENT_TYPES, Composite, common_decline, random_tensor, register, register_pattern, same, same_assumed,
    size, sizes, symbolic_decline,
)

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask_decline(mask, q, k) -> str | None:
    if mask is None:
        return None
    if mask.dtype != q.dtype:
        return f"attn_mask of dtype {mask.dtype} with {q.dtype} inputs (the op takes q's dtype)"
    if mask.dim() not in (2, 4):
        return f"attn_mask of rank {mask.dim()} (2 or 4 taken)"
    full = [q.shape[0], q.shape[1], q.shape[2], k.shape[2]][4 - mask.dim():]
    if any(size(m) != 1 and not same(m, f) for m, f in zip(mask.shape, full)):
        return f"attn_mask {list(mask.shape)} does not broadcast to {full}"
    return None


def _decline(q, k, v, dropout_p, mask, tensors, outs) -> str | None:
    """What the kernels share: 4-D inputs of one dtype, grouped heads, no dropout."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (dropout is left to the decomposition)"
    reason = common_decline([*tensors, mask], outs)
    if reason:
        return reason
    if any(t.dim() != 4 for t in (q, k, v)):
        return "inputs not 4-D [B, H, L, D]"
    if len({t.dtype for t in tensors}) != 1:
        return f"mixed dtypes {sorted({str(t.dtype) for t in tensors})}"
    reason = symbolic_decline(H=q.shape[1], Hk=k.shape[1], D=q.shape[3], Dv=v.shape[3])
    if reason:
        return f"heads: {reason}"
    h, hk, d, dv = sizes([q.shape[1], k.shape[1], q.shape[3], v.shape[3]])
    # the key and value lengths: a decoder's caches hold them as two symbols, assumed equal
    if hk == 0 or h % hk or not same_assumed(k.shape[:3], v.shape[:3]) or not same(q.shape[0], k.shape[0]):
        return f"heads or sizes do not fit: q={list(q.shape)} k={list(k.shape)} v={list(v.shape)}"
    if d != size(k.shape[3]):
        return f"q and k head dims differ: {d} vs {k.shape[3]}"
    if size(k.shape[2]) == 0 or d == 0 or dv == 0:
        return "no keys or an empty head dim"
    return _mask_decline(mask, q, k)


def _params(q, k, v, is_causal, mask, scale) -> dict:
    b, h, lq, d = sizes(q.shape)
    return {
        "B": b, "H": h, "Hk": size(k.shape[1]), "L": lq, "S": size(k.shape[2]), "D": d, "Dv": size(v.shape[3]),
        "dtype": ELEMENT_TYPES[q.dtype],
        "scale": float(scale) if scale is not None else 1.0 / math.sqrt(d),
        "is_causal": bool(is_causal),
        # A dim of 1 broadcasts; any other (None when dynamic) is the full dim.
        "mask_shape": None if mask is None else [1] * (4 - mask.dim()) + sizes(mask.shape),
        "mask_rank": None if mask is None else mask.dim(),
    }


# -- _scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, *,
#                                                 attn_mask, scale) -> (output, logsumexp) ----


def _forward_accepts(args, kwargs, outs):
    q, k, v, dropout_p, _causal, mask, _scale = args
    return _decline(q, k, v, dropout_p, mask, [q, k, v], list(outs))


def _forward_params(args, kwargs, outs):
    q, k, v, _dropout_p, is_causal, mask, scale = args
    return _params(q, k, v, is_causal, mask, scale)


def _sample_forward(shape, dtype, flags):
    b, h, lq, d = shape
    return [random_tensor(shape, dtype), random_tensor(shape, dtype), random_tensor(shape, dtype)], {}


register(Composite(
    op=FORWARD,
    accepts=_forward_accepts,
    params=_forward_params,
    reference=FALLBACK[FORWARD],
    tensor_args=(0, 1, 2, 5),
    flags=1,
    sample=_sample_forward,
    family_name="attention",
))


# -- _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out,
#        logsumexp, dropout_p, is_causal, *, attn_mask, scale) -> (grad_q, grad_k, grad_v) ----


def _backward_accepts(args, kwargs, outs):
    grad, q, k, v, out, lse, dropout_p, _causal, mask, _scale = args
    if lse.dtype != torch.float32 or not same(lse.shape, q.shape[:3]):
        return f"logsumexp {lse.dtype} {list(lse.shape)} (f32 [B, H, L] taken)"
    if not same(grad.shape, out.shape) or not same(out.shape, [*q.shape[:3], v.shape[3]]):
        return f"grad_out {list(grad.shape)} or out {list(out.shape)} does not fit q and v"
    return _decline(q, k, v, dropout_p, mask, [grad, q, k, v, out], [o for o in outs if o is not None])


def _backward_params(args, kwargs, outs):
    _grad, q, k, v, _out, _lse, _dropout_p, is_causal, mask, scale = args
    return _params(q, k, v, is_causal, mask, scale)


def _sample_backward(shape, dtype, flags):
    q, k, v = _sample_forward(shape, dtype, 1)[0]
    out, lse = FORWARD(q, k, v)
    return [random_tensor(shape, dtype), q, k, v, out, lse, 0.0, False], {}


register(Composite(
    op=BACKWARD,
    accepts=_backward_accepts,
    params=_backward_params,
    reference=FALLBACK[BACKWARD],
    tensor_args=(0, 1, 2, 3, 4, 5, 8),
    flags=2,
    sample=_sample_backward,
    family_name="attention",
))


# -- pattern: attention written out (Hugging Face's eager_attention_forward) -----------------


def _eager_attention(masked, dropout):
    """matmul(q, k^T) * scale [+ mask], softmax in f32, back to q's dtype, [dropout,] @ v."""
    def search(q, k, v, mask=None):
        scores = torch.matmul(q, k.transpose(2, 3)) * Wild("scale")
        if masked:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(Wild("dtype"))
        if dropout:
            weights = torch.nn.functional.dropout(weights, p=Wild("p"), training=Wild("training"))
        return torch.matmul(weights, v)

    def replace(graph, inputs, captures, values):
        q, k, v = values["inputs"][:3]
        if captures["dtype"] != q.dtype or not (q.dtype == k.dtype == v.dtype) or q.dtype not in ELEMENT_TYPES:
            return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} cast to {captures['dtype']}"
        if dropout and captures["p"] != 0.0 and captures["training"] is not False:
            return "dropout in training"
        if not (q.dim() == k.dim() == v.dim() == 4) or k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
            return "not [B, H, L, D] inputs with as many key heads"
        if masked and values["inputs"][3].dtype not in (q.dtype, torch.float32):
            return f"mask of dtype {values['inputs'][3].dtype}"
        kwargs = {"scale": float(captures["scale"])}
        if masked:
            kwargs["attn_mask"] = inputs[3]
        return graph.call_function(torch.nn.functional.scaled_dot_product_attention, tuple(inputs[:3]), kwargs)

    if masked:
        return search, replace
    return (lambda q, k, v: search(q, k, v)), replace


for _masked in (True, False):
    for _dropout in (True, False):
        register_pattern(Pattern("eager_attention", ("_scaled_dot_product_flash_attention_for_cpu",
                                                     "_scaled_dot_product_flash_attention_for_cpu_backward"),
                                 *_eager_attention(_masked, _dropout)))
