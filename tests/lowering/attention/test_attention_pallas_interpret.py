"""The Pallas Triton kernels' logic, run on CPU in Pallas interpret mode, against the dense reference.

Small tiles (8×16) make every program loop over several key (or query) tiles, skip tiles outside
the mask's span, and meet padded edges (lengths 19 and 29 are not multiples of the tiles)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.functional.attention import Implementation

PALLAS = Implementation("pallas_triton", block_q=8, block_kv=16)
PACKED = Implementation("pallas_triton", block_q=8, block_kv=16, pack_gqa=True)  # HQ / HKV = 2 heads a row pair
B, SQ, SKV, HQ, HKV, D, DV = 2, 19, 29, 4, 2, 8, 6

rng = np.random.default_rng(0)
SEGMENTS = jnp.asarray(np.sort(rng.integers(0, 3, (B, SQ)), axis=1))
KV_SEGMENTS = jnp.asarray(np.sort(rng.integers(0, 3, (B, SKV)), axis=1))
SCATTERED = jnp.asarray(rng.integers(0, 3, (B, SKV)))  # a document's positions need not be contiguous
MASKS = {
    "none": lambda: None,
    "causal_bottom_right": lambda: jf.masks.causal(SKV - SQ),
    "window_causal": lambda: jf.masks.sliding_window(6) & jf.masks.causal(4),
    "document": lambda: jf.masks.document(SEGMENTS, KV_SEGMENTS),
    "scattered_documents_causal": lambda: jf.masks.document(SCATTERED[:, :SQ], SCATTERED) & jf.masks.causal(),
    "prefix_lm": lambda: jf.masks.prefix_lm(5),
    "prefix_per_item": lambda: jf.masks.prefix_lm(jnp.asarray([3, 11])),
    "causal_per_item": lambda: jf.masks.causal(jnp.asarray([SKV - SQ, -4])),
    "padding_per_item": lambda: jf.masks.padding(jnp.asarray([29, 7]), jnp.asarray([12, 19])),
    "chunked_or_window": lambda: jf.masks.chunked(8) | jf.masks.sliding_window(3),
    "window_or_chunk_per_item": lambda: (  # runtime bands and chunk ids, one an item
        jf.masks.sliding_window(jnp.asarray([4, 9])) & jf.masks.causal() | jf.masks.chunked(jnp.asarray([5, 8]))
    ),
    "fully_masked_rows": lambda: jf.masks.from_mask_mod(lambda b, h, i, j: (i % 5 != 0) & (j <= i + 3)),
    "block_mask_per_head": lambda: jf.masks.block_mask(  # frame-causal over a window per head: RangeSpan's tiles
        lambda b, h, i, j: (i // 5 >= j // 5) & (j > i - 6 * (h + 1)), SQ, SKV, num_heads=HQ
    ),
    # a library mask evaluated: its ids still reach the kernels positionally (its mask_mod gathers)
    "block_mask_of_documents": lambda: jf.masks.block_mask(
        jf.masks.document(SCATTERED[:, :SQ], SCATTERED) & jf.masks.causal(), SQ, SKV, batch_shape=(B,)
    ),
}


def inputs(seed=1, d=D, dv=DV):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.standard_normal(s)) for s in ((B, SQ, HQ, d), (B, SKV, HKV, d), (B, SKV, HKV, dv)))


# Head dims of 48 and 40, each held in two pieces of 32 + 16 (config.head_pieces) where the
# Implementation asks: every product sums over the pieces, every result keeps them.
PIECES = Implementation("pallas_triton", block_q=8, block_kv=16, head_pieces=True)
PIECE_DIMS = dict(d=48, dv=40)


def dims(impl) -> dict:
    return PIECE_DIMS if isinstance(impl, Implementation) and impl.head_pieces else {}


def run(implementation, mask, **kw):
    return lambda q, k, v: jf.attention(q, k, v, mask=MASKS[mask](), implementation=implementation, **kw)


# Split-KV (forward, tangent, backward's dq): each program's key tiles over 2 (3) programs, some of
# which see no key (window, padding)
SPLIT = Implementation("pallas_triton", block_q=8, block_kv=16, kv_splits=2)
SPLIT_PACKED = Implementation("pallas_triton", block_q=8, block_kv=8, pack_gqa=True, kv_splits=3)
VARIANTS = {
    "packed": (PACKED, ["causal_bottom_right", "window_causal", "document", "padding_per_item", "fully_masked_rows"]),
    "split": (SPLIT, ["none", "window_causal", "padding_per_item", "fully_masked_rows"]),
    "split_packed": (SPLIT_PACKED, ["causal_per_item", "document"]),
    "pieces": (PIECES, ["none", "causal_bottom_right", "document", "fully_masked_rows"]),
    "split_packed_pieces": (dataclasses.replace(SPLIT_PACKED, head_pieces=True), ["causal_per_item"]),
}


@pytest.mark.parametrize(
    "impl,mask",
    [(PALLAS, m) for m in sorted(MASKS)] + [(impl, m) for impl, masks in VARIANTS.values() for m in masks],
    ids=[m for m in sorted(MASKS)] + [f"{v}-{m}" for v, (_, masks) in VARIANTS.items() for m in masks],
)
def test_forward_lse_jvp_and_grad_match_xla(impl, mask):
    ours, ref = run(impl, mask, return_lse=True, softcap=4.0), run("xla", mask, return_lse=True, softcap=4.0)
    check_matches(ours, ref, inputs(**dims(impl)), inputs(seed=2, **dims(impl)))


def test_block_mask_pieces_match_the_plain_mask_on_xla():
    """``block_mask(ranges=2)`` of sink keys and a window far past them (rows cut at key tile [16,
    32)): each primitive in two Triton calls that skip each other's tiles, merged through their lse;
    against the plain mask_mod on XLA."""
    sq, skv = 24, 70
    fn = lambda b, h, i, j: (j < 4) | ((j > i + 36) & (j <= i + 46))  # noqa: E731
    shapes = ((1, sq, HQ, D), (1, skv, HKV, D), (1, skv, HKV, DV))
    q, k, v, *tangents = (jnp.asarray(np.random.default_rng(4).standard_normal(s)) for s in shapes * 2)
    attend = lambda impl, mask: (lambda q, k, v: jf.attention(q, k, v, mask=mask, implementation=impl, return_lse=True))  # noqa: E731
    check_matches(attend(PALLAS, jf.masks.block_mask(fn, sq, skv, ranges=2)), attend("xla", fn), (q, k, v), tuple(tangents))


def check_matches(ours, ref, args, tangents):
    """Out, lse, their jvp and a gradient through both of ``ours`` against ``ref``."""
    q, k, v = args
    (out, lse), (want_out, want_lse) = ours(q, k, v), ref(q, k, v)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(want_lse), 0, want_lse), atol=1e-12)
    for a, b in zip(jax.jvp(ours, (q, k, v), tangents)[1], jax.jvp(ref, (q, k, v), tangents)[1]):
        np.testing.assert_allclose(a, b, atol=1e-11)
    loss = lambda f: (lambda *a: jnp.sum(f(*a)[0] ** 2) + jnp.sum(jnp.where(jnp.isinf(f(*a)[1]), 0, f(*a)[1])))
    for a, b in zip(jax.grad(loss(ours), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-11)
        assert np.isfinite(a).all()


def test_sinks_through_the_kernels_lse_match_xla():
    """Sinks rescale the kernels' output through their lse: the backward kernels take its cotangent."""
    q, k, v = inputs()
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    f = lambda impl: (lambda q, k, v, sinks: jf.attention(q, k, v, mask=jf.masks.causal(-3), sinks=sinks, implementation=impl))
    args = (q, k, v, sinks)
    np.testing.assert_allclose(f(PALLAS)(*args), f("xla")(*args), atol=1e-12)
    tangents = (*inputs(seed=2), jnp.asarray([1.0, 2.0, -1.0, 0.5]))
    np.testing.assert_allclose(jax.jvp(f(PALLAS), args, tangents)[1], jax.jvp(f("xla"), args, tangents)[1], atol=1e-11)
    loss = lambda impl: (lambda *a: jnp.sum(jnp.sin(f(impl)(*a))))
    for a, b in zip(jax.grad(loss(PALLAS), (0, 1, 2, 3))(*args), jax.grad(loss("xla"), (0, 1, 2, 3))(*args)):
        np.testing.assert_allclose(a, b, atol=1e-11)


THROUGH_A_JVP = ["none", "window_causal", "document", "fully_masked_rows"]


@pytest.mark.parametrize(
    "impl,mask",
    [(PALLAS, m) for m in THROUGH_A_JVP] + [(PACKED, "causal_per_item"), (PIECES, "window_causal")],
    ids=THROUGH_A_JVP + ["packed-causal_per_item", "pieces-window_causal"],
)
def test_grad_through_a_jvp_matches_xla(impl, mask):
    """A gradient through a jvp, in all six of (q, k, v, dq, dk, dv): the first-order kernels and the
    tangent map's transpose in two kernels (tangent_bwd rows and cols), against XLA's tiles; the
    loss reads out, dout and dlse."""
    args = (*inputs(**dims(impl)), *inputs(seed=2, **dims(impl)))

    def loss(impl):
        attend = lambda q, k, v: jf.attention(q, k, v, mask=MASKS[mask](), softcap=4.0, implementation=impl, return_lse=True)

        def f(q, k, v, dq, dk, dv):
            (out, lse), (dout, dlse) = jax.jvp(attend, (q, k, v), (dq, dk, dv))
            return jnp.sum(jnp.sin(dout)) + jnp.sum(jnp.where(jnp.isinf(lse), 0, dlse) ** 2) + jnp.sum(out**2)

        return f

    for a, b in zip(jax.grad(loss(impl), tuple(range(6)))(*args), jax.grad(loss("xla"), tuple(range(6)))(*args)):
        np.testing.assert_allclose(a, b, atol=1e-11)
        assert np.isfinite(a).all()


def test_grad_through_a_jvp_along_a_captured_bias_matches_xla():
    """The jvp also along a bias the score_mod reads at points (its tangent read beside it in the
    kernels), then a gradient in q, k, v and the bias's tangent."""
    q, k, v = inputs()
    r = np.random.default_rng(5)
    bias, dbias = (jnp.asarray(r.standard_normal((HQ, SQ + SKV))) for _ in range(2))

    def loss(impl):
        def f(q, k, v, dbias):
            attend = lambda q, bias: jf.attention(  # noqa: E731
                q, k, v, mask=jf.masks.causal(SKV - SQ), score_mod=lambda s, b, h, i, j: s + bias[h, i - j + SKV], implementation=impl)
            return jnp.sum(jnp.sin(jax.jvp(attend, (q, bias), (q, dbias))[1]))

        return f

    argnums = (0, 1, 2, 3)
    for a, b in zip(jax.grad(loss(PALLAS), argnums)(q, k, v, dbias), jax.grad(loss("xla"), argnums)(q, k, v, dbias)):
        np.testing.assert_allclose(a, b, atol=1e-11)


def test_against_the_dense_reference_with_a_captured_bias_and_its_gradient():
    q, k, v = inputs()
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((HQ, SQ + SKV)))

    def f(q, k, v, bias, implementation):
        score_mod = lambda s, b, h, i, j: s + bias[h, i - j + SKV]
        return jf.attention(q, k, v, mask=jf.masks.causal(SKV - SQ), score_mod=score_mod, implementation=implementation)

    np.testing.assert_allclose(f(q, k, v, bias, PALLAS), f(q, k, v, bias, "xla"), atol=1e-12)
    loss = lambda impl: (lambda *a: jnp.sum(jnp.sin(f(*a, impl))))
    for a, b in zip(jax.grad(loss(PALLAS), (0, 1, 2, 3))(q, k, v, bias), jax.grad(loss("xla"), (0, 1, 2, 3))(q, k, v, bias)):
        np.testing.assert_allclose(a, b, atol=1e-11)


# Masks and score_mods reading captured arrays, which the kernels read an element at a time:
# (arrays, mods(*arrays) -> attention keywords). Their tangents enter the tangent kernel.
CAPTURED = {
    "alibi_slopes": ((rng.random(HQ),), lambda slopes: dict(score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i))),
    "relative_bias_causal": (
        (rng.standard_normal((HQ, SQ + SKV)),),
        lambda bias: dict(score_mod=lambda s, b, h, i, j: s + bias[h, i - j + SKV], mask=jf.masks.causal(SKV - SQ)),
    ),
    "rows_and_columns_of_tables": (  # bias[h] is a row, read later at one element
        (rng.standard_normal((HQ, SQ + SKV)), rng.standard_normal((7, 5))),
        lambda bias, table: dict(score_mod=lambda s, b, h, i, j: s + bias[h][i - j + SKV] * table[:, j % 5][i % 7]),
    ),
    "bias_hiding_scores_with_minus_inf": (  # whole rows hidden too: out 0, no NaN anywhere
        (np.where(rng.random((HQ, SQ + SKV)) < 0.3, -np.inf, rng.standard_normal((HQ, SQ + SKV))),),
        lambda bias: dict(score_mod=lambda s, b, h, i, j: s + bias[h, i - j + SKV] + jnp.where(i == 4, -jnp.inf, 0.0)),
    ),
    "bias_table_read_out_of_range": (  # negative indices wrap, larger ones clamp, as jnp's do
        (rng.standard_normal((B, HQ, 7, 5)),),
        lambda table: dict(score_mod=lambda s, b, h, i, j: s * table[b, -h, i - 3, j]),
    ),
    "per_item_and_scalar_temperatures": (
        (rng.random(B) + 0.5, np.asarray(1.5)),
        lambda temps, t: dict(score_mod=lambda s, b, h, i, j: s * temps[b] / t, softcap=3.0),
    ),
    "mask_tables_and_lengths": (
        (rng.random((7, 5)) > 0.3, np.asarray([13, 29])),
        lambda table, lengths: dict(mask=lambda b, h, i, j: (table[i % 7, j % 5] | (i == j)) & (j < lengths[b])),
    ),
    "mask_array_per_item_and_head": (  # jax.nn's layout, given as mask=
        (np.random.default_rng(31).random((B, HQ, SQ, SKV)) > 0.5,),
        lambda visible: dict(mask=visible),
    ),
    "mask_array_of_keys_per_item_and_causal": (  # (B, 1, 1, SKV): padding as jax.nn users write it
        (np.arange(SKV) < np.asarray([SKV, 11])[:, None, None, None],),
        lambda visible: dict(mask=jf.masks.causal(SKV - SQ) & visible),
    ),
}


@pytest.mark.parametrize(
    "impl,case", [(PALLAS, c) for c in sorted(CAPTURED)] + [(PACKED, "alibi_slopes"), (PACKED, "rows_and_columns_of_tables"), (PIECES, "alibi_slopes")],
    ids=[c for c in sorted(CAPTURED)] + ["packed-alibi_slopes", "packed-rows_and_columns_of_tables", "pieces-alibi_slopes"],
)  # fmt: skip
def test_captured_arrays_read_at_points_match_xla(impl, case):
    """Forward, jvp and grad of the kernels reading captured arrays an element at a time, against
    XLA's; the arrays' tangents and gradients (summed by the dq kernel) included. Packed, the
    query heads of a tile's rows differ: a per-head array is read at a column of heads."""
    arrays, mods = CAPTURED[case]
    arrays = tuple(jnp.asarray(a) for a in arrays)
    floats = tuple(i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.floating))

    def f(implementation):
        def attend(q, k, v, *floats_given):
            given = dict(zip(floats, floats_given))
            return jf.attention(q, k, v, **mods(*(given.get(i, a) for i, a in enumerate(arrays))), implementation=implementation)

        return attend

    args = (*inputs(**dims(impl)), *(arrays[i] for i in floats))
    r = np.random.default_rng(5)
    tangents = tuple(jnp.asarray(r.standard_normal(a.shape)) for a in args)
    loss = lambda impl: (lambda *a: jnp.sum(jnp.sin(f(impl)(*a))))
    argnums = tuple(range(len(args)))
    got, want = [
        (f(i)(*args), jax.jvp(f(i), args, tangents)[1], *jax.grad(loss(i), argnums)(*args)) for i in (impl, "xla")
    ]
    for n, (a, b) in enumerate(zip(got, want)):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, atol=1e-12 if n == 0 else 1e-11)  # the output, then derivatives


def test_vmapped_captured_arrays_are_read_and_summed_at_each_items_points():
    """A bias with a vmapped axis: each program reads its own item's, and adds to its cotangent."""
    q, k, v = inputs()
    biases = jnp.asarray(np.random.default_rng(6).standard_normal((3, HQ, SQ + SKV)))
    f = lambda bias, q, impl: jf.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h, i - j + SKV], implementation=impl)
    loss = lambda impl: (lambda bias, q: jnp.sum(jnp.sin(f(bias, q, impl))))
    got = jax.vmap(lambda bias, q: f(bias, q, PALLAS), in_axes=(0, None))(biases, q)
    tangent = jax.vmap(lambda bias, db: jax.jvp(lambda x: f(x, q, PALLAS), (bias,), (db,))[1])(biases, 2 * biases)
    grads = jax.vmap(jax.grad(loss(PALLAS)), in_axes=(0, None))(biases, q)
    for i, bias in enumerate(biases):
        np.testing.assert_allclose(got[i], f(bias, q, "xla"), atol=1e-12)
        np.testing.assert_allclose(tangent[i], jax.jvp(lambda x: f(x, q, "xla"), (bias,), (2 * bias,))[1], atol=1e-11)
        np.testing.assert_allclose(grads[i], jax.grad(loss("xla"))(bias, q), atol=1e-11)


def test_functions_gathering_from_captured_arrays_are_refused():
    q, k, v = inputs()
    bias = jnp.asarray(np.random.default_rng(7).standard_normal((HQ, SKV)))
    fill = lambda s, b, h, i, j: s + jnp.take(bias[h], i - j, mode="fill", fill_value=0.0)  # a row, then a gather
    np.testing.assert_allclose(jf.attention(q, k, v, score_mod=fill), jf.attention(q, k, v, score_mod=fill, implementation="xla"))
    with pytest.raises(ValueError, match="one element at a time"):
        jf.attention(q, k, v, score_mod=fill, implementation=PALLAS)


def test_vmap_folds_into_the_kernel_grid():
    q, k, v = inputs()
    scales = jnp.asarray([0.5, 1.0, 2.0])
    f = jax.vmap(lambda c, q, k, v: run(PALLAS, "causal_bottom_right")(c * q, k, v), in_axes=(0, None, 1, None), out_axes=1)
    stacked_k = jnp.stack([k, 2 * k, -k], axis=1)
    got = f(scales, q, stacked_k, v)
    for i, (c, ki) in enumerate(zip(scales, (k, 2 * k, -k))):
        np.testing.assert_allclose(got[:, i], run("xla", "causal_bottom_right")(c * q, ki, v), atol=1e-12)


def test_vmapped_segment_ids_reach_each_program_sliced():
    """Positional mask arrays (segment ids) with a vmapped axis: each program reads its own item's."""
    q, k, v = inputs()
    stacked = jnp.stack([SCATTERED, KV_SEGMENTS, jnp.zeros_like(SCATTERED)])
    f = lambda seg, impl: jf.attention(q, k, v, mask=jf.masks.document(seg[:, :SQ], seg) & jf.masks.causal(), implementation=impl)
    got = jax.jit(jax.vmap(lambda seg: f(seg, PALLAS)))(stacked)
    reference = jax.jit(lambda seg: f(seg, "xla"))
    for i, seg in enumerate(stacked):
        np.testing.assert_allclose(got[i], reference(seg), atol=1e-12)


def test_float32_kernel_matches_the_float64_reference():
    q, k, v = (x.astype(jnp.float32) for x in inputs())
    out = run(PALLAS, "window_causal")(q, k, v)
    want = run("xla", "window_causal")(*(x.astype(jnp.float64) for x in (q, k, v)))
    np.testing.assert_allclose(out, want, atol=2e-6)


@pytest.mark.parametrize("impl", [PALLAS, Implementation("pallas_triton", block_q=8, block_kv=8, kv_splits=3)], ids=["whole", "split"])
def test_decoding_steps_pack_gqa_heads_and_match_xla(impl):
    """Three queries a head, GQA 3:1: packed by default (config.packs_gqa), each tile of 8 rows
    splits some query's heads; ALiBi reads its slopes at a column of heads, and the dq kernel adds
    their cotangents there (split: from 3 programs a tile). Forward, jvp and grad against XLA's
    unpacked tiles."""
    r = np.random.default_rng(9)
    q, k, v = (jnp.asarray(r.standard_normal(s)) for s in ((B, 3, 6, D), (B, SKV, 2, D), (B, SKV, 2, DV)))
    slopes = jnp.asarray(r.random(6))

    def f(impl):
        alibi = lambda slopes: lambda s, b, h, i, j: s - slopes[h] * (i + SKV - 3 - j)  # noqa: E731
        return lambda q, k, v, slopes: jf.attention(
            q, k, v, mask=jf.masks.causal(SKV - 3), score_mod=alibi(slopes), implementation=impl
        )

    args, unpacked = (q, k, v, slopes), Implementation("xla", pack_gqa=False)
    tangents = tuple(jnp.asarray(r.standard_normal(a.shape)) for a in args)
    loss = lambda impl: (lambda *a: jnp.sum(jnp.sin(f(impl)(*a))))
    got, want = [(f(i)(*args), jax.jvp(f(i), args, tangents)[1], *jax.grad(loss(i), (0, 1, 2, 3))(*args)) for i in (impl, unpacked)]
    for n, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=1e-12 if n == 0 else 1e-11)


SHARDED_MASKS = {  # built inside the shard from the local blocks of the segment ids
    "causal_bottom_right": lambda seg_q, seg_kv: jf.masks.causal(SKV - SQ),
    "document_causal": lambda seg_q, seg_kv: jf.masks.document(seg_q, seg_kv) & jf.masks.causal(),
}


@pytest.mark.parametrize(
    "impl,mask", [(PALLAS, m) for m in sorted(SHARDED_MASKS)] + [(PIECES, "document_causal")], ids=[*sorted(SHARDED_MASKS), "pieces-document_causal"]
)
def test_kernels_run_inside_shard_map(impl, mask):
    """Inside jf.shard (check_vma on) each device's kernels see their batch block: forward, jvp,
    grad and a grad through the jvp against the unsharded XLA lowering (pallas_call there needs
    its outputs' varying axes; head dims in pieces, those of tuples of them)."""
    q, k, v = inputs(**dims(impl))

    def attend(implementation):
        return lambda q, k, v, seg_q, seg_kv: jf.attention(
            q, k, v, mask=SHARDED_MASKS[mask](seg_q, seg_kv), implementation=implementation
        )

    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("data")
    sharded = jf.shard(attend(impl), mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    ours = lambda q, k, v: sharded(q, k, v, SCATTERED[:, :SQ], SCATTERED)
    ref = lambda q, k, v: attend("xla")(q, k, v, SCATTERED[:, :SQ], SCATTERED)
    tangents = inputs(seed=2, **dims(impl))
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
    jvp_loss = lambda f: (lambda *a: jnp.sum(jnp.sin(jax.jvp(f, a[:3], a[3:])[1])))
    six = tuple(range(6))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: (
            ours(*a[:3]), jax.jvp(ours, a[:3], a[3:])[1], jax.grad(loss(ours), (0, 1, 2))(*a[:3]), jax.grad(jvp_loss(ours), six)(*a)))
        out, dout, grads, through = got(q, k, v, *tangents)
    np.testing.assert_allclose(out, ref(q, k, v), atol=1e-12)
    np.testing.assert_allclose(dout, jax.jvp(ref, (q, k, v), tangents)[1], atol=1e-11)
    for a, b in zip(grads, jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-11)
    for a, b in zip(through, jax.grad(jvp_loss(ref), six)(q, k, v, *tangents)):
        np.testing.assert_allclose(a, b, atol=1e-11)


def test_a_captured_bias_and_its_gradient_inside_shard_map():
    """The bias replicated, q, k, v split along the batch: each device's dq kernel sums its share
    of the bias's cotangent, and the shares meet in one sum; forward, jvp and grad against XLA."""
    q, k, v = inputs()
    bias = jnp.asarray(np.random.default_rng(8).standard_normal((HQ, SQ + SKV)))

    def attend(implementation):
        score_mod = lambda bias: lambda s, b, h, i, j: s + bias[h, i - j + SKV]  # noqa: E731
        return lambda q, k, v, bias: jf.attention(
            q, k, v, mask=jf.masks.causal(SKV - SQ), score_mod=score_mod(bias), implementation=implementation
        )

    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    split, whole = jax.sharding.PartitionSpec("data"), jax.sharding.PartitionSpec()
    ours = jf.shard(attend(PALLAS), mesh=mesh, in_specs=(split, split, split, whole), out_specs=split)
    ref = attend("xla")
    args, tangents = (q, k, v, bias), (*inputs(seed=2), 2 * bias)
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: (ours(*a[:4]), jax.jvp(ours, a[:4], a[4:])[1], *jax.grad(loss(ours), (0, 1, 2, 3))(*a[:4])))
        got = got(*args, *tangents)
    want = (ref(*args), jax.jvp(ref, args, tangents)[1], *jax.grad(loss(ref), (0, 1, 2, 3))(*args))
    for n, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=1e-12 if n == 0 else 1e-11)
