"""Default lowering of lstsq_p on every platform: Householder QR (LAPACK/cuSOLVER via jax.lax.linalg).

* m >= n: one QR of the augmented ``[A | b]`` gives ``R`` and ``c = Qᴴb`` without forming ``Q``;
  full rank: ``x = R⁻¹c``.
* m < n: ``Aᴴ = QR``; full rank: the minimum-norm ``x = QR⁻ᴴb``.
* Rank. numpy's rank counts ``s_i > rcond·s_1``. A cheap certificate settles it for most inputs:
  upper bounds ``β`` of the 2-norms give ``β(R)·β(R⁻¹) >= s_1/s_k``, so ``β(R)·β(R⁻¹) < 1/rcond``
  proves full rank. The bounds come in rungs (``CERTIFICATE_SQUARINGS``), each tighter and dearer
  than the last; only when some matrix of the batch lacks every certificate does a ``lax.cond``
  (decided on device) run the SVD of ``R`` for the exact rank and the truncated-SVD solution of
  the rank-deficient ones. A GPU kernel may take a rung along with the QR and the solve
  (``fused``); then a batch it certifies costs that one kernel.
* ``s``, the singular values of ``R`` (those of ``A``), are computed after the ``lax.cond`` and
  apart from it, so XLA drops them when the caller does not use them. They are tied to ``x`` so
  that no two LAPACK calls run side by side (see ``_ops.after``).
* ``R`` itself is returned with a real non-negative diagonal, for the derivative rule.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxforge.lowering.linalg._nonfinite import nonfinite_matrices, poison
from jaxforge.primitives.linalg._checks import real_dtype
from jaxforge.primitives.linalg._ops import (
    after,
    ct,
    mm,
    positive_diagonal,
    solve_triangular,
    truncated_pinv,
    upper_inverse,
    within_rank,
)
from jaxforge.primitives.linalg.lstsq import residuals as lstsq_residuals

# The certificate's rungs, as squarings of the Gram in ``_two_norm_bound``. -1, the Frobenius norms,
# costs no product past R⁻¹ and is within √k: it certifies nearly every float64 problem (1/rcond ~
# 1e12) and float32 ones of few columns (of condition κ, geometric spectrum, the bound is about
# κ·k/9: 8192 x 64 x 16 and 256 x 512 x 128 at κ = 100, where 1/rcond is 1.3e5 and 1.6e4). 0 costs
# one product per factor and certifies a 4096² float32 problem of condition 100 (its bound is 3.9x
# the norm there, 1/rcond is 2048); it first tries R's Gram with R⁻¹'s Frobenius norm, which
# suffices at 1024² (bound ~κ·2.7·10.5, 1/rcond 8192). 2 squares the Grams twice and is within
# k^(1/16), for what 0 cannot certify.
CERTIFICATE_SQUARINGS = (-1, 0, 2)


def qr_r_lapack(x):
    """The triangular factor of ``x = QR`` (LAPACK geqrf, Q never formed)."""
    return jnp.linalg.qr(x, mode="r")


def augmented_qr(qr_r=qr_r_lapack):
    """``factor(a, b) -> (R, Qᴴb)`` for ``A = QR`` (m >= n), both read off the triangular factor of
    ``[A | b]`` that ``qr_r`` computes (a kernel may replace LAPACK's)."""

    def factor(a, b):
        n = a.shape[-1]
        r_aug = qr_r(jnp.concatenate([a, b], axis=-1))
        return r_aug[..., :n, :n], r_aug[..., :n, n:]

    return factor


def lstsq_xla(a, b, *, rcond: float, factor=augmented_qr(), fused=None, fused_rung: int = 0):
    """The algorithm above. ``factor(a, b) -> (R, Qᴴb)`` serves m >= n. A GPU lowering may replace
    it, or pass a kernel that also solves and takes the rung ``fused_rung`` itself:
    ``fused(a, b, rcond) -> (R, x, certified, factor)``, with R of ``A`` (of ``Aᴴ`` when wide),
    ``x`` the full-rank solution, ``certified`` per matrix, and the ``factor`` (or None when wide)
    that the tighter rungs use where the batch is not certified."""
    *batch, m, n = a.shape
    k = min(m, n)
    if k == 0:  # numpy: x = 0, rank 0, no singular values
        x = jnp.zeros((*batch, n, b.shape[-1]), a.dtype)
        no_values, no_factor = jnp.zeros((*batch, 0), real_dtype(a.dtype)), jnp.zeros((*batch, 0, 0), a.dtype)
        return x, lstsq_residuals(a, b, x), jnp.zeros(batch, jnp.int32), no_values, no_factor
    if fused is None:
        r, *solvers = _factored(a, b, factor)
        rank, x = _rank_and_solution(r, *solvers, rcond=rcond, rungs=_rungs(k, rcond))
    else:
        r, x_fused, certified, factor = fused(a, b, rcond)

        def uncertified():  # the matrices the kernel certified keep its solution: each its own, as alone
            rank, x = _rank_and_solution(*_factored(a, b, factor), rcond=rcond, rungs=_rungs(k, rcond, past=fused_rung))
            return rank, jnp.where(certified[..., None, None], x_fused, x)

        rank, x = lax.cond(jnp.all(certified), lambda: (jnp.full(batch, k, jnp.int32), x_fused), uncertified)
    s = lax.linalg.svd(after(r, x), compute_uv=False)
    bad_a = nonfinite_matrices(r)  # a NaN or Inf in A reaches R; reading R keeps s out of x's way
    x = poison(bad_a | nonfinite_matrices(x), x)
    r = poison(bad_a, positive_diagonal(r))
    return x, lstsq_residuals(a, b, x), jnp.where(bad_a, 0, rank), poison(bad_a, s), r


def _rungs(k: int, rcond: float, past: int | None = None) -> tuple[int, ...]:
    """The rungs worth trying on a k x k factor, cheapest first: those tighter than ``past`` (the rung
    a fused kernel took), less the Frobenius one where it cannot certify: ``‖R‖_F·‖R⁻¹‖_F >= k``
    (Cauchy–Schwarz on the singular values), so not when ``k·rcond >= 1`` (float32 4096², 16384 x 1024)."""
    tighter = [squarings for squarings in CERTIFICATE_SQUARINGS if past is None or squarings > past]
    return tuple(squarings for squarings in tighter if squarings >= 0 or k * rcond < 1)


def _factored(a, b, factor):
    """``(R, solve, factors, rhs)``: the triangular factor; ``solve(R)``, the full-rank solution;
    ``factors(U_R, V_Rᴴ) -> (U, V)``, the thin SVD of ``A`` from that of ``R``, with ``U`` in the basis
    of ``rhs``, the right-hand side the truncated solution applies it to."""
    m, n = a.shape[-2:]
    if m >= n:
        r, c = factor(a, b)
        return r, lambda r: solve_triangular(r, c), lambda ur, vhr: (ur, ct(vhr)), c  # A = Q·(U_R S V_Rᴴ)
    q, r = lax.linalg.qr(ct(a), full_matrices=False)
    r = after(r, q)  # the solves wait for orgqr (see _ops.after)
    solve = lambda r: mm(q, solve_triangular(r, b, adjoint=True))  # noqa: E731
    return r, solve, lambda ur, vhr: (ct(vhr), mm(q, ur)), b  # A = V_R S (Q U_R)ᴴ


def _rank_and_solution(r, solve, factors, rhs, *, rcond: float, rungs):
    """numpy's rank and solution: full rank where a rung certifies the whole batch, else by the SVD."""
    *batch, k = r.shape[:-1]

    def exact():
        u_r, s_r, vh_r = lax.linalg.svd(r, full_matrices=False)
        rank = jnp.sum(s_r > rcond * s_r[..., :1], axis=-1, dtype=jnp.int32)
        full = (rank == k)[..., None, None]
        u_small, v = factors(u_r, vh_r)
        keep = within_rank(rank, k)
        truncated = truncated_pinv(u_small, s_r, v, keep, rhs)
        full_rank = solve(jnp.where(full, r, jnp.eye(k, dtype=r.dtype)))  # finite where unselected
        return rank, jnp.where(full, full_rank, truncated)

    r_inv = upper_inverse(r)
    certified = lambda: (jnp.full(batch, k, jnp.int32), solve(r))  # noqa: E731
    proven = lambda bound: jnp.all(bound * rcond < 1)  # noqa: E731  (False for NaN)

    def certify(rungs):
        if not rungs:
            return exact()
        if rungs[0] < 0:
            return lax.cond(jnp.all(_full_rank_certificate(r, r_inv, rcond, -1)), certified, lambda: certify(rungs[1:]))
        return gram_rungs(rungs)

    def gram_rungs(rungs):
        # R's Gram first, with R⁻¹'s Frobenius norm; R⁻¹'s Gram only if that half fails. (Choosing per
        # matrix the factor whose Frobenius norm is looser, by power steps, cost as much as the Gram
        # it saved: 1024² float32 89 ms, against 83 with both Grams and 75 with this order.)
        (scale_r, y_r), (scale_inv, y_inv) = _unit_frobenius(r), _unit_frobenius(r_inv)
        gram_r = _upper_gram(y_r)

        def both(rungs):
            gram_inv = _upper_gram(y_inv)

            def tighter(rungs):
                if not rungs:
                    return exact()
                bound = _gram_bound(scale_r, gram_r, rungs[0]) * _gram_bound(scale_inv, gram_inv, rungs[0])
                return lax.cond(proven(bound), certified, lambda: tighter(rungs[1:]))

            return tighter(rungs)

        if rungs[0] == 0:
            half = _gram_bound(scale_r, gram_r, 0) * scale_inv
            return lax.cond(proven(half), certified, lambda: both(rungs))
        return both(rungs)

    return certify(rungs)


def _full_rank_certificate(r, r_inv, rcond: float, squarings: int):
    """``β(R)·β(R⁻¹) < 1/rcond``, which implies ``s_k > rcond·s_1``; False for NaN or singular R.

    ``β`` (``_two_norm_bound``) is within a factor ``k^(1/(4·2^squarings))`` of the 2-norm: with 2
    squarings 1.5 at k = 1024, so a float32 16384 x 1024 problem of condition 100 is certified
    (``1/rcond`` = 512) and skips the SVD.
    """
    return _two_norm_bound(r, squarings) * _two_norm_bound(r_inv, squarings) * rcond < 1


def _two_norm_bound(x, squarings: int):
    """An upper bound of ``‖X‖₂`` within a factor ``k^(1/(4m))``, ``m = 2^squarings``, for an
    upper-triangular ``X`` (R or R⁻¹): ``‖X‖_F`` (within ``√k``) for ``squarings = -1``, else from
    the Gram of ``X`` (``_gram_bound``)."""
    if squarings < 0:
        return _scaled_frobenius(x)
    scale, y = _unit_frobenius(x)
    return _gram_bound(scale, _upper_gram(y), squarings)


def _gram_bound(scale, g, squarings: int):
    """The bound of ``_two_norm_bound`` from ``G = YᴴY``, ``Y = X/scale``, ``scale = ‖X‖_F``.

    ``‖X‖₂² = λ_max(XᴴX) <= ‖(XᴴX)^m‖_F^(1/m) <= k^(1/(2m)) λ_max(XᴴX)``. ``G^m`` comes from
    repeated squaring of ``G`` scaled to unit Frobenius norm, the scales kept as factors
    (``‖G^m‖_F^(1/m) = c₀ c₁^(1/2) ⋯ c_p^(1/2^p)``), so nothing overflows.
    """
    frobenius = lambda y: jnp.sqrt(jnp.sum(jnp.abs(y) ** 2, axis=(-2, -1)))  # noqa: E731
    bound, exponent = jnp.ones_like(scale), 1.0
    for _ in range(squarings):
        c = frobenius(g)
        bound, exponent = bound * c**exponent, exponent / 2
        g = g / c[..., None, None].astype(g.dtype)
        g = mm(g, g)
    return scale * jnp.sqrt(bound * frobenius(g) ** exponent)


def _unit_frobenius(x):
    """``(‖X‖_F, X/‖X‖_F)``."""
    scale = _scaled_frobenius(x)
    return scale, x / scale[..., None, None].astype(x.dtype)


def _scaled_frobenius(x):
    """``‖X‖_F`` as ``p·‖X/p‖_F``, ``p = max|x_ij|``: the squares of float32 entries beyond ~1e±19
    would overflow or underflow, fail the certificate and send a well-conditioned problem to the SVD."""
    peak = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)
    peak = jnp.where(peak > 0, peak, 1)  # a zero X stays zero; NaN stays NaN (never certified)
    return peak[..., 0, 0] * jnp.sqrt(jnp.sum((jnp.abs(x) / peak) ** 2, axis=(-2, -1)))


# Order below which the Gram of a triangular factor is one product. Above it, the products of its
# blocks skip the zero one; two levels take 3/8 of the flops of one product. Measured (2 cores,
# float32, the Gram alone, best of 10): 1024² 14.4 -> 7.3 ms, 2048² 137 -> 44.
_GRAM_BLOCK = 256


def _upper_gram(y):
    """``YᴴY`` for an upper-triangular ``Y = [[A, B], [0, C]]``: ``[[AᴴA, AᴴB], [BᴴA, BᴴB + CᴴC]]``,
    the diagonal blocks' Grams by recursion."""
    k = y.shape[-1]
    if k <= _GRAM_BLOCK:
        return mm(ct(y), y)
    h = k // 2
    a, b, c = y[..., :h, :h], y[..., :h, h:], y[..., h:, h:]
    ab = mm(ct(a), b)
    top = jnp.concatenate([_upper_gram(a), ab], axis=-1)
    bottom = jnp.concatenate([ct(ab), mm(ct(b), b) + _upper_gram(c)], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)
