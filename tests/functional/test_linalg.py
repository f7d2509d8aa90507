"""svdvals, pinv and matrix_rank (functional/linalg.py, on svd_p): against numpy in float64, their
derivatives by check_grads and against jax.numpy's, vmap against a loop, jit, and split over an
explicit mesh; export with a symbolic batch for these and polar (test_linalg_polar.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jaxforge as jf

from tests.transforms.test_sharding_rules import collectives, compiled


def of_rank(rng, shape, rank, complex_=False):
    """A ``(..., m, n)`` batch of rank ``rank``, singular values about 1 (a product of two factors)."""
    *batch, m, n = shape
    draw = lambda s: rng.standard_normal(s) + (1j * rng.standard_normal(s) if complex_ else 0)  # noqa: E731
    return draw((*batch, m, rank)) @ draw((*batch, rank, n))


def with_values(rng, values, m, n):
    """An ``m × n`` matrix with singular values ``values`` (descending) and random vectors."""
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = np.zeros((m, n))
    s[np.arange(len(values)), np.arange(len(values))] = values
    return u @ s @ v.T


CASES = {  # name: a, full rank or not
    "tall": lambda r: r.standard_normal((7, 4)),
    "wide batch": lambda r: r.standard_normal((3, 4, 9)),
    "square batch": lambda r: r.standard_normal((2, 3, 5, 5)),
    "complex tall": lambda r: of_rank(r, (2, 6, 3), 3, complex_=True),
    "rank 2 of 5x4": lambda r: of_rank(r, (5, 4), 2),
    "complex rank 1 wide": lambda r: of_rank(r, (3, 2, 5), 1, complex_=True),
    "zero": lambda r: np.zeros((3, 4)),
    "empty rows": lambda r: np.zeros((2, 0, 3)),
    "empty columns": lambda r: np.zeros((3, 0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pinv_and_matrix_rank_match_numpy(name):
    a = CASES[name](np.random.default_rng(0))
    np.testing.assert_allclose(jf.linalg.pinv(a), np.linalg.pinv(a) if a.size else np.zeros(a.shape[:-2] + a.shape[-1:-3:-1]), rtol=1e-10, atol=1e-12)
    want = np.linalg.matrix_rank(a) if a.size else np.zeros(a.shape[:-2], int)
    np.testing.assert_array_equal(jf.linalg.matrix_rank(a), want)
    assert jf.linalg.matrix_rank(a).dtype == jnp.int32
    np.testing.assert_allclose(jf.linalg.svdvals(a), np.linalg.svd(a, compute_uv=False), rtol=1e-12, atol=1e-12)


def hermitian_with(rng, values, complex_=False):
    """``W diag(values) Wᴴ``, ``W`` a random unitary."""
    z = rng.standard_normal((len(values),) * 2) + (1j * rng.standard_normal((len(values),) * 2) if complex_ else 0)
    w, _ = np.linalg.qr(z)
    return (w * np.asarray(values)) @ np.conj(w.T)


HERMITIAN = {
    "positive definite batch": lambda r: np.stack([hermitian_with(r, r.random(5) + 0.5) for _ in range(3)]),
    "indefinite, rank 3": lambda r: hermitian_with(r, [3.0, -2.0, 0.5, 0.0, 0.0]),
    "complex, rank 2": lambda r: hermitian_with(r, [0.0, -1.5, 2.0, 0.0], complex_=True),
}


@pytest.mark.parametrize("name", list(HERMITIAN))
def test_hermitian_input_takes_an_eigendecomposition_with_the_same_results(name):
    a = HERMITIAN[name](np.random.default_rng(10))
    n = a.shape[-1]
    want = np.linalg.pinv(a, rcond=np.finfo(np.float64).eps * n, hermitian=True)
    np.testing.assert_allclose(jf.linalg.pinv(a, hermitian=True), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(jf.linalg.pinv(a), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(jf.linalg.matrix_rank(a, hermitian=True), np.linalg.matrix_rank(a, hermitian=True))
    np.testing.assert_array_equal(jf.linalg.matrix_rank(a, hermitian=True), jf.linalg.matrix_rank(a))
    hermitian_part = lambda x: (x + jnp.conj(jnp.swapaxes(x, -1, -2))) / 2  # noqa: E731  tangents stay Hermitian
    check_grads(lambda x: jf.linalg.pinv(hermitian_part(x), 1e-3, hermitian=True), (a,), order=2, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


def test_float32_pinv_is_accurate_to_its_precision():
    a = np.random.default_rng(1).standard_normal((8, 12, 10))
    got = jf.linalg.pinv(a.astype(np.float32))
    assert got.dtype == jnp.float32
    want = np.linalg.pinv(a)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 2e-4


def test_tolerances_follow_torch():
    """``tol = max(atol, rtol · s_max)``; both None: ``rtol = eps · max(m, n)``; atol alone: rtol 0.
    Per-matrix arrays broadcast against the batch."""
    rng = np.random.default_rng(2)
    a = np.stack([with_values(rng, [10.0, 1.0, 1e-3], 5, 3), with_values(rng, [10.0, 1e-8, 1e-14], 5, 3)])
    rank = lambda **tols: np.asarray(jf.linalg.matrix_rank(a, **tols))  # noqa: E731
    np.testing.assert_array_equal(rank(), [3, 2])
    np.testing.assert_array_equal(rank(atol=1e-2), [2, 1])  # rtol 0 beside atol
    np.testing.assert_array_equal(rank(rtol=1e-2), [2, 1])
    np.testing.assert_array_equal(rank(atol=1e-9, rtol=1e-2), [2, 1])  # the larger one counts
    np.testing.assert_array_equal(rank(atol=jnp.asarray([1e-2, 0.0])), [2, 3])  # atol 0, rtol 0: all but zeros
    np.testing.assert_array_equal(rank(rtol=np.asarray([1e-3, 1e-10]), atol=jnp.asarray([0.0, -1.0])), [2, 2])
    jitted = jax.jit(lambda a, atol: jf.linalg.matrix_rank(a, atol=atol))
    np.testing.assert_array_equal(jitted(a, 0.5), [2, 1])
    truncated = np.linalg.pinv(a, rcond=1e-2)
    np.testing.assert_allclose(jf.linalg.pinv(a, 1e-2), truncated, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(jax.jit(lambda a, t: jf.linalg.pinv(a, atol=t))(a, 0.5), truncated, rtol=1e-10, atol=1e-12)


DERIVATIVE_CASES = {  # name: (a, rtol)
    "tall": (lambda r: r.standard_normal((5, 3)), None),
    "complex wide batch": (lambda r: r.standard_normal((2, 2, 4)) + 1j * r.standard_normal((2, 2, 4)), None),
    "repeated values": (lambda r: 2.0 * np.eye(4)[:, :3], None),
    "rank 2, truncated": (lambda r: of_rank(r, (4, 5), 2), 1e-3),
}


@pytest.mark.parametrize("name", list(DERIVATIVE_CASES))
def test_pinv_derivatives_second_order(name):
    """Golub–Pereyra's rule, forward and reverse to second order: finite where an SVD's derivative is
    not (repeated values), and on a rank-deficient matrix the derivative of its truncation."""
    build, rtol = DERIVATIVE_CASES[name]
    a = build(np.random.default_rng(3))
    check_grads(lambda a: jf.linalg.pinv(a, rtol), (a,), order=2, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


def test_pinv_gradient_matches_jax_numpy():
    rng = np.random.default_rng(4)
    a, w = rng.standard_normal((3, 6, 4)), rng.standard_normal((3, 4, 6))
    loss = lambda pinv: lambda a: jnp.sum(jnp.sin(pinv(a)) * w)  # noqa: E731
    np.testing.assert_allclose(
        jax.grad(loss(jf.linalg.pinv))(a), jax.grad(loss(lambda a: jnp.linalg.pinv(a, rtol=4 * 6 * 1e-16)))(a), rtol=1e-9, atol=1e-11
    )


def test_tolerances_get_no_gradient_and_svdvals_is_finite_at_repeated_values():
    a = np.random.default_rng(5).standard_normal((4, 3))
    assert jax.grad(lambda t: jnp.sum(jf.linalg.pinv(a, t)))(0.1) == 0.0
    np.testing.assert_allclose(jax.grad(lambda a: jnp.sum(jf.linalg.svdvals(a)))(np.eye(3)), np.eye(3), atol=1e-12)
    check_grads(jf.linalg.svdvals, (a,), order=2, modes=("fwd", "rev"))


def test_vmap_matches_a_loop_and_jit_matches_eager():
    rng = np.random.default_rng(6)
    a, atol = rng.standard_normal((4, 5, 3)), np.asarray([0.0, 0.5, 1.0, 10.0])
    for fn in (lambda a, t: jf.linalg.pinv(a, atol=t), lambda a, t: jf.linalg.matrix_rank(a, atol=t)):
        looped = np.stack([fn(x, t) for x, t in zip(a, atol)])
        np.testing.assert_allclose(jax.vmap(fn)(a, atol), looped, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(jax.jit(fn)(a, atol), looped, rtol=1e-12, atol=1e-14)
    grads = jax.vmap(jax.grad(lambda x: jnp.sum(jf.linalg.pinv(x) ** 2)))(a)
    np.testing.assert_allclose(grads, np.stack([jax.grad(lambda x: jnp.sum(jf.linalg.pinv(x) ** 2))(x) for x in a]), rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("hermitian", [False, True])
def test_nan_input_gives_nan_and_rank_zero(hermitian, dtype):
    """A diagonal matrix with a NaN (LAPACK's eigh returns it finite vectors: the NaN must come
    from the values) and a full one."""
    a = np.random.default_rng(7).standard_normal((3, 4, 4))
    a = (a + np.swapaxes(a, -1, -2)).astype(dtype)
    a[1] = np.diag([1.0, 2.0, np.nan, 4.0])
    a[2, 2, 2] = np.nan
    p = np.asarray(jf.linalg.pinv(a, hermitian=hermitian))
    assert np.isfinite(p[0]).all() and np.isnan(p[1:]).all()
    np.testing.assert_array_equal(jf.linalg.matrix_rank(a, hermitian=hermitian), [4, 0, 0])


def test_a_batch_split_over_an_explicit_mesh_stays_split():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
    a = np.random.default_rng(8).standard_normal((16, 6, 4))
    loss = lambda a: jnp.sum(jf.linalg.pinv(a) ** 2)  # noqa: E731
    with jax.set_mesh(mesh):
        split = jax.device_put(a, NamedSharding(mesh, P("batch")))
        p, grad, rank = jax.jit(jf.linalg.pinv)(split), jax.jit(jax.grad(loss))(split), jax.jit(jf.linalg.matrix_rank)(split)
        assert collectives(compiled(jax.grad(loss), split)) == {}
    assert p.sharding.spec[0] == grad.sharding.spec[0] == rank.sharding.spec[0] == "batch"
    np.testing.assert_allclose(p, np.linalg.pinv(a), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, jax.grad(loss)(a), rtol=1e-10, atol=1e-12)


def test_export_with_a_symbolic_batch():
    (batch,) = jax.export.symbolic_shape("b")
    a = np.random.default_rng(9).standard_normal((4, 5, 3))
    grad = lambda a: jax.grad(lambda a: jnp.sum(jf.linalg.pinv(a)))(a)  # noqa: E731
    polar_grad = lambda a: jax.grad(lambda a: jnp.sum(jnp.sin(jf.linalg.polar(a)[0])))(a)  # noqa: E731
    for fn in (jf.linalg.pinv, jf.linalg.matrix_rank, jf.linalg.svdvals, grad, jf.linalg.polar, polar_grad):
        exported = jax.export.export(jax.jit(fn))(jax.ShapeDtypeStruct((batch, 5, 3), jnp.float64))
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12), exported.call(a), fn(a))
