"""The CUDA linalg kernels' logic on the CPU: each kernel header, compiled by the host compiler
against tests/cuda_emulation/cuda_runtime.h (CUDA threads as fibers, barriers for the syncs and
shuffles, a deadlock reported rather than hung), runs through its own launch() and is checked
against float64 numpy. What a GPU adds (timing, the device memory model, register limits) is left
to the gpu tests."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess

import numpy as np
import pytest

from jaxforge.lowering.linalg.lstsq.xla import _two_norm_bound
from tests.cuda_emulation import COMPILER, HARNESS, compile_emulated
from tests.linalg_checks import check_svd
from tests.linalg_inputs import exactly_rank_deficient, random, with_singular_values

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler (g++)")


def emulated(source: str, exe: pathlib.Path, *flags: str, optimize: str = "-O2") -> pathlib.Path:
    """``tests/cuda_emulation/<source>`` built by the host compiler against the emulation."""
    return compile_emulated([HARNESS / source], exe, *flags, optimize=optimize)


def test_emulation_runs_barriers_shuffles_and_early_exits_and_reports_a_deadlock(tmp_path):
    exe = emulated("emulation_check.cc", tmp_path / "check")
    result = subprocess.run([str(exe), "barriers"], capture_output=True, text=True, check=True, timeout=60)
    live = [t for t in range(96) if t % 3]
    total = sum(sum(range(t // 32 * 32, t // 32 * 32 + 32)) for t in live)
    assert result.stdout == f"block 0: {total}\nblock 1: {total}\n"
    deadlock = subprocess.run([str(exe), "deadlock"], capture_output=True, text=True, timeout=60)
    assert deadlock.returncode != 0
    assert "emulated block 0: deadlock, 64 threads wait at barriers that cannot complete" in deadlock.stderr


THREAD_SANITIZER = ("-fsanitize=thread",)
# Stops a run at its first report, with ThreadSanitizer's exit code.
THREAD_SANITIZER_ENV = {"TSAN_OPTIONS": "halt_on_error=1"}


def test_thread_sanitizer_sees_only_the_syncs_order_memory(tmp_path):
    """Under ThreadSanitizer the emulation orders memory where CUDA does, at __syncwarp and
    __syncthreads, and not at a shuffle: lane 1's write read by lane 0 after a shuffle they share
    is a race, after a __syncwarp it is not (tests/cuda_emulation/cuda_runtime.h)."""
    exe = emulated("emulation_check.cc", tmp_path / "check", *THREAD_SANITIZER, optimize="-O1")
    env = {**os.environ, **THREAD_SANITIZER_ENV}
    run = lambda mode: subprocess.run([str(exe), mode], capture_output=True, text=True, timeout=60, env=env)  # noqa: E731
    shuffled, synced, barriers = run("shuffled"), run("synced"), run("barriers")
    assert shuffled.returncode != 0 and "WARNING: ThreadSanitizer: data race" in shuffled.stderr
    assert synced.returncode == 0 and synced.stdout == "lane 1 posted 7\n", synced.stderr
    assert barriers.returncode == 0 and barriers.stdout.startswith("block 0: "), barriers.stderr


def kernel_runner(exe: pathlib.Path, work: pathlib.Path, env: dict | None = None):
    """``run(kernel, x, *extra, tail=None, order="forward")``: the kernel on the (batch, m, n) array
    ``x`` (and the extra arguments and second input ``tail`` some kernels take) through the harness
    ``exe``, its threads run in ``order`` ("forward" or "reverse") between barriers; returns the raw
    bytes of its outputs, back to back."""

    def run(kernel: str, x: np.ndarray, *extra, tail: np.ndarray | None = None, order: str = "forward") -> bytes:
        batch, m, n = x.shape
        dtype = {np.float32: "f32", np.float64: "f64", np.complex64: "c64", np.complex128: "c128"}[x.dtype.type]
        data = x.tobytes() if tail is None else x.tobytes() + tail.astype(x.dtype).tobytes()
        (work / "in.bin").write_bytes(data)
        args = [str(exe), kernel, dtype, str(batch), str(m), str(n), str(work / "in.bin"), str(work / "out.bin")]
        env_run = {**os.environ, **(env or {}), "JAXFORGE_EMULATED_THREAD_ORDER": order}
        subprocess.run([*args, *map(str, extra)], check=True, timeout=300, env=env_run)
        return (work / "out.bin").read_bytes()

    return run


@pytest.fixture(scope="module")
def run_kernel(tmp_path_factory):
    """kernel_runner over the harness built as the tests' other programs are."""
    work = tmp_path_factory.mktemp("emulated")
    return kernel_runner(emulated("run_kernel.cc", work / "run_kernel"), work)


@pytest.fixture(scope="module")
def run_sanitized(tmp_path_factory):
    """kernel_runner over the harness built with AddressSanitizer and UndefinedBehaviorSanitizer, either
    stopping the run at its first report: an access past a buffer, past the dynamic shared memory a
    launch asked for (poisoned: tests/cuda_emulation/cuda_runtime.h), or undefined arithmetic."""
    work = tmp_path_factory.mktemp("sanitized")
    sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    exe = emulated("run_kernel.cc", work / "run_kernel", *sanitize, optimize="-O1")
    return kernel_runner(exe, work, {"ASAN_OPTIONS": "detect_leaks=0"})


@pytest.fixture(scope="module")
def run_thread_sanitized(tmp_path_factory):
    """kernel_runner over the harness built with ThreadSanitizer, which stops a run at a race: two
    accesses of a block's threads, one a write, that no __syncthreads or __syncwarp orders, in
    whichever order the threads ran. A launch runs one block (JAXFORGE_EMULATED_GRID), so that the
    kernels' grid-stride loops take every block through the syncs between one matrix and the next."""
    work = tmp_path_factory.mktemp("thread_sanitized")
    exe = emulated("run_kernel.cc", work / "run_kernel", *THREAD_SANITIZER, optimize="-O1")
    return kernel_runner(exe, work, {**THREAD_SANITIZER_ENV, "JAXFORGE_EMULATED_GRID": "1"})


def qr_r(run_kernel, x):
    c = x.shape[-1]
    return np.frombuffer(run_kernel("qr_r", x), x.dtype).reshape(x.shape[0], c, c)


def qr_solve(run_kernel, a, b, rcond, kernel="qr_solve"):
    """``(r, solution, certified)`` of a fused least-squares kernel (qr_solve, or qr_solve_warp for
    tiny tall real problems): r is R of ``[a | b]`` when tall, of ``aᴴ`` when wide."""
    batch, m, n = a.shape
    k = b.shape[-1]
    c = n + k if m >= n else m
    raw = run_kernel(kernel, a, k, repr(float(rcond)), tail=b)
    sizes = [batch * c * c, batch * n * k]
    values = np.frombuffer(raw, a.dtype, count=sum(sizes))
    r, solution = np.split(values, sizes[:1])
    certified = np.frombuffer(raw, np.int32, offset=values.nbytes)
    return r.reshape(batch, c, c), solution.reshape(batch, n, k), certified


def svd(run_kernel, kernel, x):
    """``(s, u, vh, info)`` of the kernel's thin SVD."""
    batch, m, n = x.shape
    k = min(m, n)
    raw = run_kernel(kernel, x)
    real = np.finfo(x.dtype).dtype  # s is real
    s = np.frombuffer(raw, real, count=batch * k)
    vectors = np.frombuffer(raw, x.dtype, count=batch * k * (m + n), offset=s.nbytes)
    u, vh = np.split(vectors, [batch * m * k])
    info = np.frombuffer(raw, np.int32, offset=s.nbytes + vectors.nbytes)
    return s.reshape(batch, k), u.reshape(batch, m, k), vh.reshape(batch, k, n), info


def svd_values(run_kernel, kernel, x):
    """``(s, info)`` of the kernel's values-alone twin (``kernel + "_values"``)."""
    batch, m, n = x.shape
    raw = run_kernel(kernel + "_values", x)
    s = np.frombuffer(raw, np.finfo(x.dtype).dtype, count=batch * min(m, n))
    return s.reshape(batch, -1), np.frombuffer(raw, np.int32, offset=s.nbytes)


def to_double(x):
    """``x`` in float64, or complex128 where complex."""
    return x.astype(np.result_type(x.dtype, np.float64))


def adjoint(x):
    return np.swapaxes(x, -1, -2).conj()


def largest(dtype):
    """(rows, columns) of the widest tall matrix the kernels hold: up to 64 columns, 40 KiB."""
    size = np.dtype(dtype).itemsize
    cols = min(64, math.isqrt(40960 // size))
    return 40960 // (cols * size), cols


def check_r(x, r, *, unique: bool = True):
    """``r`` is upper triangular (exact zeros below) with ``RᵀR = XᵀX``; where ``unique`` (X of full
    column rank) it also equals numpy's R up to row signs."""
    assert np.all(np.tril(r, -1) == 0)
    x64, r64 = to_double(x), to_double(r)
    bound = 50 * np.finfo(x.dtype).eps * np.sqrt(x.shape[-2])
    gram = adjoint(x64) @ x64
    error = np.linalg.norm(adjoint(r64) @ r64 - gram, axis=(-2, -1)) / np.linalg.norm(gram, axis=(-2, -1))
    assert error.max() <= bound, error.max()
    if unique:
        want = np.linalg.qr(x64, mode="r")
        signs = np.sign(np.diagonal(r64, axis1=-2, axis2=-1)) * np.sign(np.diagonal(want, axis1=-2, axis2=-1))
        scale = np.abs(want).max(axis=(-2, -1), keepdims=True)
        assert (np.abs(r64 * signs[..., :, None] - want) / scale).max() <= bound


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
def test_qr_r_matches_numpy(run_kernel, dtype):
    rng = np.random.default_rng(0)
    rows, cols = largest(dtype)
    for x in (random(rng, (3, 40, 17), dtype), random(rng, (2, 5, 1), dtype), random(rng, (1, rows, cols), dtype)):
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


def first_rung(r, rcond):
    """lstsq's first certificate (lowering/linalg/lstsq/xla.py) in float64, and its margin: the bound's
    distance from 1/rcond, relative."""
    r = to_double(r)
    bound = np.asarray(_two_norm_bound(r, 0) * _two_norm_bound(np.linalg.inv(r), 0))
    return bound * rcond < 1, np.abs(bound * rcond - 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
def test_qr_solve_matches_numpy_and_certifies_as_the_first_rung(run_kernel, dtype):
    rng = np.random.default_rng(5)
    eps = np.finfo(dtype).eps
    conditions = np.geomspace(1, 0.1 / eps, 12)  # across 1/rcond = 1 / (40 eps)
    graded = lambda m, n: np.stack(  # noqa: E731
        [with_singular_values(rng, (), m, n, np.geomspace(1, 1 / c, min(m, n)), np.result_type(dtype, np.float64))
         for c in conditions]
    ).astype(dtype)
    rows, cols = largest(dtype)
    cases = [  # (a, b, whether R is well determined)
        (random(rng, (3, 64, 16), dtype), random(rng, (3, 64, 1), dtype), True),  # ANCHORS' tiny lstsq
        (random(rng, (2, 9, 6), dtype), random(rng, (2, 9, 3), dtype), True),  # [A | b] square
        (random(rng, (1, rows, cols - 3), dtype), random(rng, (1, rows, 3), dtype), True),
        (graded(40, 10), random(rng, (len(conditions), 40, 2), dtype), False),
        (random(rng, (3, 16, 64), dtype), random(rng, (3, 16, 1), dtype), True),  # wide: QR of Aᴴ
        (random(rng, (2, 6, 9), dtype), random(rng, (2, 6, 3), dtype), True),
        (random(rng, (1, cols, rows), dtype), random(rng, (1, cols, 2), dtype), True),
        (graded(10, 40), random(rng, (len(conditions), 10, 2), dtype), False),
    ]
    for a, b, unique in cases:
        m, n = a.shape[-2:]
        rcond = eps * max(m, n)  # numpy's default
        r, x, certified = qr_solve(run_kernel, a, b, rcond)
        check_r(np.concatenate([a, b], axis=-1) if m >= n else adjoint(a), r, unique=unique)
        k = min(m, n)
        want, margin = first_rung(r[:, :k, :k], rcond)
        clear = margin > 0.1  # near 1/rcond the kernel's R⁻¹ is off by about condition * eps = 1/max(m, n)
        np.testing.assert_array_equal(certified[clear], want[clear])
        assert want.any() and (unique or not want.all())
        a64, b64 = to_double(a), to_double(b)
        for i in np.flatnonzero(certified):
            x_np = np.linalg.lstsq(a64[i], b64[i], rcond=None)[0]  # the minimum-norm one when wide
            condition = np.linalg.cond(a64[i])
            np.testing.assert_allclose(x[i], x_np, atol=50 * eps * condition * np.abs(x_np).max())


def test_qr_solve_certifies_exactly_as_the_first_rung_where_r_is_accurate(run_kernel):
    """At rcond = 1e-3 the threshold lies where float64 R⁻¹ has 12 digits, so the kernel's flag must
    follow the rung's bound to within rounding, across a sweep of conditions that straddles it."""
    rng = np.random.default_rng(7)
    conditions = np.geomspace(30, 3e3, 40)
    a = np.stack([with_singular_values(rng, (), 24, 7, np.geomspace(1, 1 / c, 7)) for c in conditions])
    r, _, certified = qr_solve(run_kernel, a, random(rng, (len(conditions), 24, 1)), 1e-3)
    want, margin = first_rung(r[:, :7, :7], 1e-3)
    assert 5 < want.sum() < 35 and margin.min() > 1e-9
    np.testing.assert_array_equal(certified, want)


@pytest.mark.parametrize("dtype", [np.float32, np.complex64])
@pytest.mark.parametrize("wide", [False, True])
def test_qr_solve_refuses_to_certify_singular_scaled_and_nonfinite_problems(run_kernel, wide, dtype):
    rng = np.random.default_rng(6)
    a, b = random(rng, (6, 30, 8), dtype), random(rng, (6, 30, 1), dtype)
    a[0] *= 1e-30  # the scaled Grams keep tiny and huge problems certifiable
    a[1] *= 1e30
    a[2, :, 5] = 0  # a zero pivot
    a[3, :, 6] = a[3, :, 2]  # rank-deficient without a zero pivot
    a[4, 3, 3] = np.nan
    if wide:  # the same matrices transposed: 8 x 30
        a, b = np.ascontiguousarray(np.swapaxes(a, -1, -2)), random(rng, (6, 8, 1), dtype)
    b[5, 7, 0] = np.inf  # A itself is fine: the certificate is about A
    _, x, certified = qr_solve(run_kernel, a, b, np.finfo(np.float32).eps * 30)
    np.testing.assert_array_equal(certified, [1, 1, 0, 0, 0, 1])
    for i in (0, 1):
        x_np = np.linalg.lstsq(to_double(a[i]), to_double(b[i]), rcond=None)[0]
        np.testing.assert_allclose(x[i], x_np, rtol=1e-4, atol=1e-4 * np.abs(x_np).max())
    assert not np.isfinite(x[5]).all()


def frobenius_rung(r, rcond):
    """The one-warp kernel's certificate, ‖R‖_F ‖R⁻¹‖_F rcond < 1, in float64, and its margin."""
    r = to_double(r)
    bound = np.linalg.norm(r, axis=(-2, -1)) * np.linalg.norm(np.linalg.inv(r), axis=(-2, -1))
    return bound * rcond < 1, np.abs(bound * rcond - 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_qr_solve_warp_matches_numpy_and_certifies_soundly(run_kernel, dtype):
    rng = np.random.default_rng(8)
    eps = np.finfo(dtype).eps
    conditions = np.geomspace(1, 0.1 / eps, 12)
    graded = np.stack(
        [with_singular_values(rng, (), 40, 10, np.geomspace(1, 1 / c, 10)) for c in conditions]
    ).astype(dtype)
    tallest = 128 if dtype == np.float32 else 64
    cases = [  # (a, b, whether R is well determined)
        (random(rng, (5, 64, 16), dtype), random(rng, (5, 64, 1), dtype), True),  # ANCHORS' tiny lstsq
        (random(rng, (3, 9, 6), dtype), random(rng, (3, 9, 3), dtype), True),  # [A | b] square
        (random(rng, (2, tallest, 29), dtype), random(rng, (2, tallest, 3), dtype), True),  # 32 columns
        (random(rng, (2, 70, 5), dtype)[:, : min(70, tallest)], random(rng, (2, min(70, tallest), 2), dtype), True),
        (random(rng, (1, 2, 1), dtype), random(rng, (1, 2, 1), dtype), True),
        (graded, random(rng, (len(conditions), 40, 2), dtype), False),
    ]
    for a, b, unique in cases:
        a = np.ascontiguousarray(a)
        m, n = a.shape[-2:]
        rcond = eps * m
        r, x, certified = qr_solve(run_kernel, a, b, rcond, kernel="qr_solve_warp")
        check_r(np.concatenate([a, b], axis=-1), r, unique=unique)
        want, margin = frobenius_rung(r[:, :n, :n], rcond)
        clear = margin > 0.1
        np.testing.assert_array_equal(certified[clear], want[clear])
        assert want.any() and (unique or not want.all())
        a64, b64 = to_double(a), to_double(b)
        for i in np.flatnonzero(certified):
            s = np.linalg.svd(a64[i], compute_uv=False)
            assert s[-1] > rcond * s[0]  # sound: numpy's full rank
            x_np = np.linalg.lstsq(a64[i], b64[i], rcond=None)[0]
            np.testing.assert_allclose(x[i], x_np, atol=50 * eps * (s[0] / s[-1]) * np.abs(x_np).max())


def test_qr_solve_warp_limits_are_config_s(run_kernel):
    """lstsq's config.qr_solve_warp_fits admits exactly what the kernel's supported<T> does."""
    from jaxforge.lowering.linalg.lstsq import config

    rng = np.random.default_rng(10)
    shapes = [(128, 29, 3), (129, 16, 1), (64, 31, 2), (32, 16, 16), (31, 16, 16), (65, 8, 1), (64, 8, 1)]
    for dtype in (np.float32, np.float64):
        for m, n, k in shapes:
            a, b = random(rng, (1, m, n), dtype), random(rng, (1, m, k), dtype)
            try:
                qr_solve(run_kernel, a, b, 1e-6, kernel="qr_solve_warp")
                runs = True
            except subprocess.CalledProcessError as refused:
                assert refused.returncode == 3  # the harness's "unsupported shape"
                runs = False
            assert runs == config.qr_solve_warp_fits(m, n, k, np.dtype(dtype)), (m, n, k, dtype)


def test_qr_solve_warp_refuses_to_certify_singular_and_nonfinite_problems(run_kernel):
    rng = np.random.default_rng(9)
    a, b = random(rng, (7, 64, 16), np.float32), random(rng, (7, 64, 1), np.float32)
    a[0] *= 1e-30  # float64 sums of squares keep tiny and huge problems certifiable
    a[1] *= 1e30
    a[2, :, 5] = 0  # a zero pivot
    a[3, :, 6] = a[3, :, 2]  # rank-deficient without a zero pivot
    a[4, 3, 3] = np.nan
    a[5, 0, 0] = np.inf
    b[6, 7, 0] = np.inf  # A itself is fine: the certificate is about A
    r, x, certified = qr_solve(run_kernel, a, b, np.finfo(np.float32).eps * 64, kernel="qr_solve_warp")
    np.testing.assert_array_equal(certified, [1, 1, 0, 0, 0, 0, 1])
    for i in (0, 1):
        check_r(np.concatenate([a[i : i + 1], b[i : i + 1]], axis=-1), r[i : i + 1])
        x_np = np.linalg.lstsq(to_double(a[i]), to_double(b[i]), rcond=None)[0]
        np.testing.assert_allclose(x[i], x_np, rtol=1e-4, atol=1e-4 * np.abs(x_np).max())
    assert np.isnan(r[4]).any() and not np.isfinite(x[6]).all()


@pytest.mark.parametrize(
    "kernel,dtype",
    [
        ("svd_jacobi", np.float32),
        ("svd_jacobi", np.float64),
        ("svd_jacobi", np.complex64),
        ("svd_jacobi", np.complex128),
        ("svd_jacobi_lanes", np.float32),
        ("svd_jacobi_pairs", np.float32),
    ],
)
def test_warp_svd_matches_numpy(run_kernel, kernel, dtype):
    """The sweeps of the one-warp kernel: a row per lane (real and complex), a column per lane
    and two lanes per column pair (float32)."""
    rng = np.random.default_rng(2)
    wide_type = np.result_type(dtype, np.float64)
    deficient = np.r_[np.linspace(2, 1, 6), np.zeros(6)]
    cases = [
        random(rng, (2, 20, 13), dtype),
        random(rng, (9, 6, 5), dtype),  # 8 matrices a block: a second block with 7 idle warps
        random(rng, (1, 9, 17), dtype),  # wide
        random(rng, (1, 32, 20), dtype),  # every lane holds a row
        random(rng, (1, 1, 1), dtype),
        with_singular_values(rng, (1,), 24, 16, np.geomspace(1, 1e-6, 16), wide_type).astype(dtype),
        with_singular_values(rng, (1,), 12, 12, deficient, wide_type).astype(dtype),
    ]
    for x in cases:
        s, u, vh, info = svd(run_kernel, kernel, x)
        assert np.all(info > 0)  # sweeps used
        check_svd(x, s, u, vh)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
def test_block_svd_matches_numpy(run_kernel, dtype):
    rng = np.random.default_rng(3)
    wide_type = np.result_type(dtype, np.float64)
    deficient = np.r_[np.linspace(2, 1, 6), np.zeros(6)]
    cases = [  # small column counts: a block's 256 threads take turns on one CPU thread here
        random(rng, (1, 36, 20), dtype),
        random(rng, (1, 20, 36), dtype),  # wide
        with_singular_values(rng, (1,), 64, 12, np.geomspace(1, 1e-6, 12), wide_type).astype(dtype),
        with_singular_values(rng, (1,), 40, 12, deficient, wide_type).astype(dtype),
    ]
    for x in cases:
        s, u, vh, info = svd(run_kernel, "svd_jacobi_block", x)
        assert np.all(info > 0)
        check_svd(x, s, u, vh)


def test_block_svd_with_column_pairs_in_registers_matches_numpy(run_kernel):
    """The slot sweeps: 4 threads a column pair up to 64 rows, 8 up to 128; 32 to 512 threads; V in
    registers up to 64 columns, past them in shared memory."""
    rng = np.random.default_rng(5)
    deficient = np.r_[np.linspace(2, 1, 24), np.zeros(24)]
    cases = [
        random(rng, (1, 64, 64), np.float32),
        random(rng, (1, 40, 33), np.float32),  # 31 zero players
        random(rng, (1, 37, 50), np.float32),  # wide
        random(rng, (1, 100, 40), np.float32),  # 8 threads a slot
        random(rng, (1, 16, 64), np.float32),  # one warp: 8 slots of 4 threads
        random(rng, (1, 100, 20), np.float32),  # 16 slots of 8 threads
        random(rng, (1, 40, 3), np.float32),  # 13 zero players
        random(rng, (1, 72, 66), np.float32),  # V in shared memory: 64 slots of 8 threads
        with_singular_values(rng, (1,), 56, 48, np.geomspace(1, 1e-6, 48)).astype(np.float32),
        with_singular_values(rng, (1,), 48, 48, deficient).astype(np.float32),
    ]
    for x in cases:
        s, u, vh, info = svd(run_kernel, "svd_jacobi_slots", x)
        assert np.all(info > 0)
        check_svd(x, s, u, vh)


@pytest.mark.parametrize(
    "kernel,dtype",
    [("svd_jacobi", np.float32), ("svd_jacobi", np.complex64), ("svd_jacobi_lanes", np.float32),
     ("svd_jacobi_pairs", np.float32), ("svd_jacobi_block", np.float32), ("svd_jacobi_block", np.float64),
     ("svd_jacobi_block", np.complex128), ("svd_jacobi_slots", np.float32)],
)  # fmt: skip
def test_svd_nonfinite_matrices_give_nan_and_info_minus_one(run_kernel, kernel, dtype):
    one_warp = kernel not in ("svd_jacobi_block", "svd_jacobi_slots")
    shape = (3, 12, 10) if one_warp else (3, 40, 36 if kernel == "svd_jacobi_slots" else 12)
    x = random(np.random.default_rng(4), shape, dtype)
    x[1, 3, 4] = np.inf if one_warp else np.nan
    if np.iscomplexobj(x):
        x[1, 3, 4], x[2, 5, 6] = complex(1, np.nan), complex(2, -np.inf)  # only the imaginary parts
    s, u, vh, info = svd(run_kernel, kernel, x)
    bad = [1, 2] if np.iscomplexobj(x) else [1]
    assert np.all(info[bad] == -1) and all(np.isnan(v[bad]).all() for v in (s, u, vh))
    keep = [i for i in range(x.shape[0]) if i not in bad]
    check_svd(x[keep], s[keep], u[keep], vh[keep])


@pytest.mark.parametrize(
    "kernel,dtype",
    [("svd_jacobi", np.float32), ("svd_jacobi", np.float64), ("svd_jacobi", np.complex64),
     ("svd_jacobi", np.complex128), ("svd_jacobi_lanes", np.float32), ("svd_jacobi_pairs", np.float32),
     ("svd_jacobi_block", np.float32), ("svd_jacobi_block", np.float64), ("svd_jacobi_block", np.complex64),
     ("svd_jacobi_block", np.complex128), ("svd_jacobi_slots", np.float32)],
)  # fmt: skip
def test_exact_zero_singular_values_get_a_completed_orthonormal_basis(run_kernel, kernel, dtype):
    """Where a singular value is exactly 0 the normalised factor (u when tall, vh when wide) has no
    vector of its own; the kernel completes the basis, so u and vh are orthonormal as LAPACK's: for a
    zero matrix, zero columns (rows), and a matrix whose vectors are unit vectors (the completion
    must start from the others)."""
    rng = np.random.default_rng(9)
    one_warp = kernel not in ("svd_jacobi_block", "svd_jacobi_slots")
    tall = (3, 9, 6) if one_warp else (3, 40, 36 if kernel == "svd_jacobi_slots" else 12)
    for shape in (tall, (tall[0], tall[2], tall[1])):
        x = exactly_rank_deficient(rng, shape, dtype)
        x[1] = 0
        x[1, :2, :2] = np.diag([3, 2])  # u's (vh's) first vectors are e_0 and e_1
        s, u, vh, info = svd(run_kernel, kernel, x)
        assert np.all(info > 0) and np.all(s[:, -1] == 0)  # the case: no vector from the kernel's sweeps
        check_svd(x, s, u, vh)


@pytest.mark.parametrize(
    "kernel,dtype",
    [("svd_jacobi", np.float32), ("svd_jacobi", np.float64), ("svd_jacobi", np.complex64),
     ("svd_jacobi", np.complex128), ("svd_jacobi_lanes", np.float32), ("svd_jacobi_pairs", np.float32),
     ("svd_jacobi_block", np.float32), ("svd_jacobi_block", np.float64), ("svd_jacobi_block", np.complex64),
     ("svd_jacobi_slots", np.float32)],
)  # fmt: skip
def test_values_alone_are_the_full_kernels_bits(run_kernel, kernel, dtype):
    """compute_uv=False's twins hold no V and write no vectors, but rotate W as the full kernels do:
    the same singular values to the bit, the same sweeps, NaN and -1 for a non-finite matrix."""
    rng = np.random.default_rng(6)
    one_warp = kernel not in ("svd_jacobi_block", "svd_jacobi_slots")
    shapes = [(3, 12, 10), (1, 7, 19), (1, 32, 32)] if one_warp else [(2, 40, 12), (1, 20, 36)]
    if kernel == "svd_jacobi_slots":
        shapes += [(1, 72, 66)]  # past 64 columns: the full kernel's V in shared memory, 512 threads
    for shape in shapes:
        x = random(rng, shape, dtype)
        x[0, 1] = 0  # a zero row, and for the wide shapes a zero column of W
        x[-1, 2, 3] = np.nan if x.shape[0] > 1 else x[-1, 2, 3]
        s_full, _, _, info_full = svd(run_kernel, kernel, x)
        s, info = svd_values(run_kernel, kernel, x)
        np.testing.assert_array_equal(s, s_full)
        np.testing.assert_array_equal(info, info_full)
        assert (info[-1] == -1) == (x.shape[0] > 1) and np.all(info[:-1] > 0)


RACE_CASES = {  # kernel: (dtype, shape, extra arguments), a batch that fills more than one block where one warp serves a matrix
    "qr_r": [(np.float32, (3, 20, 7), ()), (np.complex128, (2, 9, 5), ())],
    "qr_solve": [(np.float64, (3, 12, 5), (2, "1e-6")), (np.complex64, (2, 5, 8), (1, "1e-4"))],
    "qr_solve_warp": [(np.float32, (9, 20, 6), (2, "1e-4")), (np.float32, (3, 100, 20), (3, "1e-4"))],  # 2, 4 row slots
    "svd_jacobi": [
        (np.float32, (9, 12, 10), ()), (np.complex64, (3, 7, 12), ()), (np.float64, (3, 9, 6), ()), (np.complex128, (3, 8, 5), ()),
    ],
    "svd_jacobi_lanes": [(np.float32, (9, 12, 10), ())],
    "svd_jacobi_pairs": [(np.float32, (9, 10, 12), ())],
    "svd_jacobi_block": [(np.float64, (3, 40, 12), ()), (np.complex64, (3, 12, 36), ()), (np.float32, (2, 140, 12), ())],
    "svd_jacobi_slots": [(np.float32, (3, 40, 36), ()), (np.float32, (1, 72, 66), ())],
    "svd_jacobi_values": [(np.float32, (9, 12, 10), ())],
    "svd_jacobi_block_values": [(np.float32, (3, 40, 12), ())],
    "svd_jacobi_slots_values": [(np.float32, (3, 36, 40), ())],
}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", RACE_CASES)
def test_no_races_or_out_of_bounds_accesses(run_sanitized, run_thread_sanitized, kernel):
    """Each kernel runs under AddressSanitizer and UBSan, which stop a run at an access out of
    bounds, and under ThreadSanitizer, which stops it at a race within a block, there with its
    threads in reverse order and one block for the whole batch; the two give the same bits (blocks
    run in turn, so a race between them could only show as different bits). Each batch of several
    matrices holds a zero matrix and one with zero columns (rows when wide), so the completion of an
    SVD's basis and a QR's zero reflections run too."""
    rng = np.random.default_rng(10)
    for dtype, shape, extra in RACE_CASES[kernel]:
        x = exactly_rank_deficient(rng, shape, dtype)
        x[-1] = random(rng, shape[1:], dtype)
        tail = random(rng, (shape[0], shape[1], extra[0]), dtype) if extra else None
        forward = run_sanitized(kernel, x, *extra, tail=tail, order="forward")
        reverse = run_thread_sanitized(kernel, x, *extra, tail=tail, order="reverse")
        assert forward == reverse, (kernel, dtype, shape)

