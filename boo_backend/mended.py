"""torch's own decompositions that AOTAutograd runs before any table is consulted, mended
while it traces (`while_tracing`). torch._decomp registers some entries as Python kernels
of the op itself (upsample_nearest*'s index helper, multilabel_margin_loss_forward at the
Autograd key), so boo's AOT table never sees these ops: the fix has to replace torch's
function for the length of the trace. An op whose backward nothing lowers, or whose backward
fails to trace, is given a Python kernel at the Autograd key the same way (grid_sampler_2d,
affine_grid_generator), so that AOTAutograd differentiates the ops it decomposes into.
Imports nothing of boo's.
"""

from __future__ import annotations

import contextlib

import torch
from torch._C import DispatchKey

aten = torch.ops.aten


def _nearest_indices(input, output_size, scales, exact=False):
    """The source index of every output position of nearest upsampling, as eager's CPU
    kernel computes it: min(floor((dst + offset) * scale), in - 1) in float32, with scale
    1 / scale_factor where one is given, else in / out; plain nearest copies (out == in) or
    halves (out == 2 in) the index without floats, whatever the scale factor."""
    indices = []
    first = input.dim() - len(output_size)
    for d, osize in enumerate(output_size):
        isize = input.shape[first + d]
        dst = torch.arange(osize, device=input.device)
        if not exact and osize == isize:
            index = dst
        elif not exact and osize == 2 * isize:
            index = dst // 2
        else:
            scale = 1.0 / scales[d] if scales[d] is not None and scales[d] > 0 else isize / osize
            index = ((dst.to(torch.float32) + (0.5 if exact else 0.0)) * scale).to(torch.int64)
            index = index.clamp(max=isize - 1)
        indices.append(index.reshape([osize] + [1] * (len(output_size) - 1 - d)))
    return indices


def _multilabel_margin_loss_forward(input, target, reduction):
    """multilabel_margin_loss as eager computes it: for each row, the hinge
    max(0, 1 - x[j] + x[k]) / dim over the labels j before the row's first -1 and the
    positions k that are none of those labels. torch._decomp's entry also counts the label
    slots after the -1, as label 0."""
    x, labels = torch.atleast_2d(input), torch.atleast_2d(target)
    dim = x.shape[1]
    torch._check(input.dim() <= 2 and dim != 0,
                 lambda: f"Expected non-empty vector or matrix with optional 0-dim batch size, "
                         f"but got: {input.shape}")
    torch._check(target.shape == input.shape,
                 lambda: f"inconsistent target size: {target.shape} for input of size: {input.shape}")
    slot = torch.arange(dim, device=target.device)
    end = torch.where(labels == -1, slot, dim).amin(-1, keepdim=True)
    counted = slot < end  # [rows, slots]: the label slots before the first -1
    u = x.gather(-1, torch.where(counted, labels, 0))
    is_target = (slot == torch.where(counted, labels, -1).unsqueeze(-1)).any(1)  # [rows, k]
    z = (1.0 - u.unsqueeze(-1) + x.unsqueeze(1)).clamp_min(0) / dim  # [rows, slot j, k]
    z = torch.where(counted.unsqueeze(-1) & ~is_target.unsqueeze(1), z, 0).sum((1, 2))
    if reduction == 1:  # mean (over no rows: nan, where eager returns uninitialized memory)
        z = z.mean()
    elif reduction == 2:  # sum
        z = z.sum()
    else:
        z = z.reshape(input.shape[:-1])
    return z, is_target.to(input.dtype).reshape(target.shape)


def _grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners):
    """grid_sampler_2d as torch._decomp writes it, in ATen ops that autograd differentiates:
    nothing lowers grid_sampler_2d_backward, which ran as an eager island in every training
    graph. Bilinear sampling with zeros padding gives NaN where a point's coordinate is not
    finite, as eager does; torch._decomp's in-bounds mask is False there and gave 0.
    Nearest sampling reaches the grid only through a rounding, which autograd does not
    differentiate: the grid's gradient was None where eager's is zeros (and AdamW decays a
    parameter whose gradient is zeros, but skips one that has none). A factor of exactly 1
    that depends on the grid through an unselected `where` gives it eager's zeros, and leaves
    every value as it is (NaNs, infinities and signed zeros included)."""
    from torch._decomp import decomposition_table

    out = decomposition_table[aten.grid_sampler_2d.default](
        input, grid, interpolation_mode, padding_mode, align_corners)
    if interpolation_mode == 0 and padding_mode == 0 and grid.dtype.is_floating_point:
        lost = torch.logical_not(torch.isfinite(grid).all(-1)).unsqueeze(1)  # [N, 1, oH, oW]
        out = torch.where(lost, torch.full_like(out, float("nan")), out)
    if interpolation_mode == 1 and grid.dtype.is_floating_point:
        never = torch.zeros((), dtype=torch.bool, device=grid.device)
        out = out * (1 + torch.where(never, grid.sum(), 0).to(out.dtype))
    return out


def _affine_grid_generator(theta, size, align_corners):
    """affine_grid_generator as torch._decomp writes it: its C++ backward takes no symbolic
    sizes ("SymIntArrayRef expected to contain only concrete integers"), so a spatial
    transformer trained on a second batch size failed to compile (in Inductor too)."""
    from torch._decomp import decomposition_table

    return decomposition_table[aten.affine_grid_generator.default](theta, size, align_corners)


_AUTOGRAD_KERNELS = {
    aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
    aten.grid_sampler_2d.default: _grid_sampler_2d,
    aten.affine_grid_generator.default: _affine_grid_generator,
}


@contextlib.contextmanager
def while_tracing():
    """While AOTAutograd traces: nearest upsampling indexes as eager does (_nearest_indices),
    and the ops of _AUTOGRAD_KERNELS are boo's functions at the Autograd key.
    torch._decomp's upsample_nearest* does not clamp, so a scale factor that does not divide
    (2x2 to [6, 10] with scales 2.3 and 4.7) indexes past the input, and IREE reads whatever
    lies past the buffer; nor does it copy or halve the index as eager does when the output
    is 1x or 2x the input."""
    from torch._decomp import decompositions as torch_decomps

    indices = torch_decomps._compute_upsample_nearest_indices
    theirs = {op: op.py_kernels.get(DispatchKey.Autograd) for op in _AUTOGRAD_KERNELS}
    torch_decomps._compute_upsample_nearest_indices = _nearest_indices
    for op, kernel in _AUTOGRAD_KERNELS.items():
        op.py_kernels[DispatchKey.Autograd] = kernel
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        torch_decomps._compute_upsample_nearest_indices = indices
        for op, kernel in theirs.items():
            if kernel is None:
                op.py_kernels.pop(DispatchKey.Autograd, None)
            else:
                op.py_kernels[DispatchKey.Autograd] = kernel
            op._dispatch_cache.clear()
