"""The order a graph is cut in (schedule.cluster): nodes of one place brought together where
the data allows, random draws and writes kept in order, constants computed where they are read."""

import operator

import torch
import torch.fx as fx

import boo_backend
from boo_backend import schedule
from boo_backend.runtime import IreeFunction
from util import assert_close

aten = torch.ops.aten


def _graph(build) -> tuple[fx.GraphModule, dict]:
    """A graph made by `build(graph, x, w)`, which returns {node: place} and the outputs."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    places, outputs = build(g, x, w)
    g.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), g), places


def _runs(gm: fx.GraphModule, places: dict) -> list[str]:
    runs = []
    for n in gm.graph.nodes:
        if n in places and n.target is not operator.getitem and (not runs or runs[-1] != places[n]):
            runs.append(places[n])
    return runs


def _interleaved(g, x, w):
    """relu (IREE), a matmul (ATen), a sum of the relu (IREE), a second matmul (ATen)."""
    h = g.call_function(aten.relu.default, (x,))
    y1 = g.call_function(aten.mm.default, (h, w))
    s = g.call_function(aten.sum.dim_IntList, (h, [0]))
    y2 = g.call_function(aten.mm.default, (h, w))
    return {h: "iree", y1: "aten", s: "iree", y2: "aten"}, [y1, s, y2]


def test_nodes_of_one_place_are_brought_together():
    gm, places = _graph(_interleaved)
    x, w = torch.randn(5, 3), torch.randn(3, 4)
    before = gm(x, w)
    assert _runs(gm, places) == ["iree", "aten", "iree", "aten"]
    assert schedule.cluster(gm, places)
    assert _runs(gm, places) == ["iree", "aten"]
    for a, b in zip(gm(x, w), before):
        assert torch.equal(a, b)
    assert not schedule.cluster(gm, places), "a second pass changed the order again"


def test_block_labels_still_cut():
    gm, places = _graph(_interleaved)
    h, y1, s, y2 = list(places)
    labels = {h: "layers[0]", y1: "layers[0]", s: "layers[1]", y2: "layers[1]"}
    schedule.cluster(gm, places, labels)
    order = [n for n in gm.graph.nodes if n in places]
    assert order == [h, y1, s, y2], "a node moved into another block's run"


def test_random_draws_and_writes_keep_their_order():
    def build(g, x, w):
        a = g.call_function(aten.rand_like.default, (x,))
        m = g.call_function(aten.mm.default, (x, w))
        b = g.call_function(aten.rand_like.default, (x,))  # IREE, like `a`; may not pass `m`'s draw
        c = g.call_function(aten.bernoulli.default, (m,))
        d = g.call_function(aten.add.Tensor, (b, a))
        return {a: "iree", m: "aten", b: "iree", c: "aten", d: "iree"}, [c, d]

    gm, places = _graph(build)
    a, m, b, c, d = list(places)
    schedule.cluster(gm, places)
    order = [n for n in gm.graph.nodes if n in places]
    assert order.index(a) < order.index(b) < order.index(c)


def test_nothing_moves_across_a_write():
    """`y.mul_(3)` returns y, but a reader of y after it has no edge to it in the graph."""
    def build(g, x, w):
        y = g.call_function(aten.add.Tensor, (x, 1))
        m = g.call_function(aten.mm.default, (x, w))
        write = g.call_function(aten.mul_.Tensor, (y, 3))
        r = g.call_function(aten.relu.default, (y,))
        return {y: "iree", m: "aten", write: "eager", r: "iree"}, [m, r]

    gm, places = _graph(build)
    y, m, write, r = list(places)
    x, w = torch.randn(5, 3), torch.randn(3, 4)
    before = gm(x, w)
    schedule.cluster(gm, places)
    order = [n for n in gm.graph.nodes if n in places]
    assert order.index(y) < order.index(write) < order.index(r)
    for a, b in zip(gm(x, w), before):
        assert torch.equal(a, b)


def test_a_constant_is_made_where_it_is_read():
    def build(g, x, w):
        h = g.call_function(aten.relu.default, (x,))
        m = g.call_function(aten.mm.default, (h, w))
        zeros = g.call_function(aten.zeros.default, ([5, 4],))  # reads nothing computed
        s = g.call_function(aten.add.Tensor, (m, zeros))
        return {h: "iree", m: "aten", zeros: "iree", s: "iree"}, [s]

    gm, places = _graph(build)
    h, m, zeros, s = list(places)
    schedule.cluster(gm, places)
    order = [n for n in gm.graph.nodes if n in places]
    assert order == [h, m, zeros, s], "the fill moved away from its reader"


class _Mlp(torch.nn.Module):
    """Two linear layers that are not a list (a list's items are blocks, cut apart)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(67, 131), torch.nn.Linear(131, 29)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_bias_gradient_joins_the_part_that_makes_its_input(monkeypatch):
    """A linear layer's backward with matmuls in ATen: the bias gradient's sum runs in the
    IREE part that computes the gradient it sums, not in a part of its own after the matmuls."""
    calls = []
    original = IreeFunction.__call__

    def counting(self, *args, **kwargs):
        calls.append(self.graph)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(IreeFunction, "__call__", counting)
    torch.manual_seed(0)
    model = _Mlp()
    x = torch.randn(37, 67)
    ref = model(x).square().sum()
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    boo_backend.reset()
    compiled = torch.compile(model, backend="boo", options={"aten_matmul": "always", "strict": True})
    out = compiled(x).square().sum()
    calls.clear()
    out.backward()
    assert_close(out, ref)
    for p, g in zip(model.parameters(), grads):
        assert_close(p.grad, g, "gradient")
    # The backward: GELU's backward and both biases' sums in one part between the matmuls.
    # The second bias's sum reads only the incoming gradient, so it waits for that part (in
    # the order AOTAutograd gives, these were three parts).
    assert len(calls) == 1, calls
