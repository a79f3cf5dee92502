"""FX -> torch-mlir: cut a graph down to what IREE computes, then import it as torch dialect.

Imports checks, symbolic, torch_import (the import itself), config and miscompiles (pieces_in_order) from boo_backend.

An AOTAutograd graph returns more than computed tensors: its own inputs (aliases), `None`
gradients, plain numbers, constants. IREE only sees the *core*: tensor inputs that some
computation reads, and the tensors that computation produces. Everything else is wired up
in Python from an output plan.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import operator
import pickle

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from . import checks, symbolic, torch_import
from .config import BooError
from .miscompiles import pieces_in_order

log = logging.getLogger("boo_backend")


@dataclasses.dataclass
class Lowered:
    """A graph ready for IREE, plus how to map its results back to the graph's outputs."""

    mlir: str
    core: fx.GraphModule | None  # None when loaded from the cache
    # Per IREE argument: ("arg", index into the graph's inputs), ("const", tensor),
    # ("permuted", (index, order)): the input permuted by `order` (see _dense_order), or
    # ("size", text): a size the graph computes that torch-mlir cannot (see _on_host),
    # evaluated per call from the inputs' sizes.
    inputs: list[tuple]
    # Per graph output: ("arg", i), ("result", j), ("value", python_value), ("size", text):
    # a SymInt the graph returns, as a symbolic.text expression of its inputs' sizes, or
    # ("view", (i, shape, stride, offset, dtype)): a view of input i (see _view_of_input),
    # ("alias", (k, shape, stride, offset, dtype)): a view of output k (_views_of_outputs), or
    # ("permuted", (j, order)): result j permuted by `order` (IREE wrote it dense; build_core).
    outputs: list[tuple]
    # Per IREE result: the (shape, stride) the graph says it has; in a graph with dynamic
    # shapes, a symbolic size is a symbolic.text expression (a str), and a stride that is
    # dense row-major for every size is None.
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
    # Where each symbol of the sizes above is read in the graph's inputs (symbolic.sources);
    # empty when no output size is symbolic.
    symbols: dict = dataclasses.field(default_factory=dict)
    # IREE results written into storage the caller passes (storage.with_storage), in the order of
    # the extra arguments that follow `inputs`; the module returns the others.
    placed: tuple[int, ...] = ()
    # The core pickled, as the compile cache keeps it: `graph()` unpickles it on first use.
    graph_blob: bytes | None = None
    # The last IREE results are 0-d bools, one per check (an index out of range, a division
    # by zero): the keys of checks.RAISES, in order.
    checks: tuple[str, ...] = ()

    _FIELDS = ("mlir", "inputs", "outputs", "result_layouts", "tuple_output", "kernels", "writes",
               "result_dtypes", "symbols", "placed", "checks")

    def to_bytes(self, extra: dict) -> bytes:
        """For the compile cache (torch.save, loadable with weights_only=True): the fields,
        `extra`, and the core pickled (torch.fx's pickling, its generated code), which a warm
        start unpickles only for a part that runs in ATen (runtime: the "aten" driver)."""
        buf = io.BytesIO()
        torch.save({**{f: getattr(self, f) for f in self._FIELDS}, "graph": self._pickled(), "extra": extra}, buf)
        return buf.getvalue()

    def _pickled(self) -> bytes | None:
        if self.core is None:
            return self.graph_blob
        try:
            return pickle.dumps(self.core, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # a constant fx cannot pickle: the part then stays in IREE
            log.debug("boo: a core graph does not pickle (%s); it cannot run in ATen on a warm start", e)
            return None

    @classmethod
    def from_bytes(cls, blob: bytes) -> tuple["Lowered", dict]:
        data = torch.load(io.BytesIO(blob), weights_only=True)
        fields = {f: data[f] for f in cls._FIELDS if f in data}
        return cls(core=None, graph_blob=data.get("graph"), **fields), data["extra"]

    def graph(self) -> fx.GraphModule | None:
        """The core graph: the one built here, or the compile cache's copy (None if it kept
        none). The cache directory is private to its user and already holds the native code
        boo runs (cache.py), so unpickling its entries trusts nothing new."""
        if self.core is None and self.graph_blob:
            self.core = pickle.loads(self.graph_blob)
        return self.core


def _is_tensor_value(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _size(value) -> int | str:
    """An int, or the symbolic.text of a symbolic size."""
    return int(symbolic.expr(value)) if symbolic.is_static(value) else symbolic.text(value)


def _layout(val: torch.Tensor) -> tuple:
    """(shape, stride) of a result; for symbolic sizes the stride is None when it is the
    dense row-major one whatever the sizes are (IREE's layout: nothing to do per call)."""
    shape = tuple(map(_size, val.shape))
    if not any(isinstance(x, str) for x in (*shape, *map(_size, val.stride()))):
        return shape, tuple(map(_size, val.stride()))
    dense = symbolic.is_row_major(val.shape, val.stride())
    return shape, None if dense else tuple(map(_size, val.stride()))


def _view_plan(index: int, val: torch.Tensor, base: torch.Tensor) -> tuple:
    """(index, shape, stride, storage offset past `base`'s, dtype) of `val`, a view of `base`:
    the dtype is the view's where it differs from the base's (else None), and the offset
    counts the view's elements (part._view makes it)."""
    if val.dtype.itemsize == base.dtype.itemsize:
        offset = val.storage_offset() - base.storage_offset()
    else:
        size = val.dtype.itemsize
        offset = (val.storage_offset() * size - base.storage_offset() * base.dtype.itemsize) // size
    return (index, tuple(map(_size, val.shape)), tuple(map(_size, val.stride())), _size(offset),
            None if val.dtype == base.dtype else val.dtype)


def _view_of_input(value: fx.Node, placeholders: list[fx.Node]) -> tuple | None:
    """The _view_plan of an output that is a view of a graph input (a split's piece, a slice,
    `x.view(torch.int16)`), by the input's index, or None. Such an output is made from
    the input itself, as eager makes it, not computed by IREE: AOTAutograd rebuilds outputs
    that alias inputs from the tensor returned (its sizes, strides and storage offset)
    whenever their views take symbolic arguments, so a fresh result would be read as a view
    at offset 0."""
    from torch.multiprocessing.reductions import StorageWeakRef

    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_sparse:
        return None
    storage = StorageWeakRef(val.untyped_storage())
    for i, p in enumerate(placeholders):
        base = p.meta.get("val")
        if isinstance(base, torch.Tensor) and StorageWeakRef(base.untyped_storage()) == storage:
            return _view_plan(i, val, base)
    return None


def _owns_storage(val: torch.Tensor) -> bool:
    """Whether `val` fills its whole storage from offset 0, each element once, as a result
    IREE writes does: an `_unsafe_view` of a larger tensor (a piece of a fused projection) is
    not a view, yet shares memory it does not span; the diagonal of a square matrix spans
    its storage but skips the rest (a base made of it would be read where nothing was
    written)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not statically_known_true(val.numel() > 0):
        return False
    extent = 1 + sum((n - 1) * s for n, s in zip(val.shape, val.stride()))
    return (statically_known_true(val.storage_offset() == 0) and statically_known_true(val.numel() == extent)
            and statically_known_true(val.untyped_storage().nbytes() == extent * val.dtype.itemsize))


def _views_of_outputs(flat: list, placeholders: list[fx.Node]) -> dict[int, tuple]:
    """{position: the _view_plan by its base's position} for the outputs that are views of
    another output the graph computes (`d, d.view(3, -1), d[0]`, `d.view(torch.int16)`).
    Such an output is made from its base, so the two share
    memory as in eager: a write into one shows in the other. AOTAutograd rebuilds these views
    itself only where a gradient is traced; an inference graph returns them as they come. A
    view of a tensor that is not returned itself is computed as a result of its own."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def tensor(value):
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        return val if isinstance(val, torch.Tensor) and val.layout == torch.strided else None

    bases = {}
    for k, value in enumerate(flat):
        val = tensor(value)
        if (val is not None and not val._is_view() and _owns_storage(val) and value.op != "placeholder"
                and _view_of_input(value, placeholders) is None):
            bases.setdefault(StorageWeakRef(val.untyped_storage()), (k, value, val))
    views = {}
    for k, value in enumerate(flat):
        val = tensor(value)
        base = bases.get(StorageWeakRef(val.untyped_storage())) if val is not None else None
        if base is None or base[1] is value:
            continue
        views[k] = _view_plan(base[0], val, base[2])
    return views


def _dense_order(val) -> list[int] | None:
    """For a tensor of static sizes that is not contiguous but is a permutation of a dense
    layout (a transposed weight, attention's gradients in (batch, token, head) order seen as
    (batch, head, token)): the order of its dims from the outermost stride in, which makes it
    contiguous. Passed permuted so, it reaches IREE as it lies in memory, not as a copy."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or symbolic.tensor_is_symbolic(val) or val.is_contiguous():
        return None
    order = symbolic.outer_first(val)
    return order if val.permute(order).is_contiguous() else None


def _inverse(order) -> list[int]:
    """The permutation that undoes `order`."""
    return sorted(range(len(order)), key=order.__getitem__)


def arguments(inputs: list[tuple], args, sizes: dict | None = None) -> list:
    """IREE's arguments for one call: `inputs` (Lowered.inputs) taken from the graph's `args`,
    and `sizes`, the values of the call's symbolic sizes (text -> int)."""
    return [args[v] if k == "arg" else args[v[0]].permute(v[1]) if k == "permuted" else sizes[v] if k == "size"
            else v for k, v in inputs]


# Arithmetic on sizes that torch-mlir imports as it means: the rest (`%`, which it imports as
# fmod and then cannot lower, `max`, `min`: sym_max and sym_min, which it does not import)
# is computed on the host, and the module takes the result as an argument. Without that,
# a graph that pads a length to a multiple (`(-n) % 8`) or takes TF's `same` padding
# (`max(k - n % s, 0)`) compiled once per shape.
_IMPORTED_SIZE_OPS = frozenset({
    torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_stride.default, torch.ops.aten.sym_numel.default,
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.neg,
})


def _on_host(node: fx.Node) -> bool:
    """A size the module is given rather than computes (see _IMPORTED_SIZE_OPS)."""
    val = node.meta.get("val")
    if node.op != "call_function" or symbolic.is_static(val):
        return False
    # A float of sizes (`d ** -0.5` of a symbolic head size): torch-mlir imports no sym_float.
    return isinstance(val, torch.SymFloat) or (isinstance(val, torch.SymInt) and node.target not in _IMPORTED_SIZE_OPS)


def _sizes_as_tensors(graph: fx.Graph, node: fx.Node) -> None:
    """A size (a SymInt or SymFloat node) given where the op takes a Tensor becomes a 0-d
    tensor, as eager wraps a number (`torch.div(n, w, rounding_mode="trunc")` of two sizes,
    Longformer's chunk count). torch-mlir imports it as a !torch.int operand, which the op
    rejects, and the graph compiled once per shape."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    for i, arg in enumerate(schema.arguments[:len(node.args)]):
        value = node.args[i]
        if (isinstance(arg.type, torch.TensorType) and isinstance(value, fx.Node)
                and isinstance(v := value.meta.get("val"), (torch.SymInt, torch.SymFloat))):
            dtype = torch.int64 if isinstance(v, torch.SymInt) else torch.float64
            with graph.inserting_before(node):
                wrapped = graph.call_function(torch.ops.aten.scalar_tensor.default, (value,), {"dtype": dtype})
            val = torch.empty((), dtype=dtype, device="meta")
            wrapped.meta = {"val": val, "tensor_meta": _extract_tensor_metadata(val)}
            node.update_arg(i, wrapped)


def _sizes_read_from_shapes(graph: fx.Graph) -> None:
    """A size input that is a dimension of a tensor input is read from that tensor
    (aten.sym_size) wherever the graph uses it. IREE 3.13 fails to compile some dispatches
    that compute from sizes passed as integers ('write affecting operations on global
    resources are restricted to workgroup distributed contexts': a running count over
    positions made with arange(n), as in Mistral's masks; 'failed to resolve workgroup count
    hint': Mamba's depthwise conv over a slice), and the graph compiled once per shape; the
    same sizes read from the tensors compile. Only for such a module (Assembly._compile_part),
    as a safeguard: built this way, BERT's backward once had a gradient 7% off at batch 4,
    length 70, because IREE fused dO's permute into the attention backward kernel (which now
    takes its inputs apart: kernels/_helpers.mlir's `apart`)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    dims: dict = {}
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, n in enumerate(val.shape):
                if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                    dims.setdefault(n.node.expr, (node, d))
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and node.users and (dim := dims.get(val.node.expr)) is not None:
            with graph.inserting_before(first):
                size = graph.call_function(torch.ops.aten.sym_size.int, dim)
            size.meta = dict(node.meta)
            node.replace_all_uses_with(size)


def build_core(gm: fx.GraphModule, sizes_from_shapes: bool = False) -> tuple[fx.GraphModule, list, list, list, bool]:
    """Split `gm` into the IREE core graph and the Python-side input/output plan
    (`sizes_from_shapes`: see _sizes_read_from_shapes)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[tuple] = []
    arg_index = 0
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            computes = any(u.op != "output" for u in node.users)
            if computes and not _is_tensor_value(node) and not isinstance(node.meta.get("val"), torch.SymInt):
                raise BooError(
                    f"boo: graph input {node.name} is not a tensor ({node.meta.get('val')!r}) "
                    "but a computation reads it; specialize the graph first"
                )
            if computes:
                env[node] = graph.placeholder(node.name)
                order = _dense_order(node.meta.get("val"))
                if order is None:
                    env[node].meta = dict(node.meta)
                    inputs.append(("arg", arg_index))
                else:  # IREE reads the memory as it lies, and permutes it back in the module
                    env[node].meta = {"val": node.meta["val"].permute(order)}
                    back = _inverse(order)
                    env[node] = graph.call_function(torch.ops.aten.permute.default, (env[node], back))
                    env[node].meta = dict(node.meta)
                    inputs.append(("permuted", (arg_index, order)))
            arg_index += 1
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                raise BooError(f"boo: graph attribute {node.target} is not a tensor")
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            env[node].meta.setdefault("val", value)
            inputs.append(("const", value))
        elif _on_host(node):
            # A placeholder after the last one so far: placeholders keep the order of `inputs`.
            last = [n for n in graph.nodes if n.op == "placeholder"]
            with graph.inserting_after(last[-1]) if last else graph.inserting_before(None):
                env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            inputs.append(("size", symbolic.text(node.meta["val"])))
        elif node.op == "call_function":
            env[node] = graph.node_copy(node, lambda n: env[n])
            _sizes_as_tensors(graph, env[node])
        elif node.op != "output":
            raise BooError(f"boo: unexpected FX node {node.op} {node.target} in an ATen graph")

    raw = out_node.args[0]
    tuple_output = isinstance(raw, (tuple, list))
    flat = list(raw) if tuple_output else [raw]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs: list[tuple] = []
    results: list[fx.Node] = []
    made: dict[fx.Node, int] = {}  # graph output -> its IREE result
    result_layouts: list = []
    views = _views_of_outputs(flat, placeholders)
    for k, value in enumerate(flat):
        if k in views:
            outputs.append(("alias", views[k]))
        elif isinstance(value, fx.Node) and value.op == "placeholder":
            outputs.append(("arg", placeholders.index(value)))
        elif isinstance(value, fx.Node) and value.meta.get("val", 0) is None:
            outputs.append(("value", None))  # e.g. a getitem of a gradient output_mask left out
        elif isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.SymInt):
            size = _size(value.meta["val"])
            outputs.append(("value", size) if isinstance(size, int) else ("size", size))
        elif isinstance(value, fx.Node) and (view := _view_of_input(value, placeholders)) is not None:
            outputs.append(("view", view))
        elif isinstance(value, fx.Node):
            if not _is_tensor_value(value):
                raise BooError(f"boo: graph output {value.name} is not a tensor; cannot return it from IREE")
            val = value.meta["val"]
            # A result eager lays out as a permutation of a dense layout (a matmul's transpose,
            # attention's heads) is written by IREE in that order, dense, and handed back
            # permuted: a view with eager's strides (but in size-1 dims, which no read depends
            # on, as for any result), not a copy into eager's layout.
            order = _dense_order(val)
            if value not in made:
                mapped = env[value]
                if order is not None:
                    mapped = graph.call_function(torch.ops.aten.permute.default, (mapped, list(order)))
                    mapped.meta = {"val": val.permute(order)}
                made[value] = len(results)
                results.append(mapped)
                result_layouts.append(_layout(mapped.meta["val"] if order is not None else val))
            if order is None:
                outputs.append(("result", made[value]))
            else:
                outputs.append(("permuted", (made[value], tuple(_inverse(order)))))
        else:
            outputs.append(("value", value))
    for flag, kind in checks.checked(graph):  # the last results: whether each check failed
        flag.meta["check"] = kind
        results.append(flag)
        result_layouts.append(_layout(flag.meta["val"]))
    graph.output(tuple(results))
    if sizes_from_shapes:
        _sizes_read_from_shapes(graph)
    core = fx.GraphModule(torch.nn.Module(), graph)
    core.graph.eliminate_dead_code()
    pieces_in_order(core.graph)
    # An input only views of which leave (returned as views, on the Python side) is not
    # passed: passing it would copy it when it is not dense (a transposed weight: 150 MB).
    kept = []
    for node, source in zip([n for n in core.graph.nodes if n.op == "placeholder"], inputs):
        val = node.meta.get("val")
        if not node.users and isinstance(val, torch.Tensor) and not symbolic.tensor_is_symbolic(val):
            core.graph.erase_node(node)
        else:
            kept.append(source)
    core.recompile()
    return core, kept, outputs, result_layouts, tuple_output


def output_texts(outputs: list) -> list[str]:
    """The symbolic sizes (symbolic.text) that the output plan needs evaluated per call."""
    texts = [v for k, v in outputs if k == "size"]
    for kind, v in outputs:
        if kind in ("view", "alias"):
            _, shape, stride, offset = v[:4]
            texts += [x for x in (*shape, *stride, offset) if isinstance(x, str)]
    return texts


def _symbols(gm: fx.GraphModule, inputs: list, outputs: list, layouts: list) -> dict:
    """symbolic.sources of `gm`'s inputs, when its outputs' sizes (or sizes computed for the
    module: `inputs`) are symbolic; a BooError
    when a symbol they need cannot be read from the inputs."""
    texts = output_texts(outputs) + [v for k, v in inputs if k == "size"]
    texts += [x for shape, stride in layouts if stride for x in (*shape, *stride) if isinstance(x, str)]
    if not texts:
        return {}
    where = symbolic.sources([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    missing = set().union(*(symbolic.free_names(t) for t in texts)) - set(where)
    if missing:
        raise BooError(f"boo: sizes {sorted(missing)} cannot be read from the graph's inputs")
    return where


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


def lower(gm: fx.GraphModule, sizes_from_shapes: bool = False) -> Lowered:
    core, inputs, outputs, layouts, tuple_output = build_core(gm, sizes_from_shapes)
    symbols = _symbols(gm, inputs, outputs, layouts)
    text, kernels = torch_import.import_core(core)
    out = next(n for n in core.graph.nodes if n.op == "output").args[0]
    dtypes = [str(r.meta["val"].dtype).removeprefix("torch.") for r in out]
    return Lowered(text, core, inputs, outputs, layouts, tuple_output, kernels, written_inputs(core), dtypes,
                   symbols, checks=tuple(r.meta["check"] for r in out if "check" in r.meta))

