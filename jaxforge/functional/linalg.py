"""Differentiable linear algebra: ``svd`` and ``lstsq`` with numpy's conventions, batched, and
what the SVD gives: ``svdvals``, ``pinv``, ``matrix_rank`` (torch.linalg's names and tolerances)
and ``polar`` (scipy.linalg's).

Each validates its arguments at trace time, canonicalises them, and binds a primitive
(``jaxforge.primitives.linalg``) that carries its own JVP and batching rules, so ``jit``, ``grad``,
``jvp``, ``vjp``, ``jacfwd``, ``jacrev``, ``hessian`` and ``vmap`` all apply; on a GPU they run the
batched SVD kernels the primitive lowers to.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxforge.functional._static import common_dtype, concrete_scalar, static_bool
from jaxforge.primitives._core import named_residuals
from jaxforge.primitives.linalg import lstsq_p, svd_p, sylvester_p
from jaxforge.primitives.linalg._checks import check_dtype, check_matrix
from jaxforge.primitives.linalg._ops import pinv_tangent
from jaxforge.primitives.linalg.lstsq import default_rcond
from jaxforge.primitives.linalg.svd import RESIDUAL_NAMES as SVD_RESIDUALS

__all__ = ["LstsqResult", "lstsq", "matrix_rank", "pinv", "polar", "svd", "svdvals"]


def svd(a, full_matrices: bool = False, compute_uv: bool = True, *, grad_eps: float = 0.0):
    r"""Singular value decomposition :math:`A = U \operatorname{diag}(s) V^H`, numpy's convention.

    Args:
      a: ``(..., m, n)`` array of float32, float64, complex64 or complex128.
      full_matrices: if True, ``u`` is ``(..., m, m)`` and ``vh`` is ``(..., n, n)``; otherwise
        ``(..., m, k)`` and ``(..., k, n)`` with ``k = min(m, n)``. jaxforge's default is the thin
        decomposition (numpy's is full).
      compute_uv: if False, return only ``s``.
      grad_eps: 0 (default) gives exact derivatives, which are infinite at repeated singular
        values (and at zero ones for non-square or complex ``a``). ``grad_eps > 0`` replaces each
        reciprocal ``1/x`` of the derivative by ``x / (x² + grad_eps)`` so gradients stay finite.

    Returns:
      ``(u, s, vh)``, or ``s`` when ``compute_uv`` is False; ``s`` is real and sorted descending.

    Derivatives of the complementary columns of a full decomposition follow the convention
    ``U⊥ᴴ dU⊥ = 0`` (see ``jaxforge.primitives.linalg.svd``); complex phases split the gauge
    equally between ``u`` and ``v``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxforge as jf
      >>> a = jnp.array([[3.0, 0.0], [0.0, 4.0], [0.0, 0.0]])
      >>> jf.linalg.svd(a, compute_uv=False)
      Array([4., 3.], dtype=float32)
      >>> jax.grad(lambda a: jf.linalg.svd(a, compute_uv=False)[0])(a)[1, 1]
      Array(1., dtype=float32)
    """
    a = _matrix("svd", a)
    grad_eps = _check_grad_eps(grad_eps)
    compute_uv = static_bool("svd", "compute_uv", compute_uv)
    # Without vectors full_matrices changes nothing but which lowerings serve: the kernels are thin.
    full_matrices = static_bool("svd", "full_matrices", full_matrices) and compute_uv
    out = svd_p.bind(a, full_matrices=full_matrices, compute_uv=compute_uv, grad_eps=grad_eps)
    if not compute_uv:
        return out[0]
    s, u, vh = out
    return u, s, vh


def svdvals(a):
    r"""Singular values :math:`s` of :math:`A = U \operatorname{diag}(s) V^H`, real and descending:
    ``svd(a, compute_uv=False)`` under numpy's and torch's name.

    Args:
      a: ``(..., m, n)`` array of float32, float64, complex64 or complex128.

    Returns:
      ``s``, ``(..., min(m, n))``. Its derivative ``ds_i = Re(u_iᴴ dA v_i)`` is finite at repeated
      values, and exact there for symmetric functions of ``s`` (sums, norms). Second derivatives
      at repeated values are not: they depend on the loss's curvature along the tie, which no
      linear rule of ``s`` alone can see (NaN, as jnp's). The nuclear norm's are finite there as
      ``jnp.trace(polar(a)[1])`` (square or tall ``a`` of full rank).
    """
    return svd_p.bind(_matrix("svdvals", a), full_matrices=False, compute_uv=False, grad_eps=0.0)[0]


def pinv(a, rtol=None, hermitian: bool = False, *, atol=None):
    r"""Moore–Penrose pseudo-inverse :math:`A^+ = V \operatorname{diag}(1/s_i)_{s_i > \tau} U^H`,
    with :math:`\tau = \max(\mathrm{atol}, \mathrm{rtol} \cdot s_{\max})`, batched.

    Args:
      a: ``(..., m, n)`` array of float32, float64, complex64 or complex128.
      rtol, atol: the relative and absolute tolerances, torch.linalg.pinv's: each None, a number
        >= 0, or a real array broadcasting against ``a.shape[:-2]`` (negative entries count as 0).
        Both None: ``rtol = eps * max(m, n)`` (torch's, lstsq's; jax.numpy's is 10 times that);
        ``atol`` alone: ``rtol = 0``.
      hermitian: ``a`` is Hermitian (square; its Hermitian part ``(A + Aᴴ)/2`` is decomposed, as
        jnp.linalg.eigh does): an eigendecomposition ``A = W diag(λ) Wᴴ`` in place of the SVD,
        ``A⁺ = W diag(1/λ_i)_{|λ_i| > τ} Wᴴ``.

    Returns:
      ``A⁺``, ``(..., n, m)``; NaN where ``a`` holds NaN.

    Derivatives are Golub and Pereyra's, exact while the rank stays put:
    ``dA⁺ = −A⁺ dA A⁺ + A⁺A⁺ᴴ dAᴴ (I − AA⁺) + (I − A⁺A) dAᴴ A⁺ᴴA⁺``, finite at repeated singular
    values (an SVD's own derivatives are not) and zero for the tolerances.

    Example:
      >>> import jax.numpy as jnp, jaxforge as jf
      >>> jf.linalg.pinv(jnp.array([[2.0, 0.0], [0.0, 0.0]]))
      Array([[0.5, 0. ],
             [0. , 0. ]], dtype=float32)
    """
    hermitian = static_bool("pinv", "hermitian", hermitian)
    a = _matrix("pinv", a, hermitian)
    return _pinv(a, *_tolerances("pinv", a, atol, rtol), hermitian)


def matrix_rank(a, rtol=None, hermitian: bool = False, *, atol=None):
    r"""The number of singular values :math:`s_i > \max(\mathrm{atol}, \mathrm{rtol} \cdot s_{\max})`.

    Args:
      a: ``(..., m, n)`` array of float32, float64, complex64 or complex128.
      rtol, atol: as :func:`pinv`'s (torch.linalg.matrix_rank's); both None: ``rtol = eps * max(m, n)``.
      hermitian: ``a`` is Hermitian: its eigenvalues' magnitudes are its singular values.

    Returns:
      int32 ``(...)``; 0 where ``a`` holds NaN.
    """
    hermitian = static_bool("matrix_rank", "hermitian", hermitian)
    a = _matrix("matrix_rank", a, hermitian)
    atol, rtol = _tolerances("matrix_rank", a, atol, rtol)
    s = jnp.abs(jnp.linalg.eigvalsh(a)) if hermitian else svdvals(a)
    return jnp.sum(s > _cutoff(s, atol, rtol)[..., None], axis=-1, dtype=jnp.int32)


def polar(a, side: str = "right"):
    r"""Polar decomposition :math:`A = UP` (``side="right"``) or :math:`A = PU` (``"left"``), from
    the thin SVD :math:`A = W \operatorname{diag}(s) V^H`: :math:`U = WV^H`, the unitary factor
    nearest ``a`` (orthonormal columns, or rows where ``m < n``), and :math:`P` Hermitian positive
    semi-definite, :math:`V \operatorname{diag}(s) V^H` (right, ``(n, n)``) or
    :math:`W \operatorname{diag}(s) W^H` (left, ``(m, m)``). scipy.linalg.polar's convention, batched.

    Args:
      a: ``(..., m, n)`` array of float32, float64, complex64 or complex128.
      side: ``"right"`` or ``"left"``.

    Returns:
      ``(u, p)``; NaN where ``a`` holds NaN.

    Derivatives, for ``m >= n`` (``m < n`` by ``U(A) = U(Aᴴ)ᴴ``), with :math:`X = W^H dA\, V` and
    :math:`K_{jk} = 1/(s_j + s_k)`:

    .. math::

        dU = \left(W\, [(X - X^H) \circ K] + (dA\, V - W X) S^{-1}\right) V^H,

    and ``dP`` by the product rule on ``P = Uᴴa`` (``a Uᴴ`` left). Its two terms are solves with
    :math:`P = V S V^H`: :math:`U\Omega` where :math:`P\Omega + \Omega P = C - C^H`
    (:math:`C = U^H dA`, :math:`\Omega = V[(X - X^H) \circ K]V^H`), and :math:`(dA - UC)P^{-1}`.
    Taken by ``sylvester_p``, differentiated in :math:`P` alone, they keep derivatives of every
    order exact where singular values repeat (an
    ``a`` with orthonormal columns: all of them), where those taken through an SVD (``W Vᴴ`` of
    ``svd``'s factors, as ``jax.scipy.linalg.polar(method="svd")`` does) meet ``1/(s_j − s_k)``;
    only a rank-deficient ``a``, whose ``U`` is not unique, makes them inf or NaN (a real square
    ``a`` of one zero singular value gets the derivative of the branch its SVD chose).

    Example (orthogonal Procrustes: the rotation nearest to carrying points ``x`` onto ``y``):
      >>> import jax.numpy as jnp, jaxforge as jf
      >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
      >>> y = x @ jnp.array([[0.0, -1.0], [1.0, 0.0]])
      >>> jf.linalg.polar(x.T @ y)[0].round(4)
      Array([[ 0., -1.],
             [ 1.,  0.]], dtype=float32)
    """
    a = _matrix("polar", a)
    if not isinstance(side, str) or side not in ("right", "left"):
        raise ValueError(f"polar: `side` must be 'right' or 'left', got {side!r}")
    m, n = a.shape[-2:]
    u = _unitary_factor(a) if m >= n else _adjoint(_unitary_factor(_adjoint(a)))
    p = _matmul(_adjoint(u), a) if side == "right" else _matmul(a, _adjoint(u))
    return u, (p + _adjoint(p)) / 2  # Hermitian to the last bit


def _unitary_factor(a):
    """``W Vᴴ`` of the thin SVD of a tall ``a`` (``m >= n``); its derivatives are ``_polar_unitary``'s."""
    factors = svd_p.bind(jax.lax.stop_gradient(a), full_matrices=False, compute_uv=True, grad_eps=0.0)
    return _polar_unitary(a, *named_residuals(factors, SVD_RESIDUALS))  # jf.remat.save_linalg keeps them


@jax.custom_jvp
def _polar_unitary(a, s, w, vh):
    """``U = W Vᴴ`` from ``a = W diag(s) Vᴴ``, differentiated in ``a`` alone: the factors are read for
    their values (their own derivatives meet ``1/(s_j − s_k)``, infinite at a tie)."""
    return _matmul(w, vh)


@_polar_unitary.defjvp
def _polar_unitary_jvp(primals, tangents):
    # With P = Uᴴa = V diag(s) Vᴴ and C = Uᴴ dA: Ω = Uᴴ dU solves PΩ + ΩP = C − Cᴴ, and the part of
    # dA outside U's span (none when square) gives (dA − UC)P⁻¹. Both solves are sylvester_p's, whose
    # rules (like this one, through `u`) keep every higher derivative in P and off the factors.
    a, s, w, vh = primals
    da = tangents[0]
    u = _polar_unitary(a, s, w, vh)
    v = _adjoint(vh)
    p = _matmul(_adjoint(u), a)
    p = (p + _adjoint(p)) / 2
    c = _matmul(_adjoint(u), da)
    (omega,) = sylvester_p.bind(p, s, v, c - _adjoint(c), two_sided=True)
    du = _matmul(u, omega)
    if a.shape[-2] > a.shape[-1]:
        du = du + sylvester_p.bind(p, s, v, da - _matmul(u, c), two_sided=False)[0]
    return u, du


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _pinv(a, atol, rtol, hermitian):
    if hermitian:  # A = W diag(λ) Wᴴ, λ real and signed
        d, w = jnp.linalg.eigh(a)
        u, vh = w, _adjoint(w)
    else:
        d, u, vh = svd_p.bind(a, full_matrices=False, compute_uv=True, grad_eps=0.0)
    kept = jnp.abs(d) > _cutoff(d, atol, rtol)[..., None]
    # NaN values stay NaN: LAPACK's eigh of a NaN matrix may return finite vectors
    inverse = jnp.where(kept, 1 / jnp.where(kept, d, 1), jnp.where(jnp.isnan(d), d, 0)).astype(a.dtype)
    return _matmul(_adjoint(vh) * inverse[..., None, :], _adjoint(u))


@_pinv.defjvp
def _pinv_jvp(hermitian, primals, tangents):
    a, atol, rtol = primals
    p = _pinv(a, atol, rtol, hermitian)
    return p, pinv_tangent(a, p, tangents[0])


def _matmul(x, y):  # the default precision of a GPU's float32 products is TF32's 10-bit mantissa
    return jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)


def _adjoint(x):
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def _cutoff(d, atol, rtol):
    """``max(atol, rtol · max |d|)`` per matrix, ``d`` its singular values or eigenvalues (possibly none)."""
    return jnp.maximum(atol, rtol * jnp.max(jnp.abs(d), axis=-1, initial=0))


def _tolerances(fn: str, a, atol, rtol):
    """``(atol, rtol)`` as real arrays of ``a``'s batch shape, torch's defaults resolved."""
    real, batch, (m, n) = np.finfo(a.dtype).dtype, a.shape[:-2], a.shape[-2:]
    if rtol is None:
        rtol = 0.0 if atol is not None else default_rcond(real, m, n)
    values = []
    for name, tol in (("atol", 0.0 if atol is None else atol), ("rtol", rtol)):
        if isinstance(tol, (int, float, np.integer, np.floating)) and not isinstance(tol, bool):
            if not tol >= 0:
                raise ValueError(f"{fn}: `{name}` must be None, a number >= 0 or a real array; got {tol!r}")
        elif not (hasattr(tol, "shape") and hasattr(tol, "dtype")) or not (
            jnp.issubdtype(tol.dtype, jnp.floating) or jnp.issubdtype(tol.dtype, jnp.integer)
        ):
            raise TypeError(f"{fn}: `{name}` must be None, a number >= 0 or a real array; got {tol!r}")
        tol = jnp.asarray(tol)
        try:
            shape = jnp.broadcast_shapes(tol.shape, batch)
        except ValueError:
            shape = None
        if shape != tuple(batch):
            raise ValueError(
                f"{fn}: `{name}` must broadcast against the batch dims of `a` {tuple(batch)}; got shape {tol.shape}"
            )
        values.append(jnp.broadcast_to(jnp.maximum(jax.lax.stop_gradient(tol).astype(real), 0), batch))
    return tuple(values)


def _matrix(fn: str, a, hermitian: bool = False):
    a = jnp.asarray(a)
    check_dtype(fn, "a", a.dtype)
    check_matrix(fn, "a", a.shape)
    if hermitian and a.shape[-1] != a.shape[-2]:
        raise ValueError(f"{fn}: `a` must be square with hermitian=True; got shape {a.shape}")
    return a


class LstsqResult(NamedTuple):
    """numpy's four results, batched over the leading dims of ``a``."""

    solution: jax.Array
    residuals: jax.Array
    rank: jax.Array
    singular_values: jax.Array


def lstsq(a, b, rcond: float | None = None) -> LstsqResult:
    r"""Least-squares solution :math:`x = \arg\min_x \lVert b - A x\rVert_2` of minimum norm.

    Args:
      a: ``(..., m, n)`` array of float32, float64, complex64 or complex128.
      b: ``(..., m, k)``, its batch dims broadcasting against those of ``a``; or a vector right-hand
        side per matrix: ``(m,)``, or exactly ``a.shape[:-1]``. Integer, boolean or half-precision
        ``b`` is cast to ``a``'s dtype.
      rcond: singular values ``<= rcond * s_max`` count as zero. ``None`` (default) means
        ``eps * max(m, n)`` (numpy's default); a negative value means ``eps``. A number or a
        concrete scalar array: the kernels decide the rank by it (a traced tolerance:
        :func:`pinv`'s ``rtol``).

    Returns:
      ``LstsqResult(solution, residuals, rank, singular_values)``: ``solution`` is ``(..., n)`` or
      ``(..., n, k)``; ``residuals`` the squared 2-norm of each column of ``b - a @ x`` when
      ``m > n`` (``(..., 1)`` for vector ``b``) and empty otherwise; ``rank`` int32; and
      ``singular_values`` ``(..., min(m, n))``. Unlike numpy, ``residuals`` is reported also when
      ``rank < n`` (a shape cannot depend on the data under ``jit``).

    Full-rank problems are solved by a QR (of ``a``, or of ``aᴴ`` when ``m < n``), never by an
    SVD; rank-deficient ones by the truncated SVD. The rank is decided on device. Derivatives of a
    full-rank solution reuse the forward's triangular factor (no second factorisation).

    Example:
      >>> import jax.numpy as jnp, jaxforge as jf
      >>> a = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
      >>> jf.linalg.lstsq(a, jnp.array([1.0, 2.0, 3.0])).solution.round(4)
      Array([1., 2.], dtype=float32)
    """
    a, b = _matrix("lstsq", a), jnp.asarray(b)
    if b.dtype.kind in "biu" or b.dtype in (jnp.float16, jnp.bfloat16):
        b = b.astype(a.dtype)  # as numpy and jnp promote it: a's dtype decides the precision
    check_dtype("lstsq", "b", b.dtype)
    *a_batch, m, n = a.shape
    # torch's rule: b is a (batch of) vector(s) iff it is 1-D or has exactly a's shape minus n.
    vector_b = b.ndim == 1 or b.shape == a.shape[:-1]
    if b.ndim < 2 and not vector_b:
        raise ValueError(f"lstsq: `b` must have shape (..., m) or (..., m, k); got a scalar `b` for `a` of shape {a.shape}")
    if vector_b:
        b = b[..., None]
    if b.shape[-2] != m:
        raise ValueError(
            f"lstsq: `a` and `b` must have the same number of rows; got `a` of shape {a.shape} "
            f"({m} rows) and `b` of shape {b.shape[:-1] if vector_b else b.shape} ({b.shape[-2]} rows)"
        )
    try:
        batch = jnp.broadcast_shapes(tuple(a_batch), b.shape[:-2])
    except ValueError:
        raise ValueError(
            f"lstsq: the batch dims of `a` {a.shape} and `b` {b.shape[:-1] if vector_b else b.shape} "
            f"do not broadcast"
        ) from None
    dtype = common_dtype("lstsq", ("a", a.dtype), ("b", b.dtype))
    a = jnp.broadcast_to(a.astype(dtype), (*batch, m, n))
    b = jnp.broadcast_to(b.astype(dtype), (*batch, m, b.shape[-1]))
    x, residuals, rank, s, _ = lstsq_p.bind(a, b, rcond=_resolve_rcond(rcond, dtype, m, n))
    if vector_b:
        x = x[..., 0]
    return LstsqResult(x, residuals, rank, s)


def _resolve_rcond(rcond, dtype, m: int, n: int) -> float:
    """``rcond`` as the float the kernels take: None, a real number or a concrete real scalar array;
    a traced one is refused (the rank is decided in the kernels) with pinv's traced tolerances."""
    if rcond is None:
        return default_rcond(dtype, m, n)
    if isinstance(rcond, jax.core.Tracer):
        raise TypeError(
            f"lstsq: `rcond` must be None, a number or a concrete scalar array; got a traced {jax.typeof(rcond).str_short()}: "
            "compute it outside jit, or solve by `jf.linalg.pinv(a, rtol=rcond) @ b`, whose tolerances may be traced"
        )
    rcond = concrete_scalar(rcond, "fiu")
    if isinstance(rcond, (bool, np.bool_)) or not isinstance(rcond, (int, float, np.floating, np.integer)) or np.isnan(rcond):
        raise TypeError(f"lstsq: `rcond` must be None or a real number; got {rcond!r}")
    return float(np.finfo(dtype).eps) if rcond < 0 else float(rcond)


def _check_grad_eps(grad_eps) -> float:
    grad_eps = concrete_scalar(grad_eps, "fiu")
    if not isinstance(grad_eps, (int, float, np.floating, np.integer)) or not grad_eps >= 0:
        raise ValueError(f"svd: `grad_eps` must be a real number >= 0; got {grad_eps!r}")
    return float(grad_eps)
