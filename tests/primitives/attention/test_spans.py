"""Spans against the dense mask: the may-range holds every visible key (query) of a block, and
every key (query) of the sure-range is visible to the whole block — for every structured mask and
their combinations, on every block of a grid."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf

SQ, SKV = 23, 31
MASKS = {
    "causal": jf.masks.causal(),
    "causal+5": jf.masks.causal(5),
    "causal-4": jf.masks.causal(-4),
    "window": jf.masks.sliding_window(4),
    "window&causal": jf.masks.sliding_window(6) & jf.masks.causal(),
    "chunked": jf.masks.chunked(7),
    "chunked&causal": jf.masks.chunked(7) & jf.masks.causal(),
    "prefix": jf.masks.prefix_lm(9),
    "chunked|window": jf.masks.chunked(8) | jf.masks.sliding_window(2),
    "causal|prefix": jf.masks.causal(-10) | jf.masks.prefix_lm(3),
    "not_causal": ~jf.masks.causal(),
    "full": jf.masks.full(),
    "document": jf.masks.document(jnp.asarray(np.repeat(np.arange(5), 5)[:SQ]), jnp.asarray(np.repeat(np.arange(5), 7)[:SKV])),
}


def dense(mask):
    q, kv = np.meshgrid(np.arange(SQ), np.arange(SKV), indexing="ij")
    fn = mask.bind((), SQ, SKV)
    return np.broadcast_to(np.asarray(fn(0, 0, jnp.asarray(q), jnp.asarray(kv)), bool), q.shape)


BLOCKS = [(lo, hi) for lo, hi in itertools.combinations(range(0, 32, 3), 2)]


@pytest.mark.parametrize("name", sorted(MASKS))
def test_may_range_covers_and_sure_range_is_covered(name):
    mask = MASKS[name]
    span, visible = mask.span(), dense(mask)
    for lo, hi in BLOCKS:
        if lo < SQ:
            q_hi = min(hi, SQ)
            rows = visible[lo:q_hi]
            kv_lo, kv_hi = (int(x) for x in span.kv(lo, q_hi, SKV))
            seen = np.flatnonzero(rows.any(axis=0))
            assert all(kv_lo <= j < kv_hi for j in seen), (name, lo, q_hi, kv_lo, kv_hi, seen)
            f_lo, f_hi = (int(x) for x in span.full_kv(lo, q_hi, SKV))
            assert rows[:, max(f_lo, 0) : max(f_hi, f_lo, 0)].all(), (name, lo, q_hi, f_lo, f_hi)
        if lo < SKV:
            kv_hi = min(hi, SKV)
            cols = visible[:, lo:kv_hi]
            q_lo, q_hi = (int(x) for x in span.q(lo, kv_hi, SQ))
            seen = np.flatnonzero(cols.any(axis=1))
            assert all(q_lo <= i < q_hi for i in seen), (name, lo, kv_hi, q_lo, q_hi, seen)
            f_lo, f_hi = (int(x) for x in span.full_q(lo, kv_hi, SQ))
            assert cols[max(f_lo, 0) : max(f_hi, f_lo, 0)].all(), (name, lo, kv_hi, f_lo, f_hi)


def test_structured_masks_have_non_trivial_sure_ranges():
    """Causal blocks below the diagonal are known visible: the kernels skip their mask arithmetic."""
    f_lo, f_hi = (int(x) for x in jf.masks.causal().span().full_kv(16, 24, 64))
    assert (f_lo, f_hi) == (0, 17)
    f_lo, f_hi = (int(x) for x in (jf.masks.causal() & jf.masks.sliding_window(100)).span().full_kv(200, 208, 512))
    assert (f_lo, f_hi) == (108, 201)
