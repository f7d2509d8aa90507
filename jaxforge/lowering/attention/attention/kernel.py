"""The attention algorithms on tiles, written once for every driver.

Each function computes the rows of one query tile (or the columns of one key tile) of one batch
item and head, reading the other operand tile by tile through a ``load`` callback. The XLA driver
(``xla.py``) vmaps them over batch and heads and scans over tiles; the Pallas driver
(``pallas_triton.py``) calls them from a kernel body with ``load`` slicing a ref. The loops only
visit the tiles that ``Mods.span`` says can be visible, so causal and windowed masks skip work.

An operand with a head dim (q, k, v, their tangents and cotangents) is an array or a tuple of
arrays, pieces along the head dim (the Triton driver holds a head dim of 576 as 512 + 64 where one
power of two would be 1024): products with it sum over its pieces, results from it keep them.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxforge.primitives.attention.mods import Mods, float_consts, with_floats
from jaxforge.primitives.attention.points import PointArray, Reads, reads_refs

__all__ = [
    "Geometry",
    "MaskTiles",
    "bounds_table",
    "bwd_dkv_cols",
    "bwd_dq_rows",
    "fwd_rows",
    "tangent_bwd_cols",
    "tangent_bwd_rows",
    "tangent_rows",
    "tile_loop",
    "zeros",
]


@dataclasses.dataclass(frozen=True)
class MaskTiles:
    """What the mask reads for one batch item, as a driver provides it: the mask function's own
    arrays (whole), the span's arrays, and ``rows(i)`` / ``cols(j)``, the positional values
    (``Mods.mask_rows``/``mask_cols``) at the queries of tile ``i`` / the keys of tile ``j``,
    each ``(block_q,)`` / ``(block_kv,)``: slices, never gathers.

    ``row_bounds(i)`` / ``col_bounds(j)``: the tile bounds (:meth:`Geometry.row_bounds`) read from
    a :func:`bounds_table` computed before the call, for a driver that passes no span arrays."""

    consts: Sequence
    span: tuple
    rows: Callable[[Any], Sequence]
    cols: Callable[[Any], Sequence]
    row_bounds: Callable[[Any], tuple] | None = None
    col_bounds: Callable[[Any], tuple] | None = None

    def rows_loaded(self, i) -> MaskTiles:
        """Query tile ``i``'s values read once, for a loop over key tiles that reuses them."""
        rows = self.rows(i)
        return dataclasses.replace(self, rows=lambda _: rows)

    def cols_loaded(self, j) -> MaskTiles:
        """Key tile ``j``'s values read once, for a loop over query tiles that reuses them."""
        cols = self.cols(j)
        return dataclasses.replace(self, cols=lambda _: cols)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one call: sequence lengths, tile sizes, GQA group, scale, precision.

    ``pack > 1`` (GQA packing, FlashAttention-3's ``pack_gqa``): the ``pack`` query heads that share
    a key/value head interleave in the rows of one tile, row ``r`` of (packed) head ``h`` being
    query ``r // pack`` of head ``h * pack + r % pack``; ``group`` is then 1. A decoding step's few
    queries per head fill a tile that way, and each key tile is loaded once for all of them.
    """

    sq: int
    skv: int
    block_q: int
    block_kv: int
    group: int  # query heads per key/value head (1 when packed)
    scale: float
    acc_dtype: jnp.dtype  # scores, sums and accumulators
    precision: str | None  # of the dot products ("highest" for f32/f64 on CPU)
    pack: int = 1
    keys_major: bool = False  # score tiles (block_kv, block_q): keys in rows (XLA, config.py)

    @property
    def rows(self) -> int:
        """Query rows per (packed) head: ``sq * pack``."""
        return self.sq * self.pack

    @property
    def key_axis(self) -> int:
        """The axis of a score tile along which its keys lie."""
        return 0 if self.keys_major else 1

    @property
    def num_q_tiles(self) -> int:
        return -(-self.rows // self.block_q)

    @property
    def num_kv_tiles(self) -> int:
        return -(-self.skv // self.block_kv)

    def _queries(self, i):
        """The queries ``[lo, hi)`` whose rows meet query tile ``i``."""
        r_lo = i * self.block_q
        return r_lo // self.pack, (jnp.minimum(r_lo + self.block_q, self.rows) + self.pack - 1) // self.pack

    def kv_tiles(self, mods: Mods, i, data):
        """Key tiles ``[lo, hi)`` that query tile ``i`` may see."""
        lo, hi = mods.span.kv(*self._queries(i), self.skv, data)
        return lo // self.block_kv, (hi + self.block_kv - 1) // self.block_kv

    def q_tiles(self, mods: Mods, j, data):
        """Query tiles ``[lo, hi)`` that may see key tile ``j``."""
        kv_lo = j * self.block_kv
        lo, hi = mods.span.q(kv_lo, jnp.minimum(kv_lo + self.block_kv, self.skv), self.sq, data)
        return lo * self.pack // self.block_q, (hi * self.pack + self.block_q - 1) // self.block_q

    def full_kv_tiles(self, mods: Mods, i, data):
        """Key tiles wholly visible to query tile ``i``: no mask arithmetic there."""
        if mods.mask is None:
            return 0, self.skv // self.block_kv
        lo, hi = mods.span.full_kv(*self._queries(i), self.skv, data)
        return (lo + self.block_kv - 1) // self.block_kv, hi // self.block_kv

    def full_q_tiles(self, mods: Mods, j, data):
        """Query tiles that wholly see key tile ``j``: none if the tile holds padded keys, which only
        the mask arithmetic hides (their scores would reach the score consts' cotangents)."""
        kv_lo = j * self.block_kv
        if mods.mask is None:
            lo, hi = 0, self.sq
        else:
            lo, hi = mods.span.full_q(kv_lo, jnp.minimum(kv_lo + self.block_kv, self.skv), self.sq, data)
        if self.skv % self.block_kv:  # else no tile holds padded keys: static bounds (XLA drops 1-step loops)
            hi = jnp.where(kv_lo + self.block_kv <= self.skv, jnp.asarray(hi, jnp.int32), jnp.asarray(lo, jnp.int32))
        return (lo * self.pack + self.block_q - 1) // self.block_q, hi * self.pack // self.block_q

    def row_bounds(self, mods: Mods, i, data=()):
        """``(lo, hi, full_lo, full_hi)``: the key tiles query tile ``i`` visits, and among them the
        wholly visible ones."""
        return (*self.kv_tiles(mods, i, data), *self.full_kv_tiles(mods, i, data))

    def col_bounds(self, mods: Mods, j, data=()):
        """``(lo, hi, full_lo, full_hi)``: the query tiles key tile ``j`` visits, as :meth:`row_bounds`."""
        return (*self.q_tiles(mods, j, data), *self.full_q_tiles(mods, j, data))

    def row_tiles(self, mods: Mods, i, mask: MaskTiles, kv_range=None):
        """``(kv_tiles, full_kv_tiles)`` of query tile ``i``; only those in ``kv_range = (start,
        stop)`` if given (a split of split-KV)."""
        lo, hi, full_lo, full_hi = mask.row_bounds(i) if mask.row_bounds else self.row_bounds(mods, i, mask.span)
        if kv_range is not None:
            lo, hi = jnp.maximum(lo, kv_range[0]), jnp.minimum(hi, kv_range[1])
        return (lo, hi), (full_lo, full_hi)

    def col_tiles(self, mods: Mods, j, mask: MaskTiles):
        """``(q_tiles, full_q_tiles)`` of key tile ``j``."""
        lo, hi, full_lo, full_hi = mask.col_bounds(j) if mask.col_bounds else self.col_bounds(mods, j, mask.span)
        return (lo, hi), (full_lo, full_hi)


def bounds_table(bounds, num_tiles: int, span_items) -> jax.Array:
    """``(B, num_tiles, 4)`` int32: ``bounds(t, data)`` (:meth:`Geometry.row_bounds`,
    :meth:`~Geometry.col_bounds`) of every tile for each batch item's span arrays (``span_items``,
    stacked over items): computed once before a kernel, whose programs read one row each."""
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    per_item = lambda data: jax.vmap(lambda t: jnp.stack([jnp.asarray(x, jnp.int32) for x in bounds(t, data)]))(tiles)  # noqa: E731
    return jax.vmap(per_item)(span_items)


def tile_loop(tiles, full_tiles, body, carry):
    """``body(t, carry, masked)`` over ``tiles``: the wholly visible ones in the middle unmasked.

    A loop whose range is empty at trace time (no mask: no masked tiles where the keys fill whole
    tiles; causal: none before the visible ones) is left out of the program."""
    raw_lo, raw_hi, raw_full_lo, raw_full_hi = raw = (*tiles, *full_tiles)
    lo, hi, full_lo, full_hi = (jnp.asarray(x, jnp.int32) for x in raw)  # tile indices; spans mix int widths
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    masked = lambda t, c: body(t, c, True)  # noqa: E731  (one function: jax traces it once for both loops)
    loops = ((lo, full_lo, masked), (full_lo, full_hi, lambda t, c: body(t, c, False)), (full_hi, hi, masked))
    # Decided on the bounds as given: clipped against a traced bound, they are all traced.
    none = _known_le(raw_hi, raw_lo)
    empty = (
        none or _known_le(raw_full_lo, raw_lo),
        none or _known_le(raw_full_hi, raw_full_lo),
        none or _known_le(raw_hi, raw_full_hi),
    )
    for (start, stop, step), skip in zip(loops, empty):
        if not skip:
            carry = lax.fori_loop(start, stop, step, carry)
    return carry


def _known_le(a, b) -> bool:
    """Whether ``a <= b`` is known at trace time (both ints, not traced)."""
    try:
        return operator.index(a) <= operator.index(b)
    except TypeError:  # a traced value
        return False


def zeros(geo: Geometry, x):
    """Accumulation-dtype zeros shaped like ``x`` (an array or its pieces)."""
    return jax.tree.map(lambda piece: jnp.zeros(piece.shape, geo.acc_dtype), x)


def _up(geo: Geometry, x):
    """``x`` (arrays or pieces) in the accumulation dtype: second derivatives are taken there."""
    return jax.tree.map(lambda piece: piece.astype(geo.acc_dtype), x)


def _add(a, b):  # arrays or pieces
    return jax.tree.map(operator.add, a, b)


def _num_rows(x) -> int:
    return jax.tree.leaves(x)[0].shape[0]


def _dot(geo: Geometry, a, b, contract=((1,), (0,))):
    if a.dtype != b.dtype:  # probabilities meet bf16/f16 values: round p like FlashAttention
        a = a.astype(b.dtype)
    return lax.dot_general(a, b, (contract, ((), ())), precision=geo.precision, preferred_element_type=geo.acc_dtype)


def _dot_t(geo, a, b):  # a @ b.T
    return _dot(geo, a, b, ((1,), (1,)))


def _t_dot(geo, a, b):  # a.T @ b
    return _dot(geo, a, b, ((0,), (0,)))


# A score tile pairs query-side rows with key-side rows; these keep the products and broadcasts
# in the geometry's orientation (``Geometry.keys_major``), so each algorithm is written once.
def _scores(geo: Geometry, a, b):
    """The tile ``a · bᵀ`` of query-side ``a`` and key-side ``b``, summed over their pieces."""
    pieces = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return functools.reduce(operator.add, [_dot_t(geo, y, x) if geo.keys_major else _dot_t(geo, x, y) for x, y in pieces])


def _over_keys(geo: Geometry, t, x):
    """``Σ_key t[query, key] x[key]``: query-side rows from a tile and key-side ``x``."""
    return jax.tree.map(lambda x: _t_dot(geo, t, x) if geo.keys_major else _dot(geo, t, x), x)


def _over_queries(geo: Geometry, t, x):
    """``Σ_query t[query, key] x[query]``: key-side rows from a tile and query-side ``x``."""
    return jax.tree.map(lambda x: _dot(geo, t, x) if geo.keys_major else _t_dot(geo, t, x), x)


def _per_query(geo: Geometry, x):
    """A per-query vector broadcast along the tile's keys."""
    return x[None, :] if geo.keys_major else x[:, None]


def _per_key(geo: Geometry, x):
    """A per-key vector broadcast along the tile's queries."""
    return x[:, None] if geo.keys_major else x[None, :]


def _positions(geo: Geometry, start, n: int, along_keys: bool):
    """``start + [0, n)`` laid along a score tile's key axis or its query axis."""
    axis = geo.key_axis if along_keys else 1 - geo.key_axis
    start = lax.convert_element_type(start, jnp.int32)  # a loop's index is int64 under x64 on CPU
    return start + lax.broadcasted_iota(jnp.int32, (n, 1) if axis == 0 else (1, n), axis)


def _visible(geo: Geometry, mods: Mods, b, h, i, j, mask: MaskTiles, masked: bool = True):
    """``(h, q_idx, kv_idx, visible)`` of tile (i, j): the query head and index of each row (the
    head a scalar unless packed), the key indices, and the mask: user mask and sequence bounds.

    ``masked=False``: a wholly visible tile (``Geometry.full_kv_tiles``), inside the keys; only
    padded query rows are hidden (they must not overflow in the backward).
    """
    row = _positions(geo, i * geo.block_q, geo.block_q, along_keys=False)
    q_idx, h = (row, h) if geo.pack == 1 else (row // geo.pack, h * geo.pack + row % geo.pack)
    kv_idx = _positions(geo, j * geo.block_kv, geo.block_kv, along_keys=True)
    if not masked:
        tile = (geo.block_kv, geo.block_q) if geo.keys_major else (geo.block_q, geo.block_kv)
        return h, q_idx, kv_idx, jnp.broadcast_to(row < geo.rows, tile)
    visible = (row < geo.rows) & (kv_idx < geo.skv)
    rows, cols = [_per_query(geo, r) for r in mask.rows(i)], [_per_key(geo, c) for c in mask.cols(j)]
    user = mods.allowed(b, h, q_idx, kv_idx, mask.consts, rows, cols)
    if user is not None:
        visible = visible & user
    return h, q_idx, kv_idx, visible


def fwd_rows(geo: Geometry, mods: Mods, q, load_kv, b, h, i, mask: MaskTiles, score_c, kv_range=None, max_scores=False, first_keys=False):
    """Output rows and log-sum-exp of query tile ``i`` (online softmax over the visible tiles), with
    ``max_scores`` the running maximum it keeps (each row's largest score, ``-inf`` where it sees
    none), with ``first_keys`` the first key attaining it.

    ``kv_range = (start, stop)``: only the key tiles among those (a split of split-KV; the
    splits' results merge through their log-sum-exps)."""
    rows, mask = _num_rows(q), mask.rows_loaded(i)
    v_tile = load_kv(0)[1]  # its width: the accumulator's

    def body(j, carry, masked):
        m, l, acc, *first = carry
        k, v = load_kv(j)
        h_row, q_idx, kv_idx, visible = _visible(geo, mods, b, h, i, j, mask, masked)
        s = mods.modify(_scores(geo, q, k) * geo.scale, b, h_row, q_idx, kv_idx, score_c)
        s = jnp.where(visible, s, -jnp.inf)
        top = jnp.max(s, axis=geo.key_axis)
        if first_keys:  # the tile's first key at its maximum, where that beats the tiles before
            # (an argmax, not a match of `top`: XLA may round two fusions' copies of s apart)
            at_top = lax.argmax(s, geo.key_axis, jnp.int32) + lax.convert_element_type(j * geo.block_kv, jnp.int32)
            first = [jnp.where(top > m, at_top, first[0])]
        m_new = jnp.maximum(m, top)
        shift = jnp.where(m_new == -jnp.inf, 0, m_new)  # all -inf so far: keep exp() finite
        alpha = jnp.exp(m - shift)
        p = jnp.exp(s - _per_query(geo, shift))
        l = alpha * l + jnp.sum(p, axis=geo.key_axis)
        return m_new, l, _add(jax.tree.map(lambda a: alpha[:, None] * a, acc), _over_keys(geo, p, v)), *first

    init = (
        jnp.full((rows,), -jnp.inf, geo.acc_dtype),
        jnp.zeros((rows,), geo.acc_dtype),
        jax.tree.map(lambda v: jnp.zeros((rows, v.shape[-1]), geo.acc_dtype), v_tile),
        *[jnp.zeros((rows,), jnp.int32)] * first_keys,
    )
    m, l, acc, *first = tile_loop(*geo.row_tiles(mods, i, mask, kv_range), body, init)
    seen = l > 0
    out = jax.tree.map(lambda a: a / jnp.where(seen, l, 1)[:, None], acc)
    lse = jnp.where(seen, jnp.where(m == -jnp.inf, 0, m) + jnp.log(jnp.where(seen, l, 1)), -jnp.inf)
    return (out, lse, *[m] * max_scores, *first)


def tangent_rows(geo: Geometry, mods: Mods, q, dq, out, lse, load, b, h, i, mask: MaskTiles, score_c, dscore, kv_range=None):
    """``(dout, dlse)`` of query tile ``i``; ``load(j) -> (k, v, dk, dv)``; ``dscore`` for float consts.

    Linear in each key's terms (``lse`` is the whole row's), so the results over the splits of
    ``kv_range`` (as :func:`fwd_rows`) add up."""
    mask = mask.rows_loaded(i)

    def body(j, carry, masked):
        r, acc = carry
        k, v, dk, dv = load(j)
        h_row, q_idx, kv_idx, visible = _visible(geo, mods, b, h, i, j, mask, masked)
        raw = _scores(geo, q, k) * geo.scale
        draw = (_scores(geo, dq, k) + _scores(geo, q, dk)) * geo.scale
        s, ds = _modify_jvp(mods, raw, draw, b, h_row, q_idx, kv_idx, score_c, dscore)
        p = jnp.where(visible, jnp.exp(s - _per_query(geo, lse_safe)), 0)
        p_ds = p * jnp.where(visible, ds, 0)
        return r + jnp.sum(p_ds, axis=geo.key_axis), _add(_add(acc, _over_keys(geo, p, dv)), _over_keys(geo, p_ds, v))

    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0)
    init = (jnp.zeros((_num_rows(q),), geo.acc_dtype), zeros(geo, out))
    r, acc = tile_loop(*geo.row_tiles(mods, i, mask, kv_range), body, init)
    return jax.tree.map(lambda a, o: a - r[:, None] * o.astype(geo.acc_dtype), acc, out), r


def _modify_jvp(mods: Mods, raw, draw, b, h, q_idx, kv_idx, score_c, dscore):
    """The modified scores of a tile and their tangent, from those of the raw scores and of the
    float score consts (``dscore``, whole arrays or, in a kernel, refs read where the consts are)."""
    floats = float_consts(score_c)
    if reads_refs(floats):  # each read's tangent: the tangent array's read there, along ``direction``

        def modify(raw, direction):
            consts = with_floats(score_c, [c.with_tangent(t, direction) for c, t in zip(floats, dscore)])
            return mods.modify(raw, b, h, q_idx, kv_idx, consts)

        return jax.jvp(modify, (raw, jnp.zeros((), raw.dtype)), (draw, jnp.ones((), raw.dtype)))
    modify = lambda raw, floats: mods.modify(raw, b, h, q_idx, kv_idx, with_floats(score_c, floats))
    return jax.jvp(modify, (raw, floats), (draw, list(dscore)))


def _score_grads(geo, mods, q, k, v, g_out, lse, delta, b, h, i, j, mask, score_c, wanted, masked):
    """Tile (i, j) of the softmax backward: ``p``, the raw-score cotangent and float-const cotangents.

    ``g_s = p (g_out·v - delta)`` is pulled back through softcap/score_mod; ``wanted[c]`` selects
    the float score consts whose cotangents are returned.
    """
    h_row, q_idx, kv_idx, visible = _visible(geo, mods, b, h, i, j, mask, masked)
    raw = _scores(geo, q, k) * geo.scale
    floats = float_consts(score_c)
    modify = lambda raw, floats: mods.modify(raw, b, h_row, q_idx, kv_idx, with_floats(score_c, floats))
    if any(c.cotangent is not None for c in floats if isinstance(c, PointArray)):
        s, vjp = _vjp_adding_read_cotangents(modify, raw, floats)
    elif any(wanted):
        s, vjp = jax.vjp(modify, raw, floats)
    else:
        s, vjp_raw = jax.vjp(lambda raw: modify(raw, floats), raw)
        vjp = lambda g: (*vjp_raw(g), [])
    p = jnp.where(visible, jnp.exp(s - _per_query(geo, jnp.where(jnp.isfinite(lse), lse, 0))), 0)
    # Masked entries get exactly 0, even where an infinite lse cotangent makes delta infinite.
    g_raw, g_floats = vjp(jnp.where(visible, p * (_scores(geo, g_out, v) - _per_query(geo, delta)), 0))
    return p, g_raw, [g for g, w in zip(g_floats, wanted) if w]


def _vjp_adding_read_cotangents(modify, raw, floats):
    """``jax.vjp`` of ``modify`` over ``raw``, for float consts a kernel reads at points: the pullback
    adds each read's cotangent into its array's (``PointArray.cotangent``) and returns no others."""
    reads = Reads()
    recorded = [c.recorded(reads) for c in floats]
    modify(raw, recorded)  # finds the reads; a second evaluation replays them

    def replayed(raw, offsets):
        reads.replay_with(offsets)
        return modify(raw, recorded)

    s, vjp = jax.vjp(replayed, raw, [jnp.zeros_like(value) for _, _, value in reads.sites])

    def pullback(g):
        g_raw, g_reads = vjp(g)
        for (array, index, _), g_read in zip(reads.sites, g_reads):
            if array.cotangent is not None:
                array.cotangent.add(index, g_read)
        return g_raw, []

    return s, pullback


def _wanted(score_c, const_grads):
    n = len(float_consts(score_c))
    return [bool(w) for w in const_grads] + [False] * (n - len(const_grads))


def bwd_dq_rows(geo: Geometry, mods: Mods, q, g_out, lse, delta, load_kv, b, h, i, mask: MaskTiles, score_c, kv_range=None):
    """``gq`` of query tile ``i``; ``delta = rowsum(g_out * out) - g_lse``. A sum over keys: the
    results over the splits of ``kv_range`` (as :func:`fwd_rows`) add up."""
    mask = mask.rows_loaded(i)

    def body(j, gq, masked):
        k, v = load_kv(j)
        _, g_raw, _ = _score_grads(geo, mods, q, k, v, g_out, lse, delta, b, h, i, j, mask, score_c, [], masked)
        return jax.tree.map(lambda a, g: a + g * geo.scale, gq, _over_keys(geo, g_raw, k))

    return tile_loop(*geo.row_tiles(mods, i, mask, kv_range), body, zeros(geo, q))


def bwd_dkv_cols(geo: Geometry, mods: Mods, k, v, load_q, b, hk, j, mask: MaskTiles, score_c, fused=None, const_grads=()):
    """``(gk, gv)`` of key tile ``j`` of key/value head ``hk``, over the ``group`` query heads.

    ``load_q(g, i) -> (q, g_out, lse, delta)`` for query head ``hk * group + g``, tile ``i``.
    With ``fused = (gq, g_consts)`` — ``gq`` of shape ``(group, padded Sq, D)`` — the same pass
    also accumulates the query cotangents and those of the float score consts flagged in
    ``const_grads``, and returns ``(gk, gv, (gq, g_consts))``: one pass instead of two, for
    drivers that can hold ``gq`` (XLA; a GPU program would need atomics).
    """
    wanted, mask = _wanted(score_c, const_grads), mask.cols_loaded(j)

    def head(g, carry):
        h = hk * geo.group + g

        def body(i, carry, masked):
            gk, gv, fused = carry
            q, g_out, lse, delta = load_q(g, i)
            p, g_raw, g_floats = _score_grads(
                geo, mods, q, k, v, g_out, lse, delta, b, h, i, j, mask, score_c, wanted, masked
            )
            gk = jax.tree.map(lambda a, g: a + g * geo.scale, gk, _over_queries(geo, g_raw, q))
            gv = _add(gv, _over_queries(geo, p, g_out))
            if fused is not None:
                gq, g_consts = fused
                rows = tuple(jnp.asarray(x, jnp.int32) for x in (g, i * geo.block_q, 0))  # one index dtype
                tile = lax.dynamic_slice(gq, rows, (1, geo.block_q, gq.shape[-1]))
                tile = tile + (_over_keys(geo, g_raw, k) * geo.scale)[None]
                fused = lax.dynamic_update_slice(gq, tile, rows), [a + c for a, c in zip(g_consts, g_floats)]
            return gk, gv, fused

        return tile_loop(*geo.col_tiles(mods, j, mask), body, carry)

    init = (zeros(geo, k), zeros(geo, v), fused)
    gk, gv, fused = lax.fori_loop(0, geo.group, head, init)
    return (gk, gv) if fused is None else (gk, gv, fused)


def _tile_pairing(geo: Geometry, mods: Mods, dq, dk, dv, g_dout, b, h, i, j, mask: MaskTiles, score_c, dscore, masked):
    """Tile (i, j)'s term of the pairing of the tangent's outputs with their cotangents, a function
    of ``(q, k, v, lse, c)`` (the tangents and ``g_dout`` fixed): see :func:`tangent_bwd_cols`."""
    h_row, q_idx, kv_idx, visible = _visible(geo, mods, b, h, i, j, mask, masked)

    def pairing(q, k, v, lse, c):
        raw = _scores(geo, q, k) * geo.scale
        draw = (_scores(geo, dq, k) + _scores(geo, q, dk)) * geo.scale
        s, ds = _modify_jvp(mods, raw, draw, b, h_row, q_idx, kv_idx, score_c, dscore)
        p = jnp.exp(jnp.where(visible, s, -jnp.inf) - _per_query(geo, lse))
        w = _scores(geo, g_dout, v) + _per_query(geo, c)
        return jnp.sum(p * (jnp.where(visible, ds, 0) * w + _scores(geo, g_dout, dv)))

    return pairing


def _seen(lse, c):
    """``lse`` and ``c`` with 0 at the rows that see no key (they pair nothing)."""
    seen = jnp.isfinite(lse)
    return jnp.where(seen, lse, 0), jnp.where(seen, c, 0)


def tangent_bwd_cols(geo: Geometry, mods: Mods, k, v, dk, dv, load_q, b, h, j, mask: MaskTiles, score_c, dscore, fused=None):
    """Key tile ``j`` of the tangent map's transpose in ``(q, k, v, out, lse)``, one query head.

    With ``c = g_dlse - g_dout·out`` per row, the pairing of the tangent's outputs with their
    cotangents is a sum over tiles, ``g_dout·dout + g_dlse·dlse = Σ_ij p_ij (ds_ij (g_dout_i·v_j +
    c_i) + g_dout_i·dv_j)``, so each tile's term is differentiated by ``jax.grad`` (softcap's and
    score_mod's second derivatives included): recomputed per tile, O(tile) memory, like the
    backward. ``dscore``: the float score consts' tangents (the consts themselves fixed).
    ``load_q(i) -> (q, dq, lse, c, g_dout)``. ``fused = (gq, glse, gc)``: the query side,
    whole (``(padded Sq, D)``, rows, rows), accumulated over key tiles (XLA holds them); returns
    ``(gk, gv, fused)``, without it ``(gk, gv)`` (a GPU program: :func:`tangent_bwd_rows` gives the
    query side). The cotangent of ``out`` is ``-gc·g_dout``.
    """
    mask = mask.cols_loaded(j)
    k, v, dk, dv = _up(geo, (k, v, dk, dv))

    def body(i, carry, masked):
        gk, gv, fused = carry
        q, dq, lse, c, g_dout = _up(geo, load_q(i))
        pairing = _tile_pairing(geo, mods, dq, dk, dv, g_dout, b, h, i, j, mask, score_c, dscore, masked)
        args = (q, k, v, *_seen(lse, c))
        if fused is None:
            g_k, g_v = jax.grad(pairing, argnums=(1, 2))(*args)
            return _add(gk, g_k), _add(gv, g_v), None
        g_q, g_k, g_v, g_lse, g_c = jax.grad(pairing, argnums=(0, 1, 2, 3, 4))(*args)
        start = jnp.asarray(i, jnp.int32) * geo.block_q
        add = lambda whole, tile: lax.dynamic_update_slice_in_dim(  # noqa: E731
            whole, lax.dynamic_slice_in_dim(whole, start, geo.block_q) + tile, start, axis=0
        )
        return _add(gk, g_k), _add(gv, g_v), tuple(add(x, t) for x, t in zip(fused, (g_q, g_lse, g_c)))

    init = (zeros(geo, k), zeros(geo, v), fused)
    gk, gv, fused = tile_loop(*geo.col_tiles(mods, j, mask), body, init)
    return (gk, gv) if fused is None else (gk, gv, fused)


def tangent_bwd_rows(geo: Geometry, mods: Mods, q, dq, lse, c, g_dout, load, b, h, i, mask: MaskTiles, score_c, dscore):
    """``(gq, glse, gc)`` of query tile ``i``: the query side of :func:`tangent_bwd_cols`'s terms,
    summed over the key tiles it sees; ``load(j) -> (k, v, dk, dv)``."""
    mask = mask.rows_loaded(i)
    q, dq, g_dout = _up(geo, (q, dq, g_dout))
    lse, c = _seen(*_up(geo, (lse, c)))

    def body(j, carry, masked):
        k, v, dk, dv = _up(geo, load(j))
        pairing = _tile_pairing(geo, mods, dq, dk, dv, g_dout, b, h, i, j, mask, score_c, dscore, masked)
        return _add(carry, jax.grad(pairing, argnums=(0, 3, 4))(q, k, v, lse, c))

    init = (zeros(geo, q), zeros(geo, lse), zeros(geo, lse))
    return tile_loop(*geo.row_tiles(mods, i, mask), body, init)
