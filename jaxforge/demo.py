"""A tour of jaxforge's linear algebra, checked as it goes, ending with a benchmark.

    python -m jaxforge.demo [--quick] [--no-bench]

(a) ``jf.linalg.svd`` and (b) ``jf.linalg.lstsq`` are compared with numpy in float64, and their
derivatives with finite differences, under ``grad`` and ``vmap``; (c) the linear-algebra
benchmark times them against jnp and numpy on this machine (float32). The exit status is 1 if any
check fails.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxforge as jf
from jaxforge import bench


class Checks:
    """Prints one line per check and remembers the ones that failed."""

    def __init__(self):
        self.failed: list[str] = []

    def check(self, label: str, ok: bool, detail: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {label}: {detail}")
        if not ok:
            self.failed.append(label)

    def close(self, label: str, error, tolerance: float) -> None:
        error = float(error)
        self.check(label, error <= tolerance, f"{error:.1e} (tolerance {tolerance:.0e})")  # NaN fails


def directional_error(f, x, direction, h: float = 1e-6) -> float:
    """Relative gap between ``grad(f)(x) · d`` and the central difference of ``f`` along ``d``."""
    exact = jnp.vdot(jax.grad(f)(x), direction)
    numeric = (f(x + h * direction) - f(x - h * direction)) / (2 * h)
    return float(abs(exact - numeric) / max(abs(numeric), 1e-12))


def max_difference(xs, ys) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(xs, ys))


def tour_svd(checks: Checks, rng: np.random.Generator) -> None:
    print("\n(a) jf.linalg.svd: A = U diag(s) Vᵀ, numpy's convention, batched over leading dims")
    a = rng.standard_normal((4, 6, 4))
    u, s, vh = jf.linalg.svd(a)
    print(f"  a batch of 4 random 6x4 float64 matrices -> u {u.shape}, s {s.shape}, vh {vh.shape}")
    norm = functools.partial(jnp.linalg.norm, axis=(-2, -1))
    checks.close("reconstruction ‖A − U diag(s) Vᵀ‖/‖A‖, worst of the batch",
                 jnp.max(norm((u * s[..., None, :]) @ vh - a) / norm(a)), 1e-13)
    u_np, s_np, _ = np.linalg.svd(a, full_matrices=False)
    checks.close("singular values vs numpy, relative to the largest",
                 np.max(np.abs(s - s_np) / s_np[..., :1]), 1e-13)
    # Singular vectors are unique up to sign only: compare |⟨u_i, u_np_i⟩| with 1.
    alignment = np.abs(np.einsum("bmk,bmk->bk", u, u_np))
    checks.close("left singular vectors vs numpy, up to sign: max |1 − |⟨u_i, u_np_i⟩||",
                 np.max(np.abs(1 - alignment)), 1e-12)

    print("  jax.grad of the log-volume f(A) = Σ log s_i, against a central difference")

    def log_volume(a):
        return jnp.sum(jnp.log(jf.linalg.svd(a, compute_uv=False)))

    direction = rng.standard_normal(a[0].shape)
    checks.close("grad · d vs finite difference along a random d, relative",
                 directional_error(log_volume, a[0], direction), 1e-7)

    print("  jax.vmap(jf.linalg.svd) over the batch equals the batched call")
    batched = jax.vmap(jf.linalg.svd)(a)
    checks.close("max |vmap − batched| over u, s, vh", max_difference(batched, (u, s, vh)), 1e-12)


def tour_lstsq(checks: Checks, rng: np.random.Generator) -> None:
    print("\n(b) jf.linalg.lstsq: the minimum-norm x minimising ‖b − Ax‖, numpy's four results")
    cases = {
        "tall 8x3": rng.standard_normal((8, 3)),
        "wide 3x8": rng.standard_normal((3, 8)),
        "rank-deficient 6x4 of rank 2": rng.standard_normal((6, 2)) @ rng.standard_normal((2, 4)),
    }
    for label, a in cases.items():
        b = rng.standard_normal(a.shape[0])
        result = jf.linalg.lstsq(a, b)
        x_np, _, rank_np, _ = np.linalg.lstsq(a, b, rcond=None)
        error = np.max(np.abs(result.solution - x_np)) / np.max(np.abs(x_np))
        checks.close(f"{label}: solution vs numpy, relative", error, 1e-12)
        checks.check(f"{label}: rank", int(result.rank) == rank_np, f"{int(result.rank)} (numpy {rank_np})")

    print("  jax.grad of the loss ‖x(A)‖² through lstsq(A, b).solution, against a central difference")

    def loss(a, b):
        return jnp.sum(jf.linalg.lstsq(a, b).solution ** 2)

    a, b = rng.standard_normal((5, 8, 3)), rng.standard_normal((5, 8))
    direction = rng.standard_normal(a[0].shape)
    checks.close("grad · d vs finite difference along a random d, relative",
                 directional_error(lambda a0: loss(a0, b[0]), a[0], direction), 1e-7)

    print("  jax.vmap(jax.grad(loss)) over 5 problems equals a Python loop of grads")
    looped = [jax.grad(loss)(a_i, b_i) for a_i, b_i in zip(a, b)]
    checks.close("max |vmap(grad) − loop|", max_difference(jax.vmap(jax.grad(loss))(a, b), looped), 1e-12)


def benchmark(quick: bool) -> None:
    shapes = "tiny shapes" if quick else "the bench shapes"
    print(
        f"\n(c) benchmark on {jax.devices()[0].device_kind}, float32, {shapes}:"
        "\n  jaxforge vs jnp's own functions, jnp QR + triangular solve (lstsq) and numpy, in this process;"
        "\n  median ms of warm calls; ratio = anchor time / jaxforge time (> 1: jaxforge is faster);"
        "\n  accuracy in float64 from each result: svd reconstruction and orthogonality,"
        "\n  lstsq normal-equation residual ‖Aᵀ(Ax − b)‖/‖Aᵀb‖.",
        flush=True,  # before the progress bar, which goes to stderr
    )
    records = bench.run("linalg", quick=quick, progress=bench.ProgressBar())
    print(bench.format_table(records))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxforge.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny benchmark")
    parser.add_argument("--no-bench", action="store_true", help="only the checked tour")
    args = parser.parse_args(argv)

    jax.config.update("jax_enable_x64", True)  # the checks compare with numpy in float64
    checks = Checks()
    rng = np.random.default_rng(0)
    tour_svd(checks, rng)
    tour_lstsq(checks, rng)
    if not args.no_bench:
        benchmark(args.quick)
    if checks.failed:
        print(f"\n{len(checks.failed)} check(s) failed: {', '.join(checks.failed)}")
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
