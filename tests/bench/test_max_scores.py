"""benchmarks/max_scores.py at its quick size: its JSON in the bench's layout, every row's maxima
as accurate as the float32 reference allows, the reference itself against a dense jnp.max."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from tests.bench.scripts import load

max_scores = load("max_scores")


def test_quick_run_writes_the_bench_layout(tmp_path, capsys):
    max_scores.main(["--quick", "--repeats", "2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*-attention-max-scores-quick.json")
    run = json.loads(path.read_text())
    assert run["family"] == "attention_max_scores" and run["device"] and run["dtype"] == "float32"
    rows = {(r["mode"], r["implementation"]): r for r in run["records"]}
    assert set(rows) == {(mode, impl) for mode in ("fwd", "fwd+bwd") for impl in ("jaxforge", "jaxforge-no-max")}
    for (mode, impl), row in rows.items():
        assert row["status"] == "ok" and len(row["times_ms"]) == 2 and row["median_ms"] > 0
        if impl == "jaxforge":
            assert row["ratio"] == 1.0 and row["accuracy"]["max_scores"] < 1e-5
        else:
            assert row["accuracy"] is None
    assert "jaxforge-no-max" in capsys.readouterr().out  # the table


def test_reference_is_a_dense_max_of_the_causal_scores():
    q, k, _ = max_scores._inputs((2, 12, 12, 4, 2, 8, 8), jnp.float32)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2), precision="highest") / np.sqrt(8)
    causal = np.tril(np.ones((12, 12), bool))
    want = jnp.swapaxes(jnp.where(causal, scores, -jnp.inf).max(-1), 1, 2)
    np.testing.assert_allclose(max_scores.reference_max_scores(q, k, causal=True), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(max_scores.reference_max_scores(q, k, causal=False), jnp.swapaxes(scores.max(-1), 1, 2), rtol=1e-6, atol=1e-6)
