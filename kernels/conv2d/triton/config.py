"""How big the Triton conv2d kernels' blocks are, and what they cost (the kernels themselves are
in `forward.py` and `backward.py` beside it): each launch's config (`resolve_config` for the
forward and the input gradient's phases, `weight_grad_config` for dW), the checks that decline a
problem or reject a config, the K blocks of the implicit GEMM (`tap_major`, `num_k_blocks`), the
weight gradient's pixel splits (`weight_grad_split`) and its float32 operands' pixel-major
copies (`pixel_major`), and the loads each launch issues, which its cost estimate states
(`forward_traffic`, `weight_grad_traffic`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from kernels._blocks import (K_MAJOR_MIN_REUSE, MIN_PIPELINED_STEPS, MIN_TRITON_DOT, Split,
                             check_triton_config, fill_sms, max_splits, require_floating,
                             require_int32_offsets, require_shared_memory, split_reduction,
                             tensor_float32, triton_block, triton_dot_shared_bytes)
from kernels._epilogue import require_supported
from kernels._pallas import pl
from kernels.conv2d.common import Conv2dConfig, Problem

__all__ = ["resolve_config", "check", "output_channels", "tap_major", "num_k_blocks",
           "forward_traffic", "PixelMajor", "pixel_major", "weight_grad_config",
           "weight_grad_grid", "weight_grad_split", "weight_grad_traffic"]


def output_channels(p: Problem) -> int:
    """Output channels one program's column blocks cover: all of them (depthwise) or a
    group's."""
    return p.o if p.depthwise else p.og


def resolve_config(p: Problem, config: Conv2dConfig | None) -> Conv2dConfig:
    """Fills unset fields: power-of-2 blocks >= 16 covering the dims up to a cap (64 for
    float64, 128 otherwise; K slices of 64 for 16-bit data), the output tile shrunk until
    every SM has one (`fill_sms`)."""
    config = config or Conv2dConfig()
    wide = p.compute_dtype.itemsize >= 8
    max_mn = 64 if wide else 128
    max_k = 32 if wide or p.compute_dtype.itemsize >= 4 else 64
    def pick(value, default):
        return default if value is None else value

    block_m, block_n = fill_sms(
        triton_block(p.m, max_mn), triton_block(output_channels(p), max_mn),
        lambda rows, cols: pl.cdiv(p.m, rows) * pl.cdiv(output_channels(p), cols) * (
            1 if p.depthwise else p.groups))
    block_m, block_n = pick(config.block_m, block_m), pick(config.block_n, block_n)
    block_k = pick(config.block_k, _default_block_k(p, max_k))
    # The patch gather computes an offset per (pixel, k) element: 128-pixel tiles need 8 warps
    # to hold it without spilling (4 warps spill on sm_80 and sm_90).
    num_warps = pick(config.num_warps, 8 if block_m >= 128 or block_n >= 128 else 4)
    return Conv2dConfig(block_m, block_n, block_k, config.block_rows, num_warps,
                        pick(config.num_stages, 3))


def check(p: Problem, config: Conv2dConfig | None) -> None:
    """Declines non-float operands, an epilogue it cannot apply and int32-overflowing sizes;
    rejects bad configs."""
    require_floating(x=p.x_dtype, w=p.w_dtype)
    require_supported(p.epilogue, p.x_dtype, p.w_dtype, p.out_dtype)
    require_int32_offsets(x=p.n * p.h * p.w * p.c, output=p.m * p.o, w=p.k * p.o)
    config = resolve_config(p, config)
    check_triton_config(config, ("block_m", "block_n", "block_k"))
    if not p.depthwise:
        require_shared_memory(triton_dot_shared_bytes(
            config.block_m, config.block_n, config.block_k,
            max(p.x_dtype.itemsize, p.w_dtype.itemsize), config.num_stages))


def tap_major(p: Problem) -> bool:
    """Whether K blocks stay inside one tap: channel runs of 16 or more (32 bytes of 16-bit
    data) make each block's patch rows contiguous loads. Fewer channels (an RGB stem, small
    groups) would leave most of a per-tap block as padding, so their blocks span taps."""
    return p.cg >= MIN_TRITON_DOT


def num_k_blocks(p: Problem, block_k: int) -> int:
    if tap_major(p):
        return p.kh * p.kw * pl.cdiv(p.cg, block_k)
    return pl.cdiv(p.k, block_k)


def _default_block_k(p: Problem, cap: int) -> int:
    """The K block: tap-major, the power of 2 in [16, cap] that pads a tap's channels least
    (ties to the larger); else the power of 2 covering K, up to `cap`."""
    if not tap_major(p):
        return triton_block(p.k, cap)
    candidates = [b for b in (16, 32, 64, 128) if b <= cap]
    return min(reversed(candidates), key=lambda b: pl.cdiv(p.cg, b) * b)


def _patch_bytes(p: Problem) -> int:
    """Bytes of every output pixel's patch (its taps' input channels): what a pass over the
    implicit-GEMM operand loads, mostly from L1/L2 where neighbouring patches overlap."""
    return p.m * p.kh * p.kw * p.c * p.x_dtype.itemsize


def _patch_passes(p: Problem, config: Conv2dConfig) -> int:
    """How often the patches are loaded: once per output-channel block of a group; depthwise,
    once per output channel of an input channel (the depth multiplier)."""
    return p.og if p.depthwise else pl.cdiv(p.og, config.block_n)


def forward_traffic(p: Problem, config: Conv2dConfig) -> int:
    """Loads the forward's programs issue: the patches (`_patch_passes`), the weights once per
    pixel block, the output (and a saved pre-activation) written once."""
    weight_bytes = p.kh * p.kw * p.cg * p.o * p.w_dtype.itemsize
    return (_patch_bytes(p) * _patch_passes(p, config)
            + weight_bytes * pl.cdiv(p.m, config.block_m)
            + p.m * p.o * p.epilogue.bytes_per_output(p.out_dtype))


def _depthwise_weight_grad_config(p: Problem) -> Conv2dConfig:
    """4 warps; a (block_m, 64) tile that gives each thread one 16-byte vector of input per tap;
    block_k taps per program, as many as keep their float32 accumulators within ~96 registers
    per thread (all 9 of a 3x3; a 7x7's 49 in 5 programs), so dY is read once per tap block
    rather than once per tap."""
    num_warps, block_n = 4, triton_block(p.o, 64)
    per_thread = max(1, 16 // p.x_dtype.itemsize)
    block_m = max(1, per_thread * 32 * num_warps // block_n)
    max_taps = max(1, 96 // (per_thread * p.accumulator_dtype.itemsize // 4))
    block_k = pl.cdiv(p.k, pl.cdiv(p.k, max_taps))
    return Conv2dConfig(block_m, block_n, block_k, None, num_warps, 3)


def weight_grad_config(p: Problem) -> Conv2dConfig:
    """Blocks of the weight gradient: a (block_k, block_n) dW tile of up to 128x128 held in
    registers (8 warps; 4 for 64x64 and smaller), shrunk until every SM has a tile
    (`fill_sms`), and a pixel slice per reduction step sized so that the pipelined patch and
    output-gradient tiles (num_stages of each) stay near 96 KiB of shared memory, inside both
    A100's and H100's limits: 64 pixels of 16-bit data, 32 of 32-bit, 16 of 64-bit. Depthwise:
    see `_depthwise_weight_grad_config`."""
    if p.depthwise:
        return _depthwise_weight_grad_config(p)
    itemsize = p.compute_dtype.itemsize
    block_k, block_n = fill_sms(
        _default_block_k(p, 64 if itemsize >= 8 else 128),
        triton_block(p.og, 64 if itemsize >= 8 else 128),
        lambda rows, cols: math.prod(weight_grad_grid(p, Conv2dConfig(block_k=rows,
                                                                        block_n=cols))))
    block_m = triton_block(p.m, {2: 64, 4: 32, 8: 16}.get(itemsize, 64))
    num_warps = 8 if block_k * block_n > 64 * 64 else 4
    return Conv2dConfig(block_m, block_n, block_k, None, num_warps, 3)


def weight_grad_grid(p: Problem, config: Conv2dConfig) -> tuple[int, int, int]:
    """The grid of one pixel split: (K blocks, output-channel blocks, groups)."""
    return (num_k_blocks(p, config.block_k), pl.cdiv(output_channels(p), config.block_n),
            1 if p.depthwise else p.groups)


class PixelMajor(NamedTuple):
    """The float32 weight gradient's operands copied pixel-major (`pixel_major`), so that both
    are K-major for TF32: the padded input split into its stride phases, each phase a
    (C, rows·cols·N) matrix, and dY laid on the same grid, (O, OH·cols·N) with zero columns
    past OW. Batch is the fastest axis, so the input column that tap (kh, kw) pairs with dY
    column q is q + `shift`: one constant per tap, a multiple of N."""

    rows: int  # rows of one stride phase of the padded input
    cols: int  # its columns: the row pitch of both copies' pixel axes

    def pixels(self, p: Problem) -> int:
        """The GEMM's contraction: dY's columns, OW padded to `cols` in every output row."""
        return p.oh * self.cols * p.n

    def input_elements(self, p: Problem) -> int:
        return p.geometry.stride[0] * p.geometry.stride[1] * p.c * self.rows * self.cols * p.n

    def phase_and_shift(self, p: Problem, kh, kw):
        """The stride phase (a row block of C) and the column shift tap (kh, kw) reads."""
        (sh, sw), (dh, dw) = p.geometry.stride, p.geometry.rhs_dilation
        phase = (kh * dh % sh) * sw + kw * dw % sw
        return phase, ((kh * dh // sh) * self.cols + kw * dw // sw) * p.n


def pixel_major(p: Problem, precision) -> PixelMajor | None:
    """The pixel-major layout of a float32 (TF32) weight gradient, or None where the gathered
    NHWC patches stay: there both dot operands are MN-major (contracted over pixels, channels
    contiguous) and load 4 bytes at a time. Taken where every input element meets at least
    `K_MAJOR_MIN_REUSE` outputs (its group's O/G channels at each of the KH·KW/stride² taps
    that read it) and every dY element too (C/G channels at KH·KW taps), the batch is a
    multiple of 4 (16-byte-aligned tap shifts), K blocks lie in one tap (`tap_major`) and the
    copies stay under 2³¹ elements."""
    g = p.geometry
    if (p.depthwise or not tap_major(p) or p.n % 4
            or not tensor_float32(p.compute_dtype, precision)
            or p.x_dtype.itemsize != 4 or p.w_dtype.itemsize != 4
            or min(p.og * p.kh * p.kw // (g.stride[0] * g.stride[1]), p.cg * p.kh * p.kw)
            < K_MAJOR_MIN_REUSE):
        return None
    layout = PixelMajor(*(pl.cdiv(size + sum(pad), stride) for size, pad, stride
                          in zip((p.h, p.w), g.padding, g.stride)))
    if max(layout.input_elements(p), p.o * layout.pixels(p)) >= 2**31:
        return None
    return layout


def weight_grad_split(p: Problem, config: Conv2dConfig, pixels: int | None = None) -> Split:
    """Pixel splits: at least two waves of programs (`Target.min_programs`) when the dW tiles
    alone leave SMs idle, unless the splits' float32 partials, written and read back, would
    together cost more than half the unsplit kernel's traffic (`weight_grad_traffic`: the
    patches once per output-channel block, dY once per K block, dW written once), the measure
    matmul's split-K uses. Counting x and dY once instead capped ResNet's stride-2 128->256
    layer at 2 splits: 144 programs, a second wave of 12 on an H100, no faster than none.
    `pixels` is the reduction's length: M, or the pixel-major layout's (`PixelMajor.pixels`)."""
    unsplit_traffic = weight_grad_traffic(p, config, p.out_dtype, p.w_dtype, 1, pixels)
    return split_reduction(math.prod(weight_grad_grid(p, config)),
                           pl.cdiv(p.m if pixels is None else pixels, config.block_m),
                           min_steps=MIN_PIPELINED_STEPS,
                           max_splits=max_splits(unsplit_traffic, p.k * p.o * 4))


def weight_grad_traffic(p: Problem, config: Conv2dConfig, dy_dtype, dw_dtype, splits: int,
                        pixels: int | None = None) -> int:
    """Loads the weight gradient's programs issue: the patches (`_patch_passes`), dY's
    `pixels` columns (M, or the pixel-major layout's, zeros included) once per K block (a
    depthwise program's block of taps), and dW written once (float32 partials per pixel split,
    which XLA then reads back, when split)."""
    dw_bytes = p.kh * p.kw * p.cg * p.o
    written = (dw_bytes * jnp.dtype(dw_dtype).itemsize if splits == 1
               else 2 * splits * dw_bytes * 4)
    return (_patch_bytes(p) * _patch_passes(p, config)
            + (p.m if pixels is None else pixels) * p.o * jnp.dtype(dy_dtype).itemsize
            * num_k_blocks(p, config.block_k)
            + written)
