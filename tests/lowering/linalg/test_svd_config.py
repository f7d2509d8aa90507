"""Dispatch of svd on CUDA, decided without a GPU: which kernel serves which shape, and the block
kernel's shared-memory size as config.py computes it against the kernel's own layout."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from jaxforge.lowering import build
from jaxforge.lowering.linalg.svd import config

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
SIZES = [(33, 33), (64, 64), (128, 128), (200, 37), (256, 100), (256, 128), (45, 1)]


def _block_header_prints(tmp_path, expressions):
    """The values of C++ ``expressions`` (ints) in the namespace of svd_jacobi_block.cuh, one line of
    them per entry, from a host program compiled by nvcc and run on the CPU."""
    source = tmp_path / "prints.cu"
    source.write_text(
        '#include <cstdio>\n#include "linalg/svd/csrc/svd_jacobi_block.cuh"\n'
        "using namespace jaxforge::svd_jacobi_block;\n"
        "int main() {\n"
        + "".join(f'  std::printf("{" ".join(["%d"] * len(e))}\\n", {", ".join(e)});\n' for e in expressions)
        + "}\n"
    )
    exe = tmp_path / "prints"
    subprocess.run([build.nvcc_path(), "-std=c++17", f"-I{build.PACKAGE_LOWERING}", str(source), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [tuple(map(int, line.split())) for line in out.splitlines()]


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
def test_block_bytes_match_the_kernel_layout(tmp_path):
    types = {"float": F32, "double": F64, "jaxforge::Complex<float>": np.dtype(np.complex64), "jaxforge::Complex<double>": np.dtype(np.complex128)}
    printed = _block_header_prints(tmp_path, [[f"block_layout<{t}>({r}, {c}).bytes" for t in types] for r, c in SIZES])
    assert printed == [tuple(config.jacobi_block_bytes(r, c, dtype) for dtype in types.values()) for r, c in SIZES]


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
def test_slot_bytes_and_limits_match_the_kernel(tmp_path, monkeypatch):
    # slots_bytes<float>(R, C) and slots_fit(R, C) from the kernel header, against config.py's.
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    sizes = [(33, 33), (64, 64), (100, 40), (128, 64), (65, 33), (128, 65), (129, 40), (64, 32), (50, 40), (100, 20),
             (40, 3), (64, 16), (33, 1), (128, 128), (70, 66), (128, 129)]
    expressions = [[f"slots_bytes<float>({r}, {c})", f"slots_fit({r}, {c})"] for r, c in sizes]
    printed = _block_header_prints(tmp_path, expressions)
    fits = [config.use_jacobi_slots(r, c, F32, False, "sm_90a") for r, c in sizes]
    assert printed == [(config.jacobi_slots_bytes(r, c), int(fit)) for (r, c), fit in zip(sizes, fits, strict=True)]


def test_each_shape_goes_to_one_kernel(monkeypatch):
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    block = lambda m, n, dtype=F32, arch="sm_90a", full=False: config.use_jacobi_block(m, n, dtype, full, arch)  # noqa: E731
    assert config.use_jacobi_warp(32, 17, F32, False) and not block(32, 17)
    assert config.use_jacobi_warp(32, 17, np.dtype(np.complex64), False) and not block(32, 17, np.dtype(np.complex64))
    assert block(64, 64) and block(200, 37) and block(45, 130) and block(128, 128)
    assert block(64, 64, F64) and block(256, 64, F64) and block(100, 100, F64)  # float64: the shared-memory sweeps
    assert not block(128, 128, F64) and not block(256, 100, F64)  # over 227 KiB in float64
    c64, c128 = np.dtype(np.complex64), np.dtype(np.complex128)
    assert block(64, 64, c64) and block(200, 40, c64) and not block(100, 100, c64) and not block(32, 32, c64)
    assert block(64, 64, c128) and not block(100, 100, c128)  # 317 KiB
    assert not block(128, 128, arch="sm_80") and block(64, 64, arch="sm_80")  # 199 KB > sm_80's 163 KiB
    assert not block(256, 128) and not block(257, 10) and not block(300, 129)  # past the kernel's limits
    assert not block(70, 40, full=True) and block(70, 70, full=True)  # thin factors only
    assert not block(64, 64, arch=None)  # no GPU
    slots = lambda m, n, dtype=F32, arch="sm_90a": config.use_jacobi_slots(m, n, dtype, False, arch)  # noqa: E731
    assert slots(64, 64) and slots(33, 128) and slots(128, 40) and slots(100, 20) and slots(3, 40)
    assert slots(128, 128) and slots(65, 65) and slots(70, 100)
    assert not slots(32, 32) and not slots(129, 64)  # the warp kernel's, past the slots' rows
    assert not slots(64, 64, F64) and not slots(64, 64, arch=None) and not slots(128, 128, arch="sm_80")


def test_kernels_stay_off_until_validated(monkeypatch):
    monkeypatch.delenv("JAXFORGE_UNVALIDATED_KERNELS", raising=False)
    assert config.use_jacobi_block(64, 64, F32, False, "sm_90a") == config.JACOBI_BLOCK_VALIDATED
    assert config.use_jacobi_block(64, 64, F64, False, "sm_90a") == config.JACOBI_BLOCK_F64_VALIDATED
    assert config.use_jacobi_block(64, 64, np.dtype(np.complex64), False, "sm_90a") == config.JACOBI_BLOCK_COMPLEX_VALIDATED
    assert (config.jacobi_warp_sweeps(F32) == "pairs") == config.JACOBI_PAIRS_VALIDATED


@pytest.mark.parametrize(
    "pairs,lanes,expected", [(True, True, "pairs"), (False, True, "lanes"), (False, False, "rows")]
)
def test_the_one_warp_sweeps_of_float32(monkeypatch, pairs, lanes, expected):
    monkeypatch.delenv("JAXFORGE_UNVALIDATED_KERNELS", raising=False)
    monkeypatch.setattr(config, "JACOBI_PAIRS_VALIDATED", pairs)
    monkeypatch.setattr(config, "JACOBI_LANES", lanes)
    assert config.jacobi_warp_sweeps(F32) == expected
    assert config.jacobi_warp_sweeps(F64) == config.jacobi_warp_sweeps(np.dtype(np.complex64)) == "rows"


@pytest.fixture
def gpu_machine(monkeypatch):
    """An sm_90a GPU machine after the kernels' build, as the cuda lowering sees it; kernels run once
    validated (JAXFORGE_UNVALIDATED_KERNELS unset). Returns svd's cuda lowering module."""
    from jaxforge.lowering.linalg.svd import cuda

    monkeypatch.delenv("JAXFORGE_UNVALIDATED_KERNELS", raising=False)
    monkeypatch.setattr(build, "gpu_arch", lambda: "sm_90a")
    monkeypatch.setitem(build._LOADED, cuda.KERNEL.name, True)
    return cuda


def custom_calls(f, shape, dtype, target=None) -> list[str]:
    """The jaxforge_svd_jacobi custom calls of ``jit(f)`` exported for cuda at ``shape``, ``dtype``
    (``f`` a new function each time: jit caches a function's lowering, made under other flags)."""
    import jax

    checks = [jax.export.DisabledSafetyCheck.custom_call(target)] if target else []
    exported = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=checks)(jax.ShapeDtypeStruct(shape, dtype))
    return [line for line in exported.mlir_module().splitlines() if "stablehlo.custom_call @jaxforge_svd_jacobi" in line]


@pytest.mark.parametrize("dtype", [np.float32, np.complex64])
def test_the_cuda_lowering_calls_the_warp_kernel_with_real_singular_values(gpu_machine, monkeypatch, dtype):
    import jaxforge as jf

    cuda = gpu_machine
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    sweeps = config.jacobi_warp_sweeps(np.dtype(dtype))
    target = cuda.SWEEP_TARGETS.get(sweeps, cuda.WARP_TARGETS[np.dtype(dtype).name])
    (call,) = custom_calls(lambda a: jf.linalg.svd(a), (8, 20, 12), dtype, target)
    element = {np.float32: "f32", np.complex64: "complex<f32>"}[dtype]
    assert f"@{target}(" in call
    assert f"-> (tensor<8x12xf32>, tensor<8x20x12x{element}>, tensor<8x12x12x{element}>, tensor<8xi32>)" in call
    # batch-partitionable, as jax's cuSOLVER calls: one batch factor shared by every operand and result
    assert 'num_batch_dims = "1"' in call
    assert "#sdy.op_sharding_rule<([i, j, k])->([i, l], [i, m, n], [i, o, p], [i]) {i=8, j=20, k=12, l=12, m=20, n=12, o=12, p=12}, custom>" in call


@pytest.mark.parametrize("slots", [True, False])
def test_the_cuda_lowering_calls_the_block_kernel_with_its_slot_sweeps_where_they_fit(gpu_machine, monkeypatch, slots):
    import jaxforge as jf

    cuda = gpu_machine
    monkeypatch.setattr(config, "JACOBI_SLOTS_VALIDATED", slots)
    for shape in ((8, 64, 64), (8, 40, 100)):
        target = cuda.SLOTS_TARGET if slots and max(shape) <= 128 else cuda.BLOCK_TARGETS["float32"]
        (call,) = custom_calls(lambda a: jf.linalg.svd(a), shape, np.float32, target)
        assert f"@{target}(" in call


@pytest.mark.parametrize("validated", [True, False])
def test_an_svd_without_vectors_calls_the_values_twin_once_validated(gpu_machine, monkeypatch, validated):
    """compute_uv=False, asked for or left by svd_p's dead-code rule, runs the kernel's twin for the
    values alone (results s and info), else the kernel itself."""
    import jaxforge as jf

    cuda = gpu_machine
    monkeypatch.setattr(config, "JACOBI_VALUES_VALIDATED", validated)
    for shape, dtype, kernel in (((8, 32, 32), np.float32, cuda.PAIRS_TARGET), ((8, 20, 12), np.float64, cuda.WARP_TARGETS["float64"]),
                                 ((8, 64, 64), np.float32, cuda.SLOTS_TARGET), ((8, 40, 200), np.float32, cuda.BLOCK_TARGETS["float32"])):  # fmt: skip
        target = cuda.VALUES_TARGETS[kernel] if validated else kernel
        for values in (lambda a: jf.linalg.svd(a, compute_uv=False), lambda a: jf.linalg.svd(a)[1]):
            calls = custom_calls(values, shape, dtype, target)
            assert len(calls) == 1 and f"@{target}(" in calls[0], calls
            k = min(shape[-2:])
            results = f"-> (tensor<8x{k}x{'f32' if dtype == np.float32 else 'f64'}>, tensor<8xi32>)"
            assert (results in calls[0]) == validated


def test_values_alone_of_a_non_square_matrix_take_the_kernels_even_with_full_matrices(gpu_machine):
    """full_matrices=True (numpy's default) changes no singular value: the call binds the thin SVD,
    which the kernels serve."""
    import jaxforge as jf

    cuda = gpu_machine
    (call,) = custom_calls(lambda a: jf.linalg.svd(a, full_matrices=True, compute_uv=False), (8, 20, 12), np.float32, cuda.PAIRS_TARGET)
    assert f"@{cuda.PAIRS_TARGET}(" in call


@pytest.mark.parametrize("validated", [True, False])
def test_a_tall_batch_past_the_kernels_takes_the_kernel_of_r_after_a_qr(gpu_machine, monkeypatch, validated):
    import jaxforge as jf

    cuda = gpu_machine
    monkeypatch.setattr(config, "JACOBI_QR_FIRST_VALIDATED", validated)
    cases = [((8, 600, 40), np.float32, cuda.SLOTS_TARGET, 40),  # R 40 x 40
             ((8, 20, 700), np.float32, cuda.PAIRS_TARGET, 20),  # wide: R of Aᴴ, 20 x 20
             ((4, 300, 24), np.complex64, cuda.WARP_TARGETS["complex64"], 24),
             ((8, 600, 40), np.complex64, cuda.BLOCK_TARGETS["complex64"] if config.JACOBI_BLOCK_COMPLEX_VALIDATED else None, 40),
             ((2, 300, 300), np.float32, None, 0)]  # fmt: skip
    for shape, dtype, target, k in cases:
        for f in (lambda a: jf.linalg.svd(a), lambda a: jf.linalg.svd(a, compute_uv=False)):
            calls = custom_calls(f, shape, dtype, target)
            if target is None or not validated:
                assert not calls, calls
            else:
                assert len(calls) == 1 and f"@{target}(" in calls[0] and f"(tensor<{shape[0]}x{k}x{k}x" in calls[0], calls
