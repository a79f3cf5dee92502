{#- native_batch_norm_backward on x[N, C, HW], per channel over (N, HW), cnt = N * HW, computing
    only what output_mask asks. mean, rstd: the saved ones when train, else running_mean and
    rsqrt(running_var + eps). With A = sum g, B = sum g * (x - mean) over (n, hw) (per-(n, c)
    sums over HW, then over the batch, accumulated in f64) and w = 1 when absent:
      train: dx = w * rstd * (g - A/cnt - (x - mean) * rstd^2 * B/cnt)
      eval:  dx = g * w * rstd
      dw = B * rstd,  db = A
    Params: N, C, HW (N and HW may be dynamic: None), dtype, train, eps, has_weight, stat_sizes (sizes of running_mean,
    running_var, save_mean, save_invstd; None when absent; the unused ones are ignored),
    output_mask. -#}
{% import "_helpers.mlir" as h with context %}
{% set X = h.tensor([N, C, HW], dtype) %}
{% set V = h.tensor([C], dtype) %}
{% set P = h.tensor([N, C], "f32") %}
{% set COL = h.tensor([C], "f32") %}
{#- SSA names of the dynamic sizes, by position in [N, C, HW]. -#}
{% set sizes = ["%dim_n", "", "%dim_hw"] %}
{% set stat_names = ["rm", "rv", "sm", "si"] %}
{% set results = [] %}
{% if output_mask[0] %}{% set _ = results.append(("dx", X)) %}{% endif %}
{% if output_mask[1] %}{% set _ = results.append(("dw", V)) %}{% endif %}
{% if output_mask[2] %}{% set _ = results.append(("db", V)) %}{% endif %}
{% set need_sums = (output_mask[0] and train) or output_mask[1] or output_mask[2] %}
func.func private @{{ func_name }}(%g: {{ X }}, %x: {{ X }}{% if has_weight %}, %w: {{ V }}{% endif %}{% for size in stat_sizes %}{% if size is not none %}, %{{ stat_names[loop.index0] }}: {{ h.tensor([size], dtype) }}{% endif %}{% endfor %})
    -> ({% for name, type in results %}{{ type }}{{ ", " if not loop.last }}{% endfor %}) {{ h.identity({"output_mask": output_mask, "train": train, "has_weight": has_weight}) }} {
  %zero = arith.constant 0.0 : f32
{% if N is none %}
  {{ h.dim("dim_n", "%x", 0, X) }}
{% endif %}
{% if HW is none %}
  {{ h.dim("dim_hw", "%x", 2, X) }}
{% endif %}
  {{ h.count("cnt", ["%dim_n" if N is none else N, "%dim_hw" if HW is none else HW]) }}
  %col_empty = tensor.empty() : {{ COL }}
  %col_zero = linalg.fill ins(%zero : f32) outs(%col_empty : {{ COL }}) -> {{ COL }}
{% set m_src, r_src = ("sm", "si") if train else ("rm", "rv") %}
  %mr:2 = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%{{ m_src }}, %{{ r_src }} : {{ V }}, {{ V }}) outs(%col_empty, %col_empty : {{ COL }}, {{ COL }}) {
  ^bb0(%min: {{ dtype }}, %rin: {{ dtype }}, %u0: f32, %u1: f32):
    {{ h.to_f32("mf", "min", dtype) }}
    {{ h.to_f32("rf", "rin", dtype) }}
{% if train %}
    linalg.yield {{ h.f32ref("mf", "min", dtype) }}, {{ h.f32ref("rf", "rin", dtype) }} : f32, f32
{% else %}
    %eps = arith.constant {{ "%.17e"|format(eps) }} : f32
    %vare = arith.addf {{ h.f32ref("rf", "rin", dtype) }}, %eps : f32
    %rstd = math.rsqrt %vare : f32
    linalg.yield {{ h.f32ref("mf", "min", dtype) }}, %rstd : f32, f32
{% endif %}
  } -> ({{ COL }}, {{ COL }})
{% if need_sums %}
  {#- f64 accumulators: a plain f32 sum over thousands of terms that cancel loses about
      log2(N * HW) bits of dweight; the passes are memory bound, so f64 adds cost little
      (compensated f32 sums cost more and did not vectorize). #}
{% set P64 = h.tensor([N, C], "f64") %}
{% set COL64 = h.tensor([C], "f64") %}
  %zero64 = arith.constant 0.0 : f64
  %p_empty = {{ h.empty([N, C], "f64", sizes) }}
  %p_zero = linalg.fill ins(%zero64 : f64) outs(%p_empty : {{ P64 }}) -> {{ P64 }}
{% set p_zero2 = "%p_zero" %}
{% if N is none or HW is none %}
  {#- With dynamic sizes, two results of one reduction need inits of their own: IREE 3.13's GPU
    bufferization fails on a shared one (a -0.0 fill, which CSE keeps apart). #}
  %negzero64 = arith.constant -0.0 : f64
  %p_zero2 = linalg.fill ins(%negzero64 : f64) outs(%p_empty : {{ P64 }}) -> {{ P64 }}
{% set p_zero2 = "%p_zero2" %}
{% endif %}
  %ab:2 = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3) }}, {{ h.map(3, [1]) }}, {{ h.map(3, [0, 1]) }}, {{ h.map(3, [0, 1]) }}],
                          iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%g, %x, %mr#0 : {{ X }}, {{ X }}, {{ COL }}) outs(%p_zero, {{ p_zero2 }} : {{ P64 }}, {{ P64 }}) {
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
  } -> ({{ P64 }}, {{ P64 }})
  %col64_empty = tensor.empty() : {{ COL64 }}
  %col64_zero = linalg.fill ins(%zero64 : f64) outs(%col64_empty : {{ COL64 }}) -> {{ COL64 }}
  %sums64:2 = linalg.generic {indexing_maps = [{{ h.map(2, [1, 0]) }}, {{ h.map(2, [1, 0]) }}, {{ h.map(2, [0]) }}, {{ h.map(2, [0]) }}],
                              iterator_types = ["parallel", "reduction"]}
      ins(%ab#0, %ab#1 : {{ P64 }}, {{ P64 }}) outs(%col64_zero, %col64_zero : {{ COL64 }}, {{ COL64 }}) {
  ^bb0(%pa: f64, %pb: f64, %a: f64, %b: f64):
    %an = arith.addf %a, %pa : f64
    %bn = arith.addf %b, %pb : f64
    linalg.yield %an, %bn : f64, f64
  } -> ({{ COL64 }}, {{ COL64 }})
  %sums:2 = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%sums64#0, %sums64#1 : {{ COL64 }}, {{ COL64 }}) outs(%col_empty, %col_empty : {{ COL }}, {{ COL }}) {
  ^bb0(%a: f64, %b: f64, %u0: f32, %u1: f32):
    %a32 = arith.truncf %a : f64 to f32
    %b32 = arith.truncf %b : f64 to f32
    linalg.yield %a32, %b32 : f32, f32
  } -> ({{ COL }}, {{ COL }})
{% endif %}
{% if output_mask[0] %}
  {#- Per channel: dx = g * k1 - (x - mean) * k2 - k3, folding the channel constants. #}
  %k:3 = linalg.generic {indexing_maps = [{% for i in range(4 + has_weight + (2 if train else 0)) %}{{ h.map(1) }}{{ ", " if not loop.last }}{% endfor %}], iterator_types = ["parallel"]}
      ins(%mr#1{% if has_weight %}, %w{% endif %}{% if train %}, %sums#0, %sums#1{% endif %} : {{ COL }}{% if has_weight %}, {{ V }}{% endif %}{% if train %}, {{ COL }}, {{ COL }}{% endif %})
      outs(%col_empty, %col_empty, %col_empty : {{ COL }}, {{ COL }}, {{ COL }}) {
  ^bb0(%rs: f32{% if has_weight %}, %win: {{ dtype }}{% endif %}{% if train %}, %a: f32, %b: f32{% endif %}, %u0: f32, %u1: f32, %u2: f32):
{% if has_weight %}
    {{ h.to_f32("wf", "win", dtype) }}
    %k1 = arith.mulf %rs, {{ h.f32ref("wf", "win", dtype) }} : f32
{% else %}
    %k1 = arith.addf %rs, %zero : f32
{% endif %}
{% if train %}
    %rs2 = arith.mulf %rs, %rs : f32
    %bm = arith.divf %b, %cnt : f32
    %bm2 = arith.mulf %bm, %rs2 : f32
    %k2 = arith.mulf %bm2, %k1 : f32
    %am = arith.divf %a, %cnt : f32
    %k3 = arith.mulf %am, %k1 : f32
{% else %}
    %k2 = arith.addf %zero, %zero : f32
    %k3 = arith.addf %zero, %zero : f32
{% endif %}
    linalg.yield %k1, %k2, %k3 : f32, f32, f32
  } -> ({{ COL }}, {{ COL }}, {{ COL }})
  %dx_empty = {{ h.empty([N, C, HW], dtype, sizes) }}
  %dx = linalg.generic {indexing_maps = [{{ h.map(3) }}{% if train %}, {{ h.map(3) }}, {{ h.map(3, [1]) }}{% endif %}{% for i in range(3 if train else 1) %}, {{ h.map(3, [1]) }}{% endfor %}, {{ h.map(3) }}],
                        iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%g{% if train %}, %x, %mr#0{% endif %}, %k#0{% if train %}, %k#1, %k#2{% endif %} : {{ X }}{% if train %}, {{ X }}, {{ COL }}{% endif %}, {{ COL }}{% if train %}, {{ COL }}, {{ COL }}{% endif %})
      outs(%dx_empty : {{ X }}) {
  ^bb0(%gin: {{ dtype }}{% if train %}, %xin: {{ dtype }}, %mu: f32{% endif %}, %k1: f32{% if train %}, %k2: f32, %k3: f32{% endif %}, %unused: {{ dtype }}):
    {{ h.to_f32("gf", "gin", dtype) }}
    %t0 = arith.mulf {{ h.f32ref("gf", "gin", dtype) }}, %k1 : f32
{% if train %}
    {{ h.to_f32("xf", "xin", dtype) }}
    %c = arith.subf {{ h.f32ref("xf", "xin", dtype) }}, %mu : f32
    %t1 = arith.mulf %c, %k2 : f32
    %t2 = arith.subf %t0, %t1 : f32
    %dxf = arith.subf %t2, %k3 : f32
{% else %}
    %dxf = arith.addf %t0, %zero : f32
{% endif %}
    {{ h.from_f32("dxn", "dxf", dtype) }}
    linalg.yield {{ h.narrowref("dxn", "dxf", dtype) }} : {{ dtype }}
  } -> {{ X }}
{% endif %}
{% if output_mask[1] or output_mask[2] %}
  %v_empty = tensor.empty() : {{ V }}
{% endif %}
{% if output_mask[1] %}
  %dw = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%sums#1, %mr#1 : {{ COL }}, {{ COL }}) outs(%v_empty : {{ V }}) {
  ^bb0(%b: f32, %rs: f32, %unused: {{ dtype }}):
    %dwf = arith.mulf %b, %rs : f32
    {{ h.from_f32("dwn", "dwf", dtype) }}
    linalg.yield {{ h.narrowref("dwn", "dwf", dtype) }} : {{ dtype }}
  } -> {{ V }}
{% endif %}
{% if output_mask[2] %}
  %db = linalg.generic {indexing_maps = [{{ h.map(1) }}, {{ h.map(1) }}], iterator_types = ["parallel"]}
      ins(%sums#0 : {{ COL }}) outs(%v_empty : {{ V }}) {
  ^bb0(%a: f32, %unused: {{ dtype }}):
    {{ h.from_f32("dbn", "a", dtype) }}
    linalg.yield {{ h.narrowref("dbn", "a", dtype) }} : {{ dtype }}
  } -> {{ V }}
{% endif %}
  return {% for name, type in results %}%{{ name }}{{ ", " if not loop.last }}{% endfor %} : {% for name, type in results %}{{ type }}{{ ", " if not loop.last }}{% endfor %}{{ "" }}
}
