#!/usr/bin/env bash
# The GPU check, from a fresh checkout on the GPU machine (nothing installed; PYTHONPATH=.):
# builds the kernels, runs the `gpu` tests, runs the linalg and attention benchmarks; JSON and logs
# go to $OUT. Prints short tables last. Budget: under 6 minutes (the attention benchmark keeps
# itself near 2.5 minutes: see GPU_BUDGET_S in jaxforge/bench/attention.py).
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

echo "== attention benchmark"
timeout 200 python3 -m jaxforge.bench attention --out "$OUT" 2>"$OUT/bench-attention-progress.log" | tee "$OUT/bench-attention.txt" >/dev/null
attention_rc=${PIPESTATUS[0]}

echo "== summary (build rc=$build_rc, gpu tests rc=$tests_rc, bench rc=$bench_rc, attention bench rc=$attention_rc)"
grep -E "passed|failed" "$OUT/gpu-tests.log" | tail -1
cat "$OUT/bench.txt"
# attention: the timed rows of jaxforge and of the anchors with ANCHORS.md targets (the whole table
# is in bench-attention.txt, every field in the JSON)
grep -E "^op |^attention .* (jaxforge|jaxforge-xla|jax.nn-cudnn|torch-sdpa-cudnn|torch-flex) +[0-9]|measurements in" \
  "$OUT/bench-attention.txt"
