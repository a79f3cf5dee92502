"""OpInfo samples differentiated through boo, for the gradient sweep (tests/test_opinfo_gradients.py).

A sample is compiled once (static shapes) and differentiated with torch.autograd.grad against
fixed random cotangents for every floating output, with respect to every floating input that
the op differentiates; the outputs and the gradients are compared with eager's on clones of
the same inputs. A gradient counts as WRONG only past 1e-4 of its largest magnitude (a sum
of many products may round differently), or where its NaNs differ from eager's.
"""

from __future__ import annotations

import random

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

import test_opinfo_sweep as sweep

# Entries of op_db whose samples draw random numbers (nothing to compare), are sparse or
# complex, or that Dynamo does not capture (nothing of them reaches boo).
_RANDOM = ("dropout", "rrelu", "bernoulli", "normal", "multinomial", "rand", "uniform", "cauchy",
           "exponential", "geometric", "log_normal", "fractional_max_pool", "svd_lowrank", "pca_lowrank",
           "poisson")
_OTHER = ("sparse", "complex", "cdouble", "cfloat", "chalf", "polar", "view_as_real", "fft.", "stft", "istft", "conj", "angle", "linalg.eig")
RELATIVE = 1e-4


def differentiable_ops() -> list[str]:
    """Every op_db entry with autograd and float32 on the CPU, less the kinds above."""
    keys = []
    for key, op in sorted(sweep._op_db().items()):
        if not op.supports_autograd or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        if any(word in key for word in _RANDOM + _OTHER):
            continue
        keys.append(key)
    return keys


def select_gradient(key: str, dtype: torch.dtype, count: int):
    """As sweep.select_samples, with requires_grad set on the sample's differentiable inputs."""
    op = sweep._op_db()[key]
    torch.manual_seed(sweep._stable_seed(sweep.SEED, key, dtype, "gradient"))
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=True))
    small = [i for i, s in enumerate(samples)
             if all(t.numel() <= sweep.MAX_NUMEL for t in sweep._tensors((s.input, s.args, s.kwargs)))]
    pool = small or list(range(len(samples)))
    rng = random.Random(f"{sweep.SEED}/{key}/{dtype}/gradient")
    return [(i, samples[i]) for i in sorted(rng.sample(pool, min(count, len(pool))))]


def _gradient_mismatch(ours, ref) -> str | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if (a is None) != (b is None):
            return f"grad[{i}]: ours is {'None' if a is None else 'a tensor'}, eager's is {'None' if b is None else 'a tensor'}"
        if a is None:
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"grad[{i}]: ours {list(a.shape)} {a.dtype}, eager's {list(b.shape)} {b.dtype}"
        if not torch.equal(a.isnan(), b.isnan()):
            return f"grad[{i}]: NaNs at {int((a.isnan() != b.isnan()).sum())} other places than eager's"
        finite = torch.isfinite(b)
        infinite = ~finite & ~b.isnan()
        if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[infinite], b[infinite]):
            return f"grad[{i}]: infinities differ from eager's"
        if finite.any():
            err = (a.double() - b.double())[finite].abs().max().item()
            scale = b.double()[finite].abs().max().item()
            if err > RELATIVE * max(scale, 1e-30) and sweep._mismatch(a, b):
                return f"grad[{i}] {list(b.shape)}: off by {err:.3g} where it reaches {scale:.3g}"
    return None


def run_gradient_sample(key: str, dtype_name: str, index: int, sample) -> sweep.Result:
    import boo_backend

    op = sweep._op_db()[key]
    result = sweep.Result(key, dtype_name, index, "ok", sweep._describe(sample))
    fn, originals = sweep.sample_function(op, sample)
    wrt = [t.requires_grad and t.is_floating_point() for t in originals]

    def run(f):
        tensors = [t.detach().clone().requires_grad_(w) for t, w in zip(originals, wrt)]
        out = f(*tensors)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad
                and o.is_floating_point()]
        inputs = [t for t in tensors if t.requires_grad]
        g = torch.Generator().manual_seed(7)
        cotangents = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, inputs, cotangents, allow_unused=True) if outs and inputs else ()
        detached = tree_unflatten([o.detach() if isinstance(o, torch.Tensor) else o for o in tree_leaves(out)],
                                  tree_flatten(out)[1])
        return detached, list(grads)

    try:
        ref = run(fn)
    except Exception as e:
        result.outcome, result.detail = "skip", f"eager raises {sweep._first_line(e)}"
        return result
    if not ref[1]:
        result.outcome, result.detail = "skip", "no differentiable output or input"
        return result
    boo_backend.reset()
    ours, fallbacks = sweep.through_boo(fn, run, run, result)
    if fallbacks is None:
        return sweep._hang_check(result)
    bad = sweep._compare(key, sample, ours[0], ref[0])
    bad = bad or _gradient_mismatch(ours[1], ref[1])
    if bad:
        result.outcome, result.detail = "WRONG", bad
    elif fallbacks:
        result.outcome, result.detail = "FALLBACK", str(fallbacks[0].message)
    torch._dynamo.reset()
    return sweep._hang_check(result)
