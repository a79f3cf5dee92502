"""Which form runs a compiled region once its graphs are built (boo_backend/regions.py): boo's
graphs with parts in IREE, or Dynamo's own graph in eager PyTorch, timed both ways over the
region's calls. These test the mechanism, never a speed: the clock the trial reads is
injected, so that one form is faster by construction."""

import pytest
import torch

import boo_backend
from boo_backend import regions, runtime
from boo_backend.runtime import IreeFunction
from util import assert_step_like_eager


def _iree_measured_faster(monkeypatch):
    """Timings in which every part runs in IREE (its measured choice); returns the list that
    each IREE call of a part appends to."""
    original = IreeFunction._timed_invoke

    def timed(self, loaded, passed, num_results, copies):
        original(self, loaded, passed, num_results, copies)
        return 1e-3 if isinstance(loaded, runtime.OnAten) else 1e-5

    monkeypatch.setattr(IreeFunction, "_timed_invoke", timed)
    monkeypatch.setattr(runtime, "_MEASURE_LIMIT", float("inf"))
    calls = []
    invoke = IreeFunction._invoke

    def invoked(self, *args, **kwargs):
        if not isinstance(self._current, runtime.OnAten):
            calls.append(self.graph)
        return invoke(self, *args, **kwargs)

    monkeypatch.setattr(IreeFunction, "_invoke", invoked)
    return calls


def _clock(monkeypatch, boo_s: float, eager_s: float):
    """The trial's clock: each call of an arm takes `boo_s` or `eager_s` seconds on it."""
    now = [0.0]
    monkeypatch.setattr(regions.time, "perf_counter", lambda: now[0])
    init = regions._Trial.__init__

    def with_costs(self, compiled, eager, *args):
        def costing(fn, seconds):
            def run(*a):
                now[0] += seconds
                return fn(*a)
            return run
        init(self, costing(compiled, boo_s), costing(eager, eager_s), *args)

    monkeypatch.setattr(regions._Trial, "__init__", with_costs)


def _train(monkeypatch, tmp_path, steps: int, options=None):
    """`steps` training steps of a small model through boo (outside strict mode), each
    checked against eager's loss and gradients. Returns the IREE calls of each step."""
    monkeypatch.delenv("BOO_STRICT", raising=False)
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path / "cache"))
    boo_backend.reset()
    torch._dynamo.reset()
    calls = _iree_measured_faster(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 67), torch.nn.LayerNorm(67), torch.nn.GELU(),
                                torch.nn.Linear(67, 5))
    run = torch.compile(model, backend="boo", options=options)
    per_step = []
    for i in range(steps):
        x = torch.randn(131, 37)
        assert_step_like_eager(model, x, run(x), f"step {i}")
        per_step.append(len(calls))
        calls.clear()
    return per_step


# Calls before the trial decides: the first two steps build and measure the graphs, then a
# warm-up pair and TRIAL_PAIRS timed pairs; the decision comes at the call after them.
_DECIDED = 2 + 2 + 2 * regions.TRIAL_PAIRS


def test_a_region_faster_as_dynamos_graph_moves_there_and_says_so(monkeypatch, tmp_path, caplog):
    _clock(monkeypatch, boo_s=0.010, eager_s=0.008)
    caplog.set_level("INFO", logger="boo_backend")
    per_step = _train(monkeypatch, tmp_path, _DECIDED + 3)
    assert all(per_step[:2]), per_step  # built and measured in IREE
    trial = per_step[2:_DECIDED]
    assert trial.count(0) == 1 + regions.TRIAL_PAIRS and trial[0] and not trial[1], per_step  # boo, eager warm
    assert per_step[_DECIDED:] == [0, 0, 0], per_step
    lines = [p.line() for p in boo_backend.placements()]
    assert len(lines) == 2 and all("then its region ran as Dynamo's graph in eager PyTorch (measured faster" in line
                                   for line in lines), lines
    assert sum("Dynamo's graph runs in eager PyTorch from now on" in r.getMessage() for r in caplog.records) == 1


def test_a_region_faster_as_boos_graphs_stays(monkeypatch, tmp_path, caplog):
    _clock(monkeypatch, boo_s=0.008, eager_s=0.010)
    caplog.set_level("INFO", logger="boo_backend")
    per_step = _train(monkeypatch, tmp_path, _DECIDED + 3)
    assert per_step[2:_DECIDED].count(0) == 1 + regions.TRIAL_PAIRS, per_step
    assert all(per_step[_DECIDED:]), per_step
    assert not any(p.in_eager for p in boo_backend.placements())
    assert sum("boo's graphs stay" in r.getMessage() for r in caplog.records) == 1


def test_slow_calls_and_named_drivers_are_not_timed(monkeypatch, tmp_path):
    """Calls further apart than TRIAL_LIMIT_S stay boo's, never run in eager (boo's warm-up
    call comes first); a driver the user named (or strict mode) never runs the region in eager."""
    _clock(monkeypatch, boo_s=regions.TRIAL_LIMIT_S * 2, eager_s=0.001)
    per_step = _train(monkeypatch, tmp_path / "slow", 8)
    assert all(per_step), per_step
    per_step = _train(monkeypatch, tmp_path / "named", _DECIDED + 2, {"cpu_driver": "local-sync"})
    assert all(per_step), per_step


@pytest.mark.parametrize("strict", [True, False])
def test_allowed_only_where_nothing_is_asked_of_iree(strict):
    from boo_backend.config import Options

    opts = Options.resolve({"strict": strict})
    assert regions.allowed(opts) is not strict
    assert not regions.allowed(Options.resolve({"strict": False, "aten_matmul": "never"}))
