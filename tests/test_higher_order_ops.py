"""Higher-order ops reach IREE (issue 19): activation checkpointing around randomness,
nested_compile_region (invoke_subgraph), cond, a custom op that mutates its input
(auto_functionalized); while_loop is refused with a warning naming it."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import boo_backend
from boo_backend.config import BooFallbackWarning
from util import close_to_scale


def _all_in_iree():
    placed = boo_backend.placements()
    assert placed and all(p.island == 0 and not p.recovered for p in placed), [p.line() for p in placed]


def test_checkpointed_dropout_draws_the_same_mask_in_the_backward():
    """y = dropout(x) under checkpointing, loss = sum(y * c): dx must be c / (1 - p) exactly
    where y kept x and 0 elsewhere, so the recomputed mask is the forward's."""
    p = 0.3
    f = torch.compile(lambda x, c: (checkpoint(lambda t: F.dropout(t * 1.0, p, True), x, use_reentrant=False) * c).sum(),
                      backend="boo")
    masks = []
    for step in range(3):
        x = (torch.rand(67, 131) + 0.5).requires_grad_()
        c = torch.randn(67, 131)
        boo_backend.reset()
        with torch.no_grad():
            pass
        loss = f(x, c)
        loss.backward()
        kept = x.grad != 0
        torch.testing.assert_close(x.grad[kept], (c / (1 - p))[kept], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss, (x.detach() * kept * c / (1 - p)).sum(), rtol=1e-5, atol=1e-4)
        assert abs(kept.float().mean().item() - (1 - p)) < 0.02, "the kept fraction is not 1 - p"
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2]), "the same mask every step"


class Block(nn.Module):
    def __init__(self, d=64, heads=4, checkpointed=True):
        super().__init__()
        self.checkpointed = checkpointed
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))
        self.heads = heads

    def _inner(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, dropout_p=0.1 if self.training else 0.0)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, d)), 0.1, self.training)
        return x + self.mlp(self.ln2(x))

    def forward(self, x):
        return checkpoint(self._inner, x, use_reentrant=False) if self.checkpointed else self._inner(x)


def _saved_bytes(model, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    return total


def test_checkpointed_transformer_block_trains_in_iree_with_less_saved_memory():
    torch.manual_seed(0)
    model = Block()
    plain = Block(checkpointed=False)
    plain.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend="boo")
    compiled_plain = torch.compile(plain, backend="boo")
    x = torch.randn(3, 37, 64)
    boo_backend.reset()
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = compiled(x).square().mean()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    _all_in_iree()
    # with dropout off, checkpointed and plain give the same gradients
    model.eval(), plain.eval()
    plain.load_state_dict(model.state_dict())
    model.zero_grad(), plain.zero_grad()
    compiled(x).square().mean().backward()
    compiled_plain(x).square().mean().backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        close_to_scale(a.grad, b.grad, name)
    # Saved memory, on the graphs just compiled (checkpointing saves less in either mode).
    saved_checkpointed = _saved_bytes(compiled, x)
    saved_plain = _saved_bytes(compiled_plain, x)
    assert saved_checkpointed < 0.5 * saved_plain, (saved_checkpointed, saved_plain)


def test_nested_compile_region_is_inlined():
    @torch.compiler.nested_compile_region
    def layer(x, w):
        return torch.tanh(x @ w) + x

    def f(x, w):
        return layer(layer(x, w), w).sum()

    x, w = torch.randn(9, 70, requires_grad=True), torch.randn(70, 70, requires_grad=True)
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    boo_backend.reset()
    out = torch.compile(f, backend="boo")(x, w)
    out.backward()
    f(xr, wr).backward()
    close_to_scale(out, f(xr, wr).detach(), "output")
    close_to_scale(x.grad, xr.grad, "dx")
    close_to_scale(w.grad, wr.grad, "dw")
    _all_in_iree()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_takes_the_branch_the_predicate_picks(sign):
    def f(x, w):
        return torch.cond(x.sum() > 0, lambda x, w: (x @ w).sin(), lambda x, w: (x * 2).cos() @ w, (x, w))

    x = torch.rand(5, 8) * sign
    w = torch.randn(8, 3)
    boo_backend.reset()
    close_to_scale(torch.compile(f, backend="boo")(x, w), f(x, w), "cond")
    _all_in_iree()


def test_checks_in_the_branch_of_cond_not_taken_do_not_raise():
    """Both branches are computed; the one not taken must not raise what eager raises only
    when it runs (an index past the end, an integer division by zero), and the one taken
    still must. Nested too."""
    def index(x, i):
        return torch.cond(i.max() < x.shape[0], lambda x, i: x[i].sum(), lambda x, i: x.sum(), (x, i))

    def divide(a, b):
        return torch.cond((b == 0).any(), lambda a, b: a * 0, lambda a, b: a // b + torch.remainder(a, b), (a, b))

    def nested(x, i):
        inner = lambda x, i: torch.cond(i.min() >= 0, lambda x, i: x.index_select(0, i).sum(),  # noqa: E731
                                        lambda x, i: x.sum() * 2, (x, i))
        return torch.cond(i.max() < x.shape[0], inner, lambda x, i: -x.sum(), (x, i))

    x = torch.arange(37.0)
    for fn, good, bad in ((index, (x, torch.tensor([1, 36, 5])), (x, torch.tensor([1, 40]))),
                          (divide, (torch.tensor([5, -7, 9]), torch.tensor([2, 3, -4])),
                           (torch.tensor([5, -7, 9]), torch.tensor([2, 0, -4]))),
                          (nested, (x, torch.tensor([3, 30])), (x, torch.tensor([3, 99])))):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="boo")
        for args in (good, bad):
            assert torch.equal(compiled(*args), fn(*args)), fn.__name__
    torch._dynamo.reset()
    with pytest.raises(IndexError, match="out of range"):  # the branch taken still checks
        torch.compile(lambda x, i: torch.cond(i.min() >= 0, lambda x, i: x[i].sum(), lambda x, i: x.sum(), (x, i)),
                      backend="boo")(x, torch.tensor([1, 40]))
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.compile(lambda a, b: torch.cond((b == 0).all(), lambda a, b: a * 0, lambda a, b: a // b, (a, b)),
                      backend="boo")(torch.tensor([5, 7]), torch.tensor([0, 3]))


def test_a_custom_op_that_mutates_its_input_runs_as_a_named_island(monkeypatch):
    monkeypatch.setenv("BOO_STRICT", "0")

    @torch.library.custom_op("boo_test::scale_in_place", mutates_args=("x",))
    def scale_in_place(x: torch.Tensor, s: float) -> None:
        x.mul_(s)

    @scale_in_place.register_fake
    def _(x, s):
        return None

    def f(x):
        y = x + 1
        scale_in_place(y, 3.0)
        return y * 2, x

    x = torch.randn(17)
    before = x.clone()
    boo_backend.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, same = torch.compile(f, backend="boo")(x)
    torch.testing.assert_close(out, (before + 1) * 6)
    assert torch.equal(x, before)
    assert any("boo_test.scale_in_place" in str(w.message) for w in caught)
    placed = boo_backend.placements()
    assert placed[-1].island_ops == ("torch.boo_test.scale_in_place",), placed[-1].line()


def test_while_loop_is_refused_by_name(monkeypatch):
    from torch._higher_order_ops.while_loop import while_loop

    def f(x):
        return while_loop(lambda i, x: i < 5, lambda i, x: (i + 1, x * 2), (torch.tensor(0), x))[1]

    x = torch.randn(8)
    with pytest.raises(Exception, match="higher_order.while_loop cannot be lowered"):
        torch.compile(f, backend="boo")(x)
    torch._dynamo.reset()
    monkeypatch.setenv("BOO_STRICT", "0")
    with pytest.warns(BooFallbackWarning, match="while_loop"):
        out = torch.compile(f, backend="boo")(x)
    torch.testing.assert_close(out, x * 32)
