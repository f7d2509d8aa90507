"""jaxforge under JAX's debugging switches: ``jax.disable_jit``, ``jax_debug_nans``/``infs``,
strict dtype promotion, ``jax.checking_leaks``, ``jax.enable_checks`` (implicit rank promotion is
an error in the whole suite: conftest).

A user debugging a training step turns these on around code that calls jaxforge; its primitives
must behave there as JAX's own do: run (compiled) under ``disable_jit``, and name themselves as the
operation that produced a NaN instead of recursing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxforge as jf

RNG = np.random.default_rng(0)
Q = RNG.normal(size=(2, 48, 4, 8))
KV = RNG.normal(size=(2, 48, 2, 8))
A = RNG.normal(size=(3, 7, 4))
B = RNG.normal(size=(3, 7, 2))


def _sinks_and_window(b, h, q_idx, kv_idx):
    return (kv_idx < 2) | ((q_idx - kv_idx < 8) & (kv_idx <= q_idx))


CALLS = {
    "attention causal grad": lambda: jax.grad(lambda q: jf.attention(q, KV, KV, mask=jf.masks.causal()).sum())(Q),
    "attention block mask in pieces": lambda: jf.attention(Q, KV, KV, mask=jf.masks.block_mask(_sinks_and_window, 48, 48, ranges=2)),
    "attention jvp": lambda: jax.jvp(lambda q: jf.attention(q, KV, KV, mask=jf.masks.sliding_window(4)), (Q,), (Q,)),
    "lstsq grad": lambda: jax.grad(lambda a: jf.linalg.lstsq(a, B).solution.sum())(A),
    "svd jvp": lambda: jax.jvp(jf.linalg.svd, (A,), (A,)),
    "transformer": lambda: jf.nn.transformer(
        jf.nn.init_transformer(jax.random.key(0), vocab_size=16, features=16, depth=1, num_heads=2), jnp.zeros((2, 8), jnp.int32), mask=jf.masks.causal()
    ),
}


AC, BC = A + 1j * RNG.normal(size=A.shape), B + 1j * RNG.normal(size=B.shape)
X, IDS = RNG.normal(size=(2, 8, 16)), np.sort(RNG.integers(0, 2**40, (2, 48)), axis=-1)


def _per_item_masks():
    """Every mask of per-item arrays, their int64 values (x64) beyond int32 some of them."""
    per_item = lambda *values: jnp.asarray(values, jnp.int64)  # noqa: E731
    mask = (jf.masks.causal(per_item(3, -2)) & jf.masks.sliding_window(per_item(0, 9))) | jf.masks.prefix_lm(per_item(5, 2**40))
    mask = mask & jf.masks.padding(per_item(40, 2**40), per_item(30, 48)) & jf.masks.chunked(per_item(16, 2**40))
    return jf.masks.shifted(mask, per_item(4, 0), 2)


def _layers_in_float64():
    norms = jf.nn.rms_norm(jf.nn.init_rms_norm(16, dtype=jnp.float64), X), jf.nn.layer_norm(jf.nn.init_layer_norm(16, dtype=jnp.float64), X)
    rotated = jf.nn.rotary_embedding(X.reshape(2, 8, 2, 8), jnp.arange(8))
    return *norms, rotated, jf.nn.cross_entropy(X, jnp.arange(16).reshape(2, 8), where=X[..., 0] > 0)


def _queries_split_along_the_sequence():
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    attend = lambda q, k: jf.attention(q, k, k, mask=jf.masks.prefix_lm(jnp.asarray([3, 30])) & jf.masks.causal()).sum()  # noqa: E731
    with jax.set_mesh(mesh):
        q, kv = jax.device_put(Q, P("data", "seq")), jax.device_put(KV, P("data"))
        return jax.jit(jax.grad(attend))(q, kv)


# Calls whose library code mixes dtypes where a careless one would: complex with real parts, a
# mask's int64 arrays with int32 positions, norms widened to float32 or beyond.
STRICT_CALLS = CALLS | {
    "complex lstsq grad": lambda: jax.grad(lambda a: jnp.abs(jf.linalg.lstsq(a, BC).solution).sum())(AC),
    "complex svd jvp": lambda: jax.jvp(jf.linalg.svd, (AC,), (AC,)),
    "complex polar grad": lambda: jax.grad(lambda a: jnp.abs(jf.linalg.polar(a, "left")[1]).sum())(AC),
    "attention per-item masks grad": lambda: jax.grad(lambda q: jf.attention(q, KV, KV, mask=_per_item_masks()).sum())(Q),
    "attention document of int64 ids": lambda: jf.attention(Q, KV, KV, mask=jf.masks.document(IDS) & jf.masks.causal()),
    "layers in float64": _layers_in_float64,
    "attention of queries split along the sequence": _queries_split_along_the_sequence,
}


@pytest.mark.parametrize("name", sorted(STRICT_CALLS))
def test_runs_unchanged_under_strict_dtype_promotion(name):
    jax.clear_caches()  # so that the call traces again, under the switch
    with jax.numpy_dtype_promotion("strict"):
        got = STRICT_CALLS[name]()
    expected = STRICT_CALLS[name]()
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_runs_under_disable_jit_as_compiled(name):
    expected = CALLS[name]()
    with jax.disable_jit():
        got = CALLS[name]()
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("switch", ["checking leaks", "enable checks"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_runs_unchanged_under_checks(name, switch):
    context = {
        "checking leaks": jax.checking_leaks,
        "enable checks": lambda: jax.enable_checks(True),
    }[switch]
    jax.clear_caches()  # so that the call traces again, under the switch
    with context():
        got = CALLS[name]()
    expected = CALLS[name]()
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_debug_nans_stays_quiet_on_finite_results(name):
    with jax.debug_nans(True):
        CALLS[name]()


def test_debug_nans_names_the_primitive():
    # Made before the switch: under it, JAX refuses even to put a NaN on the device.
    a, q = jnp.asarray(A).at[0, 0, 0].set(np.nan), jnp.where(Q > 2, np.nan, Q)
    with jax.debug_nans(True), pytest.raises(FloatingPointError, match=r"invalid value \(nan\) encountered in jaxforge_svd"):
        jf.linalg.svd(a)
    with jax.debug_nans(True), pytest.raises(FloatingPointError, match="jaxforge_attention_fwd"):
        jax.jit(lambda q: jf.attention(q, KV, KV))(q)


def test_debug_infs_names_the_empty_rows_log_sum_exp():
    # A row that sees no key has the log-sum-exp -inf (the merge of partial results reads it so).
    with jax.debug_infs(True), pytest.raises(FloatingPointError, match=r"invalid value \(inf\) encountered in jaxforge_attention_fwd"):
        jf.attention(Q, KV, KV, mask=lambda b, h, q_idx, kv_idx: q_idx > 3)
