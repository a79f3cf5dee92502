"""BOO_FORCE_DECOMPOSE and its options key, and whole models with and without composites."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boo_backend
from boo_backend import composites
from boo_backend.config import Options
from util import compare_training


def _ops(text):
    return {e.name for e in composites.REGISTRY.values() if e.op in composites.disabled(text)}


def test_force_decompose_values():
    assert _ops("") == set()
    assert _ops("1") == _ops("all") == set(composites.names())
    assert _ops("gelu_backward,native_layer_norm_backward") == {"gelu_backward", "native_layer_norm_backward"}
    # a family, as README's table names it, turns off its forward and backward; a composite's
    # own name (`gelu`) wins over the family's
    assert _ops("layer_norm, log_softmax") == {"native_layer_norm", "native_layer_norm_backward",
                                               "_log_softmax", "_log_softmax_backward_data"}
    assert _ops("gelu") == {"gelu"}
    assert _ops("attention") == {"_scaled_dot_product_flash_attention_for_cpu",
                                 "_scaled_dot_product_flash_attention_for_cpu_backward"}


def test_unknown_name_lists_valid_names():
    with pytest.raises(boo_backend.BooError, match="valid names are: .*gelu, gelu_backward"):
        composites.disabled("gelu,layer_nrom")


def test_unknown_name_fails_torch_compile(monkeypatch):
    monkeypatch.setenv("BOO_FORCE_DECOMPOSE", "gelu_bakward")
    with pytest.raises(Exception, match="valid names are"):
        torch.compile(lambda t: F.gelu(t), backend="boo")(torch.randn(3))


def test_options_key_overrides_environment(monkeypatch):
    monkeypatch.setenv("BOO_FORCE_DECOMPOSE", "all")
    assert Options.resolve({"force_decompose": "gelu"}).force_decompose == "gelu"
    assert Options.resolve({"force_decompose": ["gelu", "gelu_backward"]}).force_decompose == "gelu,gelu_backward"


class LnGeluMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x)), approximate="tanh"))


def _batches(shape, n=2):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(*shape, generator=g), torch.randn(*shape[:-1], 16, generator=g)) for _ in range(n)]


def _composite_count():
    return sum(p.composites for p in boo_backend.placements())


@pytest.mark.parametrize("force", ["", "all", "gelu_backward,native_layer_norm_backward"])
def test_linear_layernorm_gelu_linear_training(force, monkeypatch):
    monkeypatch.setenv("BOO_FORCE_DECOMPOSE", force)
    boo_backend.reset()
    torch.manual_seed(0)
    compare_training(LnGeluMlp(), _batches((24, 32)), F.mse_loss, steps=2)
    expected = {"": 4, "all": 0, "gelu_backward,native_layer_norm_backward": 2}[force]
    assert _composite_count() == expected, [p.line() for p in boo_backend.placements()]


@pytest.mark.parametrize("force", ["", "all"])
def test_transformer_encoder_layer_training(force, monkeypatch):
    monkeypatch.setenv("BOO_FORCE_DECOMPOSE", force)
    boo_backend.reset()
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                       activation="gelu", batch_first=True)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2, 6, 32, generator=g), torch.randn(2, 6, 32, generator=g))]
    compare_training(layer, batches, F.mse_loss, steps=2)
    if force == "":
        assert _composite_count() >= 6, [p.line() for p in boo_backend.placements()]
    else:
        assert _composite_count() == 0
