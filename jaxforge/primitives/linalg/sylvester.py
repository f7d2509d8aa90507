r"""sylvester: the two linear solves with a Hermitian positive definite :math:`P` that the derivative
of the polar decomposition takes, as a primitive, so that its derivatives of every order are exact
where :math:`P`'s eigenvalues repeat.

``sylvester_p`` binds ``(p, s, v, c)``: ``p`` of shape ``(*batch, n, n)``, Hermitian positive
definite, with its eigendecomposition :math:`P = V \operatorname{diag}(s) V^H` (``s`` real,
``(*batch, n)``; ``v`` ``(*batch, n, n)``), and ``c``; it returns ``(x,)``, of ``c``'s shape, where

* ``two_sided=True``: :math:`PX + XP = C`, ``c`` ``(*batch, n, n)`` skew-Hermitian (the rotation
  :math:`\Omega = U^H dU` of the polar factor solves it with :math:`C = U^H dA - dA^H U`):
  :math:`X = V[(V^H C V) \circ K]V^H`, :math:`K_{jk} = 1/(s_j + s_k)`. For real input the diagonal of
  :math:`V^H C V` (that of a skew matrix: zero) is dropped, so that a zero eigenvalue (a real square
  ``a`` of one zero singular value) gives no 0·∞;
* ``two_sided=False``: :math:`XP = C`, ``c`` ``(*batch, m, n)``: :math:`X = C V S^{-1} V^H`.

Why a primitive: :math:`X` depends on :math:`P` alone, smoothly, but ``v`` does not depend smoothly
on :math:`P` where eigenvalues repeat (its derivative meets :math:`1/(s_j - s_k)`). The JVP is
therefore written in ``dp`` alone, ``s`` and ``v`` being read for their values,

.. math::

    dX = \mathcal{S}(dC - dP\,X - X\,dP) \quad\text{(two-sided)}, \qquad
    dX = \mathcal{S}(dC - X\,dP) \quad\text{(one-sided)},

with :math:`\mathcal{S}` the same solve, and its transpose in ``c`` is the same solve with
:math:`\bar P` (:math:`\bar V`): derivatives of every order stay in this primitive and never
reach an eigenvector's. Written as jax operations, JAX would inline the solve when linearising and
differentiate ``v`` in a second derivative (NaN at an exact tie, wrong where rounding splits one).

Where things live:
    API        jaxforge/functional/linalg.py :: polar (its unitary factor's derivative)
    lowering   jaxforge/lowering/linalg/sylvester/
    tests      tests/primitives/linalg/test_sylvester.py
    benchmark  jaxforge/bench/linalg.py (entry "polar")
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxforge.primitives import _core
from jaxforge.primitives.linalg._checks import check_dtype, check_matrix, real_dtype
from jaxforge.primitives.linalg._ops import ct, mm

__all__ = ["sylvester_p", "sylvester_reference"]


def sylvester_reference(p, s, v, c, *, two_sided: bool):
    r"""The spec, from ``p`` alone, by ``jnp.linalg.solve``: :math:`X = CP^{-1}`, or the Kronecker form
    :math:`(P \otimes I + I \otimes P^T)\,\mathrm{vec}(X) = \mathrm{vec}(C)` (row-major ``vec``)."""
    del s, v
    if not two_sided:
        return (ct(jnp.linalg.solve(ct(p), ct(c))),)
    *batch, n = c.shape[:-1]
    eye = jnp.eye(n, dtype=p.dtype)
    operator = jnp.einsum("...ij,kl->...ikjl", p, eye) + jnp.einsum("ij,...lk->...ikjl", eye, p)
    vec_x = jnp.linalg.solve(operator.reshape(*batch, n * n, n * n), c.reshape(*batch, n * n, 1))
    return (vec_x.reshape(c.shape),)


def _abstract_eval(p, s, v, c, *, two_sided: bool):
    check_dtype("sylvester", "p", p.dtype)
    for name, x in (("p", p), ("v", v), ("c", c)):
        check_matrix("sylvester", name, x.shape)
        if np.dtype(x.dtype) != np.dtype(p.dtype):
            raise TypeError(f"sylvester: `{name}` has dtype {x.dtype}, `p` {p.dtype}; they must match")
    if s.dtype != real_dtype(p.dtype):
        raise TypeError(f"sylvester: `s` has dtype {s.dtype}; accepted: {real_dtype(p.dtype)}, the real dtype of `p`")
    *batch, n, _ = p.shape
    rows = n if two_sided else c.shape[-2]
    expected = {"p": (*batch, n, n), "s": (*batch, n), "v": (*batch, n, n), "c": (*batch, rows, n)}
    for name, x in zip(expected, (p, s, v, c)):
        if tuple(x.shape) != expected[name]:
            raise ValueError(
                f"sylvester: `{name}` has shape {tuple(x.shape)}; with `p` of shape {tuple(p.shape)} "
                f"(square) and two_sided={two_sided}, it must be {expected[name]}"
            )
    return _core.batch_sharded_avals("sylvester", {"p": p, "s": s, "v": v, "c": c}, len(batch), [(c.shape, c.dtype)])


def _jvp(primals, tangents, *, two_sided: bool):
    p, s, v, c = primals
    dp, _, _, dc = tangents  # s and v are read for their values: X depends on P alone
    (x,) = sylvester_p.bind(p, s, v, c, two_sided=two_sided)
    if _core.is_symbolic_zero(dp) and _core.is_symbolic_zero(dc):
        return (x,), (_core.zero_tangent(x),)
    rhs = _core.instantiate_zeros(dc)
    if not _core.is_symbolic_zero(dp):
        rhs = rhs - (mm(dp, x) + mm(x, dp) if two_sided else mm(x, dp))
    return (x,), sylvester_p.bind(p, s, v, rhs, two_sided=two_sided)


def _transpose(cts, p, s, v, c, *, two_sided: bool):
    """Linear in ``c``; the solve is symmetric in the bilinear pairing once ``P`` is conjugated."""
    (ct_x,) = cts
    if not _core.is_linear_input(c) or _core.is_symbolic_zero(ct_x):
        return [None, None, None, None]
    (ct_c,) = sylvester_p.bind(jnp.conj(p), s, jnp.conj(v), _core.instantiate_zeros(ct_x), two_sided=two_sided)
    return [None, None, None, ct_c]


def _example_args():
    rng = np.random.default_rng(0)
    v, _ = np.linalg.qr(rng.standard_normal((2, 4, 4)))
    s = np.array([[3.0, 2.0, 2.0, 0.5], [1.0, 1.0, 1.0, 1.0]])  # repeated eigenvalues
    p = (v * s[:, None, :]) @ np.swapaxes(v, -1, -2)
    c = rng.standard_normal((2, 4, 4))
    return p, s, v, c - np.swapaxes(c, -1, -2)


sylvester_p = _core.define_primitive(
    "jaxforge_sylvester",
    abstract_eval=_abstract_eval,
    jvp=_jvp,
    reference=sylvester_reference,
    example_args=_example_args,
    example_params=dict(two_sided=True),
    test_module="tests/primitives/linalg/test_sylvester.py",
    bench_entry="linalg/polar",
    transpose=_transpose,
)
