"""Transforms over primitives: ``shard`` (shard_map-style), ``remat`` (checkpoint policies).

Sharding of our primitives: under ``jit`` with batch-sharded inputs, every lowering partitions along
batch dims — the default lowerings are jax operations the partitioner splits; under explicit
sharding ``primitives._core`` gives the outputs batch-sharded avals and runs the lowering with the
mesh axes automatic.
"""

from jaxforge.transforms import remat
from jaxforge.transforms.shard import default_mesh, shard

__all__ = ["default_mesh", "remat", "shard"]
