"""lgamma, digamma and trigamma (polygamma of order 1) as the arithmetic IREE computes:
torch-mlir lowers none of them and torch._decomp's entries are prims, so every graph with
a Gamma, Beta, Dirichlet, Poisson or binomial log-probability (torch.distributions) ran
them as eager islands, and so did their backwards (lgamma's is digamma, digamma's is
trigamma). TABLE is merged into decompositions.FALLBACK, and its ops are in
decompositions.UNLOWERED. A leaf: imports nothing from boo_backend.

Each is computed in float64 whatever its input (half and float32 results rounded once):
the series below lose float32's last digits to cancellation. For x below 1/2 each uses its
reflection formula; above, lgamma is Lanczos' approximation (g = 7, nine terms, about 1e-15
relative), digamma and trigamma step the argument up by 10 and take their asymptotic series.
Poles and infinities give what eager gives: lgamma is +inf at 0, the negative integers and
both infinities; digamma is -inf at +0, +inf at -0 and NaN at the negative integers and -inf;
trigamma is +inf at the poles (eager's own value there is a large finite number).
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

_LANCZOS = (0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313,
            -176.61502916214059, 12.507343278686905, -0.13857109526572012, 9.9843695780195716e-6,
            1.5056327351493116e-7)
_STEP = 10  # digamma and trigamma: the argument is stepped up this far before the series


def _f64(x):
    return x.to(torch.float64)


def _pole(x):
    """x at 0 or a negative integer."""
    return (x <= 0) & (x == torch.floor(x))


def _off_integer(x):
    """x less its nearest integer, in [-1/2, 1/2]: sin(pi x) is that one's up to its sign, and
    the reduction is exact, so a value next to a pole keeps its digits."""
    return x - torch.round(x)


def _folded(x):
    """(x in float64, where x is below 1/2, the argument each series takes: 1 - x there, x
    elsewhere, an infinity as 1 (its result is set apart))."""
    v = _f64(x)
    low = v < 0.5
    y = torch.where(low, 1 - v, v)
    return v, low, torch.where(torch.isinf(y), 1.0, y)


def _lanczos(y):
    """lgamma(y) for y >= 1/2."""
    z = y - 1
    a = torch.full_like(z, _LANCZOS[0])
    for i, c in enumerate(_LANCZOS[1:], 1):
        a = a + c / (z + i)
    t = z + 7.5
    return 0.5 * math.log(2 * math.pi) + (z + 0.5) * torch.log(t) - t + torch.log(a)


def lgamma(x):
    if not x.dtype.is_floating_point:
        return NotImplemented
    v, low, y = _folded(x)
    big = _lanczos(y)
    reflected = math.log(math.pi) - torch.log(torch.abs(torch.sin(math.pi * _off_integer(v)))) - big
    out = torch.where(low, reflected, big)
    out = torch.where((v == 1) | (v == 2), 0.0, out)
    out = torch.where(_pole(v) | torch.isinf(v), math.inf, out)
    return out.to(x.dtype)


def _stepped(y, power: int):
    """(sum over k < _STEP of 1 / (y + k)^power, y + _STEP)."""
    total = torch.zeros_like(y)
    for k in range(_STEP):
        total = total + 1 / (y + k) ** power
    return total, y + _STEP


def digamma(x):
    if not x.dtype.is_floating_point:
        return NotImplemented
    v, low, y = _folded(x)
    steps, w = _stepped(y, 1)
    w2 = 1 / (w * w)
    series = torch.log(w) - 0.5 / w - w2 * (1 / 12 - w2 * (1 / 120 - w2 * (1 / 252 - w2 * (1 / 240 - w2 / 132))))
    big = series - steps
    r = math.pi * _off_integer(v)  # cot(pi x) has period 1
    reflected = big - math.pi * torch.cos(r) / torch.sin(r)
    out = torch.where(low, reflected, big)
    out = torch.where(_pole(v), math.nan, out)
    out = torch.where(v == 0, torch.where(1 / v < 0, math.inf, -math.inf), out)  # -0's sign, as 1 / -0
    out = torch.where(v == math.inf, math.inf, torch.where(v == -math.inf, math.nan, out))
    return out.to(x.dtype)


def trigamma(x):
    v, low, y = _folded(x)
    steps, w = _stepped(y, 2)
    w1 = 1 / w
    w2 = w1 * w1
    series = w1 + w2 / 2 + w1 * w2 * (1 / 6 - w2 * (1 / 30 - w2 * (1 / 42 - w2 / 30)))
    big = series + steps
    reflected = math.pi ** 2 / torch.sin(math.pi * _off_integer(v)) ** 2 - big
    out = torch.where(low, reflected, big)
    out = torch.where(_pole(v), math.inf, out)
    out = torch.where(v == math.inf, 0.0, torch.where(v == -math.inf, math.nan, out))
    return out.to(x.dtype)


def polygamma(n, x):
    if n == 0:
        return digamma(x)
    if n == 1 and x.dtype.is_floating_point:
        return trigamma(x)
    return NotImplemented


TABLE = {
    aten.lgamma.default: lgamma,
    aten.digamma.default: digamma,
    aten.polygamma.default: polygamma,
}
