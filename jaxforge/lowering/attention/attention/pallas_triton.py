"""The attention primitives as Pallas kernels: Triton on GPU (sm80+), interpret mode on CPU.

One program per (batch item, head, tile); its body is kernel.py's tile algorithm, with ``load``
slicing the key/value (or query) refs. Forward and tangent programs own a query tile and loop over
key tiles; the backward runs two kernels, dq over query tiles and (dk, dv) over key tiles (looping
over the query heads of its GQA group), so gq, gk and gv need no atomics. Triton's tiles want
powers of two of at least 16: a head dim is zero-padded to one, or held in two pieces where that
is narrower (config.head_pieces: 576 as 512 + 64). A piece is a slice of the head dim that a
program reads and writes on its own (a block 576 wide, loads 512 and 64 wide: no copy of the
operand is made), and kernel.py's products sum over the pieces.

Arrays a mask or score_mod closes over (a bias table, ALiBi slopes) are handed to every program
whole, as refs the functions read an element at a time (points.PointArray). Their cotangents sum
over every program: the dq kernel adds each read's cotangent atomically at its address. A mask's
positional arrays (document segment ids) are gathered per batch item before the call and a program
slices one tile of them at a time; the tile bounds its span gives them are computed before the
call too. So document masks run in the Triton kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxforge.lowering import build
from jaxforge.lowering.attention.attention import config, xla
from jaxforge.lowering.attention.attention.kernel import (
    Geometry,
    MaskTiles,
    bounds_table,
    bwd_dkv_cols,
    bwd_dq_rows,
    fwd_rows,
    tangent_bwd_cols,
    tangent_bwd_rows,
    tangent_rows,
    zeros,
)
from jaxforge.primitives.attention import points
from jaxforge.primitives.attention.attention import Implementation, merge_weights
from jaxforge.primitives.attention.mods import Mods

__all__ = [
    "CALL_KERNELS",
    "attention_bwd_pallas",
    "attention_fwd_pallas",
    "attention_tangent_bwd_pallas",
    "attention_tangent_pallas",
    "reads_captured_arrays",
    "triton_can_run",
    "triton_fits",
]

def reads_captured_arrays(mods: Mods) -> bool:
    """Whether the mask or score_mod closes over arrays (beyond a mask's positional ones)."""
    return any(f.num_consts for f in (mods.mask, mods.score) if f is not None)


def triton_can_run(mods: Mods) -> bool:
    """Whether the mask and score_mod are elementwise and read their captured arrays at points
    (points.reads_points), so the Triton kernels can apply them: Triton lowers no gather."""
    return all(points.reads_points(f) for f in (mods.mask, mods.score) if f is not None)


# The kernels of each call, which share its tiles.
CALL_KERNELS = {
    "fwd": ("fwd",),
    "tangent": ("tangent",),
    "bwd": ("bwd_dq", "bwd_dkv"),
    "tangent_bwd": ("tangent_bwd_rows", "tangent_bwd_cols"),
}


def triton_fits(call: str, q, k, v, implementation: Implementation) -> bool:
    """Whether some tiles fit the shared memory of ``call``'s kernels on this GPU (config.tiles):
    not, for example, float32 head dims of 256 in the tangent on an sm86's 99 KiB."""
    try:
        _geometry(call, q, k, v, 1.0, implementation)
    except ValueError:
        return False
    return True

_SQ = pl.squeezed


def _pad_last(x, size: int):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _geometry(call: str, q, k, v, scale: float, implementation: Implementation):
    """Tiles that fit the shared memory of every kernel of ``call`` (see config.tiles), the
    kernels' ``(num_warps, num_stages)``, and the widths of the pieces of q's and v's head dims
    (config.head_pieces: two where ``implementation.head_pieces`` asks, or by default once
    validated on a GPU)."""
    kernels = CALL_KERNELS[call]
    split = implementation.head_pieces
    split = build.enabled(config.TRITON_HEAD_PIECES_VALIDATED) if split is None else split
    widths = config.head_pieces(q.shape[-1], split), config.head_pieces(v.shape[-1], split)
    d, dv = map(sum, widths)
    tile_args = dict(kernels=kernels, d=d, dv=dv, itemsize=q.dtype.itemsize, arch=build.gpu_arch())
    geo = xla.geometry("pallas_triton", q, k, scale, implementation, **tile_args)
    return geo, config.triton_compiler(implementation, kernels, d), widths


def _seq_major(x, padded: int, width: int):
    """``(*batch, S, H, D)`` -> ``(B, padded, H, width)``, zero-padded: the layout the kernels block
    over."""
    s, h, d = x.shape[-3:]
    return jnp.pad(x.reshape(math.prod(x.shape[:-3]), s, h, d), ((0, 0), (0, padded - s), (0, 0), (0, width - d)))


def _read(ref, widths, *index):
    """``ref[*index, :]`` (``index`` by default the block's leading axes whole) in the head-dim
    pieces of ``widths``: one piece is the row as it is, more are read a slice at a time."""
    lead = index or (slice(None),) * (len(ref.shape) - 1)
    if len(widths) == 1:
        return ref[(*lead, slice(None))]
    return tuple(ref[(*lead, pl.ds(start, w))] for start, w in zip(itertools.accumulate(widths, initial=0), widths))


def _write(ref, value):
    """``ref[...] = value`` in ``ref``'s dtype, ``value`` an array or its head-dim pieces."""
    if not isinstance(value, tuple):
        ref[...] = value.astype(ref.dtype)
        return
    lead = (slice(None),) * (len(ref.shape) - 1)
    for start, piece in zip(itertools.accumulate((p.shape[-1] for p in value), initial=0), value):
        ref[(*lead, pl.ds(start, piece.shape[-1]))] = piece.astype(ref.dtype)


def _q_block(geo: Geometry, d: int, splits: int = 1):  # one query tile of one head, grid (b, h, i * splits + s)
    return pl.BlockSpec((_SQ, geo.block_q, _SQ, d), lambda b, h, p: (b, p // splits, h, 0))


def _kv_whole(geo: Geometry, s: int, d: int):  # a head's whole key/value sequence, grid (b, h, i)
    return pl.BlockSpec((_SQ, s, _SQ, d), lambda b, h, i: (b, 0, h // geo.group, 0))


def _row_block(geo: Geometry, splits: int = 1):  # lse/delta rows (B, Hq, S) of one query tile
    return pl.BlockSpec((_SQ, _SQ, geo.block_q), lambda b, h, p: (b, h, p // splits))


def _key_block(geo: Geometry, d: int):  # one key tile of one kv head, grid (b, hk, j)
    return pl.BlockSpec((_SQ, geo.block_kv, _SQ, d), lambda b, hk, j: (b, j, hk, 0))


def _group_block(geo: Geometry, padded: int, d: int):  # every query of the kv head's GQA group, grid (b, hk, j)
    return pl.BlockSpec((_SQ, padded, geo.group, d), lambda b, hk, j: (b, 0, hk, 0))


def _group_rows(geo: Geometry, padded: int):  # lse/delta rows (B, Hq, S) of the kv head's GQA group
    return pl.BlockSpec((_SQ, geo.group, padded), lambda b, hk, j: (b, hk, 0))


def _item_block(x):  # one local batch item's row of (B, ...), whole
    return pl.BlockSpec((_SQ, *x.shape[1:]), lambda b, *_: (b,) + (0,) * (x.ndim - 1))


def _whole(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _call(kernel, interpret: bool, grid, in_specs, out_specs, out_shape, args, name: str, compiler: tuple[int, int], aliases=None):
    # Inside shard_map (check_vma) pallas_call wants each output's varying mesh axes. The lowering
    # traces on untyped avals (primitives._core), so the outputs take the operands' (empty) ones.
    mat = jax.typeof(args[1]).manual_axis_type
    out_shape = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape)
    warps, stages = compiler
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        name=name,
        input_output_aliases=aliases or {},
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=stages),
    )(*args)


def _global_offsets(geo: Geometry, batch_ids, head_offset):
    """One int32 array for every program: the global batch index of each local item, then the
    global index of the first local query head (sharded calls see a block of the batch and heads),
    or packed head (xla.pack_heads)."""
    return jnp.concatenate([batch_ids, jnp.asarray(head_offset // geo.pack, jnp.int32).reshape(1)])


def _load(refs, j, size):
    """Tile ``j`` of each of ``refs``, ``(ref, widths)`` pairs, in its head-dim pieces."""
    return tuple(_read(r, widths, pl.ds(j * size, size)) for r, widths in refs)


def _back(x, batch, s, d):
    """``(B, Spad, H, Dpad)`` -> ``(*batch, s, H, d)``."""
    return x[:, :s, :, :d].reshape(*batch, s, x.shape[2], d)


def _rows_back(x, batch, s):
    """``(B, H, Spad)`` -> ``(*batch, s, H)``."""
    return jnp.swapaxes(x[:, :, :s], 1, 2).reshape(*batch, s, x.shape[1])


def _queries_back(geo: Geometry, batch, x, d=None):
    """A query-side output, ``(B, rows padded, H, Dpad)`` or (``d=None``) lse-like ``(B, H, rows
    padded)``, as ``(*batch, Sq, Hq, d)`` or ``(*batch, Sq, Hq)``: heads unpacked."""
    if d is None:
        return xla.unpack_heads(geo, _rows_back(x, batch, geo.rows), rows=True)
    return xla.unpack_heads(geo, _back(x, batch, geo.rows, d))


def _mask_operands(geo: Geometry, mods: Mods, mask_c, batch_ids, key_programs: bool = False):
    """``(operands, specs, tiles)``: the mask's operands of every program and ``tiles(refs)``, the
    :class:`MaskTiles` a program builds from its refs of them. The function's own arrays go whole;
    positional arrays one row per local batch item, padded to whole tiles. A span that reads
    arrays (document masks) is bounded before the call instead: a row of tile bounds per item and
    query tile, and with ``key_programs`` (the backward's dkv kernel) per key tile too
    (kernel.bounds_table), so no program loads a whole sequence of span data."""
    n_fn = mods.mask.num_consts if mods.mask is not None else 0

    def per_item(b):
        item = mods.item_mask(b, mask_c)
        return item.rows, item.cols, item.span

    rows, cols, span = jax.vmap(per_item)(batch_ids)
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    rows = [_pad_last(jnp.repeat(r, geo.pack, axis=-1), sq_pad) for r in rows]
    cols = [_pad_last(c, skv_pad) for c in cols]
    bounds = []
    if mods.span.num_arrays:
        bound = lambda method, num_tiles: bounds_table(functools.partial(method, mods), num_tiles, tuple(span))  # noqa: E731
        bounds = [bound(geo.row_bounds, geo.num_q_tiles)]
        bounds += [bound(geo.col_bounds, geo.num_kv_tiles)] if key_programs else []
    blocks = [*rows, *cols, *bounds]
    specs = [_whole(c) for c in mask_c[:n_fn]] + [_item_block(x) for x in blocks]
    ends = [n_fn, n_fn + len(rows), n_fn + len(rows) + len(cols)]

    def tiles(refs):
        fn_refs, row_refs, col_refs, bound_refs = refs[: ends[0]], refs[ends[0] : ends[1]], refs[ends[1] : ends[2]], refs[ends[2] :]
        read = lambda table: (lambda t: tuple(table[t, n] for n in range(4)))  # noqa: E731
        return MaskTiles(
            [points.PointArray(r) for r in fn_refs],
            (),
            lambda i: [r[pl.ds(i * geo.block_q, geo.block_q)] for r in row_refs],
            lambda j: [r[pl.ds(j * geo.block_kv, geo.block_kv)] for r in col_refs],
            *(read(r) for r in bound_refs),
        )

    return [*mask_c[:n_fn], *blocks], specs, tiles


def attention_fwd_pallas(
    q, k, v, *consts, mods: Mods, scale: float, max_scores: bool, first_keys: bool, implementation: Implementation, interpret: bool, batch_ids, head_offset
):
    geo, compiler, (dw, dvw) = _geometry("fwd", q, k, v, scale, implementation)
    offset = _global_offsets(geo, batch_ids, head_offset)
    batch, bsz, hq = q.shape[:-3], math.prod(q.shape[:-3]), q.shape[-2] // geo.pack
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    d, dv = sum(dw), sum(dvw)
    qp, kp, vp = _seq_major(xla.pack_heads(geo, q), sq_pad, d), _seq_major(k, skv_pad, d), _seq_major(v, skv_pad, dv)
    n_mask = mods.num_mask_consts
    mask_ops, mask_specs, mask_tiles = _mask_operands(geo, mods, consts[:n_mask], batch_ids)
    score_c, n_m = consts[n_mask:], len(mask_ops)
    split = _Split.of(geo, bsz * hq, implementation)

    n_rows = 1 + max_scores + first_keys  # lse, the rows' largest scores, their first keys

    def kernel(offset_ref, q_ref, k_ref, v_ref, *refs):
        in_refs, (out_ref, *row_refs) = refs[: -1 - n_rows], refs[-1 - n_rows :]
        mask, score = mask_tiles(in_refs[:n_m]), [points.PointArray(r) for r in in_refs[n_m:]]
        (i, kv_range), b, h = split.program(), offset_ref[pl.program_id(0)], offset_ref[bsz] + pl.program_id(1)
        load_kv = lambda j: _load(((k_ref, dw), (v_ref, dvw)), j, geo.block_kv)
        out, *rows = fwd_rows(geo, mods, _read(q_ref, dw), load_kv, b, h, i, mask, score, kv_range, max_scores=max_scores, first_keys=first_keys)
        _write(out_ref, out)
        for ref, row in zip(row_refs, rows):
            ref[...] = row

    out_specs, out_shapes = split.outputs(bsz, hq, dv, q.dtype, geo.acc_dtype)
    out_specs = out_specs + out_specs[1:] * (n_rows - 1)
    out_shapes = out_shapes + [out_shapes[1]] * max_scores + [jax.ShapeDtypeStruct(out_shapes[1].shape, jnp.int32)] * first_keys
    out, lse, *top = _call(
        kernel,
        interpret,
        (bsz, hq, geo.num_q_tiles * split.count),
        [_whole(offset), _q_block(geo, d, split.count), _kv_whole(geo, skv_pad, d), _kv_whole(geo, skv_pad, dv)]
        + mask_specs
        + [_whole(c) for c in score_c],
        out_specs,
        out_shapes,
        (offset, qp, kp, vp, *mask_ops, *score_c),
        "jaxforge_attention_fwd",
        compiler,
    )
    top = _top_of_splits(*top) if max_scores else ()
    out, lse = _merge_splits(out, lse)
    return _queries_back(geo, batch, out.astype(q.dtype), v.shape[-1]), *(_queries_back(geo, batch, x) for x in (lse, *top))


@dataclasses.dataclass(frozen=True)
class _Split:
    """Split-KV of a forward, tangent or backward-dq call: each query tile's key tiles shared out over
    ``count`` programs, ``per_split`` tiles each; program ``(b, h, i * count + s)`` holds query
    tile ``i``, split ``s``. Their outputs, unrounded (``acc_dtype``) where ``count > 1``, get a
    split axis: ``(B, count, rows, H, D)`` and rows ``(B, count, H, rows)``."""

    geo: Geometry
    count: int
    per_split: int

    @staticmethod
    def of(geo: Geometry, heads: int, implementation: Implementation) -> _Split:
        """``heads``: the call's (batch item, head) pairs."""
        count = config.kv_splits(heads * geo.num_q_tiles, geo.num_kv_tiles, implementation, build.gpu_sm_count())
        return _Split(geo, count, -(-geo.num_kv_tiles // count))

    def program(self):
        """This program's query tile and key-tile range (None: all)."""
        p = pl.program_id(2)
        if self.count == 1:
            return p, None
        s = p % self.count
        return p // self.count, (s * self.per_split, (s + 1) * self.per_split)

    def rows_out(self, bsz: int, hq: int, d: int, dtype, acc_dtype):
        """``(spec, shape)`` of an output of ``d`` wide rows of ``dtype``."""
        c, geo = self.count, self.geo
        spec = pl.BlockSpec((_SQ, _SQ, geo.block_q, _SQ, d), lambda b, h, p: (b, p % c, p // c, h, 0))
        return spec, jax.ShapeDtypeStruct((bsz, c, geo.num_q_tiles * geo.block_q, hq, d), dtype if c == 1 else acc_dtype)

    def outputs(self, bsz: int, hq: int, d: int, dtype, acc_dtype):
        """``(specs, shapes)`` of a forward's or tangent's outputs: rows, and row values."""
        c, geo = self.count, self.geo
        rows_spec, rows_shape = self.rows_out(bsz, hq, d, dtype, acc_dtype)
        values_spec = pl.BlockSpec((_SQ, _SQ, _SQ, geo.block_q), lambda b, h, p: (b, p % c, h, p // c))
        return [rows_spec, values_spec], [rows_shape, jax.ShapeDtypeStruct((bsz, c, hq, geo.num_q_tiles * geo.block_q), acc_dtype)]


def _merge_splits(out, lse):
    """Split-KV's partial results, ``out (B, splits, S, H, D)`` and ``lse (B, splits, H, S)``, as
    one ``(B, S, H, D)``, ``(B, H, S)``: weights ``e^{lse_s - lse}``; a row no split sees stays 0
    with lse -inf."""
    if out.shape[1] == 1:
        return out[:, 0], lse[:, 0]
    weights, lse = merge_weights(lse, axis=1)
    return jnp.sum(out * jnp.swapaxes(weights, -1, -2)[..., None], axis=1), lse  # (B, s, H, S) -> (B, s, S, H, 1)


def _top_of_splits(top, first=None):
    """Split-KV's rows' largest scores (and the first keys attaining them), ``(B, splits, H, S)``
    each, as ``(B, H, S)``: the first split holding the maximum (splits hold keys in order)."""
    if first is None:
        return (jnp.max(top, axis=1),)
    winner = jnp.argmax(top, axis=1, keepdims=True)
    return jnp.max(top, axis=1), jnp.take_along_axis(first, winner, axis=1)[:, 0]


def attention_tangent_pallas(q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation: Implementation, interpret: bool, batch_ids, head_offset):
    geo, compiler, (dw, dvw) = _geometry("tangent", q, k, v, scale, implementation)
    offset = _global_offsets(geo, batch_ids, head_offset)
    n_consts = mods.num_mask_consts + mods.num_score_consts
    consts, (dq, dk, dv, *dscore) = list(operands[:n_consts]), operands[n_consts:]
    batch, bsz, hq = q.shape[:-3], math.prod(q.shape[:-3]), q.shape[-2] // geo.pack
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    d, dvp = sum(dw), sum(dvw)
    rows = [_seq_major(xla.pack_heads(geo, x), sq_pad, w) for x, w in ((q, d), (dq, d), (out, dvp))]
    rows += [xla.seq_last(xla.pack_heads(geo, lse, rows=True), sq_pad)]
    cols = [_seq_major(x, skv_pad, w) for x, w in ((k, d), (v, dvp), (dk, d), (dv, dvp))]
    n_mask = mods.num_mask_consts
    mask_ops, mask_specs, mask_tiles = _mask_operands(geo, mods, consts[:n_mask], batch_ids)
    score_c, n_m, n_s = consts[n_mask:], len(mask_ops), len(consts) - n_mask
    split = _Split.of(geo, bsz * hq, implementation)

    def kernel(offset_ref, q_ref, dq_ref, out_ref, lse_ref, k_ref, v_ref, dk_ref, dv_ref, *refs):
        *in_refs, dout_ref, dlse_ref = refs
        mask, values = mask_tiles(in_refs[:n_m]), [points.PointArray(r) for r in in_refs[n_m:]]
        (i, kv_range), b, h = split.program(), offset_ref[pl.program_id(0)], offset_ref[bsz] + pl.program_id(1)
        load = lambda j: _load(((k_ref, dw), (v_ref, dvw), (dk_ref, dw), (dv_ref, dvw)), j, geo.block_kv)
        dout, dlse = tangent_rows(
            geo, mods, _read(q_ref, dw), _read(dq_ref, dw), _read(out_ref, dvw), lse_ref[...], load, b, h, i,
            mask, values[:n_s], values[n_s:], kv_range,
        )  # fmt: skip
        _write(dout_ref, dout)
        dlse_ref[...] = dlse

    q_block = lambda d: _q_block(geo, d, split.count)  # noqa: E731
    out_specs, out_shapes = split.outputs(bsz, hq, dvp, out.dtype, lse.dtype)
    dout, dlse = _call(
        kernel,
        interpret,
        (bsz, hq, geo.num_q_tiles * split.count),
        [_whole(offset), q_block(d), q_block(d), q_block(dvp), _row_block(geo, split.count)]
        + [_kv_whole(geo, skv_pad, x.shape[-1]) for x in cols]
        + mask_specs
        + [_whole(c) for c in (*score_c, *dscore)],
        out_specs,
        out_shapes,
        (offset, *rows, *cols, *mask_ops, *score_c, *dscore),
        "jaxforge_attention_tangent",
        compiler,
    )
    dout, dlse = dout.sum(axis=1), dlse.sum(axis=1)  # linear in the splits' terms
    return _queries_back(geo, batch, dout.astype(out.dtype), out.shape[-1]), _queries_back(geo, batch, dlse)


def attention_bwd_pallas(
    q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, implementation: Implementation, interpret: bool, batch_ids, head_offset
):
    geo, compiler, (dw, dvw) = _geometry("bwd", q, k, v, scale, implementation)
    offset = _global_offsets(geo, batch_ids, head_offset)
    *consts, g_out, g_lse = operands
    batch, bsz, hq, hkv = q.shape[:-3], math.prod(q.shape[:-3]), q.shape[-2] // geo.pack, k.shape[-2]
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    delta = xla.bwd_delta(out, g_out, g_lse, geo.acc_dtype)
    d, dv = sum(dw), sum(dvw)
    qp, gp = _seq_major(xla.pack_heads(geo, q), sq_pad, d), _seq_major(xla.pack_heads(geo, g_out), sq_pad, dv)
    lse_p, delta_p = (xla.seq_last(xla.pack_heads(geo, x, rows=True), sq_pad) for x in (lse, delta))
    kp, vp = _seq_major(k, skv_pad, d), _seq_major(v, skv_pad, dv)
    n_mask = mods.num_mask_consts
    mask_ops, mask_specs, mask_tiles = _mask_operands(geo, mods, consts[:n_mask], batch_ids, key_programs=True)
    score_c, n_m = consts[n_mask:], len(mask_ops)
    wanted = _wanted_consts(score_c, const_grads)
    sums = [jnp.zeros(score_c[c].shape, _sum_dtype(score_c[c].dtype)) for c in wanted]
    n_in = 7 + n_m + len(score_c)
    split = _Split.of(geo, bsz * hq, implementation)  # dk, dv have a program per key tile already

    def dq_kernel(offset_ref, q_ref, g_ref, lse_ref, delta_ref, k_ref, v_ref, *refs):
        in_refs, (gq_ref, *sum_refs) = refs[: n_in - 7], refs[n_in - 7 + len(sums) :]
        sum_of = dict(zip(wanted, (_Sum(r, interpret) for r in sum_refs)))
        mask = mask_tiles(in_refs[:n_m])
        score = [points.PointArray(r, cotangent=sum_of.get(c)) for c, r in enumerate(in_refs[n_m:])]
        (i, kv_range), b, h = split.program(), offset_ref[pl.program_id(0)], offset_ref[bsz] + pl.program_id(1)
        load_kv = lambda j: _load(((k_ref, dw), (v_ref, dvw)), j, geo.block_kv)
        gq = bwd_dq_rows(geo, mods, _read(q_ref, dw), _read(g_ref, dvw), lse_ref[...], delta_ref[...], load_kv, b, h, i, mask, score, kv_range)
        _write(gq_ref, gq)

    n = split.count
    gq_spec, gq_shape = split.rows_out(bsz, hq, d, q.dtype, geo.acc_dtype)
    gq, *g_consts = _call(
        dq_kernel,
        interpret,
        (bsz, hq, geo.num_q_tiles * n),
        [_whole(offset), _q_block(geo, d, n), _q_block(geo, dv, n), _row_block(geo, n), _row_block(geo, n)]
        + [_kv_whole(geo, skv_pad, d), _kv_whole(geo, skv_pad, dv)]
        + mask_specs
        + [_whole(c) for c in (*score_c, *sums)],
        [gq_spec, *(_whole(x) for x in sums)],
        [gq_shape, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in sums)],
        (offset, qp, gp, lse_p, delta_p, kp, vp, *mask_ops, *score_c, *sums),
        "jaxforge_attention_bwd_dq",
        compiler,
        aliases={n_in + s: 1 + s for s in range(len(sums))},
    )

    def dkv_kernel(offset_ref, k_ref, v_ref, q_ref, g_ref, lse_ref, delta_ref, *refs):
        *in_refs, gk_ref, gv_ref = refs
        mask, score = mask_tiles(in_refs[:n_m]), [points.PointArray(r) for r in in_refs[n_m:]]
        b, hk, j = offset_ref[pl.program_id(0)], offset_ref[bsz] // geo.group + pl.program_id(1), pl.program_id(2)

        def load_q(g, i):
            rows = pl.ds(i * geo.block_q, geo.block_q)
            return _read(q_ref, dw, rows, g), _read(g_ref, dvw, rows, g), lse_ref[g, rows], delta_ref[g, rows]

        gk, gv = bwd_dkv_cols(geo, mods, _read(k_ref, dw), _read(v_ref, dvw), load_q, b, hk, j, mask, score)
        _write(gk_ref, gk)
        _write(gv_ref, gv)

    keys, group = (lambda d: _key_block(geo, d)), (lambda d: _group_block(geo, sq_pad, d))  # noqa: E731
    gk, gv = _call(
        dkv_kernel,
        interpret,
        (bsz, hkv, geo.num_kv_tiles),
        [_whole(offset), keys(d), keys(dv), group(d), group(dv), _group_rows(geo, sq_pad), _group_rows(geo, sq_pad)]
        + mask_specs
        + [_whole(c) for c in score_c],
        [keys(d), keys(dv)],
        [jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype)],
        (offset, kp, vp, qp, gp, lse_p, delta_p, *mask_ops, *score_c),
        "jaxforge_attention_bwd_dkv",
        compiler,
    )
    return (
        _queries_back(geo, batch, gq.sum(axis=1).astype(q.dtype), q.shape[-1]),  # linear in the splits' terms
        _back(gk, batch, geo.skv, k.shape[-1]),
        _back(gv, batch, geo.skv, v.shape[-1]),
        *(g.astype(score_c[c].dtype) for c, g in zip(wanted, g_consts)),
    )


def attention_tangent_bwd_pallas(q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation: Implementation, interpret: bool, batch_ids, head_offset):
    """The tangent map's transpose in ``(q, k, v, out, lse)`` (a gradient through a jvp) as two
    kernels, like the backward's: the query side ``(gq, glse, gc)`` over query tiles, the key side
    ``(gk, gv)`` over key tiles (looping over the query heads of its GQA group); kernel.py's
    tangent_bwd_rows and tangent_bwd_cols."""
    geo, compiler, (dw, dvw) = _geometry("tangent_bwd", q, k, v, scale, implementation)
    offset = _global_offsets(geo, batch_ids, head_offset)
    n_consts = mods.num_mask_consts + mods.num_score_consts
    consts, (dq, dk, dv, g_dout, g_dlse, *dscore) = list(operands[:n_consts]), operands[n_consts:]
    batch, bsz, hq, hkv = q.shape[:-3], math.prod(q.shape[:-3]), q.shape[-2] // geo.pack, k.shape[-2]
    sq_pad, skv_pad = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    c = -xla.bwd_delta(out, g_dout, g_dlse, geo.acc_dtype)
    d, dvp = sum(dw), sum(dvw)
    rows = [_seq_major(xla.pack_heads(geo, x), sq_pad, w) for x, w in ((q, d), (dq, d), (g_dout, dvp))]
    rows += [xla.seq_last(xla.pack_heads(geo, x, rows=True), sq_pad) for x in (lse, c)]
    cols = [_seq_major(x, skv_pad, w) for x, w in ((k, d), (v, dvp), (dk, d), (dv, dvp))]
    n_mask = mods.num_mask_consts
    mask_ops, mask_specs, mask_tiles = _mask_operands(geo, mods, consts[:n_mask], batch_ids, key_programs=True)
    score_c, n_m, n_s = consts[n_mask:], len(mask_ops), len(consts) - n_mask
    extra = (*mask_ops, *score_c, *dscore)
    extra_specs = mask_specs + [_whole(x) for x in (*score_c, *dscore)]

    def refs_of(in_refs):  # the mask's tiles, the score consts and their tangents (read at points)
        values = [points.PointArray(r) for r in in_refs[n_m:]]
        return mask_tiles(in_refs[:n_m]), values[:n_s], values[n_s:]

    def rows_kernel(offset_ref, q_ref, dq_ref, g_ref, lse_ref, c_ref, k_ref, v_ref, dk_ref, dv_ref, *refs):
        *in_refs, gq_ref, glse_ref, gc_ref = refs
        b, h = offset_ref[pl.program_id(0)], offset_ref[bsz] + pl.program_id(1)
        load = lambda j: _load(((k_ref, dw), (v_ref, dvw), (dk_ref, dw), (dv_ref, dvw)), j, geo.block_kv)  # noqa: E731
        gq, glse, gc = tangent_bwd_rows(
            geo, mods, _read(q_ref, dw), _read(dq_ref, dw), lse_ref[...], c_ref[...], _read(g_ref, dvw), load, b, h, pl.program_id(2), *refs_of(in_refs)
        )
        _write(gq_ref, gq)
        glse_ref[...], gc_ref[...] = glse, gc

    gq, glse, gc = _call(
        rows_kernel,
        interpret,
        (bsz, hq, geo.num_q_tiles),
        [_whole(offset), _q_block(geo, d), _q_block(geo, d), _q_block(geo, dvp), _row_block(geo), _row_block(geo)]
        + [_kv_whole(geo, skv_pad, x.shape[-1]) for x in cols]
        + extra_specs,
        [_q_block(geo, d), _row_block(geo), _row_block(geo)],
        [jax.ShapeDtypeStruct(rows[0].shape, q.dtype), *(jax.ShapeDtypeStruct(rows[3].shape, geo.acc_dtype) for _ in range(2))],
        (offset, *rows, *cols, *extra),
        "jaxforge_attention_tangent_bwd_rows",
        compiler,
    )

    def cols_kernel(offset_ref, k_ref, v_ref, dk_ref, dv_ref, q_ref, dq_ref, g_ref, lse_ref, c_ref, *refs):
        *in_refs, gk_ref, gv_ref = refs
        b, hk, j = offset_ref[pl.program_id(0)], offset_ref[bsz] // geo.group + pl.program_id(1), pl.program_id(2)
        key_side = [_read(r, w) for r, w in ((k_ref, dw), (v_ref, dvw), (dk_ref, dw), (dv_ref, dvw))]

        def head(g, acc):
            def load_q(i):
                rows = pl.ds(i * geo.block_q, geo.block_q)
                return _read(q_ref, dw, rows, g), _read(dq_ref, dw, rows, g), lse_ref[g, rows], c_ref[g, rows], _read(g_ref, dvw, rows, g)

            grads = tangent_bwd_cols(geo, mods, *key_side, load_q, b, hk * geo.group + g, j, *refs_of(in_refs))
            return jax.tree.map(operator.add, acc, grads)

        gk, gv = jax.lax.fori_loop(0, geo.group, head, zeros(geo, tuple(key_side[:2])))
        _write(gk_ref, gk)
        _write(gv_ref, gv)

    keys, group = (lambda d: _key_block(geo, d)), (lambda d: _group_block(geo, sq_pad, d))  # noqa: E731
    gk, gv = _call(
        cols_kernel,
        interpret,
        (bsz, hkv, geo.num_kv_tiles),
        [_whole(offset), keys(d), keys(dvp), keys(d), keys(dvp), group(d), group(d), group(dvp), _group_rows(geo, sq_pad), _group_rows(geo, sq_pad)]
        + extra_specs,
        [keys(d), keys(dvp)],
        [jax.ShapeDtypeStruct(cols[0].shape, k.dtype), jax.ShapeDtypeStruct(cols[1].shape, v.dtype)],
        (offset, *cols, *rows, *extra),
        "jaxforge_attention_tangent_bwd_cols",
        compiler,
    )
    gq, glse, gc = _queries_back(geo, batch, gq, q.shape[-1]), _queries_back(geo, batch, glse), _queries_back(geo, batch, gc)
    gout = -gc[..., None] * g_dout.astype(geo.acc_dtype)
    return gq, _back(gk, batch, geo.skv, k.shape[-1]), _back(gv, batch, geo.skv, v.shape[-1]), gout.astype(out.dtype), glse.astype(lse.dtype)


def _wanted_consts(score_c, const_grads) -> list[int]:
    """Positions in ``score_c`` of the float consts whose cotangents ``const_grads`` asks for."""
    floats = [c for c, x in enumerate(score_c) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return [c for c, wanted in zip(floats, const_grads) if wanted]


def _sum_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


@dataclasses.dataclass(frozen=True)
class _Sum:
    """A captured array's cotangent, summed over every program of the dq kernel: atomic adds of
    each read's cotangent at its address (in any order: the last bits vary from run to run)."""

    ref: Any
    interpret: bool

    def add(self, index, values):
        values = values.astype(self.ref.dtype)
        if self.interpret:  # there, atomic_add keeps one of the values sent to one address; programs run in turn
            total = self.ref[...]
            self.ref[...] = total.at[index].add(values) if index else total + values
        else:
            plgpu.atomic_add(self.ref, index, values)
