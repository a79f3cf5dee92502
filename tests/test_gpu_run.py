"""boo on a real CUDA or ROCm device, in strict mode (marked `gpu`; skipped without one):

- every composite, forward and backward ops alike, in f32 and bf16, against a float64
  reference computed on the CPU (test_composites.check_against_float64, on the device);
- a GPT-2 training step (boo_backend.zoo) against eager on the same device: loss, logits and
  every gradient;
- BOO_SYNC=1 gives the same step;
- every graph placed in IREE, on the GPU driver, with the composites a GPT-2 step uses.

scripts/gpu_check.sh runs these with `pytest -m gpu`.
"""

import copy

import pytest
import torch

import boo_backend
from boo_backend import composites
from boo_backend.config import Options
from boo_backend.zoo import MODELS
from test_composites import ROWS, check_against_float64
from util import assert_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA or ROCm device: torch.cuda.is_available() is False"),
]
DEVICE = "cuda"  # ROCm's torch calls its devices cuda too
GPU_DRIVERS = {"cuda", "hip"}  # IREE runtime drivers


def _assert_ran_on_gpu():
    """Every graph boo compiled ran in IREE (no eager island, no recovery), on a GPU driver."""
    placed = boo_backend.placements()
    assert placed, "no graph was compiled by boo"
    for p in placed:
        assert p.island == 0 and not p.island_ops and not p.recovered, p.line()
        drivers = set(p.drivers.values())
        assert drivers and drivers <= GPU_DRIVERS, f"{p.name}: ours runs on {drivers or 'nothing'} | expected {GPU_DRIVERS}"


def _largest_case(name, dtype):
    """The row's largest shape (long rows and reductions, several workgroups) with its first
    variant valid for `dtype`."""
    row = ROWS[name]
    variant = next(v for v in row.variants if row.valid(dtype, v))
    k = variant[0] if name.startswith("native_layer") else 0  # layer norm's normalized dims
    shapes = [s for s in row.shapes if len(s) >= k]
    return max(shapes, key=lambda s: torch.Size(s).numel()), variant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(ROWS))
def test_composite_on_gpu_matches_float64(name, dtype):
    shape, variant = _largest_case(name, dtype)
    check_against_float64(name, dtype, shape, variant, device=DEVICE)
    _assert_ran_on_gpu()


def _scaled_close(ours, ref, what, rel=1e-4):
    """The largest error within `rel` of the reference's largest magnitude (reductions in a
    different order on the device), with both sides named."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (
        f"{what}: ours={tuple(ours.shape)} {ours.dtype} | torch={tuple(ref.shape)} {ref.dtype}")
    err = (ours.double() - ref.double()).abs().max().item()
    bound = rel * ref.double().abs().max().item() + 1e-7
    assert err <= bound, f"{what}: largest error {err:.3g} > {bound:.3g} (ours | torch differ)"


def _gpt2_step():
    """One GPT-2 training step on the device through boo and the same step eagerly:
    (loss, logits, gradients by name) of each."""
    pytest.importorskip("transformers")
    model, batch = MODELS["gpt2"]()
    model = model.to(DEVICE).train()
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    ref = copy.deepcopy(model)
    boo_backend.reset()
    results = []
    for m, run in ((model, torch.compile(model, backend="boo")), (ref, ref)):
        out = run(**batch)
        out.loss.backward()
        results.append((out.loss.detach(), out.logits.detach(),
                        {n: p.grad for n, p in m.named_parameters()}))
    return results


def _assert_same_step(ours, ref, what):
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = ours, ref
    assert_close(loss, ref_loss, f"{what} loss")
    _scaled_close(logits, ref_logits, f"{what} logits")
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert (grads[name] is None) == (g is None), f"{what} grad of {name}: ours={grads[name] is not None} | torch={g is not None}"
        if g is not None:
            _scaled_close(grads[name], g, f"{what} grad of {name}")


def test_gpt2_training_step_on_gpu_matches_eager():
    ours, ref = _gpt2_step()
    assert ours[0].device.type == "cuda" and all(g.device.type == "cuda" for g in ours[2].values() if g is not None)
    _assert_ran_on_gpu()
    assert {"forward", "backward"} <= {p.kind for p in boo_backend.placements()}
    used = {composites.by_name(n).family for p in boo_backend.placements() for n, _ in p.composite_names}
    # A GPU target traces attention in its math form (backend._attention_for): its softmax
    # is the composite there.
    missing = {"layer_norm", "gelu", "softmax"} - used
    assert not missing, f"no {sorted(missing)} composite on the GPU: {[p.line() for p in boo_backend.placements()]}"
    _assert_same_step(ours, ref, "gpt2")


def test_sync_gives_the_same_step(monkeypatch):
    default, ref = _gpt2_step()
    monkeypatch.setenv("BOO_SYNC", "1")
    assert Options.resolve().sync
    torch._dynamo.reset()
    synced, ref_again = _gpt2_step()
    _assert_ran_on_gpu()
    _assert_same_step(synced, ref_again, "BOO_SYNC=1 against eager")
    _assert_same_step(synced, default, "BOO_SYNC=1 against BOO_SYNC unset")
