"""The main job: the demo trains below the unigram baseline and writes its plot and sample; its
data packing and baseline are checked against hand-made cases."""

import subprocess
import sys

import numpy as np
import pytest

import jaxforge as jf
from jaxforge.demo import data


def test_pack_keeps_documents_apart():
    packed = data.pack([b"ab", b"cde", b"f"], length=4)
    # The stream: BOS a b BOS c d e BOS f -> two rows of 4; the last token is dropped.
    np.testing.assert_array_equal(packed.tokens, [[256, 97, 98, 256], [99, 100, 101, 256]])
    np.testing.assert_array_equal(packed.segments, [[0, 0, 0, 1], [1, 1, 1, 2]])
    assert packed.num_targets == 4  # a<-BOS, b<-a, d<-c, e<-d; c<-BOS spans two rows, BOS<-b two documents
    with pytest.raises(ValueError, match="fewer than one row"):
        data.pack([b"ab"], length=8)


def test_unigram_baseline_is_the_cross_entropy_of_training_frequencies():
    train = data.pack([b"aab"] * 4, length=4)  # targets per row: a a b
    validation = data.pack([b"abb"], length=4)
    counts = np.ones(data.VOCAB_SIZE)
    counts[ord("a")] += 8
    counts[ord("b")] += 4
    p = counts / counts.sum()
    want = -np.mean(np.log([p[ord("a")], p[ord("b")], p[ord("b")]]))
    assert data.unigram_cross_entropy(train, validation) == pytest.approx(want, rel=1e-12)


def test_stdlib_documents_are_top_level_definitions():
    documents = data.stdlib_documents(50_000)
    assert 50_000 <= sum(map(len, documents)) < 50_000 + max(map(len, documents))
    assert sum(d.lstrip().startswith((b"def ", b"class ", b"@")) for d in documents) > len(documents) // 2
    train, validation = data.split(documents)
    assert len(validation) == -(-len(documents) // 20) and len(train) + len(validation) == len(documents)


def run_tiny_demo(out) -> str:
    """Runs ``python -m jaxforge.demo --size tiny`` (no benchmark tables); returns its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "jaxforge.demo", "--size", "tiny", "--out", str(out), "--no-bench"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_generation_through_the_kv_cache_attends_to_the_last_window_of_tokens():
    """The demo's sampler (prompt prefilled into a KV cache, then one token a step, keys within the
    window) picks, near zero temperature, the tokens of a greedy loop that re-runs the model on
    the last ``window`` tokens each step: the same attention for one layer (rotary positions are
    relative; deeper, the cached keys carry what their own windows saw)."""
    import jax
    import jax.numpy as jnp

    from jaxforge.demo import train

    params = train.init_params(train.Size(16, 1, 4, 2, length=8, batch=1, steps=1, text_bytes=1, learning_rate=0.0))
    params = jax.tree.map(lambda x: x.astype(jnp.float64) * 3, params)  # sharper logits: no near ties
    window, prompt = 6, b"def"
    sampled = train.generate(params, prompt, 12, window=window, temperature=1e-9)
    tokens = [data.BOS, *prompt]
    for _ in range(12):
        logits = jf.nn.transformer(params, jnp.asarray(tokens[-window:]))[-1, :256]
        tokens.append(int(jnp.argmax(logits)))
    assert sampled == bytes(tokens[1:])


def test_demo_trains_below_the_unigram_baseline(tmp_path):
    stdout = run_tiny_demo(tmp_path)
    assert "data-parallel over 4 cpu devices" in stdout
    assert "validation loss below the unigram baseline: yes" in stdout
    assert "attention fwd+bwd" not in stdout  # --no-bench (the tables are bench's, tested there)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sample = (tmp_path / "sample.txt").read_bytes()
    assert sample.startswith(b"def ") and len(sample) == 4 + 300


def test_demo_rejects_bad_flags():
    done = subprocess.run([sys.executable, "-m", "jaxforge.demo", "--steps", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "--steps must be at least 1, got 0" in done.stderr


@pytest.mark.gpu
def test_demo_trains_on_the_gpu(tmp_path):
    stdout = run_tiny_demo(tmp_path)
    assert "gpu devices" in stdout and "validation loss below the unigram baseline: yes" in stdout
