"""Every composite compiles for CUDA (sm_80) and ROCm (gfx942) here, without a GPU, with
static sizes and with its batch, row and sequence dims dynamic.

Hopper (sm_90) has no IREE 3.13 target; boo compiles sm_89 code for it (see compile.py).
Running on a GPU: test_gpu_run.py (marked `gpu`, skipped on machines without one).
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch_mlir import ir

from boo_backend import composites, match, templates
from boo_backend.cache import CompileCache
from boo_backend.compile import compile_mlir, parse_target
from boo_backend.config import Options
from boo_backend.lower import lower
from boo_backend.partition import retrace
from test_composites import ROWS

TARGETS = ["cuda:sm_80", "rocm:gfx942"]


def _lowered(name, dtype, target="llvm-cpu", shape=None):
    """The lowered module of one call of composite `name` for `target`, on `shape` (default:
    64 x 256, or the row's small shape where it is not 2-D)."""
    row = ROWS[name]
    if shape is None:
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
@pytest.mark.sweep(0.5)
def test_composite_compiles_for_gpu(name, dtype, target, tmp_path):
    vmfb = compile_mlir(_lowered(name, dtype, target), parse_target(target), CompileCache(tmp_path, enabled=False))
    assert len(vmfb) > 1000


def _dynamic_params(name, target):
    """The kernel's parameters for the row's first variant with its batch, row and sequence
    dims dynamic (None), as a graph with dynamic shapes gives them."""
    row, entry = ROWS[name], composites.by_name(name)
    shape = (64, 256) if len(row.small) == 2 else row.small
    args, kwargs = row.make(shape, torch.float32, True, row.variants[0])
    schema = entry.op._schema.arguments
    defaults = (kwargs.get(a.name, a.default_value if a.has_default_value() else None) for a in schema[len(args):])
    full = [*args, *defaults]
    outs = entry.op(*args, **kwargs)
    params = {**entry.params(full, kwargs, list(outs) if isinstance(outs, (tuple, list)) else [outs]), "target": target}
    if "shape" in params:  # gelu
        params["shape"] = [None, *params["shape"][1:]]
    dynamic = {"HW": ("N", "HW"), "B": ("B", "L", "S"), "K": ("M", "N")}
    for key in next((v for k, v in dynamic.items() if k in params), ("M",)):
        params[key] = None
    return params


def _with_caller(kernel: str) -> str:
    """`kernel` (a private function) and a public @main that calls it, so that it compiles."""
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(kernel)  # kept alive: `fn` points into it
        fn = module.body.operations[0]
        ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        ins, outs = [str(t) for t in ftype.inputs], [str(t) for t in ftype.results]
        name = ir.StringAttr(fn.attributes["sym_name"]).value
    args = ", ".join(f"%a{i}" for i in range(len(ins)))
    return kernel + (
        f"func.func @main({', '.join(f'%a{i}: {t}' for i, t in enumerate(ins))}) -> ({', '.join(outs)}) {{\n"
        f"  %r:{len(outs)} = func.call @{name}({args}) : ({', '.join(ins)}) -> ({', '.join(outs)})\n"
        f"  return {', '.join(f'%r#{i}' for i in range(len(outs)))} : {', '.join(outs)}\n}}\n"
    )


# The attention forward's online_attention with dynamic sizes takes ~25 s to compile for
# gfx942 (6 s for sm_80); CUDA alone keeps the suite quick.
_DYNAMIC_CASES = [(name, target) for name in sorted(ROWS) for target in TARGETS
                  if (name, target) != ("_scaled_dot_product_flash_attention_for_cpu", "rocm:gfx942")]


@pytest.mark.parametrize("name,target", _DYNAMIC_CASES)
def test_dynamic_composite_compiles_for_gpu(name, target, tmp_path):
    """The kernel with dynamic dims (see test_dynamic_composites) compiles for the GPU target."""
    entry = composites.by_name(name)
    params = _dynamic_params(name, parse_target(target).kind)
    text = templates.render(entry.template, func_name=composites.function_name(entry, params),
                            composite=name, version=entry.version, **params)
    assert "?x" in text, f"{name}: no dynamic dim in {params}"
    vmfb = compile_mlir(_with_caller(text), parse_target(target), CompileCache(tmp_path, enabled=False))
    assert len(vmfb) > 1000


def test_hopper_gets_sm89_code(tmp_path):
    target = parse_target("cuda:sm_90")
    assert "--iree-cuda-target=sm_89" in target.flags
    assert compile_mlir(_lowered("gelu", torch.float32, "cuda:sm_90"), target, CompileCache(tmp_path, enabled=False))
