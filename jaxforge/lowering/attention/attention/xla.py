"""Default lowering of the attention primitives: the tile algorithms of kernel.py in XLA.

Batch items and heads are vmapped, query (or key) tiles are scanned, and the inner loop visits only
the tiles the mask's span allows, so memory is O(S · tile) per head and causal masks skip half the
work. The key side keeps its (S, H, D) layout: the loops read its tiles, and the backward writes
its gradients' tiles, in place. Runs on every platform; it is also the GPU fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxforge.lowering.attention.attention import config
from jaxforge.lowering.attention.attention.kernel import (
    Geometry,
    MaskTiles,
    bounds_table,
    bwd_dkv_cols,
    fwd_rows,
    tangent_bwd_cols,
    tangent_rows,
)
from jaxforge.primitives import _core
from jaxforge.primitives.attention.attention import Implementation, accumulation_dtype, second_order_operands
from jaxforge.primitives.attention.mods import Mods, float_consts

__all__ = [
    "attention_bwd_xla",
    "attention_fwd_xla",
    "attention_tangent2_xla",
    "attention_tangent_bwd_xla",
    "attention_tangent_xla",
    "geometry",
    "heads_first",
    "pack_heads",
    "seq_last",
    "unpack_heads",
]


def geometry(
    name: str, q, k, scale: float, impl: Implementation, pack_any_length: bool = False, **tile_args
) -> Geometry:
    """The call's tiles, for q and k as the primitive has them (``pack_heads`` packs q's side
    after). ``pack_any_length``: config.packs_gqa's ``any_length``. ``tile_args``: config.tiles'
    keywords (XLA: whether the call is masked; Triton: the kernels' shared-memory sizes)."""
    sq, hq, _ = q.shape[-3:]
    skv, hkv, _ = k.shape[-3:]
    group = hq // hkv
    pack = group if config.packs_gqa(sq, group, impl, pack_any_length) else 1
    block_q, block_kv = config.tiles(name, sq * pack, skv, impl, **tile_args)
    precise = q.dtype.itemsize >= 4  # f32/f64 products in full precision; bf16/f16 on tensor cores
    acc, precision = accumulation_dtype(q.dtype), "highest" if precise else None
    return Geometry(sq, skv, block_q, block_kv, group // pack, scale, acc, precision, pack)


def _geometry(q, k, scale: float, impl: Implementation, mods: Mods, backward: bool = False) -> Geometry:
    """The XLA lowering's geometry: its tiles depend on whether the call is masked; few query rows
    a tile lay their scores keys-major; an unmasked ``backward`` (a loop over key tiles with the
    query side in its carry: attention_bwd, attention_tangent_bwd) packs GQA groups (config.py)."""
    masked = mods.mask is not None
    geo = geometry("xla", q, k, scale, impl, pack_any_length=backward and not masked, masked=masked)
    return dataclasses.replace(geo, keys_major=config.xla_keys_major(geo.block_q))


def pack_heads(geo: Geometry, x, rows: bool = False):
    """A query-side array ``(*batch, Sq, Hq, D)`` (``rows``: ``(*batch, Sq, Hq)``, lse-like) as the
    kernels see it under GQA packing: ``(*batch, Sq * pack, Hq / pack, ...)``, row ``s * pack + g``
    of packed head ``h`` holding query ``s`` of head ``h * pack + g`` (kernel.Geometry)."""
    if geo.pack == 1:
        return x
    seq = x.ndim - (2 if rows else 3)
    s, h = x.shape[seq : seq + 2]
    x = x.reshape(*x.shape[:seq], s, h // geo.pack, geo.pack, *x.shape[seq + 2 :])
    x = jnp.swapaxes(x, seq + 1, seq + 2)
    return x.reshape(*x.shape[:seq], s * geo.pack, h // geo.pack, *x.shape[seq + 3 :])


def unpack_heads(geo: Geometry, x, rows: bool = False):
    """The inverse of :func:`pack_heads`."""
    if geo.pack == 1:
        return x
    seq = x.ndim - (2 if rows else 3)
    r, h = x.shape[seq : seq + 2]
    x = x.reshape(*x.shape[:seq], r // geo.pack, geo.pack, h, *x.shape[seq + 2 :])
    x = jnp.swapaxes(x, seq + 1, seq + 2)
    return x.reshape(*x.shape[:seq], r // geo.pack, h * geo.pack, *x.shape[seq + 3 :])


def heads_first(x, padded: int, group: int):
    """A query-side ``(*batch, S, H, D)`` -> ``(B, H/group, group, padded, D)``."""
    s, h, d = x.shape[-3:]
    x = x.reshape(math.prod(x.shape[:-3]), s, h, d)  # not -1: the size may be 0 (d = 0)
    x = jnp.pad(x, ((0, 0), (0, padded - s), (0, 0), (0, 0)))
    return jnp.swapaxes(x, 1, 2).reshape(x.shape[0], h // group, group, padded, d)


def seq_last(x, padded: int, group: int | None = None):
    """``(*batch, S, H)`` rows (lse, delta) -> ``(B, H, padded)`` or ``(B, H/group, group, padded)``."""
    s, h = x.shape[-2:]
    x = jnp.swapaxes(x.reshape(math.prod(x.shape[:-2]), s, h), 1, 2)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, padded - s)))
    return x if group is None else x.reshape(x.shape[0], h // group, group, padded)


def _back(x, batch, s: int):
    """``(B, Hkv, G, tiles, tile, *rest)`` -> ``(*batch, s, Hq, *rest)``."""
    bsz, hkv, group, tiles, tile, *rest = x.shape
    x = x.reshape(bsz, hkv * group, tiles * tile, *rest)[:, :, :s]
    return jnp.swapaxes(x, 1, 2).reshape(*batch, s, hkv * group, *rest)


def _queries_back(geo: Geometry, x, batch, rows: bool = False):
    """A query-side result ``(B, Hkv, G, tiles, tile, ...)`` as ``(*batch, Sq, Hq, ...)``: heads
    unpacked (``rows``: lse-like, no trailing dim)."""
    return unpack_heads(geo, _back(x, batch, geo.rows), rows=rows)


def _slice(x, i, size):
    return lax.dynamic_slice_in_dim(x, i * size, size, axis=0)


def _mask_tiles(geo: Geometry, mods: Mods, b, mask_c, joined) -> MaskTiles:
    """The mask's operands of batch item ``b``, its positional arrays padded to whole tiles, and
    ``joined``'s tile bounds (:func:`_joined_bounds`)."""
    item = mods.item_mask(b, mask_c)
    pad = lambda x, size: jnp.pad(x, (0, size - x.shape[0]))
    rows = [pad(jnp.repeat(r, geo.pack), geo.num_q_tiles * geo.block_q) for r in item.rows]
    cols = [pad(c, geo.num_kv_tiles * geo.block_kv) for c in item.cols]
    return MaskTiles(
        item.consts,
        item.span,
        lambda i: [_slice(r, i, geo.block_q) for r in rows],
        lambda j: [_slice(c, j, geo.block_kv) for c in cols],
        *joined,
    )


def _joined_bounds(geo: Geometry, mods: Mods, mask_c, batch_ids) -> tuple:
    """``(row_bounds, col_bounds)`` of a span that reads arrays (documents, per-item lengths and
    offsets, block masks): each tile's bounds joined over the batch items, the hull of the tiles
    they visit and the intersection of those whole to them; ``()`` for a span without arrays.

    Tile loops whose trip counts vary with the vmapped item run every lane to the longest and
    select each lane's whole carry at every step (the backward's carries hold a sequence of dq);
    on joined bounds every lane walks the same tiles, masked where they are not its own.
    """
    if not mods.span.num_arrays:
        return ()
    span = jax.vmap(lambda b: mods.item_mask(b, mask_c).span)(batch_ids)

    def joined(bounds, num_tiles):
        table = bounds_table(functools.partial(bounds, mods), num_tiles, tuple(span))  # (items, tiles, 4)
        lo, hi, full_lo, full_hi = (table[..., n] for n in range(4))
        most = jnp.iinfo(table.dtype).max  # no items: bounds no lane reads
        table = jnp.stack([lo.min(0, initial=most), hi.max(0, initial=0), full_lo.max(0, initial=0), full_hi.min(0, initial=most)], axis=-1)
        return lambda t: tuple(table[t, n] for n in range(4))

    return joined(geo.row_bounds, geo.num_q_tiles), joined(geo.col_bounds, geo.num_kv_tiles)


def _split(consts, mods: Mods):
    n = mods.num_mask_consts
    return list(consts[:n]), list(consts[n : n + mods.num_score_consts])


def _kv_rows(x, padded: int):
    """``(*batch, S, H, D)`` -> ``(B, padded, H, D)``: the key side keeps its layout (the loops
    read its tiles in place, :func:`_over_heads`); it is copied only to pad S to whole tiles."""
    s, h, d = x.shape[-3:]
    x = x.reshape(math.prod(x.shape[:-3]), s, h, d)
    return x if padded == s else jnp.pad(x, ((0, 0), (0, padded - s), (0, 0), (0, 0)))


def _over_heads(fn, geo: Geometry, hkv: int, head_args, kv_args, batch_ids, head_offset):
    """Runs ``fn(b, h, *head_args[b, hk, g], load_kv)`` for every (b, hk, g), vmapped; ``b`` and
    ``h`` are global indices: ``batch_ids[local b]``, ``head_offset + local h`` (packed heads:
    ``head_offset / pack + local h``). ``load_kv(j)``: key tile ``j`` of each of ``kv_args``
    (``_kv_rows`` layout) for the lane's (b, hk), read in place: a transposed copy of the whole key
    side would cost more than the loops' reads on CPU, where each key is read once when decoding."""

    def lane(b_local, hk, b, h, *head):
        def load_kv(j):
            start = tuple(jnp.asarray(i, jnp.int32) for i in (b_local, j * geo.block_kv, hk, 0))  # one index dtype
            return tuple(lax.dynamic_slice(x, start, (1, geo.block_kv, 1, x.shape[-1]))[0, :, 0] for x in kv_args)

        return fn(b, h, *head, load_kv)

    # Tracing batches the loops' bodies once per vmap level: (b, hk) is one vmap, and a group of
    # one head takes none.
    if geo.group == 1:

        def per_group(b_local, hk, b, h, *head):
            first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
            return jax.tree.map(lambda x: x[None], lane(b_local, hk, b, h[0], *first(head)))

    else:
        per_group = jax.vmap(lane, in_axes=(None, None, None, 0) + (0,) * len(head_args))
    nb, lanes = batch_ids.shape[0], batch_ids.shape[0] * hkv
    b_local, hk = divmod(jnp.arange(lanes, dtype=jnp.int32), hkv)
    heads = (jnp.arange(hkv * geo.group, dtype=jnp.int32) + head_offset // geo.pack).reshape(hkv, geo.group)
    by_lane = lambda tree: jax.tree.map(lambda x: x.reshape(lanes, *x.shape[2:]), tree)  # noqa: E731
    out = jax.vmap(per_group)(b_local, hk, batch_ids[b_local], heads[hk], *by_lane(head_args))
    return jax.tree.map(lambda x: x.reshape(nb, hkv, *x.shape[1:]), out)


def _over_key_tiles(cols, geo: Geometry, hkv: int, head_args, fused, kv_args, batch_ids, head_offset):
    """Scans key tiles ``j``, running ``cols(b, h, *head_args, fused, *kv_tiles, j) -> (gk, gv,
    fused)`` for every (b, hk, g) as :func:`_over_heads`; ``fused`` (leading dims (B, Hkv, G)) is
    the lanes' carry. Each tile's gk, gv, summed over the group, go in place into accumulators of
    ``kv_args[:2]``'s layout and dtype, returned with the last carry: no per-tile stack and no
    transposed copy of the key side on the way back."""

    def tile(carry, j):
        fused, gk, gv = carry

        def lane(b, h, *args):
            *head, fused, load_kv = args
            return cols(b, h, *head, fused, *load_kv(j), j)

        gk_t, gv_t, fused = _over_heads(lane, geo, hkv, [*head_args, fused], kv_args, batch_ids, head_offset)
        put = lambda acc, t: lax.dynamic_update_slice_in_dim(  # noqa: E731
            acc, jnp.swapaxes(t.sum(axis=2), 1, 2).astype(acc.dtype), j * geo.block_kv, axis=1
        )
        return (fused, put(gk, gk_t), put(gv, gv_t)), None

    init = (fused, *(jnp.zeros(x.shape, x.dtype) for x in kv_args[:2]))
    (fused, gk, gv), _ = lax.scan(tile, init, jnp.arange(geo.num_kv_tiles))
    return fused, gk, gv


def _keys_back(x, batch, s: int):
    """A key-side result in ``_kv_rows`` layout as ``(*batch, s, H, D)``."""
    return x[:, :s].reshape(*batch, s, *x.shape[2:])


def _traced_once(tiles):
    """``tiles(*arrays, geo=, mods=, ...)`` jitted on its keywords, which fix its program (config.py
    is read before, into ``geo``): a lowering that meets the same call again, in another program
    (the forward in a jvp's and in a gradient's), reuses jax's trace of the vmapped tile loops,
    most of a lowering's time."""
    keywords = [p.name for p in inspect.signature(tiles).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return jax.jit(tiles, static_argnames=keywords)


def attention_fwd_xla(
    q, k, v, *consts, mods: Mods, scale: float, max_scores: bool, first_keys: bool, implementation: Implementation, batch_ids, head_offset
):
    geo = _geometry(q, k, scale, implementation, mods)
    return _fwd_tiles(q, k, v, consts, batch_ids, head_offset, geo=geo, mods=mods, max_scores=max_scores, first_keys=first_keys)


@_traced_once
def _fwd_tiles(q, k, v, consts, batch_ids, head_offset, *, geo: Geometry, mods: Mods, max_scores: bool, first_keys: bool):
    mask_c, score_c = _split(consts, mods)
    batch, hkv = q.shape[:-3], k.shape[-2]
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    joined = _joined_bounds(geo, mods, mask_c, batch_ids)

    def one_head(b, h, q_h, load_kv):
        mask = _mask_tiles(geo, mods, b, mask_c, joined)
        tile = lambda i: fwd_rows(geo, mods, _slice(q_h, i, geo.block_q), load_kv, b, h, i, mask, score_c, max_scores=max_scores, first_keys=first_keys)
        return lax.map(tile, jnp.arange(geo.num_q_tiles))

    out, *rows = _over_heads(
        one_head,
        geo,
        hkv,
        [heads_first(pack_heads(geo, q), sq_pad, geo.group)],
        [_kv_rows(k, skv_pad), _kv_rows(v, skv_pad)],
        batch_ids,
        head_offset,
    )
    return _queries_back(geo, out, batch).astype(q.dtype), *(_queries_back(geo, x, batch, rows=True) for x in rows)


def attention_tangent_xla(q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation: Implementation, batch_ids, head_offset):
    geo = _geometry(q, k, scale, implementation, mods)
    return _tangent_tiles(q, k, v, out, lse, operands, batch_ids, head_offset, geo=geo, mods=mods)


@_traced_once
def _tangent_tiles(q, k, v, out, lse, operands, batch_ids, head_offset, *, geo: Geometry, mods: Mods):
    n_consts = mods.num_mask_consts + mods.num_score_consts
    mask_c, score_c = _split(operands[:n_consts], mods)
    dq, dk, dv, *dscore = operands[n_consts:]
    batch, hkv = q.shape[:-3], k.shape[-2]
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    joined = _joined_bounds(geo, mods, mask_c, batch_ids)

    def one_head(b, h, q_h, dq_h, out_h, lse_h, load):
        mask = _mask_tiles(geo, mods, b, mask_c, joined)

        def tile(i):
            rows = [_slice(x, i, geo.block_q) for x in (q_h, dq_h, out_h, lse_h)]
            return tangent_rows(geo, mods, *rows, load, b, h, i, mask, score_c, dscore)

        return lax.map(tile, jnp.arange(geo.num_q_tiles))

    dout, dlse = _over_heads(
        one_head,
        geo,
        hkv,
        [heads_first(pack_heads(geo, x), sq_pad, geo.group) for x in (q, dq, out)]
        + [seq_last(pack_heads(geo, lse, rows=True), sq_pad, geo.group)],
        [_kv_rows(x, skv_pad) for x in (k, v, dk, dv)],
        batch_ids,
        head_offset,
    )
    return _queries_back(geo, dout, batch).astype(out.dtype), _queries_back(geo, dlse, batch, rows=True)


def attention_tangent2_xla(
    q, k, v, out, lse, *operands, mods: Mods, scale: float, moving, implementation: Implementation, batch_ids, head_offset
):
    """The tangent map's jvp in (q, k, v, out, lse) — a jvp of a jvp: forward mode through
    attention_tangent_xla's loops, which carry each tangent beside its value (O(S) memory), along
    those of the five that are ``moving``."""
    consts, d, along, dscore = second_order_operands(operands, mods, 5)

    def tangent(q, k, v, out, lse):
        return attention_tangent_xla(
            q, k, v, out, lse, *consts, *d, *dscore, mods=mods, scale=scale, implementation=implementation,
            batch_ids=batch_ids, head_offset=head_offset,
        )  # fmt: skip

    return _core.jvp_along(tangent, (q, k, v, out, lse), along, moving)[1]


def bwd_delta(out, g_out, g_lse, acc_dtype):
    """``Δ = rowsum(g_out · out) - g_lse``, the row term of the softmax backward."""
    return jnp.sum(g_out.astype(acc_dtype) * out.astype(acc_dtype), axis=-1) - g_lse.astype(acc_dtype)


def attention_bwd_xla(
    q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, implementation: Implementation, batch_ids, head_offset
):
    """One pass over key tiles per (batch item, query head): gk and gv per tile, gq and the score
    consts' cotangents accumulated in the loop carry (the probabilities are computed once).
    GQA heads are vmapped like the others and their gk, gv summed over the group tile by tile."""
    geo = _geometry(q, k, scale, implementation, mods, backward=True)
    return _bwd_tiles(q, k, v, out, lse, operands, batch_ids, head_offset, geo=geo, mods=mods, const_grads=const_grads)


@_traced_once
def _bwd_tiles(q, k, v, out, lse, operands, batch_ids, head_offset, *, geo: Geometry, mods: Mods, const_grads):
    per_head = dataclasses.replace(geo, group=1)
    *consts, g_out, g_lse = operands
    mask_c, score_c = _split(consts, mods)
    batch, hkv = q.shape[:-3], k.shape[-2]
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    delta = bwd_delta(out, g_out, g_lse, geo.acc_dtype)
    joined = _joined_bounds(geo, mods, mask_c, batch_ids)
    wanted_consts = [c for c, w in zip(float_consts(score_c), const_grads) if w]

    def cols(b, h, q_h, g_out_h, lse_h, delta_h, fused, k_t, v_t, j):
        load_q = lambda _, i: tuple(_slice(x, i, geo.block_q) for x in (q_h, g_out_h, lse_h, delta_h))  # noqa: E731
        mask = _mask_tiles(geo, mods, b, mask_c, joined)
        return bwd_dkv_cols(per_head, mods, k_t, v_t, load_q, b, h, j, mask, score_c, fused=fused, const_grads=const_grads)

    lanes = (batch_ids.shape[0], hkv, geo.group)
    fused = (jnp.zeros((*lanes, 1, sq_pad, q.shape[-1]), geo.acc_dtype), [jnp.zeros((*lanes, *c.shape), c.dtype) for c in wanted_consts])
    (gq, g_consts), gk, gv = _over_key_tiles(
        cols,
        geo,
        hkv,
        [heads_first(pack_heads(geo, x), sq_pad, geo.group) for x in (q, g_out)]
        + [seq_last(pack_heads(geo, x, rows=True), sq_pad, geo.group) for x in (lse, delta)],
        fused,
        [_kv_rows(k, skv_pad), _kv_rows(v, skv_pad)],
        batch_ids,
        head_offset,
    )
    gq = gq.reshape(*gq.shape[:3], geo.num_q_tiles, geo.block_q, gq.shape[-1])
    gk, gv = _keys_back(gk, batch, geo.skv), _keys_back(gv, batch, geo.skv)
    g_consts = [g.sum(axis=(0, 1, 2)) for g in g_consts]
    return (_queries_back(geo, gq, batch).astype(q.dtype), gk, gv, *g_consts)


def attention_bwd_tangent_xla(
    q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, moving, implementation: Implementation, batch_ids,
    head_offset,
):  # fmt: skip
    """The backward's jvp in (q, k, v, out, lse, g_out, g_lse) — a Hessian-vector product, forward
    over reverse: forward mode through attention_bwd_xla's loops, which carry each tangent beside its
    value and keep no residuals (O(S) memory), along those of the seven that are ``moving`` (the
    jvp of a pullback at a fixed cotangent: g_out, g_lse not; 15% less time at d64 causal)."""
    *consts, g_out, g_lse = operands[:-7]

    def bwd(q, k, v, out, lse, g_out, g_lse):
        return attention_bwd_xla(
            q, k, v, out, lse, *consts, g_out, g_lse, mods=mods, scale=scale, const_grads=const_grads,
            implementation=implementation, batch_ids=batch_ids, head_offset=head_offset,
        )  # fmt: skip

    return _core.jvp_along(bwd, (q, k, v, out, lse, g_out, g_lse), operands[-7:], moving)[1]


def attention_tangent_bwd_xla(
    q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation: Implementation, batch_ids, head_offset
):
    """The tangent map's transpose in (q, k, v, out, lse) — a grad through a jvp — as attention_bwd_xla:
    one pass over key tiles per (batch item, query head), the query side in the loop carry."""
    geo = _geometry(q, k, scale, implementation, mods, backward=True)
    return _tangent_bwd_tiles(q, k, v, out, lse, operands, batch_ids, head_offset, geo=geo, mods=mods)


@_traced_once
def _tangent_bwd_tiles(q, k, v, out, lse, operands, batch_ids, head_offset, *, geo: Geometry, mods: Mods):
    per_head = dataclasses.replace(geo, group=1)
    n_consts = mods.num_mask_consts + mods.num_score_consts
    mask_c, score_c = _split(operands[:n_consts], mods)
    dq, dk, dv, g_dout, g_dlse, *dscore = operands[n_consts:]
    batch, hkv = q.shape[:-3], k.shape[-2]
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    c = -bwd_delta(out, g_dout, g_dlse, geo.acc_dtype)
    joined = _joined_bounds(geo, mods, mask_c, batch_ids)

    def cols(b, h, q_h, dq_h, g_dout_h, lse_h, c_h, fused, k_t, v_t, dk_t, dv_t, j):
        load_q = lambda i: tuple(_slice(x, i, geo.block_q) for x in (q_h, dq_h, lse_h, c_h, g_dout_h))  # noqa: E731
        mask = _mask_tiles(geo, mods, b, mask_c, joined)
        return tangent_bwd_cols(per_head, mods, k_t, v_t, dk_t, dv_t, load_q, b, h, j, mask, score_c, dscore, fused)

    lanes = (batch_ids.shape[0], hkv, geo.group)
    rows = jnp.zeros((*lanes, sq_pad), geo.acc_dtype)
    (gq, glse, gc), gk, gv = _over_key_tiles(
        cols,
        geo,
        hkv,
        [heads_first(pack_heads(geo, x), sq_pad, geo.group) for x in (q, dq, g_dout)]
        + [seq_last(pack_heads(geo, x, rows=True), sq_pad, geo.group) for x in (lse, c)],
        (jnp.zeros((*lanes, sq_pad, q.shape[-1]), geo.acc_dtype), rows, rows),
        [_kv_rows(x, skv_pad) for x in (k, v, dk, dv)],
        batch_ids,
        head_offset,
    )
    tiled = lambda x: x.reshape(*x.shape[:3], geo.num_q_tiles, geo.block_q, *x.shape[4:])  # noqa: E731
    gq, glse, gc = _queries_back(geo, tiled(gq), batch), *(_queries_back(geo, tiled(x), batch, rows=True) for x in (glse, gc))
    gk, gv = _keys_back(gk, batch, geo.skv), _keys_back(gv, batch, geo.skv)
    gout = -gc[..., None] * g_dout.astype(geo.acc_dtype)
    return gq.astype(q.dtype), gk, gv, gout.astype(out.dtype), glse.astype(lse.dtype)

