"""The net under dynamic modules: calls checked against eager by the verify policy
(BOO_VERIFY: auto, all, off), and a module wrong at a later size caught at that size."""

import dataclasses
import logging

import pytest
import torch

import boo_backend
from boo_backend import compile as boo_compile
from boo_backend import verify
from boo_backend.config import BooError, Options
from util import assert_close


def test_size_classes():
    assert verify.size_class(16) == (5, 4) and verify.size_class(48) == (6, 4)
    assert verify.size_class(60) == (6, 2) and verify.size_class(61) == (6, 0)
    assert verify.size_class(64) != verify.size_class(65) != verify.size_class(131)
    assert verify.size_class(70) == verify.size_class(102)  # same range, same alignment


def test_verify_option():
    assert Options.resolve({}).verify == "auto"
    assert Options.resolve({"verify": "ALL"}).verify == "all"
    assert Options.resolve({"verify": 0}).verify == "off"
    with pytest.raises(BooError, match="verify='sometimes'"):
        Options.resolve({"verify": "sometimes"})


def _count_checks(monkeypatch) -> list:
    calls = []
    real = verify.disagreement

    def counted(gm, args, outputs):
        calls.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        return real(gm, args, outputs)

    monkeypatch.setattr(verify, "disagreement", counted)
    return calls


@pytest.mark.parametrize("policy, expected", [("auto", 5), ("all", 7), ("off", 0)])
def test_policies_pick_the_calls_checked(monkeypatch, policy, expected):
    """auto: once per size class (16 and 48 share none; 70 and 102 share theirs); all: every
    new shape; off: none. A size seen before is never checked again."""
    monkeypatch.setenv("BOO_VERIFY", policy)
    boo_backend.reset()
    calls = _count_checks(monkeypatch)
    run = torch.compile(lambda x: torch.tanh(x) * 2, backend="boo", dynamic=True)
    for n in (16, 48, 16, 70, 102, 61, 131, 135, 70):
        x = torch.randn(n, 3)
        assert_close(run(x), torch.tanh(x) * 2, f"at {n}")
    assert len(calls) == expected, calls
    assert all(p.dynamic for p in boo_backend.placements())


def test_auto_stops_after_its_limit(monkeypatch):
    monkeypatch.setattr(verify, "LIMIT", 3)
    calls = _count_checks(monkeypatch)
    run = torch.compile(lambda x: x.cos() + 1, backend="boo", dynamic=True)
    for n in (3, 5, 9, 17, 33, 65, 129):  # seven size classes
        x = torch.randn(n)
        assert_close(run(x), x.cos() + 1, f"at {n}")
    assert len(calls) == 3


def test_a_module_wrong_past_64_is_caught_at_that_size(monkeypatch, caplog):
    """The real IREE 3.13 bug (tests/test_iree_workarounds.py), with boo's workaround taken
    out: the module is right at the first sizes and wrong past 64. The check at the first
    size past 64 catches it, warns, and the graph compiles per shape: every answer right."""
    real = boo_compile.parse_target
    monkeypatch.setattr(boo_compile, "parse_target",
                        lambda spec: dataclasses.replace(real(spec), optional_flags=("--iree-opt-data-tiling",)))
    monkeypatch.setenv("BOO_ATEN_MATMUL", "never")
    monkeypatch.setenv("BOO_CACHE", "0")
    caplog.set_level(logging.WARNING, logger="boo_backend")
    boo_backend.reset()
    run = torch.compile(torch.bmm, backend="boo", dynamic=True)
    g = torch.Generator().manual_seed(0)
    for n in (16, 40, 70, 100, 131):
        p, v = torch.randn(2, n, n, generator=g), torch.randn(2, n, 48, generator=g)
        assert_close(run(p, v), torch.bmm(p, v), f"at {n}", rtol=1e-4, atol=1e-4)
        if n == 40:
            assert "disagrees" not in caplog.text
    assert "disagrees with eager PyTorch at sizes [2, 70, 70], [2, 70, 48]" in caplog.text
    assert not any(p.dynamic for p in boo_backend.placements())


def test_a_float32_result_of_bfloat16_work_is_checked_at_bfloat16s_tolerance():
    """Under autocast a graph returns float32 computed from bfloat16 matmuls: eager's own
    rounding differs from IREE's by about 1e-2, which is no disagreement. A float32 graph at
    the same difference is one."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = torch.randn(37, 64), torch.randn(64, 64)
    mixed = make_fx(lambda x, w: (x.to(torch.bfloat16) @ w.to(torch.bfloat16)).float() + x)(x, w)
    full = make_fx(lambda x, w: x @ w + x)(x, w)
    for gm, verdict in ((mixed, None), (full, "differs")):
        off = gm(x, w) * 1.01
        said = verify.disagreement(gm, [x, w], [off])
        assert said is None if verdict is None else verdict in said, said
    assert "differs" in verify.disagreement(mixed, [x, w], [mixed(x, w) * 1.2])
