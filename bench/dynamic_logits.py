"""Issue 18's table: a GPT-2 compiled with dynamic=True, inference at lengths unlike the
first call's, its logits against eager's (strict mode: every op in IREE).

    BOO_STRICT=1 python bench/dynamic_logits.py

GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=200, n_positions=96), dropout 0,
under torch.no_grad(), shapes in the issue's order. Prints each (batch, length), the largest
logit error and how many positions are off by more than 1e-4.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

SHAPES = [(2, 16), (2, 60), (2, 64), (2, 65), (2, 72), (3, 80), (2, 96)]


def main() -> None:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=200, n_positions=96, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    run = torch.compile(model, backend="boo", dynamic=True)
    g = torch.Generator().manual_seed(1)
    print(f"{'(batch, length)':<16} {'largest error':>14} {'wrong positions':>16}")
    with torch.no_grad():
        for b, n in SHAPES:
            ids = torch.randint(0, 200, (b, n), generator=g)
            err = (run(ids).logits - model(ids).logits).abs()
            wrong = int((err.amax(dim=(0, 2)) > 1e-4).sum())
            print(f"{str((b, n)):<16} {err.max().item():>14.2e} {wrong:>16}")


if __name__ == "__main__":
    main()
