"""How the Mosaic GPU conv2d runs on the GEMM engine (the launches are in `forward.py` beside
it): the images as the engine reads them in place (`forward_pixels`, `image_operand`,
`weight_grad_sums`, `output_grad_operand`), the GEMM each pass runs (`forward_problem`,
`weight_grad_problem`) and the checks that decline a problem (`check`)."""

from __future__ import annotations


import jax
import jax.numpy as jnp

from kernels._blocks import require_floating, round_up
from kernels._pallas import pl
from kernels._pallas.mosaic_gpu import aligned_columns, pad_to
from kernels.conv2d.common import Conv2dConfig, Problem
from kernels.matmul.common import MatmulConfig, Problem as MatmulProblem
from kernels.gemm.mosaic_gpu import config as gemm_config
from kernels.gemm.mosaic_gpu import tiles
from kernels.gemm.mosaic_gpu.tiles import ONE_TERM

__all__ = ["k_slice", "image_channels", "output_channels", "forward_pixels", "image_operand",
           "forward_problem", "forward_plan", "forward_terms", "forward_config",
           "weight_grad_sums", "weight_grad_problem", "weight_grad_plan",
           "weight_grad_in_place", "output_grad_operand", "is_depthwise", "summed_depthwise",
           "check", "resolve_config", "WEIGHT_GRAD_PIXELS"]


def _gemm_of(p: Problem, rows: int = 1, k: int = 1) -> MatmulProblem:
    return MatmulProblem(
        (p.groups,), (p.groups,), (p.groups,), rows, p.og, k, False, True, p.x_dtype,
        p.w_dtype, p.out_dtype, p.epilogue, p.highest)


def k_slice(p: Problem) -> int:
    """Channels a K slice of the forward: one swizzle span of the dtype the MMA takes
    (`gemm_config.kernel_problem`: 64 16-bit channels, 32 float32 ones for TF32), the plan's
    block_k."""
    compute = gemm_config.kernel_problem(_gemm_of(p)).compute_dtype
    return gemm_config.SWIZZLE // jnp.dtype(compute).itemsize


def image_channels(p: Problem) -> int:
    """A group's channels as the forward's image operand holds them: C/G where TMA can box
    them in place (a K slice or more, rows a multiple of 16 bytes), else padded by XLA."""
    itemsize = jnp.dtype(forward_problem(p).a_dtype).itemsize
    return aligned_columns(max(p.cg, k_slice(p)), itemsize)


def output_channels(p: Problem) -> int:
    """A group's channels as the forward's kernel stores them: O/G, or where its rows are not
    a multiple of 16 bytes (TMA's stride rule, for the output and z alike) padded, the
    padding cut off by XLA (a copy)."""
    itemsize = min(jnp.dtype(p.out_dtype).itemsize, jnp.dtype(p.epilogue.saved or p.out_dtype)
                   .itemsize)
    return aligned_columns(p.og, itemsize)


def forward_pixels(p: Problem, parts: int, interpret: bool | str) -> tiles.Pixels:
    """How the forward reads x in place (`tiles.Pixels`): output rows in pieces of OW rounded
    up to 8 pixels (at most 64), the padding as TMA's zeros; interpreted, x padded at the top
    and left by XLA instead (`image_operand`)."""
    g = p.geometry
    (top, _), (left, _) = g.padding
    origin = ((max(top, 0) - top, max(left, 0) - left) if interpret else (-top, -left))
    return tiles.Pixels(
        (p.oh, p.ow), min(round_up(p.ow, gemm_config.TMA_ROWS), gemm_config.WG_ROWS),
        (p.kh, p.kw),
        g.stride, g.rhs_dilation, origin, p.groups, parts, pl.cdiv(p.cg, k_slice(p)),
        swizzled_boxes=not interpret)


def image_operand(parts: list[jax.Array], p: Problem, dtype, interpret: bool | str
                  ) -> jax.Array:
    """x's parts as `tiles.Pixels` reads them, (N, H, W / stride_w, stride_w·G·parts,
    `image_channels`): a reshape of x where it is one part of the MMA's dtype with whole
    channel rows and W a multiple of the stride; else one XLA copy (the parts, padded
    channels or columns; interpreted, the top and left padding)."""
    g = p.geometry
    (top, _), (left, _) = g.padding
    pad_top, pad_left = (max(top, 0), max(left, 0)) if interpret else (0, 0)
    stride_w = g.stride[1]
    width = round_up(p.w + pad_left, stride_w)
    channels = image_channels(p)

    def laid_out(part):
        part = part.astype(dtype).reshape(p.n, p.h, p.w, p.groups, p.cg)
        return jnp.pad(part, ((0, 0), (pad_top, 0), (pad_left, width - p.w - pad_left), (0, 0),
                              (0, channels - p.cg)))

    x = jnp.stack([laid_out(part) for part in parts], axis=4)
    return x.reshape(p.n, p.h + pad_top, width // stride_w,
                     stride_w * p.groups * len(parts), channels)


def forward_problem(p: Problem) -> MatmulProblem:
    """The forward as the GEMM engine's problem (`gemm_config.kernel_problem`: 16-bit
    operands of one dtype as they are, others as float32 on Hopper and as split bfloat16 on
    Blackwell), one batch per group: A the images' output pixels (`forward_pixels`), K each
    tap's channels, B the weights K-major (O/G padded, KH·KW·parts·C/G padded to whole K
    slices); with split parts, the problem of one part (`forward_terms`)."""
    return gemm_config.kernel_problem(_forward_gemm(p))


def _forward_gemm(p: Problem) -> MatmulProblem:
    """The forward's GEMM: M the slot rows of the output pixels' pieces, K each tap's
    channels in whole K slices."""
    block_k = k_slice(p)
    return _gemm_of(p, forward_pixels(p, 1, False).rows(p.n),
                    p.kh * p.kw * round_up(p.cg, block_k))


def forward_plan(p: Problem, config: Conv2dConfig | None) -> gemm_config.Plan:
    """The forward's launch, planned for the problem as given (Blackwell's split parts take
    narrower tiles: `gemm_config.tcgen05_columns`)."""
    return gemm_config.plan_of(_forward_gemm(p), forward_config(config))


def forward_terms(p: Problem) -> tuple[tuple[int, int], ...]:
    """The (part of x, part of w) products the forward sums along each tap's K: on
    Blackwell, float32 and mixed data as the engine's split bfloat16 parts
    (`gemm_config.split_terms`), x's parts side by side in its planes and w's in each tap's
    K, once; else one (`tiles.ONE_TERM`)."""
    gemm = _forward_gemm(p)
    return gemm_config.split_terms(gemm) if gemm_config.is_split(gemm) else ONE_TERM


def forward_config(config: Conv2dConfig | None) -> MatmulConfig:
    """The engine's config of a forward: the conv config's tile, one K split (its output is
    stored as images, with no partials to sum)."""
    config = config or Conv2dConfig()
    return MatmulConfig(config.block_m, config.block_n, None, num_stages=config.num_stages,
                        split_k=1)


def weight_grad_sums(p: Problem, interpret: bool | str) -> tiles.PixelSums:
    """How the weight gradient reads x and dY in place (`tiles.PixelSums`): K slices of
    `WEIGHT_GRAD_PIXELS` output pixels in pieces of 8, x boxed as the forward's
    (`forward_pixels`)."""
    image = forward_pixels(p, 1, interpret)._replace(piece=gemm_config.TMA_ROWS)
    return tiles.PixelSums(image, p.kh * p.kw, WEIGHT_GRAD_PIXELS // gemm_config.TMA_ROWS,
                           gemm_config.SWIZZLE // jnp.dtype(p.x_dtype).itemsize)


# Output pixels a K slice of the weight gradient: 64 16-bit rows, one swizzle span (Blackwell
# wants a K slice of whole spans).
WEIGHT_GRAD_PIXELS = 64


def _weight_grad_gemm(p: Problem, dy_dtype, dw_dtype) -> MatmulProblem:
    sums = weight_grad_sums(p, False)
    pieces = p.n * p.oh * sums.image.pieces_per_row
    batches = (p.groups * p.kh * p.kw,)
    return MatmulProblem(
        batches, batches, batches, p.og, p.cg,
        pl.cdiv(pieces, sums.slice_pieces) * WEIGHT_GRAD_PIXELS, True, False, dy_dtype,
        p.x_dtype, dw_dtype, highest=p.highest)


def weight_grad_problem(p: Problem, dy_dtype, dw_dtype) -> MatmulProblem:
    """The weight gradient as the GEMM engine's problem, one batch per (group, tap):
    dWᵀ[g, t] (O/G, C/G) = dY[g]ᵀ x[g, tap t] over the output pixels (`tiles.PixelSums`)."""
    return gemm_config.kernel_problem(_weight_grad_gemm(p, dy_dtype, dw_dtype))


def weight_grad_plan(p: Problem, dy_dtype, dw_dtype) -> gemm_config.Plan:
    """Tiles of 128 output channels (a Hopper consumer's 64 each; tcgen05's rows) by 64 input
    channels (x's boxes: one swizzle span), K slices of `WEIGHT_GRAD_PIXELS`, split along
    the pixels where the tiles leave SMs idle (float32 partials that XLA sums)."""
    return gemm_config.plan_of(_weight_grad_gemm(p, dy_dtype, dw_dtype), MatmulConfig(
        gemm_config.TCGEN05_ROWS, gemm_config.TMA_COLUMNS, WEIGHT_GRAD_PIXELS))


def weight_grad_in_place(p: Problem, dy_dtype, dw_dtype) -> bool:
    """Whether the weight gradient reads x and dY in place (`tiles.PixelSums`): 16-bit
    operands of one dtype, which the MMA takes M-major (dY's pixels are its K). Else (TF32
    takes K-major tiles only; Blackwell's split parts lie along K) XLA copies each tap's
    window of x for the engine's matmul (`forward.weight_grad`)."""
    gemm = _weight_grad_gemm(p, dy_dtype, dw_dtype)
    return gemm_config.kernel_problem(gemm).transpose_a and not gemm_config.is_split(gemm)


def output_grad_operand(dy: jax.Array, p: Problem) -> jax.Array:
    """dY as `tiles.PixelSums` reads it, (N, OH, OW, G, O/G): a reshape, or where a group's
    channels are not a multiple of 16 bytes (TMA's stride rule) one XLA copy padded with
    zeros."""
    dy = dy.reshape(p.n, p.oh, p.ow, p.groups, p.og)
    return pad_to(dy, aligned_columns(p.og, dy.dtype.itemsize))


def resolve_config(p: Problem, config: Conv2dConfig | None) -> Conv2dConfig:
    """The forward's tiles as the engine resolves them for `forward_problem`."""
    resolved = gemm_config.resolve_config(_forward_gemm(p), forward_config(config))
    return Conv2dConfig(resolved.block_m, resolved.block_n, num_stages=resolved.num_stages)


# Input channels a group below which a grouped convolution of one output channel a group runs
# as a depthwise one (`summed_depthwise`): wgmma's K is 16 (its tile pads a group's tap
# to 64 columns, and its one output channel to 64).
MIN_GEMM_CHANNELS = 16


def is_depthwise(p: Problem) -> bool:
    """One input channel a group, several groups: the depthwise kernels (no product for
    wgmma)."""
    return p.depthwise and p.groups > 1


def summed_depthwise(p: Problem) -> bool:
    """A few input channels and one output channel a group (the input gradient of a depthwise
    convolution with a channel multiplier): a depthwise convolution of every input channel,
    each group's channels then summed by XLA."""
    return p.groups > 1 and p.og == 1 and 1 < p.cg < MIN_GEMM_CHANNELS


def check(p: Problem, config: Conv2dConfig | None) -> None:
    """Declines what the engine declines for the forward's GEMM (float64, HIGHEST) and
    integer data, the depthwise path alike (its FMAs keep the GEMM path's contract); rejects a
    config that is not a valid tiling of the GEMM (the depthwise path takes none)."""
    require_floating(x=p.x_dtype, w=p.w_dtype)
    if config is not None and (config.block_k, config.block_rows, config.num_warps) != (
            None, None, None):
        raise ValueError(f"Mosaic GPU conv2d takes block_m, block_n and num_stages (its K slice "
                         f"is TMA's swizzle span), got {config}")
    # The problem as given, not as laid out (`forward_problem`): Blackwell's split parts are
    # bfloat16, which would hide float32 at HIGHEST from the engine's check.
    gemm_config.check(_forward_gemm(p), forward_config(config))
    itemsize = max(jnp.dtype(p.out_dtype).itemsize,
                   jnp.dtype(p.epilogue.saved or p.out_dtype).itemsize)
    tiles.check_stored_columns(resolve_config(p, config).block_n, itemsize)
