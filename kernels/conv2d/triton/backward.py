"""conv2d's weight gradient as Pallas kernels lowered through Triton (GPU) (the package's
docstring has every kernel's loop nest; the input gradient is the forward kernel, `forward.py`).

Block schedules
---------------
Weight gradient (`weight_grad`), GEMM path: dW[K, O/G] = patches[M, K]ᵀ @ dY[M, O/G] per group.
  grid = (splits · num_k_blocks, cdiv(O/G, block_n), G); program (s·K blocks + i, j, g)
  sums pixel slices [s·per_split, (s+1)·per_split) of its (block_k, block_n) dW tile: per step
  it gathers the (block_m, block_k) patch tile exactly as the forward does and loads the
  (block_m, block_n) output-gradient tile; the transpose is folded into the dot. The dW tile
  (up to 128x128) shrinks until every SM has one (`fill_sms`: ResNet-50's 56x56 layers have
  only 2-9 tiles of 128x128), and where the tiles still leave SMs idle the pixels are split
  (`weight_grad_split`, at least two waves on an H100): each split writes a float32 partial dW, at
  most half the unsplit kernel's loads in all, and XLA adds the partials in a fixed order.
Weight gradient, float32 pixel-major path (`config.pixel_major`): TF32 instructions take
  K-major tiles only and both gathered operands above are contracted over pixels with channels
  contiguous, so their tiles would load 4 bytes at a time. Where the operands are reused enough
  to repay it, XLA copies them pixel-major first (`_pixel_major_operands`): the padded input
  split into its stride phases, each a (C, rows·cols·N) matrix with the batch fastest, and dY
  (O, OH·cols·N) on the same grid, zero past OW. Per tap, dW[tap] = X_phase[:, q + shift] @
  dY[:, q]ᵀ over the columns q: one constant column shift a tap (a multiple of N, so with N a
  multiple of 4 every tile row is an aligned run) and no gather. Same grid and splits as the
  GEMM path; program (s·K blocks + i, j, g) loads (block_k, block_m) input tiles from its tap's
  phase rows and (block_n, block_m) dY tiles, both K-major. The input columns paired with dY's
  zero padding are masked (they run into the next row), so an inf there cannot give 0·inf.
Weight gradient, depthwise path: grid = (splits · cdiv(KH·KW, block_k), cdiv(O, block_n)); a
  program owns block_k taps (all 9 of a 3x3) of its channel block over one pixel split: per
  step it loads the (block_m, block_n) dY tile once and, for each of its taps (unrolled),
  gathers the input tile and accumulates input·dY elementwise in that tap's float32 tile; it
  reduces them over pixels once at the end. So dY is read once per tap block, not once per
  tap (`_depthwise_weight_grad_config` sizes the tiles to stay in registers).
All tiles are powers of 2 >= 16 (Triton's rule and its dot's minimum); offsets are int32, so
arrays of 2³¹ elements or more are declined.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import Split, int32_loop
from kernels._pallas import pl, triton_call, triton_store
from kernels.conv2d.common import Conv2dConfig, Problem, flops_and_bytes
from kernels.conv2d.triton.config import (PixelMajor, num_k_blocks, pixel_major,
                                          weight_grad_config, weight_grad_grid,
                                          weight_grad_split, weight_grad_traffic)
from kernels.conv2d.triton.patches import (arange_valid, dot, gather_input, input_channel,
                                           k_block_at, load_2d, patch_tile, pixel_range, store_2d)

__all__ = ["weight_grad"]


def _pixel_split(pixels: int, config: Conv2dConfig, split: Split, grid_size: int):
    """(split index, first pixel block, pixel blocks) of this program: grid axis 0 is
    split-major, `grid_size` programs per split."""
    index = pl.program_id(0) // grid_size
    first, count = split.range_of(index, pl.cdiv(pixels, config.block_m))
    return index, first, count


def _weight_grad_kernel(x_ref, dy_ref, dw_ref, *, p: Problem, config: Conv2dConfig,
                        split: Split, precision):
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    num_blocks = num_k_blocks(p, block_k)
    split_index, first, count = _pixel_split(p.m, config, split, num_blocks)
    k, group = k_block_at(p, block_k, pl.program_id(0) % num_blocks), pl.program_id(2)
    col_start = group * p.og + pl.program_id(1) * block_n
    cols_valid = arange_valid(pl.program_id(1) * block_n, block_n, p.og)

    def step(i, acc):
        m_start = (first + i) * block_m
        pixels = pixel_range(p, m_start, block_m)
        patches = patch_tile(x_ref, p, group, pixels, k)
        dy = load_2d(dy_ref, m_start, pixels[0], col_start, cols_valid)
        return acc + dot(patches, dy, p, precision, transpose_a=True)

    acc = int32_loop(count, step, jnp.zeros((block_k, block_n), p.accumulator_dtype))
    store_2d(dw_ref, acc, split_index * p.k + k.start, k.valid, col_start, cols_valid)


def _pixel_major_weight_grad_kernel(x_ref, dy_ref, dw_ref, *, p: Problem, config: Conv2dConfig,
                                    split: Split, layout: PixelMajor, precision):
    block_q, block_n, block_k = config.block_m, config.block_n, config.block_k
    num_blocks, pixels = num_k_blocks(p, block_k), layout.pixels(p)
    split_index, first, count = _pixel_split(pixels, config, split, num_blocks)
    k, group = k_block_at(p, block_k, pl.program_id(0) % num_blocks), pl.program_id(2)
    phase, shift = layout.phase_and_shift(p, k.tap // p.kw, k.tap % p.kw)
    x_row = phase * p.c + group * p.cg + k.start - k.tap * p.cg  # the block's first channel
    col_start = group * p.og + pl.program_id(1) * block_n
    cols_valid = arange_valid(pl.program_id(1) * block_n, block_n, p.og)

    def step(i, acc):
        q_start = (first + i) * block_q
        q = q_start + jnp.arange(block_q, dtype=jnp.int32)
        # dY's padded columns (ow >= OW) are zeros, but their shifted input columns run into
        # the next row: masked, so an inf there cannot make 0·inf.
        ow = lax.rem(lax.div(q, jnp.int32(p.n)), jnp.int32(layout.cols))
        real = (q < pixels) & (ow < p.ow)
        x = load_2d(x_ref, x_row, k.valid, q_start + shift, real)
        dy = load_2d(dy_ref, col_start, cols_valid, q_start, q < pixels)
        return acc + dot(x, dy, p, precision, transpose_b=True)

    acc = int32_loop(count, step, jnp.zeros((block_k, block_n), p.accumulator_dtype))
    store_2d(dw_ref, acc, split_index * p.k + k.start, k.valid, col_start, cols_valid)


def _pixel_major_operands(x: jax.Array, dy: jax.Array, p: Problem,
                          layout: PixelMajor) -> tuple[jax.Array, jax.Array]:
    """x and dY copied (by XLA) into `layout`: the padded input's stride phases, each
    (C, rows·cols·N), stacked; dY (O, OH·cols·N), its columns past OW zero."""
    (sh, sw), ((top, _), (left, _)) = p.geometry.stride, p.geometry.padding
    padded = lax.pad(x, jnp.zeros((), x.dtype), (
        (0, 0, 0), (top, layout.rows * sh - p.h - top, 0),
        (left, layout.cols * sw - p.w - left, 0), (0, 0, 0)))
    phases = padded.reshape(p.n, layout.rows, sh, layout.cols, sw, p.c).transpose(2, 4, 5, 1, 3, 0)
    dy = jnp.pad(dy, ((0, 0), (0, 0), (0, layout.cols - p.ow), (0, 0))).transpose(3, 1, 2, 0)
    return (phases.reshape(sh * sw * p.c, layout.rows * layout.cols * p.n),
            dy.reshape(p.o, layout.pixels(p)))


def _depthwise_weight_grad_kernel(x_ref, dy_ref, dw_ref, *, p: Problem, config: Conv2dConfig,
                                  split: Split):
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    num_blocks = num_k_blocks(p, block_k)
    split_index, first, count = _pixel_split(p.m, config, split, num_blocks)
    first_tap, col_start = (pl.program_id(0) % num_blocks) * block_k, pl.program_id(1) * block_n
    taps = [first_tap + t for t in range(block_k)]
    out_channel = col_start + jnp.arange(block_n, dtype=jnp.int32)
    cols_valid = out_channel < p.o
    in_channel = input_channel(p, out_channel)[None, :]

    def step(i, accs):
        m_start = (first + i) * block_m
        m_valid, n, oh, ow = pixel_range(p, m_start, block_m)
        valid = m_valid[:, None] & cols_valid[None, :]
        dy = load_2d(dy_ref, m_start, m_valid, col_start, cols_valid).astype(accs[0].dtype)
        return tuple(
            acc + gather_input(x_ref, p, n[:, None], oh[:, None], ow[:, None],
                                lax.div(tap, jnp.int32(p.kw)), lax.rem(tap, jnp.int32(p.kw)),
                                in_channel, valid).astype(acc.dtype) * dy
            for acc, tap in zip(accs, taps))

    accs = int32_loop(count, step, tuple(
        jnp.zeros((block_m, block_n), p.accumulator_dtype) for _ in taps))
    for tap, acc in zip(taps, accs):
        triton_store(dw_ref.at[split_index * p.k + tap, pl.ds(col_start, block_n)],
                     acc.sum(axis=0).astype(dw_ref.dtype), mask=cols_valid & (tap < p.k))


def weight_grad(x: jax.Array, dy: jax.Array, p: Problem, *, precision, interpret: bool | str,
                dtype: jnp.dtype) -> jax.Array:
    """dW (KH, KW, C/G, O) in `dtype` of problem `p` from its input and output gradient."""
    config, layout = weight_grad_config(p), pixel_major(p, precision)
    pixels = None if layout is None else layout.pixels(p)
    split = weight_grad_split(p, config, pixels)
    operands = (x.reshape(-1), dy.reshape(p.m, p.o))
    if layout is not None:
        kernel = functools.partial(_pixel_major_weight_grad_kernel, p=p, config=config,
                                   split=split, layout=layout, precision=precision)
        operands = _pixel_major_operands(x, dy, p, layout)
    elif p.depthwise:
        kernel = functools.partial(_depthwise_weight_grad_kernel, p=p, config=config,
                                   split=split)
    else:
        kernel = functools.partial(_weight_grad_kernel, p=p, config=config, split=split,
                                   precision=precision)
    rows, cols, groups = weight_grad_grid(p, config)
    out_dtype = dtype if split.splits == 1 else jnp.float32
    dw = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split.splits * p.k, p.o), out_dtype),
        grid=(split.splits * rows, cols, groups),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        bytes_accessed=weight_grad_traffic(p, config, dy.dtype, dtype, split.splits, pixels),
        name="conv2d_depthwise_weight_grad_triton" if p.depthwise else "conv2d_weight_grad_triton",
    )(*operands)
    if split.splits > 1:  # XLA's reduction: a fixed order, the same sum on every run
        dw = dw.reshape(split.splits, p.k, p.o).sum(axis=0).astype(dtype)
    return dw.reshape(p.kh, p.kw, p.cg, p.o)
