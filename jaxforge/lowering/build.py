"""Builds jaxforge's CUDA kernels with nvcc into a verified per-user cache, loads them, registers them.

A :class:`Kernel` is one shared library: ``.cu`` sources (the XLA FFI glue) with their ``.cuh``
headers under ``lowering/<family>/<op>/csrc/``, exporting handler symbols that are registered as
FFI targets with literal names (``jaxforge_svd_jacobi_f32``). The op's ``cuda.py`` declares it.

The cache (``$JAXFORGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxforge/kernels``, else
``~/.cache/jaxforge/kernels``) holds ``<name>-<arch>-<key>.so`` and its ``.sha256``; the key is the
sha256 of the sources, the nvcc flags and version, the jaxlib version and the GPU arch. Libraries are
written atomically, and their digest is checked just before loading. A cache directory owned by
another user, or writable by group or others, is refused, and so is a library whose digest does not
match: loading it would run its code. Without nvcc or a supported GPU, :func:`ensure_loaded` warns
once and returns False, and the default lowering runs.

    python -m jaxforge.build                    # build and load for this machine's GPU
    python -m jaxforge.build --compile-only --arch sm_80 --arch sm_90a --out DIR   # what CI runs:
                                                # DIR/<name>.so, one library per kernel for all archs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence

import jax
import jaxlib

__all__ = ["BuildError", "CacheError", "Kernel", "cache_dir", "compile_kernel", "enabled", "ensure_loaded", "main"]

PACKAGE_LOWERING = pathlib.Path(__file__).resolve().parent
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
NVCC_FLAGS = ("-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr")


class BuildError(RuntimeError):
    """nvcc failed; the message carries the end of its output."""


class CacheError(RuntimeError):
    """The kernel cache cannot be trusted: wrong owner, open permissions, or a tampered library."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One shared library of FFI handlers: ``targets`` maps FFI target names to exported symbols."""

    name: str
    sources: tuple[str, ...]  # .cu files, relative to jaxforge/lowering/ (or absolute)
    headers: tuple[str, ...]  # headers they include (csrc/xla_ffi.h among them), likewise
    targets: dict[str, str] = dataclasses.field(hash=False)

    def files(self) -> dict[str, pathlib.Path]:
        return {p: PACKAGE_LOWERING / p for p in (*self.sources, *self.headers)}


_KERNELS: dict[str, Kernel] = {}


def enabled(validated: bool) -> bool:
    """Whether a kernel may run: once validated on a GPU, or on request for the `gpu` tests.

    A kernel that has only been compiled (no GPU in that session) stays off unless
    ``JAXFORGE_UNVALIDATED_KERNELS=1``; its op's ``config.py`` flips ``validated`` after the tests pass.
    """
    return validated or os.environ.get("JAXFORGE_UNVALIDATED_KERNELS") == "1"


def declare(kernel: Kernel) -> Kernel:
    """Records ``kernel`` so that ``python -m jaxforge.build`` and CI compile it."""
    if _KERNELS.setdefault(kernel.name, kernel) is not kernel:
        raise ValueError(f"kernel {kernel.name!r} is declared twice")
    return kernel


def declared_kernels() -> dict[str, Kernel]:
    return dict(_KERNELS)


def cache_dir() -> pathlib.Path:
    """The per-user kernel cache, created private (0700) and checked before use."""
    if os.environ.get("JAXFORGE_CACHE_DIR"):
        path = pathlib.Path(os.environ["JAXFORGE_CACHE_DIR"])
    else:
        base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
        path = pathlib.Path(base) / "jaxforge" / "kernels"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(path)
    return path


def check_private(path: pathlib.Path) -> None:
    """Refuses a cache path that another user owns or that group/others may write."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise CacheError(
            f"kernel cache {path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
            "refusing to load code from it. Set JAXFORGE_CACHE_DIR to a directory of your own."
        )
    if st.st_mode & 0o022:
        raise CacheError(
            f"kernel cache {path} is writable by group or others (mode {oct(st.st_mode & 0o777)}); "
            f"refusing to load code from it. Fix it with: chmod go-w {path}"
        )


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = pathlib.Path(cuda_home) / "bin" / "nvcc"
    return str(candidate) if candidate.is_file() else None


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def cache_key(kernel: Kernel, arch: str, nvcc: str) -> str:
    digest = hashlib.sha256()
    for name, path in sorted(kernel.files().items()):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (*NVCC_FLAGS, arch, nvcc_version(nvcc), jaxlib.__version__):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def _gencode(arch: str) -> list[str]:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GPU arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    number = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{number},code=sm_{number}"]


def compile_kernel(kernel: Kernel, archs: Sequence[str], out: pathlib.Path, *, nvcc: str) -> None:
    """Compiles ``kernel`` for every GPU arch of ``archs`` into the one shared library ``out`` (not
    atomic; see verified_library). One nvcc call compiles the host code once for all of them."""
    command = [
        nvcc, *NVCC_FLAGS, *(flag for arch in archs for flag in _gencode(arch)), f"-I{jax.ffi.include_dir()}",
        f"-I{PACKAGE_LOWERING}", *(str(PACKAGE_LOWERING / s) for s in kernel.sources), "-o", str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"nvcc failed for kernel {kernel.name!r} ({', '.join(archs)}):\n{result.stderr[-4000:]}")


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verified_library(kernel: Kernel, arch: str, *, nvcc: str) -> pathlib.Path:
    """The cached library for ``(kernel, arch)``, built first if absent; its digest is checked."""
    directory = cache_dir()
    library = directory / f"{kernel.name}-{arch}-{cache_key(kernel, arch, nvcc)[:24]}.so"
    manifest = library.with_name(library.name + ".sha256")
    if not (library.exists() and manifest.exists()):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{kernel.name}-", suffix=".so")
        os.close(fd)
        tmp = pathlib.Path(tmp)
        try:
            compile_kernel(kernel, [arch], tmp, nvcc=nvcc)
            tmp.chmod(0o600)
            manifest_tmp = tmp.with_name(tmp.name + ".sha256")
            manifest_tmp.write_text(_sha256(tmp) + "\n")
            os.replace(tmp, library)  # the library first: a manifest never names a missing file
            os.replace(manifest_tmp, manifest)
        finally:
            for leftover in (tmp, tmp.with_name(tmp.name + ".sha256")):
                leftover.unlink(missing_ok=True)
    for path in (library, manifest):
        check_private(path)
    if _sha256(library) != manifest.read_text().strip():
        raise CacheError(
            f"kernel library {library} does not match its recorded sha256; refusing to load it. "
            f"Delete {library} and its .sha256 to rebuild."
        )
    return library


def load(kernel: Kernel, library: pathlib.Path) -> None:
    handle = ctypes.CDLL(str(library))
    for target, symbol in kernel.targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="CUDA")
        jax.ffi.register_ffi_target_as_batch_partitionable(target)  # see _core.kernel_call


def _first_gpu():
    """The first CUDA device, or None without one."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    return devices[0] if devices else None


def gpu_arch() -> str | None:
    """``sm_XY`` of the first CUDA device, or None without one."""
    capability = getattr(_first_gpu(), "compute_capability", None)
    if not capability:
        return None
    major, minor = capability.split(".")
    return "sm_90a" if (major, minor) == ("9", "0") else f"sm_{major}{minor}"


def gpu_sm_count() -> int | None:
    """The streaming multiprocessors of the first CUDA device, or None without one."""
    return getattr(_first_gpu(), "core_count", None)


_LOADED: dict[str, bool] = {}


def ensure_loaded(kernel: Kernel) -> bool:
    """Builds (once per machine) and registers ``kernel``; False, with one warning, if it cannot."""
    if kernel.name not in _LOADED:
        _LOADED[kernel.name] = _build_and_load(kernel)
    return _LOADED[kernel.name]


def _build_and_load(kernel: Kernel) -> bool:
    arch = gpu_arch()
    nvcc = nvcc_path()
    reason = None
    if arch is None:
        reason = "no CUDA GPU is visible"
    elif arch not in SUPPORTED_ARCHS:
        reason = f"GPU arch {arch} is not one of {', '.join(SUPPORTED_ARCHS)}"
    elif nvcc is None:
        reason = "nvcc was not found (PATH, CUDA_HOME)"
    if reason is not None:
        if arch is not None:  # on a CPU-only machine the default lowering is simply the lowering
            warnings.warn(f"jaxforge: kernel {kernel.name!r} not built: {reason}; using the default lowering")
        return False
    load(kernel, verified_library(kernel, arch, nvcc=nvcc))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxforge.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help="sm_80, sm_86, sm_89 or sm_90a (repeatable)")
    parser.add_argument("--compile-only", action="store_true", help="compile into --out; load nothing")
    parser.add_argument("--out", type=pathlib.Path, help="with --compile-only: where the libraries go")
    args = parser.parse_args(argv)

    import jaxforge  # noqa: F401  (declares every kernel)

    nvcc = nvcc_path()
    if nvcc is None:
        print("nvcc not found (PATH, CUDA_HOME)", file=sys.stderr)
        return 1
    if args.compile_only:
        out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="jaxforge-build-"))
        out.mkdir(parents=True, exist_ok=True)
        archs = args.arch or SUPPORTED_ARCHS
        for kernel, _ in _each_kernel(lambda kernel: compile_kernel(kernel, archs, out / f"{kernel.name}.so", nvcc=nvcc)):
            print(f"compiled {kernel.name} for {', '.join(archs)}")
        return 0
    arch = (args.arch or [gpu_arch()])[0]
    if arch is None:
        print("no CUDA GPU is visible; use --compile-only --arch ... to compile without one", file=sys.stderr)
        return 1
    for kernel, library in _each_kernel(lambda kernel: verified_library(kernel, arch, nvcc=nvcc)):
        load(kernel, library)
        print(f"{kernel.name} ({arch}): {library}")
    return 0


def _each_kernel(build):
    """(kernel, build(kernel)) for every declared kernel, the nvcc calls run side by side (each is
    one single-threaded process, and each kernel is a library of its own)."""
    kernels = list(_KERNELS.values())
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(kernels))) as pool:
        return list(zip(kernels, pool.map(build, kernels)))
