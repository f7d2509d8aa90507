"""Smoke tests of the benchmark runner on tiny shapes (``quick``)."""

import json

import pytest

from jaxforge.bench import format_table, run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("results")
    return run("linalg", quick=True, out_dir=out_dir), out_dir


def test_every_op_has_timed_accurate_records(quick_run):
    records, _ = quick_run
    assert {r["op"] for r in records} == {"svd", "lstsq"}
    for op in ("svd", "lstsq"):
        assert {"jaxforge", "jnp"} <= {r["implementation"] for r in records if r["op"] == op}
    for r in records:
        if r["implementation"] == "torch":  # CUDA's lstsq refuses wide systems: recorded, not raised
            continue
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and all(t > 0 for t in r["times_ms"])
        assert r["ratio"] > 0
        assert r["accuracy"] and all(0 <= v < 1e-4 for v in r["accuracy"].values()), r
    assert all(r["ratio"] == 1.0 for r in records if r["implementation"] == "jaxforge")


def test_results_are_written_as_json(quick_run):
    records, out_dir = quick_run
    (path,) = out_dir.glob("*-linalg-quick.json")
    saved = json.loads(path.read_text())
    assert saved["family"] == "linalg" and saved["jax_version"] and saved["device"]
    assert saved["records"] == records


def test_table_has_one_row_per_record(quick_run):
    records, _ = quick_run
    assert len(format_table(records).splitlines()) == len(records) + 1


def test_shapes_filter_by_name():
    records = run("linalg", quick=True, shapes=["quick_wide"])
    assert {r["shape_name"] for r in records} == {"quick_wide"}


def test_unknown_family_or_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown benchmark family 'nope'.*linalg"):
        run("nope")
    with pytest.raises(ValueError, match="unknown shape name"):
        run("linalg", quick=True, shapes=["no_such_shape"])
