"""OpInfo samples at other sizes, for the dynamic-shape sweep (tests/test_opinfo_dynamic.py).

A sample is compiled once with dynamic=True at its own size, then called at other sizes: one
size of the sample (the one most of its tensors share, and that none of its other arguments
names) becomes, in every tensor at once, each of `other_sizes`: below the first, odd and
above it, past 64 and past 128, none a multiple of 16. A tensor grows by repeating itself
along that dim and is then made aperiodic (floats scaled by a random factor in [0.75, 1.25],
which keeps signs and most domains), so a position read from the wrong place shows. Every
size is compared with eager on the same resized sample; a size eager rejects is skipped.
"""

from __future__ import annotations

import random
import time
import types
import warnings
from collections import Counter

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

import test_opinfo_sweep as sweep

MAX_NUMEL = 1 << 21  # a resized tensor larger than this skips that size
# Composite ops: also their backward (dynamic composites compute both).
WITH_GRAD = {"softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.gelu",
             "nn.functional.group_norm", "nn.functional.batch_norm", "nn.functional.rms_norm",
             "nn.functional.scaled_dot_product_attention"}


def other_sizes(size: int) -> list[int]:
    """Below (when above 2: Dynamo specializes 1), odd above, past 64, past 128."""
    above = size + 3 if (size + 3) % 2 else size + 4
    out = ([size - 1] if size > 2 else []) + [above, 67, 131]
    return [n for n in dict.fromkeys(out) if n != size]


def varied_size(sample) -> int | None:
    """The size to vary: the most common tensor size >= 2 that no other argument names."""
    leaves = tree_leaves((sample.input, sample.args, sample.kwargs))
    named = {v for v in leaves if isinstance(v, int) and not isinstance(v, bool)}
    counts = Counter(d for t in leaves if isinstance(t, torch.Tensor) for d in t.shape if d >= 2)
    ranked = sorted((c, d) for d, c in counts.items() if d not in named)
    return ranked[-1][1] if ranked else None


def select_dynamic(key: str, dtype: torch.dtype, count: int):
    """As sweep.select_samples, among the samples with a size of 3 or more to vary (of 2
    where none has one)."""
    op = sweep._op_db()[key]
    torch.manual_seed(sweep._stable_seed(sweep.SEED, key, dtype, "dynamic"))
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))
    small = [i for i, s in enumerate(samples)
             if all(t.numel() <= sweep.MAX_NUMEL for t in sweep._tensors((s.input, s.args, s.kwargs)))]
    pool = ([i for i in small if (varied_size(samples[i]) or 0) >= 3]
            or [i for i in small if varied_size(samples[i])])
    rng = random.Random(f"{sweep.SEED}/{key}/{dtype}/dynamic")
    picked = sorted(rng.sample(pool, min(count, len(pool))))
    return [(i, samples[i]) for i in picked]


def _resize(t: torch.Tensor, old: int, new: int, g: torch.Generator) -> torch.Tensor:
    out = t.detach()
    for dim, size in enumerate(t.shape):
        if size == old:
            reps = [1] * t.dim()
            reps[dim] = -(-new // old)
            out = out.repeat(*reps).narrow(dim, 0, new)
    out = out.contiguous()
    if out.is_floating_point():
        out = out * (0.75 + 0.5 * torch.rand(out.shape, generator=g)).to(out.dtype)
        if t.dim() and t.shape[-1] > 1 and bool((t.diff(dim=-1) >= 0).all()):
            out = out.sort(-1).values  # a sorted sequence (bucketize's boundaries) stays sorted
    return out.requires_grad_(t.requires_grad)


def run_dynamic_sample(key: str, dtype_name: str, index: int, sample) -> sweep.Result:
    import boo_backend

    op = sweep._op_db()[key]
    result = sweep.Result(key, dtype_name, index, "ok", sweep._describe(sample))
    size = varied_size(sample)
    if size is None:
        result.outcome, result.detail = "skip", "no size to vary"
        return result
    fn, first = sweep.sample_function(op, sample)
    grad = key in WITH_GRAD and sweep.DTYPES[dtype_name].is_floating_point

    def run(f, tensors):
        tensors = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in tensors]
        out = f(*tensors)
        if not grad:
            return out
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [t for t in tensors if t.requires_grad]
        g = torch.Generator().manual_seed(7)
        cot = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, wrt, cot, allow_unused=True) if outs and wrt else ()
        return (tree_unflatten([o.detach() if isinstance(o, torch.Tensor) else o for o in tree_leaves(out)],
                               tree_flatten(out)[1]), [g for g in grads])

    g = torch.Generator().manual_seed(sweep._stable_seed(key, dtype_name, index))
    variants = [(size, first)] + [(n, [_resize(t, size, n, g) for t in first]) for n in other_sizes(size)]
    torch._dynamo.reset()
    boo_backend.reset()
    compiled = torch.compile(fn, backend="boo", dynamic=True)
    start = time.perf_counter()
    ran, fallbacks = [], []
    for n, tensors in variants:
        if n != size and any(t.numel() > MAX_NUMEL for t in tensors):
            continue
        try:
            ref = run(fn, tensors)
        except Exception:
            if n == size:
                result.outcome, result.detail = "skip", "eager raises at the sample's own size"
                return result
            continue  # a size that this sample's other arguments do not allow
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ours = run(compiled, tensors)
            except Exception as e:
                result.outcome, result.detail = "CRASH", f"at size {n} (first {size}): {sweep._first_line(e)}"
                break
        fallbacks += [w for w in caught if issubclass(w.category, boo_backend.BooFallbackWarning)]
        at = types.SimpleNamespace(input=tensors[0] if first[:1] and first[0] is sample.input else sample.input,
                                   args=sample.args, kwargs=sample.kwargs)
        bad = sweep._compare(key, at, ours[0] if grad else ours, ref[0] if grad else ref)
        if bad is None and grad:
            bad = sweep._mismatch(ours[1], ref[1])
            bad = bad and "grad " + bad
        if bad:
            result.outcome, result.detail = "WRONG", f"at size {n} (first {size}): {bad}"
            break
        ran.append(n)
    result.seconds = time.perf_counter() - start
    if result.outcome == "ok":
        dynamic = any(p.dynamic for p in boo_backend.placements())
        result.detail = f"sizes {size}->{ran[1:]}" + ("" if dynamic else ", compiled per shape")
        if len(ran) < 2:
            result.outcome, result.detail = "skip", f"eager takes no other size than {size}"
        elif fallbacks:
            result.outcome = "FALLBACK"
            result.detail += f"; {str(fallbacks[0].message)[:160]}"
    torch._dynamo.reset()
    return sweep._hang_check(result)
