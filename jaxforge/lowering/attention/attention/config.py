"""Tile sizes of the attention lowerings.

XLA (CPU and fallback): large tiles amortise the per-iteration overhead of the tile loops; the
Pallas Triton kernels want powers of two that keep the accumulators in registers. GPU figures are
placeholders until tuned on the H200 (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

from jaxforge.primitives.attention.attention import Implementation

__all__ = ["tiles"]


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tiles(name: str, sq: int, skv: int, impl: Implementation) -> tuple[int, int]:
    """``(block_q, block_kv)`` for one call of lowering ``name``."""
    if name == "xla":
        block_q, block_kv = min(128, _round_up(sq, 8)), min(256, _round_up(skv, 8))
    else:  # Triton: power-of-two tiles of at least 16 rows (tensor-core MMA shapes)
        block_q, block_kv = min(128, max(16, _pow2_at_least(sq))), min(64, max(16, _pow2_at_least(skv)))
    return impl.block_q or block_q, impl.block_kv or block_kv


def _round_up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)
