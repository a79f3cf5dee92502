"""Matmuls, convolutions and attention placed by measurement (BOO_ATEN_MATMUL=auto).

Imports match, partition, lower, compile, runtime, timing, pool, cache and config from boo_backend.

Each `mm`/`addmm`/`bmm`/`convolution`/`convolution_backward` of a graph, by its shapes,
strides and dtypes, is timed once on this host as ATen's kernel and as IREE's code for that
one op; the decision is kept in the compile cache, whose key names the host CPU. A node goes
to ATen (an extern kernel between IREE parts, as Inductor calls them) when ATen saves more
than a split costs. Then the graph as a whole is checked: the time the chosen nodes save
must pay for the IREE calls the split adds, else nothing is split.

Nothing here is CPU-specific: on a GPU target the same timings compare cuBLAS/hipBLASLt
with IREE's kernels (`timing.sync` waits for the device).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import match, pool, symbolic, timing
from .cache import CompileCache
from .compile import Target, combine, compile_mlir, precompile
from .config import BooError, Options
from .lower import arguments, lower
from .partition import ATEN_MATMUL, ATEN_MEASURED
from .runtime import IreeFunction

log = logging.getLogger("boo_backend")

aten = torch.ops.aten

# Below this many flops a matmul stays in IREE without being measured: at IREE's speed here
# (50-200 GFLOP/s on two cores) it takes tens of microseconds, about what a split costs.
MIN_FLOPS = 1 << 23
# IREE's time for an op alone is weighed at this many times its value: in the step IREE's
# code for it took longer than alone, against ATen's kernel. On an AVX-512 Zen 4 the Llama of
# bench/scale.py timed its vocabulary projection's matmul alone at 99.5 ms in IREE against
# ATen's 108 ms, yet with that matmul and the dW one (103 against 103 ms) moved to ATen its
# forward took about 55 ms less and its backward about 80 ms less, each against Inductor's in
# the same process. So a node goes to ATen when ATen takes at most this many times IREE's
# time alone ...
_MARGIN = 1.25
# ... and that saves more than this many IREE calls' fixed cost (a split adds up to two calls).
_CALLS_PER_SPLIT = 2
# A choice this close (the saving within this share of ATen's time of what the split costs)
# is timed once more, each side keeping its fastest typical time: on a 2-core VM one timing
# of an MLP's 256x512x1024 addmm gave ATen 3.0 ms (1.6-1.9 ms in every other timing and in
# the step) against IREE's 2.7 ms, and kept the matmul in an IREE part that took 3 ms of it.
# Calls past timing.LONG_S are not timed again: one such call's noise is a few percent,
# and timing GPT-2 small's matmuls again added 1-2 s to its cold compile.
_CLOSE = 0.15
# The one-op modules to time compile in modules of up to this many (Timings.prepare; one
# compile for many costs less than one each, see compile.combine), so that one that fails
# costs a bounded number of compiles again.
_GROUP = 16


def flops(node: fx.Node) -> float:
    """Multiply-adds x 2 of a matmul or convolution node, from its metadata (0 if unknown)."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    out = node.meta.get("val")
    try:
        if node.target in (aten.mm.default, aten.bmm.default):
            return 2.0 * out.numel() * vals[0].shape[-1]
        if node.target is aten.addmm.default:
            return 2.0 * out.numel() * vals[1].shape[-1]
        if node.target is aten.convolution.default:
            weight = vals[1]  # [C_out, C_in / groups, *kernel]
            return 2.0 * out.numel() * (weight.numel() // weight.shape[0])
        if node.target is aten.convolution_backward.default:
            grad, weight = vals[0], vals[2]
            return 4.0 * grad.numel() * (weight.numel() // weight.shape[0])
        if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
            q, k, v = vals[:3]  # [B, H, L, E], [B, H, S, E], [B, H, S, Ev]
            return 2.0 * q.numel() // q.shape[-1] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        if node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            q, k, v = vals[1:4]  # recomputes the scores, then four products
            return 2.0 * q.numel() // q.shape[-1] * k.shape[-2] * (3 * q.shape[-1] + 2 * v.shape[-1])
    except (AttributeError, IndexError, TypeError):
        return 0.0
    return 0.0


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return found


def _signature(node: fx.Node) -> str:
    """What the timing depends on: the op, its tensors' layouts and its other arguments."""
    def describe(a):
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return f"{v.dtype}{tuple(v.shape)}{v.stride()}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(describe(b) for b in a) + "]"
        return repr(a)

    return f"{node.target}({describe(list(node.args))},{describe(sorted(node.kwargs.items()))})"


def _one_op_graph(node: fx.Node, examples: list[torch.Tensor]) -> fx.GraphModule:
    inputs = _tensor_args(node)

    def run(*tensors):
        table = dict(zip(inputs, tensors))
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), table.__getitem__)
        return node.target(*args, **kwargs)

    return make_fx(run, tracing_mode="fake")(*examples)


class Timings:
    """ATen's and IREE's time for one node, measured once per host and kept in the cache."""

    def __init__(self, cache: CompileCache, target: Target, opts: Options):
        self.cache = cache
        self.target = target
        self.opts = opts
        self._floor: float | None = None
        self._modules: dict[fx.Node, tuple] = {}
        self._compiled: dict[str, tuple[bytes, str]] = {}  # key: (vmfb, function), see prepare

    def _key(self, node: fx.Node) -> str:
        scale = self.opts.measure_scale
        return self.cache.key("extern", _signature(node), self.target.name, *(["x%d" % scale] if scale > 1 else []))

    def _module(self, node: fx.Node):
        """IREE's one-op module for `node` and its arguments (made once per node)."""
        if node not in self._modules:
            inputs = [a.meta["val"] for a in _tensor_args(node)]
            # In the graph's own layouts: a transposed weight reaches IREE as it lies in memory
            # and is transposed in the module (lower._dense_order), which is part of IREE's time.
            iree_args = [timing.random_like(v) for v in inputs]
            graph = _one_op_graph(node, iree_args)
            match.apply(graph, self.opts, self.target.kind)  # IREE's side of attention is its composite
            self._modules[node] = (lower(graph), iree_args)
        return self._modules[node]

    def prepare(self, nodes: list[fx.Node]) -> None:
        """Compile the one-op modules of the nodes still to be timed, up to _GROUP of them
        in one module (compile.combine), such modules side by side; the modules of a group
        that fails to compile are compiled apart, so that each failure is its own."""
        pending: dict[str, str] = {}
        for node in nodes:
            key = self._key(node)
            if key not in pending and not timing.settled(self.cache.get_json(key)):
                try:
                    pending[key] = self._module(node)[0].mlir
                except Exception as e:  # of() meets it again and says so
                    log.debug("boo: no one-op module for %s (%s)", node.target, e)
        keys = list(pending)
        groups = [keys[i:i + _GROUP] for i in range(0, len(keys), _GROUP)]
        combined = [combine([pending[k] for k in group]) if len(group) > 1 else None for group in groups]
        timeout = self.opts.compile_timeout
        precompile([text for text in combined if text is not None], self.target, self.cache, timeout)
        apart: list[str] = []
        for group, text in zip(groups, combined):
            try:
                if text is None:
                    raise BooError("not combined")
                vmfb = compile_mlir(text, self.target, self.cache, timeout)  # from the cache
            except BooError as e:
                log.debug("boo: %d one-op modules compile apart (%s)", len(group), str(e).splitlines()[0])
                apart += group
            else:
                self._compiled.update((key, (vmfb, f"m{i}_main")) for i, key in enumerate(group))
        precompile([pending[k] for k in apart], self.target, self.cache, timeout)

    def of(self, node: fx.Node) -> dict:
        """ATen's and IREE's typical seconds for `node` ({"aten_s", "iree_s", "driver",
        "quiet", "samples"}). A timing taken while other work took the machine (hostload)
        is taken again at once, up to timing.ATTEMPTS times, and again when a later compile meets
        it, up to timing.SAMPLES times; each side keeps its fastest typical time."""
        key = self._key(node)
        known = self.cache.get_json(key)
        if timing.settled(known):
            return known
        result = self._measure(node, known)
        self.cache.stats["extern_timings"] += 1
        self.cache.put_json(key, result)
        log.info("boo: %s %s: ATen %.3f ms, IREE %.3f ms on %s%s", node.target, _signature(node),
                 result["aten_s"] * 1e3, result["iree_s"] * 1e3, result["driver"], timing.under_load(result))
        return result

    def again(self, node: fx.Node, known: dict) -> dict:
        """`known` (of's result for `node`) measured once more, each side keeping its faster
        time, and marked so that later compiles do not time it again."""
        result = self._measure(node, known) | {"rechecked": True}
        self.cache.stats["extern_timings"] += 1
        self.cache.put_json(self._key(node), result)
        log.info("boo: %s %s, timed again: ATen %.3f ms, IREE %.3f ms on %s%s", node.target, _signature(node),
                 result["aten_s"] * 1e3, result["iree_s"] * 1e3, result["driver"], timing.under_load(result))
        return result

    def _measure(self, node: fx.Node, earlier: dict | None) -> dict:
        scale = self.opts.measure_scale
        nodes = _tensor_args(node)
        inputs = [a.meta["val"] for a in nodes]
        device = inputs[0].device
        aten_args = [timing.random_like(v) for v in inputs]
        table = dict(zip(nodes, aten_args))
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), table.__getitem__)
        lowered, iree_args = self._module(node)
        vmfb, name = self._compiled.get(self._key(node)) or (
            compile_mlir(lowered.mlir, self.target, self.cache, self.opts.compile_timeout), "main")
        # Each driver is timed (the default first); the others only for short calls
        # (timing.SHORT_S). No first-call check of what IREE writes into (`checked`): it clones
        # every argument, a vocabulary's weight included, and its time would count in the
        # warm-up that decides which drivers are timed; these arguments are the timing's own.
        drivers = [self.target.driver, *(d for d in self.target.drivers if d != self.target.driver)]
        functions = [IreeFunction(vmfb, self.target, name, graph=f"timing {node.target}", driver=d,
                                  checked=frozenset()) for d in drivers]
        tensors = arguments(lowered.inputs, iree_args)
        count = len(lowered.result_layouts)
        fns = [lambda: node.target(*args, **kwargs), *(functools.partial(f, tensors, count) for f in functions)]
        # The driver of the fastest IREE time kept, this measurement's or `earlier`'s.
        best = [(earlier["iree_s"], earlier["driver"])] if earlier and "driver" in earlier else []

        def measure() -> dict:
            aten_s, *iree = timing.typical_times(fns, device, scale, optional=len(drivers) - 1)
            best.append(min((s, d) for s, d in zip(iree, drivers) if s is not None))
            return {"aten_s": aten_s, "iree_s": best[-1][0]}

        with pool.RESULTS.transient():
            result = timing.fastest(measure, earlier)
        result["driver"] = min(best)[1]
        return result

    def floor(self) -> float:
        """Seconds one IREE call costs beyond its work: a one-element module, measured once."""
        if self._floor is None:
            key = self.cache.key("call-floor", self.target.name)
            known = self.cache.get_json(key)
            if not timing.settled(known):
                x = torch.ones(1)
                graph = make_fx(lambda t: t + 1, tracing_mode="fake")(x)
                lowered = lower(graph)
                vmfb = compile_mlir(lowered.mlir, self.target, self.cache, self.opts.compile_timeout)
                functions = [IreeFunction(vmfb, self.target, graph="call floor", driver=driver)
                             for driver in self.target.drivers]
                # A longer measurement does not remove what the host adds: in a process that
                # had just compiled the Llama of bench/scale.py, local-task's fastest call
                # still took 300-690 us (50-170 us in a fresh process), and a floor of 690 us
                # kept the k/v projections' matmuls, 1 ms faster in ATen, in IREE.
                def measure() -> dict:
                    return {"seconds": max(timing.min_time(lambda: f([x], 1), x.device) for f in functions)}

                known = timing.fastest(measure, known)
                self.cache.put_json(key, known)
                log.info("boo: an IREE call costs %.0f us beyond its work%s", known["seconds"] * 1e6,
                         timing.under_load(known))
            self._floor = known["seconds"]
        return self._floor


def _weighed(node: fx.Node, opts: Options) -> bool:
    """Whether `node` is timed: tensors of static sizes, and enough work (max-autotune
    times every one)."""
    vals = [a.meta.get("val") for a in _tensor_args(node)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    if any(symbolic.tensor_is_symbolic(v) for v in vals):  # one module for all sizes: nothing to time
        return False
    return flops(node) >= MIN_FLOPS or opts.autotune


def choose(graph: fx.GraphModule, mode: str, target: Target, cache: CompileCache,
           opts: Options) -> set[fx.Node]:
    """The matmul/convolution nodes of `graph` that run as ATen kernels under `mode`
    ("always", "never" or "auto")."""
    candidates = [n for n in graph.graph.nodes if n.op == "call_function" and n.target in ATEN_MEASURED]
    if mode == "never" or not candidates:
        return set()
    if mode == "always":
        return {n for n in candidates if n.target in ATEN_MATMUL}
    if mode != "auto":
        raise BooError(f"aten_matmul={mode!r}")
    timings = Timings(cache, target, opts)
    chosen: dict[fx.Node, float] = {}
    timed = [n for n in candidates if _weighed(n, opts)]
    timings.prepare(timed)
    for node in timed:
        try:
            t = timings.of(node)
        except Exception as e:  # a shape IREE cannot compile alone: no evidence for ATen
            log.debug("boo: timing %s failed (%s); it stays in IREE", node.target, e)
            continue
        split = _CALLS_PER_SPLIT * timings.floor()
        if (abs(_MARGIN * t["iree_s"] - t["aten_s"] - split) < _CLOSE * t["aten_s"] and t["aten_s"] < timing.LONG_S
                and not t.get("rechecked")):
            try:
                t = timings.again(node, t)
            except Exception as e:  # the first timing stands
                log.debug("boo: timing %s again failed (%s)", node.target, e)
        saving = _MARGIN * t["iree_s"] - t["aten_s"]
        if saving > split:
            chosen[node] = saving
    if not chosen:
        return set()
    total = sum(chosen.values())
    cost = _CALLS_PER_SPLIT * len(chosen) * timings.floor()
    if total <= cost:
        log.info("boo: ATen would save %.3f ms on %d matmuls but the split costs %.3f ms; "
                 "keeping them in IREE", total * 1e3, len(chosen), cost * 1e3)
        return set()
    return set(chosen)


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def fold_adds(graph: fx.GraphModule, chosen: set[fx.Node]) -> set[fx.Node]:
    """`chosen` (from choose), with each ATen `mm` whose one use is an `add` of a tensor of
    the same shape and dtype, directly or through a view of the product, made one `addmm`:
    BLAS adds into the product as it writes it (beta = 1). The add would otherwise be an
    IREE call of its own between ATen kernels, one more pass over memory: the Llama of
    bench/scale.py adds its residual and q/k/v input gradients that way, 40 calls a step.
    Static shapes only."""
    for mm in [n for n in chosen if n.target is aten.mm.default and len(n.users) == 1]:
        user, view = next(iter(mm.users)), None
        if user.op == "call_function" and user.target in _VIEWS and len(user.users) == 1:
            view, user = user, next(iter(user.users))
        top = view or mm
        if not (user.op == "call_function" and user.target is aten.add.Tensor and not user.kwargs
                and len(user.args) == 2 and top in user.args and user.args[0] is not user.args[1]):
            continue
        other = user.args[1] if user.args[0] is top else user.args[0]
        o, product, out = (getattr(other, "meta", {}).get("val"), mm.meta.get("val"), user.meta.get("val"))
        if not all(isinstance(v, torch.Tensor) and not symbolic.tensor_is_symbolic(v) for v in (o, product, out)):
            continue
        if not (o.dtype == product.dtype == out.dtype and o.shape == out.shape and o.is_contiguous()
                and (view is None) == (out.shape == product.shape)):
            continue
        g = graph.graph
        with g.inserting_before(user):
            bias = other if view is None else g.call_function(aten.view.default, (other, list(product.shape)))
            if view is not None:
                bias.meta["val"] = o.view(product.shape)
            fused = g.call_function(aten.addmm.default, (bias, *mm.args))
            fused.meta = {**mm.meta, "val": aten.addmm.default(bias.meta["val"], *(a.meta["val"] for a in mm.args))}
            result = fused
            if view is not None:
                result = g.call_function(aten.view.default, (fused, list(out.shape)))
                result.meta = {**view.meta, "val": fused.meta["val"].view(out.shape)}
        user.replace_all_uses_with(result)
        for node in (user, view, mm):
            if node is not None:
                g.erase_node(node)
        chosen = (chosen - {mm}) | {fused}
    graph.recompile()
    return chosen
