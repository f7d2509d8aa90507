"""CUDA lowering of lstsq_p: the default algorithm with its QR factor chosen by shape (config.py).

Large tall float32 problems: CholeskyQR2 (cholesky_qr.py), matrix products in float64, with
Householder as its on-device fallback. Small ones: csrc/qr_r*.{cuh,cu} computes only the R of
``[A | b]`` (Householder in shared memory, one block per matrix). Elsewhere, or where the kernel
cannot be built, cuSOLVER's geqrf runs as in the default.
"""

from __future__ import annotations

import jax

from jaxforge.lowering import build
from jaxforge.lowering.linalg.lstsq import config
from jaxforge.lowering.linalg.lstsq.cholesky_qr import cholesky_qr2
from jaxforge.lowering.linalg.lstsq.xla import augmented_qr, lstsq_xla, qr_r_lapack

KERNEL = build.declare(
    build.Kernel(
        name="qr_r",
        sources=("linalg/lstsq/csrc/qr_r_ffi.cu",),
        headers=("linalg/lstsq/csrc/qr_r.cuh", "csrc/xla_ffi.h", "csrc/launch.h"),
        targets={"jaxforge_qr_r_f32": "JaxforgeQrRF32", "jaxforge_qr_r_f64": "JaxforgeQrRF64"},
    )
)


def qr_r_cuda(x):
    *batch, m, cols = x.shape
    if not (config.use_qr_r_block(m, cols, x.dtype) and build.ensure_loaded(KERNEL)):
        return qr_r_lapack(x)
    return jax.ffi.ffi_call(KERNEL.target(x.dtype), jax.ShapeDtypeStruct((*batch, cols, cols), x.dtype))(x)


def lstsq_cuda(a, b, *, rcond: float):
    m, n = a.shape[-2:]
    householder = augmented_qr(qr_r_cuda)
    factor = cholesky_qr2(householder) if config.use_cholesky_qr2(m, n, a.dtype) else householder
    return lstsq_xla(a, b, rcond=rcond, factor=factor)
