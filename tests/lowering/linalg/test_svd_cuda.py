"""The CUDA Jacobi svd kernels (one warp, one block per matrix) against float64 numpy on the GPU
(skipped without one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from tests.linalg_checks import check_singular_values, check_svd
from tests.linalg_inputs import exactly_rank_deficient, random, with_singular_values

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")  # see lowering/linalg/svd/config.py


def on_gpu(x):
    return jax.device_put(x, jax.devices("gpu")[0])


def gpu_svd(a):
    f = jax.jit(jf.linalg.svd)
    return f, f(on_gpu(a))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(4096, 32, 32), (257, 32, 17), (100, 9, 31), (3, 1, 1), (64, 20, 20)])
def test_kernel_is_used_and_matches_numpy(dtype, shape):
    a = random(np.random.default_rng(0), shape, dtype)
    f, (u, s, vh) = gpu_svd(a)
    assert "jaxforge_svd_jacobi" in f.lower(on_gpu(a)).as_text()
    check_svd(a, s, u, vh)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("shape", [(4096, 32, 32), (100, 9, 31)])
def test_complex_kernel_is_used_and_matches_numpy(dtype, shape):
    a = random(np.random.default_rng(0), shape, dtype)
    f, (u, s, vh) = gpu_svd(a)
    assert "jaxforge_svd_jacobi_c" in f.lower(on_gpu(a)).as_text() and s.dtype == np.finfo(dtype).dtype
    check_svd(a, s, u, vh)


@pytest.mark.parametrize("shape", [(4096, 32, 32), (257, 32, 17), (100, 9, 31), (3, 1, 1), (64, 2, 7)])
@pytest.mark.parametrize("sweeps", ["lanes", "pairs"])  # closest, so ids start with it (pending_kernels' prefixes)
def test_float32_sweeps_are_used_and_match_numpy(sweeps, shape, monkeypatch):
    """float32's column-per-lane and column-pair sweeps, each as config.jacobi_warp_sweeps picks it.
    (The other tests here run the pairs on float32: the fixture lets unvalidated kernels run.)"""
    from jaxforge.lowering.linalg.svd import config

    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "0")
    monkeypatch.setattr(config, "JACOBI_LANES", True)
    monkeypatch.setattr(config, "JACOBI_PAIRS_VALIDATED", sweeps == "pairs")
    a = random(np.random.default_rng(0), shape, np.float32)
    f = jax.jit(lambda a: jf.linalg.svd(a))  # a new function: lowered with these flags
    u, s, vh = f(on_gpu(a))
    assert f"jaxforge_svd_jacobi_{sweeps}_f32" in f.lower(on_gpu(a)).as_text()
    check_svd(a, s, u, vh)


def test_ill_conditioned_and_rank_deficient():
    rng = np.random.default_rng(1)
    ill = with_singular_values(rng, (64,), 32, 24, np.logspace(0, -6, 24)).astype(np.float32)
    _, (u, s, vh) = gpu_svd(ill)
    check_svd(ill, s, u, vh)
    deficient = with_singular_values(rng, (64,), 20, 20, np.r_[np.linspace(2, 1, 10), np.zeros(10)]).astype(np.float32)
    _, (u, s, vh) = gpu_svd(deficient)
    np.testing.assert_allclose(s[:, 10:], 0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(u[:, :, :10]) * np.asarray(s[:, None, :10]) @ np.asarray(vh[:, :10]), deficient, atol=1e-5)


@pytest.mark.parametrize("shape", [(8, 20, 12), (8, 12, 20), (8, 70, 40), (8, 40, 70)])
def test_exact_zero_singular_values_get_orthonormal_vectors(shape):
    """A zero matrix and matrices with zero columns (rows, when wide): u and vh orthonormal, as
    numpy's, through the warp and block kernels (which complete the basis where s is exactly 0)."""
    a = exactly_rank_deficient(np.random.default_rng(8), shape, np.float32)
    f, (u, s, vh) = gpu_svd(a)
    assert "jaxforge_svd_jacobi" in f.lower(on_gpu(a)).as_text()
    check_svd(a, s, u, vh)


def test_nan_inf_and_empty():
    a = random(np.random.default_rng(2), (8, 16, 12), np.float32)
    a[3, 0, 0], a[5, 2, 2] = np.nan, np.inf
    _, (u, s, vh) = gpu_svd(a)
    for i in (3, 5):
        assert np.all(np.isnan(s[i])) and np.all(np.isnan(u[i])) and np.all(np.isnan(vh[i]))
    check_svd(np.delete(a, [3, 5], 0), *(np.delete(x, [3, 5], 0) for x in (s, u, vh)))
    for shape in [(0, 8, 8), (4, 0, 3)]:
        _, (u, s, vh) = gpu_svd(np.zeros(shape, np.float32))
        assert s.shape == shape[:-2] + (min(shape[-2:]),)


def test_gradients_through_the_kernel():
    a = with_singular_values(np.random.default_rng(3), (16,), 12, 8, np.linspace(2, 1, 8))
    loss = lambda a: jnp.sum(jf.linalg.svd(a, compute_uv=False) ** 2)  # = ‖A‖_F², gradient 2A
    grad = jax.jit(jax.grad(loss))(on_gpu(a))
    np.testing.assert_allclose(grad, 2 * a, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- the one-block kernel (float32)

BLOCK_SHAPES = [(1024, 64, 64), (64, 128, 128), (50, 200, 37), (30, 45, 130), (16, 33, 33), (7, 256, 100)]


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_block_kernel_is_used_and_matches_numpy(shape):
    a = random(np.random.default_rng(4), shape, np.float32)
    f, (u, s, vh) = gpu_svd(a)
    text = f.lower(on_gpu(a)).as_text()
    assert "jaxforge_svd_jacobi_block" in text or "jaxforge_svd_jacobi_slots" in text  # slots: up to 128 rows
    check_svd(a, s, u, vh)


@pytest.mark.parametrize(
    "shape", [(1024, 64, 64), (16, 33, 33), (9, 100, 40), (5, 37, 50), (3, 128, 64), (64, 128, 128), (6, 70, 100)]
)
@pytest.mark.parametrize("sweeps", ["block", "slots"])  # closest, so ids start with it (pending_kernels' prefixes)
def test_either_block_sweeps_where_the_slots_fit(sweeps, shape, monkeypatch):
    """The block kernel's column pairs in shared memory or in registers, as config.use_jacobi_slots
    picks them. (The other tests here run the slots where they fit: unvalidated kernels may run.)"""
    from jaxforge.lowering.linalg.svd import config

    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "0")
    monkeypatch.setattr(config, "JACOBI_SLOTS_VALIDATED", sweeps == "slots")
    a = random(np.random.default_rng(7), shape, np.float32)
    f = jax.jit(lambda a: jf.linalg.svd(a))  # a new function: lowered with this flag
    u, s, vh = f(on_gpu(a))
    assert f"jaxforge_svd_jacobi_{sweeps}_f32" in f.lower(on_gpu(a)).as_text()
    check_svd(a, s, u, vh)


def test_block_kernel_ill_conditioned_rank_deficient_nan_and_float64(monkeypatch):
    rng = np.random.default_rng(5)
    ill = with_singular_values(rng, (16,), 96, 64, np.logspace(0, -6, 64)).astype(np.float32)
    u, s, vh = gpu_svd(ill)[1]
    check_svd(ill, s, u, vh)
    deficient = with_singular_values(rng, (16,), 70, 70, np.r_[np.linspace(2, 1, 35), np.zeros(35)]).astype(np.float32)
    f, (u, s, vh) = gpu_svd(deficient)
    text = f.lower(on_gpu(deficient)).as_text()
    assert "jaxforge_svd_jacobi_block" in text or "jaxforge_svd_jacobi_slots" in text
    np.testing.assert_allclose(s[:, 35:], 0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(u[:, :, :35]) * np.asarray(s[:, None, :35]) @ np.asarray(vh[:, :35]), deficient, atol=1e-5)
    bad = random(rng, (8, 70, 40), np.float32)
    bad[3, 5, 7], bad[6, 0, 0] = np.nan, -np.inf
    _, (u, s, vh) = gpu_svd(bad)
    for i in (3, 6):
        assert np.all(np.isnan(s[i])) and np.all(np.isnan(u[i])) and np.all(np.isnan(vh[i]))
    check_svd(np.delete(bad, [3, 6], 0), *(np.delete(x, [3, 6], 0) for x in (s, u, vh)))
    from jaxforge.lowering.linalg.svd import config

    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "0")  # float64 with cuSOLVER until its flag
    double = random(rng, (4, 64, 64), np.float64)
    f = jax.jit(lambda a: jf.linalg.svd(a))  # a new function: lowered without the switch
    u, s, vh = f(on_gpu(double))
    assert ("jaxforge_svd_jacobi_block_f64" in f.lower(on_gpu(double)).as_text()) == config.JACOBI_BLOCK_F64_VALIDATED
    np.testing.assert_allclose(s, np.linalg.svd(double, compute_uv=False), rtol=1e-10)


# ---------------------------------------------------------------- large SVDs (config.LARGE_SVD)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("method", ["qdwh", "gesvdp"])
def test_large_svd_methods_on_the_gpu_match_numpy(method, dtype, monkeypatch):
    # QDWH (polar.py: cuSOLVER's QR, Cholesky and syevd) and cuSOLVER's gesvdp, which the H200
    # timed faster, on shapes past the kernels: an ill-conditioned square batch directly; after
    # A = QR a rank-deficient tall matrix (Householder) and a 2048 x 512 one (CholeskyQR2 in float32)
    from jaxforge.lowering.linalg.svd import config

    rng = np.random.default_rng(6)
    ill = with_singular_values(rng, (2,), 520, 520, np.logspace(0, -6, 520)).astype(dtype)
    deficient = with_singular_values(rng, (1,), 600, 300, np.r_[np.linspace(2, 1, 150), np.zeros(150)]).astype(dtype)
    tall = random(rng, (1, 2048, 512), dtype)
    for a, qr_first in ((ill, False), (deficient, True), (tall, True)):
        monkeypatch.setattr(config, "LARGE_SVD", ((1, 1.0, method, qr_first),))
        f = jax.jit(lambda a: jf.linalg.svd(a))  # a new function: lowered under the rule
        u, s, vh = f(on_gpu(a))
        assert {"qdwh": "cusolver_syevd", "gesvdp": "cusolver_gesvdp"}[method] in f.lower(on_gpu(a)).as_text()
        check_svd(a, s, u, vh)


def hard_batch(seed: int, shape, dtype, smallest: float = 1e-6):
    """Random matrices of ``dtype`` but for three: the second ill-conditioned (singular values down to
    ``smallest``), the third rank-deficient (its smaller half zero), the fourth holding a NaN."""
    rng = np.random.default_rng(seed)
    a = random(rng, shape, dtype)
    k = min(shape[-2:])
    wide = np.result_type(dtype, np.float64)
    a[1] = with_singular_values(rng, (), *shape[-2:], np.geomspace(1, smallest, k), wide).astype(dtype)
    a[2] = with_singular_values(rng, (), *shape[-2:], np.r_[np.linspace(2, 1, k - k // 2), np.zeros(k // 2)], wide).astype(dtype)
    a[3, 2, 1] = np.nan
    return a


def _check_block_kernel(shape, dtype, smallest):
    """The block kernel in ``dtype`` on random, ill-conditioned (singular values down to ``smallest``),
    rank-deficient and NaN-holding matrices (hard_batch)."""
    a = hard_batch(13, shape, dtype, smallest)
    f, (u, s, vh) = gpu_svd(a)
    names = {np.float64: "f64", np.complex64: "c64", np.complex128: "c128"}
    assert f"@jaxforge_svd_jacobi_block_{names[dtype]}(" in f.lower(on_gpu(a)).as_text()
    assert all(np.isnan(x[3]).all() for x in (s, u, vh))
    keep = np.delete(np.arange(shape[0]), 3)
    check_svd(a[keep], *(np.asarray(x)[keep] for x in (s, u, vh)))


@pytest.mark.parametrize("shape", [(256, 64, 64), (16, 100, 100), (20, 200, 37), (12, 45, 130), (9, 33, 33), (6, 256, 64)])
def test_block_kernel_in_float64_matches_numpy(shape):
    """config.JACOBI_BLOCK_F64_VALIDATED: the shared-memory sweeps with W in float64, κ = 1e12."""
    _check_block_kernel(shape, np.float64, 1e-12)


@pytest.mark.parametrize(
    "shape,dtype",
    [((256, 64, 64), np.complex64), ((16, 90, 90), np.complex64), ((20, 200, 37), np.complex64), ((12, 40, 130), np.complex64),
     ((128, 64, 64), np.complex128), ((8, 33, 80), np.complex128)],
)  # fmt: skip
def test_block_kernel_in_complex_matches_numpy(shape, dtype):
    """config.JACOBI_BLOCK_COMPLEX_VALIDATED: unitary rotations, V in complex128; κ = 1e6 (complex64)
    and 1e12 (complex128)."""
    _check_block_kernel(shape, dtype, 1e-6 if dtype == np.complex64 else 1e-12)


@pytest.mark.parametrize(
    "shape,dtype,target",
    [((256, 1000, 64), np.float32, "jaxforge_svd_jacobi_slots_f32"), ((64, 300, 128), np.float32, "jaxforge_svd_jacobi_slots_f32"),
     ((128, 24, 700), np.float32, "jaxforge_svd_jacobi_pairs_f32"), ((32, 500, 20), np.float64, "jaxforge_svd_jacobi_f64"),
     ((16, 400, 30), np.complex64, "jaxforge_svd_jacobi_c64")],
)  # fmt: skip
def test_tall_batches_take_the_kernel_of_r_after_a_qr(shape, dtype, target):
    """Past the kernels' rows, R of A = QR (of Aᴴ when wide) through the kernel it fits
    (config.JACOBI_QR_FIRST_VALIDATED): random, ill-conditioned (κ = 1e6), rank-deficient and
    NaN-holding matrices (hard_batch), with and without the vectors."""
    a = hard_batch(14, shape, dtype)
    f, (u, s, vh) = gpu_svd(a)
    assert f"@{target}(" in f.lower(on_gpu(a)).as_text()
    assert all(np.isnan(x[3]).all() for x in (s, u, vh))
    keep = np.delete(np.arange(shape[0]), 3)
    check_svd(a[keep], *(np.asarray(x)[keep] for x in (s, u, vh)))
    values = np.asarray(jax.jit(lambda a: jf.linalg.svd(a, compute_uv=False))(on_gpu(a)))
    check_singular_values(a[keep], values[keep])


# ---------------------------------------------------------------- the values alone (compute_uv=False)


@pytest.mark.parametrize(
    "target,dtype,shape",
    [("jaxforge_svd_jacobi_f32", np.float32, (300, 32, 20)), ("jaxforge_svd_jacobi_f64", np.float64, (100, 9, 31)),
     ("jaxforge_svd_jacobi_c64", np.complex64, (100, 24, 24)), ("jaxforge_svd_jacobi_c128", np.complex128, (50, 31, 7)),
     ("jaxforge_svd_jacobi_lanes_f32", np.float32, (300, 32, 32)), ("jaxforge_svd_jacobi_pairs_f32", np.float32, (4096, 32, 32)),
     ("jaxforge_svd_jacobi_pairs_f32", np.float32, (100, 17, 30)), ("jaxforge_svd_jacobi_block_f32", np.float32, (64, 100, 40)),
     ("jaxforge_svd_jacobi_block_f64", np.float64, (64, 100, 40)), ("jaxforge_svd_jacobi_block_c64", np.complex64, (64, 60, 40)),
     ("jaxforge_svd_jacobi_slots_f32", np.float32, (1024, 64, 64)), ("jaxforge_svd_jacobi_slots_f32", np.float32, (64, 128, 128)),
     ("jaxforge_svd_jacobi_slots_f32", np.float32, (16, 70, 100))],
)  # fmt: skip
def test_values_twins_match_numpy_and_their_kernels(target, dtype, shape):
    """Each kernel's twin for the values alone: float64 numpy's singular values at the kernel's bar
    (ill-conditioned and rank-deficient matrices among them), NaN for a matrix holding NaN, and its
    kernel's values (the emulation finds them bit-identical; here ulps of the largest are let pass,
    in case the compiler contracts the two instantiations' arithmetic differently)."""
    from jaxforge.lowering.linalg.svd import cuda

    a = hard_batch(11, shape, dtype)
    assert cuda.build.ensure_loaded(cuda.KERNEL)
    s = np.asarray(jax.jit(lambda a: cuda.jacobi_values(a, cuda.VALUES_TARGETS[target]))(on_gpu(a)))
    s_full = np.asarray(jax.jit(lambda a: cuda.jacobi_svd(a, target)[0])(on_gpu(a)))
    assert np.isnan(s[3]).all()
    keep = np.delete(np.arange(shape[0]), 3)
    check_singular_values(a[keep], s[keep])
    np.testing.assert_allclose(s[keep], s_full[keep], rtol=0, atol=8 * np.finfo(dtype).eps * s_full[keep].max())


@pytest.mark.parametrize("shape", [(512, 32, 32), (256, 64, 48), (16, 100, 128)])
def test_an_svd_without_vectors_runs_a_values_twin(shape):
    a = random(np.random.default_rng(12), shape, np.float32)
    for f in (jax.jit(lambda a: jf.linalg.svd(a, compute_uv=False)), jax.jit(lambda a: jf.linalg.svd(a)[1])):
        assert "_values_f32" in f.lower(on_gpu(a)).as_text()
        check_singular_values(a, f(on_gpu(a)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
@pytest.mark.parametrize("shape", [(4096, 32, 32), (257, 17, 32), (64, 64, 64)])
def test_pinv_and_matrix_rank_run_the_kernels_and_match_numpy(dtype, shape):
    """jf.linalg.pinv through a Jacobi kernel, its products at full precision: within 30 κ eps √k of
    float64 numpy's at κ = 100 (on CPU 0.3 κ eps; TF32's products, 2⁻¹¹, would err past it), and
    every third matrix of rank 5, the rest cut."""
    rng = np.random.default_rng(9)
    batch, m, n = shape
    k = min(m, n)
    a = with_singular_values(rng, (batch,), m, n, np.geomspace(1.0, 1e-2, k), dtype)
    a[::3] = with_singular_values(rng, (len(a[::3]),), m, n, np.r_[np.geomspace(1.0, 0.5, 5), np.zeros(k - 5)], dtype)
    pinv, rank = jax.jit(jf.linalg.pinv), jax.jit(jf.linalg.matrix_rank)
    assert "jaxforge_svd_jacobi" in pinv.lower(on_gpu(a)).as_text()
    got, want = np.asarray(pinv(on_gpu(a))), np.linalg.pinv(a.astype(np.complex128 if np.iscomplexobj(a) else np.float64), rcond=1e-3)
    np.testing.assert_array_equal(np.asarray(rank(on_gpu(a))), np.where(np.arange(batch) % 3 == 0, 5, k))
    eps = np.finfo(dtype).eps
    errors = np.linalg.norm(got - want, axis=(-2, -1)) / np.linalg.norm(want, axis=(-2, -1))
    assert errors.max() < 30 * 100 * eps * np.sqrt(k), errors.max()
