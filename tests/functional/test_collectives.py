"""jf.collectives on 8 CPU devices: values, JVPs and VJPs inside ``jax.shard_map`` against the
``vmap(axis_name=...)`` reference and an independent numpy model of the documented semantics;
second-order gradient checks; max/min ties; the gradient semantics of data- and tensor-parallel
losses; the collectives XLA emits forward and backward; and the argument errors.

Harness: the stacked array ``X`` of shape ``(8, *local)`` holds device ``i``'s input in ``X[i]``;
``on_mesh`` runs the per-device function under ``shard_map`` (``in_specs=P("i")``, each device sees
``X[i]``) and stacks the per-device results with ``out_specs=P("i")``, so results are varying on
both sides and have the same ``(8, ...)`` shape as ``jax.vmap(fn, axis_name="i")(X)``. Functions
of a replicated (invariant) input take ``in_specs=P()`` there and ``in_axes=None`` under vmap.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxforge as jf

C = jf.collectives
N = 8
TOL = dict(rtol=1e-12, atol=1e-12)


@functools.cache
def mesh():
    return jax.make_mesh((N,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))


# --- cases ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    fn: Callable  # the per-device function of the local input
    shape: tuple  # local input shape (per device), or the replicated input's shape
    ref: Callable  # numpy model: stacked inputs (or the replicated input) -> stacked outputs (N, ...)
    replicated_input: bool = False
    linear: bool = True
    ref_jvp: Callable | None = None  # numpy (x, t) -> stacked tangents, for the nonlinear cases
    ref_vjp: Callable | None = None  # numpy (x, ct) -> input cotangent, for the nonlinear cases


def stacked(y):
    """One copy of ``y`` per device."""
    return np.broadcast_to(y, (N, *np.shape(y))).copy()


def split(a, axis):
    return np.split(a, N, axis=axis)


def extremum_case(op):
    arg = np.argmax if op == "max" else np.argmin

    def holder(x):  # one-hot (N, ...) of the device that holds the extremum (no ties in random data)
        return np.arange(N).reshape((N,) + (1,) * (x.ndim - 1)) == arg(x, axis=0)

    return Case(
        lambda x: C.all_reduce(x, "i", op),
        (2, 3),
        lambda x: stacked(getattr(np, op)(x, axis=0)),
        linear=False,
        ref_jvp=lambda x, t: stacked(np.sum(np.where(holder(x), t, 0), axis=0)),
        ref_vjp=lambda x, ct: np.where(holder(x), ct.sum(0), 0),
    )


# A non-trivial sizes table for all_to_all_uneven: zeros scattered around, device 3 sends nothing,
# device 6 receives nothing, and device 0 keeps rows for itself.
SIZES = np.random.default_rng(7).integers(0, 4, (N, N))
SIZES[SIZES == 1] = 0
SIZES[3, :] = 0
SIZES[:, 6] = 0
SIZES[0, 0] = 2
ROWS = int(SIZES.sum(axis=1).max()) + 1  # one spare row, which must be ignored


def np_all_to_all_uneven(x, sizes, axis):
    """The docstring's layout: device j receives, in sender order, rows
    ``x[i][sum(sizes[i][:j]) : sum(sizes[i][:j+1])]`` from each device i, zero-padded to the
    largest column sum."""
    x = np.moveaxis(x, axis % (x.ndim - 1) + 1, 1)
    capacity = int(sizes.sum(axis=0).max())
    out = np.zeros((N, capacity, *x.shape[2:]))
    for j in range(N):
        pos = 0
        for i in range(N):
            start, k = int(sizes[i, :j].sum()), int(sizes[i, j])
            out[j, pos : pos + k] = x[i, start : start + k]
            pos += k
    return np.moveaxis(out, 1, axis % (x.ndim - 1) + 1)


def np_permute(x, perm):
    y = np.zeros_like(x)
    for src, dst in perm:
        y[dst] = x[src]
    return y


def gather_case(axis, tiled):
    join = np.concatenate if tiled else np.stack
    return Case(lambda x: C.all_gather(x, "i", axis=axis, tiled=tiled), (2, 3), lambda x: stacked(join(list(x), axis=axis)))


def reduce_scatter_case(op, axis):
    """Chunk i (along ``axis``) of the sum or mean stays on device i."""
    return Case(
        lambda x: C.reduce_scatter(x, "i", axis=axis, op=op),
        {0: (16, 3), 1: (3, 8)}[axis],
        lambda x: np.stack(split(getattr(np, op)(x, axis=0), axis)),
    )


def all_to_all_case(split_axis, concat_axis, shape):
    """Device j gets chunk j of every device's split_axis, concatenated in device order."""
    return Case(
        lambda x: C.all_to_all(x, "i", split_axis, concat_axis),
        shape,
        lambda x: np.stack(
            [np.concatenate([split(x[i], split_axis)[j] for i in range(N)], axis=concat_axis) for j in range(N)]
        ),
    )


def shift_case(offset):
    return Case(lambda x: C.shift(x, "i", offset), (2, 3), lambda x: np.roll(x, offset, axis=0))


FULL_PERM = [(i, (3 * i + 1) % N) for i in range(N)]
PARTIAL_PERM = [(0, 3), (1, 2), (6, 6), (7, 0)]  # devices 1, 4, 5 and 7 receive nothing

CASES = {
    "all_reduce-sum": Case(lambda x: C.all_reduce(x, "i", "sum"), (2, 3), lambda x: stacked(x.sum(0))),
    "all_reduce-mean": Case(lambda x: C.all_reduce(x, "i", "mean"), (2, 3), lambda x: stacked(x.mean(0))),
    "all_reduce-max": extremum_case("max"),
    "all_reduce-min": extremum_case("min"),
    **{f"all_gather-stacked-axis{a}": gather_case(a, tiled=False) for a in (0, 1, -1)},
    **{f"all_gather-tiled-axis{a}": gather_case(a, tiled=True) for a in (0, 1, -1)},
    **{f"reduce_scatter-{op}-axis{a}": reduce_scatter_case(op, a) for op in ("sum", "mean") for a in (0, 1)},
    **{
        f"all_to_all-split{s}-concat{c}": all_to_all_case(s, c, shape)
        for s, c, shape in [(0, 1, (16, 3)), (1, 0, (3, 16)), (0, 0, (8, 3)), (1, -1, (2, 8))]
    },
    "all_to_all_uneven-axis0": Case(
        lambda x: C.all_to_all_uneven(x, "i", SIZES)[0], (ROWS, 2), lambda x: np_all_to_all_uneven(x, SIZES, 0)
    ),
    "all_to_all_uneven-axis1": Case(
        lambda x: C.all_to_all_uneven(x, "i", SIZES.tolist(), axis=1)[0],
        (2, ROWS),
        lambda x: np_all_to_all_uneven(x, SIZES, 1),
    ),
    "broadcast-root0": Case(lambda x: C.broadcast(x, "i", 0), (2, 3), lambda x: stacked(x[0])),
    "broadcast-root5": Case(lambda x: C.broadcast(x, "i", root=5), (2, 3), lambda x: stacked(x[5])),
    "permute-full": Case(lambda x: C.permute(x, "i", FULL_PERM), (2, 3), lambda x: np_permute(x, FULL_PERM)),
    "permute-partial": Case(lambda x: C.permute(x, "i", PARTIAL_PERM), (2, 3), lambda x: np_permute(x, PARTIAL_PERM)),
    **{f"shift{o:+d}": shift_case(o) for o in (1, -1, 3)},
    # Megatron f: every device scales its (varying) copy differently, so the gradient is the sum
    # of N different contributions.
    "copy_to_parallel": Case(
        lambda x: C.copy_to_parallel(x, "i") * (lax.axis_index("i") + 1),
        (2, 3),
        lambda x: np.stack([(i + 1) * x for i in range(N)]),
        replicated_input=True,
    ),
    "reduce_from_parallel": Case(lambda x: C.reduce_from_parallel(x, "i"), (2, 3), lambda x: stacked(x.sum(0))),
    "scatter_to_parallel-axis-1": Case(
        lambda x: C.scatter_to_parallel(x, "i"), (3, 16), lambda x: np.stack(split(x, -1)), replicated_input=True
    ),
    "scatter_to_parallel-axis0": Case(
        lambda x: C.scatter_to_parallel(x, "i", axis=0), (8, 2), lambda x: np.stack(split(x, 0)), replicated_input=True
    ),
    "gather_from_parallel-tp": Case(
        lambda x: C.gather_from_parallel(x, "i"), (3, 2), lambda x: stacked(np.concatenate(list(x), axis=-1))
    ),
    "gather_from_parallel-no_tp": Case(
        lambda x: C.gather_from_parallel(x, "i", tensor_parallel_output_grad=False),
        (3, 2),
        lambda x: stacked(np.concatenate(list(x), axis=-1)),
    ),
    "gather_from_parallel-tp-axis0": Case(
        lambda x: C.gather_from_parallel(x, "i", axis=0, tensor_parallel_output_grad=True),
        (2, 3),
        lambda x: stacked(np.concatenate(list(x), axis=0)),
    ),
}


# Second-order checks, one representative per function and variant, grouped into one shard_map
# each (one compiled program per derivative instead of one per collective keeps them affordable).
GRAD_GROUPS = {
    "linear": [
        "all_reduce-mean",
        "all_gather-tiled-axis-1",
        "all_gather-stacked-axis1",
        "reduce_scatter-sum-axis1",
        "all_to_all-split0-concat1",
        "broadcast-root5",
        "permute-partial",
        "shift-1",
        "reduce_from_parallel",
        "gather_from_parallel-tp",
        "gather_from_parallel-no_tp",
    ],
    "extremum": ["all_reduce-max", "all_reduce-min"],
    "replicated_input": ["copy_to_parallel", "scatter_to_parallel-axis-1"],
    "uneven": ["all_to_all_uneven-axis0"],
}


def inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    shape = case.shape if case.replicated_input else (N, *case.shape)
    return rng.normal(size=shape), rng.normal(size=shape)


@functools.cache
def mesh_fwd_jvp_vjp(name):
    """Compiled once per case, shared by the tests that run it."""
    return fwd_jvp_vjp(on_mesh(CASES[name]))


def on_mesh(case):
    if case.replicated_input:
        return jax.shard_map(lambda x: case.fn(x)[None], mesh=mesh(), in_specs=P(), out_specs=P("i"))
    return jax.shard_map(lambda xs: case.fn(xs[0])[None], mesh=mesh(), in_specs=P("i"), out_specs=P("i"))


def on_vmap(case):
    if case.replicated_input:
        return jax.vmap(case.fn, in_axes=None, axis_size=N, axis_name="i")
    return jax.vmap(case.fn, axis_name="i")


def fwd_jvp_vjp(f):
    """One compiled program: f(x), its tangent along t, and its cotangent for ct."""

    def run(x, t, ct):
        y, tangent = jax.jvp(f, (x,), (t,))
        return y, tangent, jax.vjp(f, x)[1](ct)[0]

    return jax.jit(run)


def linear_map_matrix(ref, shape):
    """The matrix of the linear numpy model (columns: images of the basis vectors)."""
    size = int(np.prod(shape))
    return np.stack([np.asarray(ref(e.reshape(shape)), np.float64).ravel() for e in np.eye(size)], axis=1)


def case_params(ids):
    return [pytest.param(i, id=i) for i in ids]


# --- values, JVPs and VJPs --------------------------------------------------------------------


@pytest.mark.parametrize("name", case_params(CASES))
def test_matches_vmap_reference(name):
    case = CASES[name]
    x, t = inputs(case)
    ct = np.random.default_rng(1).normal(size=jax.eval_shape(on_mesh(case), x).shape)
    expected = fwd_jvp_vjp(on_vmap(case))(x, t, ct)
    got = mesh_fwd_jvp_vjp(name)(x, t, ct)
    for what, g, e in zip(("forward", "jvp", "vjp"), got, expected):
        assert g.shape == e.shape and g.dtype == np.float64, what
        np.testing.assert_allclose(g, e, **TOL, err_msg=what)


@pytest.mark.parametrize("name", case_params(CASES))
def test_matches_numpy_semantics(name):
    """Forward against the numpy model of the docstring; for the linear collectives the JVP is the
    model applied to the tangent and the VJP is the transposed matrix of the model."""
    case = CASES[name]
    x, t = inputs(case)
    y_np = case.ref(x)
    ct = np.random.default_rng(1).normal(size=y_np.shape)
    y, tangent, cotangent = mesh_fwd_jvp_vjp(name)(x, t, ct)
    np.testing.assert_allclose(y, y_np, **TOL)
    if case.linear:
        np.testing.assert_allclose(tangent, case.ref(t), **TOL)
        a = linear_map_matrix(case.ref, x.shape)
        np.testing.assert_allclose(cotangent, (a.T @ ct.ravel()).reshape(x.shape), **TOL)
    else:
        np.testing.assert_allclose(tangent, case.ref_jvp(x, t), **TOL)
        np.testing.assert_allclose(cotangent, case.ref_vjp(x, ct), **TOL)


@pytest.mark.parametrize("group", list(GRAD_GROUPS))
def test_check_grads_second_order(group):
    cases = [CASES[name] for name in GRAD_GROUPS[group]]

    def local(*xs):
        return tuple(c.fn(x if c.replicated_input else x[0])[None] for c, x in zip(cases, xs))

    in_specs = tuple(P() if c.replicated_input else P("i") for c in cases)
    f = jax.jit(jax.shard_map(local, mesh=mesh(), in_specs=in_specs, out_specs=P("i")))
    check_grads(f, tuple(inputs(c, seed=2)[0] for c in cases), order=2, modes=["fwd", "rev"])


def test_copy_to_parallel_matches_eager_vmap_reference():
    """Without jit the vmap fallback of copy_to_parallel works (see VMAP_BROKEN for jit)."""
    case = CASES["copy_to_parallel"]
    x, t = inputs(case)
    ref = on_vmap(case)
    ct = np.random.default_rng(1).normal(size=(N, *case.shape))
    y, tangent, cotangent = mesh_fwd_jvp_vjp("copy_to_parallel")(x, t, ct)
    np.testing.assert_allclose(y, ref(x), **TOL)
    np.testing.assert_allclose(tangent, jax.jvp(ref, (x,), (t,))[1], **TOL)
    np.testing.assert_allclose(cotangent, jax.vjp(ref, x)[1](ct)[0], **TOL)


# --- specific semantics -----------------------------------------------------------------------


def test_all_to_all_uneven_layout_and_count():
    """Each device's (out, count): what it received in sender order, zero padding after ``count``."""
    x = np.random.default_rng(3).normal(size=(N, ROWS, 2))
    f = jax.jit(
        jax.shard_map(
            lambda xs: jax.tree.map(lambda a: a[None], C.all_to_all_uneven(xs[0], "i", SIZES)),
            mesh=mesh(),
            in_specs=P("i"),
            out_specs=P("i"),
        )
    )
    out, count = f(x)
    assert out.shape == (N, SIZES.sum(axis=0).max(), 2)
    assert count.dtype == np.int32
    np.testing.assert_array_equal(count, SIZES.sum(axis=0))
    assert count[6] == 0
    for j in range(N):
        received = [x[i, SIZES[i, :j].sum() : SIZES[i, : j + 1].sum()] for i in range(N)]
        np.testing.assert_array_equal(out[j, : count[j]], np.concatenate(received))
        np.testing.assert_array_equal(out[j, count[j] :], 0)
    np.testing.assert_array_equal(out, np_all_to_all_uneven(x, SIZES, 0))


def test_all_to_all_uneven_vjp_is_the_transposed_exchange():
    """The cotangent of each received row goes back to the row it came from; unsent rows get 0."""
    x, t = inputs(CASES["all_to_all_uneven-axis0"], seed=4)
    ct = np.random.default_rng(5).normal(size=(N, SIZES.sum(axis=0).max(), 2))
    dx = mesh_fwd_jvp_vjp("all_to_all_uneven-axis0")(x, t, ct)[2]
    expected = np.zeros_like(x)
    for j in range(N):
        pos = 0
        for i in range(N):
            start, k = SIZES[i, :j].sum(), SIZES[i, j]
            expected[i, start : start + k] = ct[j, pos : pos + k]
            pos += k
    np.testing.assert_array_equal(dx, expected)
    np.testing.assert_array_equal(dx[3], 0)  # device 3 sends nothing
    np.testing.assert_array_equal(dx[:, -1], 0)  # the spare row is never sent


@pytest.mark.parametrize("op", ["max", "min"])
def test_extremum_ties_share_gradient_and_tangent(op):
    sign = 1.0 if op == "max" else -1.0
    x = sign * np.random.default_rng(6).uniform(0, 1, size=(N, 4))
    x[[2, 5], 0] = sign * 3.0  # two holders
    x[[1, 4, 7], 1] = sign * 2.0  # three holders
    x[0, 2] = sign * 5.0  # one holder
    x[:, 3] = sign * 1.5  # every device holds it
    holders = [[2, 5], [1, 4, 7], [0], list(range(N))]
    expected_grad = np.zeros_like(x)
    for col, hs in enumerate(holders):
        expected_grad[hs, col] = 1 / len(hs)

    reduced = jf.shard(lambda v: C.all_reduce(v, "i", op), in_specs=P("i"), out_specs=P())
    loss = lambda v: reduced(v).sum()
    t = np.random.default_rng(7).normal(size=x.shape)
    vmapped = lambda v: jax.vmap(lambda a: C.all_reduce(a, "i", op), axis_name="i")(v)[0].sum()

    @jax.jit
    def run(x, t):
        return reduced(x), jax.grad(loss)(x), jax.jvp(reduced, (x,), (t,))[1], jax.grad(vmapped)(x)

    y, grad, tangent, grad_vmap = run(x, t)
    np.testing.assert_array_equal(y[0], getattr(np, op)(x, axis=0))
    np.testing.assert_allclose(grad, expected_grad, **TOL)
    np.testing.assert_allclose(grad_vmap, expected_grad, **TOL)
    np.testing.assert_allclose(tangent[0], [t[hs, col].mean() for col, hs in enumerate(holders)], **TOL)


def mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None])
    return h @ params["w2"] + params["b2"][None]


def mse(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def mlp_problem(seed=8):
    rng = np.random.default_rng(seed)
    shapes = {"w1": (4, 8), "b1": (8,), "w2": (8, 2), "b2": (2,)}
    params = {k: rng.normal(size=shape) for k, shape in shapes.items()}
    return params, rng.normal(size=(64, 4)), rng.normal(size=(64, 2))


def data_parallel_loss(params, x, y):
    return jf.shard(
        lambda p, xl, yl: C.all_reduce(mse(p, xl, yl), "i", "mean"), in_specs=(P(), P("i"), P("i")), out_specs=P()
    )(params, x, y)


def test_data_parallel_gradient_equals_unsharded_gradient():
    """Replicated parameters, sharded batch, mean of the local means: the gradient is the full-batch
    gradient, neither multiplied nor divided by the number of devices."""
    params, x, y = mlp_problem()
    loss, grads = jax.jit(jax.value_and_grad(data_parallel_loss))(params, x, y)
    loss_ref, grads_ref = jax.jit(jax.value_and_grad(mse))(params, x, y)
    np.testing.assert_allclose(loss, loss_ref, **TOL)
    for k in params:
        assert grads[k].shape == params[k].shape
        np.testing.assert_allclose(grads[k], grads_ref[k], **TOL, err_msg=k)
    # and w.r.t. the data: each example's gradient, as in the unsharded loss
    gx = jax.jit(jax.grad(data_parallel_loss, argnums=1))(params, x, y)
    np.testing.assert_allclose(gx, jax.jit(jax.grad(mse, argnums=1))(params, x, y), **TOL)


def test_megatron_mlp_gradient_equals_unsharded_gradient():
    """Column- then row-parallel MLP with f = copy_to_parallel and g = reduce_from_parallel."""
    rng = np.random.default_rng(9)
    x, w1, w2 = rng.normal(size=(5, 4)), rng.normal(size=(4, 16)), rng.normal(size=(16, 3))

    def local(x, w1, w2):
        h = jnp.tanh(C.copy_to_parallel(x, "i") @ w1)
        return jnp.sum(C.reduce_from_parallel(h @ w2, "i") ** 2)

    sharded = jf.shard(local, in_specs=(P(), P(None, "i"), P("i", None)), out_specs=P())
    unsharded = lambda x, w1, w2: jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2)
    got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(x, w1, w2)
    expected = jax.jit(jax.value_and_grad(unsharded, argnums=(0, 1, 2)))(x, w1, w2)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, **TOL)


@pytest.mark.parametrize("axes", [("a", "b"), ("b", "a"), ("b", "h", "a")])
def test_permute_and_shift_number_devices_along_a_tuple_of_axes_as_the_spec_does(axes):
    """Over a tuple of mesh axes the devices are numbered in the tuple's order (the spec's shard
    order, axis_index's, all_gather's); jax's ppermute numbers them in the mesh's order, which
    permute and shift translate to. Values and gradients against np.roll over the shards."""
    mesh = jax.make_mesh((2, 2, 2), ("h", "a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    n = 2 ** len(axes)
    perm = [(i, (3 * i + 1) % n) for i in range(n)]  # not a shift
    x = np.arange(n * 3.0).reshape(n, 3)
    loss = lambda out: jnp.sum(jnp.sin(out) * jnp.arange(out.size).reshape(out.shape))
    for fn, want in (
        (lambda y: C.shift(y, axes, 3), lambda x: jnp.roll(x, 3, axis=0)),
        (lambda y: C.permute(y, axes, perm), lambda x: jnp.zeros_like(x).at[jnp.asarray([d for _, d in perm])].set(x)),
        (lambda y: C.permute(y, axes, perm[:2]), lambda x: jnp.zeros_like(x).at[jnp.asarray([d for _, d in perm[:2]])].set(x[:2])),
    ):
        sharded = jax.shard_map(fn, mesh=mesh, in_specs=P(axes), out_specs=P(axes), axis_names=set(axes))
        np.testing.assert_allclose(jax.jit(sharded)(x), want(x), **TOL)
        grad = jax.jit(jax.grad(lambda x: loss(sharded(x))))(x)
        np.testing.assert_allclose(grad, jax.grad(lambda x: loss(want(x)))(x), **TOL)
    index = jax.shard_map(lambda y: lax.axis_index(axes)[None], mesh=mesh, in_specs=P(axes), out_specs=P(axes), axis_names=set(axes))
    np.testing.assert_array_equal(jax.jit(index)(x), np.arange(n))  # the numbering the spec uses


@pytest.mark.parametrize("tp", [True, False])
def test_gather_from_parallel_gradient_equals_unsharded_gradient(tp):
    """Sequence-parallel gather: the computation after it is per device (tp=True, each device owns
    a column block of w) or duplicated (tp=False, every device computes the same loss)."""
    rng = np.random.default_rng(10)
    x, w = rng.normal(size=(16, 3)), rng.normal(size=(3, 8))
    unsharded = lambda x, w: jnp.sum(jnp.sin(x @ w))
    if tp:
        local = lambda xl, wl: C.all_reduce(jnp.sum(jnp.sin(C.gather_from_parallel(xl, "i", axis=0) @ wl)), "i")
        sharded = jf.shard(local, in_specs=(P("i"), P(None, "i")), out_specs=P())
    else:
        local = lambda xl, w: unsharded(C.gather_from_parallel(xl, "i", axis=0, tensor_parallel_output_grad=False), w)
        sharded = jf.shard(local, in_specs=(P("i"), P()), out_specs=P())
    got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))(x, w)
    expected = jax.jit(jax.value_and_grad(unsharded, argnums=(0, 1)))(x, w)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, **TOL)


# --- the collectives XLA emits ----------------------------------------------------------------

COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def collectives_in(hlo_text):
    return collections.Counter(m.group(1) for m in COLLECTIVE.finditer(hlo_text))


def compiled(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


AR, AG, RS, A2A, CP = "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
V, R = P("i"), P()  # varying (sharded) and replicated specs

# name: (per-device fn, in_spec, out_spec, local or replicated input shape, forward, backward).
# Invariant results use out_specs=P() so that the cotangent arrives invariant (out_specs=P("i")
# would add a psum to the backward pass of its own).
HLO_CASES = {
    "all_reduce-sum": (lambda x: C.all_reduce(x, "i"), V, R, (8, 8), {AR: 1}, {}),
    "all_reduce-mean": (lambda x: C.all_reduce(x, "i", "mean"), V, R, (8, 8), {AR: 1}, {}),
    "all_reduce-max": (lambda x: C.all_reduce(x, "i", "max"), V, R, (8, 8), {AR: 1}, {}),
    "all_reduce-min": (lambda x: C.all_reduce(x, "i", "min"), V, R, (8, 8), {AR: 1}, {}),
    "broadcast": (lambda x: C.broadcast(x, "i", 5), V, R, (8, 8), {AR: 1}, {}),
    "all_gather-stacked": (lambda x: C.all_gather(x, "i", axis=1), V, V, (8, 8), {AG: 1}, {RS: 1}),
    "all_gather-tiled": (lambda x: C.all_gather(x, "i", axis=1, tiled=True), V, V, (8, 8), {AG: 1}, {RS: 1}),
    "reduce_scatter-sum": (lambda x: C.reduce_scatter(x, "i", axis=1), V, V, (8, 8), {RS: 1}, {AG: 1}),
    "reduce_scatter-mean": (lambda x: C.reduce_scatter(x, "i", axis=0, op="mean"), V, V, (8, 8), {RS: 1}, {AG: 1}),
    "all_to_all": (lambda x: C.all_to_all(x, "i", 1, 0), V, V, (8, 8), {A2A: 1}, {A2A: 1}),
    "all_to_all_uneven": (lambda x: C.all_to_all_uneven(x, "i", SIZES)[0], V, V, (ROWS, 8), {A2A: 1}, {A2A: 1}),
    "permute-partial": (lambda x: C.permute(x, "i", PARTIAL_PERM), V, V, (8, 8), {CP: 1}, {CP: 1}),
    "shift": (lambda x: C.shift(x, "i", -1), V, V, (8, 8), {CP: 1}, {CP: 1}),
    "copy_to_parallel": (lambda x: C.copy_to_parallel(x, "i"), R, V, (8, 8), {}, {AR: 1}),
    "reduce_from_parallel": (lambda x: C.reduce_from_parallel(x, "i"), V, R, (8, 8), {AR: 1}, {}),
    "scatter_to_parallel": (lambda x: C.scatter_to_parallel(x, "i"), R, V, (8, 8), {}, {AR: 1}),
    "gather_from_parallel-tp": (lambda x: C.gather_from_parallel(x, "i"), V, V, (8, 8), {AG: 1}, {RS: 1}),
    "gather_from_parallel-no_tp": (
        lambda x: C.gather_from_parallel(x, "i", tensor_parallel_output_grad=False), V, R, (8, 8), {AG: 1}, {}
    ),
}


@pytest.mark.parametrize("name", list(HLO_CASES))
def test_hlo_collectives_forward_backward_and_tangent(name):
    fn, in_spec, out_spec, shape, fwd, bwd = HLO_CASES[name]
    f = jax.jit(jax.shard_map(fn, mesh=mesh(), in_specs=in_spec, out_specs=out_spec))
    x = np.random.default_rng(11).normal(size=shape if in_spec == R else (N * shape[0], *shape[1:]))
    assert collectives_in(compiled(f, x)) == collections.Counter(fwd), "forward"

    y, pullback = jax.vjp(f, x)
    assert collectives_in(compiled(lambda ct: pullback(ct), y)) == collections.Counter(bwd), "backward"

    # the JVP's tangent program (jax.linearize: the primal is computed once, outside it) applies the
    # same collective to the tangent; max/min's tie count stays on the primal side
    _, tangent_map = jax.linearize(f, x)
    assert collectives_in(compiled(lambda t: tangent_map(t), x)) == collections.Counter(fwd), "jvp tangent"

    # the whole JVP: one collective for the primal and one for the tangent (XLA may combine them),
    # plus the tie count of max/min
    counts = collectives_in(compiled(lambda x, t: jax.jvp(f, (x,), (t,)), x, x))
    extra = 1 if name.startswith(("all_reduce-max", "all_reduce-min")) else 0
    assert set(counts) == set(fwd), ("jvp", counts)
    for kind, n in fwd.items():
        assert n <= counts[kind] <= 2 * n + extra, ("jvp", counts)


def test_hlo_data_parallel_train_step_has_one_all_reduce_per_parameter_at_most():
    params, x, y = mlp_problem()
    counts = collectives_in(compiled(jax.grad(data_parallel_loss), params, x, y))
    assert 1 <= counts[AR] <= len(jax.tree.leaves(params)), counts
    assert set(counts) == {AR}, counts


# --- errors -----------------------------------------------------------------------------------


def trace(fn, local_shape=(16, 8)):
    """Traces fn per device under shard_map (errors are raised at trace time)."""
    x = jax.ShapeDtypeStruct((N * local_shape[0], *local_shape[1:]), np.float64)
    return jax.eval_shape(jax.shard_map(fn, mesh=mesh(), in_specs=P("i"), out_specs=P("i")), x)


def uneven(sizes):
    return lambda x: C.all_to_all_uneven(x, "i", sizes)


# name: (per-device function of a (16, 8) local block, regex the ValueError must match)
ERRORS = {
    "all_reduce-op": (lambda x: C.all_reduce(x, "i", "prod"), r"all_reduce: `op` must be one of .*'prod'"),
    "all_reduce-op-case": (lambda x: C.all_reduce(x, "i", "SUM"), r"`op`"),
    "reduce_scatter-op": (
        lambda x: C.reduce_scatter(x, "i", op="max"),
        r"reduce_scatter: `op` must be one of \('sum', 'mean'\)",
    ),
    "all_gather-axis": (lambda x: C.all_gather(x, "i", axis=3), r"all_gather: `axis` must be an int in \[-3, 3\), got 3"),
    "all_gather-tiled-axis": (
        lambda x: C.all_gather(x, "i", axis=2, tiled=True),
        r"all_gather: `axis` must be an int in \[-2, 2\)",
    ),
    "all_gather-axis-type": (lambda x: C.all_gather(x, "i", axis=0.0), r"all_gather: `axis`"),
    "reduce_scatter-axis": (lambda x: C.reduce_scatter(x, "i", axis=-3), r"reduce_scatter: `axis` must be an int"),
    "reduce_scatter-divisible": (
        lambda x: C.reduce_scatter(x[:, :6], "i", axis=1),
        r"reduce_scatter: dimension 1 .*`axis`.* multiple of the size 8",
    ),
    "all_to_all-split_axis": (lambda x: C.all_to_all(x, "i", 2, 0), r"all_to_all: `split_axis` must be an int"),
    "all_to_all-concat_axis": (lambda x: C.all_to_all(x, "i", 0, -3), r"all_to_all: `concat_axis` must be an int"),
    "all_to_all-divisible": (
        lambda x: C.all_to_all(x[:, :4], "i", 1, 0),
        r"all_to_all: dimension 1 .*`split_axis`.* multiple of the size 8",
    ),
    "scatter_to_parallel-divisible": (
        lambda x: C.scatter_to_parallel(x[:, :4], "i"),
        r"scatter_to_parallel: dimension 1 .*`axis`",
    ),
    "scatter_to_parallel-axis": (lambda x: C.scatter_to_parallel(x, "i", axis=2), r"scatter_to_parallel: `axis`"),
    "gather_from_parallel-axis": (lambda x: C.gather_from_parallel(x, "i", axis=-3), r"gather_from_parallel: `axis`"),
    "uneven-sizes-shape": (uneven(np.ones((7, 8), int)), r"all_to_all_uneven: `sizes` must be a 8x8 table"),
    "uneven-sizes-square-wrong": (uneven(np.ones((4, 4), int)), r"`sizes` must be a 8x8 table"),
    "uneven-sizes-negative": (uneven(-np.eye(8, dtype=int)), r"`sizes` must be a 8x8 table of non-negative"),
    "uneven-too-few-rows": (
        uneven(np.full((8, 8), 3)),
        r"all_to_all_uneven: `x` has 16 rows along axis 0, fewer than .* 24",
    ),
    "uneven-axis": (lambda x: C.all_to_all_uneven(x, "i", SIZES, axis=2), r"all_to_all_uneven: `axis`"),
    "broadcast-root-too-big": (lambda x: C.broadcast(x, "i", 8), r"broadcast: `root` must be an int in \[0, 8\).*got 8"),
    "broadcast-root-negative": (lambda x: C.broadcast(x, "i", -1), r"broadcast: `root`"),
    "broadcast-root-float": (lambda x: C.broadcast(x, "i", 1.0), r"broadcast: `root`"),
    "permute-duplicate-dst": (lambda x: C.permute(x, "i", [(0, 1), (2, 1)]), r"permute: `perm` must be \(src, dst\) pairs"),
    "permute-duplicate-src": (lambda x: C.permute(x, "i", [(0, 1), (0, 2)]), r"permute: `perm`"),
    "permute-dst-out-of-range": (
        lambda x: C.permute(x, "i", [(0, 8)]),
        r"permute: `perm` must be \(src, dst\) pairs in \[0, 8\)",
    ),
    "permute-src-negative": (lambda x: C.permute(x, "i", [(-1, 0)]), r"permute: `perm`"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_arguments_raise_value_error_naming_the_argument(name):
    fn, match = ERRORS[name]
    with pytest.raises(ValueError, match=match):
        trace(fn)


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda x: C.shift(x, "i", 1.5), r"shift: `offset` must be a Python int, got float 1\.5"),
        (lambda x: C.shift(x, "i", jnp.asarray(1) + x.size * 0), r"shift: `offset` must be a Python int, got a traced"),
        (lambda x: C.permute(x, "i", [(0, 1.5)]), r"permute: `perm` must be a Python int, got float 1\.5"),
    ],
    ids=["shift-float", "shift-traced", "permute-float"],
)
def test_device_numbers_must_be_python_ints(fn, match):
    """A fractional offset or device number was truncated (permute) or failed inside numpy's
    indexing (shift); a traced one cannot pick the devices a permute sends to."""
    with pytest.raises(TypeError, match=match):
        trace(fn)


def test_ragged_sizes_table_names_the_argument():
    ragged = [[1] * N] * (N - 1) + [[1] * (N - 1)]
    with pytest.raises(ValueError, match=r"all_to_all_uneven: `sizes`"):
        trace(lambda x: C.all_to_all_uneven(x, "i", ragged))


EVERY_COLLECTIVE = {  # each public collective, called with an axis name
    "all_reduce": lambda x, a: C.all_reduce(x, a),
    "all_reduce-max": lambda x, a: C.all_reduce(x, a, op="max"),
    "all_gather": lambda x, a: C.all_gather(x, a),
    "reduce_scatter": lambda x, a: C.reduce_scatter(x, a),
    "all_to_all": lambda x, a: C.all_to_all(x, a, 0, 1),
    "all_to_all_uneven": lambda x, a: C.all_to_all_uneven(x, a, SIZES),
    "broadcast": lambda x, a: C.broadcast(x, a),
    "permute": lambda x, a: C.permute(x, a, [(0, 1)]),
    "shift": lambda x, a: C.shift(x, a),
    "copy_to_parallel": lambda x, a: C.copy_to_parallel(x, a),
    "reduce_from_parallel": lambda x, a: C.reduce_from_parallel(x, a),
    "scatter_to_parallel": lambda x, a: C.scatter_to_parallel(x, a),
    "gather_from_parallel": lambda x, a: C.gather_from_parallel(x, a),
}


@pytest.mark.parametrize("name", list(EVERY_COLLECTIVE))
def test_an_unbound_axis_name_is_named_in_the_error(name):
    """Inside shard_map jax's psum and ppermute fail on a bare assertion for a name the mesh lacks."""
    fn = EVERY_COLLECTIVE[name]
    fn_name = name.split("-")[0]
    with pytest.raises(NameError, match=rf"{fn_name}: `axis_name` 'j' names no axis here"):
        trace(lambda x: fn(x, "j"))
    with pytest.raises(NameError, match=rf"{fn_name}: `axis_name` \('i', 'j'\) names no axis here"):
        trace(lambda x: fn(x, ("i", "j")))
    with pytest.raises(NameError, match=rf"{fn_name}: `axis_name` 'i' names no axis here"):
        fn(jnp.ones((16, 8)), "i")  # outside any mapped function


@pytest.mark.parametrize("op", ["max", "min"])
def test_complex_extrema_are_refused(op):
    with pytest.raises(TypeError, match=rf"all_reduce: op='{op}' takes real or integer values .* got complex128"):
        trace(lambda x: C.all_reduce(x * 1j, "i", op=op))


def test_a_traced_sizes_table_is_refused():
    """The exchange's layout is built at trace time: a table jit has made a tracer cannot serve."""
    sizes = jnp.asarray(SIZES)
    with pytest.raises(TypeError, match=r"all_to_all_uneven: `sizes` must be a static table"):
        jax.jit(lambda x, sizes: jax.shard_map(lambda x: C.all_to_all_uneven(x, "i", sizes)[0], mesh=mesh(), in_specs=P("i"), out_specs=P("i"))(x))(
            jnp.zeros((N * ROWS, 2)), sizes
        )
