"""Scalar functions applied to tiles with their captured arrays read at points (points.py), against
the same functions vmapped over the tile's elements (the flex semantics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from jaxforge.primitives._core import trace_function
from jaxforge.primitives.attention import points

rng = np.random.default_rng(0)
BIAS = jnp.asarray(rng.standard_normal((3, 11)))
TABLE = jnp.asarray(rng.random((2, 3, 5, 4)) > 0.5)
LENGTHS = jnp.asarray([7, 2])
SCALAR = jnp.asarray(0.25)
UNIT_AXIS = BIAS[:, None, :]


class StrictRef:
    """A ref that refuses addresses outside the array, as a GPU's memory would not."""

    def __init__(self, array):
        self.array, self.shape, self.dtype = array, array.shape, array.dtype

    def __getitem__(self, index):
        for i, n in zip(index, self.shape):
            assert 0 <= np.min(i) and np.max(i) < n, f"index {i} outside [0, {n})"
        return self.array[index]


# Functions of (score, b, h, q_idx, kv_idx) reading arrays as users write them.
READING = {
    "relative_bias_out_of_range": lambda s, b, h, i, j: s + BIAS[h, i - j + 3],  # clamped both ways
    "negative_indices": lambda s, b, h, i, j: s * BIAS[-1 - h, -j],
    "table_mask_and_lengths": lambda s, b, h, i, j: jnp.where(TABLE[b, h, i % 5, j % 4] & (j < LENGTHS[b]), s, -s),
    "scalar_and_clip": lambda s, b, h, i, j: s * SCALAR + BIAS[h, jnp.clip(i - j, 0, 10)],
    "index_read_from_an_array": lambda s, b, h, i, j: s + BIAS[h, LENGTHS[(i + j) % 2]],
    "row_then_element": lambda s, b, h, i, j: s + BIAS[h][i - j + 3],
    "column_then_element": lambda s, b, h, i, j: s + BIAS[:, j][-h],
    "views_of_a_table": lambda s, b, h, i, j: jnp.where(TABLE[b][h % 3][:, j % 4][i], s, BIAS[h][:][2 * j]),
    "slice_of_an_unsqueezed_row": lambda s, b, h, i, j: s
    + lax.dynamic_slice(lax.dynamic_slice(BIAS, (h, 0 * h), (1, 11)), (0 * h, i - j + 3), (1, 1))[0, 0],
    "unit_axis_squeezed": lambda s, b, h, i, j: s * jnp.squeeze(UNIT_AXIS[h])[i] + UNIT_AXIS[h][0][j],
}
SCALAR_ARGS = (jax.ShapeDtypeStruct((), jnp.float64), *(jax.ShapeDtypeStruct((), jnp.int32),) * 4)


def tiles():
    score = jnp.asarray(rng.standard_normal((9, 12)))
    q_idx, kv_idx = jnp.arange(9, dtype=jnp.int32)[:, None], jnp.arange(12, dtype=jnp.int32)[None, :]
    return score, jnp.int32(1), jnp.int32(2), q_idx, kv_idx


@pytest.mark.parametrize("name", sorted(READING))
def test_points_match_the_vmapped_function_and_stay_inside_the_arrays(name):
    fn, consts = trace_function(READING[name], *SCALAR_ARGS)
    assert points.reads_points(fn)
    args = tiles()
    got = points.evaluate(fn, *args, *(points.PointArray(StrictRef(c)) for c in consts))
    want = jax.vmap(jax.vmap(READING[name]))(*jnp.broadcast_arrays(*args))
    np.testing.assert_array_equal(jnp.broadcast_to(got, want.shape), want)


TANGENT_READS = {
    "point": lambda s, b, h, i, j: s * BIAS[h, i - j + 3] ** 2,
    "row_then_element": lambda s, b, h, i, j: s * BIAS[h][i - j + 3] ** 2 + BIAS[:, j][h],
}


@pytest.mark.parametrize("name", sorted(TANGENT_READS))
def test_a_read_tangent_is_the_tangent_array_read_at_the_same_point(name):
    fn, (bias,) = trace_function(TANGENT_READS[name], *SCALAR_ARGS)
    dbias = jnp.asarray(rng.standard_normal(bias.shape))
    args = tiles()

    def with_refs(direction):
        array = points.PointArray(StrictRef(bias)).with_tangent(points.PointArray(StrictRef(dbias)), direction)
        return points.evaluate(fn, *args, array)

    _, got = jax.jvp(with_refs, (0.0,), (1.0,))
    _, want = jax.jvp(lambda x: jax.vmap(jax.vmap(lambda *a: fn(*a, x)[0]))(*jnp.broadcast_arrays(*args)), (bias,), (dbias,))
    np.testing.assert_allclose(got, want, rtol=1e-14)


GATHERING = {
    "fill_mode_take": lambda s, b, h, i, j: s + jnp.take(BIAS[h], i - j, mode="fill", fill_value=0.0),
    "row_reduction": lambda s, b, h, i, j: s + jnp.max(BIAS[h]),
    "whole_array_arithmetic": lambda s, b, h, i, j: s + (2 * BIAS)[h, j],
    "row_arithmetic": lambda s, b, h, i, j: s + (2 * BIAS[h])[j],
    "row_reshaped": lambda s, b, h, i, j: s + BIAS[h].reshape(1, -1)[0, j],
}


@pytest.mark.parametrize("name", sorted(GATHERING))
def test_functions_reading_more_than_points_are_refused(name):
    fn, _ = trace_function(GATHERING[name], *SCALAR_ARGS)
    assert not points.reads_points(fn)
