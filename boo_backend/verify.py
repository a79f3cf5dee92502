"""Checks of a dynamic-shape module: IREE's outputs against the graph run in eager PyTorch
(see graph.CompiledGraph._call_dynamic), at the calls the verify policy picks.

Imports only partition (for compute_nodes) and symbolic from boo_backend.

A module compiled once for every size can be right at one size and wrong at another: IREE
3.13 packed a matmul wrongly once a dynamic size passed 64, and a size of 60 was wrong where
48 and 64 were right. So one checked call proves little. The policies (BOO_VERIFY):

- `auto` (the default): the first call in each size class, up to LIMIT checks per module. A
  size's class is its power-of-two range and its alignment (odd, even, 4, 8, or a multiple
  of 16), the boundaries where tiled code changes path; the class of a call is that of every
  size of its dynamic inputs.
- `all`: every new shape, however many (for debugging: each check runs the graph in eager).
- `off`: no check.
"""

from __future__ import annotations

import time

import torch
import torch.fx as fx

from . import symbolic
from .partition import compute_nodes

POLICIES = ("auto", "all", "off")
LIMIT = 8  # checks per module under `auto`; see bench/RESULTS.md for what they cost


def _draws_random(node: fx.Node) -> bool:
    """Random numbers, or uninitialized memory; an attention with dropout_p=0 draws none."""
    op = node.target
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return value != 0
    return True


def checkable(gm: fx.GraphModule) -> bool:
    """Whether running `gm` in eager PyTorch once more is harmless and gives the same values:
    no op that writes into its inputs, none that draws random numbers."""
    return not any(n.target._schema.is_mutable or _draws_random(n) for n in compute_nodes(gm))


def disagreement(gm, args: list, outputs, half: bool | None = None, declared=()) -> str | None:
    """How IREE's `outputs` for `args` differ from `gm` run in eager PyTorch, or None when they
    agree (`gm` must be checkable): same shapes and dtypes, the same integers, floats within
    a tolerance wide enough for a different order of summation, and for bf16's rounding
    wherever the graph computes in half precision (under autocast a float32 result carries
    the rounding of the bfloat16 matmuls before it). `gm` is a graph, or any callable with
    `half` saying whether its graph computes in half precision.

    `declared`: the graph's own dtype of each output. Where eager's kernel gives another
    dtype than torch's meta function traced (batch norm of bf16 input with float32 weights:
    float32 statistics in eager, bf16 in the graph), an output of the declared dtype is
    compared with eager's value in that dtype."""
    try:
        with torch.no_grad():
            expected = gm(*args)
    except Exception as e:  # the graph as traced does not run in eager (see Verifier.__init__)
        first = str(e).splitlines()[0] if str(e) else ""
        return f"it cannot be checked: eager PyTorch fails on the graph as traced ({type(e).__name__}: {first})"
    if half is None:
        half = computes_in_half(gm)
    ours = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    for i, (a, b) in enumerate(zip(ours, expected)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i} is {a!r}, eager gives {b!r}"
            continue
        if (isinstance(a, torch.Tensor) and a.dtype != b.dtype and i < len(declared) and declared[i] == a.dtype
                and a.dtype.is_floating_point and b.dtype.is_floating_point):
            b = b.to(a.dtype)
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            what = f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else repr(a)
            return f"output {i} is {what}, eager gives {tuple(b.shape)} {b.dtype}"
        if not b.numel():
            continue
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs from eager's"
            continue
        rel = 5e-2 if b.element_size() < 4 or half else 1e-3
        scale = b.double().nan_to_num(0.0, 0.0, 0.0).abs().max().item()
        try:
            torch.testing.assert_close(a, b, rtol=rel, atol=rel * scale + 1e-5, equal_nan=True)
        except AssertionError:
            err = (a.double() - b.double()).abs().nan_to_num(0.0).max().item()
            return f"output {i} differs by up to {err:.3g} (largest value {scale:.3g})"
    return None


def _outputs(gm: fx.GraphModule) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def computes_in_half(gm: fx.GraphModule) -> bool:
    """Whether any value of `gm` is a float of 16 bits or fewer."""
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_floating_point() and v.element_size() < 4
               for n in gm.graph.nodes)


def size_class(size: int) -> tuple[int, int]:
    """(power-of-two range, alignment up to 16) of a size."""
    if size <= 0:
        return (0, 0)
    return (size.bit_length(), min((size & -size).bit_length() - 1, 4))


class Verifier:
    """Which calls of one dynamic module are checked, and the check itself. `active` turns
    False once no call will be checked again (policy off, the limit reached, a graph that
    cannot be rerun), so the caller skips `wants` on its hot path."""

    def __init__(self, gm: fx.GraphModule, policy: str, limit: int | None = None):
        self.gm = gm
        self.policy = policy if policy == "off" or checkable(gm) else "off"
        self.limit = LIMIT if limit is None else limit
        self.active = self.policy != "off"
        self.checks = 0
        self._seen: set = set()
        values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        # Only the inputs with symbolic sizes can change from call to call.
        self._dynamic = [i for i, v in enumerate(values) if symbolic.tensor_is_symbolic(v)
                         or (isinstance(v, torch.SymInt) and not symbolic.is_static(v))]
        # The graph's dtype of each output. Eager may not run the graph as traced: a backward
        # that takes bf16 batch-norm statistics (as torch's meta function gives them) with
        # float32 weights fails in eager's kernel, which wants float32 statistics.
        self._declared = [v.dtype if isinstance(v := getattr(o, "meta", {}).get("val"), torch.Tensor) else None
                          for o in _outputs(gm)]

    def wants(self, args) -> tuple | None:
        """The key this call would be checked under, or None when it is not checked."""
        if not self.active:
            return None
        sizes = [tuple(args[i].shape) if isinstance(args[i], torch.Tensor) else (int(args[i]),)
                 for i in self._dynamic]
        key = tuple(sizes) if self.policy == "all" else tuple(tuple(map(size_class, s)) for s in sizes)
        return None if key in self._seen else key

    def sizes(self, args) -> str:
        """The sizes of a call's dynamic tensor inputs (else its SymInts), for a message."""
        shown = [str(list(args[i].shape)) for i in self._dynamic if isinstance(args[i], torch.Tensor)]
        shown = shown or [str(args[i]) for i in self._dynamic]
        return ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")

    def check(self, key: tuple, args: list, outputs, stats) -> str | None:
        """How this call's `outputs` differ from eager's, or None; counts it under `key`, and
        in `stats` (the process counters: dynamic_checks, dynamic_check_s)."""
        self._seen.add(key)
        self.checks += 1
        if self.policy == "auto" and self.checks >= self.limit:
            self.active = False
        start = time.perf_counter()
        try:
            return disagreement(self.gm, args, outputs, declared=self._declared)
        finally:
            stats["dynamic_checks"] += 1
            stats["dynamic_check_s"] += time.perf_counter() - start
