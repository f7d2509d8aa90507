"""Small matrix helpers shared by the linear-algebra rules (batched over leading dims)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def mm(x, y):
    """Matrix product at full precision: rules must not silently drop to TF32/bf16 passes."""
    return jnp.matmul(x, y, precision=lax.Precision.HIGHEST)


def ct(x):
    """Conjugate transpose of the last two dims, ``xᴴ``."""
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def diag(v):
    """``diag(v)`` for a batch of vectors ``v`` of shape (..., k)."""
    return v[..., :, None] * jnp.eye(v.shape[-1], dtype=v.dtype)


def diagonal(x):
    return jnp.diagonal(x, axis1=-2, axis2=-1)


def reciprocal(x, eps: float):
    """``1/x``, or its Lorentzian broadening ``x/(x² + eps)`` when ``eps > 0``."""
    return x / (x * x + eps) if eps > 0 else 1.0 / x


def solve_triangular(r, y, *, adjoint: bool = False):
    """``R⁻¹ y``, or ``R⁻ᴴ y`` when ``adjoint``, for upper-triangular ``R``."""
    return lax.linalg.triangular_solve(
        r, y, left_side=True, lower=False, transpose_a=adjoint, conjugate_a=adjoint
    )
