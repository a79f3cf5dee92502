"""Every composite compiles for CUDA (sm_80) and ROCm (gfx942) here, without a GPU.

Hopper (sm_90) has no IREE 3.13 target; boo compiles sm_89 code for it (see compile.py).
Running on a GPU is marked `gpu` and skipped on machines without one.
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from boo_backend import composites, match
from boo_backend.cache import CompileCache
from boo_backend.compile import compile_mlir, parse_target
from boo_backend.config import Options
from boo_backend.lower import lower
from boo_backend.partition import retrace
from test_composites import ROWS

TARGETS = ["cuda:sm_80", "rocm:gfx942"]


def _lowered(name, dtype, target="llvm-cpu"):
    row = ROWS[name]
    shape = (64, 256) if len(row.small) == 2 else row.small  # attention's is (B, H, L, S, D)
    args, kwargs = row.make(shape, dtype, True, row.variants[0])
    op = composites.by_name(name).op
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def fn(*ts):
        full = list(args)
        for i, t in zip(positions, ts):
            full[i] = t
        return op(*full, **kwargs)

    opts = Options.resolve()
    gm = make_fx(fn, tracing_mode="fake")(*tensors)
    gm = retrace(gm, tensors, match.canonical_table(opts))
    assert len(match.apply(gm, opts, parse_target(target).kind)) == 1
    lowered = lower(gm)
    assert f"@boo.{name}." in lowered.mlir
    return lowered.mlir


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(ROWS))
def test_composite_compiles_for_gpu(name, dtype, target, tmp_path):
    vmfb = compile_mlir(_lowered(name, dtype, target), parse_target(target), CompileCache(tmp_path, enabled=False))
    assert len(vmfb) > 1000


def test_hopper_gets_sm89_code(tmp_path):
    target = parse_target("cuda:sm_90")
    assert "--iree-cuda-target=sm_89" in target.flags
    assert compile_mlir(_lowered("gelu", torch.float32, "cuda:sm_90"), target, CompileCache(tmp_path, enabled=False))


@pytest.mark.gpu
def test_runs_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA or ROCm device on this machine")
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    ln = torch.nn.LayerNorm(256).cuda()
    out = torch.compile(lambda t: torch.nn.functional.gelu(ln(t)), backend="boo")(x)
    out.sum().backward()
    assert x.grad is not None
