"""Every public flag (a bool that picks what is computed) is a Python bool at trace time: a traced
one is refused naming the function and the argument, where it would otherwise die in a tracer's
``bool()``; anything but a bool, 0, 1 or a concrete array of one is refused too."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf

Q = jnp.ones((1, 4, 2, 8))
A = jnp.eye(3)
X = jnp.ones((1, 4, 8))
MHA = jf.nn.init_multi_head_attention(jax.random.key(0), 8, 2)
TRANSFORMER = jf.nn.init_transformer(jax.random.key(0), vocab_size=5, features=8, depth=1, num_heads=2)


def unchecked(fn):
    """``fn`` without the suite's annotation check (conftest): it refuses anything but a bool before
    the function's own check, which is what a user, without the check, meets."""
    return getattr(fn, "__wrapped__", fn)


def over_axis(fn):
    """``fn`` of each item of a (2, ...) batch of queries, the batch an axis named "i"."""
    return jax.vmap(fn, axis_name="i")(jnp.stack([Q, Q]))


# (function name, argument, call with the flag), every public bool that picks what is computed
FLAGS = [
    ("svd", "full_matrices", lambda f: jf.linalg.svd(A, full_matrices=f)),
    ("svd", "compute_uv", lambda f: jf.linalg.svd(A, compute_uv=f)),
    ("pinv", "hermitian", lambda f: jf.linalg.pinv(A, hermitian=f)),
    ("matrix_rank", "hermitian", lambda f: jf.linalg.matrix_rank(A, hermitian=f)),
    ("attention", "return_lse", lambda f: jf.attention(Q, Q, Q, return_lse=f)),
    ("attention", "return_max_scores", lambda f: jf.attention(Q, Q, Q, return_max_scores=f)),
    ("dot_product_attention", "is_causal", lambda f: unchecked(jf.nn.dot_product_attention)(Q, Q, Q, is_causal=f)),
    ("dot_product_attention", "return_residual", lambda f: unchecked(jf.nn.dot_product_attention)(Q, Q, Q, return_residual=f)),
    ("multi_head_attention", "return_max_scores", lambda f: unchecked(jf.nn.multi_head_attention)(MHA, X, return_max_scores=f)),
    ("transformer", "return_max_scores", lambda f: unchecked(jf.nn.transformer)(TRANSFORMER, jnp.zeros((1, 4), int), return_max_scores=f)),
    ("transformer", "remat", lambda f: unchecked(jf.nn.transformer)(TRANSFORMER, jnp.zeros((1, 4), int), remat=f)),
    ("all_gather", "tiled", lambda f: over_axis(lambda q: jf.collectives.all_gather(q, "i", tiled=f))),
    ("gather_from_parallel", "tensor_parallel_output_grad",
     lambda f: over_axis(lambda q: jf.collectives.gather_from_parallel(q, "i", tensor_parallel_output_grad=f))),
]
for fn in ("ring_attention", "all_gather_attention"):
    for name in ("causal", "load_balanced", "return_lse"):
        FLAGS.append((fn, name, lambda f, fn=fn, name=name: over_axis(lambda q: getattr(jf.parallel, fn)(q, q, q, axis_name="i", **{name: f}))))
IDS = [f"{fn}-{name}" for fn, name, _ in FLAGS]


@pytest.mark.parametrize("fn,name,call", FLAGS, ids=IDS)
def test_a_traced_flag_is_refused_by_name(fn, name, call):
    with pytest.raises(TypeError, match=rf"{fn}: `{name}` must be a Python bool, got a traced bool\[\].*static_argnames"):
        jax.jit(call)(jnp.array(True))


@pytest.mark.parametrize("fn,name,call", FLAGS, ids=IDS)
@pytest.mark.parametrize("flag", ["yes", None, 2, 1.0])
def test_a_flag_must_be_a_bool(fn, name, call, flag):
    accepted = "a bool or a jax.checkpoint policy" if name == "remat" else "a bool"
    with pytest.raises(TypeError, match=rf"{fn}: `{name}` must be {accepted}, got {type(flag).__name__} {re.escape(repr(flag))}"):
        call(flag)


@pytest.mark.parametrize("fn,name,call", FLAGS, ids=IDS)
def test_numpys_spellings_of_a_bool_are_the_bool(fn, name, call):
    """0 and 1 (numpy's ``svd(a, 0)``), numpy bools and concrete bool arrays are the Python bool."""
    for truth in (True, False):
        expected = jax.tree.map(np.asarray, call(truth))
        for spelling in (int(truth), np.bool_(truth), jnp.array(truth)):
            jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, call(spelling)), expected)
