"""Pooling rewritten for torch-mlir: average pooling with ceil_mode (a pre-lowering rewrite)
and the pooling backwards torch-mlir knows but does not lower (FALLBACK entries), adaptive
average pooling's and replicate padding's among them. A leaf:
imports nothing from boo_backend. Every size may be symbolic, so divisors and crops are
tensor ops and sym_min/sym_max, never Python tests that would become guards.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _spatial(v, nd: int, default=None) -> tuple:
    """A pooling size argument as one int per spatial dim (an int or a 1-element list
    stands for all of them; an empty stride means the kernel's)."""
    v = default if v is None or (not isinstance(v, int) and len(v) == 0) else v
    if isinstance(v, int):
        return (v,) * nd
    return tuple(v) * nd if len(v) == 1 else tuple(v)


def _window_sizes(out, size, k: int, s: int, p: int, include_pad: bool, like: torch.Tensor):
    """Per output position along one dim, the number of input positions its window divides
    by (ATen's rule: the window clipped to the padded input, and to the input itself unless
    include_pad), as a float tensor of length `out`. Computed with tensor ops, not built
    from a Python list: a constant tensor traces to a copy and a detach_, which torch-mlir
    does not lower, and the sizes may be symbolic."""
    start = torch.arange(out, dtype=torch.int64, device=like.device) * s - p
    end = torch.clamp_max(start + k, size + p)
    if not include_pad:
        start, end = torch.clamp_min(start, 0), torch.clamp_max(end, size)
    return (end - start).to(like.dtype)


def _divisors(out, size, k, s, p, include_pad: bool, like: torch.Tensor):
    """Each output position's divisor over all spatial dims: the product of _window_sizes,
    shaped to broadcast over the output's spatial dims."""
    nd, divisor = len(k), None
    for i in range(nd):
        w = _window_sizes(out[i], size[i], k[i], s[i], p[i], include_pad, like)
        w = w.reshape([-1] + [1] * (nd - 1 - i))
        divisor = w if divisor is None else divisor * w
    return divisor


def _far_pads(extra) -> list:
    """constant_pad_nd's list (last dim first) that pads each spatial dim by `extra` at its end."""
    return [e for ex in reversed(extra) for e in (0, ex)]


def ceil_mode_avg_pool(nd: int, x, kernel_size, stride=(), padding=0, ceil_mode=False,
                       count_include_pad=True, divisor_override=None):
    """Average pooling with ceil_mode as pooling without it: the input padded with zeros on
    the far side so that the last, partial window fits, each window's sum divided by the
    count ATen divides by (_window_sizes). torch-mlir's ceil_mode lowering is wrong with
    symbolic sizes (it reads past the input) and fails to compile where a stride is 1;
    this form is right for both. Half types are summed in float32."""
    if not ceil_mode:
        return NotImplemented
    k, s, p = _spatial(kernel_size, nd), _spatial(stride, nd, kernel_size), _spatial(padding, nd)
    unbatched = x.dim() == nd + 1
    xf = x.unsqueeze(0) if unbatched else x
    xf = xf.to(torch.float32 if xf.dtype in (torch.float16, torch.bfloat16) else xf.dtype)
    size = xf.shape[2:]
    # ATen's output size: rounded up, less a last window that would start in the padding
    out = [torch.sym_min((n + 2 * pi - ki + st - 1) // st + 1, (n + pi - 1) // st + 1)
           for n, ki, st, pi in zip(size, k, s, p)]
    # A window is cut to the padded input's length where it is longer (EfficientNet's pooler:
    # a 2560-wide window with ceil_mode over 1 x 1 planes, which padded to 2560 x 2560 asked
    # for 134 GB): each window starts at or after -p, so it still reaches the input's end,
    # and the sums are the same. Symbolic sizes keep the kernel (it must be a constant).
    cut = [min(ki, n + 2 * pi) if isinstance(n, int) else ki for n, ki, pi in zip(size, k, p)]
    extra = [torch.sym_max((o - 1) * st + ki - n - 2 * pi, 0) for o, n, ki, st, pi in zip(out, size, cut, s, p)]
    padded = aten.constant_pad_nd.default(xf, _far_pads(extra), 0.0)
    pool = aten.avg_pool2d.default if nd == 2 else aten.avg_pool3d.default
    sums = pool(padded, cut, list(s), list(p), False, True) * math.prod(cut)
    sums = sums[(slice(None), slice(None)) + tuple(slice(0, o) for o in out)]
    if divisor_override:
        avg = sums / divisor_override
    else:
        avg = sums / _divisors(out, size, k, s, p, count_include_pad, sums)
    avg = avg.to(x.dtype)
    return avg.squeeze(0) if unbatched else avg


# Windows of more positions than this spread their gradients by prefix sums, not by a
# convolution with a ones kernel, whose cost grows with the window: EfficientNet's pooler
# (a 256 x 256 window with ceil_mode over 2 x 2 planes) made a convolution of 3e12 flops.
_CONVOLVED_WINDOW = 64


def _spread_by_prefix_sums(grad, size, k, s, p):
    """The input gradient of average pooling from `grad` (each output's, already divided by
    its divisor), one spatial dim at a time: an input position gets the sum over the
    windows that hold it, a difference of two prefix sums over the output positions (the
    first window that reaches it, from ceil((q - k + 1) / s), to the last that starts at or
    before it, floor(q / s), for q its padded position)."""
    compute = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    g = grad.to(compute)
    for d in range(len(k)):
        dim = 2 + d
        o = g.shape[dim]
        q = torch.arange(size[d], dtype=torch.int64, device=g.device) + p[d]
        first = torch.div(q - k[d] + s[d], s[d], rounding_mode="floor").clamp(0, o)
        last = torch.div(q, s[d], rounding_mode="floor").clamp(max=o - 1)
        sums = torch.cat([torch.zeros_like(g.narrow(dim, 0, 1)), torch.cumsum(g, dim)], dim)
        spread = sums.index_select(dim, last + 1) - sums.index_select(dim, first)
        shape = [1] * g.dim()
        shape[dim] = -1
        g = torch.where((last >= first).reshape(shape), spread, torch.zeros_like(spread))
    return g.to(grad.dtype)


def avg_pool_backward(nd: int, grad_out, x, kernel_size, stride, padding, ceil_mode,
                      count_include_pad, divisor_override=None):
    """Each output gradient, divided by its window's divisor, spread over its window: the
    transposed convolution with a ones kernel, written as zeros inserted between the
    gradients (stride) and a convolution (torch-mlir lowers no grouped transposed one),
    cropped to the unpadded input. For 2 and 3 spatial dims (avg_pool1d's backward goes
    through 2d). torch._decomp lists avg_pool2d_backward among core ATen's decompositions
    but has no entry for it, nor for avg_pool3d_backward."""
    k, s, p = _spatial(kernel_size, nd), _spatial(stride, nd, kernel_size), _spatial(padding, nd)
    unbatched = x.dim() == nd + 1
    if unbatched:
        grad_out, x = grad_out.unsqueeze(0), x.unsqueeze(0)
    n, c, size, out = x.shape[0], x.shape[1], x.shape[2:], grad_out.shape[2:]
    if divisor_override:
        grad = grad_out / divisor_override
    else:
        grad = grad_out / _divisors(out, size, k, s, p, count_include_pad, grad_out)
    if math.prod(k) > _CONVOLVED_WINDOW:
        out_grad = _spread_by_prefix_sums(grad, size, k, s, p)
        return out_grad.squeeze(0) if unbatched else out_grad
    # zeros between the gradients: each output position becomes a run of s[i] positions
    interleaved = [n, c]
    for o in out:
        interleaved += [o, 1]
    pad = []
    for si in reversed(s):
        pad += [0, si - 1, 0, 0]
    spread = aten.constant_pad_nd.default(grad.reshape(interleaved), pad[:-2])
    spread = spread.reshape([n, c] + [o * si for o, si in zip(out, s)])
    spread = spread[(slice(None), slice(None)) + tuple(slice(0, (o - 1) * si + 1) for o, si in zip(out, s))]
    spread = aten.constant_pad_nd.default(spread, [e for ki in reversed(k) for e in (ki - 1, ki - 1)], 0.0)
    # channels folded into the batch: torch-mlir lowers no grouped (depthwise) 3d convolution
    ones = torch.ones([1, 1, *k], dtype=grad.dtype, device=grad.device)
    planes = spread.reshape([n * c, 1, *spread.shape[2:]])
    full = aten.convolution.default(planes, ones, None, [1] * nd, [0] * nd, [1] * nd, False, [0] * nd, 1)
    full = full.reshape([n, c, *full.shape[2:]])
    # `full` covers the padded input from its first corner; positions past the last window get 0.
    # (sym_max and a pad of 0 rather than a test: sizes may be symbolic, and a test a guard)
    extra = [torch.sym_max(pi + si - fi, 0) for pi, si, fi in zip(p, size, full.shape[2:])]
    full = aten.constant_pad_nd.default(full, _far_pads(extra), 0.0)
    out_grad = full[(slice(None), slice(None)) + tuple(slice(pi, pi + si) for pi, si in zip(p, size))]
    return out_grad.squeeze(0) if unbatched else out_grad


def unbatched(x, *args, **kwargs) -> bool:
    """Whether a 2d pooling's input has no batch dim (avg_pool1d's goes through 2d so)."""
    return isinstance(x, torch.Tensor) and x.dim() == 3


def batched(op):
    """2d pooling `op` of an input with no batch dim as of a batch of one: torch-mlir lowers
    avg_pool2d of 4-d inputs only, and the unbatched call ran as an eager island."""

    def rewrite(x, *args, **kwargs):
        if not unbatched(x):
            return NotImplemented
        return op(x.unsqueeze(0), *args, **kwargs).squeeze(0)

    return rewrite


def max_pool_backward_at_indices(nd: int, grad_out, x, indices):
    """Each output gradient added at the input position its maximum came from: `indices`
    count within each channel's flattened spatial dims. torch-mlir lowers max_pool2d's
    backward but not the 3d one, nor adaptive max pooling's."""
    planes = list(x.shape[:-nd])
    numel = math.prod(x.shape[-nd:])
    grad = torch.zeros(planes + [numel], dtype=grad_out.dtype, device=grad_out.device)
    # dim counted from the front: torch-mlir's scatter lowering crashes on a negative one
    grad = grad.scatter_add(len(planes), indices.reshape(planes + [-1]), grad_out.reshape(planes + [-1]))
    return grad.reshape(x.shape)


def adaptive_max_pool(nd: int, x, output_size):
    """Adaptive max pooling over the last `nd` dims, with eager's indices (into each plane's
    flattened spatial dims): every window read as ceil(size / out) + 1 positions from its
    start, those past its end clamped to its last (a repeat after the original cannot win
    the first maximum), then one max over each window's positions in row-major order, as
    eager scans it. torch-mlir's lowering fails to compile where windows overlap unevenly (6
    into 4) and cannot take symbolic sizes, so a model compiled once per shape."""
    spatial, out = list(x.shape[-nd:]), list(output_size)
    flat = None
    for d, (size, o) in enumerate(zip(spatial, out)):
        i = torch.arange(o, dtype=torch.int64, device=x.device)
        start = torch.div(i * size, o, rounding_mode="floor")
        end = torch.div((i + 1) * size + o - 1, o, rounding_mode="floor")
        reach = torch.arange((size + o - 1) // o + 1, dtype=torch.int64, device=x.device)
        pos = torch.minimum(start.unsqueeze(1) + reach.unsqueeze(0), end.unsqueeze(1) - 1)  # [o, L]
        shape = [1] * (2 * nd)
        shape[d], shape[nd + d] = o, -1
        term = pos.reshape(shape) * math.prod(spatial[d + 1:])
        flat = term if flat is None else flat + term
    windows = flat.reshape(math.prod(out), -1)  # [outputs, positions]: flat input indices
    planes = list(x.shape[:-nd])
    taken = x.reshape(planes + [-1]).index_select(len(planes), windows.reshape(-1))
    values, k = taken.reshape(planes + list(windows.shape)).max(-1)
    indices = torch.gather(windows.expand(planes + list(windows.shape)), -1, k.unsqueeze(-1)).squeeze(-1)
    return values.reshape(planes + out), indices.reshape(planes + out)


def replication_pad_backward(nd: int, grad_out, x, padding):
    """Each output gradient added at the input position replicate padding read it from: per
    padded dim, an index_add over the clamped positions (the padding is one gather per dim,
    so its backward is one scatter per dim). torch-mlir lowers the forward only. Half types
    are summed in float32 and rounded once."""
    compute = torch.float32 if grad_out.dtype in (torch.float16, torch.bfloat16) else grad_out.dtype
    grad = grad_out.to(compute)
    first = x.dim() - nd
    for d in range(nd):
        dim = first + d
        left = padding[2 * (nd - 1 - d)]  # padding lists the last dim first
        size = x.shape[dim]
        read = torch.clamp(torch.arange(grad.shape[dim], dtype=torch.int64, device=x.device) - left, 0, size - 1)
        shape = list(grad.shape)
        shape[dim] = size
        grad = torch.zeros(shape, dtype=compute, device=x.device).index_add(dim, read, grad)
    return grad.to(grad_out.dtype)


def max_pool3d_with_indices_backward(grad_out, x, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):
    return max_pool_backward_at_indices(3, grad_out, x, indices)


def _adaptive_windows(out, size, like: torch.Tensor):
    """[out, size]: 1 where input position j lies in output position i's window of adaptive
    pooling (ATen's: from floor(i * size / out) up to ceil((i + 1) * size / out)), else 0;
    and each window's length, as `like`'s dtype."""
    i = torch.arange(out, dtype=torch.int64, device=like.device)
    start = torch.div(i * size, out, rounding_mode="floor")
    end = torch.div((i + 1) * size + out - 1, out, rounding_mode="floor")
    j = torch.arange(size, dtype=torch.int64, device=like.device)
    inside = (j.unsqueeze(0) >= start.unsqueeze(1)) & (j.unsqueeze(0) < end.unsqueeze(1))
    return inside.to(like.dtype), (end - start).to(like.dtype)


def adaptive_avg_pool_backward(nd: int, grad_out, x):
    """Each output gradient, divided by its window's size, added over its window: one
    product with the 0/1 window matrix per spatial dim (the windows of adaptive pooling
    are a product of one range per dim). Half types are summed in float32 and rounded
    once, as eager's kernel accumulates."""
    compute = torch.float32 if grad_out.dtype in (torch.float16, torch.bfloat16) else grad_out.dtype
    grad = grad_out.to(compute)
    first = grad.dim() - nd
    for d in range(nd):
        inside, length = _adaptive_windows(grad.shape[first + d], x.shape[first + d], grad)
        shape = [1] * grad.dim()
        shape[first + d] = -1
        grad = grad / length.reshape(shape)
        # the dim last, times the [out, size] windows: [..., out] @ [out, size]
        grad = torch.matmul(grad.movedim(first + d, -1), inside).movedim(-1, first + d)
    return grad.to(grad_out.dtype)
