"""float64 math functions run in IREE on the CPU to float64 accuracy (issue 19): libm's
through a system-linked module (compile.Target.f64_flags), the rest in the forms rewrites.py
gives them. Checked against eager on wide ranges, small values and special values."""

import math

import pytest
import torch
import torch.nn.functional as F

import boo_backend

f64 = torch.float64
WIDE = torch.cat([torch.linspace(-30, 30, 1201, dtype=f64), torch.logspace(-300, 2, 301, dtype=f64),
                  -torch.logspace(-300, 2, 301, dtype=f64)])
UNIT = torch.linspace(-0.9999, 0.9999, 1001, dtype=f64)
POSITIVE = torch.logspace(-300, 300, 601, dtype=f64)
SPECIAL = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 0.5, -2.0], dtype=f64)

FUNCTIONS = {
    "tanh": (torch.tanh, WIDE), "exp": (torch.exp, WIDE), "log": (torch.log, POSITIVE),
    "sin": (torch.sin, WIDE), "cos": (torch.cos, WIDE), "tan": (torch.tan, WIDE),
    "erf": (torch.erf, WIDE), "sigmoid": (torch.sigmoid, WIDE), "log1p": (torch.log1p, torch.cat([WIDE.abs(), UNIT])),
    "expm1": (torch.expm1, WIDE), "sinh": (torch.sinh, WIDE), "cosh": (torch.cosh, WIDE),
    "asinh": (torch.asinh, WIDE), "atanh": (torch.atanh, UNIT), "acosh": (torch.acosh, 1 + POSITIVE),
    "asin": (torch.asin, UNIT), "acos": (torch.acos, UNIT), "atan": (torch.atan, WIDE),
    "log2": (torch.log2, POSITIVE), "log10": (torch.log10, POSITIVE), "exp2": (torch.exp2, WIDE),
    "softplus": (F.softplus, WIDE), "silu": (F.silu, WIDE),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), WIDE),
    "gelu": (F.gelu, torch.linspace(-3, 30, 661, dtype=f64)),
    "atan2": (lambda x: torch.atan2(x, x.flip(0)), WIDE),
    "pow": (lambda x: torch.pow(x.abs() + 0.5, x.flip(0) / 10), WIDE),
    # (|x| + 1e-100) ** -2: the square of a smaller x is subnormal, which IREE flushes to zero
    "pow_scalars": (lambda x: (x ** 3, x ** 0.5, (x.abs() + 1e-100) ** -2, x.abs() ** 1.7, 2.5 ** x,
                               (-2.0) ** x.round()), WIDE),
}


def _compiled(f, x):
    torch._dynamo.reset()
    boo_backend.reset()
    out = torch.compile(f, backend="boo")(x)
    assert all(p.island == 0 for p in boo_backend.placements()), [p.line() for p in boo_backend.placements()]
    return out


def _close(ours, ref, what, rtol=1e-12):
    assert ours.dtype == ref.dtype == f64
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)), f"{what}: NaNs differ"
    assert torch.equal(ours[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)]), f"{what}: infinities differ"
    # FTZ: IREE flushes subnormal results to zero; compare normal results only.
    normal = finite & (ref.abs() >= torch.finfo(f64).tiny)
    rel = ((ours - ref).abs() / ref.abs())[normal]
    assert rel.numel() == 0 or rel.max() <= rtol, f"{what}: {rel.max().item():.2e} relative"


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_float64_math_runs_in_iree_to_float64_accuracy(name):
    f, x = FUNCTIONS[name]
    ours, ref = _compiled(f, x), f(x)
    for i, (o, r) in enumerate(zip(*((ours, ref) if isinstance(ref, tuple) else ((ours,), (ref,))))):
        _close(o, r, f"{name}[{i}]")


@pytest.mark.parametrize("name", ["tanh", "exp", "log1p", "expm1", "sinh", "asinh", "erf", "atan2", "pow_scalars"])
def test_float64_math_special_values(name):
    f, _ = FUNCTIONS[name]
    ours, ref = _compiled(f, SPECIAL), f(SPECIAL)
    for o, r in zip(*((ours, ref) if isinstance(ref, tuple) else ((ours,), (ref,)))):
        assert torch.equal(torch.isnan(o), torch.isnan(r)), (o, r)
        exact = ~torch.isnan(r) & (torch.isinf(r) | (r == 0))
        assert torch.equal(o[exact], r[exact]), (o, r)
        assert torch.equal(torch.signbit(o[exact]), torch.signbit(r[exact])), (o, r)
        torch.testing.assert_close(o, r, rtol=1e-14, atol=0, equal_nan=True)


def test_float64_backward_through_math():
    """The backward of an f64 model with tanh, erf-gelu and log1p, against eager."""
    x = torch.randn(33, 7, dtype=f64, requires_grad=True)
    w = torch.randn(7, 5, dtype=f64, requires_grad=True)

    def f(x, w):
        h = torch.tanh(x @ w)
        return (F.gelu(h) + torch.log1p(h.square()) + torch.expm1(h / 3)).sum()

    torch._dynamo.reset()
    boo_backend.reset()
    loss = torch.compile(f, backend="boo")(x, w)
    gx, gw = torch.autograd.grad(loss, (x, w))
    rx, rw = torch.autograd.grad(f(x, w), (x, w))
    assert all(p.island == 0 for p in boo_backend.placements())
    torch.testing.assert_close(gx, rx, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [f64, torch.float32], ids=str)
def test_math_of_constants_in_float64(dtype):
    """A positional table built inside the graph (sin and cos of an arange, no input in it):
    IREE evaluates such constants while it compiles, in code that could not link libm's sin,
    and the whole module failed. float32's sin is computed in float64 too (f64.IN_F64)."""
    def f(x):
        angles = torch.arange(131, dtype=dtype)[:, None] * (0.37 ** torch.arange(3, dtype=dtype))
        return x * torch.sin(angles) + torch.cos(angles)

    x = torch.randn(131, 3, dtype=dtype)
    torch.testing.assert_close(_compiled(f, x), f(x))
