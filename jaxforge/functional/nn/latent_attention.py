"""Multi-head latent attention (DeepSeek-V2/V3's MLA) on :func:`jf.attention <jaxforge.attention>`:
keys and values decompressed from one low-rank latent per token, so a decoding cache holds that
latent and one shared rotary key, ``kv_rank + rope_dim`` numbers a token for every head.

Training (no cache) attends ``H`` heads of query/key dim ``nope_dim + rope_dim`` and value dim
``v_dim`` (192 and 128 in DeepSeek-V3). Decoding absorbs the key up-projection into the queries
and attends the latent cache as one key/value head (MQA) of key dim ``kv_rank + rope_dim`` and
value dim ``kv_rank`` (576 and 512), then applies the value up-projection to the output: the same
scores and output, with no key or value expanded.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float, Int, PRNGKeyArray

from jaxforge.functional import masks
from jaxforge.functional._static import static_bool
from jaxforge.functional.attention import attention
from jaxforge.functional.nn.attention import cache_positions, rotary_embedding, written_at
from jaxforge.functional.nn.layers import Params, check_features, rms_norm

__all__ = ["init_latent_cache", "init_multi_head_latent_attention", "multi_head_latent_attention"]


def init_multi_head_latent_attention(
    key: PRNGKeyArray,
    features: int,
    num_heads: int,
    *,
    kv_rank: int,
    q_rank: int | None = None,
    nope_dim: int = 128,
    rope_dim: int = 64,
    v_dim: int = 128,
    dtype=jnp.float32,
) -> Params:
    r"""Params of :func:`multi_head_latent_attention`, each projection :math:`\mathcal N(0, 1/\text{fan-in})`:

    * queries: ``q`` (features, H, nope_dim + rope_dim), or with ``q_rank`` the low-rank pair
      ``q_down`` (features, q_rank), ``q_norm`` (q_rank,) and ``q_up`` (q_rank, H, nope_dim + rope_dim);
    * keys and values: ``kv_down`` (features, kv_rank + rope_dim): each token's latent ``c`` and its
      shared rotary key; ``kv_norm`` (kv_rank,), the latent's RMS-norm scale; ``k_up`` (kv_rank, H,
      nope_dim) and ``v_up`` (kv_rank, H, v_dim);
    * ``o`` (H, v_dim, features).

    DeepSeek-V3: features 7168, 128 heads, ``kv_rank=512, q_rank=1536``, the dims' defaults.
    """
    dims = dict(features=features, num_heads=num_heads, kv_rank=kv_rank, nope_dim=nope_dim, v_dim=v_dim)
    bad = {name: n for name, n in dims.items() if not (isinstance(n, int) and n > 0)}
    if not (isinstance(rope_dim, int) and rope_dim >= 0 and rope_dim % 2 == 0):
        bad["rope_dim"] = rope_dim
    if q_rank is not None and not (isinstance(q_rank, int) and q_rank > 0):
        bad["q_rank"] = q_rank
    if bad:
        raise ValueError(f"init_multi_head_latent_attention: dims must be positive ints (rope_dim even, >= 0; q_rank None or positive), got {bad}")
    keys = iter(jax.random.split(key, 6))

    def normal(shape, fan_in):
        return jax.random.normal(next(keys), shape, dtype) / math.sqrt(fan_in)

    qk_dim = nope_dim + rope_dim
    if q_rank is None:
        queries = {"q": normal((features, num_heads, qk_dim), features)}
    else:
        queries = {"q_down": normal((features, q_rank), features), "q_norm": jnp.ones((q_rank,), dtype), "q_up": normal((q_rank, num_heads, qk_dim), q_rank)}
    return queries | {
        "kv_down": normal((features, kv_rank + rope_dim), features),
        "kv_norm": jnp.ones((kv_rank,), dtype),
        "k_up": normal((kv_rank, num_heads, nope_dim), kv_rank),
        "v_up": normal((kv_rank, num_heads, v_dim), kv_rank),
        "o": normal((num_heads, v_dim, features), num_heads * v_dim),
    }


def init_latent_cache(params: Params, batch_shape: tuple[int, ...], max_len: int, *, dtype=None) -> Params:
    """An empty decoding cache of :func:`multi_head_latent_attention`: ``latent`` zeros ``(*batch_shape,
    max_len, 1, kv_rank + rope_dim)`` (each token's normalised latent and its rotated shared key;
    params stacked over layers give one per layer, leading) and ``length``, int32 zeros
    ``batch_shape``. ``dtype`` defaults to the params'."""
    *layers, _, width = params["kv_down"].shape
    dtype = params["kv_down"].dtype if dtype is None else dtype
    return {"latent": jnp.zeros((*layers, *batch_shape, max_len, 1, width), dtype), "length": jnp.zeros(batch_shape, jnp.int32)}


def multi_head_latent_attention(
    params: Params,
    x: Float[ArrayLike, "*batch seq features"],
    *,
    mask=None,
    positions: Int[ArrayLike, "*#batch seq"] | None = None,
    rotary_base: float = 10000.0,
    attention_fn: Callable = attention,
    cache: Params | None = None,
    return_max_scores: bool = False,
):
    r"""Self-attention through a latent :math:`c = \operatorname{rms}(x W^{dkv})`: head ``h`` attends
    :math:`q_h = [x W^q_h;\ R x W^{qr}_h]` to keys :math:`[c W^{uk}_h;\ R x W^{kr}]` (the rotary
    part shared by the heads) and values :math:`c W^{uv}_h`, scale :math:`1/\sqrt{d_{nope} + d_{rope}}`.

    Args:
      params: from :func:`init_multi_head_latent_attention`.
      x: ``(..., seq, features)``.
      mask: any ``mask=`` of :func:`jf.attention <jaxforge.attention>`.
      positions: ``(..., seq)`` positions for the rotary parts (default ``arange(seq)``, with a
        cache ``length + arange(seq)``).
      rotary_base: the rotary base.
      attention_fn: ``attention_fn(q, k, v, mask=mask, scale=scale)``; :func:`jf.attention` by default.
      cache: decoding (:func:`init_latent_cache`), as :func:`multi_head_attention`'s: ``x`` is the
        next ``seq`` tokens of each item, their latents go into the cache at the item's ``length``,
        and the queries, the key up-projection absorbed into them, attend the cache as one
        key/value head (``mask``'s ``kv_idx`` counts the cache's positions); an item that outgrows
        the cache gets NaN outputs.
      return_max_scores: also each head's largest logit over the batch and the rows, ``(H,)``
        (the same with a cache or without): what :func:`qk_clip` bounds (Kimi K2's MuonClip on MLA).

    Returns:
      ``(..., seq, features)``; with a cache, ``(output, cache)``; with ``return_max_scores``, the
      logits' maxima after them.
    """
    return_max_scores = static_bool("multi_head_latent_attention", "return_max_scores", return_max_scores)
    maxima = {"return_max_scores": True} if return_max_scores else {}
    nope_dim, kv_rank, width = params["k_up"].shape[-1], params["k_up"].shape[0], params["kv_down"].shape[-1]
    x = check_features("multi_head_latent_attention", "x", x, params["kv_down"].shape[0])
    if "q" in params:
        q = jnp.einsum("...sf,fhd->...shd", x, params["q"])
    else:
        q_latent = rms_norm({"scale": params["q_norm"]}, x @ params["q_down"])
        q = jnp.einsum("...sr,rhd->...shd", q_latent, params["q_up"])
    if cache is not None:
        length, max_len = cache["length"], cache["latent"].shape[-3]
        positions = cache_positions("multi_head_latent_attention", length, max_len, x, positions)
    elif positions is None:
        positions = jnp.arange(x.shape[-2])
    q_nope, q_rope = q[..., :nope_dim], rotary_embedding(q[..., nope_dim:], positions, base=rotary_base)
    latent = x @ params["kv_down"]  # (..., seq, kv_rank + rope_dim)
    c = rms_norm({"scale": params["kv_norm"]}, latent[..., :kv_rank])
    k_rope = rotary_embedding(latent[..., None, kv_rank:], positions, base=rotary_base)  # one head, shared
    scale = 1 / math.sqrt(nope_dim + width - kv_rank)
    if cache is None:
        k_nope = jnp.einsum("...sr,rhd->...shd", c, params["k_up"])
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], k_rope.shape[-1]))], axis=-1)
        v = jnp.einsum("...sr,rhd->...shd", c, params["v_up"])
        out = attention_fn(jnp.concatenate([q_nope, q_rope], axis=-1), k, v, mask=mask, scale=scale, **maxima)
    else:
        written = written_at(cache["latent"], jnp.concatenate([c[..., None, :], k_rope], axis=-1), length)
        cache = {"latent": written, "length": length + x.shape[-2]}
        keys = written.astype(q.dtype)  # a cache may store another dtype (init_latent_cache)
        absorbed = jnp.einsum("...shd,rhd->...shr", q_nope, params["k_up"])  # q_nope · (c W^uk) = (q_nope W^ukᵀ) · c
        visible = masks.causal(length) if mask is None else masks.causal(length) & mask
        out = attention_fn(jnp.concatenate([absorbed, q_rope], axis=-1), keys, keys[..., :kv_rank], mask=visible, scale=scale, **maxima)
    extra = []
    if return_max_scores:
        out, top = out
        extra.append(jnp.max(top, axis=tuple(range(top.ndim - 1)), initial=-jnp.inf))  # over the batch and rows
    if cache is not None:
        out = jnp.einsum("...shr,rhd->...shd", out, params["v_up"])
    out = jnp.einsum("...shd,hdf->...sf", out, params["o"])
    if cache is not None:
        overflows = cache["length"] > max_len  # tokens past the end went unwritten: the outputs are not this item's
        out, extra = jnp.where(overflows[..., None, None], jnp.nan, out), [cache, *extra]
    return (out, *extra) if extra else out
