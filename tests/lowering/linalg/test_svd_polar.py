"""The large-SVD methods of the CUDA lowering, checked on CPU: QDWH (polar.py) against float64
numpy, ``large_svd`` with QR first, and the dispatch of config.LARGE_SVD as lowered for cuda."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.lowering.linalg.svd import config
from jaxforge.lowering.linalg.svd.cuda import large_svd
from jaxforge.lowering.linalg.svd.polar import CHOLESKY_MAX_C, qdwh, qdwh_coefficients
from tests.linalg_checks import check_svd
from tests.linalg_inputs import random, with_singular_values

jit_large_svd = jax.jit(large_svd, static_argnames=("method", "qr_first", "compute_uv"))

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]


def inputs(rng, dtype):
    rank_deficient = np.r_[np.linspace(1, 0.5, 25), np.zeros(15)]
    return {
        "square": random(rng, (3, 40, 40), dtype),
        "tall": random(rng, (2, 100, 30), dtype),
        "wide": random(rng, (2, 20, 50), dtype),
        "condition 1e6": with_singular_values(rng, (2,), 64, 48, np.geomspace(1, 1e-6, 48), dtype),
        "condition 1e12": with_singular_values(rng, (2,), 50, 50, np.geomspace(1, 1e-12, 50), dtype),
        "rank 25 of 40": with_singular_values(rng, (2,), 60, 40, rank_deficient, dtype),
        "repeated": with_singular_values(rng, (1,), 30, 30, np.r_[np.ones(10), np.full(20, 0.5)], dtype),
        "zero": np.zeros((1, 5, 4), dtype),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_svd_polar_matches_numpy(dtype):
    svd = jax.jit(lambda a: large_svd(a, "qdwh", False))  # wide: through Aᴴ; compute_uv=False below
    for a in inputs(np.random.default_rng(0), dtype).values():
        check_svd(a, *svd(a))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_qdwh_gives_the_polar_factor(dtype):
    # A = U S Vᴴ  =>  U_p = U Vᴴ, unique for full-rank A
    a = with_singular_values(np.random.default_rng(1), (2,), 70, 30, np.geomspace(1, 1e-4, 30), dtype)
    u, _, vh = np.linalg.svd(a.astype(np.float64), full_matrices=False)
    np.testing.assert_allclose(jax.jit(qdwh)(a), u @ vh, atol=1e4 * 50 * np.finfo(dtype).eps)  # κ·bar


def test_qdwh_coefficients_take_every_singular_value_to_one():
    for dtype, steps in ((np.float32, 4), (np.float64, 6)):
        eps = np.finfo(dtype).eps
        coefficients = qdwh_coefficients(eps)
        assert len(coefficients) == steps
        sigma = np.geomspace(eps, 1, 200)  # the whole interval the iteration is built for
        for a, b, c in coefficients:
            sigma = sigma * (a + b * sigma**2) / (1 + c * sigma**2)
        assert np.abs(sigma - 1).max() < 10 * eps
        assert coefficients[0][2] > CHOLESKY_MAX_C >= coefficients[-1][2]  # QR first, Cholesky last


@pytest.mark.parametrize("qr_first", [False, True])
@pytest.mark.parametrize("method", ["qdwh", "gesvd"])  # gesvdj and gesvdp are cuSOLVER's only
def test_large_svd_methods_on_cpu(method, qr_first):
    rng = np.random.default_rng(2)
    for a in (random(rng, (2, 90, 20), np.float32), random(rng, (2, 20, 90), np.float64)):
        s, u, vh = jit_large_svd(a, method=method, qr_first=qr_first)
        check_svd(a, s, u, vh)
        (values,) = jit_large_svd(a, method=method, qr_first=qr_first, compute_uv=False)
        np.testing.assert_allclose(values, s, rtol=1e-5)


def test_qr_first_takes_cholesky_qr_where_lstsq_would():
    # float32 1100 x 260 (CHOLESKY_QR_RULES: n >= 256, m >= 4n): Q and R by CholeskyQR2, float64
    # Grams; an ill-conditioned matrix of that shape falls back to Householder on device.
    rng = np.random.default_rng(4)
    well = random(rng, (1, 1100, 260), np.float32)
    ill = with_singular_values(rng, (1,), 1100, 260, np.geomspace(1, 1e-7, 260), np.float32)
    for a in (well, ill):
        s, u, vh = jit_large_svd(a, method="gesvd", qr_first=True)
        check_svd(a, s, u, vh)
    text = jit_large_svd.lower(well, method="gesvd", qr_first=True).as_text()
    assert "potrf" in text and "f64" in text
    assert "potrf" not in jit_large_svd.lower(well[:, :1000], method="gesvd", qr_first=True).as_text()  # m < 4n


def test_large_svd_qdwh_gives_nan_for_nonfinite_matrices_only():
    a = random(np.random.default_rng(3), (3, 30, 20), np.float32)
    a[0, 4, 2], a[2, 0, 0] = np.nan, np.inf
    for qr_first in (False, True):
        for out in jit_large_svd(a, method="qdwh", qr_first=qr_first):
            out = np.asarray(out)
            assert np.isnan(out[0]).all() and np.isnan(out[2]).all() and np.isfinite(out[1]).all()


def test_large_svd_rules(monkeypatch):
    assert config.large_svd_method(2048, 2048, False) == ("qdwh", False)  # measured on the H200
    assert config.large_svd_method(8192, 512, False) == ("qdwh", True)
    assert config.large_svd_method(1000, 100, False) is None  # min(m, n) below what was measured
    monkeypatch.setattr(config, "LARGE_SVD", ((512, 4.0, "qdwh", True), (512, 1.0, "gesvdp", False)))
    assert config.large_svd_method(8192, 512, False) == ("qdwh", True)  # the first rule that matches
    assert config.large_svd_method(512, 8192, False) == ("qdwh", True)
    assert config.large_svd_method(2048, 2048, True) == ("gesvdp", False)  # square: full is thin
    assert config.large_svd_method(2048, 1024, True) is None  # full U: the methods are thin only
    assert config.large_svd_method(511, 511, False) is None
    assert config.large_svd_method(8192, 0, False) is None


def lowered_for_cuda(f, *shapes, dtype=jnp.float32):
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape in shapes]
    unstable = jax.export.DisabledSafetyCheck.custom_call("cusolver_gesvdp_ffi")  # see jaxforge/export.py
    return jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[unstable])(*args).mlir_module()


@pytest.mark.parametrize(
    "rules, present, absent",
    [
        ((), "cusolver_gesvdj_ffi", "cusolver_syevd_ffi"),  # jax's default at 512
        (((512, 1.0, "qdwh", False),), "cusolver_syevd_ffi", "gesvd"),
        (((512, 1.0, "gesvdp", False),), "cusolver_gesvdp_ffi", "gesvdj"),
        (((512, 2.0, "qdwh", True),), "cusolver_geqrf_ffi", "gesvd"),
    ],
)
def test_cuda_lowering_follows_the_rules(monkeypatch, rules, present, absent):
    monkeypatch.setattr(config, "LARGE_SVD", rules)
    text = lowered_for_cuda(lambda a: jf.linalg.svd(a), (1024, 512))  # a new function: no cached lowering
    assert present in text and absent not in text
    # and so do its derivatives: the jvp rule reads the forward's factors
    text = lowered_for_cuda(lambda a, t: jax.jvp(jf.linalg.svd, (a,), (t,)), (1024, 512), (1024, 512))
    assert present in text and absent not in text
