"""The cheap full-rank certificate of the lstsq lowering: a true upper bound of the 2-norm, tight
enough to spare a well-conditioned large problem the SVD of R, its cheapest rung where it can; and
how a GPU kernel that takes the first rung itself (``fused``) hands over to the later ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxforge.lowering.linalg.lstsq.xla import (
    CERTIFICATE_SQUARINGS,
    _full_rank_certificate,
    _rungs,
    _two_norm_bound,
    _upper_gram,
    augmented_qr,
    lstsq_xla,
)
from jaxforge.primitives.linalg._ops import solve_triangular
from jaxforge.primitives.linalg.lstsq import default_rcond
from tests.linalg_inputs import random, well_conditioned, with_singular_values


@pytest.mark.parametrize("squarings", CERTIFICATE_SQUARINGS)
@pytest.mark.parametrize("n", [1, 7, 64, 300, 600])
def test_two_norm_bound_is_an_upper_bound_within_its_factor(n, squarings):
    rng = np.random.default_rng(n)
    factor = n ** (1 / (4 * 2**squarings))
    for s in (np.ones(n), np.geomspace(1, 1e-6, n), np.r_[1e3, np.ones(n - 1)], rng.uniform(0, 5, n)):
        x = np.linalg.qr(with_singular_values(rng, (3,), n, n, s), mode="r")  # triangular, as R and R⁻¹
        bound, true = np.asarray(_two_norm_bound(x, squarings)), np.linalg.norm(x, 2, axis=(-2, -1))
        assert np.all(bound >= true * (1 - 1e-12)), (bound, true)
        assert np.all(bound <= true * factor * (1 + 1e-12)), (bound / true, factor)


@pytest.mark.parametrize("n", [5, 257, 600])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_the_gram_of_a_triangular_factor_by_blocks_is_the_product(n, dtype):
    y = np.triu(random(np.random.default_rng(n), (2, n, n), dtype))
    np.testing.assert_allclose(_upper_gram(y), np.swapaxes(y, -1, -2).conj() @ y, rtol=1e-12, atol=1e-11)


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
    assert certificate(r, default_rcond(np.float32, n, n), 0)  # 1/rcond = 8192: one product a factor
    assert not certificate(r, default_rcond(np.float32, n, n), -1)  # but not the Frobenius norms
    assert certificate(r.astype(np.float64), default_rcond(np.float64, n, n), -1)  # 1/rcond = 4e12


def test_the_frobenius_rung_is_skipped_where_it_cannot_certify():
    # ‖R‖_F ‖R⁻¹‖_F >= k: with k·rcond >= 1 even an orthogonal factor fails the Frobenius rung.
    k, rcond = 64, 1 / 60
    q = np.linalg.qr(random(np.random.default_rng(4), (k, k)))[0]
    assert not certificate(q, rcond, -1) and certificate(q, rcond, 0)
    assert _rungs(k, rcond) == (0, 2) and _rungs(k, 1 / 70) == (-1, 0, 2) and _rungs(k, 1 / 70, past=0) == (2,)


@pytest.mark.parametrize("m,n", [(64, 16), (512, 128)])
def test_few_columns_in_float32_are_certified_by_the_frobenius_norms(m, n):
    # The CPU benchmark's batched float32 shapes (condition 100): no product past R⁻¹.
    a = with_singular_values(np.random.default_rng(m), (), m, n, np.geomspace(1, 1e-2, n)).astype(np.float32)
    assert certificate(np.linalg.qr(a, mode="r"), default_rcond(np.float32, m, n), -1)


@pytest.mark.parametrize("magnitude", [1e-30, 1e-20, 1e20, 1e30])
def test_float32_entries_whose_squares_leave_the_range_are_still_certified(magnitude):
    # ‖R‖_F of entries ~1e±20 squares them past float32's range; scaled first, every rung holds.
    a = with_singular_values(np.random.default_rng(5), (), 64, 16, np.geomspace(1, 1e-1, 16))
    r = np.linalg.qr((magnitude * a).astype(np.float32), mode="r")
    rcond = default_rcond(np.float32, 64, 16)
    assert all(certificate(r, rcond, squarings) for squarings in CERTIFICATE_SQUARINGS)


SPECTRA = {  # the smallest singular value apart from the rest
    "large_outlier": lambda k: np.r_[30.0, np.linspace(1, 0.5, k - 1)],  # ‖R‖_F is tight, ‖R⁻¹‖_F loose
    "geometric": lambda k: np.geomspace(1, 1e-2, k),
    "small_outlier": lambda k: np.r_[np.linspace(1, 0.5, k - 1), 1 / 30],  # ‖R⁻¹‖_F tight, ‖R‖_F loose
    "both_outliers": lambda k: np.r_[30.0, np.linspace(1, 0.5, k - 2), 1 / 30],  # every bound within 1.4x
}


@pytest.mark.parametrize("spectrum", SPECTRA)
@pytest.mark.parametrize("wide", [False, True])
def test_at_the_cut_off_the_gram_rungs_certify_nothing_they_cannot_prove(spectrum, wide):
    # 300 columns, float64: every rung is tried (-1, R's Gram with ‖R⁻¹‖_F, 0, 2), then the SVD. Just past
    # s_k/s_1 the last singular value is cut (rank k - 1); just below it none is, proven or not.
    k = 300
    rng = np.random.default_rng(8)
    s = SPECTRA[spectrum](k)
    m, n = (k, k + 20) if wide else (k + 20, k)
    a, b = with_singular_values(rng, (2,), m, n, s), random(rng, (2, m, 1))
    for rcond, rank in ((s.min() / s.max() * 1.001, k - 1), (s.min() / s.max() / 1.001, k)):
        x, _, got_rank, *_ = jax.jit(lambda a, b: lstsq_xla(a, b, rcond=rcond))(a, b)
        assert np.all(np.asarray(got_rank) == rank)
        want = np.stack([np.linalg.lstsq(a[i], b[i], rcond=rcond)[0] for i in range(2)])
        np.testing.assert_allclose(x, want, rtol=1e-8, atol=1e-8 * np.abs(want).max())


def test_rank_deficient_and_non_finite_r_are_not_certified():
    rng = np.random.default_rng(1)
    deficient = with_singular_values(rng, (), 40, 12, np.r_[np.ones(8), np.zeros(4)])
    r = np.linalg.qr(deficient, mode="r")
    nan = r.copy()
    nan[0, 0] = np.nan
    rcond = default_rcond(np.float64, 40, 12)
    for squarings in CERTIFICATE_SQUARINGS:
        assert not certificate(r, rcond, squarings) and not certificate(nan, rcond, squarings)


def fused_in_jnp(marker=0.0, proven=None):
    """``lstsq_xla``'s ``fused`` as the qr_solve kernel computes it (QR of ``[A | b]``, or of ``Aᴴ``
    when wide, the solve, the first rung), with ``marker`` added to its solution and ``proven``, if
    given, forced."""

    def fused(a, b, rcond):
        m, n = a.shape[-2:]
        if m >= n:
            r, c = augmented_qr()(a, b)
            x, factor = solve_triangular(r, c), lambda a, b: (r, c)
        else:
            q, r = jnp.linalg.qr(jnp.swapaxes(a, -1, -2).conj())
            x, factor = q @ solve_triangular(r, b, adjoint=True), None
        r_inv = solve_triangular(r, jnp.broadcast_to(jnp.eye(r.shape[-1], dtype=r.dtype), r.shape))
        certified = _full_rank_certificate(r, r_inv, rcond, 0)  # qr_solve's rung
        return r, x + marker, certified if proven is None else jnp.full_like(certified, proven), factor

    return fused


@pytest.mark.parametrize("m,n", [(20, 6), (6, 20)])
def test_a_fused_kernel_s_solution_is_taken_only_where_it_certifies_the_whole_batch(m, n):
    rng = np.random.default_rng(2)
    a, b = well_conditioned(rng, (3,), m, n), random(rng, (3, m, 2))
    rcond = default_rcond(np.float64, m, n)
    run = jax.jit(lambda a, b, fused: lstsq_xla(a, b, rcond=rcond, fused=fused), static_argnums=2)
    want = lstsq_xla(a, b, rcond=rcond)
    np.testing.assert_allclose(run(a, b, fused_in_jnp(1e3, True))[0], want[0] + 1e3, rtol=1e-12)
    for fused in (fused_in_jnp(), fused_in_jnp(1e3, False)):  # certified, or left to the later rungs
        for got, expected in zip(run(a, b, fused), want):
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("case", ["rank_deficient", "second_rung"])
def test_with_a_fused_kernel_the_later_rungs_and_the_svd_still_decide(case, wide):
    rng = np.random.default_rng(3)
    m, n = (48, 60) if wide else (60, 48)
    k = min(m, n)
    if case == "rank_deficient":  # no rung certifies: the SVD of R gives rank and solution
        a = with_singular_values(rng, (2,), m, n, np.r_[np.ones(k - 4), np.zeros(4)])
        rcond = default_rcond(np.float64, m, n)
    else:  # the kernel's rung fails, the tight one (two squarings) certifies
        a = with_singular_values(rng, (2,), m, n, np.geomspace(1, 1e-2, k))
        r = np.linalg.qr(a, mode="r")[..., :k, :k] if not wide else np.linalg.qr(np.swapaxes(a, -1, -2), mode="r")
        bounds = [np.max(np.asarray(_two_norm_bound(r, q) * _two_norm_bound(np.linalg.inv(r), q))) for q in (0, 2)]
        rcond = 1 / np.sqrt(bounds[0] * bounds[1])  # between the two rungs' bounds
    b = random(rng, (2, m, 1))
    got = lstsq_xla(a, b, rcond=rcond, fused=fused_in_jnp(1e3))  # a wrong solution, never certified
    want = lstsq_xla(a, b, rcond=rcond)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    x_np = np.stack([np.linalg.lstsq(a[i], b[i], rcond=rcond)[0] for i in range(2)])
    np.testing.assert_allclose(got[0], x_np, rtol=1e-8, atol=1e-8)
    np.testing.assert_array_equal(got[2], k - 4 if case == "rank_deficient" else k)
