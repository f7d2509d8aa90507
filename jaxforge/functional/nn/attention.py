"""Multi-head attention on :func:`jf.attention <jaxforge.attention>`: GQA, masks, rotary embedding,
and jax.nn.dot_product_attention's signature on it."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from jaxforge.functional import masks
from jaxforge.functional._static import static_bool
from jaxforge.functional.attention import attention, check_scalars, resolve_implementation
from jaxforge.functional.nn.layers import Params, at_least_float32, check_features
from jaxforge.primitives import _core
from jaxforge.primitives.attention.attention import check_operands

__all__ = ["dot_product_attention", "init_kv_cache", "init_multi_head_attention", "multi_head_attention", "rotary_embedding"]


def rotary_embedding(
    x: Float[ArrayLike, "*batch seq heads head_dim"], positions: Int[ArrayLike, "*#batch seq"], *, base: float = 10000.0
) -> Float[Array, "*batch seq heads head_dim"]:
    r"""Rotates feature pairs :math:`(x_i, x_{i+D/2})` by :math:`p\,\theta_i`, :math:`\theta_i = \text{base}^{-2i/D}`.

    So that :math:`\langle R_p q, R_{p'} k\rangle` depends on :math:`p - p'` only (RoFormer, 2021).
    Angles are computed in float32 or wider.
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"rotary_embedding: `x` needs an even head_dim, got shape {x.shape}")
    wide = at_least_float32(x.dtype)
    frequencies = base ** (-jnp.arange(0, head_dim, 2, dtype=wide) / head_dim)
    positions = jax.lax.broadcast_to_rank(jnp.asarray(positions, wide), x.ndim - 2)  # (..., seq), x's rank less two
    angles = positions[..., None, None] * jax.lax.broadcast_to_rank(frequencies, x.ndim)  # (..., seq, 1, D/2)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = jnp.split(x.astype(wide), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return rotated.astype(x.dtype)


def dot_product_attention(
    query: Float[ArrayLike, "*#batch q_len heads head_dim"],
    key: Float[ArrayLike, "*#batch kv_len kv_heads head_dim"],
    value: Float[ArrayLike, "*#batch kv_len kv_heads head_dim"],
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | ArrayLike | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, ...] | None = None,
    implementation=None,
    return_residual: bool = False,
):
    r""":math:`\operatorname{softmax}(\text{scale}\; QK^T + B)\, V` with jax.nn.dot_product_attention's
    arguments and results, on :func:`jf.attention <jaxforge.attention>`: swap the name, keep the call,
    and gain forward-mode derivatives, GPU kernels that skip the tiles the masks hide, and the
    bias's gradient in them.

    Args:
      query, key, value: ``(B, T, N, H)``, ``(B, S, K, H)``, ``(B, S, K, H)``, or without ``B``;
        ``N`` a multiple of ``K`` (GQA).
      bias: added to the scaled logits, up to 4-D, broadcasting to ``(B, N, T, S)``; differentiable.
        Split over an explicit mesh, it is gathered whole first.
      mask: boolean (True: visible), up to 4-D, broadcasting to ``(B, N, T, S)``.
      scale: default ``1/sqrt(H)``; traced (``1 / jnp.sqrt(H)`` under jit, a learned temperature)
        it multiplies ``query`` (:func:`jf.attention <jaxforge.attention>`'s ``scale``).
      is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as jax.nn).
      query_seq_lengths, key_value_seq_lengths: int32 ``(B,)``: positions past them are padding
        (a query's output 0).
      local_window_size: ``(left, right)``: query ``i`` sees keys ``i - left ... i + right``; an int
        ``w`` means ``(w, w)``.
      implementation: None (the platform's best), ``"xla"``, ``"pallas_triton"``,
        ``"pallas_mosaic_gpu"`` or a :class:`jf.attention.Implementation`; jax.nn's ``"cudnn"`` is
        jax.nn's own.
      return_residual: also return the log-sum-exp of each row, ``(B, T, N)`` (jax.nn's layout) in
        float32 (float64 for float64 input), differentiable.

    Returns:
      the output, the shape of ``query``; and the log-sum-exp with ``return_residual``.

    Where a row sees no key (a padded query, a key length of 0, a mask hiding the row) the output
    and its gradients are 0 and its log-sum-exp ``-inf``; jax.nn's ``xla`` gives the mean of the
    values over every key there (a padded query's output 0) and a finite log-sum-exp.
    """
    fn = "dot_product_attention"
    if implementation == "cudnn":
        raise ValueError(
            f"{fn}: implementation='cudnn' is jax.nn's; call jax.nn.dot_product_attention for it, or "
            "pass None, 'xla', 'pallas_triton' or 'pallas_mosaic_gpu'"
        )
    is_causal = static_bool(fn, "is_causal", is_causal)
    return_residual = static_bool(fn, "return_residual", return_residual)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = (x[None] for x in (query, key, value))
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{fn}: `{name}` must have shape (B, T|S, N|K, H) or (T|S, N|K, H), got shape {x.shape}")
    check_operands(fn, query, key, value, names=("query", "key", "value"))
    implementation = resolve_implementation(implementation, fn)
    check_scalars(fn, scale=scale)
    (batch, q_len, heads, _), kv_len = query.shape, key.shape[1]
    full = (batch, heads, q_len, kv_len)
    visible = [masks.from_array(_logits_shaped(fn, "mask", mask, full))] if mask is not None else []
    if is_causal:
        visible.append(masks.causal())
    if local_window_size is not None:
        left, right = _window(fn, local_window_size)
        visible.append(masks.causal(right) & ~masks.causal(-left - 1))
    q_lengths = _lengths(fn, "query_seq_lengths", query_seq_lengths, batch)
    kv_lengths = _lengths(fn, "key_value_seq_lengths", key_value_seq_lengths, batch)
    if q_lengths is not None or kv_lengths is not None:
        visible.append(masks.padding(kv_len if kv_lengths is None else kv_lengths, q_lengths))
    score_mod = None
    if bias is not None:
        # a score mod reads the bias at any point, which jax's sharding types refuse a split array:
        # gathered whole (its gradient split back by the transpose)
        bias = _core.gathered(_logits_shaped(fn, "bias", bias, full))

        def score_mod(score, b, h, i, j):  # a size-1 dim broadcasts: read at 0
            index = tuple(x if n > 1 else 0 for x, n in zip((b, h, i, j), bias.shape))
            return score + bias[index].astype(score.dtype)

    combined = functools.reduce(operator.and_, visible) if visible else None
    out = attention(query, key, value, mask=combined, score_mod=score_mod, scale=scale, return_lse=return_residual, implementation=implementation)
    if unbatched:
        out = jax.tree.map(lambda x: x[0], out)
    return out


def _logits_shaped(fn: str, name: str, x, full: tuple[int, ...]):
    """``x`` as jax.nn takes a mask or bias: up to 4-D (leading dims of 1 added), each dim 1 or
    ``full``'s (B, N, T, S)."""
    x = jnp.asarray(x)
    if name == "mask" and x.dtype != jnp.bool_:
        raise TypeError(f"{fn}: `mask` must be boolean (True: visible), got dtype {x.dtype}; an additive mask is a `bias`")
    if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: `bias` must be a float array, got dtype {x.dtype}")
    if x.ndim > 4 or any(n not in (1, f) for n, f in zip(x.shape[::-1], full[::-1])):
        raise ValueError(f"{fn}: `{name}` must broadcast to (B, N, T, S) = {full}, at most 4-D; got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _window(fn: str, size) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, int) else size
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in pair)):
        raise ValueError(f"{fn}: `local_window_size` must be an int >= 0 or a pair (left, right) of them, got {size!r}")
    return pair


def _lengths(fn: str, name: str, x, batch: int):
    if x is None:
        return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (batch,):
        raise ValueError(f"{fn}: `{name}` must be an integer array of shape ({batch},), got {x.dtype} {x.shape}")
    return x


def init_multi_head_attention(
    key: PRNGKeyArray,
    features: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    sinks: bool = False,
    dtype=jnp.float32,
) -> Params:
    r"""Params of :func:`multi_head_attention`: projections ``q`` (features, Hq, D), ``k``/``v``
    (features, Hkv, D), ``o`` (Hq, D, features), each :math:`\mathcal N(0, 1/\text{fan-in})`;
    with ``sinks``, ``sinks`` (Hq,) too: learned attention-sink logits (gpt-oss), from 0.

    The head counts live in the shapes, so the params describe the layer completely.
    ``num_kv_heads`` (default ``num_heads``) must divide ``num_heads``; ``head_dim`` defaults to
    ``features // num_heads``.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = features // num_heads if head_dim is None else head_dim
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"init_multi_head_attention: `num_heads` ({num_heads}) must be a positive multiple of "
            f"`num_kv_heads` ({num_kv_heads})"
        )
    if head_dim <= 0:
        raise ValueError(f"init_multi_head_attention: `head_dim` must be positive, got {head_dim}")
    kq, kk, kv, ko = jax.random.split(key, 4)

    def normal(key, shape, fan_in):
        return jax.random.normal(key, shape, dtype) / jnp.sqrt(fan_in).astype(dtype)

    params = {
        "q": normal(kq, (features, num_heads, head_dim), features),
        "k": normal(kk, (features, num_kv_heads, head_dim), features),
        "v": normal(kv, (features, num_kv_heads, head_dim), features),
        "o": normal(ko, (num_heads, head_dim, features), num_heads * head_dim),
    }
    return params | {"sinks": jnp.zeros((num_heads,), dtype)} if sinks else params


def init_kv_cache(params: Params, batch_shape: tuple[int, ...], max_len: int, *, dtype=None) -> Params:
    """An empty key/value cache of :func:`multi_head_attention` for decoding: ``k``, ``v`` zeros
    ``(*batch_shape, max_len, Hkv, D)`` (params ``k``/``v`` stacked over layers give one per layer,
    leading), and ``length``, int32 zeros ``batch_shape``: how many positions each item holds.
    ``dtype`` defaults to the params'."""
    *layers, _, hkv, d = params["k"].shape
    dtype = params["k"].dtype if dtype is None else dtype
    shape = (*layers, *batch_shape, max_len, hkv, d)
    # Two buffers, not one twice: a decoding step jitted with the cache donated gives up each once.
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "length": jnp.zeros(batch_shape, jnp.int32)}


def multi_head_attention(
    params: Params,
    x: Float[ArrayLike, "*batch seq features"],
    *,
    mask=None,
    positions: Int[ArrayLike, "*#batch seq"] | None = None,
    rotary_base: float | None = 10000.0,
    attention_fn: Callable = attention,
    cache: Params | None = None,
    return_max_scores: bool = False,
):
    r"""Self-attention :math:`\sum_h \operatorname{attn}(R x W^q_h, R x W^k_{g(h)}, x W^v_{g(h)})\, W^o_h`.

    Args:
      params: from :func:`init_multi_head_attention`; GQA when it has fewer k/v heads than q heads.
      x: ``(..., seq, features)``.
      mask: any ``mask=`` of :func:`jf.attention <jaxforge.attention>`, e.g.
        ``jf.masks.causal() & jf.masks.document(segment_ids)``.
      positions: ``(..., seq)`` token positions for the rotary embedding (default ``arange(seq)``,
        with a cache ``length + arange(seq)``).
      rotary_base: the rotary base; None for no rotary embedding.
      attention_fn: ``attention_fn(q, k, v, mask=mask)`` (and ``sinks=params["sinks"]`` where the
        params have sinks); :func:`jf.attention` by default. Swap in another implementation to
        compare against it.
      cache: decoding (:func:`init_kv_cache`): ``x`` is the next ``seq`` tokens of each item, its
        keys and values go into the cache at the item's ``length``, and its queries attend
        causally to the cache, ``jf.masks.causal(length)``, and ``mask``: its ``q_idx`` counts this
        call's tokens, its ``kv_idx`` the cache's positions (the last ``w`` keys:
        ``~jf.masks.causal(length - w)``). A batch of prompts of different lengths is prefilled
        padded, then ``length`` set to the true ones: the next steps overwrite the padding. An
        item whose tokens do not fit (``length + seq > max_len``) gets NaN outputs, at that step
        and after: the tokens past the cache's end are not written.
      return_max_scores: also each query head's largest attention logit over the batch and the
        rows, ``(Hq,)`` (``attention_fn`` called with ``return_max_scores=True``): what
        :func:`qk_clip` bounds. Inside a shard_map, this device's rows': all-reduce it (max).

    Returns:
      ``(..., seq, features)``; with a cache, ``(output, cache)``, the cache holding ``seq`` more;
      with ``return_max_scores``, the logits' maxima after them.
    """
    return_max_scores = static_bool("multi_head_attention", "return_max_scores", return_max_scores)
    x = check_features("multi_head_attention", "x", x, params["q"].shape[0])
    q, k, v = (jnp.einsum("...sf,fhd->...shd", x, params[name]) for name in "qkv")
    if cache is not None:
        length, max_len = cache["length"], cache["k"].shape[-3]
        positions = cache_positions("multi_head_attention", length, max_len, x, positions)
    if rotary_base is not None:
        if positions is None:
            positions = jnp.arange(x.shape[-2])
        q, k = (rotary_embedding(t, positions, base=rotary_base) for t in (q, k))
    if cache is not None:
        cache = {name: written_at(cache[name], new, length) for name, new in (("k", k), ("v", v))}
        k, v = (cache[name].astype(q.dtype) for name in "kv")  # a cache may store another dtype (init_kv_cache)
        mask = masks.causal(length) if mask is None else masks.causal(length) & mask
    kw = ({"sinks": params["sinks"]} if "sinks" in params else {}) | ({"return_max_scores": True} if return_max_scores else {})
    out = attention_fn(q, k, v, mask=mask, **kw)
    extra = []
    if return_max_scores:
        out, top = out
        extra.append(jnp.max(top, axis=tuple(range(top.ndim - 1)), initial=-jnp.inf))  # over the batch and rows
    out = jnp.einsum("...shd,hdf->...sf", out, params["o"])
    if cache is not None:
        length = length + x.shape[-2]
        overflows = length > max_len  # tokens past the end went unwritten: the outputs are not this item's
        out, extra = jnp.where(overflows[..., None, None], jnp.nan, out), [{**cache, "length": length}, *extra]
    return (out, *extra) if extra else out


def qk_clip(params: Params, max_scores: Float[ArrayLike, "*#layers heads"], threshold: float, *, alpha: float = 0.5) -> Params:
    r"""QK-clip (Kimi K2's MuonClip): each head's logits scaled by :math:`\gamma_h = \min(1,
    \tau / S_h)`, :math:`S_h` its largest logit (``max_scores``, from ``return_max_scores``),
    through its projections: :math:`W^k_g \mathrel{*}= \kappa_g = (\min_{h \in g} \gamma_h)^{1 -
    \alpha}` for key/value head :math:`g` (shared by its GQA group), :math:`W^q_h \mathrel{*}=
    \gamma_h / \kappa_g`; so :math:`q_h \cdot k_g` scales by exactly :math:`\gamma_h` (rotary
    embedding included) and a head under the threshold keeps its logits.

    ``params``: :func:`init_multi_head_attention`'s (leading dims, e.g. a transformer's blocks
    stacked over depth, matching those of ``max_scores``); returns them with ``q`` and ``k``
    rescaled. Applied after each optimiser step, as MuonClip does; not differentiated.

    :func:`init_multi_head_latent_attention`'s params (MLA, as Kimi K2 clips it): head ``h``'s
    own query and key parts (``q``'s or ``q_up``'s first ``nope_dim`` features, ``k_up``) scale by
    :math:`\sqrt{\gamma_h}` each, its rotary query part by :math:`\gamma_h`, the rotary key,
    shared by the heads, not at all (``alpha`` is GQA's: no MLA head shares a part it scales).
    """
    if not threshold > 0:
        raise ValueError(f"qk_clip: `threshold` must be positive, got {threshold!r}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"qk_clip: `alpha` must be in [0, 1], got {alpha!r}")
    latent = "k_up" in params
    *layers, _, hq, _ = params["k_up" if latent else "q"].shape
    top = jnp.asarray(max_scores)
    if top.shape[-1:] != (hq,):
        raise ValueError(f"qk_clip: `max_scores` must end in the {hq} query heads of `params`, got shape {top.shape}")
    gamma = threshold / jnp.maximum(top, threshold)  # (*layers, Hq): 1 at or under the threshold (-inf too)
    gamma = jnp.broadcast_to(gamma, (*layers, hq))
    if latent:
        return _latent_qk_clip(params, gamma)
    hkv = params["k"].shape[-2]
    kappa = jnp.min(gamma.reshape(*gamma.shape[:-1], hkv, hq // hkv), axis=-1) ** (1 - alpha)  # (*layers, Hkv)
    q_scale = gamma / jnp.repeat(kappa, hq // hkv, axis=-1)
    scaled = lambda w, scale: (w * scale[..., None, :, None]).astype(w.dtype)  # noqa: E731
    return {**params, "q": scaled(params["q"], q_scale), "k": scaled(params["k"], kappa)}


def _latent_qk_clip(params: Params, gamma) -> Params:
    """qk_clip of MLA params by each head's ``gamma`` ``(*layers, H)``: query and key head parts by
    its square root, the rotary query part by it."""
    root, nope = jnp.sqrt(gamma), params["k_up"].shape[-1]
    q_name = "q" if "q" in params else "q_up"
    q = params[q_name]
    columns = jnp.concatenate(  # (*layers, H, nope + rope): each query feature's factor
        [jnp.broadcast_to(root[..., None], (*root.shape, nope)), jnp.broadcast_to(gamma[..., None], (*gamma.shape, q.shape[-1] - nope))], axis=-1
    )
    return {
        **params,
        q_name: (q * columns[..., None, :, :]).astype(q.dtype),
        "k_up": (params["k_up"] * root[..., None, :, None]).astype(params["k_up"].dtype),
    }


def written_at(cache, new, length):
    """``cache (*batch, max_len, H, D)`` with ``new (*batch, seq, H, D)`` at each item's ``length``
    (positions past ``max_len`` dropped). One scatter, placed as the cache is: under explicit
    sharding a cache split along its sequence stays split (each device writes what falls in it)."""
    items = [i[..., None] for i in jnp.indices(length.shape, sparse=True)]
    positions = _after(length, new.shape[-3])
    return cache.at[(*items, positions)].set(new.astype(cache.dtype), mode="drop", out_sharding=jax.typeof(cache).sharding)


def cache_positions(fn: str, length, max_len: int, x, positions):
    """The positions of ``x``'s tokens (``(..., seq, features)``) after a cache's ``length`` (or
    ``positions`` where given), once ``x`` is checked against the cache's items and ``max_len``."""
    if length.shape != x.shape[:-2]:
        raise ValueError(f"{fn}: `cache` holds items of batch shape {length.shape} (its `length`), `x` of shape {x.shape} has batch shape {x.shape[:-2]}")
    if x.shape[-2] > max_len:
        raise ValueError(f"{fn}: `x` has {x.shape[-2]} tokens an item, more than the cache's max_len {max_len}")
    return _after(length, x.shape[-2]) if positions is None else positions


def _after(length, n: int):
    """``(*batch, n)``: the ``n`` positions after each item's ``length``."""
    return length[..., None] + jax.lax.broadcast_to_rank(jnp.arange(n, dtype=length.dtype), length.ndim + 1)
