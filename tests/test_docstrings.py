"""Every ``>>>`` example in jaxforge's docstrings runs and prints what it shows, with jax's default
32-bit types as a user has them (the suite itself enables x64)."""

from __future__ import annotations

import doctest
import importlib
import pathlib

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "jaxforge").rglob("*.py")
    if ">>>" in path.read_text()
)


def test_some_modules_have_examples():
    assert "jaxforge.functional.linalg" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    with jax.enable_x64(False):
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
