"""Every registered implementation of svd_p and lstsq_p against the reference, on the named shapes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxforge.lowering.linalg import lstsq as lstsq_lowering
from jaxforge.lowering.linalg import svd as svd_lowering
from jaxforge.primitives.linalg import lstsq, lstsq_reference, svd, svd_reference
from tests.linalg_inputs import random, well_conditioned

SVD_CASES = [(name, shape) for name, (shape, tags) in svd.SHAPES.items() if "test" in tags]
LSTSQ_CASES = [(name, shape) for name, (shape, tags) in lstsq.SHAPES.items() if "test" in tags]


@pytest.mark.parametrize("impl", sorted(svd_lowering.IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", [np.float32, np.complex128])
@pytest.mark.parametrize("name,shape", SVD_CASES)
def test_svd_implementation(impl, dtype, name, shape):
    batch, m, n = shape
    a = random(np.random.default_rng(0), (batch, m, n), dtype)
    params = dict(full_matrices=False, compute_uv=True, grad_eps=0.0)
    s, u, vh = jax.jit(lambda a: svd_lowering.IMPLEMENTATIONS[impl](a, **params))(a)
    s_ref, _, _ = svd_reference(a.astype(np.complex128))
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(s, s_ref, rtol=50 * eps * np.sqrt(max(m, n)), atol=50 * eps * np.max(s_ref))
    recon = (u * s[..., None, :].astype(dtype)) @ vh
    assert np.linalg.norm(recon - a) / np.linalg.norm(a) < 50 * eps * np.sqrt(max(m, n))


@pytest.mark.parametrize("impl", sorted(lstsq_lowering.IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", [np.float32, np.complex128])
@pytest.mark.parametrize("name,shape", LSTSQ_CASES)
def test_lstsq_implementation(impl, dtype, name, shape):
    batch, m, n, k = shape
    rng = np.random.default_rng(1)
    a, b = well_conditioned(rng, (batch,), m, n, dtype), random(rng, (batch, m, k), dtype)
    rcond = float(np.finfo(dtype).eps * max(m, n))
    x, res, rank, s, r = jax.jit(lambda a, b: lstsq_lowering.IMPLEMENTATIONS[impl](a, b, rcond=rcond))(a, b)
    x_ref, res_ref, rank_ref, s_ref, r_ref = lstsq_reference(a.astype(np.complex128), b.astype(np.complex128), rcond=rcond)
    tol = 100 * np.finfo(dtype).eps
    np.testing.assert_allclose(x, x_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(res, res_ref, rtol=np.sqrt(tol))
    np.testing.assert_array_equal(rank, rank_ref)
    np.testing.assert_allclose(s, s_ref, rtol=tol)
    np.testing.assert_allclose(r, r_ref, atol=tol * np.max(np.abs(r_ref)))  # the unique R: real diagonal >= 0
