{#- native_group_norm_backward on x[N, C, HW], viewed as [N, G, D = C/G, HW], computing only
    what output_mask asks. Per (n, c), one pass over the data sums over HW:
      A = sum g,  B = sum g * (x - mean)          (deviations from the saved mean: no cancellation)
    then, with K = D * HW and w = 1 when absent:
      dx = rstd * (g*w - S1/K - (x - mean) * rstd^2 * S2/K),  S1 = sum_d w*A,  S2 = sum_d w*B
      dw = sum_n B * rstd,  db = sum_n A
    Params: N, C, HW, G, dtype, stat_dtype, has_weight, output_mask. N and HW may be dynamic
    (None), read from x as %dim_n and %dim_hw. -#}
{% import "_helpers.mlir" as h with context %}
{% set D = C // G %}
{% set X = h.tensor([N, C, HW], dtype) %}
{% set X4 = h.tensor([N, G, D, HW], dtype) %}
{% set V = h.tensor([C], dtype) %}
{% set V2 = h.tensor([G, D], dtype) %}
{% set COL2 = h.tensor([G, D], "f32") %}
{% set ROW = h.tensor([N, G], "f32") %}
{% set NC = h.tensor([N, G, D], "f32") %}
{% set STAT = h.tensor([N, G], stat_dtype) %}
{#- SSA names of the dynamic sizes, by position in [N, G, D, HW] (and its prefixes). -#}
{% set sizes = ["%dim_n", "", "", "%dim_hw"] %}
{% set X_SIZES = ["%dim_n", "", "%dim_hw"] %}
{% set results = [] %}
{% if output_mask[0] %}{% set _ = results.append(("dx", X)) %}{% endif %}
{% if output_mask[1] %}{% set _ = results.append(("dw", V)) %}{% endif %}
{% if output_mask[2] %}{% set _ = results.append(("db", V)) %}{% endif %}
func.func private @{{ func_name }}(%g: {{ X }}, %x: {{ X }}, %mean: {{ STAT }}, %rstd: {{ STAT }}{% if has_weight %}, %w: {{ V }}{% endif %})
    -> ({% for name, type in results %}{{ type }}{{ ", " if not loop.last }}{% endfor %}) {{ h.identity({"output_mask": output_mask, "groups": G, "has_weight": has_weight}) }} {
  %zero = arith.constant 0.0 : f32
{% if N is none %}
  {{ h.dim("dim_n", "%x", 0, X) }}
{% endif %}
{% if HW is none %}
  {{ h.dim("dim_hw", "%x", 2, X) }}
{% endif %}
{% if N == 0 %}
  {#- An empty batch: IREE 3.13 crashes on reductions over zero rows, so say it directly. #}
  %dx = {{ h.empty([N, C, HW], dtype, X_SIZES) }}
  %zero_t = arith.constant 0.0 : {{ dtype }}
  %col_empty = tensor.empty() : {{ V }}
  %dw = linalg.fill ins(%zero_t : {{ dtype }}) outs(%col_empty : {{ V }}) -> {{ V }}
  %db = linalg.fill ins(%zero_t : {{ dtype }}) outs(%col_empty : {{ V }}) -> {{ V }}
{% else %}
  {{ h.count("k", [D, "%dim_hw" if HW is none else HW]) }}
  %g4 = tensor.expand_shape %g [[0], [1, 2], [3]] output_shape {{ h.output_shape([N, G, D, HW], sizes) }} : {{ X }} into {{ X4 }}
  %x4 = tensor.expand_shape %x [[0], [1, 2], [3]] output_shape {{ h.output_shape([N, G, D, HW], sizes) }} : {{ X }} into {{ X4 }}
{% if has_weight %}
  %w2 = tensor.expand_shape %w [[0, 1]] output_shape [{{ G }}, {{ D }}] : {{ V }} into {{ V2 }}
{% endif %}
  %row_empty = {{ h.empty([N, G], "f32", sizes) }}
  %mean_f = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}], iterator_types = ["parallel", "parallel"]}
      ins(%mean : {{ STAT }}) outs(%row_empty : {{ ROW }}) {
  ^bb0(%in: {{ stat_dtype }}, %unused: f32):
    {{ h.to_f32("f", "in", stat_dtype) }}
    linalg.yield {{ h.f32ref("f", "in", stat_dtype) }} : f32
  } -> {{ ROW }}
  %rstd_f = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}], iterator_types = ["parallel", "parallel"]}
      ins(%rstd : {{ STAT }}) outs(%row_empty : {{ ROW }}) {
  ^bb0(%in: {{ stat_dtype }}, %unused: f32):
    {{ h.to_f32("f", "in", stat_dtype) }}
    linalg.yield {{ h.f32ref("f", "in", stat_dtype) }} : f32
  } -> {{ ROW }}
  %nc_empty = {{ h.empty([N, G, D], "f32", sizes) }}
  {#- The sums accumulate in f64: a plain f32 sum over thousands of terms that cancel loses
      about log2(HW) bits of dweight and dbias (1.4e-5 relative at 4097 terms, where eager's
      cascade sum keeps 7e-7). The pass is memory bound, so f64 adds cost little; compensated
      (Kahan) f32 sums made the whole kernel 1.4x slower. #}
{% set NC64 = h.tensor([N, G, D], "f64") %}
  %zero64 = arith.constant 0.0 : f64
  %nc64_empty = {{ h.empty([N, G, D], "f64", sizes) }}
  %nc64_zero = linalg.fill ins(%zero64 : f64) outs(%nc64_empty : {{ NC64 }}) -> {{ NC64 }}
{% set nc64_zero2 = "%nc64_zero" %}
{% if N is none or HW is none %}
  {#- With dynamic sizes, two results of one reduction need inits of their own: IREE 3.13's GPU
    bufferization fails on a shared one (a -0.0 fill, which CSE keeps apart). #}
  %negzero64 = arith.constant -0.0 : f64
  %nc64_zero2 = linalg.fill ins(%negzero64 : f64) outs(%nc64_empty : {{ NC64 }}) -> {{ NC64 }}
{% set nc64_zero2 = "%nc64_zero2" %}
{% endif %}
  %ab64:2 = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4) }}, {{ h.map(4, [0, 1]) }}, {{ h.map(4, [0, 1, 2]) }}, {{ h.map(4, [0, 1, 2]) }}],
                            iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%g4, %x4, %mean_f : {{ X4 }}, {{ X4 }}, {{ ROW }}) outs(%nc64_zero, {{ nc64_zero2 }} : {{ NC64 }}, {{ NC64 }}) {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %mu: f32, %a: f64, %b: f64):
    {{ h.to_f32("gf", "gin", dtype) }}
    {{ h.to_f32("xf", "xin", dtype) }}
    %c = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %mu : f32
    %gc = arith.mulf {{ h.f32ref("gf", "gin", dtype) }}, %c : f32
    %g64 = arith.extf {{ h.f32ref("gf", "gin", dtype) }} : f32 to f64
    %gc64 = arith.extf %gc : f32 to f64
    %an = arith.addf %a, %g64 : f64
    %bn = arith.addf %b, %gc64 : f64
    linalg.yield %an, %bn : f64, f64
  } -> ({{ NC64 }}, {{ NC64 }})
  %ab:2 = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3) }}, {{ h.map(3) }}, {{ h.map(3) }}],
                          iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%ab64#0, %ab64#1 : {{ NC64 }}, {{ NC64 }}) outs(%nc_empty, %nc_empty : {{ NC }}, {{ NC }}) {
  ^bb0(%a: f64, %b: f64, %unused0: f32, %unused1: f32):
    %a32 = arith.truncf %a : f64 to f32
    %b32 = arith.truncf %b : f64 to f32
    linalg.yield %a32, %b32 : f32, f32
  } -> ({{ NC }}, {{ NC }})
{% if output_mask[0] %}
  %row_zero = linalg.fill ins(%zero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
{% set row_zero2 = "%row_zero" %}
{% if N is none %}
  %negzero = arith.constant -0.0 : f32
  %row_zero2 = linalg.fill ins(%negzero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
{% set row_zero2 = "%row_zero2" %}
{% endif %}
  %s:2 = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3) }}{% if has_weight %}, {{ h.map(3, [1, 2]) }}{% endif %}, {{ h.map(3, [0, 1]) }}, {{ h.map(3, [0, 1]) }}],
                         iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%ab#0, %ab#1{% if has_weight %}, %w2{% endif %} : {{ NC }}, {{ NC }}{% if has_weight %}, {{ V2 }}{% endif %}) outs(%row_zero, {{ row_zero2 }} : {{ ROW }}, {{ ROW }}) {
  ^bb0(%a: f32, %b: f32{% if has_weight %}, %win: {{ dtype }}{% endif %}, %s1: f32, %s2: f32):
{% if has_weight %}
    {{ h.to_f32("wf", "win", dtype) }}
    %wa = arith.mulf %a, {{ h.f32ref("wf", "win", dtype) }} : f32
    %wb = arith.mulf %b, {{ h.f32ref("wf", "win", dtype) }} : f32
    %s1n = arith.addf %s1, %wa : f32
    %s2n = arith.addf %s2, %wb : f32
{% else %}
    %s1n = arith.addf %s1, %a : f32
    %s2n = arith.addf %s2, %b : f32
{% endif %}
    linalg.yield %s1n, %s2n : f32, f32
  } -> ({{ ROW }}, {{ ROW }})
  %dx_empty = {{ h.empty([N, G, D, HW], dtype, sizes) }}
  %dx4 = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4) }}, {{ h.map(4, [0, 1]) }}, {{ h.map(4, [0, 1]) }}{% if has_weight %}, {{ h.map(4, [1, 2]) }}{% endif %}, {{ h.map(4, [0, 1]) }}, {{ h.map(4, [0, 1]) }}, {{ h.map(4) }}],
                         iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%g4, %x4, %mean_f, %rstd_f{% if has_weight %}, %w2{% endif %}, %s#0, %s#1 : {{ X4 }}, {{ X4 }}, {{ ROW }}, {{ ROW }}{% if has_weight %}, {{ V2 }}{% endif %}, {{ ROW }}, {{ ROW }})
      outs(%dx_empty : {{ X4 }}) {
  ^bb0(%gin: {{ dtype }}, %xin: {{ dtype }}, %mu: f32, %rs: f32{% if has_weight %}, %win: {{ dtype }}{% endif %}, %s1: f32, %s2: f32, %unused: {{ dtype }}):
    {{ h.to_f32("gf", "gin", dtype) }}
    {{ h.to_f32("xf", "xin", dtype) }}
{% if has_weight %}
    {{ h.to_f32("wf", "win", dtype) }}
    %gw = arith.mulf {{ h.f32ref("gf", "gin", dtype) }}, {{ h.f32ref("wf", "win", dtype) }} : f32
{% set gw = "%gw" %}
{% else %}
{% set gw = h.f32ref("gf", "gin", dtype) %}
{% endif %}
    %c = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %mu : f32
    %m1 = arith.divf %s1, %k : f32
    %rs2 = arith.mulf %rs, %rs : f32
    %m2a = arith.mulf %s2, %rs2 : f32
    %m2 = arith.divf %m2a, %k : f32
    %t0 = arith.subf {{ gw }}, %m1 : f32
    %t1 = arith.mulf %c, %m2 : f32
    %t2 = arith.subf %t0, %t1 : f32
    %dxf = arith.mulf %t2, %rs : f32
    {{ h.from_f32("dxn", "dxf", dtype) }}
    linalg.yield {{ h.narrowref("dxn", "dxf", dtype) }} : {{ dtype }}
  } -> {{ X4 }}
  %dx = tensor.collapse_shape %dx4 [[0], [1, 2], [3]] : {{ X4 }} into {{ X }}
{% endif %}
{% if output_mask[1] or output_mask[2] %}
  %col_empty = tensor.empty() : {{ COL2 }}
  %col_zero = linalg.fill ins(%zero : f32) outs(%col_empty : {{ COL2 }}) -> {{ COL2 }}
  %out_empty = tensor.empty() : {{ V2 }}
{% endif %}
{% for name, src, scaled in [("dw", "%ab#1", true), ("db", "%ab#0", false)] %}
{% if output_mask[loop.index] %}
  {#- Loops (g, d, n): a column sum over the batch of the [N, G, D] partial sums. #}
  %{{ name }}_sum = linalg.generic {indexing_maps = [{{ h.map(3, [2, 0, 1]) }}{% if scaled %}, {{ h.map(3, [2, 0]) }}{% endif %}, {{ h.map(3, [0, 1]) }}],
                                    iterator_types = ["parallel", "parallel", "reduction"]}
      ins({{ src }}{% if scaled %}, %rstd_f{% endif %} : {{ NC }}{% if scaled %}, {{ ROW }}{% endif %}) outs(%col_zero : {{ COL2 }}) {
  ^bb0(%p: f32{% if scaled %}, %rs: f32{% endif %}, %acc: f32):
{% if scaled %}
    %ps = arith.mulf %p, %rs : f32
    %accn = arith.addf %acc, %ps : f32
{% else %}
    %accn = arith.addf %acc, %p : f32
{% endif %}
    linalg.yield %accn : f32
  } -> {{ COL2 }}
  %{{ name }}_2 = linalg.generic {indexing_maps = [{{ h.map(2) }}, {{ h.map(2) }}], iterator_types = ["parallel", "parallel"]}
      ins(%{{ name }}_sum : {{ COL2 }}) outs(%out_empty : {{ V2 }}) {
  ^bb0(%sf: f32, %unused: {{ dtype }}):
    {{ h.from_f32("sn", "sf", dtype) }}
    linalg.yield {{ h.narrowref("sn", "sf", dtype) }} : {{ dtype }}
  } -> {{ V2 }}
  %{{ name }} = tensor.collapse_shape %{{ name }}_2 [[0, 1]] : {{ V2 }} into {{ V }}
{% endif %}
{% endfor %}
{% endif %}
  return {% for name, type in results %}%{{ name }}{{ ", " if not loop.last }}{% endfor %} : {% for name, type in results %}{{ type }}{{ ", " if not loop.last }}{% endfor %}{{ "" }}
}
