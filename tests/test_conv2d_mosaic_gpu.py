"""What conv2d's Mosaic GPU implementation (`implementation="mosaic_gpu"`, jax >= 0.12) adds to
the op's shared test base (which runs it too, in Mosaic GPU's interpreter with its race
detector): its tap-row layout, whose every TMA window must start on whole 8-row tiles (an
offset within a tile reads zeros on a device, which the interpreter cannot show), the launches
each pass makes and what they read, an explicit many-tile schedule, and the depthwise plans.
Its compiled kernels, whole programs and export: tests/test_mosaic_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels._targets import TARGETS
from kernels.conv2d import Conv2dConfig, conv2d
from kernels.conv2d.common import make_problem
from kernels.reference.conv2d import geometry as make_geometry
from tests.support import assert_close, needs, random
from tests.test_conv2d import _check, _inputs

pytestmark = [needs("mosaic_gpu"), pytest.mark.usefixtures("strict_interpret")]

# (x NHWC, w HWIO, options): strides, dilations, crops, odd widths, groups, a 7x7 stem.
GEOMETRIES = [
    ((3, 7, 9, 5), (3, 3, 5, 4), {}),
    ((2, 9, 8, 4), (3, 3, 4, 5), {"dilation": (2, 1), "stride": 2, "padding": "SAME"}),
    ((1, 9, 7, 4), (7, 1, 2, 6), {"padding": ((1, 2), (0, 3)), "stride": (2, 1),
                                  "feature_group_count": 2}),
    ((1, 5, 6, 3), (3, 3, 3, 2), {"padding": ((-1, 2), (2, -1))}),
    ((2, 224, 224, 3), (7, 7, 3, 64), {"stride": 2, "padding": 3}),
    ((4, 13, 13, 16), (5, 5, 16, 16), {"stride": 3, "dilation": 2}),
]


def _problem(x_shape, w_shape, options, dtype=jnp.bfloat16):
    options = {"stride": 1, "padding": "SAME", "dilation": 1, "feature_group_count": 1,
               "data_format": "NHWC", **options}
    g = make_geometry(x_shape, w_shape, **options)
    return make_problem(x_shape, w_shape, dtype, dtype, g, dtype)


@pytest.mark.parametrize("x_shape,w_shape,options", GEOMETRIES)
def test_every_tap_row_window_starts_on_a_whole_tma_tile(x_shape, w_shape, options):
    """TMA copies the swizzled shared-memory layout in tiles of `TMA_ROWS` rows, and Mosaic GPU
    addresses a window's first row as (tile, row within it): a window starting inside a tile
    would read zeros past the tile's rows on a device. Every tap row's shift, and so every
    window (tile starts are multiples of block_m), starts on a whole tile; the valid outputs'
    reads stay inside their stride phase; the grid computes at most the output rounded up to
    8 columns plus the taps' reach in rows."""
    from kernels.conv2d.mosaic_gpu.config import tap_rows
    from kernels.gemm.mosaic_gpu.config import TMA_ROWS

    p = _problem(x_shape, w_shape, options)
    layout = tap_rows(p)
    shifts = [layout.shift(kh) for kh in range(p.kh)]
    assert all(shift % TMA_ROWS == 0 for shift in shifts), shifts
    assert layout.cols % TMA_ROWS == 0 and layout.cols - p.ow < TMA_ROWS
    g = p.geometry
    for kh, shift in enumerate(shifts):
        phase, row = divmod(shift, layout.phase_rows)
        assert phase == kh * g.rhs_dilation[0] % g.stride[0]
        # The last valid output row's tap lands in its phase's rows of the same image.
        assert (p.oh - 1) + row // layout.cols < layout.rows
    assert layout.rows - p.oh == (p.kh - 1) * g.rhs_dilation[0] // g.stride[0]


def _launches(fn, *args):
    from kernels.compile import launches

    return launches(fn, *args, target=TARGETS["sm_90"])


def test_each_pass_is_one_launch_on_the_tap_rows():
    """The forward is one launch whose A operand is the tap rows (KW times the input: the
    patches, KH·KW times it, are never written), the weights K-major beside it. The training
    step adds the input gradient (one forward launch on dY) and the weight gradient, one launch
    that reads the same tap rows (16-bit: wgmma takes them transposed), split over pixels."""
    from kernels.conv2d.mosaic_gpu.config import tap_rows

    x_shape, w_shape = (8, 32, 32, 64), (3, 3, 64, 128)
    x, w = jnp.ones(x_shape, jnp.bfloat16), jnp.ones(w_shape, jnp.bfloat16)
    layout = tap_rows(_problem(x_shape, w_shape, {}))

    def forward(x, w):
        return conv2d(x, w, implementation="mosaic_gpu", interpret=False)

    (launch,) = _launches(forward, x, w)
    a, b = (v.aval.shape for v in launch.invars[:2])
    # KW = 3 times the input, and the 2 padding rows and the last tile's reach: not 9 times.
    assert a[2] == layout.width == 3 * 64 and a[1] * a[2] < 3.5 * x.size
    assert b == (1, 128, 3 * layout.width)

    loss = jax.grad(lambda x, w: jnp.sum(forward(x, w).astype(jnp.float32)), argnums=(0, 1))
    names = [eqn.params["name"] for eqn in _launches(loss, x, w)]
    assert names.count("conv2d_mosaic_gpu") == 2, names  # forward, input gradient
    assert sum(n.startswith("conv2d_weight_grad") for n in names) == 1, names


def test_many_tiles_and_k_steps_with_an_explicit_config():
    """130 channels (a tap row of 390 padded to 448: 7 K steps a tap row, 21 in all), stride 2,
    several output tiles of 128 grid rows and two of 64 channels: against float64 truth."""
    x_shape, w_shape, options = (1, 17, 31, 130), (3, 3, 130, 72), {"stride": 2}
    x, w = _inputs(x_shape, w_shape, jnp.bfloat16)
    config = Conv2dConfig(block_m=128, block_n=64)
    out = conv2d(x, w, implementation="mosaic_gpu", config=config, **options)
    _check(x, w, out, jnp.bfloat16, **options)


@pytest.mark.parametrize("channels,multiplier,splits", [(32, 1, 30), (96, 2, 15), (300, 1, 10)])
def test_depthwise_plan(channels, multiplier, splits):
    """Channel blocks of up to 128 (32 a warp's lanes at least); the weight gradient's pixels
    split until its CTAs (splits x taps x channel blocks x multiplier) make two waves of an
    H100's 132 SMs."""
    from kernels._pallas import on_target
    from kernels.conv2d.mosaic_gpu.depthwise import plan_of

    p = _problem((8, 56, 56, channels), (3, 3, 1, channels * multiplier),
                 {"feature_group_count": channels})
    with on_target(TARGETS["sm_90"]):
        plan = plan_of(p)
    assert plan.block_channels == min(128, max(32, 1 << (channels - 1).bit_length()))
    assert plan.splits == splits
    assert plan.splits * 9 * plan.channel_blocks * multiplier >= 2 * 132


def test_depthwise_row_blocks_are_on_the_uncapped_grid_axis():
    """CUDA caps a grid's y and z at 65,535 CTAs, and Mosaic GPU maps a grid's axes onto z, y,
    x: the depthwise kernels put their row blocks last (x), so a batch of 512 at 112x112 (over
    100,000 row blocks) launches; the multiplier and channel blocks are the capped axes."""
    from kernels.compile.launches import grid_of

    x = jnp.ones((512, 112, 112, 32), jnp.bfloat16)
    w = jnp.ones((3, 3, 1, 32), jnp.bfloat16)

    def layer(x, w):
        return conv2d(x, w, feature_group_count=32, implementation="mosaic_gpu",
                      interpret=False)

    step = jax.grad(lambda x, w: jnp.sum(layer(x, w).astype(jnp.float32)), argnums=(0, 1))
    grids = [grid_of(eqn) for eqn in _launches(step, x, w)]
    assert grids[0][2] > 65535 and len(grids) == 3, grids  # forward, dX, dW
    assert all(max(grid[:2]) <= 65535 for grid in grids), grids


def test_depthwise_with_a_channel_multiplier_and_an_epilogue():
    """Output channel c·M + j reads input channel c: 40 channels (two blocks of 32, the second
    ragged), multiplier 2, a 3x2 kernel at stride (2, 1), bias and gelu: every gradient
    against the reference's (the interpreter runs each of the weight gradient's
    taps x channel blocks x multiplier CTAs: a small kernel keeps it quick). Every pass runs
    the depthwise kernels: the input gradient, 2 input channels and 1 output channel a group,
    as the depthwise convolution of each channel summed by XLA (`summed_depthwise`), not as
    GEMMs padded 16x along K and 64x along N."""
    x, w = random((2, 9, 11, 40), jnp.float32, 1), random((3, 2, 1, 80), jnp.float32, 2)
    bias = random((80,), jnp.float32, 3)
    options = {"feature_group_count": 40, "stride": (2, 1), "padding": 1}

    def loss(implementation):
        def f(x, w, bias):
            y = conv2d(x, w, bias=bias, activation="gelu", implementation=implementation,
                       **options)
            return jnp.sum(y * jnp.linspace(-1, 1, y.size).reshape(y.shape))
        return f

    def layer(x, w):
        return conv2d(x, w, implementation="mosaic_gpu", interpret=False, **options)

    step = jax.grad(lambda x, w: jnp.sum(layer(x, w)), argnums=(0, 1))
    assert {eqn.params["name"] for eqn in _launches(step, x, w)} == {
        "conv2d_depthwise_mosaic_gpu", "conv2d_depthwise_weight_grad_mosaic_gpu"}
    got = jax.grad(loss("mosaic_gpu"), argnums=(0, 1, 2))(x, w, bias)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(x, w, bias)
    for g, r in zip(got, want):  # dW sums over 2 x 5 x 12 pixels, dbias too
        assert g.shape == r.shape
        assert_close(g, r, jnp.float32, reduction_length=120, dot=True)
