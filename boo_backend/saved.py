"""A graph cut into parts (IREE modules between ATen matmuls and eager islands, or a model's
repeated blocks), as bytes for the compile cache, so that a warm start rebuilds it without
retracing, matching, placing or importing anything.

The outer graph and its ATen/eager parts are torch.fx GraphModules, which pickle as their
generated code (torch.fx rebuilds the graph from it). Each IREE part is stored once, however
many parts share it, as its lowered form (`Lowered.to_bytes`); loading hands each to
`make_part`, which compiles it through the cache (a hit) and loads it. The cache directory
is private to its user and already holds the native code boo runs (see cache.py), so
unpickling its entries trusts nothing new.

Imports part (IreePart) and lower (Lowered) from boo_backend.
"""

from __future__ import annotations

import io
import pickle

import torch.fx as fx

from .lower import Lowered
from .part import IreePart


class _Pickler(pickle.Pickler):
    def __init__(self, file, lowered: list[bytes]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.lowered = lowered
        self.index: dict[int, int] = {}

    def persistent_id(self, obj):
        if isinstance(obj, IreePart):
            if id(obj) not in self.index:
                self.index[id(obj)] = len(self.lowered)
                self.lowered.append(obj.lowered.to_bytes({"has_module": obj.function is not None}))
            return ("iree", self.index[id(obj)])
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, parts: list):
        super().__init__(file)
        self.parts = parts

    def persistent_load(self, pid):
        kind, i = pid
        if kind != "iree":
            raise pickle.UnpicklingError(f"unknown part kind {kind!r}")
        return self.parts[i]


def _clear_meta(gm: fx.GraphModule) -> None:
    """GraphModule.meta can hold fake tensors and shape environments; nothing reads it when
    the module runs."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            module.meta = {}


def dump(outer: fx.GraphModule, extra: dict) -> bytes:
    """`outer` and `extra` (plain data: the graph's placement) as bytes."""
    _clear_meta(outer)
    lowered: list[bytes] = []
    buf = io.BytesIO()
    _Pickler(buf, lowered).dump(outer)
    return pickle.dumps({"graph": buf.getvalue(), "lowered": lowered, "extra": extra},
                        protocol=pickle.HIGHEST_PROTOCOL)


def load(blob: bytes, make_part) -> tuple[fx.GraphModule, dict]:
    """The outer graph and `extra`. Each distinct IREE part is `make_part(i, lowered, has_module)`."""
    data = pickle.loads(blob)
    parts = []
    for i, raw in enumerate(data["lowered"]):
        lowered, extra = Lowered.from_bytes(raw)
        parts.append(make_part(i, lowered, extra["has_module"]))
    return _Unpickler(io.BytesIO(data["graph"]), parts).load(), data["extra"]
