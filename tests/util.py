"""Helpers shared by the tests: one assert_close with tolerances by dtype."""

import copy

import torch

# (rtol, atol) by dtype.
TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-2, 1e-3),
}


def assert_close(ours, ref, what="value", rtol=None, atol=None):
    """Compare tensors (or nests of them) and say which side is which when they differ."""
    if isinstance(ref, (tuple, list)):
        assert isinstance(ours, (tuple, list)) and len(ours) == len(ref), f"{what}: ours={ours!r} | torch={ref!r}"
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert_close(a, b, f"{what}[{i}]", rtol, atol)
        return
    if ref is None or not isinstance(ref, torch.Tensor):
        assert ours == ref, f"{what}: ours={ours!r} | torch={ref!r}"
        return
    assert isinstance(ours, torch.Tensor), f"{what}: ours={ours!r} | torch=Tensor"
    assert ours.shape == ref.shape, f"{what} shape mismatch: ours={tuple(ours.shape)} | torch={tuple(ref.shape)}"
    assert ours.dtype == ref.dtype, f"{what} dtype mismatch: ours={ours.dtype} | torch={ref.dtype}"
    r, a = TOLERANCES.get(ref.dtype, (0, 0))
    torch.testing.assert_close(
        ours, ref, rtol=r if rtol is None else rtol, atol=a if atol is None else atol,
        msg=lambda m: f"{what}: {m}",
    )


def assert_step_like_eager(model, x, ours, what):
    """`ours` (the compiled model's output on `x`) and the parameters' gradients of its
    squared mean are eager's."""
    grads = torch.autograd.grad(ours.square().mean(), list(model.parameters()))
    ref = model(x)
    theirs = torch.autograd.grad(ref.square().mean(), list(model.parameters()))
    assert_close(ours, ref, what)
    for g, r in zip(grads, theirs):
        assert_close(g, r, f"{what} gradient")


def train_steps(model, batches, loss_fn, backend, steps=2, lr=0.1, **compile_kw):
    """Run `steps` SGD steps on a copy of `model`, compiled with `backend` (None: eager).
    Returns the losses, the gradients of the last step and the final state dict."""
    model = copy.deepcopy(model)
    run = model if backend is None else torch.compile(model, backend=backend, **compile_kw)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        loss = loss_fn(run(x), y)
        loss.backward()
        losses.append(loss.detach())
        grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}


def compare_training(model, batches, loss_fn, steps=2, **compile_kw):
    ours = train_steps(model, batches, loss_fn, "boo", steps, **compile_kw)
    ref = train_steps(model, batches, loss_fn, None, steps)
    assert_close(ours[0], ref[0], "loss")
    for name in ref[1]:
        assert_close(ours[1][name], ref[1][name], f"grad of {name}")
    for name in ref[2]:
        assert_close(ours[2][name], ref[2][name], f"state {name}")


def close_to_scale(ours, ref, what, rel=1e-4, floor=1e-7):
    """Largest absolute error within `rel` of the reference's largest magnitude (plus a tiny
    floor for all-zero references): summed reductions over different orders stay in it."""
    assert isinstance(ours, torch.Tensor), f"{what}: ours={ours!r} | torch=Tensor"
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (
        f"{what}: ours={tuple(ours.shape)} {ours.dtype} | torch={tuple(ref.shape)} {ref.dtype}"
    )
    err = (ours.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    bound = rel * (ref.double().abs().max().item() if ref.numel() else 0.0) + floor
    assert err <= bound, f"{what}: largest error {err:.3g} > {bound:.3g} (ours | torch differ)"


def layer_like_float64(layer, ref, run, x, dtype):
    """`run` (the compiled `layer`) on `x` in `dtype`, forward and backward, against `ref` (the
    same layer in float64): the output, the input's gradient and each parameter's gradient
    within `dtype`'s share of the reference's scale. Clears the gradients it made."""
    x = x.to(dtype).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    out = run(x)
    expected = ref(x64)
    g = torch.randn(expected.shape, dtype=torch.float64)
    out.backward(g.to(dtype))
    expected.backward(g)
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    close_to_scale(out.double(), expected, "output", rel=rel)
    close_to_scale(x.grad.double(), x64.grad, "input grad", rel=rel)
    theirs = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        close_to_scale(p.grad.double(), theirs[name].grad, f"{name} grad", rel=rel)
        p.grad = theirs[name].grad = None
