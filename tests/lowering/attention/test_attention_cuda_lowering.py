"""Which kernels a GPU would run, decided on CPU: the attention primitives lowered for cuda
(``jax.export`` with ``platforms=("cuda",)`` lowers the Pallas kernels to Triton IR here)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf

KERNELS = {"jaxforge_attention_fwd", "jaxforge_attention_tangent", "jaxforge_attention_bwd_dq", "jaxforge_attention_bwd_dkv"}
B, S, HQ, HKV, D = 2, 200, 4, 2, 64


def triton_kernels(mask_fn, implementation=None):
    """Names of the Pallas Triton kernels in the cuda lowering of forward, jvp and grad."""

    def f(q, k, v, seg):
        att = lambda q, k, v: jf.attention(q, k, v, mask=mask_fn(seg), implementation=implementation)
        _, tangent = jax.jvp(att, (q, k, v), (q, k, v))
        grads = jax.grad(lambda *a: jnp.sum(att(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
        return tangent, grads

    q = jax.ShapeDtypeStruct((B, S, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, HKV, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, S), jnp.int32)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[triton])(q, kv, kv, seg)
    return set(re.findall(r'name = "(jaxforge_attention_\w+)"', exported.mlir_module()))


@pytest.mark.parametrize(
    "mask_fn",
    [
        lambda seg: jf.masks.causal() & jf.masks.document(seg),
        lambda seg: ~jf.masks.document(seg) | jf.masks.sliding_window(16),
        lambda seg: jf.masks.document(seg, jnp.flip(seg, axis=-1)),
        lambda seg: jf.masks.prefix_lm(seg[:, 0] + 7),
    ],
    ids=["document_causal", "not_document_or_window", "cross_documents", "prefix_per_item"],
)
def test_runtime_data_masks_run_the_triton_kernels(mask_fn):
    """Segment ids and per-item prefix lengths are positional mask operands: each program slices a
    tile of them, no gather."""
    assert triton_kernels(mask_fn) == KERNELS


def test_masks_reading_a_table_at_traced_indices_fall_back_to_xla():
    table = jnp.asarray(np.random.default_rng(0).random((7, 5)) > 0.3)
    gathering = lambda seg: jf.masks.from_mask_mod(lambda b, h, i, j: table[i % 7, j % 5]) & jf.masks.document(seg)
    assert triton_kernels(gathering) == set()
    with pytest.raises(ValueError, match="pallas_triton"):
        triton_kernels(gathering, implementation="pallas_triton")


def triton_compiler_params(implementation):
    """``(kernel name, num_warps, num_stages)`` of each Triton kernel in the cuda lowering of grad and jvp."""
    q = jax.ShapeDtypeStruct((B, S, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, HKV, D), jnp.bfloat16)
    att = lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal(), implementation=implementation)
    f = lambda q, k, v: (jax.jvp(att, (q, k, v), (q, k, v))[1], jax.grad(lambda *a: jnp.sum(att(*a).astype(jnp.float32)), (0, 1, 2))(q, k, v))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[triton])(q, kv, kv).mlir_module()
    calls = re.findall(r'name = "(jaxforge_attention_\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    return {(name, int(warps), int(stages)) for name, stages, warps in calls}


def test_num_warps_and_num_stages_reach_every_triton_kernel():
    from jaxforge.lowering.attention.attention import config
    from jaxforge.lowering.attention.attention.pallas_triton import CALL_KERNELS

    tuned = jf.functional.attention.Implementation("pallas_triton", num_warps=8, num_stages=3)
    assert triton_compiler_params(tuned) == {(name, 8, 3) for name in KERNELS}
    calls = {"fwd": CALL_KERNELS["fwd"], "tangent": CALL_KERNELS["tangent"], "bwd_dq": CALL_KERNELS["bwd"], "bwd_dkv": CALL_KERNELS["bwd"]}
    default = jf.functional.attention.Implementation()
    expected = {(f"jaxforge_attention_{k}", *config.triton_compiler(default, calls[k], D)) for k in calls}
    assert triton_compiler_params(None) == expected
    assert ("jaxforge_attention_fwd", 4, 3) in expected  # config.TRITON_TUNED at D = 64


def test_calls_whose_tiles_fit_no_shared_memory_of_the_gpu_take_xla(monkeypatch):
    # An sm86 block has 99 KiB: the float32 tangent at head dim 256 fits no tiles there (it does on
    # an H200), so the default lowers it with XLA, and asking for Triton says why.
    from jaxforge.lowering import build

    monkeypatch.setattr(build, "gpu_arch", lambda: "sm_86")

    def kernels(d, dtype, implementation=None):
        q = jax.ShapeDtypeStruct((1, 64, 2, d), dtype)
        att = lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal(), implementation=implementation)
        f = jax.jit(lambda q, k, v: jax.jvp(att, (q, k, v), (q, k, v)))
        triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        text = jax.export.export(f, platforms=("cuda",), disabled_checks=[triton])(q, q, q).mlir_module()
        return set(re.findall(r'name = "(jaxforge_attention_\w+)"', text))

    assert kernels(256, jnp.float32) == {"jaxforge_attention_fwd"}  # the tangent runs XLA's tiles
    assert kernels(64, jnp.float32) == {"jaxforge_attention_fwd", "jaxforge_attention_tangent"}
    with pytest.raises(ValueError, match="no Triton tiles fit 94208 bytes of shared memory \\(sm_86\\)"):
        kernels(256, jnp.float32, implementation="pallas_triton")
    monkeypatch.setattr(build, "gpu_arch", lambda: "sm_90a")
    assert kernels(256, jnp.float32) == {"jaxforge_attention_fwd", "jaxforge_attention_tangent"}
