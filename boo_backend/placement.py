"""Where the ops of each compiled graph went: one Placement per graph, in PLACEMENTS.

A leaf: imports nothing from boo_backend.
"""

from __future__ import annotations

import dataclasses

# Every graph boo has placed, in order; the demo prints these. See boo_backend.placements().
PLACEMENTS: list["Placement"] = []


@dataclasses.dataclass
class Placement:
    """Where the ops of one compiled graph went."""

    name: str
    kind: str  # forward, backward or inference
    ops: int
    iree: int
    decomposed: int
    island: int
    aten: int = 0  # left to ATen by choice: matmul kernels (BOO_ATEN_MATMUL), views, parts that only copy
    recovered: bool = False
    island_ops: tuple[str, ...] = ()
    # The composites used, by name, with counts: (("rms_norm", 2), ("softmax", 1)).
    composite_names: tuple[tuple[str, int], ...] = ()
    # The runtime driver of each IREE module ("module", or "submod_N" of a split graph),
    # filled in when known: a CPU module measures its choice on its first calls. "aten": the
    # part's own graph runs in ATen, measured faster than IREE (runtime.ATEN).
    drivers: dict[str, str] = dataclasses.field(default_factory=dict)
    # Compiled once with dynamic dimensions for every size Dynamo's guards admit.
    dynamic: bool = False
    # Compiled for another target (compile_only) and run in eager PyTorch. Not cached.
    compile_only: str = ""
    # Why the region of this graph runs as Dynamo's graph in eager PyTorch from some call on
    # (regions.py); empty while boo's graphs run it.
    in_eager: str = ""

    @property
    def composites(self) -> int:
        """How many nodes composites computed."""
        return sum(n for _, n in self.composite_names)

    def line(self) -> str:
        names = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in self.composite_names)
        text = (
            f"{self.name}: {self.kind} graph, {self.ops} ops: {self.iree} to IREE "
            f"({self.composites} as composites{': ' + names if names else ''}), "
            f"{self.decomposed} decomposed at FX level, {self.island} in eager islands"
        )
        if self.aten:
            text += f", {self.aten} left to ATen (matmul kernels, views and copies, random seeds)"
        if self.island_ops:
            text += f" [{', '.join(self.island_ops)}]"
        if self.recovered:
            text += " (compile failed; whole graph ran in eager PyTorch)"
        if self.dynamic:
            text += "; dynamic shapes"
        if self.compile_only:
            text += f"; compiled for {self.compile_only} only, ran in eager PyTorch"
        if self.drivers:
            iree = sorted(set(self.drivers.values()) - {"aten"})
            on_aten = sum(d == "aten" for d in self.drivers.values())
            text += "; runs on " + ", ".join(
                iree + ([f"ATen for {on_aten} part{'s' if on_aten > 1 else ''} (measured faster)"] if on_aten else []))
        if self.in_eager:
            text += f"; then its region ran as Dynamo's graph in eager PyTorch ({self.in_eager})"
        return text
