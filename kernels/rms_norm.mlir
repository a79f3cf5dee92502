{#- boo::rms_norm on x[M, N] over N. Params: M (None when dynamic), N, eps, dtype, w_dtype (None: no weight),
    norm_dtype (None, or the dtype x * rstd is rounded to before the weight), out_dtype.
      rstd = rsqrt(sum(x^2) / N + eps);  out = round(x * rstd) * w, all in f32; the sum in lanes on
    the CPU (h.lanes). -#}
{% import "_helpers.mlir" as h with context %}
{% set X = h.tensor([M, N], dtype) %}
{% set Y = h.tensor([M, N], out_dtype) %}
{% set ROW = h.tensor([M], "f32") %}
{% set STAT = h.tensor([M, 1], "f32") %}
{% set has_weight = w_dtype is not none %}
{% set W = h.tensor([N], w_dtype) if has_weight else "" %}
{#- M's SSA value when it is dynamic. -#}
{% set m = "%dim_m" %}
func.func private @{{ func_name }}(%x: {{ X }}{% if has_weight %}, %w: {{ W }}{% endif %})
    -> ({{ Y }}, {{ STAT }}) {{ h.identity({"eps": eps, "normalized_size": N, "has_weight": has_weight, "norm_dtype": norm_dtype or "none"}) }} {
{% if M == 0 %}
  {#- An empty batch: IREE 3.13 crashes on reductions over zero rows, so say it directly. #}
  %out = tensor.empty() : {{ Y }}
  %rstd_out = tensor.empty() : {{ STAT }}
  return %out, %rstd_out : {{ Y }}, {{ STAT }}
{% else %}
{% if M is none %}
  {{ h.dim(m[1:], "%x", 0, X) }}
{% endif %}
  {% call h.dispatch_region("rms", ["%out", "%rstd_out"], [Y, STAT], [] if M is not none else [m, m]) %}
  %n = arith.constant {{ "%.1f"|format(N) }} : f32
  %eps = arith.constant {{ "%.17e"|format(eps) }} : f32
  %row_empty = {{ h.empty([M], "f32", [m]) }}
  {% call h.row_sums("ss", ["%x"], [dtype], [], 1, M, N, h.lanes(N)|int, m) %}
  ^bb0(%xin: {{ dtype }}, %s: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    {#- |x| * |x|, not x * x: IREE 3.13 turns a reduction of a value times itself into a
        vector contraction and lowers that to scalar code (3x slower here); the square is
        the same. -#}
    %xa = math.absf {{ h.f32ref("xf", "xin", dtype) }} : f32
    %x2 = arith.mulf %xa, %xa : f32
    %s1 = arith.addf %s, %x2 : f32
    linalg.yield %s1 : f32
  {% endcall %}
  %rstd = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%ss#0 : {{ ROW }}) outs(%row_empty : {{ ROW }}) {
  ^bb0(%s: f32, %unused: f32):
    %ms = arith.divf %s, %n : f32
    %mse = arith.addf %ms, %eps : f32
    %r = math.rsqrt %mse : f32
    linalg.yield %r : f32
  } -> {{ ROW }}
  %out_empty = {{ h.empty([M, N], out_dtype, [m]) }}
  %out = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2, [0]) }}{% if has_weight %}, {{ h.map(2, [1]) }}{% endif %}, {{ h.map(2) }}],
                         iterator_types = ["parallel", "parallel"]}
      ins(%x, %rstd{% if has_weight %}, %w{% endif %} : {{ X }}, {{ ROW }}{% if has_weight %}, {{ W }}{% endif %})
      outs(%out_empty : {{ Y }}) {
  ^bb0(%xin: {{ dtype }}, %r: f32{% if has_weight %}, %win: {{ w_dtype }}{% endif %}, %unused: {{ out_dtype }}):
    {{ h.to_f32("xf", "xin", dtype) }}
    %y0 = arith.mulf {{ h.f32ref("xf", "xin", dtype) }}, %r : f32
{% set y = "y0" %}
{% if norm_dtype is not none and norm_dtype != "f32" %}
    %yr = arith.truncf %y0 : f32 to {{ norm_dtype }}
    %y1 = arith.extf %yr : {{ norm_dtype }} to f32
{% set y = "y1" %}
{% endif %}
{% if has_weight %}
    {{ h.to_f32("wf", "win", w_dtype) }}
    %y2 = arith.mulf %{{ y }}, {{ h.f32ref("wf", "win", w_dtype) }} : f32
{% set y = "y2" %}
{% endif %}
    {{ h.from_f32("yn", y, out_dtype) }}
    linalg.yield {{ h.narrowref("yn", y, out_dtype) }} : {{ out_dtype }}
  } -> {{ Y }}
  %rstd_out = tensor.expand_shape %rstd [[0, 1]] output_shape {{ h.output_shape([M, 1], [m]) }} : {{ ROW }} into {{ STAT }}
  {% endcall %}

  return %rms#0, %rms#1 : {{ Y }}, {{ STAT }}
{% endif %}
}
