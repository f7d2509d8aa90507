r"""lstsq: the minimum-norm least-squares solution :math:`x = A^+ b` as a primitive.

``lstsq_p`` binds ``a`` of shape ``(*batch, m, n)`` and ``b`` of shape ``(*batch, m, k)`` (the same
batch dims and dtype) with the static cut-off ``rcond`` and returns ``(x, residuals, rank, s, r)``:

* ``x`` ``(*batch, n, k)``: :math:`A_r^+ b`, where :math:`A_r` keeps the singular values
  :math:`s_i > \mathrm{rcond}\cdot s_1` (numpy's rule);
* ``residuals`` ``(*batch, k)``: :math:`\lVert b - A x\rVert^2` per column when ``m > n``, else
  ``(*batch, 0)``. numpy returns an empty array also when ``rank < n``; a shape cannot depend on data
  under ``jit``, so jaxforge returns the actual residuals there;
* ``rank`` ``(*batch,)`` int32 and ``s`` ``(*batch, min(m, n))``, the singular values of ``a``;
* ``r`` ``(*batch, min(m, n), min(m, n))``: the forward's triangular factor, ``A = QR`` (``Aᴴ = QR``
  when ``m < n``) with a real non-negative diagonal, so ``RᴴR = AᴴA`` (``AAᴴ``). The derivative rule
  reuses it; ``jf.linalg.lstsq`` does not return it.

The rank is decided on device, without a host sync. Derivatives hold where the rank is locally
constant (Golub & Pereyra); with :math:`r = b - Ax`:

.. math::

    dx = A^+(db - dA\,x) + A^+A^{+H} dA^H r + (I - A^+A)\, dA^H A^{+H} x

Full rank, these are the corrected seminormal equations on the forward's ``R`` (Björck), with
:math:`N = R^H R` and :math:`f = db - dA\,x`: tall, :math:`dx = N^{-1}(A^H f + dA^H r)`
(:math:`= A^{+}f + (A^HA)^{-1}dA^H r`; the last term vanishes when :math:`m = n`); wide
(:math:`N = AA^H`, :math:`z = N^{-1}b`, :math:`w = dA^H z`), :math:`dx = w + A^H N^{-1}(f - A\,w)`.
Each :math:`N^{-1}` is applied twice, the second time to the first one's residual. No QR of ``A``
is recomputed: matrix products with ``A`` and ``R⁻¹``, linear in ``(da, db)``, so JAX transposes
them for reverse mode and full-rank gradients never meet an SVD singularity. The forward's ``R``
carries its own tangent, :math:`dR = (\operatorname{triu}(H, 1) + \tfrac12\operatorname{diag}(H))\,R` with
:math:`H = R^{-H}(A^H dA + dA^H A)R^{-1}`, so second derivatives flow. Rank-deficient inputs use the
truncated pseudo-inverse from the SVD of the forward's ``R``, computed only when some matrix in the
batch is rank-deficient (``lax.cond`` on device). The singular vectors of ``A`` come from that SVD
(:math:`U = AVS^{-1}`), and ds's own SVD of ``R`` runs only where a tangent of ``s`` is used (XLA
drops it from a gradient of ``x`` alone). ``R``'s tangent is not defined where ``A`` is
rank-deficient (0 there), so that pseudo-inverse is differentiated in ``A`` alone, by the same
formula (products of :math:`A^+` and ``A``): second derivatives of ``x`` and the residuals hold
there too, also where singular values repeat; in such a batch ds takes ``A``'s own SVD, whose
vectors' derivatives its own second derivatives need (exact at distinct singular values, as
svd's). The residuals follow
:math:`d\lVert r\rVert^2 = 2\operatorname{Re}\sum \bar r\,(db - dA\,x - A\,dx)` and the singular
values :math:`ds = \operatorname{Re}\operatorname{diag}(U^H dA\, V)`. The JVP names what it reads of
the forward, ``(x, rank, r)`` (``RESIDUAL_NAMES``), so that a ``jax.checkpoint`` policy may keep
them (``jaxforge.transforms.remat``) and a rematerialised backward does not solve again. ``x`` is
linear in ``b``: it transposes there (``jax.linear_transpose``) to :math:`A^{+H} g = (A^H)^+ g`.

Where things live:
    API        jaxforge/functional/linalg.py :: lstsq
    lowering   jaxforge/lowering/linalg/lstsq/
    tests      tests/primitives/linalg/test_lstsq.py
    benchmark  jaxforge/bench/linalg.py (entry "lstsq")
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxforge.primitives import _core
from jaxforge.primitives.linalg._checks import check_dtype, check_matrix, real_dtype
from jaxforge.primitives.linalg._ops import (
    after,
    after_on_cpu,
    ct,
    diag,
    diagonal,
    kept_reciprocal,
    mm,
    pinv_tangent,
    positive_diagonal,
    truncated_pinv,
    upper_inverse,
    within_rank,
)
from jaxforge.primitives.linalg.svd import svd_p

__all__ = ["RESIDUAL_NAMES", "SHAPES", "default_rcond", "lstsq_p", "lstsq_reference", "residuals"]

RESIDUAL_NAMES = ("lstsq_solution", "lstsq_rank", "lstsq_r")  # jax.ad_checkpoint.checkpoint_name of (x, rank, r)

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
    r = positive_diagonal(jnp.linalg.qr(a if m >= n else ct(a), mode="r"))
    return x, residuals(a, b, x), jnp.sum(keep, axis=-1, dtype=jnp.int32), s, r


def residuals(a, b, x):
    """Column sums of ``|b - A x|²`` when ``m > n``; an empty ``(*batch, 0)`` array otherwise."""
    m, n = a.shape[-2:]
    if m <= n:
        return jnp.sum(jnp.abs(b[..., :0]), axis=-2)  # over no columns: b's batch, its sharding kept
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
        ((*batch, min(m, n), min(m, n)), a.dtype),
    ]
    return _core.batch_sharded_avals("lstsq", {"a": a, "b": b}, len(batch), outputs)


def _jvp(primals, tangents, *, rcond: float):
    a, b = primals
    x, residuals, rank, s, r = lstsq_p.bind(a, b, rcond=rcond)
    x, rank, r = _core.named_residuals((x, rank, r), RESIDUAL_NAMES)
    da, db = (_core.instantiate_zeros(t) for t in tangents)
    if min(a.shape[-2:]) == 0:
        dx, dres, ds, dr = jnp.zeros_like(x), jnp.zeros_like(residuals), jnp.zeros_like(s), jnp.zeros_like(r)
    else:
        s, dx, dres, ds, dr = _tangents(a, b, x, rank, r, da, db)
    return (x, residuals, rank, s, r), (dx, dres, _core.zero_tangent(rank), ds, dr)


def _residual_tangent(a, b, x, da, db, dx):
    """The residuals' tangent ``2 Re Σ conj(b − Ax) ∘ (db − dA x − A dx)`` (tall problems)."""
    return 2 * jnp.sum(jnp.real(jnp.conj(b - mm(a, x)) * (db - mm(da, x) - mm(a, dx))), axis=-2)


@jax.jit
def _tangents(a, b, x, rank, r, da, db):
    """``(s, dx, dres, ds, dr)`` of a nonempty problem: ``s`` recomputed (below), the tangents of
    the solution, the residuals (tall problems; else empty), the singular values and the factor.
    Jitted: an eager jvp or grad (one outside ``jit``) compiles one program per shape, its two
    ``lax.cond`` included, not each of its operations."""
    k = min(a.shape[-2:])
    # On CPU every LAPACK call is chained after the previous one (_ops.after): R⁻¹'s solve after
    # the forward's solution, the rank-deficient branch's SVD of R after that solve, and last the
    # SVD of R that gives ds and s itself (recomputed, so that nothing waits for the forward's):
    # XLA drops it, on every platform, where neither is used (a gradient of x alone).
    r_tied = after(r, x)
    full = (rank == k)[..., None, None]
    all_full = jnp.all(full)
    eye = jnp.eye(k, dtype=r.dtype)
    r_safe = jnp.where(full, r_tied, eye)  # finite where deficient
    r_inv = upper_inverse(r_safe)
    dr = jnp.where(full, _factor_tangent(a, r_safe, r_inv, da), 0)
    s_r, v_r = lax.cond(  # the SVD only for a batch holding a rank-deficient matrix
        all_full,
        lambda: (jnp.zeros_like(r[..., 0], real_dtype(r.dtype)), jnp.zeros_like(r)),
        lambda: _right_svd(after_on_cpu(r_tied, r_inv)),
    )
    dx = lax.cond(
        all_full,
        lambda: _seminormal_tangent(a, b, x, r_inv, da, db),
        lambda: _mixed_rank_tangent(a, b, x, rank, r_inv, s_r, v_r, da, db),
    )
    s, v_r = _right_svd(after_on_cpu(r_tied, v_r))
    s, ds = lax.cond(
        all_full,
        lambda: (s, _singular_value_tangent(*_singular_vectors(a, s, v_r, rank), da)),
        lambda: _singular_values_through_a(after_on_cpu(a, v_r), s, rank, da),
    )
    m, n = a.shape[-2:]
    dres = _residual_tangent(a, b, x, da, db, dx) if m > n else jnp.zeros_like(ds[..., :0])
    return s, dx, dres, ds, dr


def _right_svd(r):
    """``(s, V_R)`` of the forward's factor ``R = U_R S V_Rᴴ``: the singular values of ``A`` and what
    :func:`_singular_vectors` needs of the rest."""
    s, _, vh_r = svd_p.bind(r, full_matrices=False, compute_uv=True, grad_eps=0.0)
    return s, ct(vh_r)


def _singular_vectors(a, s, v_r, rank):
    """``(U, V)`` of the thin SVD of ``A`` from ``(s, V_R)`` of its factor ``R``: ``A = QR`` with
    ``Q = AR⁻¹`` maps ``U_R`` to ``Q U_R = A V_R S⁻¹``, so ``U = A V_R S⁻¹, V = V_R``; when wide,
    ``Aᴴ = QR`` and ``U = V_R, V = Aᴴ V_R S⁻¹``. Vectors past the rank, whose singular values are
    zero up to rounding, are zero."""
    wide = a.shape[-2] < a.shape[-1]
    kept = within_rank(rank, s.shape[-1])
    q_u = mm(ct(a) if wide else a, v_r) * kept_reciprocal(s, kept).astype(a.dtype)[..., None, :]
    return (v_r, q_u) if wide else (q_u, v_r)


def _singular_value_tangent(u, v, da):
    """``ds = Re diag(Uᴴ dA V)``; 0 past the rank, where the vectors are 0 (the singular values have
    no derivative there)."""
    return jnp.real(diagonal(mm(mm(ct(u), da), v)))


def _singular_values_through_a(a, s, rank, da):
    """``(s, ds)`` in a batch holding a rank-deficient matrix: ``s``'s values (``R``'s, as the
    forward's) and its derivatives those of ``A``'s own SVD, as is ``ds = Re diag(Uᴴ dA V)`` (0 past
    the rank). ``R``'s tangent is not defined where ``A`` is rank-deficient (0 there), so vectors
    from its SVD would give ``ds`` a wrong derivative; ``A``'s give exact ones at distinct values."""
    s_a, u, vh = svd_p.bind(a, full_matrices=False, compute_uv=True, grad_eps=0.0)
    kept = within_rank(rank, s.shape[-1])
    # where, not a product: past the rank svd's tangents of u and vh meet 1/(0 - 0)
    u, v = (jnp.where(kept[..., None, :], x, 0) for x in (u, ct(vh)))
    moving = jnp.where(kept, s_a - lax.stop_gradient(s_a), 0)  # 0, with s_a's tangent
    return lax.stop_gradient(s) + moving, _singular_value_tangent(u, v, da)


def _seminormal_tangent(a, b, x, r_inv, da, db):
    """The full-rank ``dx`` by the corrected seminormal equations (module docstring): products with
    ``A`` and ``R⁻¹``."""
    m, n = a.shape[-2:]
    n_inv = lambda y: mm(r_inv, mm(ct(r_inv), y))  # noqa: E731  (RᴴR)⁻¹ y
    f = db - mm(da, x)
    if m >= n:  # N = AᴴA: dx = N⁻¹(Aᴴf + dAᴴr); r = b - Ax vanishes for square A
        h = mm(ct(da), b - mm(a, x)) if m > n else 0
        return _corrected(n_inv, mm(ct(a), f) + h, lambda y: mm(ct(a), f - mm(a, y)) + h)
    # N = AAᴴ: z = N⁻¹b, w = dAᴴz, dx = w + Aᴴ N⁻¹(f - Aw)
    gram = lambda y: mm(a, mm(ct(a), y))  # noqa: E731
    z = _corrected(n_inv, b, lambda z: b - gram(z))
    w = mm(ct(da), z)
    g = f - mm(a, w)
    return w + mm(ct(a), _corrected(n_inv, g, lambda t: g - gram(t)))


def _corrected(n_inv, c, residual):
    """``y`` with ``N y = c`` by one step of correction: ``y₀ = N⁻¹c``, ``y = y₀ + N⁻¹ residual(y₀)``.

    ``residual(y)`` is ``c − N y`` evaluated through ``A`` rather than ``N``: the step brings the
    seminormal solution's error, of order κ²ε, down to that of a QR solve.
    """
    y = n_inv(c)
    return y + n_inv(residual(y))


def _factor_tangent(a, r, r_inv, da):
    """``dR = (triu(H, 1) + diag(H)/2) R``, ``H = R⁻ᴴ(AᴴdA + dAᴴA)R⁻¹``: the tangent of the forward's
    ``R`` (of ``Aᴴ`` when wide) that keeps ``RᴴR = AᴴA`` and its diagonal real."""
    m, n = a.shape[-2:]
    g = mm(ct(a), da) if m >= n else mm(a, ct(da))
    c = mm(ct(r_inv), mm(g, r_inv))
    h = c + ct(c)
    return mm(jnp.triu(h, 1) + 0.5 * diag(diagonal(h)), r)


def _mixed_rank_tangent(a, b, x, rank, r_inv, s, v_r, da, db):
    """Per matrix: the seminormal tangent where the rank is full, Golub–Pereyra's with the truncated
    pseudo-inverse from the SVD of the forward's ``R`` (``(s, V_R)``) elsewhere."""
    full = (rank == r_inv.shape[-1])[..., None, None]
    return jnp.where(
        full,
        _seminormal_tangent(a, b, x, r_inv, da, db),
        _pinv_tangent(a, b, x, _truncated_pinv(a, s, v_r, rank), da, db),
    )


def _pinv_tangent(a, b, x, p, da, db):
    """Golub–Pereyra's ``dx`` with the truncated pseudo-inverse ``P = A_r⁺``."""
    w = mm(ct(da), mm(ct(p), x))
    return mm(p, db - mm(da, x) + mm(ct(p), mm(ct(da), b - mm(a, x)))) + w - mm(p, mm(a, w))


@jax.custom_jvp
def _truncated_pinv(a, s, v_r, rank):
    """``A_r⁺ = V S_r⁻¹ Uᴴ`` from ``(s, V_R)`` of the forward's ``R``, differentiated in ``a`` alone
    with its rank held (``pinv_tangent``): ``R``'s own tangent is not defined where ``A`` is
    rank-deficient (0 there), so second derivatives taken through its SVD would be wrong."""
    u, v = _singular_vectors(a, s, v_r, rank)
    return mm(v * kept_reciprocal(s, within_rank(rank, s.shape[-1])).astype(a.dtype)[..., None, :], ct(u))


@_truncated_pinv.defjvp
def _truncated_pinv_jvp(primals, tangents):
    a, s, v_r, rank = primals
    p = _truncated_pinv(a, s, v_r, rank)
    # Tied (0·ds, linear and finite) to the tangent of s, which it does not read: in a second
    # derivative's program the SVD of R that gives it then waits, on CPU, for the LAPACK calls
    # before it as its input's tangent does (_ops.after; without a use XLA would drop the tie).
    return p, pinv_tangent(a, p, tangents[0]) + 0 * tangents[1][..., :1, None].astype(p.dtype)


def _transpose(cts, a, b, *, rcond: float):
    """``x = A⁺b`` is linear in ``b`` (the residuals are quadratic in it; the rank, ``s`` and ``R``
    do not move with it), so where ``b`` alone is a linear input (``jax.linear_transpose`` in ``b``)
    its cotangent is ``A⁺ᴴ g_x = (Aᴴ)⁺ g_x``: a least-squares solve with ``Aᴴ``, whose singular
    values, so the cut-off, are ``A``'s."""
    if _core.is_linear_input(a):
        raise NotImplementedError("lstsq: its solution is linear in b, not in a: it cannot be transposed in a")
    if not _core.is_symbolic_zero(cts[1]):
        raise NotImplementedError("lstsq: its residuals are quadratic in b, not linear: they cannot be transposed")
    if _core.is_symbolic_zero(cts[0]):
        return [None, None]
    return [None, lstsq_p.bind(ct(a), cts[0], rcond=rcond)[0]]


def _known_outputs(operands, avals, *, rcond: float):
    """Where ``b`` alone is unknown (``jax.linear_transpose`` in ``b``), the rank, ``s`` and ``R``,
    which do not read it, stay known: computed with no right-hand side."""
    a, b = operands
    if a is None or b is not None:
        return [None] * 5
    no_columns = _core.zeros(avals[1].update(shape=(*avals[1].shape[:-1], 0)))
    return [None, None, *lstsq_p.bind(a, no_columns, rcond=rcond)[2:]]


def _example_args():
    rng = np.random.default_rng(0)
    return rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 2))


lstsq_p = _core.define_primitive(
    "jaxforge_lstsq",
    abstract_eval=_abstract_eval,
    jvp=_jvp,
    transpose=_transpose,
    known_outputs=_known_outputs,
    reference=lstsq_reference,
    example_args=_example_args,
    example_params=dict(rcond=default_rcond(np.float64, 6, 3)),
    test_module="tests/primitives/linalg/test_lstsq.py",
    bench_entry="linalg/lstsq",
)
