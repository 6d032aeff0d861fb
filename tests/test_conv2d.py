"""The shared conv2d suite and its test base, run against every registered implementation: the
cases and float64 ground truth the other conv2d file imports, the forward's values, dtypes,
layouts, configs and bad input. Gradients and the backward kernels' schedules are in
test_conv2d_backward.py.

Interpret mode is slow (TPU interpret mode about 25x more), so the images are small and odd
(7x9, 5x6, 17x31 only where the case needs it) and each case covers several options at once.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import reference
from kernels.conv2d import Conv2dConfig, conv2d
from kernels.conv2d.mosaic import config as mosaic_config
from tests.support import (SUPPORTS_FLOAT64, Contract, as_f64, assert_close, assert_lowers,
                           dot_platform, implementations_of, kernels_of, needs, random,
                           standard_promotion, tf32_rounded, weighted_sum, x64)

KERNELS = kernels_of("conv2d")  # this op's kernels (`tests.support.implementations_of`)

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")

# (x shape NHWC, w shape HWIO, options). Together: kernels 1x1, 3x3, 5x5, 7x1; strides 1, 2,
# (2, 1); dilation 1, 2; every padding form; groups 1, 2 and depthwise (with a channel
# multiplier); batch 1 and 3; odd sizes and channels 1, 3, 5, 130.
CASES = [
    ((3, 7, 9, 5), (3, 3, 5, 4), {}),
    ((1, 7, 9, 3), (1, 1, 3, 130), {"padding": "VALID"}),
    ((1, 7, 9, 1), (5, 5, 1, 3), {"padding": 2, "stride": 2}),
    ((1, 9, 7, 4), (7, 1, 2, 6), {"padding": ((1, 2), (0, 3)), "stride": (2, 1),
                                  "feature_group_count": 2}),
    ((3, 7, 9, 3), (3, 3, 1, 3), {"feature_group_count": 3, "dilation": 2, "padding": 0}),
    ((1, 8, 7, 5), (3, 3, 1, 10), {"feature_group_count": 5, "stride": 2,
                                   "padding": (1, 2)}),
    ((1, 9, 8, 4), (3, 3, 4, 5), {"dilation": (2, 1), "stride": 2, "padding": "SAME"}),
    ((1, 5, 6, 3), (3, 3, 3, 2), {"padding": ((-1, 2), (2, -1))}),
]
BIG_CASE = ((1, 17, 31, 130), (3, 3, 130, 8), {"stride": 2})
CASE_IDS = [f"{x[1]}x{x[2]}x{x[3]}-k{w[0]}x{w[1]}x{w[3]}-{i}" for i, (x, w, _) in
            enumerate(CASES)]


def _inputs(x_shape, w_shape, dtype, data_format="NHWC", seed=0):
    x, w = random(x_shape, dtype, seed), random(w_shape, dtype, seed + 1)
    if data_format == "NCHW":
        x, w = x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1)
    return x, w


def _ground_truth(x, w, **options):
    """The reference in float64 (x64) on the same (rounded) inputs."""
    with x64():
        return np.asarray(reference.conv2d(as_f64(x), as_f64(w), **options))


def _check(x, w, out, dtype, dot=True, implementation=None, **options):
    expected = _ground_truth(x, w, **options)
    chex.assert_shape(out, expected.shape)
    hwio = w.shape if options.get("data_format", "NHWC") == "NHWC" else (
        w.shape[2], w.shape[3], w.shape[1], w.shape[0])
    assert_close(out, expected, dtype, reduction_length=hwio[0] * hwio[1] * hwio[2], dot=dot,
                 platform=dot_platform(implementation))


# Mosaic GPU's interpreter takes about a second a launch: its kernels run the cases that reach
# their paths (the GEMM's layout with groups, strides, dilation and crops; the depthwise
# kernel with and without a multiplier; the 1x1 layer is the matmul's, tested there).
SLOW = {"mosaic_gpu": (0, 3, 4, 5, 7)}


@pytest.mark.parametrize("implementation,case", [
    pytest.param(impl, i, id=f"{impl}-{CASE_IDS[i]}") for impl in implementations_of("conv2d")
    for i in range(len(CASES)) if i in SLOW.get(impl, range(len(CASES)))])
def test_matches_float64_ground_truth(implementation, case):
    x_shape, w_shape, options = CASES[case]
    x, w = _inputs(x_shape, w_shape, jnp.float32)
    out = conv2d(x, w, implementation=implementation, **options)
    assert out.dtype == jnp.float32
    _check(x, w, out, jnp.float32, implementation=implementation, **options)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_large_channels_and_odd_image(implementation):
    # 17x31 with 130 channels: xla and triton only, TPU interpret mode would take minutes; the
    # mosaic kernel's multi-block schedules are covered by test_mosaic_many_blocks.
    x_shape, w_shape, options = BIG_CASE
    x, w = _inputs(x_shape, w_shape, jnp.float32)
    _check(x, w, conv2d(x, w, implementation=implementation, **options), jnp.float32,
           implementation=implementation, **options)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("case", [0, 5], ids=["gemm", "depthwise"])
def test_16_bit_dtypes(implementation, dtype, case):
    x_shape, w_shape, options = CASES[case]
    x, w = _inputs(x_shape, w_shape, dtype)
    out = conv2d(x, w, implementation=implementation, **options)
    assert out.dtype == dtype
    _check(x, w, out, dtype, **options)


def test_float64(implementation):
    with x64():
        x, w = _inputs((1, 7, 9, 4), (3, 3, 2, 4), jnp.float64)
        options = {"stride": 2, "feature_group_count": 2}
        if not SUPPORTS_FLOAT64[implementation]:
            with pytest.raises(NotImplementedError, match=f"{implementation}: float64"):
                conv2d(x, w, implementation=implementation, **options)
            return
        out = conv2d(x, w, implementation=implementation, **options)
        assert out.dtype == jnp.float64
        _check(x, w, out, jnp.float64, **options)


def test_nchw(implementation):
    # Grouped, strided, asymmetric padding; the gradient suite has an NCHW case too.
    x_shape, w_shape, options = CASES[3]
    x, w = _inputs(x_shape, w_shape, jnp.float32, data_format="NCHW")
    out = conv2d(x, w, implementation=implementation, data_format="NCHW", **options)
    _check(x, w, out, jnp.float32, data_format="NCHW", implementation=implementation,
           **options)


def test_mixed_dtypes_and_preferred_element_type(implementation):
    x, w = random((1, 5, 6, 3), jnp.bfloat16, 1), random((3, 3, 3, 4), jnp.float16, 2)
    with standard_promotion():
        out = conv2d(x, w, implementation=implementation)
        assert out.dtype == jnp.float32 == reference.conv2d(x, w).dtype
    _check(x, w, out, jnp.bfloat16)
    # Under the suite's strict promotion mixed operands raise, as jnp's promotion does.
    with pytest.raises(jax.dtypes.TypePromotionError):
        conv2d(x, w, implementation=implementation)
    x, w = random((1, 5, 6, 3), jnp.bfloat16, 3), random((3, 3, 3, 4), jnp.bfloat16, 4)
    out = conv2d(x, w, implementation=implementation, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    # float32 output of float32 accumulation: float32's tolerance, not bfloat16's.
    _check(x, w, out, jnp.float32, implementation=implementation)


def test_precision_highest(implementation):
    x, w = _inputs((1, 5, 6, 3), (3, 3, 3, 4), jnp.float32)
    highest = jax.lax.Precision.HIGHEST
    if implementation == "mosaic_gpu":  # float32 as TF32 (Hopper) or split bfloat16 (Blackwell)
        with pytest.raises(NotImplementedError, match="mosaic_gpu: .*HIGHEST runs in xla"):
            conv2d(x, w, implementation=implementation, precision=highest)
        implementation = (implementation, "xla")  # falls through
    out = conv2d(x, w, implementation=implementation, precision=highest)
    _check(x, w, out, jnp.float32, dot=False)


def test_declining_kernel_falls_through_to_xla():
    with x64():
        x, w = _inputs((1, 5, 6, 3), (3, 3, 3, 4), jnp.float64)
        _check(x, w, conv2d(x, w, implementation=("mosaic", "xla")), jnp.float64)


def test_empty_dims(implementation):
    x, w = jnp.ones((0, 5, 6, 3)), jnp.ones((3, 3, 3, 4))
    chex.assert_shape(conv2d(x, w, implementation=implementation), (0, 5, 6, 4))
    # Padded input smaller than the window: an empty spatial dim, as lax gives.
    x, w = jnp.ones((1, 2, 6, 3)), jnp.ones((3, 3, 3, 4))
    out = conv2d(x, w, padding="VALID", implementation=implementation)
    chex.assert_shape(out, reference.conv2d(x, w, padding="VALID").shape)
    # No input channels: zeros.
    out = conv2d(jnp.ones((1, 4, 5, 0)), jnp.ones((3, 3, 0, 2)), implementation=implementation)
    np.testing.assert_array_equal(out, np.zeros((1, 4, 5, 2)))


def test_nan_and_inf_propagate(implementation):
    x = random((1, 7, 9, 3), jnp.float32, 1).at[0, 2, 3, 1].set(jnp.nan)
    x = x.at[0, 6, 0, 0].set(jnp.inf)
    w = jnp.abs(random((3, 3, 3, 2), jnp.float32, 2))
    for options in ({}, {"stride": 2, "padding": "VALID"}):
        out = conv2d(x, w, implementation=implementation, **options)
        want = reference.conv2d(x, w, **options)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(out), np.isinf(want))


def test_vmap(implementation):
    x, w = random((2, 1, 5, 6, 3), jnp.float32, 1), random((2, 3, 3, 3, 4), jnp.float32, 2)
    out = jax.vmap(lambda x: conv2d(x, w[0], implementation=implementation))(x)
    _check(x.reshape(2, 5, 6, 3), w[0], out.reshape(2, 5, 6, 4), jnp.float32,
           implementation=implementation)
    out = jax.vmap(lambda x, w: conv2d(x, w, implementation=implementation))(x, w)
    for i in range(2):
        _check(x[i], w[i], out[i], jnp.float32, implementation=implementation)


# jit and eager, no retrace, vmap of every operand: tests/test_contract.py, from this contract.
CONTRACT = Contract(
    call=lambda impl: lambda x, w: conv2d(x, w, stride=2, implementation=impl),
    example=lambda: _inputs((1, 7, 9, 3), (3, 3, 3, 4), jnp.bfloat16),
    repeated=lambda seed: _inputs((1, 5, 6, 3), (3, 3, 3, 2), jnp.float32, seed=seed),
    check=lambda out, x, w, implementation: _check(x, w, out, x.dtype, stride=2,
                                                   implementation=implementation),
    small=lambda **kw: conv2d(jnp.ones((1, 5, 6, 4)), jnp.ones((3, 3, 4, 2)), **kw))


def _loss(implementation, **options):
    """A scalar of the convolution that weighs every output element differently."""
    if implementation == "reference":
        return lambda x, w: weighted_sum(reference.conv2d(x, w, **options))
    return lambda x, w: weighted_sum(conv2d(x, w, implementation=implementation, **options))


@pytest.mark.parametrize("options", [{}, {"stride": 2}], ids=["same", "strided"])
@pytest.mark.parametrize("impl", [k for k in KERNELS if dot_platform(k) == "gpu"])
def test_float32_convolutions_multiply_operands_rounded_to_tf32(impl, options):
    """The GPU kernels' float32 forward, dX and dW are TF32 products of operands rounded to
    nearest (tests/test_matmul.py has the matmul's and the figures): each equals the float64
    convolution of the rounded operands within float32 accumulation (the cotangent of
    `weighted_sum` is exact in TF32)."""
    x, w = _inputs((2, 9, 9, 16), (3, 3, 16, 8), jnp.float32)
    out = conv2d(x, w, implementation=impl, **options)
    grads = jax.grad(_loss(impl, **options), argnums=(0, 1))(x, w)
    rounded = [jnp.asarray(tf32_rounded(v)) for v in (x, w)]
    with x64():
        want = reference.conv2d(*rounded, **options)
        want_grads = jax.grad(_loss("reference", **options), argnums=(0, 1))(*rounded)
    assert_close(out, want, jnp.float32, reduction_length=3 * 3 * 16)
    for got, expected in zip(grads, want_grads):  # dX: 3x3x8 terms; dW: 2x9x9 (or fewer)
        assert_close(got, expected, jnp.float32, reduction_length=2 * 9 * 9)


LOWERING_CASES = [((2, 9, 17, 8), (3, 3, 8, 16), {"stride": 2}),
                  ((1, 9, 17, 8), (5, 5, 1, 8), {"feature_group_count": 8}),
                  ((1, 9, 17, 8), (3, 3, 4, 16), {"feature_group_count": 2, "dilation": 2,
                                                  "padding": ((1, 2), (0, 3))})]


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", range(len(LOWERING_CASES)), ids=["strided", "depthwise",
                                                                  "grouped"])
def test_lowers_forward_and_backward(impl, dtype, case):
    x_shape, w_shape, options = LOWERING_CASES[case]
    x, w = random(x_shape, dtype, 1), random(w_shape, dtype, 2)

    def forward(x, w):
        return conv2d(x, w, implementation=impl, interpret=False, **options)

    def backward(x, w):
        return jax.grad(lambda x, w: jnp.sum(forward(x, w).astype(jnp.float32)),
                        argnums=(0, 1))(x, w)

    assert_lowers(forward, x, w, implementation=impl)
    # The input gradient and the weight gradient (the forward result is not needed).
    assert_lowers(backward, x, w, implementation=impl, min_kernels=2)


X, W = jnp.ones((1, 5, 6, 4)), jnp.ones((3, 3, 4, 2))


@pytest.mark.parametrize("x,w,options,error,match", [
    (X, jnp.ones((3, 3, 3, 2)), {}, ValueError, "x has 4 channels"),
    (X, jnp.ones((3, 3, 4, 3)), {"feature_group_count": 2}, ValueError,
     "must divide the output channels 3"),
    (jnp.ones((1, 5, 6, 3)), jnp.ones((3, 3, 1, 3)), {"feature_group_count": 2}, ValueError,
     "must divide the input channels 3"),
    (X, W, {"feature_group_count": 0}, ValueError, "feature_group_count must be >= 1"),
    (X, W, {"stride": 0}, ValueError, "stride must be >= 1"),
    (X, W, {"stride": (1, -1)}, ValueError, "stride must be >= 1"),
    (X, W, {"dilation": 0}, ValueError, "dilation must be >= 1"),
    (X, W, {"stride": 1.5}, TypeError, "stride must be an int or a pair"),
    (X, W, {"stride": (1, 2, 3)}, TypeError, "stride must be an int or a pair"),
    (X, W, {"padding": "FULL"}, ValueError, "padding must be one of"),
    (X, W, {"padding": ((1, 2), (3,))}, ValueError, "padding must be one of"),
    (X, W, {"padding": (1, 2, 3)}, ValueError, "padding must be one of"),
    (X, W, {"padding": 1.0}, ValueError, "padding must be one of"),
    (jnp.ones((5, 6, 4)), W, {}, ValueError, "x must have rank 4"),
    (X, jnp.ones((3, 4, 2)), {}, ValueError, "w must have rank 4"),
    (X, W, {"data_format": "NWHC"}, ValueError, "data_format must be 'NHWC' or 'NCHW'"),
    (X, W, {"data_format": "NCHW"}, ValueError, "x has 5 channels"),
    (np.full((1, 5, 6, 4), "a"), W, {}, TypeError, "x must have a numeric or boolean dtype"),
])
def test_bad_input(implementation, x, w, options, error, match):
    with pytest.raises(error, match=match):
        conv2d(x, w, implementation=implementation, **options)


def test_integer_and_bool_inputs_go_to_xla():
    x, w = jnp.arange(60).reshape(1, 3, 5, 4) % 7, jnp.ones((3, 3, 4, 2), jnp.int32)
    np.testing.assert_array_equal(conv2d(x, w, implementation=("triton", "xla")),
                                  reference.conv2d(x, w))
    with pytest.raises(NotImplementedError, match="mosaic: x has dtype bool"):
        conv2d(X.astype(bool), W.astype(bool), implementation="mosaic")


def test_reference_rejects_the_same_input():
    with pytest.raises(ValueError, match="stride must be >= 1"):
        reference.conv2d(X, W, stride=0)
    with pytest.raises(ValueError, match="padding must be one of"):
        reference.conv2d(X, W, padding=((1, 2),))


# A bad implementation, interpret or config type: tests/test_contract.py, for every op.


@pytest.mark.parametrize("impl,config,match", [
    ("triton", Conv2dConfig(block_m=24), "block_m must be a power of 2 >= 16"),
    ("triton", Conv2dConfig(block_k=8), "block_k must be a power of 2 >= 16"),
    ("triton", Conv2dConfig(num_warps=3), "num_warps"),
    ("mosaic", Conv2dConfig(block_n=100), "block_n=100 breaks TPU tiling"),
    ("mosaic", Conv2dConfig(block_rows=0), "block_rows must be a positive int"),
    pytest.param("mosaic_gpu", Conv2dConfig(block_k=64), "takes block_m, block_n and num_stages",
                 marks=needs("mosaic_gpu")),
    pytest.param("mosaic_gpu", Conv2dConfig(block_m=100), "block_m a multiple of 128",
                 marks=needs("mosaic_gpu")),
])
def test_config_that_breaks_a_constraint(impl, config, match):
    x, w = jnp.ones((1, 5, 6, 4)), jnp.ones((3, 3, 4, 256))
    with pytest.raises(ValueError, match=match):
        conv2d(x, w, implementation=impl, config=config)


def test_triton_explicit_config_many_blocks():
    # Several pixel, channel and reduction blocks, none dividing its dim.
    x, w = _inputs((3, 7, 9, 5), (3, 3, 5, 40), jnp.float32)
    config = Conv2dConfig(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2)
    out = conv2d(x, w, stride=(2, 1), implementation="triton", config=config)
    _check(x, w, out, jnp.float32, stride=(2, 1), implementation="triton")


@pytest.mark.parametrize("options,w_shape", [({"stride": 2, "padding": 1}, (3, 3, 3, 4)),
                                             ({"feature_group_count": 3}, (3, 3, 1, 3))],
                         ids=["gemm", "depthwise"])
def test_mosaic_many_blocks(monkeypatch, options, w_shape):
    # Row blocks of 2 output rows, so input tiles overlap by the halo, and the weight
    # gradient reduces over several row blocks and batch elements.
    monkeypatch.setattr(mosaic_config, "_TARGET_PIXELS", 16)
    x, w = _inputs((2, 6, 7, 3), w_shape, jnp.float32)
    out = conv2d(x, w, implementation="mosaic", **options)
    _check(x, w, out, jnp.float32, **options)
    grads = jax.grad(_loss("mosaic", **options), argnums=(0, 1))(x, w)
    with x64():
        want = jax.grad(_loss("reference", **options), argnums=(0, 1))(as_f64(x), as_f64(w))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=200, dot=True)


@pytest.mark.parametrize("x_shape,w_shape,groups", [
    ((32, 56, 56, 64), (3, 3, 64, 64), 1),      # ResNet-50 3x3
    ((32, 112, 112, 32), (3, 3, 1, 32), 32),    # MobileNet depthwise 3x3
], ids=["resnet 3x3", "depthwise 3x3"])
def test_triton_cost_estimates_count_the_patch_loads(x_shape, w_shape, groups):
    """The design table's traffic comes from the cost estimates: an implicit-GEMM launch
    loads every output pixel's 9-tap patch (mostly from cache), so each launch, forward, input
    and weight gradient, states at least 9x the input's bytes (each operand once was about
    2x)."""
    from kernels import _targets
    from kernels.compile import launches

    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(conv2d(x, w, feature_group_count=groups, implementation="triton",
                              interpret=False))

    calls = launches(jax.grad(loss, argnums=(0, 1)), x, w, target=_targets.TARGETS["sm_90"])
    x_bytes = np.prod(x_shape) * 2
    for eqn in calls:
        assert eqn.params["cost_estimate"].bytes_accessed >= 9 * x_bytes, eqn.params["name"]
