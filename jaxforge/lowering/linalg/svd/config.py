"""Dispatch of svd_p on CUDA: which kernel serves which shape.

The one-warp Jacobi kernel holds a matrix's rows in the 32 lanes of a warp, so both dims are at most
32. Larger shapes use the default lowering (cuSOLVER through jax.lax.linalg) until the blocked and
QR-preconditioned kernels land; the thresholds are to be measured on the H200, not guessed.
"""

from jaxforge.lowering import build

JACOBI_WARP_MAX_DIM = 32
JACOBI_WARP_VALIDATED = False  # not yet run on a GPU: see build.enabled


def use_jacobi_warp(m: int, n: int, dtype, full_matrices: bool) -> bool:
    fits = 0 < m <= JACOBI_WARP_MAX_DIM and 0 < n <= JACOBI_WARP_MAX_DIM
    thin = m == n or not full_matrices  # the kernel computes thin factors only
    return build.enabled(JACOBI_WARP_VALIDATED) and fits and thin and dtype.name in ("float32", "float64")
