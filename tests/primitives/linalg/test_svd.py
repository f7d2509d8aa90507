"""svd_p: values against numpy, invariants, derivatives of every order, vmap, jit and sharding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding, PartitionSpec
from jax.test_util import check_grads

import jaxforge as jf
from jaxforge.primitives.linalg import svd_reference
from jaxforge.primitives.linalg.svd import SHAPES, svd_p
from tests.linalg_inputs import random, well_conditioned, with_singular_values

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
CORE_SHAPES = [(5, 3), (3, 5), (4, 4), (1, 6), (6, 1)]


def eps(dtype) -> float:
    return float(np.finfo(dtype).eps)


def fix_gauge(u, vh):
    """Rotates each column pair (u_j, v_j) by the phase that makes u's largest entry real > 0."""
    idx = jax.lax.stop_gradient(jnp.argmax(jnp.abs(u), axis=-2, keepdims=True))
    pivot = jnp.take_along_axis(u, idx, axis=-2)
    phase = pivot / jnp.abs(pivot)
    return u * jnp.conj(phase), vh * jnp.swapaxes(phase, -1, -2)


def gauge_fixed_svd(a, **kw):
    u, s, vh = jf.linalg.svd(a, **kw)
    u, vh = fix_gauge(u, vh)
    return u, s, vh


# --- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("full_matrices", [False, True])
@pytest.mark.parametrize("m,n", CORE_SHAPES)
def test_matches_numpy_and_invariants(dtype, full_matrices, m, n):
    rng = np.random.default_rng(0)
    a = random(rng, (2, 3, m, n), dtype)
    u, s, vh = jf.linalg.svd(a, full_matrices=full_matrices)
    s_np = np.linalg.svd(a.astype(np.complex128 if np.iscomplexobj(a) else np.float64), compute_uv=False)
    k = min(m, n)
    assert u.shape == (2, 3, m, m if full_matrices else k) and u.dtype == dtype
    assert vh.shape == (2, 3, n if full_matrices else k, n) and vh.dtype == dtype
    assert s.dtype == np.finfo(dtype).dtype
    tol = 50 * eps(dtype) * np.sqrt(max(m, n))
    np.testing.assert_allclose(s, s_np, rtol=tol, atol=tol * s_np.max())
    assert np.all(np.diff(np.asarray(s), axis=-1) <= 0), "singular values must be sorted descending"
    recon = (u[..., :, :k] * s[..., None, :].astype(dtype)) @ vh[..., :k, :]
    assert np.linalg.norm(recon - a) / np.linalg.norm(a) <= tol
    for q in (u, np.conj(np.swapaxes(vh, -1, -2))):
        gram = np.asarray(np.conj(np.swapaxes(q, -1, -2)) @ q)
        assert np.abs(gram - np.eye(q.shape[-1])).max() <= tol


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_float64_vectors_match_numpy_to_1e12(dtype):
    rng = np.random.default_rng(1)
    a = well_conditioned(rng, (3,), 7, 5, dtype)
    u, s, vh = gauge_fixed_svd(a)
    u_np, s_np, vh_np = np.linalg.svd(a, full_matrices=False)
    u_np, vh_np = fix_gauge(u_np, vh_np)
    np.testing.assert_allclose(s, s_np, rtol=1e-12)
    np.testing.assert_allclose(u, u_np, rtol=0, atol=1e-12)
    np.testing.assert_allclose(vh, vh_np, rtol=0, atol=1e-12)


def test_compute_uv_false_returns_singular_values_only():
    a = random(np.random.default_rng(2), (4, 6, 3))
    s = jf.linalg.svd(a, compute_uv=False)
    np.testing.assert_allclose(s, np.linalg.svd(a, compute_uv=False), rtol=1e-13)


@pytest.mark.parametrize("full_matrices", [False, True])
def test_jit_factors_no_singular_vectors_that_nothing_reads(full_matrices):
    """jit's dead-code elimination binds a values-only SVD where ``u`` and ``vh`` go unused (LAPACK
    then skips the vectors: ~5× less time at 1024×64×64 on CPU), not where a derivative reads them."""
    a = random(np.random.default_rng(4), (3, 6, 4))
    svd = functools.partial(jf.linalg.svd, full_matrices=full_matrices)
    programs = {  # whether the SVD bound after dead-code elimination computes u and vh
        "s of (u, s, vh)": (lambda a: svd(a)[1], False),
        "u": (lambda a: svd(a)[0], True),
        "vh": (lambda a: svd(a)[2], True),
        "grad of s": (jax.grad(lambda a: jnp.sum(svd(a)[1])), True),
    }
    for name, (f, vectors) in programs.items():
        jaxpr = jax.make_jaxpr(f)(a).jaxpr
        kept, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
        (eqn,) = [e for e in kept.eqns if e.primitive is svd_p]
        assert eqn.params["compute_uv"] is vectors and len(eqn.outvars) == (3 if vectors else 1), name
    np.testing.assert_allclose(jax.jit(programs["s of (u, s, vh)"][0])(a), np.linalg.svd(a, compute_uv=False), rtol=1e-13)


def test_reference_is_the_spec():
    a = random(np.random.default_rng(3), (2, 5, 4))
    s, u, vh = svd_reference(a)
    np.testing.assert_allclose(s, jf.linalg.svd(a, compute_uv=False), rtol=1e-13)
    np.testing.assert_allclose((u * s[..., None, :]) @ vh, a, atol=1e-13)


@pytest.mark.parametrize("full_matrices", [False, True])
@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0), (2, 0, 4)])
def test_empty_matrices_like_numpy(shape, full_matrices):
    a = np.zeros(shape)
    u, s, vh = jf.linalg.svd(a, full_matrices=full_matrices)
    u_np, s_np, vh_np = np.linalg.svd(a, full_matrices=full_matrices)
    for ours, theirs in ((u, u_np), (s, s_np), (vh, vh_np)):
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_give_nan_outputs_under_jit(bad):
    a = random(np.random.default_rng(4), (3, 5, 4))
    a[1, 2, 3] = bad
    u, s, vh = jax.jit(jf.linalg.svd)(a)
    assert np.all(np.isnan(s[1])) and np.all(np.isnan(u[1])) and np.all(np.isnan(vh[1]))
    np.testing.assert_allclose(s[0], np.linalg.svd(a[0], compute_uv=False), rtol=1e-13)


# --- derivatives ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("m,n", [(4, 3), (3, 4), (3, 3)])
def test_check_grads_order_2(dtype, m, n):
    a = well_conditioned(np.random.default_rng(5), (2,), m, n, dtype)
    both = lambda a: (jf.linalg.svd(a, compute_uv=False), gauge_fixed_svd(a))
    check_grads(jax.jit(both), (a,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("m,n", [(5, 3), (3, 5), (4, 4)])
def test_jvp_matches_reference_jvp(dtype, m, n):
    rng = np.random.default_rng(6)
    a = well_conditioned(rng, (3,), m, n, dtype)
    da = random(rng, a.shape, dtype)

    def reference(a):
        s, u, vh = svd_reference(a)
        u, vh = fix_gauge(u, vh)
        return u, s, vh

    ours = jax.jvp(gauge_fixed_svd, (a,), (da,))
    theirs = jax.jvp(reference, (a,), (da,))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-10), ours, theirs)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("m,n", [(5, 3), (3, 5)])
def test_full_matrices_derivative_convention(dtype, m, n):
    rng = np.random.default_rng(7)
    a = well_conditioned(rng, (), m, n, dtype)
    da = random(rng, a.shape, dtype)
    k = min(m, n)
    (u, s, vh), (du, ds, dvh) = jax.jvp(functools.partial(jf.linalg.svd, full_matrices=True), (a,), (da,))
    (u_t, s_t, _), (du_t, ds_t, dvh_t) = jax.jvp(jf.linalg.svd, (a,), (da,))
    # s and the first k columns: exactly the thin derivatives, in the thin call's gauge (a GPU
    # takes the two from different algorithms: u[:, :k] = u_t diag(phases), vh[:k] = diag(phases)ᴴ vh_t).
    phases = np.sum(np.conj(u_t) * u[:, :k], axis=0)[None]
    np.testing.assert_allclose(np.abs(phases), 1, rtol=1e-10)
    np.testing.assert_allclose(ds, ds_t, rtol=1e-12)
    np.testing.assert_allclose(du[:, :k], du_t * phases, atol=1e-12)
    np.testing.assert_allclose(dvh[:k], np.conj(phases).T * dvh_t, atol=1e-12)
    # The full factors stay unitary to first order, and the complement does not rotate in itself.
    for q, dq in ((u, du), (np.conj(vh.T), np.conj(dvh.T))):
        skew = np.conj(q.T) @ dq
        np.testing.assert_allclose(skew + np.conj(skew.T), 0, atol=1e-12)
        np.testing.assert_allclose(skew[k:, k:], 0, atol=1e-12)
    assert np.all(np.isfinite(du)) and np.all(np.isfinite(dvh))
    # The first k columns pass check_grads in full mode too.
    def first_k_columns(a):
        u, s, vh = jf.linalg.svd(a, full_matrices=True)
        return fix_gauge(u[:, :k], vh[:k])

    check_grads(jax.jit(first_k_columns), (a,), order=1, modes=("fwd", "rev"))


def test_complex_gauge_is_split_equally():
    rng = np.random.default_rng(8)
    a = well_conditioned(rng, (), 4, 3, np.complex128)
    da = random(rng, a.shape, np.complex128)
    (u, _, vh), (du, _, dvh) = jax.jvp(jf.linalg.svd, (a,), (da,))
    v, dv = np.conj(vh.T), np.conj(dvh.T)
    phase_u = np.imag(np.diagonal(np.conj(u.T) @ du))
    phase_v = np.imag(np.diagonal(np.conj(v.T) @ dv))
    np.testing.assert_allclose(phase_u, -phase_v, atol=1e-12)
    assert np.abs(phase_u).max() > 1e-3  # the split is exercised, not trivially zero


def test_degenerate_singular_values_exact_vs_broadened():
    a = np.diag([3.0, 1.0, 1.0])  # exactly repeated singular value 1
    da = random(np.random.default_rng(9), (3, 3))
    _, (du, ds, _) = jax.jvp(jf.linalg.svd, (a,), (da,))
    assert np.all(np.isfinite(ds)), "ds is finite even at a degenerate point"
    assert not np.all(np.isfinite(du)), "the exact derivative of u does not exist here"
    broadened = functools.partial(jf.linalg.svd, grad_eps=1e-8)
    _, (du_eps, ds_eps, dvh_eps) = jax.jvp(broadened, (a,), (da,))
    assert np.all(np.isfinite(du_eps)) and np.all(np.isfinite(dvh_eps))
    np.testing.assert_allclose(ds_eps, ds, rtol=1e-14)
    # The top singular vector is well separated: its exact derivative exists and broadening keeps it.
    assert np.all(np.isfinite(du[:, 0]))
    np.testing.assert_allclose(du_eps[:, 0], du[:, 0], atol=1e-8)
    grads = jax.grad(lambda a: jnp.sum(broadened(a)[0] ** 2 * jnp.arange(3.0)[None]))(a)
    assert np.all(np.isfinite(grads))


def test_zero_singular_values_broadened_gradient_is_finite():
    a = with_singular_values(np.random.default_rng(10), (), 5, 3, [2.0, 0.0, 0.0])
    loss = lambda a, eps: jnp.sum(jnp.abs(fix_gauge(*jf.linalg.svd(a, grad_eps=eps)[::2])[0]))
    assert np.all(np.isfinite(jax.grad(loss)(a, 1e-10)))


def test_broadening_converges_to_exact_for_distinct_values():
    a = well_conditioned(np.random.default_rng(11), (), 5, 4)
    exact = jax.jacfwd(lambda a: gauge_fixed_svd(a)[0])(a)
    broadened = jax.jacfwd(lambda a: gauge_fixed_svd(a, grad_eps=1e-12)[0])(a)
    np.testing.assert_allclose(broadened, exact, atol=1e-9)


def test_jacfwd_jacrev_hessian_agree():
    a = well_conditioned(np.random.default_rng(12), (), 4, 3)
    f = lambda a: jnp.sum(jf.linalg.svd(a, compute_uv=False) ** 3) + jnp.sum(gauge_fixed_svd(a)[0] ** 3)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(f))(a), jax.jit(jax.jacrev(f))(a), atol=1e-12)
    h_fwd = jax.jit(jax.jacfwd(jax.jacrev(f)))(a)
    np.testing.assert_allclose(jax.jit(jax.hessian(f))(a), h_fwd, atol=1e-10)
    np.testing.assert_allclose(h_fwd.reshape(12, 12), h_fwd.reshape(12, 12).T, atol=1e-10)


# --- vmap, jit, sharding --------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_vmap_over_any_axis_matches_loop(axis):
    a = random(np.random.default_rng(13), (3, 4, 5, 2))  # matrices are the last two dims after moving `axis`
    a = np.moveaxis(a, 0, axis)
    batched = jax.vmap(lambda x: jf.linalg.svd(x, compute_uv=False), in_axes=axis)(a)
    looped = np.stack([jf.linalg.svd(np.take(a, i, axis), compute_uv=False) for i in range(3)])
    np.testing.assert_allclose(batched, looped, rtol=1e-13)


def test_nested_vmap_and_vmap_of_grad():
    a = well_conditioned(np.random.default_rng(14), (2, 3), 4, 3)
    loss = lambda a: jnp.sum(jf.linalg.svd(a, compute_uv=False) * jnp.array([3.0, 2.0, 1.0]))
    nested = jax.vmap(jax.vmap(jax.grad(loss)))(a)
    looped = np.stack([np.stack([jax.grad(loss)(a[i, j]) for j in range(3)]) for i in range(2)])
    np.testing.assert_allclose(nested, looped, atol=1e-13)
    u, s, vh = jax.vmap(jax.vmap(jf.linalg.svd))(a)
    np.testing.assert_allclose(s, jf.linalg.svd(a, compute_uv=False), rtol=1e-13)


def test_jit_matches_eager():
    a = random(np.random.default_rng(15), (2, 6, 4))
    eager = jf.linalg.svd(a, full_matrices=True)
    jitted = jax.jit(functools.partial(jf.linalg.svd, full_matrices=True))(a)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), eager, jitted)


@pytest.mark.parametrize("full_matrices", [False, True])
def test_an_eager_vjp_of_a_new_shape_compiles_its_tangent_map_as_one_program(full_matrices, backend_compiles):
    """The jvp rule's tangent map is one jitted program: linearized and transposed, it compiles
    twice at a new shape, beside at most the transposes of the wrapper's dtype conversions (op by
    op, 16 programs with full matrices, 50 without)."""
    rng = np.random.default_rng(17)
    a = jnp.asarray(random(rng, (2, 8, 6)))
    svd = lambda a: jf.linalg.svd(a, full_matrices=full_matrices)  # noqa: E731
    cotangents = tuple(jnp.asarray(random(rng, o.shape)) for o in svd(a))  # the forward compiled too
    backend_compiles.clear()
    _, vjp = jax.vjp(svd, a)
    jax.block_until_ready(vjp(cotangents))
    assert len(backend_compiles) <= 4, backend_compiles


def test_sharded_batch_partitions_without_collectives():
    mesh = jax.make_mesh((8,), ("batch",))
    a = jax.device_put(random(np.random.default_rng(16), (16, 6, 4)), NamedSharding(mesh, PartitionSpec("batch")))
    loss = lambda a: jnp.sum(jf.linalg.svd(a, compute_uv=False) ** 2)  # per matrix: no reduction over the batch
    f = jax.jit(jax.vmap(jax.value_and_grad(loss)))
    hlo = f.lower(a).compile().as_text()
    for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
        assert f"{collective}(" not in hlo.replace("-start(", "("), collective
    u, s, vh = jax.jit(jf.linalg.svd)(a)
    assert u.sharding.spec[0] == "batch" and s.sharding.spec[0] == "batch"
    np.testing.assert_allclose(s, np.linalg.svd(np.asarray(a), compute_uv=False), rtol=1e-13)


def test_core_dims_sharded_is_a_clear_error():
    mesh = jax.make_mesh((8,), ("x",))
    a = jax.device_put(np.zeros((2, 16, 4)), NamedSharding(mesh, PartitionSpec(None, "x")))
    with pytest.raises(ValueError, match=r"svd: `a` is sharded along a core dim.*reshard it first to P\(None, None, None\)"):
        jax.jit(jf.linalg.svd)(a)


@pytest.mark.parametrize("name", [n for n, (_, tags) in SHAPES.items() if "test" in tags])
def test_named_shapes(name):
    batch, m, n = SHAPES[name][0]
    a = random(np.random.default_rng(17), (batch, m, n))
    u, s, vh = jf.linalg.svd(a)
    np.testing.assert_allclose((u * s[..., None, :]) @ vh, a, atol=1e-12)
