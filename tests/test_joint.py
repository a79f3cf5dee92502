"""The joint-graph rewrite (boo_backend/joint.py): cross-entropy's forward saves the logits and
a row statistic, not the log-probabilities. Checked on the partition itself (what the forward
saves), and end to end in strict mode against float64, at sizes unlike each other."""

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, default_partition, min_cut_rematerialization_partition

import boo_backend
from boo_backend import joint, match
from boo_backend.config import Options

aten = torch.ops.aten


def _partitioned(fn, inputs, partition_fn=min_cut_rematerialization_partition, opts=None):
    """(forward graph, backward graph) that AOTAutograd makes of `fn` with boo's
    decompositions and boo's rewrite of the joint graph."""
    opts = opts or Options()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = aot_function(fn, keep, keep, partition_fn=joint.partition(partition_fn, opts),
                            decompositions=match.decompositions(opts))
    compiled(*inputs).sum().backward()
    return graphs


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _saved_shapes(forward):
    """Shapes of the forward's outputs past the user's own (the tensors saved for backward)."""
    (out,) = [n for n in forward.graph.nodes if n.op == "output"]
    return [tuple(v.meta["val"].shape) for v in out.args[0][1:] if isinstance(v, torch.fx.Node)]


@pytest.mark.parametrize("partition_fn", [min_cut_rematerialization_partition, default_partition])
def test_the_forward_saves_the_logits_and_a_row_statistic(partition_fn):
    x = torch.randn(67, 1001, requires_grad=True)
    y = torch.randint(0, 1001, (67,))
    forward, backward = _partitioned(lambda x, y: F.cross_entropy(x * 2, y), (x, y), partition_fn)
    assert aten._log_softmax.default not in _targets(forward)
    assert aten.logsumexp.default in _targets(forward)
    saved = _saved_shapes(forward)
    # the logits (or x, to recompute them) and [67, 1]: no second [67, 1001] tensor
    assert sorted(saved).count((67, 1001)) == 1 and (67, 1) in saved, saved
    assert aten._log_softmax_backward_data.default in _targets(backward)


def test_with_composites_off_the_statistics_are_eagers_own():
    x = torch.randn(9, 130, requires_grad=True)
    y = torch.randint(0, 130, (9,))
    forward, _ = _partitioned(lambda x, y: F.cross_entropy(x, y), (x, y),
                              opts=Options.resolve({"force_decompose": "logsumexp"}))
    targets = _targets(forward)
    assert aten.logsumexp.default not in targets and aten._log_softmax.default not in targets
    assert aten.amax.default in targets and [s for s in _saved_shapes(forward) if s == (9, 1)]


@pytest.mark.parametrize("case", ["log_probs_returned", "label_smoothing", "bfloat16"])
def test_other_readers_or_dtypes_keep_log_softmax(case):
    x = torch.randn(11, 37, dtype=torch.bfloat16 if case == "bfloat16" else torch.float32, requires_grad=True)
    y = torch.randint(0, 37, (11,))
    if case == "log_probs_returned":
        def fn(x, y):
            lp = F.log_softmax(x, -1)
            return F.nll_loss(lp, y) + lp.sum()
    else:
        def fn(x, y):
            return F.cross_entropy(x, y, label_smoothing=0.1 if case == "label_smoothing" else 0.0)
    forward, _ = _partitioned(fn, (x, y))
    assert aten._log_softmax.default in _targets(forward)


def _float64_step(fn, x, *rest):
    x64 = x.detach().double().requires_grad_()
    loss = fn(x64, *[r.double() if r.is_floating_point() else r for r in rest])
    loss.sum().backward()
    return loss.detach(), x64.grad


def _relative(ours, ref):
    return ((ours.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# (logits' shape, the call): a batch of tokens over a vocabulary past 128 and of no power of
# two; ignored targets, class weights, every reduction; logits that mask some classes with
# -inf. Two cases the rewrite declines, which must stay correct: a sequence model's [batch,
# classes, length] layout reads the log-probabilities through a view (nll_loss2d's), and
# class weights multiply the whole [rows, classes] tensor before the gather.
_CASES = {
    "mean_ignore": ((261, 1013), dict(ignore_index=-100)),
    "sum": ((67, 517), dict(reduction="sum")),
    "sum_weights": ((67, 517), dict(reduction="sum", weight=True, declined=True)),
    "none": ((33, 2049), dict(reduction="none")),
    "seq_layout": ((5, 131, 19), dict(ignore_index=3, declined=True)),
    "masked_classes": ((45, 301), dict(mask=True)),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_cross_entropy_training_matches_float64(name, caplog):
    shape, kw = _CASES[name]
    kw = dict(kw)
    torch.manual_seed(len(name))
    classes = shape[1]
    x = (torch.randn(shape) * 3).requires_grad_()
    target_shape = (shape[0],) + tuple(shape[2:])
    y = torch.randint(0, classes, target_shape)
    weight = torch.rand(classes) + 0.5 if kw.pop("weight", False) else None
    declined = kw.pop("declined", False)
    if kw.get("ignore_index") is not None:
        y.view(-1)[::7] = kw["ignore_index"]
    if kw.pop("mask", False):
        x.data[:, ::5] = float("-inf")
        y = y - y % 5 + 1  # no target is a masked class

    def fn(x, y, *w):
        return F.cross_entropy(x, y, weight=w[0] if w else None, **kw)

    rest = (weight,) if weight is not None else ()
    boo_backend.reset()
    with caplog.at_level("DEBUG", logger="boo_backend"):
        compiled = torch.compile(fn, backend="boo", dynamic=False)
        for _ in range(2):  # a second call runs what the first compiled
            x.grad = None
            loss = compiled(x, y, *rest)
            loss.sum().backward()
    assert ("the forward saves row statistics" in caplog.text) is not declined
    ref_loss, ref_grad = _float64_step(fn, x, y, *rest)
    assert torch.isfinite(x.grad).all() and _relative(loss, ref_loss) < 1e-5, (loss, ref_loss)
    assert _relative(x.grad, ref_grad) < 1e-5
    # the logsumexp kernel (the declined case: log-softmax's)
    assert sum(p.composites for p in boo_backend.placements()) >= 1
