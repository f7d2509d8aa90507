"""jf.nn against independent numpy models in float64, derivatives by check_grads, vmap, jit, shard.

conftest.py switches on jaxtyping + beartype for jf.nn, so every call here also checks the
shape annotations of the signatures.
"""

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxforge as jf
from tests.primitives.attention.test_max_scores import ARGMAX

nn = jf.nn
KEY = jax.random.key(0)
RNG = np.random.default_rng(0)


def normal(*shape):
    return jnp.asarray(RNG.normal(size=shape))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def f64(params):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


# -- dense layers ---------------------------------------------------------------------------------


def test_linear_and_mlp_match_numpy():
    params = nn.init_mlp(KEY, 6, 10, dtype=jnp.float64)
    x = normal(3, 4, 6)
    p = f64(params)
    hidden = np.asarray(x) @ p["up"]["w"] + p["up"]["b"]
    want = np.tanh(hidden) @ p["down"]["w"] + p["down"]["b"]
    np.testing.assert_allclose(nn.mlp(params, x, activation=jnp.tanh), want, rtol=1e-12)
    assert set(nn.init_linear(KEY, 3, 2, bias=False)) == {"w"}
    np.testing.assert_allclose(nn.linear({"w": p["up"]["w"]}, x), x @ p["up"]["w"], rtol=1e-12)


def test_init_scales():
    w = nn.init_linear(KEY, 400, 300)["w"]
    assert w.dtype == jnp.float32 and abs(float(jnp.std(w)) * np.sqrt(400) - 1) < 0.02
    lstm = nn.init_lstm(KEY, 3, 5)
    np.testing.assert_array_equal(lstm["b"], np.r_[np.zeros(5), np.ones(5), np.zeros(10)])
    assert float(jnp.max(jnp.abs(lstm["w_hidden"]))) <= 1 / np.sqrt(5)


def test_embedding_gathers_rows():
    params = nn.init_embedding(KEY, 11, 4, dtype=jnp.float64)
    ids = jnp.array([[3, 0], [10, 3]])
    np.testing.assert_array_equal(nn.embedding(params, ids), np.asarray(params["table"])[np.asarray(ids)])


def test_norms_match_numpy():
    x = normal(2, 5, 8)
    scale, bias = normal(8), normal(8)
    xn = np.asarray(x)
    want_rms = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(scale)
    np.testing.assert_allclose(nn.rms_norm({"scale": scale}, x), want_rms, rtol=1e-12)
    centred = xn - xn.mean(-1, keepdims=True)
    want_ln = centred / np.sqrt(centred.var(-1, keepdims=True) + 1e-5) * np.asarray(scale) + np.asarray(bias)
    np.testing.assert_allclose(nn.layer_norm({"scale": scale, "bias": bias}, x), want_ln, rtol=1e-12)
    check_grads(jax.jit(lambda x, s: nn.rms_norm({"scale": s}, x)), (x, scale), order=2, modes=("fwd", "rev"))
    check_grads(jax.jit(lambda x, s, b: nn.layer_norm({"scale": s, "bias": b}, x)), (x, scale, bias), order=2)


def test_norms_of_bfloat16_accumulate_wide():
    x = jnp.full((4, 512), 3.0, jnp.bfloat16).at[0, 0].set(300.0)
    got = nn.rms_norm(nn.init_rms_norm(512, dtype=jnp.bfloat16), x)
    want = nn.rms_norm(nn.init_rms_norm(512, dtype=jnp.float32), x.astype(jnp.float32))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=1e-2)


# -- rotary embedding and attention ---------------------------------------------------------------


def test_rotary_matches_numpy_and_is_relative():
    x = normal(2, 7, 3, 8)
    positions = jnp.arange(7) + 5
    half = np.arange(4)
    theta = 10000.0 ** (-2 * half / 8)
    angle = np.asarray(positions)[:, None, None] * theta
    a, b = np.asarray(x)[..., :4], np.asarray(x)[..., 4:]
    want = np.concatenate([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)], -1)
    np.testing.assert_allclose(nn.rotary_embedding(x, positions), want, rtol=1e-12, atol=1e-12)
    # <R_p q, R_p' k> depends on p - p' only.
    q, k = normal(1, 1, 8), normal(1, 1, 8)

    def score(p, p_k):
        return jnp.sum(nn.rotary_embedding(q, jnp.array([p])) * nn.rotary_embedding(k, jnp.array([p_k])))

    np.testing.assert_allclose(score(3, 1), score(103, 101), rtol=1e-10)


def dense_attention(q, k, v, visible):
    """Softmax attention in jax.numpy with a boolean (..., Sq, Skv) visibility; GQA by repetition."""
    group = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(visible[..., None, :, :], s, -jnp.inf)
    return jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(s, axis=-1), v)


def dense_attention_with_sinks(q, k, v, visible, sinks):
    """:func:`dense_attention` whose rows have one more key: logit ``sinks[h]``, value 0."""
    group = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(visible[..., None, :, :], s, -jnp.inf)
    s = jnp.concatenate([s, jnp.broadcast_to(sinks[:, None, None], (*s.shape[:-1], 1))], axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(s, axis=-1)[..., :-1], v)


def document_causal(segment_ids):
    seq = segment_ids.shape[-1]
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    return same & np.tril(np.ones((seq, seq), bool))


SEGMENTS = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])


def test_multi_head_attention_gqa_document_causal_matches_dense():
    params = nn.init_multi_head_attention(KEY, 12, 4, num_kv_heads=2, head_dim=6, dtype=jnp.float64)
    x = normal(2, 9, 12)
    mask = jf.masks.causal() & jf.masks.document(SEGMENTS)
    got = nn.multi_head_attention(params, x, mask=mask)
    visible = document_causal(np.asarray(SEGMENTS))
    want = nn.multi_head_attention(params, x, attention_fn=lambda q, k, v, mask: dense_attention(q, k, v, visible))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    # Without rotary, no projection trick hides an error: compare with explicit numpy.
    p = f64(params)
    xn = np.asarray(x)
    q, k, v = (np.einsum("bsf,fhd->bshd", xn, p[n]) for n in "qkv")
    out = np.asarray(dense_attention(q, k, v, visible))
    want_plain = np.einsum("bshd,hdf->bsf", out, p["o"])
    got_plain = nn.multi_head_attention(params, x, mask=mask, rotary_base=None)
    np.testing.assert_allclose(got_plain, want_plain, rtol=1e-10, atol=1e-12)


def test_multi_head_attention_gradients():
    params = nn.init_multi_head_attention(KEY, 8, 2, num_kv_heads=1, dtype=jnp.float64)
    x = normal(6, 8)
    f = lambda params, x: nn.multi_head_attention(params, x, mask=jf.masks.causal())  # noqa: E731
    check_grads(jax.jit(f), (params, x), order=2, modes=("rev",))


# -- recurrent layers -----------------------------------------------------------------------------


def lstm_numpy(p, xs, h, c):
    hs = []
    for x in np.moveaxis(xs, -2, 0):
        i, f, g, o = np.split(x @ p["w_input"] + h @ p["w_hidden"] + p["b"], 4, axis=-1)
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        hs.append(h)
    return np.stack(hs, -2), (h, c)


def gru_numpy(p, xs, h):
    hs = []
    wx, wh = np.split(p["w_input"], 3, axis=-1), np.split(p["w_hidden"], 3, axis=-1)
    bx, bh = np.split(p["b_input"], 3), np.split(p["b_hidden"], 3)
    for x in np.moveaxis(xs, -2, 0):
        r = sigmoid(x @ wx[0] + bx[0] + h @ wh[0] + bh[0])
        z = sigmoid(x @ wx[1] + bx[1] + h @ wh[1] + bh[1])
        n = np.tanh(x @ wx[2] + bx[2] + r * (h @ wh[2] + bh[2]))
        h = (1 - z) * n + z * h
        hs.append(h)
    return np.stack(hs, -2), h


def test_lstm_matches_numpy_loop():
    params = nn.init_lstm(KEY, 3, 5, dtype=jnp.float64)
    xs, h0, c0 = normal(2, 7, 3), normal(2, 5), normal(2, 5)
    hs, (h, c) = nn.lstm(params, xs, (h0, c0))
    want_hs, (want_h, want_c) = lstm_numpy(f64(params), np.asarray(xs), np.asarray(h0), np.asarray(c0))
    for got, want in ((hs, want_hs), (h, want_h), (c, want_c)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    zero_state = lstm_numpy(f64(params), np.asarray(xs), np.zeros((2, 5)), np.zeros((2, 5)))[0]
    np.testing.assert_allclose(nn.lstm(params, xs)[0], zero_state, rtol=1e-12, atol=1e-14)


def test_gru_matches_numpy_loop():
    params = nn.init_gru(KEY, 3, 4, dtype=jnp.float64)
    xs, h0 = normal(5, 3), normal(4)
    hs, h = nn.gru(params, xs, h0)
    want_hs, want_h = gru_numpy(f64(params), np.asarray(xs), np.asarray(h0))
    np.testing.assert_allclose(hs, want_hs, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(h, want_h, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layer", ["lstm", "gru"])
def test_recurrent_gradients_and_vmap(layer):
    init, apply = getattr(nn, f"init_{layer}"), getattr(nn, layer)
    params = init(KEY, 2, 3, dtype=jnp.float64)
    xs = normal(4, 5, 2)
    check_grads(lambda p, x: apply(p, x)[0], (params, xs[0]), order=1, modes=("fwd", "rev"))
    batched = jax.vmap(lambda x: apply(params, x)[0])(xs)
    np.testing.assert_allclose(batched, apply(params, xs)[0], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("layer", ["lstm", "gru"])
def test_an_eager_recurrent_call_compiles_once(layer, backend_compiles):
    """Called outside jit with new inputs of the same shapes, the recurrence compiles nothing (a scan
    over a fresh closure compiled at every call)."""
    params = getattr(nn, f"init_{layer}")(KEY, 2, 3)
    jax.block_until_ready(getattr(nn, layer)(params, normal(4, 5, 2)))
    backend_compiles.clear()
    jax.block_until_ready(getattr(nn, layer)(params, normal(4, 5, 2)))
    assert backend_compiles == []


# -- transformer and loss -------------------------------------------------------------------------

CONFIG = dict(vocab_size=13, features=16, depth=2, num_heads=4, num_kv_heads=2, hidden_features=24)


def test_cross_entropy_matches_numpy():
    logits, labels = normal(3, 4, 7), jnp.asarray(RNG.integers(0, 7, (3, 4)))
    where = jnp.asarray(RNG.random((3, 4)) > 0.3)
    z = np.asarray(logits)
    log_p = z - z.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_p, np.asarray(labels)[..., None], -1)[..., 0]
    np.testing.assert_allclose(nn.cross_entropy(logits, labels), nll.mean(), rtol=1e-12)
    np.testing.assert_allclose(nn.cross_entropy(logits, labels, where=where), nll[np.asarray(where)].mean(), rtol=1e-12)
    assert float(nn.cross_entropy(logits, labels, where=jnp.zeros((3, 4), bool))) == 0.0
    for bad in (-1, 7):  # a label outside the classes: NaN, not a wrap to the last class
        wrong = labels.at[1, 2].set(bad)
        assert np.isnan(nn.cross_entropy(logits, wrong))
        ignored = where.at[1, 2].set(False)  # unless `where` leaves it out, gradient included
        np.testing.assert_allclose(nn.cross_entropy(logits, wrong, where=ignored), nll[np.asarray(ignored)].mean(), rtol=1e-12)
        assert np.isfinite(jax.grad(nn.cross_entropy)(logits, wrong, where=ignored)).all()


def loss(params, tokens, segments, attention_fn=jf.attention):
    mask = jf.masks.causal() & jf.masks.document(segments[..., :-1])
    logits = nn.transformer(params, tokens[..., :-1], mask=mask, attention_fn=attention_fn)
    same_document = segments[..., 1:] == segments[..., :-1]
    return nn.cross_entropy(logits, tokens[..., 1:], where=same_document)


def dense_loss(params, tokens, segments):
    visible = document_causal(np.asarray(segments)[..., :-1])
    return loss(params, tokens, segments, attention_fn=lambda q, k, v, mask: dense_attention(q, k, v, visible))


TOKENS = jnp.asarray(RNG.integers(0, 13, (2, 10)))
SEGMENTS_10 = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2, 2, 2, 2]])


def test_transformer_loss_and_grad_match_reference_attention():
    params = nn.init_transformer(KEY, dtype=jnp.float64, **CONFIG)
    # jitted, tokens and segments closed over (dense_loss builds its mask with numpy)
    value, grad = jax.jit(jax.value_and_grad(lambda p: loss(p, TOKENS, SEGMENTS_10)))(params)
    want_value, want_grad = jax.jit(jax.value_and_grad(lambda p: dense_loss(p, TOKENS, SEGMENTS_10)))(params)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grad))  # every param trains


def test_transformer_with_attention_sinks_trains_them():
    params = nn.init_transformer(KEY, dtype=jnp.float64, attention_sinks=True, **CONFIG)
    assert params["blocks"]["attention"]["sinks"].shape == (CONFIG["depth"], CONFIG["num_heads"])
    params["blocks"]["attention"]["sinks"] = jnp.asarray(RNG.standard_normal((CONFIG["depth"], CONFIG["num_heads"])))
    visible = document_causal(np.asarray(SEGMENTS_10)[..., :-1])
    dense = lambda q, k, v, mask, sinks: dense_attention_with_sinks(q, k, v, visible, sinks)  # noqa: E731
    value, grad = jax.jit(jax.value_and_grad(lambda p: loss(p, TOKENS, SEGMENTS_10)))(params)
    want_value, want_grad = jax.value_and_grad(lambda p: loss(p, TOKENS, SEGMENTS_10, attention_fn=dense))(params)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert float(jnp.min(jnp.abs(grad["blocks"]["attention"]["sinks"]))) > 0
    without = dict(params, blocks=dict(params["blocks"], attention={
        k: x for k, x in params["blocks"]["attention"].items() if k != "sinks"}))
    assert abs(float(loss(without, TOKENS, SEGMENTS_10)) - float(value)) > 1e-6  # the sinks change the model


def test_a_training_step_returning_the_maxima_seeks_no_first_keys():
    """A jitted gradient whose blocks' maxima are auxiliary (QK-clip's step) lowers without the
    argmax a tile that the maxima's own derivative needs (dead-code elimination through the
    layers' scan and their remat)."""
    params = nn.init_transformer(KEY, **CONFIG)

    def lowered(loss):
        return jax.jit(jax.grad(loss, has_aux=True)).lower(params).as_text()

    def step(p, remat):
        logits, top = nn.transformer(p, TOKENS, return_max_scores=True, remat=remat)
        return jnp.mean(logits**2), top

    for remat in (False, True):
        assert not re.search(ARGMAX, lowered(functools.partial(step, remat=remat))), remat
    of_maxima = lambda p: (jnp.sum(nn.transformer(p, TOKENS, return_max_scores=True)[1]), None)  # noqa: E731
    assert re.search(ARGMAX, lowered(of_maxima))


def test_each_blocks_largest_logits_and_qk_clip_bounding_them():
    """return_max_scores: each block's largest logit per query head against a dense attention's
    (same logits either way); qk_clip scales each head's logits by min(1, τ / S_h), so the clipped
    model's maxima are min(S_h, τ): GQA heads sharing a key head included (CONFIG: 2 a group)."""
    params = nn.init_transformer(KEY, dtype=jnp.float64, **dict(CONFIG, depth=3))
    params = jax.tree.map(lambda w: 4 * w, params)  # logits of several units
    mask = jf.masks.causal() & jf.masks.document(SEGMENTS_10)
    visible = document_causal(np.asarray(SEGMENTS_10))

    def dense_with_maxima(q, k, v, mask, return_max_scores):
        s = jnp.einsum("...qhd,...khd->...qhk", q, jnp.repeat(k, q.shape[-2] // k.shape[-2], axis=-2)) / np.sqrt(q.shape[-1])
        return dense_attention(q, k, v, visible), jnp.max(jnp.where(visible[:, :, None, :], s, -jnp.inf), axis=-1)

    logits, top = nn.transformer(params, TOKENS, mask=mask, return_max_scores=True)
    want_logits, want_top = nn.transformer(params, TOKENS, attention_fn=dense_with_maxima, return_max_scores=True)
    assert top.shape == (3, CONFIG["num_heads"])
    np.testing.assert_allclose(logits, nn.transformer(params, TOKENS, mask=mask), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(top, want_top, rtol=1e-10, atol=1e-10)
    # one layer: its maxima are exactly min(S_h, τ) after the clip, a clipped head beside an unclipped one
    layer = jax.tree.map(lambda w: w[0], params["blocks"]["attention"])
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 10, CONFIG["features"])))
    _, layer_top = nn.multi_head_attention(layer, x, mask=mask, return_max_scores=True)
    threshold = float(layer_top[0] + layer_top[1]) / 2  # between the two heads of key head 0
    clipped = jax.jit(nn.qk_clip, static_argnums=2)(layer, layer_top, threshold)
    np.testing.assert_allclose(nn.multi_head_attention(clipped, x, mask=mask, return_max_scores=True)[1], np.minimum(layer_top, threshold), rtol=1e-10)
    assert (np.asarray(layer_top[:2]) > threshold).sum() == 1  # one head of the group clipped, one not
    with pytest.raises(ValueError, match=r"qk_clip: `max_scores` must end in the 4 query heads of `params`, got shape \(3, 2\)"):
        nn.qk_clip(params["blocks"]["attention"], top[:, :2], threshold)
    with pytest.raises(ValueError, match=r"qk_clip: `threshold` must be positive, got 0.0"):
        nn.qk_clip(params["blocks"]["attention"], top, 0.0)
    with pytest.raises(ValueError, match=r"qk_clip: `alpha` must be in \[0, 1\], got 2.0"):
        nn.qk_clip(params["blocks"]["attention"], top, 1.0, alpha=2.0)


def test_transformer_check_grads():
    params = nn.init_transformer(KEY, dtype=jnp.float64, **dict(CONFIG, depth=1))
    check_grads(jax.jit(lambda p: loss(p, TOKENS[:1], SEGMENTS_10[:1])), (params,), order=1, modes=("fwd", "rev"))


def test_transformer_is_causal_and_respects_documents():
    params = nn.init_transformer(KEY, dtype=jnp.float64, **CONFIG)
    segments = SEGMENTS_10[1]
    mask = jf.masks.causal() & jf.masks.document(segments)
    logits = nn.transformer(params, TOKENS[1], mask=mask)
    changed = nn.transformer(params, TOKENS[1].at[3].set((TOKENS[1, 3] + 1) % 13), mask=mask)
    moved = np.any(np.asarray(logits != changed), axis=-1)
    # Token 3 lies in document 1 (positions 2..4): only positions 3 and 4 may see it.
    np.testing.assert_array_equal(moved, np.isin(np.arange(10), [3, 4]))


def unrolled_transformer(params, tokens, block_masks):
    """:func:`nn.transformer` written out block by block from the public layers, block ``i`` under
    ``block_masks[i]`` (static masks: no scan)."""
    x = nn.embedding(params["embedding"], tokens)
    for i, mask in enumerate(block_masks):
        p = jax.tree.map(lambda a: a[i], params["blocks"])
        x = x + nn.multi_head_attention(p["attention"], nn.rms_norm(p["attention_norm"], x), mask=mask)
        x = x + nn.mlp(p["mlp"], nn.rms_norm(p["mlp_norm"], x))
    return nn.linear(params["head"], nn.rms_norm(params["norm"], x))


@pytest.mark.parametrize("windows", [(2, 0), (0, 3), (1, 1)], ids=str)
def test_sliding_windows_per_block(windows):
    """``windows``: block ``i`` under ``mask & sliding_window(windows[i])`` (0: none), read from the
    layers' scan: logits and gradients as the unrolled blocks' with static masks; decoding over a
    cache keeps each block's window; a bad ``windows`` is an error naming it."""
    params = nn.init_transformer(KEY, dtype=jnp.float64, **CONFIG)
    mask = jf.masks.causal() & jf.masks.document(SEGMENTS_10)
    static = [mask if w == 0 else mask & jf.masks.sliding_window(w) for w in windows]
    got = nn.transformer(params, TOKENS, mask=mask, windows=jnp.asarray(windows))
    np.testing.assert_allclose(got, unrolled_transformer(params, TOKENS, static), rtol=1e-12, atol=1e-12)
    assert not np.allclose(got, nn.transformer(params, TOKENS, mask=mask))  # the windows matter
    grads = [jax.grad(lambda p: jnp.sum(f(p) ** 2))(params) for f in (
        lambda p: nn.transformer(p, TOKENS, mask=mask, windows=windows), lambda p: unrolled_transformer(p, TOKENS, static))]
    for a, b in zip(*(jax.tree.leaves(g) for g in grads)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    full = nn.transformer(params, TOKENS, windows=windows)  # causal alone, as decoding attends
    cache = nn.init_kv_cache(params["blocks"]["attention"], TOKENS.shape[:1], 12)
    logits, cache = nn.transformer(params, TOKENS[:, :4], cache=cache, windows=windows)
    np.testing.assert_allclose(logits, full[:, :4], rtol=1e-12, atol=1e-12)
    step = jax.jit(lambda params, token, cache: nn.transformer(params, token, cache=cache, windows=windows))
    for i in range(4, 7):
        logits, cache = step(params, TOKENS[:, i : i + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, i], rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match=r"transformer: `windows` must be an int or 2 ints \(one per block\), got int\d+\[3\]"):
        nn.transformer(params, TOKENS, windows=[1, 2, 3])


def test_decoding_with_a_kv_cache_matches_the_full_forward():
    """A prompt prefilled into the per-block caches, then one token a step under jit with the cache
    donated (its buffers reused, as a decoding loop does; GQA heads packed, causal over the cache):
    every step's logits are the full forward's at that position."""
    params = nn.init_transformer(KEY, dtype=jnp.float64, **CONFIG)
    full = nn.transformer(params, TOKENS)
    cache = nn.init_kv_cache(params["blocks"]["attention"], TOKENS.shape[:1], 12)
    assert cache["k"].shape == (CONFIG["depth"], TOKENS.shape[0], 12, CONFIG["num_kv_heads"], CONFIG["features"] // CONFIG["num_heads"])
    step = jax.jit(lambda params, tokens, cache: nn.transformer(params, tokens, cache=cache), donate_argnums=2)
    given, (logits, cache) = cache, step(params, TOKENS[:, :4], cache)  # the prefill
    np.testing.assert_allclose(logits, full[:, :4], rtol=1e-12, atol=1e-12)
    for i in range(4, TOKENS.shape[1]):
        assert all(x.is_deleted() for x in jax.tree.leaves(given))  # donated, each buffer once
        given, (logits, cache) = cache, step(params, TOKENS[:, i : i + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, i], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(cache["length"], TOKENS.shape[1])
    # the maxima beside the cache: a prefill of every token gives the full forward's
    empty = nn.init_kv_cache(params["blocks"]["attention"], TOKENS.shape[:1], 12)
    logits, cache, top = nn.transformer(params, TOKENS, cache=empty, return_max_scores=True)
    np.testing.assert_allclose(top, nn.transformer(params, TOKENS, return_max_scores=True)[1], rtol=1e-12, atol=1e-12)
    assert top.shape == (CONFIG["depth"], CONFIG["num_heads"]) and np.all(cache["length"] == TOKENS.shape[1])


def test_decoding_prompts_of_different_lengths_in_one_batch():
    """Prompts padded to one length are prefilled together, ``length`` set to each one's own; the
    next steps write over the padding, each item at its own position (runtime causal offsets and
    rotary positions): each item's logits are those of its own sequence run alone."""
    params = nn.init_transformer(KEY, dtype=jnp.float64, **CONFIG)
    lengths, tokens = np.asarray([3, 6, 1]), np.random.default_rng(1).integers(0, 13, (3, 6))
    padded = jnp.asarray(np.where(np.arange(6) < lengths[:, None], tokens, 0))
    cache = nn.init_kv_cache(params["blocks"]["attention"], (3,), 10)
    _, cache = nn.transformer(params, padded, cache=cache)
    cache = cache | {"length": jnp.asarray(lengths, jnp.int32)}
    step = jax.jit(lambda params, token, cache: nn.transformer(params, token, cache=cache))
    sequences = [list(tokens[b, : lengths[b]]) for b in range(3)]
    for _ in range(4):
        nxt = jnp.asarray([[s[-1] * 7 % 13] for s in sequences])  # any next tokens
        logits, cache = step(params, nxt, cache)
        for b, s in enumerate(sequences):
            s.append(int(nxt[b, 0]))
            alone = nn.transformer(params, jnp.asarray(s))
            np.testing.assert_allclose(logits[b, 0], alone[-1], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(cache["length"], lengths + 4)


def test_decoding_over_a_cache_split_along_its_sequence_on_an_explicit_mesh():
    """A cache split over its batch ("data") and its sequence ("seq") of an explicit mesh: each
    step writes its tokens into the shards that hold their positions and attends every device's
    keys where they lie (jf.attention with only k and v split), so the cache is never gathered;
    the prompt's and each step's logits and the cache equal one device's."""
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    params = nn.init_transformer(KEY, dtype=jnp.float64, **CONFIG)
    tokens = jnp.asarray(RNG.integers(0, 13, (2, 9)))
    cache = nn.init_kv_cache(params["blocks"]["attention"], (2,), 16)
    step = jax.jit(lambda params, tokens, cache: nn.transformer(params, tokens, cache=cache))
    specs = {"k": P(None, "data", "seq"), "v": P(None, "data", "seq"), "length": P("data")}
    with jax.set_mesh(mesh):
        split = {name: jax.device_put(x, specs[name]) for name, x in cache.items()}
        replicated = jax.device_put(params, P())
    for i, j in ((0, 5), (5, 6), (6, 7), (7, 9)):  # a prompt, then steps
        want, cache = step(params, tokens[:, i:j], cache)
        with jax.set_mesh(mesh):
            args = (replicated, jax.device_put(tokens[:, i:j], P("data")), split)
            got, split = step(*args)
            text = step.lower(*args).compile().as_text()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12), split, cache)
        gathered = re.findall(r"= f64\[([\d,]+)\][^\n]*\sall-gather(?:-start)?\(", text)  # the new tokens' keys and values only
        assert gathered and all(int(shape.split(",")[-3]) == j - i for shape in gathered), gathered
    assert split["k"].sharding.spec == P(None, "data", "seq", None, None)


def test_a_cache_of_another_dtype_and_a_step_of_no_tokens():
    """A bfloat16 cache (init_kv_cache's dtype=) under float32 params stays bfloat16 and decodes as
    a float32 cache whose attention reads k and v rounded to bfloat16; a step of no tokens returns
    the cache as it was."""
    params = nn.init_transformer(KEY, **CONFIG)
    rounded = lambda q, k, v, **kw: jf.attention(q, *(x.astype(jnp.bfloat16).astype(q.dtype) for x in (k, v)), **kw)  # noqa: E731
    caches = [nn.init_kv_cache(params["blocks"]["attention"], TOKENS.shape[:1], 12, dtype=d) for d in (jnp.bfloat16, None)]
    for i, j in ((0, 4), *((i, i + 1) for i in range(4, TOKENS.shape[1]))):
        (logits, caches[0]), (want, caches[1]) = (
            nn.transformer(params, TOKENS[:, i:j], cache=caches[0]),
            nn.transformer(params, TOKENS[:, i:j], cache=caches[1], attention_fn=rounded),
        )
        np.testing.assert_allclose(logits, want, rtol=1e-6, atol=1e-6)
    assert caches[0]["k"].dtype == caches[0]["v"].dtype == jnp.bfloat16
    none, same = nn.transformer(params, TOKENS[:, :0], cache=caches[0])
    assert none.shape == (TOKENS.shape[0], 0, CONFIG["vocab_size"])
    jax.tree.map(np.testing.assert_array_equal, same, caches[0])


def test_a_cache_that_overflows_gives_nan_for_that_item_only():
    """A step whose tokens do not fit an item's cache (``length + seq > max_len``: those past its
    end are not written) gives that item NaN logits, at that step and after; the other items decode as
    before. A step longer than the cache is refused at trace time."""
    params = nn.init_transformer(KEY, dtype=jnp.float64, **CONFIG)
    cache = nn.init_kv_cache(params["blocks"]["attention"], (2,), 6)
    _, cache = nn.transformer(params, TOKENS[:2, :4], cache=cache)
    cache = cache | {"length": jnp.asarray([5, 3], jnp.int32)}  # item 0 has room for one token, item 1 for three
    step = jax.jit(lambda params, tokens, cache: nn.transformer(params, tokens, cache=cache))
    logits, after = step(params, TOKENS[:2, 4:6], cache)
    assert np.all(np.isnan(logits[0])) and np.all(np.isfinite(logits[1]))
    alone = nn.transformer(params, jnp.concatenate([TOKENS[1, :3], TOKENS[1, 4:6]]))
    np.testing.assert_allclose(logits[1], alone[3:], rtol=1e-12, atol=1e-12)
    logits, _ = step(params, TOKENS[:2, 6:7], after)  # item 0 stays past its cache, item 1 fills its last slot
    assert np.all(np.isnan(logits[0])) and np.all(np.isfinite(logits[1]))
    with pytest.raises(ValueError, match="7 tokens an item, more than the cache's max_len 6"):
        nn.transformer(params, TOKENS[:2, :7], cache=nn.init_kv_cache(params["blocks"]["attention"], (2,), 6))


def test_transformer_vmap_and_jit_match():
    params = nn.init_transformer(KEY, dtype=jnp.float64, **CONFIG)
    batched = jax.jit(nn.transformer)(params, TOKENS)
    looped = jnp.stack([nn.transformer(params, t) for t in TOKENS])
    mapped = jax.vmap(nn.transformer, in_axes=(None, 0))(params, TOKENS)
    np.testing.assert_allclose(batched, looped, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(mapped, looped, rtol=1e-12, atol=1e-13)


def test_an_eager_transformer_call_with_a_new_document_mask_compiles_nothing(backend_compiles):
    """Outside jit, a call with other tokens and another document mask of the same shapes reuses
    every program: the blocks' scan is jitted over the arrays of its arguments, masks included
    (2.2 s a call before, for this model 4 ms)."""
    params = nn.init_transformer(KEY, **CONFIG)
    call = lambda tokens, segments: nn.transformer(params, tokens, mask=jf.masks.causal() & jf.masks.document(segments))  # noqa: E731
    tokens, segments = jnp.asarray(np.asarray(TOKENS)[::-1]), jnp.asarray(np.asarray(SEGMENTS_10)[::-1])
    jax.block_until_ready(call(TOKENS, SEGMENTS_10))
    backend_compiles.clear()
    logits = call(tokens, segments)
    assert backend_compiles == []
    np.testing.assert_allclose(logits, jax.jit(call)(tokens, segments), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", [True, jax.checkpoint_policies.dots_saveable], ids=["all", "dots_saveable"])
def test_remat_gives_the_same_gradient_from_less_memory(remat):
    """Checkpointed blocks: the same loss gradient; the compiled gradient's temporaries shrink
    (the activations of every block are not all kept for the backward)."""
    params = nn.init_transformer(KEY, dtype=jnp.float64, **dict(CONFIG, depth=4, hidden_features=64))
    tokens = jnp.asarray(RNG.integers(0, 13, (4, 32)))
    grad = lambda remat: jax.jit(jax.grad(lambda p: jnp.sum(nn.transformer(p, tokens, remat=remat) ** 2)))  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12), grad(remat)(params), grad(False)(params))
    temp = lambda remat: grad(remat).lower(params).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(remat) < 0.8 * temp(False)


def test_data_parallel_gradient_under_shard_equals_single_device():
    params = nn.init_transformer(KEY, dtype=jnp.float64, **dict(CONFIG, depth=1))
    tokens = jnp.asarray(RNG.integers(0, 13, (8, 10)))
    segments = jnp.tile(SEGMENTS_10, (4, 1))

    @jax.jit  # one program each, not op by op (most of this test's time went to small compiles)
    @jf.shard(in_specs=(P(), P("data"), P("data")), out_specs=P())
    def sharded_grad(params, tokens, segments):
        # params are replicated, so their gradient is already summed over devices by JAX's
        # typing (the transpose of the implicit broadcast): differentiate the mean loss.
        return jax.grad(lambda p: jf.collectives.all_reduce(loss(p, tokens, segments), "data", op="mean"))(params)

    # One row per device: the mean of per-device losses is the mean of per-row losses.
    got = sharded_grad(params, tokens, segments)
    want = jax.jit(jax.grad(lambda p: jnp.mean(jax.vmap(loss, in_axes=(None, 0, 0))(p, tokens, segments))))(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13)


def test_context_parallel_training_under_explicit_sharding_equals_single_device():
    """Tokens, targets and segment ids split over the batch ("data") and the sequence ("seq") of an
    explicit mesh: jit partitions the whole model (the embedding gathers rows split as its ids are;
    attention gathers k and v along the sequence), and the loss and gradients equal one device's."""
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    params = nn.init_transformer(KEY, dtype=jnp.float64, **dict(CONFIG, depth=1))
    tokens, segments = jnp.asarray(RNG.integers(0, 13, (4, 17))), jnp.asarray(np.sort(RNG.integers(0, 3, (4, 17)), axis=1))

    def loss_of(params, inputs, targets, segments):
        logits = nn.transformer(params, inputs, mask=jf.masks.causal() & jf.masks.document(segments))
        return nn.cross_entropy(logits, targets)

    args = (tokens[:, :-1], tokens[:, 1:], segments[:, :-1])  # the shift made before the split
    value, grads = jax.jit(jax.value_and_grad(loss_of))(params, *args)
    with jax.set_mesh(mesh):
        split = [jax.device_put(x, P("data", "seq")) for x in args]
        got_value, got_grads = jax.jit(jax.value_and_grad(loss_of))(jax.device_put(params, P()), *split)
    np.testing.assert_allclose(got_value, value, rtol=1e-12)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13), got_grads, grads)


def test_context_parallel_training_under_shard_equals_single_device():
    """Inside jf.shard, each of 4 devices holds two chunks of every sequence in load_balance's
    head–tail order (tokens, targets, rotary positions); attention is all_gather_attention under a
    document & causal mask over the global positions (the ids whole on every device). Loss and
    gradients equal one device's."""
    n, par = 4, jf.parallel
    params = nn.init_transformer(KEY, dtype=jnp.float64, **dict(CONFIG, depth=1))
    tokens, segments = jnp.asarray(RNG.integers(0, 13, (2, 33))), jnp.asarray(np.sort(RNG.integers(0, 3, (2, 33)), axis=1))
    inputs, targets, segments, positions = tokens[:, :-1], tokens[:, 1:], segments[:, :-1], jnp.arange(32)[None]

    def loss_of(params, inputs, targets, segments, positions, attention_fn=jf.attention):
        mask = jf.masks.document(segments) & jf.masks.causal()
        return nn.cross_entropy(nn.transformer(params, inputs, mask=mask, positions=positions, attention_fn=attention_fn), targets)

    sequence = P(None, "sp")

    @jax.jit
    @jf.shard(mesh=jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n]), in_specs=(P(), sequence, sequence, P(), sequence), out_specs=P())
    def context_parallel(params, inputs, targets, segments, positions):
        attend = functools.partial(par.all_gather_attention, axis_name="sp")
        # Every device holds as many tokens: the mean of their mean losses is the mean loss.
        mean_loss = lambda p: jf.collectives.all_reduce(loss_of(p, inputs, targets, segments, positions, attend), "sp", op="mean")  # noqa: E731
        return jax.value_and_grad(mean_loss)(params)

    balanced = [par.load_balance(x, n, axis=1) for x in (inputs, targets, positions)]
    value, grads = context_parallel(params, *balanced[:2], segments, balanced[2])
    want_value, want_grads = jax.jit(jax.value_and_grad(loss_of))(params, inputs, targets, segments, positions)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13), grads, want_grads)


# -- bad input ------------------------------------------------------------------------------------


def unchecked(fn):
    """``fn`` without the test suite's annotation check, to reach its own argument checks."""
    return inspect.unwrap(fn)


def test_bad_input_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"linear: `x` must have 3 features in dim -1, got shape \(2, 4\)"):
        nn.linear(nn.init_linear(KEY, 3, 2), jnp.ones((2, 4)))
    with pytest.raises(TypeError, match=r"embedding: `ids` must be integers, got dtype float"):
        unchecked(nn.embedding)(nn.init_embedding(KEY, 5, 2), jnp.ones(3))
    with pytest.raises(ValueError, match=r"rotary_embedding: `x` needs an even head_dim"):
        nn.rotary_embedding(jnp.ones((4, 2, 5)), jnp.arange(4))
    with pytest.raises(ValueError, match=r"`num_heads` \(6\) must be a positive multiple of `num_kv_heads` \(4\)"):
        nn.init_multi_head_attention(KEY, 12, 6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"lstm: `xs` must have 3 features"):
        nn.lstm(nn.init_lstm(KEY, 3, 2), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match=r"gru: `xs` must have shape \(\.\.\., time, 3\), got shape \(3,\)"):
        unchecked(nn.gru)(nn.init_gru(KEY, 3, 2), jnp.ones(3))
    params = nn.init_transformer(KEY, **CONFIG)
    cache = nn.init_kv_cache(params["blocks"]["attention"], (2,), 12)
    with pytest.raises(ValueError, match=r"multi_head_attention: `cache` holds items of batch shape \(2,\) .* batch shape \(3,\)"):
        nn.transformer(params, jnp.zeros((3, 1), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match=r"cross_entropy: `labels` shape \(3,\) must equal"):
        unchecked(nn.cross_entropy)(jnp.ones((4, 5)), jnp.zeros(3, int))
    with pytest.raises(TypeError, match=r"cross_entropy: `labels` must be integers, got dtype float"):
        unchecked(nn.cross_entropy)(jnp.ones((4, 5)), jnp.zeros(4))
    with pytest.raises(ValueError, match=r"init_transformer: `depth` must be positive"):
        nn.init_transformer(KEY, **dict(CONFIG, depth=0))


def test_shape_annotations_are_checked_in_tests():
    pytest.importorskip("beartype")  # conftest checks shapes only where beartype is installed
    # Integer activations violate `Float[Array, ...]`; the check runs before the body.
    with pytest.raises(jaxtyping.TypeCheckError):
        nn.rms_norm(nn.init_rms_norm(4), jnp.ones((2, 4), jnp.int32))
    # A positions array whose length disagrees with `seq` violates the shared dim name.
    with pytest.raises(jaxtyping.TypeCheckError):
        nn.rotary_embedding(jnp.ones((4, 2, 8)), jnp.arange(5))
