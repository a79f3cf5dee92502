"""Pooling forward and backward in IREE against float64 eager: average pooling with ceil_mode
(torch-mlir's lowering fails where a stride is 1 and is wrong with symbolic sizes), the
backward of average pooling in 2 and 3 dims, adaptive average pooling's backward (an eager
island in every training graph) and 3d max pooling's backward, none of which torch-mlir
lowers; adaptive average pooling of bf16 summed its windows in bf16; adaptive max pooling's
backward, average pooling of an input with no batch dim, and replicate padding's backward. Strict mode proves that no part ran as an eager island."""

import pytest
import torch
import torch.nn.functional as F

import boo_backend
from util import close_to_scale

# name: (function, input shapes: the first traced, then odd ones past 64 and 128)
CASES = {
    "avg1d_pad_exclude": (lambda x: F.avg_pool1d(x, 3, 2, padding=1, ceil_mode=True, count_include_pad=False),
                          [(2, 5, 38), (3, 5, 71), (2, 5, 131)]),
    "avg2d": (lambda x: F.avg_pool2d(x, 3, 2, ceil_mode=True), [(2, 3, 17, 20), (3, 3, 30, 21), (2, 3, 67, 131)]),
    "avg2d_pad_exclude": (lambda x: F.avg_pool2d(x, 3, 2, padding=1, ceil_mode=True, count_include_pad=False),
                          [(2, 3, 17, 20), (3, 3, 30, 21), (2, 3, 67, 131)]),
    # Funnel's pooling: a stride of 1 along the width, where torch-mlir's lowering fails to compile
    "avg2d_stride_1": (lambda x: F.avg_pool2d(x[:, None], (2, 1), (2, 1), ceil_mode=True)[:, 0],
                       [(3, 37, 64), (2, 101, 64), (4, 130, 64)]),
    "avg2d_divisor": (lambda x: F.avg_pool2d(x, 3, 3, padding=1, ceil_mode=True, divisor_override=5),
                      [(2, 3, 17, 20), (3, 3, 30, 21)]),
    "avg2d_floor": (lambda x: F.avg_pool2d(x, 3, 2, padding=1, count_include_pad=False), [(2, 3, 17, 20), (3, 3, 67, 21)]),
    "avg3d": (lambda x: F.avg_pool3d(x, 2, 2, ceil_mode=True), [(2, 3, 5, 7, 9), (3, 2, 8, 9, 11)]),
    "max3d": (lambda x: F.max_pool3d(x, 2, 2), [(2, 3, 5, 7, 9), (3, 2, 8, 9, 11)]),
    # windows of unequal sizes where the input does not divide (11 into 2: 6 and 6, overlapping)
    "adaptive_avg1d": (lambda x: F.adaptive_avg_pool1d(x, 5), [(2, 5, 38), (3, 5, 131)]),
    "adaptive_avg2d": (lambda x: F.adaptive_avg_pool2d(x, (2, 7)), [(2, 3, 11, 20), (3, 3, 67, 21), (2, 3, 130, 67)]),
    "adaptive_avg3d": (lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)), [(2, 3, 5, 7, 9), (3, 2, 8, 9, 11)]),
    # windows that overlap unevenly (6 into 4, 67 into 3): torch-mlir's lowering fails there
    "adaptive_max2d": (lambda x: F.adaptive_max_pool2d(x, (4, 3)), [(2, 3, 6, 12), (3, 3, 68, 67)]),
    # no batch dim: torch-mlir lowers avg_pool2d of 4-d inputs only (avg_pool1d's goes through it)
    "avg1d_unbatched": (lambda x: F.avg_pool1d(x, 2), [(5, 38), (3, 131)]),
    # replicate padding's backward (torch-mlir lowers the forward only), a negative pad crops
    # windows of more than 64 positions spread their gradients by prefix sums; one larger
    # than the input (EfficientNet's pooler: a convolution of 3e12 flops before)
    "avg2d_large_window": (lambda x: F.avg_pool2d(x, (9, 11), (4, 2), (3, 1), ceil_mode=True),
                           [(2, 3, 37, 41), (3, 3, 67, 131)]),
    "avg2d_window_past_input": (lambda x: F.avg_pool2d(x, 40, ceil_mode=True), [(2, 5, 2, 2), (3, 5, 3, 5)]),
    "replicate_pad2d": (lambda x: F.pad(x, (1, 2, 3, -1), mode="replicate"), [(2, 3, 17, 20), (3, 3, 67, 21)]),
}
REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.sweep(0.5)
def test_pooling_forward_and_backward_in_iree(case, dtype, dynamic, monkeypatch):
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    fn, shapes = CASES[case]
    boo_backend.reset()
    run = torch.compile(fn, backend="boo", dynamic=dynamic)
    for shape in shapes:
        g = torch.Generator().manual_seed(sum(shape))
        x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
        x64 = x.detach().double().requires_grad_()
        ref = fn(x64)
        grad = torch.randn(ref.shape, generator=g).to(dtype)
        ours = run(x)
        (dx,) = torch.autograd.grad(ours, x, grad)
        (dx64,) = torch.autograd.grad(ref, x64, grad.double())
        what = f"{case} {dtype} {shape}"
        close_to_scale(ours, ref.to(dtype), f"{what} forward", rel=REL[dtype])
        close_to_scale(dx, dx64.to(dtype), f"{what} backward", rel=REL[dtype])
    placed = boo_backend.placements()
    assert placed and not any(p.island_ops for p in placed), [p.line() for p in placed]
    if dynamic:  # Dynamo may trace again (its own guards), but boo compiles no forward per shape
        forwards = [p for p in placed if p.kind == "forward"]
        assert forwards and all(p.dynamic for p in forwards), [p.line() for p in placed]


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_square_images_are_one_module_forward_and_backward(pool, monkeypatch):
    """Height and width of one symbol (square images, PoolFormer's pooling): the decomposed
    backward's strides are products of that symbol (s0*s1**2) that no node computes, and
    comparing them inside the retrace failed ('not tracked with proxy'), so the backward
    compiled once per shape."""
    monkeypatch.setenv("BOO_VERIFY", "off")
    fn = {"avg": lambda x: F.avg_pool2d(x, 3, 1, 1) - x, "max": lambda x: F.max_pool3d(x, 2, 2)}[pool]
    boo_backend.reset()
    run = torch.compile(fn, backend="boo", dynamic=True)
    for side in (16, 37, 70, 131) if pool == "avg" else (6, 9, 14):
        shape = (2, 4, side, side) if pool == "avg" else (2, 3, side, side, side)
        _like_float64(run, fn, shape, side, f"{pool} at {side}")
    placed = boo_backend.placements()
    assert {p.kind for p in placed} == {"forward", "backward"} and all(p.dynamic for p in placed), \
        [p.line() for p in placed]


def test_a_window_thousands_wide_over_a_small_plane():
    """EfficientNet's pooler: a window as wide as its 2560 channels, with ceil_mode, over the
    1 x 1 planes of a 32 x 32 image. ceil_mode's padding to the window's size asked IREE for
    134 GB (RESOURCE_EXHAUSTED); the window is cut to the plane. The second batch size runs
    with a symbolic batch, the plane's sizes still known."""
    fn = lambda x: F.avg_pool2d(x, 2560, ceil_mode=True)  # noqa: E731
    boo_backend.reset()
    run = torch.compile(fn, backend="boo")
    for shape in ((2, 2560, 1, 1), (3, 2560, 1, 1), (2, 96, 2, 3)):
        _like_float64(run, fn, shape, sum(shape), f"at {shape}")
    placed = boo_backend.placements()
    assert placed and not any(p.island_ops or p.recovered for p in placed), [p.line() for p in placed]


def _like_float64(run, fn, shape, seed, what):
    """`run` (compiled `fn`) on a random float32 input of `shape`, forward and backward,
    against `fn` in float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    ours, ref = run(x), fn(x64)
    grad = torch.randn(ref.shape, generator=g)
    (dx,) = torch.autograd.grad(ours, x, grad)
    (dx64,) = torch.autograd.grad(ref, x64, grad.double())
    close_to_scale(ours, ref.float(), f"{what} forward", rel=1e-5)
    close_to_scale(dx, dx64.float(), f"{what} backward", rel=1e-5)
