"""The one helper that declares jaxforge primitives.

Every primitive is written on its *core rank*: operands are ``(*batch, *core)`` with the same
leading batch dims, so one batching rule serves them all — the vmapped axis is moved to the front
and becomes one more batch dim (never a Python loop). A primitive brings three functions:

* ``abstract_eval(*avals, **params) -> tuple[ShapedArray, ...]``: shapes and dtypes, raising a
  clear error at trace time for bad input;
* ``jvp(primals, tangents, **params) -> (primals_out, tangents_out)``: written with operations JAX
  can transpose, so reverse mode comes from transposition;
* a default implementation in jax operations, registered by ``lowering/`` with
  :func:`register_lowering`, which runs on every platform.

It also holds :func:`kernel_call`, the FFI call every batched CUDA kernel goes through, marked so
that XLA's partitioner splits it along its batch dims. This module is the only one in jaxforge
that touches ``jax.extend`` and ``jax.interpreters``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import core, lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import ClosedJaxpr, Literal, Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding, PartitionSpec

__all__ = [
    "PrimitiveSpec",
    "StaticFunction",
    "batch_sharded_avals",
    "define_primitive",
    "gathered",
    "instantiate_zeros",
    "is_linear_input",
    "is_symbolic_zero",
    "jvp_along",
    "jvp_in_floats",
    "kernel_call",
    "literal_value",
    "mesh_axes",
    "moving_tangents",
    "named_residuals",
    "output_aval",
    "register_lowering",
    "registered_primitives",
    "resharded",
    "trace_function",
    "varying_axes",
    "zero_tangent",
]


class _Primitive(Primitive):
    """Binds with every operand varying over the same manual (shard_map) axes.

    JAX's own primitives get this from ``pvary`` insertion at bind; ours do it here, so the outputs
    vary over the union of the operands' axes and each transpose hands an operand that was the same
    on every device a cotangent summed over them (the transpose of the ``pvary``).
    """

    def bind(self, *args, **params):
        return super().bind(*of_one_type(args), **params)


def varying_axes(x) -> frozenset:
    """The shard_map axes over which ``x`` (an array or aval) may differ between devices."""
    aval = x if isinstance(x, core.AbstractValue) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10+
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def output_aval(template, shape, dtype, sharding=None):
    """An output aval with ``template``'s varying axes (and sharding unless given)."""
    kwargs = dict(shape=tuple(shape), dtype=dtype, weak_type=False)
    if sharding is not None:
        kwargs["sharding"] = sharding
    return template.update(**kwargs)


@dataclasses.dataclass(frozen=True)
class PrimitiveSpec:
    """What the contract test needs to find every piece of one primitive."""

    primitive: Primitive
    reference: Callable  # the plain jax.numpy spec every lowering is tested against
    example_args: Callable[[], tuple]  # small float64 operands, for the contract test
    example_params: dict
    test_module: str  # path relative to the repository root
    bench_entry: str  # "<family>/<op>": jaxforge.bench.<family>.OPS[<op>]


_REGISTRY: dict[str, PrimitiveSpec] = {}


def define_primitive(
    name: str,
    *,
    abstract_eval: Callable,
    jvp: Callable,
    reference: Callable,
    example_args: Callable[[], tuple],
    example_params: dict,
    test_module: str,
    bench_entry: str,
    transpose: Callable | None = None,
    batch: Callable | None = None,
    dce: Callable | None = None,
    known_outputs: Callable | None = None,
) -> Primitive:
    """Declares a multiple-results primitive with core-rank rules and leading batch dims.

    ``transpose(cotangents, *operands, **params)`` makes the primitive linear in the operands that
    arrive as linear inputs (:func:`is_linear_input`); it returns one cotangent (or None) per
    operand. ``batch(prim, args, dims, **params) -> (outs, out_dims)`` replaces the default rule,
    which moves the vmapped axis in front as one more batch dim. ``dce(used_outputs, **params) ->
    (params, kept)``: the params of a bind computing only the outputs ``kept`` marks (those used
    among them), for the dead-code elimination ``jax.jit`` runs before lowering.
    ``known_outputs(operands, avals, **params)``, where some operands are unknown (None; ``avals``
    are all operands'), as in ``jax.linear_transpose``: the outputs that do not depend on them,
    computed from the known ones (None for the others; all None if none can be), so that what
    follows them stays known and need not be linear.
    """
    if name in _REGISTRY:
        raise ValueError(f"primitive {name!r} is declared twice")
    prim = _Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(abstract_eval)
    prim.def_impl(functools.partial(_impl_through_jit, prim))
    ad.primitive_jvps[prim] = functools.partial(_jvp_of_tangents_like_primals, jvp)
    if transpose is not None:
        ad.primitive_transposes[prim] = functools.partial(_transpose_of_cotangents_like_outputs, transpose, prim)
    batching.primitive_batchers[prim] = functools.partial(batch or _leading_batch_rule, prim)
    if dce is not None:
        pe.dce_rules[prim] = functools.partial(_dce_rule, dce)
    if known_outputs is not None:
        pe.custom_partial_eval_rules[prim] = functools.partial(_partial_eval_rule, known_outputs, prim)
    _REGISTRY[name] = PrimitiveSpec(
        primitive=prim,
        reference=reference,
        example_args=example_args,
        example_params=dict(example_params),
        test_module=test_module,
        bench_entry=bench_entry,
    )
    return prim


def _jvp_of_tangents_like_primals(jvp: Callable, primals, tangents, **params):
    """``jvp`` with each primal an array (``jax.jvp`` of a Python number hands it on as it is, and
    the rules read dtypes) and each tangent placed like its primal under explicit sharding: a
    replicated tangent of a batch-sharded primal is resharded to it, as the rules' per-shard
    kernels take both in the primal's blocks."""
    primals = [jnp.asarray(p) if isinstance(p, (bool, int, float, complex)) else p for p in primals]

    return jvp(primals, [_placed_like(jax.typeof(p), t) for p, t in zip(primals, tangents)], **params)


def _transpose_of_cotangents_like_outputs(transpose: Callable, prim: Primitive, cts, *operands, **params):
    """``transpose`` with each cotangent placed like its output under explicit sharding (a
    replicated cotangent handed to ``jax.vjp`` of a batch-sharded output, as for tangents above).
    The outputs' types are worked out only where an operand is split: theirs follow the operands'."""
    avals = [x.aval if is_linear_input(x) else jax.typeof(x) for x in operands]
    if not any(explicitly_sharded(aval) for aval in avals):
        return transpose(cts, *operands, **params)
    outputs, _ = prim.abstract_eval(*avals, **params)
    return transpose([_placed_like(aval, ct) for aval, ct in zip(outputs, cts)], *operands, **params)


def _placed_like(aval, x):
    """``x`` (a tangent or cotangent of a value of type ``aval``) resharded as ``aval`` is, where that
    is explicitly sharded; symbolic zeros and float0 unchanged."""
    if type(x) is ad.Zero or not explicitly_sharded(aval) or x.dtype == jax.dtypes.float0:
        return x
    return x if jax.typeof(x).sharding == aval.sharding else jax.sharding.reshard(x, aval.sharding)


def registered_primitives() -> dict[str, PrimitiveSpec]:
    """Every primitive declared so far, by name."""
    return dict(_REGISTRY)


def register_lowering(
    prim: Primitive,
    impl: Callable,
    *,
    platform: str | None = None,
    shards: bool = False,
    shared_operands: Callable[..., Sequence[bool]] | None = None,
    partitionable: bool = False,
) -> None:
    """Lowers ``prim`` by tracing ``impl`` (jax operations) into the enclosing computation.

    ``platform=None`` registers the default lowering, used wherever no platform-specific one is.
    ``impl`` is written once, for one device; sharding is handled here — the primitive's sharding
    rule, the same for every lowering, kernels included. Under explicit sharding ``impl`` runs per
    shard under ``shard_map`` on the operands' blocks (the dims the abstract eval lets be sharded:
    batch dims, attention's heads), so a custom call (a GPU kernel) sees local shapes and no
    operand is gathered. ``shared_operands(num_operands, **params)`` flags operands every shard
    needs whole (a mask's segment ids): they are replicated first. An output with no sharded dim
    is a sum over the shards (the cotangent of a shared operand) and is all-reduced. With
    ``shards``, ``impl`` receives ``shards=``: per dim of its first operand, ``(shard index, number
    of shards)``, or None when unsharded, to recover global indices. Under automatic sharding the
    partitioner splits ``impl``'s operations; a platform's ``impl`` whose custom calls it cannot
    split (a Pallas kernel's) warns there, unless ``partitionable``: its kernels are
    :func:`kernel_call`'s, split along their batch dims.
    """

    def lowering(ctx, *args, **params):
        # Inside shard_map the avals say over which mesh axes a value varies; the lowering emits
        # per-device code, where that typing has no meaning (and would make loop carries built
        # from constants mismatch their varying updates), so it traces on plain avals.
        ctx = ctx.replace(avals_in=[_untyped(a) for a in ctx.avals_in], avals_out=[_untyped(a) for a in ctx.avals_out])
        fn = functools.partial(impl, **params)
        if any(explicitly_sharded(aval) for aval in ctx.avals_in + ctx.avals_out):
            shared = shared_operands(len(args), **params) if shared_operands else [False] * len(args)
            fn = _per_shard(fn, ctx.avals_in, ctx.avals_out, shared, shards)
        else:
            if platform is not None and not partitionable and (devices := getattr(ctx.module_context.axis_context, "num_devices", 1)) > 1:
                _warn_whole_on_every_device(prim.name, platform, devices)
            if shards:
                fn = functools.partial(fn, shards=None)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    mlir.register_lowering(prim, lowering, platform=platform)


def _warn_whole_on_every_device(name: str, platform: str, devices: int) -> None:
    """A kernel lowering under ``jit`` over several devices with automatic axes: XLA's partitioner
    cannot split its custom call, a Pallas kernel's, whose grid is fixed at lowering. (A
    ``custom_partitioning`` bound here would, but jax 0.10 hands the device assignment it needs only
    to the lowerings of primitives in a private registry.)"""
    warnings.warn(
        f"jaxforge: {name} under jax.jit over {devices} devices with automatic mesh axes runs its {platform} "
        "kernel on the whole of its operands on every device (XLA's partitioner cannot split a custom "
        "call): shard the operands on an explicit mesh (jax.make_mesh's default axis types), where it "
        "runs per shard, or call it inside jf.shard",
        stacklevel=2,
    )


def _full_spec(aval) -> tuple:
    spec = tuple(aval.sharding.spec)
    return spec + (None,) * (aval.ndim - len(spec))


def mesh_axes(entry) -> tuple:
    """The mesh axes of one entry of a PartitionSpec (None, a name or a tuple of names)."""
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def _per_shard(fn, avals_in, avals_out, shared, pass_shards: bool):
    mesh = next(a.sharding.mesh for a in (*avals_in, *avals_out) if explicitly_sharded(a))
    in_specs = tuple(PartitionSpec() if s else PartitionSpec(*_full_spec(a)) for a, s in zip(avals_in, shared))
    used = tuple(sorted({ax for spec in in_specs for entry in spec for ax in mesh_axes(entry)}))
    summed = [not explicitly_sharded(a) for a in avals_out]
    out_specs = tuple(PartitionSpec() if s else PartitionSpec(*_full_spec(a)) for a, s in zip(avals_out, summed))
    first = _full_spec(avals_in[0])

    def body(*args):
        kwargs = {}
        if pass_shards:
            kwargs["shards"] = tuple(
                (jax.lax.axis_index(mesh_axes(e)), math.prod(mesh.shape[ax] for ax in mesh_axes(e))) if e else (0, 1)
                for e in first
            )
        outs = fn(*args, **kwargs)
        return tuple(jax.lax.psum(o, used) if s and used else o for o, s in zip(outs, summed))

    sharded = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    # shared operands that arrive sharded are gathered first
    return lambda *args: sharded(*(gathered(x) if spec == PartitionSpec() else x for x, spec in zip(args, in_specs)))


def _untyped(aval):
    """``aval`` without the varying-over-manual-axes type of shard_map."""
    if not isinstance(aval, core.ShapedArray):
        return aval
    return core.ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=aval.sharding)


def resharded(x, mesh, spec: PartitionSpec):
    """``x`` resharded to ``spec`` on ``mesh`` (explicit sharding); itself where it is so."""
    if _full_spec(jax.typeof(x)) == tuple(spec) + (None,) * (x.ndim - len(spec)):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def gathered(x, axes=None):
    """``x`` resharded whole along every dim that mesh ``axes`` (None: any axis) split under explicit
    sharding (an all-gather); ``x`` itself where none does."""
    sharding = jax.typeof(x).sharding
    dropped = lambda a: axes is None or a in axes  # noqa: E731
    if not explicitly_sharded(jax.typeof(x)) or not any(dropped(a) for e in sharding.spec for a in mesh_axes(e)):
        return x

    def kept(entry):
        rest = tuple(a for a in mesh_axes(entry) if not dropped(a))
        return rest[0] if len(rest) == 1 else rest or None

    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec(*map(kept, sharding.spec))))


def under_automatic_axes(fn, like, *args):
    """``fn(*args)``, sharded like ``like``; on an explicit mesh, under automatic axes. For the jax
    operations whose sharding types refuse a batch split over explicit axes (a gather from a
    replicated table at split indices; triangular_solve's derivative in its matrix), which XLA's
    partitioner places without collectives."""
    if not explicitly_sharded(jax.typeof(like)):
        return fn(*args)
    return jax.sharding.auto_axes(fn, out_sharding=jax.typeof(like).sharding)(*args)


def explicitly_sharded(aval) -> bool:
    """Whether ``aval``'s type splits some dim over an explicit mesh axis."""
    sharding = getattr(aval, "sharding", None)
    if sharding is None or not any(p is not None for p in sharding.spec):
        return False
    return jax.sharding.AxisType.Explicit in sharding.mesh.axis_types


def batch_sharded_avals(
    fn: str, operands: dict, batch_ndim: int, outputs: Sequence[tuple], *, split: tuple[str, dict] | None = None, hint: str = ""
) -> tuple:
    """Output avals whose batch dims are sharded like the operands'.

    Under explicit sharding, avals carry a sharding: a primitive partitions along its batch dims,
    and optionally along one core dim ``split = (label, {operand name: dim})`` — attention's heads —
    sharded alike in every operand that has it. Any other sharded core dim is an error naming the
    operand, its spec and the spec to reshard it to (then ``hint``). ``outputs`` holds
    ``(shape, dtype)`` or ``(shape, dtype, split dim)``.
    """
    label, split_dims = split if split is not None else ("", {})
    batch_specs, split_specs = {}, {}
    for name, aval in operands.items():
        spec = tuple(aval.sharding.spec) + (None,) * (aval.ndim - len(aval.sharding.spec))
        own = split_dims.get(name)
        own = None if own is None else own % aval.ndim
        if any(p is not None for d, p in enumerate(spec) if d >= batch_ndim and d != own):
            allowed = f"the leading {batch_ndim} batch dim(s)" + (f" and the {label} dim" if split_dims else "")
            kept = PartitionSpec(*(p if d < batch_ndim or d == own else None for d, p in enumerate(spec)))
            raise ValueError(
                f"{fn}: `{name}` is sharded along a core dim, spec {PartitionSpec(*spec)}; only "
                f"{allowed} may be sharded: reshard it first to {kept} (jax.sharding.reshard){hint}"
            )
        batch_specs[name] = spec[:batch_ndim]
        if own is not None:
            split_specs[name] = spec[own]
    for specs, what in ((batch_specs, "batch dims"), (split_specs, f"{label} dims")):
        (first, spec), *rest = specs.items() or [(None, None)]
        for other, other_spec in rest:
            if other_spec != spec:
                raise ValueError(
                    f"{fn}: the {what} of `{first}` and `{other}` are sharded differently, {spec} and {other_spec}"
                )
    batch_spec = next(iter(batch_specs.values()))
    split_spec = next(iter(split_specs.values()), None)
    template = next(iter(operands.values()))
    mesh = template.sharding.mesh

    def spec_of(shape, split_dim):
        entries = [*batch_spec, *[None] * (len(shape) - batch_ndim)]
        if split_dim is not None:
            entries[split_dim % len(shape)] = split_spec
        return NamedSharding(mesh, PartitionSpec(*entries))

    return tuple(output_aval(template, o[0], o[1], spec_of(o[0], o[2] if len(o) > 2 else None)) for o in outputs)


def instantiate_zeros(tangent):
    """A symbolic-zero tangent as an array of zeros; any other tangent unchanged."""
    return ad.instantiate_zeros(tangent)


def zeros(aval):
    """An array of zeros of ``aval``'s type, its sharding on an explicit mesh included."""
    return ad.zeros_like_aval(aval)


def zero_tangent(primal):
    """The symbolic-zero tangent of ``primal`` (float0 for integers): what a JVP rule returns for
    outputs that do not move, at any shape, symbolic ones (``jax.export``) included."""
    return ad.Zero(jax.typeof(primal).to_tangent_aval())


def named_residuals(values: Sequence, names: Sequence[str]) -> tuple:
    """``values``, each under its name (``jax.ad_checkpoint.checkpoint_name``): the forward's results
    a JVP rule hands to its tangent, which a ``jax.checkpoint`` policy may then keep
    (``jaxforge.transforms.remat``) so that a rematerialised backward does not run the forward."""
    return tuple(checkpoint_name(x, name) for x, name in zip(values, names, strict=True))


def jvp_along(fn: Callable, primals: Sequence, tangents: Sequence, moves: Sequence[bool]):
    """``jax.jvp(fn, primals, tangents)`` with the primals where ``moves`` is False held fixed (their
    tangents, zero, are not read): no products of zeros in ``fn``'s loops."""

    def of_moving(*moving):
        it = iter(moving)
        return fn(*(next(it) if m else p for p, m in zip(primals, moves)))

    moving = tuple(p for p, m in zip(primals, moves) if m)
    return jax.jvp(of_moving, moving, tuple(instantiate_zeros(t) for t, m in zip(tangents, moves) if m))


def jvp_in_floats(fn: Callable, primals: Sequence, tangents: Sequence):
    """``jax.jvp(fn, primals, tangents)`` with the integer primals held fixed: their float0
    tangents, whose zeros ``jax.jvp`` would want as arrays, cannot take symbolic shapes."""
    return jvp_along(fn, primals, tangents, [jnp.issubdtype(p.dtype, jnp.inexact) for p in primals])


def moving_tangents(tangents: Sequence) -> tuple[bool, ...]:
    """Which of a JVP rule's ``tangents`` are not symbolic zeros: a second-order primitive's
    ``moving`` parameter, so that its lowering differentiates along those alone."""
    return tuple(not is_symbolic_zero(t) for t in tangents)


def is_symbolic_zero(tangent) -> bool:
    """Whether a JVP rule received a symbolic-zero tangent (the operand does not move)."""
    return isinstance(tangent, ad.Zero)


def is_linear_input(operand) -> bool:
    """Whether a transpose rule received ``operand`` as a linear input (its cotangent is wanted)."""
    return isinstance(operand, ad.UndefinedPrimal)


class StaticFunction:
    """A traced function with every array it closed over hoisted into explicit arguments.

    Calling it takes the traced arguments followed by the hoisted constants, so a primitive can
    carry the function as a (hashable) parameter and the constants as operands: their tangents,
    cotangents and batch dims then flow like any operand's. Two functions with the same program
    compare equal, so eager calls with a fresh closure each time reuse one compilation.
    """

    def __init__(self, closed: ClosedJaxpr, num_consts: int):
        # ``closed`` takes the arguments followed by the constants, and closes over nothing.
        self._jaxpr = closed.jaxpr
        self.num_consts = num_consts
        self.out_avals = tuple(closed.out_avals)
        self._key = str(closed.jaxpr)

    def __call__(self, *args):
        # Not jax's eval_jaxpr, which re-enters each equation's trace-time context: its mesh is the
        # caller's (inside a shard_map manual over some axes), not that of the per-shard code
        # the kernels run in (manual over the rest too).
        return _eval_without_varying_casts(self._jaxpr, [], args)

    @property
    def jaxpr(self):
        """The program: the traced arguments, then the constants, as invars; no constvars."""
        return self._jaxpr

    def reads(self, index: int) -> bool:
        """Whether the program uses its argument ``index`` at all."""
        arg = self._jaxpr.invars[index]
        return any(v is arg for eqn in self._jaxpr.eqns for v in eqn.invars) or any(v is arg for v in self._jaxpr.outvars)

    def __eq__(self, other):
        return isinstance(other, StaticFunction) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"StaticFunction({self.num_consts} consts, {self.out_avals})"


def literal_value(var):
    """A jaxpr operand's constant value (a ``Literal``), or None for a variable."""
    return jnp.asarray(var.val, var.aval.dtype) if isinstance(var, Literal) else None


def trace_function(fn: Callable, *avals, name: str = "function") -> tuple[StaticFunction, list]:
    """Traces ``fn`` at ``avals`` (``jax.ShapeDtypeStruct``s) and hoists what it closes over.

    Returns ``(static_fn, consts)`` with ``static_fn(*args, *consts) == fn(*args)``. Closed-over
    tracers of enclosing transforms (a bias under ``grad``) become consts too. ``name`` (such as
    "attention: `score_mod`") heads the error for what jax's sharding types refuse.
    """
    try:
        closed = jax.make_jaxpr(fn)(*avals)
    except jax.errors.TracerArrayConversionError as e:
        raise TypeError(
            f"{name} turns its traced arguments into numpy values (it indexes a numpy array or calls "
            f"numpy on them); index a jax array instead, jnp.asarray(table)"
        ) from e
    except jax.errors.TracerBoolConversionError as e:
        raise TypeError(
            f"{name} branches in Python on its traced arguments (`if`, `and`, `or`, `not`, min/max); "
            f"use jnp.where and the operators &, |, ~ instead"
        ) from e
    except Exception as e:  # jax exports no class for its sharding type errors
        if type(e).__name__ != "ShardingTypeError":
            raise
        raise TypeError(
            f"{name} reads an array split over explicit mesh axes at scalar indices, which jax's sharding types "
            f"refuse ({e}); give it what it closes over replicated: jax.sharding.reshard(x, P())"
        ) from e
    consts = list(closed.consts)
    # Re-traced with the constants as plain arguments: inside shard_map a closed-over value (a
    # shard's segment ids) varies over mesh axes, and tracing inserted casts of the indices to
    # varying; kept, they would re-type values inside the lowering's loops, which are per-device
    # code where that typing has no meaning.
    const_avals = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts]
    hoisted = jax.make_jaxpr(lambda *a: _eval_without_varying_casts(closed.jaxpr, a[len(avals) :], a[: len(avals)]))(
        *avals, *const_avals
    )
    return StaticFunction(hoisted, len(consts)), consts


def _is_varying_cast(eqn) -> bool:
    name = eqn.primitive.name
    return name == "pvary" or (name == "pcast" and "varying" in str(eqn.params.get("to", "")).lower())


def varying_over(x, axes):
    """``x`` cast to vary over the shard_map ``axes`` it does not vary over yet (itself if none)."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def of_one_type(values) -> list:
    """``values`` cast to the union of their varying axes, as jnp would cast an equation's operands
    inside a shard_map (a primitive bound directly there takes them of one type only)."""
    axes = frozenset().union(*(varying_axes(x) for x in values))
    return [varying_over(x, axes) for x in values]


def _eval_without_varying_casts(jaxpr, consts, args) -> list:
    """Evaluates ``jaxpr`` with its casts to varying (identities on values) dropped, inlining jit
    calls; inside a shard_map each equation's operands are cast to one type instead (the casts
    the jaxpr held were those of its own trace)."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda var: var.val if isinstance(var, Literal) else env[var]  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(var) for var in eqn.invars]
        if _is_varying_cast(eqn):
            outs = ins
        elif eqn.primitive.name in ("pjit", "jit", "closed_call"):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            outs = _eval_without_varying_casts(inner.jaxpr, inner.consts, ins)
        else:
            ins = of_one_type(ins)
            bound = eqn.primitive.get_bind_params(eqn.params)  # params, or (subfuns, params) before jax 0.10
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            outs = eqn.primitive.bind(*subfuns, *ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(var) for var in jaxpr.outvars]


# Bounded: params hold score_mod jaxprs and their captured constants, which a notebook re-creating
# its score_mod each call would otherwise keep alive for good.
@functools.lru_cache(maxsize=256)
def _jitted_bind(prim: Primitive, params: tuple) -> Callable:
    def bind(*args):
        return prim.bind(*args, **dict(params))

    bind.__name__ = bind.__qualname__ = prim.name  # what errors and profiles call the compiled call
    return jax.jit(bind)


def _dce_rule(fewer_outputs, used_outputs, eqn):
    """Drops an unused primitive; binds one that has outputs unused for one computing fewer."""
    if not any(used_outputs):
        return [False] * len(eqn.invars), None
    params, kept = fewer_outputs(used_outputs, **eqn.params)
    outvars = [var for var, keep in zip(eqn.outvars, kept) if keep]
    return [True] * len(eqn.invars), eqn.replace(params=params, outvars=outvars)


def _partial_eval_rule(known_outputs, prim, trace, *tracers, **params):
    """Partial evaluation (known operands now, unknown ones staged): the primitive is staged for its
    outputs, less those ``known_outputs`` computes from the known operands alone."""
    known = [t.pval.is_known() for t in tracers]
    staged = trace.default_process_primitive(prim, tracers, params)
    if all(known):  # computed, nothing staged
        return staged
    operands = [t.pval.get_known() if is_known else None for t, is_known in zip(tracers, known)]
    outs = known_outputs(operands, [t.aval for t in tracers], **params)
    return [trace.new_const(out) if out is not None else s for s, out in zip(staged, outs)]


def _impl_through_jit(prim: Primitive, *args, **params):
    """Eager calls compile the primitive once per (params, shapes), like any jitted function.

    As JAX applies its own primitives: compiled under ``jax.disable_jit`` too (where the jit would
    call this impl again, without end), and under ``jax_debug_nans``/``jax_debug_infs`` the
    primitive is the operation named (JAX would re-run the jit operation by operation to find the
    culprit, which is this same call, again without end).
    """
    jitted = _jitted_bind(prim, tuple(sorted(params.items())))
    nans, infs = jax.config.jax_debug_nans, jax.config.jax_debug_infs
    with jax.disable_jit(False):
        if not (nans or infs):
            return jitted(*args)
        with jax.debug_nans(False), jax.debug_infs(False):
            outs = jitted(*args)
    for value, checked, found in (("nan", nans, jnp.isnan), ("inf", infs, jnp.isinf)):
        if checked and any(jnp.issubdtype(o.dtype, jnp.inexact) and bool(found(o).any()) for o in outs):
            raise FloatingPointError(f"invalid value ({value}) encountered in {prim.name}")
    return outs


def _leading_batch_rule(prim: Primitive, args: Sequence, dims: Sequence, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims)
    ]
    outs = prim.bind(*moved, **params)
    return outs, [0] * len(outs)


# ---------------------------------------------------------------------------------------------
# Batched kernel calls


def kernel_call(target: str, result_types: Sequence, *operands, **attributes) -> list:
    """``jax.ffi.ffi_call(target, result_types)(*operands, **attributes)`` for a batched kernel:
    its operands and results lead with the same batch dims (the first operand's all but its last
    two), and the call says so as jax's own cuSOLVER calls do (XLA's ``num_batch_dims``, Shardy's
    sharding rule). Where ``target`` is registered batch-partitionable
    (``jax.ffi.register_ffi_target_as_batch_partitionable``, as ``build.load`` registers every
    kernel), XLA's partitioner then runs it per shard of those dims under automatic sharding, where
    it would otherwise gather the operands and run the whole batch on every device."""
    batch = tuple(operands[0].shape[:-2])
    if any(tuple(x.shape[: len(batch)]) != batch for x in (*operands, *result_types)):
        shapes = [tuple(x.shape) for x in (*operands, *result_types)]
        raise ValueError(f"kernel_call {target}: operands and results must lead with the batch dims {batch}, got {shapes}")
    results = tuple(core.ShapedArray(tuple(r.shape), r.dtype) for r in result_types)
    return _kernel_call_p.bind(*operands, target=target, results=results, attributes=tuple(sorted(attributes.items())))


def _kernel_call_lowering(ctx, *args, target: str, results, attributes):
    del results  # ctx.avals_out
    batch = len(ctx.avals_in[0].shape) - 2
    shapes_in, shapes_out = ([tuple(a.shape) for a in avals] for avals in (ctx.avals_in, ctx.avals_out))
    extra = {}
    if all(isinstance(n, int) for shape in shapes_in + shapes_out for n in shape):  # symbolic: left whole, as jax's
        extra["mhlo.frontend_attributes"] = mlir.ir.DictAttr.get({"num_batch_dims": mlir.ir.StringAttr.get(str(batch))})
        if getattr(jax.config, "jax_use_shardy_partitioner", True):  # GSPMD reads num_batch_dims alone
            extra["sdy.sharding_rule"] = mlir.ir.Attribute.parse(_batch_sharding_rule(batch, shapes_in, shapes_out))
    return jax.ffi.ffi_lowering(target, extra_attributes=extra)(ctx, *args, **dict(attributes))


def _batch_sharding_rule(batch: int, shapes_in: Sequence[tuple], shapes_out: Sequence[tuple]) -> str:
    """Shardy's rule for a call whose tensors share their first ``batch`` dims: a factor for each of
    those, common to all, and one of its own for every other dim (which the partitioner keeps
    whole). Factors are named as Shardy prints them: ``i`` to ``z``, then ``z_1``, ``z_2``, ..."""
    sizes: list[int] = list(shapes_in[0][:batch])

    def factors(shape) -> str:
        own = range(len(sizes), len(sizes) + len(shape) - batch)
        sizes.extend(shape[batch:])
        return "[" + ", ".join(_factor_name(k) for k in (*range(batch), *own)) + "]"

    lhs, rhs = (", ".join(factors(s) for s in shapes) for shapes in (shapes_in, shapes_out))
    table = ", ".join(f"{_factor_name(k)}={n}" for k, n in enumerate(sizes))
    return f"#sdy.op_sharding_rule<({lhs})->({rhs}) {{{table}}}, custom>"


def _factor_name(k: int) -> str:
    return chr(ord("i") + k) if k < 18 else f"z_{k - 17}"


_kernel_call_p = Primitive("jaxforge_kernel_call")
_kernel_call_p.multiple_results = True
_kernel_call_p.def_abstract_eval(lambda *avals, results, **_: results)
_kernel_call_p.def_impl(functools.partial(_impl_through_jit, _kernel_call_p))
mlir.register_lowering(_kernel_call_p, _kernel_call_lowering)
