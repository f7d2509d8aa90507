"""Dispatch of svd_p on CUDA: which kernel serves which shape.

The one-warp Jacobi kernel holds a matrix's rows in the 32 lanes of a warp, so both dims are at most
32. Larger shapes use the default lowering (cuSOLVER through jax.lax.linalg) until the blocked and
QR-preconditioned kernels land; the thresholds are to be measured on the H200, not guessed.
"""

import os

JACOBI_WARP_MAX_DIM = 32
# False until the kernel has passed the `gpu` tests on a GPU (benchmarks/gpu_check.sh); until then it
# runs only where JAXFORGE_UNVALIDATED_KERNELS=1 (the gpu tests and the GPU check set it).
JACOBI_WARP_VALIDATED = False


def use_jacobi_warp(m: int, n: int, dtype, full_matrices: bool) -> bool:
    enabled = JACOBI_WARP_VALIDATED or os.environ.get("JAXFORGE_UNVALIDATED_KERNELS") == "1"
    fits = 0 < m <= JACOBI_WARP_MAX_DIM and 0 < n <= JACOBI_WARP_MAX_DIM
    thin = m == n or not full_matrices  # the kernel computes thin factors only
    return enabled and fits and thin and dtype.name in ("float32", "float64")
