"""CUDA lowering of svd_p: the batched Jacobi kernels (csrc/svd_jacobi*.{cuh,cu}) where they fit.

Shapes the kernel does not serve (config.py) and machines where it cannot be built fall back to the
default lowering. Matrices that hold NaN/Inf or do not converge come back as NaN from the kernel.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxforge.lowering import build
from jaxforge.lowering.linalg.svd import config
from jaxforge.lowering.linalg.svd.xla import svd_xla

WARP_TARGETS = {"float32": "jaxforge_svd_jacobi_f32", "float64": "jaxforge_svd_jacobi_f64"}
BLOCK_TARGET = "jaxforge_svd_jacobi_block_f32"  # float32 only (config.use_jacobi_block)
KERNEL = build.declare(
    build.Kernel(
        name="svd_jacobi",
        sources=("linalg/svd/csrc/svd_jacobi_ffi.cu",),
        headers=("linalg/svd/csrc/svd_jacobi.cuh", "linalg/svd/csrc/svd_jacobi_block.cuh", "csrc/xla_ffi.h"),
        targets={
            WARP_TARGETS["float32"]: "JaxforgeSvdJacobiF32",
            WARP_TARGETS["float64"]: "JaxforgeSvdJacobiF64",
            BLOCK_TARGET: "JaxforgeSvdJacobiBlockF32",
        },
    )
)


def _target(a, full_matrices: bool) -> str | None:
    """The FFI target serving ``a``, or None where the default lowering does."""
    m, n = a.shape[-2:]
    if config.use_jacobi_warp(m, n, a.dtype, full_matrices):
        return WARP_TARGETS[a.dtype.name]
    if config.use_jacobi_block(m, n, a.dtype, full_matrices, build.gpu_arch()):
        return BLOCK_TARGET
    return None


def svd_cuda(a, *, full_matrices: bool, compute_uv: bool, grad_eps: float):
    target = _target(a, full_matrices)
    if target is None or not build.ensure_loaded(KERNEL):
        return svd_xla(a, full_matrices=full_matrices, compute_uv=compute_uv, grad_eps=grad_eps)
    s, u, vh = jacobi_svd(a, target)
    return (s, u, vh) if compute_uv else (s,)


def jacobi_svd(a, target: str):
    """``(s, u, vh)`` of the thin SVD by the Jacobi kernel ``target`` (loaded; NaN where a matrix
    held NaN/Inf or did not converge). The benchmark calls it to time the kernels side by side."""
    *batch, m, n = a.shape
    k = min(m, n)
    result_types = (
        jax.ShapeDtypeStruct((*batch, k), a.dtype),
        jax.ShapeDtypeStruct((*batch, m, k), a.dtype),
        jax.ShapeDtypeStruct((*batch, k, n), a.dtype),
        jax.ShapeDtypeStruct(tuple(batch), np.int32),  # sweeps used, -1 where the result is NaN
    )
    s, u, vh, _ = jax.ffi.ffi_call(target, result_types)(a)
    return s, u, vh
