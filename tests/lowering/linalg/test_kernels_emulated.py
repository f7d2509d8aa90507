"""The CUDA linalg kernels' logic on the CPU: each kernel header, compiled by the host compiler
against tests/cuda_emulation/cuda_runtime.h (CUDA threads as fibers, barriers for the syncs and
shuffles, a deadlock reported rather than hung), runs through its own launch() and is checked
against float64 numpy. What a GPU adds (timing, the device memory model, register limits) is left
to the gpu tests."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from jaxforge.lowering import build
from tests.linalg_checks import check_svd
from tests.linalg_inputs import random, with_singular_values

HARNESS = pathlib.Path(__file__).resolve().parents[2] / "cuda_emulation"
COMPILER = shutil.which("g++")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler (g++)")


@pytest.fixture(scope="module")
def run_kernel(tmp_path_factory):
    """``run_kernel(kernel, x)``: the kernel on the (batch, m, n) array ``x``; returns the raw bytes of
    its outputs, back to back."""
    work = tmp_path_factory.mktemp("emulated")
    exe = work / "run_kernel"
    subprocess.run(
        [COMPILER, "-std=c++20", "-O2", "-pthread", "-ffp-contract=off", "-DJAXFORGE_HOST_EMULATION",
         f"-I{HARNESS}", f"-I{build.PACKAGE_LOWERING}", str(HARNESS / "run_kernel.cc"), "-o", str(exe)],
        check=True,
    )  # fmt: skip

    def run(kernel: str, x: np.ndarray) -> bytes:
        batch, m, n = x.shape
        dtype = {np.float32: "f32", np.float64: "f64"}[x.dtype.type]
        np.ascontiguousarray(x).tofile(work / "in.bin")
        args = [str(exe), kernel, dtype, str(batch), str(m), str(n), str(work / "in.bin"), str(work / "out.bin")]
        subprocess.run(args, check=True, timeout=120)
        return (work / "out.bin").read_bytes()

    return run


def qr_r(run_kernel, x):
    c = x.shape[-1]
    return np.frombuffer(run_kernel("qr_r", x), x.dtype).reshape(x.shape[0], c, c)


def svd(run_kernel, kernel, x):
    """``(s, u, vh, info)`` of the kernel's thin SVD."""
    batch, m, n = x.shape
    k = min(m, n)
    raw = run_kernel(kernel, x)
    sizes = [batch * k, batch * m * k, batch * k * n]
    values = np.frombuffer(raw, x.dtype, count=sum(sizes))
    s, u, vh = np.split(values, np.cumsum(sizes)[:2])
    info = np.frombuffer(raw, np.int32, offset=values.nbytes)
    return s.reshape(batch, k), u.reshape(batch, m, k), vh.reshape(batch, k, n), info


def check_r(x, r, *, unique: bool = True):
    """``r`` is upper triangular (exact zeros below) with ``RᵀR = XᵀX``; where ``unique`` (X of full
    column rank) it also equals numpy's R up to row signs."""
    assert np.all(np.tril(r, -1) == 0)
    x64, r64 = x.astype(np.float64), r.astype(np.float64)
    bound = 50 * np.finfo(x.dtype).eps * np.sqrt(x.shape[-2])
    gram = np.swapaxes(x64, -1, -2) @ x64
    error = np.linalg.norm(np.swapaxes(r64, -1, -2) @ r64 - gram, axis=(-2, -1)) / np.linalg.norm(gram, axis=(-2, -1))
    assert error.max() <= bound, error.max()
    if unique:
        want = np.linalg.qr(x64, mode="r")
        signs = np.sign(np.diagonal(r64, axis1=-2, axis2=-1)) * np.sign(np.diagonal(want, axis1=-2, axis2=-1))
        scale = np.abs(want).max(axis=(-2, -1), keepdims=True)
        assert (np.abs(r64 * signs[..., :, None] - want) / scale).max() <= bound


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_qr_r_matches_numpy(run_kernel, dtype):
    rng = np.random.default_rng(0)
    limit = 40960 // (64 * np.dtype(dtype).itemsize)  # rows of a 64-column matrix at the 40 KiB cap
    for x in (random(rng, (3, 40, 17), dtype), random(rng, (2, 5, 1), dtype), random(rng, (1, limit, 64), dtype)):
        check_r(x, qr_r(run_kernel, x))


def test_qr_r_scaling_zero_columns_and_nan(run_kernel):
    rng = np.random.default_rng(1)
    x = random(rng, (4, 30, 9), np.float32)
    x[0] *= 1e-30  # below the plain sum of squares' safe range: the scaled second pass
    x[1] *= 1e30  # above it
    x[2, :, 4] = 0  # a zero column reflects nothing
    r = qr_r(run_kernel, x[:3])
    check_r(x[:2], r[:2])
    check_r(x[2:3], r[2:3], unique=False)  # rank-deficient: R's trailing rows are not unique
    assert r[2, 4, 4] == 0
    x[3, 7, 2] = np.nan
    r = qr_r(run_kernel, x)
    assert np.isnan(r[3]).any() and np.isfinite(r[:3]).all()


@pytest.mark.parametrize(
    "kernel,dtype", [("svd_jacobi", np.float32), ("svd_jacobi", np.float64), ("svd_jacobi_lanes", np.float32)]
)
def test_warp_svd_matches_numpy(run_kernel, kernel, dtype):
    """Both sweeps of the one-warp kernel: a row per lane, and a column per lane (float32 only)."""
    rng = np.random.default_rng(2)
    deficient = np.r_[np.linspace(2, 1, 6), np.zeros(6)]
    cases = [
        random(rng, (2, 20, 13), dtype),
        random(rng, (9, 6, 5), dtype),  # 8 matrices a block: a second block with 7 idle warps
        random(rng, (1, 9, 17), dtype),  # wide
        random(rng, (1, 32, 20), dtype),  # every lane holds a row
        random(rng, (1, 1, 1), dtype),
        with_singular_values(rng, (1,), 24, 16, np.geomspace(1, 1e-6, 16)).astype(dtype),
        with_singular_values(rng, (1,), 12, 12, deficient).astype(dtype),
    ]
    for x in cases:
        s, u, vh, info = svd(run_kernel, kernel, x)
        assert np.all(info > 0)  # sweeps used
        check_svd(x, s, u, vh)


def test_block_svd_matches_numpy(run_kernel):
    rng = np.random.default_rng(3)
    cases = [  # small column counts: a block's 256 threads take turns on one CPU thread here
        random(rng, (1, 36, 20), np.float32),
        random(rng, (1, 20, 36), np.float32),  # wide
        with_singular_values(rng, (1,), 64, 12, np.geomspace(1, 1e-6, 12)).astype(np.float32),
    ]
    for x in cases:
        s, u, vh, info = svd(run_kernel, "svd_jacobi_block", x)
        assert np.all(info > 0)
        check_svd(x, s, u, vh)


@pytest.mark.parametrize("kernel", ["svd_jacobi", "svd_jacobi_lanes", "svd_jacobi_block"])
def test_svd_nonfinite_matrices_give_nan_and_info_minus_one(run_kernel, kernel):
    one_warp = kernel != "svd_jacobi_block"
    x = random(np.random.default_rng(4), (3, 12, 10) if one_warp else (2, 40, 12), np.float32)
    x[1, 3, 4] = np.inf if one_warp else np.nan
    s, u, vh, info = svd(run_kernel, kernel, x)
    assert info[1] == -1 and all(np.isnan(v[1]).all() for v in (s, u, vh))
    keep = [i for i in range(x.shape[0]) if i != 1]
    check_svd(x[keep], s[keep], u[keep], vh[keep])
