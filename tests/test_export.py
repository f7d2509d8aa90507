"""jf.export: a trained model (attention, LSTM, GRU) round-trips through a file into a fresh
process with identical outputs; damaged, foreign and unknown-target artifacts are refused."""

import hashlib
import json
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxforge as jf
from jaxforge import export

nn = jf.nn
VOCAB, SEQ = 20, 12


def init(key):
    k_transformer, k_lstm, k_gru = jax.random.split(key, 3)
    return {
        "transformer": nn.init_transformer(k_transformer, vocab_size=VOCAB, features=16, depth=1, num_heads=4, num_kv_heads=2),
        "lstm": nn.init_lstm(k_lstm, 16, 8),
        "gru": nn.init_gru(k_gru, 16, 8),
    }


def model(params, tokens, segments):
    mask = jf.masks.causal() & jf.masks.document(segments)
    x = nn.embedding(params["transformer"]["embedding"], tokens)
    return {
        "logits": nn.transformer(params["transformer"], tokens, mask=mask),
        "lstm": nn.lstm(params["lstm"], x)[0],
        "gru": nn.gru(params["gru"], x)[1],
    }


def batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)
    segments = np.sort(rng.integers(0, 3, (2, SEQ)), axis=-1).astype(np.int32)
    return tokens, segments


def trained_params():
    """Two Adam steps, so the saved params are not the initial ones."""
    params, opt = init(jax.random.key(0)), optax.adam(1e-2)
    state = opt.init(params)
    tokens, segments = batch()

    def loss(params):
        out = model(params, tokens, segments)
        return nn.cross_entropy(out["logits"][:, :-1], tokens[:, 1:]) + jnp.mean(out["lstm"] ** 2) + jnp.mean(out["gru"] ** 2)

    @jax.jit
    def step(params, state):
        updates, state = opt.update(jax.grad(loss)(params), state)
        return optax.apply_updates(params, updates), state

    for _ in range(2):
        params, state = step(params, state)
    return params


LOADER = textwrap.dedent(
    """
    import sys, jax, numpy as np
    import jaxforge as jf
    artifact = jf.export.load(sys.argv[1])
    inputs = np.load(sys.argv[2], allow_pickle=False)
    leaves = [inputs[f"leaf{i}"] for i in range(len(inputs.files))]
    args, kwargs = jax.tree.unflatten(artifact.exported.in_tree, leaves)
    out = artifact(*args, **kwargs)
    np.savez(sys.argv[3], **{f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(out))})
    """
)


@pytest.mark.slow
def test_trained_model_round_trips_into_a_fresh_process(tmp_path):
    params = trained_params()
    tokens, segments = batch(seed=1)
    artifact = export.save(model, (params, tokens, segments), tmp_path / "model.jfx")
    assert artifact.header["platforms"] == ["cpu"] and artifact.header["in_avals"][-1] == "int32[2,12]"
    leaves = jax.tree.leaves(((params, tokens, segments), {}))
    np.savez(tmp_path / "in.npz", **{f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)})
    done = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "model.jfx"), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = np.load(tmp_path / "out.npz", allow_pickle=False)
    want = jax.tree.leaves(jax.jit(model)(params, tokens, segments))
    assert len(got.files) == len(want) == 3
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[f"leaf{i}"], w)


def test_linalg_results_round_trip_with_their_named_tuple(tmp_path):
    a = np.random.default_rng(0).normal(size=(3, 6, 4))
    b = np.random.default_rng(1).normal(size=(3, 6))
    export.save(lambda a, b: (jf.linalg.lstsq(a, b), jf.linalg.svd(a, compute_uv=False)), (a, b), tmp_path / "la.jfx")
    loaded = export.load(tmp_path / "la.jfx")
    (result, s), (want, want_s) = loaded(a, b), (jf.linalg.lstsq(a, b), jf.linalg.svd(a, compute_uv=False))
    assert type(result) is jf.linalg.LstsqResult
    assert all(c.startswith("lapack_") for c in loaded.header["custom_calls"]) and loaded.header["custom_calls"]
    for g, w in zip((*result, s), (*want, want_s)):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("placed", [False, True], ids=["host_arguments", "arguments_on_the_mesh"])
def test_a_function_sharded_over_devices_round_trips(tmp_path, placed):
    """A jf.shard function on 4 of the 8 devices: the artifact runs on this process's first 4, on a
    mesh of the saved one's axes where the arguments were placed on it (their shardings are the
    export's), else with its arguments replicated (jax's own call refuses a 1-device context)."""
    mesh = jax.make_mesh((4,), ("i",), devices=jax.devices()[:4])
    f = jf.shard(lambda x, w: jf.collectives.all_reduce(x @ w, "i"), mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(8, 3)), rng.normal(size=(3, 2))
    if placed:
        x = jax.device_put(x, NamedSharding(mesh, P("i")))
    export.save(f, (x, w), tmp_path / "sharded.jfx")
    loaded = export.load(tmp_path / "sharded.jfx")
    assert loaded.exported.nr_devices == 4
    assert loaded.header["mesh"] == ({"axis_names": ["i"], "axis_sizes": [4], "axis_types": ["Explicit"]} if placed else None)
    for x in (x, rng.normal(size=(8, 3))):
        np.testing.assert_allclose(loaded(x, w), f(x, w), rtol=1e-12, atol=1e-12)


def test_a_bad_mesh_in_the_header_is_refused(tmp_path, artifact_bytes):
    raw = artifact_bytes
    start = len(export.MAGIC) + 8
    size = int.from_bytes(raw[len(export.MAGIC) : start], "little")
    header = json.loads(raw[start : start + size])
    for mesh in ({"axis_names": ["i"], "axis_sizes": [4]}, {"axis_names": ["i"], "axis_sizes": [-1], "axis_types": ["Auto"]}, [4]):
        encoded = json.dumps(dict(header, mesh=mesh)).encode()
        (tmp_path / "m.jfx").write_bytes(export.MAGIC + len(encoded).to_bytes(8, "little") + encoded + raw[start + size :])
        with pytest.raises(ValueError, match=r"is corrupted: its header's mesh .* is not valid"):
            export.load(tmp_path / "m.jfx")


def test_symbolic_batch_dim(tmp_path):
    params = nn.init_mlp(jax.random.key(0), 4, 8)
    (spec,) = jax.export.symbolic_args_specs((np.zeros((1, 4), np.float32),), "b, 4")
    export.save(nn.mlp, (params, spec), tmp_path / "mlp.jfx")
    loaded = export.load(tmp_path / "mlp.jfx")
    for rows in (1, 5):
        x = np.ones((rows, 4), np.float32)
        np.testing.assert_allclose(loaded(params, x), nn.mlp(params, x), rtol=1e-6)


# -- refusals -------------------------------------------------------------------------------------


@pytest.fixture
def artifact_bytes(tmp_path):
    export.save(lambda x: jnp.sin(x) * 2, (np.ones(3, np.float32),), tmp_path / "ok.jfx")
    return (tmp_path / "ok.jfx").read_bytes()


def write(tmp_path, data: bytes):
    path = tmp_path / "bad.jfx"
    path.write_bytes(data)
    return path


def test_a_flipped_payload_byte_is_refused(tmp_path, artifact_bytes):
    data = bytearray(artifact_bytes)
    data[-40] ^= 0x01
    with pytest.raises(ValueError, match=r"bad.jfx is corrupted: its payload does not match the sha256"):
        export.load(write(tmp_path, bytes(data)))


def test_a_damaged_header_or_truncated_file_is_refused(tmp_path, artifact_bytes):
    start = len(export.MAGIC) + 8
    with pytest.raises(ValueError, match=r"is corrupted: its header is not valid"):
        export.load(write(tmp_path, artifact_bytes[:start] + b"#" + artifact_bytes[start + 1 :]))
    with pytest.raises(ValueError, match=r"corrupted or truncated"):
        export.load(write(tmp_path, artifact_bytes[: start + 10]))
    with pytest.raises(ValueError, match=r"does not match the sha256"):
        export.load(write(tmp_path, artifact_bytes[:-1]))
    with pytest.raises(ValueError, match=r"is not a jaxforge export"):
        export.load(write(tmp_path, b"\x89PNG" + artifact_bytes))


def forge(tmp_path, payload: bytes, **header) -> bytes:
    """An artifact with a consistent header around ``payload``, as an attacker could write it."""
    header = {"format": export.FORMAT, "custom_calls": [], "payload_bytes": len(payload),
              "payload_sha256": hashlib.sha256(payload).hexdigest(), **header}
    encoded = json.dumps(header).encode()
    return write(tmp_path, export.MAGIC + len(encoded).to_bytes(8, "little") + encoded + payload)


def test_unknown_custom_calls_are_refused(tmp_path):
    for target in ("evil_target", "jaxforge_not_a_kernel"):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((3,), jnp.float32))
        exported = jax.export.export(
            jax.jit(lambda x: call(x)), disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)]
        )(np.ones(3, np.float32))
        path = forge(tmp_path, bytes(exported.serialize()), custom_calls=[target])
        with pytest.raises(ValueError, match=rf"calls unknown custom-call targets \['{target}'\]"):
            export.load(path)


def test_a_header_that_hides_a_custom_call_is_refused(tmp_path):
    exported = jax.export.export(jax.jit(lambda a: tuple(jnp.linalg.svd(a))))(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match=r"its header lists custom calls \[\], the module \['lapack_sgesdd_ffi'\]"):
        export.load(forge(tmp_path, bytes(exported.serialize())))


class _Exploit:
    """Unpickling it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_payload_is_never_unpickled(tmp_path):
    marker = tmp_path / "was-unpickled"
    path = forge(tmp_path, pickle.dumps(_Exploit(marker)))
    with pytest.raises(ValueError, match=r"is corrupted: its payload does not deserialize"):
        export.load(path)
    assert not marker.exists()


def test_save_rejects_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"export.save: `fn` must be callable, got int"):
        export.save(3, (1.0,), tmp_path / "x.jfx")
    with pytest.raises(TypeError, match=r"export.save: `args` must be a tuple or list of fn's arguments, got ndarray"):
        export.save(jnp.sin, np.ones(3), tmp_path / "x.jfx")


def test_export_for_cpu_and_cuda_from_a_cpu_machine(tmp_path):
    q = np.random.default_rng(0).normal(size=(1, 64, 2, 32)).astype(np.float32)

    def f(q):
        return jf.attention(q, q, q, mask=jf.masks.causal())

    saved = export.save(f, (q,), tmp_path / "both.jfx", platforms=("cpu", "cuda"))
    assert saved.header["platforms"] == ["cpu", "cuda"]
    assert "__gpu$xla.gpu.triton" in saved.header["custom_calls"]  # the Pallas Triton kernel, for cuda
    np.testing.assert_array_equal(export.load(tmp_path / "both.jfx")(q), jax.jit(f)(q))
    # Embedded Triton IR is only sure to be read by the jax that wrote it.
    older = forge(tmp_path, bytes(saved.exported.serialize()), custom_calls=saved.header["custom_calls"], jax="0.0.1")
    with pytest.raises(ValueError, match=r"compiled from embedded IR \(\['__gpu\$xla.gpu.triton'\]\) by jax 0.0.1"):
        export.load(older)
