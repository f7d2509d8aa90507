"""The kernel build: nvcc into a private, verified cache; every declared kernel compiles for CI's archs."""

from __future__ import annotations

import os
import re
import pathlib

import pytest

from jaxforge.lowering import build

DATA = pathlib.Path(__file__).resolve().parent / "data"
NVCC = build.nvcc_path()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("JAXFORGE_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def scale_kernel():
    return build.Kernel("test_scale", (str(DATA / "scale_ffi.cu"),), (), {"jaxforge_test_scale": "JaxforgeTestScale"})


def test_cache_dir_is_created_private(cache):
    assert build.cache_dir() == cache
    assert cache.stat().st_mode & 0o777 == 0o700


def test_group_writable_cache_is_refused(cache):
    cache.mkdir(mode=0o700)
    cache.chmod(0o775)
    with pytest.raises(build.CacheError, match=r"writable by group or others \(mode 0o775\).*chmod go-w"):
        build.cache_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="changing a directory's owner needs root")
def test_cache_owned_by_another_user_is_refused(cache):
    cache.mkdir(mode=0o700)
    os.chown(cache, 65534, 65534)
    with pytest.raises(build.CacheError, match=r"owned by uid 65534, not by you"):
        build.cache_dir()


@needs_nvcc
def test_cache_key_follows_sources_arch_and_flags(tmp_path, monkeypatch):
    source = tmp_path / "k.cu"
    source.write_text((DATA / "scale_ffi.cu").read_text())
    kernel = build.Kernel("k", (str(source),), (), {})
    key = build.cache_key(kernel, "sm_80", NVCC)
    assert build.cache_key(kernel, "sm_80", NVCC) == key
    assert build.cache_key(kernel, "sm_90a", NVCC) != key
    source.write_text(source.read_text() + "\n// changed\n")
    assert build.cache_key(kernel, "sm_80", NVCC) != key
    monkeypatch.setattr(build, "NVCC_FLAGS", (*build.NVCC_FLAGS, "-lineinfo"))
    source.write_text((DATA / "scale_ffi.cu").read_text())
    assert build.cache_key(kernel, "sm_80", NVCC) != key


@needs_nvcc
def test_library_is_built_once_verified_and_tampering_refused(cache, scale_kernel):
    library = build.verified_library(scale_kernel, "sm_80", nvcc=NVCC)
    assert library.parent == cache and library.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in cache.iterdir()) == [library.name, library.name + ".sha256"]
    mtime = library.stat().st_mtime_ns
    assert build.verified_library(scale_kernel, "sm_80", nvcc=NVCC) == library
    assert library.stat().st_mtime_ns == mtime, "a verified library is reused, not rebuilt"

    with library.open("ab") as f:  # tamper with the cached code
        f.write(b"\x90")
    with pytest.raises(build.CacheError, match=r"does not match its recorded sha256; refusing to load it"):
        build.verified_library(scale_kernel, "sm_80", nvcc=NVCC)

    library.chmod(0o666)  # and a library others may rewrite is refused before its digest is read
    with pytest.raises(build.CacheError, match=r"writable by group or others"):
        build.verified_library(scale_kernel, "sm_80", nvcc=NVCC)


@needs_nvcc
def test_broken_source_is_a_build_error(tmp_path, cache):
    source = tmp_path / "broken.cu"
    source.write_text("this is not CUDA\n")
    with pytest.raises(build.BuildError, match=r"nvcc failed for kernel 'broken' \(sm_80\)"):
        build.verified_library(build.Kernel("broken", (str(source),), (), {}), "sm_80", nvcc=NVCC)
    assert list(cache.iterdir()) == [], "a failed build leaves nothing behind"


def test_without_a_gpu_the_default_lowering_is_used(scale_kernel):
    if build.gpu_arch() is not None:
        pytest.skip("a GPU is visible")
    assert build.ensure_loaded(scale_kernel) is False


def test_main_without_nvcc_says_so(monkeypatch, capsys):
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    assert build.main(["--compile-only"]) == 1
    assert "nvcc not found" in capsys.readouterr().err


@needs_nvcc
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_declared_kernel_compiles_for_sm80_and_sm90a(tmp_path):
    """What CI checks without a GPU: a broken kernel fails the suite."""
    assert build.declared_kernels(), "no kernel is declared"
    assert build.main(["--compile-only", "--arch", "sm_80", "--arch", "sm_90a", "--out", str(tmp_path)]) == 0
    for kernel in build.declared_kernels().values():
        library = (tmp_path / f"{kernel.name}.so").read_bytes()  # one fat binary per kernel
        assert b"-arch sm_80 " in library and b"-arch sm_90a " in library  # each arch's device-link record
        for symbol in kernel.targets.values():  # what build.load looks up, a NUL-ended dynamic symbol
            assert symbol.encode() + b"\0" in library, (kernel.name, symbol)


def test_the_validation_switch(monkeypatch):
    monkeypatch.delenv("JAXFORGE_UNVALIDATED_KERNELS", raising=False)
    assert build.enabled(True) and not build.enabled(False)
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    assert build.enabled(False)


def test_every_declared_kernel_lists_the_headers_it_includes():
    """The cache key hashes the declared files only: an undeclared header edit would load a stale
    library. Quoted includes resolve against the including file's folder, then jaxforge/lowering/."""

    def includes(path: pathlib.Path) -> set[pathlib.Path]:
        found = set()
        for name in re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.MULTILINE):
            here, root = path.parent / name, build.PACKAGE_LOWERING / name
            target = here if here.exists() else root
            if target.exists():  # else a system or XLA header on the -I path
                found |= {target.resolve()} | includes(target)
        return found

    for kernel in build.declared_kernels().values():
        files = {p.resolve() for p in kernel.files().values()}
        used = set().union(*(includes(build.PACKAGE_LOWERING / source) for source in kernel.sources))
        assert used <= files, f"{kernel.name} does not declare {sorted(str(p) for p in used - files)}"
