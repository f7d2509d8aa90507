"""A mask or score function applied to a whole tile at once, reading its captured arrays at points.

The functions are traced on scalars (:class:`~jaxforge.primitives._core.StaticFunction`). Vmapped
over a tile's indices (``mods._elementwise``), a read of a captured array at traced indices —
``bias[h, q_idx - kv_idx]``, ``slopes[h]`` — becomes a gather over the whole array: the Triton
backend lowers no gather, and the array would have to sit in a program's registers. Here the
function's program runs equation by equation on broadcast tiles instead, and each read of one
element (``dynamic_slice`` of sizes 1, how ``x[i, j]`` traces) loads a :class:`PointArray` — a
kernel's ref of the whole array — at tiles of indices: one address per element of the tile, in
global memory, clamped into the array as ``dynamic_slice`` clamps. Whole axes taken first
(``bias[h]``, then ``[q_idx - kv_idx]`` of that row) make a view, read later at the point.

A function runs this way when :func:`reads_points` holds: elementwise arithmetic on scalars, and
captured arrays (or rows of them) either read an element at a time or holding one element. Anything else (a gather
with ``mode="fill"``, a sum over a row of a table) runs the XLA lowering.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxforge.primitives._core import StaticFunction, literal_value

__all__ = ["PointArray", "Reads", "evaluate", "reads_points", "reads_refs"]

# Primitives applied elementwise to scalars, which a tile applies to every element; "jit" and
# "pjit" calls (jnp.clip, jnp.where) are opened. Integer and float arithmetic, comparisons, logic.
_ELEMENTWISE = frozenset(
    "abs add and ceil clamp convert_element_type cos div eq exp exp2 floor ge gt integer_pow le log "
    "log1p logistic lt max min mul ne neg not or pow rem round rsqrt select_n sign sin sqrt square "
    "sub tanh xor".split()
)
_CALLS = frozenset({"jit", "pjit", "closed_call"})
# On a value of one element these change only its logical shape: the tile stays as it is.
_RESHAPES = frozenset({"squeeze", "reshape", "broadcast_in_dim", "expand_dims", "dynamic_slice"})


@dataclasses.dataclass(frozen=True)
class PointArray:
    """A captured array as a kernel holds it — a ref of the whole array — read at points.

    ``index``: per leading axis of ``ref``, an index already fixed or None where the axis remains
    (``x[v]``: the item of a vmapped array; ``bias[h]``: a row, a view read later). ``kept``: fixed
    axes that remain as axes of size 1 (a ``dynamic_slice`` not yet squeezed).
    ``tangent``, ``direction``: in a ``jax.jvp`` over ``direction`` (a scalar with tangent 1), each
    read's tangent is ``tangent`` read at the same point (a read is linear in the array).
    ``cotangent``: where a backward adds the cotangents of the reads (``add(index, values)``), and
    ``reads``, the :class:`Reads` of one evaluation that gives them.
    """

    ref: Any
    index: tuple = ()
    kept: frozenset = frozenset()
    tangent: PointArray | None = None
    direction: Any = None
    cotangent: Any = None
    reads: Reads | None = None

    @property
    def axes(self) -> tuple[int, ...]:
        """The axes of ``ref`` that remain, in order."""
        return tuple(a for a in range(len(self.ref.shape)) if a >= len(self.index) or self.index[a] is None or a in self.kept)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(1 if a in self.kept else self.ref.shape[a] for a in self.axes)

    @property
    def dtype(self):
        return self.ref.dtype

    def __getitem__(self, i) -> PointArray:
        """The first remaining axis fixed at ``i``."""
        return self._fixed({self.axes[0]: i}, kept=self.kept)

    def sliced(self, starts, sizes):
        """``lax.dynamic_slice``: the elements at ``starts`` if every size is 1, else a view whose
        axes sliced to one element stay as axes of size 1; the others must be whole."""
        if all(size == 1 for size in sizes):
            return self.read(starts)
        fixed = {a: i for a, i, size, n in zip(self.axes, starts, sizes, self.shape) if size == 1 < n}
        return self._fixed(fixed, kept=self.kept | set(fixed))

    def squeezed(self, dimensions) -> PointArray:
        """``lax.squeeze``: axes of size 1 dropped (an axis of the array's own size 1 fixed at 0)."""
        dropped = [self.axes[d] for d in dimensions]
        return self._fixed({a: 0 for a in dropped if a not in self.kept}, kept=self.kept - set(dropped))

    def _fixed(self, fixed: dict, kept) -> PointArray:
        index = self._index_of_every_axis()
        for axis, i in fixed.items():
            index[axis] = i
        tangent = None if self.tangent is None else self.tangent._fixed(fixed, kept)
        return dataclasses.replace(self, index=tuple(index), kept=frozenset(kept), tangent=tangent)

    def _index_of_every_axis(self) -> list:
        return list(self.index) + [None] * (len(self.ref.shape) - len(self.index))

    def with_tangent(self, tangent: PointArray, direction) -> PointArray:
        return dataclasses.replace(self, tangent=tangent, direction=direction)

    def recorded(self, reads: Reads) -> PointArray:
        return dataclasses.replace(self, reads=reads)

    def read(self, indices=None):
        """The elements at ``indices`` (one per remaining axis, broadcast together), each clamped
        into its axis (an axis of size 1 reads its fixed index); None: the only element."""
        if self.reads is not None and self.reads.replaying:
            return self.reads.replay()
        indices = (0,) * len(self.axes) if indices is None else tuple(indices)
        index = self._index_of_every_axis()
        for a, i in zip(self.axes, indices, strict=True):
            index[a] = index[a] if a in self.kept else i
        full = [jnp.clip(jnp.asarray(i, jnp.int32), 0, n - 1) for i, n in zip(index, self.ref.shape)]
        index = tuple(jnp.broadcast_arrays(*full))
        value = self.ref[index]
        if self.reads is not None:
            self.reads.record(self, index, value)
        if self.tangent is None:
            return value
        return _read_with_tangent(value, self.tangent.read(indices), self.direction)


class Reads:
    """The reads of some arrays during one evaluation of a function, in order; replayed in a second
    evaluation as the values read plus ``offsets``, so that a vjp over the offsets gives each read's
    cotangent (a read at traced indices has no other handle to differentiate)."""

    def __init__(self):
        self.sites: list[tuple[PointArray, tuple, Any]] = []  # (array, index, value) per read
        self._replayed = None

    @property
    def replaying(self) -> bool:
        return self._replayed is not None

    def record(self, array: PointArray, index: tuple, value) -> None:
        self.sites.append((array, index, value))

    def replay_with(self, offsets) -> None:
        self._replayed = iter([value + offset for (_, _, value), offset in zip(self.sites, offsets, strict=True)])

    def replay(self):
        return next(self._replayed)


@jax.custom_jvp
def _read_with_tangent(value, tangent, direction):
    return value


@_read_with_tangent.defjvp
def _read_jvp(primals, tangents):
    value, tangent, _ = primals
    return value, (tangent * tangents[2]).astype(value.dtype)


def reads_refs(consts) -> bool:
    """Whether a kernel hands these consts as :class:`PointArray`\\ s (else whole arrays)."""
    return any(isinstance(c, PointArray) for c in consts)


def reads_points(fn: StaticFunction) -> bool:
    """Whether ``fn`` is elementwise on scalars and reads its captured arrays at points only."""
    jaxpr = fn.jaxpr
    return _reads_points(jaxpr, set(jaxpr.invars[len(jaxpr.invars) - fn.num_consts :]))


def _size(var) -> int:
    return math.prod(var.aval.shape)


def _reads_points(jaxpr, consts) -> bool:
    consts = set(consts)  # captured arrays, and views of them (rows, columns)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner = getattr(inner, "jaxpr", inner)
            if not _reads_points(inner, {iv for iv, v in zip(inner.invars, eqn.invars) if v in consts}):
                return False
            continue
        if _is_view(eqn, consts):
            consts.add(eqn.outvars[0])
            continue
        for position, var in enumerate(eqn.invars):
            if literal_value(var) is not None or _size(var) == 1:
                continue
            point_read = var in consts and name == "dynamic_slice" and position == 0
            if not (point_read and all(s == 1 for s in eqn.params["slice_sizes"])):
                return False
        if name not in _ELEMENTWISE | _RESHAPES or any(_size(v) != 1 for v in eqn.outvars):
            return False
    return True


def _is_view(eqn, consts) -> bool:
    """Whether ``eqn`` takes whole axes of a captured array (``bias[h]``, ``bias[:, j]``):
    a ``dynamic_slice`` of sizes 1 or whole (not all 1: that reads a point), or a ``squeeze``."""
    name, x = eqn.primitive.name, eqn.invars[0] if eqn.invars else None
    if name not in ("squeeze", "dynamic_slice") or literal_value(x) is not None or x not in consts:
        return False
    if name == "squeeze":
        return True
    sizes, shape = eqn.params["slice_sizes"], eqn.invars[0].aval.shape
    return all(s in (1, n) for s, n in zip(sizes, shape)) and not all(s == 1 for s in sizes)


def evaluate(fn: StaticFunction, *args):
    """``fn(*args)[0]`` on tiles: ``args`` are arrays that broadcast together, or
    :class:`PointArray`\\ s for the captured arrays; ``reads_points(fn)`` must hold."""
    return _value(_evaluate(fn.jaxpr, args)[0])


def _evaluate(jaxpr, args, consts=()):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda var: env[var] if (value := literal_value(var)) is None else value  # noqa: E731
    for eqn in jaxpr.eqns:
        ins, name = [read(var) for var in eqn.invars], eqn.primitive.name
        if name in _CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            outs = _evaluate(inner.jaxpr, ins, inner.consts) if hasattr(inner, "consts") else _evaluate(inner, ins)
        elif name == "dynamic_slice" and isinstance(ins[0], PointArray):
            outs = [ins[0].sliced([_value(i) for i in ins[1:]], eqn.params["slice_sizes"])]
        elif name == "squeeze" and isinstance(ins[0], PointArray):
            outs = [ins[0].squeezed(eqn.params["dimensions"])]
        else:
            ins = [_value(x) for x in ins]
            if name in _RESHAPES:
                outs = [ins[0]]
            else:
                outs = [eqn.primitive.bind(*jnp.broadcast_arrays(*ins), **eqn.params)]
        env.update(zip(eqn.outvars, outs))
    return [read(var) for var in jaxpr.outvars]


def _value(x):
    """``x``, or the only element of a :class:`PointArray` (an array or view of one element)."""
    return x.read() if isinstance(x, PointArray) else x
