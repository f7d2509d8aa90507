"""Attention masks: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions that know their structure.

True means "query ``q_idx`` may attend to key ``kv_idx``". Masks combine with ``&``, ``|`` and
``~``. Each carries a *span* — which keys a block of queries can possibly see — that the kernels
use to skip tiles: ``causal()`` halves the work, ``sliding_window(w)`` makes it O(S·w).
Runtime per-position data (``document``'s segment ids) is handed to the kernels as *positional*
arrays (:meth:`Mask.bind_positional`): a kernel slices one tile of them, never gathers, so the
GPU kernels run document masks. ``b`` indexes the flattened leading (batch) dims of ``q``, ``h`` the
query head. Packed causal training, for instance::

    mask = jf.masks.causal() & jf.masks.document(segment_ids)
    out = jf.attention(q, k, v, mask=mask)

Any ``mask_mod`` written on scalars works too (``mask=lambda b, h, q, kv: ...``) but without a
span it visits every tile; :func:`block_mask` evaluates it once on the whole grid and keeps the
range of keys (queries) each query (key) sees, so tiles outside are skipped as for the masks here
(FlexAttention's ``create_block_mask``), or several ranges each, cut at each row's widest gaps
(``ranges=``: attention then runs a call per piece and merges them); :func:`from_mask_mod`
combines it with them as it is. A boolean array of visible pairs (``jax.nn``'s ``mask``) is a mask
too (:func:`from_array`), whose ranges each call measures. :func:`shifted` moves any mask to a
block of the sequence (a chunk of context parallelism), spans and all, slicing the per-position
arrays of those that have them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxforge.functional._static import common_dtype, concrete_scalar, static_int
from jaxforge.primitives import _core
from jaxforge.primitives.attention.mods import (
    AllVisible,
    Band,
    ChunkSpan,
    Complement,
    FullSpan,
    Hull,
    Intersect,
    LengthSpan,
    OffsetBand,
    PrefixSpan,
    RangeSpan,
    Span,
    at_indices,
    count_below,
    fits_int32,
    segment_ranges,
)

__all__ = [
    "Mask",
    "block_mask",
    "causal",
    "chunked",
    "document",
    "from_array",
    "from_mask_mod",
    "full",
    "padding",
    "picture",
    "prefix_lm",
    "shifted",
    "sliding_window",
]


class Mask:
    """A mask_mod with a span. Subclasses implement :meth:`mask_mod` and :meth:`span`.

    A mask is a pytree: its runtime arrays (segment ids, per-item offsets and lengths) are the
    leaves and the rest (static ints, functions, how masks combine) its structure, so a mask passes
    into ``jax.jit`` as an argument and two masks that differ only in their arrays share a compile.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys(cls, _flatten_mask, functools.partial(_unflatten_mask, cls))

    def mask_mod(self, b, h, q_idx, kv_idx):
        raise NotImplementedError

    def span(self) -> Span:
        return FullSpan()

    def span_while_tracing(self) -> Span:
        """The span whose static part bounds the keys where the mask's arrays are not yet known
        (traced): its own; a block_mask's, its source mask's."""
        return self.span()

    def span_arrays(self, batch_shape: tuple[int, ...], sq: int, skv: int, num_heads: int | None = None) -> list:
        """The runtime arrays ``span()`` reads, each ``(prod(batch_shape), seq)``, for a call of
        ``num_heads`` query heads (None: not known): none for most masks."""
        return []

    def bind_positional(self, batch_shape: tuple[int, ...], sq: int, skv: int) -> tuple[Callable, list, list]:
        """``(fn, rows, cols)``: the mask as ``fn(b, h, q_idx, kv_idx, *row_values, *col_values)``
        and its positional arrays, ``(prod(batch_shape), sq)`` and ``(prod(batch_shape), skv)``,
        whose values at ``(b, q_idx)`` and ``(b, kv_idx)`` ``fn`` receives (the form kernels run:
        they slice a tile of each instead of gathering). Most masks have none."""
        return self.mask_mod, [], []

    def shifted(self, q_offset, kv_offset) -> Mask:
        """This mask read at ``(q_idx + q_offset, kv_idx + kv_offset)``: a mask of positions rewrites
        itself, keeping its span; others are read at the shifted indices, their span unknown."""
        return _Shifted(self, q_offset, kv_offset)

    def block(self, q_offset, kv_offset, q_len: int | None, kv_len: int | None) -> Mask:
        """This mask over the ``q_len`` queries from position ``q_offset`` and the ``kv_len`` keys
        from ``kv_offset`` (:func:`shifted`, whose checks the arguments have passed; a length None:
        to the end): a mask of positions is shifted, its lengths unread; one of per-position arrays
        slices them."""
        return self.shifted(q_offset, kv_offset)

    def pieces(self) -> tuple[Mask, ...]:
        """Disjoint masks whose union is this one, which attention runs one by one and merges through
        their log-sum-exps (:func:`block_mask`'s ``ranges``): the mask itself for most."""
        return (self,)

    def bind(self, batch_shape: tuple[int, ...], sq: int, skv: int) -> Callable:
        """The scalar ``mask_mod`` for a call with q ``(*batch_shape, sq, ...)`` and ``skv`` keys:
        :meth:`bind_positional`'s function, reading its positional arrays by index."""
        fn, rows, cols = self.bind_positional(batch_shape, sq, skv)
        return lambda b, h, q_idx, kv_idx: fn(
            b, h, q_idx, kv_idx, *(r[b, q_idx] for r in rows), *(c[b, kv_idx] for c in cols)
        )

    def hoisted(self) -> Mask:
        """This mask with the arrays its plain functions close over as leaves, so that it passes
        whole into a shard_map as an operand (whose code cannot close over an explicit mesh's arrays)."""
        plain = lambda x: isinstance(x, _FromFunction)  # noqa: E731
        return jax.tree.map(lambda x: x.hoisted() if plain(x) else x, self, is_leaf=plain)

    def __call__(self, b, h, q_idx, kv_idx):
        """The mask at one index (vmapped over every pair, :func:`picture` draws it); per-item data
        (segment ids, lengths) is read at item ``b`` of its own flattened leading dims."""
        return self.mask_mod(b, h, q_idx, kv_idx)

    def __eq__(self, other):
        """Masks built alike of the same arrays (the same objects: a function's closed-over table;
        most masks hold none) are equal (``causal() == causal()``), so that one given to ``jax.jit``
        as a static argument compiles once, not at each new mask built alike; give a mask of new
        arrays (segment ids, and the ranges a mask derives from them) as an argument instead: they
        are traced."""
        if self is other:
            return True
        if not isinstance(other, Mask):
            return NotImplemented
        (mine, my_tree), (theirs, their_tree) = jax.tree.flatten(self), jax.tree.flatten(other)
        return my_tree == their_tree and all(x is y for x, y in zip(mine, theirs))

    def __hash__(self):
        leaves, tree = jax.tree.flatten(self)
        return hash((tree, *map(id, leaves)))

    def __and__(self, other) -> Mask:
        return _And(self, as_mask(other))

    def __or__(self, other) -> Mask:
        return _Or(self, as_mask(other))

    def __invert__(self) -> Mask:
        return _Not(self)

    __rand__ = lambda self, other: _And(as_mask(other), self)  # noqa: E731
    __ror__ = lambda self, other: _Or(as_mask(other), self)  # noqa: E731
    __array_ufunc__ = None  # numpy_array & mask: numpy defers to __rand__ (not one mask per element)


def _static(value) -> bool:
    """A mask field that is structure: a Python number or string, or a function (not a mask)."""
    return isinstance(value, (int, float, str)) or (callable(value) and not isinstance(value, Mask))


def _flatten_mask(mask: Mask):
    fields = [(f.name, getattr(mask, f.name)) for f in dataclasses.fields(mask)]
    children = [(jax.tree_util.GetAttrKey(name), value) for name, value in fields if not _static(value)]
    static = tuple((name, value) for name, value in fields if _static(value))
    return children, (static, tuple(key.name for key, _ in children))


def _unflatten_mask(cls, aux, children) -> Mask:
    static, names = aux
    mask = object.__new__(cls)  # as the fields were: no constructor checks (leaves may be tracers)
    for name, value in (*static, *zip(names, children)):
        object.__setattr__(mask, name, value)
    return mask


def _shown(value) -> str:
    """A mask's field as its repr shows it: an array (traced or not) by its type, ``int32[2,8]``;
    a number as itself; a function by its name."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return jax.typeof(value).str_short()
    if callable(value) and not isinstance(value, Mask):
        return getattr(value, "__qualname__", repr(value))
    return repr(value)


def _operand(mask: Mask, *within: type) -> str:
    """``repr(mask)``, parenthesised where it is one of ``within`` (an ``|`` inside ``&``)."""
    return f"({mask!r})" if isinstance(mask, within) else repr(mask)


def as_mask(mask) -> Mask:
    """A :class:`Mask` from a Mask, a boolean array (:func:`from_array`) or a plain ``mask_mod``
    callable; anything else is an error."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, (jax.Array, np.ndarray)):
        return from_array(mask)
    if callable(mask):
        return from_mask_mod(mask)
    raise TypeError(
        "mask: expected a jf.masks.Mask, a callable mask_mod(b, h, q_idx, kv_idx) -> bool or a boolean array, "
        f"got {type(mask).__name__}"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _Causal(Mask):
    offset: int | jnp.ndarray  # static, or one per batch item
    fn: str = "causal"  # whose argument the offset came from, for errors
    name: str = "offset"

    def mask_mod(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + _item(self.offset, b)

    def bind_positional(self, batch_shape, sq, skv):
        if isinstance(self.offset, int):
            return super().bind_positional(batch_shape, sq, skv)
        rows = _per_item_rows(self._per_batch(batch_shape), sq)
        return (lambda b, h, q_idx, kv_idx, offset: kv_idx <= q_idx + offset), [rows], []

    def _per_batch(self, batch_shape):
        return _per_batch(self.offset, batch_shape, self.fn, self.name, trailing=0)

    def span(self):
        return Band(None, self.offset) if isinstance(self.offset, int) else OffsetBand()

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        return [] if isinstance(self.offset, int) else [self._per_batch(batch_shape)]

    def shifted(self, q_offset, kv_offset):
        return _Causal(self.offset + q_offset - kv_offset, self.fn, self.name)

    def __repr__(self):
        return "causal()" if isinstance(self.offset, int) and self.offset == 0 else f"causal({_shown(self.offset)})"


@dataclasses.dataclass(frozen=True, eq=False)
class _Window(Mask):
    window: int
    shift: int = 0  # queries' positions minus keys' (shifted)

    def mask_mod(self, b, h, q_idx, kv_idx):
        return jnp.abs(q_idx - kv_idx + self.shift) < self.window

    def span(self):
        return Band(self.shift + 1 - self.window, self.shift + self.window - 1)

    def shifted(self, q_offset, kv_offset):
        d = self.shift + q_offset - kv_offset
        return _Window(self.window, d) if isinstance(d, int) else _band(self.window, d)

    def __repr__(self):
        window = f"sliding_window({self.window})"
        return window if self.shift == 0 else f"shifted({window}, {self.shift}, 0)"


@dataclasses.dataclass(frozen=True, eq=False)
class _Chunked(Mask):
    chunk: int

    def mask_mod(self, b, h, q_idx, kv_idx):
        return q_idx // self.chunk == kv_idx // self.chunk

    def span(self):
        return ChunkSpan(self.chunk)

    def __repr__(self):
        return f"chunked({self.chunk})"


@dataclasses.dataclass(frozen=True, eq=False)
class _ChunkedAt(Mask):
    """:func:`chunked` of an array chunk (traced, or one per batch item), its positions shifted by
    ``q_offset`` and ``kv_offset``: each position's chunk is an id, as a document's, computed at
    each call, and so are the ranges of the positions holding it (contiguous: exact)."""

    chunk: jnp.ndarray  # one, or one per batch item; below 1 counts as 1
    q_offset: int | jnp.ndarray = 0
    kv_offset: int | jnp.ndarray = 0

    def mask_mod(self, b, h, q_idx, kv_idx):
        chunk = jnp.maximum(_item(self.chunk, b), 1)
        return (q_idx + _item(self.q_offset, b)) // chunk == (kv_idx + _item(self.kv_offset, b)) // chunk

    def _per_batch(self, batch_shape):
        chunk, q_offset, kv_offset = (
            _per_batch(jnp.asarray(x, jnp.int32), batch_shape, "chunked", name, trailing=0)
            for x, name in ((self.chunk, "chunk"), (self.q_offset, "q_offset"), (self.kv_offset, "kv_offset"))
        )
        return jnp.maximum(chunk, 1), q_offset, kv_offset

    def _ids(self, batch_shape, sq, skv):
        """Each query's and key's chunk, ``(prod(batch), sq)`` and ``(prod(batch), skv)``."""
        chunk, q_offset, kv_offset = (x[:, None] for x in self._per_batch(batch_shape))
        positions = lambda n, offset: jnp.arange(n, dtype=jnp.int32)[None] + offset  # noqa: E731
        return positions(sq, q_offset) // chunk, positions(skv, kv_offset) // chunk, chunk, q_offset, kv_offset

    def bind_positional(self, batch_shape, sq, skv):
        q_ids, kv_ids, *_ = self._ids(batch_shape, sq, skv)
        return (lambda b, h, q_idx, kv_idx, q_id, kv_id: q_id == kv_id), [q_ids], [kv_ids]

    def span(self):
        return RangeSpan()

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        q_ids, kv_ids, chunk, q_offset, kv_offset = self._ids(batch_shape, sq, skv)

        def holding(ids, offset, size):  # RangeSpan's [lo, hi) and sure_hi of the positions in each id's chunk
            lo, hi = (jnp.clip(ids * chunk + n - offset, 0, size) for n in (0, chunk))
            lo, hi = jnp.where(lo < hi, lo, size), jnp.where(lo < hi, hi, 0)  # segment_ranges' empty [size, 0)
            return lo, hi, hi

        return [*holding(q_ids, kv_offset, skv), *holding(kv_ids, q_offset, sq)]

    def shifted(self, q_offset, kv_offset):
        return _ChunkedAt(self.chunk, self.q_offset + q_offset, self.kv_offset + kv_offset)

    def __repr__(self):
        chunked = f"chunked({_shown(self.chunk)})"
        offsets = (self.q_offset, self.kv_offset)
        if all(isinstance(o, int) and o == 0 for o in offsets):
            return chunked
        return f"shifted({chunked}, {', '.join(_shown(o) for o in offsets)})"


@dataclasses.dataclass(frozen=True, eq=False)
class _PrefixLM(Mask):
    prefix: int | jnp.ndarray  # static, or one length per batch item

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (kv_idx < _item(self.prefix, b)) | (kv_idx <= q_idx)

    def bind_positional(self, batch_shape, sq, skv):
        if isinstance(self.prefix, int):
            return super().bind_positional(batch_shape, sq, skv)
        rows = _per_item_rows(self._per_batch(batch_shape), sq)
        return (lambda b, h, q_idx, kv_idx, prefix: (kv_idx < prefix) | (kv_idx <= q_idx)), [rows], []

    def _per_batch(self, batch_shape):
        return _per_batch(self.prefix, batch_shape, "prefix_lm", "prefix_len", trailing=0)

    def span(self):
        return PrefixSpan(self.prefix if isinstance(self.prefix, int) else None)

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        return [] if isinstance(self.prefix, int) else [self._per_batch(batch_shape)]

    def shifted(self, q_offset, kv_offset):
        # kv + ko < prefix, or kv + ko <= q + qo
        return _Lengths("kv", self.prefix - kv_offset, "prefix_len") | _Causal(q_offset - kv_offset)

    def __repr__(self):
        return f"prefix_lm({_shown(self.prefix)})"


@dataclasses.dataclass(frozen=True, eq=False)
class _Lengths(Mask):
    """``q_idx < length`` or ``kv_idx < length`` (``axis``); the length static or one per item."""

    axis: str  # "q" or "kv"
    length: int | jnp.ndarray
    name: str  # the argument, for errors

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (q_idx if self.axis == "q" else kv_idx) < _item(self.length, b)

    def bind_positional(self, batch_shape, sq, skv):
        if isinstance(self.length, int):
            return super().bind_positional(batch_shape, sq, skv)
        rows = _per_item_rows(self._per_batch(batch_shape), sq)
        return (lambda b, h, q_idx, kv_idx, n: (q_idx if self.axis == "q" else kv_idx) < n), [rows], []

    def _per_batch(self, batch_shape):
        return _per_batch(self.length, batch_shape, "padding", self.name, trailing=0)

    def span(self):
        return LengthSpan(self.axis, self.length if isinstance(self.length, int) else None)

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        return [] if isinstance(self.length, int) else [self._per_batch(batch_shape)]

    def shifted(self, q_offset, kv_offset):
        return _Lengths(self.axis, self.length - (q_offset if self.axis == "q" else kv_offset), self.name)

    def __repr__(self):
        return f"({self.axis}_idx < {_shown(self.length)})"


def _item(x, b, trailing: int = 0):
    """Batch item ``b`` of a mask's per-item array (``(*lead, *trailing)``, ``b`` indexing the
    flattened ``lead``, clipped: an array shared by every item answers for each), or a static value."""
    if isinstance(x, int) or x.ndim == trailing:
        return x
    lead = x.shape[: x.ndim - trailing]
    return jnp.take(x.reshape(math.prod(lead), *x.shape[len(lead) :]), b, axis=0, mode="clip")


def _per_item_rows(per_item, sq: int):
    """One value per batch item handed over as a row (its value at every query) so kernels slice it."""
    return jnp.broadcast_to(per_item[:, None], (per_item.shape[0], sq))


@dataclasses.dataclass(frozen=True, eq=False)
class _Document(Mask):
    q_segments: jnp.ndarray
    kv_segments: jnp.ndarray
    ranges: tuple  # RangeSpan's six arrays, computed once per mask (not once per attention call)

    def mask_mod(self, b, h, q_idx, kv_idx):
        return _item(self.q_segments, b, trailing=1)[q_idx] == _item(self.kv_segments, b, trailing=1)[kv_idx]

    def bind_positional(self, batch_shape, sq, skv):
        for name, ids, length in (("segment_ids", self.q_segments, sq), ("kv_segment_ids", self.kv_segments, skv)):
            if ids.shape[-1] != length:
                raise ValueError(
                    f"document: `{name}` has shape {ids.shape}; its last dim must be the sequence length {length}"
                )
        q_seg, kv_seg = _int32_ids(*self._per_batch(batch_shape))
        return (lambda b, h, q_idx, kv_idx, q_id, kv_id: q_id == kv_id), [q_seg], [kv_seg]

    def _per_batch(self, batch_shape):
        q_seg = _per_batch(self.q_segments, batch_shape, "document", "segment_ids", trailing=1)
        kv_seg = _per_batch(self.kv_segments, batch_shape, "document", "kv_segment_ids", trailing=1)
        return q_seg, kv_seg

    def span(self):
        return RangeSpan()

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        return [_per_batch(r, batch_shape, "document", "segment_ids", trailing=1) for r in self.ranges]

    def block(self, q_offset, kv_offset, q_len, kv_len):
        q_len = _block_length("document", "q_len", q_offset, q_len, self.q_segments.shape[-1])
        kv_len = _block_length("document", "kv_len", kv_offset, kv_len, self.kv_segments.shape[-1])
        q_seg = _slice_positions(self.q_segments, q_offset, q_len, axis=-1, trailing=1)
        kv_seg = _slice_positions(self.kv_segments, kv_offset, kv_len, axis=-1, trailing=1)
        return _Document(q_seg, kv_seg, _block_ranges(self.ranges, q_offset, kv_offset, q_len, kv_len))

    def __repr__(self):
        same = self.q_segments is self.kv_segments
        return f"document({_shown(self.q_segments)}{'' if same else ', ' + _shown(self.kv_segments)})"


@dataclasses.dataclass(frozen=True, eq=False)
class _FromFunction(Mask):
    fn: Callable

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def hoisted(self):
        fn, consts = _traced_mask_mod(self.fn, "mask: `mask_mod`")
        return _Hoisted(fn, tuple(jnp.asarray(c) for c in consts), self.name)

    @property
    def name(self) -> str:
        return _shown(self.fn)

    def __repr__(self):
        return f"from_mask_mod({self.name})"


def _traced_mask_mod(mask_mod, name: str):
    """``_core.trace_function`` of a ``mask_mod`` at scalar int32 ``(b, h, q_idx, kv_idx)``."""
    return _core.trace_function(mask_mod, *[jax.ShapeDtypeStruct((), jnp.int32)] * 4, name=name)


def _returns_a_bool(fn: _core.StaticFunction) -> bool:
    return len(fn.out_avals) == 1 and fn.out_avals[0].shape == () and fn.out_avals[0].dtype == np.bool_


@dataclasses.dataclass(frozen=True, eq=False)
class _Hoisted(Mask):
    """A plain ``mask_mod`` traced, the arrays it closed over its leaves (:meth:`Mask.hoisted`,
    :func:`from_mask_mod`)."""

    fn: _core.StaticFunction
    consts: tuple
    name: str  # the function's, for repr

    def mask_mod(self, b, h, q_idx, kv_idx):  # any integer indices, arrays too (a picture, a numpy check)
        return at_indices(self.fn, b, h, q_idx, kv_idx, *self.consts)

    def __repr__(self):
        return f"from_mask_mod({self.name})"


@dataclasses.dataclass(frozen=True, eq=False)
class _Shifted(Mask):
    """``mask`` read at ``(q_idx + q_offset, kv_idx + kv_offset)``, for masks whose span a shift does
    not keep (chunked, a plain mask_mod): no tile is skipped. An offset per batch item goes to the
    kernels as a positional row, like causal's."""

    mask: Mask
    q_offset: int | jnp.ndarray
    kv_offset: int | jnp.ndarray

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.mask.mask_mod(b, h, q_idx + _item(self.q_offset, b), kv_idx + _item(self.kv_offset, b))

    def bind_positional(self, batch_shape, sq, skv):
        fn, inner_rows, inner_cols = self.mask.bind_positional(batch_shape, sq, skv)
        if inner_rows or inner_cols:  # a Mask subclass of the user's, given per position
            raise TypeError(f"shifted: {type(self.mask).__name__} hands the kernels arrays per position, which a shift cannot move")
        offsets = (self.q_offset, self.kv_offset)
        static = [o if isinstance(o, int) else None for o in offsets]
        rows = [
            _per_item_rows(_per_batch(o, batch_shape, "shifted", name, trailing=0), sq)
            for o, name in zip(offsets, ("q_offset", "kv_offset"))
            if not isinstance(o, int)
        ]

        def at_shifted(b, h, q_idx, kv_idx, *values):
            values = iter(values)
            qo, ko = (next(values) if o is None else o for o in static)
            return fn(b, h, q_idx + qo, kv_idx + ko)

        return at_shifted, rows, []

    def shifted(self, q_offset, kv_offset):
        return _Shifted(self.mask, self.q_offset + q_offset, self.kv_offset + kv_offset)

    def __repr__(self):
        return f"shifted({self.mask!r}, {_shown(self.q_offset)}, {_shown(self.kv_offset)})"


@dataclasses.dataclass(frozen=True, eq=False)
class _Evaluated(Mask):
    """A mask (``from_mask_mod``'s for a plain function) with the span measured by ``block_mask``:
    its function and kernel form (positional operands) are the mask's own."""

    mask: Mask
    q_len: int
    kv_len: int
    num_items: int  # the batch items it was evaluated on; 0: the function does not read b
    num_heads: int  # the query heads it was evaluated on; 0: the function does not read h
    ranges: tuple  # RangeSpan's six arrays, (*batch_shape, q_len) and (*batch_shape, kv_len)
    parts: tuple = ()  # block masks of its pieces (``ranges`` > 1), each within one range of keys a query

    def __repr__(self):
        inner = self.mask.name if isinstance(self.mask, (_FromFunction, _Hoisted)) else repr(self.mask)
        ranges = f", ranges={len(self.parts)}" if self.parts else ""
        return f"block_mask({inner}, {self.q_len}, {self.kv_len}{ranges})"

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.mask.mask_mod(b, h, q_idx, kv_idx)

    def bind_positional(self, batch_shape, sq, skv):
        self._check_lengths(sq, skv)
        return self.mask.bind_positional(batch_shape, sq, skv)

    def pieces(self):
        return self.parts or (self,)

    def span(self):
        return RangeSpan()

    def span_while_tracing(self):
        return self.mask.span_while_tracing()

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        self._check_lengths(sq, skv)
        if self.num_heads and num_heads is not None and num_heads != self.num_heads:
            raise ValueError(
                f"block_mask: evaluated on num_heads={self.num_heads} query heads (its mask_mod reads h); the call has {num_heads}"
            )
        if self.num_items and math.prod(batch_shape) != self.num_items:  # under vmap: b is not the item it was evaluated for
            raise ValueError(
                f"block_mask: evaluated on {self.num_items} batch items (its mask_mod reads b); the call has batch dims "
                f"{batch_shape} (under vmap, build the mask inside the mapped function)"
            )
        return [_per_batch(r, batch_shape, "block_mask", "batch_shape", trailing=1) for r in self.ranges]

    def block(self, q_offset, kv_offset, q_len, kv_len):
        q_len = _block_length("block_mask", "q_len", q_offset, q_len, self.q_len)
        kv_len = _block_length("block_mask", "kv_len", kv_offset, kv_len, self.kv_len)
        of = lambda mask: mask.block(q_offset, kv_offset, q_len, kv_len)  # noqa: E731
        ranges = _block_ranges(self.ranges, q_offset, kv_offset, q_len, kv_len)
        return dataclasses.replace(self, mask=of(self.mask), q_len=q_len, kv_len=kv_len, ranges=ranges, parts=tuple(map(of, self.parts)))

    def _check_lengths(self, sq, skv):
        if (sq, skv) != (self.q_len, self.kv_len):
            raise ValueError(
                f"block_mask: evaluated for q_len={self.q_len}, kv_len={self.kv_len}; the call has {sq} queries and {skv} keys"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class _Within(Mask):
    """``mask`` where ``lo[b, q_idx] <= kv_idx < hi[b, q_idx]``: one piece of a block mask, its bounds
    (``(*batch_shape, q_len)``) handed to kernels as positional rows."""

    mask: Mask
    lo: jnp.ndarray
    hi: jnp.ndarray

    def mask_mod(self, b, h, q_idx, kv_idx):
        lo, hi = (_item(x, b, trailing=1)[q_idx] for x in (self.lo, self.hi))
        return self.mask.mask_mod(b, h, q_idx, kv_idx) & (kv_idx >= lo) & (kv_idx < hi)

    def bind_positional(self, batch_shape, sq, skv):
        fn, rows, cols = self.mask.bind_positional(batch_shape, sq, skv)
        bounds = [_per_batch(x, batch_shape, "block_mask", "batch_shape", trailing=1) for x in (self.lo, self.hi)]
        n = len(rows)

        def within(b, h, q_idx, kv_idx, *values):
            lo, hi = values[n : n + 2]
            return fn(b, h, q_idx, kv_idx, *values[:n], *values[n + 2 :]) & (kv_idx >= lo) & (kv_idx < hi)

        return within, [*rows, *bounds], cols

    def block(self, q_offset, kv_offset, q_len, kv_len):  # lengths resolved by its _Evaluated
        lo, hi = (_moved(_slice_positions(x, q_offset, q_len, axis=-1, trailing=1), kv_offset) for x in (self.lo, self.hi))
        return _Within(self.mask.block(q_offset, kv_offset, q_len, kv_len), lo, hi)

    def __repr__(self):
        return f"({self.mask!r} within ranges {_shown(self.lo)})"


@dataclasses.dataclass(frozen=True, eq=False)
class _FromArray(Mask):
    """The pairs an array marks visible: ``visible`` ``(*lead, heads, q_len, kv_len)`` or
    ``(q_len, kv_len)``, each of the last three dims its size or 1 (broadcast)."""

    visible: jnp.ndarray

    def mask_mod(self, b, h, q_idx, kv_idx):
        table = self._table()
        items = math.prod(table.shape[:-3])  # clipped: an array shared by every item answers for each
        b = 0 if items == 1 else jnp.clip(b, 0, items - 1)  # b unread: block_mask needs no batch_shape
        return _at(table.reshape(items, *table.shape[-3:]), b, h, q_idx, kv_idx)

    def bind_positional(self, batch_shape, sq, skv):
        table = self._per_batch(batch_shape, sq, skv)
        return (lambda b, h, q_idx, kv_idx: _at(table, b, h, q_idx, kv_idx)), [], []

    def span(self):
        return RangeSpan()

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        """Each query's and key's range, measured on the array at every call (block_mask's, at once)."""
        table = self._per_batch(batch_shape, sq, skv, num_heads)
        table = jnp.broadcast_to(table, (*table.shape[:2], sq, skv))
        block = _rows_per_step(*table.shape)
        tile = lambda start: lax.dynamic_slice_in_dim(table, start, block, axis=2)  # noqa: E731
        return list(_scanned_ranges(tile, table.shape[0], sq, skv, block)[0])

    def block(self, q_offset, kv_offset, q_len, kv_len):
        table = self._table()
        for axis, offset, length, name in ((-2, q_offset, q_len, "q_len"), (-1, kv_offset, kv_len, "kv_len")):
            if table.shape[axis] != 1:  # else broadcast over every position
                length = _block_length("from_array", name, offset, length, table.shape[axis])
                table = _slice_positions(table, offset, length, axis=axis, trailing=3)
        return _FromArray(table)

    def _table(self):
        return self.visible.reshape((1,) * (3 - self.visible.ndim) + self.visible.shape)

    def _per_batch(self, batch_shape, sq, skv, num_heads=None):
        """The array as ``(prod(batch_shape), heads, q_len, kv_len)``, its size-1 dims kept."""
        table = self._table()
        wanted = (num_heads or table.shape[-3], sq, skv)
        if any(n not in (1, want) for n, want in zip(table.shape[-3:], wanted)):
            call = ", ".join(map(str, (*batch_shape, "num_heads" if num_heads is None else num_heads, sq, skv)))
            raise ValueError(
                f"from_array: the mask array has shape {self.visible.shape}; its last three dims must broadcast to "
                f"(num_heads, q_len, kv_len) of the call's (*batch, num_heads, q_len, kv_len) = ({call})"
            )
        return _per_batch(table, batch_shape, "from_array", "the mask array", trailing=3)

    def __repr__(self):
        return f"from_array({_shown(self.visible)})"


def _at(table, *idx):
    """``table[b, h, q_idx, kv_idx]``, a dim of size 1 broadcast (read at 0), the indices broadcasting together."""
    if not table.size:  # an empty call, traced all the same: no pair to read, none visible
        return jnp.zeros(jnp.broadcast_shapes(*(jnp.shape(i) for i in idx)), bool)
    return table[tuple(0 if n == 1 else i for n, i in zip(table.shape, idx))]


@dataclasses.dataclass(frozen=True, eq=False)
class _Full(Mask):
    def mask_mod(self, b, h, q_idx, kv_idx):
        return jnp.bool_(True)

    def span(self):
        return AllVisible()

    def shifted(self, q_offset, kv_offset):
        return self

    def __repr__(self):
        return "full()"


@dataclasses.dataclass(frozen=True, eq=False)
class _Combined(Mask):
    """Two masks joined elementwise by ``logic``; their spans by ``span_join``."""

    a: Mask
    b: Mask

    def mask_mod(self, *idx):
        return self.logic(self.a.mask_mod(*idx), self.b.mask_mod(*idx))

    def bind_positional(self, batch_shape, sq, skv):
        fa, rows_a, cols_a = self.a.bind_positional(batch_shape, sq, skv)
        fb, rows_b, cols_b = self.b.bind_positional(batch_shape, sq, skv)
        ra, ca = len(rows_a), len(cols_a)
        nr = ra + len(rows_b)

        def fn(b, h, q_idx, kv_idx, *values):
            rows, cols = values[:nr], values[nr:]
            idx = (b, h, q_idx, kv_idx)
            return self.logic(fa(*idx, *rows[:ra], *cols[:ca]), fb(*idx, *rows[ra:], *cols[ca:]))

        return fn, [*rows_a, *rows_b], [*cols_a, *cols_b]

    def span(self):
        return self.span_join(self.a.span(), self.b.span())

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        return [*self.a.span_arrays(batch_shape, sq, skv, num_heads), *self.b.span_arrays(batch_shape, sq, skv, num_heads)]

    def block(self, *where):
        return type(self)(self.a.block(*where), self.b.block(*where))


class _And(_Combined):
    logic, span_join = staticmethod(jnp.logical_and), Intersect

    def pieces(self):
        a, b = self.a.pieces(), self.b.pieces()
        if len(a) > 1:
            return tuple(_And(p, self.b) for p in a)
        return tuple(_And(self.a, p) for p in b) if len(b) > 1 else (self,)

    def __repr__(self):
        return f"{_operand(self.a, _Or)} & {_operand(self.b, _Or)}"


class _Or(_Combined):
    logic, span_join = staticmethod(jnp.logical_or), Hull

    def __repr__(self):
        return f"{self.a!r} | {self.b!r}"


@dataclasses.dataclass(frozen=True, eq=False)
class _Not(Mask):
    a: Mask

    def mask_mod(self, *idx):
        return jnp.logical_not(self.a.mask_mod(*idx))

    def bind_positional(self, batch_shape, sq, skv):
        fa, rows, cols = self.a.bind_positional(batch_shape, sq, skv)
        return (lambda *args: jnp.logical_not(fa(*args))), rows, cols

    def span(self):
        return Complement(self.a.span())

    def span_arrays(self, batch_shape, sq, skv, num_heads=None):
        return self.a.span_arrays(batch_shape, sq, skv, num_heads)

    def block(self, *where):
        return _Not(self.a.block(*where))

    def __repr__(self):
        return f"~{_operand(self.a, _Combined)}"


def causal(offset=0) -> Mask:
    """``kv_idx <= q_idx + offset``: top-left aligned; ``offset = Skv - Sq`` aligns bottom-right.

    ``offset`` is a Python int, or an integer array with one offset per batch item (shape ``batch``
    of q, or broadcastable to it; runtime values): a decoding step over KV caches filled to
    ``lengths`` (its queries the last ``Sq`` positions of each) is ``causal(lengths - Sq)``.
    """
    return _Causal(_offset("causal", "offset", offset))


def sliding_window(window) -> Mask:
    """``|q_idx - kv_idx| < window``; ``causal() & sliding_window(w)`` sees the last ``w`` keys.

    ``window`` is a Python int >= 1 (or a concrete integer scalar array), whose band the kernels
    bound statically; or an integer array, traced or not, of one window or one per batch item
    (shape ``batch`` of q, or broadcastable to it; runtime values, a window below 1 sees no key):
    then the band is ``causal(window - 1) & ~causal(-window)``, its tiles skipped by runtime bounds.
    """
    window = concrete_scalar(window, "iu")
    if isinstance(window, (jax.Array, np.ndarray)):
        return _band(_offset("sliding_window", "window", window), 0, "sliding_window", "window")
    return _Window(static_int("sliding_window", "window", window, minimum=1))


def _band(window, shift, fn: str = "causal", name: str = "offset") -> Mask:
    """``|q_idx - kv_idx + shift| < window`` where either is an array (runtime bounds): ``kv <= q +
    shift + window - 1`` and not ``kv <= q + shift - window``, two causal bands (errors naming
    ``fn``'s ``name``)."""
    return _Causal(shift + window - 1, fn, name) & ~_Causal(shift - window, fn, name)


def chunked(chunk) -> Mask:
    """``q_idx // chunk == kv_idx // chunk``: attention within fixed chunks (Llama 4 style).

    ``chunk`` is a Python int >= 1 (or a concrete integer scalar array), whose chunks the kernels
    bound statically; or an integer array, traced or not, of one chunk or one per batch item
    (shape ``batch`` of q, or broadcastable to it; runtime values, below 1 counting as 1): then
    each position's chunk is an id computed at each call, its tiles skipped by runtime ranges, as
    a document's.
    """
    chunk = concrete_scalar(chunk, "iu")
    if isinstance(chunk, (jax.Array, np.ndarray)):
        return _ChunkedAt(_offset("chunked", "chunk", chunk))
    return _Chunked(static_int("chunked", "chunk", chunk, minimum=1))


def prefix_lm(prefix_len) -> Mask:
    """``kv_idx < prefix_len or kv_idx <= q_idx``: a bidirectional prefix, causal after it.

    ``prefix_len`` is a Python int, or an integer array with one length per batch item (shape
    ``batch`` of q, or broadcastable to it).
    """
    return _PrefixLM(_length("prefix_lm", "prefix_len", prefix_len))


def padding(kv_lengths, q_lengths=None) -> Mask:
    """``kv_idx < kv_lengths`` and ``q_idx < q_lengths``: the valid positions of a padded batch
    (jax.nn.dot_product_attention's ``key_value_seq_lengths`` and ``query_seq_lengths``).

    Each is a Python int, or an integer array with one length per batch item (shape ``batch`` of
    q, or broadcastable to it); ``q_lengths=None``: every query. Tiles past an item's lengths are
    skipped; a query past its length is a fully masked row (output 0, lse ``-inf``, no gradient).
    """
    mask = _Lengths("kv", _length("padding", "kv_lengths", kv_lengths), "kv_lengths")
    if q_lengths is None:
        return mask
    return mask & _Lengths("q", _length("padding", "q_lengths", q_lengths), "q_lengths")


def _length(fn: str, name: str, value):
    """A static length (a Python int >= 0) or an integer array of them."""
    if isinstance(value, (int, np.integer)):
        return static_int(fn, name, int(value), minimum=0)
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{fn}: `{name}` must be an int or an integer array, got dtype {value.dtype}")
    return _int32_positions(value, signed=False)


def _int32_positions(value, signed: bool):
    """A mask's integer array in int32, as the positions it meets are: values that int32 lacks
    clipped at ±2^30 (at 0 and 2^30 unless ``signed``), where compared with a position, or added
    to one, they answer as the originals would."""
    if fits_int32(value.dtype):
        return value.astype(jnp.int32)
    lowest = max(np.iinfo(np.int32).min // 2 if signed else 0, np.iinfo(value.dtype).min)
    return jnp.clip(value, lowest, np.iinfo(np.int32).max // 2).astype(jnp.int32)


def document(segment_ids, kv_segment_ids=None) -> Mask:
    """``segment_ids[q_idx] == kv_segment_ids[kv_idx]``: packed documents attend only within themselves.

    ``segment_ids`` is an integer array ``(Sq,)`` or ``(*batch, Sq)`` (runtime data: it may be
    traced); ``kv_segment_ids`` defaults to it (self-attention). Combine with ``causal()``.
    """
    q_seg = _segments(segment_ids, "segment_ids")
    kv_seg = q_seg if kv_segment_ids is None else _segments(kv_segment_ids, "kv_segment_ids")
    common = common_dtype("document", ("segment_ids", q_seg.dtype), ("kv_segment_ids", kv_seg.dtype))
    q_seg, kv_seg = q_seg.astype(common), kv_seg.astype(common)  # compared everywhere: promoted once
    return _Document(q_seg, kv_seg, _document_ranges(q_seg, kv_seg))


def _int32_ids(q_seg, kv_seg):
    """Segment ids as the kernels take them (integers of up to 32 bits): themselves where they
    are, else (64-bit ids under jax_enable_x64, uint32) their ranks among all the ids, which are
    equal exactly where the ids are."""
    if fits_int32(q_seg.dtype) and fits_int32(kv_seg.dtype):
        return q_seg, kv_seg
    every = jnp.sort(jnp.concatenate([q_seg.ravel(), kv_seg.ravel()]))
    return tuple(count_below(every, ids.ravel()).reshape(ids.shape) for ids in (q_seg, kv_seg))


@jax.jit
def _document_ranges(q_seg, kv_seg) -> tuple:
    """Which keys each query's document holds, and back (``RangeSpan``'s arrays), over the
    common leading dims of the two id arrays: tiles across documents are skipped. Jitted: a mask
    built eagerly compiles one program per shape, not each of its operations."""
    try:
        lead = jnp.broadcast_shapes(q_seg.shape[:-1], kv_seg.shape[:-1])
    except ValueError:
        raise ValueError(
            f"document: the leading dims of `segment_ids` {q_seg.shape} and `kv_segment_ids` "
            f"{kv_seg.shape} do not broadcast"
        ) from None
    q_flat, kv_flat = (_replicated(jnp.broadcast_to(x, (*lead, x.shape[-1]))).reshape(math.prod(lead), x.shape[-1]) for x in (q_seg, kv_seg))
    ranges = (*segment_ranges(q_flat, kv_flat), *segment_ranges(kv_flat, q_flat))
    return tuple(r.reshape(*lead, r.shape[-1]) for r in ranges)


def from_mask_mod(mask_mod: Callable) -> Mask:
    """Wraps a plain ``mask_mod(b, h, q_idx, kv_idx) -> bool`` so it combines with other masks.

    Built outside ``jit``, the arrays the function closes over are the mask's leaves: a mask built
    afresh for each batch (its document ids closed over) and handed to a jitted step as an argument
    reuses one compilation, its arrays traced, not baked in (and arrays that span processes may
    enter jit only so). Functions compare by their program.
    """
    if not callable(mask_mod):
        raise TypeError(f"from_mask_mod: expected a callable mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}")
    plain = _FromFunction(mask_mod)
    try:
        hoisted = plain.hoisted()
    except Exception:  # the call that uses the mask traces it again and names the error there
        return plain
    if not _returns_a_bool(hoisted.fn) or any(isinstance(c, jax.core.Tracer) for c in hoisted.consts):
        # A wrong result is refused where the mask is used; under a trace, the function as written
        # (shard_map's casts to varying kept).
        return plain
    return hoisted


def shifted(mask, q_offset=0, kv_offset=0, *, q_len: int | None = None, kv_len: int | None = None) -> Mask:
    """``mask`` for a block of queries that starts at position ``q_offset`` and of keys at
    ``kv_offset``: ``shifted(mask, qo, ko)(b, h, q_idx, kv_idx) == mask(b, h, q_idx + qo, kv_idx + ko)``.

    For attention over part of a sequence (a chunk of context parallelism, :func:`jf.parallel.ring_attention
    <jaxforge.functional.parallel.ring_attention>`): causal, sliding-window, prefix-LM and padding
    masks become masks of the same kinds, so the block skips the tiles they hide (all of them when
    the block sees nothing); chunked masks and plain ``mask_mod`` functions are read at the shifted
    indices, every tile visited. Each offset is a Python int, or an integer array: one offset, or
    one per batch item (shape ``batch`` of q, or broadcastable to it); runtime values such as
    ``lax.axis_index(axis) * block``.

    Masks that read arrays given per position (``document``, ``from_array``, ``block_mask``) slice
    them to the block: ``q_len`` queries from ``q_offset`` and ``kv_len`` keys from ``kv_offset``
    (static ints; each defaults to the rest of the sequence after a static offset, and is needed
    after a traced one). Their spans are sliced alike, so the block still skips the tiles they hide.
    The block must lie within the arrays (a traced offset is not checked: ``lax.dynamic_slice``
    clamps it).
    """
    mask = as_mask(mask)
    offsets = (_offset("shifted", "q_offset", q_offset), _offset("shifted", "kv_offset", kv_offset))
    lengths = (None if n is None else static_int("shifted", name, n, minimum=0) for name, n in (("q_len", q_len), ("kv_len", kv_len)))
    return mask.block(*offsets, *lengths)


def _block_length(fn: str, name: str, offset, length: int | None, size: int) -> int:
    """The length of a block of a mask's per-position arrays (``size`` positions) from ``offset``:
    ``length``, or the rest after a static offset; a static block checked to lie within them."""
    if length is None:
        if not isinstance(offset, int):
            raise TypeError(
                f"shifted: a {fn} mask reads arrays given per position, which a block slices: pass `{name}`, "
                "the block's length (its offset is traced)"
            )
        length = size - offset
    if isinstance(offset, int) and not 0 <= offset <= offset + length <= size:
        raise ValueError(f"shifted: the block [{offset}, {offset + length}) lies outside the {size} positions of the {fn} mask")
    return length


def _slice_positions(x, offset, length: int, *, axis: int, trailing: int):
    """``x``'s positions ``[offset, offset + length)`` along ``axis`` (one of its ``trailing`` dims,
    negative); the offset an int, one integer value, or one per item of ``x``'s leading dims."""
    if isinstance(offset, int):
        return lax.slice_in_dim(x, offset, offset + length, axis=axis)
    if offset.ndim == 0:
        return lax.dynamic_slice_in_dim(x, offset, length, axis=axis)
    lead, core = jnp.broadcast_shapes(x.shape[: x.ndim - trailing], offset.shape), x.shape[x.ndim - trailing :]
    rows = jnp.broadcast_to(x, (*lead, *core)).reshape(math.prod(lead), *core)
    starts = jnp.broadcast_to(offset, lead).reshape(math.prod(lead))
    sliced = jax.vmap(lambda row, start: lax.dynamic_slice_in_dim(row, start, length, axis=axis))(rows, starts)
    return sliced.reshape(*lead, *sliced.shape[1:])


def _moved(positions, offset):
    """Positions ``(*lead, seq)`` counted from ``offset`` (an int, one value or one per item)."""
    if isinstance(offset, int) or offset.ndim == 0:
        return (positions - offset).astype(positions.dtype)
    rank = max(positions.ndim, offset.ndim + 1)
    return (lax.broadcast_to_rank(positions, rank) - lax.broadcast_to_rank(offset[..., None], rank)).astype(positions.dtype)


def _block_ranges(ranges, q_offset, kv_offset, q_len: int, kv_len: int) -> tuple:
    """RangeSpan's six arrays of a block: each query's range of keys (and each key's of queries)
    sliced to the block's rows, moved to its positions and clipped to it; a range still holds the
    visible positions of the block, its sure part visible ones only."""
    per_query, per_key = ranges[:3], ranges[3:]
    return (
        *(jnp.clip(_moved(_slice_positions(r, q_offset, q_len, axis=-1, trailing=1), kv_offset), 0, kv_len) for r in per_query),
        *(jnp.clip(_moved(_slice_positions(r, kv_offset, kv_len, axis=-1, trailing=1), q_offset), 0, q_len) for r in per_key),
    )


def _offset(fn: str, name: str, value):
    """A position offset: a Python int, or an integer array (one offset, or one per batch item),
    signed (offsets are added and subtracted)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{fn}: `{name}` must be an int or an integer array, got {type(value).__name__} {value!r}")
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{fn}: `{name}` must be an int or an integer array, got dtype {value.dtype}")
    return _int32_positions(value, signed=True)


def block_mask(
    mask_mod: Callable, q_len: int, kv_len: int, *, batch_shape=None, num_heads: int | None = None, ranges: int = 1
) -> Mask:
    """``mask_mod`` evaluated once on every (query, key) pair, so that attention skips the tiles it hides.

    A plain ``mask_mod`` has no span: attention visits every tile and masks each. This evaluates it
    on the ``q_len x kv_len`` grid (a block of rows at a time: memory O(rows · kv_len)) and keeps,
    for each query, the range of keys it may see and the range it surely sees, and the same for
    each key: FlexAttention's ``create_block_mask``, at the resolution of positions rather than of
    one tile size, so every kernel and tile reads it. The function still decides each pair inside
    the tiles visited.

    ``ranges``: how many ranges of keys each query keeps. With one, the keys hidden between visible
    ones are visited (attention sinks or global tokens plus a sliding window: every key between
    them). With ``n > 1`` each query's keys are cut at its ``n - 1`` widest gaps (runs of whole
    blocks of 16 hidden keys, the narrowest tile) into ``n`` pieces; attention runs each piece (a
    call of its own, skipping the gaps) and merges them through their log-sum-exps. The grid is
    still evaluated once (each block of rows cut as it comes), its ranges measured ``n + 1`` times.

    ``batch_shape``: the leading dims of q, needed when ``mask_mod`` reads ``b``; ``num_heads``: the
    query heads, needed when it reads ``h`` (each range then holds every head's). A function that
    reads neither is evaluated once and serves any batch. The result combines with ``&`` (keeping
    its pieces), ``|`` and ``~`` (as one range); an attention call must have ``q_len`` queries and
    ``kv_len`` keys. Built under ``jit``, the evaluation is part of the program; built outside, it
    is one compiled program per shape.
    """
    if not callable(mask_mod):
        raise TypeError(f"block_mask: expected a callable mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}")
    mask = as_mask(mask_mod)
    q_len, kv_len = (static_int("block_mask", name, n, minimum=0) for name, n in (("q_len", q_len), ("kv_len", kv_len)))
    pieces = static_int("block_mask", "ranges", ranges, minimum=1)
    fn, consts = _traced_mask_mod(mask.mask_mod, "block_mask: `mask_mod`")
    if not _returns_a_bool(fn):
        got = ", ".join(f"{o.dtype}{list(o.shape)}" for o in fn.out_avals)
        raise TypeError(f"block_mask: `mask_mod` must return a boolean scalar for scalar (b, h, q_idx, kv_idx) indices, got {got}")
    reads_b, reads_h = fn.reads(0), fn.reads(1)
    if reads_b and batch_shape is None:
        raise ValueError("block_mask: `mask_mod` reads its batch index b; pass batch_shape=, the leading dims of q")
    if reads_h and num_heads is None:
        raise ValueError("block_mask: `mask_mod` reads its head index h; pass num_heads=, the number of query heads")
    batch_shape = _shape("block_mask", "batch_shape", batch_shape) if reads_b else ()
    heads = static_int("block_mask", "num_heads", num_heads, minimum=1) if reads_h else 1
    # Eagerly, one program per function and shape (its captured arrays as arguments). Already
    # traced (under jit, shard_map), the function as written: its hoisted form drops the casts to
    # varying that shard_map's typing needs.
    grid = dict(batch_shape=batch_shape, heads=heads, q_len=q_len, kv_len=kv_len, pieces=pieces)
    if any(isinstance(c, jax.core.Tracer) for c in consts):
        hull, parts = _measured(mask.mask_mod, **grid)
    else:
        hull, parts = _evaluated(consts, fn=fn, **grid)
    items_read, heads_read = (math.prod(batch_shape) if reads_b else 0), (heads if reads_h else 0)
    evaluated = functools.partial(_Evaluated, q_len=q_len, kv_len=kv_len, num_items=items_read, num_heads=heads_read)
    parts = tuple(evaluated(_Within(mask, lo, hi), ranges=r) for lo, hi, r in parts)
    return evaluated(mask, ranges=hull, parts=parts)


# Pairs one step of the range pass takes: its column reductions run in cache (measured at 8192^2:
# 1.4x faster on an array, 1.2x on a function than at 1 << 22), a few bytes each.
_PAIRS_PER_STEP = 1 << 20


@functools.partial(jax.jit, static_argnames=("fn", "batch_shape", "heads", "q_len", "kv_len", "pieces"))
def _evaluated(consts, *, fn, **grid) -> tuple:
    """:func:`_measured` of ``fn(b, h, q_idx, kv_idx, *consts)``, jitted on the function's program."""
    return _measured(lambda *idx: fn(*idx, *consts)[0], **grid)


def _measured(mask_mod, *, batch_shape: tuple[int, ...], heads: int, q_len: int, kv_len: int, pieces: int) -> tuple:
    """``(ranges, parts)``: RangeSpan's six arrays of ``mask_mod``, ``(*batch_shape, seq)`` each
    query's then each key's, and for ``pieces > 1`` each piece's ``(lo, hi, ranges)``: the bounds of
    its keys for each query and the ranges of the mask within them."""
    items, grid = math.prod(batch_shape), _grid(mask_mod)
    block = _rows_per_step(items, heads, q_len, kv_len)
    tile = lambda start: grid(_index(items), _index(heads), start + _index(block), _index(kv_len))  # noqa: E731
    hull, parts = _scanned_ranges(tile, items, q_len, kv_len, block, pieces)
    shaped = lambda arrays: tuple(r.reshape(*batch_shape, r.shape[1]) for r in arrays)  # noqa: E731
    return shaped(hull), tuple((*shaped((lo, hi)), shaped(ranges)) for lo, hi, ranges in parts)


def _scanned_ranges(tile, items: int, rows: int, cols: int, block: int, pieces: int = 1) -> tuple:
    """``(ranges, parts)`` as :func:`_measured`'s, ``(items, n)`` each, from one pass over blocks
    of rows, ``tile(start)`` the visible pairs of rows ``[start, start + block)``, ``(items, heads,
    block, cols)``: each block's rows give their :func:`_range` and their :func:`_cuts` (the pieces'
    bounds), and join each column's range as they come. A column's ``lo`` is final once a block
    sees it, so each later hidden pair bounds its ``sure_hi``. (A second pass over the transposed
    pairs costs 1.2x the time on a function, 10x on an array, its reductions strided; a pass per
    piece evaluates the mask again.)"""
    none = lambda n, v: jnp.full((items, n), v, jnp.int32)  # noqa: E731
    no_columns = (none(cols, rows), none(cols, 0), none(cols, rows))
    if not rows * cols:  # no pair visible; no block to slice, no gap to cut
        return (none(rows, cols), none(rows, 0), none(rows, cols), *no_columns), ()
    col = _index(cols)

    def joined(columns, start):
        seen_by = tile(start)
        bounds = []
        if pieces > 1:
            bounds = list(zip(*(jnp.moveaxis(x, -1, 0) for x in _cuts(seen_by, col, pieces=pieces))))  # (items, block) each
        wide_col = lax.broadcast_to_rank(col, seen_by.ndim)
        views = [seen_by, *(seen_by & (wide_col >= lo[:, None, :, None]) & (wide_col < hi[:, None, :, None]) for lo, hi in bounds)]
        row = (start + _index(block))[:, None]
        return [_joined_range(c, view, row, rows) for c, view in zip(columns, views)], (bounds, [_range(view, col) for view in views])

    steps = -(-rows // block)
    starts = jnp.minimum(_index(steps) * block, rows - block)  # the last block ends at the last row
    # The first block outside the loop: its ranges, as the loop's carry, have the type the tile
    # gives (varying under shard_map), which constants would not.
    columns, first = joined([no_columns] * (1 if pieces == 1 else 1 + pieces), starts[0])
    if steps == 1:  # (a scan of no steps, which jax.disable_jit refuses)
        later = jax.tree.map(lambda r: r[None][:0], first)
    else:
        columns, later = lax.scan(joined, columns, starts[1:])

    def in_order(r, r_later):  # (items, block) and (steps - 1, items, block) -> (items, rows)
        r = jnp.concatenate([r, jnp.moveaxis(r_later, 0, 1).reshape(items, (steps - 1) * block)], axis=1)
        kept = rows - (steps - 1) * block  # of the last block, the rows no block before it covered
        return jnp.concatenate([r[:, : (steps - 1) * block], r[:, steps * block - kept :]], axis=1)

    bounds, of_rows = jax.tree.map(in_order, first, later)
    ranges = [(*r, *c) for r, c in zip(of_rows, columns)]
    return ranges[0], tuple((lo, hi, r) for (lo, hi), r in zip(bounds, ranges[1:]))


def _joined_range(column_range, seen_by, row, rows: int) -> tuple:
    """Each column's ``(lo, hi, sure_hi)`` over the rows before a block joined with the block's,
    ``seen_by`` its visible pairs ``(items, heads, block, cols)`` at ``row`` ``(block, 1)``."""
    lo, hi, sure_hi = column_range
    seen, hidden_to_some = seen_by.any(axis=1), ~seen_by.all(axis=1)
    lo = jnp.minimum(lo, jnp.min(jnp.where(seen, row, rows), axis=1, initial=rows))
    hi = jnp.maximum(hi, jnp.max(jnp.where(seen, row + 1, 0), axis=1, initial=0))
    sure_hi = jnp.minimum(sure_hi, jnp.min(jnp.where(hidden_to_some & (row[None] >= lo[:, None]), row, rows), axis=1, initial=rows))
    return lo, hi, sure_hi


def sampled_keys(mask: Mask, rows, kv_len: int, batch_shape: tuple, num_heads: int, budget: int = 1 << 24):
    """``(items, len(rows))``: how many keys each item may see (at any head) at each of ``rows``,
    counted on the mask's function while tracing; None where the function reads arrays known only
    at run time, or the count would take over ``budget`` evaluations."""
    fn, consts = _traced_mask_mod(mask.mask_mod, "mask: `mask_mod`")
    items, heads = (math.prod(batch_shape) if fn.reads(0) else 1), (num_heads if fn.reads(1) else 1)
    if any(isinstance(c, jax.core.Tracer) for c in consts) or items * heads * len(rows) * kv_len > budget:
        return None
    with jax.ensure_compile_time_eval():
        visible = _grid(lambda *idx: fn(*idx, *consts)[0])(_index(items), _index(heads), jnp.asarray(rows, jnp.int32), _index(kv_len))
        return np.asarray(visible.any(axis=1).sum(axis=-1))


def _grid(visible):
    """``visible(b, h, row, col)`` of scalars, mapped over 1-d ``b, h, row, col``: ``(b, h, row, col)``."""
    for axis in (3, 2, 1, 0):
        visible = jax.vmap(visible, in_axes=tuple(0 if i == axis else None for i in range(4)))
    return visible


def _rows_per_step(items: int, heads: int, rows: int, cols: int) -> int:
    if not all(isinstance(n, int) for n in (items, heads, rows, cols)):  # a symbolic dim (jax.export): one step
        return rows
    return max(1, min(rows, _PAIRS_PER_STEP // max(1, items * heads * cols)))


def _index(n: int):
    return jnp.arange(n, dtype=jnp.int32)


def _range(seen_by, col) -> tuple:
    """``(lo, hi, sure_hi)`` of each (item, row): ``[lo, hi)`` holds every column visible at any
    head, and every column of ``[lo, sure_hi)`` is visible at every head (the run from ``lo``);
    ``[cols, 0)`` and ``cols`` for a row that sees none."""
    cols = col.shape[0]
    seen, every = seen_by.any(axis=1), seen_by.all(axis=1)
    col = lax.broadcast_to_rank(col, seen.ndim)
    lo = jnp.min(jnp.where(seen, col, cols), axis=-1, initial=cols)
    hi = jnp.max(jnp.where(seen, col + 1, 0), axis=-1, initial=0)
    sure_hi = jnp.min(jnp.where(~every & (col >= lo[..., None]), col, cols), axis=-1, initial=cols)  # <= hi
    return lo, hi, sure_hi


# block_mask cuts a row between blocks of this many columns, the narrowest tile a kernel takes:
# finer cuts would skip no more work, and the gap search runs on 16x fewer values.
_CUT_COLUMNS = 16


def _cuts(seen_by, col, *, pieces: int) -> tuple:
    """``(los, his)``, ``(items, rows, pieces)`` each: the columns any head sees in each row, cut
    at its ``pieces - 1`` widest gaps (blocks of ``_CUT_COLUMNS`` hidden columns) into ranges
    ``[los[i], his[i])``, in order; empty ranges ``[hi, hi)`` last when the row has fewer gaps."""
    cols = col.shape[0]
    seen = seen_by.any(axis=1)
    col = lax.broadcast_to_rank(col, seen.ndim)
    lo = jnp.min(jnp.where(seen, col, cols), axis=-1, initial=cols, keepdims=True)
    hi = jnp.max(jnp.where(seen, col + 1, 0), axis=-1, initial=0, keepdims=True)
    pad = [(0, 0)] * (seen.ndim - 1) + [(0, -cols % _CUT_COLUMNS)]
    seen = jnp.pad(seen, pad).reshape(*seen.shape[:-1], -1, _CUT_COLUMNS).any(axis=-1)  # per block
    block = lax.broadcast_to_rank(jnp.arange(seen.shape[-1], dtype=jnp.int32), seen.ndim)
    last_seen = lax.cummax(jnp.where(seen, block, -1), axis=seen.ndim - 1)
    before = jnp.concatenate([jnp.full_like(last_seen[..., :1], -1), last_seen[..., :-1]], axis=-1)
    gap = jnp.where(seen & (before >= 0), block - before - 1, 0)  # hidden blocks just before each seen one
    ends, starts = [], []
    for _ in range(pieces - 1):  # the widest gap left (XLA CPU's top_k is ~80x slower than argmax)
        end = jnp.argmax(gap, axis=-1, keepdims=True).astype(jnp.int32)  # int64 under x64
        cut = jnp.take_along_axis(gap, end, axis=-1) > 0
        start = jnp.take_along_axis(before, end, axis=-1) + 1
        ends.append(jnp.where(cut, end * _CUT_COLUMNS, hi))  # no gap left: an empty range at hi
        starts.append(jnp.where(cut, start * _CUT_COLUMNS, hi))
        gap = jnp.where(block == end, 0, gap)
    end, start = jnp.concatenate(ends, axis=-1), jnp.concatenate(starts, axis=-1)
    order = jnp.argsort(end, axis=-1)
    end, start = (jnp.take_along_axis(x, order, axis=-1) for x in (end, start))
    return tuple(jnp.concatenate(x, axis=-1) for x in ([lo, end], [start, hi]))


def from_array(visible) -> Mask:
    """The mask an array of visible pairs gives: ``visible`` boolean, broadcasting to ``(*batch,
    num_heads, q_len, kv_len)`` (``jax.nn.dot_product_attention``'s layout; ``(q_len, kv_len)``
    serves every item and head). ``jf.attention(..., mask=visible)`` takes the array as it is.

    Each call measures, per batch item, the range of keys each query sees and of queries each key
    is seen by (any head), as :func:`block_mask` does for a function, so the tiles outside them are
    skipped and those inside them that every head sees whole skip the mask arithmetic. The array is
    an operand (a new array of the same shape reuses a compiled call) that kernels read at each
    score they compute. It combines with the other masks by ``&``, ``|`` and ``~``; an additive
    bias is a ``score_mod`` instead. An array reused across calls measures once through
    ``block_mask(from_array(visible), q_len, kv_len)``, which can also cut it (``ranges=``).
    """
    visible = visible if isinstance(visible, jax.Array) else jnp.asarray(visible)
    if visible.dtype != jnp.bool_:
        raise TypeError(
            f"from_array: a mask array must be boolean (True: visible), got dtype {visible.dtype}; "
            "an additive bias goes in score_mod"
        )
    if visible.ndim < 2:
        raise ValueError(
            f"from_array: a mask array has shape (*batch, num_heads, q_len, kv_len) or (q_len, kv_len), got shape {visible.shape}"
        )
    return _FromArray(visible)


def full() -> Mask:
    """Every key visible (the identity of ``&``)."""
    return _Full()


def picture(mask, q_len: int, kv_len: int, *, block: int = 16, b: int = 0, h: int = 0) -> str:
    """The mask of batch item ``b`` and query head ``h`` drawn over ``q_len`` queries (rows) and
    ``kv_len`` keys (columns), a character a ``block x block`` block of pairs: ``█`` all visible,
    ``░`` some, ``·`` none; headed by the share of blocks hidden. FlexAttention's printed BlockMask,
    at any resolution (``block=1``: each pair). ``mask``: a Mask, a ``mask_mod`` or a boolean array.
    Every pair is evaluated at once (``q_len · kv_len`` booleans): a picture is for a notebook's sizes.
    A mask's per-item arrays are read at ``b`` as jnp indexes: past their last item, the last one's.

    Example:
      >>> import jaxforge as jf
      >>> print(jf.masks.picture(jf.masks.causal() & jf.masks.sliding_window(32), 64, 64))
      4 x 4 blocks of 16 x 16, 43.8% hidden
      ░···
      █░··
      ░█░·
      ·░█░
    """
    mask = as_mask(mask)
    q_len, kv_len = (static_int("picture", name, n, minimum=1) for name, n in (("q_len", q_len), ("kv_len", kv_len)))
    block = static_int("picture", "block", block, minimum=1)
    b, h = (static_int("picture", name, i, minimum=0) for name, i in (("b", b), ("h", h)))
    rows, cols = (jnp.arange(n, dtype=jnp.int32) for n in (q_len, kv_len))
    at = lambda i, j: mask(jnp.int32(b), jnp.int32(h), i, j)  # noqa: E731
    visible = np.asarray(jax.vmap(jax.vmap(at, (None, 0)), (0, None))(rows, cols), bool)
    blocks = -(-q_len // block), -(-kv_len // block)
    seen = np.zeros((blocks[0] * block, blocks[1] * block), np.int64)  # visible pairs, padded to whole blocks
    pairs = np.zeros_like(seen)  # pairs inside the grid: an edge block holds fewer
    seen[:q_len, :kv_len], pairs[:q_len, :kv_len] = visible, 1
    count = lambda x: x.reshape(blocks[0], block, blocks[1], block).sum(axis=(1, 3))  # noqa: E731
    seen, total = count(seen), count(pairs)
    lines = ["".join("█" if n == t else "░" if n else "·" for n, t in zip(*row)) for row in zip(seen, total)]
    hidden = 100 * np.mean(seen == 0)
    header = f"{blocks[0]} x {blocks[1]} blocks of {block} x {block}, {hidden:.1f}% hidden"
    return "\n".join([header, *lines])


def _shape(fn: str, name: str, value) -> tuple[int, ...]:
    try:
        shape = tuple(value)
    except TypeError:
        shape = None
    if shape is None or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise TypeError(f"{fn}: `{name}` must be a tuple of non-negative ints, got {value!r}")
    return tuple(int(n) for n in shape)


def _segments(ids, name: str):
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"document: `{name}` must be an integer array, got dtype {ids.dtype}")
    if ids.ndim < 1:
        raise ValueError(f"document: `{name}` must have shape (seq,) or (*batch, seq), got shape {ids.shape}")
    return ids


def _per_batch(x, batch_shape, fn: str, name: str, trailing: int):
    """``x`` of shape ``(*batch', *trailing)`` as ``(prod(batch), *trailing)``; ``batch'`` broadcasts."""
    core = x.shape[x.ndim - trailing :] if trailing else ()
    lead = x.shape[: x.ndim - trailing]
    try:
        x = jnp.broadcast_to(x, (*batch_shape, *core))
    except ValueError:
        raise ValueError(
            f"{fn}: `{name}` has leading dims {lead}, which do not broadcast to the batch dims {batch_shape} of q"
        ) from None
    return _replicated(x.reshape(math.prod(batch_shape), *core))


def _replicated(x):
    """``x`` replicated where explicit sharding split it: masks and spans read it at traced batch
    indices, and the span's sort needs whole rows. (A few integers per token: small next to q, k, v.)"""
    return _core.gathered(x)
