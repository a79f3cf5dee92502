{#- native_layer_norm_backward on x[M, N] over N, computing only what output_mask asks:
      dx = rstd * (g*w - mean_j(g*w) - xhat * mean_j(g*w*xhat)),  xhat = (x - mean) * rstd
      dw = sum_i g * xhat,  db = sum_i g
    Params: M (None when dynamic), N, dtype, stat_dtype, has_weight, has_bias, output_mask,
    blocks, target.
    The column sums are split into `blocks` row blocks summed in parallel, then added. With a
    dynamic M the blocks take M // blocks rows each, and the rest (fewer than `blocks` rows)
    is summed on its own into the column sums' initial value.
    On the CPU, when dx and a column sum are both asked for (and N <= 4096), one dispatch
    reads each row of g and x once from memory: per row, its two sums, then (the row still
    in L1) dx and the block's column partial sums. Otherwise the row sums and dx are one
    dispatch and the column partials another. -#}
{% import "_helpers.mlir" as h with context %}
{% set X = h.tensor([M, N], dtype) %}
{% set V = h.tensor([N], dtype) %}
{% set ROW = h.tensor([M], "f32") %}
{% set STAT = h.tensor([M, 1], stat_dtype) %}
{% set R = M // blocks if M is not none else none %}
{#- M's SSA value when it is dynamic; the rows of a block and the rows left over. -#}
{% set m = "%dim_m" %}
{% set B3 = h.tensor([blocks, R, N], dtype) %}
{% set BR = h.tensor([blocks, R], "f32") %}
{% set P = h.tensor([blocks, N], "f32") %}
{% set COL = h.tensor([N], "f32") %}
{% set results = [] %}
{% if output_mask[0] %}{% set _ = results.append(("dx", X)) %}{% endif %}
{% if output_mask[1] %}{% set _ = results.append(("dw", V)) %}{% endif %}
{% if output_mask[2] %}{% set _ = results.append(("db", V)) %}{% endif %}
{% set cols = [] %}
{% if output_mask[1] %}{% set _ = cols.append("w") %}{% endif %}
{% if output_mask[2] %}{% set _ = cols.append("b") %}{% endif %}
{#- Past N = 4096, IREE 3.13 writes one accumulator's initial value as one vector of N
    elements, longer than it allows; such rows take the two-dispatch path. -#}
{% set one_pass = output_mask[0] and cols and target == "llvm-cpu" and N <= 4096 and M is not none %}
{% set gw = "gw" if has_weight else h.f32ref("gf", "gin", dtype)[1:] %}
{#- Body pieces shared by the ops below: f32 g and x, xhat, g*w; then the row sums; then dx
    from the row sums %s1, %s2. -#}
{% macro xhat_gw() -%}
    {{ h.to_f32("gf", "gin", dtype) }}
    {{ h.to_f32("xf", "xin", dtype) }}
    %c = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %mu : f32
    %xhat = arith.mulf %c, %rs : f32
{% if has_weight %}
    {{ h.to_f32("wf", "win", dtype) }}
    %gw = arith.mulf {{ h.f32ref("gf", "gin", dtype) }}, {{ h.f32ref("wf", "win", dtype) }} : f32
{% endif %}
{%- endmacro %}
{% macro row_sums_body() -%}
{{ xhat_gw() }}
    %s1n = arith.addf %s1, %{{ gw }} : f32
    %p = arith.mulf %{{ gw }}, %xhat : f32
    %s2n = arith.addf %s2, %p : f32
    linalg.yield %s1n, %s2n : f32, f32
{%- endmacro %}
{#- The column partial sums' body: g * xhat into %pw, g into %pb. #}
{% macro col_body() %}
    {{ h.to_f32("gf", "gin", dtype) }}
{% if "w" in cols %}
    {{ h.to_f32("xf", "xin", dtype) }}
    %c = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %mu : f32
    %xhat = arith.mulf %c, %rs : f32
    %gx = arith.mulf {{ h.f32ref("gf", "gin", dtype) }}, %xhat : f32
    %pwn = arith.addf %pw, %gx : f32
{% endif %}
{% if "b" in cols %}
    %pbn = arith.addf %pb, {{ h.f32ref("gf", "gin", dtype) }} : f32
{% endif %}
    linalg.yield {% for c in cols %}%p{{ c }}n{{ ", " if not loop.last }}{% endfor %} : {% for c in cols %}f32{{ ", " if not loop.last }}{% endfor %}{{ "" }}
{%- endmacro %}
{% macro dx_body() -%}
{{ xhat_gw() }}
    %m1 = arith.divf %s1, %n : f32
    %m2 = arith.divf %s2, %n : f32
    %t0 = arith.subf %{{ gw }}, %m1 : f32
    %t1 = arith.mulf %xhat, %m2 : f32
    %t2 = arith.subf %t0, %t1 : f32
    %dxf = arith.mulf %t2, %rs : f32
    {{ h.from_f32("dxn", "dxf", dtype) }}
{%- endmacro %}
func.func private @{{ func_name }}(%g: {{ X }}, %x: {{ X }}, %mean: {{ STAT }}, %rstd: {{ STAT }}{% if has_weight %}, %w: {{ V }}{% endif %})
    -> ({% for name, type in results %}{{ type }}{{ ", " if not loop.last }}{% endfor %}) {{ h.identity({"output_mask": output_mask, "normalized_size": N, "has_weight": has_weight, "has_bias": has_bias}) }} {
  %zero = arith.constant 0.0 : f32
{% if M == 0 %}
  {#- An empty batch: IREE 3.13 crashes on reductions over zero rows, so say it directly. #}
  %dx = tensor.empty() : {{ X }}
  %zero_t = arith.constant 0.0 : {{ dtype }}
  %col_empty = tensor.empty() : {{ V }}
  %dw = linalg.fill ins(%zero_t : {{ dtype }}) outs(%col_empty : {{ V }}) -> {{ V }}
  %db = linalg.fill ins(%zero_t : {{ dtype }}) outs(%col_empty : {{ V }}) -> {{ V }}
{% else %}
  %n = arith.constant {{ "%.1f"|format(N) }} : f32
{% if M is none %}
  {{ h.dim(m[1:], "%x", 0, X) }}
{% endif %}
  {{ h.row_f32("mean_f", "%mean", M, stat_dtype, m) }}
  {{ h.row_f32("rstd_f", "%rstd", M, stat_dtype, m) }}
{% if one_pass %}
  {# One dispatch over [blocks, R, N], one block per workgroup. %sums (the row sums) is
      fused into the loop over the block's rows of %parts (dx and the column partials): the
      CPU tiles below make that loop the outer one, tile dx's columns inside it (not around
      it, which would recompute the row sums for every column tile), and tile the row sums
      along the row so they accumulate in vector registers. #}
{% set vec = 16 %}
{% set row_vec = 64 %}
  %negzero = arith.constant -0.0 : f32
  %g3 = tensor.expand_shape %g [[0, 1], [2]] output_shape [{{ blocks }}, {{ R }}, {{ N }}] : {{ X }} into {{ B3 }}
  %x3 = tensor.expand_shape %x [[0, 1], [2]] output_shape [{{ blocks }}, {{ R }}, {{ N }}] : {{ X }} into {{ B3 }}
  %mean2 = tensor.expand_shape %mean_f [[0, 1]] output_shape [{{ blocks }}, {{ R }}] : {{ ROW }} into {{ BR }}
  %rstd2 = tensor.expand_shape %rstd_f [[0, 1]] output_shape [{{ blocks }}, {{ R }}] : {{ ROW }} into {{ BR }}
{% set region_values = ["%parts#0"] %}{% set region_types = [B3] %}
{% for c in cols %}{% set _ = region_values.append("%parts#" ~ loop.index) %}{% set _ = region_types.append(P) %}{% endfor %}
  {% call h.dispatch_region("one", region_values, region_types) %}
  %br_empty = tensor.empty() : {{ BR }}
  %br_zero = linalg.fill ins(%zero : f32) outs(%br_empty : {{ BR }}) -> {{ BR }}
  %sums:2 = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3) }}, {{ h.map(3, [0, 1]) }}, {{ h.map(3, [0, 1]) }}{% if has_weight %}, {{ h.map(3, [2]) }}{% endif %}, {{ h.map(3, [0, 1]) }}, {{ h.map(3, [0, 1]) }}],
                            iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%g3, %x3, %mean2, %rstd2{% if has_weight %}, %w{% endif %} : {{ B3 }}, {{ B3 }}, {{ BR }}, {{ BR }}{% if has_weight %}, {{ V }}{% endif %})
      outs(%br_zero, %br_zero : {{ BR }}, {{ BR }})
      attrs = {lowering_config = {{ h.cpu_reduction_tiles([0, 0, row_vec]) }}} {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %mu: f32, %rs: f32{% if has_weight %}, %win: {{ dtype }}{% endif %}, %s1: f32, %s2: f32):
{{ row_sums_body() }}
  } -> ({{ BR }}, {{ BR }})
  %dx_empty = tensor.empty() : {{ B3 }}
  %part_empty = tensor.empty() : {{ P }}
  {#- One initial value per partial sum, each tiled along the columns (untiled, its stack
      copy can pass IREE's limit). dw's starts at +0.0 and db's at -0.0 (both add nothing),
      so that CSE keeps them apart. #}
{% for c in cols %}
  %part_zero_{{ c }} = linalg.fill {lowering_config = {{ h.cpu_inner_tiles([0, vec]) }}} ins({{ "%zero" if c == "w" else "%negzero" }} : f32) outs(%part_empty : {{ P }}) -> {{ P }}
{% endfor %}
  {# Loops (block, column, row), the row reduction innermost as IREE orders it. #}
  %parts:{{ cols|length + 1 }} = linalg.generic {indexing_maps = [{{ h.map(3, [0, 2, 1]) }}, {{ h.map(3, [0, 2, 1]) }}, {{ h.map(3, [0, 2]) }}, {{ h.map(3, [0, 2]) }}{% if has_weight %}, {{ h.map(3, [1]) }}{% endif %}, {{ h.map(3, [0, 2]) }}, {{ h.map(3, [0, 2]) }}, {{ h.map(3, [0, 2, 1]) }}{% for c in cols %}, {{ h.map(3, [0, 1]) }}{% endfor %}],
                             iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%g3, %x3, %mean2, %rstd2{% if has_weight %}, %w{% endif %}, %sums#0, %sums#1 : {{ B3 }}, {{ B3 }}, {{ BR }}, {{ BR }}{% if has_weight %}, {{ V }}{% endif %}, {{ BR }}, {{ BR }})
      outs(%dx_empty{% for c in cols %}, %part_zero_{{ c }}{% endfor %} : {{ B3 }}{% for c in cols %}, {{ P }}{% endfor %})
      attrs = {compilation_info = {{ h.cpu_tiles_inner([1, 0, 0], [1, 0, 0], [0, 0, 1], [0, vec, 0]) }}} {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %mu: f32, %rs: f32{% if has_weight %}, %win: {{ dtype }}{% endif %}, %s1: f32, %s2: f32, %unused: {{ dtype }}{% for c in cols %}, %p{{ c }}: f32{% endfor %}):
{{ dx_body() }}
{% if "w" in cols %}
    {#- g * xhat exactly (-0.0 adds nothing). A plain mulf feeding the accumulation is folded
        by IREE into a vector.contract that it then lowers one element at a time. #}
    %gx = math.fma {{ h.f32ref("gf", "gin", dtype) }}, %xhat, %negzero : f32
    %pwn = arith.addf %pw, %gx : f32
{% endif %}
{% if "b" in cols %}
    %pbn = arith.addf %pb, {{ h.f32ref("gf", "gin", dtype) }} : f32
{% endif %}
    linalg.yield {{ h.narrowref("dxn", "dxf", dtype) }}{% for c in cols %}, %p{{ c }}n{% endfor %} : {{ dtype }}{% for c in cols %}, f32{% endfor %}{{ "" }}
  } -> ({{ B3 }}{% for c in cols %}, {{ P }}{% endfor %})
  {% endcall %}
  %dx = tensor.collapse_shape %one#0 [[0, 1], [2]] : {{ B3 }} into {{ X }}
{% else %}
{% if output_mask[0] %}
  %row_empty = {{ h.empty([M], "f32", [m]) }}
  %row_zero = linalg.fill ins(%zero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  %sums:2 = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}, {{ h.map(2, [0]) }}, {{ h.map(2, [0]) }}{% if has_weight %}, {{ h.map(2, [1]) }}{% endif %}, {{ h.map(2, [0]) }}, {{ h.map(2, [0]) }}],
                            iterator_types = ["parallel", "reduction"]}
      ins(%g, %x, %mean_f, %rstd_f{% if has_weight %}, %w{% endif %} : {{ X }}, {{ X }}, {{ ROW }}, {{ ROW }}{% if has_weight %}, {{ V }}{% endif %})
      outs(%row_zero, %row_zero : {{ ROW }}, {{ ROW }}) {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %mu: f32, %rs: f32{% if has_weight %}, %win: {{ dtype }}{% endif %}, %s1: f32, %s2: f32):
{{ row_sums_body() }}
  } -> ({{ ROW }}, {{ ROW }})
  %dx_empty = {{ h.empty([M, N], dtype, [m]) }}
  %dx = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}, {{ h.map(2, [0]) }}, {{ h.map(2, [0]) }}{% if has_weight %}, {{ h.map(2, [1]) }}{% endif %}, {{ h.map(2, [0]) }}, {{ h.map(2, [0]) }}, {{ h.map(2) }}],
                        iterator_types = ["parallel", "parallel"]}
      ins(%g, %x, %mean_f, %rstd_f{% if has_weight %}, %w{% endif %}, %sums#0, %sums#1 : {{ X }}, {{ X }}, {{ ROW }}, {{ ROW }}{% if has_weight %}, {{ V }}{% endif %}, {{ ROW }}, {{ ROW }})
      outs(%dx_empty : {{ X }}) {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %mu: f32, %rs: f32{% if has_weight %}, %win: {{ dtype }}{% endif %}, %s1: f32, %s2: f32, %unused: {{ dtype }}):
{{ dx_body() }}
    linalg.yield {{ h.narrowref("dxn", "dxf", dtype) }} : {{ dtype }}
  } -> {{ X }}
{% endif %}
{% if cols %}
  {#- A barrier keeps IREE from fusing the producer of %g (often an activation's backward)
      into this column reduction, where it would run once per strided element; it is
      cheaper to materialize it. #}
{% if M is none %}
  %g_barrier = "util.optimization_barrier"(%g) : ({{ X }}) -> {{ X }}
  {#- The barrier hides %g's size from IREE; the tie says it again. #}
  %g_cols = "flow.tensor.tie_shape"(%g_barrier, %dim_m) : ({{ X }}, index) -> {{ X }}
{% else %}
  %g_cols = "util.optimization_barrier"(%g) : ({{ X }}) -> {{ X }}
{% endif %}
{% if M is none %}
  {#- The first blocks * (M // blocks) rows in blocks, the rest on their own. #}
  %blocks = arith.constant {{ blocks }} : index
  %dim_r = arith.divui %dim_m, %blocks : index
  %dim_main = arith.muli %dim_r, %blocks : index
  %dim_rest = arith.subi %dim_m, %dim_main : index
  %g_main = tensor.extract_slice %g_cols[0, 0] [%dim_main, {{ N }}] [1, 1] : {{ X }} to {{ X }}
  %x_main = tensor.extract_slice %x[0, 0] [%dim_main, {{ N }}] [1, 1] : {{ X }} to {{ X }}
  %mean_main = tensor.extract_slice %mean_f[0] [%dim_main] [1] : {{ ROW }} to {{ ROW }}
  %rstd_main = tensor.extract_slice %rstd_f[0] [%dim_main] [1] : {{ ROW }} to {{ ROW }}
  %g_rest = tensor.extract_slice %g_cols[%dim_main, 0] [%dim_rest, {{ N }}] [1, 1] : {{ X }} to {{ X }}
  %x_rest = tensor.extract_slice %x[%dim_main, 0] [%dim_rest, {{ N }}] [1, 1] : {{ X }} to {{ X }}
  %mean_rest = tensor.extract_slice %mean_f[%dim_main] [%dim_rest] [1] : {{ ROW }} to {{ ROW }}
  %rstd_rest = tensor.extract_slice %rstd_f[%dim_main] [%dim_rest] [1] : {{ ROW }} to {{ ROW }}
{% set sources = {"g": "%g_main", "x": "%x_main", "mean": "%mean_main", "rstd": "%rstd_main"} %}
{% else %}
{% set sources = {"g": "%g_cols", "x": "%x", "mean": "%mean_f", "rstd": "%rstd_f"} %}
{% endif %}
  %g3 = tensor.expand_shape {{ sources.g }} [[0, 1], [2]] output_shape {{ h.output_shape([blocks, R, N], ["", "%dim_r"]) }} : {{ X }} into {{ B3 }}
  %x3 = tensor.expand_shape {{ sources.x }} [[0, 1], [2]] output_shape {{ h.output_shape([blocks, R, N], ["", "%dim_r"]) }} : {{ X }} into {{ B3 }}
  %mean2 = tensor.expand_shape {{ sources.mean }} [[0, 1]] output_shape {{ h.output_shape([blocks, R], ["", "%dim_r"]) }} : {{ ROW }} into {{ BR }}
  %rstd2 = tensor.expand_shape {{ sources.rstd }} [[0, 1]] output_shape {{ h.output_shape([blocks, R], ["", "%dim_r"]) }} : {{ ROW }} into {{ BR }}
  %part_empty = tensor.empty() : {{ P }}
  %part_zero = linalg.fill ins(%zero : f32) outs(%part_empty : {{ P }}) -> {{ P }}
  {#- Loops (block, column, row): written with the reduction innermost, as IREE orders it, so
      that the CPU tile sizes below name the right loops. On the CPU, IREE's own choice
      vectorizes along the rows (a strided gather); these tiles vectorize along the columns. #}
  %parts:{{ cols|length }} = linalg.generic {indexing_maps = [{{ h.map(3, [0, 2, 1]) }}, {{ h.map(3, [0, 2, 1]) }}, {{ h.map(3, [0, 2]) }}, {{ h.map(3, [0, 2]) }}{% for c in cols %}, {{ h.map(3, [0, 1]) }}{% endfor %}],
                             iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%g3, %x3, %mean2, %rstd2 : {{ B3 }}, {{ B3 }}, {{ BR }}, {{ BR }})
      outs({% for c in cols %}%part_zero{{ ", " if not loop.last }}{% endfor %} : {% for c in cols %}{{ P }}{{ ", " if not loop.last }}{% endfor %})
{% if target == "llvm-cpu" and N % 128 == 0 and blocks % 8 == 0 %}
      attrs = {compilation_info = {{ h.cpu_tiles([8, 128, 0], [1, 128, 0], [0, 0, 1]) }}}
{% endif %}
      {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %mu: f32, %rs: f32{% for c in cols %}, %p{{ c }}: f32{% endfor %}):
{{ col_body() }}
  } -> ({% for c in cols %}{{ P }}{{ ", " if not loop.last }}{% endfor %})
{% endif %}
{% endif %}
{% if cols %}
  %colf_empty = tensor.empty() : {{ COL }}
  %col_zero = linalg.fill ins(%zero : f32) outs(%colf_empty : {{ COL }}) -> {{ COL }}
  %col_empty = tensor.empty() : {{ V }}
{% if M is none %}
  {#- The rows left over, summed over rows (loops (column, row)); added to the blocks' sums
      when they are narrowed. #}
  %rest:{{ cols|length }} = linalg.generic {indexing_maps = [{{ h.map(2, [1, 0]) }}, {{ h.map(2, [1, 0]) }}, {{ h.map(2, [1]) }}, {{ h.map(2, [1]) }}{% for c in cols %}, {{ h.map(2, [0]) }}{% endfor %}],
                            iterator_types = ["parallel", "reduction"]}
      ins(%g_rest, %x_rest, %mean_rest, %rstd_rest : {{ X }}, {{ X }}, {{ ROW }}, {{ ROW }})
      outs({% for c in cols %}%col_zero{{ ", " if not loop.last }}{% endfor %} : {% for c in cols %}{{ COL }}{{ ", " if not loop.last }}{% endfor %}) {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %mu: f32, %rs: f32{% for c in cols %}, %p{{ c }}: f32{% endfor %}):
{{ col_body() }}
  } -> ({% for c in cols %}{{ COL }}{{ ", " if not loop.last }}{% endfor %})
{% endif %}
{% for c in cols %}
{% set part = ("%one#" ~ loop.index) if one_pass else ("%parts#" ~ loop.index0) %}
  %sum_{{ c }} = linalg.generic {indexing_maps = [{{ h.map(2, [1, 0]) }}, {{ h.map(2, [0]) }}], iterator_types = ["parallel", "reduction"]}
      ins({{ part }} : {{ P }}) outs(%col_zero : {{ COL }}) {
  ^bb0(%p: f32, %acc: f32):
    %accn = arith.addf %acc, %p : f32
    linalg.yield %accn : f32
  } -> {{ COL }}
{% if M is none %}
  %d{{ c }} = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%sum_{{ c }}, %rest#{{ loop.index0 }} : {{ COL }}, {{ COL }}) outs(%col_empty : {{ V }}) {
  ^bb0(%sb: f32, %sr: f32, %unused: {{ dtype }}):
    %sf = arith.addf %sb, %sr : f32
{% else %}
  %d{{ c }} = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%sum_{{ c }} : {{ COL }}) outs(%col_empty : {{ V }}) {
  ^bb0(%sf: f32, %unused: {{ dtype }}):
{% endif %}
    {{ h.from_f32("sn", "sf", dtype) }}
    linalg.yield {{ h.narrowref("sn", "sf", dtype) }} : {{ dtype }}
  } -> {{ V }}
{% endfor %}
{% endif %}
{% endif %}
  return {% for name, type in results %}%{{ name }}{{ ", " if not loop.last }}{% endfor %} : {% for name, type in results %}{{ type }}{{ ", " if not loop.last }}{% endfor %}{{ "" }}
}
