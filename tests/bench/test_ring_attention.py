"""benchmarks/ring_attention.py at its quick size: its JSON in the bench's layout, every variant
timed, and each ring's output one device's under the same mask."""

from __future__ import annotations

import json

from tests.bench.scripts import load

ring_attention = load("ring_attention")


def test_quick_run_writes_the_bench_layout(tmp_path, capsys):
    ring_attention.main(["--quick", "--repeats", "2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*-ring-attention-quick.json")
    run = json.loads(path.read_text())
    assert run["family"] == "ring_attention" and run["devices"] == 4 and run["window"] == ring_attention.QUICK_WINDOW and run["prompt"] == ring_attention.QUICK_PROMPT
    rows = {r["variant"]: r for r in run["records"]}
    assert list(rows) == ["ring, causal & window", "ring, causal", "ring, no mask", "all-gather, causal & window", "k, v gathered, causal & window", "all-gather, causal", "k, v gathered, causal", "one device, causal & window", "prompt, k, v split", "prompt, k, v gathered"]
    for row in rows.values():
        assert row["status"] == "ok" and len(row["times_ms"]) == 2 and row["median_ms"] > 0
    assert all(row["accuracy"]["out_vs_one_device"] < 1e-5 for row in rows.values())
    assert rows["ring, causal & window"]["implementation"] == "jaxforge" and rows["ring, causal & window"]["ratio"] == 1.0
    assert "ring, causal & window" in capsys.readouterr().out  # the table
