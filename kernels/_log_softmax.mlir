{#- _log_softmax: see _softmax_forward.mlir. -#}
{% include "_softmax_forward.mlir" %}
