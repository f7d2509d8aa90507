"""jf.remat: checkpoint policies that keep jf.attention's residuals, the (out, lse) its JVP names,
so that a rematerialised backward runs the attention backward without the attention forward."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxforge as jf

RNG = np.random.default_rng(0)
B, S, H, HKV, D = 2, 21, 4, 2, 8
W = jnp.asarray(RNG.standard_normal((D, D)))
X = jnp.asarray(RNG.standard_normal((B, S, H, D)))
MASK = jf.masks.causal() & jf.masks.document(jnp.asarray(np.sort(RNG.integers(0, 3, (B, S)), axis=-1)))


def block(w, x):
    """A query projection, GQA attention over the input's first heads, and a named activation."""
    q = checkpoint_name(jnp.tanh(x @ w), "queries")
    out = jf.attention(q, x[..., :HKV, :], x[..., :HKV, :], mask=MASK)
    return jnp.sin(out @ w)


def attention_forwards(jaxpr) -> int:
    return len(re.findall(r"attention_fwd\[", str(jaxpr)))


POLICIES = {
    "nothing_saved": (None, 2),  # the backward recomputes the block, the attention forward included
    "dots_saveable": (jax.checkpoint_policies.dots_saveable, 2),  # attention is no dot
    "save_attention": (jf.remat.save_attention(), 1),
    "save_attention_and_dots": (jf.remat.save_attention(policy=jax.checkpoint_policies.dots_saveable), 1),
    "save_attention_and_names": (jf.remat.save_attention("queries"), 1),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_saved_attention_residuals_spare_the_backward_a_forward(name):
    policy, forwards = POLICIES[name]
    loss = lambda f: (lambda w, x: jnp.sum(f(w, x) ** 2))  # noqa: E731
    grad = jax.grad(loss(jax.checkpoint(block, policy=policy)), argnums=(0, 1))
    assert attention_forwards(jax.make_jaxpr(grad)(W, X)) == forwards
    for got, want in zip(jax.jit(grad)(W, X), jax.grad(loss(block), argnums=(0, 1))(W, X)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_saved_residuals_are_the_output_and_lse_of_the_call(capsys):
    """What the policy keeps beyond the arguments: attention's output and its rows' lse, nothing else."""
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(block, policy=jf.remat.save_attention()), W, X)
    lines = capsys.readouterr().out.splitlines()
    computed = [line for line in lines if not re.search(r"from (the argument|a constant)", line)]
    named = {re.match(r"(\S+) named '(\w+)'", line).groups() for line in computed}
    assert len(computed) == 2 and named == {(f"f64[{B},{S},{H},{D}]", "attention_out"), (f"f64[{B},{S},{H}]", "attention_lse")}


def test_a_transformer_with_saved_attention_runs_one_attention_forward_per_block():
    params = jf.nn.init_transformer(jax.random.key(0), vocab_size=13, features=16, depth=3, num_heads=4, num_kv_heads=2,
                                    hidden_features=24, dtype=jnp.float64)  # fmt: skip
    tokens = jnp.asarray(RNG.integers(0, 13, (2, 12)))
    grad = lambda remat: jax.grad(lambda p: jnp.sum(jf.nn.transformer(p, tokens, remat=remat) ** 2))  # noqa: E731
    assert attention_forwards(jax.make_jaxpr(grad(True))(params)) == 2  # in the scan's body
    assert attention_forwards(jax.make_jaxpr(grad(jf.remat.save_attention()))(params)) == 1
    got, want = jax.jit(grad(jf.remat.save_attention()))(params), jax.jit(grad(False))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12), got, want)


A = jnp.asarray(RNG.standard_normal((3, 12, 5)))
RHS = jnp.asarray(RNG.standard_normal((3, 12)))
LINALG = {  # name: (a function of (a, b) that factors an intermediate, its primitive)
    "svd": (lambda a, b: (lambda u, s, vh: jnp.sum(u**2 * s[..., None, :]) + jnp.sum(jnp.cos(vh)))(*jf.linalg.svd(jnp.tanh(a))), "jaxforge_svd"),
    "lstsq": (lambda a, b: jnp.sum(jnp.sin(jf.linalg.lstsq(jnp.tanh(a), b * 2).solution)), "jaxforge_lstsq"),
    "polar": (lambda a, b: jnp.sum(jnp.sin(jf.linalg.polar(jnp.tanh(a))[0])), "jaxforge_svd"),
}


@pytest.mark.parametrize("name", list(LINALG))
@pytest.mark.parametrize("policy,runs", [(None, 2), (jf.remat.save_linalg(), 1)], ids=["nothing_saved", "save_linalg"])
def test_saved_factors_spare_the_backward_a_factorization(name, policy, runs):
    f, primitive = LINALG[name]
    grad = jax.grad(jax.checkpoint(f, policy=policy), argnums=(0, 1))
    assert len(re.findall(rf"\b{primitive}\[", str(jax.make_jaxpr(grad)(A, RHS)))) == runs
    for got, want in zip(jax.jit(grad)(A, RHS), jax.grad(f, argnums=(0, 1))(A, RHS)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("policy_of", [jf.remat.save_attention, jf.remat.save_linalg])
def test_names_and_policies_of_the_wrong_kind_are_refused(policy_of):
    fn = policy_of.__name__
    with pytest.raises(TypeError, match=rf"{fn}: `names` must be the strings given to checkpoint_name, got \[3\]"):
        policy_of("queries", 3)
    with pytest.raises(TypeError, match=rf"{fn}: `policy` must be None or a jax.checkpoint policy"):
        policy_of(policy="dots_saveable")
