r"""SVD through the polar decomposition: :math:`A = U_p H`, :math:`H = V \Lambda V^H`, so
:math:`A = (U_p V)\,\Lambda\,V^H` — matrix products, QRs, Choleskys and one symmetric eigensolver,
which a GPU runs far faster than the bidiagonalisation of gesvd (issue 3: large square SVDs).

:math:`U_p` comes from QDWH (Nakatsukasa, Bai & Gygi 2010; Nakatsukasa & Higham 2013): from
:math:`X_0 = A/α` with :math:`α \ge \|A\|_2` and singular values in :math:`[ℓ_0, 1]`,

.. math::

    X_{k+1} = \tfrac{b}{c} X_k + \big(a - \tfrac{b}{c}\big) X_k (I + c X_k^H X_k)^{-1},
    \qquad ℓ_{k+1} = ℓ_k \frac{a + b ℓ_k^2}{1 + c ℓ_k^2},

with :math:`(a, b, c)` the dynamically weighted Halley coefficients of :math:`ℓ_k`. Every singular
value in :math:`[ℓ_k, 1]` moves into :math:`[ℓ_{k+1}, 1]`, so :math:`X_k \to U_p`. The inverse is
taken by a QR of :math:`[\sqrt{c} X_k; I]` while ``c`` is large (stable at any conditioning) and
by a Cholesky of :math:`I + c X_k^H X_k` once :math:`c \le 100`.

Here :math:`ℓ_0` is the dtype's epsilon, so the coefficients, the iteration count (4 in float32,
6 in float64) and the choice of QR or Cholesky are fixed at trace time: no loop waits on the
device. A singular value below :math:`ℓ_0 α` (below rounding of the largest) may not reach 1; its
eigenvalue in :math:`H = U_p^H A` is then too small by at most itself, within the SVD's backward
error, and a final QR of :math:`U_p V` (columns in descending order) restores orthonormal columns,
which also completes ``u`` for rank-deficient input.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxforge.primitives.linalg._ops import ct, diagonal, mm

CHOLESKY_MAX_C = 100.0  # the Cholesky form's error grows with c (Nakatsukasa & Higham, §4)


def svd_polar(a, *, compute_uv: bool = True):
    """``(s, u, vh)`` (thin) or ``(s,)`` of ``a`` (..., m, n), m >= n, by QDWH and a Hermitian
    eigensolver (cuda.large_svd takes a wide matrix through its adjoint)."""
    u_p = qdwh(a)
    h = mm(ct(u_p), a)
    h = (h + ct(h)) / 2
    if not compute_uv:
        return (jnp.sort(jnp.abs(jnp.linalg.eigvalsh(h)), axis=-1)[..., ::-1],)
    eigenvalues, v = jnp.linalg.eigh(h)
    order = jnp.argsort(-jnp.abs(eigenvalues), axis=-1)  # descending |λ|; λ < 0 only below rounding
    eigenvalues = jnp.take_along_axis(eigenvalues, order, axis=-1)
    v = jnp.take_along_axis(v, order[..., None, :], axis=-1)
    sign = jnp.where(eigenvalues < 0, -1, 1).astype(a.dtype)
    u = _orthonormal_columns(mm(u_p, v) * sign[..., None, :])
    return jnp.abs(eigenvalues), u, ct(v)


def qdwh(a):
    """The unitary polar factor ``U_p`` of ``a`` (..., m, n), m >= n: ``a = U_p H``, H Hermitian PSD."""
    m, n = a.shape[-2:]
    norm = _frobenius_norm(a)
    x = a / jnp.where(norm > 0, norm, 1)[..., None, None].astype(a.dtype)
    eye = jnp.eye(n, dtype=a.dtype)
    for coefficient_a, b, c in qdwh_coefficients(np.finfo(a.dtype).eps):
        if c > CHOLESKY_MAX_C:
            stacked = jnp.concatenate([math.sqrt(c) * x, jnp.broadcast_to(eye, x.shape[:-2] + (n, n))], axis=-2)
            q, _ = jnp.linalg.qr(stacked)
            update = mm(q[..., :m, :], ct(q[..., m:, :])) / math.sqrt(c)  # = x (I + c xᴴx)⁻¹
        else:
            lower = jnp.linalg.cholesky(lax.broadcast_to_rank(eye, x.ndim) + c * mm(ct(x), x))
            update = _right_solve_gram(x, lower)
        x = (b / c) * x + (coefficient_a - b / c) * update
    return x


def qdwh_coefficients(lower_bound: float) -> list[tuple[float, float, float]]:
    """``(a, b, c)`` of each QDWH step from ``ℓ₀ = lower_bound`` until ``1 - ℓ`` is below it."""
    steps, ell = [], lower_bound
    while 1 - ell >= lower_bound:
        d = (4 * (1 - ell**2) / ell**4) ** (1 / 3)
        a = math.sqrt(1 + d) + math.sqrt(8 - 4 * d + 8 * (2 - ell**2) / (ell**2 * math.sqrt(1 + d))) / 2
        b = (a - 1) ** 2 / 4
        c = a + b - 1
        steps.append((a, b, c))
        ell = ell * (a + b * ell**2) / (1 + c * ell**2)
    return steps


def _frobenius_norm(a):
    """``‖a‖_F`` of each matrix without overflow (scaled by its largest entry)."""
    largest = jnp.max(jnp.abs(a), axis=(-2, -1))
    largest = jnp.where(largest > 0, largest, 1)
    scaled = a / largest[..., None, None].astype(a.dtype)
    return largest * jnp.sqrt(jnp.sum(jnp.abs(scaled) ** 2, axis=(-2, -1)))


def _right_solve_gram(x, lower):
    """``x (L Lᴴ)⁻¹`` for lower-triangular ``L``: two triangular solves from the right."""
    y = lax.linalg.triangular_solve(lower, x, left_side=False, lower=True, transpose_a=True, conjugate_a=True)
    return lax.linalg.triangular_solve(lower, y, left_side=False, lower=True)


def _orthonormal_columns(y):
    """``Q·sign(diag R)`` for ``y = QR``: ``y`` itself where its columns are orthonormal, completed
    to orthonormal columns where some are short or zero (rank-deficient input)."""
    q, r = jnp.linalg.qr(y)
    return q * jnp.where(jnp.real(diagonal(r)) < 0, -1, 1).astype(y.dtype)[..., None, :]
