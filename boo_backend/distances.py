"""torch.cdist's forward and backward as the ATen ops eager's CPU kernels compute, which
torch-mlir lowers: `_cdist_forward` and `_cdist_backward` ran as eager islands wherever
cdist does not take its matmul form (p != 2, or 25 rows or fewer on both sides), as in a
metric-learning loss over a small batch. TABLE is merged into decompositions.FALLBACK, and
its ops are in decompositions.UNLOWERED. A leaf: imports nothing from boo_backend.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _by_matmul(x1, x2, p, compute_mode) -> bool:
    """Eager's choice of the matmul form: p = 2, and compute_mode 1 ('use_mm_for_euclid_dist')
    or unset (0: 'use_mm_for_euclid_dist_if_necessary') with more than 25 rows on a side."""
    mode = 0 if compute_mode is None else compute_mode
    return p == 2 and (mode == 1 or (mode == 0 and (x1.shape[-2] > 25 or x2.shape[-2] > 25)))


def _differences(x1, x2):
    return x1.unsqueeze(-2) - x2.unsqueeze(-3)  # [..., P, R, M]


def cdist_forward(x1, x2, p, compute_mode=None):
    """The p-norm distance of every row of x1 to every row of x2, [..., P, R]."""
    if _by_matmul(x1, x2, p, compute_mode):
        # ATen's _euclidean_dist: |a|^2 - 2 a.b + |b|^2 as one product of padded rows
        n1, n2 = x1.pow(2).sum(-1, keepdim=True), x2.pow(2).sum(-1, keepdim=True)
        left = torch.cat([x1 * -2, n1, torch.ones_like(n1)], -1)
        right = torch.cat([x2, torch.ones_like(n2), n2], -1)
        return torch.matmul(left, right.mT).clamp_min(1e-30).sqrt()
    d = _differences(x1, x2).abs()
    if p == 0:
        return (d != 0).sum(-1).to(x1.dtype)
    if p == 1:
        return d.sum(-1)
    if p == 2:
        return d.pow(2).sum(-1).sqrt()
    if math.isinf(p):
        return d.amax(-1)
    return d.pow(p).sum(-1).pow(1.0 / p)


def cdist_backward(grad, x1, x2, p, dist):
    """x1's gradient: each distance's gradient times its derivative in x1's row, summed over
    x2's rows; 0 where a distance is 0, as eager's kernel (a p < 1 norm stays with it).
    Over the batch dims x1 and x2 broadcast to, as eager's meta gives it: autograd sums it
    down to x1's own."""
    if p < 1 and p != 0:
        return NotImplemented
    if p == 0:
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
        return torch.zeros([*batch, *x1.shape[-2:]], dtype=x1.dtype, device=x1.device)
    diff = _differences(x1, x2)
    g = grad.unsqueeze(-1)
    if p == 1:
        part = g * diff.sign()
    elif p == 2:
        part = torch.where(dist == 0, torch.zeros_like(grad), grad / dist).unsqueeze(-1) * diff
    elif math.isinf(p):
        part = g * diff.sign() * (diff.abs() == dist.unsqueeze(-1)).to(diff.dtype)
    else:
        d = dist.unsqueeze(-1)
        ratio = torch.where(d == 0, torch.zeros_like(diff), diff.abs().pow(p - 1) / d.pow(p - 1))
        part = g * diff.sign() * ratio
    return part.sum(-2)


TABLE = {
    aten._cdist_forward.default: cdist_forward,
    aten._cdist_backward.default: cdist_backward,
}
