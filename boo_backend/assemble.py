"""How one graph becomes IREE parts: the retrace with the plan's decompositions and the
composites' canonical forms, matching, the matmuls left to ATen, the cut into blocks and
islands, lowering, compiling side by side, and loading (`Assembly`, which CompiledGraph in
graph.py builds on; it keeps when to build and how calls are served).

Imports blocks, extern, fusions, match, partition, lower, torch_import, part, diagnose, embed,
compile, runtime, storage, verify, cache and config from boo_backend.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import operator
import re

import torch
import torch.fx as fx

from . import blocks, extern, fusions, hops, match, schedule
from .cache import timed, write_atomic
from .compile import (
    BooCompileError, Target, compile_flags, compile_mlir, computes_in_f64, has_dynamic_dims, precompile,
    unconverted_ops,
)
from .config import BooError
from .diagnose import Unlowerable, failing_ops, unlinked_ops
from .embed import mlir_op_name
from .lower import Lowered, lower
from .miscompiles import sorts_apart, wrong_in_iree, wrong_when_dynamic
from .partition import (
    Plan, compute_nodes, decomposition_table, fold_empty, fold_known_sizes, moves_only, node_places,
    preparation_table, retrace, retrace_symbolic, split_independent, split_islands,
)
from .part import IreePart
from .runtime import ATEN, IreeFunction, OnAten
from .storage import placed_results, with_storage
from .torch_import import is_registered, unregistered_ops
from .verify import checkable, computes_in_half, disagreement as disagreement_with

log = logging.getLogger("boo_backend")

def _aten_runner(core: fx.GraphModule):
    """The IREE arguments of a part to its results, computed by its graph in ATen."""
    def run(passed):
        with torch.no_grad():
            return core(*passed)
    return run


def _on_aten(core: fx.GraphModule, lowered: Lowered) -> OnAten | None:
    """The "aten" driver of a part (runtime.ATEN), or None for a graph that draws random
    numbers (ATen's would differ from IREE's). It agrees with IREE as a dynamic module's check
    does (verify.disagreement), on as many results, an unsigned one compared with IREE's
    signed twin (IreePart.retype) by its bits."""
    if not checkable(core):
        return None
    run = _aten_runner(core)
    dtypes = [getattr(torch, name) for name in lowered.result_dtypes]
    half = computes_in_half(core)

    def disagreement(passed, ours):
        theirs = run(passed)
        theirs = list(theirs) if isinstance(theirs, (tuple, list)) else [theirs]
        if len(theirs) != len(ours):
            return f"{len(theirs)} results against IREE's {len(ours)}"
        if len(dtypes) == len(ours):
            ours = [o.view(d) if o.dtype != d and o.element_size() == d.itemsize else o for o, d in zip(ours, dtypes)]
        return disagreement_with(lambda *_: theirs, passed, ours, half)

    return OnAten(run, disagreement)


def _to_torch(outer: fx.GraphModule, place_of_part: dict[str, str]) -> int:
    """Place each IREE part that only moves data (partition.moves_only) in torch, in
    `place_of_part`; returns how many ops moved."""
    moved = 0
    for sub, place in place_of_part.items():
        if place == "iree" and moves_only(getattr(outer, sub)):
            place_of_part[sub] = "aten"
            moved += len(compute_nodes(getattr(outer, sub)))
    return moved


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
            f"boo: {'decomposing ' + ', '.join(map(str, table)) if table else 'the rewrites before lowering'} "
            "changed the graph's outputs: "
            f"ours={_output_metas(after, not symbolic)} | torch={_output_metas(before, not symbolic)}"
        )


def _writes_into_its_input(target) -> bool:
    """Whether `target` writes into its first argument, as in-place ops and prims.copy_to do
    (not ops that may write other arguments: batch norm's running statistics, written only
    in training, which its own entries handle)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _check_functional(before: fx.GraphModule, after: fx.GraphModule) -> None:
    """A decomposition must not write into a tensor (torch._decomp's constant_pad_nd copies
    its input into a slice of a filled tensor with prims.copy_to): the graph is cut into parts
    and islands as if every node were a pure function, so nothing would order the write
    before the reads, and the results would be wrong. The decomposed op goes one step down
    the fallback order instead."""
    ours = {n.target for n in before.graph.nodes if n.op == "call_function"}
    bad = {mlir_op_name(n.meta["original_aten"]) for n in after.graph.nodes
           if n.op == "call_function" and n.target not in ours and _writes_into_its_input(n.target)
           and isinstance(n.meta.get("original_aten"), torch._ops.OpOverload)}
    if bad:
        log.debug("boo: the decomposition of %s writes into a tensor", ", ".join(sorted(bad)))
        raise Unlowerable(bad)


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


def _bindings_past_the_limit(e: Exception) -> int | None:
    """The binding count of a dispatch IREE's runtime refused (32 a dispatch when it records
    it, 64 when it loads), from the error; None for any other error."""
    found = re.search(r"binding count (\d+) >|requiring (\d+) bindings exceeds", str(e))
    return None if found is None else int(found.group(1) or found.group(2))


class NotDynamic(Exception):
    """The graph cannot run as one module for every size; it is compiled per shape instead."""



class _NotLoaded:
    """Stands for a module compiled for another target (compile_only): never called."""

    def __call__(self, *args):
        raise BooError("boo: compile_only modules are not loaded")


class Assembly:
    """The building half of CompiledGraph: it reads the graph (`gm`, `kind`, `name`,
    `symbolic`), the settings (`opts`, `aten_matmul`, `cache`), `_target`, `_shape_env`, and
    fills `_drivers` with each part's runtime driver."""

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
                        raise NotDynamic(f"the compiler rejects {op} with symbolic sizes") from e
                    elif op not in plan.island:
                        plan.island.add(op)
                        changed = True
                if not changed:
                    raise BooError(f"boo: the compiler still rejects {e} after placing it in an eager island")

    def _prepare(self, args: list, plan: Plan, dynamic: bool) -> fx.GraphModule:
        """One retrace of the graph: on `args` (concrete sizes) or on its own symbolic inputs
        when `dynamic`, with the pre-lowering rewrites, the composites' canonical forms and
        the plan's FX-level decompositions."""
        decompositions, missing = decomposition_table(plan.decompose - plan.island)
        sized = sorted(op for op in missing if is_registered(op))
        if sized and dynamic:  # it is no island for want of a lowering at symbolic sizes only
            raise NotDynamic(f"the compiler rejects {', '.join(sized)} with symbolic sizes, "
                             "and it has no decomposition")
        # An op torch-mlir does not know (a library's custom op) is an island at any size: the
        # graph stays dynamic around it rather than compile it once per shape. Not so an op
        # that only a decomposition brought in (torch._decomp's prims): the op it stands for
        # lowers at concrete sizes, so the graph is compiled per shape rather than run its
        # pieces in islands (Mistral with gradient checkpointing: 25 ops in islands, once).
        brought = sorted(missing - {mlir_op_name(n.target) for n in compute_nodes(self.gm)})
        if brought and dynamic:
            raise NotDynamic(f"decomposing {', '.join(sorted(plan.decompose - missing))} with symbolic sizes "
                             f"leaves {', '.join(brought)}, which torch-mlir cannot import")
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
        _check_functional(self.gm, graph)
        graph = fusions.apply(fold_empty(graph))
        if dynamic and (wrong := sorted({mlir_op_name(n.target) for n in graph.graph.nodes if wrong_when_dynamic(n)})):
            raise NotDynamic(f"{', '.join(wrong)} with ceil_mode computes wrongly with symbolic sizes")
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
        extern_nodes |= sorts_apart(graph) | hops.seeds(graph)
        extern_nodes = extern.fold_adds(graph, extern_nodes)
        places = node_places(graph, plan, extern_nodes)
        aten = sum(p == "aten" and n.target is not operator.getitem for n, p in places.items())
        island = sum(p == "eager" and n.target is not operator.getitem for n, p in places.items())
        labels = blocks.group_blocks(graph) if self.opts.blocks else {}
        schedule.cluster(graph, places, labels)
        cut = split_islands(graph, places, labels) if labels else None
        moved = _to_torch(*cut) if cut is not None else 0  # before repeats_pay, which counts IREE parts
        if cut is not None and not blocks.repeats_pay(*cut):
            log.debug("boo %s: its blocks differ too much to share modules; not cut at them", self.name)
            labels, cut = {}, None
            # Ordered by block, the graph would still be cut where a block ends: order it again
            # by place alone (an MLP's bias-gradient sum otherwise runs as a part of its own).
            schedule.cluster(graph, places)
        if set(places.values()) <= {"iree"} and not labels:
            try:
                return self._compile_part(graph, target, dump, "module"), composites, aten, 0
            except Exception as e:
                count = _bindings_past_the_limit(e)
                if count is None:
                    raise
                parts = 2 * -(-count // 32)
                log.info("boo %s: IREE built a dispatch of %d bindings; compiling it as %d modules",
                         self.name, count, parts)
                outer, place_of_part = split_independent(graph, parts)
        else:
            outer, place_of_part = cut or split_islands(graph, places, labels)
        aten += moved if cut is not None else _to_torch(outer, place_of_part)
        # Parts that compute the same thing (the same layer, repeated) share one module; the
        # distinct ones are lowered first and compiled side by side.
        distinct: dict[str, tuple[str, Lowered]] = {}
        keys = {}
        for sub, place in place_of_part.items():
            if place == "iree":
                keys[sub] = blocks.structure_key(getattr(outer, sub))
                if keys[sub] not in distinct:
                    distinct[keys[sub]] = (sub, self._lower(getattr(outer, sub), target))
        precompile([low.mlir for _, low in distinct.values()
                    if compute_nodes(low.core) and not unregistered_ops(low.mlir)],
                   target, self.cache, self.opts.compile_timeout)
        built: dict[str, IreePart] = {}
        for sub, key in keys.items():
            if key not in built:
                first, lowered = distinct[key]
                built[key] = self._compile_or_split(getattr(outer, first), target, dump, first, lowered)
            setattr(outer, sub, built[key])
        if labels:
            iree_parts = sum(p == "iree" for p in place_of_part.values())
            log.info("boo %s: %d repeated blocks; %d IREE parts, %d distinct modules",
                     self.name, len(set(labels.values()) - {None}), iree_parts, len(built))
        return outer, composites, aten, island

    @staticmethod
    def _lower(graph: fx.GraphModule, target: Target, sizes_from_shapes: bool = False) -> Lowered:
        """`graph` lowered; for a CPU module called without fences, with its results written
        into storage the caller allocates (storage.with_storage)."""
        with timed("import"):
            lowered = lower(graph, sizes_from_shapes)
            return with_storage(lowered) if target.is_cpu and not target.fenced else lowered

    def _with_sizes_from_shapes(self, graph: fx.GraphModule, target: Target, lowered: Lowered):
        """(lowered, vmfb) of `graph` with its symbolic sizes read from its tensors, where
        that changes the module and IREE compiles it (lower._sizes_read_from_shapes); else
        None."""
        if not has_dynamic_dims(lowered.mlir):
            return None
        again = self._lower(graph, target, sizes_from_shapes=True)
        if again.mlir == lowered.mlir:
            return None
        try:
            vmfb = compile_mlir(again.mlir, target, self.cache, self.opts.compile_timeout)
        except BooCompileError:
            return None
        log.debug("boo %s: compiled with its sizes read from its tensors", self.name)
        return again, vmfb

    def _compile_or_split(self, graph: fx.GraphModule, target: Target, dump, part: str,
                          lowered: Lowered | None = None) -> torch.nn.Module:
        """_compile_part, or, where IREE built a dispatch of more bindings than its runtime
        takes, `graph` cut into independent pieces (split_independent), each compiled so. A
        part between eager islands failed so (a local response norm's backward beside an
        island) and took its whole graph to eager."""
        try:
            return self._compile_part(graph, target, dump, part, lowered)
        except Exception as e:
            count = _bindings_past_the_limit(e)
            if count is None or len(compute_nodes(graph)) < 2:
                raise
            outer, pieces = split_independent(graph, 2 * -(-count // 32))
            if len(pieces) < 2:
                raise
            log.info("boo %s/%s: IREE built a dispatch of %d bindings; compiling it as %d modules",
                     self.name, part, count, len(pieces))
        for sub in pieces:
            setattr(outer, sub, self._compile_or_split(getattr(outer, sub), target, dump, f"{part}_{sub}"))
        return outer

    def _compile_part(self, graph: fx.GraphModule, target: Target, dump, part: str,
                      lowered: Lowered | None = None) -> IreePart:
        if lowered is None:
            lowered = self._lower(graph, target)
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
            retried = self._with_sizes_from_shapes(graph, target, lowered)
            if retried is None:
                unlinked = unlinked_ops(e, e.mlir.splitlines())
                names = unlinked or failing_ops(e) or unconverted_ops(lowered.mlir, target)
                log.debug("boo: iree-compile rejected %s in %s:\n%s", names or "?", self.name, e.diagnostics)
                if names:
                    raise Unlowerable(names, final=bool(unlinked)) from e
                raise
            lowered, vmfb = retried
            if dump:
                write_atomic(dump / f"{part}.mlir", lowered.mlir)
        if dump:
            write_atomic(dump / f"{part}.vmfb", vmfb)
        return IreePart(lowered, self._function(vmfb, lowered, target, f"{self.name}/{part}", part))

    def _offers_aten(self, lowered: Lowered, target: Target) -> bool:
        """Whether the part may run in ATen when that measures faster (runtime.ATEN): a CPU
        part of static shapes, its graph at hand, outside strict mode (which proves that IREE
        ran), with the driver measured (BOO_CPU_DRIVER=auto; "iree" measures IREE's drivers
        only) and matmuls placed by measurement (BOO_ATEN_MATMUL=auto)."""
        return (target.is_cpu and not target.fenced and not self.opts.strict and self.opts.cpu_driver == "auto"
                and self.opts.aten_matmul == "auto"
                and (lowered.core is not None or lowered.graph_blob is not None) and not has_dynamic_dims(lowered.mlir))

    def _function(self, vmfb: bytes, lowered: Lowered, target: Target, name: str, part: str) -> IreeFunction:
        """The loaded module, on the CPU driver BOO_CPU_DRIVER names, or the one an earlier
        process measured as faster for this module on this host, or one it will measure. With
        compile_only, nothing is loaded."""
        if self.opts.compile_only:
            return _NotLoaded()
        drivers = self._drivers
        driver, remember, aten = None, None, None
        if target.is_cpu and self.opts.cpu_driver not in ("auto", "iree"):
            driver = self.opts.cpu_driver
        elif len(target.drivers) > 1:
            offered = self._offers_aten(lowered, target)
            key = self.cache.key("driver", lowered.mlir, target.name, *(["autotune"] if self.opts.autotune else []),
                                 *([ATEN] if offered else []))
            known = self.cache.get_json(key)
            if offered and (not known or known.get("driver") == ATEN):
                try:
                    aten = _on_aten(lowered.graph(), lowered)
                except Exception as e:  # a cached graph that no longer unpickles: IREE's drivers only
                    log.debug("boo: the cached graph of %s does not load (%s); it runs in IREE", name, e)
            if known and (known.get("driver") in target.drivers or (known.get("driver") == ATEN and aten)):
                driver = known["driver"]
            else:
                def store(chosen: str) -> None:
                    drivers[part] = chosen
                    self.cache.put_json(key, {"driver": chosen})
                remember = store
        # What the first call finds IREE writing into is the compiled module's own property.
        writes_key = self.cache.key("arg-writes", hashlib.sha256(vmfb).hexdigest())
        known = self.cache.get_json(writes_key)
        checked = frozenset(known["writes"]) if known else None

        def store_writes(found: frozenset[int]) -> None:
            self.cache.put_json(writes_key, {"writes": sorted(found)})

        with timed("load"):
            function = IreeFunction(vmfb, target, graph=name, writes=frozenset(lowered.writes),
                                    placed=placed_results(lowered),
                                    driver=driver, remember=remember, sync=self.opts.sync,
                                    measure_scale=self.opts.measure_scale, checked=checked,
                                    remember_writes=store_writes, aten=aten)
        if function.driver:
            drivers[part] = function.driver
        self.functions.append(function)
        return function
