"""The attention backward as two Pallas Mosaic GPU kernels for Hopper (sm90): TMA, wgmma, warpgroups.

The Triton backward's split (pallas_triton.py), on the tensor cores of pallas_mosaic_gpu.py's
forward. With ``P = exp(S - lse)``, ``dP = dO Vᵀ`` and ``dS = P (dP - Δ)`` pulled back through
softcap and score_mod (``Δ = rowsum(dO · O) - g_lse``):

* ``dq`` programs own 2 x 64 query rows (one consumer warpgroup each, with ``Q`` and ``dO`` in
  shared memory, ``lse`` and ``Δ`` in registers) and stream key/value tiles from a producer
  warpgroup's TMA ring: ``S = Q Kᵀ`` and ``dP = dO Vᵀ`` on the tensor cores, ``dS`` in registers,
  ``dQ += dS K`` with ``dS`` as the register operand.
* ``dk, dv`` programs own 2 x 64 keys and stream, for each query head of their GQA group, the
  query tiles ``Q``, ``dO`` and their ``(lse, Δ)`` rows: ``Sᵀ = K Qᵀ``, ``dPᵀ = V dOᵀ``,
  ``dV += Pᵀ dO`` and ``dK += dSᵀ Q``, transposed so that both accumulators keep the program's
  keys as rows and no product needs a transposed register operand.

Neither needs atomics. Tiles skipped and wholly visible ones come from the mask's span
(``Geometry``), as in the forward; padded keys and queries are masked. The kernels take
what the forward takes (elementwise mask and score_mod, bf16/f16) with ``d + dv <= 256`` after
padding to multiples of 64: the dk and dv accumulators of 64 keys stay in registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxforge.lowering.attention.attention import config, pallas_triton, xla
from jaxforge.lowering.attention.attention import pallas_mosaic_gpu as mosaic
from jaxforge.lowering.attention.attention.kernel import Geometry, tile_loop
from jaxforge.primitives.attention.attention import Implementation
from jaxforge.primitives.attention.mods import Mods

__all__ = ["attention_bwd_mosaic", "mosaic_bwd_can_run"]

_WGMMA = plgpu.Layout.WGMMA


def mosaic_bwd_can_run(mods: Mods, q, v, const_grads, mask_consts=()) -> str | None:
    """Why the Mosaic GPU backward cannot run this call, or None if it can."""
    if any(const_grads):
        return "a captured array wants its cotangent (a reduction over every program)"
    if why := mosaic.mosaic_can_run(mods, q, v, mask_consts):
        return why
    d, dv = (mosaic.swizzled_width(x.shape[-1]) for x in (q, v))
    if d + dv > config.MOSAIC_BWD_MAX_HEAD_DIMS:
        return f"its backward keeps dk and dv in registers: head dims {d} + {dv} (padded) exceed {config.MOSAIC_BWD_MAX_HEAD_DIMS}"
    return None


def _pulled_back(mods: Mods, raw, b, h, q_idx, kv_idx, stats, seen):
    """``(P, dS)`` of one tile from the raw scores, given ``stats = (lse, Δ, dP)`` broadcast to
    the tile (``lse`` in log2 units, 0 where infinite): ``dS`` pulled back through score_mod;
    ``seen()`` the tile's visible scores, None for a wholly visible tile.

    The mods are elementwise, so the pullback is a product with their derivative, which a JVP
    gives (a VJP would emit ``add_any``, which Mosaic GPU does not lower).
    """
    lse, delta, dp = stats
    modify = lambda raw: mods.modify(raw, b, h, q_idx, kv_idx, [])  # noqa: E731
    s, slope = jax.jvp(modify, (raw,), (jnp.ones_like(raw),))
    p = jnp.exp2(s * mosaic.LOG2E - lse)
    g_raw = p * (dp - delta) * slope
    if seen is None:
        return p, g_raw
    seen = seen()
    return jnp.where(seen, p, 0.0), jnp.where(seen, g_raw, 0.0)  # exactly 0, even at infinite Δ


def attention_bwd_mosaic(
    q, k, v, out, lse, *operands, mods: Mods, scale: float, const_grads, implementation: Implementation, interpret: bool, batch_ids, head_offset
):
    """The backward's ``(gq, gk, gv)`` where ``mosaic_bwd_can_run`` allows it (the dispatch checks)."""
    if interpret and mosaic.mosaic_interpret_params() is None:
        raise ValueError(f"Mosaic GPU's interpret mode is not exported by jax {jax.__version__} (jax >= 0.11 has it)")
    g_out, g_lse = operands[-2:]
    d, dv = mosaic.swizzled_width(q.shape[-1]), mosaic.swizzled_width(v.shape[-1])
    block, stages = config.mosaic_bwd_tiles(d, dv, q.dtype.itemsize, implementation, values=(mods.mask_rows, mods.mask_cols))
    rows = mosaic.CONSUMERS * config.MOSAIC_BLOCK_Q
    sq, hq, skv, hkv = *q.shape[-3:-1], *k.shape[-3:-1]
    # One padding serves both kernels: whole 128-row programs, whole ``block`` tiles inside.
    sq_pad, skv_pad = (-(-n // rows) * rows for n in (sq, skv))
    qp, gp = pallas_triton._seq_major(q, sq_pad, d), pallas_triton._seq_major(g_out, sq_pad, dv)
    kp, vp = pallas_triton._seq_major(k, skv_pad, d), pallas_triton._seq_major(v, skv_pad, dv)
    delta = xla.bwd_delta(out, g_out, g_lse, jnp.float32)
    stats = jnp.stack([mosaic.log2_rows(lse, sq_pad), xla.seq_last(delta, sq_pad)], axis=2)  # (B, Hq, 2, Sq)
    arrays = mosaic.mask_arrays(mods, operands[: mods.num_mask_consts], batch_ids, sq_pad, skv_pad)
    common = dict(mods=mods, scale=scale, interpret=interpret, block=block, stages=stages, arrays=arrays, ids=(batch_ids, head_offset))
    (gq,) = _dq(qp, gp, stats, kp, vp, Geometry(sq, skv, rows, block, hq // hkv, scale, jnp.float32, None), **common)
    gk, gv = _dkv(kp, vp, qp, gp, stats, Geometry(sq, skv, block, rows, hq // hkv, scale, jnp.float32, None), **common)
    batch = q.shape[:-3]
    return (
        pallas_triton._back(gq, batch, sq, q.shape[-1]),
        pallas_triton._back(gk, batch, skv, k.shape[-1]),
        pallas_triton._back(gv, batch, skv, v.shape[-1]),
    )


def _dq(qp, gp, stats, kp, vp, geo: Geometry, *, mods, scale, interpret, block, stages, arrays: mosaic.MaskArrays, ids):
    """``dQ`` (B, Sq_pad, Hq, d): programs of 128 query rows over the key tiles they may see."""
    bsz, _, hq, d = qp.shape
    dv, block_q = vp.shape[-1], config.MOSAIC_BLOCK_Q
    dtype = qp.dtype
    bounds = mosaic.kv_bounds(geo, mods)
    operands = (qp, gp, stats, kp, vp, mosaic.program_table(mods, bounds, geo.num_q_tiles, arrays, *ids), arrays.rows, arrays.cols)
    n_own = 4 + (arrays.rows is not None)  # per consumer: table row, Q, dO, stats, the queries' positional values
    n_ring = 2 + (arrays.cols is not None)  # per slot: K, V, the keys' positional values

    def body(q_ref, g_ref, stats_ref, k_ref, v_ref, table_ref, rows_ref, cols_ref, gq_ref, smem, ready, free):
        q_smem, g_smem, stats_smem, program_smem, q_values_smem, *ring_smem = smem
        ring_smem = [x for x in ring_smem if x is not None]
        own_ready, ring_ready = ready
        (ring_free,) = free
        h_local, i, item, wg = mosaic.program_ids("q_tiles")

        @pl.when(wg < mosaic.CONSUMERS)
        def _consume():
            plgpu.set_max_registers(mosaic.CONSUMER_REGISTERS, action="increase")
            q_lo = i * geo.block_q + wg * block_q
            own = (item, pl.ds(q_lo, block_q), h_local)
            stats_rows = stats_ref.at[item, h_local, :, pl.ds(q_lo, block_q)]
            q_values = None if rows_ref is None else (rows_ref.at[item, :, pl.ds(q_lo, block_q)], q_values_smem)
            copies = [(q_ref.at[own], q_smem), (g_ref.at[own], g_smem), (stats_rows, stats_smem)]
            b, h, (lo, hi, full_lo, full_hi), q_values = mosaic.start_consumer(
                mods, lambda: bounds(i), (table_ref.at[item, i], program_smem), copies, q_values, own_ready, wg, interpret
            )
            h = h + h_local
            row_layout = _WGMMA.reduce(1)
            lse, delta = (mosaic.load_in_layout(stats_smem.at[wg, n], row_layout, interpret) for n in range(2))

            def step(t, gq, masked: bool):
                slot = lax.rem(t - lo, jnp.int32(stages))
                k_tile, v_tile, *values_tile = (x.at[slot] for x in ring_smem)
                shape = (block_q, block)
                plgpu.barrier_wait(ring_ready.at[slot * n_ring])
                raw = mosaic.product(q_smem.at[wg], k_tile.transpose((1, 0)), shape) * scale
                plgpu.barrier_wait(ring_ready.at[slot * n_ring + 1])
                dp = mosaic.product(g_smem.at[wg], v_tile.transpose((1, 0)), shape)
                if values_tile:
                    plgpu.barrier_wait(ring_ready.at[slot * n_ring + 2])
                q_idx = q_lo + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=_WGMMA)
                kv_idx = t * block + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_WGMMA)
                row = lambda x: lax.broadcast_in_dim(x, shape, [0])  # noqa: E731

                def seen():
                    kv_values = [x for tile in values_tile for x in mosaic.streamed_values(tile, interpret)]
                    return mosaic.visible(mods, geo, b, h, q_idx, kv_idx, q_values, kv_values)

                stats = (row(lse), row(delta), dp)
                _, g_raw = _pulled_back(mods, raw, b, h, q_idx, kv_idx, stats, seen if masked else None)
                gq = mosaic.accumulate(gq, g_raw.astype(dtype), k_tile, interpret)
                plgpu.barrier_arrive(ring_free.at[slot])
                return gq

            gq = plgpu.layout_cast(jnp.zeros((block_q, d), jnp.float32), _WGMMA)
            gq = tile_loop((lo, hi), (full_lo, full_hi), step, gq)
            q_smem.at[wg][...] = (gq * scale).astype(dtype)  # Q is read: its tile carries dQ out
            mosaic.write_back((q_smem.at[wg], gq_ref.at[own]))

        @pl.when(wg == mosaic.CONSUMERS)
        def _produce():
            plgpu.set_max_registers(mosaic.PRODUCER_REGISTERS, action="decrease")
            h_kv = h_local // geo.group
            lo, hi, _, _ = mosaic.producer_bounds(mods, lambda: bounds(i), table_ref.at[item, i], program_smem, own_ready.at[mosaic.CONSUMERS * n_own])
            tiles = mosaic.key_tiles((k_ref, v_ref), cols_ref, item, h_kv, lo, block)
            mosaic.stream(tiles, ring_smem, ring_ready, ring_free, hi - lo, stages)

    smem = (
        mosaic.swizzled_smem((mosaic.CONSUMERS, block_q, d), dtype),
        mosaic.swizzled_smem((mosaic.CONSUMERS, block_q, dv), dtype),
        plgpu.SMEM((mosaic.CONSUMERS, 2, block_q), jnp.float32),
        mosaic.table_smem(),
        mosaic.values_smem(arrays.rows, mosaic.CONSUMERS, block_q),
        mosaic.swizzled_smem((stages, block, d), dtype),
        mosaic.swizzled_smem((stages, block, dv), dtype),
        mosaic.values_smem(arrays.cols, stages, block),
    )
    ready = (
        plgpu.Barrier(num_barriers=mosaic.CONSUMERS * n_own + 1),  # and the producer's table row
        plgpu.Barrier(num_barriers=stages * n_ring),
    )
    free = (plgpu.Barrier(num_arrivals=mosaic.CONSUMERS, num_barriers=stages),)
    return mosaic.warpgroup_call(body, operands, [(qp.shape, dtype)], (smem, ready, free), (hq, geo.num_q_tiles, bsz), "q_tiles", interpret)


def _dkv(kp, vp, qp, gp, stats, geo: Geometry, *, mods, scale, interpret, block, stages, arrays: mosaic.MaskArrays, ids):
    """``(dK, dV)`` (B, Skv_pad, Hkv, d / dv): programs of 128 keys over the query tiles of each
    query head of their group that may see them."""
    bsz, _, hkv, d = kp.shape
    dv, block_kv = vp.shape[-1], config.MOSAIC_BLOCK_Q
    dtype = kp.dtype
    bounds = mosaic.q_bounds(geo, mods)
    operands = (kp, vp, qp, gp, stats, mosaic.program_table(mods, bounds, geo.num_kv_tiles, arrays, *ids), arrays.cols, arrays.rows)
    n_own = 3 + (arrays.cols is not None)  # per consumer: table row, K, V, the keys' positional values
    n_ring = 3 + (arrays.rows is not None)  # per slot: Q, dO, their (lse, Δ) rows, the queries' positional values

    def body(k_ref, v_ref, q_ref, g_ref, stats_ref, table_ref, cols_ref, rows_ref, gk_ref, gv_ref, smem, ready, free):
        k_smem, v_smem, program_smem, kv_values_smem, *ring_smem = smem
        ring_smem = [x for x in ring_smem if x is not None]
        own_ready, ring_ready = ready
        (ring_free,) = free
        hk, j, item, wg = mosaic.program_ids("kv_tiles")

        @pl.when(wg < mosaic.CONSUMERS)
        def _consume():
            plgpu.set_max_registers(mosaic.CONSUMER_REGISTERS, action="increase")
            kv_lo = j * geo.block_kv + wg * block_kv
            own = (item, pl.ds(kv_lo, block_kv), hk)
            kv_values = None if cols_ref is None else (cols_ref.at[item, :, pl.ds(kv_lo, block_kv)], kv_values_smem)
            copies = [(k_ref.at[own], k_smem), (v_ref.at[own], v_smem)]
            b, h_first, (lo, hi, full_lo, full_hi), kv_values = mosaic.start_consumer(
                mods, lambda: bounds(j), (table_ref.at[item, j], program_smem), copies, kv_values, own_ready, wg, interpret
            )
            h_first = h_first + hk * geo.group
            shape, col_layout = (block_kv, block), _WGMMA.reduce(0)

            def head(g, carry):
                def step(i, carry, masked: bool):
                    gk, gv = carry
                    slot = lax.rem(g * (hi - lo) + i - lo, jnp.int32(stages))
                    q_tile, g_tile, stats_tile, *values_tile = (x.at[slot] for x in ring_smem)
                    plgpu.barrier_wait(ring_ready.at[slot * n_ring])
                    raw = mosaic.product(k_smem.at[wg], q_tile.transpose((1, 0)), shape) * scale
                    plgpu.barrier_wait(ring_ready.at[slot * n_ring + 1])
                    dp = mosaic.product(v_smem.at[wg], g_tile.transpose((1, 0)), shape)
                    for n in range(2, n_ring):
                        plgpu.barrier_wait(ring_ready.at[slot * n_ring + n])
                    lse, delta = (mosaic.load_in_layout(stats_tile.at[n], col_layout, interpret) for n in range(2))
                    col = lambda x: lax.broadcast_in_dim(x, shape, [1])  # noqa: E731
                    kv_idx = kv_lo + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=_WGMMA)
                    q_idx = i * block + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_WGMMA)
                    h = h_first + g

                    def seen():
                        q_values = [x for tile in values_tile for x in mosaic.streamed_values(tile, interpret)]
                        return mosaic.visible(mods, geo, b, h, q_idx, kv_idx, q_values, kv_values, q_axis=1)

                    stats = (col(lse), col(delta), dp)
                    p, g_raw = _pulled_back(mods, raw, b, h, q_idx, kv_idx, stats, seen if masked else None)
                    gv = mosaic.accumulate(gv, p.astype(dtype), g_tile, interpret)
                    gk = mosaic.accumulate(gk, g_raw.astype(dtype), q_tile, interpret)
                    plgpu.barrier_arrive(ring_free.at[slot])
                    return gk, gv

                return tile_loop((lo, hi), (full_lo, full_hi), step, carry)

            zeros = lambda width: plgpu.layout_cast(jnp.zeros((block_kv, width), jnp.float32), _WGMMA)  # noqa: E731
            gk, gv = lax.fori_loop(*mosaic.int32(0, geo.group), head, (zeros(d), zeros(dv)))
            k_smem.at[wg][...] = (gk * scale).astype(dtype)  # K and V are read: their tiles carry dK, dV out
            v_smem.at[wg][...] = gv.astype(dtype)
            mosaic.write_back((k_smem.at[wg], gk_ref.at[own]), (v_smem.at[wg], gv_ref.at[own]))

        @pl.when(wg == mosaic.CONSUMERS)
        def _produce():
            plgpu.set_max_registers(mosaic.PRODUCER_REGISTERS, action="decrease")
            lo, hi, _, _ = mosaic.producer_bounds(mods, lambda: bounds(j), table_ref.at[item, j], program_smem, own_ready.at[mosaic.CONSUMERS * n_own])

            def query_tiles(c):  # the c-th tile of the loop over (head of the group, query tile)
                g, i = lax.div(c, hi - lo), lo + lax.rem(c, hi - lo)
                queries, h_local = pl.ds(i * block, block), hk * geo.group + g
                tile = (q_ref.at[item, queries, h_local], g_ref.at[item, queries, h_local], stats_ref.at[item, h_local, :, queries])
                return tile if rows_ref is None else (*tile, rows_ref.at[item, :, queries])

            mosaic.stream(query_tiles, ring_smem, ring_ready, ring_free, geo.group * (hi - lo), stages)

    smem = (
        mosaic.swizzled_smem((mosaic.CONSUMERS, block_kv, d), dtype),
        mosaic.swizzled_smem((mosaic.CONSUMERS, block_kv, dv), dtype),
        mosaic.table_smem(),
        mosaic.values_smem(arrays.cols, mosaic.CONSUMERS, block_kv),
        mosaic.swizzled_smem((stages, block, d), dtype),
        mosaic.swizzled_smem((stages, block, dv), dtype),
        plgpu.SMEM((stages, 2, block), jnp.float32),
        mosaic.values_smem(arrays.rows, stages, block),
    )
    ready = (
        plgpu.Barrier(num_barriers=mosaic.CONSUMERS * n_own + 1),  # and the producer's table row
        plgpu.Barrier(num_barriers=stages * n_ring),
    )
    free = (plgpu.Barrier(num_arrivals=mosaic.CONSUMERS, num_barriers=stages),)
    return mosaic.warpgroup_call(body, operands, [(kp.shape, dtype), (vp.shape, dtype)], (smem, ready, free), (hkv, geo.num_kv_tiles, bsz), "kv_tiles", interpret)
