{#- native_layer_norm on x[M, N] over N. Params: M (None when dynamic), N, eps, dtype,
    stat_dtype, has_weight, has_bias.
    Row statistics in two passes (mean, then deviations from it), then the output; f32
    throughout. On the CPU both passes reduce in lanes (h.lanes). -#}
{% import "_helpers.mlir" as h with context %}
{% set X = h.tensor([M, N], dtype) %}
{% set V = h.tensor([N], dtype) %}
{% set ROW = h.tensor([M], "f32") %}
{% set STAT = h.tensor([M, 1], stat_dtype) %}
{% set L = h.lanes(N)|int %}
{#- M's SSA value when it is dynamic, and the results' dynamic dims. -#}
{% set m = "%dim_m" %}
{% set dims = [] if M is not none else [m, m, m] %}
func.func private @{{ func_name }}(%x: {{ X }}{% if has_weight %}, %w: {{ V }}{% endif %}{% if has_bias %}, %b: {{ V }}{% endif %})
    -> ({{ X }}, {{ STAT }}, {{ STAT }}) {{ h.identity({"eps": eps, "normalized_size": N, "has_weight": has_weight, "has_bias": has_bias}) }} {
{% if M == 0 %}
  {#- An empty batch: IREE 3.13 crashes on reductions over zero rows, so say it directly. #}
  %out = tensor.empty() : {{ X }}
  %mean_out = tensor.empty() : {{ STAT }}
  %rstd_out = tensor.empty() : {{ STAT }}
{% else %}
{% if M is none %}
  {{ h.dim(m[1:], "%x", 0, X) }}
{% endif %}
  {% call h.dispatch_region("ln", ["%out", "%mean_out", "%rstd_out"], [X, STAT, STAT], dims) %}
  %zero = arith.constant 0.0 : f32
  %n = arith.constant {{ "%.1f"|format(N) }} : f32
  %eps = arith.constant {{ "%.17e"|format(eps) }} : f32
  %row_empty = {{ h.empty([M], "f32", [m]) }}
  {% call h.row_sums("sum", ["%x"], [dtype], [], 1, M, N, L, m) %}
  ^bb0(%xin: {{ dtype }}, %s: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    %s1 = arith.addf %s, {{ h.f32ref("xf", "xin", dtype) }} : f32
    linalg.yield %s1 : f32
  {% endcall %}
  %mean0 = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%sum#0 : {{ ROW }}) outs(%row_empty : {{ ROW }}) {
  ^bb0(%s: f32, %unused: f32):
    %m = arith.divf %s, %n : f32
    linalg.yield %m : f32
  } -> {{ ROW }}
  {#- Second pass around the first mean: the sum of deviations corrects the mean, the sum of
      their squares gives the variance; both stay small, so f32 keeps them accurate. #}
  {% call h.row_sums("dev", ["%x"], [dtype], ["%mean0"], 2, M, N, L, m) %}
  ^bb0(%xin: {{ dtype }}, %m0: f32, %s: f32, %ss: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    %d = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %m0 : f32
    %s1 = arith.addf %s, %d : f32
    %d2 = arith.mulf %d, %d : f32
    %ss1 = arith.addf %ss, %d2 : f32
    linalg.yield %s1, %ss1 : f32, f32
  {% endcall %}
  %stats:2 = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}],
                             iterator_types = ["parallel"]}
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
  %out_empty = {{ h.empty([M, N], dtype, [m]) }}
  %out = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2, [0]) }}, {{ h.map(2, [0]) }}{% if has_weight %}, {{ h.map(2, [1]) }}{% endif %}{% if has_bias %}, {{ h.map(2, [1]) }}{% endif %}, {{ h.map(2) }}],
                         iterator_types = ["parallel", "parallel"]}
      ins(%x, %stats#0, %stats#1{% if has_weight %}, %w{% endif %}{% if has_bias %}, %b{% endif %} : {{ X }}, {{ ROW }}, {{ ROW }}{% if has_weight %}, {{ V }}{% endif %}{% if has_bias %}, {{ V }}{% endif %})
      outs(%out_empty : {{ X }}) {
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
  } -> {{ X }}
  {{ h.row_stat("mean_out", "%stats#0", M, stat_dtype, m) }}
  {{ h.row_stat("rstd_out", "%stats#1", M, stat_dtype, m) }}
  {% endcall %}

  return %ln#0, %ln#1, %ln#2 : {{ X }}, {{ STAT }}, {{ STAT }}
{% endif %}
{% if M == 0 %}
  return %out, %mean_out, %rstd_out : {{ X }}, {{ STAT }}, {{ STAT }}
{% endif %}
}
