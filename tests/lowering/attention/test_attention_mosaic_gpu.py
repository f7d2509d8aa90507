"""The Mosaic GPU attention forward on CPU: lowered for cuda (``jax.export`` runs Pallas's Mosaic
GPU lowering and Mosaic's own passes here, down to the LLVM dialect, shared-memory check
included), its shared-memory model, what it refuses, and, where jax exports Mosaic GPU's
interpret mode (0.11+), its values. The gpu tests (test_attention_gpu.py) run it on a Hopper."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.functional.attention import Implementation
from jaxforge.functional.attention import _mods as attention_mods
from jaxforge.lowering.attention.attention import config, pallas_mosaic_gpu

MOSAIC = "pallas_mosaic_gpu"
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def lowered(f, *shapes):
    """The cuda lowering's StableHLO text of ``f`` at ``shapes`` (bfloat16)."""
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    return jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[TRITON])(*args).mlir_module()


def mosaic_kernels(text: str) -> int:
    return len(re.findall(r"custom_call @mosaic_gpu", text))


CASES = {  # (b, sq, skv, hq, hkv, d, dv), attention keywords
    "d64_window_alibi": ((2, 300, 257, 4, 2, 64, 64), dict(
        mask=jf.masks.causal() & jf.masks.sliding_window(100), score_mod=lambda s, b, h, i, j: s - 0.1 * (h + 1) * (i - j))),
    "d128_plain": ((1, 256, 256, 2, 2, 128, 128), {}),
    "mla_192_128_causal_softcap": ((1, 256, 512, 2, 2, 192, 128), dict(mask=jf.masks.causal(), softcap=20.0)),
    "d256_gqa_causal": ((1, 256, 256, 4, 1, 256, 256), dict(mask=jf.masks.causal())),
    "odd_dims_chunked_or_prefix": ((2, 37, 53, 2, 1, 80, 72), dict(mask=jf.masks.chunked(16) | jf.masks.prefix_lm(5))),
    "fully_masked_rows": ((1, 200, 200, 2, 2, 64, 64), dict(mask=jf.masks.causal(-70))),  # rows < 70 see no key
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_lowers_to_one_mosaic_kernel_beside_the_triton_tangent_and_backward(case):
    (b, sq, skv, hq, hkv, d, dv), kw = CASES[case]
    shapes = ((b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv))
    att = lambda q, k, v: jf.attention(q, k, v, implementation=MOSAIC, **kw)  # noqa: E731
    assert mosaic_kernels(lowered(att, *shapes)) == 1

    def jvp_and_grad(q, k, v):
        _, tangent = jax.jvp(att, (q, k, v), (q, k, v))
        return tangent, jax.grad(lambda *a: jnp.sum(att(*a).astype(jnp.float32)), (0, 1, 2))(q, k, v)

    text = lowered(jvp_and_grad, *shapes)
    assert mosaic_kernels(text) == 2  # the forward of jvp and of grad
    assert set(re.findall(r'name = "(jaxforge_attention_\w+)"', text)) == {
        "jaxforge_attention_tangent", "jaxforge_attention_bwd_dq", "jaxforge_attention_bwd_dkv"}


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (256, 128)], ids=str)
def test_shared_memory_model_bounds_what_mosaic_allocates(dims, monkeypatch):
    """With the model's limit lifted, a ring too large for sm90 reaches Mosaic's own check, whose
    count the model must bound from above by at most its margin."""
    d, dv = dims
    stages = next(s for s in range(2, 16) if config.mosaic_smem(128, s, d, dv, 2) > config.MOSAIC_SMEM_BYTES)
    monkeypatch.setattr(config, "MOSAIC_SMEM_BYTES", 1 << 30)
    att = lambda q, k, v: jf.attention(q, k, v, implementation=Implementation(MOSAIC, block_kv=128, num_stages=stages))  # noqa: E731
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        lowered(att, (1, 128, 1, d), (1, 256, 1, d), (1, 256, 1, dv))
    allocated = int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1))
    assert allocated <= config.mosaic_smem(128, stages, d, dv, 2) <= allocated + config.MOSAIC_SMEM_MARGIN


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (256, 128)], ids=str)
def test_default_tiles_are_the_largest_that_fit(dims):
    block_kv, stages = config.mosaic_tiles(*dims, 2, Implementation(MOSAIC))
    fits = lambda block_kv: config.mosaic_smem(block_kv, stages, *dims, 2) <= config.MOSAIC_SMEM_BYTES  # noqa: E731
    assert stages == config.MOSAIC_STAGES and fits(block_kv)
    assert block_kv == (128 if fits(128) else 64)


def test_calls_it_cannot_run_are_refused_with_the_reason():
    shapes = ((1, 128, 2, 64), (1, 128, 2, 64), (1, 128, 2, 64))
    seg = jnp.zeros((1, 128), jnp.int32)
    document = lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.document(seg), implementation=MOSAIC)  # noqa: E731
    with pytest.raises(ValueError, match="pallas_mosaic_gpu.*elementwise functions of the indices"):
        lowered(document, *shapes)
    f32 = lambda q, k, v: jf.attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation=MOSAIC)  # noqa: E731
    with pytest.raises(ValueError, match="bfloat16 or float16.*float32"):
        lowered(f32, *shapes)
    with pytest.raises(ValueError, match="block_kv None, 64 or 128"):
        jf.attention(*(jnp.zeros(s, jnp.bfloat16) for s in shapes), implementation=Implementation(MOSAIC, block_kv=32))


def test_cpu_calls_are_a_clear_error():
    x = jnp.zeros((1, 8, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="pallas_mosaic_gpu' runs on a Hopper GPU only"):
        jf.attention(x, x, x, implementation=MOSAIC)


@pytest.mark.skipif(pallas_mosaic_gpu.mosaic_interpret_params() is None, reason="needs jax >= 0.11 (Mosaic GPU interpret mode)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_forward_matches_xla(case):
    """The kernel itself (not through the primitive, whose lowering cannot host the interpreter's
    callbacks): its threads, barriers, copies and wgmmas simulated on CPU."""
    (b, sq, skv, hq, hkv, d, dv), kw = CASES[case]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv)))
    mods, consts = attention_mods(kw.get("mask"), kw.get("score_mod"), kw.get("softcap"), (b,), sq, skv, jnp.float32)
    kernel = functools.partial(
        pallas_mosaic_gpu.attention_fwd_mosaic, mods=mods, scale=d**-0.5, implementation=Implementation(MOSAIC),
        interpret=True, batch_ids=jnp.arange(b, dtype=jnp.int32), head_offset=0,
    )
    out, lse = jax.jit(kernel)(q, k, v, *consts)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_out, ref_lse = jf.attention(*f32, implementation="xla", return_lse=True, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
