"""Placed results that their own module also reads (placing.py): IREE writes them into the
caller's storage where they are made, with no copy at the end, and every value stays right.

A vmfb names the HAL functions it calls, so one that copies a buffer names
`hal.command_buffer.copy_buffer`."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import boo_backend
from boo_backend import placing
from boo_backend.cache import CompileCache
from boo_backend.compile import compile_mlir, parse_target
from boo_backend.lower import lower
from boo_backend.runtime import IreeFunction
from boo_backend.storage import placed_results, with_storage
from util import assert_close

COPIES = b"hal.command_buffer.copy_buffer"

# Each returns a placed result that it also reads: the log-softmax a loss saves and gathers
# from; a softmax and its row sums; a result and its exp; a result and a copy scattered into.
PROGRAMS = {
    "gathered": lambda x, i: (lambda y: (y, y.gather(1, i)))(torch.log_softmax(x, 1)),
    "summed": lambda x, i: (lambda y: (y, y.sum(1, keepdim=True) + i))(torch.softmax(x, 1)),
    "exp of it": lambda x, i: (lambda y: (y, y.exp() * i))(torch.tanh(x) + 1),
    # a scatter that IREE runs in place on a copy of y (the one copy it needs), never on y
    "scattered into": lambda x, i: (lambda y: (y, y.scatter(1, i, -1.0) + 2))(torch.exp(x)),
}
NEEDS_A_COPY = {"scattered into"}
CPU = parse_target("llvm-cpu")


def _placed(fn, *args):
    """fn traced at `args`, lowered, its results placed, as boo builds CPU modules."""
    return with_storage(lower(make_fx(fn, tracing_mode="fake")(*args)))


def _vmfb(lowered, tmp_path) -> bytes:
    return compile_mlir(lowered.mlir, CPU, CompileCache(tmp_path, enabled=False))


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_placed_result_read_in_its_module_is_written_where_it_is_made(name, tmp_path):
    fn = PROGRAMS[name]
    x = torch.randn(67, 1001, generator=torch.Generator().manual_seed(0))  # 268 KB: placed
    i = torch.randint(0, 1001, (67, 1), generator=torch.Generator().manual_seed(1))
    lowered = _placed(fn, x, i)
    assert 0 in lowered.placed and placing.READS_PLACED in lowered.mlir
    vmfb = _vmfb(lowered, tmp_path)
    assert (COPIES in vmfb) == (name in NEEDS_A_COPY)
    for driver in ("local-task", "local-sync"):
        ours = IreeFunction(vmfb, CPU, graph=name, driver=driver, placed=placed_results(lowered))([x, i], 2)
        ref = fn(x.double(), i)
        assert_close([o.double() for o in ours], list(ref), f"{name} on {driver}", rtol=1e-5, atol=1e-6)


def test_a_placed_result_nothing_else_reads_compiles_in_one_run(tmp_path, monkeypatch):
    x = torch.randn(67, 1001)
    lowered = _placed(lambda a: torch.log_softmax(a, 1), x)
    assert lowered.placed == (0,) and placing.READS_PLACED not in lowered.mlir
    monkeypatch.setattr(placing, "alias_early", lambda text: pytest.fail("two runs for a module that needs one"))
    assert COPIES not in _vmfb(lowered, tmp_path)


def _reference(fn, args):
    """fn's result and its arguments' gradients in float64."""
    wide = [a.detach().double().requires_grad_() if a.is_floating_point() else a for a in args]
    out = fn(*wide)
    return out, torch.autograd.grad(out, [a for a in wide if a.requires_grad])


def _cross_entropy(x, w, t):
    # Label smoothing also sums the log-probabilities, so the forward makes and saves them
    # (without it, joint.py's rewrite saves a row statistic instead).
    return F.cross_entropy(x @ w, t, label_smoothing=0.1)


def _expected_tanh(x, w, t):
    logits = x @ w
    return (logits.softmax(-1) * logits.tanh()).sum(-1).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn, aten_matmul", [(_cross_entropy, "1"), (_expected_tanh, "0")])
def test_training_a_head_whose_results_are_placed_and_read_matches_float64(fn, aten_matmul, dtype, tmp_path, monkeypatch):
    """A loss over 1001 classes: the softmax or log-softmax it saves is placed, and the
    forward reads it. Strict, on local-task, the matmul in ATen (the graph split into parts
    around it) or in IREE (one module); forward and both gradients against float64, and no
    module or part of the step copies a buffer."""
    monkeypatch.setenv("BOO_CPU_DRIVER", "local-task")
    monkeypatch.setenv("BOO_ATEN_MATMUL", aten_matmul)
    gen = torch.Generator().manual_seed(2)
    args = [(torch.randn(67, 96, generator=gen) / 4).to(dtype).requires_grad_(),
            (torch.randn(96, 1001, generator=gen) / 4).to(dtype).requires_grad_(),
            torch.randint(0, 1001, (67,), generator=gen)]
    boo_backend.reset()
    out = torch.compile(fn, backend="boo", options={"dump_dir": str(tmp_path)})(*args)
    grads = torch.autograd.grad(out, args[:2])
    ref, ref_grads = _reference(fn, args)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    for what, a, b in [("loss", out, ref), ("input's gradient", grads[0], ref_grads[0]),
                       ("weight's gradient", grads[1], ref_grads[1])]:
        assert a.dtype == dtype and a.shape == b.shape, what
        error = ((a.double() - b).norm() / b.norm()).item()
        assert error < bound, f"{what}: relative error {error:.2e} against float64"
    modules = sorted(tmp_path.glob("*/*.mlir"))
    assert any(placing.READS_PLACED in m.read_text() for m in modules), "no module reads what it places"
    for m in modules:
        assert COPIES not in m.with_suffix(".vmfb").read_bytes(), f"{m.parent.name}/{m.stem} copies a buffer"


def test_a_module_the_rewrite_cannot_read_compiles_as_imported(tmp_path, monkeypatch):
    """placing.alias_early failing costs the copy, not the module."""
    def fails(text):
        raise ValueError("unreadable")

    fn = PROGRAMS["gathered"]
    x, i = torch.randn(67, 1001), torch.randint(0, 1001, (67, 1))
    lowered = _placed(fn, x, i)
    monkeypatch.setattr(placing, "alias_early", fails)
    vmfb = _vmfb(lowered, tmp_path)
    assert COPIES in vmfb
    ours = IreeFunction(vmfb, CPU, graph="gathered", driver="local-sync", placed=placed_results(lowered))([x, i], 2)
    assert_close(list(ours), list(fn(x, i)), "gathered, as imported")
