"""Dynamic shapes: a graph Dynamo traces with symbolic sizes compiles to one IREE module that
serves every size its guards admit, gives eager's results at every size, and refuses (falls
back to per-shape modules) rather than answer wrongly."""

import copy
import logging
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boo_backend
import boo_backend.torch_import
from util import assert_close, close_to_scale

# Batch and sequence sizes of the training loop: padding to each batch's longest sequence,
# a smaller last batch, one of size 1 (Dynamo specializes size 1: a new trace), and which of
# them Dynamo traces: the first shape, the first new length, the first new batch, size 1.
SHAPES = [(2, 16), (2, 24), (4, 32), (3, 40), (2, 48), (4, 64), (1, 80)]
TRACED = [(2, 16), (2, 24), (4, 32), None, None, None, (1, 80)]


def _encoder():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def batch(b, s):
        g = torch.Generator().manual_seed(1000 * b + s)
        return {"src": torch.randn(b, s, 32, generator=g)}

    def loss(m, kw):  # not only the mean square: that of a layer norm's output is 1 always
        out = m(**kw)
        return out.square().mean() + 0.1 * out[:, :, :4].sum()

    return model, batch, loss


def _gpt2():
    pytest.importorskip("transformers")
    from boo_backend.zoo import MODELS

    model, _ = MODELS["gpt2"]()

    def batch(b, s):
        g = torch.Generator().manual_seed(1000 * b + s)
        ids = torch.randint(0, 128, (b, s), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    return model, batch, lambda m, kw: m(**kw).loss


MODELS = {"encoder": _encoder, "gpt2": _gpt2}
# GPT-2 leaves out the size-1 batch, a fourth trace that the encoder covers (each GPT-2 trace
# costs CI about 40 s).
LOOPS = {"encoder": (SHAPES, TRACED), "gpt2": (SHAPES[:-1], TRACED[:-1])}


def _step(model, run, loss_fn, kw):
    model.zero_grad()
    loss = loss_fn(run, kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_step(model, run, ref, loss_fn, x, where, **tolerance):
    """One training step of the compiled `run` of `model` against eager's `ref`: the loss and
    every parameter's gradient."""
    loss, grads = _step(model, run, loss_fn, x)
    ref_loss, ref_grads = _step(ref, ref, loss_fn, x)
    assert_close(loss, ref_loss, f"loss at {where}")
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], f"grad of {name} at {where}", **tolerance)


def _compiles() -> int:
    return boo_backend.stats().get("iree_compiles", 0)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_loop_over_changing_shapes(name):
    """dynamic=None (torch.compile's default): the first shape compiles static graphs; a new
    sequence length makes Dynamo trace it symbolic, a new batch size too (Dynamo marks dims
    dynamic as they change), and boo compiles each symbolic graph once. A shape that Dynamo
    does not trace again compiles nothing; a size-1 batch is traced anew (Dynamo
    specializes size 1). Every step matches eager."""
    boo_backend.reset()
    model, batch, loss_fn = MODELS[name]()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo")
    shapes, expected = LOOPS[name]
    traced = []
    for b, s in shapes:
        graphs, compiles = len(boo_backend.placements()), _compiles()
        kw = batch(b, s)
        loss, grads = _step(model, run, loss_fn, kw)
        ref_loss, ref_grads = _step(ref, ref, loss_fn, kw)
        assert_close(loss, ref_loss, f"{name} loss at {(b, s)}")
        for n in ref_grads:
            assert_close(grads[n], ref_grads[n], f"{name} grad of {n} at {(b, s)}", rtol=1e-4, atol=1e-5)
        new = boo_backend.placements()[graphs:]
        traced.append((b, s) if new else None)
        if not new:
            assert _compiles() == compiles, f"{name}: shape {(b, s)} compiled again without a new trace"
        elif (b, s) != shapes[0]:
            assert all(p.dynamic for p in new), [p.line() for p in new]
    assert traced == expected, traced


@pytest.mark.parametrize("name", ["encoder"])  # every zoo model: tests/test_dynamic_zoo.py
def test_dynamic_true_compiles_one_module_per_graph(name):
    boo_backend.reset()
    model, batch, loss_fn = MODELS[name]()
    run = torch.compile(model, backend="boo", dynamic=True)
    _step(model, run, loss_fn, batch(2, 16))
    placed = boo_backend.placements()
    assert all(p.dynamic for p in placed), [p.line() for p in placed]
    assert sorted(p.kind for p in placed).count("forward") == sorted(p.kind for p in placed).count("backward")
    compiled = _compiles()
    for b, s in [(3, 24), (2, 40), (4, 8)]:
        _step(model, run, loss_fn, batch(b, s))
    assert _compiles() == compiled
    assert len(boo_backend.placements()) == len(placed)


def _views(x):
    b, s = x.shape[0], x.shape[1]
    merged = (x * 2).reshape(-1, 32)                      # [b, s, 4, 8] -> [b*s, 32]
    permuted = x.permute(1, 0, 2, 3).reshape(s * b, 32)   # merging dims of a permute
    split = (merged + 1).reshape(b, s, 4, 8)              # one dim back into several
    rows = (x - 1).reshape(b, -1)                         # an inferred size
    return merged, permuted, split, rows


def _embedding_backward(weight, ids):
    return torch.nn.functional.embedding(ids, weight)


@pytest.mark.parametrize("fn", [_views, _embedding_backward])
def test_ops_torch_mlir_lowers_wrongly_for_dynamic_sizes(fn, caplog):
    """Views that merge dynamic dims, and an embedding's backward (index_put with a 2-D
    index), lowered wrongly with dynamic sizes; boo rewrites both. The module must stay
    dynamic (no disagreement with eager on its first call) and be right at every size."""
    boo_backend.reset()
    run = torch.compile(fn, backend="boo", dynamic=True)
    caplog.set_level(logging.WARNING, logger="boo_backend")
    for b, s in [(2, 4), (3, 6), (5, 3)]:
        if fn is _views:
            args = [torch.randn(b, s, 4, 8)]
        else:
            args = [torch.randn(16, 32, requires_grad=True), torch.randint(0, 16, (b, s))]
        ours = run(*args)
        ref = fn(*args)
        assert_close(ours, ref, f"{fn.__name__} at {(b, s)}")
        if fn is _embedding_backward:
            grad = torch.randn(b, s, 32)
            (g_ours,) = torch.autograd.grad(ours, args[0], grad)
            (g_ref,) = torch.autograd.grad(ref, args[0], grad)
            assert_close(g_ours, g_ref, f"embedding grad at {(b, s)}")
    assert all(p.dynamic for p in boo_backend.placements()), [p.line() for p in boo_backend.placements()]
    assert "disagrees" not in caplog.text


def test_wrong_dynamic_module_is_caught_on_its_first_call(monkeypatch, caplog):
    """Without the view rewrite, torch-mlir's module is wrong; the first call's check
    against eager catches it, warns, and the graph compiles per shape: still right."""
    monkeypatch.setattr(boo_backend.torch_import, "_views_through_one_dim", lambda module: None)
    monkeypatch.setenv("BOO_CACHE", "0")
    boo_backend.reset()
    caplog.set_level(logging.WARNING, logger="boo_backend")
    run = torch.compile(lambda x: (x * 2).reshape(-1, 32), backend="boo", dynamic=True)
    for b, s in [(2, 4), (3, 6)]:
        x = torch.randn(b, s, 4, 8)
        assert_close(run(x), (x * 2).reshape(-1, 32), f"at {(b, s)}")
    assert "disagrees with eager PyTorch" in caplog.text
    assert not any(p.dynamic for p in boo_backend.placements())


def test_graph_that_fails_dynamically_is_compiled_per_shape(monkeypatch, caplog):
    """A graph whose dynamic lowering fails falls back to one module per shape, with a
    debug line, and stays right."""
    real = boo_backend.torch_import.import_core

    def refuse_symbolic(core):
        if any(isinstance(s, torch.SymInt) for n in core.graph.nodes
               for s in getattr(n.meta.get("val"), "shape", ())):
            raise NotImplementedError("symbolic sizes refused by this test")
        return real(core)

    monkeypatch.setattr(boo_backend.torch_import, "import_core", refuse_symbolic)
    monkeypatch.setenv("BOO_CACHE", "0")
    boo_backend.reset()
    caplog.set_level(logging.DEBUG, logger="boo_backend")
    run = torch.compile(lambda x: torch.tanh(x) * 3, backend="boo", dynamic=True)
    for n in (5, 7, 9):
        x = torch.randn(n, 3)
        assert_close(run(x), torch.tanh(x) * 3, f"at {n}")
    assert "does not compile with dynamic shapes" in caplog.text
    assert len(boo_backend.placements()) == 3 and not any(p.dynamic for p in boo_backend.placements())


class _MambaMixer(nn.Module):
    """Mamba's mixer as its slow path writes it: one projection to x and z, `chunk`, a causal
    depthwise conv over x, SiLU gates."""

    def __init__(self, width=32, channels=24):
        super().__init__()
        self.inp = nn.Linear(width, 2 * channels)
        self.conv = nn.Conv1d(channels, channels, 4, groups=channels, padding=3)
        self.out = nn.Linear(channels, width)

    def forward(self, h):
        x, z = self.inp(h).transpose(1, 2).chunk(2, dim=1)
        y = F.silu(self.conv(x)[..., :h.shape[1]]) * F.silu(z)
        return self.out(y.transpose(1, 2))


def _mamba_loop(sizes):
    torch.manual_seed(0)
    model = _MambaMixer()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", dynamic=True)
    for b, s in sizes:
        h = torch.randn(b, s, 32)
        _check_step(model, run, ref, lambda m, h: m(h).square().mean(), h, (b, s))
    return boo_backend.placements()


def test_mamba_causal_conv_over_half_a_projection_is_one_module_for_every_size(monkeypatch):
    """`chunk` with symbolic sizes (torch-mlir fails to lower split_with_sizes; it is sliced
    instead) and a depthwise conv fed by that slice (IREE 3.13 failed with 'failed to resolve
    workgroup count hint' where the module took the sizes as integers): a training step at odd
    lengths past 64 and 128 compiles one forward and one backward module, in strict mode,
    right."""
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()
    placed = _mamba_loop([(2, 37), (3, 70), (2, 131), (4, 100)])
    assert [p.kind for p in placed] == ["forward", "backward"] and all(p.dynamic for p in placed), \
        [p.line() for p in placed]


class _RunsOfPositions(nn.Module):
    """A running count over positions made from the length alone (where a run of consecutive
    positions breaks, as in masks for packed sequences), weighting a projection."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 1)

    def forward(self, x):
        b, n, _ = x.shape
        pos = torch.arange(n).expand(b, -1)
        starts = torch.cat([pos[:, :1] - 1, pos], -1)
        runs = ((starts[:, 1:] - starts[:, :-1]) != 1).cumsum(-1)
        return self.proj(x).squeeze(-1) * (runs + pos)


def test_a_scan_over_positions_made_from_sizes_is_one_module_for_every_size(monkeypatch):
    """The module reads each size from a tensor it is given (lower._sizes_read_from_shapes):
    passed as an integer, IREE 3.13 failed to compile the scan ('write affecting operations on
    global resources are restricted to workgroup distributed contexts'), and the forward
    compiled once per shape."""
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()
    torch.manual_seed(0)
    model = _RunsOfPositions()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", dynamic=True)
    for b, n in [(2, 37), (3, 70), (2, 131)]:
        x = torch.randn(b, n, 12)
        _check_step(model, run, ref, lambda m, x: m(x).square().mean(), x, (b, n), rtol=1e-4, atol=1e-5)
    placed = boo_backend.placements()
    assert [p.kind for p in placed] == ["forward", "backward"] and all(p.dynamic for p in placed), \
        [p.line() for p in placed]


def test_mistral_with_gradient_checkpointing_trains_with_no_island(monkeypatch):
    """Hugging Face's Mistral with gradient checkpointing, `dynamic=True`: its recomputed masks
    count over positions made from the length (the scan above). That module failed in IREE,
    the decompositions tried after it were prims that torch-mlir cannot lower, and 25 ops ran
    in eager islands; now every graph is one module for all sizes, in strict mode."""
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    placed = _mistral_checkpointed_steps(monkeypatch, [(2, 37), (3, 131)], layers=2, width=64)
    assert placed and all(p.dynamic and not p.island for p in placed), [p.line() for p in placed]


def _mistral_checkpointed_steps(monkeypatch, sizes, layers: int, width: int):
    """Training steps of a small Mistral with gradient checkpointing, `dynamic=True`, each
    checked against eager; returns boo's placements."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("BOO_CACHE", "0")
    boo_backend.reset()
    torch.manual_seed(0)
    config = transformers.MistralConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 5 // 2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=211,
                                        max_position_embeddings=512, sliding_window=32)
    model = transformers.MistralForCausalLM(config).train()
    model.gradient_checkpointing_enable()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", dynamic=True)
    for b, n in sizes:
        ids = torch.randint(0, 211, (b, n), generator=torch.Generator().manual_seed(n))
        _check_step(model, run, ref, lambda m, ids: m(ids, labels=ids).loss, ids, (b, n), rtol=1e-3, atol=1e-5)
    return boo_backend.placements()


def test_ops_a_decomposition_brings_in_compile_per_shape_rather_than_run_in_islands(monkeypatch):
    """Without the retry above, IREE rejects Mistral's recomputed mask scan with its sizes as
    integers. torch._decomp's entries for the ops it blames are prims that torch-mlir cannot
    import: those ran in 25 eager islands of a dynamic graph. Such a graph is compiled per
    shape instead, where the ops lower as they are; strict mode (no island) proves it."""
    from boo_backend import lower
    monkeypatch.setattr(lower, "_sizes_read_from_shapes", lambda graph: None)
    monkeypatch.setenv("BOO_STRICT", "1")
    # One size: the module IREE rejects is the dynamic one, tried first (a second size would
    # compile every graph again and prove nothing more; CI time).
    placed = _mistral_checkpointed_steps(monkeypatch, [(2, 37)], layers=1, width=32)
    assert placed and not any(p.island for p in placed), [p.line() for p in placed]
    assert any(not p.dynamic for p in placed), [p.line() for p in placed]


def test_bert_trains_right_with_every_module_reading_its_sizes_from_its_tensors(monkeypatch):
    """The modules that IREE rejects with their sizes as integers are compiled with the sizes
    read from their tensors (the two tests above). Built that way, BERT's backward had the
    value projections' gradients 7% off at (4, 70): IREE 3.13 fused the permute producing the
    attention backward's dO into the kernel and got dv wrong for key rows past 64. The kernel
    now takes each input as a tensor of its own where sizes are dynamic."""
    pytest.importorskip("transformers")
    from boo_backend import assemble, zoo
    lower = assemble.Assembly._lower
    monkeypatch.setattr(assemble.Assembly, "_lower", staticmethod(lambda graph, target, _=False: lower(graph, target, True)))
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()
    model, _ = zoo.MODELS["bert"]()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo")
    for b, n in [(2, 16), (4, 70)]:
        batch = zoo.MODELS["bert"](batch=b, seq=n)[1]
        for value in batch.values():
            for d in range(value.dim()):
                torch._dynamo.maybe_mark_dynamic(value, d)
        model.zero_grad()
        ref.zero_grad()
        run(**batch).loss.backward()
        ref(**batch).loss.backward()
        for (name, ours), theirs in zip(model.named_parameters(), ref.parameters()):
            close_to_scale(ours.grad, theirs.grad, f"grad of {name} at {(b, n)}")
    placed = boo_backend.placements()
    assert any(p.kind == "backward" and p.dynamic for p in placed), [p.line() for p in placed]


def test_wav2vec2_ctc_counts_its_input_lengths_at_every_size(monkeypatch):
    """Wav2Vec2ForCTC without an attention mask counts its input lengths as
    ones_like(input_values, dtype=long).sum(-1), then through its convolutions' floor
    divisions. IREE added the ones once per vector of the length (torch_import._fills_as_splats),
    so the CTC loss was 6 where eager's was 61 and every gradient was wrong, silently."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=48, num_hidden_layers=1, num_attention_heads=4, intermediate_size=100,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, do_stable_layer_norm=True, feat_extract_norm="layer", mask_time_prob=0.0,
        ctc_loss_reduction="mean", pad_token_id=0, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
        feat_proj_dropout=0.0, layerdrop=0.0, final_dropout=0.0)
    model = transformers.Wav2Vec2ForCTC(config).train()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", dynamic=True)
    for b, n in [(3, 1370), (2, 1703)]:
        g = torch.Generator().manual_seed(n)
        audio, labels = torch.randn(b, n, generator=g), torch.randint(1, 32, (b, 7), generator=g)
        _check_step(model, run, ref, lambda m, x: m(input_values=x, labels=labels).loss, audio, (b, n),
                    rtol=1e-3, atol=1e-5)
    placed = boo_backend.placements()
    assert any(p.dynamic for p in placed), [p.line() for p in placed]


@pytest.mark.parametrize("split", ["glu_last_dim", "halves_of_the_sequence", "split_sizes"])
def test_chunk_and_split_are_one_module_for_every_size(split, monkeypatch):
    """torch-mlir fails to lower split_with_sizes (chunk, split) where any size is symbolic,
    and torch._decomp's entry takes no symbolic size: each piece is a slice instead, so a GLU
    over a fused projection, or halves of a sequence, compile one module, forward and
    backward, right at odd lengths past 64 and 128."""
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()
    fns = {
        "glu_last_dim": lambda x: (lambda a, b: a * F.silu(b))(*x.chunk(2, dim=-1)),
        "halves_of_the_sequence": lambda x: (lambda a, b: a.sum(1) - 2 * b.sum(1))(*x.chunk(2, dim=1)),
        "split_sizes": lambda x: (lambda a, b, c: a.sum(-1, keepdim=True) * c + b.mean())(*x.split([5, 2, 5], dim=-1)),
    }
    fn = fns[split]
    run = torch.compile(fn, backend="boo", dynamic=True)
    for b, s in [(2, 38), (3, 70), (2, 132), (4, 100)]:
        x = torch.randn(b, s, 12, requires_grad=True)
        x64 = x.detach().double().requires_grad_()
        ours, ref = run(x), fn(x64)
        grad = torch.randn(ref.shape)
        (dx,) = torch.autograd.grad(ours, x, grad)
        (dx64,) = torch.autograd.grad(ref, x64, grad.double())
        close_to_scale(ours, ref.float(), f"{split} forward at {(b, s)}")
        close_to_scale(dx, dx64.float(), f"{split} backward at {(b, s)}")
    placed = boo_backend.placements()
    assert placed and all(p.dynamic and not p.island for p in placed), [p.line() for p in placed]


def test_channels_last_cnn_is_one_module_for_every_size(monkeypatch):
    """A CNN fed channels_last images (a common speed setting): AOTAutograd gives the globally
    pooled output eager's channels_last strides with an as_strided of symbolic sizes, which
    torch-mlir's importer refused, so forward and backward compiled once per shape."""
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.GELU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 5))
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", dynamic=True)
    for b, side in [(2, 16), (3, 37), (4, 70), (2, 131)]:
        x = torch.randn(b, 3, side, side).to(memory_format=torch.channels_last)
        _check_step(model, run, ref, lambda m, x: m(x).square().mean(), x, (b, side), rtol=1e-3, atol=1e-5)
    placed = boo_backend.placements()
    assert {p.kind for p in placed} == {"forward", "backward"} and all(p.dynamic for p in placed), \
        [p.line() for p in placed]


def test_a_graph_refused_for_every_size_is_not_tried_again_by_a_later_process(monkeypatch, tmp_path, caplog):
    """The refusal is kept in the compile cache: a warm process compiles per shape at once,
    without the failed compiles (MobileViT's paid minutes for them in every process). A
    change to the graph is a different key, and tries again."""
    real = boo_backend.torch_import.import_core
    tries = []

    def refuse_symbolic(core):
        if any(isinstance(s, torch.SymInt) for n in core.graph.nodes for s in getattr(n.meta.get("val"), "shape", ())):
            tries.append(1)
            raise NotImplementedError("symbolic sizes refused by this test")
        return real(core)

    monkeypatch.setattr(boo_backend.torch_import, "import_core", refuse_symbolic)
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.DEBUG, logger="boo_backend")
    for process, op in enumerate((torch.tanh, torch.tanh, torch.sigmoid)):  # the third: another graph
        boo_backend.reset()
        torch._dynamo.reset()
        tries.clear()
        fn = lambda x: op(x) * 3  # noqa: E731
        run = torch.compile(fn, backend="boo", dynamic=True)
        for n in (5, 7, 9):
            x = torch.randn(n, 3)
            assert_close(run(x), fn(x), f"at {n}")
        assert len(boo_backend.placements()) == 3 and not any(p.dynamic for p in boo_backend.placements())
        assert bool(tries) == (process != 1), (process, tries)
    assert "remembered from an earlier process" in caplog.text


class _UnfoldedPatches(nn.Module):
    """MobileViT's transformer input, cut down: a conv's features unfolded into 2x2 patches
    as its `unfolding` does (the width left to `-1`), then layer norm over the width."""

    def __init__(self, channels=16):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, channels, 3, stride=16, padding=1), nn.LayerNorm(channels)

    def forward(self, x):
        features = self.conv(x)
        b, c, h, w = features.shape
        rows, columns = int(math.ceil(h / 2) * 2) // 2, int(math.ceil(w / 2) * 2) // 2
        patches = features.reshape(b * c * rows, 2, columns, 2).transpose(1, 2)
        patches = patches.reshape(b, c, rows * columns, 4).transpose(1, 3)
        return self.norm(patches.reshape(b * 4, rows * columns, -1))


def test_a_kernel_whose_width_the_importer_left_dynamic_is_one_module(monkeypatch):
    """MobileViT's last transformer normalizes unfolded patches of a 2x2 map: the layer-norm
    kernel takes the width (16) as static, but torch-mlir typed the view that feeds it with a
    `?` there, so the call did not match the kernel ('operand type mismatch') and the graph
    compiled once per batch size. The call now casts to the kernel's own types. Inference,
    strict mode."""
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()
    torch.manual_seed(0)
    model = _UnfoldedPatches().eval()
    run = torch.compile(model, backend="boo", dynamic=True)
    with torch.no_grad():
        for b in (2, 7):
            x = torch.randn(b, 3, 32, 32)
            assert_close(run(x), model(x), f"patches at batch {b}")
    placed = boo_backend.placements()
    assert len(placed) == 1 and placed[0].dynamic and placed[0].composites, [p.line() for p in placed]


def test_sizes_given_where_an_op_takes_a_tensor_are_one_module(monkeypatch):
    """`torch.div(seq_len, w, rounding_mode="trunc")` of sizes (Longformer's chunk count)
    traces to div.Tensor_mode of two SymInts; torch-mlir imported them as ints, which the op
    rejects, and five of Longformer's graphs compiled once per shape."""
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()

    def fn(x):
        chunks = torch.div(x.shape[1], 4, rounding_mode="trunc") - 1
        return x * chunks + torch.mul(x.shape[0], 0.5)

    run = torch.compile(fn, backend="boo", dynamic=True)
    for b, s in [(2, 37), (3, 70), (2, 131)]:
        x = torch.randn(b, s, 8)
        close_to_scale(run(x), fn(x.double()).float(), f"at {(b, s)}")
    placed = boo_backend.placements()
    assert len(placed) == 1 and placed[0].dynamic, [p.line() for p in placed]


def test_valid_padding_convolution_backward_is_one_module(monkeypatch):
    """`Conv2d(padding="valid")` (EfficientNet's strided depthwise convs) leaves one padding
    entry for two spatial dims in its backward; with symbolic sizes torch-mlir's lowering read
    past it and iree-compile crashed, so the backward compiled once per shape."""
    monkeypatch.setenv("BOO_CACHE", "0")
    monkeypatch.setenv("BOO_VERIFY", "off")  # a wrong dynamic module must not be caught and hidden
    boo_backend.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, 2, padding="valid", groups=8), nn.GELU(), nn.Conv2d(8, 4, 1))
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", dynamic=True)
    for b, side in [(2, 16), (3, 37), (2, 70)]:
        x = torch.randn(b, 8, side, side)
        _check_step(model, run, ref, lambda m, x: m(x).square().mean(), x, (b, side))
    placed = boo_backend.placements()
    assert [p.kind for p in placed] == ["forward", "backward"] and all(p.dynamic for p in placed), \
        [p.line() for p in placed]


def test_op_unlowerable_only_at_symbolic_sizes_compiles_per_shape_in_strict_mode(monkeypatch):
    """An op that IREE rejects with symbolic sizes and that has no decomposition: the graph
    compiles per shape, where it lowers, rather than keep the op in an island, which strict
    mode refuses. The case is the Mamba conv above without boo's decomposition of a depthwise
    conv and with the sizes passed to the module as integers, not read from its tensors (IREE
    3.13 rejects it then, 'failed to resolve workgroup count hint')."""
    from boo_backend import lower, partition
    monkeypatch.delitem(partition.FALLBACK, torch.ops.aten.convolution.default)
    monkeypatch.setattr(lower, "_sizes_read_from_shapes", lambda graph: None)
    monkeypatch.setenv("BOO_CACHE", "0")
    boo_backend.reset()
    placed = [p for p in _mamba_loop([(2, 37), (3, 64), (5, 101)]) if p.kind == "forward"]
    assert len(placed) == 3 and not any(p.dynamic or p.island for p in placed), [p.line() for p in placed]


def test_graph_split_around_aten_matmuls_stays_dynamic(monkeypatch):
    """Sizes flow between IREE parts and ATen kernels of a split graph."""
    monkeypatch.setenv("BOO_ATEN_MATMUL", "always")
    boo_backend.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="boo", dynamic=True)
    for n in (3, 5, 9):
        x = torch.randn(n, 16)
        _check_step(model, run, ref, lambda m, x: m(x).square().sum(), x, n)
    placed = boo_backend.placements()
    assert len(placed) == 2 and all(p.dynamic and p.aten for p in placed), [p.line() for p in placed]


def test_shape_outside_a_guard_goes_back_through_dynamo():
    def f(x):
        return x.sin() if x.shape[0] > 6 else x.cos()

    boo_backend.reset()
    run = torch.compile(f, backend="boo", dynamic=True)
    for n in (3, 4, 8, 9, 5):
        x = torch.randn(n, 4)
        assert_close(run(x), f(x), f"at {n}")
    assert len(boo_backend.placements()) == 2  # one module per side of the guard
    assert all(p.dynamic for p in boo_backend.placements())


def test_off_switch_compiles_per_shape(monkeypatch):
    monkeypatch.setenv("BOO_DYNAMIC", "0")
    boo_backend.reset()
    run = torch.compile(lambda x: x * 2 + 1, backend="boo", dynamic=True)
    for n in (3, 4, 5):
        x = torch.randn(n)
        assert_close(run(x), x * 2 + 1)
    assert len(boo_backend.placements()) == 3 and not any(p.dynamic for p in boo_backend.placements())


def test_dynamic_module_found_by_any_compatible_shape(tmp_path, monkeypatch):
    """The cache key of a dynamic module is the symbolic graph, not its first shape: after a
    fresh Dynamo and an empty memory cache, another size finds it on disk."""
    monkeypatch.setenv("BOO_CACHE_DIR", str(tmp_path))
    model, batch, loss_fn = _encoder()
    boo_backend.reset()
    _step(model, torch.compile(model, backend="boo", dynamic=True), loss_fn, batch(2, 16))
    assert _compiles() > 0
    torch._dynamo.reset()
    boo_backend.reset()
    _step(model, torch.compile(model, backend="boo", dynamic=True), loss_fn, batch(3, 40))
    assert _compiles() == 0, boo_backend.stats()
    assert all(p.dynamic for p in boo_backend.placements())


def test_second_process_compiles_nothing(tmp_path):
    script = textwrap.dedent("""
        import sys, torch, torch.nn as nn, boo_backend
        torch.manual_seed(0)
        model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        run = torch.compile(model, backend="boo")
        for b, s in [(2, 16), (3, 24), (4, 40)]:  # a static trace, then one symbolic in both dims
            run(torch.randn(b, s, 32)).square().mean().backward()
        print("compiles", boo_backend.stats().get("iree_compiles", 0),
              "dynamic", sum(p.dynamic for p in boo_backend.placements()))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOO_")}
    env.update(BOO_CACHE_DIR=str(tmp_path), BOO_STRICT="1")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    first, second = (r.stdout.split() for r in runs)
    assert int(first[1]) > 0 and int(first[3]) >= 2, first
    assert int(second[1]) == 0 and int(second[3]) >= 2, second


@pytest.mark.parametrize("dynamic", [True, False])
def test_outputs_that_are_views_of_inputs_keep_their_offsets(dynamic):
    """A split by a size Dynamo keeps symbolic: AOTAutograd rebuilds each piece from the
    tensor boo returns (its sizes, strides and storage offset), so boo returns the view of
    the input itself, as eager does, not a fresh tensor at offset 0."""
    def pieces(x, n):
        return torch.split(x, n) + (x[:, 1:].t(), x.narrow(0, 1, 2))

    run = torch.compile(pieces, backend="boo", dynamic=dynamic)
    for rows, n in [(5, 2), (7, 3), (70, 9)]:
        x = torch.randn(rows, 6)
        ours, ref = run(x, n), pieces(x, n)
        assert len(ours) == len(ref)
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert_close(a, b, f"piece {i} at {(rows, n)}")
            assert (a.stride(), a.storage_offset()) == (b.stride(), b.storage_offset()), f"piece {i}"
            assert a.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), f"piece {i} is not a view"


class _Rotary(nn.Module):
    """Attention over rotary-embedded queries and keys, the two ways models write the rotation
    (halves: Llama, Mistral, NeoX; pairs, x[..., ::2]: GPT-J), and a difference along the
    sequence (x[:, 1:] - x[:, :-1])."""

    def __init__(self, width: int = 64, heads: int = 4, pairs: bool = False):
        super().__init__()
        self.heads, self.pairs = heads, pairs
        self.qkv = nn.Linear(width, 3 * width, bias=False)

    def rotate(self, t):
        n, d = t.shape[-2], t.shape[-1]
        angle = torch.arange(n, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2).float() / d)
        if self.pairs:
            rotated = torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)
            angle = angle.repeat_interleave(2, -1)
        else:
            rotated = torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1)
            angle = torch.cat([angle, angle], -1)
        return t * angle.cos() + rotated * angle.sin()

    def forward(self, x):
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, n, w)
        return ((a[:, 1:] - a[:, :-1]) * torch.linspace(-1, 1, w)).sum()


@pytest.mark.parametrize("pairs", [False, True])
def test_rotary_attention_with_dynamic_sizes_trains_like_eager(pairs, monkeypatch):
    """One module for every length, checked against eager at each (no check of boo's own:
    BOO_VERIFY=off). Before torch_import._fills_as_splats, IREE wrote the backward's slices
    of q and k into one shared buffer of zeros, and their gradients came back 40-100% off."""
    monkeypatch.setenv("BOO_VERIFY", "off")
    torch.manual_seed(0)
    model, ref = _Rotary(pairs=pairs), _Rotary(pairs=pairs)
    ref.load_state_dict(model.state_dict())
    boo_backend.reset()
    run = torch.compile(model, backend="boo", dynamic=True)
    for batch, length in [(2, 37), (3, 70), (4, 131), (2, 5)]:  # (size 1 would be specialized)
        x = torch.randn(batch, length, 64, generator=torch.Generator().manual_seed(length))
        for m, call in ((model, run), (ref, ref)):
            m.zero_grad()
            call(x).backward()
        close_to_scale(model.qkv.weight.grad, ref.qkv.weight.grad, f"qkv grad at {batch}x{length}")
    backward = [p for p in boo_backend.placements() if p.kind == "backward"]
    assert len(backward) == 1 and backward[0].dynamic, [p.line() for p in boo_backend.placements()]


def test_gptj_partial_interleaved_rotary_with_dynamic_sizes_trains_like_eager(monkeypatch):
    """GPT-J rotates pairs (x[..., ::2], x[..., 1::2]) of the first rotary_dim of each head:
    its backward writes 26 slices into zeros. IREE got that module wrong with dynamic sizes
    until fusions._pad_instead_of_scatter wrote them as pads. No check of boo's own
    (BOO_VERIFY=off): the module's own gradients, at two lengths."""
    pytest.importorskip("transformers")
    from transformers import GPTJConfig, GPTJForCausalLM

    monkeypatch.setenv("BOO_VERIFY", "off")
    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=1031, n_embd=64, n_layer=1, n_head=4, rotary_dim=8, n_positions=256,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPTJForCausalLM(config).train()
    ref = copy.deepcopy(model)
    boo_backend.reset()
    run = torch.compile(model, backend="boo", dynamic=True)
    for batch, length in [(2, 37), (3, 70)]:
        tokens = torch.randint(0, 1031, (batch, length), generator=torch.Generator().manual_seed(length))
        for m, call in ((model, run), (ref, ref)):
            m.zero_grad()
            call(input_ids=tokens, labels=tokens).loss.backward()
        for (name, ours), theirs in zip(model.named_parameters(), ref.parameters()):
            close_to_scale(ours.grad, theirs.grad, f"{name} grad at {batch}x{length}")
    assert all(p.dynamic for p in boo_backend.placements() if p.kind == "backward")


def _decode_step(q, k_cache, v_cache, k_new, v_new):
    """One token of a decode loop: the new key and value appended to their caches, which
    Dynamo holds as two sizes (two symbols) once their length changes."""
    k = torch.cat([k_cache, k_new], dim=2)
    v = torch.cat([v_cache, v_new], dim=2)
    return F.scaled_dot_product_attention(q, k, v) * 2, k, v


def _decode_args(key_length, value_length):
    g = torch.Generator().manual_seed(key_length)
    return (torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 4, key_length, 16, generator=g),
            torch.randn(2, 4, value_length, 16, generator=g), torch.randn(2, 4, 1, 16, generator=g),
            torch.randn(2, 4, 1, 16, generator=g))


def _uses_attention_kernel(placement) -> bool:
    from boo_backend import composites

    return any(composites.by_name(name).family == "attention" for name, _ in placement.composite_names)


def test_module_that_assumed_a_relation_of_sizes_serves_only_calls_that_meet_it(monkeypatch):
    """boo's trace of attention compares the key and value lengths (a guard Dynamo, which
    holds them as separate symbols, never checks). The module compiled under that guard
    serves every call whose lengths are equal, one compile for all of them (it was one per
    length, once), and a call whose lengths differ does not run it: it gets its own shape,
    whose trace fails on the lengths (strict mode: an error; else the graph runs in eager)."""
    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = torch.compile(_decode_step, backend="boo")
    compiles = None
    for length in (37, 38, 70, 131, 45):  # the first is static; from 38 on, one dynamic module
        args = _decode_args(length, length)
        for ours, theirs in zip(run(*args), _decode_step(*args)):
            assert_close(ours, theirs, f"length {length}")
        if length == 38:
            compiles = boo_backend.stats()["iree_compiles"]
    assert boo_backend.stats()["iree_compiles"] == compiles, [p.line() for p in boo_backend.placements()]
    assert [p.dynamic for p in boo_backend.placements()] == [False, True]
    # the dynamic module assumed the lengths equal for its attention kernel too
    assert _uses_attention_kernel(boo_backend.placements()[-1]), boo_backend.placements()[-1].line()
    with pytest.raises(boo_backend.BooStrictError, match="failed to compile.*batch2"):
        run(*_decode_args(40, 41))
    # A warm start (the module from the disk cache, no trace to add the guard) keeps it.
    torch._dynamo.reset()
    boo_backend.reset()
    run = torch.compile(_decode_step, backend="boo")
    for length in (37, 38, 70):
        args = _decode_args(length, length)
        assert_close(run(*args)[0], _decode_step(*args)[0], f"length {length}, warm")
    assert boo_backend.stats().get("iree_compiles", 0) == 0 and boo_backend.stats()["cache_hits_disk"] > 0
    with pytest.raises(boo_backend.BooStrictError, match="failed to compile.*batch2"):
        run(*_decode_args(40, 41))


def test_generate_decodes_every_token_with_one_module(monkeypatch):
    """Hugging Face generate() with its default dynamic cache: the prefill, the first decode
    step, then one dynamic module for every later token (it compiled one per token, since
    its key and value caches are two symbols; see the test above). Tokens as eager's."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("BOO_VERIFY", "off")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1031, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 1031, (2, 37), generator=torch.Generator().manual_seed(1))
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    boo_backend.reset()
    model.forward = torch.compile(model.forward, backend="boo")
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), expected)
    placed = boo_backend.placements()
    assert len(placed) == 3 and placed[-1].dynamic, [p.line() for p in placed]
    assert _uses_attention_kernel(placed[-1]), placed[-1].line()


def _pad_to_multiple(x):
    """Sizes computed with `%` and `max`, which torch-mlir does not import as Python means
    them (fmod; no sym_max): boo computes them on the host and passes them in."""
    length = x.shape[1]
    y = F.pad(x, (0, 0, 0, (-length) % 8))
    extra = max(3 - length % 2, 0)
    return y.reshape(x.shape[0], -1, 8, x.shape[2]).sum(2) * 2, F.pad(x, (extra, 1)) + length % 5


def test_sizes_computed_with_mod_and_max_serve_every_size_with_one_module(monkeypatch):
    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = torch.compile(_pad_to_multiple, backend="boo", dynamic=True)
    for length in (37, 70, 131, 45, 64):
        x = torch.randn(2, length, 4, generator=torch.Generator().manual_seed(length))
        for ours, theirs in zip(run(x), _pad_to_multiple(x)):
            assert ours.shape == theirs.shape
            assert_close(ours, theirs, f"length {length}")
    placed = boo_backend.placements()
    assert len(placed) == 1 and placed[0].dynamic, [p.line() for p in placed]


def _compiled_twin(make):
    """A model, an eager copy with its weights, and the model compiled with dynamic=True."""
    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    boo_backend.reset()
    return model, ref, torch.compile(model, backend="boo", dynamic=True)


class _SamePadding(nn.Module):
    """TensorFlow's `same` padding as Hugging Face's MobileNets write it: pads computed from
    the input's size (int(), %, max) before each strided or depthwise convolution."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2)
        self.depthwise = nn.Conv2d(8, 8, 3, stride=2, groups=8)
        self.norm = nn.BatchNorm2d(8)

    @staticmethod
    def _same(x, conv):
        pads = []
        for size, k, s in zip((int(x.shape[-1]), int(x.shape[-2])), conv.kernel_size[::-1], conv.stride[::-1]):
            total = max(k - s, 0) if size % s == 0 else max(k - size % s, 0)
            pads += [total // 2, total - total // 2]
        return conv(F.pad(x, pads))

    def forward(self, x):
        h = F.relu6(self.norm(self._same(x, self.stem)))
        return self._same(h, self.depthwise).mean()


def test_same_padding_convolutions_train_with_one_module_per_graph(monkeypatch, caplog):
    """The retrace runs under the Python dispatcher, as AOTAutograd's trace did: pads of
    symbolic sizes reach constant_pad_nd's Python meta, not its C++ kernel, which takes only
    concrete sizes. Before, torch logged that failure as an error (with a traceback) and
    the graph compiled per shape, and the backward's convolution_backward too."""
    monkeypatch.setenv("BOO_VERIFY", "off")
    model, ref, run = _compiled_twin(_SamePadding)
    with caplog.at_level(logging.ERROR):
        for batch, side in [(2, 33), (3, 48), (2, 57)]:
            x = torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(side))
            for m, call in ((model, run), (ref, ref)):
                m.zero_grad()
                call(x).backward()
            for (name, ours), theirs in zip(model.named_parameters(), ref.parameters()):
                close_to_scale(ours.grad, theirs.grad, f"{name} grad at {batch}x{side}")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage()[:200] for r in caplog.records]
    placed = boo_backend.placements()
    assert {p.kind for p in placed} == {"forward", "backward"} and all(p.dynamic for p in placed), \
        [p.line() for p in placed]


class _NegativePad(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return F.pad(self.linear(x), (0, 0, 3, -2))


def test_backward_built_after_its_forward_added_guards_serves_only_sizes_that_meet_them(monkeypatch):
    """Guards that a forward's retrace adds stay in the ShapeEnv that its backward shares:
    once `Eq(s77, 2)` is there, the backward's sizes simplify to constants, and its module
    fits the first call's sizes only. It was kept as the module for every size, and the next
    size crashed in IREE (or, where the sizes had fit, computed on wrong ones). The guards
    are now the conditions of every module built after them (CompiledGraph._conditions_of).
    Retraced without the Python dispatcher, this forward's retrace adds such guards."""
    import contextlib

    import boo_backend.partition

    monkeypatch.setattr(boo_backend.partition, "enable_python_dispatcher", contextlib.nullcontext)
    monkeypatch.setenv("BOO_VERIFY", "off")
    model, ref, run = _compiled_twin(_NegativePad)
    for batch, length in [(2, 37), (3, 101), (2, 70)]:
        x = torch.randn(batch, length, 16, generator=torch.Generator().manual_seed(length))
        weight = torch.randn(batch, length + 1, 16, generator=torch.Generator().manual_seed(1))
        for m, call in ((model, run), (ref, ref)):
            m.zero_grad()
            (call(x) * weight).sum().backward()
        close_to_scale(model.linear.weight.grad, ref.linear.weight.grad, f"grad at {batch}x{length}")
    assert boo_backend.stats()["iree_compiles"] > 2  # the later sizes compiled their own shapes


def _with_an_empty_slice(x):
    empty = x[:, :0] * 3
    return torch.cat([x, empty], 1) * 2, empty.sum(1), empty


def test_empty_results_of_symbolic_sizes_fold_without_raw_sizes_in_the_graph(monkeypatch):
    """An op whose result is empty is folded to `full` of its shape (partition.fold_empty);
    with dynamic shapes, its symbolic sizes are read from the inputs as nodes. They were put
    in the graph as SymInt objects: torch.fx warned ("Raw SymInt value passed as argument")
    three times a graph, and the graph compiled once per shape."""
    import warnings

    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = torch.compile(_with_an_empty_slice, backend="boo", dynamic=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch, length in [(3, 37), (3, 70), (3, 131)]:
            x = torch.randn(batch, length, 4, generator=torch.Generator().manual_seed(length))
            for ours, theirs in zip(run(x), _with_an_empty_slice(x)):
                assert ours.shape == theirs.shape
                assert_close(ours, theirs, f"length {length}")
    assert not [w for w in caught if "SymInt" in str(w.message)], [str(w.message)[:120] for w in caught]
    placed = boo_backend.placements()
    assert len(placed) == 1 and placed[0].dynamic, [p.line() for p in placed]


def _attend_scaled_by_head_size(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return scores.softmax(-1) @ v, F.scaled_dot_product_attention(q, k, v)


def test_floats_of_symbolic_sizes_are_computed_on_the_host(monkeypatch):
    """`/ math.sqrt(q.size(-1))` and SDPA's default scale, with every dim dynamic (head size
    too): a SymFloat, which torch-mlir does not import (sym_float). The module takes it as an
    f64 argument; the graph compiled once per shape."""
    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = torch.compile(_attend_scaled_by_head_size, backend="boo", dynamic=True)
    for length, head in [(37, 24), (70, 37), (131, 16)]:
        g = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(2, 3, length, head, generator=g) for _ in range(3))
        for ours, theirs in zip(run(q, k, v), _attend_scaled_by_head_size(q, k, v)):
            assert_close(ours, theirs, f"{length} x {head}")
    placed = boo_backend.placements()
    assert len(placed) == 1 and placed[0].dynamic, [p.line() for p in placed]


def _pool_rounding_up(x):
    return F.max_pool2d(x[:, None], (3, 1), stride=(2, 1), ceil_mode=True)[:, 0] * 2


def test_max_pooling_with_ceil_mode_is_not_compiled_for_symbolic_sizes(monkeypatch):
    """torch-mlir's ceil_mode pooling with symbolic sizes read past its input (avg_pool2d
    was 1.6x off at 2x37, 1e34 at 3x101: Funnel's pooling of odd lengths) while the
    placement said `dynamic shapes`. Average pooling is rewritten without ceil_mode
    (tests/test_pooling.py); max pooling, whose indices that would change, compiles per
    shape."""
    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = torch.compile(_pool_rounding_up, backend="boo", dynamic=True)
    for batch, length in [(2, 37), (3, 101), (2, 70)]:
        x = torch.randn(batch, length, 64, generator=torch.Generator().manual_seed(length))
        assert_close(run(x), _pool_rounding_up(x), f"{batch}x{length}")
    assert not any(p.dynamic for p in boo_backend.placements())


def _pool_at_argmax(h, ids):
    """CLIP's text pooling: each row's vector at its largest token id."""
    return h[torch.arange(h.shape[0]), ids.to(torch.int).argmax(dim=-1)] * 2


def _index_middle_dims(h, ids):
    """Two index tensors on adjacent inner dims, the first with negative entries."""
    return h[:, ids[:, 0] - 5, ids[:, 1] % 7] * 3


@pytest.mark.parametrize("fn", [_pool_at_argmax, _index_middle_dims], ids=["argmax_pooling", "middle_dims"])
def test_several_index_tensors_are_one_module_for_every_size(fn, monkeypatch):
    """torch-mlir does not lower `x[i, j]` (two index tensors) with symbolic sizes, and the
    graph compiled once per shape; it is now indexed as one merged dim. Forward and
    backward (a scatter-add into the merged dim) at sizes unlike the first."""
    monkeypatch.setenv("BOO_VERIFY", "off")
    boo_backend.reset()
    run = torch.compile(fn, backend="boo", dynamic=True)
    for batch, length in [(2, 37), (3, 101), (2, 70), (4, 131)]:
        g = torch.Generator().manual_seed(length)
        rows = batch if fn is _pool_at_argmax else batch + 5
        h = torch.randn(rows, length, 12, generator=g, requires_grad=True)
        ids = torch.randint(0, 1000 if fn is _pool_at_argmax else 7, (batch, length), generator=g)
        ours, ref = run(h, ids), fn(h, ids)
        grad = torch.randn(ref.shape, generator=g)
        (dh,) = torch.autograd.grad(ours, h, grad)
        (dh_ref,) = torch.autograd.grad(ref, h, grad)
        assert_close(ours, ref, f"{batch}x{length}")
        assert_close(dh, dh_ref, f"grad at {batch}x{length}")
    placed = boo_backend.placements()
    assert len(placed) == 2 and all(p.dynamic for p in placed), [p.line() for p in placed]


def test_a_dynamic_module_that_fails_at_some_sizes_compiles_those_on_their_own(caplog):
    """torch-mlir's sizes for the last of uneven chunks were wrong (the backward's module
    expected 24 where chunk(3) of 70 gives 22), and IREE refused the call: a crash in the
    user's program. Such a size now compiles on its own, and the sizes the module met before
    keep it."""
    def pieces(x):
        return [c * (i + 1) for i, c in enumerate(x.chunk(3, -1))]

    def loss(outs):
        return sum(o.square().sum() for o in outs)

    run = torch.compile(pieces, backend="boo", dynamic=True)
    with caplog.at_level(logging.WARNING, logger="boo_backend"):
        for n in [7, 70, 13, 17, 70]:
            x = torch.randn(3, n, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            ours, ref = run(x), pieces(x_ref)
            assert_close(list(ours), list(ref), f"chunks at {n}")
            loss(ours).backward()
            loss(ref).backward()
            assert_close(x.grad, x_ref.grad, f"gradient at {n}")
    failed = [r.getMessage() for r in caplog.records if "failed at sizes" in r.getMessage()]
    assert failed and len(failed) == len(set(failed)), failed  # each size at most once


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_module_iree_refuses_when_it_runs_falls_back_to_eager(dynamic, monkeypatch):
    """torch-mlir lowers adaptive max pooling whose windows differ in size (17 positions into
    5) to a kernel that IREE refuses only when it runs ("only support cases with fixed stride
    size"): the call's graph runs in eager PyTorch, with a warning, rather than crashing the
    program. In strict mode the error stands. (boo now computes adaptive max pooling its own
    way, pooling.adaptive_max_pool; the test takes that out to reach torch-mlir's kernel.)"""
    from boo_backend import decompositions, graph

    def pool(x):
        return torch.nn.functional.adaptive_max_pool1d(x, 5) * 2

    op = torch.ops.aten.adaptive_max_pool2d.default
    monkeypatch.setattr(graph, "UNLOWERED", decompositions.UNLOWERED - {op})
    monkeypatch.delitem(decompositions.FALLBACK, op)
    monkeypatch.setenv("BOO_STRICT", "0")
    run = torch.compile(pool, backend="boo", dynamic=dynamic)
    seen = set()
    for n in [70, 17, 33, 17]:
        x = torch.randn(2, 3, n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_close(run(x), pool(x), f"pooled at {n}")
        refused = [w for w in caught if "failed at its first call" in str(w.message)]
        assert len(refused) == (n % 5 != 0 and n not in seen), [str(w.message) for w in caught]
        seen.add(n)
    monkeypatch.setenv("BOO_STRICT", "1")
    torch._dynamo.reset()
    with pytest.raises(boo_backend.BooError, match="fixed stride size"):
        torch.compile(pool, backend="boo", dynamic=dynamic)(torch.randn(2, 3, 17))
