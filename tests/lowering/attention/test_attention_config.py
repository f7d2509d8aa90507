"""Tile choice of the attention lowerings: every Triton kernel's estimated shared memory fits; GQA
packing's choice and its map of rows to queries and heads."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxforge.lowering.attention.attention import config, xla
from jaxforge.lowering.attention.attention.pallas_triton import CALL_KERNELS
from jaxforge.primitives.attention.attention import Implementation
from jaxforge.primitives.attention.mods import Band, Mods

KERNEL_SETS = list(CALL_KERNELS.values())  # the kernels that share one call's tiles


def test_the_estimate_reproduces_the_requests_the_h200_refused():
    # First H200 run, MLA head dims (192 padded to 256, 128) in bf16 at 128 x 64 tiles, 2 stages.
    assert config.triton_smem("tangent", 128, 64, 256, 128, 2, 2) == 327680
    assert config.triton_smem("bwd_dkv", 128, 64, 256, 128, 2, 2) == 263168


@pytest.mark.parametrize("kernels", KERNEL_SETS, ids=lambda k: "+".join(k))
@pytest.mark.parametrize("stages", [None, 3, 4])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "sm_86"])
def test_tiles_fit_shared_memory_for_every_head_dim_and_dtype(kernels, stages, arch):
    impl = Implementation("pallas_triton", num_stages=stages)
    for d, dv, itemsize in itertools.product([16, 64, 128, 256], [16, 64, 128, 256], [2, 4]):
        try:
            block_q, block_kv = config.tiles(
                "pallas_triton", 8192, 8192, impl, kernels=kernels, d=d, dv=dv, itemsize=itemsize, arch=arch
            )
        except ValueError as e:  # on an H200 only a deeper pipeline than the default, asked for
            assert (stages is not None or arch != "sm_90a") and "no Triton tiles fit" in str(e), e
            continue
        assert block_q >= 16 and block_kv >= 16 and block_q & (block_q - 1) == 0 and block_kv & (block_kv - 1) == 0
        for k in kernels:
            stages_used = config.triton_compiler(impl, kernels, d)[1]
            assert config.triton_smem(k, block_q, block_kv, d, dv, itemsize, stages_used) <= config.TRITON_SMEM_BYTES[arch]


@pytest.mark.parametrize(
    "n,pieces",
    [(8, (16,)), (32, (32,)), (48, (32, 16)), (80, (64, 16)), (96, (64, 32)), (100, (128,)), (128, (128,)),
     (192, (128, 64)), (200, (256,)), (576, (512, 64)), (1024, (1024,))],
)  # fmt: skip
def test_head_dims_split_in_two_powers_of_two_where_narrower(n, pieces):
    assert config.head_pieces(n, split=True) == pieces
    assert sum(pieces) >= n and all(w >= 16 and w & (w - 1) == 0 for w in pieces)
    assert config.head_pieces(n, split=False) == (max(16, config.pow2_at_least(n)),)


def test_mla_decoding_fits_more_tiles_in_pieces(monkeypatch):
    """MLA's absorbed decoding step (one kv head of 576/512, 8192 keys) on an H200: padded to 1024,
    no float32 tiles fit its forward or backward, nor bf16 ones its jvp; as 512 + 64 they do, and
    bf16 key tiles twice as long. Unasked, the pieces wait for config.TRITON_HEAD_PIECES_VALIDATED."""
    from jaxforge.lowering.attention.attention import pallas_triton

    monkeypatch.delenv("JAXFORGE_UNVALIDATED_KERNELS", raising=False)
    shapes = (2, 1, 16, 576), (2, 8192, 1, 576), (2, 8192, 1, 512)
    f32, bf16 = ([jnp.zeros(s, dtype) for s in shapes] for dtype in (jnp.float32, jnp.bfloat16))
    pieces, padded = Implementation("pallas_triton", head_pieces=True), Implementation("pallas_triton")
    for call in ("fwd", "bwd"):
        assert pallas_triton.triton_fits(call, *f32, pieces) and not pallas_triton.triton_fits(call, *f32, padded)
    assert pallas_triton.triton_fits("tangent", *bf16, pieces) and not pallas_triton.triton_fits("tangent", *bf16, padded)
    geo, _, widths = pallas_triton._geometry("fwd", *bf16, 1.0, pieces)
    assert widths == ((512, 64), (512,)) and geo.block_kv == 32
    geo, _, widths = pallas_triton._geometry("fwd", *bf16, 1.0, padded)
    assert widths == ((1024,), (512,)) and geo.block_kv == 16
    monkeypatch.setattr(config, "TRITON_HEAD_PIECES_VALIDATED", True)
    assert pallas_triton._geometry("fwd", *bf16, 1.0, padded)[2] == ((512, 64), (512,))
    assert pallas_triton._geometry("fwd", *bf16, 1.0, dataclasses.replace(pieces, head_pieces=False))[2] == ((1024,), (512,))


def test_tiles_stay_at_their_start_where_they_fit_and_short_sequences_shrink_them():
    impl = Implementation("pallas_triton")
    for kernels in KERNEL_SETS:
        for d in (64, 128):
            start = config.triton_start(kernels, d)
            assert config.tiles("pallas_triton", 8192, 8192, impl, kernels=kernels, d=d, dv=d) == start[:2]
            assert config.triton_compiler(impl, kernels, d) == start[2:]
    assert config.tiles("pallas_triton", 8192, 8192, impl, kernels=("tangent",), d=256, dv=128) != (128, 64)
    assert config.tiles("pallas_triton", 20, 9, impl, kernels=("fwd",), d=64, dv=64) == (32, 16)
    own = Implementation("pallas_triton", block_q=32, block_kv=16, num_warps=8, num_stages=3)
    assert config.tiles("pallas_triton", 8192, 8192, own, kernels=("fwd",), d=64, dv=64) == (32, 16)
    assert config.triton_compiler(own, ("fwd",), 64) == (8, 3)


def test_tuned_starts_are_per_call_and_head_dim():
    assert config.triton_start(("bwd_dq", "bwd_dkv"), 128) == config.TRITON_TUNED["bwd", 128]
    assert config.triton_start(("fwd",), 128) == config.TRITON_TUNED["fwd", 128]
    assert config.triton_start(("tangent",), 32) == config.TRITON_START  # not measured: the start


def test_gqa_heads_pack_below_a_tile_of_queries_unless_told():
    """Decoding (fewer queries than a tile) packs a GQA group's heads into one tile's rows; longer
    sequences do only where told any_length; plain multi-head attention and an Implementation saying
    otherwise never do."""
    default, never, always = Implementation(), Implementation(pack_gqa=False), Implementation(pack_gqa=True)
    below = config.PACK_GQA_BELOW
    assert config.packs_gqa(1, 8, default) and config.packs_gqa(below - 1, 4, default)
    assert not config.packs_gqa(below, 4, default) and not config.packs_gqa(1, 1, default)
    assert not config.packs_gqa(1, 8, never) and config.packs_gqa(4096, 8, always) and not config.packs_gqa(1, 1, always)
    # the XLA backward without a mask: every length, still never without a group or when told not to
    assert config.packs_gqa(4096, 8, default, any_length=True) and not config.packs_gqa(4096, 8, default)
    assert not config.packs_gqa(4096, 1, default, any_length=True) and not config.packs_gqa(1, 8, never, any_length=True)


def test_packed_geometry_maps_rows_to_queries_and_heads():
    q, k = jnp.zeros((2, 3, 12, 8)), jnp.zeros((2, 29, 4, 8))  # one decoding step of 3 queries, GQA 3:1
    geo = xla.geometry("xla", q, k, 1.0, Implementation(block_q=8))
    assert (geo.pack, geo.group, geo.rows, geo.num_q_tiles) == (3, 1, 9, 2)
    packed = xla.pack_heads(geo, jnp.arange(2 * 3 * 12).reshape(2, 3, 12), rows=True)  # lse-like
    assert packed.shape == (2, 9, 4)
    assert [int(packed[1, r, 2]) for r in range(9)] == [36 + 12 * (r // 3) + 2 * 3 + r % 3 for r in range(9)]
    np.testing.assert_array_equal(xla.unpack_heads(geo, packed, rows=True), jnp.arange(72).reshape(2, 3, 12))
    # a diagonal mask, one key a tile: tile 0 holds queries 0, 1 and two heads of 2; tile 1 the last
    geo = xla.geometry("xla", q, k, 1.0, Implementation(block_q=8, block_kv=1))
    diagonal = Mods(span=Band(0, 0))
    assert [tuple(map(int, geo.kv_tiles(diagonal, i, ()))) for i in (0, 1)] == [(0, 3), (2, 3)]
    assert [tuple(map(int, geo.q_tiles(diagonal, j, ()))) for j in (0, 2)] == [(0, 1), (0, 2)]


def test_keys_split_where_the_programs_would_not_fill_the_gpu():
    default = Implementation()
    assert config.kv_splits(2048, 128, default, 132) == 1  # a long prefill fills it
    assert config.kv_splits(16, 512, default, 132) == 17  # a decoding step: 2 waves of 132 SMs
    assert config.kv_splits(16, 40, default, 132) == 10  # MIN_SPLIT_TILES key tiles a split
    assert config.kv_splits(16, 3, default, 132) == 1
    assert config.kv_splits(16, 512, default, None) == 17  # no GPU: the H200's
    assert config.kv_splits(2048, 128, Implementation(kv_splits=5), 132) == 5
    assert config.kv_splits(16, 3, Implementation(kv_splits=5), 132) == 3  # a tile a split at most
