"""Correct or refused: dtypes, the caller's tensors, odd inputs and outputs, compile limits,
errors, and the cache directory's owner."""

import os
import stat
import warnings

import pytest
import torch

import boo_backend
from boo_backend.cache import CompileCache, clear_memory
from util import assert_close, compare_training


def _compile(fn, **kw):
    return torch.compile(fn, backend="boo", **kw)


def _exact(ours, ref, what="value"):
    """Integers and booleans exactly; floats (atan2 of booleans) within their tolerance:
    libm's and IREE's atan2(1, 1) differ in the last bit on some CPUs (AMD family 25)."""
    ours = ours if isinstance(ours, (tuple, list)) else (ours,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.dtype == b.dtype, f"{what}[{i}] dtype: ours={a.dtype} | torch={b.dtype}"
        if b.is_floating_point():
            assert_close(a, b, f"{what}[{i}]")
            continue
        assert torch.equal(a, b), f"{what}[{i}]: ours={a.tolist()} | torch={b.tolist()}"


@pytest.fixture
def lenient(monkeypatch):
    """Outside strict mode: fallbacks allowed, with their warnings recorded."""
    monkeypatch.setenv("BOO_STRICT", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


# -- dtypes --------------------------------------------------------------------------------


def test_float64_model_trains_in_f64():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()
    batches = [(torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64))]
    compare_training(model, batches, torch.nn.functional.mse_loss)


def test_float64_softmax_from_float32():
    x = torch.randn(4, 8)
    fn = lambda x: torch.softmax(x * 3, 0, dtype=torch.float64)  # noqa: E731
    assert_close(_compile(fn)(x), fn(x), "softmax")


def test_float64_math_boo_cannot_compute_runs_as_an_island(lenient):
    """float64 erfc has no IREE form that keeps float64's precision: that op alone runs in
    eager, with a warning (the others: tests/test_float64_math.py)."""
    x = torch.randn(4, 8, dtype=torch.float64)
    fn = lambda x: (x * 2).erfc().sum(0) + 1  # noqa: E731
    assert_close(_compile(fn)(x), fn(x), "erfc")
    assert any("erfc" in str(w.message) for w in lenient)
    assert boo_backend.placements()[-1].island == 1


INT64 = torch.tensor(
    [2**62, -(2**62), 2**53 + 1, 2**31 + 5, -7, 100, -100, 2**63 - 1, -(2**63)], dtype=torch.int64
)


def test_int64_exact_beyond_2_53():
    def fn(t, d):
        return (t * 3, t + t, t // 7, t // -7, t // d, t % 7, torch.remainder(t, -5), torch.fmod(t, 5),
                torch.div(t, 3, rounding_mode="trunc"), t << 2, t >> 3, (t * 3 + 1) // 7, t.sum())

    d = torch.tensor([3, -3, 5, 7, 2, -9, 11, 13, -17])
    _exact(_compile(fn)(INT64, d), fn(INT64, d), "int64")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8, torch.bool])
def test_small_integer_and_bool_dtypes(dtype, lenient):
    torch.manual_seed(0)
    if dtype == torch.bool:
        x, y = torch.rand(16) > 0.5, torch.rand(16) > 0.5
        fn = lambda x, y: (x & y, x | ~y, x ^ y, x.sum(), torch.atan2(x, y), x + y)  # noqa: E731
    else:
        lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
        x, y = torch.randint(lo, hi, (16,), dtype=dtype), torch.randint(1, 100, (16,), dtype=dtype)
        fn = lambda x, y: (x * y, x + y, x - y, x // y, x % y, x > y, x.sum(), x >> 1,  # noqa: E731
                           torch.maximum(x, y), x.to(torch.float32), x.to(torch.int64))
    _exact(_compile(fn)(x, y), fn(x, y), str(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_reductions_accumulate_in_f32(dtype):
    x = torch.randn(64, 33, dtype=dtype) * 4
    fn = lambda x: (x.sum(), x.exp().sum(1), x.mean(0), torch.linalg.vector_norm(x, 6), x.cumsum(1))  # noqa: E731
    # the same rounding as eager, which accumulates in f32 and rounds once
    assert_close(_compile(fn)(x), fn(x), str(dtype), rtol=1e-2, atol=1e-2)
    s = torch.tensor(8.48, dtype=torch.float16)
    assert_close(_compile(lambda s: torch.linalg.vector_norm(s, 6))(s), torch.linalg.vector_norm(s, 6), "0-d norm")


def test_mixed_dtypes_follow_type_promotion():
    a, b, c = torch.randint(0, 5, (4,)), torch.randn(4, dtype=torch.float16), torch.rand(4) > 0.5
    fn = lambda a, b, c: (a + b, a * c, b + c, a / 3, c + 1, a + 2.5)  # noqa: E731
    assert_close(_compile(fn)(a, b, c), fn(a, b, c), "promotion")


def test_atan2_special_values():
    inf, nan = float("inf"), float("nan")
    y = torch.tensor([0.0, 0.0, -0.0, -0.0, 1.0, inf, inf, -inf, -inf, inf, -1.0, nan, 2.0])
    x = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0, inf, -inf, inf, -inf, 1.0, -inf, 0.0, 3.0])
    ours, ref = _compile(torch.atan2)(y, x), torch.atan2(y, x)
    torch.testing.assert_close(ours, ref, equal_nan=True, msg=lambda m: f"atan2: {m}")
    assert torch.equal(ours.signbit(), ref.signbit()), f"signs: ours={ours} | torch={ref}"


def test_complex_is_declined_cleanly(lenient):
    c = torch.randn(4, dtype=torch.complex64)
    assert torch.equal(_compile(lambda x: x * 2 + 1)(c), c * 2 + 1)
    assert any("complex64 tensors are not supported" in str(w.message) for w in lenient)


def test_complex_in_strict_mode_is_a_boo_error():
    with pytest.raises(boo_backend.BooStrictError, match="complex64"):
        _compile(lambda x: x * 2)(torch.randn(4, dtype=torch.complex64))


# -- the caller's tensors ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sort", "sort_sorted", "topk", "scatter_add", "index_put", "index_add", "cumsum"])
def test_in_place_kernels_leave_inputs_alone(name):
    torch.manual_seed(0)
    x, idx, src = torch.randn(12), torch.randint(0, 12, (5,)), torch.randn(5)
    fns = {
        "sort": lambda x, i, s: torch.sort(x),
        "sort_sorted": lambda x, i, s: torch.sort(x.sort()[0].flip(0) * 1, descending=True),
        "topk": lambda x, i, s: torch.topk(x, 3),
        "scatter_add": lambda x, i, s: x.scatter_add(0, i, s),
        "index_put": lambda x, i, s: x.index_put((i,), s, accumulate=True),
        "index_add": lambda x, i, s: x.index_add(0, i, s),
        "cumsum": lambda x, i, s: x.cumsum(0),
    }
    fn = fns[name]
    before = [t.clone() for t in (x, idx, src)]
    ours = _compile(fn)(x, idx, src)
    for t, b in zip((x, idx, src), before):
        assert torch.equal(t, b), f"{name} changed an input: ours={t} | before={b}"
    assert_close(ours, fn(x, idx, src), name)


def test_sorted_input_stays_intact_on_later_calls():
    """A module that sorts in place must not rely on the first call's data to be caught."""
    fn = _compile(lambda x: torch.sort(x, descending=True))
    fn(torch.arange(8.0).flip(0))  # already sorted: nothing to see on the first call
    x = torch.randn(8)
    before = x.clone()
    fn(x)
    assert torch.equal(x, before)


def test_program_mutation_applied_exactly_once():
    def fn(x, y):
        x.add_(1)
        y[1:3].mul_(2)
        return x * y

    x, y = torch.randn(5), torch.randn(5)
    xr, yr = x.clone(), y.clone()
    assert_close(_compile(fn)(x, y), fn(xr, yr), "result")
    assert_close(x, xr, "x")
    assert_close(y, yr, "y")


def test_expanded_outputs_keep_eager_strides():
    fn = lambda x, s: ((x + 1).expand(4, 8), (s * 2).expand(5), (x * 3).expand(2, 4, 8).transpose(0, 1))  # noqa: E731
    x, s = torch.randn(1, 8), torch.randn(1)
    ours, ref = _compile(fn)(x, s), fn(x, s)
    assert_close(ours, ref, "expand")
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.stride() == b.stride(), f"output {i} stride: ours={a.stride()} | torch={b.stride()}"


# -- odd inputs ----------------------------------------------------------------------------


def test_odd_inputs():
    base = torch.randn(6, 8)
    cases = [
        ("0-d", lambda a: a * 2 + a.exp(), (torch.tensor(1.5),)),
        ("empty", lambda a: (a * 2, a.sum(1), a.sum()), (torch.randn(0, 4),)),
        ("empty middle", lambda a: (a + 1, a.mean(-1)), (torch.randn(3, 0, 4),)),
        ("non-contiguous", lambda a: a * 2 + 1, (base.t(),)),
        ("strided slice", lambda a: a.sum(0), (base[::2, 1::3],)),
        ("expanded", lambda a: a * 2 + a.sum(), (torch.randn(1, 5).expand(3, 5),)),
        ("same tensor twice", lambda a, b: a.sort()[0] + b, (base[0], base[0])),
        ("view and base", lambda a, b: a + b.sum(), (base, base[1:3])),
        ("python scalar", lambda a, s: a * s + s, (base, 2.5)),
        ("int and bool outputs", lambda a: (a.shape[0] * 2, a.sum() > 0, (a > 0).sum()), (base,)),
        ("0-d softmax", lambda a: torch.softmax(a, 0), (torch.tensor(0.3),)),
    ]
    for name, fn, args in cases:
        torch._dynamo.reset()
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        assert_close(_compile(fn)(*args), fn(*args), name)
        for a, b in zip(args, before):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{name}: an input changed"


def test_requires_grad_on_some_inputs_only():
    w = torch.randn(4, 3, requires_grad=True)
    x, b = torch.randn(5, 4), torch.randn(3)
    w2 = w.detach().clone().requires_grad_()
    fn = lambda w, x, b: ((x @ w + b).tanh() ** 2).sum()  # noqa: E731
    out = _compile(fn)(w, x, b)
    out.backward()
    ref = fn(w2, x, b)
    ref.backward()
    assert_close(out, ref, "loss")
    assert_close(w.grad, w2.grad, "grad")


# -- compile limits and errors -------------------------------------------------------------


def _slow_graph(x):
    for _ in range(40):
        x = torch.sin(x @ x.t()) * 0.1 + x.mean()
    return x


def test_compile_timeout_falls_back_and_is_remembered(lenient, monkeypatch):
    monkeypatch.setenv("BOO_COMPILE_TIMEOUT", "0.05")
    x = torch.randn(8, 8)
    assert_close(_compile(_slow_graph)(x), _slow_graph(x), "after timeout")
    text = " ".join(str(w.message) for w in lenient)
    assert "inference_" in text and "0.05 s" in text, text
    assert boo_backend.placements()[-1].recovered
    # a new process (memory cache gone) does not wait again
    clear_memory()
    torch._dynamo.reset()
    compiles = boo_backend.stats().get("iree_compiles", 0)
    lenient.clear()
    assert_close(_compile(_slow_graph)(x), _slow_graph(x), "remembered")
    assert boo_backend.stats().get("iree_compiles", 0) == compiles
    assert any("an earlier run found" in str(w.message) for w in lenient)


def test_compile_timeout_in_strict_mode_is_a_boo_error():
    with pytest.raises(boo_backend.BooStrictError, match="did not finish within"):
        _compile(_slow_graph, options={"compile_timeout": 0.05})(torch.randn(8, 8))


def test_compile_timeout_option_is_validated():
    with pytest.raises(boo_backend.BooError, match="compile_timeout"):
        boo_backend.Options.resolve({"compile_timeout": "soon"})


def test_runtime_errors_are_boo_errors():
    from boo_backend.runtime import BooRuntimeError

    assert issubclass(BooRuntimeError, boo_backend.BooError)


# -- the cache directory -------------------------------------------------------------------


def test_cache_directory_is_created_private(tmp_path):
    directory = tmp_path / "fresh" / "boo"
    cache = CompileCache(directory)
    assert cache.disk
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_cache_directory_writable_by_others_is_refused(tmp_path, caplog):
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, 0o777)
    cache = CompileCache(directory)
    assert not cache.disk
    assert "writable by other users" in caplog.text
    cache.put(cache.key("vmfb", "x"), b"payload")
    assert list(directory.iterdir()) == []


def test_cache_directory_of_another_user_is_refused(tmp_path, caplog, monkeypatch):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)  # as seen by another user
    assert not CompileCache(directory).disk
    assert "belongs to another user" in caplog.text


# -- found on architectures outside the zoo ------------------------------------------------


def test_index_put_with_negative_indices():
    """`x[:, [-2]]` reads wrap in eager, and so must the index_put of its backward (IREE's
    scatter took -2 as an offset and wrote out of bounds)."""
    x = torch.randn(2, 6, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    fn = lambda x: (x[:, [-2, 1], :] * 3).sum()  # noqa: E731
    out = _compile(fn)(x)
    out.backward()
    ref = fn(x2)
    ref.backward()
    assert_close(out, ref, "sum")
    assert_close(x.grad, x2.grad, "grad")
    put = lambda x, v: torch.ops.aten.index_put(x, [torch.tensor([-1, 0])], v, True)  # noqa: E731
    z, v = torch.randn(5, 3), torch.randn(2, 3)
    assert_close(_compile(put)(z, v), put(z, v), "index_put")


def test_weight_norm_backward():
    torch.manual_seed(0)
    v = torch.randn(6, 4, 3, requires_grad=True)
    g = torch.randn(1, 1, 3, requires_grad=True)
    c = torch.randn(6, 4, 3)
    fn = lambda v, g: (torch._weight_norm(v, g, 2) * c).pow(2).sum()  # noqa: E731
    v2, g2 = (t.detach().clone().requires_grad_() for t in (v, g))
    _compile(fn)(v, g).backward()
    fn(v2, g2).backward()
    assert_close(v.grad, v2.grad, "dv")
    assert_close(g.grad, g2.grad, "dg")


def test_float64_attention_is_computed_in_float64():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    out = _compile(fn)(q, k, v)
    ref = fn(*refs)
    assert_close(out, ref, "f64 attention")  # f64 tolerance: 1e-7 relative
    out.sum().backward()
    ref.sum().backward()
    for name, a, b in zip("qkv", (q, k, v), refs):
        assert_close(a.grad, b.grad, f"d{name}")


def test_float64_tanh_runs_in_iree():
    lin = torch.nn.Linear(8, 8).double()
    fn = lambda x: lin(torch.tanh(lin(x)))  # noqa: E731
    x = torch.randn(4, 8, dtype=torch.float64)
    assert_close(_compile(fn)(x), fn(x), "f64 tanh")
    placement = boo_backend.placements()[-1]
    assert placement.island == 0, placement.line()
    assert not placement.recovered
