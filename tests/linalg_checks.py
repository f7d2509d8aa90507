"""Accuracy checks shared by the linalg lowering tests: ANCHORS.md's bars against float64 numpy."""

from __future__ import annotations

import numpy as np


def _bound(a, tol_factor: float) -> float:
    return tol_factor * np.finfo(np.asarray(a).dtype).eps * np.sqrt(max(a.shape[-2:]))


def check_singular_values(a, s, *, tol_factor: float = 50):
    """``s`` within ``tol_factor · eps · √max(m, n)`` (eps of ``a``'s dtype) of float64 numpy's,
    relative to each matrix's largest singular value."""
    a = np.asarray(a)
    s_np = np.linalg.svd(a.astype(np.result_type(a.dtype, np.float64)), compute_uv=False)
    tiny = np.finfo(np.float64).tiny
    assert (np.abs(np.asarray(s, np.float64) - s_np) / np.maximum(s_np[..., :1], tiny)).max() <= _bound(a, tol_factor)


def check_svd(a, s, u, vh, *, tol_factor: float = 50):
    """``s`` (check_singular_values), the reconstruction ``‖A − U diag(s) Vᴴ‖_F / ‖A‖_F`` and the
    orthogonality of ``u`` and ``vh`` each within ``tol_factor · eps · √max(m, n)``."""
    check_singular_values(a, s, tol_factor=tol_factor)
    wide = np.complex128 if np.iscomplexobj(a) else np.float64
    a64 = np.asarray(a, wide)
    bound = _bound(a, tol_factor)
    s, u, vh = np.asarray(s, np.float64), np.asarray(u, wide), np.asarray(vh, wide)
    tiny = np.finfo(np.float64).tiny
    recon = (u * s[..., None, :]) @ vh
    norm = np.maximum(np.linalg.norm(a64, axis=(-2, -1)), tiny)
    assert (np.linalg.norm(recon - a64, axis=(-2, -1)) / norm).max() <= bound
    for q in (u, np.conj(np.swapaxes(vh, -1, -2))):
        gram = np.conj(np.swapaxes(q, -1, -2)) @ q
        assert np.abs(gram - np.eye(q.shape[-1])).max() <= bound
