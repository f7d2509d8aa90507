"""Arguments the kernels take as constants (a scale, a window, a tolerance): a number, or a
concrete scalar array standing for one."""

from __future__ import annotations

import jax
import numpy as np


def concrete_scalar(value, kinds: str):
    """``value`` as a Python number where it is a concrete (not traced) scalar array whose dtype
    kind is in ``kinds`` (numpy's: "f" float, "i" int, "u" unsigned); else ``value`` unchanged."""
    if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, jax.core.Tracer) and value.shape == () and value.dtype.kind in kinds:
        return value.item()
    return value
