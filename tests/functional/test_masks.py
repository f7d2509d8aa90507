"""A mask's positional form (what the kernels run) against its plain mask_mod, on every index."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.functional.attention import Implementation
from tests.attention_dense import visible_ranges

B, SQ, SKV = 2, 13, 17
rng = np.random.default_rng(0)
Q_IDS, KV_IDS = jnp.asarray(rng.integers(0, 4, (B, SQ))), jnp.asarray(rng.integers(0, 4, (B, SKV)))
QI, KI = np.asarray(Q_IDS), np.asarray(KV_IDS)
PREFIX = np.asarray([3, 9])
LENGTHS = np.asarray([16, 4])
VISIBLE = rng.random((B, 1, SQ, SKV)) < 0.4  # an array mask, jax.nn's layout: one for every head
# A longer sequence's arrays, of which blocks of SQ queries and SKV keys are taken
WQ_IDS, WKV_IDS = np.sort(rng.integers(0, 5, (B, SQ + 9)), axis=1), rng.integers(0, 3, (B, SKV + 6))
WIDE_VISIBLE = rng.random((B, 1, SQ + 4, SKV + 3)) < 0.4
QO = np.asarray([2, 7])  # a block's first query, per item
# name: (mask, the same mask written independently in numpy on (b, q, kv) index grids)
MASKS = {
    "document": (lambda: jf.masks.document(Q_IDS, KV_IDS), lambda b, q, kv: QI[b, q] == KI[b, kv]),
    "causal": (jf.masks.causal, lambda b, q, kv: kv <= q),
    "document&causal": (
        lambda: jf.masks.document(Q_IDS, KV_IDS) & jf.masks.causal(),
        lambda b, q, kv: (QI[b, q] == KI[b, kv]) & (kv <= q),
    ),
    "~document|window": (
        lambda: ~jf.masks.document(Q_IDS, KV_IDS) | jf.masks.sliding_window(3),
        lambda b, q, kv: (QI[b, q] != KI[b, kv]) | (np.abs(q - kv) < 3),
    ),
    "two_documents": (
        lambda: jf.masks.document(Q_IDS, KV_IDS) & jf.masks.document(Q_IDS % 2, KV_IDS % 2),
        lambda b, q, kv: (QI[b, q] == KI[b, kv]) & (QI[b, q] % 2 == KI[b, kv] % 2),
    ),
    "prefix_per_item": (lambda: jf.masks.prefix_lm(jnp.asarray(PREFIX)), lambda b, q, kv: (kv < PREFIX[b]) | (kv <= q)),
    "padding_per_item": (
        lambda: jf.masks.padding(jnp.asarray(LENGTHS), jnp.asarray(PREFIX)),
        lambda b, q, kv: (kv < LENGTHS[b]) & (q < PREFIX[b]),
    ),
    "causal_per_item": (lambda: jf.masks.causal(jnp.asarray([4, -6])), lambda b, q, kv: kv <= q + np.asarray([4, -6])[b]),
    "causal_int64_beyond_int32": (  # clipped into int32: the same comparisons
        lambda: jf.masks.causal(jnp.asarray([-(2**40), 3], jnp.int64)),
        lambda b, q, kv: kv <= q + np.asarray([-(2**40), 3])[b],
    ),
    "padding_int64_beyond_int32": (  # clipped into int32: the same comparisons
        lambda: jf.masks.padding(jnp.asarray([2**40, 5], jnp.int64)),
        lambda b, q, kv: kv < np.asarray([2**40, 5])[b],
    ),
    "block_mask_of_a_document": (  # the document's positional ids, the span evaluated
        lambda: jf.masks.block_mask(jf.masks.document(Q_IDS, KV_IDS), SQ, SKV, batch_shape=(B,)),
        lambda b, q, kv: QI[b, q] == KI[b, kv],
    ),
    "array_per_item": (lambda: jf.masks.from_array(jnp.asarray(VISIBLE)), lambda b, q, kv: VISIBLE[b, 0, q, kv]),
    "array_shared_and_causal": (  # (q_len, kv_len), given as a numpy array
        lambda: jf.masks.causal() & VISIBLE[1, 0],
        lambda b, q, kv: VISIBLE[1, 0, q, kv] & (kv <= q),
    ),
    "numpy_array_or_window": (  # the array on the left: numpy defers to Mask.__ror__
        lambda: VISIBLE[0, 0] | jf.masks.sliding_window(2),
        lambda b, q, kv: VISIBLE[0, 0, q, kv] | (np.abs(q - kv) < 2),
    ),
    "causal&window_per_item": (  # a window below 1 sees nothing
        lambda: jf.masks.causal() & jf.masks.sliding_window(jnp.asarray([0, 3])),
        lambda b, q, kv: (kv <= q) & (np.abs(q - kv) < np.asarray([0, 3])[b]),
    ),
    "chunked_per_item|causal": (
        lambda: jf.masks.chunked(jnp.asarray([3, 5])) | jf.masks.causal(-6),
        lambda b, q, kv: (q // np.asarray([3, 5])[b] == kv // np.asarray([3, 5])[b]) | (kv <= q - 6),
    ),
    "block_mask_per_item": (
        lambda: jf.masks.block_mask(lambda b, h, q, kv: KV_IDS[b, kv] <= Q_IDS[b, q], SQ, SKV, batch_shape=(B,)),
        lambda b, q, kv: KI[b, kv] <= QI[b, q],
    ),
    # shifted: the mask at (q + q_offset, kv + kv_offset); static offsets stay static masks
    "shifted_window&causal": (
        lambda: jf.masks.shifted(jf.masks.causal() & jf.masks.sliding_window(5), 9, 2),
        lambda b, q, kv: (kv + 2 <= q + 9) & (np.abs(q + 9 - kv - 2) < 5),
    ),
    "shifted_window_per_item": (
        lambda: jf.masks.shifted(jf.masks.sliding_window(4), jnp.asarray([0, 20]), jnp.asarray(11)),
        lambda b, q, kv: np.abs(q + np.asarray([0, 20])[b] - kv - 11) < 4,
    ),
    "shifted_chunked_per_item": (  # a chunk below 1 counts as 1
        lambda: jf.masks.shifted(jf.masks.chunked(jnp.asarray([4, 0])), jnp.asarray([0, 5]), 3),
        lambda b, q, kv: (q + np.asarray([0, 5])[b]) // np.asarray([4, 1])[b] == (kv + 3) // np.asarray([4, 1])[b],
    ),
    "shifted_chunked|prefix": (
        lambda: jf.masks.shifted(jf.masks.chunked(5) | jf.masks.prefix_lm(jnp.asarray(PREFIX)), jnp.asarray(7), 3),
        lambda b, q, kv: ((q + 7) // 5 == (kv + 3) // 5) | (kv + 3 < PREFIX[b]) | (kv + 3 <= q + 7),
    ),
    "shifted_mask_mod": (
        lambda: jf.masks.shifted(lambda b, h, q, kv: (q * kv + b) % 4 == 0, jnp.asarray([3, 1]), 0),
        lambda b, q, kv: ((q + np.asarray([3, 1])[b]) * kv + b) % 4 == 0,
    ),
    "shifted_padding_per_item": (
        lambda: jf.masks.shifted(jf.masks.padding(jnp.asarray(LENGTHS), jnp.asarray(PREFIX)), 2, 5),
        lambda b, q, kv: (kv + 5 < LENGTHS[b]) & (q + 2 < PREFIX[b]),
    ),
    "shifted_causal_per_item&document": (  # the document's ids are the block's own
        lambda: jf.masks.shifted(jf.masks.causal(jnp.asarray([4, -6])), 6, jnp.asarray([0, 9])) & jf.masks.document(Q_IDS, KV_IDS),
        lambda b, q, kv: (kv + np.asarray([0, 9])[b] <= q + 6 + np.asarray([4, -6])[b]) & (QI[b, q] == KI[b, kv]),
    ),
    # blocks of masks of per-position arrays: the arrays and their spans sliced
    "block_of_document&causal": (  # per-item query offsets, a traced key offset
        lambda: jf.masks.shifted(
            jf.masks.document(jnp.asarray(WQ_IDS), jnp.asarray(WKV_IDS)) & jf.masks.causal(), jnp.asarray(QO), jnp.asarray(5), q_len=SQ, kv_len=SKV
        ),
        lambda b, q, kv: (WQ_IDS[b, q + QO[b]] == WKV_IDS[b, kv + 5]) & (kv + 5 <= q + QO[b]),
    ),
    "block_of_array": (  # static offsets: the lengths default to the rest
        lambda: jf.masks.shifted(jf.masks.from_array(jnp.asarray(WIDE_VISIBLE)), 4, 3),
        lambda b, q, kv: WIDE_VISIBLE[b, 0, q + 4, kv + 3],
    ),
    "block_of_block_mask": (  # its pieces too
        lambda: jf.masks.shifted(
            jf.masks.block_mask(lambda b, h, q, kv: (jnp.asarray(WKV_IDS)[b, kv] == 1) | (q - kv < 2), SQ + 9, SKV + 6, batch_shape=(B,), ranges=2),
            jnp.asarray(6),
            2,
            q_len=SQ,
            kv_len=SKV,
        ),
        lambda b, q, kv: (WKV_IDS[b, kv + 2] == 1) | (q + 6 - kv - 2 < 2),
    ),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_positional_form_equals_the_mask(name):
    """The kernels' form (positional values sliced per tile) and ``bind`` (which reads them by
    index) both equal the mask written out in numpy, at every (b, q, kv)."""
    build, expected = MASKS[name]
    mask = build()
    fn, rows, cols = mask.bind_positional((B,), SQ, SKV)
    assert all(r.shape == (B, SQ) for r in rows) and all(c.shape == (B, SKV) for c in cols)
    b, q, kv = np.meshgrid(np.arange(B), np.arange(SQ), np.arange(SKV), indexing="ij")
    want = expected(b, q, kv)
    assert want.any() and not want.all()
    b, q, kv = (jnp.asarray(x) for x in (b, q, kv))
    values = [r[b, q] for r in rows] + [c[b, kv] for c in cols]
    np.testing.assert_array_equal(np.broadcast_to(fn(b, 0, q, kv, *values), want.shape), want)
    np.testing.assert_array_equal(np.broadcast_to(mask.bind((B,), SQ, SKV)(b, 0, q, kv), want.shape), want)
    called = jax.vmap(lambda b, q, kv: mask(b, 0, q, kv))(b.ravel(), q.ravel(), kv.ravel())  # the mask_mod, item by item
    np.testing.assert_array_equal(np.asarray(called).reshape(want.shape), want)


def test_document_ids_of_two_dtypes_are_promoted_once_or_refused_by_name_under_strict_promotion():
    mixed = jf.masks.document(Q_IDS.astype(jnp.int16), KV_IDS.astype(jnp.int32))
    b, q, kv = (jnp.asarray(x) for x in np.meshgrid(np.arange(B), np.arange(SQ), np.arange(SKV), indexing="ij"))
    with jax.numpy_dtype_promotion("strict"):
        np.testing.assert_array_equal(jax.vmap(mixed)(b.ravel(), 0 * b.ravel(), q.ravel(), kv.ravel()), (Q_IDS[b, q] == KV_IDS[b, kv]).ravel())
        with pytest.raises(TypeError, match="document: `segment_ids` has dtype int16 and `kv_segment_ids` uint32, which strict"):
            jf.masks.document(Q_IDS.astype(jnp.int16), KV_IDS.astype(jnp.uint32))


def test_document_masks_hand_their_ids_over_as_positional_arrays():
    """int32 ids go over as they are; 64-bit ones (jax_enable_x64, as here) as their int32 ranks,
    which are equal exactly where the ids are."""
    q32, kv32 = Q_IDS.astype(jnp.int32), KV_IDS.astype(jnp.int32)
    fn, rows, cols = (jf.masks.document(q32, kv32) & jf.masks.causal()).bind_positional((B,), SQ, SKV)
    np.testing.assert_array_equal(rows[0], Q_IDS)
    np.testing.assert_array_equal(cols[0], KV_IDS)
    assert bool(fn(0, 0, 3, 2, 5, 5)) and not bool(fn(0, 0, 3, 2, 5, 6)) and not bool(fn(0, 0, 2, 3, 5, 5))
    big = 2**40 if jnp.asarray(Q_IDS).dtype == jnp.int64 else 0  # beyond int32, where x64 allows it
    _, rows, cols = jf.masks.document(Q_IDS * 3 + big, KV_IDS * 3 + big).bind_positional((B,), SQ, SKV)
    assert rows[0].dtype == cols[0].dtype == jnp.int32
    same = lambda a, b: np.asarray(a)[:, :, None] == np.asarray(b)[:, None, :]  # noqa: E731
    np.testing.assert_array_equal(same(rows[0], cols[0]), same(Q_IDS, KV_IDS))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int64], ids=["int32", "int64"])
def test_an_eager_call_with_new_segment_ids_compiles_nothing(dtype, backend_compiles):
    """A document mask built outside ``jit`` computes its spans eagerly: a second call with other
    ids of the same shape reuses every compiled program (its binary search once recompiled at each
    call, 0.8 s a call). 64-bit ids are ranked first, by the same search."""
    q = jnp.ones((B, SQ, 2, 4))
    ids = lambda seed: jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 3, (B, SQ))), dtype)  # noqa: E731
    attend = lambda seed: jf.attention(q, q, q, mask=jf.masks.document(ids(seed)) & jf.masks.causal())  # noqa: E731
    jax.block_until_ready(attend(0))
    backend_compiles.clear()
    jax.block_until_ready(attend(1))
    assert backend_compiles == []


@pytest.mark.parametrize("kv_len", [None, SKV], ids=["self", "cross"])
def test_a_document_mask_of_a_new_shape_built_eagerly_compiles_one_program(kv_len, backend_compiles):
    """Its spans (a sort and a binary search each way) are one jitted program, not one compile
    per operation (0.6 s a new shape, now 0.25)."""
    ids = lambda n: jnp.asarray(np.sort(rng.integers(0, 3, (B + 1, n))).astype(np.int32))  # noqa: E731  a shape no other test uses
    q_ids, kv_ids = ids(SQ + 1), None if kv_len is None else ids(kv_len + 1)
    backend_compiles.clear()
    jax.block_until_ready(jax.tree.leaves(jf.masks.document(q_ids, kv_ids)))
    assert len(backend_compiles) == 1


def test_a_block_mask_built_eagerly_compiles_one_program_per_function_and_shape(backend_compiles):
    """Its evaluation is one jitted program; another closure of the same function (same program,
    other captured values of the same shape) reuses it, another shape compiles anew."""
    frames = lambda size: lambda b, h, q, kv: q // size >= kv // size  # noqa: E731
    table = lambda seed: jnp.asarray(np.random.default_rng(seed).random((SQ + 2, SKV)) < 0.5)  # noqa: E731
    reading = lambda t: lambda b, h, q, kv: t[q, kv]  # noqa: E731
    build = lambda fn, sq=SQ + 2: jax.block_until_ready(jax.tree.leaves(jf.masks.block_mask(fn, sq, SKV)))  # noqa: E731
    build(frames(3))
    build(reading(table(0)))
    backend_compiles.clear()
    build(reading(table(1)))
    assert backend_compiles == []
    build(frames(4))  # another program
    build(frames(4), sq=SQ + 3)
    assert len(backend_compiles) == 2


def test_a_block_mask_built_under_jit_from_traced_values_equals_the_eager_one():
    q = jnp.asarray(rng.normal(size=(B, SQ, 2, 4)))
    k = jnp.asarray(rng.normal(size=(B, SKV, 2, 4)))
    lengths = jnp.asarray([5, 11])
    mask = lambda n: jf.masks.block_mask(lambda b, h, i, j: (j < n[b]) & (j % 3 != 1), SQ, SKV, batch_shape=(B,))  # noqa: E731
    traced = jax.jit(lambda n: jf.attention(q, k, k, mask=mask(n)))(lengths)
    np.testing.assert_allclose(traced, jf.attention(q, k, k, mask=mask(lengths)), rtol=1e-12, atol=1e-12)
    for traced_range, eager_range in zip(jax.jit(lambda n: mask(n).ranges)(lengths), mask(lengths).ranges):
        np.testing.assert_array_equal(traced_range, eager_range)


def test_keys_sampled_on_a_masks_function_while_tracing():
    """What jf.attention's sequence split weighs its trade on when a block_mask's arrays are
    traced: the keys any head sees at the rows, counted on the function; nothing where the
    function reads traced arrays or the count would pass its budget."""
    rows = np.array([0, 5, 9])
    diagonal = lambda b, h, i, j: (j <= i) & (j >= i - 2 * h)  # a window per head: head 1 the widest
    counts = {}

    @jax.jit
    def under_jit(ids):
        evaluated = jf.masks.block_mask(diagonal, 10, 10, num_heads=2)
        counts["function"] = jf.masks.sampled_keys(evaluated, rows, 10, (3,), 2)
        counts["document"] = jf.masks.sampled_keys(jf.masks.document(ids), rows, 10, (3,), 2)
        counts["over budget"] = jf.masks.sampled_keys(evaluated, rows, 10, (3,), 2, budget=59)
        return ids

    under_jit(jnp.zeros((3, 10), jnp.int32))
    np.testing.assert_array_equal(counts["function"], [[1, 3, 3]])  # b unread: one item
    assert counts["document"] is None and counts["over budget"] is None


@pytest.mark.parametrize("name", sorted(MASKS))
def test_a_mask_passes_into_jit_as_an_argument(name):
    """A mask is a pytree of its runtime arrays: given to ``jit`` as an argument (its arrays
    traced) it masks as the same mask closed over; its leaves are exactly its arrays."""
    mask = MASKS[name][0]()
    leaves = jax.tree.leaves(mask)
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert bool(leaves) == (name not in ("causal", "shifted_window&causal"))
    q = jnp.asarray(rng.normal(size=(B, SQ, 2, 4)))
    k, v = (jnp.asarray(rng.normal(size=(B, SKV, 2, 4))) for _ in range(2))
    traced = jax.jit(lambda mask: jf.attention(q, k, v, mask=mask))(mask)
    np.testing.assert_allclose(traced, jf.attention(q, k, v, mask=mask), rtol=1e-12, atol=1e-12)


def test_a_mask_without_arrays_is_a_static_argument_that_compiles_once(backend_compiles):
    """``jit(..., static_argnames="mask")`` given a new ``causal() & sliding_window(8)`` at each
    step: masks built alike are equal and hash alike (those of functions closing over arrays when
    the arrays are the same), so the second call compiles nothing."""
    M = jf.masks
    assert M.causal() & M.sliding_window(8) == M.causal() & M.sliding_window(8)
    assert hash(M.chunked(4) | ~M.prefix_lm(2)) == hash(M.chunked(4) | ~M.prefix_lm(2))
    for other in (M.causal() & M.sliding_window(9), M.sliding_window(8) & M.causal(), M.causal(1)):
        assert M.causal() & M.sliding_window(8) != other
    table = jnp.arange(8) % 2 == 0  # functions closing over the same array: built alike, equal
    with_table = lambda table: M.causal() & (lambda b, h, i, j: table[j])  # noqa: E731
    assert with_table(table) == with_table(table) and hash(with_table(table)) == hash(with_table(table))
    assert with_table(table) != with_table(table + False)  # new arrays (pass them as an argument)
    ids = jnp.zeros((2, 8), jnp.int32)
    assert M.document(ids) != M.document(ids)  # its id ranges are arrays of its own
    q = jnp.asarray(rng.normal(size=(2, 8, 2, 4)))
    attend = jax.jit(lambda q, mask: jf.attention(q, q, q, mask=mask), static_argnames="mask")
    first = attend(q, mask=M.causal() & M.sliding_window(3))
    backend_compiles.clear()
    np.testing.assert_array_equal(attend(q, mask=M.causal() & M.sliding_window(3)), first)
    assert not backend_compiles


@pytest.mark.parametrize("build", ["from_mask_mod", "block_mask", "block_mask_ranges", "combined"])
def test_a_mask_of_a_function_closing_over_each_batchs_ids_compiles_once(build, backend_compiles):
    """A mask built afresh for each batch from a function that closes over the batch's ids (as
    FlexAttention users build a block mask per batch), handed to a jitted step as an argument:
    the ids are its leaves, traced, so the step compiles once and masks by each batch's ids."""
    builders = {
        "from_mask_mod": lambda fn: jf.masks.from_mask_mod(fn),
        "block_mask": lambda fn: jf.masks.block_mask(fn, SQ, SQ, batch_shape=(B,)),
        "block_mask_ranges": lambda fn: jf.masks.block_mask(fn, SQ, SQ, batch_shape=(B,), ranges=2),
        "combined": lambda fn: jf.masks.causal() & fn,
    }
    step = jax.jit(lambda q, mask: jf.attention(q, q, q, mask=mask))
    q = jnp.asarray(rng.normal(size=(B, SQ, 2, 4)))
    for i in range(3):
        ids = jnp.asarray(np.sort(rng.integers(0, 3, (B, SQ)), axis=1))
        mask = builders[build](lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx])
        assert any(leaf is ids or np.array_equal(leaf, ids) for leaf in jax.tree.leaves(mask))
        if i == 1:
            backend_compiles.clear()
        want = jf.attention(q, q, q, mask=jf.masks.document(ids) & (jf.masks.causal() if build == "combined" else jf.masks.full()))
        np.testing.assert_allclose(step(q, mask), want, rtol=1e-12, atol=1e-12)
        if i == 2:
            assert "jit(<lambda>)" not in backend_compiles, backend_compiles


@pytest.mark.parametrize("name", ["document&causal", "~document|window", "causal"])
@pytest.mark.parametrize("block", [1, 4, 5])
def test_a_picture_counts_each_blocks_visible_pairs(name, block):
    """Each character is its block of the numpy mask (edge blocks hold fewer pairs): every pair
    visible, some, none; the header counts the hidden blocks."""
    make, dense = MASKS[name]
    lines = jf.masks.picture(make(), SQ, SKV, block=block, b=1).split("\n")
    q, kv = np.meshgrid(np.arange(SQ), np.arange(SKV), indexing="ij")
    visible = dense(1, q, kv)
    expected = [
        "".join(
            "█" if tile.all() else "░" if tile.any() else "·"
            for tile in (visible[i : i + block, j : j + block] for j in range(0, SKV, block))
        )
        for i in range(0, SQ, block)
    ]
    assert lines[1:] == expected
    hidden = sum(line.count("·") for line in expected) / sum(map(len, expected))
    assert lines[0] == f"{len(expected)} x {len(expected[0])} blocks of {block} x {block}, {100 * hidden:.1f}% hidden"


def test_a_picture_takes_what_attention_takes_and_checks_its_sizes():
    causal = jf.masks.picture(jf.masks.causal(), 8, 8, block=2)
    assert jf.masks.picture(lambda b, h, i, j: j <= i, 8, 8, block=2) == causal
    assert jf.masks.picture(np.tril(np.ones((8, 8), bool)), 8, 8, block=2) == causal
    with pytest.raises(ValueError, match=r"picture: `block` must be >= 1, got 0"):
        jf.masks.picture(jf.masks.causal(), 8, 8, block=0)
    with pytest.raises(TypeError, match=r"picture: `q_len` must be a Python int"):
        jf.masks.picture(jf.masks.causal(), 8.0, 8)


def sink_or_window(b, h, q_idx, kv_idx):
    return (kv_idx < 2) | (q_idx - kv_idx < 4)


def test_a_mask_reads_as_it_was_built():
    """A notebook shows a mask in the calls and operators that build it, arrays by their type,
    with the parentheses Python's precedence (~, &, |) needs."""
    M, ids = jf.masks, jnp.zeros((2, 8), jnp.int32)
    cases = {
        "causal() & sliding_window(4)": M.causal() & M.sliding_window(4),
        "causal(3) | prefix_lm(int32[2])": M.causal(3) | M.prefix_lm(jnp.array([1, 2], jnp.int32)),
        "(causal() | prefix_lm(2)) & document(int32[2,8])": (M.causal() | M.prefix_lm(2)) & M.document(ids),
        "~(causal() & chunked(2))": ~(M.causal() & M.chunked(2)),
        "document(int32[2,8], int32[2,4]) & (kv_idx < int32[2])": M.document(ids, ids[:, :4]) & M.padding(jnp.array([3, 4], jnp.int32)),
        "shifted(sliding_window(3), 4, 0) & full()": M.shifted(M.sliding_window(3), 4, 0) & M.full(),
        "shifted(chunked(int32[2]), 2, 0)": M.shifted(M.chunked(jnp.array([2, 3], jnp.int32)), 2, 0),
        "from_array(bool[8,8]) | from_mask_mod(sink_or_window)": M.from_array(jnp.ones((8, 8), bool)) | sink_or_window,
        "block_mask(sink_or_window, 64, 64, ranges=2)": M.block_mask(sink_or_window, 64, 64, ranges=2),
        "block_mask(causal() & sliding_window(3), 8, 8)": M.block_mask(M.causal() & M.sliding_window(3), 8, 8),
    }
    for expected, mask in cases.items():
        assert repr(mask) == expected
    jax.jit(lambda ids: repr(M.document(ids)) == "document(int32[2,8])" or pytest.fail("traced ids"))(ids)


def test_masks_that_differ_only_in_their_arrays_share_a_compile(backend_compiles):
    """The static parts (ints, functions, how masks combine) are the tree's structure, compared by
    value: new ids or offsets reuse the program; another window compiles anew."""
    q = jnp.ones((B, SQ, 2, 4))
    attend = jax.jit(lambda mask: jf.attention(q, q, q, mask=mask))
    mask = lambda ids, offset, window: jf.masks.document(ids) & jf.masks.causal(offset) | jf.masks.sliding_window(window)  # noqa: E731
    masks = [mask(ids, jnp.asarray(offset), window) for ids, offset, window in ((Q_IDS, [0, 1], 2), (Q_IDS % 2, [3, -1], 2), (Q_IDS, [0, 1], 3))]
    jax.block_until_ready(attend(masks[0]))
    backend_compiles.clear()
    jax.block_until_ready(attend(masks[1]))
    assert backend_compiles == []
    jax.block_until_ready(attend(masks[2]))
    assert len(backend_compiles) == 1


@pytest.mark.parametrize("make", [jf.masks.sliding_window, jf.masks.chunked], ids=["sliding_window", "chunked"])
def test_a_traced_window_or_chunk_is_the_static_one(make):
    """A window or chunk passed into jit (so traced, bounding tiles at run time) attends as the int
    does (whose span is static), over several tiles; so does one an item against a loop."""
    q = jnp.asarray(rng.normal(size=(B, 40, 2, 4)))
    k, v = (jnp.asarray(rng.normal(size=(B, 45, 2, 4))) for _ in range(2))
    tiles = Implementation("xla", block_q=8, block_kv=16)
    attend = lambda n: jf.attention(q, k, v, mask=jf.masks.causal(5) & make(n), implementation=tiles)  # noqa: E731
    for n in (1, 7, 50):
        np.testing.assert_allclose(jax.jit(attend)(n), attend(n), rtol=1e-12, atol=1e-12)
    assert not np.allclose(attend(7), attend(50))  # the mask matters
    per_item = attend(jnp.asarray([3, 20]))
    for b, n in enumerate((3, 20)):
        np.testing.assert_allclose(per_item[b], attend(n)[b], rtol=1e-12, atol=1e-12)


def test_a_mask_vmaps_with_the_queries():
    """vmap over a mask argument slices its per-item arrays with the queries: the same as one call
    over the whole batch."""
    q = jnp.asarray(rng.normal(size=(B, SQ, 2, 4)))
    k = jnp.asarray(rng.normal(size=(B, SKV, 2, 4)))
    mask = jf.masks.document(Q_IDS, KV_IDS) & jf.masks.padding(jnp.asarray(LENGTHS)) & jf.masks.causal(jnp.asarray([4, -6]))
    mask = mask | jf.masks.from_array(jnp.asarray(VISIBLE))
    mapped = jax.vmap(lambda q, k, mask: jf.attention(q, k, k, mask=mask))(q, k, mask)
    np.testing.assert_allclose(mapped, jf.attention(q, k, k, mask=mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows_per_step", [1, 4, SQ])
def test_an_array_mask_measures_the_span_block_mask_evaluates(monkeypatch, rows_per_step):
    """from_array's ranges, measured at the call, and block_mask's for the same pairs are per item
    each query's keys seen by any head and seen whole by every head (and back), however many rows
    a step of their pass takes (4: the last step overlaps the one before)."""
    heads = 3
    visible = rng.random((B, heads, SQ, SKV)) < 0.5
    visible[:, :, 4] = False  # a query no head sees a key with
    visible[:, :, :, 5] = False  # a key no query sees
    visible[0, :, 6, 2:9] = True  # a run every head sees
    visible[1, :, 3:12, 7] = True  # and one down a key
    monkeypatch.setattr(jf.masks, "_PAIRS_PER_STEP", rows_per_step * B * heads * SKV)
    table = jnp.asarray(visible)
    evaluated = jf.masks.block_mask(lambda b, h, i, j: table[b, h, i, j], SQ, SKV, batch_shape=(B,), num_heads=heads)
    measured = jf.masks.from_array(table).span_arrays((B,), SQ, SKV, num_heads=heads)
    expected = visible_ranges(visible)
    for ranges in (measured, evaluated.span_arrays((B,), SQ, SKV, num_heads=heads)):
        assert len(ranges) == len(expected) == 6
        for got, want in zip(ranges, expected):
            np.testing.assert_array_equal(got, want)


def test_block_mask_of_an_array_measures_once_and_cuts():
    """An array reused across calls goes through block_mask once (no call measures its ranges
    again), which can cut it into pieces. A shared (q_len, kv_len) array reads neither b nor h."""
    q = jnp.asarray(rng.normal(size=(B, SQ, 2, 4)))
    k = jnp.asarray(rng.normal(size=(B, SKV, 2, 4)))
    i, j = np.arange(SQ)[:, None], np.arange(SKV)[None]
    visible = jnp.asarray((j < 2) | ((i >= j) & (i - j < 4)))  # sinks and a window: a gap to cut
    cut = jf.masks.block_mask(jf.masks.from_array(visible), SQ, SKV, ranges=2)
    assert len(cut.pieces()) == 2
    want = jf.attention(q, k, k, mask=visible)
    np.testing.assert_allclose(jf.attention(q, k, k, mask=cut), want, rtol=1e-12, atol=1e-12)
    per_head = jnp.asarray(rng.random((B, 2, SQ, SKV)) < 0.5)
    with pytest.raises(ValueError, match="reads its batch index b; pass batch_shape="):
        jf.masks.block_mask(jf.masks.from_array(per_head), SQ, SKV)
    evaluated = jf.masks.block_mask(jf.masks.from_array(per_head), SQ, SKV, batch_shape=(B,), num_heads=2)
    np.testing.assert_allclose(jf.attention(q, k, k, mask=evaluated), jf.attention(q, k, k, mask=per_head), rtol=1e-12, atol=1e-12)


def test_an_array_mask_broadcasts_over_batch_dims_heads_and_positions():
    """(1, B2, 1, SQ, 1) against q (B1, B2, ...): each item reads its own row of the array."""
    q = jnp.asarray(rng.normal(size=(3, B, SQ, 2, 4)))
    k = jnp.asarray(rng.normal(size=(3, B, SKV, 2, 4)))
    visible = rng.random((1, B, 1, SQ, 1)) < 0.6  # whole query rows hidden per item of the second dim
    out = jf.attention(q, k, k, mask=jnp.asarray(visible) | jf.masks.causal(-3))
    want = jf.attention(q, k, k, mask=lambda b, h, i, j: jnp.asarray(visible)[0, b % B, 0, i, 0] | (j <= i - 3))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "visible,error,match",
    [
        (np.zeros((SQ, SKV), np.float32), TypeError, r"from_array: a mask array must be boolean .* got dtype float32; an additive bias goes in score_mod"),
        (np.zeros(SKV, bool), ValueError, r"from_array: a mask array has shape .* got shape \(17,\)"),
        (np.zeros((SQ, SKV + 1), bool), ValueError, r"from_array: the mask array has shape \(13, 18\); .* = \(2, num_heads, 13, 17\)"),
        (np.zeros((3, SQ, SKV), bool), ValueError, r"the mask array has shape \(3, 13, 17\); .* = \(2, 2, 13, 17\)"),
        (np.zeros((3, 2, SQ, SKV), bool), ValueError, r"from_array: `the mask array` has leading dims \(3,\), which do not broadcast to the batch dims \(2,\)"),
    ],
    ids=["float", "one_dim", "keys", "heads", "batch"],
)
def test_a_wrong_mask_array_is_a_clear_error(visible, error, match):
    q = jnp.ones((B, SQ, 2, 4))
    k = jnp.ones((B, SKV, 2, 4))
    with pytest.raises(error, match=match):
        jf.attention(q, k, k, mask=visible)


@pytest.mark.parametrize(
    "batch,sq,skv,heads", [((B,), 5, 0, 2), ((B,), 0, 7, 2), ((0,), 5, 7, 2), ((B, 0), 5, 7, 2), ((B,), 5, 7, 0)],
    ids=["no_keys", "no_queries", "no_items", "an_empty_batch_dim", "no_heads"],
)
def test_an_array_mask_takes_empty_calls(batch, sq, skv, heads):
    """An empty array is traced all the same (its mask read at scalar indices): zeros, lse -inf, a
    zero gradient."""
    q, k = jnp.ones((*batch, sq, heads, 4)), jnp.ones((*batch, skv, max(heads // 2, 1) if heads else 0, 4))
    visible = jnp.ones((*batch, heads, sq, skv), bool)
    out, lse = jf.attention(q, k, k, mask=visible, return_lse=True)
    assert out.shape == q.shape and lse.shape == (*batch, sq, heads)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)
    np.testing.assert_array_equal(jax.grad(lambda q: jf.attention(q, k, k, mask=visible).sum())(q), 0.0)


@pytest.mark.parametrize(
    "mask, offsets, lengths, error, match",
    [
        (lambda: jf.masks.document(Q_IDS, KV_IDS), (jnp.asarray(1), 0), {}, TypeError, r"shifted: a document mask .* pass `q_len`"),
        (lambda: jf.masks.causal() & VISIBLE[0, 0], (0, 5), {"kv_len": 13}, ValueError, r"the block \[5, 18\) lies outside the 17 positions of the from_array"),
        (lambda: jf.masks.block_mask(lambda b, h, q, kv: q >= kv, SQ, SKV), (0, jnp.asarray(2)), {}, TypeError, r"block_mask mask .* pass `kv_len`"),
        (jf.masks.causal, (0, 0), {"q_len": -1}, ValueError, r"shifted: `q_len` must be"),
        (jf.masks.causal, (1.5, 0), {}, TypeError, r"shifted: `q_offset` must be an int or an integer array, got float"),
        (jf.masks.causal, (0, True), {}, TypeError, r"shifted: `kv_offset` must be an int or an integer array, got bool"),
        (jf.masks.causal, (jnp.asarray(1.0), 0), {}, TypeError, r"shifted: `q_offset` .* got dtype float"),
    ],
)
def test_bad_offsets_and_blocks_are_clear_errors(mask, offsets, lengths, error, match):
    with pytest.raises(error, match=match):
        jf.masks.shifted(mask(), *offsets, **lengths)


S_WHOLE = 64
W_IDS = np.sort(rng.integers(0, 6, (B, S_WHOLE)), axis=1)
WHOLE_MASKS = {  # over the whole sequence's positions
    "window|prefix": jf.masks.causal() & jf.masks.sliding_window(9) | jf.masks.prefix_lm(3),
    "document&causal": jf.masks.document(jnp.asarray(W_IDS)) & jf.masks.causal(),
    "block_mask_in_pieces": (  # the block's rows cut at the keys [16, 32) they do not see
        jf.masks.block_mask(lambda b, h, q, kv: (kv < 3) | ((kv <= q) & (q - kv < 6)), S_WHOLE, S_WHOLE, ranges=2)
    ),
}


@pytest.mark.parametrize("name", sorted(WHOLE_MASKS))
def test_a_shifted_block_attends_as_the_whole_sequence_does(name):
    """Attention of a block of queries to a block of keys under the shifted mask, the offsets traced
    (one per item for the queries), equals those rows and columns of the whole sequence's attention
    (the keys outside the block masked), and so do its gradients."""
    s, mask = S_WHOLE, WHOLE_MASKS[name]
    q, k, v = (jnp.asarray(rng.normal(size=(B, s, 2, 4))) for _ in range(3))
    q_at, kv_at, kv_len = np.asarray([40, 45]), 24, 24  # per item: q[b, q_at[b]:][:SQ]
    rows = q_at[:, None] + np.arange(SQ)
    q_block = jnp.asarray(np.asarray(q)[np.arange(B)[:, None], rows])
    k_block, v_block = k[:, kv_at : kv_at + kv_len], v[:, kv_at : kv_at + kv_len]
    inside = np.zeros((B, 1, s, s), bool)
    inside[..., kv_at : kv_at + kv_len] = True
    whole = lambda q, k, v: jf.attention(q, k, v, mask=mask & jf.masks.from_array(jnp.asarray(inside)))  # noqa: E731
    at = lambda qo, ko: jf.masks.shifted(mask, qo, ko, q_len=SQ, kv_len=kv_len)  # noqa: E731
    block = jax.jit(lambda q, k, v, qo, ko: jf.attention(q, k, v, mask=at(qo, ko)))
    want = np.asarray(whole(q, k, v))[np.arange(B)[:, None], rows]
    np.testing.assert_allclose(block(q_block, k_block, v_block, jnp.asarray(q_at), jnp.asarray(kv_at)), want, rtol=1e-12, atol=1e-12)
    g_out = jnp.asarray(rng.normal(size=want.shape))
    g_block = jax.grad(lambda q, k, v: jnp.sum(block(q, k, v, jnp.asarray(q_at), kv_at) * g_out), (0, 1, 2))(q_block, k_block, v_block)
    scattered = jnp.zeros((B, s, 2, 4)).at[jnp.arange(B)[:, None], rows].set(g_out)
    g_whole = jax.grad(lambda q, k, v: jnp.sum(whole(q, k, v) * scattered), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(g_block[0], np.asarray(g_whole[0])[np.arange(B)[:, None], rows], rtol=1e-11, atol=1e-12)
    for g, w in zip(g_block[1:], g_whole[1:]):
        np.testing.assert_allclose(g, w[:, kv_at : kv_at + kv_len], rtol=1e-11, atol=1e-12)
