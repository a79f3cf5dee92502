import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _boo_env(monkeypatch, tmp_path_factory):
    """Strict mode and a private compile cache for every test; fresh Dynamo state."""
    monkeypatch.setenv("BOO_STRICT", "1")
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "boo-cache"))
    for var in ("BOO_FORCE_DECOMPOSE", "BOO_DUMP_DIR", "BOO_CACHE", "BOO_TARGET", "BOO_ATEN_MATMUL", "BOO_CPU_DRIVER", "BOO_DYNAMIC",
                "BOO_SYNC", "BOO_COMPILE_ONLY", "BOO_BLOCKS"):
        monkeypatch.delenv(var, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "sweep(share): a sweep of cases, of which a run keeps `share`, drawn per commit (see below)")


def commit_seed() -> str:
    """The seed of this run's draw: BOO_SWEEP_SEED, else the checked-out commit's hash (a
    commit's run is reproducible, and the commits cover every case between them)."""
    import subprocess

    if os.environ.get("BOO_SWEEP_SEED"):
        return os.environ["BOO_SWEEP_SEED"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no commit"


def pytest_collection_modifyitems(config, items):
    """Keep CI in its time: of each test marked `sweep(share)`, a run keeps that share of its
    cases (at least one), drawn with commit_seed(), and deselects the rest, which pytest counts
    in its summary ('N deselected'). BOO_SWEEPS=all keeps every case. Every worker of a run
    draws the same cases."""
    if os.environ.get("BOO_SWEEPS", "") == "all":
        return
    import random

    groups: dict[str, list] = {}
    for item in items:
        mark = item.get_closest_marker("sweep")
        if mark is not None and hasattr(item, "callspec"):
            groups.setdefault(item.nodeid.split("[")[0], []).append(item)
    if not groups:
        return
    seed = commit_seed()
    dropped = set()
    for name, cases in groups.items():
        share = cases[0].get_closest_marker("sweep").args[0]
        keep = max(1, round(share * len(cases)))
        kept = set(random.Random(f"{name}/{seed}").sample(range(len(cases)), keep))
        dropped.update(id(c) for i, c in enumerate(cases) if i not in kept)
    if dropped:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in dropped])
        items[:] = [i for i in items if id(i) not in dropped]
