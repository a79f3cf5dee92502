"""Decide where each node of a graph runs, and reshape the graph to match.

Imports embed (for op names), decompositions and rewrites; nothing from compile or runtime.

Fallback order for a node that the composites did not take:
  1. torch-mlir's own lowering (inside IREE's torch input pipeline);
  2. a torch._decomp decomposition applied at FX level, then step 1 again;
  3. an eager PyTorch island between IREE parts.
Which nodes need 2 or 3 is learned from the compiler itself (see graph.py); this module
applies a `Plan` once it is known.
"""

from __future__ import annotations

import copy
import dataclasses
import operator

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._decomp import get_decompositions
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.split_module import split_module

from . import composites, symbolic
from .arith import _first_of
from .decompositions import FALLBACK, cast_to, expected_results
from .rewrites import PRE_LOWERING, needs_pre_lowering
from .embed import mlir_op_name
from .miscompiles import widened, widens

aten = torch.ops.aten


@dataclasses.dataclass
class Plan:
    """torch-mlir op names that go down fallback steps 2 and 3."""

    decompose: set[str] = dataclasses.field(default_factory=set)
    island: set[str] = dataclasses.field(default_factory=set)

    def to_json(self) -> dict:
        return {"decompose": sorted(self.decompose), "island": sorted(self.island)}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        return cls(set(data["decompose"]), set(data["island"]))


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The ATen op calls of a graph (getitem and other Python glue left out)."""
    return [
        n for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    ]


def is_symbolic(gm: fx.GraphModule) -> bool:
    """True when an input has symbolic sizes (Dynamo's dynamic shapes)."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return True
        if isinstance(val, torch.Tensor) and any(
            isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())
        ):
            return True
    return False


def retrace_symbolic(gm: fx.GraphModule, decompositions: dict | None = None) -> fx.GraphModule:
    """Trace `gm` again on its own symbolic inputs (Dynamo's dynamic shapes): sizes stay
    symbolic, and ops in `decompositions` are replaced by their decompositions."""
    values = symbolic.placeholder_values(gm)
    fake_mode = detect_fake_mode(values)
    # Under the Python dispatcher, as AOTAutograd traced it: ops whose C++ kernels take only
    # concrete sizes (constant_pad_nd's) then run their Python meta with symbolic ones.
    with fake_mode, enable_python_dispatcher(), fx_traceback.preserve_node_meta():
        return make_fx(_interpreted(gm), decomposition_table=decompositions or {}, tracing_mode="real")(*values)


def fold_known_sizes(gm: fx.GraphModule, shape_env) -> fx.GraphModule:
    """`gm` with every SymInt that Dynamo's ranges pin to one value (a symbol whose range is
    [0, 0], say) replaced by that int in the nodes that read it: sizes that are static in
    fact stay static in the module."""
    changed = False
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if not isinstance(val, torch.SymInt) or not node.users:
            continue
        bounds = shape_env.bound_sympy(val.node.expr)
        if bounds.lower != bounds.upper or not bounds.lower.is_number:
            continue
        value = int(bounds.lower)
        for user in list(node.users):
            if user.op != "output":
                user.replace_input_with(node, value)
                changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def retrace(gm: fx.GraphModule, args: list, decompositions: dict | None = None) -> fx.GraphModule:
    """Trace `gm` again on fake copies of concrete `args`: sizes become constants, every node
    gets fresh metadata, and ops in `decompositions` are replaced by their decompositions."""
    with fx_traceback.preserve_node_meta():
        return make_fx(
            _interpreted(gm),
            decomposition_table=decompositions or {},
            tracing_mode="fake",
            _allow_non_fake_inputs=True,
        )(*args)


def _interpreted(gm: fx.GraphModule):
    """`gm` run node by node, so that under `preserve_node_meta` the nodes traced from a
    node keep its module stack (blocks.block_labels reads it)."""
    def run(*args):
        return fx.Interpreter(gm).run(*args)

    return run


def _is_empty(val) -> bool:
    """An empty tensor result; a symbolic size counts only when it is 0 for every size."""
    return isinstance(val, torch.Tensor) and statically_known_true(val.numel() == 0)


def fold_empty(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or a copy of it in which every op whose result is an empty tensor is replaced
    by `aten.full` of that shape: an empty result has no values to compute, and IREE 3.13's
    compiler fails on many ops over empty tensors (stack of [0, 1, 0], for one)."""
    empty = [
        n for n in compute_nodes(gm)
        if _is_empty(n.meta.get("val")) and n.target is not aten.full.default
    ]
    if not empty:
        return gm
    gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = symbolic.sources([n.meta.get("val") for n in placeholders])
    for node in compute_nodes(gm):
        val = node.meta.get("val")
        if not _is_empty(val) or node.target is aten.full.default:
            continue
        with gm.graph.inserting_before(node):
            shape = [_size_arg(gm.graph, placeholders, where, d) for d in val.shape]
        if None in shape:  # a symbolic size no input gives as it is: the op stays
            continue
        with gm.graph.inserting_before(node):
            full = gm.graph.call_function(aten.full.default, (shape, 0), {"dtype": val.dtype, "device": val.device})
        full.meta = dict(node.meta)
        node.replace_all_uses_with(full)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _size_arg(graph: fx.Graph, placeholders: list[fx.Node], where: dict, size):
    """`size` as an argument of a node: an int, or the input (or sym_size of an input's dim)
    that gives its symbol (symbolic.sources `where`), or None when no input gives it."""
    if isinstance(size, int):
        return size
    found = where.get(getattr(symbolic.expr(size), "name", None))
    if found is None:
        return None
    i, dim = found
    if dim is None:
        return placeholders[i]
    read = graph.call_function(aten.sym_size.int, (placeholders[i], dim))  # dead code if unused
    read.meta["val"] = size
    return read


def _values(node: fx.Node) -> tuple[tuple, dict]:
    """The node's arguments with tensors as their meta values."""
    def value(a):
        if isinstance(a, (list, tuple)):
            return type(a)(value(b) for b in a)
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    return tuple(value(a) for a in node.args), {k: value(v) for k, v in node.kwargs.items()}


def op_for_name(name: str):
    """The OpOverload torch-mlir calls `name` (torch.aten.sum.dim_IntList), or None."""
    parts = name.split(".")
    if len(parts) not in (3, 4) or parts[0] != "torch":
        return None
    packet = getattr(getattr(torch.ops, parts[1], None), parts[2], None)
    return getattr(packet, parts[3] if len(parts) == 4 else "default", None)


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides wherever a size is not 1 (a size-1 dim's stride means nothing), decided
    without a guard on symbolic sizes, and outside the trace: a comparison of strides that no
    node computes (s0*s1**2 where height and width are one symbol) cannot be traced."""
    with disable_proxy_modes_tracing():
        return all(statically_known_true(n == 1) or statically_known_true(x == y)
                   for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _to_layout(x, like):
    """`x` with the strides of `like` (same shape), as a permute of a contiguous copy; `x`
    itself when it has them already or when `like` is not a dense permuted layout."""
    if not isinstance(x, torch.Tensor) or not isinstance(like, torch.Tensor) or _same_strides(x, like):
        return x
    with disable_proxy_modes_tracing():  # comparisons of strides, as in _same_strides
        order = symbolic.outer_first(like)
    inverse = sorted(range(like.dim()), key=order.__getitem__)
    out = x.permute(order).contiguous().permute(inverse)
    return out if _same_strides(out, like) else x


def keep_strides(op, decomposition):
    """`decomposition` returning tensors with the dtypes and strides of `op`'s own results
    (dtypes: see decompositions.keep_dtypes). A graph
    traced through `op` may view its results (AOTAutograd's backward views a permute of the
    CPU flash-attention gradients, laid out [B, S, H, D]); a decomposition that makes them
    contiguous instead breaks that view when the graph is traced again."""

    def run(*args, **kwargs):
        out = decomposition(*args, **kwargs)
        if out is NotImplemented:
            return out
        expected = expected_results(op, args, kwargs)
        if expected is None:  # no fake kernel for `op`: keep what the decomposition made
            return out
        out = cast_to(out, expected)
        if isinstance(out, (tuple, list)):
            fixed = [_to_layout(o, e) for o, e in zip(out, expected)]
            return fixed if isinstance(out, list) else tuple(fixed)  # torch.return_types too
        return _to_layout(out, expected)

    return run


def _implicit_decomposition(op) -> dict:
    """{op: its own CompositeImplicitAutograd kernel}, where it has one. Dispatch runs such a
    kernel before any graph is traced, so torch._decomp has no entry for the op; passes that
    run on the traced graph still emit some. AOTAutograd's tensorify_python_scalars turns the
    arithmetic on a Python float that dynamic=True left unspecialized (`2.0 / math.pi`) back
    into 0-d tensor ops, its truediv as aten.true_divide.Tensor, which torch-mlir has no
    lowering for. Retracing runs the kernel (true_divide is div), so nothing is left to island."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    if isinstance(op, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
        return {op: op.decompose}
    return {}


def decomposition_table(names: set[str]) -> tuple[dict, set[str]]:
    """Decompositions for the ops named in `names` (boo's own first, then a boo custom op's
    reference, then torch._decomp, then the op's CompositeImplicitAutograd kernel); also the
    names that have none."""
    table: dict = {}
    missing: set[str] = set()
    for name in sorted(names):
        op = op_for_name(name)
        found = {}
        if op is not None:
            if op in FALLBACK:
                found = {op: FALLBACK[op]}
            elif op.namespace == "boo" and op in composites.REGISTRY:
                found = {op: composites.REGISTRY[op].reference}
            else:
                found = get_decompositions([op]) or _implicit_decomposition(op)
        if found:
            table.update({o: keep_strides(o, fn) for o, fn in found.items()})
        else:
            missing.add(name)
    return table, missing


def preparation_table(gm: fx.GraphModule, decompositions: dict, canonical: dict) -> dict:
    """Everything one retrace applies: the pre-lowering rewrites where a node needs one, the
    composites' canonical forms, and the plan's decompositions (which win). make_fx applies
    the table to the ops that decompositions emit too, so one trace is enough."""
    table = dict(canonical)
    if any(needs_pre_lowering(n.target, *_values(n)) for n in compute_nodes(gm)):
        # A rewrite that leaves a call alone (NotImplemented) still lets the composite's
        # canonical form apply to it. Each returns its op's own strides: one call that needs
        # a rewrite applies them all, and a contiguous slice_scatter of a permuted tensor
        # broke a later view (Funnel's relative shift).
        table.update({op: _first_of(keep_strides(op, rewrite), canonical[op]) if op in canonical
                      else keep_strides(op, rewrite) for op, rewrite in PRE_LOWERING.items()})
    table.update(decompositions)
    # Unsigned integers where IREE would compute them as signed: in a wider signed type
    # (miscompiles.widened), ahead of whatever else the table does with the op.
    for op in {n.target for n in compute_nodes(gm) if widens(n)}:
        table[op] = _first_of(keep_strides(op, widened(op)), table[op]) if op in table else keep_strides(op, widened(op))
    return table


# Copies that only change a layout. With the views (an op's `is_view`), they are all a part
# that only moves data holds; such a part of a split graph runs in torch (moves_only): an
# IREE call for it costs its fixed overhead and a copy on one core, where torch's views are
# free and its copies take two threads (a transformer layer's query/key/value heads made
# dense for ATen's attention kernel: 8x128x256 floats, 0.6 ms a step as an IREE part).
_COPIES = frozenset({aten.clone.default, aten._unsafe_view.default})


def moves_only(gm: fx.GraphModule) -> bool:
    """Whether a part computes nothing: at least one op, each a view or one of _COPIES."""
    ops = compute_nodes(gm)
    return bool(ops) and all(n.target.is_view or n.target in _COPIES for n in ops)


# Ops that may run as ATen kernels by choice (BOO_ATEN_MATMUL; see extern.py), the way
# Inductor calls extern kernels.
ATEN_MATMUL = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
})
# ... and ops that only BOO_ATEN_MATMUL=auto weighs (never "always"): the CPU's attention
# kernels, whose composite was measured 3-4x slower than ATen's on an AVX2 CPU.
ATEN_MEASURED = ATEN_MATMUL | frozenset({
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
})


def node_places(gm: fx.GraphModule, plan: Plan, extern: set[fx.Node] | frozenset = frozenset()) -> dict[fx.Node, str]:
    """'iree', 'eager' (an island) or 'aten' (an extern kernel by choice: the nodes in
    `extern`) for each call node; getitem follows the node it reads."""
    places: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0] in places:
            places[node] = places[node.args[0]]
        elif mlir_op_name(node.target) in plan.island:
            places[node] = "eager"
        else:
            places[node] = "aten" if node in extern else "iree"
    if extern:
        _views_follow_users(gm, places)
    return places


def _views_follow_users(gm: fx.GraphModule, places: dict[fx.Node, str]) -> None:
    """A view (a weight's transpose, say) whose every user runs outside IREE, or is the
    graph's output, runs outside too, as a free view: in IREE it would be a copy."""
    for node in reversed(gm.graph.nodes):
        if places.get(node) != "iree" or not getattr(node.target, "is_view", False):
            continue
        outside = {"output" if u.op == "output" else places.get(u) for u in node.users}
        if node.users and outside <= {"aten", "eager", "output"}:
            places[node] = "eager" if outside == {"eager"} else "aten"


def split_islands(gm: fx.GraphModule, places: dict[fx.Node, str],
                  labels: dict | None = None) -> tuple[fx.GraphModule, dict[str, str]]:
    """Cut `gm` into consecutive runs of same-place nodes, and also where a node's label (its
    repeated block, blocks.block_labels) changes. Returns the outer graph, whose submodules
    `submod_N` are the runs, and each submodule's place."""
    labels = labels or {}
    index: dict[fx.Node, int] = {}
    part, previous = -1, None
    for node in gm.graph.nodes:
        if node not in places:
            continue
        if node.target is operator.getitem and node.args[0] in index:
            index[node] = index[node.args[0]]
            continue
        if (places[node], labels.get(node)) != previous:
            part, previous = part + 1, (places[node], labels.get(node))
        index[node] = part
    place_of_part = {f"submod_{index[n]}": places[n] for n in index}
    outer = split_module(gm, None, lambda n: index[n], keep_original_order=True)
    return outer, place_of_part


def split_independent(gm: fx.GraphModule, parts: int) -> tuple[fx.GraphModule, dict[str, str]]:
    """Cut `gm` into up to `parts` IREE submodules, each a run of whole connected components
    of its computation (nodes joined by data edges; inputs join nothing), or, where it has
    fewer components than parts, a run of its nodes in order. For graphs whose single module
    IREE 3.13 builds with a dispatch of more bindings than its runtime allows (32): many
    independent chains (an optimizer step over many parameters), or many inputs that meet
    (gradient clipping's norms of every gradient, a sum of many tensors)."""
    parent: dict[fx.Node, fx.Node] = {}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    for n in calls:
        parent[n] = n
        for a in n.all_input_nodes:
            if a in parent:
                parent[root(a)] = root(n)
    components = list(dict.fromkeys(root(n) for n in calls))
    if len(components) >= parts:
        chunk = {c: i * parts // len(components) for i, c in enumerate(components)}
        index = {n: chunk[root(n)] for n in calls}
    else:
        index = {n: i * parts // len(calls) for i, n in enumerate(calls)}
    outer = split_module(gm, None, lambda n: index[n], keep_original_order=True)
    return outer, {f"submod_{k}": "iree" for k in set(index.values())}

