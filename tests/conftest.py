"""Test set-up: float64 on, 8 CPU devices in one process for sharding tests, the `gpu` marker,
and jf.nn's shape annotations checked at run time (the hook must precede any import of jaxforge)."""

import importlib.util

from jaxtyping import install_import_hook

# beartype is a dev dependency; the GPU machine's image lacks it (its tests then run unchecked).
if importlib.util.find_spec("beartype") is not None:
    install_import_hook("jaxforge.functional.nn", "beartype.beartype")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)


def pytest_collection_modifyitems(config, items):
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
