"""Symbolic sizes (Dynamo's dynamic shapes) as text that a compiled graph evaluates per call.

A leaf: imports nothing from boo_backend.

A graph traced with dynamic shapes names its sizes by sympy symbols (s0, s27*s77). A module
compiled once for all sizes still has to answer, per call, what those symbols are: the
SymInts the graph returns (AOTAutograd saves some for the backward) and the strides eager
gives its results. `sources` finds each symbol in the graph's inputs, as a bare SymInt input
or a bare dimension of a tensor input; `Sizes` evaluates expressions of them on a call's
arguments. Expressions travel as sympy's `srepr` text, so a lowering can live in the compile
cache.
"""

from __future__ import annotations

import contextlib
import functools

import sympy
import torch
import torch.utils._sympy.functions as _torch_sympy
from torch.fx.experimental.symbolic_shapes import statically_known_true


def expr(value):
    """The sympy expression of a SymInt (or SymFloat), or the int itself."""
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return value.node.expr
    return int(value)


def is_static(value) -> bool:
    """Whether a number, SymInt or SymFloat is a known constant (a SymInt may be one)."""
    return not isinstance(value, (torch.SymInt, torch.SymFloat)) or expr(value).is_number


def text(value) -> str:
    return sympy.srepr(sympy.sympify(expr(value)))


def shape_env(values):
    """The ShapeEnv behind the first symbolic size among `values` (tensors, SymInts), or None."""
    for v in values:
        for x in (v.shape if isinstance(v, torch.Tensor) else [v]):
            if isinstance(x, torch.SymInt):
                return x.node.shape_env
    return None


def is_row_major(shape, stride) -> bool:
    """Whether sizes and strides (ints or SymInts) are dense row-major for every value of
    their symbols (size-1 dims' strides do not matter). Decided on the expressions: no guard."""
    acc = sympy.Integer(1)
    for size, st in reversed(list(zip(shape, stride))):
        size = expr(size)
        if size != 1 and sympy.expand(expr(st) - acc) != 0:
            return False
        acc = acc * size
    return True


def outer_first(t: torch.Tensor) -> list[int]:
    """`t`'s dims from the largest stride to the smallest; where the order is not known (equal
    strides, or symbolic ones no guard-free comparison settles), dims keep their order.
    Permuted by it, a dense permuted layout is contiguous."""
    stride = t.stride()

    def compare(d: int, e: int) -> int:
        if statically_known_true(stride[d] > stride[e]):
            return -1
        return 1 if statically_known_true(stride[d] < stride[e]) else d - e

    return sorted(range(t.dim()), key=functools.cmp_to_key(compare))


def tensor_is_symbolic(t) -> bool:
    return isinstance(t, torch.Tensor) and not all(is_static(s) for s in (*t.shape, *t.stride()))


@functools.cache
def _namespace() -> dict:
    names = {n: getattr(sympy, n) for n in ("Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow",
                                             "Max", "Min", "Mod", "floor", "ceiling", "true", "false",
                                             "Equality", "Unequality", "StrictLessThan", "LessThan",
                                             "StrictGreaterThan", "GreaterThan", "And", "Or", "Not")}
    names.update({n: getattr(_torch_sympy, n) for n in dir(_torch_sympy)
                  if isinstance(getattr(_torch_sympy, n), type) and issubclass(getattr(_torch_sympy, n), sympy.Basic)})
    names["__builtins__"] = {}
    return names


@functools.lru_cache(maxsize=4096)
def parse(source: str) -> sympy.Expr:
    return eval(source, _namespace())  # srepr text written by `text`


def sources(values: list, as_traced: bool = False) -> dict[str, tuple[int, int | None]]:
    """Where each symbol of a graph's inputs `values` (placeholder meta values) can be read on
    a call: name -> (input index, None) for a SymInt input, (input index, dim) for a tensor
    dimension. Symbols that appear only inside larger expressions are left out.

    A size's symbol is the one the ShapeEnv would now write for it: after a guard
    `Eq(s94, s87)` it writes s87 for both. `as_traced`: the symbol Dynamo gave the size
    when it traced, before any such replacement, so that s94 and s87 are read separately."""
    def symbol(size):
        e = size.node._expr if as_traced else expr(size)
        return e if isinstance(e, sympy.Symbol) else None

    found: dict[str, tuple[int, int | None]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.SymInt) and symbol(v) is not None:
            found.setdefault(symbol(v).name, (i, None))
        elif isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt) and symbol(size) is not None:
                    found.setdefault(symbol(size).name, (i, d))
    return found


def free_names(source: str) -> set[str]:
    return {s.name for s in parse(source).free_symbols}


class Sizes:
    """Evaluates symbolic-size expressions (srepr text) on a call's arguments."""

    def __init__(self, where: dict[str, tuple[int, int | None]]):
        self.where = sorted(where.items())

    def key(self, args) -> tuple[int, ...]:
        """The symbols' values in this call, in a fixed order: what the expressions depend on."""
        return tuple(int(args[i]) if d is None else args[i].shape[d] for _, (i, d) in self.where)

    def evaluate(self, sources_: list[str], key: tuple[int, ...]) -> list:
        """The expressions' values at these sizes: ints, floats (of sizes: a SymFloat's), or
        bools for relations."""
        binding = {name: value for (name, _), value in zip(self.where, key)}
        out = []
        for source in sources_:
            e = parse(source)
            e = e.xreplace({s: binding[s.name] for s in e.free_symbols})
            e = sympy.sympify(e)  # a bare symbol comes back as the int bound to it
            out.append(bool(e) if isinstance(e, sympy.logic.boolalg.Boolean) else int(e) if e.is_integer else float(e))
        return out


class Conditions:
    """Relations among a graph's sizes (srepr text, `Eq(s94 + 1, s87 + 1)`) that a module
    compiled for all sizes assumed, checked on each call's sizes: the answer is kept per
    distinct set of the sizes they read, so a call pays a tuple and a dict lookup."""

    def __init__(self, texts: list[str], where: dict[str, tuple[int, int | None]]):
        self.texts = list(texts)
        self.sizes = Sizes({name: where[name] for t in self.texts for name in free_names(t)})
        self._known: dict[tuple[int, ...], bool] = {}

    def __str__(self) -> str:
        return " and ".join(str(parse(t)) for t in self.texts)

    def hold(self, args) -> bool:
        key = self.sizes.key(args)
        known = self._known.get(key)
        if known is None:
            if len(self._known) >= 4096:  # a decode loop meets a new length every token
                self._known.clear()
            known = self._known[key] = all(self.sizes.evaluate(self.texts, key))
        return known


def placeholder_values(gm) -> list:
    """The fake values of `gm`'s inputs, to trace it again with make_fx: one object per
    input. AOTAutograd can give two inputs the same value object (the saved tensors of two
    calls of one nested_compile_region), and make_fx, which maps tensors to graph inputs by
    identity, then read the second input wherever the first was used."""
    values, seen = [], set()
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        v = node.meta["val"]
        if isinstance(v, torch.Tensor) and id(v) in seen:
            with v.fake_mode if hasattr(v, "fake_mode") else contextlib.nullcontext():
                v = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        seen.add(id(v))
        values.append(v)
    return values
