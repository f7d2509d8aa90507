"""sylvester_p (polar's solves with P, differentiated in P alone): every lowering against the
Kronecker-form reference in float64, derivatives by check_grads to third order where P's
eigenvalues repeat (through the factors they would be NaN or wrong), vmap against a loop, jit,
an explicit mesh, and errors naming the operand."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

from jaxforge.lowering.linalg.sylvester import IMPLEMENTATIONS
from jaxforge.primitives.linalg import sylvester_p, sylvester_reference
from tests.linalg_inputs import random, unitary
from tests.transforms.test_sharding_rules import collectives, compiled

EIGENVALUES = {"distinct": [3.0, 2.0, 1.0, 0.5], "a tie": [3.0, 2.0, 2.0, 0.5], "all equal": [1.0, 1.0, 1.0, 1.0]}


def hermitian(rng, eigenvalues, batch=(), complex_=False):
    """``V diag(s) Vᴴ`` with random unitary ``V``: ``(p, s, v)``, the eigenvalues exactly as given."""
    n, dtype = len(eigenvalues), np.complex128 if complex_ else np.float64
    v = np.stack([unitary(rng, n, dtype) for _ in range(math.prod(batch))]).reshape(*batch, n, n)
    s = np.broadcast_to(np.asarray(eigenvalues), (*batch, n)).copy()
    return (v * s[..., None, :]) @ np.conj(np.swapaxes(v, -1, -2)), s, v


def rhs(rng, shape, two_sided, complex_=False):
    c = random(rng, shape, np.complex128 if complex_ else np.float64)
    return c - np.conj(np.swapaxes(c, -1, -2)) if two_sided else c


def solve(p, c, two_sided):
    """The primitive as a function of ``p`` alone: its eigendecomposition taken here, for its values
    (as polar reads its SVD's factors)."""
    s, v = jax.lax.stop_gradient(jnp.linalg.eigh(p))
    return sylvester_p.bind(p, s, v, c, two_sided=two_sided)[0]


@pytest.mark.parametrize("lowering", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("complex_", [False, True])
@pytest.mark.parametrize("two_sided, rows", [(True, 4), (False, 6), (False, 2)])
@pytest.mark.parametrize("values", list(EIGENVALUES))
def test_lowering_matches_reference(lowering, complex_, two_sided, rows, values):
    rng = np.random.default_rng(0)
    p, s, v = hermitian(rng, EIGENVALUES[values], (3,), complex_)
    c = rhs(rng, (3, rows, 4), two_sided, complex_)
    (x,) = jax.jit(IMPLEMENTATIONS[lowering], static_argnames="two_sided")(p, s, v, c, two_sided=two_sided)
    (want,) = sylvester_reference(p, s, v, c, two_sided=two_sided)
    np.testing.assert_allclose(x, want, rtol=1e-12, atol=1e-12)
    residual = p @ x + x @ p if two_sided else x @ p
    np.testing.assert_allclose(residual, c, atol=1e-12)


@pytest.mark.parametrize("complex_", [False, True])
@pytest.mark.parametrize("two_sided", [True, False])
@pytest.mark.parametrize("values", list(EIGENVALUES))
def test_derivatives_to_third_order(values, two_sided, complex_):
    """In ``p`` and ``c`` at once, along Hermitian directions of ``p`` (its eigendecomposition reads
    one triangle) and skew-Hermitian ones of a two-sided ``c`` (real input drops the diagonal, which
    only such a ``c`` has none of in every eigenbasis); the third order where eigenvalues repeat is
    what polar's Hessians need of it."""
    rng = np.random.default_rng(1)
    p, _, _ = hermitian(rng, EIGENVALUES[values], complex_=complex_)
    c = rhs(rng, (4 if two_sided else 3, 4), two_sided, complex_)

    def f(h, c):
        c = (c - jnp.conj(c.T)) / 2 if two_sided else c
        return solve(p + (h + jnp.conj(h.T)) / 2, c, two_sided)

    # rtol: a third-order central difference of entries ~1e4 is good to ~1e-6 (check_grads defaults to 1e-5)
    check_grads(f, (np.zeros_like(p), c), order=3 if values != "distinct" else 2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-5)


def test_its_transpose_is_the_solve_with_p_conjugated():
    rng = np.random.default_rng(2)
    p, s, v = hermitian(rng, EIGENVALUES["a tie"], complex_=True)
    ct = rng.standard_normal((4, 4)) + 1j * rng.standard_normal((4, 4))
    for two_sided in (True, False):
        linear = lambda c: sylvester_p.bind(p, s, v, c, two_sided=two_sided)[0]  # noqa: E731
        (got,) = jax.linear_transpose(linear, ct)(ct)
        dense = jax.jacfwd(linear, holomorphic=True)(ct.astype(complex)).reshape(16, 16)
        np.testing.assert_allclose(got.reshape(16), dense.T @ ct.reshape(16), atol=1e-12)


def test_vmap_over_any_axis_matches_a_loop_and_jit_matches_eager():
    rng = np.random.default_rng(3)
    p, s, v = hermitian(rng, EIGENVALUES["a tie"], (3,))
    c = rhs(rng, (3, 5, 4), False)
    bind = lambda p, s, v, c: sylvester_p.bind(p, s, v, c, two_sided=False)[0]  # noqa: E731
    moved = [np.moveaxis(x, 0, -1) for x in (p, s, v, c)]
    batched = jax.vmap(bind, in_axes=-1)(*moved)
    looped = np.stack([bind(p[i], s[i], v[i], c[i]) for i in range(3)])
    np.testing.assert_allclose(batched, looped, rtol=1e-13, atol=1e-14)
    unbatched_p = jax.vmap(bind, in_axes=(None, None, None, 0))(p[0], s[0], v[0], c)
    np.testing.assert_allclose(unbatched_p, np.stack([bind(p[0], s[0], v[0], x) for x in c]), rtol=1e-13, atol=1e-14)
    np.testing.assert_array_equal(jax.jit(bind)(p, s, v, c), bind(p, s, v, c))


def test_a_batch_split_over_an_explicit_mesh_stays_split():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(4)
    p, s, v = hermitian(rng, EIGENVALUES["a tie"], (16,))
    c = rhs(rng, (16, 4, 4), True)
    loss = lambda p, s, v, c: jnp.sum(jnp.sin(sylvester_p.bind(p, s, v, c, two_sided=True)[0]))  # noqa: E731
    with jax.set_mesh(mesh):
        split = [jax.device_put(x, NamedSharding(mesh, P("batch"))) for x in (p, s, v, c)]
        grad = jax.jit(jax.grad(loss, argnums=(0, 3)))(*split)
        assert collectives(compiled(jax.grad(loss, argnums=(0, 3)), *split)) == {}
    assert grad[0].sharding.spec[0] == grad[1].sharding.spec[0] == "batch"
    for got, want in zip(grad, jax.grad(loss, argnums=(0, 3))(p, s, v, c)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(c=np.zeros((3, 4))), r"sylvester: `c` has shape \(3, 4\); .* two_sided=True, it must be \(4, 4\)"),
        (dict(s=np.zeros(3)), r"sylvester: `s` has shape \(3,\); .* it must be \(4,\)"),
        (dict(v=np.zeros((4, 4), np.float32)), r"sylvester: `v` has dtype float32, `p` float64; they must match"),
        (dict(s=np.zeros(4, np.float32)), r"sylvester: `s` has dtype float32; accepted: float64"),
        (dict(p=np.zeros((4, 4), np.int32)), r"sylvester: `p` has dtype int32; accepted dtypes are float32"),
    ],
)
def test_bad_operands_are_refused_by_name(change, message):
    operands = dict(p=np.eye(4), s=np.ones(4), v=np.eye(4), c=np.zeros((4, 4)))
    operands.update(change)
    with pytest.raises((TypeError, ValueError), match=message):
        jax.eval_shape(lambda *x: sylvester_p.bind(*x, two_sided=True), *operands.values())
