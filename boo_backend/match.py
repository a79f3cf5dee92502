"""Step 1 of a graph's journey: replace ATen nodes by composite kernels.

The composite registry arrives with the composites; until then nothing matches and every
node goes down torch-mlir's path.
"""

from __future__ import annotations

import torch.fx as fx

from .config import Options


def apply(gm: fx.GraphModule, opts: Options) -> tuple[fx.GraphModule, int]:
    """Rewrite matched nodes in `gm`; returns the graph and how many nodes became composites."""
    return gm, 0


def decompositions(opts: Options) -> dict:
    """The decomposition table for AOTAutograd: core ATen minus the composites kept."""
    from torch._decomp import core_aten_decompositions

    return dict(core_aten_decompositions())
