"""jf.nn.dot_product_attention against jax.nn.dot_product_attention (implementation="xla"): every
argument, values, gradients (the bias's too), jvp and the residual; its own rows that see no key, and
its errors. jax.nn rounds its softmax to float32 even for float64 input: the tolerances are float32's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf

B, T, S, N, K, H = 2, 7, 9, 4, 2, 8
TOL = dict(rtol=2e-6, atol=2e-6)


def operands(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    bias = jnp.asarray(rng.standard_normal((B, N, T, S)))
    mask = rng.random((B, 1, T, S)) < 0.7
    mask[..., 0] = True  # every row sees a key: jax.nn and jaxforge differ only where none does
    return q, k, v, bias, jnp.asarray(mask)


CASES = {  # name: keyword arguments from (bias, mask); the bias, where any, is differentiated too
    "plain": lambda bias, mask: {},
    "bias (B, N, T, S)": lambda bias, mask: dict(bias=bias),
    "bias (T, S), causal, scale": lambda bias, mask: dict(bias=bias[0, 0], is_causal=True, scale=0.3),
    "mask (B, 1, T, S)": lambda bias, mask: dict(mask=mask),
    "mask and bias (1, N, 1, S)": lambda bias, mask: dict(mask=mask, bias=bias[:1, :, :1]),
    "causal": lambda bias, mask: dict(is_causal=True),
    "window (3, 2)": lambda bias, mask: dict(local_window_size=(3, 2)),
    "window 2, causal": lambda bias, mask: dict(local_window_size=2, is_causal=True),
    "window (0, 4)": lambda bias, mask: dict(local_window_size=(0, 4)),
    "lengths": lambda bias, mask: dict(query_seq_lengths=jnp.asarray([7, 4], jnp.int32), key_value_seq_lengths=jnp.asarray([9, 3], jnp.int32)),
    "query lengths, causal, bias": lambda bias, mask: dict(query_seq_lengths=jnp.asarray([2, 6], jnp.int32), is_causal=True, bias=bias),
}


def both(kw):
    """jaxforge's and jax.nn's attention as functions of (q, k, v, bias); bias None where not asked."""
    fixed = {key: value for key, value in kw.items() if key != "bias"}
    with_bias = "bias" in kw

    def make(attend, **extra):
        return lambda q, k, v, bias: attend(q, k, v, bias if with_bias else None, **fixed, **extra)

    return make(jf.nn.dot_product_attention), make(jax.nn.dot_product_attention, implementation="xla")


@pytest.mark.parametrize("name", list(CASES))
def test_values_gradients_and_jvp_match_jax_nn(name):
    q, k, v, bias, mask = operands()
    kw = CASES[name](bias, mask)
    args = (q, k, v, kw.get("bias", bias))
    ours, theirs = both(kw)
    np.testing.assert_allclose(jax.jit(ours)(*args), theirs(*args), **TOL)
    loss = lambda attend: lambda *a: jnp.sum(jnp.sin(attend(*a)))  # noqa: E731
    argnums = (0, 1, 2, 3) if "bias" in kw else (0, 1, 2)
    for g, w in zip(jax.grad(loss(ours), argnums)(*args), jax.grad(loss(theirs), argnums)(*args)):
        np.testing.assert_allclose(g, w, **TOL)
    tangents = tuple(jnp.cos(x) for x in args)
    np.testing.assert_allclose(jax.jvp(ours, args, tangents)[1], jax.jvp(theirs, args, tangents)[1], **TOL)


def test_a_traced_scale_and_its_gradient_match_jax_nn():
    """``scale=1 / jnp.sqrt(H)`` under jit, or a learned temperature: traced, as jax.nn takes it."""
    q, k, v, bias, mask = operands()
    loss = lambda attend: lambda q, c: jnp.sum(jnp.sin(attend(q, k, v, bias, mask, scale=c)))  # noqa: E731
    ours, theirs = loss(jf.nn.dot_product_attention), loss(lambda *a, **kw: jax.nn.dot_product_attention(*a, **kw, implementation="xla"))
    np.testing.assert_allclose(jax.jit(lambda q: ours(q, 1 / jnp.sqrt(H)))(q), theirs(q, 1 / np.sqrt(H)), **TOL)
    for g, w in zip(jax.grad(ours, (0, 1))(q, 0.3), jax.grad(theirs, (0, 1))(q, 0.3)):
        np.testing.assert_allclose(g, w, **TOL)


def test_the_residual_is_jax_nns_log_sum_exp_and_unbatched_inputs_work():
    q, k, v, bias, mask = operands(1)
    out, lse = jf.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True, return_residual=True)
    want_out, want_lse = jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True, return_residual=True, implementation="xla")
    assert lse.shape == (B, T, N)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    one = jf.nn.dot_product_attention(q[0], k[0], v[0], bias[0], mask[0], local_window_size=(1, 1))
    np.testing.assert_allclose(one, jax.nn.dot_product_attention(q[0], k[0], v[0], bias[0], mask[0], local_window_size=(1, 1)), **TOL)
    assert one.shape == (T, N, H)


def test_the_triton_kernels_read_the_bias_a_score_at_a_time():
    """On the Pallas Triton kernels (interpreted here), a bias broadcast over the batch: values and
    gradients (the bias's by the kernels' atomic sums) as jax.nn's, in float32."""
    q, k, v, bias, _ = (x.astype(jnp.float32) for x in operands(4))
    ours = lambda q, bias: jf.nn.dot_product_attention(q, k, v, bias[:1], is_causal=True, implementation="pallas_triton")  # noqa: E731
    theirs = lambda q, bias: jax.nn.dot_product_attention(q, k, v, bias[:1], is_causal=True)  # noqa: E731
    np.testing.assert_allclose(ours(q, bias), theirs(q, bias), rtol=1e-5, atol=1e-5)
    loss = lambda attend: lambda *a: jnp.sum(jnp.sin(attend(*a)))  # noqa: E731
    for g, w in zip(jax.grad(loss(ours), (0, 1))(q, bias), jax.grad(loss(theirs), (0, 1))(q, bias)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_vmap_over_an_extra_axis_matches_a_loop():
    q, k, v, bias, mask = operands(2)
    attend = lambda q, k, v, bias: jf.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)  # noqa: E731
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v, bias)]
    looped = jnp.stack([attend(*(x[i] for x in stacked)) for i in range(2)])
    np.testing.assert_allclose(jax.vmap(attend)(*stacked), looped, rtol=1e-12, atol=1e-12)


def test_a_batch_split_over_an_explicit_mesh_bias_included():
    """Data parallel: q, k, v, a per-item bias and mask split along the batch over 2 devices (the
    bias gathered whole, a score mod reads it at any point): values and gradients equal one
    device's, the bias's gradient split back like the bias."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    q, k, v, bias, mask = operands(5)
    attend = lambda q, k, v, bias, mask: jf.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)  # noqa: E731
    loss = lambda *a: jnp.sum(jnp.sin(attend(*a)))  # noqa: E731
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        split = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v, bias, mask)]
        out, grads = jax.jit(attend)(*split), jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*split)
    np.testing.assert_allclose(out, attend(q, k, v, bias, mask), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, jax.grad(loss, (0, 1, 2, 3))(q, k, v, bias, mask)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)
        assert g.sharding.spec[0] == "data"


def test_a_row_that_sees_no_key_gives_zeros_and_no_gradient():
    """An item whose keys are all padding: jaxforge's output 0 and lse -inf there (jax.nn's xla
    averages the values over every key), the other item unchanged, every gradient finite."""
    q, k, v, _, _ = operands(3)
    lengths = jnp.asarray([S, 0], jnp.int32)
    attend = lambda q, k, v: jf.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, return_residual=True)  # noqa: E731
    out, lse = attend(q, k, v)
    np.testing.assert_array_equal(out[1], 0)
    assert np.isneginf(lse[1]).all()
    np.testing.assert_allclose(out[0], jax.nn.dot_product_attention(q, k, v, implementation="xla")[0], **TOL)
    grads = jax.grad(lambda *a: jnp.sum(attend(*a)[0] ** 2), (0, 1, 2))(q, k, v)
    assert all(np.isfinite(g).all() for g in grads)
    np.testing.assert_array_equal(grads[0][1], 0)


@pytest.mark.parametrize(
    "kw, error, message",
    [
        (dict(implementation="cudnn"), ValueError, r"implementation='cudnn' is jax.nn's"),
        (dict(mask=jnp.ones((B, N, T, S), jnp.float32)), TypeError, r"`mask` must be boolean .* got dtype float32"),
        (dict(bias=jnp.ones((B, N, T, S), jnp.int32)), TypeError, r"`bias` must be a float array, got dtype int32"),
        (dict(bias=jnp.ones((B, 3, T, S))), ValueError, r"`bias` must broadcast to \(B, N, T, S\) = \(2, 4, 7, 9\), at most 4-D; got shape \(2, 3, 7, 9\)"),
        (dict(mask=jnp.ones((1, B, N, T, S), bool)), ValueError, r"`mask` must broadcast to .*at most 4-D; got shape \(1, 2, 4, 7, 9\)"),
        (dict(local_window_size=(3,)), ValueError, r"`local_window_size` must be an int >= 0 or a pair \(left, right\) of them, got \(3,\)"),
        (dict(local_window_size=-1), ValueError, r"`local_window_size` must be an int >= 0"),
        (dict(key_value_seq_lengths=jnp.ones(3, jnp.int32)), ValueError, r"`key_value_seq_lengths` must be an integer array of shape \(2,\), got int32 \(3,\)"),
        (dict(query_seq_lengths=jnp.ones(2)), ValueError, r"`query_seq_lengths` must be an integer array of shape \(2,\), got float"),
        (dict(scale=-1.0), ValueError, r"`scale` must be a positive finite float, got -1.0"),
        (dict(scale=jnp.ones(3)), TypeError, r"`scale` must be a number or a concrete real scalar array, got ArrayImpl"),
    ],
)
def test_bad_arguments_name_themselves(kw, error, message):
    q, k, v, _, _ = operands()
    with pytest.raises(error, match=rf"dot_product_attention: {message}"):
        jf.nn.dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda q, k, v: (q, k.astype(jnp.float32), v), TypeError, r"query, key, value must share one dtype, got float64, float32, float64"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, r"the number of query heads must be a multiple .* got query heads 3 and key/value heads 2"),
    ],
)
def test_bad_operands_are_named_as_jax_nn_names_them(change, error, message):
    # (an integer dtype, head dims or key lengths that differ: the test suite's shape annotations
    # refuse them before the function runs; a user's call meets the same check, its names these)
    with pytest.raises(error, match=rf"dot_product_attention: {message}"):
        jf.nn.dot_product_attention(*change(*operands()[:3]))


def test_a_traced_scale_of_the_wrong_shape_is_named_by_dot_product_attention():
    q, k, v, _, _ = operands()
    with pytest.raises(TypeError, match=r"dot_product_attention: a traced `scale` must be a real scalar, got float64\[2\]"):
        jax.jit(lambda scale: jf.nn.dot_product_attention(q, k, v, scale=scale))(jnp.ones(2))


def test_an_unknown_implementation_is_named_by_dot_product_attention():
    with pytest.raises(ValueError, match=r"dot_product_attention: `implementation` must be None, one of"):
        jf.nn.dot_product_attention(*operands()[:3], implementation="flash")


def test_a_query_of_rank_five_is_refused():
    """jax.nn's ranks, 3 or 4 (vmap adds dims instead)."""
    q, k, v, _, _ = operands()
    with pytest.raises(ValueError, match=r"dot_product_attention: `query` must have shape \(B, T\|S, N\|K, H\) or \(T\|S, N\|K, H\), got shape \(1, 2, 7, 4, 8\)"):
        jf.nn.dot_product_attention(q[None], k, v)
