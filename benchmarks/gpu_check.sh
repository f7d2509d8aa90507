#!/usr/bin/env bash
# The GPU check, from a fresh checkout on the GPU machine (nothing installed; PYTHONPATH=.):
# builds the kernels, runs the `gpu` tests, runs the linalg benchmark; JSON and logs go to $OUT.
# Prints a short table last. Budget: under 6 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
OUT=${OUT:-/tmp/jaxforge-gpu}
mkdir -p "$OUT"
export JAXFORGE_CACHE_DIR=/tmp/jaxforge-kernels  # not under $OUT: the libraries need not come back
export JAXFORGE_UNVALIDATED_KERNELS=1  # the kernels under test (see lowering/linalg/*/config.py)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

echo "== build"
timeout 240 python3 -m jaxforge.build 2>&1 | tee "$OUT/build.log"
build_rc=${PIPESTATUS[0]}

echo "== gpu tests"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}

echo "== benchmark"
timeout 240 python3 -m jaxforge.bench linalg --out "$OUT" 2>"$OUT/bench-progress.log" | tee "$OUT/bench.txt" >/dev/null
bench_rc=${PIPESTATUS[0]}

echo "== summary (build rc=$build_rc, gpu tests rc=$tests_rc, bench rc=$bench_rc)"
grep -E "passed|failed" "$OUT/gpu-tests.log" | tail -1
cat "$OUT/bench.txt"
