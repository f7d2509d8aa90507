"""One process of a multi-process jaxforge job on localhost CPUs (see test_multiprocess.py).

Run as::

    python -m tests.multiprocess.worker --process-id I --num-processes P --port PORT \
        --mode {train,hang} --out FILE

Each process gets 2 CPU devices, float64 and gloo CPU collectives, and joins the job through
``jax.distributed.initialize`` (process 0 hosts the coordination service on ``localhost:PORT``).

* ``train``: one data- and tensor-parallel training step of a 2-layer MLP written with
  ``jf.shard`` and ``jf.collectives`` on a ("data", "model") = (2, 2) mesh over the 4 global
  devices, once with "data" across the processes (tensor parallelism inside a process) and once
  with "model" across them; the loss and the gradients, gathered to every host, go to ``--out``
  (.npz, keys ``<layout>/loss`` and ``<layout>/<param>``).
  Then a gradient of attention over a batch split across the 4 devices, masked by a block mask
  built outside ``jit`` from a function that closes over the global document ids
  (:func:`attention_step`; keys ``attention/...``).
* ``hang``: one all-reduce over jf.shard's default mesh (all devices of all processes), then
  process 0 prints ``WAITING_MARKER`` and enters a second one, which needs process 1; process 1
  prints ``PEER_IDLE_MARKER`` and sleeps until the test kills it.

:func:`train_step` is also what the test runs in its own single process as the reference.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import numpy as np

WAITING_MARKER = "WORKER0_WAITING_IN_COLLECTIVE"
PEER_IDLE_MARKER = "WORKER1_IDLE"
# Short enough that a dead peer is noticed within the test's budget, long enough that a process
# starved of CPU on a busy 2-core box still heartbeats in time.
HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 60
INIT_TIMEOUT_S = 60
# A worker orphaned by a test runner that died without killing it (SIGKILL, a crash) still ends:
# SIGALRM's default action terminates the process, even one blocked inside a C++ collective.
MAX_LIFETIME_S = 300

BATCH, D_IN, HIDDEN, D_OUT = 8, 4, 8, 3
WEIGHT_DECAY = 1e-2
LSE_WEIGHT = 0.1
# Where the 4 devices, ordered (process, local id), sit in the (data, model) mesh.
LAYOUTS = {
    "data_across_processes": lambda d: d.reshape(2, 2),  # row i = process i's devices
    "model_across_processes": lambda d: d.reshape(2, 2).T,  # column j = process j's devices
}


def make_inputs():
    """Deterministic float64 parameters and batch (the same in every process)."""
    rng = np.random.default_rng(1234)
    params = {
        "w1": rng.normal(size=(D_IN, HIDDEN)) / np.sqrt(D_IN),
        "b1": rng.normal(size=(HIDDEN,)) * 0.1,
        "w2": rng.normal(size=(HIDDEN, D_OUT)) / np.sqrt(HIDDEN),
        "b2": rng.normal(size=(D_OUT,)) * 0.1,
    }
    x = rng.normal(size=(BATCH, D_IN))
    y = rng.normal(size=(BATCH, D_OUT))
    return params, x, y


def make_mesh(devices, layout):
    import jax

    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    if len(devices) != 4:
        raise ValueError(f"train_step needs 4 devices, got {len(devices)}")
    return jax.sharding.Mesh(LAYOUTS[layout](np.asarray(devices, dtype=object)), ("data", "model"))


def _specs():
    from jax.sharding import PartitionSpec as P

    params = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    return params, P("data", None), P("data", None)


def _put(value, sharding):
    """This process's block of ``value`` (the same full array everywhere) as one global array."""
    import jax

    index_map = sharding.addressable_devices_indices_map(value.shape)
    block = []
    for dim, size in enumerate(value.shape):
        starts = [idx[dim].start or 0 for idx in index_map.values()]
        stops = [size if idx[dim].stop is None else idx[dim].stop for idx in index_map.values()]
        block.append(slice(min(starts), max(stops)))
    return jax.make_array_from_process_local_data(sharding, value[tuple(block)], value.shape)


def loss_fn(params, x, y, mesh):
    """Mean squared error of tanh MLP, + a soft-max over all examples' errors + weight decay.

    Layer 1 is column-parallel (copy_to_parallel), layer 2 row-parallel (reduce_from_parallel);
    the batch is split over "data". The extra terms route gradients through all_gather (whose
    transpose is a reduce-scatter across "data") and all_reduce("sum") over "model".
    """
    import jax
    import jax.numpy as jnp

    import jaxforge as jf

    param_specs, x_spec, y_spec = _specs()
    c = jf.collectives

    @jf.shard(mesh=mesh, in_specs=(param_specs, x_spec, y_spec), out_specs=jax.sharding.PartitionSpec())
    def per_device(p, xb, yb):
        h = jnp.tanh(c.copy_to_parallel(xb, "model") @ p["w1"] + p["b1"][None])  # (B/2, H/2)
        z = c.reduce_from_parallel(h @ p["w2"], "model") + p["b2"][None]  # (B/2, O)
        err = jnp.sum((z - yb) ** 2, axis=-1)  # (B/2,)
        every_err = c.all_gather(err, "data", tiled=True)  # (B,), the same on every device
        data_loss = jnp.mean(err) + LSE_WEIGHT * jax.nn.logsumexp(every_err)
        decay = c.all_reduce(jnp.sum(p["w1"] ** 2), "model", "sum")
        return c.all_reduce(data_loss, "data", "mean") + WEIGHT_DECAY * decay

    return per_device(params, x, y)


def train_step(devices, layout):
    """Loss and gradients of one step on a (2, 2) mesh of ``devices``, as host numpy arrays."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    mesh = make_mesh(devices, layout)
    params, x, y = make_inputs()
    param_specs, x_spec, y_spec = _specs()
    params = {k: _put(v, NamedSharding(mesh, param_specs[k])) for k, v in params.items()}
    x, y = _put(x, NamedSharding(mesh, x_spec)), _put(y, NamedSharding(mesh, y_spec))

    step = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)
    loss, grads = step(params, x, y, mesh)
    out = {"loss": loss, **grads}
    if jax.process_count() > 1:
        out = multihost_utils.process_allgather(out, tiled=True)
    return {k: np.asarray(v) for k, v in out.items()}


ATTENTION_SHAPE = (4, 32, 2, 8)  # batch, tokens, heads, head dim


def make_attention_inputs():
    """Deterministic q, k, v and packed documents' ids (the same in every process)."""
    rng = np.random.default_rng(99)
    batch, tokens, heads, dim = ATTENTION_SHAPE
    q, k, v = (rng.normal(size=ATTENTION_SHAPE) for _ in range(3))
    return q, k, v, np.sort(rng.integers(0, 3, (batch, tokens)), axis=1)


def attention_step(devices):
    """Loss and gradients (in q, k, v) of causal attention within packed documents, the batch split
    over ``devices`` (4, of every process), as host numpy arrays. The mask is FlexAttention's block
    mask per batch: built outside ``jit`` from a function closing over the global ids, then an
    argument of the jitted step (``jit`` refuses to close over arrays that span processes)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxforge as jf

    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.asarray(devices, dtype=object), ("batch",))
    q, k, v, ids = (_put(x, NamedSharding(mesh, PartitionSpec("batch"))) for x in make_attention_inputs())
    tokens = ATTENTION_SHAPE[1]
    mask = jf.masks.block_mask(lambda b, h, i, j: (ids[b, i] == ids[b, j]) & (j <= i), tokens, tokens, batch_shape=ATTENTION_SHAPE[:1])

    def loss(q, k, v, mask):
        return jnp.sum(jnp.sin(jf.attention(q, k, v, mask=mask)))

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v, mask)
    out = {"attention/loss": value, **{f"attention/d{name}": g for name, g in zip("qkv", grads)}}
    if jax.process_count() > 1:
        out = multihost_utils.process_allgather(out, tiled=True)
    return {key: np.asarray(x) for key, x in out.items()}


def _configure_and_initialize(args):
    import inspect

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(
        coordinator_address=f"localhost:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    optional = {
        "cluster_detection_method": "deactivate",  # never read SLURM/MPI/... variables
        "initialization_timeout": INIT_TIMEOUT_S,
        "heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT_S,
        "shutdown_timeout_seconds": SHUTDOWN_TIMEOUT_S,
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    kwargs.update({k: v for k, v in optional.items() if k in accepted})
    jax.distributed.initialize(**kwargs)
    assert jax.process_count() == args.num_processes, jax.process_count()
    assert jax.local_device_count() == 2 and jax.device_count() == 2 * args.num_processes, jax.devices()


def _global_sum(value):
    """All-reduce of a per-device value over jf.shard's default mesh (every device of every process)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxforge as jf

    local = np.full((jax.local_device_count(),), float(value))
    mesh = jf.transforms.default_mesh(("data",))  # the mesh jf.shard uses when given none
    arr = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, P("data")), local)
    total = jax.jit(
        jf.shard(lambda v: jf.collectives.all_reduce(jnp.sum(v), "data"), in_specs=P("data"), out_specs=P())
    )
    return float(np.asarray(total(arr).addressable_data(0)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=("train", "hang"), required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if hasattr(signal, "alarm"):
        signal.alarm(MAX_LIFETIME_S)

    _configure_and_initialize(args)
    import jax

    if args.mode == "train":
        results = {}
        for layout in LAYOUTS:
            for name, value in train_step(jax.devices(), layout).items():
                results[f"{layout}/{name}"] = value
        results.update(attention_step(jax.devices()))
        if args.out:
            np.savez(args.out, **results)
        jax.distributed.shutdown()
        return 0

    # hang
    n = args.num_processes
    expected = 2 * sum(range(1, n + 1))  # each process's 2 devices hold process_id + 1
    got = _global_sum(args.process_id + 1)
    if got != expected:
        print(f"first all-reduce gave {got}, expected {expected}", file=sys.stderr, flush=True)
        return 3
    if args.process_id == 0:
        print(WAITING_MARKER, flush=True)
        _global_sum(1)  # needs process 1, which never joins
        print("second all-reduce returned, which it must not", file=sys.stderr, flush=True)
        return 4
    print(PEER_IDLE_MARKER, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
