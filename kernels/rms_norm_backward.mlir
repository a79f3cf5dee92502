{#- boo::rms_norm_backward on x[M, N] over N. Params: M (None when dynamic), N, dtype (x's), g_dtype (grad's),
    w_dtype (None: no weight), norm_dtype (as in rms_norm), blocks.
      y = x * rstd,  gy = g * w,  dx = rstd * (gy - y * sum_j(gy * y) / N)
      dw = sum_i g * round(y)   (an empty tensor when there is no weight)
    The column sums are split into `blocks` row blocks summed in parallel, then added; with a
    dynamic M as in native_layer_norm_backward (blocks of M // blocks rows, and the rest). -#}
{% import "_helpers.mlir" as h with context %}
{% set X = h.tensor([M, N], dtype) %}
{% set G = h.tensor([M, N], g_dtype) %}
{% set ROW = h.tensor([M], "f32") %}
{% set STAT = h.tensor([M, 1], "f32") %}
{% set has_weight = w_dtype is not none %}
{#- Whether x * rstd is rounded (norm_dtype) before it meets g. -#}
{% set rounded = norm_dtype is not none and norm_dtype != "f32" %}
{% set W = h.tensor([N], w_dtype) if has_weight else h.tensor([0], dtype) %}
{#- M's SSA value when it is dynamic. -#}
{% set m = "%dim_m" %}
{#- The column partial sums' body: g * round(x * rstd) into %acc. #}
{% macro col_body() %}
    {{ h.to_f32("gf", "gin", g_dtype) }}
    {{ h.to_f32("xf", "xin", dtype) }}
{% if rounded %}
    %y0 = arith.mulf {{ h.f32ref("xf", "xin", dtype) }}, %r : f32
    %yr = arith.truncf %y0 : f32 to {{ norm_dtype }}
    %y1 = arith.extf %yr : {{ norm_dtype }} to f32
    %gyn = arith.mulf {{ h.f32ref("gf", "gin", g_dtype) }}, %y1 : f32
{% else %}
    {#- (g * x) * rstd, not g * (x * rstd) (one rounding apart): IREE 3.13 lowers the
        latter's vector contraction to scalar code, 4x slower for a 512 x 512 batch. -#}
    %gx = arith.mulf {{ h.f32ref("gf", "gin", g_dtype) }}, {{ h.f32ref("xf", "xin", dtype) }} : f32
    %gyn = arith.mulf %gx, %r : f32
{% endif %}
    %accn = arith.addf %acc, %gyn : f32
    linalg.yield %accn : f32
{%- endmacro %}
func.func private @{{ func_name }}(%g: {{ G }}, %x: {{ X }}, %rstd2: {{ STAT }}{% if has_weight %}, %w: {{ W }}{% endif %})
    -> ({{ X }}, {{ W }}) {{ h.identity({"normalized_size": N, "has_weight": has_weight, "norm_dtype": norm_dtype or "none"}) }} {
  %zero = arith.constant 0.0 : f32
{% if not has_weight or M == 0 %}
  %dw_empty = tensor.empty() : {{ W }}
{% endif %}
{% if M == 0 %}
  {#- An empty batch: IREE 3.13 crashes on reductions over zero rows, so say it directly. #}
  %dx = tensor.empty() : {{ X }}
{% if has_weight %}
  %zero_w = arith.constant 0.0 : {{ w_dtype }}
  %dw = linalg.fill ins(%zero_w : {{ w_dtype }}) outs(%dw_empty : {{ W }}) -> {{ W }}
{% else %}
  %dw = tensor.empty() : {{ W }}
{% endif %}
{% else %}
  %n = arith.constant {{ "%.1f"|format(N) }} : f32
{% if M is none %}
  {{ h.dim(m[1:], "%x", 0, X) }}
{% endif %}
  %rstd = tensor.collapse_shape %rstd2 [[0, 1]] : {{ STAT }} into {{ ROW }}
  %row_empty = {{ h.empty([M], "f32", [m]) }}
  %row_zero = linalg.fill ins(%zero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  {% call h.dispatch_region("rmsb", ["%dx0"], [X], [] if M is not none else [m]) %}
  %dot = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}, {{ h.map(2, [0]) }}{% if has_weight %}, {{ h.map(2, [1]) }}{% endif %}, {{ h.map(2, [0]) }}],
                         iterator_types = ["parallel", "reduction"]}
      ins(%g, %x, %rstd{% if has_weight %}, %w{% endif %} : {{ G }}, {{ X }}, {{ ROW }}{% if has_weight %}, {{ W }}{% endif %})
      outs(%row_zero : {{ ROW }}) {
  ^bb0(%gin: {{ g_dtype }}, %xin: {{ dtype }}, %r: f32{% if has_weight %}, %win: {{ w_dtype }}{% endif %}, %s: f32):
    {{ h.to_f32("gf", "gin", g_dtype) }}
    {{ h.to_f32("xf", "xin", dtype) }}
    %y = arith.mulf {{ h.f32ref("xf", "xin", dtype) }}, %r : f32
{% if has_weight %}
    {{ h.to_f32("wf", "win", w_dtype) }}
    %gy = arith.mulf {{ h.f32ref("gf", "gin", g_dtype) }}, {{ h.f32ref("wf", "win", w_dtype) }} : f32
{% endif %}
    %p = arith.mulf {{ "%gy" if has_weight else h.f32ref("gf", "gin", g_dtype) }}, %y : f32
    %s1 = arith.addf %s, %p : f32
    linalg.yield %s1 : f32
  } -> {{ ROW }}
  %dx_empty = {{ h.empty([M, N], dtype, [m]) }}
  %dx0 = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}, {{ h.map(2, [0]) }}{% if has_weight %}, {{ h.map(2, [1]) }}{% endif %}, {{ h.map(2, [0]) }}, {{ h.map(2) }}],
                        iterator_types = ["parallel", "parallel"]}
      ins(%g, %x, %rstd{% if has_weight %}, %w{% endif %}, %dot : {{ G }}, {{ X }}, {{ ROW }}{% if has_weight %}, {{ W }}{% endif %}, {{ ROW }})
      outs(%dx_empty : {{ X }}) {
  ^bb0(%gin: {{ g_dtype }}, %xin: {{ dtype }}, %r: f32{% if has_weight %}, %win: {{ w_dtype }}{% endif %}, %s: f32, %unused: {{ dtype }}):
    {{ h.to_f32("gf", "gin", g_dtype) }}
    {{ h.to_f32("xf", "xin", dtype) }}
    %y = arith.mulf {{ h.f32ref("xf", "xin", dtype) }}, %r : f32
{% if has_weight %}
    {{ h.to_f32("wf", "win", w_dtype) }}
    %gy = arith.mulf {{ h.f32ref("gf", "gin", g_dtype) }}, {{ h.f32ref("wf", "win", w_dtype) }} : f32
{% endif %}
    %m = arith.divf %s, %n : f32
    %ym = arith.mulf %y, %m : f32
    %t = arith.subf {{ "%gy" if has_weight else h.f32ref("gf", "gin", g_dtype) }}, %ym : f32
    %dxf = arith.mulf %t, %r : f32
    {{ h.from_f32("dxn", "dxf", dtype) }}
    linalg.yield {{ h.narrowref("dxn", "dxf", dtype) }} : {{ dtype }}
  } -> {{ X }}
  {% endcall %}

{% if M is none %}
  {#- A barrier hides a dynamic size from IREE; the tie says it again. #}
  %dx_barrier = "util.optimization_barrier"(%rmsb#0) : ({{ X }}) -> {{ X }}
  %dx = "flow.tensor.tie_shape"(%dx_barrier, %dim_m) : ({{ X }}, index) -> {{ X }}
{% else %}
  %dx = "util.optimization_barrier"(%rmsb#0) : ({{ X }}) -> {{ X }}
{% endif %}
{% if has_weight %}
{% set R = M // blocks if M is not none else none %}
{% set G3 = h.tensor([blocks, R, N], g_dtype) %}
{% set X3 = h.tensor([blocks, R, N], dtype) %}
{% set BR = h.tensor([blocks, R], "f32") %}
{% set P = h.tensor([blocks, N], "f32") %}
{% set COL = h.tensor([N], "f32") %}
{% if M is none %}
  %g_barrier = "util.optimization_barrier"(%g) : ({{ G }}) -> {{ G }}
  %g_cols = "flow.tensor.tie_shape"(%g_barrier, %dim_m) : ({{ G }}, index) -> {{ G }}
  {#- The first blocks * (M // blocks) rows in blocks, the rest on their own. #}
  %blocks = arith.constant {{ blocks }} : index
  %dim_r = arith.divui %dim_m, %blocks : index
  %dim_main = arith.muli %dim_r, %blocks : index
  %dim_rest = arith.subi %dim_m, %dim_main : index
  %g_main = tensor.extract_slice %g_cols[0, 0] [%dim_main, {{ N }}] [1, 1] : {{ G }} to {{ G }}
  %x_main = tensor.extract_slice %x[0, 0] [%dim_main, {{ N }}] [1, 1] : {{ X }} to {{ X }}
  %rstd_main = tensor.extract_slice %rstd[0] [%dim_main] [1] : {{ ROW }} to {{ ROW }}
  %g_rest = tensor.extract_slice %g_cols[%dim_main, 0] [%dim_rest, {{ N }}] [1, 1] : {{ G }} to {{ G }}
  %x_rest = tensor.extract_slice %x[%dim_main, 0] [%dim_rest, {{ N }}] [1, 1] : {{ X }} to {{ X }}
  %rstd_rest = tensor.extract_slice %rstd[%dim_main] [%dim_rest] [1] : {{ ROW }} to {{ ROW }}
{% set sources = {"g": "%g_main", "x": "%x_main", "rstd": "%rstd_main"} %}
{% else %}
  %g_cols = "util.optimization_barrier"(%g) : ({{ G }}) -> {{ G }}
{% set sources = {"g": "%g_cols", "x": "%x", "rstd": "%rstd"} %}
{% endif %}
  %g3 = tensor.expand_shape {{ sources.g }} [[0, 1], [2]] output_shape {{ h.output_shape([blocks, R, N], ["", "%dim_r"]) }} : {{ G }} into {{ G3 }}
  %x3 = tensor.expand_shape {{ sources.x }} [[0, 1], [2]] output_shape {{ h.output_shape([blocks, R, N], ["", "%dim_r"]) }} : {{ X }} into {{ X3 }}
  %rstd3 = tensor.expand_shape {{ sources.rstd }} [[0, 1]] output_shape {{ h.output_shape([blocks, R], ["", "%dim_r"]) }} : {{ ROW }} into {{ BR }}
  %part_empty = tensor.empty() : {{ P }}
  %part_zero = linalg.fill ins(%zero : f32) outs(%part_empty : {{ P }}) -> {{ P }}
  {#- Loops (block, column, row), the reduction innermost; CPU tiles vectorize the columns. #}
  %part = linalg.generic {indexing_maps = [{{ h.map(3, [0, 2, 1]) }}, {{ h.map(3, [0, 2, 1]) }}, {{ h.map(3, [0, 2]) }}, {{ h.map(3, [0, 1]) }}],
                          iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%g3, %x3, %rstd3 : {{ G3 }}, {{ X3 }}, {{ BR }}) outs(%part_zero : {{ P }})
{#- With the rounding of norm_dtype between x * rstd and g, these tiles made the module
    1.7x slower on local-sync than IREE 3.13's own choice (a 512 x 512 bf16 batch: 366
    against 211 us); without it they are as fast (f32) or a little faster (bf16). -#}
{% if target == "llvm-cpu" and N % 128 == 0 and blocks % 8 == 0 and not rounded %}
      attrs = {compilation_info = {{ h.cpu_tiles([8, 128, 0], [1, 128, 0], [0, 0, 1]) }}}
{% endif %}
      {
  ^bb0(%gin: {{ g_dtype }}, %xin: {{ dtype }}, %r: f32, %acc: f32):
{{ col_body() }}
  } -> {{ P }}
  %colf_empty = tensor.empty() : {{ COL }}
  %col_zero = linalg.fill ins(%zero : f32) outs(%colf_empty : {{ COL }}) -> {{ COL }}
  %sum_w = linalg.generic {indexing_maps = [{{ h.map(2, [1, 0]) }}, {{ h.map(2, [0]) }}], iterator_types = ["parallel", "reduction"]}
      ins(%part : {{ P }}) outs(%col_zero : {{ COL }}) {
  ^bb0(%p: f32, %acc: f32):
    %accn = arith.addf %acc, %p : f32
    linalg.yield %accn : f32
  } -> {{ COL }}
  %col_empty = tensor.empty() : {{ W }}
{% if M is none %}
  {#- The rows left over, summed over rows (loops (column, row)). #}
  %rest = linalg.generic {indexing_maps = [{{ h.map(2, [1, 0]) }}, {{ h.map(2, [1, 0]) }}, {{ h.map(2, [1]) }}, {{ h.map(2, [0]) }}],
                          iterator_types = ["parallel", "reduction"]}
      ins(%g_rest, %x_rest, %rstd_rest : {{ G }}, {{ X }}, {{ ROW }}) outs(%col_zero : {{ COL }}) {
  ^bb0(%gin: {{ g_dtype }}, %xin: {{ dtype }}, %r: f32, %acc: f32):
{{ col_body() }}
  } -> {{ COL }}
  %dw = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%sum_w, %rest : {{ COL }}, {{ COL }}) outs(%col_empty : {{ W }}) {
  ^bb0(%sb: f32, %sr: f32, %unused: {{ w_dtype }}):
    %sf = arith.addf %sb, %sr : f32
{% else %}
  %dw = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%sum_w : {{ COL }}) outs(%col_empty : {{ W }}) {
  ^bb0(%sf: f32, %unused: {{ w_dtype }}):
{% endif %}
    {{ h.from_f32("sn", "sf", w_dtype) }}
    linalg.yield {{ h.narrowref("sn", "sf", w_dtype) }} : {{ w_dtype }}
  } -> {{ W }}
{% else %}
  %dw = tensor.empty() : {{ W }}
{% endif %}
{% endif %}
  return %dx, %dw : {{ X }}, {{ W }}
}
