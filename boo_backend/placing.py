"""Placed results that their own module also reads, written in place.

storage.with_storage writes a result into caller storage with torch's
`overwrite.tensor.contents`. IREE's torch input conversion turns that into a
`hal.tensor.alias` at the end of `main`, after every other use of the value. A value that
something else in the module reads (a log-softmax saved for the backward and gathered for
the loss, a layer's output that its next op reads) then lives in a transient buffer and is
copied into the caller's storage at the end: GPT-2 small's loss module took 42.7 ms with
that copy and 16.3 ms without it (bench/RESULTS.md, thirty-fifth session). With the alias
moved to just after the value is made, and the value's readers reading the alias's result,
IREE writes it where it belongs and copies nothing. A scatter into zeros (an embedding's
gradient) still copies: IREE fills a transient buffer for it whatever the alias says.

Such modules compile in two iree-compile runs: up to IREE's input phase, then, after
`alias_early`, from there on. with_storage marks them with READS_PLACED.

Imports nothing from boo_backend.
"""

from __future__ import annotations

# The attribute storage.with_storage sets on `main` when a placed value is also read.
READS_PLACED = "boo.reads_placed"


def alias_early(text: str) -> tuple[str, int]:
    """`text` (an IREE module after its input phase) with each `hal.tensor.alias` of a value
    that something else also reads moved to just after the op that makes the value, and
    those readers reading the alias's result; and how many were moved. A value aliased twice,
    or made in another block, is left as it is."""
    from iree.compiler import ir

    with ir.Context():
        module = ir.Module.parse(text)
        moved = 0
        for func in module.body.operations:
            if func.operation.name != "util.func" or not func.regions[0].blocks:
                continue
            for op in list(func.regions[0].blocks[0].operations):
                alias = op.operation
                if alias.name != "hal.tensor.alias":
                    continue
                sources = [v for v in alias.operands if isinstance(v.type, ir.RankedTensorType)]
                if len(sources) != 1 or not isinstance(sources[0], ir.OpResult):
                    continue
                value = sources[0]
                maker = value.owner.operation
                users = [use.owner for use in value.uses]
                if (maker.parent != alias.parent or len(users) < 2
                        or any(not isinstance(v, ir.BlockArgument) for v in alias.operands if v != value)
                        or sum(u.name == "hal.tensor.alias" for u in users) != 1):
                    continue
                alias.move_after(maker)
                value.replace_all_uses_except(alias.results[0], alias)
                moved += 1
        return str(module), moved
