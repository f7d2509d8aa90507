"""Dense attention in jax.numpy on full score matrices, differentiable: the independent reference
of the attention tests (``dense_jnp``) and the index arrays score and mask functions take (``grid``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def grid(b, hq, sq, skv):
    """Index arrays (b, h, q_idx, kv_idx), each of shape (B, Hq, Sq, Skv)."""
    return np.meshgrid(np.arange(b), np.arange(hq), np.arange(sq), np.arange(skv), indexing="ij")


def dense_jnp(q, k, v, visible=None, score_fn=None, scale=None, softcap=None):
    """Attention in jax.numpy, differentiable; ``visible`` is a boolean (B, Hq, Sq, Skv)
    array and ``score_fn`` is applied to the whole score array with the index arrays of ``grid``.
    q, k, v share their leading dims."""
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
    s = jnp.where(row, s, 0.0)  # a fully masked row: keep its (discarded) softmax finite
    mx = jax.lax.stop_gradient(s.max(-1, keepdims=True, initial=-jnp.inf))
    e = jnp.exp(s - mx)
    t = e.sum(-1, keepdims=True)
    out = jnp.where(row, jnp.einsum("bhqk,bkhd->bhqd", e / t, vr, precision="highest"), 0.0)
    out = jnp.swapaxes(out, 1, 2)
    lse = jnp.where(row, mx + jnp.log(t), -jnp.inf)[..., 0]
    return out.reshape(*batch, sq, hq, dv), jnp.swapaxes(lse, 1, 2).reshape(*batch, sq, hq)
