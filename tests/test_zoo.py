"""Tiny random-config models of real architectures (boo_backend.zoo) through boo in strict
mode: one training step and one inference call each, compared with eager, and every graph
placed 100% in IREE (FX-level decompositions allowed, no eager islands, no recovery)."""

import copy

import pytest
import torch

import boo_backend
from boo_backend import composites
from boo_backend.zoo import MODELS
from util import assert_close, close_to_scale

pytest.importorskip("transformers")


# Composite families each model's graphs must use (by name, in the placements): the ops
# real training steps spend their time in reach their kernels, hand-written chains included.
EXPECTED_COMPOSITES = {
    "llama": {"rms_norm", "attention"},
    "qwen2": {"rms_norm", "attention"},
    "gpt2": {"layer_norm", "gelu", "attention"},
    "bert": {"layer_norm", "gelu", "attention"},
    "t5": {"rms_norm", "attention"},
    "resnet": {"batch_norm"},
}


def _composite_families(kinds) -> set[str]:
    return {
        composites.by_name(name).family
        for p in boo_backend.placements() if p.kind in kinds
        for name, _ in p.composite_names
    }


def _assert_composites(name, kinds):
    for kind in kinds:
        expected = EXPECTED_COMPOSITES.get(name, set())
        if kind == "inference":  # batch norm in eval has its own kernel
            expected = {"batch_norm_eval" if f == "batch_norm" else f for f in expected}
        missing = expected - _composite_families({kind})
        assert not missing, f"{name} {kind}: no {sorted(missing)} composite; {[p.line() for p in boo_backend.placements()]}"


def _assert_all_in_iree():
    placed = boo_backend.placements()
    assert placed, "no graph was compiled by boo"
    for p in placed:
        # island_ops too: an op that only a decomposition emits is not counted in p.island.
        assert p.island == 0 and not p.island_ops and not p.recovered, p.line()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.sweep(0.6)
def test_training_step(name):
    model, batch = MODELS[name]()
    ref = copy.deepcopy(model)
    model.train()
    ref.train()
    boo_backend.reset()
    out = torch.compile(model, backend="boo")(**batch)
    out.loss.backward()
    expected = ref(**batch)
    expected.loss.backward()
    _assert_all_in_iree()
    assert {"forward", "backward"} <= {p.kind for p in boo_backend.placements()}
    _assert_composites(name, ["forward", "backward"])

    assert_close(out.loss.detach(), expected.loss.detach(), "loss")
    close_to_scale(out.logits.detach(), expected.logits.detach(), "logits")
    ref_params = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        r = ref_params[pname].grad
        if r is None:
            assert p.grad is None, f"grad of {pname}: ours is set | torch=None"
            continue
        assert p.grad is not None, f"grad of {pname}: ours=None | torch is set"
        close_to_scale(p.grad, r, f"grad of {pname}")
    ref_buffers = dict(ref.named_buffers())
    for bname, b in model.named_buffers():
        if b.is_floating_point():
            close_to_scale(b, ref_buffers[bname], f"buffer {bname}")
        else:
            assert_close(b, ref_buffers[bname], f"buffer {bname}")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.sweep(0.6)
def test_inference(name):
    model, batch = MODELS[name]()
    model.eval()
    boo_backend.reset()
    with torch.no_grad():
        ours = torch.compile(model, backend="boo")(**batch)
        ref = model(**batch)
    _assert_all_in_iree()
    assert {p.kind for p in boo_backend.placements()} == {"inference"}
    _assert_composites(name, ["inference"])
    assert_close(ours.loss, ref.loss, "loss")
    close_to_scale(ours.logits, ref.logits, "logits")
