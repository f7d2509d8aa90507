"""Command line: ``python -m jaxforge.bench {linalg,attention} [--shapes NAME,...] [--quick] [--out DIR] [--tag TAG]``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from jaxforge.bench import FAMILIES, ProgressBar, format_table, run, write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxforge.bench",
        description="Times jaxforge against its anchors in one process on the default device; "
        "prints a table and writes the results as JSON.",
    )
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument(
        "--shapes",
        type=lambda names: [name for name in names.split(",") if name],
        help="comma-separated shape names from the SHAPES tables (default: those tagged for this device)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and one or two repeats")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON file (%(default)s)"
    )
    parser.add_argument("--tag", help="a word added to the file name and stored in the JSON")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        records = run(args.family, shapes=args.shapes, quick=args.quick, progress=ProgressBar())
    except ValueError as e:  # an unknown shape name: a usage error, not a crash
        parser.error(str(e))
    path = write_results(records, args.family, args.out, quick=args.quick, tag=args.tag)
    print(format_table(records))
    print(f"\n{len(records)} measurements in {time.perf_counter() - start:.0f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
