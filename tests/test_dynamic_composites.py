"""Composites in graphs with dynamic shapes: one compiled module serves every size.

Each case compiles a small module with torch.compile(dynamic=True) and runs it on three
leading sizes (never 0 or 1, which Dynamo specializes), forward and backward, in f32 and
bf16, against a float64 eager reference (test_composites' error bounds). Every placement
must be dynamic, the case's composites must be among those placed, and no size after the
first may compile again. The sizes share no value with the other dims: Dynamo gives equal
sizes one symbol, and the next size would then recompile.
"""

import copy
import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import boo_backend
from test_composites import allowed_error, rel_error, seed_for

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
SIZES = (4, 7, 10)


class Fn(torch.nn.Module):
    """A module around a function of the inputs (a module, so that dtypes cast alike)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


class Attention(torch.nn.Module):
    """SDPA of queries [B, L, 32] and keys and values [B, S, kv_heads * 8] split into heads of
    8: the head counts and size are static (the views pin them), B, L and S dynamic."""

    def __init__(self, kv_heads=4, causal=False, masked=False):
        super().__init__()
        self.kv_heads, self.causal, self.masked = kv_heads, causal, masked

    def forward(self, q, k, v, *mask):
        b, lq, s = q.shape[0], q.shape[1], k.shape[1]
        q = q.view(b, lq, 4, 8).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, 8).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, is_causal=self.causal,
                                             enable_gqa=self.kv_heads != 4)
        return out.transpose(1, 2).reshape(b, lq, 32)


def _rand(*shape, scale=1.0, shift=0.0):
    return torch.randn(shape) * scale + shift


def _attention_inputs(masked, kv_heads=4):
    def make(n):
        lq, s = n + 1, n + 4
        qkv = [_rand(n, lq, 32), _rand(n, s, kv_heads * 8), _rand(n, s, kv_heads * 8)]
        return qkv + ([_rand(lq, s, scale=2.0)] if masked else [])
    return make


@dataclasses.dataclass
class Case:
    module: Callable[[], torch.nn.Module]
    inputs: Callable[[int], list]  # float32 inputs for leading size n
    composites: set  # composite names the placements must include
    differentiable: int = 1  # how many leading inputs get gradients (not an attention mask)


ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
CASES = {
    "gelu": Case(lambda: Fn(F.gelu), lambda n: [_rand(n, 5, 16, scale=2.0)], {"gelu", "gelu_backward"}),
    "gelu_tanh": Case(lambda: Fn(lambda x: F.gelu(x, approximate="tanh")), lambda n: [_rand(n, 16, scale=2.0)],
                      {"gelu", "gelu_backward"}),
    "layer_norm": Case(lambda: torch.nn.LayerNorm(16), lambda n: [_rand(n, 3, 16, scale=3.0, shift=0.5)],
                       {"native_layer_norm", "native_layer_norm_backward"}),
    # [n * 3, 160] rows: enough for the backward's column sums to run row blocks and a rest.
    "layer_norm_blocks": Case(lambda: torch.nn.LayerNorm(160), lambda n: [_rand(n * 30, 160, scale=3.0, shift=0.5)],
                              {"native_layer_norm", "native_layer_norm_backward"}),
    "softmax": Case(lambda: Fn(lambda x: F.softmax(x, -1)), lambda n: [_rand(n, 3, 16, scale=3.0)],
                    {"_softmax", "_softmax_backward_data"}),
    "softmax_dim1": Case(lambda: Fn(lambda x: F.softmax(x, 1)), lambda n: [_rand(n, 6, 5, scale=3.0)],
                         {"_softmax", "_softmax_backward_data"}),
    "log_softmax": Case(lambda: Fn(lambda x: F.log_softmax(x, -1)), lambda n: [_rand(n, 3, 16, scale=3.0)],
                        {"_log_softmax", "_log_softmax_backward_data"}),
    "rms_norm": Case(lambda: torch.nn.RMSNorm(16, eps=1e-6), lambda n: [_rand(n * 30, 16, scale=2.0, shift=0.3)],
                     {"rms_norm", "rms_norm_backward"}),
    "group_norm": Case(lambda: torch.nn.GroupNorm(4, 8), lambda n: [_rand(n, 8, 3, 5, scale=3.0, shift=0.5)],
                       {"native_group_norm", "native_group_norm_backward"}),
    "batch_norm": Case(lambda: torch.nn.BatchNorm2d(8), lambda n: [_rand(n, 8, 3, 5, scale=3.0, shift=0.5)],
                       {"_native_batch_norm_legit_functional", "native_batch_norm_backward"}),
    "batch_norm_eval": Case(lambda: torch.nn.BatchNorm1d(8).eval(), lambda n: [_rand(n, 8, 6, scale=3.0, shift=0.5)],
                            {"_native_batch_norm_legit_no_training", "native_batch_norm_backward"}),
    "attention": Case(Attention, _attention_inputs(False), ATTENTION, 3),
    "attention_gqa_causal": Case(lambda: Attention(kv_heads=2, causal=True), _attention_inputs(False, 2), ATTENTION, 3),
    "attention_masked": Case(lambda: Attention(masked=True), _attention_inputs(True), ATTENTION, 3),
}


def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    """Random non-zero parameters and running statistics (a fresh norm's are 1s and 0s)."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5 if "var" in name or "weight" in name else torch.randn_like(t) * 0.3)
    return module


def _run(module, inputs, differentiable, seed):
    """Outputs, input and parameter gradients, and buffers after one forward and a backward
    of a random gradient (drawn from `seed`)."""
    inputs = [x.detach().requires_grad_(i < differentiable) for i, x in enumerate(inputs)]
    out = module(*inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype))
    params = [p.grad for p in module.parameters()]
    grads = [x.grad for x in inputs[:differentiable]]
    for p in module.parameters():
        p.grad = None
    return [out.detach(), *grads, *params, *(b.clone() for b in module.buffers())]


def _check(name, what, ours, ref, eager, dtype):
    for i, (a, b, e) in enumerate(zip(ours, ref, eager)):
        if b is None or not b.is_floating_point():
            continue
        assert a.shape == b.shape and a.dtype == e.dtype, \
            f"{name} {what}[{i}]: ours={a.shape}/{a.dtype} | torch={b.shape}/{e.dtype}"
        err, bound = rel_error(a, b), allowed_error(dtype, rel_error(e, b))
        assert err < bound, f"{name} {what}[{i}]: relative error {err:.2e} >= {bound:.1e}"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.sweep(0.5)
def test_dynamic_composite_matches_float64(name, dtype):
    case = CASES[name]
    torch.manual_seed(seed_for(name, str(dtype)))
    base = _randomized(case.module())
    ours_module, eager_module, ref_module = (copy.deepcopy(base).to(d) for d in (dtype, dtype, torch.float64))
    compiled = torch.compile(ours_module, backend="boo", dynamic=True)
    boo_backend.reset()
    compiles = None
    for n in SIZES:
        inputs = [x.to(dtype) for x in case.inputs(n)]
        ours = _run(compiled, inputs, case.differentiable, n)
        eager = _run(eager_module, inputs, case.differentiable, n)
        ref = _run(ref_module, [x.double() for x in inputs], case.differentiable, n)
        _check(name, f"size {n}", ours, ref, eager, dtype)
        if compiles is None:
            compiles = boo_backend.stats().get("iree_compiles", 0)
    assert boo_backend.stats().get("iree_compiles", 0) == compiles, "a later size compiled again"
    placements = boo_backend.placements()
    lines = [p.line() for p in placements]
    assert placements and all(p.dynamic for p in placements), lines
    used = {composite for p in placements for composite, _ in p.composite_names}
    assert case.composites <= used, f"composites used: {sorted(used)} | expected: {sorted(case.composites)}; {lines}"


def test_symbolic_width_declines_without_a_guard(caplog):
    """A dim the kernel needs static (layer norm's width, given as a symbolic size) makes the
    composite decline, with its reason at debug level; the graph stays dynamic (no guard)."""
    caplog.set_level("DEBUG", logger="boo_backend")
    compiled = torch.compile(lambda x: F.layer_norm(x, x.shape[-1:]), backend="boo", dynamic=True)
    boo_backend.reset()
    for n in SIZES:
        x = _rand(n, 3, n + 9)
        torch.testing.assert_close(compiled(x), F.layer_norm(x, x.shape[-1:]))
    placements = boo_backend.placements()
    lines = [p.line() for p in placements]
    assert len(placements) == 1 and placements[0].dynamic and not placements[0].composites, lines
    assert "composite native_layer_norm declines native_layer_norm: normalized size: symbolic N" in caplog.text


def test_second_compile_of_automatic_dynamic_uses_composites():
    """dynamic=None: Dynamo's first graph is static, its second (another size) dynamic, and
    composites compute both."""
    module = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.GELU())
    compiled = torch.compile(module, backend="boo")
    boo_backend.reset()
    for n in SIZES:
        x = _rand(n, 16)
        torch.testing.assert_close(compiled(x), module(x))
    placements = boo_backend.placements()
    assert [p.dynamic for p in placements] == [False, True], [p.line() for p in placements]
    assert all({"native_layer_norm", "gelu"} <= {c for c, _ in p.composite_names} for p in placements)
