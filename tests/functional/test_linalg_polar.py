"""polar (functional/linalg.py, on svd_p with its own derivative): against scipy in float64, the
factors' invariants, derivatives by check_grads to second order, also where singular values repeat
(where the SVD's own derivatives fail), vmap against a loop, jit, an explicit mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxforge as jf

from tests.functional.test_linalg import of_rank, with_values
from tests.transforms.test_sharding_rules import collectives, compiled

CASES = {
    "tall": lambda r: r.standard_normal((7, 4)),
    "wide": lambda r: r.standard_normal((3, 5)),
    "square batch": lambda r: r.standard_normal((2, 3, 4, 4)),
    "complex tall batch": lambda r: of_rank(r, (2, 6, 3), 3, complex_=True),
    "complex wide": lambda r: of_rank(r, (3, 5), 3, complex_=True),
}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_scipy_and_factors_as_promised(name, side):
    a = CASES[name](np.random.default_rng(0))
    u, p = jf.linalg.polar(a, side)
    for a_i, u_i, p_i in zip(a.reshape(-1, *a.shape[-2:]), np.reshape(u, (-1, *u.shape[-2:])), np.reshape(p, (-1, *p.shape[-2:]))):
        want_u, want_p = scipy.linalg.polar(a_i, side)
        np.testing.assert_allclose(u_i, want_u, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(p_i, want_p, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(p_i, p_i.conj().T)  # Hermitian to the bit
        assert np.linalg.eigvalsh(p_i).min() > -1e-12
        np.testing.assert_allclose(u_i @ p_i if side == "right" else p_i @ u_i, a_i, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, side", [(name, ("right", "left")[i % 2]) for i, name in enumerate(CASES)])
def test_derivatives_second_order(name, side):
    a = CASES[name](np.random.default_rng(1))
    check_grads(lambda a: jf.linalg.polar(a, side), (a,), order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(3, 3), (5, 3), (3, 5)])
def test_derivatives_where_singular_values_repeat(shape):
    """U is smooth where singular values repeat: its derivative meets 1/(s_j + s_k) only, and its
    higher ones stay in sylvester_p. Through an SVD (jax.scipy.linalg.polar's method="svd") the
    first is NaN at an exact tie and off by 8% at a tie rounded apart (2026-12-07), and so were
    jaxforge's second derivatives until they left the SVD's rule (at an orthogonal 4×4 a
    Hessian-vector product was off by 2.9 in 3.8); here all match finite differences, at ties
    rounded apart, exact, and at a matrix with orthonormal columns (all singular values 1)."""
    m, n = shape
    rng = np.random.default_rng(2)
    rounded_apart = with_values(rng, [2.0, 2.0, 1.0], m, n)
    exact = np.zeros((m, n))
    exact[:3, :3] = np.diag([2.0, 2.0, 1.0])
    orthonormal = with_values(rng, [1.0, 1.0, 1.0], m, n)
    for a in (rounded_apart, exact, orthonormal):
        check_grads(lambda a: jf.linalg.polar(a), (a,), order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_hessians_agree_and_are_symmetric_at_a_tie():
    a = with_values(np.random.default_rng(8), [2.0, 2.0, 1.0], 4, 3)
    f = lambda a: jnp.sum(jnp.sin(jf.linalg.polar(a)[0])) + jnp.sum(jf.linalg.polar(a, "left")[1] ** 2)  # noqa: E731
    fwd_over_rev = jax.jit(jax.jacfwd(jax.jacrev(f)))(a).reshape(12, 12)
    np.testing.assert_allclose(jax.jit(jax.jacrev(jax.jacrev(f)))(a).reshape(12, 12), fwd_over_rev, atol=1e-10)
    np.testing.assert_allclose(fwd_over_rev, fwd_over_rev.T, atol=1e-10)


def test_a_gradient_through_the_unitary_factor_alone():
    """Orthogonal Procrustes: the rotation nearest carrying ``x`` onto ``y`` is the polar factor of
    ``xᵀy``; its gradient in ``y`` (a loss on the aligned points) against jnp's SVD route away from
    ties, where both are exact."""
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((10, 3)), rng.standard_normal((10, 3))

    def misfit(polar_u):
        return lambda y: jnp.sum((x @ polar_u(x.T @ y) - y) ** 2)

    def svd_route(a):
        w, _, vh = jnp.linalg.svd(a)
        return w @ vh

    np.testing.assert_allclose(
        jax.grad(misfit(lambda a: jf.linalg.polar(a)[0]))(y), jax.grad(misfit(svd_route))(y), rtol=1e-10, atol=1e-12
    )


def test_vmap_matches_a_loop_and_jit_matches_eager():
    a = np.random.default_rng(4).standard_normal((4, 5, 3))
    grad = jax.grad(lambda x: jnp.sum(jf.linalg.polar(x)[1] ** 2) + jnp.sum(jnp.sin(jf.linalg.polar(x, "left")[0])))
    np.testing.assert_allclose(jax.vmap(grad)(a), np.stack([grad(x) for x in a]), rtol=1e-12, atol=1e-14)
    for got, want in zip(jax.jit(jf.linalg.polar, static_argnums=1)(a, "left"), jf.linalg.polar(a, "left")):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)


def test_nan_empty_and_rank_deficient_input():
    u, p = jf.linalg.polar(np.array([[1.0, np.nan], [0.0, 1.0], [2.0, 0.0]]))
    assert np.isnan(u).all() and np.isnan(p).all()
    for shape, side, shapes in [((2, 0, 3), "right", [(2, 0, 3), (2, 3, 3)]), ((0, 3), "left", [(0, 3), (0, 0)])]:
        u, p = jf.linalg.polar(np.zeros(shape), side)
        assert [u.shape, p.shape] == shapes and not np.any(u) and not np.any(p)
    # a real square matrix of one zero singular value: the derivative of the branch its SVD chose
    grad = jax.grad(lambda a: jnp.sum(jf.linalg.polar(a)[0] * np.arange(4.0).reshape(2, 2)))(np.diag([1.0, 0.0]))
    assert np.isfinite(grad).all()
    u, p = jf.linalg.polar(of_rank(np.random.default_rng(5), (5, 3), 2))  # U not unique; A = UP still
    np.testing.assert_allclose(u @ p, of_rank(np.random.default_rng(5), (5, 3), 2), rtol=1e-12, atol=1e-12)


def test_float32_is_accurate_to_its_precision():
    a = np.random.default_rng(6).standard_normal((8, 6, 4))
    u, p = jf.linalg.polar(a.astype(np.float32))
    assert u.dtype == p.dtype == jnp.float32
    want = np.stack([scipy.linalg.polar(x)[0] for x in a])
    np.testing.assert_allclose(u, want, rtol=0, atol=1e-5)


def test_an_unknown_side_is_refused_by_name():
    # (a's dtype and rank: test_linalg_errors.py, with svd's other companions)
    with pytest.raises(ValueError, match=r"polar: `side` must be 'right' or 'left', got 'up'"):
        jf.linalg.polar(np.eye(3), side="up")


def test_a_batch_split_over_an_explicit_mesh_stays_split():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
    a = np.random.default_rng(7).standard_normal((16, 6, 4))
    loss = lambda a: jnp.sum(jnp.sin(jf.linalg.polar(a)[0]))  # noqa: E731
    with jax.set_mesh(mesh):
        split = jax.device_put(a, NamedSharding(mesh, P("batch")))
        (u, _), grad = jax.jit(jf.linalg.polar)(split), jax.jit(jax.grad(loss))(split)
        assert collectives(compiled(jax.grad(loss), split)) == {}
    assert u.sharding.spec[0] == grad.sharding.spec[0] == "batch"
    np.testing.assert_allclose(grad, jax.grad(loss)(a), rtol=1e-10, atol=1e-12)
