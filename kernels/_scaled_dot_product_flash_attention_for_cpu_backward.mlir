{#- Attention backward from the saved log-sum-exp, f32 inside:
      P = exp(q k^T * scale + mask - lse),  delta = rowsum(dO * O),
      dS = P * (dO v^T - delta) * scale,
      dq = dS k,  dk = dS^T q,  dv = P^T dO.
    Params as the forward's (B, L and S may be dynamic). The query heads of a group share one key head: queries are
    viewed as [B, Hk, G * L, D] (row r is query row r mod L of head r floordiv L in the
    group), so the group's rows sum into dk and dv inside the contractions. -#}
{% import "_helpers.mlir" as h with context %}
{% import "_attention.mlir" as a with context %}
{% set G = H // Hk %}
{% set R = G * L if L is not none else none %}
{% set has_mask = mask_shape is not none or is_causal %}
{% set Q = h.tensor([B, H, L, D], dtype) %}
{% set K = h.tensor([B, Hk, S, D], dtype) %}
{% set V = h.tensor([B, Hk, S, Dv], dtype) %}
{% set O = h.tensor([B, H, L, Dv], dtype) %}
{% set LSE = h.tensor([B, H, L], "f32") %}
{% set QR = h.tensor([B, Hk, R, D], dtype) %}
{% set OR = h.tensor([B, Hk, R, Dv], dtype) %}
{% set LR = h.tensor([B, Hk, R], "f32") %}
{% set PS = h.tensor([B, Hk, R, S], "f32") %}
{% set KF = h.tensor([B, Hk, S, D], "f32") %}
{% set VF = h.tensor([B, Hk, S, Dv], "f32") %}
{% set QF = h.tensor([B, Hk, R, D], "f32") %}
func.func private @{{ func_name }}(%do: {{ O }}, %q: {{ Q }}, %k: {{ K }}, %v: {{ V }}, %o: {{ O }}, %lse: {{ LSE }}{% if mask_shape is not none %}, %mask: {{ a.mask_type() }}{% endif %})
    -> ({{ Q }}, {{ K }}, {{ V }}) {{ h.identity({"scale": scale, "is_causal": is_causal, "heads": H, "kv_heads": Hk, "masked": mask_shape is not none}) }} {
  %zero = arith.constant 0.0 : f32
{{ a.dims(Q, K) }}
{% if 0 in [B, H, L] %}
  {#- No query rows: IREE 3.13 crashes on reductions over zero-size dims. dk and dv are 0. #}
  %zero_t = arith.constant 0.0 : {{ dtype }}
  %dq = {{ h.empty([B, H, L, D], dtype, [a.b, "", a.l, ""]) }}
  %dk_empty = {{ h.empty([B, Hk, S, D], dtype, [a.b, "", a.s, ""]) }}
  %dk = linalg.fill ins(%zero_t : {{ dtype }}) outs(%dk_empty : {{ K }}) -> {{ K }}
  %dv_empty = {{ h.empty([B, Hk, S, Dv], dtype, [a.b, "", a.s, ""]) }}
  %dv = linalg.fill ins(%zero_t : {{ dtype }}) outs(%dv_empty : {{ V }}) -> {{ V }}
{% else %}
  %scale = arith.constant {{ "%.17e"|format(scale) }} : f32
{% set x = {"q": "%q", "k": "%k", "v": "%v", "do": "%do", "o": "%o", "lse": "%lse"} %}
{% if none in [B, L, S] %}
  {#- With dynamic sizes, IREE 3.13 computed dv wrongly for key rows past 64 when the
      caller's permute producing dO was fused into this kernel's contractions (BERT's
      backward, with its sizes read from its tensors: lower._sizes_read_from_shapes). Each
      input but the mask (whose dims vary with mask_shape; not seen to need it) is a tensor
      of its own here; the caller's producers run before. #}
{% for name, shape, names, dt in [("q", [B, H, L, D], [a.b, "", a.l, ""], dtype), ("k", [B, Hk, S, D], [a.b, "", a.s, ""], dtype),
                                  ("v", [B, Hk, S, Dv], [a.b, "", a.s, ""], dtype), ("do", [B, H, L, Dv], [a.b, "", a.l, ""], dtype),
                                  ("o", [B, H, L, Dv], [a.b, "", a.l, ""], dtype), ("lse", [B, H, L], [a.b, "", a.l], "f32")] %}
  {{ h.apart(name ~ "_apart", x[name], shape, dt, names) }}
{% set _ = x.update({name: "%" ~ name ~ "_apart"}) %}
{% endfor %}
{% endif %}
  {{ a.rows("qr", x.q, Q, [B, Hk, G, L, D], dtype, QR) }}
  {{ a.rows("dor", x.do, O, [B, Hk, G, L, Dv], dtype, OR) }}
  {{ a.rows("or", x.o, O, [B, Hk, G, L, Dv], dtype, OR) }}
  {{ a.rows("lser", x.lse, LSE, [B, Hk, G, L], "f32", LR) }}
{% if has_mask %}
  {{ a.prepared_mask("bias") }}
  {{ a.row_bias("bias") }}
{% endif %}
  {#- delta = rowsum(dO * O) #}
  %row_empty = {{ h.empty([B, Hk, R], "f32", [a.b, "", a.r]) }}
  %row_zero = linalg.fill ins(%zero : f32) outs(%row_empty : {{ LR }}) -> {{ LR }}
  %delta = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4) }}, {{ h.map(4, [0, 1, 2]) }}], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%dor, %or : {{ OR }}, {{ OR }}) outs(%row_zero : {{ LR }}) {
  ^bb0(%gi: {{ dtype }}, %oi: {{ dtype }}, %acc: f32):
    {{ h.to_f32("gf", "gi", dtype) }}
    {{ h.to_f32("of", "oi", dtype) }}
    %p = arith.mulf {{ h.f32ref("gf", "gi", dtype) }}, {{ h.f32ref("of", "oi", dtype) }} : f32
    %s = arith.addf %acc, %p : f32
    linalg.yield %s : f32
  } -> {{ LR }}
  {#- P = exp(q k^T * scale + bias - lse), loops (b, hk, r, s, d) #}
  {{ a.contraction("qk", "%qr", QR, dtype, "d0, d1, d2, d4", x.k, K, dtype, "d0, d1, d3, d4", [B, Hk, R, S], [a.b, "", a.r, a.s]) }}
  %ps_empty = {{ h.empty([B, Hk, R, S], "f32", [a.b, "", a.r, a.s]) }}
  %p = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4, [0, 1, 2]) }}{% if has_mask %}, {{ a.row_bias_map() }}{% endif %}, {{ h.map(4) }}], iterator_types = {{ h.iterators(["parallel"] * 4) }}}
      ins(%qk, %lser{% if has_mask %}, %bias_rows{% endif %} : {{ PS }}, {{ LR }}{% if has_mask %}, {{ a.row_bias_type() }}{% endif %}) outs(%ps_empty : {{ PS }}) {
  ^bb0(%s: f32, %l: f32{% if has_mask %}, %bi: f32{% endif %}, %unused: f32):
    %ss = arith.mulf %s, %scale : f32
{% if has_mask %}
    %sb = arith.addf %ss, %bi : f32
    %x = arith.subf %sb, %l : f32
{% else %}
    %x = arith.subf %ss, %l : f32
{% endif %}
    %e = math.exp %x : f32
    linalg.yield %e : f32
  } -> {{ PS }}
  {#- dS = P * (dO v^T - delta) * scale, loops (b, hk, r, s, e) #}
  {{ a.contraction("dp", "%dor", OR, dtype, "d0, d1, d2, d4", x.v, V, dtype, "d0, d1, d3, d4", [B, Hk, R, S], [a.b, "", a.r, a.s]) }}
  {#- With data tiling, IREE 3.13 computes dS wrongly when it fuses the elementwise op below
      with dP's contraction in the packed layout and the rows are not multiples of its tiles:
      dynamic sizes, and static grouped-query rows (G * L = 46 at H = 4, Hk = 2, L = 23: dq
      and dk off by 9 where they peak at 1.8). The barrier keeps dP unpacked; the tie says
      its sizes. #}
  {{ h.apart("dp_tied", "%dp", [B, Hk, R, S], "f32", [a.b, "", a.r, a.s]) }}
  %ds = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4) }}, {{ h.map(4, [0, 1, 2]) }}, {{ h.map(4) }}], iterator_types = {{ h.iterators(["parallel"] * 4) }}}
      ins(%p, %dp_tied, %delta : {{ PS }}, {{ PS }}, {{ LR }}) outs(%ps_empty : {{ PS }}) {
  ^bb0(%pi: f32, %dpi: f32, %di: f32, %unused: f32):
    %t = arith.subf %dpi, %di : f32
    %u = arith.mulf %pi, %t : f32
    %w = arith.mulf %u, %scale : f32
    linalg.yield %w : f32
  } -> {{ PS }}
  {#- dv = P^T dO, loops (b, hk, s, e, r) #}
  {{ a.contraction("dvf", "%p", PS, "f32", "d0, d1, d4, d2", "%dor", OR, dtype, "d0, d1, d4, d3", [B, Hk, S, Dv], [a.b, "", a.s, ""]) }}
  {#- dq = dS k, loops (b, hk, r, d, s) #}
  {{ a.contraction("dqf", "%ds", PS, "f32", "d0, d1, d2, d4", x.k, K, dtype, "d0, d1, d4, d3", [B, Hk, R, D], [a.b, "", a.r, ""]) }}
  {#- dk = dS^T q, loops (b, hk, s, d, r) #}
  {{ a.contraction("dkf", "%ds", PS, "f32", "d0, d1, d4, d2", "%qr", QR, dtype, "d0, d1, d4, d3", [B, Hk, S, D], [a.b, "", a.s, ""]) }}
  {{ a.narrow("dqr", "%dqf", QF, [B, Hk, R, D], [a.b, "", a.r, ""]) }}
  {{ a.narrow("dk", "%dkf", KF, [B, Hk, S, D], [a.b, "", a.s, ""]) }}
  {{ a.narrow("dv", "%dvf", VF, [B, Hk, S, Dv], [a.b, "", a.s, ""]) }}
  %dq5 = tensor.expand_shape %dqr [[0], [1], [2, 3], [4]] output_shape {{ h.output_shape([B, Hk, G, L, D], [a.b, "", "", a.l, ""]) }} : {{ QR }} into {{ h.tensor([B, Hk, G, L, D], dtype) }}
  %dq = tensor.collapse_shape %dq5 [[0], [1, 2], [3], [4]] : {{ h.tensor([B, Hk, G, L, D], dtype) }} into {{ Q }}
{% endif %}
  return %dq, %dk, %dv : {{ Q }}, {{ K }}, {{ V }}
}
