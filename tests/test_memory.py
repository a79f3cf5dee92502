"""The copies around IREE calls (memory.copy_into): bit-exact for every dtype and layout."""

import pytest
import torch

from boo_backend import memory

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


def _values(shape, dtype, g):
    x = torch.randn(shape, generator=g) * 40
    if dtype.is_complex:
        return torch.complex(x, x.flip(-1)).to(dtype)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["dense", "transposed", "sliced", "0-d", "empty", "expanded"])
def test_dense_copy_is_bit_exact_and_dense(dtype, layout):
    g = torch.Generator().manual_seed(0)
    base = _values((67, 131), dtype, g)
    t = {"dense": base, "transposed": base.t(), "sliced": base[3:60:2, 5:], "0-d": base[4, 7],
         "empty": base[:0], "expanded": base[:1].expand(5, 131)}[layout]
    out = memory.dense_copy(t)
    assert out.is_contiguous() and out.shape == t.shape and out.dtype == t.dtype
    assert out.numel() == 0 or out.data_ptr() != t.data_ptr()
    assert memory.same_bits(out, t.contiguous())


def test_copy_keeps_nan_payloads_and_negative_zeros():
    bits = torch.tensor([0x7FC00001, 0xFFC01234, 0x80000000, 0x7F800000], dtype=torch.int64).to(torch.int32)
    t = bits.view(torch.float32)
    assert torch.equal(memory.dense_copy(t).view(torch.int32), bits)


def test_copy_of_a_tensor_that_requires_grad_leaves_it_alone():
    x = torch.randn(300, requires_grad=True)
    out = memory.dense_copy(x[::3])
    assert not out.requires_grad
    torch.testing.assert_close(out, x.detach()[::3], rtol=0, atol=0)


def test_copy_into_writes_only_its_target():
    src = torch.randn(50, 40)
    out = torch.full((40, 50), 7.0).t()  # a strided target
    keep = src.clone()
    assert memory.copy_into(out, src) is out
    assert torch.equal(out, src) and torch.equal(src, keep)
