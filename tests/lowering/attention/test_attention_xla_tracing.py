"""The XLA lowering traces its tile loops once per call: another program that holds the same call
(a forward inside a jvp's and inside a gradient's program) reuses the trace, and config.py's tiles,
read before the trace, still apply when they change. A tile loop traces its masked body once and
leaves out the loops it knows to be empty."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from jaxforge.lowering.attention.attention import config, xla
from jaxforge.lowering.attention.attention.kernel import tile_loop


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


def _loops(jaxpr) -> int:
    return sum(e.primitive.name in ("while", "scan") for e in jaxpr.eqns)


def test_a_tile_loop_traces_its_masked_body_once_and_leaves_out_empty_loops():
    traced = []

    def body(t, total, masked):  # masked tiles add 1, wholly visible ones 100
        traced.append(masked)
        return total + (1 if masked else 100)

    # Tiles [0, 5), wholly visible [1, 3): masked 0, 3 and 4 in two loops of one body.
    run = lambda hi: tile_loop((0, hi), (1, 3), body, jnp.int32(0))  # noqa: E731
    jaxpr = jax.make_jaxpr(run)(5)
    assert sorted(traced) == [False, True] and _loops(jaxpr.jaxpr) == 3
    assert jax.jit(run)(5) == 203
    traced.clear()
    # Known bounds, every tile wholly visible (no mask, keys filling whole tiles): one loop.
    whole = lambda: tile_loop((0, 4), (0, 4), body, jnp.int32(0))  # noqa: E731
    assert _loops(jax.make_jaxpr(whole)().jaxpr) == 1 and traced == [False]
    assert jax.jit(whole)() == 400
