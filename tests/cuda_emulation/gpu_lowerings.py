"""A pytest plugin that runs svd's and lstsq's cuda lowerings on the CPU: every linalg kernel's FFI
handler, emulated (the library ``JAXFORGE_EMULATED_HANDLERS`` names, ``build_handlers``'), is
registered as a CPU target, and the cuda lowerings replace the CPU ones, dispatching as on an
sm_90a machine with every kernel enabled. For a subprocess (``python -m pytest -p
tests.cuda_emulation.gpu_lowerings ...``): it changes the process's lowerings for good."""

from __future__ import annotations

import os


def pytest_configure(config):
    use_cuda_lowerings(os.environ["JAXFORGE_EMULATED_HANDLERS"])


def use_cuda_lowerings(library) -> None:
    """Registers the emulated handlers of ``library`` and makes svd's and lstsq's cuda lowerings
    their CPU ones, for the rest of the process (``tools/fuzz_linalg.py --emulated-kernels`` too)."""
    from jaxforge.lowering import build
    from jaxforge.lowering.linalg.lstsq import cuda as lstsq_cuda
    from jaxforge.lowering.linalg.svd import cuda as svd_cuda
    from jaxforge.primitives import _core
    from jaxforge.primitives.linalg.lstsq import lstsq_p
    from jaxforge.primitives.linalg.svd import svd_p
    from tests.cuda_emulation import linalg_kernels, register_handlers

    register_handlers(library)
    for kernel in linalg_kernels():
        build._LOADED[kernel.name] = True
    build.gpu_arch = lambda: "sm_90a"
    os.environ["JAXFORGE_UNVALIDATED_KERNELS"] = "1"
    _core.register_lowering(svd_p, svd_cuda.svd_cuda, platform="cpu", partitionable=True)
    _core.register_lowering(lstsq_p, lstsq_cuda.lstsq_cuda, platform="cpu", partitionable=True)
