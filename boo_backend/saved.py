"""A graph cut into parts (IREE modules between ATen matmuls and eager islands, or a model's
repeated blocks), as bytes for the compile cache, so that a warm start rebuilds it without
retracing, matching, placing or importing anything.

The outer graph and its ATen/eager parts are torch.fx GraphModules, stored as their nodes
(torch.fx's own pickling stores the generated code and traces it again on load, which for
GPT-2's 198 modules cost a warm start 1.3 s); ATen parts that compute the same are stored once.
Each IREE part is stored once, however many parts share it, as its lowered form
(`Lowered.to_bytes`); loading hands each to `make_part`, which compiles it through the cache
(a hit) and loads it. The cache directory is private to its user and already holds the
native code boo runs (see cache.py), so unpickling its entries trusts nothing new.

Imports blocks (structure_key), part (IreePart) and lower (Lowered) from boo_backend.
"""

from __future__ import annotations

import io
import operator
import pickle

import torch
import torch.fx as fx

from .blocks import structure_key
from .lower import Lowered
from .part import IreePart


class _Ref:
    """A node of the graph being rebuilt, by name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return _Ref, (self.name,)


def _op_packet(qualified: str):
    namespace, name = qualified.split("::")
    return getattr(getattr(torch.ops, namespace), name)


def _op_overload(qualified: str, overload: str):
    return getattr(_op_packet(qualified), overload)


def _higher_order(name: str):
    return getattr(torch.ops.higher_order, name)


def _graph_module(nodes: list, attrs: dict, codegen) -> fx.GraphModule:
    """A GraphModule rebuilt from the nodes `_Pickler` stored, generating its code once."""
    graph = fx.Graph()
    graph._codegen = codegen
    env: dict[str, fx.Node] = {}

    def resolve(a):
        return env[a.name] if isinstance(a, _Ref) else a

    for op, name, target, args, kwargs in nodes:
        node = graph.create_node(op, target, fx.node.map_aggregate(args, resolve),
                                 fx.node.map_aggregate(kwargs, resolve), name=name)
        if node.name != name:
            raise pickle.UnpicklingError(f"node {name} came back as {node.name}")
        env[name] = node
    return fx.GraphModule(attrs, graph)


class _Pickler(pickle.Pickler):
    def __init__(self, file, lowered: list[bytes]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.lowered = lowered
        self.index: dict[int, int] = {}
        self.stateless: dict[str, fx.GraphModule] = {}

    def persistent_id(self, obj):
        if isinstance(obj, IreePart):
            if id(obj) not in self.index:
                self.index[id(obj)] = len(self.lowered)
                self.lowered.append(obj.lowered.to_bytes({"has_module": obj.function is not None}))
            return ("iree", self.index[id(obj)])
        return None

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _op_overload, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _op_packet, (obj._qualified_op_name,)
        if isinstance(obj, torch._ops.HigherOrderOperator) and obj.namespace == "higher_order":
            return _higher_order, (obj.name(),)
        if isinstance(obj, fx.GraphModule):
            return self._graph_module(obj)
        return NotImplemented

    def _graph_module(self, gm: fx.GraphModule):
        attrs = {n.target: operator.attrgetter(n.target)(gm) for n in gm.graph.nodes
                 if n.op in ("get_attr", "call_module")}
        if not attrs:  # a stateless part: one copy for every part that computes the same
            first = self.stateless.setdefault(structure_key(gm), gm)
            if first is not gm:
                return _same, (first,)
        nodes = [(n.op, n.name, n.target, fx.node.map_arg(n.args, lambda a: _Ref(a.name)),
                  fx.node.map_arg(n.kwargs, lambda a: _Ref(a.name))) for n in gm.graph.nodes]
        return _graph_module, (nodes, attrs, gm.graph._codegen)


def _same(obj):
    return obj


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
