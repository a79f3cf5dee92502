{#- _softmax / _log_softmax on x[M, N, K] over N; included by _softmax.mlir and
    _log_softmax.mlir, which set `log`. Params: M, N, K, log, dtype, out_dtype (f32 for
    half_to_float). Loops run (M, K, N): the reduction innermost. Three passes over a row
    (maximum, sum of exponentials, output) in one dispatch, in f32; over the last dim on
    the CPU, the two reductions in lanes (h.lanes), softmax too. Elsewhere softmax is
    IREE's own linalg.softmax. -#}
{% import "_helpers.mlir" as h with context %}
{% import "_softmax_layout.mlir" as L with context %}
{% set SHAPE, X, Y, ROW, XMAP, RMAP, RED, PAR = L.SHAPE, L.X, L.Y, L.ROW, L.XMAP, L.RMAP, L.RED, L.PAR %}
{% set SIZES, ROW_SHAPE, ROW_SIZES = L.SIZES, L.ROW_SHAPE, L.ROW_SIZES %}
{#- A row over the last dim (K == 1, N static) reduces in lanes on the CPU (h.lanes). -#}
{% set lanes = h.lanes(N)|int if K == 1 else 1 %}
func.func private @{{ func_name }}(%x: {{ X }}) -> {{ Y }} {{ h.identity({"dim_size": N, "log": log, "out_dtype": out_dtype}) }} {
{{ L.sizes("%x") }}
{% if 0 in [M, N, K] %}
  {#- Nothing to compute; IREE 3.13 crashes on reductions over zero rows. -#}
  %out = {{ h.empty(SHAPE, out_dtype, SIZES) }}
  return %out : {{ Y }}
{% elif not log and lanes == 1 %}
  {#- IREE's own softmax op: it forms one dispatch and codegen knows it. #}
{% set XF = h.tensor(SHAPE, "f32") %}
{% if dtype != "f32" %}
  %xf_empty = {{ h.empty(SHAPE, "f32", SIZES) }}
  %xf = linalg.generic {indexing_maps = [{{ h.map(SHAPE|length) }}, {{ h.map(SHAPE|length) }}], iterator_types = {{ PAR }}}
      ins(%x : {{ X }}) outs(%xf_empty : {{ XF }}) {
  ^bb0(%xin: {{ dtype }}, %unused: f32):
    %w = arith.extf %xin : {{ dtype }} to f32
    linalg.yield %w : f32
  } -> {{ XF }}
{% endif %}
  %sm_empty = {{ h.empty(SHAPE, "f32", SIZES) }}
  %sm = linalg.softmax dimension(1) ins({{ "%xf" if dtype != "f32" else "%x" }} : {{ XF }}) outs(%sm_empty : {{ XF }}) -> {{ XF }}
{% if out_dtype != "f32" %}
  %out_empty = {{ h.empty(SHAPE, out_dtype, SIZES) }}
  %out = linalg.generic {indexing_maps = [{{ h.map(SHAPE|length) }}, {{ h.map(SHAPE|length) }}], iterator_types = {{ PAR }}}
      ins(%sm : {{ XF }}) outs(%out_empty : {{ Y }}) {
  ^bb0(%v: f32, %unused: {{ out_dtype }}):
    %n = arith.truncf %v : f32 to {{ out_dtype }}
    linalg.yield %n : {{ out_dtype }}
  } -> {{ Y }}
  return %out : {{ Y }}
{% else %}
  return %sm : {{ Y }}
{% endif %}
{% else %}
  {% call h.dispatch_region("sm", ["%out"], [Y], L.DIMS) %}
{% if lanes > 1 %}
  {% call h.row_sums("maxs", ["%x"], [dtype], [], 1, M, N, lanes, "%dim_m", "arith.maximumf", "0xFF800000") %}
{{ L.max_body() }}
  {% endcall %}
  {% call h.row_sums("sums", ["%x"], [dtype], ["%maxs#0"], 1, M, N, lanes, "%dim_m") %}
{{ L.sum_body() }}
  {% endcall %}
{% set max, sum = "%maxs#0", "%sums#0" %}
{% else %}
  %zero = arith.constant 0.0 : f32
  %neg_inf = arith.constant 0xFF800000 : f32
  %row_empty = {{ h.empty(ROW_SHAPE, "f32", ROW_SIZES) }}
  %row_zero = linalg.fill ins(%zero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  %row_low = linalg.fill ins(%neg_inf : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  %max = linalg.generic {indexing_maps = [{{ XMAP }}, {{ RMAP }}], iterator_types = {{ RED }}}
      ins(%x : {{ X }}) outs(%row_low : {{ ROW }}) {
{{ L.max_body() }}
  } -> {{ ROW }}
  %sum = linalg.generic {indexing_maps = [{{ XMAP }}, {{ RMAP }}, {{ RMAP }}], iterator_types = {{ RED }}}
      ins(%x, %max : {{ X }}, {{ ROW }}) outs(%row_zero : {{ ROW }}) {
{{ L.sum_body() }}
  } -> {{ ROW }}
{% set max, sum = "%max", "%sum" %}
{% endif %}
  %out_empty = {{ h.empty(SHAPE, out_dtype, SIZES) }}
  %out = linalg.generic {indexing_maps = [{{ XMAP }}, {{ RMAP }}, {{ RMAP }}, {{ XMAP }}], iterator_types = {{ PAR }}}
      ins(%x, {{ max }}, {{ sum }} : {{ X }}, {{ ROW }}, {{ ROW }}) outs(%out_empty : {{ Y }}) {
  ^bb0(%xin: {{ dtype }}, %m: f32, %s: f32, %unused: {{ out_dtype }}):
    {{ h.to_f32("xf", "xin", dtype) }}
    %d = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %m : f32
{% if log %}
    %ls = math.log %s : f32
    %y = arith.subf %d, %ls : f32
{% else %}
    %e = math.exp %d : f32
    %y = arith.divf %e, %s : f32
{% endif %}
    {{ h.from_f32("yn", "y", out_dtype) }}
    linalg.yield {{ h.narrowref("yn", "y", out_dtype) }} : {{ out_dtype }}
  } -> {{ Y }}
  {% endcall %}

  return %sm#0 : {{ Y }}
{% endif %}
}
