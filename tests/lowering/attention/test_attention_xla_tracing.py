"""The XLA lowering traces its tile loops once per call: another program that holds the same call
(a forward inside a jvp's and inside a gradient's program) reuses the trace, and config.py's tiles,
read before the trace, still apply when they change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.lowering.attention.attention import config, xla


@pytest.fixture
def forward_traces(monkeypatch):
    """How many times the forward's query-tile body has been traced since the test began."""
    jax.clear_caches()  # an earlier test may have traced these calls
    traces = []
    inner = xla.fwd_rows

    def counted(*args, **kwargs):
        traces.append(None)
        return inner(*args, **kwargs)

    monkeypatch.setattr(xla, "fwd_rows", counted)
    return traces


def _qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(key, (2, 40, 2, 8)) for key in keys]


def _attention(q, k, v):
    return jf.attention(q, k, v, mask=jf.masks.causal(), implementation="xla")


def test_a_call_met_again_in_another_program_is_traced_once(forward_traces):
    q, k, v = _qkv()
    jax.jit(_attention).lower(q, k, v)
    jax.jit(lambda q, k, v: jax.jvp(_attention, (q, k, v), (q, k, v))).lower(q, k, v)
    jax.jit(jax.grad(lambda q, k, v: _attention(q, k, v).sum())).lower(q, k, v)
    assert len(forward_traces) == 1


def test_tiles_changed_in_config_apply_to_a_call_traced_before(forward_traces, monkeypatch):
    q, k, v = _qkv()
    before = jax.jit(_attention)(q, k, v)
    monkeypatch.setitem(config.XLA_TILES, True, (8, 16))
    after = jax.jit(lambda q, k, v: _attention(q, k, v))(q, k, v)
    assert len(forward_traces) == 2
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
    assert jnp.all(jnp.isfinite(after))
