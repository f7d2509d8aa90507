"""Entry point of ``python -m jaxforge.demo``; see :mod:`jaxforge.demo`."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import jax

CPU_DEVICES = 4  # virtual devices on a CPU, so data parallelism is real even there


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxforge.demo", description=__doc__)
    parser.add_argument("--size", choices=["tiny", "small", "base"], help="model and run size (default: small on CPU, base on GPU)")
    parser.add_argument("--steps", type=int, help="training steps (default: the size's)")
    parser.add_argument("--devices", type=int, help=f"devices to train on (default: all GPUs, or {CPU_DEVICES} virtual CPU devices)")
    parser.add_argument("--text", help="train on this text file (documents: its paragraphs) instead of the stdlib")
    parser.add_argument("--out", default="demo-output", help="directory for loss.png and sample.txt")
    parser.add_argument("--no-bench", action="store_true", help="skip the closing benchmark table")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "devices"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before any backend starts: how many CPU devices to simulate.
    jax.config.update("jax_num_cpu_devices", args.devices or CPU_DEVICES)

    import numpy as np

    from jaxforge import bench
    from jaxforge.demo import data, plot, train

    on_gpu = jax.default_backend() == "gpu"
    size = train.SIZES[args.size or ("base" if on_gpu else "small")]
    if args.steps:
        size = dataclasses.replace(size, steps=args.steps)
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    if size.batch % len(devices):
        size = dataclasses.replace(size, batch=len(devices) * -(-size.batch // len(devices)))
    mesh = jax.sharding.Mesh(np.array(devices), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    documents = data.file_documents(args.text, size.text_bytes) if args.text else data.stdlib_documents(size.text_bytes)
    train_docs, validation_docs = data.split(documents)
    train_data, validation = data.pack(train_docs, size.length + 1), data.pack(validation_docs, size.length + 1)
    baseline = data.unigram_cross_entropy(train_data, validation)
    source = args.text or "the Python standard library (its definitions)"
    print(f"jaxforge demo: a decoder-only transformer on {source}")
    print(
        f"  text      {sum(map(len, documents)):,} bytes in {len(documents):,} documents; "
        f"{len(train_data.tokens):,} training rows of {size.length} tokens"
    )
    print(
        f"  model     {size.depth} layers, {size.features} features, {size.num_heads} query / {size.num_kv_heads} kv heads, "
        f"{train.parameter_count(train.init_params(size)):,} params; masks: causal & document"
    )
    print(f"  training  {size.steps} steps of {size.batch} rows, data-parallel over {len(devices)} {devices[0].platform} devices")
    print(f"  unigram baseline (validation): {baseline:.3f} nats/byte")

    params, history = train.train(size, train_data, validation, mesh, progress=bench.ProgressBar(), seed=args.seed)
    final = history.validation[-1]
    print(
        f"  trained   {history.seconds:.0f} s in steps, {history.tokens_per_second:,.0f} tokens/s; "
        f"validation loss {final:.3f} nats/byte vs unigram {baseline:.3f} ({final / baseline:.0%})"
    )

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot.loss_curve(history, baseline, out / "loss.png")
    prompt = b"def "
    sample = train.generate(params, prompt, 300, window=size.length, seed=args.seed)
    (out / "sample.txt").write_bytes(sample)
    print(f"  wrote     {out / 'loss.png'} and {out / 'sample.txt'}; the sample:\n")
    print(sample.decode("utf-8", errors="replace"))
    print()

    if not args.no_bench:
        for family in ("attention", "linalg"):
            print(bench.format_table(bench.run(family, quick=True)))
            print()

    learnt = final < baseline
    print(f"validation loss below the unigram baseline: {'yes' if learnt else 'NO'}")
    return 0 if learnt else 1


if __name__ == "__main__":
    sys.exit(main())
