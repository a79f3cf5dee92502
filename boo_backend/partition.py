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
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.split_module import split_module

from . import composites, symbolic
from .decompositions import FALLBACK, cast_to, expected_results
from .rewrites import PRE_LOWERING, needs_pre_lowering
from .embed import mlir_op_name


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
    sizes = _size_readers(gm)
    for node in compute_nodes(gm):
        val = node.meta.get("val")
        if not _is_empty(val) or node.target is aten.full.default:
            continue
        shape = [d if isinstance(d, int) else sizes.get(symbolic.expr(d)) for d in val.shape]
        if None in shape:  # a symbolic size no input gives as it is: the op stays
            continue
        with gm.graph.inserting_before(node):
            shape = [d(gm.graph) if callable(d) else d for d in shape]
            full = gm.graph.call_function(aten.full.default, (shape, 0), {"dtype": val.dtype, "device": val.device})
        full.meta = dict(node.meta)
        node.replace_all_uses_with(full)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _size_readers(gm: fx.GraphModule) -> dict:
    """For each symbol that a graph input gives as it is (a SymInt input, or a tensor input's
    dim): a function that makes a node of its value at the graph's insertion point."""
    readers: dict = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            readers.setdefault(symbolic.expr(val), lambda graph, node=node: node)
        elif isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    readers.setdefault(symbolic.expr(size), lambda graph, node=node, d=d, size=size: _sym_size(
                        graph, node, d, size))
    return readers


def _sym_size(graph: fx.Graph, tensor: fx.Node, dim: int, size) -> fx.Node:
    read = graph.call_function(aten.sym_size.int, (tensor, dim))
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
    without a guard on symbolic sizes."""
    return all(n == 1 or statically_known_true(x == y) for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _to_layout(x, like):
    """`x` with the strides of `like` (same shape), as a permute of a contiguous copy; `x`
    itself when it has them already or when `like` is not a dense permuted layout."""
    if not isinstance(x, torch.Tensor) or not isinstance(like, torch.Tensor) or _same_strides(x, like):
        return x
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
        table.update(PRE_LOWERING)
    table.update(decompositions)
    return table


_UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)
aten = torch.ops.aten
# Ops whose lowering is right for unsigned integers too. IREE's integers are signless, and
# torch-mlir lowers division, remainder, reductions and widening casts of unsigned values
# as if they were signed (200 // 3 on uint8 gives 0), so any other op on them stays in eager.
_UNSIGNED_SAFE = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor,
    aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar, aten.bitwise_not.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.maximum.default, aten.minimum.default, aten.where.self, aten.clone.default,
    aten.cat.default, aten.copy.default, aten.alias.default, aten.lift_fresh_copy.default,
    aten.bitwise_right_shift.Tensor, aten.bitwise_left_shift.Tensor,
    aten.__rshift__.Scalar, aten.__lshift__.Scalar, aten.logical_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default,
    aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.constant_pad_nd.default,
})


# Ops whose lowering treats bool (i1) as a signed integer, True as -1: sort puts True first,
# clamp and scatter_add/amax with bools give False.
_BOOL_WRONG = frozenset({
    aten.sort.default, aten.sort.stable, aten.topk.default, aten.kthvalue.default,
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_min.Tensor,
    aten.clamp_max.default, aten.clamp_max.Tensor, aten.scatter_add.default,
    aten.scatter_reduce.two, aten.index_add.default,
})
# Ops whose lowering is wrong for every dtype: logcumsumexp adds exp(x) without taking out the
# running maximum, so it overflows to inf where eager does not.
_ALWAYS_WRONG = frozenset({aten.logcumsumexp.default})


# Ops that torch-mlir lowers to an in-place sort of the values and of an iota of indices.
_SORTS = frozenset({aten.sort.default, aten.sort.stable, aten.topk.default})


def sorts_apart(gm: fx.GraphModule) -> set[fx.Node]:
    """The sorts of a graph to run as ATen kernels: all but the first. IREE 3.13 makes one
    iota of indices for two sorts of the same shape and sorts it in place twice, so the
    indices of both came out permuted by the other's order (the experts that a
    mixture-of-experts model's second layer chose, say). One per module is right
    (tests/test_iree_workarounds.py)."""
    sorts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SORTS]
    return set(sorts[1:])


# Pooling whose output size rounds up (ceil_mode): torch-mlir's lowering with symbolic sizes
# read past the input (avg_pool2d of 2x37x64 was 1.6x off, of 3x101x64 by 1e34: Funnel's
# pooling). Such a graph compiles per shape, which lowers it right.
_CEIL_POOLS = frozenset({
    aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
    aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
    aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default,
})


def wrong_when_dynamic(node: fx.Node) -> bool:
    """Whether IREE would compute `node` wrongly when its sizes are symbolic (_CEIL_POOLS)."""
    if node.op != "call_function" or node.target not in _CEIL_POOLS:
        return False
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    if "ceil_mode" not in names:
        return False
    i = names.index("ceil_mode")
    ceil = node.args[i] if len(node.args) > i else node.kwargs.get("ceil_mode", schema.arguments[i].default_value)
    return bool(ceil)


def wrong_in_iree(node: fx.Node) -> bool:
    """Whether IREE would compute `node` wrongly for its dtypes, so that it must run in eager:
    unsigned integers outside _UNSIGNED_SAFE, bools in _BOOL_WRONG, ops in _ALWAYS_WRONG,
    and boolean-mask index_put that decompositions.PRE_LOWERING could not rewrite."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    op = node.target
    if op in _ALWAYS_WRONG:
        return True
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    dtypes = {v.dtype for v in vals if isinstance(v, torch.Tensor)}
    if op in (aten.index_put.default, aten._index_put_impl_.default) and any(
        isinstance(i, fx.Node) and getattr(i.meta.get("val"), "dtype", None) == torch.bool for i in node.args[1]
    ):
        return True
    if torch.bool in dtypes and op in _BOOL_WRONG:
        return True
    accumulate = len(node.args) > 3 and node.args[3]
    if op in (aten.index_put.default, aten._index_put_impl_.default) and accumulate and torch.bool in dtypes:
        return True  # True + True overflows i1 to False; eager's bool sum is a logical or
    unsigned = dtypes & set(_UNSIGNED)
    if not unsigned or op in _UNSIGNED_SAFE or op.is_view:
        return False
    if op is aten._to_copy.default:  # unsigned to float or bool is right; to int is not
        out = node.meta.get("val")
        return not (isinstance(out, torch.Tensor) and (out.dtype.is_floating_point or out.dtype in {torch.bool, *unsigned}))
    return True


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
    of its computation (nodes joined by data edges; inputs join nothing). For graphs of many
    independent chains, such as an optimizer step over many parameters, whose single module
    IREE 3.13 builds with a dispatch of more bindings than its runtime allows (32)."""
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
    chunk = {c: i * parts // len(components) for i, c in enumerate(components)}
    index = {n: chunk[root(n)] for n in calls}
    outer = split_module(gm, None, lambda n: index[n], keep_original_order=True)
    return outer, {f"submod_{k}": "iree" for k in set(index.values())}

