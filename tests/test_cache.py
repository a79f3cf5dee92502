"""The compile cache: memory and disk, keys, corruption, concurrent writers, BOO_CACHE=0."""

import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import boo_backend
from boo_backend.cache import CompileCache
from util import assert_close

_SCRIPT = r"""
import json, sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
x = torch.randn(5, 8)
loss = torch.compile(model, backend="boo")(x).square().mean()
loss.backward()
import boo_backend
from torch._dynamo.utils import counters
print(json.dumps({"stats": boo_backend.stats(), "loss": loss.item(), "aot": dict(counters["aot_autograd"])}))
"""


def _run_process(cache_dir):
    env = dict(os.environ, BOO_CACHE_DIR=str(cache_dir), BOO_STRICT="1")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing(tmp_path):
    """Nor does it trace the joint graph again: AOTAutograd's cache serves boo's forward and
    backward graphs (boo_backend/aot_cache.py), and boo's cache their modules."""
    first = _run_process(tmp_path)
    second = _run_process(tmp_path)
    assert first["aot"].get("autograd_cache_saved", 0) == 1, first["aot"]
    assert second["aot"].get("autograd_cache_hit", 0) == 1 and not second["aot"].get("autograd_cache_miss"), second["aot"]
    assert list((tmp_path / "aotautograd").iterdir()), "AOTAutograd's entries belong in boo's cache directory"
    assert first["stats"].get("iree_compiles", 0) >= 2, first
    assert second["stats"].get("iree_compiles", 0) == 0, second
    assert second["stats"].get("cache_hits_disk", 0) >= 2, second
    assert first["loss"] == second["loss"]


def _step(x):
    return torch.compile(lambda t: (t.exp() * 3).sum(dim=1), backend="boo")(x)


def test_corrupted_cache_file_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 5)
    _step(x)
    files = list(tmp_path.glob("*.vmfb"))
    assert files, list(tmp_path.iterdir())
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated
    boo_backend.reset()
    torch._dynamo.reset()
    assert_close(_step(x), (x.exp() * 3).sum(dim=1), "after rebuild")
    stats = boo_backend.stats()
    assert stats.get("cache_corrupt", 0) >= 1 and stats.get("iree_compiles", 0) >= 1, stats
    # The rebuilt file is whole again: a third, fresh start loads it.
    boo_backend.reset()
    torch._dynamo.reset()
    _step(x)
    assert boo_backend.stats().get("iree_compiles", 0) == 0


class _Scaled(torch.nn.Module):
    """A plain tensor attribute (not a buffer): Dynamo makes it a constant of the graph."""

    def __init__(self, scale):
        super().__init__()
        self.scale = torch.tensor(scale)
        self.linear = torch.nn.Linear(37, 5)

    def forward(self, x):
        return self.linear(x * self.scale - torch.tensor([0.485, 0.456, 0.406]).repeat(13)[:37])


def test_graphs_that_differ_only_in_a_constant_are_two_entries(tmp_path, monkeypatch):
    """The graphs' text is the same, the constants' values differ: each gets its own entry,
    from memory and from disk, forward and backward."""
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    x = torch.randn(11, 37)
    for attempt in ("cold", "memory", "disk"):
        if attempt == "disk":
            boo_backend.reset()
        for scale in (2.0, 3.0, -0.5):
            torch._dynamo.reset()
            f = torch.compile(lambda t, c=scale: t * torch.tensor(c) + 1, backend="boo")
            assert_close(f(x), x * scale + 1, f"{attempt}: x * {scale}")
            torch.manual_seed(0)
            model = _Scaled(scale)
            ours = torch.compile(model, backend="boo")(x)
            ours.square().sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            ref = model(x)
            ref.square().sum().backward()
            assert_close(ours, ref, f"{attempt}: module scaled by {scale}")
            for g, p in zip(grads, model.parameters()):
                assert_close(g, p.grad, f"{attempt}: gradient, scaled by {scale}")


def test_default_dtype_is_part_of_the_key(tmp_path, monkeypatch):
    """The same graph text means another thing under another default dtype: an int tensor
    times a float, a float arange and a float full are float64 under float64's default. The
    float32 module was served for them, from memory and from disk."""
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))

    def f(i, x):
        return i * 0.3, x + torch.arange(0.0, 0.9, 0.3) + torch.full((3,), 0.1)

    i, x = torch.arange(3), torch.randn(3)
    try:
        for attempt in ("cold", "memory", "disk"):
            if attempt == "disk":
                boo_backend.reset()
            for default in (torch.float32, torch.float64):
                torch.set_default_dtype(default)
                torch._dynamo.reset()
                ours, ref = torch.compile(f, backend="boo")(i, x), f(i, x)
                assert ref[0].dtype == default
                for o, r in zip(ours, ref):
                    assert o.dtype == r.dtype and torch.equal(o, r), (attempt, default, o, r)
    finally:
        torch.set_default_dtype(torch.float32)


_SCALE = 0.5


def _leaky(x):
    return F.leaky_relu(x * _SCALE, _SCALE / 5).cumsum(0)


def test_a_float_global_that_changed_is_not_served_from_another_run(tmp_path, monkeypatch):
    """Once a global float changes, Dynamo passes it as a 0-d tensor and AOTAutograd bakes
    `s / 5` into the graph it traces, under a guard AOTAutograd's cache does not keep: a later
    run with another `s` was given the first run's graph (its slope) from that cache."""
    global _SCALE
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    x = torch.linspace(-3, 3, 77).reshape(7, 11)
    try:
        for start in (0.5, 2.0):
            _SCALE = start
            torch._dynamo.reset()
            boo_backend.reset()
            compiled = torch.compile(_leaky, backend="boo")
            for rows in (5, 37):  # a second size: the batch becomes dynamic
                compiled(torch.randn(rows, 11))
            _SCALE = start * 3  # Dynamo compiles again, `s` now an input
            assert_close(compiled(x), _leaky(x), f"slope {_SCALE / 5}")
    finally:
        _SCALE = 0.5


def test_flipped_byte_is_detected(tmp_path):
    cache = CompileCache(tmp_path)
    key = cache.key("vmfb", "module text")
    cache.put(key, b"payload" * 100)
    path = tmp_path / key
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    boo_backend.reset()
    assert cache.get(key) is None
    assert not path.exists()


def test_cache_off_compiles_every_time(tmp_path, monkeypatch):
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BOO_CACHE", "0")
    boo_backend.reset()
    x = torch.randn(3, 5)
    _step(x)
    torch._dynamo.reset()
    _step(x)
    assert boo_backend.stats()["iree_compiles"] == 2
    assert not any(tmp_path.iterdir())


def test_key_covers_text_flags_and_versions(monkeypatch):
    import boo_backend.cache as cache_mod

    assert "boo-source=" in cache_mod.tool_versions()  # boo's own code and templates count too
    base = CompileCache.key("vmfb", "module", "--flag-a")
    assert CompileCache.key("vmfb", "module2", "--flag-a") != base
    assert CompileCache.key("vmfb", "module", "--flag-b") != base
    monkeypatch.setattr(cache_mod, "tool_versions", lambda: "iree-base-compiler=99")
    assert CompileCache.key("vmfb", "module", "--flag-a") != base


def _writer(directory, key, fill, rounds):
    cache = CompileCache(directory)
    for _ in range(rounds):
        cache.put(key, bytes([fill]) * 3_000_000)


def test_concurrent_writers_leave_a_whole_file(tmp_path):
    key = CompileCache.key("vmfb", "shared")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(tmp_path, key, fill, 5)) for fill in (1, 2, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    boo_backend.reset()
    payload = CompileCache(tmp_path).get(key)
    assert payload is not None and len(payload) == 3_000_000 and len(set(payload)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [key], "temporary files were left behind"


def test_warm_start_skips_tracing_and_import(tmp_path, monkeypatch):
    """The second build of the same graph loads the lowered module from the cache: no retrace,
    no torch-mlir import, no compile; the placement is the same."""
    import boo_backend.assemble as graph_mod

    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    x = torch.randn(6, 5)
    _step(x)
    first = [p.line().split(":", 1)[1] for p in boo_backend.placements()]
    boo_backend.reset()
    torch._dynamo.reset()

    def no_lowering(*a, **k):
        raise AssertionError("lowered again despite a warm cache")

    monkeypatch.setattr(graph_mod, "lower", no_lowering)
    assert_close(_step(x), (x.exp() * 3).sum(dim=1), "warm start")
    assert [p.line().split(":", 1)[1] for p in boo_backend.placements()] == first
    assert boo_backend.stats().get("iree_compiles", 0) == 0


class _Layers(torch.nn.Module):
    """Three identical blocks: boo cuts the graph at them (a split graph, not one module)."""

    def __init__(self, width=24):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _split_step(model, x, **options):
    out = torch.compile(model, backend="boo", options=options or None)(x)
    out.sum().backward()
    return out


def test_split_graph_warm_start_and_misses(tmp_path, monkeypatch):
    """A graph cut into parts (a model's blocks; matmuls left to ATen between IREE parts)
    warm-starts from the cache: no retrace, no torch-mlir import, no compile, the same
    placement and results. A changed model, dtype, flag or boo version is a miss."""
    import boo_backend.cache as cache_mod
    import boo_backend.assemble as graph_mod
    from boo_backend import blocks

    monkeypatch.setattr(blocks, "MIN_PART_ELEMENTS", 0)  # its blocks are small: cut them anyway
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    real_lower, real_retrace = graph_mod.lower, graph_mod.retrace
    calls = {"lower": 0, "retrace": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(graph_mod, "lower", counted("lower", real_lower))
    monkeypatch.setattr(graph_mod, "retrace", counted("retrace", real_retrace))

    from torch._dynamo.utils import counters

    def run(model, x, **options):
        boo_backend.reset()
        torch._dynamo.reset()
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        calls.update(lower=0, retrace=0)
        out = _split_step(model, x.clone().requires_grad_(), **options)
        calls["aot_hits"] = counters["aot_autograd"]["autograd_cache_hit"] - hits
        return out, [p.line().split(":", 1)[1] for p in boo_backend.placements()], dict(calls)

    torch.manual_seed(0)
    model = _Layers()
    x = torch.randn(7, 24)
    for options in ({}, {"aten_matmul": "always"}):
        before = set(tmp_path.rglob("*.split*"))
        first, placed, cold = run(model, x, **options)
        assert cold["lower"] > 0 and cold["retrace"] > 0
        assert set(tmp_path.rglob("*.split*")) - before, f"{options}: no split graph was cached"
        warm, placed_warm, hot = run(model, x, **options)
        assert cold["aot_hits"] == 0 and hot == {"lower": 0, "retrace": 0, "aot_hits": 1}, (options, cold, hot)
        assert boo_backend.stats().get("iree_compiles", 0) == 0
        assert placed_warm == placed
        assert_close(warm, first, "warm start")

    misses = {
        "model": lambda: run(_Layers(width=32), torch.randn(7, 32)),
        "dtype": lambda: run(_Layers().to(torch.bfloat16), x.to(torch.bfloat16)),
        "flag": lambda: run(model, x, force_decompose="gelu"),
    }
    misses["boo version"] = lambda: (monkeypatch.setattr(cache_mod, "tool_versions", lambda: "boo-backend=0.0.0-other"),
                                     run(model, x))[1]
    for what, fn in misses.items():
        calls_made = fn()[2]
        assert calls_made["lower"] > 0 and calls_made["aot_hits"] == 0, f"a changed {what} used a stale entry"


def test_warm_start_loads_the_graph_without_values_and_the_whole_graph_when_it_must_build(tmp_path, monkeypatch):
    """A hit in AOTAutograd's cache hands boo a static graph without its nodes' fake tensors
    (cheaper to unpickle; boo's cache then serves the modules). Where boo's own entries are
    gone, the graph is unpickled whole and built, with the cold process's results."""
    from boo_backend import aot_cache
    from torch._dynamo.utils import counters

    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    loaded = []
    real_load = aot_cache._load

    def load(blob):
        gm = real_load(blob)
        loaded.append(all("val" in n.meta for n in gm.graph.nodes if n.op != "output"))
        return gm

    monkeypatch.setattr(aot_cache, "_load", load)
    torch.manual_seed(0)
    model = _Layers(width=37)
    x = torch.randn(9, 37)

    def run():
        boo_backend.reset()
        torch._dynamo.reset()
        loaded.clear()
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        x_ = x.clone().requires_grad_()
        out = _split_step(model, x_)
        hits = counters["aot_autograd"]["autograd_cache_hit"] - hits
        return out, x_.grad, hits, boo_backend.stats().get("iree_compiles", 0)

    cold, cold_grad, hits, _ = run()
    assert hits == 0 and loaded == []
    warm, warm_grad, hits, compiles = run()
    assert hits == 1 and loaded == [False, False] and compiles == 0, (hits, loaded, compiles)
    for entry in [*tmp_path.glob("*.split"), *tmp_path.glob("*.lowered")]:
        entry.unlink()
    built, built_grad, hits, _ = run()
    assert hits == 1 and loaded == [False, False, True, True], loaded  # both graphs light, then each whole
    for got, grad in ((warm, warm_grad), (built, built_grad)):
        torch.testing.assert_close(got, cold, rtol=0, atol=0)
        torch.testing.assert_close(grad, cold_grad, rtol=0, atol=0)


def test_saved_split_graph_is_rebuilt_from_its_nodes(monkeypatch):
    """saved.dump/load: the outer graph and its ATen parts come back as GraphModules built from
    their nodes (torch.fx's pickling, which traces the generated code again, is not used),
    ATen parts that compute the same are stored once and shared, ops resolve to torch's own
    objects, and the rebuilt graph computes what the original did."""
    import torch.fx as fx
    from boo_backend import saved

    def part(x, w):
        return torch.ops.aten.mm.default(x, w).relu()

    def other(x, w):
        return torch.ops.aten.mm.default(x, w).tanh()

    parts = {"part_a": fx.symbolic_trace(part), "part_b": fx.symbolic_trace(part), "part_c": fx.symbolic_trace(other)}
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    y = graph.call_module("part_a", (x, w))
    b = graph.call_module("part_b", (y, w))
    c = graph.call_module("part_c", (graph.call_function(torch.ops.aten.mul.Tensor, (y, 0.5)), w))
    graph.output((b, c))
    outer = fx.GraphModule(parts, graph)

    def traced_again(*args, **kwargs):
        raise AssertionError("torch.fx's pickling traced a GraphModule's code again")

    monkeypatch.setattr(fx.graph_module, "_deserialize_graph_module", traced_again)
    loaded, extra = saved.load(saved.dump(outer, {"note": 1}), lambda *a: None)
    assert extra == {"note": 1}
    assert isinstance(loaded, fx.GraphModule) and loaded.part_a is loaded.part_b
    assert loaded.part_c is not loaded.part_a
    targets = {n.target for m in (loaded, loaded.part_a) for n in m.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.mm.default in targets and torch.ops.aten.mul.Tensor in targets
    x, w = torch.randn(5, 4), torch.randn(4, 4)
    for got, want in zip(loaded(x, w), outer(x, w)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_warm_start_of_a_graph_with_an_island_is_refused_in_strict_mode(tmp_path, monkeypatch):
    """A cached split graph with an eager island warns again when loaded, and strict mode
    refuses it, as it refuses the cold build."""
    import warnings

    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BOO_STRICT", "0")
    x = torch.randn(3, 7)
    fn = lambda t: torch.cummax(t, dim=1)[0] * 2  # noqa: E731
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        torch.compile(fn, backend="boo")(x)
    assert list(tmp_path.rglob("*.split*"))
    torch._dynamo.reset()
    boo_backend.reset()
    with pytest.warns(boo_backend.BooFallbackWarning, match="cummax"):
        assert_close(torch.compile(fn, backend="boo")(x), fn(x), "warm island")
    torch._dynamo.reset()
    boo_backend.reset()
    monkeypatch.setenv("BOO_STRICT", "1")
    with pytest.raises(boo_backend.BooStrictError, match="cummax"):
        torch.compile(fn, backend="boo")(x)


def test_attention_kernel_choice_is_part_of_aotautograds_key(tmp_path, monkeypatch):
    """The same Dynamo graph becomes the CPU flash ops or, under sdpa_kernel([MATH]), the math
    form; a graph cached under one choice must not serve the other."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, requires_grad=True) for _ in range(3))

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def composites():
        return {n for p in boo_backend.placements() for n, _ in p.composite_names}

    torch.compile(attend, backend="boo")(q, k, v).sum().backward()
    assert any("flash_attention" in n for n in composites())
    boo_backend.reset()
    torch._dynamo.reset()
    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.compile(attend, backend="boo")(q, k, v)
        ref = attend(q.detach(), k.detach(), v.detach())
    assert_close(out, ref, "math-form attention")
    assert not any("flash_attention" in n for n in composites()), composites()
