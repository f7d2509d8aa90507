"""Which lstsq kernel the CUDA lowering calls, and the program it builds around the fused one,
lowered for cuda on this CPU machine."""

from __future__ import annotations

import re
import subprocess

import jax
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.lowering import build
from jaxforge.lowering.linalg.lstsq import config, cuda
from jaxforge.primitives.linalg.lstsq import default_rcond

F16, F32, F64, C64, C128 = map(np.dtype, (np.float16, np.float32, np.float64, np.complex64, np.complex128))


def test_the_fused_kernel_takes_what_fits_one_block(monkeypatch):
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    assert config.use_qr_solve(64, 16, 1, F32)  # ANCHORS' tiny lstsq: 17 columns, 4.3 KiB
    assert config.use_qr_solve(80, 60, 4, F64) and not config.use_qr_solve(81, 60, 4, F64)  # 40 KiB
    assert not config.use_qr_solve(64, 63, 2, F32)  # 65 columns
    assert not config.use_qr_solve(16, 14, 4, F32)  # [A | b] wide
    assert config.use_qr_solve(16, 64, 1, F32) and config.use_qr_solve(64, 160, 1, F32)  # wide: Aᵀ fits
    assert not config.use_qr_solve(65, 100, 1, F32) and not config.use_qr_solve(40, 257, 1, F32)
    assert not config.use_qr_solve(40, 256, 64, F32)  # Y (n x k) passes the 96 KiB of a block
    assert config.use_qr_solve(64, 16, 1, np.dtype(np.complex64)) and not config.use_qr_solve(64, 16, 1, F16)
    assert config.use_qr_solve(51, 40, 10, C128) and not config.use_qr_solve(52, 40, 10, C128)  # 40 KiB


SOLVE_SHAPES = [(64, 16, 1), (80, 60, 4), (9, 6, 3), (16, 64, 1), (40, 256, 64), (6, 9, 2), (64, 80, 7)]


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
def test_solve_bytes_match_the_kernel_layout(tmp_path):
    # A host program that prints the kernel's own solve_layout<T>(m, n, k, warps).bytes.
    def line(t, m, n, k):
        rows, cols = (m, n + k) if m >= n else (n, m)
        return f'  std::printf("%d\\n", q::solve_layout<{t}>({m}, {n}, {k}, q::warps_for({rows}, {cols})).bytes);\n'

    lines = "".join(line(t, *shape) for t in ("float", "double") for shape in SOLVE_SHAPES)
    source = tmp_path / "layout.cu"
    source.write_text(
        '#include <cstdio>\n#include "linalg/lstsq/csrc/qr_solve.cuh"\nnamespace q = jaxforge::qr_r;\n'
        f"int main() {{\n{lines}}}\n"
    )
    exe = tmp_path / "layout"
    nvcc = [build.nvcc_path(), "-std=c++17", f"-I{build.PACKAGE_LOWERING}"]
    subprocess.run([*nvcc, str(source), "-o", str(exe)], check=True)
    printed = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert printed == [config.qr_solve_bytes(*shape, size) for size in (4, 8) for shape in SOLVE_SHAPES]


def test_the_warp_kernel_takes_tiny_tall_real_problems(monkeypatch):
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    assert config.use_qr_solve_warp(64, 16, 1, F32) and config.use_qr_solve_warp(128, 29, 3, F32)  # 32 columns
    assert config.use_qr_solve_warp(64, 16, 1, F64) and not config.use_qr_solve_warp(65, 16, 1, F64)  # 64 rows
    assert not config.use_qr_solve_warp(129, 16, 1, F32) and not config.use_qr_solve_warp(64, 30, 3, F32)
    assert not config.use_qr_solve_warp(16, 14, 4, F32)  # [A | b] wide
    assert not config.use_qr_solve_warp(64, 16, 1, C64) and not config.use_qr_solve_warp(16, 64, 1, F32)


def test_kernels_stay_off_until_validated_and_faster(monkeypatch):
    monkeypatch.delenv("JAXFORGE_UNVALIDATED_KERNELS", raising=False)
    assert config.use_qr_solve_warp(64, 16, 1, F32) == config.QR_SOLVE_WARP_VALIDATED
    assert config.use_qr_solve(64, 16, 1, F32) == (config.QR_SOLVE_VALIDATED and config.QR_KERNELS_FASTER)
    assert config.use_qr_r_block(64, 17, F32) == (config.QR_R_VALIDATED and config.QR_KERNELS_FASTER)
    monkeypatch.setattr(config, "QR_KERNELS_FASTER", True)
    assert config.use_qr_solve(64, 16, 1, F32) == config.QR_SOLVE_VALIDATED
    assert config.use_qr_r_block(64, 17, F32) == config.QR_R_VALIDATED


def lowered_for_cuda(m, n, k, dtype):
    jax.clear_caches()  # the dispatch reads config and the environment at trace time
    args = (jax.ShapeDtypeStruct((8, m, n), dtype), jax.ShapeDtypeStruct((8, m, k), dtype))
    targets = [*cuda.QR_SOLVE_TARGETS.values(), *cuda.QR_SOLVE_WARP_TARGETS.values()]
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    exported = jax.export.export(jax.jit(jf.linalg.lstsq), platforms=("cuda",), disabled_checks=checks)(*args)
    return exported.mlir_module()


@pytest.mark.parametrize("dtype", [F32, F64, C64])
def test_the_cuda_lowering_calls_the_fused_kernel_with_numpy_s_cut_off(monkeypatch, dtype):
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    monkeypatch.setitem(build._LOADED, cuda.KERNEL.name, True)  # as on a GPU machine after the build
    monkeypatch.setattr(config, "use_qr_solve_warp", lambda *shape: False)  # the block kernel's call
    with jax.enable_x64(dtype == F64):
        text = lowered_for_cuda(64, 16, 1, dtype)
        short = {F32: "f32", F64: "f64", C64: "complex<f32>"}[dtype]
        call = next(line for line in text.splitlines() if cuda.QR_SOLVE_TARGETS[dtype.name] in line)
        rcond = re.search(r"rcond = ([0-9.eE+-]+) : f64", call).group(1)
        assert float(rcond) == default_rcond(dtype, 64, 16)
        operands = f"(tensor<8x64x16x{short}>, tensor<8x64x1x{short}>)"
        assert f"{operands} -> (tensor<8x17x17x{short}>, tensor<8x16x1x{short}>, tensor<8xi32>)" in call
        assert 'num_batch_dims = "1"' in call and "([i, j, k], [i, l, m])->([i, n, o], [i, p, q], [i])" in call  # batch-partitionable
        assert "jaxforge_qr_r" not in text  # the kernel's certificate replaces the factor-only call
        wide = lowered_for_cuda(16, 40, 2, dtype)  # R of Aᵀ: 16 x 16
        assert f"-> (tensor<8x16x16x{short}>, tensor<8x40x2x{short}>, tensor<8xi32>)" in wide
        assert "jaxforge_qr_solve" not in lowered_for_cuda(200, 70, 1, dtype)  # 71 columns


@pytest.mark.parametrize("dtype", [F32, F64])
def test_the_cuda_lowering_calls_the_warp_kernel_where_it_fits(monkeypatch, dtype):
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    monkeypatch.setitem(build._LOADED, cuda.KERNEL.name, True)
    with jax.enable_x64(dtype == F64):
        text = lowered_for_cuda(64, 16, 1, dtype)
        short = {F32: "f32", F64: "f64"}[dtype]
        call = next(line for line in text.splitlines() if cuda.QR_SOLVE_WARP_TARGETS[dtype.name] in line)
        assert float(re.search(r"rcond = ([0-9.eE+-]+) : f64", call).group(1)) == default_rcond(dtype, 64, 16)
        operands = f"(tensor<8x64x16x{short}>, tensor<8x64x1x{short}>)"
        assert f"{operands} -> (tensor<8x17x17x{short}>, tensor<8x16x1x{short}>, tensor<8xi32>)" in call
        assert cuda.QR_SOLVE_TARGETS[dtype.name] not in text
        wider = lowered_for_cuda(64, 40, 1, dtype)  # 41 columns: the block kernel
        assert cuda.QR_SOLVE_TARGETS[dtype.name] in wider and "qr_solve_warp" not in wider


def test_cholesky_qr_rules_can_admit_batches_only(monkeypatch):
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    monkeypatch.setattr(config, "CHOLESKY_QR_RULES", ((1, 256, 4),))
    assert config.use_cholesky_qr2(1, 16384, 1024, F32) and not config.use_cholesky_qr2(256, 512, 128, F32)
    monkeypatch.setattr(config, "CHOLESKY_QR_RULES", ((1, 256, 4), (64, 64, 4)))
    assert config.use_cholesky_qr2(256, 512, 128, F32) and not config.use_cholesky_qr2(8, 512, 128, F32)
    assert not config.use_cholesky_qr2(256, 512, 128, F64)  # no wider type for float64's Grams


def test_the_measured_shapes_take_the_measured_winner(monkeypatch):
    # ANCHORS' shapes as timed on the H200 (config.CHOLESKY_QR_RULES, QR_KERNELS_FASTER)
    monkeypatch.delenv("JAXFORGE_UNVALIDATED_KERNELS", raising=False)
    for batch, m, n in [(1, 16384, 1024), (256, 512, 128), (1, 4096, 4096)]:
        assert config.use_cholesky_qr2(batch, m, n, F32)
    assert not config.use_cholesky_qr2(8192, 64, 16, F32) and not config.use_qr_solve(64, 16, 1, F32)
    assert not config.use_qr_solve_warp(64, 16, 1, F32)  # until the H200 has timed it
