"""An index out of range raises, as in eager, instead of reading or writing past the tensor
(boo_backend/bounds.py). Each op is checked at odd sizes, static and dynamic: in-range
indices (negative ones too, where the op takes them) give eager's results, and an index past
either end raises where eager raises."""

import pytest
import torch
import torch.nn.functional as F

import boo_backend
from util import assert_close

ROWS, COLS = 67, 9


def _rows_taken(x, i, dim=0):
    """An index shaped for gather/scatter along `dim`."""
    shape = [len(i), COLS] if dim == 0 else [ROWS, len(i)]
    return i.view(-1, 1).expand(shape) if dim == 0 else i.view(1, -1).expand(shape)


# name: (fn(x, i), whether a negative index in range is allowed)
_OPS = {
    "index": (lambda x, i: x[i] * 2, True),
    "index_of_dim_1": (lambda x, i: x.t()[:, i] + 1, True),
    # two index tensors of dynamic sizes become one into the merged dims (rewrites._index_flattened):
    # j = 7 of 5 read the next row's element 2
    "second_of_two_indices": (lambda x, i: x.t()[i.abs() % COLS, i], True),
    "index_put": (lambda x, i: x.index_put((i,), torch.tensor(3.0)), True),
    "index_put_accumulate": (lambda x, i: x.index_put((i,), torch.ones(len(i), COLS), accumulate=True), True),
    "index_select": (lambda x, i: x.index_select(0, i).sum(0), False),
    "gather": (lambda x, i: x.gather(0, _rows_taken(x, i)), False),
    "embedding": (lambda x, i: F.embedding(i, x) * 2, False),
    "scatter": (lambda x, i: x.scatter(0, _rows_taken(x, i), 1.5), False),
    "scatter_add": (lambda x, i: x.scatter_add(0, _rows_taken(x, i), torch.ones(len(i), COLS)), False),
    "scatter_reduce": (lambda x, i: x.scatter_reduce(0, _rows_taken(x, i), torch.ones(len(i), COLS), "amax"), False),
    "index_add": (lambda x, i: x.index_add(0, i, torch.ones(len(i), COLS)), False),
    "index_copy": (lambda x, i: x.index_copy(0, i, torch.ones(len(i), COLS)), False),
    "index_fill": (lambda x, i: x.index_fill(0, i, -2.0), True),
}


def _cases(negatives: bool):
    """(indices, whether eager raises) over ROWS rows, in this order: fine, too high, fine,
    too low (past the start: -ROWS - 1 where `negatives`, else -1, which index_add and
    index_copy refuse too, though torch's decompositions of them count it from the end), fine
    (a good call after a refused one works), and where `negatives`, counted from the end."""
    fine = torch.tensor([0, ROWS - 1, 5, 30, 5])
    low = torch.tensor([3, -ROWS - 1, 2]) if negatives else torch.tensor([3, -1, 2])
    cases = [(fine, False), (torch.tensor([1, ROWS, 4]), True), (torch.tensor([2, ROWS - 2, 60]), False),
             (low, True), (fine[:3], False)]
    if negatives:
        cases.append((torch.tensor([-ROWS, -1, 4]), False))
    return cases


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", list(_OPS))
@pytest.mark.sweep(0.5)
def test_an_index_out_of_range_raises_as_in_eager(name, dynamic, monkeypatch):
    fn, negatives = _OPS[name]
    monkeypatch.setenv("BOO_VERIFY", "off")  # the test compares; eager itself raises on the bad cases
    torch._dynamo.reset()
    boo_backend.reset()
    run = torch.compile(fn, backend="boo", dynamic=dynamic)
    for dtype in (torch.int64, torch.int32):
        for i, raises in _cases(negatives):
            i = i.to(dtype)
            x = torch.randn(ROWS, COLS)
            if raises:
                with pytest.raises((IndexError, RuntimeError)):
                    fn(x.clone(), i.long())
                x0 = x.clone()
                with pytest.raises(IndexError, match="out of range"):
                    run(x, i)
                assert torch.equal(x, x0), f"{name}: the input changed"
            else:  # eager's gather with an expanded int32 index reads row i[0] for every row
                assert_close(run(x, i), fn(x, i.long()), f"{name} {dtype} {i.tolist()}")
    assert all(p.island == 0 for p in boo_backend.placements())


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_target_out_of_range_raises_in_training(dynamic, monkeypatch):
    """cross_entropy's targets (gathered after its ignore_index is masked) and an embedding's
    token ids, in a training step: a label past the classes raises; ignore_index does not."""
    monkeypatch.setenv("BOO_VERIFY", "off")
    torch._dynamo.reset()
    boo_backend.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(101, 24), torch.nn.Linear(24, 37))

    def step(m, ids, labels):
        loss = F.cross_entropy(m(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        return loss

    run = torch.compile(step, backend="boo", dynamic=dynamic)
    ids = torch.randint(0, 101, (3, 19))
    labels = torch.randint(0, 37, (3, 19))
    labels[1, 4] = -100
    assert_close(run(model, ids, labels), step(model, ids, labels))
    for bad_ids, bad_labels in [(ids, labels.clone().index_fill_(1, torch.tensor([7]), 37)),
                                (ids.clone().index_fill_(1, torch.tensor([2]), 101), labels)]:
        with pytest.raises(IndexError):
            step(model, bad_ids, bad_labels)
        with pytest.raises(IndexError, match="out of range"):
            run(model, bad_ids, bad_labels)
    assert_close(run(model, ids[:, :11], labels[:, :11]), step(model, ids[:, :11], labels[:, :11]))
