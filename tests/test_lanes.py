"""Row reductions in lanes (kernels/_helpers.mlir: lanes, row_sums): on the CPU the kernels
that reduce a row view it as [N / L, L] and sum L lanes at once; on a GPU they reduce across
the row as before. Speed is measured in bench/ (bench/RESULTS.md), never here: these tests
check which form each target gets, and test_composites checks the values at widths of each
form (768: 16 lanes, 1000: 8, 4097: 16 lanes over 4096 and the last value after them)."""

from __future__ import annotations

import re

import pytest
import torch

from test_gpu_targets import _lowered

ROWS_REDUCED = ["native_layer_norm", "rms_norm", "_softmax", "_log_softmax"]


def _kernel_mlir(name: str, width: int, target: str) -> str:
    return _lowered(name, torch.float32, target, shape=(64, width))


@pytest.mark.parametrize("name", ROWS_REDUCED)
@pytest.mark.parametrize("width,lanes", [(768, 16), (1000, 8), (4097, 16), (1001, 16)])
def test_cpu_kernels_reduce_rows_in_lanes(name, width, lanes):
    text = _kernel_mlir(name, width, "llvm-cpu")
    assert f"tensor<64x{width // lanes}x{lanes}xf32>" in text, f"{name} at width {width}: no {lanes}-lane view"
    tail = width % lanes  # reduced after the lanes, from a slice of the row's last values
    slices = re.findall(r"tensor.extract_slice %\w+\[0, (\d+)\] \[64, (\d+)\]", text)
    if tail:
        assert (str(width - tail), str(tail)) in slices, f"{name} at width {width}: no slice of the last {tail} values"
    else:
        assert not slices, f"{name} at width {width}: a tail where the lanes take the whole row"


@pytest.mark.parametrize("name", ROWS_REDUCED)
def test_gpu_kernels_reduce_across_the_row(name):
    assert "x48x16xf32" not in _kernel_mlir(name, 768, "cuda:sm_80")
