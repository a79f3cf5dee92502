"""Small training programs written the way users write them (issue 19), each trained 3 steps
with torch.compile(backend="boo") against the same program in eager, in strict mode, with
no eager islands: a GPT with AdamW and gradient clipping, a CNN with dropout and nll_loss, a
VAE, a spatial transformer network, a vision-language merge, a GAN with transposed convolutions, an LSTM and a GRU language model, a float64 model
trained with LBFGS, bf16 autocast, activation checkpointing, and a compiled whole step.

Randomness (dropout) draws from boo's generator, not eager's, so programs with dropout are
compared with it off (model.eval() for the comparison, train() for the strict run)."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boo_backend
from util import close_to_scale

STEPS = 3


def _no_islands():
    placed = boo_backend.placements()
    assert placed and all(p.island == 0 and not p.recovered for p in placed), [p.line() for p in placed]


def _compare(make, batches, step, rel=2e-4, **compile_kw):
    """Train a model from `make()` and its copy for STEPS steps: one compiled with boo, one
    eager. `step(model, opt, batch)` runs one step and returns the loss; each step's loss and
    the parameters after it are compared."""
    model, opt = make()
    ref, ref_opt = make()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="boo", **compile_kw)
    boo_backend.reset()
    for i, batch in enumerate(batches[:STEPS]):
        loss = step(compiled, opt, batch)
        ref_loss = step(ref, ref_opt, batch)
        close_to_scale(loss.detach(), ref_loss.detach(), f"loss at step {i}", rel=rel)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            close_to_scale(p.detach(), q.detach(), f"{name} after step {i}", rel=rel)
    _no_islands()


def _sgd_step(loss_fn):
    def step(model, opt, batch):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss
    return step


# -- a GPT with AdamW and clipping --------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, vocab=97, d=48, heads=4, layers=2, block=40):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln1": nn.LayerNorm(d), "attn": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
                           "ln2": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d), "out": nn.Linear(4 * d, d)})
            for _ in range(layers))
        self.ln, self.head, self.heads = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False), heads
        self.head.weight = self.tok.weight  # tied, as GPT-2

    def forward(self, idx, targets=None):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            q, k, v = blk["attn"](blk["ln1"](x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](y.transpose(1, 2).contiguous().view(b, t, -1))
            x = x + blk["out"](F.gelu(blk["fc"](blk["ln2"](x)), approximate="tanh"))
        logits = self.head(self.ln(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_gpt_with_adamw_and_clipping():
    def make():
        torch.manual_seed(0)
        model = GPT()
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in model.named_parameters() if p.dim() < 2]
        return model, torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                        lr=3e-4, betas=(0.9, 0.95))

    def step(model, opt, batch):
        x, y = batch
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 97, (3, 37), generator=gen), torch.randint(0, 97, (3, 37), generator=gen))
               for _ in range(STEPS)]
    _compare(make, batches, step, rel=1e-3)


# -- a CNN with dropout and nll_loss (the MNIST example's model) ----------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, 1), nn.Conv2d(8, 16, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(16 * 6 * 6, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.fc1(torch.flatten(self.dropout1(x), 1))
        return F.log_softmax(self.fc2(self.dropout2(F.relu(x))), dim=1)


def test_cnn_with_dropout_and_nll_loss():
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(5, 1, 16, 16, generator=gen), torch.randint(0, 10, (5,), generator=gen))
               for _ in range(STEPS)]
    loss_fn = lambda model, b: F.nll_loss(model(b[0]), b[1])  # noqa: E731

    def make():
        torch.manual_seed(0)
        model = Net().eval()  # dropout off for the comparison with eager
        return model, torch.optim.Adadelta(model.parameters(), lr=1.0)

    _compare(make, batches, _sgd_step(loss_fn))
    # and in train mode (dropout from boo's generator): it runs in IREE and learns
    torch.manual_seed(0)
    model = Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="boo")
    boo_backend.reset()
    for b in batches:
        _sgd_step(loss_fn)(compiled, opt, b)
    _no_islands()


# -- a VAE ----------------------------------------------------------------------------------


class VAE(nn.Module):
    def __init__(self, d=49, h=40, z=6):
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(d, h), nn.Linear(h, z), nn.Linear(h, z)
        self.fc3, self.fc4 = nn.Linear(z, h), nn.Linear(h, d)

    def forward(self, x, eps):
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + eps * torch.exp(0.5 * logvar)  # eps given: the reparameterization's noise
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def test_vae():
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.rand(11, 49, generator=gen), torch.randn(11, 6, generator=gen)) for _ in range(STEPS)]

    def loss_fn(model, b):
        recon, mu, logvar = model(*b)
        bce = F.binary_cross_entropy(recon, b[0], reduction="sum")
        return bce - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())

    def make():
        torch.manual_seed(0)
        model = VAE()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    _compare(make, batches, _sgd_step(loss_fn), rel=1e-3)


# -- a spatial transformer network (affine_grid and grid_sample) ----------------------------


class STN(nn.Module):
    """A localization net predicts an affine transform per image; the image is resampled on
    its grid and classified."""

    def __init__(self, mode, padding, align_corners):
        super().__init__()
        self.mode, self.padding, self.align_corners = mode, padding, align_corners
        self.loc = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                 nn.Linear(24, 6))
        self.head = nn.Linear(3 * 9 * 7, 5)

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3) + torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
        grid = F.affine_grid(theta * 1.7, [x.shape[0], 3, 9, 7], align_corners=self.align_corners)
        y = F.grid_sample(x, grid, mode=self.mode, padding_mode=self.padding, align_corners=self.align_corners)
        return self.head(y.flatten(1))


@pytest.mark.parametrize("mode, padding, align_corners", [
    ("bilinear", "zeros", False), ("nearest", "border", True), ("bicubic", "reflection", True)])
def test_spatial_transformer(mode, padding, align_corners):
    """grid_sampler_2d's backward has no lowering and ran as an eager island in every
    training graph, and so did adaptive average pooling's; boo now differentiates
    grid_sampler_2d's decomposition. Batches of 3, 5 and 3 images of 13 x 11 through one
    module: affine_grid's own backward failed on the symbolic batch (Inductor's too). The
    grid (scaled by 1.7) reaches past the image."""
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(n, 3, 13, 11, generator=gen), torch.randint(0, 5, (n,), generator=gen))
               for n in (3, 5, 3)]
    loss_fn = lambda model, b: F.cross_entropy(model(b[0]), b[1])  # noqa: E731

    def make():
        torch.manual_seed(0)
        model = STN(mode, padding, align_corners)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    _compare(make, batches, _sgd_step(loss_fn), rel=1e-3)


# -- image features placed into token embeddings (a vision-language model) ------------------


class TinyVLM(nn.Module):
    """LLaVA's merge: the projected image patches replace the embeddings of the image tokens
    (masked_scatter), then a text model reads the sequence."""

    IMAGE_TOKEN = 3

    def __init__(self, vocab=37, width=24, patch=12):
        super().__init__()
        self.embed, self.project = nn.Embedding(vocab, width), nn.Linear(patch, width)
        self.layer = nn.TransformerEncoderLayer(width, 4, 48, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, patches):
        embeds = self.embed(ids)
        mask = (ids == self.IMAGE_TOKEN).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, self.project(patches))
        return self.head(self.layer(embeds))


def test_image_features_scattered_into_token_embeddings():
    """masked_scatter's backward (the image projection's gradient) ran as an eager island.
    Batches of 3 and 5 sequences of 19 tokens, 4 image tokens each at different places."""
    gen = torch.Generator().manual_seed(6)
    batches = []
    for n in (3, 5, 3):
        ids = torch.randint(4, 37, (n, 19), generator=gen)
        for row in ids:
            row[torch.randperm(19, generator=gen)[:4]] = TinyVLM.IMAGE_TOKEN
        batches.append((ids, torch.randn(n, 4, 12, generator=gen), torch.randint(0, 37, (n, 19), generator=gen)))

    def loss_fn(model, b):
        return F.cross_entropy(model(b[0], b[1]).flatten(0, 1), b[2].flatten())

    def make():
        torch.manual_seed(0)
        model = TinyVLM()  # SGD: Adam would blow the key bias's zero gradient (noise) up to lr
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    _compare(make, batches, _sgd_step(loss_fn), rel=1e-3)


# -- a GAN with transposed convolutions (DCGAN's shapes, smaller) ----------------------------


def _generator():
    return nn.Sequential(
        nn.ConvTranspose2d(8, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16), nn.ReLU(True),
        nn.ConvTranspose2d(16, 8, 4, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(True),
        nn.ConvTranspose2d(8, 1, 4, 2, 1, bias=False), nn.Tanh())


def _discriminator():
    return nn.Sequential(
        nn.Conv2d(1, 8, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(8, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(16, 1, 4, 1, 0, bias=False), nn.Sigmoid())


def test_gan_with_transposed_convolutions():
    torch.manual_seed(0)
    nets = {"G": _generator(), "D": _discriminator()}
    refs = {k: copy.deepcopy(v) for k, v in nets.items()}
    opts = {k: torch.optim.Adam(v.parameters(), lr=2e-4, betas=(0.5, 0.999)) for k, v in nets.items()}
    ref_opts = {k: torch.optim.Adam(v.parameters(), lr=2e-4, betas=(0.5, 0.999)) for k, v in refs.items()}
    compiled = {k: torch.compile(v, backend="boo") for k, v in nets.items()}
    gen = torch.Generator().manual_seed(4)
    boo_backend.reset()

    def step(G, D, optG, optD, real, noise):
        crit = nn.BCELoss()
        D.zero_grad()
        out = D(real).view(-1)
        err_real = crit(out, torch.ones_like(out))
        err_real.backward()
        fake = G(noise)
        out = D(fake.detach()).view(-1)
        err_fake = crit(out, torch.zeros_like(out))
        err_fake.backward()
        optD.step()
        G.zero_grad()
        out = D(fake).view(-1)
        err_g = crit(out, torch.ones_like(out))
        err_g.backward()
        optG.step()
        return err_real + err_fake, err_g

    for i in range(STEPS):
        real, noise = torch.randn(4, 1, 16, 16, generator=gen).tanh(), torch.randn(4, 8, 1, 1, generator=gen)
        ours = step(compiled["G"], compiled["D"], opts["G"], opts["D"], real, noise)
        theirs = step(refs["G"], refs["D"], ref_opts["G"], ref_opts["D"], real, noise)
        for a, b, what in zip(ours, theirs, ("D loss", "G loss")):
            close_to_scale(a.detach(), b.detach(), f"{what} at step {i}", rel=1e-3)
        for k in nets:
            for (name, p), q in zip(nets[k].named_parameters(), refs[k].parameters()):
                close_to_scale(p.detach(), q.detach(), f"{k}.{name} after step {i}", rel=1e-3)
    _no_islands()
    assert "backward" in {p.kind for p in boo_backend.placements()}


# -- LSTM and GRU language models (the word-language-model example's shape) -----------------


class RNNModel(nn.Module):
    """The recurrence over time as a Python loop of cells: Dynamo in torch 2.13 does not trace
    nn.LSTM/nn.GRU (the whole forward that calls one runs in eager; README, "Graph breaks"),
    and unrolls this loop."""

    def __init__(self, kind, vocab=53, emb=24, hidden=32):
        super().__init__()
        self.kind = kind
        self.encoder = nn.Embedding(vocab, emb)
        self.cell = getattr(nn, kind + "Cell")(emb, hidden)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x):
        emb = self.encoder(x)
        h = emb.new_zeros(x.shape[0], self.cell.hidden_size)
        state = (h, h) if self.kind == "LSTM" else h
        outs = []
        for t in range(x.shape[1]):
            state = self.cell(emb[:, t], state)
            outs.append(state[0] if self.kind == "LSTM" else state)
        return F.log_softmax(self.decoder(torch.stack(outs, 1)), dim=-1)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_rnn_language_model(kind):
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 53, (3, 13), generator=gen), torch.randint(0, 53, (3, 13), generator=gen))
               for _ in range(STEPS)]
    loss_fn = lambda model, b: F.nll_loss(model(b[0]).reshape(-1, 53), b[1].reshape(-1))  # noqa: E731

    def make():
        torch.manual_seed(0)
        model = RNNModel(kind)
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    def step(model, opt, batch):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        return loss

    _compare(make, batches, step, rel=1e-3)


# -- float64 with LBFGS ----------------------------------------------------------------------


def test_float64_model_with_lbfgs():
    """The LSTM time-series example's optimizer on a float64 MLP with tanh: LBFGS calls the
    closure (forward and backward) several times a step."""
    x = torch.linspace(-3, 3, 97, dtype=torch.float64).unsqueeze(1)
    y = torch.sin(x) * torch.exp(-x.square() / 4)

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 1)).double()
        return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)

    def step(model, opt, batch):
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        return opt.step(closure)

    _compare(make, [None] * STEPS, step, rel=1e-9)


# -- bf16 autocast ---------------------------------------------------------------------------


def test_bf16_autocast_training():
    gen = torch.Generator().manual_seed(6)
    batches = [(torch.randn(19, 40, generator=gen), torch.randint(0, 7, (19,), generator=gen)) for _ in range(STEPS)]

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(40, 72), nn.LayerNorm(72), nn.GELU(), nn.Linear(72, 7))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(model, opt, batch):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss

    _compare(make, batches, step, rel=2e-2)


# -- activation checkpointing and a compiled whole step --------------------------------------


class Residual(nn.Module):
    def __init__(self, d=48):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.fc2(F.dropout(F.silu(self.fc1(self.ln(x))), 0.1, self.training))


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(3))
        self.head = nn.Linear(48, 5)

    def forward(self, x):
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
        return self.head(x.mean(1))


def test_activation_checkpointing():
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(4, 23, 48, generator=gen), torch.randint(0, 5, (4,), generator=gen)) for _ in range(STEPS)]
    loss_fn = lambda model, b: F.cross_entropy(model(b[0]), b[1])  # noqa: E731

    def make():
        torch.manual_seed(0)
        model = Deep().eval()  # dropout off for the comparison with eager
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    _compare(make, batches, _sgd_step(loss_fn))
    torch.manual_seed(0)
    model = Deep().train()  # with dropout: the checkpointed regions redraw their masks in IREE
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="boo")
    boo_backend.reset()
    losses = [_sgd_step(loss_fn)(compiled, opt, b).item() for b in batches]
    assert all(math.isfinite(v) for v in losses)
    _no_islands()


def test_compiled_whole_step():
    """Forward, loss, backward, clip, AdamW step and zero_grad in one compiled function."""
    gen = torch.Generator().manual_seed(8)
    batches = [(torch.randn(13, 37, generator=gen), torch.randint(0, 11, (13,), generator=gen)) for _ in range(STEPS)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 70), nn.GELU(), nn.Linear(70, 11))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)

    def train_step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    compiled = torch.compile(train_step, backend="boo")
    boo_backend.reset()
    for i, (x, y) in enumerate(batches):
        close_to_scale(compiled(model, opt, x, y).detach(), train_step(ref, ref_opt, x, y).detach(), f"loss {i}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            close_to_scale(p.detach(), q.detach(), f"{name} after step {i}", rel=1e-3)
    _no_islands()


@pytest.mark.parametrize("norm_first, activation, masks", [(False, "relu", "padding"), (True, "gelu", "causal")])
def test_transformer_encoder_inference(norm_first, activation, masks):
    """nn.TransformerEncoder in eval mode without gradients, as a text classifier: its layers
    take torch's fused fast path (aten._transformer_encoder_layer_fwd), which ran as an eager
    island until boo took it apart (fastpaths.py). Padded rows, a causal mask and a row with
    every key masked (NaN, as eager); two sequence lengths through one dynamic module."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(90, 6, 70, batch_first=True, norm_first=norm_first, activation=activation)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()

    def classify(x, pad):
        if masks == "padding":
            h = encoder(x, src_key_padding_mask=pad)
        else:
            causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            h = encoder(x, mask=causal.isinf().expand(x.shape[0] * 6, -1, -1), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1)
        return (h * keep).sum(1) / keep.sum(1).clamp_min(1)

    compiled = torch.compile(classify, backend="boo", dynamic=True)
    for length in (11, 37):
        x = torch.randn(3, length, 90)
        pad = torch.arange(length) >= torch.tensor([[length], [length - 4], [0 if masks == "causal" else 5]])
        with torch.no_grad():
            out, ref = compiled(x, pad), classify(x, pad)
        assert torch.equal(out.isnan(), ref.isnan()) and (masks == "padding") != bool(ref.isnan().any())
        torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), rtol=1e-4, atol=1e-5)
    _no_islands()
