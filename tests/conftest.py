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
