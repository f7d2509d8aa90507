r"""lstsq: the minimum-norm least-squares solution :math:`x = A^+ b` as a primitive.

``lstsq_p`` binds ``a`` of shape ``(*batch, m, n)`` and ``b`` of shape ``(*batch, m, k)`` (the same
batch dims and dtype) with the static cut-off ``rcond`` and returns ``(x, residuals, rank, s)``:

* ``x`` ``(*batch, n, k)``: :math:`A_r^+ b`, where :math:`A_r` keeps the singular values
  :math:`s_i > \mathrm{rcond}\cdot s_1` (numpy's rule);
* ``residuals`` ``(*batch, k)``: :math:`\lVert b - A x\rVert^2` per column when ``m > n``, else
  ``(*batch, 0)``. numpy returns an empty array also when ``rank < n``; a shape cannot depend on data
  under ``jit``, so jaxforge returns the actual residuals there;
* ``rank`` ``(*batch,)`` int32 and ``s`` ``(*batch, min(m, n))``, the singular values of ``a``.

The rank is decided on device, without a host sync. Derivatives hold where the rank is locally
constant (Golub & Pereyra); with :math:`r = b - Ax`:

.. math::

    dx = A^+(db - dA\,x) + A^+A^{+H} dA^H r + (I - A^+A)\, dA^H A^{+H} x

Full column rank (:math:`m \ge n`, :math:`A = QR`) this is
:math:`dx = R^{-1}[Q^H(db - dA\,x) + R^{-H} dA^H r]`; full row rank (:math:`m < n`,
:math:`A^H = QR`, :math:`z = R^{-1}R^{-H} b`) it is
:math:`dx = QR^{-H}(db - dA\,x) + (I - QQ^H)\, dA^H z`: matmuls and triangular solves, linear in
``(da, db)``, so JAX transposes them for reverse mode and full-rank gradients never meet an SVD
singularity. Rank-deficient inputs use the truncated pseudo-inverse from the SVD of ``R``; that
branch runs only when some matrix in the batch is rank-deficient (``lax.cond`` on device). The
singular vectors of ``A`` come from the SVD of the small factor ``R`` (off CPU, only where that
branch or a tangent of ``s`` needs them). The residuals follow
:math:`d\lVert r\rVert^2 = 2\operatorname{Re}\sum \bar r\,(db - dA\,x - A\,dx)` and the singular
values :math:`ds = \operatorname{Re}\operatorname{diag}(U^H dA\, V)`.

Where things live:
    API        jaxforge/functional/linalg.py :: lstsq
    lowering   jaxforge/lowering/linalg/lstsq/
    tests      tests/primitives/linalg/test_lstsq.py
    benchmark  jaxforge/bench/linalg.py (entry "lstsq")
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxforge.primitives import _core
from jaxforge.primitives.linalg._checks import check_dtype, check_matrix, real_dtype
from jaxforge.primitives.linalg._ops import after, after_on_cpu, ct, diagonal, mm, solve_triangular, truncated_pinv
from jaxforge.primitives.linalg.svd import svd_p

__all__ = ["JVP_QR", "SHAPES", "default_rcond", "lstsq_p", "lstsq_reference", "residuals"]

# Named shapes (batch, m, n, k) shared by tests and benchmarks; "bench_gpu" are ANCHORS.md shapes.
SHAPES = {
    "tiny_batch": ((8192, 64, 16, 1), ("bench_gpu", "bench_cpu")),
    "small_batch": ((256, 512, 128, 4), ("bench_gpu", "bench_cpu")),
    "tall_large": ((1, 16384, 1024, 16), ("bench_gpu", "bench_cpu")),
    "square_large": ((1, 4096, 4096, 1), ("bench_gpu",)),
    "square_cpu": ((1, 1024, 1024, 1), ("bench_cpu",)),
    "odd_wide": ((7, 37, 61, 3), ("bench_cpu", "test")),
    "odd_tall": ((5, 61, 37, 2), ("test",)),
}


def default_rcond(dtype, m: int, n: int) -> float:
    """numpy's default cut-off: machine epsilon times max(m, n)."""
    return float(np.finfo(real_dtype(dtype)).eps * max(m, n))


def lstsq_reference(a, b, *, rcond: float):
    """The spec: the truncated-SVD pseudo-inverse solution, in plain jax.numpy."""
    m, n = a.shape[-2:]
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    keep = s > rcond * jnp.max(s, axis=-1, keepdims=True, initial=0)
    x = truncated_pinv(u, s, ct(vh), keep, b)
    return x, residuals(a, b, x), jnp.sum(keep, axis=-1, dtype=jnp.int32), s


def residuals(a, b, x):
    """Column sums of ``|b - A x|²`` when ``m > n``; an empty ``(*batch, 0)`` array otherwise."""
    m, n = a.shape[-2:]
    if m <= n:
        return jnp.zeros((*b.shape[:-2], 0), real_dtype(b.dtype))
    return jnp.sum(jnp.abs(b - mm(a, x)) ** 2, axis=-2)


def _abstract_eval(a, b, *, rcond: float):
    check_matrix("lstsq", "a", a.shape)
    check_matrix("lstsq", "b", b.shape)
    check_dtype("lstsq", "a", a.dtype)
    check_dtype("lstsq", "b", b.dtype)
    if a.dtype != b.dtype:
        raise TypeError(f"lstsq: `a` and `b` must share a dtype; got {a.dtype} and {b.dtype}")
    *batch, m, n = a.shape
    if tuple(b.shape[:-1]) != (*batch, m):
        raise ValueError(
            f"lstsq: `b` must have shape (*batch, m, k) = ({', '.join(map(str, batch + [m]))}, k) "
            f"to match `a` of shape {tuple(a.shape)}; got `b` of shape {tuple(b.shape)}"
        )
    k = b.shape[-1]
    real = real_dtype(a.dtype)
    outputs = [
        ((*batch, n, k), a.dtype),
        ((*batch, k if m > n else 0), real),
        (tuple(batch), np.dtype(np.int32)),
        ((*batch, min(m, n)), real),
    ]
    return _core.batch_sharded_avals("lstsq", {"a": a, "b": b}, len(batch), outputs)


# The jvp's thin QR by platform: a lowering may register one that beats jax's Householder QR there
# and keeps jax's derivative rules (lowering/linalg/lstsq registers CholeskyQR2's for cuda).
JVP_QR: dict[str, Callable] = {}


def _jvp_qr(x):
    householder = lambda x: lax.linalg.qr(x, full_matrices=False)  # noqa: E731
    return lax.platform_dependent(x, default=householder, **JVP_QR) if JVP_QR else householder(x)


def _jvp(primals, tangents, *, rcond: float):
    a, b = primals
    x, residuals, rank, s = lstsq_p.bind(a, b, rcond=rcond)
    da, db = (_core.instantiate_zeros(t) for t in tangents)
    m, n = a.shape[-2:]
    k = min(m, n)
    if k == 0:
        dx, ds = jnp.zeros_like(x), jnp.zeros_like(s)
    else:
        # The factors are recomputed with a differentiable QR (_jvp_qr) so that second derivatives
        # flow through them; x and rank come from the primitive (the kernel on GPU). The SVD of R serves
        # ds, so XLA drops it where s has no tangent (a gradient of x alone; likewise the forward's
        # s), and the rank-deficient branch takes its own. On CPU every LAPACK call is chained
        # after the previous one (_ops.after): there the solves wait for ds's SVD, which then runs.
        q, r = _jvp_qr(after_on_cpu(after(a if m >= n else ct(a), x), s[..., None]))
        r = after(r, q)
        u, v = _singular_vectors(q, r, wide=m < n)
        ds = jnp.real(diagonal(mm(mm(ct(u), da), v)))
        r = after_on_cpu(r, u)
        dx = lax.cond(
            jnp.all(rank == k),
            lambda: _full_rank_tangent(a, b, x, q, r, da, db),
            lambda: _mixed_rank_tangent(a, b, x, q, r, s, rank, da, db),
        )
    dres = jnp.zeros_like(residuals)
    if m > n:
        dres = 2 * jnp.sum(jnp.real(jnp.conj(b - mm(a, x)) * (db - mm(da, x) - mm(a, dx))), axis=-2)
    drank = np.zeros(rank.shape, jax.dtypes.float0)
    return (x, residuals, rank, s), (dx, dres, drank, ds)


def _full_rank_tangent(a, b, x, q, r, da, db):
    m, n = a.shape[-2:]
    if m >= n:  # A = QR: dx = R⁻¹[Qᴴ(db - dA x) + R⁻ᴴ dAᴴ (b - A x)]
        res = b - mm(a, x)
        return solve_triangular(
            r, mm(ct(q), db - mm(da, x)) + solve_triangular(r, mm(ct(da), res), adjoint=True)
        )
    # Aᴴ = QR: dx = Q R⁻ᴴ(db - dA x) + (I - QQᴴ) dAᴴ z, z = R⁻¹R⁻ᴴ b
    z = solve_triangular(r, solve_triangular(r, b, adjoint=True))
    w = mm(ct(da), z)
    return mm(q, solve_triangular(after(r, z), db - mm(da, x), adjoint=True)) + w - mm(q, mm(ct(q), w))


def _singular_vectors(q, r, *, wide: bool):
    """``(U, V)`` of the thin SVD of ``A`` from that of its small factor: ``A = QR``, or ``Aᴴ = QR``
    when ``wide``."""
    _, u_r, vh_r = svd_p.bind(r, full_matrices=False, compute_uv=True, grad_eps=0.0)
    return (ct(vh_r), mm(q, u_r)) if wide else (mm(q, u_r), ct(vh_r))


def _mixed_rank_tangent(a, b, x, q, r, s, rank, da, db):
    """Per matrix: the full-rank tangent where the rank is full, the pseudo-inverse one elsewhere."""
    m, n = a.shape[-2:]
    u, v = _singular_vectors(q, r, wide=m < n)
    r = after(r, u)  # the solves wait for the SVD
    k = r.shape[-1]
    full = (rank == k)[..., None, None]
    r_safe = jnp.where(full, r, jnp.eye(k, dtype=r.dtype))  # keeps the unselected branch finite
    return jnp.where(
        full,
        _full_rank_tangent(a, b, x, q, r_safe, da, db),
        _pinv_tangent(a, b, x, u, s, v, rank, da, db),
    )


def _pinv_tangent(a, b, x, u, s, v, rank, da, db):
    """Golub–Pereyra with the truncated pseudo-inverse A_r⁺ = V S_r⁻¹ Uᴴ of the thin SVD of A."""
    keep = jnp.arange(s.shape[-1]) < rank[..., None]

    def pinv(y):  # A⁺ y
        return truncated_pinv(u, s, v, keep, y)

    def pinv_h(y):  # A⁺ᴴ y
        return truncated_pinv(v, s, u, keep, y)

    kept = keep.astype(a.dtype)[..., :, None]  # A⁺A = V diag(kept) Vᴴ
    res = b - mm(a, x)
    w = mm(ct(da), pinv_h(x))
    return pinv(db - mm(da, x)) + pinv(pinv_h(mm(ct(da), res))) + w - mm(v, kept * mm(ct(v), w))


def _example_args():
    rng = np.random.default_rng(0)
    return rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 2))


lstsq_p = _core.define_primitive(
    "jaxforge_lstsq",
    abstract_eval=_abstract_eval,
    jvp=_jvp,
    reference=lstsq_reference,
    example_args=_example_args,
    example_params=dict(rcond=default_rcond(np.float64, 6, 3)),
    test_module="tests/primitives/linalg/test_lstsq.py",
    bench_entry="linalg/lstsq",
)
