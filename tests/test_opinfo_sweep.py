"""A sweep of PyTorch's own OpInfo samples through torch.compile(backend="boo"), forward only.

Outside strict mode: an op boo cannot compile may fall back to eager PyTorch with a
BooFallbackWarning, but it must never give a wrong result, change an input it was given,
raise where eager does not, or hang. Each sample ends as one of

    ok        the compiled result matches eager
    FALLBACK  it matches, and boo warned that (part of) the graph ran in eager PyTorch
    WRONG     the result differs from eager (shape, dtype or value beyond TOLERANCES)
    CORRUPT   a tensor passed to the compiled function changed (and eager left it alone)
    CRASH     the compiled call raised (or killed the process) where eager did not
    HANG      the sample took longer than HANG_LIMIT_S seconds
    skip      eager raises on the sample too, or Dynamo alone (backend="eager") fails on it

The samples run in a worker process, so that a sample that hangs in native code can be
killed (with its iree-compile children) and the sweep goes on with a fresh worker. One
pytest test per op; the module prints a summary table at the end.

As a script, for diagnosis (prints the table; exit status 1 when a sample is bad):

    python tests/test_opinfo_sweep.py [--ops add,sort] [--dtypes float32,int64]
        [--samples 2] [--no-worker] [--verbose] [--dynamic | --gradient]

(--gradient with no --ops: every differentiable op, tests/gradient_samples.py; about 10 minutes.)

Environment: BOO_OPINFO_SAMPLES (samples per op and dtype, default 1), BOO_OPINFO_DTYPES
(dtypes besides float32 per op in the suite, taken in turn: default 1, or all), BOO_OPINFO_HANG_S
(the HANG limit, default 60 s), BOO_OPINFO_REPORT (a file to write the summary table to).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from util import TOLERANCES  # noqa: E402

# A sample slower than this is a HANG, even if it finishes. boo's own limit per
# iree-compile (BOO_COMPILE_TIMEOUT) is set to the same value; the worker is killed if it
# has not answered KILL_GRACE_S after that.
HANG_LIMIT_S = float(os.environ.get("BOO_OPINFO_HANG_S", "60"))
KILL_GRACE_S = min(30.0, HANG_LIMIT_S)
WORKER_START_S = 180

# One sample per op and dtype keeps the sweep within CI's budget (three took 24 minutes on
# 2 cores); BOO_OPINFO_SAMPLES=3 (or more) widens it.
SAMPLES_PER_DTYPE = int(os.environ.get("BOO_OPINFO_SAMPLES", "1"))
# Samples with more elements than this in one tensor are not picked (if smaller ones exist).
MAX_NUMEL = 4096
SEED = 0

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "bool": torch.bool,
    "float16": torch.float16,
}

# OpInfo entries by `name` or `name.variant_test_name`.
OPS = [
    # arithmetic, elementwise
    "add", "sub", "mul", "div.no_rounding_mode", "div.trunc_rounding", "div.floor_rounding",
    "floor_divide", "remainder", "fmod", "pow", "neg", "abs", "sign", "reciprocal",
    "exp", "exp2", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh",
    "sigmoid", "erf", "atan2", "floor", "ceil", "round", "trunc",
    "clamp", "clamp_min", "clamp_max", "where", "lerp", "maximum", "minimum",
    "addcmul", "addcdiv",
    # comparisons
    "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf",
    # bitwise and logical
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
    "bitwise_left_shift", "bitwise_right_shift",
    "logical_and", "logical_or", "logical_xor", "logical_not",
    # reductions
    "sum", "nansum", "mean", "prod", "amax", "amin", "argmax", "argmin", "var", "std",
    "norm", "linalg.vector_norm", "logsumexp", "any", "all",
    "max.reduction_with_dim", "max.reduction_no_dim", "median",
    # scans
    "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
    # sorting and selection
    "sort", "topk", "argsort", "kthvalue", "msort", "mode",
    # indexing
    "index_select", "gather", "scatter", "scatter_add", "scatter_reduce.sum",
    "scatter_reduce.amax", "index_put", "index_add", "index_copy", "masked_fill",
    "slice_scatter", "select_scatter",
    "masked_select", "masked_scatter", "take_along_dim", "__getitem__",
    # joining, padding, shapes
    "cat", "stack", "nn.functional.pad.constant", "nn.functional.pad.reflect",
    "flip", "roll", "transpose", "permute", "reshape", "expand", "repeat", "tile",
    "tril", "triu", "narrow", "select", "squeeze", "unsqueeze", "flatten", "split", "chunk",
    # nn
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d", "nn.functional.adaptive_avg_pool2d", "nn.functional.embedding",
    "nn.functional.interpolate.nearest", "nn.functional.interpolate.bilinear",
    "nn.functional.interpolate.bicubic", "nn.functional.interpolate.nearest-exact",
    # matmul family
    "mm", "bmm", "addmm", "matmul", "nn.functional.linear", "baddbmm", "einsum", "mv", "dot",
    # softmax, bucketing
    "softmax", "log_softmax", "bucketize", "searchsorted",
    # activations, normalization, losses
    "nn.functional.gelu", "nn.functional.relu", "nn.functional.silu",
    "nn.functional.leaky_relu", "nn.functional.hardtanh", "nn.functional.elu",
    "nn.functional.softplus", "nn.functional.layer_norm", "nn.functional.group_norm",
    "nn.functional.batch_norm", "nn.functional.one_hot", "nn.functional.mse_loss",
    "nn.functional.cross_entropy",
]

BAD = ("WRONG", "CORRUPT", "CRASH", "HANG")
OUTCOMES = ("ok", "FALLBACK", "skip") + BAD

# Ops that return (values, indices): indices may differ on ties, so they are checked by
# gathering the input with them. Value: (position of `dim` in args, its default,
# position of `keepdim` in args or None).
VALUES_INDICES = {
    "sort": (0, -1, None),
    "topk": (1, -1, None),
    "kthvalue": (1, -1, 2),
    "cummax": (0, None, None),
    "cummin": (0, None, None),
    "max.reduction_with_dim": (0, None, 1),
    "mode": (0, -1, 1),
    "median": (0, None, 1),
}
# Ops that return only indices: checked by the values they pick.
INDICES_ONLY = {
    "argsort": (0, -1, None),
    "argmax": (0, None, 1),
    "argmin": (0, None, 1),
}


@dataclass
class Result:
    op: str
    dtype: str
    index: int  # position of the sample in the op's sample_inputs for this dtype
    outcome: str
    shapes: str = ""
    detail: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        detail = " ".join(self.detail.split())
        if len(detail) > 300:
            detail = detail[:297] + "..."
        return (f"{self.outcome:<8} {self.op:<34} {self.dtype:<8} #{self.index:<3} "
                f"{self.shapes:<40} {self.seconds:6.1f}s  {detail}")


# ----------------------------------------------------------------------------------------
# Running one sample (in the worker, or in this process with --no-worker)
# ----------------------------------------------------------------------------------------

_OP_DB = None


def _op_db() -> dict:
    global _OP_DB
    if _OP_DB is None:
        from torch.testing._internal.common_methods_invocations import op_db
        _OP_DB = {}
        for op in op_db:
            key = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
            _OP_DB.setdefault(key, op)
    return _OP_DB


def _stable_seed(*parts) -> int:
    return random.Random("/".join(map(str, parts))).randrange(2**31)


def _tensors(tree):
    from torch.utils._pytree import tree_leaves
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _describe(sample) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"{list(x.shape)}" + ("" if x.is_contiguous() or x.numel() <= 1 else "nc")
        return None
    shapes = [s for s in map(one, _tensors((sample.input, sample.args, sample.kwargs))) if s]
    extra = []
    for a in sample.args:
        if not isinstance(a, torch.Tensor) and not _tensors(a):
            extra.append(repr(a))
    for k, v in sample.kwargs.items():
        if not isinstance(v, torch.Tensor) and not _tensors(v):
            extra.append(f"{k}={v!r}")
    text = " ".join(shapes)
    if extra:
        text += " (" + ", ".join(extra) + ")"
    return text if len(text) <= 120 else text[:117] + "..."


def _interpolate_samples(mode):
    """Sizes and scale factors that do not divide, 1x and 2x sides, down- and upsampling."""
    def make(dtype):
        from torch.testing._internal.opinfo.core import SampleInput

        image = lambda *shape: torch.rand(*shape).to(dtype)  # noqa: E731
        corners = {"mode": mode, **({} if mode.startswith("nearest") else {"align_corners": False})}
        return [SampleInput(image(1, 1, 2, 2), size=[6, 10], **corners),
                SampleInput(image(1, 2, 7, 4), scale_factor=[0.6, 4.7], **corners)]
    return make


def _scatter_samples(key):
    """Negative starts, ends and indices; a block along the first dim (an IREE copy, once)."""
    def make(dtype):
        from torch.testing._internal.opinfo.core import SampleInput

        values = lambda *shape: torch.randn(*shape).to(dtype) if dtype.is_floating_point else             torch.randint(-9, 9, shape).to(dtype)  # noqa: E731
        if key == "slice_scatter":
            return [SampleInput(values(8, 4), args=(values(4, 4), 0, 3, -1)),
                    SampleInput(values(8, 4), args=(values(4, 4), 0, -5, -1)),
                    SampleInput(values(8, 5), args=(values(8, 2), -1, -4, 8, 2)),
                    SampleInput(values(1, 9, 3), args=(values(1, 3, 3), 1, 2, 5))]
        if key == "select_scatter":
            return [SampleInput(values(8, 4), args=(values(4), 0, -1)),
                    SampleInput(values(3, 6), args=(values(3), -1, -2))]
        return [SampleInput(values(8, 4), args=((torch.tensor([-1, -8, 2]),), values(3, 4))),
                SampleInput(values(8, 4), args=((torch.tensor([-1, -1, 2]),), values(3, 4), True))]
    return make


# boo's own samples, run besides the OpInfo ones picked: the cases that once gave garbage
# (nearest upsampling read past its input) or failed (slice_scatter with a negative end).
EXTRA_SAMPLES = {
    **{f"nn.functional.interpolate.{m}": _interpolate_samples(m)
       for m in ("nearest", "bilinear", "bicubic", "nearest-exact")},
    **{k: _scatter_samples(k) for k in ("slice_scatter", "select_scatter", "index_put")},
}


def select_samples(key: str, dtype: torch.dtype, count: int):
    """A deterministic subset of the op's samples for this dtype, then EXTRA_SAMPLES:
    [(index, sample)]."""
    op = _op_db()[key]
    torch.manual_seed(_stable_seed(SEED, key, dtype))
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))
    small = [i for i, s in enumerate(samples)
             if all(t.numel() <= MAX_NUMEL for t in _tensors((s.input, s.args, s.kwargs)))]
    pool = small or list(range(len(samples)))
    rng = random.Random(f"{SEED}/{key}/{dtype}")
    picked = sorted(rng.sample(pool, min(count, len(pool))))
    extra = EXTRA_SAMPLES[key](dtype) if key in EXTRA_SAMPLES else []
    return [(i, samples[i]) for i in picked] + list(enumerate(extra, start=len(samples)))


def op_dtypes(key: str, wanted) -> list[str]:
    supported = _op_db()[key].supported_dtypes("cpu")
    return [name for name in wanted if DTYPES[name] in supported]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous(), b.contiguous()
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(ints), b.view(ints))
    return torch.equal(a, b)


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    lines = [l for l in text.splitlines() if l.strip()]
    # Dynamo wraps backend errors; the useful part is usually the first line or two.
    return " | ".join(lines[:3])


def _mismatch(ours, ref) -> str | None:
    """None when `ours` matches eager's `ref`, else a one-line reason."""
    from torch.utils._pytree import tree_flatten
    ours_leaves, ours_spec = tree_flatten(ours)
    ref_leaves, ref_spec = tree_flatten(ref)
    if ours_spec != ref_spec:
        return f"structure differs: ours={ours_spec} | eager={ref_spec}"
    for i, (a, b) in enumerate(zip(ours_leaves, ref_leaves)):
        what = f"out[{i}]" if len(ref_leaves) > 1 else "out"
        if not isinstance(b, torch.Tensor):
            if a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
                return f"{what}: ours={a!r} | eager={b!r}"
            continue
        if not isinstance(a, torch.Tensor):
            return f"{what}: ours={type(a).__name__} | eager=Tensor"
        if a.shape != b.shape:
            return f"{what} shape: ours={list(a.shape)} | eager={list(b.shape)}"
        if a.dtype != b.dtype:
            return f"{what} dtype: ours={a.dtype} | eager={b.dtype}"
        rtol, atol = TOLERANCES.get(b.dtype, (0, 0))
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True,
                                       check_device=False, check_stride=False)
        except AssertionError as e:
            msg = [l.strip() for l in str(e).splitlines() if l.strip()]
            useful = [l for l in msg if l.startswith(("Mismatched", "Greatest"))]
            return f"{what}: " + "; ".join(useful or msg[:2])
    return None


def _arg(sample, pos, name, default):
    if name in sample.kwargs:
        return sample.kwargs[name]
    if pos is not None and len(sample.args) > pos and not isinstance(sample.args[pos], torch.Tensor):
        return sample.args[pos]
    return default


def _pick(inp: torch.Tensor, idx: torch.Tensor, dim, keepdim) -> torch.Tensor:
    """The elements of `inp` that indices `idx` (as returned along `dim`) point at."""
    if dim is None:
        return inp.reshape(-1)[idx]
    if inp.dim() == 0:
        return inp.clone() if idx.dim() == 0 else inp.reshape(1)[idx]
    if not keepdim and idx.dim() < inp.dim():
        return torch.gather(inp, dim, idx.unsqueeze(dim)).squeeze(dim)
    return torch.gather(inp, dim, idx)


def _compare(key, sample, ours, ref) -> str | None:
    """Like _mismatch, but indices of ties may differ where the op leaves them open."""
    spec = VALUES_INDICES.get(key) or INDICES_ONLY.get(key)
    inp = sample.input
    if spec is None or not isinstance(inp, torch.Tensor):
        return _mismatch(ours, ref)
    pos, default, keep_pos = spec
    dim = _arg(sample, pos, "dim", default)
    keepdim = _arg(sample, keep_pos, "keepdim", False) if keep_pos is not None else False
    if key in VALUES_INDICES:
        if not (isinstance(ref, tuple) and len(ref) == 2):
            return _mismatch(ours, ref)
        if not (isinstance(ours, tuple) and len(ours) == 2):
            return f"ours={type(ours).__name__} | eager=(values, indices)"
        bad = _mismatch_meta(ours[0], ref[0])
        if bad:
            return "values " + bad
        bad = _mismatch_meta(ours[1], ref[1])
        if bad:
            return "indices " + bad
        values, wanted = ours[0], ref[0]
        if key == "topk" and not _arg(sample, 3, "sorted", True) and values.dim() > 0:
            # unsorted top-k: any order of the same values
            values, wanted = values.sort(dim).values, wanted.sort(dim).values
        bad = _mismatch(values, wanted)
        if bad:
            return "values " + bad
        bad = _mismatch(_pick(inp, ours[1], -1 if dim is None else dim, keepdim), ours[0])
        if bad:
            return "indices point at other values than ours: " + bad
        return _permutation_mismatch(key, sample, ours[1], ref[1], dim)
    # indices only
    if not isinstance(ours, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return _mismatch(ours, ref)
    bad = _mismatch_meta(ours, ref)
    if bad:
        return bad
    if _mismatch(ours, ref) is None:
        return None
    if key == "argsort" and inp.dim() == 0:
        return _mismatch(ours, ref)
    chosen, wanted = _pick(inp, ours, dim, keepdim), _pick(inp, ref, dim, keepdim)
    bad = _mismatch(chosen, wanted)
    if bad:
        return "indices point at other values: " + bad
    return _permutation_mismatch(key, sample, ours, ref, dim)


def _permutation_mismatch(key, sample, ours, ref, dim) -> str | None:
    """sort and argsort: indices must be a permutation along dim, and with stable=True
    exactly eager's."""
    if key not in ("sort", "argsort") or ref.dim() == 0:
        return None
    if sample.kwargs.get("stable", False):
        bad = _mismatch(ours, ref)
        return bad and "stable sort, indices differ: " + bad
    bad = _mismatch(ours.sort(dim).values, ref.sort(dim).values)
    return bad and "indices are not a permutation: " + bad


def _mismatch_meta(a, b) -> str | None:
    if not isinstance(a, torch.Tensor):
        return f"ours={type(a).__name__} | eager=Tensor"
    if a.shape != b.shape:
        return f"shape: ours={list(a.shape)} | eager={list(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype: ours={a.dtype} | eager={b.dtype}"
    return None


def sample_function(op, sample):
    """(fn, tensors): the sample as a function of its tensors (its other arguments fixed)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def fn(*tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        inp, args, kwargs = tree_unflatten(filled, spec)
        return op.op(inp, *args, **kwargs)

    return fn, [leaves[i] for i in positions]


def run_sample(key: str, dtype_name: str, index: int, sample) -> Result:
    """Eager and compiled on clones of the same inputs; classify the outcome."""
    op = _op_db()[key]
    shapes = _describe(sample)
    result = Result(key, dtype_name, index, "ok", shapes)
    fn, originals = sample_function(op, sample)

    def clones():
        return [t.clone() for t in originals]

    # Eager first: a sample eager rejects is not boo's business.
    eager_inputs = clones()
    try:
        ref = fn(*eager_inputs)
    except Exception as e:
        result.outcome, result.detail = "skip", f"eager raises {_first_line(e)}"
        return result

    ours_inputs = clones()
    ours, fallbacks = through_boo(fn, lambda f: f(*ours_inputs), lambda f: f(*clones()), result)
    if fallbacks is None:
        return _hang_check(result)

    # Inputs: each must be bitwise what it was, unless eager changes it too (then the same).
    for n, (orig, before_eager, mine) in enumerate(zip(originals, eager_inputs, ours_inputs)):
        if _bitwise_equal(mine, orig):
            if _bitwise_equal(before_eager, orig):
                continue
            result.outcome = "WRONG"
            result.detail = f"input {n} {list(orig.shape)}: eager changes it in place, boo does not"
            return _hang_check(result)
        if not _bitwise_equal(before_eager, orig):  # eager mutates it as well
            bad = _mismatch(mine, before_eager)
            if bad is None:
                continue
            result.outcome, result.detail = "WRONG", f"in-place input {n}: {bad}"
            return _hang_check(result)
        result.outcome = "CORRUPT"
        changed = (mine.reshape(-1) != orig.reshape(-1)) & ~(mine.reshape(-1).isnan() & orig.reshape(-1).isnan()) \
            if mine.shape == orig.shape else None
        count = "" if changed is None else f", {int(changed.sum())} of {orig.numel()} elements changed"
        result.detail = f"input {n} {list(orig.shape)} {orig.dtype} was overwritten{count}"
        torch._dynamo.reset()
        return _hang_check(result)

    bad = _compare(key, sample, ours, ref)
    if bad:
        result.outcome = "WRONG"
        result.detail = bad
        if fallbacks:
            result.detail += f" [after fallback: {str(fallbacks[0].message)[:120]}]"
    elif fallbacks:
        result.outcome = "FALLBACK"
        result.detail = str(fallbacks[0].message)
    torch._dynamo.reset()
    return _hang_check(result)


def through_boo(fn, call, call_again, result: Result):
    """`call(compiled fn)` with fn compiled by boo, timed into `result`: (its value, boo's
    fallback warnings). Where it raises, (None, None) with `result` a skip when `call_again`
    fails with Dynamo alone (no boo in the way), else a CRASH."""
    import boo_backend

    torch._dynamo.reset()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ours = call(torch.compile(fn, backend="boo", dynamic=False))
            error = None
        except Exception as e:
            error = e
    result.seconds = time.perf_counter() - start
    if error is None:
        return ours, [w for w in caught if issubclass(w.category, boo_backend.BooFallbackWarning)]
    torch._dynamo.reset()
    try:
        call_again(torch.compile(fn, backend="eager", dynamic=False))
    except Exception as e2:
        result.outcome, result.detail = "skip", f"Dynamo alone fails: {_first_line(e2)}"
    else:
        result.outcome, result.detail = "CRASH", _first_line(error)
    torch._dynamo.reset()
    return None, None


def own_worker(tmp_path_factory):
    """A module's own Worker (the dynamic and gradient sweeps), stopped at its end: made a
    module-scoped fixture there."""
    pytest.importorskip("expecttest")  # op_db imports it
    w = Worker(worker_env(str(tmp_path_factory.getbasetemp() / "boo-cache")))
    yield w
    w.stop()


def _hang_check(result: Result) -> Result:
    if result.seconds > HANG_LIMIT_S:
        result.detail = f"took {result.seconds:.1f} s (limit {HANG_LIMIT_S:g} s); would be {result.outcome}: {result.detail}"
        result.outcome = "HANG"
    return result


def iter_op(key: str, dtypes, count: int, done=(), dynamic: bool = False, gradient: bool = False):
    """Yield ("start", dtype, index, shapes) before and a Result after each sample; with
    `dynamic`, each sample is compiled with dynamic shapes and run at several sizes
    (tests/dynamic_samples.py); with `gradient`, differentiated (tests/gradient_samples.py)."""
    run, select = run_sample, select_samples
    if dynamic:
        from dynamic_samples import run_dynamic_sample as run, select_dynamic as select
    elif gradient:
        from gradient_samples import run_gradient_sample as run, select_gradient as select
    done = {tuple(d) for d in done}
    for dtype_name in op_dtypes(key, dtypes):
        try:
            picked = select(key, DTYPES[dtype_name], count)
        except Exception as e:
            yield Result(key, dtype_name, -1, "skip", "", f"sample_inputs raises {_first_line(e)}")
            continue
        for index, sample in picked:
            if (dtype_name, index) in done:
                continue
            yield ("start", dtype_name, index, _describe(sample))
            try:
                yield run(key, dtype_name, index, sample)
            except Exception as e:  # a bug in this harness, not in boo: say so loudly
                yield Result(key, dtype_name, index, "CRASH", _describe(sample),
                             f"harness error: {_first_line(e)} {traceback.format_exc(limit=-2)}")


def worker_main() -> None:
    """Serve requests on stdin; answer JSON lines on the original stdout. Everything
    else that writes to stdout (torch, boo, native code) goes to stderr instead."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    warnings.simplefilter("ignore")
    import boo_backend  # noqa: F401  (import cost here, not in the first sample)
    _op_db()
    channel.write(json.dumps({"event": "ready"}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        for item in iter_op(request["op"], request["dtypes"], request["count"], request["done"],
                            request.get("dynamic", False), request.get("gradient", False)):
            # Results of tests/dynamic_samples.py are of this module's Result imported by name,
            # not of __main__'s: tell them from the start messages by type, not by class.
            if not isinstance(item, tuple):
                channel.write(json.dumps({"event": "result", **asdict(item)}) + "\n")
            else:
                _, dtype_name, index, shapes = item
                channel.write(json.dumps({"event": "start", "dtype": dtype_name, "index": index,
                                          "shapes": shapes}) + "\n")
        channel.write(json.dumps({"event": "done"}) + "\n")


# ----------------------------------------------------------------------------------------
# The parent side: a worker that can be killed when a sample hangs
# ----------------------------------------------------------------------------------------

class Worker:
    def __init__(self, env: dict):
        self.env = env
        self.proc = None
        self.buffer = b""
        self.log = tempfile.NamedTemporaryFile(prefix="boo-opinfo-worker-", suffix=".log", delete=False)

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=self.env, cwd=os.path.dirname(HERE), start_new_session=True,
        )
        self.buffer = b""
        message = self._read(WORKER_START_S)
        if not message or message.get("event") != "ready":
            self.stop()
            raise RuntimeError(f"the OpInfo worker did not start: {message!r}; log: {self._log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and its iree-compile
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc = None

    def _log_tail(self, n: int = 600) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return " ".join(f.read().decode(errors="replace").split())

    def _read(self, timeout: float):
        """The next message; None on timeout; {"event": "died"} when the worker exited."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    self.proc.wait()
                    return {"event": "died", "rc": self.proc.returncode}
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run_op(self, key: str, dtypes, count: int, dynamic: bool = False, gradient: bool = False) -> list[Result]:
        results: list[Result] = []
        while True:
            if self.proc is None:
                self._start()
            done = [[r.dtype, r.index] for r in results]
            self.proc.stdin.write((json.dumps({"op": key, "dtypes": list(dtypes), "count": count,
                                               "done": done, "dynamic": dynamic,
                                               "gradient": gradient}) + "\n").encode())
            self.proc.stdin.flush()
            current, started = None, time.monotonic()
            while True:
                message = self._read(HANG_LIMIT_S + KILL_GRACE_S if current else WORKER_START_S)
                if message is None or message["event"] == "died":
                    if current is None:  # not inside a sample: nothing to blame
                        self.stop()
                        raise RuntimeError(f"the OpInfo worker stopped answering: {message!r}; "
                                           f"log: {self._log_tail()}")
                    elapsed = time.monotonic() - started
                    if message is None:
                        outcome, detail = "HANG", f"no answer after {elapsed:.0f} s; worker killed"
                    else:
                        outcome = "CRASH"
                        detail = f"worker process died (exit {message['rc']}): {self._log_tail(300)}"
                    self.stop()
                    results.append(Result(key, current[0], current[1], outcome, current[2],
                                          detail, elapsed))
                    break  # a fresh worker goes on after this sample
                if message["event"] == "start":
                    current = (message["dtype"], message["index"], message["shapes"])
                    started = time.monotonic()
                elif message["event"] == "result":
                    del message["event"]
                    results.append(Result(**message))
                    current = None
                elif message["event"] == "done":
                    return results


def worker_env(cache_dir: str) -> dict:
    env = dict(os.environ)
    for var in ("BOO_FORCE_DECOMPOSE", "BOO_DUMP_DIR", "BOO_CACHE", "BOO_TARGET"):
        env.pop(var, None)
    env["BOO_STRICT"] = "0"
    env["BOO_COMPILE_TIMEOUT"] = str(max(1, round(HANG_LIMIT_S)))
    env["BOO_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
    return env


def summary(results: list[Result], wall: float | None = None, verbose: bool = False) -> str:
    counts = Counter(r.outcome for r in results)
    ops = len({r.op for r in results})
    head = f"OpInfo sweep through boo: {len(results)} samples of {ops} ops"
    if wall is not None:
        head += f" in {wall:.0f} s"
    lines = [head, "  " + "  ".join(f"{o}={counts.get(o, 0)}" for o in OUTCOMES)]
    order = {o: i for i, o in enumerate(BAD + ("FALLBACK", "skip", "ok"))}
    shown = [r for r in results if verbose or r.outcome != "ok"]
    for r in sorted(shown, key=lambda r: (order[r.outcome], r.op, r.dtype, r.index)):
        lines.append("  " + r.line())
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# pytest
# ----------------------------------------------------------------------------------------

_RESULTS: list[Result] = []


@pytest.fixture(scope="module")
def worker(tmp_path_factory, request):
    pytest.importorskip("expecttest")  # op_db imports it
    w = Worker(worker_env(str(tmp_path_factory.getbasetemp() / "boo-cache")))
    start = time.monotonic()
    yield w
    w.stop()
    if _RESULTS:
        text = summary(_RESULTS, time.monotonic() - start)
        if os.environ.get("BOO_OPINFO_REPORT"):
            with open(os.environ["BOO_OPINFO_REPORT"], "w") as f:
                f.write(text + "\n")
        # Past pytest's output capture, so that the table shows in a normal run.
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if capture is not None and reporter is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line("")
                for line in text.splitlines():
                    reporter.write_line(line)
        else:
            print(text)


@pytest.fixture(autouse=True)
def _not_strict(monkeypatch):
    """This sweep is about clean fallbacks: outside strict mode (the worker gets it too)."""
    monkeypatch.setenv("BOO_STRICT", "0")


# Dtypes per op in the suite: float32 and this many of the others, a different choice per
# op, so that every dtype is covered by many ops (all five cost CI about 9 minutes);
# BOO_OPINFO_DTYPES=all checks every op in every dtype.
OTHER_DTYPES = os.environ.get("BOO_OPINFO_DTYPES", "1")


def dtypes_for(key: str) -> list[str]:
    others = [d for d in DTYPES if d != "float32"]
    if OTHER_DTYPES == "all" or int(OTHER_DTYPES) >= len(others):
        return list(DTYPES)
    start = OPS.index(key) % len(others)
    return ["float32"] + [others[(start + i) % len(others)] for i in range(int(OTHER_DTYPES))]


@pytest.mark.parametrize("key", OPS)
@pytest.mark.sweep(0.6)
def test_opinfo(key, worker):
    results = worker.run_op(key, dtypes_for(key), SAMPLES_PER_DTYPE)
    _RESULTS.extend(results)
    bad = [r for r in results if r.outcome in BAD]
    assert not bad, f"{key}: {len(bad)} bad samples\n" + "\n".join(r.line() for r in bad)


# ----------------------------------------------------------------------------------------
# script
# ----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma list of OpInfo keys (default: the sweep's list); "
                        "'all' for every op in op_db")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma list among " + ",".join(DTYPES))
    parser.add_argument("--samples", type=int, default=SAMPLES_PER_DTYPE, help="samples per op and dtype")
    parser.add_argument("--no-worker", action="store_true",
                        help="run in this process (no protection against hangs; for debugging)")
    parser.add_argument("--cache-dir", help="BOO_CACHE_DIR (default: a fresh temporary directory)")
    parser.add_argument("--verbose", "-v", action="store_true", help="a line for every sample")
    parser.add_argument("--dynamic", action="store_true",
                        help="compile with dynamic shapes and run each sample at several sizes")
    parser.add_argument("--gradient", action="store_true",
                        help="differentiate each sample too (its outputs and gradients against eager's)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return 0
    if args.ops == "all":
        ops = sorted(_op_db())
    elif args.gradient and not args.ops:
        from gradient_samples import differentiable_ops
        ops = differentiable_ops()
    elif args.ops:
        ops = args.ops.split(",")
        unknown = [k for k in ops if k not in _op_db()]
        if unknown:
            parser.error(f"not in op_db: {', '.join(unknown)}")
    else:
        ops = OPS
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtypes {unknown}; choose among {', '.join(DTYPES)}")
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="boo-opinfo-cache-")
    env = worker_env(cache_dir)
    start = time.monotonic()
    results: list[Result] = []
    if args.no_worker:
        os.environ.update(env)
        warnings.simplefilter("ignore")
        for key in ops:
            for item in iter_op(key, dtypes, args.samples, dynamic=args.dynamic, gradient=args.gradient):
                if not isinstance(item, tuple):  # a Result (see worker_main)
                    results.append(item)
                    if args.verbose or item.outcome != "ok":
                        print(item.line(), flush=True)
    else:
        w = Worker(env)
        try:
            for key in ops:
                t0 = time.monotonic()
                got = w.run_op(key, dtypes, args.samples, args.dynamic, args.gradient)
                results.extend(got)
                counts = Counter(r.outcome for r in got)
                print(f"{key:<36} {time.monotonic() - t0:6.1f}s  "
                      + " ".join(f"{o}={n}" for o, n in sorted(counts.items())), flush=True)
                for r in got:
                    if args.verbose or r.outcome != "ok":
                        print("    " + r.line(), flush=True)
        finally:
            w.stop()
        print(f"(worker log: {w.log.name})")
    print()
    print(summary(results, time.monotonic() - start, args.verbose))
    return 1 if any(r.outcome in BAD for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
