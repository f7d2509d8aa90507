"""LSTM and GRU layers as one ``lax.scan`` over time (the second-to-last dim)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from jaxforge.functional.nn.layers import Params, check_features

__all__ = ["gru", "init_gru", "init_lstm", "lstm"]


def _uniform(key, shape, hidden_size, dtype):
    bound = 1 / jnp.sqrt(hidden_size)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def init_lstm(key: PRNGKeyArray, input_size: int, hidden_size: int, *, dtype=jnp.float32) -> Params:
    r"""Params of :func:`lstm`: ``w_input`` (input, 4H), ``w_hidden`` (H, 4H) ~ :math:`U(\pm 1/\sqrt H)`,
    ``b`` (4H,) zero but 1 for the forget gate (Jozefowicz et al., 2015). Gate order: i, f, g, o."""
    ki, kh = jax.random.split(key)
    return {
        "w_input": _uniform(ki, (input_size, 4 * hidden_size), hidden_size, dtype),
        "w_hidden": _uniform(kh, (hidden_size, 4 * hidden_size), hidden_size, dtype),
        "b": jnp.zeros((4 * hidden_size,), dtype).at[hidden_size : 2 * hidden_size].set(1),
    }


def lstm(
    params: Params,
    xs: Float[ArrayLike, "*batch time input"],
    state: tuple[Float[ArrayLike, "*batch hidden"], Float[ArrayLike, "*batch hidden"]] | None = None,
) -> tuple[Float[Array, "*batch time hidden"], tuple[Float[Array, "*batch hidden"], Float[Array, "*batch hidden"]]]:
    r"""Long short-term memory: with :math:`[i, f, g, o] = x_t W_x + h_{t-1} W_h + b`,

    .. math:: c_t = \sigma(f) c_{t-1} + \sigma(i) \tanh(g), \qquad h_t = \sigma(o) \tanh(c_t).

    Returns all hidden states ``(..., time, H)`` and the final ``(h, c)``; ``state`` (default zeros)
    is the initial ``(h, c)``.
    """
    xs = _sequence("lstm", xs, params["w_input"].shape[0])
    hidden = params["w_hidden"].shape[0]
    if state is None:
        zeros = jnp.zeros((*xs.shape[:-2], hidden), jnp.result_type(xs, params["w_hidden"]))
        state = (zeros, zeros)

    # The input projection of every step is one matmul outside the recurrence.
    x_gates = jnp.moveaxis(xs @ params["w_input"] + jax.lax.broadcast_to_rank(params["b"], xs.ndim), -2, 0)
    final, hs = _lstm_steps(params["w_hidden"], state, x_gates)
    return jnp.moveaxis(hs, 0, -2), final


def _sequence(fn: str, xs, features: int):
    """``xs`` as an array, checked at trace time to be ``(..., time, features)``."""
    xs = check_features(fn, "xs", xs, features)
    if xs.ndim < 2:
        raise ValueError(f"{fn}: `xs` must have shape (..., time, {features}), got shape {xs.shape}")
    return xs


@jax.jit  # an eager call compiles once per shape: a scan over a fresh closure compiles every time
def _lstm_steps(w_hidden, state, x_gates):
    def step(carry, x_gates):
        h, c = carry
        i, f, g, o = jnp.split(x_gates + h @ w_hidden, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    return jax.lax.scan(step, state, x_gates)


def init_gru(key: PRNGKeyArray, input_size: int, hidden_size: int, *, dtype=jnp.float32) -> Params:
    r"""Params of :func:`gru`: ``w_input`` (input, 3H), ``w_hidden`` (H, 3H), ``b_input``, ``b_hidden``
    (3H,), all :math:`U(\pm 1/\sqrt H)` as in PyTorch. Gate order: r, z, n."""
    keys = jax.random.split(key, 4)
    shapes = {"w_input": (input_size, 3 * hidden_size), "w_hidden": (hidden_size, 3 * hidden_size),
              "b_input": (3 * hidden_size,), "b_hidden": (3 * hidden_size,)}
    return {name: _uniform(k, shape, hidden_size, dtype) for k, (name, shape) in zip(keys, shapes.items())}


def gru(
    params: Params, xs: Float[ArrayLike, "*batch time input"], state: Float[ArrayLike, "*batch hidden"] | None = None
) -> tuple[Float[Array, "*batch time hidden"], Float[Array, "*batch hidden"]]:
    r"""Gated recurrent unit (PyTorch's convention, the reset gate inside the candidate's matmul):

    .. math::
        r, z = \sigma(x_t W^{r,z}_x + b^{r,z}_x + h W^{r,z}_h + b^{r,z}_h), \quad
        n = \tanh(x_t W^n_x + b^n_x + r \odot (h W^n_h + b^n_h)), \quad
        h_t = (1 - z) \odot n + z \odot h_{t-1}.

    Returns all hidden states ``(..., time, H)`` and the final one; ``state`` defaults to zeros.
    """
    xs = _sequence("gru", xs, params["w_input"].shape[0])
    hidden = params["w_hidden"].shape[0]
    if state is None:
        state = jnp.zeros((*xs.shape[:-2], hidden), jnp.result_type(xs, params["w_hidden"]))

    x_gates = jnp.moveaxis(xs @ params["w_input"] + jax.lax.broadcast_to_rank(params["b_input"], xs.ndim), -2, 0)
    final, hs = _gru_steps(params["w_hidden"], params["b_hidden"], state, x_gates)
    return jnp.moveaxis(hs, 0, -2), final


@jax.jit  # as _lstm_steps
def _gru_steps(w_hidden, b_hidden, state, x_gates):
    def step(h, x_gates):
        xr, xz, xn = jnp.split(x_gates, 3, axis=-1)
        hr, hz, hn = jnp.split(h @ w_hidden + jax.lax.broadcast_to_rank(b_hidden, h.ndim), 3, axis=-1)
        r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
        h = (1 - z) * jnp.tanh(xn + r * hn) + z * h
        return h, h

    return jax.lax.scan(step, state, x_gates)
