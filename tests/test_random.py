"""Random ops draw from torch's generator (boo_backend/hops.py, SEEDED): each call of a graph
draws its seeds with torch's generator, and each random op draws from its own seed.
IREE's own generator started every module from one fixed seed: torch.manual_seed changed
nothing, and two graphs drew the same numbers (two dropouts on either side of a graph break
had the same mask at every step). The numbers are boo's, not eager's: the tests check that
the seed reproduces them, that streams are apart, and their distribution."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boo_backend


class _TwoDropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Dropout(0.5), nn.Dropout(0.5)

    def forward(self, x):
        a = self.first(x)
        torch._dynamo.graph_break()
        return a, self.second(x) + torch.rand_like(x)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_the_seed_reproduces_the_numbers_and_graphs_draw_apart(dynamic, monkeypatch):
    monkeypatch.setenv("BOO_STRICT", "1")
    torch._dynamo.reset()
    boo_backend.reset()
    run = torch.compile(_TwoDropouts().train(), backend="boo", dynamic=dynamic)
    for rows in (129, 301):
        x = torch.ones(rows, 37)
        torch.manual_seed(3)
        first, second = run(x)
        torch.manual_seed(3)
        again = run(x)
        assert torch.equal(first, again[0]) and torch.equal(second, again[1])
        torch.manual_seed(4)
        other = run(x)
        assert not torch.equal(first, other[0]) and not torch.equal(second, other[1])
        after = run(x)  # no seed set: the generator has moved on
        assert not torch.equal(other[0], after[0])
        kept, kept_too = first > 0, second >= 1  # rand_like alone is < 1
        assert 0.45 < kept.float().mean() < 0.55 and 0.45 < kept_too.float().mean() < 0.55
        agree = (kept == kept_too).float().mean()
        assert 0.45 < agree < 0.55, f"the two graphs' masks agree at {agree:.3f} of the elements"


def _moments(name, x):
    return {
        "rand": (lambda: torch.rand(x.shape, dtype=x.dtype), 0.5, math.sqrt(1 / 12), 0, 1),
        "rand_like": (lambda: torch.rand_like(x), 0.5, math.sqrt(1 / 12), 0, 1),
        "uniform_": (lambda: x.clone().uniform_(-1.0, 3.0), 1.0, math.sqrt(16 / 12), -1, 3),
        "randn": (lambda: torch.randn(x.shape, dtype=x.dtype), 0.0, 1.0, None, None),
        "normal_": (lambda: x.clone().normal_(2.0, 3.0), 2.0, 3.0, None, None),
        "exponential_": (lambda: x.clone().exponential_(2.0), 0.5, 0.5, 0, None),
        "bernoulli": (lambda: torch.bernoulli(torch.full_like(x, 0.3)), 0.3, math.sqrt(0.21), 0, 1),
        "dropout": (lambda: F.dropout(torch.ones_like(x), 0.25), 1.0, math.sqrt(1 / 3), 0, 1.34),
        "randint": (lambda: torch.randint(3, 10, x.shape), 6.0, math.sqrt(4.0), 3, 9),
    }[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["rand", "rand_like", "uniform_", "randn", "normal_", "exponential_",
                                  "bernoulli", "dropout", "randint"])
def test_random_ops_have_their_distribution(name, dtype, monkeypatch):
    """Mean, spread and range over 40000 draws, in IREE (strict), at the type eager gives."""
    monkeypatch.setenv("BOO_STRICT", "1")
    torch._dynamo.reset()
    x = torch.zeros(200, 200, dtype=dtype)
    draw, mean, std, low, high = _moments(name, x)
    torch.manual_seed(0)
    ours = torch.compile(lambda x: draw(), backend="boo")(x)
    theirs = draw()
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    ours = ours.double()
    assert abs(ours.mean() - mean) < 0.02 * max(std, 1), f"{name} mean {ours.mean():.4f}, expected {mean}"
    assert abs(ours.std() - std) < 0.03 * std, f"{name} std {ours.std():.4f}, expected {std}"
    if low is not None:
        assert ours.min() >= low
    if high is not None:
        assert ours.max() <= high and (ours.max() < high or name not in ("rand", "rand_like"))
    assert len(ours.unique()) > 1


def test_dropout_of_every_element_as_eager(monkeypatch):
    """p = 1 in training (F.dropout, or nn.Dropout's p set to 1 between calls): eager
    multiplies by 0, so NaN and inf give NaN and the gradient is 0. boo's compile divided
    by 1 - p and failed with a bare ZeroDivisionError."""
    monkeypatch.setenv("BOO_STRICT", "1")
    torch._dynamo.reset()
    x = torch.randn(5, 37)
    x[0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    x.requires_grad_()

    def f(x):
        return F.dropout(x, p=1.0, training=True) * 3 + 1

    ours, ref = torch.compile(f, backend="boo")(x), f(x)
    torch.testing.assert_close(ours, ref, equal_nan=True)
    torch.testing.assert_close(torch.autograd.grad(ours.sum(), x), torch.autograd.grad(ref.sum(), x))
    drop = nn.Dropout(0.5)
    compiled = torch.compile(drop, backend="boo")
    y = torch.rand(9, 130) + 1
    assert 0.3 < (compiled(y) == 0).float().mean() < 0.7
    drop.p = 1.0
    assert torch.equal(compiled(y), torch.zeros_like(y))
