{#- _log_softmax_backward_data: see _softmax_backward.mlir. -#}
{% include "_softmax_backward.mlir" %}
