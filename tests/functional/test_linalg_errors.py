"""Bad input to jf.linalg: clear errors at trace time that name the argument and what is accepted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float16, jnp.bfloat16, np.bool_])
def test_svd_rejects_dtype(dtype):
    with pytest.raises(TypeError, match=r"svd: `a` has dtype \w+; accepted dtypes are float32, float64, complex64, complex128"):
        jf.linalg.svd(jnp.ones((3, 3), dtype))


@pytest.mark.parametrize("dtype", [np.int32, np.float16])
def test_lstsq_rejects_such_an_a_and_casts_such_a_b_to_as_dtype(dtype):
    """As numpy and jnp promote ``b``; an integer or half ``a`` leaves the precision undecided."""
    with pytest.raises(TypeError, match=r"lstsq: `a` has dtype"):
        jf.linalg.lstsq(jnp.ones((3, 2), dtype), jnp.ones(3))
    a, b = jnp.asarray([[1.0, 2.0], [3.0, 5.0], [4.0, -1.0]], jnp.float32), np.asarray([1, -2, 7])
    got = jf.linalg.lstsq(a, b.astype(dtype))
    assert got.solution.dtype == jnp.float32
    np.testing.assert_array_equal(got.solution, jf.linalg.lstsq(a, b.astype(np.float32)).solution)
    with pytest.raises(TypeError, match=r"lstsq: `b` has dtype float8_e4m3fn"):
        jf.linalg.lstsq(a, jnp.ones(3, jnp.float8_e4m3fn))


@pytest.mark.parametrize("fn", ["svdvals", "pinv", "matrix_rank", "polar"])
def test_the_svds_companions_check_a_as_svd_does(fn):
    with pytest.raises(TypeError, match=rf"{fn}: `a` has dtype int32; accepted dtypes are float32"):
        getattr(jf.linalg, fn)(jnp.ones((3, 3), jnp.int32))
    with pytest.raises(ValueError, match=rf"{fn}: `a` must have rank >= 2, shape \(\.\.\., m, n\); got shape \(4,\)"):
        getattr(jf.linalg, fn)(jnp.ones(4))


@pytest.mark.parametrize("fn", ["pinv", "matrix_rank"])
def test_hermitian_needs_square_matrices(fn):
    with pytest.raises(ValueError, match=rf"{fn}: `a` must be square with hermitian=True; got shape \(2, 3, 4\)"):
        getattr(jf.linalg, fn)(jnp.ones((2, 3, 4)), hermitian=True)


@pytest.mark.parametrize("fn", ["pinv", "matrix_rank"])
@pytest.mark.parametrize(
    "tols, error, message",
    [
        (dict(rtol=-1e-3), ValueError, r"`rtol` must be None, a number >= 0 or a real array; got -0.001"),
        (dict(atol=float("nan")), ValueError, r"`atol` must be None, a number >= 0 or a real array; got nan"),
        (dict(atol="1e-3"), TypeError, r"`atol` must be None, a number >= 0 or a real array; got '1e-3'"),
        (dict(rtol=True), TypeError, r"`rtol` must be None, .*; got True"),
        (dict(rtol=jnp.ones(2, jnp.complex64)), TypeError, r"`rtol` must be None, .*; got Array"),
        (dict(atol=jnp.ones(3)), ValueError, r"`atol` must broadcast against the batch dims of `a` \(2,\); got shape \(3,\)"),
        (dict(rtol=jnp.ones((4, 2))), ValueError, r"`rtol` must broadcast against the batch dims of `a` \(2,\); got shape \(4, 2\)"),
    ],
)
def test_bad_tolerances(fn, tols, error, message):
    with pytest.raises(error, match=rf"{fn}: {message}"):
        getattr(jf.linalg, fn)(jnp.ones((2, 3, 3)), **tols)


@pytest.mark.parametrize("shape", [(), (4,)])
def test_rank_below_two_is_rejected(shape):
    with pytest.raises(ValueError, match=r"svd: `a` must have rank >= 2, shape \(\.\.\., m, n\); got shape"):
        jf.linalg.svd(jnp.ones(shape))
    with pytest.raises(ValueError, match=r"lstsq: `a` must have rank >= 2"):
        jf.linalg.lstsq(jnp.ones(shape), jnp.ones(4))


def test_row_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"same number of rows; got `a` of shape \(5, 3\) \(5 rows\) and `b` of shape \(4,\) \(4 rows\)"):
        jf.linalg.lstsq(jnp.ones((5, 3)), jnp.ones(4))
    with pytest.raises(ValueError, match=r"`a` of shape \(2, 5, 3\).*`b` of shape \(2, 4, 1\)"):
        jf.linalg.lstsq(jnp.ones((2, 5, 3)), jnp.ones((2, 4, 1)))


def test_batch_dims_that_do_not_broadcast():
    with pytest.raises(ValueError, match=r"batch dims .* do not broadcast"):
        jf.linalg.lstsq(jnp.ones((3, 5, 2)), jnp.ones((4, 5, 1)))


def test_errors_are_raised_at_trace_time():
    with pytest.raises(TypeError, match="accepted dtypes"):
        jax.jit(jf.linalg.svd).lower(jax.ShapeDtypeStruct((3, 3), jnp.int32))
    with pytest.raises(ValueError, match="same number of rows"):
        jax.eval_shape(jf.linalg.lstsq, jax.ShapeDtypeStruct((5, 3), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))


def test_direct_bind_checks_too():
    from jaxforge.primitives.linalg import lstsq_p, svd_p

    with pytest.raises(TypeError, match="svd: `a` has dtype int32"):
        svd_p.bind(jnp.ones((2, 2), jnp.int32), full_matrices=False, compute_uv=True, grad_eps=0.0)
    with pytest.raises(TypeError, match="must share a dtype"):
        lstsq_p.bind(jnp.ones((3, 2), jnp.float32), jnp.ones((3, 1), jnp.float64), rcond=1e-6)


@pytest.mark.parametrize("grad_eps", [-1.0, float("nan"), "small", None])
def test_bad_grad_eps(grad_eps):
    with pytest.raises(ValueError, match=r"svd: `grad_eps` must be a real number >= 0"):
        jf.linalg.svd(jnp.ones((2, 2)), grad_eps=grad_eps)


@pytest.mark.parametrize("rcond", ["1e-3", float("nan"), [1e-3], True, jnp.ones(2)])
def test_bad_rcond(rcond):
    with pytest.raises(TypeError, match=r"lstsq: `rcond` must be None or a real number"):
        jf.linalg.lstsq(jnp.ones((3, 2)), jnp.ones(3), rcond=rcond)


def test_a_traced_rcond_is_refused_with_pinv_to_use():
    with pytest.raises(TypeError, match=r"lstsq: `rcond` must be None, a number or a concrete scalar array; got a traced float32\[\]: .*pinv"):
        jax.jit(lambda r: jf.linalg.lstsq(jnp.ones((3, 2)), jnp.ones(3), rcond=r))(jnp.float32(1e-3))


def test_a_concrete_grad_eps_array_is_a_number():
    a = jnp.eye(3)
    grad = lambda eps: jax.grad(lambda a: jnp.sum(jf.linalg.svd(a, grad_eps=eps)[0]))(a)  # noqa: E731  repeated values
    np.testing.assert_array_equal(grad(jnp.float32(1e-3)), grad(1e-3))
    assert np.isfinite(grad(jnp.float32(1e-3))).all()
    with pytest.raises(ValueError, match=r"svd: `grad_eps` must be a real number >= 0"):
        jax.jit(lambda e: jf.linalg.svd(a, grad_eps=e))(1e-3)


def test_a_concrete_rcond_array_is_a_number():
    a = jnp.asarray([[1.0, 0.0], [0.0, 1e-4], [0.0, 0.0]])
    for rcond in (jnp.float32(1e-3), np.float64(1e-3), np.asarray(1e-3)):
        assert int(jf.linalg.lstsq(a, jnp.ones(3), rcond=rcond).rank) == 1
    assert int(jf.linalg.lstsq(a, jnp.ones(3), rcond=jnp.float32(1e-5)).rank) == 2


def test_mixed_dtypes_promote():
    x = jf.linalg.lstsq(jnp.eye(3, dtype=jnp.float32), jnp.ones(3, jnp.complex64)).solution
    assert x.dtype == jnp.complex64


def test_mixed_dtypes_under_strict_promotion_are_refused_naming_both():
    with jax.numpy_dtype_promotion("strict"), pytest.raises(TypeError, match="lstsq: `a` has dtype float32 and `b` complex64, which strict"):
        jf.linalg.lstsq(jnp.eye(3, dtype=jnp.float32), jnp.ones(3, jnp.complex64))
