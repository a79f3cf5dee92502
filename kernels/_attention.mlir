{#- Shared by the attention forward and backward: the additive mask (with the causal mask
    folded in) as an f32 bias over the dims it varies along. Import with:
      {% import "_attention.mlir" as a with context %}
    Roles: b batch, hk key head, g query head within its group, m query row, s key row.
    The bias always spans s; m too when the mask varies along it or is causal; b, and hk
    with g, when the mask varies along them. -#}
{% import "_helpers.mlir" as h with context %}
{% set G = H // Hk %}
{% set roles = [] %}
{% if mask_shape is not none and mask_shape[0] > 1 %}{% set _ = roles.append("b") %}{% endif %}
{% if mask_shape is not none and mask_shape[1] > 1 %}{% set _ = roles.extend(["hk", "g"]) %}{% endif %}
{% if is_causal or (mask_shape is not none and mask_shape[2] > 1) %}{% set _ = roles.append("m") %}{% endif %}
{% set _ = roles.append("s") %}
{% set sizes = {"b": B, "hk": Hk, "g": G, "m": L, "s": S} %}

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
{% set _ = index.append(p["m"] if mask_shape[2] > 1 else "0") %}
{% set _ = index.append(p["s"] if mask_shape[3] > 1 else "0") %}
{% endif %}
%{{ name }}_empty = tensor.empty() : {{ bias_type() }}
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
