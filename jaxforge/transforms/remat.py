"""``jf.remat``: ``jax.checkpoint`` policies that know what jaxforge's primitives keep.

A rematerialised function (``jax.checkpoint(f, policy=...)``) recomputes in its backward whatever
its policy does not save. The JVP rules of jaxforge's primitives name the residuals their
derivatives read (``jax.ad_checkpoint.checkpoint_name``), so a policy can keep them and the
backward skips the primitive's forward: ``jf.attention``'s output ``(..., Sq, Hq, Dv)`` and rows'
log-sum-exps ``(..., Sq, Hq)``; ``jf.linalg.svd``'s ``(s, u, vh)``; ``jf.linalg.lstsq``'s solution,
rank and triangular factor ``R``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxforge.primitives.attention import attention
from jaxforge.primitives.linalg import lstsq, svd

__all__ = ["ATTENTION_RESIDUALS", "LINALG_RESIDUALS", "save_attention", "save_linalg"]

ATTENTION_RESIDUALS = attention.RESIDUAL_NAMES
LINALG_RESIDUALS = svd.RESIDUAL_NAMES + lstsq.RESIDUAL_NAMES


def save_attention(*names: str, policy: Callable | None = None) -> Callable:
    """A ``jax.checkpoint`` policy that saves ``jf.attention``'s residuals (``ATTENTION_RESIDUALS``),
    the values named ``names`` by ``jax.ad_checkpoint.checkpoint_name``, and what ``policy`` (another
    policy, e.g. ``jax.checkpoint_policies.dots_saveable``) saves; it recomputes the rest.

    ``jf.nn.transformer(params, tokens, remat=jf.remat.save_attention())``: each block's backward
    recomputes its projections and MLP but not its attention, for the memory of one output and
    one lse per block.

    >>> import jax, jax.numpy as jnp, jaxforge as jf
    >>> q = jnp.ones((1, 8, 2, 4))
    >>> f = jax.checkpoint(lambda q: jf.attention(q, q, q).sum(), policy=jf.remat.save_attention())
    >>> jax.ad_checkpoint.print_saved_residuals(f, q)  # what the backward keeps
    f32[1,8,2,4] from the argument q
    f32[1,8,2,4] named 'attention_out' from ...
    f32[1,8,2] named 'attention_lse' from ...
    """
    return _saving("save_attention", ATTENTION_RESIDUALS, names, policy)


def save_linalg(*names: str, policy: Callable | None = None) -> Callable:
    """:func:`save_attention` for ``jf.linalg``'s residuals (``LINALG_RESIDUALS``): the backward of an
    ``svd`` or ``lstsq`` inside a checkpointed function reuses the forward's factors instead of
    factoring again. ``save_linalg(*ATTENTION_RESIDUALS)`` keeps both families'."""
    return _saving("save_linalg", LINALG_RESIDUALS, names, policy)


def _saving(fn: str, residuals: tuple[str, ...], names: tuple, policy) -> Callable:
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise TypeError(f"{fn}: `names` must be the strings given to checkpoint_name, got {bad!r}")
    if policy is not None and not callable(policy):
        raise TypeError(f"{fn}: `policy` must be None or a jax.checkpoint policy (a callable), got {policy!r}")
    saved = jax.checkpoint_policies.save_only_these_names(*residuals, *names)
    return saved if policy is None else jax.checkpoint_policies.save_from_both_policies(saved, policy)
