"""The torch.compile entry point: `torch.compile(model, backend="boo")`.

Top of the import chain: backend -> match -> partition -> lower -> compile -> runtime.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import warnings

import torch
import torch._guards
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from . import aot_cache, composites, hops, joint, match, patterns, precompile, refusals, regions, tangents
from .compile import Target, target_for
from .config import BooError, BooFallbackWarning, BooStrictError, Options
from .graph import CompiledGraph
from .mended import while_tracing

log = logging.getLogger("boo_backend")

_graph_ids = itertools.count()


def boo(gm: fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """Dynamo backend. `options` is torch.compile's options dict (see boo_backend.config)."""
    opts = Options.resolve({**(options or {}), **kwargs})
    composites.disabled(opts.force_decompose)  # an unknown composite name fails here, early
    graph_id = next(_graph_ids)
    refused = refusals.refused_in_place(gm)
    if refused is not None:  # eager raises it where the call is made; functionalized, it would not
        log.info("boo graph %03d: eager refuses one of its in-place calls (%s); it runs as Dynamo's graph in eager",
                 graph_id, refused)
        return gm.forward
    dynamos = gm
    graphs: list[CompiledGraph] = []  # this graph's forward, backward or inference, once compiled
    matched = patterns.apply(gm, opts.force_decompose, opts.strict)
    if matched is not gm and hasattr(gm, "_backend_id"):
        matched._backend_id = gm._backend_id  # torch's precompile records the graph under it
    gm = matched

    def name_of(kind: str) -> str:
        return f"{kind}_{graph_id:03d}"

    def build(kind: str, graph: fx.GraphModule):
        """The callable for AOTAutograd's `kind` graph, or an eager fallback (not cached)."""
        name = name_of(kind)
        try:
            graph = hops.inline(graph)
        except BooError as e:
            if opts.strict:
                raise BooStrictError(f"boo strict: {kind} graph {name}: {e}") from e
            warnings.warn(f"{e} ({kind} graph {name})", BooFallbackWarning, stacklevel=2)
            at = tangents.positions(graph) if kind == "backward" else []
            run = graph.forward if not at else lambda *a: graph.forward(*tangents.fill(list(a), graph, at))
            return aot_cache.BooGraph(kind, make_boxed_func(run), None, opts, name)
        compiled = CompiledGraph(graph, kind, opts, name)
        graphs.append(compiled)
        return aot_cache.BooGraph(kind, compiled, graph, opts, name)

    def compiler(kind: str):
        def compile_graph(graph, _example_inputs):
            if kind == "forward":
                _no_donated_buffers()
            return build(kind, graph)

        return aot_cache.compiler(compile_graph)

    def rebuild(kind: str, graph: fx.GraphModule, whole=None):
        """A graph AOTAutograd's cache gave back (hops already inlined); `whole` loads it with
        its nodes' values where `graph` lacks them (aot_cache)."""
        compiled = CompiledGraph(graph, kind, opts, name_of(kind), whole)
        graphs.append(compiled)
        return compiled

    # AOTAutograd's own CSE pass costs ~0.5 s on a transformer layer's joint graph; IREE
    # runs CSE on every module anyway, so the warm start skips it.
    with (functorch_config.patch(cse=False), _attention_for(target_for(opts.target, example_inputs)),
          while_tracing(), aot_cache.serving(opts, rebuild, aot_cache.keyable(gm))):
        compiled = _aot(opts, compiler)(gm, example_inputs)
    if opts.compile_only or opts.strict:  # strict mode proves that IREE ran: no part chose ATen
        return compiled
    return regions.faster(compiled, dynamos, graphs, name_of("graph"), regions.allowed(opts))


def _loaded(kind: str, graph: fx.GraphModule, opts: Options, name: str, whole=None):
    """A graph torch's precompile loaded (no backend call under way): boo's compile cache
    serves its modules as it would a fresh compile's."""
    return CompiledGraph(graph, kind, opts, name, whole)


aot_cache.LOADED.append(_loaded)
precompile.install(boo)


def _no_donated_buffers() -> None:
    """Tell AOTAutograd that boo's backward donates none of the tensors the forward saved:
    it never writes into them (its result pool reuses only storage that nothing else holds).
    AOTAutograd refuses `backward(retain_graph=True)` for a backward compiled with donated
    buffers, and boo compiles its backward with its forward (aot_cache.serving), so without
    this a second backward through the same graph (several losses, a GAN's two steps) failed
    where eager and Inductor ran it. Called while the forward compiles, after AOTAutograd
    has listed them; its cache entry keeps the empty list."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if meta is not None and meta.bw_donated_idxs:
        meta.bw_donated_idxs.clear()  # the outer and inner metadata share the list


def _attention_for(target: Target):
    """How F.scaled_dot_product_attention is traced. On the CPU it becomes the CPU flash ops,
    which the attention composite computes. For a GPU target, its math form (matmuls and a
    softmax, which the softmax composite computes): on CUDA tensors it would otherwise become
    CUDA-only kernels (flash, memory-efficient, cuDNN) that boo can only run as eager islands,
    and the graph would differ from the one a compile_only run traced on the CPU."""
    if target.is_cpu:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _aot(opts: Options, compiler):
    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=match.decompositions(opts),
        partition_fn=joint.partition(
            min_cut_rematerialization_partition if opts.partitioner == "mincut" else default_partition, opts
        ),
    )
