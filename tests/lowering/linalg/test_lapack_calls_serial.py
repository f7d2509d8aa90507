"""jaxlib 0.10's CPU LAPACK kernels wait on the XLA thread pool for their batch tasks, so two that
run side by side can block a small pool for good: ``jax.grad`` of lstsq on a batch of 2048 hung on
2 cores until the JVP's QR waited for the forward's singular values. The rules and lowerings chain
their LAPACK calls (``_ops.after``); this checks the compiled CPU programs: within each computation,
no two LAPACK calls (or control flow holding one) are independent of each other."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import pytest

import jaxforge as jf
from jaxforge.primitives.linalg._ops import upper_inverse


def computations(hlo: str) -> dict[str, dict[str, tuple[str, list[str]]]]:
    """Each computation's instructions: name -> (text, operand names)."""
    comps: dict[str, dict[str, tuple[str, list[str]]]] = {}
    current = None
    for line in hlo.splitlines():
        text = line.strip()
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", text)
        if text.endswith("{") and " = " not in text and header and not line.startswith(" "):
            current = comps.setdefault(header.group(1), {})
        elif current is not None and (found := re.match(r"(?:ROOT )?%([\w.\-]+) = (.*)", text)):
            name, rest = found.groups()
            current[name] = (rest, re.findall(r"%([\w.\-]+)", rest.split(", metadata")[0]))
    return comps


def independent_lapack_calls(hlo: str) -> list[tuple[str, str, str]]:
    comps = computations(hlo)
    holds: dict[str, bool] = {}

    def holds_lapack(comp: str) -> bool:
        if comp not in holds:
            holds[comp] = False
            holds[comp] = any(calls_lapack(text) for text, _ in comps.get(comp, {}).values())
        return holds[comp]

    def calls_lapack(text: str) -> bool:
        called = re.findall(r"(?:branch_computations=\{|calls=|to_apply=|body=|condition=)([^}]*)", text)
        return "lapack_" in text or any(holds_lapack(c) for group in called for c in re.findall(r"%?([\w.\-]+)", group))

    found = []
    for comp, instructions in comps.items():
        ancestors: dict[str, set[str]] = {}

        def upstream(name: str) -> set[str]:
            if name not in ancestors:
                ancestors[name] = set()
                for op in instructions[name][1]:
                    if op in instructions:
                        ancestors[name] |= {op} | upstream(op)
            return ancestors[name]

        lapack = [name for name, (text, _) in instructions.items() if calls_lapack(text)]
        for x, y in itertools.combinations(lapack, 2):
            if x not in upstream(y) and y not in upstream(x):
                found.append((comp, x, y))
    return found


def lstsq_programs(m, n):
    solve = lambda a, b: jf.linalg.lstsq(a, b).solution  # noqa: E731
    grad = jax.grad(lambda a, b: jnp.sum(solve(a, b) ** 2), (0, 1))
    return {
        "forward": lambda a, b: jf.linalg.lstsq(a, b),
        "grad": grad,
        "jvp": lambda a, b: jax.jvp(solve, (a, b), (a, b)),
        "hvp": lambda a, b: jax.jvp(grad, (a, b), (a, b)),  # forward over reverse
    }


@pytest.mark.parametrize("m,n", [(24, 8), (8, 24), (280, 260)])  # 260 columns: R⁻¹ by halves
@pytest.mark.parametrize("program", ["forward", "grad", "jvp", "hvp"])
def test_lstsq_programs_run_their_lapack_calls_one_at_a_time(m, n, program):
    a, b = jnp.ones((4, m, n)), jnp.ones((4, m, 2))
    hlo = jax.jit(lstsq_programs(m, n)[program]).lower(a, b).compile().as_text()
    assert "lapack_" in hlo and not independent_lapack_calls(hlo)


@pytest.mark.parametrize("m,n", [(24, 8), (8, 24)])
def test_svd_and_polar_programs_run_their_lapack_calls_one_at_a_time(m, n):
    svd = lambda a: jf.linalg.svd(a)  # noqa: E731
    programs = [svd, jax.grad(lambda a: sum(jnp.sum(jnp.abs(t)) for t in svd(a))), lambda a: jax.jvp(svd, (a,), (a,))]
    polar = lambda a: jf.linalg.polar(a, "left")  # noqa: E731  (its own derivative, on svd_p)
    polar_grad = jax.grad(lambda a: sum(jnp.sum(jnp.sin(t)) for t in polar(a)))
    programs += [polar, polar_grad, lambda a: jax.jvp(polar_grad, (a,), (a,))]
    for program in programs:
        hlo = jax.jit(program).lower(jnp.ones((4, m, n))).compile().as_text()
        assert "lapack_" in hlo and not independent_lapack_calls(hlo)


def test_a_triangular_inverse_by_halves_runs_its_solves_one_at_a_time():
    hlo = jax.jit(upper_inverse).lower(jnp.ones((2, 300, 300))).compile().as_text()
    assert hlo.count('custom_call_target="lapack_') == 4 and not independent_lapack_calls(hlo)  # 300 -> 150 -> 75


def test_the_check_finds_two_independent_calls():
    hlo = jax.jit(lambda a, b: (jnp.linalg.qr(a), jnp.linalg.svd(b))).lower(jnp.ones((4, 6, 3)), jnp.ones((4, 5, 5)))
    assert independent_lapack_calls(hlo.compile().as_text())


def test_the_cpu_only_tie_leaves_other_platforms_free_to_drop_its_dependency():
    # _ops.after_on_cpu: lstsq's jvp ties ds's SVD of R into its solves on CPU only, so that on
    # GPU a gradient of the solution alone runs no SVD of R (XLA drops what nothing uses).
    from jaxforge.primitives.linalg._ops import after_on_cpu

    f = jax.jit(lambda x, dep: after_on_cpu(x, jnp.sin(dep)))
    arg = jax.ShapeDtypeStruct((3, 3), jnp.float32)
    lowered = {p: jax.export.export(f, platforms=(p,))(arg, arg).mlir_module() for p in ("cpu", "cuda")}
    assert "stablehlo.sine" in lowered["cpu"] and "stablehlo.sine" not in lowered["cuda"]


@pytest.mark.parametrize("tie", ["cpu", "lifted"])
@pytest.mark.parametrize("m,n", [(24, 8), (8, 24)])
def test_a_gradient_of_the_solution_factors_a_once(m, n, tie, monkeypatch):
    """A compiled gradient of the solution reuses the forward's R: outside the conditionals (the
    rank certificate, the rank-deficient branch), the only QR is the forward's and no SVD runs
    (neither the forward's singular values nor ds's vectors, which nothing uses); on CPU, its LAPACK
    calls chained, as where the tie is lifted (``after_on_cpu`` off CPU)."""
    from jaxforge.primitives.linalg import lstsq as lstsq_rule

    if tie == "lifted":
        monkeypatch.setattr(lstsq_rule, "after_on_cpu", lambda x, dep: x)
    a, b = jnp.ones((4, m, n)), jnp.ones((4, m, 2))
    hlo = jax.jit(lstsq_programs(m, n)["grad"]).lower(a, b).compile().as_text()
    entry_name = re.search(r"^ENTRY %?([\w.\-]+) ", hlo, re.MULTILINE).group(1)
    entry = computations(hlo)[entry_name]
    targets = re.findall(r'custom_call_target="lapack_\w(\w+)_ffi"', "\n".join(text for text, _ in entry.values()))
    assert sorted(targets) == sorted(["geqrf", "trsm", "trsm"] + ["orgqr"] * (m < n)), targets
