{#- gelu_backward(grad, x, approximate) elementwise, any rank. Params: shape (None for a
    dynamic dim), dtype, approximate. -#}
{% import "_helpers.mlir" as h with context %}
{% set T = h.tensor(shape, dtype) %}
{% set rank = shape|length %}
{% set names = [] %}
{% for d in shape %}{% set _ = names.append("%d" ~ loop.index0) %}{% endfor %}
func.func private @{{ func_name }}(%grad: {{ T }}, %x: {{ T }}) -> {{ T }} {{ h.identity({"approximate": approximate}) }} {
{% for i in range(rank) if shape[i] is none %}
  {{ h.dim("d" ~ i, "%grad", i, T) }}
{% endfor %}
  %empty = {{ h.empty(shape, dtype, names) }}
  %dx = linalg.generic {indexing_maps = [{{ h.map(rank) }}, {{ h.map(rank) }}, {{ h.map(rank) }}], iterator_types = {{ h.iterators(["parallel"] * rank) }}}
      ins(%grad, %x : {{ T }}, {{ T }}) outs(%empty : {{ T }}) {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %unused: {{ dtype }}):
    {{ h.to_f32("gf", "gin", dtype) }}
    {{ h.to_f32("xf", "xin", dtype) }}
{% set g = h.f32ref("gf", "gin", dtype) %}
{% set xv = h.f32ref("xf", "xin", dtype) %}
    %half = arith.constant 0.5 : f32
    %one = arith.constant 1.0 : f32
{% if approximate == "tanh" %}
    %beta = arith.constant 0.7978845608028654 : f32
    %kappa = arith.constant 0.044715 : f32
    %three_kappa = arith.constant 0.134145 : f32
    %x2 = arith.mulf {{ xv }}, {{ xv }} : f32
    %x3 = arith.mulf %x2, {{ xv }} : f32
    %kx3 = arith.mulf %kappa, %x3 : f32
    %inner0 = arith.addf {{ xv }}, %kx3 : f32
    %inner = arith.mulf %beta, %inner0 : f32
    %t = math.tanh %inner : f32
    %right = arith.addf %one, %t : f32
    %left = arith.mulf %half, {{ xv }} : f32
    %dleft = arith.mulf %half, %right : f32
    %t2 = arith.mulf %t, %t : f32
    %sech2 = arith.subf %one, %t2 : f32
    %k3x2 = arith.mulf %three_kappa, %x2 : f32
    %dinner0 = arith.addf %one, %k3x2 : f32
    %dinner = arith.mulf %beta, %dinner0 : f32
    %dright = arith.mulf %sech2, %dinner : f32
    %lr = arith.mulf %left, %dright : f32
    %deriv = arith.addf %dleft, %lr : f32
{% else %}
    %rsqrt2 = arith.constant 0.7071067811865476 : f32
    %rsqrt2pi = arith.constant 0.3989422804014327 : f32
    %mhalf = arith.constant -0.5 : f32
    %scaled = arith.mulf {{ xv }}, %rsqrt2 : f32
    %e = math.erf %scaled : f32
    %onep = arith.addf %one, %e : f32
    %cdf = arith.mulf %half, %onep : f32
    %x2 = arith.mulf {{ xv }}, {{ xv }} : f32
    %ex = arith.mulf %mhalf, %x2 : f32
    %ee = math.exp %ex : f32
    %pdf = arith.mulf %ee, %rsqrt2pi : f32
    %xpdf = arith.mulf {{ xv }}, %pdf : f32
    %deriv = arith.addf %cdf, %xpdf : f32
{% endif %}
    %dxf = arith.mulf {{ g }}, %deriv : f32
    {{ h.from_f32("dxn", "dxf", dtype) }}
    linalg.yield {{ h.narrowref("dxn", "dxf", dtype) }} : {{ dtype }}
  } -> {{ T }}
  return %dx : {{ T }}
}
