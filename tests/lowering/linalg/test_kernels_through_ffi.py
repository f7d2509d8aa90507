"""The linalg kernels' XLA FFI handlers on the CPU: their ``.cu`` files, compiled by the host
compiler against the CUDA emulation (tests/cuda_emulation/), are registered as CPU targets under
the kernels' own names, so that the cuda lowerings' calls (``_core.kernel_call``) run through XLA,
the handlers (bindings, dtype dispatch, shape checks, errors) and the emulated kernels, checked
against float64 numpy; and, on 8 CPU devices, through XLA's partitioner."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxforge.lowering import build
from jaxforge.lowering.linalg.lstsq import cuda as lstsq_cuda
from jaxforge.lowering.linalg.svd import cuda as svd_cuda
from jaxforge.primitives import _core
from tests.cuda_emulation import COMPILER, HARNESS, build_handlers, register_handlers
from tests.linalg_checks import check_svd
from tests.linalg_inputs import random, with_singular_values

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler (g++)")

DTYPES = {"f32": np.float32, "f64": np.float64, "c64": np.complex64, "c128": np.complex128}
SVD_TARGETS = [t for t in svd_cuda.KERNEL.targets if t not in svd_cuda.VALUES_TARGETS.values()]


@pytest.fixture(scope="session", autouse=True)  # once a process: XLA refuses a second registration of a name
def handlers(tmp_path_factory):
    """Every linalg kernel's handler registered as a CPU target. Returns the library's path."""
    library = build_handlers(tmp_path_factory.mktemp("ffi") / "linalg_handlers.so")
    register_handlers(library)
    return library


def dtype_of(target: str):
    return DTYPES[target.rsplit("_", 1)[1]]


def svd_with_info(a, target: str):
    """The four results of an SVD handler, ``info`` (sweeps, or -1 for NaN results) included."""
    *batch, m, n = a.shape
    k = min(m, n)
    results = [((*batch, k), np.finfo(a.dtype).dtype), ((*batch, m, k), a.dtype), ((*batch, k, n), a.dtype), (tuple(batch), np.int32)]
    types = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in results]
    return jax.jit(lambda a: _core.kernel_call(target, types, a))(a)


def solutions(a, b):
    """numpy's minimum-norm least-squares solution of each problem, in float64."""
    wide = np.result_type(a.dtype, np.float64)
    return np.stack([np.linalg.lstsq(m, c, rcond=None)[0] for m, c in zip(a.astype(wide), b.astype(wide))])


@pytest.mark.parametrize("target", SVD_TARGETS)
@pytest.mark.parametrize("shape", [(5, 9, 6), (3, 4, 7)], ids=["tall", "wide"])
def test_every_svd_handler_and_its_values_twin_match_numpy(target, shape):
    dtype = dtype_of(target)
    a = random(np.random.default_rng(1), shape, dtype)
    with jax.enable_x64(np.finfo(dtype).bits == 64):
        s, u, vh, info = svd_with_info(a, target)
        values = jax.jit(svd_cuda.jacobi_values, static_argnums=1)(a, svd_cuda.VALUES_TARGETS[target])
    assert s.dtype == np.finfo(dtype).dtype and u.dtype == dtype and u.shape == (*shape[:2], min(shape[1:]))
    check_svd(a, s, u, vh)
    assert (np.asarray(info) > 0).all()
    np.testing.assert_array_equal(values, s)  # the twin's bits are the full kernel's


@pytest.mark.parametrize("target", [svd_cuda.WARP_TARGETS["float32"], svd_cuda.BLOCK_TARGETS["complex64"]])
def test_a_matrix_holding_nan_or_inf_gets_nan_results_and_info_minus_one(target):
    a = random(np.random.default_rng(2), (4, 6, 5), dtype_of(target))
    a[1, 2, 3], a[3, 0, 0] = np.nan, np.inf
    s, u, vh, info = map(np.asarray, svd_with_info(a, target))
    assert list(info == -1) == [False, True, False, True]
    assert all(np.isnan(x[[1, 3]]).all() for x in (s, u, vh))
    check_svd(a[[0, 2]], s[::2], u[::2], vh[::2])


def test_empty_matrices_and_batches_launch_nothing():
    target = svd_cuda.WARP_TARGETS["float32"]
    s, u, vh, info = svd_with_info(np.ones((3, 4, 0), np.float32), target)  # k = 0: the handler zeroes info
    assert (s.shape, u.shape, vh.shape) == ((3, 0), (3, 4, 0), (3, 0, 0))
    np.testing.assert_array_equal(info, np.zeros(3, np.int32))
    s, u, vh, info = svd_with_info(np.ones((0, 4, 3), np.float32), target)
    assert (s.shape, u.shape, vh.shape, info.shape) == ((0, 3), (0, 4, 3), (0, 3, 3), (0,))


def test_a_shape_past_a_kernels_limit_is_refused_by_its_handler_naming_it():
    with pytest.raises(Exception, match=r"svd_jacobi: operand shape \(2, 40, 40\) exceeds the limit m, n <= 32"):
        svd_with_info(np.ones((2, 40, 40), np.float32), svd_cuda.WARP_TARGETS["float32"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_the_qr_handlers_match_numpy(dtype):
    rng = np.random.default_rng(3)
    a, b = random(rng, (4, 12, 5), dtype), random(rng, (4, 12, 2), dtype)
    wide_a, wide_b = np.swapaxes(a, -1, -2)[:, :, :8].copy(), b[:, :5].copy()  # 5 x 8: minimum norm
    solve = lambda targets: jax.jit(lambda a, b: lstsq_cuda.qr_solve_cuda(a, b, 1e-4, targets)[1:3])  # noqa: E731
    with jax.enable_x64(np.finfo(dtype).bits == 64):
        r = jax.jit(lstsq_cuda.qr_r_kernel)(a)
        tall = [solve(lstsq_cuda.QR_SOLVE_TARGETS)(a, b)]
        if dtype != np.complex64:  # the one-warp kernel is real
            tall.append(solve(lstsq_cuda.QR_SOLVE_WARP_TARGETS)(a, b))
        wide = solve(lstsq_cuda.QR_SOLVE_TARGETS)(wide_a, wide_b)
    tol = 100 * np.finfo(dtype).eps
    r_np = np.linalg.qr(a.astype(np.result_type(dtype, np.float64)), mode="r")
    np.testing.assert_allclose(np.abs(np.asarray(r)), np.abs(r_np), atol=tol * np.abs(r_np).max())
    for (x, certified), (problem_a, problem_b) in zip([*tall, wide], [(a, b)] * len(tall) + [(wide_a, wide_b)]):
        want = solutions(problem_a, problem_b)
        np.testing.assert_allclose(x, want, atol=tol * np.abs(want).max())
        assert np.asarray(certified).all()


def test_the_cuda_lowering_runs_each_devices_matrices_under_automatic_sharding(monkeypatch):
    """svd's cuda lowering, as a GPU machine dispatches it, jitted over 8 devices with the batch on
    automatic axes: each device's kernel call takes its 2 of the 16 matrices, none is gathered, and
    the results are the bits of one device's call."""
    monkeypatch.setattr(build, "gpu_arch", lambda: "sm_90a")
    monkeypatch.setitem(build._LOADED, svd_cuda.KERNEL.name, True)
    svd = lambda a: svd_cuda.svd_cuda(a, full_matrices=False, compute_uv=True, grad_eps=0.0)  # noqa: E731
    a = random(np.random.default_rng(4), (16, 9, 6), np.float32)
    auto = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.jit(svd, in_shardings=NamedSharding(auto, P("batch")))
    text = split.lower(a).compile().as_text()
    calls = re.findall(r"custom_call_target=\"jaxforge_svd_jacobi\w*\", operand_layout_constraints=\{(f32\[[\d,]+\])", text)
    assert calls == ["f32[2,9,6]"] and "all-gather" not in text, text
    whole = jax.jit(svd)(a)
    for x, y in zip(split(a), whole):
        np.testing.assert_array_equal(x, y)
    check_svd(a, *whole)


@pytest.fixture
def gpu_machine(monkeypatch):
    """The cuda lowerings as they see an sm_90a machine after the kernels' build, every kernel
    enabled (JAXFORGE_UNVALIDATED_KERNELS, as the gpu tests run them)."""
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    monkeypatch.setattr(build, "gpu_arch", lambda: "sm_90a")
    for kernel in (svd_cuda.KERNEL, lstsq_cuda.KERNEL):
        monkeypatch.setitem(build._LOADED, kernel.name, True)


def lstsq_problems(rng, m: int, n: int, dtype):
    """Two batches of ``(a, b)``: random, all of full rank (the kernel's certificate holds: its
    solutions are the results); and random, rank 2 (``L Rᴴ``), holding NaN, zero, random (the
    certificate fails: the exact branch runs on the kernel's factor)."""
    a, b = random(rng, (2, 5, m, n), dtype), random(rng, (2, 5, m, 2), dtype)
    a[1, 1] = random(rng, (m, 2), dtype) @ random(rng, (2, n), dtype)
    a[1, 2, 0, 1], a[1, 3] = np.nan, 0
    return zip(a, b)


LSTSQ_ROUTES = {  # the kernel lstsq's cuda lowering takes, once the config names it
    "one-warp fused solve": ("jaxforge_qr_solve_warp", dict()),
    "block fused solve": ("jaxforge_qr_solve_", dict(QR_KERNELS_FASTER=True, use_qr_solve_warp=lambda *shape: False)),
    "block R factor": ("jaxforge_qr_r_", dict(QR_KERNELS_FASTER=True, use_qr_solve_warp=lambda *shape: False, use_qr_solve=lambda *shape: False)),
}


@pytest.mark.parametrize("route", LSTSQ_ROUTES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lstsqs_cuda_lowering_through_each_kernel_gives_the_default_lowerings_results(gpu_machine, monkeypatch, route, dtype):
    """x, residuals, rank and singular values of lstsq's cuda lowering, each kernel route through the
    handlers, against the default (LAPACK) lowering on the same batches (:func:`lstsq_problems`)."""
    from jaxforge.lowering.linalg.lstsq import config
    from jaxforge.lowering.linalg.lstsq.xla import lstsq_xla

    target, patches = LSTSQ_ROUTES[route]
    for name, value in patches.items():
        monkeypatch.setattr(config, name, value)
    rcond, tol = 100 * np.finfo(dtype).eps, 100 * np.finfo(dtype).eps
    for a, b in lstsq_problems(np.random.default_rng(5), 10, 4, dtype):
        with jax.enable_x64(dtype == np.float64):
            cuda = jax.jit(lambda a, b: lstsq_cuda.lstsq_cuda(a, b, rcond=rcond))
            assert target in cuda.lower(a, b).as_text()
            got, want = cuda(a, b), jax.jit(lambda a, b: lstsq_xla(a, b, rcond=rcond))(a, b)
        (x, residuals, rank, s), (x_want, residuals_want, rank_want, s_want) = got[:4], want[:4]
        np.testing.assert_array_equal(rank, rank_want)
        for value, expected in ((x, x_want), (residuals, residuals_want), (s, s_want)):
            np.testing.assert_allclose(value, expected, rtol=tol, atol=tol * np.nanmax(np.abs(expected)))  # NaN where expected


@pytest.mark.parametrize("route", LSTSQ_ROUTES)
@pytest.mark.parametrize("shape", [(10, 4), (4, 10)], ids=["tall", "wide"])
def test_lstsqs_cuda_lowering_solves_each_matrix_as_alone_beside_one_that_fails_the_certificate(gpu_machine, monkeypatch, route, shape):
    """A batch holding a rank-deficient matrix runs the tighter rungs or the SVD where the kernel's
    certificate fails; the matrices it certified keep the kernel's solutions, so each gets what it
    gets alone (an ill-conditioned one, κ = 1e6, differed by about κ·eps when the whole batch took
    the other route's solutions)."""
    from jaxforge.lowering.linalg.lstsq import config

    for name, value in LSTSQ_ROUTES[route][1].items():
        monkeypatch.setattr(config, name, value)
    rng = np.random.default_rng(8)
    m, n = shape
    a = np.stack([with_singular_values(rng, (), m, n, np.geomspace(1, 1e-6, min(m, n)), np.float64), random(rng, (m, n), np.float64)])
    a[1] = random(rng, (m, 2), np.float64) @ random(rng, (2, n), np.float64)
    b = random(rng, (2, m, 3), np.float64)
    rcond = 100 * np.finfo(np.float64).eps
    with jax.enable_x64(True):
        cuda = jax.jit(lambda a, b: lstsq_cuda.lstsq_cuda(a, b, rcond=rcond)[0])
        together, alone = cuda(a, b), cuda(a[:1], b[:1])
    np.testing.assert_allclose(together[0], alone[0], rtol=1e-14, atol=1e-14 * np.abs(alone[0]).max())


def test_svds_cuda_lowering_through_the_values_twin_and_after_a_qr(gpu_machine):
    """svd's cuda lowering where only the values are asked for (the values twin) and for tall
    matrices no kernel holds (the R of their QR through the warp kernel); NaN where a matrix holds
    NaN, the others exact."""
    svd = lambda a, uv: svd_cuda.svd_cuda(a, full_matrices=False, compute_uv=uv, grad_eps=0.0)  # noqa: E731
    for shape, target in (((4, 9, 6), svd_cuda.VALUES_TARGETS[svd_cuda.PAIRS_TARGET]), ((3, 300, 20), svd_cuda.PAIRS_TARGET)):
        a = random(np.random.default_rng(6), shape, np.float32)
        a[1, 0, 0] = np.nan
        values, vectors = (jax.jit(functools.partial(svd, uv=uv)) for uv in (False, True))
        assert target in (values if shape[1] < 32 else vectors).lower(a).as_text()
        (s,), (s_uv, u, vh) = values(a), vectors(a)
        assert np.isnan(s[1]).all() and all(np.isnan(x[1]).all() for x in (s_uv, u, vh))
        finite = np.arange(shape[0]) != 1
        check_svd(a[finite], s_uv[finite], u[finite], vh[finite])
        np.testing.assert_allclose(s[finite], s_uv[finite], rtol=1e-5)


# The primitives' tests of values, derivatives (first and second order), batching, NaN and named
# shapes; not those that read LAPACK's calls in the compiled program, nor the slow thread-pool one.
PRIMITIVE_TESTS = (
    "(check_grads or jvp_matches or vmap or named_shapes or nan or nonfinite or full_matrices or matches_numpy"
    " or rank_deficient_reports or rank_deficient_gradient or both_branches) and not (test_lstsq and order_2)"
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_svds_and_lstsqs_primitive_tests_pass_through_their_cuda_lowerings(handlers):
    """svd's and lstsq's own tests, run in a process whose CPU lowerings of the two primitives are
    the cuda ones (``tests/cuda_emulation/gpu_lowerings.py``) over the emulated kernels: their rules
    (JVPs, transposes, batching) on the kernels' factors, with every kernel enabled."""
    tests = [f"tests/primitives/linalg/{name}" for name in ("test_svd.py", "test_lstsq.py")]
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "tests.cuda_emulation.gpu_lowerings"]
    env = dict(os.environ, JAXFORGE_EMULATED_HANDLERS=str(handlers))
    run = subprocess.run([*command, *tests, "-k", PRIMITIVE_TESTS], capture_output=True, text=True, env=env, timeout=560, cwd=HARNESS.parents[1])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 100, run.stdout[-500:]  # the selection ran (129 tests on 2026-12-07)
