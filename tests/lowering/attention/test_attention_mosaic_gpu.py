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
from jaxforge.lowering.attention.attention import config, pallas_mosaic_gpu, pallas_mosaic_gpu_bwd, pallas_mosaic_gpu_tangent, xla
from jaxforge.lowering.attention.attention.kernel import Geometry

MOSAIC = "pallas_mosaic_gpu"
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def lowered(f, *shapes):
    """The cuda lowering's StableHLO text of ``f`` at ``shapes`` (bfloat16)."""
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    return jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[TRITON])(*args).mlir_module()


def mosaic_kernels(text: str) -> int:
    return len(re.findall(r"custom_call @mosaic_gpu", text))


def _documents(*lengths_and_ids):
    """Segment ids of contiguous documents, one row per batch item: ``[(length, id), ...]``."""
    return np.stack([np.concatenate([np.full(n, i, np.int32) for n, i in item]) for item in lengths_and_ids])


_DOCS = _documents([(70, 0), (130, 1), (100, 2)], [(150, 5), (10, 7), (140, 6)])
_Q_DOCS, _KV_DOCS = _documents([(90, 1), (110, 2)], [(200, 4)]), _documents([(60, 2), (200, 1)], [(130, 4), (130, 3)])

CASES = {  # (b, sq, skv, hq, hkv, d, dv), attention keywords
    "d64_window_alibi": ((2, 300, 257, 4, 2, 64, 64), dict(
        mask=jf.masks.causal() & jf.masks.sliding_window(100), score_mod=lambda s, b, h, i, j: s - 0.1 * (h + 1) * (i - j))),
    "d128_plain": ((1, 256, 256, 2, 2, 128, 128), {}),
    "mla_192_128_causal_softcap": ((1, 256, 512, 2, 2, 192, 128), dict(mask=jf.masks.causal(), softcap=20.0)),
    "d256_gqa_causal": ((1, 256, 256, 4, 1, 256, 256), dict(mask=jf.masks.causal())),
    "odd_dims_chunked_or_prefix": ((2, 37, 53, 2, 1, 80, 72), dict(mask=jf.masks.chunked(16) | jf.masks.prefix_lm(5))),
    "fully_masked_rows": ((1, 200, 200, 2, 2, 64, 64), dict(mask=jf.masks.causal(-70))),  # rows < 70 see no key
    # Runtime data: segment ids (positional values at the queries and at the keys) and per-item
    # prefix and padding lengths; tiles are skipped by the span's arrays (program_table).
    "document_causal_gqa": ((2, 300, 300, 4, 2, 64, 64), dict(mask=jf.masks.causal() & jf.masks.document(_DOCS))),
    "document_cross_or_prefix": ((2, 200, 260, 2, 1, 128, 128), dict(
        mask=jf.masks.document(_Q_DOCS, _KV_DOCS) | jf.masks.prefix_lm(np.array([3, 40], np.int32)))),
    "padding_causal": ((2, 200, 200, 2, 2, 64, 64), dict(
        mask=jf.masks.padding(np.array([200, 77], np.int32), np.array([130, 200], np.int32)) & jf.masks.causal())),
    "window_or_chunk_per_item": ((2, 300, 257, 4, 2, 64, 64), dict(
        mask=jf.masks.sliding_window(np.array([100, 37], np.int32)) & jf.masks.causal() | jf.masks.chunked(np.array([64, 48], np.int32)))),
    # a plain function of the indices and the head, its spans evaluated (jf.masks.block_mask)
    "block_mask_frames_per_head": ((2, 300, 257, 4, 2, 64, 64), dict(mask=jf.masks.block_mask(
        lambda b, h, i, j: (i // 64 >= j // 64) & (j > i - 100 * (h + 1)), 300, 257, num_heads=4))),
    # attention sinks and a window, in two pieces (two calls a primitive, each its range's bounds as positional values)
    "block_mask_pieces_sinks_window": ((1, 300, 300, 2, 2, 64, 64), dict(mask=jf.masks.block_mask(
        lambda b, h, i, j: (j < 4) | ((j <= i) & (j > i - 64)), 300, 300, ranges=2))),
}


_DOCUMENT_256 = jf.masks.document(np.repeat(np.arange(4, dtype=np.int32), 64)[None])
_MASKS = {"no_mask": None, "document": _DOCUMENT_256}


def _shapes(case):
    (b, sq, skv, hq, hkv, d, dv), kw = CASES[case]
    return ((b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv)), kw


def _mosaic_runs(case) -> tuple[bool, bool]:
    """Whether the Mosaic GPU tangent and backward take the case (their head dims)."""
    shapes, kw = _shapes(case)
    mods, _ = attention_mods(kw.get("mask"), kw.get("score_mod"), kw.get("softcap"), shapes[0][:1], shapes[0][1], shapes[1][1], jnp.float32)
    q, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (shapes[0], shapes[2]))
    tangent = pallas_mosaic_gpu_tangent.mosaic_tangent_can_run(mods, q, v) is None
    return tangent, pallas_mosaic_gpu_bwd.mosaic_bwd_can_run(mods, q, v, ()) is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_primitive_lowers_to_mosaic_kernels_where_they_can_run(case):
    """The forward is one Mosaic GPU kernel; the tangent one and the backward two (dq, dkv) where
    their head dims fit, else Triton's; each once for each piece of a mask (block_mask's ranges)."""
    shapes, kw = _shapes(case)
    att = lambda q, k, v: jf.attention(q, k, v, implementation=MOSAIC, **kw)  # noqa: E731
    calls = len(kw["mask"].pieces()) if "mask" in kw else 1
    assert mosaic_kernels(lowered(att, *shapes)) == calls

    def jvp_and_grad(q, k, v):
        _, tangent = jax.jvp(att, (q, k, v), (q, k, v))
        return tangent, jax.grad(lambda *a: jnp.sum(att(*a).astype(jnp.float32)), (0, 1, 2))(q, k, v)

    text = lowered(jvp_and_grad, *shapes)
    tangent, bwd = _mosaic_runs(case)
    assert mosaic_kernels(text) == calls * (2 + tangent + 2 * bwd)  # the forward of jvp and of grad, the tangent, dq and dkv
    triton = set() if tangent else {"jaxforge_attention_tangent"}
    triton |= set() if bwd else {"jaxforge_attention_bwd_dq", "jaxforge_attention_bwd_dkv"}
    assert set(re.findall(r'name = "(jaxforge_attention_\w+)"', text)) == triton


def test_the_sm90_default_is_mosaic_but_for_decoding(monkeypatch):
    """On Hopper the default runs the validated Mosaic GPU kernels (forward, tangent, dq and dkv),
    but a decoding step (fewer queries a head than Triton's 16-row tile) keeps Triton's kernels
    (its backward XLA's tiles until config.TRITON_UNPACKED_DECODING_BWD_VALIDATED), as does any
    other GPU."""
    from jaxforge.lowering import build

    def kernels(sq, arch):
        monkeypatch.setattr(build, "gpu_arch", lambda: arch)
        att = lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal(256 - sq))  # noqa: E731
        f = lambda q, k, v: (jax.jvp(att, (q, k, v), (q, k, v)), jax.grad(lambda *a: jnp.sum(att(*a).astype(jnp.float32)), (0, 1, 2))(q, k, v))
        text = lowered(f, (2, sq, 4, 64), (2, 256, 2, 64), (2, 256, 2, 64))
        return mosaic_kernels(text), set(re.findall(r'name = "jaxforge_attention_(\w+)"', text))

    assert kernels(256, "sm_90a") == (5, set())  # two forwards (jvp's, grad's), the tangent, dq, dkv
    assert kernels(1, "sm_90a") == (0, {"fwd", "tangent"})
    assert kernels(256, "sm_80") == (0, {"fwd", "tangent", "bwd_dq", "bwd_dkv"})


def _row_outputs(text: str) -> list[int]:
    """How many float32 rows (lse, maxima) each Mosaic GPU kernel of ``text`` returns."""
    results = re.findall(r"custom_call @mosaic_gpu.* -> (\(.*?\)|tensor<[^>]*>) loc", text)
    return [len(re.findall(r"tensor<[\dx]+xf32>", r)) for r in results]


def test_the_forward_writes_the_max_scores_but_not_their_first_keys(monkeypatch):
    """return_max_scores: the forward kernel writes each row's maximum beside its lse, for a
    forward and for QK-clip's step (a gradient, the maxima aside); a derivative of the maxima
    needs the first key attaining each, which it does not find: by name a clear error, by default
    Triton's forward (XLA's until config.TRITON_MAX_SCORES_VALIDATED). The sm90 default takes it
    once config.MOSAIC_MAX_SCORES_VALIDATED."""
    from jaxforge.lowering import build

    shapes = (2, 300, 4, 64), (2, 300, 2, 64), (2, 300, 2, 64)

    def programs(implementation):
        att = lambda q, k, v: jf.attention(q, k, v, mask=jf.masks.causal(), return_max_scores=True, implementation=implementation)  # noqa: E731

        def clip_loss(q, k, v):
            out, top = att(q, k, v)
            return jnp.sum(out.astype(jnp.float32)), top

        clip_step = jax.grad(clip_loss, (0, 1, 2), has_aux=True)

        of_maxima = jax.grad(lambda *a: jnp.sum(jnp.where(jnp.isfinite(t := att(*a)[1]), t, 0)), (0, 1))
        return att, clip_step, of_maxima

    att, clip_step, of_maxima = programs(MOSAIC)
    assert _row_outputs(lowered(att, *shapes)) == [2]
    assert _row_outputs(lowered(lambda *a: att(*a)[0], *shapes)) == [1]  # maxima unused: not written
    assert sorted(_row_outputs(lowered(clip_step, *shapes))) == [0, 0, 2]  # dq and dkv write no rows
    with pytest.raises(ValueError, match=r"cannot run this call: it does not find the first key attaining each row's maximum"):
        lowered(of_maxima, *shapes)

    monkeypatch.setattr(build, "gpu_arch", lambda: "sm_90a")
    triton_forward = lambda text: 'name = "jaxforge_attention_fwd"' in text  # noqa: E731  (the kernel's)
    att, _, _ = programs(None)  # new functions after each patch: jit caches the lowering of a function
    assert _row_outputs(text := lowered(att, *shapes)) == [] and not triton_forward(text)  # XLA's tiles
    monkeypatch.setattr(config, "MOSAIC_MAX_SCORES_VALIDATED", True)
    att, clip_step, of_maxima = programs(None)
    assert _row_outputs(lowered(att, *shapes)) == [2]
    assert sorted(_row_outputs(lowered(clip_step, *shapes))) == [0, 0, 2]
    text = lowered(of_maxima, *shapes)  # the first keys: XLA's tiles, Triton's once validated
    assert mosaic_kernels(text) == 0 and not triton_forward(text)  # (the maxima's derivative is a gather)
    monkeypatch.setattr(config, "TRITON_MAX_SCORES_VALIDATED", True)
    _, _, of_maxima = programs(None)
    assert triton_forward(lowered(of_maxima, *shapes))


def test_backward_head_dims_are_capped_with_the_reason():
    mods, _ = attention_mods(None, None, None, (1,), 128, 128, jnp.float32)
    arg = lambda d: jax.ShapeDtypeStruct((1, 128, 1, d), jnp.bfloat16)  # noqa: E731
    assert pallas_mosaic_gpu_bwd.mosaic_bwd_can_run(mods, arg(80), arg(72), ()) is None  # 128 + 128 after padding
    assert "192 + 128 (padded) exceed 256" in pallas_mosaic_gpu_bwd.mosaic_bwd_can_run(mods, arg(192), arg(128), ())
    assert "cotangent" in pallas_mosaic_gpu_bwd.mosaic_bwd_can_run(mods, arg(64), arg(64), (True,))


@pytest.mark.parametrize("mask", ["no_mask", "document"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (256, 128)], ids=str)
def test_shared_memory_model_bounds_what_mosaic_allocates(dims, mask, monkeypatch):
    """With the model's limit lifted, a ring too large for sm90 reaches Mosaic's own check, whose
    count the model must bound from above by at most its margin."""
    d, dv = dims
    values = (0, 0) if _MASKS[mask] is None else (1, 1)
    model = lambda s: config.mosaic_smem(128, s, d, dv, 2, values)  # noqa: E731
    stages = next(s for s in range(2, 16) if model(s) > config.MOSAIC_SMEM_BYTES)
    monkeypatch.setattr(config, "MOSAIC_SMEM_BYTES", 1 << 30)
    impl = Implementation(MOSAIC, block_kv=128, num_stages=stages)
    att = lambda q, k, v: jf.attention(q, k, v, mask=_MASKS[mask], implementation=impl)  # noqa: E731
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        lowered(att, (1, 256, 1, d), (1, 256, 1, d), (1, 256, 1, dv))
    allocated = int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1))
    assert allocated <= model(stages) <= allocated + config.MOSAIC_SMEM_MARGIN


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (256, 128)], ids=str)
def test_default_tiles_are_the_largest_that_fit(dims):
    block_kv, stages = config.mosaic_tiles(*dims, 2, Implementation(MOSAIC))
    fits = lambda block_kv: config.mosaic_smem(block_kv, stages, *dims, 2) <= config.MOSAIC_SMEM_BYTES  # noqa: E731
    assert stages == config.MOSAIC_STAGES and fits(block_kv)
    assert block_kv == (128 if fits(128) else 64)


def _lowered_bwd_kernel(kernel: str, d: int, dv: int, block: int, stages: int, mask=None):
    """One backward kernel alone (pallas_mosaic_gpu_bwd._dq or _dkv) lowered for cuda, s = 256."""
    s = 256
    mods, consts = attention_mods(mask, None, None, (1,), s, s, jnp.float32)
    rows = (128, block) if kernel == "dq" else (block, 128)
    geo = Geometry(s, s, *rows, 1, 1.0, jnp.dtype(jnp.float32), None)
    batch_ids = jnp.zeros((1,), jnp.int32)
    arrays = pallas_mosaic_gpu.mask_arrays(mods, consts, batch_ids, s, s)
    run = getattr(pallas_mosaic_gpu_bwd, f"_{kernel}")
    f = functools.partial(run, geo=geo, mods=mods, scale=1.0, interpret=False, block=block, stages=stages, arrays=arrays, ids=(batch_ids, 0))
    seq = lambda width: jax.ShapeDtypeStruct((1, s, 1, width), jnp.bfloat16)  # noqa: E731
    stats = jax.ShapeDtypeStruct((1, 1, 2, s), jnp.float32)
    args = (seq(d), seq(dv), stats, seq(d), seq(dv)) if kernel == "dq" else (seq(d), seq(dv), seq(d), seq(dv), stats)
    return jax.export.export(jax.jit(f), platforms=("cuda",))(*args).mlir_module()


@pytest.mark.parametrize("mask", sorted(_MASKS))
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (64, 192)], ids=str)
@pytest.mark.parametrize("kernel", ["dq", "dkv"])
def test_backward_shared_memory_model_bounds_what_mosaic_allocates(kernel, dims, mask):
    """Each backward kernel at its default tiles lowers; with a ring too large for sm90 Mosaic's own
    check fails, and its count must be bounded from above by the model, by at most its margin
    (with a document mask's positional values too)."""
    d, dv = dims
    values = (0, 0) if _MASKS[mask] is None else (1, 1)
    block, stages = config.mosaic_bwd_tiles(d, dv, 2, Implementation(MOSAIC), values)
    assert mosaic_kernels(_lowered_bwd_kernel(kernel, d, dv, block, stages, _MASKS[mask])) == 1
    model = lambda s: config.mosaic_bwd_smem(kernel, 128, s, d, dv, 2, values)  # noqa: E731
    stages = next(s for s in range(2, 32) if model(s) - config.MOSAIC_SMEM_MARGIN > config.MOSAIC_SMEM_BYTES)
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        _lowered_bwd_kernel(kernel, d, dv, 128, stages, _MASKS[mask])
    allocated = int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1))
    assert allocated <= model(stages) <= allocated + config.MOSAIC_SMEM_MARGIN


def test_backward_tiles_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="Mosaic GPU backward needs .* bytes of shared memory for head dims 128/128"):
        config.mosaic_bwd_tiles(128, 128, 2, Implementation(MOSAIC, block_kv=128, num_stages=4))


@pytest.mark.parametrize("mask", ["no_mask", "document"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (64, 192)], ids=str)
def test_tangent_shared_memory_model_bounds_what_mosaic_allocates(dims, mask, monkeypatch):
    d, dv = dims
    values = (0, 0) if _MASKS[mask] is None else (1, 1)
    model = lambda s: config.mosaic_tangent_smem(128, s, d, dv, 2, values)  # noqa: E731
    stages = next(s for s in range(2, 32) if model(s) - config.MOSAIC_SMEM_MARGIN > config.MOSAIC_SMEM_BYTES)
    monkeypatch.setattr(config, "MOSAIC_SMEM_BYTES", 1 << 30)
    mods, consts = attention_mods(_MASKS[mask], None, None, (1,), 256, 256, jnp.float32)
    impl = Implementation(MOSAIC, block_kv=128, num_stages=stages)
    tangent = functools.partial(
        pallas_mosaic_gpu_tangent.attention_tangent_mosaic, mods=mods, scale=1.0, implementation=impl,
        interpret=False, batch_ids=jnp.zeros((1,), jnp.int32), head_offset=0,
    )  # fmt: skip
    seq = lambda width: jax.ShapeDtypeStruct((1, 256, 1, width), jnp.bfloat16)  # noqa: E731
    args = (seq(d), seq(d), seq(dv), seq(dv), jax.ShapeDtypeStruct((1, 256, 1), jnp.float32))
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        jax.export.export(jax.jit(lambda *a: tangent(*a[:5], *consts, *a[5:])), platforms=("cuda",))(*args, seq(d), seq(d), seq(dv))
    allocated = int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1))
    assert allocated <= model(stages) <= allocated + config.MOSAIC_SMEM_MARGIN


def test_default_tangent_and_backward_tiles_fit_every_head_dims_they_take():
    mods, _ = attention_mods(None, None, None, (1,), 128, 128, jnp.float32)
    arg = lambda d: jax.ShapeDtypeStruct((1, 128, 1, d), jnp.bfloat16)  # noqa: E731
    for d, dv in ((64, 64), (128, 128), (64, 192), (192, 64), (80, 72)):
        if pallas_mosaic_gpu_tangent.mosaic_tangent_can_run(mods, arg(d), arg(dv)) is None:
            config.mosaic_tangent_tiles(-(-d // 64) * 64, -(-dv // 64) * 64, 2, Implementation(MOSAIC))
        config.mosaic_bwd_tiles(-(-d // 64) * 64, -(-dv // 64) * 64, 2, Implementation(MOSAIC))
    assert "d <= 128" in pallas_mosaic_gpu_tangent.mosaic_tangent_can_run(mods, arg(192), arg(64))


def test_calls_it_cannot_run_are_refused_with_the_reason():
    shapes = ((1, 128, 2, 64), (1, 128, 2, 64), (1, 128, 2, 64))
    factor = jnp.asarray(0.5)
    scaled = lambda q, k, v: jf.attention(q, k, v, score_mod=lambda s, *_: s * factor, implementation=MOSAIC)  # noqa: E731
    with pytest.raises(ValueError, match="pallas_mosaic_gpu.*reads captured arrays"):
        lowered(scaled, *shapes)
    mods, consts = attention_mods(_DOCUMENT_256, None, None, (1,), 256, 256, jnp.float32)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    floats = [c.astype(jnp.float32) for c in consts]
    assert "positional arrays must be integers of up to 32 bits, got float32" in pallas_mosaic_gpu.mosaic_can_run(mods, q, q, floats)
    f32 = lambda q, k, v: jf.attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation=MOSAIC)  # noqa: E731
    with pytest.raises(ValueError, match="bfloat16 or float16.*float32"):
        lowered(f32, *shapes)
    for dims in ((0, 64), (64, 0), (64, 320)):  # no features: the Triton kernels' padding takes them
        q, v = (jax.ShapeDtypeStruct((1, 128, 2, d), jnp.bfloat16) for d in dims)
        assert f"head dims from 1 to 256, got {dims[0]} and {dims[1]}" in pallas_mosaic_gpu.mosaic_can_run(mods, q, v)
    with pytest.raises(ValueError, match="block_kv None, 64 or 128"):
        jf.attention(*(jnp.zeros(s, jnp.bfloat16) for s in shapes), implementation=Implementation(MOSAIC, block_kv=32))


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.int8])
def test_document_ids_of_any_integer_type_reach_the_kernels_as_int32(dtype):
    """64-bit ids (jax_enable_x64) and uint32 become their ranks, the rest stay: Mosaic takes them."""
    ids = np.array([[3, 3, 2**31 + 5, 2**31 + 5, 7, 7, 7, 3]], np.int64).astype(dtype)
    kv_ids = np.array([[7, 2**31 + 5, 3, 9]], np.int64).astype(dtype)
    mask = jf.masks.document(ids, kv_ids)
    mods, consts = attention_mods(mask, None, None, (1,), 8, 4, jnp.float32)
    q_seg, kv_seg = consts[: mods.mask_rows + mods.mask_cols]
    assert jnp.dtype(q_seg.dtype).itemsize <= 4 and jnp.issubdtype(q_seg.dtype, jnp.integer) and q_seg.dtype != jnp.uint32
    np.testing.assert_array_equal(q_seg[0][:, None] == kv_seg[0][None, :], ids[0][:, None] == kv_ids[0][None, :])
    att = lambda q, k, v: jf.attention(q, k, v, mask=mask, implementation=MOSAIC)  # noqa: E731
    assert mosaic_kernels(lowered(att, (1, 8, 1, 64), (1, 4, 1, 64), (1, 4, 1, 64))) == 1


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
    out, lse, top = jax.jit(functools.partial(kernel, max_scores=True))(q, k, v, *consts)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_out, ref_lse, ref_top = jf.attention(*f32, implementation="xla", return_lse=True, return_max_scores=True, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(top, ref_top, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(pallas_mosaic_gpu.mosaic_interpret_params() is None, reason="needs jax >= 0.11 (Mosaic GPU interpret mode)")
@pytest.mark.parametrize("case", sorted(c for c in CASES if _mosaic_runs(c)[1]))
def test_interpreted_backward_matches_xla(case):
    """Both backward kernels interpreted on CPU against the XLA backward in float32, with a
    cotangent for lse too (rows that see no key get none: their lse is -inf)."""
    shapes, kw = _shapes(case)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out, lse = jf.attention(*f32, implementation="xla", return_lse=True, **kw)
    g_out = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
    g_lse = jnp.where(jnp.isfinite(lse), jnp.asarray(rng.standard_normal(lse.shape), jnp.float32), 0.0)
    b, sq, skv = shapes[0][0], shapes[0][1], shapes[1][1]
    mods, consts = attention_mods(kw.get("mask"), kw.get("score_mod"), kw.get("softcap"), (b,), sq, skv, jnp.float32)
    params = dict(
        mods=mods, scale=shapes[0][-1] ** -0.5, const_grads=(), implementation=Implementation(MOSAIC),
        batch_ids=jnp.arange(b, dtype=jnp.int32), head_offset=0,
    )  # fmt: skip
    kernel = functools.partial(pallas_mosaic_gpu_bwd.attention_bwd_mosaic, interpret=True, **params)
    got = jax.jit(kernel)(q, k, v, out.astype(jnp.bfloat16), lse, *consts, g_out, g_lse)
    want = xla.attention_bwd_xla(*f32, out, lse, *consts, g_out.astype(jnp.float32), g_lse, **params)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=1e-2 * float(jnp.max(jnp.abs(w))), rtol=0)


@pytest.mark.skipif(pallas_mosaic_gpu.mosaic_interpret_params() is None, reason="needs jax >= 0.11 (Mosaic GPU interpret mode)")
@pytest.mark.parametrize("case", sorted(c for c in CASES if _mosaic_runs(c)[0]))
def test_interpreted_tangent_matches_xla(case):
    """The tangent kernel interpreted on CPU against the XLA tangent in float32 (out's and lse's)."""
    shapes, kw = _shapes(case)
    rng = np.random.default_rng(2)
    q, k, v, dq, dk, dv = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in (*shapes, *shapes))
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
    out, lse = jf.attention(*f32(q, k, v), implementation="xla", return_lse=True, **kw)
    b, sq, skv = shapes[0][0], shapes[0][1], shapes[1][1]
    mods, consts = attention_mods(kw.get("mask"), kw.get("score_mod"), kw.get("softcap"), (b,), sq, skv, jnp.float32)
    params = dict(
        mods=mods, scale=shapes[0][-1] ** -0.5, implementation=Implementation(MOSAIC),
        batch_ids=jnp.arange(b, dtype=jnp.int32), head_offset=0,
    )  # fmt: skip
    kernel = functools.partial(pallas_mosaic_gpu_tangent.attention_tangent_mosaic, interpret=True, **params)
    got = jax.jit(kernel)(q, k, v, out.astype(jnp.bfloat16), lse, *consts, dq, dk, dv)
    want = xla.attention_tangent_xla(*f32(q, k, v), out, lse, *consts, *f32(dq, dk, dv), **params)
    for g, w in zip(got, want):
        w = np.where(np.isfinite(w), w, 0)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=1e-2 * float(np.max(np.abs(w))), rtol=0)
