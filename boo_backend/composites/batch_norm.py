"""Batch norm: training forward (with running-statistics updates), eval forward, and the
combined backward (dx, dweight, dbias in one kernel; train=True from the saved statistics,
train=False from the running ones).

These are the ops AOTAutograd leaves in graphs of nn.BatchNorm*d: training gives
_native_batch_norm_legit_functional, eval _native_batch_norm_legit_no_training, and both
backwards native_batch_norm_backward. Kernels are written for a 3-D input [N, C, HxW];
`canonical` reshapes any other rank ([N, C], [N, C, D, H, W], ...) into that form.

Driver families: `batch_norm` (-F 1 training forward, -F 14 backward) and `batch_norm_eval`
(-F 1 eval forward): two forward entries in one family would both answer -F 1.

N and HxW may be dynamic; C is a constant of the kernels.
"""

from __future__ import annotations

import math

import torch
from torch._decomp import decomposition_table

from . import (
    ELEMENT_TYPES, Composite, common_decline, flat, random_tensor, register, same, size, sizes, symbolic_decline,
)

aten = torch.ops.aten


def _canonical_shape(x) -> list[int]:
    return [x.shape[0], x.shape[1], math.prod(x.shape[2:])]


def _decline(x, per_channel, outs, empty_ok=False, grad=None) -> str | None:
    if x.dim() < 2:
        return f"input of rank {x.dim()} (batch norm needs [N, C, ...])"
    reason = symbolic_decline(C=x.shape[1])
    if reason:
        return reason
    n, c, hw = _canonical_shape(x)
    if size(c) == 0:
        return "no channels"
    if size(n * hw) == 0 and not empty_ok:
        return "empty batch (eager raises or divides by zero)"
    tensors = [x, grad, *per_channel]
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(map(str, dtypes))}"
    for t in per_channel:
        if t is not None and size(t.numel()) != 0 and not same(t.shape, [c]):
            return f"a per-channel tensor of shape {list(t.shape)} for C={c}"
    return common_decline(tensors, [o for o in outs if o is not None])


def _sample_input(shape, dtype):
    c = shape[1]
    return (random_tensor(shape, dtype, 3.0, 0.5), random_tensor([c], dtype, 1.0, 1.0),
            random_tensor([c], dtype), random_tensor([c], dtype, 0.1),
            random_tensor([c], dtype, 0.1, 1.0).abs())


# -- _native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var,
#        training, momentum, eps) -> (out, save_mean, save_rstd, new_mean, new_var) -----------


def _train_accepts(args, kwargs, outs):
    x, weight, bias, rm, rv, training, _momentum, _eps = args
    if not training:
        return "training=False (eval graphs use _native_batch_norm_legit_no_training)"
    if rm is None or rv is None:
        return "no running statistics"
    return _decline(x, (weight, bias, rm, rv), outs)


def _train_params(args, kwargs, outs):
    x, weight, bias, rm, rv, training, momentum, eps = args
    n, c, hw = sizes(_canonical_shape(x))
    return {
        "N": n, "C": c, "HW": hw, "momentum": float(momentum), "eps": float(eps),
        "dtype": ELEMENT_TYPES[x.dtype], "has_weight": weight is not None, "has_bias": bias is not None,
        # The graph's dtype of the new running statistics: the meta function gives f32 for
        # bf16/f16 input where eager gives the input's dtype.
        "running_dtype": ELEMENT_TYPES[outs[3].dtype],
    }


def _train_canonical(x, weight, bias, rm, rv, training, momentum, eps):
    if x.dim() == 3 or x.dim() < 2:
        return NotImplemented
    out, *rest = aten._native_batch_norm_legit_functional.default(
        flat(x, _canonical_shape(x)), weight, bias, rm, rv, training, momentum, eps
    )
    return (flat(out, list(x.shape)), *rest)


def _sample_train(shape, dtype, flags):
    x, w, b, rm, rv = _sample_input(shape, dtype)
    return [x, w, b, rm, rv, True, 0.1, 1e-5], {}


register(Composite(
    op=aten._native_batch_norm_legit_functional.default,
    accepts=_train_accepts,
    params=_train_params,
    reference=decomposition_table[aten._native_batch_norm_legit_functional.default],
    tensor_args=(0, 1, 2, 3, 4),
    flags=1,
    sample=_sample_train,
    canonical=_train_canonical,
    family_name="batch_norm",
))


# -- _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var,
#        momentum, eps) -> (out, empty, empty) ----------------------------------------------


def _eval_accepts(args, kwargs, outs):
    x, weight, bias, rm, rv, _momentum, _eps = args
    if any(o is not None and o.dim() == 1 and size(o.numel()) != 0 for o in outs[1:]):
        return "saved statistics are not empty"
    return _decline(x, (weight, bias, rm, rv), outs[:1], empty_ok=True)


def _eval_params(args, kwargs, outs):
    x, weight, bias, rm, rv, momentum, eps = args
    n, c, hw = sizes(_canonical_shape(x))
    return {
        "N": n, "C": c, "HW": hw, "eps": float(eps),
        "dtype": ELEMENT_TYPES[x.dtype], "has_weight": weight is not None, "has_bias": bias is not None,
    }


def _eval_canonical(x, weight, bias, rm, rv, momentum, eps):
    if x.dim() == 3 or x.dim() < 2:
        return NotImplemented
    out, mean, rstd = aten._native_batch_norm_legit_no_training.default(
        flat(x, _canonical_shape(x)), weight, bias, rm, rv, momentum, eps
    )
    return flat(out, list(x.shape)), mean, rstd


def _sample_eval(shape, dtype, flags):
    x, w, b, rm, rv = _sample_input(shape, dtype)
    return [x, w, b, rm, rv, 0.1, 1e-5], {}


register(Composite(
    op=aten._native_batch_norm_legit_no_training.default,
    accepts=_eval_accepts,
    params=_eval_params,
    reference=decomposition_table[aten._native_batch_norm_legit_no_training.default],
    tensor_args=(0, 1, 2, 3, 4),
    flags=1,
    sample=_sample_eval,
    canonical=_eval_canonical,
    family_name="batch_norm_eval",
))


# -- native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
#        save_invstd, train, eps, output_mask) -> (dx, dweight, dbias) -----------------------


def _backward_accepts(args, kwargs, outs):
    grad, x, weight, rm, rv, sm, si, train, _eps, mask = args
    if not any(mask):
        return "no output asked for"
    if mask[1] and weight is None:
        return "dweight asked for an absent weight"
    used = (sm, si) if train else (rm, rv)
    if any(t is None or t.dim() != 1 or size(t.numel()) == 0 for t in used):
        return f"train={train} without its statistics"
    if not same(grad.shape, x.shape):
        return "grad_out and input shapes differ"
    return _decline(x, (weight, rm, rv, sm, si), outs, grad=grad)


def _backward_params(args, kwargs, outs):
    grad, x, weight, rm, rv, sm, si, train, eps, mask = args
    n, c, hw = sizes(_canonical_shape(x))
    return {
        "N": n, "C": c, "HW": hw, "dtype": ELEMENT_TYPES[x.dtype], "train": bool(train),
        "eps": float(eps), "has_weight": weight is not None,
        "stat_sizes": [None if t is None else size(t.numel()) for t in (rm, rv, sm, si)],
        # The results the node has: the meta function gives dx even where output_mask[0] is
        # False (eager then returns None), and the kernel must return every one it has.
        "output_mask": [o is not None for o in outs],
    }


def _backward_canonical(grad, x, weight, rm, rv, sm, si, train, eps, mask):
    if x.dim() == 3 or x.dim() < 2:
        return NotImplemented
    shape = _canonical_shape(x)
    dx, dw, db = aten.native_batch_norm_backward.default(
        flat(grad, shape), flat(x, shape), weight, rm, rv, sm, si, train, eps, mask
    )
    return flat(dx, list(x.shape)), dw, db


def _sample_backward(shape, dtype, flags):
    x, w, b, rm, rv = _sample_input(shape, dtype)
    _, sm, si, _, _ = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
    mask = [bool(flags & 2), bool(flags & 4), bool(flags & 8)]
    return [random_tensor(shape, dtype), x, w, rm, rv, sm, si, True, 1e-5, mask], {}


register(Composite(
    op=aten.native_batch_norm_backward.default,
    accepts=_backward_accepts,
    params=_backward_params,
    reference=decomposition_table[aten.native_batch_norm_backward.default],
    tensor_args=(0, 1, 2, 3, 4, 5, 6),
    flags=14,
    sample=_sample_backward,
    canonical=_backward_canonical,
    family_name="batch_norm",
))
