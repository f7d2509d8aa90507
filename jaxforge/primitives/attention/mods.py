"""What a flex-attention primitive carries about its mask and score modification.

``Mods`` is a static (hashable) parameter of the attention primitives. It holds

* ``mask``: ``mask_mod(b, h, q_idx, kv_idx, *row_values, *col_values, *mask_consts) -> bool`` or
  None (everything visible). ``mask_rows`` (``mask_cols``) arrays of shape ``(B, Sq)``
  (``(B, Skv)``) are *positional*: the function receives their values at ``(b, q_idx)``
  (``(b, kv_idx)``), so a kernel hands it a contiguous slice per tile instead of gathering at
  traced indices (document masks: the segment ids; the Triton backend cannot lower a gather);
* ``score``: ``score_mod(score, b, h, q_idx, kv_idx, *score_consts) -> score`` or None;
* ``span``: a conservative summary of the mask, :class:`Span`, giving for a range of queries the
  range of keys that may be visible (and back), so kernels never visit tiles that are masked out;
* ``softcap``: ``score -> softcap * tanh(score / softcap)`` before ``score_mod``, or None.

The functions are :class:`~jaxforge.primitives._core.StaticFunction`\\ s written on scalars: the
arrays they read (segment ids, a bias table) are operands of the primitive, so their batch dims,
tangents and cotangents follow the usual rules. ``b`` is the index into the flattened batch dims.
When ``vmap`` adds a batch dim, :meth:`Mods.vmapped` records it so that ``b`` is split back into
``(vmapped index, inner b)`` and the batched consts are indexed by the former.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxforge.primitives._core import StaticFunction
from jaxforge.primitives.attention.points import evaluate, reads_refs

__all__ = [
    "AllVisible",
    "Band",
    "ChunkSpan",
    "Complement",
    "FullSpan",
    "Hull",
    "Intersect",
    "LengthSpan",
    "Mods",
    "OffsetBand",
    "PrefixSpan",
    "RangeSpan",
    "Span",
    "ItemMask",
    "count_below",
    "fits_int32",
    "float_consts",
    "segment_ranges",
    "with_floats",
]


class Span:
    """The keys a block of queries may see, and the queries a block of keys may be seen by.

    ``kv(q_lo, q_hi, skv) -> (lo, hi)``: every visible key of the queries ``[q_lo, q_hi)`` lies in
    ``[lo, hi)`` (a superset: the mask may hide some). ``full_kv(q_lo, q_hi, skv)``: every key in
    the range is visible to every one of those queries (a subset, maybe empty), so tiles inside it
    skip the mask arithmetic. ``q`` and ``full_q`` are the converses for a block of keys. Bounds
    may be traced integers; an empty range has ``lo >= hi``.

    A span built from runtime data (document segment ids) reads ``num_arrays`` per-position
    arrays of one batch item, ``data``; without them it answers as :class:`FullSpan` does.
    """

    num_arrays = 0

    def kv(self, q_lo, q_hi, skv, data=()):
        return 0, skv

    def q(self, kv_lo, kv_hi, sq, data=()):
        return 0, sq

    def full_kv(self, q_lo, q_hi, skv, data=()):
        return 0, 0

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        return 0, 0


@dataclasses.dataclass(frozen=True)
class FullSpan(Span):
    """No structure known: every key may be visible, none is known to be."""


@dataclasses.dataclass(frozen=True)
class AllVisible(Span):
    """Every key visible to every query."""

    def full_kv(self, q_lo, q_hi, skv, data=()):
        return 0, skv

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        return 0, sq


@dataclasses.dataclass(frozen=True)
class Band(Span):
    """``q_idx + lower <= kv_idx <= q_idx + upper``; None is unbounded."""

    lower: int | None
    upper: int | None

    def kv(self, q_lo, q_hi, skv, data=()):
        lo = 0 if self.lower is None else jnp.maximum(q_lo + self.lower, 0)
        hi = skv if self.upper is None else jnp.clip(q_hi + self.upper, 0, skv)
        return lo, hi

    def q(self, kv_lo, kv_hi, sq, data=()):
        lo = 0 if self.upper is None else jnp.maximum(kv_lo - self.upper, 0)
        hi = sq if self.lower is None else jnp.clip(kv_hi - self.lower, 0, sq)
        return lo, hi

    def full_kv(self, q_lo, q_hi, skv, data=()):
        lo = 0 if self.lower is None else jnp.maximum(q_hi - 1 + self.lower, 0)
        hi = skv if self.upper is None else jnp.clip(q_lo + self.upper + 1, 0, skv)
        return lo, hi

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        lo = 0 if self.upper is None else jnp.maximum(kv_hi - 1 - self.upper, 0)
        hi = sq if self.lower is None else jnp.clip(kv_lo - self.lower + 1, 0, sq)
        return lo, hi


@dataclasses.dataclass(frozen=True)
class OffsetBand(Span):
    """``kv_idx <= q_idx + offset``, the :class:`Band` of ``causal``, with one offset per batch item
    read from ``data`` (without it, a :class:`FullSpan`)."""

    num_arrays = 1

    def kv(self, q_lo, q_hi, skv, data=()):
        return Band(None, data[0]).kv(q_lo, q_hi, skv) if data else super().kv(q_lo, q_hi, skv)

    def q(self, kv_lo, kv_hi, sq, data=()):
        return Band(None, data[0]).q(kv_lo, kv_hi, sq) if data else super().q(kv_lo, kv_hi, sq)

    def full_kv(self, q_lo, q_hi, skv, data=()):
        return Band(None, data[0]).full_kv(q_lo, q_hi, skv) if data else super().full_kv(q_lo, q_hi, skv)

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        return Band(None, data[0]).full_q(kv_lo, kv_hi, sq) if data else super().full_q(kv_lo, kv_hi, sq)


@dataclasses.dataclass(frozen=True)
class ChunkSpan(Span):
    """``q_idx // chunk == kv_idx // chunk``."""

    chunk: int

    def kv(self, q_lo, q_hi, skv, data=()):
        return self._same_chunks(q_lo, q_hi, skv)

    def q(self, kv_lo, kv_hi, sq, data=()):
        return self._same_chunks(kv_lo, kv_hi, sq)

    def full_kv(self, q_lo, q_hi, skv, data=()):
        return self._one_chunk(q_lo, q_hi, skv)

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        return self._one_chunk(kv_lo, kv_hi, sq)

    def _same_chunks(self, lo, hi, size):
        c = self.chunk
        return (lo // c) * c, jnp.minimum(((hi - 1) // c + 1) * c, size)

    def _one_chunk(self, lo, hi, size):
        """A block inside one chunk sees all of that chunk; a block across chunks, nothing for sure."""
        c = self.chunk
        start = (lo // c) * c
        return start, jnp.where(lo // c == (hi - 1) // c, jnp.minimum(start + c, size), start)


@dataclasses.dataclass(frozen=True)
class PrefixSpan(Span):
    """``kv_idx < prefix or kv_idx <= q_idx``: a bidirectional prefix, causal after it.

    ``prefix=None``: one length per batch item, read from ``data`` (without it, a :class:`FullSpan`).
    """

    prefix: int | None

    @property
    def num_arrays(self) -> int:
        return 0 if self.prefix is not None else 1

    def _length(self, data):
        return self.prefix if self.prefix is not None else (data[0] if data else None)

    def kv(self, q_lo, q_hi, skv, data=()):
        if (p := self._length(data)) is None:
            return super().kv(q_lo, q_hi, skv)
        return 0, jnp.minimum(jnp.maximum(q_hi, p), skv)

    def q(self, kv_lo, kv_hi, sq, data=()):
        if (p := self._length(data)) is None:
            return super().q(kv_lo, kv_hi, sq)
        return jnp.where(kv_lo < p, 0, jnp.minimum(kv_lo, sq)), sq

    def full_kv(self, q_lo, q_hi, skv, data=()):
        if (p := self._length(data)) is None:
            return super().full_kv(q_lo, q_hi, skv)
        return 0, jnp.minimum(jnp.maximum(q_lo + 1, p), skv)

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        if (p := self._length(data)) is None:
            return super().full_q(kv_lo, kv_hi, sq)
        return jnp.where(kv_hi <= p, 0, jnp.minimum(kv_hi - 1, sq)), sq


@dataclasses.dataclass(frozen=True)
class LengthSpan(Span):
    """``kv_idx < length`` (``axis="kv"``) or ``q_idx < length`` (``axis="q"``): the valid
    positions of a padded batch. A block of queries past a query length sees nothing, one inside
    it every key (and conversely for keys).

    ``length=None``: one per batch item, read from ``data`` (without it, a :class:`FullSpan`).
    """

    axis: str
    length: int | None

    @property
    def num_arrays(self) -> int:
        return 0 if self.length is not None else 1

    def kv(self, q_lo, q_hi, skv, data=()):
        return self._span("kv", q_lo, q_hi, skv, data, sure=False) or super().kv(q_lo, q_hi, skv)

    def q(self, kv_lo, kv_hi, sq, data=()):
        return self._span("q", kv_lo, kv_hi, sq, data, sure=False) or super().q(kv_lo, kv_hi, sq)

    def full_kv(self, q_lo, q_hi, skv, data=()):
        return self._span("kv", q_lo, q_hi, skv, data, sure=True) or super().full_kv(q_lo, q_hi, skv)

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        return self._span("q", kv_lo, kv_hi, sq, data, sure=True) or super().full_q(kv_lo, kv_hi, sq)

    def _span(self, other: str, lo, hi, size, data, sure: bool):
        """The range along ``other`` (of ``size``) for the block ``[lo, hi)`` of the other axis;
        None without the length."""
        n = self.length if self.length is not None else (data[0] if data else None)
        if n is None:
            return None
        if self.axis == other:  # the length cuts the range itself
            return 0, jnp.clip(n, 0, size)
        inside = (hi <= n) if sure else (lo < n)  # the block: wholly / partly inside the length
        return 0, jnp.where(inside, size, 0)


@dataclasses.dataclass(frozen=True)
class RangeSpan(Span):
    """A span read off six per-position arrays: for each query, the range ``[lo, hi)`` holding its
    visible keys and ``sure_hi``, every key of ``[lo, sure_hi)`` visible (``lo`` if none is known);
    the same for each key. A block may see the hull of its rows' ranges and surely sees their
    intersection. Document masks (:func:`segment_ranges` both ways) and evaluated masks
    (``jf.masks.block_mask``) hand it their arrays."""

    num_arrays = 6

    def kv(self, q_lo, q_hi, skv, data=()):
        return _hull_over(data[:3], q_lo, q_hi) if data else (0, skv)

    def q(self, kv_lo, kv_hi, sq, data=()):
        return _hull_over(data[3:], kv_lo, kv_hi) if data else (0, sq)

    def full_kv(self, q_lo, q_hi, skv, data=()):
        return _intersection_over(data[:3], q_lo, q_hi) if data else (0, 0)

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        return _intersection_over(data[3:], kv_lo, kv_hi) if data else (0, 0)


def _rows(size, lo, hi):
    index = jnp.arange(size, dtype=jnp.int32)
    return (index >= lo) & (index < hi)


def _hull_over(ranges, lo, hi):
    first, end, _ = ranges
    inside = _rows(first.shape[0], lo, hi)
    return jnp.min(jnp.where(inside, first, jnp.iinfo(first.dtype).max)), jnp.max(jnp.where(inside, end, 0))


def _intersection_over(ranges, lo, hi):
    first, _, sure_end = ranges
    inside = _rows(first.shape[0], lo, hi)
    return jnp.max(jnp.where(inside, first, 0)), jnp.min(jnp.where(inside, sure_end, jnp.iinfo(sure_end.dtype).max))


def fits_int32(dtype) -> bool:
    """Integers whose every value int32 holds: positional values the kernels may widen to int32."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.integer) and (dtype.itemsize < 4 or dtype == jnp.int32)


def float_consts(consts) -> list:
    """The floating-point ones among a score_mod's consts: those with tangents and cotangents."""
    return [c for c in consts if jnp.issubdtype(c.dtype, jnp.inexact)]


def with_floats(consts, floats) -> list:
    """``consts`` with their floating-point entries replaced, in order, by ``floats``."""
    it = iter(floats)
    return [next(it) if jnp.issubdtype(c.dtype, jnp.inexact) else c for c in consts]


def segment_ranges(ids, other):
    """For each position of ``ids`` (``(B, S)``): ``[lo, hi)``, the first and one past the last
    position of ``other`` (``(B, T)``) holding the same id, and ``sure_hi`` (``hi`` if those
    positions are contiguous, else ``lo``). An id ``other`` lacks gives the empty ``[T, 0)``.
    Int32, ``(B, S)`` each; one sort of ``other`` per row."""
    size = other.shape[-1]
    order = jnp.argsort(other, axis=-1, stable=True).astype(jnp.int32)
    ordered = jnp.take_along_axis(other, order, axis=-1)
    left, right = _counts_below(ordered, ids, (False, True))  # both bounds in one search
    present = right > left
    first = jnp.take_along_axis(order, jnp.clip(left, 0, size - 1), axis=-1)
    last = jnp.take_along_axis(order, jnp.clip(right - 1, 0, size - 1), axis=-1)
    lo = jnp.where(present, first, size)
    hi = jnp.where(present, last + 1, 0)
    sure_hi = jnp.where(right - left == hi - lo, hi, lo)
    return lo, hi, sure_hi


@functools.partial(jax.jit, static_argnames="inclusive")
def count_below(values, queries, inclusive: bool = False):
    """For each of ``queries`` (``(..., S)``), how many of the sorted ``values`` (``(..., T)``, each
    row ascending) are below it (``<``; with ``inclusive``, ``<=``): ``jnp.searchsorted`` with side
    "left" ("right"), row by row. A binary search written out, as jnp.searchsorted cannot take
    symbolic lengths (``jax.export``); a symbolic ``T`` takes the steps of int32's range. Int32.
    Jitted: called eagerly (a document mask built outside ``jit``), its loop compiles once per
    shape, not at every call."""
    return _counts_below(values, queries, (inclusive,))[0]


def _counts_below(values, queries, inclusive: tuple[bool, ...]) -> tuple:
    """:func:`count_below` for each flag of ``inclusive``, the searches side by side in one loop."""
    size = values.shape[-1]
    steps = 31 if jax.export.is_symbolic_dim(size) else int(size).bit_length()
    belows = [jnp.less_equal if flag else jnp.less for flag in inclusive]

    def step(_, bounds):  # each count lies in its [lo, hi]
        new = []
        for below, (lo, hi) in zip(belows, bounds):
            mid = (lo + hi) // 2
            value = jnp.take_along_axis(values, jnp.clip(mid, 0, size - 1), axis=-1)
            right = (lo < hi) & below(value, queries)
            new.append((jnp.where(right, mid + 1, lo), jnp.where(right | (lo == hi), hi, mid)))
        return tuple(new)

    # Bounds made like both operands carry their types (under shard_map, the mesh axes either
    # varies along), which the loop's updates have and a constant lacks.
    zero = jnp.zeros_like(queries, jnp.int32) + jnp.zeros_like(jnp.sum(values, axis=-1, keepdims=True), jnp.int32)
    bounds = tuple((zero, jnp.full_like(zero, size)) for _ in belows)
    return tuple(lo for lo, _ in jax.lax.fori_loop(0, steps, step, bounds))


@dataclasses.dataclass(frozen=True)
class _Pair(Span):
    a: Span
    b: Span

    @property
    def num_arrays(self) -> int:
        return self.a.num_arrays + self.b.num_arrays

    def _parts(self, data):
        return data[: self.a.num_arrays], data[self.a.num_arrays :]

    def kv(self, q_lo, q_hi, skv, data=()):
        da, db = self._parts(data)
        return self._may(self.a.kv(q_lo, q_hi, skv, da), self.b.kv(q_lo, q_hi, skv, db))

    def q(self, kv_lo, kv_hi, sq, data=()):
        da, db = self._parts(data)
        return self._may(self.a.q(kv_lo, kv_hi, sq, da), self.b.q(kv_lo, kv_hi, sq, db))

    def full_kv(self, q_lo, q_hi, skv, data=()):
        da, db = self._parts(data)
        return self._sure(self.a.full_kv(q_lo, q_hi, skv, da), self.b.full_kv(q_lo, q_hi, skv, db))

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        da, db = self._parts(data)
        return self._sure(self.a.full_q(kv_lo, kv_hi, sq, da), self.b.full_q(kv_lo, kv_hi, sq, db))


def _intersection(a, b):
    return jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1])


def _hull(a, b):
    return jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])


def _longer(a, b):
    take_a = a[1] - a[0] >= b[1] - b[0]
    return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])


def _union_or_longer(a, b):
    """An interval inside the union of two: their hull if they touch, else the longer one."""
    touch = (a[0] <= b[1]) & (b[0] <= a[1]) & (a[0] < a[1]) & (b[0] < b[1])
    longer = _longer(a, b)
    hull = _hull(a, b)
    return jnp.where(touch, hull[0], longer[0]), jnp.where(touch, hull[1], longer[1])


class Intersect(_Pair):
    """Keys visible under both masks (``&``): may-ranges and sure-ranges intersect."""

    _may, _sure = staticmethod(_intersection), staticmethod(_intersection)


class Hull(_Pair):
    """Keys visible under either mask (``|``): the hull of the may-ranges, a sure part of the union."""

    _may, _sure = staticmethod(_hull), staticmethod(_union_or_longer)


@dataclasses.dataclass(frozen=True)
class Complement(Span):
    """Keys the other mask hides (``~``): a block may see what the other does not surely show, and
    surely sees what the other cannot show. Each is the complement of an interval, two pieces:
    the may-range takes their hull, the sure-range the longer piece."""

    a: Span

    @property
    def num_arrays(self) -> int:
        return self.a.num_arrays

    def kv(self, q_lo, q_hi, skv, data=()):
        return _outside_hull(self.a.full_kv(q_lo, q_hi, skv, data), skv)

    def q(self, kv_lo, kv_hi, sq, data=()):
        return _outside_hull(self.a.full_q(kv_lo, kv_hi, sq, data), sq)

    def full_kv(self, q_lo, q_hi, skv, data=()):
        return _outside_longer(self.a.kv(q_lo, q_hi, skv, data), skv)

    def full_q(self, kv_lo, kv_hi, sq, data=()):
        return _outside_longer(self.a.q(kv_lo, kv_hi, sq, data), sq)


def _outside_hull(r, size):
    """An interval holding ``[0, size)`` minus ``r``: one piece when ``r`` touches an end."""
    lo, hi = r
    cut = lo < hi
    return jnp.where(cut & (lo <= 0), hi, 0), jnp.where(cut & (hi >= size) & (lo > 0), lo, size)


def _outside_longer(r, size):
    """An interval inside ``[0, size)`` minus ``r``: the longer of the two pieces."""
    lo, hi = r
    piece = _longer((0, jnp.clip(lo, 0, size)), (jnp.clip(hi, 0, size), size))
    cut = lo < hi
    return jnp.where(cut, piece[0], 0), jnp.where(cut, piece[1], size)


@dataclasses.dataclass(frozen=True)
class _BatchMap:
    """One vmap level: ``b = v * inner + b_inner``; ``flags[i]``: const i has a leading ``v`` axis."""

    inner: int
    mask_flags: tuple[bool, ...]
    score_flags: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class ItemMask:
    """A mask's operands for one batch item: the function's own arrays (whole, for ``allowed``,
    which indexes them by ``b``), and the item's positional rows ``(Sq,)``, columns ``(Skv,)``
    and span arrays."""

    consts: tuple
    rows: tuple
    cols: tuple
    span: tuple


@dataclasses.dataclass(frozen=True)
class Mods:
    mask: StaticFunction | None = None
    score: StaticFunction | None = None
    span: Span = FullSpan()
    softcap: float | None = None
    batch_maps: tuple[_BatchMap, ...] = ()
    mask_rows: int = 0
    mask_cols: int = 0

    @property
    def num_mask_consts(self) -> int:
        """The mask function's consts, its positional rows and columns, then the span's arrays."""
        if self.mask is None:
            return 0
        return self.mask.num_consts + self.mask_rows + self.mask_cols + self.span.num_arrays

    def item_mask(self, b, mask_consts) -> ItemMask:
        """The mask's operands for batch item ``b`` (a scalar global index)."""
        if self.mask is None:
            return ItemMask((), (), (), ())
        inner, consts = self._unmap(b, mask_consts, "mask_flags")
        n, r, c = self.mask.num_consts, self.mask_rows, self.mask_cols
        item = [x[inner] for x in consts[n:]]
        return ItemMask(tuple(mask_consts[:n]), tuple(item[:r]), tuple(item[r : r + c]), tuple(item[r + c :]))

    @property
    def num_score_consts(self) -> int:
        return 0 if self.score is None else self.score.num_consts

    def vmapped(self, inner: int, mask_flags, score_flags) -> Mods:
        """The mods after a vmap that put ``inner`` flattened batch items under each new index."""
        level = _BatchMap(inner, tuple(mask_flags), tuple(score_flags))
        return dataclasses.replace(self, batch_maps=self.batch_maps + (level,))

    def allowed(self, b, h, q_idx, kv_idx, mask_consts, rows=None, cols=None):
        """The mask on a tile: index arrays broadcast together; None when nothing is masked.

        ``rows``/``cols``: the positional values of the tile (broadcasting like ``q_idx`` and
        ``kv_idx``), as a kernel slices them; ``mask_consts`` then need only hold the function's
        own arrays. None (the dense reference) reads them from ``mask_consts`` by index.
        """
        if self.mask is None:
            return None
        n, r = self.mask.num_consts, self.mask_rows
        sliced = rows is not None

        def fn(b, h, q, kv, *values):
            b, consts = self._unmap(b, mask_consts, "mask_flags")
            if not sliced:
                positional = consts[n : n + r + self.mask_cols]
                values = [x[b, q] for x in positional[:r]] + [x[b, kv] for x in positional[r:]]
            return _apply(self.mask, b, h, q, kv, *values, *consts[:n])

        values = [*rows, *cols] if sliced else []
        return _elementwise(fn, *_indices(b, h, q_idx, kv_idx), *values, on_tiles=reads_refs(mask_consts))

    def modify(self, score, b, h, q_idx, kv_idx, score_consts):
        """Softcap, then ``score_mod``, elementwise on a tile of raw scores ``scale * q·k``."""
        if self.softcap is not None:
            score = self.softcap * jnp.tanh(score / self.softcap)
        if self.score is None:
            return score

        def fn(s, b, h, q, kv):
            b, consts = self._unmap(b, score_consts, "score_flags")
            return jnp.asarray(_apply(self.score, s, b, h, q, kv, *consts), s.dtype)

        return _elementwise(fn, score, *_indices(b, h, q_idx, kv_idx), on_tiles=reads_refs(score_consts))

    def _unmap(self, b, consts, which):
        """The batch index the user's function sees, and its consts indexed for that item."""
        consts = list(consts)
        for level in reversed(self.batch_maps):  # the newest vmap owns the leading axis
            v, b = b // level.inner, b % level.inner
            consts = [c[v] if batched else c for c, batched in zip(consts, getattr(level, which))]
        return b, consts


def _indices(*idx):
    """Indices as the int32 scalars the user's functions were traced with."""
    return [jnp.asarray(i, jnp.int32) for i in idx]


def at_indices(fn: StaticFunction, b, h, q_idx, kv_idx, *consts):
    """``fn(b, h, q_idx, kv_idx, *consts)[0]`` of a function traced at int32 scalars, at indices of
    any integer type, broadcast arrays included (one element at a time): read as the plain function."""
    return _elementwise(lambda *idx: fn(*idx, *consts)[0], *_indices(b, h, q_idx, kv_idx))


def _apply(fn: StaticFunction, *args):
    """``fn(*args)[0]``; a kernel's consts held as refs are read at points (points.evaluate)."""
    return evaluate(fn, *args) if reads_refs(args) else fn(*args)[0]


def _elementwise(fn, *args, on_tiles: bool = False):
    """Applies a scalar function to broadcast arrays, one vmap per axis (the flex semantics).

    ``on_tiles``: ``fn`` applies to the tiles as they are (points.evaluate broadcasts each step).
    """
    if on_tiles:
        shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
        return jnp.broadcast_to(fn(*args), shape)
    args = jnp.broadcast_arrays(*args)
    for _ in range(args[0].ndim):
        fn = jax.vmap(fn)
    return fn(*args)
