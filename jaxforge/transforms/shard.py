"""``jf.shard``: a shard_map-style transform with a default mesh and errors that name the culprit."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["default_mesh", "shard"]


def shard(f: Callable | None = None, *, mesh: Mesh | None = None, in_specs, out_specs, check_vma: bool = True):
    """Runs ``f`` once per device on its shard of the inputs (``jax.shard_map`` semantics).

    Args:
      f: the per-device function; it sees local shards and may call ``jf.collectives`` on the
        mesh's axis names. Usable as a decorator: ``@jf.shard(in_specs=..., out_specs=...)``.
      mesh: a ``jax.sharding.Mesh``. Default: the mesh of ``jax.set_mesh`` where one is set (as
        ``jax.shard_map``), else all devices (of every process) on one axis, named after the one
        axis name the specs use ("data" if they use none). On a mesh with explicit axes the
        arguments (host arrays too) are first resharded as ``in_specs`` say.
      in_specs, out_specs: ``PartitionSpec`` pytrees (prefixes of the arguments / results).
      check_vma: track which values vary across devices (JAX's default); it is what makes every
        transpose exact, e.g. the gradient of a replicated parameter is summed once, never
        multiplied by the number of devices.

    Composes with jit, grad, jvp and vmap. Bad specs raise before tracing ``f``, naming the
    argument, its shape and the offending axis. The shard_map runs under ``jax.jit`` (one per
    mesh): called eagerly, or differentiated eagerly, it compiles once per shape instead of
    dispatching every collective and operation of ``f`` on its own (seconds, not minutes, for a
    ring attention); under an outer ``jit`` the inner one is inlined. On a mesh with explicit axes,
    differentiate eagerly under ``jax.set_mesh(mesh)``: JAX builds ``jax.grad``'s seed for a result
    on that mesh outside any ``jit`` and refuses it without one.
    """
    if f is None:
        return functools.partial(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    if not callable(f):
        raise TypeError(f"shard: `f` must be callable, got {type(f).__name__}")

    @functools.cache  # per mesh, so that jit's cache of compiled programs persists across calls
    def mapped(the_mesh):
        return jax.jit(jax.shard_map(f, mesh=the_mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))

    @functools.wraps(f)
    def sharded(*args):
        the_mesh = mesh if mesh is not None else _context_mesh() or default_mesh(_axis_names((in_specs, out_specs)))
        _check_in_specs(args, in_specs, the_mesh)
        _check_axes("out_specs", out_specs, the_mesh)
        return mapped(the_mesh)(*_placed(args, in_specs, the_mesh))

    return sharded


def default_mesh(axis_names=()) -> Mesh:
    """All devices of all processes on one axis (named after ``axis_names``' only entry, or "data")."""
    names = sorted(set(axis_names))
    if len(names) > 1:
        raise ValueError(
            f"shard: the specs use several mesh axes {names}; pass mesh=jax.make_mesh(shape, {tuple(names)}) "
            "(the default mesh has one axis)"
        )
    name = names[0] if names else "data"
    return jax.make_mesh((jax.device_count(),), (name,), axis_types=(jax.sharding.AxisType.Auto,))


def _context_mesh():
    """The mesh of ``jax.set_mesh`` (abstract under ``jit``, where only its shape is known), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _is_spec(x) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _spec_axes(spec) -> list:
    axes = []
    for entry in spec or ():
        axes.extend(entry if isinstance(entry, tuple) else [entry])
    return [a for a in axes if a is not None]


def _axis_names(specs) -> list:
    return [a for spec in jax.tree_util.tree_leaves(specs, is_leaf=_is_spec) if spec is not None for a in _spec_axes(spec)]


def _check_axes(what: str, specs, mesh: Mesh):
    for spec in jax.tree_util.tree_leaves(specs, is_leaf=_is_spec):
        if not _is_spec(spec):
            raise TypeError(f"shard: `{what}` must hold PartitionSpecs (or None), got {spec!r}")
        for axis in _spec_axes(spec):
            if axis not in mesh.axis_names:
                raise ValueError(f"shard: {what} {spec} names axis {axis!r}, which the mesh {dict(mesh.shape)} lacks")


def _placed(args, in_specs, mesh: Mesh) -> tuple:
    """``args`` resharded to ``in_specs`` where ``mesh`` has explicit axes: there, shard_map takes
    only inputs already laid out as the specs say, and a host array is laid out on no mesh."""
    if jax.sharding.AxisType.Explicit not in tuple(mesh.axis_types):
        return tuple(args)

    def place(spec, sub):
        target = NamedSharding(mesh, PartitionSpec() if spec is None else spec)
        return jax.tree_util.tree_map(lambda leaf: jax.sharding.reshard(jnp.asarray(leaf), target), sub)

    return jax.tree_util.tree_map(place, in_specs, tuple(args), is_leaf=_is_spec)


def _check_in_specs(args, in_specs, mesh: Mesh):
    _check_axes("in_specs", in_specs, mesh)
    pairs = []
    collect = lambda spec, sub: pairs.extend((spec, leaf) for leaf in jax.tree_util.tree_leaves(sub))
    try:
        jax.tree_util.tree_map(collect, in_specs, tuple(args), is_leaf=_is_spec)
    except ValueError as err:
        raise ValueError(f"shard: in_specs {in_specs} is not a prefix of the {len(args)} argument(s): {err}") from None
    for index, (spec, arg) in enumerate(pairs):
        shape = getattr(arg, "shape", ())
        if spec is None:
            continue
        if len(spec) > len(shape):
            raise ValueError(f"shard: in_specs {spec} has {len(spec)} entries, but argument leaf {index} has shape {shape}")
        for dim, entry in enumerate(spec):
            axes = [] if entry is None else list(entry if isinstance(entry, tuple) else (entry,))
            size = math.prod(mesh.shape[a] for a in axes)
            if axes and shape[dim] % size:
                raise ValueError(
                    f"shard: argument leaf {index} has shape {shape}; its dim {dim} ({shape[dim]}) is not a "
                    f"multiple of the mesh axes {axes} (size {size}) that in_specs {spec} splits it over"
                )
