"""The check on a dynamic-shape module's first call: IREE's outputs against the graph run in
eager PyTorch (see graph.CompiledGraph._build_dynamic).

Imports only partition (for compute_nodes) from boo_backend.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .partition import compute_nodes


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


def _checkable(gm: fx.GraphModule) -> bool:
    """Whether running `gm` in eager PyTorch once more is harmless and gives the same values:
    no op that writes into its inputs, none that draws random numbers."""
    return not any(n.target._schema.is_mutable or _draws_random(n) for n in compute_nodes(gm))


def disagreement(gm: fx.GraphModule, args: list, outputs) -> str | None:
    """How IREE's `outputs` for `args` differ from `gm` run in eager PyTorch, or None when they
    agree: same shapes and dtypes, the same integers, floats within a tolerance wide enough
    for a different order of summation (and bf16's rounding)."""
    if not _checkable(gm):
        return None
    with torch.no_grad():
        expected = gm(*args)
    ours = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    for i, (a, b) in enumerate(zip(ours, expected)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i} is {a!r}, eager gives {b!r}"
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            what = f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else repr(a)
            return f"output {i} is {what}, eager gives {tuple(b.shape)} {b.dtype}"
        if not b.numel():
            continue
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs from eager's"
            continue
        rel = 5e-2 if b.element_size() < 4 else 1e-3
        scale = b.double().nan_to_num(0.0, 0.0, 0.0).abs().max().item()
        try:
            torch.testing.assert_close(a, b, rtol=rel, atol=rel * scale + 1e-5, equal_nan=True)
        except AssertionError:
            err = (a.double() - b.double()).abs().nan_to_num(0.0).max().item()
            return f"output {i} differs by up to {err:.3g} (largest value {scale:.3g})"
    return None
