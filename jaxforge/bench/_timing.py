"""Timing helpers: a host timer around synchronised calls, and a short name for the device."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
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


def median_time(
    fn: Callable, *args, min_repeats: int = 3, max_seconds: float = 2.0, max_repeats: int = 30
) -> Timing:
    """Median seconds of ``fn(*args)``, which must already be warm (compiled).

    Times at least ``min_repeats`` calls, then more until the timed calls add up to
    ``max_seconds`` or ``max_repeats`` calls are made.
    """
    times: list[float] = []
    while len(times) < max_repeats and (len(times) < min_repeats or sum(times) < max_seconds):
        times.append(timed_call(fn, *args)[0])
    return Timing(statistics.median(times), times)


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
