"""torch.cdist forward and backward in IREE (boo_backend/distances.py), against float64
eager: every p eager's kernel computes directly, the matmul form past 25 rows, a batch dim
that broadcasts, and distances of exactly 0, whose gradient eager's kernel makes 0.
_cdist_forward and _cdist_backward ran as eager islands before; strict mode (conftest)
proves they no longer do."""

import math

import pytest
import torch

import boo_backend
from util import close_to_scale


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf, 0.0])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_cdist_forward_and_backward(p, dynamic, monkeypatch):
    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = torch.compile(lambda a, b: torch.cdist(a, b, p=p), backend="boo", dynamic=dynamic)
    gen = torch.Generator().manual_seed(int(p) if math.isfinite(p) else 9)
    # (x1's shape, x2's shape): a broadcast batch, then more rows and another width
    for s1, s2 in (((2, 1, 7, 3), (3, 5, 3)), ((2, 3, 13, 5), (3, 11, 5))):
        x1, x2 = torch.randn(s1, generator=gen), torch.randn(s2, generator=gen)
        x2[..., 0, :] = x1[0, 0, 0]  # a distance of exactly 0 in every batch
        x1, x2 = x1.requires_grad_(), x2.requires_grad_()
        ours = run(x1, x2)
        a64, b64 = x1.detach().double().requires_grad_(), x2.detach().double().requires_grad_()
        ref = torch.cdist(a64, b64, p=p)
        grad = torch.randn(ref.shape, generator=gen)
        got = torch.autograd.grad(ours, (x1, x2), grad.float())
        expected = torch.autograd.grad(ref, (a64, b64), grad.double())
        close_to_scale(ours, ref.float(), f"p={p} {s1} forward", rel=1e-5)
        for a, b in zip(got, expected):
            close_to_scale(a, b.float(), f"p={p} {s1} backward", rel=1e-5)
    placed = boo_backend.placements()
    assert placed and not any(q.island_ops for q in placed), [q.line() for q in placed]


def test_cdist_by_matmul_past_25_rows():
    """p = 2 past 25 rows takes the matmul form, as eager does."""
    gen = torch.Generator().manual_seed(4)
    x1 = torch.randn(2, 37, 6, generator=gen, requires_grad=True)
    x2 = torch.randn(2, 29, 6, generator=gen, requires_grad=True)
    boo_backend.reset()
    torch._dynamo.reset()
    ours = torch.compile(torch.cdist, backend="boo")(x1, x2)
    ref = torch.cdist(x1, x2)
    grad = torch.randn(ref.shape, generator=gen)
    close_to_scale(ours, ref, "forward", rel=1e-5)
    for a, b in zip(torch.autograd.grad(ours, (x1, x2), grad), torch.autograd.grad(ref, (x1, x2), grad)):
        close_to_scale(a, b, "backward", rel=1e-4)
    placed = boo_backend.placements()
    assert placed and not any(q.island_ops for q in placed), [q.line() for q in placed]
