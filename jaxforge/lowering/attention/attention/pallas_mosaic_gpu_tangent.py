"""The attention tangent (forward-mode AD) as a Pallas Mosaic GPU kernel for Hopper (sm90).

kernel.py's ``tangent_rows`` on the tensor cores of pallas_mosaic_gpu.py's forward. With
``S = mod(Q Kᵀ·scale)``, ``dS = mod'(·)·(dQ Kᵀ + Q dKᵀ)·scale`` (the JVP of the elementwise
mods), ``P = exp(S - lse)`` from the forward's lse, and ``r = rowsum(P dS)``:
``dlse = r`` and ``dO = P dV + (P dS) V - r O``.

A program owns 2 x 64 query rows (one consumer warpgroup each: ``Q``, ``dQ`` and ``O`` in shared
memory, ``lse`` in registers) and a producer warpgroup streams ``K``, ``V``, ``dK``, ``dV`` tiles
through a TMA ring. Per tile a consumer runs ``Q Kᵀ`` and ``dQ Kᵀ + Q dKᵀ`` (two products into one
accumulator), the softmax in registers, then ``P dV + (P dS) V`` into its output accumulator, both
probabilities as register operands. Tiles come from the mask's span as in the forward; padded keys
are masked. It takes what the forward takes (elementwise mask and score_mod, bf16/f16) with
``d + dv <= 256`` after padding to multiples of 64 and d <= 128: two d-wide tiles of its own
and a ring of four tiles a stage fill sm90's shared memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxforge.lowering.attention.attention import config, pallas_triton
from jaxforge.lowering.attention.attention import pallas_mosaic_gpu as mosaic
from jaxforge.lowering.attention.attention.kernel import Geometry, tile_loop
from jaxforge.primitives.attention.attention import Implementation
from jaxforge.primitives.attention.mods import Mods

__all__ = ["attention_tangent_mosaic", "mosaic_tangent_can_run"]

_WGMMA = plgpu.Layout.WGMMA


def mosaic_tangent_can_run(mods: Mods, q, v, mask_consts=()) -> str | None:
    """Why the Mosaic GPU tangent cannot run this call, or None if it can."""
    if why := mosaic.mosaic_can_run(mods, q, v, mask_consts):
        return why
    d, dv = (mosaic.swizzled_width(x.shape[-1]) for x in (q, v))
    values = (mods.mask_rows, mods.mask_cols)
    size = config.mosaic_tangent_smem(config.MOSAIC_BWD_BLOCK, config.MOSAIC_BWD_STAGES, d, dv, q.dtype.itemsize, values)
    if d + dv > config.MOSAIC_BWD_MAX_HEAD_DIMS or size > config.MOSAIC_SMEM_BYTES:
        return f"its accumulators and shared memory take head dims {d} + {dv} (padded) up to {config.MOSAIC_BWD_MAX_HEAD_DIMS} with d <= 128"
    return None


def attention_tangent_mosaic(
    q, k, v, out, lse, *operands, mods: Mods, scale: float, implementation: Implementation, interpret: bool, batch_ids, head_offset
):
    """The tangent's ``(dout, dlse)`` where ``mosaic_tangent_can_run`` allows it (the dispatch checks)."""
    if interpret and mosaic.mosaic_interpret_params() is None:
        raise ValueError(f"Mosaic GPU's interpret mode is not exported by jax {jax.__version__} (jax >= 0.11 has it)")
    dq, dk, dv_in = operands[-3:]
    d, dv = mosaic.swizzled_width(q.shape[-1]), mosaic.swizzled_width(v.shape[-1])
    block, stages = config.mosaic_tangent_tiles(d, dv, q.dtype.itemsize, implementation, values=(mods.mask_rows, mods.mask_cols))
    block_q = config.MOSAIC_BLOCK_Q
    rows = mosaic.CONSUMERS * block_q
    sq, hq, skv, hkv = *q.shape[-3:-1], *k.shape[-3:-1]
    geo = Geometry(sq, skv, rows, block, hq // hkv, scale, jnp.dtype(jnp.float32), None)
    sq_pad, skv_pad = geo.num_q_tiles * rows, geo.num_kv_tiles * block
    seq = pallas_triton._seq_major
    qp, dqp, outp = seq(q, sq_pad, d), seq(dq, sq_pad, d), seq(out, sq_pad, dv)
    kp, dkp, vp, dvp = seq(k, skv_pad, d), seq(dk, skv_pad, d), seq(v, skv_pad, dv), seq(dv_in, skv_pad, dv)
    lse2 = mosaic.log2_rows(lse, sq_pad)
    arrays = mosaic.mask_arrays(mods, operands[: mods.num_mask_consts], batch_ids, sq_pad, skv_pad)
    bounds = mosaic.kv_bounds(geo, mods)
    table = mosaic.program_table(mods, bounds, geo.num_q_tiles, arrays, batch_ids, head_offset)
    bsz, dtype = qp.shape[0], q.dtype
    operands = (qp, dqp, outp, lse2, kp, vp, dkp, dvp, table, arrays.rows, arrays.cols)

    def body(q_ref, dq_ref, out_ref, lse_ref, k_ref, v_ref, dk_ref, dv_ref, table_ref, rows_ref, cols_ref, dout_ref, dlse_ref, smem, ready, free):
        q_smem, dq_smem, o_smem, lse_smem, program_smem, q_values_smem, *ring_smem = smem
        ring_smem = [x for x in ring_smem if x is not None]  # K, V, dK, dV and the keys' positional values
        o_smem = q_smem if o_smem is None else o_smem  # equal head dims: O and then dO take Q's tile
        own_ready, out_ready, ring_ready = ready
        (ring_free,) = free
        h_local, i, item, wg = mosaic.program_ids("q_tiles")

        @pl.when(wg < mosaic.CONSUMERS)
        def _consume():
            plgpu.set_max_registers(mosaic.CONSUMER_REGISTERS, action="increase")
            q_lo = i * rows + wg * block_q
            own = (item, pl.ds(q_lo, block_q), h_local)
            lse_rows = lse_ref.at[item, h_local, pl.ds(q_lo, block_q)]
            q_values = None if rows_ref is None else (rows_ref.at[item, :, pl.ds(q_lo, block_q)], q_values_smem)
            copies = [(q_ref.at[own], q_smem), (dq_ref.at[own], dq_smem), (lse_rows, lse_smem)]
            b, h, (lo, hi, full_lo, full_hi), q_values = mosaic.start_consumer(
                mods, lambda: bounds(i), (table_ref.at[item, i], program_smem), copies, q_values, own_ready, wg, interpret
            )
            h = h + h_local
            lse_row = lax.broadcast_in_dim(mosaic.load_in_layout(lse_smem.at[wg], _WGMMA.reduce(1), interpret), (block_q, block), [0])

            def step(t, carry, masked: bool):
                r, acc = carry
                slot = lax.rem(t - lo, jnp.int32(stages))
                k_tile, v_tile, dk_tile, dv_tile, *values_tile = (x.at[slot] for x in ring_smem)
                for n in range(len(ring_smem)):
                    plgpu.barrier_wait(ring_ready.at[slot * len(ring_smem) + n])
                shape = (block_q, block)

                def scores(refs):  # Q Kᵀ, and dQ Kᵀ + Q dKᵀ in one accumulator
                    raw_ref, draw_ref = refs
                    plgpu.wgmma(raw_ref, q_smem.at[wg], k_tile.transpose((1, 0)))
                    plgpu.wgmma(draw_ref, dq_smem.at[wg], k_tile.transpose((1, 0)))
                    plgpu.wgmma(draw_ref, q_smem.at[wg], dk_tile.transpose((1, 0)))
                    return raw_ref[...], draw_ref[...]

                raw, draw = pl.run_scoped(scores, (plgpu.ACC(shape, jnp.float32),) * 2)
                q_idx = q_lo + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=_WGMMA)
                kv_idx = t * block + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_WGMMA)
                modify = lambda raw: mods.modify(raw, b, h, q_idx, kv_idx, [])  # noqa: E731
                s, ds = jax.jvp(modify, (raw * scale,), (draw * scale,))
                p = jnp.exp2(s * mosaic.LOG2E - lse_row)
                if masked:
                    kv_values = [x for tile in values_tile for x in mosaic.streamed_values(tile, interpret)]
                    seen = mosaic.visible(mods, geo, b, h, q_idx, kv_idx, q_values, kv_values)
                    p, ds = jnp.where(seen, p, 0.0), jnp.where(seen, ds, 0.0)
                p_ds = p * ds
                acc = mosaic.accumulate(acc, p.astype(dtype), dv_tile, interpret)
                acc = mosaic.accumulate(acc, p_ds.astype(dtype), v_tile, interpret)
                plgpu.barrier_arrive(ring_free.at[slot])
                return r + p_ds.sum(axis=1), acc

            carry = (
                plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), _WGMMA.reduce(1)),
                plgpu.layout_cast(jnp.zeros((block_q, dv), jnp.float32), _WGMMA),
            )
            r, acc = tile_loop((lo, hi), (full_lo, full_hi), step, carry)
            plgpu.copy_gmem_to_smem(out_ref.at[own], o_smem.at[wg], out_ready.at[wg])
            plgpu.barrier_wait(out_ready.at[wg])
            out_tile = mosaic.load_in_layout(o_smem.at[wg], _WGMMA, interpret).astype(jnp.float32)
            o_smem.at[wg][...] = (acc - lax.broadcast_in_dim(r, acc.shape, [0]) * out_tile).astype(dtype)
            lse_smem.at[wg][...] = r
            mosaic.write_back((o_smem.at[wg], dout_ref.at[own]), (lse_smem.at[wg], dlse_ref.at[item, h_local, pl.ds(q_lo, block_q)]))

        @pl.when(wg == mosaic.CONSUMERS)
        def _produce():
            plgpu.set_max_registers(mosaic.PRODUCER_REGISTERS, action="decrease")
            h_kv = h_local // geo.group
            lo, hi, _, _ = mosaic.producer_bounds(mods, lambda: bounds(i), table_ref.at[item, i], program_smem, own_ready.at[mosaic.CONSUMERS * n_own])
            tiles = mosaic.key_tiles((k_ref, v_ref, dk_ref, dv_ref), cols_ref, item, h_kv, lo, block)
            mosaic.stream(tiles, ring_smem, ring_ready, ring_free, hi - lo, stages)

    n_own = 4 + (arrays.rows is not None)  # per consumer: table row, Q, dQ, lse, the queries' positional values
    n_ring = 4 + (arrays.cols is not None)  # per slot: K, V, dK, dV, the keys' positional values

    smem = (
        mosaic.swizzled_smem((mosaic.CONSUMERS, block_q, d), dtype),
        mosaic.swizzled_smem((mosaic.CONSUMERS, block_q, d), dtype),
        None if dv == d else mosaic.swizzled_smem((mosaic.CONSUMERS, block_q, dv), dtype),
        plgpu.SMEM((mosaic.CONSUMERS, block_q), jnp.float32),
        mosaic.table_smem(),
        mosaic.values_smem(arrays.rows, mosaic.CONSUMERS, block_q),
        *(mosaic.swizzled_smem((stages, block, width), dtype) for width in (d, dv, d, dv)),
        mosaic.values_smem(arrays.cols, stages, block),
    )
    ready = (
        plgpu.Barrier(num_barriers=mosaic.CONSUMERS * n_own + 1),  # and the producer's table row
        plgpu.Barrier(num_barriers=mosaic.CONSUMERS),  # O, after the loop
        plgpu.Barrier(num_barriers=stages * n_ring),
    )
    free = (plgpu.Barrier(num_arrivals=mosaic.CONSUMERS, num_barriers=stages),)
    outputs = (((bsz, sq_pad, hq, dv), out.dtype), ((bsz, hq, sq_pad), jnp.float32))
    dout, dlse = mosaic.warpgroup_call(body, operands, outputs, (smem, ready, free), (hq, geo.num_q_tiles, bsz), "q_tiles", interpret)
    batch = q.shape[:-3]
    return pallas_triton._back(dout, batch, sq, v.shape[-1]), pallas_triton._rows_back(dlse, batch, sq).astype(lse.dtype)
