"""jaxforge: differentiable linear algebra, flex attention and collectives as JAX primitives.

Public surface::

    jf.linalg.svd(a, full_matrices=False, compute_uv=True, *, grad_eps=0.0)
    jf.linalg.lstsq(a, b, rcond=None) -> LstsqResult(solution, residuals, rank, singular_values)
"""

from jaxforge import lowering as _lowering  # noqa: F401  (registers every lowering, once)
from jaxforge.functional import linalg as linalg

__all__ = ["linalg"]
__version__ = "0.1.0"
