"""lstsq_p: numpy's results, the QR route, rank on device, derivatives, vmap, jit and sharding."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from jax.test_util import check_grads

import jaxforge as jf
from jaxforge.primitives.linalg import lstsq_p, lstsq_reference
from jaxforge.primitives.linalg.lstsq import SHAPES, default_rcond
from tests.linalg_inputs import random, well_conditioned, with_singular_values

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
CORE_SHAPES = [(6, 3), (3, 6), (4, 4), (5, 1), (1, 5)]


def numpy_lstsq(a, b, rcond=None):
    """numpy's lstsq looped over the batch; residuals as numpy reports them."""
    a64 = a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)
    b64 = b.astype(a64.dtype)
    batch = a.shape[:-2]
    outs = [np.linalg.lstsq(a64[i], b64[i], rcond=rcond) for i in np.ndindex(*batch)]
    return [np.stack([o[j] for o in outs]).reshape(*batch, *np.shape(outs[0][j])) if outs else None for j in range(4)]


def solution(a, b, **kw):
    return jf.linalg.lstsq(a, b, **kw).solution


def rank_deficient(rng, batch, m, n, rank, dtype=np.float64):
    k = min(m, n)
    s = np.concatenate([np.linspace(2.0, 1.0, rank), np.zeros(k - rank)])
    return with_singular_values(rng, batch, m, n, s, dtype)


# --- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", CORE_SHAPES)
@pytest.mark.parametrize("vector_b", [False, True])
def test_matches_numpy(dtype, m, n, vector_b):
    rng = np.random.default_rng(0)
    a = well_conditioned(rng, (3,), m, n, dtype)
    b = random(rng, (3, m) if vector_b else (3, m, 2), dtype)
    x, res, rank, s = jf.linalg.lstsq(a, b)
    x_np, res_np, rank_np, s_np = numpy_lstsq(a, b)
    tol = 100 * np.finfo(dtype).eps
    assert x.shape == x_np.shape and x.dtype == dtype
    np.testing.assert_allclose(x, x_np, rtol=tol, atol=tol)
    np.testing.assert_array_equal(rank, rank_np)
    assert rank.dtype == np.int32
    np.testing.assert_allclose(s, s_np, rtol=tol)
    assert res.shape == ((3, 1 if vector_b else 2) if m > n else (3, 0))
    if m > n:
        np.testing.assert_allclose(res, res_np, rtol=np.sqrt(tol))


@pytest.mark.parametrize("m,n", [(9, 4), (4, 9), (6, 6)])
def test_float64_matches_numpy_to_1e12(m, n):
    rng = np.random.default_rng(1)
    a = well_conditioned(rng, (4,), m, n)
    b = random(rng, (4, m, 3))
    x, res, _, s = jf.linalg.lstsq(a, b)
    x_np, res_np, _, s_np = numpy_lstsq(a, b)
    np.testing.assert_allclose(x, x_np, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(s, s_np, rtol=1e-12)
    if m > n:
        np.testing.assert_allclose(res, res_np, rtol=1e-12)


@pytest.mark.parametrize("m,n,rank", [(8, 5, 3), (5, 8, 2), (6, 6, 5)])
def test_rank_deficient_reports_rank_and_minimum_norm_solution(m, n, rank):
    rng = np.random.default_rng(2)
    a = rank_deficient(rng, (2,), m, n, rank)
    b = random(rng, (2, m, 2))
    x, res, r, s = jax.jit(jf.linalg.lstsq)(a, b)
    x_np, _, r_np, _ = numpy_lstsq(a, b)
    np.testing.assert_array_equal(r, [rank, rank])
    np.testing.assert_array_equal(r, r_np)
    np.testing.assert_allclose(x, x_np, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(x, lstsq_reference(a, b, rcond=default_rcond(np.float64, m, n))[0], atol=1e-12)


def test_mixed_batch_full_and_deficient():
    rng = np.random.default_rng(3)
    a = np.stack([well_conditioned(rng, (), 7, 4), rank_deficient(rng, (), 7, 4, 2)])
    b = random(rng, (2, 7, 1))
    x, _, rank, _ = jf.linalg.lstsq(a, b)
    np.testing.assert_array_equal(rank, [4, 2])
    for i in range(2):
        np.testing.assert_allclose(x[i], np.linalg.lstsq(a[i], b[i])[0], atol=1e-12)


def test_rcond_cuts_small_singular_values_like_numpy():
    rng = np.random.default_rng(4)
    a = with_singular_values(rng, (), 6, 4, [1.0, 1e-2, 1e-4, 1e-6])
    b = random(rng, (6, 2))
    for rcond in (None, -1, 1e-3, 1e-5, 0.5):
        x, _, rank, _ = jf.linalg.lstsq(a, b, rcond=rcond)
        x_np, _, rank_np, _ = np.linalg.lstsq(a, b, rcond=rcond)
        assert int(rank) == int(rank_np), rcond
        np.testing.assert_allclose(x, x_np, rtol=1e-8)


def test_batch_dims_broadcast_between_a_and_b():
    rng = np.random.default_rng(5)
    a = well_conditioned(rng, (3,), 5, 2)
    b = random(rng, (4, 1, 5, 2))
    x = solution(a, b)
    assert x.shape == (4, 3, 2, 2)
    np.testing.assert_allclose(x[2, 1], np.linalg.lstsq(a[1], b[2, 0])[0], atol=1e-13)
    b_shared = random(rng, (5, 2))  # one right-hand side matrix for every matrix of the batch
    np.testing.assert_allclose(solution(a, b_shared)[1], np.linalg.lstsq(a[1], b_shared)[0], atol=1e-13)


@pytest.mark.parametrize("m,n", [(0, 3), (3, 0), (0, 0)])
@pytest.mark.parametrize("vector_b", [False, True])
def test_empty_matrices_like_numpy(m, n, vector_b):
    a, b = np.zeros((m, n)), np.ones((m,) if vector_b else (m, 2))
    ours = jf.linalg.lstsq(a, b)
    theirs = np.linalg.lstsq(a, b)
    for o, t in zip(ours, theirs):
        assert np.shape(o) == np.shape(t)
        np.testing.assert_array_equal(o, t)


@pytest.mark.parametrize("m,n", [(6, 3), (3, 6), (4, 4)])
def test_no_right_hand_sides_like_numpy(m, n):
    """``b`` of zero columns: still the rank and singular values of ``a``, and their gradient."""
    a = random(np.random.default_rng(12), (2, m, n))
    b = np.zeros((2, m, 0))
    ours = jax.jit(jf.linalg.lstsq)(a, b)
    for i in range(2):
        for o, t in zip(ours, np.linalg.lstsq(a[i], b[i])):
            assert np.shape(o[i]) == np.shape(t)
            np.testing.assert_allclose(o[i], t, atol=1e-13)
    grad = jax.grad(lambda a: jf.linalg.lstsq(a, b).singular_values.sum())(a)
    np.testing.assert_allclose(grad, jax.grad(lambda a: jnp.linalg.svd(a, compute_uv=False).sum())(a), atol=1e-13)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_give_nan_outputs_under_jit(bad):
    rng = np.random.default_rng(6)
    a, b = well_conditioned(rng, (3,), 6, 3), random(rng, (3, 6, 1))
    a[1, 0, 0] = bad
    x, res, rank, s = jax.jit(jf.linalg.lstsq)(a, b)
    assert np.all(np.isnan(x[1])) and np.all(np.isnan(res[1])) and np.all(np.isnan(s[1]))
    assert int(rank[1]) == 0
    np.testing.assert_allclose(x[0], np.linalg.lstsq(a[0], b[0])[0], atol=1e-13)
    b[2, 3, 0] = bad
    assert np.all(np.isnan(jax.jit(solution)(a, b)[2]))


def test_full_rank_route_never_decomposes_a_with_an_svd():
    """Only the n×n triangular factor meets an SVD (for the rank); A itself goes through QR."""
    a, b = jnp.zeros((4, 50, 6), jnp.float32), jnp.zeros((4, 50, 1), jnp.float32)
    hlo = jax.jit(jf.linalg.lstsq).lower(a, b).as_text()
    svd_operands = re.findall(r"@lapack_\w*ges\w*_ffi\([^\n]*\} : \(tensor<([0-9x]+)xf32>", hlo)
    assert svd_operands and all(shape == "4x6x6" for shape in svd_operands), svd_operands
    assert "geqrf" in hlo


# --- derivatives ----------------------------------------------------------------------------


def all_outputs(a, b):
    x, residuals, _, s = jf.linalg.lstsq(a, b)
    return x, residuals, s


@pytest.mark.parametrize("m,n", [(5, 3), (3, 5), (4, 4)])
def test_check_grads_order_2(m, n):
    rng = np.random.default_rng(7)
    a, b = well_conditioned(rng, (2,), m, n), random(rng, (2, m, 2))
    check_grads(jax.jit(all_outputs), (a, b), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("m,n", [(5, 3), (3, 5)])
def test_check_grads_complex(m, n):
    rng = np.random.default_rng(7)
    a, b = well_conditioned(rng, (2,), m, n, np.complex128), random(rng, (2, m, 2), np.complex128)
    check_grads(jax.jit(all_outputs), (a, b), order=1, modes=("fwd", "rev"))


@pytest.mark.parametrize("m,n", [(7, 4), (4, 7), (5, 5)])
def test_jvp_matches_reference_autodiff(m, n):
    """The QR-based rule against autodiff through the SVD-based spec, second order included."""
    rng = np.random.default_rng(8)
    a, b = well_conditioned(rng, (3,), m, n), random(rng, (3, m, 2))
    ta, tb = random(rng, a.shape), random(rng, b.shape)
    rcond = default_rcond(np.float64, m, n)
    ours = lambda a, b: jf.linalg.lstsq(a, b)[:2] + (jf.linalg.lstsq(a, b)[3],)
    spec = lambda a, b: (lambda x, r, _, s, __: (x, r, s))(*lstsq_reference(a, b, rcond=rcond))
    jvp = jax.jit(jax.jvp, static_argnums=0)  # one program each, not op by op
    for f_ours, f_spec in ((ours, spec), (jax.jacfwd(lambda a, b: ours(a, b)[0]), jax.jacfwd(lambda a, b: spec(a, b)[0]))):
        got = jvp(f_ours, (a, b), (ta, tb))
        want = jvp(f_spec, (a, b), (ta, tb))
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-9), got, want)


@pytest.mark.parametrize("m,n", [(7, 4), (4, 7)])
def test_an_eager_gradient_compiles_once(m, n, backend_compiles):
    """Outside ``jit`` a gradient runs the jvp rule eagerly: its ``lax.cond`` branches (full rank or
    not) compile at the first call only (they once recompiled at every call, 1.7 s a call on 4 x 32
    x 8, where jnp's gradient took 15 ms)."""
    rng = np.random.default_rng(12)
    b = random(rng, (3, m, 2))
    grad = jax.grad(lambda a: jnp.sum(solution(a, b) ** 2))
    jax.block_until_ready(grad(well_conditioned(rng, (3,), m, n)))
    backend_compiles.clear()
    jax.block_until_ready(grad(well_conditioned(rng, (3,), m, n)))
    assert backend_compiles == []


@pytest.mark.parametrize("m,n", [(9, 6), (6, 9)])
def test_an_eager_vjp_of_a_new_shape_compiles_its_tangent_map_as_one_program(m, n, backend_compiles):
    """The jvp rule's tangent map is one jitted program: linearized and transposed, it compiles
    twice at a new shape, beside at most the transposes of the wrapper's dtype conversions (op by
    op, the residuals' tangent outside it, 5 programs when wide, 26 when tall)."""
    rng = np.random.default_rng(16)
    a, b = well_conditioned(rng, (2,), m, n), random(rng, (2, m, 3))
    inexact = lambda a, b: tuple(o for o in jf.linalg.lstsq(a, b) if jnp.issubdtype(o.dtype, jnp.inexact))  # noqa: E731
    cotangents = tuple(jnp.asarray(random(rng, o.shape)) for o in inexact(a, b))  # the forward compiled too
    backend_compiles.clear()
    _, vjp = jax.vjp(inexact, a, b)
    jax.block_until_ready(vjp(cotangents))
    assert len(backend_compiles) <= 4, backend_compiles


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("m,n", [(7, 4), (4, 7), (5, 5)])
def test_the_factor_output_and_its_tangent_match_the_reference_qr(m, n, dtype):
    """``r``, the forward's R that the rule reuses, and the tangent that second derivatives follow."""
    rng = np.random.default_rng(16)
    a, b = well_conditioned(rng, (2,), m, n, dtype), random(rng, (2, m, 1), dtype)
    ta = random(rng, a.shape, dtype)
    rcond = default_rcond(dtype, m, n)
    ours = jax.jit(lambda a, b: lstsq_p.bind(a, b, rcond=rcond)[4])
    spec = jax.jit(lambda a, b: lstsq_reference(a, b, rcond=rcond)[4])  # jax's QR rule, made unique
    r, dr = jax.jvp(ours, (a, b), (ta, np.zeros_like(b)))
    r_ref, dr_ref = jax.jvp(spec, (a, b), (ta, np.zeros_like(b)))
    np.testing.assert_allclose(r, r_ref, atol=1e-12)
    np.testing.assert_allclose(dr, dr_ref, atol=1e-11)
    assert np.allclose(np.tril(r, -1), 0) and np.all(np.real(np.diagonal(r, axis1=-2, axis2=-1)) > 0)


@pytest.mark.parametrize("m,n", [(120, 30), (30, 120), (60, 60)])
def test_float32_tangents_are_as_accurate_as_from_a_recomputed_qr(m, n):
    """The full-rank rule solves on the forward's R (corrected seminormal equations); at κ = 1e3 in
    float32 its error against float64 stays that of the QR-based formula it replaces."""
    rng = np.random.default_rng(17)
    a = with_singular_values(rng, (3,), m, n, np.geomspace(1, 1e-3, min(m, n)))
    b = a @ random(rng, (3, n, 2)) + 1e-3 * random(rng, (3, m, 2))  # small residuals
    da, db = random(rng, a.shape), random(rng, b.shape)
    a32, b32, da32, db32 = (t.astype(np.float32) for t in (a, b, da, db))
    x32, dx32 = jax.jit(lambda *t: jax.jvp(solution, t[:2], t[2:]))(a32, b32, da32, db32)
    _, dx64 = jax.jvp(solution, (a32.astype(np.float64), b32.astype(np.float64)), (da, db))

    def qr_tangent(a, b, x, da, db):  # real inputs
        t = lambda y: jnp.swapaxes(y, -1, -2)  # noqa: E731
        solve = lambda r, y, adjoint=False: jax.lax.linalg.triangular_solve(  # noqa: E731
            r, y, left_side=True, lower=False, transpose_a=adjoint
        )
        if m >= n:  # A = QR: dx = R⁻¹[Qᵀ(db - dA x) + R⁻ᵀ dAᵀ (b - A x)]; the last term is 0 when m = n
            q, r = jnp.linalg.qr(a)
            rhs = t(q) @ (db - da @ x)
            if m > n:
                rhs = rhs + solve(r, t(da) @ (b - a @ x), adjoint=True)
            return solve(r, rhs)
        q, r = jnp.linalg.qr(t(a))  # Aᵀ = QR: dx = Q R⁻ᵀ(db - dA x) + (I - QQᵀ) dAᵀ z, z = R⁻¹R⁻ᵀ b
        w = t(da) @ solve(r, solve(r, b, adjoint=True))
        return q @ solve(r, db - da @ x, adjoint=True) + w - q @ (t(q) @ w)

    dx_qr = jax.jit(qr_tangent)(a32, b32, x32, da32, db32)
    error = lambda dx: np.linalg.norm(np.asarray(dx, np.float64) - dx64) / np.linalg.norm(dx64)  # noqa: E731
    assert error(dx32) < 2 * error(dx_qr) + 1e-6, (error(dx32), error(dx_qr))


@pytest.mark.parametrize("m,n,rank", [(8, 5, 3), (5, 8, 3), (6, 6, 4)])
def test_rank_deficient_gradient_is_finite_and_matches_pinv(m, n, rank):
    rng = np.random.default_rng(9)
    a, b = rank_deficient(rng, (2,), m, n, rank), random(rng, (2, m, 1))
    loss = lambda a, b: jnp.sum(solution(a, b) ** 2)
    ga, gb = jax.grad(loss, argnums=(0, 1))(a, b)
    assert np.all(np.isfinite(ga)) and np.all(np.isfinite(gb))
    # Along perturbations that keep the rank (da = P_U X P_V), the derivative is the pinv one.
    u, _, vh = np.linalg.svd(a)
    pu = u[..., :, :rank] @ np.swapaxes(u[..., :, :rank], -1, -2)
    pv = np.swapaxes(vh[..., :rank, :], -1, -2) @ vh[..., :rank, :]
    da, db = pu @ random(rng, a.shape) @ pv, random(rng, b.shape)
    h = 1e-6
    numeric = (loss(a + h * da, b + h * db) - loss(a - h * da, b - h * db)) / (2 * h)
    np.testing.assert_allclose(np.sum(ga * da) + np.sum(gb * db), numeric, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("m,n", [(6, 4), (4, 6), (5, 5), (0, 3)])
def test_transposes_in_b_to_the_pseudo_inverse_adjoint(m, n, dtype):
    """The solution is linear in b: ``jax.linear_transpose`` in b gives ``A⁺ᴴ g`` (one matrix
    rank-deficient); in a, or through the residuals, it is a clear error."""
    rng = np.random.default_rng(29)
    a = np.concatenate([random(rng, (1, m, n), dtype), rank_deficient(rng, (1,), m, n, min(m, n) // 2, dtype)])
    b, g = random(rng, (2, m, 3), dtype), random(rng, (2, n, 3), dtype)
    for rhs, cotangent in ((b, g), (b[..., 0], g[..., 0])):
        got = jax.jit(jax.linear_transpose(lambda b: solution(a, b), rhs))(cotangent)[0]
        want = np.einsum("...nm,...n->...m" if rhs.ndim == 2 else "...nm,...nk->...mk", np.linalg.pinv(a).conj(), cotangent)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(NotImplementedError, match="linear in b, not in a"):
        jax.linear_transpose(lambda a: solution(a, b), a)(g)
    with pytest.raises(NotImplementedError, match="residuals are quadratic in b"):
        jax.linear_transpose(lambda b: jf.linalg.lstsq(a, b).residuals, b)(np.ones((2, 3 if m > n else 0)))


@pytest.mark.parametrize("m,n", [(8, 5), (5, 8), (6, 6)])
def test_both_branches_give_a_full_rank_matrix_the_same_gradient(m, n):
    """Alone, a full-rank matrix takes the seminormal rule on the forward's R; batched with a
    rank-deficient one, the branch that also takes the SVD of R. Both must agree."""
    rng = np.random.default_rng(19)
    full, deficient = well_conditioned(rng, (1,), m, n), rank_deficient(rng, (1,), m, n, 3)
    b = random(rng, (2, m, 2))
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(solution(a, b))), argnums=(0, 1)))
    alone = grad(full, b[:1])
    batched = grad(np.concatenate([full, deficient]), b)
    for got, want in zip(batched, alone):
        np.testing.assert_allclose(got[:1], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("m,n", [(6, 4), (4, 6)])
@pytest.mark.parametrize("values", [(3.0, 2.0, 1.0), (2.0, 2.0, 1.0)])
def test_second_derivatives_of_a_rank_deficient_matrix(values, m, n, dtype):
    """Along directions that hold the rank (``a = L Rᴴ`` with ``L``, ``R`` of 3 columns, moved):
    x and the residuals to second order, also where singular values repeat; s at distinct values
    (at a tie it has none, as svd's). Through the forward's R, whose tangent is 0 where the rank
    is deficient, x's Hessian-vector products were off by as much as they measure (2026-12-07)."""
    rng = np.random.default_rng(20)
    a = with_singular_values(rng, (), m, n, np.array([*values, *[0.0] * (min(m, n) - 3)]), dtype)
    u, s, vh = np.linalg.svd(a)
    left, right = u[:, :3] * s[:3], np.conj(vh[:3].T)
    b = random(rng, (m, 2), dtype)

    def outputs(left, right, b):
        x, residuals, _, s = jf.linalg.lstsq(left @ jnp.conj(right.T), b)
        return (x, residuals, s) if len(set(values)) == len(values) else (x, residuals)

    assert jf.linalg.lstsq(a, b).rank == 3
    # eps: a central difference's truncation error, eps² times a third derivative, is 1e-6 here at
    # the default 1e-4 (complex, wide); at 1e-5 rounding still stays far below the tolerance
    check_grads(outputs, (left, right, b), order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, eps=1e-5)


@pytest.mark.parametrize("m,n", [(8, 5), (5, 8)])
def test_singular_value_tangents_of_a_rank_deficient_matrix(m, n):
    """ds from the forward's R (U = AVS⁻¹): Re(uᵢᴴ dA vᵢ) for the nonzero singular values, and 0 for
    the zero ones, whose derivative is not defined; never NaN."""
    rng = np.random.default_rng(18)
    a, b, da = rank_deficient(rng, (2,), m, n, 3), random(rng, (2, m, 1)), random(rng, (2, m, n))
    ds = jax.jit(lambda a, da: jax.jvp(lambda a: jf.linalg.lstsq(a, b).singular_values, (a,), (da,))[1])(a, da)
    u, _, vh = np.linalg.svd(a, full_matrices=False)
    want = np.einsum("...ji,...jk,...ik->...i", u[..., :3], da, vh[..., :3, :])
    np.testing.assert_allclose(ds[..., :3], want, atol=1e-10)
    np.testing.assert_array_equal(ds[..., 3:], 0)


def test_jacfwd_jacrev_hessian_agree():
    rng = np.random.default_rng(10)
    a, b = well_conditioned(rng, (), 5, 3), random(rng, (5,))
    f = lambda a: jnp.sum(jnp.sin(jf.linalg.lstsq(a, b).solution)) + jf.linalg.lstsq(a, b).residuals[0]
    np.testing.assert_allclose(jax.jit(jax.jacfwd(f))(a), jax.jit(jax.jacrev(f))(a), atol=1e-12)
    h = jax.jit(jax.hessian(f))(a).reshape(15, 15)
    np.testing.assert_allclose(h, jax.jit(jax.jacrev(jax.jacfwd(f)))(a).reshape(15, 15), atol=1e-10)
    np.testing.assert_allclose(h, h.T, atol=1e-10)


# --- vmap, jit, sharding --------------------------------------------------------------------


@pytest.mark.parametrize("in_axes", [(0, 0), (1, None), (2, 1)])  # a: (3, 6, 4) with the 3 moved to in_axes[0]
def test_vmap_matches_loop(in_axes):
    rng = np.random.default_rng(11)
    a, b = random(rng, (3, 6, 4)), random(rng, (3, 6, 2))
    a = np.moveaxis(a, 0, in_axes[0])
    if in_axes[1] is None:
        b = b[0]
    else:
        b = np.moveaxis(b, 0, in_axes[1])
    batched = jax.vmap(solution, in_axes=in_axes)(a, b)
    take = lambda x, ax, i: x if ax is None else np.take(x, i, ax)
    looped = np.stack([np.linalg.lstsq(take(a, in_axes[0], i), take(b, in_axes[1], i))[0] for i in range(3)])
    np.testing.assert_allclose(batched, looped, atol=1e-12)


def test_nested_vmap_of_grad_matches_loop():
    rng = np.random.default_rng(12)
    a, b = well_conditioned(rng, (2, 3), 5, 3), random(rng, (2, 3, 5))
    loss = lambda a, b: jnp.sum(solution(a, b) ** 2)
    nested = jax.jit(jax.vmap(jax.vmap(jax.grad(loss))))(a, b)
    grad = jax.jit(jax.grad(loss))
    looped = np.stack([np.stack([grad(a[i, j], b[i, j]) for j in range(3)]) for i in range(2)])
    np.testing.assert_allclose(nested, looped, atol=1e-12)


@pytest.mark.parametrize("m,n", [(6, 4), (140, 132)])  # 132 columns: R⁻¹ by halves
def test_sharded_batch_partitions_without_gathering(m, n):
    mesh = jax.make_mesh((8,), ("batch",))
    sharding = NamedSharding(mesh, PartitionSpec("batch"))
    rng = np.random.default_rng(13)
    a = jax.device_put(well_conditioned(rng, (16,), m, n), sharding)
    b = jax.device_put(random(rng, (16, m, 2)), sharding)
    loss = lambda a, b: jnp.sum(solution(a, b) ** 2)
    f = jax.jit(jax.vmap(jax.grad(loss)))
    hlo = f.lower(a, b).compile().as_text()
    # The only communication is the one-byte "is any matrix rank-deficient" predicate.
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    for line in re.findall(r"[^\n]*all-reduce\([^\n]*", hlo):
        assert re.search(r"= pred\[\] all-reduce", line), line
    grads = f(a, b)
    assert grads.sharding.spec[0] == "batch"
    np.testing.assert_allclose(grads, jax.jit(jax.vmap(jax.grad(loss)))(np.asarray(a), np.asarray(b)), atol=1e-12)


@pytest.mark.parametrize("name", [n for n, (_, tags) in SHAPES.items() if "test" in tags])
def test_named_shapes(name):
    batch, m, n, k = SHAPES[name][0]
    rng = np.random.default_rng(14)
    a, b = random(rng, (batch, m, n)), random(rng, (batch, m, k))
    np.testing.assert_allclose(solution(a, b), numpy_lstsq(a, b)[0], atol=1e-11)


@pytest.mark.timeout(120)
def test_large_batches_do_not_deadlock_the_cpu_thread_pool():
    """jaxlib's CPU LAPACK kernels share the XLA pool; our chained calls never run side by side."""
    rng = np.random.default_rng(15)
    a, b = random(rng, (1024, 24, 8)).astype(np.float32), random(rng, (1024, 24, 1)).astype(np.float32)
    f = jax.jit(lambda a, b: jf.linalg.lstsq(a, b))
    g = jax.jit(jax.grad(lambda a, b: jnp.sum(jf.linalg.lstsq(a, b).solution ** 2), argnums=(0, 1)))
    for _ in range(5):
        jax.block_until_ready((f(a, b), g(a, b)))
    np.testing.assert_allclose(f(a, b).solution[7], np.linalg.lstsq(a[7], b[7])[0], rtol=1e-4, atol=1e-5)


def test_batch_sharded_differently_is_a_clear_error():
    mesh = jax.make_mesh((8,), ("batch",))
    a = jax.device_put(np.zeros((8, 5, 3)), NamedSharding(mesh, PartitionSpec("batch")))
    b = jax.device_put(np.zeros((8, 5, 1)), NamedSharding(mesh, PartitionSpec()))
    with pytest.raises(ValueError, match=r"lstsq: the batch dims of `a` and `b` are sharded differently"):
        jax.jit(jf.linalg.lstsq)(a, b)
