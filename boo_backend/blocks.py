"""Repeated blocks: the layers of a model, found in a graph so that each distinct one is
lowered and compiled once.

Dynamo records, for every node, the stack of modules it was traced in (`nn_module_stack`;
AOTAutograd's backward nodes carry their forward node's as `fwd_nn_module_stack`). A model's
layers sit in a `ModuleList` or `Sequential`: paths `...h.0`, `...h.1`, ... of one class.
`block_labels` names each node's layer; a graph cut at those labels gives parts that are
often the same graph, and `structure_key` says when two parts are (same ops, arguments,
sizes, strides, dtypes, composites and constants), so one module serves them all.

A leaf: imports only embed (for the composite meta key).
"""

from __future__ import annotations

import hashlib
import operator
import re

import torch
import torch.fx as fx

from .embed import META_KEY

_INDEXED = re.compile(r"^(.*?)(?:\.(\d+)|\[(\d+)\])$")


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """(path, class name) of the modules `node` was traced in, outermost first."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value[0], value[1]
        out.append((str(path), getattr(cls, "__qualname__", str(cls))))
    return out


def keep_module_stacks(gm: fx.GraphModule) -> None:
    """Give backward nodes their forward node's module stack under the key a retrace keeps
    (torch.fx copies `nn_module_stack` to the nodes traced from a node, not the fwd_ form)."""
    for node in gm.graph.nodes:
        if "nn_module_stack" not in node.meta and node.meta.get("fwd_nn_module_stack"):
            node.meta["nn_module_stack"] = node.meta["fwd_nn_module_stack"]


def group_blocks(gm: fx.GraphModule) -> dict[fx.Node, str | None]:
    """`block_labels`, after moving the pieces of a block that the graph computes late (the
    transposed weights a forward returns for its backward, after every layer) up to the end
    of that block's first run, where their inputs allow: each block then is one part.
    Empty when the graph has fewer than two blocks (nothing to cut)."""
    labels = block_labels(gm)
    if len(set(labels.values()) - {None}) < 2:
        return {}
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    anchor: dict[str, fx.Node] = {}  # the last node of each label's first run
    closed: set[str] = set()
    previous = None
    moved = False
    for node in list(gm.graph.nodes):
        label = labels.get(node)
        if node.op != "call_function":
            continue
        if label != previous and previous is not None:
            closed.add(previous)
        previous = label
        if label is None:
            continue
        if label not in closed:
            anchor[label] = node
            continue
        at = anchor[label]
        if all(order[a] <= order[at] for a in node.all_input_nodes):
            at.append(node)
            order[node] = order[at] + 1e-9
            anchor[label] = node
            moved = True
    return block_labels(gm) if moved else labels


def block_labels(gm: fx.GraphModule) -> dict[fx.Node, str | None]:
    """Each call node's repeated block ("<list path>[<index>]"), or None outside them.

    A block is an indexed child (`layers.3`) of a container with at least two indexed
    children of the same class among the graph's nodes; the outermost such level counts.
    Nodes with no module stack (views and getitems AOTAutograd adds) belong to the block of
    the node before them, so that they add no cut."""
    found: dict[fx.Node, tuple[str, str, str]] = {}
    indices: dict[tuple[str, str], set[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for path, cls in module_stack(node):
            m = _INDEXED.match(path)
            if m:
                found[node] = (m.group(1), cls, m.group(2) or m.group(3))
                indices.setdefault((m.group(1), cls), set()).add(m.group(2) or m.group(3))
                break
    repeated = {k for k, v in indices.items() if len(v) >= 2}
    labels: dict[fx.Node, str | None] = {}
    previous = None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        hit = found.get(node)
        if hit is not None and (hit[0], hit[1]) in repeated:
            previous = f"{hit[0]}[{hit[2]}]"
        elif hit is not None or module_stack(node):
            previous = None  # inside the model but outside its repeated blocks
        labels[node] = previous
    return labels


def tensor_text(value: torch.Tensor) -> str:
    """A constant tensor as a key names it: its dtype, layout and a digest of its bytes."""
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"tensor:{_value_text(value)}:{hashlib.sha256(data).hexdigest()}"


def _value_text(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}{tuple(val.shape)}{val.stride()}@{val.storage_offset()}"
    if isinstance(val, (tuple, list)):
        return "(" + ",".join(_value_text(v) for v in val) + ")"
    return repr(val)


# Cutting a graph at its blocks pays when the parts that repeat another hold at least this
# share of the IREE ops: each module costs iree-compile a fixed ~1-2 s here, so a model whose
# blocks all differ (T5's first layer computes the position bias; two layers of anything)
# compiled 18 modules in 63 s where one took 39 s.
REPEATED_SHARE = 0.2
# ... and when its IREE parts write at least this many elements each, on average (the
# elements their ops' results hold, views included; a getitem's are its op's): each part
# is an IREE call whose fixed cost (tens of microseconds in Python and the runtime) the saved
# compile time does not pay back in a small model. The zoo's 2-layer GPT-2 (about 50,000
# elements a part, cut) trained at 0.92x eager, uncut at 1.12x, on an AVX-512 Zen 4; GPT-2
# small and the Llama of bench/scale.py write 2.5-17 million a part.
MIN_PART_ELEMENTS = 1 << 20


def _elements(node: fx.Node) -> int:
    """Elements a node's results hold; for a symbolic size, at the sizes it was traced with
    (its hint; nothing when it has none). Reading the hint adds no guard."""
    val = node.meta.get("val")
    total = 0
    for v in val if isinstance(val, (tuple, list)) else [val]:
        if isinstance(v, torch.Tensor):
            n = v.numel()
            if not isinstance(n, int):
                n = getattr(getattr(n, "node", None), "hint", None)
            total += n if isinstance(n, int) else 0
    return total


def repeats_pay(outer: fx.GraphModule, place_of_part: dict[str, str]) -> bool:
    """Whether the parts of a graph cut at its blocks (`split_islands`' result) repeat enough
    to compile fewer ops than the whole graph holds (see REPEATED_SHARE), and each does
    enough work to be worth a call of its own (MIN_PART_ELEMENTS)."""
    seen: set[str] = set()
    total = repeated = elements = parts = 0
    for sub, place in place_of_part.items():
        if place != "iree":
            continue
        part = getattr(outer, sub)
        calls = [n for n in part.graph.nodes if n.op == "call_function"]
        key = structure_key(part)
        total += len(calls)
        elements += sum(_elements(n) for n in calls if n.target is not operator.getitem)
        parts += 1
        if key in seen:
            repeated += len(calls)
        seen.add(key)
    return total > 0 and repeated >= REPEATED_SHARE * total and elements >= MIN_PART_ELEMENTS * parts


def structure_key(gm: fx.GraphModule) -> str:
    """A digest that two graphs share when they compute the same thing in the same way: the
    same ops in the same order on the same sizes, strides and dtypes, with the same
    composites and constants. Node names do not count."""
    names: dict[fx.Node, str] = {}
    h = hashlib.sha256()
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"%{i}"
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: names[a])
        target = "" if node.op == "placeholder" else node.target
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor):
                target = tensor_text(value)
            else:
                return f"unique:{id(gm)}"  # a submodule or other object: never shared
        elif node.op == "call_module":
            return f"unique:{id(gm)}"
        call = node.meta.get(META_KEY)
        composite = f"{call.entry.name}:{call.entry.version}:{call.params!r}" if call else ""
        h.update(f"{node.op}|{target}|{args!r}|{_value_text(node.meta.get('val'))}|{composite}\n".encode())
    return h.hexdigest()
