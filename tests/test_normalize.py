"""The shared normalize suite (layer norm, RMS norm, standardization) and its test base: the
helpers the other normalize files import (`_inputs`, `_check`, `_ground_truth`) and the forward's
values against float64 truth, run for every registered implementation (xla, triton interpreted,
mosaic in strict TPU interpret mode). The kernels' schedules are in test_normalize_schedules.py,
gradients in test_normalize_backward.py, the fused residual add in test_normalize_residual.py.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.normalize import NormalizeConfig, layer_norm, normalize, rms_norm
from kernels.reference.normalize import (layer_norm as reference_layer_norm,
                                 normalize as reference_normalize, rms_norm as reference_rms_norm)
from tests.support import (FLOAT_DTYPES, SUPPORTS_FLOAT64, Contract, as_f64, assert_close,
                           implementations_of, kernels_of, random, tolerance, weighted_sum,
                           x64)

KERNELS = kernels_of("normalize")  # this op's kernels (`tests.support.implementations_of`)

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")


def _param_shape(shape, axis):
    axes = (axis,) if isinstance(axis, int) else axis
    return tuple(shape[a] for a in sorted(a % len(shape) for a in axes))


def _group_size(shape, axis) -> int:
    return int(np.prod(_param_shape(shape, axis), dtype=np.int64))


def _ground_truth(x, scale=None, offset=None, **kwargs) -> np.ndarray:
    """The reference evaluated in float64 on the (rounded) inputs."""
    with x64():
        args = [None if a is None else jnp.asarray(as_f64(a)) for a in (x, scale, offset)]
        return np.asarray(reference_normalize(*args, **kwargs))


def _inputs(shape, axis, dtype, seed=0, param_dtype=jnp.float32):
    x = random(shape, dtype, seed)
    pshape = _param_shape(shape, axis)
    scale = random(pshape, param_dtype, seed + 1) + 1
    offset = random(pshape, param_dtype, seed + 2)
    return x, scale, offset


def _check(y, x, scale, offset, **kwargs):
    expected = _ground_truth(x, scale, offset, **kwargs)
    chex.assert_shape(y, x.shape)
    assert y.dtype == x.dtype
    assert_close(y, expected, x.dtype, reduction_length=_group_size(x.shape, kwargs["axis"]))


# (shape, axis): not multiples of any block; a row that is one 8192-element Triton chunk (5000);
# long rows that loop over chunks (65536); the tutorial's axis-0 standardization; several axes,
# negative axes, non-contiguous axes (the one layout that transposes).
CASES = [((1, 1), -1), ((3, 7), -1), ((129, 1000), -1), ((4, 33, 4096), -1), ((3, 5000), -1),
         ((2, 65536), -1), ((10000, 100), 0), ((3, 5, 33), (1, 2)), ((6, 20, 7), -2),
         ((4, 9, 6), (0, 2)), ((2, 3, 4, 5), (-3, -2))]


# Mosaic GPU's interpreter is slow (registry: no fast interpreter): its kernels skip the largest
# cases, whose paths smaller ones take too: streamed rows (65536; `CHUNKED` below), resident
# rows of many pieces (4096; 1000 and 5000 here) and the columns layout (axis 0; (300, 37) in
# test_16_bit_dtypes).
SLOW_CASES = {"mosaic_gpu": [((4, 33, 4096), -1), ((2, 65536), -1), ((10000, 100), 0)]}


@pytest.mark.parametrize("implementation,shape,axis", [
    (impl, *case) for impl in implementations_of("normalize") for case in CASES
    if case not in SLOW_CASES.get(impl, [])], ids=str)
def test_matches_float64_ground_truth(implementation, shape, axis):
    x, scale, offset = _inputs(shape, axis, jnp.float32)
    y = normalize(x, scale, offset, axis=axis, implementation=implementation)
    _check(y, x, scale, offset, axis=axis)


@pytest.mark.parametrize("shape,axis", [((129, 1000), -1), ((300, 37), 0), ((5, 2, 7), (0, 2))],
                         ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=lambda d: jnp.dtype(d).name)
def test_16_bit_dtypes(implementation, shape, axis, dtype):
    x, scale, offset = _inputs(shape, axis, dtype, seed=3)
    y = normalize(x, scale, offset, axis=axis, implementation=implementation)
    _check(y, x, scale, offset, axis=axis)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("epsilon", [0.0, 1e-5])
@pytest.mark.parametrize("params", ["none", "scale", "offset", "both"])
def test_options(implementation, subtract_mean, epsilon, params):
    shape, axis = (19, 45), -1
    x, scale, offset = _inputs(shape, axis, jnp.float32, seed=4)
    scale = scale if params in ("scale", "both") else None
    offset = offset if params in ("offset", "both") else None
    kwargs = dict(axis=axis, epsilon=epsilon, subtract_mean=subtract_mean)
    y = normalize(x, scale, offset, implementation=implementation, **kwargs)
    _check(y, x, scale, offset, **kwargs)


# Groups longer than one block, with a ragged last chunk, for each layout: the chunked paths
# (merged moments, two-phase Mosaic grid; Triton's backward: two chunks (200) summed in its
# programs, three (300) by a sums pass) at sizes the interpreters run quickly. In the columns
# layout a Mosaic chunk with scale/offset is a multiple of 128 (the parameters' lane dim).
CHUNKED = [((20, 300), -1, NormalizeConfig(block_groups=16, block_reduced=128)),
           ((20, 200), -1, NormalizeConfig(block_groups=16, block_reduced=128)),
           ((300, 20), 0, NormalizeConfig(block_groups=20, block_reduced=128)),
           ((2, 300, 130), 1, NormalizeConfig(block_groups=128, block_reduced=128))]


def _case_id(value) -> str:
    if isinstance(value, NormalizeConfig):
        return f"blocks{value.block_groups}x{value.block_reduced}"
    return str(value)


def _chunked_config(implementation, config):
    if implementation == "triton":  # Triton blocks are powers of 2
        return NormalizeConfig(block_groups=1 << (config.block_groups - 1).bit_length(),
                               block_reduced=config.block_reduced)
    if implementation == "mosaic_gpu":  # rows a CTA streams, within its shared memory
        return NormalizeConfig(block_groups=min(config.block_groups, 16),
                               block_reduced=config.block_reduced)
    return config


@pytest.mark.parametrize("implementation", KERNELS)  # the config means nothing to xla
@pytest.mark.parametrize("shape,axis,config,subtract_mean", [
    *((*case, True) for case in CHUNKED),
    # RMS norm skips the mean in the same chunked schedule: one shape of it.
    (*CHUNKED[1], False)], ids=lambda v: ("layer" if v else "rms") if isinstance(v, bool) else _case_id(v))
def test_groups_longer_than_one_block(implementation, shape, axis, config, subtract_mean):
    config = _chunked_config(implementation, config)
    x, scale, offset = _inputs(shape, axis, jnp.float32, seed=5)
    kwargs = dict(axis=axis, subtract_mean=subtract_mean)

    def loss(f, **kw):  # (loss, y): one jitted program computes the output and its gradients
        def fn(x, s, o):
            y = f(x, s, o, **kwargs, **kw)
            return weighted_sum(y), y
        return jax.jit(jax.grad(fn, argnums=(0, 1, 2), has_aux=True))

    grads, y = loss(normalize, implementation=implementation, config=config)(x, scale, offset)
    _check(y, x, scale, offset, **kwargs)
    want, _ = loss(reference_normalize)(x, scale, offset)
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=x.size)


# Each Triton schedule (kernels/normalize/triton/__init__.py, "Programs vs the GPU") at a size the
# interpreter runs quickly: long groups with enough group blocks for one wave (fused, looped
# chunks); too few blocks, so the reduced axis is split, several chunks per split with a
# shorter last split (rows and columns layouts, ragged chunks and group blocks).
TRITON_SCHEDULES = [((132, 40), -1, NormalizeConfig(block_groups=1, block_reduced=16), "fused"),
                    ((1, 2210), -1, NormalizeConfig(block_groups=1, block_reduced=4), "split"),
                    ((301, 3), 0, NormalizeConfig(block_groups=2, block_reduced=1), "split")]


def _large_mean(shape):
    return jnp.asarray((1e4 + np.random.default_rng(6).standard_normal(shape)).astype(np.float32))


@pytest.mark.parametrize("shape,axis", [((64, 1000), -1), ((1000, 16), 0)], ids=str)
def test_large_mean_small_spread(implementation, shape, axis):
    """1e4 + N(0, 1): E[x²] - E[x]² would cancel catastrophically (float32 holds 1e8 to within
    8); the mean-first statistics keep the error at float32's resolution of the data."""
    x = _large_mean(shape)
    y = normalize(x, axis=axis, implementation=implementation)
    expected = _ground_truth(x, axis=axis)
    # The inputs' magnitude is 1e4 times their spread: the mean (and so y) can be no more
    # accurate than float32's roundings of 1e4-sized partial sums, so the tolerance scales by
    # that ratio; the sums are trees, log2(n) roundings deep. (E[x²] - E[x]² gives NaN here.)
    condition = float(jnp.max(jnp.abs(x))) / float(np.std(as_f64(x)))
    depth = int(np.ceil(np.log2(_group_size(shape, axis))))
    tol = tolerance(jnp.float32, reduction_length=depth)
    chex.assert_trees_all_close(as_f64(y), expected, rtol=tol["rtol"],
                                atol=tol["atol"] * condition)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("shape,axis", [((6, 40), -1), ((40, 6), 0)], ids=str)
def test_constant_groups_with_zero_epsilon(implementation, subtract_mean, shape, axis):
    """Constant groups have var = 0: with epsilon = 0 the reference gives 0·inf = NaN (layer
    norm) or x/|x| (RMS, NaN for all-zero groups); the kernels give NaN exactly there."""
    x = np.array(random(shape, jnp.float32, 7))
    if axis == -1:
        x[1], x[4] = 3.0, 0.0
    else:
        x[:, 1], x[:, 4] = 3.0, 0.0
    x = jnp.asarray(x)
    kwargs = dict(axis=axis, epsilon=0.0, subtract_mean=subtract_mean)
    y = normalize(x, implementation=implementation, **kwargs)
    want = reference_normalize(x, **kwargs)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    assert np.isnan(want).any()
    finite = ~np.isnan(want)
    assert_close(np.asarray(y)[finite], _ground_truth(x, **kwargs)[finite], jnp.float32,
                 reduction_length=40)


@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_nan_and_inf_propagate(implementation, subtract_mean, axis):
    x = random((9, 20), jnp.float32, 8).at[2, 3].set(jnp.nan).at[5, 7].set(jnp.inf)
    x = x.at[7, 11].set(-jnp.inf)
    kwargs = dict(axis=axis, subtract_mean=subtract_mean)
    y = normalize(x, implementation=implementation, **kwargs)
    want = reference_normalize(x, **kwargs)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(want))
    finite = np.isfinite(want)
    assert_close(np.asarray(y)[finite], np.asarray(want)[finite], jnp.float32,
                 reduction_length=20)


def test_float64(implementation):
    with x64():
        x, scale, offset = _inputs((33, 250), -1, jnp.float64, seed=9,
                                   param_dtype=jnp.float64)
        if not SUPPORTS_FLOAT64[implementation]:
            with pytest.raises(NotImplementedError, match=f"{implementation}: float64"):
                normalize(x, scale, offset, implementation=implementation)
            return
        for axis in (-1, 0):
            x, scale, offset = _inputs((33, 250), axis, jnp.float64, seed=9,
                                       param_dtype=jnp.float64)
            y = normalize(x, scale, offset, axis=axis, implementation=implementation)
            _check(y, x, scale, offset, axis=axis)


def test_declining_kernel_falls_through_to_xla():
    with x64():
        x = random((8, 9), jnp.float64, 1)
        y = normalize(x, implementation=("mosaic", "xla"))
        _check(y, x, None, None, axis=-1)


@pytest.mark.parametrize("x_dtype,param_dtype", [(jnp.float32, jnp.bfloat16),
                                                 (jnp.float16, jnp.bfloat16)],
                         ids=["f32-bf16", "f16-bf16"])
def test_parameter_dtypes(implementation, x_dtype, param_dtype):
    """The output has x's dtype whatever scale's; scale's gradient has scale's dtype."""
    x, scale, offset = _inputs((12, 50), -1, x_dtype, seed=10, param_dtype=param_dtype)
    y = normalize(x, scale, offset, implementation=implementation)
    _check(y, x, scale, offset, axis=-1)
    loss = lambda s: jnp.sum(normalize(x, s, offset, implementation=implementation)
                             .astype(jnp.float32))
    assert jax.grad(loss)(scale).dtype == scale.dtype


def test_empty(implementation):
    for shape, axis in (((0, 5), -1), ((5, 0), -1), ((2, 0, 3), (0, 2))):
        x = jnp.zeros(shape)
        fn = jax.jit(lambda x: normalize(x, axis=axis, implementation=implementation))
        chex.assert_shape(fn(x), shape)
        chex.assert_shape(jax.jit(jax.grad(lambda x: jnp.sum(fn(x))))(x), shape)


def test_aliases(implementation):
    x, scale, offset = _inputs((7, 90), -1, jnp.float32, seed=11)
    y = layer_norm(x, scale, offset, implementation=implementation)
    _check(y, x, scale, offset, axis=-1, epsilon=1e-5)
    y = rms_norm(x, scale, implementation=implementation)
    _check(y, x, scale, None, axis=-1, epsilon=1e-6, subtract_mean=False)
    chex.assert_trees_all_close(reference_layer_norm(x, scale, offset),
                                reference_normalize(x, scale, offset))
    chex.assert_trees_all_close(reference_rms_norm(x, scale),
                                reference_normalize(x, scale, epsilon=1e-6, subtract_mean=False))


def test_reference_is_the_tutorials_standardization():
    x = np.random.default_rng(12).standard_normal((500, 30)) * 3 + 5
    want = (x - x.mean(0)) / x.std(0)
    with x64():
        np.testing.assert_allclose(reference_normalize(jnp.asarray(x), axis=0, epsilon=0), want,
                                   rtol=1e-12, atol=1e-12)
    assert_close(reference_normalize(jnp.asarray(x, jnp.float32), axis=0, epsilon=0), want,
                 jnp.float32, reduction_length=500)


def test_vmap(implementation):
    x, scale, offset = _inputs((4, 17, 40), -1, jnp.float32, seed=14)
    fn = lambda x, s, o: normalize(x, s, o, implementation=implementation)
    _check(jax.vmap(fn, in_axes=(0, None, None))(x, scale, offset), x, scale, offset, axis=-1)
    # Batching over the last axis: each batch member of shape (4, 17) normalizes its columns.
    y = jax.vmap(lambda x: normalize(x, axis=0, implementation=implementation), in_axes=2,
                 out_axes=2)(x)
    _check(y, x, None, None, axis=0)


# jit and eager, no retrace, vmap of every operand: tests/test_contract.py, from this contract.
CONTRACT = Contract(
    call=lambda impl: lambda x, s=None, o=None: normalize(x, s, o, implementation=impl),
    example=lambda: _inputs((37, 130), -1, jnp.bfloat16, seed=13),
    repeated=lambda seed: (random((12, 20), jnp.float32, seed),),
    check=lambda y, x, s=None, o=None, implementation=None: _check(y, x, s, o, axis=-1),
    small=lambda **kw: normalize(jnp.ones((4, 8)), **kw))


def test_bitwise_identical_on_repeated_runs(implementation):
    x, scale, offset = _inputs((70, 300), -1, jnp.float32, seed=15)
    fn = jax.jit(jax.value_and_grad(lambda x, s, o: jnp.sum(jnp.sin(normalize(
        x, s, o, implementation=implementation))), argnums=(0, 1, 2)))
    first = jax.tree.map(np.asarray, fn(x, scale, offset))
    for _ in range(2):
        chex.assert_trees_all_equal(first, jax.tree.map(np.asarray, fn(x, scale, offset)))


def _loss(fn, **kwargs):
    return lambda x, s, o: jnp.sum(jnp.sin(fn(x, s, o, **kwargs)) * jnp.cos(x))


@pytest.mark.parametrize("call,error,match", [
    (lambda impl: normalize(jnp.ones((4, 5)), jnp.ones(4), implementation=impl), ValueError,
     r"scale must have the shape of the normalized axes \(5,\).*got shape \(4,\)"),
    (lambda impl: normalize(jnp.ones((4, 5)), None, jnp.ones((1, 5)), implementation=impl),
     ValueError, r"offset must have the shape"),
    (lambda impl: normalize(jnp.ones((4, 5)), axis=2, implementation=impl), ValueError,
     "axis 2 is out of range for x of rank 2"),
    (lambda impl: normalize(jnp.ones((4, 5)), axis=(-3,), implementation=impl), ValueError,
     "axis -3 is out of range"),
    (lambda impl: normalize(jnp.ones((4, 5)), axis=(1, -1), implementation=impl), ValueError,
     "repeats an axis"),
    (lambda impl: normalize(jnp.ones((4, 5)), axis=1.0, implementation=impl), TypeError,
     "axis must be an int or a tuple of ints"),
    (lambda impl: normalize(jnp.ones((4, 5), jnp.int32), implementation=impl), TypeError,
     "x must have a floating-point dtype, got int32"),
    (lambda impl: normalize(jnp.ones((4, 5)), jnp.ones(5, jnp.int32), implementation=impl),
     TypeError, "scale must have a floating-point dtype"),
    (lambda impl: normalize(jnp.ones((4, 5)), epsilon=-1e-5, implementation=impl), ValueError,
     "epsilon must be >= 0, got -1e-05"),
    (lambda impl: normalize(jnp.ones((4, 5)), epsilon=float("nan"), implementation=impl),
     ValueError, "epsilon must be >= 0"),
    (lambda impl: normalize(jnp.ones((4, 5)), subtract_mean="yes", implementation=impl),
     TypeError, "subtract_mean must be True or False"),
    (lambda impl: rms_norm(jnp.ones((4, 5)), epsilon=-1.0, implementation=impl), ValueError,
     "rms_norm: epsilon must be >= 0"),
    (lambda impl: layer_norm(jnp.ones(()), implementation=impl), ValueError,
     "layer_norm: axis -1 is out of range for x of rank 0"),
    (lambda impl: normalize(jnp.ones((4, 5)), implementation=impl, config=(8, 128)), TypeError,
     "config must be a NormalizeConfig"),
])
def test_bad_input(implementation, call, error, match):
    with pytest.raises(error, match=match):
        call(implementation)


def test_bad_input_under_jit_raises_before_tracing_a_kernel():
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        jax.jit(lambda x: normalize(x, epsilon=-1.0, implementation="triton"))(jnp.ones((3, 4)))
    with pytest.raises(TypeError, match="epsilon must be a concrete real number"):
        jax.jit(lambda x, e: normalize(x, epsilon=e, implementation="triton"))(
            jnp.ones((3, 4)), 1e-5)


@pytest.mark.parametrize("implementation,config,match", [
    ("triton", NormalizeConfig(block_reduced=100), "config.block_reduced must be a power of 2"),
    ("triton", NormalizeConfig(block_groups=3), "config.block_groups must be a power of 2"),
    ("triton", NormalizeConfig(num_partials=0), "config.num_partials must be a positive int"),
    ("mosaic", NormalizeConfig(block_reduced=100), "config.block_reduced=100 breaks TPU tiling"),
    ("mosaic", NormalizeConfig(block_groups=12), "config.block_groups=12 breaks TPU tiling"),
])
def test_bad_config(implementation, config, match):
    with pytest.raises(ValueError, match=match):
        normalize(jnp.ones((40, 300)), implementation=implementation, config=config)
