"""Hand-written chains become composites, forward and backward, with eager's numerics.

Each case trains the module one step under strict mode and compares with eager, then checks
the placements: the chain's composite ran in the forward graph and in the backward graph.
BOO_FORCE_DECOMPOSE naming the composite turns its patterns off; a chain a pattern must not
take (float64, a weight that broadcasts differently) is left alone and still right.
"""

import copy

import pytest
import torch
from transformers.activations import NewGELUActivation
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

import boo_backend
from util import assert_close


class RmsNormCall(torch.nn.Module):
    def __init__(self, n, weighted=True, eps=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n)) if weighted else None
        self.n, self.eps = n, eps

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, [self.n], self.weight, self.eps)


class ScalarFirstGelu(torch.nn.Module):
    """The tanh formula written with the constants on the other side."""

    def forward(self, x):
        inner = (x + torch.pow(x, 3.0) * 0.044715) * 0.7978845608028654
        return x * 0.5 * (torch.tanh(inner) + 1.0)


def _cases():
    yield "llama", lambda: LlamaRMSNorm(24, 1e-6), torch.float32, "rms_norm"
    yield "llama-bf16", lambda: LlamaRMSNorm(24, 1e-5).bfloat16(), torch.bfloat16, "rms_norm"
    yield "llama-f32-weight-bf16-input", lambda: LlamaRMSNorm(24, 1e-6), torch.bfloat16, "rms_norm"
    yield "t5", lambda: T5LayerNorm(24), torch.float32, "rms_norm"
    yield "t5-bf16", lambda: T5LayerNorm(24).bfloat16(), torch.bfloat16, "rms_norm"
    yield "t5-f32-weight-f16-input", lambda: T5LayerNorm(24), torch.float16, "rms_norm"
    yield "torch.rms_norm", lambda: RmsNormCall(24), torch.float32, "rms_norm"
    yield "torch.rms_norm-no-weight-default-eps", lambda: RmsNormCall(24, False), torch.bfloat16, "rms_norm"
    yield "new-gelu", lambda: NewGELUActivation(), torch.float32, "gelu"
    yield "new-gelu-scalars-right", lambda: ScalarFirstGelu(), torch.float32, "gelu"


CASES = {name: (make, dtype, composite) for name, make, dtype, composite in _cases()}


def _run(module, x, backend):
    x = x.clone().requires_grad_()
    run = module if backend is None else torch.compile(module, backend=backend, dynamic=False)
    out = run(x)
    grad = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    params = [x] + [p for p in module.parameters()]
    return out, torch.autograd.grad(out, params, grad)


def _composites_by_graph():
    return {p.name.split("_")[0]: p.composites for p in boo_backend.placements()}


def _module(make, dtype):
    torch.manual_seed(0)
    module = make()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    return module


@pytest.mark.parametrize("name", sorted(CASES))
def test_chain_becomes_a_composite_forward_and_backward(name):
    make, dtype, _ = CASES[name]
    module = _module(make, dtype)
    x = (torch.randn(3, 5, 24) * 2 + 0.1).to(dtype)
    boo_backend.reset()
    ours = _run(module, x, "boo")
    ref = _run(module, x, None)
    assert_close(ours[0], ref[0], "output", rtol=2e-2 if dtype != torch.float32 else None,
                 atol=2e-2 if dtype != torch.float32 else None)
    for i, (a, b) in enumerate(zip(ours[1], ref[1])):
        assert_close(a, b, f"grad {i}", rtol=3e-2 if dtype != torch.float32 else 1e-4,
                     atol=3e-2 if dtype != torch.float32 else 1e-4)
    used = _composites_by_graph()
    assert used.get("forward", 0) >= 1 and used.get("backward", 0) >= 1, [p.line() for p in boo_backend.placements()]


@pytest.mark.parametrize("name", ["llama", "t5", "torch.rms_norm", "new-gelu"])
def test_force_decompose_turns_the_pattern_off(name, monkeypatch):
    make, dtype, composite = CASES[name]
    monkeypatch.setenv("BOO_FORCE_DECOMPOSE", composite)
    module = _module(make, dtype)
    x = torch.randn(3, 5, 24)
    boo_backend.reset()
    ours = _run(module, x, "boo")
    ref = _run(module, x, None)
    assert_close(ours[0], ref[0], "output")
    assert sum(_composites_by_graph().values()) == 0, [p.line() for p in boo_backend.placements()]


def test_float64_chain_is_left_alone():
    """Llama's chain on float64 input normalizes in float32 (its `.to(float32)`): eager's
    result is only float32-accurate, so is the comparison."""
    module = _module(lambda: LlamaRMSNorm(24, 1e-6).double(), torch.float64)
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    boo_backend.reset()
    ours = _run(module, x, "boo")
    ref = _run(module, x, None)
    assert_close(ours[0], ref[0], "output", rtol=1e-5, atol=1e-6)
    assert_close(list(ours[1]), list(ref[1]), "grads", rtol=1e-5, atol=1e-6)
    assert sum(_composites_by_graph().values()) == 0


def test_weight_that_broadcasts_otherwise_is_left_alone():
    """A [n, 1] weight broadcasts against [.., n, n] rows in a way rms_norm does not."""
    class ColumnWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(24, 1))

        def forward(self, x):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * h.to(x.dtype)

    module = _module(ColumnWeight, torch.float32)
    x = torch.randn(3, 24, 24)
    boo_backend.reset()
    ours = _run(module, x, "boo")
    ref = _run(module, x, None)
    assert_close(ours[0], ref[0], "output")
    assert_close(list(ours[1]), list(ref[1]), "grads")
    assert sum(_composites_by_graph().values()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_attention_becomes_the_attention_composite(dtype):
    """Hugging Face's eager attention (matmul, scale, mask, softmax in f32, dropout 0,
    matmul) in a Llama layer with grouped-query heads, trained one step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 9))
    boo_backend.reset()
    ours = torch.compile(model, backend="boo", dynamic=False)(input_ids=ids, labels=ids)
    ours.loss.backward()
    expected = ref(input_ids=ids, labels=ids)
    expected.loss.backward()
    tol = {} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    assert_close(ours.loss.detach(), expected.loss.detach(), "loss", **tol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad of {name}", **({"rtol": 1e-4, "atol": 1e-5} if not tol else tol))
    names = {n for p in boo_backend.placements() for n, _ in p.composite_names}
    assert {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"} <= names, \
        [p.line() for p in boo_backend.placements()]


def test_a_failing_pattern_leaves_the_graph_to_the_rest_of_boo(monkeypatch):
    """A bug in a pattern's replacement costs the patterns, not the model: a warning and
    the graph as Dynamo gave it; strict mode raises."""
    from boo_backend import composites
    from boo_backend.patterns import Pattern

    def broken(graph, inputs, captures, values):
        raise RuntimeError("a bug in a pattern")

    monkeypatch.setattr(composites, "PATTERNS", [Pattern("broken", ("gelu",), lambda x: torch.tanh(x) + 1.0, broken)])
    module = ScalarFirstGelu()
    x = torch.randn(4, 8)
    monkeypatch.setenv("BOO_STRICT", "0")
    boo_backend.reset()
    with pytest.warns(boo_backend.BooFallbackWarning, match="a bug in a pattern"):
        ours = _run(module, x, "boo")
    ref = _run(module, x, None)
    assert_close(ours[0], ref[0], "output")
    monkeypatch.setenv("BOO_STRICT", "1")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="a bug in a pattern"):
        _run(module, x, "boo")
