"""Pre-lowering rewrites of convolutions that torch-mlir or IREE 3.13 get wrong (see
rewrites.PRE_LOWERING, which merges CONV_REWRITES).

A leaf: imports nothing from boo_backend.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _per_dim(values, spatial: int) -> list:
    """A stride, padding or dilation list with one entry per spatial dim (`padding="valid"`
    gives [0] for all of them)."""
    return list(values) * spatial if len(values) == 1 else list(values)


def _short_conv_lists(grad, x, weight, bias_sizes, stride, padding, dilation, *args, **kwargs) -> bool:
    """A convolution_backward whose stride, padding or dilation holds one entry for several
    spatial dims (`padding="valid"` gives [0])."""
    spatial = weight.dim() - 2
    return spatial > 1 and any(len(v) == 1 for v in (stride, padding, dilation))


def _conv_backward_full_lists(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                              output_padding, groups, output_mask):
    """convolution_backward with one stride, padding and dilation entry per spatial dim:
    torch-mlir's lowering reads past a one-entry list with symbolic sizes, and iree-compile
    crashed (EfficientNet's `padding="valid"` convolutions; their backward compiled once per
    shape)."""
    if not _short_conv_lists(grad, x, weight, bias_sizes, stride, padding, dilation):
        return NotImplemented
    spatial = weight.dim() - 2
    full = [_per_dim(v, spatial) for v in (stride, padding, dilation, output_padding)]
    return aten.convolution_backward.default(grad, x, weight, bias_sizes, *full[:3], transposed, full[3], groups,
                                             output_mask)


def _lone_windows(x, weight, stride, padding, dilation, transposed) -> dict[int, tuple[int, int, int]]:
    """The spatial dims of a convolution where its one output position's window ends before
    the padded input does: {dim of x: (input elements kept, left pad, right pad)}.

    IREE 3.13 fails to compile such a convolution, forward and backward ('linalg.generic' op
    inferred input/output operand #1 has shape's dimension #3 to be 4, but found 3): a
    RegNet's grouped 3x3, stride 2, padding 1 convolution on a 2x2 input. With more than one
    output position, or a window that reaches the padded input's end, it compiles right."""
    if transposed or not isinstance(x, torch.Tensor) or x.dim() != weight.dim():
        return {}
    spatial = weight.dim() - 2
    stride, padding, dilation = (_per_dim(v, spatial) for v in (stride, padding, dilation))
    lone = {}
    for i in range(spatial):
        size, k = x.shape[2 + i], weight.shape[2 + i]
        s, p, d = stride[i], padding[i], dilation[i]
        if not all(isinstance(v, int) for v in (size, k, s, p, d)):
            continue  # symbolic: not known to be one window
        extent = d * (k - 1) + 1
        padded = size + 2 * p
        if extent < padded < extent + s:  # one output position, and padded input left over
            kept = max(0, min(size, extent - p))
            lone[2 + i] = (kept, p, extent - p - kept)
    return lone


def _windowed(x, lone: dict):
    """`x` cropped to what the lone windows read, and padded explicitly to their extent."""
    pad = []
    for dim in range(x.dim() - 1, 1, -1):  # constant_pad_nd lists the last dim first
        kept, left, right = lone.get(dim, (x.shape[dim], 0, 0))
        if dim in lone and kept < x.shape[dim]:
            x = aten.slice.Tensor(x, dim, 0, kept)
        pad += [left, right]
    return aten.constant_pad_nd.default(x, pad, 0.0) if any(pad) else x


def _unpadded(values, lone: dict, spatial: int, fill: int) -> list:
    values = _per_dim(values, spatial)
    return [fill if 2 + i in lone else v for i, v in enumerate(values)]


def _has_lone_window(x, weight, bias, stride, padding, dilation, transposed, *args, **kwargs) -> bool:
    return bool(_lone_windows(x, weight, stride, padding, dilation, transposed))


def _conv_lone_window(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution with a lone window (see _lone_windows) on its input cropped and padded
    to that window: one output position either way, and IREE compiles this one."""
    lone = _lone_windows(x, weight, stride, padding, dilation, transposed)
    if not lone:
        return NotImplemented
    spatial = weight.dim() - 2
    return aten.convolution.default(_windowed(x, lone), weight, bias, _unpadded(stride, lone, spatial, 1),
                                    _unpadded(padding, lone, spatial, 0), _per_dim(dilation, spatial),
                                    transposed, _per_dim(output_padding, spatial), groups)


def _has_lone_window_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                              *args, **kwargs) -> bool:
    return bool(_lone_windows(x, weight, stride, padding, dilation, transposed))


def _conv_backward_lone_window(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                               output_padding, groups, output_mask):
    """The gradients of _conv_lone_window's convolution; the input's gradient is zero where
    the window does not reach."""
    lone = _lone_windows(x, weight, stride, padding, dilation, transposed)
    if not lone:
        return NotImplemented
    spatial = weight.dim() - 2
    gx, gw, gb = aten.convolution_backward.default(
        grad, _windowed(x, lone), weight, bias_sizes, _unpadded(stride, lone, spatial, 1),
        _unpadded(padding, lone, spatial, 0), _per_dim(dilation, spatial), transposed,
        _per_dim(output_padding, spatial), groups, output_mask)
    if gx is not None:
        pad = []
        for dim in range(x.dim() - 1, 1, -1):
            kept, left, right = lone.get(dim, (x.shape[dim], 0, 0))
            if dim in lone:
                gx = aten.slice.Tensor(gx, dim, left, left + kept)
            pad += [0, x.shape[dim] - kept]
        gx = aten.constant_pad_nd.default(gx, pad, 0.0) if any(pad) else gx
    return gx, gw, gb


# Tables for rewrites._merged, which tries an op's entries in order.
CONV_REWRITES = (
    {aten.convolution_backward.default: (_short_conv_lists, _conv_backward_full_lists)},
    {aten.convolution.default: (_has_lone_window, _conv_lone_window),
     aten.convolution_backward.default: (_has_lone_window_backward, _conv_backward_lone_window)},
)
