"""Swap matched ATen ops in an imported torch-dialect module for calls to composite kernels.

Part of the lower step; imports only the composite registry and templates (leaves).

torch-mlir's importer emits one op per FX node, in graph order, so the k-th op named
`torch.aten.gelu_backward` in `main` is the k-th `gelu_backward` node of the graph. For a
matched node the op is replaced by: `torch_c.to_builtin_tensor` on each tensor operand, a
`func.call` to the kernel (a private function rendered from kernels/<name>.mlir), and
`torch_c.from_builtin_tensor` on each result. IREE inlines the kernel into the graph, so it
fuses with its neighbours like any other op.
"""

from __future__ import annotations

import importlib

import torch
import torch.fx as fx

from . import composites, templates
from .config import BooError

# The FX node meta key match.py sets on nodes a composite computes.
META_KEY = "boo_composite"



class _Lazy:
    """A module imported at its first use: torch-mlir's Python API loads its native library
    (35 MB resident), which a process whose modules all come from the cache never needs."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


ir = _Lazy("torch_mlir.ir")
func_d = _Lazy("torch_mlir.dialects.func")

_ELEMENT = {torch.float32: "F32Type", torch.bfloat16: "BF16Type", torch.float16: "F16Type"}


def _builtin(t: torch.Tensor) -> ir.Type:
    """The builtin tensor type of a FakeTensor; a symbolic size is a `?` dim, as the importer
    gives it (and as composites.size makes it in a kernel's parameters)."""
    dims = [ir.ShapedType.get_dynamic_size() if s is None else s for s in composites.sizes(t.shape)]
    return ir.RankedTensorType.get(dims, getattr(ir, _ELEMENT[t.dtype]).get())


def _kernel_text(call) -> tuple[str, str]:
    entry = call.entry
    name = composites.function_name(entry, call.params)
    text = templates.render(
        entry.template, func_name=name, composite=entry.name, version=entry.version, **call.params
    )
    return name, text


def _parse_kernel(text: str, entry) -> ir.Module:
    try:
        return ir.Module.parse(text)
    except Exception as e:  # MLIRError: the rendered kernel is not valid MLIR
        raise BooError(
            f"kernel template {entry.template} rendered invalid MLIR: {e}\n{templates.numbered(text)}"
        ) from e


def _main(module: ir.Module) -> ir.Operation:
    for op in module.body.operations:
        if ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise BooError("imported module has no @main")


def _sweep_dead(body) -> None:
    """Erase the constants and lists left without users by the replaced ops (IREE's torch
    conversion rejects an unused torch constant). Reverse order: users before producers."""
    for op in reversed(list(body.operations)):
        if op.operation.name.startswith(("torch.constant.", "torch.prim.ListConstruct")) and all(
            not list(r.uses) for r in op.results
        ):
            op.erase()


def schema_args(node: fx.Node) -> list:
    """The node's arguments in schema order, keyword-only ones included (defaults filled in):
    the order of the operands torch-mlir gives the op."""
    schema = node.target._schema
    args = list(node.args)
    for arg in schema.arguments[len(args):]:
        args.append(node.kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None))
    return args


def _imported_name(op) -> str:
    """The op's name as mlir_op_name gives it; torch-mlir imports an op outside its
    registry (a torch.library custom op such as boo::rms_norm) as `torch.operator "name"`."""
    name = op.operation.name
    if name == "torch.operator":
        return ir.StringAttr(op.attributes["name"]).value
    return name


def mlir_op_name(target) -> str | None:
    """The name torch-mlir gives an ATen OpOverload: aten.sum.dim_IntList -> torch.aten.sum.dim_IntList."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    ns, name = target._schema.name.split("::")
    overload = target._overloadname
    return f"torch.{ns}.{name}" + ("" if overload == "default" else f".{overload}")


def embed(module: ir.Module, graph: fx.Graph) -> list[str]:
    """Replace the ops of matched nodes; returns the kernel function names used."""
    calls: dict[str, list] = {}
    for node in graph.nodes:
        name = mlir_op_name(node.target) if node.op == "call_function" else None
        if name:
            calls.setdefault(name, []).append((node, node.meta.get(META_KEY)))
    if not any(call for entries in calls.values() for _, call in entries):
        return []

    ctx = module.context
    ctx.allow_unregistered_dialects = True  # torch_c has no Python registration
    used: dict[str, ir.Operation] = {}
    with ctx, ir.Location.unknown():
        body = _main(module).regions[0].blocks[0]
        for op in list(body.operations):
            pending = calls.get(_imported_name(op))
            if not pending:
                continue
            node, call = pending.pop(0)
            if call is None:
                continue
            fname, text = _kernel_text(call)
            if fname not in used:
                kernel = _parse_kernel(text, call.entry)
                for kop in list(kernel.body.operations):
                    kop.detach_from_parent()
                    module.body.append(kop)
                    used[fname] = kop
            outs = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
            operands, node_args = list(op.operands), schema_args(node)
            with ir.InsertionPoint(op):
                ins = [
                    ir.Operation.create(
                        "torch_c.to_builtin_tensor", results=[_builtin(node_args[i].meta["val"])],
                        operands=[operands[i]],
                    ).result
                    for i in call.arg_positions
                ]
                result_types = [_builtin(outs[i]) for i in call.results]
                kcall = func_d.CallOp(result_types, ir.FlatSymbolRefAttr.get(fname), ins)
                for k, i in enumerate(call.results):
                    back = ir.Operation.create(
                        "torch_c.from_builtin_tensor", results=[op.results[i].type],
                        operands=[kcall.results[k]],
                    )
                    op.results[i].replace_all_uses_with(back.result)
            for r in op.results:
                if list(r.uses):
                    raise BooError(f"boo: {node.name}: a result the composite does not compute is still used")
            op.erase()
        _sweep_dead(body)
    return list(used)
