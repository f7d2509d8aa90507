"""benchmarks/remat_attention.py at its quick size: its JSON in the bench's layout, the three
variants' attention forwards and memory as the remat policies promise, the same gradient."""

from __future__ import annotations

import json

from tests.bench.scripts import load

remat_attention = load("remat_attention")


def test_quick_run_writes_the_bench_layout(tmp_path, capsys):
    remat_attention.main(["--quick", "--repeats", "2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*-remat-attention-quick.json")
    run = json.loads(path.read_text())
    assert run["family"] == "remat" and run["device"] and run["date"] and run["config"]["depth"] == 2
    rows = {r["variant"]: r for r in run["records"]}
    assert list(rows) == list(remat_attention.VARIANTS)
    # the scan over blocks traces one block: its attention forward once, twice where remat reruns it
    assert [rows[v]["attention_forwards"] for v in rows] == [1, 2, 1]
    assert rows["remat=True"]["temp_mib"] < rows["no remat"]["temp_mib"]
    for row in rows.values():
        assert row["status"] == "ok" and len(row["times_ms"]) == 2 and row["median_ms"] > 0
        assert row["accuracy"]["grad_vs_no_remat"] < 1e-5
    assert rows["save_attention"]["implementation"] == "jaxforge" and rows["save_attention"]["ratio"] == 1.0
    assert "save_attention" in capsys.readouterr().out  # the table
