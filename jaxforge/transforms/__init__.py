"""Transforms over primitives: the ``shard`` transform and the sharding rules of custom calls.

Empty until the collectives issue. Today the linalg primitives partition along batch dims through
their default lowering (jax's LAPACK/cuSOLVER calls carry batch-sharding rules) and, under explicit
sharding, through ``primitives._core.batch_sharded_avals``.
"""
