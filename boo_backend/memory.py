"""Where tensors' memory lies, for the IREE calls in runtime.py: which arguments share
memory, which results sit in an argument's memory or in one another's, and which results
must leave IREE's pool at once.

Imports pool (the storage results are copied into) from boo_backend.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from . import pool


def spans(tensors: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(start, end, index) of each non-empty tensor's memory, in address order."""
    found = []
    for i, t in enumerate(tensors):
        n = t.numel() if isinstance(t, torch.Tensor) else 0
        if n:
            p = t.data_ptr()
            found.append((p, p + n * t.element_size(), i))
    found.sort()
    return found


def overlapping(spans: list[tuple[int, int, int]]) -> list[int]:
    """Indices of the spans that overlap an earlier one in address order."""
    reach, hit = 0, []
    for start, end, i in spans:
        if start < reach:
            hit.append(i)
        reach = max(reach, end)
    return hit


def _inside(spans: list[tuple[int, int, int]]):
    """A test of whether an address lies in the memory of `spans` (from spans())."""
    starts = [s for s, _, _ in spans]
    reach, ends = 0, []
    for _, end, _ in spans:
        reach = max(reach, end)
        ends.append(reach)

    def inside(p: int) -> bool:
        k = bisect.bisect_right(starts, p)
        return bool(k) and ends[k - 1] > p

    return inside


# IREE 3.13's local-task device takes results from a growable pool of 64 MiB slabs. A result
# that torch frees after later calls have allocated (an activation kept for the backward, a
# gradient the optimizer reads) returns memory the pool does not hand out again: a GPT-2 small
# training step grew the process by 670 MB a step, a Llama of 8 x 512 by 190 MB, and neither
# stopped. local-sync allocates each buffer directly and does not grow. So a local-task call's
# results are copied into torch's memory before the call returns, and the pool gets its block
# back at once (out_of_pool; tests/test_iree_workarounds.py). Allocations past one slab come
# from the system and do not leak, but IREE packs a call's results into one allocation, and a
# small result kept for the backward then holds the whole of it: sparing those from the copy
# raised GPT-2's peak memory from eager + 6% to eager + 24%, for no step time measured.
# CPU modules now write every result of a shape known before the call into storage the call
# allocates (storage.with_storage); the copy is left for results of dynamic shape.
POOLED = ("local-task",)


# torch's copies run on its OpenMP threads, and with OMP_WAIT_POLICY unset (the default) the
# worker thread then spins for about 7 ms before it sleeps. An IREE local-task call in those
# ms shares a core with it: a 3.2 ms backward part of the MLP step took 6.7 ms after the copy
# of its own results, and 3.5 ms when that copy ran on one thread (bench/RESULTS.md, sixth
# session). So the copies around IREE calls run on the calling thread, through numpy, which
# takes no OpenMP threads. Past _PARALLEL_COPY bytes the copy itself costs more than the spin
# (64 MB of fresh memory: 21 ms on torch's two threads, 36 ms on one) and goes to torch.
_PARALLEL_COPY = 32 << 20
SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_into(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """out[...] = t (same shape and dtype; any strides), on the calling thread for a CPU
    copy of fewer than _PARALLEL_COPY bytes (see there). Returns `out`."""
    bits = SAME_SIZE_INT.get(t.element_size())
    if (bits is None or t.device.type != "cpu" or out.device.type != "cpu" or t.dtype != out.dtype
            or t.dtype.is_complex or t.is_quantized or t.layout != torch.strided or not t.numel()
            or t.numel() * t.element_size() >= _PARALLEL_COPY or t.is_neg()):
        return out.copy_(t)
    np.copyto(out.detach().view(bits).numpy(), t.detach().view(bits).numpy())
    return out


def dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh, dense copy of `t` (see copy_into); on the CPU, in storage from pool.RESULTS
    (every caller hands the copy out as a result)."""
    if t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized:
        out = pool.RESULTS.tensor(tuple(t.shape), t.dtype)
    else:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return copy_into(out, t)


def out_of_pool(results: list[torch.Tensor], spans: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The results, each copied into torch's memory (see POOLED), except a result in an
    argument's memory (`spans`, from spans(): IREE wrote into it), which is not the pool's."""
    inside = _inside(spans)
    return [dense_copy(r) if r.numel() and not inside(r.data_ptr()) else r for r in results]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs with the same payload are equal)."""
    if a.numel() == 0:
        return True
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def unalias(results: list[torch.Tensor], spans: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """IREE may hand back an input's buffer (or one buffer twice) for a result that is a copy
    in the graph, e.g. `x.clone()`. The graph promised a fresh tensor, so copy those.
    `spans`: the arguments' memory, from spans."""
    inside = _inside(spans)
    seen: set[int] = set()
    for i, r in enumerate(results):
        if not r.numel():
            continue
        p = r.data_ptr()
        if p in seen or inside(p):
            results[i] = dense_copy(r)
        seen.add(results[i].data_ptr())
    return results
