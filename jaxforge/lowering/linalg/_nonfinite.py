"""NaN/Inf policy shared by the linalg lowerings: a matrix with a non-finite entry gives NaN outputs.

LAPACK does not promise that (an Inf can come back as a partly finite factorisation). The checks
read small outputs (singular values, solutions), not the inputs: reading an input that LAPACK
overwrites in place would make XLA copy it.
"""

from __future__ import annotations

import jax.numpy as jnp


def nonfinite_matrices(x):
    """Boolean ``(*batch,)``: which matrices ``x[..., :, :]`` hold a NaN or Inf."""
    return ~jnp.all(jnp.isfinite(x), axis=(-2, -1))


def poison(bad, out):
    """NaN where ``bad``, broadcast over the core dims of ``out`` (an inexact array)."""
    mask = bad.reshape(bad.shape + (1,) * (out.ndim - bad.ndim))
    return jnp.where(mask, jnp.nan, out)
