"""The shared gather suite and its test base, run against every registered implementation: the
NumPy ground truth the other gather file imports, every mode, dtype, index and shape, the
transformations, configs and bad input. Gradients and the scatter-add kernels' schedules are
in test_gather_backward.py.

Ground truth is NumPy: indices are normalized with Python integers (no dtype can overflow), rows
taken with `np.take`, gradients scattered with `np.add.at` in float64. A gather copies values,
so forward results must match exactly; gradients (sums) use the tolerance rule.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import registry
from kernels.gather import GatherConfig, gather
from kernels.reference.gather import default_fill_value, gather as reference_gather
from tests.support import (SUPPORTS_FLOAT64, Contract, as_f64, assert_close, implementations_of,
                           random, x64)

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")

MODES = (None, "promise_in_bounds", "clip", "drop", "fill", "wrap")
CLAMPING = (None, "promise_in_bounds", "clip")
FILLING = ("drop", "fill")
# In range, -1, -n, -n-1, n, n+1, the int32 extremes, duplicates: for an axis of 10.
SPECIAL_INDICES = [0, 3, -1, -10, -11, 10, 11, 2**31 - 1, -2**31, 3, 3, 9]


def _ids(value):
    return jnp.dtype(value).name if isinstance(value, type) else repr(value)


# ---------------------------------------------------------------- NumPy ground truth


def _rows(indices, n: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(row in [0, n), in range) per index, in Python integers."""
    i = np.asarray(indices).astype(object)
    if rule == "wrap":
        return np.mod(i, n).astype(np.int64), np.ones(i.shape, bool)
    i = np.where(i < 0, i + n, i)
    in_range = ((i >= 0) & (i < n)).astype(bool)
    return np.minimum(np.maximum(i, 0), n - 1).astype(np.int64), in_range


def _default_fill(dtype):
    return default_fill_value(dtype)


def expected_gather(x, indices, axis=0, mode=None, fill_value=None) -> np.ndarray:
    x = np.asarray(x)
    axis %= x.ndim
    rows, in_range = _rows(indices, x.shape[axis], "wrap" if mode == "wrap" else "clip")
    out = np.take(x, rows, axis=axis)
    if mode in FILLING:
        fill = _default_fill(x.dtype) if fill_value is None else fill_value
        fill = np.asarray(fill).astype(x.dtype)
        mask = in_range.reshape((1,) * axis + in_range.shape + (1,) * (x.ndim - axis - 1))
        out = np.where(mask, out, fill)
    return out


def expected_gradient(x_shape, ct, indices, axis=0, mode=None) -> np.ndarray:
    """float64 scatter-add of cotangent `ct` with JAX's backward rule for `mode`."""
    axis %= len(x_shape)
    rows, in_range = _rows(indices, x_shape[axis], "wrap" if mode == "wrap" else "clip")
    keep = np.ones_like(in_range) if mode in ("clip", "wrap") else in_range
    rows, keep = rows.reshape(-1), keep.reshape(-1)
    ct = as_f64(ct).reshape(x_shape[:axis] + (rows.size,) + x_shape[axis + 1:])
    dx = np.zeros(x_shape, np.float64)
    np.add.at(np.moveaxis(dx, axis, 0), rows[keep], np.moveaxis(ct, axis, 0)[keep])
    return dx


def assert_exact(actual, expected) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if jnp.issubdtype(actual.dtype, jnp.inexact):  # NumPy's NaN == NaN rule misses bfloat16
        actual, expected = as_f64(actual), as_f64(expected)
    np.testing.assert_array_equal(actual, expected)


def check_gather(implementation, x, indices, axis=0, mode=None, fill_value=None, **kwargs):
    out = gather(x, indices, axis=axis, mode=mode, fill_value=fill_value,
                 implementation=implementation, **kwargs)
    assert_exact(out, expected_gather(x, indices, axis, mode, fill_value))
    return out


# ---------------------------------------------------------------- forward semantics


@pytest.mark.parametrize("given_fill", [False, True], ids=["default_fill", "fill_7"])
@pytest.mark.parametrize("mode", MODES, ids=_ids)
def test_every_mode_and_index_value(implementation, mode, given_fill):
    x = random((10, 3), jnp.float32, seed=1)
    indices = jnp.asarray(SPECIAL_INDICES, jnp.int32)
    check_gather(implementation, x, indices, mode=mode, fill_value=7.0 if given_fill else None)


def test_matches_jax_where_jax_is_right(implementation):
    x = random((10, 3), jnp.float32, seed=2)
    indices = jnp.asarray(SPECIAL_INDICES, jnp.int32)
    for mode in MODES[:-1]:
        expected = x.at[indices].get(mode=mode)
        assert_exact(gather(x, indices, mode=mode, implementation=implementation), expected)
    assert_exact(gather(x, indices, mode="wrap", implementation=implementation),
                 jnp.take(x, indices, axis=0, mode="wrap"))


TABLE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.int32, jnp.uint8,
                jnp.bool_)


@pytest.mark.parametrize("dtype", TABLE_DTYPES, ids=_ids)
def test_table_dtypes(implementation, dtype):
    x = jnp.asarray((np.arange(36).reshape(12, 3) % 7 - 2).astype(jnp.dtype(dtype)))
    indices = jnp.asarray([5, -1, 12, -13, 0, 11, 2**31 - 1], jnp.int32)
    for mode in (None, "fill", "wrap"):  # "fill": the dtype's default fill value
        check_gather(implementation, x, indices, mode=mode)


def test_float64_and_64_bit_tables(implementation):
    with x64():
        for dtype in (jnp.float64, jnp.int64):
            x = random((11, 4), jnp.float64, seed=3).astype(dtype)
            indices = jnp.asarray([3, -1, 11, -12, 2**40], jnp.int64)
            if not SUPPORTS_FLOAT64[implementation]:
                with pytest.raises(NotImplementedError,
                                   match=f"{implementation}: {jnp.dtype(dtype).name}"):
                    gather(x, indices, implementation=implementation)
                continue
            for mode in ("clip", "fill", "wrap"):
                check_gather(implementation, x, indices, mode=mode)


def test_fill_values_convert_like_jax(implementation):
    cases = [(jnp.uint8, -1), (jnp.int32, 7.9), (jnp.bool_, 0), (jnp.float32, np.inf),
             (jnp.bfloat16, -2.5), (jnp.int8, -128)]
    indices = jnp.asarray([0, 4, -5], jnp.int32)
    for dtype, fill in cases:
        x = jnp.ones((4, 2), dtype)
        out = gather(x, indices, mode="fill", fill_value=fill, implementation=implementation)
        assert_exact(out, x.at[indices].get(mode="fill", fill_value=fill))


# (index dtype, table rows, indices): narrow dtypes into long axes, where JAX itself overflows.
INDEX_CASES = [
    (jnp.int8, 300, [-100, 100, 127, -128, -1, 0]),
    (jnp.uint8, 300, [255, 0, 17]),
    (jnp.int16, 300, [-300, -301, 299, 300, 32767, -32768]),
    (jnp.uint16, 20, [65535, 19, 20]),
    (jnp.int32, 20, [-20, -21, 19, 20, 2**31 - 1, -2**31]),
    (jnp.uint32, 20, [2**32 - 1, 3_000_000_000, 19, 20]),
]
INDEX_CASES_X64 = [
    (jnp.int64, 20, [2**40, -2**40, -2**63, 2**63 - 1, -20, 19, -21]),
    (jnp.uint64, 20, [2**64 - 1, 2**63, 19, 20]),
]


def _check_index_case(implementation, dtype, n, values):
    x = random((n, 2), jnp.float32, seed=4)
    indices = jnp.asarray(np.array(values, dtype=jnp.dtype(dtype)))
    for mode in ("clip", "fill", "wrap"):
        check_gather(implementation, x, indices, mode=mode)


@pytest.mark.parametrize("dtype,n,values", INDEX_CASES,
                         ids=[jnp.dtype(c[0]).name for c in INDEX_CASES])
def test_index_dtypes_never_overflow(implementation, dtype, n, values):
    _check_index_case(implementation, dtype, n, values)


@pytest.mark.parametrize("dtype,n,values", INDEX_CASES_X64,
                         ids=[jnp.dtype(c[0]).name for c in INDEX_CASES_X64])
def test_64_bit_index_dtypes_never_overflow(implementation, dtype, n, values):
    with x64():
        _check_index_case(implementation, dtype, n, values)


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (0,), (2, 0)], ids=str)
def test_index_shapes(implementation, shape):
    x = random((7, 6), jnp.float32, seed=5)
    values = np.random.default_rng(6).integers(-9, 9, size=shape)
    indices = jnp.asarray(values, jnp.int32)
    for axis in (0, 1):
        out = check_gather(implementation, x, indices, axis=axis, mode="fill")
        chex.assert_shape(out, x.shape[:axis] + shape + x.shape[axis + 1:])


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
def test_axes(implementation, axis):
    x = random((4, 5, 6), jnp.float32, seed=7)
    indices = jnp.asarray([[0, -1, 6, 2], [-7, 3, 3, 5]], jnp.int32)
    for mode in ("fill", "clip"):
        check_gather(implementation, x, indices, axis=axis, mode=mode)


@pytest.mark.parametrize("shape,num_indices", [((1, 1), 3), ((10,), 4), ((1000, 129), 300)],
                         ids=str)
def test_table_shapes(implementation, shape, num_indices):
    x = random(shape, jnp.float32, seed=8)
    n = shape[0]
    indices = jnp.asarray(np.random.default_rng(9).integers(-n - 2, n + 2, num_indices),
                          jnp.int32)
    check_gather(implementation, x, indices, mode="fill")
    check_gather(implementation, x, indices, mode=None)


# Mosaic and Mosaic GPU are left out: their simulators copy each of the 2048 rows apart (TPU
# interpret mode: minutes; Mosaic GPU's interpreter: 10 s, beside its ring and pieces tests).
@pytest.mark.parametrize("implementation", [name for name in implementations_of("gather")
                                            if registry.get(name).fast_interpreter
                                            and name != "mosaic"])
def test_embedding_table_with_2048_ids(implementation):
    x = random((32000, 512), jnp.bfloat16, seed=10)
    indices = jnp.asarray(np.random.default_rng(11).integers(-32000, 32000, 2048), jnp.int32)
    check_gather(implementation, x, indices)


# The backward at embedding size runs for minutes interpreted (one program per table row, each
# carrying the whole table through the interpreter's loop), so kernels use 1000 rows here.
@pytest.mark.parametrize("mode", [None, "clip"], ids=_ids)
def test_gradient_of_a_1000_row_table(implementation, mode):
    x = random((1000, 129), jnp.float32, seed=29)
    # 200 indices: more than one 128-index chunk of the Mosaic backward.
    indices = jnp.asarray(np.random.default_rng(30).integers(-1010, 1010, 200), jnp.int32)
    ct = random((200, 129), jnp.float32, seed=31)
    dx = jax.vjp(lambda x: gather(x, indices, mode=mode, implementation=implementation),
                 x)[1](ct)[0]
    assert_close(dx, expected_gradient(x.shape, ct, indices, 0, mode), jnp.float32,
                 reduction_length=20)


def test_size_zero_dims(implementation):
    x = jnp.ones((10, 0), jnp.float32)
    indices = jnp.asarray([1, 2, 30], jnp.int32)
    assert gather(x, indices, implementation=implementation).shape == (3, 0)
    empty_axis = jnp.ones((3, 0), jnp.float32)
    out = gather(empty_axis, jnp.zeros((0,), jnp.int32), axis=1, implementation=implementation)
    assert out.shape == (3, 0)


def test_nan_and_inf_are_copied(implementation):
    x = jnp.asarray([[np.nan, 1.0], [np.inf, -np.inf]], jnp.float32)
    check_gather(implementation, x, jnp.asarray([1, 0, 2], jnp.int32), mode="fill",
                 fill_value=3.0)


# ---------------------------------------------------------------- transformations


# jit and eager, no retrace, vmap of every operand: tests/test_contract.py, from this contract.
CONTRACT = Contract(
    call=lambda impl: lambda x, i: gather(x, i, axis=0, mode="fill", implementation=impl),
    example=lambda: (random((9, 5), jnp.float32, seed=24),
                     jnp.asarray([[8, -1], [9, 0]], jnp.int32)),
    repeated=lambda seed: (random((6, 4), jnp.float32, seed),
                           jnp.asarray([seed, -1 - seed, 6 + seed], jnp.int32)),
    check=lambda out, x, i, implementation: assert_exact(out, expected_gather(x, i, 0, "fill")),
    small=lambda **kw: gather(jnp.ones((5, 3)), jnp.asarray([1, 2]), **kw))


def test_vmap(implementation):
    x = random((3, 9, 5), jnp.float32, seed=25)
    indices = jnp.asarray([[8, -1, 9], [0, 2, -10], [4, 4, 4]], jnp.int32)
    def fn(x, i):
        return gather(x, i, mode="fill", implementation=implementation)
    out = jax.vmap(fn)(x, indices)
    expected = np.stack([expected_gather(x[k], indices[k], 0, "fill") for k in range(3)])
    assert_exact(out, expected)
    out = jax.vmap(fn, in_axes=(None, 0))(x[0], indices)
    assert_exact(out, expected_gather(x[0], indices, 0, "fill"))
    ct = random((3, 3, 5), jnp.float32, seed=32)
    grads = jax.vmap(lambda x, i, ct: jax.vjp(lambda x: fn(x, i), x)[1](ct)[0])(x, indices, ct)
    for k in range(3):
        assert_close(grads[k], expected_gradient(x.shape[1:], ct[k], indices[k], 0, "fill"),
                     jnp.float32, reduction_length=3)


def test_no_retracing_with_nan_fill(implementation):
    traces = []

    @jax.jit
    def fn(x, i):
        traces.append(1)
        return gather(x, i, mode="fill", implementation=implementation)

    x, indices = random((4, 2), jnp.float32), jnp.asarray([0, 7], jnp.int32)
    fn(x, indices), fn(x + 1, indices + 1)
    assert len(traces) == 1


# ---------------------------------------------------------------- configs and bad input


def test_small_blocks_config(implementation):
    x = random((3, 40, 256), jnp.float32, seed=26)
    indices = jnp.asarray(np.random.default_rng(27).integers(-45, 45, 13), jnp.int32)
    configs = {"triton": GatherConfig(block_indices=4, block_columns=64, num_warps=2),
               "mosaic": GatherConfig(block_batch=2, block_rows=16,
                                      block_columns=128)}
    config = configs.get(implementation)
    check_gather(implementation, x, indices, axis=1, mode="fill", config=config)
    ct = random((3, 13, 256), jnp.float32, seed=28)
    dx = jax.vjp(lambda x: gather(x, indices, axis=1, implementation=implementation,
                                  config=config), x)[1](ct)[0]
    assert_close(dx, expected_gradient(x.shape, ct, indices, 1, None), jnp.float32,
                 reduction_length=13)


@pytest.mark.parametrize("kernel,config,field", [
    ("triton", GatherConfig(block_indices=3), "block_indices"),
    ("triton", GatherConfig(block_columns=0), "block_columns"),
    ("mosaic", GatherConfig(block_columns=100), "block_columns"),
    ("mosaic", GatherConfig(block_rows=5), "block_rows"),
    ("mosaic", GatherConfig(block_indices=64), "block_indices"),
    ("mosaic", GatherConfig(block_batch=-1), "block_batch"),
])
def test_invalid_config(kernel, config, field):
    x, indices = jnp.ones((40, 256), jnp.float32), jnp.asarray([1], jnp.int32)
    with pytest.raises(ValueError, match=f"config.{field}"):
        gather(x, indices, implementation=kernel, config=config)


def test_bad_input(implementation):
    x, indices = jnp.ones((5, 3)), jnp.asarray([1, 2], jnp.int32)
    def call(x=x, i=indices, **kw):
        return gather(x, i, implementation=implementation, **kw)
    with pytest.raises(TypeError, match="indices.*float32"):
        call(i=jnp.asarray([1.0]))
    with pytest.raises(TypeError, match="indices.*bool"):
        call(i=jnp.asarray([True]))
    with pytest.raises(ValueError, match="mode.*'nearest'"):
        call(mode="nearest")
    with pytest.raises(ValueError, match="axis 2"):
        call(axis=2)
    with pytest.raises(ValueError, match="axis -3"):
        call(axis=-3)
    with pytest.raises(ValueError, match="x must have rank >= 1"):
        call(x=jnp.float32(1.0))
    with pytest.raises(ValueError, match="size 0"):
        call(x=jnp.ones((0, 3)))
    # A bad implementation, interpret or config type: tests/test_contract.py, for every op.


def test_reference_bad_input():
    with pytest.raises(TypeError, match="indices"):
        reference_gather(jnp.ones(3), jnp.asarray([0.5]))
    with pytest.raises(ValueError, match="mode"):
        reference_gather(jnp.ones(3), jnp.asarray([0]), mode="raise")


def test_default_implementation_is_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    x, indices = random((4, 2), jnp.float32), jnp.asarray([3, -1], jnp.int32)
    assert_exact(gather(x, indices), expected_gather(x, indices))



@pytest.mark.parametrize("mode,expected_row", [("fill", None), ("clip", 5), ("wrap", 1),
                                               (None, 5)])
def test_numpy_int64_indices_keep_their_meaning_with_x64_off(implementation, mode, expected_row):
    # jnp.asarray would truncate 2**32 + 3 to 3 (JAX only warns); the op saturates on the host.
    assert not jax.config.jax_enable_x64
    x = random((6, 4), jnp.float32, seed=40)
    indices = np.array([2**32 + 3, -(2**40), 2], np.int64)
    out = gather(x, indices, mode=mode, implementation=implementation)
    expected = reference_gather(x, indices, mode=mode)
    chex.assert_trees_all_equal(np.asarray(out), np.asarray(expected))
    if expected_row is None:
        assert np.isnan(np.asarray(out[:2])).all()
    else:
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(x[expected_row]))
    np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(x[2]))


def test_triton_declines_tables_past_int32_offsets():
    # 2**31 one-byte elements: within Pallas's 32-bit byte addressing, past int32 offsets.
    table = jax.ShapeDtypeStruct((2**16, 2**15), jnp.int8)
    indices = jax.ShapeDtypeStruct((4,), jnp.int32)
    with pytest.raises(NotImplementedError, match=r"x has 2147483648 elements; the kernel's "
                                                  r"int32 offsets"):
        jax.eval_shape(lambda x, i: gather(x, i, implementation="triton"), table, indices)
    out = jax.eval_shape(lambda x, i: gather(x, i, implementation=("triton", "xla")), table,
                         indices)
    assert out.shape == (4, 2**15)


@pytest.mark.parametrize("implementation", implementations_of("gather"))
@pytest.mark.parametrize("mode", ["wrap", "clip", "fill"])
def test_a_one_device_explicit_mesh(mode, implementation):
    """On a mesh of Explicit axes of one device, the table sharded by columns and the ids by
    data: out-of-range ids keep their mode's answer as with no mesh (`jnp.take` has no
    out_sharding, so xla applies wrap to the ids first: it was clipped, 12 reading row 9
    instead of row 2); the kernels run in shard_map there too (the operands' types name mesh
    axes, which Pallas refuses: sharded refs, non-Manual axes); the output has the ids' and the
    table's columns' sharding."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    table = random((10, 4), jnp.float32, seed=3)
    ids = np.array([-13, 12, 25, 3, -1, 9], np.int32)
    op = functools.partial(gather, mode=mode, fill_value=-2.0, implementation=implementation)
    with jax.set_mesh(mesh):
        x = jax.device_put(table, NamedSharding(mesh, P(None, "model")))
        i = jax.device_put(jnp.asarray(ids), NamedSharding(mesh, P("data")))
        got = op(x, i)
        dx = jax.grad(lambda x: jnp.sum(op(x, i)))(x)
    assert got.sharding.spec == P("data", "model")
    # The same gather with no mesh: JAX's answer for the mode (checked against NumPy above).
    expected = reference_gather(table, ids, mode=mode, fill_value=-2.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert_close(dx, expected_gradient(table.shape, np.ones((6, 4)), ids, 0, mode),
                 jnp.float32, reduction_length=len(ids))
