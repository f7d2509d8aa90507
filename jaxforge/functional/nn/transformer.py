"""A decoder-only transformer (pre-norm, rotary, GQA or MLA) and the token cross-entropy."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from jaxforge.functional import masks
from jaxforge.functional._static import static_bool
from jaxforge.functional.attention import attention
from jaxforge.functional.nn.attention import init_multi_head_attention, multi_head_attention
from jaxforge.functional.nn.latent_attention import init_multi_head_latent_attention, multi_head_latent_attention
from jaxforge.functional.nn.layers import (
    NestedParams,
    at_least_float32,
    embedding,
    init_embedding,
    init_linear,
    init_mlp,
    init_rms_norm,
    linear,
    mlp,
    rms_norm,
)

__all__ = ["cross_entropy", "init_transformer", "transformer"]


def init_transformer(
    key: PRNGKeyArray,
    *,
    vocab_size: int,
    features: int,
    depth: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    hidden_features: int | None = None,
    attention_sinks: bool = False,
    latent_attention: dict | None = None,
    dtype=jnp.float32,
) -> NestedParams:
    """Params of :func:`transformer`: ``embedding``, ``blocks`` (every leaf stacked over ``depth``),
    the final ``norm`` and the output ``head`` (no bias). ``hidden_features`` defaults to 4 × features;
    ``attention_sinks``: learned sink logits in every attention layer (``init_multi_head_attention``'s ``sinks``);
    ``latent_attention``: multi-head latent attention (MLA) in every block, this dict the keyword
    arguments of :func:`init_multi_head_latent_attention` (``kv_rank`` at least), in place of GQA."""
    if depth <= 0:
        raise ValueError(f"init_transformer: `depth` must be positive, got {depth}")
    if latent_attention is not None and (num_kv_heads is not None or attention_sinks):
        raise ValueError("init_transformer: `latent_attention` (MLA) takes neither `num_kv_heads` nor `attention_sinks`")
    hidden_features = 4 * features if hidden_features is None else hidden_features
    k_embed, k_blocks, k_head = jax.random.split(key, 3)

    def init_block(key):
        k_attention, k_mlp = jax.random.split(key)
        return {
            "attention_norm": init_rms_norm(features, dtype=dtype),
            "attention": init_multi_head_attention(
                k_attention, features, num_heads, num_kv_heads=num_kv_heads, sinks=attention_sinks, dtype=dtype
            )
            if latent_attention is None
            else init_multi_head_latent_attention(k_attention, features, num_heads, **latent_attention, dtype=dtype),
            "mlp_norm": init_rms_norm(features, dtype=dtype),
            "mlp": init_mlp(k_mlp, features, hidden_features, dtype=dtype),
        }

    return {
        "embedding": init_embedding(k_embed, vocab_size, features, dtype=dtype),
        "blocks": jax.vmap(init_block)(jax.random.split(k_blocks, depth)),
        "norm": init_rms_norm(features, dtype=dtype),
        "head": init_linear(k_head, features, vocab_size, bias=False, dtype=dtype),
    }


def transformer(
    params: NestedParams,
    tokens: Int[ArrayLike, "*batch seq"],
    *,
    mask=None,
    positions: Int[ArrayLike, "*#batch seq"] | None = None,
    attention_fn: Callable = attention,
    cache: NestedParams | None = None,
    remat: bool | Callable = False,
    return_max_scores: bool = False,
    windows: int | Sequence[int] | Int[ArrayLike, " depth"] | None = None,
):
    r"""Next-token logits of a pre-norm decoder: for each block,
    :math:`x \mathrel{+}= \text{attn}(\text{rms}(x))`, :math:`x \mathrel{+}= \text{mlp}(\text{rms}(x))`.

    Args:
      params: from :func:`init_transformer`.
      tokens: ``(..., seq)`` integer ids.
      mask: the attention mask; default ``jf.masks.causal()``. For packed documents pass
        ``jf.masks.causal() & jf.masks.document(segment_ids)``.
      positions: rotary positions, default ``arange(seq)``.
      attention_fn: passed to :func:`multi_head_attention` (:func:`multi_head_latent_attention`).
      cache: decoding: ``init_kv_cache(params["blocks"]["attention"], batch_shape, max_len)``
        (``init_latent_cache`` for MLA blocks), a cache per block; ``tokens`` are the next ones of
        each item (a prompt to prefill, then one a step), ``mask`` only adds to the causal mask
        over the cache (see :func:`multi_head_attention`).
      remat: activation checkpointing: a gradient recomputes each block's activations from its input
        instead of storing them (one more forward, memory for one block's activations in place of
        every block's). True: save nothing else; or a ``jax.checkpoint`` policy, e.g.
        ``jf.remat.save_attention()``, which keeps each block's attention output and lse so that
        the backward recomputes the projections and MLP but not the attention.
      return_max_scores: also each block's largest attention logit per query head, ``(depth,
        Hq)``: MuonClip's statistic, for :func:`qk_clip` on ``params["blocks"]["attention"]``.
      windows: sliding windows, one per block (``(depth,)`` ints) or one for all: block ``i``
        attends under ``mask & jf.masks.sliding_window(windows[i])`` (with a cache, to its last
        ``windows[i]`` positions), 0 for no window: gpt-oss alternates 128 and 0, Gemma 3 five
        blocks of 1024 to one of 0. Runtime values (the scan's), so their tiles are skipped by
        runtime bounds.

    Returns:
      ``(..., seq, vocab)`` logits; with a cache, ``(logits, cache)``; with ``return_max_scores``,
      the logits' maxima after them.

    The blocks run as one ``lax.scan`` over depth, so compile time does not grow with depth.
    """
    return_max_scores = static_bool("transformer", "return_max_scores", return_max_scores)
    if not callable(remat):
        remat = static_bool("transformer", "remat", remat, accepted="a bool or a jax.checkpoint policy")
    if cache is None:
        mask = masks.causal() if mask is None else mask
    mask = None if mask is None else masks.as_mask(mask)  # a pytree, so a jit argument
    windows = None if windows is None else _windows(windows, jax.tree.leaves(params["blocks"])[0].shape[0])
    x = embedding(params["embedding"], tokens)
    kv = None if cache is None else {name: x for name, x in cache.items() if name != "length"}  # k and v, or MLA's latent
    length = None if cache is None else cache["length"]
    x, (kv, top) = _blocks(
        params["blocks"], x, kv, length, windows, mask=mask, positions=positions, attention_fn=attention_fn, remat=remat,
        max_scores=return_max_scores,
    )
    logits = linear(params["head"], rms_norm(params["norm"], x))
    extra = [] if cache is None else [{**kv, "length": cache["length"] + jnp.shape(tokens)[-1]}]
    extra += [top] if return_max_scores else []
    return (logits, *extra) if extra else logits


# Jitted (masks are pytrees): an eager call compiles once per shape, where a scan over a fresh
# closure would trace and compile at every call.
@functools.partial(jax.jit, static_argnames=("attention_fn", "remat", "max_scores"))
def _blocks(blocks, x, kv, length, windows, *, mask, positions, attention_fn, remat, max_scores):
    """The blocks of :func:`transformer` over ``x``, each with its slice of the cache ``kv`` (None
    without one, else {"k", "v"}, or MLA's {"latent"}, stacked over blocks, all at ``length``) and
    of ``windows`` (None, or one per block); ``remat`` as there. Returns ``x`` and, stacked over
    blocks, ``(cache, max_scores)`` (None where not asked for)."""

    def block(x, layer):
        p, kv, window = layer
        layer_cache = None if kv is None else {**kv, "length": length}
        layer_mask = mask if window is None else _windowed(mask, window, None if kv is None else length)
        attend = multi_head_latent_attention if "k_up" in p["attention"] else multi_head_attention
        results = attend(
            p["attention"], rms_norm(p["attention_norm"], x), mask=layer_mask, positions=positions, attention_fn=attention_fn,
            cache=layer_cache, return_max_scores=max_scores,
        )  # fmt: skip
        attended, *extra = results if kv is not None or max_scores else (results,)
        if kv is not None:
            layer_cache = {name: x for name, x in extra[0].items() if name != "length"}
        x = x + attended
        return x + mlp(p["mlp"], rms_norm(p["mlp_norm"], x)), (layer_cache, extra[-1] if max_scores else None)

    if remat:
        block = jax.checkpoint(block, policy=None if remat is True else remat)

    return jax.lax.scan(block, x, (blocks, kv, windows))


# A window that no sequence outgrows (the band's offsets stay within int32 for positions < 2**30)
_UNBOUNDED = 1 << 30


def _windows(windows, depth: int):
    """``windows`` checked, as ``(depth,)`` int32."""
    windows = jnp.asarray(windows)
    if not jnp.issubdtype(windows.dtype, jnp.integer) or windows.shape not in ((), (depth,)):
        raise TypeError(
            f"transformer: `windows` must be an int or {depth} ints (one per block), got {windows.dtype}{list(windows.shape)}"
        )
    return jnp.broadcast_to(windows.astype(jnp.int32), (depth,))


def _windowed(mask, window, length):
    """``mask`` and the band of a query's last ``window`` keys (0: every key): over the call's own
    positions, or (``length`` not None) over a cache filled to ``length`` ahead of the queries,
    where ``multi_head_attention`` adds the causal part."""
    window = jnp.where(window > 0, window, _UNBOUNDED)
    band = masks.sliding_window(window) if length is None else ~masks.causal(length - window)
    return band if mask is None else mask & band


def cross_entropy(
    logits: Float[ArrayLike, "*batch classes"], labels: Int[ArrayLike, "*batch"], *, where: Bool[ArrayLike, "*batch"] | None = None
) -> Float[Array, ""]:
    r"""Mean negative log-likelihood :math:`-\frac1N\sum_i \log \operatorname{softmax}(z_i)_{y_i}` over
    the positions where ``where`` is True (all by default; 0 when none), in float32 or wider. A
    label outside ``[0, classes)`` where ``where`` holds gives NaN (negative ones too: they do not
    wrap round to the last classes)."""
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"cross_entropy: `labels` must be integers, got dtype {labels.dtype}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: `labels` shape {labels.shape} must equal logits' leading shape {logits.shape[:-1]}")
    log_p = jax.nn.log_softmax(logits.astype(at_least_float32(logits.dtype)), axis=-1)
    nll = -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]  # NaN past the classes
    nll = jnp.where(labels >= 0, nll, jnp.nan)  # and before them, where the index would wrap
    if where is None:
        return jnp.mean(nll)
    where = jnp.broadcast_to(where, nll.shape)
    return jnp.sum(jnp.where(where, nll, 0)) / jnp.maximum(jnp.sum(where, dtype=nll.dtype), 1)
