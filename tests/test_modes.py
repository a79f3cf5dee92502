"""torch.compile's mode= reaches boo (as the options key "mode") and means what README says."""

import pytest
import torch

import boo_backend
from boo_backend.config import MODES, BooError, Options


def test_modes_set_defaults_that_explicit_settings_beat(monkeypatch):
    assert Options.resolve({}).mode == "default"
    fast = Options.resolve({"mode": "reduce-overhead"})
    assert (fast.aten_matmul, fast.cpu_driver, fast.autotune) == ("never", "local-sync", False)
    assert Options.resolve({"mode": "reduce-overhead", "cpu_driver": "local-task"}).cpu_driver == "local-task"
    monkeypatch.setenv("BOO_ATEN_MATMUL", "auto")
    assert Options.resolve({"mode": "reduce-overhead"}).aten_matmul == "auto"
    tuned = Options.resolve({"mode": "max-autotune"})
    assert tuned.autotune and tuned.measure_scale > 1 and tuned.aten_matmul == "auto"
    assert Options.resolve({"mode": "max-autotune-no-cudagraphs"}).autotune
    monkeypatch.setenv("BOO_MODE", "max-autotune")
    assert Options.resolve({}).autotune


def test_an_unknown_mode_is_a_clear_error():
    with pytest.raises(BooError, match="mode='fastest'.*reduce-overhead"):
        Options.resolve({"mode": "fastest"})
    f = torch.compile(lambda x: x + 1, backend="boo", mode="fastest")
    with pytest.raises(Exception, match="mode='fastest' is not a torch.compile mode"):
        f(torch.randn(3))


def _mlp(x, w1, w2):
    return torch.nn.functional.gelu(x @ w1) @ w2


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("dynamic", [False, True])
def test_every_mode_compiles_with_fullgraph_and_dynamic(mode, dynamic):
    boo_backend.reset()
    f = torch.compile(_mlp, backend="boo", mode=mode, fullgraph=True, dynamic=dynamic)
    w1, w2 = torch.randn(48, 96), torch.randn(96, 40)
    for rows in (37, 70):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(f(x, w1, w2), _mlp(x, w1, w2), rtol=1e-4, atol=1e-4)
    placed = boo_backend.placements()
    assert placed and all(p.island == 0 for p in placed)
    if mode == "reduce-overhead":
        assert all(p.aten == 0 for p in placed)
        assert {d for p in placed for d in p.drivers.values()} == {"local-sync"}


def test_mode_goes_with_other_options():
    """torch.compile refuses mode= together with options=; the options key carries both."""
    boo_backend.reset()
    f = torch.compile(_mlp, backend="boo", options={"mode": "reduce-overhead", "strict": True})
    x, w1, w2 = torch.randn(5, 48), torch.randn(48, 96), torch.randn(96, 40)
    torch.testing.assert_close(f(x, w1, w2), _mlp(x, w1, w2), rtol=1e-4, atol=1e-4)
    assert {d for p in boo_backend.placements() for d in p.drivers.values()} == {"local-sync"}
