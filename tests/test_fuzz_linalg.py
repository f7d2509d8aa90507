"""tools/fuzz_linalg.py stays runnable: a seed of each op passes, and a wrong value or a wrong
derivative fails its seed."""

import importlib

import jax
import jax.numpy as jnp
import pytest

import jaxforge as jf

SVD_SEED, LSTSQ_SEED, PINV_SEED = 2, 6, 9  # float64 with distinct singular values and a batch: every check runs


@pytest.fixture(scope="module")
def fuzz():
    return importlib.import_module("tools.fuzz_linalg")  # tools/ is no package: a namespace one from the root


@pytest.mark.parametrize("seed", [SVD_SEED, LSTSQ_SEED, PINV_SEED])
def test_a_seed_of_each_op_passes(fuzz, seed):
    assert fuzz.main(["--seed", str(seed), "--count", "1"]) == 0


def _wrong_value(x, a):
    return x * (1 + 1e-6)


def _wrong_derivative(x, a):  # the same value, and a tangent that is off by 1e-3 Σ da
    extra = jnp.real(jnp.sum(jnp.where(jnp.isnan(a), 0, a)))  # a NaN matrix changes no other's value
    return x + 1e-3 * (extra - jax.lax.stop_gradient(extra)).astype(x.dtype)


@pytest.mark.parametrize("wrong", [_wrong_value, _wrong_derivative])
@pytest.mark.parametrize("seed", [SVD_SEED, LSTSQ_SEED, PINV_SEED])
def test_a_wrong_result_fails(fuzz, monkeypatch, capsys, seed, wrong):
    svd, lstsq, pinv = jf.linalg.svd, jf.linalg.lstsq, jf.linalg.pinv

    def bad_svd(a, *args, **kwargs):
        out = svd(a, *args, **kwargs)
        return wrong(out, a) if not isinstance(out, tuple) else (out[0], wrong(out[1], a), out[2])

    def bad_lstsq(a, b, rcond=None):
        return lstsq(a, b, rcond)._replace(solution=wrong(lstsq(a, b, rcond).solution, a))

    monkeypatch.setattr(jf.linalg, "svd", bad_svd)
    monkeypatch.setattr(jf.linalg, "lstsq", bad_lstsq)
    monkeypatch.setattr(jf.linalg, "pinv", lambda a, rtol=None, hermitian=False: wrong(pinv(a, rtol, hermitian), a))
    assert fuzz.main(["--seed", str(seed), "--count", "1"]) == 1
    assert f"seed {seed} failed" in capsys.readouterr().out
