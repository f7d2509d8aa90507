"""Every lowering of svd_p is registered here, and nowhere else."""

from jaxforge.lowering.linalg.svd.cuda import svd_cuda
from jaxforge.lowering.linalg.svd.xla import svd_xla
from jaxforge.primitives import _core
from jaxforge.primitives.linalg.svd import svd_p

# name -> implementation in jax ops; tests run every entry against the reference.
IMPLEMENTATIONS = {"xla": svd_xla}

_core.register_lowering(svd_p, svd_xla)
_core.register_lowering(svd_p, svd_cuda, platform="cuda", partitionable=True)
