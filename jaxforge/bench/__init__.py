"""Benchmarks of jaxforge against its anchors, measured side by side in one process on one device.

    python -m jaxforge.bench {linalg,attention} [--shapes NAME,...] [--quick] [--out DIR] [--tag TAG]

:func:`run` measures one family and returns one record per (op, shape, implementation): the
timed calls and their median, the accuracy of the results, and ``ratio`` = anchor time / jaxforge
time (> 1 means jaxforge is faster). :func:`write_results` saves them as JSON with the versions
and the device (``run`` does after each shape too, marked incomplete, so that a run killed at a
time limit leaves what it measured); :func:`format_table` prints them.
"""

from __future__ import annotations

import datetime
import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from jaxforge.bench import attention, linalg
from jaxforge.bench._timing import device_name

__all__ = ["FAMILIES", "ProgressBar", "format_table", "run", "write_results"]

# family -> measure(*, shapes, quick, progress) -> records
FAMILIES: dict[str, Callable[..., list[dict]]] = {"attention": attention.measure, "linalg": linalg.measure}


def run(
    family: str,
    *,
    shapes: Sequence[str] | None = None,
    quick: bool = False,
    out_dir: str | Path | None = None,
    tag: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    budget_s=None,
    date: datetime.date | None = None,
    **options,
) -> list[dict]:
    """Measures ``family`` and returns its records; writes them as JSON under ``out_dir`` if given,
    and as they come (``complete: false``) after each shape.

    ``shapes`` selects named shapes (default: those tagged for this device), ``quick`` uses tiny
    shapes and one or two repeats, ``progress(done, total, label)`` follows the run, ``budget_s``
    is the family's time budget (see its ``measure``; default: its own on a GPU); ``date`` names
    the results (default: the day the run starts, for every write, so a run past midnight keeps
    one file); ``options`` go to the family's ``measure`` (attention: ``variants``).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown benchmark family {family!r}; known families: {sorted(FAMILIES)}")
    checkpoint, date = None, date or datetime.date.today()
    if out_dir is not None:
        checkpoint = functools.partial(write_results, family=family, out_dir=out_dir, quick=quick, tag=tag, complete=False, date=date)
    records = FAMILIES[family](shapes=shapes, quick=quick, progress=progress, budget_s=budget_s, checkpoint=checkpoint, **options)
    if out_dir is not None:
        write_results(records, family, out_dir, quick=quick, tag=tag, date=date)
    return records


def results_path(family: str, out_dir: str | Path, *, date: datetime.date, quick: bool = False, tag: str | None = None) -> Path:
    """``out_dir/<date>-<device>-<family>[-quick][-<tag>].json``."""
    suffix = "".join(f"-{part}" for part in ("quick" if quick else None, tag) if part)
    return Path(out_dir) / f"{date.isoformat()}-{device_name()}-{family}{suffix}.json"


def write_results(
    records: list[dict],
    family: str,
    out_dir: str | Path,
    *,
    quick: bool = False,
    tag: str | None = None,
    complete: bool = True,
    date: datetime.date,
) -> Path:
    """Writes ``records`` to :func:`results_path` (``complete``: the run finished; ``date``: the
    day the run began); returns the path."""
    path = results_path(family, out_dir, quick=quick, tag=tag, date=date)
    path.parent.mkdir(parents=True, exist_ok=True)
    results = dict(
        family=family,
        date=date.isoformat(),
        device=device_name(),
        device_kind=jax.devices()[0].device_kind,
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        numpy_version=np.__version__,
        quick=quick,
        tag=tag,
        complete=complete,
        records=records,
    )
    tmp = path.with_name(path.name + ".tmp")  # whole files only, even if the run is killed while writing
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)
    return path


def format_table(records: list[dict]) -> str:
    """An aligned text table: op (and mode), shape, implementation, median ms, ratio, accuracy or reason."""
    header = ("op", "shape", "dims", "implementation", "median ms", "ratio", "accuracy")
    rows = [header] + [_row(r) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    right = {4, 5}  # numbers align on the right
    lines = [
        "  ".join(
            [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
            + [row[-1]]
        )
        for row in rows
    ]
    return "\n".join(lines)


def _row(record: dict) -> tuple[str, ...]:
    op = record["op"] + (f" {record['mode']}" if record.get("mode") else "")
    where = (op, record["shape_name"], "x".join(map(str, record["shape"])), record["implementation"])
    if record["status"] != "ok":
        return (*where, "-", "-", f"{record['status']}: {record['reason']}")
    accuracy = "  ".join(f"{name} {value:.1e}" for name, value in record["accuracy"].items())
    if record.get("tflops"):
        accuracy = f"{record['tflops']:.3g} TFLOP/s  {accuracy}"
    ratio = "-" if record["ratio"] is None else f"{record['ratio']:.2f}x"  # None: jaxforge has no time here
    return (*where, f"{record['median_ms']:.3f}", ratio, accuracy)


class ProgressBar:
    """Draws ``[#####.....] 5/10 label`` on stderr: in place on a terminal, one line per step elsewhere."""

    def __init__(self, width: int = 20):
        self.width = width
        self._drawn = 0  # length of the line on screen, to blank its tail when redrawing

    def __call__(self, done: int, total: int, label: str) -> None:
        filled = self.width * done // max(total, 1)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {label}"
        stream = sys.stderr
        if stream.isatty():
            stream.write("\r" + line.ljust(self._drawn) + ("\n" if done == total else ""))
            self._drawn = len(line)
        else:
            stream.write(line + "\n")
        stream.flush()
