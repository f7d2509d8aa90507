"""Every lowering of lstsq_p is registered here, and nowhere else."""

from jaxforge.lowering.linalg.lstsq.cuda import lstsq_cuda
from jaxforge.lowering.linalg.lstsq.xla import lstsq_xla
from jaxforge.primitives import _core
from jaxforge.primitives.linalg.lstsq import lstsq_p

# name -> implementation in jax ops; tests run every entry against the reference.
IMPLEMENTATIONS = {"xla": lstsq_xla}

_core.register_lowering(lstsq_p, lstsq_xla)
_core.register_lowering(lstsq_p, lstsq_cuda, platform="cuda", partitionable=True)
