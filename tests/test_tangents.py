"""Outputs that no one differentiates (the logits returned beside a loss): boo's backward runs
without their zero gradients (boo_backend/tangents.py), with eager's gradients."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import boo_backend
from boo_backend import tangents
from util import assert_close, close_to_scale


class Head(nn.Module):
    """A loss with its logits and a second output, as Hugging Face's models return them."""

    def __init__(self, width=37, classes=131):
        super().__init__()
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        h = F.gelu(self.body(x))
        logits = self.head(h)
        return F.cross_entropy(logits, y), logits, h


def _grads(run, model, x, y, loss_of):
    model.zero_grad(set_to_none=True)
    loss_of(*run(x, y)).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh_placements():
    boo_backend.reset()


def _graph_names() -> set[str]:
    return {p.name for p in boo_backend.placements()}


def _backwards() -> tuple[set[str], set[str]]:
    """The names of the whole backward graphs that ran, and of their variants."""
    names = {n for n in _graph_names() if n.startswith("backward_")}
    variants = {n for n in names if "_z" in n}
    return names - variants, variants


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_of_the_loss_alone_skip_the_unused_outputs(dtype):
    """Only the loss is differentiated: the backward runs its variant without the logits' and
    the hidden state's tangents, at two batch sizes unlike each other (static shapes)."""
    torch.manual_seed(0)
    model = Head().to(dtype)
    ref = Head().double()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="boo", dynamic=False)
    g = torch.Generator().manual_seed(1)
    for rows in (67, 150):
        x = torch.randn(rows, 37, generator=g).to(dtype)
        y = torch.randint(0, 131, (rows,), generator=g)
        ours = _grads(compiled, model, x, y, lambda loss, logits, h: loss)
        want = _grads(ref, ref, x.double(), y, lambda loss, logits, h: loss)
        for i, (a, b) in enumerate(zip(ours, want)):
            close_to_scale(a.double(), b, f"grad {i} at {rows} rows", rel=1e-4 if dtype == torch.float32 else 3e-2)
    whole, variants = _backwards()
    assert variants and not whole, f"whole backward graphs {whole} ran; variants: {variants}"


def test_a_later_backward_through_every_output_uses_the_whole_graph():
    """A step that differentiates the logits too gets the graph with every tangent; a step
    after it with the loss alone returns to the variant. Gradients as eager's each time."""
    torch.manual_seed(0)
    model = Head()
    compiled = torch.compile(model, backend="boo", dynamic=False)
    x, y = torch.randn(67, 37), torch.randint(0, 131, (67,))
    losses = [lambda loss, logits, h: loss,
              lambda loss, logits, h: loss + logits.square().mean() + h.sin().sum(),
              lambda loss, logits, h: loss]
    for step, loss_of in enumerate(losses):
        ours = _grads(compiled, model, x, y, loss_of)
        want = _grads(model, model, x, y, loss_of)
        for i, (a, b) in enumerate(zip(ours, want)):
            assert_close(a, b, f"grad {i} at step {step}")
    whole, variants = _backwards()
    assert len(whole) == 1 and {f"{n}_z0" for n in whole} == variants, (whole, variants)


def test_two_backwards_through_one_graph_each_with_its_own_outputs():
    """retain_graph: the first backward differentiates the loss alone, the second the hidden
    state alone; the gradients add up as eager's."""
    torch.manual_seed(0)
    model = Head()
    compiled = torch.compile(model, backend="boo", dynamic=False)
    x, y = torch.randn(41, 37), torch.randint(0, 131, (41,))

    def grads(run):
        model.zero_grad(set_to_none=True)
        loss, logits, h = run(x, y)
        loss.backward(retain_graph=True)
        h.cos().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    grads(compiled)
    ours, want = grads(compiled), grads(model)
    for i, (a, b) in enumerate(zip(ours, want)):
        assert_close(a, b, f"grad {i}")
    whole, variants = _backwards()
    assert not whole and len(variants) == 2, (whole, variants)


def _traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def test_zeroed_graph_adds_nothing_where_the_tangent_was():
    """x + zeros is x (a -0.0 stays -0.0, as in eager, which adds nothing); other uses of the
    tangent see zeros; an addition that broadcasts or promotes keeps its zeros."""
    def bw(a, t, wide):
        return a * 2 + t, t * 3, t + a.sin(), wide + t[:1].to(torch.float64)

    a = torch.tensor([[-0.0, 1.5, -2.0], [0.25, -0.0, 7.0]])
    t = torch.randn(2, 3)
    wide = torch.randn(4, 3, dtype=torch.float64)
    gm = _traced(bw, a, t, wide)
    z = tangents.zeroed(gm, (1,))
    assert len([n for n in z.graph.nodes if n.op == "placeholder"]) == 2
    adds = [n for n in z.graph.nodes if n.target == torch.ops.aten.add.Tensor]
    assert len(adds) == 1, f"only the promoting, broadcasting addition stays: {z.graph}"
    got = z(a, wide)
    want = bw(a, torch.zeros(2, 3), wide)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"output {i}: ours={g} | torch={w}"
    # a * 2 + zeros would give +0.0; eager's gradient, which adds no zeros, keeps -0.0
    assert torch.equal(torch.signbit(got[0]), torch.signbit(a * 2))


def test_fill_gives_the_zeros_autograd_would_have_made():
    def bw(a, tangents, token):  # AOTAutograd's names: tangents_1; an effect token passes as None
        return a + tangents.t()

    gm = _traced(bw, torch.randn(3, 5), torch.randn(5, 3).t().contiguous().t(), None)
    assert tangents.positions(gm) == [1]
    filled = tangents.fill([torch.ones(3, 5), None, None], gm, tangents.positions(gm))
    assert filled[1].shape == (5, 3) and filled[1].stride() == (1, 5) and not filled[1].any()
    assert filled[2] is None


def test_symbolic_forward_keeps_its_tangents():
    """A graph with symbolic sizes leaves autograd's zeros as they are (a zero tangent needs a
    static shape): the whole backward runs, with eager's gradients, at a third size too."""
    torch.manual_seed(0)
    model = Head()
    compiled = torch.compile(model, backend="boo", dynamic=True)
    g = torch.Generator().manual_seed(2)
    for rows in (19, 67, 130):
        x, y = torch.randn(rows, 37, generator=g), torch.randint(0, 131, (rows,), generator=g)
        ours = _grads(compiled, model, x, y, lambda loss, logits, h: loss)
        want = _grads(model, model, x, y, lambda loss, logits, h: loss)
        for i, (a, b) in enumerate(zip(ours, want)):
            assert_close(a, b, f"grad {i} at {rows} rows")
    whole, variants = _backwards()
    assert whole and not variants, (whole, variants)
