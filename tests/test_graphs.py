"""Single functions through boo: in-place ops and views, odd outputs, islands, visibility."""

import logging
import warnings

import pytest
import torch

import boo_backend
from util import assert_close


def _compile(fn, **kw):
    return torch.compile(fn, backend="boo", **kw)


def inplace_and_views(x, y):
    x = x.clone()
    x.add_(1.5)
    x[:, 1:3] = y[:, :2] * 2          # slice, then write into the slice
    t = x.transpose(0, 1)            # transpose view
    t.mul_(0.5)                      # in-place through the view writes x
    v = x.view(-1)[::2]              # view + strided slice
    e = y[:1].expand(x.shape[0], -1)  # expand
    return x, t.contiguous(), v.sum(), e + x


def test_inplace_ops_and_views_match_eager():
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    assert_close(_compile(inplace_and_views)(x, y), inplace_and_views(x, y), "inplace/view outputs")


def test_mutation_of_graph_input_is_applied():
    def f(buf, z):
        buf.mul_(2).add_(z)
        return buf.sum()

    a, b = torch.randn(5, 3), torch.randn(5, 3)
    a_ref = a.clone()
    out = _compile(f)(a, b)
    ref = f(a_ref, b)
    assert_close(out, ref, "sum")
    assert_close(a, a_ref, "mutated input")


def test_inplace_view_function_gradients():
    def f(w, x):
        h = x @ w
        h[:, :2] = h[:, :2].relu()
        return h.t().reshape(-1).view(h.shape[1], -1).square().mean()

    w = torch.randn(6, 5, requires_grad=True)
    x = torch.randn(4, 6)
    w_ref = w.detach().clone().requires_grad_()
    out = _compile(f)(w, x)
    out.backward()
    ref = f(w_ref, x)
    ref.backward()
    assert_close(out, ref, "loss")
    assert_close(w.grad, w_ref.grad, "grad")


def test_outputs_zero_dim_int_bool_constants_and_strides():
    def f(x, idx, mask):
        const = torch.tensor([1.0, -2.0, 3.0])  # becomes a constant of the graph
        s = (x * const).sum()                 # 0-d result
        i = idx * 3 + x.shape[0]              # int64
        b = mask & (x[0] > 0)                 # bool
        t = (x * 2).t()                       # non-contiguous output
        return s, i, b, t, x                  # x: output that is an input

    x = torch.randn(4, 3)
    idx = torch.randint(-5, 5, (3,), dtype=torch.int64)
    mask = torch.tensor([True, False, True])
    ours = _compile(f)(x, idx, mask)
    ref = f(x, idx, mask)
    assert_close(ours, ref, "outputs")
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.stride() == b.stride(), f"output {i} stride: ours={a.stride()} | torch={b.stride()}"
    assert ours[4] is x or ours[4].data_ptr() == x.data_ptr()


@pytest.mark.parametrize("dynamic", [False, True])
def test_output_aliasing_input_view(dynamic):
    """Views of an input come back as views of it, as in eager, also as a dtype of another
    size (`x[1:].view(torch.int16)` was sized in float32 elements over the float32 input:
    a setStorage error)."""
    def f(x):
        return x.view(2, -1), x[1:], x * 2, x[1:].view(torch.int16), x[:, 2:].view(torch.float64)

    run = _compile(f, dynamic=dynamic)
    for rows, cols in ((4, 6), (7, 10)):
        x = torch.randn(rows, cols)
        ours, ref = run(x), f(x)
        assert [o.stride() for o in ours] == [r.stride() for r in ref]
        assert_close(ours, ref, "outputs")
        assert all(o.data_ptr() == r.data_ptr() for o, r in zip(ours[:2] + ours[3:], ref[:2] + ref[3:])), \
            "a view output must alias its input, as in eager"
        x.add_(1)
        assert_close(ours[1], x[1:], "alias follows its base")
        assert torch.equal(ours[3], x[1:].view(torch.int16)) and torch.equal(ours[4], x[:, 2:].view(torch.float64))


@pytest.mark.parametrize("dynamic", [False, True])
def test_outputs_that_view_each_other_share_memory(dynamic):
    """`d, d.view(...), d[0], d.t()` under no_grad: eager's outputs share d's memory, so a
    write into one shows in the others. AOTAutograd leaves this to the backend when no
    gradient is traced."""
    def f(x):
        d = x * 2
        return d, d.view(-1, d.shape[0]), d[1], d.t(), d[:, 2:].view(torch.int32), (x + 1)[1:], d[2:].view(torch.int16)

    compiled = _compile(f, dynamic=dynamic)
    for rows, cols in ((5, 9), (37, 130), (129, 301)):
        x = torch.randn(rows, cols)
        with torch.no_grad():
            ours, ref = compiled(x), f(x)
        assert_close(ours, ref, f"outputs at {rows}x{cols}")
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert a.stride() == b.stride(), f"output {i} stride at {rows}x{cols}"
        d, flat, row, t = ours[:4]
        assert all(o.untyped_storage().data_ptr() == d.untyped_storage().data_ptr() for o in ours[1:5] + ours[6:])
        flat.view(-1)[0] = 100.0
        row.fill_(-3.0)
        t[-1, 0] = 7.0
        expected = ref[0].clone()
        expected.view(-1)[0] = 100.0
        expected[1] = -3.0
        expected[0, -1] = 7.0
        assert torch.equal(d, expected), f"writes into views of d at {rows}x{cols}"
        assert torch.equal(ours[4], d[:, 2:].view(torch.int32)), "an int32 view of d follows d"
        assert torch.equal(ours[6], d[2:].view(torch.int16)), "an int16 view of d follows d"


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_strided_view_returned_before_its_base(dynamic):
    """`y.diagonal(), y`: the diagonal spans y's storage from offset 0, but only y, which
    fills it, is what IREE writes. boo once took the diagonal for the base and made y from
    its copy, where nothing but the diagonal was written (off by 1.3 at 5x5); the same when
    an island (or the next part) read y: `new_zeros` + `diagonal().fill_`, torch.func.jacrev's
    basis, came back as memory garbage."""
    def f(x):
        y = x * 2
        return y.diagonal(), y, y[:, ::3]

    def basis(x):
        z = x.new_zeros(x.shape[0], x.shape[0])
        z.diagonal().fill_(1)
        return z * x.tanh()

    boo_backend.reset()
    outputs, eye = _compile(f, dynamic=dynamic), _compile(basis, dynamic=dynamic)
    for n in (5, 37, 130):
        x = torch.randn(n, n)
        with torch.no_grad():
            ours, ref = outputs(x), f(x)
        assert_close(ours, ref, f"outputs at {n}x{n}")
        ours[0].fill_(-1.0)
        assert torch.equal(ours[1].diagonal(), ours[0]) and torch.equal(ours[2][0, 0], ours[0][0])
        assert_close(eye(x[0]), basis(x[0]), f"new_zeros + diagonal().fill_ at {n}")
    assert all(p.island == 0 for p in boo_backend.placements())


def test_non_contiguous_and_unaligned_inputs():
    def f(a, b):
        return a * b + 1

    base = torch.randn(1, 4 * 6 + 1)
    a = base[0, 1:].view(4, 6)           # storage offset 1: not 64-byte aligned
    b = torch.randn(6, 4).t()            # non-contiguous
    assert_close(_compile(f)(a, b), f(a, b), "result")


def cummax_fn(x):
    values, indices = torch.cummax(x * 2, dim=1)
    return values.sin() + 1, indices


def test_eager_island_warns_once_and_matches(monkeypatch):
    monkeypatch.setenv("BOO_STRICT", "0")
    boo_backend.reset()
    x = torch.randn(3, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _compile(cummax_fn)(x)
        _compile(cummax_fn)(x)
    assert_close(ours, cummax_fn(x), "island outputs")
    msgs = [str(w.message) for w in caught if issubclass(w.category, boo_backend.BooFallbackWarning)]
    assert len(msgs) == 1 and "aten.cummax" in msgs[0], msgs
    (placement,) = boo_backend.placements()
    assert placement.island == 1 and placement.iree >= 2, placement.line()


def test_strict_mode_refuses_island():
    with pytest.raises(boo_backend.BooStrictError, match="aten.cummax"):
        _compile(cummax_fn)(torch.randn(3, 7))


def test_fx_level_decomposition_for_op_torch_mlir_cannot_lower():
    """native_layer_norm_backward: torch-mlir rejects it, torch._decomp rescues it (no island)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from boo_backend.config import Options
    from boo_backend.graph import CompiledGraph

    def f(g, x, mean, rstd, w, b):
        return torch.ops.aten.native_layer_norm_backward(g, x, [8], mean, rstd, w, b, [True, True, True])

    x = torch.randn(5, 8)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
    args = [torch.randn(5, 8), x, mean, rstd, torch.randn(8), torch.randn(8)]
    boo_backend.reset()
    opts = Options.resolve({"force_decompose": "native_layer_norm_backward"})  # composite off
    graph = CompiledGraph(make_fx(f)(*args), "backward", opts, "nlnb")
    assert_close(list(graph(list(args))), list(f(*args)), "layer norm backward")  # a graph may empty its list
    (placement,) = boo_backend.placements()
    assert (placement.decomposed, placement.island) == (1, 0), placement.line()


def test_placement_logged_at_info(caplog):
    boo_backend.reset()
    with caplog.at_level(logging.INFO, logger="boo_backend"):
        x = torch.randn(3, 5, requires_grad=True)
        _compile(lambda t: (t.sin() * 2).sum())(x).backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "boo_backend" and r.levelno == logging.INFO]
    assert any("forward graph" in m and "to IREE" in m and "decomposed at FX level" in m and "eager islands" in m for m in lines), lines
    assert any("backward graph" in m for m in lines), lines


def test_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BOO_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("BOO_CACHE", "0")
    _compile(lambda t: t.cos() + 1)(torch.randn(4))
    (graph_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    names = {p.name for p in graph_dir.iterdir()}
    assert {"graph.txt", "module.mlir", "module.flags", "module.vmfb"} <= names, names
    assert "torch.aten.cos" in (graph_dir / "module.mlir").read_text()
    assert "llvm-cpu" in (graph_dir / "module.flags").read_text()
    assert (graph_dir / "module.vmfb").stat().st_size > 0


def test_unknown_option_is_an_error():
    with pytest.raises(Exception, match="valid options"):
        torch.compile(lambda t: t + 1, backend="boo", options={"stirct": True})(torch.randn(2))


def test_fresh_outputs_do_not_alias_inputs_or_each_other():
    def f(x):
        y = x * 2
        return x.clone(), y.clone(), y.clone()

    x = torch.randn(16, 16)
    a, b, c = _compile(f)(x)
    a.add_(1)
    b.add_(1)
    assert_close(x + 1, a, "clone of x is its own tensor")
    assert_close(c, x * 2, "two clones of one value are two tensors")


def test_layer_norm_over_empty_shape():
    """The composite declines an empty normalized shape, and torch-mlir's path crashes on it;
    an op whose result is empty computes nothing, so boo folds it to an empty tensor."""
    x = torch.randn(0, 8)

    def f(t):
        return torch.nn.functional.layer_norm(t, [0, 8]) + 1

    out = _compile(f, dynamic=False)(x)
    assert_close(out, f(x), "empty layer norm")


def _permuted_empty(x):
    y = x.permute(0, 2, 1)
    out = torch.empty_like(y)  # AOTAutograd: aten.empty_permuted, which torch-mlir does not know
    out.copy_(y * 2)
    return out + 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_empty_like_of_a_permuted_tensor_runs_in_iree(dynamic):
    """aten.empty_permuted is decomposed (an empty of the sizes in memory order, permuted
    back): in strict mode it was refused as an island (Mixtral's default experts)."""
    boo_backend.reset()
    run = _compile(_permuted_empty, dynamic=dynamic)
    for n in (37, 70):
        x = torch.randn(3, n, 5, generator=torch.Generator().manual_seed(n))
        ours, theirs = run(x), _permuted_empty(x)
        assert ours.stride() == theirs.stride()
        assert torch.equal(ours, theirs)
    assert all(p.island == 0 for p in boo_backend.placements())


@torch.library.custom_op("boo_tests::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_doubled.register_fake
def _(x):
    return torch.empty_like(x)


def _around_a_custom_op(x, w):
    h = torch.relu(x @ w)
    return _doubled(h).sum(-1) + h.mean(-1)


def test_a_custom_op_is_one_island_of_a_dynamic_module(monkeypatch):
    """An op torch-mlir does not know (a library's custom op) is an island at every size, so
    a graph with dynamic shapes stays one module around it, and warns once. It was compiled
    once per shape, and warned at each."""
    monkeypatch.setenv("BOO_STRICT", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = _compile(_around_a_custom_op, dynamic=True)
    w = torch.randn(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (37, 70, 131):
            x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
            assert_close(run(x, w), _around_a_custom_op(x, w), f"rows {n}")
    islands = [w for w in caught if issubclass(w.category, boo_backend.BooFallbackWarning)]
    assert len(islands) == 1 and "boo_tests.doubled" in str(islands[0].message), [str(w.message) for w in caught]
    placed = boo_backend.placements()
    assert len(placed) == 1 and placed[0].dynamic and placed[0].island == 1, [p.line() for p in placed]


@torch.library.custom_op("boo_tests::tripled", mutates_args=())
def _tripled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_tripled.register_fake
def _(x):
    return torch.empty_like(x)


_tripled.register_autograd(lambda ctx, grad: _doubled(grad) * 1.5)  # an island in the backward too


def _norm_pad_then_custom(x):
    h = torch.nn.functional.local_response_norm(x, 3)
    h = torch.nn.functional.pad(h, (1, 2, 0, 1), mode="reflect")
    return _tripled(h).sum()


def test_a_part_between_islands_past_the_binding_limit_is_split(monkeypatch):
    """The backward of a local response norm and reflect padding is one IREE part beside an
    island, and IREE builds it with a dispatch of 36 bindings, more than its runtime takes
    (32). Only whole graphs were split then: this one ran all 134 ops in eager."""
    monkeypatch.setenv("BOO_STRICT", "0")
    boo_backend.reset()
    x = torch.randn(3, 6, 23, 29, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", boo_backend.BooFallbackWarning)
        (grad,) = torch.autograd.grad(_compile(_norm_pad_then_custom)(x), x)
    assert_close(grad, torch.autograd.grad(_norm_pad_then_custom(x), x)[0], "gradient")
    (backward,) = [p for p in boo_backend.placements() if p.kind == "backward"]
    assert not backward.recovered and backward.island_ops == ("torch.boo_tests.doubled",), backward.line()


def _sums_of_all(x):
    square = torch.ones(x.shape[1], x.shape[1]).triu(1)
    return x.sum() + square.sum() + x.transpose(1, 2).mean(), square.sum((0, 1))


@pytest.mark.parametrize("dynamic", [False, True])
def test_reductions_over_every_dim_of_empty_rows(dynamic):
    """A sum over every dim is two reductions of rows (rewrites._two_stage_reduction); rows
    of length 0 made its reshape to [-1, 0] ambiguous, and the graph failed to compile
    (strict mode: refused) whenever a length was 0."""
    boo_backend.reset()
    run = _compile(_sums_of_all, dynamic=dynamic)
    for length in (5, 0, 7):
        x = torch.randn(2, length, 3, generator=torch.Generator().manual_seed(length))
        for ours, theirs in zip(run(x), _sums_of_all(x)):
            torch.testing.assert_close(ours, theirs, equal_nan=True)


# One program per op of decompositions.UNLOWERED: what holds it in its forward or backward.
_UNLOWERED_PROGRAMS = {
    # (nll_loss's decomposition squeezes the gathered log-probabilities)
    "squeeze.dims": (lambda x: torch.nn.functional.cross_entropy(x, torch.arange(x.shape[0]) % x.shape[1]), (7, 33)),
    "avg_pool2d_backward": (lambda x: torch.nn.functional.avg_pool2d(x, 3, 2), (2, 3, 17, 20)),
    "avg_pool3d_backward": (lambda x: torch.nn.functional.avg_pool3d(x, 2, 2), (2, 3, 5, 7, 9)),
    "max_pool3d_with_indices_backward": (lambda x: torch.nn.functional.max_pool3d(x, 2, 2), (2, 3, 5, 7, 9)),
    "diagonal_scatter": (lambda x: torch.diagonal_scatter(x, x.diagonal(1, 2, 0) * 2, 1, 2, 0), (7, 3, 6)),
}


def _failed_lowerings(program, shape, caplog) -> list[str]:
    boo_backend.reset()
    torch._dynamo.reset()
    x = torch.randn(*shape, requires_grad=True)
    with caplog.at_level(logging.DEBUG, logger="boo_backend"):
        out = _compile(program)(x)
        out.sum().backward()
    reference = torch.randn(*shape).copy_(x.detach()).requires_grad_()
    program(reference).sum().backward()
    assert_close(out, program(reference), "forward")
    assert_close(x.grad, reference.grad, "gradient")
    return [r.getMessage() for r in caplog.records if "cannot lower" in r.getMessage()]


@pytest.mark.parametrize("op", sorted(_UNLOWERED_PROGRAMS))
def test_ops_torch_mlir_never_lowers_are_decomposed_from_the_first_compile(op, caplog, monkeypatch, tmp_path):
    """Each op of UNLOWERED takes its decomposition before the first import, so no graph pays
    a failed import or compile for it. With the op taken out of UNLOWERED, the failure is seen:
    the entry is still needed (when a new torch-mlir lowers the op, this says it can go)."""
    monkeypatch.setenv("BOO_STRICT", "1")
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path / "first"))  # no plan from an earlier test
    program, shape = _UNLOWERED_PROGRAMS[op]
    assert _failed_lowerings(program, shape, caplog) == []
    from boo_backend import decompositions, graph
    caplog.clear()
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path / "second"))
    monkeypatch.setattr(graph, "UNLOWERED", frozenset(o for o in decompositions.UNLOWERED if op not in str(o)))
    assert any(op in line for line in _failed_lowerings(program, shape, caplog))


_ALIVE: list[bool] = []
_WATCHED: list = []


@torch.library.custom_op("boo_test::note_alive", mutates_args=())
def _note_alive(x: torch.Tensor) -> torch.Tensor:
    if _WATCHED:  # not while make_fx traces it
        _ALIVE.append(_WATCHED[0]() is not None)
    return x.clone()


@_note_alive.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_graph_cut_into_parts_frees_each_argument_after_its_last_reader(monkeypatch):
    """AOTAutograd hands a backward its saved activations in one list and keeps no other
    reference: a graph cut into parts must let go of an activation once its last part has
    read it, not hold every one until the graph returns (GPT-2 small's peak: 200 MB)."""
    import weakref

    from torch.fx.experimental.proxy_tensor import make_fx

    from boo_backend.config import Options
    from boo_backend.graph import CompiledGraph

    def f(a, b):
        c = (a.sin() + 1).mean(0, keepdim=True)  # a's last reader, in IREE
        d = torch.ops.boo_test.note_alive(c)  # an island: the graph is cut around it
        return (d.cos() * b).sum(0)

    def fresh():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(300, 257, generator=g), torch.randn(1, 257, generator=g)]

    monkeypatch.setenv("BOO_STRICT", "0")  # the island that looks
    boo_backend.reset()
    _WATCHED.clear()
    graph = CompiledGraph(make_fx(f)(*fresh()), "backward", Options.resolve({}), "frees")
    expected = f(*fresh())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", boo_backend.BooFallbackWarning)
        for _ in range(2):  # the call that builds the parts, and a call of the built ones
            args = fresh()
            _WATCHED[:] = [weakref.ref(args[0])]
            _ALIVE.clear()
            assert_close(graph(args), expected, "output")
            assert _ALIVE == [False] and args == [], "the graph held its first argument past its last reader"
