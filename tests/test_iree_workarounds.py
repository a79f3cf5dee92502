"""Minimal repros of IREE 3.13 bugs that boo works around, each a test of the workaround.

A test marked `xfail(strict=True)` runs IREE the way that is wrong: when a new IREE fixes the
bug, it passes, fails as XPASS, and says that the workaround can go.
"""

import dataclasses

import numpy as np
import pytest
import torch

from boo_backend.cache import CompileCache
from boo_backend.compile import compile_flags, compile_mlir, has_dynamic_dims, parse_target
from boo_backend.runtime import IreeFunction

# A batched matmul whose M and K are the same dynamic size (s1), as in attention's
# scores @ values: [s0, s1, s1] @ [s0, s1, s2]. The symbols come from torch-mlir's import of
# Dynamo's sizes, as every dynamic module boo builds has them.
SAME_DIM_BMM = """
func.func @main(%a: !torch.vtensor<[?,?,?],f32>, %b: !torch.vtensor<[?,?,?],f32>) -> !torch.vtensor<[?,?,?],f32> {
  %s1 = torch.symbolic_int "s1" {min_val = 2, max_val = 9223372036854775807} : !torch.int
  %s2 = torch.symbolic_int "s2" {min_val = 2, max_val = 9223372036854775807} : !torch.int
  %s0 = torch.symbolic_int "s0" {min_val = 2, max_val = 9223372036854775807} : !torch.int
  torch.bind_symbolic_shape %a, [%s1, %s0], affine_map<()[s0, s1] -> (s1, s0, s0)> : !torch.vtensor<[?,?,?],f32>
  torch.bind_symbolic_shape %b, [%s1, %s2, %s0], affine_map<()[s0, s1, s2] -> (s2, s0, s1)> : !torch.vtensor<[?,?,?],f32>
  %0 = torch.aten.bmm %a, %b : !torch.vtensor<[?,?,?],f32>, !torch.vtensor<[?,?,?],f32> -> !torch.vtensor<[?,?,?],f32>
  return %0 : !torch.vtensor<[?,?,?],f32>
}
"""

# Below the first call's size, odd, past 64 and past 128, not multiples of 16.
LENGTHS = [16, 61, 64, 65, 100, 131]


def _worst_error(target, tmp_path) -> float:
    """The largest error of the module over LENGTHS, relative to the result's scale."""
    vmfb = compile_mlir(SAME_DIM_BMM, target, CompileCache(tmp_path, enabled=False))
    function = IreeFunction(vmfb, target, graph="same-dim bmm", driver="local-sync")
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for length in LENGTHS:
        a = torch.randn(2, length, length, generator=g)
        b = torch.randn(2, length, 48, generator=g)
        (out,) = function([a, b], 1)
        ref = torch.bmm(a.double(), b.double())
        worst = max(worst, ((out.double() - ref).abs().max() / ref.abs().max()).item())
    return worst


def test_modules_use_the_global_optimization_data_tiling_path():
    target = parse_target("llvm-cpu")
    assert has_dynamic_dims(SAME_DIM_BMM) and not has_dynamic_dims(
        "func.func @main(%a: !torch.vtensor<[4,8],f32>) -> !torch.vtensor<[4,8],f32>")
    for dynamic in (True, False):
        assert "--iree-global-opt-data-tiling" in compile_flags(target, dynamic=dynamic)
        assert "--iree-opt-data-tiling" not in compile_flags(target, dynamic=dynamic)


_DISPATCH_PATH = ("--iree-opt-data-tiling",)


def test_matmul_with_two_equal_dynamic_dims_is_right_with_boos_flags(tmp_path):
    assert _worst_error(parse_target("llvm-cpu"), tmp_path) < 1e-5


@pytest.mark.xfail(strict=True, reason="IREE 3.13: dispatch-creation data tiling miscomputes a "
                   "matmul whose M and K are one dynamic size, once it passes 64")
def test_matmul_with_two_equal_dynamic_dims_on_the_default_data_tiling_path(tmp_path):
    target = dataclasses.replace(parse_target("llvm-cpu"), optional_flags=_DISPATCH_PATH)
    assert "--iree-opt-data-tiling" in compile_flags(target, dynamic=True)
    assert _worst_error(target, tmp_path) < 1e-5


# A batched matmul plus a sum of its left operand over the contracted dim, static sizes: the
# p=2 torch.cdist backward's `x1 * G.sum(-1) - G @ x2` at 2 x 30 rows, cut down.
BMM_BESIDE_A_ROW_SUM = """
func.func @main(%a: !torch.vtensor<[2,30,40],f32>, %b: !torch.vtensor<[2,40,8],f32>) -> !torch.vtensor<[2,30,8],f32> {
  %0 = torch.aten.bmm %a, %b : !torch.vtensor<[2,30,40],f32>, !torch.vtensor<[2,40,8],f32> -> !torch.vtensor<[2,30,8],f32>
  %int-1 = torch.constant.int -1
  %1 = torch.prim.ListConstruct %int-1 : (!torch.int) -> !torch.list<int>
  %true = torch.constant.bool true
  %none = torch.constant.none
  %2 = torch.aten.sum.dim_IntList %a, %1, %true, %none : !torch.vtensor<[2,30,40],f32>, !torch.list<int>, !torch.bool, !torch.none -> !torch.vtensor<[2,30,1],f32>
  %int1 = torch.constant.int 1
  %3 = torch.aten.add.Tensor %0, %2, %int1 : !torch.vtensor<[2,30,8],f32>, !torch.vtensor<[2,30,1],f32>, !torch.int -> !torch.vtensor<[2,30,8],f32>
  return %3 : !torch.vtensor<[2,30,8],f32>
}
"""


def _row_sum_error(target, tmp_path) -> float:
    vmfb = compile_mlir(BMM_BESIDE_A_ROW_SUM, target, CompileCache(tmp_path, enabled=False))
    function = IreeFunction(vmfb, target, graph="bmm beside a row sum", driver="local-sync")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 30, 40, generator=g), torch.randn(2, 40, 8, generator=g)
    (out,) = function([a, b], 1)
    ref = torch.bmm(a.double(), b.double()) + a.double().sum(-1, keepdim=True)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def test_a_matmul_beside_a_sum_of_its_operand_is_right_with_boos_flags(tmp_path):
    assert _row_sum_error(parse_target("llvm-cpu"), tmp_path) < 1e-5


@pytest.mark.xfail(strict=True, reason="IREE 3.13: dispatch-creation data tiling miscomputes a "
                   "batched matmul beside a sum of its left operand over the contracted dim")
def test_a_matmul_beside_a_sum_of_its_operand_on_the_default_data_tiling_path(tmp_path):
    target = dataclasses.replace(parse_target("llvm-cpu"), optional_flags=_DISPATCH_PATH)
    assert _row_sum_error(target, tmp_path) < 1e-5


def test_cdist_gradients_match_eager():
    """torch.cdist past 25 rows (its matmul form): the first input's gradient was off by 10."""
    import boo_backend

    x1 = torch.randn(2, 30, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x2 = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    torch._dynamo.reset()
    boo_backend.reset()
    ours = torch.compile(torch.cdist, backend="boo")(x1, x2)
    g = torch.randn(ours.shape, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(torch.autograd.grad(ours, (x1, x2), g),
                               torch.autograd.grad(torch.cdist(x1, x2), (x1, x2), g), rtol=1e-4, atol=1e-5)


def _pool_growth_mb(tmp_path, calls: int = 600, storage: bool = False) -> float:
    """How much the process grows (MB) over the last three quarters of `calls` local-task
    calls whose results torch frees in a random order, a few dozen calls later (as a
    training step frees its activations and gradients); the first quarter fills the
    working set. `storage`: the modules write their results into storage the call allocates
    (storage.with_storage), as boo builds CPU modules."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from boo_backend.lower import lower
    from boo_backend.storage import placed_results, with_storage

    target = parse_target("llvm-cpu")
    cache = CompileCache(tmp_path, enabled=False)
    functions = []
    for n in (512 * 1024, 3 * 1000 * 1000, 700 * 1024, 2 * 1024 * 1024 + 17):
        x = torch.randn(n)
        graph = make_fx(lambda a: (a * 2, (a + 1).exp(), a.sum()), tracing_mode="fake")(x)
        lowered = with_storage(lower(graph)) if storage else lower(graph)
        assert len(lowered.placed) == (2 if storage else 0)  # not the sum: 4 bytes (PLACED_MIN_BYTES)
        vmfb = compile_mlir(lowered.mlir, target, cache)
        functions.append((IreeFunction(vmfb, target, graph=f"pool {n}", driver="local-task", placed=placed_results(lowered)), x))

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    rng = np.random.default_rng(0)
    held: list = []
    start = 0.0
    for call in range(calls):
        if call == calls // 4:
            start = rss_mb()
        function, x = functions[rng.integers(len(functions))]
        for r in function([x], 3):
            held.append((call + int(rng.integers(0, 40)), r))
        held = [(dies, r) for dies, r in held if dies > call]
        if call == 0:
            torch.testing.assert_close(held[0][1], x * 2)  # the copies hold the results
    return rss_mb() - start


def test_local_task_results_freed_late_do_not_grow_the_process(tmp_path):
    assert _pool_growth_mb(tmp_path) < 400  # without the copy: about 2 GB


def test_results_in_caller_storage_do_not_grow_the_process(tmp_path, monkeypatch):
    from boo_backend import memory

    copies = []
    monkeypatch.setattr(memory, "out_of_pool", lambda out, spans: copies.extend(out) or out)
    assert _pool_growth_mb(tmp_path, storage=True) < 400
    # Only the sums came from IREE's pool (and, with out_of_pool stubbed, stayed there).
    assert copies and all(r.numel() == 1 for r in copies)


@pytest.mark.xfail(strict=True, reason="IREE 3.13's local-task pool does not reuse blocks of results freed late")
def test_local_task_pool_without_the_copy_grows(tmp_path, monkeypatch):
    from boo_backend import memory

    monkeypatch.setattr(memory, "POOLED", ())
    assert _pool_growth_mb(tmp_path) < 400  # without the copy: about 2 GB


def test_out_of_pool_copies_all_but_what_sits_in_an_argument():
    from boo_backend import memory

    arg = torch.randn(1000)
    small = torch.randn(1000)
    out = memory.out_of_pool([arg, small, torch.empty(0)], memory.spans([arg]))
    assert out[0] is arg and out[2].numel() == 0  # IREE wrote into its argument: not the pool's
    assert out[1] is not small and out[1].data_ptr() != small.data_ptr()
    torch.testing.assert_close(out[1], small)

    packed = torch.randn(9 * 1000 * 1000 * 2)  # two results end to end, past a slab
    big = [packed[: 9 * 1000 * 1000], packed[9 * 1000 * 1000:]]
    out = memory.out_of_pool(list(big), [])
    assert all(o.data_ptr() != b.data_ptr() for o, b in zip(out, big))  # neither holds the other


def _two_writes_into_zeros(x, index):
    """A backward's shape: a slice and a scatter, each written into zeros of one shape."""
    zeros = torch.ops.aten.full.default([x.shape[0], x.shape[1], 16], 0.0)
    halves = torch.ops.aten.slice_scatter.default(zeros, x[..., 8:], 2, 0, 8)
    scattered = torch.ops.aten.index_put.default(zeros, [None, None, index], x[..., :2] * 3, True)
    return halves + scattered


def _two_writes_worst_error(tmp_path) -> float:
    from torch.fx.experimental.proxy_tensor import make_fx

    from boo_backend.lower import arguments, lower

    index = torch.tensor([1, 3])
    lowered = lower(make_fx(_two_writes_into_zeros, tracing_mode="symbolic")(torch.randn(5, 7, 16), index))
    assert has_dynamic_dims(lowered.mlir)
    target = parse_target("llvm-cpu")
    vmfb = compile_mlir(lowered.mlir, target, CompileCache(tmp_path, enabled=False))
    function = IreeFunction(vmfb, target, graph="two writes into zeros", driver="local-sync")
    worst = 0.0
    for length in LENGTHS:
        x = torch.randn(3, length, 16, generator=torch.Generator().manual_seed(length))
        out = function(arguments(lowered.inputs, [x, index]), len(lowered.result_layouts))[0]
        ref = _two_writes_into_zeros(x, index)
        worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
    return worst


def test_two_writes_into_one_dynamic_fill_stay_apart(tmp_path):
    """`full` of dynamic sizes is imported as fill.Scalar of an empty tensor, which IREE
    makes a splat for each use (torch_import._fills_as_splats)."""
    assert _two_writes_worst_error(tmp_path) < 1e-6


@pytest.mark.xfail(strict=True, reason="IREE 3.13: a broadcast constant of dynamic sizes is one "
                   "dispatch's result, and two ops that write into it in place share its buffer")
def test_two_writes_into_one_dynamic_fill_as_torch_mlir_lowers_full(tmp_path, monkeypatch):
    from boo_backend import torch_import

    monkeypatch.setattr(torch_import, "_fills_as_splats", lambda module: None)
    assert _two_writes_worst_error(tmp_path) < 1e-6


def _two_masks(x, base=torch.zeros_like, value=1.0):
    a = base(x)
    a[:, :3] = value if isinstance(value, float) else value[:, :3]
    b = base(x)
    b[:, 5:] = 2 * value if isinstance(value, float) else value[:, 5:] * 2
    return a, b


def _two_neg_inf_masks(x):
    a = torch.zeros_like(x)
    a[:, x.shape[1] // 2:] = float("-inf")
    b = torch.zeros_like(x)
    b[:, :x.shape[1] // 2] = float("-inf")
    return (x + a).softmax(-1), (x + b).softmax(-1)


# Two buffers of one value and the input's two dynamic sizes, each written in part through a
# slice (which functionalizes to a slice_scatter into a slice of it): IREE gave both writes
# to one buffer and left the other as it was.
_TWO_BUFFERS = {
    "zeros_scalar": _two_masks,
    "ones_scalar": lambda x: _two_masks(x, torch.ones_like),
    "zeros_tensor": lambda x: _two_masks(x, value=x.sin()),
    "neg_inf_softmax": _two_neg_inf_masks,
}


def _dynamic_in_iree(fn, monkeypatch):
    """`fn` compiled once for every size, in strict mode, with boo's own check against eager
    off: the test makes it."""
    import boo_backend

    monkeypatch.setenv("BOO_VERIFY", "off")
    monkeypatch.setenv("BOO_STRICT", "1")
    boo_backend.reset()
    return torch.compile(fn, backend="boo", dynamic=True)


def _assert_all_dynamic():
    import boo_backend

    placed = boo_backend.placements()
    assert placed and all(p.dynamic for p in placed), [p.line() for p in placed]


@pytest.mark.parametrize("name", list(_TWO_BUFFERS))
def test_two_buffers_of_one_value_written_through_slices_stay_apart(name, monkeypatch):
    fn = _TWO_BUFFERS[name]
    run = _dynamic_in_iree(fn, monkeypatch)
    for rows, n in [(3, 7), (4, 70), (2, 131), (5, 17)]:
        x = torch.randn(rows, n)
        ours, theirs = run(x), fn(x)
        for i, (o, t) in enumerate(zip(ours, theirs)):
            assert torch.allclose(o, t, rtol=1e-6, atol=1e-6), f"{name} result {i} at {(rows, n)}: {o} | {t}"
    _assert_all_dynamic()


def _every_other_filled(x):
    y = x[::2]
    y.fill_(7.0)
    return y.sum(), x * 1


# A view filled in place and then reduced: the fill is the source of a slice_scatter, and
# made a splat of its own it fed the reduction one value per vector of the dim (7 for
# x[::2] of 8 sevens, 35 for 66 of them).
_FILLED_VIEWS = {
    "every_other_filled": _every_other_filled,
    "columns_filled": lambda x: x.view(1, -1)[:, ::3].fill_(-2.5).sum(-1),
    "zeros_written_then_summed": lambda x: torch.zeros_like(x).index_fill(0, torch.tensor([0]), 4.0).sum()
                                           + torch.zeros_like(x).slice_scatter(torch.ones_like(x[1:]), 0, 1).sum(),
}


@pytest.mark.parametrize("name", list(_FILLED_VIEWS))
def test_a_filled_view_reduces_to_its_count(name, monkeypatch):
    fn = _FILLED_VIEWS[name]
    run = _dynamic_in_iree(fn, monkeypatch)
    for n in (7, 8, 131, 70):
        x = torch.randn(n)
        xe = x.clone()
        ours, theirs = run(x), fn(xe)
        for i, (o, t) in enumerate(zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs))):
            assert torch.allclose(o, t, rtol=1e-6, atol=1e-5), f"{name} result {i} at {n}: {o} | {t}"
        assert torch.equal(x, xe), f"{name}: the input at {n}"
    _assert_all_dynamic()


def _tail_zeroed(x):
    x[1:].zero_()
    return x * 2


def _columns_filled(x):
    x[:, 2:].fill_(-1.5)
    return x.sum(0)


# An input filled in place through a slice, with dynamic sizes: IREE fills the input's own
# buffer, which asks for DISCARD_WRITE, and a DLPack import allows READ|WRITE only ("buffer
# does not support the requested access type"). The first input already holds the fill, so
# the first call changes no bits: the input must still be passed so from then on.
_INPUTS_FILLED = {
    "tail_filled_then_summed": (lambda x: x[1:].fill_(7.0).sum(), [(9,), (70,), (131,), (17,)]),
    "tail_zeroed": (_tail_zeroed, [(9,), (70,), (131,), (17,)]),
    "rows_filled_then_summed": (lambda x: x[1:].fill_(7.0).sum(), [(3, 9), (4, 70), (2, 131), (5, 17)]),
    "columns_filled": (_columns_filled, [(3, 9), (4, 70), (2, 131), (5, 17)]),
}


@pytest.mark.parametrize("name", list(_INPUTS_FILLED))
def test_an_input_filled_through_a_slice(name, monkeypatch):
    fn, shapes = _INPUTS_FILLED[name]
    run = _dynamic_in_iree(fn, monkeypatch)
    for k, shape in enumerate(shapes):
        x = torch.randn(shape)
        if not k:
            fn(x)  # in eager: x holds the fill already
        xe = x.clone()
        ours, theirs = run(x), fn(xe)
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-5), f"{name} at {shape}: {ours} | {theirs}"
        assert torch.equal(x, xe), f"{name}: the input at {shape}"
    _assert_all_dynamic()


# Sums over a dim of a tensor of one value, the way programs write them: Wav2Vec2 counts its
# input lengths with ones_like(x, dtype=long).sum(-1) when no attention mask is given.
_CONSTANT_SUMS = {
    "ones_like_sum": lambda x: torch.ones_like(x).sum(-1),
    "long_lengths": lambda x: torch.ones_like(x, dtype=torch.long).sum(-1),
    "full_like_mean": lambda x: torch.full_like(x, 3.0).mean(-1),
    "ones_of_sizes": lambda x: torch.ones(x.shape[0], x.shape[1]).sum(-1),
    "zeros_plus_one": lambda x: (torch.zeros_like(x) + 1).sum(-1),
    "scatter_then_sum": lambda x: torch.zeros_like(x).index_put((torch.tensor([0]),), torch.tensor(2.0)).sum(-1),
}


@pytest.mark.parametrize("name", list(_CONSTANT_SUMS))
def test_sums_of_a_dynamic_fill_count_every_element(name, monkeypatch):
    """IREE 3.13 folds a splat into a reduction over a dynamic dim and adds the value once per
    vector of the dim, not once per element (ones_like(x).sum(-1) gave 2 for 17 ones with
    AVX-512). A fill of dynamic sizes is a splat only where an op writes into it in place
    (torch_import._fills_as_splats), so a sum reads it as torch-mlir lowers it."""
    fn = _CONSTANT_SUMS[name]
    run = _dynamic_in_iree(fn, monkeypatch)
    for rows, n in [(3, 70), (2, 17), (5, 9), (2, 131)]:
        x = torch.randn(rows, n)
        ours, theirs = run(x), fn(x)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), f"{name} at {(rows, n)}: {ours} | {theirs}"
    _assert_all_dynamic()


def _two_sorts(a, b):
    """Two sorts of one shape: each gives the indices of its own order."""
    return torch.ops.aten.sort.default(a, -1)[1], torch.ops.aten.sort.default(b * 3, -1)[1]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.xfail(strict=True, reason="IREE 3.13: two sorts of one shape sort one iota of indices in place")
def test_two_sorts_in_one_module(dynamic, tmp_path):
    """The raw repro: one module with both sorts (boo runs all but the first of a graph's
    sorts in ATen: miscompiles.sorts_apart)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from boo_backend.lower import arguments, lower

    a, b = torch.randn(37, 5), torch.randn(37, 5)
    lowered = lower(make_fx(_two_sorts, tracing_mode="symbolic" if dynamic else "real")(a, b))
    assert has_dynamic_dims(lowered.mlir) == dynamic
    target = parse_target("llvm-cpu")
    vmfb = compile_mlir(lowered.mlir, target, CompileCache(tmp_path, enabled=False))
    function = IreeFunction(vmfb, target, graph="two sorts", driver="local-sync")
    for ours, theirs in zip(function(arguments(lowered.inputs, [a, b]), 2), _two_sorts(a, b)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dynamic", [False, True])
def test_sorts_of_one_shape_in_one_graph_give_their_own_indices(dynamic, monkeypatch):
    """Through boo: the graph's second sort runs in ATen, and each sort's indices are its own.
    The routers of a mixture-of-experts model with two layers (topk over the experts in
    each) chose the first layer's experts in the second, with dynamic shapes."""
    import boo_backend

    monkeypatch.setenv("BOO_VERIFY", "off")

    def route(a, b, c):
        first = torch.topk(a.softmax(-1), 2, dim=-1)
        second = torch.topk((b * 3).softmax(-1), 2, dim=-1)
        return first.values, first.indices, second.values, second.indices, c.argsort(-1)

    boo_backend.reset()
    run = torch.compile(route, backend="boo", dynamic=dynamic)
    for n in (37, 70, 131):
        g = torch.Generator().manual_seed(n)
        args = [torch.randn(n, 5, generator=g) for _ in range(3)]
        ours, theirs = run(*args), route(*args)
        for i in (1, 3, 4):
            assert torch.equal(ours[i], theirs[i]), f"indices {i} at {n}"
        for i in (0, 2):
            torch.testing.assert_close(ours[i], theirs[i])
    placed = boo_backend.placements()
    assert all(p.aten == 2 and p.dynamic == dynamic for p in placed), [p.line() for p in placed]


def _bf16_logits_loss(logits, labels):
    """A causal LM's loss in bf16 training (Hugging Face's ForCausalLMLoss): the bf16 logits
    cast to float32, then cross-entropy."""
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_dispatch_that_needs_more_stack_compiles_and_runs(dynamic, monkeypatch):
    """IREE's CPU codegen refused the fused cast and log-softmax for its stack buffers (89 KiB
    at 140 rows of 1000 classes, 157 KiB with symbolic rows; at 74 or 303 rows it fit), and
    the whole graph ran in eager. It is compiled with more stack allowed, and local-task's
    workers get stacks that hold it (at 256 rows the default one crashed the process). Strict
    mode proves IREE ran it; both drivers run it (the choice times each)."""
    import boo_backend

    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = torch.compile(_bf16_logits_loss, backend="boo", dynamic=dynamic)
    for rows in (140, 256, 200, 131):
        g = torch.Generator().manual_seed(rows)
        logits = torch.randn(1, rows, 1000, generator=g).bfloat16().requires_grad_()
        labels = torch.randint(0, 1000, (1, rows), generator=g)
        ours = run(logits, labels)
        (grad,) = torch.autograd.grad(ours, logits)
        ref64 = torch.nn.functional.cross_entropy(logits.double().view(rows, 1000), labels.view(-1))
        (grad64,) = torch.autograd.grad(ref64, logits)
        torch.testing.assert_close(ours.double(), ref64.detach(), rtol=1e-5, atol=1e-5, msg=f"loss at {rows} rows")
        torch.testing.assert_close(grad.double(), grad64.bfloat16().double(), rtol=1e-2, atol=1e-5,
                                   msg=f"grad at {rows} rows")
    placed = boo_backend.placements()
    assert placed and not any(p.island or p.recovered for p in placed), [p.line() for p in placed]


@pytest.mark.parametrize("weighted, padding_idx", [(True, None), (False, 2), (True, 2)], ids=["weights", "padding", "both"])
def test_weighted_and_padded_embedding_bag_sums_as_eager(weighted, padding_idx, monkeypatch):
    """torch-mlir's embedding_bag sum drops per_sample_weights and padding_idx with symbolic
    sizes (the unweighted sum, padding rows included, with no warning): boo's own form
    (bags.py) computes it in IREE, strict; forward and backward match eager's at every size."""
    import boo_backend

    monkeypatch.setenv("BOO_VERIFY", "off")

    def bags(w, i, o, p):
        return torch.nn.functional.embedding_bag(i, w, o, mode="sum", per_sample_weights=p, padding_idx=padding_idx)

    boo_backend.reset()
    torch._dynamo.reset()
    run = torch.compile(bags, backend="boo", dynamic=True)
    for n, k in ((37, 8), (129, 23), (1000, 61)):
        g = torch.Generator().manual_seed(n)
        w = torch.randn(n, 5, generator=g, requires_grad=True)
        i, o = torch.randint(0, 7, (k,), generator=g), torch.tensor([0, 3, k // 2])
        p = torch.randn(k, generator=g, requires_grad=True) if weighted else None
        ours = run(w, i, o, p)
        theirs = bags(w, i, o, p)
        torch.testing.assert_close(ours, theirs)
        upstream = torch.randn(theirs.shape, generator=g)
        leaves = (w, p) if weighted else (w,)
        for a, b in zip(torch.autograd.grad(ours, leaves, upstream), torch.autograd.grad(theirs, leaves, upstream)):
            torch.testing.assert_close(a, b)
    placed = boo_backend.placements()
    assert placed and not any(p.island or p.recovered for p in placed), [p.line() for p in placed]


def _raw_module(fn, args, tmp_path, rewritten=False):
    """`fn` traced and lowered as boo lowers a graph, compiled with boo's flags: what IREE
    itself makes of it, with boo's pre-lowering rewrites applied or (by default) not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from boo_backend.lower import arguments, lower
    from boo_backend.rewrites import PRE_LOWERING

    lowered = lower(make_fx(fn, decomposition_table=PRE_LOWERING if rewritten else None)(*args))
    target = parse_target("llvm-cpu")
    vmfb = compile_mlir(lowered.mlir, target, CompileCache(tmp_path, enabled=False))
    function = IreeFunction(vmfb, target, graph=fn.__name__, driver="local-sync")
    return function(arguments(lowered.inputs, list(args)), 1)[0]


def _cat_of_late_pieces(x, base, rows, cols, block, a, b, e, s):
    """Cut down from ormqr's backward: a cat whose first piece is computed last, after a
    slice_scatter on an inner dim of a value that the second piece's matmuls read."""
    last = -x.squeeze(-1)
    v1 = base.slice_scatter(rows, dim=0, start=3, end=5)
    middle = -((e @ v1[2:5])[:, 2:5] @ s).squeeze(-1)
    v2 = v1.slice_scatter(cols, dim=1, start=1, end=5)
    v3 = v2.slice_scatter(block, dim=0, start=2, end=5)
    first = -((a @ v3[1:5])[:, 1:5] @ b).squeeze(-1)
    return torch.cat([first, middle, last])


def _late_pieces_args():
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1), (5, 5), (2, 5), (5, 4), (3, 5), (1, 4), (4, 1), (1, 3), (3, 1)]
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.xfail(strict=True, reason="IREE 3.13: EmplaceAllocations moves a slice_scatter's in-place "
                   "update above a matmul that still reads the tensor it updates")
def test_a_cat_of_pieces_computed_out_of_order_in_graph_order(tmp_path, monkeypatch):
    """The raw repro: the graph as boo's rewrites leave it (row-wise slice_scatters as cats,
    one-row matmuls with a row of zeros), in the order it was traced, where boo computes each
    piece's work after the pieces before it (miscompiles.pieces_in_order, which lower calls).
    The second piece came out 2.1 off."""
    from boo_backend import lower

    monkeypatch.setattr(lower, "pieces_in_order", lambda graph: None)
    args = _late_pieces_args()
    ours = _raw_module(_cat_of_late_pieces, args, tmp_path, rewritten=True)
    torch.testing.assert_close(ours, _cat_of_late_pieces(*args))


def test_a_cat_of_pieces_computed_out_of_order_is_right():
    """Through boo, strict: each piece's work after the pieces before it, every piece is right."""
    import boo_backend

    boo_backend.reset()
    args = _late_pieces_args()
    ours = torch.compile(_cat_of_late_pieces, backend="boo")(*args)
    ref = _cat_of_late_pieces(*[a.double() for a in args])
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    assert not any(p.island for p in boo_backend.placements())


def _row_of_a_column_slice(w, m):
    return w[:, 2:3].t() @ m


@pytest.mark.xfail(strict=True, reason="IREE 3.13: global-optimization data tiling reads a 1 x K "
                   "operand (the transpose of a column slice) as if dense")
def test_a_row_of_a_column_slice_on_the_data_tiling_path(tmp_path):
    """The raw repro: the matmul as torch-mlir lowers it; IREE read w's elements 2..38 in a row
    instead of w[:, 2] (boo gives such a product a second row: rewrites._vector_product)."""
    g = torch.Generator().manual_seed(0)
    w, m = torch.randn(37, 11, generator=g), torch.randn(37, 70, generator=g)
    torch.testing.assert_close(_raw_module(_row_of_a_column_slice, (w, m), tmp_path), _row_of_a_column_slice(w, m))


_ONE_ROW_OR_COLUMN = {
    "row.t() @ m": lambda w, m, c: w[:, 2:3].t() @ m,
    "m.t() @ column": lambda w, m, c: m.t() @ w[:, 2:3],
    "vector @ m": lambda w, m, c: w[:, 2] @ m,
    "linear": lambda w, m, c: torch.nn.functional.linear(w[:, 2:3].t(), m.t(), c),
    "addmm": lambda w, m, c: torch.addmm(c, w[:, 2:3].t(), m, beta=0.5, alpha=2.0),
    "einsum": lambda w, m, c: torch.einsum("nk,np->kp", w[:, 2:3], m),
}


# Every form static in f32; with symbolic sizes and in bf16 (which share the rewrite), some.
_PRODUCT_CASES = [(form, False, torch.float32) for form in _ONE_ROW_OR_COLUMN] + [
    ("vector @ m", True, torch.float32), ("m.t() @ column", True, torch.float32),
    ("row.t() @ m", False, torch.bfloat16), ("linear", True, torch.bfloat16)]


@pytest.mark.parametrize("form, dynamic, dtype", _PRODUCT_CASES,
                         ids=[f"{f}-{'dynamic' if d else 'static'}-{str(t)[6:]}" for f, d, t in _PRODUCT_CASES])
def test_products_with_one_row_or_column_match_float64(form, dynamic, dtype, monkeypatch):
    """One row (or column) of a matrix times another, as users write it, strict, against
    float64. Static: the wrong read above (off by 23 at these sizes). Symbolic: `vector @ m`
    came back with 80 columns, not 70 (which the dynamic check caught; it is off here)."""
    import boo_backend

    monkeypatch.setenv("BOO_VERIFY", "off")
    fn = _ONE_ROW_OR_COLUMN[form]
    boo_backend.reset()
    torch._dynamo.reset()
    run = torch.compile(fn, backend="boo", dynamic=dynamic)
    for n, k, p in ((37, 11, 70), (130, 5, 129))[: 2 if dynamic else 1]:
        g = torch.Generator().manual_seed(n)
        w, m, c = torch.randn(n, k, generator=g), torch.randn(n, p, generator=g), torch.randn(p, generator=g)
        args = [t.to(dtype) for t in (w, m, c)]
        ours = run(*args)
        ref = fn(*[t.double() for t in args])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ours.double(), ref, rtol=tol, atol=tol * ref.abs().max().item(),
                                   msg=f"{form} at {n}x{k}, {n}x{p}")
    placed = boo_backend.placements()
    assert placed and not any(p.island or p.recovered for p in placed), [p.line() for p in placed]


@pytest.mark.parametrize("m, k, n", [(5, 3, 2), (7, 4, 3)])
def test_ormqr_gradients_match_eager(m, k, n, monkeypatch):
    """Where both bugs above were found: ormqr's backward (its forward is an ATen island) gave
    gradients up to 100x off, silently. Not strict: ormqr itself runs in eager."""
    import boo_backend

    monkeypatch.setenv("BOO_STRICT", "0")

    def apply(a, tau, c):
        return torch.ormqr(a, tau, c, left=True, transpose=False)

    boo_backend.reset()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(m * 10 + k)
    a = torch.randn(m, k, generator=g, requires_grad=True)
    tau = torch.rand(k, generator=g, requires_grad=True)
    c = torch.randn(m, n, generator=g, requires_grad=True)
    cotangent = torch.randn(m, n, generator=g)
    ref = torch.autograd.grad(apply(a, tau, c), (a, tau, c), cotangent)
    ours = torch.autograd.grad(torch.compile(apply, backend="boo")(a, tau, c), (a, tau, c), cotangent)
    for name, r, o in zip(("input", "tau", "other"), ref, ours):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4 * r.abs().max().item(), msg=f"gradient of {name}")


_SQUARES = {
    "sum of x * x": lambda x: (x * x).sum(-1),
    "mean of x * x, keepdim": lambda x: (x * x).mean(-1, keepdim=True),
    "x * x": lambda x: x * x,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("form", list(_SQUARES))
def test_a_value_times_itself_is_squared_as_eager_squares_it(form, dtype, monkeypatch, tmp_path):
    """`x * x` reaches IREE as `x ** 2` (rewrites._square_as_pow): a reduction of a value
    times itself became a vector contraction that IREE 3.13 lowers to scalar code, 17x
    slower at 512 x 512. Strict; the square matches eager's bit for bit, infinities, NaN and
    -0 included, at sizes past 128 that are not multiples of 16. float64 keeps its products
    (its powers become products, f64._pow_ieee)."""
    import boo_backend

    monkeypatch.setenv("BOO_DUMP_DIR", str(tmp_path))
    fn = _SQUARES[form]
    boo_backend.reset()
    torch._dynamo.reset()
    x = (torch.randn(131, 301, generator=torch.Generator().manual_seed(5)) * 7).to(dtype)
    x[0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 3e38 if dtype != torch.float16 else 6e4])
    ours = torch.compile(fn, backend="boo")(x)
    if form == "x * x":
        torch.testing.assert_close(ours, x * x, rtol=0, atol=0, equal_nan=True)
    else:
        ref = fn(x.double())
        torch.testing.assert_close(ours[1:].double(), ref[1:], rtol=1e-5 if dtype in (torch.float32, torch.float64) else 1e-2,
                                   atol=0, check_dtype=False)
        assert ours[0].isnan().all()
    graphs = "".join(p.read_text() for p in tmp_path.rglob("graph.txt"))
    if dtype == torch.float64:
        assert "aten.mul.Tensor" in graphs, graphs
    else:
        assert "aten.pow.Tensor_Scalar" in graphs and "aten.mul.Tensor" not in graphs, graphs
