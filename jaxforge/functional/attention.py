"""``jf.attention``: flex-style attention with masks, score mods, GQA and forward-mode AD."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxforge.functional._static import concrete_scalar, static_bool
from jaxforge.functional.collectives import all_reduce, permute
from jaxforge.functional.masks import Mask, as_mask, sampled_keys, shifted
from jaxforge.primitives import _core
from jaxforge.primitives.attention.attention import (
    IMPLEMENTATION_NAMES,
    Implementation,
    accumulation_dtype,
    attention_fwd_p,
    check_operands,
    merge_weights,
)
from jaxforge.primitives.attention.mods import Mods

__all__ = ["Implementation", "attention", "merge_attention"]

_INT = jax.ShapeDtypeStruct((), jnp.int32)


def attention(
    q,
    k,
    v,
    *,
    mask: Mask | Callable | jax.Array | np.ndarray | None = None,
    score_mod: Callable | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    return_max_scores: bool = False,
    sinks=None,
    implementation: str | Implementation | None = None,
):
    r"""Scaled dot-product attention, :math:`\operatorname{softmax}(f(\text{scale}\; q k^T) + \text{mask})\, v`.

    Args:
      q: ``(..., Sq, Hq, D)`` queries.
      k: ``(..., Skv, Hkv, D)`` keys; ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA).
      v: ``(..., Skv, Hkv, Dv)`` values; ``Dv`` may differ from ``D``. Leading dims broadcast.
      mask: a :mod:`jf.masks <jaxforge.functional.masks>` mask, or ``mask_mod(b, h, q_idx, kv_idx)
        -> bool`` on scalars (True: visible). ``b`` indexes the flattened leading dims, ``h`` the
        query head. A plain ``mask_mod`` visits every tile; ``jf.masks.block_mask(mask_mod, Sq,
        Skv)`` evaluates it once so that the tiles it hides are skipped (with ``ranges=2``, those of
        a gap inside each row too, such as between sink tokens and a sliding window: a mask in
        pieces runs one call each, merged through their log-sum-exps). A boolean array
        broadcasting to ``(*batch, Hq, Sq, Skv)`` (``jax.nn.dot_product_attention``'s mask) is
        ``jf.masks.from_array``'s: its hidden tiles are skipped too.
      score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on scalars (ALiBi, relative
        bias, ...). Arrays it closes over get gradients and tangents like any input; read an
        element at a time (``slopes[h]``, ``bias[h, q_idx - kv_idx]``, ``bias[h][q_idx - kv_idx]``) they stay in the GPU
        kernels, other reads (a gather with ``mode="fill"``, a row's sum) run the XLA lowering.
      scale: multiplies ``q·k``; default ``1/sqrt(D)``. A number (or a concrete scalar array)
        the kernels take as a constant; a traced real scalar (a learned temperature,
        ``1 / jnp.sqrt(d)`` under jit, as jax.nn takes) multiplies ``q`` instead, differentiable
        (``(c q)·k = c (q·k)``: the same logits, lse and max scores, ``c q`` rounded to q's dtype).
      softcap: ``score -> softcap * tanh(score / softcap)``, applied before ``score_mod``: a
        positive number (or a concrete scalar array) the kernels take as a constant, or a traced
        real scalar, differentiable, which joins ``score_mod`` as an array it closes over (not
        checked: the formula as written, NaN at a cap of 0 where a score is 0).
      return_lse: also return the log-sum-exp of each row, ``(..., Sq, Hq)``, float32 (float64
        for float64 input); ``-inf`` for a fully masked row, whose output is 0.
      return_max_scores: also return each row's largest score, ``(..., Sq, Hq)`` in the lse's
        dtype: the maximum over the keys it sees of the logits entering the softmax (after
        ``scale``, ``softcap`` and ``score_mod``; sinks are not keys), ``-inf`` for a fully masked
        row. What QK-clip (MuonClip) bounds, per head: ``max_scores.max(axis=(0, 1))`` for one batch
        dim. The forward's online softmax keeps it anyway, so it costs a row of writes. It is
        differentiable through the first key attaining it (its derivative is that score's), which
        the forward seeks (an argmax a tile) only under jit where a derivative of the maxima is
        used: not in a forward, nor in a gradient that returns them as auxiliary data.
      sinks: attention sinks (gpt-oss): one logit per query head, ``(Hq,)`` or any float array that
        broadcasts to the lse's ``(..., Sq, Hq)``, joining each row's softmax as a key of value 0:
        :math:`\sum_j e^{s_j} v_j / (e^{\text{sink}} + \sum_j e^{s_j})`; the lse includes it.
        Differentiable like the rest (its gradient too): the kernels' output is rescaled through
        their lse (:func:`merge_attention` with a part of value 0), one more rounding of ``out``.
      implementation: None (the platform's best), "xla", "pallas_triton" or "pallas_mosaic_gpu"
        (Hopper), or an :class:`Implementation`: one of those with tile sizes, warps, stages, GQA
        packing, split-KV or head dims in pieces.

    Returns:
      ``out`` of shape ``(..., Sq, Hq, Dv)``, or a tuple of ``out``, then ``lse`` and
      ``max_scores`` where asked for.

    Differentiable in every mode (jvp, grad, vmap, and their compositions): forward-mode runs a
    fused tangent kernel, reverse-mode the FlashAttention backward.

    Under explicit sharding, batch dims and heads may be sharded, and so may the sequences: each
    shard of q's attends its queries to every key, the mask (its per-position arrays sliced) and
    ``score_mod`` seeing the queries' global positions (:func:`jf.masks.shifted
    <jaxforge.functional.masks.shifted>`); out and lse keep q's split. Where the mask lets later
    queries see more keys (causal), the shards first trade halves of their queries into
    :func:`jf.parallel.load_balance <jaxforge.functional.parallel.load_balance>`'s head–tail layout,
    so each does the same work, and trade the results back; q's batch or heads split beside its
    sequence stay split (the mask and score_mod see global items and heads). k and v split along their
    sequence over the axes that split q's are gathered whole first (an all-gather, whose transpose
    sums their gradients back to the shards: the context parallelism of Llama 3);
    :func:`jf.parallel.ring_attention <jaxforge.functional.parallel.ring_attention>` keeps them
    split instead. Split over axes that q does not use (q's sequence whole: a decoding step over a
    sequence-split KV cache, a prompt over a long context; or split over others), they stay split:
    each device attends its queries to its own keys and the parts merge through their log-sum-exps
    (one pmax and one psum of the rows).
    """
    return_lse = static_bool("attention", "return_lse", return_lse)
    return_max_scores = static_bool("attention", "return_max_scores", return_max_scores)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 3:
            raise ValueError(f"attention: `{name}` must have rank >= 3 (..., seq, heads, head_dim), got shape {x.shape}")
    try:
        batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except ValueError:
        raise ValueError(
            f"attention: the leading dims of q {q.shape}, k {k.shape} and v {v.shape} do not broadcast"
        ) from None
    q, k, v = (jnp.broadcast_to(x, (*batch, *x.shape[-3:])) for x in (q, k, v))
    check_operands("attention", q, k, v)
    q, scale = _scale_folded(q, scale)
    score_mod, softcap = _softcap_folded(score_mod, softcap)
    q_axes = _sequence_split(q)
    kv_axes = _key_split(q, k, v)
    if not kv_axes:
        k, v = (_core.gathered(x, _sequence_split(x)) for x in (k, v))  # whole along the sequence
    kw = dict(scale=scale, softcap=softcap, sinks=sinks, implementation=implementation, max_scores=return_max_scores)
    if q_axes or kv_axes:
        out, lse, top = _over_sequence_shards(q_axes, kv_axes, q, k, v, mask, score_mod, **kw)
    else:
        out, lse, top = _attend(q, k, v, mask, score_mod, **kw)
    asked = [lse] * return_lse + [top] * return_max_scores
    return (out, *asked) if asked else out


def _attend(q, k, v, mask, score_mod, *, scale, softcap, sinks, implementation, max_scores=False, where=None):
    """``(out, lse, max_scores)`` of checked, broadcast operands (``max_scores`` None unless asked
    for): one primitive call per piece of the mask.

    ``where``: inside the shard_map of :func:`_over_sequence_shards`, ``(batch, offsets, heads,
    head_offset)``: q's global batch shape, where its block starts along each batch dim, its
    global number of heads and its first head; the mask and ``score_mod`` then see global batch
    and head indices (:func:`_mods`)."""
    batch, (sq, hq, d), skv = q.shape[:-3], q.shape[-3:], k.shape[-3]
    if scale is None:
        scale = 1 / math.sqrt(d) if d else 1.0
    scale = _positive_float("scale", scale)
    softcap = None if softcap is None else _positive_float("softcap", softcap)
    sinks = None if sinks is None else _sinks(sinks, (*batch, sq, hq))
    implementation = resolve_implementation(implementation)
    parts = []
    for piece in (None,) if mask is None else as_mask(mask).pieces():  # disjoint keys: merged through their lse
        mods, consts = _mods(piece, score_mod, softcap, batch, sq, skv, accumulation_dtype(q.dtype), num_heads=hq, where=where)
        parts.append(attention_fwd_p.bind(q, k, v, *consts, mods=mods, scale=scale, max_scores=max_scores, first_keys=False, implementation=implementation))
    top = functools.reduce(jnp.maximum, [part[2] for part in parts]) if max_scores else None  # pieces: disjoint keys
    parts = [tuple(part[:2]) for part in parts]
    if sinks is not None:  # a part of value 0
        lse = parts[0][1]
        parts.append((None, jnp.zeros_like(lse) + lax.broadcast_to_rank(sinks.astype(lse.dtype), lse.ndim)))  # lse's shape and sharding
    return (*(parts[0] if len(parts) == 1 else _merged(parts)), top)


def _sequence_split(x) -> tuple:
    """The explicit mesh axes that split ``x``'s sequence dim (-3), or ``()``."""
    sharding = jax.typeof(x).sharding
    spec, kinds = tuple(sharding.spec), dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    entry = spec[x.ndim - 3] if len(spec) > x.ndim - 3 else None
    axes = () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)
    return axes if all(kinds[a] == jax.sharding.AxisType.Explicit for a in axes) else ()


def _key_split(q, k, v) -> tuple:
    """The explicit mesh axes that split both k's and v's sequence, where q uses none of them
    (along its sequence, batch dims or heads); else ``()``."""
    axes = _sequence_split(k)
    used = {a for e in jax.typeof(q).sharding.spec for a in _core.mesh_axes(e)}
    return axes if axes == _sequence_split(v) and not used & set(axes) else ()


def _over_sequence_shards(q_axes, kv_axes, q, k, v, mask, score_mod, *, sinks, **kw):
    """``(out, lse)`` with q's sequence split over mesh ``q_axes`` and k's and v's over ``kv_axes``
    (either or both): a shard_map manual over them and over the axes that split q's batch dims and
    heads (k and v split like q's there). Split queries: each shard attends its queries, from
    global position ``index * local``, to every key; where the mask gives later queries more keys
    (causal), the shards first trade halves into the head–tail layout (:func:`_head_tail`), so
    each does the same work. Split keys: each shard attends its queries to its keys, from global
    position ``index * local``, and the parts merge through their lse (:func:`_merged_over`). The
    mask and ``score_mod`` read global positions, batch and head indices (``_attend``'s
    ``where``); the mask's arrays and those ``score_mod`` closes over go in whole, as operands (a
    shard_map's code cannot close over arrays of an explicit mesh)."""
    mesh = next(m for m in (jax.typeof(x).sharding.mesh for x in (q, k, v)) if m.axis_names)  # q may be unplaced
    seq = q.ndim - 3
    entries = tuple(jax.typeof(q).sharding.spec) + (None,) * (q.ndim - len(jax.typeof(q).sharding.spec))
    size = lambda entry: math.prod(mesh.shape[a] for a in _core.mesh_axes(entry))  # noqa: E731  shards along it
    shards, kv_shards = size(entries[seq]), size(kv_axes)
    local, kv_local = q.shape[seq] // shards, k.shape[seq] // kv_shards
    lse_spec = P(*entries[:-1])
    kv_spec = P(*entries[:seq], kv_axes or None, entries[seq + 1], None)  # q's batch and heads, whole along the sequence or split over kv_axes
    if k.shape[-2] % size(entries[seq + 1]):
        raise ValueError(
            f"attention: q's heads are split over {entries[seq + 1]} ({size(entries[seq + 1])} shards) beside its sequence, "
            f"but k and v have {k.shape[-2]} heads, which do not split so; split q's heads by a divisor of {k.shape[-2]}"
        )
    k, v = (_core.resharded(x, mesh, kv_spec) for x in (k, v))
    operands = {"q": q, "k": k, "v": v}
    specs = {"q": P(*entries), "k": kv_spec, "v": kv_spec, "mask": P(), "sinks": lse_spec, "score": P()}
    if mask is not None:
        operands["mask"] = jax.tree.map(lambda x: _core.gathered(jnp.asarray(x)), as_mask(mask).hoisted())
    if sinks is not None:
        operands["sinks"] = _core.resharded(jnp.broadcast_to(_sinks(sinks, q.shape[:-1]), q.shape[:-1]), mesh, lse_spec)
    if score_mod is not None:  # what it closes over goes in whole, as operands; it reads them at global indices
        score_fn, consts = _traced_score_mod(score_mod, accumulation_dtype(q.dtype))
        operands["score"] = [_core.gathered(jnp.asarray(c)) for c in consts]
    manual_axes = {a for e in entries for a in _core.mesh_axes(e)} | set(kv_axes)
    balanced = _balances(operands.get("mask"), q.shape[seq], k.shape[seq], shards, q.shape[:seq], q.shape[-2])

    def where():  # the block of q this shard holds: where it starts along each batch dim and the heads
        start = lambda e, n: lax.axis_index(_core.mesh_axes(e)) * (n // size(e)) if e else jnp.int32(0)  # noqa: E731
        offsets = [start(e, n) for e, n in zip(entries[:seq], q.shape[:seq])]
        return q.shape[:seq], offsets, q.shape[-2], start(entries[seq + 1], q.shape[-2])

    def attend(parts, start, length):  # parts["q"] (and ["sinks"]): `length` queries from global `start`
        kv_start = lax.axis_index(kv_axes) * kv_local if kv_axes else 0
        mask = parts.get("mask")
        block = None if mask is None else shifted(mask, start, kv_start, q_len=length, kv_len=kv_local if kv_axes else None)
        at = None if score_mod is None else (lambda s, b, h, i, j: score_fn(s, b, h, i + start, j + kv_start, *parts["score"])[0])
        sinks = parts.get("sinks")
        out, lse, top = _attend(parts["q"], parts["k"], parts["v"], block, at, sinks=None if kv_axes else sinks, where=where(), **kw)
        if not kv_axes:
            return out, lse, top
        out, lse = _merged_over(kv_axes, out, lse)
        top = None if top is None else all_reduce(top, kv_axes, op="max")
        return (*((out, lse) if sinks is None else merge_attention(out, lse, None, sinks.astype(lse.dtype))), top)

    def shard(operands):
        index = lax.axis_index(q_axes) if q_axes else 0
        if not balanced:
            return attend(operands, index * local, local)
        return _head_tail(operands, index, q_axes, shards, seq, attend)

    in_specs = ({name: specs[name] for name in operands},)
    sharded = jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=(specs["q"], lse_spec, lse_spec), axis_names=manual_axes)
    return sharded(operands)


def _merged_over(axes, out, lse):
    """:func:`_merged` of the parts of the devices along mesh ``axes`` (attentions of the same
    queries over their keys): one pmax of the rows' lse (for range only: it cancels), a psum of the
    weighted outputs and one of their weights (apart, so that the total stays known where v alone
    is not, as in ``jax.linear_transpose``: XLA's all-reduce combiner joins the two)."""
    top = lax.pmax(lax.stop_gradient(lse), axes)
    top = jnp.where(jnp.isfinite(top), top, 0)
    weights = jnp.exp(lse - top)  # a part that sees nothing: 0
    summed = lax.psum(out.astype(weights.dtype) * weights[..., None], axes)
    total = lax.psum(weights, axes)
    seen = total > 0
    safe = jnp.where(seen, total, 1)
    merged = summed / safe[..., None]
    return merged.astype(out.dtype), jnp.where(seen, top + jnp.log(safe), -jnp.inf)


def _head_tail(operands, index, axes, shards: int, seq: int, attend):
    """``attend`` with device ``index``'s two halves of queries (chunks ``2 index``, ``2 index + 1``
    of ``2 shards``) traded for chunks ``index`` and ``2 shards - 1 - index``, then the results
    traded back: one collective-permute of the even chunks, one of the odd ones, each way (their
    transposes carry the gradients)."""
    rows = [name for name in ("q", "sinks") if name in operands]
    half = operands["q"].shape[seq] // 2
    home = lambda chunk: chunk if chunk < shards else 2 * shards - 1 - chunk  # noqa: E731  the device it goes to
    parts = []
    for parity in (0, 1):
        there = [(i, home(2 * i + parity)) for i in range(shards)]
        back = [(j, i) for i, j in there]
        moved = {name: permute(lax.slice_in_dim(operands[name], parity * half, (parity + 1) * half, axis=seq), axes, there) for name in rows}
        chunk = jnp.where(index % 2 == parity, index, 2 * shards - 1 - index)  # which of its two arrived
        parts.append(jax.tree.map(lambda x: permute(x, axes, back), attend({**operands, **moved}, chunk * half, half)))
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=seq), *parts)


def _balances(mask, sq: int, skv: int, shards: int, batch: tuple, num_heads: int) -> bool:
    """Whether trading q's halves into the head–tail layout pays: the keys the mask's span leaves
    each block of rows give the busiest contiguous shard over 5/4 of the busiest head–tail
    device's work (causal: about ``2 - 1/shards`` times). The span reads the mask's arrays where
    they are known when tracing (a ``block_mask`` built outside ``jit``), summed over the items;
    where they are not but the mask's function reads no such array (a ``block_mask`` of a function
    of the positions, built under ``jit``), the keys are counted on the function at a row of each
    block; else the span's static part counts (document ids under ``jit`` count as every key; a
    ``block_mask`` of library masks built under ``jit``, its source's: causal where that is)."""
    half = sq // shards // 2
    if mask is None or shards < 2 or (sq // shards) % 2 or not half:
        return False
    mask = as_mask(mask)
    span = mask.span()
    edges = np.unique(np.linspace(0, half, 9).astype(int))  # 8 blocks of rows a chunk, the span's grain
    starts = (np.arange(2 * shards)[:, None] * half + edges[None, :-1]).ravel()
    ends = starts + np.tile(np.diff(edges), 2 * shards)
    known = span.num_arrays and not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(mask))
    keys = None if known or not span.num_arrays else sampled_keys(mask, (starts + ends) // 2, skv, batch, num_heads)
    with jax.ensure_compile_time_eval():  # the keys each block of rows may see, per item
        rows = (jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32))  # positions, as the spans' arrays
        extent = lambda span, *item: jax.vmap(lambda lo, hi: jnp.subtract(*span.kv(lo, hi, skv, item)[::-1]))(*rows)  # noqa: E731
        if known:
            keys = jax.vmap(functools.partial(extent, span))(*mask.span_arrays(batch, sq, skv, num_heads))
        elif keys is None:
            keys = extent(mask.span_while_tracing())[None]
    chunks = ((ends - starts) * np.maximum(np.asarray(keys), 0).sum(axis=0)).reshape(2 * shards, -1).sum(axis=1)  # per chunk of `half` rows
    contiguous = chunks[0::2] + chunks[1::2]
    head_tail = chunks[:shards] + chunks[::-1][:shards]
    return bool(contiguous.max() * 4 > head_tail.max() * 5)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combines two attentions of the same queries over disjoint keys through their log-sum-exps.

    ``out = (out_a e^{lse_a} + out_b e^{lse_b}) / (e^{lse_a} + e^{lse_b})``; rows that see no key in
    either part stay 0 with lse ``-inf`` (no NaN, zero gradients). ``out_b=None``: a part of value 0
    (an attention sink of logit ``lse_b``, which broadcasts to ``lse_a``).
    """
    return _merged([(out_a, lse_a), (out_b, jnp.zeros_like(lse_a) + lax.broadcast_to_rank(jnp.asarray(lse_b), lse_a.ndim))])  # lse_a's shape and sharding


def _merged(parts):
    """:func:`merge_attention` of any number of ``(out, lse)`` parts, the first with an output."""
    weights, lse = merge_weights(jnp.stack([lse for _, lse in parts], axis=-1), axis=-1)
    out = sum(out * weights[..., i, None] for i, (out, _) in enumerate(parts) if out is not None)
    return out.astype(parts[0][0].dtype), lse


def _sinks(sinks, lse_shape):
    sinks = jnp.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"attention: `sinks` must be a floating-point array (one logit per query head), got dtype {sinks.dtype}")
    try:
        fits = jnp.broadcast_shapes(sinks.shape, lse_shape) == tuple(lse_shape)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"attention: `sinks` has shape {sinks.shape}, which does not broadcast to the rows' (..., Sq, Hq) "
            f"= {lse_shape}; give one logit per query head, shape ({lse_shape[-1]},)"
        )
    return sinks


def _mods(mask, score_mod, softcap, batch, sq, skv, score_dtype, num_heads=None, where=None):
    """The primitive's ``Mods`` and its consts. ``where``: :func:`_attend`'s, q a block of a larger
    batch and heads: the mask's per-item arrays are bound to the whole batch and taken at the
    block's items, and the functions are read at global ``b`` and ``h``. (Here, not through the
    lowering's ``shards=`` as the per-shard rule does: inside a shard_map the lowering traces its
    code where the manual axes are not bound, so it cannot read the shard's index.)"""
    bound_batch, globally, local = batch, None, (lambda x: x)  # noqa: E731
    if where is not None:
        bound_batch, offsets, num_heads, head_offset = where
        globally = lambda b, h: (_global_item(b, batch, bound_batch, offsets), h + head_offset)  # noqa: E731
        items = _global_item(jnp.arange(math.prod(batch), dtype=jnp.int32), batch, bound_batch, offsets)
        local = functools.partial(_items, items, math.prod(bound_batch))
    mask_fn, mask_consts, span, rows, cols = None, [], Mods().span, [], []
    if mask is not None:
        mask = as_mask(mask)
        fn, rows, cols = mask.bind_positional(bound_batch, sq, skv)
        rows, cols = [local(x) for x in rows], [local(x) for x in cols]
        values = [jax.ShapeDtypeStruct((), x.dtype) for x in (*rows, *cols)]
        mask_fn, fn_consts = _traced_at_global("attention: `mask`", fn, globally, 0, _INT, _INT, _INT, _INT, *values)
        _check_output("mask", mask_fn, np.bool_, "a boolean")
        span = mask.span()
        span_arrays = [local(x) for x in mask.span_arrays(bound_batch, sq, skv, num_heads)]
        mask_consts = [*fn_consts, *rows, *cols, *span_arrays]  # Mods.num_mask_consts
    score_fn, score_consts = None, []
    if score_mod is not None:
        score_fn, score_consts = _traced_score_mod(score_mod, score_dtype, globally)
    mods = Mods(mask=mask_fn, score=score_fn, span=span, softcap=softcap, mask_rows=len(rows), mask_cols=len(cols))
    return mods, [*mask_consts, *score_consts]


def _traced_score_mod(score_mod, score_dtype, globally=None):
    """``score_mod`` checked and traced at scalars (:func:`_traced_at_global`)."""
    if not callable(score_mod):
        raise TypeError(f"attention: `score_mod` must be a callable score_mod(score, b, h, q_idx, kv_idx), got {type(score_mod).__name__}")
    score = jax.ShapeDtypeStruct((), score_dtype)
    traced = _traced_at_global("attention: `score_mod`", score_mod, globally, 1, score, _INT, _INT, _INT, _INT)
    _check_output("score_mod", traced[0], None, "a floating-point")
    return traced


def _traced_at_global(name: str, fn, globally, at: int, *avals):
    """``_core.trace_function(fn, *avals)``, its batch and head indices (arguments ``at`` and
    ``at + 1``) made global by ``globally`` where it reads them (only then: the offsets it closes
    over become the function's constants, which some kernels cannot read)."""
    traced = _core.trace_function(fn, *avals, name=name)
    if globally is None or not (traced[0].reads(at) or traced[0].reads(at + 1)):
        return traced

    def read_globally(*args):
        return fn(*args[:at], *globally(args[at], args[at + 1]), *args[at + 2 :])

    return _core.trace_function(read_globally, *avals, name=name)


def _items(items, count: int, x):
    """A mask's per-item array of the whole batch (``count`` items) at the block's ``items``."""
    if x.shape[:1] != (count,):
        raise ValueError(
            f"attention: a mask's per-item array has shape {x.shape}; Mask.bind_positional and span_arrays "
            f"give them as (prod(batch), ...) = ({count}, ...)"
        )
    return jnp.take(x, items, axis=0)


def _global_item(b, local_batch, whole_batch, offsets):
    """The flat index in ``whole_batch`` of item ``b`` (flat) of the block of ``local_batch`` items
    from ``offsets``."""
    if not local_batch:
        return b
    coords = jnp.unravel_index(b, local_batch)
    return jnp.ravel_multi_index([c + o for c, o in zip(coords, offsets)], whole_batch, mode="clip").astype(b.dtype)


def _check_output(name, fn, dtype, what):
    outs = fn.out_avals
    ok = len(outs) == 1 and outs[0].shape == () and (
        outs[0].dtype == dtype if dtype is not None else jnp.issubdtype(outs[0].dtype, jnp.floating)
    )
    if not ok:
        got = ", ".join(f"{o.dtype}{list(o.shape)}" for o in outs)
        raise TypeError(
            f"attention: `{name}` must return {what} scalar for scalar (b, h, q_idx, kv_idx) indices "
            f"(it is applied elementwise, like torch's flex_attention), got {got}"
        )


def _scale_folded(q, scale):
    """``(q, scale)``: a traced ``scale`` multiplies ``q`` (in the accumulation dtype, rounded once)
    and leaves 1, since the kernels take the scale as a constant; any other passes through."""
    if not isinstance(scale, jax.core.Tracer):
        return q, scale
    _check_real_scalar("scale", scale)
    acc = accumulation_dtype(q.dtype)
    return (q.astype(acc) * scale.astype(acc)).astype(q.dtype), 1.0


def _softcap_folded(score_mod, softcap):
    """``(score_mod, softcap)``: a traced ``softcap`` joins ``score_mod``, applied before it as
    the kernels apply a constant cap, so that it is an array the score mod closes over (an
    operand, with tangents and a gradient); any other passes through."""
    if not isinstance(softcap, jax.core.Tracer):
        return score_mod, softcap
    _check_real_scalar("softcap", softcap)
    if score_mod is not None and not callable(score_mod):
        return score_mod, None  # _traced_score_mod refuses it by name

    def capped(score, b, h, q_idx, kv_idx):
        cap = softcap.astype(score.dtype)
        score = cap * jnp.tanh(score / cap)
        return score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)

    return capped, None


def check_scalars(fn: str, **scalars):
    """Checks ``scale`` and ``softcap`` as :func:`attention` takes them, errors naming ``fn``: each
    None, a traced real scalar, or a positive finite number (a concrete scalar array included)."""
    for name, value in scalars.items():
        if isinstance(value, jax.core.Tracer):
            _check_real_scalar(name, value, fn)
        elif value is not None:
            _positive_float(name, value, fn)


def _check_real_scalar(name: str, traced, fn: str = "attention"):
    if jnp.shape(traced) != () or traced.dtype.kind not in "fiu":
        raise TypeError(f"{fn}: a traced `{name}` must be a real scalar, got {jax.typeof(traced).str_short()}")


def _positive_float(name, value, fn: str = "attention") -> float:
    """``value`` as a float: a number or a concrete real scalar array, positive and finite (a
    traced scale or softcap was folded into q or the score mod before)."""
    value = concrete_scalar(value, "fiu")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{fn}: `{name}` must be a number or a concrete real scalar array, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{fn}: `{name}` must be a positive finite float, got {value}")
    return value


def resolve_implementation(impl, fn: str = "attention") -> Implementation:
    """``implementation`` as an :class:`Implementation`, checked (errors naming ``fn``)."""
    if impl is None:
        return Implementation()
    if isinstance(impl, str) and impl in IMPLEMENTATION_NAMES:
        impl = Implementation(impl)
    if not isinstance(impl, Implementation) or impl.name not in (None, *IMPLEMENTATION_NAMES):
        raise ValueError(
            f"{fn}: `implementation` must be None, one of {IMPLEMENTATION_NAMES} or an "
            f"Implementation, got {impl!r}"
        )
    for name in ("block_q", "block_kv", "num_stages", "kv_splits"):
        size = getattr(impl, name)
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"{fn}: Implementation.{name} must be a positive int, got {size!r}")
    if impl.name == "pallas_mosaic_gpu" and (impl.block_q not in (None, 64) or impl.block_kv not in (None, 64, 128) or impl.num_warps is not None or impl.pack_gqa or impl.kv_splits):
        raise ValueError(
            f"{fn}: Implementation('pallas_mosaic_gpu') takes block_q None or 64 (rows a warpgroup), "
            f"block_kv None, 64 or 128, no num_warps (it runs warpgroups), no pack_gqa or kv_splits, got {impl!r}"
        )
    for name in ("pack_gqa", "head_pieces"):
        switch = getattr(impl, name)
        if switch is not None and not isinstance(switch, bool):
            raise ValueError(f"{fn}: Implementation.{name} must be None, True or False, got {switch!r}")
    warps = impl.num_warps
    if warps is not None and (not isinstance(warps, int) or warps not in (1, 2, 4, 8, 16)):
        raise ValueError(f"{fn}: Implementation.num_warps must be one of 1, 2, 4, 8, 16, got {warps!r}")
    return impl
