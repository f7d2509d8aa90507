"""jaxforge: differentiable linear algebra, flex attention and collectives as JAX primitives.

Public surface::

    jf.attention(q, k, v, *, mask=None, score_mod=None, scale=None, softcap=None,
                 return_lse=False, implementation=None)
    jf.masks.causal(), sliding_window(w), document(segment_ids), prefix_lm(n), chunked(c), ...
    jf.linalg.svd(a, full_matrices=False, compute_uv=True, *, grad_eps=0.0)
    jf.linalg.lstsq(a, b, rcond=None) -> LstsqResult(solution, residuals, rank, singular_values)
"""

from jaxforge import lowering as _lowering  # noqa: F401  (registers every lowering, once)
from jaxforge.functional import linalg as linalg
from jaxforge.functional import masks as masks
from jaxforge.functional.attention import attention as attention

__all__ = ["attention", "linalg", "masks"]
__version__ = "0.1.0"
