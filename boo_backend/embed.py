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


def _vtensor(builtin: ir.Type) -> ir.Type:
    """The torch value-tensor type of a builtin tensor type (same sizes, same element type)."""
    shaped = ir.RankedTensorType(builtin)
    dims = ",".join("?" if ir.ShapedType.is_dynamic_size(d) else str(d) for d in shaped.shape)
    return ir.Type.parse(f"!torch.vtensor<[{dims}],{shaped.element_type}>")


def _cast(value: ir.Value, to: ir.Type) -> ir.Value:
    """`value` as type `to` (sizes made static or dynamic), where its type differs."""
    if str(value.type) == str(to):
        return value
    return ir.Operation.create("torch.tensor_static_info_cast", results=[to], operands=[value]).result


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
            # The kernel's own types: a size it takes as static may be `?` in the imported
            # module (a width after a view of symbolic sizes that the importer could not fold:
            # MobileViT's unfolded patches), and the call must match the kernel exactly.
            kernel_type = ir.FunctionType(ir.TypeAttr(used[fname].attributes["function_type"]).value)
            operands = list(op.operands)
            with ir.InsertionPoint(op):
                ins = [
                    ir.Operation.create(
                        "torch_c.to_builtin_tensor", results=[want],
                        operands=[_cast(operands[i], _vtensor(want))],
                    ).result
                    for i, want in zip(call.arg_positions, kernel_type.inputs)
                ]
                kcall = func_d.CallOp(list(kernel_type.results), ir.FlatSymbolRefAttr.get(fname), ins)
                for k, i in enumerate(call.results):
                    back = ir.Operation.create(
                        "torch_c.from_builtin_tensor", results=[_vtensor(kernel_type.results[k])],
                        operands=[kcall.results[k]],
                    )
                    op.results[i].replace_all_uses_with(_cast(back.result, op.results[i].type))
            for r in op.results:
                if list(r.uses):
                    raise BooError(f"boo: {node.name}: a result the composite does not compute is still used")
            op.erase()
        _sweep_dead(body)
    return list(used)
