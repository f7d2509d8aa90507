"""The XLA lowering's tile bounds of spans that read arrays, joined over the batch items: every
lane walks the same tiles (the hull of the items', whole only where whole to every item), so its
tile loops' trip counts do not vary with the vmapped item."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.functional.attention import _mods
from jaxforge.lowering.attention.attention import xla
from jaxforge.primitives.attention.attention import Implementation

SQ, SKV, H, D = 70, 90, 2, 8
IDS = np.stack([np.repeat(np.arange(3), [20, 30, 40]), np.repeat(np.arange(2), [70, 20]), np.zeros(SKV, int)]).astype(np.int32)
MASKS = {  # per item: three layouts of documents, lengths, causal offsets, evaluated spans
    "document_causal": lambda: jf.masks.document(IDS[:, :SQ], IDS) & jf.masks.causal(SKV - SQ),
    "padding": lambda: jf.masks.padding(jnp.asarray([90, 17, 0]), jnp.asarray([70, 50, 33])),
    "causal_per_item": lambda: jf.masks.causal(jnp.asarray([-30, 0, 25])),
    "block_mask": lambda: jf.masks.block_mask(lambda b, h, i, j: (j < 9 + 30 * b) & (j > i - 40), SQ, SKV, batch_shape=(3,)),
}


def _bounds(name, items):
    mods, consts = _mods(MASKS[name](), None, None, (3,), SQ, SKV, jnp.float32, num_heads=H)
    geo = xla._geometry(jnp.zeros((3, SQ, H, D)), jnp.zeros((3, SKV, H, D)), 1.0, Implementation("xla", block_q=16, block_kv=16), mods)
    joined = xla._joined_bounds(geo, mods, consts, jnp.asarray(items))
    own = [mods.item_mask(b, consts).span for b in items]
    return geo, mods, joined, own


@pytest.mark.parametrize("name", sorted(MASKS))
def test_joined_bounds_are_the_hull_of_the_items_tiles_and_the_intersection_of_their_whole_ones(name):
    geo, mods, (rows, cols), own = _bounds(name, [0, 1, 2])
    for joined, bounds, tiles in ((rows, geo.row_bounds, geo.num_q_tiles), (cols, geo.col_bounds, geo.num_kv_tiles)):
        for t in range(tiles):
            lo, hi, full_lo, full_hi = np.array([[int(x) for x in bounds(mods, t, span)] for span in own]).T
            assert [int(x) for x in joined(t)] == [lo.min(), hi.max(), full_lo.max(), full_hi.min()], (name, t)


@pytest.mark.parametrize("item", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_one_items_joined_bounds_are_its_own(name, item):
    geo, mods, (rows, cols), (span,) = _bounds(name, [item])
    for joined, bounds, tiles in ((rows, geo.row_bounds, geo.num_q_tiles), (cols, geo.col_bounds, geo.num_kv_tiles)):
        for t in range(tiles):
            assert [int(x) for x in joined(t)] == [int(x) for x in bounds(mods, t, span)], (name, t)


def test_spans_without_arrays_keep_their_own_bounds():
    mods, consts = _mods(jf.masks.causal() & jf.masks.sliding_window(9), None, None, (3,), SQ, SKV, jnp.float32, num_heads=H)
    geo = xla._geometry(jnp.zeros((3, SQ, H, D)), jnp.zeros((3, SKV, H, D)), 1.0, Implementation("xla"), mods)
    assert xla._joined_bounds(geo, mods, consts, jnp.arange(3)) == ()
