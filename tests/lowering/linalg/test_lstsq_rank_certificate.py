"""The cheap full-rank certificate of the lstsq lowering: a true upper bound of the 2-norm, tight
enough to spare a well-conditioned large problem the SVD of R, its cheapest rung where it can."""

from __future__ import annotations

import numpy as np
import pytest

from jaxforge.lowering.linalg.lstsq.xla import CERTIFICATE_SQUARINGS, _full_rank_certificate, _two_norm_bound
from jaxforge.primitives.linalg.lstsq import default_rcond
from tests.linalg_inputs import with_singular_values


@pytest.mark.parametrize("squarings", CERTIFICATE_SQUARINGS)
@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_two_norm_bound_is_an_upper_bound_within_its_factor(n, squarings):
    rng = np.random.default_rng(n)
    factor = n ** (1 / (4 * 2**squarings))
    for s in (np.ones(n), np.geomspace(1, 1e-6, n), np.r_[1e3, np.ones(n - 1)], rng.uniform(0, 5, n)):
        x = with_singular_values(rng, (3,), n, n, s)
        bound, true = np.asarray(_two_norm_bound(x, squarings)), np.linalg.norm(x, 2, axis=(-2, -1))
        assert np.all(bound >= true * (1 - 1e-12)), (bound, true)
        assert np.all(bound <= true * factor * (1 + 1e-12)), (bound / true, factor)


def certificate(r, rcond, squarings):
    return bool(_full_rank_certificate(r, np.linalg.inv(r), rcond, squarings))


def test_a_well_conditioned_1024_column_problem_is_certified_in_float32():
    # The GPU benchmark's lstsq 16384 x 1024 (condition 100): without the certificate the lowering
    # runs the SVD of the 1024 x 1024 R, which cost 3x the QR on the H200.
    n = 1024
    a = with_singular_values(np.random.default_rng(0), (), n, n, np.geomspace(1, 1e-2, n)).astype(np.float32)
    r = np.linalg.qr(a, mode="r")
    rcond = default_rcond(np.float32, 16384, n)
    assert certificate(r, rcond, 2) and not certificate(r, rcond, 0)  # 1/rcond = 512: the tight rung
    assert certificate(r, default_rcond(np.float32, n, n), 0)  # 1/rcond = 8192: the cheap one


def test_rank_deficient_and_non_finite_r_are_not_certified():
    rng = np.random.default_rng(1)
    deficient = with_singular_values(rng, (), 40, 12, np.r_[np.ones(8), np.zeros(4)])
    r = np.linalg.qr(deficient, mode="r")
    nan = r.copy()
    nan[0, 0] = np.nan
    rcond = default_rcond(np.float64, 40, 12)
    for squarings in CERTIFICATE_SQUARINGS:
        assert not certificate(r, rcond, squarings) and not certificate(nan, rcond, squarings)
