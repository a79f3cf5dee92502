"""Repeated blocks (boo_backend.blocks): a model's layers are cut into parts, and parts that
compute the same thing share one module. Results stay eager's; a deeper model compiles no
more modules than a shallower one; blocks that differ in anything that matters are not
shared."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import boo_backend
from boo_backend import blocks

from util import assert_close


@pytest.fixture
def small_blocks_cut(monkeypatch):
    """The models here are small, and their parts too small to be worth a call each
    (blocks.MIN_PART_ELEMENTS): cut them anyway, to test the cut itself."""
    monkeypatch.setattr(blocks, "MIN_PART_ELEMENTS", 0)


def _gpt2(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=97, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _train_step(model, tokens, **compile_kwargs):
    """Loss and gradients of one step with boo, and of the same step in eager."""
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="boo", **compile_kwargs)
    loss = compiled(tokens, labels=tokens).loss
    loss.backward()
    ref_loss = ref(tokens, labels=tokens).loss
    ref_loss.backward()
    assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, what=name)


def _compiles(layers: int, caplog, cache_dir, **options) -> tuple[int, list[str]]:
    """iree-compile runs for one training step with the compile cache in `cache_dir`, and
    the blocks lines."""
    options["cache_dir"] = str(cache_dir)
    boo_backend.reset()
    torch._dynamo.reset()
    tokens = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.INFO, logger="boo_backend"):
        caplog.clear()
        _train_step(_gpt2(layers), tokens, options=options)
    lines = [r.getMessage() for r in caplog.records if "repeated blocks" in r.getMessage()]
    return boo_backend.stats().get("iree_compiles", 0), lines


def test_deeper_model_compiles_no_more_modules(small_blocks_cut, caplog, tmp_path):
    """GPT-2 with 2 layers from an empty cache, then with 4 layers on the same cache: the
    deeper model needs no module that the shallower one did not compile (every op in IREE,
    strict), and each graph says how many distinct modules its blocks needed."""
    two, lines_two = _compiles(2, caplog, tmp_path / "cache")
    assert two > 0 and any("2 repeated blocks" in line for line in lines_two), lines_two
    four, lines_four = _compiles(4, caplog, tmp_path / "cache")
    assert four == 0, f"the 4-layer model compiled {four} modules that the 2-layer one did not"
    assert any("4 repeated blocks" in line for line in lines_four), lines_four
    assert all("distinct modules" in line for line in lines_four)
    # One module per graph without the cut.
    off, lines_off = _compiles(2, caplog, tmp_path / "off", blocks=False)
    assert not lines_off
    assert 0 < off < two  # one module per graph


class _Block(nn.Module):
    def __init__(self, width: int, scale: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x):
        return x + self.scale * torch.nn.functional.gelu(self.fc(self.norm(x)))


class _Stack(nn.Module):
    """Blocks of one class that differ: a scale written as a Python float (a constant in the
    graph), and, at the end, two blocks of another width."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(48, 1.0), _Block(48, 1.0), _Block(48, 0.5), _Block(48, 1.0)])
        self.proj = nn.Linear(48, 72)
        self.wide = nn.ModuleList([_Block(72, 1.0), _Block(72, 1.0)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        x = self.proj(x)
        for layer in self.wide:
            x = layer(x)
        return x.sum(-1)


def _run(model, x, grad):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_that_differ_are_not_shared(small_blocks_cut, dtype, caplog):
    """Blocks that differ in a constant or a width get their own modules, and every result is
    as close to a float64 reference as eager's (within 3x eager's own error)."""
    torch.manual_seed(0)
    model = _Stack().to(dtype)
    x = torch.randn(5, 67, 48, dtype=dtype)
    grad = torch.randn(5, 67, dtype=dtype)
    exact = _run(copy.deepcopy(model).double(), x.double(), grad.double())
    eager = _run(copy.deepcopy(model), x, grad)
    boo_backend.reset()
    with caplog.at_level(logging.INFO, logger="boo_backend"):
        ours = _run(torch.compile(model, backend="boo"), x, grad)
    for i, (a, e, r) in enumerate(zip(ours, eager, exact)):
        ours_err = (a.double() - r).abs().max().item()
        eager_err = (e.double() - r).abs().max().item()
        assert ours_err <= 3 * eager_err + 1e-6 * r.abs().max().item(), (i, ours_err, eager_err)
    lines = [r.getMessage() for r in caplog.records if "repeated blocks" in r.getMessage()]
    assert any("4 repeated blocks" in line or "6 repeated blocks" in line for line in lines), lines


class _Widening(nn.Module):
    """Three blocks of one class, each of another width: nothing repeats."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(w, w + 8), nn.GELU()) for w in (24, 32, 40)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1)


def test_blocks_that_all_differ_are_not_cut(small_blocks_cut, caplog):
    """A graph whose blocks share nothing is compiled whole: each module costs iree-compile
    a fixed second or two, and cutting would buy no reuse (blocks.repeats_pay)."""
    torch.manual_seed(0)
    model = _Widening()
    x = torch.randn(3, 19, 24)
    grad = torch.randn(3, 19)
    eager = _run(copy.deepcopy(model), x, grad)
    boo_backend.reset()
    with caplog.at_level(logging.INFO, logger="boo_backend"):
        ours = _run(torch.compile(model, backend="boo"), x, grad)
    for i, (a, e) in enumerate(zip(ours, eager)):
        assert_close(a, e, f"result {i}", rtol=1e-5, atol=1e-5)
    lines = [r.getMessage() for r in caplog.records if "repeated blocks" in r.getMessage()]
    assert not lines, lines
    assert {p.kind for p in boo_backend.placements()} == {"forward", "backward"}


def test_small_blocks_are_not_cut(caplog, tmp_path, monkeypatch):
    """A 2-layer GPT-2 of width 64 on 2 x 19 tokens: its blocks repeat, but each part would
    write far fewer elements than blocks.MIN_PART_ELEMENTS, so the graphs are not cut (an
    IREE call costs more than the compile it saves); results stay eager's. With the bound
    below its parts' size, the same model is cut."""
    compiles, lines = _compiles(2, caplog, tmp_path / "small")
    assert compiles > 0 and not lines, lines
    monkeypatch.setattr(blocks, "MIN_PART_ELEMENTS", 20_000)
    compiles, lines = _compiles(2, caplog, tmp_path / "lowered")
    assert any("2 repeated blocks" in line for line in lines), lines


def test_blocks_not_cut_leave_no_cuts_behind():
    """An MLP's two Linear layers are blocks that do not repeat. Its graph, not cut at them,
    is ordered by place alone: the backward's IREE work (both bias gradients' sums, GELU's
    and layer norm's backward) is one part between the ATen matmuls, not three."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(72, 136), nn.LayerNorm(136), nn.GELU(), nn.Linear(136, 72))
    x = torch.randn(37, 72)
    eager = copy.deepcopy(model)
    boo_backend.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="boo", options={"aten_matmul": "always", "strict": True})
    compiled(x).square().mean().backward()
    eager(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, what=name)
    backward = [p for p in boo_backend.placements() if p.kind == "backward"]
    assert len(backward) == 1 and backward[0].aten > 0, [p.line() for p in backward]
    assert len(backward[0].drivers) == 1, backward[0].drivers


def _with_constant(value: float):
    gm = torch.fx.symbolic_trace(lambda x: x * torch.tensor([value, 2.0]))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = torch.empty(2)
    return gm


def test_structure_key_sees_constants_not_names():
    a, b, c = _with_constant(1.0), _with_constant(1.0), _with_constant(3.0)
    # Rename b's nodes: names do not count.
    for node in b.graph.nodes:
        if node.op != "output":
            node.name = node.name + "_renamed"
    assert blocks.structure_key(a) == blocks.structure_key(b)
    assert blocks.structure_key(a) != blocks.structure_key(c)


def test_nested_compile_region_calls_are_blocks(small_blocks_cut, caplog):
    """Each call of a function marked with torch.compiler.nested_compile_region is a block:
    its calls share one module, forward and backward, and the results are eager's."""

    @torch.compiler.nested_compile_region
    def block(x, w, b):
        return x + torch.nn.functional.gelu(x @ w + b)

    def f(x, ws, bs):
        for w, b in zip(ws, bs):
            x = block(x, w, b)
        return x.sum(-1)

    torch.manual_seed(0)
    x = torch.randn(37, 24)
    ws = [(0.2 * torch.randn(24, 24)).requires_grad_() for _ in range(4)]
    bs = [torch.randn(24, requires_grad=True) for _ in range(4)]
    boo_backend.reset()
    with caplog.at_level(logging.INFO, logger="boo_backend"):
        out = torch.compile(f, backend="boo")(x, ws, bs)
        out.sum().backward()
    grads = [t.grad.clone() for t in ws + bs]
    for t in ws + bs:
        t.grad = None
    expected = f(x, ws, bs)
    expected.sum().backward()
    assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for i, (g, t) in enumerate(zip(grads, ws + bs)):
        assert_close(g, t.grad, f"grad {i}", rtol=1e-5, atol=1e-5)
    lines = [r.getMessage() for r in caplog.records if "repeated blocks" in r.getMessage()]
    assert any("repeated blocks" in line for line in lines), lines
