{#- gelu(x, approximate) elementwise, any rank. Params: shape (None for a
    dynamic dim), dtype, approximate. -#}
{% import "_helpers.mlir" as h with context %}
{% set T = h.tensor(shape, dtype) %}
{% set rank = shape|length %}
{% set names = [] %}
{% for d in shape %}{% set _ = names.append("%d" ~ loop.index0) %}{% endfor %}
func.func private @{{ func_name }}(%x: {{ T }}) -> {{ T }} {{ h.identity({"approximate": approximate}) }} {
{% for i in range(rank) if shape[i] is none %}
  {{ h.dim("d" ~ i, "%x", i, T) }}
{% endfor %}
  %empty = {{ h.empty(shape, dtype, names) }}
  %y = linalg.generic {indexing_maps = [{{ h.map(rank) }}, {{ h.map(rank) }}], iterator_types = {{ h.iterators(["parallel"] * rank) }}}
      ins(%x : {{ T }}) outs(%empty : {{ T }}) {
  ^bb0(%xin: {{ dtype }}, %unused: {{ dtype }}):
    {{ h.to_f32("xf", "xin", dtype) }}
{% set xv = h.f32ref("xf", "xin", dtype) %}
    %half = arith.constant 0.5 : f32
    %one = arith.constant 1.0 : f32
    %hx = arith.mulf %half, {{ xv }} : f32
{% if approximate == "tanh" %}
    %beta = arith.constant 0.7978845608028654 : f32
    %kappa = arith.constant 0.044715 : f32
    %x2 = arith.mulf {{ xv }}, {{ xv }} : f32
    %x3 = arith.mulf %x2, {{ xv }} : f32
    %kx3 = arith.mulf %kappa, %x3 : f32
    %inner0 = arith.addf {{ xv }}, %kx3 : f32
    %inner = arith.mulf %beta, %inner0 : f32
    %t = math.tanh %inner : f32
    %onep = arith.addf %one, %t : f32
{% else %}
    %rsqrt2 = arith.constant 0.7071067811865476 : f32
    %scaled = arith.mulf {{ xv }}, %rsqrt2 : f32
    %e = math.erf %scaled : f32
    %onep = arith.addf %one, %e : f32
{% endif %}
    %yf = arith.mulf %hx, %onep : f32
    {{ h.from_f32("yn", "yf", dtype) }}
    linalg.yield {{ h.narrowref("yn", "yf", dtype) }} : {{ dtype }}
  } -> {{ T }}
  return %y : {{ T }}
}
