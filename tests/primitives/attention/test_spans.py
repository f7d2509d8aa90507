"""Spans against the dense mask: the may-range holds every visible key (query) of a block, and
every key (query) of the sure-range is visible to the whole block — for every structured mask and
their combinations, on every block of a grid."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.primitives.attention.mods import count_below
from tests.attention_dense import visible_ranges

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
    "not_window": ~jf.masks.sliding_window(5),
    "not_chunked&causal": ~jf.masks.chunked(6) & jf.masks.causal(),
    "not(causal|prefix)": ~(jf.masks.causal(-3) | jf.masks.prefix_lm(4)),
    "not_not_causal": ~~jf.masks.causal(2),
    "full": jf.masks.full(),
    "padding": jf.masks.padding(20, 15),
    "padding&causal": jf.masks.padding(SKV, 9) & jf.masks.causal(),
    "not_padding": ~jf.masks.padding(12),
    "document": jf.masks.document(jnp.asarray(np.repeat(np.arange(5), 5)[:SQ]), jnp.asarray(np.repeat(np.arange(5), 7)[:SKV])),
    "shifted_window": jf.masks.shifted(jf.masks.sliding_window(4), 7, 0),
    "shifted_window_back": jf.masks.shifted(jf.masks.sliding_window(6), 0, 12),
    "shifted_window&causal": jf.masks.shifted(jf.masks.sliding_window(5) & jf.masks.causal(), 20, 3),
    "shifted_chunked": jf.masks.shifted(jf.masks.chunked(7), 3, 5),
    "shifted_prefix": jf.masks.shifted(jf.masks.prefix_lm(9), 4, 6),
    "shifted_padding": jf.masks.shifted(jf.masks.padding(20, 15), 2, 8),
}


def dense(mask, batch_shape=(), b=0):
    q, kv = np.meshgrid(np.arange(SQ), np.arange(SKV), indexing="ij")
    fn = mask.bind(batch_shape, SQ, SKV)
    return np.broadcast_to(np.asarray(fn(b, 0, jnp.asarray(q), jnp.asarray(kv)), bool), q.shape)


BLOCKS = [(lo, hi) for lo, hi in itertools.combinations(range(0, 32, 3), 2)]


@pytest.mark.parametrize("name", sorted(MASKS))
def test_may_range_covers_and_sure_range_is_covered(name):
    mask = MASKS[name]
    check_span(name, mask.span(), dense(mask), ())


def _ids(kind, seed, length):
    rng = np.random.default_rng(seed)
    return {
        "sorted": np.sort(rng.integers(0, 6, (2, length)), axis=-1),
        "scattered": rng.integers(0, 4, (2, length)),  # a segment's positions need not be contiguous
        "one": np.zeros((2, length), int),
        "distinct": np.tile(np.arange(length), (2, 1)),
    }[kind]


LAYOUTS = [(q, kv) for q in ("sorted", "scattered", "one", "distinct") for kv in ("same", "sorted", "scattered")]


@pytest.mark.parametrize("q_kind,kv_kind", LAYOUTS)
@pytest.mark.parametrize("combine", ["alone", "&causal", "|window", "~"])
def test_document_spans_from_segment_ids(q_kind, kv_kind, combine):
    """Document masks carry per-position ranges of each segment: blocks across documents are skipped."""
    if kv_kind == "same":  # self-attention style: the queries are the first SQ keys
        kv_ids = _ids(q_kind, 1, SKV)
        q_ids = kv_ids[:, :SQ]
    else:
        q_ids, kv_ids = _ids(q_kind, 1, SQ), _ids(kv_kind, 2, SKV)
    mask = jf.masks.document(jnp.asarray(q_ids), jnp.asarray(kv_ids))
    mask = {
        "alone": mask,
        "&causal": mask & jf.masks.causal(),
        "|window": mask | jf.masks.sliding_window(3),
        "~": ~mask,
    }[combine]
    span, arrays = mask.span(), mask.span_arrays((2,), SQ, SKV)
    assert len(arrays) == span.num_arrays == 6
    for b in range(2):
        check_span(f"{q_kind}/{kv_kind}/{combine}/b{b}", span, dense(mask, (2,), b), tuple(a[b] for a in arrays))


def test_document_span_skips_across_documents():
    ids = jnp.asarray(np.repeat(np.arange(4), 8))  # four documents of 8
    mask = jf.masks.document(ids)
    data = tuple(a[0] for a in mask.span_arrays((), 32, 32))
    assert tuple(int(x) for x in mask.span().kv(8, 16, 32, data)) == (8, 16)
    assert tuple(int(x) for x in mask.span().full_kv(8, 16, 32, data)) == (8, 16)
    assert tuple(int(x) for x in mask.span().kv(4, 12, 32, data)) == (0, 16)
    f_lo, f_hi = (int(x) for x in mask.span().full_kv(4, 12, 32, data))
    assert f_lo >= f_hi  # two documents: no key is seen by every row


def check_span(name, span, visible, data, surely_visible=None, blocks=BLOCKS):
    """The may-ranges hold every pair of ``visible``; the sure-ranges only pairs of ``surely_visible``
    (default ``visible``; a head-dependent mask: visible at every head)."""
    surely_visible = visible if surely_visible is None else surely_visible
    sq, skv = visible.shape
    for lo, hi in blocks:
        if lo < sq:
            q_hi = min(hi, sq)
            rows = visible[lo:q_hi]
            kv_lo, kv_hi = (int(x) for x in span.kv(lo, q_hi, skv, data))
            seen = np.flatnonzero(rows.any(axis=0))
            assert all(kv_lo <= j < kv_hi for j in seen), (name, lo, q_hi, kv_lo, kv_hi, seen)
            f_lo, f_hi = (int(x) for x in span.full_kv(lo, q_hi, skv, data))
            assert surely_visible[lo:q_hi, max(f_lo, 0) : max(f_hi, f_lo, 0)].all(), (name, lo, q_hi, f_lo, f_hi)
        if lo < skv:
            kv_hi = min(hi, skv)
            cols = visible[:, lo:kv_hi]
            q_lo, q_hi = (int(x) for x in span.q(lo, kv_hi, sq, data))
            seen = np.flatnonzero(cols.any(axis=1))
            assert all(q_lo <= i < q_hi for i in seen), (name, lo, kv_hi, q_lo, q_hi, seen)
            f_lo, f_hi = (int(x) for x in span.full_q(lo, kv_hi, sq, data))
            assert surely_visible[max(f_lo, 0) : max(f_hi, f_lo, 0), lo:kv_hi].all(), (name, lo, kv_hi, f_lo, f_hi)


def test_negated_masks_skip_tiles():
    """``~causal`` (keys after the query) skips every tile below the diagonal and knows the ones above."""
    span = (~jf.masks.causal()).span()
    assert tuple(int(x) for x in span.kv(16, 24, 64)) == (17, 64)
    assert tuple(int(x) for x in span.full_kv(16, 24, 64)) == (24, 64)
    ids = jnp.asarray(np.repeat(np.arange(4), 8))
    mask = ~jf.masks.document(ids)
    data = tuple(a[0] for a in mask.span_arrays((), 32, 32))
    assert len(data) == mask.span().num_arrays == 6
    assert tuple(int(x) for x in mask.span().full_kv(8, 16, 32, data)) == (16, 32)  # the longer side


def test_structured_masks_have_non_trivial_sure_ranges():
    """Causal blocks below the diagonal are known visible: the kernels skip their mask arithmetic."""
    f_lo, f_hi = (int(x) for x in jf.masks.causal().span().full_kv(16, 24, 64))
    assert (f_lo, f_hi) == (0, 17)
    f_lo, f_hi = (int(x) for x in (jf.masks.causal() & jf.masks.sliding_window(100)).span().full_kv(200, 208, 512))
    assert (f_lo, f_hi) == (108, 201)


@pytest.mark.parametrize("combine", ["alone", "&window", "|chunked", "&document"])
def test_per_batch_prefix_spans(combine):
    """prefix_lm with one length per batch item reads its length as span data."""
    mask = jf.masks.prefix_lm(jnp.asarray([0, 4, 17, 31])[:2])
    mask = {
        "alone": mask,
        "&window": mask & jf.masks.sliding_window(5),
        "|chunked": mask | jf.masks.chunked(6),
        "&document": mask & jf.masks.document(jnp.asarray(_ids("sorted", 3, SQ)), jnp.asarray(_ids("sorted", 4, SKV))),
    }[combine]
    span, arrays = mask.span(), mask.span_arrays((2,), SQ, SKV)
    assert len(arrays) == span.num_arrays
    for b in range(2):
        check_span(f"prefix/{combine}/b{b}", span, dense(mask, (2,), b), tuple(a[b] for a in arrays))
    f_lo, f_hi = (int(x) for x in jf.masks.prefix_lm(jnp.asarray([12])).span().full_kv(0, 4, 31, (jnp.asarray(12),)))
    assert (f_lo, f_hi) == (0, 12)


@pytest.mark.parametrize("combine", ["kv", "kv_and_q", "&causal", "|window", "~"])
def test_per_batch_padding_spans(combine):
    """padding's lengths per batch item are span data: tiles past an item's lengths are skipped."""
    kv_lengths, q_lengths = jnp.asarray([31, 7]), jnp.asarray([0, 14])  # item 0: no valid query
    mask = {
        "kv": jf.masks.padding(kv_lengths),
        "kv_and_q": jf.masks.padding(kv_lengths, q_lengths),
        "&causal": jf.masks.padding(kv_lengths, q_lengths) & jf.masks.causal(),
        "|window": jf.masks.padding(kv_lengths) | jf.masks.sliding_window(3),
        "~": ~jf.masks.padding(kv_lengths, q_lengths),
    }[combine]
    span, arrays = mask.span(), mask.span_arrays((2,), SQ, SKV)
    assert len(arrays) == span.num_arrays
    for b in range(2):
        check_span(f"padding/{combine}/b{b}", span, dense(mask, (2,), b), tuple(a[b] for a in arrays))


@pytest.mark.parametrize("combine", ["alone", "&window", "&padding", "|prefix", "~"])
def test_per_batch_causal_offset_spans(combine):
    """causal with one offset per batch item (a decoding step over KV caches) reads it as span
    data, and its spans are the static offset's Band's."""
    offsets = jnp.asarray([8, -5])
    mask = jf.masks.causal(offsets)
    mask = {
        "alone": mask,
        "&window": mask & jf.masks.sliding_window(6),
        "&padding": mask & jf.masks.padding(jnp.asarray([20, 31])),
        "|prefix": mask | jf.masks.prefix_lm(3),
        "~": ~mask,
    }[combine]
    span, arrays = mask.span(), mask.span_arrays((2,), SQ, SKV)
    assert len(arrays) == span.num_arrays
    for b in range(2):
        check_span(f"causal_offsets/{combine}/b{b}", span, dense(mask, (2,), b), tuple(a[b] for a in arrays))
    per_item, static = jf.masks.causal(jnp.asarray([8])).span(), jf.masks.causal(8).span()
    for method in ("kv", "full_kv", "q", "full_q"):
        size = SKV if "kv" in method else SQ
        got = getattr(per_item, method)(4, 12, size, (jnp.asarray(8),))
        assert tuple(int(x) for x in got) == tuple(int(x) for x in getattr(static, method)(4, 12, size)), method


@pytest.mark.parametrize("make", ["window", "chunked"])
@pytest.mark.parametrize("combine", ["alone", "&causal", "|prefix", "~", "shifted"])
def test_per_batch_window_and_chunk_spans(make, combine):
    """A window or chunk given as an array (one per item; traced alike) reads its spans' data at
    run time; a chunk's ranges are exact: a query's [lo, hi) holds just its chunk's keys."""
    mask = {"window": jf.masks.sliding_window, "chunked": jf.masks.chunked}[make](jnp.asarray([5, 9]))
    mask = {
        "alone": mask,
        "&causal": mask & jf.masks.causal(),
        "|prefix": mask | jf.masks.prefix_lm(3),
        "~": ~mask,
        "shifted": jf.masks.shifted(mask, jnp.asarray([0, 25]), jnp.asarray(14)),
    }[combine]
    span, arrays = mask.span(), mask.span_arrays((2,), SQ, SKV)
    assert len(arrays) == span.num_arrays
    for b in range(2):
        visible = dense(mask, (2,), b)
        check_span(f"{make}_per_item/{combine}/b{b}", span, visible, tuple(a[b] for a in arrays))
        if make == "chunked" and combine in ("alone", "shifted"):
            lo, hi = (np.asarray(a[b]) for a in arrays[:2])
            np.testing.assert_array_equal(np.maximum(hi - lo, 0), visible.sum(1))


def test_padding_spans_are_tight():
    """The keys past the length, and the queries past theirs, are never visited."""
    span = jf.masks.padding(jnp.asarray([10]), jnp.asarray([5])).span()
    data = (jnp.asarray(10), jnp.asarray(5))
    bounds = lambda fn, lo, hi, size: tuple(int(x) for x in fn(lo, hi, size, data))  # noqa: E731
    assert bounds(span.kv, 0, 8, 31) == bounds(span.full_kv, 0, 4, 31) == (0, 10)
    assert bounds(span.kv, 8, 16, 31)[1] <= 0 and bounds(span.full_kv, 0, 8, 31)[1] <= 0
    assert bounds(span.q, 0, 8, 23) == bounds(span.full_q, 0, 8, 23) == (0, 5)
    assert bounds(span.q, 12, 20, 23)[1] <= 0 and bounds(span.full_q, 4, 12, 23)[1] <= 0


@pytest.mark.parametrize("inclusive", [False, True])
@pytest.mark.parametrize("dtypes", [(np.int32, np.int32), (np.int64, np.int32), (np.int8, np.int64)])
def test_count_below_is_searchsorted(inclusive, dtypes):
    """The binary search that document spans use, against numpy's searchsorted: ties, absent ids,
    extremes of the dtypes, rows of one batch, and (exported with a symbolic length) int32's
    full count of steps."""
    rng = np.random.default_rng(3)
    values_dtype, queries_dtype = dtypes
    lo = max(np.iinfo(values_dtype).min, np.iinfo(queries_dtype).min)
    hi = min(np.iinfo(values_dtype).max, np.iinfo(queries_dtype).max)
    values = rng.integers(-4, 5, (3, 17)).astype(values_dtype)
    queries = rng.integers(-6, 7, (3, 11)).astype(queries_dtype)
    values[0, :2], queries[1, :2] = (lo, hi), (lo, hi)
    values = np.sort(values, axis=-1)
    side = "right" if inclusive else "left"
    want = [np.searchsorted(v, q, side=side) for v, q in zip(values, queries)]
    count = lambda v, q: count_below(v, q, inclusive=inclusive)  # noqa: E731
    t, s = jax.export.symbolic_shape("t, s")
    specs = jax.ShapeDtypeStruct((3, t), values.dtype), jax.ShapeDtypeStruct((3, s), queries.dtype)
    exported = jax.export.export(jax.jit(count))(*specs)
    for got in (count(jnp.asarray(values), jnp.asarray(queries)), exported.call(values, queries)):
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, want)


# --- block_mask: spans measured by evaluating a plain mask_mod --------------------------------------

TABLE = np.random.default_rng(5).random((2, 3, SQ, SKV)) < 0.3  # (item, head, q, kv)
TABLE[0, :, 4] = False  # a query no head of item 0 sees a key with
# name: (mask_mod, block_mask keywords, numpy visibility (item, head, q, kv))
EVALUATED = {
    "frames_causal": (lambda b, h, i, j: i // 5 >= j // 5, {}, lambda b, h, i, j: i // 5 >= j // 5),
    "captured_table": (lambda b, h, i, j: jnp.asarray(TABLE[0, 0])[i, j], {}, lambda b, h, i, j: TABLE[0, 0][i, j]),
    "per_item_and_head": (
        lambda b, h, i, j: jnp.asarray(TABLE)[b, h, i, j] | ((j <= i) & (j > i - 2 * h - 2)),
        dict(batch_shape=(2,), num_heads=3),
        lambda b, h, i, j: TABLE[b, h, i, j] | ((j <= i) & (j > i - 2 * h - 2)),
    ),
    "nothing": (lambda b, h, i, j: i < -1, {}, lambda b, h, i, j: i < -1),
    "a_library_mask": (jf.masks.causal(-3) | jf.masks.sliding_window(2), {}, lambda b, h, i, j: (j <= i - 3) | (abs(i - j) < 2)),
}


def _evaluated(name):
    fn, keywords, expected = EVALUATED[name]
    b, h, q, kv = np.meshgrid(np.arange(2), np.arange(3), np.arange(SQ), np.arange(SKV), indexing="ij")
    return jf.masks.block_mask(fn, SQ, SKV, **keywords), np.broadcast_to(expected(b, h, q, kv), b.shape)


@pytest.mark.parametrize("name", sorted(EVALUATED))
def test_block_mask_ranges_are_each_positions_visible_keys_and_queries(name):
    """Each query's range is the hull of the keys any head shows it, its sure range the run of keys
    every head shows it from there (and the same for each key): computed here by brute force."""
    mask, visible = _evaluated(name)
    arrays = mask.span_arrays((2,), SQ, SKV, num_heads=3)
    for got, want in zip(arrays, visible_ranges(visible), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("name", sorted(EVALUATED))
def test_block_mask_spans_hold_the_mask(name):
    mask, visible = _evaluated(name)
    span, arrays = mask.span(), mask.span_arrays((2,), SQ, SKV, num_heads=3)
    for combine, other in (("alone", None), ("&causal", jf.masks.causal(4)), ("|window", jf.masks.sliding_window(3)), ("~", "~")):
        combined = mask if other is None else ~mask if other == "~" else (mask & other if combine[0] == "&" else mask | other)
        c_span, c_arrays = combined.span(), combined.span_arrays((2,), SQ, SKV, num_heads=3)
        for b in range(2):
            per_head = np.stack([np.asarray(_bound(combined, b, h)) for h in range(3)])
            check_span(f"{name}/{combine}/b{b}", c_span, per_head.any(0), tuple(a[b] for a in c_arrays), per_head.all(0))
    assert len(arrays) == span.num_arrays == 6


def _bound(mask, b, h):
    q, kv = np.meshgrid(np.arange(SQ), np.arange(SKV), indexing="ij")
    return np.broadcast_to(mask.bind((2,), SQ, SKV)(b, h, jnp.asarray(q), jnp.asarray(kv)), q.shape)


def test_block_mask_of_frames_skips_the_tiles_above_them():
    """Frame-causal attention (video, world models): a block of queries sees the keys up to the end
    of its last frame, and surely all of them up to its first frame's end."""
    mask = jf.masks.block_mask(lambda b, h, i, j: i // 8 >= j // 8, 64, 64)
    span, data = mask.span(), tuple(a[0] for a in mask.span_arrays((), 64, 64))
    assert tuple(int(x) for x in span.kv(16, 24, 64, data)) == (0, 24)
    assert tuple(int(x) for x in span.full_kv(16, 24, 64, data)) == (0, 24)
    assert tuple(int(x) for x in span.kv(20, 28, 64, data)) == (0, 32)
    assert tuple(int(x) for x in span.full_kv(20, 28, 64, data)) == (0, 24)
    assert tuple(int(x) for x in span.q(16, 24, 64, data)) == (16, 64)
    assert tuple(int(x) for x in span.full_q(16, 24, 64, data)) == (16, 64)


# --- block_mask(ranges=n): a mask cut into pieces at each query's widest gaps ------------------------

PQ, PKV = 45, 100  # key blocks of 16 (the cut resolution): [0, 16) ... [96, 100)
BANDS = np.random.default_rng(6).random((2, 3, PQ, PKV)) < 0.5  # (item, head, q, kv)


def _bands(b, h, i, j, table):
    """Three bands of keys, [0, 8), [40, 44) and [82, 100) (gaps of one and two whole hidden blocks),
    drawn per item and head, plus a window that walks from the first band over the second."""
    return (table[b, h, i, j] & ((j < 8) | ((j >= 40) & (j < 44)) | (j >= 82))) | ((j >= i) & (j < i + 4))


@pytest.mark.parametrize("ranges", [2, 3])
def test_block_mask_pieces_split_the_mask_and_their_spans_hold_them(ranges):
    """Each visible pair lies in exactly one piece; each piece's measured spans hold it."""
    fn = lambda b, h, i, j: _bands(b, h, i, j, jnp.asarray(BANDS))  # noqa: E731
    mask = jf.masks.block_mask(fn, PQ, PKV, batch_shape=(2,), num_heads=3, ranges=ranges)
    pieces = mask.pieces()
    assert len(pieces) == ranges
    q, kv = (jnp.asarray(x) for x in np.meshgrid(np.arange(PQ), np.arange(PKV), indexing="ij"))
    blocks = list(itertools.combinations(range(0, PKV + 5, 6), 2))
    for b in range(2):
        count = 0
        for p, piece in enumerate(pieces):
            per_head = np.stack([np.broadcast_to(piece.bind((2,), PQ, PKV)(b, h, q, kv), q.shape) for h in range(3)])
            np.testing.assert_array_equal(per_head, np.stack([np.broadcast_to(piece(b, h, q, kv), q.shape) for h in range(3)]))
            data = tuple(a[b] for a in piece.span_arrays((2,), PQ, PKV, num_heads=3))
            check_span(f"piece {p}/b{b}", piece.span(), per_head.any(0), data, per_head.all(0), blocks=blocks)
            count = count + per_head
        np.testing.assert_array_equal(count, _bands(b, np.arange(3)[:, None, None], np.asarray(q), np.asarray(kv), BANDS))


@pytest.mark.parametrize("ranges", [2, 3, 4])
def test_block_mask_cuts_at_the_widest_gaps(ranges):
    """Each row's keys are cut at its ``ranges - 1`` widest runs of hidden blocks (the first of equal
    ones), in order; fewer runs leave empty pieces at the row's end. Brute force per row."""
    table = BANDS[:1, :1]
    pieces = jf.masks.block_mask(lambda b, h, i, j: _bands(0, 0, i, j, jnp.asarray(table)), PQ, PKV, ranges=ranges).pieces()
    for row in range(PQ):
        keys = np.flatnonzero(_bands(0, 0, row, np.arange(PKV), table))
        seen = [any(16 * k <= key < 16 * k + 16 for key in keys) for k in range(-(-PKV // 16))]
        runs, start = [], None  # runs of hidden blocks between seen ones: [start, end)
        for k, s in enumerate(seen):
            if not s and start is None and any(seen[:k]):
                start = k
            if s and start is not None:
                runs, start = [*runs, (start, k)], None
        cut = sorted(sorted(runs, key=lambda r: (r[0] - r[1], r[0]))[: ranges - 1])
        bounds = [keys[0], *(16 * e for _, e in cut)], [*(16 * s for s, _ in cut), keys[-1] + 1]
        want = [*zip(*bounds)] + [(keys[-1] + 1, keys[-1] + 1)] * (ranges - 1 - len(cut))
        got = [(int(p.mask.lo[row]), int(p.mask.hi[row])) for p in pieces]
        assert got == want, (row, got, want)


@pytest.mark.parametrize("sq,skv", [(5, 0), (0, 5), (0, 0)])
def test_block_mask_pieces_of_empty_sequences(sq, skv):
    """No gap to cut: one piece, and attention's zeros (and zero gradients) as for any mask."""
    mask = jf.masks.block_mask(lambda b, h, i, j: j <= i, sq, skv, ranges=3)
    assert mask.pieces() == (mask,)
    q, kv = jnp.ones((1, sq, 1, 4)), jnp.ones((1, skv, 1, 4))
    np.testing.assert_array_equal(jf.attention(q, kv, kv, mask=mask), np.zeros((1, sq, 1, 4)))
    np.testing.assert_array_equal(jax.grad(lambda q: jf.attention(q, kv, kv, mask=mask).sum())(q), np.zeros(q.shape))


@pytest.mark.parametrize("combine", ["window", "window&causal", "prefix|chunked", "~padding"])
def test_per_batch_shifted_spans(combine):
    """A mask shifted by offsets given as arrays (one per item for the queries) reads them as span
    data; a block the shifted mask hides has an empty range, so attention visits none of its tiles."""
    mask = {
        "window": jf.masks.sliding_window(4),
        "window&causal": jf.masks.sliding_window(6) & jf.masks.causal(),
        "prefix|chunked": jf.masks.prefix_lm(jnp.asarray([2, 12])) | jf.masks.chunked(5),
        "~padding": ~jf.masks.padding(jnp.asarray([9, 30])),
    }[combine]
    mask = jf.masks.shifted(mask, jnp.asarray([0, 25]), jnp.asarray(14))
    span, arrays = mask.span(), mask.span_arrays((2,), SQ, SKV)
    assert len(arrays) == span.num_arrays
    for b in range(2):
        check_span(f"shifted/{combine}/b{b}", span, dense(mask, (2,), b), tuple(a[b] for a in arrays))
    far = jf.masks.shifted(jf.masks.sliding_window(4) & jf.masks.causal(), jnp.asarray(64), jnp.asarray(0))
    lo, hi = (int(x) for x in far.span().kv(0, SQ, SKV, tuple(a[0] for a in far.span_arrays((), SQ, SKV))))
    assert lo >= hi


# name: a mask reading per-position arrays over a longer sequence (2 items, 3 heads, SQ + 9 × SKV + 6)
WIDE = np.random.default_rng(8).random((2, 3, SQ + 9, SKV + 6)) < 0.3
WIDE_IDS = np.sort(np.random.default_rng(9).integers(0, 6, (2, SKV + 6)), axis=-1)
OF_ARRAYS = {
    "document": jf.masks.document(jnp.asarray(WIDE_IDS[:, : SQ + 9]), jnp.asarray(WIDE_IDS)),
    "array": jf.masks.from_array(jnp.asarray(WIDE)),
    "block_mask": jf.masks.block_mask(lambda b, h, i, j: jnp.asarray(WIDE)[b, h, i, j] | (i == j), SQ + 9, SKV + 6, batch_shape=(2,), num_heads=3),
}


@pytest.mark.parametrize("name", sorted(OF_ARRAYS))
def test_blocks_of_masks_of_arrays_keep_spans_that_hold_them(name):
    """A block of SQ queries and SKV keys (static, traced and per-item offsets) is the whole mask's
    rows and columns there, and its spans, sliced from the whole mask's, hold it; a document of
    contiguous segments keeps exact ranges (its tiles across documents still skipped)."""
    whole = OF_ARRAYS[name]
    for qo, ko in ((5, 2), (jnp.asarray(9), jnp.asarray(6)), (jnp.asarray([0, 7]), jnp.asarray(3))):
        mask = jf.masks.shifted(whole, qo, ko, q_len=SQ, kv_len=SKV)
        span, arrays = mask.span(), mask.span_arrays((2,), SQ, SKV, num_heads=3)
        q, kv = (jnp.asarray(x) for x in np.meshgrid(np.arange(SQ + 9), np.arange(SKV + 6), indexing="ij"))
        for b in range(2):
            q0, k0 = int(np.broadcast_to(qo, (2,))[b]), int(np.broadcast_to(ko, (2,))[b])
            want = np.stack([np.broadcast_to(whole.bind((2,), SQ + 9, SKV + 6)(b, h, q, kv), q.shape) for h in range(3)])
            per_head = np.stack([np.asarray(_bound(mask, b, h)) for h in range(3)])
            np.testing.assert_array_equal(per_head, want[:, q0 : q0 + SQ, k0 : k0 + SKV])
            data = tuple(a[b] for a in arrays)
            check_span(f"{name}/{qo}/{ko}/b{b}", span, per_head.any(0), data, per_head.all(0))
            if name == "document":
                lo, hi = data[:2]
                np.testing.assert_array_equal(np.maximum(hi - lo, 0), per_head[0].sum(1))
