"""CUDA lowering of svd_p: the batched one-warp Jacobi kernel (csrc/svd_jacobi*.{cuh,cu}) where it fits.

Shapes the kernel does not serve (config.py) and machines where it cannot be built fall back to the
default lowering. Matrices that hold NaN/Inf or do not converge come back as NaN from the kernel.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxforge.lowering import build
from jaxforge.lowering.linalg.svd import config
from jaxforge.lowering.linalg.svd.xla import svd_xla

KERNEL = build.declare(
    build.Kernel(
        name="svd_jacobi",
        sources=("linalg/svd/csrc/svd_jacobi_ffi.cu",),
        headers=("linalg/svd/csrc/svd_jacobi.cuh", "csrc/xla_ffi.h"),
        targets={"jaxforge_svd_jacobi_f32": "JaxforgeSvdJacobiF32", "jaxforge_svd_jacobi_f64": "JaxforgeSvdJacobiF64"},
    )
)


def svd_cuda(a, *, full_matrices: bool, compute_uv: bool, grad_eps: float):
    *batch, m, n = a.shape
    if not (config.use_jacobi_warp(m, n, a.dtype, full_matrices) and build.ensure_loaded(KERNEL)):
        return svd_xla(a, full_matrices=full_matrices, compute_uv=compute_uv, grad_eps=grad_eps)
    k = min(m, n)
    result_types = (
        jax.ShapeDtypeStruct((*batch, k), a.dtype),
        jax.ShapeDtypeStruct((*batch, m, k), a.dtype),
        jax.ShapeDtypeStruct((*batch, k, n), a.dtype),
        jax.ShapeDtypeStruct(tuple(batch), np.int32),  # sweeps used, -1 where the result is NaN
    )
    s, u, vh, _ = jax.ffi.ffi_call(KERNEL.target(a.dtype), result_types)(a)
    return (s, u, vh) if compute_uv else (s,)
