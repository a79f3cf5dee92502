"""Compiled optimizer steps (issue 19): torch.compile(opt.step) and one compiled function
that runs forward, loss, backward, clipping, opt.step() and zero_grad, in strict mode, for
SGD with momentum and the Adam family (foreach or not, amsgrad, weight decay, a learning
rate held as a tensor). Dynamo writes Adam's addcmul_/addcdiv_ with value= as prims.fma and
foreach optimizers call _foreach_ ops; both reach IREE."""

import copy

import pytest
import torch

import boo_backend

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adam_amsgrad_wd": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True, weight_decay=0.01),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=True),
    "adamw_for_loop": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=False),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=2e-3, amsgrad=True, foreach=True),
    "adamw_tensor_lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-3), weight_decay=0.1, foreach=False),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 70), torch.nn.GELU(), torch.nn.LayerNorm(70),
                               torch.nn.Linear(70, 11))


def _state_close(a: torch.optim.Optimizer, b: torch.optim.Optimizer):
    for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        for key, va in a.state[pa].items():
            vb = b.state[pb][key]
            if isinstance(va, torch.Tensor):
                torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-7, msg=f"state {key}")


def _params_close(m, r):
    for (name, p), q in zip(m.named_parameters(), r.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=f"parameter {name}")


def _no_islands():
    placed = boo_backend.placements()
    assert placed and all(p.island == 0 and not p.recovered for p in placed), [p.line() for p in placed]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_optimizer_step_matches_eager(name):
    """Same gradients, same state: 3 steps of torch.compile(opt.step) against eager's."""
    boo_backend.reset()
    model, ref = _model(), _model()
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    step = torch.compile(opt.step, backend="boo")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(model.parameters(), ref.parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        step()
        ref_opt.step()
        _params_close(model, ref)
        _state_close(opt, ref_opt)
    _no_islands()


def _check_whole_step(model, ref, name, loss_of, batch, steps=3, max_norm=1.0):
    """Forward, loss, backward, clip_grad_norm_, opt.step() and zero_grad in one compiled
    function, against eager; each step starts from the same parameters and state as eager's
    (Adam magnifies tiny gradient differences near zero, so a free-running comparison would
    drift)."""
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())

    def train_step(model, opt, *inputs):
        loss = loss_of(model, *inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        return loss

    compiled = torch.compile(train_step, backend="boo")
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        inputs = batch(gen)
        loss, ref_loss = compiled(model, opt, *inputs), train_step(ref, ref_opt, *inputs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        _params_close(model, ref)
        _state_close(opt, ref_opt)
        ref.load_state_dict(model.state_dict())  # the next step from the same point
        ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _no_islands()
    assert {"forward", "backward"} <= {p.kind for p in boo_backend.placements()}


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw_foreach", "adamw_tensor_lr"])
def test_compiled_whole_train_step(name):
    boo_backend.reset()
    loss_fn = torch.nn.CrossEntropyLoss()
    _check_whole_step(_model(), _model(), name, lambda m, x, y: loss_fn(m(x), y),
                      lambda gen: (torch.randn(13, 37, generator=gen), torch.randint(0, 11, (13,), generator=gen)))


def test_a_tensor_learning_rate_changes_without_recompiling():
    boo_backend.reset()
    model, ref = _model(), _model()
    opt = OPTIMIZERS["adamw_tensor_lr"](model.parameters())
    ref_opt = OPTIMIZERS["adamw_tensor_lr"](ref.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5 ** s)
    step = torch.compile(opt.step, backend="boo")
    compiles = None
    for i in range(4):
        for p, q in zip(model.parameters(), ref.parameters()):
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
        step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        _params_close(model, ref)
        if i == 0:
            compiles = boo_backend.stats().get("iree_compiles", 0)
    assert boo_backend.stats().get("iree_compiles", 0) == compiles, "the schedule recompiled the step"
    _no_islands()


@pytest.mark.parametrize("count", [37, 150])
def test_clipping_many_gradients_runs_in_iree(count):
    """clip_grad_norm_ over more gradients than a dispatch may bind (IREE's runtime takes 32
    when it records a dispatch, 64 when it loads one): IREE fused every gradient's norm into
    one dispatch, its module failed to load, and the whole graph ran in eager. Its graph is
    one connected computation, so it is cut into modules by node order. Strict mode."""
    boo_backend.reset()
    gen = torch.Generator().manual_seed(count)
    params = [torch.nn.Parameter(torch.randn(5 + i % 7, 3, generator=gen)) for i in range(count)]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = torch.compile(torch.nn.utils.clip_grad_norm_, backend="boo")(params, 0.5)
    norms = torch.stack([g.double().norm() for g in grads])
    expected = norms.norm()
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=0)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad.double(), g.double() * 0.5 / (expected + 1e-6), rtol=1e-5, atol=1e-7)
    _no_islands()


def test_compiled_whole_train_step_of_a_deep_model():
    """The whole step of a 20-layer MLP (40 parameters: more than a dispatch may bind)."""
    boo_backend.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.Tanh()) for _ in range(20)])
    _check_whole_step(model, copy.deepcopy(model), "adamw_foreach", lambda m, x: m(x).square().mean(),
                      lambda gen: (torch.randn(9, 24, generator=gen),), steps=2, max_norm=0.1)
