"""jf.shard on 8 CPU devices: the default mesh, explicit meshes, the decorator form, jit, grad, jvp,
vmap, pytree arguments, and the spec errors raised before ``f`` is traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxforge as jf
from jaxforge.transforms import default_mesh

C = jf.collectives
N = 8
TOL = dict(rtol=1e-12, atol=1e-12)


def scaled_by_total(x, axis_name="i"):
    """Per device: its shard times the global sum (one all-reduce)."""
    return x * C.all_reduce(jnp.sum(x), axis_name)


def mesh_2x4():
    return jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def rng_normal(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


# --- meshes ---------------------------------------------------------------------------------


def test_default_mesh_is_named_after_the_spec_axis():
    x = rng_normal(16)
    sizes = jf.shard(lambda x: lax.axis_size("batch") * jnp.ones(1), in_specs=P("batch"), out_specs=P("batch"))(x)
    np.testing.assert_array_equal(sizes, np.full(N, N))
    y = jf.shard(lambda x: scaled_by_total(x, "batch"), in_specs=P("batch"), out_specs=P("batch"))(x)
    np.testing.assert_allclose(y, x * x.sum(), **TOL)
    assert isinstance(y.sharding, NamedSharding)
    assert y.sharding.mesh.axis_names == ("batch",) and y.sharding.mesh.size == N
    assert y.sharding.spec == P("batch")


def test_default_mesh_helper():
    assert dict(default_mesh().shape) == {"data": N}
    assert dict(default_mesh(("i", "i")).shape) == {"i": N}
    with pytest.raises(ValueError, match=r"several mesh axes \['a', 'b'\]"):
        default_mesh(("b", "a"))


def test_specs_without_axis_names_replicate_over_all_devices():
    x = rng_normal(3, 2)
    # every device computes the same thing; the "data" axis exists and has all devices
    y = jf.shard(lambda x: jnp.sin(x) * lax.axis_size("data"), in_specs=P(), out_specs=P())(x)
    np.testing.assert_allclose(y, np.sin(x) * N, **TOL)


def test_explicit_two_axis_mesh():
    mesh = mesh_2x4()
    x = rng_normal(4, 8)
    f = jf.shard(lambda x: C.all_reduce(x, "b"), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a"))
    y = f(x)
    np.testing.assert_allclose(y, sum(x[:, 2 * k : 2 * k + 2] for k in range(4)), **TOL)
    assert y.sharding.mesh.shape == mesh.shape


def test_explicit_mesh_with_fewer_devices():
    mesh = jax.make_mesh((4,), ("i",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    x = rng_normal(8)
    y = jf.shard(lambda x: lax.axis_size("i") * scaled_by_total(x), mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
    np.testing.assert_allclose(y, 4 * x * x.sum(), **TOL)


def test_decorator_form():
    @jf.shard(in_specs=P("i"), out_specs=P())
    def sum_of_squares(x):
        return C.all_reduce(jnp.sum(x**2), "i")

    x = rng_normal(16, 2)
    np.testing.assert_allclose(sum_of_squares(x), np.sum(x**2), **TOL)
    assert sum_of_squares.__name__ == "sum_of_squares"

    mesh = jax.make_mesh((N,), ("j",), axis_types=(jax.sharding.AxisType.Auto,))

    @jf.shard(mesh=mesh, in_specs=P(None, "j"), out_specs=P(None, "j"))
    def column_softmax_scale(x):
        return x / C.all_reduce(jnp.max(x), "j", "max")

    x = rng_normal(2, 16)
    np.testing.assert_allclose(column_softmax_scale(x), x / x.max(), **TOL)


# --- composition with transforms -----------------------------------------------------------


def sharded_scaled():
    return jf.shard(scaled_by_total, in_specs=P("i"), out_specs=P("i"))


def test_jit_outside_and_inside():
    x = rng_normal(16)
    expected = x * x.sum()
    np.testing.assert_allclose(jax.jit(sharded_scaled())(x), expected, **TOL)
    np.testing.assert_allclose(jf.shard(jax.jit(scaled_by_total), in_specs=P("i"), out_specs=P("i"))(x), expected, **TOL)


def test_grad_and_jvp():
    """loss(x, w) = sum(sin(x) * w) with x sharded and w replicated: the gradients of the unsharded
    loss, w's summed over devices exactly once."""
    x, w, tx, tw = rng_normal(16, 3), rng_normal(3, seed=1), rng_normal(16, 3, seed=2), rng_normal(3, seed=3)
    loss = jf.shard(lambda x, w: C.all_reduce(jnp.sum(jnp.sin(x) * w[None]), "i"), in_specs=(P("i"), P()), out_specs=P())

    @jax.jit
    def run(x, w, tx, tw):
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w), jax.jvp(loss, (x, w), (tx, tw))

    (value, (gx, gw)), (primal, tangent) = run(x, w, tx, tw)
    np.testing.assert_allclose(value, np.sum(np.sin(x) * w), **TOL)
    np.testing.assert_allclose(primal, value, **TOL)
    np.testing.assert_allclose(gx, np.cos(x) * w, **TOL)
    np.testing.assert_allclose(gw, np.sin(x).sum(0), **TOL)
    np.testing.assert_allclose(tangent, np.sum(np.cos(x) * tx * w + np.sin(x) * tw), **TOL)


def test_vmap_outside_over_an_unsharded_leading_axis():
    xb = rng_normal(3, 16)
    expected = xb * xb.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(jax.vmap(sharded_scaled())(xb), expected, **TOL)
    # the batch axis elsewhere, and vmap of the gradient
    np.testing.assert_allclose(jax.vmap(sharded_scaled(), in_axes=1, out_axes=1)(xb.T), expected.T, **TOL)
    loss = jf.shard(lambda x: C.all_reduce(jnp.sum(x**3), "i"), in_specs=P("i"), out_specs=P())
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(loss)))(xb), 3 * xb**2, **TOL)


def test_vmap_inside_with_the_leading_axis_unsharded_in_the_spec():
    xb = rng_normal(3, 16)
    f = jf.shard(jax.vmap(scaled_by_total), in_specs=P(None, "i"), out_specs=P(None, "i"))
    np.testing.assert_allclose(f(xb), xb * xb.sum(axis=1, keepdims=True), **TOL)


def test_pytree_arguments_and_results():
    params = {"w": rng_normal(3, 2), "b": rng_normal(2, seed=1)}
    x = rng_normal(16, 3, seed=2)

    def local(params, x):
        y = x @ params["w"] + params["b"][None]
        return {"y": y, "total": C.all_reduce(jnp.sum(y), "i")}

    expected_y = x @ params["w"] + params["b"]
    for in_specs in [(P(), P("i")), ({"w": P(), "b": P()}, P("i"))]:
        out = jf.shard(local, in_specs=in_specs, out_specs={"y": P("i"), "total": P()})(params, x)
        assert set(out) == {"y", "total"}
        np.testing.assert_allclose(out["y"], expected_y, **TOL)
        np.testing.assert_allclose(out["total"], expected_y.sum(), **TOL)
    # a tuple argument, with a single spec standing for all of its leaves
    out = jf.shard(lambda pair: (pair[0] + pair[1], pair[0] * 2), in_specs=P("i"), out_specs=(P("i"), P("i")))((x, 2 * x))
    np.testing.assert_allclose(out[0], 3 * x, **TOL)
    np.testing.assert_allclose(out[1], 2 * x, **TOL)


def test_check_vma_is_passed_through():
    x = np.arange(16.0)
    with pytest.raises(ValueError, match=r"out_specs"):
        jf.shard(lambda x: jnp.sum(x), in_specs=P("i"), out_specs=P())(x)
    # unchecked: the (varying) local sums are taken as replicated, device 0's sum comes back
    np.testing.assert_allclose(jf.shard(lambda x: jnp.sum(x), in_specs=P("i"), out_specs=P(), check_vma=False)(x), 1.0)


# --- errors ---------------------------------------------------------------------------------

MESH_I = lambda: jax.make_mesh((N,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))

ERRORS = {
    "unknown-axis-in_specs": (
        dict(mesh=MESH_I, in_specs=P("j"), out_specs=P("i")),
        (np.ones(16),),
        r"shard: in_specs P\('j',\) names axis 'j', which the mesh \{'i': 8\} lacks",
    ),
    "unknown-axis-out_specs": (
        dict(mesh=MESH_I, in_specs=P("i"), out_specs=P(None, "k")),
        (np.ones(16),),
        r"shard: out_specs P\(None, 'k'\) names axis 'k', which the mesh \{'i': 8\} lacks",
    ),
    "unknown-axis-in-pytree-spec": (
        dict(mesh=MESH_I, in_specs=({"a": P(("i", "z"))},), out_specs=P()),
        ({"a": np.ones(16)},),
        r"in_specs .* names axis 'z'",
    ),
    "spec-longer-than-rank": (
        dict(in_specs=P("i", None), out_specs=P("i")),
        (np.ones(16),),
        r"shard: in_specs P\('i', None\) has 2 entries, but argument leaf 0 has shape \(16,\)",
    ),
    "spec-longer-than-rank-second-leaf": (
        dict(in_specs=(P("i"), P(None, None)), out_specs=P("i")),
        (np.ones(16), np.ones(3)),
        r"in_specs P\(None, None\) has 2 entries, but argument leaf 1 has shape \(3,\)",
    ),
    "not-divisible": (
        dict(in_specs=P("i"), out_specs=P("i")),
        (np.ones(12),),
        r"shard: argument leaf 0 has shape \(12,\); its dim 0 \(12\) is not a multiple of the mesh axes \['i'\] \(size 8\)",
    ),
    "not-divisible-dim1-two-axes": (
        dict(mesh=mesh_2x4, in_specs=P(None, ("a", "b")), out_specs=P()),
        (np.ones((3, 12)),),
        r"its dim 1 \(12\) is not a multiple of the mesh axes \['a', 'b'\] \(size 8\)",
    ),
    "not-a-prefix-too-few": (
        dict(in_specs=(P("i"),), out_specs=P("i")),
        (np.ones(16), np.ones(16)),
        r"shard: in_specs \(P\('i',\),\) is not a prefix of the 2 argument\(s\)",
    ),
    "not-a-prefix-too-many": (
        dict(in_specs=(P("i"), P(), P()), out_specs=P("i")),
        (np.ones(16),),
        r"is not a prefix of the 1 argument\(s\)",
    ),
    "not-a-prefix-dict-keys": (
        dict(in_specs=({"y": P("i")},), out_specs=P("i")),
        ({"x": np.ones(16)},),
        r"is not a prefix of the 1 argument\(s\)",
    ),
    "two-axes-without-mesh": (
        dict(in_specs=P("i"), out_specs=P("j")),
        (np.ones(16),),
        r"shard: the specs use several mesh axes \['i', 'j'\]; pass mesh=jax\.make_mesh\(shape, \('i', 'j'\)\)",
    ),
    "two-axes-in-one-entry-without-mesh": (
        dict(in_specs=P(("i", "j")), out_specs=P()),
        (np.ones(16),),
        r"several mesh axes \['i', 'j'\]",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_spec_errors_are_raised_before_tracing(name):
    kwargs, args, match = ERRORS[name]
    kwargs = {k: v() if k == "mesh" else v for k, v in kwargs.items()}
    traced = []

    def f(*a):
        traced.append(a)
        return a[0]

    with pytest.raises(ValueError, match=match):
        jf.shard(f, **kwargs)(*args)
    assert not traced


def test_type_errors():
    with pytest.raises(TypeError, match=r"shard: `f` must be callable, got int"):
        jf.shard(3, in_specs=P(), out_specs=P())
    with pytest.raises(TypeError, match=r"shard: `in_specs` must hold PartitionSpecs \(or None\), got 'i'"):
        jf.shard(lambda x: x, in_specs=("i",), out_specs=P())(np.ones(8))
    with pytest.raises(TypeError, match=r"shard: `out_specs` must hold PartitionSpecs"):
        jf.shard(lambda x: x, in_specs=P(), out_specs=[0])(np.ones(8))


DOCUMENTS = {
    "document": jf.masks.document,
    # the mask as one function evaluated per shard: the shard's ids vary over the mesh, the indices not
    "block_mask": lambda seg: jf.masks.block_mask(
        lambda b, h, i, j: (seg[b, i] == seg[b, j]) & (j <= i), 12, 12, batch_shape=seg.shape[:1]
    ),
    # the same pairs as jax.nn's boolean array, its ranges measured per shard
    "array": lambda seg: seg[:, None, :, None] == seg[:, None, None, :],
    # and cut into pieces (too short for a gap: the second sees nothing), two calls merged per shard
    "block_mask_pieces": lambda seg: jf.masks.block_mask(
        lambda b, h, i, j: (seg[b, i] == seg[b, j]) & (j <= i), 12, 12, batch_shape=seg.shape[:1], ranges=2
    ),
}


@pytest.mark.parametrize("documents", sorted(DOCUMENTS))
def test_attention_with_a_mask_capturing_sharded_segment_ids(documents):
    # Regression: the mask closes over a value that varies over the mesh axis; its casts to
    # varying must not leak into the lowering's loops (they broke the carries' types).
    q = jnp.asarray(rng_normal(8, 12, 2, 4))
    segments = jnp.asarray(np.random.default_rng(1).integers(0, 3, (8, 12)).cumsum(-1) // 7)

    def loss(q, segments):
        mask = jf.masks.causal() & DOCUMENTS[documents](segments)
        return jnp.sum(jf.attention(q, q, q, mask=mask) ** 2)

    sharded = jf.shard(
        lambda q, s: (C.all_reduce(loss(q, s), "data"), jax.grad(loss)(q, s)),
        in_specs=(P("data"), P("data")),
        out_specs=(P(), P("data")),
    )
    value, grad = jax.jit(sharded)(q, segments)  # one program, not op by op
    np.testing.assert_allclose(value, loss(q, segments), **TOL)
    np.testing.assert_allclose(grad, jax.jit(jax.grad(loss))(q, segments), **TOL)


def test_explicit_mesh_takes_host_arrays():
    # shard_map alone refuses inputs not laid out as in_specs on an explicit mesh; jf.shard places them.
    mesh = jax.make_mesh((4,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = jf.shard(lambda x, y: C.all_reduce(x, "i") + y, mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
    x = np.arange(8.0)
    want = x.reshape(4, 2).sum(0) + 1.0
    np.testing.assert_allclose(f(x, 1.0), want, **TOL)
    np.testing.assert_allclose(jax.jit(f)(x, np.ones(2)), want, **TOL)
    with jax.set_mesh(mesh):
        grad = jax.grad(lambda x: jax.jit(f)(x, 1.0).sum())(jnp.asarray(x))
    np.testing.assert_allclose(grad, np.ones(8), **TOL)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_the_mesh_of_set_mesh_is_the_default(axis_type):
    """As jax.shard_map: with a mesh set, jf.shard without ``mesh=`` runs on it (here two axes,
    which the default mesh could not give), eagerly, under jit and in a gradient."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(axis_type,) * 2)
    f = jf.shard(lambda x: C.all_reduce(x, "b", op="max"), in_specs=P("a", "b"), out_specs=P("a"))
    x = rng_normal(4, 8)
    want = np.max(x.reshape(4, 4, 2), axis=1)
    with jax.set_mesh(mesh):
        for run in (f, jax.jit(f)):
            y = run(x)
            np.testing.assert_allclose(y, want, **TOL)
            assert y.sharding.mesh.shape == mesh.shape
        grad = jax.grad(lambda x: jnp.sum(jax.jit(f)(x) * np.arange(2.0)[None]))(jnp.asarray(x))
    column = np.tile(want, (1, 4))  # shard j holds columns 2j, 2j + 1
    np.testing.assert_allclose(grad, (x == column) * np.tile(np.arange(2.0), 4), **TOL)  # to each max


def test_an_eager_call_and_gradient_compile_one_program(backend_compiles):
    """jf.shard jits its shard_map: called outside jit, f runs as one program (not an op and a
    collective at a time, each dispatched and compiled on its own: 8 programs here), compiled once
    per shape; so does an eager gradient."""
    mesh = jax.make_mesh((N,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))  # nothing to reshard first
    f = jf.shard(lambda x: jnp.sin(scaled_by_total(x)) * lax.axis_index("i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    x, y = (jax.device_put(rng_normal(16, seed=s), NamedSharding(mesh, P("i"))) for s in (0, 1))  # placed: no program moves them
    jax.block_until_ready(f(x))
    assert len(backend_compiles) == 1
    grad = jax.grad(lambda x: f(x).sum())
    jax.block_until_ready(grad(x))
    backend_compiles.clear()
    jax.block_until_ready((f(y), grad(y)))
    assert backend_compiles == []
