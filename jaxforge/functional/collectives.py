r"""Differentiable collectives, usable inside ``jf.shard``, ``jax.shard_map`` and ``vmap(axis_name=...)``.

Each is built from XLA's own collectives (``lax.psum``, ``all_gather``, ``psum_scatter``,
``all_to_all``, ``ppermute``), so communication is never reimplemented, and JAX's typing of values
as *invariant* (the same on every device of an axis) or *varying* decides every transpose: a
gradient is never silently multiplied or summed by the axis size.

=====================  =========================  ================================  ==========================
function               forward                    transpose (reverse mode)          collectives fwd / bwd
=====================  =========================  ================================  ==========================
all_reduce sum/mean    all-reduce (→ invariant)   broadcast of the cotangent        1 / 0
all_reduce max/min     all-reduce max/min         cotangent to the devices holding  1 (+1 tie count under
                                                  the extremum, split among ties    differentiation) / 0
all_gather             all-gather                 reduce-scatter                    1 / 1
reduce_scatter         reduce-scatter             all-gather                        1 / 1
all_to_all(_uneven)    all-to-all                 all-to-all, axes swapped          1 / 1
broadcast              all-reduce of root's x     cotangent to the root             1 / 0
permute, shift         collective-permute         inverse permutation               1 / 1
=====================  =========================  ================================  ==========================

JVPs apply the same (linear) collective to the tangent; max/min's tangent is the tangent of the
extremum's holder (averaged over ties). Every function also works under ``vmap`` with an
``axis_name``, which is the single-device reference the tests compare against.

The Megatron-LM tensor-parallel pairs, named for what they do in each direction:

* :func:`copy_to_parallel` — identity forward, all-reduce backward (Megatron's *f*);
* :func:`reduce_from_parallel` — all-reduce forward, identity backward (*g*);
* :func:`scatter_to_parallel` — keep this device's slice forward; backward reassembles the
  gradient (an all-reduce of the zero-padded slice: JAX has no public split whose transpose is an
  all-gather);
* :func:`gather_from_parallel` — all-gather forward; backward reduce-scatters when the gathered
  value feeds per-device (tensor-parallel) computation, ``tensor_parallel_output_grad=True``, or
  just takes this device's slice when the computation after it is duplicated (``False``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxforge.functional._static import static_bool, static_int
from jaxforge.primitives import _core

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_uneven",
    "broadcast",
    "copy_to_parallel",
    "gather_from_parallel",
    "permute",
    "reduce_from_parallel",
    "reduce_scatter",
    "scatter_to_parallel",
    "shift",
]

_REDUCE_OPS = ("sum", "mean", "max", "min")


def all_reduce(x, axis_name, op: str = "sum"):
    """Reduces ``x`` over the devices of ``axis_name``; every device gets the result.

    ``op``: "sum", "mean", "max" or "min". max/min are differentiable: the tangent (or gradient)
    goes to the devices whose value equals the result, shared equally among ties.
    """
    _check_op("all_reduce", op, _REDUCE_OPS)
    _axis_size("all_reduce", axis_name)
    if op in ("max", "min") and jnp.iscomplexobj(x):
        raise TypeError(f"all_reduce: op={op!r} takes real or integer values (complex numbers have no order), got {jnp.result_type(x)}")
    if op == "sum":
        return lax.psum(x, axis_name)
    if op == "mean":
        return lax.pmean(x, axis_name)
    return _extremum(x, axis_name, op)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _extremum(x, axis_name, op):
    return (lax.pmax if op == "max" else lax.pmin)(x, axis_name)


@_extremum.defjvp
def _extremum_jvp(axis_name, op, primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _extremum(x, axis_name, op)
    holds = (x == y).astype(dx.dtype)
    # One all-reduce for the tie count (primal, so it is not transposed) and one, linear, for the
    # tangent of the holders: the extremum's tangent, averaged over ties.
    count = lax.psum(holds, axis_name)
    return y, lax.psum(holds * dx, axis_name) / count


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """Every device's ``x`` along a new axis ``axis`` (stacked), or concatenated when ``tiled``."""
    tiled = static_bool("all_gather", "tiled", tiled)
    axis = _axis("all_gather", "axis", axis, x.ndim + (0 if tiled else 1))
    _axis_size("all_gather", axis_name)
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def reduce_scatter(x, axis_name, *, axis: int = 0, op: str = "sum"):
    """Sums (or averages) ``x`` over the devices and keeps chunk ``i`` of ``axis`` on device ``i``.

    ``x.shape[axis]`` must be a multiple of the axis size (torch's reduce_scatter_tensor).
    """
    _check_op("reduce_scatter", op, ("sum", "mean"))
    axis = _axis("reduce_scatter", "axis", axis, x.ndim)
    _check_divisible("reduce_scatter", "axis", x, axis, axis_name)
    out = lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)
    return out / lax.axis_size(axis_name) if op == "mean" else out


def all_to_all(x, axis_name, split_axis: int, concat_axis: int):
    """Cuts ``split_axis`` into axis-size chunks, sends chunk ``i`` to device ``i``, and concatenates
    what arrives along ``concat_axis`` (in device order)."""
    split_axis = _axis("all_to_all", "split_axis", split_axis, x.ndim)
    concat_axis = _axis("all_to_all", "concat_axis", concat_axis, x.ndim)
    _check_divisible("all_to_all", "split_axis", x, split_axis, axis_name)
    return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)


def all_to_all_uneven(x, axis_name, sizes, *, axis: int = 0):
    """All-to-all with per-peer sizes: device ``i`` sends ``sizes[i][j]`` rows of ``axis`` to ``j``.

    ``sizes`` is a static ``n × n`` table. Device ``i`` reads its rows from the front of ``x``:
    the first ``sizes[i][0]`` go to device 0, the next ``sizes[i][1]`` to device 1, and so on
    (``x.shape[axis]`` must hold the largest row sum). Device ``j`` returns ``(out, count)``:
    what it received, concatenated in sender order at the front of ``out``, zero-padded to the
    largest column sum, and ``count = sum_i sizes[i][j]``. One dense all-to-all of chunks padded to
    the largest entry carries the data; the transpose is the same exchange with the table transposed.
    """
    axis = _axis("all_to_all_uneven", "axis", axis, x.ndim)
    n = _axis_size("all_to_all_uneven", axis_name)
    if isinstance(sizes, jax.core.Tracer):
        raise TypeError("all_to_all_uneven: `sizes` must be a static table (nested lists or a numpy array), got a traced array")
    try:
        table = np.asarray(sizes)
    except ValueError:
        table = np.zeros((0,))
    if table.shape != (n, n) or not np.issubdtype(table.dtype, np.integer) or (table < 0).any():
        raise ValueError(
            f"all_to_all_uneven: `sizes` must be a {n}x{n} table of non-negative ints for axis "
            f"{axis_name!r} of size {n}, got {table.tolist()}"
        )
    if x.shape[axis] < table.sum(axis=1).max():
        raise ValueError(
            f"all_to_all_uneven: `x` has {x.shape[axis]} rows along axis {axis}, fewer than the largest "
            f"number a device sends, {table.sum(axis=1).max()}"
        )
    chunk, capacity = max(int(table.max()), 1), int(table.sum(axis=0).max())
    x = jnp.moveaxis(x, axis, 0)
    me = lax.axis_index(axis_name)
    # Send side: row r of chunk j is x[start_ij + r] (zero past sizes[i][j]).
    starts = np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(table, axis=1)[:, :-1]], axis=1)
    rows = np.arange(chunk)
    send_idx = jnp.asarray(starts[:, :, None] + rows, jnp.int32)[me]  # (n, chunk)
    send_ok = jnp.asarray(rows < table[:, :, None])[me]
    send = jnp.where(_expand(send_ok, x.ndim), x[send_idx], 0)  # (n, chunk, ...)
    recv = lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # chunk i now comes from device i
    # Receive side: output row o is row (o - offset_ij) of chunk i for the sender i it falls in.
    offsets = np.concatenate([np.zeros((1, n), np.int64), np.cumsum(table, axis=0)[:-1]], axis=0)
    src = np.zeros((n, capacity), np.int64)
    valid = np.zeros((n, capacity), bool)
    for j in range(n):
        for i in range(n):
            for r in range(table[i, j]):
                src[j, offsets[i, j] + r] = i * chunk + r
                valid[j, offsets[i, j] + r] = True
    flat = recv.reshape(n * chunk, *recv.shape[2:])
    out = jnp.where(_expand(jnp.asarray(valid)[me], x.ndim), flat[jnp.asarray(src, jnp.int32)[me]], 0)
    return jnp.moveaxis(out, 0, axis), jnp.asarray(table.sum(axis=0), jnp.int32)[me]


def broadcast(x, axis_name, root: int = 0):
    """Device ``root``'s ``x`` on every device (one all-reduce; works on every platform).

    The gradient flows to ``root`` only.
    """
    n = _axis_size("broadcast", axis_name)
    if not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ValueError(f"broadcast: `root` must be an int in [0, {n}) for axis {axis_name!r}, got {root!r}")
    return lax.psum(jnp.where(lax.axis_index(axis_name) == root, x, jnp.zeros_like(x)), axis_name)


def permute(x, axis_name, perm):
    """Sends device ``src``'s ``x`` to ``dst`` for each pair ``(src, dst)`` in ``perm``; devices that
    receive nothing get zeros. Over a tuple of axes, devices are numbered in the tuple's order, as
    ``axis_index`` and a spec's shards number them."""
    n = _axis_size("permute", axis_name)
    perm = tuple((static_int("permute", "perm", s), static_int("permute", "perm", d)) for s, d in perm)
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if any(not 0 <= i < n for i in srcs + dsts) or len(set(srcs)) < len(srcs) or len(set(dsts)) < len(dsts):
        raise ValueError(
            f"permute: `perm` must be (src, dst) pairs in [0, {n}) with each src and each dst at most "
            f"once, got {list(perm)}"
        )
    if len(perm) < n:
        # Complete the permutation (vmap's rule wants a full one); the added senders send zeros.
        idle_src = [i for i in range(n) if i not in srcs]
        idle_dst = [i for i in range(n) if i not in dsts]
        sends = jnp.asarray(np.isin(np.arange(n), srcs))[lax.axis_index(axis_name)]
        x = jnp.where(sends, x, jnp.zeros_like(x))
        perm = perm + tuple(zip(idle_src, idle_dst))
    return lax.ppermute(x, *_in_mesh_order(axis_name, perm))


def shift(x, axis_name, offset: int = 1):
    """The ring step: device ``i``'s ``x`` goes to device ``(i + offset) mod n``."""
    n = _axis_size("shift", axis_name)
    offset = static_int("shift", "offset", offset)
    return lax.ppermute(x, *_in_mesh_order(axis_name, [(i, (i + offset) % n) for i in range(n)]))


def _in_mesh_order(axis_name, perm):
    """``(axis_name, perm)`` for ``lax.ppermute``, with a tuple of mesh axes put in the mesh's order
    and ``perm``'s device numbers renumbered to match. Devices are numbered along a tuple of axes
    in the tuple's order by ``axis_index``, ``all_gather``, ``psum_scatter`` and a sharding's spec,
    but in the mesh's order by ``ppermute`` (jax 0.10): with the tuple in the mesh's order, both agree."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    mesh = jax.sharding.get_abstract_mesh()
    if len(names) < 2 or not all(name in mesh.axis_names for name in names):
        return axis_name, perm
    ordered = tuple(sorted(names, key=mesh.axis_names.index))
    sizes = [mesh.shape[name] for name in names]

    def renumber(i):
        coords = dict(zip(names, np.unravel_index(i, sizes)))
        return int(np.ravel_multi_index([coords[name] for name in ordered], [mesh.shape[name] for name in ordered]))

    return ordered, [(renumber(src), renumber(dst)) for src, dst in perm]


def copy_to_parallel(x, axis_name):
    """Identity forward, all-reduce backward (Megatron's *f*): an invariant value entering
    per-device computation. Its gradient sums the devices' contributions."""
    _axis_size("copy_to_parallel", axis_name)
    return _to_varying(x, axis_name)


def _to_varying(x, axis_name):
    """``pcast(x, to="varying")`` inside shard_map. Under ``vmap(axis_name=...)`` values carry no
    varying/invariant type and an unbatched input's cotangent is already summed over the batch, so
    the identity is exact there."""
    return lax.pcast(x, axis_name, to="varying") if _typed_axis(axis_name) else x


def _typed_axis(axis_name) -> bool:
    """Whether ``axis_name`` is a shard_map axis whose values are typed varying/invariant."""
    return axis_name in _core.varying_axes(lax.axis_index(axis_name))


def reduce_from_parallel(x, axis_name):
    """All-reduce forward, identity backward (Megatron's *g*): partial per-device results summed."""
    _axis_size("reduce_from_parallel", axis_name)
    return lax.psum(x, axis_name)


def scatter_to_parallel(x, axis_name, *, axis: int = -1):
    """This device's chunk of an invariant ``x`` along ``axis`` (no communication forward)."""
    axis = _axis("scatter_to_parallel", "axis", axis, x.ndim)
    _check_divisible("scatter_to_parallel", "axis", x, axis, axis_name)
    size = x.shape[axis] // _axis_size("scatter_to_parallel", axis_name)
    x = _to_varying(x, axis_name)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * size, size, axis)


def gather_from_parallel(x, axis_name, *, axis: int = -1, tensor_parallel_output_grad: bool = True):
    """All-gather of the devices' chunks along ``axis`` (concatenated).

    ``tensor_parallel_output_grad=True``: what follows runs per device, so each device's gradient
    is partial and the backward reduce-scatters. ``False``: what follows is the same on every device
    (the result is invariant), so the backward only keeps this device's slice — no communication.
    """
    axis = _axis("gather_from_parallel", "axis", axis, x.ndim)
    _axis_size("gather_from_parallel", axis_name)
    # Under vmap every item is its own computation: the varying gather is the exact semantics.
    per_device = static_bool("gather_from_parallel", "tensor_parallel_output_grad", tensor_parallel_output_grad)
    invariant = not per_device and _typed_axis(axis_name)
    return lax.all_gather(x, axis_name, axis=axis, tiled=True, to="invarying" if invariant else "varying")


def _expand(mask, ndim):
    return mask.reshape(mask.shape + (1,) * (ndim - 1))


def _check_op(fn, op, allowed):
    if op not in allowed:
        raise ValueError(f"{fn}: `op` must be one of {allowed}, got {op!r}")


def _axis(fn, name, axis, ndim):
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"{fn}: `{name}` must be an int in [{-ndim}, {ndim}), got {axis!r}")
    return int(axis) % ndim


def _axis_size(fn, axis_name) -> int:
    """The size of ``axis_name`` (a name or a tuple of names), or an error naming the function where
    it is not bound (inside shard_map, jax's psum and ppermute fail on an assertion)."""
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise NameError(
            f"{fn}: `axis_name` {axis_name!r} names no axis here ({err}); call {fn} inside jf.shard, "
            "jax.shard_map or jax.vmap(axis_name=...) with that axis"
        ) from None


def _check_divisible(fn, name, x, axis, axis_name):
    n = _axis_size(fn, axis_name)
    if x.shape[axis] % n:
        raise ValueError(
            f"{fn}: dimension {axis} of x (shape {x.shape}, the `{name}`) must be a multiple of the "
            f"size {n} of axis {axis_name!r}"
        )
