"""Test set-up: float64 on, implicit rank promotion an error, 8 CPU devices in one process for
sharding tests, the `gpu` marker, and jf.nn's shape annotations checked at run time (the hook must
precede any import of jaxforge)."""

import gc
import importlib.util
import os
from pathlib import Path

from jaxtyping import install_import_hook

# beartype is a dev dependency; the GPU machine's image lacks it (its tests then run unchecked).
if importlib.util.find_spec("beartype") is not None:
    install_import_hook("jaxforge.functional.nn", "beartype.beartype")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)
# As in JAX's own suite, an implicit rank promotion (a (n,) bias added to a (b, n) array) is an
# error: jaxforge must run for a user who sets it so. The README's examples (user code) are exempt.
jax.config.update("jax_numpy_rank_promotion", "raise")


def _mapping_count() -> int | None:
    """This process's memory mappings (None off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


try:
    _MAPPING_LIMIT = int(Path("/proc/sys/vm/max_map_count").read_text())
except (OSError, ValueError):
    _MAPPING_LIMIT = 65530  # Linux's default


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Each compiled CPU program keeps its JIT code in memory mappings of its own, and jax's caches
    keep the programs: an xdist worker that had run ~1200 tests' programs reached the kernel's
    vm.max_map_count, where LLVM's next allocation fails ("LLVM compilation error: Cannot allocate
    memory") and the worker dies. Past half that limit the caches go (later tests recompile)."""
    yield
    mappings = _mapping_count()
    if mappings is not None and mappings > _MAPPING_LIMIT // 2:
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def backend_compiles():
    """The XLA compilations that run while the test does (``jax.monitoring``'s compile events), by
    the name of the function compiled (``jit(f)``): a list to clear after a warm-up call and to
    read after the call under test."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event.endswith("backend_compile_duration"):
            compiles.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield compiles
    jax.monitoring.unregister_event_duration_listener(listener)


def pytest_collection_modifyitems(config, items):
    # The slow tests first (longest first, as a scheduler would): the two workers then end on
    # short tests, so neither waits long for the other's last one.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Under JAXFORGE_OUTCOME_LOG each test's outcome (pytest -rA's ``PASSED node-id`` line) and
    each failure's traceback are appended to that file as they happen, so a run its time limit cuts
    off still says what passed and why the rest failed (gpu_check.sh, pending_kernels.py); xdist's
    workers leave it to the controller, which sees every report."""
    path = os.environ.get("JAXFORGE_OUTCOME_LOG")
    if not path or "PYTEST_XDIST_WORKER" in os.environ:
        return
    if report.failed:
        outcome = "FAILED" if report.when == "call" else "ERROR"
        entry = f"{outcome} {report.nodeid}\n=== {report.nodeid} ({report.when})\n{report.longreprtext}\n"
    elif report.passed and report.when == "call":
        entry = f"PASSED {report.nodeid}\n"
    else:
        return
    with open(path, "a") as log:
        log.write(entry)
