"""The main job: train a small model for a few steps with boo and with eager, side by side.

Prints each step's loss and time for both, then where boo placed every graph's ops.
Exits non-zero if the losses differ. Uses only boo_backend's public API.
"""

import argparse
import copy
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import boo_backend


class Net(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear, then a classifier."""

    def __init__(self, d_in=64, hidden=256, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, d_in)
        self.head = nn.Linear(d_in, classes)

    def forward(self, x):
        h = self.fc2(F.gelu(self.norm(self.fc1(x))))
        return self.head(h + x)


def run(model, compiled, batches, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, times = [], []
    for x, y in batches:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    return losses, times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
               for _ in range(args.steps)]

    eager_model = copy.deepcopy(model)
    eager_losses, eager_times = run(eager_model, eager_model, batches, args.lr)
    boo_model = copy.deepcopy(model)
    boo_losses, boo_times = run(boo_model, torch.compile(boo_model, backend="boo"), batches, args.lr)

    print(f"{'step':>4}  {'eager loss':>12}  {'boo loss':>12}  {'eager ms':>9}  {'boo ms':>9}")
    for i, (le, lb, te, tb) in enumerate(zip(eager_losses, boo_losses, eager_times, boo_times)):
        note = "  (includes compile)" if i == 0 else ""
        print(f"{i:>4}  {le:>12.6f}  {lb:>12.6f}  {te:>9.2f}  {tb:>9.2f}{note}")
    print("\nplacement summary:")
    for placement in boo_backend.placements():
        print("  " + placement.line())

    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager_losses, boo_losses))
    ok = worst <= 1e-4
    print(f"\nlargest relative loss difference: {worst:.2e} -> {'losses match' if ok else 'LOSSES DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
