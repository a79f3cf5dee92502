"""boo's own FX-level rewrites. Imports only bags, distances, fastpaths, gammas, pooling, refusals, symbolic
and nans, all leaves.

- AOT: entries that replace core ATen's in the table given to AOTAutograd.
- FALLBACK: decompositions for ops that torch-mlir cannot lower and whose torch._decomp entry
  is missing or leads back to such ops. Used at fallback step 3, before torch._decomp.
(The rewrites that steer around IREE's and torch-mlir's bugs live in rewrites.py, pooling's
in pooling.py.)
"""

from __future__ import annotations

import functools
import itertools
import math

import sympy
import torch

from . import bags, distances, fastpaths, gammas
from .nans import PRIMS
from .pooling import (adaptive_avg_pool_backward, adaptive_max_pool, avg_pool_backward, max_pool3d_with_indices_backward,
                      max_pool_backward_at_indices, replication_pad_backward)
from .refusals import raise_when_run, refusal
from .symbolic import expr

aten = torch.ops.aten


def _squeeze_dims(x, dims):
    dims = {d % max(x.dim(), 1) for d in dims}
    return aten.reshape.default(x, [s for i, s in enumerate(x.shape) if i not in dims or s != 1])


def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.empty_like` of a permuted tensor (torch-mlir does not know the op): an empty
    tensor of the sizes in memory order, seen in the logical order. Its values are unset."""
    physical = aten.empty.memory_format([size[d] for d in physical_layout], dtype=dtype, device=device)
    return aten.permute.default(physical, [list(physical_layout).index(d) for d in range(len(size))])


def _flash_attention_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal,
                                  *, attn_mask=None, scale=None):
    """Attention backward from the saved log-sum-exp: recompute the probabilities, then
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K * scale, dK = dS^T Q * scale."""
    if dropout_p != 0.0 or not _grouped(q, k):
        return NotImplemented  # dropout masks are not reproduced here
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    acc = _accumulation_dtype(q)
    qf, dof, of = (t.to(acc) for t in (q, grad_out, out))
    kf, vf = (_repeat_heads(t.to(acc), q) for t in (k, v))
    scores = _masked_scores(qf, kf, scale, is_causal, attn_mask)
    probs = torch.exp(scores - logsumexp.to(acc).unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-2, -1), dof)
    dprobs = torch.matmul(dof, vf.transpose(-2, -1))
    delta = (dof * of).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, kf)
    dk = torch.matmul(dscores.transpose(-2, -1), qf)
    return dq.to(q.dtype), _sum_groups(dk, k).to(k.dtype), _sum_groups(dv, v).to(v.dtype)


def _flash_attention_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Attention forward that also returns the log-sum-exp its backward needs (torch._decomp's
    entry returns the probabilities in that place, which only inference can use)."""
    if dropout_p != 0.0 or not _grouped(q, k):
        return NotImplemented
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    acc = _accumulation_dtype(q)
    scores = _masked_scores(q.to(acc), _repeat_heads(k.to(acc), q), scale, is_causal, attn_mask)
    lse = _logsumexp_last(scores)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), _repeat_heads(v.to(acc), q))
    return out.to(q.dtype), lse


def _logsumexp_last(scores):
    """logsumexp over the last dim, written out (torch-mlir's lowering of aten.logsumexp is
    rejected by iree-compile, which cost two failed compiles per graph): the row maximum
    taken out, a row of -inf (every key masked) giving -inf as eager's does."""
    top = torch.amax(scores, dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    return (torch.log(torch.sum(torch.exp(scores - top), dim=-1, keepdim=True)) + top).squeeze(-1)


def _accumulation_dtype(q):
    """The CPU flash kernel's (at::opmath_type): float32 for half types, else q's own dtype,
    so float64 attention stays float64 and its log-sum-exp is float64, as the ATen backward
    that may run in an eager island expects."""
    return torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype


def _grouped(q, k) -> bool:
    """Whether k's heads divide q's: grouped-query attention (enable_gqa) when fewer."""
    return q.dim() == 4 and k.dim() == 4 and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0


def _repeat_heads(t, q):
    """Key or value heads repeated to q's head count: head h of q reads head h // group,
    as SDPA's enable_gqa does (repeat_interleave over dim 1)."""
    group = q.shape[1] // t.shape[1]
    if group == 1:
        return t
    b, h, s, d = t.shape
    return t.unsqueeze(2).expand(b, h, group, s, d).reshape(b, h * group, s, d)


def _sum_groups(grad, like):
    """The gradient of _repeat_heads: sum over each group of query heads."""
    group = grad.shape[1] // like.shape[1]
    if group == 1:
        return grad
    b, h, s, d = like.shape
    return grad.reshape(b, h, group, s, d).sum(dim=2)


def _masked_scores(qf, kf, scale, is_causal, attn_mask):
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if is_causal:
        lq, lk = qf.shape[-2], kf.shape[-2]
        # SDPA's is_causal aligns the mask to the top left (query i sees keys 0..i), also
        # when lq != lk; the CPU flash kernel does the same.
        keep = torch.ones(lq, lk, dtype=torch.bool, device=qf.device).tril(diagonal=0)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(scores.dtype))
    return scores


def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    """`x` with its diagonal(offset, dim1, dim2) replaced by `src`, as a select between the
    two (torch._decomp's entry writes into a clone, and torch-mlir's lowering fails in IREE;
    torch.func.jacrev builds its basis this way). The element at (i, j) of dims (dim1, dim2)
    is on the diagonal where j - i == offset, and then it is src's element i - max(-offset, 0)."""
    dim1, dim2 = dim1 % x.dim(), dim2 % x.dim()
    rows, cols, length = x.shape[dim1], x.shape[dim2], src.shape[-1]
    if length == 0:
        return x.clone()

    def along(n, dim):
        shape = [1] * x.dim()
        shape[dim] = n
        return torch.arange(n, device=x.device).reshape(shape)

    on = along(cols, dim2) - along(rows, dim1) == offset
    at_row = (torch.arange(rows, device=x.device) - max(-offset, 0)).clamp(0, length - 1)
    placed = src.to(x.dtype).index_select(-1, at_row).unsqueeze(-1).movedim([-2, -1], [dim1, dim2])
    return torch.where(on, placed, x)


def _masked_scatter_backward(grad, mask, sizes):
    """The gradient of masked_scatter's source: grad's elements where `mask` holds, in order,
    in a tensor of the source's `sizes` (zeros past the last). Each masked element goes to
    its rank among the masked ones (a cumulative sum), the rest to one slot past the end
    that is dropped: static sizes, where eager's masked_select has a size only the data
    knows. It was an eager island (a vision-language model's image features placed into
    its token embeddings)."""
    mask = mask.expand(grad.shape).reshape(-1)
    total = math.prod(sizes)
    rank = torch.cumsum(mask.to(torch.int64), 0) - 1
    slot = torch.where(mask, rank.clamp_max(total), total)  # a mask with more places than sizes holds: dropped
    placed = torch.zeros(total + 1, dtype=grad.dtype, device=grad.device).scatter_add(0, slot, grad.reshape(-1))
    return placed[:total].reshape(sizes)


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """`x` with the elements of its as_strided(size, stride, offset) view replaced by `src`
    (AOTAutograd's backward of an as_strided view, e.g. under adaptive average pooling).
    torch._decomp only turns it into prims.as_strided_scatter. A row-major window of x's
    elements is a slice_scatter of the flattened tensor; any other view an index_put at the
    positions it reads. Positions count in x's storage, so x must be contiguous."""
    if not x.is_contiguous():
        return NotImplemented
    offset, numel = storage_offset or 0, 1
    for s in size:
        numel *= s
    flat, values = x.reshape(-1), src.reshape(-1).to(x.dtype)
    if numel == 0:
        return x.clone()
    expected, acc = [], 1
    for s in reversed(size):
        expected.append(acc)
        acc *= s
    if all(expr(s) == 1 or expr(st) - expr(e) == 0 for s, st, e in zip(size, stride, reversed(expected))):
        if expr(offset) == 0 and sympy.expand(expr(numel) - expr(flat.shape[0])) == 0:
            return values.reshape(x.shape)  # the whole of x (sizes may be symbolic)
        out = aten.slice_scatter.default(flat, values, 0, offset, offset + numel)
    else:
        index = torch.full([1] * len(size), offset, dtype=torch.int64, device=x.device)
        for d, (s, st) in enumerate(zip(size, stride)):
            shape = [1] * len(size)
            shape[d] = s
            index = index + (torch.arange(s, device=x.device) * st).reshape(shape)
        out = aten.index_put.default(flat, [index.reshape(-1)], values)
    return out.reshape(x.shape)


def _weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """Gradients of w = v * (g / ||v||), the norm over every dim but `dim` (the backward of
    torch._weight_norm, as nn.utils.parametrizations.weight_norm uses it). torch._decomp has
    no entry; this is ATen's own formula, accumulated in float32 for half types as its CPU
    kernel does."""
    dim = dim % saved_v.dim()
    dtype = torch.float32 if saved_v.dtype in (torch.float16, torch.bfloat16) else saved_v.dtype
    gw, v, g = grad_w.to(dtype), saved_v.to(dtype), saved_g.to(dtype)
    shape = [s if d == dim else 1 for d, s in enumerate(v.shape)]
    norms = saved_norms.to(dtype).reshape(shape)
    others = [d for d in range(v.dim()) if d != dim]
    sums = aten.sum.dim_IntList(gw * v, others, True) if others else gw * v
    grad_v = (g.reshape(shape) / norms) * (gw - v * (sums / (norms * norms)))
    grad_g = sums / norms
    return grad_v.to(saved_v.dtype), grad_g.reshape(saved_g.shape).to(saved_g.dtype)


def _scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """float8 matmul with per-tensor or per-row/column scales: the product of the float32
    values, accumulated in float32, scaled, biased, then cast (as eager's CPU kernel)."""
    if scale_result is not None:
        return NotImplemented
    f32 = torch.float32
    out = torch.mm(a.to(f32), b.to(f32)) * scale_a.to(f32) * scale_b.to(f32)
    if bias is not None:
        out = out + bias.to(f32)
    return out.to(out_dtype if out_dtype is not None else a.dtype)


def _constant_pad_by_gather(x, pad, value=0.0):
    """constant_pad_nd without a write into a slice: along each padded dim, the input read at
    clamped positions (index_select), and `value` where a position falls outside it; a
    negative pad (a crop) is the same read. torch._decomp's entry writes x into a slice of a
    filled tensor with prims.copy_to, a mutation the partitioned graph does not order, and
    IREE 3.13 fails to compile a concatenation or a pad fed by a slice of symbolic size
    ('failed to resolve workgroup count hint'); a gather compiles."""
    for i in range(len(pad) // 2):
        dim, left, right = x.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        if isinstance(left, int) and isinstance(right, int) and left == 0 and right == 0:
            continue
        n = x.shape[dim]
        shape = list(x.shape)
        shape[dim] = n + left + right
        if isinstance(n, int) and n == 0:
            x = aten.full.default(shape, value, dtype=x.dtype, device=x.device)
            continue
        at = torch.arange(n + left + right, device=x.device) - left
        picked = aten.index_select.default(x, dim, torch.clamp(at, 0, n - 1))
        inside = ((at >= 0) & (at < n)).reshape([-1] + [1] * (x.dim() - 1 - dim))
        x = aten.where.self(inside, picked, aten.scalar_tensor.default(value, dtype=x.dtype, device=x.device))
    return x


# More taps make a dispatch that, with symbolic sizes, needs more than the 64 push constants
# IREE's CPU runtime takes (a 7x7 kernel needs 86).
_MOST_TAPS = 16


def _depthwise_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A depthwise convolution (one input channel per group, one output channel per input
    channel, few taps) as the sum over its taps of the padded input's strided slices, each
    times that tap's per-channel weight. IREE 3.13 failed to compile a depthwise conv1d whose
    input comes through a transpose and a slice when the module took its symbolic sizes as
    integers ('failed to resolve workgroup count hint': Mamba's causal conv over half of a
    projection), and the graph compiled once per shape; lower._sizes_read_from_shapes avoids
    that, and this serves the convolutions IREE still rejects. Half types are summed in
    float32."""
    nd, k = x.dim() - 2, list(weight.shape[2:])
    if (transposed or x.dim() < 3 or groups != x.shape[1] or list(weight.shape[:2]) != [groups, 1]
            or math.prod(k) > _MOST_TAPS):
        return NotImplemented
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    padded = _constant_pad_by_gather(x.to(acc), [e for p in reversed(padding) for e in (p, p)])
    size = padded.shape[2:]
    out = [(n - d * (kk - 1) - 1) // st + 1 for n, d, kk, st in zip(size, dilation, k, stride)]
    w = weight.to(acc)
    total = None
    for tap in itertools.product(*[range(kk) for kk in k]):
        piece = padded
        for i, t in enumerate(tap):
            start = t * dilation[i]
            piece = aten.slice.Tensor(piece, 2 + i, start, start + (out[i] - 1) * stride[i] + 1, stride[i])
        term = piece * w[(slice(None), 0, *tap)].reshape([-1] + [1] * nd)
        total = term if total is None else total + term
    if bias is not None:
        total = total + bias.to(acc).reshape([-1] + [1] * nd)
    return total.to(x.dtype)


def _transposed_convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                                     output_padding, groups, output_mask):
    """The gradients of a transposed convolution from ordinary convolutions, which torch-mlir
    lowers: its input gradient is the ordinary convolution of `grad` with the same weight
    (the adjoint), its weight gradient the weight gradient of that ordinary convolution with
    `x` as the gradient, its bias gradient the sum of `grad` over all but the channels."""
    if not transposed:
        return NotImplemented
    plain = [0] * len(stride)
    dx = dw = db = None
    if output_mask[0]:
        dx = aten.convolution.default(grad, weight, None, stride, padding, dilation, False, plain, groups)
    if output_mask[1]:
        dw = aten.convolution_backward.default(x, grad, weight, None, stride, padding, dilation, False, plain,
                                               groups, [False, True, False])[1]
    if output_mask[2]:
        wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
        db = aten.sum.dim_IntList(grad, [0, *range(2, grad.dim())], dtype=wide).to(grad.dtype)
    return dx, dw, db


def _fma(a, b, c):
    """Dynamo's form of addcmul_/addcdiv_ with value= and add_ with a tensor alpha (every
    Adam-family step): a * b + c. Eager computes those ops unfused too, with a number `b`
    first converted to the tensors' type: for integers, `x.addcmul_(y, y, value=0.5)` leaves
    x as it is (b * a in float, truncated when copied back, gave x + y * y / 2)."""
    if isinstance(b, float) and all(isinstance(t, torch.Tensor) and _integral(t.dtype) for t in (a, c)):
        b = int(b)
    return a * b + c


def _integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _per_tensor(op, base):
    """A _foreach_ op as one `base` call per tensor: list arguments (Tensor[], Scalar[])
    indexed, the rest shared; addcmul/addcdiv's per-tensor `scalars` tensor indexed too."""
    listed = [isinstance(a.type, torch._C.ListType) for a in op._schema.arguments]
    names = [a.name for a in op._schema.arguments]
    # Arguments the per-tensor op takes by keyword only (addcmul's value, add's alpha).
    keyword = {a.name for o in base.overloads() for a in getattr(base, o)._schema.arguments if a.kwarg_only}
    weighted = "scalars" in names and base in (aten.addcmul, aten.addcdiv)

    def run(*args, **kwargs):
        args = list(args) + [kwargs.pop(n) for n in names[len(args):] if n in kwargs]
        count = len(next(a for a, is_list in zip(args, listed) if is_list))
        results = []
        for i in range(count):
            call = [a[i] if is_list else a for a, is_list in zip(args, listed)]
            if weighted and isinstance(call[names.index("scalars")], torch.Tensor):
                self_, t1, t2, weights = call[:4]
                term = aten.mul.Tensor(t1, t2) if base is aten.addcmul else aten.div.Tensor(t1, t2)
                results.append(aten.add.Tensor(self_, aten.mul.Tensor(term, weights[i])))
            else:
                named = {n: a for n, a in zip(names, call) if n in keyword}
                results.append(base(*[a for n, a in zip(names, call) if n not in keyword], **named, **kwargs))
        return results

    return run


def foreach_decompositions() -> dict:
    """Every functional _foreach_ overload whose per-tensor op exists: torch-mlir lowers no
    _foreach_ op, and optimizers (foreach=True, the default on CPU tensors) and clip_grad_norm_
    call them."""
    table = {}
    for name in dir(aten):
        base = getattr(aten, name[len("_foreach_"):], None) if name.startswith("_foreach_") else None
        if base is None or name.endswith("_"):
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            if "out" not in overload:
                table[getattr(packet, overload)] = _per_tensor(getattr(packet, overload), base)
    return table


def fma_decomposition() -> dict:
    from torch._inductor import inductor_prims  # noqa: F401  (registers prims.fma)

    return {torch.ops.prims.fma.default: _fma}


def cast_to(out, expected):
    """`out` (a decomposition's result) with the dtypes of `expected` (the op's own results)."""
    if isinstance(out, (tuple, list)) and isinstance(expected, (tuple, list)):
        fixed = [cast_to(o, e) for o, e in zip(out, expected)]
        return fixed if isinstance(out, list) else tuple(fixed)
    if isinstance(out, torch.Tensor) and isinstance(expected, torch.Tensor) and out.dtype != expected.dtype:
        return out.to(expected.dtype)
    return out


def _tensors_of(args, kwargs) -> list:
    return [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]


def _probed_dtype(op, args, kwargs):
    """The dtype eager's own kernel gives `op` on one-element CPU tensors of the arguments'
    dtypes and ranks, or None. For pointwise ops whose inputs differ in dtype: some of their
    fake kernels do not promote as the eager kernel does (threshold_backward of an int64
    gradient and a float32 input: eager float32, fake int64; mish_backward likewise)."""
    tensors = _tensors_of(args, kwargs)
    if len({t.dtype for t in tensors}) < 2:
        return None
    plain = (bool, int, float, type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format)
    if not all(isinstance(a, (torch.Tensor, *plain)) for a in [*args, *kwargs.values()]):
        return None  # a symbolic scalar or a list: not probed

    def small(a):
        return torch.ones([1] * a.dim(), dtype=a.dtype) if isinstance(a, torch.Tensor) else a

    try:
        with torch.utils._python_dispatch._disable_current_modes():
            out = op(*[small(a) for a in args], **{k: small(v) for k, v in kwargs.items()})
    except Exception:
        return None
    return out.dtype if isinstance(out, torch.Tensor) else None


def _elementwise(op, args, kwargs, expected) -> bool:
    """Pointwise by tag, or shaped like it: every tensor argument and the result alike."""
    if torch.Tag.pointwise in getattr(op, "tags", ()):
        return True
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    tensors = _tensors_of(args, kwargs)
    return (isinstance(expected, torch.Tensor) and bool(tensors)
            and all(t.dim() == expected.dim() and all(statically_known_true(a == b) for a, b in zip(t.shape, expected.shape))
                    for t in tensors))


def expected_results(op, args, kwargs):
    """`op`'s own results on the (fake) arguments a decomposition is traced with: metadata
    only, recorded in no graph, with eager's dtype where the fake kernel's differs (see
    _probed_dtype). None where `op` has no fake kernel."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    try:
        with disable_proxy_modes_tracing():
            expected = op(*args, **kwargs)
            if isinstance(expected, torch.Tensor) and _elementwise(op, args, kwargs, expected):
                dtype = _probed_dtype(op, args, kwargs)
                if dtype is not None and dtype != expected.dtype:
                    expected = expected.to(dtype)  # a fake tensor: metadata only
    except Exception:
        return None
    return expected


def keep_dtypes(op, decomposition):
    """`decomposition` returning the dtypes `op` itself returns. torch._decomp's entries for
    pointwise backward ops take the gradient's dtype (threshold_backward of an int64 gradient
    and a float32 input gives int64), where eager promotes both inputs (float32)."""

    def run(*args, **kwargs):
        out = decomposition(*args, **kwargs)
        if out is NotImplemented or len({t.dtype for t in _tensors_of(args, kwargs)}) < 2:
            return out  # one input dtype: nothing to promote (and no fake kernel run, no guard added)
        expected = expected_results(op, args, kwargs)
        return out if expected is None else cast_to(out, expected)

    return run


# core ATen's entry for CPU flash attention saves the probabilities where its backward
# expects the log-sum-exp, so training through it fails; this one saves the log-sum-exp.
# torch-mlir's _scaled_mm takes only dims that are multiples of 16; the product of the float32
# values takes any.
# Ops torch-mlir 20261001 knows but never lowers: their FALLBACK entry applies from the first
# compile rather than after one fails (two iree-compile runs per graph and shape).
UNLOWERED = frozenset({
    aten.squeeze.dims,  # nll_loss's decomposition; a logsumexp's where its composite is off
    aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default,
    aten.max_pool3d_with_indices_backward.default,
    aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default,
    aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default,
    aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default,
    aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default, aten.masked_scatter_backward.default, *bags.TABLE,
    *distances.TABLE, *gammas.TABLE,
    aten.diagonal_scatter.default,  # lowered, but iree-compile rejects what it gives
    aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar,
})

def _dist(input, other, p=2):
    """torch.dist as the norm of the difference (torch._decomp's form), which AOTAutograd then
    decomposes as it does every norm. torch-mlir's own lowering of dist gave inf for p = 0,
    1.0 for p = inf where eager gives 3.0, and 1.0 for p = -inf (eager 0.0)."""
    return aten.norm.Scalar(aten.sub.Tensor(input, other), p)


def _torchs(op):
    """torch._decomp's decomposition of `op`, which boo's entry below wraps."""
    from torch._decomp import decomposition_table

    return decomposition_table[op]


def _from_the_start(op):
    """torch._decomp's `op` (index_add, index_copy) refusing a negative index as eager does.
    Their decompositions become an index_put, which counts an index from the end, so
    `x.index_add(0, tensor([-1]), s)` added into x's last row where eager raises IndexError.
    The assert becomes the part's index check (checks.py)."""
    theirs = _torchs(op)

    def run(x, dim, index, *args, **kwargs):
        aten._assert_async.msg(aten.all.default(aten.ge.Scalar(index, 0)), "index")
        return theirs(x, dim, index, *args, **kwargs)

    return run


def _counted_from_the_end(op):
    """torch._decomp's index_fill, which eager lets count an index from the end: its
    decomposition is an index_copy (_from_the_start), so the index is made non-negative first."""
    theirs = _torchs(op)

    def run(x, dim, index, *args, **kwargs):
        n = x.shape[dim] if x.dim() else 1
        return theirs(x, dim, aten.where.self(aten.lt.Scalar(index, 0), aten.add.Scalar(index, n), index),
                      *args, **kwargs)

    return run


def _leaky_relu(x, negative_slope=0.01):
    """x where x > 0, else x times the slope, as eager's kernel computes it. torch-mlir's
    lowering adds the two clamped halves, so a zero lost its sign (eager: leaky_relu(0.0, -0.5)
    is -0.0)."""
    return aten.where.self(aten.gt.Scalar(x, 0), x, aten.mul.Scalar(x, negative_slope))


def _addcmul(self, tensor1, tensor2, *, value=1):
    """torch._decomp's addcmul with `value` first converted to the result's type, as eager's
    kernel does: for integers, value=0.5 is 0 and 2.7 is 2 (the decomposition refused a float
    value for integer tensors, and its in-place form added 0.5 * t1 * t2 and truncated)."""
    dtype = functools.reduce(torch.promote_types, (self.dtype, tensor1.dtype, tensor2.dtype))
    if isinstance(value, float) and _integral(dtype):
        value = int(value)
    return _torchs(aten.addcmul.default)(self, tensor1, tensor2, value=value)


def _bitwise_with_a_number(op):
    """bitwise_or/xor of a tensor and a number as of two tensors (the number's a 0-d one of
    the tensor's dtype): torch-mlir lowers only the Tensor forms, and torch._decomp's entry
    brings in prims, so `ids | 1` ran as an eager island."""
    def run(x, other):
        return op(x, aten.scalar_tensor.default(other, dtype=x.dtype, device=x.device))

    return run


def _refusing(op):
    """torch._decomp's `op`, raising eager's error when the graph runs where eager refuses
    the call (refusals.refusal): AOTAutograd decomposes it before boo's own refusals see it."""
    theirs = _torchs(op)

    def run(*args, **kwargs):
        message = refusal(op, args, kwargs)
        if message is not None:
            raise_when_run(message)
        return theirs(*args, **kwargs)

    return run


AOT = {
    aten.nll_loss_forward.default: _refusing(aten.nll_loss_forward.default),
    aten.nll_loss2d_forward.default: _refusing(aten.nll_loss2d_forward.default),
    aten.addcmul.default: _addcmul,
    aten.leaky_relu.default: _leaky_relu,
    aten.index_fill.int_Scalar: _counted_from_the_end(aten.index_fill.int_Scalar),
    aten.index_fill.int_Tensor: _counted_from_the_end(aten.index_fill.int_Tensor),
    aten.index_add.default: _from_the_start(aten.index_add.default),
    aten.index_copy.default: _from_the_start(aten.index_copy.default),
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_cpu,
    aten._scaled_mm.default: _scaled_mm,
    aten.dist.default: _dist,
    **fastpaths.AOT,
}

FALLBACK = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_cpu,
    aten.squeeze.dims: _squeeze_dims,
    aten.empty_permuted.default: _empty_permuted,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_attention_cpu_backward,
    aten.as_strided_scatter.default: _as_strided_scatter,
    aten.diagonal_scatter.default: _diagonal_scatter,
    aten.masked_scatter_backward.default: _masked_scatter_backward,
    **bags.TABLE,
    **distances.TABLE,
    **gammas.TABLE,
    aten.bitwise_or.Scalar: _bitwise_with_a_number(aten.bitwise_or.Tensor),
    aten.bitwise_xor.Scalar: _bitwise_with_a_number(aten.bitwise_xor.Tensor),
    aten.avg_pool2d_backward.default: functools.partial(avg_pool_backward, 2),
    aten.avg_pool3d_backward.default: functools.partial(avg_pool_backward, 3),
    aten.max_pool3d_with_indices_backward.default: max_pool3d_with_indices_backward,
    aten._adaptive_avg_pool2d_backward.default: functools.partial(adaptive_avg_pool_backward, 2),
    aten._adaptive_avg_pool3d_backward.default: functools.partial(adaptive_avg_pool_backward, 3),
    aten.adaptive_max_pool2d_backward.default: functools.partial(max_pool_backward_at_indices, 2),
    aten.adaptive_max_pool2d.default: functools.partial(adaptive_max_pool, 2),
    **{getattr(aten, f"replication_pad{nd}d_backward").default: functools.partial(replication_pad_backward, nd)
       for nd in (1, 2, 3)},
    aten.adaptive_max_pool3d.default: functools.partial(adaptive_max_pool, 3),
    aten.adaptive_max_pool3d_backward.default: functools.partial(max_pool_backward_at_indices, 3),
    aten._weight_norm_interface_backward.default: _weight_norm_interface_backward,
    aten.convolution_backward.default: _transposed_convolution_backward,
    aten.convolution.default: _depthwise_convolution,
    aten.constant_pad_nd.default: _constant_pad_by_gather,
    **PRIMS,
}
