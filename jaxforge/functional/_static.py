"""Arguments the kernels take as constants (a scale, a window, a tolerance): a number, or a
concrete scalar array standing for one; and the one dtype of two array arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


def static_int(fn: str, name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int: a Python or numpy int, or a concrete integer scalar array; a traced one
    is refused (it sets a size, a mask's static span, a device's number)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{fn}: `{name}` must be a Python int, got a traced {jax.typeof(value).str_short()}: compute it outside jit")
    value = concrete_scalar(value, "iu")
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{fn}: `{name}` must be a Python int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{fn}: `{name}` must be >= {minimum}, got {value}")
    return int(value)


def common_dtype(fn: str, a: tuple[str, np.dtype], b: tuple[str, np.dtype]) -> np.dtype:
    """The dtype two arguments ``(name, dtype)`` promote to; under strict dtype promotion, which
    leaves different dtypes unpromoted, a TypeError naming ``fn`` and both."""
    try:
        return jnp.promote_types(a[1], b[1])
    except jax.dtypes.TypePromotionError:
        raise TypeError(
            f"{fn}: `{a[0]}` has dtype {a[1]} and `{b[0]}` {b[1]}, which strict dtype promotion "
            "(jax_numpy_dtype_promotion='strict') leaves unpromoted; cast one to the other's dtype"
        ) from None
