"""Calls that eager PyTorch refuses, and that boo must refuse as eager does rather than
compute: Dynamo traces with fake kernels, which let through what eager's kernels refuse.
A leaf: imports only nans (its rewrite helpers). decompositions uses `refusal` for ops that
AOTAutograd decomposes before the pre-lowering rewrites run.

- REFUSAL_REWRITES (pre-lowering rewrites, ATen level): the call raises eager's error when
  the graph runs.
- refused_in_place (Dynamo's graph): an in-place op whose result eager cannot write back
  into its tensor's type (`int_tensor.mul_(1.5)`, `bool_tensor.mul_(2)`), or whose kernel
  eager lacks for that type (`int_tensor.lerp_(y, 0.5)`). Functionalized, it becomes an
  out-of-place op and a copy back, which casts without a word: the truncated product came
  back. Such a graph runs as Dynamo's graph in eager, which raises eager's error there.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from .nans import _inner, _nested

aten = torch.ops.aten


# Ops whose eager kernels refuse some arguments that their fake kernels let through, so that
# a traced graph computes what eager refuses: a number that does not fit the tensor's type
# (`torch.where(c, int32_x, 2**40)`, `masked_fill`, `full`, `clamp` bounds; the wrapped value
# came back), subtraction with bool tensors, a float `alpha` with integer tensors (with
# symbolic sizes, `torch.add(a, b, alpha=0.5)` of ints gave `a`), and class weights of
# another type than the scores (decompositions.AOT's nll_loss: cross_entropy of bf16
# logits with float32 weights). Each call is tried in eager on empty tensors of its
# arguments' dtypes and ranks; an error of one of these kinds is raised at run time, with
# eager's message (an assert that checks.py turns into a flag).
_REFUSING = frozenset({
    aten.scalar_tensor.default, aten.full.default, aten.full_like.default, aten.new_full.default,
    aten.fill.Scalar, aten.masked_fill.Scalar, aten.index_fill.int_Scalar, aten.scatter.value,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Tensor, aten.rsub.Scalar, aten.add.Tensor,
})
_REFUSALS = ("without overflow", "with a bool tensor is not supported", "with two bool tensors is not supported",
             "must not be a floating point number", "expected scalar type")


def refusal(op, args, kwargs) -> str | None:
    """Eager's message where it refuses this call of `op` for its dtypes or numbers."""
    values = (*args, *kwargs.values())
    numbers = any(type(v) in (int, float, bool) for v in values)
    bools = any(isinstance(v, torch.Tensor) and v.dtype == torch.bool for v in values)
    if not (numbers or bools) or any(isinstance(v, torch.SymInt | torch.SymFloat) for v in values):
        return None
    def empty(v):  # sizes (full's) become 0 too: nothing is allocated
        if isinstance(v, torch.Tensor):  # a 0-d one holds a zero (uninitialized, a target read past the classes)
            return torch.zeros((), dtype=v.dtype) if v.dim() == 0 else torch.empty((0,) * v.dim(), dtype=v.dtype)
        return [0 if isinstance(x, int | torch.SymInt) else empty(x) for x in v] if isinstance(v, list | tuple) else v

    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        try:
            op(*[empty(a) for a in args], **{k: "cpu" if k == "device" else empty(v) for k, v in kwargs.items()})
        except Exception as e:  # any other error of the stand-ins' sizes (IndexError, ValueError) is no refusal
            message = str(e).splitlines()[0] if str(e) else ""
            return message if any(r in message for r in _REFUSALS) else None
    return None


def _refused(op, *args, **kwargs) -> bool:
    return op in _REFUSING and not _nested(op) and refusal(op, args, kwargs) is not None


def _raise_as_eager(op):
    """`op`, and an assert that always fails, with eager's message (see _REFUSING)."""

    def rewrite(*args, **kwargs):
        message = None if _nested(op) else refusal(op, args, kwargs)
        if message is None:
            return NotImplemented
        raise_when_run(message)
        return _inner(op, *args, **kwargs)

    return rewrite


def raise_when_run(message: str) -> None:
    """While a graph is traced: an assert that always fails, so that the graph raises a
    RuntimeError with eager's `message` when it runs (checks.py turns it into a flag)."""
    aten._assert_async.msg(aten.scalar_tensor.default(False, dtype=torch.bool), message)


REFUSAL_REWRITES = {op: (functools.partial(_refused, op), _raise_as_eager(op)) for op in _REFUSING}


# In-place calls in Dynamo's graph: methods and functions named with a trailing underscore
# (`x.mul_(y)`, `torch.relu_`), Python's in-place operators, and calls with `out=`.
_IN_PLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
})
_IN_PLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS)
_TYPE_REFUSALS = ("can't be cast to the desired output type", "not implemented for")


def _in_place(node: fx.Node) -> bool:
    """Whether `node` is an in-place call of Dynamo's graph."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target in _IN_PLACE_OPERATORS or "out" in node.kwargs:
            return True
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return (name.endswith("_") and not name.startswith("_")) or name in _IN_PLACE_DUNDERS


def _probe_value(v):
    """A real stand-in for a traced value: a tensor of the same dtype and rank with every size
    1 (they broadcast with anything; the index 0 is in range), a symbolic number's hint."""
    if isinstance(v, torch.Tensor):
        if v.device.type != "cpu":
            raise _Unprobed
        return torch.zeros((1,) * v.dim(), dtype=v.dtype)
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        hint = v.node.hint
        if hint is None:
            raise _Unprobed
        return hint
    if isinstance(v, list | tuple):
        return type(v)(_probe_value(x) for x in v)
    return v


class _Unprobed(Exception):
    pass


def refused_in_place(gm: fx.GraphModule) -> str | None:
    """Eager's message for the first in-place call of Dynamo's graph `gm` that eager refuses
    for its dtypes (see the module's docstring), or None. Each is made once in eager, on
    one-element CPU tensors of its arguments' dtypes."""
    calls = [node for node in gm.graph.nodes if _in_place(node)]
    if not calls:
        return None
    # `x.uniform_()` must not move the caller's generator
    with torch.random.fork_rng(devices=[]), unset_fake_temporarily():
        for node in calls:
            try:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs),
                                               lambda n: _probe_value(n.meta.get("example_value")))
                if node.op == "call_method":
                    getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    node.target(*args, **kwargs)
            except _Unprobed:
                continue
            except Exception as e:  # eager's TypeError, RuntimeError or NotImplementedError
                message = str(e).splitlines()[0] if str(e) else ""
                if any(r in message for r in _TYPE_REFUSALS):
                    return message
    return None
