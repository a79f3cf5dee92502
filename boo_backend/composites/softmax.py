"""Softmax and log-softmax, forward and backward, over any dim (half_to_float included).

Kernels are written for a 3-D input [M, N, K] reduced over N (the dim), with M the dims
before it and K the dims after, or [M, N] over N when K is 1; `canonical` reshapes any other
call into that form. M, N and K may each be dynamic.
"""

from __future__ import annotations

import math

import torch
from torch._decomp import decomposition_table

from . import ELEMENT_TYPES, Composite, common_decline, random_tensor, register, same, size

aten = torch.ops.aten


def _split(shape, dim) -> tuple[int, int, int]:
    """[M, N, K] for a reduction over `dim` of `shape` (a 0-d tensor is [1, 1, 1])."""
    if not shape:
        return 1, 1, 1
    dim = dim % len(shape)
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])


def _canonical_shape(shape, dim) -> list:
    m, n, k = _split(shape, dim)
    return [m, n] if size(k) == 1 else [m, n, k]


def _is_canonical(t, dim) -> bool:
    return same(list(t.shape), _canonical_shape(list(t.shape), dim)) and dim in (1, 1 - t.dim())


def _canonical(op, tensors, dim, rest):
    """Call `op` on `tensors` reshaped to the kernel's form over dim 1, and reshape its
    result back; NotImplemented when they are in that form already."""
    shape = list(tensors[0].shape)
    if _is_canonical(tensors[0], dim):
        return NotImplemented
    out = op(*[aten.reshape.default(t, _canonical_shape(shape, dim)) for t in tensors], 1, rest)
    return aten.reshape.default(out, shape)


def _accepts(tensors, dim, outs):
    if not _is_canonical(tensors[0], dim):
        return "not in the kernel's form ([M, N] or [M, N, K] over dim 1)"
    return common_decline(tensors, outs)


def _params(x, dim, outs, log):
    m, n, k = _split(list(x.shape), dim)
    return {"M": size(m), "N": size(n), "K": size(k), "log": log,
            "dtype": ELEMENT_TYPES[x.dtype], "out_dtype": ELEMENT_TYPES[outs[0].dtype]}


# -- _softmax(self, dim, half_to_float) / _log_softmax(...) --------------------------------


def _forward_accepts(args, kwargs, outs):
    return _accepts([args[0]], args[1], outs)


def _forward_entry(op, log):
    def params(args, kwargs, outs):
        return _params(args[0], args[1], outs, log)

    def canonical(x, dim, half_to_float):
        return _canonical(op, [x], dim, half_to_float)

    def sample(shape, dtype, flags):
        return [random_tensor(shape, dtype, 3.0), -1, False], {}

    return Composite(op=op, accepts=_forward_accepts, params=params,
                     reference=decomposition_table[op], tensor_args=(0,), flags=1, sample=sample,
                     canonical=canonical, family_name="log_softmax" if log else "softmax")


# -- _softmax_backward_data(grad_output, output, dim, input_dtype) / the log_softmax twin ----


def _backward_accepts(args, kwargs, outs):
    grad, out = args[0], args[1]
    if grad.dtype != out.dtype:
        return "grad and output dtypes differ"
    return _accepts([grad, out], args[2], outs)


def _backward_entry(op, forward, log):
    def params(args, kwargs, outs):
        return _params(args[0], args[2], outs, log)

    def canonical(grad, out, dim, input_dtype):
        return _canonical(op, [grad, out], dim, input_dtype)

    def sample(shape, dtype, flags):
        y = forward(random_tensor(shape, dtype, 3.0), -1, False)
        return [random_tensor(shape, dtype), y, -1, dtype], {}

    return Composite(op=op, accepts=_backward_accepts, params=params,
                     reference=decomposition_table[op], tensor_args=(0, 1), flags=2, sample=sample,
                     canonical=canonical, family_name="log_softmax" if log else "softmax")


register(_forward_entry(aten._softmax.default, log=False))
register(_forward_entry(aten._log_softmax.default, log=True))
register(_backward_entry(aten._softmax_backward_data.default, aten._softmax.default, log=False))
register(_backward_entry(aten._log_softmax_backward_data.default, aten._log_softmax.default, log=True))


# -- logsumexp(self, dim, keepdim) over one dim -------------------------------------------
# The kernel takes x[M, N] over N with keepdim; `canonical` moves the reduced dim last and
# flattens the rest. Static sizes only, none of them 0. torch-mlir cannot lower logsumexp,
# so `canonical` gives a call the kernel cannot take torch's decomposition (with keepdim,
# then reshaped: its squeeze.dims would be one more op torch-mlir cannot lower).


def _lse_dim(x, dims) -> int | None:
    return dims[0] % max(x.dim(), 1) if isinstance(dims, (list, tuple)) and len(dims) == 1 else None


def _lse_decline(x, dims) -> str | None:
    if _lse_dim(x, dims) is None:
        return "not over exactly one dim"
    if not all(isinstance(n, int) for n in x.shape) or 0 in x.shape:
        return "symbolic or zero sizes"
    return None


def _lse_accepts(args, kwargs, outs):
    x, dims = args[0], args[1]
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    reason = _lse_decline(x, dims)
    if reason:
        return reason
    if not (x.dim() == 2 and _lse_dim(x, dims) == 1 and keepdim):
        return "not in the kernel's form ([M, N] over dim 1, keepdim)"
    return common_decline([x], outs)


def _lse_params(args, kwargs, outs):
    x = args[0]
    return {"M": size(x.shape[0]), "N": size(x.shape[1]), "K": 1,
            "dtype": ELEMENT_TYPES[x.dtype], "out_dtype": ELEMENT_TYPES[outs[0].dtype]}


def _lse_canonical(x, dims, keepdim=False):
    dim = _lse_dim(x, dims)
    if dim is not None and x.dim() == 2 and dim == 1 and keepdim and x.dtype in ELEMENT_TYPES:
        return NotImplemented
    if not dims:  # every dim
        return decomposition_table[aten.logsumexp.default](x, dims, keepdim)
    reduced = {d % x.dim() for d in dims} if x.dim() else set()
    shape = [1 if i in reduced else n for i, n in enumerate(x.shape) if keepdim or i not in reduced]
    if _lse_decline(x, dims) or x.dtype not in ELEMENT_TYPES:
        out = decomposition_table[aten.logsumexp.default](x, dims, True)
    else:
        n = x.shape[dim] if x.dim() else 1
        out = aten.logsumexp.default(aten.reshape.default(aten.movedim.int(x, dim, -1), [x.numel() // n, n]), [1], True)
    return aten.reshape.default(out, shape)


def _lse_sample(shape, dtype, flags):
    return [random_tensor(shape, dtype, 3.0), [-1], True], {}


register(Composite(op=aten.logsumexp.default, accepts=_lse_accepts, params=_lse_params,
                   reference=decomposition_table[aten.logsumexp.default], tensor_args=(0,), flags=1,
                   sample=_lse_sample, canonical=_lse_canonical))
