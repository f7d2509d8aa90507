r"""attention: flex-style scaled dot-product attention as three primitives with their own rules.

For query ``i`` and key ``j`` of one batch item and head (GQA: query head ``h`` reads key/value
head ``h // (Hq / Hkv)``), with :math:`m_{ij}` the mask and :math:`f` softcap then ``score_mod``:

.. math::

    s_{ij} = f(\text{scale}\; q_i \cdot k_j) \text{ where } m_{ij},\ -\infty \text{ elsewhere};\quad
    \text{lse}_i = \log \textstyle\sum_j e^{s_{ij}};\quad
    p_{ij} = e^{s_{ij} - \text{lse}_i};\quad o_i = \textstyle\sum_j p_{ij} v_j .

A fully masked row has :math:`o_i = 0`, :math:`\text{lse}_i = -\infty` and zero derivatives.

* ``attention_fwd_p(q, k, v, *mask_consts, *score_consts) -> (out, lse)``; with ``max_scores=True``
  also each row's largest score :math:`\max_j s_{ij}`, and with ``first_keys=True`` the first key
  attaining it, which its JVP binds for: the maximum's derivative is that key's :math:`ds_{ij}`,
  computed at that key alone (O(S·D)). Where jit finds the first keys (or the maxima) unused, its
  dead-code elimination binds a forward without them (``_fwd_fewer_outputs``).
* ``attention_tangent_p(q, k, v, out, lse, *consts, dq, dk, dv, *dscore_consts) -> (dout, dlse)``,
  linear in the tangents (the JVP of fwd). With :math:`ds_{ij} = f'\,\text{scale}(dq_i\cdot k_j +
  q_i\cdot dk_j) + \partial_c f\, dc`:

  .. math::  d\text{lse}_i = \textstyle\sum_j p_{ij}\, ds_{ij},\qquad
             do_i = \textstyle\sum_j p_{ij}\,(ds_{ij}\, v_j + dv_j) - d\text{lse}_i\, o_i .

* ``attention_bwd_p(q, k, v, out, lse, *consts, g_out, g_lse) -> (gq, gk, gv, *gscore_consts)``,
  the transpose of the tangent map (the FlashAttention backward, with an lse cotangent):

  .. math::  g_{s,ij} = p_{ij}\,(g_{o,i}\cdot v_j - \Delta_i),\quad
             \Delta_i = g_{o,i}\cdot o_i - g_{\text{lse},i},\quad
             g_q = \text{scale}\, (f' g_s)\, k,\ g_k = \text{scale}\,(f' g_s)^T q,\ g_v = p^T g_o .

fwd's JVP binds tangent; tangent's transpose binds bwd; bwd's transpose binds tangent. So jvp, grad,
jacfwd, jacrev and hessian-vector products all come from these three. The JVP names the residuals
it passes on, ``out`` and ``lse`` (``RESIDUAL_NAMES``), so that a ``jax.checkpoint`` policy may save
them and a rematerialised backward need not run the forward again (``jaxforge.transforms.remat``).

Second order. The tangent map's JVP is tangent itself along (dq, dk, dv) plus
``attention_tangent2_p``, its derivative in ``(q, k, v, out, lse)`` as the kernels read them
(``p = e^{s - lse}``, ``dout = Σ p (ds v + dv) - dlse·o``); that primitive's transpose,
``attention_tangent_bwd_p``, is a gradient through a jvp (consistency-model training). With
``c_i = g_{\text{lse},i} - g_{o,i}\cdot o_i`` the pairing with the cotangents is a sum over tiles,

.. math::  g_o\cdot do + g_{\text{lse}}\cdot d\text{lse} = \textstyle\sum_{ij}
           p_{ij}\,\big(ds_{ij}\,(g_{o,i}\cdot v_j + c_i) + g_{o,i}\cdot dv_j\big),

so its lowering differentiates each tile's term (O(S) memory, kernel.tangent_bwd_cols); the
cotangent of ``out`` is ``-g_c\, g_o``. tangent2 itself (a jvp of a jvp) is forward mode through
the tangent's tiles (O(S) memory). Third order, and the derivatives of bwd and of the tangent where
the float score consts themselves move, differentiate the dense reference: correct, not fast.

Operands are ``q (*batch, Sq, Hq, D)``, ``k (*batch, Skv, Hkv, D)``, ``v (*batch, Skv, Hkv, Dv)``,
``out (*batch, Sq, Hq, Dv)``, ``lse (*batch, Sq, Hq)`` (float32, float64 for float64 input).

Where things live:
    API        jaxforge/functional/attention.py :: attention, jaxforge/functional/masks.py
    lowering   jaxforge/lowering/attention/attention/
    tests      tests/primitives/attention/test_attention.py
    benchmark  jaxforge/bench/attention.py (entry "attention")
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxforge.primitives import _core
from jaxforge.primitives.attention.mods import Mods, float_consts, with_floats

__all__ = [
    "ACCEPTED_DTYPES",
    "IMPLEMENTATION_NAMES",
    "Implementation",
    "RESIDUAL_NAMES",
    "SHAPES",
    "attention_bwd_p",
    "attention_bwd_tangent_p",
    "attention_fwd_p",
    "attention_reference",
    "attention_tangent2_p",
    "attention_tangent_bwd_p",
    "attention_tangent_p",
    "lse_dtype",
    "merge_weights",
    "second_order_operands",
    "tangent_at",
]

ACCEPTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
IMPLEMENTATION_NAMES = ("xla", "pallas_triton", "pallas_mosaic_gpu")
RESIDUAL_NAMES = ("attention_out", "attention_lse")  # jax.ad_checkpoint.checkpoint_name of (out, lse)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """Which lowering runs a call (the ``implementation`` parameter), optionally with tile sizes.

    ``name=None`` picks the platform's best: "pallas_triton" on GPU, "xla" elsewhere. On CPU,
    "pallas_triton" runs the kernels in Pallas interpret mode (slow: for testing kernel logic).
    "pallas_mosaic_gpu" runs the forward, the tangent and the backward as Hopper (sm90) Mosaic GPU
    kernels (TMA, wgmma, warpgroups; the tangent and backward for head dims ``d + dv <= 256``,
    Triton's beyond); a GPU only (the kernels' own tests interpret them where jax exports Mosaic
    GPU's interpret mode, 0.11+). ``block_q``/``block_kv`` (tile rows) and, for Triton, ``num_warps`` (a
    power of two) and ``num_stages`` (software-pipelining depth) override config.py's choice for
    every kernel of the call: for tuning sweeps (``python -m jaxforge.bench attention --variants``).
    Mosaic GPU takes ``block_kv`` (64 or 128) and ``num_stages``; its ``block_q`` is 64 a warpgroup.
    ``pack_gqa`` (XLA and Triton): the query heads sharing a key/value head go in the rows of one
    tile (kernel.Geometry); None packs where one head's queries fill less than a tile (decoding,
    config.packs_gqa). ``kv_splits`` (the Triton forward, tangent and backward's dq): split-KV, each
    program's key tiles shared out over that many programs whose results merge through their
    log-sum-exps (flash-decoding; the tangents and dq add up); None splits where the programs would not fill the GPU (config.kv_splits).
    ``head_pieces`` (Triton): a head dim that is no power of two held in two power-of-two pieces
    where that is narrower (576 as 512 + 64) instead of zero-padded to one (1024); None: once
    validated on a GPU (config.head_pieces).
    """

    name: str | None = None
    block_q: int | None = None
    block_kv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    pack_gqa: bool | None = None
    kv_splits: int | None = None
    head_pieces: bool | None = None

# Named cases shared by tests and benchmarks: (batch, Sq, Skv, Hq, Hkv, D, Dv), mask, tags.
# "bench_gpu" are the GPU benchmark's cases (bf16 on the H200), "anchor" those with ANCHORS.md targets.
SHAPES = {
    "long_d128": ((2, 8192, 8192, 16, 16, 128, 128), None, ("bench_gpu", "anchor")),
    "long_d128_causal": ((2, 8192, 8192, 16, 16, 128, 128), "causal", ("bench_gpu", "anchor")),
    "short_d64": ((8, 2048, 2048, 16, 16, 64, 64), None, ("bench_gpu", "anchor")),
    "window_causal": ((2, 8192, 8192, 16, 16, 128, 128), "sliding_window_causal", ("bench_gpu", "anchor")),
    "document_causal": ((2, 8192, 8192, 16, 16, 128, 128), "document_causal", ("bench_gpu",)),
    "frames_causal": ((2, 8192, 8192, 16, 16, 128, 128), "frames_causal", ("bench_gpu",)),
    "sinks_window_causal": ((1, 16384, 16384, 16, 16, 128, 128), "sinks_window_causal", ("bench_gpu",)),
    "gqa_8to1": ((2, 4096, 4096, 32, 4, 128, 128), "causal", ("bench_gpu",)),
    "alibi_causal": ((2, 4096, 4096, 16, 16, 128, 128), "alibi_causal", ("bench_gpu",)),
    "mla_192_128": ((2, 4096, 4096, 16, 16, 192, 128), "causal", ("bench_gpu",)),
    "d256_causal": ((2, 4096, 4096, 16, 16, 256, 256), "causal", ("bench_gpu",)),
    "odd_cross": ((2, 1000, 1531, 8, 2, 64, 64), None, ("bench_gpu",)),
    # one decoding step: a batch of 64 with KV caches of 8192 keys; 2 with 65536 (split-KV)
    "decode_gqa_8to1": ((64, 1, 8192, 32, 4, 128, 128), None, ("bench_gpu",)),
    "decode_long_kv": ((2, 1, 65536, 32, 8, 128, 128), None, ("bench_gpu",)),
    # MLA's absorbed decoding step at DeepSeek-V3's dims (jf.nn.multi_head_latent_attention with a
    # cache): 128 query heads on one key/value head of 576 and 512; run by name (--shapes)
    "decode_mla_absorbed": ((64, 1, 8192, 128, 1, 576, 512), None, ()),
    "cpu_d64": ((2, 1024, 1024, 8, 8, 64, 64), None, ("bench_cpu",)),
    "cpu_causal": ((2, 1024, 1024, 8, 8, 64, 64), "causal", ("bench_cpu",)),
    "cpu_gqa_document": ((1, 1000, 1000, 8, 2, 64, 64), "document_causal", ("bench_cpu",)),
    "cpu_frames": ((1, 2048, 2048, 8, 8, 64, 64), "frames_causal", ("bench_cpu",)),
    "cpu_sinks_window": ((1, 8192, 8192, 2, 2, 64, 64), "sinks_window_causal", ("bench_cpu",)),
    "cpu_decode_gqa_4to1": ((4, 1, 16384, 32, 8, 128, 128), None, ("bench_cpu",)),
    "test_odd": ((2, 37, 53, 4, 2, 8, 6), None, ("test",)),
}


def lse_dtype(dtype) -> np.dtype:
    """The log-sum-exp is float64 for float64 input, else float32."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def accumulation_dtype(dtype) -> np.dtype:
    """Scores and sums accumulate in float32 (float64 for float64 input)."""
    return lse_dtype(dtype)


def merge_weights(lse, axis: int):
    """Weights and log-sum-exp of attentions of the same queries over disjoint keys, ``lse`` theirs
    along ``axis``: ``w_s = e^{lse_s - lse}``, ``lse = log Σ_s e^{lse_s}``, the merged output
    ``Σ_s w_s out_s``. A row that no part sees: weights 0, lse ``-inf`` (no NaN, zero gradients)."""
    top = jnp.max(lse, axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0)
    weights = jnp.exp(lse - top)  # a part that sees nothing: 0
    total = jnp.sum(weights, axis=axis, keepdims=True)
    seen = total > 0
    safe = jnp.where(seen, total, 1)
    return weights / safe, jnp.squeeze(jnp.where(seen, top + jnp.log(safe), -jnp.inf), axis)


def _split(operands, mods: Mods):
    n_mask = mods.num_mask_consts
    return list(operands[:n_mask]), list(operands[n_mask : n_mask + mods.num_score_consts])


# ---------------------------------------------------------------------------------------------
# The spec: dense attention in jax.numpy.


def attention_reference(q, k, v, *consts, mods: Mods, scale: float, max_scores: bool = False, first_keys: bool = False, implementation=None):
    """Dense attention (the spec): ``(out, lse)``, with ``max_scores`` also each row's largest
    score, with ``first_keys`` the first key attaining it. Memory O(Sq·Skv) per batch item and head."""
    del implementation
    *batch, sq, hq, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    qf, kf, vf = _dense_heads(q, k, v)
    s = _dense_scores(qf, kf, consts, mods, scale)
    allowed = _dense_mask(s, consts, mods)
    if allowed is not None:
        s = jnp.where(allowed, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)  # initial: there may be no keys
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    e = jnp.exp(s - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    visible = total > 0
    total = jnp.where(visible, total, 1)
    out = jnp.einsum("bhqk,bkhd->bqhd", e / total, vf.astype(acc), precision="highest")
    lse = jnp.where(visible, row_max + jnp.log(total), -jnp.inf)[..., 0]  # (b, h, q)
    out = out.astype(q.dtype).reshape(*batch, sq, hq, v.shape[-1])
    rows = lambda x: jnp.swapaxes(x, -1, -2).reshape(*batch, sq, hq)  # noqa: E731  (b, h, q) -> (*batch, q, h)
    if not max_scores:
        return out, rows(lse)
    top = jnp.max(s, axis=-1, initial=-jnp.inf)
    if not first_keys:
        return out, rows(lse), rows(top)
    first = jnp.argmax(s, axis=-1).astype(jnp.int32) if s.shape[-1] else jnp.zeros(top.shape, jnp.int32)
    return out, rows(lse), rows(top), rows(first)


def _dense_heads(q, k, v):
    """q, k, v with their batch dims flattened and k, v repeated over each GQA group."""
    batch = q.shape[:-3]
    qf, kf, vf = (x.reshape(math.prod(batch), *x.shape[len(batch) :]) for x in (q, k, v))
    group = q.shape[-2] // k.shape[-2] if k.shape[-2] else 0  # no k/v heads: no query heads either
    return qf, jnp.repeat(kf, group, axis=2), jnp.repeat(vf, group, axis=2)


def _dense_iotas(shape, batch_ids=None, head_offset=0):
    """``(b, h, q_idx, kv_idx)`` of a ``(B, H, Sq, Skv)`` score array; global ``b`` and ``h`` for a
    shard's block (``batch_ids[b]``, ``head_offset + h``)."""
    b, h, qi, ki = (jax.lax.broadcasted_iota(jnp.int32, shape, axis) for axis in range(4))
    return (b if batch_ids is None else batch_ids[b]), h + head_offset, qi, ki


def _dense_scores(qf, kf, consts, mods: Mods, scale: float, **where):
    """Modified scores ``(B, H, Sq, Skv)`` (no mask applied), in the accumulation dtype."""
    _, score_c = _split(consts, mods)
    raw = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision="highest", preferred_element_type=accumulation_dtype(qf.dtype))
    modify = lambda raw, score_c: mods.modify(raw * scale, *_dense_iotas(raw.shape, **where), score_c)  # noqa: E731
    return _core.under_automatic_axes(modify, raw, raw, score_c)  # a score mod's gathers


def _dense_mask(scores, consts, mods: Mods, **where):
    """The mask of a score array (None: every key visible)."""
    mask_c, _ = _split(consts, mods)
    if mods.mask is None:
        return None
    allowed = lambda mask_c: mods.allowed(*_dense_iotas(scores.shape, **where), mask_c)  # noqa: E731
    return _core.under_automatic_axes(allowed, scores, mask_c)  # a mask's gathers


def _tangent_reference(q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation=None):
    del out, lse
    consts, tangents = _split_tangent_operands(operands, mods)
    mask_c, score_c = _split(consts, mods)
    dq, dk, dv, *dscore = tangents
    ref = lambda q, k, v, *score_c: attention_reference(q, k, v, *mask_c, *score_c, mods=mods, scale=scale)
    full_dscore = with_floats(score_c, dscore)  # the integer consts' entries are held fixed
    _, (dout, dlse) = _core.jvp_in_floats(ref, (q, k, v, *score_c), (dq, dk, dv, *full_dscore))
    return dout, dlse


def _bwd_reference(q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, implementation=None):
    del out, lse
    *consts, g_out, g_lse = operands
    mask_c, score_c = _split(consts, mods)
    ref = lambda q, k, v, *score_c: attention_reference(q, k, v, *mask_c, *score_c, mods=mods, scale=scale)
    _, vjp = jax.vjp(ref, q, k, v, *score_c)
    gq, gk, gv, *gscore = vjp((g_out, g_lse))
    gscore = [g for g, c in zip(gscore, score_c) if jnp.issubdtype(c.dtype, jnp.inexact)]
    return (gq, gk, gv, *[g for g, wanted in zip(gscore, const_grads) if wanted])


def _bwd_at(q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads):
    """The backward as the kernels compute it, densely: the transpose of :func:`tangent_at` in
    ``(dq, dk, dv, float score-const tangents)`` at ``(g_out, g_lse)``; from the given ``(out, lse)``,
    where :func:`_bwd_reference` recomputes them."""
    *consts, g_out, g_lse = operands
    _, score_c = _split(consts, mods)
    at = lambda *d: tangent_at(q, k, v, out, lse, *consts, *d, mods=mods, scale=scale)  # noqa: E731
    gq, gk, gv, *gscore = jax.vjp(at, *(jnp.zeros_like(x) for x in (q, k, v, *float_consts(score_c))))[1]((g_out, g_lse))
    return (gq, gk, gv, *[g for g, wanted in zip(gscore, const_grads) if wanted])


def _bwd_tangent_reference(
    q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, moving, implementation=None
):
    """The jvp of :func:`_bwd_at` in ``(q, k, v, out, lse, g_out, g_lse)`` along the last seven
    operands, those where ``moving`` is False zero (held fixed)."""
    *consts, g_out, g_lse = operands[:-7]
    at = lambda q, k, v, out, lse, g_out, g_lse: _bwd_at(  # noqa: E731
        q, k, v, out, lse, *consts, g_out, g_lse, mods=mods, scale=scale, const_grads=const_grads
    )
    return _core.jvp_along(at, (q, k, v, out, lse, g_out, g_lse), operands[-7:], moving)[1]


def tangent_at(q, k, v, out, lse, *operands, mods: Mods, scale: float, batch_ids=None, head_offset=0):
    """The tangent map as the kernels compute it, densely: from the given ``(out, lse)``,
    ``p = e^{s - lse}``, ``dlse = Σ_j p ds``, ``dout = Σ_j p (ds v + dv) - dlse·out``. Its partial
    derivatives in ``out`` and ``lse`` are the second-order primitives'. ``operands``: the consts,
    dq, dk, dv, then the float score consts' tangents."""
    n = mods.num_mask_consts + mods.num_score_consts
    consts, (dq, dk, dv), dscore = list(operands[:n]), operands[n : n + 3], list(operands[n + 3 :])
    mask_c, score_c = _split(consts, mods)
    *batch, sq, hq, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    (qf, kf, vf), (dqf, dkf, dvf) = _dense_heads(q, k, v), _dense_heads(dq, dk, dv)
    where = dict(batch_ids=batch_ids, head_offset=head_offset)

    def scores(qf, kf, floats):
        return _dense_scores(qf, kf, [*mask_c, *with_floats(score_c, floats)], mods, scale, **where)

    s, ds = jax.jvp(scores, (qf, kf, float_consts(score_c)), (dqf, dkf, dscore))
    allowed = _dense_mask(s, consts, mods, **where)
    visible = True if allowed is None else allowed
    lse_f = jnp.swapaxes(lse.reshape(math.prod(batch), sq, hq), 1, 2)[..., None].astype(acc)
    p = jnp.exp(jnp.where(visible, s, -jnp.inf) - jnp.where(jnp.isfinite(lse_f), lse_f, 0))
    p_ds = p * jnp.where(visible, ds, 0)
    dlse = jnp.sum(p_ds, axis=-1)  # (b, h, q)
    mix = lambda w, x: jnp.einsum("bhqk,bkhd->bqhd", w, x.astype(acc), precision="highest")  # noqa: E731
    outf = out.reshape(math.prod(batch), sq, hq, out.shape[-1]).astype(acc)
    dout = mix(p_ds, vf) + mix(p, dvf) - jnp.swapaxes(dlse, 1, 2)[..., None] * outf
    return dout.astype(out.dtype).reshape(out.shape), jnp.swapaxes(dlse, 1, 2).reshape(lse.shape).astype(lse.dtype)


def second_order_operands(operands, mods: Mods, n_linear: int):
    """``(consts, [dq, dk, dv], the n_linear operands after them, float score-const tangents)`` of
    attention_tangent2 (``n_linear=5``: the tangents of q, k, v, out, lse) or attention_tangent_bwd
    (2: the cotangents of dout, dlse)."""
    n = mods.num_mask_consts + mods.num_score_consts
    split = (n, n + 3, n + 3 + n_linear)
    return list(operands[: split[0]]), list(operands[split[0] : split[1]]), list(operands[split[1] : split[2]]), list(operands[split[2] :])


def _tangent2_reference(q, k, v, out, lse, *operands, mods: Mods, scale: float, moving, implementation=None):
    """The jvp of :func:`tangent_at` in ``(q, k, v, out, lse)`` along ``along``, zero where
    ``moving`` is False (held fixed)."""
    consts, d, along, dscore = second_order_operands(operands, mods, 5)
    at = lambda q, k, v, out, lse: tangent_at(q, k, v, out, lse, *consts, *d, *dscore, mods=mods, scale=scale)  # noqa: E731
    return _core.jvp_along(at, (q, k, v, out, lse), along, moving)[1]


def _tangent_bwd_reference(q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation=None):
    """The vjp of :func:`tangent_at` in ``(q, k, v, out, lse)`` at the cotangents ``(g_dout, g_dlse)``."""
    consts, d, cts, dscore = second_order_operands(operands, mods, 2)
    at = lambda q, k, v, out, lse: tangent_at(q, k, v, out, lse, *consts, *d, *dscore, mods=mods, scale=scale)  # noqa: E731
    return jax.vjp(at, q, k, v, out, lse)[1](tuple(cts))


def _split_tangent_operands(operands, mods: Mods):
    n = mods.num_mask_consts + mods.num_score_consts
    return list(operands[:n]), list(operands[n:])


# ---------------------------------------------------------------------------------------------
# Shape rules.


def check_operands(fn: str, q, k, v, names: tuple[str, str, str] = ("q", "k", "v")):
    """Shapes and dtypes of q, k, v; raises naming the argument (as ``fn`` calls it: ``names``),
    what it got and what is accepted."""
    nq, nk, nv = names
    for name, x in zip(names, (q, k, v)):
        if x.ndim < 3:
            raise ValueError(f"{fn}: `{name}` must have rank >= 3 (..., seq, heads, head_dim), got shape {x.shape}")
        if x.dtype not in [np.dtype(d) for d in ACCEPTED_DTYPES]:
            raise TypeError(
                f"{fn}: `{name}` has dtype {x.dtype}; accepted: bfloat16, float16, float32, float64"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{fn}: {nq}, {nk}, {nv} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        raise ValueError(
            f"{fn}: {nq}, {nk}, {nv} must share their batch dims, got {q.shape[:-3]}, {k.shape[:-3]}, {v.shape[:-3]}"
        )
    (_, hq, d), (skv, hkv, dk), (skv_v, hkv_v, _) = q.shape[-3:], k.shape[-3:], v.shape[-3:]
    if d != dk:
        raise ValueError(f"{fn}: {nq} and {nk} must share head_dim, got {nq} {q.shape} and {nk} {k.shape}")
    if (skv, hkv) != (skv_v, hkv_v):
        raise ValueError(f"{fn}: {nk} and {nv} must share (seq, heads), got {nk} {k.shape} and {nv} {v.shape}")
    if (hq % hkv if hkv else hq):  # no k/v heads only for no query heads (an empty call)
        raise ValueError(
            f"{fn}: the number of query heads must be a multiple of the key/value heads (GQA), "
            f"got {nq} heads {hq} and {nk}/{nv} heads {hkv}"
        )


def _output_avals(fn, q, k, v, outputs):
    """Outputs ``(shape, dtype, heads dim)``, partitioned along batch and heads like q, k, v."""
    heads = ("heads", {"q": -2, "k": -2, "v": -2})
    hint = "; of the core dims, only the heads and the sequences may be split (jf.attention gathers k's and v's)"
    return _core.batch_sharded_avals(fn, {"q": q, "k": k, "v": v}, q.ndim - 3, outputs, split=heads, hint=hint)


def _fwd_abstract_eval(q, k, v, *consts, mods: Mods, scale: float, max_scores: bool, first_keys: bool, implementation):
    check_operands("attention", q, k, v)
    if first_keys and not max_scores:
        raise ValueError("attention_fwd_p: first_keys=True needs max_scores=True (the first key attaining each row's maximum)")
    *batch, sq, hq, _ = q.shape
    row = ((*batch, sq, hq), lse_dtype(q.dtype), -1)
    rows = [row] + [row] * max_scores + [(row[0], np.int32, -1)] * first_keys  # lse, the maxima, their first keys
    return _output_avals("attention", q, k, v, [((*batch, sq, hq, v.shape[-1]), q.dtype, -2), *rows])


def _tangent_abstract_eval(q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation):
    check_operands("attention_tangent", q, k, v)
    return _output_avals("attention_tangent", q, k, v, [(out.shape, out.dtype, -2), (lse.shape, lse.dtype, -1)])


def _bwd_abstract_eval(q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, implementation):
    check_operands("attention_bwd", q, k, v)
    _, score_c = _split(operands[:-2], mods)
    grads = _output_avals("attention_bwd", q, k, v, [(x.shape, x.dtype, -2) for x in (q, k, v)])
    # A captured array's cotangent sums over every batch item and head: replicated.
    replicated = NamedSharding(q.sharding.mesh, PartitionSpec())
    consts = [
        _core.output_aval(c, c.shape, c.dtype, replicated)
        for c, wanted in zip(float_consts(score_c), const_grads)
        if wanted
    ]
    return (*grads, *consts)


def _bwd_tangent_abstract_eval(q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, moving, implementation):
    return _bwd_abstract_eval(q, k, v, out, lse, *operands[:-7], mods=mods, scale=scale, const_grads=const_grads, implementation=implementation)


def _tangent2_abstract_eval(q, k, v, out, lse, *operands, mods: Mods, scale: float, moving, implementation):
    check_operands("attention_tangent2", q, k, v)
    return _output_avals("attention_tangent2", q, k, v, [(out.shape, out.dtype, -2), (lse.shape, lse.dtype, -1)])


def _tangent_bwd_abstract_eval(q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation):
    check_operands("attention_tangent_bwd", q, k, v)
    grads = [(x.shape, x.dtype, -2) for x in (q, k, v, out)] + [(lse.shape, lse.dtype, -1)]
    return _output_avals("attention_tangent_bwd", q, k, v, grads)


def shared_operands(leading: int, trailing_split: int):
    """Which operands every shard needs whole, for a primitive whose operands are ``leading`` split
    arrays (q, k, v, ...), the captured consts, ``trailing_split`` split arrays, then the consts'
    tangents. Masks and score mods read their captured arrays at global batch and head indices."""

    def flags(num_operands: int, *, mods: Mods, **params) -> list[bool]:
        n_consts = mods.num_mask_consts + mods.num_score_consts
        rest = num_operands - leading - n_consts - trailing_split
        return [False] * leading + [True] * n_consts + [False] * trailing_split + [True] * rest

    return flags


# ---------------------------------------------------------------------------------------------
# Derivative rules.


def _fwd_jvp(primals, tangents, *, mods: Mods, scale: float, max_scores: bool, first_keys: bool, implementation):
    params = dict(mods=mods, scale=scale, implementation=implementation)
    q, k, v, *consts = primals
    out, lse, *top = attention_fwd_p.bind(*primals, max_scores=max_scores, first_keys=max_scores, **params)
    out, lse = _core.named_residuals((out, lse), RESIDUAL_NAMES)
    _, score_c = _split(consts, mods)
    _, dscore = _split(tangents[3:], mods)
    dscore = [_core.instantiate_zeros(t) for t, c in zip(dscore, score_c) if jnp.issubdtype(c.dtype, jnp.inexact)]
    dq, dk, dv = (_core.instantiate_zeros(t) for t in tangents[:3])
    dout, dlse = attention_tangent_p.bind(q, k, v, out, lse, *consts, dq, dk, dv, *dscore, **params)
    if not max_scores:
        return (out, lse), (dout, dlse)
    top, first = top
    dtop = _max_score_tangent(q, k, consts, top, first, dq, dk, dscore, mods=mods, scale=scale)
    if not first_keys:
        return (out, lse, top), (dout, dlse, dtop)
    return (out, lse, top, first), (dout, dlse, dtop, _core.zero_tangent(first))


def _fwd_transpose(cts, q, k, v, *consts, mods: Mods, scale: float, max_scores: bool, first_keys: bool, implementation):
    """``out = p v`` is linear in ``v`` (the lse and the maxima do not move with it), so where
    ``v`` alone is a linear input (``jax.linear_transpose`` in ``v``; a custom JVP rule whose
    tangent is an attention of a tangent ``v``, differentiated) its cotangent is the backward's
    ``g_v = p^T g_o``, which reads neither ``v`` nor ``out``: both go in as zeros."""
    nonlinear = [name for name, x in (("q", q), ("k", k)) if _core.is_linear_input(x)]
    nonlinear += ["the arrays a mask or score mod closes over"] * any(_core.is_linear_input(c) for c in consts)
    if nonlinear:
        raise NotImplementedError(f"attention: its output is linear in v, not in {' or '.join(nonlinear)}: it cannot be transposed in them")
    if _core.is_symbolic_zero(cts[0]):
        return [None] * (3 + len(consts))
    zeros_v = _core.zeros(v.aval)
    zero_out, lse = attention_fwd_p.bind(q, k, zeros_v, *consts, mods=mods, scale=scale, max_scores=False, first_keys=False, implementation=implementation)
    _, score_c = _split(consts, mods)
    _, _, gv, *_ = attention_bwd_p.bind(
        q, k, zeros_v, zero_out, lse, *consts, _core.instantiate_zeros(cts[0]), jnp.zeros_like(lse),
        mods=mods, scale=scale, const_grads=(False,) * len(float_consts(score_c)), implementation=implementation,
    )  # fmt: skip
    return [None, None, gv] + [None] * len(consts)


def _fwd_known_outputs(operands, avals, *, mods: Mods, scale: float, max_scores: bool, first_keys: bool, implementation):
    """Where ``v`` alone is unknown (``jax.linear_transpose`` in ``v``), the lse and the maxima, which
    do not move with it, stay known: computed with zeros for ``v`` (the output is left to the staged
    forward). Sinks and a mask's pieces, merged through the lse, then stay linear in ``v``."""
    q, k, v, *consts = operands
    if v is not None or any(x is None for x in (q, k, *consts)):
        return [None] * (2 + max_scores + first_keys)
    zeros_v = _core.zeros(avals[2])
    _, *rest = attention_fwd_p.bind(
        q, k, zeros_v, *consts, mods=mods, scale=scale, max_scores=max_scores, first_keys=first_keys, implementation=implementation
    )
    return [None, *rest]


def _fwd_fewer_outputs(used, *, max_scores: bool, first_keys: bool, **params):
    """A forward without the first keys, or the maxima, where none uses them (dead-code
    elimination: the JVP binds the first keys, which a gradient whose maxima are auxiliary never
    reads). Returns its params and which outputs it keeps."""
    first_keys = first_keys and used[3]
    max_scores = max_scores and (used[2] or first_keys)
    kept = [True, True] + [max_scores] * (len(used) > 2) + [first_keys] * (len(used) > 3)
    return dict(params, max_scores=max_scores, first_keys=first_keys), kept


def _max_score_tangent(q, k, consts, top, first, dq, dk, dscore, *, mods: Mods, scale: float):
    """The tangent of each row's largest score: ``ds_{i, first_i}``, the score's tangent at the first
    key attaining it (one key a row: O(S·D), linear in ``dq``, ``dk`` and the float score consts'
    tangents); 0 where the row sees no key."""
    if 0 in (k.shape[-3], *top.shape):  # no key, or no row (symbolic dims compare, never bool())
        return jnp.zeros_like(top)
    at = lambda *args: _max_score_tangent_at(*args, mods=mods, scale=scale)  # noqa: E731
    return _core.under_automatic_axes(at, top, q, k, consts, top, first, dq, dk, dscore)  # its gathers


def _max_score_tangent_at(q, k, consts, top, first, dq, dk, dscore, *, mods: Mods, scale: float):
    *batch, sq, hq, _ = q.shape
    _, score_c = _split(consts, mods)
    bsz, group = math.prod(batch), hq // k.shape[-2]
    flat = lambda x: x.reshape(bsz, *x.shape[len(batch) :])  # noqa: E731
    b, i, h = (jax.lax.broadcasted_iota(jnp.int32, (bsz, sq, hq), axis) for axis in range(3))
    j = flat(first)
    by_group = j.reshape(bsz, sq, hq // group, group, 1)  # query head h reads kv head h // group

    def at_first(x):  # (B, Sq, Hq, D): each row's key, gathered along the keys alone (batch-parallel)
        return jnp.take_along_axis(flat(x)[:, :, :, None], by_group, axis=1).reshape(bsz, sq, hq, x.shape[-1])

    dot = lambda a, c: jnp.einsum("bqhd,bqhd->bqh", a, c, precision="highest", preferred_element_type=accumulation_dtype(q.dtype))  # noqa: E731
    raw = dot(flat(q), at_first(k)) * scale
    draw = (dot(flat(dq), at_first(k)) + dot(flat(q), at_first(dk))) * scale
    modify = lambda raw, floats: mods.modify(raw, b, h, i, j, with_floats(score_c, floats))  # noqa: E731
    _, ds = jax.jvp(modify, (raw, float_consts(score_c)), (draw, list(dscore)))
    return jnp.where(jnp.isfinite(flat(top)), ds, 0).astype(top.dtype).reshape(top.shape)


def _tangent_transpose(cts, q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation):
    consts, tangents = _split_tangent_operands(operands, mods)
    g_out, g_lse = (_core.instantiate_zeros(c) for c in cts)
    const_grads = tuple(_core.is_linear_input(t) for t in tangents[3:])
    gq, gk, gv, *gscore = attention_bwd_p.bind(
        q, k, v, out, lse, *consts, g_out, g_lse,
        mods=mods, scale=scale, const_grads=const_grads, implementation=implementation,
    )  # fmt: skip
    gscore = iter(gscore)
    grads = [gq, gk, gv] + [next(gscore) if wanted else None for wanted in const_grads]
    grads = [g if _core.is_linear_input(t) else None for g, t in zip(grads, tangents)]
    return [None] * (5 + len(consts)) + grads


def _as_direction(cts, consts, mods: Mods, const_grads) -> list:
    """Cotangents of the backward's outputs ``(gq, gk, gv, wanted score-const grads)`` as a direction
    of the tangent map: ``[dq, dk, dv, every float score const's tangent]`` (zeros where unwanted)."""
    _, score_c = _split(consts, mods)
    cts = iter(_core.instantiate_zeros(c) for c in cts)
    dq, dk, dv = next(cts), next(cts), next(cts)
    d_score = [next(cts) if wanted else jnp.zeros_like(f) for f, wanted in zip(float_consts(score_c), const_grads)]
    return [dq, dk, dv, *d_score]


def _score_consts_move(primals, tangents, mods: Mods) -> bool:
    """Whether a float score const (after the five leading operands) has a nonzero tangent."""
    first, stop = 5 + mods.num_mask_consts, 5 + mods.num_mask_consts + mods.num_score_consts
    pairs = zip(primals[first:stop], tangents[first:stop])
    return any(jnp.issubdtype(c.dtype, jnp.inexact) and not _core.is_symbolic_zero(t) for c, t in pairs)


def _bwd_transpose(cts, q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, implementation):
    *consts, g_out, g_lse = operands
    dout, dlse = attention_tangent_p.bind(
        q, k, v, out, lse, *consts, *_as_direction(cts, consts, mods, const_grads),
        mods=mods, scale=scale, implementation=implementation,
    )  # fmt: skip
    return [None] * (5 + len(consts)) + [dout if _core.is_linear_input(g_out) else None,
                                          dlse if _core.is_linear_input(g_lse) else None]  # fmt: skip


def _bwd_jvp(primals, tangents, *, mods: Mods, scale: float, const_grads, implementation):
    """The backward's derivative in every operand (a Hessian-vector product, forward over reverse) is
    attention_bwd_tangent: forward mode through the backward's tiles, O(S) memory. Where the float
    score consts themselves move, the dense reference's derivative."""
    params = dict(mods=mods, scale=scale, const_grads=const_grads, implementation=implementation)
    if _score_consts_move(primals, tangents, mods):
        return _reference_jvp(_bwd_reference)(primals, tangents, **params)
    n = mods.num_mask_consts + mods.num_score_consts
    along = (*tangents[:5], *tangents[5 + n :])
    outs = attention_bwd_p.bind(*primals, **params)
    if not any(moving := _core.moving_tangents(along)):  # only integer mask consts moved
        return outs, [_core.zero_tangent(x) for x in outs]
    along = [_core.instantiate_zeros(t) for t in along]
    return outs, attention_bwd_tangent_p.bind(*primals, *along, moving=moving, **params)


def _bwd_tangent_transpose(cts, q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, moving, implementation):
    """Reverse over reverse, in the first-order primitives' tiles. With ``φ(x, d, g) = ⟨g, T(x; d)⟩``,
    ``T`` the tangent map (linear in ``d``), the backward is ``∂φ/∂d``, so the pairing of cotangents
    ``c`` with its jvp along ``(ẋ, ġ)`` is ``∂φ/∂x(x, c, g)·ẋ + ⟨ġ, T(x; c)⟩``: the cotangent of
    ``x = (q, k, v, out, lse)`` is attention_tangent_bwd at ``(d, g) = (c, g)``, that of ``g``
    attention_tangent along ``c``."""
    params = dict(mods=mods, scale=scale, implementation=implementation)
    n = mods.num_mask_consts + mods.num_score_consts
    consts, (g_out, g_lse), along = list(operands[:n]), operands[n : n + 2], operands[n + 2 :]
    c = _as_direction(cts, consts, mods, const_grads)
    linear = [_core.is_linear_input(t) for t in along]
    grads = [None] * 7
    if any(linear[:5]):
        grads[:5] = attention_tangent_bwd_p.bind(q, k, v, out, lse, *consts, *c[:3], g_out, g_lse, *c[3:], **params)
    if any(linear[5:]):
        grads[5:] = attention_tangent_p.bind(q, k, v, out, lse, *consts, *c, **params)
    return [None] * (5 + n + 2) + [g if wanted else None for g, wanted in zip(grads, linear)]


def _tangent_jvp(primals, tangents, *, mods: Mods, scale: float, implementation):
    """The tangent map is linear in (dq, dk, dv, score-const tangents): its own kernel takes their
    tangents; its derivative in (q, k, v, out, lse) is attention_tangent2, whose transpose (a
    grad through a jvp) runs in O(S) memory. Where the float score consts themselves move, the
    dense reference's derivative."""
    params = dict(mods=mods, scale=scale, implementation=implementation)
    if _score_consts_move(primals, tangents, mods):
        return _reference_jvp(_tangent_reference)(primals, tangents, **params)
    n = mods.num_mask_consts + mods.num_score_consts
    q, k, v, out, lse, *operands = primals
    consts, d = operands[:n], operands[n:]  # d: dq, dk, dv and the float score consts' tangents
    outs = attention_tangent_p.bind(*primals, **params)
    along_x, along_d = tangents[:5], tangents[5 + n :]
    terms = []  # each skipped where its direction is a symbolic zero (jvp of a jvp: d's tangent)
    if any(moving := _core.moving_tangents(along_x)):
        along_x = [_core.instantiate_zeros(t) for t in along_x]
        terms.append(attention_tangent2_p.bind(q, k, v, out, lse, *consts, *d[:3], *along_x, *d[3:], moving=moving, **params))
    if any(_core.moving_tangents(along_d)):
        along_d = [_core.instantiate_zeros(t) for t in along_d]
        terms.append(attention_tangent_p.bind(q, k, v, out, lse, *consts, *along_d, **params))
    if not terms:  # only integer mask consts moved
        return outs, [_core.zero_tangent(x) for x in outs]
    return outs, [sum(parts[1:], parts[0]) for parts in zip(*terms)]


def _tangent2_transpose(cts, q, k, v, out, lse, *operands, mods: Mods, scale: float, moving, implementation):
    consts, d, along, dscore = second_order_operands(operands, mods, 5)
    g_dout, g_dlse = (_core.instantiate_zeros(c) for c in cts)
    grads = attention_tangent_bwd_p.bind(
        q, k, v, out, lse, *consts, *d, g_dout, g_dlse, *dscore, mods=mods, scale=scale, implementation=implementation
    )
    linear = [g if _core.is_linear_input(t) else None for g, t in zip(grads, along)]
    return [None] * (5 + len(consts) + 3) + linear + [None] * len(dscore)


def _tangent_bwd_transpose(cts, q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation):
    consts, d, (g_dout, g_dlse), dscore = second_order_operands(operands, mods, 2)
    if not any(moving := _core.moving_tangents(cts)):
        return [None] * (5 + len(operands))
    along = [_core.instantiate_zeros(c) for c in cts]
    dout, dlse = attention_tangent2_p.bind(
        q, k, v, out, lse, *consts, *d, *along, *dscore, mods=mods, scale=scale, moving=moving, implementation=implementation
    )
    linear = [dout if _core.is_linear_input(g_dout) else None, dlse if _core.is_linear_input(g_dlse) else None]
    return [None] * (5 + len(consts) + 3) + linear + [None] * len(dscore)


def _reference_jvp(reference):
    """Second-order rules: differentiate the dense reference (correct, not fast)."""

    def jvp(primals, tangents, **params):
        return _core.jvp_in_floats(lambda *args: reference(*args, **params), primals, tangents)

    return jvp


# ---------------------------------------------------------------------------------------------
# Batching: vmapped axes become one more leading batch dim; consts keep theirs and are indexed
# through Mods.vmapped, so nothing loops.


def _batch_rule(n_leading: int, n_trailing: int):
    """``n_leading`` operands before the consts and ``n_trailing`` after carry the batch dims."""

    def rule(prim, args, dims, *, mods: Mods, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        n_mask, n_score = mods.num_mask_consts, mods.num_score_consts
        head, mask_c, score_c, tail = (
            args[:n_leading],
            args[n_leading : n_leading + n_mask],
            args[n_leading + n_mask : n_leading + n_mask + n_score],
            args[n_leading + n_mask + n_score :],
        )
        head_d, mask_d, score_d, tail_d = (
            dims[:n_leading],
            dims[n_leading : n_leading + n_mask],
            dims[n_leading + n_mask : n_leading + n_mask + n_score],
            dims[n_leading + n_mask + n_score :],
        )
        # A score const is batched if it or its tangent is; bwd makes per-item cotangents of every
        # const whose gradient is wanted, so those are batched too.
        float_idx = [i for i, c in enumerate(score_c) if jnp.issubdtype(c.dtype, jnp.inexact)]
        score_batched = [d is not None for d in score_d]
        if prim in (attention_tangent_p, attention_tangent2_p, attention_tangent_bwd_p):
            for i, d in zip(float_idx, tail_d[n_trailing:]):
                score_batched[i] |= d is not None
        if prim in (attention_bwd_p, attention_bwd_tangent_p):
            for i, wanted in zip(float_idx, params["const_grads"]):
                score_batched[i] |= wanted

        def front(x, d, batched=True):
            if d is not None:
                return jnp.moveaxis(x, d, 0)
            return jnp.broadcast_to(x, (size, *x.shape)) if batched else x

        q_batch = _batch_shape(args[0], dims[0])
        new_mods = mods.vmapped(math.prod(q_batch), [d is not None for d in mask_d], score_batched)
        moved = (
            [front(x, d) for x, d in zip(head, head_d)]
            + [front(x, d, batched=d is not None) for x, d in zip(mask_c, mask_d)]
            + [front(x, d, batched=b) for x, d, b in zip(score_c, score_d, score_batched)]
            + [front(x, d) for x, d in zip(tail[:n_trailing], tail_d[:n_trailing])]
            # the tangent primitive's trailing operands: tangents of the float consts, batched with them
            + [front(x, d, batched=score_batched[i]) for x, d, i in zip(tail[n_trailing:], tail_d[n_trailing:], float_idx)]
        )
        outs = prim.bind(*moved, mods=new_mods, **params)
        return outs, [0] * len(outs)

    return rule


def _batch_shape(q, dim):
    """The batch dims of ``q`` without the vmapped axis."""
    shape = list(q.shape)
    if dim is not None:
        del shape[dim]
    return shape[:-3]


# ---------------------------------------------------------------------------------------------


def _example_args():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 3))
    k = rng.standard_normal((2, 7, 2, 3))
    v = rng.standard_normal((2, 7, 2, 2))
    return q, k, v


def _example_tangent_args():
    q, k, v = _example_args()
    out, lse = attention_reference(q, k, v, mods=Mods(), scale=0.5)
    return q, k, v, out, lse, q, k, v


def _example_bwd_args():
    q, k, v, out, lse, *_ = _example_tangent_args()
    return q, k, v, out, lse, out, lse


def _example_bwd_tangent_args():
    q, k, v, out, lse, g_out, g_lse = _example_bwd_args()
    return q, k, v, out, lse, g_out, g_lse, 0.5 * q, -k, v, out, 2.0 * lse, -g_out, g_lse


def _example_tangent2_args():
    q, k, v, out, lse, *_ = _example_tangent_args()
    return q, k, v, out, lse, q, k, v, q, k, v, out, lse


def _example_tangent_bwd_args():
    q, k, v, out, lse, *_ = _example_tangent_args()
    return q, k, v, out, lse, q, k, v, out, lse


_TEST_MODULE = "tests/primitives/attention/test_attention.py"
_COMMON = dict(test_module=_TEST_MODULE, bench_entry="attention/attention")

attention_fwd_p = _core.define_primitive(
    "jaxforge_attention_fwd",
    abstract_eval=_fwd_abstract_eval,
    jvp=_fwd_jvp,
    transpose=_fwd_transpose,
    reference=attention_reference,
    example_args=_example_args,
    example_params=dict(mods=Mods(), scale=0.5, max_scores=False, first_keys=False, implementation=Implementation()),
    batch=_batch_rule(3, 0),
    dce=_fwd_fewer_outputs,
    known_outputs=_fwd_known_outputs,
    **_COMMON,
)
attention_tangent_p = _core.define_primitive(
    "jaxforge_attention_tangent",
    abstract_eval=_tangent_abstract_eval,
    jvp=_tangent_jvp,
    transpose=_tangent_transpose,
    reference=_tangent_reference,
    example_args=_example_tangent_args,
    example_params=dict(mods=Mods(), scale=0.5, implementation=Implementation()),
    batch=_batch_rule(5, 3),
    **_COMMON,
)
attention_bwd_p = _core.define_primitive(
    "jaxforge_attention_bwd",
    abstract_eval=_bwd_abstract_eval,
    jvp=_bwd_jvp,
    transpose=_bwd_transpose,
    reference=_bwd_reference,
    example_args=_example_bwd_args,
    example_params=dict(mods=Mods(), scale=0.5, const_grads=(), implementation=Implementation()),
    batch=_batch_rule(5, 2),
    **_COMMON,
)
# Second order. The backward's derivative (forward over reverse: a Hessian-vector product), in its
# tiles (O(S) memory), and its transpose (reverse over reverse), in the tangent's and tangent_bwd's;
# third order forward through it, dense.
attention_bwd_tangent_p = _core.define_primitive(
    "jaxforge_attention_bwd_tangent",
    abstract_eval=_bwd_tangent_abstract_eval,
    jvp=_reference_jvp(_bwd_tangent_reference),
    transpose=_bwd_tangent_transpose,
    reference=_bwd_tangent_reference,
    example_args=_example_bwd_tangent_args,
    example_params=dict(mods=Mods(), scale=0.5, const_grads=(), moving=(True,) * 7, implementation=Implementation()),
    batch=_batch_rule(5, 9),
    **_COMMON,
)
# The tangent map's derivative in (q, k, v, out, lse) (a jvp of a jvp) and its transpose (a grad
# through a jvp), both in XLA's tiles (O(S) memory); third order through them, dense.
attention_tangent2_p = _core.define_primitive(
    "jaxforge_attention_tangent2",
    abstract_eval=_tangent2_abstract_eval,
    jvp=_reference_jvp(_tangent2_reference),
    transpose=_tangent2_transpose,
    reference=_tangent2_reference,
    example_args=_example_tangent2_args,
    example_params=dict(mods=Mods(), scale=0.5, moving=(True,) * 5, implementation=Implementation()),
    batch=_batch_rule(5, 8),
    **_COMMON,
)
attention_tangent_bwd_p = _core.define_primitive(
    "jaxforge_attention_tangent_bwd",
    abstract_eval=_tangent_bwd_abstract_eval,
    jvp=_reference_jvp(_tangent_bwd_reference),
    transpose=_tangent_bwd_transpose,
    reference=_tangent_bwd_reference,
    example_args=_example_tangent_bwd_args,
    example_params=dict(mods=Mods(), scale=0.5, implementation=Implementation()),
    batch=_batch_rule(5, 5),
    **_COMMON,
)
