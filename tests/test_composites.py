"""Each composite alone, against a float64 reference, with and without composites.

One row per composite in ROWS: how to make its inputs, and its variants. A test fails if an
entry of the registry lacks a row or a template.
"""

import dataclasses
import math
import zlib
from typing import Callable

import pytest
import torch

import boo_backend
from boo_backend import composites, templates

aten = torch.ops.aten
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
REL_ERROR = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rand(shape, dtype, contiguous=True, scale=1.0, shift=0.0):
    """Random normal values (never zeros); non-contiguous ones are transposed views."""
    if contiguous or len(shape) < 2:
        return (torch.randn(shape) * scale + shift).to(dtype)
    return (torch.randn(list(reversed(shape))) * scale + shift).to(dtype).transpose(0, -1).transpose(1, -2) \
        if len(shape) > 2 else (torch.randn(shape[::-1]) * scale + shift).to(dtype).t()


def _gelu(shape, dtype, contiguous, approximate):
    return (rand(shape, dtype, contiguous, scale=2.0),), {"approximate": approximate}


def _gelu_backward(shape, dtype, contiguous, approximate):
    return (rand(shape, dtype, contiguous), rand(shape, dtype, contiguous, scale=2.0)), {"approximate": approximate}


def _ln_affine(shape, dtype, k, weight, bias):
    normalized = list(shape[len(shape) - k:])
    w = rand(normalized, dtype, shift=1.0) if weight else None
    b = rand(normalized, dtype) if bias else None
    return normalized, w, b


def _layer_norm(shape, dtype, contiguous, variant):
    k, weight, bias = variant
    normalized, w, b = _ln_affine(shape, dtype, k, weight, bias)
    return (rand(shape, dtype, contiguous, scale=3.0, shift=0.5), normalized, w, b, 1e-5), {}


def _layer_norm_backward(shape, dtype, contiguous, variant):
    k, weight, bias, mask = variant
    normalized, w, b = _ln_affine(shape, dtype, k, weight, bias)
    x = rand(shape, dtype, contiguous, scale=3.0, shift=0.5)
    _, mean, rstd = aten.native_layer_norm(x, normalized, w, b, 1e-5)
    return (rand(shape, dtype, contiguous), x, normalized, mean, rstd, w, b, mask), {}


def _attention_inputs(shape, dtype, contiguous, variant):
    """Shape (B, H, L, S, D); the variant names the options: "gqa" (half as many key heads),
    "causal", "scale", and a mask: "additive" [L, S], "full" [B, H, L, S] additive, "bool"
    (a boolean [B, 1, 1, S] mask as SDPA hands it on: 0 or -inf), "masked_row" (a [L, S]
    mask that hides every key from query row 0)."""
    b, h, lq, s, d = shape
    hk = h // 2 if "gqa" in variant else h

    def heads(b, h, n, d):
        """Non-contiguous ones laid out [B, L, H, D], as a projection's output is; eager's
        CPU kernel assumes a unit stride along D (and is wrong without it)."""
        return rand([b, h, n, d], dtype) if contiguous else rand([b, n, h, d], dtype).transpose(1, 2)

    q, k, v = heads(b, h, lq, d), heads(b, hk, s, d), heads(b, hk, s, d)
    kwargs = {"scale": 0.3} if "scale" in variant else {}
    if "additive" in variant:
        kwargs["attn_mask"] = rand([lq, s], dtype, scale=2.0)
    if "full" in variant:
        kwargs["attn_mask"] = rand([b, h, lq, s], dtype)
    if "bool" in variant or "masked_row" in variant:
        keep = torch.rand([b, 1, 1, s]) > 0.4 if "bool" in variant else torch.rand([lq, s]) > 0.4
        keep[..., 0] = keep[..., -1] = True  # keys every row sees ...
        if "masked_row" in variant:
            keep[0] = False  # ... but row 0, which sees none: eager gives it 0s
        kwargs["attn_mask"] = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).to(dtype)
    return [q, k, v, 0.0, "causal" in variant], kwargs


def _attention(shape, dtype, contiguous, variant):
    args, kwargs = _attention_inputs(shape, dtype, contiguous, variant)
    return tuple(args), kwargs


def _attention_backward(shape, dtype, contiguous, variant):
    (q, k, v, dropout_p, causal), kwargs = _attention_inputs(shape, dtype, contiguous, variant)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, causal, **kwargs)
    grad = rand(out.shape, dtype) if contiguous else rand(list(out.transpose(1, 2).shape), dtype).transpose(1, 2)
    return (grad, q, k, v, out, lse, dropout_p, causal), kwargs


@dataclasses.dataclass
class Row:
    make: Callable  # (shape, dtype, contiguous, variant) -> (args, kwargs)
    variants: list
    shapes: list  # shapes for f32; low precision uses the first two
    small: tuple = (3, 40)  # the shape of the forced-decomposition and dump tests
    strided: tuple = (7, 5)  # the shape of the non-contiguous test


_WIDTHS = [(4, 1), (3, 3), (2, 1000), (3, 4097), (0, 8)]
ROWS = {
    "gelu": Row(_gelu, ["none", "tanh"], [(8, 3), (1000,), (3, 4097), (2, 3, 5), (0, 4)]),
    "gelu_backward": Row(_gelu_backward, ["none", "tanh"], [(8, 3), (1000,), (3, 4097), (2, 3, 5), (0, 4)]),
    "native_layer_norm": Row(
        _layer_norm,
        [(1, True, True), (1, False, False), (1, True, False), (2, True, True)],
        _WIDTHS + [(2, 3, 16)],
    ),
    "native_layer_norm_backward": Row(
        _layer_norm_backward,
        [(1, True, True, [True, True, True]), (1, False, False, [True, False, False]),
         (1, True, True, [False, True, True]), (1, True, False, [True, True, False]),
         (2, True, True, [True, True, True])],
        _WIDTHS + [(2, 3, 16)],
    ),
}
_ATTENTION_VARIANTS = ["none", "causal", "additive", "bool", "full_scale", "gqa", "gqa_causal_additive",
                       "causal_bool_scale", "masked_row"]
_ATTENTION_SHAPES = [(2, 4, 17, 17, 8), (1, 2, 3, 1, 64), (2, 2, 1, 17, 8), (1, 4, 33, 20, 16), (0, 4, 5, 9, 8)]
ROWS["_scaled_dot_product_flash_attention_for_cpu"] = Row(
    _attention, _ATTENTION_VARIANTS, _ATTENTION_SHAPES, small=(2, 4, 9, 5, 8), strided=(2, 4, 9, 5, 8))
# Where a query row sees a single key (S = 1, or L = 1 under a causal mask) its dq is 0 up to
# rounding, and a relative error measures nothing: the backward's shapes avoid that.
ROWS["_scaled_dot_product_flash_attention_for_cpu_backward"] = Row(
    _attention_backward, _ATTENTION_VARIANTS,
    [(2, 4, 17, 17, 8), (1, 2, 3, 5, 64), (1, 4, 33, 20, 16), (2, 2, 17, 3, 8), (0, 4, 5, 9, 8)],
    small=(2, 4, 9, 5, 8), strided=(2, 4, 9, 5, 8))


def test_every_composite_has_a_template_and_a_test_row():
    assert sorted(ROWS) == composites.names(), f"rows={sorted(ROWS)} | registry={composites.names()}"
    for entry in composites.REGISTRY.values():
        assert templates.exists(entry.template), f"{entry.name}: kernels/{entry.template} is missing"


def _cases():
    for name, row in ROWS.items():
        for dtype_name, dtype in DTYPES.items():
            shapes = row.shapes if dtype is torch.float32 else row.shapes[:2]
            for shape in shapes:
                for variant in row.variants:
                    k = variant[0] if isinstance(variant, tuple) else 0
                    if len(shape) < k or (k and math.prod(shape[len(shape) - k:]) == 0):
                        continue  # layer norm over an empty normalized shape: see test_graphs
                    yield pytest.param(name, dtype, shape, variant, id=f"{name}-{dtype_name}-{'x'.join(map(str, shape))}-{variant}")


def _to64(v):
    return v.double() if isinstance(v, torch.Tensor) else v


def rel_error(ours, ref):
    if ref.numel() == 0:
        return 0.0
    scale = ref.abs().max().item()
    return (ours.double() - ref).abs().max().item() / max(scale, 1e-30)


def allowed_error(dtype, eager_err):
    """The dtype's bound, loosened (at most 10x) where eager's own result at this dtype is
    that far from float64: a sum of a few terms that cancel (layer norm's dbias over a
    4x1 input) has a small result and a large relative rounding error in any order."""
    return max(REL_ERROR[dtype], min(4 * eager_err, 10 * REL_ERROR[dtype]))


def seed_for(*parts) -> int:
    """A seed that is the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode())


def check_against_float64(name, dtype, shape, variant, contiguous=True, expect_composite=True):
    row = ROWS[name]
    torch.manual_seed(seed_for(name, shape, variant))
    args, kwargs = row.make(shape, dtype, contiguous, variant)
    op = composites.by_name(name).op

    def fn(*a):
        return op(*a, **kwargs)

    boo_backend.reset()
    ours = torch.compile(fn, backend="boo", dynamic=False)(*args)
    ref = op(*[_to64(a) for a in args], **{k: _to64(v) for k, v in kwargs.items()})
    eager = op(*args, **kwargs)
    ours, ref, eager = ((v if isinstance(v, (tuple, list)) else (v,)) for v in (ours, ref, eager))
    for i, (a, b, e) in enumerate(zip(ours, ref, eager)):
        if b is None:
            assert a is None, f"output {i}: ours={a!r} | torch=None"
            continue
        assert a.shape == b.shape and a.dtype == e.dtype, f"output {i}: ours={a.shape}/{a.dtype} | torch={b.shape}/{e.dtype}"
        err, bound = rel_error(a, b), allowed_error(dtype, rel_error(e, b))
        assert err < bound, f"{name} output {i}: relative error {err:.2e} >= {bound:.1e} (eager's: {rel_error(e, b):.1e})"
    used = sum(p.composites for p in boo_backend.placements())
    # A node whose one result is empty computes nothing: boo folds it to an empty tensor.
    if len(ref) == 1 and ref[0].numel() == 0:
        expect_composite = False
    assert used == (1 if expect_composite else 0), [p.line() for p in boo_backend.placements()]


@pytest.mark.parametrize("name,dtype,shape,variant", list(_cases()))
def test_composite_matches_float64(name, dtype, shape, variant):
    check_against_float64(name, dtype, shape, variant)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_composite_non_contiguous_inputs(name):
    row = ROWS[name]
    shape = (6, 3, 16) if name.startswith("native") else row.strided
    check_against_float64(name, torch.float32, shape, row.variants[0], contiguous=False)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_forced_decomposition_matches_float64(name, monkeypatch, tmp_path):
    monkeypatch.setenv("BOO_FORCE_DECOMPOSE", name)
    monkeypatch.setenv("BOO_DUMP_DIR", str(tmp_path))
    row = ROWS[name]
    check_against_float64(name, torch.float32, row.small, row.variants[0], expect_composite=False)
    mlir = "\n".join(p.read_text() for p in tmp_path.rglob("*.mlir"))
    assert f"@boo.{name}." not in mlir and "boo.composite" not in mlir


@pytest.mark.parametrize("name", sorted(ROWS))
def test_dumped_module_names_its_composite(name, monkeypatch, tmp_path):
    monkeypatch.setenv("BOO_DUMP_DIR", str(tmp_path))
    row = ROWS[name]
    check_against_float64(name, torch.float32, row.small, row.variants[0])
    (mlir,) = [p.read_text() for p in tmp_path.rglob("*.mlir")]
    entry = composites.by_name(name)
    assert f"func.func private @boo.{name}.v{entry.version}." in mlir
    assert f'boo.composite = "{name}"' in mlir and f"boo.version = {entry.version} : i64" in mlir
    expected = {"gelu": "approximate", "native_layer_norm": "eps", "native_layer_norm_backward": "output_mask",
                "_scaled_dot_product_flash_attention_for_cpu": "kv_heads",
                "_scaled_dot_product_flash_attention_for_cpu_backward": "scale"}
    assert f"{expected.get(name, 'approximate')} = " in mlir.split("boo.params = {", 1)[1].split("}", 1)[0]
