"""Dispatch of lstsq_p on CUDA: which QR factors a tall problem.

The block Householder kernel keeps one ``[A | b]`` in a thread block's shared memory: at most 64
columns and 40 KiB, tall or square (m >= columns). Where it fits, its fused form (qr_solve) also
back-substitutes and certifies the rank in the same block. CholeskyQR2 takes tall float32 and
complex64 problems that one of CHOLESKY_QR_RULES admits (its products run in double width), where
matrix products beat geqrf's panel steps: large single matrices, and batches, which cuSOLVER
factors one matrix at a time. Other shapes use cuSOLVER through the default lowering; the limits
are to be set from the benchmark's lstsq-cholesky_qr2 and lstsq-householder rows on the H200.
"""

from jaxforge.lowering import build

QR_R_MAX_COLS = 64
QR_R_MAX_BYTES = 40 * 1024
QR_R_VALIDATED = False  # not yet run on a GPU: see build.enabled


def qr_r_block_fits(m: int, cols: int, dtype) -> bool:
    """Whether an ``m x cols`` ``[A | b]`` of ``dtype`` fits the block kernel."""
    fits = 0 < cols <= min(m, QR_R_MAX_COLS) and m * cols * dtype.itemsize <= QR_R_MAX_BYTES
    return fits and dtype.name in ("float32", "float64")


def use_qr_r_block(m: int, cols: int, dtype) -> bool:
    return build.enabled(QR_R_VALIDATED) and qr_r_block_fits(m, cols, dtype)


QR_SOLVE_VALIDATED = False  # not yet run on a GPU: see build.enabled


def use_qr_solve(m: int, n: int, k: int, dtype) -> bool:
    """Whether the fused kernel solves an ``m x n`` problem with ``k`` right-hand sides."""
    return build.enabled(QR_SOLVE_VALIDATED) and n >= 1 and qr_r_block_fits(m, n + k, dtype)


# (min batch, min columns n, min aspect m / n): CholeskyQR2 where any rule holds.
CHOLESKY_QR_RULES = ((1, 256, 4),)
CHOLESKY_QR_VALIDATED = False  # not yet timed on a GPU: see build.enabled


def use_cholesky_qr2(batch: int, m: int, n: int, dtype) -> bool:
    large = any(batch >= b and n >= cols and m >= aspect * n for b, cols, aspect in CHOLESKY_QR_RULES)
    return build.enabled(CHOLESKY_QR_VALIDATED) and large and dtype.name in ("float32", "complex64")
