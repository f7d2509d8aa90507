"""Builds C++ against the host emulation of CUDA here (``cuda_runtime.h``): kernel headers, and the
kernels' FFI handlers (``.cu`` files, read as C++), run on a CPU."""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

from jaxforge.lowering import build

HARNESS = pathlib.Path(__file__).resolve().parent
COMPILER = shutil.which("g++")


def compile_emulated(sources, output: pathlib.Path, *flags: str, optimize: str = "-O2") -> pathlib.Path:
    """``sources`` (paths; ``.cu`` files compiled as C++) built by the host compiler against the
    emulation into ``output``, with the extra compiler ``flags`` (``-shared -fPIC`` for a library)."""
    files = []
    for source in map(pathlib.Path, sources):
        files += ["-x", "c++", str(source), "-x", "none"] if source.suffix == ".cu" else [str(source)]
    subprocess.run(
        [COMPILER, "-std=c++20", optimize, "-pthread", "-ffp-contract=off", "-DJAXFORGE_HOST_EMULATION",
         f"-I{HARNESS}", f"-I{build.PACKAGE_LOWERING}", *flags, *files, "-o", str(output)],
        check=True,
    )  # fmt: skip
    return output


def linalg_kernels() -> tuple:
    """svd's and lstsq's kernels (``build.Kernel``), whose handlers ``ffi_handlers.cc`` links."""
    from jaxforge.lowering.linalg.lstsq import cuda as lstsq_cuda
    from jaxforge.lowering.linalg.svd import cuda as svd_cuda

    return svd_cuda.KERNEL, lstsq_cuda.KERNEL


def build_handlers(output: pathlib.Path) -> pathlib.Path:
    """The linalg kernels' FFI handlers, emulated, as one shared library at ``output``."""
    import jax

    sources = [*(build.PACKAGE_LOWERING / kernel.sources[0] for kernel in linalg_kernels()), HARNESS / "ffi_handlers.cc"]
    return compile_emulated(sources, output, "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", optimize="-O1")


def register_handlers(library: pathlib.Path) -> None:
    """Every handler of ``library`` (``build_handlers``') registered as a CPU target under its
    kernel's name, batch-partitionable, as ``build.load`` registers it for CUDA. Once a process:
    XLA refuses a second registration of a name."""
    import jax

    handle = ctypes.CDLL(str(library))
    for kernel in linalg_kernels():
        for target, symbol in kernel.targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")
            jax.ffi.register_ffi_target_as_batch_partitionable(target)
