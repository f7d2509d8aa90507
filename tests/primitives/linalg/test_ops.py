"""The shared matrix helpers of the linear-algebra rules (``primitives/linalg/_ops.py``)."""

import numpy as np
import pytest

from jaxforge.primitives.linalg._ops import _INVERSE_BLOCK, upper_inverse
from tests.linalg_inputs import random, with_singular_values


@pytest.mark.parametrize("n", [1, _INVERSE_BLOCK, _INVERSE_BLOCK + 1, 300, 513])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_a_triangular_inverse_by_halves_is_the_inverse(n, dtype):
    rng = np.random.default_rng(n)
    a = with_singular_values(rng, (2,), n, n, np.geomspace(1, 1e-6, n)).astype(dtype)
    phases = random(rng, (2, n, 1), dtype)
    r = phases / np.abs(phases) * np.linalg.qr(a, mode="r")  # of condition 1e6, a complex diagonal too
    inverse = np.asarray(upper_inverse(r))
    assert inverse.dtype == dtype and np.all(np.tril(inverse, -1) == 0)
    # A backward-stable inverse: X R = I up to rounding times R's condition number (1e6).
    np.testing.assert_allclose(inverse @ r, np.broadcast_to(np.eye(n), r.shape), atol=1e-8)
    np.testing.assert_allclose(inverse, np.linalg.inv(r), rtol=1e-8, atol=1e-8 * np.abs(inverse).max())
