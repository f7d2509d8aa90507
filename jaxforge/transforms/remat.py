"""``jf.remat``: ``jax.checkpoint`` policies that know what jaxforge's primitives keep.

A rematerialised function (``jax.checkpoint(f, policy=...)``) recomputes in its backward whatever
its policy does not save. ``jf.attention``'s JVP names the residuals its backward reads, the output
``(..., Sq, Hq, Dv)`` and the rows' log-sum-exps ``(..., Sq, Hq)``, so a policy can keep them: the
backward then runs the attention backward at once, not the attention forward first.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxforge.primitives.attention.attention import RESIDUAL_NAMES

__all__ = ["ATTENTION_RESIDUALS", "save_attention"]

ATTENTION_RESIDUALS = RESIDUAL_NAMES


def save_attention(*names: str, policy: Callable | None = None) -> Callable:
    """A ``jax.checkpoint`` policy that saves ``jf.attention``'s residuals (``ATTENTION_RESIDUALS``),
    the values named ``names`` by ``jax.ad_checkpoint.checkpoint_name``, and what ``policy`` (another
    policy, e.g. ``jax.checkpoint_policies.dots_saveable``) saves; it recomputes the rest.

    ``jf.nn.transformer(params, tokens, remat=jf.remat.save_attention())``: each block's backward
    recomputes its projections and MLP but not its attention, for the memory of one output and
    one lse per block.
    """
    saved = jax.checkpoint_policies.save_only_these_names(*ATTENTION_RESIDUALS, *names)
    return saved if policy is None else jax.checkpoint_policies.save_from_both_policies(saved, policy)
