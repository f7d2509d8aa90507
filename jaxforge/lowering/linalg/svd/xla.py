"""Default lowering of svd_p on every platform: LAPACK on CPU, cuSOLVER on GPU (via jax.lax.linalg)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxforge.lowering.linalg._nonfinite import poison
from jaxforge.primitives.linalg._checks import real_dtype


def svd_xla(a, *, full_matrices: bool, compute_uv: bool, grad_eps: float, algorithm=None):
    """``algorithm``: jax's ``SvdAlgorithm`` (cuSOLVER's gesvd, gesvdj or gesvdp on GPU), None for its default."""
    del grad_eps  # derivatives only
    if a.size == 0:
        return _empty_svd(a, full_matrices=full_matrices, compute_uv=compute_uv)
    if not compute_uv:
        return (lax.linalg.svd(a, full_matrices=False, compute_uv=False, algorithm=algorithm),)
    u, s, vh = lax.linalg.svd(a, full_matrices=full_matrices, compute_uv=True, algorithm=algorithm)
    bad = ~jnp.all(jnp.isfinite(s), axis=-1)  # LAPACK leaves s non-finite for NaN/Inf input
    return tuple(poison(bad, x) for x in (s, u, vh))


def _empty_svd(a, *, full_matrices: bool, compute_uv: bool):
    """numpy's answer for a zero-size matrix: no singular values, identity complements."""
    *batch, m, n = a.shape
    k = min(m, n)
    s = jnp.zeros((*batch, k), real_dtype(a.dtype))
    if not compute_uv:
        return (s,)
    cols_u, rows_v = (m, n) if full_matrices else (k, k)
    u = jnp.broadcast_to(jnp.eye(m, cols_u, dtype=a.dtype), (*batch, m, cols_u))
    vh = jnp.broadcast_to(jnp.eye(rows_v, n, dtype=a.dtype), (*batch, rows_v, n))
    return s, u, vh
