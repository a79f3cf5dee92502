"""Convolutions with one output position whose window ends before the padded input does
(boo_backend/convolutions.py): IREE 3.13 fails to compile them, forward and backward, so a
RegNet's grouped 3x3, stride 2 convolution on a 2x2 map ran its whole graph in eager. boo
crops and pads the input to the window. Forward and backward in IREE, against a float64
eager reference, in fp32 and bf16, with no island."""

import pytest
import torch

import boo_backend
from util import layer_like_float64

CLASSES = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}
CASES = [
    # 2 + 2 padded, window 3, stride 2: one position, and a padded row it never reads.
    (1, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1), (2, 4, 2)),
    # RegNet's: grouped, on a 2x2 map.
    (2, dict(in_channels=8, out_channels=8, kernel_size=3, stride=2, padding=1, groups=4), (2, 8, 2, 2)),
    # Only the first dim has one position; its window leaves 2 input rows unread (cropped).
    (2, dict(in_channels=4, out_channels=6, kernel_size=(2, 3), stride=(3, 2)), (3, 4, 4, 7)),
    # Dilated: the window spans 5 of 7 padded rows (IREE compiles this one as it is too;
    # the rewrite must keep it right).
    (2, dict(in_channels=4, out_channels=4, kernel_size=3, stride=3, padding=1, dilation=2), (2, 4, 5, 5)),
    (3, dict(in_channels=2, out_channels=4, kernel_size=2, stride=2, bias=False), (1, 2, 3, 3, 4)),
    # The window reads padding only: the output is the bias, the input's gradient zero.
    (1, dict(in_channels=3, out_channels=3, kernel_size=2, stride=4, padding=2), (2, 3, 1)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, kwargs, shape", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_lone_window_forward_and_backward(dim, kwargs, shape, dtype):
    torch.manual_seed(0)
    layer = CLASSES[dim](**kwargs).to(dtype)
    ref = CLASSES[dim](**kwargs).double()
    ref.load_state_dict(layer.state_dict())
    boo_backend.reset()
    layer_like_float64(layer, ref, torch.compile(layer, backend="boo"), torch.randn(shape), dtype)
    placed = boo_backend.placements()
    assert {"forward", "backward"} <= {p.kind for p in placed}
    assert all(p.island == 0 and not p.recovered for p in placed), [p.line() for p in placed]


def test_lone_window_with_another_batch():
    """A second batch size compiles the graph with a symbolic batch; the map's sizes stay
    known, and so does the window."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.GELU(),
                                torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2))
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.GELU(),
                              torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)).double()
    ref.load_state_dict(model.state_dict())
    boo_backend.reset()
    run = torch.compile(model, backend="boo")
    for batch in (2, 3, 5):
        layer_like_float64(model, ref, run, torch.randn(batch, 3, 3, 3), torch.float32)
    placed = boo_backend.placements()
    assert all(p.island == 0 and not p.recovered for p in placed), [p.line() for p in placed]
