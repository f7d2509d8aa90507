"""Tile choice of the Triton attention kernels: every kernel's estimated shared memory fits."""

from __future__ import annotations

import itertools

import pytest

from jaxforge.lowering.attention.attention import config
from jaxforge.lowering.attention.attention.pallas_triton import CALL_KERNELS
from jaxforge.primitives.attention.attention import Implementation

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
