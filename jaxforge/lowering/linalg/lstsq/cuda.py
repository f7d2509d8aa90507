"""CUDA lowering of lstsq_p: the default algorithm with its QR factor chosen by shape (config.py).

Tiny tall real problems, once config admits it (QR_SOLVE_WARP_VALIDATED): csrc/qr_solve_warp.cuh, the
same fused solve by one warp per matrix held in registers. Small problems, once config admits the
kernels (QR_KERNELS_FASTER): csrc/qr_solve.cuh solves in one kernel, the Householder QR of
``[A | b]`` (of ``Aᴴ`` when wide) in shared memory, one block per matrix, Q never formed, the
substitutions and a rung of the full-rank certificate (block: the Gram rung, 0; warp: the
Frobenius one, -1); a batch it certifies needs nothing else. Large and batched tall float32 problems: CholeskyQR2 (cholesky_qr.py), matrix products in
float64, with Householder as its on-device fallback; the Householder kernel alone (csrc/qr_r.cuh)
factors what fits it. Elsewhere, or where the kernel cannot be built, cuSOLVER's geqrf runs as in
the default. The derivative rule factors nothing in full rank:
it solves on the R returned here. ``thin_qr`` lends the same choice of QR to svd.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxforge.lowering import build
from jaxforge.lowering.linalg.lstsq import config
from jaxforge.lowering.linalg.lstsq.cholesky_qr import cholesky_qr2, cholesky_qr2_thin
from jaxforge.lowering.linalg.lstsq.xla import augmented_qr, lstsq_xla, qr_r_lapack
from jaxforge.primitives import _core

QR_R_TARGETS = {
    "float32": "jaxforge_qr_r_f32",
    "float64": "jaxforge_qr_r_f64",
    "complex64": "jaxforge_qr_r_c64",
    "complex128": "jaxforge_qr_r_c128",
}
QR_SOLVE_TARGETS = {
    "float32": "jaxforge_qr_solve_f32",
    "float64": "jaxforge_qr_solve_f64",
    "complex64": "jaxforge_qr_solve_c64",
    "complex128": "jaxforge_qr_solve_c128",
}
QR_SOLVE_WARP_TARGETS = {"float32": "jaxforge_qr_solve_warp_f32", "float64": "jaxforge_qr_solve_warp_f64"}
KERNEL = build.declare(
    build.Kernel(
        name="qr_r",
        sources=("linalg/lstsq/csrc/qr_r_ffi.cu",),
        headers=(
            "linalg/lstsq/csrc/qr_r.cuh",
            "linalg/lstsq/csrc/qr_solve.cuh",
            "linalg/lstsq/csrc/qr_solve_warp.cuh",
            "csrc/xla_ffi.h",
            "csrc/launch.h",
            "csrc/scalar.h",
            "csrc/warp.h",
        ),
        targets={
            "jaxforge_qr_r_f32": "JaxforgeQrRF32",
            "jaxforge_qr_r_f64": "JaxforgeQrRF64",
            "jaxforge_qr_r_c64": "JaxforgeQrRC64",
            "jaxforge_qr_r_c128": "JaxforgeQrRC128",
            "jaxforge_qr_solve_f32": "JaxforgeQrSolveF32",
            "jaxforge_qr_solve_f64": "JaxforgeQrSolveF64",
            "jaxforge_qr_solve_c64": "JaxforgeQrSolveC64",
            "jaxforge_qr_solve_c128": "JaxforgeQrSolveC128",
            "jaxforge_qr_solve_warp_f32": "JaxforgeQrSolveWarpF32",
            "jaxforge_qr_solve_warp_f64": "JaxforgeQrSolveWarpF64",
        },
    )
)


def qr_r_cuda(x):
    *batch, m, cols = x.shape
    if not (config.use_qr_r_block(m, cols, x.dtype) and build.ensure_loaded(KERNEL)):
        return qr_r_lapack(x)
    return qr_r_kernel(x)


def qr_r_kernel(x):
    """R of ``x`` by the block kernel (loaded, ``x`` within its limits), whatever the dispatch says:
    for the benchmark and the profiler."""
    *batch, _, cols = x.shape
    return _core.kernel_call(QR_R_TARGETS[x.dtype.name], (jax.ShapeDtypeStruct((*batch, cols, cols), x.dtype),), x)[0]


def qr_solve_cuda(a, b, rcond: float, targets=QR_SOLVE_TARGETS):
    """The kernel's ``(R, x, certified, factor)`` (see ``lstsq_xla``'s ``fused``): R of ``[A | b]``
    when tall, whose ``(R, Qᴴb)`` then serve as ``factor``; R of ``Aᴴ`` when wide. ``targets``:
    the block kernel's, or the one-warp kernel's (QR_SOLVE_WARP_TARGETS, tall real problems)."""
    *batch, m, n = a.shape
    k = b.shape[-1]
    cols = n + k if m >= n else m
    result_types = (
        jax.ShapeDtypeStruct((*batch, cols, cols), a.dtype),
        jax.ShapeDtypeStruct((*batch, n, k), a.dtype),
        jax.ShapeDtypeStruct(tuple(batch), jnp.int32),
    )
    r, x, certified = _core.kernel_call(targets[a.dtype.name], result_types, a, b, rcond=np.float64(rcond))
    if m < n:
        return r, x, certified != 0, None
    r_a, qhb = r[..., :n, :n], r[..., :n, n:]
    return r_a, x, certified != 0, lambda a, b: (r_a, qhb)


def thin_qr(x):
    """The thin ``(Q, R)`` of a tall ``x`` on CUDA: CholeskyQR2 where lstsq's dispatch takes that
    shape, else jax's Householder QR (cuSOLVER's geqrf and orgqr): svd's QR before a large method."""
    *batch, m, n = x.shape
    householder = lambda x: jax.lax.linalg.qr(x, full_matrices=False)  # noqa: E731
    if config.use_cholesky_qr2(math.prod(batch), m, n, x.dtype):
        return cholesky_qr2_thin(householder)(x)
    return householder(x)


def lstsq_cuda(a, b, *, rcond: float):
    *batch, m, n = a.shape
    if config.use_qr_solve_warp(m, n, b.shape[-1], a.dtype) and build.ensure_loaded(KERNEL):
        fused = functools.partial(qr_solve_cuda, targets=QR_SOLVE_WARP_TARGETS)
        return lstsq_xla(a, b, rcond=rcond, fused=fused, fused_rung=-1)
    if config.use_qr_solve(m, n, b.shape[-1], a.dtype) and build.ensure_loaded(KERNEL):
        return lstsq_xla(a, b, rcond=rcond, fused=qr_solve_cuda)
    householder = augmented_qr(qr_r_cuda)
    factor = cholesky_qr2(householder) if config.use_cholesky_qr2(math.prod(batch), m, n, a.dtype) else householder
    return lstsq_xla(a, b, rcond=rcond, factor=factor)
