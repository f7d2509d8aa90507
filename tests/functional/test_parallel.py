"""jf.parallel against unsharded computations: values, gradients (grad through the collectives),
jvp, and the collectives each step compiles to, on 8 CPU devices in float64."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxforge as jf
from jaxforge.functional import parallel as par

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def mesh(n, name):
    return jax.make_mesh((n,), (name,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])


def collectives(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {k: len(re.findall(rf"\s{k}(-start)?\(", text)) for k in KINDS}


def rng_arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s)) for s in shapes]


# --- tensor-parallel MLP -----------------------------------------------------------------------


def mlp(params, x):
    w1, b1, w2, b2 = params
    return jnp.tanh(x @ w1 + b1[None]) @ w2 + b2[None]


def tp_mlp(params, x, n=4):
    """Column-parallel first layer, row-parallel second, hidden units split over "model"."""

    def local(w1, b1, w2, b2, x):
        h = jnp.tanh(par.column_parallel_linear(x, w1, b1, axis_name="model"))
        return par.row_parallel_linear(h, w2, b2, axis_name="model")

    specs = (P(None, "model"), P("model"), P("model", None), P(), P())
    return jf.shard(local, mesh=mesh(n, "model"), in_specs=specs, out_specs=P())(*params, x)


@pytest.fixture
def mlp_inputs():
    return rng_arrays((6, 8), (8,), (8, 5), (5,), (3, 6))


def test_tensor_parallel_mlp_value_and_gradient_equal_unsharded(mlp_inputs):
    *params, x = mlp_inputs
    np.testing.assert_allclose(tp_mlp(params, x), mlp(params, x), rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda params, x: jnp.sum(f(params, x) ** 2))
    got = jax.jit(jax.grad(loss(tp_mlp), argnums=(0, 1)))(params, x)
    want = jax.grad(loss(mlp), argnums=(0, 1))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)


def test_tensor_parallel_mlp_check_grads(mlp_inputs):
    *params, x = mlp_inputs
    check_grads(jax.jit(lambda *a: tp_mlp(a[:4], a[4])), (*params, x), order=2, modes=["fwd", "rev"])


def test_tensor_parallel_mlp_one_all_reduce_each_way(mlp_inputs):
    *params, x = mlp_inputs
    assert collectives(lambda p, x: tp_mlp(p, x), params, x) == {**dict.fromkeys(KINDS, 0), "all-reduce": 1}
    _, vjp = jax.vjp(lambda x: tp_mlp(params, x), x)
    out = tp_mlp(params, x)
    assert collectives(vjp, out) == {**dict.fromkeys(KINDS, 0), "all-reduce": 1}  # dx: copy_to's all-reduce


# --- sequence-parallel norm ---------------------------------------------------------------------


def test_sequence_parallel_rms_norm_gradient_of_the_replicated_scale():
    x, scale = rng_arrays((2, 16, 4), (4,))
    local = lambda x, scale: par.sequence_parallel_rms_norm(x, scale)
    sharded = jf.shard(local, mesh=mesh(8, "seq"), in_specs=(P(None, "seq"), P()), out_specs=P(None, "seq"))
    np.testing.assert_allclose(sharded(x, scale), local(x, scale), rtol=1e-12)
    loss = lambda f: (lambda x, s: jnp.sum(jnp.sin(f(x, s))))
    grad = lambda f: jax.jit(jax.grad(loss(f), (0, 1)))  # noqa: E731
    for g, w in zip(grad(sharded)(x, scale), grad(local)(x, scale)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)  # not multiplied by the 8 shards


# --- ring attention -----------------------------------------------------------------------------

RING_CASES = [(2, False, False), (2, True, False), (4, True, True)]  # (devices, causal, load_balanced)


def ring(n, causal, balanced, sinks=None, mask=None, attend=par.ring_attention):
    inner = lambda q, k, v: attend(q, k, v, axis_name="ctx", causal=causal, mask=mask, load_balanced=balanced, sinks=sinks)
    sharded = jf.shard(inner, mesh=mesh(n, "ctx"), in_specs=P(None, "ctx"), out_specs=P(None, "ctx"))
    if not balanced:
        return sharded
    return lambda q, k, v: par.unbalance(sharded(*(par.load_balance(x, n) for x in (q, k, v))), n)


def dense(causal):
    return lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal() if causal else None)


@pytest.mark.parametrize("n,causal,balanced", RING_CASES)
def test_ring_attention_value_grad_and_jvp(n, causal, balanced):
    q, k, v = rng_arrays((2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 6))  # GQA, Dv != D
    f, ref = jax.jit(ring(n, causal, balanced)), dense(causal)
    np.testing.assert_allclose(f(q, k, v), ref(q, k, v), rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda *a: jnp.sum(f(*a) ** 2))
    for g, w in zip(jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)
    tangents = tuple(rng_arrays(q.shape, k.shape, v.shape, seed=1))
    np.testing.assert_allclose(jax.jvp(f, (q, k, v), tangents)[1], jax.jvp(ref, (q, k, v), tangents)[1], atol=1e-11)


# (devices, load_balanced, mask, causal): the mask over global positions, shifted to each pair of chunks
_ring_tables = np.random.default_rng(3)
RING_MASKS = {  # name: (devices, load balanced, mask over the global positions, causal)
    "window&causal": (2, True, jf.masks.sliding_window(5), True),  # pairs of chunks hidden
    "prefix": (2, False, jf.masks.prefix_lm(11), False),
    "mask_mod": (4, False, lambda b, h, i, j: (i - j) % 3 == 0, False),  # read at shifted indices, no span
    # per-position arrays, the whole sequence's on every device: each pair of chunks slices them
    "document": (2, False, jf.masks.document(jnp.asarray(np.sort(_ring_tables.integers(0, 5, (2, 32)), axis=-1))), True),
    "array": (2, False, jf.masks.from_array(jnp.asarray(_ring_tables.random((2, 1, 32, 32)) < 0.4)), False),
}


@pytest.mark.parametrize("name", sorted(RING_MASKS))
def test_ring_attention_under_a_mask_value_and_grad(name):
    """(The jvp is attention's through the same calls and merges, tested above.)"""
    n, balanced, mask, causal = RING_MASKS[name]
    q, k, v = rng_arrays((2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 6))
    whole = jf.masks.as_mask(mask) & jf.masks.causal() if causal else mask
    f, ref = jax.jit(ring(n, causal, balanced, mask=mask)), lambda q, k, v: jf.attention(q, k, v, mask=whole)
    np.testing.assert_allclose(f(q, k, v), ref(q, k, v), rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda *a: jnp.sum(f(*a) ** 2))
    for g, w in zip(jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)


SCORED = {  # name: (attend, devices, causal, load balanced, mask over the global positions, softcap)
    "ring_causal_balanced": (par.ring_attention, 4, True, True, None, 3.0),  # the three calls of a step, head and tail positions
    "ring_balanced": (par.ring_attention, 2, False, True, None, None),  # one call a step, positions still head–tail
    "ring_contiguous_causal": (par.ring_attention, 4, True, False, None, None),
    "ring_window": (par.ring_attention, 2, True, True, jf.masks.sliding_window(9), 2.0),  # chunk pairs, each shifted
    "gathered_balanced": (par.all_gather_attention, 2, False, True, None, 3.0),
    "gathered_document": (par.all_gather_attention, 2, False, False, RING_MASKS["document"][2], None),
}


def relative_bias(table, length):
    """A learned bias per head and query–key distance (T5's, unbucketed), and ALiBi's slope."""
    return lambda s, b, h, i, j: s + table[h, i - j + length - 1] - 0.25 * (h + 1) * jnp.abs(i - j)


@pytest.mark.parametrize("name", sorted(SCORED))
def test_context_parallel_attention_with_a_score_mod_reads_global_positions(name):
    """Values and the gradients of q, k, v and of the bias table (summed over the devices) equal
    one device's attention of the whole sequence."""
    attend, n, causal, balanced, mask, softcap = SCORED[name]
    q, k, v, table = rng_arrays((2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 6), (4, 63))

    def inner(q, k, v, table):
        score_mod = relative_bias(table, 32)
        return attend(q, k, v, axis_name="ctx", causal=causal, mask=mask, score_mod=score_mod, softcap=softcap, load_balanced=balanced)

    seq = P(None, "ctx")
    sharded = jf.shard(inner, mesh=mesh(n, "ctx"), in_specs=(seq, seq, seq, P()), out_specs=seq)
    if balanced:
        f = lambda q, k, v, t: par.unbalance(sharded(*(par.load_balance(x, n) for x in (q, k, v)), t), n)
    else:
        f = sharded
    whole = jf.masks.causal() if causal else None
    whole = mask if whole is None else whole if mask is None else jf.masks.as_mask(mask) & whole
    ref = lambda q, k, v, t: jf.attention(q, k, v, mask=whole, score_mod=relative_bias(t, 32), softcap=softcap)
    np.testing.assert_allclose(jax.jit(f)(q, k, v, table), ref(q, k, v, table), rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
    got, want = jax.jit(jax.grad(loss(f), (0, 1, 2, 3)))(q, k, v, table), jax.grad(loss(ref), (0, 1, 2, 3))(q, k, v, table)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)


def test_a_score_mods_table_gets_its_gradient_in_one_all_reduce_after_the_ring():
    """Not one in each step's branch: devices take different branches of a causal step, and an
    all-reduce in one of them would wait on the devices that took another."""
    q, table = rng_arrays((1, 32, 2, 4), (2, 63))
    inner = lambda q, t: par.ring_attention(q, q, q, axis_name="ctx", causal=True, score_mod=relative_bias(t, 32))
    f = jf.shard(inner, mesh=mesh(2, "ctx"), in_specs=(P(None, "ctx"), P()), out_specs=P(None, "ctx"))
    grad = collectives(jax.grad(lambda q, t: jnp.sum(f(q, t)), (0, 1)), q, table)
    assert grad["all-reduce"] == 1 and grad["all-gather"] == grad["reduce-scatter"] == 0


UNEQUAL = {  # name: (attend, causal, load balanced, with a score_mod)
    "ring_causal": (par.ring_attention, True, False, False),
    "ring_causal_bias_balanced": (par.ring_attention, True, True, True),
    "ring_bias_balanced": (par.ring_attention, False, True, True),  # the unmasked ring: keys at their own chunks' positions
    "gathered_causal_bias_balanced": (par.all_gather_attention, True, True, True),
}


@pytest.mark.parametrize("name", sorted(UNEQUAL))
def test_chunks_of_queries_and_keys_of_unequal_lengths(name):
    """16 queries against 32 keys over 2 devices: a device's 8 queries meet chunks of 16 keys, each
    at its own global positions (a causal ring was top-left aligned on the local chunks)."""
    attend, causal, balanced, biased = UNEQUAL[name]
    q, k, v, table = rng_arrays((2, 16, 4, 8), (2, 32, 2, 8), (2, 32, 2, 6), (4, 48))
    score_mod = (lambda t: relative_bias(t, 32)) if biased else (lambda t: None)
    inner = lambda q, k, v, t: attend(q, k, v, axis_name="ctx", causal=causal, score_mod=score_mod(t), load_balanced=balanced)
    seq = P(None, "ctx")
    sharded = jf.shard(inner, mesh=mesh(2, "ctx"), in_specs=(seq, seq, seq, P()), out_specs=seq)
    layout, restore = (lambda x: par.load_balance(x, 2), lambda x: par.unbalance(x, 2)) if balanced else (lambda x: x, lambda x: x)
    f = lambda q, k, v, t: restore(sharded(layout(q), layout(k), layout(v), t))
    ref = lambda q, k, v, t: jf.attention(q, k, v, mask=jf.masks.causal() if causal else None, score_mod=score_mod(t))
    np.testing.assert_allclose(jax.jit(f)(q, k, v, table), ref(q, k, v, table), rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
    got, want = jax.jit(jax.grad(loss(f), (0, 1, 2, 3)))(q, k, v, table), jax.grad(loss(ref), (0, 1, 2, 3))(q, k, v, table)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("attend", [par.ring_attention, par.all_gather_attention])
def test_bad_operands_are_refused_by_name(attend):
    q, k = jnp.zeros((1, 8, 4, 8)), jnp.zeros((1, 8, 2, 4))
    sharded = jf.shard(lambda q, k: attend(q, k, k, axis_name="ctx"), mesh=mesh(2, "ctx"), in_specs=P(None, "ctx"), out_specs=P(None, "ctx"))
    with pytest.raises(ValueError, match=rf"{attend.__name__}: q and k must share head_dim, got q \(1, 4, 4, 8\) and k \(1, 4, 2, 4\)"):
        sharded(q, k)


@pytest.mark.parametrize("attend", [par.ring_attention, par.all_gather_attention])
@pytest.mark.parametrize("kw, message", [(dict(scale=0.0), r"`scale` must be a positive finite float, got 0.0"), (dict(softcap=-2), r"`softcap` must be a positive finite float, got -2.0")])
def test_bad_scalars_are_refused_by_name(attend, kw, message):
    q = jnp.zeros((1, 8, 2, 4))
    sharded = jf.shard(lambda q: attend(q, q, q, axis_name="ctx", **kw), mesh=mesh(2, "ctx"), in_specs=P(None, "ctx"), out_specs=P(None, "ctx"))
    with pytest.raises(ValueError, match=rf"{attend.__name__}: {message}"):
        sharded(q)


@pytest.mark.parametrize("attend", [par.ring_attention, par.all_gather_attention])
def test_a_load_balanced_layout_needs_an_even_local_length(attend):
    q = jnp.zeros((1, 6, 2, 4))
    inner = lambda q: attend(q, q, q, axis_name="ctx", score_mod=lambda s, b, h, i, j: s * (i >= j))
    sharded = jf.shard(inner, mesh=mesh(2, "ctx"), in_specs=P(None, "ctx"), out_specs=P(None, "ctx"))
    with pytest.raises(ValueError, match=rf"{attend.__name__}: a load-balanced mask or score_mod needs even local lengths .* got q \(1, 3, 2, 4\) and k \(1, 3, 2, 4\)"):
        sharded(q)


def test_ring_attention_joins_sinks_once():
    q, k, v = rng_arrays((2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 6))
    sinks = jnp.asarray([0.5, -1.0, 2.0, -jnp.inf])  # the last head has none
    got = jax.jit(ring(4, True, True, sinks))(q, k, v)
    np.testing.assert_allclose(got, jf.attention(q, k, v, mask=jf.masks.causal(), sinks=sinks), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[..., 3, :], jf.attention(q, k, v, mask=jf.masks.causal())[..., 3, :], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("attend", [par.ring_attention, par.all_gather_attention])
def test_the_lse_of_the_local_queries_sinks_included(attend):
    """``return_lse``: each device's rows' log-sum-exp, as one device's jf.attention gives it for
    the whole sequence; gradients through out and lse alike."""
    q, k, v = rng_arrays((2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 6))
    sinks = jnp.asarray([0.5, -1.0, 2.0, -jnp.inf])
    inner = lambda q, k, v: attend(q, k, v, axis_name="ctx", causal=True, sinks=sinks, return_lse=True)
    sharded = jf.shard(inner, mesh=mesh(4, "ctx"), in_specs=P(None, "ctx"), out_specs=(P(None, "ctx"), P(None, "ctx")))
    f = lambda q, k, v: jax.tree.map(lambda x: par.unbalance(x, 4, axis=1), sharded(*(par.load_balance(x, 4) for x in (q, k, v))))
    ref = lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal(), sinks=sinks, return_lse=True)
    for g, w in zip(jax.jit(f)(q, k, v), ref(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda *a: (lambda out, lse: jnp.sum(out**2) + jnp.sum(jnp.sin(lse)))(*f(*a)))
    for g, w in zip(jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)


MAXIMA = {  # name: (attend, devices, causal, load balanced, mask over the global positions)
    "ring causal balanced": (par.ring_attention, 4, True, True, None),  # the causal ring's branches
    "ring causal contiguous": (par.ring_attention, 2, True, False, None),  # its `later`: nothing visible
    "ring window": (par.ring_attention, 2, True, True, jf.masks.sliding_window(5)),  # the masked ring
    "ring unmasked": (par.ring_attention, 2, False, False, None),
    "gather window": (par.all_gather_attention, 4, True, True, jf.masks.sliding_window(5)),
    "gather unmasked": (par.all_gather_attention, 2, False, False, None),
}


@pytest.mark.parametrize("name", list(MAXIMA))
def test_the_largest_scores_of_the_local_queries(name):
    """``return_max_scores`` (with ``return_lse``): each device's rows' largest scores as one
    device's jf.attention gives them, the steps' and chunks' merged by their maximum; the gradient
    of a loss of the maxima (and of out and lse) equals one device's."""
    attend, n, causal, balanced, mask = MAXIMA[name]
    q, k, v = rng_arrays((2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 6))
    inner = lambda q, k, v: attend(  # noqa: E731
        q, k, v, axis_name="ctx", causal=causal, mask=mask, load_balanced=balanced, return_lse=True, return_max_scores=True
    )
    sharded = jf.shard(inner, mesh=mesh(n, "ctx"), in_specs=P(None, "ctx"), out_specs=(P(None, "ctx"),) * 3)
    if balanced:
        f = lambda q, k, v: jax.tree.map(lambda x: par.unbalance(x, n, axis=1), sharded(*(par.load_balance(x, n) for x in (q, k, v))))  # noqa: E731
    else:
        f = sharded
    whole = None if mask is None and not causal else jf.masks.causal() if mask is None else jf.masks.as_mask(mask) & jf.masks.causal()
    ref = lambda q, k, v: jf.attention(q, k, v, mask=whole, return_lse=True, return_max_scores=True)  # noqa: E731
    got, want = jax.jit(f)(q, k, v), ref(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda *a: (lambda out, lse, top: jnp.sum(out**2) + jnp.sum(jnp.sin(lse)) + jnp.sum(top**2))(*f(*a)))  # noqa: E731
    for g, w in zip(jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)


def test_ring_attention_check_grads():
    # First order: second derivatives of attention run its dense reference rules (tested there).
    q, k, v = rng_arrays((1, 8, 2, 4), (1, 8, 2, 4), (1, 8, 2, 4))
    check_grads(jax.jit(ring(2, True, True)), (q, k, v), order=1, modes=["fwd", "rev"])


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_communication(n):
    q, k, v = rng_arrays((1, 8 * n, 2, 4), (1, 8 * n, 2, 4), (1, 8 * n, 2, 4))
    inner = lambda q, k, v: par.ring_attention(q, k, v, axis_name="ctx", causal=True)
    f = jf.shard(inner, mesh=mesh(n, "ctx"), in_specs=P(None, "ctx"), out_specs=P(None, "ctx"))
    # n - 1 ring steps, each moving k and v (XLA may fuse the two into one permute of a tuple).
    fwd = collectives(f, q, k, v)
    assert fwd["collective-permute"] in (n - 1, 2 * (n - 1)) and sum(fwd.values()) == fwd["collective-permute"]
    grad = collectives(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2)), q, k, v)
    assert grad["all-reduce"] == grad["all-gather"] == grad["all-to-all"] == 0  # only the ring and its reverse


GATHERED = {  # name: (devices, causal, load balanced, mask over the global positions, sinks)
    "unmasked": (2, False, False, None, None),
    "causal_balanced_sinks": (4, True, True, None, jnp.asarray([0.5, -1.0, 2.0, -jnp.inf])),
    "window": (4, False, False, jf.masks.causal() & jf.masks.sliding_window(7), None),
    "document&causal_balanced": (2, True, True, RING_MASKS["document"][2], None),
    "array": (2, False, True, RING_MASKS["array"][2], None),
}


@pytest.mark.parametrize("name", sorted(GATHERED))
def test_all_gather_attention_value_and_grad(name):
    n, causal, balanced, mask, sinks = GATHERED[name]
    q, k, v = rng_arrays((2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 6))
    whole = jf.masks.causal() if causal and mask is None else jf.masks.as_mask(mask) & jf.masks.causal() if causal else mask
    f = jax.jit(ring(n, causal, balanced, sinks, mask, attend=par.all_gather_attention))
    ref = lambda q, k, v: jf.attention(q, k, v, mask=whole, sinks=sinks)
    np.testing.assert_allclose(f(q, k, v), ref(q, k, v), rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda *a: jnp.sum(f(*a) ** 2))
    for g, w in zip(jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)


def test_all_gather_attention_communication():
    """The forward gathers k and v (XLA may fuse the two) and permutes nothing; the backward sums
    their gradients back to the shards."""
    q, k, v = rng_arrays((1, 32, 2, 4), (1, 32, 2, 4), (1, 32, 2, 4))
    inner = lambda q, k, v: par.all_gather_attention(q, k, v, axis_name="ctx", causal=True)
    f = jf.shard(inner, mesh=mesh(4, "ctx"), in_specs=P(None, "ctx"), out_specs=P(None, "ctx"))
    fwd = collectives(f, q, k, v)
    assert fwd["all-gather"] in (1, 2) and sum(fwd.values()) == fwd["all-gather"]
    grad = collectives(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2)), q, k, v)
    assert grad["collective-permute"] == 0 and grad["reduce-scatter"] + grad["all-reduce"] >= 1


def test_load_balance_round_trip_and_layout():
    x = jnp.arange(16.0).reshape(1, 16, 1, 1)
    lb = par.load_balance(x, 4)
    assert lb[0, :, 0, 0].tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    np.testing.assert_array_equal(par.unbalance(lb, 4), x)
    for fn in (par.load_balance, par.unbalance):
        with pytest.raises(ValueError, match=rf"{fn.__name__}: `x` of shape \(1, 12, 1, 1\) .* multiple of 2 \* num_shards = 8"):
            fn(x[:, :12], 4)
        with pytest.raises(ValueError, match=rf"{fn.__name__}: `num_shards` must be a positive int, got 0"):
            fn(x, 0)


def test_merge_attention_of_two_halves_is_attention_of_the_whole():
    q, k, v = rng_arrays((1, 5, 2, 4), (1, 9, 2, 4), (1, 9, 2, 3))
    a = jf.attention(q, k[:, :4], v[:, :4], return_lse=True)
    b = jf.attention(q, k[:, 4:], v[:, 4:], return_lse=True)
    out, lse = par.merge_attention(*a, *b)
    want_out, want_lse = jf.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)
    empty = (jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf))
    out, lse = par.merge_attention(*empty, *empty)
    assert not np.isnan(out).any() and np.all(lse == -np.inf)
