"""Dispatch of lstsq_p on CUDA: where the block Householder kernel factors ``[A | b]``.

The kernel keeps one matrix in a thread block's shared memory: at most 64 columns and 40 KiB, tall
or square (m >= columns). Other shapes use cuSOLVER through the default lowering; the limits are to
be tuned on the H200.
"""

from jaxforge.lowering import build

QR_R_MAX_COLS = 64
QR_R_MAX_BYTES = 40 * 1024
QR_R_VALIDATED = False  # not yet run on a GPU: see build.enabled


def use_qr_r_block(m: int, cols: int, dtype) -> bool:
    fits = 0 < cols <= min(m, QR_R_MAX_COLS) and m * cols * dtype.itemsize <= QR_R_MAX_BYTES
    return build.enabled(QR_R_VALIDATED) and fits and dtype.name in ("float32", "float64")
