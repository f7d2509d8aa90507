"""Bad input to jf.attention and jf.masks: clear errors at trace time that name the argument."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.functional.attention import Implementation
from jaxforge.primitives.attention.attention import attention_fwd_p
from jaxforge.primitives.attention.mods import Mods

masks = jf.masks


def qkv(b=2, sq=5, skv=7, hq=4, hkv=2, d=8, dv=6, dtype=jnp.float32):
    return jnp.ones((b, sq, hq, d), dtype), jnp.ones((b, skv, hkv, d), dtype), jnp.ones((b, skv, hkv, dv), dtype)


def abstract(*arrays):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]


# --- q, k, v ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(), (4,), (5, 8)])
def test_rank_below_three(name, shape):
    args = dict(zip("qkv", qkv()))
    args[name] = jnp.ones(shape)
    with pytest.raises(ValueError, match=rf"attention: `{name}` must have rank >= 3 \(\.\.\., seq, heads, head_dim\), got shape"):
        jf.attention(**args)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_, jnp.complex64])
def test_rejected_dtypes(name, dtype):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name].astype(dtype)
    pattern = rf"attention: `{name}` has dtype {np.dtype(dtype).name}; accepted: bfloat16, float16, float32, float64"
    with pytest.raises(TypeError, match=pattern):  # named before the dtypes are compared
        jf.attention(**args)


def test_integer_q_k_v_all_rejected():
    q, k, v = (x.astype(jnp.int32) for x in qkv())
    with pytest.raises(TypeError, match=r"attention: `q` has dtype int32; accepted"):
        jf.attention(q, k, v)


@pytest.mark.parametrize("dtypes", [(jnp.float32, jnp.float64, jnp.float64), (jnp.float32, jnp.float32, jnp.bfloat16), (jnp.float16, jnp.bfloat16, jnp.float16)])
def test_mismatched_dtypes(dtypes):
    q, k, v = (x.astype(t) for x, t in zip(qkv(), dtypes))
    names = ", ".join(np.dtype(t).name for t in dtypes)
    with pytest.raises(TypeError, match=rf"attention: q, k, v must share one dtype, got {names}"):
        jf.attention(q, k, v)


def test_head_dim_mismatch_between_q_and_k():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"attention: q and k must share head_dim, got q \(2, 5, 4, 8\) and k \(2, 7, 2, 6\)"):
        jf.attention(q, k[..., :6], v)


@pytest.mark.parametrize("v_shape", [(2, 6, 2, 6), (2, 7, 1, 6), (2, 7, 4, 6)], ids=["seq", "heads", "more_heads"])
def test_k_and_v_seq_or_heads_mismatch(v_shape):
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=r"attention: k and v must share \(seq, heads\), got k \(2, 7, 2, 8\) and v"):
        jf.attention(q, k, jnp.ones(v_shape, jnp.float32))


@pytest.mark.parametrize("hq,hkv", [(4, 3), (2, 4), (5, 2)])
def test_query_heads_not_a_multiple_of_kv_heads(hq, hkv):
    q, k, v = qkv(hq=hq, hkv=hkv)
    with pytest.raises(ValueError, match=rf"attention: the number of query heads must be a multiple of the key/value heads \(GQA\), got q heads {hq} and k/v heads {hkv}"):
        jf.attention(q, k, v)


def test_zero_kv_heads():
    q, k, v = qkv(hkv=0)
    with pytest.raises(ValueError, match=r"multiple of the key/value heads"):
        jf.attention(q, k, v)


@pytest.mark.parametrize("batches", [((2,), (3,), (2,)), ((2, 3), (2,), (2, 3)), ((2, 4), (4,), (3, 1))])
def test_batch_dims_that_do_not_broadcast(batches):
    q, k, v = qkv()
    q, k, v = (jnp.ones((*b, *x.shape[1:])) for b, x in zip(batches, (q, k, v)))
    with pytest.raises(ValueError, match=r"attention: the leading dims of q .*, k .* and v .* do not broadcast"):
        jf.attention(q, k, v)


# --- mask and score_mod ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask, got",
    [
        (lambda b, h, i, j: i - j, r"int32\[\]"),
        (lambda b, h, i, j: (i - j) * 1.0, r"float"),
        (lambda b, h, i, j: jnp.ones(2, bool), r"bool\[2\]"),
        (lambda b, h, i, j: (j <= i, j >= i), r"bool\[\], bool\[\]"),
    ],
    ids=["int", "float", "vector", "tuple"],
)
def test_mask_must_return_a_boolean_scalar(mask, got):
    with pytest.raises(TypeError, match=rf"attention: `mask` must return a boolean scalar .*got {got}"):
        jf.attention(*qkv(), mask=mask)


def test_combined_mask_with_a_bad_mask_mod():
    with pytest.raises(TypeError, match=r"attention: `mask` must return a boolean scalar"):
        jf.attention(*qkv(), mask=masks.causal() & masks.from_mask_mod(lambda b, h, i, j: jnp.ones((3,), bool)))


@pytest.mark.parametrize(
    "score_mod, got",
    [
        (lambda s, b, h, i, j: i - j, r"int32\[\]"),
        (lambda s, b, h, i, j: s > 0, r"bool\[\]"),
        (lambda s, b, h, i, j: jnp.ones(3) * s, r"float\d+\[3\]"),
        (lambda s, b, h, i, j: (s, s), r"float\d+\[\], float\d+\[\]"),
        (lambda s, b, h, i, j: s * 1j, r"complex"),
    ],
    ids=["int", "bool", "vector", "tuple", "complex"],
)
def test_score_mod_must_return_a_floating_scalar(score_mod, got):
    with pytest.raises(TypeError, match=rf"attention: `score_mod` must return a floating-point scalar .*got {got}"):
        jf.attention(*qkv(), score_mod=score_mod)


TABLE = np.ones((7, 7), bool)


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(mask=lambda b, h, i, j: TABLE[i, j]), r"attention: `mask` turns its traced arguments into numpy values .*jnp\.asarray"),
        (dict(mask=masks.from_mask_mod(lambda b, h, i, j: TABLE[i, j])), r"attention: `mask` turns its traced arguments into numpy"),
        (dict(score_mod=lambda s, b, h, i, j: s + np.float32(TABLE[i, j])), r"attention: `score_mod` turns its traced arguments into numpy"),
        (dict(mask=lambda b, h, i, j: (i >= j) and (i - j < 4)), r"attention: `mask` branches in Python .*jnp\.where and the operators &, \|, ~"),
        (dict(score_mod=lambda s, b, h, i, j: s if i > j else -s), r"attention: `score_mod` branches in Python on its traced arguments"),
    ],
    ids=["numpy-mask", "numpy-mask-mod", "numpy-score-mod", "and-mask", "if-score-mod"],
)
def test_python_on_the_traced_indices_is_named(kw, error):
    """FlexAttention habits that tracing refuses (a numpy table, Python's `and` and `if`) get a hint."""
    with pytest.raises(TypeError, match=error):
        jf.attention(*qkv(), **kw)


@pytest.mark.parametrize("mask", ["causal", 3, [[True]]], ids=["str", "int", "list"])
def test_mask_of_the_wrong_type(mask):
    expected = r"mask: expected a jf\.masks\.Mask, a callable mask_mod\(b, h, q_idx, kv_idx\) -> bool or a boolean array, got"
    with pytest.raises(TypeError, match=expected):
        jf.attention(*qkv(), mask=mask)


def test_combining_a_mask_with_a_non_mask():
    with pytest.raises(TypeError, match=r"mask: expected a jf\.masks\.Mask, a callable .*got str"):
        masks.causal() & "window"
    with pytest.raises(TypeError, match=r"mask: expected .*got int"):
        1 | masks.causal()


def test_score_mod_not_callable():
    with pytest.raises(TypeError, match=r"attention: `score_mod` must be a callable score_mod\(score, b, h, q_idx, kv_idx\), got str"):
        jf.attention(*qkv(), score_mod="alibi")


def test_from_mask_mod_needs_a_callable():
    with pytest.raises(TypeError, match=r"from_mask_mod: expected a callable mask_mod"):
        masks.from_mask_mod(np.ones((5, 7), bool))


# --- the masks' own arguments ----------------------------------------------------------------------


@pytest.mark.parametrize("ids", [np.zeros(4, np.int32), np.zeros(6, np.int32), np.zeros((2, 3), np.int32)], ids=["short", "long", "batched_short"])
def test_document_segment_ids_of_the_wrong_length(ids):
    with pytest.raises(ValueError, match=r"document: `segment_ids` has shape \(.*\); its last dim must be the sequence length 5"):
        jf.attention(*qkv(skv=5), mask=masks.document(ids))


def test_document_kv_segment_ids_of_the_wrong_length():
    mask = masks.document(np.zeros(5, np.int32), np.zeros(5, np.int32))  # Skv is 7
    with pytest.raises(ValueError, match=r"document: `kv_segment_ids` has shape \(5,\); its last dim must be the sequence length 7"):
        jf.attention(*qkv(), mask=mask)


def test_document_self_attention_ids_need_sq_equal_skv():
    with pytest.raises(ValueError, match=r"document: `kv_segment_ids` has shape \(5,\); its last dim must be the sequence length 7"):
        jf.attention(*qkv(), mask=masks.document(np.zeros(5, np.int32)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_])
def test_document_segment_ids_must_be_integers(dtype):
    with pytest.raises(TypeError, match=rf"document: `segment_ids` must be an integer array, got dtype {np.dtype(dtype).name}"):
        masks.document(np.zeros(5, dtype))
    with pytest.raises(TypeError, match=r"document: `kv_segment_ids` must be an integer array"):
        masks.document(np.zeros(5, np.int32), np.zeros(7, dtype))


def test_document_segment_ids_of_rank_zero():
    with pytest.raises(ValueError, match=r"document: `segment_ids` must have shape \(seq,\) or \(\*batch, seq\), got shape \(\)"):
        masks.document(np.int32(3))


def test_document_segment_ids_with_foreign_batch_dims():
    with pytest.raises(ValueError, match=r"document: `segment_ids` has leading dims \(3,\), which do not broadcast to the batch dims \(2,\) of q"):
        jf.attention(*qkv(skv=5), mask=masks.document(np.zeros((3, 5), np.int32)))


@pytest.mark.parametrize("window", [0, -3])
def test_sliding_window_must_be_positive(window):
    with pytest.raises(ValueError, match=rf"sliding_window: `window` must be >= 1, got {window}"):
        masks.sliding_window(window)


@pytest.mark.parametrize("window", [2.0, "4", None, True])
def test_sliding_window_must_be_an_int(window):
    with pytest.raises(TypeError, match=r"sliding_window: `window` must be a Python int, got"):
        masks.sliding_window(window)


@pytest.mark.parametrize(
    "offset", [1.5, 2.0, True, "3", jnp.asarray([1.0, 2.0])], ids=["float", "integral_float", "bool", "str", "float_array"]
)
def test_causal_offset_must_be_an_int_or_integer_array(offset):
    with pytest.raises(TypeError, match=r"causal: `offset` must be an int or an integer array, got"):
        masks.causal(offset)
    with pytest.raises(ValueError, match=r"causal: `offset` has leading dims \(3,\), which do not broadcast to the batch dims \(2,\) of q"):
        jf.attention(*qkv(), mask=masks.causal(jnp.array([1, 2, 3])))


def test_sliding_window_arguments():
    with pytest.raises(ValueError, match=r"sliding_window: `window` must be >= 1, got 0"):
        masks.sliding_window(0)
    with pytest.raises(TypeError, match=r"sliding_window: `window` must be an int or an integer array, got dtype float32"):
        masks.sliding_window(jnp.ones(2, jnp.float32))
    with pytest.raises(TypeError, match=r"sliding_window: `window` must be a Python int, got float 2.0"):
        masks.sliding_window(2.0)
    with pytest.raises(ValueError, match=r"sliding_window: `window` has leading dims \(3,\), which do not broadcast to the batch dims \(2,\) of q"):
        jf.attention(*qkv(), mask=masks.sliding_window(jnp.array([1, 2, 3])))


def test_chunked_arguments():
    with pytest.raises(ValueError, match=r"chunked: `chunk` must be >= 1, got 0"):
        masks.chunked(0)
    with pytest.raises(TypeError, match=r"chunked: `chunk` must be a Python int"):
        masks.chunked(8.0)
    with pytest.raises(TypeError, match=r"chunked: `chunk` must be an int or an integer array, got dtype float32"):
        masks.chunked(jnp.ones(2, jnp.float32))
    with pytest.raises(ValueError, match=r"chunked: `chunk` has leading dims \(3,\), which do not broadcast to the batch dims \(2,\) of q"):
        jf.attention(*qkv(), mask=masks.chunked(jnp.array([1, 2, 3])))


def test_prefix_lm_arguments():
    with pytest.raises(ValueError, match=r"prefix_lm: `prefix_len` must be >= 0, got -1"):
        masks.prefix_lm(-1)
    with pytest.raises(TypeError, match=r"prefix_lm: `prefix_len` must be an int or an integer array, got dtype float"):
        masks.prefix_lm(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"prefix_lm: `prefix_len` has leading dims \(3,\), which do not broadcast to the batch dims \(2,\) of q"):
        jf.attention(*qkv(), mask=masks.prefix_lm(jnp.array([1, 2, 3])))


def test_padding_arguments():
    with pytest.raises(ValueError, match=r"padding: `kv_lengths` must be >= 0, got -2"):
        masks.padding(-2)
    with pytest.raises(TypeError, match=r"padding: `q_lengths` must be an int or an integer array, got dtype float"):
        masks.padding(3, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"padding: `kv_lengths` has leading dims \(3,\), which do not broadcast to the batch dims \(2,\) of q"):
        jf.attention(*qkv(), mask=masks.padding(jnp.array([1, 2, 3])))


def test_block_mask_arguments():
    frames = lambda b, h, i, j: i // 2 >= j // 2  # noqa: E731
    with pytest.raises(TypeError, match=r"block_mask: expected a callable mask_mod\(b, h, q_idx, kv_idx\), got ndarray"):
        masks.block_mask(np.ones((5, 7), bool), 5, 7)
    for name, lengths in (("q_len", (5.0, 7)), ("kv_len", (5, None))):
        with pytest.raises(TypeError, match=rf"block_mask: `{name}` must be a Python int"):
            masks.block_mask(frames, *lengths)
    with pytest.raises(ValueError, match=r"block_mask: `kv_len` must be >= 0, got -1"):
        masks.block_mask(frames, 5, -1)
    with pytest.raises(TypeError, match=r"block_mask: `mask_mod` must return a boolean scalar .*got int32\[\]"):
        masks.block_mask(lambda b, h, i, j: i - j, 5, 7)
    with pytest.raises(ValueError, match=r"block_mask: `mask_mod` reads its batch index b; pass batch_shape="):
        masks.block_mask(lambda b, h, i, j: (b == 0) | (j <= i), 5, 7)
    with pytest.raises(ValueError, match=r"block_mask: `mask_mod` reads its head index h; pass num_heads="):
        masks.block_mask(lambda b, h, i, j: j <= i + h, 5, 7)
    with pytest.raises(TypeError, match=r"block_mask: `batch_shape` must be a tuple of non-negative ints, got 2"):
        masks.block_mask(lambda b, h, i, j: (b == 0) | (j <= i), 5, 7, batch_shape=2)
    with pytest.raises(ValueError, match=r"block_mask: `num_heads` must be >= 1, got 0"):
        masks.block_mask(lambda b, h, i, j: j <= i + h, 5, 7, num_heads=0)
    with pytest.raises(ValueError, match=r"block_mask: `ranges` must be >= 1, got 0"):
        masks.block_mask(frames, 5, 7, ranges=0)
    with pytest.raises(TypeError, match=r"block_mask: `ranges` must be a Python int, got float 2.0"):
        masks.block_mask(frames, 5, 7, ranges=2.0)


def test_block_mask_of_another_shape_than_the_call():
    with pytest.raises(ValueError, match=r"block_mask: evaluated for q_len=5, kv_len=6; the call has 5 queries and 7 keys"):
        jf.attention(*qkv(), mask=masks.block_mask(lambda b, h, i, j: j <= i, 5, 6))
    with pytest.raises(ValueError, match=r"block_mask: evaluated on num_heads=2 query heads \(its mask_mod reads h\); the call has 4"):
        jf.attention(*qkv(), mask=masks.causal() & masks.block_mask(lambda b, h, i, j: j <= i + h, 5, 7, num_heads=2))
    by_item = masks.block_mask(lambda b, h, i, j: j <= i + b, 5, 7, batch_shape=(3,))
    with pytest.raises(ValueError, match=r"block_mask: evaluated on 3 batch items \(its mask_mod reads b\); the call has batch dims \(2,\)"):
        jf.attention(*qkv(), mask=by_item)
    by_item = masks.block_mask(lambda b, h, i, j: j <= i + b, 5, 7, batch_shape=(2,))
    with pytest.raises(ValueError, match=r"block_mask: evaluated on 2 batch items .*the call has batch dims \(\) \(under vmap, build"):
        jax.vmap(lambda q, k, v, mask: jf.attention(q, k, v, mask=mask))(*qkv(), by_item)  # b would be 0 for each item
    broadcast = masks.block_mask(lambda b, h, i, j: j <= i + 2, 5, 7, batch_shape=(3,))  # b unread: any batch
    assert jf.attention(*qkv(), mask=broadcast).shape == (2, 5, 4, 6)


def test_sinks_arguments():
    q, k, v = qkv()
    hq = q.shape[-2]
    with pytest.raises(TypeError, match=r"attention: `sinks` must be a floating-point array \(one logit per query head\), got dtype int"):
        jf.attention(q, k, v, sinks=jnp.arange(hq))
    with pytest.raises(ValueError, match=rf"attention: `sinks` has shape \({hq + 1},\), which does not broadcast to the rows' \(\.\.\., Sq, Hq\)"):
        jf.attention(q, k, v, sinks=jnp.zeros(hq + 1))
    with pytest.raises(ValueError, match=r"`sinks` has shape \(3, 1, 1, 1\)"):  # would broadcast the output up
        jf.attention(q, k, v, sinks=jnp.zeros((3, 1, 1, 1)))


# --- scale, softcap, implementation ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["scale", "softcap"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_scale_and_softcap_must_be_positive_and_finite(name, value):
    with pytest.raises(ValueError, match=rf"attention: `{name}` must be a positive finite float, got"):
        jf.attention(*qkv(), **{name: value})


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_scale_and_softcap_must_be_real_scalars(name):
    q, k, v = qkv()
    for value, got in (("0.5", "str '0.5'"), (True, "bool True"), (np.ones(2), "ndarray"), (jnp.complex64(1), "ArrayImpl")):
        with pytest.raises(TypeError, match=rf"attention: `{name}` must be a number or a concrete real scalar array, got {re.escape(got)}"):
            jf.attention(q, k, v, **{name: value})


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_a_traced_scale_or_softcap_must_be_a_real_scalar(name):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"attention: a traced `{name}` must be a real scalar, got float32\[2\]"):
        jax.jit(lambda c: jf.attention(q, k, v, **{name: c}))(jnp.ones(2, jnp.float32))
    with pytest.raises(TypeError, match=rf"attention: a traced `{name}` must be a real scalar, got complex64\[\]"):
        jax.jit(lambda c: jf.attention(q, k, v, **{name: c}))(jnp.complex64(1))


@pytest.mark.parametrize("implementation", ["triton", "XLA", "cudnn", 3, ("xla",)])
def test_unknown_implementation(implementation):
    got = re.escape(repr(implementation))  # what was passed, not an Implementation made of it
    with pytest.raises(ValueError, match=rf"attention: `implementation` must be None, one of \('xla', 'pallas_triton', 'pallas_mosaic_gpu'\) or an Implementation, got {got}$"):
        jf.attention(*qkv(), implementation=implementation)


def test_unknown_implementation_name_in_an_implementation():
    with pytest.raises(ValueError, match=r"attention: `implementation` must be None, one of"):
        jf.attention(*qkv(), implementation=Implementation("mosaic"))


@pytest.mark.parametrize("field", ["block_q", "block_kv", "num_stages", "kv_splits"])
@pytest.mark.parametrize("size", [0, -8, 16.0])
def test_implementation_tile_sizes(field, size):
    with pytest.raises(ValueError, match=rf"attention: Implementation\.{field} must be a positive int, got"):
        jf.attention(*qkv(), implementation=Implementation("xla", **{field: size}))


@pytest.mark.parametrize(
    "fields", [dict(block_q=128), dict(block_kv=32), dict(num_warps=4), dict(pack_gqa=True), dict(kv_splits=2)], ids=str
)
def test_mosaic_gpu_tiles(fields):
    with pytest.raises(ValueError, match=r"Implementation\('pallas_mosaic_gpu'\) takes block_q None or 64 .* got"):
        jf.attention(*qkv(), implementation=Implementation("pallas_mosaic_gpu", **fields))


@pytest.mark.parametrize("field", ["pack_gqa", "head_pieces"])
@pytest.mark.parametrize("value", [1, "yes"])
def test_implementation_switches_are_bools(field, value):
    with pytest.raises(ValueError, match=rf"attention: Implementation\.{field} must be None, True or False, got {value!r}"):
        jf.attention(*qkv(), implementation=Implementation("xla", **{field: value}))


@pytest.mark.parametrize("warps", [0, 3, 32, 4.0])
def test_implementation_num_warps(warps):
    with pytest.raises(ValueError, match=r"attention: Implementation\.num_warps must be one of 1, 2, 4, 8, 16, got"):
        jf.attention(*qkv(), implementation=Implementation("pallas_triton", num_warps=warps))


# --- at trace time -----------------------------------------------------------------------------------


def test_errors_are_raised_at_trace_time():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q and k must share head_dim"):
        jax.eval_shape(jf.attention, *abstract(q, k[..., :4], v))
    with pytest.raises(TypeError, match=r"`q` has dtype int32"):
        jax.jit(jf.attention).lower(*abstract(q.astype(jnp.int32), k, v))
    with pytest.raises(TypeError, match=r"`mask` must return a boolean scalar"):
        jax.eval_shape(lambda q, k, v: jf.attention(q, k, v, mask=lambda b, h, i, j: i), *abstract(q, k, v))
    with pytest.raises(ValueError, match=r"document: `segment_ids` has shape"):
        jax.jit(lambda q, k, v, ids: jf.attention(q, k, v, mask=masks.document(ids))).lower(
            *abstract(q, k, v), jax.ShapeDtypeStruct((2, 4), jnp.int32)
        )


def test_errors_under_vmap_name_the_argument():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q and k must share head_dim"):
        jax.vmap(jf.attention)(q[None], k[None, ..., :4], v[None])


def test_direct_bind_checks_too():
    q, k, v = qkv()
    params = dict(mods=Mods(), scale=0.5, max_scores=False, first_keys=False, implementation=Implementation())
    with pytest.raises(TypeError, match=r"attention: `k` has dtype int32"):
        attention_fwd_p.bind(q, k.astype(jnp.int32), v, **params)
    with pytest.raises(ValueError, match=r"attention: q, k, v must share their batch dims"):
        attention_fwd_p.bind(q, k[None], v[None], **params)
    with pytest.raises(ValueError, match=r"first_keys=True needs max_scores=True"):
        attention_fwd_p.bind(q, k, v, **params | dict(first_keys=True))
