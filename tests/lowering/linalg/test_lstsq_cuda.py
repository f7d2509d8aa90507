"""lstsq on the GPU with the fused QR-solve kernel (and the block QR kernel it builds on) against
float64 numpy (skipped without a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.primitives.linalg.lstsq import default_rcond
from tests.linalg_inputs import random, well_conditioned, with_singular_values

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")  # see lowering/linalg/lstsq/config.py


def on_gpu(*xs):
    return [jax.device_put(x, jax.devices("gpu")[0]) for x in xs]


def to_double(x):
    x = np.asarray(x)
    return x.astype(np.result_type(x.dtype, np.float64))


def normal_residual(a, b, x):
    a, b, x = (to_double(v) for v in (a, b, x))
    at = np.swapaxes(a, -1, -2).conj()
    return np.max(np.linalg.norm(at @ (a @ x - b), axis=(-2, -1)) / np.linalg.norm(at @ b, axis=(-2, -1)))


CASES = [  # (batch, m, n, k), dtype, whether [A | b] (Aᴴ when wide) fits the kernel (≤ 64 columns, ≤ 40 KiB)
    ((8192, 64, 16, 1), np.float32, True),
    ((8192, 64, 16, 1), np.float64, True),
    ((64, 200, 30, 2), np.float32, True),
    ((64, 200, 30, 2), np.float64, False),
    ((16, 512, 128, 4), np.float32, False),
    ((1024, 16, 64, 1), np.float32, True),  # wide: the minimum-norm solution, Q applied in the kernel
    ((64, 30, 200, 2), np.float64, False),
    ((2048, 64, 16, 1), np.complex64, True),
    ((256, 16, 40, 2), np.complex128, True),
]


@pytest.mark.parametrize("shape,dtype,uses_kernel", CASES)
def test_matches_numpy(shape, dtype, uses_kernel):
    batch, m, n, k = shape
    rng = np.random.default_rng(0)
    a, b = random(rng, (batch, m, n), dtype), random(rng, (batch, m, k), dtype)
    f = jax.jit(jf.linalg.lstsq)
    assert ("jaxforge_qr_solve" in f.lower(*on_gpu(a, b)).as_text()) == uses_kernel
    x, res, rank, s = f(*on_gpu(a, b))
    eps = np.finfo(dtype).eps
    sample = range(min(batch, 32))
    x_np = np.stack([np.linalg.lstsq(to_double(a[i]), to_double(b[i]))[0] for i in sample])
    np.testing.assert_allclose(np.asarray(x)[: len(sample)], x_np, rtol=1e4 * eps, atol=1e4 * eps)
    assert normal_residual(a, b, x) <= 1e3 * eps
    np.testing.assert_array_equal(rank, min(m, n))


@pytest.mark.parametrize(
    "shape,dtype",
    [((8192, 64, 16, 1), np.float32), ((8192, 64, 16, 1), np.float64), ((300, 128, 29, 3), np.float32),
     ((300, 33, 5, 2), np.float64), ((64, 2, 1, 1), np.float32)],
)  # fmt: skip
def test_the_warp_kernel_agrees_with_the_block_kernel_and_numpy(shape, dtype):
    # The one-warp kernel (qr_solve_warp.cuh, emulated on CPU) on the GPU: R of [A | b] equals the
    # block kernel's up to row signs, the solution numpy's, and every well-conditioned matrix is
    # certified; a NaN, a zero pivot and a rank-deficient matrix are not.
    from jaxforge.lowering import build
    from jaxforge.lowering.linalg.lstsq import cuda

    assert build.ensure_loaded(cuda.KERNEL)
    batch, m, n, k = shape
    rng = np.random.default_rng(4)
    a, b = well_conditioned(rng, (batch,), m, n, dtype), random(rng, (batch, m, k), dtype)
    a[1, 0, 0] = np.nan
    if n > 1:
        a[2, :, 0] = 0
        a[3, :, -1] = a[3, :, 0]
    rcond = default_rcond(dtype, m, n)

    def run(targets):  # the targets are a dict, so closed over rather than a static argument
        return (np.asarray(v) for v in jax.jit(lambda a, b: cuda.qr_solve_cuda(a, b, rcond, targets)[:3])(*on_gpu(a, b)))

    r, x, certified = run(cuda.QR_SOLVE_WARP_TARGETS)
    r_block, _, _ = run(cuda.QR_SOLVE_TARGETS)
    bad = [1, 2, 3] if n > 1 else [1]
    good = np.setdiff1d(np.arange(batch), bad)
    np.testing.assert_array_equal(certified[bad], 0)
    assert certified[good].all()
    signs = np.sign(np.diagonal(r, axis1=-2, axis2=-1)) * np.sign(np.diagonal(r_block, axis1=-2, axis2=-1))
    eps = np.finfo(dtype).eps
    scale = np.abs(r_block[good]).max()
    assert np.abs(r[good] * signs[good, :, None] - r_block[good]).max() <= 100 * eps * np.sqrt(m) * scale
    sample = good[:32]
    x_np = np.stack([np.linalg.lstsq(to_double(a[i]), to_double(b[i]))[0] for i in sample])
    np.testing.assert_allclose(x[sample], x_np, rtol=1e3 * eps, atol=1e3 * eps)
    assert np.isnan(r[1]).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ill_conditioned(dtype):
    """Condition 1e6: the kernel's certificate holds in float64 (1/rcond = 2e14) and fails in float32
    (1/rcond = 2e5), where the later rungs and the SVD of R decide; either way numpy's answer."""
    rng = np.random.default_rng(3)
    a = with_singular_values(rng, (16,), 40, 12, np.geomspace(1, 1e-6, 12)).astype(dtype)
    b = random(rng, (16, 40, 1), dtype)
    x, _, rank, _ = jax.jit(jf.linalg.lstsq)(*on_gpu(a, b))
    rcond = default_rcond(dtype, 40, 12)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    x_np = np.stack([np.linalg.lstsq(a64[i], b64[i], rcond=rcond)[0] for i in range(16)])
    rank_np = [np.linalg.matrix_rank(a64[i], rcond * np.linalg.norm(a64[i], 2)) for i in range(16)]
    np.testing.assert_array_equal(rank, rank_np)
    if dtype == np.float64:
        np.testing.assert_allclose(x, x_np, rtol=1e6 * 1e3 * np.finfo(dtype).eps)
    assert normal_residual(a, b, x) <= 1e3 * np.finfo(dtype).eps * 1e6


def test_empty_batch_and_no_rows():
    for a, b in ((np.zeros((0, 30, 6), np.float32), np.zeros((0, 30, 1), np.float32)),
                 (np.zeros((4, 0, 6), np.float32), np.zeros((4, 0, 2), np.float32))):  # fmt: skip
        x, _, rank, _ = jax.jit(jf.linalg.lstsq)(*on_gpu(a, b))
        assert x.shape == (a.shape[0], 6, b.shape[-1]) and np.all(np.asarray(x) == 0) and np.all(np.asarray(rank) == 0)


def test_rank_deficient_and_nan():
    rng = np.random.default_rng(1)
    a = with_singular_values(rng, (32,), 40, 12, np.r_[np.linspace(2, 1, 8), np.zeros(4)]).astype(np.float32)
    b = random(rng, (32, 40, 1), np.float32)
    a[5, 0, 0] = np.nan
    x, res, rank, s = jax.jit(jf.linalg.lstsq)(*on_gpu(a, b))
    assert np.all(np.isnan(x[5])) and int(rank[5]) == 0
    keep = [i for i in range(32) if i != 5]
    np.testing.assert_array_equal(np.asarray(rank)[keep], 8)
    # numpy in float64 with float32's cut-off: the zero singular values, rounded to float32, are ~1e-8
    rcond = default_rcond(np.float32, 40, 12)
    x_np = np.stack([np.linalg.lstsq(a[i].astype(np.float64), b[i].astype(np.float64), rcond=rcond)[0] for i in keep])
    np.testing.assert_allclose(np.asarray(x)[keep], x_np, atol=1e-4)


def test_gradient_through_the_kernel():
    rng = np.random.default_rng(2)
    a, b = well_conditioned(rng, (64,), 30, 6), random(rng, (64, 30, 1))
    loss = lambda a, b: jnp.sum(jf.linalg.lstsq(a, b).solution ** 2)
    g_gpu = jax.jit(jax.grad(loss))(*on_gpu(a, b))
    cpu = jax.devices("cpu")[0]
    g_cpu = jax.grad(loss)(jax.device_put(a, cpu), jax.device_put(b, cpu))
    np.testing.assert_allclose(g_gpu, g_cpu, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape", [(16, 512, 128, 2), (16, 128, 512, 2)], ids=["tall", "wide"])
def test_derivatives_where_cholesky_qr_factors(shape):
    # float32 shapes that CHOLESKY_QR_RULES admit: the derivative rule solves on the forward's
    # CholeskyQR2 R (corrected seminormal equations); its tangent and gradient against float64 on CPU
    batch, m, n, k = shape
    rng = np.random.default_rng(3)
    a, da = (well_conditioned(rng, (batch,), m, n, np.float32) for _ in range(2))
    b, db = (random(rng, (batch, m, k), np.float32) for _ in range(2))
    solution = lambda a, b: jf.linalg.lstsq(a, b).solution  # noqa: E731
    loss = lambda a, b: jnp.sum(solution(a, b) ** 2)  # noqa: E731
    programs = {
        "tangent": lambda a, b, da, db: jax.jvp(solution, (a, b), (da, db))[1],
        "grad": lambda a, b, da, db: jax.grad(loss, argnums=(0, 1))(a, b),
    }
    cpu = jax.devices("cpu")[0]
    for name, program in programs.items():
        got = jax.jit(program)(*on_gpu(a, b, da, db))
        want = jax.jit(program)(*(jax.device_put(x.astype(np.float64), cpu) for x in (a, b, da, db)))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.linalg.norm(to_double(g) - w) <= 1e-4 * np.linalg.norm(w), name
