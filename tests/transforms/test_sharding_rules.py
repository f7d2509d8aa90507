"""The sharding rule shared by every primitive (primitives/_core.register_lowering): with the batch
sharded on an explicit mesh, the lowering runs per shard — kernels see local shapes, no operand is
gathered — on 8 CPU devices."""

from __future__ import annotations

import ctypes
import functools
import math
import pathlib
import re
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxforge as jf
from jaxforge.primitives import _core
from jaxforge.primitives.attention.attention import attention_fwd_p

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@pytest.fixture(scope="module")
def batch():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
    return NamedSharding(mesh, P("batch"))


def compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def collectives(text):
    return {k: n for k in KINDS if (n := len(re.findall(rf"\s{k}(-start)?\(", text)))}


def test_svd_runs_lapack_on_the_local_batch(batch):
    a = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((16, 6, 4))), batch)
    text = compiled(lambda a: jf.linalg.svd(a), a)
    assert collectives(text) == {}
    calls = [line for line in text.splitlines() if "custom-call(" in line and "gesdd" in line]
    assert calls and all("f64[2,6,4]" in line for line in calls), calls  # 16 / 8 matrices per device
    grad = compiled(jax.grad(lambda a: jnp.sum(jf.linalg.svd(a, compute_uv=False))), a)
    assert collectives(grad) == {}


def test_lstsq_forward_and_gradient_stay_local(batch):
    rng = np.random.default_rng(1)
    a, b = (jax.device_put(jnp.asarray(x), batch) for x in (rng.standard_normal((16, 9, 4)), rng.standard_normal((16, 9))))
    loss = lambda a, b: jnp.sum(jf.linalg.lstsq(a, b).solution ** 2)
    want = jax.jit(jax.grad(loss, (0, 1)))(np.asarray(a), np.asarray(b))
    got = jax.jit(jax.grad(loss, (0, 1)))(a, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
        assert g.sharding.spec[0] == "batch"
    text = compiled(jax.grad(loss, (0, 1)), a, b)
    # Only the lax.cond predicate (does any matrix need the rank-deficient branch?) and the
    # scalar loss's sum may cross devices; nothing is gathered.
    assert "all-gather" not in collectives(text)


@pytest.mark.parametrize("implementation", ["xla", jf.functional.attention.Implementation("pallas_triton", 8, 8)])
def test_attention_per_shard_with_global_batch_index(batch, implementation):
    """A mask and score_mod that read the batch index b must see the global index on every shard."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((8, 16, 2, 4)) for _ in range(3))
    seg = np.sort(rng.integers(0, 3, (8, 16)), axis=1)
    bias = rng.standard_normal((2, 32))

    def loss(q, k, v, bias, seg):
        out = jf.attention(
            q, k, v,
            mask=jf.masks.document(seg) & jf.masks.causal(),
            score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 16] + 0.25 * b,
            implementation=implementation,
        )  # fmt: skip
        return jnp.sum(out**2)

    args = [jax.device_put(jnp.asarray(x), batch) for x in (q, k, v)] + [jnp.asarray(bias)]
    sharded_seg = jax.device_put(jnp.asarray(seg), batch)
    got = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(*args, sharded_seg)
    want = jax.value_and_grad(loss, (0, 1, 2, 3))(q, k, v, bias, seg)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-11)
    # Without captured arrays nothing crosses devices; the bias's gradient is one all-reduce.
    plain = lambda q, k, v: jnp.sum(jf.attention(q, k, v, mask=jf.masks.causal(), implementation=implementation))
    for fn in (plain, jax.grad(plain, (0, 1, 2)), lambda q, k, v: jax.jvp(plain, (q, k, v), (q, k, v))):
        assert set(collectives(compiled(fn, *args[:3]))) <= {"all-reduce"}  # the scalar sum only
    outputs = compiled(lambda q, k, v: jf.attention(q, k, v, implementation=implementation), *args[:3])
    assert collectives(outputs) == {}


_Impl = jf.functional.attention.Implementation


def _inside_the_mesh_as_outside(batch, cases, split: int = 2):
    """Each ``(fn, args)`` jitted inside ``jax.set_mesh`` (every value's type then carries its
    sharding), its first ``split`` args split like the batch and the rest replicated, gives what it
    gives outside, its results of the batch's size split like it."""
    place = lambda i, x: jax.device_put(jnp.asarray(x), batch if i < split else NamedSharding(batch.mesh, P()))  # noqa: E731
    with jax.set_mesh(batch.mesh):
        got = [jax.jit(fn)(*(place(i, x) for i, x in enumerate(args))) for fn, args in cases]
    for (fn, args), result in zip(cases, got):
        for g, w in zip(jax.tree.leaves(result), jax.tree.leaves(jax.jit(fn)(*args))):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-11)
            assert g.sharding.spec[0] == "batch" or g.shape[0] != len(args[0])


def test_lstsq_derivatives_inside_a_set_explicit_mesh(batch):
    """The zeros the rules make take their operand's sharding; triangular_solve's derivative in its
    matrix, which jax's sharding types refuse on a split batch, runs under automatic axes. First
    and second derivatives and the transpose in b, one matrix rank-deficient."""
    rng = np.random.default_rng(10)
    a, b = rng.standard_normal((16, 6, 4)), rng.standard_normal((16, 6, 2))
    a[3, :, 3] = a[3, :, 0]
    solve = lambda a, b: jf.linalg.lstsq(a, b)[:2]  # noqa: E731
    hvp = lambda a, b: jax.jvp(jax.grad(lambda a: jnp.sum(jnp.sin(solve(a, b)[0]))), (a,), (b[..., :1] * a,))[1]  # noqa: E731
    _inside_the_mesh_as_outside(batch, [
        (jax.grad(lambda a, b: sum(jnp.sum(x**2) for x in solve(a, b)), (0, 1)), (a, b)),
        (lambda a, b: jax.jvp(solve, (a, b), (b[..., :1] * a, b))[1], (a, b)),
        (hvp, (a, b)),
        (lambda a, b: jax.linear_transpose(lambda b: solve(a, b)[0], b)(solve(a, b)[0])[0], (a, b)),
    ])  # fmt: skip


def test_attention_derivatives_inside_a_set_explicit_mesh(batch):
    """The transpose rules place a cotangent like its output, and the transpose in v makes its zeros
    for v split like v; the dense second-order rules and the maxima's tangent (each row's key
    gathered) run under automatic axes, with a mask and a score mod that read tables at the batch
    index (jax's vmap and gathers refuse index arrays split otherwise than what they index)."""
    rng = np.random.default_rng(11)
    q, k, v, table = (rng.standard_normal(s) for s in ((8, 12, 2, 4),) * 3 + ((2, 8),))
    sinks, lengths = jnp.asarray(rng.standard_normal(2)), jnp.asarray(rng.integers(1, 13, 8))
    cotangent = rng.standard_normal(q.shape)  # replicated: the transpose rules place it like the output

    def attend(q, k, v, table, **kw):
        mask = jf.masks.causal() & jf.masks.from_mask_mod(lambda b, h, i, j: j < lengths[b])
        return jf.attention(q, k, v, mask=mask, score_mod=lambda s, b, h, i, j: s + table[h, b], sinks=sinks, **kw)

    loss = lambda *args: jnp.sum(jnp.sin(attend(*args)))  # noqa: E731
    largest = lambda *args: jnp.sum(jnp.sin(attend(*args, return_max_scores=True)[1]))  # noqa: E731
    _inside_the_mesh_as_outside(batch, [
        (lambda q, k, v, table: jax.linear_transpose(lambda v: attend(q, k, v, table), v)(q)[0], (q, k, v, table)),
        (lambda *args: jax.jvp(jax.grad(loss, (0, 1, 2, 3)), args, args[::-1][1:] + args[3:])[1], (q, k, v, table)),
        (jax.grad(largest, (0, 1, 3)), (q, k, v, table)),
        (lambda q, k, v, table: jax.vjp(lambda q: attend(q, k, v, table), q)[1](jnp.asarray(cotangent)), (q, k, v, table)),
    ], split=3)  # fmt: skip
    with jax.set_mesh(batch.mesh):  # each row's key gathered along the keys alone: k is not
        placed = [jax.device_put(jnp.asarray(x), batch) for x in (q, k, v)]
        assert "all-gather" not in collectives(compiled(jax.grad(largest, (0, 1)), *placed, table))


def test_attention_transposes_in_v_with_its_keys_split_along_the_sequence(batch):
    """The key shards' parts merge through their lse, which stays known where v alone is not (its
    total is a psum apart from the weighted outputs'): ``jax.linear_transpose`` in v holds."""
    rng = np.random.default_rng(12)
    q, k, v, g = (rng.standard_normal(s) for s in ((2, 8, 2, 4), (2, 16, 2, 4), (2, 16, 2, 4), (2, 8, 2, 4)))
    attend = lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal(), sinks=jnp.asarray([0.5, -1.0]))  # noqa: E731
    in_v = lambda q, k, v: jax.linear_transpose(lambda v: attend(q, k, v), v)(jnp.asarray(g))[0]  # noqa: E731
    keys = NamedSharding(batch.mesh, P(None, "batch"))
    with jax.set_mesh(batch.mesh):
        got = jax.jit(in_v)(q, jax.device_put(k, keys), jax.device_put(v, keys))
    np.testing.assert_allclose(got, jax.vjp(lambda v: attend(q, k, v), v)[1](g)[0], rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize(
    "implementation",
    ["xla", _Impl("pallas_triton", 8, 8), _Impl("xla", pack_gqa=True), _Impl("pallas_triton", 8, 8, pack_gqa=True)],
)
def test_attention_split_over_batch_and_heads(implementation):
    """A 2×4 mesh splits the batch and the heads (GQA: 8 query heads over 4 kv heads); head- and
    batch-dependent score mods see global indices, and no float operand is gathered."""
    mesh = jax.make_mesh((2, 4), ("data", "heads"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    split = NamedSharding(mesh, P("data", None, "heads"))
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((4, 12, 8, 4), (4, 12, 4, 4), (4, 12, 4, 4)))
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, 8))

    def loss(q, k, v, slopes):
        alibi = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j) + 0.1 * b
        out = jf.attention(q, k, v, mask=jf.masks.causal(), score_mod=alibi, implementation=implementation)
        return jnp.sum(out**2)

    args = [jax.device_put(jnp.asarray(x), split) for x in (q, k, v)]
    got = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(*args, slopes)
    want = jax.value_and_grad(loss, (0, 1, 2, 3))(q, k, v, slopes)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-11)
    assert got[1][0].sharding.spec == P("data", None, "heads", None)
    text = compiled(lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal(), implementation=implementation), *args)
    assert collectives(text) == {}


def test_core_dims_other_than_heads_and_sequences_stay_an_error():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    q = jax.device_put(jnp.ones((2, 16, 2, 8)), NamedSharding(mesh, P(None, None, None, "x")))
    fix = r"reshard it first to P\(None, None, None, None\) \(jax.sharding.reshard\).*only the heads and the sequences"
    with pytest.raises(ValueError, match=r"attention: `q` is sharded along a core dim.*" + fix):
        jf.attention(q, q, q)
    # q's heads split beside its sequence, k's and v's single head (MQA) cannot follow
    mesh = jax.make_mesh((2, 4), ("model", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    q = jax.device_put(jnp.ones((2, 16, 2, 8)), NamedSharding(mesh, P(None, "seq", "model")))
    with pytest.raises(ValueError, match=r"attention: q's heads are split over model \(2 shards\) beside its sequence, but k and v have 1 heads"):
        jf.attention(q, jnp.ones((2, 16, 1, 8)), jnp.ones((2, 16, 1, 8)))


@pytest.mark.parametrize("case", ["ring_window", "local_bias"])
def test_attention_inside_a_shard_map_manual_over_some_axes(case):
    """Context parallelism over a manual "seq" axis while the batch stays explicitly sharded on
    "data": the mask's and score_mod's traced programs (their trace-time mesh is the caller's)
    run in the per-shard code of the remaining axis. Values and gradients equal one device's."""
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 32, 2, 8))) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal(15))
    window = jf.masks.causal() & jf.masks.sliding_window(6)
    if case == "ring_window":
        body = lambda q, k, v: jf.parallel.ring_attention(q, k, v, axis_name="seq", mask=window, load_balanced=False)
        want = lambda q, k, v: jf.attention(q, k, v, mask=window)
    else:  # each shard's 8 tokens attend among themselves, with a relative bias from a table
        score_mod = lambda s, b, h, i, j: s + bias[jnp.clip(i - j, -7, 7) + 7]
        body = lambda q, k, v: jf.attention(q, k, v, mask=window, score_mod=score_mod)
        chunks = lambda x: x.reshape(4, 4, 8, 2, 8)  # (batch, shard, token, head, dim)
        want = lambda q, k, v: jax.vmap(body, in_axes=1, out_axes=1)(*map(chunks, (q, k, v))).reshape(q.shape)
    f = lambda q, k, v: jax.shard_map(body, mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"), axis_names={"seq"})(q, k, v)
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, NamedSharding(mesh, P("data", "seq"))) for x in (q, k, v)]
        out = jax.jit(f)(*args)
        grads = jax.jit(jax.grad(loss(f), (0, 1, 2)))(*args)
    assert out.sharding.spec == P("data", "seq", None, None)
    np.testing.assert_allclose(out, want(q, k, v), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, jax.grad(loss(want), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)


QUERY_SPLITS = {  # name: (mask, score_mod, sinks), over global positions
    "window_alibi": (jf.masks.causal() & jf.masks.sliding_window(7), lambda s, b, h, i, j: s - 0.3 * (h + 1) * (i - j), None),
    "prefix_per_item_sinks": (jf.masks.prefix_lm(jnp.asarray([3, 20, 0, 9])) & jf.masks.causal(), None, jnp.asarray([0.5, -1.0])),
    "chunked_bias": (jf.masks.chunked(12), lambda s, b, h, i, j: s + jnp.sin(0.1 * (i - j)), None),
}


@pytest.mark.parametrize("name", sorted(QUERY_SPLITS))
def test_queries_split_along_the_sequence_attend_every_key(name):
    """q sharded along its sequence (explicitly, over "seq"; its batch over "data"), k and v whole
    there: each shard attends its queries at their global positions, as jax.nn partitions it; out
    and lse keep q's split. Values, lse and gradients equal one device's."""
    mask, score_mod, sinks = QUERY_SPLITS[name]
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in ((4, 32, 2, 8), (4, 24, 2, 8), (4, 24, 2, 6)))
    attend = lambda q, k, v: jf.attention(q, k, v, mask=mask, score_mod=score_mod, sinks=sinks, return_lse=True)
    loss = lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)[0])) + jnp.sum(jnp.where(jnp.isfinite(l := attend(q, k, v)[1]), l, 0))
    with jax.set_mesh(mesh):
        qs = jax.device_put(q, NamedSharding(mesh, P("data", "seq")))
        ks, vs = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (k, v))
        out, lse = jax.jit(attend)(qs, ks, vs)
        grads = jax.jit(jax.grad(loss, (0, 1, 2)))(qs, ks, vs)
    assert out.sharding.spec == P("data", "seq", None, None) and tuple(lse.sharding.spec)[:2] == ("data", "seq")
    want_out, want_lse = attend(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, jax.grad(loss, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)
    tangents = tuple(jnp.cos(x) for x in (q, k, v))  # replicated: resharded like the primals
    with jax.set_mesh(mesh):
        _, (d_out, _) = jax.jit(lambda *a: jax.jvp(attend, a[:3], a[3:]))(qs, ks, vs, *tangents)
    np.testing.assert_allclose(d_out, jax.jvp(attend, (q, k, v), tangents)[1][0], rtol=1e-11, atol=1e-11)


def test_arrays_a_score_mod_or_mask_mod_closes_over_go_into_the_sequence_split():
    """A score_mod (a relative bias) and a plain mask_mod (segment ids) closing over arrays passed
    into jit, q split along its sequence: the shard_map takes them whole as operands (its code
    cannot close over an explicit mesh's arrays), the bias's gradient summed over the shards.
    Values, gradients (the bias's too) and a jvp equal one device's; a bias split over the mesh,
    which jax cannot index by scalars, is a clear error."""
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(14)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 32, 2, 8))) for _ in range(3))
    bias, ids = jnp.asarray(rng.standard_normal((2, 63))), jnp.asarray(np.sort(rng.integers(0, 3, (4, 32)), axis=-1))
    attend = lambda q, k, v, bias, ids: jf.attention(
        q, k, v, mask=lambda b, h, i, j: (ids[b, i] == ids[b, j]) & (i >= j), score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 31]
    )
    loss = lambda *a: jnp.sum(jnp.sin(attend(*a)))
    tangents = (jnp.cos(q), jnp.cos(bias))
    jvp = lambda q, k, v, bias, ids, dq, dbias: jax.jvp(lambda q, bias: attend(q, k, v, bias, ids), (q, bias), (dq, dbias))[1]
    with jax.set_mesh(mesh):
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
        args = (*(put(x, P("data", "seq")) for x in (q, k, v)), put(bias, P()), put(ids, P()))
        out, grads = jax.jit(attend)(*args), jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*args)
        d_out = jax.jit(jvp)(*args, *tangents)
        with pytest.raises(TypeError, match=r"`score_mod` reads an array split over explicit mesh axes .*reshard"):
            jax.jit(attend)(*args[:3], put(bias, P("data")), args[4])
    np.testing.assert_allclose(out, attend(q, k, v, bias, ids), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, jax.grad(loss, (0, 1, 2, 3))(q, k, v, bias, ids)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(d_out, jvp(q, k, v, bias, ids, *tangents), rtol=1e-11, atol=1e-12)


SEQUENCE_SPLITS = {  # name: a mask of per-position arrays, from segment ids (4, 32) or a table (4, 1, 32, 32)
    "document&causal": lambda ids, table: jf.masks.document(ids) & jf.masks.causal(),
    "array|window": lambda ids, table: jf.masks.from_array(table) | jf.masks.sliding_window(3),
}


@pytest.mark.parametrize("name", sorted(SEQUENCE_SPLITS))
def test_every_sequence_split_gathers_the_keys_and_slices_the_masks_arrays(name):
    """q, k, v and the mask's arrays all split along the sequence (jax.nn refuses this): k and v are
    gathered whole, each shard of q attends under the mask's rows of its queries. Values,
    gradients (split as their primals) and a jvp match one device's."""
    build = SEQUENCE_SPLITS[name]
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 32, 2, 8))) for _ in range(3))
    ids, table = jnp.asarray(np.sort(rng.integers(0, 5, (4, 32)), axis=-1)), jnp.asarray(rng.random((4, 1, 32, 32)) < 0.3)
    loss = lambda q, k, v, mask: jnp.sum(jnp.sin(jf.attention(q, k, v, mask=mask)))
    with jax.set_mesh(mesh):
        split = lambda x, spec=P("data", "seq"): jax.device_put(x, NamedSharding(mesh, spec))
        args = (*map(split, (q, k, v)), build(split(ids), split(table, P("data", None, "seq"))))
        out = jax.jit(lambda q, k, v, mask: jf.attention(q, k, v, mask=mask))(*args)
        grads = jax.jit(jax.grad(loss, (0, 1, 2)))(*args)
    mask = build(ids, table)
    np.testing.assert_allclose(out, jf.attention(q, k, v, mask=mask), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, jax.grad(loss, (0, 1, 2))(q, k, v, mask)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)
    assert out.sharding.spec == P("data", "seq", None, None)
    assert all(g.sharding.spec == P("data", "seq", None, None) for g in grads)
    tangents = tuple(jnp.cos(x) for x in (q, k, v))  # through the shard_map, the mask's integer arrays beside
    attend = lambda mask, *qkv: jf.attention(*qkv, mask=mask)
    with jax.set_mesh(mesh):
        d_out = jax.jit(lambda mask, *a: jax.jvp(lambda *qkv: attend(mask, *qkv), a[:3], a[3:])[1])(args[3], *args[:3], *tangents)
    np.testing.assert_allclose(d_out, jax.jvp(lambda *qkv: attend(mask, *qkv), (q, k, v), tangents)[1], rtol=1e-11, atol=1e-11)


KEY_SPLITS = {  # name: (mask of per-item lengths (4,) and ids (the queries' (4, 8), the keys' (4, 32)), a score_mod over a table (4, 64), sinks, q's spec, k's and v's spec)
    "decoding over caches": (lambda lengths, ids: jf.masks.causal(lengths - 8), None, None, P("data"), P("data", "seq")),
    "documents, bias and sinks": (
        lambda lengths, ids: jf.masks.document(*ids) & jf.masks.causal(24),
        lambda table: lambda s, b, h, i, j: s + table[h, i - j + 32],
        jnp.linspace(-1, 1, 4),
        P("data"),
        P(None, "seq"),
    ),
    "heads split, rows that see no key": (lambda lengths, ids: jf.masks.sliding_window(2) & jf.masks.causal(lengths - 11), None, None, P(None, None, "data"), P(None, "seq", "data")),
    "queries split too, over another axis": (
        lambda lengths, ids: jf.masks.document(*ids) & jf.masks.causal(24),
        lambda table: lambda s, b, h, i, j: s + table[h, i - j + 32],
        None,
        P(None, "seq"),
        P(None, "data"),
    ),
}


@pytest.mark.parametrize("name", list(KEY_SPLITS))
def test_keys_split_along_the_sequence_attend_where_they_lie_and_merge(name):
    """k and v split along their sequence over mesh axes q does not use, q's sequence whole (a
    decoding step over a sequence-split KV cache, a short prompt over a long context) or split over
    another axis: each device attends its queries to its own keys, the mask and score_mod at their
    global positions, and the parts merge through their lse (one pmax, one psum of the rows): k
    and v are never gathered, their gradients stay split.
    Values, lse (-inf where a row sees no key on any device), gradients (the table's too) and a
    jvp equal one device's."""
    build, score_mod, sinks, q_spec, kv_spec = KEY_SPLITS[name]
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(15)
    q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((4, 8, 4, 8), (4, 32, 2, 8), (4, 32, 2, 6)))
    lengths, kv_ids = jnp.asarray([32, 9, 20, 8]), jnp.asarray(np.sort(rng.integers(0, 4, (4, 32)), axis=-1))
    ids = (kv_ids[:, 24:], kv_ids)  # the queries are the last 8 positions
    table = jnp.asarray(rng.standard_normal((4, 64)))
    attend = lambda q, k, v, table, lengths, ids: jf.attention(
        q, k, v, mask=build(lengths, ids), score_mod=score_mod and score_mod(table), sinks=sinks, return_lse=True
    )
    loss = lambda *a: jnp.sum(jnp.sin(attend(*a)[0])) + jnp.sum(jnp.where(jnp.isfinite(l := attend(*a)[1]), l, 0))
    jvp = lambda q, k, v, table, lengths, ids, *t: jax.jvp(lambda *x: attend(*x, lengths, ids)[0], (q, k, v, table), t)[1]
    tangents = tuple(jnp.cos(x) for x in (q, k, v, table))
    with jax.set_mesh(mesh):
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
        args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec), put(table, P()), put(lengths, P()), (put(ids[0], P()), put(ids[1], P(None, "seq"))))
        (out, lse), grads = jax.jit(attend)(*args), jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*args)
        d_out = jax.jit(jvp)(*args, *tangents)
        text = compiled(jax.grad(loss, (0, 1, 2, 3)), *args)
    want_out, want_lse = attend(q, k, v, table, lengths, ids)
    assert np.isneginf(want_lse).any() == (name == "heads split, rows that see no key")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.where(np.isneginf(want_lse), 0, lse), np.where(np.isneginf(want_lse), 0, want_lse), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, jax.grad(loss, (0, 1, 2, 3))(q, k, v, table, lengths, ids)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(d_out, jvp(q, k, v, table, lengths, ids, *tangents), rtol=1e-11, atol=1e-12)
    assert out.sharding.spec == q_spec + (None,) * (4 - len(q_spec)) and grads[1].sharding.spec == kv_spec + (None,) * (4 - len(kv_spec))
    gathered = re.findall(r"= f64\[([\d,]+)\][^\n]*\sall-gather(?:-start)?\(", text)  # float arrays' (k's gradient to its own batch split)
    assert all(int(shape.split(",")[1]) < 32 for shape in gathered), gathered  # none whole along the sequence


TRADES = {  # name: (mask, q's length, mesh axes, q's spec, k's and v's spec, whether the shards trade)
    "causal": (jf.masks.causal(), 32, ("data", "seq"), P("data", "seq"), P("data"), True),
    "causal, seq over two axes, heads split": (jf.masks.causal(), 32, ("h", "a", "b"), P(None, ("a", "b"), "h"), P(None, "a", "h"), True),
    "causal, seq over two axes out of the mesh's order": (jf.masks.causal(), 32, ("h", "a", "b"), P("h", ("b", "a")), P("h", "b"), True),
    "window": (jf.masks.causal() & jf.masks.sliding_window(5), 32, ("data", "seq"), P("data", "seq"), P("data"), False),
    "causal block_mask built outside jit": (jf.masks.block_mask(lambda b, h, i, j: i >= j, 32, 32), 32, ("data", "seq"), P("data", "seq"), P("data"), True),
    # built in the call (under jit): its arrays unknown when tracing, its function counted instead
    "causal block_mask built under jit": (functools.partial(jf.masks.block_mask, lambda b, h, i, j: i >= j, 32, 32), 32, ("data", "seq"), P("data", "seq"), P("data"), True),
    "bidirectional block_mask built under jit": (functools.partial(jf.masks.block_mask, lambda b, h, i, j: i // 8 == j // 8, 32, 32), 32, ("data", "seq"), P("data", "seq"), P("data"), False),
    # its document ids traced too (made in the call): its source's static part, causal, counted
    "block_mask of causal & documents built under jit": (
        lambda: jf.masks.block_mask(jf.masks.causal() & jf.masks.document(jnp.arange(32) // 12), 32, 32), 32, ("data", "seq"), P("data", "seq"), P("data"), True
    ),
    "causal, odd local length": (jf.masks.causal(), 36, ("data", "seq"), P("data", "seq"), P("data"), False),
}


@pytest.mark.parametrize("name", list(TRADES))
def test_shards_of_causal_queries_trade_halves_for_equal_work(name):
    """Under a causal mask the later queries see more keys: the shards of q trade halves of their
    queries into the head–tail layout (two collective-permutes each way, over the sequence's mesh
    axes in their order) so that each does the same work, and trade the results back. A sliding
    window leaves the work even (no trade), and so must an odd local length (36 over 4: no
    halves); a block_mask whose arrays are known when tracing is measured on them, one built in
    the call on its function. Values and gradients equal one device's."""
    mask, sq, axes, q_spec, kv_spec, trades = TRADES[name]
    built = mask if isinstance(mask, jf.masks.Mask) else None
    mesh = jax.make_mesh((2, 4) if len(axes) == 2 else (2, 2, 2), axes, axis_types=(jax.sharding.AxisType.Explicit,) * len(axes))
    rng = np.random.default_rng(12)
    q, k, v = (jnp.asarray(rng.standard_normal((2, sq, 2, 8))) for _ in range(3))
    attend = lambda q, k, v: jf.attention(q, k, v, mask=built or mask(), score_mod=lambda s, b, h, i, j: s - 0.1 * (h + 1) * (i - j))
    loss = lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))
    with jax.set_mesh(mesh):
        qs = jax.device_put(q, NamedSharding(mesh, q_spec))
        ks, vs = (jax.device_put(x, NamedSharding(mesh, kv_spec)) for x in (k, v))
        out, grads = jax.jit(attend)(qs, ks, vs), jax.jit(jax.grad(loss, (0, 1, 2)))(qs, ks, vs)
        permutes = collectives(compiled(attend, qs, ks, vs)).get("collective-permute", 0)
    assert permutes == (4 if trades else 0)  # q's halves there, out's back (the lse's are not used)
    np.testing.assert_allclose(out, attend(q, k, v), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, jax.grad(loss, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)


BESIDE = {  # name: (the other axis, q's shape (batch..., seq, heads, dim), its spec, the ids' spec, the dim gathers must keep split)
    "batch": ("data", (4, 32, 4, 8), P("data", "seq"), P("data", "seq"), 0),
    "second of two batch dims": ("data", (3, 4, 32, 2, 8), P(None, "data", "seq"), P(None, "data", "seq"), 1),
    "heads": ("model", (4, 32, 4, 8), P(None, "seq", "model"), P(None, "seq"), 2),
}


@pytest.mark.parametrize("name", list(BESIDE))
def test_a_sequence_split_beside_a_batch_or_heads_split_gathers_only_the_keys(name):
    """q, k, v split along the sequence and along a batch dim (or the heads) on one explicit mesh:
    the shard_map is manual over both, so no array is gathered along the batch (or heads) —
    jax's partially manual shard_map gathers them at its boundary — while the mask's per-item
    arrays (document ids, prefix lengths) and a score_mod reading ``b`` and ``h`` see global
    items and heads. Values and gradients equal one device's."""
    other, shape, spec, ids_spec, kept = BESIDE[name]
    mesh = jax.make_mesh((2, 4), (other, "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(13)
    q, k, v = (jnp.asarray(rng.standard_normal(shape)) for _ in range(3))
    batch, heads = shape[:-3], shape[-2]
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (*batch, 32)), axis=-1))
    prefix = jnp.asarray(rng.integers(0, 32, batch))
    slopes = jnp.asarray(rng.standard_normal((math.prod(batch), heads)))  # ALiBi, one slope per (item, head)
    mask = lambda ids, prefix: (jf.masks.document(ids) & jf.masks.causal()) | jf.masks.prefix_lm(prefix)
    attend = lambda q, k, v, ids, prefix: jf.attention(q, k, v, mask=mask(ids, prefix), score_mod=lambda s, b, h, i, j: s - slopes[b, h] * (i - j) / 8)
    loss = lambda *a: jnp.sum(jnp.sin(attend(*a)))
    with jax.set_mesh(mesh):
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
        args = (*(put(x, spec) for x in (q, k, v)), put(ids, ids_spec), put(prefix, P(*ids_spec[:-1])))
        out, grads = jax.jit(attend)(*args), jax.jit(jax.grad(loss, (0, 1, 2)))(*args)
        text = compiled(jax.grad(loss, (0, 1, 2)), *args)
    np.testing.assert_allclose(out, attend(q, k, v, ids, prefix), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, jax.grad(loss, (0, 1, 2))(q, k, v, ids, prefix)):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)
    assert out.sharding.spec == spec + (None,) * (len(shape) - len(spec))
    gathered = re.findall(r"= f64\[([\d,]+)\][^\n]*\sall-gather(?:-start)?\(", text)  # the float arrays' gathers
    assert gathered and all(int(s.split(",")[kept]) < shape[kept] for s in gathered), gathered
    with jax.set_mesh(mesh):
        (mods,) = {eqn.params["mods"] for eqn in equations(jax.make_jaxpr(attend)(*args).jaxpr) if eqn.primitive is attention_fwd_p}
    assert mods.mask.num_consts == 0 and mods.score.num_consts > 0  # only a function reading b or h reads the shard's offsets


def equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from equations(inner)


def test_a_kernel_lowering_under_automatic_axes_warns_that_it_runs_whole_on_every_device(batch):
    """A platform's (kernel) lowering under jit over several devices with automatic axes cannot be
    split by XLA's partitioner: one warning names the primitive and what to do. Explicitly sharded,
    on one device, in the default lowering, or where the kernels are batch-partitionable: none."""
    prim = Primitive("kernel_probe")
    prim.def_abstract_eval(lambda x: (x,))
    prim.multiple_results = True
    _core.register_lowering(prim, lambda x: (2 * x,), platform="cpu")
    auto = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    x = np.ones((8, 3))
    with pytest.warns(UserWarning, match=r"kernel_probe under jax.jit over 8 devices with automatic mesh axes .* explicit mesh"):
        out = jax.jit(prim.bind, in_shardings=NamedSharding(auto, P("batch")))(x)[0]
    np.testing.assert_array_equal(out, 2 * x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(prim.bind)(jax.device_put(x, batch))  # explicit: per shard
        jax.jit(prim.bind)(x)  # one device
        jax.jit(lambda a: jf.linalg.svd(a, compute_uv=False), in_shardings=NamedSharding(auto, P("batch")))(np.ones((8, 3, 2)))  # its default lowering
    partitioned = Primitive("partitioned_kernel_probe")
    partitioned.def_abstract_eval(lambda x: (x,))
    partitioned.multiple_results = True
    _core.register_lowering(partitioned, lambda x: (2 * x,), platform="cpu", partitionable=True)  # svd's and lstsq's cuda
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(partitioned.bind, in_shardings=NamedSharding(auto, P("batch")))(x)


@pytest.fixture(scope="session")  # once a process: XLA refuses a second registration of a name
def row_sums_targets(tmp_path_factory):
    """Two CPU FFI targets of ``row_sums_ffi.cc``, the first registered batch-partitionable (as
    ``build.load`` registers every kernel), the second not."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no host C++ compiler (g++)")
    library = tmp_path_factory.mktemp("ffi") / "row_sums.so"
    source = pathlib.Path(__file__).with_name("row_sums_ffi.cc")
    subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", str(source), "-o", str(library)], check=True)
    handler = jax.ffi.pycapsule(ctypes.CDLL(str(library)).RowSums)
    targets = ("jaxforge_test_row_sums_partitioned", "jaxforge_test_row_sums_whole")
    for target in targets:
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
    jax.ffi.register_ffi_target_as_batch_partitionable(targets[0])
    return targets


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_a_kernel_call_runs_on_each_devices_matrices_under_automatic_sharding(row_sums_targets, shardy):
    """``_core.kernel_call`` marks its batch dims as jax's cuSOLVER calls do, so that under automatic
    axes XLA's partitioner (Shardy's, or GSPMD's) hands a batch-partitionable kernel each device's
    matrices; a kernel not registered so is handed the whole batch on every device, gathered."""
    auto = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    x = np.random.default_rng(3).standard_normal((16, 3, 5)).astype(np.float32)
    results = (jax.ShapeDtypeStruct((16, 3), jnp.float32), jax.ShapeDtypeStruct((16,), jnp.int32))
    was = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        for target, matrices in zip(row_sums_targets, (2, 16)):
            call = jax.jit(functools.partial(_core.kernel_call, target, results), in_shardings=NamedSharding(auto, P("batch")))
            sums, seen = call(x)
            np.testing.assert_allclose(sums, x.sum(-1), rtol=1e-6)
            np.testing.assert_array_equal(seen, np.full(16, matrices))
            assert ("all-gather" in call.lower(x).compile().as_text()) == (matrices == 16)
    finally:
        jax.config.update("jax_use_shardy_partitioner", was)


def test_a_tangent_placed_otherwise_than_its_primal_is_resharded_like_it(batch):
    """jvp at a batch-sharded primal with a replicated tangent (as jnp's rules allow): the kernels
    run per shard on both, the tangent resharded like its primal."""
    rng = np.random.default_rng(9)
    q, a = jnp.asarray(rng.standard_normal((16, 12, 2, 4))), jnp.asarray(rng.standard_normal((16, 6, 4)))
    attend = lambda q: jf.attention(q, q, q, mask=jf.masks.causal())
    svals = lambda a: jf.linalg.svd(a, compute_uv=False)
    for fn, x in ((attend, q), (svals, a)):
        tangent = jnp.cos(x)
        got = jax.jit(lambda x, t: jax.jvp(fn, (x,), (t,))[1])(jax.device_put(x, batch), tangent)
        np.testing.assert_allclose(got, jax.jvp(fn, (x,), (tangent,))[1], rtol=1e-11, atol=1e-12)
        assert got.sharding.spec[0] == "batch"
