"""Property tests: random shapes, batch dims and conditioning against numpy (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxforge as jf
from tests.linalg_inputs import with_singular_values

shapes = st.tuples(
    st.lists(st.integers(1, 3), max_size=2),  # batch dims
    st.integers(1, 9),  # m
    st.integers(1, 9),  # n
)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, log_cond=st.floats(0, 8), seed=st.integers(0, 2**31 - 1))
def test_svd_values_and_reconstruction(shape, log_cond, seed):
    batch, m, n = shape
    k = min(m, n)
    s_true = np.logspace(0, -log_cond, k)
    a = with_singular_values(np.random.default_rng(seed), tuple(batch), m, n, s_true)
    u, s, vh = jf.linalg.svd(a)
    np.testing.assert_allclose(s, np.broadcast_to(s_true, s.shape), rtol=0, atol=1e-13)
    np.testing.assert_allclose((u * s[..., None, :]) @ vh, a, atol=1e-13)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, k=st.integers(1, 3), log_cond=st.floats(0, 6), seed=st.integers(0, 2**31 - 1))
def test_lstsq_matches_numpy_across_conditioning(shape, k, log_cond, seed):
    batch, m, n = shape
    rng = np.random.default_rng(seed)
    a = with_singular_values(rng, tuple(batch), m, n, np.logspace(0, -log_cond, min(m, n)))
    b = rng.standard_normal((*batch, m, k))
    x, res, rank, _ = jf.linalg.lstsq(a, b)
    for idx in np.ndindex(*batch):
        x_np, res_np, rank_np, _ = np.linalg.lstsq(a[idx], b[idx], rcond=None)
        assert int(rank[idx]) == int(rank_np)
        # The solution's sensitivity grows with κ (and κ² for the residual part): scale the bound.
        scale = 10.0 ** (2 * log_cond) * 1e-13 * max(1.0, np.abs(x_np).max())
        np.testing.assert_allclose(x[idx], x_np, rtol=0, atol=scale)
        if m > n:
            np.testing.assert_allclose(res[idx], res_np, rtol=1e-8, atol=1e-12)
