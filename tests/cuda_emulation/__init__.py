"""Builds C++ against the host emulation of CUDA here (``cuda_runtime.h``): kernel headers, and the
kernels' FFI handlers (``.cu`` files, read as C++), run on a CPU."""

from __future__ import annotations

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
        [COMPILER, "-std=c++20", optimize, "-U_FORTIFY_SOURCE", "-pthread", "-ffp-contract=off", "-DJAXFORGE_HOST_EMULATION",
         f"-I{HARNESS}", f"-I{build.PACKAGE_LOWERING}", *flags, *files, "-o", str(output)],
        check=True,
    )  # fmt: skip
    return output
