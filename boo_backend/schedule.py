"""The order of a graph's nodes before it is cut into parts: nodes that run in the same place
(IREE, an ATen kernel, an eager island) and the same repeated block are brought together, so
the graph is cut into fewer, larger parts.

A graph is cut wherever the place changes (partition.split_islands). The order Dynamo and
AOTAutograd give mixes places more than the data needs: GPT-2's backward sums a bias's
gradient after the two matmuls that read the same gradient, a part of its own (12 per step,
each a few ms on a single core); a forward's views of a matmul's result (`q`, `k`, `v` split
from one projection) become a part of their own, and the part that reads them gets permuted
views, which it must be passed as dense copies. Reordered, the sum runs in the part that
computes the gradient, and the views in the part that reads them (IREE then reads the
matmul's result itself).

Imports nothing else from boo_backend.
"""

from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx


def _writes(node: fx.Node) -> bool:
    """Whether a node writes into memory that others may read (an in-place op, a custom op
    that mutates its input): nothing moves across it, since who reads before or after the
    write is not in the graph's edges."""
    return node.op == "call_function" and node.is_impure()


def _draws(node: fx.Node) -> bool:
    """Whether a node draws from the random generator: such nodes keep their order among
    themselves (eager's draws happen in the graph's order)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _neutral(node: fx.Node) -> bool:
    """A node that starts no run of its own: a getitem joins the part of the node it reads,
    and a get_attr is a constant any part may take."""
    return node.op == "get_attr" or (node.op == "call_function" and node.target is operator.getitem)


def cluster(gm: fx.GraphModule, places: dict[fx.Node, str], labels: dict | None = None) -> bool:
    """Reorder `gm`'s nodes in place (a topological order of the same graph) so that runs of
    one place and block label are as long as the data allows. List scheduling: among the
    nodes whose inputs are computed, take one of the current run's key if there is one,
    else the earliest in the old order. A source (a node that reads no computed value: a
    constant, a fill, a view of an input) waits until a node that reads it has all its
    other inputs: computed early, it would only hold memory for longer. Nothing moves
    across a node that writes memory (_writes), and random draws keep their order among
    themselves. Returns whether the order changed."""
    labels = labels or {}
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(nodes)}
    inputs: dict[fx.Node, set[fx.Node]] = {}
    barrier, since_barrier, previous_draw = None, [], None
    for n in nodes:
        inputs[n] = {a for a in n.all_input_nodes if a in index}
        if _writes(n):
            inputs[n].update(since_barrier)
            barrier, since_barrier = n, []
        elif barrier is not None:
            inputs[n].add(barrier)
        since_barrier.append(n)
        if _draws(n):
            if previous_draw is not None:
                inputs[n].add(previous_draw)
            previous_draw = n
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for a in inputs[n]:
            users[a].append(n)
    source = {n for n in nodes if not inputs[n] and not _neutral(n) and not _writes(n) and not _draws(n)}
    waiting = {n: len(inputs[n]) for n in nodes}  # inputs not yet scheduled
    computed_waiting = {n: len(inputs[n] - source) for n in nodes}  # of those, not sources

    ready_any: list = []  # (index, node) heaps, lazily cleaned of scheduled nodes
    ready_by_key: dict = {}
    ready_neutral: list = []
    unreleased = sorted(source, key=index.__getitem__, reverse=True)  # a stack, earliest last
    released: set[fx.Node] = set()
    done: set[fx.Node] = set()

    def key(n: fx.Node):
        return places.get(n), labels.get(n)

    def push(n: fx.Node) -> None:
        if _neutral(n):
            heapq.heappush(ready_neutral, (index[n], n))
        else:
            heapq.heappush(ready_any, (index[n], n))
            heapq.heappush(ready_by_key.setdefault(key(n), []), (index[n], n))

    def release_sources_of(n: fx.Node) -> None:
        for a in inputs[n] & source:
            if a not in released:
                released.add(a)
                push(a)

    for n in nodes:
        if n in source:
            continue
        if not waiting[n]:
            push(n)
        elif not computed_waiting[n]:
            release_sources_of(n)

    order: list[fx.Node] = []
    current = None
    while len(order) < len(nodes):
        picked = _pop(ready_neutral, done) or _pop(ready_by_key.get(current, []), done) or _pop(ready_any, done)
        if picked is None:  # only unreleased sources are left that nothing will release
            while unreleased and unreleased[-1] in released:
                unreleased.pop()
            if not unreleased:
                raise RuntimeError("boo: schedule.cluster found a cycle; the graph is not a DAG")
            released.add(unreleased[-1])
            push(unreleased[-1])
            continue
        done.add(picked)
        order.append(picked)
        if not _neutral(picked):
            current = key(picked)
        for u in users[picked]:
            waiting[u] -= 1
            if picked not in source:
                computed_waiting[u] -= 1
            if not waiting[u]:
                push(u)
            elif not computed_waiting[u]:
                release_sources_of(u)
    if order == nodes:
        return False
    anchor = next((n for n in reversed(gm.graph.nodes) if n.op == "placeholder"), None)
    for n in order:
        if anchor is None:
            first = next(iter(gm.graph.nodes))
            if first is not n:
                first.prepend(n)
        elif anchor.next is not n:
            anchor.append(n)
        anchor = n
    gm.graph.lint()
    gm.recompile()
    return True


def _pop(heap: list, done: set):
    while heap:
        _, n = heapq.heappop(heap)
        if n not in done:
            return n
    return None
