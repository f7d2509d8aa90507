"""Every lowering of sylvester_p is registered here, and nowhere else: one, in jax operations (its
products are few and small beside the SVD that gives ``s`` and ``v``)."""

from jaxforge.lowering.linalg.sylvester.xla import sylvester_xla
from jaxforge.primitives import _core
from jaxforge.primitives.linalg.sylvester import sylvester_p

# name -> implementation in jax ops; tests run every entry against the reference.
IMPLEMENTATIONS = {"xla": sylvester_xla}

_core.register_lowering(sylvester_p, sylvester_xla)
