"""Trains a byte-level decoder-only transformer on packed documents, data-parallel with jf.shard.

Every device holds the params and a slice of the batch; the loss is the mean over all the
batch's targets (a sum and a count all-reduced), so its gradient is the single-device gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxforge as jf
from jaxforge.demo.data import BOS, VOCAB_SIZE, Packed

nn, C = jf.nn, jf.collectives


@dataclasses.dataclass(frozen=True)
class Size:
    """A model and a run: the transformer's shape, the batch, the steps and how much text."""

    features: int
    depth: int
    num_heads: int
    num_kv_heads: int
    length: int  # tokens per row
    batch: int  # rows per step, over all devices
    steps: int
    text_bytes: int
    learning_rate: float


SIZES = {
    "tiny": Size(64, 2, 4, 2, length=64, batch=16, steps=100, text_bytes=150_000, learning_rate=3e-3),
    "small": Size(128, 3, 4, 2, length=128, batch=16, steps=400, text_bytes=400_000, learning_rate=3e-3),
    "base": Size(512, 8, 8, 2, length=512, batch=32, steps=2000, text_bytes=4_000_000, learning_rate=1e-3),
}


def init_params(size: Size, seed: int = 0) -> dict:
    return nn.init_transformer(
        jax.random.key(seed),
        vocab_size=VOCAB_SIZE,
        features=size.features,
        depth=size.depth,
        num_heads=size.num_heads,
        num_kv_heads=size.num_kv_heads,
    )


def parameter_count(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def summed_loss(params, tokens, segments):
    """(sum of next-token losses, number of targets) for rows of packed documents."""
    mask = jf.masks.causal() & jf.masks.document(segments[..., :-1])
    logits = nn.transformer(params, tokens[..., :-1], mask=mask)
    within = segments[..., 1:] == segments[..., :-1]  # no target across a document boundary
    count = jnp.sum(within)
    return nn.cross_entropy(logits, tokens[..., 1:], where=within) * count, count


def optimizer(size: Size) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, size.learning_rate, warmup_steps=max(size.steps // 20, 1), decay_steps=size.steps, end_value=size.learning_rate / 10
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def make_steps(mesh: Mesh, opt: optax.GradientTransformation):
    """(train_step, eval_loss), each one jitted jf.shard over the mesh's "data" axis."""
    rows = P("data")

    def global_mean(params, tokens, segments):
        total, count = summed_loss(params, tokens, segments)
        return C.all_reduce(total, "data") / C.all_reduce(count, "data")

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    @functools.partial(jf.shard, mesh=mesh, in_specs=(P(), P(), rows, rows), out_specs=(P(), P(), P()))
    def train_step(params, opt_state, tokens, segments):
        loss, grads = jax.value_and_grad(global_mean)(params, tokens, segments)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(jf.shard(global_mean, mesh=mesh, in_specs=(P(), rows, rows), out_specs=P()))
    return train_step, eval_loss


def batches(data: Packed, batch: int, seed: int):
    """Endless random batches of rows (each epoch a fresh permutation)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(data.tokens))
        for start in range(0, len(order) - batch + 1, batch):
            rows = order[start : start + batch]
            yield data.tokens[rows], data.segments[rows]


def evaluate(eval_loss, params, data: Packed, batch: int, max_batches: int = 4) -> float:
    """Mean loss over the first ``max_batches`` batches of ``data``, weighted by targets."""
    total = count = 0.0
    for start in range(0, min(len(data.tokens), max_batches * batch) - batch + 1, batch):
        tokens, segments = data.tokens[start : start + batch], data.segments[start : start + batch]
        within = int(np.sum(segments[:, 1:] == segments[:, :-1]))
        total += float(eval_loss(params, tokens, segments)) * within
        count += within
    return total / max(count, 1)


def generate(params, prompt: bytes, length: int, *, window: int, temperature: float = 0.8, seed: int = 0) -> bytes:
    """``prompt`` and ``length`` bytes sampled after it, each token attending to the last ``window``
    (the context the model was trained on) through a KV cache: the prompt prefilled, then one
    token a step. (Sliding-window attention: past the first layer the cached keys carry what
    their own windows saw, so a token's context reaches further back than ``window``.)"""
    tokens = jnp.asarray([[BOS, *prompt]], jnp.int32)
    cache = nn.init_kv_cache(params["blocks"]["attention"], (1,), tokens.shape[1] + length)

    @jax.jit
    def step(params, tokens, cache, key):
        within_window = ~jf.masks.causal(cache["length"] - window)  # keys after q - window (causal: added)
        logits, cache = nn.transformer(params, tokens, mask=within_window, cache=cache)
        return jax.random.categorical(key, logits[:, -1, :256] / temperature), cache  # bytes only, never BOS

    key, sampled = jax.random.key(seed), []
    for _ in range(length):
        key, sub = jax.random.split(key)
        token, cache = step(params, tokens, cache, sub)
        sampled.append(int(token[0]))
        tokens = token[:, None]
    return prompt + bytes(sampled)


@dataclasses.dataclass
class History:
    """Per-step training loss, validation loss at a few steps, and the speed of the steps."""

    steps: list[int] = dataclasses.field(default_factory=list)
    train: list[float] = dataclasses.field(default_factory=list)
    eval_steps: list[int] = dataclasses.field(default_factory=list)
    validation: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # in training steps after the first
    tokens_per_second: float = 0.0


def train(size: Size, train_data: Packed, validation: Packed, mesh: Mesh, *, progress, seed: int = 0):
    """Runs ``size.steps`` steps; returns (params, History)."""
    opt = optimizer(size)
    params = init_params(size, seed)
    opt_state = opt.init(params)
    train_step, eval_loss = make_steps(mesh, opt)
    history = History()
    eval_every = max(size.steps // 6, 1)
    data = batches(train_data, size.batch, seed)
    for step in range(1, size.steps + 1):
        tokens, segments = next(data)
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, tokens, segments)
        history.steps.append(step)
        history.train.append(float(loss))
        if step > 1:  # the first step compiles
            history.seconds += time.perf_counter() - start
        if step % eval_every == 0 or step == size.steps:
            history.eval_steps.append(step)
            history.validation.append(evaluate(eval_loss, params, validation, size.batch))
            progress(step, size.steps, f"loss {history.train[-1]:.3f}  validation {history.validation[-1]:.3f}")
    history.tokens_per_second = (size.steps - 1) * size.batch * size.length / max(history.seconds, 1e-9)
    return params, history
