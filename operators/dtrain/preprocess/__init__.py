"""Preprocess raw records once, before training, into memory-mappable shards.

    dtrain preprocess --transform mypkg.prep:transform --input s3://raw/2024-01-01/ --output /fsx/digits/2024-01-01

Engines (no Airflow): :mod:`dtrain.preprocess.runner` (parallel runner, finalize),
:mod:`dtrain.preprocess.shardfmt` (the shard format and its manifest checks),
:mod:`dtrain.preprocess.ragged` (variable-length fields: values + offsets),
:mod:`dtrain.preprocess.packing` (token sequences into fixed-length blocks). The Airflow
operators live in :mod:`dtrain.preprocess.operator`. Nothing heavy is imported by this package.
"""
