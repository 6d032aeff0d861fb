"""The staged input and the shifted windows both conv2d passes read (`forward.py`,
`backward.py`): the wrapper's one XLA copy of the input, its tiles' BlockSpec, each tap's
window of a tile, and the one dot.

Staging (in the wrapper, one XLA copy of the input)
---------------------------------------------------
This first version pads in the wrapper: `lax.pad` applies the padding (negative: a crop) and
enough extra zero rows and columns that every block is whole, and the stride is removed by
splitting the padded image into stride_h·stride_w phases: phase (a, b) holds the padded pixels
(i·stride_h + a, j·stride_w + b). Tap (kh, kw) of output pixel (oh, ow) is then pixel
(oh + kh·dh // sh, ow + kw·dw // sw) of phase (kh·dh % sh, kw·dw % sw) (dh, dw: the kernel
dilation): an unstrided window, so each tap is a static, contiguous slice of a VMEM tile.
Groups become a separate array axis (GEMM path) so a block never straddles them. The output is
computed on a grid of whole blocks (OH rounded up to block_rows, OW to a multiple of the
sublane tile so a (rows, OW, C) window reshapes to a (rows·OW, C) matrix without relayout) and
cropped afterwards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels._pallas import pl
from kernels.conv2d.common import Conv2dConfig, Problem
from kernels.conv2d.mosaic.config import Layout, resolve_config

__all__ = ["crop_or_pad", "dot", "input_spec", "stage_input", "staged_input", "staged_x",
           "tap_list", "window_at"]


def crop_or_pad(x: jax.Array, pads: list[tuple[int, int]]) -> jax.Array:
    """`lax.pad` whose negative padding (a crop) is applied after the positive part, so no
    intermediate shape is negative."""
    grown = lax.pad(x, jnp.zeros((), x.dtype), [(max(lo, 0), max(hi, 0), 0) for lo, hi in pads])
    starts = [max(-lo, 0) for lo, _ in pads]
    limits = [size - max(-hi, 0) for size, (_, hi) in zip(grown.shape, pads)]
    return lax.slice(grown, starts, limits)


def stage_input(x: jax.Array, p: Problem, layout: Layout) -> jax.Array:
    """(N, H, W, C) -> (N, sh·sw, rows, cols, G, C/G): padded and split into phases."""
    (sh, sw), padding = p.geometry.stride, p.geometry.padding
    pads = [(0, 0), (padding[0][0], layout.rows * sh - p.h - padding[0][0]),
            (padding[1][0], layout.cols * sw - p.w - padding[1][0]), (0, 0)]
    phased = crop_or_pad(x, pads).reshape(p.n, layout.rows, sh, layout.cols, sw, p.groups, p.cg)
    return phased.transpose(0, 2, 4, 1, 3, 5, 6).reshape(
        p.n, layout.phases, layout.rows, layout.cols, p.groups, p.cg)


def window_at(x_ref, p: Problem, layout: Layout, kh: int, kw: int, lead: tuple) -> jax.Array:
    """The (block_rows, out_cols, channels) input window that tap (kh, kw) multiplies."""
    (sh, sw), (dh, dw) = p.geometry.stride, p.geometry.rhs_dilation
    phase = (kh * dh % sh) * sw + kw * dw % sw
    return x_ref[(*lead, phase, pl.ds(kh * dh // sh, layout.block_rows),
                  pl.ds(kw * dw // sw, layout.out_cols), slice(None))]


def tap_list(p: Problem):
    return [(kh, kw) for kh in range(p.kh) for kw in range(p.kw)]


def dot(a, b, p: Problem, precision, transpose_a: bool = False):
    dims = (((0,) if transpose_a else (1,), (0,)), ((), ()))
    return lax.dot_general(a.astype(p.compute_dtype), b.astype(p.compute_dtype), dims,
                           precision=precision, preferred_element_type=jnp.float32)


def input_spec(p: Problem, layout: Layout, channels: int, index):
    """Element-indexed input tile: block_rows output rows plus the halo, so tiles overlap.

    `index(grid indices) -> (n, g, row_block, channel_block)`."""
    rows, cols = layout.tile_rows, layout.cols

    def index_map(*grid):
        n, group, row_block, channel_block = index(*grid)
        if p.depthwise:
            # A literal 0 when one block holds every channel: Mosaic must prove a lane offset
            # is a multiple of 128, and cannot from `channel_block * channels` when C < 128.
            first_channel = 0 if channels == p.c else channel_block * channels
            return (n, 0, row_block * layout.block_rows, 0, first_channel)
        return (n, group, 0, row_block * layout.block_rows, 0, 0)

    if p.depthwise:
        block = (1, layout.phases, rows, cols, channels)
    else:
        block = (1, 1, layout.phases, rows, cols, channels)
    return pl.BlockSpec(tuple(pl.Element(b) for b in block), index_map)


def staged_x(x: jax.Array, p: Problem, layout: Layout) -> jax.Array:
    staged = stage_input(x, p, layout)
    if p.depthwise:  # channels (one per group) in the lanes
        return staged.reshape(*staged.shape[:4], p.c)
    return staged.transpose(0, 4, 1, 2, 3, 5)  # (N, G, phases, rows, cols, C/G)


def staged_input(x: jax.Array, p: Problem, config: Conv2dConfig | None = None) -> jax.Array:
    """The wrapper's one XLA copy of the input (padded, dilated, phase-split) that `conv`
    feeds the kernel; the bench times it alone to show what padding in the wrapper costs."""
    return staged_x(x, p, Layout(p, resolve_config(p, config).block_rows))
