"""The attention benchmark: ``jf.attention`` forward, gradient and JVP against its anchors.

Each case of ``jaxforge.primitives.attention.attention.SHAPES`` (``bench_gpu`` in bfloat16 on a
GPU, ``bench_cpu`` in float32 elsewhere) is measured in three modes, and two more on request:

* ``fwd``: ``attention(q, k, v)``;
* ``fwd+bwd``: ``jax.grad`` of ``sum(out * do)`` with respect to q, k and v (torch: the same
  through ``torch.autograd.grad``);
* ``jvp``: ``jax.jvp`` with respect to q, k and v, giving ``(out, dout)``;
* ``hvp`` (asked for by ``modes``): ``jax.jvp`` of the ``fwd+bwd`` gradient along the jvp's
  tangents, a Hessian-vector product (forward over reverse), giving the gradient's tangents;
* ``jvp2`` (asked for by ``modes``): ``jax.jvp`` of the jvp's ``dout`` along the same tangents,
  the second directional derivative ``ddout`` (forward over forward, Taylor mode);
* ``jvp-grad`` (asked for by ``modes``): ``jax.grad`` of ``sum(sin(dout))`` with respect to q, k
  and v, a gradient through the jvp (reverse over forward: consistency-model training).

Contenders (shared/ANCHORS.md), all timed in this process on the default device: jaxforge with
its default implementation (and, on a GPU, ``implementation="xla"`` too); ``jax.nn.dot_product_attention``
with ``implementation="xla"`` everywhere and ``"cudnn"`` on a GPU; on a GPU, the Pallas Triton
``mha`` of ``jax.experimental.pallas.ops.gpu.attention``; on a Hopper, jaxforge on its Triton
kernels by name (``jaxforge-triton``: the default there runs the Mosaic GPU ones) and jax's
FlashAttention-3 ``attention_mgpu``; on a GPU, jaxforge's Triton kernels by name where the default
does not yet run them (``jaxforge-decoding``: GQA packing and split-KV on decoding shapes;
``jaxforge-pieces``: head dims that are no power of two in two pieces); where
torch with CUDA is importable,
``torch.nn.functional.scaled_dot_product_attention`` on its cuDNN and flash backends and compiled
``torch.nn.attention.flex_attention`` on the masked cases. A contender that cannot express a case
(a mask it has no way to take, GQA, unequal head dims, forward-mode AD) is recorded as skipped with
the reason; one that raises is recorded as an error.

TFLOP/s follow ANCHORS.md: a forward costs ``2·B·Sq·Skv·Hq·(D + Dv)`` (= ``4·B·S²·H·D`` for equal
head dims) times the visible fraction of the score matrix: 1/2 for causal by convention, counted
exactly for the sliding-window and document masks; fwd+bwd counts 3.5 forwards. JVP has no FLOP
convention: its records give the time over the same implementation's forward time instead.

Accuracy is the max abs error of each output against a float32 reference: jax.nn's XLA attention
on the float32-cast inputs at ``highest`` matmul precision, one (batch item, key/value head) at a
time so that its memory stays small (v is zero-padded when its head dim differs, which changes
nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxforge as jf
from jaxforge.bench._timing import error_record, median_times, timed_call, timed_record, untimed_record
from jaxforge.lowering import build
from jaxforge.lowering.attention.attention import config
from jaxforge.primitives.attention.attention import SHAPES

__all__ = ["ALL_MODES", "MODES", "OPS", "QUICK_SHAPES", "WINDOW", "measure", "parse_variant", "variant_name"]

MODES = ("fwd", "fwd+bwd", "jvp")  # the default
ALL_MODES = (*MODES, "hvp", "jvp2", "jvp-grad")
_FORWARD_AD_MODES = ("jvp", "hvp", "jvp2", "jvp-grad")  # a contender without forward-mode AD skips these
WINDOW = 1024  # the "sliding_window_causal" mask: the query and the 1023 keys before it
# "frames_causal": the sequence cut into this many frames, each query seeing its own frame and those
# before (video and world-model training): a plain mask_mod, which jaxforge takes through
# jf.masks.block_mask, and torch's flex_attention through create_block_mask.
FRAMES = 8
# "sinks_window_causal" (StreamingLLM): the first SINKS keys and the WINDOW keys up to the query, a
# plain mask_mod with a gap between the two in each long row; jaxforge cuts its rows there
# (jf.masks.block_mask(ranges=2)), torch's flex_attention lists the tiles (create_block_mask).
SINKS = 4
DOCUMENTS = (3, 6)  # "document_causal": this many documents (inclusive range) per batch item, random lengths
BWD_FLOPS = 3.5  # fwd+bwd counts 3.5 forwards (backward = 2.5, the flash-attn convention)
SEED = 0

# Tiny cases for smoke tests: ((batch, Sq, Skv, Hq, Hkv, D, Dv), mask, tags), like SHAPES.
QUICK_SHAPES = {
    "quick_causal": ((1, 128, 128, 2, 2, 32, 32), "causal", ("quick",)),
    "quick_gqa_document": ((1, 128, 128, 4, 2, 32, 16), "document_causal", ("quick",)),
    "quick_alibi": ((1, 128, 128, 4, 4, 32, 32), "alibi_causal", ("quick",)),
    "quick_frames": ((1, 128, 128, 2, 2, 32, 32), "frames_causal", ("quick",)),
    "quick_sinks_window": ((1, 1280, 1280, 1, 1, 16, 16), "sinks_window_causal", ("quick",)),  # rows from 1055 cut
}

# Timed calls after the first (compiling) one and `warmups` more: at least `min_repeats`, then
# more until `max_seconds` of timed calls or `max_repeats` calls; a call slower than
# `max_seconds` is timed once.
_REPEATS = {
    "quick": dict(warmups=0, min_repeats=1, max_repeats=2, max_seconds=0.05),
    "cpu": dict(warmups=1, min_repeats=3, max_repeats=10, max_seconds=1.0),
    "gpu": dict(warmups=1, min_repeats=3, max_repeats=10, max_seconds=0.2),
}
# Seconds from the start of a GPU run after which contenders are no longer measured: the essential
# ones (jaxforge, the anchors with ANCHORS.md targets) run first on every case until the hard limit,
# the others after them until the soft limit. A first H200 run took about 20 s per case for the
# essential ones alone, compilation and torch.compile included.
GPU_BUDGET_S = (180.0, 180.0)
REFERENCE_MEMORY_FRACTION = 0.5  # of the device's memory, for one batch item and key/value head

_NO_TORCH_JVP = "torch has no forward-mode AD for SDPA or flex_attention (pytorch#154332)"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dims: tuple[int, int, int, int, int, int, int]  # (batch, Sq, Skv, Hq, Hkv, D, Dv)
    mask: str | None  # None, "causal", "sliding_window_causal", "document_causal", "alibi_causal", "frames_causal"
    # or "sinks_window_causal"
    dtype: type

    batch = property(lambda self: self.dims[0])
    sq = property(lambda self: self.dims[1])
    skv = property(lambda self: self.dims[2])
    hq = property(lambda self: self.dims[3])
    hkv = property(lambda self: self.dims[4])
    d = property(lambda self: self.dims[5])
    dv = property(lambda self: self.dims[6])

    @property
    def scale(self) -> float:
        return 1 / math.sqrt(self.d)

    @property
    def frame(self) -> int:
        """The frame length of "frames_causal" (a remainder makes one more, shorter frame)."""
        return max(self.sq // FRAMES, 1)

    @property
    def dense_flops(self) -> int:
        """A forward over the whole score matrix: two matmuls, ``2·B·Sq·Skv·Hq·(D + Dv)``."""
        b, sq, skv, hq, _, d, dv = self.dims
        return 2 * b * sq * skv * hq * (d + dv)


@dataclasses.dataclass(frozen=True)
class Inputs:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    seg: jax.Array | None  # (batch, S) int32 segment ids of "document_causal", else None
    do: jax.Array  # cotangent of out (fwd+bwd)
    dq: jax.Array  # tangents (jvp)
    dk: jax.Array
    dv: jax.Array


@dataclasses.dataclass(frozen=True)
class Contender:
    """One implementation: ``prepare(case, inputs, mode)`` gives ``(fn, args)`` or a skip reason.

    ``fn(*args)`` returns a tuple of outputs, ready on return: ``(out,)`` for fwd, ``(dq, dk, dv)``
    for fwd+bwd, ``(out, dout)`` for jvp. ``to_jax`` turns one output into a ``(B, S, H, D)`` jax
    array. ``essential(case)``: measured until the hard time limit, not only the soft one.
    """

    name: str
    prepare: Callable[[Case, Inputs, str], tuple[Callable, tuple] | str]
    to_jax: Callable = lambda x: x
    essential: Callable[[Case], bool] = lambda case: False
    note: Callable[[Case], str | None] = lambda case: None


@dataclasses.dataclass(frozen=True)
class _Op:
    name: str
    shapes: dict  # name -> ((batch, Sq, Skv, Hq, Hkv, D, Dv), mask, tags)
    contenders: Callable[[str], list[Contender]]  # backend -> contenders, jaxforge first


def measure(
    *,
    shapes: Sequence[str] | None = None,
    quick: bool = False,
    progress=None,
    budget_s=None,
    variants=(),
    modes=MODES,
    checkpoint=None,
) -> list[dict]:
    """Times every contender on each selected case in each mode; one record per triple.

    ``shapes`` names entries of ``SHAPES`` or ``QUICK_SHAPES``; the default is every case tagged
    for this run (``quick``, else ``bench_gpu`` on a GPU and ``bench_cpu`` elsewhere). Cases with
    ANCHORS.md targets run first, then smallest first; the essential contenders of every case
    before the others. ``budget_s``: ``(soft, hard)`` seconds (default: ``GPU_BUDGET_S`` on a GPU,
    none elsewhere). ``variants``: ``jf.attention`` Implementations (Triton tiles, warps, stages)
    measured as essential contenders beside the default one, named by ``variant_name``: a tuning
    sweep. ``modes``: some of ``ALL_MODES``. ``progress(done, total, label)`` is called before each
    measurement and at the end; ``checkpoint(records)``, if given, gets every record after each case
    and mode (those not yet measured marked skipped).
    """
    start = time.perf_counter()
    backend = jax.default_backend()
    op = OPS["attention"]
    if not modes or set(modes) - set(ALL_MODES):
        raise ValueError(f"modes {list(modes)}: each one of {list(ALL_MODES)}")
    if shapes is not None:
        unknown = sorted(set(shapes) - set(op.shapes))
        if unknown:
            raise ValueError(f"unknown shape name(s) {unknown}; known: {sorted(op.shapes)}")
    tag = "quick" if quick else "bench_gpu" if backend == "gpu" else "bench_cpu"
    names = [n for n, (_, _, tags) in op.shapes.items() if tag in tags] if shapes is None else list(shapes)
    dtype = jnp.bfloat16 if backend == "gpu" else jnp.float32
    cases = [Case(n, tuple(op.shapes[n][0]), op.shapes[n][1], dtype) for n in dict.fromkeys(names)]
    anchored = lambda c: "anchor" in op.shapes[c.name][2]  # noqa: E731  (cases with ANCHORS.md targets)
    cases.sort(key=lambda c: (not anchored(c), c.dense_flops, c.dense_flops * _visible_fraction(c, _segment_ids(c))))
    if budget_s is None and backend == "gpu" and not quick:
        budget_s = GPU_BUDGET_S
    soft, hard = budget_s if budget_s is not None else (math.inf, math.inf)
    repeats = _REPEATS["quick" if quick else "gpu" if backend == "gpu" else "cpu"]

    contenders = op.contenders(backend)
    contenders[1:1] = [
        _jax_contender(variant_name(v), _jf_forward(v), essential=lambda case: True) for v in variants
    ]
    total = len(cases) * len(modes) * len(contenders)
    measured: dict[tuple[str, str, str], dict] = {}
    # Under a budget, two passes: the essential contenders (jaxforge and the anchors with targets)
    # on every case, then the others while the soft limit allows, so that a budget cuts optional
    # rows, not cases. Without one, a single pass: every contender of a case and mode is timed in
    # the same interleaved rounds.
    passes = ((True,), (False,)) if math.isfinite(soft) or math.isfinite(hard) else ((True, False),)
    for kinds in passes:
        for case in cases:
            todo = [c for c in contenders if c.essential(case) in kinds]
            limits = {c.name: (hard, "hard") if c.essential(case) else (soft, "soft") for c in todo}
            in_time = any(time.perf_counter() - start <= limit for limit, _ in limits.values())
            inputs = _make_inputs(case) if in_time else None
            reference, ref_note = _reference(case, inputs, modes) if in_time else (None, None)
            for mode in modes:
                outcomes: dict[str, dict | _Ready] = {}  # compiled and checked first, then timed together
                for contender in todo:
                    if progress:
                        progress(len(measured) + len(outcomes), total, f"{case.name} {mode} {contender.name}")
                    elapsed, (limit, which) = time.perf_counter() - start, limits[contender.name]
                    if inputs is None or elapsed > limit:
                        reason = f"time budget: {elapsed:.0f} s into the run, past its {which} limit of {limit:.0f} s"
                        outcomes[contender.name] = _not_timed("skipped", reason)
                    else:
                        outcomes[contender.name] = _prepare(contender, case, inputs, mode, reference, repeats)
                ready = {name: r for name, r in outcomes.items() if isinstance(r, _Ready)}
                options = {k: v for k, v in repeats.items() if k != "warmups"}
                slow = [name for name, r in ready.items() if r.warm_s > options["max_seconds"]]
                timings = median_times({name: (r.fn, r.args) for name, r in ready.items()}, **options, once=slow)
                for contender in todo:
                    record, timing = outcomes[contender.name], timings.get(contender.name)
                    if isinstance(timing, Exception):
                        record = _error(timing)
                    elif isinstance(record, _Ready):
                        record = timed_record(record.first_s, timing, record.accuracy, tflops=None, time_over_fwd=None)
                    notes = [n for n in (contender.note(case), ref_note if record["status"] == "ok" else None) if n]
                    record["note"] = "; ".join(notes) or None
                    measured[case.name, mode, contender.name] = record
                if checkpoint:
                    checkpoint(_records(op, cases, modes, contenders, measured))
            del inputs, reference
    if progress:
        progress(total, total, "done")
    return _records(op, cases, modes, contenders, measured)


def _records(op, cases: list[Case], modes, contenders, measured: dict[tuple[str, str, str], dict]) -> list[dict]:
    """One record per (case, mode, contender), in that order, with ratios, TFLOP/s and time over the
    forward; a triple ``measured`` lacks (a run under way) is marked skipped."""
    not_yet = _not_timed("skipped", "not measured yet: the run was cut off before it")
    records: list[dict] = []
    for case in cases:
        fraction = _visible_fraction(case, _segment_ids(case))
        case_records = []
        for mode in modes:
            group = []
            for contender in contenders:
                record = dict(
                    op=op.name,
                    shape_name=case.name,
                    shape=list(case.dims),
                    mask=case.mask,
                    dtype=np.dtype(case.dtype).name,
                    implementation=contender.name,
                    mode=mode,
                )
                record.update(measured.get((case.name, mode, contender.name), not_yet))
                group.append(record)
            _add_ratios_and_tflops(group, case, mode, fraction)
            case_records += group
        _add_time_over_fwd(case_records)
        records += case_records
    return records


# ---------------------------------------------------------------- one measurement


class _Ready(NamedTuple):
    """A contender compiled, warmed up and checked in one case and mode, to be timed beside the others."""

    fn: Callable
    args: tuple
    first_s: float
    warm_s: float
    accuracy: dict[str, float] | None


def _prepare(contender: Contender, case: Case, inputs: Inputs, mode: str, reference, repeats: dict) -> dict | _Ready:
    """Compiles, warms up and checks one contender in one mode; skips and errors become records."""
    try:
        prepared = contender.prepare(case, inputs, mode)
        if isinstance(prepared, str):
            return _not_timed("skipped", prepared)
        fn, args = prepared
        first_s, outputs = timed_call(fn, *args)  # compiles, and gives the outputs to check
        warm_s = first_s
        for _ in range(repeats["warmups"]):
            warm_s = timed_call(fn, *args)[0]
        accuracy = _accuracy(mode, [contender.to_jax(x) for x in outputs], reference)
    except Exception as e:  # a contender's limits (a shape it refuses, no JVP rule) are data
        return _error(e)
    return _Ready(fn, args, first_s, warm_s, accuracy)


def _error(e: Exception) -> dict:
    return error_record(e, tflops=None, time_over_fwd=None)


def _not_timed(status: str, reason: str) -> dict:
    return untimed_record(status, reason, tflops=None, time_over_fwd=None)


def _add_ratios_and_tflops(group: list[dict], case: Case, mode: str, fraction: float) -> None:
    """ratio = contender time / jaxforge time in the same case and mode: > 1 means jaxforge is faster."""
    ours = next((r for r in group if r["implementation"] == "jaxforge" and r["status"] == "ok"), None)
    flops = case.dense_flops * fraction * {"fwd": 1.0, "fwd+bwd": BWD_FLOPS}.get(mode, math.nan)
    for r in group:
        if r["status"] != "ok":
            continue
        if ours is not None:
            r["ratio"] = round(r["median_ms"] / ours["median_ms"], 4)
        if math.isfinite(flops):
            r["tflops"] = float(f"{flops / (r['median_ms'] * 1e-3) / 1e12:.4g}")


def _add_time_over_fwd(records: list[dict]) -> None:
    """For fwd+bwd and jvp records: time over the same implementation's forward time."""
    fwd = {r["implementation"]: r for r in records if r["mode"] == "fwd" and r["status"] == "ok"}
    for r in records:
        base = fwd.get(r["implementation"])
        if r["mode"] != "fwd" and r["status"] == "ok" and base is not None:
            r["time_over_fwd"] = round(r["median_ms"] / base["median_ms"], 3)


# ---------------------------------------------------------------- cases, inputs, FLOPs


def _segment_ids(case: Case) -> np.ndarray | None:
    """``(batch, S)`` int32 ids of a few contiguous documents of random lengths (fixed seed)."""
    if case.mask != "document_causal":
        return None
    if case.sq != case.skv:
        raise ValueError(f"{case.name}: a document mask needs Sq == Skv, got {case.sq} and {case.skv}")
    rng = np.random.default_rng(SEED)
    rows = []
    for _ in range(case.batch):
        n_docs = int(rng.integers(DOCUMENTS[0], DOCUMENTS[1] + 1))
        cuts = np.sort(rng.choice(np.arange(1, case.sq), size=min(n_docs, case.sq) - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(case.sq), side="right"))
    return np.stack(rows).astype(np.int32)


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's per-head slopes ``2^(-8 (h + 1) / heads)``: "alibi_causal" adds ``slope_h (kv - q)``
    to the causal scores, read by jf.attention's score_mod from a captured array."""
    return (2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32)


def _alibi_bias(slopes, sq: int, skv: int):
    """The dense ``(1, H, Sq, Skv)`` float32 bias of ALiBi, as jax.nn takes it."""
    distance = (jnp.arange(skv)[None, :] - jnp.arange(sq)[:, None]).astype(jnp.float32)
    return (jnp.asarray(slopes)[:, None, None] * distance[None])[None]


def _visible_fraction(case: Case, seg) -> float:
    """The fraction of the score matrix a forward computes: 1/2 for causal (ANCHORS.md), else counted."""
    if case.mask is None:
        return 1.0
    if case.mask in ("causal", "alibi_causal"):
        return 0.5
    q = np.arange(case.sq)
    if case.mask == "sliding_window_causal":  # keys max(0, q - WINDOW + 1) ..= min(q, Skv - 1)
        visible = np.maximum(np.minimum(q, case.skv - 1) - np.maximum(q - WINDOW + 1, 0) + 1, 0)
        return float(visible.sum() / (case.sq * case.skv))
    if case.mask == "frames_causal":  # keys up to the end of q's frame
        return float(np.minimum((q // case.frame + 1) * case.frame, case.skv).sum() / (case.sq * case.skv))
    if case.mask == "sinks_window_causal":  # the window's keys, and the sinks before it
        window = np.minimum(q, case.skv - 1) - np.maximum(q - WINDOW + 1, 0) + 1
        sinks = np.minimum(min(SINKS, case.skv), np.maximum(q - WINDOW + 1, 0))
        return float((window + sinks).sum() / (case.sq * case.skv))
    if case.mask == "document_causal":  # keys from the start of q's document ..= q
        seg = _segment_ids(case) if seg is None else np.asarray(seg)
        starts_doc = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        start = np.maximum.accumulate(np.where(starts_doc, q, 0), axis=1)
        return float((q - start + 1).sum() / (case.batch * case.sq * case.skv))
    raise ValueError(f"unknown mask {case.mask!r}")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_normals(key, dims, dtype):
    b, sq, skv, hq, hkv, d, dv = dims
    shapes = [(b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv), (b, sq, hq, dv)]
    shapes += shapes[:3]  # tangents of q, k, v
    sizes = [math.prod(s) for s in shapes]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32).astype(dtype)  # one draw: one small program
    parts = jnp.split(flat, np.cumsum(sizes)[:-1].tolist())
    return tuple(p.reshape(s) for p, s in zip(parts, shapes))


def _make_inputs(case: Case) -> Inputs:
    q, k, v, do, dq, dk, dv = _random_normals(jax.random.key(SEED), case.dims, case.dtype)
    seg = _segment_ids(case)
    return Inputs(q, k, v, None if seg is None else jnp.asarray(seg), do, dq, dk, dv)


# ---------------------------------------------------------------- reference and accuracy

_ACCURACY_NAMES = {
    "fwd": ("out",), "fwd+bwd": ("dq", "dk", "dv"), "jvp": ("out", "dout"), "hvp": ("hq", "hk", "hv"), "jvp2": ("ddout",),
    "jvp-grad": ("jgq", "jgk", "jgv"),
}  # fmt: skip


@jax.jit
def _max_abs_error(x, ref):
    return jnp.max(jnp.abs(x.astype(jnp.float32) - ref))


def _accuracy(mode: str, outputs: list, reference: dict | None) -> dict[str, float] | None:
    if reference is None:
        return None
    names = _ACCURACY_NAMES[mode]
    if len(outputs) != len(names):
        raise ValueError(f"{mode}: expected {len(names)} outputs ({', '.join(names)}), got {len(outputs)}")
    return {n: float(_max_abs_error(x, reference[n])) for n, x in zip(names, outputs)}


def _device_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _reference(case: Case, x: Inputs, modes: Sequence[str]) -> tuple[dict | None, str | None]:
    """float32 ``out``, ``dq, dk, dv``, ``dout`` (and ``hq, hk, hv``, ``ddout``, ``jgq, jgk, jgv``
    where ``modes`` has "hvp", "jvp2", "jvp-grad"), or None and why there is none."""
    # One (batch item, kv head) at a time: its scores, their tangents and cotangents in float32.
    item_bytes = 8 * (case.hq // case.hkv) * case.sq * case.skv * 4
    memory = _device_memory_bytes()
    if memory is not None and item_bytes > REFERENCE_MEMORY_FRACTION * memory:
        return None, f"no accuracy: the float32 reference needs ~{item_bytes / 2**30:.0f} GiB per head, more than it may take"
    try:
        with jax.default_matmul_precision("highest"):
            fn = _reference_fn(case, "hvp" in modes, "jvp2" in modes, "jvp-grad" in modes)
            out, (gq, gk, gv), dout, hvp, ddout, jvp_grad = fn(x.q, x.k, x.v, x.seg, x.do, x.dq, x.dk, x.dv)
        second = dict(zip(("hq", "hk", "hv"), hvp)) | dict(zip(("ddout",), ddout)) | dict(zip(("jgq", "jgk", "jgv"), jvp_grad))
        return dict(out=out, dq=gq, dk=gk, dv=gv, dout=dout, **second), None
    except Exception as e:  # e.g. out of memory: the timings still stand
        return None, f"no accuracy: the float32 reference failed ({type(e).__name__}: {str(e)[:150]})"


def _reference_fn(case: Case, hvp: bool, jvp2: bool, jvp_grad: bool):
    attend = _jnn_forward(case, "xla")
    bsz, hkv = case.batch, case.hkv

    def split(x):  # (B, S, Hkv*h, D) -> (B*Hkv, 1, S, h, D): one item per batch item and kv head
        b, s, h, d = x.shape
        x = x.astype(jnp.float32).reshape(b, s, hkv, h // hkv, d)
        return jnp.swapaxes(x, 1, 2).reshape(b * hkv, 1, s, h // hkv, d)

    def merge(x):  # the inverse of split
        _, _, s, h, d = x.shape
        return jnp.swapaxes(x.reshape(bsz, hkv, s, h, d), 1, 2).reshape(bsz, s, hkv * h, d)

    def one(item):
        q, k, v, seg, slopes, do, dq, dk, dv = item
        fn = lambda q, k, v: attend(q, k, v, seg, slopes)  # noqa: E731
        x, d = (q, k, v), (dq, dk, dv)
        tangent = lambda *a: jax.jvp(fn, a, d)[1]  # noqa: E731
        out, vjp = jax.vjp(fn, *x)
        hv = jax.jvp(lambda *a: jax.vjp(fn, *a)[1](do), x, d)[1] if hvp else ()
        jg = jax.grad(lambda *a: jnp.sum(jnp.sin(tangent(*a))), argnums=(0, 1, 2))(*x) if jvp_grad else ()
        if jvp2:  # the jvp of the tangent gives the tangent too
            dout, ddout = jax.jvp(tangent, x, d)
            return out, vjp(do), dout, hv, (ddout,), jg
        return out, vjp(do), tangent(*x), hv, (), jg

    @jax.jit
    def reference(q, k, v, seg, do, dq, dk, dv):
        seg_items = None if seg is None else jnp.repeat(seg, hkv, axis=0)[:, None, :]
        slopes = jnp.tile(jnp.asarray(alibi_slopes(case.hq)).reshape(hkv, -1), (bsz, 1))  # each item's heads
        items = (split(q), split(k), split(v), seg_items, slopes, split(do), split(dq), split(dk), split(dv))
        out, grads, dout, hvp, ddout, jvp_grad = lax.map(one, items)
        merged = lambda xs: tuple(merge(x) for x in xs)  # noqa: E731
        return merge(out), merged(grads), merge(dout), merged(hvp), merged(ddout), merged(jvp_grad)

    return reference


# ---------------------------------------------------------------- jax contenders


_MASK_MODS = ("frames_causal", "sinks_window_causal")  # the masks given as plain functions


def _plain_mask_mod(case: Case):
    """A mask of ``_MASK_MODS`` as a plain ``mask_mod`` (jax and torch alike): "frames_causal", a
    query sees the keys of its frame and before; "sinks_window_causal", the first SINKS keys and the
    WINDOW up to it."""
    if case.mask == "frames_causal":
        frame = case.frame
        return lambda b, h, q, kv: q // frame >= kv // frame
    return lambda b, h, q, kv: (kv <= q) & ((kv < SINKS) | (q - kv < WINDOW))


_RANGES = {"frames_causal": 1, "sinks_window_causal": 2}  # block_mask's ranges a query, per plain mask_mod


def _dense_mask(case: Case):
    """The plain mask_mod on broadcast index grids: the boolean array ``(1, 1, Sq, Skv)`` jax.nn takes."""
    return _plain_mask_mod(case)(0, 0, jnp.arange(case.sq)[:, None], jnp.arange(case.skv)[None, :])[None, None]


@functools.lru_cache(maxsize=8)
def _built_mask(case: Case, ranges: int) -> tuple:
    """``(mask, ms)``: ``jf.masks.block_mask`` of the case's plain mask_mod, built before the timed
    calls (as torch's create_block_mask is: once per mask, shared by every layer that reads it),
    and the time of a build after the first (compiling) one."""
    build = lambda: jax.block_until_ready(jf.masks.block_mask(_plain_mask_mod(case), case.sq, case.skv, ranges=ranges))  # noqa: E731
    build()
    start = time.perf_counter()
    return build(), (time.perf_counter() - start) * 1e3


def _build_note(ranges_of: Callable[[Case], int | None]) -> Callable[[Case], str | None]:
    """The note of a contender given ``_built_mask(case, ranges_of(case))`` (None: no block mask)."""

    def note(case: Case) -> str | None:
        n = ranges_of(case)
        return None if n is None else f"block_mask(ranges={n}) built before the timed calls in {_built_mask(case, n)[1]:.1f} ms"

    return note


def _jf_mask(case: Case, seg):
    mask = case.mask
    if mask is None:
        return None
    if mask in ("causal", "alibi_causal"):
        return jf.masks.causal()
    if mask == "sliding_window_causal":
        return jf.masks.causal() & jf.masks.sliding_window(WINDOW)
    if mask == "document_causal":
        return jf.masks.causal() & jf.masks.document(seg)
    raise ValueError(f"unknown mask {mask!r}")


def _jax_modes(attend: Callable, mode: str, x: Inputs) -> tuple[Callable, tuple]:
    """The jitted call of one mode for ``attend(q, k, v, seg) -> out``, and its arguments."""
    if mode == "fwd":

        def fwd(q, k, v, seg):
            return (attend(q, k, v, seg),)

        return jax.jit(fwd), (x.q, x.k, x.v, x.seg)
    if mode == "fwd+bwd":

        def loss(q, k, v, seg, do):
            return jnp.sum(attend(q, k, v, seg).astype(jnp.float32) * do.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (x.q, x.k, x.v, x.seg, x.do)
    if mode == "jvp":

        def jvp(q, k, v, seg, dq, dk, dv):
            return jax.jvp(lambda q, k, v: attend(q, k, v, seg), (q, k, v), (dq, dk, dv))

        return jax.jit(jvp), (x.q, x.k, x.v, x.seg, x.dq, x.dk, x.dv)
    if mode == "hvp":
        grad, _ = _jax_modes(attend, "fwd+bwd", x)

        def hvp(q, k, v, seg, do, dq, dk, dv):
            return jax.jvp(lambda q, k, v: grad(q, k, v, seg, do), (q, k, v), (dq, dk, dv))[1]

        return jax.jit(hvp), (x.q, x.k, x.v, x.seg, x.do, x.dq, x.dk, x.dv)
    if mode == "jvp2":
        jvp, _ = _jax_modes(attend, "jvp", x)

        def jvp2(q, k, v, seg, dq, dk, dv):
            return jax.jvp(lambda q, k, v: jvp(q, k, v, seg, dq, dk, dv)[1], (q, k, v), (dq, dk, dv))[1:]

        return jax.jit(jvp2), (x.q, x.k, x.v, x.seg, x.dq, x.dk, x.dv)
    if mode == "jvp-grad":
        jvp, _ = _jax_modes(attend, "jvp", x)

        def loss(q, k, v, seg, dq, dk, dv):
            return jnp.sum(jnp.sin(jvp(q, k, v, seg, dq, dk, dv)[1].astype(jnp.float32)))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (x.q, x.k, x.v, x.seg, x.dq, x.dk, x.dv)
    raise ValueError(f"unknown mode {mode!r}")


def _jax_contender(name: str, forward: Callable[[Case], Callable | str], *, no_jvp: str | None = None, **kw) -> Contender:
    """A jax contender from ``forward(case) -> attend(q, k, v, seg) -> out`` or a skip reason.

    ``no_jvp``: why the contender has no forward-mode AD (a ``custom_vjp``), or None.
    """

    def prepare(case, x, mode):
        attend = forward(case)
        if isinstance(attend, str):
            return attend
        if mode in _FORWARD_AD_MODES and no_jvp:
            return no_jvp
        return _jax_modes(attend, mode, x)

    return Contender(name, prepare, **kw)


def variant_name(impl) -> str:
    """``jaxforge[128x64w4s2]``: block_q x block_kv, warps, stages (``-`` where config.py decides)."""
    field = lambda v: "-" if v is None else str(v)  # noqa: E731
    bq, bkv, w, st = (field(getattr(impl, n)) for n in ("block_q", "block_kv", "num_warps", "num_stages"))
    return f"jaxforge[{bq}x{bkv}w{w}s{st}]"


def parse_variant(text: str):
    """``"128x64w4s2"`` (any field may be ``-``) as a Triton ``Implementation``."""
    match = re.fullmatch(r"(\d+|-)x(\d+|-)w(\d+|-)s(\d+|-)", text)
    if match is None:
        raise ValueError(f"a variant is BQxBKVwWARPSsSTAGES such as 128x64w4s2 ('-' keeps config.py's), got {text!r}")
    bq, bkv, w, st = (None if g == "-" else int(g) for g in match.groups())
    return jf.functional.attention.Implementation("pallas_triton", block_q=bq, block_kv=bkv, num_warps=w, num_stages=st)


def _jf_forward(implementation):
    def forward(case: Case):
        slopes = jnp.asarray(alibi_slopes(case.hq))
        score_mod = (lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(slopes.dtype)) if case.mask == "alibi_causal" else None
        built = _built_mask(case, _RANGES[case.mask])[0] if case.mask in _MASK_MODS else None

        def attend(q, k, v, seg):
            mask = _jf_mask(case, seg) if built is None else built
            return jf.attention(q, k, v, mask=mask, score_mod=score_mod, implementation=implementation)

        return attend

    return forward


def _jf_mask_mod(case: Case) -> Callable | str:
    """``jf.attention`` given the plain ``mask_mod``, which visits every tile: what
    ``jf.masks.block_mask`` saves."""
    if case.mask not in _MASK_MODS:
        return f"only the {' and '.join(_MASK_MODS)} cases have a plain mask_mod to compare"
    mask_mod = _plain_mask_mod(case)
    return lambda q, k, v, seg: jf.attention(q, k, v, mask=mask_mod)


def _jf_array(case: Case) -> Callable | str:
    """``jf.attention`` given the boolean array jax.nn takes (``jf.masks.from_array``, its ranges
    measured in every call), built in the call as jax.nn's is."""
    if case.mask not in _MASK_MODS:
        return f"only the {' and '.join(_MASK_MODS)} cases have a mask to give as an array"
    return lambda q, k, v, seg: jf.attention(q, k, v, mask=_dense_mask(case))


def _jf_one_range(case: Case) -> Callable | str:
    """``jf.attention`` with the sinks and window evaluated in one range a query
    (``block_mask(ranges=1)``), visiting the keys between them: what the second range saves."""
    if case.mask != "sinks_window_causal":
        return "only the sinks_window_causal case has a gap in its rows"
    mask = _built_mask(case, 1)[0]
    return lambda q, k, v, seg: jf.attention(q, k, v, mask=mask)


def _jf_xla_contender() -> Contender:
    """``implementation="xla"``, unless the default compiles to the same program (then skipped)."""
    default, explicit = _jf_forward(None), _jf_forward("xla")

    def prepare(case, x, mode):
        fn, args = _jax_modes(explicit(case), mode, x)
        fn_default, _ = _jax_modes(default(case), mode, x)
        try:
            same = fn_default.lower(*args).as_text() == fn.lower(*args).as_text()
        except Exception:  # the default's own record reports its failure; measure xla regardless
            same = False
        if same:
            return "the default implementation compiles to the same program here (it resolves to xla for this case)"
        return fn, args

    return Contender("jaxforge-xla", prepare)


def _jnn_forward(case: Case, implementation: str) -> Callable | str:
    """``jax.nn.dot_product_attention``; head dims are zero-padded to match when D != Dv."""
    if implementation == "cudnn":
        if case.mask in ("document_causal", *_MASK_MODS):
            return f"jax.nn's cuDNN path takes no {case.mask} mask (a dense mask would be materialised as a bias)"
        if np.dtype(case.dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
            return f"cuDNN attention takes bfloat16 or float16, not {np.dtype(case.dtype).name}"
    width = max(case.d, case.dv)
    kwargs = dict(scale=case.scale, is_causal=case.mask not in (None, *_MASK_MODS), implementation=implementation)
    if case.mask == "sliding_window_causal":
        kwargs["local_window_size"] = (WINDOW - 1, 0)

    def pad(x):
        return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])

    def attend(q, k, v, seg, slopes=alibi_slopes(case.hq)):  # the reference hands each item's heads' slopes
        mask = None if seg is None else seg[:, None, :, None] == seg[:, None, None, :]
        if case.mask in _MASK_MODS:
            mask = _dense_mask(case)
        bias = _alibi_bias(slopes, case.sq, case.skv).astype(q.dtype) if case.mask == "alibi_causal" else None
        out = jax.nn.dot_product_attention(pad(q), pad(k), pad(v), bias=bias, mask=mask, **kwargs)
        return out[..., : case.dv]

    return attend


def _padded_note(case: Case) -> str | None:
    if case.d == case.dv:
        return None
    return f"head dims zero-padded to {max(case.d, case.dv)} (jax.nn needs equal q/k/v head dims)"


def _pallas_forward(case: Case) -> Callable | str:
    try:
        from jax.experimental.pallas.ops.gpu.attention import mha
    except Exception as e:
        return f"jax.experimental.pallas.ops.gpu.attention is not importable ({type(e).__name__}: {e})"
    if case.mask not in (None, "causal", "document_causal"):
        return f"mha takes no {case.mask} mask (causal and segment ids only)"
    if case.hq != case.hkv:
        return "mha needs as many key/value heads as query heads (no GQA)"
    if case.d != case.dv:
        return "mha needs equal q, k and v head dims"
    block = 128  # BlockSizes.get_default(): block_q = block_k = 128 (min with the sequence length)
    if case.sq % min(block, case.sq) or case.skv % min(block, case.skv):
        return f"mha needs sequence lengths that are multiples of its block size {block}"

    def attend(q, k, v, seg):
        return mha(q, k, v, seg, sm_scale=case.scale, causal=case.mask is not None)

    return attend


def _hopper() -> str | None:
    """Why the Mosaic GPU (sm90) kernels cannot run here, or None on a Hopper GPU."""
    arch = build.gpu_arch()
    return None if arch == "sm_90a" else f"Mosaic GPU attention is for sm90 (Hopper); this device is {arch or 'not a GPU'}"


def _jf_triton(case: Case) -> Callable | str:
    """``jf.attention`` on the Triton kernels by name on a Hopper, where the default runs the
    Mosaic GPU ones: the default of every other GPU."""
    if why := _hopper():
        return f"{why}: the default runs the Triton kernels"
    if case.mask == "alibi_causal" or config.decoding(case.sq):
        return "the default runs the Triton kernels (ALiBi's captured slopes, decoding)"
    return _jf_forward("pallas_triton")(case)


def _jf_decoding(case: Case) -> Callable | str:
    """``jf.attention`` on the Triton kernels by name where the default may not pack GQA heads or
    split the keys (decoding shapes, config.TRITON_DECODING_VALIDATED)."""
    if not (config.decoding(case.sq) and case.hq > case.hkv):
        return "not a decoding shape: the default runs the same kernels"
    return _jf_forward("pallas_triton")(case)


def _jf_pieces(case: Case) -> Callable | str:
    """``jf.attention``'s default with head dims that are no power of two held in two pieces, which
    the default pads to one until config.TRITON_HEAD_PIECES_VALIDATED."""
    if all(config.head_pieces(n, split=True) == config.head_pieces(n, split=False) for n in (case.d, case.dv)):
        return "head dims of one piece: the default runs the same kernels"
    return _jf_forward(jf.functional.attention.Implementation(head_pieces=True))(case)


def _mgpu_forward(case: Case) -> Callable | str:
    """jax's own FlashAttention-3 on Mosaic GPU (``jax.experimental.pallas.ops.gpu.attention_mgpu``)."""
    if why := _hopper():
        return why
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except Exception as e:
        return f"jax.experimental.pallas.ops.gpu.attention_mgpu is not importable ({type(e).__name__}: {e})"
    if case.mask not in (None, "causal"):
        return "attention_mgpu has a causal mask only"
    if case.d != case.dv or case.d % 64:
        return "attention_mgpu needs equal q, k and v head dims, a multiple of 64"
    block_q, block_kv = 64, 64 if case.d > 128 else 128
    if case.sq % (2 * block_q) or case.skv % block_kv:
        return f"attention_mgpu needs Sq a multiple of {2 * block_q} and Skv of {block_kv}"
    blocks = dict(block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64) if case.mask is None else {}
    config = attention_mgpu.TuningConfig(
        block_q=block_q, block_kv=block_kv, max_concurrent_steps=2, causal=case.mask == "causal", **blocks
    )

    def attend(q, k, v, seg):  # it applies no scale: q is pre-scaled (one elementwise pass over q)
        return attention_mgpu.attention(q * jnp.asarray(case.scale, q.dtype), k, v, config)

    return attend


# ---------------------------------------------------------------- torch contenders


def _cuda_torch():
    """(torch, None) when torch is installed and sees a GPU, else (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return torch, None


def _torch_bhsd(torch, x):
    """A jax ``(B, S, H, D)`` array as a contiguous torch CUDA ``(B, H, S, D)`` tensor, same dtype."""
    dtype = getattr(torch, np.dtype(x.dtype).name)
    # through float32: torch takes no numpy bfloat16 (and numpy's issubdtype does not see it as a float)
    host = np.asarray(x.astype(jnp.float32)) if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x)
    return torch.as_tensor(host, device="cuda").to(dtype).transpose(1, 2).contiguous()


def _torch_to_jax(t):
    """A torch ``(B, H, S, D)`` output as a jax ``(B, S, H, D)`` array."""
    t = t.detach().contiguous()
    try:
        x = jax.dlpack.from_dlpack(t)
    except Exception:  # no shared device or dtype: through the host
        x = jnp.asarray(t.float().cpu().numpy())
    return jnp.swapaxes(x, 1, 2)


def _torch_modes(torch, attend: Callable, mode: str, case: Case, x: Inputs) -> tuple[Callable, tuple] | str:
    if mode in _FORWARD_AD_MODES:
        return _NO_TORCH_JVP
    q, k, v = (_torch_bhsd(torch, t) for t in (x.q, x.k, x.v))
    if mode == "fwd":

        def fwd(q, k, v):
            out = attend(q, k, v)
            torch.cuda.synchronize()  # the host timer must see torch's kernels finish
            return (out,)

        return fwd, (q, k, v)
    do = _torch_bhsd(torch, x.do)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def fwd_bwd(q, k, v, do):
        grads = torch.autograd.grad(attend(q, k, v), (q, k, v), do)
        torch.cuda.synchronize()
        return grads

    return fwd_bwd, (q, k, v, do)


def _torch_unavailable(name: str, reason: str) -> Contender:
    return Contender(name, lambda case, x, mode: reason, essential=lambda case: True)  # costs nothing


def _sdpa_contender(torch, backend: str) -> Contender:
    name = f"torch-sdpa-{backend}"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def prepare(case, x, mode):
        if case.mask not in (None, "causal"):
            return f"SDPA takes no {case.mask} mask (is_causal only; an explicit attn_mask leaves the fused kernels)"
        kwargs = dict(is_causal=case.mask == "causal", scale=case.scale)
        if case.hq != case.hkv:
            kwargs["enable_gqa"] = True

        def attend(q, k, v):
            with sdpa_kernel(kind):
                return scaled_dot_product_attention(q, k, v, **kwargs)

        return _torch_modes(torch, attend, mode, case, x)

    return Contender(name, prepare, to_jax=_torch_to_jax, essential=lambda case: backend == "cudnn")


def _flex_contender(torch) -> Contender:
    name = "torch-flex"
    try:
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return _torch_unavailable(name, f"torch.nn.attention.flex_attention is not importable ({e})")
    dynamo = torch._dynamo.config  # one recompilation per case and mode: more than the default limit
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit, max(getattr(dynamo, limit), 64))
    compiled = torch.compile(flex_attention, dynamic=False)

    def prepare(case, x, mode):
        if case.mask is None:
            return "flex_attention is measured on masked cases only (SDPA covers plain attention)"
        if mode in _FORWARD_AD_MODES:
            return _NO_TORCH_JVP
        batch = None
        score_mod = None
        if case.mask in ("causal", "alibi_causal"):
            mask_mod = lambda b, h, q, kv: q >= kv  # noqa: E731
        elif case.mask == "sliding_window_causal":
            mask_mod = lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW)  # noqa: E731
        elif case.mask == "document_causal":
            seg, batch = torch.as_tensor(np.asarray(x.seg), device="cuda"), case.batch
            mask_mod = lambda b, h, q, kv: (q >= kv) & (seg[b, q] == seg[b, kv])  # noqa: E731
        elif case.mask in _MASK_MODS:
            mask_mod = _plain_mask_mod(case)
        else:
            return f"no flex mask_mod for {case.mask!r}"
        if case.mask == "alibi_causal":
            slopes = torch.as_tensor(alibi_slopes(case.hq), device="cuda")
            score_mod = lambda score, b, h, q, kv: score + slopes[h] * (kv - q)  # noqa: E731
        block_mask = create_block_mask(mask_mod, B=batch, H=None, Q_LEN=case.sq, KV_LEN=case.skv, device="cuda")
        kwargs = dict(block_mask=block_mask, score_mod=score_mod, scale=case.scale)
        if case.hq != case.hkv:
            kwargs["enable_gqa"] = True
        return _torch_modes(torch, lambda q, k, v: compiled(q, k, v, **kwargs), mode, case, x)

    essential = lambda case: case.mask in ("sliding_window_causal", "document_causal", "alibi_causal", *_MASK_MODS)  # noqa: E731
    return Contender(name, prepare, to_jax=_torch_to_jax, essential=essential)


# ---------------------------------------------------------------- the contenders per backend


def _contenders(backend: str) -> list[Contender]:
    everywhere = lambda case: True  # noqa: E731
    jnn_xla = _jax_contender("jax.nn-xla", lambda case: _jnn_forward(case, "xla"), note=_padded_note)
    mask_mod = _jax_contender("jaxforge-mask-mod", _jf_mask_mod)
    array = _jax_contender("jaxforge-array", _jf_array)
    own_ranges = _build_note(lambda case: _RANGES.get(case.mask))
    one_range_note = _build_note(lambda case: 1 if case.mask == "sinks_window_causal" else None)
    one_range = _jax_contender("jaxforge-one-range", _jf_one_range, note=one_range_note)
    jaxforge = _jax_contender("jaxforge", _jf_forward(None), essential=everywhere, note=own_ranges)
    if backend != "gpu":
        return [jaxforge, mask_mod, array, one_range, jnn_xla]
    contenders = [
        jaxforge,
        mask_mod,
        array,
        one_range,
        _jax_contender("jaxforge-triton", _jf_triton, essential=everywhere, note=own_ranges),
        _jax_contender("jaxforge-decoding", _jf_decoding, essential=everywhere),
        _jax_contender("jaxforge-pieces", _jf_pieces, essential=everywhere),
        _jf_xla_contender(),
        _jax_contender(
            "jax.nn-cudnn",
            lambda case: _jnn_forward(case, "cudnn"),
            no_jvp="jax.nn's cuDNN attention is a custom_vjp: it has no forward-mode AD (jax.jvp raises)",
            essential=everywhere,
            note=_padded_note,
        ),
    ]
    torch, why_not = _cuda_torch()
    torch_names = ("torch-sdpa-cudnn", "torch-sdpa-flash")
    if torch is None:
        contenders += [_torch_unavailable(n, why_not) for n in torch_names]
    else:
        contenders += [_sdpa_contender(torch, "cudnn"), _sdpa_contender(torch, "flash")]
    pallas = _jax_contender(
        "pallas-triton", _pallas_forward, no_jvp="Pallas mha is a custom_vjp: it has no forward-mode AD (jax.jvp raises)"
    )
    mgpu = _jax_contender(
        "pallas-mgpu", _mgpu_forward, no_jvp="attention_mgpu is a custom_vjp: it has no forward-mode AD (jax.jvp raises)"
    )
    contenders += [jnn_xla, pallas, mgpu]
    contenders.append(_flex_contender(torch) if torch is not None else _torch_unavailable("torch-flex", why_not))
    return contenders


# The benchmark entry, by the `bench_entry` name its primitive declares.
OPS = {"attention": _Op("attention", {**SHAPES, **QUICK_SHAPES}, _contenders)}
