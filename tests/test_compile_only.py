"""compile_only (BOO_COMPILE_ONLY=1): cross-compile a model for a GPU on a machine without one.

Every graph of the zoo's GPT-2 training step, forward and backward, is compiled for CUDA and
for ROCm into the compile cache and dump_dir, while the step runs in eager PyTorch. A later
process on another host (the GPU machine's CPU differs) finds every module in the cache.
"""

import logging

import pytest
import torch

import boo_backend
from boo_backend import cache as cache_mod
from boo_backend.zoo import MODELS

pytest.importorskip("transformers")


def _step(options):
    torch.manual_seed(0)
    model, batch = MODELS["gpt2"]()
    run = torch.compile(model, backend="boo", options=options) if options is not None else model
    loss = run(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("target,arch_flag", [("cuda:sm_80", "--iree-cuda-target=sm_80"),
                                              ("rocm:gfx942", "--iree-rocm-target=gfx942")])
def test_gpt2_cross_compiles(target, arch_flag, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path / "cache"))
    boo_backend.reset()
    dump = tmp_path / "dump"
    with caplog.at_level(logging.INFO, logger="boo_backend"):
        loss, grads = _step({"compile_only": True, "target": target, "dump_dir": str(dump)})
    eager_loss, eager_grads = _step(None)

    # The step ran in eager PyTorch (AOTAutograd's graphs, with PyTorch's kernels; attention
    # in its math form, so the last bits may differ from eager's flash kernel).
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-7)
    for n in eager_grads:
        torch.testing.assert_close(grads[n], eager_grads[n], rtol=1e-5, atol=1e-7)
    said = [r.getMessage() for r in caplog.records if "compile_only: compiling every graph" in r.getMessage()]
    assert len(said) == 1 and target in said[0]

    # Every graph, forward and backward, has its module and flags naming the target.
    placed = boo_backend.placements()
    kinds = {p.kind for p in placed}
    assert {"forward", "backward"} <= kinds
    assert all(p.compile_only == target and p.island == 0 and not p.recovered for p in placed)
    # Attention was traced in its math form, as on the GPU (backend._attention_for).
    names = {n for p in placed for n, _ in p.composite_names}
    assert "_softmax" in names and not any("flash_attention" in n for n in names)
    for p in placed:
        parts = sorted((dump / p.name).glob("*.vmfb"))
        assert parts, f"{p.name}: no module written"
        for vmfb in parts:
            assert vmfb.stat().st_size > 1000
            assert arch_flag in vmfb.with_suffix(".flags").read_text().split()
    compiled = boo_backend.stats()["iree_compiles"]
    assert compiled >= len(placed)

    # A later process on the GPU machine (another CPU): nothing left to compile.
    boo_backend.reset()
    torch._dynamo.reset()
    monkeypatch.setattr(cache_mod, "host_id", lambda: "machine=x86_64;cpu=The GPU machine's CPU")
    _step({"compile_only": True, "target": target})
    assert boo_backend.stats().get("iree_compiles", 0) == 0
    assert len(boo_backend.placements()) == len(placed)


def test_compile_only_needs_a_target():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="BooError: compile_only .* needs a target"):
        torch.compile(model, backend="boo", options={"compile_only": True})(torch.randn(2, 4))


def test_dynamic_graphs_cross_compile_once(tmp_path, monkeypatch):
    """A graph with symbolic sizes is compiled once, with dynamic dims, for every size."""
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path / "cache"))
    boo_backend.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    run = torch.compile(model, backend="boo", dynamic=True, options={"compile_only": True, "target": "rocm:gfx942"})
    for batch in (3, 5, 7):
        x = torch.randn(batch, 32)
        out = run(x)
        out.sum().backward()
        torch.testing.assert_close(out, model(x))
    placed = boo_backend.placements()
    assert [p.kind for p in placed] == ["forward", "backward"]
    assert all(p.dynamic and p.compile_only == "rocm:gfx942" for p in placed)
    assert boo_backend.stats()["iree_compiles"] == 2
