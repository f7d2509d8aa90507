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

A mask's runtime data (document segment ids, per-item prefix lengths) reaches the kernels in two
forms. Its *positional* values (``Mods.mask_rows``/``mask_cols``: one int32 per query or key) are
copied per tile like the operands: a consumer's own 64 rows once, the streamed tiles' in the
producer's ring beside their K (or Q) tile, each loaded into registers as a row or a column of
the score tile. The tiles a program visits, which then depend on the data (``RangeSpan``), are
computed before the call for every program (``program_table``) and read from its table row;
for static spans each warpgroup computes them itself, so the producer starts copying at once.

The tangent's and the backward's kernels (pallas_mosaic_gpu_tangent.py, pallas_mosaic_gpu_bwd.py)
share this module's pieces and read the ``(out, lse)`` this kernel writes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxforge.lowering.attention.attention import config, pallas_triton, xla
from jaxforge.lowering.attention.attention.kernel import Geometry, bounds_table, tile_loop
from jaxforge.primitives.attention.attention import Implementation
from jaxforge.primitives.attention.mods import Mods, fits_int32

__all__ = [
    "CONSUMERS",
    "CONSUMER_REGISTERS",
    "LOG2E",
    "MaskArrays",
    "PRODUCER_REGISTERS",
    "accumulate",
    "attention_fwd_mosaic",
    "int32",
    "key_tiles",
    "kv_bounds",
    "load_in_layout",
    "log2_rows",
    "mask_arrays",
    "mosaic_can_run",
    "mosaic_interpret_params",
    "producer_bounds",
    "product",
    "program_ids",
    "program_table",
    "q_bounds",
    "start_consumer",
    "stream",
    "streamed_values",
    "swizzled_smem",
    "swizzled_width",
    "table_smem",
    "values_smem",
    "visible",
    "warpgroup_call",
    "write_back",
]

CONSUMERS = 2  # warpgroups computing, each owning config.MOSAIC_BLOCK_Q query rows
LOG2E = math.log2(math.e)
_LN2 = math.log(2)
_ROWS, _COLS = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)  # a value per row / column of a tile
# Consumers need registers for their accumulators; the producer only issues copies.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40


def mosaic_can_run(mods: Mods, q, v, mask_consts=()) -> str | None:
    """Why the Mosaic GPU forward cannot run this call, or None if it can.

    The mask and score_mod must be elementwise arithmetic on the indices and on the mask's
    positional arrays (integers of up to 32 bits, as jf.masks hands over document segment ids and
    per-item prefix lengths), with no other captured array; bf16/f16 operands; head dims from 1 to 256.
    """
    if pallas_triton.reads_captured_arrays(mods) or not pallas_triton.triton_can_run(mods):
        return (
            "its mask or score_mod reads captured arrays (the Mosaic GPU kernels apply elementwise functions "
            "of the indices and of positional arrays such as document segment ids)"
        )
    for x in mask_consts[: mods.mask_rows + mods.mask_cols]:  # the function itself has no arrays
        if not fits_int32(x.dtype):
            return f"its mask's positional arrays must be integers of up to 32 bits, got {x.dtype}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it takes bfloat16 or float16 operands, got {q.dtype}"
    if min(q.shape[-1], v.shape[-1]) == 0 or max(q.shape[-1], v.shape[-1]) > 256:
        return f"it takes head dims from 1 to 256, got {q.shape[-1]} and {v.shape[-1]}"
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


@dataclasses.dataclass(frozen=True)
class MaskArrays:
    """A mask's runtime arrays as the Mosaic GPU kernels read them, one leading row per local batch
    item: its positional values at the queries (``rows``, ``(B, R, Sq_pad)``) and at the keys
    (``cols``, ``(B, C, Skv_pad)``), int32, None where it has none; and its span's arrays."""

    rows: jax.Array | None
    cols: jax.Array | None
    span: tuple


def mask_arrays(mods: Mods, mask_consts, batch_ids, sq_pad: int, skv_pad: int) -> MaskArrays:
    """The mask's arrays of each local batch item (``batch_ids``: their global indices), the
    positional ones zero-padded to whole programs (padding is masked by the bounds anyway)."""
    if mods.mask is None:
        return MaskArrays(None, None, ())

    def per_item(b):
        item = mods.item_mask(b, mask_consts)
        return item.rows, item.cols, item.span

    rows, cols, span = jax.vmap(per_item)(batch_ids)
    stacked = lambda xs, size: jnp.stack([pallas_triton._pad_last(x.astype(jnp.int32), size) for x in xs], 1) if xs else None  # noqa: E731
    return MaskArrays(stacked(rows, sq_pad), stacked(cols, skv_pad), tuple(span))


def kv_bounds(geo: Geometry, mods: Mods):
    """``bounds(i, span=()) -> (lo, hi, full_lo, full_hi)`` of query program ``i`` (Geometry.row_bounds)."""
    return functools.partial(geo.row_bounds, mods)


def q_bounds(geo: Geometry, mods: Mods):
    """``bounds(j, span=())`` of key program ``j`` (Geometry.col_bounds)."""
    return functools.partial(geo.col_bounds, mods)


def program_table(mods: Mods, bounds, num_programs: int, arrays: MaskArrays, batch_ids, head_offset):
    """``(B, T, 32)`` int32, a row per local batch item and program: the item's global index, that
    of its first local head and, where the span reads arrays, ``bounds(t, span)`` (:func:`kv_bounds`,
    :func:`q_bounds`) for the item's span (static spans are bounded in the kernel). A program
    copies its row (128 bytes, the smallest copy a warpgroup takes)."""
    bsz = batch_ids.shape[0]
    table = jnp.zeros((bsz, num_programs, 32), jnp.int32)
    table = table.at[..., 0].set(batch_ids[:, None]).at[..., 1].set(head_offset)
    if not mods.span.num_arrays:
        return table
    return table.at[..., 2:6].set(bounds_table(bounds, num_programs, arrays.span))


def _tile_bounds(mods: Mods, bounds, row):
    """``(lo, hi, full_lo, full_hi)`` of this program: ``bounds()`` in the kernel where the span is
    static (the producer can start at once), else from its table row ``row`` (shared memory)."""
    if mods.span.num_arrays:
        return int32(*(row[n] for n in range(2, 6)))
    return int32(*bounds())


def start_consumer(mods: Mods, bounds, table, copies, values, ready, wg, interpret: bool):
    """A consumer's own operands in shared memory: its program's table row (``table``), the
    ``copies`` and, where the mask has them, its positional values (``values``), each a
    ``(source, destination)`` pair (:func:`_load_own`; ``values`` may be None). Returns its item's
    global index, its first head's, its tile bounds (:func:`_tile_bounds`) and the values."""
    _load_own([table, *copies] + ([] if values is None else [values]), ready, wg)
    row = table[1].at[wg]
    own = [] if values is None else _own_values(values[1].at[wg], interpret)
    return row[0], row[1], _tile_bounds(mods, bounds, row), own


def producer_bounds(mods: Mods, bounds, table_ref, table_smem, ready):
    """The producer's tile bounds: its own copy of the table row where the span reads arrays."""
    if mods.span.num_arrays:
        plgpu.copy_gmem_to_smem(table_ref, table_smem.at[CONSUMERS], ready)
        plgpu.barrier_wait(ready)
    return _tile_bounds(mods, bounds, table_smem.at[CONSUMERS])


def _own_values(values_smem, interpret: bool) -> list:
    """A consumer's positional values (``(count, rows)`` shared memory) along its tile's rows."""
    return [load_in_layout(values_smem.at[n], _ROWS, interpret) for n in range(values_smem.shape[0])]


def streamed_values(values_smem, interpret: bool) -> list:
    """A streamed tile's positional values (``(count, cols)`` shared memory) along the columns."""
    return [load_in_layout(values_smem.at[n], _COLS, interpret) for n in range(values_smem.shape[0])]


def table_smem():
    """Each warpgroup's copy of its program's table row."""
    return plgpu.SMEM((CONSUMERS + 1, 32), jnp.int32)


def values_smem(values, count: int, size: int):
    """Shared memory for ``count`` tiles of ``size`` positions of positional ``values``, or None."""
    return None if values is None else plgpu.SMEM((count, values.shape[1], size), jnp.int32)


# jax 0.10 requires plgpu.load's index; jax 0.11 deprecates it (the ref comes indexed, ref.at[...])
_LOAD_TAKES_INDEX = getattr(inspect.signature(plgpu.load).parameters.get("idx"), "default", None) is inspect.Parameter.empty


def load_in_layout(ref, layout, interpret: bool):
    """A shared-memory tile or row in registers in ``layout`` (the interpreter ignores layouts and
    lacks ``plgpu.load``)."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(ref, layout=layout)


def int32(*xs):
    """Loop bounds and indices in int32, whatever jax_enable_x64 says (Mosaic GPU indexes in int32)."""
    return tuple(jnp.asarray(x, jnp.int32) for x in xs)


def _load_own(copies, ready, wg):
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


def key_tiles(refs, cols_ref, item, head, lo, block: int):
    """``tiles(c)`` for :func:`stream` in a query program: key tile ``lo + c`` of each of ``refs``
    (at ``item``, ``head``) and, where the mask has them, of the keys' positional values."""

    def tiles(c):
        keys = pl.ds((lo + c) * block, block)
        tile = tuple(x.at[item, keys, head] for x in refs)
        return tile if cols_ref is None else (*tile, cols_ref.at[item, :, keys])

    return tiles


def warpgroup_call(body, operands, outputs, scratch, grid, tiles: str, interpret: bool):
    """Runs ``body(*operand refs, *output refs, *scratch refs)`` in three warpgroups (two consumers,
    a producer) per program of ``grid``, named (heads, ``tiles``, batch). Operands that are None
    (a mask without positional arrays) get a None ref; ``outputs`` are ``(shape, dtype)`` pairs;
    the ``scratch`` buffers and barriers are allocated by all warpgroups together."""
    # As in pallas_triton._call: inside shard_map the outputs take the operands' varying axes.
    varying = jax.typeof(operands[0]).manual_axis_type
    out_type = tuple(jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=varying) for shape, dtype in outputs)
    given = [x for x in operands if x is not None]

    def entry(*refs):
        it = iter(refs[: len(given)])
        in_refs = [None if x is None else next(it) for x in operands]
        out_refs = refs[len(given) :]
        pl.run_scoped(lambda *allocated: body(*in_refs, *out_refs, *allocated), *scratch, collective_axes="warpgroup")

    kernel = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=grid,
        grid_names=("heads", tiles, "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="warpgroup",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_interpret_params() if interpret else None,
    )
    return kernel(*given)


def write_back(*copies):
    """``(shared, global)`` tiles a consumer has written: made visible to TMA, copied out, waited for."""
    plgpu.commit_smem()
    for source, destination in copies:
        plgpu.copy_smem_to_gmem(source, destination)
    plgpu.wait_smem_to_gmem(0)


def visible(mods: Mods, geo: Geometry, b, h, q_idx, kv_idx, rows=(), cols=(), q_axis: int = 0):
    """Which scores of a tile count: inside both sequences (not padding) and allowed by the mask;
    ``rows`` / ``cols`` its positional values at the tile's queries / keys, vectors along the
    tile's axis ``q_axis`` / the other."""
    inside = (kv_idx < geo.skv) & (q_idx < geo.sq)
    spread = lambda xs, axis: [lax.broadcast_in_dim(x, q_idx.shape, [axis]) for x in xs]  # noqa: E731
    user = mods.allowed(b, h, q_idx, kv_idx, [], spread(rows, q_axis), spread(cols, 1 - q_axis))
    return inside if user is None else inside & user


def program_ids(tiles: str):
    """``(head, tile, item, warpgroup)`` of a program on a grid named (heads, ``tiles``, batch)."""
    return tuple(lax.axis_index(name) for name in ("heads", tiles, "batch", "warpgroup"))


def attention_fwd_mosaic(
    q, k, v, *consts, mods: Mods, scale: float, implementation: Implementation, interpret: bool, batch_ids, head_offset, max_scores: bool = False
):
    """``(out, lse)``, with ``max_scores`` also each row's largest score: the running maximum the
    online softmax keeps (log2 units there), written after the lse through the lse's buffer."""
    if interpret and mosaic_interpret_params() is None:
        raise ValueError(f"Mosaic GPU's interpret mode is not exported by jax {jax.__version__} (jax >= 0.11 has it)")
    block_q = config.MOSAIC_BLOCK_Q
    rows = CONSUMERS * block_q
    d, dv = swizzled_width(q.shape[-1]), swizzled_width(v.shape[-1])
    sq, hq, skv, hkv = *q.shape[-3:-1], *k.shape[-3:-1]
    block_kv, stages = config.mosaic_tiles(d, dv, q.dtype.itemsize, implementation, values=(mods.mask_rows, mods.mask_cols))
    geo = Geometry(sq, skv, rows, block_kv, hq // hkv, scale, jnp.dtype(jnp.float32), None)
    batch, bsz = q.shape[:-3], math.prod(q.shape[:-3])
    sq_pad, skv_pad = geo.num_q_tiles * rows, geo.num_kv_tiles * block_kv
    arrays = mask_arrays(mods, consts, batch_ids, sq_pad, skv_pad)
    qp, kp, vp = (pallas_triton._seq_major(x, s, w) for x, s, w in ((q, sq_pad, d), (k, skv_pad, d), (v, skv_pad, dv)))
    bounds = kv_bounds(geo, mods)
    table = program_table(mods, bounds, geo.num_q_tiles, arrays, batch_ids, head_offset)
    wgmma_layout = plgpu.Layout.WGMMA

    def body(q_ref, k_ref, v_ref, table_ref, rows_ref, cols_ref, out_ref, lse_ref, *refs):
        *top_ref, smem, ready, free, turn = refs  # top_ref: the maxima's, with max_scores
        q_smem, o_smem, k_smem, v_smem, lse_smem, program_smem, q_values_smem, kv_values_smem = smem
        o_smem = q_smem if o_smem is None else o_smem  # equal head dims: the output reuses q's tile
        own_ready, k_ready, v_ready, cols_ready = ready
        k_free, v_free = free
        h_local, i, item, wg = program_ids("q_tiles")

        @pl.when(wg < CONSUMERS)
        def _consume():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            q_lo = i * rows + wg * block_q
            own = (item, pl.ds(q_lo, block_q))
            q_values = None if rows_ref is None else (rows_ref.at[item, :, own[1]], q_values_smem)
            b, h, (lo, hi, full_lo, full_hi), q_values = start_consumer(
                mods, lambda: bounds(i), (table_ref.at[item, i], program_smem), [(q_ref.at[(*own, h_local)], q_smem)],
                q_values, own_ready, wg, interpret,
            )  # fmt: skip
            h = h + h_local

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
                if cols_ref is not None:  # every phase is waited for; the values read where masked
                    plgpu.barrier_wait(cols_ready.at[slot])
                kv_values = streamed_values(kv_values_smem.at[slot], interpret) if masked and cols_ref is not None else []
                plgpu.barrier_arrive(k_free.at[slot])
                q_idx = q_lo + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=wgmma_layout)
                kv_idx = t * block_kv + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=wgmma_layout)
                s = mods.modify(s * scale, b, h, q_idx, kv_idx, [])
                if masked:
                    s = jnp.where(visible(mods, geo, b, h, q_idx, kv_idx, q_values, kv_values), s, -jnp.inf)
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
                plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), _ROWS),
                plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), _ROWS),
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
            write_back((o_smem.at[wg], out_ref.at[(*own, h_local)]), (lse_smem.at[wg], lse_ref.at[item, h_local, own[1]]))
            if max_scores:  # the lse's buffer again: write_back waited for its copy out
                lse_smem.at[wg][...] = m * _LN2
                write_back((lse_smem.at[wg], top_ref[0].at[item, h_local, own[1]]))

        @pl.when(wg == CONSUMERS)
        def _produce():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            h_kv = h_local // geo.group
            lo, hi, _, _ = producer_bounds(mods, lambda: bounds(i), table_ref.at[item, i], program_smem, own_ready.at[CONSUMERS * n_own])

            def load(t, wait: bool):
                slot = lax.rem(t - lo, jnp.int32(stages))
                tile = (item, pl.ds(t * block_kv, block_kv), h_kv)
                if wait:  # both consumers are done with the slot's previous tile
                    plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[tile], k_smem.at[slot], k_ready.at[slot])
                if cols_ref is not None:  # the keys' positional values travel (and are freed) with K
                    plgpu.copy_gmem_to_smem(cols_ref.at[item, :, tile[1]], kv_values_smem.at[slot], cols_ready.at[slot])
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

    operands = (qp, kp, vp, table, arrays.rows, arrays.cols)
    n_own = 2 + (arrays.rows is not None)  # per consumer: table row, Q, the queries' positional values

    swizzled = lambda shape: swizzled_smem(shape, q.dtype)  # noqa: E731
    smem = (
        swizzled((CONSUMERS, block_q, d)),
        None if dv == d else swizzled((CONSUMERS, block_q, dv)),
        swizzled((stages, block_kv, d)),
        swizzled((stages, block_kv, dv)),
        plgpu.SMEM((CONSUMERS, block_q), jnp.float32),
        table_smem(),
        values_smem(arrays.rows, CONSUMERS, block_q),
        values_smem(arrays.cols, stages, block_kv),
    )
    ready = (
        plgpu.Barrier(num_barriers=CONSUMERS * n_own + 1),  # and the producer's table row
        plgpu.Barrier(num_barriers=stages),  # K
        plgpu.Barrier(num_barriers=stages),  # V
        plgpu.Barrier(num_barriers=stages),  # the keys' positional values
    )
    free = (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2
    turn = plgpu.Barrier(num_arrivals=CONSUMERS)
    rows_out = ((bsz, hq, sq_pad), jnp.float32)  # the lse (and the maxima)
    outputs = (((bsz, sq_pad, hq, dv), q.dtype), *[rows_out] * (1 + max_scores))
    out, *rows = warpgroup_call(body, operands, outputs, (smem, ready, free, turn), (hq, geo.num_q_tiles, bsz), "q_tiles", interpret)
    return pallas_triton._back(out, batch, geo.sq, v.shape[-1]), *(pallas_triton._rows_back(x, batch, geo.sq) for x in rows)
