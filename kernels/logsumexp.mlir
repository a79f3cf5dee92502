{#- logsumexp(x, [1], keepdim=True) of x[M, N]: log(sum(exp(x - m))) + m, with m the row
    maximum taken as 0 where it is infinite (torch's own order, so that a row holding +inf
    gives +inf and a row of -inf gives -inf). Params: M, N, K (1), dtype, out_dtype (dtype).
    The two reductions run in one dispatch, in f32; on the CPU in lanes (h.lanes), as the
    softmax kernels' do. The cross-entropy rewrite (joint.py) saves this row statistic
    where the forward would otherwise write the log-probabilities. -#}
{% import "_helpers.mlir" as h with context %}
{% import "_softmax_layout.mlir" as L with context %}
{% set X, ROW, XMAP, RMAP, RED = L.X, L.ROW, L.XMAP, L.RMAP, L.RED %}
{% set Y = h.tensor([M, 1], out_dtype) %}
{% set lanes = h.lanes(N)|int %}
func.func private @{{ func_name }}(%x: {{ X }}) -> {{ Y }} {{ h.identity({"dim_size": N}) }} {
{{ L.sizes("%x") }}
  {% call h.dispatch_region("lse", ["%out"], [Y], ["%dim_m"] if M is none else []) %}
{% if lanes > 1 %}
  {% call h.row_sums("maxs", ["%x"], [dtype], [], 1, M, N, lanes, "%dim_m", "arith.maximumf", "0xFF800000") %}
{{ L.max_body() }}
  {% endcall %}
{% set max = "%maxs#0" %}
{% else %}
  %neg_inf = arith.constant 0xFF800000 : f32
  %row_empty = {{ h.empty([M], "f32", ["%dim_m"]) }}
  %row_low = linalg.fill ins(%neg_inf : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  %max = linalg.generic {indexing_maps = [{{ XMAP }}, {{ RMAP }}], iterator_types = {{ RED }}}
      ins(%x : {{ X }}) outs(%row_low : {{ ROW }}) {
{{ L.max_body() }}
  } -> {{ ROW }}
{% set max = "%max" %}
{% endif %}
  %finite_empty = {{ h.empty([M], "f32", ["%dim_m"]) }}
  %finite = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins({{ max }} : {{ ROW }}) outs(%finite_empty : {{ ROW }}) {
  ^bb0(%m: f32, %unused: f32):
    %inf = arith.constant 0x7F800000 : f32
    %zero = arith.constant 0.0 : f32
    %a = math.absf %m : f32
    %is_inf = arith.cmpf oeq, %a, %inf : f32
    %f = arith.select %is_inf, %zero, %m : f32
    linalg.yield %f : f32
  } -> {{ ROW }}
{% if lanes > 1 %}
  {% call h.row_sums("sums", ["%x"], [dtype], ["%finite"], 1, M, N, lanes, "%dim_m") %}
{{ L.sum_body() }}
  {% endcall %}
{% set sum = "%sums#0" %}
{% else %}
  %zero = arith.constant 0.0 : f32
  %row_zero = linalg.fill ins(%zero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  %sum = linalg.generic {indexing_maps = [{{ XMAP }}, {{ RMAP }}, {{ RMAP }}], iterator_types = {{ RED }}}
      ins(%x, %finite : {{ X }}, {{ ROW }}) outs(%row_zero : {{ ROW }}) {
{{ L.sum_body() }}
  } -> {{ ROW }}
{% set sum = "%sum" %}
{% endif %}
  %row_lse_empty = {{ h.empty([M], "f32", ["%dim_m"]) }}
  %row_lse = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins({{ sum }}, %finite : {{ ROW }}, {{ ROW }}) outs(%row_lse_empty : {{ ROW }}) {
  ^bb0(%s: f32, %m: f32, %unused: f32):
    %l = math.log %s : f32
    %v = arith.addf %l, %m : f32
    linalg.yield %v : f32
  } -> {{ ROW }}
  {{ h.row_stat("out", "%row_lse", M, out_dtype, "%dim_m") }}
  {% endcall %}

  return %lse#0 : {{ Y }}
}
