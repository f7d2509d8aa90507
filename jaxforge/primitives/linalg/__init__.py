"""The linear-algebra primitives: svd_p, lstsq_p and sylvester_p (polar's derivative)."""

from jaxforge.primitives.linalg.lstsq import lstsq_p, lstsq_reference
from jaxforge.primitives.linalg.svd import svd_p, svd_reference
from jaxforge.primitives.linalg.sylvester import sylvester_p, sylvester_reference

__all__ = ["lstsq_p", "lstsq_reference", "svd_p", "svd_reference", "sylvester_p", "sylvester_reference"]
