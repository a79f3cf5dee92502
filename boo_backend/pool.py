"""Memory for CPU modules' results, kept after the results die and handed out again: the
storage a call passes for the results it writes there (storage.with_storage), and the copies
of results of dynamic shape out of IREE's pool (memory.dense_copy).

A fresh tensor of tens of MB costs a page fault per 4 KiB on its first write: about 28 ms for
the 62.5 MiB a Llama's loss writes (torch.empty is 0.02 ms; torch.zeros of the same size
28 ms). A training step writes results of the same sizes step after step, so a storage that
nothing else holds any more is written again instead: in a scratch experiment that reused each
part's storage from the step before, the Llama of bench/scale.py spent 180-199 ms a step in its
IREE parts instead of 292-299 (bench/RESULTS.md, tenth session).

A result takes a free storage of its size in bytes or up to _SLACK times larger.
A storage is handed out again only when the pool holds the last reference to it: a result
kept for the backward, a `.grad`, a view, a numpy array or a DLPack capsule of it each hold one
(torch counts them on the storage), so nothing still readable is ever overwritten. The pool
keeps at most BOO_RESULT_POOL_MB MiB (default _DEFAULT_MB; 0 turns it off). Past that, it drops
the storages it holds alone that were used longest ago, and a result it cannot make room for
gets memory of its own, as before.

The matmuls a graph leaves to ATen write large results there too (`products`): a Llama's
[512, 32000] logits took 82 ms in fresh memory against 61 ms in memory written before.

Imports config (BooError) from boo_backend.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading

import torch
import torch.fx as fx

from .config import BooError

_DEFAULT_MB = 1024
# Smaller results are left to torch's allocator: their page faults cost little, and each
# storage the pool holds adds to the list it searches.
_MIN_BYTES = 256 << 10
# A result may take a free storage up to this much larger than it needs: with dynamic shapes
# the sizes move a little from step to step (sequence lengths), and an exact match would keep
# a storage for every length met.
_SLACK = 1.25


def _alone(storage: torch.UntypedStorage) -> bool:
    """Whether `storage` has no reference but the pool's."""
    return torch._C._storage_Use_Count(storage._cdata) == 1


class Pool:
    """Storages by size in bytes; each size's list runs from least to most recently used."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self.reused = 0  # storages handed out again, for tests and diagnosis
        self._by_size: dict[int, list[torch.UntypedStorage]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self._fresh: list[tuple[int, torch.UntypedStorage]] | None = None  # see transient()

    def tensor(self, shape: tuple, dtype: torch.dtype, nbytes: int | None = None) -> torch.Tensor:
        """A dense CPU tensor of `shape` and `dtype` whose contents are undefined (as
        torch.empty's): the caller writes all of it. `nbytes`: its size, where the caller
        knows it already."""
        if nbytes is None:
            nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < _MIN_BYTES or nbytes > self.limit:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            storage = self._take(nbytes)
            # Built under the lock: once a tensor holds the storage, no other caller takes it.
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        """A free storage of `nbytes` to _SLACK times that (the smallest such), else a new one."""
        for size in sorted(n for n in self._by_size if nbytes <= n <= nbytes * _SLACK):
            same = self._by_size[size]
            for i, storage in enumerate(same):
                if _alone(storage):
                    same.pop(i)
                    if storage.nbytes() == size:
                        same.append(storage)
                        self.reused += 1
                        return storage
                    self.held -= size  # a caller's resize_ changed it: drop it
                    break
        storage = torch.UntypedStorage(nbytes)
        if self._make_room(nbytes):
            self._by_size[nbytes].append(storage)
            self.held += nbytes
            if self._fresh is not None:
                self._fresh.append((nbytes, storage))
        return storage

    @contextlib.contextmanager
    def transient(self):
        """Storages first made inside the block are forgotten at its end where nothing else
        holds them. For calls beside the step's own: the driver choice times a part again
        while the first call's results are alive (runtime._choose), so each result it
        writes takes a second storage, which the step never needs and the pool would keep
        for good (290 MB of GPT-2 small's cold process)."""
        with self._lock:
            outer, self._fresh = self._fresh, []
        try:
            yield
        finally:
            with self._lock:
                fresh, self._fresh = self._fresh, outer
                for size, storage in fresh:
                    same = self._by_size.get(size, [])
                    at = next((i for i, s in enumerate(same) if s is storage), None)
                    if at is not None and _alone(storage):
                        del same[at]
                        self.held -= size
                    elif outer is not None:
                        outer.append((size, storage))

    def _make_room(self, nbytes: int) -> bool:
        """Drop storages only the pool holds, larger sizes first and the least recently used
        first within a size, until `nbytes` more fit under the limit. False, dropping nothing,
        if even dropping them all would not make room."""
        excess = self.held + nbytes - self.limit
        if excess <= 0:
            return True
        free = [(size, s) for size in sorted(self._by_size, reverse=True) for s in self._by_size[size] if _alone(s)]
        if sum(size for size, _ in free) < excess:
            return False
        for size, storage in free:
            self._by_size[size].remove(storage)
            self.held -= size
            excess -= size
            if excess <= 0:
                return True
        return True

    def clear(self) -> None:
        """Forget every storage (results that still hold one keep it)."""
        with self._lock:
            self._by_size.clear()
            self.held = 0


def _limit() -> int:
    raw = os.environ.get("BOO_RESULT_POOL_MB", "").strip()
    try:
        mb = float(raw) if raw else _DEFAULT_MB
    except ValueError:
        raise BooError(f"boo: BOO_RESULT_POOL_MB={raw!r} is not a number of MiB (0 turns the pool off)") from None
    return int(max(mb, 0) * (1 << 20))


RESULTS = Pool(_limit())


_aten = torch.ops.aten
# An ATen product smaller than this keeps torch's allocator. glibc maps a block this large
# afresh on every allocation (32 MiB is the most its mmap threshold grows to) and unmaps it
# when freed; smaller ones come from its heap, in memory written before, once a block of
# their size has been freed. Pooling those as well gained nothing measurable in
# bench/scale.py's models and left GPT-2 small's pool near its limit (926 MB held).
PRODUCT_MIN_BYTES = 32 << 20


def _out(shape: tuple, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """Storage from RESULTS for a product of `a` and `b` of `shape`, or None where the
    product keeps torch's own: off the CPU, small, or where autograd records the call."""
    if not (a.device.type == "cpu" and a.layout == torch.strided and a.dtype == b.dtype):
        return None
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return None
    nbytes = math.prod(shape) * a.dtype.itemsize
    if nbytes < PRODUCT_MIN_BYTES or nbytes > RESULTS.limit:
        return None
    return RESULTS.tensor(shape, a.dtype, nbytes)


def mm(a, b):
    """aten.mm, its result in storage from RESULTS where it is large."""
    out = _out((a.shape[0], b.shape[1]), a, b)
    return _aten.mm.default(a, b) if out is None else _aten.mm.out(a, b, out=out)


def addmm(c, a, b, *, beta=1, alpha=1):
    """aten.addmm, its result in storage from RESULTS where it is large."""
    out = _out((a.shape[0], b.shape[1]), a, b)
    if out is None or c.dtype != a.dtype:
        return _aten.addmm.default(c, a, b, beta=beta, alpha=alpha)
    return _aten.addmm.out(c, a, b, beta=beta, alpha=alpha, out=out)


def bmm(a, b):
    """aten.bmm, its result in storage from RESULTS where it is large."""
    out = _out((a.shape[0], a.shape[1], b.shape[2]), a, b)
    return _aten.bmm.default(a, b) if out is None else _aten.bmm.out(a, b, out=out)


PRODUCTS = {_aten.mm.default: mm, _aten.addmm.default: addmm, _aten.bmm.default: bmm}


def products(runner):
    """`runner` (a graph cut into parts, or an IREE part) with each ATen matmul of its graphs
    writing a large result into storage from RESULTS. Applied to a built graph as it is
    served, after part.donate (which knows matmuls by their ATen targets), and never to the
    graph the compile cache keeps."""
    if not isinstance(runner, fx.GraphModule):
        return runner
    nodes = [n for n in runner.graph.nodes if n.op == "call_function" and n.target in PRODUCTS]
    for node in nodes:
        node.target = PRODUCTS[node.target]
    if nodes:
        runner.recompile()
    for child in runner.children():  # ATen's parts; not the graphs inside IREE parts
        products(child)
    return runner
