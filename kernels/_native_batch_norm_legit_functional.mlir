{#- _native_batch_norm_legit_functional (training) on x[N, C, HW], normalized per channel over
    (N, HW); cnt = N * HW. Params: N, C, HW, momentum, eps, dtype, has_weight, has_bias;
    N and HW may be dynamic (None).
    Statistics in two passes (mean, then deviations from it), each as per-(n, c) sums over HW
    followed by a sum over the batch; f32 throughout. Running statistics:
      new_mean = (1 - momentum) * running_mean + momentum * mean
      new_var  = (1 - momentum) * running_var  + momentum * var * cnt / (cnt - 1)  (unbiased) -#}
{% import "_helpers.mlir" as h with context %}
{% set X = h.tensor([N, C, HW], dtype) %}
{% set V = h.tensor([C], dtype) %}
{% set P = h.tensor([N, C], "f32") %}
{% set COL = h.tensor([C], "f32") %}
{% set RV = h.tensor([C], running_dtype) %}
{#- SSA names of the dynamic sizes, by position in [N, C, HW]. -#}
{% set sizes = ["%dim_n", "", "%dim_hw"] %}
func.func private @{{ func_name }}(%x: {{ X }}{% if has_weight %}, %w: {{ V }}{% endif %}{% if has_bias %}, %b: {{ V }}{% endif %}, %rm: {{ V }}, %rv: {{ V }})
    -> ({{ X }}, {{ V }}, {{ V }}, {{ RV }}, {{ RV }}) {{ h.identity({"eps": eps, "momentum": momentum, "has_weight": has_weight, "has_bias": has_bias}) }} {
  %zero = arith.constant 0.0 : f32
{% if N is none or HW is none %}
{% if N is none %}
  {{ h.dim("dim_n", "%x", 0, X) }}
{% endif %}
{% if HW is none %}
  {{ h.dim("dim_hw", "%x", 2, X) }}
{% endif %}
  {{ h.count("cnt", ["%dim_n" if N is none else N, "%dim_hw" if HW is none else HW]) }}
  %one = arith.constant 1.0 : f32
  %cnt1 = arith.subf %cnt, %one : f32
{% else %}
  %cnt = arith.constant {{ "%.1f"|format(N * HW) }} : f32
  %cnt1 = arith.constant {{ "%.1f"|format(N * HW - 1) }} : f32
{% endif %}
  %eps = arith.constant {{ "%.17e"|format(eps) }} : f32
  %mom = arith.constant {{ "%.17e"|format(momentum) }} : f32
  %keep = arith.constant {{ "%.17e"|format(1.0 - momentum) }} : f32
  %p_empty = {{ h.empty([N, C], "f32", sizes) }}
  %p_zero = linalg.fill ins(%zero : f32) outs(%p_empty : {{ P }}) -> {{ P }}
{% set p_zero2 = "%p_zero" %}
{% if N is none or HW is none %}
  {#- With dynamic sizes, two results of one reduction need inits of their own: IREE 3.13's GPU
    bufferization fails on a shared one (a -0.0 fill, which CSE keeps apart). #}
  %negzero = arith.constant -0.0 : f32
  %p_zero2 = linalg.fill ins(%negzero : f32) outs(%p_empty : {{ P }}) -> {{ P }}
{% set p_zero2 = "%p_zero2" %}
{% endif %}
  %col_empty = tensor.empty() : {{ COL }}
  %col_zero = linalg.fill ins(%zero : f32) outs(%col_empty : {{ COL }}) -> {{ COL }}
  %sum = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3, [0, 1]) }}], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%x : {{ X }}) outs(%p_zero : {{ P }}) {
  ^bb0(%xin: {{ dtype }}, %s: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    %s1 = arith.addf %s, {{ h.f32ref("xf", "xin", dtype) }} : f32
    linalg.yield %s1 : f32
  } -> {{ P }}
  %mean0 = linalg.generic {indexing_maps = [{{ h.map(2, [1, 0]) }}, {{ h.map(2, [0]) }}], iterator_types = ["parallel", "reduction"]}
      ins(%sum : {{ P }}) outs(%col_zero : {{ COL }}) {
  ^bb0(%s: f32, %acc: f32):
    %m = arith.divf %s, %cnt : f32
    %accn = arith.addf %acc, %m : f32
    linalg.yield %accn : f32
  } -> {{ COL }}
  {#- Second pass around the first mean: the sum of deviations corrects the mean, the sum of
      their squares gives the variance. #}
  %dev:2 = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3, [1]) }}, {{ h.map(3, [0, 1]) }}, {{ h.map(3, [0, 1]) }}],
                           iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%x, %mean0 : {{ X }}, {{ COL }}) outs(%p_zero, {{ p_zero2 }} : {{ P }}, {{ P }}) {
  ^bb0(%xin: {{ dtype }}, %m0: f32, %s: f32, %ss: f32):
    {{ h.to_f32("xf", "xin", dtype) }}
    %d = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %m0 : f32
    %s1 = arith.addf %s, %d : f32
    %d2 = arith.mulf %d, %d : f32
    %ss1 = arith.addf %ss, %d2 : f32
    linalg.yield %s1, %ss1 : f32, f32
  } -> ({{ P }}, {{ P }})
  %devc:2 = linalg.generic {indexing_maps = [{{ h.map(2, [1, 0]) }}, {{ h.map(2, [1, 0]) }}, {{ h.map(2, [0]) }}, {{ h.map(2, [0]) }}],
                            iterator_types = ["parallel", "reduction"]}
      ins(%dev#0, %dev#1 : {{ P }}, {{ P }}) outs(%col_zero, %col_zero : {{ COL }}, {{ COL }}) {
  ^bb0(%s: f32, %ss: f32, %acc: f32, %acc2: f32):
    %accn = arith.addf %acc, %s : f32
    %acc2n = arith.addf %acc2, %ss : f32
    linalg.yield %accn, %acc2n : f32, f32
  } -> ({{ COL }}, {{ COL }})
  %stats:4 = linalg.generic {indexing_maps = [{% for i in range(9) %}{{ h.map(1) }}{{ ", " if not loop.last }}{% endfor %}],
                             iterator_types = ["parallel"]}
      ins(%mean0, %devc#0, %devc#1, %rm, %rv : {{ COL }}, {{ COL }}, {{ COL }}, {{ V }}, {{ V }})
      outs(%col_empty, %col_empty, %col_empty, %col_empty : {{ COL }}, {{ COL }}, {{ COL }}, {{ COL }}) {
  ^bb0(%m0: f32, %s: f32, %ss: f32, %rmin: {{ dtype }}, %rvin: {{ dtype }}, %u0: f32, %u1: f32, %u2: f32, %u3: f32):
    %dm = arith.divf %s, %cnt : f32
    %mean = arith.addf %m0, %dm : f32
    %ex2 = arith.divf %ss, %cnt : f32
    %dm2 = arith.mulf %dm, %dm : f32
    %var0 = arith.subf %ex2, %dm2 : f32
    %var = arith.maximumf %var0, %zero : f32
    %vare = arith.addf %var, %eps : f32
    %rstd = math.rsqrt %vare : f32
    %ssc = arith.mulf %var, %cnt : f32
    %uvar = arith.divf %ssc, %cnt1 : f32
    {{ h.to_f32("rmf", "rmin", dtype) }}
    {{ h.to_f32("rvf", "rvin", dtype) }}
    %rm0 = arith.mulf {{ h.f32ref("rmf", "rmin", dtype) }}, %keep : f32
    %rm1 = arith.mulf %mean, %mom : f32
    %rmn = arith.addf %rm0, %rm1 : f32
    %rv0 = arith.mulf {{ h.f32ref("rvf", "rvin", dtype) }}, %keep : f32
    %rv1 = arith.mulf %uvar, %mom : f32
    %rvn = arith.addf %rv0, %rv1 : f32
    linalg.yield %mean, %rstd, %rmn, %rvn : f32, f32, f32, f32
  } -> ({{ COL }}, {{ COL }}, {{ COL }}, {{ COL }})
  %out_empty = {{ h.empty([N, C, HW], dtype, sizes) }}
  %out = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3, [1]) }}, {{ h.map(3, [1]) }}{% if has_weight %}, {{ h.map(3, [1]) }}{% endif %}{% if has_bias %}, {{ h.map(3, [1]) }}{% endif %}, {{ h.map(3) }}],
                         iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%x, %stats#0, %stats#1{% if has_weight %}, %w{% endif %}{% if has_bias %}, %b{% endif %} : {{ X }}, {{ COL }}, {{ COL }}{% if has_weight %}, {{ V }}{% endif %}{% if has_bias %}, {{ V }}{% endif %})
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
  %v_empty = tensor.empty() : {{ V }}
  %rv_empty = tensor.empty() : {{ RV }}
{% for i in range(4) %}
{% set T, dt, empty = (V, dtype, "%v_empty") if i < 2 else (RV, running_dtype, "%rv_empty") %}
  %o{{ i }} = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%stats#{{ i }} : {{ COL }}) outs({{ empty }} : {{ T }}) {
  ^bb0(%in: f32, %unused: {{ dt }}):
    {{ h.from_f32("n", "in", dt) }}
    linalg.yield {{ h.narrowref("n", "in", dt) }} : {{ dt }}
  } -> {{ T }}
{% endfor %}
  return %out, %o0, %o1, %o2, %o3 : {{ X }}, {{ V }}, {{ V }}, {{ RV }}, {{ RV }}
}
