{#- _softmax_backward_data / _log_softmax_backward_data on grad and output [M, N, K] over N;
    included by the two op templates, which set `log`. Params: M, N, K, log, dtype (grad's and
    output's), out_dtype (input_dtype's).
      softmax:      dx = y * (g - sum_n(g * y))
      log_softmax:  dx = g - exp(y) * sum_n(g)
    One reduction and one elementwise pass, in one dispatch, in f32. -#}
{% import "_helpers.mlir" as h with context %}
{% import "_softmax_layout.mlir" as L with context %}
{% set SHAPE, X, Y, ROW, XMAP, RMAP, RED, PAR = L.SHAPE, L.X, L.Y, L.ROW, L.XMAP, L.RMAP, L.RED, L.PAR %}
{% set SIZES, ROW_SHAPE, ROW_SIZES = L.SIZES, L.ROW_SHAPE, L.ROW_SIZES %}
func.func private @{{ func_name }}(%g: {{ X }}, %y: {{ X }}) -> {{ Y }} {{ h.identity({"dim_size": N, "log": log, "out_dtype": out_dtype}) }} {
{{ L.sizes("%g") }}
{% if 0 in [M, N, K] %}
  %out = {{ h.empty(SHAPE, out_dtype, SIZES) }}
  return %out : {{ Y }}
{% else %}
  {% call h.dispatch_region("smb", ["%out"], [Y], L.DIMS) %}
  %zero = arith.constant 0.0 : f32
  %row_empty = {{ h.empty(ROW_SHAPE, "f32", ROW_SIZES) }}
  %row_zero = linalg.fill ins(%zero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  %sum = linalg.generic {indexing_maps = [{{ XMAP }}, {{ XMAP }}, {{ RMAP }}], iterator_types = {{ RED }}}
      ins(%g, %y : {{ X }}, {{ X }}) outs(%row_zero : {{ ROW }}) {
  ^bb0(%gin: {{ dtype }}, %yin: {{ dtype }}, %s: f32):
    {{ h.to_f32("gf", "gin", dtype) }}
{% if log %}
    %s1 = arith.addf %s, {{ h.f32ref("gf", "gin", dtype) }} : f32
{% else %}
    {{ h.to_f32("yf", "yin", dtype) }}
    %p = arith.mulf {{ h.f32ref("gf", "gin", dtype) }}, {{ h.f32ref("yf", "yin", dtype) }} : f32
    %s1 = arith.addf %s, %p : f32
{% endif %}
    linalg.yield %s1 : f32
  } -> {{ ROW }}
  %out_empty = {{ h.empty(SHAPE, out_dtype, SIZES) }}
  %out = linalg.generic {indexing_maps = [{{ XMAP }}, {{ XMAP }}, {{ RMAP }}, {{ XMAP }}], iterator_types = {{ PAR }}}
      ins(%g, %y, %sum : {{ X }}, {{ X }}, {{ ROW }}) outs(%out_empty : {{ Y }}) {
  ^bb0(%gin: {{ dtype }}, %yin: {{ dtype }}, %s: f32, %unused: {{ out_dtype }}):
    {{ h.to_f32("gf", "gin", dtype) }}
    {{ h.to_f32("yf", "yin", dtype) }}
{% if log %}
    %e = math.exp {{ h.f32ref("yf", "yin", dtype) }} : f32
    %es = arith.mulf %e, %s : f32
    %dx = arith.subf {{ h.f32ref("gf", "gin", dtype) }}, %es : f32
{% else %}
    %d = arith.subf {{ h.f32ref("gf", "gin", dtype) }}, %s : f32
    %dx = arith.mulf {{ h.f32ref("yf", "yin", dtype) }}, %d : f32
{% endif %}
    {{ h.from_f32("dxn", "dx", out_dtype) }}
    linalg.yield {{ h.narrowref("dxn", "dx", out_dtype) }} : {{ out_dtype }}
  } -> {{ Y }}
  {% endcall %}

  return %smb#0 : {{ Y }}
{% endif %}
}
