{#- The layout the softmax kernels share, for [M, N, K] reduced over N: import with
      {% import "_softmax_layout.mlir" as L with context %}
    Loops run (M, K, N), the reduction innermost. M, N and K may be dynamic (None): sizes()
    reads them from the input as %dim_m, %dim_n, %dim_k, which SIZES (X's, Y's) and ROW_SIZES name. -#}
{% import "_helpers.mlir" as h with context %}
{#- K == 1 (a reduction over the last dim) is written in 2-D: IREE vectorizes the innermost
    dim, which must not be a unit one. -#}
{% set SHAPE = [M, N] if K == 1 else [M, N, K] %}
{% set X = h.tensor(SHAPE, dtype) %}
{% set Y = h.tensor(SHAPE, out_dtype) %}
{% set ROW_SHAPE = [M] if K == 1 else [M, K] %}
{% set ROW = h.tensor(ROW_SHAPE, "f32") %}
{% set XMAP = h.map(2) if K == 1 else h.map(3, [0, 2, 1]) %}
{% set RMAP = h.map(2, [0]) if K == 1 else h.map(3, [0, 1]) %}
{% set RED = '["parallel", "reduction"]' if K == 1 else '["parallel", "parallel", "reduction"]' %}
{% set PAR = '["parallel", "parallel"]' if K == 1 else '["parallel", "parallel", "parallel"]' %}
{% set SIZES = ["%dim_m", "%dim_n"] if K == 1 else ["%dim_m", "%dim_n", "%dim_k"] %}
{% set ROW_SIZES = ["%dim_m"] if K == 1 else ["%dim_m", "%dim_k"] %}
{#- The dynamic dims of the result (Y), in order, for a dispatch region returning it. -#}
{% set DIMS = [] %}
{% for d in SHAPE %}{% if d is none %}{% set _ = DIMS.append(SIZES[loop.index0]) %}{% endif %}{% endfor %}

{#- %dim_m, %dim_n, %dim_k (those dynamic) from `value`, an X. -#}
{% macro sizes(value) -%}
{% for d in SHAPE %}
{% if d is none %}
  {{ h.dim(SIZES[loop.index0][1:], value, loop.index0, X) }}
{% endif %}
{% endfor %}
{%- endmacro %}

{#- The bodies of the two reductions: the row maximum, and the sum of exponentials past it. -#}
{% macro max_body() -%}
  ^bb0(%xin: {{ dtype }}, %m: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    %m1 = arith.maximumf %m, {{ h.f32ref("xf", "xin", dtype) }} : f32
    linalg.yield %m1 : f32
{%- endmacro %}
{% macro sum_body() -%}
  ^bb0(%xin: {{ dtype }}, %m: f32, %s: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    %d = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %m : f32
    %e = math.exp %d : f32
    %s1 = arith.addf %s, %e : f32
    linalg.yield %s1 : f32
{%- endmacro %}
