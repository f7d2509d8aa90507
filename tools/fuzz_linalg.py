"""Random ``svd``, ``lstsq``, ``pinv`` and ``polar`` calls against numpy in float64, for minutes at a time: what the
suite's fixed shapes may miss after a change to the rules, the batching or the lowerings.

Each seed draws an op, a dtype (float64 or complex128 for derivatives; float32 or complex64 for
values only), batch dims (none, or up to two of 0-3 items), a matrix shape (0-10 a side, one seed
in five up to 40), its singular values (spread, clustered, repeated, zero, or spanning up to
κ = 1e8) and the op's options (``full_matrices``, ``compute_uv``, ``grad_eps``; ``rcond``, a vector
or ``k`` columns of ``b``, batch dims of ``b`` that broadcast; pinv's ``rtol`` and, for square
matrices, ``hermitian``: the matrix's Hermitian part; polar's ``side``). It checks

* the values against ``numpy.linalg`` per matrix (singular values within Weyl's bound; ``u`` and
  ``vh`` by reconstruction and orthonormality; lstsq's rank where the singular values leave no
  doubt, its solution within a bound that grows with κ, residuals; pinv's and matrix_rank's alike;
  polar's factors by reconstruction, orthonormality and ``P`` Hermitian positive semi-definite,
  and at full rank ``u`` against ``W Vᴴ``),
  jitted against eager, vmapped
  over a batch axis against a loop, and a NaN in one matrix giving it NaN results and leaving the
  others' alone;
* where derivatives are defined (float64 or complex128, distinct singular values; for lstsq full
  rank, or a rank-deficient ``a = L Rᴴ`` moved through its factors, which holds the rank), the jvp of gauge-invariant results (``s``, ``u diag(w(s)) vh``, the projectors onto the
  complements of a full decomposition; lstsq's solution, residuals and singular values; the
  pseudo-inverse and polar's factors, also at repeated values) against central finite differences, ``vjp`` as the jvp's transpose, and on small problems Hessian-vector products of
  a scalar of them (forward over reverse against differences of the gradient, reverse over reverse
  against forward over reverse; polar's also at repeated values).

    PYTHONPATH=. python tools/fuzz_linalg.py [--seconds 600] [--seed 0] [--count N] [--emulated-kernels]

``--emulated-kernels`` (CPU) sends svd and lstsq through their cuda lowerings over the CUDA kernels
and FFI handlers built against tests/cuda_emulation/, every kernel enabled: the GPU path's logic.

prints each failing seed with its error, and last the count of seeds run and failed (exit 1 if any
failed). A seed reruns alone with ``--seed S --count 1``.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import jaxforge as jf  # noqa: E402
from tests.linalg_inputs import random, with_singular_values  # noqa: E402
from tools import fuzz_loop  # noqa: E402

COMPLEX = {np.float32: np.complex64, np.float64: np.complex128}


def random_singular_values(rng, k: int, *, distinct: bool):
    """``(values, kind)``: ``k`` descending singular values and the name of their spread. Distinct
    ones lie apart by at least 1/40 of the largest, so finite differences of ``u`` and ``vh`` hold."""
    if distinct:
        return (np.linspace(2.0, 1.0, k) if k > 1 else np.full(k, 1.5)) * rng.choice([1e-3, 1.0, 1e3]), "distinct"
    kind = rng.choice(["graded", "repeated", "zeros", "tiny"])
    if kind == "graded":  # κ up to 1e8
        return np.logspace(0, -rng.uniform(0, 8), k), kind
    if kind == "repeated":
        return np.sort(rng.choice([1.0, 2.0], k))[::-1].copy(), kind
    if kind == "zeros":  # rank deficient
        rank = int(rng.integers(0, max(k, 1)))
        return np.concatenate([np.linspace(2.0, 1.0, rank), np.zeros(k - rank)]), kind
    return np.full(k, 1e-30) * np.linspace(2.0, 1.0, k), kind  # a matrix scaled to underflow's edge


def random_problem(rng):
    """The op's draws: dtype, batch dims, shape and the matrix ``a`` (numpy)."""
    derivatives = rng.random() < 0.75
    dtype = np.float64 if derivatives else np.float32
    if rng.random() < 0.35:
        dtype = COMPLEX[dtype]
    batch = tuple(int(x) for x in rng.integers(0 if rng.random() < 0.1 else 1, 4, int(rng.integers(0, 3))))
    side = 41 if rng.random() < 0.2 else 11
    m, n = (int(x) for x in rng.integers(0 if rng.random() < 0.1 else 1, side, 2))
    s, kind = random_singular_values(rng, min(m, n), distinct=derivatives and rng.random() < 0.7)
    a = with_singular_values(rng, batch, m, n, s, np.result_type(dtype, np.float64))  # built in double precision
    return dtype, a, s, kind


def _tol(dtype, m: int, n: int) -> float:
    return 50 * np.finfo(dtype).eps * np.sqrt(max(m, n, 1))


def check_svd(rng, dtype, a64, s_true, kind) -> None:
    m, n = a64.shape[-2:]
    k, batch = min(m, n), a64.shape[:-2]
    full, grad_eps = bool(rng.random() < 0.4), float(rng.choice([0.0, 0.0, 1e-12]))
    a = jnp.asarray(a64.astype(dtype))
    call = lambda a: jf.linalg.svd(a, full_matrices=full, grad_eps=grad_eps)  # noqa: E731
    u, s, vh = call(a)
    assert u.shape == (*batch, m, m if full else k) and vh.shape == (*batch, n if full else k, n)
    assert s.shape == (*batch, k) and s.dtype == np.finfo(dtype).dtype
    tol = _tol(dtype, m, n)
    a_wide = np.asarray(a, a64.dtype)  # the input as rounded to dtype
    s_np = np.linalg.svd(a_wide, compute_uv=False) if a_wide.size else np.zeros((*batch, k))
    scale = np.maximum(s_np[..., :1] if k else np.ones((*batch, 1)), np.finfo(np.float64).tiny)
    np.testing.assert_array_less(np.abs(np.asarray(s, np.float64) - s_np) / scale, tol)
    u64, vh64 = np.asarray(u, a64.dtype), np.asarray(vh, a64.dtype)
    recon = (u64[..., :, :k] * np.asarray(s, np.float64)[..., None, :]) @ vh64[..., :k, :]
    np.testing.assert_array_less(np.abs(recon - a_wide) / scale[..., None], tol)
    for q in (u64, np.conj(np.swapaxes(vh64, -1, -2))):
        gram = np.conj(np.swapaxes(q, -1, -2)) @ q
        np.testing.assert_array_less(np.abs(gram - np.eye(q.shape[-1])), tol)
    np.testing.assert_allclose(jf.linalg.svd(a, compute_uv=False) / scale, s / scale, rtol=0, atol=tol)
    _check_transforms(call, (a,), (True,), tol, gauge=_svd_invariants(k, full))
    if dtype in (np.float64, np.complex128) and kind == "distinct" and grad_eps == 0 and k:
        _check_derivatives(rng, lambda a: _svd_invariants(k, full)(call(a)), (a,), s_true[0])
    if grad_eps and kind in ("repeated", "zeros"):  # broadened: finite where the exact ones are not
        tangent = jnp.asarray(random(rng, a.shape, a.dtype))
        for x in jax.tree.leaves(jax.jvp(call, (a,), (tangent,))[1]):
            assert np.isfinite(x).all(), f"grad_eps={grad_eps}: a non-finite tangent at {kind} singular values"


def _svd_invariants(k: int, full: bool):
    """Results a unitary gauge leaves alone: ``s``, ``u diag(w) vh`` and the complements' projectors."""

    def invariants(usv):
        u, s, vh = usv
        w = s**2 + jax.lax.broadcast_to_rank(jnp.arange(1, k + 1), s.ndim)  # distinct weights: each pair of singular vectors counts
        out = [s, (u[..., :, :k] * w[..., None, :].astype(u.dtype)) @ vh[..., :k, :]]
        if full:
            out += [u[..., :, k:] @ jnp.conj(jnp.swapaxes(u[..., :, k:], -1, -2))]
            out += [jnp.conj(jnp.swapaxes(vh[..., k:, :], -1, -2)) @ vh[..., k:, :]]
        return out

    return invariants


def _at_the_cutoff(s, cutoff: float, tol: float) -> bool:
    """Whether a singular value lies at ``cutoff · s_max`` within rounding: either rank is right there."""
    relative = s / max(s[0], np.finfo(np.float64).tiny) if s.size else s
    return bool(np.any(np.abs(relative - cutoff) <= max(0.5 * cutoff, tol)))


def check_lstsq(rng, dtype, a64, s_true, kind) -> None:
    m, n = a64.shape[-2:]
    batch = a64.shape[:-2]
    vector = rng.random() < 0.4
    cols = 1 if vector else int(rng.integers(0 if rng.random() < 0.1 else 1, 4))  # 0: no right-hand side
    b_batch = batch
    if vector and rng.random() < 0.3:  # one vector for every matrix
        b_batch = ()
    elif batch and not vector and rng.random() < 0.3:  # b broadcasts: a leading dim of one, or fewer dims
        b_batch = (1, *batch[1:]) if rng.random() < 0.5 else batch[1:]
        if (*b_batch, m, cols) == a64.shape[:-1]:  # torch's rule, lstsq's, reads that b as vectors
            b_batch = batch
    b64 = random(rng, (*b_batch, m) if vector else (*b_batch, m, cols), a64.dtype)
    rcond = rng.choice([None, None, -1.0, 1e-3])
    a, b = jnp.asarray(a64.astype(dtype)), jnp.asarray(b64.astype(dtype))
    call = lambda a, b: jf.linalg.lstsq(a, b, rcond=rcond)  # noqa: E731
    x, residuals, rank, s = call(a, b)
    wide = a64.dtype
    a_w, b_w = np.asarray(a, wide), np.broadcast_to(np.asarray(b, wide), (*batch, *b64.shape[len(b_batch) :]))
    eps = np.finfo(dtype).eps
    cutoff = (eps * max(m, n) if rcond is None else eps if rcond < 0 else rcond) if m and n else 0
    for idx in np.ndindex(*batch):
        x_np, _, rank_np, s_np = np.linalg.lstsq(a_w[idx], b_w[idx], rcond=cutoff if m and n else None)
        np.testing.assert_allclose(s[idx], s_np, rtol=0, atol=_tol(dtype, m, n) * (s_np[0] if s_np.size else 1))
        if _at_the_cutoff(s_np, cutoff, _tol(dtype, m, n)):
            continue
        assert int(rank[idx]) == int(rank_np), (int(rank[idx]), int(rank_np))
        kept = s_np[: int(rank_np)]
        cond = kept[0] / kept[-1] if kept.size else 1.0
        bound = _tol(dtype, m, n) * cond**2 * max(1.0, np.abs(x_np).max(initial=0)) * max(1.0, np.abs(b_w[idx]).max(initial=0))
        np.testing.assert_allclose(x[idx], x_np, rtol=0, atol=bound)
        if m > n:
            r = np.asarray(b_w[idx]).reshape(m, cols) - a_w[idx] @ np.asarray(x[idx], wide).reshape(n, cols)
            np.testing.assert_allclose(residuals[idx], np.sum(np.abs(r) ** 2, 0), rtol=1e3 * eps, atol=bound)
    _check_transforms(call, (a, b), (True, b_batch == batch), _tol(dtype, m, n) * 1e3, gauge=lambda out: out)
    if kind == "distinct" and dtype in (np.float64, np.complex128) and min(m, n) > 0:  # full rank

        def differentiable(a, b):
            x, residuals, _, s = call(a, b)
            return [x, s] + ([residuals] if residuals.size else [])

        _check_derivatives(rng, differentiable, (a, b), s_true[0])
    rank_held = int(np.sum(s_true > 0))
    if kind == "zeros" and dtype in (np.float64, np.complex128) and 0 < rank_held < min(m, n):
        # along directions that hold the rank: a = L Rᴴ with L, R of rank_held columns, moved; the
        # cut-off far from both the kept values (2 to 1) and the rounding the product leaves
        u, s_np, vh = np.linalg.svd(a64, full_matrices=False)
        left, right = u[..., :rank_held] * s_np[..., None, :rank_held], np.conj(np.swapaxes(vh[..., :rank_held, :], -1, -2))

        def held(left, right, b):
            x, residuals, _, s = jf.linalg.lstsq(left @ jnp.conj(jnp.swapaxes(right, -1, -2)), b, rcond=1e-6)
            return [x, s] + ([residuals] if residuals.size else [])

        _check_derivatives(rng, held, (jnp.asarray(left), jnp.asarray(right), b), s_true[0])


def check_pinv(rng, dtype, a64, s_true, kind) -> None:
    m, n = a64.shape[-2:]
    batch = a64.shape[:-2]
    rtol = rng.choice([None, None, 1e-3])
    hermitian = m == n and rng.random() < 0.3  # then its Hermitian part, read as such (values only)
    if hermitian:
        a64 = (a64 + np.conj(np.swapaxes(a64, -1, -2))) / 2
    a = jnp.asarray(a64.astype(dtype))
    call = lambda a: jf.linalg.pinv(a, rtol, hermitian)  # noqa: E731
    x, rank = call(a), jf.linalg.matrix_rank(a, rtol, hermitian)
    assert x.shape == (*batch, n, m) and x.dtype == dtype and rank.shape == batch
    a_w = np.asarray(a, a64.dtype)
    tol, cutoff = _tol(dtype, m, n), (np.finfo(dtype).eps * max(m, n) if rtol is None else rtol)
    for idx in np.ndindex(*batch):
        s_np = np.linalg.svd(a_w[idx], compute_uv=False) if a_w[idx].size else np.zeros(0)
        if _at_the_cutoff(s_np, cutoff, tol):
            continue
        rank_np = int(np.sum(s_np > cutoff * s_np[:1]))
        assert int(rank[idx]) == rank_np, (int(rank[idx]), rank_np)
        want = np.linalg.pinv(a_w[idx], rcond=cutoff) if a_w[idx].size else np.zeros((n, m))
        bound = tol * (s_np[0] / s_np[rank_np - 1] ** 2 if rank_np else 1.0)  # ‖ΔA⁺‖ ≲ κ ‖A⁺‖ ‖ΔA‖/‖A‖
        np.testing.assert_allclose(x[idx], want, rtol=0, atol=bound)
    _check_transforms(call, (a,), (True,), tol * 1e3, gauge=lambda out: out)
    if dtype in (np.float64, np.complex128) and kind in ("distinct", "repeated") and min(m, n) > 0 and not hermitian:
        _check_derivatives(rng, lambda a: [call(a)], (a,), s_true[0])


def check_polar(rng, dtype, a64, s_true, kind) -> None:
    m, n = a64.shape[-2:]
    batch, k = a64.shape[:-2], min(m, n)
    side = str(rng.choice(["right", "left"]))
    a = jnp.asarray(a64.astype(dtype))
    call = lambda a: jf.linalg.polar(a, side)  # noqa: E731
    u, p = call(a)
    size = n if side == "right" else m
    assert u.shape == (*batch, m, n) and p.shape == (*batch, size, size) and u.dtype == p.dtype == dtype
    tol, wide = _tol(dtype, m, n), a64.dtype
    a_w, u64, p64 = (np.asarray(x, wide) for x in (a, u, p))
    adjoint = lambda x: np.conj(np.swapaxes(x, -1, -2))  # noqa: E731
    scale = max(float(s_true[0]) if k else 1.0, np.finfo(np.float64).tiny)
    np.testing.assert_array_less(np.abs((u64 @ p64 if side == "right" else p64 @ u64) - a_w) / scale, tol)
    gram = adjoint(u64) @ u64 if m >= n else u64 @ adjoint(u64)
    np.testing.assert_array_less(np.abs(gram - np.eye(gram.shape[-1])), tol)
    np.testing.assert_array_equal(p64, adjoint(p64))
    if p64.size:
        assert np.linalg.eigvalsh(p64).min() >= -tol * scale
    if kind != "zeros" and k:  # full rank: U is unique
        w, _, vh = np.linalg.svd(a_w, full_matrices=False)
        np.testing.assert_allclose(u64, w @ vh, rtol=0, atol=tol * s_true[0] / s_true[-1])
    _check_transforms(call, (a,), (True,), tol * 1e3, gauge=lambda out: out)
    if dtype in (np.float64, np.complex128) and kind in ("distinct", "repeated") and k:
        _check_derivatives(rng, lambda a: list(call(a)), (a,), s_true[0])


def _check_transforms(call, args, batched, tol, gauge) -> None:
    """jit against eager, vmap over the first batch axis against a loop (``batched[i]``: argument
    ``i`` has that axis), and a NaN in the first matrix: its results NaN, the others' unchanged."""
    eager = gauge(call(*args))
    _close_trees(gauge(jax.jit(call)(*args)), eager, tol)
    items = args[0].shape[0] if args[0].ndim > 2 else 0
    if items < 2:
        return
    axes = tuple(0 if b else None for b in batched)
    looped = [gauge(call(*(x[i] if b else x for x, b in zip(args, batched)))) for i in range(items)]
    mapped = gauge(jax.vmap(call, in_axes=axes)(*args))
    _close_trees(mapped, jax.tree.map(lambda *xs: jnp.stack(xs), *looped), tol)
    if args[0].size:
        poisoned = gauge(call(args[0].at[0].set(jnp.nan), *args[1:]))
        _close_trees(jax.tree.map(lambda x: x[1:], poisoned), jax.tree.map(lambda x: x[1:], eager), tol)
        first = np.asarray(jax.tree.leaves(poisoned)[0][0])
        assert np.isnan(first).all(), f"a NaN matrix gave {first}"


def _close_trees(actual, expected, tol) -> None:
    for x, y in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, (x.shape, y.shape)
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def _check_derivatives(rng, fn, args, size) -> None:
    """The jvp against central differences (a step of ``1e-6 size``, ``size`` the largest singular
    value), the vjp as its transpose, and on small problems the
    Hessian-vector products of a scalar of the results (forward over reverse against differences of
    the gradient, reverse over reverse against forward over reverse)."""
    tangents = tuple(jnp.asarray(random(rng, x.shape, x.dtype)) for x in args)
    outs, jvp_out = jax.jvp(fn, args, tangents)
    _assert_central_difference(fn, args, tangents, jvp_out, 1e-6 * size)
    cotangents = [jnp.asarray(random(rng, o.shape, o.dtype)) for o in outs]
    pulled = jax.vjp(fn, *args)[1](cotangents)
    # JAX pairs a cotangent with a tangent without conjugation: Re Σ c·t
    lhs, rhs = _pair(cotangents, jvp_out), _pair(pulled, tangents)
    assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs)), (lhs, rhs)
    if sum(x.size for x in args) > 300:
        return  # second order on small problems only: seconds, not minutes
    argnums = tuple(range(len(args)))
    grad = jax.grad(lambda *a: _pair(cotangents, fn(*a), traced=True), argnums=argnums)
    forward_over_reverse = jax.jvp(grad, args, tangents)[1]
    _assert_central_difference(grad, args, tangents, forward_over_reverse, 1e-6 * size, tol=1e-5)
    reverse_over_reverse = jax.grad(lambda *a: _pair(grad(*a), tangents, traced=True), argnums=argnums)(*args)
    _close_trees(reverse_over_reverse, forward_over_reverse, 1e-8 * max(1.0, *(np.abs(x).max(initial=0) for x in forward_over_reverse)))


def _pair(xs, ys, traced=False):
    total = sum(jnp.sum(jnp.real(x * y)) for x, y in zip(xs, ys))
    return total if traced else float(total)


def _assert_central_difference(fn, args, tangents, derivative, h, tol=1e-6) -> None:
    plus = fn(*(x + h * t for x, t in zip(args, tangents)))
    minus = fn(*(x - h * t for x, t in zip(args, tangents)))
    for d, p, q in zip(derivative, plus, minus):
        fd = (np.asarray(p) - np.asarray(q)) / (2 * h)
        np.testing.assert_allclose(d, fd, rtol=0, atol=tol * max(1.0, np.abs(fd).max(initial=0.0)))


def run_seed(seed: int) -> None:
    rng = np.random.default_rng(seed)
    draw = rng.random()
    op = check_svd if draw < 0.45 else check_lstsq if draw < 0.75 else check_pinv if draw < 0.9 else check_polar
    op(rng, *random_problem(rng))


def main(argv=None) -> int:
    parser = fuzz_loop.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--emulated-kernels", action="store_true", help="svd and lstsq through their cuda lowerings and kernels, emulated on the CPU")
    args = parser.parse_args(argv)
    if args.emulated_kernels:
        import tempfile

        from tests.cuda_emulation import build_handlers
        from tests.cuda_emulation.gpu_lowerings import use_cuda_lowerings

        use_cuda_lowerings(build_handlers(pathlib.Path(tempfile.mkdtemp()) / "linalg_handlers.so"))
    return fuzz_loop.run(run_seed, args)


if __name__ == "__main__":
    sys.exit(main())
