"""benchmarks/pending_kernels.py: its list stays true to config.py and the tests, and its verdict
flips a flag only on passing tests and faster, as accurate bench rows."""

from __future__ import annotations

import json
import re

import pytest

from tests.bench.scripts import ROOT, load

pending_kernels = load("pending_kernels")
PENDING = pending_kernels.PENDING


@pytest.mark.parametrize("pending", PENDING, ids=lambda p: p.flag.split(":")[1])
def test_each_entry_names_a_flag_still_off_and_tests_that_exist(pending):
    assert pending_kernels.flag_value(pending.flag) is False  # a flipped flag leaves PENDING
    for prefix in pending.tests:
        path, _, name = prefix.partition("::")
        function = re.match(r"\w*", name).group(0)
        assert (ROOT / path).exists() and f"def {function}" in (ROOT / path).read_text(), prefix


def _log(outcomes):
    return "\n".join(["... some output", *(f"{o} {node}" for node, o in outcomes), "== 3 passed in 1.0s =="])


def _rows(candidate_ms, error, incumbent_ms=2.0):
    row = PENDING[0].rows[0]

    def record(name, ms, err):
        return {"op": row.op, "shape_name": row.shape_name, "implementation": name, "status": "ok",
                "median_ms": ms, "accuracy": {"orthogonality": err}}  # fmt: skip

    return [record(row.candidate, candidate_ms, error), record(row.incumbent, incumbent_ms, 1e-5)]


def _passing():
    return [(prefix + "-x]", "PASSED") for prefix in PENDING[0].tests]


def test_a_flag_is_earned_by_passing_tests_and_a_faster_accurate_row(tmp_path):
    tests = pending_kernels.outcomes(_log(_passing()))
    earned, lines = pending_kernels.verdict(PENDING[0], tests, _rows(1.0, 1.5e-5))
    assert earned and lines[0] == f"tests: {len(PENDING[0].tests)} passed, 0 failed, 0 not run"
    assert "(0.50x)" in lines[1]


def test_every_collected_test_must_have_run_and_node_ids_keep_their_spaces():
    # a run its time limit cut off: one test of the first prefix ran and passed, its sibling did not
    node = PENDING[0].tests[0] + "-(64, 64)]"
    tests = pending_kernels.outcomes(_log(_passing()) + f"\nPASSED {node}\nFAILED {node[:-1]}x] - AssertionError")
    assert tests[node] == "PASSED" and tests[node[:-1] + "x]"] == "FAILED"
    del tests[node[:-1] + "x]"]
    earned, lines = pending_kernels.verdict(PENDING[0], tests, _rows(1.0, 1e-5), expected={node, node + "-sibling"})
    assert not earned and lines[0].endswith("0 failed, 1 not run")
    assert pending_kernels.verdict(PENDING[0], tests, _rows(1.0, 1e-5), expected={node})[0]


def test_pytest_collects_the_gpu_tests_each_entry_names_and_no_other():
    nodes = pending_kernels.pending_tests()
    prefixes = [prefix for pending in PENDING for prefix in pending.tests]
    for prefix in prefixes:
        assert any(node.startswith(prefix) for node in nodes), prefix
    assert all(node.startswith(tuple(prefixes)) for node in nodes) and len(set(nodes)) == len(nodes)
    with pytest.raises(RuntimeError, match="could not collect"):
        pending_kernels.collected(["tests/no_such_file.py::test_x"])


@pytest.mark.parametrize(
    "outcomes,candidate_ms,error",
    [
        ("one failed", 1.0, 1e-5),
        ("one missing", 1.0, 1e-5),
        ("all passed", 3.0, 1e-5),  # slower
        ("all passed", 1.0, 3e-5),  # more than twice the incumbent's error
        ("all passed", None, None),  # no timing
    ],
)
def test_a_flag_stays_off_otherwise(outcomes, candidate_ms, error):
    ran = _passing()
    if outcomes == "one failed":
        ran[0] = (ran[0][0], "FAILED")
    if outcomes == "one missing":
        ran = ran[1:]
    rows = [] if candidate_ms is None else _rows(candidate_ms, error)
    earned, _ = pending_kernels.verdict(PENDING[0], pending_kernels.outcomes(_log(ran)), rows)
    assert not earned


def test_the_report_reads_an_output_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pending_kernels, "collected", lambda prefixes: {node for node, _ in _passing()})
    (tmp_path / "tests.log").write_text(_log(_passing()[1:]))
    (tmp_path / "outcomes.log").write_text(_log(_passing()[:1]))  # what a cut-off run finished
    (tmp_path / "bench.json").write_text(json.dumps({"records": _rows(1.0, 1e-5)}))
    assert pending_kernels.main(tmp_path) == 0
    report = capsys.readouterr().out.splitlines()
    assert report[1] == f"{PENDING[0].flag.split(':')[1]}: flip to True"
    assert sum("keep False" in line for line in report) == len(PENDING) - 1
