"""The pool of result storage (pool.py): a storage is written again only once nothing but the
pool holds it, so no result a program still reads changes; results stay equal to eager's."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from boo_backend import pool
from boo_backend.config import BooError

SHAPE = (300, 1000)  # 1.2 MB of float32: past pool._MIN_BYTES


def test_a_storage_is_handed_out_again_only_when_the_pool_alone_holds_it():
    p = pool.Pool(64 << 20)
    a = p.tensor(SHAPE, torch.float32)
    ptr = a.data_ptr()
    assert a.shape == SHAPE and a.is_contiguous() and a.dtype == torch.float32
    holders = {
        "tensor": lambda t: t,
        "view": lambda t: t[1:, ::2],
        "reshape": lambda t: t.view(-1),
        "detach": lambda t: t.detach(),
        "numpy": lambda t: t.numpy(),
        "dlpack": lambda t: torch.utils.dlpack.to_dlpack(t),
        "storage": lambda t: t.untyped_storage(),
        "grad": lambda t: _as_grad(t),
    }
    for name, hold in holders.items():
        kept = hold(a)
        del a
        b = p.tensor(SHAPE, torch.float32)
        assert b.data_ptr() != ptr, f"a storage still held by a {name} was handed out again"
        del kept, b
        a = p.tensor(SHAPE, torch.float32)
        assert a.data_ptr() == ptr, f"the storage was not reused once the {name} was gone"


def _as_grad(t: torch.Tensor):
    w = torch.zeros(t.shape, requires_grad=True)
    w.grad = t
    return w


def test_other_sizes_and_small_or_empty_results_get_their_own_memory():
    each = 300 * 1000 * 4
    p = pool.Pool(64 << 20)
    a = p.tensor(SHAPE, torch.float32)
    ptr = a.data_ptr()
    del a
    same_bytes = p.tensor((600, 1000), torch.bfloat16)  # the same bytes in another dtype: reused
    assert same_bytes.data_ptr() == ptr and same_bytes.dtype == torch.bfloat16 and same_bytes.shape == (600, 1000)
    other = p.tensor((301, 1000), torch.float32)
    assert other.data_ptr() != ptr and p.held == each + 301 * 1000 * 4
    for shape in [(10, 10), (0, 1000), ()]:  # below pool._MIN_BYTES: torch.empty's memory
        t = p.tensor(shape, torch.float32)
        assert t.shape == shape and t.dtype == torch.float32
    assert p.held == each + 301 * 1000 * 4 and p.reused == 1


def test_a_result_takes_a_free_storage_at_most_a_quarter_larger():
    p = pool.Pool(64 << 20)
    near = p.tensor((320, 1000), torch.float32)
    far = p.tensor((400, 1000), torch.float32)
    near_ptr, far_ptr = near.data_ptr(), far.data_ptr()
    del near, far
    a = p.tensor(SHAPE, torch.float32)  # 1.07x: the 320-row storage
    assert a.data_ptr() == near_ptr and a.shape == SHAPE and a.untyped_storage().nbytes() == 320 * 1000 * 4
    b = p.tensor(SHAPE, torch.float32)  # only the 400-row one is free (1.33x): memory of its own
    assert b.data_ptr() not in (near_ptr, far_ptr) and b.untyped_storage().nbytes() == 300 * 1000 * 4
    a.fill_(1.0)
    b.fill_(2.0)
    assert bool((a == 1.0).all()) and bool((b == 2.0).all())
    assert p.held == (320 + 400 + 300) * 1000 * 4 and p.reused == 1


def test_the_limit_drops_the_least_recently_used_storages_held_by_the_pool_alone():
    each = 300 * 1000 * 4
    p = pool.Pool(3 * each)
    live = [p.tensor(SHAPE, torch.float32) for _ in range(3)]
    assert p.held == 3 * each
    fourth = p.tensor(SHAPE, torch.float32)  # no room, and nothing to drop: not pooled
    assert p.held == 3 * each
    del live[0], fourth
    bigger = p.tensor((600, 1000), torch.float32)  # needs two free storages; one is free
    assert p.held == 3 * each  # so nothing was dropped, and it has memory of its own
    del live[0], bigger
    bigger = p.tensor((600, 1000), torch.float32)  # now two are free: both dropped
    assert p.held == 3 * each and p.reused == 0
    kept = live[0].data_ptr()
    del bigger
    again = p.tensor((600, 1000), torch.float32)
    assert p.reused == 1 and p.held == 3 * each and live[0].data_ptr() == kept


def test_a_resized_storage_leaves_the_pool():
    p = pool.Pool(64 << 20)
    a = p.tensor(SHAPE, torch.float32)
    a.resize_(400, 1000)  # grows the storage the pool handed out
    del a
    b = p.tensor(SHAPE, torch.float32)
    assert b.untyped_storage().nbytes() == 300 * 1000 * 4 and p.reused == 0 and p.held == 300 * 1000 * 4


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("BOO_RESULT_POOL_MB", "0")
    off = pool.Pool(pool._limit())
    a = off.tensor(SHAPE, torch.float32)
    del a
    off.tensor(SHAPE, torch.float32)
    assert off.held == 0 and off.reused == 0
    monkeypatch.setenv("BOO_RESULT_POOL_MB", "2.5")
    assert pool._limit() == int(2.5 * (1 << 20))
    monkeypatch.setenv("BOO_RESULT_POOL_MB", "lots")
    with pytest.raises(BooError, match="BOO_RESULT_POOL_MB"):
        pool._limit()


@pytest.fixture
def fresh_pool(monkeypatch):
    p = pool.Pool(256 << 20)
    monkeypatch.setattr(pool, "RESULTS", p)
    return p


class Block(nn.Module):
    """Results of 0.3-1.5 MB: placed, pooled, and some kept for the backward."""

    def __init__(self, width=389, hidden=1031):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def test_training_steps_match_eager_while_storage_is_reused(fresh_pool):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(411, 389, generator=g)
        before = x.clone()
        loss = run(x).square().mean()
        loss.backward()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        assert torch.equal(x, before)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"step {step} {name}: {m}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert fresh_pool.reused > 0  # the later steps wrote into storage the earlier ones let go


def test_gradients_accumulated_without_zero_grad_are_never_overwritten(fresh_pool):
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo")
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(257, 389, generator=g)
        run(x).sum().backward()
        ref(x).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-4)


def test_results_a_program_keeps_are_never_written_again(fresh_pool):
    """Inference results kept in a list, views of them and numpy copies of their memory all
    keep their values while later calls reuse what was let go."""

    def f(x, w):
        h = torch.tanh(x @ w)
        return h * 2, h.sum(0)

    run = torch.compile(f, backend="boo")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(389, 777, generator=g) / 389**0.5
    kept, expected = [], []
    for i in range(6):
        x = torch.randn(333, 389, generator=g)
        out = run(x, w)
        ref = f(x, w)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=5e-5)  # f32 sums of 389 terms
        if i % 2:  # every other result is kept, in one form or another; the rest are let go
            kept.append({1: out[0], 3: out[0][5:, ::3], 5: out[0].numpy()}[i])
            expected.append({1: ref[0], 3: ref[0][5:, ::3], 5: ref[0].numpy()}[i])
        del out
    for k, e in zip(kept, expected):
        if isinstance(k, np.ndarray):
            np.testing.assert_allclose(k, e, rtol=1e-4, atol=5e-5)
        else:
            torch.testing.assert_close(k, e, rtol=1e-4, atol=5e-5)
    assert fresh_pool.reused > 0


def test_reset_empties_the_pool_and_results_keep_their_storage():
    import boo_backend

    kept = pool.RESULTS.tensor(SHAPE, torch.float32)
    kept.fill_(3.0)
    assert pool.RESULTS.held >= kept.untyped_storage().nbytes()
    boo_backend.reset()
    assert pool.RESULTS.held == 0
    other = pool.RESULTS.tensor(SHAPE, torch.float32)
    other.fill_(4.0)
    assert other.data_ptr() != kept.data_ptr() and bool((kept == 3.0).all())


def test_results_of_dynamic_shape_copied_out_of_iree_reuse_storage_and_keep_their_values(fresh_pool, monkeypatch):
    """local-task's results of dynamic shape are copied out of IREE's pool (memory.out_of_pool)
    into storage from this pool; results kept across calls keep their values."""
    from boo_backend import memory

    monkeypatch.setenv("BOO_CPU_DRIVER", "local-task")
    copied = []
    real = memory.out_of_pool
    monkeypatch.setattr(memory, "out_of_pool", lambda out, spans: copied.append(len(out)) or real(out, spans))

    def f(x):
        return torch.tanh(x) * 3, x.exp().sum(1)

    run = torch.compile(f, backend="boo", dynamic=True)
    g = torch.Generator().manual_seed(4)
    kept = []
    for rows in (301, 437, 301, 437, 301, 437):
        x = torch.randn(rows, 997, generator=g)
        out = run(x)
        torch.testing.assert_close(out[0], f(x)[0], rtol=1e-4, atol=1e-5)
        if rows == 437:
            kept.append((out[0], f(x)[0]))
        del out
    for k, e in kept:
        torch.testing.assert_close(k, e, rtol=1e-4, atol=1e-5)
    assert copied and fresh_pool.reused > 0


def test_dense_copy_uses_the_pool_for_cpu_tensors_only_once_the_last_copy_is_gone(fresh_pool):
    from boo_backend import memory

    t = torch.randn(SHAPE)
    a = memory.dense_copy(t)
    ptr = a.data_ptr()
    b = memory.dense_copy(t.t())
    assert b.data_ptr() != ptr and torch.equal(b, t.t().contiguous())
    del a
    c = memory.dense_copy(t * 2)
    assert c.data_ptr() == ptr and torch.equal(c, t * 2) and torch.equal(b, t.t().contiguous())


def test_storages_made_inside_a_transient_block_are_dropped_unless_still_held():
    p = pool.Pool(64 << 20)
    before = p.tensor(SHAPE, torch.float32)
    del before  # made outside: the pool keeps it
    with p.transient():
        kept = p.tensor((400, 1000), torch.float32)
        with p.transient():
            inner = p.tensor((500, 1000), torch.float32)
            reused = p.tensor(SHAPE, torch.float32)  # the storage made before the block
            dropped = p.tensor((600, 1000), torch.float32)
            del reused, dropped
        held_inner = p.held  # the inner block dropped (600, 1000) only: `inner` is still held
        del inner
    assert held_inner == (300 + 400 + 500) * 1000 * 4
    # The outer block's end dropped `inner`, which the inner block passed on; `kept` lives on.
    assert p.held == (300 + 400) * 1000 * 4
    del kept
    again = p.tensor((400, 1000), torch.float32)  # made inside a block, held past its end
    assert p.reused == 2 and again.shape == (400, 1000)


def test_choosing_a_driver_leaves_no_storage_that_the_steps_do_not_need(fresh_pool, monkeypatch, tmp_path):
    """The driver choice (runtime._choose) calls a part again while the first call's results
    are alive; the storages those calls take are not kept beside the step's own."""
    import boo_backend

    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    held = []
    for _ in range(2):  # cold (choosing), then warm on the same cache (choices read back)
        torch._dynamo.reset()
        boo_backend.reset()
        fresh_pool.clear()
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block())
        run = torch.compile(model, backend="boo")
        x = torch.randn(411, 389, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            run(x).square().mean().backward()
        held.append(fresh_pool.held)
    assert held[0] == held[1] > 0


@pytest.fixture
def pooled_products(fresh_pool, monkeypatch):
    """ATen products of 256 KiB or more written into the pool, as those of 32 MiB are."""
    monkeypatch.setattr(pool, "PRODUCT_MIN_BYTES", 256 << 10)
    return fresh_pool


def test_aten_products_in_pooled_storage_match_float64(pooled_products):
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(301, 517, generator=g), torch.randn(517, 389, generator=g)
    c = torch.randn(389, generator=g)
    x, y = torch.randn(3, 301, 517, generator=g), torch.randn(3, 517, 389, generator=g)
    for _ in range(2):  # the second round writes into the storage the first let go
        got = {"mm": pool.mm(a, b), "addmm": pool.addmm(c, a, b, beta=0.5, alpha=2.0), "bmm": pool.bmm(x, y)}
        want = {"mm": a.double() @ b.double(), "addmm": 0.5 * c.double() + 2.0 * (a.double() @ b.double()),
                "bmm": x.double() @ y.double()}
        for name, t in got.items():
            assert t.is_contiguous() and t.dtype == torch.float32, name
            torch.testing.assert_close(t.double(), want[name], rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")
        del got, t
    assert pooled_products.reused == 3
    small = pool.mm(a[:10], b)  # under the size: torch's own memory, no storage taken
    assert pooled_products.held == 301 * 389 * 4 * 2 + 3 * 301 * 389 * 4 and small.shape == (10, 389)
    a.requires_grad_(True)  # autograd records the call: no out= (which it refuses)
    assert pool.mm(a, b).grad_fn is not None


class Head(nn.Module):
    """A language-model head whose logits and weight gradient ATen computes: the two largest
    results of bench/scale.py's models (62.5 MiB and more there)."""

    def __init__(self, width=389, vocab=1031):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x, labels):
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits, labels)


def test_training_with_pooled_products_matches_eager_and_kept_logits_keep_their_values(pooled_products):
    torch.manual_seed(0)
    model = Head()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", options={"aten_matmul": "always"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    kept = []
    for step in range(5):
        x, labels = torch.randn(267, 389, generator=g), torch.randint(0, 1031, (267,), generator=g)
        logits, loss = run(x, labels)
        ref_logits, ref_loss = ref(x, labels)
        loss.backward(), ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-3, atol=1e-3)  # f32 sums of 389 terms
        grad = model.head.weight.grad
        torch.testing.assert_close(grad, ref.head.weight.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"step {step}: {m}")
        pooled = {s.data_ptr() for same in pooled_products._by_size.values() for s in same}
        assert logits.untyped_storage().data_ptr() in pooled and grad.untyped_storage().data_ptr() in pooled
        if step % 2 == 0:  # kept past the next steps' products, which must not write there
            kept.append((logits, logits.clone()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        del logits
    for logits, then in kept:
        assert torch.equal(logits, then)
    assert pooled_products.reused > 0


def test_gradients_accumulated_into_pooled_products_are_never_overwritten(pooled_products):
    torch.manual_seed(0)
    model = Head()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", options={"aten_matmul": "always"})
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        x, labels = torch.randn(267, 389, generator=g), torch.randint(0, 1031, (267,), generator=g)
        run(x, labels)[1].backward()
        ref(x, labels)[1].backward()
    torch.testing.assert_close(model.head.weight.grad, ref.head.weight.grad, rtol=1e-3, atol=1e-5)
