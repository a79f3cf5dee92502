"""The gradients of outputs that nothing differentiated: not made, and not read.

A model's forward returns more than the loss: the logits, the key/value cache. Each output
that requires grad is an output of AOTAutograd's autograd.Function, and autograd fills a
tensor of zeros for each whose gradient no one computed, which the backward then reads: the
Llama of bench/scale.py fills 62 MiB of logits' zeros every step, GPT-2 small 98 MiB, and
their loss modules read them again. Eager has no such tensor.

boo's forward therefore asks autograd not to make them (`leave_unmade`), and its backward
gets None in their place. It then runs a copy of its graph (`zeroed`) in which each such
tangent is a zero constant made inside the graph (IREE never stores it) and an addition of
it gives the other addend, as eager's autograd, which adds nothing there, does.
Static graphs only: a zero tangent needs its shape, and a symbolic one takes its sizes from
the call. Imports only torch.
"""

from __future__ import annotations

import sys

import torch
import torch.fx as fx

aten = torch.ops.aten

# AOTAutograd's generated forward of its autograd.Function, which calls boo's forward graph
# with the function's `ctx` among its locals (torch/_functorch/_aot_autograd/runtime_wrappers.py).
_CALLER = "_compiled_forward"
_FRAMES = 4  # how far up from boo's graph the caller may be (wrappers of its own between)


def leave_unmade() -> None:
    """Tell autograd, for the forward call under way, to pass None for the gradients of
    outputs no one differentiated (ctx.set_materialize_grads(False)). Nothing happens where
    the caller is not AOTAutograd's autograd.Function, or under compiled autograd (which
    builds the backward's inputs itself)."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    if compiled_autograd.compiled_autograd_enabled or compiled_autograd.in_compiled_autograd_region:
        return
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        frame = frame.f_back
        if frame is None:
            return
        if frame.f_code.co_name == _CALLER:
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.FunctionCtx) and hasattr(ctx, "set_materialize_grads"):
                ctx.set_materialize_grads(False)
            return


def positions(gm: fx.GraphModule) -> list[int]:
    """Positions of the backward graph's tangents among its inputs (AOTAutograd names them
    `tangents_<n>`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if n.name.startswith("tangents")]


def fill(args: list, gm: fx.GraphModule, at: list[int]) -> list:
    """`args` with each None at a tangent's position (`at`, from `positions`) replaced by the
    zeros autograd would have made (the placeholder's shape, strides and dtype): for a
    backward that runs its graph as it is."""
    if not any(args[i] is None for i in at):
        return args
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for i, (a, val) in enumerate(zip(args, vals)):
        if a is None and i in at:
            if not isinstance(val, torch.Tensor):
                raise RuntimeError("boo: a backward input is None and its graph does not say its shape")
            a = torch.empty_strided(tuple(val.shape), val.stride(), dtype=val.dtype, device=val.device).zero_()
        out.append(a)
    return out


def zeroed(gm: fx.GraphModule, missing: tuple[int, ...]) -> fx.GraphModule:
    """A copy of `gm` without the placeholders at positions `missing` (each a tensor of static
    shape): each is a zero tensor of its shape and dtype made in the graph, and an addition of
    it to a value of the same shape and dtype is that value."""
    graph = fx.Graph()
    mapping: dict = {}
    out = graph.graph_copy(gm.graph, mapping)
    graph.output(out)
    placeholders = [mapping[n] for n in gm.graph.nodes if n.op == "placeholder"]
    first = next(n for n in graph.nodes if n.op != "placeholder")
    made = []
    for i in missing:
        node = placeholders[i]
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or any(not isinstance(s, int) for s in val.shape):
            raise ValueError(f"boo: backward input {node.name} has no static shape to make its zeros from")
        with graph.inserting_before(first):
            zeros = graph.call_function(aten.full.default, (list(val.shape), 0),
                                        {"dtype": val.dtype, "layout": torch.strided, "device": val.device,
                                         "pin_memory": False})
        zeros.meta = {k: v for k, v in node.meta.items() if k != "tensor_meta"}
        zeros.meta["val"] = _contiguous(val)
        node.replace_all_uses_with(zeros)
        graph.erase_node(node)
        made.append(zeros)
    for zeros in made:
        for user in list(zeros.users):
            other = _other_addend(user, zeros)
            if other is not None:
                user.replace_all_uses_with(other)
                graph.erase_node(user)
        if not zeros.users:
            graph.erase_node(zeros)
    graph.lint()
    result = fx.GraphModule(gm, graph)
    result.meta = dict(gm.meta)
    return result


def _contiguous(val: torch.Tensor) -> torch.Tensor:
    """The fake value of aten.full's result for `val`'s shape and dtype (dense, row-major)."""
    if val.is_contiguous():
        return val
    return val.new_empty(val.shape)


def _other_addend(node: fx.Node, zeros: fx.Node) -> fx.Node | None:
    """For `node` = x + zeros (or zeros + x) of x's own shape and dtype, with no alpha: x."""
    if node.op != "call_function" or node.target != aten.add.Tensor or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args[0], node.args[1]
    other = b if a is zeros else a if b is zeros else None
    if not isinstance(other, fx.Node) or other is zeros:
        return None
    mine, theirs = node.meta.get("val"), other.meta.get("val")
    if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)):
        return None
    if mine.dtype != theirs.dtype or tuple(mine.shape) != tuple(theirs.shape) or mine.stride() != theirs.stride():
        return None
    return other
