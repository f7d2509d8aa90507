"""Accuracy checks shared by the linalg lowering tests: ANCHORS.md's bars against float64 numpy."""

from __future__ import annotations

import numpy as np


def check_svd(a, s, u, vh, *, tol_factor: float = 50):
    """``s``, the reconstruction ``‖A − U diag(s) Vᴴ‖_F / ‖A‖_F`` and the orthogonality of ``u`` and
    ``vh`` each within ``tol_factor · eps · √max(m, n)`` (eps of ``a``'s dtype); ``s`` is compared
    relative to each matrix's largest singular value."""
    wide = np.complex128 if np.iscomplexobj(a) else np.float64
    a64 = np.asarray(a, wide)
    m, n = a64.shape[-2:]
    bound = tol_factor * np.finfo(np.asarray(a).dtype).eps * np.sqrt(max(m, n))
    s, u, vh = np.asarray(s, np.float64), np.asarray(u, wide), np.asarray(vh, wide)
    s_np = np.linalg.svd(a64, compute_uv=False)
    tiny = np.finfo(np.float64).tiny
    assert (np.abs(s - s_np) / np.maximum(s_np[..., :1], tiny)).max() <= bound
    recon = (u * s[..., None, :]) @ vh
    norm = np.maximum(np.linalg.norm(a64, axis=(-2, -1)), tiny)
    assert (np.linalg.norm(recon - a64, axis=(-2, -1)) / norm).max() <= bound
    for q in (u, np.conj(np.swapaxes(vh, -1, -2))):
        gram = np.conj(np.swapaxes(q, -1, -2)) @ q
        assert np.abs(gram - np.eye(q.shape[-1])).max() <= bound
