"""CUDA lowering of lstsq_p: the default algorithm with ``[A | b]`` factored by the block QR kernel.

csrc/qr_r*.{cuh,cu} computes only R (Householder in shared memory, one block per matrix), where it
fits (config.py); elsewhere, or where it cannot be built, cuSOLVER's geqrf runs as in the default.
"""

from __future__ import annotations

import jax

from jaxforge.lowering import build
from jaxforge.lowering.linalg.lstsq import config
from jaxforge.lowering.linalg.lstsq.xla import lstsq_xla, qr_r_lapack

KERNEL = build.declare(
    build.Kernel(
        name="qr_r",
        sources=("linalg/lstsq/csrc/qr_r_ffi.cu",),
        headers=("linalg/lstsq/csrc/qr_r.cuh", "csrc/xla_ffi.h"),
        targets={"jaxforge_qr_r_f32": "JaxforgeQrRF32", "jaxforge_qr_r_f64": "JaxforgeQrRF64"},
    )
)


def qr_r_cuda(x):
    *batch, m, cols = x.shape
    if not (config.use_qr_r_block(m, cols, x.dtype) and build.ensure_loaded(KERNEL)):
        return qr_r_lapack(x)
    return jax.ffi.ffi_call(KERNEL.target(x.dtype), jax.ShapeDtypeStruct((*batch, cols, cols), x.dtype))(x)


def lstsq_cuda(a, b, *, rcond: float):
    return lstsq_xla(a, b, rcond=rcond, qr_r=qr_r_cuda)
