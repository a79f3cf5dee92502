"""The composite registry: one entry per ATen OpOverload that boo replaces by a kernel.

A leaf: imports only config and symbolic (leaves) from boo_backend. Adding a composite means
one entry (in the family module under this package), one template `kernels/<name>.mlir`, and
one test row.

An entry says, for a node of its op:
- `accepts(args, kwargs, outs)`: None to take the node, or the reason it declines;
- `params(args, kwargs, outs)`: the template parameters (also the kernel's identity);
- `reference`: the decomposition it replaces (a torch._decomp entry), used when it is off;
- `canonical`: optional, rewrites a call into the shapes the kernel is written for;
- `tensor_args`: positions of the op's tensor arguments the kernel takes (None ones dropped).
- `flags`: the MIOpen-style -F bits this op answers in the benchmark driver (1 forward,
  2 input gradient, 4 weight gradient, 8 bias gradient), under its family name
  (`layer_norm` for native_layer_norm and native_layer_norm_backward);
- `sample(shape, dtype, flags)`: random inputs (args, kwargs) for the driver and benchmarks.
`args` is every argument in schema order (keyword-only ones too, defaults filled in), `kwargs`
the node's keyword arguments; both hold FakeTensors for tensors; `outs` the op's FakeTensor
results.

Sizes may be symbolic (SymInts, in a graph Dynamo traced with dynamic shapes). A parameter
holds a symbolic size as None, which templates render as a `?` dim; `size`, `sizes` and
`same` read sizes without ever evaluating a SymInt (which would add a guard to Dynamo's
graph, and make boo compile it per shape). A kernel that needs a dim static (its tiling, a
constant) declines where that dim is symbolic: `symbolic_decline`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Callable

import sympy
import torch

from .. import symbolic
from ..config import BooError

# Dtypes a kernel accepts, with their MLIR element type. Low precision accumulates in f32.
ELEMENT_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclasses.dataclass(frozen=True)
class Composite:
    op: torch._ops.OpOverload
    accepts: Callable[..., str | None]
    params: Callable[..., dict]
    reference: Callable
    tensor_args: tuple[int, ...]
    flags: int
    sample: Callable[..., tuple[list, dict]]
    canonical: Callable | None = None
    version: int = 1
    # The driver's op name when the ATen name does not give it (`softmax` for _softmax).
    family_name: str | None = None

    @property
    def name(self) -> str:
        """The ATen op without its overload: `gelu_backward`. Names the template, test and driver op."""
        return self.op._schema.name.split("::")[1]

    @property
    def template(self) -> str:
        return f"{self.name}.mlir"

    @property
    def family(self) -> str:
        """The driver's op name: `layer_norm` for native_layer_norm(_backward)."""
        return self.family_name or self.name.removeprefix("native_").removesuffix("_backward")


REGISTRY: dict[torch._ops.OpOverload, Composite] = {}
# Hand-written chains that patterns.py turns into these composites' ops (patterns.Pattern),
# declared in the family modules next to their entries.
PATTERNS: list = []


def register(entry: Composite) -> Composite:
    if entry.op in REGISTRY:
        raise BooError(f"composite for {entry.op} registered twice")
    REGISTRY[entry.op] = entry
    return entry


def register_pattern(pattern):
    PATTERNS.append(pattern)
    return pattern


def by_name(name: str) -> Composite:
    for entry in REGISTRY.values():
        if entry.name == name:
            return entry
    families = sorted({e.family for e in REGISTRY.values()})
    raise BooError(f"unknown composite {name!r}; valid names are: {', '.join(names())}; "
                   f"or families: {', '.join(families)}")


def names() -> list[str]:
    return sorted(entry.name for entry in REGISTRY.values())


def for_flags(family: str, flags: int) -> list[Composite]:
    """The composites of `family` that -F `flags` asks for, forward first."""
    found = [e for e in REGISTRY.values() if e.family == family]
    if not found:
        families = sorted({e.family for e in REGISTRY.values()})
        raise BooError(f"unknown op {family!r}; valid ops are: {', '.join(families)}")
    chosen = sorted((e for e in found if e.flags & flags), key=lambda e: e.flags)
    if not chosen or flags & ~sum({e.flags for e in found}):
        valid = ", ".join(f"{e.flags}={e.name}" for e in sorted(found, key=lambda e: e.flags))
        raise BooError(f"-F {flags} does not fit {family}; its bits are {valid}")
    return chosen


def flat(t, shape):
    """`t` reshaped (a canonical form's reshape), or None for an absent tensor."""
    return None if t is None else torch.ops.aten.reshape.default(t, shape)


def rows_cols(x, normalized_shape) -> tuple[int, int]:
    """[M, N] for a norm of `x` over its trailing `normalized_shape`."""
    return math.prod(x.shape[: x.dim() - len(normalized_shape)]), math.prod(normalized_shape)


def random_tensor(shape, dtype, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(list(shape)) * scale + shift).to(dtype)


def function_name(entry: Composite, params: dict) -> str:
    """The one place a kernel's MLIR function name is made: name, version, parameter hash."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"boo.{entry.name}.v{entry.version}.{digest}"


def disabled(force_decompose: str) -> set[torch._ops.OpOverload]:
    """The ops BOO_FORCE_DECOMPOSE turns off: "1"/"all" -> every one, else a comma list of
    composite names (`_log_softmax`) or of family names (`log_softmax`: its forward and
    backward) where no composite has that name (`gelu` is the forward composite alone)."""
    text = (force_decompose or "").strip()
    if text.lower() in ("", "0", "none", "false", "off"):
        return set()
    if text.lower() in ("1", "all", "true", "on"):
        return set(REGISTRY)
    off = set()
    for name in filter(None, (n.strip() for n in text.split(","))):
        if name in names():
            off.add(by_name(name).op)
        else:  # a family, as README's table names them (`layer_norm`)
            off.update([e.op for e in REGISTRY.values() if e.family == name] or [by_name(name).op])
    return off


def enabled(force_decompose: str) -> dict[torch._ops.OpOverload, Composite]:
    off = disabled(force_decompose)
    return {op: entry for op, entry in REGISTRY.items() if op not in off}


def size(value) -> int | None:
    """A size as a template parameter: the int, or None for a symbolic one (a `?` dim)."""
    return int(symbolic.expr(value)) if symbolic.is_static(value) else None


def sizes(values) -> list[int | None]:
    return [size(v) for v in values]


def same(a, b) -> bool:
    """Whether sizes `a` and `b` (ints, SymInts, or sequences of them) are equal for every
    value of their symbols; never a guard."""
    if isinstance(a, (list, tuple, torch.Size)) or isinstance(b, (list, tuple, torch.Size)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return sympy.expand(symbolic.expr(a) - symbolic.expr(b)) == 0


def same_assumed(a, b) -> bool:
    """Whether sizes `a` and `b` are equal, as `same`, or, when they are other symbols equal
    at the sizes being traced, by assuming so: a guard, which the module built on it checks
    on every call (graph.CompiledGraph's conditions). For sizes a model keeps equal in
    separate tensors, such as the key and value caches of a decoder."""
    if same(a, b):
        return True
    if isinstance(a, (list, tuple, torch.Size)) or isinstance(b, (list, tuple, torch.Size)):
        return len(a) == len(b) and all(same_assumed(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.SymInt) or not isinstance(b, torch.SymInt):
        return False
    return a.node.hint is not None and a.node.hint == b.node.hint and bool(a == b)


def symbolic_decline(**named) -> str | None:
    """The reason to decline when one of the named sizes, which the kernel needs static,
    is symbolic: symbolic_decline(N=n) -> "symbolic N (the kernel needs it static)"."""
    found = [name for name, value in named.items() if size(value) is None]
    if found:
        return f"symbolic {', '.join(found)} (the kernel needs {'it' if len(found) == 1 else 'them'} static)"
    return None


def common_decline(tensors: list, outs: list) -> str | None:
    """Checks every kernel shares: float dtype, one dtype, on a device. Symbolic sizes are
    each family's to check (see symbolic_decline)."""
    for t in [*tensors, *outs]:
        if t is None:
            continue
        if t.dtype not in ELEMENT_TYPES:
            return f"dtype {t.dtype} (kernels take {', '.join(map(str, ELEMENT_TYPES))})"
    return None


from . import attention, batch_norm, gelu, group_norm, layer_norm, rms_norm, softmax  # noqa: E402,F401  (families register themselves)
