"""Higher-order ops in AOTAutograd's graphs, rewritten into plain ATen before boo places the
graph (torch-mlir's importer takes none of them). A leaf: imports nothing else from boo_backend
but config, symbolic and checks (leaves too).

- invoke_subgraph (torch.compiler.nested_compile_region): the subgraph inlined.
- cond: both branches inlined and their results selected with `where` (cond's branches are
  pure and return alike; an IREE module has no branches to skip). In the branch not taken,
  each index is 0 and each integer divisor 1, so that its checks do not raise.
- random ops (dropout, rand, randn, bernoulli, ...; SEEDED): drawn from a counter-based
  generator keyed by a seed that the graph draws from torch's generator once per call
  (`boo::seeds`, an ATen kernel), each op from a seed of its own. IREE's own generator starts
  every module from the same fixed seed: torch.manual_seed changed nothing, and two graphs
  (two dropouts on either side of a graph break) drew the same masks at every step.
- run_and_save_rng_state / run_with_rng_state (activation checkpointing around randomness):
  the saved "state" becomes random bytes drawn in the forward, and the random ops that the
  op (or subgraph) runs draw from the same generator keyed by those bytes, so that the
  backward's recomputation draws exactly the forward's numbers.
- auto_functionalized (a custom op that mutates its input): the op on a copy of what it
  mutates; the op itself then runs as an eager island, as any custom op does.
- while_loop and any other: refused with an error naming the op (the graph then runs in
  eager PyTorch with a warning that names it, or strict mode raises).

The graph is traced again (make_fx on its own inputs' fake values, symbolic sizes kept)
through an interpreter that runs these rewrites.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from . import checks
from .config import BooError
from .symbolic import placeholder_values

aten = torch.ops.aten

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1, _MIX2 = -4658895280553007687, -7723592293110705685  # splitmix64's multipliers


def _shr(x, bits: int):
    """Logical shift right of int64 values, as a division (torch-mlir lowers no int64 shift):
    the low 63 bits divided by 2^bits, plus the sign bit moved down."""
    low = aten.div.Scalar_mode(aten.bitwise_and.Scalar(x, (1 << 63) - 1), 1 << bits, rounding_mode="trunc")
    return aten.add.Tensor(low, aten.mul.Scalar(aten._to_copy.default(aten.lt.Scalar(x, 0), dtype=torch.int64),
                                                1 << (63 - bits)))


def uniform(seed: torch.Tensor, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Uniform [0, 1) numbers of `shape`, a function of `seed` (0-d int64) and of each
    element's index: splitmix64's finalizer of seed * m + index * golden."""
    count = 1
    for s in shape:
        count = count * s
    index = aten.arange.start_step(0, count, 1, dtype=torch.int64, device=device)
    h = aten.add.Tensor(aten.mul.Scalar(index, _GOLDEN), aten.mul.Scalar(seed, _MIX1))
    h = aten.mul.Scalar(aten.bitwise_xor.Tensor(h, _shr(h, 30)), _MIX1)
    h = aten.mul.Scalar(aten.bitwise_xor.Tensor(h, _shr(h, 27)), _MIX2)
    h = aten.bitwise_xor.Tensor(h, _shr(h, 31))
    # as many bits as the type holds exactly, so that no value rounds up to 1
    bits = {torch.float64: 53, torch.float16: 11, torch.bfloat16: 8}.get(dtype, 24)
    u = aten.mul.Scalar(aten._to_copy.default(_shr(h, 64 - bits), dtype=_wide(dtype)), 2.0 ** -bits)
    return aten.reshape.default(aten._to_copy.default(u, dtype=dtype), list(shape))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in (torch.float64, torch.int64) else torch.float32


def normal(seed: torch.Tensor, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Standard normal numbers (Box-Muller) from two uniform streams of `seed`."""
    wide = _wide(dtype)
    u = uniform(seed, shape, wide, device)
    v = uniform(aten.bitwise_not.default(seed), shape, wide, device)
    radius = aten.sqrt.default(aten.mul.Scalar(aten.log.default(aten.rsub.Scalar(u, 1.0)), -2.0))
    return aten._to_copy.default(aten.mul.Tensor(radius, aten.cos.default(aten.mul.Scalar(v, 2 * math.pi))),
                                 dtype=dtype)


def _integers(seed, low, high, shape, dtype, device):
    """Integers in [low, high) from uniform float64 numbers."""
    u = uniform(seed, shape, torch.float64, device)
    drawn = aten.floor.default(aten.add.Scalar(aten.mul.Scalar(u, high - low), low))
    return aten._to_copy.default(aten.clamp.default(drawn, low, high - 1), dtype=dtype)


@torch.library.custom_op("boo::seeds", mutates_args=(), schema="(Device device, int count) -> Tensor[]",
                         tags=(torch.Tag.nondeterministic_seeded,))
def host_seeds(device: torch.device, count: int) -> list[torch.Tensor]:
    """`count` 0-d int64 tensors drawn from torch's generator of `device`: the seeds of a
    graph's random ops, one each, drawn once per call as an ATen kernel (assemble places it
    so). One op hands each its own seed, so that the IREE parts of repeated blocks take
    their seeds as inputs and stay alike (blocks.py)."""
    drawn = torch.randint(-(1 << 63), (1 << 63) - 1, (count,), dtype=torch.int64, device=device)
    return [drawn[i].clone() for i in range(count)]


@host_seeds.register_fake
def _(device, count):
    return [torch.empty((), dtype=torch.int64, device=device) for _ in range(count)]


SEED = torch.ops.boo.seeds.default


def seeds(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of `gm` that draw a seed from torch's generator (they run in ATen)."""
    return {n for n in gm.graph.nodes if n.op == "call_function" and n.target is SEED}


def _dropout(seed, x, p, train):
    if not train or p == 0:
        return x, aten.ones_like.default(x, dtype=torch.bool)
    if p == 1:  # eager's F.dropout multiplies by 0 (NaN stays NaN), dropping every element
        return aten.mul.Scalar(x, 0.0), aten.zeros_like.default(x, dtype=torch.bool)
    keep = aten.ge.Scalar(uniform(seed, x.shape, torch.float32, x.device), p)
    return aten.mul.Scalar(aten.mul.Tensor(x, keep), 1.0 / (1.0 - p)), keep


# The random ops a checkpointed region may run, drawn from a seed: op -> f(seed, *args, **kwargs).
SEEDED = {
    aten.native_dropout.default: _dropout,
    aten.bernoulli.p: lambda seed, x, p=0.5, *, generator=None: aten._to_copy.default(
        aten.lt.Scalar(uniform(seed, x.shape, torch.float32, x.device), p), dtype=x.dtype),
    aten.bernoulli.default: lambda seed, x, *, generator=None: aten._to_copy.default(
        aten.lt.Tensor(uniform(seed, x.shape, torch.float32, x.device), x), dtype=x.dtype),
    aten.rand_like.default: lambda seed, x, *, dtype=None, **kw: uniform(seed, x.shape, dtype or x.dtype, x.device),
    aten.rand.default: lambda seed, size, *, dtype=None, device=None, **kw: uniform(
        seed, size, dtype or torch.float32, device or "cpu"),
    aten.uniform.default: lambda seed, x, low=0.0, high=1.0, *, generator=None: aten._to_copy.default(
        aten.add.Scalar(aten.mul.Scalar(uniform(seed, x.shape, _wide(x.dtype), x.device), high - low), low),
        dtype=x.dtype),
    aten.exponential.default: lambda seed, x, lambd=1.0, *, generator=None: aten._to_copy.default(
        aten.div.Scalar(aten.neg.default(aten.log.default(aten.rsub.Scalar(
            uniform(seed, x.shape, _wide(x.dtype), x.device), 1.0))), lambd), dtype=x.dtype),
    aten.randn_like.default: lambda seed, x, *, dtype=None, **kw: normal(seed, x.shape, dtype or x.dtype, x.device),
    aten.randn.default: lambda seed, size, *, dtype=None, device=None, **kw: normal(
        seed, size, dtype or torch.float32, device or "cpu"),
    aten.normal_functional.default: lambda seed, x, mean=0.0, std=1.0, *, generator=None: aten._to_copy.default(
        aten.add.Scalar(aten.mul.Scalar(normal(seed, x.shape, _wide(x.dtype), x.device), std), mean), dtype=x.dtype),
    aten.randint.low: lambda seed, low, high, size, *, dtype=None, device=None, **kw: _integers(
        seed, low, high, size, dtype or torch.int64, device or "cpu"),
    aten.randint.default: lambda seed, high, size, *, dtype=None, device=None, **kw: _integers(
        seed, 0, high, size, dtype or torch.int64, device or "cpu"),
    aten.randint_like.default: lambda seed, x, high, *, dtype=None, **kw: _integers(
        seed, 0, high, x.shape, dtype or x.dtype, x.device),
    aten.randint_like.low_dtype: lambda seed, x, low, high, *, dtype=None, **kw: _integers(
        seed, low, high, x.shape, dtype or x.dtype, x.device),
}


def _draws_nothing(op, args, kwargs) -> bool:
    """A random op called so that it draws no numbers: attention with dropout_p = 0."""
    if op is aten._scaled_dot_product_flash_attention_for_cpu.default:
        return (args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)) == 0
    return False


def _is_random(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


class _Run(fx.Interpreter):
    """Runs a graph (under make_fx), higher-order ops by the rewrites; random ops draw
    (SEEDED) from the next of `seeds` (the host's, a list this run and the runs of its
    subgraphs take from), then from the one after the last drawn. `replay`: `seed` is a
    checkpointed region's saved state, from which its random ops draw in turn, and must all
    draw again alike in the backward; else ops that SEEDED lacks draw as they did."""

    def __init__(self, gm: fx.GraphModule, seed=None, state_bytes: int = 5056, region: str | None = None,
                 taken=None, replay: bool = False, seeds: list | None = None):
        super().__init__(gm)
        self.seed = seed
        self.seeds = seeds
        self.replay = replay
        # Inside a branch of cond: a 0-d bool tensor, whether this branch is the one taken.
        self.taken = taken
        # The module stack the nodes traced here get (one per invoke_subgraph call), so that
        # blocks.block_labels sees each call of a nested_compile_region as a block of its own.
        self.region = region
        self.regions = 0
        # the size of the "rng state" the graph saves (torch.get_rng_state()'s on the CPU)
        self.state_bytes = state_bytes

    def call_function(self, target, args, kwargs):
        if isinstance(target, torch._ops.HigherOrderOperator):
            rewrite = getattr(self, "_" + target.name(), None)
            if rewrite is None:
                raise BooError(f"boo: torch.ops.higher_order.{target.name()} cannot be lowered to IREE "
                               "(boo lowers invoke_subgraph, cond, checkpointing's rng ops and "
                               "auto_functionalized); the graph runs in eager PyTorch")
            return rewrite(*args, **kwargs)
        if self._seeded() and _is_random(target) and not _draws_nothing(target, args, kwargs):
            if target in SEEDED:
                return SEEDED[target](self._next_seed(), *args, **kwargs)
            if self.replay:
                raise BooError(f"boo: {target} under activation checkpointing draws numbers boo cannot "
                               "draw again in the backward (it can for dropout, bernoulli, rand and randn)")
        if self.taken is not None:
            args = _harmless_unless_taken(target, list(args), self.taken)
        return super().call_function(target, args, kwargs)

    def _seeded(self) -> bool:
        return self.seed is not None or bool(self.seeds)

    def _next_seed(self):
        """A new stream for each random op."""
        self.seed = self.seeds.pop(0) if self.seeds and not self.replay else aten.add.Scalar(self.seed, 1)
        return self.seed

    def _sub(self, graph, args, seed=None, region=None, taken=None):
        """`graph` run on `args`; its random ops draw from `seed` (a checkpointed region's
        state), else as this graph's would, and this graph's draw on after theirs."""
        replay = self.replay if seed is None else True
        run = _Run(graph, self.seed if seed is None else seed, self.state_bytes, region or self.region,
                   self.taken if taken is None else taken, replay, None if replay else self.seeds)
        out = run.run(*args)
        if seed is None:
            self.seed = run.seed
        return out

    def run_node(self, n):
        if self.region is None:
            return super().run_node(n)
        stack = n.meta.get("nn_module_stack")
        n.meta["nn_module_stack"] = {"region": (self.region, "nested_compile_region")}
        try:
            return super().run_node(n)
        finally:
            if stack is None:
                del n.meta["nn_module_stack"]
            else:
                n.meta["nn_module_stack"] = stack

    def _invoke_subgraph(self, subgraph, identifier, *operands):
        self.regions += 1
        return self._sub(subgraph, operands, region=self.region or f"nested_compile_region.{self.regions}")

    def _cond(self, pred, true_fn, false_fn, operands):
        not_pred = aten.logical_not.default(pred)
        if self.taken is not None:
            pred, not_pred = (aten.logical_and.default(self.taken, p) for p in (pred, not_pred))
        ours, theirs = self._sub(true_fn, operands, taken=pred), self._sub(false_fn, operands, taken=not_pred)
        select = lambda a, b: aten.where.self(pred, a, b) if isinstance(a, torch.Tensor) else a  # noqa: E731
        if isinstance(ours, (tuple, list)):
            return type(ours)(select(a, b) for a, b in zip(ours, theirs))
        return select(ours, theirs)

    def _run_and_save_rng_state(self, op, *args, **kwargs):
        drawn = (uniform(self._next_seed(), [self.state_bytes], torch.float32, "cpu") if self._seeded()
                 else aten.rand.default([self.state_bytes]))
        state = aten._to_copy.default(aten.mul.Scalar(drawn, 256.0), dtype=torch.uint8)
        return state, self._run_with_rng_state(state, op, *args, **kwargs)

    def _run_with_rng_state(self, state, op, *args, **kwargs):
        # seven bytes of the state as one int64 (through float: IREE widens uint8 as signed)
        head = aten._to_copy.default(aten._to_copy.default(aten.slice.Tensor(state, 0, 0, 7), dtype=torch.float32),
                                     dtype=torch.int64)
        seed = aten.select.int(head, 0, 0)
        for k in range(1, 7):
            seed = aten.add.Tensor(seed, aten.mul.Scalar(aten.select.int(head, 0, k), 256 ** k))
        if isinstance(op, fx.GraphModule):
            return self._sub(op, args, seed)
        if _is_random(op):
            return _Run(_single(op, len(args), kwargs), seed, replay=True).run(*args)
        return op(*args, **kwargs)

    def _auto_functionalized(self, op, **kwargs):
        return self._functionalized(op, kwargs, v2=False)

    def _auto_functionalized_v2(self, op, **kwargs):
        return self._functionalized(op, kwargs, v2=True)

    def _functionalized(self, op, kwargs, v2: bool):
        """The op on copies of what it mutates; returns (its results..., the copies...)."""
        mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        bases = None
        if v2:
            bases = list(kwargs.pop("_all_bases"))
            for name in mutated:
                index = kwargs.pop(f"_{name}_base_index", None)
                for extra in ("_size", "_stride", "_storage_offset", "_slice_dim", "_slice_start", "_slice_end"):
                    kwargs.pop(f"_{name}{extra}", None)
                if index is not None:
                    bases[index] = aten.clone.default(bases[index])
                    kwargs[name] = bases[index]
        else:
            for name in mutated:
                if kwargs.get(name) is not None:
                    kwargs[name] = aten.clone.default(kwargs[name])
        out = op(**kwargs)
        # auto_functionalized's results: the op's (a None for an op that returns nothing), then the written
        results = list(out) if isinstance(out, (tuple, list)) else [out]
        written = bases if v2 else [kwargs[name] for name in mutated]
        return tuple(results + list(written))


def _single(op, count: int, kwargs) -> fx.GraphModule:
    """A graph of one call of `op` on `count` inputs."""
    graph = fx.Graph()
    inputs = [graph.placeholder(f"a{i}") for i in range(count)]
    graph.output(graph.call_function(op, tuple(inputs), kwargs))
    return fx.GraphModule(torch.nn.Module(), graph)


# Integer ops that raise on a zero divisor (arith's checks, and ATen itself on an island):
# the position of the divisor.
_DIVISIONS = {aten.div.Tensor_mode: 1, aten.remainder.Tensor: 1, aten.fmod.Tensor: 1, aten.floor_divide.default: 1}


def _harmless_unless_taken(target, args: list, taken) -> list:
    """`args` of an op in a branch of cond, with each index it takes 0 and each integer
    divisor 1 where the branch is not taken. Both branches are computed, and the one not
    taken must not raise what eager only raises when it runs: `cond(i.max() < n, x[i], ...)`
    with i past n, or `cond((b == 0).any(), ..., a // b)` (checks.py)."""
    def harmless(value, neutral):
        if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
            return value
        return aten.where.self(taken, value, aten.full_like.default(value, neutral))

    spec = checks.ONE_INDEX.get(target)
    if spec is not None and len(args) > spec[1]:
        args[spec[1]] = harmless(args[spec[1]], 0)
    elif target in checks.INDEX_LISTS and len(args) > 1:
        args[1] = [harmless(i, 0) for i in args[1]]
    elif target in _DIVISIONS and len(args) > _DIVISIONS[target]:
        args[_DIVISIONS[target]] = harmless(args[_DIVISIONS[target]], 1)
    return args


def has_higher_order_ops(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
               for n in gm.graph.nodes)


def _draws(gm: fx.GraphModule) -> int:
    """How many seeds `gm` may draw: one for each call of a random op that SEEDED draws and
    each random state saved (checkpointing), in `gm` and in each call of a graph it calls."""
    count = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        count += n.target in SEEDED or n.target is torch.ops.higher_order.run_and_save_rng_state
        for a in n.args:
            if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(sub := getattr(gm, a.target, None), fx.GraphModule):
                count += _draws(sub)
    return count


def _device(values) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


def inline(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` traced again with its higher-order ops rewritten and its random ops drawn from a
    seed of torch's generator (see the module's docstring); `gm` itself when it has neither."""
    draws = _draws(gm)
    if not draws and not has_higher_order_ops(gm):
        return gm
    state_bytes = 5056
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.higher_order.run_and_save_rng_state:
            for user in n.users:
                val = user.meta.get("val")
                if user.args[1] == 0 and isinstance(val, torch.Tensor) and isinstance(val.numel(), int):
                    state_bytes = val.numel()
    values = placeholder_values(gm)
    fake_mode = detect_fake_mode(values)
    with fake_mode, fx_traceback.preserve_node_meta():  # module stacks, for blocks.block_labels
        return make_fx(lambda *a: _Run(gm, state_bytes=state_bytes,
                                       seeds=list(host_seeds(_device(a), draws)) if draws else None).run(*a),
                       tracing_mode="real")(*values)
