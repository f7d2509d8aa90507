"""The attention forward as a Pallas Mosaic GPU kernel for Hopper (sm90): TMA, wgmma, warpgroups.

FlashAttention-3's plan (Shah et al. 2024, research/attention.md). A program owns 2 x 64 query rows
of one batch item and head and runs three warpgroups: two consumers, each with its own 64 rows in
registers, and one producer that streams the key/value tiles into a ring of shared-memory slots
with TMA. Per key tile a consumer waits for the slot, runs ``S = Q Kᵀ`` on the tensor cores
(wgmma), releases the key slot, applies the scale, softcap, score_mod and mask to ``S`` in
registers, updates the online softmax (base 2, so each ``exp`` is one ``ex2`` after an FMA), then
``O += P V`` (wgmma with ``P`` from registers) and releases the value slot. The consumers take
turns (FA3's ping-pong): a shared barrier lets one issue its products while the other computes its
softmax, so the tensor cores and the exponent units stay busy together.

Both consumers visit the same key tiles, the span (``Geometry.kv_tiles``) of their 128 rows, so
the producer's ring is consumed in lockstep; the tiles wholly visible to all 128 rows skip the
mask arithmetic. Sequences are zero-padded to whole tiles and padded keys are masked; head dims
are padded to multiples of 64 (the 128-byte swizzle of bf16 rows), so MLA's 192 stays 192.

The tangent's and the backward's kernels (pallas_mosaic_gpu_tangent.py, pallas_mosaic_gpu_bwd.py)
share this module's pieces and read the ``(out, lse)`` this kernel writes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxforge.lowering.attention.attention import config, pallas_triton, xla
from jaxforge.lowering.attention.attention.kernel import Geometry, tile_loop
from jaxforge.primitives.attention.attention import Implementation
from jaxforge.primitives.attention.mods import Mods

__all__ = [
    "CONSUMERS",
    "CONSUMER_REGISTERS",
    "LOG2E",
    "PRODUCER_REGISTERS",
    "accumulate",
    "attention_fwd_mosaic",
    "global_offsets",
    "int32",
    "load_in_layout",
    "load_own",
    "log2_rows",
    "mosaic_can_run",
    "mosaic_interpret_params",
    "product",
    "query_program",
    "stream",
    "swizzled_smem",
    "swizzled_width",
    "visible",
    "warpgroup_kernel",
    "write_back",
]

CONSUMERS = 2  # warpgroups computing, each owning config.MOSAIC_BLOCK_Q query rows
LOG2E = math.log2(math.e)
_LN2 = math.log(2)
# Consumers need registers for their accumulators; the producer only issues copies.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40


def mosaic_can_run(mods: Mods, q, v) -> str | None:
    """Why the Mosaic GPU forward cannot run this call, or None if it can.

    The mask and score_mod must be elementwise arithmetic on the indices (no captured arrays, no
    per-item data such as document segments); bf16/f16 operands; head dims up to 256.
    """
    if not pallas_triton.triton_can_run(mods) or mods.num_mask_consts or mods.num_score_consts:
        return "its mask or score_mod reads arrays (the Mosaic GPU forward applies elementwise functions of the indices only)"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it takes bfloat16 or float16 operands, got {q.dtype}"
    if max(q.shape[-1], v.shape[-1]) > 256:
        return f"it takes head dims up to 256, got {q.shape[-1]} and {v.shape[-1]}"
    return None


def mosaic_interpret_params():
    """Mosaic GPU's CPU interpreter (public from jax 0.11), or None where this jax lacks it."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    return None if params is None else params()


def swizzled_width(n: int) -> int:
    """A head dim padded to whole 128-byte swizzled rows of bf16/f16: a multiple of 64."""
    return -(-n // 64) * 64


def swizzled_smem(shape, dtype):
    """Shared memory in wgmma's operand layout: 128-byte swizzled tiles of 8 rows."""
    dtype = jnp.dtype(dtype)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 128 // dtype.itemsize)), plgpu.SwizzleTransform(128)))


def product(a, b_ref, shape):
    """``a @ b`` on the tensor cores into a fresh float32 accumulator of ``shape``; ``a`` a shared
    memory ref or a register array."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b_ref)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def accumulate(acc, a, b_ref, interpret: bool):
    """``acc + a @ b`` (``acc`` float32 in the wgmma layout, ``a`` registers, ``b`` shared memory)."""
    if interpret:  # Mosaic GPU's interpreter lacks run_state: a fresh product, then the sum
        return acc + product(a, b_ref, acc.shape)
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b_ref))(plgpu.ACC.init(acc))  # in place, in registers


def log2_rows(lse, padded: int):
    """The forward's lse as ``(B, H, padded)`` rows in log2 units, 0 where infinite (rows that see
    no key: their tiles are masked, so the 0 only keeps the exponents finite)."""
    return xla.seq_last(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(jnp.float32) * LOG2E, padded)


def global_offsets(batch_ids, head_offset):
    """Per local batch item its global index and that of the first local head, padded to 32 int32:
    a program copies its item's row (128 bytes, the smallest copy a warpgroup takes) to shared memory."""
    return jnp.zeros((batch_ids.shape[0], 32), jnp.int32).at[:, 0].set(batch_ids).at[:, 1].set(head_offset)


def load_in_layout(ref, layout, interpret: bool):
    """A shared-memory tile or row in registers in ``layout`` (the interpreter ignores layouts and
    lacks ``plgpu.load``)."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=layout)


def int32(*xs):
    """Loop bounds and indices in int32, whatever jax_enable_x64 says (Mosaic GPU indexes in int32)."""
    return tuple(jnp.asarray(x, jnp.int32) for x in xs)


def load_own(copies, ready, wg):
    """Consumer ``wg``'s own tiles: a TMA copy per ``(source, destination[wg])``, each on its own
    barrier of ``ready`` (``len(copies)`` per consumer), then the waits for all."""
    n = len(copies)
    for c, (source, destination) in enumerate(copies):
        plgpu.copy_gmem_to_smem(source, destination.at[wg], ready.at[wg * n + c])
    for c in range(n):
        plgpu.barrier_wait(ready.at[wg * n + c])


def stream(tiles, slots, ready, free, total, stages: int):
    """The producer's ring: for c in ``[0, total)`` the source tiles ``tiles(c)`` copied into
    ``slots[n].at[c % stages]``, each arriving on ``ready[slot * len(slots) + n]``; a slot is reused
    once both consumers arrived on ``free[slot]``, and the last waits are drained (Pallas wants a
    barrier's waiter to see every phase)."""
    stages_ = jnp.int32(stages)

    def load(c, slot):
        for n, (source, slot_ref) in enumerate(zip(tiles(c), slots, strict=True)):
            plgpu.copy_gmem_to_smem(source, slot_ref.at[slot], ready.at[slot * len(slots) + n])

    for first in range(stages):
        pl.when(first < total)(lambda first=first: load(jnp.int32(first), first))

    @pl.loop(stages_, total)
    def _(c):
        slot = lax.rem(c, stages_)
        plgpu.barrier_wait(free.at[slot])
        load(c, slot)

    pl.loop(jnp.maximum(total - stages, 0), total)(lambda c: plgpu.barrier_wait(free.at[lax.rem(c, stages_)]))


def warpgroup_kernel(entry, out_type, grid, names, interpret: bool):
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=grid,
        grid_names=names,
        num_threads=CONSUMERS + 1,
        thread_name="warpgroup",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_interpret_params() if interpret else None,
    )


def write_back(*copies):
    """``(shared, global)`` tiles a consumer has written: made visible to TMA, copied out, waited for."""
    plgpu.commit_smem()
    for source, destination in copies:
        plgpu.copy_smem_to_gmem(source, destination)
    plgpu.wait_smem_to_gmem(0)


def visible(mods: Mods, geo: Geometry, b, h, q_idx, kv_idx):
    """Which scores of a tile count: inside both sequences (not padding) and allowed by the mask."""
    inside = (kv_idx < geo.skv) & (q_idx < geo.sq)
    user = mods.allowed(b, h, q_idx, kv_idx, [], [], [])
    return inside if user is None else inside & user


def query_program(geo: Geometry, mods: Mods):
    """``(head, tile, item, warpgroup, (lo, hi, full_lo, full_hi))`` of a program over query tiles
    (grid names heads, q_tiles, batch): the key tiles ``[lo, hi)`` it visits, among them the wholly
    visible ``[full_lo, full_hi)``."""
    h_local, i, item, wg = (lax.axis_index(name) for name in ("heads", "q_tiles", "batch", "warpgroup"))
    return h_local, i, item, wg, int32(*geo.kv_tiles(mods, i, ()), *geo.full_kv_tiles(mods, i, ()))


def attention_fwd_mosaic(
    q, k, v, *consts, mods: Mods, scale: float, implementation: Implementation, interpret: bool, batch_ids, head_offset
):
    if interpret and mosaic_interpret_params() is None:
        raise ValueError(f"Mosaic GPU's interpret mode is not exported by jax {jax.__version__} (jax >= 0.11 has it)")
    block_q = config.MOSAIC_BLOCK_Q
    rows = CONSUMERS * block_q
    d, dv = swizzled_width(q.shape[-1]), swizzled_width(v.shape[-1])
    block_kv, stages = config.mosaic_tiles(d, dv, q.dtype.itemsize, implementation)
    sq, hq, skv, hkv = *q.shape[-3:-1], *k.shape[-3:-1]
    geo = Geometry(sq, skv, rows, block_kv, hq // hkv, scale, jnp.dtype(jnp.float32), None)
    batch, bsz = q.shape[:-3], math.prod(q.shape[:-3])
    sq_pad, skv_pad = geo.num_q_tiles * rows, geo.num_kv_tiles * block_kv
    qp, kp, vp = (pallas_triton._seq_major(x, s, w) for x, s, w in ((q, sq_pad, d), (k, skv_pad, d), (v, skv_pad, dv)))
    offsets = global_offsets(batch_ids, head_offset)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = wgmma_layout.reduce(1)

    def body(q_ref, k_ref, v_ref, offset_ref, out_ref, lse_ref, smem, ready, free, turn):
        q_smem, o_smem, k_smem, v_smem, lse_smem, offset_smem = smem
        o_smem = q_smem if o_smem is None else o_smem  # equal head dims: the output reuses q's tile
        q_ready, k_ready, v_ready, offset_ready = ready
        k_free, v_free = free
        h_local, i, item, wg, (lo, hi, full_lo, full_hi) = query_program(geo, mods)

        @pl.when(wg < CONSUMERS)
        def _consume():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            q_lo = i * rows + wg * block_q
            plgpu.copy_gmem_to_smem(offset_ref.at[item], offset_smem.at[wg], offset_ready.at[wg])
            plgpu.copy_gmem_to_smem(q_ref.at[item, pl.ds(q_lo, block_q), h_local], q_smem.at[wg], q_ready.at[wg])
            plgpu.barrier_wait(offset_ready.at[wg])
            b, h = offset_smem[wg, 0], offset_smem[wg, 1] + h_local
            plgpu.barrier_wait(q_ready.at[wg])

            def meet():  # both consumers arrive, then go on together
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

            def step(t, carry, masked: bool):
                m, l, acc = carry
                slot = lax.rem(t - lo, jnp.int32(stages))
                plgpu.barrier_wait(k_ready.at[slot])

                def scores(acc_ref):  # the product, then the meeting, then the wait for it
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    meet()
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                q_idx = q_lo + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=wgmma_layout)
                kv_idx = t * block_kv + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=wgmma_layout)
                s = mods.modify(s * scale, b, h, q_idx, kv_idx, [])
                if masked:
                    s = jnp.where(visible(mods, geo, b, h, q_idx, kv_idx), s, -jnp.inf)
                s = s * LOG2E  # base 2 from here: m and the exponents are in log2 units
                m_new = jnp.maximum(m, s.max(axis=1))
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all masked so far: exp2 stays finite
                alpha = jnp.exp2(m - shift)
                p = jnp.exp2(s - lax.broadcast_in_dim(shift, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                plgpu.barrier_arrive(turn)  # this softmax is done: the other consumer's products may go
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)

                acc = accumulate(acc, p.astype(v_smem.dtype), v_smem.at[slot], interpret)
                plgpu.barrier_arrive(v_free.at[slot])
                return m_new, l, acc

            carry = (
                plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.full((block_q, dv), 0.0, jnp.float32), wgmma_layout),
            )
            pl.when(wg == 1)(meet)  # consumer 1 runs half a step behind consumer 0 ...
            m, l, acc = tile_loop((lo, hi), (full_lo, full_hi), step, carry)
            pl.when(wg == 0)(meet)  # ... and consumer 0 makes up the meeting at the end
            seen = l > 0
            l_safe = jnp.where(seen, l, 1.0)
            o_smem.at[wg][...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_smem.dtype)
            m_safe = jnp.where(m == -jnp.inf, 0.0, m)
            lse_smem.at[wg][...] = jnp.where(seen, (m_safe + jnp.log2(l_safe)) * _LN2, -jnp.inf)
            own_rows = pl.ds(q_lo, block_q)
            write_back((o_smem.at[wg], out_ref.at[item, own_rows, h_local]), (lse_smem.at[wg], lse_ref.at[item, h_local, own_rows]))

        @pl.when(wg == CONSUMERS)
        def _produce():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            h_kv = h_local // geo.group

            def load(t, wait: bool):
                slot = lax.rem(t - lo, jnp.int32(stages))
                tile = (item, pl.ds(t * block_kv, block_kv), h_kv)
                if wait:  # both consumers are done with the slot's previous tile
                    plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[tile], k_smem.at[slot], k_ready.at[slot])
                if wait:
                    plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[tile], v_smem.at[slot], v_ready.at[slot])

            def drain(t):  # Pallas wants a barrier's waiter to see every phase: the last releases too
                slot = lax.rem(t - lo, jnp.int32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            for first in range(stages):
                pl.when(lo + first < hi)(lambda first=first: load(lo + first, wait=False))
            pl.loop(lo + stages, hi)(lambda t: load(t, wait=True))
            pl.loop(jnp.maximum(lo, hi - stages), hi)(drain)

    def entry(q_ref, k_ref, v_ref, offset_ref, out_ref, lse_ref):
        swizzled = lambda shape: swizzled_smem(shape, q.dtype)  # noqa: E731
        smem = (
            swizzled((CONSUMERS, block_q, d)),
            None if dv == d else swizzled((CONSUMERS, block_q, dv)),
            swizzled((stages, block_kv, d)),
            swizzled((stages, block_kv, dv)),
            plgpu.SMEM((CONSUMERS, block_q), jnp.float32),
            plgpu.SMEM((CONSUMERS, offsets.shape[1]), jnp.int32),
        )
        ready = (
            plgpu.Barrier(num_barriers=CONSUMERS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=CONSUMERS),
        )
        free = (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2
        pl.run_scoped(
            lambda *scratch: body(q_ref, k_ref, v_ref, offset_ref, out_ref, lse_ref, *scratch),
            smem,
            ready,
            free,
            plgpu.Barrier(num_arrivals=CONSUMERS),
            collective_axes="warpgroup",
        )

    # As in pallas_triton._call: inside shard_map the outputs take the operands' varying axes.
    mat = jax.typeof(k).manual_axis_type
    out_type = (
        jax.ShapeDtypeStruct((bsz, sq_pad, hq, dv), q.dtype, manual_axis_type=mat),
        jax.ShapeDtypeStruct((bsz, hq, sq_pad), jnp.float32, manual_axis_type=mat),
    )
    out, lse = warpgroup_kernel(entry, out_type, (hq, geo.num_q_tiles, bsz), ("heads", "q_tiles", "batch"), interpret)(qp, kp, vp, offsets)
    return pallas_triton._back(out, batch, geo.sq, v.shape[-1]), pallas_triton._rows_back(lse, batch, geo.sq)

