"""Small matrix helpers shared by the linear-algebra rules (batched over leading dims)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxforge.primitives import _core


def mm(x, y):
    """Matrix product at full precision: rules must not silently drop to TF32/bf16 passes."""
    return jnp.matmul(x, y, precision=lax.Precision.HIGHEST)


def ct(x):
    """Conjugate transpose of the last two dims, ``xᴴ``."""
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def diag(v):
    """``diag(v)`` for a batch of vectors ``v`` of shape (..., k)."""
    return v[..., :, None] * lax.broadcast_to_rank(jnp.eye(v.shape[-1], dtype=v.dtype), v.ndim + 1)


def diagonal(x):
    return jnp.diagonal(x, axis1=-2, axis2=-1)


def reciprocal(x, eps: float):
    """``1/x``, or its Lorentzian broadening ``x/(x² + eps)`` when ``eps > 0``."""
    return x / (x * x + eps) if eps > 0 else 1.0 / x


def solve_triangular(r, y, *, adjoint: bool = False):
    """``R⁻¹ y``, or ``R⁻ᴴ y`` when ``adjoint``, for upper-triangular ``R``."""
    solve = functools.partial(lax.linalg.triangular_solve, left_side=True, lower=False, transpose_a=adjoint, conjugate_a=adjoint)
    return _core.under_automatic_axes(solve, y, r, y)  # its derivative in R masks R unsharded


# Order up to which a triangular inverse is one solve against the identity. Above it the inverse
# is built by halves, whose off-diagonal block is two matrix products: faster than a solve with as
# many right-hand sides (2 cores, float32: 1024² 15.8 -> 9.8 ms, 2048² 95 -> 49), as accurate.
_INVERSE_BLOCK = 128


def upper_inverse(r):
    """``R⁻¹`` for upper-triangular ``R = [[A, B], [0, C]]``: ``[[A⁻¹, −A⁻¹BC⁻¹], [0, C⁻¹]]``, the
    diagonal blocks' inverses by recursion, each solve after the last (see ``after``), the corner
    entries of the result after them all."""
    k = r.shape[-1]
    if k <= _INVERSE_BLOCK:
        return solve_triangular(r, jnp.zeros_like(r) + lax.broadcast_to_rank(jnp.eye(k, dtype=r.dtype), r.ndim))  # keeps r's batch sharding
    h = k // 2
    a_inv = upper_inverse(r[..., :h, :h])
    c_inv = upper_inverse(after_on_cpu(r[..., h:, h:], a_inv[..., -1:, -1:]))  # after A⁻¹'s last solve
    a_inv = after_on_cpu(a_inv, c_inv[..., -1:, -1:])  # so R⁻¹[0, 0], which a later `after` reads, waits too
    top = jnp.concatenate([a_inv, -mm(a_inv, mm(r[..., :h, h:], c_inv))], axis=-1)
    bottom = jnp.concatenate([jnp.zeros_like(r[..., h:, :h]), c_inv], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def after(x, dep):
    """``x``, with a data dependency on ``dep`` (same leading batch dims) so that it is computed later.

    jaxlib 0.10's CPU LAPACK kernels wait on the XLA thread pool for their batch tasks; two of them
    running side by side can block every worker of a small pool for good (seen on 2 cores). Rules
    and lowerings chain their LAPACK calls through this tie so that none of them run concurrently.
    It adds ``0 * f(dep)`` with ``f`` finite, which XLA cannot fold away (0·x is not 0 for NaN).
    """
    if 0 in dep.shape[-2:]:  # nothing computed to wait for (an lstsq with no right-hand side)
        return x
    d = jnp.abs(dep[..., :1, :1]).astype(jnp.finfo(x.dtype).dtype)
    tie = 0 * jnp.where(jnp.isnan(d), 0, jnp.minimum(d, 1))
    return x + tie.astype(x.dtype)


def after_on_cpu(x, dep):
    """``after(x, dep)`` where the program runs on CPU, where the deadlock ``after`` avoids lives;
    ``x`` elsewhere, which leaves XLA free to drop ``dep``'s computation when nothing else uses it."""
    return lax.platform_dependent(x, dep, cpu=after, default=lambda x, _: x)


def truncated_pinv(u, s, v, keep, y):
    """``V diag(1/s) Uᴴ y`` over the kept triplets: the truncated pseudo-inverse of ``U diag(s) Vᴴ``.

    Dropped singular values never meet a division, so no inf reaches derivatives.
    """
    return mm(v, kept_reciprocal(s, keep).astype(y.dtype)[..., :, None] * mm(ct(u), y))


def pinv_tangent(a, p, da):
    """Golub and Pereyra's ``dA⁺`` where the rank is locally constant, from ``P = A⁺`` and ``A``:
    ``−P dA P + PPᴴ dAᴴ (I − AP) + (I − PA) dAᴴ PᴴP``. Products of ``P`` and ``A`` alone, so a
    rule that calls itself for ``P``'s tangent gives derivatives of every order, also where
    singular values repeat."""
    ph, dah = ct(p), ct(da)
    left = mm(mm(p, ph), dah)  # A⁺A⁺ᴴ dAᴴ, then times (I − AA⁺)
    right = mm(dah, mm(ph, p))  # dAᴴ A⁺ᴴA⁺, after (I − A⁺A)
    return -mm(mm(p, da), p) + left - mm(mm(left, a), p) + right - mm(p, mm(a, right))


def within_rank(rank, k: int):
    """``(..., k)`` booleans: index ``i < rank``, the singular triplets a rank keeps."""
    return lax.broadcast_to_rank(jnp.arange(k, dtype=rank.dtype), rank.ndim + 1) < rank[..., None]


def kept_reciprocal(s, keep):
    """``1/s`` where ``keep``, 0 elsewhere: dropped values never meet a division."""
    return jnp.where(keep, 1 / jnp.where(keep, s, 1), 0)


def positive_diagonal(r):
    """``D R`` with ``D`` diagonal unitary such that ``diag(D R)`` is real and non-negative: for a full
    rank ``A = QR``, the unique triangular factor of the thin QR (the Cholesky factor of ``AᴴA``)."""
    d = jnp.diagonal(r, axis1=-2, axis2=-1)
    magnitude = jnp.abs(d)
    phase = jnp.where(magnitude == 0, 1, jnp.conj(d) / jnp.where(magnitude == 0, 1, magnitude).astype(d.dtype))
    return phase[..., :, None] * r
