"""Python floats under dynamic=True: Dynamo leaves them unspecialized (a global such as
math.pi, a float argument, a float made from a symbolic size), and AOTAutograd's
tensorify_python_scalars turns their arithmetic back into 0-d tensor ops, a division as
aten.true_divide.Tensor, an op torch-mlir cannot lower. boo decomposes it into div.Tensor
(its own CompositeImplicitAutograd kernel), so the graph stays one dynamic module with no
eager island (GPT-2's NewGELUActivation, `math.sqrt(2.0 / math.pi)`, failed in strict mode)."""

import math

import pytest
import torch

import boo_backend
from boo_backend.partition import decomposition_table
from util import assert_close

SIZES = (5, 17, 70, 131)


def _gelu_constant(x):  # math.pi: a graph input, 2.0 / pi a true_divide of two 0-d tensors
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _float_argument(x, scale):  # a float argument that changes per call, in the same module
    return x * math.sqrt(2.0 / scale) - scale / 4.0


def _from_sizes(x):  # floats computed from symbolic sizes
    return x * (1.0 / x.shape[0]) + x.shape[1] / 3.0


CASES = {
    "constant": (_gelu_constant, lambda n: (torch.randn(n, 8),)),
    "argument": (_float_argument, lambda n: (torch.randn(n, 8), 0.5 + n / 7)),
    "sizes": (_from_sizes, lambda n: (torch.randn(n, n + 3),)),
}


def test_true_divide_has_a_decomposition():
    table, missing = decomposition_table({"torch.aten.true_divide.Tensor"})
    assert not missing and torch.ops.aten.true_divide.Tensor in table


@pytest.mark.parametrize("case", sorted(CASES))
def test_float_arithmetic_stays_dynamic(case):
    fn, make = CASES[case]
    before = len(boo_backend.placements())
    run = torch.compile(fn, backend="boo", dynamic=True)
    torch.manual_seed(0)
    for n in SIZES:
        args = make(n)
        assert_close(run(*args), fn(*args), f"{case} at size {n}")
    placed = boo_backend.placements()[before:]
    assert placed, "boo compiled nothing"
    for p in placed:
        assert p.dynamic, f"{p.name} was compiled per shape: {p}"
        assert p.island == 0 and not p.island_ops, f"{p.name} has eager islands: {p}"


def test_float_arithmetic_backward():
    """The forward and backward graphs of a training step carry the same tensorified floats."""
    before = len(boo_backend.placements())
    run = torch.compile(_gelu_constant, backend="boo", dynamic=True)
    torch.manual_seed(0)
    for n in SIZES:
        x = torch.randn(n, 8)
        ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        run(ours).square().sum().backward()
        _gelu_constant(ref).square().sum().backward()
        assert_close(ours.grad, ref.grad, f"gradient at size {n}")
    placed = boo_backend.placements()[before:]
    assert {p.kind for p in placed} >= {"forward", "backward"}
    assert all(p.dynamic and not p.island_ops for p in placed), placed
