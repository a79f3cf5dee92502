"""torch's own decompositions that AOTAutograd runs before any table is consulted, mended
while it traces (`while_tracing`). torch._decomp registers some entries as Python kernels
of the op itself (upsample_nearest*'s index helper, multilabel_margin_loss_forward at the
Autograd key), so boo's AOT table never sees these ops: the fix has to replace torch's
function for the length of the trace. Imports nothing of boo's.
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


@contextlib.contextmanager
def while_tracing():
    """While AOTAutograd traces: nearest upsampling indexes as eager does (_nearest_indices),
    and multilabel_margin_loss_forward is _multilabel_margin_loss_forward.
    torch._decomp's upsample_nearest* does not clamp, so a scale factor that does not divide
    (2x2 to [6, 10] with scales 2.3 and 4.7) indexes past the input, and IREE reads whatever
    lies past the buffer; nor does it copy or halve the index as eager does when the output
    is 1x or 2x the input."""
    from torch._decomp import decompositions as torch_decomps

    op = aten.multilabel_margin_loss_forward.default
    theirs = torch_decomps._compute_upsample_nearest_indices, op.py_kernels.get(DispatchKey.Autograd)
    torch_decomps._compute_upsample_nearest_indices = _nearest_indices
    op.py_kernels[DispatchKey.Autograd] = _multilabel_margin_loss_forward
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        torch_decomps._compute_upsample_nearest_indices = theirs[0]
        if theirs[1] is None:
            op.py_kernels.pop(DispatchKey.Autograd, None)
        else:
            op.py_kernels[DispatchKey.Autograd] = theirs[1]
        op._dispatch_cache.clear()
