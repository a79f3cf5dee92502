"""FX -> torch dialect: torch-mlir's FX importer on a graph's core (lower.build_core), with
the symbol ranges of its sizes, the composite kernels it calls (embed), and boo's fixes to
what the importer emits.

Imports symbolic and embed from boo_backend.
"""

from __future__ import annotations

import functools
import re

import sympy
import torch
import torch.fx as fx

from . import symbolic
from .embed import embed


_OPERATOR = re.compile(r'torch\.operator "(torch\.[\w.]+)"')


def unregistered_ops(mlir: str) -> list[str]:
    """torch-mlir names of ops the importer could only emit as opaque `torch.operator`."""
    return sorted(set(_OPERATOR.findall(mlir)))


@functools.cache
def _registered() -> frozenset[str]:
    import torch_mlir.dialects.torch as dialect

    return frozenset(name for c in vars(dialect).values()
                     if isinstance(name := getattr(c, "OPERATION_NAME", None), str))


def is_registered(name: str) -> bool:
    """Whether torch-mlir's torch dialect has the op `name` (torch.aten.index.Tensor); an op
    it lacks is imported as an opaque `torch.operator`, which nothing lowers at any size."""
    return name in _registered()


@functools.cache
def _node_importer():
    """torch-mlir's node importer, leaving out the shape bindings it cannot express: a size
    such as (s79**2)//s79 has no affine form. A binding only adds facts; the `?` dims stay."""
    from torch_mlir.extras.fx_importer import GraphNodeImporter

    class _NodeImporter(GraphNodeImporter):
        __slots__ = ()

        def _create_bind_symbolic_shape_ops(self, loc, node):
            try:
                super()._create_bind_symbolic_shape_ops(loc, node)
            except NotImplementedError:
                pass

    return _NodeImporter


def _symbol_ranges(core: fx.GraphModule) -> dict[str, RangeConstraint]:
    """The range of every symbol in `core`'s sizes, as the importer takes them."""
    from torch_mlir.extras.fx_importer import RangeConstraint

    used: set = set()
    for node in core.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            used.update(*(symbolic.expr(x).free_symbols for x in val.shape if isinstance(x, torch.SymInt)))
        elif isinstance(val, torch.SymInt):
            used.update(symbolic.expr(val).free_symbols)
    if not used:
        return {}
    env = symbolic.shape_env(n.meta.get("val") for n in core.graph.nodes)
    i64 = torch.iinfo(torch.int64)
    ranges = {}
    for sym in sorted(used, key=lambda s: s.name):
        r = env.var_to_range.get(sym) if env is not None else None
        lo = int(r.lower) if r is not None and isinstance(r.lower, sympy.Integer) else i64.min
        hi = int(r.upper) if r is not None and isinstance(r.upper, sympy.Integer) else i64.max
        ranges[sym.name] = RangeConstraint(lo, hi)
    return ranges


_VTENSOR = re.compile(r"!torch\.vtensor<\[([^\]]*)\],(.+)>")
_VIEWS = ("torch.aten.view", "torch.aten._unsafe_view", "torch.aten.reshape")


def _int_constant(value) -> int | None:
    """The value of a `torch.constant.int`, or None for any other SSA value."""
    owner = value.owner
    if getattr(owner, "name", None) != "torch.constant.int":
        return None
    from torch_mlir import ir as tm_ir

    return tm_ir.IntegerAttr(owner.attributes["value"]).value


def _create(name: str, result, *operands, **attributes):
    """The result of a new op `name` (in the current context and insertion point)."""
    from torch_mlir import ir as tm_ir

    return tm_ir.Operation.create(name, results=[result], operands=list(operands), attributes=attributes).result


def _views_through_one_dim(module) -> None:
    """Each view between tensors of two or more dims, one of them dynamic, goes through one
    flat dim: x -> [-1] -> target. torch-mlir's view lowering pairs dynamic dims with the
    wrong groups when several dims merge ([?, ?, 4, 8] -> [?, 32] came back [s0, s1*32],
    values and all); collapsing to one dim and expanding that lowers right for every size."""
    from torch_mlir import ir as tm_ir

    with module.context, tm_ir.Location.unknown():
        int_type, list_type = tm_ir.Type.parse("!torch.int"), tm_ir.Type.parse("!torch.list<int>")
        for func in module.body.operations:
            for op in list(func.regions[0].blocks[0].operations):
                if op.operation.name not in _VIEWS:
                    continue
                source, result = _VTENSOR.fullmatch(str(op.operands[0].type)), _VTENSOR.fullmatch(str(op.results[0].type))
                if not source or not result:
                    continue
                ranks = [len(m.group(1).split(",")) if m.group(1) else 0 for m in (source, result)]
                if min(ranks) < 2 or "?" not in source.group(1) + result.group(1):
                    continue
                target = op.operands[1].owner
                if target.name != "torch.prim.ListConstruct":
                    continue
                with tm_ir.InsertionPoint(op):
                    minus_one = _create("torch.constant.int", int_type,
                                        value=tm_ir.IntegerAttr.get(tm_ir.IntegerType.get_signless(64), -1))
                    flat = _create("torch.aten.view", tm_ir.Type.parse(f"!torch.vtensor<[?],{source.group(2)}>"),
                                   op.operands[0], _create("torch.prim.ListConstruct", list_type, minus_one))
                    sizes = list(target.operands)
                    inferred = [i for i, v in enumerate(sizes) if _int_constant(v) == -1]
                    if inferred:  # from a flat dim, the lowering needs every size: numel // the rest
                        known = None
                        for i, v in enumerate(sizes):
                            if i not in inferred:
                                known = v if known is None else _create("torch.aten.mul.int", int_type, known, v)
                        numel = _create("torch.aten.numel", int_type, flat)
                        sizes[inferred[0]] = numel if known is None else _create(
                            "torch.aten.floordiv.int", int_type, numel, known)
                    # The view's type gets every size the list fixes: from one dim, the lowering
                    # gets a constant size wrong unless the type shows it too.
                    dims = [d if d != "?" else str(c) if (c := _int_constant(v)) is not None else "?"
                            for d, v in zip(result.group(1).split(","), sizes)]
                    refined = tm_ir.Type.parse(f"!torch.vtensor<[{','.join(dims)}],{result.group(2)}>")
                    new = _create(op.operation.name, refined, flat, _create("torch.prim.ListConstruct", list_type, *sizes))
                    if refined != op.results[0].type:
                        new = _create("torch.tensor_static_info_cast", op.results[0].type, new)
                op.results[0].replace_all_uses_with(new)
                op.operation.erase()


# A fill op (operands: what the empty tensor takes, then the value) -> the op that makes the
# same tensor empty, and which of the fill's operands it takes.
_FILLS = {
    "torch.aten.full": ("torch.aten.empty.memory_format", (0, 2, 3, 4, 5, None)),
    "torch.aten.full_like": ("torch.aten.empty_like", (0, 2, 3, 4, 5, 6)),
}


def _writes_into(name: str) -> bool:
    """Whether a torch op's lowering writes into its first operand's tensor in place (a
    scatter, index_put, index_add or index_copy: its result is that tensor, updated)."""
    return "scatter" in name or any(w in name for w in ("index_put", "index_add", "index_copy"))


# Ops whose result is a view of their first operand's tensor: a write into it is a write into
# that tensor. `a[:, :3] = 1` on zeros of two dims is a slice_scatter into a slice (over
# all of dim 0) of the zeros, functionalized.
_VIEWS_OF_FIRST = frozenset(f"torch.aten.{v}" for v in (
    "slice.Tensor", "select.int", "narrow", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze",
    "squeeze.dim", "squeeze.dims", "permute", "transpose.int", "t", "expand", "diagonal", "alias",
    "as_strided", "unflatten.int", "flatten.using_ints"))


def _written(owner, operand: int) -> bool:
    """Whether `owner`, a use of a tensor as its `operand`-th operand, writes into it in place,
    itself or through views. The tensor written is the first operand; a fill that is only the
    source of a scatter is read (as the broadcast that reduces right)."""
    name = owner.name
    return operand == 0 and (_writes_into(name) or name in _VIEWS_OF_FIRST and any(
        _written(u.owner, u.operand_number) for u in owner.results[0].uses))


def _fills_as_splats(module) -> None:
    """Each `full`/`full_like` of dynamic sizes that an op writes into in place (slice_scatter,
    index_put: a backward's zeros), itself or through a view of it, is, for that op or view,
    `fill.Scalar` of an empty tensor.
    torch-mlir lowers `full` to a broadcast of a 0-d constant, which IREE 3.13 makes a
    dispatch of its own when sizes are dynamic (a splat when they are static); two ops that
    write into that one result in place (which IREE merges when equal) then write into one
    buffer, and each result holds both writes. `fill.Scalar` lowers to linalg.fill, which
    IREE makes a splat for each use. Other uses keep the broadcast: a sum over a dynamic
    dim of a splat, fused into the reduction, added the value once per vector of the dim
    (`ones_like(x).sum(-1)` gave 2 for 17 ones on AVX-512: Wav2Vec2's input lengths)."""
    from torch_mlir import ir as tm_ir

    with module.context, tm_ir.Location.unknown():
        for func in module.body.operations:
            for op in list(func.regions[0].blocks[0].operations):
                name = op.operation.name
                if name not in _FILLS or "?" not in str(op.results[0].type):
                    continue
                writes = [(use.owner, use.operand_number) for use in op.results[0].uses
                          if _written(use.owner, use.operand_number)]
                if not writes:
                    continue
                empty_name, taken = _FILLS[name]
                operands, result = list(op.operands), op.results[0].type
                with tm_ir.InsertionPoint(op):
                    none = _create("torch.constant.none", tm_ir.Type.parse("!torch.none"))
                    empty = _create(empty_name, result, *(none if i is None else operands[i] for i in taken))
                    filled = _create("torch.aten.fill.Scalar", result, empty, operands[1])
                for owner, i in writes:
                    owner.operands[i] = filled
                if not list(op.results[0].uses):
                    op.operation.erase()


def _is_float_tensor(a) -> bool:
    val = a.meta.get("val") if isinstance(a, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _is_number(t) -> bool:
    """Whether an argument of schema type `t` that holds an int is a number (a Scalar, or a
    Tensor given as a Python number), not a size or a dim."""
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, (torch._C.NumberType, torch._C.TensorType))


def _exact_int(a) -> bool:
    """An int that a float (torch-mlir's f64 constant) holds exactly: a larger one stays an
    int (`new_full(..., 2**60, dtype=torch.int64)` of a float tensor must not round)."""
    return type(a) is int and abs(a) <= 2**53


# An int exponent stays an int: torch-mlir lowers it to repeated multiplication (powi), a
# float one to powf (x ** 4.0 through exp and log: 1.6e-7 off, and slower).
_WHOLE_EXPONENTS = frozenset({torch.ops.aten.pow.Tensor_Scalar})


def _int_numbers_as_floats(core: fx.GraphModule) -> None:
    """An int Python number (a Scalar argument) that meets a float tensor becomes a float,
    as eager reads it. torch-mlir's folds of such an op on a constant tensor read the int
    wrongly: full(4, 0.3) + -1 gave 1.8e19 (-1 read as unsigned), full(4, 0.3) < 0 gave True,
    full(4, 0.0) == 0 gave False. Ints in other slots (sizes, dims) are left alone."""
    for node in core.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not any(_is_float_tensor(a) for a in node.args):
            continue
        schema = node.target._schema.arguments
        node.args = tuple(float(a) if _exact_int(a) and i < len(schema) and _is_number(schema[i].type)
                          and node.target not in _WHOLE_EXPONENTS else a for i, a in enumerate(node.args))
        types = {arg.name: arg.type for arg in schema}
        node.kwargs = {k: float(v) if _exact_int(v) and k in types and _is_number(types[k]) else v
                       for k, v in node.kwargs.items()}


_HALF = (torch.float16, torch.bfloat16)
# Ops whose eager CPU kernel for a half tensor and a scalar (a Python number, or a 0-d tensor)
# computes with the scalar in f32 (its "opmath" type), not rounded to the tensor's type.
# op -> the rounding modes it does so for.
_SCALAR_IN_F32 = {
    torch.ops.aten.mul.Tensor: (None,), torch.ops.aten.mul.Scalar: (None,), torch.ops.aten.div.Tensor: (None,),
    torch.ops.aten.div.Scalar: (None,), torch.ops.aten.div.Tensor_mode: ("trunc",),
    torch.ops.aten.div.Scalar_mode: ("trunc",),
}


def _wide_scalar(a) -> bool:
    """Whether `a` is a Python number or a 0-d float tensor wider than f16/bf16."""
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        return isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype in (torch.float32, torch.float64)
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _half_scalars_in_f32(core: fx.GraphModule) -> None:
    """`x * c` and `x / c` of an f16/bf16 tensor and a scalar computed in f32 and rounded once,
    as eager's CPU kernels do: torch-mlir rounds c to the tensor's type first, so every
    product was off by c's rounding (0.3 is 0.30078 in bf16), half of them by an ulp."""
    graph = core.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SCALAR_IN_F32 or len(node.args) != 2:
            continue
        if node.kwargs.get("rounding_mode") not in _SCALAR_IN_F32[node.target]:
            continue
        x, c = node.args
        if not (isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"].dtype in _HALF):
            continue
        if not _wide_scalar(c):
            continue
        half = node.meta["val"].dtype
        if half not in _HALF:
            continue
        with graph.inserting_before(node):
            wide = graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.float32})
            wide.meta["val"] = x.meta["val"].to(torch.float32)
            if isinstance(c, fx.Node) and c.meta["val"].dtype != torch.float32:
                c32 = graph.call_function(torch.ops.aten._to_copy.default, (c,), {"dtype": torch.float32})
                c32.meta["val"] = c.meta["val"].to(torch.float32)
                c = c32
            out = graph.call_function(node.target, (wide, c), dict(node.kwargs))
            out.meta["val"] = node.meta["val"].to(torch.float32)
        with graph.inserting_after(out):
            back = graph.call_function(torch.ops.aten._to_copy.default, (out,), {"dtype": half})
            back.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(back)
        graph.erase_node(node)
    core.recompile()


def import_core(core: fx.GraphModule) -> tuple[str, list[str]]:
    """torch dialect text for `core`, with one public function `main` and the composite
    kernels it calls; also the kernels' function names."""
    from torch_mlir import ir as tm_ir
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter

    context = tm_ir.Context()
    torch_d.register_dialect(context)
    importer = FxImporter(context=context)
    importer._graph_node_importer_cls = _node_importer()
    # Symbolic sizes become `?` dims; `torch.symbolic_int` declares each symbol with its range
    # and `torch.bind_symbolic_shape` says how each tensor's sizes relate to them (s27*s77
    # rows), which IREE turns into assumptions. The importer reads the ranges from an
    # ExportedProgram only; a Dynamo graph's come from its ShapeEnv.
    _int_numbers_as_floats(core)
    _half_scalars_in_f32(core)
    ranges = _symbol_ranges(core)
    importer._cc._symbolic_guards = ranges
    importer.import_stateless_graph(core.graph, func_name="main", import_symbolic_shape_expressions=bool(ranges))
    module = importer.module
    kernels = embed(module, core.graph)
    _views_through_one_dim(module)
    _fills_as_splats(module)
    return str(module), kernels
