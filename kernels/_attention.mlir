{#- Shared by the attention forward and backward: the additive mask (with the causal mask
    folded in) as an f32 bias over the dims it varies along. Import with:
      {% import "_attention.mlir" as a with context %}
    Roles: b batch, hk key head, g query head within its group, m query row, s key row.
    The bias always spans s; m too when the mask varies along it or is causal; b, and hk
    with g, when the mask varies along them.
    B, L and S may be dynamic (None), as may the mask's dims along them: dims() reads them
    from %q and %k as %dim_b, %dim_l and %dim_s, with %dim_r = G * L (the query rows of a
    group) and %dim_bh = B * Hk (the contractions' batch). -#}
{% import "_helpers.mlir" as h with context %}
{% set G = H // Hk %}
{% set b, l, s = "%dim_b", "%dim_l", "%dim_s" %}
{% set r = l if G == 1 else "%dim_r" %}
{% set bh = b if Hk == 1 else "%dim_bh" %}
{% set roles = [] %}
{% if mask_shape is not none and mask_shape[0] != 1 %}{% set _ = roles.append("b") %}{% endif %}
{% if mask_shape is not none and mask_shape[1] != 1 %}{% set _ = roles.extend(["hk", "g"]) %}{% endif %}
{% set by_head = mask_shape is not none and mask_shape[1] != 1 %}
{#- m joins g (when query heads are grouped, or the bias spans heads) so that the two fold
    into query rows r = g * L + m without a floordiv/mod map (IREE cannot tile those). -#}
{% if is_causal or (mask_shape is not none and mask_shape[2] != 1) or by_head %}{% set _ = roles.append("m") %}{% endif %}
{% if "m" in roles and not by_head and G > 1 %}{% set _ = roles.insert(roles.index("m"), "g") %}{% endif %}
{% set _ = roles.append("s") %}
{% set sizes = {"b": B, "hk": Hk, "g": G, "m": L, "s": S} %}
{% set names = {"b": b, "hk": "", "g": "", "m": l, "s": s} %}
{% set bias_shape, bias_names = [], [] %}
{% for role in roles %}{% set _ = bias_shape.append(sizes[role]) %}{% set _ = bias_names.append(names[role]) %}{% endfor %}
{#- The bias's dims in the loops (b, hk, r, s) over query rows r = g * L + m of a group
    (the row bias folds g into m). -#}
{% set row_roles = [] %}
{% for role in roles %}{% if role != "g" %}{% set _ = row_roles.append(role) %}{% endif %}{% endfor %}
{% set row_dims = {"b": "d0", "hk": "d1", "m": "d2", "s": "d3"} %}
{% set row_sizes = {"b": B, "hk": Hk, "m": (G * L if L is not none else none) if "g" in roles else L, "s": S} %}

{#- The dynamic sizes, from %q (a `qt`) and %k (a `kt`). -#}
{% macro dims(qt, kt) -%}
{% if B is none %}
  {{ h.dim("dim_b", "%q", 0, qt) }}
{% if Hk != 1 %}
  %dim_bh_k = arith.constant {{ Hk }} : index
  %dim_bh = arith.muli %dim_b, %dim_bh_k : index
{% endif %}
{% endif %}
{% if L is none %}
  {{ h.dim("dim_l", "%q", 2, qt) }}
{% if G != 1 %}
  %dim_r_g = arith.constant {{ G }} : index
  %dim_r = arith.muli %dim_l, %dim_r_g : index
{% endif %}
{% endif %}
{% if S is none %}
  {{ h.dim("dim_s", "%k", 2, kt) }}
{% endif %}
{%- endmacro %}

{% macro row_bias_map() -%}
affine_map<(d0, d1, d2, d3) -> ({% for role in row_roles %}{{ row_dims[role] }}{{ ", " if not loop.last }}{% endfor %})>
{%- endmacro %}

{% macro row_bias_type() -%}
{% set shape = [] %}{% for role in row_roles %}{% set _ = shape.append(row_sizes[role]) %}{% endfor %}{{ h.tensor(shape, "f32") }}
{%- endmacro %}

{#- %name_rows: the bias %name over query rows of a group. -#}
{% macro row_bias(name) -%}
{% if "g" in roles %}
{% set groups = [] %}
{% for role in roles %}{% if role == "m" %}{% set _ = groups[-1].append(loop.index0) %}{% else %}{% set _ = groups.append([loop.index0]) %}{% endif %}{% endfor %}
%{{ name }}_rows = tensor.collapse_shape %{{ name }} {{ groups }} : {{ bias_type() }} into {{ row_bias_type() }}
{% else %}
%{{ name }}_rows = tensor.cast %{{ name }} : {{ bias_type() }} to {{ row_bias_type() }}
{% endif %}
{%- endmacro %}

{% macro mask_type() -%}
{{ h.tensor(mask_shape[4 - mask_rank:], dtype) }}
{%- endmacro %}

{% macro bias_type() -%}
{% set shape = [] %}{% for role in roles %}{% set _ = shape.append(sizes[role]) %}{% endfor %}{{ h.tensor(shape, "f32") }}
{%- endmacro %}

{#- The bias's dims named in the caller's loop space: names maps each role to a dim. -#}
{% macro bias_dims(names) -%}
{% for role in roles %}{{ names[role] }}{{ ", " if not loop.last }}{% endfor %}
{%- endmacro %}

{#- %name: the f32 bias; from %mask (when given) and the causal rule (key row > query row
    gets -inf). -#}
{% macro prepared_mask(name) -%}
{% set r = roles|length %}
{% set p = {} %}
{% for role in roles %}{% set _ = p.update({role: "d" ~ loop.index0}) %}{% endfor %}
{% set index = [] %}
{% if mask_shape is not none %}
{% if mask_rank == 4 %}
{% set _ = index.append(p["b"] if "b" in p else "0") %}
{% set _ = index.append(p["hk"] ~ " * " ~ G ~ " + " ~ p["g"] if "hk" in p else "0") %}
{% endif %}
{% set _ = index.append(p["m"] if mask_shape[2] != 1 else "0") %}
{% set _ = index.append(p["s"] if mask_shape[3] != 1 else "0") %}
{% endif %}
%{{ name }}_empty = {{ h.empty(bias_shape, "f32", bias_names) }}
  %{{ name }} = linalg.generic {indexing_maps = [{% if mask_shape is not none %}affine_map<({% for i in range(r) %}d{{ i }}{{ ", " if not loop.last }}{% endfor %}) -> ({{ index|join(", ") }})>, {% endif %}{{ h.map(r) }}],
                                iterator_types = {{ h.iterators(["parallel"] * r) }}}
      {% if mask_shape is not none %}ins(%mask : {{ mask_type() }}) {% endif %}outs(%{{ name }}_empty : {{ bias_type() }}) {
  ^bb0({% if mask_shape is not none %}%{{ name }}_in: {{ dtype }}, {% endif %}%{{ name }}_unused: f32):
{% if mask_shape is not none %}
    {{ h.to_f32(name ~ "_f", name ~ "_in", dtype) }}
{% set value = h.f32ref(name ~ "_f", name ~ "_in", dtype) %}
{% else %}
    %{{ name }}_f = arith.constant 0.0 : f32
{% set value = "%" ~ name ~ "_f" %}
{% endif %}
{% if is_causal %}
    %{{ name }}_m = linalg.index {{ roles.index("m") }} : index
    %{{ name }}_s = linalg.index {{ roles.index("s") }} : index
    %{{ name }}_future = arith.cmpi ugt, %{{ name }}_s, %{{ name }}_m : index
    %{{ name }}_ninf = arith.constant 0xFF800000 : f32
    %{{ name }}_v = arith.select %{{ name }}_future, %{{ name }}_ninf, {{ value }} : f32
    linalg.yield %{{ name }}_v : f32
{% else %}
    linalg.yield {{ value }} : f32
{% endif %}
  } -> {{ bias_type() }}
{%- endmacro %}

{#- A contraction over the last loop of 5: out(d0, d1, d2, d3) += x * y, where d0 and d1 are
    batch dims of every operand (xmap and ymap start with "d0, d1"). They are collapsed into one
    before the contraction: IREE's CPU backend tiles a one-batch contraction like a batch
    matmul, but runs one with two batch dims about 8x slower. `out_shape` is [B, Hk, ., .]
    (f32), with the SSA names of its dynamic dims in `out_names`. -#}
{% macro contraction(name, x, xt, xdt, xmap, y, yt, ydt, ymap, out_shape, out_names) -%}
{% set out_t = h.tensor(out_shape, "f32") %}
{% set xs = xt[7:-1].split("x") %}{% set ys = yt[7:-1].split("x") %}
{% set batch = none if out_shape[0] is none else out_shape[0] * out_shape[1] %}
{% set x3 = "tensor<" ~ (batch if batch is not none else "?") ~ "x" ~ xs[2:]|join("x") ~ ">" %}
{% set y3 = "tensor<" ~ (batch if batch is not none else "?") ~ "x" ~ ys[2:]|join("x") ~ ">" %}
{% set o3 = h.tensor([batch, out_shape[2], out_shape[3]], "f32") %}
{% set xm = [] %}{% for d in xmap.split(", ")[2:] %}{% set _ = xm.append("d" ~ ((d[1:]|int) - 1)) %}{% endfor %}
{% set ym = [] %}{% for d in ymap.split(", ")[2:] %}{% set _ = ym.append("d" ~ ((d[1:]|int) - 1)) %}{% endfor %}
%{{ name }}_x3 = tensor.collapse_shape {{ x }} [[0, 1], [2], [3]] : {{ xt }} into {{ x3 }}
  %{{ name }}_y3 = tensor.collapse_shape {{ y }} [[0, 1], [2], [3]] : {{ yt }} into {{ y3 }}
  %{{ name }}_empty = {{ h.empty([batch, out_shape[2], out_shape[3]], "f32", [bh, out_names[2], out_names[3]]) }}
  %{{ name }}_zero = linalg.fill ins(%zero : f32) outs(%{{ name }}_empty : {{ o3 }}) -> {{ o3 }}
  %{{ name }}_3 = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, {{ xm|join(", ") }})>, affine_map<(d0, d1, d2, d3) -> (d0, {{ ym|join(", ") }})>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>],
                           iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%{{ name }}_x3, %{{ name }}_y3 : {{ x3 }}, {{ y3 }}) outs(%{{ name }}_zero : {{ o3 }}) {
  ^bb0(%{{ name }}_x: {{ xdt }}, %{{ name }}_y: {{ ydt }}, %{{ name }}_acc: f32):
    {{ h.to_f32(name ~ "_xf", name ~ "_x", xdt) }}
    {{ h.to_f32(name ~ "_yf", name ~ "_y", ydt) }}
    %{{ name }}_p = arith.mulf {{ h.f32ref(name ~ "_xf", name ~ "_x", xdt) }}, {{ h.f32ref(name ~ "_yf", name ~ "_y", ydt) }} : f32
    %{{ name }}_s = arith.addf %{{ name }}_acc, %{{ name }}_p : f32
    linalg.yield %{{ name }}_s : f32
  } -> {{ o3 }}
  %{{ name }} = tensor.expand_shape %{{ name }}_3 [[0, 1], [2], [3]] output_shape {{ h.output_shape(out_shape, out_names) }} : {{ o3 }} into {{ out_t }}
{%- endmacro %}
{#- %name: [B, H, L, ...] `value` as [B, Hk, G * L, ...] (shape5: [B, Hk, G, L, ...]). -#}
{% macro rows(name, value, t, shape5, dt, out_t) -%}
%{{ name }}_5 = tensor.expand_shape {{ value }} [[0], [1, 2], [3]{% if shape5|length == 5 %}, [4]{% endif %}] output_shape {{ h.output_shape(shape5, [b, "", "", l, ""]) }} : {{ t }} into {{ h.tensor(shape5, dt) }}
  %{{ name }} = tensor.collapse_shape %{{ name }}_5 [[0], [1], [2, 3]{% if shape5|length == 5 %}, [4]{% endif %}] : {{ h.tensor(shape5, dt) }} into {{ out_t }}
{%- endmacro %}
{#- %name: `value` (f32, a `t`) narrowed to dtype, of `shape` (dynamic dims named by `names`). -#}
{% macro narrow(name, value, t, shape, names) -%}
{% set out_t = h.tensor(shape, dtype) %}
%{{ name }}_empty = {{ h.empty(shape, dtype, names) }}
  %{{ name }} = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4) }}], iterator_types = {{ h.iterators(["parallel"] * 4) }}}
      ins({{ value }} : {{ t }}) outs(%{{ name }}_empty : {{ out_t }}) {
  ^bb0(%{{ name }}_in: f32, %{{ name }}_unused: {{ dtype }}):
    {{ h.from_f32(name ~ "_n", name ~ "_in", dtype) }}
    linalg.yield {{ h.narrowref(name ~ "_n", name ~ "_in", dtype) }} : {{ dtype }}
  } -> {{ out_t }}
{%- endmacro %}
