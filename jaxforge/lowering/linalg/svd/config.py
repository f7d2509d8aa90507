"""Dispatch of svd_p on CUDA: which kernel serves which shape.

The one-warp Jacobi kernel holds a matrix's rows in the 32 lanes of a warp, so both dims are at most
32. The one-block kernel keeps a matrix (any of the four types) and its rotations, in double
width, in a block's shared memory: max(m, n) <= 256, min(m, n) <= 128 and what the device lets a block opt in to. Larger
shapes go to the method LARGE_SVD names for them, or else to the default lowering (cuSOLVER through
jax.lax.linalg). The thresholds are measured on the H200, not guessed.
"""

import numpy as np

from jaxforge.lowering import build

JACOBI_WARP_MAX_DIM = 32
# The kernels pass their gpu tests on the H200 (2026-11-30, benchmarks/gpu_check.sh).
JACOBI_WARP_VALIDATED = True
# float32: which sweeps the one-warp kernel runs, a row of W per lane (jacobi_sweeps, three 5-level
# butterflies a rotation) or a column per lane (jacobi_sweeps_lanes, 16 rotations a step). On the
# H200 at 8192 x 32 x 32 the columns take 5.27 ms against the rows' 8.11, at the same accuracy
# (bench rows jaxforge-lanes, jaxforge-rows; 2026-11-30).
JACOBI_LANES = True
# float32: two lanes a column pair (jacobi_sweeps_pairs: rows split in halves, one column of a pair
# moving between rounds, 128 registers against the lanes' 225, so an SM holds 16 warps instead of
# 8) in place of either. On the H200 (2026-12-04) they pass their gpu tests and take 1.84 ms at
# 8192 x 32 x 32 against the lanes' 3.49 (orthogonality 3.6e-5 against 2.9e-5; bench rows
# jaxforge-pairs, jaxforge-lanes). Past 16 columns they play 31 rounds a sweep, where the circle
# method of the lanes plays C - 1 (C rounded up to even).
JACOBI_PAIRS_VALIDATED = True
JACOBI_BLOCK_MAX_ROWS, JACOBI_BLOCK_MAX_COLS = 256, 128
JACOBI_BLOCK_VALIDATED = True
# float64 in the block kernel's shared-memory sweeps (the slot sweeps' registers hold float32 only):
# float32's kernel with W in float64, past the one-warp kernel where the default lowering loops
# cuSOLVER over the batch. Off until its gpu tests pass and the bench (op "svd_f64", row
# jaxforge-block) finds it faster than that loop.
JACOBI_BLOCK_F64_VALIDATED = False
# complex64 and complex128 in the same sweeps, each pair rotated by the one-warp kernel's unitary
# rotation, V in complex128. Off until their gpu tests pass and the bench (op "svd_c64", row
# jaxforge-block) finds it faster than cuSOLVER's loop.
JACOBI_BLOCK_COMPLEX_VALIDATED = False
# float32 with 32 < max(m, n) <= 128: the block kernel with its column pairs in registers
# (jacobi_sweeps_slots: 4 or 8 threads a pair, 32 to 512 a block; V in float64 registers up to 64
# columns, past them in shared memory), in place of the shared-memory sweeps. On the H200
# (2026-12-04) it passes its gpu tests and takes 5.69 ms at 1024 x 64 x 64 and 11.3 at
# 256 x 128 x 128 against the shared-memory sweeps' 9.73 and 26.9, at their accuracy (bench rows
# jaxforge-slots, jaxforge-block); ptxas gives it 208 registers (two 64 x 64 matrices an SM,
# 8 warps) and, with V in shared memory, 128 (one 128 x 128, 16 warps).
JACOBI_SLOTS_VALIDATED = True
JACOBI_SLOTS_MAX_ROWS, JACOBI_SLOTS_MAX_COLS = 128, 128
JACOBI_SLOTS_MAX_COLS_IN_REGISTERS = 64  # past it V stays in shared memory
# compute_uv=False (asked for, or jit finding u and vh unused): each kernel's twin for the values
# alone (V neither held nor rotated, no vectors written; s and info bit-identical to the kernel's,
# tested under tests/cuda_emulation). ptxas (sm_90a) gives the twins 96 registers for the column
# pairs against 128 with V, 108 for the register slots against 209 (64 columns) and 128 (past
# them, V in shared memory), whose V also leaves shared memory (a block of 64 x 64: 17 KiB against
# 49; of 128 x 128: 68 against 197). Off until the H200 measures them: bench op "svdvals", rows
# jaxforge-<kernel>-values against jaxforge-<kernel>.
JACOBI_VALUES_VALIDATED = False
# Tall matrices past the kernels (max(m, n) > 256, or past the block's shared memory) whose R of
# A = QR (lstsq/cuda.thin_qr; of A^H when wide) fits one: that kernel after the QR, u = Q u_R, where
# the default lowering loops cuSOLVER over the batch. Off until its gpu tests pass and the bench
# (op "svd", shape tall_batch, row jaxforge-qr-jacobi) finds it faster.
JACOBI_QR_FIRST_VALIDATED = False
# Shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin): sm_90 has 227 KiB,
# sm_80 163 KiB, sm_86/sm_89 99 KiB.
MAX_SHARED_BYTES = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90a": 232448}


def _thin(m: int, n: int, full_matrices: bool) -> bool:
    return m == n or not full_matrices  # the kernels compute thin factors only


def use_jacobi_warp(m: int, n: int, dtype, full_matrices: bool) -> bool:
    fits = 0 < m <= JACOBI_WARP_MAX_DIM and 0 < n <= JACOBI_WARP_MAX_DIM
    types = ("float32", "float64", "complex64", "complex128")
    return build.enabled(JACOBI_WARP_VALIDATED) and fits and _thin(m, n, full_matrices) and dtype.name in types


def jacobi_warp_sweeps(dtype) -> str:
    """The sweeps the one-warp kernel runs on ``dtype``: ``"pairs"``, ``"lanes"`` (float32) or
    ``"rows"`` (every type)."""
    if dtype.name != "float32":
        return "rows"
    if build.enabled(JACOBI_PAIRS_VALIDATED):
        return "pairs"
    return "lanes" if JACOBI_LANES else "rows"


def jacobi_block_bytes(rows: int, cols: int, dtype=np.dtype(np.float32)) -> int:
    """The block kernel's shared memory for an R x C work matrix of ``dtype`` (``block_layout<T>`` in
    csrc/svd_jacobi_block.cuh): V in double width, W, real norms, 16 real reduction slots, perm."""
    complex_ = dtype.kind == "c"
    real = dtype.itemsize // 2 if complex_ else dtype.itemsize
    v = (cols | 1) * cols * (16 if complex_ else 8)
    w = (rows | 1) * cols * dtype.itemsize
    return (v + w + cols * real + 16 * real + cols * 4 + 15) // 16 * 16


def jacobi_slots_bytes(rows: int, cols: int) -> int:
    """The slot sweeps' shared memory (``slots_bytes<float>``): the block layout, or where they end
    past it, two exchange buffers of 16 float32 values of W, 16 float64 values of V (unless V stays
    in shared memory, ahead of them) and an index per thread."""
    lanes, players = 2, 2
    while lanes * 16 < rows:
        lanes *= 2
    while players < cols:
        players *= 2
    threads = max(players // 2, 32 // lanes) * lanes
    shared_v = cols > JACOBI_SLOTS_MAX_COLS_IN_REGISTERS
    start = (cols | 1) * cols * 8 if shared_v else 0
    end = start + 2 * threads * (16 * (4 + (0 if shared_v else 8)) + 4)
    return max(jacobi_block_bytes(rows, cols), (end + 15) // 16 * 16)


def use_jacobi_slots(m: int, n: int, dtype, full_matrices: bool, arch: str | None) -> bool:
    """For float32 matrices past the warp kernel with max(m, n) <= 128, on GPU ``arch``."""
    rows, cols = max(m, n), min(m, n)
    fits = 0 < cols <= JACOBI_SLOTS_MAX_COLS and JACOBI_WARP_MAX_DIM < rows <= JACOBI_SLOTS_MAX_ROWS
    fits = fits and jacobi_slots_bytes(rows, cols) <= MAX_SHARED_BYTES.get(arch, 0)
    return build.enabled(JACOBI_SLOTS_VALIDATED) and fits and _thin(m, n, full_matrices) and dtype.name == "float32"


def use_jacobi_qr_first(m: int, n: int, full_matrices: bool) -> bool:
    """Whether an m x n SVD that no kernel serves may take the kernel of R, ``A = QR`` (of ``Aᴴ``
    when wide), if one serves R (cuda.r_target)."""
    return build.enabled(JACOBI_QR_FIRST_VALIDATED) and _thin(m, n, full_matrices)


def use_jacobi_values() -> bool:
    """Whether an SVD without vectors runs the kernels' twins for the values alone (else the
    kernel, its vectors dropped)."""
    return build.enabled(JACOBI_VALUES_VALIDATED)


def use_jacobi_block(m: int, n: int, dtype, full_matrices: bool, arch: str | None) -> bool:
    """For matrices past the warp kernel that fit the block kernel on GPU ``arch`` (float32; the other
    types once validated)."""
    validated = {
        "float32": JACOBI_BLOCK_VALIDATED,
        "float64": JACOBI_BLOCK_F64_VALIDATED,
        "complex64": JACOBI_BLOCK_COMPLEX_VALIDATED,
        "complex128": JACOBI_BLOCK_COMPLEX_VALIDATED,
    }
    if dtype.name not in validated or not build.enabled(validated[dtype.name]):
        return False
    return jacobi_block_fits(max(m, n), min(m, n), dtype, arch) and _thin(m, n, full_matrices)


def jacobi_block_fits(rows: int, cols: int, dtype, arch: str | None) -> bool:
    """Whether an R x C work matrix of ``dtype`` past the warp kernel fits the block kernel on GPU ``arch``."""
    fits = 0 < cols <= JACOBI_BLOCK_MAX_COLS and JACOBI_WARP_MAX_DIM < rows <= JACOBI_BLOCK_MAX_ROWS
    return fits and jacobi_block_bytes(rows, cols, np.dtype(dtype)) <= MAX_SHARED_BYTES.get(arch, 0)


# Past the kernels: cuSOLVER by jax's ``algorithm=`` (gesvd, gesvdj, gesvdp) or QDWH (polar.py),
# each either on A or, for a tall A = QR, on R. `python -m jaxforge.bench linalg` times every pair
# on the large shapes (rows "svd-<method>" and "svd-qr-<method>"). LARGE_SVD holds the winners as
# rules (min(m, n) at least, max/min at least, method, qr_first); the first that matches wins and
# none leaves jax's default (gesvdj up to 1024, gesvd beyond). On the H200 (2026-12-04) QDWH takes
# 8192 x 512 in 14.4 ms after CholeskyQR2's QR (lstsq/cuda.thin_qr; 18.4 after cuSOLVER's on
# 11-30; the default: 43.7) and 2048 x 2048 in 72.9 ms (default: 292). cuSOLVER's gesvdp is faster
# at 2048 x 2048 (65.1 ms) but fails the gpu test's singular-value bar in float32 and float64
# (test_large_svd_methods_on_the_gpu_match_numpy: ill-conditioned, rank-deficient and tall
# inputs), which QDWH passes; the aspects between 1 and 16 are not measured.
LARGE_SVD_METHODS = ("gesvd", "gesvdj", "gesvdp", "qdwh")
LARGE_SVD: tuple[tuple[int, float, str, bool], ...] = ((512, 4.0, "qdwh", True), (512, 1.0, "qdwh", False))


def large_svd_method(m: int, n: int, full_matrices: bool) -> tuple[str, bool] | None:
    """``(method, qr_first)`` for an m x n SVD past the kernels, or None for the default lowering."""
    k, aspect = min(m, n), max(m, n) / max(min(m, n), 1)
    if k == 0 or not _thin(m, n, full_matrices):  # the methods give thin factors only
        return None
    matches = ((method, qr) for min_k, min_aspect, method, qr in LARGE_SVD if k >= min_k and aspect >= min_aspect)
    return next(matches, None)
