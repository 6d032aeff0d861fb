"""What conv2d's Mosaic GPU implementation (`implementation="mosaic_gpu"`, jax >= 0.12) adds to
the op's shared test base (which runs it too, in Mosaic GPU's interpreter with its race
detector): the boxes it reads the images by (each at the input pixel the definition names, in
the compiled and the interpreted layout alike), the launches each pass makes and that they
read x and dY in place, the whole programs' bytes against XLA's, an explicit many-tile
schedule, and the depthwise plans. Its compiled kernels, whole programs and export:
tests/test_mosaic_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels._targets import TARGETS
from kernels.conv2d import Conv2dConfig, conv2d
from kernels.conv2d.common import make_problem
from kernels.reference.conv2d import geometry as make_geometry
from tests.support import assert_close, needs, random, skip_without_xla_gpu_compiler
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


class _Recorder:
    """A GMEM ref's stand-in: `.at[...]` returns the indices a box is taken at."""

    class _At:
        def __getitem__(self, index):
            return index

    at = _At()


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("x_shape,w_shape,options", GEOMETRIES)
def test_every_box_reads_the_pixels_its_tap_multiplies(x_shape, w_shape, options, interpret):
    """`tiles.Pixels`' pieces cover every output pixel once (rows of the grid past the last
    image and columns past OW aside), a slot's pieces never overlap, and each box of x, read
    through the view `config.image_operand` makes (its W axis in stride phases), starts at the
    input pixel the definition of a convolution names for the piece's first output at the
    tap: out·stride + tap·dilation - padding (before the padding XLA adds in the interpreter,
    which shifts the box's origin by as much). The weight gradient's pieces of 8 likewise."""
    from kernels.conv2d.mosaic_gpu.config import forward_pixels, weight_grad_sums
    from kernels.gemm.mosaic_gpu.config import WG_ROWS

    p = _problem(x_shape, w_shape, options)
    g = p.geometry
    for pixels in (forward_pixels(p, 1, interpret), weight_grad_sums(p, interpret).image):
        assert pixels.piece % 8 == 0 and pixels.piece <= WG_ROWS
        pieces = pixels.rows(p.n) // WG_ROWS * pixels.pieces_per_half
        covered = {}
        for q in range(pieces):
            n, r, c = pixels.pixel(q)
            for ow in range(c, min(c + pixels.piece, p.ow)):
                if n < p.n:
                    covered[n, r, ow] = covered.get((n, r, ow), 0) + 1
            for tap in range(p.kh * p.kw):
                kh, kw = divmod(tap, p.kw)
                box = pixels.tap_box(_Recorder(), q, tap, p.groups - 1, 0, None)
                _, h, columns, plane, _ = box
                phase = plane // p.groups
                assert plane % p.groups == p.groups - 1
                padding = [0 if interpret and before > 0 else before
                           for before, _ in g.padding]
                for axis, (start, out, k) in enumerate(((h, r, kh),
                                                        (columns.start * g.stride[1] + phase, c,
                                                         kw))):
                    # The view's column j of phase f is x's column j·stride_w + f.
                    want = out * g.stride[axis] + k * g.rhs_dilation[axis] - padding[axis]
                    assert start == want, (q, tap, axis, start, want)
        assert covered == {(n, r, c): 1 for n in range(p.n) for r in range(p.oh)
                           for c in range(p.ow)}


def _launches(fn, *args):
    from kernels.compile import launches

    return launches(fn, *args, target=TARGETS["sm_90"])


def test_each_pass_reads_the_images_in_place():
    """The forward is one launch whose A operand is x itself (a view of as many elements: no
    patches or other layout) and whose output is the NHWC result (as many elements), the weights
    K-major beside it. The training step adds the input gradient (one forward launch on dY)
    and the weight gradient, one launch on dY and x in place, split over pixels."""
    x_shape, w_shape = (8, 32, 32, 64), (3, 3, 64, 128)
    x, w = jnp.ones(x_shape, jnp.bfloat16), jnp.ones(w_shape, jnp.bfloat16)

    def forward(x, w):
        return conv2d(x, w, implementation="mosaic_gpu", interpret=False)

    (launch,) = _launches(forward, x, w)
    a, b = (v.aval for v in launch.invars[:2])
    assert a.size == x.size and a.dtype == x.dtype and len(a.shape) == 5
    assert b.shape == (1, 128, 9 * 64)
    (out,) = launch.outvars
    assert out.aval.size == 8 * 32 * 32 * 128

    loss = jax.grad(lambda x, w: jnp.sum(forward(x, w).astype(jnp.float32)), argnums=(0, 1))
    found = _launches(loss, x, w)
    names = [eqn.params["name"] for eqn in found]
    assert names.count("conv2d_mosaic_gpu") == 2, names  # forward, input gradient
    (weight_grad,) = [e for e in found if e.params["name"].startswith("conv2d_weight_grad")]
    dy, image = (v.aval for v in weight_grad.invars[:2])
    assert dy.size == 8 * 32 * 32 * 128 and image.size == x.size


# The two training layers and the inference layer issue 58 names, as `python -m bench`'s design
# rows count them: (case, training, most bytes against XLA's program).
_LAYER_BYTES = [("32x56x56x64 * 3x3x64x64 bfloat16", True, 1.15),
                ("32x28x28x128 * 3x3x128x256 bfloat16, stride=2", True, 1.15),
                ("32x56x56x64 * 3x3x64x64 bfloat16, activation=relu, bias", False, 0.5)]


@pytest.mark.timeout(600)
def test_whole_programs_move_about_what_xlas_move_on_an_h100():
    """The layers' whole programs compiled for one H100 (forward, and the gradients from a
    cotangent where training), bytes by XLA's cost analysis (`layer_program`): the ResNet
    layer and its stride-2 one within 1.15x XLA's, the fused inference layer under half."""
    from kernels.compile import CASES
    from kernels.compile.programs import layer_program

    skip_without_xla_gpu_compiler()
    for description, training, most in _LAYER_BYTES:
        case = next(c for c in CASES["conv2d"] if c.description == description)
        _, nbytes = layer_program(case, "sm_90", "mosaic_gpu", training=training)
        _, xla_bytes = layer_program(case, "sm_90", "xla", training=training)
        assert nbytes <= most * xla_bytes, (description, nbytes, xla_bytes)


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_whole_programs_move_about_what_xlas_move_on_a_b200():
    """As on an H100, for one B200 (in a process of its own: `_compiled`)."""
    from tests.test_mosaic_gpu import _compiled

    skip_without_xla_gpu_compiler()
    rows = _compiled(
        "import json\n"
        "from kernels.compile import use_compile_only_devices; use_compile_only_devices()\n"
        "from kernels.compile import CASES\n"
        "from kernels.compile.programs import layer_program\n"
        f"for description, training, _ in {_LAYER_BYTES!r}:\n"
        "    case = next(c for c in CASES['conv2d'] if c.description == description)\n"
        "    print(json.dumps({impl: layer_program(case, 'sm_100', impl, training=training)[1]\n"
        "                      for impl in ('mosaic_gpu', 'xla')}))\n")
    assert len(rows) == len(_LAYER_BYTES)
    for (description, _, most), row in zip(_LAYER_BYTES, rows):
        assert row["mosaic_gpu"] <= most * row["xla"], (description, row)


@pytest.mark.parametrize("block_n,width", [(64, 64), (128, 64), (32, 32), (48, 16)])
def test_the_epilogue_stores_from_slices_one_swizzle_span_wide(block_n, width):
    """The output is stored a box a piece from a swizzle-only view of the epilogue's slices,
    the same bytes as the tiled view the registers are stored to only where a slice's row is
    one swizzle span (32, 64 or 128 bytes): 16-bit slices of 64, 32 or 16 columns, the widest
    that divides block_n (`tiles.epilogue_width`)."""
    from kernels.conv2d.mosaic_gpu.config import forward_pixels
    from kernels.gemm.mosaic_gpu.tiles import epilogue_width

    pixels = forward_pixels(_problem((1, 8, 8, 64), (3, 3, 64, 64), {}), 1, False)
    out = jax.ShapeDtypeStruct((1,), jnp.bfloat16)
    assert epilogue_width(64, block_n, pixels, out, None) == width


def test_a_tile_whose_stores_no_swizzle_span_divides_is_declined():
    """24 16-bit columns (48 bytes) hold no whole span of 32 bytes or more: declined, naming
    block_n, before any kernel is traced."""
    x, w = _inputs((1, 8, 8, 64), (3, 3, 64, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_n must be a multiple of 16"):
        conv2d(x, w, implementation="mosaic_gpu", config=Conv2dConfig(block_m=128, block_n=24))


def test_many_tiles_and_k_steps_with_an_explicit_config():
    """130 channels (3 K slices of 64 a tap, the last overhanging: 27 K steps), stride 2,
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
