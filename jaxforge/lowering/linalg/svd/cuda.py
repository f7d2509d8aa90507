"""CUDA lowering of svd_p: the batched Jacobi kernels (csrc/svd_jacobi*.{cuh,cu}) where they fit,
the measured best of cuSOLVER's methods and QDWH (polar.py) for large shapes (config.LARGE_SVD).

A batch of tall matrices past the kernels whose R of ``A = QR`` fits one (of ``Aᴴ`` when wide)
takes that kernel after the QR (config.use_jacobi_qr_first). Other shapes and machines where the
kernel cannot be built take the default lowering. Matrices that
hold NaN/Inf or do not converge come back as NaN. Without ``compute_uv`` (asked for, or set by svd_p's
dead-code rule) each kernel's twin for the values alone runs (VALUES_TARGETS,
config.use_jacobi_values): no rotations accumulated, no vectors written, the same singular values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxforge.lowering import build
from jaxforge.lowering.linalg._nonfinite import nonfinite_matrices, poison
from jaxforge.lowering.linalg.lstsq.cuda import thin_qr
from jaxforge.lowering.linalg.svd import config
from jaxforge.lowering.linalg.svd.polar import svd_polar
from jaxforge.lowering.linalg.svd.xla import svd_xla
from jaxforge.primitives import _core
from jaxforge.primitives.linalg._ops import ct, mm

WARP_TARGETS = {
    "float32": "jaxforge_svd_jacobi_f32",
    "float64": "jaxforge_svd_jacobi_f64",
    "complex64": "jaxforge_svd_jacobi_c64",
    "complex128": "jaxforge_svd_jacobi_c128",
}
# float32's other one-warp sweeps (config.jacobi_warp_sweeps): a column a lane, two lanes a column pair
LANES_TARGET = "jaxforge_svd_jacobi_lanes_f32"
PAIRS_TARGET = "jaxforge_svd_jacobi_pairs_f32"
SWEEP_TARGETS = {"lanes": LANES_TARGET, "pairs": PAIRS_TARGET}
BLOCK_TARGETS = {  # config.use_jacobi_block
    "float32": "jaxforge_svd_jacobi_block_f32",
    "float64": "jaxforge_svd_jacobi_block_f64",
    "complex64": "jaxforge_svd_jacobi_block_c64",
    "complex128": "jaxforge_svd_jacobi_block_c128",
}
SLOTS_TARGET = "jaxforge_svd_jacobi_slots_f32"  # the same with its column pairs in registers (config.use_jacobi_slots)
# Each kernel's twin for the values alone: results s and info.
VALUES_TARGETS = {
    WARP_TARGETS["float32"]: "jaxforge_svd_jacobi_values_f32",
    WARP_TARGETS["float64"]: "jaxforge_svd_jacobi_values_f64",
    WARP_TARGETS["complex64"]: "jaxforge_svd_jacobi_values_c64",
    WARP_TARGETS["complex128"]: "jaxforge_svd_jacobi_values_c128",
    LANES_TARGET: "jaxforge_svd_jacobi_lanes_values_f32",
    PAIRS_TARGET: "jaxforge_svd_jacobi_pairs_values_f32",
    BLOCK_TARGETS["float32"]: "jaxforge_svd_jacobi_block_values_f32",
    BLOCK_TARGETS["float64"]: "jaxforge_svd_jacobi_block_values_f64",
    BLOCK_TARGETS["complex64"]: "jaxforge_svd_jacobi_block_values_c64",
    BLOCK_TARGETS["complex128"]: "jaxforge_svd_jacobi_block_values_c128",
    SLOTS_TARGET: "jaxforge_svd_jacobi_slots_values_f32",
}
KERNEL = build.declare(
    build.Kernel(
        name="svd_jacobi",
        sources=("linalg/svd/csrc/svd_jacobi_ffi.cu",),
        headers=(
            "linalg/svd/csrc/svd_jacobi.cuh",
            "linalg/svd/csrc/svd_jacobi_block.cuh",
            "csrc/xla_ffi.h",
            "csrc/launch.h",
            "csrc/scalar.h",
            "csrc/warp.h",
        ),
        targets={
            WARP_TARGETS["float32"]: "JaxforgeSvdJacobiF32",
            WARP_TARGETS["float64"]: "JaxforgeSvdJacobiF64",
            WARP_TARGETS["complex64"]: "JaxforgeSvdJacobiC64",
            WARP_TARGETS["complex128"]: "JaxforgeSvdJacobiC128",
            LANES_TARGET: "JaxforgeSvdJacobiLanesF32",
            PAIRS_TARGET: "JaxforgeSvdJacobiPairsF32",
            BLOCK_TARGETS["float32"]: "JaxforgeSvdJacobiBlockF32",
            BLOCK_TARGETS["float64"]: "JaxforgeSvdJacobiBlockF64",
            BLOCK_TARGETS["complex64"]: "JaxforgeSvdJacobiBlockC64",
            BLOCK_TARGETS["complex128"]: "JaxforgeSvdJacobiBlockC128",
            SLOTS_TARGET: "JaxforgeSvdJacobiSlotsF32",
            VALUES_TARGETS[WARP_TARGETS["float32"]]: "JaxforgeSvdJacobiF32Values",
            VALUES_TARGETS[WARP_TARGETS["float64"]]: "JaxforgeSvdJacobiF64Values",
            VALUES_TARGETS[WARP_TARGETS["complex64"]]: "JaxforgeSvdJacobiC64Values",
            VALUES_TARGETS[WARP_TARGETS["complex128"]]: "JaxforgeSvdJacobiC128Values",
            VALUES_TARGETS[LANES_TARGET]: "JaxforgeSvdJacobiLanesF32Values",
            VALUES_TARGETS[PAIRS_TARGET]: "JaxforgeSvdJacobiPairsF32Values",
            VALUES_TARGETS[BLOCK_TARGETS["float32"]]: "JaxforgeSvdJacobiBlockF32Values",
            VALUES_TARGETS[BLOCK_TARGETS["float64"]]: "JaxforgeSvdJacobiBlockF64Values",
            VALUES_TARGETS[BLOCK_TARGETS["complex64"]]: "JaxforgeSvdJacobiBlockC64Values",
            VALUES_TARGETS[BLOCK_TARGETS["complex128"]]: "JaxforgeSvdJacobiBlockC128Values",
            VALUES_TARGETS[SLOTS_TARGET]: "JaxforgeSvdJacobiSlotsF32Values",
        },
    )
)


def _target(a, full_matrices: bool) -> str | None:
    """The FFI target serving ``a``, or None where the default lowering does."""
    m, n = a.shape[-2:]
    if config.use_jacobi_warp(m, n, a.dtype, full_matrices):
        sweeps = config.jacobi_warp_sweeps(a.dtype)
        return SWEEP_TARGETS.get(sweeps, WARP_TARGETS[a.dtype.name])
    if config.use_jacobi_slots(m, n, a.dtype, full_matrices, build.gpu_arch()):
        return SLOTS_TARGET
    if config.use_jacobi_block(m, n, a.dtype, full_matrices, build.gpu_arch()):
        return BLOCK_TARGETS[a.dtype.name]
    return None


def r_target(a) -> str | None:
    """The FFI target serving R of ``A = QR`` (of ``Aᴴ`` when wide) where none serves ``a`` itself,
    or None."""
    k = min(a.shape[-2:])
    return None if _target(a, False) is not None else _target(jax.ShapeDtypeStruct((k, k), a.dtype), False)


def svd_cuda(a, *, full_matrices: bool, compute_uv: bool, grad_eps: float):
    target = _target(a, full_matrices)
    if target is not None and build.ensure_loaded(KERNEL):
        return jacobi(a, target, compute_uv=compute_uv)
    of_r = r_target(a) if target is None and config.use_jacobi_qr_first(*a.shape[-2:], full_matrices) else None
    if of_r is not None and build.ensure_loaded(KERNEL):
        return after_qr(a, functools.partial(jacobi, target=of_r), compute_uv=compute_uv)
    large = config.large_svd_method(*a.shape[-2:], full_matrices)
    if large is not None:
        return large_svd(a, *large, compute_uv=compute_uv)
    return svd_xla(a, full_matrices=full_matrices, compute_uv=compute_uv, grad_eps=grad_eps)


def jacobi(a, target: str, *, compute_uv: bool):
    """``(s, u, vh)`` or ``(s,)`` by the Jacobi kernel ``target`` (loaded), or by its twin for the
    values alone where config.use_jacobi_values."""
    if not compute_uv and config.use_jacobi_values():
        return (jacobi_values(a, VALUES_TARGETS[target]),)
    s, u, vh = jacobi_svd(a, target)
    return (s, u, vh) if compute_uv else (s,)


def jacobi_svd(a, target: str):
    """``(s, u, vh)`` of the thin SVD by the Jacobi kernel ``target`` (loaded; NaN where a matrix
    held NaN/Inf or did not converge). The benchmark calls it to time the kernels side by side."""
    *batch, m, n = a.shape
    k = min(m, n)
    result_types = (
        jax.ShapeDtypeStruct((*batch, k), jnp.finfo(a.dtype).dtype),  # real
        jax.ShapeDtypeStruct((*batch, m, k), a.dtype),
        jax.ShapeDtypeStruct((*batch, k, n), a.dtype),
        jax.ShapeDtypeStruct(tuple(batch), np.int32),  # sweeps used, -1 where the result is NaN
    )
    s, u, vh, _ = _core.kernel_call(target, result_types, a)
    return s, u, vh


def jacobi_values(a, target: str):
    """The singular values ``s`` alone by the values twin ``target`` (of VALUES_TARGETS; loaded): the
    bits ``jacobi_svd`` gives by the kernel it twins."""
    *batch, m, n = a.shape
    result_types = (
        jax.ShapeDtypeStruct((*batch, min(m, n)), jnp.finfo(a.dtype).dtype),
        jax.ShapeDtypeStruct(tuple(batch), np.int32),
    )
    return _core.kernel_call(target, result_types, a)[0]


CUSOLVER_ALGORITHMS = {
    "gesvd": jax.lax.linalg.SvdAlgorithm.QR,
    "gesvdj": jax.lax.linalg.SvdAlgorithm.JACOBI,
    "gesvdp": jax.lax.linalg.SvdAlgorithm.POLAR,
}


def after_qr(a, svd_of_r, *, compute_uv: bool):
    """The thin ``(s, u, vh)`` or ``(s,)`` of ``a`` from ``svd_of_r(R, compute_uv=...)`` of the
    triangular factor of ``A = QR`` (of ``Aᴴ`` when wide): ``u = Q u_R``, ``vh = vh_R``."""
    if a.shape[-2] < a.shape[-1]:
        out = after_qr(ct(a), svd_of_r, compute_uv=compute_uv)
        return out if not compute_uv else (out[0], ct(out[2]), ct(out[1]))
    if not compute_uv:
        return svd_of_r(thin_qr(a)[1], compute_uv=False)
    q, r = thin_qr(a)
    s, u, vh = svd_of_r(r, compute_uv=True)
    return s, mm(q, u), vh


def large_svd(a, method: str, qr_first: bool, *, compute_uv: bool = True):
    """The thin ``(s, u, vh)`` or ``(s,)`` by one of config.LARGE_SVD_METHODS; with ``qr_first``, of
    the triangular factor of ``A = QR`` (after_qr). The benchmark times every choice through here,
    so it measures what the dispatch runs."""
    if qr_first:
        return after_qr(a, functools.partial(large_svd, method=method, qr_first=False), compute_uv=compute_uv)
    if a.shape[-2] < a.shape[-1]:
        out = large_svd(ct(a), method, False, compute_uv=compute_uv)
        return out if not compute_uv else (out[0], ct(out[2]), ct(out[1]))
    if method == "qdwh":
        bad = nonfinite_matrices(a)  # zeroed first, so no NaN meets an eigensolver
        out = svd_polar(jnp.where(bad[..., None, None], 0, a), compute_uv=compute_uv)
        return tuple(poison(bad, x) for x in out)
    return svd_xla(a, full_matrices=False, compute_uv=compute_uv, grad_eps=0.0, algorithm=CUSOLVER_ALGORITHMS[method])
