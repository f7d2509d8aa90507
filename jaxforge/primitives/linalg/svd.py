r"""svd: the singular value decomposition :math:`A = U \operatorname{diag}(s) V^H` as a primitive.

``svd_p`` binds one operand ``a`` of shape ``(*batch, m, n)`` (float32/64, complex64/128) and
returns ``(s,)`` or ``(s, u, vh)``: ``s`` real, sorted descending, shape ``(*batch, k)`` with
``k = min(m, n)``; ``u`` is ``(*batch, m, k)`` (``m`` columns when ``full_matrices``) and ``vh`` is
``(*batch, k, n)`` (``n`` rows when ``full_matrices``).

Derivatives (thin part; :math:`dP = U^H dA\, V`, :math:`S = \operatorname{diag}(s)`):

.. math::

    ds &= \operatorname{Re}\operatorname{diag}(dP) \\
    dU &= U\,[F \circ (dP\,S + S\,dP^H) + i\,\Im\operatorname{diag}(dP)\,(2S)^{-1}]
          + (I - UU^H)\, dA\, V S^{-1} \\
    dV &= V\,[F \circ (S\,dP + dP^H S) - i\,\Im\operatorname{diag}(dP)\,(2S)^{-1}]
          + (I - VV^H)\, dA^H U S^{-1}

with :math:`F_{jk} = 1/((s_k - s_j)(s_k + s_j))` off the diagonal and 0 on it.

* **Degenerate or zero singular values.** With ``grad_eps == 0`` (the default) the formula is exact:
  a repeated singular value makes ``F`` infinite, so ``du``/``dv`` hold inf/NaN there (the
  derivative does not exist); a zero singular value does the same for the ``S⁻¹`` terms of
  non-square or complex input. ``ds`` is always finite. With ``grad_eps = ε > 0`` every reciprocal
  of a singular value, or of a sum or difference of two, is Lorentzian-broadened,
  :math:`1/x \to x/(x^2 + ε)`: gradients stay finite and are exact up to O(ε/x²).
* **Complex gauge.** Columns of ``u`` and ``v`` are defined up to a common phase; the tangent
  splits the phase equally, :math:`\Im\operatorname{diag}(U^H dU) = -\Im\operatorname{diag}(V^H dV)`.
  A loss that depends on the gauge has no well-defined gradient.
* **Full matrices.** The complementary columns :math:`U_\perp` (``m > n``) or :math:`V_\perp`
  (``m < n``) are not unique. Convention: they move only as much as staying orthogonal to the
  thin factor requires (:math:`U_\perp^H dU_\perp = 0`), that is
  :math:`dU_\perp = -U S^{-1} V^H dA^H U_\perp` and :math:`dV_\perp = -V S^{-1} U^H dA\, V_\perp`.
  ``s`` and the first ``k`` columns have exact derivatives.

The JVP names the factors it reads, ``(s, u, vh)`` (``RESIDUAL_NAMES``), so that a ``jax.checkpoint``
policy may keep them (``jaxforge.transforms.remat``) and a rematerialised backward does not factor
``a`` again. Where jit finds ``u`` and ``vh`` unused, its dead-code elimination binds an SVD without
them (``_values_alone``): ``jf.linalg.svd(a)[1]`` costs what ``compute_uv=False`` does.

Where things live:
    API        jaxforge/functional/linalg.py :: svd
    lowering   jaxforge/lowering/linalg/svd/
    tests      tests/primitives/linalg/test_svd.py
    benchmark  jaxforge/bench/linalg.py (entry "svd")
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxforge.primitives import _core
from jaxforge.primitives.linalg._checks import check_dtype, check_matrix, real_dtype
from jaxforge.primitives.linalg._ops import ct, diag, diagonal, mm, reciprocal

__all__ = ["RESIDUAL_NAMES", "SHAPES", "svd_p", "svd_reference"]

RESIDUAL_NAMES = ("svd_s", "svd_u", "svd_vh")  # jax.ad_checkpoint.checkpoint_name of (s, u, vh)

# Named shapes (batch, m, n) shared by tests and benchmarks; "bench_gpu" are ANCHORS.md shapes.
SHAPES = {
    "tiny_batch": ((8192, 32, 32), ("bench_gpu",)),
    "small_batch": ((1024, 64, 64), ("bench_gpu", "bench_cpu")),
    "medium_batch": ((256, 128, 128), ("bench_gpu",)),
    "square_large": ((1, 2048, 2048), ("bench_gpu",)),
    "tall_large": ((1, 8192, 512), ("bench_gpu", "bench_cpu")),
    "tall_batch": ((256, 1000, 64), ("bench_gpu",)),  # past the kernels, its R not
    "cpu_batch": ((256, 32, 32), ("bench_cpu",)),
    "cpu_tall": ((16, 1000, 100), ("bench_cpu",)),
    "odd_wide": ((3, 37, 61), ("bench_cpu", "test")),
    "odd_tall": ((5, 61, 37), ("test",)),
}


def svd_reference(a, *, full_matrices: bool = False, compute_uv: bool = True, grad_eps: float = 0.0):
    """The spec: ``jnp.linalg.svd`` with the primitive's output order ``(s, u, vh)`` or ``(s,)``.

    ``grad_eps`` changes derivatives only, so the reference ignores it.
    """
    del grad_eps
    if not compute_uv:
        return (jnp.linalg.svd(a, compute_uv=False),)
    u, s, vh = jnp.linalg.svd(a, full_matrices=full_matrices)
    return s, u, vh


def _abstract_eval(a, *, full_matrices: bool, compute_uv: bool, grad_eps: float):
    check_matrix("svd", "a", a.shape)
    check_dtype("svd", "a", a.dtype)
    *batch, m, n = a.shape
    k = min(m, n)
    outputs = [((*batch, k), real_dtype(a.dtype))]
    if compute_uv:
        outputs.append(((*batch, m, m if full_matrices else k), a.dtype))
        outputs.append(((*batch, n if full_matrices else k, n), a.dtype))
    return _core.batch_sharded_avals("svd", {"a": a}, len(batch), outputs)


def _jvp(primals, tangents, *, full_matrices: bool, compute_uv: bool, grad_eps: float):
    (a,), (da,) = primals, tangents
    s, u, vh = svd_p.bind(a, full_matrices=full_matrices, compute_uv=True, grad_eps=grad_eps)
    s, u, vh = _core.named_residuals((s, u, vh), RESIDUAL_NAMES)
    da = _core.instantiate_zeros(da)
    tangents = _tangents(s, u, vh, da, full_matrices=full_matrices, compute_uv=compute_uv, grad_eps=grad_eps)
    return ((s, u, vh) if compute_uv else (s,)), tangents


@functools.partial(jax.jit, static_argnames=("full_matrices", "compute_uv", "grad_eps"))
def _tangents(s, u, vh, da, *, full_matrices: bool, compute_uv: bool, grad_eps: float):
    """``(ds, du, dvh)`` (``(ds,)`` without ``compute_uv``) along ``da``. Jitted: an eager jvp or
    grad compiles one program per shape, not each of its ~40 operations."""
    m, n = da.shape[-2:]
    k = min(m, n)
    u_k, v_k = u[..., :, :k], ct(vh[..., :k, :])

    dp = mm(mm(ct(u_k), da), v_k)
    ds = jnp.real(diagonal(dp))
    if not compute_uv:
        return (ds,)

    # F_jk = 1/((s_k - s_j)(s_k + s_j)); the diagonal is masked before dividing so that no inf
    # reaches a where() (whose unselected branch would still poison second derivatives).
    s_row, s_col = s[..., None, :], s[..., :, None]
    off_diag = ~jnp.eye(k, dtype=bool)
    diff = jnp.where(off_diag, s_row - s_col, 1)
    f = jnp.where(off_diag, reciprocal(diff, grad_eps) * reciprocal(s_row + s_col, grad_eps), 0)
    f = f.astype(da.dtype)
    s_c = s.astype(da.dtype)
    dp_s = dp * s_c[..., None, :]  # dP S
    s_dp = s_c[..., :, None] * dp  # S dP
    omega_u = f * (dp_s + ct(dp_s))
    omega_v = f * (s_dp + ct(s_dp))
    s_inv = reciprocal(s, grad_eps).astype(da.dtype)
    if jnp.iscomplexobj(da):
        phase = 0.5j * jnp.imag(diagonal(dp)).astype(da.dtype) * s_inv
        omega_u = omega_u + diag(phase)
        omega_v = omega_v - diag(phase)
    du = mm(u_k, omega_u)
    dv = mm(v_k, omega_v)
    if m > k:  # the part of dA V outside the span of U
        da_v = mm(da, v_k)
        du = du + (da_v - mm(u_k, mm(ct(u_k), da_v))) * s_inv[..., None, :]
    if n > k:
        dah_u = mm(ct(da), u_k)
        dv = dv + (dah_u - mm(v_k, mm(ct(v_k), dah_u))) * s_inv[..., None, :]

    if full_matrices and m > k:  # dU⊥ = -U S⁻¹ Vᴴ dAᴴ U⊥
        u_perp = u[..., :, k:]
        du = jnp.concatenate([du, -mm(u_k, s_inv[..., :, None] * mm(ct(v_k), mm(ct(da), u_perp)))], -1)
    if full_matrices and n > k:  # dV⊥ = -V S⁻¹ Uᴴ dA V⊥
        v_perp = ct(vh[..., k:, :])
        dv = jnp.concatenate([dv, -mm(v_k, s_inv[..., :, None] * mm(ct(u_k), mm(da, v_perp)))], -1)
    return ds, du, ct(dv)


def _values_alone(used, **params):
    """Where jit finds ``u`` and ``vh`` unused (a forward or gradient that reads ``s`` alone: the
    JVP's factors are read by its tangent, so there they stay), an SVD without singular vectors."""
    if not params["compute_uv"] or any(used[1:]):
        return params, [True] * len(used)
    return dict(params, compute_uv=False, full_matrices=False), [True, False, False]


def _example_args():
    return (np.random.default_rng(0).standard_normal((2, 5, 3)),)


svd_p = _core.define_primitive(
    "jaxforge_svd",
    abstract_eval=_abstract_eval,
    jvp=_jvp,
    reference=svd_reference,
    example_args=_example_args,
    example_params=dict(full_matrices=False, compute_uv=True, grad_eps=0.0),
    test_module="tests/primitives/linalg/test_svd.py",
    bench_entry="linalg/svd",
    dce=_values_alone,
)
