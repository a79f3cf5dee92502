"""One AOTAutograd graph, compiled and run through IREE: once, with dynamic dimensions, when
Dynamo traced it with symbolic sizes, else once per concrete input shape.

Imports assemble (how a graph becomes IREE parts), blocks, saved, partition, lower, part,
placement, verify, symbolic, diagnose, embed, compile, cache and config from boo_backend.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import operator
import re
import warnings
import weakref
from typing import Callable

import sympy
import torch
import torch.fx as fx

from . import blocks, pool, saved, symbolic, tangents
from .assemble import Assembly, NotDynamic
from .cache import CompileCache, timed
from .compile import BooCompileTimeout, Target, compile_mlir, compile_flags, target_for
from .config import BooFallbackWarning, BooStrictError, Options
from .decompositions import UNLOWERED
from .diagnose import first_error
from .embed import mlir_op_name
from .verify import Verifier
from .lower import Lowered
from .partition import Plan, compute_nodes, is_symbolic
from .part import IreePart, donate
from .runtime import ATEN, BooRuntimeError
from .placement import PLACEMENTS, Placement

log = logging.getLogger("boo_backend")

# Guards on sizes that boo's tracing added to a ShapeEnv once Dynamo had made its own, which
# Dynamo therefore never checks (srepr text), by env: see CompiledGraph._conditions_of.
_ADDED_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Factory ops name their device; a module does not depend on it (all its buffers live on the
# target), so a graph traced on CPU tensors and the same graph traced on CUDA ones share a
# cache entry: a cache cross-compiled for a GPU (compile_only) serves the GPU's process.
_DEVICE = re.compile(r"(device: )(?:cpu|cuda|hip)(?::\d+)?\b|device\(type='\w+'(?:, index=\d+)?\)")


def graph_text(gm: fx.GraphModule) -> str:
    """The graph as a cache key names it, devices left out, and the value of each constant it
    reads (get_attr). The graph's text names a constant but does not show it: graphs that
    differ only there (`x * torch.tensor(2.0)` and `x * torch.tensor(3.0)`) were one key, and
    the second was given the first's module and constant. Also torch's default dtype, which
    the text does not show either: `i * 0.3` of an int64 `i`, `torch.arange(0., 1, 0.3)` and
    `torch.full(size, 0.1)` are float64 under `torch.set_default_dtype(torch.float64)`, and
    were served the float32 module compiled before it."""
    consts = [f"default dtype = {torch.get_default_dtype()}"]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            text = (blocks.tensor_text(value) if isinstance(value, torch.Tensor)
                    else graph_text(value) if isinstance(value, fx.GraphModule) else f"object:{id(value)}")
            consts.append(f"{node.target} = {text}")
    return _DEVICE.sub("device: ...", "\n".join([str(gm.graph), *consts]))


@functools.cache
def _say_compile_only(target: str) -> None:
    log.info("boo: compile_only: compiling every graph for %s into the compile cache (and dump_dir); "
             "the model runs in eager PyTorch", target)


def _boxed(runner) -> Callable[[list], object]:
    """`runner` as a call on the argument list, which a graph cut into parts empties before its
    first part runs. AOTAutograd hands the backward its saved activations in that list and
    keeps no other reference to them (it clears ctx's), so each activation is freed after the
    part that reads it last, as torch's autograd frees them, rather than when the whole
    backward returns: GPT-2 small's peak fell by 200 MB (bench/RESULTS.md, twenty-third
    session). A graph is given the boxed calling convention on a copy, so the one it came
    from (an eager fallback's `self.gm`) still takes its arguments one by one."""
    if isinstance(runner, IreePart):  # one module: it reads every argument in its one call
        forward = runner.forward  # not through nn.Module's call hooks, which cost per step

        def call(args):
            return forward(*args)

        call.part = runner  # for bench/overhead.py
        return call
    if isinstance(runner, fx.GraphModule):
        graph = fx.Graph()
        graph.output(graph.graph_copy(runner.graph, {}))
        graph.set_codegen(fx.graph._BoxedCodeGen())
        return fx.GraphModule(runner, graph).forward
    return lambda args: runner(*args)


def _signature(values) -> list[str]:
    """Dtypes, sizes and strides of a call's arguments (or of a graph's symbolic inputs)."""
    return [f"{v.dtype}{tuple(v.shape)}{v.stride()}" if isinstance(v, torch.Tensor) else repr(v) for v in values]


class CompiledGraph(Assembly):
    """The callable handed back to AOTAutograd (boxed: it takes the argument list).

    A graph with symbolic sizes first tries to compile once for all of them (`dynamic`):
    torch-mlir imports the sizes as `?` dims with their relations, and IREE compiles those.
    The graph falls back to one module per concrete shape when that fails; a debug line says
    why. Making the module may need a guard on the sizes that Dynamo does not check (boo's
    retrace of attention compares the key and value lengths, which Dynamo holds as separate
    symbols): the module then serves the calls whose sizes meet it (`_conditions`), and
    another call compiles for its own shape.
    """

    def __init__(self, gm: fx.GraphModule, kind: str, opts: Options, name: str,
                 whole: Callable[[], fx.GraphModule] | None = None):
        # An instance attribute, so that wrappers made with functools.wraps copy it.
        self._boxed_call = True
        self.gm = gm
        # A warm start's graph of static shapes may come without its nodes' values (which
        # only a build reads): `whole` loads the graph with them (aot_cache).
        self._whole = whole
        blocks.keep_module_stacks(gm)  # for the blocks of every retrace of it
        self.kind = kind
        self.opts = opts
        self.name = name
        self.symbolic = is_symbolic(gm)
        self.dynamic = self.symbolic and opts.dynamic
        self._dynamic_runner = None
        self._conditions: symbolic.Conditions | None = None  # what the dynamic module assumed
        self._verifier = Verifier(gm, opts.verify if self.dynamic else "off")
        self.cache = CompileCache(opts.cache_dir, opts.cache)
        self._runners: dict = {}
        # Measuring where matmuls run (aten_matmul=auto) needs the target's device, which a
        # compile_only run does not have: they stay in IREE there.
        self.aten_matmul = "never" if opts.compile_only and opts.aten_matmul == "auto" else opts.aten_matmul
        # Runtime drivers of the runner being built, by part; see Placement.drivers.
        self._drivers: dict[str, str] = {}
        # Every IREE module loaded for the graph (all its runners and variants): see on_aten_only.
        self.functions: list = []
        # A backward given None for tangents its forward left unmade: the graph with those
        # inputs as zeros, by their positions (tangents.py).
        self._variants: dict[tuple[int, ...], CompiledGraph] = {}
        self._tangents = tangents.positions(gm) if kind == "backward" else []
        # A static forward asks autograd not to make the zero gradients its backward gets None for.
        self._leaves_unmade = kind == "forward" and not self.symbolic and not opts.compile_only

    def built(self) -> bool:
        """Whether the graph has been built (at its first call)."""
        return bool(self._runners or self._dynamic_runner or any(v.built() for v in self._variants.values()))

    def names(self) -> set[str]:
        """The graph's name and its variants' (their placements carry them)."""
        return {self.name, *(v.name for v in self._variants.values())}

    def on_aten_only(self) -> bool:
        """Whether the graph has been built and each of its IREE modules was measured slower
        than its own graph op by op in ATen (runtime.ATEN): nothing of it runs in IREE."""
        return self.built() and all(getattr(f, "driver", None) == ATEN for f in self.functions)

    def runs_in_iree(self) -> bool:
        """Whether a module of the graph has settled on an IREE driver: it never runs on ATen
        only then (a driver, once chosen, stays)."""
        return any(getattr(f, "driver", None) not in (None, ATEN) for f in self.functions)

    def _key(self, args) -> tuple:
        return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)

    def __call__(self, args):
        if self._tangents and any(args[i] is None for i in self._tangents):
            return self._without_unmade(args)
        if self._leaves_unmade:
            tangents.leave_unmade()
        if self.opts.compile_only:
            self._compile_only(list(args))
            return self.gm(*args)
        if self.dynamic:
            if (self._dynamic_runner is not None and not self._verifier.active
                    and (self._conditions is None or self._conditions.hold(args))):
                outputs = self._run_dynamic(self._dynamic_runner, args)
            else:
                outputs = self._call_dynamic(args)
            if outputs is not None:
                return outputs
        key = self._key(args) if self.symbolic else None
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = _boxed(self._build(list(args), len(self._runners)))
            return self._first_call(key, runner, args)
        return runner(args)

    def _without_unmade(self, args: list):
        """A backward call given None for the tangents at some positions (tangents.py): the
        graph's variant where they are zeros, on the other arguments. Only tangents count:
        AOTAutograd passes its effect tokens as None too."""
        missing = tuple(i for i in self._tangents if args[i] is None)
        variant = self._variants.get(missing)
        if variant is None:
            gm = self._whole() if self._whole is not None else self.gm
            try:
                zeroed = tangents.zeroed(gm, missing)
            except ValueError as e:  # a tangent without a static shape: autograd's zeros after all
                log.debug("%s; %s graph %s makes the zeros", e, self.kind, self.name)
                return self(tangents.fill(list(args), gm, self._tangents))
            variant = CompiledGraph(zeroed, self.kind, self.opts, f"{self.name}_z{len(self._variants)}")
            variant.functions = self.functions
            self._variants[missing] = variant
            log.debug("boo: %s graph %s: tangents %s were not made (outputs no one differentiated); "
                      "running %s, where they are zeros", self.kind, self.name, list(missing), variant.name)
        present = [a for i, a in enumerate(args) if i not in missing]  # other Nones (effect tokens) stay
        if isinstance(args, list):
            args.clear()  # the saved tensors go as the graph lets go of them, as in a call of its own
        return variant(present)

    def _first_call(self, key, runner, args: list):
        """A module's first call. IREE refuses some modules only when they run (torch-mlir
        lowers adaptive max pooling whose windows differ in size to a kernel that fails
        then), and the graph then runs in eager PyTorch where the call still has its
        arguments: one module takes them as they are, but a graph cut into parts has let go
        of them (keeping them for a retry would raise the first step's peak, which is the
        process's), so its error stands."""
        try:
            return runner(args)
        except BooRuntimeError as e:
            if self.opts.strict or not args:
                raise
            warnings.warn(f"boo: {self.kind} graph {self.name} failed at its first call ({first_error(e)}); "
                          "running it in eager PyTorch at these sizes", BooFallbackWarning, stacklevel=2)
            self._runners[key] = _boxed(self.gm)
            return self.gm(*args)

    def _compile_only(self, args: list) -> None:
        """Compile this call's module(s) for the target without loading them (compile_only)."""
        _say_compile_only(self._target(args).name)
        if self.dynamic:
            if self._dynamic_runner is not None:
                return
            try:  # not run, so not checked against eager (see _call_dynamic)
                self._dynamic_runner = self._build(args, 0, dynamic=True)
                return
            except NotDynamic as e:
                log.debug("boo: %s graph %s does not compile with dynamic shapes (%s)", self.kind, self.name, e)
                self.dynamic = False
        key = self._key(args) if self.symbolic else None
        if key not in self._runners:
            self._runners[key] = self._build(args, len(self._runners))

    # -- building -------------------------------------------------------------------------

    def _target(self, args) -> Target:
        return target_for(self.opts.target, args)

    def _call_dynamic(self, args: list):
        """This call's outputs from the module for every size, or None (and per-shape
        compiles from now on). Calls are checked against the graph run in eager PyTorch as
        the verify policy says (verify.Verifier): torch-mlir and IREE have computed some
        graphs wrongly for dynamic sizes only, and at some sizes only (past 64, say), and a
        wrong module must not serve every shape."""
        runner = self._dynamic_runner
        if runner is None:
            try:
                runner = self._build(list(args), 0, dynamic=True)
            except NotDynamic as e:
                log.debug("boo: %s graph %s does not compile with dynamic shapes (%s); compiling it "
                          "once per input shape", self.kind, self.name, e)
                self.dynamic = False
                return None
            runner = self._dynamic_runner = _boxed(runner)
        if self._conditions is not None and not self._conditions.hold(args):
            log.debug("boo: %s graph %s: this call's sizes break what its dynamic module assumes (%s); "
                      "compiling its shape", self.kind, self.name, self._conditions)
            return None
        key = self._verifier.wants(args)
        outputs = self._run_dynamic(runner, args, keep=key is not None)  # the check reads them again
        if outputs is None or key is None:
            return outputs
        wrong = self._verifier.check(key, args, outputs, self.cache.stats)
        if wrong:
            log.warning("boo: the dynamic-shape module of %s graph %s disagrees with eager PyTorch at "
                        "sizes %s (%s); compiling the graph once per input shape instead",
                        self.kind, self.name, self._verifier.sizes(args), wrong)
            PLACEMENTS[:] = [p for p in PLACEMENTS if not (p.name == self.name and p.dynamic)]
            self.dynamic = False
            self._dynamic_runner = None
            return None
        return outputs

    def _run_dynamic(self, runner, args: list, keep: bool = False):
        """The dynamic module's outputs, or None: at sizes it failed at before (a module of
        their own serves them), or where it fails now. torch-mlir's symbolic sizes have been
        wrong at some sizes only (the last of uneven chunks; adaptive pooling whose windows
        vary), and IREE refuses the call. A graph cut into parts has let go of its arguments
        by then, so its error stands."""
        if self._runners and self._key(args) in self._runners:
            return None
        try:
            return runner(list(args) if keep else args)
        except BooRuntimeError as e:
            if not args:
                raise
            log.warning("boo: the dynamic-shape module of %s graph %s failed at sizes %s (%s); "
                        "compiling that shape on its own", self.kind, self.name, self._verifier.sizes(args),
                        first_error(e))
            return None

    def _conditions_of(self, env) -> list[str]:
        """The guards on sizes that boo's tracing added to `env` after Dynamo made its own, in
        this build or an earlier one (the env reasons with them from then on: `s87` may be
        replaced by `s94` everywhere), that this graph's sizes take part in: srepr text, to be
        checked per call. NotDynamic when one reads a size that the graph's inputs do not give
        as a bare dimension or SymInt, since no call could check it."""
        where = self._traced_sources
        texts = []
        for text in dict.fromkeys(_ADDED_GUARDS.get(env, ())):
            names = symbolic.free_names(text)
            if names and names <= where.keys():
                texts.append(text)
            elif names & where.keys():
                raise NotDynamic(f"it would need guards Dynamo does not check: {symbolic.parse(text)}")
        return texts

    @functools.cached_property
    def _traced_sources(self) -> dict:
        """Where each of the graph's symbols, as Dynamo traced them, is read (symbolic.sources)."""
        return symbolic.sources([n.meta.get("val") for n in self.gm.graph.nodes if n.op == "placeholder"],
                                as_traced=True)

    def _assume(self, texts: list[str]) -> None:
        self._conditions = symbolic.Conditions(texts, self._traced_sources) if texts else None

    def _shape_env(self):
        return symbolic.shape_env(n.meta.get("val") for n in self.gm.graph.nodes if n.op == "placeholder")

    def _constraints(self) -> list[str]:
        """The value ranges Dynamo gave the graph's symbols: part of a dynamic module's key."""
        env = self._shape_env()
        if env is None:
            return []
        return sorted(f"{s}:{r}" for s, r in env.var_to_range.items())

    def _build(self, args: list, index: int, dynamic: bool = False):
        with timed("build"):
            return pool.products(donate(self._build_timed(args, index, dynamic)))

    def _build_timed(self, args: list, index: int, dynamic: bool):
        name = self.name if index == 0 else f"{self.name}_s{index}"
        self._drivers = {}
        ops = [n for n in compute_nodes(self.gm) if not n.target.__name__.startswith("sym_")]
        # A dynamic module's key is the symbolic graph and its sizes' ranges, not a shape.
        shapes = (["dynamic", *_signature(n.meta.get("val") for n in self.gm.graph.nodes if n.op == "placeholder"),
                   *self._constraints()] if dynamic else _signature(args))
        target = self._target(args)
        plan_key = self.cache.key(
            "plan", graph_text(self.gm), *compile_flags(target), self.opts.force_decompose,
            self.aten_matmul, *(["autotune"] if self.opts.autotune else []), *(["blocks"] if self.opts.blocks else []),
            *shapes, host=target.host_specific,
        )
        lowered_key = self.cache.key("lowered", plan_key, host=target.host_specific)
        split_key = self.cache.key("split", plan_key, host=target.host_specific)
        if self.opts.dump_dir is None:
            for key in (lowered_key, split_key):
                runner = self._from_cache(key, args, name)
                if runner is not None:
                    return runner
        if self._whole is not None:
            self.gm, self._whole = self._whole(), None
            blocks.keep_module_stacks(self.gm)
        cached = self.cache.get_json(plan_key)
        plan = Plan.from_json(cached) if cached else Plan(decompose={
            mlir_op_name(n.target) for n in compute_nodes(self.gm) if n.target in UNLOWERED})
        dump = self._dump_dir(name)
        env = self._shape_env() if dynamic else None
        guards = len(env.guards) if env is not None else 0
        # A graph that did not compile for every size is not tried again by a later process
        # (each try costs the failed compiles: minutes for a large graph).
        refused_key = self.cache.key("not-dynamic", plan_key, host=target.host_specific)
        refused = self.cache.get_json(refused_key) if dynamic else None
        if refused is not None:
            raise NotDynamic(f"{refused['why']} (remembered from an earlier process)")
        try:
            try:
                runner, used, aten, island = self._assemble_until_placed(args, plan, dump, dynamic)
            finally:  # whether or not it compiled: the env has them now
                if env is not None and len(env.guards) > guards:
                    _ADDED_GUARDS.setdefault(env, []).extend(sympy.srepr(g.expr) for g in env.guards[guards:])
            conditions = self._conditions_of(env) if env is not None else []
        except BooStrictError:
            raise
        except NotDynamic as e:
            self.cache.put_json(refused_key, {"why": str(e)})
            raise
        except Exception as e:  # anything the compiler stack throws that we cannot attribute
            if dynamic:
                if not isinstance(e, BooCompileTimeout):  # a longer limit may let it compile
                    self.cache.put_json(refused_key, {"why": first_error(e)})
                raise NotDynamic(first_error(e)) from e
            what = f"{self.kind} graph {name} failed to compile: {first_error(e)}"
            if self.opts.strict:
                raise BooStrictError(
                    f"boo strict: {what}. Unset BOO_STRICT to run this graph in eager PyTorch, "
                    "or file the module that BOO_DUMP_DIR writes"
                ) from e
            warnings.warn(f"boo: {what}; running the whole graph in eager PyTorch",
                          BooFallbackWarning, stacklevel=2)
            placement = Placement(name, self.kind, len(ops), 0, 0, len(ops), recovered=True)
            self._record(placement)
            return self.gm
        if dynamic:
            self._assume(conditions)
        self.cache.put_json(plan_key, plan.to_json())
        self._report_islands(plan, name)
        names = [mlir_op_name(n.target) for n in ops]
        # Islands are counted in the graph as run (an op may be islanded after decomposing).
        island = min(island, len(ops))
        # The prepared graph's ATen ops (matmuls, views, parts that only copy) against the ops
        # of the graph Dynamo gave: decompositions and fusions change the count.
        aten = min(aten, len(ops) - island)
        decomposed = sum(n in plan.decompose and n not in plan.island for n in names)
        decomposed = max(0, min(decomposed, len(ops) - island - aten))
        placement = Placement(
            name, self.kind, len(ops), len(ops) - island - decomposed - aten, decomposed, island,
            aten, island_ops=tuple(sorted(plan.island)),
            composite_names=tuple(sorted(collections.Counter(used).items())), drivers=self._drivers,
            dynamic=dynamic, compile_only=target.name if self.opts.compile_only else "",
        )
        self._record(placement)
        # Skip all of this next time: one module, or the parts and the graph that calls them.
        extra = {k: v for k, v in dataclasses.asdict(placement).items() if k not in ("name", "drivers", "compile_only")}
        extra["conditions"] = conditions
        if isinstance(runner, IreePart):
            extra["has_module"] = runner.function is not None
            self.cache.put(lowered_key, runner.lowered.to_bytes(extra))
        elif runner is not self.gm:
            try:
                blob = saved.dump(runner, extra)
            except Exception as e:  # a part torch.fx cannot pickle: no warm start for this graph
                log.debug("boo: %s graph %s is not cached: %s", self.kind, name, e)
            else:
                self.cache.put(split_key, blob)
        return runner

    def _from_cache(self, key: str, args: list, name: str) -> "IreePart | None":
        """A warm start: the lowered module and its placement, without tracing or importing."""
        blob = self.cache.get(key)
        if blob is None:
            return None
        target = self._target(args)

        def part(lowered: Lowered, has_module: bool, part: str) -> IreePart:
            function = None
            if has_module:
                vmfb = compile_mlir(lowered.mlir, target, self.cache, self.opts.compile_timeout)
                function = self._function(vmfb, lowered, target, f"{name}/{part}", part)
            return IreePart(lowered, function)

        try:
            if key.endswith(".split"):
                runner, extra = saved.load(blob, lambda i, lowered, has: part(lowered, has, f"part_{i}"))
            else:
                lowered, extra = Lowered.from_bytes(blob)
                runner = part(lowered, extra.pop("has_module"), "module")
            conditions = extra.pop("conditions", [])
            extra["island_ops"] = tuple(extra["island_ops"])
            extra["composite_names"] = tuple(tuple(c) for c in extra.get("composite_names", ()))
        except Exception as e:  # a stale or unreadable entry: build from scratch
            log.warning("boo: cached lowering for %s is unusable (%s); rebuilding", name, e)
            return None
        self._report_islands(Plan(island=set(extra["island_ops"])), name)  # strict mode refuses them warm too
        compile_only = self._target(args).name if self.opts.compile_only else ""
        self._record(Placement(name=name, drivers=self._drivers, compile_only=compile_only, **extra))
        if extra["dynamic"]:
            self._assume(conditions)
        return runner

    def _record(self, placement: Placement) -> None:
        PLACEMENTS.append(placement)
        log.info("boo %s", placement.line())

    def _dump_dir(self, name: str):
        if self.opts.dump_dir is None:
            return None
        path = self.opts.dump_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _report_islands(self, plan: Plan, name: str) -> None:
        """One warning per island op, or in strict mode an error naming them."""
        why = ("IREE cannot compute it correctly: torch-mlir has no lowering and no decomposition "
               "helps, the target lacks a math function it needs, or its lowering is wrong for "
               "these dtypes")
        if plan.island and self.opts.strict:
            raise BooStrictError(
                f"boo strict: {', '.join(sorted(plan.island))} would run as an eager PyTorch "
                f"island in {self.kind} graph {name} ({why}). Unset BOO_STRICT to allow islands."
            )
        for op in sorted(plan.island):
            warnings.warn(
                f"boo: {op} runs as an eager PyTorch island in {self.kind} graph {name}: {why}",
                BooFallbackWarning,
                stacklevel=4,
            )
