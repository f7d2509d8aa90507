"""Matrices with known singular values, so tests can state tolerances and conditioning exactly."""

from __future__ import annotations

import numpy as np


def unitary(rng, n: int, dtype) -> np.ndarray:
    """A Haar-ish random unitary (orthogonal for real dtypes) n×n matrix."""
    z = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        z = z + 1j * rng.standard_normal((n, n))
    q, r = np.linalg.qr(z)
    return (q * (np.diagonal(r) / np.abs(np.diagonal(r)))).astype(dtype)


def with_singular_values(rng, batch: tuple, m: int, n: int, s, dtype=np.float64) -> np.ndarray:
    """``U diag(s) Vᴴ`` for random unitary ``U``, ``V``; ``s`` has min(m, n) entries."""
    k = min(m, n)
    s = np.asarray(s, dtype=np.float64)
    assert s.shape == (k,)
    out = np.empty((*batch, m, n), dtype)
    for idx in np.ndindex(*batch):
        u = unitary(rng, m, dtype)[:, :k]
        v = unitary(rng, n, dtype)[:, :k]
        out[idx] = (u * s) @ v.conj().T
    return out


def well_conditioned(rng, batch: tuple, m: int, n: int, dtype=np.float64) -> np.ndarray:
    """Distinct singular values spread over [1, 2]: safe for finite differences of every order."""
    k = min(m, n)
    return with_singular_values(rng, batch, m, n, np.linspace(2.0, 1.0, k) if k > 1 else [1.5], dtype)


def random(rng, shape: tuple, dtype=np.float64) -> np.ndarray:
    x = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


def exactly_rank_deficient(rng, shape: tuple, dtype=np.float64) -> np.ndarray:
    """Random matrices with their trailing half of columns (of rows, when wide) zero, the first a
    zero matrix: singular values exactly 0, where a Jacobi kernel has no normalised vector of its
    own and completes the basis."""
    a = random(rng, shape, dtype)
    m, n = shape[-2:]
    if m >= n:
        a[..., :, n // 2 :] = 0
    else:
        a[..., m // 2 :, :] = 0
    a[0] = 0
    return a
