{#- Shared pieces for every kernel template. Import with:
      {% import "_helpers.mlir" as h %}
    Low-precision inputs (bf16, f16) are widened to f32 for arithmetic and narrowed on store. -#}

{#- `tensor<4x8xf32>`; a dynamic dim (None) is `?`: `tensor<?x8xf32>`; rank 0 gives
    `tensor<f32>`. -#}
{% macro tensor(shape, dtype) -%}
tensor<{% for d in shape %}{{ "?" if d is none else d }}x{% endfor %}{{ dtype }}>
{%- endmacro %}

{#- Dynamic sizes. A parameter that is None is a dim known only at run time: kernels read it
    with dim() and hand it to every op that makes a tensor of that size (empty(),
    tensor.expand_shape's output_shape). -#}

{#- %name : index, dim `i` of `value` (a `type`). -#}
{% macro dim(name, value, i, type) -%}
%{{ name }}_i = arith.constant {{ i }} : index
  %{{ name }} = tensor.dim {{ value }}, %{{ name }}_i : {{ type }}
{%- endmacro %}

{#- `tensor.empty(...) : tensor<...>` of `shape`; each dynamic dim takes its SSA index value
    from `names` (by position; entries of static dims are ignored). -#}
{% macro empty(shape, dtype, names=[]) -%}
{% set dynamic = [] %}
{% for d in shape %}{% if d is none %}{% set _ = dynamic.append(names[loop.index0]) %}{% endif %}{% endfor %}
tensor.empty({{ dynamic|join(", ") }}) : {{ tensor(shape, dtype) }}
{%- endmacro %}

{#- %name: `value` (of `shape`, its dynamic dims named by `names` as in empty()) behind a
    barrier: IREE fuses neither its producer into its users nor it into them. The tie says
    its sizes, which IREE cannot read through the barrier. -#}
{% macro apart(name, value, shape, dtype, names=[]) -%}
{% set dynamic = [] %}
{% for d in shape %}{% if d is none %}{% set _ = dynamic.append(names[loop.index0]) %}{% endif %}{% endfor %}
%{{ name }}_barrier = "util.optimization_barrier"({{ value }}) : ({{ tensor(shape, dtype) }}) -> {{ tensor(shape, dtype) }}
  %{{ name }} = "flow.tensor.tie_shape"(%{{ name }}_barrier{% for n in dynamic %}, {{ n }}{% endfor %}) : ({{ tensor(shape, dtype) }}{% for n in dynamic %}, index{% endfor %}) -> {{ tensor(shape, dtype) }}
{%- endmacro %}

{#- `output_shape [...]` of a tensor.expand_shape: ints, or the SSA names of dynamic ones
    (by position in `names`). -#}
{% macro output_shape(shape, names=[]) -%}
[{% for d in shape %}{{ names[loop.index0] if d is none else d }}{{ ", " if not loop.last }}{% endfor %}]
{%- endmacro %}

{#- %name : f32, the element count `factors` multiply to: ints, and SSA index values (strings)
    for dynamic ones. A constant when every factor is static. -#}
{% macro count(name, factors) -%}
{% set ns = namespace(n=1, dynamic=[]) %}
{% for f in factors %}{% if f is string %}{% set ns.dynamic = ns.dynamic + [f] %}{% else %}{% set ns.n = ns.n * f %}{% endif %}{% endfor %}
{% if not ns.dynamic %}
%{{ name }} = arith.constant {{ "%.1f"|format(ns.n) }} : f32
{%- else %}
%{{ name }}_p0 = arith.constant {{ ns.n }} : index
{% for f in ns.dynamic %}
  %{{ name }}_p{{ loop.index }} = arith.muli %{{ name }}_p{{ loop.index0 }}, {{ f }} : index
{% endfor %}
  %{{ name }}_i = arith.index_cast %{{ name }}_p{{ ns.dynamic|length }} : index to i64
  %{{ name }} = arith.uitofp %{{ name }}_i : i64 to f32
{%- endif %}
{%- endmacro %}

{#- affine_map<(d0, d1) -> (d0, d1)> restricted to the dims in `keep` (default: all). -#}
{% macro map(rank, keep=None) -%}
affine_map<({% for i in range(rank) %}d{{ i }}{{ ", " if not loop.last }}{% endfor %}) -> ({% for i in (range(rank) if keep is none else keep) %}d{{ i }}{{ ", " if not loop.last }}{% endfor %})>
{%- endmacro %}

{% macro iterators(kinds) -%}
[{% for k in kinds %}"{{ k }}"{{ ", " if not loop.last }}{% endfor %}]
{%- endmacro %}

{#- Widen `%value` of `dtype` to f32 as `%name`; nothing to emit when it is already f32.
    Refer to the result with f32ref(name, value, dtype). -#}
{% macro to_f32(name, value, dtype) -%}
{% if dtype != "f32" %}%{{ name }} = arith.extf %{{ value }} : {{ dtype }} to f32{% endif %}
{%- endmacro %}

{% macro f32ref(name, value, dtype) -%}
%{{ name if dtype != "f32" else value }}
{%- endmacro %}

{#- Narrow f32 `%value` to `dtype` as `%name`; refer to it with narrowref(). -#}
{% macro from_f32(name, value, dtype) -%}
{% if dtype != "f32" %}%{{ name }} = arith.truncf %{{ value }} : f32 to {{ dtype }}{% endif %}
{%- endmacro %}

{% macro narrowref(name, value, dtype) -%}
%{{ name if dtype != "f32" else value }}
{%- endmacro %}

{#- An MLIR attribute for a Python value. -#}
{% macro attr(v) -%}
{% if v is sameas true %}true{% elif v is sameas false %}false{% elif v is none %}"?"{% elif v is string %}"{{ v }}"{% elif v is float %}{{ "%.17e"|format(v) }} : f64{% elif v is integer %}{{ v }} : i64{% else %}[{% for x in v %}{{ attr(x) }}{{ ", " if not loop.last }}{% endfor %}]{% endif %}
{%- endmacro %}

{#- The attributes that carry a composite's identity on its function. -#}
{% macro identity(params) -%}
attributes {boo.composite = "{{ composite }}", boo.version = {{ version }} : i64, boo.params = { {%- for k, v in params.items() %}{{ k }} = {{ attr(v) }}{{ ", " if not loop.last }}{% endfor -%} }}
{%- endmacro %}

{#- %name : tensor<Mx1x{dtype}> from the f32 row vector `value` : tensor<Mxf32>; `m` names
    M's SSA value when it is dynamic. -#}
{% macro row_stat(name, value, M, dtype, m="") -%}
%{{ name }}_empty = {{ empty([M, 1], dtype, [m]) }}
  %{{ name }} = linalg.generic {indexing_maps = [affine_map<(d0, d1) -> (d0)>, affine_map<(d0, d1) -> (d0, d1)>], iterator_types = ["parallel", "parallel"]}
      ins({{ value }} : {{ tensor([M], "f32") }}) outs(%{{ name }}_empty : {{ tensor([M, 1], dtype) }}) {
  ^bb0(%{{ name }}_in: f32, %{{ name }}_unused: {{ dtype }}):
    {{ from_f32(name ~ "_n", name ~ "_in", dtype) }}
    linalg.yield {{ narrowref(name ~ "_n", name ~ "_in", dtype) }} : {{ dtype }}
  } -> {{ tensor([M, 1], dtype) }}
{%- endmacro %}

{#- %name : tensor<Mxf32> from the stat tensor `value` : tensor<Mx1x{dtype}>; `m` as in
    row_stat. -#}
{% macro row_f32(name, value, M, dtype, m="") -%}
%{{ name }}_empty = {{ empty([M], "f32", [m]) }}
  %{{ name }} = linalg.generic {indexing_maps = [affine_map<(d0) -> (d0, 0)>, affine_map<(d0) -> (d0)>], iterator_types = ["parallel"]}
      ins({{ value }} : {{ tensor([M, 1], dtype) }}) outs(%{{ name }}_empty : {{ tensor([M], "f32") }}) {
  ^bb0(%{{ name }}_in: {{ dtype }}, %{{ name }}_unused: f32):
    {{ to_f32(name ~ "_f", name ~ "_in", dtype) }}
    linalg.yield {{ f32ref(name ~ "_f", name ~ "_in", dtype) }} : f32
  } -> {{ tensor([M], "f32") }}
{%- endmacro %}

{#- CPU tile sizes for one linalg op (IREE's DoubleTilingExpert pipeline): per loop, the
    workgroup tile, the vector tile of parallel loops, the vector tile of reductions. -#}
{% macro cpu_tiles(distribution, parallel, reduction) -%}
#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = {{ distribution }}, vector_common_parallel = {{ parallel }}, vector_reduction = {{ reduction }}>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>
{%- endmacro %}

{#- Wrap the caller's ops in one IREE dispatch region returning `values`, as %name#i. For
    row-local work (reductions feeding elementwise ops over the same rows) this keeps a row
    in cache between the passes instead of splitting them into dispatches. Generic syntax,
    since the flow dialect is unknown where the kernel is parsed. -#}
{% macro dispatch_region(name, values, types, dims=[]) -%}
%{{ name }}:{{ values|length }} = "flow.dispatch.region"({{ dims|join(", ") }}) <{operandSegmentSizes = array<i32: {{ dims|length }}, 0>}> ({
{{ caller() }}
    "flow.return"({{ values|join(", ") }}) : ({{ types|join(", ") }}) -> ()
  }, {
  }) : ({% for d in dims %}index{{ ", " if not loop.last }}{% endfor %}) -> ({{ types|join(", ") }})
{%- endmacro %}

{#- As cpu_tiles, with a fourth level: the vector tile of parallel loops inside the reduction
    loops. Tiled after the reductions, so a producer fused at the workgroup level (a row sum
    that a reduction loop consumes) is computed once per reduction step, not per tile. -#}
{% macro cpu_tiles_inner(distribution, parallel, reduction, inner) -%}
#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = {{ distribution }}, vector_common_parallel = {{ parallel }}, vector_reduction = {{ reduction }}, vector_inner_parallel = {{ inner }}>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>
{%- endmacro %}

{#- A CPU lowering config with only the vector tile of reductions, for an op fused into
    another's dispatch (which carries the compilation_info). -#}
{% macro cpu_reduction_tiles(reduction) -%}
#iree_cpu.lowering_config<vector_reduction = {{ reduction }}>
{%- endmacro %}

{#- A CPU lowering config with only the vector tile of parallel loops inside reductions: for
    the initial value of an accumulator that a reduction loop keeps in memory, which would
    otherwise be written in one vector as long as its untiled loops. -#}
{% macro cpu_inner_tiles(inner) -%}
#iree_cpu.lowering_config<vector_inner_parallel = {{ inner }}>
{%- endmacro %}

{#- Row reductions in lanes. IREE's CPU code for a reduction across a row can reduce its
    vector to a scalar at every step (it did for layer norm's two-result reduction: 2-3x
    slower than eager's kernel on AVX-512); over the row viewed as [N / L, L] with the L
    lanes a parallel dim, each step is one vector add, and the L partial sums are added
    once at the end (bench/RESULTS.md: layer norm, RMS norm and softmax forward gain; the
    softmax backward lost, and keeps its row form). `lanes(N)` is the L a kernel uses: on the CPU 8 where N is a multiple
    of 8 but not of 16, else 16; row_sums reduces the last N % L of a row (a vocabulary of
    50257) after the lanes (GPU reductions stay across the row). -#}
{% macro lanes(N) -%}
{{ 1 if target != "llvm-cpu" or N is none or N <= 16 else 8 if N % 16 and N % 8 == 0 else 16 }}
{%- endmacro %}

{#- %name: `value` (a [M, N] tensor of `dtype`) viewed as [M, N / L, L]. -#}
{% macro lane_view(name, value, M, N, L, dtype, m="") -%}
%{{ name }} = tensor.expand_shape {{ value }} [[0], [1, 2]] output_shape {{ output_shape([M, N // L, L], [m]) }} : {{ tensor([M, N], dtype) }} into {{ tensor([M, N // L, L], dtype) }}
{%- endmacro %}

{#- %name:k, the k f32 row sums [M] of the k lane sums `values` ([M, L] each); with
    `combine` = "arith.maximumf" and `init` -inf, row maxima. -#}
{% macro lane_sums(name, values, M, L, m="", combine="arith.addf", init="0.0") -%}
%{{ name }}_fz = arith.constant {{ init }} : f32
  %{{ name }}_empty = {{ empty([M], "f32", [m]) }}
  %{{ name }}_init = linalg.fill ins(%{{ name }}_fz : f32) outs(%{{ name }}_empty : {{ tensor([M], "f32") }}) -> {{ tensor([M], "f32") }}
  %{{ name }}:{{ values|length }} = linalg.generic {indexing_maps = [{% for v in values %}{{ map(2) }}, {% endfor %}{% for v in values %}{{ map(2, [0]) }}{{ ", " if not loop.last }}{% endfor %}], iterator_types = ["parallel", "reduction"]}
      ins({{ values|join(", ") }} : {% for v in values %}{{ tensor([M, L], "f32") }}{{ ", " if not loop.last }}{% endfor %})
      outs({% for v in values %}%{{ name }}_init{{ ", " if not loop.last }}{% endfor %} : {% for v in values %}{{ tensor([M], "f32") }}{{ ", " if not loop.last }}{% endfor %}) {
  ^bb0({% for v in values %}%{{ name }}_in{{ loop.index0 }}: f32, {% endfor %}{% for v in values %}%{{ name }}_acc{{ loop.index0 }}: f32{{ ", " if not loop.last }}{% endfor %}):
{% for v in values %}
    %{{ name }}_s{{ loop.index0 }} = {{ combine }} %{{ name }}_acc{{ loop.index0 }}, %{{ name }}_in{{ loop.index0 }} : f32
{% endfor %}
    linalg.yield {% for v in values %}%{{ name }}_s{{ loop.index0 }}{{ ", " if not loop.last }}{% endfor %} : {% for v in values %}f32{{ ", " if not loop.last }}{% endfor %}
  } -> ({% for v in values %}{{ tensor([M], "f32") }}{{ ", " if not loop.last }}{% endfor %})
{%- endmacro %}

{#- %name:k, k f32 sums over each row of [M, N] tensors: `full` ([M, N] values; `dtypes`,
    theirs), `rows` ([M] f32 values read once per row). The caller gives the body: a
    `^bb0` with one argument per full and row value, then k f32 accumulators, and a
    `linalg.yield` of the k new sums. In lanes when L > 1 (lanes()); the lanes' zero is
    %<name>_lz and the rows' %<name>_rz. `combine` and `init` as in lane_sums (row maxima:
    the body combines with arith.maximumf too). -#}
{% macro row_sums(name, full, dtypes, rows, k, M, N, L, m="", combine="arith.addf", init="0.0") -%}
%{{ name }}_zero = arith.constant {{ init }} : f32
{% set body = caller %}{#- inside a call block, `caller` is that block's own -#}
{% if L > 1 %}
{% set tail = N % L %}
{% set N = N - tail %}
{% set rows_size = m if M is none else M %}
{% for v in full %}
{% if tail %}
  %{{ name }}_h{{ loop.index0 }} = tensor.extract_slice {{ v }}[0, 0] [{{ rows_size }}, {{ N }}] [1, 1] : {{ tensor([M, N + tail], dtypes[loop.index0]) }} to {{ tensor([M, N], dtypes[loop.index0]) }}
  %{{ name }}_t{{ loop.index0 }} = tensor.extract_slice {{ v }}[0, {{ N }}] [{{ rows_size }}, {{ tail }}] [1, 1] : {{ tensor([M, N + tail], dtypes[loop.index0]) }} to {{ tensor([M, tail], dtypes[loop.index0]) }}
  {{ lane_view(name ~ "_v" ~ loop.index0, "%" ~ name ~ "_h" ~ loop.index0, M, N, L, dtypes[loop.index0], m) }}
{% else %}
  {{ lane_view(name ~ "_v" ~ loop.index0, v, M, N, L, dtypes[loop.index0], m) }}
{% endif %}
{% endfor %}
  %{{ name }}_le = {{ empty([M, L], "f32", [m]) }}
  %{{ name }}_lz = linalg.fill ins(%{{ name }}_zero : f32) outs(%{{ name }}_le : {{ tensor([M, L], "f32") }}) -> {{ tensor([M, L], "f32") }}
  %{{ name }}_l:{{ k }} = linalg.generic {indexing_maps = [{% for v in full %}{{ map(3) }}, {% endfor %}{% for v in rows %}{{ map(3, [0]) }}, {% endfor %}{% for i in range(k) %}{{ map(3, [0, 2]) }}{{ ", " if not loop.last }}{% endfor %}],
                                 iterator_types = ["parallel", "reduction", "parallel"]}
{% set values, types = [], [] %}
{% for v in full %}{% set _ = values.append("%" ~ name ~ "_v" ~ loop.index0) %}{% set _ = types.append(tensor([M, N // L, L], dtypes[loop.index0])) %}{% endfor %}
{% for v in rows %}{% set _ = values.append(v) %}{% set _ = types.append(tensor([M], "f32")) %}{% endfor %}
      ins({{ values|join(", ") }} : {{ types|join(", ") }})
      outs({% for i in range(k) %}%{{ name }}_lz{{ ", " if not loop.last }}{% endfor %} : {% for i in range(k) %}{{ tensor([M, L], "f32") }}{{ ", " if not loop.last }}{% endfor %}) {
{{ caller() }}
  } -> ({% for i in range(k) %}{{ tensor([M, L], "f32") }}{{ ", " if not loop.last }}{% endfor %})
{% set parts = [] %}
{% for i in range(k) %}{% set _ = parts.append("%" ~ name ~ "_l#" ~ i) %}{% endfor %}
  {{ lane_sums(name ~ "_main" if tail else name, parts, M, L, m, combine, init) }}
{% if tail %}
  {#- The row's last N % L values, reduced onto the lanes' sums. -#}
{% set tails, starts = [], [] %}
{% for v in full %}{% set _ = tails.append("%" ~ name ~ "_t" ~ loop.index0) %}{% endfor %}
{% for i in range(k) %}{% set _ = starts.append("%" ~ name ~ "_main#" ~ i) %}{% endfor %}
  {% call row_generic(name, tails, dtypes, rows, starts, M, tail) %}
{{ body() }}
  {% endcall %}
{% endif %}
{% else %}
  %{{ name }}_re = {{ empty([M], "f32", [m]) }}
  %{{ name }}_rz = linalg.fill ins(%{{ name }}_zero : f32) outs(%{{ name }}_re : {{ tensor([M], "f32") }}) -> {{ tensor([M], "f32") }}
  {% call row_generic(name, full, dtypes, rows, ["%" ~ name ~ "_rz"] * k, M, N) %}
{{ body() }}
  {% endcall %}
{% endif %}
{%- endmacro %}

{#- %name:k, the reduction over each row of [M, N] tensors `full` (`dtypes`, theirs) onto
    `starts` (k [M] f32 values), `rows` ([M] f32 values) read once per row; the caller
    gives the body, as row_sums's. -#}
{% macro row_generic(name, full, dtypes, rows, starts, M, N) -%}
%{{ name }}:{{ starts|length }} = linalg.generic {indexing_maps = [{% for v in full %}{{ map(2) }}, {% endfor %}{% for v in rows %}{{ map(2, [0]) }}, {% endfor %}{% for s in starts %}{{ map(2, [0]) }}{{ ", " if not loop.last }}{% endfor %}],
                               iterator_types = ["parallel", "reduction"]}
{% set types = [] %}
{% for v in full %}{% set _ = types.append(tensor([M, N], dtypes[loop.index0])) %}{% endfor %}
{% for v in rows %}{% set _ = types.append(tensor([M], "f32")) %}{% endfor %}
      ins({{ (full + rows)|join(", ") }} : {{ types|join(", ") }})
      outs({{ starts|join(", ") }} : {% for s in starts %}{{ tensor([M], "f32") }}{{ ", " if not loop.last }}{% endfor %}) {
{{ caller() }}
  } -> ({% for s in starts %}{{ tensor([M], "f32") }}{{ ", " if not loop.last }}{% endfor %})
{%- endmacro %}
