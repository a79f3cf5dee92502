"""Transposed convolutions, 1-d to 3-d, forward and backward in IREE (issue 19: DCGAN's
generator ran its backward as an eager island): stride, padding, output_padding, groups,
dilation, rectangular kernels, no bias. Checked against a float64 eager reference."""

import pytest
import torch

import boo_backend
from util import layer_like_float64

CASES = [
    (1, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1), (2, 4, 9)),
    (2, dict(in_channels=4, out_channels=6, kernel_size=4, stride=2, padding=1), (2, 4, 7, 5)),
    (2, dict(in_channels=5, out_channels=3, kernel_size=3, stride=1, padding=0), (3, 5, 11, 13)),
    (2, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1, groups=2,
             dilation=2), (2, 4, 6, 7)),
    (2, dict(in_channels=6, out_channels=3, kernel_size=(3, 2), stride=(2, 3), padding=(1, 0),
             output_padding=(1, 2), bias=False), (3, 6, 5, 4)),
    (3, dict(in_channels=2, out_channels=4, kernel_size=3, stride=2, padding=1, output_padding=1), (1, 2, 4, 5, 3)),
]
CLASSES = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d, 3: torch.nn.ConvTranspose3d}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, kwargs, shape", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_conv_transpose_forward_and_backward(dim, kwargs, shape, dtype):
    torch.manual_seed(0)
    layer = CLASSES[dim](**kwargs).to(dtype)
    ref = CLASSES[dim](**kwargs).double()
    ref.load_state_dict(layer.state_dict())
    boo_backend.reset()
    layer_like_float64(layer, ref, torch.compile(layer, backend="boo"), torch.randn(shape), dtype)
    placed = boo_backend.placements()
    assert {"forward", "backward"} <= {p.kind for p in placed}
    assert all(p.island == 0 for p in placed), [p.line() for p in placed]
