"""Rewrites across ops (fusions.py) and arguments donated to IREE (part.Donating): the tied
embedding of a language model, whose backward scatters into the projection's gradient."""

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import boo_backend
from boo_backend import fusions
from util import assert_close, compare_training

aten = torch.ops.aten


class TiedLM(nn.Module):
    """Embedding, a norm and the embedding's own weight as the output projection (GPT-2)."""

    def __init__(self, vocab: int, width: int, also_read: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.also_read = also_read
        with torch.no_grad():
            self.emb.weight.mul_(0.3)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        logits = h @ self.emb.weight.t()
        if self.also_read:  # the logits' gradient also feeds a second use of the weight
            logits = logits + (h[..., :1] * self.emb.weight[:, 0])
        return logits.reshape(-1, logits.shape[-1])


def _tokens(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    t = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    t[0, : length // 2] = 7  # repeated rows: the scatter accumulates
    return t


def _scatter_then_add(x, idx, v):
    return x + aten.index_put(torch.zeros_like(x), [idx], v, True)


def _graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scatter_into_zeros_then_add_becomes_one_accumulating_index_put(dtype):
    x = torch.randn(203, 37, dtype=dtype)
    idx = torch.tensor([5, 0, 202, 5, 5, 17])
    v = torch.randn(6, 37, dtype=dtype)
    gm = _graph(_scatter_then_add, x, idx, v)
    fused = fusions.apply(gm)
    assert fused is not gm
    assert not _calls(fused, aten.add.Tensor), fused.code
    (put,) = _calls(fused, aten.index_put.default)
    assert put.args[0].op == "placeholder"  # into x itself, no zeros
    ref = _scatter_then_add(x.double(), idx, v.double())
    assert_close(fused(x, idx, v), ref.to(dtype), "fused")
    assert_close(gm(x, idx, v), fused(x, idx, v), "fused against unfused")


@pytest.mark.parametrize("case", ["bfloat16", "not_zeros", "broadcast_add", "no_accumulate", "zeros_read_twice"])
def test_scatter_then_add_is_left_alone(case):
    """The rewrite holds only where it is an identity with the same rounding."""
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    x = torch.randn(40, 9, dtype=dtype)
    idx = torch.tensor([3, 3, 1])
    v = torch.randn(3, 9, dtype=dtype)
    fns = {
        "bfloat16": _scatter_then_add,
        "not_zeros": lambda x, i, v: x + aten.index_put(torch.ones_like(x), [i], v, True),
        "broadcast_add": lambda x, i, v: x[:1] + aten.index_put(torch.zeros_like(x), [i], v, True),
        "no_accumulate": lambda x, i, v: x + aten.index_put(torch.zeros_like(x), [i], v, False),
        "zeros_read_twice": lambda x, i, v: (lambda z: (x + aten.index_put(z, [i], v, True), z))(torch.zeros_like(x)),
    }
    gm = _graph(fns[case], x, idx, v)
    assert fusions.apply(gm) is gm


@pytest.mark.parametrize("shape", [(1003, 90, 3, 37), (4099, 130, 2, 71)])
@pytest.mark.parametrize("also_read", [False, True])
def test_tied_embedding_training_matches_eager(shape, also_read, monkeypatch, caplog):
    """Several steps (the first call of a module passes copies; later ones donate the ATen
    matmul's result to the scatter), odd sizes, repeated tokens. Matmuls go to ATen, so
    that the projection's gradient reaches the scatter as an ATen result. With `also_read`
    a second use of the weight adds to that gradient in IREE first: nothing to donate."""
    monkeypatch.setenv("BOO_ATEN_MATMUL", "1")
    vocab, width, batch, length = shape
    torch.manual_seed(0)
    model = TiedLM(vocab, width, also_read)
    batches = [(_tokens(batch, length, vocab, s), _tokens(batch, length, vocab, s + 10).reshape(-1)) for s in range(3)]
    boo_backend.reset()
    with caplog.at_level(logging.DEBUG, logger="boo_backend"):
        compare_training(model, batches, F.cross_entropy, steps=4)
    donated = [r.getMessage() for r in caplog.records if "passed without a copy" in r.getMessage()]
    assert bool(donated) == (not also_read), donated
    assert all(p.island == 0 for p in boo_backend.placements())


def test_donated_argument_is_never_a_callers_tensor(monkeypatch):
    """In a graph cut around an ATen matmul, a graph input that the module scatters into
    stays as the caller had it, call after call."""
    monkeypatch.setenv("BOO_ATEN_MATMUL", "1")
    boo_backend.reset()

    def fn(x, idx, v, a, b):
        return aten.index_put(x, [idx], v, True) + (a @ b).sum()

    x, a, b = torch.randn(300, 33), torch.randn(40, 50), torch.randn(50, 33)
    keep = x.clone()
    idx = torch.tensor([1, 1, 299])
    v = torch.randn(3, 33)
    compiled = torch.compile(fn, backend="boo")
    for _ in range(3):
        out = compiled(x, idx, v, a, b)
        assert_close(out, fn(keep, idx, v, a, b), "out")
        assert torch.equal(x, keep)
    assert all(p.aten > 0 for p in boo_backend.placements())


def test_tied_embedding_with_dynamic_sizes_matches_eager(monkeypatch, caplog):
    """One symbolic graph serves every batch and length: the rewrite adds no guard (a guard
    would make boo compile per shape), and the values match eager at each size."""
    monkeypatch.setenv("BOO_ATEN_MATMUL", "1")
    vocab, width = 517, 72
    torch.manual_seed(0)
    model = TiedLM(vocab, width)
    ref = TiedLM(vocab, width)
    ref.load_state_dict(model.state_dict())
    boo_backend.reset()
    compiled = torch.compile(model, backend="boo", dynamic=True)
    caplog.set_level(logging.DEBUG, logger="boo_backend")
    for batch, length in [(2, 9), (3, 70), (5, 131)]:
        tokens = _tokens(batch, length, vocab, batch)
        for m, run in ((model, compiled), (ref, ref)):
            m.zero_grad()
            F.cross_entropy(run(tokens), tokens.reshape(-1)).backward()
        assert_close(model.emb.weight.grad, ref.emb.weight.grad, f"weight grad at {batch}x{length}")
    backward = [p for p in boo_backend.placements() if p.kind == "backward"]
    assert backward and all(p.dynamic for p in backward), [p.line() for p in backward]
    assert all(p.island == 0 for p in boo_backend.placements())
    said = [r.getMessage() for r in caplog.records]
    assert any("fused the chains" in m for m in said) and any("passed without a copy" in m for m in said)


def _nll_then_log_softmax_backward(out, idx, w):
    grad = aten.scatter.value(torch.zeros_like(out), 1, idx, -1.0) * w
    return aten._log_softmax_backward_data.default(grad, out, 1, out.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_backward_becomes_one_elementwise_pass(dtype):
    torch.manual_seed(0)
    out = torch.log_softmax(torch.randn(67, 1031, dtype=torch.float64) * 3, 1)
    idx = torch.randint(0, 1031, (67, 1))
    w = torch.where(torch.rand(67, 1) < 0.2, 0.0, torch.rand(67, 1) + 0.5).to(torch.float64)  # ignored rows: 0
    gm = _graph(_nll_then_log_softmax_backward, out.to(dtype), idx, w.to(dtype))
    fused = fusions.apply(gm)
    assert fused is not gm
    left = {n.target for n in fused.graph.nodes if n.op == "call_function"}
    assert aten.scatter.value not in left and aten._log_softmax_backward_data.default not in left, fused.code
    ref = _nll_then_log_softmax_backward(out, idx, w)
    assert_close(fused(out.to(dtype), idx, w.to(dtype)), ref.to(dtype), "fused")


@pytest.mark.parametrize("case", ["bfloat16", "weight_per_class", "two_per_row"])
def test_cross_entropy_backward_left_alone(case):
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    out = torch.log_softmax(torch.randn(9, 13), 1).to(dtype)
    idx = torch.randint(0, 13, (9, 2 if case == "two_per_row" else 1))
    w = torch.rand(1, 13) if case == "weight_per_class" else torch.rand(9, 1)
    gm = _graph(_nll_then_log_softmax_backward, out, idx, w.to(dtype))
    assert fusions.apply(gm) is gm


class _WithLoss(nn.Module):
    def __init__(self, reduction: str):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 1031))
        self.reduction = reduction

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y, reduction=self.reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_training_with_ignored_targets_matches_eager(reduction, caplog):
    """A classifier over 1031 classes with its F.cross_entropy inside the compiled module, a
    fifth of the targets ignored (-100), in strict mode, several SGD steps."""
    torch.manual_seed(0)
    ours, ref = _WithLoss(reduction), _WithLoss(reduction)
    ref.load_state_dict(ours.state_dict())
    run = torch.compile(ours, backend="boo")
    boo_backend.reset()
    caplog.set_level(logging.DEBUG, logger="boo_backend")
    for step in range(3):
        x = torch.randn(77, 48, generator=torch.Generator().manual_seed(step))
        y = torch.randint(0, 1031, (77,), generator=torch.Generator().manual_seed(step + 9))
        y[::5] = -100
        losses = []
        for module, call in ((ours, run), (ref, ref)):
            module.zero_grad()
            loss = call(x, y)
            loss.backward()
            losses.append(loss.detach())
        assert_close(losses[0], losses[1], f"loss at step {step}")
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, f"grad of {name} at step {step}")
        with torch.no_grad():
            for p, q in zip(ours.parameters(), ref.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    assert any("fused the chains ending in _log_softmax_backward_data" in r.getMessage() for r in caplog.records)
    assert all(p.island == 0 for p in boo_backend.placements())


def _halves_and_strides(x):
    """Slice backwards (what AOTAutograd writes for x[..., 8:], x[..., ::2] and the like): pieces
    written into one tensor of zeros, several times."""
    z = torch.zeros_like(x)
    out = aten.slice_scatter(z, x[..., 8:] * 2, -1, 0, 8) + aten.slice_scatter(z, -x[..., :8], -1, 8, 2**63 - 1)
    out = out + aten.slice_scatter(z, x[..., 1::2], -1, 0, None, 2) - aten.slice_scatter(z, x[..., ::2], -1, 1, 16, 2)
    full = aten.full.default(list(x.shape), 3, dtype=x.dtype)
    odd = aten.slice_scatter(full, x[:, 1::2], 1, 1, None, 2)  # 7 rows, a step of 2
    return out * 2 + aten.slice_scatter(full, x[:, 1:], 1, 0, -1) + aten.slice_scatter(full, x[:, -2:], 1, -2) + odd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_slices_written_into_a_fill_become_pads(dtype):
    x = (torch.randn(3, 7, 16) * 5).to(dtype)
    gm = _graph(_halves_and_strides, x)
    fused = fusions.apply(gm)
    assert fused is not gm and not _calls(fused, aten.slice_scatter.default), fused.code
    assert len(_calls(fused, aten.constant_pad_nd.default)) == 7 and len(_calls(fused, aten.where.ScalarOther)) == 3
    assert torch.equal(fused(x), _halves_and_strides(x))


def _masks(x):
    """Bool slices into fills of False and True (the fill's value stays a bool: a where with
    an int would promote)."""
    no, yes = torch.zeros_like(x), aten.full.default(list(x.shape), True, dtype=torch.bool)
    return aten.slice_scatter(no, x[..., 1::2], -1, 0, None, 2) | aten.slice_scatter(yes, x[..., :8], -1, 8)


def test_bool_slices_written_into_a_fill_become_pads():
    x = torch.randn(3, 7, 16) > 0
    fused = fusions.apply(_graph(_masks, x))
    assert not _calls(fused, aten.slice_scatter.default), fused.code
    out = fused(x)
    assert out.dtype == torch.bool and torch.equal(out, _masks(x))


@pytest.mark.parametrize("case", ["into_a_tensor", "other_dtype", "symbolic_start"])
def test_slices_written_elsewhere_are_left_alone(case):
    if case == "into_a_tensor":
        gm = _graph(lambda x, y: aten.slice_scatter(y, x[:, :2], 1, 0, 2), torch.randn(3, 5), torch.randn(3, 5))
    elif case == "other_dtype":  # slice_scatter casts the slice; a pad would not
        gm = _graph(lambda x: aten.slice_scatter(torch.zeros_like(x, dtype=torch.int64), x[:, :2], 1, 0, 2),
                    torch.randn(3, 5))
    else:  # a start the graph computes
        gm = make_fx(lambda x, y: aten.slice_scatter(torch.zeros_like(x), y, 0, -x.shape[0] // 2),
                     tracing_mode="symbolic")(torch.randn(6, 5), torch.randn(3, 5))
    assert fusions.apply(gm) is gm

