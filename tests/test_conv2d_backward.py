"""conv2d's gradients for every registered implementation (input and weight gradients, strided
phases, the 1x1 on the matmul kernels, second order, finite differences in float64) and the
backward kernels' schedules against an H100 and a TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from kernels import reference
from kernels.conv2d import conv2d
from tests.support import SUPPORTS_FLOAT64, as_f64, assert_close, dot_platform, kernels_of, x64

KERNELS = kernels_of("conv2d")  # this op's kernels (`tests.support.implementations_of`)
from tests.test_conv2d import CASES, _check, _inputs, _loss

# Kernels interpreted by default run strict here (TPU interpret mode for Mosaic), on small grids.
pytestmark = pytest.mark.usefixtures("strict_interpret")


GRAD_CASES = [CASES[0], CASES[3], CASES[5], CASES[6], CASES[7],
              ((1, 8, 7, 4), (3, 3, 2, 4), {"stride": 2, "feature_group_count": 2,
                                            "data_format": "NCHW"}),
              # 288 output pixels: the Triton forward and dX read float32 weights K-major.
              ((2, 12, 12, 8), (3, 3, 8, 16), {})]
# TPU interpret mode is ~25x slower: mosaic runs the grouped-strided-padded, the depthwise
# and the NCHW cases here, and several row blocks in test_mosaic_many_blocks.
MOSAIC_GRAD_CASES = (1, 2, 5)


@pytest.mark.parametrize("implementation,case", [
    (impl, case) for impl in ("xla", "triton", "mosaic") for case in range(len(GRAD_CASES))
    if impl != "mosaic" or case in MOSAIC_GRAD_CASES])
def test_gradients_match_reference(implementation, case):
    x_shape, w_shape, options = GRAD_CASES[case]
    x, w = _inputs(x_shape, w_shape, jnp.float32, options.get("data_format", "NHWC"))
    grads = jax.grad(_loss(implementation, **options), argnums=(0, 1))(x, w)
    with x64():
        want = jax.grad(_loss("reference", **options), argnums=(0, 1))(as_f64(x), as_f64(w))
    n, h, wd = x_shape[:3]
    length = max(np.prod(w_shape), n * h * wd)
    for got, expected, operand in zip(grads, want, (x, w)):
        assert got.dtype == operand.dtype
        assert_close(got, expected, jnp.float32, reduction_length=length, dot=True,
                     platform=dot_platform(implementation))


def _weight_grad_problem(x_shape, w_shape, dtype, **options):
    from kernels.conv2d import common
    from kernels.reference.conv2d import geometry

    options = {"stride": 1, "padding": "SAME", "dilation": 1, "feature_group_count": 1,
               "data_format": "NHWC", **options}
    g = geometry(x_shape, w_shape, **options)
    return common.make_problem(x_shape, w_shape, jnp.dtype(dtype), jnp.dtype(dtype), g,
                               jnp.dtype(dtype))


@pytest.mark.parametrize("x_shape,w_shape,options", [
    ((4, 20, 20, 16), (3, 3, 16, 16), {}),
    ((2, 21, 19, 8), (3, 3, 4, 6), {"stride": 2, "feature_group_count": 2}),
    ((2, 10, 10, 8), (3, 3, 1, 8), {"feature_group_count": 8}),  # depthwise
], ids=["gemm", "grouped-strided", "depthwise"])
def test_triton_weight_gradient_pixel_splits(x_shape, w_shape, options):
    """Few dW tiles and many pixels: the pixels are split over programs whose float32 partial
    dW are summed afterwards; every pixel counted once."""
    from kernels.conv2d.triton import config as triton_config

    p = _weight_grad_problem(x_shape, w_shape, jnp.float32, **options)
    split = triton_config.weight_grad_split(p, triton_config.weight_grad_config(p))
    assert split.splits > 1, split
    x, w = _inputs(x_shape, w_shape, jnp.float32)
    got = jax.grad(_loss("triton", **options), argnums=1)(x, w)
    with x64():
        want = jax.grad(_loss("reference", **options), argnums=1)(as_f64(x), as_f64(w))
    assert_close(got, want, jnp.float32, reduction_length=x_shape[0] * x_shape[1] * x_shape[2],
                 dot=True, platform="gpu")


@pytest.mark.parametrize("x_shape,w_shape,options", [
    ((4, 8, 8, 32), (3, 3, 32, 32), {}),
    ((4, 9, 11, 64), (3, 3, 32, 256), {"stride": 2, "feature_group_count": 2}),
    ((4, 10, 9, 48), (3, 2, 48, 64), {"dilation": 2, "padding": ((2, -1), (1, 3))}),
], ids=["same", "grouped-strided", "dilated-cropped"])
def test_triton_float32_weight_gradient_pixel_major(x_shape, w_shape, options):
    """A float32 weight gradient whose operands are reused enough reads both K-major from
    XLA's pixel-major copies (stride phases, a column shift per tap): dW against float64
    truth, odd image sizes, groups, a stride, a dilation and cropping padding."""
    from kernels.conv2d.triton import config as triton_config

    p = _weight_grad_problem(x_shape, w_shape, jnp.float32, **options)
    assert triton_config.pixel_major(p, None) is not None
    x, w = _inputs(x_shape, w_shape, jnp.float32)
    got = jax.grad(_loss("triton", **options), argnums=1)(x, w)
    with x64():
        want = jax.grad(_loss("reference", **options), argnums=1)(as_f64(x), as_f64(w))
    assert_close(got, want, jnp.float32, reduction_length=int(np.prod(x_shape[:3])), dot=True,
                 platform="gpu")


def test_triton_pixel_major_weight_gradient_reads_no_padding_pairs():
    """dY's zero columns past OW pair with input columns of the next row: masked, so an inf in
    an input column that no product of a tap reads leaves that tap's dW finite (here column 0,
    which tap kw = 2 of a VALID 3x3 never reads), as XLA's gradient is."""
    x, w = _inputs((4, 8, 8, 32), (3, 3, 32, 32), jnp.float32)
    x = x.at[:, :, 0, :].set(jnp.inf)
    dy = jnp.asarray(np.random.default_rng(3).standard_normal((4, 6, 6, 32)), jnp.float32)

    def weight_grad(implementation):
        conv = lambda w: conv2d(x, w, padding="VALID", implementation=implementation)  # noqa: E731
        return jax.vjp(conv, w)[1](dy)[0]

    got, want = weight_grad("triton")[:, 1:], weight_grad("xla")[:, 1:]
    assert bool(jnp.isfinite(want).all())
    assert_close(got, want, jnp.float32, reduction_length=4 * 6 * 6, dot=True, platform="gpu")


def test_triton_pixel_major_weight_gradient_where_it_repays():
    """The pixel-major copies are taken for float32 on the tensor cores (TF32) only, with a
    batch a multiple of 4 and enough reuse; otherwise the gathered kernel runs."""
    from kernels.conv2d.triton.config import pixel_major

    p = _weight_grad_problem((4, 8, 8, 32), (3, 3, 32, 32), jnp.float32)
    assert pixel_major(p, None) is not None and pixel_major(p, "high") is not None
    assert pixel_major(p, "highest") is None  # an IEEE float32 dot takes any layout
    assert pixel_major(p._replace(n=6), None) is None  # unaligned tap shifts
    assert pixel_major(p._replace(x_dtype=jnp.dtype(jnp.bfloat16)), None) is None
    assert pixel_major(_weight_grad_problem((4, 8, 8, 16), (3, 3, 16, 32), jnp.float32),
                       None) is None  # 16 channels x 9 taps: 144 < K_MAJOR_MIN_REUSE


@pytest.mark.parametrize("x_shape,w_shape,options,tap_major", [
    ((1, 6, 5, 48), (3, 3, 24, 20), {"feature_group_count": 2, "stride": 2}, True),
    ((2, 9, 11, 4), (5, 5, 1, 8), {"feature_group_count": 4, "padding": (2, 1)}, False),
], ids=["tap-major-ragged-channels", "depthwise-5x5-two-tap-blocks"])
def test_triton_k_blocks(x_shape, w_shape, options, tap_major):
    """Tap-major K blocks whose last channel block is ragged (24 channels a group in blocks of
    32), and a depthwise dW whose 25 taps take two programs (13 + 12), against float64 truth:
    forward, dX and dW."""
    from kernels.conv2d.triton import config as triton_config

    p = _weight_grad_problem(x_shape, w_shape, jnp.float32, **options)
    config = (triton_config.resolve_config(p, None) if tap_major else
              triton_config.weight_grad_config(p))
    assert triton_config.tap_major(p) == tap_major
    assert p.k % config.block_k and triton_config.num_k_blocks(p, config.block_k) > 1, config
    x, w = _inputs(x_shape, w_shape, jnp.float32)
    _check(x, w, conv2d(x, w, implementation="triton", **options), jnp.float32,
           implementation="triton", **options)
    grads = jax.grad(_loss("triton", **options), argnums=(0, 1))(x, w)
    with x64():
        want = jax.grad(_loss("reference", **options), argnums=(0, 1))(as_f64(x), as_f64(w))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=int(np.prod(x_shape[:3])),
                     dot=True, platform="gpu")


@pytest.mark.parametrize("x_shape,w_shape,options", [
    *GRAD_CASES, ((1, 6, 5, 48), (3, 3, 24, 20), {"feature_group_count": 2, "stride": 2}),
    ((2, 9, 11, 4), (5, 5, 1, 8), {"feature_group_count": 4, "padding": (2, 1)})])
def test_gradient_tolerance_holds_for_xla_itself(x_shape, w_shape, options):
    """The tolerance rule as the gradient tests apply it is one that XLA's own float32
    gradient meets on the same inputs: a check it failed would test the CPU's rounding, not
    the kernel (sum(sin(conv)) failed it on an AMD EPYC: dX 2.15e-5 against 1.43e-5)."""
    x, w = _inputs(x_shape, w_shape, jnp.float32, options.get("data_format", "NHWC"))
    grads = jax.jit(jax.grad(_loss("reference", **options), argnums=(0, 1)))(x, w)
    with x64():
        want = jax.grad(_loss("reference", **options), argnums=(0, 1))(as_f64(x), as_f64(w))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=int(np.prod(x_shape[:3])),
                     dot=True)


# ResNet-50's weight gradients at batch 32 (bfloat16) and the programs the Triton kernel
# launched for them before the pixel split: every pixel of a dW tile in one program.
# (The stride-1 1x1s, 2 programs each before, run on the matmul kernels now: see
# test_pointwise_convolution_launches_matmul_kernels and matmul's split-K tests.)
RESNET_WEIGHT_GRADIENTS = {
    "conv2_x 3x3 64->64": ((32, 56, 56, 64), (3, 3, 64, 64), {}),  # was 5 programs
    "conv3_1 downsample 1x1/2 256->512": ((32, 56, 56, 256), (1, 1, 256, 512), {"stride": 2}),
    "conv3_1 3x3/2 128->256": ((32, 28, 28, 128), (3, 3, 128, 256), {"stride": 2}),  # 1.1 waves
    "conv4_x 3x3 256->256": ((32, 14, 14, 256), (3, 3, 256, 256), {}),  # was 36
    "MobileNet depthwise 3x3 x64": ((32, 56, 56, 64), (3, 3, 1, 64),
                                    {"feature_group_count": 64}),  # was 9
}


@pytest.mark.parametrize("name", RESNET_WEIGHT_GRADIENTS)
def test_triton_weight_gradient_fills_an_h100(name):
    """Design property (no device needed): at least one program per SM of an H100, two waves
    where the dW tiles alone would leave SMs idle, the float32 partials (written and read
    back) within half the loads of the unsplit kernel. The stride-2 layer had 72 tiles in 2
    splits (issue 25: its partials were held to half of x and dY read once)."""
    import math

    from kernels import _targets
    from kernels.conv2d.triton import config as triton_config

    x_shape, w_shape, options = RESNET_WEIGHT_GRADIENTS[name]
    p = _weight_grad_problem(x_shape, w_shape, jnp.bfloat16, **options)
    config = triton_config.weight_grad_config(p)
    split = triton_config.weight_grad_split(p, config)
    tiles = math.prod(triton_config.weight_grad_grid(p, config))
    h100 = _targets.TARGETS["sm_90"]
    assert tiles * split.splits >= h100.num_sms, (config, split)
    if tiles < h100.num_sms:
        assert tiles * split.splits >= h100.min_programs, (config, split)
    loads = triton_config.weight_grad_traffic(p, config, jnp.bfloat16, jnp.bfloat16, 1)
    assert 2 * split.splits * p.k * p.o * 4 <= loads / 2 or split.splits == 1


# The sub-pixel phases of a strided input gradient at their edge cases: a 1x1 stride-2 kernel
# (three of four phases get no tap), stride 3 with dilation 3 (every tap in one phase per axis),
# a stride larger than the kernel with cropping padding (phases whose pixels all miss).
PHASE_CASES = [
    ((1, 8, 9, 3), (1, 1, 3, 4), {"stride": 2, "padding": 0}),
    ((1, 10, 11, 2), (3, 2, 2, 3), {"stride": 3, "dilation": 3, "padding": "SAME"}),
    ((1, 9, 7, 2), (2, 3, 2, 2), {"stride": (4, 3), "padding": ((2, -1), (-1, 3))}),
]


@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
@pytest.mark.parametrize("x_shape,w_shape,options", PHASE_CASES,
                         ids=["1x1-stride2", "stride3-dilation3", "stride4x3-cropped"])
def test_strided_input_gradient_phases(implementation, x_shape, w_shape, options):
    x, w = _inputs(x_shape, w_shape, jnp.float32)
    got = jax.grad(_loss(implementation, **options), argnums=0)(x, w)
    with x64():
        want = jax.grad(_loss("reference", **options), argnums=0)(as_f64(x), as_f64(w))
    assert_close(got, want, jnp.float32, reduction_length=np.prod(w_shape), dot=True,
                 platform=dot_platform(implementation))


@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_pointwise_convolution_gradients(implementation):
    """A 1x1 stride-1 convolution runs on the matmul kernels, forward, dX and dW."""
    x, w = _inputs((2, 5, 7, 6), (1, 1, 6, 9), jnp.float32)
    _check(x, w, conv2d(x, w, implementation=implementation), jnp.float32, implementation=implementation)
    grads = jax.grad(_loss(implementation), argnums=(0, 1))(x, w)
    with x64():
        want = jax.grad(_loss("reference"), argnums=(0, 1))(as_f64(x), as_f64(w))
    for got, expected in zip(grads, want):
        assert_close(got, expected, jnp.float32, reduction_length=70, dot=True,
                     platform=dot_platform(implementation))


@pytest.mark.parametrize("target", ["sm_90", "v5e"])
def test_pointwise_convolution_launches_matmul_kernels(target):
    """ResNet-50's bottleneck 1x1s (here conv2_x 64->256 at batch 32) are matmuls of contiguous
    pixel rows: forward, dX and dW launch the matmul kernel (tiles by shape class, split-K,
    vectorized loads), not the implicit-GEMM patch gather."""
    from kernels import _targets
    from kernels.compile import implementation_for, launches

    implementation = implementation_for(target)
    x = jax.ShapeDtypeStruct((32, 56, 56, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1, 1, 64, 256), jnp.bfloat16)
    loss = lambda x, w: jnp.sum(conv2d(x, w, implementation=implementation,  # noqa: E731
                                       interpret=False).astype(jnp.float32))
    calls = launches(jax.value_and_grad(loss, argnums=(0, 1)), x, w,
                     target=_targets.TARGETS[target])
    names = [eqn.params["name"] for eqn in calls]
    assert len(names) == 3 and all(name.startswith("matmul") for name in names), names


# Strided layers at batch 32 (bfloat16): the input gradient of a stride-s forward convolves
# the output gradient dilated by s; multiplying its zeros executed s² times the MACs needed.
STRIDED_INPUT_GRADIENTS = {
    "ResNet-50 stem 7x7/2": ((32, 224, 224, 3), (7, 7, 3, 64), {}),
    "ResNet-50 conv3_1 3x3/2": ((32, 56, 56, 128), (3, 3, 128, 128), {}),
    "ResNet-50 downsample 1x1/2": ((32, 56, 56, 256), (1, 1, 256, 512), {"padding": 0}),
    "MobileNet depthwise 3x3/2": ((32, 112, 112, 64), (3, 3, 1, 64),
                                  {"feature_group_count": 64}),
}


@pytest.mark.parametrize("target", ["sm_90", "v5e"])
@pytest.mark.parametrize("name", STRIDED_INPUT_GRADIENTS)
def test_strided_input_gradient_executes_the_forward_macs(target, name):
    """Design property (no device needed): the input-gradient launches of a stride-2 layer
    execute at most 1.1x the forward's multiply-adds, and none reads an array of twice dy's size
    (the zero-dilated dy was stride² = 4x)."""
    from kernels import _targets
    from kernels.compile import implementation_for, launches

    x_shape, w_shape, options = STRIDED_INPUT_GRADIENTS[name]
    options = {"stride": 2, **options}
    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)
    implementation = implementation_for(target)

    def forward(x, w):
        return conv2d(x, w, implementation=implementation, interpret=False, **options)

    def input_gradient(x, w):
        y, vjp = jax.vjp(lambda x: forward(x, w), x)
        return vjp(jnp.ones_like(y))

    dy = jax.eval_shape(forward, x, w)
    target = _targets.TARGETS[target]
    forward_calls = launches(forward, x, w, target=target)
    calls = [eqn for eqn in launches(input_gradient, x, w, target=target)[len(forward_calls):]
             if "weight_grad" not in eqn.params["name"]]
    forward_macs = dy.size * w_shape[0] * w_shape[1] * w_shape[2]
    executed_macs = sum(eqn.params["cost_estimate"].flops for eqn in calls) // 2
    assert calls and executed_macs <= 1.1 * forward_macs, (len(calls), executed_macs,
                                                            forward_macs)
    for eqn in calls:  # Mosaic's staged dy is padded to whole blocks: < 2x, not 4x
        assert max(v.aval.size for v in eqn.invars) < 2 * max(dy.size, np.prod(w_shape))


@pytest.mark.parametrize("impl", KERNELS)
def test_gradients_bfloat16(impl):
    x, w = _inputs((1, 7, 9, 4), (3, 3, 2, 6), jnp.bfloat16)
    options = {"stride": 2, "feature_group_count": 2}
    grads = jax.grad(lambda x, w: jnp.sum(conv2d(x, w, implementation=impl, **options)
                                          .astype(jnp.float32)), argnums=(0, 1))(x, w)
    with x64():
        want = jax.grad(lambda x, w: jnp.sum(reference.conv2d(x, w, **options)),
                        argnums=(0, 1))(as_f64(x), as_f64(w))
    for got, expected, operand in zip(grads, want, (x, w)):
        assert got.dtype == operand.dtype
        assert_close(got, expected, jnp.bfloat16, reduction_length=63, dot=True)


@pytest.mark.parametrize("implementation,options", [
    ("xla", {"stride": 2}), ("triton", {"stride": 2}), ("mosaic", {"stride": 2}),
    ("xla", {"feature_group_count": 3}), ("triton", {"feature_group_count": 3})],
    ids=["xla-strided", "triton-strided", "mosaic-strided", "xla-depthwise", "triton-depthwise"])
def test_grad_of_grad(implementation, options):
    x, w = _inputs((1, 5, 6, 3), (3, 3, 3 // options.get("feature_group_count", 1), 3),
                   jnp.float32)

    def second(impl):
        inner = jax.grad(_loss(impl, **options), argnums=0)
        return jax.grad(lambda x, w: jnp.sum(inner(x, w) ** 2), argnums=(0, 1))

    got = second(implementation)(x, w)
    with x64():
        want = second("reference")(as_f64(x), as_f64(w))
    # Four chained convolutions (forward, input gradient and their derivatives).
    for got_, expected in zip(got, want):
        assert_close(got_, expected, jnp.float32, reduction_length=1000, dot=True,
                     platform=dot_platform(implementation))


@pytest.mark.parametrize("impl", [i for i in ("xla", "triton") if SUPPORTS_FLOAT64[i]])
@pytest.mark.parametrize("options,order", [
    ({"stride": 2, "padding": ((1, 0), (2, 1))}, 2),
    ({"feature_group_count": 2, "dilation": 2, "stride": (1, 2)}, 1)],
    ids=["strided", "grouped-dilated"])
def test_finite_differences_float64(impl, options, order):
    with x64():
        x, w = _inputs((1, 5, 6, 2), (3, 3, 2 // options.get("feature_group_count", 1), 2),
                       jnp.float64)
        # order=2 also checks grad of grad against finite differences.
        check_grads(lambda x, w: conv2d(x, w, implementation=impl, **options), (x, w),
                    order=order, modes=["rev"], atol=1e-6, rtol=1e-6)
