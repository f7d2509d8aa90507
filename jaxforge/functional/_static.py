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


def static_bool(fn: str, name: str, value, accepted: str = "a bool") -> bool:
    """``value`` as a Python bool: a bool, 0 or 1 (numpy's ``svd(a, 0)``), or a concrete scalar
    array of one; a traced one is refused, naming ``name``: a flag picks what is computed.
    ``accepted`` says what the argument takes, for the error."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{fn}: `{name}` must be a Python bool, got a traced {jax.typeof(value).str_short()}: it decides "
            f"what is computed, so pass it to jax.jit as a static argument (static_argnames)"
        )
    value = concrete_scalar(value, "biu")
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{fn}: `{name}` must be {accepted}, got {type(value).__name__} {value!r}")
