"""What a failed compile says: which ATen ops it names, and one line for a warning.

Imports compile (for BooCompileError) and torch_import (for unregistered_ops) from boo_backend.
"""

from __future__ import annotations

import re

from .compile import BooCompileError
from .torch_import import unregistered_ops


class Unlowerable(Exception):
    """The compiler rejected these torch-mlir op names. `final`: a decomposition would not
    help (the target lacks a math function the op needs), so they go straight to islands."""

    def __init__(self, names: set[str], final: bool = False):
        super().__init__(", ".join(sorted(names)))
        self.names = names
        self.final = final


_OP_LINE = re.compile(r"^\s*(?P<results>%[\w, %]+?)\s*=\s*(?P<op>torch\.[\w.]+)")
_ATEN = re.compile(r"^torch\.(aten|prims)\.")


def _walk(start: list[int], step) -> list[int]:
    """Line indices reached from `start`, where `step(i)` gives the lines next to line i."""
    todo, seen = list(start), {}
    while todo:
        i = todo.pop()
        if i not in seen:
            seen[i] = None
            todo.extend(step(i))
    return list(seen)


def _failing_lines(err: BooCompileError, lines: list[str]) -> list[int]:
    return [n - 1 for n in err.failing_lines() if 0 < n <= len(lines)]


def unlinked_ops(err: BooCompileError, lines: list[str]) -> set[str]:
    """A link error ("undefined symbol: sin") comes from a math function the CPU runtime lacks
    (IREE has no f64 `sin`, `exp`, ...). It points at the root op of the dispatch, so look at
    that op and its producers: those named after the symbol, else those computing in f64."""
    symbols = set(re.findall(r"undefined symbol: (\w+)", err.diagnostics))
    if not symbols:
        return set()
    defs = {v: i for i, line in enumerate(lines) if (m := _OP_LINE.match(line))
            for v in re.findall(r"%[\w]+", m.group("results"))}

    def producers(i: int) -> list[int]:
        operands = lines[i].split("=", 1)[-1].split(":", 1)[0]
        return [defs[v] for v in re.findall(r"%[\w]+", operands) if v in defs]

    # The linker names the dispatch's line as ">>> referenced by <stdin>:N"; the compiler's
    # own errors for a link failure point at line 1 (the module).
    referenced = [int(n) - 1 for n in re.findall(r"referenced by <stdin>:(\d+)", err.diagnostics)]
    start = [i for i in _failing_lines(err, lines) + referenced if 0 <= i < len(lines)]
    ops: dict[str, str] = {}
    for i in _walk(start, producers):
        m = _OP_LINE.match(lines[i])
        if m and _ATEN.match(m.group("op")):
            ops[m.group("op")] = lines[i]
    stems = {sym.rstrip("f") for sym in symbols}
    named = {op for op in ops if any(stem in op.split(".")[2] for stem in stems)}
    if named:
        return named
    # No op on that walk is named after the symbol: the f64 ops of the module that are
    # (tanh for "tanh", not every f64 op of the graph).
    exact = symbols | {sym[:-1] for sym in symbols if sym.endswith("f")}
    everywhere = {m.group("op") for line in lines if (m := _OP_LINE.match(line)) and _ATEN.match(m.group("op"))
                  and "f64" in line and m.group("op").split(".")[2].split("_")[0] in exact}
    return everywhere or {op for op, line in ops.items() if "f64" in line}


def failing_ops(err: BooCompileError) -> set[str]:
    """ATen op names behind the lines the compiler complained about. A complaint about a
    constant or a list means its user was left unconverted, so follow the value to it."""
    lines = err.mlir.splitlines()

    def users(i: int) -> list[int]:
        m = _OP_LINE.match(lines[i])
        if not m or _ATEN.match(m.group("op")):
            return []
        found = []
        for value in re.findall(r"%[\w]+", m.group("results")):
            use = re.compile(re.escape(value) + r"\b")
            found.extend(j for j in range(i + 1, len(lines)) if use.search(lines[j].split("=", 1)[-1]))
        return found

    names: set[str] = set()
    for i in _walk(_failing_lines(err, lines), users):
        names.update(unregistered_ops(lines[i]))
        m = _OP_LINE.match(lines[i])
        if m and _ATEN.match(m.group("op")):
            names.add(m.group("op"))
    return names


def first_error(e: Exception) -> str:
    """One line for a warning: the compiler's first error, or the exception's first line."""
    if isinstance(e, BooCompileError):
        line = next((ln for ln in e.diagnostics.splitlines() if "error" in ln), "").strip()
        if not line and "Stack dump" in e.diagnostics:
            line = "the compiler crashed (stack dump in the debug log)"
        return f"iree-compile: {line or 'failed'}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
