"""Dense attention in jax.numpy on full score matrices, differentiable: the independent reference
of the attention tests (``dense_jnp``), the index arrays score and mask functions take (``grid``),
and the ranges a mask's visible pairs give (``visible_ranges``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def grid(b, hq, sq, skv):
    """Index arrays (b, h, q_idx, kv_idx), each of shape (B, Hq, Sq, Skv)."""
    return np.meshgrid(np.arange(b), np.arange(hq), np.arange(sq), np.arange(skv), indexing="ij")


def dense_jnp(q, k, v, visible=None, score_fn=None, scale=None, softcap=None, max_scores=False):
    """Attention in jax.numpy, differentiable; ``visible`` is a boolean (B, Hq, Sq, Skv)
    array and ``score_fn`` is applied to the whole score array with the index arrays of ``grid``.
    q, k, v share their leading dims. ``(out, lse)``, with ``max_scores`` also each row's largest
    score (jnp.max's derivative)."""
    batch = q.shape[:-3]
    q, k, v = (x.reshape(math.prod(batch), *x.shape[-3:]) for x in (q, k, v))
    bsz, sq, hq, d = q.shape
    skv, hkv, dv = v.shape[1:]
    group = hq // hkv if hkv else 0  # no heads
    kr, vr = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr, precision="highest") * (1 / np.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if score_fn is not None:
        s = score_fn(s, *grid(bsz, hq, sq, skv))
    visible = np.ones(s.shape, bool) if visible is None else np.asarray(visible)
    row = visible.any(-1, keepdims=True)
    s = jnp.where(visible, s, -jnp.inf)
    top = s.max(-1, initial=-jnp.inf)
    s = jnp.where(row, s, 0.0)  # a fully masked row: keep its (discarded) softmax finite
    mx = jax.lax.stop_gradient(s.max(-1, keepdims=True, initial=-jnp.inf))
    e = jnp.exp(s - mx)
    t = e.sum(-1, keepdims=True)
    out = jnp.where(row, jnp.einsum("bhqk,bkhd->bhqd", e / t, vr, precision="highest"), 0.0)
    out = jnp.swapaxes(out, 1, 2)
    lse = jnp.where(row, mx + jnp.log(t), -jnp.inf)[..., 0]
    rows = lambda x: jnp.swapaxes(x, 1, 2).reshape(*batch, sq, hq)  # noqa: E731
    return (out.reshape(*batch, sq, hq, dv), rows(lse), *[rows(top)] * max_scores)


def visible_ranges(visible) -> tuple:
    """RangeSpan's six arrays of a boolean ``(items, heads, q_len, kv_len)`` array by brute force,
    ``(items, n)`` each: each query's hull of the keys any head shows it and the run of keys every
    head shows it from there (``sure_hi``), then the same for each key; ``(n_other, 0, n_other)``
    where none is seen."""
    ranges = []
    for by_rows in (visible, np.swapaxes(visible, 2, 3)):
        seen, every = by_rows.any(axis=1), by_rows.all(axis=1)  # over heads: (items, rows, cols)
        items, rows, width = seen.shape
        lo, hi, sure_hi = (np.zeros((items, rows), np.int64) for _ in range(3))
        for b in range(items):
            for row in range(rows):
                cols = np.flatnonzero(seen[b, row])
                lo[b, row], hi[b, row] = (cols[0], cols[-1] + 1) if cols.size else (width, 0)
                run = every[b, row, lo[b, row] : hi[b, row]]
                sure_hi[b, row] = max(lo[b, row] + (np.argmin(run) if not run.all() else run.size), lo[b, row])
        ranges += [lo, hi, sure_hi]
    return tuple(ranges)
