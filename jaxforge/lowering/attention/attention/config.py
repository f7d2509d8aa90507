"""Tile sizes of the attention lowerings.

XLA (CPU and fallback): large tiles amortise the per-iteration overhead of the tile loops; the
Pallas Triton kernels want powers of two that keep the accumulators in registers, with tiles, warps
and pipeline stages tuned on the H200 per call and head dim (TRITON_TUNED).
"""

from __future__ import annotations

import os

import jax

from jaxforge.primitives.attention.attention import Implementation

__all__ = [
    "PACK_GQA_BELOW",
    "decoding",
    "deterministic",
    "head_pieces",
    "kv_splits",
    "mosaic_bwd_smem",
    "mosaic_bwd_tiles",
    "mosaic_smem",
    "mosaic_tangent_smem",
    "mosaic_tangent_tiles",
    "mosaic_tiles",
    "packs_gqa",
    "pow2_at_least",
    "tiles",
    "triton_compiler",
    "triton_smem",
    "triton_start",
]


def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# The Triton kernels hold a head dim in powers of two of at least 16 (Triton's block and MMA
# shapes). One such piece pads 576 (MLA's absorbed decoding: 512 latent + 64 rotary dims) to
# 1024 and 192 (DeepSeek's prefill queries and keys) to 256; two pieces hold them as 512 + 64
# and 128 + 64, the scores summing a product over each. True once the gpu test
# test_head_dims_in_two_pieces passes on an H200 and the bench's decode_mla_absorbed row beats
# the padded kernels; until then the kernels pad to one power of two unless a call asks for the
# pieces (Implementation.head_pieces) or JAXFORGE_UNVALIDATED_KERNELS=1 (the gpu tests).
TRITON_HEAD_PIECES_VALIDATED = False


def head_pieces(n: int, split: bool) -> tuple[int, ...]:
    """The widths the Triton kernels hold a head dim of ``n`` in: one power of two (at least 16)
    or, with ``split`` and where that is narrower, the largest power of two below ``n`` and one
    for the rest (576 -> 512 + 64, 192 -> 128 + 64, 80 -> 64 + 16; 100 stays 128)."""
    whole = max(16, pow2_at_least(n))
    head = whole // 2
    rest = max(16, pow2_at_least(n - head))
    return (head, rest) if split and head + rest < whole else (whole,)


# Shared memory a Triton program may take, by GPU: what a block may opt in to (sm90 227 KiB, sm80
# 163 KiB, sm86/sm89 99 KiB) less a 7 KiB margin for what the estimate below does not count. Without
# a GPU (interpret mode, lowering for export) the sm90 figure.
TRITON_SMEM_BYTES = {"sm_90a": 220 * 1024, "sm_80": 156 * 1024, "sm_86": 92 * 1024, "sm_89": 92 * 1024}
# (block_q, block_kv, num_warps, num_stages) of one call's Triton kernels, by the call (fwd, tangent,
# bwd: dq and dkv) and the padded head dim d; the stages are the copies of each inner-loop tile that
# Triton's software pipelining keeps. An Implementation's own fields win. Tuned on the H200 by
# `gpu_check.sh tune` (2026-11-30, benchmarks/results/2026-11-30-h200-attention-tune.json): the
# D64 case (8 x 2048, 16 heads) and the causal D128 one (2 x 8192, 16 heads), bf16, against the
# start below. Forward D64: 0.73 ms against 1.09; forward D128: 2.15 against 2.32; tangent D128:
# 6.02 against 9.74; backward D128 (fwd+bwd less fwd): 5.0 against 12.2. The D64 backward and
# tangent were best at the start; other head dims are not measured.
TRITON_START = (128, 64, 4, 2)
TRITON_TUNED = {
    ("fwd", 64): (128, 64, 4, 3),
    ("fwd", 128): (128, 128, 8, 2),
    ("tangent", 128): (128, 64, 8, 2),
    ("bwd", 128): (64, 64, 4, 2),
}
# A gradient through a jvp (tangent_bwd rows and cols kernels) holds twice the backward's tiles a
# program: it starts at the backward's D128 tiles, which fit head dims up to 128 (not yet measured).
_TRITON_CALL_START = {"tangent_bwd": (64, 64, 4, 2)}
# Per kernel, in head dims (d of q/k, dv of v): the width of the program's own tile rows and of the
# rows its inner loop loads, the matmul operands that go through shared memory. fwd owns q and loads
# k, v; tangent owns q, dq and loads k, v, dk, dv; bwd_dq owns q, dout and loads k, v; bwd_dkv owns
# k, v and loads q, dout (and its lse, delta rows, 8 bytes a row); tangent_bwd_rows owns q, dq, dout
# and loads k, v, dk, dv; tangent_bwd_cols the other way round.
_TRITON_WIDTHS = {
    "fwd": (lambda d, dv: d, lambda d, dv: d + dv),
    "tangent": (lambda d, dv: 2 * d, lambda d, dv: 2 * (d + dv)),
    "bwd_dq": (lambda d, dv: d + dv, lambda d, dv: d + dv),
    "bwd_dkv": (lambda d, dv: d + dv, lambda d, dv: d + dv),
    "tangent_bwd_rows": (lambda d, dv: 2 * d + dv, lambda d, dv: 2 * (d + dv)),
    "tangent_bwd_cols": (lambda d, dv: 2 * (d + dv), lambda d, dv: 2 * d + dv),
}
_TRITON_OWNS_Q = {"fwd": True, "tangent": True, "bwd_dq": True, "bwd_dkv": False, "tangent_bwd_rows": True, "tangent_bwd_cols": False}


# GQA packing (kernel.Geometry.pack): with fewer queries a head than the smallest Triton tile (16
# rows), a tile holds the queries of every head of a GQA group instead of padding one head's. Below
# that, unpacked tiles are mostly padding (a decoding step: 1 query a head, 15 padded rows);
# above it, packing would only coarsen the tiles' masks and spans.
PACK_GQA_BELOW = 16


def decoding(sq: int) -> bool:
    """Whether ``sq`` queries a head are fewer than the smallest Triton tile (a symbolic length
    may be long)."""
    return not jax.export.is_symbolic_dim(sq) and sq < PACK_GQA_BELOW


# The XLA backward without a mask packs GQA groups at any length (xla.py passes ``any_length``):
# each lane's key tile is then loaded once for the group and gk, gv need no sum over its heads.
# Measured (2 cores, float32, backward alone): 2 x 1024 x 1024, 8 heads on 2, d64: 310 -> 290 ms;
# 4 x 16 x 8192, 32 on 8, d128: 2094 -> 684; attention_tangent_bwd alike (a gradient through a jvp,
# whole: 2 x 16 x 4096, 32 on 8, d128 527 -> 317 ms; 2 x 1024 x 1024, 8 on 2, d64 551 -> 530). Not
# the forward (those: 102 -> 86 but 277 -> 341 ms) nor masked calls, whose packed tiles span more
# keys (causal backward 173 -> 252, document 57 -> 63).
def packs_gqa(sq: int, group: int, impl: Implementation, any_length: bool = False) -> bool:
    """Whether the query heads of each GQA group share tiles: ``impl.pack_gqa``, else for short
    query sequences (``sq < PACK_GQA_BELOW``) or, told ``any_length``, at every length; never
    without a group to pack."""
    wanted = impl.pack_gqa if impl.pack_gqa is not None else any_length or decoding(sq)
    return wanted and group > 1


# GQA packing and split-KV in the Triton kernels: True once the gpu test
# test_decoding_packs_gqa_heads_and_splits_keys passes on an H200 and its bench row beats the
# unpacked, unsplit kernels: then the default does both where config says (until then, on GPU, only
# a call naming "pallas_triton" does).
TRITON_DECODING_VALIDATED = False

# The Triton backward of a decoding-sized call left unpacked (fewer queries a head than a tile, each
# head in a tile of its own: the default until TRITON_DECODING_VALIDATED). On the H200 (2026-12-04)
# its dv erred 1.0e-2 and 1.0e-3 at the bench's decode_gqa_8to1 and decode_long_kv (max |dv| about
# 0.04 and 0.006) where the packed kernels and torch's erred 2e-4 and 2e-5, with dq and dk alike;
# interpret mode on CPU does not reproduce it, and its kernels' Triton IR at the bench's shape is
# that of b 4 x 2048 keys at 32:4 but for the shape's numbers (tools/triton_ir.py,
# tests/test_triton_ir.py; the H200 cleared 8:1 there, whose one kv head changes the dkv kernel's
# IR). Until its gpu test
# (test_unpacked_decoding_gradients_are_as_accurate_as_packed) passes at the bench's shape, the
# default runs such a backward in XLA's tiles; a call naming "pallas_triton" runs the kernels.
TRITON_UNPACKED_DECODING_BWD_VALIDATED = False

# The Triton forward writing each row's largest score and the first key attaining it
# (return_max_scores): True once its gpu test (test_max_scores_in_the_triton_forward) passes on an
# H200 and benchmarks/max_scores.py's Triton rows beat the XLA tiles; until then, on GPU, such a
# call runs XLA's tiles for its forward unless it names "pallas_triton".
TRITON_MAX_SCORES_VALIDATED = False

# The Triton kernels of a gradient through a jvp (attention_tangent_bwd: pallas_triton.py's
# tangent_bwd rows and cols kernels), in place of XLA's tiles: True once their gpu test
# (test_grad_through_a_jvp_in_the_triton_kernels) passes on an H200 and the bench's jvp-grad row
# beats the XLA tiles; until then a call naming "pallas_triton" runs them.
TRITON_TANGENT_BWD_VALIDATED = False

# Split-KV (flash-decoding) in the Triton forward and tangent: where a call's programs (batch x
# heads x query tiles) are fewer than the GPU's SMs, each program's key tiles are shared out over
# up to KV_SPLIT_WAVES x SMs programs in all, MIN_SPLIT_TILES tiles a split at least; the forward's
# partial results merge through their log-sum-exps, the tangent's add up. Without a GPU (interpret
# mode) the H200's 132 SMs.
KV_SPLIT_WAVES = 2
MIN_SPLIT_TILES = 4


def kv_splits(programs: int, num_kv_tiles: int, impl: Implementation, sm_count: int | None) -> int:
    """How many programs share each forward (tangent, backward dq) program's ``num_kv_tiles`` key tiles:
    ``impl.kv_splits`` (at most one a tile), else enough to fill the GPU's SMs twice over; no split
    where the program count is symbolic (``jax.export``): a split fit for one batch would hurt another."""
    if impl.kv_splits is not None:
        return min(impl.kv_splits, num_kv_tiles)
    sms = sm_count or 132
    if jax.export.is_symbolic_dim(programs) or programs >= sms:
        return 1
    return max(1, min(-(-KV_SPLIT_WAVES * sms // programs), num_kv_tiles // MIN_SPLIT_TILES))


# The XLA lowering's (block_q, block_kv), by whether the call has a mask. Measured on CPU (2 cores,
# float32, the bench's cpu_d64 and cpu_gqa_document shapes, tiles set by Implementation): without a
# mask, 256 x 512 tiles take 0.6x the time of 128 x 256 forward, 0.7x backward and jvp (fewer loop
# steps, larger products); with one, larger tiles skip less (a document mask of ~170-key documents:
# 1.7x slower forward, 2.1x backward).
XLA_TILES = {False: (256, 512), True: (128, 256)}

# Tiles of at most XLA_FEW_ROWS query rows (a decoding step, GQA-packed or not) take 1024 keys (fewer
# loop steps, scores no larger) and lay their scores keys-major (kernel.Geometry.keys_major): XLA CPU
# computes a thin q·kᵀ as k·qᵀ 2x faster, keys being the long side. Measured (2 cores, float32,
# decoding 4 x 1 x 16384, 32 heads on 8, d 128): fwd/bwd/jvp 0.86x/0.90x/0.80x the time of
# queries-major; MHA 4 x 1 x 4096 x 32 heads: 0.63x/0.74x/0.63x; at 256 x 512 (d64) 1.1-1.2x, slower.
XLA_FEW_ROWS = 32


def xla_keys_major(block_q: int) -> bool:
    """Whether the XLA lowering's score tiles of ``block_q`` query rows lie keys-major."""
    return block_q <= XLA_FEW_ROWS


def tiles(
    name: str,
    sq: int,
    skv: int,
    impl: Implementation,
    *,
    masked: bool = True,
    kernels=(),
    d: int = 0,
    dv: int = 0,
    itemsize: int = 2,
    arch: str | None = None,
) -> tuple[int, int]:
    """``(block_q, block_kv)`` for one call of lowering ``name``.

    XLA: ``XLA_TILES[masked]``, ``masked`` whether the call has a mask (whose tiles it may skip).

    Triton: ``kernels`` (names of ``_TRITON_WIDTHS``) share the tiles; ``d``, ``dv`` are the padded
    head dims. Tiles start at the call's ``triton_start`` (no longer than the sequences) and the
    larger one (else the inner loop's) is halved until every kernel's estimated shared memory fits
    ``TRITON_SMEM_BYTES`` of GPU ``arch``.
    """
    if name == "xla":
        rows, cols = XLA_TILES[masked]
        block_q = _tile_within(sq, rows)
        block_kv = _tile_within(skv, cols if block_q > XLA_FEW_ROWS else 1024)
        return impl.block_q or block_q, impl.block_kv or block_kv
    # Triton: power-of-two tiles of at least 16 rows (tensor-core MMA shapes)
    start_q, start_kv, *_ = triton_start(kernels, d)
    block_q, block_kv = min(start_q, max(16, pow2_at_least(sq))), min(start_kv, max(16, pow2_at_least(skv)))
    block_q, block_kv = impl.block_q or block_q, impl.block_kv or block_kv
    stages = triton_compiler(impl, kernels, d)[1]
    limit = TRITON_SMEM_BYTES.get(arch, TRITON_SMEM_BYTES["sm_90a"])
    while over := [k for k in kernels if triton_smem(k, block_q, block_kv, d, dv, itemsize, stages) > limit]:
        loop_is_kv = _TRITON_OWNS_Q[over[0]]
        if block_q > block_kv or (block_q == block_kv and not loop_is_kv):
            block_q //= 2
        else:
            block_kv //= 2
        if min(block_q, block_kv) < 16:
            raise ValueError(
                f"attention: no Triton tiles fit {limit} bytes of shared memory ({arch or 'sm_90a'}) for head dims "
                f"{d}/{dv}, {itemsize}-byte elements and {stages} pipeline stages (Implementation's block_q, "
                f"block_kv, num_stages: {impl.block_q}, {impl.block_kv}, {impl.num_stages}); ask for fewer stages"
            )
    return block_q, block_kv


def _tile_within(n, tile: int) -> int:
    """``tile``, or ``n`` rounded up to a multiple of 8 where that is less; ``tile`` where ``n`` is
    symbolic (``jax.export``: the sequence may be long)."""
    return tile if jax.export.is_symbolic_dim(n) else min(tile, _round_up(n, 8))


def triton_start(kernels, d: int) -> tuple[int, int, int, int]:
    """``(block_q, block_kv, num_warps, num_stages)`` before the Implementation's own and the fit to
    shared memory, for the call running ``kernels`` at padded head dim ``d``."""
    call = kernels[0].rsplit("_", 1)[0] if kernels[0].startswith(("bwd_", "tangent_bwd_")) else kernels[0]
    return TRITON_TUNED.get((call, d), _TRITON_CALL_START.get(call, TRITON_START))


def triton_compiler(impl: Implementation, kernels, d: int) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the Triton kernels of one call (see ``triton_start``)."""
    *_, warps, stages = triton_start(kernels, d)
    return impl.num_warps or warps, impl.num_stages or stages


def triton_smem(kernel: str, block_q: int, block_kv: int, d: int, dv: int, itemsize: int, stages: int) -> int:
    """Estimated shared memory of one Triton program: ``stages`` copies of the inner loop's tiles
    plus the program's own tile; bwd_dkv also transposes its probabilities through shared memory
    and loads its rows' lse and delta. It reproduces the requests the H200 refused for head dims
    256/128 in bf16 at 128 x 64 tiles (tangent 327680 bytes, backward 263168)."""
    own_width, loop_width = (w(d, dv) for w in _TRITON_WIDTHS[kernel])
    own, loop = (block_q, block_kv) if _TRITON_OWNS_Q[kernel] else (block_kv, block_q)
    size = (stages * loop * loop_width + own * own_width) * itemsize
    if kernel == "bwd_dkv":
        size += block_q * block_kv * itemsize + 8 * block_q
    return size


# Masks and score_mods reading captured arrays (ALiBi slopes, a bias table) at points: the Triton
# kernels load them at each score's address and the dq kernel sums their cotangents with atomic
# adds (points.py). On the H200 (2026-12-04) the gpu test passes and ALiBi (2 x 4096^2 x 16, D 128,
# causal) takes 0.75 / 2.6 / 2.1 ms fwd / fwd+bwd / jvp against XLA's tiles' 10.7 / 25.7 / 26.9.
TRITON_POINT_READS_VALIDATED = True

# XLA's flags asking for run-to-run determinism (--xla_gpu_deterministic_ops implies the other).
DETERMINISTIC_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")


def deterministic() -> bool:
    """Whether ``XLA_FLAGS`` asks XLA for deterministic GPU programs (as ``--flag``, ``--flag=true``
    or ``=1``; the last mention of a flag counts, as in XLA). Then a backward summing a captured
    array's cotangent runs XLA's tiles, whose sums XLA orders, not the Triton dq kernel's atomics."""
    asked = dict.fromkeys(DETERMINISTIC_FLAGS, False)
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, has_value, value = flag.lstrip("-").partition("=")
        if name in asked:
            asked[name] = not has_value or value.lower() in ("true", "1")
    return any(asked.values())

# Mosaic GPU (pallas_mosaic_gpu.py): each consumer warpgroup owns 64 query rows (one wgmma M);
# the key/value ring fits sm90's 227 KiB. Mosaic places each shared-memory buffer at a multiple
# of 1 KiB and reserves a little beside them (barriers: 2.4 KiB at the shapes tried); the
# margin covers that.
# The sm90 default forward since its gpu tests (30 with the document masks') passed on the H200
# (2026-12-04) and it beat the Triton default at its accuracy: D 64 0.64 vs 0.80 ms, D 128 causal
# 1.65 vs 2.60, document & causal 1.52 vs 1.77.
MOSAIC_VALIDATED = True
# The Mosaic forward writing each row's maximum (return_max_scores; not the first key attaining it,
# which only a derivative of the maxima binds): True once its gpu test
# (test_mosaic_forward_writes_the_max_scores) passes on an H200 and benchmarks/max_scores.py's
# jaxforge-mgpu rows beat the default's; until then such a forward runs Triton's or XLA's there.
MOSAIC_MAX_SCORES_VALIDATED = False
MOSAIC_BLOCK_Q = 64
MOSAIC_SMEM_BYTES = 227 * 1024
MOSAIC_SMEM_MARGIN = 4096
MOSAIC_BLOCK_KV = 128
MOSAIC_STAGES = 2
_OWN = 2 * MOSAIC_BLOCK_Q  # rows the two consumers of a program own


def mosaic_tiles(d: int, dv: int, itemsize: int, impl: Implementation, values=(0, 0)) -> tuple[int, int]:
    """``(block_kv, stages)`` of the Mosaic GPU forward for padded head dims ``d``, ``dv`` and
    ``values``, the mask's positional arrays at the queries and at the keys: the
    Implementation's, else 128 keys a tile halved (to 64 at least) until the ring fits."""
    block_kv, stages = impl.block_kv or MOSAIC_BLOCK_KV, impl.num_stages or MOSAIC_STAGES
    size = lambda block_kv: mosaic_smem(block_kv, stages, d, dv, itemsize, values)  # noqa: E731
    while size(block_kv) > MOSAIC_SMEM_BYTES and block_kv > 64 and not impl.block_kv:
        block_kv //= 2
    return _fitting("forward", size(block_kv), d, dv, block_kv, stages)


def mosaic_smem(block_kv: int, stages: int, d: int, dv: int, itemsize: int, values=(0, 0)) -> int:
    """Shared memory of one Mosaic GPU forward program: the two consumers' query and output
    tiles (one tile when ``d == dv``), ``stages`` key/value tiles, the lse rows, the program's
    table rows, the positional mask values, and the margin."""
    tiles = [_OWN * d, 0 if d == dv else _OWN * dv, stages * block_kv * d, stages * block_kv * dv]
    return _smem([itemsize * n for n in tiles] + [_OWN * 4], values, stages, block_kv)


def _smem(buffers, values, stages: int, block: int) -> int:
    """The bytes of ``buffers``, of the program's table rows and of its positional mask values,
    ``values = (own, streamed)`` arrays at the consumers' own rows and at ``stages`` streamed
    tiles of ``block`` (int32), each placed at a multiple of 1 KiB; and the margin."""
    own, streamed = values
    buffers = [*buffers, 3 * 32 * 4, 4 * own * _OWN, 4 * streamed * stages * block]
    return sum(-(-n // 1024) * 1024 for n in buffers) + MOSAIC_SMEM_MARGIN


# The Mosaic GPU backward (pallas_mosaic_gpu_bwd.py): its dq and dkv programs own 2 x 64 rows and
# stream tiles of MOSAIC_BWD_BLOCK rows through a ring of MOSAIC_BWD_STAGES; a dkv consumer keeps
# the float32 dk and dv of its 64 keys in registers, (d + dv) / 2 a thread, hence the head-dim cap.
# Both the sm90 defaults since their gpu tests passed on the H200 (2026-12-04: 19 backward, 23
# tangent) and they beat the Triton kernels at their accuracy: fwd+bwd D 64 1.85 vs 2.41 ms, D 128
# causal 4.76 vs 7.55, document 3.24 vs 3.63; jvp 1.40 vs 1.72, 3.40 vs 5.74, 2.26 vs 2.95.
MOSAIC_BWD_VALIDATED = True
MOSAIC_TANGENT_VALIDATED = True  # the tangent (pallas_mosaic_gpu_tangent.py)
MOSAIC_BWD_BLOCK = 64
MOSAIC_BWD_STAGES = 2
MOSAIC_BWD_MAX_HEAD_DIMS = 256


def mosaic_bwd_tiles(d: int, dv: int, itemsize: int, impl: Implementation, values=(0, 0)) -> tuple[int, int]:
    """``(block, stages)`` of the Mosaic GPU backward for padded head dims ``d``, ``dv`` and
    positional mask arrays ``values`` (at the queries, at the keys): the Implementation's
    ``block_kv`` and ``num_stages``, else the defaults above; both kernels must fit."""
    block, stages = impl.block_kv or MOSAIC_BWD_BLOCK, impl.num_stages or MOSAIC_BWD_STAGES
    size = max(mosaic_bwd_smem(kernel, block, stages, d, dv, itemsize, values) for kernel in ("dq", "dkv"))
    return _fitting("backward", size, d, dv, block, stages)


def mosaic_bwd_smem(kernel: str, block: int, stages: int, d: int, dv: int, itemsize: int, values=(0, 0)) -> int:
    """Shared memory of one program of the backward's ``kernel`` ("dq" or "dkv"): the two consumers'
    own tiles (Q and dO, or K and V), ``stages`` streamed tiles (K and V, or Q, dO and their lse
    and Δ rows), the lse and Δ rows of its own queries (dq), the table rows, the positional mask
    values (``values`` at the queries, at the keys: a dkv program owns keys), and the margin."""
    tiles = [itemsize * n for n in (_OWN * d, _OWN * dv, stages * block * d, stages * block * dv)]
    if kernel == "dq":
        return _smem([*tiles, 2 * _OWN * 4], values, stages, block)
    return _smem([*tiles, stages * 2 * block * 4], values[::-1], stages, block)


def mosaic_tangent_tiles(d: int, dv: int, itemsize: int, impl: Implementation, values=(0, 0)) -> tuple[int, int]:
    """``(block, stages)`` of the Mosaic GPU tangent: the backward's defaults (or the
    Implementation's), its ring of K, V, dK and dV tiles fitting sm90's shared memory."""
    block, stages = impl.block_kv or MOSAIC_BWD_BLOCK, impl.num_stages or MOSAIC_BWD_STAGES
    return _fitting("tangent", mosaic_tangent_smem(block, stages, d, dv, itemsize, values), d, dv, block, stages)


def mosaic_tangent_smem(block: int, stages: int, d: int, dv: int, itemsize: int, values=(0, 0)) -> int:
    """Shared memory of one Mosaic GPU tangent program: the two consumers' Q, dQ and (when its
    head dim differs from Q's) O tiles, their lse rows, ``stages`` of K, V, dK, dV tiles, the
    table rows, the positional mask values, and the margin."""
    tiles = [_OWN * d, _OWN * d, 0 if d == dv else _OWN * dv, *(stages * block * n for n in (d, dv, d, dv))]
    return _smem([itemsize * n for n in tiles] + [_OWN * 4], values, stages, block)


def _fitting(kernel: str, size: int, d: int, dv: int, block: int, stages: int) -> tuple[int, int]:
    """``(block, stages)`` where a Mosaic GPU ``kernel`` of ``size`` bytes fits sm90's shared memory."""
    if size > MOSAIC_SMEM_BYTES:
        raise ValueError(
            f"attention: the Mosaic GPU {kernel} needs {size} bytes of shared memory for head dims {d}/{dv}, "
            f"{block}-row tiles and {stages} stages; sm90 has {MOSAIC_SMEM_BYTES}: ask for fewer stages or rows"
        )
    return block, stages


def _round_up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)
