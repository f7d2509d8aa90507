"""What a GPU run says of the kernels config.py keeps off until a GPU has checked them: for each
``*_VALIDATED = False`` flag, its gpu tests (the PASSED / FAILED lines pytest -rA left in
tests.log, or outcomes.log as they happened) and its bench rows against the kernel it would
replace (the JSON files of ``python -m jaxforge.bench``), and a verdict: flip the flag when every
test pytest collects under its prefixes ran and passed and each candidate row is faster than its
incumbent at no worse than twice its error.

    python3 benchmarks/pending_kernels.py OUT_DIR     # benchmarks/gpu_check.sh runs it last
    python3 benchmarks/pending_kernels.py OUT_DIR benchmarks/results/2026-12-04-h200-*.json
                                     # a tests-only run, with bench rows of an earlier one
    python3 benchmarks/pending_kernels.py --tests    # the node ids of those tests, one a line

A flag flipped in config.py leaves PENDING with it (tests/bench/test_pending_kernels.py holds every
entry to a flag that is still False).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

LINALG = "tests/lowering/linalg/"
ATTENTION = "tests/lowering/attention/"


@dataclasses.dataclass(frozen=True)
class Row:
    """Bench records to compare: ``candidate`` against ``incumbent`` on one case."""

    op: str
    shape_name: str
    candidate: str
    incumbent: str
    mode: str | None = None  # attention's fwd / fwd+bwd / jvp


@dataclasses.dataclass(frozen=True)
class Pending:
    flag: str  # "module:ATTRIBUTE", a config flag that is False until the GPU has checked the kernel
    tests: tuple[str, ...]  # node-id prefixes: every test they name must pass
    rows: tuple[Row, ...]


def _max_scores_rows(candidate: str) -> tuple[Row, ...]:
    """benchmarks/max_scores.py's rows of ``candidate`` against the default, forward and has_aux step."""
    return tuple(
        Row("attention_max_scores", shape, candidate, "jaxforge", mode) for shape in ("long_d128_causal", "gqa_8to1") for mode in ("fwd", "fwd+bwd")
    )


PENDING = (
    Pending(
        "jaxforge.lowering.linalg.lstsq.config:QR_SOLVE_WARP_VALIDATED",
        (LINALG + "test_lstsq_cuda.py::test_the_warp_kernel_agrees_with_the_block_kernel_and_numpy",),
        (Row("lstsq", "tiny_batch", "lstsq-qr_solve_warp", "lstsq-householder"),),
    ),
    Pending(  # GQA packing and split-KV: "jaxforge" runs the unpacked, unsplit Triton kernels until then
        "jaxforge.lowering.attention.attention.config:TRITON_DECODING_VALIDATED",
        (ATTENTION + "test_attention_gpu.py::test_decoding_packs_gqa_heads_and_splits_keys",),
        tuple(
            Row("attention", shape, "jaxforge-decoding", "jaxforge", mode)
            for shape in ("decode_gqa_8to1", "decode_long_kv")
            for mode in ("fwd", "fwd+bwd", "jvp")  # the forward, tangent and dq kernels split
        ),
    ),
    Pending(  # a decoding step's backward left unpacked: "jaxforge" runs it in XLA's tiles until then (its dv
        # erred on the H200); tests alone decide: a bench row of those kernels would time the wrong dv
        "jaxforge.lowering.attention.attention.config:TRITON_UNPACKED_DECODING_BWD_VALIDATED",
        (ATTENTION + "test_attention_gpu.py::test_unpacked_decoding_gradients_are_as_accurate_as_packed",),
        (),
    ),
    Pending(  # head dims in two pieces: "jaxforge" pads them to one power of two until then (MLA's
        # decoding jvp, whose padded tiles fit no H200, in XLA's tiles)
        "jaxforge.lowering.attention.attention.config:TRITON_HEAD_PIECES_VALIDATED",
        (
            ATTENTION + "test_attention_gpu.py::test_head_dims_in_two_pieces",
            ATTENTION + "test_attention_gpu.py::test_mla_absorbed_decoding_head_dims",
        ),
        tuple(Row("attention", "decode_mla_absorbed", "jaxforge-pieces", "jaxforge", mode) for mode in ("fwd", "jvp"))
        + tuple(Row("attention", "mla_192_128", "jaxforge-pieces", "jaxforge", mode) for mode in ("fwd+bwd", "jvp")),
    ),
    Pending(  # return_max_scores: "jaxforge" runs the forward in XLA's tiles until then
        "jaxforge.lowering.attention.attention.config:TRITON_MAX_SCORES_VALIDATED",
        (ATTENTION + "test_attention_gpu.py::test_max_scores_in_the_triton_forward",),
        _max_scores_rows("jaxforge-triton"),
    ),
    Pending(  # return_max_scores on Hopper: "jaxforge" runs that forward in Triton's kernel or XLA's tiles until then
        "jaxforge.lowering.attention.attention.config:MOSAIC_MAX_SCORES_VALIDATED",
        (ATTENTION + "test_attention_gpu.py::test_mosaic_forward_writes_the_max_scores",),
        _max_scores_rows("jaxforge-mgpu"),
    ),
    Pending(  # float64 past 32: "jaxforge" loops cuSOLVER over the batch until then
        "jaxforge.lowering.linalg.svd.config:JACOBI_BLOCK_F64_VALIDATED",
        (LINALG + "test_svd_cuda.py::test_block_kernel_in_float64_matches_numpy",),
        (Row("svd_f64", "small_batch", "jaxforge-block", "jaxforge"),),
    ),
    Pending(  # complex past 32: "jaxforge" loops cuSOLVER over the batch until then
        "jaxforge.lowering.linalg.svd.config:JACOBI_BLOCK_COMPLEX_VALIDATED",
        (LINALG + "test_svd_cuda.py::test_block_kernel_in_complex_matches_numpy",),
        (Row("svd_c64", "small_batch", "jaxforge-block", "jaxforge"),),
    ),
    Pending(  # tall batches past the kernels: "jaxforge" loops cuSOLVER over the batch until then
        "jaxforge.lowering.linalg.svd.config:JACOBI_QR_FIRST_VALIDATED",
        (LINALG + "test_svd_cuda.py::test_tall_batches_take_the_kernel_of_r_after_a_qr",),
        (Row("svd", "tall_batch", "jaxforge-qr-jacobi", "jaxforge"),),
    ),
    Pending(  # compute_uv=False: "jaxforge" runs each Jacobi kernel whole, its vectors dropped, until then
        "jaxforge.lowering.linalg.svd.config:JACOBI_VALUES_VALIDATED",
        (
            LINALG + "test_svd_cuda.py::test_values_twins_match_numpy_and_their_kernels",
            LINALG + "test_svd_cuda.py::test_an_svd_without_vectors_runs_a_values_twin",
        ),
        (
            Row("svdvals", "tiny_batch", "jaxforge-pairs-values", "jaxforge-pairs"),
            Row("svdvals", "small_batch", "jaxforge-slots-values", "jaxforge-slots"),
            Row("svdvals", "medium_batch", "jaxforge-slots-values", "jaxforge-slots"),
        ),
    ),
    Pending(  # a gradient through a jvp: "jaxforge" runs XLA's tiles for it until then; by name, every
        # kernel is Triton's (on a Hopper the default's first-order ones are Mosaic's, faster still)
        "jaxforge.lowering.attention.attention.config:TRITON_TANGENT_BWD_VALIDATED",
        (ATTENTION + "test_attention_gpu.py::test_grad_through_a_jvp_in_the_triton_kernels",),
        (Row("attention", "long_d128_causal", "jaxforge-triton", "jaxforge", "jvp-grad"),),
    ),
)

_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR) (.+?)(?: - .*)?$")  # node ids may hold spaces: [causal-(64, 64)]
ROOT = Path(__file__).resolve().parents[1]


def outcomes(log: str) -> dict[str, str]:
    """Node id -> PASSED / FAILED / ERROR, from pytest's -rA summary lines (or tests/conftest.py's
    outcome log, in the same form)."""
    found = {}
    for line in log.splitlines():
        if match := _OUTCOME.match(line):
            found[match.group(2)] = match.group(1)
    return found


def records(out: Path) -> list[dict]:
    """Every record of the bench JSON files in ``out``."""
    return [r for path in sorted(out.glob("*.json")) for r in json.loads(path.read_text()).get("records", [])]


def _record(rows: list[dict], row: Row, name: str) -> dict | None:
    for r in rows:
        if (r["op"], r["shape_name"], r["implementation"], r.get("mode")) == (row.op, row.shape_name, name, row.mode):
            return r if r.get("status") == "ok" else None
    return None


def collected(prefixes) -> set[str]:
    """The node ids of the gpu tests in the files ``prefixes`` name, as pytest collects them (no GPU
    needed), so that a run its time limit cut off cannot pass for a complete one."""
    files = sorted({prefix.split("::")[0] for prefix in prefixes})
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:  # without the list a cut-off run could pass for a complete one
        raise RuntimeError(f"pytest could not collect {files} (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def pending_tests() -> list[str]:
    """The node ids of every gpu test a flag of PENDING waits for (gpu_check.sh's ``pending`` group
    runs them: ``pending_kernels.py --tests``)."""
    prefixes = tuple(prefix for pending in PENDING for prefix in pending.tests)
    return sorted(node for node in collected(prefixes) if node.startswith(prefixes))


def verdict(pending: Pending, tests: dict[str, str], rows: list[dict], expected: set[str] = frozenset()) -> tuple[bool, list[str]]:
    """Whether ``pending`` has earned its flag, and the facts that say so, one line each; every node
    of ``expected`` under its prefixes must have run."""
    ran = {node: outcome for node, outcome in tests.items() if node.startswith(pending.tests)}
    failed = sorted(node for node, outcome in ran.items() if outcome != "PASSED")
    missing = [prefix for prefix in pending.tests if not any(node.startswith(prefix) for node in ran)]
    not_run = sorted(node for node in expected if node.startswith(pending.tests) and node not in ran)
    lines = [
        f"tests: {len(ran) - len(failed)} passed, {len(failed)} failed, {len(not_run)} not run"
        + "".join(f"\n    {n}" for n in failed)
    ]
    lines += [f"    no test ran for {prefix}" for prefix in missing]
    earned = bool(ran) and not failed and not missing and not not_run
    for row in pending.rows:
        mine, theirs = _record(rows, row, row.candidate), _record(rows, row, row.incumbent)
        case = f"{row.op} {row.shape_name}{' ' + row.mode if row.mode else ''}"
        if mine is None or theirs is None:
            lines.append(f"{case}: no timing of {row.candidate if mine is None else row.incumbent}")
            earned = False
            continue
        errors = [(k, mine["accuracy"][k], theirs["accuracy"].get(k)) for k in mine.get("accuracy") or {}]
        worse = [k for k, a, b in errors if b is not None and a > 2 * b + 1e-12]
        faster = mine["median_ms"] < theirs["median_ms"]
        earned = earned and faster and not worse
        accuracy = ", ".join(f"{k} {a:.1e} vs {b:.1e}" for k, a, b in errors if b is not None)
        lines.append(
            f"{case}: {row.candidate} {mine['median_ms']:.3g} ms vs {row.incumbent} {theirs['median_ms']:.3g} ms "
            f"({mine['median_ms'] / theirs['median_ms']:.2f}x); {accuracy}"
        )
    return earned, lines


def flag_value(flag: str):
    module, attribute = flag.split(":")
    return getattr(importlib.import_module(module), attribute)


def main(out: Path, more_results: tuple[Path, ...] = ()) -> int:
    tests = {}
    for name in ("tests.log", "outcomes.log"):  # the outcome log also holds what a cut-off run finished
        if (out / name).exists():
            tests |= outcomes((out / name).read_text())
    rows = records(out) + [r for path in more_results for r in json.loads(path.read_text()).get("records", [])]
    expected = set(pending_tests())
    print("== pending kernels: flip a flag only where the verdict says so")
    for pending in PENDING:
        name = pending.flag.split(":")[1]
        if flag_value(pending.flag):
            print(f"{name}: already True; its entry in PENDING goes")
            continue
        earned, lines = verdict(pending, tests, rows, expected)
        print(f"{name}: {'flip to True' if earned else 'keep False'}")
        for line in lines:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--tests"]:
        print("\n".join(pending_tests()))
        raise SystemExit(0)
    raise SystemExit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/jaxforge-gpu"), tuple(map(Path, sys.argv[2:]))))
