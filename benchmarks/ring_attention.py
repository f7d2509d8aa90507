"""Ring attention under a mask of positions, side by side in one process: ``ring_attention(mask=
causal & sliding_window(w))``, whose shifted masks skip the pairs of chunks the window hides, the
causal ring (``causal=True``: half the pairs), the unmasked ring, ``all_gather_attention`` (k and v
gathered whole: Llama 3's context parallelism) and ``jf.attention`` with q, k and v split along the
sequence on an explicit mesh (the same, partitioned by jf.attention) under the window, both again
under the causal mask alone (all_gather_attention on contiguous chunks, where the last device
does the most work; jf.attention trading halves of q into the head–tail layout), one
device's ``jf.attention`` under the window, and a prompt of the last tokens over the whole sequence
with k and v split on the explicit mesh (causal, bottom-right): jf.attention attending each device's
keys and merging through the lse, against the same call with k and v gathered first. For each: its median forward time over interleaved repeats
and its largest difference from one device's ``jf.attention`` under the same mask. The JSON has
the bench's layout (``python -m jaxforge.bench``): the masked ring is the ``jaxforge`` record, the
others anchors with ``ratio`` = their time / its.

    python benchmarks/ring_attention.py [--devices 4] [--repeats 5] [--out benchmarks/results] [--quick]

On a CPU the devices are simulated (``jax_num_cpu_devices``, set here before jax starts) and share
its cores: an uneven split shows only where there are as many cores as devices (``--devices 2``
on 2 cores; the JSON's name then says ``-2dev``). ``--quick``: 256 tokens, a window of 32 (the smoke test's size).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxforge as jf

SHAPE, WINDOW, PROMPT = (1, 8192, 4, 64), 512, 512  # (batch, tokens, heads, head_dim)
QUICK_SHAPE, QUICK_WINDOW, QUICK_PROMPT = (1, 256, 2, 16), 32, 16


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    shape, width, prompt = (QUICK_SHAPE, QUICK_WINDOW, QUICK_PROMPT) if args.quick else (SHAPE, WINDOW, PROMPT)
    mesh = jax.make_mesh((args.devices,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[: args.devices])
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal(shape), jnp.float32) for i in range(3))
    window = jf.masks.causal() & jf.masks.sliding_window(width)

    def ring(attend=jf.parallel.ring_attention, **kw):
        inner = lambda q, k, v: attend(q, k, v, axis_name="sp", load_balanced=False, **kw)  # noqa: E731
        return jax.jit(jf.shard(inner, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))

    explicit = jax.make_mesh((args.devices,), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[: args.devices])
    last = jf.masks.causal(shape[1] - prompt)  # the prompt's queries: the last positions

    def on_explicit_mesh(mask, specs=(P(None, "sp"),) * 3, queries=lambda q: q):
        attend = jax.jit(lambda q, k, v: jf.attention(*(jax.sharding.reshard(x, s) for x, s in zip((queries(q), k, v), specs)), mask=mask))

        def call(q, k, v):
            with jax.set_mesh(explicit):
                return attend(q, k, v)

        return call

    one_device = lambda mask, queries=lambda q: q: jax.jit(lambda q, k, v: jf.attention(queries(q), k, v, mask=mask))  # noqa: E731
    tail = lambda q: q[:, -prompt:]  # noqa: E731
    variants = {  # name: (function, one device's)
        "ring, causal & window": (ring(mask=window), one_device(window)),
        "ring, causal": (ring(causal=True), one_device(jf.masks.causal())),
        "ring, no mask": (ring(), one_device(None)),
        "all-gather, causal & window": (ring(jf.parallel.all_gather_attention, mask=window), one_device(window)),
        "k, v gathered, causal & window": (on_explicit_mesh(window), one_device(window)),
        "all-gather, causal": (ring(jf.parallel.all_gather_attention, causal=True), one_device(jf.masks.causal())),
        "k, v gathered, causal": (on_explicit_mesh(jf.masks.causal()), one_device(jf.masks.causal())),
        "one device, causal & window": (one_device(window), one_device(window)),
        "prompt, k, v split": (on_explicit_mesh(last, (P(), P(None, "sp"), P(None, "sp")), tail), one_device(last, tail)),
        "prompt, k, v gathered": (on_explicit_mesh(last, (P(),) * 3, tail), one_device(last, tail)),
    }
    references = {name: reference(q, k, v) for name, (_, reference) in variants.items()}
    variants = {name: fn for name, (fn, _) in variants.items()}
    times = {name: [] for name in variants}
    for fn in variants.values():
        jax.block_until_ready(fn(q, k, v))
    for _ in range(args.repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            times[name].append((time.perf_counter() - start) * 1e3)
    ours = float(np.median(times["ring, causal & window"]))
    records = []
    print(f"{'variant':31s} {'median ms':>10s} {'ratio':>6s} {'max |Δout| vs one device':>25s}")
    for name, fn in variants.items():
        median = float(np.median(times[name]))
        difference = float(jnp.max(jnp.abs(fn(q, k, v) - references[name])))
        print(f"{name:31s} {median:10.1f} {median / ours:6.2f} {difference:25.2e}")
        records.append(dict(
            op="ring_attention", mode="fwd", shape_name=f"{args.devices}dev_{shape[1]}tok_window{width}", shape=list(shape),
            status="ok", implementation="jaxforge" if name == "ring, causal & window" else name, variant=name,
            median_ms=median, ratio=median / ours, times_ms=times[name], accuracy={"out_vs_one_device": difference},
        ))  # fmt: skip
    device = jax.devices()[0]
    devices = "" if args.devices == 4 else f"-{args.devices}dev"
    path = args.out / f"{datetime.date.today()}-{device.platform}-ring-attention{devices}{'-quick' if args.quick else ''}.json"
    run = dict(family="ring_attention", date=str(datetime.date.today()), device=device.platform, device_kind=device.device_kind,
               backend=jax.default_backend(), jax_version=jax.__version__, devices=args.devices, window=width, prompt=prompt, dtype="float32",
               records=records)  # fmt: skip
    path.write_text(json.dumps(run, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # before jax starts its CPU backend
    main()
