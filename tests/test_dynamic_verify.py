"""The net under dynamic modules: calls checked against eager by the verify policy
(BOO_VERIFY: auto, all, off), and a module wrong at a later size caught at that size."""

import copy
import dataclasses
from collections import Counter
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

    def counted(gm, args, outputs, **kwargs):
        calls.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        return real(gm, args, outputs, **kwargs)

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


def _batch_norm_graphs():
    """The forward and backward of batch norm on bf16 input with float32 weights, as
    AOTAutograd traces them under autocast: torch's meta function gives bf16 statistics,
    eager's kernel float32 ones."""
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 8, 5, 7, generator=g) * 2 + 1).bfloat16()
    w, b = torch.rand(8, generator=g) + 0.5, torch.randn(8, generator=g)
    rm, rv = torch.randn(8, generator=g) * 0.1, torch.rand(8, generator=g) + 0.5

    def forward(x, w, b, rm, rv):
        return aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)

    def backward(grad, x, w, rm, rv, mean, rstd):
        return aten.native_batch_norm_backward.default(grad, x, w, rm, rv, mean, rstd, True, 1e-5, [True] * 3)

    fwd = make_fx(forward, tracing_mode="fake")(x, w, b, rm, rv)
    declared = [n.meta["val"].dtype for n in next(n for n in fwd.graph.nodes if n.op == "output").args[0]]
    eager = forward(x, w, b, rm, rv)
    mean, rstd = (t.to(torch.bfloat16) for t in eager[1:3])  # in the graph's dtype
    grad = torch.randn(x.shape, generator=g).bfloat16()
    bwd = make_fx(backward, tracing_mode="fake")(grad, x, w, rm, rv, mean, rstd)
    return (fwd, [x, w, b, rm, rv], declared, eager), (bwd, [grad, x, w, rm, rv, mean, rstd])


def test_batch_norm_statistics_in_the_graphs_dtype_are_checked_in_it():
    """A module that gives batch norm's statistics in the graph's dtype (bf16) agrees with
    eager's float32 ones; one a step of bf16 away does not."""
    (fwd, args, declared, eager), _ = _batch_norm_graphs()
    assert declared[1:3] == [torch.bfloat16] * 2 and eager[1].dtype == torch.float32, (declared, eager[1].dtype)
    ours = [t.to(d) for t, d in zip(eager, declared)]
    verifier = verify.Verifier(fwd, "all")
    assert verifier.check(("a",), args, ours, Counter()) is None
    ours[1] = ours[1] + 0.1 * ours[1].abs().max()
    assert "differs" in verifier.check(("b",), args, ours, Counter())


def test_a_graph_eager_cannot_run_is_not_checked_and_says_so():
    """The backward of that batch norm takes bf16 statistics with float32 weights, which
    eager's kernel refuses: the check says it cannot check (the caller then compiles per
    shape) rather than raising into the user's program."""
    _, (bwd, args) = _batch_norm_graphs()
    with pytest.raises(RuntimeError):
        bwd(*args)
    said = verify.Verifier(bwd, "all").check(("a",), args, [torch.zeros(1)] * 3, Counter())
    assert "cannot be checked" in said, said


def test_batch_norm_under_autocast_at_several_batch_sizes():
    """A CNN trained under bf16 autocast: its second batch size compiles dynamic modules,
    whose check met a backward that eager cannot run as traced (it raised RuntimeError:
    mixed dtype). Each size's loss, output and running statistics are eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, stride=2, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo")
    boo_backend.reset()
    for batch in (2, 3, 5):
        x = torch.randn(batch, 3, 12, 12, generator=torch.Generator().manual_seed(batch))
        outs = []
        for m in (run, ref):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
            out.float().square().mean().backward()
            outs.append(out)
        assert_close(outs[0], outs[1], f"output at batch {batch}", rtol=5e-2, atol=5e-2)
        for (name, a), b in zip(model.named_buffers(), ref.buffers()):
            assert_close(a, b, f"{name} at batch {batch}", rtol=1e-2, atol=1e-2)
    placed = boo_backend.placements()
    assert all(p.island == 0 and not p.recovered for p in placed), [p.line() for p in placed]
