"""FX -> torch-mlir: cut a graph down to what IREE computes, then import it as torch dialect.

Imports only config from boo_backend.

An AOTAutograd graph returns more than computed tensors: its own inputs (aliases), `None`
gradients, plain numbers, constants. IREE only sees the *core*: tensor inputs that some
computation reads, and the tensors that computation produces. Everything else is wired up
in Python from an output plan.
"""

from __future__ import annotations

import dataclasses
import io
import re

import torch
import torch.fx as fx
from torch_mlir import fx as tm_fx

from .config import BooError
from .embed import embed


@dataclasses.dataclass
class Lowered:
    """A graph ready for IREE, plus how to map its results back to the graph's outputs."""

    mlir: str
    core: fx.GraphModule | None  # None when loaded from the cache
    # Per IREE argument: ("arg", index into the graph's inputs) or ("const", tensor).
    inputs: list[tuple]
    # Per graph output: ("arg", i), ("result", j) or ("value", python_value).
    outputs: list[tuple]
    # Per IREE result: the (shape, stride) the graph says it has, or None if unknown.
    result_layouts: list
    # The output node's args were a tuple (True) or a single value (False).
    tuple_output: bool
    # Composite kernel functions in the module.
    kernels: list[str] = dataclasses.field(default_factory=list)
    # IREE arguments that an in-place kernel may write into (see written_inputs).
    writes: tuple[int, ...] = ()
    # Per IREE result: its torch dtype's name (IREE's integers are signless, so an unsigned
    # result comes back as its signed twin and is reinterpreted).
    result_dtypes: list[str] = dataclasses.field(default_factory=list)

    _FIELDS = ("mlir", "inputs", "outputs", "result_layouts", "tuple_output", "kernels", "writes",
               "result_dtypes")

    def to_bytes(self, extra: dict) -> bytes:
        """Everything but the FX graph, for the compile cache (torch.save, loadable with
        weights_only=True); `extra` rides along."""
        buf = io.BytesIO()
        torch.save({**{f: getattr(self, f) for f in self._FIELDS}, "extra": extra}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> tuple["Lowered", dict]:
        data = torch.load(io.BytesIO(blob), weights_only=True)
        fields = {f: data[f] for f in cls._FIELDS}
        return cls(core=None, **fields), data["extra"]


def _is_tensor_value(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def build_core(gm: fx.GraphModule) -> tuple[fx.GraphModule, list, list, list, bool]:
    """Split `gm` into the IREE core graph and the Python-side input/output plan."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[tuple] = []
    arg_index = 0
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            computes = any(u.op != "output" for u in node.users)
            if computes and not _is_tensor_value(node):
                raise BooError(
                    f"boo: graph input {node.name} is not a tensor ({node.meta.get('val')!r}) "
                    "but a computation reads it; specialize the graph first"
                )
            if computes:
                env[node] = graph.placeholder(node.name)
                env[node].meta = dict(node.meta)
                inputs.append(("arg", arg_index))
            arg_index += 1
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                raise BooError(f"boo: graph attribute {node.target} is not a tensor")
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            env[node].meta.setdefault("val", value)
            inputs.append(("const", value))
        elif node.op == "call_function":
            env[node] = graph.node_copy(node, lambda n: env[n])
        elif node.op != "output":
            raise BooError(f"boo: unexpected FX node {node.op} {node.target} in an ATen graph")

    raw = out_node.args[0]
    tuple_output = isinstance(raw, (tuple, list))
    flat = list(raw) if tuple_output else [raw]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs: list[tuple] = []
    results: list[fx.Node] = []
    result_layouts: list = []
    for value in flat:
        if isinstance(value, fx.Node) and value.op == "placeholder":
            outputs.append(("arg", placeholders.index(value)))
        elif isinstance(value, fx.Node) and value.meta.get("val", 0) is None:
            outputs.append(("value", None))  # e.g. a getitem of a gradient output_mask left out
        elif isinstance(value, fx.Node):
            if not _is_tensor_value(value):
                raise BooError(f"boo: graph output {value.name} is not a tensor; cannot return it from IREE")
            mapped = env[value]
            if mapped not in results:
                results.append(mapped)
                val = value.meta["val"]
                result_layouts.append((tuple(val.shape), tuple(val.stride())))
            outputs.append(("result", results.index(mapped)))
        else:
            outputs.append(("value", value))
    graph.output(tuple(results))
    core = fx.GraphModule(torch.nn.Module(), graph)
    core.graph.eliminate_dead_code()
    core.recompile()
    return core, inputs, outputs, result_layouts, tuple_output


aten = torch.ops.aten

# Ops that torch-mlir lowers to kernels updating a tensor in place (TMTensor sort, topk,
# scatter, scan). Given a function argument, IREE 3.13 writes into the caller's buffer.
_IN_PLACE = frozenset({
    aten.sort.default, aten.sort.stable, aten.topk.default, aten.kthvalue.default,
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
    aten.scatter_add.default, aten.scatter_reduce.two, aten.index_put.default,
    aten._index_put_impl.default, aten.index_add.default, aten.index_copy.default,
    aten.masked_scatter.default, aten.cumsum.default, aten.cumprod.default,
})
# Ops whose result may share the argument's buffer once IREE elides the copy.
_PASS_THROUGH = frozenset({
    aten.clone.default, aten._to_copy.default, aten.alias.default, aten.copy.default,
    aten.lift_fresh_copy.default,
})


def written_inputs(core: fx.GraphModule) -> tuple[int, ...]:
    """Positions of `core`'s inputs that reach an in-place kernel through views and copies.
    The runtime passes those as copies (and checks the rest on the first call)."""
    found = []
    for i, node in enumerate(n for n in core.graph.nodes if n.op == "placeholder"):
        todo, seen = [node], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for user in n.users:
                if user.op != "call_function":
                    continue
                if user.target in _IN_PLACE:
                    found.append(i)
                    todo = []
                    break
                if user.target in _PASS_THROUGH or getattr(user.target, "is_view", False):
                    todo.append(user)
    return tuple(found)


_OPERATOR = re.compile(r'torch\.operator "(torch\.[\w.]+)"')


def unregistered_ops(mlir: str) -> list[str]:
    """torch-mlir names of ops the importer could only emit as opaque `torch.operator`."""
    return sorted(set(_OPERATOR.findall(mlir)))


def import_core(core: fx.GraphModule) -> tuple[str, list[str]]:
    """torch dialect text for `core`, with one public function `main` and the composite
    kernels it calls; also the kernels' function names."""
    module = tm_fx.stateless_fx_import(core, output_type="raw", model_name="main")
    kernels = embed(module, core.graph)
    return str(module), kernels


def lower(gm: fx.GraphModule) -> Lowered:
    core, inputs, outputs, layouts, tuple_output = build_core(gm)
    text, kernels = import_core(core)
    out = next(n for n in core.graph.nodes if n.op == "output").args[0]
    dtypes = [str(r.meta["val"].dtype).removeprefix("torch.") for r in out]
    return Lowered(text, core, inputs, outputs, layouts, tuple_output, kernels, written_inputs(core), dtypes)
