"""Random attention calls against the dense float64 attention, for minutes at a time: what the
suite's fixed cases may miss after a change to the masks, spans or tile loops.

Each seed draws batch, lengths (1-39, one seed in five up to 71), GQA heads, head dims, an implementation (XLA's default
tiles, small tiles with or without packed GQA, or the Triton kernels in interpret mode) and a mask:
a random tree of ``&``, ``|`` and ``~`` over causal (static or per-item offsets), sliding window and
chunked (static or per item), prefix LM, padding and document masks, masks of positions shifted to a block of the sequence
(static, shared or per-item offsets: ``jf.masks.shifted``), blocks of any of these leaves drawn over
a longer sequence (their per-position arrays sliced) and plain mask_mods evaluated by
``jf.masks.block_mask`` (frames, tables of visible pairs per item and head, sink keys and a window
far from them) and boolean arrays as jax.nn takes them (some dims broadcast), some subtrees
evaluated by ``block_mask`` as a whole (in one range or cut into pieces), the range pass taking
all rows at once or a few at a time. The visible pairs are computed here from each mask's
definition (not from the library's ``mask_mod``). ``first-order`` compares out, lse, the
gradient, the jvp and ``jax.linear_transpose`` in v (half the seeds with ``return_max_scores``: the rows' largest scores too, in
the loss and the jvp, and beside a jitted gradient as ``has_aux``; a third of the seeds a number
for ``scale``, a third one traced where the call is; likewise ``softcap``); ``second-order`` adds a score
mod (ALiBi, a captured relative-bias table or a per-head scale) and compares the gradient in the table too and a Hessian-vector product;
``sharded`` runs the call under jit on an explicit mesh of 8 CPU devices ("data" × "seq" = 2 × 4),
q split along its sequence (k and v too, or whole, or over "data") or k and v alone (the batch or the heads split over "data" or
neither; now and then an ALiBi-like bias on q_idx, b and h, or a relative-bias table passed into
jit; now and then no sequence split, the batch or the heads alone), and compares out, lse and the
gradient (the table's too; half the seeds the rows' largest scores too) and ``jax.linear_transpose``
in v against the dense vjp, its cotangent replicated. ``context-parallel`` runs
``jf.parallel.ring_attention`` or ``all_gather_attention`` inside ``jf.shard`` over 2 or 4 devices,
in contiguous chunks or the head–tail layout, under such a mask or none, causal or not, now and
then with a score mod, softcap and sinks, and compares out and the gradient (the table's too;
half the seeds with the rows' largest scores, in the loss too). ``jax-nn`` calls
``jf.nn.dot_product_attention`` and ``jax.nn.dot_product_attention`` with the same random
arguments (a bias and a mask of broadcast shapes, causal, windows, sequence lengths) and compares
out, lse, the gradient and the jvp.

    PYTHONPATH=. python tools/fuzz_attention.py [--mode first-order|second-order|sharded|context-parallel|jax-nn] [--seconds 600] [--seed 0]

prints each failing seed with its error, and last the count of seeds run and failed (exit 1 if any
failed). A seed reruns alone with ``--seed S --count 1``.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)

import jaxforge as jf  # noqa: E402
from jaxforge.functional.attention import Implementation  # noqa: E402
from tests.attention_dense import dense_jnp  # noqa: E402
from tools import fuzz_loop  # noqa: E402

masks = jf.masks


def _ids(rng, b, s, n):
    ids = rng.integers(0, n, (b, s)).astype(np.int32)
    return np.sort(ids, -1) if rng.random() < 0.6 else ids  # packed documents, or scattered ids


POSITIONAL = ["causal", "causal_per_item", "window", "chunked", "prefix", "prefix_per_item", "padding"]
LEAVES = [*POSITIONAL, "document", "frames", "table", "sinks_window", "array", "shifted", "block"]


def random_leaf(rng, b, hq, sq, skv, kinds=LEAVES):
    """``(mask, visible)``: a basic mask and its boolean pairs, broadcasting to (b, hq, sq, skv)."""
    q, k = np.arange(sq)[None, None, :, None], np.arange(skv)[None, None, None, :]
    kind = rng.choice(kinds)
    if kind in POSITIONAL:
        return positions_mask(rng, kind, b, sq, skv, q, k)
    if kind == "block":  # a block of a leaf over a longer sequence, its per-position arrays sliced
        extra = [int(rng.integers(0, 9)) for _ in range(2)]
        mask, visible = random_leaf(rng, b, hq, sq + extra[0], skv + extra[1], [k for k in LEAVES if k != "block"])
        qo, ko = (_offset(rng, b, n, low=0) for n in extra)
        visible = np.broadcast_to(visible, (b, hq, sq + extra[0], skv + extra[1]))
        rows = [visible[i, :, _at_item(qo, i) :][:, :sq, _at_item(ko, i) :][:, :, :skv] for i in range(b)]
        offsets = (o if isinstance(o, int) else jnp.asarray(o) for o in (qo, ko))
        return masks.shifted(mask, *offsets, q_len=sq, kv_len=skv), np.stack(rows)
    if kind == "shifted":  # a mask of positions moved to a block: queries from q_offset, keys from kv_offset
        offsets = [_offset(rng, b, 2 * max(sq, skv)) for _ in range(2)]
        at = lambda x, o: x + (o[:, None, None, None] if np.ndim(o) == 1 else np.asarray(o))  # noqa: E731
        mask, visible = positions_mask(rng, rng.choice([*POSITIONAL, "mask_mod"]), b, sq, skv, at(q, offsets[0]), at(k, offsets[1]))
        return masks.shifted(mask, *(o if isinstance(o, int) else jnp.asarray(o) for o in offsets)), visible
    if kind == "frames":  # a frame sees itself and those before: a plain mask_mod
        frame = int(rng.integers(1, max(sq, skv) + 2))
        return masks.block_mask(lambda b, h, i, j: i // frame >= j // frame, sq, skv), q // frame >= k // frame
    if kind == "array":  # jax.nn's boolean array, some dims broadcast
        shape = tuple(n if rng.random() < 0.7 else 1 for n in (b, hq, sq, skv))
        table = rng.random(shape) < rng.choice([0.05, 0.3, 0.9])
        if shape[:2] == (1, 1) and rng.random() < 0.3:  # shared by every item and head: measured once, no b or h
            return masks.block_mask(masks.from_array(table), sq, skv, ranges=_ranges(rng)), table
        return jnp.asarray(table) if rng.random() < 0.5 else masks.from_array(table), table
    if kind == "table":  # visible pairs drawn per item and head: holes, empty rows and columns
        table = rng.random((b, hq, sq, skv)) < rng.choice([0.05, 0.3, 0.9])
        pick = lambda b, h, i, j: jnp.asarray(table)[b, h, i, j]  # noqa: E731
        return masks.block_mask(pick, sq, skv, batch_shape=(b,), num_heads=hq, ranges=_ranges(rng)), table
    if kind == "sinks_window":  # bottom-right aligned: the window ends the long rows, a gap to cut past 32 keys
        sinks, width, offset = int(rng.integers(1, 6)), int(rng.integers(1, 12)), skv - sq
        fn = lambda b, h, i, j: (j < sinks) | ((j <= i + offset) & (j > i + offset - width))  # noqa: E731
        return masks.block_mask(fn, sq, skv, ranges=_ranges(rng)), (k < sinks) | ((k <= q + offset) & (k > q + offset - width))
    n = int(rng.integers(1, 5))
    q_ids = _ids(rng, b, sq, n)
    if sq == skv and rng.random() < 0.5:
        return masks.document(q_ids), q_ids[:, None, :, None] == q_ids[:, None, None, :]
    kv_ids = _ids(rng, b, skv, n)
    return masks.document(q_ids, kv_ids), q_ids[:, None, :, None] == kv_ids[:, None, None, :]


def _offset(rng, b, n, low=None):
    """A position offset in [low, n] (default [-n, n]): a Python int, one shared array value, or one
    per item."""
    low = -n if low is None else low
    r = rng.random()
    if r < 0.4:
        return int(rng.integers(low, n + 1))
    return rng.integers(low, n + 1, () if r < 0.6 else b).astype(np.int32)


def _at_item(offset, i):
    return int(offset[i]) if np.ndim(offset) else int(offset)


def positions_mask(rng, kind, b, sq, skv, q, k):
    """``(mask, visible)``: a mask of positions of ``kind`` (no per-position arrays), its pairs at
    positions ``q`` (``(b | 1, 1, sq, 1)``) and ``k`` (``(b | 1, 1, 1, skv)``)."""
    per_item = lambda x: x[:, None, None, None]  # noqa: E731
    if kind in ("causal", "causal_per_item"):
        offset = int(rng.integers(-sq, skv + 1)) if kind == "causal" else rng.integers(-sq, skv + 1, b).astype(np.int32)
        return masks.causal(offset), k <= q + (offset if kind == "causal" else per_item(offset))
    if kind == "window":  # an int (a static band), or one window an item (runtime bounds; 0 sees nothing)
        if rng.random() < 0.5:
            window = int(rng.integers(1, max(sq, skv) + 2))
            return masks.sliding_window(window), np.abs(q - k) < window
        window = rng.integers(0, max(sq, skv) + 2, b).astype(np.int32)
        return masks.sliding_window(window), np.abs(q - k) < per_item(window)
    if kind == "chunked":  # likewise
        if rng.random() < 0.5:
            chunk = int(rng.integers(1, max(sq, skv) + 2))
            return masks.chunked(chunk), q // chunk == k // chunk
        chunk = rng.integers(1, max(sq, skv) + 2, b).astype(np.int32)
        return masks.chunked(chunk), q // per_item(chunk) == k // per_item(chunk)
    if kind in ("prefix", "prefix_per_item"):
        prefix = int(rng.integers(0, skv + 2)) if kind == "prefix" else rng.integers(0, skv + 2, b).astype(np.int32)
        return masks.prefix_lm(prefix), (k < (prefix if kind == "prefix" else per_item(prefix))) | (k <= q)
    if kind == "padding":
        kv_len, q_len = rng.integers(0, skv + 1, b).astype(np.int32), rng.integers(0, sq + 1, b).astype(np.int32)
        if rng.random() < 0.5:
            return masks.padding(kv_len), k < per_item(kv_len)
        return masks.padding(kv_len, q_len), (k < per_item(kv_len)) & (q < per_item(q_len))
    return masks.from_mask_mod(lambda b, h, i, j: (3 * i + j) % 5 < 2), (3 * q + k) % 5 < 2  # a plain mask_mod


def _ranges(rng) -> int:
    """block_mask's ranges: one, or pieces cut at each row's widest gaps (a gap holds a whole block of
    16 keys only past 32 keys: tables and subtrees cut now and then)."""
    return int(rng.choice([1, 2, 3]))


def random_mask(rng, b, hq, sq, skv, depth=0):
    """A tree of up to two levels of ``&``, ``|``, ``~`` over basic masks, and its pairs; now and
    then a subtree evaluated by ``block_mask`` (its spans measured instead of derived)."""
    r = rng.random()
    if depth == 2 or r < 0.4:
        return random_leaf(rng, b, hq, sq, skv)
    if r < 0.5:
        mask, visible = random_mask(rng, b, hq, sq, skv, depth + 1)
        mask = masks.from_array(mask) if isinstance(mask, jax.Array) else mask  # block_mask takes a function
        return masks.block_mask(mask, sq, skv, batch_shape=(b,), num_heads=hq, ranges=_ranges(rng)), visible
    if r < 0.6:
        mask, visible = random_mask(rng, b, hq, sq, skv, depth + 1)
        return ~mask, ~visible
    (m1, v1), (m2, v2) = random_mask(rng, b, hq, sq, skv, depth + 1), random_mask(rng, b, hq, sq, skv, depth + 1)
    return (m1 & m2, v1 & v2) if r < 0.8 else (m1 | m2, v1 | v2)


def random_implementation(rng):
    r = rng.random()
    if r < 0.3:
        return "xla"
    if r < 0.85:
        block_q, block_kv = int(rng.choice([4, 8, 16, 64])), int(rng.choice([8, 16, 32]))
        return Implementation("xla", block_q=block_q, block_kv=block_kv, pack_gqa=bool(rng.random() < 0.3))
    return Implementation("pallas_triton", block_q=8, block_kv=16)


def _finite(x):
    return jnp.where(jnp.isfinite(x), x, 0)


def _loss(attend, weights):
    def loss(*args):
        out, lse, *top = attend(*args)  # and the rows' largest scores where asked for
        return jnp.sum(jnp.sin(out) * weights) + jnp.sum(_finite(lse) ** 2) + sum(jnp.sum(jnp.cos(_finite(t))) for t in top)

    return loss


def _loss_with_maxima_aside(attend, weights):
    """``_loss`` of ``out`` and ``lse`` with the rows' largest scores beside it (``has_aux``: a
    training step's QK-clip statistic, whose first keys jit's dead-code elimination drops)."""

    def loss(*args):
        out, lse, top = attend(*args)
        return _loss(lambda: (out, lse), weights)(), top

    return loss


def _assert_close(actual, expected, tol, rows=None):
    actual, expected = np.asarray(actual), np.asarray(expected)
    if rows is not None:  # lse and its tangent: compared on rows that see a key
        actual, expected = actual[rows], expected[rows]
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


def _assert_attention_close(ours, dense):
    """``(out, lse[, max_scores])`` against the dense attention's; lse (and the maxima) are -inf
    exactly on the rows that see no key. Returns those that see one."""
    (out, *row_values), (out_d, lse_d, *_) = ours, dense
    rows = np.isfinite(np.asarray(lse_d))
    _assert_close(out, out_d, 1e-9)
    for x, x_d in zip(row_values, dense[1:]):
        np.testing.assert_array_equal(np.isneginf(x), ~rows)
        _assert_close(x, x_d, 1e-9, rows)
    return rows


def run_seed(seed: int, mode: str) -> None:
    # The range pass's step (pairs a step): most seeds one step, some a row or a few at a time.
    per_step = int(np.random.default_rng([seed, 1]).choice([1 << 20, 1 << 20, 1 << 9, 1 << 6]))
    default, masks._PAIRS_PER_STEP = masks._PAIRS_PER_STEP, per_step
    try:
        _run_seed(seed, mode)
    finally:
        masks._PAIRS_PER_STEP = default


def _run_seed(seed: int, mode: str) -> None:
    rng = np.random.default_rng(seed)
    longest = 40 if rng.random() < 0.8 else 72  # past 32 keys, gaps of a whole block of 16 for block_mask to cut
    b, sq, skv = int(rng.integers(1, 3)), int(rng.integers(1, longest)), int(rng.integers(1, longest))
    hkv = int(rng.integers(1, 3))
    hq, d, dv = hkv * int(rng.integers(1, 3)), int(rng.choice([1, 4, 8])), int(rng.choice([1, 3, 8]))
    mask, visible = random_mask(rng, b, hq, sq, skv)
    visible = np.broadcast_to(visible, (b, hq, sq, skv))
    q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv)))
    table = jnp.asarray(rng.standard_normal((hq, sq + skv)))
    implementation = random_implementation(rng)
    if isinstance(implementation, Implementation) and implementation.name == "pallas_triton" and np.random.default_rng([seed, 5]).random() < 0.5:
        # head dims past 32, which the kernels hold in two pieces (32 + 16: config.head_pieces)
        implementation = dataclasses.replace(implementation, head_pieces=True)
        wide = np.random.default_rng([seed, 6])
        q, k, v = (jnp.concatenate([x, jnp.asarray(wide.standard_normal((*x.shape[:-1], 32)))], axis=-1) for x in (q, k, v))
        dv += 32  # (weights like out)
    score_mod = lambda table: None  # noqa: E731
    if mode == "second-order":
        score_mod = {
            "alibi": lambda table: lambda s, b, h, i, j: s - 0.3 * (h + 1) * jnp.abs(i - j),
            "relative_bias": lambda table: lambda s, b, h, i, j: s + table[h, i - j + skv],
            "head_scale": lambda table: lambda s, b, h, i, j: s * (1 + 0.1 * table[h, 0]),
        }[rng.choice(["alibi", "relative_bias", "head_scale"])]
    max_scores = mode == "first-order" and bool(np.random.default_rng([seed, 2]).random() < 0.5)  # apart: seeds keep their draws
    scale = _random_positive(np.random.default_rng([seed, 3]), 0.2, 2.0) if mode == "first-order" else lambda table: None
    softcap = _random_positive(np.random.default_rng([seed, 4]), 0.5, 5.0) if mode == "first-order" else lambda table: None
    ours = lambda q, k, v, table: jf.attention(  # noqa: E731
        q, k, v, mask=mask, score_mod=score_mod(table), scale=scale(table), softcap=softcap(table), return_lse=True,
        return_max_scores=max_scores, implementation=implementation,
    )
    dense = lambda q, k, v, table: dense_jnp(q, k, v, visible, score_mod(table), scale=scale(table), softcap=softcap(table), max_scores=max_scores)  # noqa: E731
    args = (q, k, v, table)
    rows = _assert_attention_close(ours(*args), dense(*args))
    weights = rng.standard_normal((b, sq, hq, dv))  # like out
    argnums = (0, 1, 2, 3) if mode == "second-order" else (0, 1, 2)
    grads = [jax.grad(_loss(f, weights), argnums=argnums)(*args) for f in (ours, dense)]
    for a, e in zip(*grads):
        _assert_close(a, e, 1e-8)
    if max_scores:  # jitted, the maxima aside: the forward that dead-code elimination leaves
        step = lambda f: jax.jit(jax.grad(_loss_with_maxima_aside(f, weights), argnums=argnums, has_aux=True))(*args)  # noqa: E731
        (step_grads, top), (step_grads_d, top_d) = step(ours), step(dense)
        _assert_close(top, top_d, 1e-9, rows)
        for a, e in zip(step_grads, step_grads_d):
            _assert_close(a, e, 1e-8)
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in args)
    if mode == "first-order":
        (t_out, *t_rows), (t_out_d, *t_rows_d) = (jax.jvp(f, args, tangents)[1] for f in (ours, dense))
        _assert_close(t_out, t_out_d, 1e-8)
        for t, t_d in zip(t_rows, t_rows_d):  # lse's and the maxima's
            _assert_close(t, t_d, 1e-8, rows)
        out_in_v = lambda f: lambda v: f(q, k, v, table)[0]  # noqa: E731  (linear: pieces merge through the lse)
        cotangent = jnp.asarray(weights)
        _assert_close(jax.linear_transpose(out_in_v(ours), v)(cotangent)[0], jax.vjp(out_in_v(dense), v)[1](cotangent)[0], 1e-8)
    else:
        hvps = [jax.jvp(jax.grad(_loss(f, weights), argnums=argnums), args, tangents)[1] for f in (ours, dense)]
        for a, e in zip(*hvps):
            _assert_close(a, e, 1e-7)


def _random_positive(rng, low: float, high: float):
    """``scale(table)`` or ``softcap(table)``: the default, a number in ``[low, high)``, or a function of
    the table in that range (first-order seeds do not differentiate the table, but their jvp moves
    it, and jit traces it: a traced scale or cap)."""
    kind = rng.choice(["default", "number", "of the table"])
    number = float(rng.uniform(low, high))
    return {
        "default": lambda table: None,
        "number": lambda table: number,
        "of the table": lambda table: low + (high - low) * (1 + jnp.tanh(table[0, 0])) / 2,
    }[kind]


def _run_sharded_seed(seed: int) -> None:
    """A random call with its sequences split on an explicit ("data", "seq") mesh, against the dense
    attention on one device."""
    rng = np.random.default_rng(seed)
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2, devices=jax.devices()[:8])
    b, sq, skv, hkv = 2, 4 * int(rng.integers(1, 11)), 4 * int(rng.integers(1, 11)), int(rng.integers(1, 3))
    hq, d = hkv * int(rng.integers(1, 3)), int(rng.choice([4, 8]))
    mask, visible = random_mask(rng, b, hq, sq, skv)
    visible = np.broadcast_to(visible, (b, hq, sq, skv))
    q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, d)))
    table = jnp.asarray(rng.standard_normal((hq, sq + skv)))  # passed into jit: the shard_map takes it as an operand
    score_mod = {
        "none": lambda table: None,
        "alibi": lambda table: lambda s, b, h, i, j: s - 0.3 * (h + 1) * jnp.abs(i - j) - 0.05 * b * (i - j),
        "relative_bias": lambda table: lambda s, b, h, i, j: s + table[h, i - j + skv],
    }[rng.choice(["none", "alibi", "relative_bias"], p=[0.6, 0.2, 0.2])]
    implementation = random_implementation(rng)
    implementation = "xla" if isinstance(implementation, str) or implementation.name != "xla" else implementation
    batch = "data" if rng.random() < 0.5 else None
    heads = "data" if batch is None and hkv % 2 == 0 and rng.random() < 0.5 else None  # "data" splits the heads instead
    q_seq, kv_seq = ("seq", "seq" if rng.random() < 0.6 else None) if rng.random() < 0.7 else (None, "seq")  # the latter: keys split alone
    if batch is None and heads is None and rng.random() < 0.3:  # keys over "data": beside q's split, or alone
        kv_seq = "data"
    later = np.random.default_rng([seed, 3])  # draws added later, apart: seeds keep their draws
    if (batch or heads) and later.random() < 0.3:  # the batch or the heads split alone: no shard_map
        q_seq = kv_seq = None
    specs = (P(batch, q_seq, heads), *[P(batch, kv_seq, heads)] * 2)
    max_scores = bool(np.random.default_rng([seed, 2]).random() < 0.5)  # apart: seeds keep their draws
    ours = lambda q, k, v, table: jf.attention(  # noqa: E731
        q, k, v, mask=mask, score_mod=score_mod(table), return_lse=True, return_max_scores=max_scores, implementation=implementation
    )
    dense = lambda q, k, v, table: dense_jnp(q, k, v, visible, score_mod(table), max_scores=max_scores)  # noqa: E731
    weights = rng.standard_normal((b, sq, hq, d))
    with jax.set_mesh(mesh):
        split = [jax.device_put(x, spec) for x, spec in zip((q, k, v, table), (*specs, P()))]
        results = jax.jit(ours)(*split)
        grads = jax.jit(jax.grad(_loss(ours, weights), argnums=(0, 1, 2, 3)))(*split)
        in_v = jax.jit(lambda q, k, v, table: jax.linear_transpose(lambda v: ours(q, k, v, table)[0], v)(weights)[0])(*split)
    _assert_attention_close(results, dense(q, k, v, table))
    for a, e in zip(grads, jax.grad(_loss(dense, weights), argnums=(0, 1, 2, 3))(q, k, v, table)):
        _assert_close(a, e, 1e-8)
    _assert_close(in_v, jax.vjp(lambda v: dense(q, k, v, table)[0], v)[1](jnp.asarray(weights))[0], 1e-8)


def _run_context_parallel_seed(seed: int) -> None:
    """``jf.parallel.ring_attention`` or ``all_gather_attention`` inside ``jf.shard`` over 2 or 4
    CPU devices (contiguous chunks or the head–tail layout; now and then chunks of keys of another
    length than the queries'), under a random mask or none, causal
    or not, now and then a score_mod (the relative-bias table an operand of the shard), softcap
    and sinks, against the dense attention on one device: out and the gradients."""
    rng = np.random.default_rng(seed)
    n, balanced = int(rng.choice([2, 4])), bool(rng.random() < 0.6)
    attend = jf.parallel.ring_attention if rng.random() < 0.6 else jf.parallel.all_gather_attention
    b, hkv, s = int(rng.integers(1, 3)), int(rng.integers(1, 3)), n * 2 * int(rng.integers(1, 6))
    skv = s if rng.random() < 0.7 else n * 2 * int(rng.integers(1, 6))  # chunks of keys of another length
    hq, d, dv = hkv * int(rng.integers(1, 3)), int(rng.choice([4, 8])), int(rng.choice([3, 8]))
    mask, visible = random_mask(rng, b, hq, s, skv) if rng.random() < 0.7 else (None, np.ones((1, 1, s, skv), bool))
    causal = bool(rng.random() < 0.5)
    visible = np.broadcast_to(visible & (np.arange(skv)[None, :] <= np.arange(s)[:, None]) if causal else visible, (b, hq, s, skv))
    q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((b, s, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv)))
    table = jnp.asarray(rng.standard_normal((hq, s + skv)))
    score_mod = {
        "none": lambda table: None,
        "alibi": lambda table: lambda x, b, h, i, j: x - 0.3 * (h + 1) * jnp.abs(i - j),
        "relative_bias": lambda table: lambda x, b, h, i, j: x + table[h, i - j + skv],
    }[rng.choice(["none", "alibi", "relative_bias"])]
    softcap = float(rng.choice([2.0, 5.0])) if rng.random() < 0.3 else None
    sinks = jnp.asarray(rng.standard_normal(hq)) if rng.random() < 0.3 else None

    max_scores = bool(np.random.default_rng([seed, 2]).random() < 0.5)  # the rows' largest scores too (apart: seeds keep their draws)

    def local(q, k, v, table):
        kw = dict(causal=causal, mask=mask, score_mod=score_mod(table), softcap=softcap, sinks=sinks, load_balanced=balanced)
        out = attend(q, k, v, axis_name="ctx", return_max_scores=max_scores, **kw)
        return out if max_scores else (out,)

    mesh = jax.make_mesh((n,), ("ctx",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
    sharded = jf.shard(local, mesh=mesh, in_specs=(*[P(None, "ctx")] * 3, P()), out_specs=P(None, "ctx"))
    layout = (lambda x: jf.parallel.load_balance(x, n)) if balanced else (lambda x: x)  # noqa: E731
    restore = (lambda x: jf.parallel.unbalance(x, n, axis=1)) if balanced else (lambda x: x)  # noqa: E731
    ours = lambda q, k, v, table: tuple(map(restore, sharded(layout(q), layout(k), layout(v), table)))  # noqa: E731

    def dense(q, k, v, table):
        out, lse, *top = dense_jnp(q, k, v, visible, score_mod(table), softcap=softcap, max_scores=max_scores)
        return (out if sinks is None else jf.parallel.merge_attention(out, lse, None, sinks)[0], *top)

    args, weights = (q, k, v, table), rng.standard_normal((b, s, hq, dv))
    got, want = jax.jit(ours)(*args), dense(*args)
    _assert_close(got[0], want[0], 1e-9)
    if max_scores:  # -inf exactly on the rows that see no key
        rows = np.isfinite(np.asarray(want[1]))
        np.testing.assert_array_equal(np.isneginf(got[1]), ~rows)
        _assert_close(got[1], want[1], 1e-9, rows)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)[0]) * weights) + sum(jnp.sum(jnp.cos(_finite(t))) for t in f(*a)[1:])  # noqa: E731
    for a, e in zip(jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(*args), jax.grad(loss(dense), argnums=(0, 1, 2, 3))(*args)):
        _assert_close(a, e, 1e-8)


def _run_jax_nn_seed(seed: int) -> None:
    """``jf.nn.dot_product_attention`` against ``jax.nn.dot_product_attention`` (xla) on the same
    random arguments: out, the residual lse, the gradient (the bias's too) and the jvp, on the rows
    that see a key or are query padding (a row that sees none and is not padding jax.nn averages
    over every value: its weight in the loss is 0, its values are not compared). jax.nn computes
    its softmax in float32 even for float64 input, hence the tolerance."""
    rng = np.random.default_rng([seed, 3])
    b, t, s, kv_heads = int(rng.integers(1, 3)), int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.integers(1, 3))
    n, h = kv_heads * int(rng.integers(1, 3)), int(rng.choice([1, 4, 8]))
    q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((b, t, n, h), (b, s, kv_heads, h), (b, s, kv_heads, h)))
    full, visible, kw = (b, n, t, s), np.ones((b, n, t, s), bool), {}

    def broadcast_shape():  # each dim 1 or full's; now and then without leading dims (jax.nn adds 1s)
        shape = tuple(f if rng.random() < 0.6 else 1 for f in full)
        return shape[int(rng.integers(1, 3)) :] if rng.random() < 0.3 else shape

    bias = jnp.asarray(rng.standard_normal(broadcast_shape())) if rng.random() < 0.6 else None
    if rng.random() < 0.4:
        kw["mask"] = jnp.asarray(rng.random(broadcast_shape()) < 0.8)
        visible &= np.asarray(kw["mask"])
    q_idx, kv_idx = np.arange(t)[:, None], np.arange(s)[None, :]
    if rng.random() < 0.4:
        kw["is_causal"] = True
        visible &= kv_idx <= q_idx
    if rng.random() < 0.3:
        left, right = (int(x) for x in rng.integers(0, 6, 2))
        kw["local_window_size"] = (left, right) if rng.random() < 0.7 else left
        left, right = (left, left) if isinstance(kw["local_window_size"], int) else (left, right)
        visible &= (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)
    q_padding = np.zeros((b, 1, t), bool)
    if rng.random() < 0.3:
        q_len, kv_len = rng.integers(0, t + 1, b), rng.integers(0, s + 1, b)
        kw["query_seq_lengths"], kw["key_value_seq_lengths"] = (jnp.asarray(x, jnp.int32) for x in (q_len, kv_len))
        q_padding = np.arange(t)[None, None, :] >= q_len[:, None, None]
        visible &= ~q_padding[..., None] & (np.arange(s)[None, None, None, :] < kv_len[:, None, None, None])
    seen = visible.any(-1)  # (b, n, t)
    counted = np.swapaxes(seen | q_padding, 1, 2)  # (b, t, n): rows both compute alike
    weights = jnp.asarray(rng.standard_normal((b, t, n, h)) * counted[..., None])
    bias_arg = jnp.zeros(()) if bias is None else bias

    def attend(fn):
        def call(q, k, v, bias):
            return fn(q, k, v, None if bias.ndim == 0 else bias, return_residual=True, **kw)

        return call

    ours, theirs = attend(jf.nn.dot_product_attention), attend(lambda *a, **kw: jax.nn.dot_product_attention(*a, implementation="xla", **kw))
    args, tol = (q, k, v, bias_arg), 2e-6
    (out, lse), (out_n, lse_n) = jax.jit(ours)(*args), theirs(*args)
    rows = np.swapaxes(seen, 1, 2)
    _assert_close(np.where(counted[..., None], out, 0), np.where(counted[..., None], out_n, 0), tol)
    _assert_close(lse, lse_n, tol, rows)
    assert np.isneginf(np.asarray(lse))[~rows].all()
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)[0]) * weights)  # noqa: E731
    for a, e in zip(jax.jit(jax.grad(loss(ours), (0, 1, 2, 3)))(*args), jax.grad(loss(theirs), (0, 1, 2, 3))(*args)):
        _assert_close(a, e, tol)
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in args)
    weighted = lambda f: lambda *a: f(*a)[0] * weights  # noqa: E731
    _assert_close(jax.jvp(weighted(ours), args, tangents)[1], jax.jvp(weighted(theirs), args, tangents)[1], tol)


def main(argv=None) -> int:
    parser = fuzz_loop.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["first-order", "second-order", "sharded", "context-parallel", "jax-nn"], default="first-order")
    args = parser.parse_args(argv)
    if args.mode in ("sharded", "context-parallel") and len(jax.devices()) < 8:
        print(f"{args.mode}: needs 8 devices, {len(jax.devices())} here (on a CPU, run this script: it asks for 8)")
        return 1
    seeds = {"sharded": _run_sharded_seed, "context-parallel": _run_context_parallel_seed, "jax-nn": _run_jax_nn_seed}.get(
        args.mode, lambda seed: run_seed(seed, args.mode)
    )
    return fuzz_loop.run(seeds, args, label=f"{args.mode}: ")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # the sharded mode's mesh; before jax starts its CPU backend
    sys.exit(main())
