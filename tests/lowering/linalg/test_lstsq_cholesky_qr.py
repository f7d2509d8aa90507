"""CholeskyQR2, the GPU factor of large tall float32 least squares, run on CPU: accuracy against
float64 numpy, its on-device fallback to Householder, and that the cuda lowering picks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.lowering.linalg.lstsq.cholesky_qr import cholesky_qr2, cholesky_qr2_thin
from jaxforge.lowering.linalg.lstsq.xla import augmented_qr, lstsq_xla
from jaxforge.primitives.linalg.lstsq import default_rcond
from tests.linalg_inputs import random, with_singular_values


def sentinel(a, b):
    """A fallback whose results are recognisable: NaN everywhere."""
    n = a.shape[-1]
    return jnp.full((*a.shape[:-2], n, n), jnp.nan, a.dtype), jnp.full((*b.shape[:-2], n, b.shape[-1]), jnp.nan, b.dtype)


def normal_residual(a, b, x):
    a, b, x = (np.asarray(v, np.float64) for v in (a, b, x))
    at = np.swapaxes(a, -1, -2)
    return np.max(np.linalg.norm(at @ (a @ x - b), axis=(-2, -1)) / np.linalg.norm(at @ b, axis=(-2, -1)))


def gram_error(a, r):
    """‖RᴴR − AᴴA‖_F / ‖A‖_F², in float64."""
    a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
    t = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    return np.max(np.linalg.norm(t(r) @ r - t(a) @ a, axis=(-2, -1)) / np.linalg.norm(a, axis=(-2, -1)) ** 2)


@pytest.mark.parametrize("cond", [1e2, 1e7])
def test_r_is_the_cholesky_factor_of_the_gram_and_q_is_orthonormal(cond):
    # At condition 1e7 (R₁'s diagonal spans ~4e5, so CholeskyQR2 takes it) the first iteration's
    # Q₁ is orthonormal only to ~κ²u₆₄ = 5e-3: without the second, ‖Qᴴb‖ ≠ ‖b‖ shows it, and
    # R = R₂R₁ in the wrong order shows in the Gram.
    rng = np.random.default_rng(2)
    u, v = (np.linalg.qr(rng.standard_normal((2, rows, 200)))[0] for rows in (800, 200))
    sv = np.geomspace(1, 1 / cond, 200)
    a = ((u * sv) @ np.swapaxes(v, -1, -2)).astype(np.float32)
    # b = A V S⁻¹ y: in the range of A (as rounded), with every singular direction alike
    b = (a.astype(np.float64) @ (v @ (rng.standard_normal((2, 200, 1)) / sv[:, None]))).astype(np.float32)
    r, c = jax.jit(cholesky_qr2(sentinel))(a, b)
    assert np.isfinite(r).all() and gram_error(a, r) <= 1e-6, gram_error(a, r)
    norms = [np.linalg.norm(np.asarray(x, np.float64), axis=(-2, -1)) for x in (c, b)]
    assert np.max(np.abs(norms[0] / norms[1] - 1)) <= 1e-6
    x = np.linalg.solve(np.asarray(r, np.float64), np.asarray(c, np.float64))
    want = np.stack([np.linalg.lstsq(a[i].astype(np.float64), b[i].astype(np.float64), rcond=None)[0] for i in range(2)])
    assert np.max(np.abs(x - want)) <= 50 * cond * np.finfo(np.float32).eps * np.abs(want).max()


@pytest.mark.parametrize("x64", [True, False])
def test_float32_solution_as_accurate_as_householder(x64):
    rng = np.random.default_rng(0)
    a = with_singular_values(rng, (3,), 600, 150, np.geomspace(1, 1e-4, 150)).astype(np.float32)
    b = random(rng, (3, 600, 2), np.float32)
    rcond = default_rcond(np.float32, 600, 150)
    with jax.enable_x64(x64):
        r, c = jax.jit(cholesky_qr2(sentinel))(a, b)  # finite: the Cholesky branch ran
        assert r.dtype == c.dtype == jnp.float32 and np.isfinite(r).all() and np.isfinite(c).all()
        ours = jax.jit(lambda a, b: lstsq_xla(a, b, rcond=rcond, factor=cholesky_qr2(sentinel))[0])(a, b)
        householder = jax.jit(lambda a, b: lstsq_xla(a, b, rcond=rcond)[0])(a, b)
    a64 = a.astype(np.float64)
    np.testing.assert_allclose(np.swapaxes(r, -1, -2) @ r, np.swapaxes(a64, -1, -2) @ a64, rtol=0, atol=1e-5 * np.abs(a64).max() ** 2 * 600)
    assert normal_residual(a, b, ours) <= max(2 * normal_residual(a, b, householder), 1e-6)
    want = np.stack([np.linalg.lstsq(a64[i], b[i].astype(np.float64), rcond=None)[0] for i in range(3)])
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_complex64():
    rng = np.random.default_rng(3)
    a = with_singular_values(rng, (2,), 500, 120, np.geomspace(1, 1e-3, 120), np.complex128).astype(np.complex64)
    b = random(rng, (2, 500, 2), np.complex64)
    r, c = jax.jit(cholesky_qr2(sentinel))(a, b)
    assert r.dtype == jnp.complex64 and np.isfinite(r).all()
    rh = np.conj(np.swapaxes(np.asarray(r, np.complex128), -1, -2))
    a64 = a.astype(np.complex128)
    np.testing.assert_allclose(rh @ r, np.conj(np.swapaxes(a64, -1, -2)) @ a64, atol=1e-5 * np.abs(a64).max() ** 2 * 500)
    x = np.linalg.solve(np.asarray(r, np.complex128), np.asarray(c, np.complex128))
    want = np.stack([np.linalg.lstsq(a64[i], b[i].astype(np.complex128), rcond=None)[0] for i in range(2)])
    np.testing.assert_allclose(x, want, atol=1e-3 * np.abs(want).max())


def test_singular_ill_conditioned_or_nan_input_takes_the_fallback():
    rng = np.random.default_rng(1)
    b = random(rng, (2, 300, 1), np.float32)
    cases = {
        "rank deficient": with_singular_values(rng, (2,), 300, 80, np.r_[np.ones(40), np.zeros(40)]),
        "condition 1e9": with_singular_values(rng, (2,), 300, 80, np.geomspace(1, 1e-9, 80)),
        # graded columns: R's diagonal spans 1e7, past MAX_DIAGONAL_RATIO, though the Cholesky holds
        "diagonal ratio 1e7": np.linalg.qr(random(rng, (2, 300, 80)))[0] * np.geomspace(1, 1e-7, 80),
        "nan": np.where(np.arange(300)[:, None] == 7, np.nan, random(rng, (2, 300, 80))),
    }
    for name, a in cases.items():
        r, c = jax.jit(cholesky_qr2(sentinel))(a.astype(np.float32), b)
        assert np.isnan(r).all() and np.isnan(c).all(), name
    r, c = jax.jit(cholesky_qr2(augmented_qr()))(cases["rank deficient"].astype(np.float32), b)
    assert np.isfinite(r).all()  # the real fallback: Householder's R, whose rank lstsq then reads


def test_each_matrix_keeps_its_own_factor_beside_one_that_falls_back():
    """The fallback runs for the batch where some matrix needs it, but only those matrices take its
    factors: the others' are CholeskyQR2's, as alone (else a NaN in one matrix would change every
    other's solution, by up to κ·eps)."""
    rng = np.random.default_rng(3)
    a = random(rng, (3, 300, 80), np.float32)
    a[1, 7] = np.nan
    b = random(rng, (3, 300, 2), np.float32)
    r, c = jax.jit(cholesky_qr2(sentinel))(a, b)
    assert np.isnan(r[1]).all() and np.isnan(c[1]).all()
    for i in (0, 2):
        r_alone, c_alone = jax.jit(cholesky_qr2(sentinel))(a[i], b[i])
        np.testing.assert_allclose(r[i], r_alone, rtol=1e-6, atol=1e-6 * np.abs(r_alone).max())
        np.testing.assert_allclose(c[i], c_alone, rtol=1e-6, atol=1e-6 * np.abs(c_alone).max())


@pytest.mark.parametrize("x64", [True, False])
def test_the_cuda_lowering_picks_cholesky_qr_for_large_tall_float32(monkeypatch, x64):
    # Lowered for cuda on this CPU machine: the Grams and solves appear in float64, also where the
    # program runs without x64 (the lowering switches it on for them).
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")

    def lowered(m, n, dtype):
        args = (jax.ShapeDtypeStruct((m, n), dtype), jax.ShapeDtypeStruct((m, 1), dtype))
        f = jax.jit(lambda a, b: jf.linalg.lstsq(a, b).solution)
        return jax.export.export(f, platforms=("cuda",), disabled_checks=[triton])(*args).mlir_module()

    with jax.enable_x64(x64):
        assert "potrf" in lowered(2048, 256, jnp.float32) and "xf64>" in lowered(2048, 256, jnp.float32)
        assert "potrf" in lowered(2048, 256, jnp.complex64) and "complex<f64>" in lowered(2048, 256, jnp.complex64)
        assert "potrf" not in lowered(2048, 128, jnp.float32)  # too few columns: geqrf
    assert "potrf" not in lowered(2048, 256, jnp.float64)  # float64 input: geqrf


# ---------------------------------------------------------------- svd's QR (cuda.thin_qr)


def test_thin_qr_factors_and_falls_back():
    rng = np.random.default_rng(5)
    a = with_singular_values(rng, (3,), 200, 40, np.geomspace(1, 1e-3, 40)).astype(np.float32)
    q, r = jax.jit(cholesky_qr2_thin(lambda x: jax.lax.linalg.qr(x, full_matrices=False)))(a)
    assert q.dtype == r.dtype == np.float32 and np.allclose(np.triu(r), r)
    np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(40), (3, 40, 40)), atol=2e-6)
    np.testing.assert_allclose(q @ r, a, atol=2e-6 * np.abs(a).max())
    deficient = np.concatenate([a[..., :20], a[..., :20]], axis=-1)
    q, r = jax.jit(cholesky_qr2_thin(lambda x: (x * np.nan, x[..., :40, :] * np.nan)))(deficient)
    assert np.isnan(q).all() and np.isnan(r).all()  # the fallback's sentinel


def test_the_cuda_gradient_solves_on_the_forward_s_cholesky_qr(monkeypatch):
    # Lowered for cuda: at a shape the forward gives CholeskyQR2, the gradient's full-rank rule solves
    # on its R; no second CholeskyQR2 of A (there was one while the jvp refactored A).
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")

    def potrf_functions(m, n):
        args = (jax.ShapeDtypeStruct((m, n), jnp.float32), jax.ShapeDtypeStruct((m, 1), jnp.float32))
        grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jf.linalg.lstsq(a, b).solution ** 2)))
        return jax.export.export(grad, platforms=("cuda",))(*args).mlir_module().count("custom_call @cusolver_potrf")

    assert potrf_functions(2048, 256) == 1 and potrf_functions(2048, 128) == 0
