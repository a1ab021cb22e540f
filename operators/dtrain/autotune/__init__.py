"""DeepSpeed's own autotuner as a pipeline step: ``dtrain autotune`` and DeepSpeedAutotuneOperator.

    from dtrain.autotune.operator import DeepSpeedAutotuneOperator
"""
