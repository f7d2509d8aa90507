"""tools/fuzz_attention.py stays runnable: one seed of each mode passes, and a seed whose
independently computed mask is wrong fails."""

import importlib

import numpy as np
import pytest


@pytest.fixture(scope="module")
def fuzz():
    return importlib.import_module("tools.fuzz_attention")  # tools/ is no package: a namespace one from the root


# the seeds of first-order, sharded and context-parallel ask for the rows' largest scores too;
# first-order's 5 a scale of the table (traced in the jvp and under jit)
# jax-nn's seed 34: a bias (2, 1, 8, 1), a mask of every dim, a window of 1, sequence lengths, GQA 4:2
@pytest.mark.parametrize("mode,seed", [("first-order", 5), ("second-order", 2), ("sharded", 3), ("context-parallel", 7), ("jax-nn", 34)])
def test_a_seed_of_each_mode_passes(fuzz, mode, seed):
    assert fuzz.main(["--mode", mode, "--seed", str(seed), "--count", "1"]) == 0


def test_a_wrong_reference_mask_fails(fuzz, monkeypatch, capsys):
    leaf = fuzz.random_leaf
    monkeypatch.setattr(fuzz, "random_leaf", lambda *a: (lambda m, v: (m, ~np.asarray(v)))(*leaf(*a)))
    assert fuzz.main(["--seed", "2", "--count", "1"]) == 1
    assert "seed 2 failed" in capsys.readouterr().out


def test_a_wrong_drop_in_fails(fuzz, monkeypatch, capsys):
    import jaxforge as jf

    right = jf.nn.dot_product_attention
    monkeypatch.setattr(jf.nn, "dot_product_attention", lambda *a, **kw: (lambda out, lse: (out * (1 + 1e-4), lse))(*right(*a, **kw)))
    assert fuzz.main(["--mode", "jax-nn", "--seed", "34", "--count", "1"]) == 1
    assert "seed 34 failed" in capsys.readouterr().out
