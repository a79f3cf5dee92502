"""Results written into storage the caller allocates: a CPU module's `main` takes one more
argument per result whose shape is known before the call (and that is not tiny:
PLACED_MIN_BYTES), and IREE writes the result there, so nothing is copied out of IREE's pool
(memory.POOLED).

Imports lower (Lowered), memory (the element sizes the runtime can import) and placing (the
mark for a module that reads what it places) from boo_backend.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import memory, placing
from .lower import Lowered


# Results smaller than this are left to IREE. Passing storage costs the call a few Python
# steps per result (a tensor, its import, a buffer view) that cost more than the result is
# worth: a result IREE allocates costs only its export, and on local-task a copy of a few KB
# out of IREE's pool. The zoo's 2-layer GPT-2 and Llama place 8 results a call, all of them
# small: leaving those to IREE cut the time of their IREE parts 10-15% (bench/RESULTS.md,
# fourteenth session). The pool reuses no storage under 256 KiB (pool._MIN_BYTES) either, so
# a result this small gains nothing else from being placed.
PLACED_MIN_BYTES = 64 << 10


def placeable(lowered: Lowered) -> tuple[int, ...]:
    """The results whose shape is known before the call, of PLACED_MIN_BYTES or more: those
    the caller allocates."""
    found = []
    for j, ((shape, _), dtype) in enumerate(zip(lowered.result_layouts, lowered.result_dtypes)):
        kind = getattr(torch, dtype, None)
        if (isinstance(kind, torch.dtype) and not kind.is_complex and kind.itemsize in memory.SAME_SIZE_INT
                and all(isinstance(n, int) for n in shape) and 0 not in shape
                and math.prod(shape) * kind.itemsize >= PLACED_MIN_BYTES):
            found.append(j)
    return tuple(found)


def with_storage(lowered: Lowered) -> Lowered:
    """`lowered` with each placeable result written into storage its caller passes: `main`
    takes one more argument per such result (a `!torch.tensor`, which IREE imports as a
    buffer view and writes with `hal.tensor.alias`) and returns only the others.

    On the CPU, IREE's local-task device otherwise takes results from a pool they must leave
    at once (memory.POOLED): the copy that moves them costs a pass over fresh memory, 20-27 ms
    for a 62.5 MiB cross-entropy result of the Llama in bench/scale.py."""
    placed = placeable(lowered)
    if not placed:
        return lowered
    from torch_mlir import ir as tm_ir
    from torch_mlir.dialects import torch as torch_d

    context = tm_ir.Context()
    torch_d.register_dialect(context)
    context.allow_unregistered_dialects = True  # the composite kernels' torch_c ops (embed)
    module = tm_ir.Module.parse(lowered.mlir, context)
    main = next(op for op in module.body.operations
                if op.operation.name == "func.func" and tm_ir.StringAttr(op.attributes["sym_name"]).value == "main")
    block = main.regions[0].blocks[0]
    ret = list(block.operations)[-1]
    values = list(ret.operands)
    if len(values) != len(lowered.result_layouts) or "arg_attrs" in main.attributes or "res_attrs" in main.attributes:
        return lowered  # not the shape import_core gives; keep IREE's own results
    with tm_ir.Location.unknown(context):
        storage = [block.add_argument(tm_ir.Type.parse(str(values[j].type).replace("!torch.vtensor", "!torch.tensor", 1)),
                                      tm_ir.Location.unknown(context)) for j in placed]
        kept = [v for j, v in enumerate(values) if j not in placed]
        with tm_ir.InsertionPoint(ret):
            for j, arg in zip(placed, storage):
                tm_ir.Operation.create("torch.overwrite.tensor.contents", operands=[values[j], arg])
            tm_ir.Operation.create("func.return", operands=kept)
        ret.erase()
        if any(use.owner.name != "torch.overwrite.tensor.contents" for j in placed for use in values[j].uses):
            main.attributes[placing.READS_PLACED] = tm_ir.UnitAttr.get()
        main.attributes["function_type"] = tm_ir.TypeAttr.get(tm_ir.FunctionType.get(
            [a.type for a in block.arguments], [v.type for v in kept]))
    return dataclasses.replace(lowered, mlir=str(module), placed=placed)


def placed_results(lowered: Lowered) -> list[tuple[int, tuple, torch.dtype]]:
    """(result index, shape, dtype) of each result `lowered` writes into caller storage: what
    runtime.IreeFunction allocates per call."""
    return [(j, lowered.result_layouts[j][0], getattr(torch, lowered.result_dtypes[j])) for j in lowered.placed]
