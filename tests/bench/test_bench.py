"""Smoke tests of the benchmark runner on tiny shapes (``quick``)."""

import datetime
import json
import re

import numpy as np
import pytest

from jaxforge.bench import format_table, run
from jaxforge.bench._timing import median_times


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("results")
    return run("linalg", quick=True, out_dir=out_dir), out_dir


def test_calls_are_timed_in_interleaved_rounds_until_each_has_its_repeats():
    order = []
    calls = {name: (lambda name=name: order.append(name), ()) for name in "abc"}
    timings = median_times(calls, min_repeats=3, max_seconds=0.0, max_repeats=30, once=["c"])
    assert order == ["a", "b", "c", "a", "b", "a", "b"]  # c, slow, once; then rounds of a and b
    assert [len(timings[name].times) for name in "abc"] == [3, 3, 1]
    assert all(timings[name].median == np.median(timings[name].times) for name in "abc")
    order.clear()
    assert [len(t.times) for t in median_times(calls, min_repeats=1, max_seconds=1e9, max_repeats=4).values()] == [4] * 3
    assert order == list("abc") * 4


def test_a_call_that_raises_stops_only_itself():
    calls = {"ok": (lambda: None, ()), "fails": (lambda: 1 / 0, ())}
    timings = median_times(calls, min_repeats=3, max_seconds=0.0)
    assert isinstance(timings["fails"], ZeroDivisionError) and len(timings["ok"].times) == 3


def test_every_op_has_timed_accurate_records(quick_run):
    records, _ = quick_run
    assert {r["op"] for r in records} == {"svd", "svd_f64", "svd_c64", "svdvals", "pinv", "polar", "lstsq", "lstsq_grad"}
    for op in ("svd", "svd_f64", "svd_c64", "svdvals", "pinv", "polar", "lstsq"):
        assert {"jaxforge", "jnp"} <= {r["implementation"] for r in records if r["op"] == op}
    assert {(r["shape_name"], r["implementation"]) for r in records if r["op"] == "lstsq_grad"} == {
        ("quick_tall", "jaxforge"),
        ("quick_tall", "jnp-qr"),
    }
    for r in records:
        if r["implementation"] == "torch":  # CUDA's lstsq refuses wide systems: recorded, not raised
            continue
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and all(t > 0 for t in r["times_ms"])
        assert r["ratio"] > 0
        assert r["accuracy"] and all(0 <= v < (1e-12 if r["op"] == "svd_f64" else 1e-4) for v in r["accuracy"].values()), r
    assert all(r["ratio"] == 1.0 for r in records if r["implementation"] == "jaxforge")


def test_results_are_written_as_json(quick_run):
    records, out_dir = quick_run
    (path,) = out_dir.glob("*-linalg-quick.json")
    saved = json.loads(path.read_text())
    assert saved["family"] == "linalg" and saved["jax_version"] and saved["device"] and saved["complete"]
    assert saved["records"] == records
    assert not list(out_dir.glob("*.tmp"))  # written whole, then renamed


class _Killed(BaseException):
    """What a time limit's kill is to the run: nothing in it catches this."""


def _killed_at(label: str):
    """A progress callback that stops the run where ``label`` is about to be measured."""

    def progress(done, total, text):
        if text.startswith(label):
            raise _Killed(text)

    return progress


def test_a_run_cut_off_leaves_the_shapes_it_finished(tmp_path):
    with pytest.raises(_Killed):
        run("linalg", quick=True, shapes=["quick_tall", "quick_wide"], out_dir=tmp_path, progress=_killed_at("svd quick_wide"))
    (path,) = tmp_path.glob("*-linalg-quick.json")
    saved = json.loads(path.read_text())
    assert saved["complete"] is False
    assert path.name.startswith(saved["date"])
    assert {(r["op"], r["shape_name"]) for r in saved["records"]} == {("svd", "quick_tall")}
    assert all(r["status"] == "ok" for r in saved["records"] if r["implementation"] == "jaxforge")


def test_every_write_of_a_run_carries_the_date_it_started(tmp_path):
    """The checkpoints and the last write name one file, even when the day changes during the run."""
    started = datetime.date(2001, 2, 3)  # not today
    run("linalg", quick=True, shapes=["quick_wide"], out_dir=tmp_path, date=started, budget_s=0.0)
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("2001-02-03-") and json.loads(path.read_text())["date"] == "2001-02-03"


def test_table_has_one_row_per_record(quick_run):
    records, _ = quick_run
    assert len(format_table(records).splitlines()) == len(records) + 1


def test_shapes_filter_by_name():
    records = run("linalg", quick=True, shapes=["quick_wide"])
    assert {r["shape_name"] for r in records} == {"quick_wide"}
    assert {r["op"] for r in records} == {"svd", "svd_f64", "svd_c64", "svdvals", "pinv", "polar", "lstsq"}
    records = run("linalg", quick=True, shapes=["lstsq:quick_wide"], budget_s=0.0)  # one op's only
    assert {(r["op"], r["shape_name"]) for r in records} == {("lstsq", "quick_wide")}


def test_past_the_budget_only_jaxforge_is_measured():
    records = run("linalg", quick=True, shapes=["quick_tall"], budget_s=0.0)
    for r in records:
        if r["implementation"] == "jaxforge":
            assert r["status"] == "ok" and r["ratio"] == 1.0
        else:
            assert r["status"] == "skipped" and "time budget" in r["reason"], r
    assert len(records) > 2  # both ops, with their anchors
    records = run("linalg", quick=True, shapes=["quick_tall"], budget_s=(0.0, 0.0))  # and past ALL, none
    assert {r["status"] for r in records} == {"skipped"} and len(records) > 2


def test_a_timed_row_without_a_jaxforge_time_has_no_ratio():
    record = dict(op="attention", mode="fwd", shape_name="s", shape=[1], implementation="x", status="ok",
                  median_ms=1.0, ratio=None, accuracy={"out": 1e-3}, tflops=None)  # fmt: skip
    assert format_table([record]).splitlines()[1].split()[-4:] == ["1.000", "-", "out", "1.0e-03"]


def test_unknown_family_or_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown benchmark family 'nope'.*linalg"):
        run("nope")
    with pytest.raises(ValueError, match="unknown shape name"):
        run("linalg", quick=True, shapes=["no_such_shape"])


# ---------------------------------------------------------------- attention


@pytest.fixture(scope="module")
def attention_run(tmp_path_factory):
    # One tiny case covers GQA, Dv != D, the document & causal mask and every mode, in a few seconds.
    out_dir = tmp_path_factory.mktemp("attention")
    return run("attention", quick=True, shapes=["quick_gqa_document"], out_dir=out_dir), out_dir


def test_attention_records_every_mode_timed_and_accurate(attention_run):
    records, _ = attention_run
    assert {r["op"] for r in records} == {"attention"}
    assert {r["shape_name"] for r in records} == {"quick_gqa_document"}
    assert {(r["mode"], r["implementation"]) for r in records} >= {
        (mode, impl) for mode in ("fwd", "fwd+bwd", "jvp") for impl in ("jaxforge", "jax.nn-xla")
    }
    fields = {"shape", "status", "reason", "first_call_ms", "times_ms", "median_ms", "ratio", "accuracy", "tflops"}
    expected_errors = {"fwd": {"out"}, "fwd+bwd": {"dq", "dk", "dv"}, "jvp": {"out", "dout"}}
    for r in records:
        assert fields <= set(r), r
        if r["implementation"] in ("jaxforge-mask-mod", "jaxforge-array", "jaxforge-one-range"):  # plain mask_mod cases only
            assert r["status"] == "skipped" and "only the frames_causal and sinks_window_causal cases" in r["reason"] or (
                "only the sinks_window_causal case" in r["reason"]
            ), r
            continue
        assert r["status"] == "ok", r  # on CPU every other contender expresses every quick case
        assert r["median_ms"] > 0 and all(t > 0 for t in r["times_ms"])
        assert r["ratio"] > 0
        assert set(r["accuracy"]) == expected_errors[r["mode"]]
        assert all(0 <= v < 1e-4 for v in r["accuracy"].values()), r  # float32 against the float32 reference
        if r["mode"] == "jvp":  # no FLOP convention: the time over the same implementation's forward instead
            assert r["tflops"] is None and r["time_over_fwd"] > 0
        else:
            assert r["tflops"] > 0
    assert all(r["ratio"] == 1.0 for r in records if r["implementation"] == "jaxforge")


def test_attention_results_are_written_as_json(attention_run):
    records, out_dir = attention_run
    (path,) = out_dir.glob("*-attention-quick.json")
    saved = json.loads(path.read_text())
    assert saved["family"] == "attention" and saved["records"] == records and saved["complete"]
    assert len(format_table(records).splitlines()) == len(records) + 1


def test_an_attention_run_cut_off_leaves_the_modes_it_finished(tmp_path):
    with pytest.raises(_Killed):
        run("attention", quick=True, shapes=["quick_causal"], modes=["fwd", "jvp"], out_dir=tmp_path, progress=_killed_at("quick_causal jvp"))
    (path,) = tmp_path.glob("*-attention-quick.json")
    saved = json.loads(path.read_text())
    status = {(r["mode"], r["implementation"]): r["status"] for r in saved["records"]}
    assert saved["complete"] is False and status[("fwd", "jaxforge")] == "ok" and status[("fwd", "jax.nn-xla")] == "ok"
    assert {s for (mode, _), s in status.items() if mode == "jvp"} == {"skipped"}


def test_attention_budget_measures_the_essential_contenders_of_every_case_first():
    # soft limit 0: the optional contenders (everything but jaxforge on CPU) are skipped, on every
    # case, while jaxforge is measured on both cases; the records keep the case/mode/contender order
    cases = ["quick_causal", "quick_frames", "quick_gqa_document", "quick_alibi"]  # by size
    records = run("attention", quick=True, shapes=cases[::-1], budget_s=(0.0, float("inf")))
    assert list(dict.fromkeys(r["shape_name"] for r in records)) == cases
    for case in cases:
        rows = [r for r in records if r["shape_name"] == case]
        assert [r["mode"] for r in rows if r["implementation"] == "jaxforge"] == ["fwd", "fwd+bwd", "jvp"]
        for r in rows:
            if r["implementation"] == "jaxforge":
                assert r["status"] == "ok" and r["ratio"] == 1.0, r
                assert all(0 <= e < 1e-4 for e in r["accuracy"].values()), r  # ALiBi's bias in the reference too
            else:
                assert r["status"] == "skipped" and "soft limit" in r["reason"], r
    hard = run("attention", quick=True, shapes=["quick_causal"], budget_s=(0.0, 0.0))
    assert all(r["status"] == "skipped" for r in hard) and len(format_table(hard).splitlines()) == len(hard) + 1


def test_attention_cases_with_anchor_targets_run_first():
    # a zero budget measures nothing: only the order of the (skipped) records is looked at
    records = run("attention", shapes=["odd_cross", "mla_192_128", "long_d128", "short_d64"], budget_s=(0.0, 0.0))
    order = list(dict.fromkeys(r["shape_name"] for r in records))
    assert order == ["short_d64", "long_d128", "odd_cross", "mla_192_128"]  # anchored, then by size
    assert all(r["status"] == "skipped" for r in records)


def test_attention_flops_count_the_visible_scores():
    from jaxforge.bench.attention import FRAMES, SINKS, WINDOW, Case, _segment_ids, _visible_fraction

    def dense_fraction(case, seg):  # every (batch item, query, key) of the mask, counted
        q, kv = np.arange(case.sq)[:, None], np.arange(case.skv)[None, :]
        if case.mask == "frames_causal":
            frame = case.sq // FRAMES
            return (q // frame >= kv // frame).mean()
        if case.mask == "sinks_window_causal":
            return ((kv <= q) & ((kv < SINKS) | (q - kv < WINDOW))).mean()
        if seg is None:
            visible = np.broadcast_to((kv <= q) & (q - kv < WINDOW), (case.batch, case.sq, case.skv))
        else:
            visible = (kv <= q) & (seg[:, :, None] == seg[:, None, :])
        return visible.mean()

    assert _visible_fraction(Case("c", (1, 64, 64, 1, 1, 8, 8), "causal", np.float32), None) == 0.5  # ANCHORS.md
    assert _visible_fraction(Case("n", (1, 64, 64, 1, 1, 8, 8), None, np.float32), None) == 1.0
    for case in (
        Case("w", (1, 3000, 3000, 1, 1, 8, 8), "sliding_window_causal", np.float32),
        Case("d", (3, 500, 500, 1, 1, 8, 8), "document_causal", np.float32),
        Case("f", (1, 2048, 2048, 1, 1, 8, 8), "frames_causal", np.float32),
        Case("f", (1, 2050, 2050, 1, 1, 8, 8), "frames_causal", np.float32),  # a ninth frame of 2
        Case("s", (1, 3000, 2500, 1, 1, 8, 8), "sinks_window_causal", np.float32),
        Case("s", (1, 1000, 2, 1, 1, 8, 8), "sinks_window_causal", np.float32),  # fewer keys than sinks
    ):
        seg = _segment_ids(case)
        assert _visible_fraction(case, seg) == pytest.approx(dense_fraction(case, seg), rel=1e-12)


def test_attention_frames_compare_the_evaluated_mask_with_the_plain_mask_mod():
    """quick_frames: jaxforge takes the frames through jf.masks.block_mask, jaxforge-mask-mod the
    same function as a plain mask_mod, jaxforge-array the boolean array jax.nn takes; all against
    the dense reference (jaxforge's every mode:
    test_attention_budget_measures_the_essential_contenders_of_every_case_first)."""
    records = run("attention", quick=True, shapes=["quick_frames"], modes=["fwd"])
    rows = {(r["mode"], r["implementation"]): r for r in records}
    assert rows[("fwd", "jaxforge-one-range")]["note"] is None  # skipped: no block mask built for it
    for mode in ("fwd",):
        for impl in ("jaxforge", "jaxforge-mask-mod", "jaxforge-array", "jax.nn-xla"):
            r = rows[(mode, impl)]
            assert r["status"] == "ok" and all(e < 1e-4 for e in r["accuracy"].values()), r


def test_attention_sinks_and_window_compare_two_ranges_with_one_and_the_plain_mask_mod():
    """quick_sinks_window: jaxforge cuts the rows past the window's reach into two pieces
    (``block_mask(ranges=2)``), jaxforge-one-range keeps one range a row, jaxforge-mask-mod passes
    the function as it is; all against the dense reference."""
    from jaxforge.bench.attention import QUICK_SHAPES, Case, _built_mask

    dims, mask, _ = QUICK_SHAPES["quick_sinks_window"]
    assert len(_built_mask(Case("s", dims, mask, np.float32), 2)[0].pieces()) == 2
    records = run("attention", quick=True, shapes=["quick_sinks_window"], modes=["fwd"])
    rows = {r["implementation"]: r for r in records}
    for impl in ("jaxforge", "jaxforge-one-range", "jaxforge-mask-mod", "jaxforge-array", "jax.nn-xla"):
        assert rows[impl]["status"] == "ok" and all(e < 1e-4 for e in rows[impl]["accuracy"].values()), rows[impl]
    for impl, ranges in (("jaxforge", 2), ("jaxforge-one-range", 1)):  # built once, outside the timed calls
        assert re.fullmatch(rf"block_mask\(ranges={ranges}\) built before the timed calls in [\d.]+ ms", rows[impl]["note"]), rows[impl]


def test_attention_unknown_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown shape name"):
        run("attention", quick=True, shapes=["no_such_shape"])


def test_attention_variants_are_timed_beside_the_default():
    from jaxforge.bench.attention import parse_variant, variant_name

    variant = parse_variant("32x16w2s3")
    assert (variant.name, variant.block_q, variant.block_kv, variant.num_warps, variant.num_stages) == ("pallas_triton", 32, 16, 2, 3)
    assert variant_name(parse_variant("-x64w-s-")) == "jaxforge[-x64w-s-]"
    with pytest.raises(ValueError, match="a variant is BQxBKVwWARPSsSTAGES"):
        parse_variant("128x64")
    records = run("attention", quick=True, shapes=["quick_causal"], variants=[variant])
    rows = [r for r in records if r["implementation"] == "jaxforge[32x16w2s3]"]
    assert [r["mode"] for r in rows] == ["fwd", "fwd+bwd", "jvp"]
    assert all(r["status"] == "ok" and all(v < 1e-4 for v in r["accuracy"].values()) for r in rows), rows


def test_attention_second_order_modes_on_request():
    """``modes`` picks among fwd, fwd+bwd, jvp, hvp (a jvp of the gradient), jvp2 (a jvp of the
    jvp) and jvp-grad (a gradient through the jvp), each checked against the reference's."""
    modes = ("fwd", "hvp", "jvp2", "jvp-grad")
    records = run("attention", quick=True, shapes=["quick_gqa_document"], modes=modes)
    implementations = ("jaxforge", "jaxforge-mask-mod", "jaxforge-array", "jaxforge-one-range", "jax.nn-xla")
    assert {(r["mode"], r["implementation"]) for r in records} == {(m, i) for m in modes for i in implementations}
    names = {"fwd": {"out"}, "hvp": {"hq", "hk", "hv"}, "jvp2": {"ddout"}, "jvp-grad": {"jgq", "jgk", "jgv"}}
    for r in records:
        if r["implementation"] in ("jaxforge-mask-mod", "jaxforge-array", "jaxforge-one-range"):  # plain mask_mod cases only
            assert r["status"] == "skipped", r
            continue
        assert r["status"] == "ok", r
        assert set(r["accuracy"]) == names[r["mode"]]
        assert all(0 <= v < 1e-4 for v in r["accuracy"].values()), r
        if r["mode"] != "fwd":
            assert r["tflops"] is None and r["time_over_fwd"] > 0
    with pytest.raises(ValueError, match="modes"):
        run("attention", quick=True, shapes=["quick_causal"], modes=("fwd", "hessian"))


def test_gpu_svd_algorithm_variants_are_accurate_and_gated_to_large_shapes():
    # On a GPU every choice of the large-SVD dispatch is timed beside jnp's default; those that need
    # no cuSOLVER-only algorithm (gesvd is LAPACK's, QDWH is jax ops) also run here.
    from jaxforge.bench import linalg

    variants = {impl.name: impl for impl in linalg._svd_algorithms()}
    methods = ("gesvd", "gesvdj", "gesvdp", "qdwh")
    assert set(variants) == {f"svd-{method}" for method in methods} | {f"svd-qr-{method}" for method in methods}
    assert not any(v.applies((8192, 32, 32)) for v in variants.values())
    assert not variants["svd-qr-qdwh"].applies((1, 2048, 2048)) and variants["svd-qr-qdwh"].applies((1, 8192, 512))
    (a,) = linalg._svd_inputs((1, 1024, 512))
    for name in ("svd-gesvd", "svd-qr-gesvd", "svd-qdwh", "svd-qr-qdwh"):
        outputs = [np.asarray(x, np.float64) for x in variants[name].fn(a)]
        accuracy = linalg._svd_accuracy((np.asarray(a, np.float64),), outputs)
        assert accuracy["reconstruction"] < 1e-5 and accuracy["orthogonality"] < 2e-4, (name, accuracy)


def test_gpu_kernel_contenders_are_gated_to_the_shapes_their_kernels_serve():
    from jaxforge.bench import linalg

    rows, lanes, pairs, block, slots = linalg._svd_kernel_variants()
    for kernel in (rows, lanes, pairs):  # one warp a matrix: m, n <= 32
        assert kernel.applies((8192, 32, 32)) and not kernel.applies((1024, 64, 64)), kernel.name
    assert block.applies((8192, 32, 32)) and block.applies((1024, 64, 64)) and slots.applies((1024, 64, 64))
    assert not slots.applies((8192, 32, 32)) and slots.applies((256, 128, 128)) and slots.applies((4, 37, 128))
    assert slots.applies((4, 100, 20)) and block.applies((256, 128, 128)) and not slots.applies((7, 256, 100))
    householder, qr_r, qr_solve, qr_solve_warp, cholesky = linalg._lstsq_factors()
    assert qr_r.applies((8192, 64, 16, 1)) and not qr_r.applies((256, 512, 128, 4))  # 40 KiB at most
    assert qr_solve.applies((8192, 64, 16, 1)) and qr_solve.applies((7, 37, 61, 3))  # wide too: Aᵀ fits
    assert not qr_solve.applies((256, 512, 128, 4))
    assert qr_solve_warp.applies((8192, 64, 16, 1)) and not qr_solve_warp.applies((7, 37, 61, 3))  # tall only
    assert not qr_solve_warp.applies((5, 200, 30, 2))  # 200 rows
    assert cholesky.applies((256, 512, 128, 4)) and not cholesky.applies((7, 37, 61, 3))  # tall only
    (a, b) = linalg._lstsq_inputs((2, 300, 40, 2))  # the two that need no kernel also run here
    for row in (householder, cholesky):
        assert linalg._lstsq_accuracy((a, b), row.fn(a, b))["normal_residual"] < 1e-5, row.name


def test_the_pieces_contender_runs_only_where_a_head_dim_splits():
    """jaxforge-pieces times the default with head dims in two pieces (config.head_pieces) where it
    would differ from the default: MLA's 192/128 and 576/512, not 128/128."""
    import jax.numpy as jnp

    from jaxforge.bench.attention import Case, _jf_pieces

    assert "one piece" in _jf_pieces(Case("d128", (1, 32, 32, 2, 2, 128, 128), None, np.float32))
    for dims in ((1, 32, 32, 2, 2, 192, 128), (1, 1, 32, 4, 1, 576, 512)):
        attend = _jf_pieces(Case("mla", dims, None, np.float32))
        b, sq, skv, hq, hkv, d, dv = dims
        q, k, v = (jnp.ones(s, jnp.float32) for s in ((b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv)))
        assert attend(q, k, v, None).shape == (b, sq, hq, dv)
