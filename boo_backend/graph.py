"""One AOTAutograd graph, compiled and run through IREE: once, with dynamic dimensions, when
Dynamo traced it with symbolic sizes, else once per concrete input shape.

Imports partition, lower, part, placement, verify, symbolic, diagnose, compile, runtime, cache
and config from boo_backend.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import logging
import operator
import re
import warnings

import torch
import torch.fx as fx

from . import blocks, extern, fusions, match, saved, symbolic
from .cache import CompileCache, timed, write_atomic
from .compile import (
    BooCompileError, Target, compile_flags, compile_mlir, computes_in_f64, has_dynamic_dims, precompile,
    target_for, unconverted_ops,
)
from .config import BooError, BooFallbackWarning, BooStrictError, Options
from .diagnose import Unlowerable, failing_ops, first_error, unlinked_ops
from .embed import mlir_op_name
from .verify import Verifier
from .lower import Lowered, lower, unregistered_ops
from .partition import (
    Plan, compute_nodes, decomposition_table, fold_empty, is_symbolic, node_places,
    fold_known_sizes, preparation_table, retrace, retrace_symbolic, wrong_in_iree, split_independent, split_islands,
)
from .part import IreePart, donate
from .placement import PLACEMENTS, Placement
from .runtime import IreeFunction

log = logging.getLogger("boo_backend")

def _output_metas(gm: fx.GraphModule, shapes: bool = True) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in (out if isinstance(out, (tuple, list)) else [out])]
    return [
        ((tuple(v.shape) if shapes else v.dim()), v.dtype) if isinstance(v, torch.Tensor)
        else ("value" if shapes else type(v).__name__.replace("SymInt", "int"))
        for v in vals
    ]


def _check_same_outputs(before: fx.GraphModule, after: fx.GraphModule, table: dict, symbolic: bool) -> None:
    """A decomposition must not change what the graph returns (torch._decomp's attention entry,
    for one, returns probabilities where the log-sum-exp belongs). Symbolic graphs compare
    ranks and dtypes."""
    if _output_metas(before, not symbolic) != _output_metas(after, not symbolic):
        raise BooError(
            f"boo: decomposing {', '.join(map(str, table))} changed the graph's outputs: "
            f"ours={_output_metas(after, not symbolic)} | torch={_output_metas(before, not symbolic)}"
        )


def _describe(graph: fx.GraphModule) -> str:
    """The graph as matched: its code, then one line per node a composite computes."""
    lines = [graph.print_readable(print_output=False), "", "# composites:"]
    for node in graph.graph.nodes:
        call = node.meta.get(match.META_KEY)
        if call:
            lines.append(f"#   {node.name}: {call.entry.name} v{call.entry.version} {call.params}")
    return "\n".join(lines) + "\n"


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


class _NotDynamic(Exception):
    """The graph cannot run as one module for every size; it is compiled per shape instead."""


# Factory ops name their device; a module does not depend on it (all its buffers live on the
# target), so a graph traced on CPU tensors and the same graph traced on CUDA ones share a
# cache entry: a cache cross-compiled for a GPU (compile_only) serves the GPU's process.
_DEVICE = re.compile(r"(device: )(?:cpu|cuda|hip)(?::\d+)?\b|device\(type='\w+'(?:, index=\d+)?\)")


def graph_text(gm: fx.GraphModule) -> str:
    """The graph as a cache key names it, devices left out."""
    return _DEVICE.sub("device: ...", str(gm.graph))


@functools.cache
def _say_compile_only(target: str) -> None:
    log.info("boo: compile_only: compiling every graph for %s into the compile cache (and dump_dir); "
             "the model runs in eager PyTorch", target)


class _NotLoaded:
    """Stands for a module compiled for another target (compile_only): never called."""

    def __call__(self, *args):
        raise BooError("boo: compile_only modules are not loaded")


def _signature(values) -> list[str]:
    """Dtypes, sizes and strides of a call's arguments (or of a graph's symbolic inputs)."""
    return [f"{v.dtype}{tuple(v.shape)}{v.stride()}" if isinstance(v, torch.Tensor) else repr(v) for v in values]


class CompiledGraph:
    """The callable handed back to AOTAutograd (boxed: it takes the argument list).

    A graph with symbolic sizes first tries to compile once for all of them (`dynamic`):
    torch-mlir imports the sizes as `?` dims with their relations, and IREE compiles those.
    The graph falls back to one module per concrete shape when that fails, or when making
    it needed a guard on its sizes that Dynamo did not already check; a debug line says why.
    """

    def __init__(self, gm: fx.GraphModule, kind: str, opts: Options, name: str):
        # An instance attribute, so that wrappers made with functools.wraps copy it.
        self._boxed_call = True
        self.gm = gm
        blocks.keep_module_stacks(gm)  # for the blocks of every retrace of it
        self.kind = kind
        self.opts = opts
        self.name = name
        self.symbolic = is_symbolic(gm)
        self.dynamic = self.symbolic and opts.dynamic
        self._dynamic_runner = None
        self._verifier = Verifier(gm, opts.verify if self.dynamic else "off")
        self.cache = CompileCache(opts.cache_dir, opts.cache)
        self._runners: dict = {}
        # Measuring where matmuls run (aten_matmul=auto) needs the target's device, which a
        # compile_only run does not have: they stay in IREE there.
        self.aten_matmul = "never" if opts.compile_only and opts.aten_matmul == "auto" else opts.aten_matmul
        # Runtime drivers of the runner being built, by part; see Placement.drivers.
        self._drivers: dict[str, str] = {}

    def _key(self, args) -> tuple:
        return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)

    def __call__(self, args):
        if self.opts.compile_only:
            self._compile_only(list(args))
            return self.gm(*args)
        if self.dynamic:
            if self._dynamic_runner is not None and not self._verifier.active:
                return self._dynamic_runner(*args)
            outputs = self._call_dynamic(list(args))
            if outputs is not None:
                return outputs
        key = self._key(args) if self.symbolic else None
        runner = self._runners.get(key)
        if runner is None:
            runner = self._build(list(args), len(self._runners))
            # IreePart's forward directly: nn.Module's call hooks cost per step for nothing.
            runner = self._runners[key] = runner.forward if isinstance(runner, IreePart) else runner
        return runner(*args)

    def _compile_only(self, args: list) -> None:
        """Compile this call's module(s) for the target without loading them (compile_only)."""
        _say_compile_only(self._target(args).name)
        if self.dynamic:
            if self._dynamic_runner is not None:
                return
            try:  # not run, so not checked against eager (see _call_dynamic)
                self._dynamic_runner = self._build(args, 0, dynamic=True)
                return
            except _NotDynamic as e:
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
                runner = self._build(args, 0, dynamic=True)
            except _NotDynamic as e:
                log.debug("boo: %s graph %s does not compile with dynamic shapes (%s); compiling it "
                          "once per input shape", self.kind, self.name, e)
                self.dynamic = False
                return None
            runner = self._dynamic_runner = runner.forward if isinstance(runner, IreePart) else runner
        key = self._verifier.wants(args)
        outputs = runner(*args)
        if key is None:
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
            return donate(self._build_timed(args, index, dynamic))

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
        cached = self.cache.get_json(plan_key)
        plan = Plan.from_json(cached) if cached else Plan()
        dump = self._dump_dir(name)
        env = self._shape_env() if dynamic else None
        guards = len(env.guards) if env is not None else 0
        try:
            runner, used, aten, island = self._assemble_until_placed(args, plan, dump, dynamic)
            if env is not None and len(env.guards) > guards:
                added = ", ".join(str(g.expr) for g in env.guards[guards:])
                raise _NotDynamic(f"it would need guards Dynamo does not check: {added}")
        except (BooStrictError, _NotDynamic):
            raise
        except Exception as e:  # anything the compiler stack throws that we cannot attribute
            if dynamic:
                raise _NotDynamic(first_error(e)) from e
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
        self.cache.put_json(plan_key, plan.to_json())
        self._report_islands(plan, name)
        names = [mlir_op_name(n.target) for n in ops]
        # Islands are counted in the graph as run (an op may be islanded after decomposing).
        island = min(island, len(ops))
        decomposed = sum(n in plan.decompose and n not in plan.island for n in names)
        decomposed = min(decomposed, len(ops) - island - aten)
        placement = Placement(
            name, self.kind, len(ops), len(ops) - island - decomposed - aten, decomposed, island,
            aten, island_ops=tuple(sorted(plan.island)),
            composite_names=tuple(sorted(collections.Counter(used).items())), drivers=self._drivers,
            dynamic=dynamic, compile_only=target.name if self.opts.compile_only else "",
        )
        self._record(placement)
        # Skip all of this next time: one module, or the parts and the graph that calls them.
        extra = {k: v for k, v in dataclasses.asdict(placement).items() if k not in ("name", "drivers", "compile_only")}
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
            extra["island_ops"] = tuple(extra["island_ops"])
            extra["composite_names"] = tuple(tuple(c) for c in extra.get("composite_names", ()))
        except Exception as e:  # a stale or unreadable entry: build from scratch
            log.warning("boo: cached lowering for %s is unusable (%s); rebuilding", name, e)
            return None
        self._report_islands(Plan(island=set(extra["island_ops"])), name)  # strict mode refuses them warm too
        compile_only = self._target(args).name if self.opts.compile_only else ""
        self._record(Placement(name=name, drivers=self._drivers, compile_only=compile_only, **extra))
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

    def _assemble_until_placed(self, args: list, plan: Plan, dump, dynamic: bool = False):
        """Compile; each time the compiler names ops it cannot lower, move them one step
        down the fallback order (FX decomposition, then eager island) and try again. With
        dynamic shapes an op is not islanded: the graph is compiled per shape instead."""
        complex_ = sorted({str(v.dtype) for n in self.gm.graph.nodes
                           if isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_complex()})
        if complex_:
            raise BooError(f"{', '.join(complex_)} tensors are not supported by boo's IREE path")
        while True:
            try:
                return self._assemble(args, plan, dump, dynamic)
            except Unlowerable as e:
                changed = False
                for op in sorted(e.names):
                    if op not in plan.decompose and not e.final:
                        plan.decompose.add(op)
                        log.debug("boo: torch-mlir cannot lower %s; trying its decomposition", op)
                        changed = True
                    elif dynamic:
                        raise _NotDynamic(f"the compiler rejects {op} with symbolic sizes") from e
                    elif op not in plan.island:
                        plan.island.add(op)
                        changed = True
                if not changed:
                    raise BooError(f"boo: the compiler still rejects {e} after placing it in an eager island")

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

    def _prepare(self, args: list, plan: Plan, dynamic: bool) -> fx.GraphModule:
        """One retrace of the graph: on `args` (concrete sizes) or on its own symbolic inputs
        when `dynamic`, with the pre-lowering rewrites, the composites' canonical forms and
        the plan's FX-level decompositions."""
        decompositions, missing = decomposition_table(plan.decompose - plan.island)
        plan.island |= missing
        table = preparation_table(self.gm, decompositions, match.canonical_table(self.opts))
        if (dynamic or not self.symbolic) and not any(n.target in table for n in compute_nodes(self.gm)):
            graph = self.gm
        elif dynamic:
            graph = retrace_symbolic(self.gm, table)
            _check_same_outputs(self.gm, graph, decompositions, True)
        if dynamic:
            graph = fold_known_sizes(graph if graph is not self.gm else _copy(graph), self._shape_env())
        else:
            graph = retrace(self.gm, args, table)
            _check_same_outputs(self.gm, graph, decompositions, self.symbolic)
        graph = fusions.apply(fold_empty(graph))
        plan.island |= {mlir_op_name(n.target) for n in graph.graph.nodes if wrong_in_iree(n)}
        return graph

    def _assemble(self, args: list, plan: Plan, dump, dynamic: bool):
        graph = self._prepare(args, plan, dynamic)
        target = self._target(args)
        composites = match.apply(graph, self.opts, target.kind)
        if dump:
            write_atomic(dump / "graph.txt", _describe(graph))
        extern_nodes = extern.choose(graph, self.aten_matmul, target, self.cache, self.opts)
        for node in extern_nodes:  # a composite op left to ATen's kernel is not a composite
            call = node.meta.pop(match.META_KEY, None)
            if call is not None:
                composites.remove(call.entry.name)
        places = node_places(graph, plan, extern_nodes)
        aten = sum(p == "aten" and n.target is not operator.getitem for n, p in places.items())
        island = sum(p == "eager" and n.target is not operator.getitem for n, p in places.items())
        labels = blocks.group_blocks(graph) if self.opts.blocks else {}
        cut = split_islands(graph, places, labels) if labels else None
        if cut is not None and not blocks.repeats_pay(*cut):
            log.debug("boo %s: its blocks differ too much to share modules; not cut at them", self.name)
            labels, cut = {}, None
        if set(places.values()) <= {"iree"} and not labels:
            try:
                return self._compile_part(graph, target, dump, "module"), composites, aten, 0
            except Exception as e:
                bindings = re.search(r"binding count (\d+) > (\d+)", str(e))
                if bindings is None:
                    raise
                parts = 2 * -(-int(bindings.group(1)) // int(bindings.group(2)))
                log.info("boo %s: IREE built a dispatch of %s bindings; compiling it as %d modules",
                         self.name, bindings.group(1), parts)
                outer, place_of_part = split_independent(graph, parts)
        else:
            outer, place_of_part = cut or split_islands(graph, places, labels)
        # Parts that compute the same thing (the same layer, repeated) share one module; the
        # distinct ones are lowered first and compiled side by side.
        distinct: dict[str, tuple[str, Lowered]] = {}
        keys = {}
        for sub, place in place_of_part.items():
            if place == "iree":
                keys[sub] = blocks.structure_key(getattr(outer, sub))
                if keys[sub] not in distinct:
                    with timed("import"):
                        distinct[keys[sub]] = (sub, lower(getattr(outer, sub)))
        precompile([low.mlir for _, low in distinct.values()
                    if compute_nodes(low.core) and not unregistered_ops(low.mlir)],
                   target, self.cache, self.opts.compile_timeout)
        built: dict[str, IreePart] = {}
        for sub, key in keys.items():
            if key not in built:
                first, lowered = distinct[key]
                built[key] = self._compile_part(getattr(outer, first), target, dump, first, lowered)
            setattr(outer, sub, built[key])
        if labels:
            iree_parts = sum(p == "iree" for p in place_of_part.values())
            log.info("boo %s: %d repeated blocks; %d IREE parts, %d distinct modules",
                     self.name, len(set(labels.values()) - {None}), iree_parts, len(built))
        return outer, composites, aten, island

    def _compile_part(self, graph: fx.GraphModule, target: Target, dump, part: str,
                      lowered: Lowered | None = None) -> IreePart:
        if lowered is None:
            with timed("import"):
                lowered = lower(graph)
        if dump:
            write_atomic(dump / f"{part}.mlir", lowered.mlir)
            flags = compile_flags(target, dynamic=has_dynamic_dims(lowered.mlir), f64=computes_in_f64(lowered.mlir))
            write_atomic(dump / f"{part}.flags", "\n".join(flags) + "\n")
        if not compute_nodes(lowered.core):
            return IreePart(lowered, None)
        bad = unregistered_ops(lowered.mlir)
        if bad:
            raise Unlowerable(set(bad))
        try:
            vmfb = compile_mlir(lowered.mlir, target, self.cache, self.opts.compile_timeout)
        except BooCompileError as e:
            unlinked = unlinked_ops(e, e.mlir.splitlines())
            names = unlinked or failing_ops(e) or unconverted_ops(lowered.mlir, target)
            log.debug("boo: iree-compile rejected %s in %s:\n%s", names or "?", self.name, e.diagnostics)
            if names:
                raise Unlowerable(names, final=bool(unlinked)) from e
            raise
        if dump:
            write_atomic(dump / f"{part}.vmfb", vmfb)
        return IreePart(lowered, self._function(vmfb, lowered, target, f"{self.name}/{part}", part))

    def _function(self, vmfb: bytes, lowered: Lowered, target: Target, name: str, part: str) -> IreeFunction:
        """The loaded module, on the CPU driver BOO_CPU_DRIVER names, or the one an earlier
        process measured as faster for this module on this host, or one it will measure. With
        compile_only, nothing is loaded."""
        if self.opts.compile_only:
            return _NotLoaded()
        drivers = self._drivers
        driver, remember = None, None
        if target.is_cpu and self.opts.cpu_driver != "auto":
            driver = self.opts.cpu_driver
        elif len(target.drivers) > 1:
            key = self.cache.key("driver", lowered.mlir, target.name, *(["autotune"] if self.opts.autotune else []))
            known = self.cache.get_json(key)
            if known and known.get("driver") in target.drivers:
                driver = known["driver"]
            else:
                def store(chosen: str) -> None:
                    drivers[part] = chosen
                    self.cache.put_json(key, {"driver": chosen})
                remember = store
        with timed("load"):
            function = IreeFunction(vmfb, target, graph=name, writes=frozenset(lowered.writes),
                                    driver=driver, remember=remember, sync=self.opts.sync,
                                    measure_scale=self.opts.measure_scale)
        if function.driver:
            drivers[part] = function.driver
        return function
