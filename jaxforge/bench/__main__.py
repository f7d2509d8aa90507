"""Command line: ``python -m jaxforge.bench {linalg,attention} [--shapes NAME,...] [--quick] [--budget S[,S]]
[--variants BQxBKVwWsS,...] [--modes fwd,fwd+bwd,jvp,hvp,jvp2,jvp-grad] [--out DIR] [--tag TAG]``."""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

from jaxforge.bench import FAMILIES, ProgressBar, format_table, results_path, run


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
    parser.add_argument(
        "--budget",
        type=lambda text: tuple(float(x) for x in text.split(",")),
        help="seconds into the run after which anchors are skipped: linalg takes one number (or S,ALL: "
        "jaxforge's rows too past ALL), attention SOFT,HARD (optional contenders, then all) "
        "(default: the family's own on a GPU, none elsewhere)",
    )
    parser.add_argument(
        "--variants",
        type=lambda text: [v for v in text.split(",") if v],
        help="attention only: Triton configurations BQxBKVwWARPSsSTAGES, e.g. 128x64w4s2,128x128w8s3 "
        "('-' keeps config.py's), each timed as a contender beside the default",
    )
    parser.add_argument(
        "--modes",
        type=lambda text: [m for m in text.split(",") if m],
        help="attention only: comma-separated modes among fwd,fwd+bwd,jvp,hvp,jvp2,jvp-grad (default: fwd,fwd+bwd,jvp)",
    )
    parser.add_argument("--tag", help="a word added to the file name and stored in the JSON")
    args = parser.parse_args(argv)

    budget = args.budget
    if budget is not None and len(budget) not in ((2,) if args.family == "attention" else (1, 2)):
        parser.error(f"--budget for {args.family} takes {'SOFT,HARD' if args.family == 'attention' else 'S or S,ALL'}")
    if budget is not None and len(budget) == 1:
        budget = budget[0]
    options = {}
    if args.variants:
        if args.family != "attention":
            parser.error("--variants is for the attention family")
        from jaxforge.bench.attention import parse_variant

        try:
            options["variants"] = [parse_variant(v) for v in args.variants]
        except ValueError as e:
            parser.error(str(e))
    if args.modes:
        if args.family != "attention":
            parser.error("--modes is for the attention family")
        options["modes"] = args.modes
    start, date = time.perf_counter(), datetime.date.today()
    try:
        records = run(
            args.family,
            shapes=args.shapes,
            quick=args.quick,
            out_dir=args.out,
            tag=args.tag,
            progress=ProgressBar(),
            budget_s=budget,
            date=date,
            **options,
        )
    except ValueError as e:  # an unknown shape name or mode: a usage error, not a crash
        parser.error(str(e))
    path = results_path(args.family, args.out, quick=args.quick, tag=args.tag, date=date)
    print(format_table(records))
    print(f"\n{len(records)} measurements in {time.perf_counter() - start:.0f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
