{#- The layout the softmax kernels share, for [M, N, K] reduced over N: import with
      {% import "_softmax_layout.mlir" as L with context %}
    Loops run (M, K, N), the reduction innermost. -#}
{% import "_helpers.mlir" as h with context %}
{#- K == 1 (a reduction over the last dim) is written in 2-D: IREE vectorizes the innermost
    dim, which must not be a unit one. -#}
{% set SHAPE = [M, N] if K == 1 else [M, N, K] %}
{% set X = h.tensor(SHAPE, dtype) %}
{% set Y = h.tensor(SHAPE, out_dtype) %}
{% set ROW = h.tensor([M] if K == 1 else [M, K], "f32") %}
{% set XMAP = h.map(2) if K == 1 else h.map(3, [0, 2, 1]) %}
{% set RMAP = h.map(2, [0]) if K == 1 else h.map(3, [0, 1]) %}
{% set RED = '["parallel", "reduction"]' if K == 1 else '["parallel", "parallel", "reduction"]' %}
{% set PAR = '["parallel", "parallel"]' if K == 1 else '["parallel", "parallel", "parallel"]' %}
