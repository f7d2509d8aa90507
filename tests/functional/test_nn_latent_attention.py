"""jf.nn.multi_head_latent_attention (DeepSeek's MLA): its heads against a dense float64 reference
(every head's keys and values written out), decoding from the latent cache (the key up-projection
absorbed into the queries, one key/value head of dim kv_rank + rope_dim) against the whole
sequence, values and gradients (JAX's of the reference: exact)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf

DIMS = dict(kv_rank=16, nope_dim=8, rope_dim=4, v_dim=6)
FEATURES, HEADS, B, S = 32, 4, 2, 10


def params_and_x(q_rank=None, seed=0):
    params = jf.nn.init_multi_head_latent_attention(jax.random.key(seed), FEATURES, HEADS, q_rank=q_rank, dtype=jnp.float64, **DIMS)
    params = {name: w + 0.1 for name, w in params.items()}  # norms' scales away from 1: their gradients count
    return params, jax.random.normal(jax.random.key(seed + 1), (B, S, FEATURES), jnp.float64)


def reference(params, x, visible, logits=None):
    """Every head's keys and values written out, a dense softmax over ``visible`` (S, S); each
    head's largest visible logit appended to ``logits`` where given."""
    kv_rank, nope = DIMS["kv_rank"], DIMS["nope_dim"]
    rms = lambda t, scale: t / jnp.sqrt(jnp.mean(t**2, -1, keepdims=True) + 1e-6) * jnp.broadcast_to(scale, t.shape)  # noqa: E731
    q = jnp.einsum("bsf,fhd->bshd", x, params["q"]) if "q" in params else jnp.einsum("bsr,rhd->bshd", rms(x @ params["q_down"], params["q_norm"]), params["q_up"])
    latent = x @ params["kv_down"]
    c = rms(latent[..., :kv_rank], params["kv_norm"])
    positions = jnp.arange(S)
    rope = lambda t: jf.nn.rotary_embedding(t, positions)  # noqa: E731
    q = jnp.concatenate([q[..., :nope], rope(q[..., nope:])], -1)
    k_rope = jnp.repeat(rope(latent[..., None, kv_rank:]), HEADS, axis=-2)
    k = jnp.concatenate([jnp.einsum("bsr,rhd->bshd", c, params["k_up"]), k_rope], -1)
    v = jnp.einsum("bsr,rhd->bshd", c, params["v_up"])
    scores = jnp.where(visible, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(nope + DIMS["rope_dim"]), -jnp.inf)
    if logits is not None:
        logits.append(jnp.max(scores, axis=(0, 2, 3)))
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd,hdf->bqf", weights, v, params["o"])


@pytest.mark.parametrize("q_rank", [None, 12])
def test_matches_a_dense_reference(q_rank):
    params, x = params_and_x(q_rank)
    segments = jnp.asarray([0] * 4 + [1] * 6)
    mask = jf.masks.causal() & jf.masks.document(segments)
    visible = (np.tril(np.ones((S, S), bool))) & (segments[:, None] == segments[None, :])
    got = jf.nn.multi_head_latent_attention(params, x, mask=mask)
    np.testing.assert_allclose(got, reference(params, x, visible), rtol=1e-12, atol=1e-12)


def decode(params, x, prompt, max_len=12):
    """A prompt of ``prompt`` tokens, then one token a step, from the latent cache."""
    cache = jf.nn.init_latent_cache(params, (B,), max_len)
    out, cache = jf.nn.multi_head_latent_attention(params, x[:, :prompt], cache=cache)
    outs = [out]
    for t in range(prompt, x.shape[1]):
        out, cache = jf.nn.multi_head_latent_attention(params, x[:, t : t + 1], cache=cache)
        outs.append(out)
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("q_rank", [None, 12])
def test_decoding_from_the_latent_cache_matches_the_whole_sequence(q_rank):
    params, x = params_and_x(q_rank, seed=2)
    whole = jf.nn.multi_head_latent_attention(params, x, mask=jf.masks.causal())
    got, cache = decode(params, x, prompt=6)
    assert cache["latent"].shape == (B, 12, 1, DIMS["kv_rank"] + DIMS["rope_dim"])  # a token's cache: 20 numbers
    np.testing.assert_array_equal(cache["length"], [S, S])
    np.testing.assert_allclose(got, whole, rtol=1e-12, atol=1e-12)


def test_gradients_match_the_dense_reference_s_with_and_without_the_cache():
    params, x = params_and_x(12, seed=3)
    layer = lambda params, x: jf.nn.multi_head_latent_attention(params, x, mask=jf.masks.causal())  # noqa: E731
    w = jax.random.normal(jax.random.key(9), (B, S, FEATURES), jnp.float64)
    loss = lambda out: jnp.sum(jnp.sin(out) * w)  # noqa: E731
    grad = lambda f: jax.jit(jax.grad(lambda params, x: loss(f(params, x)), (0, 1)))(params, x)  # noqa: E731
    want = grad(lambda params, x: reference(params, x, np.tril(np.ones((S, S), bool))))
    for got in (grad(layer), grad(lambda params, x: decode(params, x, prompt=7)[0])):
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12), got, want)


def test_an_item_that_outgrows_its_cache_gets_nan():
    params, x = params_and_x()
    out, cache = jf.nn.multi_head_latent_attention(params, x[:, :3], cache=jf.nn.init_latent_cache(params, (B,), 4))
    cache = {**cache, "length": jnp.asarray([1, 3])}  # item 1 fills its cache with 2 tokens more
    out, cache = jf.nn.multi_head_latent_attention(params, x[:, 3:5], cache=cache)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
    with pytest.raises(ValueError, match=r"multi_head_latent_attention: `x` has 10 tokens an item, more than the cache's max_len 4"):
        jf.nn.multi_head_latent_attention(params, x, cache=jf.nn.init_latent_cache(params, (B,), 4))


@pytest.mark.parametrize("kw", [dict(kv_rank=0), dict(rope_dim=3), dict(q_rank=-1), dict(v_dim=0)])
def test_bad_dims_are_refused(kw):
    with pytest.raises(ValueError, match=r"init_multi_head_latent_attention: dims must be positive ints"):
        jf.nn.init_multi_head_latent_attention(jax.random.key(0), FEATURES, HEADS, **(DIMS | kw))


@pytest.mark.parametrize("q_rank", [None, 12])
def test_largest_logits_and_qk_clip_bounding_them(q_rank):
    """return_max_scores: each head's largest logit, the reference's, with the cache or without;
    qk_clip (Kimi K2's MuonClip on MLA: head parts by √γ, the rotary query part by γ, the shared
    rotary key left alone) scales each head's logits by exactly min(1, τ / S_h)."""
    params, x = params_and_x(q_rank, seed=4)
    params = {**params, "q" if q_rank is None else "q_up": params["q" if q_rank is None else "q_up"] * 6}  # logits of 10 or so
    causal = jf.masks.causal()
    _, top = jf.nn.multi_head_latent_attention(params, x, mask=causal, return_max_scores=True)
    logits = []
    reference(params, x, np.tril(np.ones((S, S), bool)), logits=logits)
    np.testing.assert_allclose(top, logits[0], rtol=1e-12)
    _, _, cached_top = jf.nn.multi_head_latent_attention(params, x, cache=jf.nn.init_latent_cache(params, (B,), S), return_max_scores=True)
    np.testing.assert_allclose(cached_top, top, rtol=1e-12)
    threshold = float(np.median(top))
    clipped = jf.nn.qk_clip(params, top, threshold)
    assert clipped.keys() == params.keys() and clipped["kv_down"] is params["kv_down"]  # the shared rotary key unscaled
    _, clipped_top = jf.nn.multi_head_latent_attention(clipped, x, mask=causal, return_max_scores=True)
    np.testing.assert_allclose(clipped_top, np.minimum(top, threshold), rtol=1e-10)


def test_a_transformer_of_mla_blocks_decodes_as_it_runs_the_whole_sequence():
    """init_transformer(latent_attention=...): MLA in every block; decoding from init_latent_cache
    (one per block) against the whole sequence under sliding windows, and a rematerialised
    gradient against the plain one."""
    params = jf.nn.init_transformer(jax.random.key(5), vocab_size=32, features=FEATURES, depth=2, num_heads=HEADS, latent_attention=DIMS, dtype=jnp.float64)
    tokens = jax.random.randint(jax.random.key(6), (B, S), 0, 32)
    windows = [3, 0]
    whole = jf.nn.transformer(params, tokens, windows=windows)
    cache = jf.nn.init_latent_cache(params["blocks"]["attention"], (B,), 12)
    assert cache["latent"].shape == (2, B, 12, 1, DIMS["kv_rank"] + DIMS["rope_dim"])
    steps, cache = jf.nn.transformer(params, tokens[:, :6], cache=cache, windows=windows)
    steps = [steps]
    for t in range(6, S):
        logits, cache = jf.nn.transformer(params, tokens[:, t : t + 1], cache=cache, windows=windows)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), whole, rtol=1e-11, atol=1e-11)
    loss = lambda remat: lambda p: jnp.sum(jnp.sin(jf.nn.transformer(p, tokens, remat=remat)))  # noqa: E731
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12), jax.grad(loss(jf.remat.save_attention()))(params), jax.grad(loss(False))(params)
    )
    with pytest.raises(ValueError, match=r"init_transformer: `latent_attention` \(MLA\) takes neither `num_kv_heads` nor `attention_sinks`"):
        jf.nn.init_transformer(jax.random.key(5), vocab_size=32, features=FEATURES, depth=2, num_heads=HEADS, num_kv_heads=2, latent_attention=DIMS)


def test_decoding_in_the_triton_kernels_in_head_dim_pieces():
    """The absorbed decoding step through the Triton kernels (interpret mode) with head dims of 48
    and 44 (kv_rank 44 + rope 4), each held as 32 + 16 (Implementation.head_pieces: 576 = 512 + 64
    at DeepSeek-V3's sizes), against the whole sequence in XLA's tiles."""
    import functools

    from jaxforge.functional.attention import Implementation

    params = jf.nn.init_multi_head_latent_attention(jax.random.key(4), FEATURES, HEADS, **{**DIMS, "kv_rank": 44}, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(5), (B, S, FEATURES), jnp.float64)
    whole = jf.nn.multi_head_latent_attention(params, x, mask=jf.masks.causal())
    pieces = functools.partial(jf.attention, implementation=Implementation("pallas_triton", block_q=8, block_kv=16, head_pieces=True))
    cache = jf.nn.init_latent_cache(params, (B,), 12)
    out, cache = jf.nn.multi_head_latent_attention(params, x[:, :6], cache=cache)
    outs = [out]
    for t in range(6, S):
        out, cache = jf.nn.multi_head_latent_attention(params, x[:, t : t + 1], cache=cache, attention_fn=pieces)
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), whole, rtol=1e-12, atol=1e-12)
