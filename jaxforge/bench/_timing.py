"""Timing helpers: a host timer around synchronised calls, and a short name for the device."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Container, Hashable, Mapping
from typing import Any, NamedTuple

import jax


class Timing(NamedTuple):
    """The median and every timed call, in seconds."""

    median: float
    times: list[float]


def timed_call(fn: Callable, *args) -> tuple[float, Any]:
    """Seconds from calling ``fn(*args)`` until its outputs are ready, and the outputs."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def median_times(
    calls: Mapping[Hashable, tuple[Callable, tuple]],
    *,
    min_repeats: int = 3,
    max_seconds: float = 2.0,
    max_repeats: int = 30,
    once: Container[Hashable] = (),
) -> dict[Hashable, Timing | Exception]:
    """Median seconds of each warm (compiled) call ``fn(*args)`` of ``calls`` (name -> (fn, args)).

    The calls are timed in rounds, one call of each per round: the machine's drift (its clock,
    other load) then falls on all of them alike, not on whichever ran through a slow stretch, so
    their ratios hold. Each is timed at least ``min_repeats`` times (once if its name is in
    ``once``: a slow call), then more while its timed calls add up to less than ``max_seconds``
    and it has had fewer than ``max_repeats``. A call that raises is not timed again: its exception
    stands in for its Timing, and the others go on.
    """
    times: dict[Hashable, list[float]] = {name: [] for name in calls}
    failed: dict[Hashable, Exception] = {}

    def wants_more(name) -> bool:
        done, least = times[name], 1 if name in once else min_repeats
        return name not in failed and len(done) < max_repeats and (len(done) < least or sum(done) < max_seconds)

    while active := [name for name in calls if wants_more(name)]:
        for name in active:
            fn, args = calls[name]
            try:
                times[name].append(timed_call(fn, *args)[0])
            except Exception as e:  # e.g. out of memory on a later call: a record, not the end of the run
                failed[name] = e
    return {name: failed[name] if name in failed else Timing(statistics.median(done), done) for name, done in times.items()}


def device_name() -> str:
    """The default device's kind as a file-name slug: ``cpu``, ``h200``, ``a100-sxm4-80gb``."""
    slug = re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")
    return slug.removeprefix("nvidia-")  # every GPU here is NVIDIA's; the model is what tells runs apart


def ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded to 0.1 µs (finer digits are noise)."""
    return round(seconds * 1e3, 4)


def timed_record(first_s: float, timing: Timing, accuracy: dict, **extra) -> dict:
    """The timing fields of a measured record; ``extra`` adds a family's own fields."""
    return dict(
        status="ok",
        reason=None,
        first_call_ms=ms(first_s),
        times_ms=[ms(t) for t in timing.times],
        median_ms=ms(timing.median),
        ratio=None,
        accuracy=accuracy,
        **extra,
    )


def untimed_record(status: str, reason: str, first_s: float | None = None, **extra) -> dict:
    """A record that was skipped or failed, with the reason."""
    return dict(
        status=status,
        reason=reason,
        first_call_ms=None if first_s is None else ms(first_s),
        times_ms=[],
        median_ms=None,
        ratio=None,
        accuracy=None,
        **extra,
    )


def error_record(e: Exception, **extra) -> dict:
    """The record of a call that raised: the exception's type and message, on one line, cut short."""
    return untimed_record("error", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", **extra)
