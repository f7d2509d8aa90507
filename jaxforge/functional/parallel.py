r"""Model-parallel building blocks written with ``jf.collectives``, for use inside ``jf.shard``.

Every backward here comes from differentiating the forward: the collectives' transposes (and the
invariant/varying typing of ``jax.shard_map``) produce the gradient communication.

* :func:`column_parallel_linear` / :func:`row_parallel_linear`: Megatron tensor parallelism. A
  column-parallel layer followed by a row-parallel one (an MLP) costs one all-reduce forward and
  one backward.
* :func:`sequence_parallel_rms_norm`: RMS norm of sequence-sharded activations; its scale's
  gradient is summed over the shards by the transpose of the implicit broadcast.
* :func:`ring_attention`: context parallelism — the sequence is sharded, key/value blocks travel
  round the ring (``shift``) and the partial results merge through their log-sum-exp. With
  ``causal=True`` and :func:`load_balance`'s head–tail layout every device does the same work;
  ``mask=`` takes any mask, each block of it shifted to where its queries and keys lie
  (``jf.masks.shifted``) so blocks it hides cost nothing; ``score_mod=`` (ALiBi, a relative bias)
  reads the global positions.
* :func:`all_gather_attention`: the same layouts, k and v gathered whole on every device instead.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxforge.functional import collectives, masks
from jaxforge.functional._static import static_bool
from jaxforge.functional.attention import _traced_score_mod, attention, check_scalars, merge_attention
from jaxforge.primitives import _core
from jaxforge.primitives.attention.attention import accumulation_dtype, check_operands

__all__ = [
    "all_gather_attention",
    "column_parallel_linear",
    "load_balance",
    "merge_attention",
    "ring_attention",
    "row_parallel_linear",
    "sequence_parallel_rms_norm",
    "unbalance",
]


def column_parallel_linear(x, w, b=None, *, axis_name, gather_output: bool = False):
    """``x @ w + b`` with ``w``'s columns (and ``b``) split over ``axis_name``; ``x`` replicated.

    Returns this device's columns, or all of them with ``gather_output`` (an all-gather whose
    backward keeps this device's slice).
    """
    y = collectives.copy_to_parallel(x, axis_name) @ w
    if b is not None:
        y = y + lax.broadcast_to_rank(b, y.ndim)
    if gather_output:
        y = collectives.gather_from_parallel(y, axis_name, axis=-1, tensor_parallel_output_grad=False)
    return y


def row_parallel_linear(x, w, b=None, *, axis_name):
    """``x @ w + b`` with ``x``'s last dim and ``w``'s rows split over ``axis_name``; the partial
    products are summed (one all-reduce) and ``b`` (replicated) added once."""
    y = collectives.reduce_from_parallel(x @ w, axis_name)
    return y if b is None else y + lax.broadcast_to_rank(b, y.ndim)


def sequence_parallel_rms_norm(x, scale, *, eps: float = 1e-6):
    r""":math:`x / \sqrt{\overline{x^2} + \epsilon} \cdot \text{scale}` over the last dim, per token.

    Tokens are independent, so the forward needs no communication; ``scale`` is replicated and its
    gradient, a sum over tokens, is all-reduced over the sequence shards by the transpose.
    """
    ms = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * lax.rsqrt(ms + eps).astype(x.dtype)) * lax.broadcast_to_rank(jnp.asarray(scale), x.ndim)


def ring_attention(
    q,
    k,
    v,
    *,
    axis_name,
    causal: bool = False,
    mask=None,
    score_mod=None,
    softcap=None,
    load_balanced: bool = True,
    scale=None,
    sinks=None,
    return_lse: bool = False,
    return_max_scores: bool = False,
):
    """Attention over a sequence sharded along ``axis_name`` (inside ``jf.shard``/``shard_map``).

    ``q``, ``k``, ``v`` are this device's chunks, ``(..., S_local, H, D)`` (k's and v's may be of
    another length than q's: a chunk of each sequence, at its own global positions). Key/value
    chunks go round the ring in ``n`` steps (``n - 1`` collective-permutes); each step attends the
    local queries to the visiting chunk with ``jf.attention`` and merges by log-sum-exp.

    ``causal=True`` needs the global order of the chunks: with ``load_balanced`` (default) the
    sequence must be in :func:`load_balance`'s head–tail layout (device ``r`` holds chunks ``r``
    and ``2n-1-r`` of ``2n``), and every step costs each device half a block; otherwise device
    ``r`` holds chunk ``r`` and devices idle on blocks above the diagonal. ``sinks``,
    ``return_lse`` and ``return_max_scores``: as :func:`jf.attention <jaxforge.attention>`'s (the
    sinks joined once after the ring; the lse, the sinks' included, and the largest scores of the
    local queries).

    ``mask``: any mask over the global positions (with ``causal=True``, joined to it by ``&``), in
    either layout: each step attends each local chunk to each visiting one under the mask shifted
    to their positions (:func:`jf.masks.shifted <jaxforge.functional.masks.shifted>`), and a pair of
    chunks it hides visits no tile. Its arrays (a document's segment ids, ``from_array``'s table)
    are the whole sequence's, in its global order, on every device.

    ``score_mod`` and ``softcap``: as ``jf.attention``'s, ``score_mod`` at the global positions of
    its query and key (in the layout ``load_balanced`` names, as a mask's) and at this device's
    batch and head indices; the arrays it closes over (a relative-bias table) get their gradients
    summed over the devices.
    """
    check_operands("ring_attention", q, k, v)
    check_scalars("ring_attention", scale=scale, softcap=softcap)
    causal, load_balanced, return_lse = _flags("ring_attention", causal=causal, load_balanced=load_balanced, return_lse=return_lse)
    kw = dict(scale=scale, softcap=softcap, return_lse=True, return_max_scores=return_max_scores)
    score_mod = _varying_score_mod(score_mod, q, axis_name)
    if mask is None and (not causal or q.shape[-3] == k.shape[-3]):
        _check_layout("ring_attention", q, k, causal or score_mod is not None, load_balanced)
        result = _ring(q, k, v, axis_name, causal, load_balanced, score_mod, kw)
    else:  # a mask, or causal over chunks of unequal lengths: each pair of chunks under its block of it
        mask = _joined("ring_attention", q, k, mask, causal, load_balanced)
        result = _ring_masked(q, k, v, mask, score_mod, axis_name, load_balanced, kw)
    return _finished(result, sinks, return_lse)


def _flags(fn: str, **flags) -> tuple[bool, ...]:
    return tuple(static_bool(fn, name, value) for name, value in flags.items())


def _check_layout(fn: str, q, k, positioned: bool, load_balanced: bool) -> None:
    if positioned and load_balanced and (q.shape[-3] % 2 or k.shape[-3] % 2):
        raise ValueError(
            f"{fn}: a load-balanced mask or score_mod needs even local lengths (a head and a tail chunk each), "
            f"got q {q.shape} and k {k.shape}"
        )


def _joined(fn: str, q, k, mask, causal: bool, load_balanced: bool, positioned: bool = False):
    """``mask`` with ``causal=True`` joined by ``&`` (None: neither), the layout checked (so too
    where ``positioned``: a score_mod reads positions)."""
    _check_layout(fn, q, k, causal or mask is not None or positioned, load_balanced)
    if mask is None:
        return masks.causal() if causal else None
    return masks.as_mask(mask) & masks.causal() if causal else masks.as_mask(mask)


def _finished(result, sinks, return_lse: bool):
    """``out`` of a partial result ``(out, lse[, max_scores])`` with the attention sinks joined once,
    through the lse (None: as they are), then the lse where asked for and the maxima where there."""
    out, lse, *top = result
    if sinks is not None:
        out, lse = merge_attention(out, lse, None, jnp.asarray(sinks).astype(lse.dtype))
    asked = [lse] * return_lse + top
    return (out, *asked) if asked else out


def _merged_partials(a, b):
    """Two partial results ``(out, lse[, max_scores])`` of the same queries over disjoint keys."""
    return (*merge_attention(*a[:2], *b[:2]), *(jnp.maximum(x, y) for x, y in zip(a[2:], b[2:])))


def _ring(q, k, v, axis_name, causal: bool, load_balanced: bool, score_mod, kw):
    """:func:`ring_attention`'s partial result ``(out, lse[, max_scores])``, unmasked or causal (q's
    and k's chunks of one length): whole blocks, or halves of them."""
    n, me, local, kv_local = lax.axis_size(axis_name), lax.axis_index(axis_name), q.shape[-3], k.shape[-3]
    half = local // 2

    def step_attention(src, k, v):
        def attend(q, k, v, q_start=0, kv_start=0, mask=None):  # local rows and keys from these
            chunks = ((me, local, q_start), (src, kv_local, kv_start))
            positions = (_global_position(device, n, length, load_balanced, start) for device, length, start in chunks)
            return attention(q, k, v, mask=mask, score_mod=_at_positions(score_mod, *positions), **kw)

        if not causal:
            return attend(q, k, v)
        diagonal = lambda: attend(q, k, v, mask=masks.causal())
        if load_balanced:
            # src < me: the visiting head chunk precedes both local chunks, its tail follows them.
            # src > me: only the local tail chunk sees the visitor, all of it.
            earlier = lambda: attend(q, k[..., :half, :, :], v[..., :half, :, :])
            later = lambda: _rows_after(half, attend(q[..., half:, :, :], k, v, q_start=half))
        else:
            earlier = lambda: attend(q, k, v)
            later = lambda: _nothing_visible(q, v, kw["return_max_scores"])
        return lax.switch(jnp.sign(src - me) + 1, [earlier, diagonal, later])

    result = step_attention(me, k, v)
    for step in range(1, n):
        k, v = collectives.shift(k, axis_name), collectives.shift(v, axis_name)
        result = _merged_partials(result, step_attention((me - step) % n, k, v))
    return result


def _varying_score_mod(score_mod, q, axis_name):
    """``score_mod`` with the arrays it closes over cast, once, to vary over ``axis_name``: the
    transpose of that cast, the all-reduce of their gradients, then runs once, after every step,
    not in each call (some of which sit in branches that devices take differently, where an
    all-reduce would wait for ever on the devices that took another)."""
    if score_mod is None:
        return None
    fn, consts = _traced_score_mod(score_mod, accumulation_dtype(q.dtype))
    typed = _core.varying_axes(lax.axis_index(axis_name))  # none under vmap(axis_name=...)
    consts = [_core.varying_over(c, typed) for c in consts]
    return lambda *args: fn(*args, *consts)[0]


def _global_position(device, n: int, local: int, load_balanced: bool, start: int = 0):
    """Where local index ``start + i`` of ``device``'s chunk of ``local`` lies in the sequence:
    contiguous chunks, or :func:`load_balance`'s head and tail."""
    if not load_balanced:
        return _from(device * local + start)
    c = local // 2
    return lambda i: jnp.where(start + i < c, device * c, (2 * n - 2 - device) * c) + start + i


def _from(offset):
    """The positions of a contiguous chunk from ``offset``."""
    return lambda i: offset + i


def _at_positions(score_mod, q_position, kv_position):
    """``score_mod`` at the global positions ``q_position(q_idx)``, ``kv_position(kv_idx)`` (None: None)."""
    if score_mod is None:
        return None
    return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_position(q_idx), kv_position(kv_idx))


def _ring_masked(q, k, v, mask, score_mod, axis_name, load_balanced: bool, kw):
    """:func:`ring_attention`'s partial result under ``mask``: every local chunk of queries attends
    every chunk of keys that visits, the mask (and ``score_mod``) shifted to their global
    positions; merged by lse."""
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    queries = _local_chunks(q, me, n, load_balanced)
    results = [None] * len(queries)
    for step in range(n):
        if step:
            k, v = collectives.shift(k, axis_name), collectives.shift(v, axis_name)
        src = (me - step) % n
        visiting = list(zip(*(_local_chunks(x, src, n, load_balanced) for x in (k, v))))
        for i, (q_chunk, q_offset) in enumerate(queries):
            for (k_chunk, kv_offset), (v_chunk, _) in visiting:
                block = masks.shifted(mask, q_offset, kv_offset, q_len=q_chunk.shape[-3], kv_len=k_chunk.shape[-3])
                at = _at_positions(score_mod, _from(q_offset), _from(kv_offset))
                part = attention(q_chunk, k_chunk, v_chunk, mask=block, score_mod=at, **kw)
                results[i] = part if results[i] is None else _merged_partials(results[i], part)
    return _rows_joined(results)


def _rows_joined(parts):
    """Partial results of consecutive chunks of queries as one: concatenated along the rows."""
    return tuple(jnp.concatenate(xs, axis=-3 if not i else -2) for i, xs in enumerate(zip(*parts)))


def _local_chunks(x, device, n: int, load_balanced: bool) -> list:
    """``(chunk, its first global position)`` of each chunk of the sequence ``x`` (dim -3) that
    ``device`` of ``n`` holds: all of it, or the head and tail chunks of :func:`load_balance`."""
    local = x.shape[-3]
    if not load_balanced:
        return [(x, device * local)]
    c = local // 2
    return [(x[..., :c, :, :], device * c), (x[..., c:, :, :], (2 * n - 1 - device) * c)]


def all_gather_attention(
    q,
    k,
    v,
    *,
    axis_name,
    causal: bool = False,
    mask=None,
    score_mod=None,
    softcap=None,
    load_balanced: bool = True,
    scale=None,
    sinks=None,
    return_lse: bool = False,
    return_max_scores: bool = False,
):
    """Attention over a sequence sharded along ``axis_name`` (inside ``jf.shard``/``shard_map``) by
    gathering every key and value: the context parallelism of Llama 3, beside :func:`ring_attention`.

    ``q``, ``k``, ``v`` are this device's chunks, ``(..., S_local, H, D)``, in the same layouts as
    ring_attention's (``load_balanced``: :func:`load_balance`'s head–tail order, so that a causal
    mask gives every device the same work). One all-gather of k and one of v (whose transposes sum
    their gradients back to the shards) bring the whole sequence to every device, which attends
    its queries to it under ``mask`` (with ``causal=True``, joined by ``&``) shifted to their
    positions, ``score_mod`` (and ``softcap``, as ``jf.attention``'s) at their global positions:
    one call per local chunk, the tiles the mask hides skipped. Against the ring: memory for every
    key per device, but no step waits on the next permute, and a mask of arrays slices them once.
    Small k and v (GQA, MQA) make the gather cheap. ``sinks``, ``return_lse`` and
    ``return_max_scores``: as ring_attention's.
    """
    check_operands("all_gather_attention", q, k, v)
    check_scalars("all_gather_attention", scale=scale, softcap=softcap)
    causal, load_balanced, return_lse = _flags("all_gather_attention", causal=causal, load_balanced=load_balanced, return_lse=return_lse)
    mask = _joined("all_gather_attention", q, k, mask, causal, load_balanced, score_mod is not None)
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    k, v = (collectives.all_gather(x, axis_name, axis=x.ndim - 3, tiled=True) for x in (k, v))
    kw = dict(scale=scale, softcap=softcap, return_lse=True, return_max_scores=return_max_scores)
    score_mod = _varying_score_mod(score_mod, q, axis_name)
    if mask is None and score_mod is None:  # the keys' order does not matter
        parts = [attention(q, k, v, **kw)]
    else:
        if load_balanced:  # the gathered chunks into their global order
            k, v = unbalance(k, n), unbalance(v, n)
        parts = [
            attention(
                chunk,
                k,
                v,
                mask=None if mask is None else masks.shifted(mask, start, 0, q_len=chunk.shape[-3]),
                score_mod=_at_positions(score_mod, _from(start), _from(0)),
                **kw,
            )
            for chunk, start in _local_chunks(q, me, n, load_balanced)
        ]
    return _finished(_rows_joined(parts), sinks, return_lse)


def _rows_after(half, result):
    """Pads a partial result of the last rows back to all rows: the first ``half`` see nothing."""
    out, *rows = result
    pad = [(0, 0)] * (out.ndim - 3) + [(half, 0), (0, 0), (0, 0)]
    return jnp.pad(out, pad), *(jnp.pad(x, pad[:-1], constant_values=-jnp.inf) for x in rows)


def _nothing_visible(q, v, max_scores: bool):
    """No key visible: out 0, lse (and the maxima) -inf (built from q so it varies over the same devices)."""
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    out = lax.full_like(q, 0, shape=(*q.shape[:-1], v.shape[-1]))
    nothing = lax.full_like(q, -jnp.inf, dtype=lse_dtype, shape=q.shape[:-1])
    return out, nothing, *[nothing] * max_scores


def load_balance(x, num_shards: int, *, axis: int = -3):
    """Reorders a global sequence into the head–tail layout: cut into ``2 * num_shards`` chunks,
    shard ``r`` gets chunks ``r`` and ``2 * num_shards - 1 - r`` (then shard the axis evenly).

    Reorder once, on the host or where the data is made: applied to an array already sharded
    along ``axis``, the reorder is a reshuffle across devices (all-to-alls and permutes), and so
    is its transpose in the backward pass."""
    chunks = _chunks("load_balance", x, num_shards, axis)
    order = [c for r in range(num_shards) for c in (chunks[r], chunks[2 * num_shards - 1 - r])]
    return jnp.concatenate(order, axis=axis)


def unbalance(x, num_shards: int, *, axis: int = -3):
    """Inverse of :func:`load_balance`."""
    chunks = _chunks("unbalance", x, num_shards, axis)
    heads, tails = chunks[0::2], chunks[1::2]
    return jnp.concatenate(heads + tails[::-1], axis=axis)


def _chunks(fn: str, x, num_shards: int, axis: int):
    """``x`` cut into ``2 * num_shards`` equal chunks along ``axis``, or an error naming what fails."""
    x = jnp.asarray(x)
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"{fn}: `num_shards` must be a positive int, got {num_shards!r}")
    if not -x.ndim <= axis < x.ndim or x.shape[axis] % (2 * num_shards):
        raise ValueError(
            f"{fn}: `x` of shape {x.shape} must have an `axis` ({axis}) whose length is a multiple of "
            f"2 * num_shards = {2 * num_shards} (each shard holds a head and a tail chunk)"
        )
    return jnp.split(x, 2 * num_shards, axis=axis)
