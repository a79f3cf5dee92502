{#- Attention forward: out = softmax(q k^T * scale + mask) v and its log-sum-exp, f32 inside.
    Params: B, H, Hk, L, S, D, Dv, dtype, scale, is_causal, mask_shape (4-D, or None),
    mask_rank (2 or 4). B, L and S may be dynamic (None); see _attention.mlir.
    IREE's own online_attention op (the flash loop: running row max and sum) computes the
    unnormalized output; the running max and sum give the log-sum-exp. The query heads are
    viewed as [Hk, G] so that a group of query heads shares one key head without copies.
    Loop dims of online_attention: d0 batch, d1 key head, d2 head in group, d3 query row,
    d4 head dim, d5 key row, d6 value dim. -#}
{% import "_helpers.mlir" as h with context %}
{% import "_attention.mlir" as a with context %}
{% set G = H // Hk %}
{% set Q = h.tensor([B, H, L, D], dtype) %}
{% set K = h.tensor([B, Hk, S, D], dtype) %}
{% set V = h.tensor([B, Hk, S, Dv], dtype) %}
{% set O = h.tensor([B, H, L, Dv], dtype) %}
{% set LSE = h.tensor([B, H, L], "f32") %}
{% set Q5 = h.tensor([B, Hk, G, L, D], dtype) %}
{% set ACC = h.tensor([B, Hk, G, L, Dv], "f32") %}
{% set ROW = h.tensor([B, Hk, G, L], "f32") %}
{% set O5 = h.tensor([B, Hk, G, L, Dv], dtype) %}
{% set has_mask = mask_shape is not none or is_causal %}
func.func private @{{ func_name }}(%q: {{ Q }}, %k: {{ K }}, %v: {{ V }}{% if mask_shape is not none %}, %mask: {{ a.mask_type() }}{% endif %})
    -> ({{ O }}, {{ LSE }}) {{ h.identity({"scale": scale, "is_causal": is_causal, "heads": H, "kv_heads": Hk, "masked": mask_shape is not none}) }} {
{{ a.dims(Q, K) }}
{% if 0 in [B, H, L] %}
  {#- An empty batch: IREE 3.13 crashes on reductions over zero-size dims. #}
  %out = {{ h.empty([B, H, L, Dv], dtype, [a.b, "", a.l, ""]) }}
  %lse = {{ h.empty([B, H, L], "f32", [a.b, "", a.l]) }}
  return %out, %lse : {{ O }}, {{ LSE }}
{% else %}
{% if target == "llvm-cpu" %}
{% set R = G * L if L is not none else none %}
{% set QR = h.tensor([B, Hk, R, D], dtype) %}
{% set PS = h.tensor([B, Hk, R, S], "f32") %}
{% set LR = h.tensor([B, Hk, R], "f32") %}
{% set OF = h.tensor([B, Hk, R, Dv], "f32") %}
{% set OR = h.tensor([B, Hk, R, Dv], dtype) %}
  {#- On the CPU, IREE 3.13's online_attention runs ~17x slower than eager (780 ms for 32
      heads of 512x64), so the scores are materialized per row block instead: contraction,
      row max, row sum of exp, then P v, with queries viewed as [B, Hk, G * L, D]. #}
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %scale = arith.constant {{ "%.17e"|format(scale) }} : f32
  {{ a.rows("qr", "%q", Q, [B, Hk, G, L, D], dtype, QR) }}
{% if has_mask %}
  {{ a.prepared_mask("bias") }}
  {{ a.row_bias("bias") }}
{% endif %}
  {{ a.contraction("qk", "%qr", QR, dtype, "d0, d1, d2, d4", "%k", K, dtype, "d0, d1, d3, d4", [B, Hk, R, S], [a.b, "", a.r, a.s]) }}
{% set ins_maps %}{{ h.map(4) }}{% if has_mask %}, {{ a.row_bias_map() }}{% endif %}{% endset %}
{% set ins_vals %}%qk{% if has_mask %}, %bias_rows{% endif %}{% endset %}
{% set ins_types %}{{ PS }}{% if has_mask %}, {{ a.row_bias_type() }}{% endif %}{% endset %}
{% macro logit() %}
    %ss = arith.mulf %s, %scale : f32
{% if has_mask %}
    %x = arith.addf %ss, %bi : f32
{% else %}
    %x = arith.addf %ss, %zero : f32
{% endif %}
{% endmacro %}
  %row_empty = {{ h.empty([B, Hk, R], "f32", [a.b, "", a.r]) }}
  %max0 = linalg.fill ins(%ninf : f32) outs(%row_empty : {{ LR }}) -> {{ LR }}
  %max = linalg.generic {indexing_maps = [{{ ins_maps }}, {{ h.map(4, [0, 1, 2]) }}], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins({{ ins_vals }} : {{ ins_types }}) outs(%max0 : {{ LR }}) {
  ^bb0(%s: f32{% if has_mask %}, %bi: f32{% endif %}, %m: f32):
{{ logit() }}
    %mn = arith.maximumf %m, %x : f32
    linalg.yield %mn : f32
  } -> {{ LR }}
  {#- exp(x - max), 0 in a row whose every key is masked (max = -inf). #}
  %ps_empty = {{ h.empty([B, Hk, R, S], "f32", [a.b, "", a.r, a.s]) }}
  %p = linalg.generic {indexing_maps = [{{ ins_maps }}, {{ h.map(4, [0, 1, 2]) }}, {{ h.map(4) }}], iterator_types = {{ h.iterators(["parallel"] * 4) }}}
      ins({{ ins_vals }}, %max : {{ ins_types }}, {{ LR }}) outs(%ps_empty : {{ PS }}) {
  ^bb0(%s: f32{% if has_mask %}, %bi: f32{% endif %}, %m: f32, %unused: f32):
{{ logit() }}
    %hidden = arith.cmpf oeq, %m, %ninf : f32
    %xm = arith.subf %x, %m : f32
    %e = math.exp %xm : f32
    %pe = arith.select %hidden, %zero, %e : f32
    linalg.yield %pe : f32
  } -> {{ PS }}
  %sum0 = linalg.fill ins(%zero : f32) outs(%row_empty : {{ LR }}) -> {{ LR }}
  %sum = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4, [0, 1, 2]) }}], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%p : {{ PS }}) outs(%sum0 : {{ LR }}) {
  ^bb0(%pi: f32, %acc: f32):
    %an = arith.addf %acc, %pi : f32
    linalg.yield %an : f32
  } -> {{ LR }}
  {{ a.contraction("pv", "%p", PS, "f32", "d0, d1, d2, d4", "%v", V, dtype, "d0, d1, d4, d3", [B, Hk, R, Dv], [a.b, "", a.r, ""]) }}
  %or_empty = {{ h.empty([B, Hk, R, Dv], dtype, [a.b, "", a.r, ""]) }}
  %or = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4, [0, 1, 2]) }}, {{ h.map(4) }}], iterator_types = {{ h.iterators(["parallel"] * 4) }}}
      ins(%pv, %sum : {{ OF }}, {{ LR }}) outs(%or_empty : {{ OR }}) {
  ^bb0(%acc: f32, %sm: f32, %unused: {{ dtype }}):
    %empty_row = arith.cmpf oeq, %sm, %zero : f32
    %div = arith.divf %acc, %sm : f32
    %o = arith.select %empty_row, %zero, %div : f32
    {{ h.from_f32("on", "o", dtype) }}
    linalg.yield {{ h.narrowref("on", "o", dtype) }} : {{ dtype }}
  } -> {{ OR }}
  %lser = linalg.generic {indexing_maps = [{{ h.map(3) }}, {{ h.map(3) }}, {{ h.map(3) }}], iterator_types = {{ h.iterators(["parallel"] * 3) }}}
      ins(%max, %sum : {{ LR }}, {{ LR }}) outs(%row_empty : {{ LR }}) {
  ^bb0(%m: f32, %sm: f32, %unused: f32):
    %empty_row = arith.cmpf oeq, %sm, %zero : f32
    %lg = math.log %sm : f32
    %l = arith.addf %m, %lg : f32
    %lse = arith.select %empty_row, %zero, %l : f32
    linalg.yield %lse : f32
  } -> {{ LR }}
  %out5 = tensor.expand_shape %or [[0], [1], [2, 3], [4]] output_shape {{ h.output_shape([B, Hk, G, L, Dv], [a.b, "", "", a.l, ""]) }} : {{ OR }} into {{ O5 }}
  %out = tensor.collapse_shape %out5 [[0], [1, 2], [3], [4]] : {{ O5 }} into {{ O }}
  %lse4 = tensor.expand_shape %lser [[0], [1], [2, 3]] output_shape {{ h.output_shape([B, Hk, G, L], [a.b, "", "", a.l]) }} : {{ LR }} into {{ ROW }}
  %lse = tensor.collapse_shape %lse4 [[0], [1, 2], [3]] : {{ ROW }} into {{ LSE }}
  return %out, %lse : {{ O }}, {{ LSE }}
{% else %}
  %zero = arith.constant 0.0 : f32
  %lowest = arith.constant -3.40282347e+38 : f32
  %scale = arith.constant {{ "%.17e"|format(scale) }} : f32
  %q5 = tensor.expand_shape %q [[0], [1, 2], [3], [4]] output_shape {{ h.output_shape([B, Hk, G, L, D], [a.b, "", "", a.l, ""]) }} : {{ Q }} into {{ Q5 }}
{% if has_mask %}
  {{ a.prepared_mask("bias") }}
{% endif %}
  %acc_empty = {{ h.empty([B, Hk, G, L, Dv], "f32", [a.b, "", "", a.l, ""]) }}
  %acc0 = linalg.fill ins(%zero : f32) outs(%acc_empty : {{ ACC }}) -> {{ ACC }}
  %row_empty = {{ h.empty([B, Hk, G, L], "f32", [a.b, "", "", a.l]) }}
  %max0 = linalg.fill ins(%lowest : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  %sum0 = linalg.fill ins(%zero : f32) outs(%row_empty : {{ ROW }}) -> {{ ROW }}
  {#- Generic syntax: the kernel is parsed where IREE's dialects are unknown. #}
  %fa:3 = "iree_linalg_ext.online_attention"(%q5, %k, %v, %scale{% if has_mask %}, %bias{% endif %}, %acc0, %max0, %sum0) <{indexing_maps = [
        affine_map<(d0, d1, d2, d3, d4, d5, d6) -> (d0, d1, d2, d3, d4)>,
        affine_map<(d0, d1, d2, d3, d4, d5, d6) -> (d0, d1, d5, d4)>,
        affine_map<(d0, d1, d2, d3, d4, d5, d6) -> (d0, d1, d5, d6)>,
        affine_map<(d0, d1, d2, d3, d4, d5, d6) -> ()>,
{% if has_mask %}
        affine_map<(d0, d1, d2, d3, d4, d5, d6) -> ({{ a.bias_dims({"b": "d0", "hk": "d1", "g": "d2", "m": "d3", "s": "d5"}) }})>,
{% endif %}
        affine_map<(d0, d1, d2, d3, d4, d5, d6) -> (d0, d1, d2, d3, d6)>,
        affine_map<(d0, d1, d2, d3, d4, d5, d6) -> (d0, d1, d2, d3)>,
        affine_map<(d0, d1, d2, d3, d4, d5, d6) -> (d0, d1, d2, d3)>]}> ({
  ^bb0(%score: f32):
    "iree_linalg_ext.yield"(%score) : (f32) -> ()
  }) : ({{ Q5 }}, {{ K }}, {{ V }}, f32{% if has_mask %}, {{ a.bias_type() }}{% endif %}, {{ ACC }}, {{ ROW }}, {{ ROW }}) -> ({{ ACC }}, {{ ROW }}, {{ ROW }})
  {#- A row that every key is masked from has sum 0: its output and log-sum-exp are 0, as
      eager's CPU kernel gives. The running max is kept in base 2 (IREE folds log2(e) into
      the scale), so the log-sum-exp is ln(2) * (max + log2(sum)). #}
  %out_empty = {{ h.empty([B, Hk, G, L, Dv], dtype, [a.b, "", "", a.l, ""]) }}
  %out5 = linalg.generic {indexing_maps = [{{ h.map(5) }}, {{ h.map(5, [0, 1, 2, 3]) }}, {{ h.map(5) }}], iterator_types = {{ h.iterators(["parallel"] * 5) }}}
      ins(%fa#0, %fa#2 : {{ ACC }}, {{ ROW }}) outs(%out_empty : {{ O5 }}) {
  ^bb0(%acc: f32, %sum: f32, %unused: {{ dtype }}):
    %empty_row = arith.cmpf oeq, %sum, %zero : f32
    %div = arith.divf %acc, %sum : f32
    %o = arith.select %empty_row, %zero, %div : f32
    {{ h.from_f32("on", "o", dtype) }}
    linalg.yield {{ h.narrowref("on", "o", dtype) }} : {{ dtype }}
  } -> {{ O5 }}
  %ln2 = arith.constant 0.69314718055994531 : f32
  %lse4 = linalg.generic {indexing_maps = [{{ h.map(4) }}, {{ h.map(4) }}, {{ h.map(4) }}], iterator_types = {{ h.iterators(["parallel"] * 4) }}}
      ins(%fa#1, %fa#2 : {{ ROW }}, {{ ROW }}) outs(%row_empty : {{ ROW }}) {
  ^bb0(%max: f32, %sum: f32, %unused: f32):
    %empty_row = arith.cmpf oeq, %sum, %zero : f32
    %log2sum = math.log2 %sum : f32
    %l2 = arith.addf %max, %log2sum : f32
    %l = arith.mulf %l2, %ln2 : f32
    %lse = arith.select %empty_row, %zero, %l : f32
    linalg.yield %lse : f32
  } -> {{ ROW }}
  %out = tensor.collapse_shape %out5 [[0], [1, 2], [3], [4]] : {{ O5 }} into {{ O }}
  %lse = tensor.collapse_shape %lse4 [[0], [1, 2], [3]] : {{ ROW }} into {{ LSE }}
  return %out, %lse : {{ O }}, {{ LSE }}
{% endif %}
{% endif %}
}
