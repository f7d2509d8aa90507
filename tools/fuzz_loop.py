"""The fuzzers' driver (``fuzz_attention.py``, ``fuzz_linalg.py``): seeds one after another for a
time or a count; a failing seed is printed with its error and the search goes on."""

from __future__ import annotations

import argparse
import time

import jax


def parser(description: str) -> argparse.ArgumentParser:
    """``--seconds``, ``--seed`` (the first) and ``--count``; a fuzzer adds its own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--count", type=int, default=None, help="stop after this many seeds")
    return parser


def run(run_seed, args, label: str = "") -> int:
    """Calls ``run_seed(seed)`` until ``args.seconds`` or ``args.count`` runs out; prints each
    failure and last the count of seeds run and failed. Returns 1 if any failed, else 0."""
    start, seed, failed = time.monotonic(), args.seed, 0
    while time.monotonic() - start < args.seconds and (args.count is None or seed < args.seed + args.count):
        try:
            run_seed(seed)
        except Exception as error:  # a failing seed is reported and the search goes on
            failed += 1
            print(f"seed {seed} failed: {type(error).__name__}: {str(error)[:800]}", flush=True)
        seed += 1
        if seed % 40 == 0:
            jax.clear_caches()  # each new shape's programs hold memory mappings (vm.max_map_count)
    print(f"{label}{seed - args.seed} seeds, {failed} failed")
    return 1 if failed else 0
