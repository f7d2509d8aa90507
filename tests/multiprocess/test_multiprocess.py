"""jf.shard, jf.collectives and jf.attention across processes: 2 localhost processes × 2 CPU devices, gloo.

Each test starts ``python -m tests.multiprocess.worker`` twice (see worker.py), joined by
``jax.distributed.initialize`` on a free localhost port, and always kills what it started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf
from tests.multiprocess import worker

ROOT = Path(__file__).resolve().parents[2]
NUM_PROCESSES = 2
TRAIN_TIMEOUT_S = 120  # both workers, start to exit
MARKER_TIMEOUT_S = 90  # until both hang-mode workers are past their first collective
DEAD_PEER_EXIT_S = 60  # process 0 must exit this soon after process 1 is killed
# What jax's distributed runtime prints (to stderr, then SIGABRT) when the coordination service
# notices a task stopped heartbeating (jax 0.10.2), worker.HEARTBEAT_TIMEOUT_S after the kill.
DEAD_PEER_ERROR = "Terminating process because the JAX distributed service detected fatal errors"

# Settings of the parent (conftest: 8 devices) or of the shell that a worker must not inherit:
# each worker configures its own devices, platform, precision and distributed parameters.
_DROPPED_ENV = {
    "JAX_NUM_CPU_DEVICES",
    "JAX_PLATFORMS",
    "JAX_PLATFORM_NAME",
    "JAX_ENABLE_X64",
    "JAX_CPU_COLLECTIVES_IMPLEMENTATION",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_BIND_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JAX_LOCAL_DEVICE_IDS",
    "JAX_PARTITION_INDEX",
    "JAX_SLICE_INDEX",
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Workers:
    """``NUM_PROCESSES`` worker processes, their output in files; ``with`` kills any still running."""

    def __init__(self, tmp_path: Path, mode: str):
        port, env = _free_port(), _worker_env()
        self.stdout = [tmp_path / f"worker{i}.out" for i in range(NUM_PROCESSES)]
        self.stderr = [tmp_path / f"worker{i}.err" for i in range(NUM_PROCESSES)]
        self.npz = [tmp_path / f"worker{i}.npz" for i in range(NUM_PROCESSES)]
        self.procs = []
        try:
            for i in range(NUM_PROCESSES):
                cmd = [sys.executable, "-m", "tests.multiprocess.worker", "--process-id", str(i), "--num-processes",
                       str(NUM_PROCESSES), "--port", str(port), "--mode", mode, "--out", str(self.npz[i])]
                with open(self.stdout[i], "wb") as out, open(self.stderr[i], "wb") as err:
                    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
                self.procs.append(proc)
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def out(self, i: int) -> str:
        return self.stdout[i].read_text(errors="replace")

    def err(self, i: int) -> str:
        return self.stderr[i].read_text(errors="replace")

    def report(self) -> str:
        parts = []
        for i, p in enumerate(self.procs):
            parts.append(f"--- worker {i}: returncode {p.poll()}\n[stdout]\n{self.out(i)[-3000:]}\n"
                         f"[stderr]\n{self.err(i)[-6000:]}")
        return "\n".join(parts)

    def wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() > deadline:
                self.__exit__()
                pytest.fail(f"workers still running after {timeout} s; killed them\n{self.report()}")
            if any(p.poll() not in (None, 0) for p in self.procs):
                time.sleep(1)  # let a peer's error reach its log, then stop the rest
                self.__exit__()
                pytest.fail(f"a worker failed\n{self.report()}")
            time.sleep(0.2)

    def wait_for(self, i: int, marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.out(i):
            if self.procs[i].poll() is not None:
                pytest.fail(f"worker {i} exited before printing {marker!r}\n{self.report()}")
            if time.monotonic() > deadline:
                pytest.fail(f"worker {i} did not print {marker!r} within {timeout} s\n{self.report()}")
            time.sleep(0.2)


def _dense_step():
    """The worker's loss written without sharding or collectives, and its gradients."""
    params, x, y = worker.make_inputs()

    def loss(p):
        h = jnp.tanh(x @ p["w1"] + p["b1"][None])
        err = jnp.sum((h @ p["w2"] + p["b2"][None] - y) ** 2, axis=-1)
        data = jnp.mean(err) + worker.LSE_WEIGHT * jax.nn.logsumexp(err)
        return data + worker.WEIGHT_DECAY * jnp.sum(p["w1"] ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return {"loss": np.asarray(value), **{k: np.asarray(v) for k, v in grads.items()}}


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for name in want:
        assert got[name].dtype == np.float64, (what, name, got[name].dtype)
        assert got[name].shape == want[name].shape, (what, name, got[name].shape, want[name].shape)
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_single_process_step_matches_dense(layout):
    """The reference the multi-process test compares against: 4 of this process's devices."""
    _assert_same(worker.train_step(jax.devices()[:4], layout), _dense_step(), f"single process, {layout}")


def test_single_process_attention_step_matches_one_device():
    """The attention step's reference: its batch split over 4 of this process's devices, its block
    mask of a function against the library's ``document & causal`` on one device."""
    q, k, v, ids = (jnp.asarray(x) for x in worker.make_attention_inputs())

    def loss(q, k, v):
        return jnp.sum(jnp.sin(jf.attention(q, k, v, mask=jf.masks.document(ids) & jf.masks.causal())))

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = {"attention/loss": np.asarray(value), **{f"attention/d{n}": np.asarray(g) for n, g in zip("qkv", grads)}}
    _assert_same(worker.attention_step(jax.devices()[:4]), want, "single process, attention")


@pytest.mark.slow
@pytest.mark.timeout(TRAIN_TIMEOUT_S + 60)
def test_two_processes_match_single_process(tmp_path):
    with Workers(tmp_path, "train") as workers:
        # The reference, in this process (4 of its 8 devices), while the workers run.
        want = {layout: worker.train_step(jax.devices()[:4], layout) for layout in worker.LAYOUTS}
        want["attention"] = {key.split("/", 1)[1]: v for key, v in worker.attention_step(jax.devices()[:4]).items()}
        workers.wait_all(TRAIN_TIMEOUT_S)
    for i, path in enumerate(workers.npz):
        assert path.exists(), f"worker {i} wrote no {path.name}\n{workers.report()}"
        with np.load(path) as data:
            results = {key: data[key] for key in data.files}
        for part in want:
            got = {key.split("/", 1)[1]: v for key, v in results.items() if key.startswith(part + "/")}
            _assert_same(got, want[part], f"worker {i} of {NUM_PROCESSES}, {part}")


@pytest.mark.slow
@pytest.mark.timeout(MARKER_TIMEOUT_S + DEAD_PEER_EXIT_S + 60)
def test_killed_peer_gives_clear_error_not_hang(tmp_path):
    with Workers(tmp_path, "hang") as workers:
        workers.wait_for(1, worker.PEER_IDLE_MARKER, MARKER_TIMEOUT_S)
        workers.wait_for(0, worker.WAITING_MARKER, MARKER_TIMEOUT_S)
        time.sleep(1)  # let process 0 block inside its second all-reduce
        assert workers.procs[0].poll() is None, f"process 0 exited before its peer was killed\n{workers.report()}"
        workers.procs[1].kill()
        workers.procs[1].wait()
        killed = time.monotonic()
        try:
            code = workers.procs[0].wait(timeout=DEAD_PEER_EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still waits {DEAD_PEER_EXIT_S} s after its peer was killed\n{workers.report()}")
        elapsed = time.monotonic() - killed
    stderr = workers.err(0)
    assert code != 0, f"process 0 exited with 0 after {elapsed:.1f} s\n{workers.report()}"
    assert DEAD_PEER_ERROR in stderr, (
        f"process 0 exited {code} after {elapsed:.1f} s without {DEAD_PEER_ERROR!r}\n{workers.report()}"
    )
    assert "stopped sending heartbeats" in stderr, workers.report()
