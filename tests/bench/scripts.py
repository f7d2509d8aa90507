"""The scripts under benchmarks/ (a folder, not a package), imported from their paths for their tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name: str):
    """``benchmarks/<name>.py`` as a module, registered in ``sys.modules`` (dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
