"""AOTAutograd's own cache, serving boo's graphs: a warm process skips AOTAutograd's work
(the joint graph's trace, the partition into forward and backward) on top of boo's.

torch keeps an AOTAutogradCache for compilers that return `OutputCode` objects. In its
"bundled" form an entry pickles those objects whole, with the metadata AOTAutograd needs to
run them. boo's OutputCode (`BooGraph`) pickles only the graph it was given (torch.fx's
GraphPickler, fake tensors and symbolic sizes included). A hit unpickles the graph and
hands it to the backend as a fresh compile would, and boo's own compile cache then serves
the modules built for it (graph.py: the plan key is the graph's text).

A graph of static shapes is pickled twice: whole, and without the fake tensors of its nodes
(`meta["val"]`), which a hit on boo's own cache never reads. A hit unpickles the light copy
(0.14 s instead of 0.59 s for the two graphs of bench/scale.py's Llama) and the whole one
only if boo has to build the graph after all (CompiledGraph's `whole`).

Stale entries: the entry's key is AOTAutograd's (the Dynamo graph, input metadata, torch's
own version and configs) plus a tag that names boo's version, the hash of boo's sources and
kernels, the tools' versions and every resolved option (`Options`). Entries live in boo's
cache directory, so BOO_CACHE=0 and a fresh BOO_CACHE_DIR leave AOTAutograd's cache alone.

Imports cache (the versions), config and partition (is_symbolic) from boo_backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
from typing import Any, Callable
from unittest import mock

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache, BypassAOTAutogradCache
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._inductor.output_code import OutputCode

from . import cache
from .config import Options
from .partition import is_symbolic

# Set by `serving` while the backend runs AOTAutograd: builds the callable for a graph that
# a hit unpickled (kind, graph, whole) -> callable; `whole`: None when the graph is whole, else
# what loads the graph with its values.
_REBUILD: list[Callable[[str, fx.GraphModule, Callable[[], fx.GraphModule] | None], Any]] = []
# The tag of the boo compile now wrapping a function under torch's precompile (set by
# precompile.py; "" for another backend's compile, None outside one).
ASKING: contextvars.ContextVar[str | None] = contextvars.ContextVar("boo_precompile_asking", default=None)
# Set by the backend's module: builds the callable for a graph that torch's precompile loaded,
# outside any backend call (precompile.py): (kind, graph, options, name, whole) -> callable.
LOADED: list[Callable[..., Any]] = []


class BooGraph(OutputCode):
    """What boo's forward, backward and inference compilers return: the compiled graph (or
    its eager fallback), as AOTAutograd's cache can store it."""

    def __init__(self, kind: str, compiled, gm: fx.GraphModule | None, opts: Options, name: str):
        super().__init__()
        self._boxed_call = True
        self.kind = kind
        self.compiled = compiled
        self.gm = gm  # None: not storable (an eager fallback)
        self.graph_bytes: bytes | None = None
        self.light_bytes: bytes | None = None  # static shapes: the graph without its values
        # What rebuilds it where no backend call is under way (torch's precompile), and what
        # tells a precompiled entry made for other settings (precompile.py).
        self.opts = opts
        self.name = name
        self.tag = tag(opts)

    def __call__(self, inputs):
        return self.compiled(inputs)

    def __setstate__(self, state) -> None:
        # Unpickled or copied: AOTAutograd's cache in boo's backend, or torch's precompile for
        # a compile that precompile.py knows to be boo's. A precompiled entry read for another
        # backend (which boo's patches did not see start) fails to load, and that backend traces.
        if not _REBUILD and not ASKING.get() and torch._dynamo.config.caching_precompile:
            raise RuntimeError("boo: a graph of boo's in torch's precompile cache, read for another backend")
        self.__dict__.update(state)

    def prepare_for_serialization(self) -> None:
        # Called on a shallow copy, before pickling the entry.
        if self.graph_bytes is not None:  # loaded from an entry: its bytes serve again
            self.compiled = None
            return
        if self.gm is None:
            raise BypassAOTAutogradCache(f"boo: the {self.kind} graph runs in eager PyTorch")
        try:
            with cache.timed("aot_save"):
                self.graph_bytes = _dump(self.gm)
                if not is_symbolic(self.gm):
                    self.light_bytes = _dump(self.gm, values=False)
        except Exception as e:  # a graph torch.fx cannot pickle: no entry for it
            raise BypassAOTAutogradCache(f"boo: the {self.kind} graph does not pickle: {e}") from e
        self.compiled = None
        self.gm = None

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        whole = functools.partial(_load, self.graph_bytes)
        with cache.timed("aot_load"):
            gm = _load(self.light_bytes) if self.light_bytes is not None else whole()
        whole = whole if self.light_bytes is not None else None
        if _REBUILD:
            self.compiled = _REBUILD[-1](self.kind, gm, whole)
        else:
            self.compiled = LOADED[0](self.kind, gm, self.opts, self.name, whole)

    def set_triton_bundle(self, triton_bundle) -> None:
        pass


def _dump(gm: fx.GraphModule, values: bool = True) -> bytes:
    """The graph as bytes, with each node's fake tensor (`val`) when `values`. Module stacks
    keep their paths and class names (boo reads no more), not the classes: a test's or a
    script's local class does not pickle."""
    from torch.fx._graph_pickler import GraphPickler, Options as PickleOptions

    saved = {}
    keys = ("val", "nn_module_stack", "fwd_nn_module_stack") if values else ("nn_module_stack", "fwd_nn_module_stack")
    for node in gm.graph.nodes:
        saved[node] = node.meta
        kept = {k: node.meta[k] for k in keys if node.meta.get(k) is not None}
        for key in ("nn_module_stack", "fwd_nn_module_stack"):
            if kept.get(key):
                kept[key] = {k: (str(v[0]), getattr(v[1], "__qualname__", str(v[1])))
                             for k, v in kept[key].items()}
        node.meta = kept
    module_meta, gm.meta = gm.meta, {}
    try:
        return GraphPickler.dumps(gm, PickleOptions(ops_filter=None))
    finally:
        gm.meta = module_meta
        for node, meta in saved.items():
            node.meta = meta


def _load(blob: bytes) -> fx.GraphModule:
    """A graph from `_dump`, its symbolic sizes in a shape environment of its own (GraphPickler
    restores the pickled environment's state into it: Dynamo's must not be overwritten)."""
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = GraphPickler.loads(blob, FakeTensorMode(shape_env=ShapeEnv()))
    gm.recompile()
    return gm


def compiler(compile_graph: Callable):
    """`compile_graph` as a compiler AOTAutograd's cache recognizes."""
    return SerializableAOTDispatchCompiler(BooGraph, compile_graph)


def tag(opts: Options) -> str:
    """What boo adds to AOTAutograd's key: every input to what a hit would give the backend,
    the attention kernels torch may pick included (`sdpa_kernel`: the same Dynamo graph
    becomes the CPU flash ops or the math form, and AOTAutograd's key does not say which)."""
    options = sorted((k, str(v)) for k, v in dataclasses.asdict(opts).items())
    digest = hashlib.sha256(f"{cache.tool_versions()}|{options}|{_attention_kernels()}".encode()).hexdigest()[:24]
    return f"boo:{digest}"


def _attention_kernels() -> str:
    kinds = ("flash", "mem_efficient", "math", "cudnn")
    return ",".join(k for k in kinds if getattr(torch.backends.cuda, f"{k}_sdp_enabled")())


def keyable(gm) -> bool:
    """Whether AOTAutograd's cache can key `gm` (Dynamo's graph) safely. It keys the graph
    before AOTAutograd traces it, and checks the guards that tracing adds on sizes only: a
    float that becomes a number while tracing (a global `s` that changed once, which Dynamo
    then passes as a 0-d tensor and reads with `.item()`: `leaky_relu(x, s / 5)`) is baked
    into the traced graph under a guard the entry does not keep, and a second process with
    another `s` was served the first one's graph. Such graphs are not put in that cache
    (boo's own cache keys the traced graph, constants included)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("example_value", node.meta.get("val")), torch.SymFloat):
            return False
        if (node.op == "call_method" and node.target == "item") or node.target in (
                torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.Tensor.item):
            return False
    return True


@contextlib.contextmanager
def serving(opts: Options, rebuild: Callable[..., Any], cacheable: bool = True):
    """AOTAutograd's cache on for one backend call, its entries in boo's cache directory,
    keyed by boo's tag; `rebuild` turns a hit's graph into the callable (see _REBUILD). Off
    when boo's cache is off, or the graph is not `cacheable` (see keyable)."""
    if not opts.cache or not cacheable:
        with functorch_config.patch(enable_autograd_cache=False):
            yield
        return
    directory = str(opts.cache_dir / "aotautograd")
    previous = torch.compiler.config.cache_key_tag
    _REBUILD.append(rebuild)
    try:
        with (
            # The entry holds the OutputCode objects themselves, and the backward is compiled
            # (boo's compile is lazy: this only wraps the graph) while this patch holds, so
            # that it is saved.
            functorch_config.patch(bundled_autograd_cache=True,
                                   force_non_lazy_backward_lowering=True),
            torch.compiler.config.patch(cache_key_tag=f"{previous}|{tag(opts)}"),
            mock.patch.object(AOTAutogradCache, "_get_tmp_dir", classmethod(lambda cls: directory)),
        ):
            yield
    finally:
        _REBUILD.pop()
