"""Default lowering of lstsq_p on every platform: Householder QR (LAPACK/cuSOLVER via jax.lax.linalg).

Full rank: x = R⁻¹Qᴴb (m >= n, A = QR) or x = QR⁻ᴴb (m < n, Aᴴ = QR, the minimum-norm solution).
The rank is read off the singular values of R (those of A), so it matches numpy; the truncated-SVD
branch runs only when some matrix in the batch is rank-deficient, chosen on device by lax.cond.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxforge.primitives.linalg._checks import real_dtype
from jaxforge.primitives.linalg._ops import ct, mm, solve_triangular
from jaxforge.primitives.linalg.lstsq import residuals as lstsq_residuals


def lstsq_xla(a, b, *, rcond: float):
    *batch, m, n = a.shape
    k = min(m, n)
    if k == 0:  # numpy: x = 0, rank 0, no singular values
        x = jnp.zeros((*batch, n, b.shape[-1]), a.dtype)
        return x, lstsq_residuals(a, b, x), jnp.zeros(batch, jnp.int32), jnp.zeros((*batch, 0), real_dtype(a.dtype))
    tall = m >= n
    q, r = lax.linalg.qr(a if tall else ct(a), full_matrices=False)
    s = lax.linalg.svd(r, compute_uv=False)
    rank = jnp.sum(s > rcond * s[..., :1], axis=-1, dtype=jnp.int32)
    full = rank == k

    def full_rank_solution(r):
        if tall:
            return solve_triangular(r, mm(ct(q), b))
        return mm(q, solve_triangular(r, b, adjoint=True))

    def mixed_rank_solution():
        r_safe = jnp.where(full[..., None, None], r, jnp.eye(k, dtype=r.dtype))
        return jnp.where(full[..., None, None], full_rank_solution(r_safe), _truncated_solution())

    def _truncated_solution():
        ur, s_, vhr = lax.linalg.svd(r, full_matrices=False)
        keep = jnp.arange(k) < rank[..., None]
        s_inv = jnp.where(keep, 1 / jnp.where(keep, s_, 1), 0).astype(a.dtype)[..., :, None]
        if tall:  # A = (Q U_R) S V_Rᴴ
            return mm(ct(vhr), s_inv * mm(ct(mm(q, ur)), b))
        return mm(mm(q, ur), s_inv * mm(vhr, b))  # A = V_R S (Q U_R)ᴴ

    x = lax.cond(jnp.all(full), lambda: full_rank_solution(r), mixed_rank_solution)
    return x, lstsq_residuals(a, b, x), rank, s
