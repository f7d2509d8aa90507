"""The main job: train a small decoder-only transformer with flex masks, data-parallel.

    python -m jaxforge.demo [--size tiny|small|base] [--steps N] [--devices N] [--text FILE] [--out DIR] [--no-bench]

Documents (by default the top-level definitions of the Python standard library, read at run
time) are packed into rows and trained on with ``jf.masks.causal() & jf.masks.document(ids)``,
through ``jf.shard`` over the devices (4 virtual CPU devices on a CPU). It writes the loss curve
(``loss.png``) and a generated sample (``sample.txt``) to ``--out`` and ends with a benchmark
table of the primitives. The exit status is 1 unless the validation loss ends below the unigram
baseline.
"""
