"""A mask's positional form (what the kernels run) against its plain mask_mod, on every index."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf

B, SQ, SKV = 2, 13, 17
rng = np.random.default_rng(0)
Q_IDS, KV_IDS = jnp.asarray(rng.integers(0, 4, (B, SQ))), jnp.asarray(rng.integers(0, 4, (B, SKV)))
MASKS = {
    "document": lambda: jf.masks.document(Q_IDS, KV_IDS),
    "causal": jf.masks.causal,
    "document&causal": lambda: jf.masks.document(Q_IDS, KV_IDS) & jf.masks.causal(),
    "~document|window": lambda: ~jf.masks.document(Q_IDS, KV_IDS) | jf.masks.sliding_window(3),
    "two_documents": lambda: jf.masks.document(Q_IDS, KV_IDS) & jf.masks.document(Q_IDS % 2, KV_IDS % 2),
    "prefix_per_item": lambda: jf.masks.prefix_lm(jnp.asarray([3, 9])),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_positional_form_equals_the_mask_mod(name):
    mask = MASKS[name]()
    fn, rows, cols = mask.bind_positional((B,), SQ, SKV)
    plain = mask.bind((B,), SQ, SKV)
    assert all(r.shape == (B, SQ) for r in rows) and all(c.shape == (B, SKV) for c in cols)
    b, q, kv = np.meshgrid(np.arange(B), np.arange(SQ), np.arange(SKV), indexing="ij")
    b, q, kv = (jnp.asarray(x) for x in (b, q, kv))
    values = [r[b, q] for r in rows] + [c[b, kv] for c in cols]
    np.testing.assert_array_equal(fn(b, 0, q, kv, *values), plain(b, 0, q, kv))


def test_document_masks_hand_their_ids_over_as_positional_arrays():
    fn, rows, cols = (jf.masks.document(Q_IDS, KV_IDS) & jf.masks.causal()).bind_positional((B,), SQ, SKV)
    np.testing.assert_array_equal(rows[0], Q_IDS)
    np.testing.assert_array_equal(cols[0], KV_IDS)
    assert bool(fn(0, 0, 3, 2, 5, 5)) and not bool(fn(0, 0, 3, 2, 5, 6)) and not bool(fn(0, 0, 2, 3, 5, 5))
