"""boo's own decompositions (decompositions.FALLBACK) for ops that IREE or torch-mlir reject
in some graphs: each is forced from the first compile (the op put in UNLOWERED) and run in
IREE against float64 eager, forward and backward, static and dynamic, at several sizes.
And a decomposition that writes into a tensor is never used as it is."""

import logging

import pytest
import torch
import torch.nn.functional as F

import boo_backend
from boo_backend import graph, partition
from util import close_to_scale

aten = torch.ops.aten
REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# name: (op forced through its decomposition, function of (x, w), weight shape, input shapes)
CASES = {
    # Mamba's causal conv: depthwise, 4 taps, padded on both sides, then cut to the length
    "depthwise1d_causal": (aten.convolution.default,
                           lambda x, w: F.conv1d(x, w, padding=3, groups=x.shape[1])[..., :x.shape[-1]],
                           (24, 1, 4), [(2, 24, 37), (3, 24, 70), (2, 24, 131)]),
    "depthwise1d_stride_dilation": (aten.convolution.default,
                                    lambda x, w: F.conv1d(x, w, stride=2, padding=2, dilation=2, groups=x.shape[1]),
                                    (24, 1, 3), [(2, 24, 37), (3, 24, 70), (2, 24, 131)]),
    "depthwise2d": (aten.convolution.default, lambda x, w: F.conv2d(x, w, padding=1, groups=x.shape[1]),
                    (8, 1, 3, 3), [(2, 8, 17, 20), (3, 8, 30, 9), (1, 8, 67, 131)]),
    "pad": (aten.constant_pad_nd.default, lambda x, w: F.pad(x, (2, 1, 0, 3), value=0.5) * w,
            (1,), [(2, 5, 17, 20), (3, 5, 30, 9), (1, 5, 67, 131)]),
    "pad_and_crop": (aten.constant_pad_nd.default, lambda x, w: F.pad(x, (-1, 3, 2, -2)) * w,
                     (1,), [(2, 5, 17, 20), (3, 5, 30, 9), (1, 5, 67, 131)]),
}


class _WithWeight(torch.nn.Module):
    def __init__(self, fn, weight):
        super().__init__()
        self.fn, self.weight = fn, torch.nn.Parameter(weight)

    def forward(self, x):
        return self.fn(x, self.weight)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.sweep(0.5)
def test_decomposition_in_iree_against_float64(case, dtype, dynamic, monkeypatch):
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    op, fn, w_shape, shapes = CASES[case]
    assert op in partition.FALLBACK
    monkeypatch.setattr(graph, "UNLOWERED", graph.UNLOWERED | {op})
    boo_backend.reset()
    g = torch.Generator().manual_seed(len(case))
    layer = _WithWeight(fn, torch.randn(w_shape, generator=g).to(dtype))  # a parameter: static sizes
    run = torch.compile(layer, backend="boo", dynamic=dynamic)
    w = layer.weight
    w64 = w.detach().double().requires_grad_()
    for shape in shapes:
        x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
        x64 = x.detach().double().requires_grad_()
        ref = fn(x64, w64)
        grad = torch.randn(ref.shape, generator=g).to(dtype)
        ours = run(x)
        dx, dw = torch.autograd.grad(ours, (x, w), grad)
        dx64, dw64 = torch.autograd.grad(ref, (x64, w64), grad.double())
        what = f"{case} {dtype} {shape}"
        close_to_scale(ours, ref.to(dtype), f"{what} forward", rel=REL[dtype])
        close_to_scale(dx, dx64.to(dtype), f"{what} input gradient", rel=REL[dtype])
        close_to_scale(dw, dw64.to(dtype), f"{what} weight gradient", rel=REL[dtype] * 4)
    placed = boo_backend.placements()
    forwards = [p for p in placed if p.kind == "forward"]
    assert forwards and all(p.decomposed and not p.island_ops for p in forwards), [p.line() for p in placed]
    if dynamic:  # Dynamo may trace again (its own guards), but boo compiles no forward per shape
        assert all(p.dynamic for p in forwards), [p.line() for p in placed]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_decomposition_that_writes_into_a_tensor_is_not_used(dynamic, monkeypatch, caplog):
    """torch._decomp's constant_pad_nd copies its input into a slice of a filled tensor
    (prims.copy_to). Partitioned as if it were pure, that write was not ordered before the
    reads, and a dynamic Mamba conv gave errors of the results' own size. Such a decomposition
    is refused: the op runs as an eager island (static) or the graph compiles per shape."""
    monkeypatch.setenv("BOO_STRICT", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")
    monkeypatch.delitem(partition.FALLBACK, aten.constant_pad_nd.default)
    monkeypatch.setattr(graph, "UNLOWERED", graph.UNLOWERED | {aten.constant_pad_nd.default})
    boo_backend.reset()

    def fn(x):
        padded = F.pad(torch.tanh(x), (3, 3))
        return padded[..., :-3] * 2 + padded[..., 3:]

    run = torch.compile(fn, backend="boo", dynamic=dynamic)
    caplog.set_level(logging.DEBUG, logger="boo_backend")
    with torch.no_grad(), pytest.warns(boo_backend.BooFallbackWarning, match="constant_pad_nd runs as an eager"):
        for n in (37, 70, 131):
            x = torch.randn(2, 5, n)
            close_to_scale(run(x), fn(x), f"at {n}")
    assert "the decomposition of torch.aten.constant_pad_nd writes into a tensor" in caplog.text
    placed = boo_backend.placements()
    if dynamic:
        assert not any(p.dynamic for p in placed), [p.line() for p in placed]
    else:
        assert all("torch.aten.constant_pad_nd" in p.island_ops for p in placed), [p.line() for p in placed]
