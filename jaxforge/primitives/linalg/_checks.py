"""Trace-time checks shared by the linear-algebra primitives and their public wrappers."""

from __future__ import annotations

import jax
import numpy as np

ACCEPTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128))
_ACCEPTED_NAMES = ", ".join(d.name for d in ACCEPTED_DTYPES)


def check_dtype(fn: str, arg: str, dtype) -> np.dtype:
    """Returns ``dtype`` if it is one the linalg kernels accept, else raises TypeError."""
    dtype = np.dtype(dtype)
    if dtype not in ACCEPTED_DTYPES:
        raise TypeError(
            f"{fn}: `{arg}` has dtype {dtype.name}; accepted dtypes are {_ACCEPTED_NAMES} "
            f"(cast integer or half-precision input explicitly, e.g. with .astype(jnp.float32))"
        )
    return dtype


def check_matrix(fn: str, arg: str, shape: tuple[int, ...]) -> None:
    """A matrix operand has rank >= 2, ``(*batch, m, n)``, and static ``m``, ``n``: the algorithm
    and the kernel depend on them (batch dims may be symbolic under ``jax.export``)."""
    if len(shape) < 2:
        raise ValueError(
            f"{fn}: `{arg}` must have rank >= 2, shape (..., m, n); got shape {tuple(shape)}"
        )
    if any(jax.export.is_symbolic_dim(d) for d in shape[-2:]):
        raise ValueError(
            f"{fn}: `{arg}` must have static matrix dims, its last two (the algorithm depends on them; "
            f"batch dims may be symbolic); got shape {tuple(shape)}"
        )


def real_dtype(dtype) -> np.dtype:
    return np.finfo(np.dtype(dtype)).dtype
