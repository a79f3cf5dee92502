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


_SOFTMAX = {"_softmax": aten._softmax.default, "_log_softmax": aten._log_softmax.default}


def _softmax_forward(shape, dtype, contiguous, variant):
    dim, half_to_float = variant
    return (rand(shape, dtype, contiguous, scale=3.0), dim, half_to_float), {}


def _softmax_backward(name):
    def make(shape, dtype, contiguous, variant):
        dim, upcast = variant
        inner = torch.float32 if upcast else dtype  # half_to_float: grad and output in f32
        y = _SOFTMAX[name](rand(shape, inner, scale=3.0), dim, False)
        if not contiguous and len(shape) >= 2:
            y = y.transpose(0, -1).contiguous().transpose(0, -1)
        return (rand(shape, inner, contiguous), y, dim, dtype), {}
    return make


def _low_precision_only(dtype, variant):
    return variant[1] is False or dtype is not torch.float32


def _half_only(dtype, variant):
    """torch's _log_softmax takes half_to_float for float16 inputs only."""
    return variant[1] is False or dtype is torch.float16


def _logsumexp(shape, dtype, contiguous, variant):
    dim, keepdim = variant
    return (rand(shape, dtype, contiguous, scale=3.0), [dim], keepdim), {}


def _rms_affine(shape, dtype, variant):
    weighted, rounded = variant
    n = shape[-1]
    return [n], (rand([n], dtype, shift=1.0) if weighted else None), (dtype if rounded else None)


def _rms_norm(shape, dtype, contiguous, variant):
    normalized, w, norm_dtype = _rms_affine(shape, dtype, variant)
    return (rand(shape, dtype, contiguous, scale=2.0, shift=0.3), normalized, w, 1e-6, norm_dtype, dtype), {}


def _rms_norm_backward(shape, dtype, contiguous, variant):
    normalized, w, norm_dtype = _rms_affine(shape, dtype, variant)
    x = rand(shape, dtype, contiguous, scale=2.0, shift=0.3)
    _, rstd = torch.ops.boo.rms_norm(x, normalized, w, 1e-6, norm_dtype, dtype)
    return (rand(shape, dtype, contiguous), x, rstd, normalized, w, norm_dtype), {}
def _group_norm_args(shape, dtype, contiguous, groups, weight, bias):
    """x of `shape` = [N, C, *spatial]; the group count is gcd(groups, C), so it divides C."""
    n, c = shape[0], shape[1]
    x = rand(shape, dtype, contiguous, scale=3.0, shift=0.5)
    w = rand([c], dtype, shift=1.0) if weight else None
    b = rand([c], dtype) if bias else None
    return x, w, b, n, c, math.prod(shape[2:]), math.gcd(groups, c)


def _group_norm(shape, dtype, contiguous, variant):
    _, groups, weight, bias = variant
    x, w, b, n, c, hxw, g = _group_norm_args(shape, dtype, contiguous, groups, weight, bias)
    return (x, w, b, n, c, hxw, g, 1e-5), {}


def _group_norm_backward(shape, dtype, contiguous, variant):
    _, groups, weight, mask = variant
    x, w, b, n, c, hxw, g = _group_norm_args(shape, dtype, contiguous, groups, weight, False)
    _, mean, rstd = aten.native_group_norm(x.contiguous(), w, b, n, c, hxw, g, 1e-5)
    return (rand(shape, dtype, contiguous), x, mean, rstd, w, n, c, hxw, g, mask), {}


def _batch_norm_args(shape, dtype, contiguous, weight, bias):
    c = shape[1]
    x = rand(shape, dtype, contiguous, scale=3.0, shift=0.5)
    w = rand([c], dtype, shift=1.0) if weight else None
    b = rand([c], dtype) if bias else None
    return x, w, b, rand([c], dtype, scale=0.1), rand([c], dtype, scale=0.1, shift=1.0).abs()


def _batch_norm_train(shape, dtype, contiguous, variant):
    _, weight, bias = variant
    x, w, b, rm, rv = _batch_norm_args(shape, dtype, contiguous, weight, bias)
    return (x, w, b, rm, rv, True, 0.1, 1e-5), {}


def _batch_norm_eval(shape, dtype, contiguous, variant):
    _, weight, bias = variant
    x, w, b, rm, rv = _batch_norm_args(shape, dtype, contiguous, weight, bias)
    return (x, w, b, rm, rv, 0.1, 1e-5), {}


def _batch_norm_backward(shape, dtype, contiguous, variant):
    """train: the saved statistics of a training forward; eval: the running ones, with the
    empty saved statistics that graphs pass."""
    train, weight, mask = variant
    x, w, b, rm, rv = _batch_norm_args(shape, dtype, contiguous, weight, False)
    if train == "train":
        _, sm, si, _, _ = aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)
    else:
        _, sm, si = aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)
    return (rand(shape, dtype, contiguous), x, w, rm, rv, sm, si, train == "train", 1e-5, mask), {}
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
    shapes: list  # every variant runs on the first; f32 runs each other shape once (see _cases)
    # Whether a variant applies to a dtype (half_to_float needs a low-precision input).
    valid: Callable = lambda dtype, variant: True
    # Arguments for the float64 reference call, from the float64 arguments.
    reference_args: Callable = lambda args: args
    # Eager's kernel checks that its input is contiguous (native_group_norm): the float64
    # reference and eager then run on contiguous copies, and only ours sees the views.
    eager_needs_contiguous: bool = False
    small: tuple = (3, 40)  # the shape of the forced-decomposition and dump tests
    strided: tuple = (7, 5)  # the shape of the non-contiguous test


# Widths that reduce in 16 lanes on the CPU (768), in 8 (1000), and in 16 lanes and then
# the row's last values (4097: one value; 1001: nine).
_WIDTHS = [(4, 1), (3, 3), (5, 768), (2, 1000), (3, 4097), (2, 1001), (0, 8)]
# [N, C, *spatial]: HxW of 1, 3 and 4097 (17 x 241) elements per channel, 4-D. Not an empty
# batch in training: eager raises (forward) or divides by zero (backward) there.
_BN_SHAPES = [(4, 8), (3, 5), (2, 6, 5, 7), (17, 3, 241), (3, 12, 1, 1)]
# [N, C, *spatial]: HxW of 1, groups of 3 (5x4x3 with 4 groups) and of 4097, 4-D, an empty
# batch. Not a group of one element: its output is exactly the bias (zero without one), and
# the float64 reference's rounding around zero is no scale to compare with.
_GN_SHAPES = [(4, 8), (5, 4, 3), (2, 6, 5, 7), (2, 2, 4097), (0, 8, 3), (3, 12, 1, 1)]
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
        # The last four have several row blocks in the column sums; with the variants taken
        # in turn, (96, 1001) and (72, 32) run the one-pass kernel (dx with dw and/or db).
        _WIDTHS + [(2, 3, 16), (96, 1001), (64, 48), (80, 32), (72, 32)],
    ),
    # variants: (with a weight, x * rstd rounded to the input's dtype before the weight)
    "rms_norm": Row(_rms_norm, [(True, False), (False, False), (True, True)], _WIDTHS + [(2, 3, 16)],
                    reference_args=lambda args: (*args[:5], torch.float64)),
    "rms_norm_backward": Row(_rms_norm_backward, [(True, False), (False, False), (True, True)],
                             _WIDTHS + [(2, 3, 16)]),
    **{
        name: Row(_softmax_forward, [(-1, False), (0, False), (1, False), (-1, True)],
                  [(3, 7), (2, 3, 16)] + _WIDTHS, _half_only if name == "_log_softmax" else _low_precision_only,
                  lambda args: (args[0], args[1], False))  # half_to_float: float64 throughout
        for name in _SOFTMAX
    },
    **{
        f"{name}_backward_data": Row(_softmax_backward(name), [(-1, False), (0, False), (1, False), (-1, True)],
                                     [(3, 7), (2, 3, 16)] + _WIDTHS, _low_precision_only,
                                     lambda args: (*args[:3], torch.float64))
        for name in _SOFTMAX
    },
    # variants: (dim, keepdim)
    "logsumexp": Row(_logsumexp, [(-1, True), (0, False), (1, True), (-1, False)], [(3, 7), (2, 3, 16)] + _WIDTHS),
    # Variants lead with a name (_cases reads a leading int as layer norm's k).
    "native_group_norm": Row(
        _group_norm,
        [("affine", 2, True, True), ("plain", 4, False, False), ("weight", 3, True, False),
         ("one_group", 1, True, True)],
        _GN_SHAPES,
        eager_needs_contiguous=True,
    ),
    # Without a weight, eager computes dx alone (asked for dweight or dbias it raises).
    "native_group_norm_backward": Row(
        _group_norm_backward,
        [("all", 2, True, [True, True, True]), ("dx_plain", 4, False, [True, False, False]),
         ("dw_db", 2, True, [False, True, True]), ("dx_db", 3, True, [True, False, True]),
         ("dx_dw", 1, True, [True, True, False])],
        _GN_SHAPES,
        eager_needs_contiguous=True,
    ),
    "_native_batch_norm_legit_functional": Row(
        _batch_norm_train,
        [("affine", True, True), ("plain", False, False), ("weight", True, False)],
        _BN_SHAPES,
    ),
    "_native_batch_norm_legit_no_training": Row(
        _batch_norm_eval,
        [("affine", True, True), ("plain", False, False), ("bias", False, True)],
        _BN_SHAPES + [(0, 8, 3)],
    ),
    "native_batch_norm_backward": Row(
        _batch_norm_backward,
        [("train", True, [True, True, True]), ("train", False, [True, False, False]),
         ("train", True, [True, True, False]), ("train", True, [True, False, True]),
         ("eval", True, [True, True, True]), ("eval", False, [True, False, False]),
         ("eval", True, [True, True, False])],
        # Not output_mask[0] False: eager returns no dx there, its meta function (so ours) one.
        _BN_SHAPES,
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
    """Sampled to keep the suite's time: every variant on the row's first shape in float32
    and bfloat16, one in float16 (a different one per row), and (f32) every other shape
    once, with the variants taken in turn."""
    for r, (name, row) in enumerate(ROWS.items()):
        for dtype_name, dtype in DTYPES.items():
            variants = [v for v in row.variants if row.valid(dtype, v)]
            pairs = [(row.shapes[0], v) for v in variants]
            if dtype is torch.float16 and variants:
                pairs = [(row.shapes[0], variants[r % len(variants)])]
            if dtype is torch.float32:
                pairs += [(shape, variants[j % len(variants)]) for j, shape in enumerate(row.shapes[1:])]
            for shape, variant in pairs:
                k = variant[0] if isinstance(variant, tuple) and name.startswith("native_layer") else 0
                if len(shape) < k or (k and math.prod(shape[len(shape) - k:]) == 0):
                    continue  # layer norm over an empty normalized shape: see test_graphs
                yield pytest.param(name, dtype, shape, variant,
                                   id=f"{name}-{dtype_name}-{'x'.join(map(str, shape))}-{variant}")


def _to64(v):
    return v.double() if isinstance(v, torch.Tensor) else v


def rel_error(ours, ref):
    if ref.numel() == 0:
        return 0.0
    scale = ref.abs().max().item()
    return (ours.double() - ref).abs().max().item() / max(scale, 1e-30)


def allowed_error(dtype, eager_err):
    """The dtype's bound, loosened where eager's own result at this dtype is that far from
    float64. In f32 that error measures the problem's conditioning (a sum of a few terms
    that cancel, layer norm's dbias over a 4x1 input; RMS norm's dx over rows of one, which
    is gy * (1 - y^2) with y = +-1 in f32): boo may not be more than 2x worse than eager.
    In bf16/f16 eager often accumulates in low precision (its layer-norm dweight), so the
    loosening stops at 10x the bound."""
    if dtype is torch.float32:
        return max(REL_ERROR[dtype], 2 * eager_err)
    return max(REL_ERROR[dtype], min(4 * eager_err, 10 * REL_ERROR[dtype]))


def seed_for(*parts) -> int:
    """A seed that is the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode())


def _meta_results(op, args, kwargs) -> list:
    """The op's results as torch.compile's graph has them (fake tensors): the dtypes to
    expect, which can differ from the CPU kernel's (a half_to_float softmax backward)."""
    with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        out = op(*args, **kwargs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _moved(v, device):
    """Tensors (in nests) on `device`, strides kept; anything else as it is."""
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, (tuple, list)):
        return [_moved(x, device) for x in v] if isinstance(v, list) else tuple(_moved(x, device) for x in v)
    return v


# The composite is what is under test: attention's, at sizes where boo would weigh ATen's
# kernel against it (BOO_ATEN_MATMUL=auto), stays the composite.
_COMPOSITE_ONLY = {"aten_matmul": "never"}


def check_against_float64(name, dtype, shape, variant, contiguous=True, expect_composite=True, device="cpu"):
    """`device`: where boo runs the op. Inputs are made on the CPU and moved there; the
    references (float64 and eager at `dtype`) are computed on the CPU."""
    row = ROWS[name]
    torch.manual_seed(seed_for(name, shape, variant))
    args, kwargs = row.make(shape, dtype, contiguous, variant)
    op = composites.by_name(name).op
    on_device = {k: _moved(v, device) for k, v in kwargs.items()}

    def fn(*a):
        return op(*a, **on_device)

    boo_backend.reset()
    ours = _moved(torch.compile(fn, backend="boo", dynamic=False, options=_COMPOSITE_ONLY)(*_moved(args, device)), "cpu")
    if row.eager_needs_contiguous:
        args = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    ref = op(*row.reference_args([_to64(a) for a in args]), **{k: _to64(v) for k, v in kwargs.items()})
    try:
        eager = op(*args, **kwargs)
    except RuntimeError:  # half_to_float does not run on the CPU
        eager = None
    meta = _meta_results(op, args, kwargs)
    ours, ref, eager = ((v if isinstance(v, (tuple, list)) else (v,)) for v in (ours, ref, eager))
    for i, (a, b, m) in enumerate(zip(ours, ref, meta)):
        if b is None:
            assert a is None, f"output {i}: ours={a!r} | torch=None"
            continue
        assert a.shape == b.shape and a.dtype == m.dtype, f"output {i}: ours={a.shape}/{a.dtype} | torch={b.shape}/{m.dtype}"
        eager_err = 0.0 if eager[0] is None else rel_error(eager[i], b)
        err, bound = rel_error(a, b), allowed_error(dtype, eager_err)
        assert err < bound, f"{name} output {i}: relative error {err:.2e} >= {bound:.1e} (eager's: {eager_err:.1e})"
    used = sum(p.composites for p in boo_backend.placements())
    # A node whose one result is empty computes nothing: boo folds it to an empty tensor.
    if len(ref) == 1 and ref[0].numel() == 0:
        expect_composite = False
    assert used == (1 if expect_composite else 0), [p.line() for p in boo_backend.placements()]


@pytest.mark.parametrize("name,dtype,shape,variant", list(_cases()))
@pytest.mark.sweep(0.5)
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
                **{name: "dim_size" for name in ROWS if "softmax" in name or name == "logsumexp"},
                "rms_norm": "eps", "rms_norm_backward": "norm_dtype",
                "native_group_norm": "groups", "native_group_norm_backward": "output_mask",
                "_native_batch_norm_legit_functional": "momentum",
                "_native_batch_norm_legit_no_training": "eps", "native_batch_norm_backward": "train",
                "_scaled_dot_product_flash_attention_for_cpu": "kv_heads",
                "_scaled_dot_product_flash_attention_for_cpu_backward": "scale"}
    assert f"{expected.get(name, 'approximate')} = " in mlir.split("boo.params = {", 1)[1].split("}", 1)[0]


# Calls of logsumexp the kernel does not take. torch-mlir cannot lower the op, so each must
# reach torch's decomposition before the first import (no failed lowering, no retry).
_LSE_DECLINED = {
    "two_dims": (lambda x: torch.logsumexp(x, (0, 2), keepdim=True), (5, 7, 3), torch.float32),
    "float64": (lambda x: torch.logsumexp(x, -1), (5, 131), torch.float64),
    "zero_width": (lambda x: torch.logsumexp(x, -1), (5, 0), torch.float32),
    "zero_d": (lambda x: torch.logsumexp(x, 0), (), torch.float32),
}


@pytest.mark.parametrize("case", sorted(_LSE_DECLINED))
def test_logsumexp_calls_the_kernel_declines_are_decomposed_first(case, caplog):
    fn, shape, dtype = _LSE_DECLINED[case]
    torch.manual_seed(seed_for(case))
    x = rand(shape, dtype, scale=3.0).requires_grad_()
    boo_backend.reset()
    with caplog.at_level("DEBUG", logger="boo_backend"):
        out = torch.compile(fn, backend="boo", dynamic=False)(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
    x64 = x.detach().double().requires_grad_()
    ref = fn(x64)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x64)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-6, atol=1e-6)  # -inf over no values
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-6, atol=1e-6)
    assert "cannot lower" not in caplog.text
