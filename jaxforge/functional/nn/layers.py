"""Dense layers, embeddings, normalisations and the MLP: ``layer(params, x)`` with ``init_layer(...)``.

Params are plain dicts of arrays, so optax, ``jax.tree`` and ``jf.shard`` specs apply directly.
Each function works on any leading dims; the last dim is the feature dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

__all__ = [
    "check_features",
    "embedding",
    "init_embedding",
    "init_layer_norm",
    "init_linear",
    "init_mlp",
    "init_rms_norm",
    "layer_norm",
    "linear",
    "mlp",
    "rms_norm",
]

Params = dict[str, ArrayLike]  # one layer
NestedParams = dict[str, Any]  # layers of layers


def check_features(fn: str, name: str, x, expected: int, axis: int = -1) -> Array:
    """``x`` as an array, after a trace-time check that ``x.shape[axis] == expected`` naming the
    function and the argument."""
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[axis] != expected:
        raise ValueError(f"{fn}: `{name}` must have {expected} features in dim {axis}, got shape {x.shape}")
    return x


def at_least_float32(dtype):
    """``dtype``, or float32 where it is narrower: the precision norms and angles are computed in
    (written out rather than promoted, so that strict dtype promotion holds)."""
    return jnp.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else jnp.dtype(dtype)


def init_linear(key: PRNGKeyArray, in_features: int, out_features: int, *, bias: bool = True, dtype=jnp.float32) -> Params:
    r"""Params of :func:`linear`: ``w`` ~ :math:`\mathcal N(0, 1/\text{in})` of shape (in, out), ``b`` = 0."""
    params = {"w": jax.random.normal(key, (in_features, out_features), dtype) / jnp.sqrt(in_features).astype(dtype)}
    if bias:
        params["b"] = jnp.zeros((out_features,), dtype)
    return params


def _features(p, x):
    """``p`` of shape ``(features,)`` with ``x``'s rank, for ``jax_numpy_rank_promotion="raise"``."""
    return jax.lax.broadcast_to_rank(p, x.ndim)


def linear(params: Params, x: Float[ArrayLike, "*batch d_in"]) -> Float[Array, "*batch d_out"]:
    r""":math:`y = x W + b` (``b`` only where ``params`` has one)."""
    x = check_features("linear", "x", x, params["w"].shape[0])
    y = x @ params["w"]
    return y + _features(params["b"], y) if "b" in params else y


def init_embedding(key: PRNGKeyArray, num_embeddings: int, features: int, *, dtype=jnp.float32) -> Params:
    r"""Params of :func:`embedding`: a table ~ :math:`\mathcal N(0, 1)` of shape (num_embeddings, features)."""
    return {"table": jax.random.normal(key, (num_embeddings, features), dtype)}


def embedding(params: Params, ids: Int[ArrayLike, "*batch"]) -> Float[Array, "*batch features"]:
    r""":math:`y = T[\text{ids}]`; negative ids count from the end as in numpy, ids past the end
    are clamped (JAX's indexing). Under explicit sharding the rows are split as the ids are."""
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"embedding: `ids` must be integers, got dtype {ids.dtype}")
    table = jnp.asarray(params["table"])
    return table.at[ids].get(out_sharding=_rows_like(table, ids))


def _rows_like(table, ids):
    """The sharding of ``table``'s rows gathered at ``ids`` where explicit sharding splits either
    (jax asks for it): split as ``ids``, their features as the table's; else None."""
    ids_spec, table_spec = (tuple(jax.typeof(x).sharding.spec) for x in (ids, table))
    if not any(entry is not None for entry in (*ids_spec, *table_spec)):
        return None
    features = table_spec[1] if len(table_spec) > 1 else None
    spec = jax.sharding.PartitionSpec(*ids_spec, *[None] * (ids.ndim - len(ids_spec)), features)
    return jax.sharding.NamedSharding(jax.typeof(ids).sharding.mesh, spec)


def init_rms_norm(features: int, *, dtype=jnp.float32) -> Params:
    """Params of :func:`rms_norm`: ``scale`` = 1."""
    return {"scale": jnp.ones((features,), dtype)}


def rms_norm(params: Params, x: Float[ArrayLike, "*batch features"], *, eps: float = 1e-6) -> Float[Array, "*batch features"]:
    r""":math:`y = \gamma \odot x / \sqrt{\overline{x^2} + \epsilon}`, the mean over features in float32 or wider."""
    x = check_features("rms_norm", "x", x, params["scale"].shape[0])
    wide = x.astype(at_least_float32(x.dtype))
    normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * _features(params["scale"], x)


def init_layer_norm(features: int, *, dtype=jnp.float32) -> Params:
    """Params of :func:`layer_norm`: ``scale`` = 1, ``bias`` = 0."""
    return {"scale": jnp.ones((features,), dtype), "bias": jnp.zeros((features,), dtype)}


def layer_norm(params: Params, x: Float[ArrayLike, "*batch features"], *, eps: float = 1e-5) -> Float[Array, "*batch features"]:
    r""":math:`y = \gamma \odot (x - \mu) / \sqrt{\sigma^2 + \epsilon} + \beta` over features, in float32 or wider."""
    x = check_features("layer_norm", "x", x, params["scale"].shape[0])
    wide = x.astype(at_least_float32(x.dtype))
    centred = wide - jnp.mean(wide, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * _features(params["scale"], x) + _features(params["bias"], x)


def init_mlp(key: PRNGKeyArray, features: int, hidden_features: int, *, dtype=jnp.float32) -> NestedParams:
    """Params of :func:`mlp`: two :func:`linear` layers, ``up`` (features -> hidden) and ``down``."""
    up, down = jax.random.split(key)
    return {
        "up": init_linear(up, features, hidden_features, dtype=dtype),
        "down": init_linear(down, hidden_features, features, dtype=dtype),
    }


def mlp(
    params: NestedParams,
    x: Float[ArrayLike, "*batch features"],
    *,
    activation: Callable[[Array], Array] = jax.nn.gelu,
) -> Float[Array, "*batch features"]:
    r""":math:`y = \text{down}(\sigma(\text{up}(x)))`."""
    return linear(params["down"], activation(linear(params["up"], x)))
