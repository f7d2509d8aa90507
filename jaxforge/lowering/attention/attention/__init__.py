"""Every lowering of the three attention primitives is registered here, and nowhere else.

The ``implementation`` parameter picks the algorithm: "xla" (kernel.py's tiles in XLA, every
platform), "pallas_triton" (the same tiles as Pallas kernels: Triton on GPU, interpret mode on
CPU) or "pallas_mosaic_gpu" (Hopper kernels).
``None`` means "pallas_triton" on GPU (where its tiles fit the GPU's shared memory and the shapes
are static, and for masks or score_mods reading captured arrays once
config.TRITON_POINT_READS_VALIDATED, and for a forward returning max scores once
config.TRITON_MAX_SCORES_VALIDATED; else "xla") and "xla" elsewhere; on an sm90 GPU each
Mosaic GPU kernel (validated there: config.MOSAIC_VALIDATED, MOSAIC_TANGENT_VALIDATED,
MOSAIC_BWD_VALIDATED; a forward returning max scores MOSAIC_MAX_SCORES_VALIDATED) runs where it can, but for decoding (config.decoding: fewer queries a
head than Triton's smallest tile) and calls that pack GQA heads, which Triton's kernels do. The
Triton default packs GQA heads and splits the forward's keys (decoding) once
config.TRITON_DECODING_VALIDATED; a call naming "pallas_triton" does where config says. Until
then a decoding-sized backward the default would run unpacked takes XLA's tiles, short of
config.TRITON_UNPACKED_DECODING_BWD_VALIDATED.
"pallas_mosaic_gpu" runs the Mosaic GPU forward (an error where it cannot), tangent and backward
(Triton's where they cannot, and in interpret mode: a primitive's lowering cannot host Mosaic
GPU's interpreter). Where ``XLA_FLAGS`` asks XLA for deterministic GPU programs
(config.deterministic), a backward that sums a captured array's cotangent runs XLA's tiles, named
or not: Triton's dq kernel adds them atomically, in whatever order its programs run.

Second order runs XLA's tiles, but for a gradient through a jvp (attention_tangent_bwd), which
runs Triton kernels where a call names them and, on GPU, by default once
config.TRITON_TANGENT_BWD_VALIDATED.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxforge.lowering import build
from jaxforge.lowering.attention.attention import (
    config,
    pallas_mosaic_gpu,
    pallas_mosaic_gpu_bwd,
    pallas_mosaic_gpu_tangent,
    pallas_triton,
    xla,
)
from jaxforge.primitives import _core
from jaxforge.primitives.attention.attention import (
    attention_bwd_p,
    attention_bwd_tangent_p,
    attention_fwd_p,
    attention_tangent2_p,
    attention_tangent_bwd_p,
    attention_tangent_p,
    lse_dtype,
    shared_operands,
)
from jaxforge.primitives.attention.mods import float_consts


# primitive -> {implementation name: lowering in jax ops}; tests run every entry against the reference.
IMPLEMENTATIONS = {
    attention_fwd_p: {
        "xla": xla.attention_fwd_xla,
        "pallas_triton": pallas_triton.attention_fwd_pallas,
        "pallas_mosaic_gpu": pallas_mosaic_gpu.attention_fwd_mosaic,
    },
    attention_tangent_p: {
        "xla": xla.attention_tangent_xla,
        "pallas_triton": pallas_triton.attention_tangent_pallas,
        "pallas_mosaic_gpu": pallas_mosaic_gpu_tangent.attention_tangent_mosaic,
    },
    attention_bwd_p: {
        "xla": xla.attention_bwd_xla,
        "pallas_triton": pallas_triton.attention_bwd_pallas,
        "pallas_mosaic_gpu": pallas_mosaic_gpu_bwd.attention_bwd_mosaic,
    },
}


_TRITON_CALL = {attention_fwd_p: "fwd", attention_tangent_p: "tangent", attention_bwd_p: "bwd"}


def _dispatch(prim, platform: str | None):
    def lowering(*args, mods, implementation, shards, **params):
        name = implementation.name
        asks_mosaic = name == "pallas_mosaic_gpu" or (platform == "cuda" and name is None)
        mosaic_why_not = _mosaic_why_not(prim, mods, args, params) if asks_mosaic else "not asked for"
        if platform == "cuda" and name is None:
            q, k, v = args[:3]
            asked = implementation
            name = "pallas_triton" if _triton_by_default(_TRITON_CALL[prim], q, k, v, mods, implementation) else "xla"
            if name == "pallas_triton" and not build.enabled(config.TRITON_DECODING_VALIDATED):
                implementation = _without_decoding(implementation)
            # Mosaic neither packs GQA heads nor takes fewer than 128 rows a program: decoding stays
            # on Triton's 16-row tiles (packed once validated)
            packs = config.packs_gqa(q.shape[-3], q.shape[-2] // k.shape[-2], implementation)
            mosaic = mosaic_why_not is None and _mosaic_by_default(prim, params) and not packs and not config.decoding(q.shape[-3])
            if name == "pallas_triton" and mosaic:
                name = "pallas_mosaic_gpu"
            elif name == "pallas_triton" and prim is attention_bwd_p and _unpacked_decoding_bwd_unchecked(q, packs):
                name, implementation = "xla", asked
            elif prim is attention_fwd_p and params["max_scores"] and not build.enabled(config.TRITON_MAX_SCORES_VALIDATED):
                name, implementation = "xla", asked  # the Triton forward's maxima wait for a GPU's check
        elif name in ("pallas_triton", "pallas_mosaic_gpu") and not pallas_triton.triton_can_run(mods):
            raise ValueError(
                f"attention: implementation={name!r} cannot apply this mask/score_mod: the kernels apply "
                "elementwise functions that read captured arrays one element at a time (bias[h, q_idx - kv_idx]); "
                "this one gathers or reduces over an array, or applies a non-elementwise operation; use "
                "implementation=None or 'xla'"
            )
        if name in ("pallas_triton", "pallas_mosaic_gpu") and _symbolic(*args[:3]):
            raise ValueError(
                f"attention: implementation={name!r} needs static shapes (a Pallas GPU kernel's grid cannot be "
                f"symbolic); got q, k, v of shapes {', '.join(str(x.shape) for x in args[:3])}; use "
                "implementation=None or 'xla'"
            )
        if name == "pallas_mosaic_gpu" and prim is attention_fwd_p:
            if mosaic_why_not is not None:
                raise ValueError(f"attention: implementation='pallas_mosaic_gpu' cannot run this call: {mosaic_why_not}")
            if platform != "cuda":
                # Mosaic GPU's interpreter runs through ordered io_callbacks, which a primitive's
                # lowering cannot host; tests interpret the kernels (pallas_mosaic_gpu*.py) directly.
                raise ValueError("attention: implementation='pallas_mosaic_gpu' runs on a Hopper GPU only; use 'xla' or 'pallas_triton' here")
        elif name == "pallas_mosaic_gpu" and (mosaic_why_not is not None or platform != "cuda"):
            name = "pallas_triton"  # the tangent and backward fall back to Triton's kernels
        if platform == "cuda" and name == "pallas_triton" and prim is attention_bwd_p and any(params["const_grads"]) and config.deterministic():
            name = "xla"  # the dq kernel would sum the captured arrays' cotangents atomically, in any order
        name = name or "xla"
        if _is_empty(*args[:2]):
            return _empty_results(prim, args, mods, params)
        if name == "pallas_mosaic_gpu" and prim is attention_fwd_p:
            params = {key: value for key, value in params.items() if key != "first_keys"}  # False: _mosaic_why_not
        extra = {"interpret": platform != "cuda"} if name != "xla" else {}
        batch_ids, head_offset = _global_indices(args[0].shape, shards)
        return IMPLEMENTATIONS[prim][name](
            *args, mods=mods, implementation=implementation, batch_ids=batch_ids, head_offset=head_offset, **extra, **params
        )

    return lowering


def _triton_by_default(call: str, q, k, v, mods, implementation) -> bool:
    """Whether the GPU default may run ``call``'s Triton kernels: static shapes, masks and score mods
    they can apply (reading captured arrays once validated), tiles that fit the GPU."""
    return (
        not _symbolic(q, k, v)
        and pallas_triton.triton_can_run(mods)
        and (not pallas_triton.reads_captured_arrays(mods) or build.enabled(config.TRITON_POINT_READS_VALIDATED))
        and pallas_triton.triton_fits(call, q, k, v, implementation)
    )


def _unpacked_decoding_bwd_unchecked(q, packs: bool) -> bool:
    """Whether a backward would run the Triton kernels on decoding-sized tiles of one head each,
    whose dv a GPU has yet to clear (config.TRITON_UNPACKED_DECODING_BWD_VALIDATED)."""
    return not packs and config.decoding(q.shape[-3]) and not build.enabled(config.TRITON_UNPACKED_DECODING_BWD_VALIDATED)


def _symbolic(*arrays) -> bool:
    """Whether any of the arrays has a symbolic dim (``jax.export`` with shape polymorphism)."""
    return any(jax.export.is_symbolic_dim(d) for x in arrays for d in x.shape)


def _without_decoding(impl):
    """``impl`` with GQA packing and split-KV off unless it asks for them."""
    pack = False if impl.pack_gqa is None else impl.pack_gqa
    return dataclasses.replace(impl, pack_gqa=pack, kv_splits=impl.kv_splits or 1)


def _mosaic_why_not(prim, mods, args, params) -> str | None:
    """Why ``prim`` has no Mosaic GPU kernel for this call, or None where it has one."""
    q, v = args[0], args[2]
    first = 3 if prim is attention_fwd_p else 5
    mask_consts = args[first : first + mods.num_mask_consts]
    if prim is attention_fwd_p:
        if params["first_keys"]:
            return "it does not find the first key attaining each row's maximum, which a derivative of the maxima reads (first_keys)"
        return pallas_mosaic_gpu.mosaic_can_run(mods, q, v, mask_consts)
    if prim is attention_bwd_p:
        return pallas_mosaic_gpu_bwd.mosaic_bwd_can_run(mods, q, v, params["const_grads"], mask_consts)
    return pallas_mosaic_gpu_tangent.mosaic_tangent_can_run(mods, q, v, mask_consts)


def _mosaic_by_default(prim, params) -> bool:
    """A Mosaic GPU kernel is the default on Hopper once validated there (a forward writing the
    maxima: config.MOSAIC_MAX_SCORES_VALIDATED too). Not on request (JAXFORGE_UNVALIDATED_KERNELS):
    the gpu tests and the bench ask for it by name, and the default stays the kernels they measure
    it against."""
    validated = {
        attention_fwd_p: config.MOSAIC_VALIDATED,
        attention_tangent_p: config.MOSAIC_TANGENT_VALIDATED,
        attention_bwd_p: config.MOSAIC_BWD_VALIDATED,
    }[prim]
    if prim is attention_fwd_p and params["max_scores"]:
        validated = validated and config.MOSAIC_MAX_SCORES_VALIDATED
    return validated and build.gpu_arch() == "sm_90a"


def _global_indices(q_shape, shards):
    """For a shard's q block: the global flat batch index of each local item, and its first head."""
    batch = q_shape[:-3]
    local_ids = jnp.arange(math.prod(batch), dtype=jnp.int32)
    if shards is None:
        return local_ids, 0
    *batch_shards, _, (head_index, _), _ = shards
    local = jnp.unravel_index(local_ids, batch) if batch else ()
    flat = jnp.zeros_like(local_ids)
    for i, n, (index, count) in zip(local, batch, batch_shards):
        flat = flat * (n * count) + index * n + i
    return flat.astype(jnp.int32), head_index * q_shape[-2]


def _is_empty(q, k) -> bool:
    """Whether the call has no rows (no batch item, query head or query) or no keys: then its
    tiles, loops and grids would have no extent, and :func:`_empty_results` gives its results."""
    return 0 in (math.prod(q.shape[:-3]), q.shape[-2], q.shape[-3], k.shape[-3])


def _empty_results(prim, args, mods, params):
    """No rows: empty outputs (and zero gradients of the arrays a score mod captures). No keys:
    every row fully masked (out 0, lse -inf, no gradient)."""
    q, k, v = args[:3]
    if prim is attention_fwd_p:
        lse = jnp.full(q.shape[:-1], -jnp.inf, lse_dtype(q.dtype))
        top = [lse] * params["max_scores"] + [jnp.zeros(lse.shape, jnp.int32)] * params["first_keys"]
        return jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype), lse, *top
    if prim is attention_tangent_p:
        out, lse = args[3:5]
        return jnp.zeros_like(out), jnp.zeros_like(lse)
    n_consts = mods.num_mask_consts + mods.num_score_consts
    score_c = args[5 + mods.num_mask_consts : 5 + n_consts]
    floats = float_consts(score_c)
    wanted = [jnp.zeros_like(c) for c, w in zip(floats, params["const_grads"]) if w]
    return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), *wanted)


_SHARED = {
    attention_fwd_p: shared_operands(3, 0),
    attention_tangent_p: shared_operands(5, 3),
    attention_bwd_p: shared_operands(5, 2),
}
for _prim in IMPLEMENTATIONS:
    for _platform in (None, "cuda"):
        _core.register_lowering(
            _prim, _dispatch(_prim, _platform), platform=_platform, shards=True, shared_operands=_SHARED[_prim]
        )


def _second_order(impl, empty):
    """Second order in XLA's tiles on every platform: ``impl`` at global batch and head
    indices; no rows or no keys (:func:`_is_empty`), ``empty(args, mods, params)``: zeros (a fully
    masked map)."""

    def lowering(*args, mods, implementation, shards, **params):
        q, k = args[:2]
        if _is_empty(q, k):
            return empty(args, mods, params)
        batch_ids, head_offset = _global_indices(q.shape, shards)
        return impl(*args, mods=mods, implementation=implementation, batch_ids=batch_ids, head_offset=head_offset, **params)

    return lowering


def _zeros_like(*positions: int):
    """Zeros shaped like the operands at ``positions``."""
    return lambda args, mods, params: tuple(jnp.zeros_like(args[i]) for i in positions)


# A jvp of a jvp and a jvp of a grad (a Hessian-vector product): XLA's tiles.
for _prim, _impl, _empty, _shared in (
    (attention_tangent2_p, xla.attention_tangent2_xla, _zeros_like(3, 4), shared_operands(5, 8)),  # (dout, dlse)
    (attention_bwd_tangent_p, xla.attention_bwd_tangent_xla, functools.partial(_empty_results, attention_bwd_p), shared_operands(5, 9)),
):
    _core.register_lowering(_prim, _second_order(_impl, _empty), shards=True, shared_operands=_shared)


def _tangent_bwd(platform: str | None):
    """A grad through a jvp: the Triton kernels where a call names them ("pallas_mosaic_gpu" too,
    which has none) or, on GPU, by default once config.TRITON_TANGENT_BWD_VALIDATED; else XLA's
    tiles."""
    tiles = _second_order(xla.attention_tangent_bwd_xla, _zeros_like(0, 1, 2, 3, 4))

    def lowering(*args, mods, implementation, shards, **params):
        q, k, v = args[:3]
        triton = implementation.name in ("pallas_triton", "pallas_mosaic_gpu")
        if platform == "cuda" and implementation.name is None and build.enabled(config.TRITON_TANGENT_BWD_VALIDATED):
            triton = _triton_by_default("tangent_bwd", q, k, v, mods, implementation)
            implementation = implementation if build.enabled(config.TRITON_DECODING_VALIDATED) else _without_decoding(implementation)
        if not triton or _symbolic(q, k, v) or not pallas_triton.triton_can_run(mods) or _is_empty(q, k):
            return tiles(*args, mods=mods, implementation=implementation, shards=shards, **params)
        batch_ids, head_offset = _global_indices(q.shape, shards)
        return pallas_triton.attention_tangent_bwd_pallas(
            *args, mods=mods, implementation=implementation, interpret=platform != "cuda", batch_ids=batch_ids,
            head_offset=head_offset, **params,
        )  # fmt: skip

    return lowering


for _platform in (None, "cuda"):
    _core.register_lowering(attention_tangent_bwd_p, _tangent_bwd(_platform), platform=_platform, shards=True, shared_operands=shared_operands(5, 5))
