"""Activation checkpointing of a transformer, side by side in one process: no remat, remat of
everything (``remat=True``), and remat that keeps attention's residuals (``jf.remat.save_attention()``).
For each: the compiled gradient's temporary memory, how many attention forwards its jaxpr runs,
its median time over interleaved repeats, and its largest difference from the gradient without
remat. The JSON has the bench's layout (``python -m jaxforge.bench``): save_attention is the
``jaxforge`` record, the others anchors with ``ratio`` = their time / its time.

    python benchmarks/remat_attention.py [--repeats 11] [--out benchmarks/results] [--quick]

``--quick``: a 2-block model of 32 features on 2x64 tokens (the smoke test's size).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxforge as jf

CONFIG = dict(vocab_size=256, features=128, depth=4, num_heads=4, num_kv_heads=2, hidden_features=512)
TOKENS = (2, 2048)
QUICK_CONFIG = dict(CONFIG, features=32, depth=2, hidden_features=64)
QUICK_TOKENS = (2, 64)
VARIANTS = {"no remat": False, "remat=True": True, "save_attention": jf.remat.save_attention()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    config, shape = (QUICK_CONFIG, QUICK_TOKENS) if args.quick else (CONFIG, TOKENS)
    params = jf.nn.init_transformer(jax.random.key(0), **config)
    tokens = jax.random.randint(jax.random.key(1), shape, 0, config["vocab_size"])
    grads, rows = {}, {}
    for name, remat in VARIANTS.items():
        grad = jax.grad(lambda p, remat=remat: jnp.mean(jf.nn.transformer(p, tokens, remat=remat) ** 2))
        compiled = jax.jit(grad).lower(params).compile()
        forwards = len(re.findall(r"attention_fwd\[", str(jax.make_jaxpr(grad)(params))))
        grads[name] = compiled
        rows[name] = dict(temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20, attention_forwards=forwards, times_ms=[])
        jax.block_until_ready(compiled(params))
    for _ in range(args.repeats):
        for name, compiled in grads.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(params))
            rows[name]["times_ms"].append((time.perf_counter() - start) * 1e3)
    reference = jax.tree.leaves(grads["no remat"](params))
    ours = float(np.median(rows["save_attention"]["times_ms"]))
    records = []
    print(f"{'variant':16s} {'temp MiB':>9s} {'fwd runs':>8s} {'median ms':>10s} {'max |Δgrad|':>12s}")
    for name, row in rows.items():
        median = float(np.median(row["times_ms"]))
        difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads[name](params)), reference))
        print(f"{name:16s} {row['temp_mib']:9.1f} {row['attention_forwards']:8d} {median:10.1f} {difference:12.2e}")
        records.append(dict(
            op="transformer", mode="grad", shape_name=f"depth{config['depth']}_{shape[0]}x{shape[1]}", shape=list(shape), status="ok",
            implementation="jaxforge" if name == "save_attention" else name, variant=name,
            median_ms=median, ratio=median / ours, accuracy={"grad_vs_no_remat": difference}, **row,
        ))  # fmt: skip
    device = jax.devices()[0]
    path = args.out / f"{datetime.date.today()}-{device.platform}-remat-attention{'-quick' if args.quick else ''}.json"
    run = dict(family="remat", date=str(datetime.date.today()), device=device.platform, device_kind=device.device_kind,
               backend=jax.default_backend(), jax_version=jax.__version__, config=config, dtype="float32", records=records)  # fmt: skip
    path.write_text(json.dumps(run, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
