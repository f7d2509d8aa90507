"""The linear-algebra primitives: svd_p and lstsq_p."""

from jaxforge.primitives.linalg.lstsq import lstsq_p, lstsq_reference
from jaxforge.primitives.linalg.svd import svd_p, svd_reference

__all__ = ["lstsq_p", "lstsq_reference", "svd_p", "svd_reference"]
