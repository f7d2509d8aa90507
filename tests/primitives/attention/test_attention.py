"""Attention (attention_fwd_p, attention_tangent_p, attention_bwd_p) through ``jf.attention``.

Values are checked in float64 against ``dense``, an independent numpy attention (einsum, with the
mask and score functions applied elementwise by ``np.vectorize``); derivatives against
``dense_jnp``, the same dense attention in jax.numpy on full score matrices, against the library's
own spec ``attention_reference``, and by finite differences (``check_grads``). Then vmap (one bind,
no loop), jit, sharding along the batch, and the half-precision dtypes.
"""

from __future__ import annotations

import functools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from jax.test_util import check_grads

import jaxforge as jf
from jaxforge.functional.attention import Implementation, _mods
from jaxforge.primitives.attention.attention import (
    SHAPES,
    attention_bwd_p,
    attention_fwd_p,
    attention_reference,
    attention_tangent_p,
)
from tests.attention_dense import dense_jnp, grid

masks = jf.masks

# Every lowering the tests run. Small tiles make the tile loops run several iterations and make the
# causal / window spans skip whole tiles (the default XLA tiles cover these short sequences in one).
# A new implementation (e.g. "pallas_triton") is appended here.
# pack_gqa puts each GQA group's query heads in the rows of one tile (HQ / HKV = 2 here). XLA lays
# tiles of few query rows keys-major (config.xla_keys_major), these short sequences' included; 64
# rows keep queries in rows.
IMPLEMENTATIONS = [
    "xla",
    Implementation("xla", block_q=8, block_kv=16),
    Implementation("xla", block_q=8, block_kv=16, pack_gqa=True),
    Implementation("xla", block_q=64, block_kv=16),
]


def _impl_id(impl) -> str:
    if isinstance(impl, str):
        return impl
    return f"{impl.name}-{impl.block_q}x{impl.block_kv}" + ("-packed" if impl.pack_gqa else "")


over_impls = pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=_impl_id)

TOL = dict(rtol=1e-11, atol=1e-11)  # float64 values
DTOL = dict(rtol=1e-9, atol=1e-9)  # float64 derivatives


# --- independent references -------------------------------------------------------------------


def allowed(mask_fn, b, hq, sq, skv):
    """The mask as a boolean (B, Hq, Sq, Skv) array, by calling ``mask_fn`` on every index."""
    if mask_fn is None:
        return np.ones((b, hq, sq, skv), bool)
    return np.vectorize(mask_fn, otypes=[bool])(*grid(b, hq, sq, skv))


def dense(q, k, v, mask_fn=None, score_fn=None, scale=None, softcap=None, max_scores=False):
    """``(out, lse)`` in float64 numpy, with ``max_scores`` also each row's largest score (``-inf``
    where it sees none); leading dims broadcast and are flattened into ``b``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    q, k, v = (np.broadcast_to(x, batch + x.shape[-3:]).reshape(math.prod(batch), *x.shape[-3:]) for x in (q, k, v))
    bsz, sq, hq, d = q.shape
    skv, hkv, dv = v.shape[1:]
    group = hq // hkv if hkv else 0  # no heads
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * (1 / np.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if score_fn is not None:
        s = np.vectorize(score_fn, otypes=[np.float64])(s, *grid(bsz, hq, sq, skv))
    s = np.where(allowed(mask_fn, bsz, hq, sq, skv), s, -np.inf)
    top = s.max(-1, keepdims=True, initial=-np.inf)
    mx = np.where(np.isfinite(top), top, 0)
    e = np.exp(s - mx)
    t = e.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", e / np.where(t > 0, t, 1), vr)
    lse = np.where(t > 0, mx + np.log(np.where(t > 0, t, 1)), -np.inf)  # (b, h, q, 1)
    rows = lambda x: np.swapaxes(x[..., 0], 1, 2).reshape(*batch, sq, hq)  # noqa: E731
    return (out.reshape(*batch, sq, hq, dv), rows(lse), *[rows(top)] * max_scores)


def reference(q, k, v, *, mask=None, score_mod=None, scale=None, softcap=None):
    """The library's spec ``attention_reference`` with the mods ``jf.attention`` would build."""
    batch = q.shape[:-3]
    mods, consts = _mods(mask, score_mod, softcap, batch, q.shape[-3], k.shape[-3], q.dtype)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    return attention_reference(q, k, v, *consts, mods=mods, scale=float(scale))


def qkv(rng, batch, sq, skv, hq, hkv, d, dv, dtype=np.float64):
    q = rng.standard_normal((*batch, sq, hq, d))
    k = rng.standard_normal((*batch, skv, hkv, d))
    v = rng.standard_normal((*batch, skv, hkv, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def segments(rng, *shape, n=4):
    """Sorted random segment ids (packed documents), int32."""
    return np.sort(rng.integers(0, n, shape), axis=-1).astype(np.int32)


def assert_close(actual, expected, **tol):
    tol = tol or TOL
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), **tol)


# --- masks ------------------------------------------------------------------------------------

B, HQ, HKV, D, DV = 2, 4, 2, 8, 6
SELF, CROSS, TALL = (37, 37), (37, 53), (53, 37)  # (Sq, Skv): odd lengths, several tiles of 8 / 16


def _document_cross(rng, lead):
    q_ids, kv_ids = segments(rng, *lead, 37), segments(rng, *lead, 53)
    q_np, kv_np = np.broadcast_to(q_ids, (B, 37)), np.broadcast_to(kv_ids, (B, 53))
    return masks.document(q_ids, kv_ids), lambda b, h, i, j: q_np[b, i] == kv_np[b, j]


def _document_self(rng, lead):
    ids = segments(rng, *lead, 37)
    ids_np = np.broadcast_to(ids, (B, 37))
    return masks.document(ids), lambda b, h, i, j: ids_np[b, i] == ids_np[b, j]


def _document_causal(rng):
    ids = segments(rng, B, 37)
    return masks.causal() & masks.document(jnp.asarray(ids)), lambda b, h, i, j: j <= i and ids[b, i] == ids[b, j]


def _not_document_or_causal(rng):
    ids = segments(rng, B, 37)
    return ~masks.document(jnp.asarray(ids)) | masks.causal(), lambda b, h, i, j: j <= i or ids[b, i] != ids[b, j]


def _padding(rng):
    lens = np.array([30, 45])
    lens_j = jnp.asarray(lens)
    return (lambda b, h, i, j: j < lens_j[b]), lambda b, h, i, j: j < lens[b]


def _prefix_per_batch(rng):
    prefix = np.array([3, 20])
    return masks.prefix_lm(jnp.asarray(prefix)), lambda b, h, i, j: j < prefix[b] or j <= i


def _block_mask_per_item_and_head(rng):
    """Frame-causal over a window that widens with the head, odd heads with holes drawn per
    (item, head, query, key): the evaluated span holds every head's keys (the hull), and only even
    heads' tiles are whole, so no tile is (the intersection)."""
    table = rng.random((B, HQ, 37, 37)) < 0.2
    table_j = jnp.asarray(table)
    fn = lambda b, h, i, j: (i // 6 >= j // 6) & (j > i - 8 * (h + 1)) & (table_j[b, h, i, j] | (h % 2 == 0) | (j % 3 != 0))  # noqa: E731
    expected = lambda b, h, i, j: i // 6 >= j // 6 and j > i - 8 * (h + 1) and (table[b, h, i, j] or h % 2 == 0 or j % 3 != 0)  # noqa: E731
    return masks.block_mask(fn, 37, 37, batch_shape=(B,), num_heads=HQ), expected


def _array_per_item_and_head(rng):
    """jax.nn's layout, given as mask=: holes per (item, head, query, key), a row hidden at every
    head, and a band every head sees (tiles whole to all heads, which skip the mask arithmetic)."""
    visible = rng.random((B, HQ, 37, 53)) < 0.3
    visible[:, :, 5] = False
    i, j = np.arange(37)[:, None], np.arange(53)
    visible |= (j >= i + 4) & (j < i + 30)
    return jnp.asarray(visible), lambda b, h, i, j: visible[b, h, i, j]


# (id, (Sq, Skv), rng -> (mask for jf.attention, numpy mask_fn(b, h, i, j) -> bool))
MASK_CASES = [
    ("full", CROSS, lambda r: (masks.full(), lambda b, h, i, j: True)),
    ("causal", CROSS, lambda r: (masks.causal(), lambda b, h, i, j: j <= i)),
    ("causal_negative_offset", SELF, lambda r: (masks.causal(-5), lambda b, h, i, j: j <= i - 5)),
    ("causal_tall_bottom_right", TALL, lambda r: (masks.causal(-16), lambda b, h, i, j: j <= i - 16)),
    ("causal_per_item_offsets", CROSS, lambda r: (  # item 1's first rows see nothing
        masks.causal(jnp.asarray([20, -3])), lambda b, h, i, j: j <= i + [20, -3][b])),
    ("window_and_causal", SELF, lambda r: (masks.sliding_window(5) & masks.causal(), lambda b, h, i, j: 0 <= i - j < 5)),
    ("document", SELF, lambda r: _document_self(r, ())),
    ("document_cross", CROSS, lambda r: _document_cross(r, ())),
    ("document_cross_batched", CROSS, lambda r: _document_cross(r, (B,))),
    ("document_and_causal", SELF, _document_causal),
    ("prefix_lm", SELF, lambda r: (masks.prefix_lm(10), lambda b, h, i, j: j < 10 or j <= i)),
    ("prefix_lm_per_batch", SELF, _prefix_per_batch),
    ("chunked", CROSS, lambda r: (masks.chunked(8), lambda b, h, i, j: i // 8 == j // 8)),
    ("causal_or_window", SELF, lambda r: (masks.causal() | masks.sliding_window(3), lambda b, h, i, j: j <= i or abs(i - j) < 3)),
    ("not_causal", CROSS, lambda r: (~masks.causal(), lambda b, h, i, j: j > i)),
    ("not_document_or_causal", SELF, _not_document_or_causal),
    ("chunked_and_not_window", CROSS, lambda r: (
        masks.chunked(8) & ~masks.sliding_window(2), lambda b, h, i, j: i // 8 == j // 8 and abs(i - j) >= 2)),
    ("lambda_padding_captured", CROSS, _padding),
    ("padding_per_item", CROSS, lambda r: (
        masks.padding(jnp.asarray([30, 45])), lambda b, h, i, j: j < [30, 45][b])),
    ("padding_q_and_kv_per_item_and_causal", SELF, lambda r: (  # item 0 keeps no query
        masks.padding(jnp.asarray([37, 9]), jnp.asarray([0, 20])) & masks.causal(),
        lambda b, h, i, j: j < [37, 9][b] and i < [0, 20][b] and j <= i)),
    ("padding_static_or_window", TALL, lambda r: (
        masks.padding(17, 40) | masks.sliding_window(3), lambda b, h, i, j: (j < 17 and i < 40) or abs(i - j) < 3)),
    ("from_mask_mod_and_causal", SELF, lambda r: (
        masks.from_mask_mod(lambda b, h, i, j: (h + j) % 2 == 0) & masks.causal(),
        lambda b, h, i, j: (h + j) % 2 == 0 and j <= i)),
    ("block_mask_per_item_and_head", SELF, _block_mask_per_item_and_head),
    ("block_mask_with_holes_and_window", CROSS, lambda r: (  # rows from 30 see nothing; key tile 0 whole for rows 8-15
        masks.block_mask(lambda b, h, i, j: (i < 30) & ((j < 20) | (j > i + 10)), 37, 53) & masks.sliding_window(20),
        lambda b, h, i, j: i < 30 and (j < 20 or j > i + 10) and abs(i - j) < 20)),
    ("block_mask_pieces_and_causal", CROSS, lambda r: (  # rows from 21 cut at key tile [16, 32): two calls, merged
        masks.block_mask(lambda b, h, i, j: (j < 3) | ((j > i + 10) & (j <= i + 16)), 37, 53, ranges=2) & masks.causal(14),
        lambda b, h, i, j: (j < 3 or i + 10 < j <= i + 16) and j <= i + 14)),
    ("array_per_item_and_head", CROSS, _array_per_item_and_head),
    ("array_of_keys_per_item_and_causal", SELF, lambda r: (  # (B, 1, 1, Skv): padding as jax.nn users write it
        masks.causal() & (np.arange(37) < np.asarray([37, 12])[:, None, None, None]),
        lambda b, h, i, j: j <= i and j < [37, 12][b])),
    # a plain lambda on either side of & and |: Mask.__rand__ and Mask.__ror__
    ("sink_or_lambda_and_window", CROSS, lambda r: (
        (lambda b, h, i, j: j < 2) | ((lambda b, h, i, j: (b + h + j) % 3 != 1) & masks.sliding_window(4)),
        lambda b, h, i, j: j < 2 or ((b + h + j) % 3 != 1 and abs(i - j) < 4))),
]
MASK_IDS = [c[0] for c in MASK_CASES]
_MASKS = {c[0]: c for c in MASK_CASES}


def mask_case(name, seed=0):
    _, (sq, skv), build = _MASKS[name]
    rng = np.random.default_rng(seed)
    mask, mask_fn = build(rng)
    return (sq, skv), mask, mask_fn, rng


@over_impls
@pytest.mark.parametrize("name", MASK_IDS)
def test_masks_match_dense(impl, name):
    (sq, skv), mask, mask_fn, rng = mask_case(name)
    q, k, v = qkv(rng, (B,), sq, skv, HQ, HKV, D, DV)
    out, lse = jf.attention(q, k, v, mask=mask, return_lse=True, implementation=impl)
    out_np, lse_np = dense(q, k, v, mask_fn)
    assert out.shape == (B, sq, HQ, DV) and out.dtype == np.float64
    assert lse.shape == (B, sq, HQ) and lse.dtype == np.float64
    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse))
    assert_close(out, out_np)
    assert_close(lse, lse_np)


def test_masks_are_not_all_trivial():
    """Every mask case shows something and (but full) hides something, so it tests what it says."""
    for name in MASK_IDS:
        (sq, skv), _, mask_fn, _ = mask_case(name)
        vis = allowed(mask_fn, B, HQ, sq, skv)
        assert vis.any(), name
        assert vis.all() == (name == "full"), name


# --- score_mod and softcap ----------------------------------------------------------------------

SQ, SKV = CROSS
SLOPES = 2.0 ** -np.arange(1, HQ + 1)  # ALiBi: one slope per query head
REL_BIAS = np.random.default_rng(100).standard_normal((HQ, SQ + SKV))  # bias[h, q_idx - kv_idx + Skv]
TEMPS = np.array([0.5, 2.0])  # one temperature per batch item


def _score_cases():
    slopes, bias, temps = jnp.asarray(SLOPES), jnp.asarray(REL_BIAS), jnp.asarray(TEMPS)
    return {
        # id: (score_mod for jf.attention, numpy score_fn, softcap, jf mask, numpy mask, scale)
        "alibi_causal": (lambda s, b, h, i, j: s + slopes[h] * (j - i),
                         lambda s, b, h, i, j: s + SLOPES[h] * (j - i), None, masks.causal(16), lambda b, h, i, j: j <= i + 16, None),
        "relative_bias": (lambda s, b, h, i, j: s + bias[h, i - j + SKV],
                          lambda s, b, h, i, j: s + REL_BIAS[h, i - j + SKV], None, masks.causal(3), lambda b, h, i, j: j <= i + 3, None),
        "per_batch_temperature_and_scale": (lambda s, b, h, i, j: s * temps[b],
                                            lambda s, b, h, i, j: s * TEMPS[b], None, None, None, 0.3),
        "softcap": (None, None, 1.5, None, None, None),
        "softcap_and_relative_bias": (lambda s, b, h, i, j: s + bias[h, i - j + SKV],
                                      lambda s, b, h, i, j: s + REL_BIAS[h, i - j + SKV], 1.5,
                                      masks.sliding_window(9), lambda b, h, i, j: abs(i - j) < 9, None),
    }  # fmt: skip


SCORE_IDS = list(_score_cases())


@over_impls
@pytest.mark.parametrize("name", SCORE_IDS)
def test_score_mods_match_dense(impl, name):
    score_mod, score_fn, softcap, mask, mask_fn, scale = _score_cases()[name]
    q, k, v = qkv(np.random.default_rng(1), (B,), SQ, SKV, HQ, HKV, D, DV)
    q = 3 * q  # scores of a few units, so that softcap=1.5 bends them
    out, lse = jf.attention(
        q, k, v, mask=mask, score_mod=score_mod, softcap=softcap, scale=scale, return_lse=True, implementation=impl
    )
    out_np, lse_np = dense(q, k, v, mask_fn, score_fn, scale=scale, softcap=softcap)
    assert_close(out, out_np)
    assert_close(lse, lse_np)
    if softcap is not None:  # the cap bends these scores: without it the result differs
        assert np.abs(dense(q, k, v, mask_fn, score_fn)[0] - out_np).max() > 1e-2


@over_impls
def test_gradients_of_per_head_score_arrays_without_a_mask(impl):
    """ALiBi slopes and a per-head shift, differentiated, with no mask: the key tiles hold padded
    keys, which must not reach the arrays' cotangents. A shift of every score of a row changes
    nothing: its gradient is zero."""
    q, k, v = qkv(np.random.default_rng(15), (B,), SQ, SKV, HQ, HKV, D, DV)
    w = np.random.default_rng(16).standard_normal((B, SQ, HQ, DV))
    alibi = lambda slopes, shift: lambda s, b, h, i, j: s + slopes[h] * (j - i) + shift[h]
    ours = lambda slopes, shift: jnp.sum(jf.attention(q, k, v, score_mod=alibi(slopes, shift), implementation=impl) * w)
    theirs = lambda slopes, shift: jnp.sum(dense_jnp(q, k, v, None, alibi(slopes, shift))[0] * w)
    args = (jnp.asarray(SLOPES), jnp.asarray(np.arange(HQ, dtype=np.float64)))
    (g_slopes, g_shift), (want_slopes, _) = jax.grad(ours, (0, 1))(*args), jax.grad(theirs, (0, 1))(*args)
    assert_close(g_slopes, want_slopes, **DTOL)
    assert_close(g_shift, np.zeros(HQ), atol=1e-12, rtol=0)


# --- shapes -------------------------------------------------------------------------------------

# (batch, Sq, Skv, Hq, Hkv, D, Dv), causal (bottom-right aligned: every query sees a key)
SHAPE_CASES = {
    "mqa_4_to_1": (((2,), 21, 19, 4, 1, 8, 8), True),
    "dv_larger_than_d": (((), 13, 7, 3, 1, 5, 9), False),
    "batch_2x3": (((2, 3), 11, 17, 2, 2, 4, 4), True),
    "single_query": (((2,), 1, 29, 2, 2, 8, 8), True),
    # decoding with GQA 3:1 (packed by default): 9 rows, a tile of 8 splits a query's heads
    "decode_gqa_3_to_1": (((2,), 3, 29, 6, 2, 8, 8), True),
    "single_key": (((2,), 9, 1, 2, 1, 8, 3), False),
    **{name: (((s[0],), *s[1:]), mask == "causal") for name, (s, mask, tags) in SHAPES.items() if "test" in tags},
}


@over_impls
@pytest.mark.parametrize("name", list(SHAPE_CASES))
def test_shapes_match_dense(impl, name):
    (batch, sq, skv, hq, hkv, d, dv), causal = SHAPE_CASES[name]
    q, k, v = qkv(np.random.default_rng(4), batch, sq, skv, hq, hkv, d, dv)
    offset = skv - sq
    mask = masks.causal(offset) if causal else None
    out, lse = jf.attention(q, k, v, mask=mask, return_lse=True, implementation=impl)
    out_np, lse_np = dense(q, k, v, (lambda b, h, i, j: j <= i + offset) if causal else None)
    assert out.shape == (*batch, sq, hq, dv) and lse.shape == (*batch, sq, hq)
    assert_close(out, out_np)
    assert_close(lse, lse_np)


@over_impls
def test_leading_dims_broadcast(impl):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 3, 11, 4, 8))
    k = rng.standard_normal((3, 13, 2, 8))  # broadcasts against (2, 3)
    v = rng.standard_normal((2, 1, 13, 2, 5))
    lens = np.arange(6) + 7  # b indexes the flattened (2, 3) broadcast batch
    lens_j = jnp.asarray(lens)
    out = jf.attention(q, k, v, mask=lambda b, h, i, j: j < lens_j[b], implementation=impl)
    assert out.shape == (2, 3, 11, 4, 5)
    assert_close(out, dense(q, k, v, lambda b, h, i, j: j < lens[b])[0])


@over_impls
def test_multiple_batch_dims_with_per_batch_masks(impl):
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (2, 3), 12, 12, 2, 1, 4, 4)
    ids = segments(rng, 2, 3, 12)
    prefix = np.array([1, 5, 9])  # per batch item, broadcast over the first batch dim
    mask = masks.document(ids) & masks.prefix_lm(jnp.asarray(prefix))
    out = jf.attention(q, k, v, mask=mask, implementation=impl)
    flat = ids.reshape(6, 12)
    mask_fn = lambda b, h, i, j: flat[b, i] == flat[b, j] and (j < prefix[b % 3] or j <= i)
    assert_close(out, dense(q, k, v, mask_fn)[0])


# --- log-sum-exp and fully masked rows ------------------------------------------------------------


@over_impls
def test_lse_is_logsumexp_of_scores(impl):
    """lse against np.logaddexp over the masked, modified scores (the call of the relative_bias case)."""
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (B,), SQ, SKV, HQ, HKV, D, DV)
    bias = jnp.asarray(REL_BIAS)
    out, lse = jf.attention(
        q, k, v, mask=masks.causal(3), score_mod=lambda s, b, h, i, j: s + bias[h, i - j + SKV],
        return_lse=True, implementation=impl,
    )  # fmt: skip
    s = np.einsum("bqhd,bkhd->bqhk", q, np.repeat(k, HQ // HKV, axis=2)) / np.sqrt(D)
    i, h, j = np.arange(SQ)[:, None, None], np.arange(HQ)[None, :, None], np.arange(SKV)[None, None, :]
    s = np.where(j <= i + 3, s + REL_BIAS[h, i - j + SKV], -np.inf)
    assert lse.shape == (B, SQ, HQ) and lse.dtype == np.float64
    assert_close(lse, np.logaddexp.reduce(s, axis=-1))
    assert_close(out, np.einsum("bqhk,bkhd->bqhd", np.exp(s - np.asarray(lse)[..., None]), np.repeat(v, HQ // HKV, 2)))


def _hidden_rows_mask(b, h, i, j):
    return (i % 5 != 2) and not (b == 1 and h == 3 and i < 4) and j <= i + 16


FULLY_MASKED = {
    # id: (Sq, Skv, jf mask, numpy mask_fn, derivatives checked)
    "mask_mod": (37, 53, lambda b, h, i, j: (i % 5 != 2) & ~((b == 1) & (h == 3) & (i < 4)) & (j <= i + 16),
                 _hidden_rows_mask, ("grad", "jvp")),
    "causal_negative_offset": (37, 37, masks.causal(-5), lambda b, h, i, j: j <= i - 5, ("grad",)),
    "nothing_visible": (13, 21, ~masks.full(), lambda b, h, i, j: False, ()),
}


@over_impls
@pytest.mark.parametrize("name", list(FULLY_MASKED))
def test_fully_masked_rows(impl, name):
    sq, skv, mask, mask_fn, derivatives = FULLY_MASKED[name]
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (B,), sq, skv, HQ, HKV, D, DV)
    vis = allowed(mask_fn, B, HQ, sq, skv)
    hidden = np.swapaxes(~vis.any(-1), 1, 2)  # (B, Sq, Hq)
    assert hidden.any()
    out, lse = jf.attention(q, k, v, mask=mask, return_lse=True, implementation=impl)
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    np.testing.assert_array_equal(np.asarray(out)[hidden], 0.0)
    np.testing.assert_array_equal(np.asarray(lse)[hidden], -np.inf)
    assert np.isfinite(np.asarray(lse)[~hidden]).all()
    out_np, lse_np = dense(q, k, v, mask_fn)
    assert_close(out, out_np)
    assert_close(lse, lse_np)
    if "grad" not in derivatives:
        return

    w = rng.standard_normal(out.shape)

    def loss(attn, q, k, v):
        out, lse = attn(q, k, v)
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    ours = functools.partial(jf.attention, mask=mask, return_lse=True, implementation=impl)
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(np.asarray(grads[0])[hidden], 0.0)
    expected = jax.jit(jax.grad(functools.partial(loss, functools.partial(dense_jnp, visible=vis)), argnums=(0, 1, 2)))(q, k, v)
    for g, e in zip(grads, expected):
        assert_close(g, e, **DTOL)
    if "jvp" not in derivatives:
        return

    tangents = qkv(rng, (B,), sq, skv, HQ, HKV, D, DV)
    _, (dout, dlse) = jax.jvp(ours, (q, k, v), tangents)
    assert np.isfinite(np.asarray(dout)).all() and np.isfinite(np.asarray(dlse)).all()
    np.testing.assert_array_equal(np.asarray(dout)[hidden], 0.0)
    np.testing.assert_array_equal(np.asarray(dlse)[hidden], 0.0)


# --- attention sinks -----------------------------------------------------------------------------

SINKS = np.asarray([0.3, -1.0, 2.0, -np.inf])  # one logit per query head; the last head has none


def dense_with_sinks(q, k, v, visible, sinks):
    """Attention whose rows have one more key, of logit ``sinks[h]`` and value 0, in jax.numpy
    (differentiable); ``visible`` as in :func:`dense_jnp`."""
    bsz, sq, hq, d = q.shape
    group = hq // k.shape[2]
    kr, vr = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr, precision="highest") / np.sqrt(d)
    s = jnp.where(visible, s, -jnp.inf)
    s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], (bsz, hq, sq, 1))], axis=-1)
    mx = jax.lax.stop_gradient(s.max(-1, keepdims=True, initial=-jnp.inf))
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.exp(s - mx)
    t = e.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", e[..., :-1] / jnp.where(t > 0, t, 1), vr, precision="highest")
    lse = jnp.where(t > 0, mx + jnp.log(jnp.where(t > 0, t, 1)), -jnp.inf)[..., 0]
    return out, jnp.swapaxes(lse, 1, 2)


@over_impls
def test_sinks_are_a_key_of_value_zero(impl):
    """Output, lse, jvp and grad (the sinks' included) against a dense softmax with the sink as one
    more key; rows with no visible key keep out 0 and lse = the sink (-inf without one)."""
    rng = np.random.default_rng(21)
    q, k, v = qkv(rng, (B,), 37, 37, HQ, HKV, D, DV)
    sinks = jnp.asarray(SINKS)
    visible = allowed(lambda b, h, i, j: j <= i - 5, B, HQ, 37, 37)  # the first 5 rows see no key
    f = lambda q, k, v, sinks: jf.attention(q, k, v, mask=masks.causal(-5), sinks=sinks, return_lse=True, implementation=impl)
    ref = lambda q, k, v, sinks: dense_with_sinks(q, k, v, visible, sinks)
    (out, lse), (want_out, want_lse) = f(q, k, v, sinks), ref(q, k, v, sinks)
    assert_close(out, want_out)
    np.testing.assert_array_equal(lse[:, :5], np.broadcast_to(SINKS, lse[:, :5].shape))
    assert_close(lse, want_lse)
    tangents = (*qkv(np.random.default_rng(22), (B,), 37, 37, HQ, HKV, D, DV), jnp.asarray([1.0, -2.0, 0.5, 3.0]))
    got, want = jax.jvp(f, (q, k, v, sinks), tangents)[1], jax.jvp(ref, (q, k, v, sinks), tangents)[1]
    assert_close(got[0], want[0], **DTOL)
    assert_close(jnp.where(jnp.isfinite(want[1]), got[1], 0), jnp.where(jnp.isfinite(want[1]), want[1], 0), **DTOL)
    w_out, w_lse = rng.standard_normal(out.shape), np.where(np.isfinite(want_lse), rng.standard_normal(lse.shape), 0)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * w_out) + jnp.sum(jnp.where(w_lse != 0, fn(*a)[1], 0) * w_lse)
    grads, want_grads = jax.grad(loss(f), (0, 1, 2, 3))(q, k, v, sinks), jax.grad(loss(ref), (0, 1, 2, 3))(q, k, v, sinks)
    for g, w in zip(grads, want_grads):
        assert np.isfinite(g).all()
        assert_close(g, w, **DTOL)
    assert np.abs(np.asarray(grads[3][:3])).min() > 1e-3 and grads[3][3] == 0  # a sink of -inf takes no gradient


@over_impls
def test_sinks_check_grads_order_2(impl):
    rng = np.random.default_rng(23)
    q, k, v = qkv(rng, (1,), 9, 11, 2, 1, 4, 3)
    f = lambda q, k, v, sinks: jf.attention(q, k, v, mask=masks.causal(2), sinks=sinks, implementation=impl)
    check_grads(f, (q, k, v, jnp.asarray([0.5, -0.3])), order=2, modes=("fwd", "rev"))


def test_a_traced_scale_multiplies_q():
    """A traced scale (a learned temperature; ``1 / jnp.sqrt(d)`` under jit) gives the constant
    scale's out, lse and max scores, derivatives in it to order 2, and a vmap over scales a loop's."""
    rng = np.random.default_rng(25)
    q, k, v = qkv(rng, (B,), 13, 17, HQ, HKV, D, DV)
    f = lambda q, k, c: jf.attention(q, k, v, mask=masks.causal(), scale=c, return_lse=True, return_max_scores=True)
    for c in (0.37, 2.0):
        for got, want in zip(jax.jit(f)(q, k, c), f(q, k, c)):  # traced, against the constant
            assert_close(jnp.where(jnp.isfinite(want), got, 0), jnp.where(jnp.isfinite(want), want, 0))
    check_grads(lambda q, k, c: f(q, k, c)[:2], (q, k, 0.37), order=2, modes=("fwd", "rev"))
    scales = [0.2, 0.5, 1.5]
    batched = jax.vmap(lambda c: f(q, k, c)[0])(jnp.asarray(scales))
    for c, out in zip(scales, batched):
        assert_close(out, f(q, k, c)[0])


def test_a_traced_softcap_joins_the_score_mod():
    """A traced softcap (a hyperparameter passed into jit, or vmapped over) gives the constant cap's
    out, lse and max scores, with a score mod after it or alone; derivatives in it to order 2 (the
    constant's kernels leave its derivative out: here it is an array the score mod closes over);
    a vmap over caps a loop's."""
    rng = np.random.default_rng(26)
    q, k, v = qkv(rng, (B,), 13, 17, HQ, HKV, D, DV)
    q = 4 * q  # scores well past the caps, where tanh bends
    alibi = lambda s, b, h, i, j: s - 0.25 * (h + 1) * abs(i - j)
    f = lambda q, k, c, score_mod=alibi: jf.attention(q, k, v, mask=masks.causal(), softcap=c, score_mod=score_mod, return_lse=True, return_max_scores=True)
    for score_mod in (alibi, None):
        for c in (0.7, 3.0):
            for got, want in zip(jax.jit(f, static_argnums=3)(q, k, c, score_mod), f(q, k, c, score_mod)):
                assert_close(jnp.where(jnp.isfinite(want), got, 0), jnp.where(jnp.isfinite(want), want, 0))
    assert not np.allclose(f(q, k, 0.7)[0], f(q, k, 3.0)[0])  # the cap matters
    check_grads(lambda q, k, c: f(q, k, c)[:2], (q, k, 0.7), order=2, modes=("fwd", "rev"))  # c a Python float
    caps = [0.5, 1.0, 4.0]
    batched = jax.vmap(lambda c: f(q, k, c)[0])(jnp.asarray(caps))
    for c, out in zip(caps, batched):
        assert_close(out, f(q, k, c)[0])


def test_a_python_number_a_score_mod_closes_over_has_forward_derivatives():
    """``jax.jvp`` hands a Python number's primal to the rules as it is (not an array): jacfwd and
    a Hessian in a temperature the score mod closes over match the dense softmax's."""
    rng = np.random.default_rng(27)
    q, k, v = qkv(rng, (B,), 9, 11, HQ, HKV, D, DV)
    mod = lambda c: lambda s, b, h, i, j: s * c  # noqa: E731
    ours = lambda c: jf.attention(q, k, v, score_mod=mod(c))  # noqa: E731
    ref = lambda c: dense_jnp(q, k, v, score_fn=mod(c))[0]  # noqa: E731
    assert_close(jax.jacfwd(ours)(1.5), jax.jacfwd(ref)(1.5), **DTOL)
    assert_close(jax.hessian(lambda c: ours(c).sum())(1.5), jax.hessian(lambda c: ref(c).sum())(1.5), **DTOL)


@over_impls
def test_attention_transposes_in_v(impl):
    """``out = p v`` is linear in v: ``jax.linear_transpose`` in v equals the vjp (captured bias,
    per-item window, GQA), and so does the gradient of a custom JVP whose tangent is an attention
    of the tangent v; in q it is refused by name."""
    rng = np.random.default_rng(28)
    q, k, v = qkv(rng, (B,), 13, 17, HQ, HKV, D, DV)
    bias = jnp.asarray(rng.standard_normal((HQ, 30)))
    f = lambda v: jf.attention(  # noqa: E731
        q, k, v, mask=masks.causal(4) & masks.sliding_window(jnp.asarray([3, 8])),
        score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 17], implementation=impl,
    )
    g = jnp.asarray(rng.standard_normal((B, 13, HQ, DV)))
    want = jax.vjp(f, v)[1](g)[0]
    assert_close(jax.linear_transpose(f, v)(g)[0], want, **DTOL)
    attend = jax.custom_jvp(f)
    attend.defjvp(lambda primals, tangents: (f(*primals), f(*tangents)))
    assert_close(jax.grad(lambda v: jnp.sum(attend(v) * g))(v), want, **DTOL)
    with pytest.raises(NotImplementedError, match=r"attention: its output is linear in v, not in q"):
        jax.linear_transpose(lambda q: jf.attention(q, k, v, implementation=impl), q)(g)


@over_impls
def test_attention_with_sinks_and_pieces_transposes_in_v(impl):
    """Sinks and a mask's pieces are merged through the lse, which does not move with v: it stays
    known where v alone is (``jax.linear_transpose``), so the merge stays linear in v."""
    rng = np.random.default_rng(29)
    q, k, v = qkv(rng, (B,), 13, 17, HQ, HKV, D, DV)
    i, j = np.arange(13)[:, None], np.arange(17)[None]
    visible = jnp.asarray((j < 2) | ((i + 4 >= j) & (i + 4 - j < 5)))  # sinks and a window: two pieces
    cut = masks.block_mask(masks.from_array(visible), 13, 17, ranges=2)
    assert len(cut.pieces()) == 2
    sinks = jnp.asarray(rng.standard_normal(HQ))
    g = jnp.asarray(rng.standard_normal((B, 13, HQ, DV)))
    for kw in (dict(sinks=sinks), dict(mask=cut), dict(mask=cut, sinks=sinks)):
        f = lambda v: jf.attention(q, k, v, implementation=impl, **kw)  # noqa: E731
        assert_close(jax.linear_transpose(f, v)(g)[0], jax.vjp(f, v)[1](g)[0], **DTOL)


def test_vmapped_sinks_match_a_loop():
    rng = np.random.default_rng(24)
    q, k, v = qkv(rng, (B,), 13, 13, HQ, HKV, D, DV)
    sinks = jnp.asarray(rng.standard_normal((3, HQ)))
    f = lambda sinks: jf.attention(q, k, v, mask=masks.causal(), sinks=sinks)
    batched = jax.vmap(f)(sinks)
    for i in range(3):
        assert_close(batched[i], f(sinks[i]))


# --- derivatives --------------------------------------------------------------------------------


# One case for the derivative, jit and dtype tests: GQA, Sq != Skv over several 8 x 16 tiles, a
# bottom-right causal mask with packed documents (per batch item; every query sees at least one key),
# a captured relative-position bias (differentiated too) and softcap. Returns (out, lse). Eager calls
# compile once per primitive and shape, so the tests that share this case share their kernels.
GB, GSQ, GSKV, GHQ, GHKV, GD, GDV = 2, 20, 27, 4, 2, 4, 3


def _packed_case(rng):
    q, k, v = qkv(rng, (GB,), GSQ, GSKV, GHQ, GHKV, GD, GDV)
    q_ids = segments(rng, GB, GSQ, n=3)
    kv_ids = np.concatenate([np.repeat(q_ids[:, :1], GSKV - GSQ, axis=1), q_ids], axis=1)  # key i + 7 <-> query i
    bias = rng.standard_normal((GHQ, GSQ + GSKV))
    offset = GSKV - GSQ
    mask = masks.causal(offset) & masks.document(q_ids, kv_ids)
    score = lambda bias: lambda s, b, h, i, j: s + bias[h, i - j + GSKV]

    def ours(impl):
        def f(q, k, v, bias):
            bias = jnp.asarray(bias)  # check_grads passes numpy arrays
            return jf.attention(q, k, v, mask=mask, score_mod=score(bias), softcap=2.0, return_lse=True, implementation=impl)

        return f

    def spec(q, k, v, bias):
        return reference(q, k, v, mask=mask, score_mod=score(jnp.asarray(bias)), softcap=2.0)

    mask_fn = lambda b, h, i, j: j <= i + offset and q_ids[b, i] == kv_ids[b, j]
    vis = allowed(mask_fn, GB, GHQ, GSQ, GSKV)
    assert vis.any(-1).all()
    return types.SimpleNamespace(
        args=(q, k, v, bias),
        ours=ours,
        spec=spec,
        ref=lambda q, k, v, bias: dense_jnp(q, k, v, vis, score(bias), softcap=2.0),
        dense=lambda q, k, v, bias: dense(q, k, v, mask_fn, score(np.asarray(bias)), softcap=2.0),
    )


@over_impls
def test_check_grads_order_2(impl):
    case = _packed_case(np.random.default_rng(9))
    check_grads(case.ours(impl), case.args, order=2, modes=("fwd", "rev"))


@over_impls
def test_derivatives_match_dense_and_reference(impl):
    """grad and jvp with respect to q, k, v and the captured bias, against jax's derivatives of
    dense_jnp and of the library's spec attention_reference."""
    rng = np.random.default_rng(9)
    case = _packed_case(rng)
    args, f, spec, ref = case.args, case.ours(impl), case.spec, case.ref
    out, lse = f(*args)
    assert out.shape == (GB, GSQ, GHQ, GDV) and lse.shape == (GB, GSQ, GHQ)
    out_np, lse_np = case.dense(*args)
    assert_close(out, out_np)
    assert_close(lse, lse_np)
    w_out, w_lse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * w_out) + jnp.sum(fn(*a)[1] * w_lse)
    argnums = (0, 1, 2, 3)
    grads = jax.grad(loss(f), argnums)(*args)
    for g, e in zip(grads, jax.jit(jax.grad(loss(ref), argnums))(*args)):
        assert g.shape == e.shape
        assert_close(g, e, **DTOL)
    assert np.abs(np.asarray(grads[3])).max() > 1e-3  # the bias gradient is there

    tangents = tuple(rng.standard_normal(a.shape) for a in args)
    primals_out, tangents_out = jax.jvp(f, args, tangents)
    for expected in (jax.jit(functools.partial(jax.jvp, ref))(args, tangents), jax.jvp(spec, args, tangents)):
        jax.tree.map(lambda x, y: assert_close(x, y, **DTOL), (primals_out, tangents_out), expected)
    # Only the bias moves: its tangent alone reaches the output.
    only_bias = (*(np.zeros_like(a) for a in args[:3]), tangents[3])
    _, (dout, dlse) = jax.jvp(f, args, only_bias)
    _, (dout_r, dlse_r) = jax.jit(functools.partial(jax.jvp, ref))(args, only_bias)
    assert np.abs(np.asarray(dout)).max() > 1e-3
    assert_close(dout, dout_r, **DTOL)
    assert_close(dlse, dlse_r, **DTOL)


# Masks with different spans (which tiles the forward and both backward passes visit).
# Band.q, PrefixSpan.q, RangeSpan.q of an evaluated mask (Band + Intersect: _packed_case), pieces merged
GRAD_MASKS = [
    "causal_tall_bottom_right", "prefix_lm", "block_mask_per_item_and_head", "block_mask_pieces_and_causal", "array_per_item_and_head"
]


@over_impls
@pytest.mark.parametrize("name", GRAD_MASKS)
def test_grad_matches_dense_for_mask_spans(impl, name):
    (sq, skv), mask, mask_fn, rng = mask_case(name)
    q, k, v = qkv(rng, (B,), sq, skv, HQ, HKV, D, DV)  # the operands of test_masks_match_dense
    w = np.random.default_rng(11).standard_normal((B, sq, HQ, DV))
    vis = allowed(mask_fn, B, HQ, sq, skv)
    ours = lambda q, k, v: jnp.sum(jf.attention(q, k, v, mask=mask, implementation=impl) * w)
    theirs = lambda q, k, v: jnp.sum(dense_jnp(q, k, v, vis)[0] * w)
    for g, e in zip(jax.grad(ours, (0, 1, 2))(q, k, v), jax.jit(jax.grad(theirs, (0, 1, 2)))(q, k, v)):
        assert_close(g, e, **DTOL)


@over_impls
def test_jacfwd_matches_jacrev(impl):
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, (1,), 6, 9, 2, 1, 3, 2)
    bias = rng.standard_normal((2, 15))
    score = lambda bias: lambda s, b, h, i, j: s + bias[h, i - j + 9]
    f = lambda q, bias: jf.attention(q, k, v, mask=masks.causal(3), score_mod=score(bias), return_lse=True, implementation=impl)
    fwd = jax.jacfwd(f, argnums=(0, 1))(q, bias)
    rev = jax.jacrev(f, argnums=(0, 1))(q, bias)
    vis = allowed(lambda b, h, i, j: j <= i + 3, 1, 2, 6, 9)
    expected = jax.jit(jax.jacrev(lambda q, bias: dense_jnp(q, k, v, vis, score(bias)), argnums=(0, 1)))(q, bias)
    assert jax.tree.structure(fwd) == jax.tree.structure(expected)
    for a, b_, c in zip(jax.tree.leaves(fwd), jax.tree.leaves(rev), jax.tree.leaves(expected)):
        assert a.shape == c.shape
        assert_close(a, b_, rtol=1e-12, atol=1e-12)
        assert_close(a, c, **DTOL)


@over_impls
def test_hessian_vector_product(impl):
    rng = np.random.default_rng(14)
    case = _packed_case(rng)
    args, ours, ref = case.args, case.ours, case.ref
    w_out, w_lse = rng.standard_normal((GB, GSQ, GHQ, GDV)), rng.standard_normal((GB, GSQ, GHQ))
    loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] ** 2 * w_out) + jnp.sum(fn(*a)[1] * w_lse)
    tangents = tuple(rng.standard_normal(a.shape) for a in args)
    hvp = lambda fn: jax.jvp(jax.grad(loss(fn), argnums=(0, 1, 2, 3)), args, tangents)
    (g, hv), (g_r, hv_r) = hvp(ours(impl)), jax.jit(lambda: hvp(ref))()
    for a, b_ in zip(g + hv, g_r + hv_r):
        assert_close(a, b_, **DTOL)


# --- second order: a gradient through a jvp ----------------------------------------------------


def _jvp_loss(attend):
    """A consistency-model-style loss on the output and on its jvp along (dq, dk, dv), of all six."""

    def loss(q, k, v, dq, dk, dv):
        (out, lse), (dout, dlse) = jax.jvp(attend, (q, k, v), (dq, dk, dv))
        seen = jnp.isfinite(lse)
        return jnp.sum(jnp.sin(dout)) + jnp.sum(jnp.where(seen, dlse, 0) ** 2) + jnp.sum(out**2) + jnp.sum(jnp.where(seen, lse, 0))

    return loss


REL = np.random.default_rng(101).standard_normal((HQ, 2 * 37))
# name: ((Sq, Skv), rng -> (mask, numpy mask_fn), score_mod, softcap, whether it runs the O(S) rule)
SECOND_ORDER = {
    "causal_with_fully_masked_rows": (SELF, lambda r: (masks.causal(-5), lambda b, h, i, j: j <= i - 5), None, None, True),
    "document_causal_softcap": (SELF, _document_causal, None, 2.5, True),
    "window_alibi_cross": (CROSS, lambda r: (masks.sliding_window(9), lambda b, h, i, j: abs(i - j) < 9),
                           lambda s, b, h, i, j: s - 0.25 * (h + 1) * jnp.abs(i - j), None, True),
    "captured_bias": (SELF, lambda r: (masks.causal(), lambda b, h, i, j: j <= i),
                      lambda s, b, h, i, j: s + jnp.asarray(REL)[h, i - j + 37], None, True),
    "unmasked_softcap": (CROSS, lambda r: (None, None), None, 2.0, True),  # XLA packs GQA heads backward
}


def _second_order_case(name, impl, seed):
    """``(args, attend, dense, tiled)`` of case ``name``: q, k, v and a tangent of each; ours and the
    dense attention, both ``(q, k, v) -> (out, lse)``; whether it runs the O(S) rules."""
    (sq, skv), build, score_fn, softcap, tiled = SECOND_ORDER[name]
    rng = np.random.default_rng(seed)
    mask, mask_fn = build(rng)
    args = (*qkv(rng, (B,), sq, skv, HQ, HKV, D, DV), *qkv(rng, (B,), sq, skv, HQ, HKV, D, DV))
    visible = allowed(mask_fn, B, HQ, sq, skv)
    attend = lambda q, k, v: jf.attention(  # noqa: E731
        q, k, v, mask=mask, score_mod=score_fn, softcap=softcap, return_lse=True, implementation=impl)
    return args, attend, lambda q, k, v: dense_jnp(q, k, v, visible, score_fn, softcap=softcap), tiled


@over_impls
@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_grad_through_a_jvp_matches_dense(impl, name):
    """Gradients of all six of (q, k, v, dq, dk, dv) through a jvp, against jax's second derivatives
    of the dense attention: the tangent map's transpose in XLA's tiles (O(S) memory)."""
    args, attend, dense, tiled = _second_order_case(name, impl, seed=31)
    ours, ref = _jvp_loss(attend), _jvp_loss(dense)
    grad = jax.grad(ours, argnums=tuple(range(6)))
    for g, w in zip(jax.jit(grad)(*args), jax.grad(ref, argnums=tuple(range(6)))(*args)):
        assert np.isfinite(g).all()
        assert_close(g, w, **DTOL)
    assert ("attention_tangent_bwd" in str(jax.make_jaxpr(grad)(*args))) == tiled


@over_impls
@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_jvp_of_a_jvp_matches_dense(impl, name):
    """Forward over forward (Taylor mode; jacfwd of jacfwd): the jvp along (dq, dk, dv), differentiated
    along another direction of (q, k, v), runs the tangent map's derivative (attention_tangent2)
    in XLA's tiles (O(S) memory); against jax's second derivatives of the dense attention. A row
    that sees no key has zero derivatives (the dense attention's lse tangents there are NaN)."""
    args, attend, dense, tiled = _second_order_case(name, impl, seed=34)
    x, d, along = args[:3], args[3:], tuple(jnp.cos(a) for a in args[3:])

    def jvp_of_jvp(attend):
        inner = lambda q, k, v: jax.jvp(attend, (q, k, v), d)[1]  # noqa: E731
        return lambda *x: jax.jvp(inner, x, along)

    (dout, dlse), (ddout, ddlse) = jax.jit(jvp_of_jvp(attend))(*x)
    (dout_r, dlse_r), (ddout_r, ddlse_r) = jvp_of_jvp(dense)(*x)
    seen = np.isfinite(attend(*x)[1])
    assert_close(dout, dout_r, **DTOL)
    assert_close(ddout, ddout_r, **DTOL)
    for ours, ref in ((dlse, dlse_r), (ddlse, ddlse_r)):
        assert np.isfinite(ours).all() and not np.asarray(ours)[~seen].any()
        assert_close(np.where(seen, ours, 0), np.where(seen, ref, 0), **DTOL)
    assert ("attention_tangent2" in str(jax.make_jaxpr(jvp_of_jvp(attend))(*x))) == tiled


@over_impls
@pytest.mark.parametrize("moving", ["primals", "tangents", "both"])
def test_jvp_of_a_jvp_skips_what_does_not_move(impl, moving):
    """The jvp of ``(q, k, v, dq, dk, dv) -> dout`` along ``moving`` of them, against the dense
    attention's; each of its terms — attention_tangent2 along (q, k, v), attention_tangent along
    (dq, dk, dv) — runs only where its direction moves (``jvp of a jvp`` holds d fixed: the
    tangent map is then run twice, for dout and the fwd's own, not three times)."""
    args, attend, dense, _ = _second_order_case("document_causal_softcap", impl, seed=35)
    along = tuple(jnp.cos(a) for a in args)
    fixed = {"primals": (3, 4, 5), "tangents": (0, 1, 2), "both": ()}[moving]

    def jvp_of_dout(attend):
        def dout(*moved):  # the fixed ones closed over: their tangents are symbolic zeros
            full = iter(moved)
            q, k, v, *d = (a if i in fixed else next(full) for i, a in enumerate(args))
            return jax.jvp(attend, (q, k, v), tuple(d))[1]

        moved = tuple(i for i in range(6) if i not in fixed)
        return lambda: jax.jvp(dout, tuple(args[i] for i in moved), tuple(along[i] for i in moved))

    for ours, ref in zip(jax.tree.leaves(jax.jit(jvp_of_dout(attend))()), jax.tree.leaves(jvp_of_dout(dense)())):
        seen = np.isfinite(ref)  # the dense lse's tangents are NaN on rows that see no key; ours 0
        assert np.isfinite(ours).all() and not np.asarray(ours)[~seen].any()
        assert_close(np.where(seen, ours, 0), np.where(seen, ref, 0), **DTOL)
    jaxpr = str(jax.make_jaxpr(jvp_of_dout(attend))())
    runs = {p: len(re.findall(rf"{p}\[", jaxpr)) for p in ("attention_tangent", "attention_tangent2")}
    assert runs == {"primals": dict(attention_tangent=2, attention_tangent2=1),
                    "tangents": dict(attention_tangent=2, attention_tangent2=0),
                    "both": dict(attention_tangent=3, attention_tangent2=1)}[moving]  # fmt: skip


def _hvp(attend, argnums=(0, 1, 2)):
    """``(q, k, v, *tangents) -> (gradient, its jvp)`` of a loss on ``attend``'s (out, lse), forward
    over reverse; ``tangents`` of the arguments in ``argnums``."""

    def loss(q, k, v):
        out, lse = attend(q, k, v)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) ** 2)

    def hvp(q, k, v, *tangents):
        def grad(*moving):
            xs = [q, k, v]
            for i, x in zip(argnums, moving):
                xs[i] = x
            return jax.grad(loss, argnums=argnums)(*xs)

        return jax.jvp(grad, tuple((q, k, v)[i] for i in argnums), tangents)

    return hvp


@over_impls
@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_hessian_vector_product_matches_dense(impl, name):
    """A jvp of a gradient (forward over reverse) of (q, k, v) along tangents of all three: the
    backward's tiles in forward mode (attention_bwd_tangent, O(S) memory), against jax's second
    derivatives of the dense attention."""
    args, attend, dense, tiled = _second_order_case(name, impl, seed=36)
    ours, ref = _hvp(attend), _hvp(dense)
    (g, hv), (g_r, hv_r) = jax.jit(ours)(*args), ref(*args)
    for a, w in zip(g + hv, g_r + hv_r):
        assert np.isfinite(a).all()
        assert_close(a, w, **DTOL)
    assert ("attention_bwd_tangent" in str(jax.make_jaxpr(ours)(*args))) == tiled


@over_impls
@pytest.mark.parametrize("along", [(0,), (1, 2)], ids=["q", "kv"])
def test_hessian_vector_product_at_a_fixed_cotangent(impl, along):
    """The jvp of a pullback at a fixed cotangent (a Gauss–Newton-style product) along some of
    (q, k, v): attention_bwd_tangent differentiates along those alone (its ``moving``), against
    jax's second derivatives of the dense attention."""
    args, attend, dense, _ = _second_order_case("document_causal_softcap", impl, seed=39)
    rng = np.random.default_rng(39)
    out, lse = dense(*args[:3])
    cotangent = (rng.standard_normal(out.shape), rng.standard_normal(lse.shape))

    def product(attend):
        def pullback(*moved):
            xs = list(args[:3])
            for i, x in zip(along, moved):
                xs[i] = x
            return jax.vjp(attend, *xs)[1](cotangent)

        return lambda: jax.jvp(pullback, tuple(args[i] for i in along), tuple(args[3 + i] for i in along))

    for ours, ref in zip(jax.tree.leaves(jax.jit(product(attend))()), jax.tree.leaves(product(dense)())):
        assert_close(ours, ref, **DTOL)
    (eqn,) = [e for e in jax.make_jaxpr(product(attend))().jaxpr.eqns if "bwd_tangent" in e.primitive.name]
    assert eqn.params["moving"] == tuple(i in along for i in range(3)) + (True, True, False, False)  # out, lse move


@over_impls
@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_gradient_of_a_gradient_matches_dense(impl, name):
    """Reverse over reverse (a gradient penalty, a meta-gradient): the backward's jvp transposed into
    the tangent map and its transpose (attention_tangent, attention_tangent_bwd: O(S) memory),
    against jax's second derivatives of the dense attention."""
    args, attend, dense, tiled = _second_order_case(name, impl, seed=39)

    def penalty(attend):
        def loss(q, k, v):
            out, lse = attend(q, k, v)
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) ** 2)

        return lambda q, k, v: sum(jnp.sum(jnp.sin(g)) for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

    grad = jax.grad(penalty(attend), argnums=(0, 1, 2))
    for g, w in zip(jax.jit(grad)(*args[:3]), jax.grad(penalty(dense), argnums=(0, 1, 2))(*args[:3])):
        assert np.isfinite(g).all()
        assert_close(g, w, **DTOL)
    assert ("attention_tangent_bwd" in str(jax.make_jaxpr(grad)(*args[:3]))) == tiled


def test_hessians_forward_and_reverse_over_reverse_and_third_order():
    """A Hessian in k by forward over reverse (attention_bwd_tangent) and by reverse over reverse
    (its transpose) against the dense attention's, with GQA and fully masked
    rows; finite differences of a Hessian-vector product (attention_bwd_tangent's own jvp)."""
    rng = np.random.default_rng(37)
    q, k, v = qkv(rng, (1,), 9, 11, 4, 2, 4, 3)
    att = lambda q, k, v: jf.attention(q, k, v, mask=masks.causal(-2), softcap=2.0, return_lse=True)
    visible = allowed(lambda b, h, i, j: j <= i - 2, 1, 4, 9, 11)
    loss = lambda attend: lambda k: jnp.sum(jnp.sin(attend(q, k, v)[0]))
    want = jax.jit(jax.hessian(loss(lambda q, k, v: dense_jnp(q, k, v, visible, softcap=2.0))))(k)
    for outer in (jax.jacfwd, jax.jacrev):
        assert_close(jax.jit(outer(jax.grad(loss(att))))(k), want, **DTOL)
    dq, dk, dv = qkv(rng, (1,), 9, 11, 4, 2, 4, 3)
    check_grads(jax.jit(lambda q, k, v: _hvp(att)(q, k, v, dq, dk, dv)[1]), (q, k, v), order=1, modes=("fwd", "rev"))


def test_vmapped_and_sharded_hessian_vector_products_match():
    """vmap of the Hessian-vector product against a loop; sharded along the batch over 8 devices
    (the rule runs per shard, at the global batch indices a document mask reads) against unsharded."""
    rng = np.random.default_rng(38)
    args = (*qkv(rng, (8,), 12, 12, 2, 1, 4, 4), *qkv(rng, (8,), 12, 12, 2, 1, 4, 4))
    ids = segments(rng, 8, 12, n=3)

    def hvp(q, k, v, dq, dk, dv, ids):
        attend = lambda q, k, v: jf.attention(q, k, v, mask=masks.causal() & masks.document(ids), return_lse=True)
        return jax.tree.leaves(_hvp(attend)(q, k, v, dq, dk, dv))

    want = hvp(*args, ids)
    looped = [hvp(*(x[i : i + 1] for x in (*args, ids))) for i in range(8)]
    for n, g in enumerate(jax.vmap(hvp)(*(x[:, None] for x in (*args, ids)))):
        assert_close(g[:, 0], jnp.concatenate([l[n] for l in looped]), rtol=1e-12, atol=1e-12)
    batch = NamedSharding(jax.make_mesh((8,), ("batch",)), PartitionSpec("batch"))
    for g, w in zip(jax.jit(hvp)(*(jax.device_put(x, batch) for x in (*args, ids))), want):
        assert g.sharding.spec[0] == "batch"
        assert_close(g, w, rtol=1e-12, atol=1e-12)


@over_impls
@pytest.mark.parametrize("bias_moves", [False, True])
def test_grad_through_a_jvp_along_a_captured_bias(impl, bias_moves):
    """A jvp along the bias too (its tangent enters the tiles' score tangents), then a gradient:
    with the bias fixed, the O(S) rule; with the bias among the gradient's arguments, the dense one."""
    rng = np.random.default_rng(35)
    args = (*qkv(rng, (B,), 37, 37, HQ, HKV, D, DV), jnp.asarray(REL), jnp.asarray(rng.standard_normal(REL.shape)))
    visible = allowed(lambda b, h, i, j: j <= i, B, HQ, 37, 37)

    def loss(attend):
        def f(q, k, v, bias, dbias):
            (out, _), (dout, dlse) = jax.jvp(lambda q, bias: attend(q, k, v, bias), (q, bias), (q, dbias))
            return jnp.sum(jnp.sin(dout)) + jnp.sum(dlse**2) + jnp.sum(out**2)

        return f

    ours = loss(lambda q, k, v, bias: jf.attention(
        q, k, v, mask=masks.causal(), score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 37], return_lse=True, implementation=impl))
    ref = loss(lambda q, k, v, bias: dense_jnp(q, k, v, visible, lambda s, b, h, i, j: s + bias[h, i - j + 37]))
    argnums = (0, 1, 2, 3, 4) if bias_moves else (0, 1, 2, 4)
    grad = jax.grad(ours, argnums=argnums)
    for g, w in zip(jax.jit(grad)(*args), jax.grad(ref, argnums=argnums)(*args)):
        assert_close(g, w, **DTOL)
    assert ("attention_tangent_bwd" in str(jax.make_jaxpr(grad)(*args))) != bias_moves


@over_impls
def test_second_order_through_a_jvp_check_grads(impl):
    """Finite differences of the jvp's output, forward (attention_tangent2) and reverse
    (attention_tangent_bwd), with GQA and fully masked rows."""
    rng = np.random.default_rng(32)
    q, k, v = qkv(rng, (1,), 9, 11, 4, 2, 4, 3)
    dq, dk, dv = qkv(rng, (1,), 9, 11, 4, 2, 4, 3)
    att = lambda q, k, v: jf.attention(q, k, v, mask=masks.causal(-2), softcap=2.0, implementation=impl)
    check_grads(lambda q, k, v: jax.jvp(att, (q, k, v), (dq, dk, dv))[1], (q, k, v), order=1, modes=("fwd", "rev"))


def test_vmapped_grad_through_a_jvp_matches_a_loop():
    rng = np.random.default_rng(33)
    q, k, v = qkv(rng, (3,), 13, 13, HQ, HKV, D, DV)
    dq, dk, dv = qkv(rng, (3,), 13, 13, HQ, HKV, D, DV)
    grad = jax.jit(jax.grad(_jvp_loss(lambda q, k, v: jf.attention(q, k, v, mask=masks.causal(), return_lse=True)), argnums=(0, 3)))
    batched = jax.vmap(grad)(q, k, v, dq, dk, dv)
    for i in range(3):
        for g, w in zip(batched, grad(q[i], k[i], v[i], dq[i], dk[i], dv[i])):
            assert_close(g[i], w, rtol=1e-13, atol=1e-13)


# --- vmap -------------------------------------------------------------------------------------


@over_impls
def test_vmap_non_leading_axis_matches_loop(impl):
    """q and k vmapped at axis 1, v and the bias shared."""
    rng = np.random.default_rng(15)
    case = _packed_case(rng)
    q, k, v, bias = case.args
    qs = np.stack([q, 0.5 * q, -q], axis=1)
    ks = np.stack([k, k[:, ::-1], 2 * k], axis=1)
    f = case.ours(impl)
    out, lse = jax.vmap(f, in_axes=(1, 1, None, None))(qs, ks, v, bias)
    assert out.shape == (3, GB, GSQ, GHQ, GDV) and lse.shape == (3, GB, GSQ, GHQ)
    for i in range(3):
        out_i, lse_i = f(qs[:, i], ks[:, i], v, bias)
        assert_close(out[i], out_i, rtol=1e-13, atol=1e-13)
        assert_close(lse[i], lse_i, rtol=1e-13, atol=1e-13)
        out_np, lse_np = case.dense(qs[:, i], ks[:, i], v, bias)
        assert_close(out[i], out_np)
        assert_close(lse[i], lse_np)


@over_impls
def test_vmap_over_captured_bias_only(impl):
    rng = np.random.default_rng(16)
    q, k, v = qkv(rng, (B,), SQ, SKV, HQ, HKV, D, DV)
    biases = rng.standard_normal((3, HQ, SQ + SKV))

    def f(bias):
        bias = jnp.asarray(bias)
        return jf.attention(
            q, k, v, mask=masks.sliding_window(9), score_mod=lambda s, b, h, i, j: s + bias[h, i - j + SKV],
            softcap=1.5, implementation=impl,
        )  # fmt: skip

    batched = jax.vmap(f)(biases)
    assert batched.shape == (3, B, SQ, HQ, DV)
    for i in range(3):
        assert_close(batched[i], f(biases[i]), rtol=1e-13, atol=1e-13)
        score_fn = lambda s, b, h, a, j: s + biases[i][h, a - j + SKV]
        assert_close(batched[i], dense(q, k, v, lambda b, h, a, j: abs(a - j) < 9, score_fn, softcap=1.5)[0])


@over_impls
def test_vmap_over_segment_ids(impl):
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, (B,), 37, 37, HQ, HKV, D, DV)
    ids = segments(rng, 3, B, 37)
    f = lambda ids: jf.attention(q, k, v, mask=masks.causal() & masks.document(ids), implementation=impl)
    batched = jax.vmap(f)(ids)
    for i in range(3):
        assert_close(batched[i], f(ids[i]), rtol=1e-13, atol=1e-13)
        assert_close(batched[i], dense(q, k, v, lambda b, h, a, j: ids[i][b, a] == ids[i][b, j] and j <= a)[0])


@over_impls
def test_vmap_over_padding_lengths(impl):
    """Per-item key and query lengths with a vmapped axis: each level's span skips its own tiles."""
    rng = np.random.default_rng(18)
    q, k, v = qkv(rng, (B,), 37, 37, HQ, HKV, D, DV)
    kv_lengths, q_lengths = np.asarray([[37, 5], [0, 20], [16, 37]]), np.asarray([[30, 37], [37, 2], [9, 0]])
    f = lambda kv_len, q_len: jf.attention(q, k, v, mask=masks.padding(kv_len, q_len), implementation=impl)
    batched = jax.vmap(f)(jnp.asarray(kv_lengths), jnp.asarray(q_lengths))
    for i, (kv_len, q_len) in enumerate(zip(kv_lengths, q_lengths)):
        assert_close(batched[i], dense(q, k, v, lambda b, h, a, j: j < kv_len[b] and a < q_len[b])[0])


@over_impls
def test_vmap_of_grad_matches_loop(impl):
    """q and the bias batched, k and v shared: the gradients of k, v and the bias are per item."""
    rng = np.random.default_rng(18)
    case = _packed_case(rng)
    (q, k, v, bias), ours = case.args, case.ours
    qs, biases = np.stack([q, -q, 2 * q]), np.stack([bias, 0.5 * bias, -bias])
    w_out, w_lse = rng.standard_normal((GB, GSQ, GHQ, GDV)), rng.standard_normal((GB, GSQ, GHQ))
    f = ours(impl)
    grad = jax.grad(lambda *a: jnp.sum(f(*a)[0] * w_out) + jnp.sum(f(*a)[1] * w_lse), argnums=(0, 1, 2, 3))
    batched = jax.vmap(grad, in_axes=(0, None, None, 0))(qs, k, v, biases)
    for i in range(3):
        for g, e in zip(batched, grad(qs[i], k, v, biases[i])):
            assert_close(g[i], e, rtol=1e-12, atol=1e-12)


@over_impls
def test_nested_vmap(impl):
    """Outer vmap over q and segment ids, inner vmap over q and a bias: each const indexed by its own level."""
    rng = np.random.default_rng(19)
    q = rng.standard_normal((2, 3, B, 13, 2, 4))
    _, k, v = qkv(rng, (B,), 13, 13, 2, 1, 4, 3)
    ids = segments(rng, 2, B, 13)
    biases = rng.standard_normal((3, 2, 26))

    def f(q, ids, bias):
        return jf.attention(
            q, k, v, mask=masks.document(ids) & masks.causal(),
            score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 13], implementation=impl,
        )  # fmt: skip

    nested = jax.vmap(jax.vmap(f, in_axes=(0, None, 0)), in_axes=(0, 0, None))(q, ids, biases)
    assert nested.shape == (2, 3, B, 13, 2, 3)
    for a in range(2):
        for c in range(3):
            mask_fn = lambda b, h, i, j: ids[a][b, i] == ids[a][b, j] and j <= i
            score_fn = lambda s, b, h, i, j: s + biases[c][h, i - j + 13]
            assert_close(nested[a, c], dense(q[a, c], k, v, mask_fn, score_fn)[0])


def _count(jaxpr, prim):
    return sum(e.primitive is prim for e in jaxpr.eqns)


@over_impls
def test_vmapped_call_binds_once(impl):
    rng = np.random.default_rng(20)
    q, k, v = qkv(rng, (5, 2), 9, 9, 2, 2, 4, 4)
    bias = jnp.asarray(rng.standard_normal((2, 18)))
    f = lambda q, k, v: jf.attention(
        q, k, v, mask=masks.causal(), score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 9], implementation=impl
    )
    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=1))(q, k, v).jaxpr
    assert _count(jaxpr, attention_fwd_p) == 1, "one bind for the whole batch, no loop"
    assert not any(e.primitive.name in ("while", "scan") for e in jaxpr.eqns)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is attention_fwd_p]
    assert eqn.invars[0].aval.shape == (2, 5, 9, 2, 4)
    loss = lambda q, k, v: jnp.sum(f(q, k, v))
    jaxpr = jax.make_jaxpr(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=1))(q, k, v).jaxpr
    assert _count(jaxpr, attention_fwd_p) == 1 and _count(jaxpr, attention_bwd_p) == 1
    jaxpr = jax.make_jaxpr(jax.vmap(lambda q, dq: jax.jvp(f, (q, k, v), (dq, k, v))))(q, q).jaxpr
    assert _count(jaxpr, attention_fwd_p) == 1 and _count(jaxpr, attention_tangent_p) == 1


# --- jit and sharding ---------------------------------------------------------------------------


@over_impls
def test_jit_matches_eager(impl):
    case = _packed_case(np.random.default_rng(21))
    f = case.ours(impl)
    eager, jitted = f(*case.args), jax.jit(f)(*case.args)
    jax.tree.map(lambda x, y: assert_close(x, y, rtol=1e-14, atol=1e-14), eager, jitted)
    jax.tree.map(assert_close, jitted, case.dense(*case.args))


@over_impls
def test_sharded_batch_matches_unsharded(impl):
    """q, k, v and the segment ids sharded along the batch over 8 devices: same values, the outputs
    stay sharded along the batch, and q, k, v are never communicated (only the small integer
    segment ids are gathered: the mask reads them at a traced batch index)."""
    mesh = jax.make_mesh((8,), ("batch",))
    batch = NamedSharding(mesh, PartitionSpec("batch"))
    rng = np.random.default_rng(22)
    q, k, v = qkv(rng, (8,), 12, 12, 2, 1, 4, 4)
    ids = segments(rng, 8, 12, n=3)

    def f(q, k, v, ids):
        return jf.attention(q, k, v, mask=masks.causal() & masks.document(ids), return_lse=True, implementation=impl)

    sharded = [jax.device_put(x, batch) for x in (q, k, v, ids)]
    compiled = jax.jit(f).lower(*sharded).compile()
    out, lse = compiled(*sharded)
    assert out.sharding.spec[0] == "batch" and lse.sharding.spec[0] == "batch"
    out_u, lse_u = f(q, k, v, ids)
    assert_close(out, out_u, rtol=1e-13, atol=1e-13)
    assert_close(lse, lse_u, rtol=1e-13, atol=1e-13)
    assert_close(out, dense(q, k, v, lambda b, h, i, j: ids[b, i] == ids[b, j] and j <= i)[0])
    collectives = re.compile(r"(all-gather|all-reduce|all-to-all|collective-permute)(-start)?\(")
    for line in compiled.as_text().splitlines():
        match = collectives.search(line)
        if match:  # the result type precedes the op name
            assert not re.search(r"\b(bf16|f16|f32|f64)\[", line[: match.start()]), line


def test_sharded_second_order_through_a_jvp_matches_unsharded():
    """The second-order rules through a jvp (its gradient; its jvp) run per shard at global batch
    indices (the document mask reads them)."""
    mesh = jax.make_mesh((8,), ("batch",))
    batch = NamedSharding(mesh, PartitionSpec("batch"))
    rng = np.random.default_rng(34)
    args = (*qkv(rng, (8,), 12, 12, 2, 1, 4, 4), *qkv(rng, (8,), 12, 12, 2, 1, 4, 4))
    ids = segments(rng, 8, 12, n=3)

    def second_order(q, k, v, dq, dk, dv, ids):
        attend = lambda q, k, v: jf.attention(q, k, v, mask=masks.causal() & masks.document(ids), return_lse=True)
        inner = lambda q, k, v: jax.jvp(attend, (q, k, v), (dq, dk, dv))[1]  # noqa: E731
        grads = jax.grad(_jvp_loss(attend), argnums=tuple(range(6)))(q, k, v, dq, dk, dv)
        return (*grads, *jax.jvp(inner, (q, k, v), (jnp.cos(dq), jnp.cos(dk), jnp.cos(dv)))[1])

    sharded = jax.jit(second_order)(*(jax.device_put(x, batch) for x in (*args, ids)))
    for g, w in zip(sharded, second_order(*args, ids), strict=True):
        assert g.sharding.spec[0] == "batch"
        assert_close(g, w, rtol=1e-12, atol=1e-12)


# --- dtypes -------------------------------------------------------------------------------------


def _cast(args, dtype):
    """q, k, v in ``dtype``; the bias in float32 (scores are float32 for every dtype below float64)."""
    q, k, v, bias = args
    return (*(np.asarray(x, np.float32).astype(dtype) for x in (q, k, v)), bias.astype(np.float32))


@over_impls
def test_float32_matches_float64(impl):
    case = _packed_case(np.random.default_rng(24))
    f = case.ours(impl)
    out64, lse64 = f(*case.args)
    out, lse = f(*_cast(case.args, np.float32))
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert_close(out, out64, rtol=1e-5, atol=1e-5)
    assert_close(lse, lse64, rtol=1e-5, atol=1e-5)


# bfloat16 / float16: the probabilities are rounded to the value dtype before p·v (like
# FlashAttention) and the output is rounded too; against float32 on the same rounded inputs the
# error is a few units of bfloat16's 2^-8, so 2e-2 absolute for outputs of size ~1.
HALF_TOL = dict(rtol=2e-2, atol=2e-2)


@over_impls
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16], ids=["bfloat16", "float16"])
def test_half_precision_close_to_float32(impl, dtype):
    rng = np.random.default_rng(25)
    case = _packed_case(rng)
    f = case.ours(impl)
    args = _cast(case.args, dtype)
    out, lse = f(*args)
    assert out.dtype == dtype and lse.dtype == np.float32
    out32, lse32 = f(*_cast(args, np.float32))  # the same rounded inputs
    assert_close(out, out32, **HALF_TOL)
    assert_close(lse, lse32, **HALF_TOL)
    if dtype != jnp.bfloat16:
        return
    # The backward in bfloat16 against float64 on the same rounded inputs, relative to the largest entry.
    w_out, w_lse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    loss = lambda *a: jnp.sum(f(*a)[0].astype(np.float64) * w_out) + jnp.sum(f(*a)[1] * w_lse)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    grads64 = jax.grad(loss, argnums=(0, 1, 2, 3))(*(np.asarray(x, np.float64) for x in args))
    for g, e, x in zip(grads, grads64, args):
        assert g.dtype == x.dtype
        assert_close(g, e, rtol=0, atol=5e-2 * float(np.abs(np.asarray(e)).max()))


# --- regressions: constant score_mod, empty sequences, int arrays captured beside float ones -------


def test_score_mod_returning_a_constant():
    q, k, v = qkv(np.random.default_rng(26), (B,), 5, 7, 2, 1, 4, 3)
    out = jf.attention(q, k, v, score_mod=lambda s, b, h, i, j: 0.0)  # uniform attention
    assert_close(out, np.broadcast_to(np.repeat(v, 2, axis=2).mean(axis=1, keepdims=True), out.shape))


# Empty calls and head dims run in the Pallas kernels too (interpret mode): their dispatch and padding.
over_impls_and_pallas = pytest.mark.parametrize(
    "impl", [*IMPLEMENTATIONS, Implementation("pallas_triton", block_q=8, block_kv=16)], ids=_impl_id
)

EMPTY_CASES = {  # (batch, Sq, Skv, Hq, Hkv): calls with no keys, or no rows to compute
    "no_keys": ((B,), 5, 0, 2, 1),
    "no_queries": ((B,), 0, 7, 2, 1),
    "no_batch_items": ((0,), 5, 7, 2, 1),
    "an_empty_batch_dim": ((B, 0), 5, 7, 2, 1),
    "no_heads": ((B,), 5, 7, 0, 0),
    "no_query_heads": ((B,), 5, 7, 0, 1),
}


@over_impls_and_pallas
@pytest.mark.parametrize("case", sorted(EMPTY_CASES))
def test_empty_calls(impl, case):
    """Every primitive returns zeros (no keys: every row fully masked, lse -inf) without entering
    the tiles, masks and score mods included (a document mask's spans of an empty batch)."""
    batch, sq, skv, hq, hkv = EMPTY_CASES[case]
    rng = np.random.default_rng(27)
    q, k, v = qkv(rng, batch, sq, skv, hq, hkv, 4, 3)
    mask = masks.causal() & masks.document(segments(rng, *batch, sq), segments(rng, *batch, skv))
    bias = jnp.asarray(rng.standard_normal(8))
    attend = lambda q, k, v: jf.attention(  # noqa: E731
        q, k, v, mask=mask, score_mod=lambda s, b, h, i, j: s + bias[h], return_lse=True, implementation=impl
    )
    out, lse = attend(q, k, v)
    assert out.shape == (*batch, sq, hq, 3) and lse.shape == (*batch, sq, hq)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)
    for x in jax.tree.leaves(_hvp(attend)(q, k, v, q, k, v)):
        np.testing.assert_array_equal(x, 0.0)  # no gradient, nor any change to it
    bias_loss = lambda bias: jnp.sum(jf.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h], implementation=impl) ** 2)  # noqa: E731
    np.testing.assert_array_equal(jax.grad(bias_loss)(bias), 0.0)
    vmapped = jax.vmap(attend)(*(jnp.zeros((0, *x.shape)) for x in (q, k, v)))  # a vmap of size 0
    assert [x.shape for x in vmapped] == [(0, *out.shape), (0, *lse.shape)]


@over_impls_and_pallas
@pytest.mark.parametrize("dims", [(0, 3), (4, 0)], ids=["no_key_features", "no_value_features"])
def test_empty_head_dims(impl, dims):
    """D = 0: every score is the score mod's of 0 (uniform attention without one); Dv = 0: an empty
    output, and the lse all the same. Values, gradients and their jvp against the dense attention."""
    d, dv = dims
    rng = np.random.default_rng(29)
    q, k, v = qkv(rng, (B,), 9, 13, HQ, HKV, d, dv)
    alibi = lambda s, b, h, i, j: s - 0.25 * (h + 1) * abs(i - j)  # noqa: E731
    ours = lambda q, k, v: jf.attention(  # noqa: E731
        q, k, v, mask=masks.causal(4), score_mod=alibi, scale=0.5, return_lse=True, implementation=impl
    )
    want_out, want_lse = dense(q, k, v, lambda b, h, i, j: j <= i + 4, alibi, scale=0.5)
    out, lse = ours(q, k, v)
    assert_close(out, want_out)
    assert_close(lse, want_lse)
    visible = allowed(lambda b, h, i, j: j <= i + 4, B, HQ, 9, 13)
    theirs = lambda q, k, v: dense_jnp(q, k, v, visible, alibi, scale=0.5)  # noqa: E731
    for a, w in zip(*(jax.tree.leaves(_hvp(f)(q, k, v, q, k, v)) for f in (ours, theirs))):
        assert_close(a, w, **DTOL)


@pytest.mark.parametrize("case", ["no_keys", "no_heads", "no_query_heads", "no_value_features"])
def test_dense_rules_take_empty_calls(case):
    """Third order, and second order in a captured array, differentiate the dense reference: it
    too takes calls with no keys, no heads or no value features, against jax's derivatives of the
    dense attention."""
    batch, sq, skv, hq, hkv = EMPTY_CASES.get(case, ((B,), 9, 13, HQ, HKV))
    rng = np.random.default_rng(30)
    q, k, v = qkv(rng, batch, sq, skv, hq, hkv, 4, 0 if case == "no_value_features" else 3)
    bias = jnp.asarray(rng.standard_normal(HQ))
    ours = lambda q, bias: jf.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * bias[h], return_lse=True)  # noqa: E731
    theirs = lambda q, bias: dense_jnp(q, k, v, None, lambda s, b, h, i, j: s * bias[h])  # noqa: E731

    def derivatives(attend):
        loss = lambda x, bias: jnp.sum(jnp.where(jnp.isfinite(lse := attend(q * x, bias)[1]), lse, 0) ** 2)  # noqa: E731
        return jax.jvp(jax.grad(jax.grad(loss)), (1.0, bias), (1.0, bias))[1], jax.hessian(loss, argnums=1)(1.0, bias)

    derivatives = jax.jit(derivatives, static_argnums=0)  # one program each, not ~300 small eager ones
    for a, w in zip(derivatives(ours), derivatives(theirs)):
        assert_close(a, w, **DTOL)


def _positions_case():
    """A relative bias read at captured integer positions: score_mod's consts are (pos: int32, bias: float)."""
    rng = np.random.default_rng(28)
    q, k, v = qkv(rng, (1,), 6, 6, 2, 1, 3, 2)
    pos_np = np.array([0, 1, 2, 5, 6, 9], np.int32)  # packed positions with gaps
    pos, bias = jnp.asarray(pos_np), rng.standard_normal((2, 19))
    w = rng.standard_normal((1, 6, 2, 2))
    ours = lambda q, bias: jnp.sum(jf.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h, pos[i] - pos[j] + 9]) * w)
    theirs = lambda q, bias: jnp.sum(dense_jnp(q, k, v, None, lambda s, b, h, i, j: s + bias[h, pos_np[i] - pos_np[j] + 9])[0] * w)
    return (q, bias), ours, theirs


def test_grad_of_bias_read_at_captured_int_positions():
    args, ours, theirs = _positions_case()
    for g, e in zip(jax.jit(jax.grad(ours, (0, 1)))(*args), jax.jit(jax.grad(theirs, (0, 1)))(*args)):
        assert_close(g, e, **DTOL)


def test_hvp_of_bias_read_at_captured_int_positions():
    args, ours, theirs = _positions_case()
    tangents = tuple(np.ones_like(a) for a in args)
    hvp = jax.jit(lambda f, *primals: jax.jvp(jax.grad(f, (0, 1)), primals, tangents), static_argnums=0)
    ours_hvp, theirs_hvp = hvp(ours, *args), hvp(theirs, *args)
    jax.tree.map(lambda x, y: assert_close(x, y, **DTOL), ours_hvp, theirs_hvp)


def test_vmap_of_jvp_with_an_unbatched_captured_bias():
    """vmap over q only: the bias tangent is per item while the bias itself is shared."""
    rng = np.random.default_rng(41)
    q = jnp.asarray(rng.standard_normal((3, 2, 9, 2, 4)))
    k = jnp.asarray(rng.standard_normal((2, 11, 2, 4)))
    bias = jnp.asarray(rng.standard_normal((2, 20)))
    f = lambda q, bias: jf.attention(q, k, k, score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 11], mask=jf.masks.causal(2))
    jvp = lambda q: jax.jvp(f, (q, bias), (q, bias * 0.5))[1]
    np.testing.assert_allclose(jax.vmap(jvp)(q), jnp.stack([jvp(x) for x in q]), atol=1e-12)
