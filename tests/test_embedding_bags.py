"""EmbeddingBag forward and backward in IREE (boo_backend/bags.py), against float64 eager:
every mode, per_sample_weights, padding_idx, include_last_offset, 2-d input, empty bags,
at two numbers of entries through one dynamic module. Strict mode (conftest) proves that
no part ran in an eager island: before, only the plain sum's forward did."""

import pytest
import torch
import torch.nn.functional as F

import boo_backend
from util import close_to_scale

ROWS, DIM = 57, 6
CASES = {
    "sum": dict(mode="sum"),
    "mean": dict(mode="mean"),
    "max": dict(mode="max"),
    "sum_weighted": dict(mode="sum", weighted=True),
    "sum_padding": dict(mode="sum", padding_idx=4),
    "mean_padding": dict(mode="mean", padding_idx=4),
    "max_padding_last_offset": dict(mode="max", padding_idx=4, include_last_offset=True),
    "mean_2d": dict(mode="mean", two_d=True),
}


def _batch(n: int, gen: torch.Generator, case: dict):
    """n entries in bags of uneven sizes, two of them empty (one of them the last), with
    padding entries and repeated rows."""
    if case.get("two_d"):
        return torch.randint(0, ROWS, (n // 7, 7), generator=gen), None
    indices = torch.randint(0, ROWS, (n,), generator=gen)
    indices[::5] = 4
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: n // 4].add(1).tolist())
    offsets = [0, *cuts[:3], cuts[2], *cuts[3:], n]  # bag 3 empty, and the last one (from n)
    if case.get("include_last_offset"):
        offsets += [n]  # the end of the last bag
    return indices, torch.tensor(offsets)


# bf16: one case per kind of reduction
RUNS = [(case, torch.float32) for case in sorted(CASES)] + [
    (case, torch.bfloat16) for case in ("mean", "sum_weighted", "max")]


@pytest.mark.parametrize("case, dtype", RUNS, ids=[f"{c}-{str(d)[6:]}" for c, d in RUNS])
def test_embedding_bag_forward_and_backward(case, dtype, monkeypatch):
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    spec = dict(CASES[case])
    weighted = spec.pop("weighted", False)
    spec.pop("two_d", None)  # _batch reads it

    def fn(weight, indices, offsets, psw):
        return F.embedding_bag(indices, weight, offsets, per_sample_weights=psw, **spec)

    boo_backend.reset()
    run = torch.compile(fn, backend="boo", dynamic=True)
    gen = torch.Generator().manual_seed(11)
    for n in (70, 133):
        indices, offsets = _batch(n, gen, CASES[case])
        weight = torch.randn(ROWS, DIM, generator=gen).to(dtype).requires_grad_()
        psw = torch.rand(indices.numel(), generator=gen).to(dtype).requires_grad_() if weighted else None
        ours = run(weight, indices, offsets, psw)
        w64 = weight.detach().double().requires_grad_()
        p64 = psw.detach().double().requires_grad_() if weighted else None
        ref = fn(w64, indices, offsets, p64)
        grad = torch.randn(ref.shape, generator=gen)
        wanted = [weight] + ([psw] if weighted else [])
        got = torch.autograd.grad(ours, wanted, grad.to(dtype))
        expected = torch.autograd.grad(ref, [w64] + ([p64] if weighted else []), grad.double())
        rel = 1e-5 if dtype == torch.float32 else 2e-2
        close_to_scale(ours, ref.to(dtype), f"{case} {n} forward", rel=rel)
        for i, (a, b) in enumerate(zip(got, expected)):
            close_to_scale(a, b.to(dtype), f"{case} {n} gradient {i}", rel=rel)
    placed = boo_backend.placements()
    assert placed and not any(p.island_ops for p in placed), [p.line() for p in placed]
    assert all(p.dynamic for p in placed if p.kind == "forward"), [p.line() for p in placed]
