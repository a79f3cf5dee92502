{#- native_group_norm on x[N, C, HW], viewed as [N, G, D = C/G, HW], normalized over (D, HW).
    Params: N, C, HW, G, eps, dtype, stat_dtype, has_weight, has_bias. N and HW may be dynamic
    (None), read from x as %dim_n and %dim_hw.
    Group statistics in two passes (mean, then deviations from it), then the output with the
    per-channel weight and bias; f32 throughout. -#}
{% import "_helpers.mlir" as h with context %}
{#- %name : [N, G] of stat_dtype from the f32 `value`. -#}
{% macro stat_out(name, value, ROW, STAT, stat_dtype) -%}
%{{ name }}_empty = {{ h.empty([N, G], stat_dtype, sizes) }}
  %{{ name }} = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}], iterator_types = ["parallel", "parallel"]}
      ins({{ value }} : {{ ROW }}) outs(%{{ name }}_empty : {{ STAT }}) {
  ^bb0(%{{ name }}_in: f32, %{{ name }}_unused: {{ stat_dtype }}):
    {{ h.from_f32(name ~ "_n", name ~ "_in", stat_dtype) }}
    linalg.yield {{ h.narrowref(name ~ "_n", name ~ "_in", stat_dtype) }} : {{ stat_dtype }}
  } -> {{ STAT }}
{%- endmacro %}
{% set D = C // G %}
{% set X = h.tensor([N, C, HW], dtype) %}
{% set X4 = h.tensor([N, G, D, HW], dtype) %}
{% set V = h.tensor([C], dtype) %}
{% set V2 = h.tensor([G, D], dtype) %}
{% set ROW = h.tensor([N, G], "f32") %}
{% set STAT = h.tensor([N, G], stat_dtype) %}
{% set RED = '["parallel", "parallel", "reduction", "reduction"]' %}
{#- SSA names of the dynamic sizes, by position in [N, G, D, HW] (and its prefixes). -#}
{% set sizes = ["%dim_n", "", "", "%dim_hw"] %}
{% set X_SIZES = ["%dim_n", "", "%dim_hw"] %}
func.func private @{{ func_name }}(%x: {{ X }}{% if has_weight %}, %w: {{ V }}{% endif %}{% if has_bias %}, %b: {{ V }}{% endif %})
    -> ({{ X }}, {{ STAT }}, {{ STAT }}) {{ h.identity({"eps": eps, "groups": G, "has_weight": has_weight, "has_bias": has_bias}) }} {
{% if N is none %}
  {{ h.dim("dim_n", "%x", 0, X) }}
{% endif %}
{% if HW is none %}
  {{ h.dim("dim_hw", "%x", 2, X) }}
{% endif %}
{% if N == 0 %}
  {#- An empty batch: IREE 3.13 crashes on reductions over zero rows, so say it directly. #}
  %out = {{ h.empty([N, C, HW], dtype, X_SIZES) }}
  %mean_out = {{ h.empty([N, G], stat_dtype, sizes) }}
  %rstd_out = {{ h.empty([N, G], stat_dtype, sizes) }}
  return %out, %mean_out, %rstd_out : {{ X }}, {{ STAT }}, {{ STAT }}
{% else %}
  %x4 = tensor.expand_shape %x [[0], [1, 2], [3]] output_shape {{ h.output_shape([N, G, D, HW], sizes) }} : {{ X }} into {{ X4 }}
{% if has_weight %}
  %w2 = tensor.expand_shape %w [[0, 1]] output_shape [{{ G }}, {{ D }}] : {{ V }} into {{ V2 }}
{% endif %}
{% if has_bias %}
  %b2 = tensor.expand_shape %b [[0, 1]] output_shape [{{ G }}, {{ D }}] : {{ V }} into {{ V2 }}
{% endif %}
{% set dims = [] %}
{% for shape in [[N, G, D, HW], [N, G], [N, G]] %}{% for d in shape %}{% if d is none %}{% set _ = dims.append(sizes[loop.index0]) %}{% endif %}{% endfor %}{% endfor %}
  {% call h.dispatch_region("gn", ["%out", "%mean_out", "%rstd_out"], [X4, STAT, STAT], dims) %}
  %zero = arith.constant 0.0 : f32
  {{ h.count("n", [D, "%dim_hw" if HW is none else HW]) }}
  %eps = arith.constant {{ "%.17e"|format(eps) }} : f32
  %row_empty = {{ h.empty([N, G], "f32", sizes) }}
  %row_zero = linalg.fill ins(%zero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  %sum = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4, [0, 1]) }}], iterator_types = {{ RED }}}
      ins(%x4 : {{ X4 }}) outs(%row_zero : {{ ROW }}) {
  ^bb0(%xin: {{ dtype }}, %s: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    %s1 = arith.addf %s, {{ h.f32ref("xf", "xin", dtype) }} : f32
    linalg.yield %s1 : f32
  } -> {{ ROW }}
  %mean0 = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}], iterator_types = ["parallel", "parallel"]}
      ins(%sum : {{ ROW }}) outs(%row_empty : {{ ROW }}) {
  ^bb0(%s: f32, %unused: f32):
    %m = arith.divf %s, %n : f32
    linalg.yield %m : f32
  } -> {{ ROW }}
  {#- Second pass around the first mean: the sum of deviations corrects the mean, the sum of
      their squares gives the variance. #}
  %dev:2 = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4, [0, 1]) }}, {{ h.map(4, [0, 1]) }}, {{ h.map(4, [0, 1]) }}],
                           iterator_types = {{ RED }}}
      ins(%x4, %mean0 : {{ X4 }}, {{ ROW }}) outs(%row_zero, %row_zero : {{ ROW }}, {{ ROW }}) {
  ^bb0(%xin: {{ dtype }}, %m0: f32, %s: f32, %ss: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    %d = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %m0 : f32
    %s1 = arith.addf %s, %d : f32
    %d2 = arith.mulf %d, %d : f32
    %ss1 = arith.addf %ss, %d2 : f32
    linalg.yield %s1, %ss1 : f32, f32
  } -> ({{ ROW }}, {{ ROW }})
  %stats:2 = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}, {{ h.map(2) }}, {{ h.map(2) }}, {{ h.map(2) }}],
                             iterator_types = ["parallel", "parallel"]}
      ins(%mean0, %dev#0, %dev#1 : {{ ROW }}, {{ ROW }}, {{ ROW }}) outs(%row_empty, %row_empty : {{ ROW }}, {{ ROW }}) {
  ^bb0(%m0: f32, %s: f32, %ss: f32, %unused0: f32, %unused1: f32):
    %dm = arith.divf %s, %n : f32
    %mean = arith.addf %m0, %dm : f32
    %ex2 = arith.divf %ss, %n : f32
    %dm2 = arith.mulf %dm, %dm : f32
    %var0 = arith.subf %ex2, %dm2 : f32
    %var = arith.maximumf %var0, %zero : f32
    %vare = arith.addf %var, %eps : f32
    %rstd = math.rsqrt %vare : f32
    linalg.yield %mean, %rstd : f32, f32
  } -> ({{ ROW }}, {{ ROW }})
  %out_empty = {{ h.empty([N, G, D, HW], dtype, sizes) }}
  %out = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4, [0, 1]) }}, {{ h.map(4, [0, 1]) }}{% if has_weight %}, {{ h.map(4, [1, 2]) }}{% endif %}{% if has_bias %}, {{ h.map(4, [1, 2]) }}{% endif %}, {{ h.map(4) }}],
                         iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%x4, %stats#0, %stats#1{% if has_weight %}, %w2{% endif %}{% if has_bias %}, %b2{% endif %} : {{ X4 }}, {{ ROW }}, {{ ROW }}{% if has_weight %}, {{ V2 }}{% endif %}{% if has_bias %}, {{ V2 }}{% endif %})
      outs(%out_empty : {{ X4 }}) {
  ^bb0(%xin: {{ dtype }}, %mean: f32, %rstd: f32{% if has_weight %}, %win: {{ dtype }}{% endif %}{% if has_bias %}, %bin: {{ dtype }}{% endif %}, %unused: {{ dtype }}):
    {{ h.to_f32("xf", "xin", dtype) }}
    %c = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %mean : f32
    %y0 = arith.mulf %c, %rstd : f32
{% set y = "y0" %}
{% if has_weight %}
    {{ h.to_f32("wf", "win", dtype) }}
    %y1 = arith.mulf %y0, {{ h.f32ref("wf", "win", dtype) }} : f32
{% set y = "y1" %}
{% endif %}
{% if has_bias %}
    {{ h.to_f32("bf", "bin", dtype) }}
    %y2 = arith.addf %{{ y }}, {{ h.f32ref("bf", "bin", dtype) }} : f32
{% set y = "y2" %}
{% endif %}
    {{ h.from_f32("yn", y, dtype) }}
    linalg.yield {{ h.narrowref("yn", y, dtype) }} : {{ dtype }}
  } -> {{ X4 }}
  {{ stat_out("mean_out", "%stats#0", ROW, STAT, stat_dtype) }}
  {{ stat_out("rstd_out", "%stats#1", ROW, STAT, stat_dtype) }}
  {% endcall %}
  %out = tensor.collapse_shape %gn#0 [[0], [1, 2], [3]] : {{ X4 }} into {{ X }}
  return %out, %gn#1, %gn#2 : {{ X }}, {{ STAT }}, {{ STAT }}
{% endif %}
}
