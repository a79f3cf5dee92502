"""The fused inference kernels that torch.nn modules call on their fast path, written as the
ATen ops they fuse, so that AOTAutograd's trace takes them apart and IREE runs them.
`nn.TransformerEncoderLayer` in eval mode without gradients calls
`aten._transformer_encoder_layer_fwd`, which neither torch._decomp nor torch-mlir knows:
without this entry every such layer ran as an eager island. Imports nothing of boo's.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _masked_softmax(scores, mask, mask_type):
    """Softmax over the last dim of [batch, heads, queries, keys] scores, as the fast path's
    kernel takes its mask: any nonzero entry masks (a float mask is made boolean first, so
    a finite additive bias masks too), and a [batch, keys] padding mask (type 1) or a 2-d
    [queries, keys] one broadcasts. A row with every key masked gives NaN, as eager."""
    if mask is None:
        return scores.softmax(-1)
    masked = mask if mask.dtype == torch.bool else mask != 0
    if masked.dim() == 2:
        masked = masked[:, None, None, :] if mask_type == 1 else masked[None, None]
    return scores.masked_fill(masked, -math.inf).softmax(-1)


def _self_attention(x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type):
    batch, length, width = x.shape
    head = width // num_heads
    q, k, v = aten.linear(x, qkv_weight, qkv_bias).view(batch, length, 3, num_heads, head) \
        .permute(2, 0, 3, 1, 4).unbind(0)
    scores = (q / math.sqrt(head)) @ k.transpose(-2, -1)
    out = (_masked_softmax(scores, mask, mask_type) @ v).transpose(1, 2).reshape(batch, length, width)
    return aten.linear(out, proj_weight, proj_bias)


def _transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                   proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                                   norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                                   ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """One post- or pre-norm encoder layer: self-attention and a two-layer feed-forward
    (exact GELU or ReLU), each with its residual."""
    if src.numel() == 0:
        return src.clone()

    def norm(x, weight, bias):
        return aten.native_layer_norm(x, [embed_dim], weight, bias, eps)[0]

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = _self_attention(x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type) + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    hidden = aten.linear(norm(x, norm_weight_2, norm_bias_2) if norm_first else x, ffn_weight_1, ffn_bias_1)
    x = aten.linear(aten.gelu(hidden) if use_gelu else aten.relu(hidden), ffn_weight_2, ffn_bias_2) + x
    return x if norm_first else norm(x, norm_weight_2, norm_bias_2)


AOT = {aten._transformer_encoder_layer_fwd.default: _transformer_encoder_layer_fwd}
