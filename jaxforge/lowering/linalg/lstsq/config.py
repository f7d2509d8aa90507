"""Dispatch of lstsq_p on CUDA: where the block Householder kernel factors ``[A | b]``.

The kernel keeps one matrix in a thread block's shared memory: at most 64 columns and 40 KiB, tall
or square (m >= columns). Other shapes use cuSOLVER through the default lowering; the limits are to
be tuned on the H200.
"""

import os

QR_R_MAX_COLS = 64
QR_R_MAX_BYTES = 40 * 1024
# False until the kernel has passed the `gpu` tests on a GPU (benchmarks/gpu_check.sh); until then it
# runs only where JAXFORGE_UNVALIDATED_KERNELS=1 (the gpu tests and the GPU check set it).
QR_R_VALIDATED = False


def use_qr_r_block(m: int, cols: int, dtype) -> bool:
    enabled = QR_R_VALIDATED or os.environ.get("JAXFORGE_UNVALIDATED_KERNELS") == "1"
    fits = 0 < cols <= min(m, QR_R_MAX_COLS) and m * cols * dtype.itemsize <= QR_R_MAX_BYTES
    return enabled and fits and dtype.name in ("float32", "float64")
