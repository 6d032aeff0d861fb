"""conv2d as Pallas kernels lowered through Triton (GPU): implicit GEMM.

Each kernel's loop nest, per program (blocks and splits: `triton_config.py`):

    forward, GEMM path:   for kb in range(num_k_blocks):            # (tap, channel slice)
                              acc += patches[i, kb] @ w[kb, j]      # patches gathered, masked
                          out[i, j] = acc
    forward, depthwise:   for tap in range(KH * KW):
                              acc += x[pixels(i) + tap, channels(j)] * w[tap, j]
                          out[i, j] = acc
    dW, GEMM path:        for pb in pixel blocks of split s:
                              acc += patches[pb, kb]^T @ dy[pb, j]
                          dw[s, kb, j] = acc                        # partials summed by XLA
    dW, depthwise:        for pb in pixel blocks of split s:
                              for tap in taps(kb):                  # unrolled
                                  acc[tap] += x[pixels(pb) + tap, j] * dy[pb, j]
                          dw[s, tap, j] = sum over pixels of acc[tap]

The convolution is the GEMM out[M, O] = patches[M, K] @ w[K, O] per group, with M = N·OH·OW
output pixels and K = KH·KW·C_in/G (taps times input channels, channel fastest). The patch
matrix is never built in HBM: each program gathers its tile of it straight from the NHWC input
with masked pointer loads, computing for every (pixel, tap) the input position
`oh·stride + kh·dilation - pad_lo`; positions in the padding or past an edge are masked off and
read as zero. So strides, dilations and every padding form (negative: a crop) cost nothing extra
in HBM.

K is walked in blocks that stay inside one tap when a group has 16 or more input channels
(`tap_major`): a block is (tap, channel slice), its tap is one scalar per step, and each patch
row is a run of consecutive channels of one input pixel. The compiler then issues 16-byte
vector loads and pipelines them with `cp.async` like the weight tiles (the compile report's
`load_bytes`); a block that spanned taps would need a division per element and scalar 2-byte
loads. Groups of fewer channels (an RGB stem) keep blocks that span taps: per-tap blocks would
be mostly padding.

Block schedules
---------------
Forward (`conv`), GEMM path (C_in/G > 1):
  grid = (cdiv(M, block_m), cdiv(O/G, block_n), G). Program (i, j, g) owns the output tile of
  block_m pixels x block_n channels of group g. It loops over the K blocks (`num_k_blocks`):
  gathers a (block_m, block_k) patch tile (masked), loads the (block_k, block_n) weight tile
  (masked past K and past the group's channels), and accumulates their dot in float32 (float64
  for float64) registers; 16-bit inputs are multiplied on the tensor cores with float32
  accumulation. The tile is cast and stored once, masked to the array. Traffic: the output is
  written once, the weights read cdiv(M, block_m) times, each input pixel about KH·KW/stride²
  times per column block (mostly from L2/L1: neighbouring pixels share it).
Forward, depthwise path (C_in/G == 1, each output channel reads one input channel):
  grid = (cdiv(M, block_m), cdiv(O, block_n)). A program loops over the KH·KW taps; each step
  gathers the (block_m, block_n) input values of that tap for its pixels and channels
  (channel = out_channel // (O/G)) and FMAs them with the tap's weight row in float32. No dot:
  a dot with K = 1 would leave the tensor cores multiplying padding.
Weight gradient (`weight_grad`), GEMM path: dW[K, O/G] = patches[M, K]ᵀ @ dY[M, O/G] per group.
  grid = (splits · num_k_blocks, cdiv(O/G, block_n), G); program (s·K blocks + i, j, g)
  sums pixel slices [s·per_split, (s+1)·per_split) of its (block_k, block_n) dW tile: per step
  it gathers the (block_m, block_k) patch tile exactly as the forward does and loads the
  (block_m, block_n) output-gradient tile; the transpose is folded into the dot. The dW tile
  (up to 128x128) shrinks until every SM has one (`fill_sms`: ResNet-50's 56x56 layers have
  only 2-9 tiles of 128x128), and where the tiles still leave SMs idle the pixels are split
  (`weight_grad_split`, at least two waves on an H100): each split writes a float32 partial dW, at
  most half the unsplit kernel's loads in all, and XLA adds the partials in a fixed order.
Weight gradient, depthwise path: grid = (splits · cdiv(KH·KW, block_k), cdiv(O, block_n)); a
  program owns block_k taps (all 9 of a 3x3) of its channel block over one pixel split: per
  step it loads the (block_m, block_n) dY tile once and, for each of its taps (unrolled),
  gathers the input tile and accumulates input·dY elementwise in that tap's float32 tile; it
  reduces them over pixels once at the end. So dY is read once per tap block, not once per
  tap (`_depthwise_weight_grad_config` sizes the tiles to stay in registers).
The input gradient is the forward kernel run on the output gradient, one launch per sub-pixel
phase when the forward is strided (see `kernels.conv2d`).

All tiles are powers of 2 >= 16 (Triton's rule and its dot's minimum); offsets are int32, so
arrays of 2³¹ elements or more are declined.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels._blocks import Split, int32_loop
from kernels._pallas import pl, triton_call, triton_load, triton_store
from kernels.conv2d.common import Conv2dConfig, Problem, flops_and_bytes
# How big the blocks are and what they cost; `check` is this module's, as each backend's is.
from kernels.conv2d.triton_config import (check, forward_traffic, num_k_blocks, resolve_config,
                                          tap_major, weight_grad_config, weight_grad_grid,
                                          weight_grad_split, weight_grad_traffic)

__all__ = ["check", "conv", "weight_grad"]


def _source(p: Problem, out_pos, tap, axis: int):
    """Input index along `axis` read by output position `out_pos` at kernel tap `tap`, and
    whether it is a real pixel (not padding)."""
    g = p.geometry
    pos = out_pos * g.stride[axis] + tap * g.rhs_dilation[axis] - g.padding[axis][0]
    return pos, (pos >= 0) & (pos < (p.h, p.w)[axis])


def _input_channel(p: Problem, out_channel):
    """The input channel a depthwise output channel reads (a plain copy at multiplier 1, so
    the compiler still sees consecutive channels)."""
    return out_channel if p.og == 1 else lax.div(out_channel, jnp.int32(p.og))


def _pixels(p: Problem, start, size: int):
    """Flat output pixels start..start+size-1 as (valid, n, oh, ow) vectors."""
    m = start + jnp.arange(size, dtype=jnp.int32)
    n = lax.div(m, jnp.int32(p.oh * p.ow))
    rest = lax.rem(m, jnp.int32(p.oh * p.ow))
    return m < p.m, n, lax.div(rest, jnp.int32(p.ow)), lax.rem(rest, jnp.int32(p.ow))


def _gather_input(x_ref, p: Problem, n, oh, ow, kh, kw, channel, valid):
    """Input values at (pixel, tap, channel) (broadcastable int32 arrays) of the flat NHWC
    input; padding, edges and `~valid` read 0 and touch no memory.

    Out-of-image positions are clamped before the channel is added, so where the pixel and tap
    are per row and the channel per column (a tile of one tap), every row is a run of
    consecutive, aligned addresses: Triton's axis analysis sees it and issues 16-byte vector
    loads, which its pipeliner turns into `cp.async` copies a few K steps ahead."""
    ih, valid_h = _source(p, oh, kh, 0)
    iw, valid_w = _source(p, ow, kw, 1)
    position_valid = valid_h & valid_w
    position = jnp.where(position_valid, (n * p.h + ih) * p.w + iw, 0)
    return triton_load(x_ref.at[position * p.c + channel], mask=valid & position_valid,
                       other=0)


class KBlock(NamedTuple):
    """Rows [start, start + block_k) of a group's K = taps x channels axis as one K step sees
    them: `tap` a scalar when the block lies in one tap, else per row like `channel`."""

    start: Any
    tap: Any
    channel: jax.Array
    valid: jax.Array


def _k_block(p: Problem, block_k: int, index) -> KBlock:
    """K block `index` of `num_k_blocks`: tap-major blocks are (tap, channel block) pairs, so
    the per-element tap arithmetic becomes one scalar division per step."""
    lanes = jnp.arange(block_k, dtype=jnp.int32)
    if tap_major(p):
        per_tap = pl.cdiv(p.cg, block_k)
        tap, first_channel = index // per_tap, (index % per_tap) * block_k
        channel = first_channel + lanes
        return KBlock(tap * p.cg + first_channel, tap, channel, channel < p.cg)
    k = index * block_k + lanes
    return KBlock(index * block_k, lax.div(k, jnp.int32(p.cg)), lax.rem(k, jnp.int32(p.cg)),
                  k < p.k)


def _patch_tile(x_ref, p: Problem, group, pixels, k: KBlock):
    """The (block_m, block_k) tile of the implicit im2col matrix of `group`."""
    m_valid, n, oh, ow = pixels
    kh, kw = lax.div(k.tap, jnp.int32(p.kw)), lax.rem(k.tap, jnp.int32(p.kw))
    if jnp.ndim(k.tap):
        kh, kw = kh[None, :], kw[None, :]
    return _gather_input(x_ref, p, n[:, None], oh[:, None], ow[:, None], kh, kw,
                         group * p.cg + k.channel[None, :], m_valid[:, None] & k.valid[None, :])


def _load_2d(ref, row_start, rows_valid, col_start, cols_valid):
    view = ref.at[pl.ds(row_start, rows_valid.shape[0]), pl.ds(col_start, cols_valid.shape[0])]
    return triton_load(view, mask=rows_valid[:, None] & cols_valid[None, :], other=0)


def _store_2d(ref, value, row_start, rows_valid, col_start, cols_valid):
    view = ref.at[pl.ds(row_start, rows_valid.shape[0]), pl.ds(col_start, cols_valid.shape[0])]
    triton_store(view, value.astype(ref.dtype), mask=rows_valid[:, None] & cols_valid[None, :])


def _arange_valid(start, size: int, limit: int):
    return start + jnp.arange(size, dtype=jnp.int32) < limit


def _dot(a, b, p: Problem, precision, transpose_a: bool = False):
    dims = (((0,) if transpose_a else (1,), (0,)), ((), ()))
    return lax.dot_general(a.astype(p.compute_dtype), b.astype(p.compute_dtype), dims,
                           precision=precision, preferred_element_type=p.accumulator_dtype)


def _conv_kernel(x_ref, w_ref, out_ref, *, p: Problem, config: Conv2dConfig, precision):
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    row_start, group = pl.program_id(0) * block_m, pl.program_id(2)
    col_start = group * p.og + pl.program_id(1) * block_n
    pixels = _pixels(p, row_start, block_m)
    cols_valid = _arange_valid(pl.program_id(1) * block_n, block_n, p.og)

    def step(k_block, acc):
        k = _k_block(p, block_k, k_block)
        patches = _patch_tile(x_ref, p, group, pixels, k)
        weights = _load_2d(w_ref, k.start, k.valid, col_start, cols_valid)
        return acc + _dot(patches, weights, p, precision)

    acc = int32_loop(num_k_blocks(p, block_k), step,
                        jnp.zeros((block_m, block_n), p.accumulator_dtype))
    _store_2d(out_ref, acc, row_start, pixels[0], col_start, cols_valid)


def _depthwise_kernel(x_ref, w_ref, out_ref, *, p: Problem, config: Conv2dConfig):
    block_m, block_n = config.block_m, config.block_n
    row_start, col_start = pl.program_id(0) * block_m, pl.program_id(1) * block_n
    m_valid, n, oh, ow = _pixels(p, row_start, block_m)
    out_channel = col_start + jnp.arange(block_n, dtype=jnp.int32)
    cols_valid = out_channel < p.o
    in_channel = _input_channel(p, out_channel)
    valid = m_valid[:, None] & cols_valid[None, :]

    def step(tap, acc):
        kh, kw = lax.div(tap, jnp.int32(p.kw)), lax.rem(tap, jnp.int32(p.kw))
        values = _gather_input(x_ref, p, n[:, None], oh[:, None], ow[:, None], kh, kw,
                               in_channel[None, :], valid)
        weights = triton_load(w_ref.at[tap, pl.ds(col_start, block_n)], mask=cols_valid,
                              other=0)
        return acc + values.astype(acc.dtype) * weights.astype(acc.dtype)[None, :]

    acc = int32_loop(p.kh * p.kw, step,
                        jnp.zeros((block_m, block_n), p.accumulator_dtype))
    _store_2d(out_ref, acc, row_start, m_valid, col_start, cols_valid)


def conv(x: jax.Array, w: jax.Array, p: Problem, *, config: Conv2dConfig | None, precision,
         interpret: bool | str) -> jax.Array:
    """The convolution of a problem that `check` accepted: (N, OH, OW, O) in p.out_dtype."""
    config = resolve_config(p, config)
    if p.depthwise:
        kernel = functools.partial(_depthwise_kernel, p=p, config=config)
        grid = (pl.cdiv(p.m, config.block_m), pl.cdiv(p.o, config.block_n))
    else:
        kernel = functools.partial(_conv_kernel, p=p, config=config, precision=precision)
        grid = (pl.cdiv(p.m, config.block_m), pl.cdiv(p.og, config.block_n), p.groups)
    out = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p.m, p.o), p.out_dtype),
        grid=grid,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        flops=flops_and_bytes(p)[0],
        bytes_accessed=forward_traffic(p, config),
        name="conv2d_depthwise_triton" if p.depthwise else "conv2d_triton",
    )(x.reshape(-1), w.reshape(p.k, p.o))
    return out.reshape(p.n, p.oh, p.ow, p.o)


def _pixel_split(p: Problem, config: Conv2dConfig, split: Split, grid_size: int):
    """(split index, first pixel block, pixel blocks) of this program: grid axis 0 is
    split-major, `grid_size` programs per split."""
    index = pl.program_id(0) // grid_size
    first, count = split.range_of(index, pl.cdiv(p.m, config.block_m))
    return index, first, count


def _weight_grad_kernel(x_ref, dy_ref, dw_ref, *, p: Problem, config: Conv2dConfig,
                        split: Split, precision):
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    num_blocks = num_k_blocks(p, block_k)
    split_index, first, count = _pixel_split(p, config, split, num_blocks)
    k, group = _k_block(p, block_k, pl.program_id(0) % num_blocks), pl.program_id(2)
    col_start = group * p.og + pl.program_id(1) * block_n
    cols_valid = _arange_valid(pl.program_id(1) * block_n, block_n, p.og)

    def step(i, acc):
        m_start = (first + i) * block_m
        pixels = _pixels(p, m_start, block_m)
        patches = _patch_tile(x_ref, p, group, pixels, k)
        dy = _load_2d(dy_ref, m_start, pixels[0], col_start, cols_valid)
        return acc + _dot(patches, dy, p, precision, transpose_a=True)

    acc = int32_loop(count, step, jnp.zeros((block_k, block_n), p.accumulator_dtype))
    _store_2d(dw_ref, acc, split_index * p.k + k.start, k.valid, col_start, cols_valid)


def _depthwise_weight_grad_kernel(x_ref, dy_ref, dw_ref, *, p: Problem, config: Conv2dConfig,
                                  split: Split):
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    num_blocks = num_k_blocks(p, block_k)
    split_index, first, count = _pixel_split(p, config, split, num_blocks)
    first_tap, col_start = (pl.program_id(0) % num_blocks) * block_k, pl.program_id(1) * block_n
    taps = [first_tap + t for t in range(block_k)]
    out_channel = col_start + jnp.arange(block_n, dtype=jnp.int32)
    cols_valid = out_channel < p.o
    in_channel = _input_channel(p, out_channel)[None, :]

    def step(i, accs):
        m_start = (first + i) * block_m
        m_valid, n, oh, ow = _pixels(p, m_start, block_m)
        valid = m_valid[:, None] & cols_valid[None, :]
        dy = _load_2d(dy_ref, m_start, m_valid, col_start, cols_valid).astype(accs[0].dtype)
        return tuple(
            acc + _gather_input(x_ref, p, n[:, None], oh[:, None], ow[:, None],
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
    config = weight_grad_config(p)
    split = weight_grad_split(p, config)
    if p.depthwise:
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
        bytes_accessed=weight_grad_traffic(p, config, dy.dtype, dtype, split.splits),
        name="conv2d_depthwise_weight_grad_triton" if p.depthwise else "conv2d_weight_grad_triton",
    )(x.reshape(-1), dy.reshape(p.m, p.o))
    if split.splits > 1:  # XLA's reduction: a fixed order, the same sum on every run
        dw = dw.reshape(split.splits, p.k, p.o).sum(axis=0).astype(dtype)
    return dw.reshape(p.kh, p.kw, p.cg, p.o)
