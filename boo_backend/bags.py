"""EmbeddingBag forward and backward as gathers and scatter_adds over each entry's bag,
which IREE computes. torch-mlir lowers only the plain sum of `_embedding_bag`, drops
per_sample_weights and padding_idx where it lowers more (miscompiles), and nothing lowers
the backward: a recommendation model or a bag-of-words classifier trained with its
embedding bags in eager islands. TABLE is merged into decompositions.FALLBACK, and its ops
are in decompositions.UNLOWERED. A leaf: imports nothing from boo_backend.

Every bag is read from `offsets` (offset2bag is recomputed: eager's CPU forward leaves it
empty on its fast path); an entry at padding_idx counts for nothing, a mean divides by the
entries that count, and an empty bag gives zeros (max: its max_indices are -1).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
_SUM, _MEAN, _MAX = 0, 1, 2


def _add_at(out, index, src):
    """out.index_add(0, index, src) as a scatter_add: the compiler rejects index_add's form
    (an accumulating index_put) with symbolic sizes."""
    if src.dim() == 2:
        index = index.unsqueeze(1).expand(-1, src.shape[1])
    return out.scatter_add(0, index, src)


def _bags(indices, offsets, include_last_offset: bool):
    """(the bag of each entry, the number of bags)."""
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    n = indices.shape[0]
    starts = torch.zeros(n + 1, dtype=torch.int64, device=indices.device)
    # a bag starting at n (an empty last bag) marks the dropped slot
    starts = _add_at(starts, offsets[:bags].to(torch.int64).clamp(0, n),
                     torch.ones(bags, dtype=torch.int64, device=indices.device))
    return torch.cumsum(starts[:n], 0) - 1, bags


def _counted(indices, padding_idx):
    """Which entries count: all but those at padding_idx (-1: none)."""
    if padding_idx is None or padding_idx < 0:
        return torch.ones(indices.shape, dtype=torch.bool, device=indices.device)
    return indices != padding_idx


def _fast_path_sum(weight, per_sample_weights, padding_idx) -> bool:
    """Where eager's CPU forward returns an empty offset2bag (the shapes its meta gives)."""
    return (weight.dtype in (torch.float32, torch.float16) and weight.stride(1) == 1
            and (padding_idx is None or padding_idx < 0)
            and (per_sample_weights is None or per_sample_weights.stride(0) == 1))


def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """(output, offset2bag, bag_size, max_indices) with the shapes eager's meta gives them."""
    bag, bags = _bags(indices, offsets, include_last_offset)
    counted = _counted(indices, padding_idx)
    dim = weight.shape[1]
    rows = weight.index_select(0, indices.to(torch.int64))
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.to(rows.dtype).unsqueeze(1)
    size = _add_at(torch.zeros(bags, dtype=torch.int64, device=weight.device), bag, counted.to(torch.int64))
    if mode == _MAX:
        low = torch.full_like(rows, float("-inf"))
        taken = torch.where(counted.unsqueeze(1), rows, low)
        best = low.new_full((bags, dim), float("-inf")).scatter_reduce(
            0, bag.unsqueeze(1).expand(-1, dim), taken, "amax", include_self=True)
        empty = (size == 0).unsqueeze(1)
        output = torch.where(empty, torch.zeros_like(best), best)
        # the first entry of each bag that holds the maximum, per column
        n = indices.shape[0]
        place = torch.arange(n, device=weight.device).unsqueeze(1).expand(-1, dim)
        wins = (taken == best.index_select(0, bag)) & counted.unsqueeze(1)
        first = torch.full((bags, dim), n, dtype=torch.int64, device=weight.device).scatter_reduce(
            0, bag.unsqueeze(1).expand(-1, dim), torch.where(wins, place, n), "amin", include_self=True)
        padded = torch.cat([indices.to(torch.int64), indices.new_full((1,), -1).to(torch.int64)])
        max_indices = torch.where(empty, -1, padded.index_select(0, first.reshape(-1)).reshape(bags, dim))
        offset2bag = bag
    else:
        rows = torch.where(counted.unsqueeze(1), rows, torch.zeros_like(rows))
        output = _add_at(torch.zeros((bags, dim), dtype=weight.dtype, device=weight.device), bag, rows)
        if mode == _MEAN:
            output = output / size.clamp_min(1).to(output.dtype).unsqueeze(1)
        max_indices = torch.zeros(bags, dtype=torch.int64, device=weight.device)
        fast = mode == _SUM and _fast_path_sum(weight, per_sample_weights, padding_idx)
        offset2bag = bag[:0] if fast else bag
    like = offsets.dtype
    return output, offset2bag.to(like), size.to(like), max_indices.to(like)


def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    """The dense gradient of the weight: each bag's gradient added at its entries' rows (a
    mean's divided by its size, scaled by per_sample_weights), or, for max, at the rows the
    maximum came from. Not sparse gradients, nor scale_grad_by_freq: eager's CPU kernel
    divides by another row's count there (indices [0, 0, 1] in one bag give row 0 a
    gradient of 1 and row 1 one of 0.5, where F.embedding gives 1 and 1), and the island
    keeps eager's numbers."""
    if sparse or scale_grad_by_freq:
        return NotImplemented
    dim = grad.shape[1]
    indices = indices.to(torch.int64)
    if mode == _MAX:
        flat = maximum_indices.to(torch.int64) * dim + torch.arange(dim, device=grad.device)
        flat = torch.where(maximum_indices < 0, num_weights * dim, flat)  # empty bags: a dropped slot
        out = torch.zeros(num_weights * dim + 1, dtype=grad.dtype, device=grad.device)
        return _add_at(out, flat.reshape(-1), grad.reshape(-1))[:-1].reshape(num_weights, dim)
    bag, bags = _bags(indices, offsets, offsets.shape[0] != grad.shape[0])
    counted = _counted(indices, padding_idx)
    part = grad.index_select(0, bag)
    if per_sample_weights is not None:
        part = part * per_sample_weights.to(part.dtype).unsqueeze(1)
    if mode == _MEAN:
        size = _add_at(torch.zeros(bags, dtype=torch.int64, device=grad.device), bag, counted.to(torch.int64))
        part = part / size.clamp_min(1).to(part.dtype).index_select(0, bag).unsqueeze(1)
    part = torch.where(counted.unsqueeze(1), part, torch.zeros_like(part))
    return _add_at(torch.zeros((num_weights, dim), dtype=grad.dtype, device=grad.device), indices, part)


def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    """Each entry's weight gradient: its bag's gradient dotted with its row (0 at padding)."""
    bag, _ = _bags(indices, offsets, offsets.shape[0] != grad.shape[0])
    rows = weight.index_select(0, indices.to(torch.int64))
    dot = (grad.index_select(0, bag) * rows).sum(1)
    return torch.where(_counted(indices, padding_idx), dot, torch.zeros_like(dot))


TABLE = {
    aten._embedding_bag.default: embedding_bag,
    aten._embedding_bag_forward_only.default: embedding_bag,
    aten._embedding_bag_backward.default: embedding_bag_backward,
    aten._embedding_bag_per_sample_weights_backward.default: embedding_bag_per_sample_weights_backward,
}
