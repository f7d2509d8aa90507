"""Which kernels a GPU would run, decided on CPU: the attention primitives lowered for cuda
(``jax.export`` with ``platforms=("cuda",)`` lowers the Pallas kernels to Triton IR here)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.lowering.attention.attention import config

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
        lambda seg: jf.masks.padding(seg[:, 0] + 150, seg[:, 1] + 90) & jf.masks.causal(),
        lambda seg: jf.masks.causal(seg[:, 0] - 3),
    ],
    ids=["document_causal", "not_document_or_window", "cross_documents", "prefix_per_item", "padding_per_item", "causal_per_item"],
)
def test_runtime_data_masks_run_the_triton_kernels(mask_fn):
    """Segment ids and per-item prefix lengths are positional mask operands: each program slices a
    tile of them, no gather."""
    assert triton_kernels(mask_fn) == KERNELS


def test_document_masks_hand_the_triton_kernels_tile_bounds_not_whole_span_arrays():
    """The segment ids' per-position ranges (the span's arrays, O(S) each) are reduced to a row of
    tile bounds per program before the call: a program reads four integers, not a sequence."""
    q = jax.ShapeDtypeStruct((1, 3000, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 3000), jnp.int32)
    f = lambda q, k, v, seg: jf.attention(q, k, v, mask=jf.masks.document(seg) & jf.masks.causal())
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[triton])(q, q, q, seg).mlir_module()
    (operands,) = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*?\) \{.*?\} : \((.*?)\) ->", text)
    from jaxforge.lowering.attention.attention.pallas_triton import _geometry

    geo, *_ = _geometry("fwd", q, q, q, 1.0, jf.functional.attention.Implementation())
    padded = geo.num_q_tiles * geo.block_q, geo.num_kv_tiles * geo.block_kv
    table = f"1x{geo.num_q_tiles}x4"  # the forward's query programs; the backward's dkv also has one per key tile
    assert re.findall(r"tensor<([\dx]+)xi32>", operands) == ["2", f"1x{padded[0]}", f"1x{padded[1]}", table]


def test_decoding_packs_gqa_heads_and_splits_keys_in_the_triton_forward_once_validated(monkeypatch):
    """One decoding step over KV caches of 65536 (GQA 4:1, the caches' fill levels runtime data):
    the forward's, the tangent's and the backward dq's grids are (items, key/value heads, splits) —
    each program a tile of its group's packed query heads and 1/17 of the keys (2 x 8 programs
    would leave an H200's 132 SMs idle); the dk/dv kernel's, a program per key tile — and the
    default runs them once config.TRITON_DECODING_VALIDATED."""

    def grids(implementation=None):
        q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((2, 65536, 8, 128), jnp.bfloat16)
        lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
        mask = lambda n: jf.masks.causal(n - 1) & jf.masks.padding(n)  # noqa: E731
        att = lambda q, k, v, n: jf.attention(q, k, v, mask=mask(n), implementation=implementation)  # noqa: E731
        jvp = lambda q, k, v, n: jax.jvp(lambda q: att(q, k, v, n), (q,), (q,))  # noqa: E731
        grad = jax.grad(lambda q, k, v, n: jnp.sum(att(q, k, v, n).astype(jnp.float32)), (0, 1, 2))
        f = lambda *a: (jvp(*a), grad(*a))  # noqa: E731
        triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        text = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[triton])(q, kv, kv, lengths).mlir_module()
        return [tuple(map(int, g)) for g in re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)]

    # the forward (jvp's and grad's), the tangent and dq, then dk/dv (a program per key tile)
    split, whole = [(2, 8, 17)] * 4, [(2, 32, 1)] * 4
    got = grids("pallas_triton")
    assert len(got) == 5 and got[:4] == split and got[4][:2] == (2, 8)
    assert grids(jf.functional.attention.Implementation("pallas_triton", pack_gqa=False, kv_splits=1))[:4] == whole
    assert grids() == whole[:3]  # the forwards and the tangent; the backward in XLA's tiles (below)
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    assert grids()[:4] == split


def test_an_unpacked_decoding_backward_runs_xla_until_a_gpu_clears_its_dv(monkeypatch):
    """config.TRITON_UNPACKED_DECODING_BWD_VALIDATED: a decoding step's backward that the default
    would run in unpacked Triton tiles (one query a head, GQA 8:2) takes XLA's tiles, its forward
    Triton's; a call naming "pallas_triton", a longer query sequence, the flag, or the packed
    kernels once validated run the Triton backward."""

    def kernels(sq, implementation=None):
        q, kv = jax.ShapeDtypeStruct((2, sq, 8, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.bfloat16)
        grad = jax.grad(lambda *a: jnp.sum(jf.attention(*a, implementation=implementation).astype(jnp.float32)), (0, 1, 2))
        triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        text = jax.export.export(jax.jit(grad), platforms=("cuda",), disabled_checks=[triton])(q, kv, kv).mlir_module()
        return set(re.findall(r'name = "(jaxforge_attention_\w+)"', text))

    backward = {"jaxforge_attention_bwd_dq", "jaxforge_attention_bwd_dkv"}
    assert kernels(1) == {"jaxforge_attention_fwd"}
    assert kernels(1, jf.functional.attention.Implementation("pallas_triton", pack_gqa=False)) == {"jaxforge_attention_fwd", *backward}
    assert kernels(16) == {"jaxforge_attention_fwd", *backward}
    monkeypatch.setattr(config, "TRITON_UNPACKED_DECODING_BWD_VALIDATED", True)
    assert kernels(1) == {"jaxforge_attention_fwd", *backward}
    monkeypatch.setattr(config, "TRITON_UNPACKED_DECODING_BWD_VALIDATED", False)
    monkeypatch.setattr(config, "TRITON_DECODING_VALIDATED", True)
    assert kernels(1) == {"jaxforge_attention_fwd", *backward}


def test_masks_reading_captured_arrays_at_points_run_the_triton_kernels_once_validated(monkeypatch):
    table = jnp.asarray(np.random.default_rng(0).random((7, 5)) > 0.3)
    reading = lambda seg: jf.masks.from_mask_mod(lambda b, h, i, j: table[i % 7, j % 5]) & jf.masks.document(seg)
    assert triton_kernels(reading, implementation="pallas_triton") == KERNELS
    assert triton_kernels(reading) == KERNELS  # config.TRITON_POINT_READS_VALIDATED (H200, 2026-12-04)
    monkeypatch.setattr(config, "TRITON_POINT_READS_VALIDATED", False)
    assert triton_kernels(reading) == set()  # XLA's tiles until a GPU validates them
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    assert triton_kernels(reading) == KERNELS


def score_kernels(score_mod, argnums=(0, 1, 2), implementation=None):
    """Kernels in the cuda lowering of forward, jvp and grad (by ``argnums`` of (q, k, v, bias))
    of attention with ``score_mod(bias)``, the bias a (heads, 2 S) array."""

    def f(q, k, v, bias):
        att = lambda q, k, v, bias: jf.attention(q, k, v, score_mod=score_mod(bias), implementation=implementation)
        _, tangent = jax.jvp(att, (q, k, v, bias), (q, k, v, bias))
        return tangent, jax.grad(lambda *a: jnp.sum(att(*a).astype(jnp.float32)), argnums)(q, k, v, bias)

    q = jax.ShapeDtypeStruct((B, S, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, HKV, D), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((HQ, 2 * S), jnp.float32)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[triton])(q, kv, kv, bias)
    return set(re.findall(r'name = "(jaxforge_attention_\w+)"', exported.mlir_module()))


def alibi_and_bias(bias):
    return lambda s, b, h, i, j: s + bias[h][i - j + S] + bias[h, 0] * (j - i)  # a row, a point


def test_a_captured_bias_read_at_points_and_its_gradient_run_the_triton_kernels():
    triton = dict(implementation="pallas_triton")
    assert score_kernels(alibi_and_bias, **triton) == KERNELS
    assert score_kernels(alibi_and_bias, argnums=(0, 1, 2, 3), **triton) == KERNELS  # the dq kernel sums the bias's
    only_bias = score_kernels(alibi_and_bias, argnums=(3,), **triton)
    assert only_bias == {"jaxforge_attention_fwd", "jaxforge_attention_tangent", "jaxforge_attention_bwd_dq"}


@pytest.mark.parametrize(
    "flags, asked",
    [
        ("", False),
        ("--xla_gpu_deterministic_ops", True),
        ("--xla_gpu_deterministic_ops=true", True),
        ("--xla_gpu_deterministic_ops=1", True),
        ("--xla_gpu_deterministic_ops=false", False),
        ("--xla_backend_optimization_level=0 --xla_gpu_exclude_nondeterministic_ops=True", True),
        ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
        ("--xla_gpu_deterministic_ops_of_another_kind=true", False),
    ],
)
def test_xla_flags_asking_for_determinism_are_read_as_xla_reads_them(monkeypatch, flags, asked):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert config.deterministic() is asked


@pytest.mark.parametrize("implementation", [None, "pallas_triton"])
def test_a_captured_arrays_gradient_runs_xla_tiles_where_xla_is_asked_for_determinism(monkeypatch, implementation):
    """The dq kernel's atomic adds would sum the bias's cotangent in any order: with XLA's
    determinism flag that backward runs XLA's tiles (whose scatter XLA then orders), by name too;
    the backward of q, k and v alone (no atomics) stays in Triton."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    forward_and_tangent = {"jaxforge_attention_fwd", "jaxforge_attention_tangent"}
    assert score_kernels(alibi_and_bias, argnums=(0, 1, 2, 3), implementation=implementation) == forward_and_tangent
    assert score_kernels(alibi_and_bias, argnums=(3,), implementation=implementation) == forward_and_tangent
    assert score_kernels(alibi_and_bias, implementation=implementation) == KERNELS
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert score_kernels(alibi_and_bias, argnums=(0, 1, 2, 3), implementation=implementation) == KERNELS


def test_score_mods_gathering_from_captured_arrays_fall_back_to_xla():
    fill = lambda bias: lambda s, b, h, i, j: s + jnp.take(bias[h], i - j, mode="fill", fill_value=0.0)
    assert score_kernels(fill) == set()
    with pytest.raises(ValueError, match="pallas_triton"):
        score_kernels(fill, implementation="pallas_triton")


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


@pytest.mark.parametrize("implementation,validated,kernels", [("pallas_triton", False, True), (None, False, False), (None, True, True)])
def test_a_gradient_through_a_jvp_runs_the_tangent_bwd_kernels_by_name_or_once_validated(monkeypatch, implementation, validated, kernels):
    monkeypatch.setattr(config, "TRITON_TANGENT_BWD_VALIDATED", validated)

    def f(q, k, v, dq, dk, dv):
        att = lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal(), implementation=implementation)
        return jax.grad(lambda *a: jnp.sum(jnp.sin(jax.jvp(att, a[:3], a[3:])[1].astype(jnp.float32))), tuple(range(6)))(q, k, v, dq, dk, dv)

    q = jax.ShapeDtypeStruct((B, S, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, HKV, D), jnp.bfloat16)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[triton])(q, kv, kv, q, kv, kv)
    names = set(re.findall(r'name = "(jaxforge_attention_\w+)"', exported.mlir_module()))
    assert ({"jaxforge_attention_tangent_bwd_rows", "jaxforge_attention_tangent_bwd_cols"} <= names) == kernels
    assert "jaxforge_attention_bwd_dkv" in names  # the transpose in dq, dk, dv: the backward's kernels


def max_scores_kernels(implementation=None):
    """Kernels in the cuda lowering of forward, jvp and grad of attention with ``return_max_scores``."""

    def f(q, k, v, seg):
        att = lambda q, k, v: jf.attention(  # noqa: E731
            q, k, v, mask=jf.masks.causal() & jf.masks.document(seg), return_max_scores=True, implementation=implementation
        )
        _, tangent = jax.jvp(att, (q, k, v), (q, k, v))
        def loss(*a):  # one call: one whose maxima nothing reads binds a forward without them
            out, top = att(*a)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(top), top, 0))

        return tangent, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q = jax.ShapeDtypeStruct((B, S, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, HKV, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, S), jnp.int32)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[triton])(q, kv, kv, seg).mlir_module()
    return set(re.findall(r'name = "(jaxforge_attention_\w+)"', text))


def test_max_scores_run_in_the_triton_forward_once_validated(monkeypatch):
    """``return_max_scores``: the forward kernel writes each row's maximum and the first key at it
    (split-KV's splits merged after the call), lowered to Triton IR by name (packed and split too);
    the default runs XLA's tiles for that forward until config.TRITON_MAX_SCORES_VALIDATED, the
    tangent and backward kernels as ever (the maxima's derivative is a gather beside them)."""
    assert max_scores_kernels("pallas_triton") == KERNELS
    packed_split = jf.functional.attention.Implementation("pallas_triton", pack_gqa=True, kv_splits=2)
    assert max_scores_kernels(packed_split) == KERNELS
    assert max_scores_kernels() == KERNELS - {"jaxforge_attention_fwd"}
    monkeypatch.setenv("JAXFORGE_UNVALIDATED_KERNELS", "1")
    assert max_scores_kernels() == KERNELS
