"""Shape polymorphism (``jax.export`` with symbolic dims): every primitive exports with a symbolic
batch, attention with symbolic sequence lengths too, and the exported function run at several
sizes equals the function traced at each; where a kernel needs static shapes the default falls
back to the XLA lowering, and a call naming the kernel (or a symbolic matrix dim) is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxforge as jf

b, L, M = jax.export.symbolic_shape("b, L, M")
SIZES = ({"b": 2, "L": 5, "M": 9}, {"b": 1, "L": 37, "M": 70})
H, D = 4, 8


def spec(*shape, dtype=jnp.float64):
    return jax.ShapeDtypeStruct(shape, dtype)


def ids(*shape):
    return spec(*shape, dtype=jnp.int32)


def booleans(*shape):
    return spec(*shape, dtype=jnp.bool_)


def attend(mask=None, **kw):
    return lambda q, k: jf.attention(q, k, k, mask=mask, **kw)


def loss(fn):
    return lambda *args: jnp.sum(fn(*args) ** 2)


_CAUSAL = jf.masks.causal()
_BIAS = jnp.linspace(-1.0, 1.0, H * 99).reshape(H, 99)
# name: (function, argument specs)
CASES = {
    "attention batch": (attend(_CAUSAL, return_lse=True), spec(b, 16, H, D), spec(b, 16, 2, D)),
    "attention self": (attend(_CAUSAL), spec(2, L, H, D), spec(2, L, 2, D)),
    "attention cross": (attend(jf.masks.causal(3)), spec(2, L, H, D), spec(2, M, 1, D)),
    "attention batch and length": (attend(jf.masks.sliding_window(4) & _CAUSAL), spec(b, L, H, D), spec(b, L, 2, D)),
    "attention chunked | prefix": (attend(jf.masks.chunked(5) | jf.masks.prefix_lm(3)), spec(2, L, H, D), spec(2, L, H, D)),
    "attention per-item window | chunk, traced softcap": (
        lambda q, k, n: jf.attention(q, k, k, mask=jf.masks.sliding_window(n) & _CAUSAL | jf.masks.chunked(n + 2), softcap=1.0 + 0.5 * n[0]),
        spec(b, L, H, D),
        spec(b, L, 2, D),
        ids(b),
    ),
    "attention decoding": (attend(sinks=jnp.arange(H, dtype=jnp.float64)), spec(b, 1, H, D), spec(b, M, 1, D)),
    "attention score_mod": (
        attend(score_mod=lambda s, _, h, q_idx, kv_idx: s + _BIAS[h, jnp.clip(q_idx - kv_idx + 49, 0, 98)]),
        spec(2, L, H, D),
        spec(2, L, 2, D),
    ),
    "attention grad": (jax.grad(loss(attend(_CAUSAL)), argnums=(0, 1)), spec(b, L, H, D), spec(b, M, 2, D)),
    "attention jvp": (lambda q, k: jax.jvp(attend(), (q, k), (q, k)), spec(2, L, H, D), spec(2, M, 2, D)),
    "attention max scores jvp": (
        lambda q, k: jax.jvp(attend(_CAUSAL, return_max_scores=True), (q, k), (q, k)), spec(b, L, H, D), spec(b, M, 2, D)
    ),
    "attention hvp": (
        lambda q, k: jax.jvp(jax.grad(loss(attend(_CAUSAL))), (q, k), (q, k)),
        spec(2, L, H, D),
        spec(2, L, 2, D),
    ),
    "attention grad of jvp": (
        jax.grad(lambda q, k: jnp.sum(jax.jvp(attend(_CAUSAL), (q, k), (q, k))[1] ** 2)),
        spec(2, L, H, D),
        spec(2, L, 2, D),
    ),
    "attention vmap": (jax.vmap(attend(_CAUSAL)), spec(3, b, L, H, D), spec(3, b, L, 2, D)),
    "attention document": (
        jax.grad(lambda q, seg: jnp.sum(jf.attention(q, q, q, mask=jf.masks.document(seg) & _CAUSAL) ** 2)),
        spec(b, L, H, D),
        ids(b, L),
    ),
    "attention lengths": (
        lambda q, n: jf.attention(q, q, q, mask=jf.masks.padding(n, n) & jf.masks.causal(n - 2)),
        spec(b, L, H, D),
        ids(b),
    ),
    "attention mask array": (
        jax.grad(lambda q, k, visible: jnp.sum(jf.attention(q, k, k, mask=visible) ** 2)),
        spec(b, L, H, D),
        spec(b, M, 2, D),
        booleans(b, 1, L, M),
    ),
    "attention shared mask array and causal": (
        lambda q, visible: jf.attention(q, q, q, mask=jf.masks.from_array(visible) & _CAUSAL),
        spec(2, L, H, D),
        booleans(L, L),
    ),
    "svd batch": (lambda a: jf.linalg.svd(a), spec(b, 7, 5)),
    "svd grad": (jax.grad(lambda a: jnp.sum(jf.linalg.svd(a, compute_uv=False) ** 3)), spec(b, 5, 7)),
    "lstsq batch": (lambda a, y: tuple(jf.linalg.lstsq(a, y)), spec(b, 9, 4), spec(b, 9)),
    "lstsq grad": (jax.grad(lambda a, y: jnp.sum(jf.linalg.lstsq(a, y).solution ** 2), argnums=(0, 1)), spec(b, 4, 9), spec(b, 4, 2)),
}


def concrete(shape_spec, sizes, rng):
    shape = tuple(d if isinstance(d, int) else sizes[str(d)] for d in shape_spec.shape)
    if shape_spec.dtype == jnp.bool_:  # a mask array
        return rng.random(shape) < 0.6
    if jnp.issubdtype(shape_spec.dtype, jnp.integer):  # segment ids, or lengths within L
        high = 3 if len(shape) > 1 else sizes["L"] + 1
        return np.sort(rng.integers(0, high, shape), axis=-1).astype(shape_spec.dtype)
    return rng.standard_normal(shape).astype(shape_spec.dtype)


@pytest.mark.parametrize("name", sorted(CASES))
def test_exported_with_symbolic_dims_equals_each_size_traced(name):
    fn, *specs = CASES[name]
    exported = jax.export.export(jax.jit(fn))(*specs)
    rng = np.random.default_rng(0)
    for sizes in SIZES:
        args = [concrete(s, sizes, rng) for s in specs]
        got, want = jax.tree.leaves(exported.call(*args)), jax.tree.leaves(jax.jit(fn)(*args))
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):  # tiles differ between the two (symbolic lengths take whole ones)
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-10, err_msg=f"{name} at {sizes}")


def _cuda_module(fn, *specs) -> str:
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    return jax.export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=[triton])(*specs).mlir_module()


def test_gpu_default_runs_xla_tiles_where_a_dim_is_symbolic():
    """Triton grids cannot be symbolic: the GPU default lowers such calls to the XLA tiles (and
    the kernels where every dim is static)."""
    q, k = spec(b, 64, H, 64, dtype=jnp.bfloat16), spec(b, 64, 2, 64, dtype=jnp.bfloat16)
    assert "__gpu$xla.gpu.triton" not in _cuda_module(attend(_CAUSAL), q, k)
    static = spec(2, 64, H, 64, dtype=jnp.bfloat16), spec(2, 64, 2, 64, dtype=jnp.bfloat16)
    assert "__gpu$xla.gpu.triton" in _cuda_module(attend(_CAUSAL), *static)


@pytest.mark.parametrize("implementation", ["pallas_triton", "pallas_mosaic_gpu"])
def test_naming_a_kernel_with_symbolic_dims_is_refused(implementation):
    with pytest.raises(ValueError, match=f"implementation='{implementation}' needs static shapes.*use implementation=None or 'xla'"):
        jax.export.export(jax.jit(attend(implementation=implementation)))(spec(b, 16, H, D), spec(b, 16, H, D))


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (lambda a: jf.linalg.svd(a), [(L, 4)]),
        (lambda a, y: jf.linalg.lstsq(a, y), [(8, L), (8, 2)]),
        (lambda a, y: jf.linalg.lstsq(a, y), [(8, 4), (8, L)]),
    ],
)
def test_symbolic_matrix_dims_are_refused(fn, shapes):
    with pytest.raises(ValueError, match=r"must have static matrix dims, its last two .* got shape \("):
        jax.export.export(jax.jit(fn))(*(spec(*s) for s in shapes))
