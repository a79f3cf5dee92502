"""Rewrites of AOTAutograd's joint graph (forward and backward in one graph), made before the
partition decides what the forward saves for the backward. Imports composites (a leaf),
config and fusions' helpers from boo_backend.

- **Cross-entropy saves a row statistic** (`_row_stats`): `log_softmax(x)` whose only
  readers are gathers (nll_loss's forward picks each row's target), its own backward and
  `*_like` fills of its shape is `x - logsumexp(x)`. The forward then gathers from `x` and
  subtracts the statistic, and the backward computes `exp(x - lse)` from `x` again
  (fusions._cross_entropy_backward makes that one pass). The forward no longer writes the
  log-probabilities, a tensor as large as the logits (65 MB for 512 tokens over a
  vocabulary of 32000), and the backward reads `x`, which a language model returns as its
  logits and holds anyway, where it read a saved copy. The partition saves `x` and the
  [rows, 1] statistic (AOTAutograd's min-cut bans recomputing reductions; its default
  partition saves what the forward made).
  The statistic is one kernel (the logsumexp composite, composites/softmax.py) where that
  composite is on and takes the dtype; else the maximum `m` and `log(sum(exp(x - m)))`,
  subtracted in eager's own order.
  Measured on [512, 32000] float32 logits (Xeon, 2 cores; bench/cross_entropy.py and
  bench/RESULTS.md): forward 9.5 ms before, 3.8-5.1 ms with the module on local-task and
  9.2-10.3 on local-sync; backward 12.1 ms before, 8.5-13.6 after (Inductor: 5.3-6.6 and
  28.5-31).
  Declined, so computed as before: float32 and float64 only (in half precision log_softmax
  rounds its result once, and the subtractions here would round twice); static sizes only
  (new nodes' values are computed on them, and symbolic ones could gain guards);
  log-probabilities read through a view (nll_loss2d: [batch, classes, length] logits) or
  multiplied whole (class weights), or read by anything else (label smoothing's sum, a
  user's own use).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from . import composites
from .config import Options
from .fusions import _EXACT, _insert, _val

aten = torch.ops.aten
log = logging.getLogger("boo_backend")

_LIKES = (aten.full_like.default, aten.zeros_like.default, aten.empty_like.default)


def _readers(ls: fx.Node, dim: int, x: torch.Tensor):
    """(gathers, backwards, likes, aliases) reading `ls` directly or through aliases, or None
    if any other node reads it."""
    gathers, backwards, likes, aliases = [], [], [], []
    pending = [ls]
    while pending:
        node = pending.pop()
        for user in node.users:
            t = user.target
            if t is aten.alias.default:
                aliases.append(user)
                pending.append(user)
            elif (t is aten.gather.default and user.args[0] is node and len(user.args) == 3
                  and not user.kwargs.get("sparse_grad", False) and user.args[1] % x.dim() == dim):
                index = _val(user.args[2])
                if not (isinstance(index, torch.Tensor)
                        and all(index.shape[i] == x.shape[i] for i in range(x.dim()) if i != dim)):
                    return None  # the row statistics would not broadcast to the gathered shape
                gathers.append(user)
            elif (t is aten._log_softmax_backward_data.default and len(user.args) == 4
                  and user.args[1] is node and user.args[0] is not node and user.args[2] % x.dim() == dim):
                backwards.append(user)
            elif t in _LIKES and user.args[0] is node and _val(node).stride() == x.stride():
                likes.append(user)
            else:
                return None
    return gathers, backwards, likes, aliases


def _row_stats(graph: fx.Graph, ls: fx.Node, lse_composite: bool) -> bool:
    if ls.target is not aten._log_softmax.default or len(ls.args) != 3 or ls.args[2] or ls.kwargs:
        return False
    x_node, dim = ls.args[0], ls.args[1]
    x = _val(x_node)
    if not (isinstance(x, torch.Tensor) and x.dtype in _EXACT and x.dim() >= 1 and isinstance(dim, int)
            and all(isinstance(n, int) for n in x.shape) and _val(ls).dtype == x.dtype):
        return False
    dim %= x.dim()
    found = _readers(ls, dim, x)
    mode = detect_fake_mode([x])
    if found is None or mode is None or not (found[0] or found[1]):
        return False
    gathers, backwards, likes, aliases = found

    def call(anchor, target, *args) -> fx.Node:
        with mode:
            value = target(*fx.node.map_arg(args, _val))
        return _insert(graph, anchor, target, args, value)

    if lse_composite and x.dtype in composites.ELEMENT_TYPES:  # one row statistic, one kernel
        stats = [call(ls, aten.logsumexp.default, x_node, [dim], True)]
    else:  # eager's order of operations: (x - m) - log(sum(exp(x - m)))
        m = call(ls, aten.amax.default, x_node, [dim], True)
        stats = [m, call(ls, aten.log.default, call(ls, aten.sum.dim_IntList, call(
            ls, aten.exp.default, call(ls, aten.sub.Tensor, x_node, m)), [dim], True))]

    def log_probs(anchor, values):
        for stat in stats:
            values = call(anchor, aten.sub.Tensor, values, stat)
        return values

    for g in gathers:
        g.replace_all_uses_with(log_probs(g, call(g, aten.gather.default, x_node, g.args[1], g.args[2])))
    for b in backwards:
        b.replace_input_with(b.args[1], log_probs(b, x_node))
    for like in likes:
        like.replace_input_with(like.args[0], x_node)
    for node in [*gathers, *reversed(aliases), ls]:
        graph.erase_node(node)
    return True


def rewrite(joint: fx.GraphModule, opts: Options) -> fx.GraphModule:
    """`joint`, changed in place where a rewrite above applies."""
    lse_composite = aten.logsumexp.default in composites.enabled(opts.force_decompose)
    changed = [node.name for node in list(joint.graph.nodes)
               if node.op == "call_function" and _row_stats(joint.graph, node, lse_composite)]
    if changed:
        log.debug("boo: the forward saves row statistics for %s", ", ".join(changed))
        joint.graph.lint()
        joint.recompile()
    return joint


def partition(partition_fn, opts: Options):
    """AOTAutograd's `partition_fn`, run on the rewritten joint graph."""
    def run(joint: fx.GraphModule, joint_inputs, **kwargs):
        return partition_fn(rewrite(joint, opts), joint_inputs, **kwargs)

    return run
