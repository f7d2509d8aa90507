"""CholeskyQR2 for tall float32/complex64 least squares: ``(R, Qᴴb)`` from matrix products in
double width (float64/complex128).

``R₁ = chol(AᴴA)``, ``Q₁ = A R₁⁻¹``, then once more on ``Q₁``: ``R₂ = chol(Q₁ᴴQ₁)``,
``Q = Q₁ R₂⁻¹``, ``R = R₂ R₁`` and ``Qᴴb``. Two Grams and two triangular solves of the whole
matrix: work a GPU does at its matrix-product rate, where Householder QR (geqrf) is a sequence of
panel steps. The Grams, factors and solves run in float64 from float32 data (products of float32
numbers are exact there), so the first Cholesky holds for condition numbers up to about 1e7 and
the second iteration makes Q orthogonal to float64 precision; R and Qᴴb are rounded to float32
at the end (Yamamoto et al., 2015, with the float64 Gram of issue 3).

Where a Cholesky breaks down (NaN: numerically singular), or R₁'s diagonal spans more than
``MAX_DIAGONAL_RATIO`` (too ill-conditioned for float32 data), a ``lax.cond`` decided on device
also runs ``fallback`` (Householder), whose factors those matrices take; the others keep
CholeskyQR2's, so that each matrix's factors are those it gets alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxforge.primitives.linalg._ops import ct, mm

MAX_DIAGONAL_RATIO = 1e6  # max |r_ii| / min |r_ii| of R₁ (a lower bound of κ(A)) still factored here


def cholesky_qr2(fallback):
    """``factor(a, b) -> (R, Qᴴb)`` for float32/complex64 ``a`` (m >= n) by CholeskyQR2, else
    ``fallback(a, b)``."""

    def factor(a, b):
        def finish(q, r):  # Qᴴb from the double-width Q
            return r.astype(a.dtype), mm(ct(q), b.astype(_wide(b.dtype))).astype(b.dtype)

        return _cholesky_qr2(a, finish, lambda: fallback(a, b))

    return factor


def cholesky_qr2_thin(fallback):
    """``qr(x) -> (Q, R)``, the thin QR of a tall float32/complex64 ``x`` by CholeskyQR2, else
    ``fallback(x)``: svd's QR before a large method (``cuda.thin_qr``)."""

    def qr(x):
        return _cholesky_qr2(x, lambda q, r: (q.astype(x.dtype), r.astype(x.dtype)), lambda: fallback(x))

    return qr


def _cholesky_qr2(x, finish, fallback):
    """``finish(Q, R)`` of the double-width CholeskyQR2 of ``x`` for the matrices whose ``R₁`` passes
    the checks above, ``fallback()``'s for the others (decided on device: the fallback runs only
    where some matrix needs it)."""
    with jax.enable_x64(True):
        x64 = x.astype(_wide(x.dtype))
        r1 = _cholesky_r(x64)
        diagonal = jnp.abs(jnp.diagonal(r1, axis1=-2, axis2=-1))
        usable = jnp.all(jnp.isfinite(r1), axis=(-2, -1)) & (
            jnp.max(diagonal, axis=-1) <= MAX_DIAGONAL_RATIO * jnp.min(diagonal, axis=-1)
        )

        def cholesky():  # Q₁ = x R₁⁻¹, R₂ = chol(Q₁ᴴQ₁), Q = Q₁R₂⁻¹, R = R₂R₁
            q1 = _right_solve(x64, r1)
            r2 = _cholesky_r(q1)
            return finish(_right_solve(q1, r2), mm(r2, r1))

        def mixed():
            return jax.tree.map(lambda c, f: jnp.where(usable[..., None, None], c, f), cholesky(), fallback())

        return lax.cond(jnp.all(usable), cholesky, mixed)


def _wide(dtype):
    return jnp.complex128 if jnp.issubdtype(dtype, jnp.complexfloating) else jnp.float64


def _cholesky_r(x):
    """The upper factor of ``xᴴx = RᴴR`` (NaN where the Gram is not numerically positive definite)."""
    return ct(jnp.linalg.cholesky(mm(ct(x), x)))


def _right_solve(x, r):
    """``x R⁻¹`` for upper-triangular ``R``."""
    return lax.linalg.triangular_solve(r, x, left_side=False, lower=False)
