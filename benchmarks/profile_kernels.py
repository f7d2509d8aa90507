"""Launches each linalg CUDA kernel of jaxforge once at its ANCHORS shape (float32) for a profiler
to read: `benchmarks/gpu_check.sh profile` runs it under Nsight Compute (the kernels are built
ahead, so the launch is the kernel's steady state; XLA's compilation happens on the host).

    python3 benchmarks/profile_kernels.py [NAME...]
    # NAME: qr_r qr_solve qr_solve_warp svd_rows svd_lanes svd_pairs svd_block svd_slots
    #       svd_pairs_values svd_slots_values svd_block_f64 svd_block_c64
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from jaxforge.lowering import build
from jaxforge.lowering.linalg.lstsq import cuda as lstsq_cuda
from jaxforge.lowering.linalg.svd import cuda as svd_cuda


def _normal(shape):
    return jax.device_put(np.random.default_rng(0).standard_normal(shape).astype(np.float32))


def _cases():
    a, b = _normal((8192, 64, 16)), _normal((8192, 64, 1))
    augmented = _normal((8192, 64, 17))
    svd = lambda target: lambda x: svd_cuda.jacobi_svd(x, target)  # noqa: E731
    values = lambda target: lambda x: svd_cuda.jacobi_values(x, svd_cuda.VALUES_TARGETS[target])  # noqa: E731
    typed = lambda dtype: jax.device_put(np.asarray(_normal((1024, 64, 64)), dtype))  # noqa: E731
    return {
        "qr_r": (lstsq_cuda.qr_r_kernel, (augmented,)),
        "qr_solve": (lambda a, b: lstsq_cuda.qr_solve_cuda(a, b, 1e-5)[:3], (a, b)),
        "qr_solve_warp": (
            lambda a, b: lstsq_cuda.qr_solve_cuda(a, b, 1e-5, lstsq_cuda.QR_SOLVE_WARP_TARGETS)[:3],
            (a, b),
        ),
        "svd_rows": (svd(svd_cuda.WARP_TARGETS["float32"]), (_normal((8192, 32, 32)),)),
        "svd_lanes": (svd(svd_cuda.LANES_TARGET), (_normal((8192, 32, 32)),)),
        "svd_pairs": (svd(svd_cuda.PAIRS_TARGET), (_normal((8192, 32, 32)),)),
        "svd_block": (svd(svd_cuda.BLOCK_TARGETS["float32"]), (_normal((1024, 64, 64)),)),
        "svd_slots": (svd(svd_cuda.SLOTS_TARGET), (_normal((1024, 64, 64)),)),
        "svd_pairs_values": (values(svd_cuda.PAIRS_TARGET), (_normal((8192, 32, 32)),)),
        "svd_slots_values": (values(svd_cuda.SLOTS_TARGET), (_normal((1024, 64, 64)),)),
        "svd_block_f64": (svd(svd_cuda.BLOCK_TARGETS["float64"]), (typed(np.float64),)),
        "svd_block_c64": (svd(svd_cuda.BLOCK_TARGETS["complex64"]), (typed(np.complex64),)),
    }


def main(names: list[str]) -> int:
    jax.config.update("jax_enable_x64", True)  # the float64 block kernel's input; the others are float32
    if not (build.ensure_loaded(lstsq_cuda.KERNEL) and build.ensure_loaded(svd_cuda.KERNEL)):
        print("the kernels could not be built or loaded here (no CUDA GPU, or no nvcc)", file=sys.stderr)
        return 1
    cases = _cases()
    unknown = sorted(set(names) - set(cases))
    if unknown:
        print(f"unknown kernel name(s) {unknown}; known: {sorted(cases)}", file=sys.stderr)
        return 2
    for name in names or cases:
        fn, args = cases[name]
        jax.block_until_ready(jax.jit(fn)(*args))
        print(f"{name}: ran", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
