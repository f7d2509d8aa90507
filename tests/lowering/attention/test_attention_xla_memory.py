"""The default (XLA) lowering's memory is O(S): XLA's buffer assignment for the forward, the JVP, the
gradient, the gradient through a JVP, the JVP of a JVP (forward over forward), the JVP of a
gradient (a Hessian-vector product) and the gradient of a gradient (a gradient penalty), compiled
(not run) on CPU, grows linearly with the sequence length, up to S = 131072, where a dense score
matrix alone would take 137 GB. The same measure on jax's dense attention
grows quadratically, so the check can fail."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxforge as jf

HEADS, DIM = 2, 64


def _modes(attention):
    def fwd(q, k, v):
        return attention(q, k, v)

    def jvp(q, k, v):
        return jax.jvp(attention, (q, k, v), (q, k, v))[1]

    def grad(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)

    def grad_of_jvp(q, k, v):  # consistency-model training: a loss on the jvp, differentiated
        return jax.grad(lambda q, k, v: jnp.sum(jvp(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)

    def jvp_of_jvp(q, k, v):  # forward over forward (Taylor-mode, jacfwd of jacfwd)
        return jax.jvp(jvp, (q, k, v), (v, q, k))[1]

    def hvp(q, k, v):  # forward over reverse
        return jax.jvp(grad, (q, k, v), (q, k, v))[1]

    def grad_of_grad(q, k, v):  # reverse over reverse
        return jax.grad(lambda q, k, v: sum(jnp.sum(g**2) for g in grad(q, k, v)), argnums=(0, 1, 2))(q, k, v)

    return {"fwd": fwd, "jvp": jvp, "grad": grad, "grad_of_jvp": grad_of_jvp, "jvp_of_jvp": jvp_of_jvp, "hvp": hvp, "grad_of_grad": grad_of_grad}


def _temp_bytes(fn, seq: int) -> int:
    x = jax.ShapeDtypeStruct((1, seq, HEADS, DIM), jnp.float32)
    return jax.jit(fn).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def _jaxforge(q, k, v):
    return jf.attention(q, k, v, mask=jf.masks.causal())


def _dense(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


@pytest.mark.parametrize("mode", ["fwd", "jvp", "grad", "grad_of_jvp", "jvp_of_jvp", "hvp", "grad_of_grad"])
def test_temporary_memory_is_linear_in_the_sequence_length(mode):
    fn = _modes(_jaxforge)[mode]
    small, large = _temp_bytes(fn, 4096), _temp_bytes(fn, 8192)
    assert large <= 2.2 * small, (small, large)
    one_array = 131072 * HEADS * DIM * 4
    # q, k, v, out: one array each; measured up to 16.1 (the gradient of a gradient), where an
    # O(S²/tile) term would take hundreds
    assert _temp_bytes(fn, 131072) <= 20 * one_array


def test_the_dense_attention_measures_quadratic():
    fn = _modes(_dense)["grad"]
    small, large = _temp_bytes(fn, 1024), _temp_bytes(fn, 2048)
    assert large >= 3.5 * small, (small, large)
