"""How big the Mosaic conv2d kernels' blocks are (the kernels themselves are in `forward.py` and
`backward.py` beside it): the staged input's geometry for a problem and a number of output rows
per step (`Layout`: stride phases, halo, padded widths), the channels and rows a step takes
(`resolve_config`), the VMEM a step plans (`vmem_bytes`) and the checks that decline a problem
or reject a config (`check`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels import _targets
from kernels._blocks import LANES, require_floating, round_up, sublanes
from kernels._epilogue import require_supported
from kernels._pallas import pl
from kernels.conv2d.common import Conv2dConfig, Problem

__all__ = ["Layout", "lane_channels", "resolve_config", "vmem_bytes", "check"]

_MAX_CHANNEL_BLOCK = 512
_TARGET_PIXELS = 512  # rows of the per-tap matmul a step aims for


class Layout:
    """The staged arrays' geometry for one problem and block_rows."""

    def __init__(self, p: Problem, block_rows: int):
        g = p.geometry
        self.phases = g.stride[0] * g.stride[1]
        self.halo = tuple(((k - 1) * d) // s for k, d, s in
                          zip((p.kh, p.kw), g.rhs_dilation, g.stride))
        tile = max(sublanes(p.x_dtype), sublanes(p.out_dtype), sublanes(p.w_dtype))
        self.block_rows = block_rows
        self.num_row_blocks = pl.cdiv(p.oh, block_rows)
        self.out_rows = self.num_row_blocks * block_rows
        self.out_cols = round_up(p.ow, tile)
        self.rows = self.out_rows + self.halo[0]
        self.cols = self.out_cols + self.halo[1]
        self.tile_rows = block_rows + self.halo[0]


def _channel_block(channels: int) -> int:
    """All channels, or the largest multiple of 128 (<= 512) dividing them."""
    if channels <= _MAX_CHANNEL_BLOCK or channels % LANES:
        return channels
    return next(b for b in (512, 384, 256, 128) if channels % b == 0)


def lane_channels(p: Problem) -> int:
    """The channel count a step blocks: per group (GEMM path) or the input channels
    (depthwise path, whose channel multiplier is a grid axis)."""
    return p.c if p.depthwise else p.og


def resolve_config(p: Problem, config: Conv2dConfig | None) -> Conv2dConfig:
    """Fills block_n (channels per step) and block_rows (about 512 output pixels a step)."""
    config = config or Conv2dConfig()
    out_cols = round_up(max(p.ow, 1), 16)
    block_rows = config.block_rows
    if block_rows is None:
        block_rows = max(1, min(max(p.oh, 1), _TARGET_PIXELS // out_cols))
    block_n = config.block_n
    if block_n is None:
        block_n = _channel_block(lane_channels(p))
    return dataclasses.replace(config, block_rows=block_rows, block_n=block_n)


def vmem_bytes(p: Problem, layout: Layout, block_n: int) -> int:
    """Double-buffered input tile, weights and output block (and a saved pre-activation), plus
    the float32 accumulator."""
    channels = block_n if p.depthwise else p.cg
    x_tile = layout.phases * layout.tile_rows * layout.cols * channels * p.x_dtype.itemsize
    weights = p.kh * p.kw * (1 if p.depthwise else p.cg) * block_n * p.w_dtype.itemsize
    out = layout.block_rows * layout.out_cols * block_n
    out_bytes = out * p.epilogue.bytes_per_output(p.out_dtype)
    return 2 * (x_tile + weights + out_bytes) + 4 * (out + weights)


def check(p: Problem, config: Conv2dConfig | None) -> None:
    """Declines float64, non-float operands and tiles that do not fit VMEM; rejects configs
    that break TPU tiling."""
    require_floating(x=p.x_dtype, w=p.w_dtype)
    require_supported(p.epilogue, p.x_dtype, p.w_dtype, p.out_dtype)
    if jnp.float64 in (p.x_dtype, p.w_dtype, p.out_dtype):
        raise NotImplementedError("float64 is not supported on TPU")
    config = resolve_config(p, config)
    channels = lane_channels(p)
    block_n = config.block_n
    if (not isinstance(block_n, int) or block_n < 1
            or (block_n != channels and (block_n % LANES or channels % block_n))):
        raise ValueError(f"config.block_n={block_n!r} breaks TPU tiling for mosaic: it must equal "
                         f"the {channels} output channels per group or be a multiple of 128 that "
                         "divides them")
    if not isinstance(config.block_rows, int) or config.block_rows < 1:
        raise ValueError(f"config.block_rows must be a positive int, got {config.block_rows!r}")
    needed, target = vmem_bytes(p, Layout(p, config.block_rows), block_n), _targets.current("tpu")
    if needed > target.vmem_budget:
        raise NotImplementedError(
            f"a step's tiles need {needed} bytes of VMEM, over {target.name}'s budget of "
            f"{target.vmem_budget}; this kernel keeps the whole padded width in one tile")
