"""The linear-algebra benchmark: ``jf.linalg.svd`` (with and without vectors) and ``jf.linalg.lstsq``
against their anchors.

Anchors (shared/ANCHORS.md): jnp's own functions, a jnp QR + triangular-solve least squares,
numpy (when running on CPU) and torch (on GPU, where importable), all timed in this process on
the default device, in interleaved rounds (``median_times``). Inputs are float32 ``U diag(s) Vᵀ``
with random orthonormal factors and singular values spread geometrically over ``[1/COND, 1]``;
the shapes are the ``SHAPES`` tables of ``jaxforge.primitives.linalg`` tagged ``bench_cpu`` or
``bench_gpu``. Accuracy is computed in float64 numpy from each implementation's float32 results.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

import jaxforge as jf
from jaxforge.bench._timing import error_record, median_times, timed_call, timed_record, untimed_record
from jaxforge.primitives.linalg._ops import solve_triangular
from jaxforge.primitives.linalg.lstsq import SHAPES as LSTSQ_SHAPES, default_rcond
from jaxforge.primitives.linalg.svd import SHAPES as SVD_SHAPES

__all__ = ["COND", "OPS", "QUICK_SHAPES", "measure"]

COND = 100.0  # condition number of every input: well-conditioned, so accuracy tells methods apart
SKIP_SECONDS = 20.0  # an anchor slower than this per call is recorded as skipped, not timed

# Tiny shapes for smoke tests, tagged "quick": (batch, m, n) for svd, (batch, m, n, k) for lstsq.
QUICK_SHAPES = {
    "svd": {"quick_tall": ((4, 16, 8), ("quick",)), "quick_wide": ((2, 8, 12), ("quick",))},
    "lstsq": {"quick_tall": ((4, 16, 8, 2), ("quick",)), "quick_wide": ((2, 8, 12, 1), ("quick",))},
}
_REPEATS = {
    "quick": dict(min_repeats=2, max_repeats=2, max_seconds=1.0),
    "cpu": dict(min_repeats=3, max_repeats=30, max_seconds=2.0),
    "gpu": dict(min_repeats=3, max_repeats=30, max_seconds=0.5),
}
# Seconds from the start of a GPU run after which the anchors are no longer measured (jaxforge
# still is); gpu_check.sh passes its own. The first H200 run took 124 s with every anchor but 6.
GPU_BUDGET_S = 90.0


def _unchanged(*xs):
    return xs


def _wide(x) -> np.ndarray:
    """``x`` on the host in float64, or complex128 where complex."""
    x = np.asarray(x)
    return x.astype(np.result_type(x.dtype, np.float64))


def _to_host(*xs):
    return tuple(np.asarray(x) for x in xs)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One contender: ``fn(*prepare(*inputs))`` returns a tuple of outputs, ready on return."""

    name: str
    fn: Callable[..., Sequence]
    prepare: Callable[..., tuple] = _unchanged  # moves the inputs where fn wants them, untimed
    fetch: Callable[[Any], np.ndarray] = np.asarray  # one output back to a host array
    applies: Callable[[tuple[int, ...]], bool] = lambda shape: True  # else recorded as skipped


@dataclasses.dataclass(frozen=True)
class _Op:
    name: str
    shapes: dict  # name -> (shape, tags), the primitive's SHAPES and the quick ones
    make_inputs: Callable[[tuple[int, ...]], tuple[jax.Array, ...]]
    implementations: Callable[[str], list[Implementation]]  # backend -> contenders, jaxforge first
    accuracy: Callable[[tuple[np.ndarray, ...], list[np.ndarray]], dict[str, float]]


def measure(
    *, shapes: Sequence[str] | None = None, quick: bool = False, progress=None, budget_s=None, checkpoint=None
) -> list[dict]:
    """Times every implementation of svd and lstsq on each selected shape; one record per triple.

    ``shapes`` names entries of the ``SHAPES`` tables or of ``QUICK_SHAPES``, for both ops or, as
    ``op:name``, for one; the default is every
    shape tagged for this run (``quick``, else ``bench_gpu`` on a GPU and ``bench_cpu`` elsewhere).
    ``progress(done, total, label)`` is called before each measurement and once at the end.
    ``budget_s``: seconds after which anchors are skipped, or ``(anchors, all)`` to skip jaxforge's
    own rows too past the second, so that a run under a time limit still writes its results
    (default: ``GPU_BUDGET_S`` for the anchors on a GPU, unlimited elsewhere). ``checkpoint(records)``,
    if given, gets the records so far after each shape.
    """
    start = time.perf_counter()
    backend = jax.default_backend()
    on_cpu = backend == "cpu"  # where every implementation loops over the batch, one matrix at a time
    if shapes is not None:
        known = {f"{qualifier}{name}" for op in OPS.values() for name in op.shapes for qualifier in ("", f"{op.name}:")}
        unknown = sorted(set(shapes) - known)
        if unknown:
            raise ValueError(f"unknown shape name(s) {unknown}; known: {sorted(known)}")
    tag = "quick" if quick else "bench_gpu" if backend == "gpu" else "bench_cpu"
    if budget_s is None:
        budget_s = GPU_BUDGET_S if backend == "gpu" and not quick else math.inf
    soft, hard = (budget_s, math.inf) if np.isscalar(budget_s) else budget_s
    repeats = _REPEATS["quick" if quick else backend if backend in _REPEATS else "gpu"]
    plan = [
        (op, name, shape, op.implementations(backend))
        for op in OPS.values()
        for name, shape in _select_shapes(op, shapes, tag).items()
    ]
    total = sum(len(impls) for *_, impls in plan)
    records: list[dict] = []
    for op, name, shape, impls in plan:
        inputs = op.make_inputs(shape)
        host64 = tuple(_wide(x) for x in inputs)
        outcomes: dict[str, dict | _Ready] = {}  # compiled and checked first, then timed together
        for impl in impls:
            if progress:
                progress(len(records) + len(outcomes), total, f"{op.name} {name} {impl.name}")
            elapsed = time.perf_counter() - start
            if not impl.applies(shape):
                outcomes[impl.name] = untimed_record("skipped", "not measured on this shape (it informs a dispatch choice on others)")
            elif elapsed > (limit := hard if impl.name == "jaxforge" else soft):
                reason = f"time budget: {elapsed:.0f} s into the run, past its limit of {limit:.0f} s"
                outcomes[impl.name] = untimed_record("skipped", reason)
            else:
                outcomes[impl.name] = _prepare(op, impl, inputs, host64, repeats, batch_is_a_loop=on_cpu)
        ready = {impl: r for impl, r in outcomes.items() if isinstance(r, _Ready)}
        timings = median_times(
            {impl: (r.fn, r.args) for impl, r in ready.items()},
            **repeats,
            once=[impl for impl, r in ready.items() if r.first_s > repeats["max_seconds"]],
        )
        for impl, outcome in outcomes.items():
            record = dict(op=op.name, shape_name=name, shape=list(shape), implementation=impl)
            if isinstance(outcome, _Ready):
                timing = timings[impl]
                if isinstance(timing, Exception):
                    if impl == "jaxforge":  # the subject's errors surface
                        raise timing
                    outcome = error_record(timing)
                else:
                    outcome = timed_record(outcome.first_s, timing, outcome.accuracy)
            records.append({**record, **outcome})
        _add_ratios(records[-len(impls):])
        if checkpoint:
            checkpoint(records)
    if progress:
        progress(total, total, "done")
    return records


def _select_shapes(op: _Op, names, tag: str) -> dict[str, tuple[int, ...]]:
    if names is None:
        return {name: shape for name, (shape, tags) in op.shapes.items() if tag in tags}
    picked = [name.removeprefix(f"{op.name}:") for name in names]
    return {name: op.shapes[name][0] for name in picked if name in op.shapes}


class _Ready(NamedTuple):
    """An implementation compiled and checked on one shape, to be timed beside the others."""

    fn: Callable
    args: tuple
    first_s: float
    accuracy: dict[str, float]


def _prepare(
    op: _Op, impl: Implementation, inputs, host64, repeats: dict, *, batch_is_a_loop: bool
) -> dict | _Ready:
    """Compiles and checks one implementation; an anchor that fails or is too slow is skipped (a record).

    ``batch_is_a_loop``: a call costs its batch size times one matrix's call, so an anchor's cost
    is estimated from one matrix before the whole batch is run.
    """
    if impl.name == "jaxforge":  # the subject: always timed, and its errors surface
        return _first_call(op, impl, impl.prepare(*inputs), host64)
    try:
        args = impl.prepare(*inputs)
        batch = inputs[0].shape[0]
        if batch_is_a_loop and batch > 1:
            one_matrix = tuple(x[:1] for x in args)
            impl.fn(*one_matrix)  # compiles, so that the estimate is of a warm call
            estimate = math.inf
            for _ in range(3):  # the first warm calls may still pay for allocations (jax's polar: 45, 20, 0.6 ms)
                estimate = min(estimate, timed_call(impl.fn, *one_matrix)[0] * batch)
                if estimate <= SKIP_SECONDS:
                    break
            if estimate > SKIP_SECONDS:
                return untimed_record("skipped", f"estimated {estimate:.0f} s per call from one matrix")
        return _first_call(op, impl, args, host64, skip_seconds=SKIP_SECONDS)
    except Exception as e:  # an anchor's limits (e.g. a driver refusing a shape) are data
        return error_record(e)


def _first_call(op: _Op, impl: Implementation, args, host64, skip_seconds=None) -> dict | _Ready:
    first_s, outputs = timed_call(impl.fn, *args)  # compiles, and gives the outputs to check
    if skip_seconds is not None and first_s > skip_seconds:
        return untimed_record("skipped", f"first call took {first_s:.0f} s", first_s)
    accuracy = op.accuracy(host64, [_wide(impl.fetch(x)) for x in outputs])
    return _Ready(impl.fn, args, first_s, accuracy)


def _add_ratios(records: list[dict]) -> None:
    """ratio = anchor time / jaxforge time on the same shape: > 1 means jaxforge is faster."""
    ours = next(r["median_ms"] for r in records if r["implementation"] == "jaxforge")
    for r in records:
        if r["status"] == "ok":
            r["ratio"] = round(r["median_ms"] / ours, 4)


# ---------------------------------------------------------------- inputs


@functools.partial(jax.jit, static_argnums=1)
def _well_conditioned(key, shape: tuple[int, ...]):
    """float32 matrices ``U diag(s) Vᵀ``: random orthonormal U, V; s geometric from 1 to 1/COND."""
    *batch, m, n = shape
    k = min(m, n)
    key_u, key_v = jax.random.split(key)
    u, _ = jnp.linalg.qr(jax.random.normal(key_u, (*batch, m, k), jnp.float32))
    v, _ = jnp.linalg.qr(jax.random.normal(key_v, (*batch, n, k), jnp.float32))
    s = jnp.geomspace(1.0, 1.0 / COND, k, dtype=jnp.float32)
    return _matmul(u * jax.lax.broadcast_to_rank(s, u.ndim), jnp.swapaxes(v, -1, -2))


def _svd_inputs(shape):
    return (_well_conditioned(jax.random.key(0), shape),)


def _svd_inputs_as(dtype):
    """svd's inputs in ``dtype``: the float32 ones exactly in float64; for complex types, ``(A + iB)/√2``
    of two of them."""

    def inputs(shape):
        with jax.enable_x64(True):
            (a,) = _svd_inputs(shape)
            if np.dtype(dtype).kind == "c":
                a = jax.lax.complex(a, _well_conditioned(jax.random.key(1), shape)).astype(jnp.complex128) / math.sqrt(2)
            return (a.astype(dtype),)

    return inputs


def _lstsq_inputs(shape):
    batch, m, n, k = shape
    a = _well_conditioned(jax.random.key(0), (batch, m, n))
    b = jax.random.normal(jax.random.key(1), (batch, m, k), jnp.float32)
    return a, b


# ---------------------------------------------------------------- implementations


def _matmul(x, y):
    # Full float32 products: a GPU's default TF32 passes would cost the anchors accuracy.
    return jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)


def _anchored(backend: str, ours: Callable, jnp_fn: Callable, numpy_fn: Callable, torch_fn: Callable) -> list[Implementation]:
    """``jaxforge`` running ``ours`` and its anchors: ``jnp`` (``jnp_fn``), ``numpy`` on CPU and, on a
    GPU where installed, ``torch`` (``torch_fn(torch)``); each a function of the inputs."""
    impls = [Implementation("jaxforge", jax.jit(ours)), Implementation("jnp", jax.jit(jnp_fn))]
    if backend == "cpu":
        impls.append(Implementation("numpy", numpy_fn, prepare=_to_host))
    torch = _cuda_torch() if backend == "gpu" else None
    if torch is not None:
        impls.append(_torch_implementation(torch, torch_fn(torch)))
    return impls


def _outputs(fn: Callable) -> Callable:
    """``fn`` returning its one result as a tuple of outputs."""
    return lambda *args: (fn(*args),)


def _svd_anchored(backend: str) -> list[Implementation]:
    """jaxforge's svd and its anchors: jnp's, numpy's on CPU, torch's on GPU where installed."""
    thin = dict(full_matrices=False)
    return _anchored(
        backend,
        jf.linalg.svd,
        functools.partial(jnp.linalg.svd, **thin),
        functools.partial(np.linalg.svd, **thin),
        lambda torch: functools.partial(torch.linalg.svd, **thin),
    )


def _svd_implementations(backend: str) -> list[Implementation]:
    extra = [*_svd_kernel_variants(), _svd_after_qr(), *_svd_algorithms()] if backend == "gpu" else []
    return _svd_anchored(backend) + extra


def _svd_after_qr() -> Implementation:
    """The Jacobi kernel of R after ``A = QR`` (``jaxforge-qr-jacobi``: config.JACOBI_QR_FIRST_VALIDATED),
    through the dispatch's own after_qr, on the shapes it would serve."""
    from jaxforge.lowering.linalg.svd import cuda

    def svd(a):
        s, u, vh = cuda.after_qr(a, functools.partial(cuda.jacobi, target=_loaded(cuda.r_target(a))), compute_uv=True)
        return u, s, vh

    applies = lambda shape: cuda.r_target(jax.ShapeDtypeStruct(shape, jnp.float32)) is not None  # noqa: E731
    return Implementation("jaxforge-qr-jacobi", jax.jit(svd), applies=applies)


def _svd_implementations_as(dtype):
    """svd's contenders on inputs of ``dtype``, run with jax_enable_x64; on a GPU also the block
    kernel by name (``jaxforge-block``: config.JACOBI_BLOCK_F64_VALIDATED,
    JACOBI_BLOCK_COMPLEX_VALIDATED) where it fits."""

    def implementations(backend: str) -> list[Implementation]:
        impls = _svd_anchored(backend)
        if backend == "gpu":
            from jaxforge.lowering import build
            from jaxforge.lowering.linalg.svd import config, cuda

            def fits(shape):
                return config.jacobi_block_fits(max(shape[-2:]), min(shape[-2:]), dtype, build.gpu_arch())

            def block(a):
                s, u, vh = cuda.jacobi_svd(a, _loaded(cuda.BLOCK_TARGETS[np.dtype(dtype).name]))
                return u, s, vh

            impls.append(Implementation("jaxforge-block", jax.jit(block), applies=fits))
        return [dataclasses.replace(impl, fn=_in_x64(impl.fn)) for impl in impls]

    return implementations


def _in_x64(fn):
    def call(*args):
        with jax.enable_x64(True):
            return fn(*args)

    return call


def _svdvals_implementations(backend: str) -> list[Implementation]:
    values = dict(compute_uv=False)
    impls = _anchored(
        backend,
        _outputs(jf.linalg.svdvals),
        _outputs(functools.partial(jnp.linalg.svd, **values)),
        _outputs(functools.partial(np.linalg.svd, **values)),
        lambda torch: _outputs(torch.linalg.svdvals),
    )
    return impls + (_svd_values_variants() if backend == "gpu" else [])


def _pinv_implementations(backend: str) -> list[Implementation]:
    """jf.linalg.pinv (an svd_p and one product) against jnp's, numpy's on CPU, torch's on GPU."""
    pinv = (jf.linalg.pinv, jnp.linalg.pinv, np.linalg.pinv)
    return _anchored(backend, *map(_outputs, pinv), lambda torch: _outputs(torch.linalg.pinv))


def _polar_implementations(backend: str) -> list[Implementation]:
    """jf.linalg.polar's unitary factor (an svd_p and one product) against jax.scipy.linalg.polar's
    (QDWH: no reverse mode), scipy's on CPU and torch's ``U Vᴴ`` of its SVD on GPU (torch has none)."""

    def torch_polar(torch):
        def unitary(a):
            u, _, vh = torch.linalg.svd(a, full_matrices=False)
            return (u @ vh,)

        return unitary

    numpy_polar = lambda a: (np.stack([scipy.linalg.polar(x)[0] for x in a.reshape(-1, *a.shape[-2:])]).reshape(a.shape),)  # noqa: E731

    def jax_polar(a):  # jax's QDWH takes tall matrices (side="right"): a wide one's U by its transpose's
        wide = a.shape[-2] < a.shape[-1]
        u = jax.scipy.linalg.polar(jnp.swapaxes(a, -1, -2) if wide else a)[0]
        return (jnp.swapaxes(u, -1, -2) if wide else u,)

    return _anchored(backend, lambda a: (jf.linalg.polar(a)[0],), jax_polar, numpy_polar, torch_polar)


def _svd_values_variants() -> list[Implementation]:
    """Each Jacobi kernel's singular values (``jaxforge-<kernel>``) beside its twin's for the values
    alone (``jaxforge-<kernel>-values``: config.JACOBI_VALUES_VALIDATED), where the kernel fits."""
    from jaxforge.lowering.linalg.svd import cuda

    impls = []
    for name, target, applies in _svd_kernels():
        full = lambda a, target=target: (cuda.jacobi_svd(a, _loaded(target))[0],)  # noqa: E731
        alone = lambda a, target=target: (cuda.jacobi_values(a, _loaded(cuda.VALUES_TARGETS[target])),)  # noqa: E731
        impls += [Implementation(name, jax.jit(full), applies=applies), Implementation(f"{name}-values", jax.jit(alone), applies=applies)]
    return impls


def _loaded(target: str) -> str:
    """``target``, once the svd kernels are built and loaded here."""
    from jaxforge.lowering import build
    from jaxforge.lowering.linalg.svd import cuda

    if not build.ensure_loaded(cuda.KERNEL):
        raise RuntimeError("the svd kernels could not be built here")
    return target


def _svd_kernels() -> list[tuple[str, str, Callable]]:
    """``(row name, FFI target, applies)`` of each kernel that could serve a shape. On the small
    shapes the one-warp kernel serves (m, n <= 32): its sweeps with a row a lane, a column a lane
    and two lanes a column pair (``jaxforge-rows``, ``jaxforge-lanes``, ``jaxforge-pairs``: which
    decide config.jacobi_warp_sweeps) and the one-block kernel (``jaxforge-block``:
    config.JACOBI_WARP_MAX_DIM). Where the block kernel's slot sweeps fit (32 < max(m, n) <= 128):
    ``jaxforge-slots`` and ``jaxforge-block`` (config.JACOBI_SLOTS_VALIDATED)."""
    from jaxforge.lowering.linalg.svd import config, cuda

    one_warp = lambda shape: max(shape[-2:]) <= config.JACOBI_WARP_MAX_DIM  # noqa: E731
    slots = lambda shape: config.JACOBI_WARP_MAX_DIM < max(shape[-2:]) <= config.JACOBI_SLOTS_MAX_ROWS  # noqa: E731
    return [
        ("jaxforge-rows", cuda.WARP_TARGETS["float32"], one_warp),
        ("jaxforge-lanes", cuda.LANES_TARGET, one_warp),
        ("jaxforge-pairs", cuda.PAIRS_TARGET, one_warp),
        ("jaxforge-block", cuda.BLOCK_TARGETS["float32"], lambda shape: one_warp(shape) or slots(shape)),
        ("jaxforge-slots", cuda.SLOTS_TARGET, slots),
    ]


def _svd_kernel_variants() -> list[Implementation]:
    """Each kernel of _svd_kernels, its factors timed whole."""
    from jaxforge.lowering.linalg.svd import cuda

    def svd(a, target):
        s, u, vh = cuda.jacobi_svd(a, _loaded(target))
        return u, s, vh

    return [Implementation(name, jax.jit(functools.partial(svd, target=target)), applies=applies) for name, target, applies in _svd_kernels()]


def _large(shape) -> bool:
    return min(shape[-2:]) >= 512


def _svd_algorithms() -> list[Implementation]:
    """Every choice config.LARGE_SVD picks from, on the large shapes: cuSOLVER's SVDs by jax's
    ``algorithm=`` and QDWH, on A and (tall shapes) on R of A = QR, run as the dispatch runs them."""
    from jaxforge.lowering.linalg.svd import config
    from jaxforge.lowering.linalg.svd.cuda import large_svd

    def row(method: str, qr_first: bool) -> Implementation:
        def svd(a):
            s, u, vh = large_svd(a, method, qr_first)
            return u, s, vh

        applies = (lambda shape: _large(shape) and shape[-2] >= 2 * shape[-1]) if qr_first else _large
        return Implementation(f"svd-{'qr-' if qr_first else ''}{method}", jax.jit(svd), applies=applies)

    return [row(method, qr_first) for qr_first in (False, True) for method in config.LARGE_SVD_METHODS]


def _qr_lstsq(a, b):
    """jnp QR + triangular solve: ``R⁻¹Qᵀb`` (m >= n, A = QR) or ``QR⁻ᵀb`` (m < n, Aᵀ = QR)."""
    m, n = a.shape[-2:]
    if m >= n:
        q, r = jnp.linalg.qr(a)
        return jax.scipy.linalg.solve_triangular(r, _matmul(jnp.swapaxes(q, -1, -2), b))
    q, r = jnp.linalg.qr(jnp.swapaxes(a, -1, -2))  # minimum-norm solution of a wide system
    return _matmul(q, jax.scipy.linalg.solve_triangular(r, b, trans="T"))


def _numpy_lstsq(a, b):
    return (np.stack([np.linalg.lstsq(a_i, b_i, rcond=None)[0] for a_i, b_i in zip(a, b)]),)


def _lstsq_implementations(backend: str) -> list[Implementation]:
    jnp_lstsq = jax.vmap(lambda a, b: jnp.linalg.lstsq(a, b)[0])  # 2-D only; an SVD inside
    impls = [
        Implementation("jaxforge", jax.jit(lambda a, b: (jf.linalg.lstsq(a, b).solution,))),
        Implementation("jnp", jax.jit(lambda a, b: (jnp_lstsq(a, b),))),
        Implementation("jnp-qr", jax.jit(lambda a, b: (_qr_lstsq(a, b),))),
    ]
    if backend == "cpu":
        impls.append(Implementation("numpy", _numpy_lstsq, prepare=_to_host))
    torch = _cuda_torch() if backend == "gpu" else None
    if torch is not None:
        impls.append(_torch_implementation(torch, lambda a, b: (torch.linalg.lstsq(a, b).solution,)))
    if backend == "gpu":
        impls += _lstsq_factors()
    return impls


def _lstsq_grad_implementations(backend: str) -> list[Implementation]:
    """``∇(a, b)`` of ``Σ x²`` for ``x`` the least-squares solution: jaxforge's jvp transposed, the
    same through jnp's QR, torch's autograd."""

    def grad(solve):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(solve(a, b) ** 2), argnums=(0, 1)))

    impls = [
        Implementation("jaxforge", grad(lambda a, b: jf.linalg.lstsq(a, b).solution)),
        Implementation("jnp-qr", grad(_qr_lstsq)),
    ]
    torch = _cuda_torch() if backend == "gpu" else None
    if torch is not None:

        def torch_grad(a, b):
            a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
            return torch.autograd.grad((torch.linalg.lstsq(a, b).solution ** 2).sum(), (a, b))

        impls.append(_torch_implementation(torch, torch_grad))
    return impls


def _lstsq_factors() -> list[Implementation]:
    """Each QR the lstsq dispatch chooses from (lowering/linalg/lstsq/config.py): R and Qᴴb of
    ``[A | b]`` and one triangular solve, without lstsq's rank certificate. Which is fastest on a
    shape sets the dispatch; jaxforge's time less the chosen one's is the certificate's."""
    from jaxforge.lowering import build
    from jaxforge.lowering.linalg.lstsq import config, cuda
    from jaxforge.lowering.linalg.lstsq.cholesky_qr import cholesky_qr2
    from jaxforge.lowering.linalg.lstsq.xla import augmented_qr

    def kernel(a, b):
        if not build.ensure_loaded(cuda.KERNEL):
            raise RuntimeError("the lstsq kernel could not be built here")
        return augmented_qr(cuda.qr_r_kernel)(a, b)

    def row(name: str, factor, applies) -> Implementation:
        solve = jax.jit(lambda a, b: (solve_triangular(*factor(a, b)),))
        return Implementation(f"lstsq-{name}", solve, applies=applies)

    def fused(targets):  # a kernel's own solution, without lstsq's later rungs
        def solve(a, b):
            if not build.ensure_loaded(cuda.KERNEL):
                raise RuntimeError("the lstsq kernel could not be built here")
            m, n = a.shape[-2:]
            return (cuda.qr_solve_cuda(a, b, default_rcond(a.dtype, m, n), targets)[1],)

        return jax.jit(solve)

    tall = lambda shape: shape[1] >= shape[2]  # noqa: E731
    fits = lambda shape: config.qr_r_block_fits(shape[1], shape[2] + shape[3], np.dtype(np.float32))  # noqa: E731
    fused_fits = lambda shape: config.qr_solve_fits(*shape[1:], np.dtype(np.float32))  # noqa: E731
    warp_fits = lambda shape: config.qr_solve_warp_fits(*shape[1:], np.dtype(np.float32))  # noqa: E731
    return [
        row("householder", augmented_qr(), tall),  # cuSOLVER geqrf
        row("qr_r", kernel, fits),  # the block kernel
        Implementation("lstsq-qr_solve", fused(cuda.QR_SOLVE_TARGETS), applies=fused_fits),  # the fused kernel
        Implementation("lstsq-qr_solve_warp", fused(cuda.QR_SOLVE_WARP_TARGETS), applies=warp_fits),  # one warp
        row("cholesky_qr2", cholesky_qr2(augmented_qr()), tall),
    ]


def _cuda_torch():
    """torch, when it is installed and sees a GPU; None otherwise (torch is an optional anchor)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_implementation(torch, call: Callable) -> Implementation:
    def synchronised(*args):
        out = tuple(call(*args))
        torch.cuda.synchronize()  # the host timer must see torch's kernels finish
        return out

    def to_cuda(*xs):
        return tuple(torch.as_tensor(np.asarray(x), device="cuda") for x in xs)

    return Implementation("torch", synchronised, prepare=to_cuda, fetch=lambda t: t.cpu().numpy())


# ---------------------------------------------------------------- accuracy (float64, host)


def _frobenius(x):
    return np.linalg.norm(x, axis=(-2, -1))


def _svd_accuracy(inputs, outputs) -> dict[str, float]:
    """Max over the batch of ‖A − U S Vᴴ‖/‖A‖ and of max(‖UᴴU − I‖, ‖VᴴV − I‖), Frobenius norms."""
    (a,), (u, s, vh) = inputs, outputs
    eye = np.eye(s.shape[-1])
    adjoint = lambda x: np.conj(np.swapaxes(x, -1, -2))  # noqa: E731
    reconstruction = _frobenius(a - (u * s[..., None, :]) @ vh) / _frobenius(a)
    orthogonality = np.maximum(_frobenius(adjoint(u) @ u - eye), _frobenius(vh @ adjoint(vh) - eye))
    return dict(reconstruction=float(reconstruction.max()), orthogonality=float(orthogonality.max()))


def _svdvals_accuracy(inputs, outputs) -> dict[str, float]:
    """Max over the batch of ‖s − s₆₄‖_∞ / s₆₄[0] against float64 numpy's values."""
    (a,), (s,) = inputs, outputs
    s64 = np.linalg.svd(a, compute_uv=False)
    return dict(values=float((np.abs(s - s64).max(-1) / s64[..., 0]).max()))


def _pinv_accuracy(inputs, outputs) -> dict[str, float]:
    """Max over the batch of ‖X − A⁺₆₄‖/‖A⁺₆₄‖ against float64 numpy's pseudo-inverse (κ = COND: none
    of the inputs' singular values is cut)."""
    (a,), (x,) = inputs, outputs
    want = np.linalg.pinv(a)
    return dict(relative=float((_frobenius(x - want) / _frobenius(want)).max()))


def _polar_accuracy(inputs, outputs) -> dict[str, float]:
    """Max over the batch of ‖U − U₆₄‖_F/√n against float64 numpy's ``W Vᴴ`` (κ = COND)."""
    (a,), (u,) = inputs, outputs
    w, _, vh = np.linalg.svd(a, full_matrices=False)
    return dict(unitary=float((_frobenius(u - w @ vh) / np.sqrt(a.shape[-1])).max()))


def _lstsq_accuracy(inputs, outputs) -> dict[str, float]:
    """Max over the batch of the normal-equation residual ‖Aᵀ(Ax − b)‖/‖Aᵀb‖."""
    (a, b), (x,) = inputs, outputs
    at = np.swapaxes(a, -1, -2)
    return dict(normal_residual=float((_frobenius(at @ (a @ x - b)) / _frobenius(at @ b)).max()))


def _lstsq_grad_accuracy(inputs, outputs) -> dict[str, float]:
    """Relative errors (worst matrix) of both gradients against the full-rank formula in float64:
    with ``z = (AᵀA)⁻¹·2x``, ``r = b − Ax``: ``∇b = Az``, ``∇A = −(Az)xᵀ + rzᵀ``."""
    (a, b), (grad_a, grad_b) = inputs, outputs
    at = np.swapaxes(a, -1, -2)
    gram = at @ a
    x = np.linalg.solve(gram, at @ b)
    z = np.linalg.solve(gram, 2 * x)
    want_b = a @ z
    want_a = -want_b @ np.swapaxes(x, -1, -2) + (b - a @ x) @ np.swapaxes(z, -1, -2)
    error = lambda got, want: float((_frobenius(got - want) / _frobenius(want)).max())  # noqa: E731
    return dict(grad_a=error(grad_a, want_a), grad_b=error(grad_b, want_b))


def _batched_shapes(shapes: dict) -> dict:
    """svd's shapes the Jacobi kernels serve (max(m, n) <= 128): where the values alone differ."""
    return {name: entry for name, entry in shapes.items() if max(entry[0][1:]) <= 128}


def _grad_shapes(shapes: dict) -> dict:
    """lstsq's tall shapes, on a GPU and in the quick run only (on CPU a gradient run is minutes)."""
    tall = {name: (shape, tags) for name, (shape, tags) in shapes.items() if shape[1] >= shape[2]}
    return {name: (shape, tuple(t for t in tags if t != "bench_cpu")) for name, (shape, tags) in tall.items()}


# The benchmark entries, by the `bench_entry` name their primitive declares, lstsq's gradient, svd in
# float64 and complex64, svd without vectors and the pseudo-inverse (last: on a GPU the time budget
# falls on them first).
OPS = {
    "svd": _Op("svd", {**SVD_SHAPES, **QUICK_SHAPES["svd"]}, _svd_inputs, _svd_implementations, _svd_accuracy),
    "lstsq": _Op(
        "lstsq", {**LSTSQ_SHAPES, **QUICK_SHAPES["lstsq"]}, _lstsq_inputs, _lstsq_implementations, _lstsq_accuracy
    ),
    "lstsq_grad": _Op(
        "lstsq_grad",
        _grad_shapes({**LSTSQ_SHAPES, **QUICK_SHAPES["lstsq"]}),
        _lstsq_inputs,
        _lstsq_grad_implementations,
        _lstsq_grad_accuracy,
    ),
    **{
        name: _Op(
            name,
            _batched_shapes({**SVD_SHAPES, **QUICK_SHAPES["svd"]}),
            _svd_inputs_as(dtype),
            _svd_implementations_as(dtype),
            _svd_accuracy,
        )
        for name, dtype in (("svd_f64", np.float64), ("svd_c64", np.complex64))
    },
    "svdvals": _Op(
        "svdvals",
        _batched_shapes({**SVD_SHAPES, **QUICK_SHAPES["svd"]}),
        _svd_inputs,
        _svdvals_implementations,
        _svdvals_accuracy,
    ),
    "pinv": _Op("pinv", _batched_shapes({**SVD_SHAPES, **QUICK_SHAPES["svd"]}), _svd_inputs, _pinv_implementations, _pinv_accuracy),
    "polar": _Op("polar", _batched_shapes({**SVD_SHAPES, **QUICK_SHAPES["svd"]}), _svd_inputs, _polar_implementations, _polar_accuracy),
}
