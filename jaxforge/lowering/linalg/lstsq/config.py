"""Dispatch of lstsq_p on CUDA: which QR factors a tall problem.

The block Householder kernel keeps one ``[A | b]`` in a thread block's shared memory: at most 64
columns and 40 KiB, tall or square (m >= columns). Its fused form (qr_solve) also solves and
certifies the rank in the same block, for tall problems whose ``[A | b]`` fits and wide ones whose
``Aᴴ`` does (it applies Q from its reflectors, never forming it). CholeskyQR2 takes tall float32 and
complex64 problems that one of CHOLESKY_QR_RULES admits (its products run in double width), where
matrix products beat geqrf's panel steps: large single matrices, and batches, which cuSOLVER
factors one matrix at a time. Other shapes use cuSOLVER through the default lowering. Every limit
comes from the benchmark's lstsq-* rows on the H200.
"""

import jax

from jaxforge.lowering import build

QR_R_MAX_COLS = 64
QR_R_MAX_BYTES = 40 * 1024
# The block kernels pass their gpu tests on the H200 (2026-11-30), but at the one shape measured,
# 8192 x 64 x 16 with one right-hand side, they are slower than cuSOLVER: the fused solve takes
# 1.23 ms for the whole lstsq and the factor 1.22 ms with its triangular solve, against 0.48 ms for
# geqrf with the same solve (bench rows jaxforge, lstsq-qr_r, lstsq-householder). The dispatch
# leaves them out until a measured shape favours them; JAXFORGE_UNVALIDATED_KERNELS (the gpu tests,
# the bench) still runs them.
QR_R_VALIDATED = QR_SOLVE_VALIDATED = True
QR_KERNELS_FASTER = False


def qr_r_block_fits(m: int, cols: int, dtype) -> bool:
    """Whether an ``m x cols`` ``[A | b]`` of ``dtype`` fits the block kernel."""
    fits = 0 < cols <= min(m, QR_R_MAX_COLS) and m * cols * dtype.itemsize <= QR_R_MAX_BYTES
    return fits and dtype.name in ("float32", "float64", "complex64", "complex128")


def use_qr_r_block(m: int, cols: int, dtype) -> bool:
    return build.enabled(QR_R_VALIDATED and QR_KERNELS_FASTER) and qr_r_block_fits(m, cols, dtype)


# The one-warp kernel (csrc/qr_solve_warp.cuh): tall real problems with n + k <= 32 columns and
# m <= 128 rows (float32) or 64 (float64), the matrix in a warp's registers, no block barriers.
# Written for lstsq's 8192 x 64 x 16 anchor, where the block kernel lost to geqrf, and tested in the
# CUDA emulation only (2026-12-01, no GPU that session): off until its gpu tests pass on the H200
# and the bench's lstsq-qr_solve_warp row beats geqrf's.
QR_SOLVE_WARP_MAX_COLS = 32
QR_SOLVE_WARP_MAX_ROWS = {"float32": 128, "float64": 64}
QR_SOLVE_WARP_VALIDATED = False


def qr_solve_warp_fits(m: int, n: int, k: int, dtype) -> bool:
    """Whether an ``m x n`` problem with ``k`` right-hand sides fits the one-warp kernel."""
    rows = QR_SOLVE_WARP_MAX_ROWS.get(dtype.name, 0)
    return min(n, k) >= 1 and n + k <= QR_SOLVE_WARP_MAX_COLS and n + k <= m <= rows


def use_qr_solve_warp(m: int, n: int, k: int, dtype) -> bool:
    return build.enabled(QR_SOLVE_WARP_VALIDATED) and qr_solve_warp_fits(m, n, k, dtype)


QR_SOLVE_MAX_BYTES = 96 * 1024  # what every supported GPU grants a block (sm_86/sm_89: 99 KiB)


def _factored(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(rows, columns, p) of what the fused kernel factors: [A | b] when tall, Aᴴ when wide."""
    return (m, n + k, n) if m >= n else (n, m, m)


def qr_solve_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    """The fused kernel's shared memory (csrc/qr_solve.cuh: solve_layout), in bytes."""
    rows, cols, p = _factored(m, n, k)
    warps = min(max(-(-rows * cols // 256), 1), 8)
    align = lambda elements: (elements * itemsize + 15) & ~15  # noqa: E731
    factor = align((rows | 1) * cols + warps * cols + 4 * warps + 2 * cols) // itemsize
    return align(factor + p * (k + p) + (0 if m >= n else n * k))


def qr_solve_fits(m: int, n: int, k: int, dtype) -> bool:
    """Whether an ``m x n`` problem with ``k`` right-hand sides fits the fused kernel."""
    rows, cols, _ = _factored(m, n, k)
    fits = min(m, n, k) >= 1 and qr_r_block_fits(rows, cols, dtype)
    return fits and qr_solve_bytes(m, n, k, dtype.itemsize) <= QR_SOLVE_MAX_BYTES


def use_qr_solve(m: int, n: int, k: int, dtype) -> bool:
    return build.enabled(QR_SOLVE_VALIDATED and QR_KERNELS_FASTER) and qr_solve_fits(m, n, k, dtype)


# (min batch, min columns n, min aspect m / n): CholeskyQR2 where any rule holds. Measured on the
# H200 (2026-11-30) with its triangular solve, against geqrf's: 16384 x 1024, 6.07 ms against 20.7;
# a batch of 256 512 x 128, 3.27 against 39.6; 4096 x 4096, 18.2 against 23.9. Batches from 16 up
# are admitted on the argument that geqrf factors a batch one matrix at a time (only 256 measured).
CHOLESKY_QR_RULES = ((1, 256, 4), (16, 128, 4), (1, 4096, 1))
CHOLESKY_QR_VALIDATED = True  # passes the gpu tests on the H200 (2026-11-30)


def use_cholesky_qr2(batch: int, m: int, n: int, dtype) -> bool:
    """Whether a rule holds; a symbolic ``batch`` (``jax.export``) is taken at its least, 1."""
    batch = 1 if jax.export.is_symbolic_dim(batch) else batch
    large = any(batch >= b and n >= cols and m >= aspect * n for b, cols, aspect in CHOLESKY_QR_RULES)
    return build.enabled(CHOLESKY_QR_VALIDATED) and large and dtype.name in ("float32", "complex64")
