"""``jf.attention(..., return_max_scores=True)``: each row's largest score, kept by the forward's
online softmax, and its derivative (the score's at the first key attaining it).

Values against the float64 numpy attention of test_attention (``dense``), derivatives against
jnp.max of the dense scores (``dense_jnp``) and by finite differences (``check_grads``); masks whose
rows see nothing, pieces merged, sinks (not keys), vmap, jit and the batch split over devices.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxforge as jf
from jaxforge.functional.attention import Implementation
from jaxforge.primitives.attention.attention import attention_fwd_p
from tests.attention_dense import dense_jnp
from tests.primitives.attention.test_attention import (
    B,
    D,
    DTOL,
    DV,
    HKV,
    HQ,
    IMPLEMENTATIONS,
    REL_BIAS,
    SKV,
    SQ,
    _impl_id,
    _score_cases,
    allowed,
    assert_close,
    dense,
    mask_case,
    qkv,
)

masks = jf.masks
# Triton's kernels in interpret mode; split-KV's splits (some seeing no key) merge their maxima
PALLAS = Implementation("pallas_triton", block_q=8, block_kv=16)
SPLIT = Implementation("pallas_triton", block_q=8, block_kv=8, pack_gqa=True, kv_splits=3)
over_impls = pytest.mark.parametrize("impl", [*IMPLEMENTATIONS[1:], PALLAS, SPLIT], ids=lambda i: _impl_id(i) + ("-split" if i.kv_splits else ""))

# Masks whose rows see nothing (per-item offsets, item 0's padded queries), cut in pieces merged
# through their lse, arrays, functions and documents.
MASKS = [
    "full",
    "causal_per_item_offsets",
    "document_cross_batched",
    "padding_q_and_kv_per_item_and_causal",
    "block_mask_pieces_and_causal",
    "array_per_item_and_head",
    "sink_or_lambda_and_window",
]


def _finite(x):
    return jnp.where(jnp.isfinite(x), x, 0)


@over_impls
@pytest.mark.parametrize("name", MASKS)
def test_max_scores_match_dense_under_masks(impl, name):
    (sq, skv), mask, mask_fn, rng = mask_case(name)
    q, k, v = qkv(rng, (B,), sq, skv, HQ, HKV, D, DV)
    out, lse, top = jf.attention(q, k, v, mask=mask, return_lse=True, return_max_scores=True, implementation=impl)
    out_np, lse_np, top_np = dense(q, k, v, mask_fn, max_scores=True)
    assert top.shape == (B, sq, HQ) and top.dtype == np.float64
    hidden = np.swapaxes(~allowed(mask_fn, B, HQ, sq, skv).any(-1), 1, 2)
    np.testing.assert_array_equal(np.asarray(top)[hidden], -np.inf)  # a row that sees nothing
    assert_close(top, top_np)
    assert_close(out, out_np)  # the call's other results are those of a call without it
    assert_close(lse, lse_np)
    assert (np.asarray(top)[~hidden] <= np.asarray(lse)[~hidden]).all()


@over_impls
@pytest.mark.parametrize("name", list(_score_cases()))
def test_max_scores_are_of_the_modified_scores(impl, name):
    """After scale, softcap and score_mod: the logits entering the softmax."""
    score_mod, score_fn, softcap, mask, mask_fn, scale = _score_cases()[name]
    q, k, v = qkv(np.random.default_rng(1), (B,), SQ, SKV, HQ, HKV, D, DV)
    q = 3 * q
    top = jf.attention(q, k, v, mask=mask, score_mod=score_mod, softcap=softcap, scale=scale, return_max_scores=True, implementation=impl)[1]
    assert_close(top, dense(q, k, v, mask_fn, score_fn, scale=scale, softcap=softcap, max_scores=True)[2])


def test_max_scores_leave_out_the_sinks():
    q, k, v = qkv(np.random.default_rng(2), (B,), SQ, SKV, HQ, HKV, D, DV)
    sinks = jnp.asarray([30.0, -1.0, 2.0, 0.5])  # the first above every score
    out, top = jf.attention(q, k, v, mask=masks.causal(), sinks=sinks, return_max_scores=True)
    assert_close(top, dense(q, k, v, lambda b, h, i, j: j <= i, max_scores=True)[2])
    assert_close(out, jf.attention(q, k, v, mask=masks.causal(), sinks=sinks))


def _bias_case(seed):
    q, k, v = qkv(np.random.default_rng(seed), (B,), SQ, SKV, HQ, HKV, D, DV)
    bias = jnp.asarray(REL_BIAS)
    score_mod = lambda bias: lambda s, b, h, i, j: s + jnp.asarray(bias)[h, i - j + SKV]  # noqa: E731
    return q, k, v, bias, score_mod


@over_impls
def test_max_score_derivatives_match_jnp_max_of_the_dense_scores(impl):
    """jvp and grad in q, k and a captured bias table, the other outputs' cotangents beside them."""
    q, k, v, bias, score_mod = _bias_case(3)
    visible = allowed(lambda b, h, i, j: j <= i + 3, B, HQ, SQ, SKV)
    ours = lambda q, k, v, bias: jf.attention(  # noqa: E731
        q, k, v, mask=masks.causal(3), score_mod=score_mod(bias), return_lse=True, return_max_scores=True, implementation=impl
    )
    theirs = lambda q, k, v, bias: dense_jnp(q, k, v, visible, score_mod(bias), max_scores=True)  # noqa: E731
    args = (q, k, v, bias)
    tangents = (*qkv(np.random.default_rng(4), (B,), SQ, SKV, HQ, HKV, D, DV), jnp.asarray(np.random.default_rng(5).standard_normal(bias.shape)))
    (_, got), (_, want) = jax.jvp(ours, args, tangents), jax.jvp(theirs, args, tangents)
    for g, w in zip(got, want):
        assert_close(g, w, **DTOL)
    w = [np.random.default_rng(6 + i).standard_normal(x.shape) for i, x in enumerate(got)]
    loss = lambda fn: lambda *a: sum(jnp.sum(_finite(x) * c) for x, c in zip(fn(*a), w))  # noqa: E731
    for g, want in zip(jax.grad(loss(ours), (0, 1, 2, 3))(*args), jax.grad(loss(theirs), (0, 1, 2, 3))(*args)):
        assert_close(g, want, **DTOL)


@over_impls
def test_max_scores_check_grads_order_2(impl):
    q, k, v, bias, score_mod = _bias_case(7)
    f = lambda q, k, bias: jf.attention(  # noqa: E731
        q, k, v, mask=masks.sliding_window(9), score_mod=score_mod(bias), softcap=2.0, return_max_scores=True, implementation=impl
    )[1]
    check_grads(f, (q, k, bias), order=2, modes=("fwd", "rev"))


def test_rows_that_see_nothing_have_zero_derivatives():
    q, k, v = qkv(np.random.default_rng(8), (B,), 13, 13, HQ, HKV, D, DV)
    top_of = lambda q, k: jf.attention(q, k, v, mask=masks.causal(-5), return_max_scores=True)[1]  # noqa: E731
    top, dtop = jax.jvp(top_of, (q, k), (q, k))
    np.testing.assert_array_equal(np.asarray(top)[:, :5], -np.inf)
    np.testing.assert_array_equal(np.asarray(dtop)[:, :5], 0.0)
    gq, gk = jax.grad(lambda q, k: jnp.sum(_finite(top_of(q, k))), (0, 1))(q, k)
    np.testing.assert_array_equal(np.asarray(gq)[:, :5], 0.0)
    assert np.isfinite(gq).all() and np.isfinite(gk).all()


ARGMAX = r"stablehlo\.reduce\(%[\w#]+ init: %[\w#]+\), \(%[\w#]+ init"  # a reduce of values and indices


@pytest.mark.parametrize("impl", [Implementation("xla"), PALLAS], ids=_impl_id)
def test_first_keys_are_sought_only_where_a_derivative_of_the_maxima_reads_them(impl):
    """The forward finds the first key attaining each row's maximum (an argmax a tile) for the
    maxima's JVP alone: after jit's dead-code elimination a forward, QK-clip's training step (a
    gradient whose maxima are auxiliary) and a jvp of the output bind a forward without it (the
    last two without the maxima either where nothing reads them), a derivative of the maxima one
    with it."""
    q, k, v, _, _ = _bias_case(12)
    attend = lambda q, k, v: jf.attention(q, k, v, mask=masks.causal(), return_max_scores=True, implementation=impl)  # noqa: E731

    def clip_step(q, k, v):
        out, top = attend(q, k, v)
        return jnp.sum(out), top.max(axis=(0, 1))

    programs = {  # (max_scores, first_keys) of the forward each binds (None: no forward)
        "nothing of it": (lambda *a: (attend(*a), jnp.sum(a[0]))[1], None),
        "forward": (attend, (True, False)),
        "its output alone": (lambda *a: attend(*a)[0], (False, False)),
        "grad, maxima auxiliary": (jax.grad(clip_step, (0, 1, 2), has_aux=True), (True, False)),
        "jvp of the output": (lambda *a: jax.jvp(attend, a, a)[1][0], (False, False)),
        "jvp": (lambda *a: jax.jvp(attend, a, a), (True, True)),
        "grad of the maxima": (jax.grad(lambda *a: jnp.sum(_finite(attend(*a)[1])), (0, 1)), (True, True)),
    }
    for name, (f, want) in programs.items():
        jaxpr = jax.make_jaxpr(f)(q, k, v).jaxpr
        kept, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
        bound = [(e.params["max_scores"], e.params["first_keys"]) for e in kept.eqns if e.primitive is attention_fwd_p]
        assert bound == ([] if want is None else [want]), name
        assert bool(re.search(ARGMAX, jax.jit(f).lower(q, k, v).as_text())) is bool(want and want[1]), name


@pytest.mark.parametrize("shape", [(B, 5, 0, 2, 1), (B, 0, 7, 2, 1), (0, 5, 7, 2, 1)], ids=["no_keys", "no_queries", "no_items"])
def test_empty_calls(shape):
    bsz, sq, skv, hq, hkv = shape
    q, k, v = qkv(np.random.default_rng(9), (bsz,), sq, skv, hq, hkv, 4, 3)
    top_of = lambda q, k: jf.attention(q, k, v, mask=masks.causal(), return_max_scores=True)[1]  # noqa: E731
    top, dtop = jax.jvp(top_of, (q, k), (q, k))
    assert top.shape == (bsz, sq, hq)
    np.testing.assert_array_equal(top, -np.inf)
    np.testing.assert_array_equal(dtop, 0.0)
    np.testing.assert_array_equal(jax.grad(lambda q: jnp.sum(_finite(top_of(q, k))))(q), 0.0)


def test_vmap_matches_a_loop_and_jit_matches_eager():
    q, k, v, _, score_mod = _bias_case(10)
    tables = jnp.asarray(np.random.default_rng(11).standard_normal((3, *REL_BIAS.shape)))
    top_of = lambda bias: jf.attention(q, k, v, mask=masks.causal(), score_mod=score_mod(bias), return_max_scores=True)[1]  # noqa: E731
    looped = jnp.stack([top_of(t) for t in tables])
    assert_close(jax.vmap(top_of)(tables), looped)
    assert_close(jax.jit(jax.vmap(top_of))(tables), looped)
    grad_of = jax.grad(lambda bias: jnp.sum(top_of(bias)))
    assert_close(jax.vmap(grad_of)(tables), jnp.stack([grad_of(t) for t in tables]), **DTOL)


def test_qk_clip_statistic_per_head():
    """MuonClip's statistic: each query head's largest logit over the batch, as a jnp.max of the
    dense scores gives it (scale included)."""
    q, k, v = qkv(np.random.default_rng(12), (B,), SQ, SKV, HQ, HKV, D, DV)
    per_head = jf.attention(q, k, v, mask=masks.causal(), scale=0.7, return_max_scores=True)[1].max(axis=(0, 1))
    scores = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, HQ // HKV, axis=2)) * 0.7
    causal = np.arange(SKV)[None, :] <= np.arange(SQ)[:, None]
    assert_close(per_head, np.where(causal, scores, -np.inf).max(axis=(0, 2, 3)))


def test_sharded_batch_keeps_the_split():
    mesh = jax.make_mesh((4,), ("batch",))
    batch = NamedSharding(mesh, PartitionSpec("batch"))
    q, k, v = qkv(np.random.default_rng(13), (4,), 12, 12, 2, 1, 4, 4)
    f = jax.jit(lambda q, k, v: jf.attention(q, k, v, mask=masks.causal(), return_max_scores=True)[1])
    top = f(*(jax.device_put(x, batch) for x in (q, k, v)))
    assert top.sharding.spec[0] == "batch"
    assert_close(top, dense(q, k, v, lambda b, h, i, j: j <= i, max_scores=True)[2])


SEQUENCE_SPLITS = {  # name: (q's spec, k's and v's spec): queries traded head-tail (causal); keys merged
    "queries": (P("data", "seq"), P("data")),
    "keys": (P("data"), P("data", "seq")),
}


@pytest.mark.parametrize("name", list(SEQUENCE_SPLITS))
def test_sequence_splits_match_one_device(name):
    """On an explicit mesh: q split along its sequence (the shards trade halves under the causal
    mask) or k and v (each device's keys, the parts' maxima merged by a differentiable all-reduce):
    values and gradients (a bias table's too) equal one device's."""
    q_spec, kv_spec = SEQUENCE_SPLITS[name]
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    q, k, v = qkv(np.random.default_rng(15), (2,), 32, 32, 2, 1, 8, 6)
    table = jnp.asarray(np.random.default_rng(16).standard_normal((2, 64)))
    top_of = lambda q, k, v, table: jf.attention(  # noqa: E731
        q, k, v, mask=masks.causal(-3), score_mod=lambda s, b, h, i, j: s + table[h, i - j + 32], return_max_scores=True
    )[1]
    loss = lambda *a: jnp.sum(jnp.sin(_finite(top_of(*a))))  # noqa: E731
    with jax.set_mesh(mesh):
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec), put(table, P()))
        top, grads = jax.jit(top_of)(*args), jax.jit(jax.grad(loss, (0, 1, 3)))(*args)
    assert tuple(top.sharding.spec)[:2] == tuple(q_spec) + (None,) * (2 - len(q_spec))
    assert_close(top, dense(q, k, v, lambda b, h, i, j: j <= i - 3, lambda s, b, h, i, j: s + table[h, i - j + 32], max_scores=True)[2])
    for g, w in zip(grads, jax.grad(loss, (0, 1, 3))(q, k, v, table)):
        assert_close(g, w, **DTOL)

