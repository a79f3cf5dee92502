{#- _native_batch_norm_legit_no_training (eval) on x[N, C, HW] with the running statistics:
      out = (x - running_mean) * rsqrt(running_var + eps) * w + b
    The saved mean and rstd are empty ([0]), as eager gives them.
    Params: N, C, HW, eps, dtype, has_weight, has_bias; N and HW may be dynamic (None). -#}
{% import "_helpers.mlir" as h with context %}
{% set X = h.tensor([N, C, HW], dtype) %}
{% set V = h.tensor([C], dtype) %}
{% set E = h.tensor([0], dtype) %}
{% set COL = h.tensor([C], "f32") %}
{#- SSA names of the dynamic sizes, by position in [N, C, HW]. -#}
{% set sizes = ["%dim_n", "", "%dim_hw"] %}
func.func private @{{ func_name }}(%x: {{ X }}{% if has_weight %}, %w: {{ V }}{% endif %}{% if has_bias %}, %b: {{ V }}{% endif %}, %rm: {{ V }}, %rv: {{ V }})
    -> ({{ X }}, {{ E }}, {{ E }}) {{ h.identity({"eps": eps, "has_weight": has_weight, "has_bias": has_bias}) }} {
  %saved_mean = tensor.empty() : {{ E }}
  %saved_rstd = tensor.empty() : {{ E }}
{% if N is none %}
  {{ h.dim("dim_n", "%x", 0, X) }}
{% endif %}
{% if HW is none %}
  {{ h.dim("dim_hw", "%x", 2, X) }}
{% endif %}
{% if N == 0 %}
  %out = {{ h.empty([N, C, HW], dtype, sizes) }}
{% else %}
  %eps = arith.constant {{ "%.17e"|format(eps) }} : f32
  %col_empty = tensor.empty() : {{ COL }}
  {#- Per channel: out = x * scale + shift, scale = rstd * w, shift = b - mean * scale. #}
  %ss:2 = linalg.generic {indexing_maps = [{% for i in range(4 + has_weight + has_bias) %}{{ h.map(1) }}{{ ", " if not loop.last }}{% endfor %}], iterator_types = ["parallel"]}
      ins(%rm, %rv{% if has_weight %}, %w{% endif %}{% if has_bias %}, %b{% endif %} : {{ V }}, {{ V }}{% if has_weight %}, {{ V }}{% endif %}{% if has_bias %}, {{ V }}{% endif %})
      outs(%col_empty, %col_empty : {{ COL }}, {{ COL }}) {
  ^bb0(%rmin: {{ dtype }}, %rvin: {{ dtype }}{% if has_weight %}, %win: {{ dtype }}{% endif %}{% if has_bias %}, %bin: {{ dtype }}{% endif %}, %u0: f32, %u1: f32):
    {{ h.to_f32("rmf", "rmin", dtype) }}
    {{ h.to_f32("rvf", "rvin", dtype) }}
    %vare = arith.addf {{ h.f32ref("rvf", "rvin", dtype) }}, %eps : f32
    %rstd = math.rsqrt %vare : f32
{% set scale = "%rstd" %}
{% if has_weight %}
    {{ h.to_f32("wf", "win", dtype) }}
    %scale = arith.mulf %rstd, {{ h.f32ref("wf", "win", dtype) }} : f32
{% set scale = "%scale" %}
{% endif %}
    %ms = arith.mulf {{ h.f32ref("rmf", "rmin", dtype) }}, {{ scale }} : f32
{% if has_bias %}
    {{ h.to_f32("bf", "bin", dtype) }}
    %shift = arith.subf {{ h.f32ref("bf", "bin", dtype) }}, %ms : f32
{% else %}
    %shift = arith.negf %ms : f32
{% endif %}
    linalg.yield {{ scale }}, %shift : f32, f32
  } -> ({{ COL }}, {{ COL }})
  %out_empty = {{ h.empty([N, C, HW], dtype, sizes) }}
  %out = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3, [1]) }}, {{ h.map(3, [1]) }}, {{ h.map(3) }}],
                         iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%x, %ss#0, %ss#1 : {{ X }}, {{ COL }}, {{ COL }}) outs(%out_empty : {{ X }}) {
  ^bb0(%xin: {{ dtype }}, %scale_c: f32, %shift_c: f32, %unused: {{ dtype }}):
    {{ h.to_f32("xf", "xin", dtype) }}
    %y0 = arith.mulf {{ h.f32ref("xf", "xin", dtype) }}, %scale_c : f32
    %y = arith.addf %y0, %shift_c : f32
    {{ h.from_f32("yn", "y", dtype) }}
    linalg.yield {{ h.narrowref("yn", "y", dtype) }} : {{ dtype }}
  } -> {{ X }}
{% endif %}
  return %out, %saved_mean, %saved_rstd : {{ X }}, {{ E }}, {{ E }}
}
